"""Rank consistency (issue 24): every rank of a tensor-parallel group must dispatch the same
variant for the same shape. Lookups depend only on a table's content (not on row order, the
process or its hash seed), and `resgen db merge` refuses sources that rank the variants they
both measured differently, unless a rule (--on-conflict first|union) settles it."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from typing import ClassVar

import pytest

import fakefam
from fakefam import (FakeFamily, FakeProblem, FakeVariant, isolated_cache, make_env,  # noqa: F401
                     subprocess_env, tune_fake)
from resgen.cli import main
from resgen.db import TuningDB
from resgen.db.consistency import find_conflicts
from resgen.runtime import Device, Dispatcher
from resgen.search import family as family_mod
from resgen.search.build import variant_fingerprint
from resgen.search.record import ResultRecord, Status

pytestmark = pytest.mark.usefixtures("isolated_cache")
DEV = Device("Fake GPU", "sm_90a")
OP = FakeProblem.OP


@dataclasses.dataclass(frozen=True, slots=True)
class OtherVariant(FakeVariant):
    FAMILY: ClassVar[str] = "fake_gemm_b"


class OtherFamily(FakeFamily):
    """A second family of the fake op (as linear_sm90_mma and linear_sm90_wgmma both serve
    "linear"): its space indices and medians can equal the first family's."""

    NAME: ClassVar[str] = "fake_gemm_b"
    VARIANT: ClassVar[type] = OtherVariant

    def space(self, problem, arch):
        return [OtherVariant(**{f.name: getattr(v, f.name) for f in dataclasses.fields(v)})
                for v in super().space(problem, arch)]

    def default(self, p, arch):
        return OtherVariant()


@pytest.fixture
def two_families(monkeypatch):
    other = OtherFamily()
    monkeypatch.setitem(family_mod._REGISTRY, other.NAME, other)
    return fakefam.FAMILY, other


def _store(path, fam, problem, variant, median, env=None):
    with TuningDB(path) as db:
        db.record(ResultRecord(
            problem=problem, variant=variant, environment=env or make_env(),
            fingerprint=variant_fingerprint(fam, variant, problem, "sm_90a"), status=Status.OK,
            median_us=median, samples_us=[median],
            space_index=fam.space(problem, "sm_90a").index(variant),
            policy={"tie_rel": 0.01}))


def test_lookups_depend_only_on_the_tables_content(tmp_path, two_families):
    a_fam, b_fam = two_families
    p = FakeProblem(m=16, k=4096)
    rows = [(a_fam, FakeVariant(tile=8, stages=1), 5.0),        # an exact cross-family tie:
            (b_fam, OtherVariant(tile=8, stages=1), 5.0),       # same space index and median
            (a_fam, FakeVariant(tile=16, stages=2), 9.0),
            (b_fam, OtherVariant(tile=16, stages=1), 7.0)]
    fwd, rev = tmp_path / "fwd.sqlite", tmp_path / "rev.sqlite"
    for fam, v, med in rows:
        _store(fwd, fam, p, v, med)
    for fam, v, med in reversed(rows):
        _store(rev, fam, p, v, med)
    answers = set()
    for path in (fwd, rev, fwd):
        d = Dispatcher(paths=[path], device=DEV)
        for m in (9, 12, 16):
            q = FakeProblem(m=m, k=4096)
            answers.add((m, d.lookup(OP, q).key()))
            assert d.lookup(OP, q) is d.lookup(OP, q)
    assert len(answers) == 3                        # one answer per shape, whatever the order
    assert {k for _, k in answers} == {FakeVariant(tile=8, stages=1).key()}


LOOKUPS = """
import sys
from resgen.runtime import Device, Dispatcher
from fakefam import FakeProblem
d = Dispatcher(paths=[sys.argv[1]], device=Device("Fake GPU", "sm_90a"))
for m in range(1, 80, 3):
    print(m, d.lookup("fake_gemm", FakeProblem(m=m, k=4096)).key())
"""


def test_lookups_agree_across_processes_and_hash_seeds(tmp_path):
    path = tmp_path / "t.sqlite"
    tune_fake(path, ms=[1, 4, 16, 64], max_variants=64)
    outs = []
    for seed in ("1", "2", "12345"):
        env = subprocess_env()
        env.update(PYTHONHASHSEED=seed, RESGEN_CACHE_DIR=str(tmp_path / "cache"))
        r = subprocess.run([sys.executable, "-c", LOOKUPS, str(path)], env=env,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        outs.append(r.stdout)
    assert outs[0] == outs[1] == outs[2] and len(outs[0].splitlines()) == 27


# -- db merge: the rank-consistency check ------------------------------------------------------
P = FakeProblem(m=16, k=4096)
Q = FakeProblem(m=4, k=4096)
V1, V2, V3 = FakeVariant(tile=8, stages=1), FakeVariant(tile=8, stages=2), FakeVariant(tile=16)
V4 = FakeVariant(tile=8, stages=4)


def _src(path, timings):
    for problem, v, med in timings:
        _store(path, fakefam.FAMILY, problem, v, med)
    return path


def _served(path, problem):
    return Dispatcher(paths=[path], device=DEV).lookup(OP, problem)


def _merge(*args):
    return main(["db", "merge", *map(str, args), "--import", "fakefam"])


def test_sources_that_measured_different_variants_or_agree_merge(tmp_path):
    a = _src(tmp_path / "a.sqlite", [(P, V1, 5.0), (Q, V1, 2.0)])
    b = _src(tmp_path / "b.sqlite", [(P, V2, 4.0), (P, V3, 6.0)])        # disjoint variants
    c = _src(tmp_path / "c.sqlite", [(P, V1, 5.5), (P, V2, 4.4)])        # agrees with a+b
    with TuningDB(a, readonly=True) as x, TuningDB(b, readonly=True) as y, \
            TuningDB(c, readonly=True) as z:
        assert find_conflicts([("a", x.rows()), ("b", y.rows()), ("c", z.rows())]) == []
    out = tmp_path / "m.sqlite"
    assert _merge(a, b, c, "--into", out) == 0
    assert _served(out, P) == V2 and _served(out, Q) == V1


def test_sources_that_rank_the_same_variants_differently_are_refused(tmp_path, capsys):
    a = _src(tmp_path / "a.sqlite", [(P, V1, 5.0), (P, V2, 6.0), (Q, V1, 2.0)])
    b = _src(tmp_path / "b.sqlite", [(P, V1, 7.0), (P, V2, 6.0), (Q, V4, 1.0)])
    out = tmp_path / "m.sqlite"
    assert _merge(a, b, "--into", out) == 1
    err = capsys.readouterr().err
    assert "1 workload(s)" in err and "nothing was merged" in err and "--on-conflict" in err
    assert err.count("conflict: ") == 1 and V1.name() in err and V2.name() in err
    assert not out.exists()
    # first: that workload's rows come from the first source that has any (here a's)
    assert _merge(a, b, "--into", out, "--on-conflict", "first") == 0
    assert _served(out, P) == V1
    with TuningDB(out, readonly=True) as db:
        rows = db.rows()
    assert len([r for r in rows if r["workload_key"] == P.key()]) == 2     # b's two dropped
    assert _served(out, Q) == V4              # no conflict there: both sources' rows merged
    # ... and the destination's own rows count as the first source
    assert _merge(b, "--into", out) == 1
    # union: every row (one timing per workload, variant, fingerprint and environment: the
    # first source's, as merge always kept); the runtime's rule picks over them
    union = tmp_path / "u.sqlite"
    assert _merge(b, a, "--into", union, "--on-conflict", "union") == 0
    assert _served(union, P) == V2                  # b's V1 (7.0) kept, its V2 (6.0) wins
