"""Warm start: the best variants an earlier table timed for a workload become the first
candidates of a new tuning run.

After a template change every stored result of that family is stale (its fingerprint no
longer matches), so the runtime and `resgen db merge --fresh-only` drop it, and a re-tune
would start from the prior again. The variants that won before are usually still good: a warm
start puts the best few of them (by their old median, same GPU name) ahead of the default, the
seeds and the prior's order, in the cover stage too. They are only an ordering hint: each is
compiled, checked and timed again under the current fingerprint like any other candidate.

The earlier table is untrusted input (users share them): a row is used only if its variant
key parses into the family's typed variant space and passes `why_invalid` for the problem. A
key that lacks fields added to the variant since (a new axis) takes those fields' defaults,
which by this project's convention reproduce the kernel as it was; a key with fields the
variant no longer has is skipped. Nothing read from the table is rendered or imported
unvalidated.

A W4A16 linear workload (compensation "w4a16") runs the plain kernels on the BF16 activations
(fused variants: the same tiles with a copy prologue), so where the table has no rows for it,
the rows of its plain W4A4 twin (same shape, M and format) are the hint: xop and fused variants
alike, each still checked by `why_invalid` for W4A16. Likewise an M-Ext workload ("full") of a
family with a fold axis: presum's GEMM is the plain GEMM (linear_sm90_wgmma: the same kernel in
FP16), so the plain twin's winners with fold "presum" are interleaved with the workload's own
rows (presum twin of plain's best first), each checked by `why_invalid` (NVFP4 only).

This layer does not open databases (resgen.db sits above it): the table's rows come from a
`reader(path, gpu_name) -> rows` the caller passes (resgen.db.warm_start_rows; the CLI sets
TuneConfig.warm_start_reader to it).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from .variant import ProblemBase, VariantBase

__all__ = ["WarmStart", "lenient_variant"]

log = logging.getLogger(__name__)


def lenient_variant(cls: type, key: str) -> VariantBase | None:
    """The variant of class `cls` a stored key describes, with fields missing from the key
    set to the class defaults (`cls()` must exist); None if the key names a field `cls` does
    not have, another family, or a value `cls.from_dict` rejects."""
    try:
        raw = json.loads(key)
        if not isinstance(raw, dict) or raw.get(cls.TAG) != cls.FAMILY:
            return None
        names = {f.name for f in dataclasses.fields(cls)}
        if set(raw) - names - {cls.TAG}:
            return None
        return cls.from_dict({**cls().as_dict(), **raw})
    except Exception:
        return None


class WarmStart:
    """The timed rows of an earlier table (any fingerprint), grouped per (family, workload)
    and sorted by median; read once, on first use."""

    def __init__(self, path: str | Path, gpu_name: str | None,
                 reader: Callable[[str, str | None], Sequence[Mapping[str, Any]]]):
        self.path = Path(path)
        self.gpu_name = gpu_name
        self.reader = reader
        self._rows: dict[tuple[str, str], list[tuple[float, str]]] | None = None

    def _load(self) -> dict[tuple[str, str], list[tuple[float, str]]]:
        if self._rows is None:
            by: dict[tuple[str, str], list[tuple[float, str]]] = defaultdict(list)
            try:
                rows = list(self.reader(str(self.path), self.gpu_name))
            except Exception as e:            # a missing / corrupt / foreign table: no hint
                log.warning("warm start: cannot read %s: %s", self.path, e)
                rows = []
            for r in rows:
                med = r.get("median_us")
                if isinstance(med, (int, float)) and not isinstance(med, bool) and \
                        0 < med < float("inf"):
                    by[(str(r["family"]), str(r["workload_digest"]))].append(
                        (float(med), str(r["variant_key"])))
            self._rows = {k: sorted(v) for k, v in by.items()}
        return self._rows

    def candidates(self, family: Any, problem: ProblemBase, arch: str, limit: int
                   ) -> list[VariantBase]:
        """Up to `limit` distinct variants of `family` this table timed fastest for
        `problem`, each parsed leniently and valid for the problem on `arch`."""
        out: list[VariantBase] = []
        seen: set[str] = set()
        rows = self._load()
        found = rows.get((family.NAME, problem.digest()), [])
        if not found and getattr(problem, "compensation", None) == "w4a16":
            twin = problem.plain_twin()  # type: ignore[attr-defined]
            found = rows.get((family.NAME, twin.digest()), [])
        keys: list[tuple[str, str | None]] = [(key, None) for _, key in found]
        if ((getattr(problem, "compensation", None) == "full"
                or getattr(problem, "kext_presum", False))
                and "fold" in {f.name for f in dataclasses.fields(family.VARIANT)}):
            # presum's GEMM is the plain one: the plain twin's winners with fold "presum"
            # interleaved with the workload's own (M-Ext: its exact-fold winners; a K-Ext
            # presum workload: its presum rows)
            twin = problem.plain_twin()  # type: ignore[attr-defined]
            plain = [(key, "presum") for _, key in rows.get((family.NAME, twin.digest()), [])]
            keys = [k for pair in zip(plain, keys) for k in pair] + \
                plain[len(keys):] + keys[len(plain):]
        for key, fold in keys:
            if len(out) >= limit:
                break
            v = lenient_variant(family.VARIANT, key)
            if v is not None and fold is not None:
                try:
                    v = dataclasses.replace(v, fold=type(v.fold)(fold))  # type: ignore[attr-defined,type-var]
                except Exception:
                    continue
            if v is None or v.key() in seen:
                continue
            try:
                if family.why_invalid(v, problem, arch) is not None:
                    continue
            except Exception:
                continue
            seen.add(v.key())
            out.append(v)
        return out
