"""Tuning across processes and hosts through a coordinator (issue 24): optuna's RDBStorage on
a real PostgreSQL server (tests/pgfixture.py: a throwaway cluster, stopped at the end), and
several `resgen tune` processes of the CPU test family ("hosts", each with its own cache,
GPU lock and database) against one study."""

from __future__ import annotations

import collections
import functools
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

import fakefam
from fakefam import (FakeProblem, FakeVariant, Pack, isolated_cache, make_env,  # noqa: F401
                     subprocess_env)
from pgfixture import pg_server, pg_url  # noqa: F401
from resgen.cli import main
from resgen.db import TuningDB
from resgen.search import coordinator as coord_mod
from resgen.search.coordinator import (Coordinator, CoordinatorConfig, CoordinatorError,
                                       check_url, _ident_key)
from resgen.search.orchestrate import Job, run_jobs
from resgen.search.record import ResultRecord, Status, pick_winner
from resgen.search.timing import policy_named
from resgen.search.tuner import UNFINISHED, TuneConfig

pytestmark = pytest.mark.usefixtures("isolated_cache")

HUNG = FakeVariant(tile=8, stages=2, pack=Pack.A, split=False)    # fakefam.HANG_ONCE's variant
TUNE = ["tune", "--model", "qwen3-8b", "--families", "fake_gemm", "--import", "fakefam",
        "--formats", "nvfp4", "--compensations", "none", "--m-buckets", "1,16",
        "--timer", "fakefam:fake_timer", "--max-variants", "16", "--jobs", "1",
        "--time-budget", "600"]
# The GPU code path (worker processes, cover + refine stages) with faked device facts.
DRIVER = """
import sys
import fakefam
import resgen.cli as cli
import resgen.search.record as record
cli._has_gpu = lambda: True
record.current_environment = lambda device=0: fakefam.make_env()
raise SystemExit(cli.main(sys.argv[1:]))
"""


def _fake_gpu(monkeypatch):
    import resgen.cli as cli
    import resgen.search.record as record

    monkeypatch.setattr(cli, "_has_gpu", lambda: True)
    monkeypatch.setattr(record, "current_environment", lambda device=0: make_env())


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]          # nothing listens there once closed


def _coord(url, env=None, settings="s1", grace=2):
    return Coordinator(CoordinatorConfig(url=url, heartbeat_s=1, grace_s=grace, poll_s=0.1),
                       env or make_env(), settings)


# -- bad coordinators: one line, exit code 2, nothing created -----------------------------------
def test_url_checks_name_the_problem(monkeypatch):
    for bad, why in (("not a url", "not a database URL"),
                     ("sqlite:///x.db", "need a PostgreSQL server URL"),
                     ("postgresql:///db", "names no host"),
                     ("postgresql+nosuchdrv://u@h/db", "'nosuchdrv' is not installed")):
        with pytest.raises(CoordinatorError, match=why):
            check_url(bad)
    url = check_url("postgresql://me:secret@db.example:5432/tune")
    assert url.startswith("postgresql+psycopg://") and "secret" in url
    assert "secret" not in coord_mod.redact(url) and "***" in coord_mod.redact(url)
    monkeypatch.setattr(coord_mod, "DRIVERS", ("no_such_driver_a", "no_such_driver_b"))
    with pytest.raises(CoordinatorError, match=r"resgen\[dist\]"):
        check_url("postgresql://u@h/db")


@pytest.mark.parametrize("extra, why", [
    (["--coordinator", "postgresql://resgen@127.0.0.1:{port}/postgres"],
     "cannot use the coordinator postgresql://resgen@127.0.0.1:{port}/postgres"),
    (["--coordinator", "mysql://u@h/db"], "need a PostgreSQL server URL"),
    (["--coordinator", "postgresql://u@127.0.0.1/db", "--shard", "0/2"], "use one of them"),
    (["--coordinator", "postgresql://u@127.0.0.1/db", "--no-resume"],
     "needs --coordinator-run TAG"),
])
def test_a_coordinator_that_cannot_be_used_stops_the_run_before_it_starts(
        tmp_path, capsys, monkeypatch, extra, why):
    _fake_gpu(monkeypatch)
    port = _closed_port()
    db = tmp_path / "t.sqlite"
    rc = main(TUNE + ["--db", str(db)] + [a.format(port=port) for a in extra])
    out, err = capsys.readouterr()
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("resgen tune: "), err
    assert why.format(port=port) in lines[0] and "Traceback" not in out + err
    assert not db.exists()                       # never a half run


def test_no_driver_is_a_one_line_error(tmp_path, capsys, monkeypatch):
    _fake_gpu(monkeypatch)
    monkeypatch.setattr(coord_mod, "DRIVERS", ("no_such_driver",))
    rc = main(TUNE + ["--db", str(tmp_path / "t.sqlite"), "--coordinator",
                      "postgresql://u@127.0.0.1/db"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err and "pip install 'resgen[dist]'" in err


def test_without_a_coordinator_no_server_or_driver_is_needed(tmp_path, monkeypatch):
    """The plain tuner never imports the coordinator's driver or SQLAlchemy's PostgreSQL
    dialect (resgen.search.distributed is only imported with --coordinator)."""
    code = ("import sys, resgen.cli as c; "
            "assert c.main(sys.argv[1:]) == 0; "
            "bad = [m for m in sys.modules if m.startswith(('psycopg', 'resgen.search.coord', "
            "'resgen.search.distributed', 'sqlalchemy.dialects.postgresql'))]; "
            "assert not bad, bad")
    env = subprocess_env()
    env.update(RESGEN_CACHE_DIR=str(tmp_path / "cache"))
    env.pop("RESGEN_COORDINATOR", None)
    out = subprocess.run([sys.executable, "-c", code, "tune", "--model", "qwen3-8b",
                          "--families", "fake_gemm", "--import", "fakefam", "--compile-only",
                          "--jobs", "1", "--db", str(tmp_path / "t.sqlite")],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]


# -- the study's protocol, in this process --------------------------------------------------------
def _workloads(ms=(1, 4)):
    return [{"stage": "full", "family": "fake_gemm", "problem": FakeProblem(m=m).key(),
             "wl": FakeProblem(m=m).digest(), "fp": "f", "cls": "c"} for m in ms]


def test_claims_are_exclusive_and_a_dead_processs_claim_comes_back(pg_url):
    a, b = _coord(pg_url), _coord(pg_url)
    try:
        w = _workloads()
        assert a.publish(w) == 2 and b.publish(w) == 0       # once, whoever comes first
        mine = {("fake_gemm", x["problem"]) for x in w}
        i1, i2 = a.claim(mine), b.claim(mine)
        assert {i1.problem_key, i2.problem_key} == {x["problem"] for x in w}
        # Both in flight, nothing waiting: b waits (here until its deadline).
        assert b.claim(mine, deadline=time.time() + 0.5) is None
        assert b.finish(i2.trial_id, 1.0)
        a.close()                                  # a dies: its trial's heartbeat stops
        t0 = time.monotonic()
        i3 = b.claim(mine, deadline=time.time() + 60)
        assert time.monotonic() - t0 > 1.0         # only after the grace period
        assert i3.problem_key == i1.problem_key and i3.retries == 1
        b.release(i3.trial_id)                     # e.g. past the time budget: handed back
        i4 = b.claim(mine)
        assert i4.problem_key == i1.problem_key and i4.retries == 1   # not counted a retry
        assert b.finish(i4.trial_id, None)
        assert b.claim(mine) is None               # nothing waiting, nothing in flight
        states = collections.Counter(t.state.name for t, d in b.snapshot()
                                     if d["kind"] == "workload")
        assert states == {"COMPLETE": 2, "FAIL": 2}
        # Other run settings never take this run's work.
        c = _coord(pg_url, settings="s2")
        try:
            assert c.claim(mine) is None
        finally:
            c.close()
    finally:
        a.close()
        b.close()


def test_the_registry_is_shared_and_one_study_per_environment(pg_url):
    a, b = _coord(pg_url), _coord(pg_url, settings="other")
    try:
        p, v = FakeProblem(m=4), FakeVariant(stages=3)
        a.report(ResultRecord(problem=p, variant=v, environment=make_env(), fingerprint="fp1",
                              status=Status.OK, space_index=7, median_us=3.5))
        b.snapshot()
        k = b.lookup("fake_gemm", p.digest(), v.key(), "fp1")
        assert (k.status, k.median_us, k.space_index) == (Status.OK, 3.5, 7)
        assert b.lookup("fake_gemm", p.digest(), v.key(), "fp2") is None    # fingerprint
        # Another GPU kind (or driver) gets another study, and sees nothing of this one.
        c = _coord(pg_url, env=make_env(gpu_name="Other GPU"))
        try:
            assert c.name != a.name
            c.snapshot()
            assert c.lookup("fake_gemm", p.digest(), v.key(), "fp1") is None
        finally:
            c.close()
    finally:
        a.close()
        b.close()
    # A study caught between another process's two attribute writes (app set, environment
    # not yet: processes starting together) is this environment's: joined, completed.
    import optuna

    env = make_env(gpu_name="Half-made GPU")
    half = optuna.create_study(study_name=coord_mod.study_name(env),
                               storage=coord_mod.check_url(pg_url))
    half.set_user_attr("app", coord_mod.APP)
    c = _coord(pg_url, env=env)
    try:
        assert half.user_attrs["environment"] == env.as_dict()
    finally:
        c.close()
    # A study of that name that is not this environment's resgen study is refused.
    import optuna

    env = make_env(gpu_name="Third GPU")
    optuna.create_study(study_name=coord_mod.study_name(env),
                        storage=coord_mod.check_url(pg_url)).set_user_attr("app", "other")
    with pytest.raises(CoordinatorError, match="not this environment's resgen study"):
        _coord(pg_url, env=env)


# -- several hosts, one killed mid-trial ---------------------------------------------------------
def _single_process(tmp_path, problem_keys):
    """What one process tunes for the same jobs without a coordinator (seeds off, as a
    distributed run has them)."""
    path = tmp_path / "one.sqlite"
    cfg = TuneConfig(arch="sm_90a", max_variants=16, coverage=True, seeds=0,
                     policy=policy_named("tune"), time_budget_s=600)
    run_jobs([Job("fake_gemm", k) for k in problem_keys], functools.partial(TuningDB, path),
             make_env(), cfg, timer=fakefam.fake_timer)
    return path


def _rows(path):
    with TuningDB(path, readonly=True) as db:
        return {(r["workload_key"], r["variant_key"], r["fingerprint"]): r for r in db.rows()}


def _winners(rows):
    by = collections.defaultdict(list)
    for r in rows.values():
        if r["status"] == Status.OK:
            by[r["workload_key"]].append(r)
    return {w: pick_winner(rs, 0.01)["variant_key"] for w, rs in by.items()}


def test_hosts_share_one_study_a_killed_host_is_re_run_and_the_merge_is_one_process(
        tmp_path, pg_url):
    hang = tmp_path / "hang"
    hosts, logs = [], []
    for h in range(3):
        env = subprocess_env()
        env.update(RESGEN_CACHE_DIR=str(tmp_path / f"cache{h}"), FAKEFAM_HANG_ONCE=str(hang))
        log = open(tmp_path / f"host{h}.log", "w+")
        logs.append(log)
        hosts.append(subprocess.Popen(
            [sys.executable, "-c", DRIVER, *TUNE, "--db", str(tmp_path / f"h{h}.sqlite"),
             "--coordinator", pg_url, "--coordinator-grace", "4"], env=env, stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True))
    try:
        deadline = time.monotonic() + 180
        while not (hang.exists() and hang.read_text()):
            assert time.monotonic() < deadline, "no host ever ran the hanging variant"
            assert all(p.poll() is None for p in hosts), "a host ended before the hang"
            time.sleep(0.2)
        pid = int(hang.read_text().split()[0])
        victim = os.getpgid(pid)                 # that host: its tune process and workers
        os.killpg(victim, signal.SIGKILL)
        for p in hosts:
            p.wait(timeout=300)
    finally:
        for p in hosts:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        for f in logs:
            f.close()
    killed = next(i for i, p in enumerate(hosts) if p.pid == victim)
    for i, p in enumerate(hosts):
        text = (tmp_path / f"host{i}.log").read_text()
        if i != killed:
            assert p.returncode == 0 and "Traceback" not in text, text[-3000:]
            assert "TUNING SUMMARY" in text
    # The study: every piece of work done exactly once; the killed host's claims failed by
    # the heartbeat and re-run by another host; every evaluation reported once.
    c = _coord(pg_url)
    try:
        snap = c.snapshot()
    finally:
        c.close()
    work: dict[str, list[str]] = collections.defaultdict(list)
    results = collections.Counter()
    for t, d in snap:
        if d["kind"] == "result":
            results[(d["wl"], d["variant"], d["fp"])] += 1
        else:
            work[_ident_key(d)].append(t.state.name)
    assert work and all(sorted(s).count("COMPLETE") == 1 for s in work.values()), work
    failed = [k for k, s in work.items() if "FAIL" in s]
    assert failed and all(sorted(s) == ["COMPLETE", "FAIL"] for k, s in
                          ((k, work[k]) for k in failed))
    assert not any(s in ("WAITING", "RUNNING") for ss in work.values() for s in ss)
    assert results and set(results.values()) == {1}, "a variant was timed twice"
    # The hung variant: never finished on the killed host, finished on exactly one other.
    hung = {i: [r for k, r in _rows(tmp_path / f"h{i}.sqlite").items()
                if r["variant_key"] == HUNG.key() and k[0] == hang.read_text().split(" ", 1)[1]]
            for i in range(3)}
    assert [r["error"] for r in hung[killed]] == [UNFINISHED]
    assert sorted(r["status"] for i in hung if i != killed for r in hung[i]) == [Status.OK]
    # The hosts' databases merged = one process's database: same rows (here even the same
    # fake timings), same winners, no "never finished" marker left.
    merged = tmp_path / "merged.sqlite"
    assert main(["db", "merge", *[str(tmp_path / f"h{i}.sqlite") for i in range(3)],
                 "--into", str(merged), "--import", "fakefam"]) == 0
    got = _rows(merged)
    one = _rows(_single_process(tmp_path, {k[0] for k in got}))
    assert set(got) == set(one) and len(got) == 2 * 16 * 4      # 4 shapes x M 1, 16
    fields = ("status", "median_us", "space_index", "error")
    assert {k: tuple(r[f] for f in fields) for k, r in got.items()} == \
        {k: tuple(r[f] for f in fields) for k, r in one.items()}
    assert _winners(got) == _winners(one) and len(_winners(got)) == 8
    per_host = collections.Counter()
    for i in range(3):
        for k, r in _rows(tmp_path / f"h{i}.sqlite").items():
            if r["error"] != UNFINISHED:
                per_host[k] += 1
    assert set(per_host.values()) == {1}         # each outcome in one host's database
    assert sum(1 for i in range(3) if i != killed
               for _ in _rows(tmp_path / f"h{i}.sqlite")) > 0


# -- the planner reads the tuner's fixed candidate lists without evaluating ----------------------
@pytest.mark.parametrize("case", ["exhaustive", "ranked", "spread", "cover-preflight", "optuna"])
def test_the_planner_lists_exactly_what_the_tuner_evaluates(tmp_path, monkeypatch, case):
    from resgen.search.distributed import _Planner
    from resgen.search.tuner import Tuner

    compile_only = case in ("spread", "cover-preflight")
    if case == "ranked":
        monkeypatch.setattr(fakefam.FakeFamily, "prior", fakefam.fake_prior, raising=False)
    env = make_env(gpu_name="none (compile-only)", compile_only=True) if compile_only \
        else make_env()
    cfg = TuneConfig(arch="sm_90a", seeds=0, compile_only=compile_only,
                     max_variants={"exhaustive": 64, "ranked": 4, "spread": 9,
                                   "cover-preflight": 4, "optuna": 6}[case],
                     preflight="cover" if case == "cover-preflight" else "full")
    p = FakeProblem(m=64, k=4096)
    _, planned = _Planner(env, cfg).plan(fakefam.FAMILY, p, "full")
    if case == "optuna":
        assert planned is None                 # depends on the timings: searched by its owner
        return
    with TuningDB(tmp_path / "t.sqlite") as db:
        s = Tuner(db, env, cfg, fakefam.fake_timer).tune(fakefam.FAMILY, p, stage="full")
        order = [(r["variant_key"], r["space_index"]) for r in sorted(db.rows(),
                                                                      key=lambda r: r["id"])]
    assert s.search == case
    assert [(v.key(), i) for v, i in planned] == order and len(order) > 1


def test_processes_starting_together_all_join_one_study(pg_url):
    """Six coordinators connecting at once to an empty database (optuna's tables, the study
    and its attributes created by whoever is first; the others lose creation races and must
    retry or join, never stop the run) all join the same study."""
    import threading

    env = make_env(gpu_name="Crowded GPU")
    go = threading.Barrier(6)
    got: list = []
    errors: list = []

    def start() -> None:
        go.wait()
        try:
            c = _coord(pg_url, env=env)
            got.append(c)
        except Exception as e:          # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=start) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    try:
        assert not errors, errors
        assert len(got) == 6 and len({c._sid for c in got}) == 1
    finally:
        for c in got:
            c.close()
