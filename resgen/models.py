"""Model registry: a model's linear projection shapes and attention geometry per
tensor-parallel degree, for `resgen tune --model`.

Built in: Qwen3-4B, Qwen3-8B and Qwen3-32B, from their Hugging Face config.json files
(huggingface.co/Qwen/Qwen3-4B, /Qwen3-8B, /Qwen3-32B):
    model      hidden  intermediate  heads  kv heads  head_dim  layers
    Qwen3-4B    2560      9728         32      8        128       36
    Qwen3-8B    4096     12288         32      8        128       36
    Qwen3-32B   5120     25600         64      8        128       64
Any other decoder with a Llama/Qwen-style config works through `from_hf_config` (a dict, a
config.json path or a directory holding one).

Projection shapes (N output features x K input features, per rank, Megatron-style split):
qkv (column-parallel, fused), o (row-parallel), gate_up (column-parallel, fused), down
(row-parallel). KV heads are split across ranks when tp divides them and replicated (one per
rank) when tp is a multiple of them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from .search.variant import AttentionProblem, LinearProblem

__all__ = ["ModelSpec", "LinearShape", "AttentionGeometry", "MODELS", "get_model",
           "get_models", "linear_problems", "attention_problems", "tuning_workloads",
           "COMPENSATIONS", "KEXT_FOLDS", "LINEAR_MODES", "FORMATS", "ATTENTION_PV",
           "ATTENTION_MODES", "DEFAULT_ATTENTION_MODES"]

FORMATS: tuple[str, ...] = ("nvfp4", "mxfp4")
_MAX_FEATURES = 1 << 20          # LinearProblem's n and k range
_MAX_HEAD_DIM = 1024             # AttentionProblem's head_dim range
# The W4A4 compensation modes (Blackwell-parity numerics): `resgen tune`'s default and what the
# shipped table must cover (tests/test_tuned_table.py).
COMPENSATIONS: tuple[str, ...] = ("none", "full", "0.125", "0.25", "0.5", "1.0")
# Every linear mode a LinearProblem takes: the above, W4A16 (BF16 activations, the
# Hopper-native mode; tuned on request with --compensations w4a16; the shipped H200 table
# covers it at the decode and prefill buckets, tests/test_tuned_table.py) and W4A8 (FP8
# activations; only the experimental linear_sm90_fp8 family serves it, MXFP4, M >= 64).
LINEAR_MODES: tuple[str, ...] = COMPENSATIONS + ("w4a16", "w4a8")


@dataclass(frozen=True)
class LinearShape:
    name: str
    n: int          # output features per rank
    k: int          # input features per rank


@dataclass(frozen=True)
class AttentionGeometry:
    q_heads: int    # per rank
    kv_heads: int   # per rank
    head_dim: int


def _pos_int(cfg: Mapping[str, Any], key: str) -> int:
    v = cfg.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ValueError(f"config field {key!r} must be a positive int, got {v!r}")
    return v


@dataclass(frozen=True)
class ModelSpec:
    name: str
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int

    def __post_init__(self) -> None:
        for f in ("hidden", "intermediate", "heads", "kv_heads", "head_dim", "layers"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{self.name}: {f} must be a positive int, got {v!r}")
        if self.heads % self.kv_heads:
            raise ValueError(f"{self.name}: {self.heads} query heads are not a multiple of "
                             f"{self.kv_heads} KV heads")
        if self.head_dim % 16 or self.head_dim > _MAX_HEAD_DIM:
            raise ValueError(f"{self.name}: head_dim {self.head_dim} is not a multiple of 16 "
                             f"up to {_MAX_HEAD_DIM} (NVFP4 blocks of 16 along the head)")
        widest = max(self.hidden, 2 * self.intermediate,
                     (self.heads + 2 * self.kv_heads) * self.head_dim)
        if widest > _MAX_FEATURES:
            raise ValueError(f"{self.name}: a projection {widest} features wide exceeds the "
                             f"{_MAX_FEATURES} resgen's linear problems cover")

    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any], name: str | None = None) -> "ModelSpec":
        """From a Hugging Face config dict (hidden_size, intermediate_size,
        num_attention_heads, num_key_value_heads (default: heads), head_dim (default:
        hidden / heads), num_hidden_layers)."""
        if not isinstance(cfg, Mapping):
            raise TypeError(f"expected a config mapping, got {type(cfg).__name__}")
        hidden = _pos_int(cfg, "hidden_size")
        heads = _pos_int(cfg, "num_attention_heads")
        kv = cfg.get("num_key_value_heads", heads)
        if "head_dim" in cfg and cfg["head_dim"] is not None:
            head_dim = _pos_int(cfg, "head_dim")
        else:
            if hidden % heads:
                raise ValueError("hidden_size is not a multiple of num_attention_heads and "
                                 "the config has no head_dim")
            head_dim = hidden // heads
        label = name or str(cfg.get("_name_or_path") or cfg.get("model_type") or "custom")
        return cls(name=label, hidden=hidden, intermediate=_pos_int(cfg, "intermediate_size"),
                   heads=heads, kv_heads=kv, head_dim=head_dim,
                   layers=_pos_int(cfg, "num_hidden_layers"))

    def _kv_per_rank(self, tp: int) -> int:
        if self.kv_heads % tp == 0:
            return self.kv_heads // tp
        if tp % self.kv_heads == 0:
            return 1                      # replicated: each rank keeps one KV head
        raise ValueError(f"{self.name}: tp={tp} neither divides nor is a multiple of "
                         f"{self.kv_heads} KV heads")

    def _check_tp(self, tp: int) -> None:
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tp must be a positive int, got {tp!r}")
        if self.heads % tp or self.intermediate % tp:
            raise ValueError(f"{self.name}: tp={tp} does not divide {self.heads} heads and "
                             f"intermediate size {self.intermediate}")

    def linear_shapes(self, tp: int = 1) -> list[LinearShape]:
        """Per-rank projection shapes, in layer order: qkv, o, gate_up, down."""
        self._check_tp(tp)
        q = self.heads // tp * self.head_dim
        kv = self._kv_per_rank(tp) * self.head_dim
        inter = self.intermediate // tp
        return [LinearShape("qkv", q + 2 * kv, self.hidden),
                LinearShape("o", self.hidden, q),
                LinearShape("gate_up", 2 * inter, self.hidden),
                LinearShape("down", self.hidden, inter)]

    def linear_nk(self, tp: int = 1) -> dict[str, tuple[int, int]]:
        """{projection name: (N, K)} per rank, in layer order (linear_shapes as a mapping)."""
        return {s.name: (s.n, s.k) for s in self.linear_shapes(tp)}

    def attention(self, tp: int = 1) -> AttentionGeometry:
        self._check_tp(tp)
        return AttentionGeometry(self.heads // tp, self._kv_per_rank(tp), self.head_dim)


MODELS: dict[str, ModelSpec] = {
    "qwen3-4b": ModelSpec("qwen3-4b", hidden=2560, intermediate=9728, heads=32, kv_heads=8,
                          head_dim=128, layers=36),
    "qwen3-8b": ModelSpec("qwen3-8b", hidden=4096, intermediate=12288, heads=32, kv_heads=8,
                          head_dim=128, layers=36),
    "qwen3-32b": ModelSpec("qwen3-32b", hidden=5120, intermediate=25600, heads=64, kv_heads=8,
                           head_dim=128, layers=64),
}


def get_model(name: str | Mapping[str, Any] | Path) -> ModelSpec:
    """A registry name ("qwen3-8b", "Qwen/Qwen3-8B"), a config dict, a config.json path, or a
    model directory containing config.json."""
    if isinstance(name, Mapping):
        return ModelSpec.from_hf_config(name)
    key = str(name).strip().lower().split("/")[-1]
    if key in MODELS:
        return MODELS[key]
    p = Path(str(name))
    if p.is_dir():
        p = p / "config.json"
    if p.is_file():
        try:
            cfg = json.loads(p.read_bytes().decode("utf-8"))
        except OSError as e:
            raise ValueError(f"{p}: cannot read ({e.strerror or e})") from None
        except UnicodeDecodeError:
            raise ValueError(f"{p}: not a UTF-8 text file (a config.json is JSON)") from None
        except (json.JSONDecodeError, RecursionError) as e:
            raise ValueError(f"{p}: not JSON: {e}") from None
        if not isinstance(cfg, Mapping):
            raise ValueError(f"{p}: a config.json holds a JSON object, not a "
                             f"{type(cfg).__name__}")
        try:
            return ModelSpec.from_hf_config(cfg, name=p.parent.name or None)
        except ValueError as e:
            raise ValueError(f"{p}: {e}") from None
    raise ValueError(f"unknown model {name!r}: known {sorted(MODELS)}, or give a config.json "
                     f"or a model directory")


def get_models(names: Sequence[str]) -> list[ModelSpec]:
    """Models by name (get_model), "all" for every built-in one; each model once."""
    out: list[ModelSpec] = []
    for n in names:
        for spec in (MODELS.values() if str(n).strip().lower() == "all" else [get_model(n)]):
            if spec not in out:
                out.append(spec)
    return out


def _dedupe(items: Iterable[Any]) -> list[Any]:
    seen, out = set(), []
    for x in items:
        if x not in seen:
            seen.add(x)
            out.append(x)
    return out


KEXT_FOLDS: tuple[str, ...] = ("exact", "presum")


def _folds(fmt: str, compensation: str, kext_folds: Sequence[str]) -> list[str]:
    """The folds a (format, compensation) is planned with: kext_folds for K-Ext ratios
    (presum NVFP4 only: LinearProblem.fold), "exact" for every other mode."""
    bad = [f for f in kext_folds if f not in KEXT_FOLDS]
    if bad or not kext_folds:
        raise ValueError(f"K-Ext folds must be among {KEXT_FOLDS}, got {list(kext_folds)}")
    if compensation in ("none", "full", "w4a16", "w4a8"):
        return ["exact"]
    return [f for f in kext_folds if f == "exact" or fmt == "nvfp4"]


def linear_problems(models: Sequence[ModelSpec], tp: int = 1,
                    formats: Sequence[str] = FORMATS,
                    compensations: Sequence[str] = COMPENSATIONS,
                    m_buckets: Sequence[int] = (1,), static_scale: bool = True,
                    kext_folds: Sequence[str] = ("exact",)) -> list[LinearProblem]:
    """Every (shape, format, compensation, fold, M bucket) workload, duplicates removed,
    ordered by model, shape, format, compensation, fold, M. kext_folds: the K-Ext folds
    ("exact", "presum": LinearProblem.fold; presum for NVFP4 only, MXFP4 K-Ext keeps the
    exact fold)."""
    return _dedupe(LinearProblem(fmt=f, compensation=c, m=m, n=s.n, k=s.k,
                                 static_scale=static_scale, fold=fd)
                   for spec in models for s in spec.linear_shapes(tp) for f in formats
                   for c in compensations for fd in _folds(f, c, kext_folds)
                   for m in m_buckets)


ATTENTION_PV: tuple[str, ...] = ("f16", "fp8")
# Decode attention modes -> (compensation, query) of AttentionProblem. "q16" (the FP16 query,
# never quantized: issue 20 section 2) is not in the default list until the shipped table
# covers it (as compensation "w4a16" for the linear layers).
ATTENTION_MODES: dict[str, tuple[bool, str]] = {"resattn": (True, "nvfp4"),
                                                "plain": (False, "nvfp4"),
                                                "q16": (False, "q16")}
DEFAULT_ATTENTION_MODES: tuple[str, ...] = ("resattn", "plain")


def attention_problems(models: Sequence[ModelSpec], tp: int = 1,
                       batches: Sequence[int] = (1,), kv_lens: Sequence[int] = (8192,),
                       page_size: int = 32, compensation: Sequence[bool] = (True, False),
                       pv: Sequence[str] = ATTENTION_PV,
                       modes: Sequence[str] | None = None) -> list[AttentionProblem]:
    """Decode attention workloads per geometry: ResAttn and the plain NVFP4-KV form (or the
    given `modes`, names of ATTENTION_MODES, which then replace `compensation`), with the
    P.V product in FP16 (V decoded exactly) and in FP8 E4M3 (the paper's)."""
    if modes is None:
        forms = [(bool(c), "nvfp4") for c in compensation]
    else:
        bad = [m for m in modes if m not in ATTENTION_MODES]
        if bad:
            raise ValueError(f"attention modes {bad} not in {sorted(ATTENTION_MODES)}")
        forms = [ATTENTION_MODES[m] for m in modes]
    return _dedupe(AttentionProblem(batch=b, q_heads=g.q_heads, kv_heads=g.kv_heads,
                                    head_dim=g.head_dim, kv_len=L, page_size=page_size,
                                    compensation=c, pv=v, query=qm)
                   for spec in models for g in [spec.attention(tp)] for c, qm in forms
                   for v in pv for b in batches for L in kv_lens)


def tuning_workloads(family: Any, models: Sequence[ModelSpec], *, tp: int = 1,
                     formats: Sequence[str] = FORMATS,
                     compensations: Sequence[str] = COMPENSATIONS,
                     m_buckets: Sequence[int] = (1,), attn_batches: Sequence[int] = (1,),
                     kv_lens: Sequence[int] = (8192,), attn_pv: Sequence[str] = ATTENTION_PV,
                     attn_modes: Sequence[str] = DEFAULT_ATTENTION_MODES,
                     kext_folds: Sequence[str] = ("exact",)) -> list[Any]:
    """The workloads `resgen tune` gives a kernel family for the models, deduplicated: its
    own `model_problems` hook when it has one; the linear or attention workloads for those
    problem types; for another problem type (e.g. the quantizer's), its
    `for_linear(LinearProblem)` classmethod when it has one, else the linear workloads' fields
    of the same name. Raises ValueError for a bad format, compensation, bucket or tp."""
    import dataclasses

    own = family.model_problems(models, tp=tp, formats=formats, compensations=compensations,
                                m_buckets=m_buckets)
    if own is not None:        # the KernelFamilyBase default (None): derived below
        return list(own)
    lin = linear_problems(models, tp, formats, compensations, m_buckets,
                          kext_folds=kext_folds)
    if family.PROBLEM is LinearProblem:
        # only what the family serves (e.g. W4A8 only the FP8 tensor-core family)
        return [p for p in lin if family.problem_invalid(p) is None]
    if family.PROBLEM is AttentionProblem:
        # only the workloads the family serves at all (attention_sm100 refuses pv=fp8 and the
        # Q16 query as a whole: no tuning job, instead of a "no valid variant" error)
        return [p for p in attention_problems(models, tp, attn_batches, kv_lens, pv=attn_pv,
                                              modes=attn_modes)
                if family.problem_invalid(p) is None]
    names = {f.name for f in dataclasses.fields(family.PROBLEM)}
    for_linear = getattr(family.PROBLEM, "for_linear", None)
    out, seen = [], set()
    for lp in lin:
        try:
            p = for_linear(lp) if for_linear is not None else \
                family.PROBLEM(**{n: getattr(lp, n) for n in names if hasattr(lp, n)})
        except (TypeError, ValueError):
            continue
        if p not in seen:
            seen.add(p)
            out.append(p)
    return out
