"""Trace-time device helpers of the linear_sm90_mma kernels (CuTe DSL, straight-line code).

The kernel template (resgen/templates/linear_sm90_mma.py.j2) owns the control flow (loops over
K groups, split-K reduction, epilogue branches); these helpers emit the per-chunk data path.
Register arrays are Python lists of DSL scalars, indexed only at trace time.

Data path per 64-column chunk kq and m16 tile (layouts: resgen.kernels.sm90_fp4_layout):
    scale word  -> 2 x PRMT (b | b << 16) -> 2 x IMAD          = S(r0), S(r1) bf16x2
    4 words     -> pair decode (bit ops)  -> 16 x mul.rn.bf16x2 = A fragments of 4 k16 steps
    activation  -> two 16-byte loads per n8 tile                = B fragments of 4 k16 steps
    4 x (MT x NT) mma.sync.m16n8k16 into FP32 accumulators

Fused activation quantization (act = "fused"): one BS-element block of x per thread, quantized
with resgen.kernels.fp4_device (the bit-exact GPU twin of resgen.formats; no second copy of
the math here) into the exact-BF16 operand words the MMA B fragments read:
    base_operand(xs, ...)       base block (+ its residue block for M-Ext)
    selected_residues(xs, ...)  K-Ext: residues of one base block, compacted by the masks
    operand_words(block)        value x block scale, packed bf16x2 (exact)
"""

from __future__ import annotations

from typing import Sequence

from cutlass import Float32, Uint32

from . import fp4_device as fd
from . import sm90_ptx as P

__all__ = ["scale_pair", "decode_nib", "decode_split", "DECODERS", "chunk_mma", "SCALE_CONSTS",
           "x_values", "operand_words", "base_operand", "selected_residues"]

# (multiplier applied to b | b << 16, bf16x2 offset): see sm90_fp4_layout.expand_scale_bits
SCALE_CONSTS = {"nvfp4": (16, 0x76807680), "mxfp4": (128, 0x3B803B80)}


def _byte_sel(b: int) -> int:
    """PRMT selector producing bytes [a.b, 0, a.b, 0] (second operand is zero)."""
    return (4 << 12) | (b << 8) | (4 << 4) | b


def scale_pair(sw: Uint32, i: int, fmt: str) -> tuple[Uint32, Uint32]:
    """bf16x2 scales (row r0, row r1) of chunk i (0..3) of a group from the lane's scale word
    sw = word i // 2 of its 8-byte scale vector (byte 2 (i % 2) = r0, byte 2 (i % 2) + 1 = r1)."""
    mul, add = SCALE_CONSTS[fmt]
    zero = Uint32(0)
    b0 = 2 * (i % 2)
    x0 = P.prmt(sw, zero, _byte_sel(b0))
    x1 = P.prmt(sw, zero, _byte_sel(b0 + 1))
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


def chunk_mma(words: Sequence[Sequence[Uint32]], scales: Sequence[tuple[Uint32, Uint32]],
              xw: Sequence[Sequence[Uint32]], acc: list[list[list[Float32]]],
              packing: str) -> None:
    """One 64-column chunk: words[mt][j] (4 per m16 tile), scales[mt] = (S(r0), S(r1)),
    xw[nt] = the lane's 8 activation words of n8 tile nt; acc[mt][nt] = 4 FP32, updated."""
    decode = DECODERS[packing]
    for mt, wv in enumerate(words):
        s0, s1 = scales[mt]
        for j in range(4):
            r = decode(wv[j])
            a = (P.mul_bf16x2(r[0], s0), P.mul_bf16x2(r[1], s1),
                 P.mul_bf16x2(r[2], s0), P.mul_bf16x2(r[3], s1))
            for nt, x in enumerate(xw):
                acc[mt][nt] = list(P.mma_bf16_16816(a, (x[2 * j], x[2 * j + 1]), acc[mt][nt]))


# ----------------------------------------------------------------------------- fused quantizer


def x_values(words: Sequence[Uint32]) -> list[Float32]:
    """Packed bf16 pairs (element 0 low) -> exact Float32 values, in channel order."""
    xs = []
    for w in words:
        lo, hi = fd.bf16x2_to_f32(w)
        xs += [lo, hi]
    return xs


def operand_words(block: fd.Block) -> list[Uint32]:
    """The block's exact BF16 operand values (code value x block scale), packed in pairs."""
    v = fd.operand_values(block)
    return [fd.pack_bf16x2_exact(v[2 * i], v[2 * i + 1]) for i in range(len(v) // 2)]


def base_operand(xs: Sequence[Float32], fmt: str, alpha, mext: bool, store_base, store_res):
    """One block of x (len(xs) = the format's block, one thread): quantize it, hand the base
    operand words to store_base, then (M-Ext) quantize its residue and hand those words to
    store_res. The base words are stored before the residue is quantized so that they are
    not live across it (ptxas spilled them otherwise). alpha: the NVFP4 tensor scale
    (Float32) / None (MXFP4)."""
    blk = fd.quantize_block(list(xs), fmt, alpha, 1)
    store_base(operand_words(blk))
    if mext:
        rblk = fd.quantize_block(fd.residues(list(xs), blk), fmt, alpha, 1)
        store_res(operand_words(rblk))


def selected_residues(xs: Sequence[Float32], fmt: str, alpha, mask, ksel: int) -> list:
    """K-Ext: quantize one base block, take its residues and keep, per 8-channel group, the
    ksel channels whose bits are set in that group's mask byte (mask: Uint32 holding the
    block's len(xs) / 8 mask bytes, first group in the low byte), lowest channel first."""
    blk = fd.quantize_block(list(xs), fmt, alpha, 1)
    rs = fd.residues(list(xs), blk)
    out = []
    for g8 in range(len(xs) // 8):
        out += fd.select_by_mask(rs[8 * g8:8 * g8 + 8], (mask >> Uint32(8 * g8)) & Uint32(0xFF),
                                 ksel)
    return out
