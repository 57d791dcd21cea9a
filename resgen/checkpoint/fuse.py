"""Fusing linear layers that read the same input: q/k/v -> qkv, gate/up -> gate_up.

The tuned table holds the fused shapes (resgen.models: qkv N = q + 2 kv, gate_up N = 2 x
intermediate); a model patched module by module misses it for 4 of Qwen3-8B's 7 projections.
Fusing concatenates the parts along N (output rows): codes [N_i, K/2] and block scales
[N_i, K/bs] row blocks stacked, so every output row keeps its own blocks.

Exactness and cost:
- MXFP4, or NVFP4 parts that share one tensor scale (weight_scale_2; ModelOpt's export
  unifies it over q/k/v and gate/up, preprocess_linear_fusion, and so does resgen's): the fused
  weight is bit for bit the parts' bytes, stacked. Cost: one copy of the weights (N x K / 2
  bytes), once, at load.
- NVFP4 parts with different tensor scales need one alpha: on_mismatch="requantize" takes
  alpha = max(alpha_i) (the scale a joint quantization of the concatenated weight would have,
  since alpha = amax / 2688 is monotone in amax). The parts whose alpha equals it keep their
  bytes. Every other part is requantized from its exact dequantized values: each block's
  effective scale d = alpha_i * sf_i becomes alpha * sf' with sf' = E4M3_rne(d / alpha) and the
  codes are re-rounded to E2M1 under it (resgen.weights.quantize_with_scales). That is NOT
  exact: each value moves by at most one FP4 step of its block. Measured on Gaussian weights
  (tests/test_checkpoint_fuse.py prints it): 2.0-2.9% relative change of the requantized part
  for alpha_i / alpha in 0.37-0.8, on top of FP4's own 9.5% (so its total weight error grows
  by about 3.5%); a per-block scale search (resgen.weights.search_scales) gains nothing here.
  When alpha / alpha_i is a power of two the values are unchanged. Cost: one dequantize +
  quantize of the requantized parts, O(N K), once at load. vLLM instead takes max(weight_scale_2) WITHOUT requantizing, which is exact only
  when the scales are equal. on_mismatch="error" refuses, so the caller serves the parts unfused
  (each with its own tuned entry, or the family default).
- Static input scales (input_scale): the parts read one tensor, so a consistent checkpoint has
  one value; if they differ, "requantize" takes the largest (as vLLM does: every part's
  calibrated range still fits) and "error" refuses.
- K-Ext weights fuse when all parts carry the same channel selection (a selection belongs to
  the shared input); the extension columns are stacked with the base ones.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .. import formats
from ..calibrate import QLinearWeight
from .errors import CheckpointError

__all__ = ["fuse_linears"]


def fuse_linears(parts: Sequence[QLinearWeight], *,
                 on_mismatch: str = "requantize") -> QLinearWeight:
    """Concatenate linear weights along N -> one QLinearWeight [sum N_i, K(+ext)].

    parts: QLinearWeight of one format, one in_features K and one selection (or none).
    on_mismatch: "requantize" | "error": what to do when NVFP4 tensor scales (or static input
        scales) differ (see the module docstring for what requantizing changes).
    The result's meta records "fused_parts" and, when it happened, "requantized" (the indices
    of the parts whose codes were requantized).
    """
    if on_mismatch not in ("requantize", "error"):
        raise ValueError(f"on_mismatch must be 'requantize' or 'error', got {on_mismatch!r}")
    parts = list(parts)
    if not parts:
        raise ValueError("fuse_linears needs at least one part")
    if not all(isinstance(p, QLinearWeight) for p in parts):
        raise TypeError("fuse_linears takes QLinearWeight parts")
    p0 = parts[0]
    for i, p in enumerate(parts[1:], 1):
        if p.fmt != p0.fmt:
            raise ValueError(f"part {i} is {p.fmt}, part 0 {p0.fmt}: one format per fused layer")
        if p.in_features != p0.in_features:
            raise ValueError(f"part {i} has K={p.in_features}, part 0 K={p0.in_features}: fused "
                             "parts read one input")
        if (p.selection is None) != (p0.selection is None) or (
                p.selection is not None and (p.selection.ratio != p0.selection.ratio or
                                             not torch.equal(p.selection.masks,
                                                             p0.selection.masks))):
            raise ValueError(f"part {i}'s K-Ext channel selection differs from part 0's: "
                             "fused parts must select the same input channels")
    requant: list[int] = []
    gs = p0.q.global_scale
    qs = [p.q for p in parts]
    if p0.fmt == "nvfp4":
        alphas = [p.q.global_scale.reshape(()).float() for p in parts]
        if any(not torch.equal(a, alphas[0]) for a in alphas):
            if on_mismatch == "error":
                raise CheckpointError(
                    "NVFP4 parts have different tensor scales (weight_scale_2 "
                    f"{[float(a) for a in alphas]}): serve them unfused, or fuse with "
                    "on_mismatch='requantize' (changes the values of the parts with the smaller "
                    "scales by up to one FP4 rounding step)")
            gs = torch.stack(alphas).max().reshape(())
            qs = []
            for i, (p, a) in enumerate(zip(parts, alphas)):
                if torch.equal(a, gs):
                    qs.append(p.q)
                else:
                    qs.append(_requantize(p.q, gs))
                    requant.append(i)
    isc = [p.input_scale for p in parts]
    input_scale = None
    if any(s is not None for s in isc):
        if any(s is None for s in isc):
            raise ValueError("some parts have a static input_scale and others none")
        vals = [s.reshape(()).float() for s in isc]
        if any(not torch.equal(v, vals[0]) for v in vals):
            if on_mismatch == "error":
                raise CheckpointError(f"parts have different static input scales "
                                      f"{[float(v) for v in vals]} for one input")
        input_scale = torch.stack(vals).max().reshape(())
    q = formats.QuantizedTensor(p0.fmt, torch.cat([x.codes for x in qs], 0),
                                torch.cat([x.scales for x in qs], 0), gs)
    meta = dict(p0.meta)
    meta["fused_parts"] = str(len(parts))
    if requant:
        meta["requantized"] = ",".join(map(str, requant))
    return QLinearWeight(q, p0.in_features, p0.selection, input_scale, meta)


def _requantize(q: formats.QuantizedTensor, alpha: torch.Tensor) -> formats.QuantizedTensor:
    """NVFP4 [N, K] re-expressed under tensor scale alpha (>= its own): block scales
    sf' = E4M3(alpha_i * sf / alpha), codes re-rounded from the exact dequantized values."""
    from ..weights import quantize_with_scales

    x = formats.dequantize(q)
    d = q.global_scale.reshape(()).float() * q.scales.float()
    sf = formats.e4m3_round(d / alpha)
    return quantize_with_scales(x, "nvfp4", sf, alpha)
