"""bench/flashinfer_peer.py on the CPU: the page-table conversion, the BF16-query reference, and
the wrapper plumbing against a stand-in `flashinfer` package that implements the documented
paged-KV semantics (indptr / indices / last_page_len, HND NVFP4 codes + E4M3 block scales) in
torch. The real FlashInfer runs only on the GPU machine."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import flashinfer_peer as FP  # noqa: E402
from resgen import reference as R  # noqa: E402
from resgen.kvcache import PagedKVCache  # noqa: E402

FAKE = '''
import torch
from resgen import formats as F

__version__ = "fake-0"


class BatchDecodeWithPagedKVCacheWrapper:
    def __init__(self, ws, layout, use_tensor_cores=False, backend="auto"):
        assert layout == "HND" and use_tensor_cores and backend == "fa2"

    def plan(self, indptr, indices, last_page_len, hq, hkv, d, page_size, *, q_data_type,
             kv_data_type, o_data_type):
        assert indptr.dtype == indices.dtype == last_page_len.dtype == torch.int32
        assert kv_data_type == torch.uint8 and q_data_type == o_data_type == torch.bfloat16
        self.p = (indptr.tolist(), indices.tolist(), last_page_len.tolist(), hq, hkv, d,
                  page_size)

    def run(self, q, kv, kv_cache_sf, k_scale, v_scale, out=None):
        indptr, indices, last, hq, hkv, d, ps = self.p
        (kc, vc), (ksf, vsf) = kv, kv_cache_sf

        def deq(codes, sf):             # [pages, Hkv, ps, D/2], [.., D/16] -> [.., D]
            vals = F.e2m1_decode(F.unpack_fp4(codes)).float()
            return vals * sf.float().repeat_interleave(16, dim=-1)

        out = torch.zeros_like(q) if out is None else out
        for b in range(q.shape[0]):
            pages = indices[indptr[b]:indptr[b + 1]]
            if not pages:
                out[b] = 0
                continue
            n = (len(pages) - 1) * ps + last[b]
            k = deq(kc[pages], ksf[pages]).permute(1, 0, 2, 3).reshape(hkv, -1, d)[:, :n]
            v = deq(vc[pages], vsf[pages]).permute(1, 0, 2, 3).reshape(hkv, -1, d)[:, :n]
            qb = q[b].float().reshape(hkv, hq // hkv, d)
            p = torch.softmax(qb @ (k * k_scale).transpose(1, 2) * d ** -0.5, -1)
            out[b] = (p @ (v * v_scale)).reshape(hq, d).to(out.dtype)
        return out
'''


@pytest.fixture()
def fake_flashinfer(tmp_path, monkeypatch):
    (tmp_path / "flashinfer").mkdir()
    (tmp_path / "flashinfer" / "__init__.py").write_text(textwrap.dedent(FAKE))
    monkeypatch.setenv("RESGEN_FLASHINFER", str(tmp_path))
    monkeypatch.setattr(FP, "_FI", None)
    monkeypatch.setattr(FP, "_WHY", "not loaded yet")
    monkeypatch.delitem(sys.modules, "flashinfer", raising=False)
    yield
    sys.modules.pop("flashinfer", None)
    if str(tmp_path) in sys.path:
        sys.path.remove(str(tmp_path))


def _cache(lens, hkv=2, d=64, ps=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    ks = [torch.randn(hkv, n, d, generator=g) for n in lens]
    vs = [torch.randn(hkv, n, d, generator=g) for n in lens]
    cache, bt, sl = PagedKVCache.from_dense(ks, vs, page_size=ps, k_scale=0.5, v_scale=2.0)
    return cache, bt.to(torch.int32), sl.to(torch.int32)


def test_page_table_conversion():
    bt = torch.tensor([[7, 3, 9, 0], [5, 0, 0, 0], [0, 0, 0, 0], [2, 4, 6, 8]],
                      dtype=torch.int32)
    sl = torch.tensor([33, 16, 0, 64], dtype=torch.int32)
    indptr, indices, last = FP.page_table(bt, sl, 16)
    assert indptr.tolist() == [0, 3, 4, 4, 8]
    assert indices.tolist() == [7, 3, 9, 5, 2, 4, 6, 8]
    assert last.tolist() == [1, 16, 0, 16]
    assert indptr.dtype == indices.dtype == last.dtype == torch.int32


def test_exact_bf16_query_is_attention_on_the_dequantized_cache():
    cache, bt, sl = _cache([40, 5, 0])
    q = torch.randn(3, 8, 64).to(torch.bfloat16)
    got = FP.exact_bf16_query(q, cache, bt, sl)
    # the FP4 query of the reference with compensation is close, not equal (ResAttn's error)
    resattn = R.decode_attention(q.float(), cache, bt, sl, compensation=True)
    rel = float((resattn - got).norm() / got.norm())
    assert 0 < rel < 0.05
    assert bool((got[2] == 0).all())


def test_load_says_why_without_the_path(monkeypatch):
    monkeypatch.delenv("RESGEN_FLASHINFER", raising=False)
    monkeypatch.setattr(FP, "_FI", None)
    monkeypatch.setattr(FP, "_WHY", "not loaded yet")
    assert FP.load() is None and "RESGEN_FLASHINFER" in FP.why_not()
    assert FP.version() is None


def test_wrapper_plumbing_with_a_stand_in(fake_flashinfer):
    assert FP.version() == "fake-0" and FP.why_not() == ""
    cache, bt, sl = _cache([40, 5, 0, 16])
    q = torch.randn(4, 8, 64).to(torch.bfloat16)
    res = FP.check(q, cache, bt, sl)
    assert res["ok"], res
    assert FP.check(q, cache, bt, sl, slice(1, 2))["ok"]
    r = FP.Runner([(q, cache, bt, sl)], torch.empty_like(q))
    r.rotate(3)
    assert r() is r.out and not bool(r.out.isnan().any())
