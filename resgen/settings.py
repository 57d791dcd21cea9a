"""All resgen settings in one place; environment variables are read only here.

RESGEN_CACHE_DIR   rendered kernels and compile artifacts (default ~/.cache/resgen)
RESGEN_DB          an explicit tuning database to consult first
RESGEN_ARCH        compile target when no GPU is present (default sm_90a)
RESGEN_TUNED_DIR   the shipped dispatch tables, one per GPU (default <repo>/tuned)

The runtime's database search order is: an explicit path, then RESGEN_DB, then the user's
cache database `<cache_dir>/tuning.sqlite`, then `<tuned_dir>/<gpu>.sqlite` for this GPU.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Settings", "settings"]

_REPO_TUNED = Path(__file__).resolve().parent.parent / "tuned"


@dataclass(frozen=True)
class Settings:
    cache_dir: Path
    db_path: Path | None
    arch: str
    tuned_dir: Path = _REPO_TUNED

    @property
    def user_db(self) -> Path:
        """The tuner's default output and the runtime's second choice."""
        return self.cache_dir / "tuning.sqlite"


@functools.lru_cache(maxsize=1)
def settings() -> Settings:
    """Read once; tests that change the environment call `settings.cache_clear()`."""
    cache = os.environ.get("RESGEN_CACHE_DIR") or str(Path.home() / ".cache" / "resgen")
    db = os.environ.get("RESGEN_DB")
    tuned = os.environ.get("RESGEN_TUNED_DIR")
    return Settings(cache_dir=Path(cache), db_path=Path(db) if db else None,
                    arch=os.environ.get("RESGEN_ARCH", "sm_90a"),
                    tuned_dir=Path(tuned) if tuned else _REPO_TUNED)
