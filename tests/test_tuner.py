"""The tuner on the fake family: search, budgets, resume, compile cache, failures, ties."""

from __future__ import annotations

import dataclasses
import functools
import shutil
import time

import pytest

import fakefam
from fakefam import (FakeFamily, FakeProblem, FakeVariant, Pack, fake_us,  # noqa: F401
                     isolated_cache, make_env, tune_fake)
from resgen.db import TuningDB
from resgen.search.record import Status
from resgen.search.timing import DEFAULT_POLICY, MeasurementPolicy, summarize
from resgen.search.orchestrate import Job, run_jobs
from resgen.search.tuner import TuneConfig, Tuner, gpu_lock, working_set_bytes
from resgen.search.variant import LinearProblem

pytestmark = pytest.mark.usefixtures("isolated_cache")
FAM = fakefam.FAMILY


def _valid(p: FakeProblem, arch: str = "sm_90a") -> list[FakeVariant]:
    return [v for v in FAM.space(p, arch) if FAM.why_invalid(v, p, arch) is None]


class CountingTimer:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def __call__(self, runner, policy, n_sets):
        self.calls.append(runner.v.key())
        return fakefam.fake_timer(runner, policy, n_sets)


def test_exhaustive_small_space_finds_the_fastest_checked_variant(tmp_path):
    p = FakeProblem(m=16, k=4096)
    valid = _valid(p)
    timer = CountingTimer()
    (s,) = tune_fake(tmp_path / "t.sqlite", ms=[16], max_variants=len(valid), timer=timer)
    assert s.search == "exhaustive" and s.evaluated == len(valid)
    assert s.space == 64 and s.invalid == 64 - len(valid)
    assert s.invalid_reasons and all(isinstance(r, str) for r in s.invalid_reasons)
    # The default goes first, then the fixed space order.
    assert timer.calls[0] == FakeVariant().key()
    # Injected failures: 3 stages + pack b fail to compile; split + pack b fail the check.
    bad_compile = [v for v in valid if v.stages == 3 and v.pack is Pack.B]
    bad_check = [v for v in valid if v.split and v.pack is Pack.B and v not in bad_compile]
    assert s.compile_failed == len(bad_compile) and s.check_failed == len(bad_check)
    assert s.timed == len(valid) - len(bad_compile) - len(bad_check)
    timed_keys = set(timer.calls)
    assert not timed_keys & {v.key() for v in bad_compile + bad_check}   # never timed
    good = [v for v in valid if v not in bad_compile + bad_check]
    best = min(good, key=lambda v: (fake_us(v, p), FAM.space(p, "sm_90a").index(v)))
    assert s.winner == best.name()
    with TuningDB(tmp_path / "t.sqlite", readonly=True) as db:
        rows = db.rows()
        assert len(rows) == len(valid)
        by_status = {st: [r for r in rows if r["status"] == st] for st in Status.ALL}
        assert len(by_status[Status.OK]) == s.timed
        assert all("injected compile failure" in r["error"]
                   for r in by_status[Status.COMPILE_FAILED])
        assert all(r["rel_err"] == 0.5 and "injected wrong answer" in r["error"]
                   for r in by_status[Status.CHECK_FAILED])
        assert all(r["registers"] == 32 + 8 * FakeVariant.from_key(r["variant_key"]).stages
                   for r in by_status[Status.OK])
        assert all(r["space_index"] == FAM.space(p, "sm_90a").index(
            FakeVariant.from_key(r["variant_key"])) for r in rows)
        ok = by_status[Status.OK][0]
        assert ok["policy_name"] == DEFAULT_POLICY.name and ok["timing_mode"] == "fake"


def test_compile_once_per_compile_key_across_m_buckets(tmp_path):
    fakefam.COMPILES.clear()
    tune_fake(tmp_path / "t.sqlite", ms=[1, 4, 8, 16, 64], max_variants=64)
    assert fakefam.COMPILES, "nothing compiled"
    assert len(fakefam.COMPILES) == len(set(fakefam.COMPILES))
    assert {ck for _, ck in fakefam.COMPILES} == {FakeProblem(m=1, k=4096).key()}


def test_optuna_search_is_seeded_budgeted_and_deterministic(tmp_path):
    def order(path, seed):
        tune_fake(path, ms=[64], max_variants=10, seed=seed)
        with TuningDB(path, readonly=True) as db:
            return [r["variant_key"] for r in
                    db.db.query("SELECT v.key AS variant_key FROM results r JOIN variants v "
                                "ON v.id = r.variant_id ORDER BY r.id")]
    assert len(_valid(FakeProblem(m=64, k=4096))) > 10
    a = order(tmp_path / "a.sqlite", 0)
    b = order(tmp_path / "b.sqlite", 0)
    c = order(tmp_path / "c.sqlite", 1)
    assert a == b                                   # same seed, same timings: same trials
    assert len(a) == len(set(a)) == 10              # the budget counts distinct variants
    assert a[0] == FakeVariant().key()              # the default is enqueued first
    assert a != c


def test_resume_skips_stored_rows_and_times_only_new_variants(tmp_path):
    path = tmp_path / "t.sqlite"
    t1 = CountingTimer()
    (s1,) = tune_fake(path, ms=[16], max_variants=4, timer=t1)
    t2 = CountingTimer()
    (s2,) = tune_fake(path, ms=[16], max_variants=4, timer=t2)
    assert t2.calls == [] and s2.resumed == s1.evaluated and s2.winner == s1.winner
    t3 = CountingTimer()
    (s3,) = tune_fake(path, ms=[16], max_variants=8, timer=t3)
    assert s3.resumed == 4 and s3.evaluated == 8
    assert not set(t3.calls) & set(t1.calls)         # adding variants re-times only new ones
    with TuningDB(path, readonly=True) as db:
        assert len(db) == 8
    with TuningDB(path, readonly=True) as db:
        ok_before = {r["variant_key"]: r["id"] for r in db.rows(status=Status.OK)}
    t4 = CountingTimer()
    tune_fake(path, ms=[16], max_variants=8, timer=t4, resume=False)
    assert sorted(t4.calls) == sorted(ok_before)     # --no-resume re-times everything
    with TuningDB(path, readonly=True) as db:
        assert len(db) == 8                          # ... replacing, not duplicating, rows


def test_template_change_invalidates_stored_results(tmp_path, monkeypatch):
    path = tmp_path / "t.sqlite"
    (s1,) = tune_fake(path, ms=[4], max_variants=3)
    tdir = tmp_path / "templates"
    shutil.copytree(fakefam.TEMPLATES, tdir)
    (tdir / "fake_kernel.py.j2").write_text((tdir / "fake_kernel.py.j2").read_text()
                                            + "\n# edited\n")
    monkeypatch.setattr(FakeFamily, "TEMPLATE_DIR", tdir)
    timer = CountingTimer()
    (s2,) = tune_fake(path, ms=[4], max_variants=3, timer=timer)
    assert s2.resumed == 0 and len(timer.calls) == s2.timed > 0
    with TuningDB(path, readonly=True) as db:
        assert len({r["fingerprint"] for r in db.rows()}) == 2 * s1.evaluated


def test_time_budget_still_gives_every_workload_one_variant(tmp_path):
    env = make_env()
    cfg = TuneConfig(arch="sm_90a", max_variants=64)
    with TuningDB(tmp_path / "t.sqlite") as db:
        tuner = Tuner(db, env, cfg, fakefam.fake_timer)
        s = tuner.tune(FAM, FakeProblem(m=16, k=4096), deadline=time.monotonic() - 1)
    assert s.evaluated == 1 and s.stopped_by == "time_budget" and s.winner is not None
    summaries = tune_fake(tmp_path / "u.sqlite", ms=[1, 4, 16], max_variants=64,
                          time_budget_s=1e-6)
    assert [x.evaluated for x in summaries] == [1, 1, 1]


def test_ties_within_noise_go_to_the_space_order(tmp_path):
    def flat(runner, policy, n_sets):          # every variant within 0.5%: all ties
        jitter = 1.0 + 0.005 * (hash(runner.v.key()) % 2)
        return summarize([10.0 * jitter] * 3, policy, launches=8, n_sets=n_sets, mode="fake")
    p = FakeProblem(m=16, k=4096)
    (s,) = tune_fake(tmp_path / "t.sqlite", ms=[16], max_variants=64, timer=flat)
    assert s.winner == _valid(p)[0].name() == FAM.space(p, "sm_90a")[0].name()


def test_broken_family_parts_are_recorded_not_fatal(tmp_path, monkeypatch):
    original = FakeFamily.why_invalid

    def bad_why(self, v, p, arch):
        if v.stages == 2:
            raise KeyError("predicate bug")
        return original(self, v, p, arch)

    class Boom(fakefam.FakeRunner):
        def check(self):
            raise RuntimeError("device fell over")

    monkeypatch.setattr(FakeFamily, "why_invalid", bad_why, raising=True)
    monkeypatch.setattr(FakeFamily, "runner",
                        lambda self, c, v, p, d, n_sets=1, seed=0: Boom(v, p, c, n_sets))
    (s,) = tune_fake(tmp_path / "t.sqlite", ms=[16], max_variants=64)
    assert any("predicate bug" in r for r in s.invalid_reasons)
    assert s.run_failed > 0 and s.timed == 0 and s.winner is None
    with TuningDB(tmp_path / "t.sqlite", readonly=True) as db:
        errs = [r["error"] for r in db.rows() if r["status"] == Status.RUN_FAILED]
    assert errs and all("device fell over" in e for e in errs)


def test_space_failure_and_empty_space_are_reported(tmp_path, monkeypatch):
    (s,) = tune_fake(tmp_path / "t.sqlite", ms=[1], k=1000, max_variants=4)
    assert s.winner is not None                           # split variants invalid, others ok
    monkeypatch.setattr(FakeFamily, "why_invalid", lambda self, v, p, a: "never")
    (s,) = tune_fake(tmp_path / "t.sqlite", ms=[2], max_variants=4)
    assert s.error == "no valid variant in the space" and s.invalid == 64
    monkeypatch.setattr(FakeFamily, "space", lambda self, p, a: 1 / 0)
    (s,) = tune_fake(tmp_path / "t.sqlite", ms=[2], max_variants=4)
    assert s.error.startswith("space() raised")


def test_compile_only_records_compiles_and_runs_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(FakeFamily, "runner", lambda *a, **k: pytest.fail("ran a kernel"))
    env = make_env(gpu_name="none (compile-only)", compile_only=True)
    sums = tune_fake(tmp_path / "t.sqlite", ms=[1, 16], env=env, max_variants=64,
                     timer=lambda *a: pytest.fail("timed"))
    assert all(s.timed == 0 and s.compiled > 0 for s in sums)
    with TuningDB(tmp_path / "t.sqlite", readonly=True) as db:
        rows = db.rows()
        assert {r["status"] for r in rows} == {Status.COMPILED, Status.COMPILE_FAILED}
        assert all(r["compile_only"] == 1 and r["median_us"] is None for r in rows)
        assert len(rows) == sum(s.evaluated for s in sums)
    with pytest.raises(ValueError):
        Tuner(None, env, TuneConfig(compile_only=False))


def test_compile_only_spread_covers_every_axis_value(tmp_path):
    env = make_env(gpu_name="none (compile-only)", compile_only=True)
    p = FakeProblem(m=64, k=4096)
    valid = _valid(p)
    (s,) = tune_fake(tmp_path / "t.sqlite", ms=[64], env=env, max_variants=9)
    assert s.search == "spread" and s.evaluated == 9 < len(valid)
    with TuningDB(tmp_path / "t.sqlite", readonly=True) as db:
        vs = [FakeVariant.from_key(r["variant_key"]) for r in db.rows()]
    assert FakeVariant() in vs and len(set(vs)) == 9
    for field in ("tile", "stages", "pack", "split"):
        assert {getattr(v, field) for v in vs} == {getattr(v, field) for v in valid}, field


def test_parallel_workers_compile_only(tmp_path):
    env = make_env(gpu_name="none (compile-only)", compile_only=True)
    cfg = TuneConfig(arch="sm_90a", compile_only=True, max_variants=64)
    jobs = [Job(FAM.NAME, FakeProblem(m=m, n=n, k=4096).key())
            for n in (256, 512, 1024) for m in (1, 16)]
    events = []
    sums = run_jobs(jobs, functools.partial(TuningDB, tmp_path / "t.sqlite"), env, cfg,
                    workers=2, modules=["fakefam"], on_event=lambda k, o: events.append(k))
    assert len(sums) == len(jobs) and events.count("done") == len(jobs)
    assert "crash" not in events
    assert {s.problem_key for s in sums} == {j.problem_key for j in jobs}
    with TuningDB(tmp_path / "t.sqlite", readonly=True) as db:
        assert len(db) == sum(s.evaluated for s in sums) and db.verify().ok
    with pytest.raises(ValueError, match="gpu_lock"):
        run_jobs(jobs, functools.partial(TuningDB, tmp_path / "u.sqlite"), make_env(),
                 TuneConfig(), workers=2)


POISON = FakeVariant(tile=8, stages=4, pack=Pack.A)


def test_device_loss_in_process_stops_cleanly(tmp_path, monkeypatch):
    import resgen.search.device as device_mod

    monkeypatch.setattr(fakefam, "POISON", True)
    monkeypatch.setattr(fakefam, "_POISONED", [False])
    monkeypatch.setattr(device_mod, "device_healthy", lambda d: not fakefam._POISONED[0])
    events = []
    cfg = TuneConfig(arch="sm_90a", max_variants=64)
    jobs = [Job(FAM.NAME, FakeProblem(m=m, k=4096).key()) for m in (1, 4)]
    sums = run_jobs(jobs, functools.partial(TuningDB, tmp_path / "t.sqlite"), make_env(), cfg,
                    timer=fakefam.fake_timer, on_event=lambda k, o: events.append((k, o)))
    assert sorted(k for k, _ in events if k in ("lost", "crash")) == ["crash", "lost"]
    assert sums == []                       # the first workload was cut short, nothing else ran
    with TuningDB(tmp_path / "t.sqlite", readonly=True) as db:
        bad = [r for r in db.rows() if r["status"] == Status.RUN_FAILED]
    assert [FakeVariant.from_key(r["variant_key"]) for r in bad] == [POISON]
    assert "illegal memory access" in bad[0]["error"]


def test_a_process_with_a_broken_context_is_replaced(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKEFAM_POISON", "1")
    cfg = TuneConfig(arch="sm_90a", max_variants=64, gpu_lock=str(tmp_path / "gpu.lock"),
                     timer="fakefam:fake_timer")
    jobs = [Job(FAM.NAME, FakeProblem(m=m, n=n, k=4096).key())
            for n, m in ((256, 1), (256, 16), (512, 1))]
    events = []
    sums = run_jobs(jobs, functools.partial(TuningDB, tmp_path / "t.sqlite"), make_env(), cfg,
                    workers=2, isolate=True, modules=["fakefam"],
                    on_event=lambda k, o: events.append(k))
    assert events.count("lost") == 3 and "crash" not in events
    assert sorted(s.problem_key for s in sums) == sorted(j.problem_key for j in jobs)
    with TuningDB(tmp_path / "t.sqlite", readonly=True) as db:
        rows = db.rows()
    for j in jobs:
        p = FakeProblem.from_key(j.problem_key)
        mine = {FakeVariant.from_key(r["variant_key"]): r for r in rows
                if r["workload_key"] == j.problem_key}
        assert set(mine) == set(_valid(p))                   # every variant evaluated once
        assert mine[POISON]["status"] == Status.RUN_FAILED
        assert all(r["status"] != Status.RUN_FAILED for v, r in mine.items() if v != POISON)
    s16 = next(s for s in sums if FakeProblem.from_key(s.problem_key).m == 16)
    assert s16.resumed > 0 and s16.winner is not None


def test_a_process_that_dies_is_replaced_and_its_work_requeued(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKEFAM_KILL", "1")
    killer = FakeVariant(tile=8, stages=3, pack=Pack.A)
    cfg = TuneConfig(arch="sm_90a", max_variants=64, gpu_lock=str(tmp_path / "gpu.lock"),
                     timer="fakefam:fake_timer")
    jobs = [Job(FAM.NAME, FakeProblem(m=m, n=256, k=4096).key()) for m in (1, 4)]
    events = []
    sums = run_jobs(jobs, functools.partial(TuningDB, tmp_path / "t.sqlite"), make_env(), cfg,
                    workers=1, isolate=True, modules=["fakefam"],
                    on_event=lambda k, o: events.append((k, o)))
    lost = [o for k, o in events if k == "lost"]
    assert len(lost) == 2 and all("died (exit code -9)" in o for o in lost), events
    assert sorted(s.problem_key for s in sums) == sorted(j.problem_key for j in jobs)
    with TuningDB(tmp_path / "t.sqlite", readonly=True) as db:
        rows = db.rows()
    for j in jobs:
        mine = {FakeVariant.from_key(r["variant_key"]): r for r in rows
                if r["workload_key"] == j.problem_key}
        assert set(mine) == set(_valid(FakeProblem.from_key(j.problem_key)))
        assert mine[killer]["status"] == Status.RUN_FAILED
        assert "never finished" in mine[killer]["error"]


def test_hung_process_is_killed_after_the_budget(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKEFAM_HANG", "1")
    hang = FakeVariant(tile=8, stages=2, pack=Pack.A)
    cfg = TuneConfig(arch="sm_90a", max_variants=64, gpu_lock=str(tmp_path / "gpu.lock"),
                     timer="fakefam:fake_timer", time_budget_s=10.0, hard_stop_grace_s=2.0)
    jobs = [Job(FAM.NAME, FakeProblem(m=1, n=256, k=4096).key())]
    events = []
    t0 = time.monotonic()
    run_jobs(jobs, functools.partial(TuningDB, tmp_path / "t.sqlite"), make_env(), cfg,
             workers=1, isolate=True, modules=["fakefam"],
             on_event=lambda k, o: events.append((k, o)))
    assert time.monotonic() - t0 < 60
    # the message names the workload the killed process was on
    assert any(k == "crash" and "hard stop" in o and f"in flight: {FAM.NAME} {jobs[0].problem_key}"
               in o for k, o in events)
    with TuningDB(tmp_path / "t.sqlite", readonly=True) as db:
        rows = {FakeVariant.from_key(r["variant_key"]): r for r in db.rows()}
    assert rows[hang]["status"] == Status.RUN_FAILED and "never finished" in rows[hang]["error"]
    assert rows[FakeVariant()]["status"] == Status.OK       # finished work is kept


def test_gpu_lock_is_exclusive_across_processes(tmp_path):
    import multiprocessing as mp

    lock = str(tmp_path / "gpu.lock")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with gpu_lock(lock):
        p = ctx.Process(target=_lock_child, args=(lock, q))
        p.start()
        time.sleep(1.0)
        assert q.empty()                       # the child waits while we hold the lock
    assert q.get(timeout=30) == "got it"
    p.join(timeout=30)


def _lock_child(lock, q):
    with gpu_lock(lock):
        q.put("got it")


def test_working_set_and_rotation_sets():
    p = LinearProblem(fmt="nvfp4", compensation="none", m=1, n=24576, k=4096)
    ws = working_set_bytes(FAM, FakeVariant(), p)
    assert ws >= 24576 * 4096 * 0.5625                     # at least the FP4 weights
    assert DEFAULT_POLICY.sets_for(ws) == 3                 # 2 x 60 MB / 56.6 MB -> 3 sets
    small = LinearProblem(m=1, n=4096, k=4096)
    assert DEFAULT_POLICY.sets_for(working_set_bytes(FAM, FakeVariant(), small)) == 13
    kext = dataclasses.replace(p, compensation="0.5")
    assert working_set_bytes(FAM, FakeVariant(), kext) > ws
    assert MeasurementPolicy(max_sets=4).sets_for(1) == 4


# -- H4b: phases, prepared inputs, priors, seeds, coverage, grouping ----------------------------
def _rows_in_order(path, problem_key=None):
    with TuningDB(path, readonly=True) as db:
        rows = sorted(db.rows(), key=lambda r: r["id"])
    return [r for r in rows if problem_key is None or r["workload_key"] == problem_key]


def test_every_row_records_its_phase_seconds(tmp_path):
    import json

    (s,) = tune_fake(tmp_path / "t.sqlite", ms=[16], max_variants=64)
    rows = _rows_in_order(tmp_path / "t.sqlite")
    by_status = {}
    for r in rows:
        by_status.setdefault(r["status"], []).append(json.loads(r["phase_s"]))
    assert all(set(ph) == {"compile", "wait", "prep", "check", "time"}
               for ph in by_status[Status.OK])
    assert all(set(ph) == {"compile", "wait", "prep", "check"}       # never timed
               for ph in by_status[Status.CHECK_FAILED])
    assert all(set(ph) == {"compile"} for ph in by_status[Status.COMPILE_FAILED])
    assert all(v >= 0 for phs in by_status.values() for ph in phs for v in ph.values())
    # The workload summary adds them up (rows round to microseconds).
    for k in ("compile", "prep", "check", "time"):
        stored = sum(ph.get(k, 0.0) for phs in by_status.values() for ph in phs)
        assert s.phase_s[k] == pytest.approx(stored, abs=1e-5 * len(rows))


def test_prepare_hook_builds_inputs_once_per_workload(tmp_path, monkeypatch):
    seen = []

    class Recording(fakefam.FakeRunner):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            seen.append(self.inputs)

    monkeypatch.setattr(FakeFamily, "prepare", fakefam.fake_prepare, raising=False)
    monkeypatch.setattr(FakeFamily, "runner",
                        lambda self, c, v, p, d, n_sets=1, seed=0, inputs=None:
                        Recording(v, p, c, n_sets, inputs))
    fakefam.PREPARED.clear()
    sums = tune_fake(tmp_path / "t.sqlite", ms=[1, 16], max_variants=6)
    assert [p for p, _ in fakefam.PREPARED] == [s.problem_key for s in sums]
    assert all(s.prepared == 1 for s in sums)
    ran = sum(s.timed + s.check_failed for s in sums)
    assert len(seen) == ran > 2 and all(x is not None for x in seen)
    assert len({id(x) for x in seen}) == 2             # one inputs object per workload
    # Inputs bigger than keep_inputs_bytes are rebuilt for every variant instead of kept.
    fakefam.PREPARED.clear()
    (s,) = tune_fake(tmp_path / "u.sqlite", ms=[16], max_variants=6, keep_inputs_bytes=0)
    assert s.prepared == len(fakefam.PREPARED) == s.timed + s.check_failed > 1


def test_prior_ranks_the_candidates_under_a_small_budget(tmp_path, monkeypatch):
    monkeypatch.setattr(FakeFamily, "prior", fakefam.fake_prior, raising=False)
    p = FakeProblem(m=64, k=4096)
    valid = _valid(p)
    space = FAM.space(p, "sm_90a")
    (s,) = tune_fake(tmp_path / "t.sqlite", ms=[64], max_variants=4)
    assert s.search == "ranked" and s.evaluated == 4 < len(valid)
    order = [FakeVariant.from_key(r["variant_key"]) for r in _rows_in_order(tmp_path / "t.sqlite")]
    rest = sorted((v for v in valid if v != FakeVariant()),
                  key=lambda v: (fake_us(v, p), space.index(v)))
    assert order == [FakeVariant()] + rest[:3]          # the default, then the prior's best
    ok = [v for v in order if not (v.stages == 3 and v.pack is Pack.B)
          and not (v.split and v.pack is Pack.B)]
    assert s.winner == min(ok, key=lambda v: (fake_us(v, p), space.index(v))).name()


def test_a_prior_that_fails_means_no_opinion(tmp_path, monkeypatch):
    def picky(self, v, p):
        if v.pack is Pack.B:
            raise ZeroDivisionError("no idea")
        return float("nan") if v.stages == 4 else fake_us(v, p)

    monkeypatch.setattr(FakeFamily, "prior", picky, raising=False)
    (s,) = tune_fake(tmp_path / "t.sqlite", ms=[64], max_variants=20)
    order = [FakeVariant.from_key(r["variant_key"]) for r in _rows_in_order(tmp_path / "t.sqlite")]
    scored = [v for v in order[1:] if v.pack is Pack.A and v.stages != 4]
    assert order[1:len(scored) + 1] == scored           # opinions first, no-opinions last
    assert s.winner is not None


def test_seeds_from_an_earlier_workload_of_the_class_go_first(tmp_path):
    path = tmp_path / "t.sqlite"
    p16, p32 = FakeProblem(m=16, k=4096), FakeProblem(m=32, k=4096)
    fakefam.COMPILES.clear()
    sums = tune_fake(path, ms=[16, 32], max_variants=8, seeds=3)     # optuna: no prior
    assert [s.search for s in sums] == ["optuna", "optuna"]
    rows16 = _rows_in_order(path, p16.key())
    best16 = sorted((r["median_us"], r["space_index"], r["variant_key"]) for r in rows16
                    if r["status"] == Status.OK)[:3]
    rows32 = _rows_in_order(path, p32.key())
    first = [r["variant_key"] for r in rows32[:4]]
    assert first == [FakeVariant().key()] + [k for _, _, k in best16]
    # Those were compiled for M=16 already (same compile key): compiled once in the run.
    assert len(fakefam.COMPILES) == len(set(fakefam.COMPILES))
    # seeds=0 switches it off.
    sums = tune_fake(tmp_path / "u.sqlite", ms=[16, 32], max_variants=8, seeds=0)
    rows32 = _rows_in_order(tmp_path / "u.sqlite", p32.key())
    assert [r["variant_key"] for r in rows32[:4]] != first


def test_coverage_stage_then_refine_within_max_variants(tmp_path):
    timer = CountingTimer()
    sums = tune_fake(tmp_path / "t.sqlite", ms=[1, 4, 16, 64], max_variants=5,
                     coverage=True, timer=timer)
    assert len(sums) == 4
    for s in sums:
        assert s.stage == "cover+refine" and s.winner is not None
        assert s.evaluated == len(set(s.indices)) <= 5
        assert s.resumed == 0                           # the refine stage's resume is internal
    # Nothing was timed twice: the refine stage reused the cover stage's rows.
    assert len(timer.calls) == sum(s.timed for s in sums)
    with TuningDB(tmp_path / "t.sqlite", readonly=True) as db:
        assert len(db) == sum(s.evaluated for s in sums)


def test_cover_and_refine_stages_skip_workloads_past_the_budget(tmp_path):
    env = make_env()
    with TuningDB(tmp_path / "t.sqlite") as db:
        tuner = Tuner(db, env, TuneConfig(arch="sm_90a", max_variants=8), fakefam.fake_timer)
        for stage in ("cover", "refine"):
            s = tuner.tune(FAM, FakeProblem(m=16, k=4096), deadline=time.monotonic() - 1,
                           stage=stage)
            assert s.evaluated == 0 and s.stopped_by == "time_budget" and s.search == "skipped"
        assert len(db) == 0
        with pytest.raises(ValueError):
            tuner.tune(FAM, FakeProblem(m=16, k=4096), stage="sometimes")


def test_cover_stage_tries_the_next_candidate_when_one_fails(tmp_path, monkeypatch):
    class DefaultWrong(fakefam.FakeRunner):
        def check(self):
            if self.v == FakeVariant():
                return fakefam.CheckResult(False, 1.0, 3e-3, "default wrong (injected)")
            return super().check()

    monkeypatch.setattr(FakeFamily, "runner",
                        lambda self, c, v, p, d, n_sets=1, seed=0: DefaultWrong(v, p, c, n_sets))
    env = make_env()
    with TuningDB(tmp_path / "t.sqlite") as db:
        tuner = Tuner(db, env, TuneConfig(arch="sm_90a", coverage_attempts=3),
                      fakefam.fake_timer)
        s = tuner.tune(FAM, FakeProblem(m=16, k=4096), stage="cover")
        assert (s.evaluated, s.check_failed, s.timed) == (2, 1, 1) and s.winner is not None
        tuner = Tuner(db, env, TuneConfig(arch="sm_90a", coverage_attempts=1),
                      fakefam.fake_timer)
        s = tuner.tune(FAM, FakeProblem(m=4, k=4096), stage="cover")
        assert s.evaluated == 1 and s.winner is None and s.stopped_by == "attempts"


def test_no_resume_with_coverage_times_each_variant_once(tmp_path):
    from datetime import datetime, timezone

    path = tmp_path / "t.sqlite"
    tune_fake(path, ms=[16], max_variants=4)
    since = datetime.now(timezone.utc).isoformat(timespec="microseconds")
    timer = CountingTimer()
    (s,) = tune_fake(path, ms=[16], max_variants=4, coverage=True, resume=False,
                     resume_since=since, timer=timer)
    assert len(timer.calls) == len(set(timer.calls)) == s.timed    # re-timed, once each
    assert FakeVariant().key() in timer.calls and s.evaluated == 4


def test_plan_groups_by_compile_class_in_chunks_family_order(monkeypatch):
    from resgen.search.orchestrate import plan_groups
    from resgen.search.tuner import compile_class

    jobs = [Job(FAM.NAME, FakeProblem(m=m, n=n, k=4096).key())
            for n in (256, 512) for m in (1, 4, 16, 64)]
    groups = plan_groups(jobs, "sm_90a", workers=1)
    assert sorted(len(g) for g in groups) == [4, 4]      # one class per N: M is run-time
    assert sorted(j.problem_key for g in groups for j in g) == sorted(j.problem_key
                                                                      for j in jobs)
    for g in groups:
        assert len({compile_class(*j.resolve(), "sm_90a") for j in g}) == 1
    # A compile key without N (every shape one class) is cut into chunks for the workers,
    # never smaller than a shape's bucket siblings.
    monkeypatch.setattr(FakeFamily, "compile_key",
                        lambda self, v, p: dataclasses.replace(p, m=1, n=256))
    one = plan_groups(jobs, "sm_90a", workers=1)
    assert [len(g) for g in one] == [8]
    many = plan_groups(jobs, "sm_90a", workers=4)
    assert [len(g) for g in many] == [4, 4]
    assert all(len({FakeProblem.from_key(j.problem_key).n for j in g}) == 1 for g in many)


def test_merge_summaries_counts_distinct_variants():
    from resgen.search.tuner import WorkloadSummary, merge_summaries

    a = WorkloadSummary("f", "k", stage="cover", evaluated=2, timed=1, check_failed=1,
                        indices=[0, 3], phase_s={"time": 1.0}, winner="x", winner_us=2.0,
                        default_us=5.0)
    b = WorkloadSummary("f", "k", stage="refine", evaluated=4, resumed=2, timed=2,
                        indices=[0, 3, 7, 9], phase_s={"time": 0.5, "prep": 0.25},
                        winner="y", winner_us=1.0, stopped_by="max_variants")
    c = WorkloadSummary("f", "other", evaluated=1, indices=[4])
    m, other = merge_summaries([a, c, b])
    assert other is c
    assert (m.evaluated, m.resumed, m.timed, m.check_failed) == (4, 0, 3, 1)
    assert m.indices == [0, 3, 7, 9] and m.stage == "cover+refine"
    assert m.phase_s == {"time": 1.5, "prep": 0.25}
    assert (m.winner, m.winner_us, m.default_us, m.stopped_by) == ("y", 1.0, 5.0,
                                                                    "max_variants")
    assert a.indices == [0, 3] and a.phase_s == {"time": 1.0}      # inputs untouched


def test_a_family_that_keeps_breaking_the_context_is_disabled(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKEFAM_POISON", "1")
    cfg = TuneConfig(arch="sm_90a", max_variants=64, gpu_lock=str(tmp_path / "gpu.lock"),
                     timer="fakefam:fake_timer", max_family_losses=1)
    jobs = [Job(FAM.NAME, FakeProblem(m=m, n=n, k=4096).key())
            for n, m in ((256, 1), (256, 16), (512, 1))]
    events = []
    sums = run_jobs(jobs, functools.partial(TuningDB, tmp_path / "t.sqlite"), make_env(), cfg,
                    workers=1, isolate=True, modules=["fakefam"],
                    on_event=lambda k, o: events.append((k, o)))
    kinds = [k for k, _ in events]
    assert kinds.count("lost") == 1 and kinds.count("disabled") == 1 and "crash" not in kinds
    assert sorted(s.problem_key for s in sums) == sorted(j.problem_key for j in jobs)
    off = [s for s in sums if (s.error or "").startswith("family disabled")]
    assert len(off) >= 2 and all(s.evaluated == 0 for s in off)


def test_a_family_that_never_passes_its_check_is_disabled(tmp_path, monkeypatch):
    class Wrong(fakefam.FakeRunner):
        def check(self):
            return fakefam.CheckResult(False, 1.0, 3e-3, "always wrong (injected)")

    monkeypatch.setattr(FakeFamily, "runner",
                        lambda self, c, v, p, d, n_sets=1, seed=0: Wrong(v, p, c, n_sets))
    events = []
    cfg = TuneConfig(arch="sm_90a", max_variants=3, max_family_failures=2)
    jobs = [Job(FAM.NAME, FakeProblem(m=m, k=4096).key()) for m in (1, 4, 16, 64)]
    sums = run_jobs(jobs, functools.partial(TuningDB, tmp_path / "t.sqlite"), make_env(), cfg,
                    timer=fakefam.fake_timer, on_event=lambda k, o: events.append((k, o)))
    assert [k for k, _ in events].count("disabled") == 1
    assert [s.evaluated for s in sums] == [3, 3, 0, 0] and not any(s.timed for s in sums)
    assert all(s.error.startswith("family disabled") for s in sums[2:])
    with pytest.raises(ValueError):
        TuneConfig(max_family_failures=0)


def test_winner_counts_every_stored_row_of_the_workload(tmp_path, monkeypatch):
    """A refine stage in another process that never revisits the cover stage's timed variant
    still reports the winner the runtime will serve (every stored row counts)."""
    from resgen.search.record import pick_winner

    class DefaultWrong(fakefam.FakeRunner):
        def check(self):
            if self.v == FakeVariant():
                return fakefam.CheckResult(False, 1.0, 3e-3, "default wrong (injected)")
            return super().check()

    monkeypatch.setattr(FakeFamily, "runner",
                        lambda self, c, v, p, d, n_sets=1, seed=0: DefaultWrong(v, p, c, n_sets))
    p = FakeProblem(m=64, k=4096)
    env = make_env()
    with TuningDB(tmp_path / "t.sqlite") as db:
        cover = Tuner(db, env, TuneConfig(arch="sm_90a"), fakefam.fake_timer).tune(
            FAM, p, stage="cover")
        assert cover.evaluated == 2 and cover.winner is not None
        refine = Tuner(db, env, TuneConfig(arch="sm_90a", max_variants=2, search="optuna"),
                       fakefam.fake_timer).tune(FAM, p, stage="refine")
        rows = db.rows(status=Status.OK)
    best = pick_winner(rows, 0.01)
    assert refine.winner == best["variant_name"]
    # Rows of a stale template never count.
    monkeypatch.setattr(Tuner, "_fingerprint", lambda self, f, pr, v: "changed")
    with TuningDB(tmp_path / "t.sqlite") as db:
        tuner = Tuner(db, env, TuneConfig(arch="sm_90a"), fakefam.fake_timer)
        assert tuner._known(FAM, p, {v.key() for v in _valid(p)}) == {}


def test_runners_with_as_layer_are_timed_as_the_whole_op(tmp_path, monkeypatch):
    """The tuner switches a runner with as_layer() to it before the check and the timing."""
    calls: list[str] = []

    class Layer(fakefam.FakeRunner):
        layered = False

        def as_layer(self):
            calls.append(self.v.key())
            self.layered = True

        def check(self):
            assert self.layered, "checked before as_layer()"
            return super().check()

    monkeypatch.setattr(FakeFamily, "runner",
                        lambda self, c, v, p, d, n_sets=1, seed=0: Layer(v, p, c, n_sets))
    seen = []

    def timer(runner, policy, n_sets):
        seen.append(runner.layered)
        return summarize([fake_us(runner.v, runner.p)] * 3, policy, launches=8,
                         n_sets=n_sets, mode="fake")

    (s,) = tune_fake(tmp_path / "t.sqlite", ms=[16], max_variants=4, timer=timer)
    assert s.timed > 0 and len(calls) >= s.timed and seen and all(seen)


def test_cover_stage_starts_with_the_priors_first_choice(tmp_path, monkeypatch):
    """With a prior, the one variant a short budget may get is the prior's best, not the
    default (which stays the next candidate)."""
    monkeypatch.setattr(FakeFamily, "prior", fakefam.fake_prior, raising=False)
    p = FakeProblem(m=16, k=4096)
    best = min(_valid(p), key=lambda v: (fakefam.fake_prior(FAM, v, p), v.key()))
    assert best != FakeVariant()
    env = make_env()
    with TuningDB(tmp_path / "t.sqlite") as db:
        s = Tuner(db, env, TuneConfig(arch="sm_90a", coverage_attempts=3),
                  fakefam.fake_timer).tune(FAM, p, stage="cover")
    assert s.evaluated == 1 and s.winner == best.name()


def test_warm_runs_before_the_gpu_lock_and_its_failure_is_not_fatal(tmp_path, monkeypatch):
    seen: list[str] = []

    def warm(self, v, p):
        seen.append(v.key())
        if v.stages == 2:
            raise RuntimeError("helper compile failed")

    monkeypatch.setattr(FakeFamily, "warm", warm, raising=False)
    (s,) = tune_fake(tmp_path / "t.sqlite", ms=[16], max_variants=6)
    assert len(seen) == s.compiled and s.timed > 0 and s.winner is not None
    with TuningDB(tmp_path / "t.sqlite", readonly=True) as db:
        st2 = [r["status"] for r in db.rows() if '"stages":2' in r["variant_key"]]
    assert Status.OK in st2 and Status.RUN_FAILED not in st2   # warm() failing is no outcome


def test_linear_families_warm_the_layer_quantizer(monkeypatch):
    import resgen.search.linear_sm90_mma as L
    from resgen.search import linear_sm90_wgmma as W
    from resgen.search import sm90_linear

    made = []
    monkeypatch.setattr(sm90_linear, "layer_quantizer",
                        lambda p, arch="sm_90a", layout=None: made.append(p))
    p = LinearProblem("nvfp4", "full", 1, 4096, 4096)
    L.FAMILY.warm(L.LinearSm90Variant(), p)
    L.FAMILY.warm(L.LinearSm90Variant(act=L.Act.FUSED), p)       # quantizes in its prologue
    W.FAMILY.warm(W.LinearSm90WgmmaVariant(), p)
    assert made == [p, p]


def test_summaries_merge_in_stage_order_whatever_the_arrival_order():
    """Worker processes report stages in any order; the refine stage's winner must win (a
    race seen under CPU load made the cover winner override it)."""
    from resgen.search.tuner import WorkloadSummary, merge_summaries

    cover = WorkloadSummary(family="f", problem_key="p", stage="cover", search="cover",
                            evaluated=1, timed=1, winner="a", winner_us=2.0, indices=[0])
    refine = WorkloadSummary(family="f", problem_key="p", stage="refine", search="optuna",
                             evaluated=2, timed=2, winner="b", winner_us=1.0, indices=[0, 5])
    other = WorkloadSummary(family="f", problem_key="q", stage="cover", search="cover")
    for order in ([cover, other, refine], [refine, other, cover]):
        merged = merge_summaries(order)
        assert [m.problem_key for m in merged] == [order[0].problem_key, "q"]
        (m,) = [m for m in merged if m.problem_key == "p"]
        assert (m.stage, m.search, m.winner, m.evaluated) == ("cover+refine", "cover+optuna",
                                                              "b", 2)


def test_refine_share_never_reaches_past_the_run_budget():
    """The last workloads of a run used to get workers x the time left, so a run whose
    workloads all finished still ran into the hard stop (tune13b: 64 workloads, 14
    processes, killed 30 s past the budget)."""
    from resgen.search.orchestrate import workload_share

    assert workload_share("refine", 100.0, 14, 1) == 100.0      # not 1400 s
    assert workload_share("refine", 100.0, 14, 28) == 50.0      # the fair share
    assert workload_share("refine", -5.0, 14, 3) == 0.0         # past the budget
    assert workload_share("cover", 100.0, 14, 500) == 100.0     # one variant each, any time
