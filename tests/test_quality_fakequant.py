"""The fast fake-quant path equals resgen.formats / resgen.reference on random layers."""

from __future__ import annotations

import pytest
import torch

from resgen import formats, reference
from resgen.calibrate import prepare_weight, select_channels
from resgen.quality.fakequant import FakeQuantLinear, qdq, qdq_with_residue


def _heavy(shape, seed):
    """Random activations with outlier channels and exact ties, like LLM inputs."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp(torch.randn(shape[-1], generator=g) * 1.5)
    x[..., :4] = torch.tensor([0.25, -0.75, 2.5, 5.0])  # E2M1 ties when the scale is 1
    return x


def test_e2m1_round_matches_codec_on_every_tie_and_grid_point():
    grid = torch.arange(-8.0, 8.0, 0.125)
    v = torch.cat([grid, -grid, torch.tensor([0.0, -0.0, 1e-30, -1e-30, 100.0, -100.0])])
    want = formats.e2m1_decode(formats.e2m1_encode(v))
    got = formats.e2m1_round(v)
    assert torch.equal(got, want)
    assert torch.equal(torch.signbit(got), torch.signbit(want))


@pytest.mark.parametrize("fmt", formats.FORMATS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_qdq_is_bit_identical_to_formats_round_trip(fmt, seed):
    x = _heavy((37, 128), seed)
    x[3] = 0.0                                  # an all-zero row: exact zeros
    want = formats.dequantize(formats.quantize(x, fmt))
    assert torch.equal(qdq(x, fmt), want)


@pytest.mark.parametrize("seed", [0, 1])
def test_residue_matches_quantize_with_residue_kext(seed):
    x = _heavy((19, 64), seed)
    sel = select_channels(x.abs().mean(0), 0.25)
    for fmt in formats.FORMATS:
        base, res = formats.quantize_with_residue(x, fmt, channels=sel)
        x_hat, r_hat = qdq_with_residue(x, fmt, None, sel.indices)
        assert torch.equal(x_hat, formats.dequantize(base))
        assert torch.equal(r_hat, formats.dequantize(res))


# A static input_scale exists for NVFP4 only (MXFP4 has no tensor scale).
@pytest.mark.parametrize("fmt,static", [("nvfp4", False), ("nvfp4", True), ("mxfp4", False)])
@pytest.mark.parametrize("comp", ["none", "full", 0.125, 0.25, 0.5])
def test_fake_quant_linear_equals_reference_linear(fmt, comp, static):
    n, k = 48, 128
    g = torch.Generator().manual_seed(7)
    w = torch.randn(n, k, generator=g) * 0.05
    x = _heavy((3, 11, k), 11)
    sel = None if comp in ("none", "full") else select_channels(x.abs().mean((0, 1)), comp)
    isc = formats.nvfp4_global_scale(x) * 0.8 if static else None  # a little saturation
    qw = prepare_weight(w, fmt, selection=sel, input_scale=isc)
    want = reference.linear(x, qw, comp)
    got = FakeQuantLinear(qw, comp)(x)
    assert got.shape == want.shape == (3, 11, n)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5 * float(want.abs().max()))
    # The compensation must matter, or this comparison proves little.
    if comp != "none":
        plain = reference.linear(x, qw, "none")
        assert reference.nmse(want, plain) > 1e-6


def test_fake_quant_linear_rejects_wrong_ratio():
    w = torch.randn(16, 64)
    qw = prepare_weight(w, "nvfp4", selection=select_channels(torch.rand(64), 0.25))
    with pytest.raises(ValueError):
        FakeQuantLinear(qw, 0.5)


@pytest.mark.parametrize("fmt", formats.FORMATS)
def test_w4a16_fake_quant_equals_reference_and_beats_w4a4(fmt):
    """W4A16: activations rounded to BF16 (not quantized), FP4 weights; the fast path equals
    resgen.reference.linear_w4a16 to FP32 rounding, and its error against the unquantized
    layer is below plain W4A4's (only the weight and the BF16 rounding are lossy)."""
    n, k = 48, 128
    g = torch.Generator().manual_seed(5)
    w = torch.randn(n, k, generator=g) * 0.05
    x = _heavy((2, 9, k), 3)
    qw = prepare_weight(w, fmt)
    want = reference.linear_w4a16(x, qw)
    got = FakeQuantLinear(qw, "w4a16")(x)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5 * float(want.abs().max()))
    # independent formula: bf16-rounded x against the dequantized weight, float64
    indep = (x.to(torch.bfloat16).double() @ formats.dequantize(qw.q).double().T).float()
    torch.testing.assert_close(want, indep, rtol=1e-6, atol=1e-6 * float(indep.abs().max()))
    exact = x.double() @ w.double().T
    assert reference.nmse(want, exact) < reference.nmse(reference.linear(x, qw, "none"), exact)
    # a K-Ext weight serves W4A16 through its base part
    sel = select_channels(x.abs().mean((0, 1)), 0.25)
    qe = prepare_weight(w, fmt, selection=sel)
    assert torch.equal(FakeQuantLinear(qe, "w4a16")(x), got)


@pytest.mark.parametrize("fmt", formats.FORMATS)
def test_w4a8_fake_quant_equals_reference_and_sits_between_w4a4_and_w4a16(fmt):
    """W4A8: E4M3 activations with one scale per token, FP4 weights. The fast path equals
    resgen.reference.linear_w4a8 to FP32 rounding; the reference equals an independent formula
    (E4M3 per row by hand: exponent, 3 mantissa bits, round to nearest even); its error
    against the unquantized layer is below plain W4A4's and above W4A16's."""
    n, k = 48, 128
    g = torch.Generator().manual_seed(7)
    w = torch.randn(n, k, generator=g) * 0.05
    x = _heavy((2, 9, k), 4)
    x[0, 0] = 0.0                                    # an all-zero token: scale clamps, y = 0
    qw = prepare_weight(w, fmt)
    want = reference.linear_w4a8(x, qw)
    got = FakeQuantLinear(qw, "w4a8")(x)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5 * float(want.abs().max()))
    assert torch.all(want[0, 0] == 0)
    xr = x.reshape(-1, k).double()
    s = (xr.abs().amax(1, keepdim=True).float() * (1.0 / 448)).clamp(min=1e-12).double()
    v = (xr.float() / s.float()).double()            # FP32 division, as the definition
    e = torch.floor(torch.log2(v.abs().clamp(min=2.0 ** -6)))   # E4M3: subnormals below 2^-6
    q = torch.round(v / 2.0 ** (e - 3)) * 2.0 ** (e - 3)        # 3 mantissa bits, ties even
    indep = ((q * s) @ formats.dequantize(qw.q).double().T).reshape(2, 9, n).float()
    torch.testing.assert_close(want, indep, rtol=1e-6, atol=1e-6 * float(indep.abs().max()))
    exact = x.double() @ w.double().T
    err = {m: reference.nmse(f, exact) for m, f in (
        ("w4a4", reference.linear(x, qw, "none")), ("w4a8", want),
        ("w4a16", reference.linear_w4a16(x, qw)))}
    assert err["w4a16"] < err["w4a8"] < err["w4a4"], err
    with pytest.raises(ValueError, match="no residue"):
        FakeQuantLinear(qw, "w4a8", fold="presum")


def test_fp8_rowwise_quant_is_the_baselines_quantizer():
    from resgen import baselines

    x = _heavy((6, 64), 9)
    a8, a = formats.fp8_rowwise_quant(x)
    b8, b = baselines.fp8_rowwise_quant(x)
    assert torch.equal(a, b) and torch.equal(a8.view(torch.uint8), b8.view(torch.uint8))


def test_fake_quant_bias_is_added_in_fp32():
    w = torch.randn(16, 64)
    b = torch.randn(16)
    qw = prepare_weight(w, "nvfp4")
    x = _heavy((5, 64), 2)
    for comp in ("none", "full", "w4a16"):
        plain = FakeQuantLinear(qw, comp)(x)
        torch.testing.assert_close(FakeQuantLinear(qw, comp, bias=b)(x), plain + b)
