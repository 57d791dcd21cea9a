"""Compare two tuning tables: per bucket, the geometric mean (and range) over the workloads of
one op that both tables hold of old best median / new best median (> 1: the new table is
faster). Buckets: M for linear layers, (batch, KV length) for decode attention, else the op.

    python3 bench/report/compare_tables.py OLD.sqlite[.xz] NEW.sqlite[.xz] [--op decode_attention]

Reads only the `results` / `workloads` rows with status 'ok' (the best median per workload,
whatever family or variant won); both files are opened read-only (an .xz table is unpacked to
a temporary file first). CPU only.
"""

from __future__ import annotations

import argparse
import collections
import json
import lzma
import math
import shutil
import sqlite3
import tempfile
from pathlib import Path


def bucket_of(key: str) -> str:
    """The bucket a workload key (its JSON) is reported in."""
    w = json.loads(key)
    if "m" in w:
        return f"M={w['m']}"
    if "batch" in w and "kv_len" in w:
        return f"B={w['batch']} KV={w['kv_len']}"
    return str(w.get("op", "?"))


def best_medians(path: Path, op: str) -> dict[str, float]:
    """{workload key (JSON): best ok median in us} of one table's workloads of `op`."""
    with tempfile.TemporaryDirectory() as tmp:
        db = path
        if path.suffix == ".xz":
            db = Path(tmp) / "table.sqlite"
            with lzma.open(path) as src, open(db, "wb") as dst:
                shutil.copyfileobj(src, dst)
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
        try:
            rows = con.execute(
                "SELECT w.key, MIN(r.median_us) "
                "FROM results r JOIN workloads w ON w.id = r.workload_id "
                "WHERE r.status = 'ok' AND w.op = ? GROUP BY w.id", (op,)).fetchall()
        finally:
            con.close()
    return {str(k): float(us) for k, us in rows if us is not None and us > 0}


def compare(old: dict[str, float], new: dict[str, float]
            ) -> dict[str, tuple[int, float, float, float]]:
    """{bucket: (workloads, geometric mean, min, max) of old / new} over shared workloads,
    buckets in order, then "all" over every shared workload."""
    by: dict[str, list[float]] = collections.defaultdict(list)
    for key, t_old in old.items():
        if key in new:
            by[bucket_of(key)].append(t_old / new[key])

    def order(b: str) -> tuple:
        return tuple(int(t) if t.isdigit() else t for t in b.replace("=", " ").split())

    def summary(r: list[float]) -> tuple[int, float, float, float]:
        return len(r), math.exp(sum(map(math.log, r)) / len(r)), min(r), max(r)

    out = {b: summary(r) for b, r in sorted(by.items(), key=lambda kv: order(kv[0]))}
    if by:
        out["all"] = summary([x for r in by.values() for x in r])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old", type=Path)
    ap.add_argument("new", type=Path)
    ap.add_argument("--op", default="linear")
    a = ap.parse_args(argv)
    res = compare(best_medians(a.old, a.op), best_medians(a.new, a.op))
    if not res:
        print("no workload in both tables")
        return 1
    print(f"{'bucket':<18}  {'workloads':>9}  {'geomean old/new':>15}  {'min':>6}  {'max':>6}")
    for b, (n, g, lo, hi) in res.items():
        print(f"{b:<18}  {n:>9}  {g:>15.4f}  {lo:>6.3f}  {hi:>6.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
