"""Where the M = 1 decode layers lose time: the best whole-layer linear_sm90_mma variants of the
H200 benchmark (bench/results/h200/final_linear_sm90_check.json.xz: kind "layer", no PDL, graph
timing) for the four Qwen3-8B shapes, NVFP4 plain and M-Ext, launched under Nsight Compute.

    source .devcache/device/env.sh && ncu --clock-control none \\
        --kernel-name regex:kernel_cutlass_linear --section SpeedOfLight --section Occupancy \\
        --section LaunchStats --section WarpStateStats --section SchedulerStats --csv \\
        --page details --log-file $OUT/ncu_decode_m1.csv \\
        python3 bench/probes/ncu_decode_m1.py > $OUT/ncu_decode_m1.order.txt

(--clock-control none: real boost clocks; ncu's default locks the SM at base clock, 1.33 GHz.)

Each variant is launched twice (the first launch warms instruction caches and TLBs); the
order file names the variant of every pair of profiled launches. bench/report/ncu_summary.py
turns the CSV into a table.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

sys.path[:0] = [str(ROOT / "bench"), str(ROOT / "bench" / "report")]

from resgen.models import get_model  # noqa: E402

_QWEN3_8B = get_model("qwen3-8b").linear_nk()
# the Qwen3-8B projections the retired gpu_linear_check.py measured, in its order
SHAPES = {name: _QWEN3_8B[name] for name in ("gate_up", "down", "qkv", "o")}
from report_io import load_json  # noqa: E402


def best_variants() -> list[tuple[str, str, str]]:
    """(shape, mode, variant key) of the fastest non-PDL whole-layer M = 1 NVFP4 timings."""
    d = load_json(ROOT / "bench/results/h200/final_linear_sm90_check.json.xz")
    best: dict[tuple[str, str], dict] = {}
    for t in d["tasks"]:
        if (t.get("kind") == "layer" and not t.get("pdl") and t.get("timing_mode") == "graph"
                and t.get("fmt") == "nvfp4" and t.get("m") == 1
                and t.get("mode") in ("none", "full") and t.get("median_us")):
            k = (t["shape"], t["mode"])
            if k not in best or t["median_us"] < best[k]["median_us"]:
                best[k] = t
    return [(s, m, best[(s, m)]["variant"]) for s in SHAPES for m in ("none", "full")
            if (s, m) in best]


def main() -> None:
    sys.path.insert(0, str(ROOT / "bench" / "probes"))
    import layer_probe

    from resgen.search.linear_sm90_mma import FAMILY, LinearSm90Variant
    from resgen.search.variant import LinearProblem

    for shape, mode, key in best_variants():
        n, k = SHAPES[shape]
        p = LinearProblem("nvfp4", mode, 1, n, k)
        v = LinearSm90Variant.from_key(key)
        layer_probe.launch_twice(FAMILY, v, p, f"{shape} {mode} {v.name()}")


if __name__ == "__main__":
    main()
