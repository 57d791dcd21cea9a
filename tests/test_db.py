"""The SQLite dispatch database: round trip, reload, concurrency, a killed writer, bad files."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fakefam import FakeProblem, FakeVariant, isolated_cache, make_env, subprocess_env  # noqa: F401
from resgen.db import (SCHEMA_VERSION, CorruptDatabaseError, DatabaseError,
                       ForeignDatabaseError, MissingDatabaseError, NewerSchemaError, TuningDB)
from resgen.search.record import ResultRecord, Status, pick_winner


def rec(m=1, tile=8, stages=1, median=5.0, status=Status.OK, fp="fp0", env=None, idx=0,
        **kw) -> ResultRecord:
    timed = status == Status.OK
    return ResultRecord(problem=FakeProblem(m=m), variant=FakeVariant(tile=tile, stages=stages),
                        environment=env or make_env(), fingerprint=fp, status=status,
                        space_index=idx, median_us=median if timed else None,
                        q10_us=median * 0.9 if timed else None,
                        q90_us=median * 1.1 if timed else None,
                        samples_us=[median, median * 1.1, median * 0.9] if timed else [],
                        launches=64 if timed else None, n_sets=4 if timed else None,
                        timing_mode="graph" if timed else None,
                        policy={"name": "p", "tie_rel": 0.01} if timed else {}, **kw)


def test_round_trip_and_reload(tmp_path):
    path = tmp_path / "t.sqlite"
    r1 = rec(m=1, stages=1, median=3.25, rel_err=1.5e-4, registers=96, spill_bytes=0,
             compile_s=1.25)
    r2 = rec(m=1, stages=2, median=2.5, idx=1)
    r3 = rec(m=4, stages=1, status=Status.COMPILE_FAILED, error="boom", idx=0)
    with TuningDB(path) as db:
        assert len(db) == 0
        assert db.record(r1) and db.record(r2) and db.record(r3)
        assert len(db) == 3
    with TuningDB(path, readonly=True) as db:
        assert len(db) == 3
        row = db.find(r1.problem, r1.variant, "fp0", r1.environment)
        assert row is not None
        assert row["median_us"] == 3.25 and row["q10_us"] == 3.25 * 0.9
        assert json.loads(row["samples"]) == [3.25, 3.25 * 1.1, 3.25 * 0.9]
        assert (row["registers"], row["spill_bytes"], row["compile_s"]) == (96, 0, 1.25)
        assert row["rel_err"] == 1.5e-4 and row["status"] == "ok"
        assert json.loads(row["policy"]) == {"name": "p", "tie_rel": 0.01}
        # Keys read back parse through the validated constructors only.
        rows = db.rows()
        assert {FakeVariant.from_key(r["variant_key"]) for r in rows} == \
            {r1.variant, r2.variant}
        assert {FakeProblem.from_key(r["workload_key"]) for r in rows} == \
            {FakeProblem(m=1), FakeProblem(m=4)}
        failed = [r for r in rows if r["status"] == Status.COMPILE_FAILED]
        assert failed[0]["error"] == "boom" and failed[0]["median_us"] is None
        # Different fingerprint or environment: a different row.
        assert db.find(r1.problem, r1.variant, "fp1", r1.environment) is None
        assert db.find(r1.problem, r1.variant, "fp0", make_env("Other")) is None
        best = db.best(FakeProblem(m=1), gpu_name="Fake GPU", arch="sm_90a")
        assert best["variant_key"] == r2.variant.key()
        assert db.verify().ok
        with pytest.raises(DatabaseError):
            db.record(r1)                                    # read-only


def test_workload_columns_and_schema(tmp_path):
    with TuningDB(tmp_path / "t.sqlite") as db:
        wid = db.add_workload(FakeProblem(m=16))
        assert db.add_workload(FakeProblem(m=16)) == wid != db.add_workload(FakeProblem(m=4))
        db.record(rec(m=16))
        assert db.conn.execute("SELECT count(*) FROM workloads").fetchone()[0] == 2
        w = list(db.db.query("SELECT * FROM workloads"))[0]
        assert (w["op"], w["fmt"], w["compensation"], w["m"], w["n"], w["k"]) == \
            ("fake_gemm", "nvfp4", "none", 16, 256, 256)
        assert db.conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        meta = dict(db.conn.execute("SELECT key, value FROM meta").fetchall())
        assert meta["app"] == "resgen-tuning" and meta["schema_version"] == str(SCHEMA_VERSION)
        assert db.conn.execute("PRAGMA synchronous").fetchone()[0] == 1       # NORMAL
        env = db.environments()[0]
        assert env["gpu_name"] == "Fake GPU" and env["sm_count"] == 132


def test_phase_seconds_stored_checksummed_and_merged(tmp_path):
    a, b = tmp_path / "a.sqlite", tmp_path / "b.sqlite"
    with TuningDB(a) as db:
        db.record(rec(m=1, phase_s={"compile": 1.5, "prep": 0.25, "check": 0.01,
                                    "time": 0.02}))
        db.record(rec(m=4))                                  # no phases: NULL
        rows = {r["m"]: r for r in db.db.query(
            "SELECT w.m AS m, r.phase_s AS phase_s FROM results r "
            "JOIN workloads w ON w.id = r.workload_id")}
        assert json.loads(rows[1]["phase_s"]) == {"check": 0.01, "compile": 1.5,
                                                  "prep": 0.25, "time": 0.02}
        assert rows[4]["phase_s"] is None and db.verify().ok
        db.conn.execute("UPDATE results SET phase_s = '{\"time\": 9}' "
                        "WHERE phase_s IS NOT NULL")
        assert not db.verify().ok                            # phases are checksummed
        db.conn.execute("UPDATE results SET phase_s = NULL WHERE phase_s IS NOT NULL")
        assert not db.verify().ok                            # ... and cannot be dropped
    with TuningDB(b) as dst:
        with TuningDB(tmp_path / "c.sqlite") as src:
            src.record(rec(m=16, phase_s={"time": 0.5}))
            assert dst.merge_from(src)["added"] == 1
        (row,) = dst.rows()
        assert json.loads(row["phase_s"]) == {"time": 0.5} and dst.verify().ok
        assert dst.export_json()["results"][0]["phase_s"] == {"time": 0.5}


def test_version_1_file_is_read_then_upgraded(tmp_path):
    """A schema-1 file (no results.phase_s) opens read-only as is, keeps its checksums, and
    is upgraded in place by the first writer."""
    path = tmp_path / "v1.sqlite"
    with TuningDB(path) as db:
        db.record(rec(m=1))
    c = sqlite3.connect(path)
    c.execute("ALTER TABLE results DROP COLUMN phase_s")
    c.execute("UPDATE meta SET value = '1' WHERE key = 'schema_version'")
    c.commit()
    c.close()
    with TuningDB(path, readonly=True) as db:
        assert db.schema_version == 1 and db.verify().ok and len(db.rows()) == 1
    with TuningDB(path) as db:
        assert db.schema_version == SCHEMA_VERSION
        db.record(rec(m=4, phase_s={"time": 0.1}))
        assert db.verify().ok and len(db) == 2
    with TuningDB(path, readonly=True) as db:
        assert db.schema_version == SCHEMA_VERSION


def test_xz_compressed_export_reads_back(tmp_path, isolated_cache):  # noqa: F811
    src = tmp_path / "t.sqlite"
    with TuningDB(src) as db:
        for m in (1, 4, 16):
            db.record(rec(m=m, median=float(m)))
        packed = db.export_sqlite(tmp_path / "ship" / "h200.sqlite.xz")
        with pytest.raises(FileExistsError):
            db.export_sqlite(packed)
    assert packed.read_bytes()[:6] == b"\xfd7zXZ\x00"              # an xz stream
    assert not list(packed.parent.glob("*.tmp"))
    with TuningDB(packed, readonly=True) as db, TuningDB(src, readonly=True) as orig:
        assert db.source == packed and db.path != packed
        assert [r["checksum"] for r in db.rows()] == [r["checksum"] for r in orig.rows()]
        assert db.verify().ok
        first = db.path
    with TuningDB(packed, readonly=True) as db:
        assert db.path == first                                    # unpacked once
    with pytest.raises(DatabaseError, match="read-only"):
        TuningDB(packed)
    with pytest.raises(MissingDatabaseError):
        TuningDB(tmp_path / "none.sqlite.xz", readonly=True)
    bad = tmp_path / "bad.sqlite.xz"
    bad.write_bytes(b"\xfd7zXZ\x00 but not really")
    with pytest.raises(CorruptDatabaseError, match="xz"):
        TuningDB(bad, readonly=True)


def test_existing_row_kept_unless_replace(tmp_path):
    with TuningDB(tmp_path / "t.sqlite") as db:
        assert db.record(rec(median=5.0))
        assert not db.record(rec(median=1.0))              # resume semantics: keep the first
        assert db.rows()[0]["median_us"] == 5.0
        assert db.record(rec(median=1.0), replace=True)    # --no-resume re-times
        assert len(db) == 1 and db.rows()[0]["median_us"] == 1.0
        assert db.verify().ok


def test_record_rejects_bad_status():
    with pytest.raises(ValueError):
        rec(status="great")
    with pytest.raises(ValueError):
        ResultRecord(problem=FakeProblem(), variant=FakeVariant(), environment=make_env(),
                     fingerprint="f", status=Status.OK, space_index=0, median_us=None)


def test_pick_winner_ties_go_to_space_order():
    rows = [{"median_us": 10.0, "space_index": 5}, {"median_us": 10.05, "space_index": 2},
            {"median_us": 10.2, "space_index": 0}]
    assert pick_winner(rows, 0.01)["space_index"] == 2     # 10.05 is within 1% of 10.0
    assert pick_winner(rows, 0.0)["space_index"] == 5
    assert pick_winner(rows, 0.05)["space_index"] == 0
    assert pick_winner([], 0.01) is None


def test_tampered_row_fails_verify(tmp_path):
    path = tmp_path / "t.sqlite"
    with TuningDB(path) as db:
        db.record(rec(median=5.0))
        db.record(rec(stages=2, median=6.0, idx=1))
    c = sqlite3.connect(path)
    c.execute("UPDATE results SET median_us = 0.5 WHERE median_us = 6.0")
    c.commit()
    c.close()
    with TuningDB(path, readonly=True) as db:
        rep = db.verify()
    assert not rep.ok and any("checksum" in e for e in rep.errors)


def test_missing_file(tmp_path):
    with pytest.raises(MissingDatabaseError):
        TuningDB(tmp_path / "none.sqlite", readonly=True)
    with pytest.raises(MissingDatabaseError):
        TuningDB(tmp_path / "none.sqlite", create=False)


def test_corrupt_files(tmp_path):
    junk = tmp_path / "junk.sqlite"
    junk.write_bytes(os.urandom(4096))
    for ro in (True, False):
        with pytest.raises(CorruptDatabaseError):
            TuningDB(junk, readonly=ro)
    # A real database whose pages after the header are overwritten.
    good = tmp_path / "good.sqlite"
    with TuningDB(good) as db:
        for i in range(50):
            db.record(rec(m=1 + i))
        c = db.conn
        c.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    data = bytearray(good.read_bytes())
    data[100:len(data)] = os.urandom(len(data) - 100)
    good.write_bytes(bytes(data))
    with pytest.raises(DatabaseError):
        with TuningDB(good, readonly=True) as db:
            if db.verify().ok:
                db.rows()
                raise AssertionError("a shredded file verified")
            raise CorruptDatabaseError("verify reported damage")
    empty = tmp_path / "empty.sqlite"
    empty.write_bytes(b"")
    with pytest.raises(CorruptDatabaseError):
        TuningDB(empty, readonly=True)
    with TuningDB(empty) as db:                      # writable: an empty file becomes a database
        assert len(db) == 0


def test_foreign_and_newer_files(tmp_path):
    foreign = tmp_path / "foreign.sqlite"
    c = sqlite3.connect(foreign)
    c.execute("CREATE TABLE songs (title TEXT)")
    c.commit()
    c.close()
    for ro in (True, False):
        with pytest.raises(ForeignDatabaseError):
            TuningDB(foreign, readonly=ro)
    other_app = tmp_path / "other.sqlite"
    c = sqlite3.connect(other_app)
    c.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT)")
    c.execute("INSERT INTO meta VALUES ('app', 'someone-else'), ('schema_version', '1')")
    c.commit()
    c.close()
    with pytest.raises(ForeignDatabaseError):
        TuningDB(other_app, readonly=True)
    newer = tmp_path / "newer.sqlite"
    TuningDB(newer).close()
    c = sqlite3.connect(newer)
    c.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'",
              (str(SCHEMA_VERSION + 1),))
    c.commit()
    c.close()
    for ro in (True, False):
        with pytest.raises(NewerSchemaError, match="newer"):
            TuningDB(newer, readonly=ro)
    assert issubclass(NewerSchemaError, DatabaseError)


def test_merge_and_export(tmp_path):
    a, b, dst = tmp_path / "a.sqlite", tmp_path / "b.sqlite", tmp_path / "dst.sqlite"
    with TuningDB(a) as db:
        db.record(rec(m=1, median=4.0))
        db.record(rec(m=4, median=4.5))
    with TuningDB(b) as db:
        db.record(rec(m=1, median=9.0))                     # same key as in a: a's row stays
        db.record(rec(m=16, median=5.0, env=make_env("Other GPU")))
    with TuningDB(dst) as d:
        for src in (a, b):
            with TuningDB(src, readonly=True) as s:
                d.merge_from(s)
        assert len(d) == 3
        with TuningDB(a, readonly=True) as s:
            assert d.merge_from(s)["added"] == 0           # idempotent
        assert d.verify().ok
        assert {r["median_us"] for r in d.rows()} == {4.0, 4.5, 5.0}
        js = d.export_json()
        assert js["schema_version"] == SCHEMA_VERSION and len(js["results"]) == 3
        assert js["results"][0]["samples"] == [4.0, 4.4, 3.6]
        out = d.export_sqlite(tmp_path / "ship" / "h200.sqlite")
    c = sqlite3.connect(out)
    assert c.execute("PRAGMA journal_mode").fetchone()[0] == "delete"
    c.close()
    with TuningDB(out, readonly=True) as s:
        assert len(s) == 3 and s.verify().ok
    with pytest.raises(FileExistsError):
        with TuningDB(dst) as d:
            d.export_sqlite(out)


def _spawn_writer(path: Path, tag: str, count: int) -> subprocess.Popen:
    code = f"import fakefam; fakefam.writer_main({str(path)!r}, {tag!r}, {count})"
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=subprocess_env())


def test_two_concurrent_writers(tmp_path):
    path = tmp_path / "shared.sqlite"
    n = 150
    procs = [_spawn_writer(path, tag, n) for tag in ("a", "b")]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
        assert out.count("committed") == n
    with TuningDB(path, readonly=True) as db:
        assert len(db) == 2 * n
        rep = db.verify()
        assert rep.ok, rep.errors
        rows = db.rows()
    for tag in ("a", "b"):
        mine = sorted(r["median_us"] for r in rows if r["fingerprint"] == f"fp-{tag}")
        assert mine == [1.0 + i for i in range(n)]          # nothing lost, nothing torn
        assert all(len(json.loads(r["samples"])) == 50 for r in rows)


def test_writer_killed_mid_run_keeps_every_committed_row(tmp_path):
    path = tmp_path / "killed.sqlite"
    p = _spawn_writer(path, "k", -1)
    committed = -1
    assert p.stdout is not None
    deadline = time.monotonic() + 120
    while committed < 40 and time.monotonic() < deadline:
        line = p.stdout.readline()
        if line.startswith("committed"):
            committed = int(line.split()[1])
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=30)
    # The writer may have committed (and reported) more rows before the kill landed: the
    # rest of its output says how many.
    for line in p.stdout.read().splitlines():
        if line.startswith("committed"):
            committed = int(line.split()[1])
    assert committed >= 40, p.stderr.read() if p.stderr else ""
    with TuningDB(path) as db:                                # recovery happens on open
        rep = db.verify()
        assert rep.ok, rep.errors
        meds = sorted(r["median_us"] for r in db.rows())
    # Every commit the writer reported is there, intact; at most the row in flight is not.
    assert meds[:committed + 1] == [1.0 + i for i in range(committed + 1)]
    assert len(meds) in (committed + 1, committed + 2)
