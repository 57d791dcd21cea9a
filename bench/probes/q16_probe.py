"""H200 probe of Q16 decode attention (FP16 query x NVFP4 K/V, the query never quantized; issue
20 section 2) against ResAttn and plain NVFP4-KV, the same family and cache layout: is Q16 at
plain cost? (and, with RESGEN_FLASHINFER set, FlashInfer's fa2 NVFP4-KV decode, which also
keeps a 16-bit query, on the same cache bytes: bench/flashinfer_peer.py says how it travels).

    source .devcache/device/env.sh && RESGEN_CACHE_DIR=/tmp/resgen-cache \\
        timeout -k 10 -s INT 540 python3 bench/probes/q16_probe.py

Points: Qwen3-8B (32/8/128) and Qwen3-32B (64/8/128) x batch {1, 8, 32} x KV {32K, 8K} (32K
first). Per point and mode (q16, plain, resattn) the fallback rule's variant and the same with
twice / half its split count (one compile per rendered kernel serves every split count), and
the variant the runtime dispatches from the shipped table for that mode (tuned/h200.sqlite.xz
holds Q16, plain and ResAttn rows; marked "table": true in the JSON); each
is checked against resgen.reference.decode_attention (the family runner's check: fresh inputs,
NaN-poisoned output, the mode's own reference) and timed under the tuner's policy
(DEFAULT_POLICY: CUDA graph, input sets rotated past 2 x L2, median); the fastest correct one
per mode is kept. RESGEN_BENCH_BUDGET_S (default 480 s from the start) stops starting new
points; $OUT/q16_probe.json is rewritten after every point, a short table is printed last.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
for _p in (ROOT, ROOT / "bench"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

ARCH = "sm_90a"
GEOMS = {"qwen3-8b": (32, 8, 128), "qwen3-32b": (64, 8, 128)}
BATCHES = (1, 8, 32)
KV_LENS = (32768, 8192)
MODES = {"q16": dict(compensation=False, query="q16"),
         "plain": dict(compensation=False, query="nvfp4"),
         "resattn": dict(compensation=True, query="nvfp4")}


def points() -> list[tuple[str, int, int]]:
    """(geometry, batch, KV length) in run order: KV 32K first, then 8K."""
    return [(g, b, n) for n in KV_LENS for g in GEOMS for b in BATCHES]


def problem(geom: str, batch: int, kv_len: int, mode: str):
    from resgen.search.variant import AttentionProblem

    hq, hkv, d = GEOMS[geom]
    return AttentionProblem(batch=batch, q_heads=hq, kv_heads=hkv, head_dim=d, kv_len=kv_len,
                            **MODES[mode])


def candidates(p, table: Any = None) -> list:
    """The fallback rule's variant and the same with 2x / 0.5x its split count (valid ones),
    then `table` (the variant the runtime dispatches from the shipped table for p's mode,
    gpu_attention_check.table_variant; None where the table has no row):
    bench/gpu_attention_check.py's candidate rule."""
    from gpu_attention_check import resattn_candidates

    return resattn_candidates(p, table)


def compile_identity(v, p) -> str:
    """What a compile depends on (the rendered parameters: no split count, batch or length)."""
    from resgen.search.attention_sm90 import FAMILY

    return json.dumps(FAMILY.template_params(v, FAMILY.compile_key(v, p)), sort_keys=True)


def summary(rows: list[dict]) -> list[str]:
    """The short table: per point the best us of each mode and Q16's ratios (CPU-testable)."""
    lines = [f"{'point':28s} {'q16':>9s} {'plain':>9s} {'resattn':>9s} {'fi':>9s} "
             f"{'q16/plain':>9s} {'q16/res':>9s}"]
    for r in rows:
        us = {m: ((r.get(m) or {}).get("best") or {}).get("us") for m in MODES}
        fi = (r.get("flashinfer") or {}).get("us")

        def f(x: Any) -> str:
            return f"{x:9.2f}" if isinstance(x, (int, float)) else f"{'-':>9s}"

        def ratio(a: Any, b: Any) -> str:
            return f"{a / b:9.3f}" if a and b else f"{'-':>9s}"

        lines.append(f"{r['point']:28s} {f(us['q16'])} {f(us['plain'])} {f(us['resattn'])} "
                     f"{f(fi)} {ratio(us['q16'], us['plain'])} {ratio(us['q16'], us['resattn'])}")
    return lines


def main() -> int:
    import torch

    import flashinfer_peer
    from resgen.search.attention_sm90 import FAMILY
    from resgen.search.build import compile_variant
    from resgen.search.timing import DEFAULT_POLICY, measure
    from resgen.search.tuner import working_set_bytes

    t0 = time.time()
    budget = float(os.environ.get("RESGEN_BENCH_BUDGET_S", "480"))
    out_dir = Path(os.environ.get("OUT", "bench/results/h200"))
    out_dir.mkdir(parents=True, exist_ok=True)
    fi = flashinfer_peer.load()
    compiled: dict[str, Any] = {}
    rows: list[dict] = []
    ok_all = True
    for geom, batch, kv in points():
        if time.time() - t0 > budget:
            print(f"budget of {budget:.0f} s spent: stopping before {geom} b={batch} kv={kv}")
            break
        row: dict[str, Any] = {"point": f"{geom} b={batch} kv={kv // 1024}K", "geometry": geom,
                               "batch": batch, "kv_len": kv}
        fi_sets = None
        for mode in MODES:
            p = problem(geom, batch, kv, mode)
            ent: dict[str, Any] = {"problem": json.loads(p.key()), "variants": []}
            from gpu_attention_check import table_variant

            tv = table_variant(p)
            for v in candidates(p, tv):
                rec: dict[str, Any] = {"variant": v.name(), "table": v == tv}
                try:
                    ident = compile_identity(v, p)
                    if ident not in compiled:
                        compiled[ident] = compile_variant(FAMILY, v, p, ARCH)
                    c = compiled[ident]
                    if not c.ok:
                        raise RuntimeError(c.error)
                    rec["registers"] = c.registers
                    n_sets = DEFAULT_POLICY.sets_for(working_set_bytes(FAMILY, v, p))
                    runner = FAMILY.runner(c.compiled, v, p, "cuda", n_sets=n_sets, seed=0)
                    chk = runner.check()
                    rec.update(ok=chk.ok, rel_err=chk.rel_err)
                    if chk.ok:
                        t = measure(runner, DEFAULT_POLICY, n_sets)
                        rec.update(us=t.median_us, q=t.quantiles_us, n_sets=t.n_sets)
                        if mode == "q16" and fi_sets is None:
                            fi_sets = (runner.sets, runner.out)
                    else:
                        rec["detail"] = chk.detail
                        ok_all = False
                    del runner
                except Exception as e:            # compile or launch failure: recorded
                    rec.update(error=f"{type(e).__name__}: {e}"[:600],
                               trace=traceback.format_exc()[-1500:])
                    ok_all = False
                ent["variants"].append(rec)
                print(f"{row['point']:28s} {mode:8s} {v.name():58s} "
                      + (f"{rec['us']:9.2f} us rel {rec['rel_err']:.1e}" if rec.get("us")
                         else str(rec.get("detail") or rec.get("error"))[:100]), flush=True)
            timed = [r for r in ent["variants"] if r.get("us")]
            ent["best"] = min(timed, key=lambda r: r["us"]) if timed else None
            row[mode] = ent
        if fi is not None and fi_sets is not None:
            try:
                row["flashinfer"] = flashinfer_peer.time_sets(*fi_sets)
            except Exception as e:
                row["flashinfer"] = {"error": f"{type(e).__name__}: {e}"[:600]}
        fi_sets = None
        rows.append(row)
        torch.cuda.empty_cache()
        (out_dir / "q16_probe.json").write_text(json.dumps(
            {"gpu": torch.cuda.get_device_name(), "policy": DEFAULT_POLICY.as_dict(),
             "flashinfer": flashinfer_peer.version() or
             f"not measured: {flashinfer_peer.why_not()}",
             "seconds": round(time.time() - t0, 1), "rows": rows}, indent=1))
    print("\n".join(summary(rows)))
    return 0 if ok_all else 1


if __name__ == "__main__":
    sys.exit(main())
