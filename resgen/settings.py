"""All resgen settings in one place; environment variables are read only here.

RESGEN_CACHE_DIR   rendered kernels and compile artifacts (default ~/.cache/resgen)
RESGEN_DB          an explicit tuning database to consult first
RESGEN_ARCH        compile target when no GPU is present (default sm_90a)
RESGEN_TUNED_DIR   the shipped dispatch tables, one per GPU (default <repo>/tuned)

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

__all__ = ["Settings", "settings", "arch_of_capability", "device_arch", "DEFAULT_ARCH"]

_REPO_TUNED = Path(__file__).resolve().parent.parent / "tuned"
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


@dataclass(frozen=True)
class Settings:
    cache_dir: Path
    db_path: Path | None
    no_gpu_arch: str                 # RESGEN_ARCH, else DEFAULT_ARCH
    tuned_dir: Path = _REPO_TUNED

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
    return Settings(cache_dir=Path(cache), db_path=Path(db) if db else None,
                    no_gpu_arch=os.environ.get("RESGEN_ARCH") or DEFAULT_ARCH,
                    tuned_dir=Path(tuned) if tuned else _REPO_TUNED)
