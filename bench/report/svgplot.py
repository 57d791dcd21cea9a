"""Dependency-free SVG line charts for the benchmark reports (no plotting library on the GPU
machine or in CI).

A figure is a list of SVG element strings: `panel` draws one chart with a log2 x axis (several
series, optional reference lines, an optional inline legend), `grid_origins` places panels in a
grid, `legend` draws a shared legend row, `document` wraps it all in an <svg> element on a white
background. Coordinates are SVG user units (pixels); every piece of text is XML-escaped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence
from xml.sax.saxutils import escape as _escape

COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b")
MARKERS = ("circle", "square", "open-circle", "open-square", "none")


def esc(s: object) -> str:
    """Text for an SVG text node or attribute value: &, <, > and double quotes escaped."""
    return _escape(str(s), {'"': "&quot;"})


@dataclass(frozen=True)
class Series:
    """One line: `points` are (x, y) pairs with x > 0 (the x axis is log2); drawn in x order as
    given. `dash` is an SVG stroke-dasharray ("" = solid); `marker` one of MARKERS; `key`, when
    set, is written as the line's data-series attribute so tests/tools can find it."""
    label: str
    points: Sequence[tuple[float, float]]
    color: str
    dash: str = ""
    marker: str = "circle"
    key: str | None = None

    def __post_init__(self) -> None:
        if self.marker not in MARKERS:
            raise ValueError(f"marker {self.marker!r} is not one of {MARKERS}")
        for x, _ in self.points:
            if not x > 0:
                raise ValueError(f"series {self.label!r}: x must be > 0 on a log axis, got {x}")


@dataclass(frozen=True)
class HLine:
    """A horizontal reference line at y (a target, or 1.0 for a baseline); its y takes part in
    the automatic y range."""
    y: float
    color: str = "#888"
    dash: str = "4 3"


@dataclass(frozen=True)
class VLine:
    """A vertical marker at x, with optional labels written left / right of it near the
    bottom of the plot area."""
    x: float
    color: str = "#555"
    dash: str = "2 3"
    left: str = ""
    right: str = ""


@dataclass(frozen=True)
class Frame:
    """Panel size and the margins around its plot area (pixels)."""
    width: int = 300
    height: int = 210
    ml: int = 48
    mr: int = 12
    mt: int = 26
    mb: int = 34


@dataclass(frozen=True)
class Axes:
    """Axis options of a panel. x ticks: `xticks` (default: every data x), labels `xfmt`.
    y: from `ymin` to `ymax` (default: the largest data/reference y times `headroom`); ticks
    every `ystep` from ymin when given, else `nyticks` evenly spaced; labels `yfmt`. `ygrid`
    draws light lines at the y ticks. `legend_step`: when set, each series' label is written
    inside the panel's top-left corner, that many pixels apart."""
    ylabel: str = ""
    xlabel: str = ""
    xticks: Sequence[float] | None = None
    xfmt: Callable[[float], str] = lambda x: f"{x:g}"
    xdefault: Sequence[float] = (1.0, 2.0)
    ymin: float = 0.0
    ymax: float | None = None
    headroom: float = 1.15
    ystep: float | None = None
    nyticks: int = 5
    yfmt: Callable[[float], str] = lambda v: f"{v:.3g}"
    ygrid: bool = False
    legend_step: int | None = None
    hlines: Sequence[HLine] = field(default_factory=tuple)
    vlines: Sequence[VLine] = field(default_factory=tuple)


def _marker(kind: str, cx: float, cy: float, color: str) -> str:
    if kind == "circle":
        return f'<circle cx="{cx:.1f}" cy="{cy:.1f}" r="2.5" fill="{color}"/>'
    if kind == "open-circle":
        return (f'<circle cx="{cx:.1f}" cy="{cy:.1f}" r="3" fill="white" stroke="{color}" '
                f'stroke-width="1.4"/>')
    if kind in ("square", "open-square"):
        fill = color if kind == "square" else "white"
        return (f'<rect x="{cx - 3:.1f}" y="{cy - 3:.1f}" width="6" height="6" fill="{fill}" '
                f'stroke="{color}" stroke-width="1.4"/>')
    return ""


def panel(x0: float, y0: float, title: str, series: Sequence[Series],
          axes: Axes = Axes(), frame: Frame = Frame()) -> list[str]:
    """SVG elements of one line chart whose top-left corner is (x0, y0). Values outside the
    y range are drawn on its edge."""
    W, ML, MT = frame.width, frame.ml, frame.mt
    data_x = sorted({x for s in series for x, _ in s.points})
    xs = sorted(set(axes.xticks)) if axes.xticks is not None else data_x
    xs = xs or list(axes.xdefault)
    lx0, lx1 = math.log2(min(xs + data_x)), math.log2(max(xs + data_x))
    if lx1 == lx0:
        lx0, lx1 = lx0 - 1, lx1 + 1
    ys = [y for s in series for _, y in s.points] + [h.y for h in axes.hlines]
    ymin = axes.ymin
    top = axes.ymax or (max(ys) * axes.headroom if ys else ymin + 1.0)
    if axes.ystep:
        top = ymin + math.ceil((top - ymin) / axes.ystep - 1e-9) * axes.ystep
    if not top > ymin:
        top = ymin + 1.0
    pw, ph = W - ML - frame.mr, frame.height - MT - frame.mb

    def px(x):
        return x0 + ML + (math.log2(x) - lx0) / (lx1 - lx0) * pw

    def py(y):
        return y0 + MT + ph - (max(ymin, min(y, top)) - ymin) / (top - ymin) * ph

    if axes.ystep:
        n = int(round((top - ymin) / axes.ystep))
        yticks = [ymin + axes.ystep * k for k in range(n + 1)]
    else:
        yticks = [ymin + (top - ymin) * k / (axes.nyticks - 1) for k in range(axes.nyticks)]
    s = []
    if axes.ygrid:
        s += [f'<line x1="{x0 + ML}" x2="{x0 + ML + pw}" y1="{py(yv):.1f}" y2="{py(yv):.1f}" '
              f'stroke="#e4e4e4"/>' for yv in yticks]
    s += [f'<rect x="{x0 + ML}" y="{y0 + MT}" width="{pw}" height="{ph}" fill="none" '
          f'stroke="#444"/>',
          f'<text x="{x0 + W / 2}" y="{y0 + 16}" text-anchor="middle" font-size="12">'
          f'{esc(title)}</text>',
          f'<text x="{x0 + 12}" y="{y0 + MT + ph / 2}" font-size="10" text-anchor="middle" '
          f'transform="rotate(-90 {x0 + 12} {y0 + MT + ph / 2})">{esc(axes.ylabel)}</text>']
    for yv in yticks:
        s.append(f'<text x="{x0 + ML - 4}" y="{py(yv) + 3}" font-size="9" '
                 f'text-anchor="end">{esc(axes.yfmt(yv))}</text>')
    for x in xs:
        s.append(f'<text x="{px(x)}" y="{y0 + MT + ph + 14}" font-size="9" '
                 f'text-anchor="middle">{esc(axes.xfmt(x))}</text>')
    if axes.xlabel:
        s.append(f'<text x="{x0 + ML + pw / 2}" y="{y0 + MT + ph + 28}" font-size="10" '
                 f'text-anchor="middle">{esc(axes.xlabel)}</text>')
    for h in axes.hlines:
        s.append(f'<line x1="{x0 + ML}" x2="{x0 + ML + pw}" y1="{py(h.y)}" y2="{py(h.y)}" '
                 f'stroke="{h.color}" stroke-dasharray="{h.dash}"/>')
    for v in axes.vlines:
        xv = px(v.x)
        s.append(f'<line x1="{xv:.1f}" x2="{xv:.1f}" y1="{y0 + MT}" y2="{y0 + MT + ph}" '
                 f'stroke="{v.color}" stroke-dasharray="{v.dash}"/>')
        for label, dx, anchor in ((v.left, -4, "end"), (v.right, 4, "start")):
            if label:
                s.append(f'<text x="{xv + dx:.1f}" y="{y0 + MT + ph - 6}" font-size="9" '
                         f'fill="{v.color}" text-anchor="{anchor}">{esc(label)}</text>')
    for i, ser in enumerate(series):
        c = ser.color
        path = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in ser.points)
        extra = (f' stroke-dasharray="{ser.dash}"' if ser.dash else "") + (
            f' data-series="{esc(ser.key)}"' if ser.key is not None else "")
        s.append(f'<polyline class="series" points="{path}" fill="none" stroke="{c}" '
                 f'stroke-width="1.8"{extra}/>')
        for x, y in ser.points:
            s.append(_marker(ser.marker, px(x), py(y), c))
        if axes.legend_step is not None:
            s.append(f'<text x="{x0 + ML + 6 + axes.legend_step * i}" y="{y0 + MT + 12}" '
                     f'font-size="9" fill="{c}">{esc(ser.label)}</text>')
    return [e for e in s if e]


def legend(x: float, y: float, entries: Sequence[Series], width: float,
           font_size: int = 11) -> tuple[list[str], float]:
    """A shared legend: a short line sample with the entry's marker, then its label, left to
    right from (x, y), wrapping at `width`. Returns the elements and the height used."""
    out, cx, cy, row = [], x, y, font_size + 7
    for e in entries:
        w = 34 + 0.6 * font_size * len(e.label) + 16    # sample + estimated text width + gap
        if cx > x and cx + w > x + width:
            cx, cy = x, cy + row
        dash = f' stroke-dasharray="{e.dash}"' if e.dash else ""
        out.append(f'<line x1="{cx:.1f}" x2="{cx + 26:.1f}" y1="{cy:.1f}" y2="{cy:.1f}" '
                   f'stroke="{e.color}" stroke-width="1.8"{dash}/>')
        out.append(_marker(e.marker, cx + 13, cy, e.color))
        out.append(f'<text x="{cx + 32:.1f}" y="{cy + font_size / 2 - 1:.1f}" '
                   f'font-size="{font_size}">{esc(e.label)}</text>')
        cx += w
    return [e for e in out if e], cy - y + row


def grid_origins(n: int, cols: int, cell_w: float, cell_h: float, left: float = 0.0,
                 top: float = 0.0) -> list[tuple[float, float]]:
    """Top-left corners of n panels laid out row by row, `cols` per row."""
    if cols < 1:
        raise ValueError(f"cols must be >= 1, got {cols}")
    return [(left + (i % cols) * cell_w, top + (i // cols) * cell_h) for i in range(n)]


def text(x: float, y: float, s: str, size: int = 11, anchor: str = "start",
         weight: str = "normal", fill: str = "#000") -> str:
    """One line of text at (x, y) (baseline)."""
    w = f' font-weight="{weight}"' if weight != "normal" else ""
    f = f' fill="{fill}"' if fill != "#000" else ""
    return (f'<text x="{x}" y="{y}" font-size="{size}" text-anchor="{anchor}"{w}{f}>'
            f'{esc(s)}</text>')


def document(body: Sequence[str], width: float, height: float,
             footer: str | None = None) -> str:
    """The whole SVG file: white background, the body elements, an optional small footer line
    at the bottom left."""
    foot = (f'\n<text x="6" y="{height - 6}" font-size="9">{esc(footer)}</text>'
            if footer is not None else "")
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'font-family="sans-serif">\n<rect width="100%" height="100%" fill="white"/>\n'
            + "\n".join(body) + foot + "\n</svg>\n")
