"""bench/report/attention_targets.py: one row per geometry and batch with the worst point over KV
lengths >= 32K, recomputed here from the raw configs for one row; the committed table is the
one the script writes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH / "report"))

import attention_targets as A  # noqa: E402
from report_io import load_json  # noqa: E402


@pytest.fixture(scope="module")
def check():
    if not A.CHECK.exists():
        pytest.skip("committed H200 report not present")
    return load_json(A.CHECK)


def test_worst_points_recomputed(check):
    rows = {(g, b): r for g, b, *r in A.target_rows(check)}
    assert {g for g, _ in rows} == {"qwen3-8b", "qwen3-32b", "d256"}
    kvs, sp, fl, ra = rows[("qwen3-8b", 64)]
    pts = [c for c in check["configs"] if c["geom"] == "qwen3-8b" and c["batch"] == 64
           and c["kv_len"] >= 32768]
    assert kvs == sorted(c["kv_len"] for c in pts) and len(pts) == 2
    res = [c["table"]["resattn"]["us"] for c in pts]
    assert sp == pytest.approx(min(c["sdpa"]["gqa"]["us"] / r for c, r in zip(pts, res)))
    assert fl == pytest.approx(min(c["floor_us"] / r for c, r in zip(pts, res)))
    assert ra == pytest.approx(max(r / c["table"]["plain"]["us"] for c, r in zip(pts, res)))


def test_committed_table_is_current(check, tmp_path):
    out = tmp_path / "t.md"
    assert A.main(["--out", str(out)]) == 0
    assert out.read_text() == (A.RESULTS / "attention_targets.md").read_text()
    assert "| qwen3-8b | 64 |" in out.read_text()
