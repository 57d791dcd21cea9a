"""linear_sm90_wgmma on an H200: every variant of a small problem's space, a covering subset for
both formats and every compensation mode, the Qwen3-8B shapes at prefill sizes, the whole
layer behind the fused quantizer, CUDA-graph replay; fresh random inputs, NaN-poisoned outputs,
||out - ref|| / ||ref|| <= 3e-3 vs resgen.reference.linear, bit-identical reruns."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from resgen.search.cover import covering_subset
from resgen.search.linear_sm90_mma import Packing
from resgen.search.linear_sm90_wgmma import (FAMILY, LinearSm90WgmmaVariant, Raster,
                                             compile_once)
from resgen.search.variant import LinearProblem

# tests/gpu/runner_checks.py
from runner_checks import (check_graph_replay, check_layer_graph_behind_the_quantizer,
                           check_runner)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ARCH = "sm_90a"


def _compiled(v: LinearSm90WgmmaVariant, p: LinearProblem):
    out = compile_once(v, p, ARCH)            # shared with bench/gpu_prefill_check.py
    assert out.ok, out.error
    assert out.spill_bytes == 0
    return out.compiled


def _check_variant(v: LinearSm90WgmmaVariant, base: LinearProblem, ms=(1, 37)):
    assert FAMILY.why_invalid(v, base, ARCH) is None
    fn = _compiled(v, base)
    for m in ms:
        p = dataclasses.replace(base, m=m)
        r = FAMILY.runner(fn, v, p, "cuda", n_sets=1, seed=m)
        check_runner(r, v, m, p.k)           # wgmma variants are all deterministic


SMALL_FULL = LinearProblem("nvfp4", "full", 40, 256, 256)


@pytest.mark.parametrize("v", FAMILY.space(SMALL_FULL, ARCH), ids=lambda v: v.name())
def test_every_variant_small_mext(v):
    _check_variant(v, SMALL_FULL, ms=(1, 40, 77))


COVER_PROBLEMS = [LinearProblem(fmt, comp, 64, 512, 1024)
                  for fmt in ("nvfp4", "mxfp4")
                  for comp in ("none", "full", "0.125", "0.25", "0.5", "1.0")]


@pytest.mark.parametrize("p", COVER_PROBLEMS, ids=lambda p: f"{p.fmt}-{p.compensation}")
def test_covering_variants(p):
    for v in covering_subset(list(FAMILY.space(p, ARCH))):
        _check_variant(v, p, ms=(3, 64, 200))


QWEN = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]


@pytest.mark.parametrize("n, k", QWEN)
@pytest.mark.parametrize("fmt, comp, m", [("nvfp4", "none", 1024), ("nvfp4", "full", 300),
                                          ("mxfp4", "0.25", 129), ("nvfp4", "1.0", 256)])
def test_qwen_shapes(n, k, fmt, comp, m):
    p = LinearProblem(fmt, comp, m, n, k)
    cands = [FAMILY.default(p, ARCH), LinearSm90WgmmaVariant(2, 1, 256, 4),
             LinearSm90WgmmaVariant(1, 2, 128, 6, Raster.CH, Packing.NIB)]
    for v in cands:
        if FAMILY.why_invalid(v, p, ARCH) is None:
            _check_variant(v, p, ms=(m,))


SPLIT_CASES = [(4096, 12288, "nvfp4", "full", 16), (4096, 4096, "nvfp4", "none", 64),
               (6144, 4096, "mxfp4", "full", 32), (24576, 4096, "nvfp4", "none", 128)]


@pytest.mark.parametrize("n, k, fmt, comp, m", SPLIT_CASES)
def test_qwen_decode_split_k(n, k, fmt, comp, m):
    """The two split-K variants the prior ranks first on Qwen3-8B shapes at decode / mid-size
    M: checked twice (the semaphores must be back at zero), bit-identical reruns (the slices
    are summed in split order whichever CTA arrives last), M values around the token tile."""
    p = LinearProblem(fmt, comp, m, n, k)
    split = [v for v in sorted(FAMILY.space(p, ARCH), key=lambda v: FAMILY.prior(v, p))
             if v.split_k > 1][:2]
    assert split, "no split-K candidate"
    for v in split:
        _check_variant(v, p, ms=(1, m, m + 3))


def test_split_k_graph_replay_and_semaphores_reset():
    p = LinearProblem("nvfp4", "full", 16, 4096, 12288)
    v = LinearSm90WgmmaVariant(2, 1, 32, 6, Raster.TOK, Packing.SPLIT, 4)
    check_graph_replay(FAMILY.runner(_compiled(v, p), v, p, "cuda", n_sets=2, seed=0))


@pytest.mark.parametrize("fmt, comp", [("nvfp4", "none"), ("nvfp4", "full"),
                                       ("nvfp4", "0.25"), ("mxfp4", "full"),
                                       ("mxfp4", "0.125")])
def test_whole_layer_behind_the_quantizer(fmt, comp):
    """quant_sm90 (xop only, kp_align 256) + the GEMM on bf16 activations vs the reference."""
    from resgen.kernels.quant_sm90 import QuantConfig, compile_config

    p = LinearProblem(fmt, comp, 100, 1024, 2048)
    v = FAMILY.default(p, ARCH)
    alpha = "none" if fmt == "mxfp4" else "static"
    layout = "row_pair" if comp == "full" else "plain"
    qk = compile_config(QuantConfig(fmt, comp, p.k, layout, write_codes=False, write_xop=True,
                                    alpha=alpha, kp_align=256))[0]
    r = FAMILY.runner(_compiled(v, p), v, p, "cuda", n_sets=1, seed=0)
    r.attach_quantizer(qk)
    for _ in range(2):
        res = r.check_quantized()
        assert res.ok, f"{comp}: {res.detail} (rel {res.rel_err:.3e})"


@pytest.mark.parametrize("comp, split", [("none", 1), ("full", 2)])
def test_pdl_behind_the_quantizer_eager_and_graph(comp, split):
    """PDL variants launched right behind quant_sm90 (which triggers its dependents at once):
    the whole layer checked twice, then replayed in a CUDA graph (where the programmatic edge
    lets the GEMM start during the quantizer) and compared with an eager run bit for bit."""
    from resgen.kernels.quant_sm90 import QuantConfig, compile_config

    p = LinearProblem("nvfp4", comp, 24, 4096, 4096)
    v = LinearSm90WgmmaVariant(1, 1, 32 if comp == "none" else 64, 6, Raster.TOK,
                               Packing.SPLIT, split, True)
    assert FAMILY.why_invalid(v, p, ARCH) is None
    layout = "row_pair" if comp == "full" else "plain"
    qk = compile_config(QuantConfig("nvfp4", comp, p.k, layout, write_codes=False,
                                    write_xop=True, alpha="static", kp_align=256))[0]
    r = FAMILY.runner(_compiled(v, p), v, p, "cuda", n_sets=2, seed=0)
    r.attach_quantizer(qk)
    check_layer_graph_behind_the_quantizer(r)


def test_cuda_graph_replay_matches_eager():
    p = LinearProblem("nvfp4", "full", 333, 4096, 4096)
    v = LinearSm90WgmmaVariant(2, 1, 128, 4)
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
    """Every weight code is +-0.5 (the BF16 subnormal 2^-127 before the scale multiply): an
    FTZ anywhere in mul.rn.bf16x2 would zero the output."""
    from resgen import calibrate as C
    from resgen import formats as F
    from resgen import reference
    from resgen.kernels.sm90_operand import make_xop
    from resgen.kernels.linear_sm90_wgmma import WgmmaLauncher
    from resgen.kernels.linear_sm90_wgmma_layout import prepare_wgmma_weight
    from resgen.search.linear_sm90_mma import compare
    from resgen.search.linear_sm90_wgmma import geometry_of

    n, k, m = 128, 512, 4
    g = torch.Generator().manual_seed(0)
    codes = torch.where(torch.rand(n, k, generator=g) < 0.5, 1, 9).to(torch.uint8)
    q = F.QuantizedTensor("nvfp4", F.pack_fp4(codes),
                          torch.full((n, k // 16), 2.0).to(torch.float8_e4m3fn),
                          torch.tensor(0.5))
    qw = C.QLinearWeight(q.to("cuda"), k)
    p = LinearProblem("nvfp4", "none", m, n, k, static_scale=False)
    v = dataclasses.replace(FAMILY.default(p, ARCH), packing=Packing(packing))
    wt = prepare_wgmma_weight(qw, packing)
    x = torch.randn(m, k, device="cuda")
    xop, ax = make_xop(x, qw, "none")
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    WgmmaLauncher(_compiled(v, p), geometry_of(v, p), "cuda")(wt, xop, m, m, ax, out)
    torch.cuda.synchronize()
    res = compare(out, reference.linear(x, qw, "none"))
    assert res.ok, f"{res.detail}: rel err {res.rel_err:.3e} (1.0 means the 0.5 codes vanished)"
