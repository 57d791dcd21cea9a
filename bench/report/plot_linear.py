"""Latency of residue-compensated FP4 linear layers relative to plain FP4 against M, one panel per
Qwen3 projection shape (the paper's Fig. 18 style), from the committed H200 results:

    python bench/report/plot_linear.py   # bench/results/h200/linear_relative_latency.{svg,md}
    python bench/report/plot_linear.py --model qwen3-4b --prefill none \
        --decode bench/results/h200/bench_qwen3_4b_table14.json.xz
                                     # ... linear_relative_latency_qwen3_4b.{svg,md} (decode only)

Inputs (options --decode / --prefill / --out-dir override the defaults; the default decode input
is the `resgen bench` report described last):
- decode, M = 1..128, family linear_sm90_mma: bench/results/h200/final_linear_sm90_check.json.xz
  (with --decode).
  Used: records of its "tasks" list with kind == "layer" (the whole layer from BF16 activations,
  activation quantization included: fused one-launch variants and xop = quant_sm90 + GEMM),
  pdl == false, timing_mode != "eager" (all others are "graph") and a median_us; per
  (shape, fmt, mode, m) the smallest median_us. This is exactly the "layer" column of that
  file's "table" (the ratio is its "ext/pl" column). Not used: kind == "gemm"
  (GEMM-only on a prepared operand) and pdl == true (back-to-back launches overlapping, a
  different timed quantity; the prefill family has no such column).
- prefill, M = 128..2048, family linear_sm90_wgmma:
  bench/results/h200/final_linear_sm90_wgmma_prefill.json.xz. Used: records of its "entries" list
  with quantizer == true (quant_sm90 + GEMM: the whole layer), check.ok and a median_us; per
  (shape, fmt, mode, m) the smallest median_us (the whole-layer columns of its "table"). Not
  used: quantizer == false (GEMM-only variant selection).
- or, for the decode range (--decode given a `resgen bench` JSON: a dict with "rows"): what the
  runtime dispatches from the shipped table, one variant per (shape, fmt, mode, M), either
  kernel family (records with resgen_us and check.ok; shapes named by their N x K). The
  committed figure uses bench/results/h200/bench_qwen3_8b_table14b.json.xz this way.
- or, for the prefill range (--prefill given a `resgen bench` JSON), likewise: the committed
  figure uses bench/results/h200/bench_qwen3_8b_table12_prefill.json.xz (M = 256..2048, the
  shipped table's prefill buckets).
y = best(mode) / best(plain, mode "none") for the same shape, format, M and file (kernel
family), so plain = 1.0 and lower is faster. At M = 128 both families were measured; both points
are drawn (decode: filled circles, prefill: open squares) with a dotted line at the change.
modes: "full" = M-Ext (full residue as extra rows, 2M rows), "0.125".."1.0" = K-Ext with that
fraction of channels compensated (K grows by that fraction).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import svgplot as sp  # noqa: E402
from report_io import load_json  # noqa: E402
from resgen.models import get_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results" / "h200"
DECODE_JSON = RESULTS / "bench_qwen3_8b_table14b.json.xz"     # a resgen bench report (dispatch)
PREFILL_JSON = RESULTS / "bench_qwen3_8b_table12_prefill.json.xz"     # resgen bench, M >= 256
OUT_NAME = "linear_relative_latency"

SHAPES = ("qkv", "o", "gate_up", "down")          # panel order
M_TICKS = tuple(2 ** i for i in range(12))        # 1 .. 2048
FAMILY_SPLIT_M = 128                              # decode family for M <= 128, prefill for >=


@dataclass(frozen=True)
class Family:
    tag: str          # "decode" | "prefill"
    kernel: str       # the kernel family's registry name
    marker: str       # svgplot marker of its points
    m_lo: int
    m_hi: int


DECODE = Family("decode", "linear_sm90_mma", "circle", 1, FAMILY_SPLIT_M)
DISPATCH = Family("dispatch", "the runtime's choice per layer (linear_sm90_mma or "
                  "linear_sm90_wgmma)", "circle", 1, FAMILY_SPLIT_M)
# names of the Qwen3 projection shapes (TP1) the reports' (N, K) belong to (the three built-in
# models' (N, K) pairs are all distinct)
SHAPE_OF = {(s.n, s.k): s.name for mdl in ("qwen3-4b", "qwen3-8b", "qwen3-32b")
            for s in get_model(mdl).linear_shapes()}
MODEL_LABEL = {"qwen3-4b": "Qwen3-4B", "qwen3-8b": "Qwen3-8B", "qwen3-32b": "Qwen3-32B"}
NO_PREFILL: dict = {"rows": []}      # --prefill none: a bench report without rows
PREFILL = Family("prefill", "linear_sm90_wgmma", "open-square", FAMILY_SPLIT_M, 1 << 30)
PREFILL_DISPATCH = Family("prefill dispatch", "the runtime's choice from the prefill buckets "
                          "(linear_sm90_wgmma)", "open-square", FAMILY_SPLIT_M, 1 << 30)

# (fmt, mode) -> (legend label, colour), in legend order. Other compensated modes found in the
# files get a generic label and the remaining colours.
KNOWN = {("nvfp4", "full"): ("NVFP4 M-Ext (full residue)", "#d62728"),
         ("nvfp4", "0.125"): ("NVFP4 K-Ext 0.125", "#1f77b4"),
         ("nvfp4", "0.25"): ("NVFP4 K-Ext 0.25", "#2ca02c"),
         ("nvfp4", "0.5"): ("NVFP4 K-Ext 0.5", "#9467bd"),
         ("nvfp4", "1.0"): ("NVFP4 K-Ext 1.0", "#ff7f0e"),
         ("mxfp4", "full"): ("MXFP4 M-Ext (full residue)", "#8c564b")}
SPARE_COLORS = ("#e377c2", "#17becf", "#bcbd22", "#7f7f7f")

Key = tuple[str, str, str, int]                   # (shape, fmt, mode, m)


def _us(x) -> float | None:
    return float(x) if isinstance(x, (int, float)) and math.isfinite(x) and x > 0 else None


def _keep_min(best: dict[Key, float], key: Key, us: float) -> None:
    if key not in best or us < best[key]:
        best[key] = us


def is_bench(report: dict) -> bool:
    """A `resgen bench` report (rows of dispatched variants) rather than gpu_linear_check's."""
    return isinstance(report, dict) and isinstance(report.get("rows"), list)


def decode_family(report: dict) -> Family:
    return DISPATCH if is_bench(report) else DECODE


def prefill_family(report: dict) -> Family:
    return PREFILL_DISPATCH if is_bench(report) else PREFILL


def _bench_shape(p: dict) -> str:
    n, k = int(p["n"]), int(p["k"])
    return SHAPE_OF.get((n, k), f"{n}x{k}")


def bench_best(report: dict) -> dict[Key, float]:
    """The dispatched variant's whole-layer median (us) per (shape, fmt, mode, m) of a
    `resgen bench` report, over rows whose correctness check passed."""
    best: dict[Key, float] = {}
    for r in report["rows"]:
        us, p = _us(r.get("resgen_us")), r.get("problem")
        if us is not None and isinstance(p, dict) and (r.get("check") or {}).get("ok"):
            _keep_min(best, (_bench_shape(p), p["fmt"], str(p["compensation"]), int(p["m"])),
                      us)
    return best


def decode_best(report: dict) -> dict[Key, float]:
    """Best whole-layer, non-PDL, graph-timed median (us) per (shape, fmt, mode, m) of a
    gpu_linear_check.py report (see the module docstring for the fields), or the dispatched
    medians of a `resgen bench` report (bench_best)."""
    if is_bench(report):
        return bench_best(report)
    tasks = report.get("tasks") if isinstance(report, dict) else None
    if not isinstance(tasks, list):
        raise ValueError("decode report: expected a dict with a 'tasks' list "
                         "(gpu_linear_check.py output)")
    best: dict[Key, float] = {}
    for t in tasks:
        us = _us(t.get("median_us"))
        if (t.get("kind") == "layer" and t.get("pdl") is False
                and t.get("timing_mode") != "eager" and us is not None):
            _keep_min(best, (t["shape"], t["fmt"], str(t["mode"]), int(t["m"])), us)
    return best


def prefill_best(report: dict) -> dict[Key, float]:
    """Best whole-layer (quantizer + GEMM) median (us) per (shape, fmt, mode, m) of a
    gpu_prefill_check.py report, over entries whose correctness check passed, or the
    dispatched medians of a `resgen bench` report (bench_best)."""
    if is_bench(report):
        return bench_best(report)
    entries = report.get("entries") if isinstance(report, dict) else None
    if not isinstance(entries, list):
        raise ValueError("prefill report: expected a dict with an 'entries' list "
                         "(bench/gpu_prefill_check.py output)")
    best: dict[Key, float] = {}
    for e in entries:
        us = _us(e.get("median_us"))
        if e.get("quantizer") is True and (e.get("check") or {}).get("ok") and us is not None:
            _keep_min(best, (e["shape"], e["fmt"], str(e["mode"]), int(e["m"])), us)
    return best


def ratios(best: dict[Key, float]) -> dict[Key, float]:
    """best[compensated] / best[plain] of the same (shape, fmt, m); keys without a plain
    measurement are left out."""
    out = {}
    for (shape, fmt, mode, m), us in best.items():
        plain = best.get((shape, fmt, "none", m))
        if mode != "none" and plain:
            out[(shape, fmt, mode, m)] = us / plain
    return out


def shape_dims(*reports: dict) -> dict[str, tuple[int, int]]:
    """(N, K) of each shape, read from the records' canonical problem keys."""
    dims: dict[str, tuple[int, int]] = {}
    for rep in reports:
        for r in rep.get("rows") or []:
            p = r.get("problem")
            if isinstance(p, dict) and "n" in p and "k" in p:
                dims.setdefault(_bench_shape(p), (int(p["n"]), int(p["k"])))
        for r in (rep.get("tasks") or []) + (rep.get("entries") or []):
            try:
                p = json.loads(r["problem"])
                dims.setdefault(r["shape"], (int(p["n"]), int(p["k"])))
            except (KeyError, TypeError, ValueError):
                continue
    return dims


def series_styles(*ratio_maps: dict[Key, float]) -> dict[tuple[str, str], tuple[str, str]]:
    """(fmt, mode) -> (label, colour) for every compensated mode present, KNOWN ones first."""
    present = {(fmt, mode) for r in ratio_maps for (_, fmt, mode, _) in r}
    styles = {k: v for k, v in KNOWN.items() if k in present}
    for i, (fmt, mode) in enumerate(sorted(present - set(KNOWN))):
        styles[(fmt, mode)] = (f"{fmt.upper()} {mode}", SPARE_COLORS[i % len(SPARE_COLORS)])
    return styles


def panel_series(shape: str, fam_ratios: list[tuple[Family, dict[Key, float]]],
                 styles: dict[tuple[str, str], tuple[str, str]]) -> list[sp.Series]:
    """One line per (fmt, mode, family) measured for `shape`; the data-series key is
    'fmt/mode/family'."""
    out = []
    for (fmt, mode), (label, color) in styles.items():
        for fam, rat in fam_ratios:
            pts = sorted((m, r) for (s, f, md, m), r in rat.items()
                         if s == shape and f == fmt and md == mode and fam.m_lo <= m <= fam.m_hi)
            if pts:
                # dashed when it skips M values: only the drawn points were measured
                gap = any(b[0] > 2 * a[0] for a, b in zip(pts, pts[1:]))
                out.append(sp.Series(f"{label}, {fam.tag}", pts, color,
                                     dash="5 3" if gap else "", marker=fam.marker,
                                     key=f"{fmt}/{mode}/{fam.tag}"))
    return out


FRAME = sp.Frame(width=460, height=300, ml=52, mr=14, mt=30, mb=44)
def _decode_source(dec: dict) -> str:
    """How the decode-range points were obtained (figure subtitle)."""
    if is_bench(dec):
        return ("M ≤ 128, the runtime's dispatch from the shipped table (filled circles): "
                "resgen bench rows (whole layer, check ok), one variant per layer, either family.")
    return ("decode, M ≤ 128, linear_sm90_mma (filled circles): final_linear_sm90_check.json.xz "
            "'tasks', kind=layer, pdl=false, timing_mode graph: min median_us (its table's "
            "'layer' column).")


def no_prefill(pre: dict) -> bool:
    """The prefill range was not measured (--prefill none)."""
    return is_bench(pre) and not pre["rows"]


def _prefill_source(pre: dict) -> str:
    """How the prefill-range points were obtained (figure subtitle)."""
    if no_prefill(pre):
        return "M ≥ 256: not measured for this model (no prefill buckets in the shipped table)."
    if is_bench(pre):
        return ("M ≥ 256, the runtime's dispatch from the shipped table's prefill buckets (open "
                "squares): resgen bench rows (whole layer, check ok), one variant per layer.")
    return ("prefill, M ≥ 128, linear_sm90_wgmma (open squares): "
            "final_linear_sm90_wgmma_prefill.json.xz 'entries', quantizer=true, check.ok: min "
            "median_us.")


def subtitle(dec: dict, pre: dict) -> tuple[str, ...]:
    return (
        "y = whole-layer latency (BF16 activations in, activation quantization included) / "
        "plain FP4 of the same format, shape, M and source; lower is faster.",
        _decode_source(dec),
        _prefill_source(pre),
        "Not used: GEMM-only (kind=gemm, quantizer=false) and PDL (pdl=true) timings.",
        "Dotted vertical line: change of source"
        + ("" if is_bench(pre) else " (both measured at M = 128)")
        + ". Dashed coloured line: the M values between its points were not measured.",
    )


def _env_line(dec: dict, pre: dict) -> str:
    e, p = dec.get("environment") or {}, pre.get("environment") or {}
    label = e.get("policy_label") or (dec.get("policy") or {}).get("name", "?")
    runs = f"decode run {str(e.get('date') or dec.get('date', '?'))[:16]}"
    if not no_prefill(pre):
        runs += f", prefill run {str(p.get('date') or pre.get('date', '?'))[:16]}"
    return (f"{e.get('gpu_name', '?')} ({e.get('arch', '?')}), torch {e.get('torch', '?')}, "
            f"CuTe DSL {e.get('cute_dsl', '?')}, timing {label}; {runs} UTC; "
            "python bench/report/plot_linear.py")


def render_svg(dec: dict, pre: dict, model: str = "Qwen3-8B") -> str:
    """The figure: a title, the data-source subtitle, a shared legend, 2 x 2 panels."""
    d_rat, p_rat = ratios(decode_best(dec)), ratios(prefill_best(pre))
    dfam, pfam = decode_family(dec), prefill_family(pre)
    fam_ratios = [(dfam, d_rat), (pfam, p_rat)]
    styles = series_styles(d_rat, p_rat)
    dims = shape_dims(dec, pre)
    shapes = [s for s in SHAPES if s in dims] + sorted(set(dims) - set(SHAPES))
    cols = 2
    width = cols * FRAME.width + 20
    body = [sp.text(14, 24, f"FP4 linear layers on H200 (Hopper kernels, {model} shapes): "
                    "latency relative to plain FP4", size=15, weight="bold")]
    y = 44
    for line in subtitle(dec, pre):
        body.append(sp.text(14, y, line, size=10, fill="#333"))
        y += 14
    entries = [sp.Series("plain FP4 (= 1.0)", [], "#000", dash="5 3", marker="none")]
    entries += [sp.Series(label, [], color, marker="none") for label, color in styles.values()]
    entries += [sp.Series(f"{f.tag}: {f.kernel}", [], "#666", marker=f.marker)
                for f in (dfam, pfam) if f is dfam or not no_prefill(pre)]
    leg, leg_h = sp.legend(24, y + 8, entries, width - 40)
    body += leg
    top = y + 8 + leg_h
    axes = sp.Axes(ylabel="latency / plain FP4", xlabel="M (tokens, log scale)",
                   xticks=M_TICKS, xfmt=lambda x: f"{int(x)}", ymin=0.0, headroom=1.08,
                   ystep=0.5, yfmt=lambda v: f"{v:.1f}x", ygrid=True,
                   hlines=(sp.HLine(1.0, "#000", "5 3"),),
                   vlines=(sp.VLine(FAMILY_SPLIT_M, "#555", "2 3",
                                    "dispatch" if dfam is DISPATCH else "decode (mma)",
                                    "prefill" if pfam is PREFILL_DISPATCH
                                    else "prefill (wgmma)"),))
    origins = sp.grid_origins(len(shapes), cols, FRAME.width, FRAME.height, left=10, top=top)
    for shape, (x0, y0) in zip(shapes, origins):
        n, k = dims[shape]
        body += sp.panel(x0, y0, f"{shape}  (N={n}, K={k})",
                         panel_series(shape, fam_ratios, styles), axes, FRAME)
    rows = (len(shapes) + cols - 1) // cols
    height = top + rows * FRAME.height + 24
    return sp.document(body, width, height, _env_line(dec, pre))


def _cell(x: float | None, digits: int = 3) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def _range(vals: list[float], digits: int = 2) -> str:
    return f"{min(vals):.{digits}f}–{max(vals):.{digits}f}" if vals else "n/a"


def render_md(dec: dict, pre: dict, model: str = "Qwen3-8B", name: str = OUT_NAME) -> str:
    """The same ratios as a markdown table (plain latencies in us for scale) and the findings
    computed from them."""
    d_best, p_best = decode_best(dec), prefill_best(pre)
    d_rat, p_rat = ratios(d_best), ratios(p_best)
    styles = series_styles(d_rat, p_rat)
    modes = list(styles)
    dims = shape_dims(dec, pre)
    shapes = [s for s in SHAPES if s in dims] + sorted(set(dims) - set(SHAPES))
    dfam, pfam = decode_family(dec), prefill_family(pre)
    fams = [(dfam, d_best, d_rat), (pfam, p_best, p_rat)]
    if dfam is DISPATCH:
        dsrc = (f"- M <= {FAMILY_SPLIT_M}, {dfam.kernel}: a `resgen bench` report on the shipped "
                "table, rows with `check.ok`; `resgen_us`.")
    else:
        dsrc = (f"- decode, M <= {FAMILY_SPLIT_M}, `{DECODE.kernel}`: "
                "`final_linear_sm90_check.json.xz`, `tasks` with `kind=layer`, `pdl=false`, "
                "`timing_mode` graph; min `median_us` (the file's table column `layer`).")
    psrc = (f"- M >= {2 * FAMILY_SPLIT_M}, {pfam.kernel}: a `resgen bench` report on the "
            "shipped table's prefill buckets, rows with `check.ok`; `resgen_us`."
            if pfam is PREFILL_DISPATCH else
            f"- prefill, M >= {FAMILY_SPLIT_M}, `{PREFILL.kernel}`: "
            "`final_linear_sm90_wgmma_prefill.json.xz`, `entries` with `quantizer=true` and "
            "`check.ok`; min `median_us`.")
    if no_prefill(pre):
        psrc = f"- M >= {2 * FAMILY_SPLIT_M}: not measured for this model."
    out = [f"# {name}: FP4 linear latency relative to plain FP4 (H200, {model} shapes)", "",
           "Generated by `python bench/report/plot_linear.py` (figure: "
           f"[{name}.svg]({name}.svg)).", "",
           "Each ratio is the best whole-layer median latency of the compensated mode divided by "
           "the best whole-layer median of plain FP4 (mode `none`) of the same format, shape, M "
           "and kernel family (lower is faster). Whole layer = BF16 activations in, activation "
           "quantization included.", "",
           dsrc,
           psrc,
           "- Not used: GEMM-only timings (`kind=gemm`, `quantizer=false`) and PDL timings "
           "(`pdl=true`).", "",
           "| shape | M | family | plain NVFP4 us | " + " | ".join(styles[m][0] for m in modes)
           + " | plain MXFP4 us |",
           "| --- | ---: | --- | ---: | " + " | ".join("---:" for _ in modes) + " | ---: |"]
    for shape in shapes:
        for fam, best, rat in fams:
            ms = sorted({m for (s, _, _, m) in best if s == shape and fam.m_lo <= m <= fam.m_hi})
            for m in ms:
                cells = [_cell(rat.get((shape, f, md, m))) for f, md in modes]
                out.append(f"| {shape} | {m} | {fam.tag} | "
                           f"{_cell(best.get((shape, 'nvfp4', 'none', m)), 1)} | "
                           + " | ".join(cells)
                           + f" | {_cell(best.get((shape, 'mxfp4', 'none', m)), 1)} |")
    out += ["", "## What it shows", ""] + findings(d_best, p_best, dims, dfam)
    return "\n".join(out) + "\n"


def findings(d_best: dict[Key, float], p_best: dict[Key, float],
             dims: dict[str, tuple[int, int]], dfam: Family = DECODE) -> list[str]:
    """A few sentences whose numbers are all computed from the data (dfam: the source of the
    decode-range points)."""
    who = "the dispatched variants" if dfam is DISPATCH else "the decode family"
    d_rat, p_rat = ratios(d_best), ratios(p_best)

    def sel(rat, fmt, mode, pred):
        return [r for (_, f, md, m), r in rat.items() if f == fmt and md == mode and pred(m)]

    def tflops(best, pred):
        return [2.0 * m * dims[s][0] * dims[s][1] / us * 1e-6
                for (s, f, md, m), us in best.items()
                if f == "nvfp4" and md == "none" and pred(m) and s in dims]

    lines = []
    small = sel(d_rat, "nvfp4", "full", lambda m: m <= 8)
    m1 = sel(d_rat, "nvfp4", "full", lambda m: m == 1)
    mx1 = sel(d_rat, "mxfp4", "full", lambda m: m == 1)
    if small:
        lines.append(f"- Decode, M = 1..8: NVFP4 M-Ext costs {_range(small)}x plain (median "
                     f"{statistics.median(small):.3f}; M = 1 alone {_range(m1)}x); MXFP4 M-Ext "
                     f"at M = 1 {_range(mx1)}x. The paper's B200 kernels show 3.1-7.8% median "
                     "M-Ext overhead for M = 1..64.")
    m16 = sel(d_rat, "nvfp4", "full", lambda m: m == 16)
    mx16 = sel(d_rat, "mxfp4", "full", lambda m: m == 16)
    if m16:
        lines.append(f"- Decode, M = 16: NVFP4 M-Ext {_range(m16)}x, MXFP4 M-Ext "
                     f"{_range(mx16)}x: from here the 2M rows of M-Ext are no longer hidden "
                     f"behind the weight read in {who}.")
    large = sel(d_rat, "nvfp4", "full", lambda m: 32 <= m <= FAMILY_SPLIT_M)
    below = sorted((m, s) for (s, f, md, m), r in d_rat.items()
                   if f == "nvfp4" and md == "full" and r < 1.0 and m >= 32)
    if large:
        text = f"- Decode, M = 32..{FAMILY_SPLIT_M}: NVFP4 M-Ext {_range(large)}x."
        if below:
            slow = [d_best[k] / p_best[k] for k in d_best
                    if k[1:3] == ("nvfp4", "none") and k in p_best]
            text += (" Ratios below 1 (" + ", ".join(f"{s} M={m}" for m, s in below)
                     + ") do not mean M-Ext is free: it does strictly more work (2M rows), so "
                     f"they show {who}' plain configurations are poorly tuned at that M")
            text += (f" (at M = {FAMILY_SPLIT_M} the plain layer is {_range(slow)}x the time "
                     "of the prefill family's)." if slow else ".")
        lines.append(text)
    big = lambda m: m >= 2 * FAMILY_SPLIT_M  # noqa: E731
    pm = sel(p_rat, "nvfp4", "full", big)
    if pm:
        parts = [f"K-Ext {md} {_range(sel(p_rat, 'nvfp4', md, big))}x"
                 for md in ("0.125", "0.25", "0.5", "1.0") if sel(p_rat, "nvfp4", md, big)]
        k1_vs_m = [p_best[(s, f, "1.0", m)] / p_best[(s, f, "full", m)]
                   for (s, f, md, m) in p_best if md == "full" and f == "nvfp4" and big(m)
                   and (s, f, "1.0", m) in p_best]
        lines.append(f"- Prefill, M = {2 * FAMILY_SPLIT_M}..2048: NVFP4 M-Ext {_range(pm)}x "
                     f"plain (it doubles the rows); {', '.join(parts)}. The K-Ext cost grows "
                     "with the compensated fraction of K; K-Ext 1.0 / M-Ext = "
                     f"{_range(k1_vs_m)}.")
    p128 = sel(p_rat, "nvfp4", "full", lambda m: m == FAMILY_SPLIT_M)
    k128 = sel(p_rat, "nvfp4", "0.125", lambda m: m == FAMILY_SPLIT_M)
    if p128:
        tf = tflops(p_best, lambda m: m == FAMILY_SPLIT_M)
        tf_big = tflops(p_best, lambda m: m >= 8 * FAMILY_SPLIT_M)
        lines.append(f"- Prefill, M = {FAMILY_SPLIT_M}: M-Ext {_range(p128)}x, K-Ext 0.125 "
                     f"{_range(k128)}x; plain reaches {_range(tf, 0)} TFLOP/s (dense "
                     f"equivalent) at this M against {_range(tf_big, 0)} at M >= "
                     f"{8 * FAMILY_SPLIT_M}, so part of the added work fits in idle compute.")
    kd = [(s, m, r, d_rat.get((s, "nvfp4", "full", m)))
          for (s, f, md, m), r in d_rat.items() if f == "nvfp4" and md == "0.125"]
    if kd:
        worse = sum(1 for *_, r, mx in kd if mx is not None and r > mx)
        both = sum(1 for *_, mx in kd if mx is not None)
        lines.append(f"- K-Ext 0.125 in {who} (M = "
                     f"{', '.join(str(m) for m in sorted({m for _, m, *_ in kd}))}): "
                     f"{_range([r for _, _, r, _ in kd])}x plain, above M-Ext in {worse} of "
                     f"{both} (shape, M) points.")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--decode", type=Path, default=DECODE_JSON)
    ap.add_argument("--prefill", default=str(PREFILL_JSON),
                    help="a report for M >= 256, or 'none' (decode range only)")
    ap.add_argument("--model", default="qwen3-8b", choices=sorted(MODEL_LABEL),
                    help="names the figure; files other than Qwen3-8B's get a _<model> suffix")
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    a = ap.parse_args(argv)
    dec = load_json(a.decode)
    pre = NO_PREFILL if a.prefill == "none" else load_json(Path(a.prefill))
    label = MODEL_LABEL[a.model]
    name = OUT_NAME if a.model == "qwen3-8b" else f"{OUT_NAME}_{a.model.replace('-', '_')}"
    svg, md = render_svg(dec, pre, label), render_md(dec, pre, label, name)
    a.out_dir.mkdir(parents=True, exist_ok=True)
    for ext, text in (("svg", svg), ("md", md)):
        path = a.out_dir / f"{name}.{ext}"
        path.write_text(text)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
