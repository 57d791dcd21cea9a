"""bench/report/fold_table.py on a small table with the dispatch database's columns."""

from __future__ import annotations

import json
import math
import sqlite3
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench" / "report"))

import fold_table as F  # noqa: E402


def _table(path: Path, rows: list[tuple[str, str, int, float, str]]) -> None:
    """rows: (compensation, fold, n, median_us, status) at M = 16, K = 64."""
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE workloads (id INTEGER PRIMARY KEY, op TEXT, key TEXT)")
    con.execute("CREATE TABLE results (id INTEGER PRIMARY KEY, workload_id INTEGER, "
                "status TEXT, median_us REAL)")
    ids: dict[tuple[str, str, int], int] = {}
    for comp, fold, n, us, status in rows:
        if (comp, fold, n) not in ids:
            ids[(comp, fold, n)] = len(ids) + 1
            w = {"op": "linear", "fmt": "nvfp4", "compensation": comp, "m": 16, "n": n, "k": 64}
            if fold == "presum":
                w["fold"] = "presum"
            con.execute("INSERT INTO workloads VALUES (?, 'linear', ?)",
                        (ids[(comp, fold, n)], json.dumps(w)))
        con.execute("INSERT INTO results (workload_id, status, median_us) VALUES (?, ?, ?)",
                    (ids[(comp, fold, n)], status, us))
    con.commit()
    con.close()


def test_fold_ratios_per_ratio_and_m(tmp_path, capsys):
    db = tmp_path / "t.sqlite"
    _table(db, [("none", "exact", 128, 10.0, "ok"),
                ("0.125", "exact", 128, 12.0, "ok"), ("0.125", "presum", 128, 11.0, "ok"),
                # a failed, faster presum row must not count
                ("0.125", "presum", 128, 1.0, "check_failed"),
                ("none", "exact", 256, 20.0, "ok"),
                ("0.125", "exact", 256, 30.0, "ok"), ("0.125", "presum", 256, 20.0, "ok"),
                # no plain twin: left out
                ("0.125", "exact", 512, 9.0, "ok"), ("0.125", "presum", 512, 5.0, "ok")])
    res = F.fold_ratios(F.best_medians(db, "linear"))
    assert list(res) == [(0.125, 16)]
    n, presum, exact = res[(0.125, 16)]
    assert n == 2
    assert math.isclose(presum, math.sqrt(1.1 * 1.0))
    assert math.isclose(exact, math.sqrt(1.2 * 1.5))
    assert F.main([str(db)]) == 0
    out = capsys.readouterr().out
    assert "presum/plain" in out and f"{presum:.3f}" in out


def test_no_presum_rows_is_an_error_exit(tmp_path, capsys):
    db = tmp_path / "t.sqlite"
    _table(db, [("none", "exact", 128, 10.0, "ok")])
    assert F.main([str(db)]) == 1
    assert "no K-Ext presum workload" in capsys.readouterr().out
