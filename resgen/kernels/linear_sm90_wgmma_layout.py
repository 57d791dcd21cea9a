"""Offline weight layout "wg64" of the Hopper prefill FP4 linear kernels (family
linear_sm90_wgmma), and a pure-torch decode of it.

The kernels run `wgmma.mma_async.m64nNk16` in BF16 with the weights as the A operand in
REGISTERS: per warp, the A fragment of m64nNk16 is the mma.sync m16n8k16 A fragment of the
warp's 16 rows (CUTLASS/CuTe GMMA ALayout_64x16; tests/test_linear_sm90_wgmma.py checks it
against the CuTe DSL's own partition of an identity tensor, thread by thread), so the decode
family's bit trick carries over unchanged: a code decodes by bit placement to E2M1 x 2^-126,
one `mul.rn.bf16x2` by S = s_w x 2^119 gives E2M1 x s_w x 2^-7 exactly (see
resgen.kernels.sm90_fp4_layout for the scale bytes and the two nibble packings "nib" / "split").

Why a new layout (and not frag16). The activations (B) come from shared memory through TMA
with the 128-byte swizzle, in NATURAL column order: the wgmma B descriptor walks k16 steps as
32-byte column slices of the swizzled tile, and TMA cannot permute columns at 2-element
granularity (its smallest box row is 16 bytes). frag16's K permutation inside 64-column chunks
would need the quantizer to write a permuted xop; instead these weights use the natural order:
word (mb, c, q, lane, j) holds, for lane = 4 g + t of warp q, the codes of rows
r0 = 64 mb + 16 q + g and r1 = r0 + 8 at chunk columns 16 j + 2 t + {0, 1, 8, 9}:
    a0 = (r0, 16j+2t)  a1 = (r0, 16j+2t+1)  a2 = (r1, 16j+2t)  a3 = (r1, 16j+2t+1)
    a4 = (r0, 16j+2t+8) a5 = (r0, 16j+2t+9) a6 = (r1, 16j+2t+8) a7 = (r1, 16j+2t+9)
(the frag16 slot -> bit placement of the chosen packing is reused: the words are built by
resgen.kernels.sm90_fp4_layout.prepare_sm90_weight on a column-permuted copy of the codes, so any
packing it knows is available here with the same decode). With natural order a k16 step is
exactly one NVFP4 block: each lane needs 8 scales per chunk (4 steps x 2 rows), MXFP4 4.

Records. Kp = round_up(K or K + ext, 256) (as resgen.kernels.sm90_fp4_layout.K_ALIGN and the
quantizer's kp_align=256; the kernel itself needs Kp % 128 == 0). For every m64 block mb and
64-column chunk c one contiguous record of REC bytes (one bulk copy per block and stage):
    bytes [0, 2048):     int32 words [q 4][lane 32][j 4]        (lane l reads 16 bytes at
                          q * 512 + l * 16: the 4 k16 steps of its chunk)
    bytes [2048, REC):   scale bytes [q 4][g 8][SB]
        NVFP4 (SB = 8, REC = 2304): byte 2 j + rr = block (row r_rr, 4 c + j)
        MXFP4 (SB = 4, REC = 2176): byte 2 h + rr = block (row r_rr, 2 c + h), h = j // 2
    so k16 step j reads scale word j // 2 (NVFP4) / 0 (MXFP4) and expands its bytes with
    resgen.kernels.sm90_fp4_decode.scale_pair (PRMT + IMAD per scale).
Tensor: int32 [N / 64, Kp / 64, REC / 4], record (mb, c) at byte (mb * Kp / 64 + c) * REC.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import formats
from ..calibrate import QLinearWeight, Selection
from .sm90_fp4_layout import (K_ALIGN, PACKINGS, decode_pairs, expand_scale_bits, pad_to,
                              prepare_sm90_weight, scale_bytes)
from .linear_sm90_wgmma_geom import (REC_WORD_BYTES, SLOT_COL, SLOT_ROW8, record_bytes,
                                     scale_bytes_per_group)

__all__ = ["WgWeight", "prepare_wgmma_weight", "chunk_permutation", "record_fields",
           "fragment_values", "dense_weight_values", "bf16_from_bits"]


@dataclass(frozen=True)
class WgWeight:
    """A linear weight in the wg64 layout (module docstring).

    records: int32 [N / 64, Kp / 64, REC / 4]
    alpha:   float32 [1], the NVFP4 weight tensor scale alpha_w (1.0 for MXFP4)
    kw:      the reduction length before padding (K, or K + ext for K-Ext)
    """

    fmt: str
    packing: str
    out_features: int
    in_features: int
    kw: int
    records: torch.Tensor
    alpha: torch.Tensor
    selection: Selection | None = None
    input_scale: torch.Tensor | None = None

    @property
    def kp(self) -> int:
        return self.records.shape[1] * 64

    @property
    def nk(self) -> int:
        return self.records.shape[1]

    @property
    def device(self) -> torch.device:
        return self.records.device

    def to(self, device) -> "WgWeight":
        isc = None if self.input_scale is None else self.input_scale.to(device)
        return WgWeight(self.fmt, self.packing, self.out_features, self.in_features, self.kw,
                        self.records.to(device), self.alpha.to(device), self.selection, isc)

    def nbytes(self) -> int:
        """Bytes the kernel streams per call (records + alpha)."""
        return self.records.numel() * 4 + 4


def chunk_permutation(device=None) -> torch.Tensor:
    """int64 [64]: perm[p] = the natural chunk column that frag16 column position p must hold
    so that frag16's words become wg64 words. frag16 puts physical columns 16 t + 4 j + q
    (q = 0..3 for slots a0/a2, a1/a3, a4/a6, a5/a7) in k16 step j of lane t; wg64 wants
    16 j + 2 t + (q & 1) + 8 (q >> 1) there."""
    t = torch.arange(4).view(4, 1, 1)
    j = torch.arange(4).view(1, 4, 1)
    q = torch.arange(4).view(1, 1, 4)
    nat = 16 * j + 2 * t + (q & 1) + 8 * (q >> 1)                     # indexed [t, j, q]
    return nat.reshape(64).to(device)


def _scale_record(sb: torch.Tensor, fmt: str, n: int, nk: int) -> torch.Tensor:
    """uint8 [N, Kp / block] scale bytes -> uint8 [N / 64, nk, 4 * 8 * SB] record tails."""
    if fmt == "nvfp4":
        s = sb.reshape(n // 64, 4, 2, 8, nk, 4)                # mb, q, rr, g, c, j
        s = s.permute(0, 4, 1, 3, 5, 2)                          # mb, c, q, g, j, rr
    else:
        s = sb.reshape(n // 64, 4, 2, 8, nk, 2)                # mb, q, rr, g, c, h
        s = s.permute(0, 4, 1, 3, 5, 2)                          # mb, c, q, g, h, rr
    return s.reshape(n // 64, nk, 32 * scale_bytes_per_group(fmt))


def prepare_wgmma_weight(qweight: QLinearWeight, packing: str = "split") -> WgWeight:
    """QLinearWeight -> wg64 records (offline; any device, runs in torch).

    Requires N % 64 == 0. K-Ext weights (prepared with a selection) keep their extension: the
    kernel reduces over K + ext in one pass. MXFP4 scales outside the exact BF16 range raise
    ValueError (resgen.kernels.sm90_fp4_layout.scale_bytes)."""
    if packing not in PACKINGS:
        raise ValueError(f"unknown packing {packing!r}; expected one of {PACKINGS}")
    q = qweight.q
    if q.codes.dim() != 2:
        raise ValueError("a linear weight must be 2-D")
    n, kw = q.shape[0], q.shape[1]
    if n % 64:
        raise ValueError(f"linear_sm90_wgmma needs out_features % 64 == 0, got N={n}")
    kp = pad_to(kw, K_ALIGN)
    nk = kp // 64
    dev = q.codes.device
    # words: frag16 of the column-permuted codes (scales are not used by the words; the real
    # ones are checked and laid out below)
    codes = formats.unpack_fp4(q.codes)
    codes = torch.nn.functional.pad(codes, (0, kp - kw)).reshape(n, nk, 64)
    perm = chunk_permutation(dev)
    permuted = formats.pack_fp4(codes[:, :, perm].reshape(n, kp))
    bs = q.block_size
    dummy = formats.QuantizedTensor(
        q.fmt, permuted,
        torch.zeros(n, kp // bs, dtype=q.scales.dtype, device=dev) if q.fmt == "nvfp4"
        else torch.full((n, kp // bs), 127, dtype=torch.uint8, device=dev),
        q.global_scale)
    f16 = prepare_sm90_weight(QLinearWeight(dummy, kp), packing)
    words = f16.words.reshape(n // 64, 4, nk, 32, 4).permute(0, 2, 1, 3, 4)   # mb, c, q, l, j
    wbytes = words.contiguous().view(torch.uint8).reshape(n // 64, nk, REC_WORD_BYTES)
    sb = scale_bytes(q)                                                       # [N, Kw / bs]
    sb = torch.nn.functional.pad(sb, (0, kp // bs - sb.shape[1]))
    rec = torch.cat([wbytes, _scale_record(sb, q.fmt, n, nk)], dim=-1).contiguous()
    alpha = (q.global_scale if q.global_scale is not None
             else torch.ones((), device=dev)).to(torch.float32).reshape(1)
    return WgWeight(q.fmt, packing, n, qweight.in_features, kw,
                    rec.view(torch.int32).reshape(n // 64, nk, record_bytes(q.fmt) // 4),
                    alpha.to(dev), qweight.selection, qweight.input_scale)


# ----------------------------------------------------------------------------- decoding


def record_fields(wt: WgWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """(words int32 [N/64, nk, 4, 32, 4], scale bytes uint8 [N/64, nk, 4, 8, SB]) read back
    from the records at the byte offsets the kernel uses."""
    nb, nk = wt.records.shape[0], wt.records.shape[1]
    raw = wt.records.view(torch.uint8).reshape(nb, nk, record_bytes(wt.fmt))
    words = raw[..., :REC_WORD_BYTES].contiguous().view(torch.int32).reshape(nb, nk, 4, 32, 4)
    sc = raw[..., REC_WORD_BYTES:].reshape(nb, nk, 4, 8, scale_bytes_per_group(wt.fmt))
    return words, sc


def bf16_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """int64 bf16x2 bit patterns [...] -> float32 [..., 2] (low half first), exact."""
    h = torch.stack([bits & 0xFFFF, (bits >> 16) & 0xFFFF], dim=-1).to(torch.int32)
    return (h << 16).view(torch.float32)


def fragment_values(wt: WgWeight) -> torch.Tensor:
    """float32 [N/64, nk, 4 (q), 32 (lane), 4 (j), 8 (slot a0..a7)]: the A register values the
    kernel feeds wgmma, computed as it does: pair decode (bit ops of the packing), scale byte
    -> bf16x2 by one integer multiply-add, BF16 multiply (exact, so FP32 holds it)."""
    words, sc = record_fields(wt)
    r = decode_pairs(words, wt.packing)                                # ..., j, p (4 pairs)
    nb, nk = words.shape[0], words.shape[1]
    sc = sc.to(torch.int64)
    if wt.fmt == "nvfp4":
        s = sc.reshape(nb, nk, 4, 8, 4, 2)                             # q, g, j, rr
    else:
        s = sc.reshape(nb, nk, 4, 8, 2, 2).repeat_interleave(2, dim=4)  # h -> j = 2h, 2h+1
    s = s.unsqueeze(4).expand(nb, nk, 4, 8, 4, 4, 2).reshape(nb, nk, 4, 32, 4, 2)  # lane
    sbits = expand_scale_bits(s, wt.fmt)                               # ..., j, rr
    # pairs R_0, R_2 are row r0 (scale rr 0), R_1, R_3 row r1
    s_p = sbits[..., [0, 1, 0, 1]]
    prod = bf16_from_bits(r) * bf16_from_bits(s_p)                     # exact in FP32
    if not bool(torch.equal(prod, prod.to(torch.bfloat16).float())):
        raise AssertionError("a decoded weight x scale product is not exact in BF16")
    return prod.reshape(nb, nk, 4, 32, 4, 8)


def dense_weight_values(wt: WgWeight) -> torch.Tensor:
    """float32 [N, Kp]: the fragment values scattered back to (row, column) with the wgmma A
    fragment coordinates (WgGeometry.a_coord). Equals the unit-scale dequantized weight times
    2^-7 when the layout, packing and scale bytes are right."""
    frag = fragment_values(wt)
    nb, nk = frag.shape[0], frag.shape[1]
    out = torch.zeros(nb, 64, nk, 64, dtype=torch.float32, device=frag.device)
    q = torch.arange(4).view(4, 1, 1)
    lane = torch.arange(32).view(1, 32, 1)
    j = torch.arange(4).view(1, 1, 4)
    g, t = lane // 4, lane % 4
    for s in range(8):
        row = (16 * q + g + SLOT_ROW8[s]).expand(4, 32, 4).reshape(-1)
        col = (16 * j + 2 * t + SLOT_COL[s]).expand(4, 32, 4).reshape(-1)
        vals = frag[..., s].reshape(nb, nk, -1).permute(0, 2, 1)        # nb, (q l j), nk
        out[:, row, :, col] = vals.permute(1, 0, 2)
    return out.reshape(nb * 64, nk * 64)
