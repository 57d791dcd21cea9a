#!/usr/bin/env python3
"""Distributed tuning vs one GPU (issue 24): the same `resgen tune` on one GPU without a
coordinator, then on G GPUs of this host against one coordinator (a throwaway PostgreSQL
cluster started here, scripts/pgcluster.py), the G databases merged with `resgen db merge`.
Reports the wall times and checks that the merged table covers what the single-GPU table
covers (the same workloads with a winner, the same (workload, variant) rows) and how many
winners agree (timings differ between runs, so winners may too). JSON to
$OUT/dist_tune.json (or --out), a short table last.

    python3 bench/dist_tune.py --gpus 2 --model qwen3-8b            # on nvidia-h200-x2
    python3 bench/dist_tune.py --cpu                                 # CI: fake family, no GPU

--phase baseline | distributed | all (default): the device machine carries either the CuTe DSL
bundle or the coordinator's wheels per call (bench/dist_tune_h200x2.sh), so the baseline and
the distributed run can be two calls; their state lives in --work (default /tmp/resgen-dist).
With --cpu the tuners are `resgen tune` of the CPU test family (tests/fakefam.py) on a faked
GPU, each "GPU" a process of its own, as tests/test_coordinator.py runs them.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# The GPU code path of `resgen tune` with faked device facts (tests/test_interrupt.py).
FAKE_DRIVER = """
import sys
import fakefam
import resgen.cli as cli
import resgen.search.record as record
cli._has_gpu = lambda: True
record.current_environment = lambda device=0: fakefam.make_env()
raise SystemExit(cli.main(sys.argv[1:]))
"""
CPU_ARGS = ("--families fake_gemm --import fakefam --formats nvfp4 --compensations none "
            "--m-buckets 1,16 --timer fakefam:fake_timer --max-variants 8 --jobs 1")
# qwen3-8b: 164 workloads (both formats, plain and full residue, four M buckets, decode
# attention at 2 batches x 32K), 8 variants each: about 3 minutes on one H200 (14 compiling
# processes), short enough that no run is cut by its budget.
GPU_ARGS = ("--formats nvfp4,mxfp4 --compensations none,full --m-buckets 1,4,16,64 "
            "--max-variants 8 --attn-batches 1,32 --kv-lens 32768 --attn-pv f16")


def _pgcluster():
    spec = importlib.util.spec_from_file_location("resgen_pgcluster",
                                                  ROOT / "scripts" / "pgcluster.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _tune_cmd(cpu: bool, model: str, db: Path, budget: float, extra: str,
              coordinator: str | None) -> list[str]:
    head = [sys.executable, "-c", FAKE_DRIVER] if cpu else [sys.executable, "-m", "resgen"]
    cmd = head + ["tune", "--model", model, "--db", str(db), "--time-budget", str(budget)]
    cmd += shlex.split(CPU_ARGS if cpu else GPU_ARGS) + shlex.split(extra)
    if coordinator:
        cmd += ["--coordinator", coordinator]
    return cmd


def _env(cpu: bool, gpu: int | None, cache: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["RESGEN_CACHE_DIR"] = str(cache)          # each "host" has its own cache and GPU lock
    env.pop("RESGEN_COORDINATOR", None)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT)] + ([str(ROOT / "tests")] if cpu else []) +
        ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    if gpu is not None and not cpu:
        env["CUDA_VISIBLE_DEVICES"] = str(gpu)
    return env


def _run_all(cmds: list[tuple[list[str], dict, Path]], timeout: float) -> tuple[float, list]:
    """Start every command at once; (wall seconds until the last ends, return codes)."""
    t0 = time.monotonic()
    procs = []
    for cmd, env, log in cmds:
        f = open(log, "w")
        procs.append((subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT,
                                       cwd=ROOT, start_new_session=True), f))
    rcs = []
    for p, f in procs:
        try:
            rcs.append(p.wait(timeout=max(1.0, timeout - (time.monotonic() - t0))))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, 9)
            rcs.append("timeout")
        f.close()
    return time.monotonic() - t0, rcs


def _table_facts(path: Path) -> dict:
    """(workload, variant) rows by status and each workload's winner (plain SQL: this script
    must not depend on which resgen modules import on the machine it runs on)."""
    c = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        rows = c.execute(
            "SELECT w.key, v.key, r.status, r.median_us, r.space_index, r.error "
            "FROM results r JOIN workloads w ON w.id = r.workload_id "
            "JOIN variants v ON v.id = r.variant_id").fetchall()
    finally:
        c.close()
    keys = {(w, v): st for w, v, st, _, _, _ in rows}
    timed: dict[str, list] = {}
    for w, v, st, med, idx, _ in rows:
        if st == "ok" and med:
            timed.setdefault(w, []).append((med, idx, v))
    winners = {}
    for w, ts in timed.items():
        best = min(m for m, _, _ in ts)
        near = [t for t in ts if t[0] <= best * 1.01]
        winners[w] = min(near, key=lambda t: (t[1], t[0], t[2]))[2]
    return {"rows": keys, "winners": winners}


def _compare(one: dict, merged: dict) -> dict:
    a, b = set(one["rows"]), set(merged["rows"])
    wa, wb = one["winners"], merged["winners"]
    return {"single_rows": len(a), "merged_rows": len(b), "rows_equal": a == b,
            "only_single": len(a - b), "only_merged": len(b - a),
            "single_workloads_with_winner": len(wa), "merged_workloads_with_winner": len(wb),
            "coverage_equal": set(wa) == set(wb),
            "winners_agree": sum(1 for w in wa if wb.get(w) == wa[w])}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--budget", type=float, default=400.0,
                    help="--time-budget of every tune (large enough that none is cut short)")
    ap.add_argument("--tune-args", default="", help="extra `resgen tune` arguments")
    ap.add_argument("--phase", choices=["baseline", "distributed", "all"], default="all")
    ap.add_argument("--work", type=Path, default=Path("/tmp/resgen-dist"))
    ap.add_argument("--cpu", action="store_true", help="the CPU test family, no GPU")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--baseline-coordinator", action="store_true",
                    help="tune the baseline through a coordinator too (same search: seeds "
                         "off), so that its rows can equal the merged table's exactly; "
                         "default: a plain single-GPU run, what a user has without one")
    a = ap.parse_args(argv)
    out_dir = a.out or Path(os.environ.get("OUT") or a.work)
    out_dir.mkdir(parents=True, exist_ok=True)
    a.work.mkdir(parents=True, exist_ok=True)
    state_path = a.work / "state.json"
    state = json.loads(state_path.read_text()) if state_path.exists() else {}
    timeout = a.budget + 240
    one_db = a.work / "one.sqlite"
    pg = _pgcluster()
    if a.phase in ("baseline", "all"):
        one_db.unlink(missing_ok=True)
        cluster = pg.Cluster(pg.temp_root()).start() if a.baseline_coordinator else None
        try:
            cmd = _tune_cmd(a.cpu, a.model, one_db, a.budget, a.tune_args,
                            cluster.url if cluster else None)
            wall, rcs = _run_all([(cmd, _env(a.cpu, 0, a.work / "cache-one"),
                                   out_dir / "tune-one.log")], timeout)
        finally:
            if cluster is not None:
                cluster.stop()
        state["baseline"] = {"wall_s": wall, "rc": rcs[0], "cmd": cmd,
                             "coordinated": a.baseline_coordinator}
        state_path.write_text(json.dumps(state, indent=1))
    if a.phase in ("distributed", "all"):
        if "baseline" not in state or not one_db.exists():
            print("dist_tune: no baseline in --work (run --phase baseline first, on this "
                  "machine)", file=sys.stderr)
            return 2
        cluster = pg.Cluster(pg.temp_root())
        cluster.start()
        try:
            dbs = [a.work / f"gpu{g}.sqlite" for g in range(a.gpus)]
            for d in dbs:
                d.unlink(missing_ok=True)
            cmds = [(_tune_cmd(a.cpu, a.model, d, a.budget, a.tune_args, cluster.url),
                     _env(a.cpu, g, a.work / f"cache-gpu{g}"), out_dir / f"tune-gpu{g}.log")
                    for g, d in enumerate(dbs)]
            wall, rcs = _run_all(cmds, timeout)
        finally:
            cluster.stop()
        merged = a.work / "merged.sqlite"
        merged.unlink(missing_ok=True)
        merge = subprocess.run(
            ([sys.executable, "-c", FAKE_DRIVER] if a.cpu else [sys.executable, "-m", "resgen"])
            + ["db", "merge", *map(str, dbs), "--into", str(merged)]
            + (["--import", "fakefam"] if a.cpu else []),
            env=_env(a.cpu, None, a.work / "cache-merge"), capture_output=True, text=True,
            cwd=ROOT, timeout=600)
        state["distributed"] = {"wall_s": wall, "rcs": rcs, "gpus": a.gpus,
                                "merge_rc": merge.returncode,
                                "merge_out": (merge.stdout + merge.stderr)[-4000:],
                                "server_stopped": not cluster.running()}
        if merge.returncode == 0:
            state["compare"] = _compare(_table_facts(one_db), _table_facts(merged))
        state_path.write_text(json.dumps(state, indent=1))
    from resgen.search.timing import TUNE_POLICY
    from run_record import run_record

    # one record per call (the GPU check runs the phases in two calls; the tuner's policy)
    state.setdefault("runs", []).append(run_record(__file__, argv, policy=TUNE_POLICY))
    (out_dir / "dist_tune.json").write_text(json.dumps(state, indent=1))
    b, d, c = state.get("baseline", {}), state.get("distributed", {}), state.get("compare", {})
    rows = [("single GPU wall s", f"{b.get('wall_s', 0):.1f}", f"rc {b.get('rc')}")]
    if d:
        rows.append((f"{d['gpus']} GPUs wall s", f"{d['wall_s']:.1f}",
                     f"rcs {d['rcs']}, merge rc {d['merge_rc']}"))
        if b.get("wall_s"):
            rows.append(("speedup", f"{b['wall_s'] / max(d['wall_s'], 1e-9):.2f}x", ""))
    for k in ("coverage_equal", "rows_equal", "single_workloads_with_winner",
              "merged_workloads_with_winner", "winners_agree", "only_single", "only_merged"):
        if k in c:
            rows.append((k, str(c[k]), ""))
    w = max(len(r[0]) for r in rows)
    for r in rows:
        print(f"{r[0]:<{w}}  {r[1]:>8}  {r[2]}".rstrip())
    ok = (not d) or (d["merge_rc"] == 0 and all(rc == 0 for rc in d["rcs"])
                     and c.get("coverage_equal") and d.get("server_stopped"))
    return 0 if ok and b.get("rc") == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
