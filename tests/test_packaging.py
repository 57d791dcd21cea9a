"""An installed resgen (a wheel, not the source checkout) serves the shipped table and runs
`resgen bench`'s baselines (issue 22 item 13): the table is package data (resgen/_tuned, built
from tuned/ by setup.py) and the baselines are package code (resgen.baselines)."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TABLES = sorted(p.name for p in (ROOT / "tuned").glob("*.sqlite*"))

PROBE = """
import resgen, resgen.settings as S
from pathlib import Path
from resgen.runtime import Device, Dispatcher
from resgen.search.variant import LinearProblem
from resgen.cli import _load_baselines
site = Path(__import__("sys").argv[1]).resolve()
assert Path(resgen.__file__).resolve().is_relative_to(site), resgen.__file__
assert S.settings().tuned_dir == site / "resgen" / "_tuned", S.settings().tuned_dir
d = Dispatcher(device=Device("NVIDIA H200", "sm_90a"))
p = LinearProblem("nvfp4", "full", 1, 4096, 4096, True)
v = d.lookup("linear", p)
print("SOURCE", d.source("linear", p))
print("FLOOR", _load_baselines().floor_us(4.45e6))
"""


@pytest.mark.slow
@pytest.mark.skipif(not TABLES, reason="no shipped table in tuned/")
def test_a_wheel_ships_the_table_and_the_baselines(tmp_path):
    whl = tmp_path / "whl"
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "-w", str(whl),
                        "--no-deps", "--no-build-isolation", "-q"], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    (wheel,) = whl.glob("resgen-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for t in TABLES:
        assert f"resgen/_tuned/{t}" in names
    assert "resgen/baselines.py" in names and "resgen/templates/quant_sm90.py.j2" in names
    site = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                        str(site), str(wheel)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(site), "HOME": str(tmp_path),
           "RESGEN_CACHE_DIR": str(tmp_path / "cache")}
    r = subprocess.run([sys.executable, "-c", PROBE, str(site)], capture_output=True,
                       text=True, timeout=600, cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"_tuned/{TABLES[0]} bucket" in r.stdout, r.stdout + r.stderr[-1000:]
    assert "FLOOR 1.0" in r.stdout
