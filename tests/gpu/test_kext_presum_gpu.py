"""K-Ext presum workloads (LinearProblem fold "presum", issue 20 section 1) on an H200: both
Hopper linear families' presum variants behind the real quant_sm90 K-Ext presum quantizer.

- Qwen3-8B's four projections at NVFP4 K-Ext 0.125 (two of them at 0.5 too), M = 1 / 16
  (linear_sm90_mma) and 16 / 128 / 2048 (linear_sm90_wgmma): the family default and the first
  presum variant by the prior; the runner's check (the GEMM alone on make_presum_xop, then
  the whole layer: the quantizer's presum rows with the K-Ext masks, the FP16 GEMM over K on
  the base weight)
  against reference.linear(ratio, fold="presum"), fresh random inputs, NaN-poisoned outputs,
  twice, then bit-identical reruns;
- resgen.ops.Linear(qweight, ratio, fold="presum") on the dispatch it gets, against the same
  reference, and its CUDA-graph replay."""

from __future__ import annotations

import pytest
import torch

from resgen import calibrate as C
from resgen import reference as R
from resgen.search import build
from resgen.search.family import get_family
from resgen.search.sm90_linear import compare
from resgen.search.variant import LinearProblem

from runner_checks import check_runner  # tests/gpu/runner_checks.py

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ARCH = "sm_90a"
DEV = "cuda"
QWEN3_8B = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]
CASES = [("linear_sm90_mma", 1), ("linear_sm90_mma", 16), ("linear_sm90_wgmma", 16),
         ("linear_sm90_wgmma", 128), ("linear_sm90_wgmma", 2048)]
_COMPILED: dict = {}


def _compiled(fam, v, p):
    key = (fam.NAME, v, fam.compile_key(v, p))
    if key not in _COMPILED:
        out = build.compile_variant(fam, v, p, ARCH)
        assert out.ok, out.error
        assert out.spill_bytes == 0
        _COMPILED[key] = out.compiled
    return _COMPILED[key]


# K-Ext 0.125 on every shape, 0.5 on the two K = 4096 / 12288 representatives
PARAMS = ([(n, k, f, m, "0.125") for n, k in QWEN3_8B for f, m in CASES]
          + [(n, k, f, m, "0.5") for n, k in ((4096, 4096), (4096, 12288)) for f, m in CASES])


@pytest.mark.parametrize("n, k, fname, m, ratio", PARAMS,
                         ids=lambda c: str(c) if not isinstance(c, str) else c)
def test_kext_presum_layers(n, k, fname, m, ratio):
    fam = get_family(fname)
    p = LinearProblem("nvfp4", ratio, m, n, k, fold="presum")
    space = sorted(fam.space(p, ARCH), key=lambda v: fam.prior(v, p))
    for v in dict.fromkeys([fam.default(p, ARCH), space[0]]):
        assert v.presum and fam.why_invalid(v, p, ARCH) is None
        r = fam.runner(_compiled(fam, v, p), v, p, DEV, n_sets=1, seed=m + n)
        r.as_layer()                          # the real K-Ext presum quantizer in front
        assert r.quantizer.config.layout == "presum" and r.masks is not None
        assert not r.exact_too
        check_runner(r, v, m, k)


def test_ops_linear_kext_presum_and_graph_replay():
    g = torch.Generator().manual_seed(5)
    n, k, ratio = 4096, 4096, 0.125
    w = torch.randn(n, k, generator=g) * torch.exp(0.5 * torch.randn(n, 1, generator=g))
    st = C.ChannelStats(k)
    st.update(torch.randn(64, k, generator=g) * torch.exp(torch.randn(1, k, generator=g)))
    qw = C.prepare_weight(w, "nvfp4", C.select_channels(st.mean_abs(), ratio),
                          input_scale=torch.tensor(8.0 / 2688))
    from resgen.ops import Linear

    layer = Linear(qw, ratio, fold="presum")
    for m in (1, 16, 128):
        x = (torch.randn(m, k, device=DEV) * 3).to(torch.bfloat16)
        y = layer(x)
        plan = layer.plan(m)
        assert plan.problem.fold == "presum" and plan.variant.presum
        ref = R.linear(x.float().cpu(), qw, ratio, fold="presum")
        res = compare(y.cpu(), ref)
        assert res.ok, f"M={m} {plan.family} {plan.variant.name()}: {res.detail}"
    layer.warmup([16])
    x = (torch.randn(16, k, device=DEV) * 3).to(torch.bfloat16)
    eager = layer(x)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        layer(x)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(x)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.view(torch.int16), eager.view(torch.int16))
