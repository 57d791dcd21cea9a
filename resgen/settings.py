"""All resgen settings in one place; environment variables are read only here.

RESGEN_CACHE_DIR   rendered kernels and compile artifacts (default ~/.cache/resgen)
RESGEN_DB          an explicit tuning database to consult first
RESGEN_ARCH        compile target when no GPU is present (default sm_90a)
RESGEN_TUNED_DIR   the shipped dispatch tables, one per GPU (default: the package's copy,
                   <package>/_tuned, in an installed wheel; <repo>/tuned in a source checkout)
RESGEN_COORDINATOR the PostgreSQL URL `resgen tune` coordinates through by default (its
                   --coordinator; unset: no coordinator; resgen.search.coordinator)
RESGEN_EXPERIMENTAL opt-in families

The compile target (`settings().arch`, the default of resgen.ops and the compile-only CLI) is
this machine's GPU's arch when a CUDA GPU is present (compute capability 9.0 -> sm_90a), else
RESGEN_ARCH, else sm_90a.

The runtime's database search order is: an explicit path, then RESGEN_DB, then the user's
cache database `<cache_dir>/tuning.sqlite`, then `<tuned_dir>/<gpu>.sqlite` for this GPU.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Settings", "settings", "arch_of_capability", "device_arch", "DEFAULT_ARCH",
           "default_tuned_dir"]

_PACKAGE = Path(__file__).resolve().parent
_REPO_TUNED = _PACKAGE.parent / "tuned"          # the user's layout in a source checkout
_PACKAGED_TUNED = _PACKAGE / "_tuned"            # tuned/ as package data (setup.py build_py)
DEFAULT_ARCH = "sm_90a"          # the compile target without a GPU and without RESGEN_ARCH


def arch_of_capability(major: int, minor: int) -> str:
    """CUDA compute capability -> the arch-specific target resgen compiles for."""
    return f"sm_{major}{minor}a" if major >= 9 else f"sm_{major}{minor}"


@functools.lru_cache(maxsize=1)
def device_arch() -> str | None:
    """The arch of CUDA device 0, or None without a usable GPU (read once per process; this
    initializes CUDA, so it is called only when a compile target is asked for)."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        return arch_of_capability(*torch.cuda.get_device_capability(0))
    except Exception:
        return None


def default_tuned_dir() -> Path:
    """Where the shipped tables are without RESGEN_TUNED_DIR: the copy built into the
    package (a wheel or non-editable install) when there is one, else the source checkout's
    tuned/ (an editable install or PYTHONPATH)."""
    if any(_PACKAGED_TUNED.glob("*.sqlite*")):
        return _PACKAGED_TUNED
    return _REPO_TUNED


@dataclass(frozen=True)
class Settings:
    cache_dir: Path
    db_path: Path | None
    no_gpu_arch: str                 # RESGEN_ARCH, else DEFAULT_ARCH
    tuned_dir: Path = _REPO_TUNED
    coordinator: str | None = None   # RESGEN_COORDINATOR
    experimental: frozenset[str] = frozenset()

    @property
    def user_db(self) -> Path:
        """The tuner's default output and the runtime's second choice."""
        return self.cache_dir / "tuning.sqlite"

    @property
    def arch(self) -> str:
        """The compile target: the GPU's arch where one is present, else no_gpu_arch."""
        return device_arch() or self.no_gpu_arch


@functools.lru_cache(maxsize=1)
def settings() -> Settings:
    """Read once; tests that change the environment call `settings.cache_clear()`."""
    cache = os.environ.get("RESGEN_CACHE_DIR") or str(Path.home() / ".cache" / "resgen")
    db = os.environ.get("RESGEN_DB")
    tuned = os.environ.get("RESGEN_TUNED_DIR")
    exp = os.environ.get("RESGEN_EXPERIMENTAL", "")
    return Settings(cache_dir=Path(cache), db_path=Path(db) if db else None,
                    no_gpu_arch=os.environ.get("RESGEN_ARCH") or DEFAULT_ARCH,
                    tuned_dir=Path(tuned) if tuned else default_tuned_dir(),
                    coordinator=os.environ.get("RESGEN_COORDINATOR") or None,
                    experimental=frozenset(n for n in exp.split(",") if n))
