"""SVG plot of bench/gpu_attention_check.py results (drawn by svgplot, whose docstring says
why not matplotlib).

    python bench/report/plot_attention.py bench/results/h200/attention_sm90_check.json[.xz] \
        [out.svg]

Two rows of panels, one panel per geometry (like the paper's Fig. 10 a-c): top, ResAttn's
speedup over torch SDPA with BF16 KV against KV length, one line per batch, with the 2.9x target;
bottom, ResAttn's share of the NVFP4 HBM floor (floor time / ResAttn time), with the 85% target.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from report_io import load_json  # noqa: E402
from svgplot import COLORS, Axes, Frame, HLine, Series, document, panel  # noqa: E402

W, H = 300, 210           # one panel
FRAME = Frame(W, H, ml=48, mr=12, mt=26, mb=34)


def _series(configs: list[dict], geom: str, metric: str) -> dict[int, list[tuple[int, float]]]:
    out: dict[int, list[tuple[int, float]]] = {}
    for e in configs:
        if e["geom"] != geom:
            continue
        r = (e.get("resattn") or {}).get("best") or {}
        us = r.get("us")
        if not us:
            continue
        if metric == "speedup":
            sd = (e.get("sdpa") or {}).get("us")
            if not sd:
                continue
            y = sd / us
        else:
            y = 100.0 * e["floor_us"] / us
        out.setdefault(e["batch"], []).append((e["kv_len"], y))
    return {b: sorted(v) for b, v in sorted(out.items())}


def _panel(x0: float, y0: float, title: str, series, target: float, ylabel: str,
           ymax: float | None = None) -> list[str]:
    lines = [Series(f"B={b}", pts, COLORS[i % len(COLORS)]) for i, (b, pts) in
             enumerate(series.items())]
    axes = Axes(ylabel=ylabel, xfmt=lambda x: f"{x // 1024}K", xdefault=(8192, 131072),
                ymax=ymax, hlines=(HLine(target),), legend_step=42)
    return panel(x0, y0, title, lines, axes, FRAME)


def render(report: dict) -> str:
    configs = report.get("configs", [])
    geoms = list(dict.fromkeys(e["geom"] for e in configs)) or ["(no data)"]
    width, height = W * len(geoms), 2 * H + 20
    body = []
    for j, geom in enumerate(geoms):
        body += _panel(j * W, 0, f"{geom}: ResAttn vs SDPA-BF16", _series(configs, geom,
                                                                          "speedup"),
                       2.9, "speedup (x)")
        body += _panel(j * W, H, f"{geom}: share of NVFP4 floor", _series(configs, geom,
                                                                          "floor"),
                       85.0, "% of HBM floor", ymax=110.0)
    gpu = (report.get("env") or {}).get("gpu", "")
    return document(body, width, height, f"{gpu}; dashed: targets (2.9x, 85%)")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print(__doc__)
        return 2
    src = Path(argv[0])
    out = Path(argv[1]) if len(argv) > 1 else \
        src.with_name(src.name.removesuffix(".xz")).with_suffix(".svg")
    out.write_text(render(load_json(src)))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
