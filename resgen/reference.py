"""Reference operators: the oracle every resgen kernel is checked against.

All of them run on CPU or CUDA tensors with plain torch. Products of FP4 values are formed
exactly (E2M1 x E4M3 fits FP32, and the reductions run in float64), global scales are applied
once, and results are returned in float32.
"""

from __future__ import annotations

from typing import Literal, Union

import torch

from . import formats
from .calibrate import QLinearWeight
from .formats import QuantizedTensor
from .kvcache import PagedKVCache

__all__ = ["Compensation", "Fold", "FOLDS", "linear", "linear_w4a16", "linear_w4a8",
           "decode_attention",
           "nmse", "attention_fp32", "quantize_query", "query_fp16", "QUERY_MODES",
           "Q16_EXP_OFFSET", "check_compensation"]

Compensation = Union[Literal["none", "full"], float]
# How base and residue meet: "exact" (two products, or one over K + ext, each exact, summed in
# FP32: Blackwell's block-scaled numerics) or "presum" (X_hat + R_hat summed in FP32, rounded
# once to FP16 by resgen.formats.presum_fp16, ONE product with the exactly decoded weight: the
# Hopper-native form of issue 20 section 1; linear_sm90_mma's fold="presum" variants compute it
# for NVFP4 M-Ext).
Fold = Literal["exact", "presum"]
FOLDS: tuple[str, ...] = ("exact", "presum")


def nmse(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Pooled NMSE: total squared error / total squared reference (float64)."""
    out64, ref64 = out.double(), ref.double()
    den = float((ref64 * ref64).sum())
    if den == 0:
        raise ValueError("pooled NMSE is undefined for an all-zero reference")
    return float(((out64 - ref64) ** 2).sum()) / den


def check_compensation(compensation: Compensation, qweight: QLinearWeight) -> None:
    """Raise ValueError unless `compensation` can run on `qweight`."""
    if compensation in ("none", "full"):
        return
    if isinstance(compensation, str):
        raise ValueError(f"compensation must be 'none', 'full' or a ratio, got {compensation!r}")
    if qweight.selection is None:
        raise ValueError("a compensation ratio needs a weight prepared with a channel selection")
    if float(compensation) != qweight.selection.ratio:
        raise ValueError(f"the weight was prepared for ratio {qweight.selection.ratio}, "
                         f"not {compensation}")


def _unit(q: QuantizedTensor) -> torch.Tensor:
    return formats.dequantize(q, apply_global_scale=False).double()


def _global(q: QuantizedTensor) -> torch.Tensor:
    one = torch.ones((), dtype=torch.float32, device=q.device)
    return one if q.global_scale is None else q.global_scale.to(torch.float32)


def linear(x: torch.Tensor, qweight: QLinearWeight, compensation: Compensation = "none",
           *, weight_unit: torch.Tensor | None = None, fold: Fold = "exact") -> torch.Tensor:
    """Reference FP4 linear layer. x: [..., K] float -> float32 [..., N].

    compensation:
      "none"  plain W4A4:  Y = X_hat W_hat^T
      "full"  M-Ext:       Y = X_hat W_hat^T + R_hat W_hat^T, each product formed separately,
                           scaled, then added in FP32 (the fold)
      ratio   K-Ext:       Y = [X_hat | R_hat_S] [W_hat | W_hat_S]^T, one reduction over K + ext
    fold="presum" (issue 20 section 1): Y = fp16(X_hat + R_hat) W_hat^T, ONE product: the
      residue (M-Ext: every channel's; K-Ext: the selected channels', added onto their base
      channels, the extension weight W_hat_S unused) summed with the base in FP32 and rounded
      once (resgen.formats.presum_fp16; the weight exact in FP16: formats.presum_weight).
      "none" has no residue: presum is plain W4A4 (X_hat is exact in FP16).
    Activations are quantized with qweight.input_scale (static NVFP4 alpha) when set, else
    dynamically. Global scales alpha_x * alpha_w (FP32) are applied once per product.
    weight_unit: dequantize(qweight.q) without the global scale, [N, K (+ ext)] float (exact in
    FP32), when the caller keeps it across calls (resgen.ops.cpu.ReferenceLinear); computed
    here otherwise.
    """
    if fold not in FOLDS:
        raise ValueError(f"fold must be one of {FOLDS}, got {fold!r}")
    check_compensation(compensation, qweight)
    fmt = qweight.fmt
    k = qweight.in_features
    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        raise ValueError(f"x must be a tensor [..., K={k}], got "
                         f"{'a 0-dim tensor' if isinstance(x, torch.Tensor) else type(x).__name__}")
    if x.shape[-1] != k:
        raise ValueError(f"input has K={x.shape[-1]}, the weight expects K={k}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.shape[0] == 0:            # no rows: the empty result of the right shape
        return torch.zeros(*lead, qweight.out_features, dtype=torch.float32, device=x.device)
    channels = qweight.selection if compensation not in ("none", "full") else None
    base, res = formats.quantize_with_residue(x2, fmt, channels=channels,
                                              global_scale=qweight.input_scale)
    w = qweight.q.to(x.device)
    ab = _global(base) * _global(w)
    wu = _unit(w) if weight_unit is None else weight_unit.to(x.device).double()
    wb = wu[:, :k]
    if fold == "presum":
        s = _unit(base).float()
        if compensation == "full":
            s = s + _unit(res).float()
        elif compensation != "none":         # K-Ext: the residues back onto their channels
            s = s + formats.residue_on_channels(_unit(res).float(), channels.indices, k)
        s16 = formats.presum_fp16(s, fmt).double()
        w16 = formats.presum_weight(wb, fmt).double()
        y = (s16 @ w16.T).float() * ab
        return y.reshape(*lead, -1)
    if compensation == "none":
        y = (_unit(base) @ wb.T).float() * ab
    elif compensation == "full":
        y = (_unit(base) @ wb.T).float() * ab + (_unit(res) @ wb.T).float() * ab
    else:
        xe = torch.cat([_unit(base), _unit(res)], dim=-1)
        y = (xe @ wu.T).float() * ab
    return y.reshape(*lead, -1)


def linear_w4a16(x: torch.Tensor, qweight: QLinearWeight, *,
                 weight_unit: torch.Tensor | None = None) -> torch.Tensor:
    """Reference W4A16 linear layer (FP4 weights, BF16 activations). x: [..., K] float ->
    float32 [..., N].

        Y = bf16(X) W_hat^T

    The activations are rounded to BF16 (round to nearest even) and never quantized to FP4;
    the weight is the base FP4 weight (a K-Ext weight's extension is unused) with its global
    scale applied once; the product is exact (float64) and returned in FP32. This is the
    Hopper-native W4A16 mode (what Marlin computes) and the one definition of its numerics:
    the quality study's fake-quant path is checked against it. weight_unit: as for linear.
    """
    k = qweight.in_features
    if x.shape[-1] != k:
        raise ValueError(f"input has K={x.shape[-1]}, the weight expects K={k}")
    lead = x.shape[:-1]
    xb = x.reshape(-1, k).to(torch.bfloat16).double()
    w = qweight.q.to(x.device)
    wu = _unit(w) if weight_unit is None else weight_unit.to(x.device).double()
    y = (xb @ wu[:, :k].T).float() * _global(w)
    return y.reshape(*lead, -1)


def linear_w4a8(x: torch.Tensor, qweight: QLinearWeight, *,
                weight_unit: torch.Tensor | None = None) -> torch.Tensor:
    """Reference W4A8 linear layer (FP4 weights, FP8 E4M3 activations with one FP32 scale per
    token). x: [..., K] float -> float32 [..., N].

        Y = (E4M3(X / s) * s) W_hat^T,   s = max(amax(|row|) / 448, 1e-12) per token

    (resgen.formats.fp8_rowwise_quant), the base FP4 weight with its global scale, the product
    exact in float64. A numerics for Hopper's FP8 tensor cores (E2M1 codes are exact in E4M3),
    named for what it is: the activations are rounded to FP8, so it is neither W4A4's
    block-scaled numerics nor W4A16's. The quality study's W4A8 is checked against it."""
    k = qweight.in_features
    if x.shape[-1] != k:
        raise ValueError(f"input has K={x.shape[-1]}, the weight expects K={k}")
    lead = x.shape[:-1]
    x8, s = formats.fp8_rowwise_quant(x.reshape(-1, k))
    xq = x8.double() * s.double()
    w = qweight.q.to(x.device)
    wu = _unit(w) if weight_unit is None else weight_unit.to(x.device).double()
    y = (xq @ wu[:, :k].T).float() * _global(w)
    return y.reshape(*lead, -1)


# ----------------------------------------------------------------------------- attention


def quantize_query(q: torch.Tensor, *, scale: Literal["row", "tensor"] = "row"):
    """Split queries q: [B, Hq, D] into NVFP4 base and residue (16-element blocks along D).

    scale="row": one dynamic tensor scale per (batch, head) row, which is what the ResAttn
    kernels compute in-register; "tensor": one for the whole query tensor.
    Returns (base, res, alpha) with alpha: float32 [B, Hq, 1] (row) broadcastable.
    """
    if scale not in ("row", "tensor"):
        raise ValueError(f"query scale must be 'row' or 'tensor', got {scale!r}")
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise ValueError(f"queries must be [B, Hq, D], got "
                         f"{tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__}")
    b, h, d = q.shape
    if scale == "tensor":
        base, res = formats.quantize_with_residue(q, "nvfp4")
        return base, res, base.global_scale.expand(b, h, 1)
    qf = q.float()
    amax = qf.abs().amax(-1, keepdim=True)
    # IEEE division by a tensor on every device (as resgen.formats does): torch on CUDA divides
    # by a Python scalar as amax * RN(1 / 2688), one ulp off for some rows, and an alpha one ulp
    # off flips FP4 codes that sit on a rounding midpoint (the kernels divide with div.rn.f32).
    alpha = amax / torch.full_like(amax, formats.E2M1_MAX * formats.E4M3_MAX)
    tiny = torch.finfo(torch.float32).tiny
    alpha = torch.where(alpha == 0, torch.ones_like(alpha), alpha.clamp(min=tiny))
    (c, sc), (rc, rsc) = formats.residue_pair(qf, "nvfp4", alpha.unsqueeze(-1))

    def mk(codes, scales):
        return QuantizedTensor("nvfp4", formats.pack_fp4(codes), scales, None)

    return mk(c, sc), mk(rc, rsc), alpha


# How the decode query meets the NVFP4 K/V: "nvfp4" (split into FP4 base [+ residue]: plain /
# ResAttn, Blackwell's block-scaled numerics) or "q16" (rounded to FP16 once, no quantization:
# issue 20 section 2, the attention analogue of W4A16; on Hopper the MMA takes FP16 anyway).
QUERY_MODES: tuple[str, ...] = ("nvfp4", "q16")
# q16 row scale 2^(floor(log2 amax) - 14): the row's amax lands in [2^14, 2^15), far below
# FP16's 65504, so nothing overflows, and a BF16 element (8 significant bits) is exact in FP16
# down to 2^-17 after scaling, i.e. every element >= amax * 2^-31 converts exactly.
Q16_EXP_OFFSET = 14


def query_fp16(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The Q16 query: q: [..., D] float -> (q16 [..., D] float32 holding FP16 values, scale
    [..., 1] float32 power of two) with q ~= q16 * scale.

    scale = 2^max(floor(log2 amax) - 14, -126) per row (amax = max |q| of the row; an all-zero
    row gets 2^-126); q16 = fp16_rne(q / scale). For BF16 inputs the conversion is exact for
    every element >= amax * 2^-31 (smaller ones round to FP16 subnormals or zero, an absolute
    error <= amax * 2^-39); it never overflows. The kernels compute the same scale from the
    FP32 exponent bits of amax (resgen.kernels.attention_sm90_q16_device.query_stage_q16).
    """
    if not isinstance(q, torch.Tensor) or q.dim() < 1:
        raise ValueError("query_fp16 takes a tensor [..., D]")
    qf = q.float()
    if not bool(torch.isfinite(qf).all()):
        raise ValueError("queries contain NaN or Inf")
    amax = qf.abs().amax(-1, keepdim=True)
    bits = amax.view(torch.int32)
    expo = (bits >> 23) & 0xFF                       # biased FP32 exponent of amax
    sexp = torch.clamp(expo - Q16_EXP_OFFSET, min=1)   # biased exponent of the scale
    scale = (sexp << 23).view(torch.float32)
    inv = ((254 - sexp) << 23).view(torch.float32)   # 1 / scale, exact (a power of two)
    q16 = (qf * inv).to(torch.float16).float()
    return q16, scale


FP8_P_SCALE = 256.0     # P is scaled by 2^8 before E4M3 rounding in the FP8 PV path


def _round_e4m3(v: torch.Tensor) -> torch.Tensor:
    sign = torch.sign(v)
    return sign * formats.e4m3_round(v.abs()).float()


def decode_attention(q: torch.Tensor, cache: PagedKVCache, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, *, compensation: bool = True,
                     pv: Literal["fp32", "bf16", "f16", "fp8"] = "fp32",
                     query_scale: Literal["row", "tensor"] = "row",
                     sm_scale: float | None = None, fold: Fold = "exact",
                     query: str = "nvfp4") -> torch.Tensor:
    """Reference ResAttn decode attention over a paged NVFP4 KV cache.

    q: [B, Hq, D] float; block_tables: int [B, max_pages]; seq_lens: int [B].
    scores = (Q_hat K_hat^T + R_hat K_hat^T) * sm_scale, the two products added in FP32 before
    the softmax (compensation=False drops R_hat: the plain NVFP4-KV baseline);
    fold="presum": scores = fp16(Q_hat + R_hat) K_hat^T * sm_scale, one product (the query's
    base and residue summed in FP32 and rounded once, resgen.formats.presum_fp16; K_hat is
    exact in FP16).
    query="q16" (needs compensation=False): scores = q16 K_hat^T * scale_q * sm_scale with
    (q16, scale_q) = query_fp16(q), the query rounded once to FP16 and never quantized: more
    accurate than ResAttn and than fold="presum" (which rounds the already quantized
    Q_hat + R_hat to FP16), at plain NVFP4-KV cost (one product).
    pv: "fp32" exact P V_hat; "bf16" / "f16" P rounded to BF16 / FP16 (V_hat / alpha_v is
        exact in both); "fp8" P * 2^8 and V_hat / alpha_v rounded to E4M3 (the paper's FP8 PV;
        the 2^8 puts P in [0, 256] so probabilities down to 2^-14 stay E4M3 normals).
    A sequence of length 0 yields zeros. Returns float32 [B, Hq, D].
    """
    if pv not in ("fp32", "bf16", "f16", "fp8"):
        raise ValueError(f"pv must be 'fp32', 'bf16', 'f16' or 'fp8', got {pv!r}")
    if query_scale not in ("row", "tensor"):
        raise ValueError(f"query_scale must be 'row' or 'tensor', got {query_scale!r}")
    if fold not in FOLDS:
        raise ValueError(f"fold must be one of {FOLDS}, got {fold!r}")
    if query not in QUERY_MODES:
        raise ValueError(f"query must be one of {QUERY_MODES}, got {query!r}")
    if query == "q16" and (compensation or fold != "exact"):
        raise ValueError("query='q16' is not quantized, so it has no residue to compensate: "
                         "pass compensation=False (and fold='exact')")
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise ValueError("queries must be a tensor [B, Hq, D]")
    bsz, hq, d = q.shape
    hkv = cache.num_kv_heads
    if hq % hkv:
        raise ValueError(f"{hq} query heads are not a multiple of {hkv} KV heads")
    if d != cache.head_dim:
        raise ValueError(f"query head dim {d} != cache head dim {cache.head_dim}")
    if tuple(seq_lens.shape) != (bsz,) or block_tables.dim() != 2 or \
            block_tables.shape[0] != bsz:
        raise ValueError(f"{bsz} queries need seq_lens [{bsz}] and block_tables "
                         f"[{bsz}, max_pages], got {tuple(seq_lens.shape)} and "
                         f"{tuple(block_tables.shape)}")
    if bsz and int(seq_lens.max()) > block_tables.shape[1] * cache.page_size:
        raise ValueError(f"a sequence of {int(seq_lens.max())} tokens exceeds its block table "
                         f"({block_tables.shape[1]} pages of {cache.page_size})")
    if bsz and int(seq_lens.min()) < 0:
        raise ValueError("seq_lens must be non-negative")
    if not bool(torch.isfinite(q).all()):
        raise ValueError("queries contain NaN or Inf")
    scale = sm_scale if sm_scale is not None else d ** -0.5
    if query == "q16":
        q16, alpha_q = query_fp16(q)
        qu = q16.double()
        ru = torch.zeros_like(qu)
    else:
        base, res, alpha_q = quantize_query(q, scale=query_scale)
        qu = formats.dequantize(base, apply_global_scale=False).double()
        ru = formats.dequantize(res, apply_global_scale=False).double()
    if fold == "presum" and compensation:
        qu = formats.presum_fp16((qu.float() + ru.float()), "nvfp4").double()
        compensation = False                 # the residue is inside the one operand now
    out = torch.zeros(bsz, hq, d, dtype=torch.float32, device=q.device)
    group = hq // hkv
    for b in range(bsz):
        n = int(seq_lens[b])
        if n == 0:
            continue
        ku, vu = cache.gather_unit(block_tables[b], n)   # [Hkv, n, D] float64, no alpha
        for h in range(hkv):
            heads = slice(h * group, (h + 1) * group)
            s = qu[b, heads] @ ku[h].T
            if compensation:
                s = (s.float() + (ru[b, heads] @ ku[h].T).float()).double()
            s = s * alpha_q[b, heads].double() * float(cache.k_scale) * scale
            m = s.amax(-1, keepdim=True)
            p = torch.exp(s - m)
            l_sum = p.sum(-1, keepdim=True)
            v = vu[h]
            if pv == "bf16":
                p = p.to(torch.bfloat16).double()
            elif pv == "f16":
                p = p.to(torch.float16).double()
            elif pv == "fp8":
                p = _round_e4m3(p.float() * FP8_P_SCALE).double() / FP8_P_SCALE
                v = _round_e4m3(v.float()).double()
            out[b, heads] = ((p @ v) / l_sum * float(cache.v_scale)).float()
    return out


def attention_fp32(q: torch.Tensor, k: list[torch.Tensor], v: list[torch.Tensor],
                   sm_scale: float | None = None) -> torch.Tensor:
    """Exact GQA decode attention in float64 -> float32 on unquantized K/V.

    q: [B, Hq, D]; k[b], v[b]: [Hkv, n_b, D]. The reference for "total error" studies.
    """
    bsz, hq, d = q.shape
    scale = sm_scale if sm_scale is not None else d ** -0.5
    out = torch.zeros(bsz, hq, d, dtype=torch.float32, device=q.device)
    for b in range(bsz):
        kb, vb = k[b].double(), v[b].double()
        if kb.shape[1] == 0:
            continue
        group = hq // kb.shape[0]
        qb = q[b].double().reshape(kb.shape[0], group, d)
        p = torch.softmax(qb @ kb.transpose(1, 2) * scale, dim=-1)
        out[b] = (p @ vb).reshape(hq, d).float()
    return out
