"""Running many workloads: the tuner (resgen.search.tuner, which tunes one workload) in this
process or in spawned worker processes that take turns on the GPU.

Parallelism: CuTe DSL compiled functions cannot leave the process that compiled them
(cute.compile forces no_cache), so `run_jobs(workers=N)` starts N processes that each compile
on their own core, and hold an exclusive file lock on the GPU while they prepare, check and
time (resgen.search.device): compile work overlaps, GPU work never does. Workloads are
grouped by compile class (the family and the compile key of its default variant: all M
buckets of a shape, or every shape of a family whose kernels take N and K at run time), so
one process compiles a class once; large classes are cut into chunks to keep every process
busy, biggest first.

A process whose CUDA context a variant broke hands its remaining workloads back and is
replaced; so is one that dies outright. A family that keeps failing is switched off for the
rest of the run (_FamilyBreaker).

Ctrl-C: worker processes ignore SIGINT (the parent decides); on KeyboardInterrupt the parent
stops them (SIGTERM: a variant in flight is stored as interrupted, which resume re-tries),
drops what the queues still hold and raises TuneInterrupted with the summaries so far.
"""

from __future__ import annotations

import collections
import importlib
import logging
import os
import signal
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from . import device as _device
from .build import format_error
from .buckets import without_buckets
from .family import KernelFamily, get_family
from .record import Environment
from .timing import measure
from .tuner import (Interrupted, Timer, TuneConfig, Tuner, WorkloadSummary, compile_class,
                    merge_summaries, stages_of)
from .variant import ProblemBase, canonical_json

__all__ = ["Job", "run_jobs", "plan_groups", "workload_share", "TuneInterrupted"]

log = logging.getLogger("resgen.tuner")


class TuneInterrupted(Exception):
    """Ctrl-C during run_jobs: the workers are stopped; `summaries` are the workloads that
    finished (every finished result is stored)."""

    def __init__(self, summaries: list[WorkloadSummary]) -> None:
        super().__init__("interrupted")
        self.summaries = summaries


@dataclass(frozen=True)
class Job:
    """One workload, in picklable form."""

    family: str
    problem_key: str

    def resolve(self) -> tuple[KernelFamily, ProblemBase]:
        fam = get_family(self.family)
        return fam, fam.PROBLEM.from_key(self.problem_key)


def plan_groups(jobs: Sequence[Job], arch: str, workers: int = 1) -> list[list[Job]]:
    """Jobs grouped by compile class (compile_class); with several workers, a class larger
    than max(the largest set of bucket siblings, jobs / (4 x workers)) is cut into
    consecutive chunks of that size so every process has work. Order: families in the order
    they first appear in `jobs` (the caller's priority: a stage covers the first family's
    workloads first), then biggest groups first, so a long group never starts last."""
    classes: dict[str, list[Job]] = {}
    sub: collections.Counter[str] = collections.Counter()
    for j in jobs:
        fam, p = j.resolve()
        classes.setdefault(compile_class(fam, p, arch), []).append(j)
        sub[canonical_json([j.family, without_buckets(p)])] += 1
    per_chunk = (len(jobs) if workers <= 1 else
                 max([-(-len(jobs) // (4 * workers))] + list(sub.values())))
    groups: list[list[Job]] = []
    for members in classes.values():
        groups += [members[i:i + per_chunk] for i in range(0, len(members), per_chunk)]
    rank = {f: i for i, f in enumerate(dict.fromkeys(j.family for j in jobs))}
    return sorted(groups, key=lambda g: (rank[g[0].family], -len(g)))



def _import_modules(mods: Sequence[str]) -> None:
    for m in mods:
        importlib.import_module(m)


def _resolve_timer(config: TuneConfig, default: Timer) -> Timer:
    """config.timer ("module:function", picklable into worker processes) or `default`."""
    if config.timer is None:
        return default
    mod, _, name = config.timer.partition(":")
    fn = getattr(importlib.import_module(mod), name, None)
    if not callable(fn):
        raise ValueError(f"timer {config.timer!r} is not a callable")
    return fn



Item = tuple[str, list[Job]]          # (stage, jobs) as queued


def workload_share(stage: str, left_s: float, workers: int, left_workloads: int) -> float:
    """Seconds one workload may search, given `left_s` seconds of the run's budget and
    `left_workloads` workloads of `stage` not yet started (this one included) over `workers`
    processes: the cover stage may use the whole rest (one variant each), the refine stage
    its fair share, never past the run's budget (the last few workloads of a run would
    otherwise get workers x the time left and keep searching until the hard stop)."""
    left_s = max(left_s, 0.0)
    if stage == "cover":
        return left_s
    return min(left_s * workers / max(left_workloads, 1), left_s)


def _run_groups(next_item: Callable[[], Item | None], store_factory: Callable[[], Any],
                env: Environment, config: TuneConfig, deadline: float | None,
                remaining: Callable[[str, int], int], workers: int,
                emit: Callable[[str, Any], None], requeue: Callable[[Item], None],
                timer: Timer = measure,
                disabled: Callable[[str], bool] = lambda family: False) -> None:
    store = store_factory()
    try:
        tuner = Tuner(store, env, config, timer)
        while True:
            item = next_item()
            if item is None:
                return
            stage, group = item
            for i, job in enumerate(group):
                left = remaining(stage, -1) + 1   # this stage's workloads not yet started
                wl_deadline = None
                if deadline is not None:
                    wl_deadline = time.monotonic() + workload_share(
                        stage, deadline - time.time(), workers, left)
                emit("start", job)
                if disabled(job.family):
                    emit("done", WorkloadSummary(
                        family=job.family, problem_key=job.problem_key, stage=stage,
                        search="skipped", error="family disabled for the rest of the run "
                        "(it kept failing; see the run's 'disabled' events)"))
                    continue
                try:
                    fam, problem = job.resolve()
                    summary = tuner.tune(fam, problem, wl_deadline, stage=stage)
                except _device.DeviceLost as e:
                    remaining(stage, len(group) - i)
                    requeue((stage, group[i:]))      # resume skips what is already stored
                    emit("lost", f"{job.family} {job.problem_key}: {e}")
                    return
                except Exception as e:              # a broken family never stops the run
                    summary = WorkloadSummary(family=job.family, problem_key=job.problem_key,
                                              stage=stage, error=format_error(e))
                emit("done", summary)
    finally:
        close = getattr(store, "close", None)
        if close is not None:
            close()


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent dies, so a killed `resgen tune` leaves no
    worker holding the GPU (daemon processes are only reaped on a clean parent exit)."""
    try:
        import ctypes
        import signal

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, int(signal.SIGKILL))          # PR_SET_PDEATHSIG
    except Exception:
        pass


def _child(queue_in: Any, queue_out: Any, counter: Any, pending: Any, banned: Any,
           store_factory: Callable[[], Any], env: Environment, config: TuneConfig,
           deadline: float | None, workers: int, modules: Sequence[str],
           log_level: int) -> None:
    _die_with_parent()
    _stop_on_sigterm()
    logging.basicConfig(level=log_level)
    try:
        _import_modules(modules)
        stages = stages_of(config)

        def remaining(stage: str, delta: int) -> int:
            i = stages.index(stage)
            with counter.get_lock():
                counter[i] += delta
                return counter[i]

        pid = os.getpid()

        def emit(kind: str, obj: Any) -> None:
            queue_out.put((kind, obj, pid))

        def next_item() -> Item | None:
            # `pending` counts items put and not yet claimed: a claimed item is in (or on
            # its way into) the queue, so the blocking get cannot wait forever.
            with pending.get_lock():
                if pending.value <= 0:
                    return None
                pending.value -= 1
            item = queue_in.get()
            emit("claim", item)             # the parent re-queues it if this process dies
            return item

        def requeue(item: Item) -> None:
            with pending.get_lock():
                pending.value += 1
            queue_in.put(item)
            queue_in.close()
            queue_in.join_thread()      # flushed before this process reports the loss

        def disabled(family: str) -> bool:
            with banned.get_lock():
                names = banned.value.decode()
            return family in names.split(",")

        _run_groups(next_item, store_factory, env, config, deadline, remaining, workers,
                    emit, requeue, _resolve_timer(config, measure), disabled)
    except Interrupted:
        return                              # stopped by the parent (Ctrl-C): nothing to say
    except BaseException as e:
        queue_out.put(("crash", format_error(e), os.getpid()))
        raise
    finally:
        queue_out.put(("exit", None, os.getpid()))


def _stop_on_sigterm() -> None:
    """Worker processes: Ctrl-C reaches the whole process group; the parent alone decides
    (SIGINT ignored) and stops the workers with SIGTERM, raised here as Interrupted so the
    variant in flight is stored as interrupted (resume re-tries it)."""
    def stop(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)     # once
        raise Interrupted()

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, stop)


class _FamilyBreaker:
    """Switches off a family for the rest of a run after TuneConfig.max_family_losses lost
    processes or max_family_failures workloads in a row without a timed winner (workloads
    with no valid variant, or skipped past the budget, do not count)."""

    def __init__(self, config: TuneConfig, on_disable: Callable[[list[str], str], None]):
        self.config = config
        self.on_disable = on_disable
        self.losses: collections.Counter[str] = collections.Counter()
        self.streak: collections.Counter[str] = collections.Counter()
        self.off: list[str] = []

    def _disable(self, family: str, why: str) -> None:
        if family not in self.off:
            self.off.append(family)
            self.on_disable(list(self.off), f"family {family} disabled for the rest of the "
                                            f"run: {why}")

    def lost(self, family: str | None) -> None:
        if family is None:
            return
        self.losses[family] += 1
        if self.losses[family] >= self.config.max_family_losses:
            self._disable(family, f"its variants broke the CUDA context or killed a tuner "
                                  f"process {self.losses[family]} times")

    def done(self, s: WorkloadSummary) -> None:
        if self.config.compile_only or s.search == "skipped" or \
                (s.error or "").startswith("no valid"):
            return
        if s.winner is not None:
            self.streak[s.family] = 0
            return
        self.streak[s.family] += 1
        if self.streak[s.family] >= self.config.max_family_failures:
            self._disable(s.family, f"{self.streak[s.family]} workloads in a row without "
                                    "a timed winner (every candidate failed to compile, "
                                    "check or run)")


def run_jobs(jobs: Sequence[Job], store_factory: Callable[[], Any], env: Environment,
             config: TuneConfig, *, workers: int = 1, isolate: bool = False,
             modules: Sequence[str] = (),
             on_event: Callable[[str, Any], None] = lambda kind, obj: None,
             timer: Timer = measure) -> list[WorkloadSummary]:
    """Tune every job; `store_factory` (picklable, e.g. functools.partial(TuningDB, path))
    opens the result store in each process. Returns one summary per workload (its stages
    merged, see merge_summaries).

    Work items are (stage, group) pairs: every group (plan_groups) of the first stage, then
    every group of the next (stages_of). workers == 1 and not isolate: in this process (with
    `timer`; tests use this). Otherwise in `workers` spawned processes (each with the real
    timer) that import `modules` first (where families outside resgen register themselves); a
    process whose CUDA context a variant broke hands its remaining workloads back and is
    replaced; so is one that dies outright (its claimed workloads are re-queued). With a time
    budget, processes still running `grace` seconds after it (a hung kernel) are killed.
    Events: ("start", Job), ("done", WorkloadSummary of one stage), ("lost", str),
    ("disabled", str: a family switched off, see _FamilyBreaker), ("crash", str).
    """
    workers = max(1, int(workers))
    groups = plan_groups(jobs, config.arch, workers)
    stages = stages_of(config)
    items: list[Item] = [(st, g) for st in stages for g in groups]
    deadline = None if config.time_budget_s is None else time.time() + config.time_budget_s
    summaries: list[WorkloadSummary] = []
    off: list[str] = []                       # this process's view (single-process runs)
    publish: list[Callable[[list[str]], None]] = [lambda names: None]

    def on_disable(names: list[str], why: str) -> None:
        off[:] = names
        publish[0](names)
        on_event("disabled", why)

    breaker = _FamilyBreaker(config, on_disable)

    def emit(kind: str, obj: Any) -> None:
        if kind == "done":
            summaries.append(obj)
            on_event(kind, obj)
            breaker.done(obj)
            return
        on_event(kind, obj)

    workers = min(workers, len(groups) or 1)
    if workers > 1 and config.gpu_lock is None and not config.compile_only:
        raise ValueError("several tuner processes on one GPU need config.gpu_lock")
    if workers == 1 and not isolate:
        it = iter(items)
        left = {st: len(jobs) for st in stages}

        def remaining(stage: str, delta: int) -> int:
            left[stage] += delta
            return left[stage]

        def lost(item: Item) -> None:
            emit("crash", f"the device was lost; {len(item[1])} workloads not tuned (run in "
                          "worker processes to continue past a broken variant)")

        try:
            _run_groups(lambda: next(it, None), store_factory, env, config, deadline,
                        remaining, 1, emit, lost, _resolve_timer(config, timer),
                        lambda f: f in off)
        except KeyboardInterrupt:
            raise TuneInterrupted(merge_summaries(summaries)) from None
        return merge_summaries(summaries)

    import multiprocessing as mp
    import queue as _q

    ctx = mp.get_context("spawn")           # never fork a process that may hold a CUDA context
    q_in, q_out = ctx.Queue(), ctx.Queue()
    for item in items:
        q_in.put(item)
    counter = ctx.Array("i", [len(jobs)] * len(stages))
    pending = ctx.Value("i", len(items))
    banned = ctx.Array("c", 4096)             # comma-separated names of disabled families

    def publish_banned(names: list[str]) -> None:
        with banned.get_lock():
            banned.value = ",".join(names).encode()[:4095]

    publish[0] = publish_banned
    args = (q_in, q_out, counter, pending, banned, store_factory, env, config, deadline,
            workers, list(modules), logging.getLogger().level)

    def spawn():
        p = ctx.Process(target=_child, args=args, daemon=True)
        p.start()
        return p

    procs: dict[int, Any] = {}
    try:
        procs.update((p.pid, p) for p in (spawn() for _ in range(workers)))
        claimed: dict[int, Item] = {}        # per process: its claimed item, jobs not yet done
        exited: set[int] = set()
        respawns = 0
        grace = config.hard_stop_grace_s

        def replace(pid: int, why: str, family: str | None = None) -> None:
            nonlocal respawns
            emit("lost", why)
            breaker.lost(family)
            if respawns < 4 * workers:
                respawns += 1
                p = spawn()
                procs[p.pid] = p

        while len(exited) < len(procs):
            try:
                kind, obj, pid = q_out.get(timeout=1.0)
            except _q.Empty:
                # The pipe is empty, so every message of a process that exited normally has been
                # read: a dead process not marked exited died abruptly.
                for pid, p in list(procs.items()):
                    if pid in exited or p.is_alive():
                        continue
                    # Died without saying so (SIGKILL, segfault): put back what it had claimed
                    # (its variant in flight is stored as "never finished", so resume skips it).
                    exited.add(pid)
                    stage, rest = claimed.pop(pid, ("", []))
                    if rest:
                        with pending.get_lock():
                            pending.value += 1
                        q_in.put((stage, rest))
                    replace(pid, f"tuner process {pid} died (exit code {p.exitcode}) during "
                                 f"{rest[0].problem_key if rest else 'no workload'}",
                            rest[0].family if rest else None)
                kind = None
            if deadline is not None and time.time() > deadline + grace:
                busy = []                 # what each killed process had claimed and not finished
                for pid, p in procs.items():
                    if p.is_alive():
                        p.kill()
                        rest = claimed.get(pid, ("", []))[1]
                        if rest:
                            busy.append(f"{rest[0].family} {rest[0].problem_key}")
                emit("crash", f"hard stop {grace:.0f} s after the time budget: killed the tuner "
                              "processes still running (a hung kernel?"
                              + (f" in flight: {'; '.join(busy)}" if busy else "")
                              + "); every finished result is stored")
                break
            if kind is None:
                continue
            if kind == "exit":
                exited.add(pid)
            elif kind == "claim":
                claimed[pid] = (obj[0], list(obj[1]))
            elif kind == "done":
                stage, rest = claimed.get(pid, ("", []))
                claimed[pid] = (stage, [j for j in rest if (j.family, j.problem_key) !=
                                        (obj.family, obj.problem_key)])
                emit(kind, obj)
            elif kind == "lost":
                _, rest = claimed.pop(pid, ("", []))    # the process re-queued its own work
                replace(pid, obj, rest[0].family if rest else str(obj).split(" ", 1)[0])
            else:
                emit(kind, obj)
        if pending.value > 0:
            emit("crash", f"{pending.value} work item(s) left untuned (too many broken "
                          "processes)")
    except KeyboardInterrupt:
        _stop_workers(procs, (q_in, q_out))
        raise TuneInterrupted(merge_summaries(summaries)) from None
    for p in procs.values():
        p.join(timeout=10)
    return merge_summaries(summaries)


def _stop_workers(procs: dict[int, Any], queues: Sequence[Any], grace_s: float = 5.0) -> None:
    """After Ctrl-C: SIGTERM every worker (it stores its variant in flight as interrupted),
    SIGKILL those still alive `grace_s` later, and drop what the queues hold (their feeder
    threads would otherwise block this process's exit writing to dead workers). A second
    Ctrl-C meanwhile is ignored."""
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        for p in procs.values():
            if p.is_alive():
                p.terminate()
        end = time.monotonic() + grace_s
        for p in procs.values():
            p.join(timeout=max(0.0, end - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(timeout=2)
        for q in queues:
            q.cancel_join_thread()
            q.close()
    finally:
        signal.signal(signal.SIGINT, old)
