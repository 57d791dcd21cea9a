"""W4A16 on an H200 with the real kernels (the plain W4A4 kernels on BF16 activations,
alpha_x = 1): Qwen3-8B layer shapes, NVFP4 / MXFP4, both linear families (pinned variants
covering the pipelines, split-K and PDL, plus the dispatched one), M = 1 .. 100 (in place and
through the padding copy); fresh random activations vs resgen.reference.linear_w4a16
(||out - ref|| / ||ref|| <= 3e-3, no NaN) into NaN-poisoned outputs, the activations left
untouched, bit-identical reruns, a CUDA graph of warmed-up plans replaying like eager, and
FP4Linear's kernels backend.

Fused W4A16 (linear_sm90_mma's fused variants with the copy prologue, operand "copy"): the
four Qwen3-8B shapes (N x K = 6144x4096, 4096x4096, 24576x4096, 4096x12288; MXFP4 on two) at
M = 1, 3, 8, pinned variants covering the pipelines, clusters of 2, split-K (workspace and
atomic) and PDL plus the space's first fused variant by the prior, each behind the real launch
path (resgen.ops.Linear: one launch, no operand stage) with the checks above; the same tiles'
xop twin bit for bit; the tuner's runner check; a CUDA graph. CPU half: tests/test_w4a16.py.

    python -m pytest -q tests/gpu/test_w4a16_gpu.py            # on the H200 (a few minutes)
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from resgen import calibrate as C
from resgen import reference as R
from resgen.ops import Linear
from resgen.search import linear_sm90_mma as LS
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
        plan = layer.plan(m)
        fam = LS.FAMILY if plan.variant.FAMILY == LS.FAMILY.NAME else LW.FAMILY
        assert fam.why_invalid(plan.variant, plan.problem, ARCH) is None
        assert _rel(y, R.linear_w4a16(x.float(), qw)) <= TOLERANCE, plan.variant.name()


def _assert_graph_replays_like_eager(layers: list, ms) -> None:
    """Every layer at every M (K = 4096), warmed up, then captured in one CUDA graph: the
    replay, into NaN-poisoned outputs, equals the eager calls bit for bit."""
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


def test_w4a16_graph_replays_like_eager():
    qw = _qweight("nvfp4", 4096, 4096)
    layers = [Linear(qw, "w4a16", variant=VARIANTS[0]), Linear(qw, "w4a16", variant=VARIANTS[4])]
    _assert_graph_replays_like_eager(layers, (1, 8, 64))


def test_fp4linear_w4a16_on_the_gpu():
    from resgen.ops import FP4Linear

    torch.manual_seed(0)
    lin = torch.nn.Linear(4096, 6144, bias=True, device="cuda")
    mod = FP4Linear.from_linear(lin, "nvfp4", "w4a16")
    x = torch.randn(4, 4096, device="cuda")
    y = mod(x)
    ref = R.linear_w4a16(x.to(torch.bfloat16).float(), mod.op.qweight) + lin.bias.detach()
    assert y.dtype == torch.float32 and _rel(y, ref) <= TOLERANCE


# ----------------------------------------------------------------------------- fused W4A16

QWEN_SHAPES = ((6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288))
FUSED_MS = (1, 3, 8)
_FU = dict(act=LS.Act.FUSED)
FUSED_VARIANTS = [
    LS.LinearSm90Variant(warps_m=1, warps_k=8, stages=3, **_FU),                # cp.async ring
    LS.LinearSm90Variant(warps_m=4, warps_k=2, pipeline=LS.Pipeline.BULK, stages=2, pdl=True,
                         **_FU),
    LS.LinearSm90Variant(warps_m=4, warps_k=2, pipeline=LS.Pipeline.REGS, stages=1, cluster=2,
                         **_FU),
    LS.LinearSm90Variant(warps_m=2, warps_k=4, pipeline=LS.Pipeline.DIRECT, stages=1,
                         l2_prefetch=2, split_k=2, reduce=LS.Reduction.WORKSPACE, cluster=2,
                         pdl=True, **_FU),
    LS.LinearSm90Variant(warps_m=1, warps_k=8, stages=2, split_k=2,
                         reduce=LS.Reduction.ATOMIC, **_FU),
]


def _fused_cases(fmt, n, k, m):
    """The pinned fused variants valid for the problem (the others are outside the space: a
    tile past shared memory at K = 12288, say), then the space's first fused variant by the
    prior (what the tuner times first)."""
    p = LinearProblem(fmt, "w4a16", m, n, k)
    vs = [v for v in FUSED_VARIANTS if LS.FAMILY.why_invalid(v, p, ARCH) is None]
    fused = [v for v in LS.FAMILY.space(p, ARCH) if v.fused]
    vs.append(min(fused, key=lambda v: LS.FAMILY.prior(v, p)))
    return p, list(dict.fromkeys(vs))


def _check_plan(layer, m, k, qw, g):
    """One call of the layer's plan for m rows: NaN-poisoned output, reference, input
    untouched, a bit-identical rerun (deterministic variants). Returns the output."""
    plan = layer.plan(m)
    x = (torch.randn(m, k, generator=g, device="cuda") * 3).to(torch.bfloat16)
    x0 = x.clone()
    out = torch.full((m, qw.out_features), float("nan"), dtype=torch.bfloat16, device="cuda")
    plan.run(x, out)
    torch.cuda.synchronize()
    name = plan.variant.name()
    ref = R.linear_w4a16(x.float(), qw)
    assert not bool(out.isnan().any()), (name, m)
    err = _rel(out, ref)
    assert err <= TOLERANCE, (name, m, err)
    assert torch.equal(x.view(torch.int16), x0.view(torch.int16))
    again = torch.full_like(out, float("nan"))
    plan.run(x, again)
    torch.cuda.synchronize()
    if plan.variant.deterministic:
        assert torch.equal(out.view(torch.int16), again.view(torch.int16)), (name, m)
    else:
        assert _rel(again, ref) <= TOLERANCE, (name, m)
    assert _rel(R.linear(x.float(), qw, "none"), ref) > 5 * TOLERANCE
    return out


@pytest.mark.parametrize("fmt, n, k", [("nvfp4", n, k) for n, k in QWEN_SHAPES]
                         + [("mxfp4", n, k) for n, k in SHAPES])
def test_fused_variants_compute_w4a16_in_one_launch(fmt, n, k):
    qw = _qweight(fmt, n, k)
    g = torch.Generator(device="cuda").manual_seed(3 * n + k)
    ran = set()
    for m in FUSED_MS:
        p, vs = _fused_cases(fmt, n, k, m)
        assert len(vs) >= 2, (p.key(), [v.name() for v in vs])
        for v in vs:
            layer = Linear(qw, "w4a16", variant=v)
            run = layer.plan(m).run
            # one launch: the kernel reads the caller's activations, nothing in front
            assert run.fused and run.stage is None and run.quantizer is None
            _check_plan(layer, m, k, qw, g)
            ran.add(v)
    # every pinned axis value ran on this shape except where the space has no room for it
    assert ran & set(FUSED_VARIANTS)


@pytest.mark.parametrize("n, k", QWEN_SHAPES)
def test_fused_w4a16_equals_its_xop_twin_bit_for_bit(n, k):
    """The copy prologue's operand tile is exactly the zero-padded operand the xop twin (same
    tiles, same FP32 summation order) reads from global memory: identical bits."""
    qw = _qweight("nvfp4", n, k, seed=1)
    v = FUSED_VARIANTS[0]
    twin = dataclasses.replace(v, act=LS.Act.XOP)
    fused, xop = Linear(qw, "w4a16", variant=v), Linear(qw, "w4a16", variant=twin)
    for m in FUSED_MS:
        if LS.FAMILY.why_invalid(v, LinearProblem("nvfp4", "w4a16", m, n, k), ARCH):
            continue          # (K = 12288, 8 rows: the tile and the ring exceed shared memory)
        x = (torch.randn(m, k, device="cuda") * 3).to(torch.bfloat16)
        a = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        b = torch.full_like(a, float("nan"))
        fused.plan(m).run(x, a)
        xop.plan(m).run(x, b)
        torch.cuda.synchronize()
        assert not bool(a.isnan().any())
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), (n, k, m)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_the_tuners_runner_checks_fused_w4a16(fmt):
    """What the tuner times: Sm90LinearRunner's check (fresh inputs, poisoned output, against
    linear_w4a16) and a timed call of each input set."""
    from resgen.ops.common import compile_cached

    p = LinearProblem(fmt, "w4a16", 1, 6144, 4096)
    v = FUSED_VARIANTS[1]
    r = LS.FAMILY.runner(compile_cached(LS.FAMILY, v, p, ARCH), v, p, "cuda", n_sets=3)
    res = r.check()
    assert res.ok, res.detail
    for i in range(3):
        r.rotate(i)
        y = r().clone()
        torch.cuda.synchronize()
        assert _rel(y, R.linear_w4a16(r.xbs[i].float(), r.sets[i][0])) <= TOLERANCE


def test_fused_w4a16_graph_replays_like_eager():
    qw = _qweight("nvfp4", 4096, 4096)
    layers = [Linear(qw, "w4a16", variant=FUSED_VARIANTS[0]),
              Linear(qw, "w4a16", variant=FUSED_VARIANTS[3])]
    _assert_graph_replays_like_eager(layers, FUSED_MS)
