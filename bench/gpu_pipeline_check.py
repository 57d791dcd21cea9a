"""GPU check of the compiler pipeline (timer, tuner, database, runtime) on the H200.

    source .devcache/device/env.sh && RESGEN_CACHE_DIR=/tmp/resgen-cache \
        python3 bench/gpu_pipeline_check.py            # about 2-4 minutes; JSON to $OUT

1. the timer: a 64 MB copy under the cold-L2 graph policy (achieved bandwidth must look like
   HBM) and a tiny kernel timed with and without the CUDA graph (launch overhead removed);
2. the tuner in one process and in two processes sharing the GPU lock, on real families and a
   few Qwen3-8B workloads (every variant checked against the reference before timing);
3. the database written by both (verify), and the runtime serving the winners (warm lookup);
then a short table; everything raw goes to $OUT/pipeline_check.json. One failing step is
recorded and the script goes on.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from resgen import runtime  # noqa: E402
from resgen.db import TuningDB  # noqa: E402
from resgen.models import get_model  # noqa: E402
from resgen.search.family import families_for  # noqa: E402
from resgen.search.record import current_environment  # noqa: E402
from resgen.search.timing import DEFAULT_POLICY, MeasurementPolicy, measure  # noqa: E402
from resgen.search.orchestrate import Job, run_jobs  # noqa: E402
from resgen.search.tuner import TuneConfig  # noqa: E402
from resgen.search.variant import AttentionProblem, LinearProblem  # noqa: E402
from resgen.search.device import gpu_lock_path  # noqa: E402

OUT = Path(os.environ.get("OUT", "bench/results/h200"))
REPORT: dict = {"steps": {}}
LINES: list[list[str]] = []


STEPS: list = []


def step(name):
    """Register a step; main() runs them in order (never at import: the tuner's spawned
    worker processes re-import this module)."""
    def wrap(fn):
        STEPS.append((name, fn))
        return fn
    return wrap


def run_step(name, fn) -> None:
    t0 = time.time()
    try:
        REPORT["steps"][name] = {"ok": True, **(fn() or {})}
    except Exception as e:
        REPORT["steps"][name] = {"ok": False, "error": f"{type(e).__name__}: {e}",
                                 "traceback": traceback.format_exc()[-3000:]}
        LINES.append([name, "FAILED", f"{type(e).__name__}: {e}"[:90]])
    REPORT["steps"][name]["seconds"] = round(time.time() - t0, 2)


class CopyRunner:
    def __init__(self, n_sets: int, numel: int) -> None:
        self.src = [torch.randn(numel, device="cuda") for _ in range(n_sets)]
        self.dst = torch.empty_like(self.src[0])
        self.i = 0

    def rotate(self, i: int) -> None:
        self.i = i

    def __call__(self):
        self.dst.copy_(self.src[self.i])


@step("timer")
def _timer():
    numel = 16 << 20                                   # 64 MB of fp32
    n = DEFAULT_POLICY.sets_for(4 * numel)
    t = measure(CopyRunner(n, numel), DEFAULT_POLICY, n)
    gbps = 2 * 4 * numel / (t.median_us * 1e-6) / 1e9
    tiny = CopyRunner(1, 256)
    g = measure(tiny, DEFAULT_POLICY, 1)
    e = measure(tiny, MeasurementPolicy(graph=False), 1)
    LINES.append(["timer", f"copy 64MB {t.median_us:.1f} us = {gbps:.0f} GB/s ({t.mode})",
                  f"tiny kernel graph {g.median_us:.2f} us vs eager {e.median_us:.2f} us"])
    assert t.mode == "graph" and g.mode == "graph", (t.note, g.note)
    return {"copy": t.__dict__, "copy_gbps": gbps, "tiny_graph": g.__dict__,
            "tiny_eager": e.__dict__}


def _jobs(fam, problems):
    return [Job(fam.NAME, p.key()) for p in problems]


def _tune(jobs, workers, max_variants):
    env = current_environment()
    db = OUT / "pipeline_check.sqlite"
    cfg = TuneConfig(arch=env.arch, max_variants=max_variants, time_budget_s=150,
                     gpu_lock=gpu_lock_path())
    t0 = time.time()
    sums = run_jobs(jobs, functools.partial(TuningDB, db), env, cfg, workers=workers)
    dt = time.time() - t0
    for s in sums:
        LINES.append([f"tune x{workers}", f"{json.loads(s.problem_key)}"[:70],
                      f"{s.search} eval {s.evaluated} ok {s.timed} cf {s.compile_failed} "
                      f"chk {s.check_failed} run {s.run_failed} win "
                      f"{s.winner_us and round(s.winner_us, 2)} us {s.seconds:.0f}s"])
    assert len(sums) == len(jobs) and all(s.timed > 0 for s in sums), \
        [(s.problem_key, s.error, s.invalid_reasons) for s in sums if s.timed == 0]
    return {"seconds": dt, "workloads": [s.__dict__ for s in sums]}


PROBLEMS: list = []


@step("tune_one_process")
def _tune1():
    fams = families_for("linear", "sm_90a")
    assert fams, "no linear family registered"
    sh = {s.name: s for s in get_model("qwen3-8b").linear_shapes()}
    ps = [LinearProblem(fmt="nvfp4", compensation="none", m=1, n=sh["o"].n, k=sh["o"].k),
          LinearProblem(fmt="nvfp4", compensation="full", m=16, n=sh["o"].n, k=sh["o"].k)]
    PROBLEMS.extend(ps)
    return _tune(_jobs(fams[0], ps), 1, 6)


@step("tune_two_processes")
def _tune2():
    fams = families_for("linear", "sm_90a")
    sh = {s.name: s for s in get_model("qwen3-8b").linear_shapes()}
    ps = [LinearProblem(fmt="nvfp4", compensation="none", m=1, n=sh["gate_up"].n,
                        k=sh["gate_up"].k),
          LinearProblem(fmt="mxfp4", compensation="full", m=4, n=sh["down"].n, k=sh["down"].k),
          LinearProblem(fmt="nvfp4", compensation="0.25", m=1, n=sh["qkv"].n, k=sh["qkv"].k)]
    PROBLEMS.extend(ps)
    jobs = _jobs(fams[0], ps)
    att = families_for("decode_attention", "sm_90a")
    if att:
        a = AttentionProblem(batch=8, q_heads=32, kv_heads=8, head_dim=128, kv_len=8192)
        PROBLEMS.append(a)
        jobs += _jobs(att[0], [a])
    return _tune(jobs, 2, 4)


@step("database_and_runtime")
def _runtime():
    db = OUT / "pipeline_check.sqlite"
    with TuningDB(db, readonly=True) as d:
        rep = d.verify()
        n = len(d)
    assert rep.ok, rep.errors
    disp = runtime.Dispatcher(paths=[db])
    served = {}
    for p in PROBLEMS:
        v = disp.lookup(type(p).OP, p)
        served[p.key()] = (v.name(), disp.source(type(p).OP, p))
    defaults = [k for k, (_, src) in served.items() if src == "default"]
    reps = 100_000
    t0 = time.perf_counter()
    for i in range(reps):
        disp.lookup(type(PROBLEMS[i % len(PROBLEMS)]).OP, PROBLEMS[i % len(PROBLEMS)])
    warm_us = (time.perf_counter() - t0) / reps * 1e6
    LINES.append(["runtime", f"db rows {n}, verify ok, served {len(served) - len(defaults)}"
                  f"/{len(served)} from the table", f"warm lookup {warm_us:.2f} us"])
    assert not defaults, defaults
    return {"rows": n, "served": served, "warm_lookup_us": warm_us}


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    from run_record import run_record

    REPORT["run"] = run_record(__file__, policy=DEFAULT_POLICY)
    REPORT["environment"] = current_environment().as_dict()
    (OUT / "pipeline_check.sqlite").unlink(missing_ok=True)
    for name, fn in STEPS:
        run_step(name, fn)
    (OUT / "pipeline_check.json").write_text(json.dumps(REPORT, indent=1, default=str))
    w = [max([len(r[i]) for r in LINES] + [1]) for i in range(2)]
    for r in LINES:
        print(f"{r[0]:<{w[0]}}  {r[1]:<{w[1]}}  {r[2]}")
    ok = all(s["ok"] for s in REPORT["steps"].values())
    print(f"pipeline check: {'PASS' if ok else 'FAIL'} -> {OUT / 'pipeline_check.json'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
