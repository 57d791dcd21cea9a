"""The tuner: for each (family, problem) on an arch, find the fastest correct variant.

Per workload: enumerate `family.space` (fixed order), drop what `why_invalid` rejects (reasons
logged and counted), then evaluate candidates: render + compile (once per compile key: every
M bucket that shares one reuses it; failures, registers and spills recorded, never fatal),
`runner.check()` against the reference (must pass before timing), time under the measurement
policy, and store every outcome as its own row through a ResultStore (the dispatch database;
this layer does not import it), with the seconds each phase took (compile, wait for the GPU
lock, prep, check, time).

Candidate order: with a warm start (TuneConfig.warm_start, resgen.search.warmstart), the
variants an earlier table timed fastest for the workload come first, in the cover stage too
(they were stale there: re-compiled, checked and timed like any other); then the family
default (in the cover stage the prior's first choice goes before it when the family has a
prior and there is no warm start), then "seeds" (the best variants of workloads this
process tuned earlier in the same compile class, e.g. the M = 1 winner when tuning M = 4:
already compiled, and usually close), then the family's `prior(variant, problem)` order when
it has one (lower first), else the space order. Search: exhaustive when the valid space fits
the budget; "ranked" (that order, up to the budget) when the family has a prior; otherwise
optuna's TPE sampler, seeded per workload, asked and told one trial at a time with the default
and the seeds enqueued first, so a run is reproducible given the same timings. A compile-only
pre-flight of a space larger than the budget compiles the default plus variants spread evenly
over the space order (deterministic, every axis exercised). Budgets: `max_variants` per
workload and `time_budget_s` for the whole run (shared fairly: each workload may use the
remaining time divided by the workloads left). Resume: a (workload, variant, fingerprint,
environment) already stored is not re-timed; its stored median takes part in the search.

Stages (TuneConfig.coverage): a "full" run tunes each workload once, and every workload gets
at least one variant even past the budget. With coverage, a first "cover" stage evaluates
candidates of every workload in the order above until one passes its check and is timed (at
most `coverage_attempts`), so every workload has a timed result early; then a "refine" stage
spends what is left of the budget on the rest of the search (the cover results are resumed,
never re-timed). Past the budget both stages skip the workloads they have not started, so the
run ends on time.

What is timed is the whole op the runtime would run: a runner with an `as_layer()` method is
switched to it before its check (the linear families: a variant that reads a prepared
activation operand gets the quantizer in front, so it competes fairly with variants that
quantize in their own prologue and with other families).

Family hooks (resgen.search.family documents them and their defaults): `warm(variant, problem)` does
CPU-only work a runner will need before the GPU lock is taken; `prepare(problem, device, n_sets,
seed)` builds the input sets (and check inputs / reference outputs) of a problem once; the
tuner keeps them for every variant of that workload and passes them as
`runner(..., inputs=...)`. `prior(variant, problem)` ranks candidates. A family that does not
define them (KernelFamilyBase's defaults) gets `runner(...)` per variant and the space order.

Many workloads, in worker processes that take turns on the GPU: resgen.search.orchestrate.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol, Sequence

from . import device as _device
from .build import CompileOutcome, compile_variant, format_error, variant_fingerprint
from .buckets import without_buckets
from .cover import covering_subset
from .device import DeviceLost, gpu_lock
from .family import KernelFamily
from .record import Environment, ResultRecord, Status, pick_winner
from .timing import DEFAULT_POLICY, MeasurementPolicy, Timing, measure
from .variant import ProblemBase, VariantBase, canonical_json, _to_jsonable
from ..settings import settings

__all__ = ["TuneConfig", "ResultStore", "WorkloadSummary", "Tuner", "working_set_bytes",
           "gpu_lock", "DeviceLost", "compile_class", "stages_of", "merge_summaries",
           "Interrupted", "SEARCHES", "STAGES", "PHASES", "PREFLIGHTS", "GPU_HOST_CORES",
           "INTERRUPTED", "UNFINISHED"]

log = logging.getLogger("resgen.tuner")


class ResultStore(Protocol):
    """What the tuner needs from the dispatch database (resgen.db.TuningDB implements it).
    Optional: `timed_rows(problem, environment)` -> the workload's stored "ok" rows
    (variant_key, fingerprint, median_us, space_index, created), so that a workload's
    winner is chosen among everything stored for it (an earlier stage's, an earlier run's),
    as the runtime will choose it."""

    def find(self, problem: ProblemBase, variant: VariantBase, fingerprint: str,
             environment: Environment) -> Mapping[str, Any] | None: ...

    def record(self, rec: ResultRecord, *, replace: bool = False) -> bool: ...


SEARCHES = ("auto", "exhaustive", "ranked", "optuna")
PREFLIGHTS = ("full", "cover")
GPU_HOST_CORES = 16                    # the H200 machine resgen's tables were tuned on
STAGES = ("full", "cover", "refine")
PHASES = ("compile", "wait", "prep", "check", "time")


@dataclass
class TuneConfig:
    # the compile target: the GPU's, else RESGEN_ARCH, else sm_90a (resgen.settings)
    arch: str = field(default_factory=lambda: settings().arch)
    policy: MeasurementPolicy = DEFAULT_POLICY
    max_variants: int = 16                 # evaluated per workload (timed, or compiled)
    time_budget_s: float | None = None     # whole run
    resume: bool = True                    # skip stored (workload, variant, fp, env) rows
    compile_only: bool = False
    seed: int = 0
    device: str = "cuda"
    gpu_lock: str | None = None            # lock file held around prep + check + time
    timer: str | None = None               # "module:function" replacing timing.measure
    hard_stop_grace_s: float = 60.0        # kill processes this long past the time budget
    search: str = "auto"                   # one of SEARCHES (see the module docstring)
    coverage: bool = False                 # a "cover" stage before the search (GPU runs)
    coverage_attempts: int = 3             # candidates a cover stage tries per workload
    seeds: int = 3                         # best variants remembered per compile class
    keep_inputs_bytes: int = 4 << 30       # prepared inputs larger than this are not kept
    compile_cache: int = 512               # compiled variants kept per process (LRU)
    # A family whose variants broke the CUDA context (or killed a tuner process) this many
    # times, or that finished this many workloads in a row without a timed winner (every
    # candidate failed to compile, check or run), is disabled for the rest of the run: a
    # systematically broken family must not eat the budget (and the process respawns) of
    # the others. Its stored rows stay; nothing else is lost.
    max_family_losses: int = 8
    max_family_failures: int = 24
    # With resume=False: rows created at or after this UTC ISO time are this run's own (the
    # cover stage's) and are reused, not re-timed.
    resume_since: str | None = None
    # An earlier table whose fastest variants per workload (any fingerprint, this GPU) go
    # first (resgen.search.warmstart); warm_count of them per workload.
    warm_start: str | None = None
    warm_count: int = 2
    # reader(path, gpu_name) -> the table's timed rows (resgen.db.warm_start_rows: this layer
    # opens no database); a picklable module-level function, needed with warm_start.
    warm_start_reader: Callable[[str, str | None], Sequence[Mapping[str, Any]]] | None = None
    # Compile-only runs: "full" compiles up to max_variants per workload (the default and an
    # even spread over the space); "cover" compiles a covering subset of each workload's
    # valid variants (every axis value at least once, resgen.search.cover), whatever
    # max_variants says.
    preflight: str = "full"

    def __post_init__(self) -> None:
        if self.max_variants < 1:
            raise ValueError("max_variants must be >= 1")
        if self.time_budget_s is not None and self.time_budget_s <= 0:
            raise ValueError("time_budget_s must be positive")
        if self.search not in SEARCHES:
            raise ValueError(f"search must be one of {SEARCHES}, got {self.search!r}")
        if self.coverage_attempts < 1 or self.seeds < 0 or self.compile_cache < 1:
            raise ValueError("coverage_attempts and compile_cache must be >= 1, seeds >= 0")
        if self.warm_count < 0:
            raise ValueError("warm_count must be >= 0")
        if self.warm_start and self.warm_start_reader is None:
            raise ValueError("warm_start needs warm_start_reader (resgen.db.warm_start_rows)")
        if self.max_family_losses < 1 or self.max_family_failures < 1:
            raise ValueError("max_family_losses and max_family_failures must be >= 1")
        if self.preflight not in PREFLIGHTS:
            raise ValueError(f"preflight must be one of {PREFLIGHTS}, got {self.preflight!r}")
        if self.time_budget_s is not None and not math.isfinite(self.time_budget_s):
            raise ValueError("time_budget_s must be a finite number of seconds")

    def default_workers(self, cores: int | None = None, *, plan_gpu_host: bool = False
                        ) -> int:
        """Tuner processes when none are asked for. Compile-only: one per core. On a GPU:
        every core but two compiles (CuTe DSL compiles take 0.5-3 s on one core; GPU work
        takes milliseconds per variant) and the processes take turns on the GPU, at most 14.
        plan_gpu_host: planning a GPU run on a machine without one plans for the 16-core
        H200 host."""
        if plan_gpu_host:
            cores = GPU_HOST_CORES
        cores = cores or os.cpu_count() or 1
        return cores if self.compile_only else max(1, min(14, cores - 2))


@dataclass
class WorkloadSummary:
    family: str
    problem_key: str
    stage: str = "full"
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
    prepared: int = 0                      # family.prepare calls (input sets built)
    winner: str | None = None
    winner_us: float | None = None
    default_us: float | None = None
    seconds: float = 0.0
    # Seconds by phase (PHASES), summed over this workload's variants.
    phase_s: dict[str, float] = field(default_factory=dict)
    indices: list[int] = field(default_factory=list)   # space indices evaluated, in order
    stopped_by: str | None = None          # "max_variants" | "time_budget" | "attempts" | None
    warm_started: int = 0                  # warm-start candidates put first
    error: str | None = None               # the workload itself failed (e.g. space() raised)

    _COUNTS = ("compiled", "compile_failed", "check_failed", "run_failed", "timed",
               "prepared")

    def merged(self, later: "WorkloadSummary") -> "WorkloadSummary":
        """This workload's summary after a later stage: `evaluated` counts distinct variants;
        a variant both stages evaluated was resumed by the later one from this one's row, so
        it is not counted as resumed; other counts and seconds add up; the later winner,
        stop reason and error win when set."""
        out = dataclasses.replace(self, invalid_reasons=dict(self.invalid_reasons),
                                  phase_s=dict(self.phase_s), indices=list(self.indices))
        for k in self._COUNTS:
            setattr(out, k, getattr(self, k) + getattr(later, k))
        again = set(self.indices) & set(later.indices)
        out.indices += [i for i in later.indices if i not in again]
        out.evaluated = len(out.indices)
        out.resumed = self.resumed + later.resumed - len(again)
        for k, v in later.phase_s.items():
            out.phase_s[k] = out.phase_s.get(k, 0.0) + v
        out.seconds += later.seconds
        out.stage = f"{self.stage}+{later.stage}"
        if later.search != self.search:
            out.search = f"{self.search}+{later.search}"
        out.space, out.invalid = max(self.space, later.space), max(self.invalid, later.invalid)
        if later.winner is not None:
            out.winner, out.winner_us = later.winner, later.winner_us
        out.default_us = self.default_us if self.default_us is not None else later.default_us
        out.stopped_by = later.stopped_by
        out.error = later.error if later.error is not None else self.error
        out.warm_started = max(self.warm_started, later.warm_started)
        return out


_STAGE_ORDER = {"cover": 0, "full": 1, "refine": 2}


def merge_summaries(summaries: Sequence[WorkloadSummary]) -> list[WorkloadSummary]:
    """One summary per workload (family, problem key), its stages merged in stage order
    (cover before refine), whatever order the worker processes reported them in: the later
    stage's winner is the workload's winner. Workloads keep the order of first appearance."""
    ranked = sorted(enumerate(summaries),
                    key=lambda t: (_STAGE_ORDER.get(t[1].stage, 1), t[0]))
    first: dict[tuple[str, str], int] = {}
    for i, s in enumerate(summaries):
        first.setdefault((s.family, s.problem_key), i)
    out: dict[tuple[str, str], WorkloadSummary] = {}
    for _, s in ranked:
        k = (s.family, s.problem_key)
        out[k] = out[k].merged(s) if k in out else s
    return sorted(out.values(), key=lambda s: first[(s.family, s.problem_key)])


def working_set_bytes(family: KernelFamily, variant: VariantBase, problem: ProblemBase) -> int:
    """Bytes one input set occupies (sizes the cold-L2 rotation): the family's
    `working_set_bytes(variant, problem)` (KernelFamilyBase estimates it from the problem
    type)."""
    return int(family.working_set_bytes(variant, problem))


Timer = Callable[[Any, MeasurementPolicy, int], Timing]


@dataclass
class _Prepared:
    """A family's prepared inputs for one workload, shared by its variants."""

    key: tuple
    n_sets: int
    nbytes: int
    inputs: Any


def compile_class(family: KernelFamily, problem: ProblemBase, arch: str,
                  default: VariantBase | None = None) -> str:
    """The family plus the compile key of its default variant for `problem` (else the problem
    without its bucketed fields): workloads of one class mostly share compiled kernels."""
    try:
        d = default if default is not None else family.default(problem, arch)
        ck: Any = family.compile_key(d, problem).key()
    except Exception:
        ck = without_buckets(problem)
    return canonical_json([family.NAME, ck])


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
        self._compiled: collections.OrderedDict[tuple[str, str, str, str], CompileOutcome] = \
            collections.OrderedDict()
        self._seeds: dict[str, list[VariantBase]] = {}
        self._inputs: _Prepared | None = None
        self._warm = None
        if config.warm_start and not config.compile_only:
            from .warmstart import WarmStart

            self._warm = WarmStart(config.warm_start, environment.gpu_name,
                                   config.warm_start_reader)

    def clear_compile_cache(self) -> None:
        self._compiled.clear()

    # -- one workload --------------------------------------------------------------------------
    def tune(self, family: KernelFamily, problem: ProblemBase,
             deadline: float | None = None, *, stage: str = "full") -> WorkloadSummary:
        """Tune one workload; `deadline` (time.monotonic()) stops starting new variants.
        stage: "full", "cover" or "refine" (module docstring)."""
        if stage not in STAGES:
            raise ValueError(f"stage must be one of {STAGES}, got {stage!r}")
        t0 = time.monotonic()
        s = WorkloadSummary(family=family.NAME, problem_key=problem.key(), stage=stage)

        def out_of_time() -> bool:
            return deadline is not None and time.monotonic() > deadline

        if stage != "full" and out_of_time():
            s.search, s.stopped_by = "skipped", "time_budget"
            return s
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

        valid_keys = {v.key() for v in valid}
        default = None
        try:
            d = family.default(problem, arch)
            if d.key() in valid_keys:
                default = d
        except Exception as e:
            log.warning("%s.default() raised for %s: %s", family.NAME, problem.key(), e)
        cls = compile_class(family, problem, arch, default)
        warm = [] if self._warm is None else [
            v for v in self._warm.candidates(family, problem, arch, self.config.warm_count)
            if v.key() in valid_keys]
        s.warm_started = len(warm)
        seeds = [v for v in self._seeds.get(cls, []) if v.key() in valid_keys]
        # warm start, default, seeds; each variant once, at its first place
        head = list({h.key(): h for h in
                     warm + ([default] if default is not None else []) + seeds}.values())

        results: dict[str, float | None] = {}

        def evaluate(v: VariantBase) -> float | None:
            med = self._evaluate(family, problem, v, index[v.key()], s)
            results[v.key()] = med
            s.indices.append(index[v.key()])
            return med

        cfg = self.config
        budget = cfg.max_variants
        prior = family.prior if family.defines("prior") else None
        try:
            if stage == "cover" and not cfg.compile_only:
                s.search = "cover"
                order = self._ordered(family, problem, valid, head, index)
                if prior is not None and not warm:
                    # The one variant a short budget may get: the prior's first choice (what
                    # the family knows wins on the hardware), then the default and the seeds.
                    best = self._ordered(family, problem, valid, [], index)[0]
                    order = [best] + [v for v in order if v.key() != best.key()]
                for v in order:
                    if len(results) >= cfg.coverage_attempts:
                        s.stopped_by = "attempts"
                        break
                    if results and out_of_time():
                        s.stopped_by = "time_budget"
                        break
                    if evaluate(v) is not None:
                        break
            elif cfg.compile_only or len(valid) <= budget or cfg.search == "exhaustive" or (
                    cfg.search == "ranked" or (cfg.search == "auto" and prior is not None)):
                order = self._ordered(family, problem, valid, head, index)
                s.search = "exhaustive" if len(valid) <= budget else "ranked"
                if cfg.compile_only and cfg.preflight == "cover":
                    # every axis value of the valid space compiled at least once
                    s.search = "cover-preflight"
                    heads = {h.key() for h in head}
                    order = head + [v for v in covering_subset(valid) if v.key() not in heads]
                    budget = len(order)
                elif cfg.compile_only and len(valid) > budget:
                    # Compile-only pre-flight of a large space: the head plus variants spread
                    # evenly over the fixed order, so every axis value gets compiled somewhere.
                    s.search = "spread"
                    heads = {h.key() for h in head}
                    rest = [v for v in valid if v.key() not in heads]
                    n = budget - len(head)
                    order = head[:budget] + ([rest[(i * len(rest)) // n] for i in range(n)]
                                             if n > 0 else [])
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
                s.stopped_by = _optuna_search(valid, head, evaluate, budget, out_of_time,
                                              self._seed(family, problem))
        finally:
            self._inputs = None                 # a workload's inputs die with it
            if not cfg.compile_only:
                _device.release_device_memory(cfg.device, collect=True)
        if default is not None:
            s.default_us = results.get(default.key())
        known = dict(self._known(family, problem, valid_keys) if not cfg.compile_only else {})
        known.update((k, m) for k, m in results.items() if m is not None)
        timed = [{"median_us": m, "space_index": index[k], "key": k}
                 for k, m in known.items()]
        win = pick_winner(timed, cfg.policy.tie_rel)
        if win is not None:
            wv = next(v for v in valid if v.key() == win["key"])
            s.winner, s.winner_us = wv.name(), float(win["median_us"])
        self._remember(cls, valid, results)
        s.evaluated = len(results)
        s.seconds = time.monotonic() - t0
        return s

    def _known(self, family: KernelFamily, problem: ProblemBase,
               valid_keys: set[str]) -> dict[str, float]:
        """Medians of the workload's stored timed rows that resume may use: a valid variant,
        this environment, the current fingerprint (variant key -> median)."""
        fetch = getattr(self.store, "timed_rows", None)
        if fetch is None:
            return {}
        cfg, out = self.config, {}
        try:
            rows = fetch(problem, self.env)
        except Exception as e:                 # a winner from this run's results still counts
            log.warning("reading stored results of %s failed: %s", problem.key(), e)
            return {}
        for row in rows:
            k = row["variant_key"]
            if k not in valid_keys or not (row["median_us"] or 0) > 0:
                continue
            if not cfg.resume and str(row.get("created") or "") < (cfg.resume_since or "~"):
                continue
            try:
                v = family.VARIANT.from_key(k)
                if row["fingerprint"] != self._fingerprint(family, problem, v):
                    continue
            except Exception:
                continue
            out[k] = float(row["median_us"])
        return out

    def _ordered(self, family: KernelFamily, problem: ProblemBase,
                 valid: Sequence[VariantBase], head: Sequence[VariantBase],
                 index: Mapping[str, int]) -> list[VariantBase]:
        """head, then the rest by the family's prior (lower first; ties and a prior that
        raises or returns NaN fall back to the space order), else in space order."""
        prior = family.prior if family.defines("prior") else None
        rest: Sequence[VariantBase] = valid
        if prior is not None:
            def score(v: VariantBase) -> float:
                try:
                    x = float(prior(v, problem))
                except Exception as e:
                    log.debug("%s.prior raised for %s: %s", family.NAME, v.name(), e)
                    return math.inf
                return x if math.isfinite(x) else math.inf
            rest = sorted(valid, key=lambda v: (score(v), index[v.key()]))
        heads = {h.key() for h in head}
        return list(head) + [v for v in rest if v.key() not in heads]

    def _remember(self, cls: str, valid: Sequence[VariantBase],
                  results: Mapping[str, float | None]) -> None:
        """Keep this workload's best timed variants as seeds for its compile class (the most
        recent workload's first)."""
        n = self.config.seeds
        if n <= 0:
            return
        by_key = {v.key(): v for v in valid}
        best = sorted((m, k) for k, m in results.items() if m is not None)[:n]
        new = [by_key[k] for _, k in best]
        keys = {v.key() for v in new}
        old = [v for v in self._seeds.get(cls, []) if v.key() not in keys]
        self._seeds[cls] = (new + old)[:2 * n]

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
            while len(self._compiled) > self.config.compile_cache:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(key)
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

    def _stored(self, problem: ProblemBase, v: VariantBase, fp: str) -> Mapping[str, Any] | None:
        """The stored row resume may reuse (resume=False: only this run's own rows)."""
        cfg = self.config
        if not cfg.resume and cfg.resume_since is None:
            return None
        row = self.store.find(problem, v, fp, self.env)
        if row is not None and row.get("error") == INTERRUPTED:
            return None                      # stopped by Ctrl-C, not by the variant
        if row is None or cfg.resume:
            return row
        return row if str(row.get("created") or "") >= cfg.resume_since else None

    def _runner(self, family: KernelFamily, out: CompileOutcome, v: VariantBase,
                problem: ProblemBase, n_sets: int, s: WorkloadSummary) -> Any:
        """family.runner(...), with the workload's prepared inputs when the family has a
        `prepare` hook (built once per workload, rebuilt only if a variant needs more sets)."""
        cfg = self.config
        if not family.defines("prepare"):
            return family.runner(out.compiled, v, problem, cfg.device, n_sets=n_sets,
                                 seed=cfg.seed)
        key = (family.NAME, problem.key(), str(cfg.device), cfg.seed)
        p = self._inputs
        if p is None or p.key != key or p.n_sets < n_sets:
            self._inputs = p = None             # free the old sets before building new ones
            inputs = family.prepare(problem, cfg.device, n_sets, cfg.seed)
            p = _Prepared(key, n_sets, n_sets * working_set_bytes(family, v, problem), inputs)
            s.prepared += 1
            if p.nbytes <= cfg.keep_inputs_bytes:
                self._inputs = p
        return family.runner(out.compiled, v, problem, cfg.device, n_sets=n_sets,
                             seed=cfg.seed, inputs=p.inputs)

    def _evaluate(self, family: KernelFamily, problem: ProblemBase, v: VariantBase, idx: int,
                  s: WorkloadSummary) -> float | None:
        """Median microseconds of a checked, timed variant, else None (outcome recorded)."""
        cfg = self.config
        phases: dict[str, float] = {}

        def lap(name: str, since: float) -> float:
            now = time.perf_counter()
            phases[name] = phases.get(name, 0.0) + now - since
            s.phase_s[name] = s.phase_s.get(name, 0.0) + now - since
            return now

        try:
            fp = self._fingerprint(family, problem, v)
        except Exception as e:
            s.compile_failed += 1
            self._record(problem, v, "render-failed", idx, Status.COMPILE_FAILED,
                         error="render: " + format_error(e))
            return None
        row = self._stored(problem, v, fp)
        if row is not None:
            s.resumed += 1
            return float(row["median_us"]) if row["status"] == Status.OK else None
        t = time.perf_counter()
        out = self._compile(family, problem, v)
        lap("compile", t)
        stats = {"registers": out.registers, "spill_bytes": out.spill_bytes,
                 "compile_s": out.seconds}
        if not out.ok:
            s.compile_failed += 1
            log.info("compile failed: %s: %s", v.name(), (out.error or "").splitlines()[0:1])
            self._record(problem, v, out.fingerprint or fp, idx, Status.COMPILE_FAILED,
                         error=out.error, phase_s=phases, **stats)
            return None
        s.compiled += 1
        if cfg.compile_only:
            self._record(problem, v, out.fingerprint, idx, Status.COMPILED, phase_s=phases,
                         **stats)
            return None
        # CPU work the runner will need (e.g. a helper kernel's compile), done before taking
        # the GPU lock so that it overlaps other processes' GPU work. A failure is left for
        # the runner to raise again under the lock, where it is recorded.
        t = time.perf_counter()
        try:
            family.warm(v, problem)
        except Exception as e:
            log.debug("%s.warm failed for %s: %s", family.NAME, v.name(), e)
        lap("compile", t)
        try:
            t = time.perf_counter()
            with _device.gpu_lock(cfg.gpu_lock):
                t = lap("wait", t)
                # A marker first: if this variant hangs the GPU or kills the process, the row
                # says so and a resumed run skips it. The outcome below replaces it.
                self._record(problem, v, out.fingerprint, idx, Status.RUN_FAILED,
                             error=_UNFINISHED, replace=True, **stats)
                runner = None
                try:
                    n_sets = cfg.policy.sets_for(working_set_bytes(family, v, problem))
                    runner = self._runner(family, out, v, problem, n_sets, s)
                    as_layer = getattr(runner, "as_layer", None)
                    if as_layer is not None:
                        as_layer()          # time the whole op (e.g. quantizer + GEMM)
                    t = lap("prep", t)
                    chk = runner.check()
                    t = lap("check", t)
                    if not chk.ok:
                        s.check_failed += 1
                        self._record(problem, v, out.fingerprint, idx, Status.CHECK_FAILED,
                                     rel_err=_finite(chk.rel_err), replace=True,
                                     error=f"check failed: rel_err={chk.rel_err} > "
                                           f"{chk.tolerance}: {chk.detail}"[:4000],
                                     phase_s=phases, **stats)
                        return None
                    timing = self.timer(runner, cfg.policy, n_sets)
                    lap("time", t)
                finally:
                    runner = None
        except (KeyboardInterrupt, Interrupted):
            # Ctrl-C with this variant in flight: not its fault; a resumed run tries it again
            self._record(problem, v, out.fingerprint, idx, Status.RUN_FAILED,
                         error=INTERRUPTED, replace=True, **stats)
            raise
        except Exception as e:
            s.run_failed += 1
            self._record(problem, v, out.fingerprint, idx, Status.RUN_FAILED,
                         error=format_error(e), replace=True, phase_s=phases, **stats)
            if not _device.device_healthy(cfg.device):
                raise DeviceLost(f"{v.name()} broke the CUDA context: {e}") from e
            return None
        finally:
            _device.release_device_memory(cfg.device, collect=False)
        s.timed += 1
        self._record(problem, v, out.fingerprint, idx, Status.OK, median_us=timing.median_us,
                     q10_us=timing.quantile_us(0.1), q90_us=timing.quantile_us(0.9),
                     samples_us=timing.samples_us, launches=timing.launches,
                     n_sets=timing.n_sets, timing_mode=timing.mode,
                     rel_err=_finite(chk.rel_err), error=timing.note or None, replace=True,
                     phase_s=phases, **stats)
        return timing.median_us


_UNFINISHED = ("started, never finished: the process hung, crashed or was killed while "
               "running this variant")
INTERRUPTED = "interrupted (Ctrl-C) while running this variant: a resumed run tries it again"
UNFINISHED = _UNFINISHED      # the marker's public name (db merge, resgen.search.distributed)


class Interrupted(BaseException):
    """Raised in a tuner worker process when the parent stops it (SIGTERM after Ctrl-C):
    a BaseException, so that no `except Exception` of a family records it as a failure."""


def _finite(x: float | None) -> float | None:
    import math

    return float(x) if x is not None and math.isfinite(float(x)) else None


def _optuna_search(valid: Sequence[VariantBase], head: Sequence[VariantBase],
                   evaluate: Callable[[VariantBase], float | None], budget: int,
                   out_of_time: Callable[[], bool], seed: int) -> str | None:
    """TPE over the variant's fields (categorical, values in space order), with `head` (the
    default and the seeds) enqueued first; a sampled combination that is not a valid variant
    is told as pruned and costs no budget."""
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
    for v in head:
        study.enqueue_trial(dict(zip(choices, params_of(v))))
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


def stages_of(config: TuneConfig) -> tuple[str, ...]:
    """The stages a run goes through: ("cover", "refine") with coverage on a GPU run."""
    return ("cover", "refine") if config.coverage and not config.compile_only else ("full",)


_MOVED = {"Job", "run_jobs", "plan_groups", "workload_share", "TuneInterrupted"}


def __getattr__(name: str) -> Any:
    """The process orchestration moved to resgen.search.orchestrate; these names still
    resolve from here for callers that imported them from the tuner."""
    if name in _MOVED:
        from . import orchestrate

        return getattr(orchestrate, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
