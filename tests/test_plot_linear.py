"""CPU tests of bench/report/plot_linear.py (relative-latency figure of the Hopper linear
kernels) and bench/report/svgplot.py (the SVG writer it shares with
bench/report/plot_attention.py), on synthetic reports with the structure of the committed H200
JSON files."""

from __future__ import annotations

import json
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH / "report"))

import plot_attention  # noqa: E402
import plot_linear as PL  # noqa: E402
from report_io import load_json  # noqa: E402
import svgplot  # noqa: E402

SVG_NS = "{http://www.w3.org/2000/svg}"
DIMS = {"qkv": (6144, 4096), "down": (4096, 12288)}


def _problem(shape: str, fmt: str, mode: str, m: int) -> str:
    n, k = DIMS[shape]
    return json.dumps({"compensation": mode, "fmt": fmt, "k": k, "m": m, "n": n,
                       "op": "linear", "static_scale": True}, sort_keys=True)


def _task(shape, fmt, mode, m, us, kind="layer", pdl=False, timing_mode="graph") -> dict:
    return {"shape": shape, "fmt": fmt, "mode": mode, "m": m, "kind": kind, "pdl": pdl,
            "act": "fused", "timing_mode": timing_mode, "median_us": us, "rel_err": 1e-3,
            "problem": _problem(shape, fmt, mode, m), "name": "v"}


def _entry(shape, fmt, mode, m, us, quantizer=True, ok=True) -> dict:
    return {"shape": shape, "fmt": fmt, "mode": mode, "m": m, "quantizer": quantizer,
            "check": {"ok": ok, "rel_err": 1e-3}, "median_us": us,
            "problem": _problem(shape, fmt, mode, m)}


def decode_report() -> dict:
    """Plain = 10 us * (shape factor); M-Ext 1.2x plain except M = 2 (exactly 1.0x); K-Ext
    0.125 2x at M = 1 and 16 only; MXFP4 M-Ext 1.5x at M = 1; plus faster records that must be
    ignored (GEMM-only, PDL, eagerly timed, and a slower duplicate that must lose)."""
    tasks = []
    for shape, f in (("qkv", 1.0), ("down", 3.0)):
        for m in (1, 2, 16, 128):
            plain = 10.0 * f * m
            tasks += [_task(shape, "nvfp4", "none", m, plain),
                      _task(shape, "nvfp4", "none", m, plain * 1.7),       # slower duplicate
                      _task(shape, "nvfp4", "none", m, plain / 4, kind="gemm"),
                      _task(shape, "nvfp4", "none", m, plain / 3, pdl=True),
                      _task(shape, "nvfp4", "none", m, plain / 5, timing_mode="eager"),
                      _task(shape, "nvfp4", "full", m, plain * (1.0 if m == 2 else 1.2)),
                      _task(shape, "nvfp4", "full", m, plain / 9, kind="gemm")]
            if m in (1, 16):
                tasks.append(_task(shape, "nvfp4", "0.125", m, plain * 2.0))
        tasks += [_task(shape, "mxfp4", "none", 1, 8.0 * f),
                  _task(shape, "mxfp4", "full", 1, 12.0 * f)]
    return {"tasks": tasks, "baselines": [], "table": [],
            "environment": {"gpu_name": "Synthetic GPU", "date": "2026-01-01T00:00:00"}}


def prefill_report() -> dict:
    """Plain at M = 128, 256; M-Ext 1.8x; K-Ext 0.125 1.1x, 1.0 1.9x; faster GEMM-only and a
    failed-check entry that must be ignored; MXFP4 plain only (no ratio)."""
    entries = []
    for shape in DIMS:
        for m in (128, 256):
            plain = 0.5 * m
            entries += [_entry(shape, "nvfp4", "none", m, plain),
                        _entry(shape, "nvfp4", "none", m, plain / 3, quantizer=False),
                        _entry(shape, "nvfp4", "full", m, plain * 1.8),
                        _entry(shape, "nvfp4", "full", m, plain / 2, ok=False),
                        _entry(shape, "nvfp4", "0.125", m, plain * 1.1),
                        _entry(shape, "nvfp4", "1.0", m, plain * 1.9)]
        entries.append(_entry(shape, "mxfp4", "none", 256, 140.0))
    return {"entries": entries, "baselines": [], "table": [],
            "environment": {"date": "2026-01-01T00:05:00"}}


def test_best_uses_whole_layer_non_pdl_graph_timings_only():
    d = PL.decode_best(decode_report())
    assert d[("qkv", "nvfp4", "none", 16)] == pytest.approx(160.0)
    assert d[("down", "nvfp4", "full", 1)] == pytest.approx(36.0)
    p = PL.prefill_best(prefill_report())
    assert p[("qkv", "nvfp4", "full", 128)] == pytest.approx(64 * 1.8)
    assert p[("down", "nvfp4", "none", 256)] == pytest.approx(128.0)


def test_ratios_are_relative_to_plain_of_same_format_shape_m():
    r = PL.ratios(PL.decode_best(decode_report()))
    assert r[("qkv", "nvfp4", "full", 1)] == pytest.approx(1.2)
    assert r[("down", "nvfp4", "full", 2)] == pytest.approx(1.0)
    assert r[("down", "nvfp4", "0.125", 16)] == pytest.approx(2.0)
    assert r[("qkv", "mxfp4", "full", 1)] == pytest.approx(1.5)
    assert not any(mode == "none" for _, _, mode, _ in r)
    pr = PL.ratios(PL.prefill_best(prefill_report()))
    assert pr[("down", "nvfp4", "1.0", 256)] == pytest.approx(1.9)
    assert not any(f == "mxfp4" for _, f, _, _ in pr)        # MXFP4 has no compensated entry


def bench_report() -> dict:
    """A `resgen bench` report: the dispatched variant per workload; M-Ext 1.25x plain for qkv;
    a failed check and an error row that must be ignored; an unnamed shape (1024 x 512)."""
    rows = []
    for m in (1, 16):
        for (n, k), f in (((6144, 4096), 1.0), ((1024, 512), 2.0)):
            for comp, r in (("none", 1.0), ("full", 1.25)):
                rows.append({"problem": {"compensation": comp, "fmt": "nvfp4", "k": k, "m": m,
                                         "n": n, "op": "linear", "static_scale": True},
                             "variant": "linear_sm90_wgmma:x", "check": {"ok": True},
                             "resgen_us": 10.0 * f * m * r})
    rows.append({"problem": {"compensation": "full", "fmt": "mxfp4", "k": 4096, "m": 1,
                             "n": 6144}, "check": {"ok": False}, "resgen_us": 1.0})
    rows.append({"problem": {"compensation": "none", "fmt": "mxfp4", "k": 4096, "m": 1,
                             "n": 6144}, "error": "RuntimeError: x"})
    return {"environment": {"gpu_name": "Synthetic GPU"}, "policy": {"name": "p"},
            "date": "2026-01-01 00:00:00", "rows": rows}


def test_bench_report_as_the_decode_source():
    rep = bench_report()
    assert PL.is_bench(rep) and PL.decode_family(rep) is PL.DISPATCH
    best = PL.decode_best(rep)
    assert set(best) == {(s, "nvfp4", c, m) for s in ("qkv", "1024x512")
                         for c in ("none", "full") for m in (1, 16)}
    r = PL.ratios(best)
    assert r[("qkv", "nvfp4", "full", 16)] == pytest.approx(1.25)
    assert PL.shape_dims(rep)["1024x512"] == (1024, 512)
    svg = PL.render_svg(rep, prefill_report())
    ET.fromstring(svg)
    assert "dispatch" in svg and "Synthetic GPU" in svg
    md = PL.render_md(rep, prefill_report())
    assert "| qkv | 16 | dispatch | 160.0 | 1.250 |" in md


def test_bench_report_as_the_prefill_source():
    """A `resgen bench` report at prefill M (the shipped table's prefill buckets) is read the
    same way and drawn as the prefill-dispatch family."""
    rep = bench_report()
    for r in rep["rows"]:
        r["problem"]["m"] *= 256                       # M = 256, 4096
    assert PL.prefill_family(rep) is PL.PREFILL_DISPATCH
    assert PL.prefill_family(prefill_report()) is PL.PREFILL
    r = PL.ratios(PL.prefill_best(rep))
    assert r[("qkv", "nvfp4", "full", 4096)] == pytest.approx(1.25)
    svg = PL.render_svg(decode_report(), rep)
    root = ET.fromstring(svg)
    keys = {e.get("data-series") for e in _polylines(root)}
    assert "nvfp4/full/prefill dispatch" in keys
    assert "| qkv | 256 | prefill dispatch | 10.0 | 1.250 |" in PL.render_md(decode_report(), rep)


def test_bad_reports_raise_value_error():
    with pytest.raises(ValueError, match="tasks"):
        PL.decode_best({"entries": []})
    with pytest.raises(ValueError, match="entries"):
        PL.prefill_best({"tasks": []})
    with pytest.raises(ValueError):
        PL.decode_best([])


def _polylines(root) -> list:
    return [e for e in root.iter(f"{SVG_NS}polyline") if e.get("data-series")]


def _points(el) -> list[tuple[float, float]]:
    return [tuple(map(float, p.split(","))) for p in el.get("points").split()]


def test_svg_is_well_formed_with_expected_series_per_panel():
    svg = PL.render_svg(decode_report(), prefill_report())
    root = ET.fromstring(svg)
    titles = [t.text for t in root.iter(f"{SVG_NS}text") if t.text and "(N=" in t.text]
    assert titles == ["qkv  (N=6144, K=4096)", "down  (N=4096, K=12288)"]   # SHAPES order
    lines = _polylines(root)
    expected = {"nvfp4/full/decode", "nvfp4/full/prefill", "nvfp4/0.125/decode",
                "nvfp4/0.125/prefill", "nvfp4/1.0/prefill", "mxfp4/full/decode"}
    keys = [e.get("data-series") for e in lines]
    assert sorted(keys) == sorted(list(expected) * 2)          # every series in both panels
    n_points = {"nvfp4/full/decode": 4, "nvfp4/full/prefill": 2, "nvfp4/0.125/decode": 2,
                "nvfp4/0.125/prefill": 2, "nvfp4/1.0/prefill": 2, "mxfp4/full/decode": 1}
    for e in lines:
        assert len(_points(e)) == n_points[e.get("data-series")]
    # K-Ext decode skips M = 2..8: dashed; M-Ext decode is measured at 1, 2, (16, 128): the
    # 2 -> 16 step is a gap too, the prefill lines are contiguous
    dashed = {e.get("data-series") for e in lines if e.get("stroke-dasharray")}
    assert dashed == {"nvfp4/0.125/decode", "nvfp4/full/decode"}
    # the family marker: decode points are filled circles, prefill points open squares
    assert len(list(root.iter(f"{SVG_NS}circle"))) == 2 * (4 + 2 + 1) + 1    # + legend sample
    # legend: one entry per series style plus the plain line and the two families
    legend = [t.text for t in root.iter(f"{SVG_NS}text")]
    for label in ("plain FP4 (= 1.0)", "NVFP4 M-Ext (full residue)", "NVFP4 K-Ext 0.125",
                  "NVFP4 K-Ext 1.0", "MXFP4 M-Ext (full residue)",
                  "decode: linear_sm90_mma", "prefill: linear_sm90_wgmma"):
        assert label in legend
    assert "NVFP4 K-Ext 0.25" not in legend                     # not measured, not drawn


def test_svg_point_with_ratio_one_lies_on_the_plain_line():
    root = ET.fromstring(PL.render_svg(decode_report(), prefill_report()))
    plain_y = [float(e.get("y1")) for e in root.iter(f"{SVG_NS}line")       # document order
               if e.get("stroke") == "#000" and e.get("y1") == e.get("y2")
               and float(e.get("x2")) - float(e.get("x1")) > 100]
    assert len(plain_y) == 2                                    # one per panel
    mext = [e for e in _polylines(root) if e.get("data-series") == "nvfp4/full/decode"]
    for line, y1 in zip(mext, plain_y):
        pts = _points(line)                                     # M = 1, 2, 16, 128
        assert pts[1][1] == pytest.approx(y1, abs=0.06)         # ratio 1.0 at M = 2
        assert pts[0][1] < y1 and pts[0][1] == pytest.approx(pts[2][1])   # 1.2 above, equal
        assert pts[0][0] < pts[1][0] < pts[2][0] < pts[3][0]    # log x increases with M


def test_markdown_table_has_the_same_ratios():
    md = PL.render_md(decode_report(), prefill_report())
    rows = [r for r in md.splitlines() if r.startswith("| ")]
    header = [c.strip() for c in rows[0].strip("|").split("|")]
    cells = {}
    for r in rows[2:]:
        c = [x.strip() for x in r.strip("|").split("|")]
        cells[(c[0], int(c[1]), c[2])] = dict(zip(header, c))
    assert cells[("qkv", 1, "decode")]["NVFP4 M-Ext (full residue)"] == "1.200"
    assert cells[("qkv", 1, "decode")]["MXFP4 M-Ext (full residue)"] == "1.500"
    assert cells[("down", 2, "decode")]["NVFP4 K-Ext 0.125"] == "–"
    assert cells[("down", 128, "prefill")]["NVFP4 K-Ext 1.0"] == "1.900"
    assert cells[("down", 128, "decode")]["plain NVFP4 us"] == "3840.0"
    assert ("qkv", 128, "decode") in cells and ("qkv", 128, "prefill") in cells
    assert "## What it shows" in md


def test_main_writes_both_files(tmp_path):
    dec, pre = tmp_path / "d.json", tmp_path / "p.json"
    dec.write_text(json.dumps(decode_report()))
    pre.write_text(json.dumps(prefill_report()))
    assert PL.main(["--decode", str(dec), "--prefill", str(pre), "--out-dir",
                    str(tmp_path / "out")]) == 0
    svg = (tmp_path / "out" / f"{PL.OUT_NAME}.svg").read_text()
    ET.fromstring(svg)
    assert "Synthetic GPU" in svg
    assert (tmp_path / "out" / f"{PL.OUT_NAME}.md").read_text().count("| qkv |") == 6


def test_decode_only_figure_for_another_model(tmp_path):
    """--prefill none: the decode range alone, named after the model; no prefill series,
    legend entry or run date, and the markdown says the prefill range was not measured."""
    dec = tmp_path / "d.json"
    dec.write_text(json.dumps(bench_report()))
    assert PL.main(["--decode", str(dec), "--prefill", "none", "--model", "qwen3-4b",
                    "--out-dir", str(tmp_path / "out")]) == 0
    name = f"{PL.OUT_NAME}_qwen3_4b"
    svg = (tmp_path / "out" / f"{name}.svg").read_text()
    root = ET.fromstring(svg)
    assert "Qwen3-4B shapes" in svg and "prefill run" not in svg
    assert "prefill dispatch: " not in svg
    assert all("prefill" not in (e.get("data-series") or "") for e in _polylines(root))
    md = (tmp_path / "out" / f"{name}.md").read_text()
    assert md.startswith(f"# {name}:") and "not measured for this model" in md
    assert "| qkv | 16 | dispatch | 160.0 | 1.250 |" in md


# ------------------------------------------------------------------------------ svgplot


def test_svgplot_escapes_text_and_validates_input():
    s = svgplot.Series('a<b & "c"', [(1, 1.0), (4, 2.0)], "#123456", key="k&1")
    body = svgplot.panel(0, 0, "t<&>", [s], svgplot.Axes(ylabel="y&", legend_step=40))
    root = ET.fromstring(svgplot.document(body, 300, 210, footer="f<"))
    texts = [t.text for t in root.iter(f"{SVG_NS}text")]
    assert "t<&>" in texts and 'a<b & "c"' in texts and "f<" in texts
    assert [e.get("data-series") for e in root.iter(f"{SVG_NS}polyline")] == ["k&1"]
    with pytest.raises(ValueError, match="x must be > 0"):
        svgplot.Series("bad", [(0, 1.0)], "#000")
    with pytest.raises(ValueError, match="marker"):
        svgplot.Series("bad", [(1, 1.0)], "#000", marker="star")
    with pytest.raises(ValueError, match="cols"):
        svgplot.grid_origins(3, 0, 10, 10)


def test_svgplot_ystep_ticks_cover_the_data():
    s = svgplot.Series("s", [(1, 0.7), (2, 2.26)], "#000")
    body = svgplot.panel(0, 0, "t", [s], svgplot.Axes(ystep=0.5, headroom=1.0,
                                                       yfmt=lambda v: f"{v:.1f}"))
    labels = [re.search(r">([^<]*)</text>", e).group(1) for e in body
              if 'text-anchor="end"' in e]
    assert labels == ["0.0", "0.5", "1.0", "1.5", "2.0", "2.5"]


def test_svgplot_grid_origins_row_major():
    assert svgplot.grid_origins(3, 2, 100, 50, left=5, top=7) == [(5, 7), (105, 7), (5, 57)]


# ------------------------------------------------------------ plot_attention on svgplot


def test_attention_plot_reproduces_the_committed_h200_figure():
    """plot_attention.render (called by bench/gpu_attention_check.py) now draws through
    svgplot; on the committed H200 report it must give the committed SVG byte for byte."""
    res = BENCH / "results" / "h200"
    report = load_json(res / "attention_sm90_check.json.xz")
    assert plot_attention.render(report) == (res / "attention_sm90_check.svg").read_text()


def test_attention_plot_on_synthetic_report_is_well_formed():
    configs = [{"geom": g, "batch": b, "kv_len": n, "floor_us": n * b / 4000,
                "resattn": {"best": {"us": n * b / 3000}}, "sdpa": {"us": n * b / 1000}}
               for g in ("g1", "g2") for b in (1, 8, 64) for n in (8192, 32768, 131072)]
    root = ET.fromstring(plot_attention.render({"configs": configs, "env": {"gpu": "A&B"}}))
    assert len(list(root.iter(f"{SVG_NS}polyline"))) == 2 * 2 * 3      # geoms x rows x batches
    assert len(list(root.iter(f"{SVG_NS}circle"))) == 2 * 2 * 3 * 3
    assert any(t.text == "A&B; dashed: targets (2.9x, 85%)" for t in root.iter(f"{SVG_NS}text"))
