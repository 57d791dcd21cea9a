"""tuned/produce_h200.sh's orchestration on a CPU, with `python3` replaced by a recorder: one
`resgen tune` on one GPU; with RESGEN_TUNE_GPUS=2 one `--shard g/2` per GPU
(CUDA_VISIBLE_DEVICES=g), each into its own copy of the seeded work database (copied before
any shard starts), then the shard merged into the work database before the export. Device
time is too scarce to find a broken script on the H200."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

FAKE_PYTHON = """#!/usr/bin/env bash
echo "CVD=${CUDA_VISIBLE_DEVICES:-none} $*" >> "$FAKE_LOG"
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
    case "${args[$i]}" in
        --out|--json|--db|--into) touch "${args[$((i + 1))]}" ;;
    esac
done
exit 0
"""


def _run(tmp_path: Path, gpus: int) -> tuple[list[str], subprocess.CompletedProcess]:
    if shutil.which("xz") is None or shutil.which("timeout") is None:
        pytest.skip("needs xz and timeout")
    repo = tmp_path / "repo"
    (repo / "tuned").mkdir(parents=True)
    shutil.copy(ROOT / "tuned" / "produce_h200.sh", repo / "tuned" / "produce_h200.sh")
    (repo / ".devcache" / "device").mkdir(parents=True)
    (repo / ".devcache" / "device" / "env.sh").write_text("# fake\n")
    subprocess.run(["xz", "-z", "-c"], input=b"seed", stdout=open(repo / "seed.xz", "wb"),
                   check=True)
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    py = bin_ / "python3"
    py.write_text(FAKE_PYTHON)
    py.chmod(py.stat().st_mode | stat.S_IEXEC)
    log = tmp_path / "calls.log"
    env = {**os.environ, "PATH": f"{bin_}:{os.environ['PATH']}", "FAKE_LOG": str(log),
           "OUT": str(tmp_path / "out"), "RESGEN_TUNE_WORK": str(tmp_path / "work.sqlite"),
           "RESGEN_TUNE_BUDGET": "5", "RESGEN_TUNE_RESUME_FROM": "seed.xz",
           "RESGEN_TUNE_GPUS": str(gpus), "RESGEN_TUNE_ARGS": "--families linear_sm90_mma"}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    r = subprocess.run(["bash", str(repo / "tuned" / "produce_h200.sh")], env=env,
                       capture_output=True, text=True, timeout=120)
    return log.read_text().splitlines(), r


def test_one_gpu_runs_one_tune(tmp_path):
    calls, r = _run(tmp_path, 1)
    assert r.returncode == 0, r.stdout + r.stderr
    tunes = [c for c in calls if " resgen tune " in c]
    assert len(tunes) == 1 and "--shard" not in tunes[0] and tunes[0].startswith("CVD=none")
    assert "--warm-start" in tunes[0] and "--families linear_sm90_mma" in tunes[0]
    assert any(" resgen db export " in c for c in calls)


def test_two_gpus_run_one_shard_each_then_merge(tmp_path):
    calls, r = _run(tmp_path, 2)
    assert r.returncode == 0, r.stdout + r.stderr
    work = str(tmp_path / "work.sqlite")
    shard1 = str(tmp_path / "work-1.sqlite")
    tunes = sorted(c for c in calls if " resgen tune " in c)
    assert len(tunes) == 2
    assert tunes[0].startswith("CVD=0 ") and "--shard 0/2" in tunes[0] and f"--db {work}" in tunes[0]
    assert tunes[1].startswith("CVD=1 ") and "--shard 1/2" in tunes[1] \
        and f"--db {shard1}" in tunes[1]
    assert Path(shard1).exists()          # the seeded work database, copied for shard 1
    i_merge = next(i for i, c in enumerate(calls) if f"db merge {shard1} --into {work}" in c)
    i_export = next(i for i, c in enumerate(calls) if " resgen db export " in c)
    assert max(i for i, c in enumerate(calls) if " resgen tune " in c) < i_merge < i_export
    assert (tmp_path / "out" / "tune-0.log").exists() and (tmp_path / "out" / "tune-1.log").exists()
