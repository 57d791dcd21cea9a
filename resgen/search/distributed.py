"""A distributed tuning run: `resgen tune --coordinator postgresql://...` on every GPU of one or
many hosts. Each `resgen tune` starts its tuner processes as without a coordinator (they
compile on their own cores and take turns on the host's GPU, resgen.search.device), but they
draw their work from the coordinator's study (resgen.search.coordinator) instead of a local
queue, record every outcome in the host's SQLite database exactly as before, and report it to
the study. docs/distributed_tuning.md has the design.

What a claimed trial runs (resgen.search.tuner does the tuning itself):
- a cover-stage workload trial: the cover search (one checked, timed variant);
- a "full"/"refine" workload trial: the search a single process would run. A fixed candidate
  list (resgen.search.tuner's exhaustive, ranked, spread or covering order; `_Planner` reads
  it off the tuner without evaluating anything) is enqueued as variant trials, which this
  process evaluates in order while idle processes may take some from the end; a large space
  without a prior is searched by the seeded TPE sampler right here;
- another process's variant trial: that one evaluation.
Before a variant is timed the study's registry is consulted (`_StudyStore.find`): a result
another process, host or earlier run measured for the same (workload, variant, fingerprint)
is reused, never re-timed. So the variants evaluated for a workload, and the rows the hosts'
databases hold between them, do not depend on how many processes or hosts took part.

Differences from a run without a coordinator: seeds (the best variants of earlier workloads of
a compile class, tried first) are off, since which workloads a process tuned earlier depends
on the interleaving; a variant that was in flight when a process died is tried again (by the
study's retry) instead of being skipped, up to twice per workload search; the family breaker
is off (a family failing on one host need not fail on another).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import time
from typing import Any, Callable, Mapping, Sequence

from . import device as _device
from .build import format_error, memo_fingerprint
from .coordinator import (Coordinator, CoordinatorConfig, Item, file_digest, redact,
                          run_settings)
from .family import KernelFamily
from .orchestrate import (Job, TuneInterrupted, _die_with_parent, _import_modules,
                          _resolve_timer, _stop_on_sigterm, _stop_workers)
from .record import Environment, ResultRecord, Status, pick_winner
from .timing import measure
from .tuner import (INTERRUPTED, UNFINISHED, Interrupted, Timer, TuneConfig, Tuner,
                    WorkloadSummary, compile_class, merge_summaries, stages_of)
from .variant import ProblemBase, VariantBase, sha256_json

__all__ = ["run_distributed", "workload_trials"]

log = logging.getLogger("resgen.tuner")


class _Sequential(Exception):
    """The planner met a search whose candidates depend on timings (cover, optuna)."""


def _no_timer(runner: Any, policy: Any, n_sets: int) -> Any:
    raise AssertionError("the planner never times")


class _Planner(Tuner):
    """Tuner.tune without evaluating anything: the fixed candidates (and space indices) a
    stage of a workload would evaluate, in order, or None for a search that depends on the
    timings (the cover stage, optuna's TPE)."""

    def __init__(self, env: Environment, config: TuneConfig) -> None:
        super().__init__(None, env, config, timer=_no_timer)   # type: ignore[arg-type]
        self._picked: list[tuple[VariantBase, int]] = []

    def plan(self, family: KernelFamily, problem: ProblemBase, stage: str
             ) -> tuple[WorkloadSummary | None, list[tuple[VariantBase, int]] | None]:
        self._picked = []
        try:
            s = self.tune(family, problem, None, stage=stage)
        except _Sequential:
            return None, None
        return s, list(self._picked)

    def _evaluate(self, family: KernelFamily, problem: ProblemBase, v: VariantBase, idx: int,
                  s: WorkloadSummary) -> float | None:
        if s.search in ("optuna", "cover"):
            raise _Sequential(s.search)
        self._picked.append((v, idx))
        return None


class _StudyStore:
    """The tuner's ResultStore in a distributed run: the host's TuningDB, plus the study's
    registry. `find` answers from the local database, else from what any process reported
    (so nothing is timed twice); a local answer the study does not know yet is reported (an
    earlier run's rows on this host serve the other hosts too). `record` writes locally and
    reports every final outcome. A local "started, never finished" marker does not count: the
    study decides what is tried again (its heartbeat and retry)."""

    def __init__(self, local: Any, coord: Coordinator) -> None:
        self.local = local
        self.coord = coord

    def find(self, problem: ProblemBase, variant: VariantBase, fingerprint: str,
             environment: Environment) -> Mapping[str, Any] | None:
        fam = type(variant).FAMILY
        row = self.local.find(problem, variant, fingerprint, environment)
        if row is not None and row.get("error") != UNFINISHED:
            if row.get("error") != INTERRUPTED and row.get("status") in Status.ALL and \
                    self.coord.lookup(fam, problem.digest(), variant.key(), fingerprint) is None:
                self._share(problem, variant, fingerprint, row)
            return row
        k = self.coord.lookup(fam, problem.digest(), variant.key(), fingerprint)
        if k is None:
            return None
        return {"status": k.status, "median_us": k.median_us, "error": None,
                "created": k.created}

    def _share(self, problem: ProblemBase, variant: VariantBase, fp: str,
               row: Mapping[str, Any]) -> None:
        try:
            med = row.get("median_us") if row["status"] == Status.OK else None
            rec = ResultRecord(problem=problem, variant=variant, environment=self.coord.env,
                               fingerprint=fp, status=row["status"],
                               space_index=int(row["space_index"]), median_us=med)
            self.coord.report(rec, created=str(row.get("created") or "") or None)
        except Exception as e:        # an odd local row is simply not shared
            log.debug("not sharing a local row: %s", e)

    def record(self, rec: ResultRecord, *, replace: bool = False) -> bool:
        ok = self.local.record(rec, replace=replace)
        if rec.error not in (UNFINISHED, INTERRUPTED):
            self.coord.report(rec)
        return ok

    def timed_rows(self, problem: ProblemBase, environment: Environment) -> list:
        fetch = getattr(self.local, "timed_rows", None)
        return list(fetch(problem, environment)) if fetch is not None else []

    def close(self) -> None:
        close = getattr(self.local, "close", None)
        if close is not None:
            close()


class _ItemTuner(Tuner):
    """The tuner of one process of a distributed run: `_evaluate` goes through the study
    (a fixed candidate is claimed as its variant trial first; a search's variant in flight is
    marked on the workload trial, and one that was in flight in two failed attempts is given
    up)."""

    def __init__(self, store: _StudyStore, env: Environment, config: TuneConfig,
                 timer: Timer, coord: Coordinator) -> None:
        super().__init__(store, env, config, timer)
        self.coord = coord
        self.item: Item | None = None
        self.open: dict[str, list[int]] | None = None
        self._direct = False

    def compiled_digests(self) -> set[str]:
        return {sha256_json([k[0], k[1], k[2]])[:16] for k in self._compiled}

    def fingerprint(self, family: KernelFamily, problem: ProblemBase, v: VariantBase) -> str:
        return self._fingerprint(family, problem, v)

    def evaluate_direct(self, family: KernelFamily, problem: ProblemBase, v: VariantBase,
                        idx: int, s: WorkloadSummary) -> float | None:
        """One evaluation outside a workload search (another process's variant trial)."""
        self._direct = True
        try:
            return super()._evaluate(family, problem, v, idx, s)
        finally:
            self._direct = False

    def _evaluate(self, family: KernelFamily, problem: ProblemBase, v: VariantBase, idx: int,
                  s: WorkloadSummary) -> float | None:
        if self._direct:
            return super()._evaluate(family, problem, v, idx, s)
        if self.open is not None:
            tids = self.open.get(v.key())
            if tids is None:
                log.warning("%s: %s is not among the enqueued candidates", problem.key(),
                            v.name())
                return super()._evaluate(family, problem, v, idx, s)
            state, tid = self.coord.take_variant(tids)
            if state == "done":
                s.resumed += 1
                return self.coord.variant_value(tid)
            if state != "mine":
                return None                        # in flight elsewhere, or given up
            try:
                med = super()._evaluate(family, problem, v, idx, s)
            except _device.DeviceLost:
                self.coord.finish(tid, None)       # its outcome is recorded and reported
                raise
            except BaseException:
                self.coord.release(tid)
                raise
            self.coord.finish(tid, med)
            return med
        if self.coord.struck(self.item, v.key()):
            s.run_failed += 1
            log.warning("%s: %s was in flight in two failed attempts of this search: given "
                        "up", problem.key(), v.name())
            return None
        if self.item is not None:
            self.coord.mark_inflight(self.item, v.key())
        try:
            return super()._evaluate(family, problem, v, idx, s)
        finally:
            if self.item is not None:
                self.coord.mark_inflight(self.item, None)


def workload_trials(jobs: Sequence[Job], config: TuneConfig) -> list[dict[str, Any]]:
    """The workload trials of a run: one per job and stage (stages_of), each with its problem
    digest, the fingerprint of the family's default variant (a template change makes new
    trials) and its compile class (claiming prefers a class the process has compiled)."""
    fp_memo: dict = {}
    out = []
    for j in jobs:
        fam, p = j.resolve()
        try:
            fp = memo_fingerprint(fp_memo, fam, fam.default(p, config.arch), p, config.arch)
        except Exception:
            fp = ""
        cls = sha256_json([compile_class(fam, p, config.arch)])[:16]
        for stage in stages_of(config):
            out.append({"stage": stage, "family": j.family, "problem": j.problem_key,
                        "wl": p.digest(), "fp": fp, "cls": cls})
    return out


def _mono(deadline: float | None) -> float | None:
    return None if deadline is None else time.monotonic() + (deadline - time.time())


def _work(coord: Coordinator, store: _StudyStore, env: Environment, config: TuneConfig,
          jobs: Sequence[Job], deadline: float | None, emit: Callable[[str, Any], None],
          timer: Timer) -> None:
    """One process's loop: claim, run, finish, until nothing is left (or the budget ends)."""
    tuner = _ItemTuner(store, env, config, timer, coord)
    planner = _Planner(env, config)
    mine = {(j.family, j.problem_key) for j in jobs}
    classes: collections.deque[str] = collections.deque(maxlen=8)
    while True:
        item = coord.claim(mine, compiled=tuner.compiled_digests(), classes=list(classes),
                           deadline=deadline)
        if item is None:
            return
        if item.kind == "workload":
            classes.appendleft(str(item.ident.get("cls")))
        try:
            job = Job(item.family, item.problem_key)
            fam, problem = job.resolve()
            if item.kind == "workload":
                s, value = _run_workload(coord, tuner, planner, item, fam, problem, deadline)
            else:
                s, value = _run_variant(tuner, item, fam, problem)
        except _device.DeviceLost as e:
            coord.release(item.trial_id)
            emit("lost", f"{item.family} {item.problem_key}: {e}")
            raise
        except (KeyboardInterrupt, Interrupted):
            coord.release(item.trial_id)
            raise
        except Exception as e:                 # a broken family never stops the run
            coord.finish(item.trial_id, None)
            emit("item", WorkloadSummary(family=item.family, problem_key=item.problem_key,
                                         stage=item.stage, error=format_error(e)))
            continue
        finally:
            tuner.item, tuner.open = None, None
        if deadline is not None and time.time() > deadline and item.kind == "workload" and \
                s.stopped_by == "time_budget":
            coord.release(item.trial_id)       # not finished: a later run continues it
        else:
            coord.finish(item.trial_id, value)
        emit("item", s)


def _run_workload(coord: Coordinator, tuner: _ItemTuner, planner: _Planner, item: Item,
                  fam: KernelFamily, problem: ProblemBase, deadline: float | None
                  ) -> tuple[WorkloadSummary, float | None]:
    tuner.item = item
    stage = item.stage
    if stage != "cover":
        plan_s, fixed = planner.plan(fam, problem, stage)
        if fixed is not None and not fixed:
            return plan_s, None                 # no valid variant, space() raised, ...
        if fixed:
            cands = []
            for pos, (v, idx) in enumerate(fixed):
                try:
                    fp = tuner.fingerprint(fam, problem, v)
                except Exception:
                    fp = "render-failed"
                ck = sha256_json([fam.NAME, v.key(), fam.compile_key(v, problem).key()])[:16]
                cands.append({"variant": v.key(), "index": idx, "fp": fp, "ck": ck,
                              "pos": pos})
            tuner.open = coord.open_workload(item, cands)
    s = tuner.tune(fam, problem, _mono(deadline), stage=stage)
    return s, s.winner_us


def _run_variant(tuner: _ItemTuner, item: Item, fam: KernelFamily, problem: ProblemBase
                 ) -> tuple[WorkloadSummary, float | None]:
    v = fam.VARIANT.from_key(str(item.ident["variant"]))
    idx = int(item.ident["index"])
    s = WorkloadSummary(family=fam.NAME, problem_key=problem.key(), stage=item.stage,
                        search="taken")
    t0 = time.monotonic()
    try:
        med = tuner.evaluate_direct(fam, problem, v, idx, s)
    finally:
        if not tuner.config.compile_only:
            _device.release_device_memory(tuner.config.device, collect=True)
    s.indices, s.evaluated, s.seconds = [idx], 1, time.monotonic() - t0
    if med is not None:
        s.winner, s.winner_us = v.name(), med
    return s, med


def _combine(parts: Sequence[WorkloadSummary]) -> WorkloadSummary:
    """Summaries of one workload and stage from several trials (the owner's search and the
    candidates other processes took) as one."""
    first = next((p for p in parts if p.search != "taken"), parts[0])
    out = dataclasses.replace(first, invalid_reasons=dict(first.invalid_reasons),
                              phase_s=dict(first.phase_s), indices=list(first.indices))
    for p in parts:
        if p is first:
            continue
        for k in WorkloadSummary._COUNTS + ("resumed",):
            setattr(out, k, getattr(out, k) + getattr(p, k))
        out.indices += [i for i in p.indices if i not in out.indices]
        for k, v in p.phase_s.items():
            out.phase_s[k] = out.phase_s.get(k, 0.0) + v
        out.seconds += p.seconds
        out.error = out.error or p.error
    out.evaluated = len(out.indices)
    return out


def _final(coord: Coordinator, jobs: Sequence[Job], parts: Sequence[WorkloadSummary],
           config: TuneConfig) -> list[WorkloadSummary]:
    """One summary per job: what this host's processes did, with the winner and the number of
    results that the whole study knows (every host's)."""
    by: dict[tuple[str, str, str], list[WorkloadSummary]] = collections.defaultdict(list)
    for part in parts:
        by[(part.family, part.problem_key, part.stage)].append(part)
    staged = merge_summaries([_combine(v) for v in by.values()])
    mine = {(s.family, s.problem_key): s for s in staged}
    coord.snapshot()                            # the registry, as every host left it
    fp_memo: dict = {}
    out = []
    for j in jobs:
        fam, p = j.resolve()
        s = mine.get((j.family, j.problem_key))
        if s is None:
            s = WorkloadSummary(family=j.family, problem_key=j.problem_key, stage="elsewhere",
                                search="elsewhere")
        timed, known = [], coord.known_for(fam.NAME, p.digest())
        for vkey, k in known:
            if k.status != Status.OK or k.median_us is None:
                continue
            try:
                v = fam.VARIANT.from_key(vkey)
                if memo_fingerprint(fp_memo, fam, v, p, config.arch) != k.fingerprint:
                    continue
            except Exception:
                continue
            timed.append({"median_us": k.median_us, "space_index": k.space_index,
                          "name": v.name()})
        win = pick_winner(timed, config.policy.tie_rel)
        if win is not None:
            s.winner, s.winner_us = str(win["name"]), float(win["median_us"])
        if s.stage == "elsewhere":
            s.resumed = len({vk for vk, _ in known})
        out.append(s)
    return out


def _child(queue_out: Any, cfg: CoordinatorConfig, settings: str, since: str | None,
           store_factory: Callable[[], Any], env: Environment, config: TuneConfig,
           jobs: Sequence[Job], deadline: float | None, modules: Sequence[str],
           log_level: int) -> None:
    _die_with_parent()
    _stop_on_sigterm()
    logging.basicConfig(level=log_level)
    pid = os.getpid()

    def emit(kind: str, obj: Any) -> None:
        queue_out.put((kind, obj, pid))

    coord = None
    try:
        _import_modules(modules)
        coord = Coordinator(cfg, env, settings)
        coord.since = since
        store = _StudyStore(store_factory(), coord)
        try:
            _work(coord, store, env, config, jobs, deadline, emit, _resolve_timer(config,
                                                                                  measure))
        finally:
            store.close()
    except (Interrupted, _device.DeviceLost):
        return
    except BaseException as e:
        queue_out.put(("crash", format_error(e), pid))
        raise
    finally:
        if coord is not None:
            coord.close()
        queue_out.put(("exit", None, pid))


def run_distributed(jobs: Sequence[Job], store_factory: Callable[[], Any], env: Environment,
                    config: TuneConfig, coordinator: CoordinatorConfig, *, workers: int = 1,
                    isolate: bool = False, modules: Sequence[str] = (),
                    on_event: Callable[[str, Any], None] = lambda kind, obj: None,
                    timer: Timer = measure, progress_s: float = 30.0
                    ) -> list[WorkloadSummary]:
    """Tune `jobs` together with every other process of the study (see the module docstring):
    connect (CoordinatorError before anything runs if the coordinator cannot be used),
    publish the jobs' workload trials (once, whoever comes first), then work in this process
    (workers == 1 and not isolate; with `timer`) or in `workers` spawned processes until
    nothing of `jobs` is left. Returns one summary per job (its winner from every host's
    results). Events: ("note", str) progress lines, ("lost", str), ("crash", str), then
    ("done", WorkloadSummary) per job at the end."""
    config = dataclasses.replace(config, seeds=0)
    settings = run_settings(config, file_digest(config.warm_start), coordinator.run_tag)
    coord = Coordinator(coordinator, env, settings)
    parts: list[WorkloadSummary] = []
    mine = {(j.family, j.problem_key) for j in jobs}
    try:
        added = coord.publish(workload_trials(jobs, config))
        since = None
        if not config.resume:
            since = coord.run_created           # the same on every host of this run
            config = dataclasses.replace(config, resume_since=since)
            coord.since = since
        others = coord.live_elsewhere()
        on_event("note", f"coordinator {coord.name} on {redact(coordinator.url)}: "
                         f"{added} workload trials published (run {settings})"
                 + (f"; {others} trials of another run in flight in this environment: "
                    "variants both runs evaluate at once may be timed twice" if others else ""))
        deadline = None if config.time_budget_s is None else time.time() + config.time_budget_s
        if workers <= 1 and not isolate:
            store = _StudyStore(store_factory(), coord)
            try:
                _work(coord, store, env, config, jobs, deadline,
                      lambda k, o: parts.append(o) if k == "item" else on_event(k, o),
                      _resolve_timer(config, timer))
            except KeyboardInterrupt:
                raise TuneInterrupted(_final(coord, jobs, parts, config)) from None
            except _device.DeviceLost as e:
                on_event("crash", f"the device was lost ({e}); run in worker processes to "
                                  "continue past a broken variant")
            finally:
                store.close()
        else:
            _run_processes(coord, settings, since, store_factory, env, config, jobs,
                           deadline, max(1, workers), modules, on_event, parts, mine,
                           progress_s)
        final = _final(coord, jobs, parts, config)
        left = coord.progress(mine)
        waiting = left.get("WAITING", 0) + left.get("RUNNING", 0)
        if waiting:
            on_event("note", f"coordinator: {waiting} trials of this run are not finished "
                             "(time budget); the same command continues them")
    finally:
        coord.close()
    for s in final:
        on_event("done", s)
    return final


def _run_processes(coord: Coordinator, settings: str, since: str | None,
                   store_factory: Callable[[], Any], env: Environment, config: TuneConfig,
                   jobs: Sequence[Job], deadline: float | None, workers: int,
                   modules: Sequence[str], on_event: Callable[[str, Any], None],
                   parts: list[WorkloadSummary], mine: set, progress_s: float) -> None:
    import multiprocessing as mp
    import queue as _q

    if workers > 1 and config.gpu_lock is None and not config.compile_only:
        raise ValueError("several tuner processes on one GPU need config.gpu_lock")
    ctx = mp.get_context("spawn")
    q_out = ctx.Queue()
    args = (q_out, coord.cfg, settings, since, store_factory, env, config, list(jobs),
            deadline, list(modules), logging.getLogger().level)

    def spawn() -> Any:
        p = ctx.Process(target=_child, args=args, daemon=True)
        p.start()
        return p

    procs: dict[int, Any] = {}
    exited: set[int] = set()
    respawns, grace = 0, config.hard_stop_grace_s
    last_note = time.monotonic()
    try:
        procs.update((p.pid, p) for p in (spawn() for _ in range(workers)))
        while len(exited) < len(procs):
            try:
                kind, obj, pid = q_out.get(timeout=1.0)
            except _q.Empty:
                kind = None
                for pid, p in list(procs.items()):
                    if pid in exited or p.is_alive():
                        continue
                    exited.add(pid)          # died without a word: its trial goes stale
                    on_event("lost", f"tuner process {pid} died (exit code {p.exitcode}); "
                                     "its trial is re-queued by the coordinator")
                    if respawns < 4 * workers:
                        respawns += 1
                        q = spawn()
                        procs[q.pid] = q
            if deadline is not None and time.time() > deadline + grace:
                for p in procs.values():
                    if p.is_alive():
                        p.kill()
                on_event("crash", f"hard stop {grace:.0f} s after the time budget: killed the "
                                  "tuner processes still running (their trials go stale and "
                                  "are re-queued); every finished result is stored")
                break
            if time.monotonic() - last_note > progress_s:
                last_note = time.monotonic()
                c = coord.progress(mine)
                on_event("note", "coordinator: " + ", ".join(
                    f"{n.lower()} {c.get(n, 0)}" for n in ("COMPLETE", "RUNNING", "WAITING",
                                                            "FAIL")))
            if kind is None:
                continue
            if kind == "exit":
                exited.add(pid)
            elif kind == "item":
                parts.append(obj)
            elif kind == "lost":
                on_event(kind, obj)
                if respawns < 4 * workers:
                    respawns += 1
                    q = spawn()
                    procs[q.pid] = q
            else:
                on_event(kind, obj)
    except KeyboardInterrupt:
        _stop_workers(procs, (q_out,))
        raise TuneInterrupted(_final(coord, jobs, parts, config)) from None
    for p in procs.values():
        p.join(timeout=10)
