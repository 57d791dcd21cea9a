"""`resgen bench`'s added baselines on an H200, at Qwen3-8B's four projection shapes and
M = 1, 16, 64, 128: vLLM's Marlin W4A16 (NVFP4 and MXFP4) against x @ the dequantized
weights (resgen.formats, FP32), the fused FP8 per-token quantizer and the static per-tensor
cast bit for bit against their torch references, and the rowwise and per-tensor FP8 forms
against the FP32 product of their own E4M3 operands. Fresh random inputs per case, outputs
poisoned with NaN first; NaN never passes.

Marlin needs its library (bash bench/marlin_setup.sh, carried as .peers/marlin): without it the
Marlin tests fail, naming the path (they do not skip: a missing library is not a pass)."""

from __future__ import annotations

import zlib

import pytest
import torch

from resgen import baselines as B
from resgen import baselines_marlin as BM
from resgen import formats
from resgen.models import get_model

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SHAPES = [(s.name, s.n, s.k) for s in get_model("qwen3-8b").linear_shapes(1)]
MS = (1, 16, 64, 128)
MARLIN_TOL = 1e-2
FP8_TOL = 1e-2


def _rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    y = y.float()
    assert torch.isfinite(y).all(), "output holds NaN / Inf (poison not overwritten?)"
    return float((y - ref).norm() / ref.norm())


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("name,n,k", SHAPES)
def test_marlin_fp4_matches_the_dequantized_weights(fmt, m, name, n, k):
    g = torch.Generator(device="cuda").manual_seed(zlib.crc32(f"{fmt}{m}{name}".encode()))
    w = torch.randn(n, k, device="cuda", generator=g)
    q = formats.quantize(w, fmt)
    x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    y = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    fn = B.marlin_fp4(x, q, fmt, out=y)
    ref = x.float() @ formats.dequantize(q).T
    out = fn()
    torch.cuda.synchronize()
    assert out.data_ptr() == y.data_ptr()
    rel = _rel(out, ref)
    assert rel <= MARLIN_TOL, f"{fmt} {name} M={m}: rel err {rel:.3g}"
    # a second call (Marlin resets its locks after each call) is right again
    first = out.clone()
    y.fill_(float("nan"))
    again = fn()
    torch.cuda.synchronize()
    assert _rel(again, ref) <= MARLIN_TOL
    assert torch.equal(again, first), "a rerun changed the bits (stale locks?)"


def test_marlin_wrong_layout_is_caught():
    """The check has teeth: weights quantized from another matrix fail it."""
    n, k, m = 4096, 4096, 16
    q = formats.quantize(torch.randn(n, k, device="cuda"), "nvfp4")
    other = formats.quantize(torch.randn(n, k, device="cuda"), "nvfp4")
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    ref = x.float() @ formats.dequantize(other).T
    assert _rel(B.marlin_fp4(x, q, "nvfp4")(), ref) > 0.5


@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("k", sorted({k for _, _, k in SHAPES}))
def test_fused_fp8_quantizer_is_bit_exact_to_its_reference(m, k):
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16) * 3
    x[0, 0] = 0.0
    if m > 1:
        x[1] = 0.0                       # an all-zero row: scale clamps to 1e-12
    x8, s = B.fp8_rowwise_quant_triton(x)
    r8, rs = B.fp8_rowwise_quant(x)
    assert torch.equal(s, rs)
    assert torch.equal(x8.view(torch.uint8), r8.view(torch.uint8))


def _check_fp8_form(form, make, quant, m, name, n, k):
    """An FP8 form (make) against the FP32 product of its own E4M3 operands (quant: the form's
    quantizer), M padded to 16 rows as `resgen bench` pads it."""
    m16 = -(-m // 16) * 16
    x = torch.nn.functional.pad(torch.randn(m, k, device="cuda").to(torch.bfloat16),
                                (0, 0, 0, m16 - m))
    w = (torch.randn(n, k, device="cuda") / k ** 0.5).to(torch.bfloat16)
    fn = make(x, w)
    x8, xs = quant(x)
    w8, ws = quant(w)
    ref = (x8.float() * xs) @ (w8.float() * ws).T
    out = fn()
    rel = _rel(out[:m], ref[:m])
    assert rel <= FP8_TOL, f"{form} {name} M={m}: rel err {rel:.3g}"
    # and the FP8 error against the bf16 product stays an FP8 error (not a wrong layout)
    assert _rel(out[:m], (x.float() @ w.float().T)[:m]) < 0.1


@pytest.mark.parametrize("form", ["prequant", "fused"])
@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("name,n,k", SHAPES)
def test_fp8_rowwise_forms_match_their_operands(form, m, name, n, k):
    make = B.cublas_fp8_prequant if form == "prequant" else B.cublas_fp8_fused
    _check_fp8_form(form, make, B.fp8_rowwise_quant, m, name, n, k)


@pytest.mark.parametrize("k", sorted({k for _, _, k in SHAPES}))
def test_static_fp8_cast_is_bit_exact_to_its_reference(k):
    x = torch.randn(33, k, device="cuda").to(torch.bfloat16) * 3
    x[0, :7] = 0.0
    _, s = B.fp8_tensor_quant(x)
    for scale in (s, s / 4):                     # calibrated, and one that clamps
        x8, t = B.fp8_tensor_quant_triton(x, scale)
        r8, rt = B.fp8_tensor_quant(x, scale)
        assert torch.equal(t, rt)
        assert torch.equal(x8.view(torch.uint8), r8.view(torch.uint8))


@pytest.mark.parametrize("form", ["tensor_prequant", "static"])
@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("name,n,k", SHAPES)
def test_fp8_per_tensor_forms_match_their_operands(form, m, name, n, k):
    make = B.cublas_fp8_tensor_prequant if form == "tensor_prequant" else B.cublas_fp8_static
    _check_fp8_form(form, make, B.fp8_tensor_quant, m, name, n, k)


def test_marlin_library_is_the_built_one():
    lib = BM.load()
    assert lib.marlin_capi_version() == BM.CAPI_VERSION
    assert lib.marlin_capi_sms() == torch.cuda.get_device_properties(0).multi_processor_count
