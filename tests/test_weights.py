"""Weight-side methods: valid formats.* tensors, and never a larger block error."""

from __future__ import annotations

import pytest
import torch

from resgen import formats, reference, weights
from resgen.calibrate import prepare_weight, select_channels


def _w(n, k, seed, outliers=True):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.02
    if outliers:
        w[:, ::13] *= 8                                   # heavy columns, as in LLM weights
    return w


def _alpha(w, fmt):
    return formats.nvfp4_global_scale(w) if fmt == "nvfp4" else None


def _assert_valid(q, fmt, n, k):
    """What the kernels rely on: packed codes, E4M3 / E8M0 scales of the right shapes."""
    assert q.fmt == fmt and q.codes.dtype == torch.uint8 and tuple(q.codes.shape) == (n, k // 2)
    bs = formats.block_size(fmt)
    assert tuple(q.scales.shape) == (n, k // bs)
    if fmt == "nvfp4":
        assert q.scales.dtype == torch.float8_e4m3fn and q.global_scale is not None
        assert bool(torch.isfinite(q.scales.float()).all()) and float(q.scales.float().min()) >= 0
    else:
        assert q.scales.dtype == torch.uint8 and q.global_scale is None
        assert int(q.scales.max()) <= 254                 # 255 is E8M0's NaN
    assert bool(torch.isfinite(formats.dequantize(q)).all())


@pytest.mark.parametrize("fmt", formats.FORMATS)
def test_default_scales_reproduce_formats_quantize(fmt):
    w = _w(24, 128, 0)
    q0 = formats.quantize(w, fmt, global_scale=_alpha(w, fmt))
    q = weights.quantize_with_scales(w, fmt, q0.scales, q0.global_scale)
    assert torch.equal(q.codes, q0.codes) and torch.equal(q.scales.view(torch.uint8),
                                                          q0.scales.view(torch.uint8))


@pytest.mark.parametrize("fmt", formats.FORMATS)
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("weighted", [False, True])
def test_search_never_increases_block_error(fmt, seed, weighted):
    w = _w(32, 256, seed)
    w[3] = 0.0                                            # all-zero blocks stay exact
    imp = torch.rand(256, generator=torch.Generator().manual_seed(seed)) ** 4 if weighted else None
    q0 = formats.quantize(w, fmt, global_scale=_alpha(w, fmt))
    q = weights.search_scales(w, fmt, importance=imp)
    _assert_valid(q, fmt, 32, 256)
    e0 = weights.block_error(w, q0, imp)
    e1 = weights.block_error(w, q, imp)
    assert bool((e1 <= e0).all())
    assert float(e1.sum()) < float(e0.sum())             # and it does find better scales
    assert float(e1[3].sum()) == 0.0


def test_four_over_six_picks_only_6_or_4_targets_and_never_errs_more():
    w = _w(16, 128, 5)
    q0 = formats.quantize(w, "nvfp4", global_scale=_alpha(w, "nvfp4"))
    q = weights.four_over_six(w)
    _assert_valid(q, "nvfp4", 16, 128)
    amax = w.reshape(16, 8, 16).abs().amax(-1)
    alpha = q.global_scale
    six = formats.e4m3_round(amax / 6 / alpha).float()
    four = formats.e4m3_round(amax / 4 / alpha).float()
    sc = q.scales.float()
    assert bool(((sc == six) | (sc == four)).all())
    assert bool((sc == four).any())
    assert bool((weights.block_error(w, q) <= weights.block_error(w, q0)).all())


@pytest.mark.parametrize("fmt", formats.FORMATS)
def test_gptq_lowers_output_error_on_correlated_inputs(fmt):
    g = torch.Generator().manual_seed(3)
    k = 128
    mix = torch.randn(k, k, generator=g) / k ** 0.5 + torch.eye(k)
    x = (torch.randn(1024, k, generator=g) @ mix) * torch.exp(torch.randn(k, generator=g))
    w = _w(48, k, 1)
    h = (x.T @ x).double()
    q = weights.gptq(w, h, fmt)
    _assert_valid(q, fmt, 48, k)
    q0 = formats.quantize(w, fmt, global_scale=_alpha(w, fmt))
    ref = x @ w.T
    err_gptq = reference.nmse(x @ formats.dequantize(q).T, ref)
    err_amax = reference.nmse(x @ formats.dequantize(q0).T, ref)
    assert err_gptq < 0.8 * err_amax


def test_gptq_rejects_bad_shapes():
    w = _w(8, 64, 0)
    with pytest.raises(ValueError):
        weights.gptq(w, torch.eye(32, dtype=torch.float64), "nvfp4")
    with pytest.raises(ValueError):
        weights.search_scales(w, "nvfp4", targets=(4.0, 6.0))
    with pytest.raises(ValueError):
        weights.search_scales(w, "nvfp4", importance=torch.ones(8))
    with pytest.raises(TypeError):
        weights.quantize_with_scales(w, "mxfp4", torch.zeros(8, 2, dtype=torch.float8_e4m3fn))


@pytest.mark.parametrize("fmt", formats.FORMATS)
@pytest.mark.parametrize("method", weights.WEIGHT_METHODS)
def test_prepare_keeps_the_k_ext_layout(fmt, method):
    w = _w(32, 128, 2)
    x = torch.randn(64, 128) * torch.linspace(0.1, 3, 128)
    sel = select_channels(x.abs().mean(0), 0.25)
    h = (x.T @ x).double()
    qw = weights.prepare(w, fmt, method, selection=sel, importance=(x ** 2).mean(0),
                         ext_importance=torch.ones(sel.indices.numel()), hessian=h)
    ref = prepare_weight(w, fmt, selection=sel)
    assert qw.in_features == 128 and qw.selection is sel
    assert qw.q.codes.shape == ref.q.codes.shape and qw.q.scales.shape == ref.q.scales.shape
    assert qw.q.scales.dtype == ref.q.scales.dtype
    if fmt == "nvfp4":
        assert torch.equal(qw.q.global_scale, ref.q.global_scale)
    _assert_valid(qw.q, fmt, 32, qw.q.codes.shape[1] * 2)
    # The reference linear runs it with K-Ext compensation, and it stays close to FP32.
    y = reference.linear(x, qw, 0.25)
    assert reference.nmse(y, x @ w.T) < 0.05
