"""Split-K for linear_sm90_wgmma at decode / mid-size M on the Qwen3-8B shapes, one process:

    source .devcache/device/env.sh && RESGEN_CACHE_DIR=/tmp/resgen-cache \\
        timeout -k 10 -s INT 400 python3 bench/probes/gpu_splitk_check.py      # JSON to $OUT

For every (shape, M in 16 / 32 / 64 / 128, NVFP4 plain and M-Ext):
  - "table": what the runtime dispatches from the shipped table (tuned/h200.sqlite.xz) for the
    workload, whole layer as the tuner times it (its linear_sm90_wgmma rows predate split-K and
    are stale, so this is the best linear_sm90_mma variant the table knows);
  - "wgmma": the prior's best variant of each distinct (consumers, m_wg, bn, split_k, stages,
    pdl) of the linear_sm90_wgmma space, the first RESGEN_SPLITK_TOP (default 8), each compiled,
    checked against
    resgen.reference.linear (fresh random inputs, NaN-poisoned output, rel err <= 3e-3) and, if
    correct, timed as the whole layer (quant_sm90 + GEMM);
  - cuBLAS BF16 (torch.matmul) on the same shape.
Timing: resgen.search.timing.measure with the default (cold-L2, CUDA-graph) policy, all in one
run. Prints a table last; writes $OUT/linear_wgmma_splitk_check.json. RESGEN_SPLITK_BUDGET_S
(default 330) stops starting new workloads.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # baselines

import torch  # noqa: E402

import baselines as B  # noqa: E402
from resgen import runtime  # noqa: E402
from resgen.cli import time_layer  # noqa: E402
from resgen.models import get_model  # noqa: E402
from resgen.search.family import get_family  # noqa: E402
from resgen.search.linear_sm90_wgmma import FAMILY  # noqa: E402
from resgen.search.record import current_environment  # noqa: E402
from resgen.search.timing import DEFAULT_POLICY, CallableRunner, measure  # noqa: E402
from resgen.search.variant import LinearProblem  # noqa: E402

ARCH = "sm_90a"
OUT = Path(os.environ.get("OUT", "bench/results/h200"))
TOP = int(os.environ.get("RESGEN_SPLITK_TOP", "8"))
BUDGET_S = float(os.environ.get("RESGEN_SPLITK_BUDGET_S", "330"))
SHAPES = get_model("qwen3-8b").linear_nk()
MS = (16, 64, 32, 128)
COMPS = ("full", "none")
_COMPILED: dict[tuple, object] = {}


def timed_layer(fam, v, p) -> dict:
    """Compile (once per compile key), check and time the whole layer of variant v
    (resgen.cli.time_layer, as `resgen bench` does)."""
    rec: dict = {"variant": v.name(), "split_k": getattr(v, "split_k", None)}
    try:
        t = time_layer(fam, v, p, ARCH, _COMPILED, DEFAULT_POLICY)
    except RuntimeError as e:                       # compile failure
        rec["error"] = str(e)[:400]
        return rec
    rec["rel_err"], rec["ok"] = t["check"]["rel_err"], bool(t["check"]["ok"])
    if "resgen_us" in t:
        rec["us"] = t["resgen_us"]
    else:
        rec["error"] = t["check"].get("detail", "")
    return rec


def distinct_top(p: LinearProblem) -> list:
    """The prior's best variant of each distinct (consumers, m_wg, bn, split_k, stages, pdl),
    first TOP."""
    seen, out = set(), []
    for c in sorted(FAMILY.space(p, ARCH), key=lambda c: FAMILY.prior(c, p)):
        key = (c.consumers, c.m_wg, c.bn, c.split_k, c.stages, c.pdl)
        if key not in seen:
            seen.add(key)
            out.append(c)
    return out[:TOP]


def main() -> int:
    t0 = time.time()
    env = current_environment()
    disp = runtime.Dispatcher()
    rows, table = [], []
    for m in MS:
        for name, (n, k) in SHAPES.items():
            for comp in COMPS:
                if time.time() - t0 > BUDGET_S:
                    break
                p = LinearProblem("nvfp4", comp, m, n, k)
                row: dict = {"shape": name, "n": n, "k": k, "m": m, "comp": comp}
                try:
                    v = disp.lookup("linear", p)
                    row["table"] = timed_layer(get_family(type(v).FAMILY), v, p)
                    row["table"]["source"] = disp.source("linear", p)
                    cands = distinct_top(p)
                    row["wgmma"] = [timed_layer(FAMILY, c, p) for c in cands]
                    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
                    sets = DEFAULT_POLICY.sets_for(n * k * 2)
                    ws = [w] + [torch.randn_like(w) for _ in range(sets - 1)]
                    row["bf16_us"] = measure(CallableRunner([B.cublas_bf16(x, wi) for wi in ws]),
                                             DEFAULT_POLICY, sets).median_us
                    del ws
                except Exception as e:
                    row["error"] = "".join(traceback.format_exception(e)[-4:])[:800]
                rows.append(row)
                ok = [c for c in row.get("wgmma", []) if "us" in c]
                best = min(ok, key=lambda c: c["us"]) if ok else None
                tus = row.get("table", {}).get("us")
                table.append((name, m, comp, tus, best and best["us"], best and best["variant"],
                              row.get("bf16_us"),
                              sum(1 for c in row.get("wgmma", []) if not c.get("ok"))))
                torch.cuda.empty_cache()
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "linear_wgmma_splitk_check.json").write_text(json.dumps(
        {"environment": env.as_dict(), "policy": DEFAULT_POLICY.as_dict(),
         "date": time.strftime("%Y-%m-%d %H:%M:%S"), "rows": rows}, indent=1))
    f = lambda x: f"{x:.2f}" if x else "-"                          # noqa: E731
    print(f"{'shape':8} {'M':>4} {'comp':5} {'table us':>9} {'wgmma us':>9} {'ratio':>6} "
          f"{'bf16 us':>8} {'bad':>3}  best wgmma variant")
    for name, m, comp, tus, wus, wv, bus, bad in table:
        r = f"{tus / wus:.2f}" if tus and wus else "-"
        print(f"{name:8} {m:>4} {comp:5} {f(tus):>9} {f(wus):>9} {r:>6} {f(bus):>8} {bad:>3}  "
              f"{wv or '-'}")
    print(f"{time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
