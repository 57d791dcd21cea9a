"""Every user error of the CLI is one clear line and exit code 2, and nothing is created
before the arguments are validated (issue 22 items 4, 5, 11, 14); the problem constructors
validate what they are given (item 5)."""

from __future__ import annotations

import subprocess
import sys

import pytest

import fakefam
from fakefam import isolated_cache, subprocess_env  # noqa: F401
from resgen.cli import main
from resgen.search.variant import AttentionProblem, LinearProblem

pytestmark = pytest.mark.usefixtures("isolated_cache")

BASE = ["tune", "--families", "fake_gemm", "--import", "fakefam"]


def _one_line_error(capsys, argv, *needles):
    capsys.readouterr()
    rc = main(argv)
    out, err = capsys.readouterr()
    assert rc == 2, (argv, out, err)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


@pytest.mark.parametrize("extra,needle", [
    (["--model", "meta-llama/Llama-3.1-8B"], "unknown model"),
    (["--model", "qwen3-8b", "--tp", "3"], "tp=3"),
    (["--model", "qwen3-8b", "--time-budget", "0"], "--time-budget"),
    (["--model", "qwen3-8b", "--time-budget", "-5"], "--time-budget"),
    (["--model", "qwen3-8b", "--time-budget", "nan"], "--time-budget"),
    (["--model", "qwen3-8b", "--formats", "fp8"], "fmt='fp8'"),
    (["--model", "qwen3-8b", "--m-buckets", "2000000"], "m=2000000"),
    (["--model", "qwen3-8b", "--compensations", "0.3"], "compensation='0.3'"),
    (["--model", "qwen3-8b", "--import", "no_such_module_xyz"], "no_such_module_xyz"),
])
@pytest.mark.parametrize("plan", [True, False])
def test_tune_refuses_bad_arguments_before_creating_anything(tmp_path, capsys, extra,
                                                              needle, plan):
    db = tmp_path / "never.sqlite"
    argv = BASE + extra + ["--db", str(db)] + (["--plan"] if plan else [])
    _one_line_error(capsys, argv, needle)
    assert not db.exists()


def test_attention_pv_is_validated(tmp_path, capsys):
    db = tmp_path / "never.sqlite"
    _one_line_error(capsys, ["tune", "--model", "qwen3-8b", "--ops", "decode_attention",
                             "--attn-pv", "bf16", "--db", str(db), "--plan"], "pv='bf16'")
    assert not db.exists()


def test_model_folders_with_bad_configs(tmp_path, capsys):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_bytes(b"\xff\xfe{\x00")
    _one_line_error(capsys, BASE + ["--model", str(d), "--plan"], "UTF-8")
    (d / "config.json").write_text("[1, 2]")
    _one_line_error(capsys, BASE + ["--model", str(d), "--plan"], "JSON object")
    (d / "config.json").write_text('{"hidden_size": 100, "num_attention_heads": 4, '
                                   '"intermediate_size": 64, "num_hidden_layers": 1}')
    _one_line_error(capsys, BASE + ["--model", str(d), "--plan"], "head_dim")


def test_a_db_that_is_not_ours_is_refused_before_the_plan(tmp_path, capsys):
    junk = tmp_path / "junk.sqlite"
    junk.write_bytes(b"this is not a database" * 20)
    before = junk.read_bytes()
    line = _one_line_error(capsys, BASE + ["--model", "qwen3-8b", "--db", str(junk)],
                           "not an SQLite database")
    assert "PLAN" not in line and junk.read_bytes() == before
    _one_line_error(capsys, BASE + ["--model", "qwen3-8b", "--db", str(tmp_path)],
                    "directory")


def test_a_missing_kernel_compiler_is_one_error(tmp_path, capsys, monkeypatch):
    """Item 11: checked once before planning, with what to install (not 12,288 failures)."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "cutlass" else real(name, *a))
    db = tmp_path / "never.sqlite"
    _one_line_error(capsys, ["tune", "--model", "qwen3-8b", "--families", "quant_sm90",
                             "--db", str(db)], "nvidia-cutlass-dsl", "resgen[kernels]")
    assert not db.exists()
    # --plan needs no compiler; an out-of-tree family brings its own
    assert main(["tune", "--model", "qwen3-8b", "--families", "quant_sm90", "--plan",
                 "--db", str(db)]) == 0


def test_show_and_db_bad_inputs(tmp_path, capsys):
    _one_line_error(capsys, ["show", "--db", str(tmp_path / "missing.sqlite")],
                    "no such tuning database")
    _one_line_error(capsys, ["show", "--import", "no_such_module_xyz"], "no_such_module_xyz")
    _one_line_error(capsys, ["db", "verify", str(tmp_path / "missing.sqlite")], "no such")
    fakefam.tune_fake(tmp_path / "a.sqlite", ms=[1], max_variants=2)
    (tmp_path / "out.sqlite").write_bytes(b"")
    _one_line_error(capsys, ["db", "export", str(tmp_path / "a.sqlite"), "--out",
                             str(tmp_path / "out.sqlite")], "exists")


def test_bench_unknown_model_is_one_line(capsys):
    _one_line_error(capsys, ["bench", "--model", "meta-llama/Llama-3.1-8B"], "unknown model")


def test_report_and_plan_without_the_quality_extra(monkeypatch, capsys):
    """Item 14: a missing third-party module says what to install."""
    import types

    fake = types.ModuleType("resgen.quality.cli")

    def report_main(argv):
        raise ModuleNotFoundError("No module named 'transformers'", name="transformers")

    fake.report_main = report_main
    fake.plan_main = lambda argv: (_ for _ in ()).throw(FileNotFoundError("jargon.txt.gz"))
    monkeypatch.setitem(sys.modules, "resgen.quality.cli", fake)
    import resgen.quality

    monkeypatch.setattr(resgen.quality, "cli", fake, raising=False)
    _one_line_error(capsys, ["report", "--quick"], "transformers", "--quality")
    _one_line_error(capsys, ["plan"], "jargon.txt.gz")


def test_problem_constructors_validate():
    """Item 5: the constructors refuse what from_dict refuses."""
    for kw in (dict(fmt="fp8"), dict(compensation="0.3"), dict(m=2_000_000), dict(m=0),
               dict(n=True), dict(static_scale=1)):
        with pytest.raises(ValueError, match="LinearProblem"):
            LinearProblem(**kw)
    with pytest.raises(ValueError, match="pv"):
        AttentionProblem(pv="bf16")
    with pytest.raises(ValueError, match="head_dim"):
        AttentionProblem(head_dim=8)
    p = LinearProblem("mxfp4", "0.25", 16, 4096, 4096, True)
    assert LinearProblem.from_key(p.key()) == p


def test_unknown_model_in_a_process_is_one_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "resgen", "tune", "--model", "meta-llama/x",
                        "--plan"], capture_output=True, text=True, env=subprocess_env(),
                       timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().count("\n") == 0 and "unknown model" in r.stderr


def test_show_without_db_shows_what_the_runtime_serves(tmp_path, capsys):
    """Item 16: the shipped table of a GPU (here the fake GPU's, tuned/fake.sqlite) is shown
    with the runtime's answer per tuned workload, the user's cache database first."""
    from resgen.settings import settings

    tuned = settings().tuned_dir
    tuned.mkdir(parents=True)
    sums = fakefam.tune_fake(tuned / "fake.sqlite", ms=[1, 4], max_variants=6)
    capsys.readouterr()
    assert main(["show", "--import", "fakefam"]) == 0
    out = capsys.readouterr().out
    assert "What the runtime serves on Fake GPU (sm_90a)" in out
    assert str(settings().user_db) in out and "fake.sqlite" in out
    for s in sums:
        assert s.winner in out
    assert out.count("\nfake_gemm") == 2


@pytest.mark.parametrize("argv, needle", [
    (["tune", "--model", "qwen3-8b", "--tp", "x", "--plan"], "--tp: 'x' is not an integer"),
    (["tune", "--model", "qwen3-8b", "--m-buckets", "1,0", "--plan"],
     "0 is not a positive integer"),
    (["generate", "--model", "m", "--prompt", "p", "--max-new-tokens", "0"],
     "--max-new-tokens: 0 is not a positive integer"),
    (["quantize", "--model", "m", "--fmt", "nvfp4", "--calib", "c", "--out", "o",
      "--seq-len", "x"], "--seq-len: 'x' is not an integer"),
])
def test_count_arguments_of_every_command_say_what_is_wrong(capsys, argv, needle):
    """resgen.argtypes.positive_int behind tune, generate and quantize: a count that is not a
    positive integer is argparse's usage error naming the argument (exit 2), no traceback."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err
    assert needle in err.strip().splitlines()[-1], err
