"""The pre-summed ("presum") fold of linear_sm90_mma: device helpers, geometry and their torch
twins (issue 20 section 1; numerics defined by resgen.formats.presum_fp16 / presum_weight and
resgen.reference.linear(..., fold="presum")).

M-Ext with the exact fold runs the residue rows R_hat as extra MMA rows (xop "row_pair": row
2j the base of token j, 2j + 1 its residue) and folds c0 + c1 in the epilogue: twice the BF16
MMAs. Presum reads quant_sm90's layout "presum" instead: one FP16 row per token,
fp16(X_hat + R_hat), the two unit values summed in FP32 and rounded ONCE by the quantizer
(what linear_sm90_wgmma's presum variants read). Its B fragments load like plain's (the same
bytes, FP16 words in place of BF16) and feed ONE FP16 mma.sync against the weight decoded
exactly in FP16; the accumulator columns are tokens, so the epilogue is the plain one (no fold).
(Until session 33 these variants read the row pair and summed it in the B load: slower than the
exact fold on the H200, docs/linear_sm90_mma.md.)

Every linear_sm90_mma render imports this module (the template substitutes only); its PRESUM
constant (template parameter fold) picks these functions at trace time.

Per 64-column chunk and n8 tile (lane g, t; token r = row0 + 8 nt + g):
    presum row r: two 16-byte loads                          = 8 f16x2 B words
Per chunk and m16 tile:
    scale word -> 2 x PRMT (b | b << 16) -> 2 x IMAD        = S16(r0), S16(r1) f16x2
    4 words -> pair decode to E2M1 x 2^-14 (f16x2 bits) -> 16 x mul.rn.f16x2
                                                            = E2M1 x s_w x 2^-7, exact in FP16
    4 x (MT x NT) mma.sync.m16n8k16.f32.f16.f16.f32

Why these are exact (NVFP4; the weight factor 2^-7 is the BF16 path's, so the epilogue factor
alpha_x alpha_w 2^7 is the same):
  - weight: E2M1 (2 significant bits) x E4M3 (4) has 6; the smallest nonzero value
    0.5 x 2^-9 x 2^-7 = 2^-17 is a multiple of FP16's subnormal step 2^-24, the largest
    6 x 448 x 2^-7 = 21 is far below 65504;
  - scale: byte b = ((E' + 9) << 3) | f for s_w = 2^E' (1 + f/8) (resgen.kernels.sm90_fp4_layout), and
    s_w x 2^7 in FP16 has exponent field E' + 22 and mantissa f << 7, i.e. the bits
    b * 128 + 0x3400 (at most 143 * 128 + 0x3400 = 0x7B80 < 0x7C00: never Inf);
  - activation: the quantizer's FP16 row is formats.presum_fp16 (NVFP4: fp16 RNE of the FP32
    sum of the unit values, no alpha, no scale factoring: t = 0), read as it is.
MXFP4 presum needs each token row's power-of-two shift t = floor(log2 max |X_hat + R_hat|) - 11
over ALL of K (formats.presum_fp16) before its first MMA; a CTA sees only its K range, so the
family refuses it (resgen.search.linear_sm90_mma), as it does fused presum (the fused prologue
writes the exact operand).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from cutlass import Uint32

from . import sm90_ptx as P
from .sm90_fp4_decode import byte_sel
from .linear_sm90_mma_geom import Geometry

__all__ = ["PRESUM_SCALE_CONSTS", "F16_MAG", "decode_nib_f16", "decode_split_f16",
           "F16_DECODERS", "PresumGeometry", "presum_geometry", "scale_pair_f16",
           "presum_b_words", "chunk_mma_f16"]

# (multiplier applied to b | b << 16, f16x2 offset): S16 = s_w x 2^7 (see the docstring)
PRESUM_SCALE_CONSTS = {"nvfp4": (128, 0x34003400)}

# the three magnitude bits (m, e0, e1) of an E2M1 code at FP16 bits 9..11 of each half: the
# code's exponent in the FP16 exponent's low bits, m the top mantissa bit, so the pair decodes
# to E2M1 x 2^-14 (e = 0: the FP16 subnormal m x 2^-15)
F16_MAG = 0x0E000E00
_SIGN = 0x80008000


def decode_nib_f16(w: Any, u: Callable[[int], Any] = int) -> list:
    """Packing "nib": the 4 f16x2 pairs (E2M1 x 2^-14) of a word, a0a1, a2a3, a4a5, a6a7
    (the nibble of slot s sits where resgen.kernels.sm90_fp4_layout puts it; magnitude bits 12..14
    of a half shifted to 9..11). w: a DSL Uint32 (u = Uint32) or a torch int64 tensor of
    non-negative 32-bit words (u = int); bits above 32 are masked off."""
    out = []
    for p in range(4):
        tp = w << u(4 * p) if p else w
        out.append((tp & u(_SIGN)) | ((tp & u(0x70007000)) >> u(3)))
    return out


def decode_split_f16(w: Any, u: Callable[[int], Any] = int) -> list:
    """Packing "split" (sign apart from magnitude; sm90_fp4_layout: |code| of pair p at bits 6, 3, 0, 9
    of each half, sign at 15, 12, 14, 13): each pair's magnitude moved to bits 9..11 and its
    sign to 15. Arguments as decode_nib_f16."""
    mag, sgn = u(F16_MAG), u(_SIGN)
    w3 = w << u(3)
    return [(w3 & mag) | (w & sgn),
            ((w << u(6)) & mag) | (w3 & sgn),
            ((w << u(9)) & mag) | ((w << u(1)) & sgn),
            (w & mag) | ((w << u(2)) & sgn)]


F16_DECODERS = {"nib": decode_nib_f16, "split": decode_split_f16}


@dataclass(frozen=True)
class PresumGeometry(Geometry):
    """Geometry of a presum kernel: Geometry's index math with mext False (accumulator columns,
    token tiles, grid z, workspace and stores count tokens: TOK = 8 NT tokens per CTA), read
    from quant_sm90's "presum" operand, float16 [T_pad, Kp], one row per token."""

    fold: str = "presum"

    def check(self) -> None:
        super().check()
        if self.fold != "presum":
            raise ValueError(f"PresumGeometry of fold {self.fold!r}")
        if self.mext:
            raise ValueError("presum: the GEMM rows are tokens (mext False), one summed operand "
                             "row per token")
        if self.fused or self.fmt != "nvfp4":
            raise ValueError("presum runs NVFP4 xop variants only (see the module docstring)")

    @property
    def xop_rows_per_token(self) -> int:
        """Operand rows per token in the xop: one (the sum)."""
        return 1

    def xb_row(self, tok: Any) -> Any:
        """xop row of token tok."""
        return tok

    @property
    def res_off(self) -> int:
        """0: the operand holds the sums, there is no second row to read (the template's
        presum_b_words call, shared by every render, passes it)."""
        return 0


def presum_geometry(g: Geometry) -> PresumGeometry:
    """The presum twin of a plain (mext False) xop geometry."""
    return PresumGeometry(**{f.name: getattr(g, f.name) for f in dataclasses.fields(Geometry)})


# ----------------------------------------------------------------------------- device (trace)


def scale_pair_f16(sw: Any, i: int, fmt: str) -> tuple:
    """f16x2 scales S16(r0), S16(r1) of chunk i (0..3) of a group from the lane's scale word
    (resgen.kernels.sm90_fp4_decode.scale_pair with the FP16 constants)."""
    mul, add = PRESUM_SCALE_CONSTS[fmt]
    zero = Uint32(0)
    b0 = 2 * (i % 2)
    x0 = P.prmt(sw, zero, byte_sel(b0))
    x1 = P.prmt(sw, zero, byte_sel(b0 + 1))
    return x0 * Uint32(mul) + Uint32(add), x1 * Uint32(mul) + Uint32(add)


def presum_b_words(load: Callable[[Any], tuple], a: Any, res_off: int) -> list:
    """The lane's 8 f16x2 B words of one chunk and n8 tile: its 16 columns of the token's
    presum row (fp16(X_hat + R_hat), formats.presum_fp16) at address a, two 16-byte loads
    (`load`), plain's B load. res_off: PresumGeometry.res_off, 0 (the operand holds the sums)."""
    if res_off != 0:
        raise ValueError("presum reads quant_sm90's presum rows: res_off must be 0")
    return list(load(a) + load(a + 16))


def chunk_mma_f16(words: Sequence[Sequence[Any]], scales: Sequence[tuple],
                  xw: Sequence[Sequence[Any]], acc: list, packing: str) -> None:
    """One 64-column chunk in FP16 (linear_sm90_mma_dev.chunk_mma's shape): words[mt][j] (4 per
    m16 tile), scales[mt] = (S16(r0), S16(r1)), xw[nt] = the lane's 8 presum B words of n8
    tile nt; acc[mt][nt] = 4 FP32, updated."""
    decode = F16_DECODERS[packing]
    for mt, wv in enumerate(words):
        s0, s1 = scales[mt]
        for j in range(4):
            r = decode(wv[j], Uint32)
            a = (P.mul_f16x2(r[0], s0), P.mul_f16x2(r[1], s1),
                 P.mul_f16x2(r[2], s0), P.mul_f16x2(r[3], s1))
            for nt, x in enumerate(xw):
                acc[mt][nt] = list(P.mma_f16_16816(a, (x[2 * j], x[2 * j + 1]), acc[mt][nt]))
