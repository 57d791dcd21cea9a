"""Reference operators: linear with every compensation mode, paged-KV decode attention, NMSE."""

from __future__ import annotations

import pytest
import torch

from resgen import calibrate as C
from resgen import formats as F
from resgen import reference as R
from resgen.kvcache import PagedKVCache, kv_bytes_per_token


def _layer(fmt, ratio=None, n=32, k=128, seed=0, input_scale=None):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    x = torch.randn(6, k, generator=g)
    sel = None
    if ratio is not None:
        st = C.ChannelStats(k)
        st.update(x)
        sel = C.select_channels(st.mean_abs(), ratio)
    return x, w, C.prepare_weight(w, fmt, sel, input_scale=input_scale)


@pytest.mark.parametrize("fmt", F.FORMATS)
def test_linear_plain_and_full_match_hand_composition(fmt):
    x, w, qw = _layer(fmt)
    base, res = F.quantize_with_residue(x, fmt)
    xb, xr = F.dequantize(base).double(), F.dequantize(res).double()
    wh = F.dequantize(qw.q).double()
    y0 = R.linear(x, qw, "none")
    y1 = R.linear(x, qw, "full")
    assert y0.dtype == torch.float32 and y0.shape == (6, 32)
    assert torch.allclose(y0.double(), xb @ wh.T, rtol=1e-5, atol=1e-5)
    assert torch.allclose(y1.double(), (xb + xr) @ wh.T, rtol=1e-5, atol=1e-5)
    ref = x.double() @ w.double().T
    assert R.nmse(y1, ref) < R.nmse(y0, ref)


def test_linear_full_applies_global_scales_once_per_product():
    x, _, qw = _layer("nvfp4", seed=3)
    base, res = F.quantize_with_residue(x, "nvfp4")
    ab = base.global_scale * qw.q.global_scale
    ub = F.dequantize(base, apply_global_scale=False).double()
    ur = F.dequantize(res, apply_global_scale=False).double()
    uw = F.dequantize(qw.q, apply_global_scale=False).double()
    expect = (ub @ uw.T).float() * ab + (ur @ uw.T).float() * ab
    assert torch.equal(R.linear(x, qw, "full"), expect)


@pytest.mark.parametrize("fmt", F.FORMATS)
@pytest.mark.parametrize("ratio", C.RATIOS)
def test_linear_kext_ratios(fmt, ratio):
    x, w, qw = _layer(fmt, ratio, seed=1)
    y = R.linear(x, qw, ratio)
    base, res = F.quantize_with_residue(x, fmt, channels=qw.selection)
    expect = (F.dequantize(F.cat([base, res])).double() @ F.dequantize(qw.q).double().T)
    assert torch.allclose(y.double(), expect, rtol=1e-5, atol=1e-5)
    if ratio == 1.0:
        assert torch.allclose(y, R.linear(x, qw, "full"), rtol=1e-5, atol=1e-5)


def test_linear_error_shrinks_with_ratio_on_average():
    errs = {}
    for r in (0.125, 0.5, 1.0):
        tot = 0.0
        for seed in range(4):
            x, w, qw = _layer("nvfp4", r, k=256, seed=seed)
            tot += R.nmse(R.linear(x, qw, r), x.double() @ F.dequantize(qw.base()).double().T)
        errs[r] = tot
    assert errs[1.0] < errs[0.5] < errs[0.125]


def test_linear_static_input_scale_and_batch_dims():
    x, w, qw = _layer("nvfp4", input_scale=0.01)
    y = R.linear(x.reshape(2, 3, -1), qw, "full")
    assert y.shape == (2, 3, 32)
    base, res = F.quantize_with_residue(x, "nvfp4", global_scale=0.01)
    assert float(base.global_scale) == pytest.approx(0.01)
    assert torch.allclose(y.reshape(6, -1).double(),
                          (F.dequantize(base) + F.dequantize(res)).double()
                          @ F.dequantize(qw.q).double().T, rtol=1e-5, atol=1e-6)


def test_linear_errors():
    x, w, qw = _layer("nvfp4")
    with pytest.raises(ValueError, match="channel selection"):
        R.linear(x, qw, 0.25)
    with pytest.raises(ValueError, match="compensation"):
        R.linear(x, qw, "half")
    with pytest.raises(ValueError, match="K=64"):
        R.linear(x[:, :64], qw, "none")
    x, w, qw = _layer("nvfp4", 0.25)
    with pytest.raises(ValueError, match="ratio 0.25"):
        R.linear(x, qw, 0.5)


def test_nmse():
    ref = torch.tensor([3.0, 4.0])
    assert R.nmse(torch.tensor([3.0, 3.0]), ref) == pytest.approx(1 / 25)
    with pytest.raises(ValueError, match="all-zero"):
        R.nmse(ref, torch.zeros(2))


# ----------------------------------------------------------------------------- KV cache + attention


def _seqs(lens, hkv=2, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    ks = [torch.randn(hkv, n, d, generator=g) for n in lens]
    vs = [torch.randn(hkv, n, d, generator=g) for n in lens]
    return ks, vs


def test_cache_append_is_quantize_of_each_token():
    ks, vs = _seqs([5, 40])
    cache, bt, sl = PagedKVCache.from_dense(ks, vs, page_size=16)
    assert sl.tolist() == [5, 40]
    for b in range(2):
        k, v = cache.gather(bt[b], int(sl[b]))
        qk = F.quantize(ks[b].transpose(0, 1), "nvfp4", global_scale=1.0)
        assert torch.equal(k, F.dequantize(qk).transpose(0, 1))
        qv = F.quantize(vs[b].transpose(0, 1), "nvfp4", global_scale=1.0)
        assert torch.equal(v, F.dequantize(qv).transpose(0, 1))


def test_cache_validation_and_accounting():
    with pytest.raises(ValueError, match="multiple of 16"):
        PagedKVCache.empty(4, 2, 40)
    cache = PagedKVCache.empty(2, 2, 64, page_size=8)
    bad_table = torch.tensor([[5]], dtype=torch.int32)
    with pytest.raises(ValueError, match="outside the cache"):
        cache.append(torch.zeros(1, 2, 64), torch.zeros(1, 2, 64), bad_table,
                     torch.tensor([[0, 0]]))
    acc = kv_bytes_per_token(8, 128)
    assert acc["nvfp4"] == 2 * 8 * (64 + 8) and acc["ratio"] == pytest.approx(72 / 256)


@pytest.mark.parametrize("pv", ["fp32", "bf16", "fp8"])
def test_decode_attention_lengths_and_compensation(pv):
    lens = [0, 1, 31, 70]
    ks, vs = _seqs(lens, seed=1)
    cache, bt, sl = PagedKVCache.from_dense(ks, vs, page_size=32)
    g = torch.Generator().manual_seed(2)
    q = torch.randn(4, 8, 64, generator=g)
    out = R.decode_attention(q, cache, bt, sl, compensation=True, pv=pv)
    assert torch.equal(out[0], torch.zeros(8, 64))             # empty sequence -> zeros
    k1, v1 = cache.gather(bt[1], 1)
    tol = {"fp32": 1e-6, "bf16": 1e-2, "fp8": 1e-1}[pv]
    assert torch.allclose(out[1], v1[:, 0].repeat_interleave(4, 0), atol=tol)  # length 1
    assert torch.isfinite(out).all()
    kd = [cache.gather(bt[b], n)[0] for b, n in enumerate(lens)]
    vd = [cache.gather(bt[b], n)[1] for b, n in enumerate(lens)]
    exact = R.attention_fp32(q, kd, vd)
    with_res = R.nmse(out[1:], exact[1:])
    plain = R.nmse(R.decode_attention(q, cache, bt, sl, compensation=False, pv=pv)[1:], exact[1:])
    if pv == "fp32":
        assert with_res * 10 < plain


def test_decode_attention_matches_dense_softmax_on_same_kv():
    ks, vs = _seqs([50], hkv=1, d=32, seed=3)
    cache, bt, sl = PagedKVCache.from_dense(ks, vs, page_size=8)
    q = torch.randn(1, 2, 32)
    base, res, alpha = R.quantize_query(q)
    qh = (F.dequantize(base, apply_global_scale=False)
          + F.dequantize(res, apply_global_scale=False)) * alpha
    k, v = cache.gather(bt[0], 50)
    s = (qh[0].double() @ k[0].double().T) / 32 ** 0.5
    expect = torch.softmax(s, -1) @ v[0].double()
    got = R.decode_attention(q, cache, bt, sl)[0]
    assert torch.allclose(got.double(), expect, rtol=1e-5, atol=1e-6)


def test_quantize_query_row_scales():
    q = torch.randn(2, 3, 64)
    q[1, 2] *= 1000
    base, res, alpha = R.quantize_query(q)
    assert alpha.shape == (2, 3, 1)
    assert torch.allclose(alpha[1, 2, 0], q[1, 2].abs().max() / 2688)
    recon = (F.dequantize(base, apply_global_scale=False)
             + F.dequantize(res, apply_global_scale=False)) * alpha
    assert R.nmse(recon, q) < 1e-3
    b2, r2, a2 = R.quantize_query(q, scale="tensor")
    assert torch.equal(a2, a2.flatten()[0].expand_as(a2))


def test_attention_errors():
    ks, vs = _seqs([4], hkv=2, d=64)
    cache, bt, sl = PagedKVCache.from_dense(ks, vs)
    with pytest.raises(ValueError, match="multiple of 2 KV heads"):
        R.decode_attention(torch.randn(1, 3, 64), cache, bt, sl)
    with pytest.raises(ValueError, match="head dim"):
        R.decode_attention(torch.randn(1, 4, 32), cache, bt, sl)
    with pytest.raises(ValueError, match="pv must be"):
        R.decode_attention(torch.randn(1, 4, 64), cache, bt, sl, pv="int8")
