"""All resgen settings in one place; environment variables are read only here.

RESGEN_CACHE_DIR   rendered kernels and compile artifacts (default ~/.cache/resgen)
RESGEN_DB          an explicit tuning database to consult first
RESGEN_ARCH        compile target when no GPU is present (default sm_90a)
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Settings", "settings"]


@dataclass(frozen=True)
class Settings:
    cache_dir: Path
    db_path: Path | None
    arch: str


@functools.lru_cache(maxsize=1)
def settings() -> Settings:
    cache = os.environ.get("RESGEN_CACHE_DIR") or str(Path.home() / ".cache" / "resgen")
    db = os.environ.get("RESGEN_DB")
    return Settings(cache_dir=Path(cache), db_path=Path(db) if db else None,
                    arch=os.environ.get("RESGEN_ARCH", "sm_90a"))
