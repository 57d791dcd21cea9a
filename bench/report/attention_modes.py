"""Decode-attention modes of one tuning table against each other: per workload geometry
(heads, head dim, batch, KV length, P.V), the best tuned median of the Q16 query over that of
plain NVFP4-KV and of ResAttn; min / median / max over the geometries that have all three.
The medians come from the tune runs that stored them (not one run: no one-run ratio).

    python3 bench/report/attention_modes.py [tuned/h200.sqlite.xz]

CPU only; reads the table read-only through compare_tables.best_medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from compare_tables import best_medians  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def mode_of(w: dict) -> str:
    """q16 / resattn / plain of a decode-attention workload key."""
    if w.get("query") == "q16":
        return "q16"
    return "resattn" if w.get("compensation") else "plain"


def ratios(table: Path) -> dict[str, list[float]]:
    """{"q16/plain": [...], "q16/resattn": [...]} over geometries with all three modes."""
    best: dict[tuple, dict[str, float]] = {}
    for key, us in best_medians(table, "decode_attention").items():
        w = json.loads(key)
        geom = (w["q_heads"], w["kv_heads"], w["head_dim"], w["batch"], w["kv_len"], w.get("pv"))
        best.setdefault(geom, {})[mode_of(w)] = us
    full = [m for m in best.values() if len(m) == 3]
    return {f"q16/{o}": [m["q16"] / m[o] for m in full] for o in ("plain", "resattn")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("table", nargs="?", type=Path, default=ROOT / "tuned" / "h200.sqlite.xz")
    a = ap.parse_args(argv)
    if not a.table.is_file():
        ap.error(f"no tuning table at {a.table}")
    rows = ratios(a.table)
    if not rows["q16/plain"]:
        ap.error(f"{a.table} has no geometry tuned in all three modes (q16, plain, resattn)")
    for name, rs in rows.items():
        print(f"{name}: {len(rs)} geometries, min {min(rs):.2f}, median "
              f"{statistics.median(rs):.2f}, max {max(rs):.2f} (tuned medians; > 1: Q16 slower)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
