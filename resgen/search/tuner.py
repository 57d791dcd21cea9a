"""The tuner: for each (family, problem) on an arch, find the fastest correct variant.

Per workload: enumerate `family.space` (fixed order), drop what `why_invalid` rejects (reasons
logged and counted), then evaluate candidates: render + compile (once per compile key: every
M bucket that shares one reuses it; failures, registers and spills recorded, never fatal),
`runner.check()` against the reference (must pass before timing), time under the measurement
policy, and store every outcome as its own row through a ResultStore (the dispatch database;
this layer does not import it). Small spaces are searched exhaustively (the family default
first, then space order); large ones with optuna's TPE sampler, seeded per workload, asked and
told one trial at a time, so a run is reproducible given the same timings. A compile-only
pre-flight of a space larger than the budget compiles the default plus variants spread evenly
over the space order (deterministic, every axis exercised). Budgets:
`max_variants` per workload and `time_budget_s` for the whole run (shared fairly: each
workload may use the remaining time divided by the workloads left; every workload gets at least
one variant). Resume: a (workload, variant, fingerprint, environment) already stored is not
re-timed; its stored median takes part in the search.

Parallelism: CuTe DSL compiled functions cannot leave the process that compiled them
(cute.compile forces no_cache), so `run_jobs(workers=N)` starts N processes that each compile
on their own core, and hold an exclusive file lock on the GPU while they check and time: compile
work overlaps, GPU work never does. Workloads that share a compile key (all M buckets of a
shape) go to the same process.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import importlib
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Protocol, Sequence

from .build import CompileOutcome, compile_variant, format_error, variant_fingerprint
from .buckets import without_buckets
from .family import KernelFamily, get_family
from .record import Environment, ResultRecord, Status, pick_winner
from .timing import DEFAULT_POLICY, MeasurementPolicy, Timing, measure
from .variant import ProblemBase, VariantBase, canonical_json, _to_jsonable

__all__ = ["TuneConfig", "ResultStore", "WorkloadSummary", "Tuner", "Job", "run_jobs",
           "working_set_bytes", "gpu_lock", "DeviceLost"]

log = logging.getLogger("resgen.tuner")


class ResultStore(Protocol):
    """What the tuner needs from the dispatch database (resgen.db.TuningDB implements it)."""

    def find(self, problem: ProblemBase, variant: VariantBase, fingerprint: str,
             environment: Environment) -> Mapping[str, Any] | None: ...

    def record(self, rec: ResultRecord, *, replace: bool = False) -> bool: ...


@dataclass
class TuneConfig:
    arch: str = "sm_90a"
    policy: MeasurementPolicy = DEFAULT_POLICY
    max_variants: int = 16                 # evaluated per workload (timed, or compiled)
    time_budget_s: float | None = None     # whole run
    resume: bool = True                    # skip stored (workload, variant, fp, env) rows
    compile_only: bool = False
    seed: int = 0
    device: str = "cuda"
    gpu_lock: str | None = None            # lock file held around check + time
    timer: str | None = None               # "module:function" replacing timing.measure
    hard_stop_grace_s: float = 60.0        # kill processes this long past the time budget

    def __post_init__(self) -> None:
        if self.max_variants < 1:
            raise ValueError("max_variants must be >= 1")
        if self.time_budget_s is not None and self.time_budget_s <= 0:
            raise ValueError("time_budget_s must be positive")


@dataclass
class WorkloadSummary:
    family: str
    problem_key: str
    search: str = "exhaustive"
    space: int = 0
    invalid: int = 0
    invalid_reasons: dict[str, int] = field(default_factory=dict)
    evaluated: int = 0
    resumed: int = 0
    compiled: int = 0
    compile_failed: int = 0
    check_failed: int = 0
    run_failed: int = 0
    timed: int = 0
    winner: str | None = None
    winner_us: float | None = None
    default_us: float | None = None
    seconds: float = 0.0
    stopped_by: str | None = None          # "max_variants" | "time_budget" | None
    error: str | None = None               # the workload itself failed (e.g. space() raised)


def working_set_bytes(family: KernelFamily, variant: VariantBase, problem: ProblemBase) -> int:
    """Bytes one input set occupies (sizes the cold-L2 rotation). A family may define
    `working_set_bytes(variant, problem)`; otherwise estimated from the problem type."""
    hook = getattr(family, "working_set_bytes", None)
    if hook is not None:
        return int(hook(variant, problem))
    d = problem.as_dict()
    if type(problem).OP == "linear":
        from ..formats import block_size

        fmt, k, n, m = d["fmt"], d["k"], d["n"], d["m"]
        kw = problem.k_ext(block_size(fmt)) if hasattr(problem, "k_ext") else k
        per_weight = 0.5 + (1 / 16 if fmt == "nvfp4" else 1 / 32)
        rows = 2 * m if d.get("compensation") == "full" else m
        return int(n * kw * per_weight + rows * kw * 2 + m * k * 2 + m * n * 2)
    if type(problem).OP == "decode_attention":
        kv = d["batch"] * d["kv_len"] * d["kv_heads"] * d["head_dim"] * 2 * (0.5 + 1 / 16)
        return int(kv + d["batch"] * d["q_heads"] * d["head_dim"] * 4)
    if isinstance(d.get("m"), int) and isinstance(d.get("k"), int):
        # An activation-shaped problem (e.g. the quantizer): bf16 input plus up to twice its
        # size written (base + residue operand rows).
        return 6 * d["m"] * d["k"]
    return 0


@contextlib.contextmanager
def gpu_lock(path: str | None) -> Iterator[None]:
    """Exclusive advisory lock on `path` (no-op for None): one process on the GPU at a time."""
    if path is None:
        yield
        return
    import fcntl

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


Timer = Callable[[Any, MeasurementPolicy, int], Timing]


class Tuner:
    """Tunes workloads one at a time in this process; see the module docstring."""

    def __init__(self, store: ResultStore, environment: Environment, config: TuneConfig,
                 timer: Timer = measure) -> None:
        if environment.compile_only != config.compile_only:
            raise ValueError("a compile-only run needs a compile-only environment and back")
        self.store = store
        self.env = environment
        self.config = config
        self.timer = timer
        self._compiled: dict[tuple[str, str, str, str], CompileOutcome] = {}

    def clear_compile_cache(self) -> None:
        self._compiled.clear()

    # -- one workload --------------------------------------------------------------------------
    def tune(self, family: KernelFamily, problem: ProblemBase,
             deadline: float | None = None) -> WorkloadSummary:
        """Tune one workload; `deadline` (time.monotonic()) stops starting new variants."""
        t0 = time.monotonic()
        s = WorkloadSummary(family=family.NAME, problem_key=problem.key())
        arch = self.config.arch
        try:
            space = list(family.space(problem, arch))
        except Exception as e:
            s.error = "space() raised: " + format_error(e)
            log.error("%s %s: %s", family.NAME, problem.key(), s.error)
            return s
        s.space = len(space)
        index: dict[str, int] = {}
        valid: list[VariantBase] = []
        reasons: collections.Counter[str] = collections.Counter()
        for i, v in enumerate(space):
            if v.key() in index:
                continue                    # a duplicate in the space: the first one counts
            index[v.key()] = i
            try:
                why = family.why_invalid(v, problem, arch)
            except Exception as e:
                why = f"why_invalid raised {type(e).__name__}: {e}"
            if why is None:
                valid.append(v)
            else:
                reasons[str(why)] += 1
                log.debug("%s invalid for %s: %s", v.name(), problem.key(), why)
        s.invalid = len(space) - len(valid)
        s.invalid_reasons = dict(reasons.most_common(8))
        if not valid:
            s.error = "no valid variant in the space"
            log.warning("%s %s: no valid variant (%s)", family.NAME, problem.key(),
                        s.invalid_reasons)
            return s

        default = None
        try:
            d = family.default(problem, arch)
            if d.key() in index and family.why_invalid(d, problem, arch) is None:
                default = d
        except Exception as e:
            log.warning("%s.default() raised for %s: %s", family.NAME, problem.key(), e)

        results: dict[str, float | None] = {}

        def evaluate(v: VariantBase) -> float | None:
            med = self._evaluate(family, problem, v, index[v.key()], s)
            results[v.key()] = med
            return med

        budget = self.config.max_variants
        out_of_time = (lambda: deadline is not None and time.monotonic() > deadline)
        if self.config.compile_only or len(valid) <= budget:
            rest = [v for v in valid if default is None or v.key() != default.key()]
            s.search = "exhaustive"
            if len(valid) > budget:
                # Compile-only pre-flight of a large space: the default plus variants spread
                # evenly over the fixed order, so every axis value gets compiled somewhere.
                s.search = "spread"
                n = budget - (default is not None)
                rest = [rest[(i * len(rest)) // n] for i in range(n)] if n > 0 else []
            order = ([default] if default is not None else []) + rest
            for v in order:
                if len(results) >= budget:
                    s.stopped_by = "max_variants"
                    break
                if results and out_of_time():
                    s.stopped_by = "time_budget"
                    break
                evaluate(v)
        else:
            s.search = "optuna"
            s.stopped_by = _optuna_search(valid, default, evaluate, budget, out_of_time,
                                          self._seed(family, problem))
        if default is not None:
            s.default_us = results.get(default.key())
        timed = [{"median_us": m, "space_index": index[k], "key": k}
                 for k, m in results.items() if m is not None]
        win = pick_winner(timed, self.config.policy.tie_rel)
        if win is not None:
            wv = next(v for v in valid if v.key() == win["key"])
            s.winner, s.winner_us = wv.name(), float(win["median_us"])
        s.evaluated = len(results)
        s.seconds = time.monotonic() - t0
        return s

    def _seed(self, family: KernelFamily, problem: ProblemBase) -> int:
        from .variant import sha256_json

        return int(sha256_json([self.config.seed, family.NAME, problem.key()])[:8], 16)

    # -- one variant ------------------------------------------------------------------------------
    def _compile(self, family: KernelFamily, problem: ProblemBase, v: VariantBase
                 ) -> CompileOutcome:
        ck = family.compile_key(v, problem)
        key = (family.NAME, v.key(), ck.key(), self.config.arch)
        out = self._compiled.get(key)
        if out is None:
            out = compile_variant(family, v, problem, self.config.arch)
            self._compiled[key] = out
        return out

    def _fingerprint(self, family: KernelFamily, problem: ProblemBase, v: VariantBase) -> str:
        ck = family.compile_key(v, problem)
        out = self._compiled.get((family.NAME, v.key(), ck.key(), self.config.arch))
        if out is not None and out.fingerprint:
            return out.fingerprint
        return variant_fingerprint(family, v, problem, self.config.arch)

    def _record(self, problem: ProblemBase, v: VariantBase, fp: str, idx: int, status: str,
                replace: bool = False, **kw: Any) -> None:
        rec = ResultRecord(problem=problem, variant=v, environment=self.env, fingerprint=fp,
                           status=status, space_index=idx, policy=self.config.policy.as_dict()
                           if status == Status.OK else {}, **kw)
        self.store.record(rec, replace=replace or not self.config.resume)

    def _evaluate(self, family: KernelFamily, problem: ProblemBase, v: VariantBase, idx: int,
                  s: WorkloadSummary) -> float | None:
        """Median microseconds of a checked, timed variant, else None (outcome recorded)."""
        cfg = self.config
        try:
            fp = self._fingerprint(family, problem, v)
        except Exception as e:
            s.compile_failed += 1
            self._record(problem, v, "render-failed", idx, Status.COMPILE_FAILED,
                         error="render: " + format_error(e))
            return None
        if cfg.resume:
            row = self.store.find(problem, v, fp, self.env)
            if row is not None:
                s.resumed += 1
                return float(row["median_us"]) if row["status"] == Status.OK else None
        out = self._compile(family, problem, v)
        stats = {"registers": out.registers, "spill_bytes": out.spill_bytes,
                 "compile_s": out.seconds}
        if not out.ok:
            s.compile_failed += 1
            log.info("compile failed: %s: %s", v.name(), (out.error or "").splitlines()[0:1])
            self._record(problem, v, out.fingerprint or fp, idx, Status.COMPILE_FAILED,
                         error=out.error, **stats)
            return None
        s.compiled += 1
        if cfg.compile_only:
            self._record(problem, v, out.fingerprint, idx, Status.COMPILED, **stats)
            return None
        try:
            with gpu_lock(cfg.gpu_lock):
                # A marker first: if this variant hangs the GPU or kills the process, the row
                # says so and a resumed run skips it. The outcome below replaces it.
                self._record(problem, v, out.fingerprint, idx, Status.RUN_FAILED,
                             error=_UNFINISHED, replace=True, **stats)
                runner = None
                try:
                    n_sets = cfg.policy.sets_for(working_set_bytes(family, v, problem))
                    runner = family.runner(out.compiled, v, problem, cfg.device,
                                           n_sets=n_sets, seed=cfg.seed)
                    chk = runner.check()
                    if not chk.ok:
                        s.check_failed += 1
                        self._record(problem, v, out.fingerprint, idx, Status.CHECK_FAILED,
                                     rel_err=_finite(chk.rel_err), replace=True,
                                     error=f"check failed: rel_err={chk.rel_err} > "
                                           f"{chk.tolerance}: {chk.detail}"[:4000], **stats)
                        return None
                    t = self.timer(runner, cfg.policy, n_sets)
                finally:
                    runner = None
                    _release_device_memory(cfg.device)
        except Exception as e:
            s.run_failed += 1
            self._record(problem, v, out.fingerprint, idx, Status.RUN_FAILED,
                         error=format_error(e), replace=True, **stats)
            if not _device_healthy(cfg.device):
                raise DeviceLost(f"{v.name()} broke the CUDA context: {e}") from e
            return None
        s.timed += 1
        self._record(problem, v, out.fingerprint, idx, Status.OK, median_us=t.median_us,
                     q10_us=t.quantile_us(0.1), q90_us=t.quantile_us(0.9),
                     samples_us=t.samples_us, launches=t.launches, n_sets=t.n_sets,
                     timing_mode=t.mode, rel_err=_finite(chk.rel_err),
                     error=t.note or None, replace=True, **stats)
        return t.median_us


_UNFINISHED = ("started, never finished: the process hung, crashed or was killed while "
               "running this variant")


def _finite(x: float | None) -> float | None:
    import math

    return float(x) if x is not None and math.isfinite(float(x)) else None


def _optuna_search(valid: Sequence[VariantBase], default: VariantBase | None,
                   evaluate: Callable[[VariantBase], float | None], budget: int,
                   out_of_time: Callable[[], bool], seed: int) -> str | None:
    """TPE over the variant's fields (categorical, values in space order); a sampled
    combination that is not a valid variant is told as pruned and costs no budget."""
    import warnings

    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    names = [f.name for f in dataclasses.fields(valid[0])]
    choices: dict[str, list[str]] = {}
    for n in names:
        vals: list[str] = []
        for v in valid:
            x = canonical_json(_to_jsonable(getattr(v, n)))
            if x not in vals:
                vals.append(x)
        if len(vals) > 1:
            choices[n] = vals

    def params_of(v: VariantBase) -> tuple[str, ...]:
        return tuple(canonical_json(_to_jsonable(getattr(v, n))) for n in choices)

    by_params: dict[tuple[str, ...], VariantBase] = {}
    for v in valid:
        by_params.setdefault(params_of(v), v)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        sampler = optuna.samplers.TPESampler(seed=seed, multivariate=True,
                                             n_startup_trials=max(2, min(10, budget // 3)))
    study = optuna.create_study(direction="minimize", sampler=sampler)
    if default is not None:
        study.enqueue_trial(dict(zip(choices, params_of(default))))
    seen: dict[str, float | None] = {}
    attempts, max_attempts = 0, 20 * budget + 100
    pruned = optuna.trial.TrialState.PRUNED
    while True:
        if len(seen) >= budget:
            return "max_variants"
        if seen and out_of_time():
            return "time_budget"
        if attempts >= max_attempts:
            return None
        attempts += 1
        trial = study.ask()
        key = tuple(trial.suggest_categorical(n, vals) for n, vals in choices.items())
        v = by_params.get(key)
        if v is None:
            study.tell(trial, state=pruned)
            continue
        if v.key() in seen:
            med = seen[v.key()]
        else:
            med = evaluate(v)
            seen[v.key()] = med
        if med is None:
            study.tell(trial, state=pruned)
        else:
            study.tell(trial, med)


# -- running many workloads, optionally in several processes --------------------------------------
@dataclass(frozen=True)
class Job:
    """One workload, in picklable form."""

    family: str
    problem_key: str

    def resolve(self) -> tuple[KernelFamily, ProblemBase]:
        fam = get_family(self.family)
        return fam, fam.PROBLEM.from_key(self.problem_key)


def group_jobs(jobs: Sequence[Job]) -> list[list[Job]]:
    """Jobs that differ only in bucketed fields (likely one compile key) form one group."""
    groups: dict[str, list[Job]] = {}
    for j in jobs:
        fam, p = j.resolve()
        groups.setdefault(canonical_json([j.family, without_buckets(p)]), []).append(j)
    return list(groups.values())


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


def _release_device_memory(device: str) -> None:
    """Return this process's cached CUDA memory: several tuner processes share the GPU, and
    one runner can hold many GB (a 64 x 128K-token KV cache is about 10 GB)."""
    import torch

    if str(device).startswith("cuda") and torch.cuda.is_available():
        import gc

        gc.collect()
        try:
            torch.cuda.empty_cache()
        except Exception:       # a broken context is reported by the health check
            pass


class DeviceLost(RuntimeError):
    """A variant left the CUDA context unusable (e.g. an illegal address): its row is stored;
    this process must not run anything else."""


def _device_healthy(device: str) -> bool:
    import torch

    if not str(device).startswith("cuda") or not torch.cuda.is_available():
        return True
    try:
        torch.cuda.synchronize()
        return float((torch.ones(1, device=device) + 1).item()) == 2.0
    except Exception:
        return False


def _run_groups(groups_next: Callable[[], list[Job] | None], store_factory: Callable[[], Any],
                env: Environment, config: TuneConfig, deadline: float | None,
                remaining: Callable[[int], int], workers: int,
                emit: Callable[[str, Any], None], requeue: Callable[[list[Job]], None],
                timer: Timer = measure) -> None:
    store = store_factory()
    try:
        tuner = Tuner(store, env, config, timer)
        while True:
            group = groups_next()
            if group is None:
                return
            for i, job in enumerate(group):
                left = remaining(-1) + 1          # workloads not yet started, this one included
                wl_deadline = None
                if deadline is not None:
                    share = (deadline - time.time()) * workers / max(left, 1)
                    wl_deadline = time.monotonic() + max(share, 0.0)
                emit("start", job)
                try:
                    fam, problem = job.resolve()
                    summary = tuner.tune(fam, problem, wl_deadline)
                except DeviceLost as e:
                    remaining(len(group) - i)
                    requeue(group[i:])               # resume skips what is already stored
                    emit("lost", f"{job.family} {job.problem_key}: {e}")
                    return
                except Exception as e:              # a broken family never stops the run
                    summary = WorkloadSummary(family=job.family, problem_key=job.problem_key,
                                              error=format_error(e))
                emit("done", summary)
            tuner.clear_compile_cache()
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


def _child(queue_in: Any, queue_out: Any, counter: Any, pending: Any,
           store_factory: Callable[[], Any], env: Environment, config: TuneConfig,
           deadline: float | None, workers: int, modules: Sequence[str],
           log_level: int) -> None:
    _die_with_parent()
    logging.basicConfig(level=log_level)
    try:
        _import_modules(modules)

        def remaining(delta: int) -> int:
            with counter.get_lock():
                counter.value += delta
                return counter.value

        pid = os.getpid()

        def emit(kind: str, obj: Any) -> None:
            queue_out.put((kind, obj, pid))

        def next_group() -> list[Job] | None:
            # `pending` counts groups put and not yet claimed: a claimed group is in (or on
            # its way into) the queue, so the blocking get cannot wait forever.
            with pending.get_lock():
                if pending.value <= 0:
                    return None
                pending.value -= 1
            group = queue_in.get()
            emit("claim", group)            # the parent re-queues it if this process dies
            return group

        def requeue(rest: list[Job]) -> None:
            with pending.get_lock():
                pending.value += 1
            queue_in.put(rest)
            queue_in.close()
            queue_in.join_thread()      # flushed before this process reports the loss

        _run_groups(next_group, store_factory, env, config, deadline, remaining, workers,
                    emit, requeue, _resolve_timer(config, measure))
    except BaseException as e:
        queue_out.put(("crash", format_error(e), os.getpid()))
        raise
    finally:
        queue_out.put(("exit", None, os.getpid()))


def run_jobs(jobs: Sequence[Job], store_factory: Callable[[], Any], env: Environment,
             config: TuneConfig, *, workers: int = 1, isolate: bool = False,
             modules: Sequence[str] = (),
             on_event: Callable[[str, Any], None] = lambda kind, obj: None,
             timer: Timer = measure) -> list[WorkloadSummary]:
    """Tune every job; `store_factory` (picklable, e.g. functools.partial(TuningDB, path))
    opens the result store in each process.

    workers == 1 and not isolate: in this process (with `timer`; tests use this). Otherwise in
    `workers` spawned processes (each with the real timer) that import `modules` first (where
    families outside resgen register themselves); a process whose CUDA context a variant broke
    hands its remaining workloads back and is replaced; so is one that dies outright (its
    claimed workloads are re-queued). With a time budget, processes still running `grace`
    seconds after it (a hung kernel) are killed. Events: ("start", Job),
    ("done", WorkloadSummary), ("lost", str), ("crash", str).
    """
    groups = group_jobs(jobs)
    deadline = None if config.time_budget_s is None else time.time() + config.time_budget_s
    summaries: list[WorkloadSummary] = []

    def emit(kind: str, obj: Any) -> None:
        if kind == "done":
            summaries.append(obj)
        on_event(kind, obj)

    workers = max(1, min(int(workers), len(groups) or 1))
    if workers > 1 and config.gpu_lock is None and not config.compile_only:
        raise ValueError("several tuner processes on one GPU need config.gpu_lock")
    if workers == 1 and not isolate:
        it = iter(groups)
        left = [len(jobs)]

        def remaining(delta: int) -> int:
            left[0] += delta
            return left[0]

        def lost(rest: list[Job]) -> None:
            emit("crash", f"the device was lost; {len(rest)} workloads not tuned (run in "
                          "worker processes to continue past a broken variant)")

        _run_groups(lambda: next(it, None), store_factory, env, config, deadline, remaining, 1,
                    emit, lost, _resolve_timer(config, timer))
        return summaries

    import multiprocessing as mp
    import queue as _q

    ctx = mp.get_context("spawn")           # never fork a process that may hold a CUDA context
    q_in, q_out = ctx.Queue(), ctx.Queue()
    for g in groups:
        q_in.put(g)
    counter = ctx.Value("i", len(jobs))
    pending = ctx.Value("i", len(groups))
    args = (q_in, q_out, counter, pending, store_factory, env, config, deadline, workers,
            list(modules), logging.getLogger().level)

    def spawn():
        p = ctx.Process(target=_child, args=args, daemon=True)
        p.start()
        return p

    procs = {p.pid: p for p in (spawn() for _ in range(workers))}
    claimed: dict[int, list[Job]] = {}       # per process: claimed jobs not yet done
    exited: set[int] = set()
    respawns = 0
    grace = config.hard_stop_grace_s

    def replace(pid: int, why: str) -> None:
        nonlocal respawns
        emit("lost", why)
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
                rest = claimed.pop(pid, [])
                if rest:
                    with pending.get_lock():
                        pending.value += 1
                    q_in.put(rest)
                replace(pid, f"tuner process {pid} died (exit code {p.exitcode}) during "
                             f"{rest[0].problem_key if rest else 'no workload'}")
            kind = None
        if deadline is not None and time.time() > deadline + grace:
            for p in procs.values():
                if p.is_alive():
                    p.kill()
            emit("crash", f"hard stop {grace:.0f} s after the time budget: killed the tuner "
                          "processes still running (a hung kernel?); every finished result "
                          "is stored")
            break
        if kind is None:
            continue
        if kind == "exit":
            exited.add(pid)
        elif kind == "claim":
            claimed[pid] = list(obj)
        elif kind == "done":
            rest = claimed.get(pid, [])
            claimed[pid] = [j for j in rest if (j.family, j.problem_key) !=
                            (obj.family, obj.problem_key)]
            emit(kind, obj)
        elif kind == "lost":
            claimed.pop(pid, None)          # the process re-queued its own work
            replace(pid, obj)
        else:
            emit(kind, obj)
    if pending.value > 0:
        emit("crash", f"{pending.value} workload group(s) left untuned (too many broken "
                      "processes)")
    for p in procs.values():
        p.join(timeout=10)
    return summaries
