"""K-Ext folds in one tuning table: per (K-Ext ratio, M), the geometric mean over the shapes
that hold all three of best median K-Ext presum / plain and best median K-Ext exact / plain
(the same shape, format and static-scale setting; plain: compensation "none"). It says what
the tuner measured, layer kernel by kernel, before any `resgen bench` run:

    python3 bench/report/fold_table.py tuned/h200.sqlite.xz

Reads only rows with status 'ok' (compare_tables.best_medians). CPU only.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from compare_tables import best_medians  # noqa: E402

Shape = tuple[str, str, str, int, int, int, object]   # fmt, compensation, fold, m, n, k, static


def _shape(key: str) -> Shape:
    w = json.loads(key)
    return (w["fmt"], w["compensation"], w.get("fold", "exact"), int(w["m"]), int(w["n"]),
            int(w["k"]), w.get("static_scale"))


def fold_ratios(best: dict[str, float]) -> dict[tuple[float, int], tuple[int, float, float]]:
    """{(ratio, m): (shapes, geomean presum/plain, geomean exact/plain)} from {key: best us}."""
    by = {_shape(k): us for k, us in best.items()}
    agg: dict[tuple[float, int], list[tuple[float, float]]] = collections.defaultdict(list)
    for (fmt, comp, fold, m, n, k, st), us in by.items():
        if fold != "presum":
            continue
        exact = by.get((fmt, comp, "exact", m, n, k, st))
        plain = by.get((fmt, "none", "exact", m, n, k, st))
        if exact and plain:
            agg[(float(comp), m)].append((us / plain, exact / plain))

    def g(r: list[float]) -> float:
        return math.exp(sum(map(math.log, r)) / len(r))

    return {b: (len(r), g([p for p, _ in r]), g([e for _, e in r]))
            for b, r in sorted(agg.items())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("table", type=Path)
    a = ap.parse_args(argv)
    res = fold_ratios(best_medians(a.table, "linear"))
    if not res:
        print("no K-Ext presum workload with its exact fold and plain twin in the table")
        return 1
    print(f"{'ratio':>6}  {'M':>5}  {'shapes':>6}  {'presum/plain':>12}  {'exact/plain':>11}")
    for (ratio, m), (n, p, e) in res.items():
        print(f"{ratio:>6}  {m:>5}  {n:>6}  {p:>12.3f}  {e:>11.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
