"""bench/ is entry points, probes/ and report/ (bench/README.md): every script is listed where
it lives, every probe has its row, and every bench/ path that a doc, script or test cites
exists (a move that forgot a citation fails here, not on the GPU machine)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"


def _scripts(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir()
                  if p.is_file() and p.suffix in (".py", ".sh"))


def test_every_entry_point_and_report_is_listed_in_the_bench_readme():
    text = (BENCH / "README.md").read_text()
    missing = [n for n in _scripts(BENCH) if f"`{n}`" not in text and f"{n}`" not in text]
    missing += [f"report/{n}" for n in _scripts(BENCH / "report") if n not in text]
    assert not missing, f"add these to bench/README.md: {missing}"


def test_every_probe_has_its_readme_row():
    rows = [ln for ln in (BENCH / "probes" / "README.md").read_text().splitlines()
            if ln.startswith("| `")]
    named = {re.match(r"\| `([^`]+)`", ln).group(1) for ln in rows}
    missing = [n for n in _scripts(BENCH / "probes") if n not in named]
    assert not missing, f"add a row (question, result, conclusion, doc) for: {missing}"
    for ln in rows:                         # question | result | conclusion | absorbed by
        assert ln.count("|") >= 6, ln


def _tracked_texts() -> list[Path]:
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], check=True,
                             capture_output=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    paths = [ROOT / p for p in out.decode().split("\0") if p]
    return [p for p in paths if p.is_file() and p.suffix in (".md", ".py", ".sh", ".toml")
            and not (p.relative_to(ROOT).parts[:2] == ("bench", "results")
                     and p.suffix != ".md")]


# a script that a test writes into a fake repository, not a citation
MADE_BY_TESTS = {"bench/x_probe.py"}


def test_every_cited_bench_script_exists():
    """Every bench/ script a tracked text names exists, unless that line also says where a
    retired one lives (`git show REV:bench/x.py`)."""
    # `git show REV:bench/x.py` names a file at a revision (a retired script), not the tree
    cite = re.compile(r"(?<![\w/.:-])bench/((?:[\w-]+/)*[\w-]+\.(?:py|sh))\b")
    missing = set()
    for p in _tracked_texts():
        for line in p.read_text(errors="ignore").splitlines():
            for m in cite.finditer(line):
                retired = f":bench/{m.group(1)}" in line     # the line says where it lives
                if (not (BENCH / m.group(1)).is_file() and m.group(0) not in MADE_BY_TESTS
                        and not retired):
                    missing.add(f"{p.relative_to(ROOT)}: bench/{m.group(1)}")
    assert not missing, sorted(missing)


def test_run_record_names_the_command_that_reproduces_the_run(monkeypatch):
    import sys

    sys.path.insert(0, str(BENCH))
    from run_record import run_record

    from resgen.search.timing import DEFAULT_POLICY

    monkeypatch.setenv("RESGEN_BENCH_BUDGET_S", "140")
    monkeypatch.setenv("OUT", "/tmp/out dir")
    rec = run_record(BENCH / "gpu_attention_check.py", ["--out", "a b"], policy=DEFAULT_POLICY,
                     budget_s=140.0)
    assert rec["command"] == ("RESGEN_BENCH_BUDGET_S=140 python3 bench/gpu_attention_check.py "
                              "--out 'a b'")
    assert rec["env"]["OUT"] == "/tmp/out dir" and "OUT=" not in rec["command"]
    assert rec["policy"] == {"label": DEFAULT_POLICY.label, **DEFAULT_POLICY.as_dict()}
    assert rec["budget_s"] == 140.0 and rec["argv"] == ["--out", "a b"] and rec["date"]


@pytest.mark.parametrize("script, flags", [
    ("gpu_attention_check.py", ["--budget-s", "--out", "--no-tests"]),
    ("gpu_prefill_check.py", ["--budget-s", "--total-s", "--out", "--no-tests"]),
])
def test_gpu_entry_points_take_the_flags_bench_readme_names(script, flags):
    """The flags replace RESGEN_BENCH_* variables (which stay their defaults); --help runs on
    a CPU, and bench/README.md's commands use them."""
    import os
    import sys

    r = subprocess.run([sys.executable, str(BENCH / script), "--help"], capture_output=True,
                       text=True, timeout=300, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr[-2000:]
    for f in flags:
        assert f in r.stdout, (script, f)
    readme_cmd = next(ln for ln in (BENCH / "README.md").read_text().splitlines()
                      if ln.startswith(f"| `{script}`"))
    for f in re.findall(r"--[a-z][\w-]*", readme_cmd.split("|")[-2]):
        assert f in r.stdout, (script, f)
