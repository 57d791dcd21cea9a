"""Covering subsets of a variant space: few variants in which every (field, value) pair of
the space appears at least once (what the GPU tests check when the whole space is too big)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence, TypeVar

__all__ = ["covering_subset", "field_pairs"]

V = TypeVar("V")


def field_pairs(v: Any) -> set[Any]:
    """A dataclass instance's (field name, value) pairs."""
    return {(f.name, getattr(v, f.name)) for f in dataclasses.fields(v)}


def covering_subset(space: Sequence[V],
                    pairs: Callable[[V], set[Any]] = field_pairs) -> list[V]:
    """Greedy set cover: repeatedly the item (first in space order on ties) that adds the
    most pairs not yet covered. space: dataclass instances (pairs: their (field, value)
    pairs), or any items with a `pairs` function of their own (e.g. (problem, variant)
    cases that also cover problem properties)."""
    need = set().union(*(pairs(v) for v in space)) if space else set()
    chosen: list[V] = []
    while need:
        best = max(space, key=lambda v: len(need & pairs(v)))
        chosen.append(best)
        need -= pairs(best)
    return chosen
