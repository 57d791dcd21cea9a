"""Rotary position embeddings: inverse frequencies per scaling type and the cos/sin tables.

The formulas are those of transformers' modeling_rope_utils (tests/test_engine_config.py
compares them value for value): "default", "linear" (inverse frequencies / factor), "llama3"
(Llama 3.1's smoothed per-band scaling) and "yarn" (interpolation / extrapolation ramp and the
attention factor applied to cos and sin). The tables are computed once in FP32 as transformers
computes them (position x inverse frequency, then cos / sin, times the attention factor), so a
decode step gathers its rows instead of recomputing them (cos and the rolled signed sin side by
side, rope_pairs: one gather); rotation is rotate-half (the Hugging Face layout of q / k
weights).
"""

from __future__ import annotations

import math

import torch

from .config import RopeConfig

__all__ = ["inv_freq", "rope_tables", "signed_sin", "rope_pairs", "apply_rope"]


def inv_freq(rope: RopeConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies float32 [head_dim / 2], attention factor) of a RoPE config."""
    base, p, dim = rope.theta, rope.params, head_dim
    exps = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim
    freq = 1.0 / (base ** exps)
    if rope.type == "default":
        return freq, 1.0
    if rope.type == "linear":
        return freq / p["factor"], 1.0
    if rope.type == "llama3":
        factor, lo, hi = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
        old = p["original_max_position_embeddings"]
        lo_wl, hi_wl = old / lo, old / hi
        wavelen = 2 * math.pi / freq
        scaled = torch.where(wavelen > lo_wl, freq / factor, freq)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < hi_wl) * ~(wavelen > lo_wl)
        return torch.where(medium, smoothed, scaled), 1.0
    if rope.type == "yarn":
        return _yarn(rope, dim)
    raise ValueError(f"RoPE type {rope.type!r} is not supported")


def _yarn(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    p, base = rope.params, rope.theta
    omax = p["original_max_position_embeddings"]
    factor = p.get("factor")
    if factor is None:
        raise ValueError("yarn RoPE needs a 'factor'")

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    att = p.get("attention_factor")
    if att is None:
        if p.get("mscale") and p.get("mscale_all_dim"):
            att = float(mscale(factor, p["mscale"]) / mscale(factor, p["mscale_all_dim"]))
        else:
            att = mscale(factor)
    fast, slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def corr_dim(rot: float) -> float:
        return (dim * math.log(omax / (rot * 2 * math.pi))) / (2 * math.log(base))

    lo, hi = corr_dim(fast), corr_dim(slow)
    if p.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    pos = base ** (torch.arange(0, dim, 2).to(torch.float) / dim)
    extra, inter = 1.0 / pos, 1.0 / (factor * pos)
    keep = 1 - ramp
    return inter * (1 - keep) + extra * keep, float(att)


def rope_tables(rope: RopeConfig, head_dim: int, max_positions: int,
                device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin): float32 [max_positions, head_dim] each (the frequencies twice, as
    transformers lays them out), attention factor applied."""
    f, att = inv_freq(rope, head_dim)
    pos = torch.arange(max_positions, dtype=torch.float32)
    ang = pos[:, None] * f[None, :]
    emb = torch.cat([ang, ang], dim=-1)
    return ((emb.cos() * att).to(device), (emb.sin() * att).to(device))


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """sin with its first half negated: rotate_half(x) * sin == roll(x, D / 2) * signed_sin
    element for element (IEEE negation is exact), one roll instead of a negation and a cat."""
    h = sin.shape[-1] // 2
    return torch.cat([-sin[..., :h], sin[..., h:]], dim=-1)


def rope_pairs(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """cos, sin [P, D] (rope_tables) -> [P, 2, D]: cos and roll(signed_sin(sin), D / 2), the
    table apply_rope reads (one gather per step for both; rolling the table instead of x
    makes both products of the rotation one broadcast multiply)."""
    s = signed_sin(sin)
    return torch.stack([cos, s.roll(s.shape[-1] // 2, dims=-1)], dim=1)


def apply_rope(x: torch.Tensor, cs: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; cs: [T, 2, D] rows of rope_pairs (the rows of x's positions, in x's
    dtype: the caller casts the table once, as transformers casts cos / sin to x's dtype) ->
    x rotated: x * cos + rotate_half(x) * sin, the products rounded separately and added (the
    order transformers uses, so FP32 results match it bit for bit).

    Eagerly in three launches instead of four (x * cos, roll, * sin, +): p = x * [cos, rs]
    (rs = roll(signed sin)) holds x * cos and x * rs; roll(x * rs) == roll(x) * signed sin, so
    each half of the result is one add of p's halves written in place (IEEE addition
    commutes exactly: the same values). Under torch.compile the plain formula (inductor
    fuses it into one kernel either way)."""
    c, rs = cs[:, None, 0, :], cs[:, None, 1, :]
    h = x.shape[-1] // 2
    if torch.compiler.is_compiling():
        return x * c + x.roll(h, dims=-1) * (rs.roll(h, dims=-1))
    p = x.unsqueeze(2) * cs.unsqueeze(1)                  # [T, H, 2, D]
    out = torch.empty_like(x)
    torch.add(p[..., 0, :h], p[..., 1, h:], out=out[..., :h])
    torch.add(p[..., 0, h:], p[..., 1, :h], out=out[..., h:])
    return out
