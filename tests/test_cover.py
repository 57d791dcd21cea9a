"""resgen.search.cover: covering subsets of the real variant spaces (what the GPU tests run)."""

from __future__ import annotations

import dataclasses

from resgen.search.cover import covering_subset
from resgen.search.linear_sm90_mma import FAMILY as MMA
from resgen.search.linear_sm90_wgmma import FAMILY as WGMMA
from resgen.search.variant import LinearProblem


def _pairs(vs):
    return {(f.name, getattr(v, f.name)) for v in vs for f in dataclasses.fields(v)}


def test_covering_subset_covers_every_field_value_of_real_spaces():
    for fam, p in ((MMA, LinearProblem("nvfp4", "full", 16, 256, 1024)),
                   (WGMMA, LinearProblem("nvfp4", "none", 40, 256, 256))):
        space = list(fam.space(p, "sm_90a"))
        chosen = covering_subset(space)
        assert _pairs(chosen) == _pairs(space)
        assert all(v in space for v in chosen) and len(set(chosen)) == len(chosen)
        assert len(chosen) < len(space) / 4
        assert covering_subset(space) == chosen                     # deterministic


def test_covering_subset_of_nothing_and_of_one():
    assert covering_subset([]) == []
    v = MMA.default(LinearProblem("nvfp4", "none", 1, 256, 1024), "sm_90a")
    assert covering_subset([v]) == [v]
