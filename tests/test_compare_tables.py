"""bench/report/compare_tables.py on two small tables with the dispatch database's columns."""

from __future__ import annotations

import json
import lzma
import math
import sqlite3
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench" / "report"))

import compare_tables as C  # noqa: E402


def _table(path: Path, rows: list[tuple[int, int, float, str]]) -> None:
    """rows: (m, n, median_us, status); two results per workload where given twice."""
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE workloads (id INTEGER PRIMARY KEY, op TEXT, key TEXT)")
    con.execute("CREATE TABLE results (id INTEGER PRIMARY KEY, workload_id INTEGER, "
                "status TEXT, median_us REAL)")
    ids: dict[tuple[int, int], int] = {}
    for m, n, us, status in rows:
        if (m, n) not in ids:
            ids[(m, n)] = len(ids) + 1
            key = json.dumps({"op": "linear", "fmt": "nvfp4", "m": m, "n": n, "k": 64})
            con.execute("INSERT INTO workloads VALUES (?, 'linear', ?)", (ids[(m, n)], key))
        con.execute("INSERT INTO results (workload_id, status, median_us) VALUES (?, ?, ?)",
                    (ids[(m, n)], status, us))
    con.commit()
    con.close()


def test_best_of_ok_rows_geomean_per_bucket(tmp_path, capsys):
    old, new = tmp_path / "old.sqlite", tmp_path / "new.sqlite"
    _table(old, [(1, 128, 10.0, "ok"), (1, 128, 8.0, "ok"), (1, 256, 4.0, "ok"),
                 (16, 128, 20.0, "ok"), (16, 512, 9.0, "ok")])
    # a failed row faster than everything must not count; (16, 512) only in old
    _table(new, [(1, 128, 4.0, "ok"), (1, 128, 1.0, "check_failed"), (1, 256, 8.0, "ok"),
                 (16, 128, 10.0, "ok")])
    with open(new, "rb") as src, lzma.open(tmp_path / "new.sqlite.xz", "wb") as dst:
        dst.write(src.read())
    res = C.compare(C.best_medians(old, "linear"), C.best_medians(tmp_path / "new.sqlite.xz",
                                                                  "linear"))
    assert list(res) == ["M=1", "M=16", "all"]
    n, g, lo, hi = res["M=1"]
    assert n == 2 and math.isclose(g, math.sqrt(2.0 * 0.5)) and (lo, hi) == (0.5, 2.0)
    assert res["M=16"][:2] == (1, 2.0)
    assert res["all"][0] == 3 and math.isclose(res["all"][1], 2.0 ** (1 / 3))
    assert C.main([str(old), str(new)]) == 0
    assert "geomean" in capsys.readouterr().out
    assert C.main([str(old), str(new), "--op", "attention"]) == 1


def test_attention_buckets():
    assert C.bucket_of(json.dumps({"op": "decode_attention", "batch": 8, "kv_len": 131072})) \
        == "B=8 KV=131072"
    assert C.bucket_of(json.dumps({"op": "quant", "k": 4096})) == "quant"
