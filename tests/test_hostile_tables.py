"""A tuning database is untrusted input (issue 22, items 1-4, 7, 8): one hostile or damaged
row never crashes `Dispatcher.lookup`, `resgen db verify`, `resgen show` or `resgen db merge`,
is never served, never merged by default, and nothing it holds reaches the terminal raw.
The probes of the issue are reproduced one by one, then fuzzed (hypothesis) over the stored
fields: workload and variant keys, policies, medians, space indices and names."""

from __future__ import annotations

import json
import logging
import math
import shutil
import sqlite3
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings as hsettings, strategies as st

import fakefam
from fakefam import FakeProblem, FakeVariant, isolated_cache, tune_fake  # noqa: F401
from resgen.cli import main
from resgen.db import TuningDB, row_checksum
from resgen.runtime import Device, Dispatcher

pytestmark = pytest.mark.usefixtures("isolated_cache")
FAM = fakefam.FAMILY
DEV = Device("Fake GPU", "sm_90a")
OP = FakeProblem.OP
P4 = FakeProblem(m=4, k=4096)
ESC = "\x1b]0;pwned\x07\x1b[2J\x1b[Hwinner fake_gemm:tile64"


def _base(tmp_path: Path) -> Path:
    """A small table: the fake family tuned for M = 4 (every valid variant timed)."""
    path = tmp_path / "base.sqlite"
    tune_fake(path, ms=[4], max_variants=64)
    return path


def _winner_row(path: Path) -> dict:
    with TuningDB(path, readonly=True) as db:
        best = db.best(P4, gpu_name="Fake GPU", arch="sm_90a")
    assert best is not None
    return best


def _tamper(path: Path, rid: int, *, table: str = "results", reseal: bool = True,
            **cols) -> None:
    """Set columns of one row; reseal=True recomputes the result's checksum afterwards (a
    hostile author can), reseal=False leaves it (a torn or hand-edited row)."""
    c = sqlite3.connect(path)
    sets = ", ".join(f"{k} = ?" for k in cols)
    c.execute(f"UPDATE {table} SET {sets} WHERE id = ?", [*cols.values(), rid])
    c.commit()
    c.close()
    if reseal and table == "results":
        _reseal(path, rid)


def _reseal(path: Path, rid: int) -> None:
    with TuningDB(path, readonly=True) as db:
        row = next(r for r in db.rows() if r["id"] == rid)
    try:
        ck = row_checksum(row, row["environment_digest"], row["workload_digest"],
                          row["variant_digest"])
    except (TypeError, ValueError):
        return                                  # unhashable content: stays torn
    c = sqlite3.connect(path)
    c.execute("UPDATE results SET checksum = ? WHERE id = ?", (ck, rid))
    c.commit()
    c.close()


def _lookup_is_safe(path: Path, hostile_key: str | None = None) -> FakeVariant:
    """Lookup never raises, serves a variant valid for the real problem, and never the
    hostile row's variant (when given)."""
    d = Dispatcher(paths=[path], device=DEV)
    for m in (3, 4):
        p = FakeProblem(m=m, k=4096)
        v = d.lookup(OP, p)
        assert FAM.why_invalid(v, p, "sm_90a") is None
    v = d.lookup(OP, P4)
    if hostile_key is not None:
        assert v.key() != hostile_key
    return v


def _cli(capsys, *argv) -> tuple[int, str]:
    capsys.readouterr()
    rc = main(list(argv))
    cap = capsys.readouterr()
    text = cap.out + cap.err
    assert "\x1b" not in text and "\x07" not in text, text[:300]
    assert "Traceback" not in text
    return rc, text


# -- item 1: the policy's tie band ---------------------------------------------------------------
@pytest.mark.parametrize("tie", [-1.0, float("nan"), 1e9, float("inf"), "0.5", None, [0.1]])
def test_a_row_with_a_bad_tie_band_is_skipped_not_fatal(tmp_path, caplog, tie):
    path = _base(tmp_path)
    good = _lookup_is_safe(path)
    win = _winner_row(path)
    # a slower row with a hostile policy: NaN / negative emptied the tie set (crash), 1e9 /
    # inf made every row a tie so the lowest space index won
    with TuningDB(path, readonly=True) as db:
        slow = max((r for r in db.rows() if r["status"] == "ok"),
                   key=lambda r: r["median_us"])
    pol = json.loads(slow["policy"])
    pol["tie_rel"] = tie
    _tamper(path, slow["id"], policy=json.dumps(pol), space_index=0)
    with caplog.at_level(logging.WARNING, logger="resgen.runtime"):
        v = _lookup_is_safe(path, hostile_key=slow["variant_key"])
    assert v == good and v.key() == win["variant_key"]
    assert any("skipped 1 of" in r.message and "tie_rel" in r.message for r in caplog.records)


def test_pick_winner_rejects_a_tie_band_out_of_range():
    from resgen.search.record import MAX_TIE_REL, pick_winner

    rows = [{"median_us": 1.0, "space_index": 1}, {"median_us": 1.5, "space_index": 0}]
    assert pick_winner(rows, MAX_TIE_REL)["space_index"] == 1
    for bad in (-0.1, float("nan"), MAX_TIE_REL * 2, float("inf")):
        with pytest.raises(ValueError, match="tie_rel"):
            pick_winner(rows, bad)
    # rows without a positive finite median take no part
    assert pick_winner([{"median_us": float("nan"), "space_index": 0},
                        {"median_us": -1.0, "space_index": 0}] + rows[1:])["median_us"] == 1.5


@pytest.mark.parametrize("col,val", [("median_us", float("nan")), ("median_us", "fast"),
                                     ("median_us", 1e300), ("median_us", -1.0),
                                     ("space_index", "x"), ("space_index", -5),
                                     ("space_index", 1.5), ("policy", "[1, 2]"),
                                     ("policy", "not json"), ("policy", '{"version": "9"}')])
def test_every_stored_number_is_range_checked(tmp_path, col, val):
    """Items 1 and 3: one bad number skips its row (a text space_index used to turn off the
    whole table); the rest of the table still serves."""
    path = _base(tmp_path)
    win = _winner_row(path)
    _tamper(path, win["id"], **{col: val})
    v = _lookup_is_safe(path)
    assert v.key() != win["variant_key"]        # the bad row is skipped, the next one wins
    d = Dispatcher(paths=[path], device=DEV)
    assert d.source(OP, P4) != "default"       # the table is still on


# -- item 2: checksums at run time ---------------------------------------------------------------
def test_a_row_that_fails_its_checksum_is_never_served(tmp_path, caplog):
    path = _base(tmp_path)
    with TuningDB(path, readonly=True) as db:
        slow = max((r for r in db.rows() if r["status"] == "ok"), key=lambda r: r["median_us"])
    _tamper(path, slow["id"], reseal=False, median_us=1e-3)    # altered: now the fastest
    rc = main(["db", "verify", str(path)])
    assert rc == 1
    with caplog.at_level(logging.WARNING, logger="resgen.runtime"):
        v = _lookup_is_safe(path, hostile_key=slow["variant_key"])
    assert v.key() == _winner_row(path)["variant_key"]
    assert any("checksum" in r.message for r in caplog.records)


def test_a_key_that_does_not_match_its_digest_is_not_served(tmp_path):
    path = _base(tmp_path)
    win = _winner_row(path)
    c = sqlite3.connect(path)
    (vid,) = c.execute("SELECT variant_id FROM results WHERE id = ?", (win["id"],)).fetchone()
    other = FakeVariant(tile=8, stages=4).key()             # a real key, not this row's
    c.execute("UPDATE variants SET key = ? WHERE id = ?", (other, vid))
    c.commit()
    c.close()
    _lookup_is_safe(path)
    d = Dispatcher(paths=[path], device=DEV)
    assert d.lookup(OP, P4).key() not in (other, win["variant_key"])


# -- items 4 and 7: db verify and show on hostile content ----------------------------------------
HOSTILE_KEYS = ["[1, 2]", '"text"', "3", "not json", "[" * 100000 + "]" * 100000,
                '{"op": "fake_gemm", "m": "1"}', '{"family": ["x"]}']


@pytest.mark.parametrize("key", HOSTILE_KEYS, ids=range(len(HOSTILE_KEYS)))
@pytest.mark.parametrize("table", ["workloads", "variants"])
def test_verify_show_merge_survive_hostile_keys(tmp_path, capsys, key, table):
    path = _base(tmp_path)
    _tamper(path, 1, table=table, key=key)
    rc, text = _cli(capsys, "db", "verify", str(path))
    assert rc == 1 and ("not JSON" in text or "digest" in text or "object" in text)
    rc, text = _cli(capsys, "show", "--db", str(path))
    assert rc == 0
    merged = tmp_path / "m.sqlite"
    rc, text = _cli(capsys, "db", "merge", str(path), "--into", str(merged))
    assert rc == 0
    with TuningDB(merged, readonly=True) as db:
        for r in db.rows():
            assert json.loads(r["workload_key"]) and json.loads(r["variant_key"])
            assert r["variant_key"] != key and r["workload_key"] != key
    _lookup_is_safe(path)


def test_verify_warns_of_a_key_that_parses_but_is_not_canonical(tmp_path, capsys):
    """A stored key whose object parses but whose canonical key differs (a default field
    spelled out: the same variant as the canonical key's row, under another digest) is
    reported, as a parse failure is; the canonical keys of the same table are not."""
    from resgen.cli import _parse_key
    from resgen.search.linear_sm90_wgmma import LinearSm90WgmmaVariant
    from resgen.search.variant import sha256_json

    canon = LinearSm90WgmmaVariant(1, 1, 64, 6).key()
    spelled = {**json.loads(canon), "fold": "exact", "producer": "wg"}
    assert _parse_key("variant", canon) is None
    assert "not the canonical key" in (_parse_key("variant", json.dumps(spelled)) or "")
    path = _base(tmp_path)
    rc, text = _cli(capsys, "db", "verify", str(path))
    assert rc == 0 and "canonical" not in text
    _tamper(path, 1, table="variants", key=json.dumps(spelled), digest=sha256_json(spelled))
    c = sqlite3.connect(path)
    rids = [r for (r,) in c.execute("SELECT id FROM results WHERE variant_id = 1")]
    c.close()
    for rid in rids:                    # a hostile author reseals what the new digest breaks
        _reseal(path, rid)
    rc, text = _cli(capsys, "db", "verify", str(path))
    assert rc == 0 and "error" not in text
    assert "warning: variants 1:" in text and "not the canonical key of what it parses" in text
    assert canon in text


def test_verify_and_show_report_text_medians(tmp_path, capsys):
    path = _base(tmp_path)
    win = _winner_row(path)
    _tamper(path, win["id"], median_us="fast")
    rc, text = _cli(capsys, "db", "verify", str(path))
    assert rc == 1 and "median_us" in text
    rc, text = _cli(capsys, "show", "--db", str(path))
    assert rc == 0 and "bad_numbers:1" in text


def test_show_prints_no_stored_name_and_escapes_gpu_names(tmp_path, capsys):
    path = _base(tmp_path)
    c = sqlite3.connect(path)
    c.execute("UPDATE variants SET name = ?", (ESC,))
    c.execute("UPDATE environments SET gpu_name = ?", ("Fake\x1b[2J GPU",))
    c.commit()
    c.close()
    rc, text = _cli(capsys, "show", "--db", str(path))      # _cli asserts no escape got out
    assert rc == 0 and "pwned" not in text and "\\x1b" in text
    assert FakeVariant(tile=8, stages=1).name().split("_")[0] in text


def test_damaged_pages_are_one_line_errors(tmp_path, capsys):
    path = _base(tmp_path)
    data = bytearray(path.read_bytes())
    page = 4096
    for off in range(2 * page, len(data) - page, 3 * page):       # trash every third page
        data[off:off + page] = bytes((i * 37) % 251 for i in range(page))
    bad = tmp_path / "damaged.sqlite"
    bad.write_bytes(bytes(data))
    for argv in (["db", "verify", str(bad)], ["show", "--db", str(bad)],
                 ["db", "merge", str(bad), "--into", str(tmp_path / "m.sqlite")]):
        rc, text = _cli(capsys, *argv)
        assert rc in (1, 2), (argv, text)
    d = Dispatcher(paths=[bad], device=DEV)
    assert FAM.why_invalid(d.lookup(OP, P4), P4, "sm_90a") is None


# -- item 8: merge copies only what the runtime could accept --------------------------------------
def test_merge_keeps_only_servable_rows_by_default(tmp_path, capsys):
    path = _base(tmp_path)
    with TuningDB(path, readonly=True) as db:
        rows = db.rows()
    ok = [r for r in rows if r["status"] == "ok"]
    # a parseable variant that is invalid for its workload (tile 64 > 4 rows), resealed
    bad_variant = FakeVariant(tile=64, stages=1)
    c = sqlite3.connect(path)
    c.execute("UPDATE variants SET key = ?, digest = ? WHERE id = (SELECT variant_id FROM "
              "results WHERE id = ?)", (bad_variant.key(), bad_variant.digest(), ok[0]["id"]))
    c.commit()
    c.close()
    _reseal(path, ok[0]["id"])
    _tamper(path, ok[1]["id"], policy='{"tie_rel": NaN}')
    fresh = tmp_path / "fresh.sqlite"
    for into, extra in ((tmp_path / "m.sqlite", []), (fresh, ["--fresh-only"])):
        rc, text = _cli(capsys, "db", "merge", str(path), "--into", str(into), *extra)
        assert rc == 0 and "'dropped': 2" in text
        with TuningDB(into, readonly=True) as db:
            keys = {r["variant_key"] for r in db.rows()}
            assert len(db) == len(rows) - 2 and bad_variant.key() not in keys
    rc, text = _cli(capsys, "db", "merge", str(path), "--into", str(tmp_path / "all.sqlite"),
                    "--all-rows")
    with TuningDB(tmp_path / "all.sqlite", readonly=True) as db:
        assert rc == 0 and len(db) == len(rows)


# -- the fuzz --------------------------------------------------------------------------------------
_json = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70)
                     | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12),
                     lambda kids: st.lists(kids, max_size=4)
                     | st.dictionaries(st.text(max_size=8), kids, max_size=4),
                     max_leaves=12)


def _dumps(x) -> str:
    return json.dumps(x, allow_nan=True)


def _key_like(tag: str, base: dict):
    """Keys near the real ones (a real key with one field replaced or added) and random JSON."""
    return st.one_of(
        _json.map(_dumps),
        st.tuples(st.sampled_from(sorted(base) + ["extra"]), _json).map(
            lambda kv: _dumps({**base, kv[0]: kv[1]})),
        st.text(max_size=20))


_WL = json.loads(P4.key())
_VAR = json.loads(FakeVariant().key())
_POLICY = {"name": "fake", "version": 1, "tie_rel": 0.01}

row_edits = st.fixed_dictionaries({}, optional={
    "policy": st.one_of(_json.map(_dumps), st.tuples(st.sampled_from(sorted(_POLICY)), _json)
                        .map(lambda kv: _dumps({**_POLICY, kv[0]: kv[1]}))),
    "median_us": st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-5, 5),
                           st.text(max_size=5), st.none()),
    # no NaN: SQLite stores a NaN REAL as NULL, which the column's NOT NULL refuses to anyone
    "space_index": st.one_of(st.integers(-2**63, 2**63 - 1), st.floats(allow_nan=False),
                             st.text(max_size=4)),
    "status": st.sampled_from(["ok", "compiled", "bogus", ""]),
})


@hsettings(max_examples=40, deadline=None,
           suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(edits=row_edits, wkey=st.none() | _key_like("op", _WL),
       vkey=st.none() | _key_like("family", _VAR), name=st.text(max_size=30),
       reseal=st.booleans())
def test_fuzz_stored_fields(tmp_path_factory, capsys, edits, wkey, vkey, name, reseal):
    base = tmp_path_factory.getbasetemp() / "fuzz-base.sqlite"
    if not base.exists():
        tune_fake(base, ms=[4], max_variants=64)
    tmp = Path(tmp_path_factory.mktemp("fuzz"))
    path = tmp / "t.sqlite"
    shutil.copy(base, path)
    win = _winner_row(path)
    c = sqlite3.connect(path)
    (wid, vid) = c.execute("SELECT workload_id, variant_id FROM results WHERE id = ?",
                           (win["id"],)).fetchone()
    if wkey is not None:
        c.execute("UPDATE workloads SET key = ? WHERE id = ?", (wkey, wid))
    if vkey is not None:
        c.execute("UPDATE variants SET key = ?, name = ? WHERE id = ?", (vkey, name, vid))
    c.commit()
    c.close()
    if edits:
        _tamper(path, win["id"], reseal=reseal, **edits)
    v = _lookup_is_safe(path)
    # a row served must be one whose stored numbers are sane
    d = Dispatcher(paths=[path], device=DEV)
    _, src, med = d.served(OP, P4)
    assert med is None or (math.isfinite(med) and med > 0)
    assert FAM.why_invalid(v, P4, "sm_90a") is None
    for argv in (["db", "verify", str(path)], ["show", "--db", str(path)],
                 ["db", "merge", str(path), "--into", str(tmp / "m.sqlite")]):
        rc, _ = _cli(capsys, *argv)
        assert rc in (0, 1), argv
    with TuningDB(tmp / "m.sqlite", readonly=True) as db:
        merged = db.rows()
    for r in merged:                     # what merge copied, the runtime can parse
        got = FAM.VARIANT.from_key(r["variant_key"]), FAM.PROBLEM.from_key(r["workload_key"])
        assert FAM.why_invalid(got[0], got[1], "sm_90a") is None


def test_ignored_stale_rows_are_said_once(tmp_path, caplog):
    """Item 17: stale rows are dropped with a word even when a fresh row answers."""
    path = _base(tmp_path)
    win = _winner_row(path)
    with TuningDB(path) as db:
        from resgen.search.record import ResultRecord, Status

        db.record(ResultRecord(problem=P4, variant=FakeVariant(tile=8, stages=3),
                               environment=fakefam.make_env(), fingerprint="0" * 64,
                               status=Status.OK, median_us=1e-3, samples_us=[1e-3],
                               space_index=0, policy={"tie_rel": 0.01}))
    with caplog.at_level(logging.WARNING, logger="resgen.runtime"):
        d = Dispatcher(paths=[path], device=DEV)
        v = d.lookup(OP, P4)
        d.lookup(OP, FakeProblem(m=3, k=4096))
    assert v.key() == win["variant_key"] != FakeVariant(tile=8, stages=3).key()
    stale = [r for r in caplog.records if "ignoring stale" in r.message]
    assert len(stale) == 1 and "re-tune" in stale[0].message
