"""Typed variant and problem representation shared by every kernel family.

A variant is a frozen, slotted dataclass whose fields are ints, bools, or enums (subclasses of
`Choice`). `key()` is canonical JSON (sorted keys, the family name included), `name()` a
human-readable label that is never parsed back. `from_dict()` is the ONLY way a variant is
rebuilt from untrusted data (a tuning database): every field must be present, of its declared
type, and within the declared range, or a ValueError is raised. No string from a database is
ever rendered into kernel source: templates only see the typed fields.

A problem (workload) is likewise a frozen dataclass with a canonical key.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import json
import typing
from dataclasses import dataclass
from typing import Any, ClassVar

__all__ = ["Choice", "VariantBase", "ProblemBase", "LinearProblem", "AttentionProblem",
           "canonical_json", "sha256_json", "IntRange"]


class Choice(str, enum.Enum):
    """Base for enum-valued variant axes; serialized by value."""

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class IntRange:
    """Allowed values of an int field: attach as field(metadata={"range": IntRange(...)})."""

    lo: int
    hi: int
    pow2: bool = False

    def check(self, name: str, v: int) -> None:
        if not (self.lo <= v <= self.hi) or (self.pow2 and v & (v - 1)):
            kind = "a power of two " if self.pow2 else ""
            raise ValueError(f"field {name}={v} must be {kind}in [{self.lo}, {self.hi}]")


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def sha256_json(obj: Any) -> str:
    return hashlib.sha256(canonical_json(obj).encode()).hexdigest()


def _to_jsonable(v: Any) -> Any:
    if isinstance(v, enum.Enum):
        return v.value
    if isinstance(v, tuple):
        return [_to_jsonable(x) for x in v]
    return v


@functools.lru_cache(maxsize=None)
def _type_hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _parse_field(cls, f: dataclasses.Field, raw: Any) -> Any:
    hints = _type_hints(cls)
    tp = hints[f.name]
    origin = typing.get_origin(tp)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(raw)
        except ValueError:
            raise ValueError(f"field {f.name}={raw!r} is not one of "
                             f"{[m.value for m in tp]}") from None
    if tp is bool:
        if not isinstance(raw, bool):
            raise ValueError(f"field {f.name} must be a bool, got {raw!r}")
        return raw
    if tp is int:
        if isinstance(raw, bool) or not isinstance(raw, int):
            raise ValueError(f"field {f.name} must be an int, got {raw!r}")
        rng = f.metadata.get("range")
        if rng is not None:
            rng.check(f.name, raw)
        return raw
    if tp is float:
        if isinstance(raw, bool) or not isinstance(raw, (int, float)):
            raise ValueError(f"field {f.name} must be a number, got {raw!r}")
        return float(raw)
    if tp is str:
        if not isinstance(raw, str):
            raise ValueError(f"field {f.name} must be a string, got {raw!r}")
        allowed = f.metadata.get("allowed")
        if allowed is not None and raw not in allowed:
            raise ValueError(f"field {f.name}={raw!r} is not one of {sorted(allowed)}")
        return raw
    if origin is tuple:
        (elt, _ellipsis) = typing.get_args(tp)
        if not isinstance(raw, list) or not all(isinstance(x, elt) and not isinstance(x, bool)
                                                for x in raw):
            raise ValueError(f"field {f.name} must be a list of {elt.__name__}")
        return tuple(raw)
    raise TypeError(f"unsupported variant field type {tp!r} for {cls.__name__}.{f.name}")


# Field metadata: a field added after keys were stored is left out of the key (and of a
# variant's name) while at its default, and a dict without it parses as the default, so every
# key written before the field existed parses, and means, what it did.
UNKEYED_DEFAULT = "unkeyed_default"


def _unkeyed_at_default(f: dataclasses.Field, jsonable: Any) -> bool:
    return bool(f.metadata.get(UNKEYED_DEFAULT)) and jsonable == _to_jsonable(f.default)


class _Keyed:
    __slots__ = ()

    """key()/from_dict() for frozen dataclasses with a `family` or `op` class tag."""

    TAG: ClassVar[str] = "family"

    def as_dict(self) -> dict[str, Any]:
        d = {}
        for f in dataclasses.fields(self):
            v = _to_jsonable(getattr(self, f.name))
            if not _unkeyed_at_default(f, v):
                d[f.name] = v
        d[self.TAG] = getattr(type(self), self.TAG.upper())
        return d

    def key(self) -> str:
        """Canonical JSON of every field plus the family/op tag."""
        return canonical_json(self.as_dict())

    def digest(self) -> str:
        return sha256_json(self.as_dict())

    @classmethod
    def from_dict(cls, d: Any):
        """Validated parse of untrusted data; raises ValueError on anything unexpected."""
        if not isinstance(d, dict):
            raise ValueError(f"{cls.__name__}: expected an object, got {type(d).__name__}")
        tag = getattr(cls, cls.TAG.upper())
        if d.get(cls.TAG) != tag:
            raise ValueError(f"{cls.__name__}: {cls.TAG} must be {tag!r}, got {d.get(cls.TAG)!r}")
        d = {**{f.name: _to_jsonable(f.default) for f in dataclasses.fields(cls)
                if f.metadata.get(UNKEYED_DEFAULT)}, **d}
        names = {f.name for f in dataclasses.fields(cls)}
        extra = set(d) - names - {cls.TAG}
        missing = names - set(d)
        if extra or missing:
            raise ValueError(f"{cls.__name__}: unexpected fields {sorted(extra)}, "
                             f"missing {sorted(missing)}")
        kwargs = {f.name: _parse_field(cls, f, d[f.name]) for f in dataclasses.fields(cls)}
        return cls(**kwargs)

    @classmethod
    def from_key(cls, key: str):
        try:
            d = json.loads(key)
        except (TypeError, json.JSONDecodeError) as e:
            raise ValueError(f"{cls.__name__}: key is not JSON: {e}") from None
        return cls.from_dict(d)


class VariantBase(_Keyed):
    """Base of every kernel variant dataclass (declare FAMILY and `@dataclass(frozen=True,
    slots=True)` on the subclass)."""

    __slots__ = ()
    TAG: ClassVar[str] = "family"
    FAMILY: ClassVar[str] = ""

    def name(self) -> str:
        """Human-readable label; never parsed back."""
        parts = []
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if _unkeyed_at_default(f, _to_jsonable(v)):
                continue
            short = f.metadata.get("short", f.name)
            parts.append(f"{short}{_to_jsonable(v)}" if not isinstance(v, bool)
                         else (short if v else f"no{short}"))
        return f"{self.FAMILY}:" + "_".join(str(p) for p in parts)


class ProblemBase(_Keyed):
    """Base of every workload dataclass: validated at construction with the same field rules
    as `from_dict` (types, ranges, allowed values), so a bad format, compensation or bucket
    is refused where it is made, never planned or tuned."""

    __slots__ = ()
    TAG: ClassVar[str] = "op"
    OP: ClassVar[str] = ""

    def __post_init__(self) -> None:
        cls = type(self)
        for f in dataclasses.fields(self):
            try:
                _parse_field(cls, f, _to_jsonable(getattr(self, f.name)))
            except ValueError as e:
                raise ValueError(f"{cls.__name__}: {e}") from None


@dataclass(frozen=True, slots=True)
class LinearProblem(ProblemBase):
    """One FP4 linear layer call: Y[M, N] = X[M, K] W[N, K]^T with compensation.

    compensation: "none" | "full" | "0.125" | "0.25" | "0.5" | "1.0" (K-Ext ratios as strings so
    keys stay exact) | "w4a16" (FP4 weights, BF16 activations never quantized:
    resgen.reference.linear_w4a16) | "w4a8" (FP4 weights, FP8 E4M3 activations with one scale
    per token: resgen.reference.linear_w4a8; the FP8 tensor-core family only, experimental).
    m is the real token count; the database stores buckets
    (see runtime).
    static_scale: NVFP4 activation tensor scale given (calibrated) rather than computed (W4A16
    has no activation scale: its workloads are keyed static, like MXFP4's).
    fold: how a K-Ext layer's selected residues meet the weight: "exact" (the residue
    channels as extension columns against the extension weight W_S: Blackwell's numerics) or
    "presum" (each selected channel's residue added onto its base channel, the sum rounded
    once to FP16, ONE product with the base weight over K: resgen.reference.linear(ratio,
    fold="presum"); K-Ext at plain cost on Hopper, NVFP4 only). A workload value, not a
    variant axis: K-Ext presum moves the output by 3-6e-3 against the exact fold
    (docs/hopper_native.md), so a tuner must never pick it behind the user's back. (M-Ext's
    presum stays within the exact fold's check and is a variant axis of the Hopper families.)
    Omitted from the key while "exact", so every key written before the field existed parses,
    and means, what it did.
    """

    OP: ClassVar[str] = "linear"
    fmt: str = dataclasses.field(default="nvfp4", metadata={"allowed": ("nvfp4", "mxfp4")})
    compensation: str = dataclasses.field(
        default="none", metadata={"allowed": ("none", "full", "0.125", "0.25", "0.5", "1.0",
                                              "w4a16", "w4a8")})
    m: int = dataclasses.field(default=1, metadata={"range": IntRange(1, 1 << 20)})
    n: int = dataclasses.field(default=4096, metadata={"range": IntRange(16, 1 << 20)})
    k: int = dataclasses.field(default=4096, metadata={"range": IntRange(16, 1 << 20)})
    static_scale: bool = True
    fold: str = dataclasses.field(default="exact", metadata={"allowed": ("exact", "presum"),
                                                             UNKEYED_DEFAULT: True})

    def __post_init__(self) -> None:
        ProblemBase.__post_init__(self)
        if self.fold == "presum":
            if self.ratio is None:
                raise ValueError(f"LinearProblem: fold='presum' is a K-Ext fold (a ratio "
                                 f"compensation), got compensation {self.compensation!r} "
                                 "(M-Ext presum is a variant choice of the 'full' workload)")
            if self.fmt != "nvfp4":
                raise ValueError("LinearProblem: fold='presum' is NVFP4 only (MXFP4 presum "
                                 "needs a per-row shift from max |X_hat + R_hat| over all of "
                                 "K, which the layer quantizer's warp tiles do not see)")

    @property
    def ratio(self) -> float | None:
        return (None if self.compensation in ("none", "full", "w4a16", "w4a8")
                else float(self.compensation))

    @property
    def kext_presum(self) -> bool:
        """A K-Ext layer with the presum fold: the GEMM is the plain one over K in FP16."""
        return self.fold == "presum"

    def plain_twin(self) -> "LinearProblem":
        """The plain W4A4 workload of the same format, M, N, K and scale (compensation "none",
        the exact fold): the GEMM a presum variant runs, and W4A16's operand-free twin."""
        return dataclasses.replace(self, compensation="none", fold="exact")

    @property
    def w4a16(self) -> bool:
        """BF16 activations read as they are (no activation quantizer, no residue)."""
        return self.compensation == "w4a16"

    @property
    def rows(self) -> int:
        """Activation rows the GEMM sees: 2M for M-Ext, else M."""
        return 2 * self.m if self.compensation == "full" else self.m

    def k_ext(self, block: int) -> int:
        """Reduction length including the K-Ext extension (padded to the block); K for the
        presum fold (its residues ride on their base channels: no extension)."""
        r = self.ratio
        if r is None or self.kext_presum:
            return self.k
        sel = int(self.k * r)
        return self.k + -(-sel // block) * block


@dataclass(frozen=True, slots=True)
class AttentionProblem(ProblemBase):
    """One ResAttn decode call over a paged NVFP4 KV cache."""

    OP: ClassVar[str] = "decode_attention"
    batch: int = dataclasses.field(default=1, metadata={"range": IntRange(1, 4096)})
    q_heads: int = dataclasses.field(default=32, metadata={"range": IntRange(1, 1024)})
    kv_heads: int = dataclasses.field(default=8, metadata={"range": IntRange(1, 1024)})
    head_dim: int = dataclasses.field(default=128, metadata={"range": IntRange(16, 1024)})
    kv_len: int = dataclasses.field(default=8192, metadata={"range": IntRange(0, 1 << 24)})
    page_size: int = dataclasses.field(default=32, metadata={"range": IntRange(1, 4096)})
    compensation: bool = True
    # PV numerics: "f16" (V decoded exactly, P rounded to FP16) or "fp8" (V and P rounded to
    # E4M3, the paper's FP8 PV). A workload field, not a variant axis: a tuner must never
    # trade accuracy for speed behind the user's back.
    pv: str = dataclasses.field(default="f16", metadata={"allowed": ("f16", "fp8")})
    # How the query meets the cache: "nvfp4" (split into FP4 base [+ residue]: plain or
    # ResAttn by `compensation`) or "q16" (FP16 query, never quantized; compensation must be
    # False: there is no residue). Omitted from the key while "nvfp4", so every key written
    # before the field existed (the shipped table's) parses, and means, what it did.
    query: str = dataclasses.field(default="nvfp4", metadata={"allowed": ("nvfp4", "q16"),
                                                              UNKEYED_DEFAULT: True})

    def __post_init__(self) -> None:
        ProblemBase.__post_init__(self)
        if self.query == "q16" and self.compensation:
            raise ValueError("AttentionProblem: query='q16' has no query residue: "
                             "compensation must be False")

