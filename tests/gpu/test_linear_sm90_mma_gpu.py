"""linear_sm90_mma on an H200: a covering subset of the space of small problems (every field value
of the space at least once, both formats, every compensation), the nib / 2-group variants
outside the space, fused quantization at partial tiles and K-Ext (per CTA and shared by a
cluster of 2; a cluster of 4 outside the space), the Qwen3-8B shapes (with bulk-ring variants);
fresh random inputs, NaN-poisoned outputs, ||out - ref|| / ||ref|| <= 3e-3 vs
resgen.reference.linear, bit-identical reruns for deterministic variants, repeated calls
(semaphores / workspace reset),
CUDA-graph replay, and two PDL layers chained through their activations (the second must wait
for the first's output)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from resgen.search import build
from resgen.search.cover import covering_subset
from resgen.search.linear_sm90_mma import (FAMILY, Act, LinearSm90Variant, Packing, Pipeline,
                                           Reduction, geometry_of)
from resgen.search.variant import LinearProblem

from runner_checks import check_runner  # tests/gpu/runner_checks.py

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ARCH = "sm_90a"
_COMPILED: dict[tuple[str, str], object] = {}


def _compiled(v: LinearSm90Variant, p: LinearProblem):
    key = (v.key(), FAMILY.compile_key(v, p).key())
    if key not in _COMPILED:
        out = build.compile_variant(FAMILY, v, p, ARCH)
        assert out.ok, out.error
        # Register-pressure spills are pruned by the predicate's register estimate; ptxas may
        # still park one or two values outside the main loop on the stack to stay at an
        # occupancy step (seen at 64 / 80 registers): at most 16 bytes.
        assert out.spill_bytes <= 16, f"{v.name()}: {out.spill_bytes} bytes of local memory"
        _COMPILED[key] = out.compiled
    return _COMPILED[key]


def _check_variant(v: LinearSm90Variant, base: LinearProblem, ms=(1, 3), determinism=True):
    assert FAMILY.why_invalid(v, base, ARCH) is None, FAMILY.why_invalid(v, base, ARCH)
    for m in ms:
        p = dataclasses.replace(base, m=m)
        # one compile per compile key (all M of an xop variant; M sharing a fused tile size)
        r = FAMILY.runner(_compiled(v, p), v, p, "cuda", n_sets=1, seed=m)
        check_runner(r, v, m, p.k, reruns=determinism)


COVER_PROBLEMS = [LinearProblem(fmt, comp, 16, 256, 1024)
                  for fmt in ("nvfp4", "mxfp4") for comp in ("none", "full", "0.125", "1.0")]


@pytest.mark.parametrize("p", COVER_PROBLEMS, ids=lambda p: f"{p.fmt}-{p.compensation}")
def test_covering_variants(p):
    """m = 16 is the compiled row count (fused tiles); 1 and 7 run the same kernels with
    fewer rows, 40 with more token tiles than compiled for."""
    for v in covering_subset(list(FAMILY.space(p, ARCH))):
        _check_variant(v, p, ms=(1, 7, 16, 40))


OUTSIDE_SPACE = [
    LinearSm90Variant(4, 1, 2, 2, 2, Pipeline.DIRECT, 1, 0, 1, Reduction.NONE, Packing.NIB),
    LinearSm90Variant(2, 2, 1, 2, 2, Pipeline.CP_ASYNC, 2, 0, 2, Reduction.WORKSPACE,
                      Packing.NIB, Act.FUSED, True),
    LinearSm90Variant(1, 4, 4, 1, 1, Pipeline.REGS, 1, 2, 1, Reduction.NONE, Packing.NIB),
    LinearSm90Variant(4, 2, 1, 8, 1, Pipeline.CP_ASYNC, 2, 0, 1, Reduction.NONE),
    # a cluster of 4 CTAs sharing the fused quantization (lost to 1 and 2 on the H200)
    LinearSm90Variant(1, 2, 1, 2, 1, Pipeline.CP_ASYNC, 3, 0, 1, Reduction.NONE, Packing.SPLIT,
                      Act.FUSED, False, 4),
]


@pytest.mark.parametrize("v", OUTSIDE_SPACE, ids=lambda v: v.name())
@pytest.mark.parametrize("comp", ["none", "full"])
def test_variants_outside_the_space(v, comp):
    _check_variant(v, LinearProblem("nvfp4", comp, 16, 256, 2048), ms=(1, 16))


@pytest.mark.parametrize("cluster", [1, 2])
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("comp", ["none", "full", "0.25", "0.5"])
def test_fused_partial_tiles_and_long_k(fmt, comp, cluster):
    """Fused kernels at 1, 3 and 5 tokens (operand tiles of 1/2, 4 and 8 rows; 5 M-Ext tokens
    = 10 rows over two z tiles) with K = 12288 split over CTAs. A kernel compiled for one token
    is refused for three: run that way on the H200 (2026-11-30) it left rows unwritten, since
    the host grid follows the real M while the kernel's tile was sized for one token."""
    p = LinearProblem(fmt, comp, 1, 512, 12288)
    v = LinearSm90Variant(1, 4, 1, 1, 1, Pipeline.CP_ASYNC, 3, 0, 2, Reduction.WORKSPACE,
                          Packing.SPLIT, Act.FUSED, True, cluster)
    if FAMILY.why_invalid(v, p, ARCH) is not None:      # K + ext not split by 2 x 4
        v = dataclasses.replace(v, warps_k=2, split_k=3)
    _check_variant(v, p, ms=(1, 3, 5))
    with pytest.raises(ValueError, match="was compiled for"):
        FAMILY.runner(_compiled(v, p), v, dataclasses.replace(p, m=3), "cuda", n_sets=1)


QWEN = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]


@pytest.mark.parametrize("n, k", QWEN)
@pytest.mark.parametrize("fmt, comp, m", [("nvfp4", "full", 4), ("mxfp4", "0.125", 2)])
def test_qwen_shapes(n, k, fmt, comp, m):
    """The default (xop) and two fused PDL variants per shape; the tuner (resgen tune) checks
    every variant it times on these shapes too."""
    p = LinearProblem(fmt, comp, m, n, k)
    nt = min(4, -(-p.rows // 8))
    cands = [FAMILY.default(p, ARCH),
             LinearSm90Variant(warps_m=1, warps_k=8, n_tiles=nt, pipeline=Pipeline.CP_ASYNC,
                               stages=3, act=Act.FUSED, pdl=True),
             LinearSm90Variant(warps_m=1, warps_k=2, n_tiles=nt, pipeline=Pipeline.DIRECT,
                               stages=1, l2_prefetch=3, split_k=3,
                               reduce=Reduction.WORKSPACE, act=Act.FUSED, pdl=True),
             LinearSm90Variant(warps_m=4, warps_k=2, n_tiles=nt, pipeline=Pipeline.REGS,
                               stages=1, act=Act.FUSED, pdl=True),
             LinearSm90Variant(warps_m=4, warps_k=2, n_tiles=nt, pipeline=Pipeline.REGS,
                               stages=1, act=Act.FUSED, cluster=2),
             # the bulk ring (copy engine + mbarriers), xop and fused + PDL
             LinearSm90Variant(warps_m=4, warps_k=2, n_tiles=nt, pipeline=Pipeline.BULK,
                               stages=4),
             LinearSm90Variant(warps_m=1, warps_k=8, n_tiles=nt, pipeline=Pipeline.BULK,
                               stages=2, act=Act.FUSED, pdl=True)]
    ran = 0
    for v in cands:
        if FAMILY.why_invalid(v, p, ARCH) is None:
            _check_variant(v, p, ms=(m,), determinism=v.reduce != Reduction.ATOMIC)
            ran += 1
    assert ran >= 5           # including the bulk xop variant, valid on every shape


QWEN3_4B_RAGGED = [(2560, 9728), (6144, 2560)]       # 38 and 10 K groups of 256


@pytest.mark.parametrize("n, k", QWEN3_4B_RAGGED)
@pytest.mark.parametrize("fmt, comp", [("nvfp4", "none"), ("nvfp4", "full"),
                                       ("mxfp4", "full"), ("nvfp4", "0.125")])
def test_ragged_k_slices(n, k, fmt, comp):
    """Ragged K slices (a CTA's K groups split unevenly over its warps, the long slices' last
    iteration behind a runtime guard) on Qwen3-4B's down and qkv shapes: every ragged
    pipeline (cp.async ring, bulk ring, direct loads with L2 prefetch), xop and fused + PDL,
    split-K, at 1 and 3 tokens."""
    p = LinearProblem(fmt, comp, 1, n, k)
    cands = [LinearSm90Variant(1, 8, 1, 1, 1, Pipeline.CP_ASYNC, 3, act=Act.FUSED, pdl=True),
             LinearSm90Variant(1, 8, 1, 1, 1, Pipeline.BULK, 2, act=Act.FUSED),
             LinearSm90Variant(1, 4, 1, 1, 1, Pipeline.DIRECT, 1, l2_prefetch=2),
             LinearSm90Variant(2, 4, 1, 1, 1, Pipeline.BULK, 2, pdl=True),
             LinearSm90Variant(1, 4, 1, 1, 1, Pipeline.CP_ASYNC, 2, 0, 2, Reduction.WORKSPACE,
                               act=Act.FUSED)]
    ran = ragged = 0
    for v in cands:
        if FAMILY.why_invalid(v, p, ARCH) is None:
            _check_variant(v, p, ms=(1, 3))
            ran += 1
            ragged += geometry_of(v, p).ragged
    assert ran >= 4 and ragged >= 3


@pytest.mark.parametrize("pipe", [(Pipeline.CP_ASYNC, 3), (Pipeline.BULK, 2)],
                         ids=lambda x: f"{x[0].value}{x[1]}")
@pytest.mark.parametrize("pdl", [False, True])
def test_cuda_graph_replay_matches_eager(pdl, pipe):
    p = LinearProblem("nvfp4", "full", 3, 4096, 4096)
    v = LinearSm90Variant(warps_m=1, warps_k=4, pipeline=pipe[0], stages=pipe[1],
                          split_k=2, reduce=Reduction.WORKSPACE, act=Act.FUSED, pdl=pdl)
    r = FAMILY.runner(_compiled(v, p), v, p, "cuda", n_sets=2, seed=0)
    r.rotate(1)
    eager = r().clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        r()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    r.out.fill_(float("nan"))
    with torch.cuda.graph(g):
        for i in range(4):
            r.rotate(i)
            r()
    g.replay()
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(r.out.view(torch.int16), eager.view(torch.int16))


@pytest.mark.parametrize("graph", [False, True])
def test_pdl_layers_chained_through_activations(graph):
    """Layer 2 (fused, PDL) quantizes layer 1's BF16 output. Layer 1 lets it launch at its
    own start; layer 2 must still read x only after griddepcontrol.wait. Any early read shows
    up as a mismatch with the same two layers run with a synchronize in between."""
    from resgen.kernels.linear_sm90_mma import LinearSm90Launcher
    from resgen.search.linear_sm90_mma import geometry_of, random_layer

    m, d = 4, 4096
    gen = torch.Generator(device="cuda").manual_seed(5)
    p1 = LinearProblem("nvfp4", "none", m, d, d)
    p2 = LinearProblem("nvfp4", "full", m, d, d)
    v1 = LinearSm90Variant(1, 8, 1, 1, 1, Pipeline.CP_ASYNC, 3, 0, 1, Reduction.NONE,
                           Packing.SPLIT, Act.FUSED, True)
    v2 = LinearSm90Variant(2, 4, 1, 1, 1, Pipeline.DIRECT, 1, 4, 1, Reduction.NONE,
                           Packing.SPLIT, Act.FUSED, True)
    from resgen.kernels.sm90_fp4_layout import prepare_sm90_weight

    q1, q2 = random_layer(p1, "cuda", gen), random_layer(p2, "cuda", gen)
    w1, w2 = prepare_sm90_weight(q1, "split"), prepare_sm90_weight(q2, "split")
    l1 = LinearSm90Launcher(_compiled(v1, p1), geometry_of(v1, p1), 0, 0, "cuda")
    l2 = LinearSm90Launcher(_compiled(v2, p2), geometry_of(v2, p2), 0, 0, "cuda")
    a1 = torch.as_tensor(q1.input_scale, dtype=torch.float32, device="cuda").reshape(1)
    a2 = torch.as_tensor(q2.input_scale, dtype=torch.float32, device="cuda").reshape(1)
    xs = [(torch.randn(m, d, generator=gen, device="cuda")).to(torch.bfloat16)
          for _ in range(3)]
    h = torch.empty(m, d, dtype=torch.bfloat16, device="cuda")
    ys = [torch.empty(m, d, dtype=torch.bfloat16, device="cuda") for _ in xs]

    def chain():
        for x, y in zip(xs, ys):
            l1(w1, x, m, m, a1, h)          # h is rewritten while the next l2 may be waiting
            l2(w2, h, m, 2 * m, a2, y)

    want = []
    for x in xs:
        hh = torch.empty_like(h)
        l1(w1, x, m, m, a1, hh)
        torch.cuda.synchronize()
        yy = torch.empty_like(h)
        l2(w2, hh, m, 2 * m, a2, yy)
        torch.cuda.synchronize()
        want.append(yy)
    if graph:
        chain()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            chain()
        for y in ys:
            y.fill_(float("nan"))
        for _ in range(5):
            g.replay()
    else:
        for _ in range(5):
            chain()
    torch.cuda.synchronize()
    for y, w in zip(ys, want):
        assert torch.equal(y.view(torch.int16), w.view(torch.int16))


@pytest.mark.parametrize("packing", ["split", "nib"])
def test_subnormal_half_codes_survive_the_bf16_decode(packing):
    """Every weight code is +-0.5 (decoded to the BF16 subnormal 2^-127 before the scale
    multiply): an FTZ anywhere in mul.rn.bf16x2 would zero the output."""
    from resgen import calibrate as C
    from resgen import formats as F
    from resgen import reference
    from resgen.kernels.sm90_fp4_layout import prepare_sm90_weight
    from resgen.kernels.linear_sm90_mma import LinearSm90Launcher
    from resgen.kernels.sm90_operand import make_xop
    from resgen.search.linear_sm90_mma import compare, geometry_of

    n, k, m = 128, 512, 4
    g = torch.Generator().manual_seed(0)
    codes = torch.where(torch.rand(n, k, generator=g) < 0.5, 1, 9).to(torch.uint8)
    q = F.QuantizedTensor("nvfp4", F.pack_fp4(codes),
                          torch.full((n, k // 16), 2.0).to(torch.float8_e4m3fn),
                          torch.tensor(0.5))
    qw = C.QLinearWeight(q.to("cuda"), k)
    p = LinearProblem("nvfp4", "none", m, n, k, static_scale=False)
    v = dataclasses.replace(FAMILY.default(p, ARCH), packing=Packing(packing))
    geom = geometry_of(v, p)
    wt = prepare_sm90_weight(qw, packing)
    x = torch.randn(m, k, device="cuda")
    xop, ax = make_xop(x, qw, "none", t_multiple=geom.tok)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    LinearSm90Launcher(_compiled(v, p), geom, 0, 0, "cuda")(wt, xop, m, m, ax, out)
    torch.cuda.synchronize()
    res = compare(out, reference.linear(x, qw, "none"))
    assert res.ok, f"{res.detail}: rel err {res.rel_err:.3e} (1.0 means the 0.5 codes vanished)"
