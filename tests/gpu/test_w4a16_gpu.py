"""W4A16 on an H200 with the real kernels (the plain W4A4 kernels on BF16 activations,
alpha_x = 1): Qwen3-8B layer shapes, NVFP4 / MXFP4, both linear families (pinned variants
covering the pipelines, split-K and PDL, plus the dispatched one), M = 1 .. 100 (in place and
through the padding copy); fresh random activations vs resgen.reference.linear_w4a16
(||out - ref|| / ||ref|| <= 3e-3, no NaN) into NaN-poisoned outputs, the activations left
untouched, bit-identical reruns, a CUDA graph of warmed-up plans replaying like eager, and
FP4Linear's kernels backend. CPU half: tests/test_w4a16.py."""

from __future__ import annotations

import pytest
import torch

from resgen import calibrate as C
from resgen import reference as R
from resgen.ops import Linear
from resgen.search import linear_sm90 as LS
from resgen.search import linear_sm90_wgmma as LW
from resgen.search.sm90_linear import TOLERANCE
from resgen.search.variant import LinearProblem

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ARCH = "sm_90a"
SHAPES = ((6144, 4096), (4096, 12288))          # Qwen3-8B qkv, down
MS = (1, 3, 16, 64, 100)

# (family, variant) pinned across the pipelines and reductions; each valid for both shapes
VARIANTS = [
    LS.LinearSm90Variant(warps_m=1, warps_k=8, stages=3),                       # cp.async ring
    LS.LinearSm90Variant(warps_m=4, warps_k=2, pipeline=LS.Pipeline.BULK, stages=2, pdl=True),
    LS.LinearSm90Variant(warps_m=2, warps_k=4, pipeline=LS.Pipeline.DIRECT, stages=1,
                         l2_prefetch=2, split_k=2, reduce=LS.Reduction.WORKSPACE),
    LS.LinearSm90Variant(warps_m=4, warps_k=2, pipeline=LS.Pipeline.REGS, stages=1,
                         n_tiles=2, split_k=2, reduce=LS.Reduction.ATOMIC),
    LW.LinearSm90WgmmaVariant(2, 1, 128, 6),
    LW.LinearSm90WgmmaVariant(1, 1, 32, 8, split_k=4, pdl=True),
    LW.LinearSm90WgmmaVariant(1, 2, 64, 4, LW.Raster.CH, LS.Packing.NIB, 2),
]


def _qweight(fmt, n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.exp(0.5 * torch.randn(n, 1, generator=g))
    isc = torch.tensor(4.0 / (6 * 448)) if fmt == "nvfp4" else None
    return C.prepare_weight(w, fmt, input_scale=isc)


def _rel(y, ref):
    return float((y.float() - ref).norm() / ref.norm())


@pytest.mark.parametrize("v", VARIANTS, ids=lambda v: v.name())
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("n, k", SHAPES)
def test_pinned_variants_compute_w4a16(v, fmt, n, k):
    fam = LS.FAMILY if v.FAMILY == LS.FAMILY.NAME else LW.FAMILY
    qw = _qweight(fmt, n, k)
    layer = Linear(qw, "w4a16", variant=v)
    g = torch.Generator(device="cuda").manual_seed(n + k)
    for m in MS:
        p = LinearProblem(fmt, "w4a16", m, n, k)
        assert fam.why_invalid(v, p, ARCH) is None, (v.name(), p.key())
        plan = layer.plan(m)
        x = (torch.randn(m, k, generator=g, device="cuda") * 3).to(torch.bfloat16)
        x0 = x.clone()
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        plan.run(x, out)
        torch.cuda.synchronize()
        ref = R.linear_w4a16(x.float(), qw)
        assert not bool(out.isnan().any()), (v.name(), m)
        err = _rel(out, ref)
        assert err <= TOLERANCE, (v.name(), m, err)
        assert torch.equal(x.view(torch.int16), x0.view(torch.int16))   # input untouched
        again = torch.full_like(out, float("nan"))
        plan.run(x, again)
        if v.deterministic:
            assert torch.equal(out.view(torch.int16), again.view(torch.int16)), (v.name(), m)
        # the mode really differs from W4A4 on these inputs
        assert _rel(R.linear(x.float(), qw, "none"), ref) > 5 * TOLERANCE


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_dispatched_w4a16_layer(fmt):
    qw = _qweight(fmt, 24576, 4096)                 # gate_up
    layer = Linear(qw, "w4a16")
    for m in (1, 16, 128):
        x = torch.randn(m, 4096, device="cuda").to(torch.bfloat16)
        y = layer(x)
        assert not getattr(layer.plan(m).variant, "fused", False)
        assert _rel(y, R.linear_w4a16(x.float(), qw)) <= TOLERANCE, layer.plan(m).variant.name()


def test_w4a16_graph_replays_like_eager():
    qw = _qweight("nvfp4", 4096, 4096)
    layers = [Linear(qw, "w4a16", variant=VARIANTS[0]), Linear(qw, "w4a16", variant=VARIANTS[4])]
    ms = (1, 8, 64)
    for layer in layers:
        layer.warmup(ms)
    xs = [torch.randn(m, 4096, device="cuda").to(torch.bfloat16) for m in ms]
    eager = [layer(x).clone() for layer in layers for x in xs]
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [layer(x) for layer in layers for x in xs]
    for o in outs:
        o.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    for o, e in zip(outs, eager):
        assert torch.equal(o.view(torch.int16), e.view(torch.int16))


def test_fp4linear_w4a16_on_the_gpu():
    from resgen.ops import FP4Linear

    torch.manual_seed(0)
    lin = torch.nn.Linear(4096, 6144, bias=True, device="cuda")
    mod = FP4Linear.from_linear(lin, "nvfp4", "w4a16")
    x = torch.randn(4, 4096, device="cuda")
    y = mod(x)
    ref = R.linear_w4a16(x.to(torch.bfloat16).float(), mod.op.qweight) + lin.bias.detach()
    assert y.dtype == torch.float32 and _rel(y, ref) <= TOLERANCE
