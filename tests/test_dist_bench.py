"""bench/dist_tune.py (issue 24's GPU check) on its CPU path: the CPU test family on a faked
GPU, one plain "single-GPU" tune, then two "GPUs" against a throwaway PostgreSQL cluster, the
databases merged and compared. The GPU run itself is bench/dist_tune_h200x2.sh."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from fakefam import subprocess_env
from pgfixture import pgcluster

ROOT = Path(__file__).resolve().parent.parent


def test_dist_tune_cpu_path_reports_equal_coverage_and_stops_its_server(tmp_path):
    assert pgcluster.find_bindir() is not None, "PostgreSQL server binaries are missing"
    env = subprocess_env()
    env.pop("OUT", None)
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "bench/dist_tune.py", "--cpu", "--gpus", "2",
                        "--work", str(tmp_path / "work"), "--out", str(out), "--budget", "120",
                        "--tune-args=--m-buckets 1"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=600)
    logs = "".join(f"\n--- {f.name}\n" + f.read_text()[-1500:]
                   for f in sorted(out.glob("tune-*.log")))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:] + logs
    data = json.loads((out / "dist_tune.json").read_text())
    d, c = data["distributed"], data["compare"]
    assert d["rcs"] == [0, 0] and d["merge_rc"] == 0 and d["server_stopped"]
    assert c["coverage_equal"] and c["merged_workloads_with_winner"] == 4
    assert r.stdout.strip().splitlines()[-1].startswith("only_merged")   # the table is last
