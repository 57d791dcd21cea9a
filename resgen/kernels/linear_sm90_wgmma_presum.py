"""The pre-summed ("presum") fold of linear_sm90_wgmma (issue 20 section 1): the FP16 A-fragment
decode its presum renders import, and the torch twin the CPU tests check it with.

M-Ext with the exact fold runs each token's base and residue as two B rows of the wgmma (xop
row pairs, bn / 2 tokens per CTA tile) and folds the two accumulator columns in the epilogue:
twice the MMAs. In this kernel the activations reach the wgmma as the TMA'd B operand straight
from shared memory, so they cannot be summed on the way in (as linear_sm90_mma's presum does
in its B-fragment loads); the layer quantizer writes the sum instead: quant_sm90's layout
"presum", one FP16 row per token, fp16(X_hat + R_hat) (resgen.formats.presum_fp16, NVFP4). The
GEMM is then the plain kernel (mext False: rows = tokens, no fold) with FP16 in place of BF16:
FP16 operand tile sB and TMA box, FP16 A registers, wgmma ... .f32.f16.f16, and the weight
decoded exactly in FP16 by `decode_chunk_f16`:

    4 words -> pair decode to E2M1 x 2^-14 (f16x2 bits, linear_sm90_mma_presum.F16_DECODERS)
    scale word -> S16 = s_w x 2^7 per row (linear_sm90_mma_presum.scale_pair_f16)
    16 x mul.rn.f16x2                               = E2M1 x s_w x 2^-7, exact in FP16

the same values as the BF16 decode (linear_sm90_wgmma_dev.decode_chunk), so the epilogue and
its factor alpha_x alpha_w 2^7 are the plain kernel's. Why these are exact: the
linear_sm90_mma_presum docstring (the weight's 6 significant bits, 2^-17 .. 21, inside FP16).
NVFP4 only: MXFP4's per-row shift needs max |X_hat + R_hat| over all of K before the row is
written (formats.presum_fp16), which the quantizer's warp tiles do not see.

Every presum render of resgen/templates/linear_sm90_wgmma.py.j2 imports this module; exact
renders do not (their text, imports and fingerprints are what they were before the axis).
"""

from __future__ import annotations

from typing import Any, Sequence

from cutlass import Uint32

from . import sm90_ptx as P
from .linear_sm90_mma_presum import F16_DECODERS, PRESUM_SCALE_CONSTS, scale_pair_f16

__all__ = ["decode_chunk_f16", "fragment_values_f16"]


def decode_chunk_f16(geom: Any, words: Sequence[Uint32], swords: Sequence[Uint32]
                     ) -> list[Uint32]:
    """linear_sm90_wgmma_dev.decode_chunk in FP16: the 16 A registers (f16x2) of the 4 k16 steps
    of one chunk, [4 j + r] = (a_{2r}, a_{2r+1}) of step j (same placement)."""
    decode = F16_DECODERS[geom.packing]
    out: list[Uint32] = []
    for j in range(4):
        wi, i = geom.scale_select(j)
        s0, s1 = scale_pair_f16(swords[wi], i, geom.fmt)
        r = decode(words[j], Uint32)
        out += [P.mul_f16x2(r[0], s0), P.mul_f16x2(r[1], s1),
                P.mul_f16x2(r[2], s0), P.mul_f16x2(r[3], s1)]
    return out


def fragment_values_f16(wt: Any) -> Any:
    """float32 [N/64, nk, 4 (q), 32 (lane), 4 (j), 8 (slot)]: the A register values
    decode_chunk_f16 computes, in torch with its bit operations (pair decode, the scale byte's
    integer multiply-add to FP16 bits, FP16 multiply): what the CPU tests compare with
    linear_sm90_wgmma_layout.fragment_values (the BF16 decode) value for value. NVFP4 only."""
    import torch

    from .linear_sm90_wgmma_layout import record_fields

    if wt.fmt not in PRESUM_SCALE_CONSTS:
        raise ValueError(f"presum decodes {sorted(PRESUM_SCALE_CONSTS)}, not {wt.fmt}")
    words, sc = record_fields(wt)                         # words: ..., j (4 words per lane)
    nb, nk = words.shape[0], words.shape[1]
    pairs = torch.stack(F16_DECODERS[wt.packing](words.to(torch.int64) & 0xFFFFFFFF),
                        dim=-1)                           # ..., j, p (4 f16x2 pairs)
    mul, add = PRESUM_SCALE_CONSTS[wt.fmt]
    s = sc.to(torch.int64).reshape(nb, nk, 4, 8, 4, 2)     # q, g, j, rr (scale bytes)
    s = s.unsqueeze(4).expand(nb, nk, 4, 8, 4, 4, 2).reshape(nb, nk, 4, 32, 4, 2)
    s16 = (s * mul + (add & 0xFFFF)) & 0xFFFF              # one half of b | b << 16 times mul

    def f16(bits: torch.Tensor) -> torch.Tensor:           # int64 FP16 bit patterns -> f32
        b = bits & 0xFFFF
        return torch.where(b >= 2 ** 15, b - 2 ** 16, b).to(torch.int16).view(
            torch.float16).float()

    vals = f16(torch.stack([pairs, pairs >> 16], dim=-1))  # ..., j, p, 2 (E2M1 x 2^-14)
    sv = f16(s16)                                          # ..., j, rr (S16 = s_w x 2^7)
    prod = vals * sv[..., [0, 1, 0, 1]].unsqueeze(-1)      # pairs 0, 2: row r0; 1, 3: r1
    if not bool(torch.equal(prod, prod.to(torch.float16).float())):
        raise AssertionError("a decoded weight x scale product is not exact in FP16")
    return prod.reshape(nb, nk, 4, 32, 4, 8)
