"""The device-call scripts' orchestration on a CPU, with `python3` (and `nvidia-smi`,
`compute-sanitizer`) replaced by recorders. Device time is too scarce to find a broken script
on the H200.

tuned/produce_h200.sh: one `resgen tune` on one GPU; with RESGEN_TUNE_GPUS=2 one
`--shard g/2` per GPU (CUDA_VISIBLE_DEVICES=g), each into its own copy of the seeded work
database (copied before any shard starts), then the shard merged into the work database
before the export.

bench/probe_and_test.sh: the probe on GPU 0 and the GPU tests on GPU 1 of a two-GPU machine
(both on GPU 0 otherwise), then memcheck.

bench/gpu_tests_all.sh: every test file at once, each under its time limit, its JUnit XML and
log named after the tag and the file, and the exit status of a failing file reported.

bench/presum_quant_h200.sh: the split probe, then the quantizer-configuration probe (presum
layout by default), each with its own log; a failing first probe does not stop the second.

bench/h200_lib.sh (sourced by the bench/*_h200.sh scripts): each step under its limit with its
own log (and JUnit XML for pytest), a failing step's code kept as the exit code while the later
steps still run; no .devcache stops the call at once with exit code 2 and says so."""

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
        --out|--json|--db|--into|--log-file) touch "${args[$((i + 1))]}" ;;
    esac
done
[ -n "${FAKE_FAIL:-}" ] && [[ "$*" == *"$FAKE_FAIL"* ]] && exit 3
exit 0
"""


def _fake_repo(tmp_path: Path, script: str, gpus: int = 1) -> tuple[Path, dict]:
    """A repository holding `script` and a fake .devcache, and an environment whose PATH
    starts with recording python3 / compute-sanitizer and an nvidia-smi listing `gpus`."""
    if shutil.which("xz") is None or shutil.which("timeout") is None:
        pytest.skip("needs xz and timeout")
    repo = tmp_path / "repo"
    (repo / Path(script).parent).mkdir(parents=True, exist_ok=True)
    shutil.copy(ROOT / script, repo / script)
    (repo / "bench").mkdir(exist_ok=True)
    shutil.copy(ROOT / "bench" / "h200_lib.sh", repo / "bench" / "h200_lib.sh")
    (repo / ".devcache" / "device").mkdir(parents=True)
    (repo / ".devcache" / "device" / "env.sh").write_text("# fake\n")
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    smi = "".join(f"echo 'GPU {g}: NVIDIA H200 (UUID: GPU-{g})'\n" for g in range(gpus))
    for name, text in (("python3", FAKE_PYTHON), ("compute-sanitizer", FAKE_PYTHON),
                       ("nvidia-smi", "#!/usr/bin/env bash\n" + smi)):
        f = bin_ / name
        f.write_text(text)
        f.chmod(f.stat().st_mode | stat.S_IEXEC)
    env = {**os.environ, "PATH": f"{bin_}:{os.environ['PATH']}",
           "FAKE_LOG": str(tmp_path / "calls.log"), "OUT": str(tmp_path / "out")}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return repo, env


def run_script(repo: Path, script: str, env: dict, *args: str,
               timeout: int = 60) -> subprocess.CompletedProcess:
    """bash `script` (a path in `repo`) with `args` in `env`, its output captured."""
    return subprocess.run(["bash", str(repo / script), *args], env=env, capture_output=True,
                          text=True, timeout=timeout)


def _calls(tmp_path: Path) -> list[str]:
    """The recorded stand-in calls, one per line."""
    return (tmp_path / "calls.log").read_text().splitlines()


def _run(tmp_path: Path, gpus: int) -> tuple[list[str], subprocess.CompletedProcess]:
    repo, env = _fake_repo(tmp_path, "tuned/produce_h200.sh")
    subprocess.run(["xz", "-z", "-c"], input=b"seed", stdout=open(repo / "seed.xz", "wb"),
                   check=True)
    env.update({"RESGEN_TUNE_WORK": str(tmp_path / "work.sqlite"), "RESGEN_TUNE_BUDGET": "5",
                "RESGEN_TUNE_RESUME_FROM": "seed.xz", "RESGEN_TUNE_GPUS": str(gpus),
                "RESGEN_TUNE_ARGS": "--families linear_sm90_mma"})
    r = run_script(repo, "tuned/produce_h200.sh", env, timeout=120)
    return _calls(tmp_path), r


def test_one_gpu_runs_one_tune(tmp_path):
    calls, r = _run(tmp_path, 1)
    assert r.returncode == 0, r.stdout + r.stderr
    tunes = [c for c in calls if " resgen tune " in c]
    assert len(tunes) == 1 and "--shard" not in tunes[0] and tunes[0].startswith("CVD=none")
    assert "--warm-start" in tunes[0] and "--families linear_sm90_mma" in tunes[0]
    assert any(" resgen db export " in c for c in calls)


def test_a_second_call_on_the_work_database_still_warm_starts(tmp_path):
    """Session 31's prefill call ran on the warm machine's existing work database and lost
    its warm start: the seed is re-read and --warm-start passed whenever RESUME_FROM is set,
    and the work database is not re-seeded (merged into) a second time."""
    (tmp_path / "work.sqlite").write_text("")
    calls, r = _run(tmp_path, 1)
    assert r.returncode == 0, r.stdout + r.stderr
    tunes = [c for c in calls if " resgen tune " in c]
    assert len(tunes) == 1 and f"--warm-start {tmp_path / 'work-seed.sqlite'}" in tunes[0]
    assert not any(" resgen db merge " in c for c in calls)
    assert (tmp_path / "work-seed.sqlite").read_bytes() == b"seed"


def test_two_gpus_run_one_shard_each_then_merge(tmp_path):
    calls, r = _run(tmp_path, 2)
    assert r.returncode == 0, r.stdout + r.stderr
    work = str(tmp_path / "work.sqlite")
    shard1 = str(tmp_path / "work-1.sqlite")
    tunes = sorted(c for c in calls if " resgen tune " in c)
    assert len(tunes) == 2
    assert tunes[0].startswith("CVD=0 ") and "--shard 0/2" in tunes[0] \
        and f"--db {work}" in tunes[0]
    assert tunes[1].startswith("CVD=1 ") and "--shard 1/2" in tunes[1] \
        and f"--db {shard1}" in tunes[1]
    assert Path(shard1).exists()          # the seeded work database, copied for shard 1
    i_merge = next(i for i, c in enumerate(calls) if f"db merge {shard1} --into {work}" in c)
    i_export = next(i for i, c in enumerate(calls) if " resgen db export " in c)
    assert max(i for i, c in enumerate(calls) if " resgen tune " in c) < i_merge < i_export
    assert (tmp_path / "out" / "tune-0.log").exists() and (tmp_path / "out" / "tune-1.log").exists()


@pytest.mark.parametrize("gpus", [1, 2])
def test_probe_and_test_uses_both_gpus_when_there_are_two(tmp_path, gpus):
    repo, env = _fake_repo(tmp_path, "bench/probe_and_test.sh", gpus)
    r = run_script(repo, "bench/probe_and_test.sh", env, "bench/x_probe.py",
                   "tests/gpu/test_x.py", "run7", timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    calls = _calls(tmp_path)
    probe = [c for c in calls if "bench/x_probe.py" in c]
    tests = [c for c in calls if " -m pytest " in c]
    memcheck = [c for c in calls if "--tool memcheck" in c]
    assert len(probe) == len(tests) == len(memcheck) == 1
    assert probe[0].startswith("CVD=0 ")
    assert tests[0].startswith(f"CVD={1 if gpus == 2 else 0} ")
    assert "tests/gpu/test_x.py" in tests[0] and "gpu_tests_run7.xml" in tests[0]
    assert calls.index(memcheck[0]) == len(calls) - 1        # after both
    out = tmp_path / "out"
    assert "probe rc=0" in (out / "x_probe.log").read_text()
    assert "pytest rc=0" in (out / "gpu_tests_run7.log").read_text()
    assert "memcheck rc=0" in (out / "memcheck_run7_stdout.txt").read_text()
    assert f"({gpus} GPU(s))" in r.stdout
    # a failing step makes the call's exit code non-zero
    env["FAKE_FAIL"] = "-m pytest"
    r = run_script(repo, "bench/probe_and_test.sh", env, "bench/x_probe.py",
                   "tests/gpu/test_x.py", "run8", timeout=120)
    assert r.returncode == 1 and "pytest rc=3" in (out / "gpu_tests_run8.log").read_text()


def test_gpu_tests_all_runs_every_file_with_its_own_xml(tmp_path):
    repo, env = _fake_repo(tmp_path, "bench/gpu_tests_all.sh")
    env["FAKE_FAIL"] = "test_b_gpu"
    r = run_script(repo, "bench/gpu_tests_all.sh", env, "s9", "tests/gpu/test_a_gpu.py",
                   "tests/gpu/test_b_gpu.py")
    assert r.returncode == 0, r.stdout + r.stderr
    calls = _calls(tmp_path)
    assert len(calls) == 2 and all(" -m pytest " in c for c in calls)
    for name in ("test_a_gpu", "test_b_gpu"):
        call = next(c for c in calls if f"tests/gpu/{name}.py" in c)
        assert f"--junitxml={tmp_path / 'out'}/gpu_tests_s9_{name}.xml" in call
    lines = [ln.rstrip() for ln in r.stdout.strip().splitlines()]
    assert [ln.split(":")[0] for ln in lines] == ["test_a_gpu", "test_b_gpu"]
    assert "rc=0" in lines[0] and "rc=3" in lines[1]
    out = tmp_path / "out"
    assert [ln.rstrip() for ln in (out / "gpu_tests_s9.txt").read_text().splitlines()] == lines
    # the logs travel as one archive (a device call returns at most 8 files)
    packed = subprocess.run(["tar", "tJf", str(out / "gpu_tests_s9.tar.xz")],
                            capture_output=True, text=True, check=True).stdout.split()
    assert sorted(packed) == ["gpu_tests_s9_test_a_gpu.log", "gpu_tests_s9_test_b_gpu.log"]
    assert sorted(p.name for p in out.iterdir()) == ["gpu_tests_s9.tar.xz", "gpu_tests_s9.txt"]


def test_gpu_tests_all_wants_a_tag_and_a_file(tmp_path):
    repo, env = _fake_repo(tmp_path, "bench/gpu_tests_all.sh")
    r = run_script(repo, "bench/gpu_tests_all.sh", env, "s9")
    assert r.returncode == 2 and "usage" in r.stderr


def test_presum_quant_runs_both_probes_even_when_the_first_fails(tmp_path):
    repo, env = _fake_repo(tmp_path, "bench/presum_quant_h200.sh")
    env["FAKE_FAIL"] = "presum_split_probe"
    r = run_script(repo, "bench/presum_quant_h200.sh", env)
    assert r.returncode == 3, r.stdout + r.stderr
    calls = _calls(tmp_path)
    assert [c.split()[1] for c in calls] == ["bench/probes/presum_split_probe.py",
                                             "bench/probes/quant_layer_config_probe.py"]
    out = tmp_path / "out"
    assert {p.name for p in out.iterdir()} == {"presum_split_probe.log",
                                               "quant_layer_config_probe.log"}


def test_kext_presum_script_runs_every_step_and_keeps_a_failure(tmp_path):
    repo, env = _fake_repo(tmp_path, "bench/kext_presum_h200.sh")
    env["FAKE_FAIL"] = "test_kext_presum_gpu"
    r = run_script(repo, "bench/kext_presum_h200.sh", env)
    assert r.returncode == 3, r.stdout + r.stderr
    calls = _calls(tmp_path)
    assert len(calls) == 3
    out = tmp_path / "out"
    assert f"--junitxml {out}/gpu_tests_kext_presum.xml" in calls[0] \
        and calls[0].endswith("tests/gpu/test_kext_presum_gpu.py")
    assert "tests/gpu/test_ops_gpu.py" in calls[1] and "dispatched_layer" in calls[1]
    assert calls[2].endswith("bench/probes/kext_presum_probe.py")
    assert "gpu_tests_kext_presum: rc=3" in r.stdout and "kext_presum_probe: rc=0" in r.stdout
    assert {p.name for p in out.iterdir()} >= {"gpu_tests_kext_presum.log",
                                                "gpu_tests_ops.log", "kext_presum_probe.log"}


def test_h200_scripts_stop_at_once_without_devcache(tmp_path):
    repo, env = _fake_repo(tmp_path, "bench/wgmma_presum_h200.sh")
    shutil.rmtree(repo / ".devcache")
    r = run_script(repo, "bench/wgmma_presum_h200.sh", env)
    assert r.returncode == 2 and "carry .devcache" in r.stdout
    assert not (tmp_path / "calls.log").exists()


def test_hopper_targets_benches_each_model_with_the_kext_folds(tmp_path):
    repo, env = _fake_repo(tmp_path, "bench/hopper_targets_h200.sh")
    env.update({"TAG": "s99", "MODELS": "qwen3-8b,qwen3-4b", "COMPS": "none,0.125",
                "KEXT_FOLDS": "exact,presum"})
    r = run_script(repo, "bench/hopper_targets_h200.sh", env)
    assert r.returncode == 0, r.stdout + r.stderr
    calls = _calls(tmp_path)
    assert [c.split("--model ")[1].split()[0] for c in calls] == ["qwen3-8b", "qwen3-4b"]
    for c in calls:
        assert "--compensations none,0.125 --kext-folds exact,presum" in c
    out = tmp_path / "out"
    assert (out / "bench_s99_qwen3-4b.json").exists()
    assert "bench qwen3-4b:" in (out / "bench_s99_qwen3-4b.log").read_text()
