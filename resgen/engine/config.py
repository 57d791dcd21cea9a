"""The decoder architectures the engine runs, read from a Hugging Face config.

Families (``model_type``):
    llama   RMSNorm, RoPE, GQA, SwiGLU; optional ``attention_bias`` (q/k/v/o biases)
    qwen2   as llama, with q/k/v biases (always, as Qwen2's modeling code has them)
    qwen3   as llama, with per-head RMSNorms of q and k (before RoPE); optional attention_bias
Tied embeddings (``tie_word_embeddings``) in all three. Anything the engine does not implement
(another activation, MLP biases, a sliding window in use, partial rotary dims, an unknown RoPE
type) is a ValueError naming the field, never a silently different model.

RoPE scaling: ``rope_scaling`` (config.json as checkpoints ship it) or ``rope_parameters``
(transformers >= 5): types "default", "linear", "llama3" and "yarn" (resgen.engine.rope);
"dynamic" (its frequencies change with the running length, which static CUDA graphs cannot
follow) and "longrope" are refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

__all__ = ["FAMILIES", "RopeConfig", "DecoderConfig"]

FAMILIES = ("llama", "qwen2", "qwen3")
ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def _int(cfg: Mapping[str, Any], key: str, default: Any = None) -> int:
    v = cfg.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ValueError(f"config field {key!r} must be a positive integer, got {v!r}")
    return v


def _float(v: Any, key: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v == v or v <= 0:
        raise ValueError(f"config field {key!r} must be a positive number, got {v!r}")
    return float(v)


@dataclass(frozen=True)
class RopeConfig:
    """RoPE of one model: base theta, scaling type and that type's parameters (as floats)."""

    theta: float
    type: str = "default"
    params: Mapping[str, float] = field(default_factory=dict)

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any]) -> "RopeConfig":
        params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        if params and all(isinstance(v, Mapping) for v in params.values()):
            raise ValueError("per-layer-type rope_parameters are not supported")
        theta = params.pop("rope_theta", None)
        if theta is None:
            theta = cfg.get("rope_theta", 10000.0)
        kind = params.pop("rope_type", None) or params.pop("type", None) or "default"
        params.pop("type", None)
        if kind not in ROPE_TYPES:
            raise ValueError(f"RoPE type {kind!r} is not supported (supported: {ROPE_TYPES}; "
                             "'dynamic' changes its frequencies with the running length, which "
                             "the engine's static CUDA graphs cannot follow)")
        prf = params.pop("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
        if prf not in (None, 1, 1.0):
            raise ValueError(f"partial_rotary_factor {prf} is not supported (only 1.0)")
        if kind in ("llama3", "yarn"):
            omax = cfg.get("original_max_position_embeddings")
            if omax is None:
                omax = params.get("original_max_position_embeddings",
                                  cfg.get("max_position_embeddings"))
            params["original_max_position_embeddings"] = omax
        need = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor",
                                                  "high_freq_factor",
                                                  "original_max_position_embeddings"),
                "yarn": ("original_max_position_embeddings",)}.get(kind, ())
        for key in need:
            if params.get(key) is None:
                raise ValueError(f"RoPE type {kind!r} needs rope parameter {key!r}")
        clean: dict[str, Any] = {}
        for key, v in params.items():
            if v is None:
                continue
            if isinstance(v, bool):
                clean[key] = v
            elif isinstance(v, (int, float)):
                clean[key] = float(v)
            else:
                raise ValueError(f"rope parameter {key!r} must be a number, got {v!r}")
        return cls(_float(theta, "rope_theta"), kind, clean)


@dataclass(frozen=True)
class DecoderConfig:
    """One decoder model's architecture (see the module docstring)."""

    family: str
    vocab_size: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    rms_eps: float
    rope: RopeConfig
    max_positions: int
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    tie_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = "model"

    @property
    def q_size(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """{fused projection: (N, K)}: the shapes the kernels see (q/k/v and gate/up fused)."""
        return {"qkv": (self.q_size + 2 * self.kv_size, self.hidden),
                "o": (self.hidden, self.q_size),
                "gate_up": (2 * self.intermediate, self.hidden),
                "down": (self.hidden, self.intermediate)}

    def params(self) -> int:
        """Weights of the decoder layers' projections (what the kernels stream per token)."""
        return self.layers * sum(n * k for n, k in self.linear_shapes().values())

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any], name: str | None = None) -> "DecoderConfig":
        """From a config.json dict (or transformers' config.to_dict())."""
        if not isinstance(cfg, Mapping):
            raise TypeError(f"expected a config mapping, got {type(cfg).__name__}")
        family = cfg.get("model_type")
        if family not in FAMILIES:
            raise ValueError(f"model_type {family!r} is not supported (supported: {FAMILIES})")
        act = cfg.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"hidden_act {act!r} is not supported (the engine runs SwiGLU)")
        if cfg.get("mlp_bias"):
            raise ValueError("mlp_bias is not supported")
        if cfg.get("use_sliding_window"):
            raise ValueError("use_sliding_window is set: sliding-window attention is not "
                             "supported")
        if cfg.get("pretraining_tp", 1) not in (1, None):
            raise ValueError("pretraining_tp > 1 is not supported")
        hidden = _int(cfg, "hidden_size")
        heads = _int(cfg, "num_attention_heads")
        kv = _int(cfg, "num_key_value_heads", heads)
        if heads % kv:
            raise ValueError(f"{heads} attention heads are not a multiple of {kv} KV heads")
        hd = cfg.get("head_dim")
        if hd is None:
            if hidden % heads:
                raise ValueError("hidden_size is not a multiple of num_attention_heads and the "
                                 "config has no head_dim")
            hd = hidden // heads
        head_dim = _int({"head_dim": hd}, "head_dim")
        eps = cfg.get("rms_norm_eps", 1e-6)
        attn_bias = bool(cfg.get("attention_bias", False))
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else
                                         ([] if eos is None else [eos])))
        bos = cfg.get("bos_token_id")
        return cls(
            family=family, vocab_size=_int(cfg, "vocab_size"), hidden=hidden,
            intermediate=_int(cfg, "intermediate_size"), layers=_int(cfg, "num_hidden_layers"),
            heads=heads, kv_heads=kv, head_dim=head_dim, rms_eps=_float(eps, "rms_norm_eps"),
            rope=RopeConfig.from_hf(cfg),
            max_positions=_int(cfg, "max_position_embeddings", 4096),
            qkv_bias=family == "qwen2" or attn_bias, o_bias=family != "qwen2" and attn_bias,
            qk_norm=family == "qwen3", tie_embeddings=bool(cfg.get("tie_word_embeddings",
                                                                     False)),
            bos_token_id=None if bos is None else int(bos), eos_token_ids=eos_ids,
            name=name or str(cfg.get("_name_or_path") or family))
