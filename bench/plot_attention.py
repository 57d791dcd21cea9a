"""SVG plot of bench/gpu_attention_check.py results (no plotting library needed).

    python bench/plot_attention.py bench/results/h200/attention_sm90_check.json [out.svg]

Two rows of panels, one panel per geometry (like the paper's Fig. 10 a-c): top, ResAttn's
speedup over torch SDPA with BF16 KV against KV length, one line per batch, with the 2.9x target;
bottom, ResAttn's share of the NVFP4 HBM floor (floor time / ResAttn time), with the 85% target.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b")
W, H = 300, 210           # one panel
ML, MR, MT, MB = 48, 12, 26, 34


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
    xs = sorted({x for pts in series.values() for x, _ in pts}) or [8192, 131072]
    lx0, lx1 = math.log2(min(xs)), math.log2(max(xs))
    if lx1 == lx0:
        lx0, lx1 = lx0 - 1, lx1 + 1
    ys = [y for pts in series.values() for _, y in pts] + [target]
    top = ymax or max(ys) * 1.15
    pw, ph = W - ML - MR, H - MT - MB

    def px(x):
        return x0 + ML + (math.log2(x) - lx0) / (lx1 - lx0) * pw

    def py(y):
        return y0 + MT + ph - max(0.0, min(y, top)) / top * ph

    s = [f'<rect x="{x0 + ML}" y="{y0 + MT}" width="{pw}" height="{ph}" fill="none" '
         f'stroke="#444"/>',
         f'<text x="{x0 + W / 2}" y="{y0 + 16}" text-anchor="middle" font-size="12">'
         f'{title}</text>',
         f'<text x="{x0 + 12}" y="{y0 + MT + ph / 2}" font-size="10" text-anchor="middle" '
         f'transform="rotate(-90 {x0 + 12} {y0 + MT + ph / 2})">{ylabel}</text>']
    for k in range(5):
        yv = top * k / 4
        s.append(f'<text x="{x0 + ML - 4}" y="{py(yv) + 3}" font-size="9" '
                 f'text-anchor="end">{yv:.3g}</text>')
    for x in xs:
        lab = f"{x // 1024}K"
        s.append(f'<text x="{px(x)}" y="{y0 + MT + ph + 14}" font-size="9" '
                 f'text-anchor="middle">{lab}</text>')
    s.append(f'<line x1="{x0 + ML}" x2="{x0 + ML + pw}" y1="{py(target)}" y2="{py(target)}" '
             f'stroke="#888" stroke-dasharray="4 3"/>')
    for i, (b, pts) in enumerate(series.items()):
        c = COLORS[i % len(COLORS)]
        path = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in pts)
        s.append(f'<polyline class="series" points="{path}" fill="none" stroke="{c}" '
                 f'stroke-width="1.8"/>')
        for x, y in pts:
            s.append(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="2.5" fill="{c}"/>')
        s.append(f'<text x="{x0 + ML + 6 + 42 * i}" y="{y0 + MT + 12}" font-size="9" '
                 f'fill="{c}">B={b}</text>')
    return s


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
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'font-family="sans-serif">\n<rect width="100%" height="100%" fill="white"/>\n'
            + "\n".join(body)
            + f'\n<text x="6" y="{height - 6}" font-size="9">{gpu}; dashed: targets '
              f'(2.9x, 85%)</text>\n</svg>\n')


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print(__doc__)
        return 2
    src = Path(argv[0])
    out = Path(argv[1]) if len(argv) > 1 else src.with_suffix(".svg")
    out.write_text(render(json.loads(src.read_text())))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
