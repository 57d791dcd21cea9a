"""Warm start from an earlier table (resgen.search.warmstart) on the fake family: its fastest
variants go first even though their rows are stale, keys are parsed leniently but validated,
and a bad table only loses the hint."""

from __future__ import annotations

import json

import pytest

import fakefam
from fakefam import FakeProblem, FakeVariant, Pack, isolated_cache, make_env, tune_fake  # noqa: F401
from resgen.db import TuningDB, warm_start_rows
from resgen.search.record import ResultRecord, Status
from resgen.search.warmstart import WarmStart, lenient_variant

pytestmark = pytest.mark.usefixtures("isolated_cache")
FAM = fakefam.FAMILY
P = FakeProblem(m=16, k=4096)
BEST = FakeVariant(tile=16, stages=2, pack=Pack.A, split=True)      # not the default


def _earlier_table(path, rows, gpu="Fake GPU"):
    """A table whose rows were tuned with other templates (a fingerprint nothing matches)."""
    env = make_env(gpu_name=gpu)
    with TuningDB(path) as db:
        for i, (v, us) in enumerate(rows):
            db.record(ResultRecord(problem=P, variant=v, environment=env, fingerprint="f" * 64,
                                   status=Status.OK, space_index=i, median_us=us,
                                   samples_us=[us], policy={"tie_rel": 0.01}))


class Recorder:
    def __init__(self):
        self.calls: list[str] = []

    def __call__(self, runner, policy, n_sets):
        self.calls.append(runner.v.key())
        return fakefam.fake_timer(runner, policy, n_sets)


@pytest.mark.parametrize("coverage", [False, True])
def test_the_earlier_tables_fastest_variants_go_first(tmp_path, coverage):
    old = tmp_path / "old.sqlite"
    second = FakeVariant(tile=8, stages=3, pack=Pack.A, split=False)
    _earlier_table(old, [(FakeVariant(), 9.0), (BEST, 1.0), (second, 2.0),
                         (FakeVariant(tile=32), 0.5)])             # tile 32 > 16 rows: invalid
    rec = Recorder()
    (s,) = tune_fake(tmp_path / "new.sqlite", ms=[16], max_variants=4, timer=rec,
                     warm_start=str(old), coverage=coverage)
    assert s.warm_started == 2
    assert rec.calls[0] == BEST.key()
    if not coverage:
        assert rec.calls[:3] == [BEST.key(), second.key(), FakeVariant().key()]
    # the stale rows were not reused: every timed variant has a fresh row in the new table
    with TuningDB(tmp_path / "new.sqlite", readonly=True) as db:
        fresh = {r["variant_key"] for r in db.rows(status=Status.OK)}
    assert BEST.key() in fresh


def test_without_a_warm_start_the_default_goes_first(tmp_path):
    rec = Recorder()
    (s,) = tune_fake(tmp_path / "new.sqlite", ms=[16], max_variants=3, timer=rec)
    assert s.warm_started == 0 and rec.calls[0] == FakeVariant().key()


def test_rows_of_another_gpu_are_no_hint(tmp_path):
    old = tmp_path / "old.sqlite"
    _earlier_table(old, [(BEST, 1.0)], gpu="Other GPU")
    assert WarmStart(old, "Fake GPU", warm_start_rows).candidates(FAM, P, "sm_90a", 3) == []
    assert WarmStart(old, "Other GPU", warm_start_rows).candidates(FAM, P, "sm_90a", 3) == [BEST]


def test_keys_are_parsed_leniently_but_validated():
    key = json.loads(BEST.key())
    # a field added to the variant since the table was written takes its default
    missing = {k: v for k, v in key.items() if k != "split"}
    assert lenient_variant(FakeVariant, json.dumps(missing)) == FakeVariant(
        tile=16, stages=2, pack=Pack.A, split=False)
    # a field the variant no longer has, another family, a bad value, not JSON: no variant
    assert lenient_variant(FakeVariant, json.dumps({**key, "bogus": 1})) is None
    assert lenient_variant(FakeVariant, json.dumps({**key, "family": "other"})) is None
    assert lenient_variant(FakeVariant, json.dumps({**key, "tile": 12})) is None
    assert lenient_variant(FakeVariant, json.dumps({**key, "pack": "__import__('os')"})) is None
    assert lenient_variant(FakeVariant, "not json") is None
    assert lenient_variant(FakeVariant, BEST.key()) == BEST


def test_a_missing_or_corrupt_table_only_loses_the_hint(tmp_path):
    bad = tmp_path / "bad.sqlite"
    bad.write_bytes(b"this is not a database")
    for path in (bad, tmp_path / "absent.sqlite"):
        assert WarmStart(path, "Fake GPU", warm_start_rows).candidates(FAM, P, "sm_90a", 3) == []
    rec = Recorder()
    (s,) = tune_fake(tmp_path / "new.sqlite", ms=[16], max_variants=2, timer=rec,
                     warm_start=str(bad))
    assert s.timed >= 1 and s.warm_started == 0 and rec.calls[0] == FakeVariant().key()
