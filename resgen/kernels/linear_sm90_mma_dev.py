"""Trace-time device helpers of the linear_sm90_mma kernels (CuTe DSL, straight-line code).

The kernel template (resgen/templates/linear_sm90_mma.py.j2) owns the control flow (loops over
K groups, split-K reduction, epilogue branches); these helpers emit the per-chunk data path.
Register arrays are Python lists of DSL scalars, indexed only at trace time.

Data path per 64-column chunk kq and m16 tile (layouts: resgen.kernels.sm90_fp4_layout; the
scale expansion and pair decode: resgen.kernels.sm90_fp4_decode):
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
from .sm90_fp4_decode import DECODERS

__all__ = ["chunk_mma", "x_values", "operand_words", "base_operand", "selected_residues"]

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
