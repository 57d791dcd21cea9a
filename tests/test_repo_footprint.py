"""The repository must travel to the GPU machine: one device call carries at most 64 MiB, and the
CuTe DSL / optuna bundle it needs (.devcache, made by scripts/devcache.sh from ../shared/device)
takes about 50 MiB of that. The device tool counts disk usage (4 KiB blocks), not bytes: a
session once had 63.8 MiB by bytes refused. This guard fails while there is still room to act
(compress superseded raw results with xz, keep tuned tables compressed) instead of at the next
device call."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MIB = 1 << 20
CARRY_LIMIT = 64 * MIB
BLOCK = 4096
# 64 MiB minus the slim device bundle (49.8 MiB in 4 KiB blocks) leaves about 14 MiB; 13 MiB
# keeps 1 MiB for a session's untracked results (the real sum is checked below where
# .devcache exists)
TRACKED_LIMIT = 13 * MIB


def disk_usage(size: int) -> int:
    """Bytes a file of `size` bytes occupies in 4 KiB blocks (how the device tool counts)."""
    return -(-size // BLOCK) * BLOCK


def _tracked() -> list[Path]:
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], check=True,
                             capture_output=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the device call copies a git working tree")
    return [ROOT / p for p in out.decode().split("\0") if p]


def _usage(files: list[Path]) -> int:
    return sum(disk_usage(p.stat().st_size) for p in files)


def test_disk_usage_rounds_up_to_blocks():
    assert [disk_usage(n) for n in (0, 1, BLOCK, BLOCK + 1)] == [0, BLOCK, BLOCK, 2 * BLOCK]


def test_tracked_files_fit_beside_the_device_bundle():
    files = [p for p in _tracked() if p.is_file()]
    assert files, "git lists no files"
    total = _usage(files)
    largest = sorted(files, key=lambda p: p.stat().st_size, reverse=True)[:5]
    detail = ", ".join(f"{p.relative_to(ROOT)} {p.stat().st_size // 1024} KiB" for p in largest)
    assert total <= TRACKED_LIMIT, (f"tracked files take {total / MIB:.2f} MiB of disk > "
                                    f"{TRACKED_LIMIT / MIB:.0f} MiB: a device call would "
                                    f"exceed 64 MiB with .devcache; largest: {detail}")


def test_local_device_bundle_fits_with_the_tree():
    """Where .devcache exists (the development machine), the real sum must fit, with 1 MiB to
    spare for the files a session writes before its next call."""
    bundle = ROOT / ".devcache"
    if not bundle.is_dir():
        pytest.skip("no .devcache here (CI): the tracked-files guard above covers the tree")
    files = [p for p in _tracked() if p.is_file()]
    extra = [Path(d) / f for d, _, fs in os.walk(bundle) for f in fs]
    total = _usage(files) + _usage(extra)
    assert total <= CARRY_LIMIT - MIB, (
        f"tree {_usage(files) / MIB:.1f} MiB + .devcache {_usage(extra) / MIB:.1f} MiB > 63 MiB:"
        " remake .devcache with scripts/devcache.sh (drops optuna's RDB-storage wheels)")


def test_devcache_script_drops_only_the_rdb_storage_wheels(tmp_path):
    src = tmp_path / "device"
    (src / "wheels").mkdir(parents=True)
    (src / "env.sh").write_text("# env\n")
    kept = ["optuna-5.0.0-py3-none-any.whl", "sqlite_utils-4.2.1-py3-none-any.whl",
            "colorlog-6.12.0-py3-none-any.whl"]
    dropped = ["sqlalchemy-2.1.9-cp312-cp312-manylinux2014_x86_64.whl",
               "greenlet-3.5.6-cp312-cp312-manylinux_2_28_x86_64.whl",
               "alembic-1.20.1-py3-none-any.whl", "mako-1.4.3-py3-none-any.whl"]
    for name in kept + dropped:
        (src / "wheels" / name).write_bytes(b"x")
    dest = tmp_path / "out"
    r = subprocess.run(["bash", str(ROOT / "scripts" / "devcache.sh"), str(src)],
                       env={**os.environ, "DEVCACHE_DEST": str(dest)},
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert (dest / "device" / "env.sh").is_file()
    assert sorted(p.name for p in (dest / "device" / "wheels").iterdir()) == sorted(kept)
    bad = subprocess.run(["bash", str(ROOT / "scripts" / "devcache.sh"), str(tmp_path / "no")],
                         env={**os.environ, "DEVCACHE_DEST": str(dest)},
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "env.sh not found" in bad.stderr
    assert (dest / "device" / "env.sh").is_file()       # a bad source removes nothing


def _stem(name: str) -> str:
    for ext in (".xz", ".json", ".jsonl", ".log", ".svg", ".xml", ".md", ".txt", ".csv"):
        if name.endswith(ext):
            name = name[: -len(ext)]
    return name


def test_every_result_file_is_cited():
    """A file under bench/results/ is kept only while something cites it (a README or doc
    row, a script that reads it): by name, by its name without .xz, or by its stem (a row
    such as "decode_step.json (.log)"). git keeps the ones deleted."""
    import re

    files = [p for p in _tracked() if p.is_file()]
    res = [p for p in files if p.relative_to(ROOT).parts[:2] == ("bench", "results")]
    texts = [p.read_text(errors="ignore") for p in files
             if p.suffix in (".py", ".md", ".sh", ".txt", ".toml", ".j2", ".cfg")
             and (p not in res or p.suffix == ".md")]
    blob = "\n".join(texts)
    uncited = []
    for p in res:
        b = p.name
        if b in blob or (b.endswith(".xz") and b[:-3] in blob):
            continue
        if re.search(r"(?<![\w-])" + re.escape(_stem(b)) + r"(?![\w-])", blob):
            continue
        uncited.append(str(p.relative_to(ROOT)))
    assert not uncited, f"cite these in a README / doc or delete them: {uncited}"
