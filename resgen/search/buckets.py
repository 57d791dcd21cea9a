"""Which problem fields are tuned at a few bucket values (M for linear layers; batch and KV
length for decode attention) rather than exactly.

A problem class may declare `BUCKET_FIELDS: ClassVar[tuple[str, ...]]`; otherwise the op's
entry below applies, else a field named "m", else nothing is bucketed. The tuner times at the
bucket values themselves; the runtime maps a real value to the tuned buckets (see
resgen.runtime) and re-checks validity against the real problem.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

from .variant import ProblemBase

__all__ = ["bucket_fields", "without_buckets", "bucket_rank", "DEFAULT_M_BUCKETS",
           "DEFAULT_ATTN_BATCHES", "DEFAULT_KV_LENS"]

_BY_OP = {"linear": ("m",), "decode_attention": ("batch", "kv_len")}

# Decode is M = 1..16 (one token per sequence); 32..128 covers M-Ext targets and small batches.
# A real M maps to the nearest bucket at or above it (M = 2..4 -> 4, 5..16 -> 16): the swapped
# decode kernels pad tokens to 8-column MMA tiles anyway, so M = 2 and 4 time alike. Six buckets
# keep `resgen tune --model qwen3-8b` inside its 10-minute budget on one H200.
DEFAULT_M_BUCKETS: tuple[int, ...] = (1, 4, 16, 32, 64, 128)
DEFAULT_ATTN_BATCHES: tuple[int, ...] = (1, 8, 32, 64)
DEFAULT_KV_LENS: tuple[int, ...] = (8192, 32768, 131072)


def bucket_fields(problem_cls: type[ProblemBase]) -> tuple[str, ...]:
    declared = getattr(problem_cls, "BUCKET_FIELDS", None)
    if declared is not None:
        return tuple(declared)
    names = {f.name for f in dataclasses.fields(problem_cls)}
    fields = _BY_OP.get(problem_cls.OP)
    if fields is not None and set(fields) <= names:
        return fields
    return ("m",) if "m" in names else ()


def without_buckets(problem: ProblemBase) -> dict[str, Any]:
    """The problem as a dict with its bucketed fields removed (what must match exactly)."""
    d = problem.as_dict()
    for f in bucket_fields(type(problem)):
        d.pop(f, None)
    return d


def bucket_rank(real: Sequence[int], bucket: Sequence[int]) -> tuple:
    """Preference of a tuned bucket for a real value, smaller first, field by field: buckets
    at or above the real value first (a kernel tuned for a slightly larger M still covers M
    with its tiles), nearest first on a log scale; then buckets below, nearest first."""
    key = []
    for r, b in zip(real, bucket):
        r, b = max(int(r), 1), max(int(b), 1)
        key.append((0 if b >= r else 1, abs(math.log2(b) - math.log2(r))))
    return tuple(key)
