"""The repository must travel to the GPU machine: one device call carries at most 64 MiB, and the
CuTe DSL / optuna bundle it needs (.devcache, a copy of ../shared/device) takes about 55 MiB of
that. This guard fails while there is still room to act (compress superseded raw results with
xz, keep tuned tables compressed) instead of at the next device call."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# 64 MiB minus the 57.9 MB device bundle leaves about 9.2 MB; keep a margin for a session's
# new results
LIMIT_BYTES = 9_000_000


def _tracked() -> list[Path]:
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], check=True,
                             capture_output=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the device call copies a git working tree")
    return [ROOT / p for p in out.decode().split("\0") if p]


def test_tracked_files_fit_beside_the_device_bundle():
    files = [p for p in _tracked() if p.is_file()]
    assert files, "git lists no files"
    total = sum(p.stat().st_size for p in files)
    largest = sorted(files, key=lambda p: p.stat().st_size, reverse=True)[:5]
    detail = ", ".join(f"{p.relative_to(ROOT)} {p.stat().st_size // 1024} KiB" for p in largest)
    assert total <= LIMIT_BYTES, (f"tracked files take {total / 1e6:.2f} MB > "
                                  f"{LIMIT_BYTES / 1e6:.1f} MB: a device call would exceed "
                                  f"64 MiB with .devcache; largest: {detail}")
