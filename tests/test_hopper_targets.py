"""CPU test of bench/report/hopper_targets.py on synthetic `resgen bench` reports: every row
comes from the first report holding all the sums it needs (so numerator and denominator are
one run's), the verdicts follow the issue-20 thresholds, and the committed table is what the
script makes from the committed reports."""

from __future__ import annotations

import json
import lzma
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench" / "report"))

import hopper_targets as HT  # noqa: E402

SHAPES = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]


def _row(comp, m, n, k, us, ok=True, **extra):
    return {"problem": {"fmt": "nvfp4", "compensation": comp, "m": m, "n": n, "k": k},
            "check": {"ok": ok}, "resgen_us": us, "floor_us": 1.0, **extra}


def _write(path: Path, rows: list[dict]) -> str:
    path.write_bytes(lzma.compress(json.dumps({"rows": rows}).encode()))
    return path.name


def test_rows_come_from_the_first_report_that_holds_them(tmp_path):
    new, old = [], []
    for n, k in SHAPES:
        # the new report: plain only at M = 2048 (4 x 100 us), BF16 4 x 110
        new.append(_row("none", 2048, n, k, 100.0, bf16_us=110.0))
        # the old report: plain 4 x 120 and full 4 x 240 at 2048, decode rows at M = 1
        old += [_row("none", 2048, n, k, 120.0, bf16_us=110.0), _row("full", 2048, n, k, 240.0),
                _row("none", 1, n, k, 7.0, bf16_us=30.0, fp8_tensor_prequant_us=10.0),
                _row("w4a16", 1, n, k, 8.0)]
    old.append(_row("full", 1, 6144, 4096, 1.0, ok=False))       # a failed check: not summed
    names = (_write(tmp_path / "new.json.xz", new), _write(tmp_path / "old.json.xz", old))
    rows = HT.targets("qwen3-8b", HT.Reports(names, tmp_path))
    t = {(r[1], r[2]): r for r in rows}
    pre = t[("prefill plain >= 1.0x cuBLAS BF16", "M = 2048")]
    assert pre[3] == pytest.approx(1.1) and pre[4] and pre[5] == "new.json.xz"
    full = t[("full residue <= 1.05x plain", "M = 2048")]          # new lacks full: old's pair
    assert full[3] == pytest.approx(2.0) and not full[4] and full[5] == "old.json.xz"
    assert t[("plain <= 30 us", "M = 1")][3] == pytest.approx(28.0)
    assert t[("plain <= 30 us", "M = 1")][4]
    assert t[("plain >= 3.6x cuBLAS BF16", "M = 1")][3] == pytest.approx(30 / 7)
    fp8 = t[("plain faster than cuBLAS FP8 W8A8, per-tensor pre-quantized", "M = 1")]
    assert fp8[3] == pytest.approx(10 / 7) and fp8[4]
    w4 = t[("W4A16 faster than plain W4A4", "M = 1")]
    assert w4[3] == pytest.approx(7 / 8) and not w4[4]
    assert ("full residue <= 1.05x plain", "M = 1") not in t      # one shape failed its check
    lim = [r for r in rows if r[1].startswith("plain / limit") and r[2].startswith("M = 2048")]
    # limit at 2048: the BF16 MMA work of the four shapes at BF16_MMA_FLOPS (floor 4 us)
    mma = sum(2.0 * 2048 * n * k for n, k in SHAPES) / HT.BF16_MMA_FLOPS * 1e6
    assert lim[0][3] == pytest.approx(400.0 / mma)
    text = HT.render(rows)
    assert "| qwen3-8b | prefill plain >= 1.0x cuBLAS BF16 | M = 2048 | 1.100 | yes |" in text


def test_kext_presum_rows_are_counted_apart_and_keep_the_folds_apart(tmp_path):
    rows = []
    for n, k in SHAPES:
        rows += [_row("none", 64, n, k, 10.0), _row("0.125", 64, n, k, 12.0),
                 # the presum fold of the same ratio: its key holds fold "presum"
                 {**_row("0.125", 64, n, k, 10.4), "problem": {
                     "fmt": "nvfp4", "compensation": "0.125", "fold": "presum", "m": 64,
                     "n": n, "k": k}}]
    names = (_write(tmp_path / "r.json.xz", rows),)
    got = HT.targets("qwen3-8b", HT.Reports(names, tmp_path))
    t = {(r[1], r[2]): r for r in got}
    presum = t[(HT.KEXT_PRESUM, "ratio 0.125, M = 64")]
    assert presum[3] == pytest.approx(1.04) and presum[4]
    assert t[("K-Ext exact fold / plain", "ratio 0.125, M = 64")][3] == pytest.approx(1.2)
    text = HT.render(got)
    assert "K-Ext presum at plain cost (section 1, counted apart): 1 of 1." in text
    assert "| K-Ext exact fold / plain | ratio 0.125, M = 64 | 1.200 | - |" in text
    # the section-3 count leaves the K-Ext rows out
    goals = [r for r in got if not r[1].startswith(HT.INFO) and r[1] != HT.KEXT_PRESUM]
    assert f"Targets met: {sum(r[4] for r in goals)} of {len(goals)}." in text


def test_the_committed_table_is_the_scripts_output(tmp_path):
    out = tmp_path / "t.md"
    assert HT.main(["--out", str(out)]) == 0
    assert out.read_text() == (ROOT / "bench" / "results" / "h200" / "hopper_targets.md"
                               ).read_text()


def test_a_missing_or_damaged_report_is_one_line(tmp_path, capsys):
    assert HT.main(["--results", str(tmp_path), "--out", str(tmp_path / "t.md")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hopper_targets: ") and len(err.strip().splitlines()) == 1
    for name in HT.REPORTS["qwen3-8b"]:
        (tmp_path / name).write_bytes(b"not xz")
    assert HT.main(["--results", str(tmp_path), "--out", str(tmp_path / "t.md")]) == 2
    assert not (tmp_path / "t.md").exists()
