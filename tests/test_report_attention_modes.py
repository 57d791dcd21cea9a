"""bench/report/attention_modes.py: Q16 against plain / ResAttn from a table's tuned medians."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench" / "report"))

import attention_modes as AM  # noqa: E402


def test_ratios_of_the_shipped_table_cover_every_q16_geometry(capsys):
    """The shipped table tunes Q16 on the default grid (48 geometries) next to both other
    modes: a ratio per geometry and mode, positive and finite; the CLI prints both lines."""
    table = ROOT / "tuned" / "h200.sqlite.xz"
    if not table.exists():
        pytest.skip("no shipped table")
    r = AM.ratios(table)
    assert set(r) == {"q16/plain", "q16/resattn"}
    assert len(r["q16/plain"]) == len(r["q16/resattn"]) == 48
    assert all(0 < x < 10 for xs in r.values() for x in xs)
    assert AM.main([str(table)]) == 0
    out = capsys.readouterr().out
    assert "q16/plain: 48 geometries" in out and "q16/resattn: 48 geometries" in out


def test_a_missing_table_is_one_usage_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        AM.main([str(tmp_path / "none.sqlite")])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith(f"no tuning table at {tmp_path / 'none.sqlite'}")
    assert not any("Traceback" in ln for ln in err)
