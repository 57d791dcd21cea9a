"""The `resgen` command line.

    resgen tune --model qwen3-8b[,qwen3-32b,...|all] [--formats] [--ops] [--m-buckets] [--db]
                [--tp] [--resume] [--max-variants] [--time-budget] [--compile-only] [--jobs]
                [--policy tune|bench] [--search] [--coverage] [--plan]
    resgen show [--db]                      winners as a table
    resgen bench --model qwen3-8b [--db]    winners vs torch.matmul BF16 / _scaled_mm FP8 (GPU)
    resgen db verify|merge|export|refingerprint   database maintenance
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
import math
import os
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, Callable, Sequence

from .argtypes import positive_int

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
                   default=["none", "full", "0.125", "0.25", "0.5", "1.0"],
                   help="none (W4A4), full (M-Ext), K-Ext ratios 0.125 / 0.25 / 0.5 / 1.0, or "
                        "w4a16 (BF16 activations, the Hopper-native mode; not in the default "
                        "list until the shipped table covers it)")
    t.add_argument("--kext-folds", type=_csv(str), default=["exact"],
                   help="K-Ext folds to tune: exact (extension columns: Blackwell's "
                        "numerics) and/or presum (residues onto their base channels, one "
                        "FP16 GEMM over K: K-Ext at plain cost on Hopper, NVFP4 only, its own "
                        "numerics: resgen.reference.linear(fold='presum'))")
    t.add_argument("--ops", type=_csv(str), default=None,
                   help="ops to tune (default: every op with a family for the arch)")
    t.add_argument("--families", type=_csv(str), default=None,
                   help="restrict to these kernel families")
    t.add_argument("--m-buckets", type=_csv(positive_int), default=list(DEFAULT_M_BUCKETS))
    t.add_argument("--attn-batches", type=_csv(positive_int), default=list(DEFAULT_ATTN_BATCHES))
    t.add_argument("--kv-lens", type=_csv(positive_int), default=list(DEFAULT_KV_LENS))
    t.add_argument("--attn-pv", type=_csv(str), default=["f16", "fp8"],
                   help="decode attention P.V numerics to tune (f16, fp8)")
    t.add_argument("--attn-modes", type=_csv(str), default=["resattn", "plain"],
                   help="decode attention modes to tune: resattn, plain, q16 (the FP16 query "
                        "x NVFP4 K/V, the Hopper-native mode; not in the default list until "
                        "the shipped table covers it)")
    t.add_argument("--tp", type=positive_int, default=1)
    t.add_argument("--db", type=Path, default=None,
                   help="output database (default: the user's cache database)")
    t.add_argument("--resume", action=argparse.BooleanOptionalAction, default=True,
                   help="skip variants already stored for this fingerprint and environment "
                        "(default); --no-resume re-times and replaces them")
    t.add_argument("--max-variants", type=positive_int, default=16,
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
    t.add_argument("--full-preflight", action="store_true",
                   help="compile-only runs: every workload, up to --max-variants variants "
                        "each (default: a covering subset of the workloads and of their "
                        "variants, every format, mode, bucket, shape and axis value at least "
                        "once: a few minutes on a 2-core CPU)")
    t.add_argument("--arch", default=None, help="compile target (default: the GPU's, or "
                   "RESGEN_ARCH / sm_90a without one)")
    t.add_argument("--jobs", type=positive_int, default=None,
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
    t.add_argument("--coordinator", default=None, metavar="URL",
                   help="tune together with every other `resgen tune` given the same URL (one "
                        "per GPU, on one or many hosts): work is drawn from one optuna study "
                        "on this PostgreSQL server (postgresql://USER@HOST:PORT/DB), results "
                        "go to each host's --db as always (`resgen db merge` gathers them); "
                        "default: RESGEN_COORDINATOR, 'none' for no coordinator; needs "
                        "pip install 'resgen[dist]' (docs/distributed_tuning.md)")
    t.add_argument("--coordinator-run", default=None, metavar="TAG",
                   help="with --coordinator and --no-resume: names this re-measure run (the "
                        "same on every host): only its own timings count")
    t.add_argument("--coordinator-grace", type=positive_int, default=30, metavar="S",
                   help="with --coordinator: a trial whose process sent no heartbeat for S "
                        "seconds (killed, host down) is failed and re-queued (default 30)")

    s = sub.add_parser("show", help="winners per workload as a table")
    s.add_argument("--db", type=Path, default=None)
    s.add_argument("--op", default=None)
    s.add_argument("--import", dest="imports", action="append", default=[])

    b = sub.add_parser("bench", help="dispatched winners, whole layer, vs torch.matmul BF16, "
                                     "_scaled_mm FP8 (torch-op quant, pre-quantized, fused "
                                     "per-token quant), vLLM Marlin W4A16 (if built: "
                                     "bench/marlin_setup.sh), Triton MXFP4 and the HBM floor "
                                     "(GPU)")
    b.add_argument("--model", required=True, type=_csv(str))
    b.add_argument("--db", type=Path, default=None)
    b.add_argument("--tp", type=positive_int, default=1)
    b.add_argument("--m", type=_csv(positive_int), default=[1, 16])
    b.add_argument("--formats", type=_csv(str), default=["nvfp4", "mxfp4"])
    b.add_argument("--compensations", type=_csv(str), default=["none", "full"],
                   help="modes to time (none, full, a K-Ext ratio, w4a16); 'x none' compares "
                        "each with resgen plain W4A4 on the same layer")
    b.add_argument("--kext-folds", type=_csv(str), default=["exact"],
                   help="K-Ext folds to time (exact, presum: as for tune)")
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
                   help="also drop results whose fingerprint does not match this checkout's "
                        "templates, kernel modules and versions (stale ones)")
    m.add_argument("--all-rows", action="store_true",
                   help="copy every result whose checksum holds, parseable or not (forensics; "
                        "by default only rows the runtime could accept are merged: registered "
                        "family, keys that parse, numbers in range, valid for the workload)")
    m.add_argument("--on-conflict", choices=["refuse", "first", "union"], default="refuse",
                   help="when sources rank the variants they both measured differently for a "
                        "workload (its winner would depend on which timings the table keeps): "
                        "refuse (default: nothing is written), first (that workload's rows "
                        "come from the first source that has any; the existing --into rows "
                        "count first), union (keep all; the runtime's rule picks over them); "
                        "see resgen/db/consistency.py")
    m.add_argument("--import", dest="imports", action="append", default=[])
    e = dsub.add_parser("export", help="to JSON, or a compact read-only-friendly SQLite copy "
                        "(xz-compressed when --out ends in .xz, as tuned/ ships it)")
    e.add_argument("path", type=Path)
    e.add_argument("--out", type=Path, required=True)
    e.add_argument("--format", choices=["json", "sqlite"], default=None,
                   help="default: from the --out suffix")
    e.add_argument("--winners", action="store_true",
                   help="only the winning timed row per workload and GPU (a small SQLite "
                        "database to share; `resgen db merge` imports it)")
    e.add_argument("--fresh-only", action="store_true",
                   help="with --winners: choose among rows tuned with this checkout's "
                        "templates and versions only")
    r = dsub.add_parser("refingerprint",
                        help="give rows the new code's fingerprints where the kernel is "
                             "provably unchanged since --from (resgen/db/refingerprint.py)")
    r.add_argument("--db", type=Path, required=True,
                   help="the tuning database (.sqlite, or .sqlite.xz as tuned/ ships it)")
    r.add_argument("--from", dest="from_rev", required=True, metavar="GIT_REV",
                   help="the revision the rows were tuned with (git archive REV resgen)")
    r.add_argument("--repo", type=Path, default=None,
                   help="the git repository --from names (default: the one holding the "
                        "running resgen, which is the new side)")
    r.add_argument("--out", type=Path, default=None,
                   help="write a new database here (xz when it ends in .xz); default: in place")
    r.add_argument("--workers", type=positive_int, default=1,
                   help="child processes per side for renders and compiles (both sides run "
                        "at once: 2 x N processes; default 1)")
    r.add_argument("--winners-only", action="store_true",
                   help="only each workload's winning timed row (as `db export --winners`)")
    r.add_argument("--family", dest="families", action="append", default=None,
                   help="only rows of this family (repeatable; a staged migration)")
    r.add_argument("--check-ptx", choices=["auto", "always", "never"], default="auto",
                   help="tier 2, compile both renders on the CPU and compare PTX and host IR: "
                        "auto (rows tier 1 cannot decide), always (every row), never")
    r.add_argument("--dry-run", action="store_true", help="report only, write nothing")
    r.add_argument("--json", action="store_true", help="the summary as one JSON line too")

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
    from .search.device import has_gpu

    return has_gpu()


def _import_all(mods: Sequence[str]) -> None:
    """--import: modules that register out-of-tree families (a bad name is a usage error)."""
    import importlib

    for mod in mods:
        try:
            importlib.import_module(mod)
        except ImportError as e:
            raise _Usage(f"--import {mod}: {e}") from None


class _Progress:
    """A tqdm bar on a terminal; into a log (stderr not a terminal) one line per 10 % of the
    work or per minute instead of thousands of carriage-return updates (tqdm, a dependency,
    has no line-oriented mode: it redraws with carriage returns at any interval)."""

    def __init__(self, total: int, desc: str, stream: Any = None) -> None:
        self.total, self.n, self.desc = total, 0, desc
        self.stream = stream or sys.stderr
        self._last_t, self._last_step = time.monotonic(), 0
        self.bar = None
        if getattr(self.stream, "isatty", lambda: False)():
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=desc, unit="workload", file=self.stream)

    def update(self, postfix: str) -> None:
        self.n += 1
        if self.bar is not None:
            self.bar.set_postfix_str(postfix, refresh=False)
            self.bar.update(1)
            return
        step = (10 * self.n) // max(self.total, 1)            # tenths done
        if step > self._last_step or self.n == self.total or \
                time.monotonic() - self._last_t > 60:
            self._last_step, self._last_t = step, time.monotonic()
            print(f"{self.desc}: {self.n}/{self.total} workloads  {postfix}", file=self.stream,
                  flush=True)

    def write(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line, file=self.stream)
        else:
            print(line, file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    from .search.tuneplan import table

    return table(headers, rows)


# -- tune ------------------------------------------------------------------------------------------
class _Usage(Exception):
    """A user error: printed as one line, exit code 2."""


def _compiler_missing(fams: Sequence[Any]) -> str | None:
    """The install hint when a built-in family (they all compile with CuTe DSL) is selected
    and the kernel compiler is not importable; None when it is (or only out-of-tree families
    run, which bring their own compilers)."""
    import importlib.util

    if not any(type(f).__module__.startswith("resgen.") for f in fams):
        return None
    try:
        found = importlib.util.find_spec("cutlass") is not None
    except (ImportError, ValueError):
        found = False
    if found:
        return None
    return ("the CuTe DSL kernel compiler (nvidia-cutlass-dsl 4.8.1, module 'cutlass') is not "
            "installed: run scripts/install.sh, or pip install 'resgen[kernels]'")


def _tune_families(args: argparse.Namespace, arch: str) -> list[Any]:
    from .search.family import families

    known = families()
    if args.families:
        unknown = set(args.families) - set(known)
        if unknown:
            raise _Usage(f"unknown families {sorted(unknown)} (registered: {sorted(known)})")
    fams = [f for f in known.values() if arch in f.ARCHS
            and (not args.families or f.NAME in args.families)
            and (not args.ops or f.PROBLEM.OP in args.ops)]
    if not fams:
        raise _Usage(f"no kernel family for ops {args.ops or 'any'} on {arch} (registered: "
                     f"{sorted(known)})")
    return sorted(fams, key=lambda f: f.NAME)


def _tune_workloads(args: argparse.Namespace, fams: Sequence[Any], models: Sequence[Any],
                    preflight: str | None) -> tuple[dict, dict, list]:
    """(problems per family, workloads per model per family, jobs) of a run; raises
    ValueError for a bad format, compensation, bucket or tp (the problem constructors
    validate)."""
    from .models import tuning_workloads
    from .search.orchestrate import Job
    from .search.tuneplan import preflight_workloads

    kw = dict(tp=args.tp, formats=args.formats, compensations=args.compensations,
              m_buckets=args.m_buckets, attn_batches=args.attn_batches, kv_lens=args.kv_lens,
              attn_pv=args.attn_pv, attn_modes=args.attn_modes, kext_folds=args.kext_folds)
    problems: dict[str, list] = {}
    per_model: dict[str, dict[str, int]] = {}
    jobs: list = []
    for fam in fams:
        probs = tuning_workloads(fam, models, **kw)      # deduplicated across the models
        if preflight is not None:
            probs = preflight_workloads(probs, preflight)
        problems[fam.NAME] = probs
        per_model[fam.NAME] = ({m.name: len(tuning_workloads(fam, [m], **kw)) for m in models}
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
    return problems, per_model, jobs


def _check_output_db(path: Path) -> None:
    """An existing output database must be ours (refused before anything is created)."""
    from .db import DatabaseError, TuningDB

    if path.is_dir():
        raise _Usage(f"--db {path}: a directory, not a database file")
    if path.exists():
        try:
            TuningDB(path, readonly=True).close()
        except DatabaseError as e:
            raise _Usage(f"--db {e}") from None


def _check_warm_start(path: Path | None) -> None:
    from .db import DatabaseError, TuningDB

    if path is None:
        return
    # a typo must not silently tune without the hint: the table must open and be ours
    try:
        with TuningDB(path, readonly=True) as db:
            rep = db.verify()
    except DatabaseError as e:
        raise _Usage(f"--warm-start {path}: {e}") from None
    if not rep.ok:
        raise _Usage(f"--warm-start {path} fails verification: {'; '.join(rep.errors[:3])}")


def _coordinator_config(args: argparse.Namespace) -> Any:
    """--coordinator (or RESGEN_COORDINATOR) as a CoordinatorConfig, None without one; the
    URL and the flags that go with it are checked here, before anything is created."""
    from .settings import settings

    url = args.coordinator if args.coordinator is not None else settings().coordinator
    if not url or url.strip().lower() in ("none", "off"):
        if args.coordinator_run:
            raise _Usage("--coordinator-run needs --coordinator")
        return None
    from .search.coordinator import CoordinatorConfig, CoordinatorError, check_url

    if args.shard is not None:
        raise _Usage("--shard and --coordinator both split the work: use one of them")
    if not args.resume and not args.coordinator_run:
        raise _Usage("--no-resume with --coordinator needs --coordinator-run TAG (the same on "
                     "every host) so that the hosts agree on which timings are this run's")
    try:
        check_url(url)
        grace = args.coordinator_grace
        return CoordinatorConfig(url=url, grace_s=max(2, grace),
                                 heartbeat_s=max(1, min(10, grace // 6)),
                                 run_tag=args.coordinator_run)
    except CoordinatorError as e:
        raise _Usage(str(e)) from None
    except ValueError as e:
        raise _Usage(f"--coordinator-grace: {e}") from None


def _probe_coordinator(cfg: Any, env: Any) -> None:
    from .search.coordinator import CoordinatorError, probe

    try:
        probe(cfg, env)
    except CoordinatorError as e:
        raise _Usage(str(e)) from None


def _preflight_note(arch: str, preflight: str, max_variants: int) -> str:
    what = ("a covering subset of the workloads and of each one's variants: every format, "
            "mode, bucket, shape and axis value compiled at least once; --full-preflight "
            "compiles every workload" if preflight == "cover" else
            f"every workload, up to --max-variants={max_variants} variants each")
    return (f"No CUDA GPU found: running the COMPILE-ONLY pre-flight for {arch} instead "
            f"({what}); nothing is run or timed; results are stored with status 'compiled' "
            "under a compile-only environment.")


def cmd_tune(args: argparse.Namespace) -> int:
    try:
        return _tune(args)
    except _Usage as e:
        print(f"resgen tune: {e}", file=sys.stderr)
        return 2


def _tune(args: argparse.Namespace) -> int:
    from .db import DatabaseError, TuningDB, warm_start_rows
    from .models import get_models
    from .search import device
    from .search.orchestrate import TuneInterrupted, run_jobs
    from .search.record import compile_only_environment, current_environment
    from .search.timing import policy_named
    from .search.tuneplan import measured_costs, plan_run
    from .search.tuner import TuneConfig, stages_of
    from .settings import settings

    started = time.monotonic()            # the budget counts from here: setup included
    started_utc = _utc_now()
    # -- parse: everything is validated before anything is created -----------------------
    budget = args.time_budget
    if budget is not None and not (math.isfinite(budget) and budget > 0):
        raise _Usage(f"--time-budget {budget}: need a positive number of seconds")
    if not (math.isfinite(args.hard_stop) and args.hard_stop >= 0):
        raise _Usage(f"--hard-stop {args.hard_stop}: need a non-negative number of seconds")
    _import_all(args.imports)
    coordinator = _coordinator_config(args)
    try:
        models = get_models(args.model)
    except ValueError as e:
        raise _Usage(str(e)) from None
    gpu = _has_gpu()
    compile_only = args.compile_only or not gpu
    if compile_only:
        arch = args.arch or settings().arch
        env = compile_only_environment(arch)
        # --plan on a machine without a GPU plans the GPU run (unless --compile-only).
        compile_only = args.compile_only or not args.plan
    else:
        env = current_environment()
        arch = args.arch or env.arch
        if arch != env.arch:
            raise _Usage(f"--arch {arch} differs from this GPU's {env.arch}: use --compile-only")
    fams = _tune_families(args, arch)
    preflight = ("full" if args.full_preflight else "cover") if compile_only else None
    try:
        problems, per_model, jobs = _tune_workloads(args, fams, models, preflight)
    except ValueError as e:
        raise _Usage(str(e)) from None
    if not jobs:
        raise _Usage("no workloads to tune")
    _check_warm_start(args.warm_start)
    db_path = Path(args.db or settings().user_db)
    _check_output_db(db_path)
    if not args.plan:
        missing = _compiler_missing(fams)
        if missing:
            raise _Usage(missing)
    if budget is None and not compile_only:
        budget = 480.0
    try:
        config = TuneConfig(
            arch=arch, policy=policy_named(args.policy), max_variants=args.max_variants,
            time_budget_s=budget, resume=args.resume, compile_only=compile_only,
            seed=args.seed, timer=args.timer, search=args.search, coverage=args.coverage,
            gpu_lock=None if compile_only else device.gpu_lock_path(settings().cache_dir),
            hard_stop_grace_s=args.hard_stop,
            resume_since=None if args.resume else started_utc,
            warm_start=str(args.warm_start) if args.warm_start else None,
            warm_start_reader=warm_start_rows if args.warm_start else None,
            preflight=preflight or "full")
    except ValueError as e:
        raise _Usage(str(e)) from None
    if coordinator is not None and not args.plan:
        _probe_coordinator(coordinator, env)     # unreachable: one line, before anything runs
    workers = args.jobs or config.default_workers(
        plan_gpu_host=args.plan and not gpu and not compile_only)
    measured = None
    if db_path.exists():
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
    # -- call ------------------------------------------------------------------------------
    if not gpu and not args.compile_only:
        print(_preflight_note(arch, config.preflight, args.max_variants), file=sys.stderr)
    print(plan.text(), file=sys.stderr)
    try:
        TuningDB(db_path).close()                 # create before starting workers
    except DatabaseError as e:
        raise _Usage(f"--db {e}") from None
    left = None if budget is None else max(1.0, budget - (time.monotonic() - started))
    config.time_budget_s = left
    stages = stages_of(config)
    label = "compile-only pre-flight" if compile_only else f"tuning on {env.gpu_name}"
    print(f"resgen tune: {label}, arch {arch}, {len(jobs)} workloads, stages "
          f"{'+'.join(stages)}, {workers} process(es), budget {budget or 'none'} s, policy "
          f"{config.policy.label}, database {db_path}", file=sys.stderr)
    progress = _TuneProgress(len(jobs) * (1 if coordinator else len(stages)), compile_only)
    modules = list(args.imports) + sorted({type(f).__module__ for f in fams})
    interrupted = False
    try:
        # On a GPU the tuning always runs in worker processes: one whose CUDA context a
        # broken variant poisons is replaced, and the run goes on.
        if coordinator is not None:
            from .search.coordinator import CoordinatorError
            from .search.distributed import run_distributed

            try:
                summaries = run_distributed(
                    jobs, functools.partial(TuningDB, db_path), env, config, coordinator,
                    workers=workers, isolate=not compile_only, modules=modules,
                    on_event=progress.on_event)
            except CoordinatorError as e:
                raise _Usage(str(e)) from None
        else:
            summaries = run_jobs(jobs, functools.partial(TuningDB, db_path), env, config,
                                 workers=workers, isolate=not compile_only, modules=modules,
                                 on_event=progress.on_event)
    except TuneInterrupted as e:
        summaries, interrupted = e.summaries, True
    progress.close()
    # -- print -------------------------------------------------------------------------------
    elapsed = time.monotonic() - started
    print(_summary_text(summaries, compile_only, elapsed, db_path), flush=True)
    progress.report()
    if args.json:
        _write_tune_json(args.json, summaries, progress, config, plan, env, models, db_path,
                         elapsed, workers, budget, compile_only, interrupted)
    if interrupted:
        stored = _stored_since(db_path, started_utc)
        print(f"\ninterrupted: {stored} results of this run are stored in {db_path}; run the "
              "same command again to resume (stored variants are skipped, the one in flight "
              "is tried again)", file=sys.stderr)
        return 130
    ok = progress.totals["timed"] + progress.totals["compiled"] + progress.totals["resumed"]
    return 1 if progress.crashes or ok == 0 else 0


def _stored_since(path: Path, since: str) -> int | str:
    from .db import TuningDB

    try:
        with TuningDB(path, readonly=True) as db:
            return db.count(since=since)
    except Exception:
        return "?"


class _TuneProgress:
    """The run's events: a progress bar and the counts, crashes and disabled families the
    summary prints."""

    def __init__(self, total: int, compile_only: bool) -> None:
        self.bar = _Progress(total, "compile-only" if compile_only else "tune")
        self.totals: Counter[str] = Counter()
        self.crashes: list[str] = []
        self.disabled: list[str] = []

    def on_event(self, kind: str, obj: Any) -> None:
        t = self.totals
        if kind == "done":
            for k in ("compiled", "compile_failed", "check_failed", "run_failed", "timed",
                      "resumed"):
                t[k] += getattr(obj, k)
            t["errors"] += obj.error is not None
            failed = t["compile_failed"] + t["check_failed"] + t["run_failed"]
            self.bar.update(f"{obj.stage}: compiled {t['compiled']} timed {t['timed']} "
                            f"failed {failed}")
        elif kind == "crash":
            self.crashes.append(str(obj))
        elif kind == "lost":
            t["lost"] += 1
            self.bar.write(f"replacing a tuner process: {obj}")
        elif kind == "disabled":
            self.disabled.append(str(obj))
            self.bar.write(str(obj))
        elif kind == "note":                   # the coordinator's progress lines
            self.bar.write(str(obj))

    def close(self) -> None:
        self.bar.close()

    def report(self) -> None:
        if self.totals["lost"]:
            print(f"{self.totals['lost']} tuner process(es) were replaced after a variant broke "
                  "the CUDA context (those variants are stored as run_failed)")
        for c in self.crashes:
            print(f"tuner process crashed: {c}", file=sys.stderr)
        for d in self.disabled:
            print(d)


def _write_tune_json(path: Path, summaries: list, progress: _TuneProgress, config: Any,
                     plan: Any, env: Any, models: list, db_path: Path, elapsed: float,
                     workers: int, budget: float | None, compile_only: bool,
                     interrupted: bool) -> None:
    from .search.tuner import PHASES, stages_of

    phase_totals = {k: sum(s.phase_s.get(k, 0.0) for s in summaries) for k in PHASES}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({
        "mode": "compile-only" if compile_only else "tune", "arch": config.arch,
        "preflight": config.preflight if compile_only else None,
        "environment": env.as_dict(), "database": str(db_path), "seconds": elapsed,
        "workers": workers, "time_budget_s": budget, "policy": config.policy.as_dict(),
        "stages": list(stages_of(config)), "crashes": progress.crashes,
        "disabled": progress.disabled, "interrupted": interrupted, "plan": plan.as_dict(),
        "phase_s": phase_totals, "models": [m.name for m in models],
        "workloads": [s.__dict__ for s in summaries]}, indent=1, default=str))


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
    if shown and compile_only:
        prow = [[fam, f"{p['compile']:.1f}"] for fam, p in sorted(phases.items())]
        prow.append(["TOTAL", f"{sum(p['compile'] for p in phases.values()):.1f}"])
        text += ["compile seconds (summed over processes):",
                 _table(["family", "compile"], prow)]
    elif shown:
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


# -- show ------------------------------------------------------------------------------------------
def _printable(text: Any, limit: int = 80) -> str:
    """Untrusted text (a GPU name from a shared table) as one printable line: control and
    other non-printable characters escaped, cut to `limit` characters."""
    out = "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(text))
    return out if len(out) <= limit else out[:limit - 3] + "..."


def _workload_label(problem: Any) -> str:
    d = problem.as_dict()
    d.pop("op", None)
    return " ".join(f"{k}={v}" for k, v in sorted(d.items()))


def _parsed(row: Any) -> tuple[Any, Any, Any] | None:
    """(family, problem, variant) of a stored row, parsed through the family's types and
    matched against the stored digests; None if any of it fails (nothing else is shown)."""
    from .search.family import get_family

    try:
        fam = get_family(row["family"])
        p = fam.PROBLEM.from_key(row["workload_key"])
        v = fam.VARIANT.from_key(row["variant_key"])
    except Exception:
        return None
    if p.digest() != row["workload_digest"] or v.digest() != row["variant_digest"]:
        return None
    return fam, p, v


def _intact(row: Any) -> bool:
    from .db import row_checksum

    try:
        return row_checksum(row, row["environment_digest"], row["workload_digest"],
                            row["variant_digest"]) == row["checksum"]
    except (TypeError, ValueError):
        return False


def cmd_show(args: argparse.Namespace) -> int:
    """With --db: that file's winners per workload. Without: what the runtime would serve
    (resgen.runtime's databases in its order, the shipped table included), per GPU."""
    _import_all(args.imports)
    if args.db is None:
        return _show_served(args)
    from .db import DatabaseError, TuningDB
    from .search.build import variant_fingerprint
    from .search.record import Status, pick_winner, stored_timing

    try:
        with TuningDB(args.db, readonly=True) as db:
            rows = db.rows(op=args.op)
    except DatabaseError as e:
        print(f"resgen show: {e}", file=sys.stderr)
        return 2
    groups: dict[tuple, list] = defaultdict(list)
    unparsed = 0
    for r in rows:
        got = _parsed(r) if _intact(r) else None
        if got is None:
            unparsed += 1
            continue
        groups[(got[1].key(), r["gpu_name"], r["arch"])].append((r, got))
    out = []
    for (_, gpu, arch), rs in groups.items():
        counts = Counter(str(r["status"]) if r["status"] in Status.ALL else "?" for r, _ in rs)
        timed = []
        for r, got in rs:
            if r["status"] != Status.OK:
                continue
            try:
                t = stored_timing(r)
            except ValueError:
                counts["bad_numbers"] += 1
                continue
            timed.append({"median_us": t.median_us, "space_index": t.space_index,
                          "tie": t.tie_rel, "row": r, "got": got})
        win = pick_winner(timed, min((t["tie"] for t in timed), default=0.01))
        _, problem, _ = rs[0][1]
        name, us, fresh = "-", "-", ""
        if win is not None:
            fam, p, v = win["got"]
            name, us = v.name(), f"{win['median_us']:.2f}"
            try:
                fresh = "yes" if variant_fingerprint(fam, v, p, arch) == \
                    win["row"]["fingerprint"] else "STALE"
            except Exception:
                fresh = "?"
        out.append([problem.OP, _workload_label(problem), _printable(gpu, 40), name, us, fresh,
                    " ".join(f"{k}:{n}" for k, n in sorted(counts.items()))])
    if not out:
        print(f"{args.db}: no results" + (f" ({unparsed} rows that do not parse or fail their "
                                          "checksum, not shown)" if unparsed else ""))
        return 0
    print(_table(["op", "workload", "gpu", "winner", "us", "current", "results"], out))
    if unparsed:
        print(f"({unparsed} rows that do not parse or fail their checksum are not shown; "
              f"`resgen db verify {args.db}` lists them)")
    return 0


def _show_devices() -> list[Any]:
    """The GPUs to show the runtime's answers for: this machine's, else every GPU with timed
    results in a database the runtime would consult (the shipped tables included)."""
    from .db import TuningDB
    from .runtime import Device
    from .settings import settings

    dev = Device.current()
    if dev is not None:
        return [dev]
    s = settings()
    paths = [p for p in (s.db_path, s.user_db) if p is not None]
    tuned = Path(s.tuned_dir)
    if tuned.is_dir():
        paths += sorted(tuned.glob("*.sqlite")) + sorted(tuned.glob("*.sqlite.xz"))
    found: list[Any] = []
    for p in paths:
        try:
            with TuningDB(p, readonly=True) as db:
                envs = db.environments()
        except Exception:
            continue
        for e in envs:
            if e.get("compile_only") or not isinstance(e.get("gpu_name"), str) or \
                    not isinstance(e.get("arch"), str):
                continue
            d = Device(e["gpu_name"], e["arch"])
            if d not in found:
                found.append(d)
    return found


def _show_served(args: argparse.Namespace) -> int:
    from .runtime import Dispatcher, default_db_paths

    from .runtime import Device

    here = Device.current()
    devices = _show_devices()
    if not devices:
        print("resgen show: no tuned results for any GPU in the runtime's databases "
              f"({', '.join(str(p) for p in default_db_paths(None))}, and no shipped table); "
              "`resgen show --db PATH` shows one file", file=sys.stderr)
        return 0
    for dev in devices:
        disp = Dispatcher(device=dev)
        out = []
        for op, p in disp.tuned(args.op):
            v, src, med = disp.served(op, p)
            out.append([op, _workload_label(p), v.name(), "-" if med is None else f"{med:.2f}",
                        _printable(src, 120)])
        where = ", ".join(str(x) for x in disp.paths)
        print(f"What the runtime serves on {_printable(dev.gpu_name, 40)} ({dev.arch}) from "
              f"{where}" + ("" if dev == here else " (not this machine's GPU: what it would "
                                                    "serve there)"))
        if out:
            print(_table(["op", "workload", "served", "us", "from"], out))
        else:
            print("  nothing tuned")
    return 0


# -- bench -----------------------------------------------------------------------------------------
def _load_baselines() -> Any:
    """cuBLAS BF16 / FP8 (three forms), Marlin W4A16, Triton MXFP4 and the HBM floor
    (resgen.baselines: package code, so `resgen bench` works from an installed copy)."""
    from . import baselines

    return baselines


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
    from .models import get_models, linear_problems

    try:
        models = get_models(args.model)
        problems = linear_problems(models, args.tp, args.formats, args.compensations, args.m,
                                   kext_folds=args.kext_folds)
    except ValueError as e:
        print(f"resgen bench: {e}", file=sys.stderr)
        return 2
    if not _has_gpu():
        print("resgen bench needs a CUDA GPU (none found)", file=sys.stderr)
        return 2
    import torch

    from . import runtime
    from .search.family import get_family
    from .search.record import current_environment
    from .search.timing import DEFAULT_POLICY

    _import_all(args.imports)
    bl = _load_baselines()
    env = current_environment()
    disp = runtime.Dispatcher(paths=[args.db] if args.db else None)
    policy = DEFAULT_POLICY
    rows = []
    base_cache: dict[tuple, dict] = {}
    compiled: dict[tuple, Any] = {}                 # one compile per compile key (M buckets)
    for p in problems:
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
        wbytes = (bl.nvfp4_weight_bytes if p.fmt == "nvfp4" else bl.mxfp4_weight_bytes)(p.n, p.k)
        rec["floor_us"] = bl.floor_us(wbytes)
        torch.cuda.empty_cache()
    out_path = args.out or (Path(os.environ["OUT"]) / "bench.json" if os.environ.get("OUT")
                            else Path("bench/results/h200") / f"bench_{int(time.time())}.json")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps({"environment": env.as_dict(), "policy": policy.as_dict(),
                                    "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                                    "rows": rows}, indent=1))
    print(_bench_table(rows))
    for line in _bench_sums(rows):
        print(line)
    for why in sorted({r["marlin_error"] for r in rows if r.get("marlin_error")}):
        print(f"note: no Marlin W4A16 baseline: {why}")
    print(f"-> {out_path}")
    return 0


# The baselines `resgen bench` times, as (JSON key, name in the sums); the table's ratio
# columns follow this order. fp8_us is the per-tensor FP8 form quantized by torch ops (the key
# the first bench JSON files and bench/report read); the fair W8A8 forms are, rowwise,
# fp8_prequant_us (activations quantized outside the timed call) and fp8_fused_us (one fused
# per-token quantization kernel, as a serving engine runs) and, per tensor,
# fp8_tensor_prequant_us (quantized outside the timed call: the lower bound, since cuBLAS's
# per-tensor kernels are the faster ones at small M) and fp8_static_us (a static calibrated
# activation scale and one cast kernel, as an engine serves a static-FP8 checkpoint).
BASELINE_COLUMNS: tuple[tuple[str, str], ...] = (
    ("bf16_us", "cuBLAS BF16"), ("fp8_us", "cuBLAS FP8 torch-quant"),
    ("fp8_prequant_us", "cuBLAS FP8 prequant"), ("fp8_fused_us", "cuBLAS FP8 fused-quant"),
    ("fp8_tensor_prequant_us", "cuBLAS FP8 per-tensor prequant"),
    ("fp8_static_us", "cuBLAS FP8 static-scale"),
    ("marlin_us", "Marlin W4A16"), ("triton_us", "Triton MXFP4"))
_SHORT = {"bf16_us": "bf16", "fp8_us": "fp8tq", "fp8_prequant_us": "fp8pre",
          "fp8_fused_us": "fp8fused", "fp8_tensor_prequant_us": "fp8tpre",
          "fp8_static_us": "fp8static", "marlin_us": "marlin", "triton_us": "triton"}
# The FP8 forms (BASELINE_COLUMNS key -> baselines function, its quantizer for the check)
FP8_FORMS: tuple[tuple[str, str, str | None], ...] = (
    ("fp8_us", "cublas_fp8_torch_quant", None),
    ("fp8_prequant_us", "cublas_fp8_prequant", "fp8_rowwise_quant"),
    ("fp8_fused_us", "cublas_fp8_fused", "fp8_rowwise_quant"),
    ("fp8_tensor_prequant_us", "cublas_fp8_tensor_prequant", "fp8_tensor_quant"),
    ("fp8_static_us", "cublas_fp8_static", "fp8_tensor_quant"))


def _mode(problem: dict[str, Any]) -> str:
    """A bench row's mode label: its compensation, "+presum" for a K-Ext presum workload
    (LinearProblem.fold), so the two K-Ext folds are reported apart."""
    comp = str(problem["compensation"])
    return comp + "+presum" if problem.get("fold") == "presum" else comp


def _bench_table(rows: list[dict[str, Any]]) -> str:
    """One line per layer: resgen's time, its share of the HBM floor, each baseline's time and
    baseline / resgen (x > 1: resgen is faster), and resgen plain W4A4 ("none") / this mode
    on the same layer. Columns: BASELINE_COLUMNS' order; '-' where a time is missing."""
    plain = {(r["problem"]["fmt"], r["problem"]["m"], r["problem"]["n"], r["problem"]["k"]):
             r.get("resgen_us") for r in rows if _mode(r["problem"]) == "none"}
    keys = [k for k, _ in BASELINE_COLUMNS]
    table = []
    for r in rows:
        pr = r["problem"]
        r_us = r.get("resgen_us")
        pct = f"{100 * r['floor_us'] / r_us:.0f}" if r_us and r.get("floor_us") else "-"
        table.append([pr["fmt"], _mode(pr), pr["m"], f"{pr['n']}x{pr['k']}",
                      _fmt(r_us), pct]
                     + [_fmt(r.get(k)) for k in keys if k != "triton_us"]
                     + [_ratio(r.get(k), r_us) for k in keys]
                     + [_ratio(plain.get((pr["fmt"], pr["m"], pr["n"], pr["k"])), r_us),
                        r.get("variant", r.get("error", ""))[:48]])
    heads = (["fmt", "comp", "M", "NxK", "resgen us", "%floor"]
             + [f"{_SHORT[k]} us" for k in keys if k != "triton_us"]
             + [f"x {_SHORT[k]}" for k in keys] + ["x none", "variant"])
    return _table(heads, table)


def _bench_sums(rows: list[dict[str, Any]]) -> list[str]:
    """Per (format, compensation, M): the layers' summed whole-layer times against the summed
    baselines (the decode targets are sums over a model's projection shapes) and, for the
    other modes (M-Ext, K-Ext, W4A16), against resgen plain W4A4 ("none") on the same
    layers."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        pr = r["problem"]
        groups.setdefault((pr["fmt"], _mode(pr), pr["m"]), []).append(r)
    out = []
    for (fmt, comp, m), rs in groups.items():
        if not all(r.get("resgen_us") for r in rs):
            out.append(f"sum {fmt} {comp} M={m}: incomplete ({len(rs)} layers)")
            continue
        ours = sum(r["resgen_us"] for r in rs)
        line = f"sum {fmt} {comp} M={m} over {len(rs)} layers: {ours:.2f} us"
        base = groups.get((fmt, "none", m))
        if comp != "none" and base is not None and len(base) == len(rs) and \
                all(r.get("resgen_us") for r in base):
            tot = sum(r["resgen_us"] for r in base)
            line += f"; resgen none {tot:.2f} us (x{tot / ours:.2f})"
        for key, name in BASELINE_COLUMNS + (("floor_us", "HBM floor"),):
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
    """The layer's shape under each baseline (BASELINE_COLUMNS): torch.matmul BF16; the five
    torch._scaled_mm FP8 forms of FP8_FORMS (activation rows padded to a multiple of 16, which
    _scaled_mm requires; all but torch-quant checked against the FP32 product of their own
    E4M3 operands before timing); vLLM's Marlin W4A16 in the layer's format (checked against
    x @ the dequantized weights before timing; skipped with the reason in marlin_error when
    its library is absent); Triton MXFP4 for MXFP4 layers."""
    import torch

    from .search.timing import CallableRunner, measure

    out: dict[str, Any] = {}
    n_sets = policy.sets_for(p.n * p.k * 2)          # bf16 weights
    fp8_sets = policy.sets_for(p.n * p.k)            # E4M3 weights: half the bytes per set
    try:
        xs = [torch.randn(p.m, p.k, device="cuda", dtype=torch.bfloat16)
              for _ in range(max(n_sets, fp8_sets))]
        ws = [torch.randn(p.n, p.k, device="cuda", dtype=torch.bfloat16) / p.k ** 0.5
              for _ in range(max(n_sets, fp8_sets))]
        out["bf16_us"] = measure(CallableRunner([bl.cublas_bf16(x, w) for x, w in
                                                 zip(xs[:n_sets], ws[:n_sets])]),
                                 policy, n_sets).median_us
        m16 = -(-p.m // 16) * 16
        xp = [torch.nn.functional.pad(x, (0, 0, 0, m16 - p.m)) for x in xs]
        out["fp8_rows"] = m16
        for key, name, quant in FP8_FORMS:
            make = getattr(bl, name, None)
            if make is None:
                continue
            try:
                if quant is not None:
                    out[key.replace("_us", "_rel_err")] = _check_fp8(
                        getattr(bl, quant), make, xp[0], ws[0])
                out[key] = measure(CallableRunner([make(x, w) for x, w in
                                                   zip(xp[:fp8_sets], ws[:fp8_sets])]),
                                   policy, fp8_sets).median_us
            except Exception as e:
                out[key.replace("_us", "_error")] = f"{type(e).__name__}: {e}"[:300]
        if hasattr(bl, "marlin_fp4"):
            out.update(_bench_marlin(bl, xs[0], p, policy))
        if p.fmt == "mxfp4" and getattr(bl, "TRITON_AVAILABLE", False):
            out.update(_bench_triton(bl, xs[0], p, policy))
        del xs, ws, xp
    except Exception as e:
        out["baseline_error"] = f"{type(e).__name__}: {e}"[:500]
    return out


FP8_TOLERANCE = 1e-2        # bf16 output of an FP32-accumulated E4M3 product
MARLIN_TOLERANCE = 1e-2     # bf16 output, FP32 accumulation and FP32 global reduction


def _rel_err(y: Any, ref: Any) -> float:
    """||y - ref|| / ||ref|| in FP32; NaN (never passes) if y holds a NaN or Inf."""
    import torch

    y = y.float()
    if not bool(torch.isfinite(y).all()):
        return float("nan")
    return float((y - ref).norm() / ref.norm())


def _check_fp8(quant: Any, make: Any, x: Any, w: Any) -> float:
    """An FP8 form against the FP32 product of its own E4M3 operands (fresh quantization of x
    and w by the form's quantizer, quant: bl.fp8_rowwise_quant or bl.fp8_tensor_quant,
    dequantized); raises if rel err > FP8_TOLERANCE."""
    x8, xs = quant(x)
    w8, ws = quant(w)
    ref = (x8.float() * xs) @ (w8.float() * ws).T
    rel = _rel_err(make(x, w)(), ref)
    if not rel <= FP8_TOLERANCE:
        raise RuntimeError(f"wrong result: rel err {rel:.3g} > {FP8_TOLERANCE}")
    return rel


def _bench_marlin(bl: Any, x: Any, p: Any, policy: Any) -> dict[str, Any]:
    """vLLM's Marlin W4A16 (resgen.baselines_marlin) in the layer's format: weights quantized by
    resgen.formats and repacked once (not timed); checked first against x @ dequantize(q)^T in
    FP32 (output poisoned with NaN; rel err <= MARLIN_TOLERANCE), then timed over the policy's
    weight sets. marlin_error says why it was not timed (library absent, wrong result, ...)."""
    import torch

    from . import formats
    from .search.timing import CallableRunner, measure

    out: dict[str, Any] = {}
    try:
        n_sets = policy.sets_for(p.n * p.k // 2)
        qs = [formats.quantize(torch.randn(p.n, p.k, device="cuda"), p.fmt)
              for _ in range(n_sets)]
        y = torch.full((p.m, p.n), float("nan"), dtype=torch.bfloat16, device="cuda")
        fn = bl.marlin_fp4(x, qs[0], p.fmt, out=y)
        ref = x.float() @ formats.dequantize(qs[0]).T
        rel = _rel_err(fn(), ref)
        out["marlin_rel_err"] = rel
        if not rel <= MARLIN_TOLERANCE:
            raise RuntimeError(f"wrong result: rel err {rel:.3g} > {MARLIN_TOLERANCE}")
        fns = [fn] + [bl.marlin_fp4(x, q, p.fmt) for q in qs[1:]]
        out["marlin_us"] = measure(CallableRunner(fns), policy, n_sets).median_us
    except Exception as e:
        out["marlin_error"] = f"{type(e).__name__}: {e}"[:300]
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


# -- db --------------------------------------------------------------------------------------------
def _parse_key(kind: str, key: str) -> str | None:
    """Validated parse of a stored key through its family's types, which must give back the
    key itself (canonical); error text or None."""
    from .search.family import families, get_family
    from .search.variant import canonical_json

    try:
        d = json.loads(key)
    except (TypeError, ValueError, RecursionError):
        return "key is not JSON"
    if not isinstance(d, dict):
        return f"key is a JSON {type(d).__name__}, not an object"

    def canonical(obj: Any) -> str | None:
        # a key that parses but is not its object's canonical key (a default field spelled
        # out, say) names the same variant / workload as another row: a duplicate that
        # lookups and merges would treat as distinct
        if obj.key() != canonical_json(d):
            return (f"not the canonical key of what it parses to "
                    f"({_printable(obj.key(), 160)})")
        return None

    try:
        if kind == "variant":
            return canonical(get_family(d.get("family")).VARIANT.from_dict(d))
        classes = {f.PROBLEM for f in families().values() if f.PROBLEM.OP == d.get("op")}
        if not classes:
            return f"no registered family for op {_printable(repr(d.get('op')), 60)}"
        errs = []
        for cls in classes:
            try:
                return canonical(cls.from_dict(d))
            except (TypeError, ValueError) as e:
                errs.append(str(e))
        return "; ".join(errs)
    except (TypeError, ValueError) as e:
        return str(e)


def _servable_filter(fresh_only: bool) -> Callable[[Any], bool]:
    """A predicate on database rows for `db merge`: what the runtime could accept. The row's
    family is registered, its workload and variant parse through the family's types and match
    their stored digests, its status is known, a timed row's numbers pass the range checks
    (resgen.search.record.stored_timing), and the variant is valid for its workload on the
    row's arch (why_invalid). fresh_only: also the fingerprint recorded for it is the one the
    current templates, kernel modules, compile options and versions give (the rule the
    runtime and the tuner use to tell stale results; computed once per compile class)."""
    from .search.build import memo_fingerprint
    from .search.record import Status, stored_timing

    cache: dict[tuple, str] = {}

    def keep(row: Any) -> bool:
        got = _parsed(row)
        if got is None or row["status"] not in Status.ALL:
            return False
        fam, p, v = got
        try:
            if row["status"] == Status.OK:
                stored_timing(row)
            if fam.why_invalid(v, p, row["arch"]) is not None:
                return False
            return not fresh_only or \
                memo_fingerprint(cache, fam, v, p, row["arch"]) == row["fingerprint"]
        except Exception:        # bad numbers, unknown arch, a family that raises: not kept
            return False

    return keep


def _merge_rule(args: argparse.Namespace, keep: Callable[[Any], bool] | None
                ) -> list[Callable[[Any], bool] | None] | None:
    """The rank-consistency check of `db merge` (resgen.db.consistency): one row filter per
    source, or None (after printing the conflicts) when they are refused."""
    from .db import TuningDB
    from .db.consistency import conflict_groups

    sources, offset = [], 0
    if args.into.exists():
        with TuningDB(args.into, readonly=True) as db:
            sources.append((f"{args.into} (its rows before the merge)", db.rows()))
        offset = 1
    for src in args.sources:
        with TuningDB(src, readonly=True) as db:
            sources.append((str(src), db.rows()))
    conflicts, first = conflict_groups(sources, _servable_filter(True))
    if conflicts and args.on_conflict == "refuse":
        print(f"resgen db merge: {len(conflicts)} workload(s) would get a winner that depends "
              f"on which source's timings are kept; nothing was merged into {args.into} "
              "(--on-conflict first|union picks a rule)", file=sys.stderr)
        for c in conflicts[:20]:
            print(f"  conflict: {_printable(c.text(), 400)}", file=sys.stderr)
        return None
    if not conflicts or args.on_conflict == "union":
        return [keep] * len(args.sources)
    bad = {(c.workload_digest, c.gpu_name, c.arch) for c in conflicts}

    def only_first(i: int) -> Callable[[Any], bool]:
        def k(row: Any) -> bool:
            g = (str(row["workload_digest"]), str(row["gpu_name"]), str(row["arch"]))
            if g in bad and first[g] != i:
                return False
            return keep is None or keep(row)
        return k

    return [only_first(offset + i) for i in range(len(args.sources))]


def _refingerprint(args: argparse.Namespace) -> int:
    """`resgen db refingerprint` (resgen.db.refingerprint); bad input is one line, exit 2;
    exit 0 when every row considered is identical, 1 when some are left alone."""
    from .db.refingerprint import RefingerprintError, refingerprint

    try:
        s = refingerprint(args.db, args.from_rev, out=args.out, workers=args.workers,
                          winners_only=args.winners_only, check_ptx=args.check_ptx,
                          dry_run=args.dry_run, repo=args.repo, families=args.families)
    except RefingerprintError as e:
        print(f"resgen db refingerprint: {e}", file=sys.stderr)
        return 2
    where = "dry run, nothing written" if args.dry_run else \
        f"written to {args.out or args.db}"
    print(f"{args.db} from {args.from_rev} ({where})")
    for line in s.lines():
        print(line)
    if args.json:
        print(json.dumps(s.as_dict()))
    return 0 if not s.left else 1


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
            _import_all(args.imports)
            keep = None if args.all_rows else _servable_filter(args.fresh_only)
            keeps = _merge_rule(args, keep)
            if keeps is None:
                return 1
            with TuningDB(args.into) as dst:
                for src, keep_src in zip(args.sources, keeps):
                    with TuningDB(src, readonly=True) as s:
                        counts = dst.merge_from(s, keep=keep_src)
                    print(f"{src} -> {args.into}: {counts}")
            return 0
        if args.dbcmd == "refingerprint":
            return _refingerprint(args)
        if args.dbcmd == "export" and args.winners:
            with TuningDB(args.path, readonly=True) as db:
                counts = db.export_winners(args.out, _servable_filter(True) if args.fresh_only
                                           else None)
            print(f"{args.path} -> {args.out} (winners): {counts}")
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
    except (DatabaseError, OSError) as e:       # FileExistsError, PermissionError, ...
        print(f"resgen db {args.dbcmd}: {e}", file=sys.stderr)
        return 2
    return 2


# -- entry -----------------------------------------------------------------------------------------
_QUALITY_HINT = "scripts/install.sh .venv --quality (or pip install 'resgen[quality]')"


def _quality(name: str, argv: list[str]) -> int:
    """`resgen report` / `resgen plan` (resgen.quality.cli); a missing quality extra or
    input is one line and exit code 2."""
    try:
        from .quality import cli as qcli
    except ImportError as e:
        print(f"resgen {name}: the quality package is not available ({e}); install it: "
              f"{_QUALITY_HINT}", file=sys.stderr)
        return 2
    try:
        return int(getattr(qcli, f"{name}_main")(argv) or 0)
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] == "resgen":
            raise
        print(f"resgen {name} needs the quality extra (module {e.name!r} is missing): "
              f"{_QUALITY_HINT}", file=sys.stderr)
        return 2
    except (FileNotFoundError, ValueError) as e:
        print(f"resgen {name}: {e}", file=sys.stderr)
        return 2


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
    except _Usage as e:
        print(f"resgen {args.cmd}: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:             # `resgen show | head`: the reader left, not an error
        sys.stdout = open(os.devnull, "w")
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
