"""The FP4 linear-layer targets of the Hopper kernel issue, computed from `resgen bench` reports
(one run each, whole layers, what the runtime dispatches), so every closing figure comes from
one committed file and one command:

    python bench/report/linear_targets.py     # writes bench/results/h200/linear_targets.md

Inputs: --decode (default bench/results/h200/bench_qwen3_8b_table14b.json.xz, M = 1..128) and
--prefill (default bench_qwen3_8b_table12_prefill.json.xz, M = 256..2048), rows with
check.ok. Every ratio is a ratio of four-shape sums (qkv, o, gate/up, down of the model) of
medians measured in the same report:
- decode speed-up: sum over the shapes and every measured M in 1..16 of cuBLAS BF16 (FP8) /
  the same sum for resgen NVFP4 plain;
- floor share at M = 1: the NVFP4 HBM floor / resgen NVFP4 plain, per layer (gate/up, down);
- M-Ext / plain per M in 1..64 (NVFP4; the target holds if the largest is <= 1.03);
- MXFP4 M-Ext vs Triton's MXFP4 x BF16 path per M in 1..64 (the target: every one >= 5);
- prefill, M = 1024 and 2048: plain NVFP4 vs cuBLAS BF16, K-Ext 0.125 / plain, and full K-Ext
  (ratio 1.0) / full M-Ext.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from report_io import load_json, mode  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "results" / "h200"
DECODE_JSON = RESULTS / "bench_qwen3_8b_table14b.json.xz"
PREFILL_JSON = RESULTS / "bench_qwen3_8b_table12_prefill.json.xz"
GATE_UP_DOWN = {"gate/up": lambda n, k: n > 2 * k, "down": lambda n, k: k > 2 * n}

Key = tuple[str, str, int]                 # (fmt, mode: report_io.mode, m)
Row = tuple[str, str, float, bool]         # (target, how it is measured, value, met)


def sums(report: dict, field: str) -> dict[Key, float]:
    """Four-shape sums of `field` per (fmt, mode, m) (mode: the compensation, "+presum" for
    the K-Ext presum fold), over rows whose check passed and that have the field; a key is
    kept only if every shape of the report has it."""
    acc: dict[Key, dict[tuple[int, int], float]] = defaultdict(dict)
    shapes = set()
    for r in report["rows"]:
        p = r["problem"]
        shapes.add((p["n"], p["k"]))
        v = r.get(field)
        if (r.get("check") or {}).get("ok") and isinstance(v, (int, float)):
            acc[(p["fmt"], mode(p), int(p["m"]))][(p["n"], p["k"])] = float(v)
    return {k: sum(d.values()) for k, d in acc.items() if set(d) == shapes}


def decode_targets(report: dict) -> list[Row]:
    """The target rows of the decode range."""
    res, bf, f8 = (sums(report, f) for f in ("resgen_us", "bf16_us", "fp8_us"))
    tri = sums(report, "triton_us")
    ms = sorted({m for (f, c, m) in res if f == "nvfp4" and c == "none" and m <= 16})
    out: list[Row] = []
    if ms:
        base = sum(res[("nvfp4", "none", m)] for m in ms)
        for name, ref, goal in (("cuBLAS BF16", bf, 3.5), ("cuBLAS FP8", f8, 2.0)):
            if all(("nvfp4", "none", m) in ref for m in ms):
                x = sum(ref[("nvfp4", "none", m)] for m in ms) / base
                out.append((f"decode M = 1..16 >= {goal}x {name}",
                            f"sum over 4 shapes x M = {', '.join(map(str, ms))}", x, x >= goal))
    for layer, is_layer in GATE_UP_DOWN.items():
        for r in report["rows"]:
            p = r["problem"]
            if (p["fmt"], p["compensation"], p["m"]) == ("nvfp4", "none", 1) and \
                    is_layer(p["n"], p["k"]) and (r.get("check") or {}).get("ok"):
                x = r["floor_us"] / r["resgen_us"]
                out.append((f"{layer} >= 85% of the NVFP4 floor",
                            f"M = 1, {p['n']} x {p['k']}", x, x >= 0.85))
    for m in sorted({m for (f, c, m) in res if f == "nvfp4" and c == "full" and m <= 64}):
        if ("nvfp4", "none", m) in res:
            x = res[("nvfp4", "full", m)] / res[("nvfp4", "none", m)]
            out.append(("M-Ext / plain <= 1.03", f"NVFP4, M = {m}", x, x <= 1.03))
    for m in sorted({m for (f, c, m) in res if f == "mxfp4" and c == "full" and m <= 64}):
        if ("mxfp4", "full", m) in tri:
            x = tri[("mxfp4", "full", m)] / res[("mxfp4", "full", m)]
            out.append(("MXFP4 M-Ext >= 5x Triton", f"M = {m}", x, x >= 5.0))
    return out


def prefill_targets(report: dict) -> list[Row]:
    """The target rows of the prefill range."""
    res, bf = sums(report, "resgen_us"), sums(report, "bf16_us")
    out: list[Row] = []
    for m in (1024, 2048):
        pl = res.get(("nvfp4", "none", m))
        if pl is None:
            continue
        if ("nvfp4", "none", m) in bf:
            x = bf[("nvfp4", "none", m)] / pl
            out.append(("plain >= 0.9x cuBLAS BF16", f"NVFP4, M = {m}", x, x >= 0.9))
        if ("nvfp4", "0.125", m) in res:
            x = res[("nvfp4", "0.125", m)] / pl
            out.append(("K-Ext 0.125 / plain <= 1.10", f"NVFP4, M = {m}", x, x <= 1.10))
        if ("nvfp4", "1.0", m) in res and ("nvfp4", "full", m) in res:
            x = res[("nvfp4", "1.0", m)] / res[("nvfp4", "full", m)]
            out.append(("full M-Ext >= 1.5x faster than full K-Ext",
                        f"K-Ext 1.0 / M-Ext, NVFP4, M = {m}", x, x >= 1.5))
    return out


def render(decode: dict, prefill: dict | None, sources: tuple[str, str]) -> str:
    rows = decode_targets(decode) + (prefill_targets(prefill) if prefill else [])
    lines = ["# linear_targets: the Hopper kernel issue's linear-layer targets", "",
             "Generated by `python bench/report/linear_targets.py` from "
             f"`{sources[0]}`" + (f" and `{sources[1]}`" if prefill else "")
             + " (ratios of four-shape sums of one report each; see the script's docstring).",
             "", "| target | measured on | value | met |", "| --- | --- | ---: | --- |"]
    for name, how, x, ok in rows:
        val = f"{100 * x:.1f}%" if "%" in name else f"{x:.4f}"
        lines.append(f"| {name} | {how} | {val} | {'yes' if ok else 'no'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--decode", type=Path, default=DECODE_JSON)
    ap.add_argument("--prefill", default=str(PREFILL_JSON), help="a report, or 'none'")
    ap.add_argument("--out", type=Path, default=RESULTS / "linear_targets.md")
    a = ap.parse_args(argv)
    pre = None if a.prefill == "none" else load_json(Path(a.prefill))
    text = render(load_json(a.decode), pre, (Path(a.decode).name, Path(a.prefill).name))
    a.out.write_text(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
