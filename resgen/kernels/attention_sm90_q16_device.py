"""Device helper of the sm_90a Q16 decode-attention kernel (CuTe DSL, trace time): the query
stage that replaces the ResAttn query split (issue 20 section 2).

Only Q16 renders of resgen/templates/attention_sm90.py.j2 import this module, so the
helpers (and hence the fingerprints) of every plain / ResAttn kernel stay what they were.

Q16 feeds the BF16 query to the QK mma.sync as FP16 values, never quantized. The FP16 operand
columns go through the same shared-memory tile as the quantized query (one column per head,
"dense" packing), so the B-fragment loads, the QK MMAs, the softmax and the PV path are the
family's unchanged helpers (resgen.kernels.attention_sm90_device).

BF16 -> FP16 (hardware facts this relies on): BF16 has FP32's exponent range and 8 significant
bits, FP16 11 bits and a maximum of 65504, so a plain conversion could overflow (|q| >= 65520)
or lose bits in FP16's subnormal range. Each head row is therefore scaled by the power of two
2^-e, e = max(floor(log2 amax) - 14, -126) (from amax's FP32 exponent bits; exact), so the
row's amax lands in [2^14, 2^15): nothing overflows, and every element >= amax * 2^-31 (scaled
>= 2^-17) converts exactly (cvt.rn.f16x2.f32 keeps FP16 subnormals). The scale goes where the
ResAttn alpha goes (shared memory, one FP32 per head; score_scales multiplies it in), so the
kernel computes resgen.reference.query_fp16 exactly.
"""

from __future__ import annotations

from cutlass import Float32, Int32, Int64, Uint32

from . import attention_sm90_device as D
from . import attention_sm90_maps as M
from . import fp4_device as F4
from . import sm90_ptx as P

__all__ = ["Q16_EXP_OFFSET", "q16_row_scale", "query_stage_q16"]

Q16_EXP_OFFSET = 14           # resgen.reference.Q16_EXP_OFFSET (a CPU test checks they agree)


def q16_row_scale(amax) -> tuple[Float32, Float32]:
    """(scale, 1 / scale) of a row from its amax (FP32 >= 0): 2^(E - 14 - 127) with E the
    biased exponent of amax, at least 2^-126 (zero or tiny rows); both exact powers of two."""
    expo = (F4.f32_bits(amax) >> 23) & Uint32(0xFF)
    # max(E, 15) - 14 = max(E - 14, 1): the scale's biased exponent, never 0 (no subnormal)
    sexp = P.max_u32_imm(expo, Q16_EXP_OFFSET + 1) - Uint32(Q16_EXP_OFFSET)
    return F4.bits_f32(sexp << 23), F4.bits_f32((Uint32(254) - sexp) << 23)


def query_stage_q16(cfg: D.AttnCfg, q_group_addr, warp, lane, qs, alpha_s) -> None:
    """The GQA group's BF16 query rows -> FP16 operand columns (dense packing).

    q_group_addr: Int64 address of the group's first bf16 row [G, D]; qs: shared [ncol, D] f16
    (row j of head j = q_j * 2^-e_j rounded to FP16), alpha_s: shared f32 per head (2^e_j).
    Each warp takes rows warp, warp + W, ...; lane holds D/32 consecutive dims. Shared memory
    must be zero-filled first (the columns of absent heads stay zero). cfg: compensation False,
    packing "dense" (resgen.kernels.attention_sm90.AttnShape refuses anything else).
    """
    d = cfg.head_dim
    per = d // 32
    for i in range((cfg.group + cfg.num_warps - 1) // cfg.num_warps):
        j = warp + cfg.num_warps * i
        valid = j < cfg.group
        jj = D.imin(j, cfg.group - 1) if cfg.group > 1 else Int32(0)
        words = P.ld_nc_bytes(q_group_addr + Int64(jj) * (2 * d) + Int64(lane) * (2 * per),
                              2 * per)
        xs = []
        for w in words:
            lo, hi = F4.bf16x2_to_f32(w)
            xs += [lo, hi]
        amax = F4.group_max(F4.abs_max(xs), 32)       # the whole row (every lane executes)
        scale, inv = q16_row_scale(amax)
        row = qs + (M.qk_col(jj, 0, "dense") * d + lane * per) * 2
        for e in range(0, per, 2):
            P.sts_u32_if(valid, row + e * 2, P.pack_f16x2(F4.mul_rn(xs[e], inv),
                                                         F4.mul_rn(xs[e + 1], inv)))
        P.sts_f32_if(valid & (lane == 0), alpha_s + jj * 4, scale)
