"""linear_sm90_mma's presum fold on an H200 (issue 20 section 1): Qwen3-8B's four projections,
NVFP4 M-Ext (the only combination presum runs: MXFP4 and fused are refused, checked below),
M = 1, 16, 64, 128. Each variant is the space's first presum variant by the prior for its M
and, for the same tiles, the default's presum twin; the runner's check (the GEMM alone on a
torch-built operand, make_presum_xop, then the whole layer behind the real quant_sm90
quantizer in layout "presum") compares against reference.linear(fold="presum") AND the exact
fold's reference at 3e-3, on fresh random inputs, NaN-poisoned outputs, twice (state left by a
call), then bit-identical reruns. A hand-made FP16 operand that BF16 cannot hold shows the
kernel reads the quantizer's sums exactly. Also: CUDA-graph replay of a bound presum layer."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

from resgen import calibrate as C
from resgen.search.linear_sm90_mma import (FAMILY, PRESUM_NVFP4_ONLY, PRESUM_XOP_ONLY, Act, Fold,
                                           LinearSm90Variant, Pipeline, geometry_of)
from resgen.search.variant import LinearProblem

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_linear_sm90_mma_gpu import _compiled  # noqa: E402  (one compile cache for both files)

from runner_checks import check_runner  # tests/gpu/runner_checks.py

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ARCH = "sm_90a"
QWEN3_8B = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]
MS = (1, 16, 64, 128)


def _variants(p: LinearProblem) -> list[LinearSm90Variant]:
    """The prior's first presum variant of the space, and the default's presum twin."""
    space = [v for v in FAMILY.space(p, ARCH) if v.presum]
    assert space, "no presum variant in the NVFP4 M-Ext space"
    best = min(space, key=lambda v: FAMILY.prior(v, p))
    twin = dataclasses.replace(FAMILY.default(p, ARCH), fold=Fold.PRESUM)
    return list(dict.fromkeys([best, twin]))


@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("n, k", QWEN3_8B, ids=lambda s: str(s))
def test_presum_qwen3_8b(n, k, m):
    p = LinearProblem("nvfp4", "full", m, n, k)
    for v in _variants(p):
        assert FAMILY.why_invalid(v, p, ARCH) is None, FAMILY.why_invalid(v, p, ARCH)
        r = FAMILY.runner(_compiled(v, p), v, p, "cuda", n_sets=1, seed=m)
        r.as_layer()                       # the real quant_sm90 quantizer in front
        check_runner(r, v, m, k)


def test_presum_is_refused_where_it_cannot_run():
    v = LinearSm90Variant(warps_m=1, warps_k=8, stages=3, fold=Fold.PRESUM)
    assert FAMILY.why_invalid(v, LinearProblem("mxfp4", "full", 16, 4096, 4096),
                              ARCH) == PRESUM_NVFP4_ONLY
    assert FAMILY.why_invalid(dataclasses.replace(v, act=Act.FUSED),
                              LinearProblem("nvfp4", "full", 1, 4096, 4096),
                              ARCH) == PRESUM_XOP_ONLY


def test_presum_reads_the_fp16_rows_exactly_on_the_gpu():
    """The quantizer's FP16 sums are read as they are: token 0's operand (1 + 2^-10, -1) is
    exact in FP16, not in BF16, so on a weight of equal values the kernel gives c 2^-10
    (reading it as BF16 would give 0); token 1 an ordinary value. Against the float64 product
    of the same operand and the FP16-exact weight."""
    from resgen import formats as F

    n, k = 64, 256
    qw = C.prepare_weight(torch.ones(n, k), "nvfp4")
    p = LinearProblem("nvfp4", "full", 2, n, k)
    v = LinearSm90Variant(warps_m=4, warps_k=1, pipeline=Pipeline.DIRECT, stages=1,
                          fold=Fold.PRESUM)
    g = geometry_of(v, p)
    launch = FAMILY.launcher(_compiled(v, p), v, p, "cuda")
    wt = FAMILY.layout(qw, "split")
    wt = dataclasses.replace(wt, **{f.name: getattr(wt, f.name).cuda()
                                    for f in dataclasses.fields(wt)
                                    if isinstance(getattr(wt, f.name), torch.Tensor)})
    xop = torch.zeros(g.tok, 256, dtype=torch.float16)
    xop[0, 0], xop[0, 1] = 1.0 + 2.0 ** -10, -1.0
    xop[1, 5] = 1.0 + 2.0 ** -9
    ax = torch.ones(1)
    out = torch.full((2, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    launch(wt, xop.cuda(), 2, 2, ax.cuda(), out)
    torch.cuda.synchronize()
    w16 = F.presum_weight(F.dequantize(qw.q, apply_global_scale=False), "nvfp4").double()
    want = (xop[:2, :k].double() @ w16.T) * float(qw.q.global_scale)
    assert g.fold == "presum"
    assert torch.equal(out.cpu().float(), want.to(torch.bfloat16).float())
    assert bool((out[0] != 0).all())


def test_presum_layer_replays_in_a_cuda_graph():
    p = LinearProblem("nvfp4", "full", 16, 4096, 4096)
    v = _variants(p)[0]
    r = FAMILY.runner(_compiled(v, p), v, p, "cuda", n_sets=1, seed=3)
    r.as_layer()
    assert r.check().ok
    eager = r().clone()
    side = torch.cuda.Stream()                 # warm-up off the capture stream
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        r()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        r()
    r.out.fill_(float("nan"))
    g.replay()
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(r.out.view(torch.int16), eager.view(torch.int16))
