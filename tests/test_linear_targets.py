"""CPU test of bench/report/linear_targets.py on a synthetic `resgen bench` report: the ratios are
ratios of four-shape sums, rows with a failed check or a missing shape are not summed, and
each target's verdict follows its threshold."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench" / "report"))

import linear_targets as LT  # noqa: E402

SHAPES = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]


def _row(fmt, comp, m, n, k, us, ok=True, **extra):
    return {"problem": {"fmt": fmt, "compensation": comp, "m": m, "n": n, "k": k},
            "check": {"ok": ok}, "resgen_us": us, **extra}


def report() -> dict:
    rows = []
    for n, k in SHAPES:
        for m in (1, 4, 16):
            # plain 10 us per layer, BF16 40 (4x), FP8 15 (1.5x); floor 9 (90%) at M = 1
            rows.append(_row("nvfp4", "none", m, n, k, 10.0, bf16_us=40.0, fp8_us=15.0,
                             floor_us=9.0 if n != 4096 or k == 12288 else 5.0))
            rows.append(_row("nvfp4", "full", m, n, k, 10.2 if m == 1 else 12.0))
            rows.append(_row("mxfp4", "full", m, n, k, 10.0, triton_us=60.0 if m == 1 else 40.0))
    rows.append(_row("nvfp4", "none", 32, 6144, 4096, 1.0, bf16_us=1e6))     # one shape only
    rows.append(_row("nvfp4", "full", 1, 6144, 4096, 1.0, ok=False))        # failed check
    return {"rows": rows}


def test_decode_targets_are_ratios_of_four_shape_sums():
    t = {(name, how): (x, ok) for name, how, x, ok in LT.decode_targets(report())}
    assert t[("decode M = 1..16 >= 3.5x cuBLAS BF16", "sum over 4 shapes x M = 1, 4, 16")] \
        == (pytest.approx(4.0), True)
    assert t[("decode M = 1..16 >= 2.0x cuBLAS FP8", "sum over 4 shapes x M = 1, 4, 16")] \
        == (pytest.approx(1.5), False)
    assert t[("gate/up >= 85% of the NVFP4 floor", "M = 1, 24576 x 4096")] == \
        (pytest.approx(0.9), True)
    assert t[("down >= 85% of the NVFP4 floor", "M = 1, 4096 x 12288")][1] is True
    assert t[("M-Ext / plain <= 1.03", "NVFP4, M = 1")] == (pytest.approx(1.02), True)
    assert t[("M-Ext / plain <= 1.03", "NVFP4, M = 16")] == (pytest.approx(1.2), False)
    assert t[("MXFP4 M-Ext >= 5x Triton", "M = 1")] == (pytest.approx(6.0), True)
    assert t[("MXFP4 M-Ext >= 5x Triton", "M = 4")] == (pytest.approx(4.0), False)
    assert not any("M = 32" in how for _, how in t)         # M = 32 lacks three shapes


def test_prefill_targets_and_rendering(tmp_path):
    rows = []
    for n, k in SHAPES:
        rows += [_row("nvfp4", "none", 2048, n, k, 100.0, bf16_us=95.0),
                 _row("nvfp4", "0.125", 2048, n, k, 109.0),
                 _row("nvfp4", "full", 2048, n, k, 200.0),
                 _row("nvfp4", "1.0", 2048, n, k, 300.0)]
    t = {name: (x, ok) for name, _, x, ok in LT.prefill_targets({"rows": rows})}
    assert t["plain >= 0.9x cuBLAS BF16"] == (pytest.approx(0.95), True)
    assert t["K-Ext 0.125 / plain <= 1.10"] == (pytest.approx(1.09), True)
    assert t["full M-Ext >= 1.5x faster than full K-Ext"] == (pytest.approx(1.5), True)
    md = LT.render(report(), {"rows": rows}, ("d.json", "p.json"))
    assert "| gate/up >= 85% of the NVFP4 floor | M = 1, 24576 x 4096 | 90.0% | yes |" in md
    assert "| K-Ext 0.125 / plain <= 1.10 | NVFP4, M = 2048 | 1.0900 | yes |" in md
