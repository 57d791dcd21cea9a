"""`with resgen.autotune():` record the shapes a model really runs, then tune them.

    import resgen
    with resgen.autotune():                 # or autotune(db=path, max_variants=8, ...)
        model.generate(ids, max_new_tokens=16)      # any calls through resgen's custom ops
    # on exit: every linear / quantizer / decode-attention workload seen was tuned into the
    # user's database (resgen.settings().user_db), and the runtime reloaded

FlashInfer's `autotune()` pattern: the shapes come from real calls, not from a model registry.
Recording happens in resgen's torch.library custom ops (resgen.ops.custom): each call through
torch.ops.resgen.linear / quantize / decode_attention records the problem its op object
looks up (resgen.ops.Linear.problem(M), LayerQuantizer.problem(M), DecodeAttention.problem(
batch, KV-length class)). Calls already captured in a CUDA graph replay without Python and
are not seen: record with eager calls (or the first, warm-up calls of a compiled model).

On exit the workloads are tuned exactly as `resgen tune` tunes (resgen.search.tuner.run_jobs,
the same families, search and measurement policy): on a GPU compiled, checked and timed; on a
machine without one, or with compile_only=True, the compile-only pre-flight for sm_90a
(rendered and compiled, stored with status "compiled"). Workloads already in the database for
this environment are resumed, not redone. The result summary is kept in `.summary`.
"""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path
from typing import Any, Iterator

from .ops.custom import Recorder, pop_recorder, push_recorder, recording

__all__ = ["autotune", "tune_recorded", "Recorder", "recording"]

def _jobs(rec: Recorder, arch: str) -> list:
    from .search.family import families_for
    from .search.tuner import Job

    jobs = []
    for op, probs in rec.problems.items():
        fams = sorted((f for f in families_for(op, arch)), key=lambda f: f.NAME)
        for p in probs:
            for fam in fams:
                if fam.PROBLEM is not type(p):
                    continue
                if fam.problem_invalid(p) is None:
                    jobs.append(Job(fam.NAME, p.key()))
    return jobs


def tune_recorded(rec: Recorder, *, db: str | Path | None = None, max_variants: int = 8,
                  compile_only: bool | None = None, time_budget_s: float | None = None,
                  workers: int | None = None, arch: str | None = None) -> list:
    """Tune the recorded problems into `db` (default: the user's database); returns the
    tuner's summaries (one per workload)."""
    import os

    from .db import TuningDB
    from .search.record import compile_only_environment, current_environment
    from .search.timing import policy_named
    from .search.tuner import TuneConfig, run_jobs
    from .settings import settings

    try:
        import torch

        gpu = bool(torch.cuda.is_available())
    except Exception:
        gpu = False
    compile_only = (not gpu) if compile_only is None else (compile_only or not gpu)
    arch = arch or settings().arch
    env = compile_only_environment(arch) if compile_only else current_environment()
    if not compile_only:
        arch = env.arch
    jobs = _jobs(rec, arch)
    if not jobs:
        return []
    path = Path(db) if db is not None else settings().user_db
    TuningDB(path).close()                # create (or reject a foreign file) before tuning
    cores = os.cpu_count() or 1
    workers = workers or (min(len(jobs), cores) if compile_only else 1)
    lock = None
    if not compile_only and workers > 1:
        try:        # the per-GPU lock `resgen tune` takes (resgen.search.device, when present)
            from .search.device import gpu_lock_path

            lock = gpu_lock_path()
        except ImportError:
            lock = str(settings().cache_dir / "gpu-autotune.lock")
    config = TuneConfig(arch=arch, policy=policy_named("tune"), max_variants=max_variants,
                        time_budget_s=time_budget_s, compile_only=compile_only, gpu_lock=lock)
    modules = sorted({type(_family(j.family)).__module__ for j in jobs})
    summaries = run_jobs(jobs, functools.partial(TuningDB, path), env, config,
                         workers=workers, isolate=workers > 1 or not compile_only,
                         modules=modules)
    from . import runtime

    runtime.reset()                       # later lookups see the new rows
    rec.db = path
    return summaries


def _family(name: str) -> Any:
    from .search.family import get_family

    return get_family(name)


@contextlib.contextmanager
def autotune(*, db: str | Path | None = None, max_variants: int = 8,
             compile_only: bool | None = None, time_budget_s: float | None = None,
             workers: int | None = None, arch: str | None = None,
             tune: bool = True) -> Iterator[Recorder]:
    """Record the problems resgen's custom ops run inside the block; on a normal exit tune
    them (see the module docstring). tune=False only records (the Recorder is yielded)."""
    rec = push_recorder()
    try:
        yield rec
    finally:
        pop_recorder(rec)
    if tune:
        rec.summary = tune_recorded(rec, db=db, max_variants=max_variants,
                                    compile_only=compile_only, time_budget_s=time_budget_s,
                                    workers=workers, arch=arch)
