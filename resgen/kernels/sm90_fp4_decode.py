"""The device side of the Hopper FP4 weight layout (resgen.kernels.sm90_fp4_layout): a lane's
scale word expanded to the bf16x2 block scales of its two rows, and a 32-bit word of codes
decoded to bf16x2 pairs for each packing (CuTe DSL, trace time; straight-line code). Shared by
both Hopper linear families: linear_sm90_mma's chunk MMA and linear_sm90_wgmma's A fragments.

    scale_pair(sw, i, fmt)   (S(r0), S(r1)) of chunk i: 2 x PRMT (b | b << 16), 2 x IMAD
    DECODERS[packing](w)     the 4 bf16x2 pairs (E2M1 x 2^-126) of a word ("nib", "split")
    byte_sel(b)              the PRMT selector [b, 0, b, 0] both expansions use
    SCALE_CONSTS[fmt]        (multiplier, bf16x2 offset) of the expansion
"""

from __future__ import annotations

from cutlass import Uint32

from . import sm90_ptx as P

__all__ = ["SCALE_CONSTS", "byte_sel", "scale_pair", "decode_nib", "decode_split", "DECODERS"]

# (multiplier applied to b | b << 16, bf16x2 offset): see sm90_fp4_layout.expand_scale_bits
SCALE_CONSTS = {"nvfp4": (16, 0x76807680), "mxfp4": (128, 0x3B803B80)}


def byte_sel(b: int) -> int:
    """PRMT selector producing bytes [a.b, 0, a.b, 0] (second operand is zero)."""
    return (4 << 12) | (b << 8) | (4 << 4) | b


def scale_pair(sw: Uint32, i: int, fmt: str) -> tuple[Uint32, Uint32]:
    """bf16x2 scales (row r0, row r1) of chunk i (0..3) of a group from the lane's scale word
    sw = word i // 2 of its 8-byte scale vector (byte 2 (i % 2) = r0, byte 2 (i % 2) + 1 = r1)."""
    mul, add = SCALE_CONSTS[fmt]
    zero = Uint32(0)
    b0 = 2 * (i % 2)
    x0 = P.prmt(sw, zero, byte_sel(b0))
    x1 = P.prmt(sw, zero, byte_sel(b0 + 1))
    return x0 * Uint32(mul) + Uint32(add), x1 * Uint32(mul) + Uint32(add)


def decode_nib(w: Uint32) -> list[Uint32]:
    """Packing "nib": the 4 bf16x2 pairs (E2M1 x 2^-126) of a word, a0a1, a2a3, a4a5, a6a7."""
    out = []
    for p in range(4):
        tp = w << Uint32(4 * p) if p else w
        out.append((tp & Uint32(0x80008000)) | ((tp & Uint32(0x70007000)) >> Uint32(6)))
    return out


def decode_split(w: Uint32) -> list[Uint32]:
    """Packing "split" (sign apart from magnitude): 7 LOP3/SHF + 4 IMAD.SHL per word."""
    mag, sgn = Uint32(0x01C001C0), Uint32(0x80008000)
    both = Uint32(0x81C081C0)
    return [w & both,
            (w << Uint32(3)) & both,
            ((w << Uint32(6)) & mag) | ((w << Uint32(1)) & sgn),
            ((w >> Uint32(3)) & mag) | ((w << Uint32(2)) & sgn)]


DECODERS = {"nib": decode_nib, "split": decode_split}
