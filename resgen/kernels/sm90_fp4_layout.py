"""The Hopper FP4 weight layout "frag16", written offline and read by both Hopper linear
families (linear_sm90_mma, the decode kernels it was designed for, and linear_sm90_wgmma, whose
layout is built from it), and a pure-torch CPU emulation of linear_sm90_mma's data path.

Hopper has no FP4 tensor cores. The kernels run `mma.sync.m16n8k16` in BF16 with FP32
accumulation on EXACT values: a weight code is decoded by bit placement to the BF16 value
E2M1 x 2^-126, then multiplied (`mul.rn.bf16x2`, exact) by its block scale S = s_w x 2^119, which
gives E2M1 x s_w x 2^-7 exactly; the epilogue multiplies by 2^7 (and alpha_x * alpha_w for
NVFP4). Weights are the MMA's A operand (operand swap: output channels on the 16-row M side,
tokens on the 8-column N side).

Layout "frag16" (this module writes it; the kernels read it)
------------------------------------------------------------
The reduction axis is zero-padded to Kp = round_up(Kw, 256) (Kw = K, or K + ext for K-Ext), so
a lane's scale vector (below) always covers whole 4-chunk groups. Output channels: N % 16 == 0.
Terms: mt = n // 16 (an m16 tile), kq = k // 64 (a 64-wide K chunk), lane = 4 g + t (g = 0..7,
t = 0..3), j = 0..3 (the k16 MMA step inside the chunk).

K permutation inside a chunk. An MMA only needs A and B to agree on which physical k sits in
which k slot, so lane t's slots {2t, 2t+1, 2t+8, 2t+9} of step j hold the physical columns
    slot 2t, 2t+1  <->  k = 64 kq + 16 t + 4 j + {0, 1}
    slot 2t+8, 2t+9 <->  k = 64 kq + 16 t + 4 j + {2, 3}
(the kernel reads the activation operand at the same columns). Why: a lane then owns exactly
the 16 columns 16t..16t+15 of a chunk, i.e. ONE NVFP4 block per row for all four steps
(so it expands 2 scales per chunk instead of 8), and its B fragments for the whole chunk are
32 contiguous bytes of one activation row (two 16-byte loads instead of eight 4-byte ones).

Words: int32 [N/16, Kp/64, 32, 4], i.e. W32[mt][kq][lane][j]: each lane loads ONE 16-byte vector
per (mt, kq); a warp loads 512 contiguous bytes. Word (mt, kq, lane, j) holds the 8 codes of
rows r0 = 16 mt + g and r1 = r0 + 8 at columns c = 64 kq + 16 t + 4 j + {0..3}; as MMA A
fragment registers:
    a0 = (r0, c+0)  a1 = (r0, c+1)  a2 = (r1, c+0)  a3 = (r1, c+1)
    a4 = (r0, c+2)  a5 = (r0, c+3)  a6 = (r1, c+2)  a7 = (r1, c+3)
Packing "nib" places them as 4-bit nibbles (sign in the nibble's top bit) so that pair
p = 0..3 of the word, t_p = w << 4p, decodes with
    R_p = (t_p & 0x80008000) | ((t_p & 0x70007000) >> 6)     (bf16x2: a_{2p} low, a_{2p+1} high)
    a0 bits 12-15   a1 bits 28-31   a2 bits 8-11   a3 bits 24-27
    a4 bits 4-7     a5 bits 20-23   a6 bits 0-3    a7 bits 16-19
R_0 and R_2 are row r0 (scale S(r0)), R_1 and R_3 row r1 (scale S(r1)).
Packing "split" separates each code's sign from its 3 magnitude bits so that fewer integer
operations (7 LOP3/SHF per word instead of 10, and 4 instead of 6 shifts on the FMA pipe)
place them; per 16-bit half (the high element sits 16 bits above the low one):
    pair p:   0 (a0,a1)   1 (a2,a3)   2 (a4,a5)   3 (a6,a7)
    |code|:   bits 6-8    bits 3-5    bits 0-2    bits 9-11     (m, e0, e1 upwards)
    sign:     bit 15      bit 12      bit 14      bit 13
    R_0 = w & 0x81C081C0                  R_1 = (w << 3) & 0x81C081C0
    R_2 = ((w << 6) & 0x01C001C0) | ((w << 1) & 0x80008000)
    R_3 = ((w >> 3) & 0x01C001C0) | ((w << 2) & 0x80008000)

Scale bytes: uint8 [N/16, Kp/256, SL, 8]; lane l reads the 8 bytes at [mt][kq // 4][sl(l)]:
byte 2i = row r0, byte 2i + 1 = row r1, for chunk kq = 4 (kq // 4) + i.
    NVFP4: SL = 32, sl = lane, the block is (row, 4 kq + t) (16 columns = the lane's block).
    MXFP4: SL = 16, sl = 2 g + t // 2, the block is (row, 2 kq + t // 2); lanes t = 2s, 2s + 1
           share the 32-column block and read the same bytes (one byte per block stored).
A byte b expands to the BF16x2 scale with one integer multiply-add on (b | b << 16):
    NVFP4: b = ((E' + 9) << 3) | f for s_w = 2^E' (1 + f/8), E' in [-9, 8] (E4M3 subnormals
           renormalized; a zero scale gives b = 0, harmless: its codes are all zero);
           bits = b * 0x00100010 + 0x76807680
    MXFP4: b = stored E8M0 value E; bits = b * 0x00800080 + 0x3B803B80 (needs E <= 135 and,
           for a nonzero block, E >= 9: prep raises ValueError otherwise)

Activation operand ("xop", made by the quantizer): bf16 [T_pad, Kp] row-major, each value
exactly code x block scale (no alpha); Kp as above (zero columns). Rows: plain = tokens;
M-Ext "row_pair" = row 2j the base of token j, row 2j + 1 its residue, so the two products land
in adjacent accumulator columns c0/c1 of one thread and the fold is c0 + c1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from .. import formats
from ..calibrate import QLinearWeight, Selection

__all__ = ["K_ALIGN", "PACKINGS", "XOP_LAYOUTS", "Sm90Weight", "prepare_sm90_weight",
           "scale_bytes", "expand_scale_bits", "decode_pairs", "fragment_weight_values",
           "emulate_linear_sm90_mma", "epilogue_factor", "pad_to"]

K_ALIGN = 256                 # Kp granularity: 4 chunks of 64 (one scale vector per lane)
PACKINGS: tuple[str, ...] = ("nib", "split")
XOP_LAYOUTS: tuple[str, ...] = ("plain", "row_pair")
_SCALE_CHUNKS = 4             # chunks (of 64 columns) covered by one 8-byte scale vector

# slot s = 0..7 of a word -> (row r1?, column offset 0..3) and the nibble's bit offset ("nib")
_SLOT_ROW = (0, 0, 1, 1, 0, 0, 1, 1)
_SLOT_COL = (0, 1, 0, 1, 2, 3, 2, 3)
_NIB_SHIFT = (12, 28, 8, 24, 4, 20, 0, 16)
# "split": (lowest magnitude bit, sign bit) of slots a0..a7
_SPLIT_MAG = (6, 22, 3, 19, 0, 16, 9, 25)
_SPLIT_SIGN = (15, 31, 12, 28, 14, 30, 13, 29)

_NV_SCALE_MUL, _NV_SCALE_ADD = 0x00100010, 0x76807680
_MX_SCALE_MUL, _MX_SCALE_ADD = 0x00800080, 0x3B803B80
_MX_E_MAX, _MX_E_MIN_NONZERO = 135, 9


def pad_to(v: int, m: int) -> int:
    """v rounded up to a multiple of m."""
    return -(-v // m) * m


@dataclass(frozen=True)
class Sm90Weight:
    """A linear weight in the frag16 layout (see the module docstring).

    words:  int32 [N/16, Kp/64, 32, 4]
    scales: uint8 [N/16, Kp/256, SL, 8] (SL = 32 NVFP4, 16 MXFP4)
    alpha:  float32 [1], the NVFP4 weight tensor scale alpha_w (1.0 for MXFP4)
    kw:     the reduction length the kernel sees before padding (K, or K + ext for K-Ext)
    """

    fmt: str
    packing: str
    out_features: int
    in_features: int
    kw: int
    words: torch.Tensor
    scales: torch.Tensor
    alpha: torch.Tensor
    selection: Selection | None = None
    input_scale: torch.Tensor | None = None

    @property
    def kp(self) -> int:
        return self.words.shape[1] * 64

    @property
    def device(self) -> torch.device:
        return self.words.device

    def to(self, device) -> "Sm90Weight":
        isc = None if self.input_scale is None else self.input_scale.to(device)
        return Sm90Weight(self.fmt, self.packing, self.out_features, self.in_features, self.kw,
                          self.words.to(device), self.scales.to(device), self.alpha.to(device),
                          self.selection, isc)

    def nbytes(self) -> int:
        """Bytes the kernel streams per call (codes + scale bytes + alpha)."""
        return self.words.numel() * 4 + self.scales.numel() + 4


def scale_bytes(q: formats.QuantizedTensor) -> torch.Tensor:
    """uint8 [..., K/block]: the stored block scales as the byte the kernel expands.

    NVFP4 raises nothing (every E4M3 value maps); MXFP4 raises ValueError for E > 135, or
    E < 9 on a block with a nonzero code: there BF16 cannot hold E2M1 x s_w x 2^-7 exactly.
    """
    if q.fmt == "nvfp4":
        s = q.scales.to(torch.float32)
        if bool((s < 0).any()) or not bool(torch.isfinite(s).all()):
            raise ValueError("NVFP4 block scales must be finite and non-negative")
        mant, exp = torch.frexp(s)               # s = mant * 2^exp, mant in [0.5, 1)
        e = exp.to(torch.int32) - 1              # s = 2^e * (1 + f/8)
        f = (mant * 16 - 8).to(torch.int32)
        b = ((e + 9) << 3) | f
        if bool(((s > 0) & ((e < -9) | (e > 8) | (f < 0) | (f > 7))).any()):
            raise AssertionError("E4M3 value outside the renormalized range")  # cannot happen
        return torch.where(s > 0, b, torch.zeros_like(b)).to(torch.uint8)
    e8 = q.scales.to(torch.int32)
    codes = formats.unpack_fp4(q.codes)
    bs = q.block_size
    nonzero = ((codes & 7) != 0).reshape(*codes.shape[:-1], -1, bs).any(-1)
    if bool((e8 > _MX_E_MAX).any()):
        raise ValueError(f"MXFP4 block scale exponent above {_MX_E_MAX - 127} (|w| >= 2^11): "
                         "the BF16 path of the Hopper linear kernels cannot represent it exactly")
    if bool((nonzero & (e8 < _MX_E_MIN_NONZERO)).any()):
        raise ValueError(f"MXFP4 nonzero block with scale exponent below "
                         f"{_MX_E_MIN_NONZERO - 127} (|w| < 2^-116): not exact in BF16")
    return e8.to(torch.uint8)


def expand_scale_bits(b: torch.Tensor, fmt: str) -> torch.Tensor:
    """int64 bf16x2 bit patterns the kernel builds from scale bytes b (one IMAD on b | b << 16)."""
    b = b.to(torch.int64)
    mul, add = (_NV_SCALE_MUL, _NV_SCALE_ADD) if fmt == "nvfp4" else (_MX_SCALE_MUL,
                                                                      _MX_SCALE_ADD)
    return (b * mul + add) & 0xFFFFFFFF


def prepare_sm90_weight(qweight: QLinearWeight, packing: str = "nib") -> Sm90Weight:
    """QLinearWeight -> frag16 layout (offline; any device, runs in torch).

    K-Ext weights (prepared with a selection) keep their extension: the kernel reduces over
    K + ext in one pass.
    """
    if packing not in PACKINGS:
        raise ValueError(f"unknown packing {packing!r}; expected one of {PACKINGS}")
    q = qweight.q
    n, kw = q.shape[0], q.shape[1]
    if q.codes.dim() != 2:
        raise ValueError("a linear weight must be 2-D")
    if n % 16:
        raise ValueError(f"the Hopper FP4 weight layout needs out_features % 16 == 0, got N={n}")
    kp = pad_to(kw, K_ALIGN)
    dev = q.codes.device
    codes = formats.unpack_fp4(q.codes).to(torch.int64)               # [N, Kw]
    codes = torch.nn.functional.pad(codes, (0, kp - kw))
    # [mt, rr(r0/r1), g, kq, t, j, col] -> words
    c = codes.reshape(n // 16, 2, 8, kp // 64, 4, 4, 4)
    word = torch.zeros(n // 16, kp // 64, 8, 4, 4, dtype=torch.int64, device=dev)  # g, t, j
    for s in range(8):
        sub = c[:, _SLOT_ROW[s], :, :, :, :, _SLOT_COL[s]].permute(0, 2, 1, 3, 4)  # mt,kq,g,t,j
        if packing == "nib":
            word |= sub << _NIB_SHIFT[s]
        else:
            word |= ((sub & 7) << _SPLIT_MAG[s]) | ((sub >> 3) << _SPLIT_SIGN[s])
    words = word.reshape(n // 16, kp // 64, 32, 4)
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)

    sb = scale_bytes(q).to(torch.int64)                                 # [N, Kw/bs]
    bs = q.block_size
    sb = torch.nn.functional.pad(sb, (0, kp // bs - sb.shape[1]))
    ng = kp // K_ALIGN
    if q.fmt == "nvfp4":
        # block index (within a 256-group) = 4 i + t ; rows r0/r1
        s6 = sb.reshape(n // 16, 2, 8, ng, 4, 4)                        # mt, rr, g, grp, i, t
        sc = s6.permute(0, 3, 2, 5, 4, 1).reshape(n // 16, ng, 32, 8)  # mt, grp, g, t, i, rr
    else:
        s6 = sb.reshape(n // 16, 2, 8, ng, 4, 2)                        # mt, rr, g, grp, i, s
        sc = s6.permute(0, 3, 2, 5, 4, 1).reshape(n // 16, ng, 16, 8)  # mt, grp, g, s, i, rr
    alpha = (q.global_scale if q.global_scale is not None
             else torch.ones((), device=dev)).to(torch.float32).reshape(1)
    return Sm90Weight(q.fmt, packing, n, qweight.in_features, kw, words.contiguous(),
                      sc.to(torch.uint8).contiguous(), alpha.to(dev), qweight.selection,
                      qweight.input_scale)


# ----------------------------------------------------------------------------- emulation


def decode_pairs(words: torch.Tensor, packing: str = "nib") -> torch.Tensor:
    """int64 [..., 4] bf16x2 bit patterns R_0..R_3 of each word (the kernel's bit operations).

    words: int32 [...]. "nib": R_p = (t & 0x80008000) | ((t & 0x70007000) >> 6), t = w << 4p;
    "split": the four expressions of the module docstring (32-bit arithmetic).
    """
    w = words.to(torch.int64) & 0xFFFFFFFF
    m32 = 0xFFFFFFFF
    if packing == "nib":
        out = []
        for p in range(4):
            t = (w << (4 * p)) & m32
            out.append((t & 0x80008000) | ((t & 0x70007000) >> 6))
    elif packing == "split":
        mag, sgn = 0x01C001C0, 0x80008000
        out = [w & (mag | sgn), (w << 3) & (mag | sgn),
               ((w << 6) & mag) | ((w << 1) & sgn), ((w >> 3) & mag) | ((w << 2) & sgn)]
    else:
        raise ValueError(f"unknown packing {packing!r}")
    return torch.stack(out, dim=-1)


def _bf16_halves(bits: torch.Tensor) -> torch.Tensor:
    """int64 bf16x2 patterns [...] -> bfloat16 [..., 2] (low half = element 0)."""
    lo = (bits & 0xFFFF).to(torch.int32)
    hi = ((bits >> 16) & 0xFFFF).to(torch.int32)
    h = torch.stack([lo, hi], dim=-1)
    h = torch.where(h >= 2 ** 15, h - 2 ** 16, h).to(torch.int16)
    return h.view(torch.bfloat16)


def _lane_scale_bits(wt: Sm90Weight) -> torch.Tensor:
    """int64 [N/16, Kp/64, 32, 2] bf16x2 scale patterns per (mt, kq, lane, row r0/r1)."""
    mtn, ng = wt.scales.shape[0], wt.scales.shape[1]
    lanes = torch.arange(32, device=wt.device)
    sl = lanes if wt.fmt == "nvfp4" else 2 * (lanes // 4) + (lanes % 4) // 2
    sc = wt.scales.to(torch.int64)[:, :, sl, :]                      # mt, grp, lane, 8
    sc = sc.reshape(mtn, ng, 32, 4, 2).permute(0, 1, 3, 2, 4)        # mt, grp, i, lane, rr
    return _prmt_imad_expand(sc.reshape(mtn, ng * 4, 32, 2), wt.fmt)


def _prmt_imad_expand(b: torch.Tensor, fmt: str) -> torch.Tensor:
    """The kernel's expansion: PRMT builds b | b << 16, one IMAD scales and offsets it."""
    x = b | (b << 16)
    mul, add = (16, _NV_SCALE_ADD) if fmt == "nvfp4" else (128, _MX_SCALE_ADD)
    return (x * mul + add) & 0xFFFFFFFF


def fragment_weight_values(wt: Sm90Weight) -> torch.Tensor:
    """bfloat16 [N/16, Kp/64, 32, 4(j), 8(slot)]: the scaled A fragment values the kernel feeds
    to the MMA (decoded pair x scale, multiplied in BF16 as mul.rn.bf16x2 does)."""
    r = decode_pairs(wt.words, wt.packing)                            # mt, kq, lane, j, p
    s = _lane_scale_bits(wt)                                          # mt, kq, lane, rr
    s_p = s[:, :, :, None, [0, 1, 0, 1]]                              # R_0,R_2 row r0
    prod = _bf16_halves(r).float() * _bf16_halves(s_p).float()        # exact in FP32
    prod = prod.to(torch.bfloat16)                                    # exact: no rounding
    return prod.reshape(*prod.shape[:-2], 8)                          # slots a0..a7


def dense_from_fragments(frag: torch.Tensor) -> torch.Tensor:
    """Scatter A fragments [mt, kq, lane, j, slot] back to a dense [N, Kp] matrix (float32),
    using the slot -> (row, column) map of the module docstring."""
    mtn, kqn = frag.shape[0], frag.shape[1]
    out = torch.zeros(mtn, 2, 8, kqn, 4, 4, 4, dtype=torch.float32, device=frag.device)
    f = frag.float().reshape(mtn, kqn, 8, 4, 4, 8)                    # mt, kq, g, t, j, slot
    for s in range(8):
        out[:, _SLOT_ROW[s], :, :, :, :, _SLOT_COL[s]] = f[..., s].permute(0, 2, 1, 3, 4)
    return out.reshape(mtn * 16, kqn * 64)


def epilogue_factor(fmt: str, alpha_x: torch.Tensor | None, alpha_w: torch.Tensor) -> torch.Tensor:
    """float32 [1]: what the kernel multiplies the FP32 accumulator by (alpha_x*alpha_w*2^7
    for NVFP4, 2^7 for MXFP4), in the kernel's FP32 order."""
    if fmt == "mxfp4":
        return torch.full((1,), 128.0, dtype=torch.float32, device=alpha_w.device)
    if alpha_x is None:
        raise ValueError("NVFP4 needs alpha_x")
    return (alpha_x.float().reshape(1) * alpha_w.float().reshape(1)) * 128.0


def emulate_linear_sm90_mma(xop: torch.Tensor, wt: Sm90Weight, m: int,
                        layout: Literal["plain", "row_pair"] = "plain",
                        alpha_x: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel's data path on the CPU (or any device), in torch. Returns float32 [m, N]
    (before the final BF16 rounding; `.to(torch.bfloat16)` gives the kernel's output).

    xop: bf16 [T, Kp] (T >= rows; rows = m plain, 2m row_pair). Steps, as the kernel does them:
    16-byte word vectors -> pair decode (bit ops) -> scale bytes expanded by IMAD -> BF16 multiply
    -> per k16 step an MMA of the A fragments with B fragments read from the xop at the SAME
    permuted columns (FP32 accumulation; here float64, exact for these inputs) -> fold of
    adjacent columns (row_pair) -> epilogue factor.
    """
    if xop.dtype != torch.bfloat16 or xop.dim() != 2:
        raise TypeError("xop must be a 2-D bfloat16 tensor")
    if xop.shape[1] != wt.kp:
        raise ValueError(f"xop has {xop.shape[1]} columns, the weight expects Kp={wt.kp}")
    rows = 2 * m if layout == "row_pair" else m
    if layout not in XOP_LAYOUTS:
        raise ValueError(f"unknown xop layout {layout!r}")
    if xop.shape[0] < rows:
        raise ValueError(f"xop has {xop.shape[0]} rows, need {rows}")
    frag = fragment_weight_values(wt).double()                        # mt, kq, lane, j, slot
    mtn, kqn = frag.shape[0], frag.shape[1]
    x = xop[:rows].double().reshape(rows, kqn, 4, 4, 4)               # row, kq, t, j, col
    # B fragment of lane t, step j: slots (2t, 2t+1, 2t+8, 2t+9) <- columns 16t+4j+(0,1,2,3).
    # A fragment slot a0/a1 pairs with b0/b1 (columns +0, +1), a4/a5 with b2/b3 (+2, +3); the
    # same for row r1 (a2/a3, a6/a7).
    f = frag.reshape(mtn, kqn, 8, 4, 4, 8)                            # mt, kq, g, t, j, slot
    a_r0 = f[..., [0, 1, 4, 5]]                                       # columns +0,+1,+2,+3
    a_r1 = f[..., [2, 3, 6, 7]]
    acc_r0 = torch.einsum("mqgtjc,rqtjc->mgr", a_r0, x)               # [mt, g, rows]
    acc_r1 = torch.einsum("mqgtjc,rqtjc->mgr", a_r1, x)
    acc = torch.stack([acc_r0, acc_r1], dim=1).reshape(mtn * 16, rows)   # channel, xop row
    acc = acc.float()                                                 # FP32 accumulator
    if layout == "row_pair":
        acc = acc[:, 0::2] + acc[:, 1::2]                             # the fold: c0 + c1
    fac = epilogue_factor(wt.fmt, alpha_x, wt.alpha.cpu() if xop.device.type == "cpu"
                          else wt.alpha)
    return (acc * fac.to(acc.device)).T.contiguous()
