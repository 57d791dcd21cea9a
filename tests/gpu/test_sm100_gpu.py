"""linear_sm100_tc and quant_sm100 on a Blackwell (sm_100) GPU: the compile cover checked against
the FP32 reference (the GEMM on fresh random inputs into NaN-poisoned outputs, then the whole
layer behind the quantizer; the quantizer byte-exact against operand_reference), CUDA-graph
replay equal to eager. NEVER RUN: no Blackwell GPU exists in this workplace, so on the H200
(and on any non-sm_100 device) every test here skips. On a B200:

    source .devcache/device/env.sh && python3 -m pytest -m gpu -q tests/gpu/test_sm100_gpu.py
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu]
if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 10:
    # before the covers are computed: collecting this file costs nothing elsewhere
    pytest.skip("needs an sm_100 (Blackwell datacenter) GPU", allow_module_level=True)

ARCH = "sm_100a"


def _linear_cases():
    from resgen.search import linear_sm100_tc as L

    return L.covering_cases()


def _quant_cases():
    from resgen.search import quant_sm100 as Q

    return Q.covering_cases()


@pytest.mark.parametrize("p, v", _linear_cases(), ids=lambda x: getattr(x, "name", lambda: "")())
def test_linear_sm100_tc_matches_the_reference(p, v):
    from resgen.search import build
    from resgen.search import linear_sm100_tc as L

    out = build.compile_variant(L.FAMILY, v, p, ARCH)
    assert out.ok and out.spill_bytes == 0, out.error
    r = L.FAMILY.runner(out.compiled, v, p, "cuda", n_sets=2)
    for _ in range(2):                                   # GEMM on the torch-made operand
        res = r.check()
        assert res.ok, res.detail
    r.as_layer()                                         # quant_sm100 in front
    res = r.check()
    assert res.ok, res.detail
    a = r().clone()
    assert torch.equal(r().view(torch.int16), a.view(torch.int16)) or not v.deterministic
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = r()
    g.replay()
    torch.cuda.synchronize()
    if v.deterministic:
        assert torch.equal(y.view(torch.int16), a.view(torch.int16))


@pytest.mark.parametrize("p, v", _quant_cases(), ids=lambda x: getattr(x, "name", lambda: "")())
def test_quant_sm100_is_byte_exact(p, v):
    from resgen.search import build
    from resgen.search import quant_sm100 as Q

    out = build.compile_variant(Q.FAMILY, v, p, ARCH)
    assert out.ok, out.error
    r = Q.FAMILY.runner(out.compiled, v, p, "cuda", n_sets=1)
    for _ in range(4):                                   # randn, ties, zeros, mixed
        res = r.check()
        assert res.ok, res.detail
