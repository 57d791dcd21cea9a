"""The operands of the linear_sm90_fp8 kernels (torch, host or device): MXFP4 codes as E4M3
bytes and float32 group scales, for the weights (offline) and the activations (per call).

Why E4M3 holds MXFP4 exactly: every E2M1 value (0, 0.5, 1, 1.5, 2, 3, 4, 6, signed) has at
most 2 significant bits and lies in [2^-1, 6]; E4M3 has 3 mantissa bits, normals down to 2^-6
and subnormals in steps of 2^-9, a maximum of 448. So v * 2^d is an E4M3 value for every E2M1
value v and every integer d in [FOLD_MIN, FOLD_MAX] = [-8, 6] (v is a multiple of 2^-1, so
v 2^-8 is a multiple of 2^-9; 6 * 2^6 = 384 <= 448), and no d outside that range works for
all of them (0.5 * 2^-9 is not a multiple of 2^-9; 6 * 2^7 = 768 > 448).

group = 1 (no fold): codes are the plain E2M1 values, the scale of (row, k32 block) is the
E8M0 block scale 2^e. group = G > 1 (fold): the G blocks of a group share one scale 2^B per
row, and block b's codes carry 2^(e_b - B) (B = max e - 6 over the group's non-zero blocks).
That is exact iff the group's non-zero blocks span at most FOLD_MAX - FOLD_MIN = 14 binades;
a wider group is refused with FoldRangeError (the exact alternative is group = 1), never
rounded. All-zero blocks carry no information: any d encodes them (zero codes).

Why no fast exact NVFP4 form exists on the FP8 tensor cores. An NVFP4 block (16 elements)
is shorter than the FP8 wgmma k-step (32), so its scale cannot be applied outside the tensor
core per block; it must be folded into the codes, and an E4M3 block scale s = (1 + f/8) 2^e
(f = 0..7; subnormal scales alike) is not a power of two. v * s is an E4M3 number (4
significant bits) iff the significand product has at most 4 bits: for the E2M1 values with
one significant bit (0.5, 1, 2, 4) always (range permitting), for those with two (1.5, 3, 6)
iff 3 (8 + f) has at most 4 significant bits, i.e. f in {0, 2, 4} (24, 30, 36); f = 6 gives
42 = 101010b and every odd f at least 5 bits (1.5 * 1.125 = 1.6875 = 1.1011b, which E4M3
rounds to 1.75). So every block whose scale significand is 1.125, 1.375, 1.625, 1.75 or
1.875 and that holds a code of magnitude 1.5, 3 or 6 has no exact E4M3 form: 5 of the 8
significands, and nearly every such block holds such a code. Exact forms exist only at two
FP8 k-steps per 32 elements: one NVFP4 block per k32 step with the other half zeroed, or
each element twice along K with s split into two foldable parts (1.125 = 1 + 0.125, 1.375 =
1.25 + 0.125, 1.625 = 1.5 + 0.125, 1.75 = 1.5 + 0.25, 1.875 = 1.5 + 0.375): the BF16 rate
again, with as many promotions per MAC or more, so NVFP4 stays on the BF16 path (E2M1 x E4M3 products fit BF16 exactly). `nvfp4_fold_exact` checks
the claim value by value (tests/test_linear_sm90_fp8.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..formats import QuantizedTensor, e2m1_decode, e2m1_values, unpack_fp4
from .linear_sm90_fp8_convert import lut16
from .linear_sm90_fp8_geom import K_BLOCK, KC

__all__ = ["FOLD_MIN", "FOLD_MAX", "ROW_MULTIPLE", "FoldRangeError", "Fp8Operand",
           "Fp4Operand", "fold_operand", "token_operand", "fp4_operand", "expand_fp4", "e4m3_bytes", "e4m3_values", "pow2_f32", "nvfp4_fold_exact",
           "kp_fp8"]

FOLD_MIN, FOLD_MAX = -8, 6
ROW_MULTIPLE = 16        # operand rows padded to it (the scale rows' TMA stride: 16 bytes)


class FoldRangeError(ValueError):
    """A promotion group's block scales span more binades than E4M3 can fold exactly."""


@dataclass
class Fp8Operand:
    """One operand of a linear_sm90_fp8 GEMM.

    codes:  uint8 [R_pad, Kp] E4M3 bytes (rows past the real R and columns past K are zero);
    scales: float32 [Kp / (32 group), R_pad] the group scales, group-major (TMA boxes);
    rows:   R, the real rows; group: k32 blocks per promotion group."""

    codes: torch.Tensor
    scales: torch.Tensor
    rows: int
    group: int

    @property
    def kp(self) -> int:
        return int(self.codes.shape[1])

    @property
    def rows_pad(self) -> int:
        return int(self.codes.shape[0])

    def values(self) -> torch.Tensor:
        """float32 [R_pad, Kp]: the E4M3 code values (the folded codes for group > 1)."""
        return e4m3_values(self.codes)


@dataclass
class Fp4Operand:
    """The weight of a wload = "fp4" kernel (promotion group 1): packed E2M1 codes as in HBM.

    packed: uint8 [R_pad, Kp / 2] (ModelOpt packing: even element in the low nibble; rows past
            the real R and columns past K / 2 are zero);
    scales: uint8 [Kp / 32, R_pad] the E8M0 block scale bytes (e + 127; 0 past the real rows
            and K), block-major;
    rows:   R, the real rows. group is always 1 (the codes are converted unscaled)."""

    packed: torch.Tensor
    scales: torch.Tensor
    rows: int
    group: int = 1

    @property
    def kp(self) -> int:
        return 2 * int(self.packed.shape[1])

    @property
    def rows_pad(self) -> int:
        return int(self.packed.shape[0])


def kp_fp8(k: int) -> int:
    """The padded reduction length: K rounded up to two chunks (256: the kernel walks chunk
    pairs)."""
    return -(-k // (2 * KC)) * (2 * KC)


def pow2_f32(e: torch.Tensor) -> torch.Tensor:
    """float32 2^e exactly for int32 e in [-149, 127] (subnormals below -126), from bits."""
    normal = torch.bitwise_left_shift(torch.clamp(e + 127, min=1), 23)
    sub = torch.bitwise_left_shift(torch.ones_like(e), torch.clamp(e + 149, min=0, max=22))
    return torch.where(e >= -126, normal, sub).to(torch.int32).view(torch.float32)


def e4m3_bytes(v: torch.Tensor) -> torch.Tensor:
    """float32 values that ARE E4M3 numbers -> uint8 E4M3 bytes; ValueError otherwise (the
    conversion would round)."""
    b = v.to(torch.float8_e4m3fn)
    if not torch.equal(b.to(torch.float32), v):
        raise ValueError("values not exactly representable in E4M3")
    return b.view(torch.uint8)


def e4m3_values(codes: torch.Tensor) -> torch.Tensor:
    """uint8 E4M3 bytes -> float32 values."""
    return codes.view(torch.float8_e4m3fn).to(torch.float32)


def fold_operand(q: QuantizedTensor, group: int, kp: int,
                 row_multiple: int = ROW_MULTIPLE) -> Fp8Operand:
    """MXFP4 q [R, K] -> Fp8Operand (codes [R_pad, kp], scales [kp / (32 group), R_pad]).

    R_pad = R rounded up to row_multiple; kp a multiple of 32 * group and >= K. Raises
    FoldRangeError where a group of a row cannot be folded exactly (module docstring)."""
    _check_mxfp4(q)
    if group not in (1, 2, 4):
        raise ValueError(f"group={group} (1, 2 or 4 k32 blocks)")
    r, k = q.shape
    if kp < k or kp % (K_BLOCK * group):
        raise ValueError(f"Kp={kp} must be >= K={k} and a multiple of {K_BLOCK * group}")
    rp = -(-max(r, 1) // row_multiple) * row_multiple
    ng = kp // (K_BLOCK * group)
    dev = q.codes.device
    vals = torch.zeros(rp, kp, dtype=torch.float32, device=dev)
    vals[:r, :k] = e2m1_decode(unpack_fp4(q.codes))
    e = _block_exponents(q, rp, kp)
    vb = vals.reshape(rp, ng, group, K_BLOCK)
    if group == 1:
        codes = e4m3_bytes(vals)
        base = e.reshape(rp, ng)
    else:
        nz = (vb != 0).any(dim=-1)                                   # [rp, ng, group]
        eg = e.reshape(rp, ng, group)
        big = torch.full_like(eg, 1 << 20)
        emax = torch.where(nz, eg, -big).amax(dim=-1)
        emin = torch.where(nz, eg, big).amin(dim=-1)
        anynz = nz.any(dim=-1)
        span = torch.where(anynz, emax - emin, torch.zeros_like(emax))
        wide = span > FOLD_MAX - FOLD_MIN
        if bool(wide.any()):
            row, grp = (int(i) for i in wide.nonzero()[0])
            raise FoldRangeError(
                f"row {row}, promotion group {grp} (K {grp * group * K_BLOCK}.."
                f"{(grp + 1) * group * K_BLOCK - 1}): its non-zero block scales span "
                f"{int(span[row, grp])} binades, more than the {FOLD_MAX - FOLD_MIN} E4M3 can "
                f"fold exactly at group={group}; use group=1")
        base = torch.where(anynz, emax - FOLD_MAX, torch.zeros_like(emax))
        d = torch.where(nz, eg - base.unsqueeze(-1), torch.zeros_like(eg))
        codes = e4m3_bytes((vb * pow2_f32(d).unsqueeze(-1)).reshape(rp, kp))
    scales = pow2_f32(base).t().contiguous()
    return Fp8Operand(codes.contiguous(), scales, r, group)


def token_operand(x: torch.Tensor, group: int, kp: int,
                  row_multiple: int = ROW_MULTIPLE) -> Fp8Operand:
    """The W4A8 activations: x [R, K] float -> Fp8Operand of E4M3 values with one FP32 scale
    per token (formats.fp8_rowwise_quant), the scale repeated for every promotion group
    (scales [kp / (32 group), R_pad]; padding rows and columns zero). The kernel then computes
    sum_g part_g * (s_t * sw[c, g]) = the W4A8 product (resgen.reference.linear_w4a8), with
    one difference: E4M3 x E2M1 products have up to 6 significant bits and a k32 block's sum
    is not exact in Hopper's reduced-precision FP8 accumulator (module docstring), so W4A8 is
    checked against the reference with a tolerance, never bit for bit."""
    from ..formats import fp8_rowwise_quant

    if group not in (1, 2, 4):
        raise ValueError(f"group={group} (1, 2 or 4 k32 blocks)")
    if x.dim() != 2:
        raise ValueError(f"activations must be 2-D, got {tuple(x.shape)}")
    r, k = x.shape
    if kp < k or kp % (K_BLOCK * group):
        raise ValueError(f"Kp={kp} must be >= K={k} and a multiple of {K_BLOCK * group}")
    rp = -(-max(r, 1) // row_multiple) * row_multiple
    x8, s = fp8_rowwise_quant(x)
    codes = torch.zeros(rp, kp, dtype=torch.uint8, device=x.device)
    codes[:r, :k] = x8.view(torch.uint8)
    ng = kp // (K_BLOCK * group)
    scales = torch.zeros(ng, rp, dtype=torch.float32, device=x.device)
    scales[:, :r] = s.reshape(1, r)
    return Fp8Operand(codes, scales, r, group)


def _check_mxfp4(q: QuantizedTensor) -> None:
    if q.fmt != "mxfp4":
        raise ValueError(f"linear_sm90_fp8 takes MXFP4 operands, got {q.fmt} (no exact NVFP4 "
                         "form exists on the FP8 tensor cores: see this module's docstring)")
    if q.codes.dim() != 2:
        raise ValueError(f"an operand is [R, K], got codes of shape {tuple(q.codes.shape)}")


def _block_exponents(q: QuantizedTensor, rp: int, kp: int) -> torch.Tensor:
    """int32 [rp, kp / 32]: the E8M0 block exponents e (scale 2^e), -127 past the real rows
    and K (zero codes there)."""
    r, k = q.shape
    e = torch.full((rp, kp // K_BLOCK), -127, dtype=torch.int32, device=q.codes.device)
    e[:r, : k // K_BLOCK] = q.scales.to(torch.int32) - 127
    if bool((e > 127).any()):
        raise ValueError("MXFP4 scales hold the E8M0 NaN code 255")
    return e


def fp4_operand(q: QuantizedTensor, kp: int, row_multiple: int = ROW_MULTIPLE) -> Fp4Operand:
    """MXFP4 q [R, K] -> Fp4Operand (packed [R_pad, kp / 2], E8M0 scales [kp / 32, R_pad]):
    the codes and scale bytes as they are (no fold, so never refused), zero-padded; kp a
    multiple of 32, >= K."""
    _check_mxfp4(q)
    r, k = q.shape
    if kp < k or kp % K_BLOCK or k % 2:
        raise ValueError(f"Kp={kp} must be >= K={k} and a multiple of {K_BLOCK}")
    rp = -(-max(r, 1) // row_multiple) * row_multiple
    packed = torch.zeros(rp, kp // 2, dtype=torch.uint8, device=q.codes.device)
    packed[:r, : k // 2] = q.codes
    scales = (_block_exponents(q, rp, kp) + 127).to(torch.uint8).t().contiguous()
    return Fp4Operand(packed, scales, r, 1)


def expand_fp4(op: Fp4Operand) -> Fp8Operand:
    """The E4M3 operand the kernel's converter builds in shared memory from op: every code
    through linear_sm90_fp8_convert's bit math (lut16), the scales as 2^(b - 127) (its
    e8m0_word_ref, tested equal to pow2_f32). Equal, byte for byte, to fold_operand(q, 1, kp)
    of the same MXFP4 tensor."""
    lut = torch.tensor(lut16(), dtype=torch.uint8, device=op.packed.device)
    codes = lut[unpack_fp4(op.packed).long()]
    scales = pow2_f32(op.scales.to(torch.int32) - 127)
    return Fp8Operand(codes.contiguous(), scales, op.rows, 1)


def nvfp4_fold_exact() -> torch.Tensor:
    """bool [8, 127]: whether E2M1 magnitude i (0, 0.5, .., 6) times E4M3 scale byte s
    (0..126, the finite non-negative scales) is an E4M3 number. Power-of-two scales fold every
    code (within range); most others do not (the module docstring's claim, checked)."""
    mags = e2m1_values()[:8]
    scales = torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)
    prod = mags.unsqueeze(1) * scales.unsqueeze(0)                 # exact in FP32
    return prod.to(torch.float8_e4m3fn).to(torch.float32) == prod
