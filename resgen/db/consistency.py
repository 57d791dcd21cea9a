"""Rank consistency of a merged dispatch table: `resgen db merge` refuses to join databases
that disagree about which variant wins a workload, unless told which rule settles it.

Every rank of a tensor-parallel group must dispatch the same variant for the same shape
(FlashInfer #3186: ranks that pick different kernels diverge and deadlock). The runtime reads
one table and its choice depends only on the rows in it (resgen.search.record.pick_winner);
what can make the table itself ambiguous is merging sources that measured the same variants
and rank them differently: which of their timings the table keeps then decides the winner.

The check, per workload and device (GPU name, arch): among the rows the runtime could serve
(timed, intact, parseable, valid, current fingerprint, the newest measurement policy present),
two sources conflict when the variants BOTH measured have different winners in each
(pick_winner, ties within the recorded noise band by the family's space order). Sources that
measured disjoint variants (the hosts of a distributed run, the shards of a static split) or
the same rows (a table copied into each shard) never conflict.

Rules (`resgen db merge --on-conflict`):
- refuse (default): nothing is written; the conflicts are listed;
- first: for a conflicting workload, only the first source (in command-line order; the
  destination's own rows count as first) that has rows for it contributes them;
- union: merge everything as `merge` always did (a workload, variant, fingerprint and
  environment measured by several sources keeps the first source's timing) and let the
  runtime's rule pick over what is kept (lowest median, ties by space order): timings of
  different machines or runs then compete.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

from ..search.record import Status, pick_winner, stored_timing

__all__ = ["Conflict", "RULES", "find_conflicts", "conflict_groups"]

RULES = ("refuse", "first", "union")

Group = tuple[str, str, str]        # (workload digest, GPU name, arch)


@dataclass(frozen=True)
class Conflict:
    """Two sources whose common variants have different winners for one workload."""

    workload_key: str
    workload_digest: str
    gpu_name: str
    arch: str
    first: tuple[str, str, float]    # (source, winning variant name, its median in us)
    second: tuple[str, str, float]
    common: int                      # variants both measured

    def text(self) -> str:
        (s1, v1, m1), (s2, v2, m2) = self.first, self.second
        return (f"{self.workload_key} on {self.gpu_name} ({self.arch}): {s1} picks {v1} "
                f"({m1:.2f} us), {s2} picks {v2} ({m2:.2f} us) among the {self.common} "
                "variants both measured")


def _timed(rows: Iterable[Mapping[str, Any]], accept: Callable[[Mapping[str, Any]], bool]
           ) -> dict[Group, list[dict[str, Any]]]:
    """The servable timed rows of one source, by group, as pick_winner input."""
    out: dict[Group, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        if r.get("status") != Status.OK or r.get("compile_only"):
            continue
        try:
            t = stored_timing(r)
            if not accept(r):
                continue
        except Exception:
            continue
        out[(str(r["workload_digest"]), str(r["gpu_name"]), str(r["arch"]))].append({
            "median_us": t.median_us, "space_index": t.space_index, "tie": t.tie_rel,
            "policy": t.policy, "variant": (str(r["family"]), str(r["variant_key"])),
            "name": str(r.get("variant_name") or r["variant_key"]),
            "family": str(r["family"]), "variant_key": str(r["variant_key"]),
            "workload_key": str(r.get("workload_key") or r["workload_digest"])})
    return out


def conflict_groups(sources: Sequence[tuple[str, Iterable[Mapping[str, Any]]]],
                    accept: Callable[[Mapping[str, Any]], bool] = lambda r: True
                    ) -> tuple[list[Conflict], dict[Group, int]]:
    """(conflicts, group -> index of the first source with servable rows for it) over
    `sources` ((label, rows of TuningDB.rows()) in priority order); see the module
    docstring. `accept` says which rows the runtime could serve."""
    per = [(label, _timed(rows, accept)) for label, rows in sources]
    groups = sorted({g for _, by in per for g in by})
    first: dict[Group, int] = {}
    out: list[Conflict] = []
    for g in groups:
        have = [(i, label, by[g]) for i, (label, by) in enumerate(per) if by.get(g)]
        first[g] = have[0][0]
        if len(have) < 2:
            continue
        newest = max(r["policy"] for _, _, rs in have for r in rs)
        have = [(i, label, [r for r in rs if r["policy"] == newest]) for i, label, rs in have]
        for (_, l1, r1), (_, l2, r2) in itertools.combinations(have, 2):
            common = {r["variant"] for r in r1} & {r["variant"] for r in r2}
            if not common:
                continue
            c1 = [r for r in r1 if r["variant"] in common]
            c2 = [r for r in r2 if r["variant"] in common]
            tie = min(r["tie"] for r in c1 + c2)
            w1, w2 = pick_winner(c1, tie), pick_winner(c2, tie)
            if w1 is not None and w2 is not None and w1["variant"] != w2["variant"]:
                out.append(Conflict(w1["workload_key"], g[0], g[1], g[2],
                                    (l1, w1["name"], w1["median_us"]),
                                    (l2, w2["name"], w2["median_us"]), len(common)))
                break
    return out, first


def find_conflicts(sources: Sequence[tuple[str, Iterable[Mapping[str, Any]]]],
                   accept: Callable[[Mapping[str, Any]], bool] = lambda r: True
                   ) -> list[Conflict]:
    """The conflicts of merging `sources` (see conflict_groups)."""
    return conflict_groups(sources, accept)[0]
