"""Covering subsets of a variant space: few variants in which every (field, value) pair of
the space appears at least once (what the GPU tests check when the whole space is too big)."""

from __future__ import annotations

import dataclasses
from typing import Sequence, TypeVar

__all__ = ["covering_subset"]

V = TypeVar("V")


def _pairs(v) -> set[tuple[str, object]]:
    return {(f.name, getattr(v, f.name)) for f in dataclasses.fields(v)}


def covering_subset(space: Sequence[V]) -> list[V]:
    """Greedy set cover: repeatedly the variant (first in space order on ties) that adds the
    most (field, value) pairs not yet covered. space: dataclass instances."""
    need = set().union(*(_pairs(v) for v in space)) if space else set()
    chosen: list[V] = []
    while need:
        best = max(space, key=lambda v: len(need & _pairs(v)))
        chosen.append(best)
        need -= _pairs(best)
    return chosen
