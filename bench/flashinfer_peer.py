"""FlashInfer's fa2 decode (NVFP4 KV, BF16 query) on resgen's paged NVFP4 cache: the peer the
ResAttn issue asks for, timed in bench/gpu_attention_check.py beside ResAttn, plain NVFP4-KV
and SDPA in one run.

Same bytes: FlashInfer's HND NVFP4 cache ([pages, Hkv, page, D/2] uint8 codes, even element
in the low nibble; [pages, Hkv, page, D/16] E4M3 block scales; FP32 K / V tensor scales) is
the layout of resgen.kvcache.PagedKVCache, so both read the same cache; only the page table
is converted (block table + lengths -> indptr / indices / last-page lengths). FlashInfer
keeps the query in BF16 (no FP4 query), so it is checked against exact attention with the
BF16 query on the same dequantized K / V.

Getting it onto the GPU machine (which cannot reach PyPI; one call carries 64 MiB, and
.devcache alone takes 56 MiB, so FlashInfer travels in its own call):
  1. here:  bash bench/flashinfer_pack.sh                      (writes the ignored .fi/)
  2. device call A, carry [".fi"]:
        bash bench/flashinfer_setup.sh
     unpacks FlashInfer into /tmp/fi/site and runs `python3 bench/flashinfer_peer.py --warm`:
     JIT-compiles (nvcc) the fa2 NVFP4 decode modules for the benchmark's geometries, checks
     each against the reference and writes $OUT/flashinfer_warm.json;
  3. device call B, carry [".devcache"], while the machine is still warm (its idle release
     is about 30 s; /tmp and FlashInfer's JIT cache survive between calls on one machine):
        source .devcache/device/env.sh && RESGEN_FLASHINFER=/tmp/fi/site \\
            RESGEN_BENCH_BUDGET_S=240 python3 bench/gpu_attention_check.py
RESGEN_FLASHINFER (a path list) is where `import flashinfer` is looked for; without it, or if
the import fails, the attention check runs without the peer and says why in its JSON.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

WORKSPACE_BYTES = 128 << 20
TOLERANCE = 2e-2      # BF16 output, FP16/BF16 P and V inside FlashInfer, vs exact attention
WARM_GEOMS = ((32, 8, 128), (64, 8, 128), (16, 2, 256))

_FI: Any = None
_WHY = "not loaded yet"


def load() -> Any:
    """The flashinfer module (from RESGEN_FLASHINFER's paths), or None; why_not() says why."""
    global _FI, _WHY
    if _FI is not None or _WHY != "not loaded yet":
        return _FI
    paths = [p for p in os.environ.get("RESGEN_FLASHINFER", "").split(os.pathsep) if p]
    if not paths:
        _WHY = "RESGEN_FLASHINFER is not set (see bench/flashinfer_peer.py)"
        return None
    for p in reversed(paths):
        if p not in sys.path:
            sys.path.insert(0, p)
    os.environ.setdefault("FLASHINFER_CUDA_ARCH_LIST", "9.0a")
    try:
        import flashinfer
    except Exception as e:       # a missing dependency, an ABI mismatch, ...
        _WHY = f"import flashinfer failed: {type(e).__name__}: {e}"[:500]
        return None
    _FI, _WHY = flashinfer, ""
    return _FI


def why_not() -> str:
    return _WHY


def version() -> str | None:
    fi = load()
    return getattr(fi, "__version__", None) if fi is not None else None


def page_table(block_tables: torch.Tensor, seq_lens: torch.Tensor, page_size: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """resgen's (block tables [B, max_pages], lengths [B]) -> FlashInfer's (indptr [B + 1],
    indices [sum pages], last_page_len [B]), int32 on the tables' device. A sequence of
    length 0 gets no page (FlashInfer writes zeros for it, like resgen)."""
    sl = seq_lens.to(torch.int64)
    pages = (sl + page_size - 1) // page_size
    indptr = torch.zeros(len(sl) + 1, dtype=torch.int64, device=sl.device)
    indptr[1:] = torch.cumsum(pages, 0)
    cols = torch.arange(block_tables.shape[1], device=sl.device)
    indices = block_tables[cols.unsqueeze(0) < pages.unsqueeze(1)]
    last = torch.where(sl > 0, sl - (pages - 1) * page_size, torch.zeros_like(sl))
    return (indptr.to(torch.int32), indices.to(torch.int32).contiguous(),
            last.to(torch.int32))


class FlashInferDecode:
    """One planned fa2 decode wrapper for one (cache, block table, lengths) set."""

    def __init__(self, q_heads: int, cache: Any, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor):
        fi = load()
        if fi is None:
            raise RuntimeError(why_not())
        dev = cache.k_codes.device
        self.ws = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
        self.w = fi.BatchDecodeWithPagedKVCacheWrapper(self.ws, "HND", use_tensor_cores=True,
                                                       backend="fa2")
        indptr, indices, last = page_table(block_tables, seq_lens, cache.page_size)
        self.w.plan(indptr, indices, last, q_heads, cache.num_kv_heads, cache.head_dim,
                    cache.page_size, q_data_type=torch.bfloat16, kv_data_type=torch.uint8,
                    o_data_type=torch.bfloat16)
        self.cache = cache
        self.k_scale, self.v_scale = float(cache.k_scale), float(cache.v_scale)

    def __call__(self, q: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        c = self.cache
        return self.w.run(q, (c.k_codes, c.v_codes), kv_cache_sf=(c.k_sf, c.v_sf),
                          k_scale=self.k_scale, v_scale=self.v_scale, out=out)


def exact_bf16_query(q: torch.Tensor, cache: Any, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor) -> torch.Tensor:
    """Exact attention (float64 -> float32) of the BF16 query on the dequantized cache."""
    from resgen import reference as R

    ks, vs = [], []
    for b in range(q.shape[0]):
        n = int(seq_lens[b])
        if n == 0:
            empty = torch.zeros(cache.num_kv_heads, 0, cache.head_dim, dtype=torch.float64,
                                device=q.device)
            ks.append(empty)
            vs.append(empty)
            continue
        ku, vu = cache.gather_unit(block_tables[b], n)
        ks.append(ku * float(cache.k_scale))
        vs.append(vu * float(cache.v_scale))
    return R.attention_fp32(q.float(), ks, vs)


def check(q: torch.Tensor, cache: Any, block_tables: torch.Tensor, seq_lens: torch.Tensor,
          rows: slice | None = None) -> dict:
    """FlashInfer on (rows of) a batch vs exact_bf16_query: {"ok", "rel_err", "detail"}."""
    from resgen.search.attention_sm90 import compare

    if rows is not None:
        q, block_tables, seq_lens = q[rows], block_tables[rows], seq_lens[rows]
    out = torch.full_like(q, float("nan"))
    FlashInferDecode(q.shape[1], cache, block_tables, seq_lens)(q, out=out)
    if out.is_cuda:
        torch.cuda.synchronize()
    res = compare(out, exact_bf16_query(q, cache, block_tables, seq_lens), TOLERANCE)
    empty = seq_lens == 0
    if res.ok and bool(empty.any()) and bool(out[empty].float().abs().max() != 0):
        return {"ok": False, "rel_err": res.rel_err, "detail": "empty sequence not zero"}
    return {"ok": res.ok, "rel_err": res.rel_err, "detail": res.detail}


class Runner:
    """measure()-compatible runner over rotated sets [(q, cache, bt, sl)]."""

    def __init__(self, sets: list, out: torch.Tensor):
        self.ops = [FlashInferDecode(q.shape[1], c, bt, sl) for q, c, bt, sl in sets]
        self.qs = [s[0] for s in sets]
        self.out, self.cur = out, 0

    def rotate(self, i: int) -> None:
        self.cur = i % len(self.ops)

    def __call__(self) -> torch.Tensor:
        return self.ops[self.cur](self.qs[self.cur], out=self.out)


def time_sets(sets: list, out: torch.Tensor) -> dict:
    """Check (last batch row of set 0), then time FlashInfer over the point's rotated sets."""
    from resgen.search.timing import DEFAULT_POLICY, measure

    q, cache, bt, sl = sets[0]
    r = q.shape[0] - 1
    ck = check(q, cache, bt, sl, slice(r, r + 1))
    row: dict = {"check": ck, "us": None}
    if not ck["ok"]:
        return row
    t = measure(Runner(sets, out), DEFAULT_POLICY, n_sets=len(sets))
    row.update(us=t.median_us, q=t.quantiles_us, mode=t.mode, n_sets=t.n_sets,
               launches=t.launches, note=t.note)
    return row


def warm(out_dir: Path) -> int:
    """Device call A: import, JIT-compile and check the fa2 NVFP4 decode per geometry."""
    from resgen.kvcache import PagedKVCache

    t0 = time.time()
    rep: dict = {"version": version(), "why_not": why_not(), "geoms": []}
    if load() is not None:
        for hq, hkv, d in WARM_GEOMS:
            g = torch.Generator(device="cuda").manual_seed(d + hq)
            lens = [3000, 37, 1, 0]
            ks = [torch.randn(hkv, n, d, generator=g, device="cuda") for n in lens]
            vs = [torch.randn(hkv, n, d, generator=g, device="cuda") for n in lens]
            cache, bt, sl = PagedKVCache.from_dense(ks, vs, page_size=32)
            bt, sl = bt.to(torch.int32).contiguous(), sl.to(torch.int32)
            q = (torch.randn(len(lens), hq, d, generator=g, device="cuda") * 2).to(
                torch.bfloat16)
            t1 = time.time()
            try:
                res = check(q, cache, bt, sl)
            except Exception as e:
                res = {"ok": False, "error": f"{type(e).__name__}: {e}"[:2000]}
            res.update(geom=[hq, hkv, d], seconds=round(time.time() - t1, 1))
            rep["geoms"].append(res)
            print(json.dumps(res), flush=True)
    rep["seconds"] = round(time.time() - t0, 1)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "flashinfer_warm.json").write_text(json.dumps(rep, indent=1))
    ok = rep["geoms"] and all(g.get("ok") for g in rep["geoms"])
    print(f"flashinfer {rep['version']}: {'all checks passed' if ok else 'NOT usable'} "
          f"({rep['why_not'] or 'imported'}; {rep['seconds']} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    if "--warm" in sys.argv[1:]:
        raise SystemExit(warm(Path(os.environ.get("OUT", "bench/results/h200"))))
    print(__doc__)
