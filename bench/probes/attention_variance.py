"""How much one attention_sm90 variant's timing moves with its random inputs (GPU, ~2 minutes).

attention_sm90_check3 timed the table's ResAttn variant for Qwen3-8B, batch 32, KV 128K
(s8, last-CTA reduction) at 1749 us, where tune11 had measured the same variant at 1316 us and
ranked it first; the check's best candidate (s4) took 1437 us there (tuner: 1377 us). Both
measurements use resgen.search.timing.DEFAULT_POLICY-style CUDA-graph timing on random paged
caches with shuffled pages (resgen.search.attention_sm90.random_cache), but different seeds.
This probe separates the two explanations: input dependence (the page order of one random
cache) and run-to-run noise.

For each point and variant: check against the reference (bench/gpu_attention_check.py's
_check), then, for seeds 1..SEEDS (fresh caches each), measure twice, variants interleaved.

    source .devcache/device/env.sh && RESGEN_CACHE_DIR=/tmp/resgen-cache \\
        timeout -k 5 -s INT 200 python3 bench/probes/attention_variance.py     # JSON to $OUT
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for _p in (ROOT, ROOT / "tests" / "gpu", ROOT / "bench"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import torch  # noqa: E402

import gpu_attention_check as A  # noqa: E402
from resgen.search.attention_sm90 import AttentionSm90Variant  # noqa: E402

SEEDS = 3
# (geom, batch, kv_len) -> split counts to compare (w4, kc32, pair, last-CTA, prefetch)
POINTS = {("qwen3-8b", 32, 131072): (2, 4, 8), ("qwen3-32b", 32, 8192): (4, 8)}


def variant(splits: int) -> AttentionSm90Variant:
    return AttentionSm90Variant.from_key(json.dumps(
        {"family": "attention_sm90", "kc": 32, "num_warps": 4, "packing": "pair",
         "prefetch": True, "reduction": "lastcta", "splits": splits},
        sort_keys=True, separators=(",", ":")))


def main() -> int:
    import test_attention_sm90_gpu as T
    from resgen.kernels.attention_sm90 import DecodeAttentionSm90
    from resgen.search.attention_sm90 import shape_of
    from resgen.search.timing import DEFAULT_POLICY, measure

    out = Path(os.environ.get("OUT", ROOT / "bench" / "results" / "h200"))
    bench = A.Bench(out, 1e9)
    rows = []
    for (geom, b, n), splits in POINTS.items():
        p = A.problem_of(geom, b, n)
        ops = {}
        for s in splits:
            v = variant(s)
            ck = A._check(bench, v, p)
            if not ck["ok"]:
                print(f"{geom} B={b} L={n} s{s}: CHECK FAILED {ck['detail'][:200]}")
                continue
            ops[s] = DecodeAttentionSm90(T.compiled(v, p).compiled, shape_of(v, p), v.splits)
        n_sets = DEFAULT_POLICY.sets_for(A.decode_hbm_bytes([n] * b, p.kv_heads, p.head_dim,
                                                            p.q_heads))
        for seed in range(1, SEEDS + 1):
            sets = A._Sets(p, n_sets, seed=seed)
            for rep in range(2):
                for s, op in ops.items():
                    t = measure(A._OpRunner(op, sets), DEFAULT_POLICY, n_sets=n_sets)
                    rows.append({"geom": geom, "batch": b, "kv_len": n, "splits": s,
                                 "seed": seed, "rep": rep, "us": t.median_us,
                                 "q": t.quantiles_us, "n_sets": t.n_sets})
            del sets
            torch.cuda.empty_cache()
    out.mkdir(parents=True, exist_ok=True)
    (out / "attention_variance.json").write_text(json.dumps(
        {"gpu": torch.cuda.get_device_name(0), "policy": DEFAULT_POLICY.as_dict(),
         "rows": rows, "errors": bench.report.get("errors", [])}, indent=1))
    print(f"{'point':24s} {'s':>3s} " + " ".join(f"seed{k}:r0/r1".rjust(16)
                                                 for k in range(1, SEEDS + 1)) + "  spread")
    for (geom, b, n), splits in POINTS.items():
        for s in splits:
            rs = [r for r in rows if (r["geom"], r["batch"], r["kv_len"], r["splits"])
                  == (geom, b, n, s)]
            if not rs:
                continue
            cells = []
            for k in range(1, SEEDS + 1):
                us = [r["us"] for r in rs if r["seed"] == k]
                cells.append("/".join(f"{u:.0f}" for u in us).rjust(16))
            allus = [r["us"] for r in rs]
            print(f"{geom + f' B={b} L={n // 1024}K':24s} {s:3d} " + " ".join(cells)
                  + f"  {max(allus) / min(allus):.2f} (median {statistics.median(allus):.0f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
