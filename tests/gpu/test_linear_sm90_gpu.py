"""linear_sm90_mma on an H200: every variant of a small problem's space, a covering subset of
the others, the Qwen3-8B shapes; fresh random inputs, NaN-poisoned outputs,
||out - ref|| / ||ref|| <= 3e-3 vs resgen.reference.linear, bit-identical reruns for
deterministic variants, repeated calls (semaphores / workspace reset) and CUDA-graph replay."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from resgen.search import build
from resgen.search.linear_sm90 import FAMILY, LinearSm90Variant, Packing, Pipeline, Reduction
from resgen.search.variant import LinearProblem

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ARCH = "sm_90a"
_COMPILED: dict[tuple[str, str], object] = {}


def _compiled(v: LinearSm90Variant, p: LinearProblem):
    key = (v.key(), FAMILY.compile_key(v, p).key())
    if key not in _COMPILED:
        out = build.compile_variant(FAMILY, v, p, ARCH)
        assert out.ok, out.error
        assert out.spill_bytes == 0
        _COMPILED[key] = out.compiled
    return _COMPILED[key]


def _check_variant(v: LinearSm90Variant, base: LinearProblem, ms=(1, 3), determinism=True):
    assert FAMILY.why_invalid(v, base, ARCH) is None
    fn = _compiled(v, base)
    for m in ms:
        p = dataclasses.replace(base, m=m)
        r = FAMILY.runner(fn, v, p, "cuda", n_sets=1, seed=m)
        for _ in range(2):           # the second call sees the state the first one left
            res = r.check()
            assert res.ok, f"{v.name()} m={m}: {res.detail} (rel {res.rel_err:.3e})"
        if determinism and v.deterministic:
            x = torch.randn(m, p.k, device="cuda")
            a = r.run_on(x)
            b = r.run_on(x)
            torch.cuda.synchronize()
            assert torch.equal(a.view(torch.int16), b.view(torch.int16)), \
                f"{v.name()} m={m}: reruns differ"


def _cover(space):
    """A small subset of `space` in which every (field, value) of the space appears."""
    need = {(f.name, getattr(v, f.name)) for v in space for f in dataclasses.fields(v)}
    chosen = []
    while need:
        best = max(space, key=lambda v: len(need & {(f.name, getattr(v, f.name))
                                                    for f in dataclasses.fields(v)}))
        chosen.append(best)
        need -= {(f.name, getattr(best, f.name)) for f in dataclasses.fields(best)}
    return chosen


SMALL_FULL = LinearProblem("nvfp4", "full", 16, 128, 512)


@pytest.mark.parametrize("v", FAMILY.space(SMALL_FULL, ARCH), ids=lambda v: v.name())
def test_every_variant_small_mext(v):
    _check_variant(v, SMALL_FULL, ms=(1, 16))


COVER_PROBLEMS = [LinearProblem(fmt, comp, 16, 256, 1024)
                  for fmt in ("nvfp4", "mxfp4") for comp in ("none", "full", "0.125", "1.0")]


@pytest.mark.parametrize("p", COVER_PROBLEMS, ids=lambda p: f"{p.fmt}-{p.compensation}")
def test_covering_variants(p):
    for v in _cover(list(FAMILY.space(p, ARCH))):
        _check_variant(v, p, ms=(1, 7, 16))


QWEN = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]


@pytest.mark.parametrize("n, k", QWEN)
@pytest.mark.parametrize("fmt, comp, m", [("nvfp4", "full", 4), ("mxfp4", "none", 1),
                                          ("nvfp4", "none", 16)])
def test_qwen_shapes(n, k, fmt, comp, m):
    p = LinearProblem(fmt, comp, m, n, k)
    nt = min(4, -(-p.rows // 8))
    cands = [FAMILY.default(p, ARCH),
             LinearSm90Variant(warps_m=1, warps_k=4, n_tiles=nt, pipeline=Pipeline.CP_ASYNC,
                               stages=3, split_k=2, reduce=Reduction.WORKSPACE),
             LinearSm90Variant(warps_m=2, warps_k=2, m_tiles=2, n_tiles=nt,
                               pipeline=Pipeline.DIRECT, stages=1, split_k=2,
                               reduce=Reduction.ATOMIC, packing=Packing.NIB),
             LinearSm90Variant(warps_m=4, warps_k=2, n_tiles=nt, pipeline=Pipeline.REGS,
                               stages=1)]
    for v in cands:
        if FAMILY.why_invalid(v, p, ARCH) is None:
            _check_variant(v, p, ms=(m,), determinism=v.reduce == Reduction.WORKSPACE)


def test_cuda_graph_replay_matches_eager():
    p = LinearProblem("nvfp4", "full", 3, 4096, 4096)
    v = LinearSm90Variant(warps_m=1, warps_k=4, pipeline=Pipeline.CP_ASYNC, stages=4,
                          split_k=2, reduce=Reduction.WORKSPACE)
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
        r()
    g.replay()
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(r.out.view(torch.int16), eager.view(torch.int16))


@pytest.mark.parametrize("packing", ["split", "nib"])
def test_subnormal_half_codes_survive_the_bf16_decode(packing):
    """Every weight code is +-0.5 (decoded to the BF16 subnormal 2^-127 before the scale
    multiply): an FTZ anywhere in mul.rn.bf16x2 would zero the output."""
    from resgen import calibrate as C
    from resgen import formats as F
    from resgen import reference
    from resgen.kernels.layouts import prepare_sm90_weight
    from resgen.kernels.linear_sm90 import LinearSm90Launcher, make_xop
    from resgen.search.linear_sm90 import compare, geometry_of

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
