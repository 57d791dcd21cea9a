"""Summarize bench/probes/ncu_decode_m1.py's Nsight Compute CSV: one row per profiled variant (the
second of its two launches), the figures that say what bounds a small decode layer.

    python bench/report/ncu_summary.py bench/results/h200/ncu_decode_m1.csv.xz \\
        bench/results/h200/ncu_decode_m1.order.txt > bench/results/h200/ncu_decode_m1.md
"""

from __future__ import annotations

import csv
import io
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "probes"))   # SHAPES

from ncu_decode_m1 import SHAPES  # noqa: E402
from report_io import read_text  # noqa: E402

COLUMNS = (("Duration", "us", 1e-3), ("DRAM Throughput", "DRAM %", 1.0),
           ("Compute (SM) Throughput", "SM %", 1.0), ("L2 Cache Throughput", "L2 %", 1.0),
           ("Achieved Occupancy", "occ %", 1.0), ("Theoretical Occupancy", "theor. occ %", 1.0),
           ("Grid Size", "CTAs", 1.0), ("Waves Per SM", "waves", 1.0),
           ("Issued Warp Per Scheduler", "issue/sched", 1.0),
           ("No Eligible", "no eligible %", 1.0),
           ("Warp Cycles Per Issued Instruction", "cyc/issue", 1.0),
           ("SM Frequency", "SM GHz", 1e-9))


def _num(s: str) -> float:
    return float(s.replace(",", ""))


def load(csv_path: Path) -> dict[int, dict[str, float]]:
    """Kernel launch ID -> {metric name: value} (numeric metrics only)."""
    text = "".join(line for line in read_text(csv_path).splitlines(True)
                   if not line.startswith("=="))
    out: dict[int, dict[str, float]] = {}
    for r in csv.DictReader(io.StringIO(text)):
        try:
            out.setdefault(int(r["ID"]), {})[r["Metric Name"]] = _num(r["Metric Value"])
        except (KeyError, ValueError):
            continue
    return out


def table(csv_path: Path, order_path: Path) -> list[str]:
    import baselines as B

    launches = load(csv_path)
    names = [ln.split() for ln in order_path.read_text().splitlines() if ln.strip()]
    head = ["shape", "mode", "variant", "floor us"] + [c[1] for c in COLUMNS] + ["% of floor"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for i, (shape, mode, name) in enumerate(names):
        m = launches.get(2 * i + 1)              # second launch of the pair
        if m is None:
            continue
        n, k = SHAPES[shape]
        floor = B.floor_us(B.nvfp4_weight_bytes(n, k))
        cells = [shape, mode, name.split(":", 1)[1], f"{floor:.2f}"]
        for metric, _, scale in COLUMNS:
            v = m.get(metric)
            cells.append("-" if v is None else f"{v * scale:.3g}")
        dur = m.get("Duration")
        cells.append("-" if not dur else f"{100 * floor / (dur * 1e-3):.0f}")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


if __name__ == "__main__":
    print("\n".join(table(Path(sys.argv[1]), Path(sys.argv[2]))))
