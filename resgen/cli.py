"""The `resgen` command line.

    resgen tune --model qwen3-8b[,qwen3-32b,...|all] [--formats] [--ops] [--m-buckets] [--db]
                [--tp] [--resume] [--max-variants] [--time-budget] [--compile-only] [--jobs]
                [--policy tune|bench] [--search] [--coverage] [--plan]
    resgen show [--db]                      winners as a table
    resgen bench --model qwen3-8b [--db]    winners vs torch.matmul BF16 / _scaled_mm FP8 (GPU)
    resgen db verify|merge|export           database maintenance
    resgen report ... / resgen plan ...     quality report and compensation planner
                                            (resgen.quality.cli)

Without a CUDA GPU, `tune` says so and runs the compile-only pre-flight for sm_90a: every
candidate variant is rendered and compiled and the outcome stored with status "compiled" (or
"compile_failed") under a compile-only environment; nothing is run or timed.

`tune` with several models (or `all`) tunes every workload they share once (workloads are
shapes, not models: the database serves any model with that shape), prints its plan first
(workloads per family and per model, compile classes, compiles, estimated GPU seconds) and
ends with the seconds spent per phase (compile, waiting for the GPU, prep, check, time).
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, Callable, Sequence

__all__ = ["main", "build_parser"]


def _csv(kind: Callable[[str], Any]) -> Callable[[str], list[Any]]:
    def parse(text: str) -> list[Any]:
        try:
            out = [kind(x.strip()) for x in text.split(",") if x.strip()]
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        if not out:
            raise argparse.ArgumentTypeError("empty list")
        return out
    return parse


def _pos_int(text: str) -> int:
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a positive integer")
    return v


def _shard(text: str) -> tuple[int, int]:
    """"I/N" -> (I, N) with 0 <= I < N."""
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not I/N") from None
    if n < 1 or not 0 <= i < n:
        raise argparse.ArgumentTypeError(f"{text!r}: need 0 <= I < N")
    return i, n


def build_parser() -> argparse.ArgumentParser:
    from .search.buckets import DEFAULT_ATTN_BATCHES, DEFAULT_KV_LENS, DEFAULT_M_BUCKETS

    p = argparse.ArgumentParser(prog="resgen", description=__doc__.split("\n\n")[0])
    p.add_argument("-v", "--verbose", action="count", default=0)
    sub = p.add_subparsers(dest="cmd", required=True)

    t = sub.add_parser("tune", help="tune kernels for a model's shapes into a database")
    t.add_argument("--model", required=True, type=_csv(str),
                   help="qwen3-4b, qwen3-8b, qwen3-32b, a config.json or model directory; "
                        "comma-separated for several, or 'all' (every built-in model)")
    t.add_argument("--formats", type=_csv(str), default=["nvfp4", "mxfp4"])
    t.add_argument("--compensations", type=_csv(str),
                   default=["none", "full", "0.125", "0.25", "0.5", "1.0"])
    t.add_argument("--ops", type=_csv(str), default=None,
                   help="ops to tune (default: every op with a family for the arch)")
    t.add_argument("--families", type=_csv(str), default=None,
                   help="restrict to these kernel families")
    t.add_argument("--m-buckets", type=_csv(_pos_int), default=list(DEFAULT_M_BUCKETS))
    t.add_argument("--attn-batches", type=_csv(_pos_int), default=list(DEFAULT_ATTN_BATCHES))
    t.add_argument("--kv-lens", type=_csv(_pos_int), default=list(DEFAULT_KV_LENS))
    t.add_argument("--attn-pv", type=_csv(str), default=["f16", "fp8"],
                   help="decode attention P.V numerics to tune (f16, fp8)")
    t.add_argument("--tp", type=_pos_int, default=1)
    t.add_argument("--db", type=Path, default=None,
                   help="output database (default: the user's cache database)")
    t.add_argument("--resume", action=argparse.BooleanOptionalAction, default=True,
                   help="skip variants already stored for this fingerprint and environment "
                        "(default); --no-resume re-times and replaces them")
    t.add_argument("--max-variants", type=_pos_int, default=16,
                   help="variants evaluated per workload (spaces up to this size are searched "
                        "exhaustively, larger ones by the family's prior or with optuna)")
    t.add_argument("--policy", choices=["tune", "bench"], default="tune",
                   help="measurement policy: 'tune' (cold-l2-graph-tune: short graphs, 5 "
                        "repetitions; default) or 'bench' (cold-l2-graph, as resgen bench)")
    t.add_argument("--search", choices=["auto", "exhaustive", "ranked", "optuna"],
                   default="auto", help="auto: exhaustive if the space fits --max-variants, "
                   "else ranked by the family's prior, else optuna")
    t.add_argument("--coverage", action=argparse.BooleanOptionalAction, default=True,
                   help="GPU runs: first give every workload one checked, timed variant, then "
                        "search with the rest of the budget (default on)")
    t.add_argument("--warm-start", type=Path, default=None, metavar="TABLE",
                   help="an earlier table (e.g. tuned/h200.sqlite.xz from before a template "
                        "change): its fastest variants per workload on this GPU, whatever "
                        "their fingerprint, are tried first (validated, re-checked, re-timed)")
    t.add_argument("--plan", action="store_true",
                   help="print the plan (workloads, compiles, estimated GPU seconds) and exit")
    t.add_argument("--time-budget", type=float, default=None,
                   help="seconds for the whole run (default 480 on a GPU, none compile-only); "
                        "tuner processes still running --hard-stop seconds later (a hung "
                        "kernel) are killed")
    t.add_argument("--hard-stop", type=float, default=60.0,
                   help="seconds past the budget before stuck tuner processes are killed")
    t.add_argument("--compile-only", action="store_true",
                   help="render and compile only (automatic without a GPU)")
    t.add_argument("--arch", default=None, help="compile target (default: the GPU's, or "
                   "RESGEN_ARCH / sm_90a without one)")
    t.add_argument("--jobs", type=_pos_int, default=None,
                   help="tuner processes (compile in parallel, one on the GPU at a time)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--shard", type=_shard, default=None, metavar="I/N",
                   help="tune only every N-th workload from the I-th (0-based) of the "
                        "deterministic workload order: N runs with I = 0 .. N-1, e.g. one per "
                        "GPU of a host (CUDA_VISIBLE_DEVICES) into separate databases, cover "
                        "every workload once between them (`resgen db merge` joins them; "
                        "tuned/produce_h200.sh does this with RESGEN_TUNE_GPUS)")
    t.add_argument("--json", type=Path, default=None, help="write the run summary here")
    t.add_argument("--import", dest="imports", action="append", default=[],
                   help="import this module first (registers out-of-tree families)")
    t.add_argument("--timer", default=None, metavar="MODULE:FUNCTION",
                   help="replace resgen.search.timing.measure (alternative measurement tools; "
                        "the tests' fake timings)")

    s = sub.add_parser("show", help="winners per workload as a table")
    s.add_argument("--db", type=Path, default=None)
    s.add_argument("--op", default=None)
    s.add_argument("--import", dest="imports", action="append", default=[])

    b = sub.add_parser("bench", help="dispatched winners, whole layer, vs torch.matmul BF16, "
                                     "_scaled_mm FP8, Triton MXFP4 and the HBM floor (GPU)")
    b.add_argument("--model", required=True, type=_csv(str))
    b.add_argument("--db", type=Path, default=None)
    b.add_argument("--tp", type=_pos_int, default=1)
    b.add_argument("--m", type=_csv(_pos_int), default=[1, 16])
    b.add_argument("--formats", type=_csv(str), default=["nvfp4", "mxfp4"])
    b.add_argument("--compensations", type=_csv(str), default=["none", "full"])
    b.add_argument("--out", type=Path, default=None,
                   help="JSON output (default: $OUT/bench.json or bench/results/h200/)")
    b.add_argument("--import", dest="imports", action="append", default=[])

    d = sub.add_parser("db", help="database maintenance")
    dsub = d.add_subparsers(dest="dbcmd", required=True)
    v = dsub.add_parser("verify", help="integrity, checksums, keys")
    v.add_argument("path", type=Path)
    v.add_argument("--import", dest="imports", action="append", default=[])
    m = dsub.add_parser("merge", help="copy results of other databases into one")
    m.add_argument("sources", type=Path, nargs="+")
    m.add_argument("--into", type=Path, required=True)
    m.add_argument("--fresh-only", action="store_true",
                   help="copy only results whose variant parses and whose fingerprint matches "
                        "this checkout's templates, kernel modules and versions (drop stale ones)")
    e = dsub.add_parser("export", help="to JSON, or a compact read-only-friendly SQLite copy "
                        "(xz-compressed when --out ends in .xz, as tuned/ ships it)")
    e.add_argument("path", type=Path)
    e.add_argument("--out", type=Path, required=True)
    e.add_argument("--format", choices=["json", "sqlite"], default=None,
                   help="default: from the --out suffix")

    from .checkpoint import cli as checkpoint_cli       # `resgen quantize`
    checkpoint_cli.add_parser(sub)

    for name, what in (("report", "quality report (resgen.quality)"),
                       ("plan", "layer-wise compensation planner (resgen.quality)")):
        q = sub.add_parser(name, help=what, add_help=False)
        q.add_argument("args", nargs=argparse.REMAINDER)
    from .engine.cli import add_parser as add_generate   # resgen generate (resgen.engine.cli)

    add_generate(sub)
    return p


# -- helpers --------------------------------------------------------------------------------------
def _has_gpu() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


def _import_all(mods: Sequence[str]) -> None:
    import importlib

    for mod in mods:
        importlib.import_module(mod)


class _Progress:
    """tqdm when installed (it is not on the GPU image), else a line every few seconds."""

    def __init__(self, total: int, desc: str) -> None:
        self.total, self.n, self.desc, self._last = total, 0, desc, 0.0
        try:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=desc, unit="workload", file=sys.stderr)
        except Exception:
            self.bar = None

    def update(self, postfix: str) -> None:
        self.n += 1
        if self.bar is not None:
            self.bar.set_postfix_str(postfix, refresh=False)
            self.bar.update(1)
        elif time.monotonic() - self._last > 5 or self.n == self.total:
            self._last = time.monotonic()
            print(f"{self.desc}: {self.n}/{self.total} workloads  {postfix}", file=sys.stderr,
                  flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    from .search.tuneplan import table

    return table(headers, rows)


def _gpu_lock_path() -> str:
    """One lock file per physical GPU (its UUID), so tuners on different GPUs of one host
    (CUDA_VISIBLE_DEVICES) never wait for each other, and tuners sharing one GPU take turns."""
    from .settings import settings

    try:
        import torch

        tag = str(torch.cuda.get_device_properties(0).uuid)
    except Exception:
        tag = "0"
    tag = "".join(c for c in tag if c.isalnum() or c == "-")[:64] or "0"
    return str(settings().cache_dir / f"gpu-{tag}.lock")


def _problems_for(fam: Any, models: list, args: argparse.Namespace) -> list:
    """The workloads of a family for the models (see the module docstring of models.py)."""
    import dataclasses

    from .models import attention_problems, linear_problems
    from .search.variant import AttentionProblem, LinearProblem

    hook = getattr(fam, "model_problems", None)
    if hook is not None:
        return list(hook(models, tp=args.tp, formats=args.formats,
                         compensations=args.compensations, m_buckets=args.m_buckets))
    lin = linear_problems(models, args.tp, args.formats, args.compensations, args.m_buckets)
    if fam.PROBLEM is LinearProblem:
        return lin
    if fam.PROBLEM is AttentionProblem:
        return attention_problems(models, args.tp, args.attn_batches, args.kv_lens,
                                  pv=args.attn_pv)
    # Another problem type (e.g. the quantizer's): its `for_linear(LinearProblem)` classmethod
    # when it has one, else the linear workloads' fields of the same name.
    names = {f.name for f in dataclasses.fields(fam.PROBLEM)}
    for_linear = getattr(fam.PROBLEM, "for_linear", None)
    out, seen = [], set()
    for lp in lin:
        try:
            p = for_linear(lp) if for_linear is not None else \
                fam.PROBLEM(**{n: getattr(lp, n) for n in names if hasattr(lp, n)})
        except (TypeError, ValueError):
            continue
        if p not in seen:
            seen.add(p)
            out.append(p)
    return out


# -- tune -------------------------------------------------------------------------------------------
def _models(names: Sequence[str]) -> list:
    from .models import MODELS, get_model

    out = []
    for n in names:
        for spec in (MODELS.values() if n.strip().lower() == "all" else [get_model(n)]):
            if spec not in out:
                out.append(spec)
    return out


def cmd_tune(args: argparse.Namespace) -> int:
    from .db import DatabaseError, TuningDB
    from .search.family import families
    from .search.record import compile_only_environment, current_environment
    from .search.timing import policy_named
    from .search.tuneplan import measured_costs, plan_run
    from .search.tuner import PHASES, Job, TuneConfig, run_jobs, stages_of
    from .settings import settings

    started = time.monotonic()            # the budget counts from here: setup included
    started_utc = _utc_now()
    _import_all(args.imports)
    models = _models(args.model)
    gpu = _has_gpu()
    compile_only = args.compile_only or not gpu
    if not gpu and not args.compile_only and not args.plan:
        print("No CUDA GPU found: running the COMPILE-ONLY pre-flight instead: per workload "
              f"up to --max-variants={args.max_variants} valid variants (the default plus an "
              "even spread over the space) are rendered and compiled; nothing is run or "
              "timed; results are stored with status 'compiled' under a compile-only "
              "environment.", file=sys.stderr)
    if compile_only:
        arch = args.arch or settings().arch
        env = compile_only_environment(arch)
        # --plan on a machine without a GPU plans the GPU run (unless --compile-only).
        compile_only = args.compile_only or not args.plan
    else:
        env = current_environment()
        arch = args.arch or env.arch
        if arch != env.arch:
            print(f"--arch {arch} differs from this GPU's {env.arch}: use --compile-only",
                  file=sys.stderr)
            return 2
    fams = [f for f in families().values() if arch in f.ARCHS]
    if args.families:
        unknown = set(args.families) - {f.NAME for f in families().values()}
        if unknown:
            print(f"unknown families {sorted(unknown)}", file=sys.stderr)
            return 2
        fams = [f for f in fams if f.NAME in args.families]
    if args.ops:
        fams = [f for f in fams if f.PROBLEM.OP in args.ops]
    if not fams:
        print(f"no kernel family for ops {args.ops or 'any'} on {arch} (registered: "
              f"{sorted(families())})", file=sys.stderr)
        return 2
    jobs: list[Job] = []
    problems: dict[str, list] = {}
    per_model: dict[str, dict[str, int]] = {}
    for fam in sorted(fams, key=lambda f: f.NAME):
        probs = _problems_for(fam, models, args)       # deduplicated across the models
        problems[fam.NAME] = probs
        per_model[fam.NAME] = ({m.name: len(_problems_for(fam, [m], args)) for m in models}
                               if len(models) > 1 else {models[0].name: len(probs)})
        jobs += [Job(fam.NAME, p.key()) for p in probs]
    if args.shard is not None:
        # round robin over the deterministic order: each shard gets every family, model and
        # M bucket in about equal parts; each workload is tuned (and its variants compared)
        # on one GPU only
        i, n = args.shard
        jobs = jobs[i::n]
        kept = {(j.family, j.problem_key) for j in jobs}
        problems = {f: [p for p in ps if (f, p.key()) in kept] for f, ps in problems.items()}
        per_model = {f: {f"shard-{i}/{n}": len(problems[f])} for f in per_model}
    if not jobs:
        print("no workloads to tune", file=sys.stderr)
        return 2
    if args.warm_start is not None:
        # a typo must not silently tune without the hint: the table must open and be ours
        try:
            with TuningDB(args.warm_start, readonly=True) as db:
                rep = db.verify()
        except DatabaseError as e:
            print(f"--warm-start {args.warm_start}: {e}", file=sys.stderr)
            return 2
        if not rep.ok:
            print(f"--warm-start {args.warm_start} fails verification: "
                  f"{'; '.join(rep.errors[:3])}", file=sys.stderr)
            return 2
    db_path = args.db or settings().user_db
    budget = args.time_budget if args.time_budget is not None else (
        None if compile_only else 480.0)
    cores = os.cpu_count() or 1
    # Compile-only: one process per core. On a GPU: every core but two compiles (CuTe DSL
    # compiles take 0.5-3 s on one core; GPU work takes milliseconds per variant), and the
    # processes take turns on the GPU.
    workers = args.jobs or (cores if compile_only else max(1, min(14, cores - 2)))
    if args.plan and not gpu and not args.jobs and not compile_only:
        workers = 14                              # planning for the 16-core H200 machine
    lock = None if compile_only else _gpu_lock_path()
    policy = policy_named(args.policy)
    config = TuneConfig(arch=arch, policy=policy, max_variants=args.max_variants,
                        time_budget_s=budget, resume=args.resume, compile_only=compile_only,
                        seed=args.seed, gpu_lock=lock, timer=args.timer, search=args.search,
                        coverage=args.coverage, hard_stop_grace_s=args.hard_stop,
                        resume_since=None if args.resume else started_utc,
                        warm_start=str(args.warm_start) if args.warm_start else None)
    measured = None
    if Path(db_path).exists():
        try:
            with TuningDB(db_path, readonly=True) as db:
                measured = measured_costs(db.rows(gpu_name=env.gpu_name, compile_only=False))
        except DatabaseError:
            measured = None
    plan = plan_run(problems, per_model, {f.NAME: f for f in fams}, config, workers,
                    measured=measured)
    if args.plan:
        print(plan.text())
        return 0
    print(plan.text(), file=sys.stderr)
    TuningDB(db_path).close()                     # create (or reject) before starting workers
    left = None if budget is None else max(1.0, budget - (time.monotonic() - started))
    config.time_budget_s = left
    stages = stages_of(config)
    label = "compile-only pre-flight" if compile_only else f"tuning on {env.gpu_name}"
    print(f"resgen tune: {label}, arch {arch}, {len(jobs)} workloads, stages "
          f"{'+'.join(stages)}, {workers} process(es), budget {budget or 'none'} s, policy "
          f"{policy.label}, database {db_path}", file=sys.stderr)
    bar = _Progress(len(jobs) * len(stages), "compile-only" if compile_only else "tune")
    totals: Counter[str] = Counter()
    crashes: list[str] = []
    disabled: list[str] = []

    def on_event(kind: str, obj: Any) -> None:
        if kind == "done":
            for k in ("compiled", "compile_failed", "check_failed", "run_failed", "timed",
                      "resumed"):
                totals[k] += getattr(obj, k)
            totals["errors"] += obj.error is not None
            bar.update(f"{obj.stage}: compiled {totals['compiled']} timed {totals['timed']} "
                       f"failed {totals['compile_failed'] + totals['check_failed'] + totals['run_failed']}")
        elif kind == "crash":
            crashes.append(str(obj))
        elif kind == "lost":
            totals["lost"] += 1
            print(f"\nreplacing a tuner process: {obj}", file=sys.stderr)
        elif kind == "disabled":
            disabled.append(str(obj))
            print(f"\n{obj}", file=sys.stderr)

    modules = list(args.imports) + sorted({type(f).__module__ for f in fams})
    # On a GPU the tuning always runs in worker processes: one whose CUDA context a broken
    # variant poisons is replaced, and the run goes on.
    summaries = run_jobs(jobs, functools.partial(TuningDB, db_path), env, config,
                         workers=workers, isolate=not compile_only, modules=modules,
                         on_event=on_event)
    bar.close()
    elapsed = time.monotonic() - started
    print(_summary_text(summaries, compile_only, elapsed, db_path), flush=True)
    if totals["lost"]:
        print(f"{totals['lost']} tuner process(es) were replaced after a variant broke the "
              "CUDA context (those variants are stored as run_failed)")
    for c in crashes:
        print(f"tuner process crashed: {c}", file=sys.stderr)
    for d in disabled:
        print(d)
    if args.json:
        phase_totals = {k: sum(s.phase_s.get(k, 0.0) for s in summaries) for k in PHASES}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "mode": "compile-only" if compile_only else "tune", "arch": arch,
            "environment": env.as_dict(), "database": str(db_path), "seconds": elapsed,
            "workers": workers, "time_budget_s": budget, "policy": policy.as_dict(),
            "stages": list(stages), "crashes": crashes, "disabled": disabled,
            "plan": plan.as_dict(),
            "phase_s": phase_totals, "models": [m.name for m in models],
            "workloads": [s.__dict__ for s in summaries]}, indent=1, default=str))
    ok = totals["timed"] + totals["compiled"] + totals["resumed"]
    return 1 if crashes or ok == 0 else 0


def _utc_now() -> str:
    """The database's `created` format (UTC ISO, microseconds): rows of this run sort at
    or after it."""
    from datetime import datetime, timezone

    return datetime.now(timezone.utc).isoformat(timespec="microseconds")


def _summary_text(summaries: list, compile_only: bool, elapsed: float, db_path: Path) -> str:
    from .search.tuner import PHASES

    by_fam: dict[str, Counter] = defaultdict(Counter)
    phases: dict[str, Counter] = defaultdict(Counter)
    errors: Counter[str] = Counter()
    for s in summaries:
        c = by_fam[s.family]
        c["workloads"] += 1
        for k in ("evaluated", "resumed", "compiled", "compile_failed", "check_failed",
                  "run_failed", "timed"):
            c[k] += getattr(s, k)
        c["winners"] += s.winner is not None
        c["no_valid"] += (s.error or "").startswith("no valid")
        c["errors"] += s.error is not None and not (s.error or "").startswith("no valid")
        if s.stopped_by == "time_budget":
            c["budget_stops"] += 1
        if s.error:
            errors[s.error.splitlines()[0][:160]] += 1
        for k, v in s.phase_s.items():
            phases[s.family][k] += v
    head = ("COMPILE-ONLY PRE-FLIGHT (nothing was run or timed)" if compile_only
            else "TUNING SUMMARY")
    cols = ["family", "workloads", "compiled", "compile_failed"]
    if not compile_only:
        cols += ["check_failed", "run_failed", "timed", "winners", "budget_stops"]
    cols += ["resumed", "no_valid", "errors"]
    rows = [[fam] + [c[k] for k in cols[1:]] for fam, c in sorted(by_fam.items())]
    text = [f"\n{head}: {len(summaries)} workloads in {elapsed:.1f} s -> {db_path}",
            _table(cols, rows)]
    shown = [k for k in PHASES if any(p[k] for p in phases.values())]
    if shown:
        gpu = [k for k in ("prep", "check", "time") if k in shown]
        prow = []
        for fam, p in sorted(phases.items()):
            prow.append([fam] + [f"{p[k]:.1f}" for k in shown] +
                        [f"{sum(p[k] for k in gpu):.1f}"])
        tot = Counter()
        for p in phases.values():
            tot.update(p)
        prow.append(["TOTAL"] + [f"{tot[k]:.1f}" for k in shown] +
                    [f"{sum(tot[k] for k in gpu):.1f}"])
        text += ["seconds by phase (compile: summed over processes; wait: for the GPU lock; "
                 "GPU held = prep + check + time):",
                 _table(["family"] + shown + ["GPU held"], prow)]
    if errors:
        text.append("workload errors:")
        text += [f"  {n} x {msg}" for msg, n in errors.most_common(5)]
    return "\n".join(text)


# -- show -------------------------------------------------------------------------------------------
def _workload_label(key: str) -> str:
    d = json.loads(key)
    d.pop("op", None)
    return " ".join(f"{k}={v}" for k, v in sorted(d.items()))


def cmd_show(args: argparse.Namespace) -> int:
    from .db import DatabaseError, TuningDB
    from .search.build import variant_fingerprint
    from .search.family import get_family
    from .search.record import Status, pick_winner
    from .settings import settings

    _import_all(args.imports)
    path = args.db or settings().user_db
    try:
        db = TuningDB(path, readonly=True)
    except DatabaseError as e:
        print(f"resgen show: {e}", file=sys.stderr)
        return 2
    with db:
        rows = db.rows(op=args.op)
    groups: dict[tuple, list] = defaultdict(list)
    for r in rows:
        groups[(r["op"], r["workload_key"], r["gpu_name"], r["arch"])].append(r)
    out = []
    for (op, wkey, gpu, arch), rs in groups.items():
        counts = Counter(r["status"] for r in rs)
        timed = [r for r in rs if r["status"] == Status.OK]
        win = pick_winner(timed, _tie(timed)) if timed else None
        fresh = ""
        if win is not None:
            try:
                fam = get_family(win["family"])
                v = fam.VARIANT.from_key(win["variant_key"])
                p = fam.PROBLEM.from_key(wkey)
                fresh = "yes" if variant_fingerprint(fam, v, p, arch) == win["fingerprint"] \
                    else "STALE"
            except Exception:
                fresh = "?"
        out.append([op, _workload_label(wkey), gpu, win["variant_name"] if win else "-",
                    f"{win['median_us']:.2f}" if win else "-", fresh,
                    " ".join(f"{k}:{n}" for k, n in sorted(counts.items()))])
    if not out:
        print(f"{path}: no results")
        return 0
    print(_table(["op", "workload", "gpu", "winner", "us", "current", "results"], out))
    return 0


def _tie(rows: list) -> float:
    for r in rows:
        try:
            return float(json.loads(r["policy"])["tie_rel"])
        except Exception:
            continue
    return 0.01


# -- bench ------------------------------------------------------------------------------------------
def _load_baselines() -> Any:
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "bench" / "baselines.py"
    if not path.exists():
        raise RuntimeError(f"{path} not found: `resgen bench` runs from a source checkout")
    spec = importlib.util.spec_from_file_location("resgen_bench_baselines", path)
    mod = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(mod)
    return mod


def time_layer(fam: Any, v: Any, p: Any, arch: str, compiled: dict, policy: Any
               ) -> dict[str, Any]:
    """Compile variant v of family fam (once per compile key, memoized in `compiled`), check it
    against the reference (fresh inputs, poisoned output) and, if correct, time the whole layer
    as the tuner does (the layer quantizer in front of variants that read a prepared operand).
    Returns {"check": {"ok", "rel_err"}, "resgen_us"?}; raises on a compile failure."""
    from .search.build import compile_variant
    from .search.timing import measure
    from .search.tuner import working_set_bytes

    ck = (fam.NAME, v.key(), fam.compile_key(v, p).key())
    out = compiled.get(ck) or compile_variant(fam, v, p, arch)
    compiled[ck] = out
    if not out.ok:
        raise RuntimeError(out.error)
    n_sets = policy.sets_for(working_set_bytes(fam, v, p))
    runner = fam.runner(out.compiled, v, p, "cuda", n_sets=n_sets, seed=0)
    if hasattr(runner, "as_layer"):
        runner.as_layer()          # the whole layer, as the tuner timed it
    chk = runner.check()
    rec: dict[str, Any] = {"check": {"ok": chk.ok, "rel_err": chk.rel_err}}
    if chk.ok:
        rec["resgen_us"] = measure(runner, policy, n_sets).median_us
    else:
        rec["check"]["detail"] = chk.detail
    return rec


def cmd_bench(args: argparse.Namespace) -> int:
    if not _has_gpu():
        print("resgen bench needs a CUDA GPU (none found)", file=sys.stderr)
        return 2
    import torch

    from . import runtime
    from .models import get_model, linear_problems
    from .search.family import get_family
    from .search.record import current_environment
    from .search.timing import DEFAULT_POLICY

    _import_all(args.imports)
    bl = _load_baselines()
    env = current_environment()
    disp = runtime.Dispatcher(paths=[args.db] if args.db else None)
    policy = DEFAULT_POLICY
    models = [get_model(m) for m in args.model]
    rows, table = [], []
    base_cache: dict[tuple, dict] = {}
    compiled: dict[tuple, Any] = {}                 # one compile per compile key (M buckets)
    for p in linear_problems(models, args.tp, args.formats, args.compensations, args.m):
        rec: dict[str, Any] = {"problem": json.loads(p.key())}
        try:
            v = disp.lookup("linear", p)
            rec["variant"], rec["source"] = v.name(), disp.source("linear", p)
            rec.update(time_layer(get_family(type(v).FAMILY), v, p, env.arch, compiled,
                                  policy))
        except Exception as e:
            rec["error"] = f"{type(e).__name__}: {e}"[:500]
        key = (p.m, p.n, p.k, p.fmt == "mxfp4")
        if key not in base_cache:
            base_cache[key] = _bench_baselines(bl, p, policy)
        rec.update(base_cache[key])
        rows.append(rec)
        r_us, b_us, f_us = rec.get("resgen_us"), rec.get("bf16_us"), rec.get("fp8_us")
        t_us = rec.get("triton_us")
        wbytes = (bl.nvfp4_weight_bytes if p.fmt == "nvfp4" else bl.mxfp4_weight_bytes)(p.n, p.k)
        rec["floor_us"] = bl.floor_us(wbytes)
        pct = f"{100 * rec['floor_us'] / r_us:.0f}" if r_us else "-"
        table.append([p.fmt, p.compensation, p.m, f"{p.n}x{p.k}", _fmt(r_us), pct, _fmt(b_us),
                      _fmt(f_us), _ratio(b_us, r_us), _ratio(f_us, r_us), _ratio(t_us, r_us),
                      rec.get("variant", rec.get("error", ""))[:48]])
        torch.cuda.empty_cache()
    out_path = args.out or (Path(os.environ["OUT"]) / "bench.json" if os.environ.get("OUT")
                            else Path("bench/results/h200") / f"bench_{int(time.time())}.json")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps({"environment": env.as_dict(), "policy": policy.as_dict(),
                                    "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                                    "rows": rows}, indent=1))
    print(_table(["fmt", "comp", "M", "NxK", "resgen us", "%floor", "bf16 us", "fp8 us",
                  "x bf16", "x fp8", "x triton", "variant"], table))
    for line in _bench_sums(rows):
        print(line)
    print(f"-> {out_path}")
    return 0


def _bench_sums(rows: list[dict[str, Any]]) -> list[str]:
    """Per (format, compensation, M): the layers' summed whole-layer times against the summed
    baselines (the decode targets are sums over a model's projection shapes)."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        pr = r["problem"]
        groups.setdefault((pr["fmt"], pr["compensation"], pr["m"]), []).append(r)
    out = []
    for (fmt, comp, m), rs in groups.items():
        if not all(r.get("resgen_us") for r in rs):
            out.append(f"sum {fmt} {comp} M={m}: incomplete ({len(rs)} layers)")
            continue
        ours = sum(r["resgen_us"] for r in rs)
        line = f"sum {fmt} {comp} M={m} over {len(rs)} layers: {ours:.2f} us"
        for key, name in (("bf16_us", "cuBLAS BF16"), ("fp8_us", "cuBLAS FP8"),
                          ("triton_us", "Triton MXFP4"), ("floor_us", "HBM floor")):
            if all(r.get(key) for r in rs):
                tot = sum(r[key] for r in rs)
                line += (f"; {name} {tot:.2f} us (x{tot / ours:.2f})" if key != "floor_us"
                         else f"; {name} {tot:.2f} us ({100 * tot / ours:.0f}%)")
        out.append(line)
    return out


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _ratio(base: float | None, ours: float | None) -> str:
    return "-" if not base or not ours else f"{base / ours:.2f}"


def _bench_baselines(bl: Any, p: Any, policy: Any) -> dict[str, Any]:
    """torch.matmul BF16 and torch._scaled_mm FP8 per-tensor on the layer's shape (the FP8
    activation rows are padded to a multiple of 16, which _scaled_mm requires)."""
    import torch

    from .search.timing import CallableRunner, measure

    out: dict[str, Any] = {}
    wbytes = p.n * p.k * 2
    n_sets = policy.sets_for(wbytes)
    try:
        xs = [torch.randn(p.m, p.k, device="cuda", dtype=torch.bfloat16) for _ in range(n_sets)]
        ws = [torch.randn(p.n, p.k, device="cuda", dtype=torch.bfloat16) / p.k ** 0.5
              for _ in range(n_sets)]
        out["bf16_us"] = measure(CallableRunner([bl.cublas_bf16(x, w) for x, w in zip(xs, ws)]),
                                 policy, n_sets).median_us
        m16 = -(-p.m // 16) * 16
        xp = [torch.nn.functional.pad(x, (0, 0, 0, m16 - p.m)) for x in xs]
        out["fp8_us"] = measure(CallableRunner([bl.cublas_fp8(x, w) for x, w in zip(xp, ws)]),
                                policy, n_sets).median_us
        out["fp8_rows"] = m16
        if p.fmt == "mxfp4" and getattr(bl, "TRITON_AVAILABLE", False):
            out.update(_bench_triton(bl, xs[0], p, policy))
        del xs, ws, xp
    except Exception as e:
        out["baseline_error"] = f"{type(e).__name__}: {e}"[:500]
    return out


def _bench_triton(bl: Any, x: Any, p: Any, policy: Any) -> dict[str, Any]:
    """Triton MXFP4 x BF16 (bench/baselines.py triton_mxfp4, every form): each form is first
    checked against x @ dequantized weights (rel err <= 1e-2; a wrong form is recorded and not
    timed), then timed; triton_us is the fastest correct form."""
    import torch

    from . import formats
    from .search.timing import CallableRunner, measure

    forms: dict[str, Any] = {}
    n_sets = policy.sets_for(p.n * p.k // 2)
    qs = [formats.quantize(torch.randn(p.n, p.k, device="cuda"), "mxfp4") for _ in range(n_sets)]
    ref = x.float() @ formats.dequantize(qs[0]).T
    for form in bl.TRITON_FORMS:
        rec: dict[str, Any] = {}
        try:
            y = bl.triton_mxfp4(x, qs[0].codes, qs[0].scales, form=form)().float()
            rel = float((y - ref).norm() / ref.norm())
            rec["rel_err"] = rel
            if rel == rel and rel <= 1e-2:
                fns = [bl.triton_mxfp4(x, q.codes, q.scales, form=form) for q in qs]
                rec["us"] = measure(CallableRunner(fns), policy, n_sets).median_us
        except Exception as e:
            rec["error"] = f"{type(e).__name__}: {e}"[:300]
        forms[form] = rec
    timed = {f: r["us"] for f, r in forms.items() if "us" in r}
    out: dict[str, Any] = {"triton_forms": forms}
    if timed:
        best = min(timed, key=timed.get)
        out["triton_us"], out["triton_form"] = timed[best], best
    return out


# -- db ---------------------------------------------------------------------------------------------
def _parse_key(kind: str, key: str) -> str | None:
    """Validated parse of a stored key through its family's types; error text or None."""
    from .search.family import get_family

    try:
        d = json.loads(key)
        if kind == "variant":
            get_family(d.get("family")).VARIANT.from_dict(d)
        else:
            from .search.family import families

            classes = {f.PROBLEM for f in families().values() if f.PROBLEM.OP == d.get("op")}
            if not classes:
                return f"no registered family for op {d.get('op')!r}"
            errs = []
            for cls in classes:
                try:
                    cls.from_dict(d)
                    return None
                except ValueError as e:
                    errs.append(str(e))
            return "; ".join(errs)
    except ValueError as e:
        return str(e)
    return None


def _fresh_filter() -> Callable[[Any], bool]:
    """A predicate on database rows: tuned with what this checkout would compile (its family is
    registered, its variant and workload parse, and the fingerprint recorded for it is the one
    the current templates, kernel modules, compile options and versions give: the rule the
    runtime and the tuner use to tell stale results). Fingerprints are computed once per
    compile class."""
    from .search.build import memo_fingerprint
    from .search.family import get_family

    cache: dict[tuple, str] = {}

    def fresh(row) -> bool:
        try:
            fam = get_family(row["family"])
            v = fam.VARIANT.from_key(row["variant_key"])
            p = fam.PROBLEM.from_key(row["workload_key"])
            return memo_fingerprint(cache, fam, v, p, row["arch"]) == row["fingerprint"]
        except Exception:        # unparseable, unknown family or arch: not fresh
            return False

    return fresh


def cmd_db(args: argparse.Namespace) -> int:
    from .db import DatabaseError, TuningDB

    try:
        if args.dbcmd == "verify":
            _import_all(args.imports)
            with TuningDB(args.path, readonly=True) as db:
                rep = db.verify(parse=_parse_key)
            print(f"{args.path}: {'OK' if rep.ok else 'DAMAGED'}  " +
                  " ".join(f"{k}={v}" for k, v in rep.counts.items()))
            for e in rep.errors[:50]:
                print(f"  error: {e}")
            for w in rep.warnings[:50]:
                print(f"  warning: {w}")
            return 0 if rep.ok else 1
        if args.dbcmd == "merge":
            keep = _fresh_filter() if args.fresh_only else None
            with TuningDB(args.into) as dst:
                for src in args.sources:
                    with TuningDB(src, readonly=True) as s:
                        counts = dst.merge_from(s, keep=keep)
                    print(f"{src} -> {args.into}: {counts}")
            return 0
        if args.dbcmd == "export":
            fmt = args.format or ("sqlite" if args.out.name.endswith(
                (".sqlite", ".db", ".sqlite.xz", ".db.xz")) else "json")
            with TuningDB(args.path, readonly=True) as db:
                if fmt == "sqlite":
                    db.export_sqlite(args.out)
                else:
                    args.out.parent.mkdir(parents=True, exist_ok=True)
                    args.out.write_text(json.dumps(db.export_json(), indent=1))
            print(f"{args.path} -> {args.out} ({fmt})")
            return 0
    except (DatabaseError, FileExistsError) as e:
        print(f"resgen db {args.dbcmd}: {e}", file=sys.stderr)
        return 2
    return 2


# -- entry --------------------------------------------------------------------------------------------
def _quality(name: str, argv: list[str]) -> int:
    try:
        from .quality import cli as qcli
    except ImportError as e:
        print(f"resgen {name}: the quality package is not available ({e})", file=sys.stderr)
        return 2
    return int(getattr(qcli, f"{name}_main")(argv) or 0)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # report/plan own their flags (resgen.quality.cli parses them).
    rest = [a for a in argv if a not in ("-v", "-vv", "--verbose")]
    if rest and rest[0] in ("report", "plan"):
        return _quality(rest[0], rest[1:])
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING - 10 * min(args.verbose, 2),
                        format="%(levelname)s %(name)s: %(message)s")
    from .checkpoint import cli as checkpoint_cli
    from .engine.cli import run as cmd_generate

    handler = {"tune": cmd_tune, "show": cmd_show, "bench": cmd_bench, "db": cmd_db,
               "quantize": checkpoint_cli.run, "generate": cmd_generate}
    try:
        return handler[args.cmd](args)
    except BrokenPipeError:             # `resgen show | head`: the reader left, not an error
        sys.stdout = open(os.devnull, "w")
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
