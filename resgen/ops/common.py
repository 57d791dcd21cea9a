"""What the run-time ops share: choosing the variant for a problem (a pinned variant, checked
with its family's predicate, or the dispatch tables through resgen.runtime) and compiling it
once per process."""

from __future__ import annotations

from typing import Any

from ..search.family import KernelFamily
from ..search.variant import ProblemBase

__all__ = ["compile_cached", "choose_variant", "MAX_PLANS"]

MAX_PLANS = 256     # per op instance: shape classes whose plans (and buffers) are kept, LRU

_COMPILED: dict[tuple, Any] = {}


def compile_cached(family: KernelFamily, variant: Any, problem: ProblemBase,
                   arch: str) -> Any:
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


def choose_variant(op: str, problem: ProblemBase, arch: str, family: str | None = None,
                   variant: Any = None, dispatcher: Any = None
                   ) -> tuple[KernelFamily, Any, str]:
    """(family object, variant, where it came from) for `problem`: the pinned `variant` (a
    ValueError if its family's predicate rejects the problem), else the dispatcher's answer
    (default: the process-wide resgen.runtime dispatcher), optionally within `family`."""
    from ..search.family import get_family

    if variant is not None:
        fam = get_family(variant.FAMILY)
        why = fam.why_invalid(variant, problem, arch)
        if why is not None:
            raise ValueError(f"pinned variant {variant.name()} cannot run {problem.key()}: "
                             f"{why}")
        return fam, variant, "pinned"
    if dispatcher is None:
        from .. import runtime

        dispatcher = runtime.dispatcher()
    v = dispatcher.lookup(op, problem, family)
    return get_family(v.FAMILY), v, dispatcher.source(op, problem, family)
