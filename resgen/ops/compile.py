"""Compiled kernels for the run-time ops, memoized per process."""

from __future__ import annotations

from typing import Any

from ..search.variant import ProblemBase

__all__ = ["compile_cached"]

_COMPILED: dict[tuple, Any] = {}


def compile_cached(family: Any, variant: Any, problem: ProblemBase, arch: str) -> Any:
    """The compiled kernel of `variant` for `problem` (memoized per family, variant, compile
    key and arch in this process). Raises RuntimeError with the compiler's message on failure."""
    from ..search import build

    key = (family.NAME, variant.key(), family.compile_key(variant, problem).key(), arch)
    if key not in _COMPILED:
        out = build.compile_variant(family, variant, problem, arch)
        if not out.ok:
            raise RuntimeError(f"{variant.name()} did not compile for {problem.key()} on "
                               f"{arch}: {out.error}")
        _COMPILED[key] = out.compiled
    return _COMPILED[key]
