"""The pre-summed fold ("presum", issue 20 section 1) on the CPU: formats.presum_fp16 and
presum_weight against independent formulas and their range claims, reference.linear /
decode_attention with fold="presum" against a float64 formula built from the quantized
values, its distance from the exact fold (within the kernels' 3e-3 check; measured in
bench/presum_accuracy.py), and the quality study's fake-quant path against the reference."""

from __future__ import annotations

import pytest
import torch

from resgen import calibrate as C
from resgen import formats as F
from resgen import reference as R
from resgen.quality.fakequant import FakeQuantLinear
from resgen.search.variant import LinearProblem


def _qweight(fmt, n=96, k=512, seed=0, ratio=None, static=False):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.exp(0.5 * torch.randn(n, 1, generator=g))
    sel = None
    if ratio is not None:
        st = C.ChannelStats(k)
        st.update(torch.randn(16, k, generator=g) * torch.exp(torch.randn(1, k, generator=g)))
        sel = C.select_channels(st.mean_abs(), ratio)
    isc = torch.tensor(8.0 / 2688) if fmt == "nvfp4" and static else None
    return C.prepare_weight(w, fmt, sel, input_scale=isc)


def _x(m=24, k=512, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.exp(torch.randn(1, k, generator=g))
    return x


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


# ----------------------------------------------------------------------------- formats


def test_nvfp4_presum_is_one_fp16_rounding_in_range():
    x = _x(8, 512)
    base, res = F.quantize_with_residue(x, "nvfp4")
    s = (F.dequantize(base, apply_global_scale=False) +
         F.dequantize(res, apply_global_scale=False))
    p = F.presum_fp16(s, "nvfp4")
    assert torch.equal(p, s.half().float())
    nz = s != 0
    assert bool(torch.isfinite(p).all())
    assert float(((p - s).abs()[nz] / s.abs()[nz]).max()) <= 2.0 ** -11
    # unit values are multiples of 2^-10 and below FP16's max: no subnormal, no overflow
    assert float(s.abs()[nz].min()) >= 2.0 ** -10 and float(s.abs().max()) < 65504 / 8
    assert torch.equal(torch.remainder(s * 1024, 1), torch.zeros_like(s))


@pytest.mark.parametrize("scale", [1e-30, 1e-3, 1.0, 1e6, 1e30])
def test_mxfp4_presum_rescales_each_row_into_fp16(scale):
    x = _x(6, 256) * scale
    x[2] = 0
    p = F.presum_fp16(x, "mxfp4")
    assert bool(torch.isfinite(p).all()) and not bool(p[2].any())
    nz = x != 0
    rel = ((p - x).abs()[nz] / x.abs()[nz])
    big = x.abs() >= x.abs().amax(-1, keepdim=True) * 2.0 ** -20
    assert float(rel[big[nz]].max()) <= 2.0 ** -11
    # an independent formula: per row, the power of two 2^t with max|x| * 2^-t in [2^11, 2^12)
    for r in (0, 1, 3):
        t = int(torch.floor(torch.log2(x[r].abs().max().double()))) - 11
        want = (x[r].double() * 2.0 ** -t).half().double() * 2.0 ** t
        assert torch.equal(p[r].double(), want)


def test_presum_weight_is_exact_or_refused():
    qw = _qweight("nvfp4")
    wu = F.dequantize(qw.q, apply_global_scale=False)
    assert torch.equal(F.presum_weight(wu, "nvfp4"), wu)
    qm = _qweight("mxfp4")
    wm = F.dequantize(qm.q)
    assert torch.equal(F.presum_weight(wm, "mxfp4"), wm)
    wild = wm.clone()
    wild[0, :32] *= 2.0 ** -60                      # block scales 60 binades below the rest
    with pytest.raises(ValueError, match="not exact in FP16"):
        F.presum_weight(wild, "mxfp4")


# ----------------------------------------------------------------------------- reference


def _presum_formula(x, qw, comp):
    """Float64 presum from the quantized values, written independently of reference.linear."""
    fmt, k = qw.fmt, qw.in_features
    sel = qw.selection if comp not in ("none", "full") else None
    base, res = F.quantize_with_residue(x, fmt, channels=sel, global_scale=qw.input_scale)
    xb = F.dequantize(base, apply_global_scale=False)
    xr = F.dequantize(res, apply_global_scale=False)
    if sel is not None:
        full = torch.zeros_like(xb)
        full[:, sel.indices] = xr[:, : sel.indices.numel()]
        xr = full
    s = (xb + xr).float()
    if fmt == "nvfp4":
        s16 = s.half().double()
    else:
        t = torch.floor(torch.log2(s.abs().amax(-1, keepdim=True).double())) - 11
        s16 = (s.double() * 2.0 ** -t).half().double() * 2.0 ** t
    w = F.dequantize(qw.q, apply_global_scale=False).double()[:, :k]
    ga = 1.0 if base.global_scale is None else float(base.global_scale)
    gw = 1.0 if qw.q.global_scale is None else float(qw.q.global_scale)
    return (s16 @ w.T) * ga * gw


@pytest.mark.parametrize("fmt, comp, static", [("nvfp4", "full", False),
                                               ("nvfp4", "full", True),
                                               ("mxfp4", "full", False),
                                               ("nvfp4", 0.25, False), ("mxfp4", 0.5, False)])
def test_reference_presum_matches_the_formula_and_stays_near_the_exact_fold(fmt, comp,
                                                                          static):
    qw = _qweight(fmt, ratio=None if comp == "full" else comp, static=static)
    x = _x()
    y = R.linear(x, qw, comp, fold="presum")
    want = _presum_formula(x, qw, comp)
    assert _rel(y, want) <= 1e-6
    exact = R.linear(x, qw, comp)
    if comp == "full":
        # the one FP16 rounding of the sum: far inside the kernels' 3e-3 check (MXFP4 sums
        # of E2M1 x 2^e pairs usually fit 11 bits: often no rounding at all)
        assert _rel(y, exact) <= 1e-3
    else:
        # K-Ext presum also trades W_hat_S (extension blocks) for the base weight's values
        assert _rel(y, exact) <= 3e-2
    plain = R.linear(x, qw, "none")
    ref = x.double() @ F.dequantize(qw.q).double()[:, : qw.in_features].T
    # compensation survives: presum is much closer to the FP4-weight product than plain
    assert R.nmse(y.double(), ref) < 0.8 * R.nmse(plain.double(), ref)


def test_presum_of_plain_is_plain():
    qw = _qweight("nvfp4")
    x = _x()
    assert _rel(R.linear(x, qw, "none", fold="presum"), R.linear(x, qw, "none")) <= 1e-6
    with pytest.raises(ValueError, match="fold"):
        R.linear(x, qw, "full", fold="fp8")


def test_decode_attention_presum_near_the_exact_fold():
    from resgen.kvcache import PagedKVCache

    g = torch.Generator().manual_seed(0)
    lens = [300, 17]
    ks = [torch.randn(2, n, 64, generator=g) for n in lens]
    vs = [torch.randn(2, n, 64, generator=g) for n in lens]
    cache, bt, sl = PagedKVCache.from_dense(ks, vs, page_size=16)
    q = torch.randn(2, 8, 64, generator=g) * 2
    exact = R.decode_attention(q, cache, bt, sl)
    pre = R.decode_attention(q, cache, bt, sl, fold="presum")
    plain = R.decode_attention(q, cache, bt, sl, compensation=False)
    assert 0 < _rel(pre, exact) <= 1e-3
    assert _rel(pre, exact) < 0.1 * _rel(plain, exact)
    same = R.decode_attention(q, cache, bt, sl, compensation=False, fold="presum")
    assert torch.equal(same, plain)


# ----------------------------------------------------------------------------- fake-quant


@pytest.mark.parametrize("fmt, comp", [("nvfp4", "full"), ("mxfp4", "full"), ("nvfp4", 0.5),
                                       ("mxfp4", 0.25)])
def test_fakequant_presum_matches_the_reference(fmt, comp):
    qw = _qweight(fmt, ratio=None if comp == "full" else comp)
    x = _x()
    mod = FakeQuantLinear(qw, comp, fold="presum")
    assert _rel(mod(x), R.linear(x, qw, comp, fold="presum")) <= 1e-5
    with pytest.raises(ValueError, match="residue"):
        FakeQuantLinear(qw, "w4a16", fold="presum")


# ----------------------------------------------------------------------------- K-Ext operand


def test_residue_on_channels_puts_each_residue_back_on_its_channel():
    r = torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 5.0, 6.0, 0.0]])    # 3 selected + padding
    out = F.residue_on_channels(r, torch.tensor([5, 0, 2]), 8)
    assert torch.equal(out, torch.tensor([[2.0, 0, 3.0, 0, 0, 1.0, 0, 0],
                                          [5.0, 0, 6.0, 0, 0, 4.0, 0, 0]]))
    with pytest.raises(ValueError, match="2 extension values for 3 selected"):
        F.residue_on_channels(r[:, :2], torch.tensor([5, 0, 2]), 8)


@pytest.mark.parametrize("ratio", [0.125, 0.25, 0.5, 1.0])
def test_kext_presum_operand_times_the_base_weight_is_the_reference(ratio):
    """quant_sm90's K-Ext "presum" operand (what the kernel writes, defined in torch) times
    the FP16-exact base weight gives reference.linear(ratio, fold="presum"): the quantizer's
    layout and the reference are the same numerics."""
    from resgen.kernels import quant_sm90 as Q

    qw = _qweight("nvfp4", ratio=ratio)
    k = qw.in_features
    x = _x(m=21).to(torch.bfloat16)
    op = Q.operand_reference(x, "nvfp4", str(ratio), "presum", 8, None, qw.selection.masks, 256)
    m = x.shape[0]
    assert op.xop.dtype == torch.float16 and op.xop.shape == (24, k)     # rows to 8
    assert not op.xop[m:].any() and op.codes.numel() == 0
    w16 = F.presum_weight(F.dequantize(qw.q, apply_global_scale=False)[:, :k], "nvfp4")
    y = (op.xop[:m].double() @ w16.double().T) * float(op.alpha) * float(qw.q.global_scale)
    want = R.linear(x.float(), qw, ratio, fold="presum")
    assert _rel(y, want) <= 1e-6
    # and independently of reference.linear: the formula above
    assert _rel(y, _presum_formula(x.float(), qw, ratio)) <= 1e-6


def test_kext_presum_layout_is_validated():
    from resgen.kernels import quant_sm90 as Q

    assert Q.operand_shape("nvfp4", "0.25", 512, 3, "presum").kq == 512
    assert Q.operand_shape("nvfp4", "0.25", 512, 3, "plain").kq == 512 + 128
    with pytest.raises(ValueError, match="K-Ext plain or presum"):
        Q.operand_shape("nvfp4", "0.25", 512, 3, "row_pair")
    with pytest.raises(ValueError, match="NVFP4 only"):
        Q.operand_shape("mxfp4", "0.25", 512, 3, "presum")
    cfg = Q.QuantConfig("nvfp4", "0.25", 512, "presum", write_codes=True)
    assert "fp16 xop only" in cfg.why_invalid()


def test_layer_quant_config_is_pack16_where_measured():
    """The NVFP4 layer quantizers of M-Ext presum rows and plain W4A4 rows run the measured
    configuration (pack16, 4 warps, unroll 1: quant_layer_config_probe_s33 / _s34 / _s37)
    where K allows pack16; every other layout keeps the QuantConfig defaults, and the
    compensation, K, alpha and layout are the layer's."""
    from resgen.kernels.quant_sm90 import QuantConfig
    from resgen.search import sm90_linear as SL

    default = QuantConfig("nvfp4", "full", 4096, "presum")
    for comp, layout, k in (("full", "presum", 12288), ("none", None, 4096)):
        p = LinearProblem("nvfp4", comp, 64, 4096, k)
        cfg = SL.layer_quant_config(p, layout)
        assert (cfg.ept, cfg.warps, cfg.unroll, cfg.persist) == (16, 4, 1, False)
        assert (cfg.compensation, cfg.k, cfg.layout, cfg.kp_align) == \
            (comp, k, layout or "plain", 256)
        assert cfg.write_xop and not cfg.write_codes and cfg.why_invalid() is None
        assert cfg.alpha == ("static" if p.static_scale else "dynamic")
        # K = 768 is not a multiple of pack16's warp tile (512): the defaults
        odd = SL.layer_quant_config(LinearProblem("nvfp4", comp, 64, 4096, 768), layout)
        assert (odd.ept, odd.warps, odd.unroll) == (default.ept, default.warps, default.unroll)
    # unmeasured: row pairs (M-Ext exact), K-Ext extensions, MXFP4 plain
    for fmt, comp, layout in (("nvfp4", "full", None), ("nvfp4", "0.25", "presum"),
                              ("nvfp4", "0.25", None), ("mxfp4", "none", None)):
        c = SL.layer_quant_config(LinearProblem(fmt, comp, 64, 4096, 4096), layout)
        assert (c.ept, c.warps, c.unroll, c.persist) == (default.ept, default.warps,
                                                         default.unroll, default.persist)
    # MXFP4 has no presum quantizer layout: nothing is tuned into an invalid configuration
    mx = SL.layer_quant_config(LinearProblem("mxfp4", "full", 16, 4096, 4096), "presum")
    assert mx.ept == default.ept and mx.alpha == "none" and mx.why_invalid()
    with pytest.raises(ValueError, match="W4A16"):
        SL.layer_quant_config(LinearProblem("nvfp4", "w4a16", 1, 128, 512))


@pytest.mark.parametrize("ratio", [0.125, 0.5])
def test_make_presum_xop_kext_is_the_quantizers_operand(ratio):
    """sm90_operand.make_presum_xop for a K-Ext ratio (the runner's torch operand of a K-Ext
    presum workload) is quant_sm90's "presum" operand bit for bit, and M-Ext's is unchanged
    by the compensation argument; plain has nothing to pre-sum."""
    from resgen.kernels import quant_sm90 as Q
    from resgen.kernels.sm90_operand import make_presum_xop

    qw = _qweight("nvfp4", ratio=ratio)
    x = _x(m=13).to(torch.bfloat16)
    xop, alpha = make_presum_xop(x.float(), qw, str(ratio), t_multiple=8)
    op = Q.operand_reference(x, "nvfp4", str(ratio), "presum", 8, None, qw.selection.masks, 256)
    assert xop.shape == op.xop.shape and xop.dtype == torch.float16
    assert torch.equal(xop.view(torch.int16), op.xop.view(torch.int16))
    assert torch.equal(alpha.reshape(()), op.alpha.reshape(()).float())
    qm = _qweight("nvfp4")
    a, _ = make_presum_xop(x.float(), qm, t_multiple=8)
    b, _ = make_presum_xop(x.float(), qm, "full", t_multiple=8)
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="no residue"):
        make_presum_xop(x.float(), qm, "none")
