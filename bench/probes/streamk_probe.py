"""Does stream-K (persistent CTAs, linear_sm90_wgmma's `streamk` axis) beat the grid schedule
at serving M? Qwen3-8B's four projections, NVFP4, plain at M = 16 / 64 / 128 / 512 / 2048 and
M-Ext at M = 64 / 128: per (shape, M) the shipped table's fastest timed linear_sm90_wgmma row
(and at M = 16 the dispatched linear_sm90_mma row, the table's best overall), then that
winner's stream-K twins (split_k 1, no PDL, one and, with one consumer warpgroup, two CTAs per
SM) and the stream-K variant the prior ranks first with its twins. Every variant is checked against
resgen.reference.linear before it is timed as the whole layer under the tuner's policy
(bench/probes/layer_probe.py). About five minutes:

    source .devcache/device/env.sh && RESGEN_CACHE_DIR=/tmp/resgen-cache \\
        timeout -k 5 -s INT 330 python3 bench/probes/streamk_probe.py      # JSON to $OUT
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from layer_probe import summarized_probe, table_best  # noqa: E402
from resgen.search.family import get_family  # noqa: E402
from resgen.search.linear_sm90_wgmma import FAMILY  # noqa: E402
from resgen.search.variant import LinearProblem  # noqa: E402

SHAPES = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]
# most informative first (a run cut by its time limit keeps these)
CASES = [("none", 64), ("none", 128), ("full", 64), ("none", 16), ("none", 2048), ("none", 512),
         ("full", 128)]


def twins(v):
    """The grid winner's stream-K twins that are valid in principle (why_invalid decides)."""
    base = dataclasses.replace(v, split_k=1, pdl=False)
    out = [dataclasses.replace(base, streamk=1)]
    if v.consumers == 1:
        out.append(dataclasses.replace(base, streamk=2))
    return out


def cases():
    families = ("linear_sm90_wgmma", "linear_sm90_mma")
    best_any = table_best(families)
    best_wg = table_best(["linear_sm90_wgmma"])
    only = os.environ.get("STREAMK_ONLY")          # e.g. "none:64" to run one point
    for comp, m in CASES:
        if only and only != f"{comp}:{m}":
            continue
        for n, k in SHAPES:
            p = LinearProblem("nvfp4", comp, m, n, k)
            seen = set()
            rows = []
            if p.key() in best_any and best_any[p.key()][1] != FAMILY.NAME:
                _, fam, v = best_any[p.key()]
                rows.append((fam, v, "table"))
            if p.key() in best_wg:
                v = best_wg[p.key()][2]
                rows.append((FAMILY.NAME, v, "table" if not rows else "wgmma"))
                rows += [(FAMILY.NAME, t, "twin") for t in twins(v)]
            # the prior's first stream-K pick: in session 36's run the space enumerated stream-K
            # variants (ranked with no wave cost); it no longer does, so a rerun takes the
            # stream-K twins of the prior's first grid variant instead
            sk = [v for v in FAMILY.space(p, "sm_90a") if v.streamk]
            if sk:
                pick = min(sk, key=lambda v: FAMILY.prior(v, p))
                rows.append((FAMILY.NAME, pick, "prior"))
                rows += [(FAMILY.NAME, t, "prior") for t in twins(pick)]
            else:
                grid = min(FAMILY.space(p, "sm_90a"), key=lambda v: FAMILY.prior(v, p))
                rows += [(FAMILY.NAME, t, "prior") for t in twins(grid)]
            for fam, v, role in rows:
                if (fam, v.key()) in seen:
                    continue
                seen.add((fam, v.key()))
                yield p, get_family(fam), v, {"m": m, "role": role}


def summary(rows):
    """Per (comp, M, shape): the table's time, the best stream-K time and their ratio; and
    per (comp, M) the four-shape sums."""
    by: dict = {}
    for r in rows:
        if not r.get("us"):
            continue
        key = (r["comp"], r["m"], f"{r['n']}x{r['k']}")
        d = by.setdefault(key, {})
        if r["role"] == "table":
            d["table_us"] = r["us"]
        if "_ps" in r["variant"]:
            if r["us"] < d.get("streamk_us", 1e30):
                d["streamk_us"], d["streamk_variant"] = r["us"], r["variant"]
    out = {"per_shape": [], "sums": []}
    sums: dict = {}
    for (comp, m, shape), d in sorted(by.items()):
        if "table_us" in d and "streamk_us" in d:
            best = min(d["table_us"], d["streamk_us"])
            out["per_shape"].append({"comp": comp, "m": m, "shape": shape, **d,
                                     "streamk_over_table": d["streamk_us"] / d["table_us"]})
            s = sums.setdefault((comp, m), [0.0, 0.0, 0])
            s[0] += d["table_us"]
            s[1] += best
            s[2] += 1
    for (comp, m), (t, b, c) in sorted(sums.items()):
        out["sums"].append({"comp": comp, "m": m, "shapes": c, "table_us": t,
                            "best_with_streamk_us": b, "ratio": b / t})
    return out


def main() -> int:
    rc, doc = summarized_probe("streamk_probe", cases(),
                               tag=lambda r: f"M={r['m']:<5d} {r['role']:6s} ",
                               summary=summary)
    print("comp  M     shapes  table us  with stream-K us  ratio")
    for s in doc["summary"]["sums"]:
        print(f"{s['comp']:5s} {s['m']:<5d} {s['shapes']:6d}  {s['table_us']:8.2f}  "
              f"{s['best_with_streamk_us']:16.2f}  {s['ratio']:.3f}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
