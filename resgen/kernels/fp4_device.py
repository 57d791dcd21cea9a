"""Device-side FP4 quantization math for CuTe DSL kernels: the bit-exact GPU twin of resgen.formats.

Every function here runs at TRACE time inside a `@cute.kernel` / `@cute.jit` function and emits
straight-line code on DSL scalars (`Float32`, `Uint32`); a "list" is a Python list of DSL scalars
(a register array unrolled at trace time, never indexed dynamically, so never local memory).
Python ints/floats are accepted wherever a scalar is. Nothing here branches on device values.

Exactness contract: the FP32 operations that resgen.formats performs are emitted as inline PTX
with an explicit rounding modifier and WITHOUT .ftz (`div.rn.f32`, `mul.rn.f32`, `add.rn.f32`,
`sub.rn.f32`): IEEE results, subnormals kept, and ptxas never contracts an explicitly rounded
mul/add pair into an FMA (the DSL's own `a * b - c` does get fused, which would change residues).
Those wrappers, like every inline PTX, are resgen.kernels.sm90_ptx's; this module re-exports
the exact arithmetic and the global loads / stores below as part of its API.

API (stable: the GEMM prologue and the attention query split call these)
--------------------------------------------------------------------------
Exact FP32 arithmetic and bit casts
    div_rn(a, b), mul_rn(a, b), add_rn(a, b), sub_rn(a, b), fma_rn(a, b, c) -> Float32
    rcp_rn(a) -> Float32                            IEEE 1 / a (rcp.rn.f32)
    div6_rn(a) -> Float32                           IEEE a / 6 for a >= 0 (3 FMA-pipe
                                                    instructions; div.rn for tiny a)
    fabs(a) -> Float32
    fmin(a, b), fmax(a, b) -> Float32               (min.f32 / max.f32; exact, no NaN inputs)
    f32_bits(x) -> Uint32,  bits_f32(u) -> Float32  (reinterpretation, no conversion)
    sel_u32(p, a, b) -> Uint32, sel_f32(p, a, b) -> Float32   (p ? a : b, branch free)
    abs_max(xs) -> Float32                          max |x| over a list
    group_max(v, lanes) -> Float32                  max over aligned groups of `lanes` adjacent
                                                    lanes (1, 2, 4, 8, 16 or 32; butterfly
                                                    shuffles: all 32 lanes of the warp must call)
BF16
    bf16x2_to_f32(w) -> (lo, hi)                    exact widening of a packed pair (element 0 low)
    bf16x2_abs_max(words) -> Float32                max |x| over packed bf16 pairs (half the
                                                    instructions of abs_max on widened values)
    pack_bf16x2_exact(lo, hi) -> Uint32             packs two FP32 values that are EXACTLY bf16
                                                    (FP4 value x block scale always is): the high
                                                    halves are taken, no rounding (one PRMT)
E2M1 elements
    e2m1_round(v) -> (code, value)                  RNE to E2M1 saturating at +-6; code uint 0..15
                                                    (sign bit 3 from v's sign bit: -0 -> 8); value is
                                                    the signed E2M1 value of code as Float32
    e2m1_round_signed(v, sign) -> (code, value)     the same for |v| with the sign bit `sign`
    e2m1_decode(code) -> Float32
    pack_codes(codes) -> Uint32                     up to 8 codes, element 0 in the low nibble
Scales
    e4m3_encode(v) -> Uint32 byte                   E4M3 RNE satfinite (cvt.rn.satfinite.e4m3x2.f32)
    e4m3_decode(byte) -> Float32                    exact (subnormals included)
    nvfp4_tensor_scale(amax) -> Float32             dynamic alpha = amax / 2688, formats'
                                                    zero -> 1 and FLT_MIN floor rules
    nvfp4_block_scale(amax, alpha) -> (byte, sf, d) byte = E4M3(amax/6/alpha), sf its value, d = alpha*sf
    mxfp4_block_scale(amax) -> (byte, scale, inv)   byte = E8M0 e+127, scale = 2^e, inv = 2^-e
One block held in registers (block = 16 NVFP4 / 32 MXFP4 elements spread over `lanes` lanes)
    Block = NamedTuple(codes, values, scale_byte, scale, d)
        codes/values: per element (see e2m1_round); scale_byte: the stored scale (E4M3 / E8M0);
        scale: its value (sf or 2^e, what the BF16 GEMM operand multiplies by, alpha excluded);
        d: the effective dequantization scale (alpha*sf or 2^e)
    quantize_block(xs, fmt, alpha, lanes) -> Block  alpha: Float32 tensor scale (NVFP4) / None (MXFP4)
    quantize_block_with_amax(xs, fmt, alpha, amax) -> Block   when the block amax is known
    block_quotients(xs, d, amax) -> list[Float32]   quotients x / d whose E2M1 codes are those of
                                                    IEEE x / d (NVFP4's division: shared
                                                    reciprocal + one FMA refinement, div.rn
                                                    fallback for extreme scales; see there)
    fast_division_ok(d, amax) -> Boolean
    residues(xs, block) -> list[Float32]            r = x - d * value (FP32, formats' order)
    operand_values(block) -> list[Float32]          value * scale: the exact BF16 GEMM operand
    select_by_mask(rs, mask, k) -> list[Float32]    the k entries of an 8-entry list whose bit is
                                                    set in `mask` (Uint32 byte), ascending
Global memory (raw 64-bit addresses, Int64; alignment is the caller's promise; sm90_ptx's)
    ld_global_v4(addr, l1=False) -> 4 x Uint32      (ld.global.nc: read-only path; l1=False
                                                    also skips L1 allocation: data read once)
    ld_global_f32(addr) -> Float32, ld_global_u32 / ld_global_u16 / ld_global_u8(addr) -> Uint32
    st_global_v4(addr, w0..w3, pred=None), st_global_v2(addr, w0, w1, pred=None),
    st_global_u32 / st_global_u16 / st_global_u8(addr, w, pred=None)   (low bits of w stored)
        pred: optional DSL Boolean; the store happens only where it is true (PTX predication)
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

from cutlass import Boolean, Float32, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T
import cutlass.cute as cute

from . import sm90_ptx as P
# re-exported (see the docstring); _f32 / _u32 coerce an operand to a DSL scalar
from .sm90_ptx import _as_f32 as _f32
from .sm90_ptx import _as_u32 as _u32
from .sm90_ptx import (add_rn, div_rn, fabs, fma_rn, fmax, fmin, ld_global_u8, ld_global_u16,
                       ld_global_u32, ld_global_v4, mul_rn, rcp_rn, st_global_u8, st_global_u16,
                       st_global_u32, st_global_v2, st_global_v4, sub_rn)
from .sm90_ptx import ld_f32 as ld_global_f32

__all__ = [
    "div_rn", "mul_rn", "add_rn", "sub_rn", "fma_rn", "rcp_rn", "div6_rn",
    "fabs", "fmin", "fmax", "f32_bits", "bits_f32",
    "sel_u32", "sel_f32", "abs_max", "group_max",
    "bf16x2_to_f32", "bf16x2_abs_max", "pack_bf16x2_exact",
    "e2m1_round", "e2m1_round_signed", "e2m1_decode", "pack_codes",
    "e4m3_encode", "e4m3_decode", "nvfp4_tensor_scale", "nvfp4_block_scale",
    "mxfp4_block_scale",
    "Block", "quantize_block", "quantize_block_with_amax", "block_quotients",
    "fast_division_ok", "residues", "operand_values",
    "select_by_mask",
    "ld_global_v4", "ld_global_f32", "ld_global_u32", "ld_global_u16", "ld_global_u8",
    "st_global_v4", "st_global_v2", "st_global_u32",
    "st_global_u16", "st_global_u8",
    "BLOCK", "E2M1_MAX", "E4M3_MAX", "NVFP4_ALPHA_DIVISOR",
]

BLOCK = {"nvfp4": 16, "mxfp4": 32}
E2M1_MAX = 6.0
E4M3_MAX = 448.0
NVFP4_ALPHA_DIVISOR = E2M1_MAX * E4M3_MAX      # 2688: alpha = amax / 2688

# FP32 bit patterns used below.
_SIGN = 0x80000000
_ABS = 0x7FFFFFFF
_EXP = 0x7F800000
_ONE = 0x3F800000            # 1.0
_MAGIC_SHIFT = 22 << 23      # adding 22 to the exponent: 2^e -> 2^(e+22)
_MIN_NORMAL = 0x00800000     # 2^-126 (FLT_MIN)
_TWO_POW_120 = 0x7B800000    # 2^120: E4M3 bits placed at FP32 bit 20 need this factor
_TWO_POW_M127 = 0x00400000   # 2^-127 (subnormal): the E8M0 scale of byte 0
_ONE_SIXTH = 0x3E2AAAAB      # RN(1 / 6)
_DIV6_MIN = 0x0D800000       # 2^-100: div6_rn's FMA path is exact from here up (see there)


# ----------------------------------------------------------------------------- FP32 helpers


def div6_rn(a) -> Float32:
    """RN(a / 6) for finite a >= 0 (NVFP4's s = amax / 6), exactly as div.rn.f32 gives it.

    q0 = RN(a * RN(1/6)), then one Markstein step q = RN(q0 + RN(a - 6 q0) * RN(1/6)): 3
    FMA-pipe instructions instead of div.rn's ~9 and a branch. Checked exhaustively against IEEE
    division for every float32 a >= 2^-100 (the step is exact where no intermediate is
    subnormal); smaller a (subnormal quotients) take div.rn.f32 (a per-lane branch that is
    never taken for real activations)."""
    a = _f32(a)
    c = bits_f32(_ONE_SIXTH)
    q = mul_rn(a, c)
    q = fma_rn(fma_rn(q, -6.0, a), c, q)
    return _div6_tiny(a, q)


@cute.jit
def _div6_tiny(a, q):
    r = q
    if f32_bits(a) < Uint32(_DIV6_MIN):
        r = div_rn(a, 6.0)
    return r


def f32_bits(x) -> Uint32:
    return Uint32(llvm.bitcast(T.i32(), _f32(x).ir_value()))


def bits_f32(u) -> Float32:
    return Float32(llvm.bitcast(T.f32(), _u32(u).ir_value()))


def sel_u32(p, a, b) -> Uint32:
    """p ? a : b for a DSL Boolean p."""
    from cutlass.cutlass_dsl import select_

    return Uint32(select_(p, _u32(a), _u32(b)))


def sel_f32(p, a, b) -> Float32:
    from cutlass.cutlass_dsl import select_

    return Float32(select_(p, _f32(a), _f32(b)))


# ----------------------------------------------------------------------------- reductions


def abs_max(xs: Sequence) -> Float32:
    """max |x| over a non-empty list (exact; one FMNMX with an |x| operand per element)."""
    m = fabs(xs[0])
    for x in xs[1:]:
        m = fmax(m, fabs(x))
    return m


def group_max(v, lanes: int) -> Float32:
    """Max of v over aligned groups of `lanes` adjacent lanes (a power of two <= 32).

    Butterfly shuffles: every lane of the warp must execute this (no lane may be masked off)."""
    if lanes < 1 or lanes > 32 or lanes & (lanes - 1):
        raise ValueError(f"lanes must be a power of two in [1, 32], got {lanes}")
    v = _f32(v)
    off = lanes // 2
    while off:
        v = fmax(v, cute.arch.shuffle_sync_bfly(v, offset=off))
        off //= 2
    return v


# ----------------------------------------------------------------------------- bf16


def bf16x2_to_f32(w) -> tuple[Float32, Float32]:
    """Packed bf16 pair (element 0 in the low half) -> two exact Float32."""
    w = _u32(w)
    return bits_f32(w << 16), bits_f32(w & 0xFFFF0000)


def bf16x2_abs_max(words: Sequence) -> Float32:
    """max |x| over the bf16 values of packed pairs (exact; no NaN inputs).

    max.xorsign.abs.bf16x2 (sm_86+) takes the maximum of the magnitudes pairwise (its sign bit,
    the XOR of the inputs' signs, is ignored), so n words cost n - 1 HMNMX2 plus 3 instructions
    for the last pair, instead of 2n FMNMX on widened values."""
    if not words:
        raise ValueError("bf16x2_abs_max needs at least one word")
    m = _u32(words[0])
    for w in words[1:]:
        m = P.max_xorsign_abs_bf16x2(m, w)
    lo, hi = bf16x2_to_f32(m)
    return fmax(fabs(lo), fabs(hi))


def pack_bf16x2_exact(lo, hi) -> Uint32:
    """Two Float32 that are exactly representable in bf16 -> packed pair (lo in the low half).

    Takes the high 16 bits of each (no rounding): exact for FP4 value x block scale, which
    needs at most 6 significant bits (E2M1 x E4M3) or is a power-of-two multiple (MXFP4)."""
    return P.prmt(f32_bits(lo), f32_bits(hi), 0x7632, hex_imm=True)


# ----------------------------------------------------------------------------- E2M1


def e2m1_round(v) -> tuple[Uint32, Float32]:
    """Round v to E2M1 (nearest, ties to the even code, saturating at +-6).

    Returns (code, value): code in 0..15 with the sign of v in bit 3 (so -0 and negative values
    that round to 0 give code 8, as formats.e2m1_encode), value the signed E2M1 value of code.
    """
    return e2m1_round_signed(v, f32_bits(v) & _SIGN)


def e2m1_round_signed(v, sign) -> tuple[Uint32, Float32]:
    """e2m1_round of |v| with the sign bit `sign` (Uint32: 0 or 0x80000000) instead of v's.

    Method (exact, branch free, 6 instructions for the value): a = min(|v|, 6); the E2M1 grid
    step is 0.5 below 2, 1 in [2, 4) and 2 from 4, so adding M = 2^22, 2^23 or 2^24 (a's
    exponent, at least 2^0, plus 22) rounds a to a multiple of the step with FP32
    round-to-nearest-even, whose ties go to the even multiple = the even code; subtracting M
    leaves the grid value q exactly. The code: q * 2^-126 places q's exponent and mantissa bit
    at FP32 bits 22..24 (0.5 becomes the subnormal 2^-127), so its bits >> 22 are the
    magnitude code.
    """
    sign = _u32(sign)
    a = fmin(fabs(v), E2M1_MAX)
    magic = bits_f32(P.max_u32((f32_bits(a) & _EXP) + _MAGIC_SHIFT, _ONE + _MAGIC_SHIFT))
    q = sub_rn(add_rn(a, magic), magic)
    code = (f32_bits(mul_rn(q, bits_f32(_MIN_NORMAL))) >> 22) | (sign >> 28)
    return code, bits_f32(f32_bits(q) | sign)


def e2m1_decode(code) -> Float32:
    """E2M1 code (0..15) -> signed value: magnitude bits at FP32 bit 22 times 2^126 (exact)."""
    code = _u32(code)
    mag = mul_rn(bits_f32((code & 7) << 22), bits_f32(0x7E800000))   # 0x7E800000 = 2^126
    return bits_f32(f32_bits(mag) | ((code & 8) << 28))


def pack_codes(codes: Sequence) -> Uint32:
    """Up to 8 E2M1 codes -> one word, element 0 in the low nibble (formats.pack_fp4 order)."""
    if not 1 <= len(codes) <= 8:
        raise ValueError(f"pack_codes takes 1..8 codes, got {len(codes)}")
    w = _u32(codes[0])
    for i, c in enumerate(codes[1:], start=1):
        w = w | (_u32(c) << (4 * i))
    return w


# ----------------------------------------------------------------------------- scales


def e4m3_encode(v) -> Uint32:
    """Non-negative Float32 -> E4M3 byte, RNE, saturating at 448 (and +inf -> 448)."""
    return P.f32_to_e4m3x2(v) & 0xFF


def e4m3_decode(byte) -> Float32:
    """E4M3 byte (sign ignored) -> Float32, exact: bits at FP32 bit 20, times 2^120."""
    return mul_rn(bits_f32((_u32(byte) & 0x7F) << 20), bits_f32(_TWO_POW_120))


def nvfp4_tensor_scale(amax) -> Float32:
    """Dynamic NVFP4 alpha from the tensor amax, as formats.nvfp4_global_scale:
    amax / 2688 (FP32 division), 1 for an all-zero tensor, at least FLT_MIN otherwise."""
    amax = _f32(amax)
    alpha = fmax(div_rn(amax, NVFP4_ALPHA_DIVISOR), bits_f32(_MIN_NORMAL))
    return sel_f32(amax == Float32(0.0), Float32(1.0), alpha)


def nvfp4_block_scale(amax, alpha) -> tuple[Uint32, Float32, Float32]:
    """(E4M3 byte, its value sf, effective scale d = alpha * sf) for one block's amax.
    (s / alpha stays a div.rn.f32: ptxas hoists the reciprocal of a loop-invariant alpha, so
    it costs ~6 instructions per block, as much as a reciprocal-and-refine done by hand.)"""
    s = div6_rn(amax)
    byte = e4m3_encode(div_rn(s, alpha))
    sf = e4m3_decode(byte)
    return byte, sf, mul_rn(alpha, sf)


def mxfp4_block_scale(amax) -> tuple[Uint32, Float32, Float32]:
    """(E8M0 byte = e + 127, 2^e, 2^-e) with e = clamp(floor(log2 amax) - 2, -127, 127).

    floor(log2 amax) is the unbiased FP32 exponent; a subnormal or zero amax gives e = -127.
    A finite amax has e <= 125, so 2^-e is always a normal number; 2^e for e = -127 is the
    subnormal 2^-127."""
    ef = f32_bits(amax) >> 23
    byte = P.max_u32(ef, 2) - 2
    scale = bits_f32(sel_u32(byte == Uint32(0), _TWO_POW_M127, byte << 23))
    inv = bits_f32((Uint32(254) - byte) << 23)
    return byte, scale, inv


# ----------------------------------------------------------------------------- blocks


class Block(NamedTuple):
    """One quantized block, per lane: this lane's elements of it plus the shared scale."""

    codes: list          # Uint32 per element, 0..15
    values: list         # Float32 per element: signed E2M1 value of the code
    scale_byte: Uint32   # stored scale: E4M3 (NVFP4) or E8M0 (MXFP4) byte
    scale: Float32       # its value (sf or 2^e): the BF16 operand multiplier, alpha excluded
    d: Float32           # effective dequantization scale: alpha * sf (NVFP4) or 2^e (MXFP4)


def _check_fmt(fmt: str) -> None:
    if fmt not in BLOCK:
        raise ValueError(f"unknown FP4 format {fmt!r}")


def quantize_block(xs: Sequence, fmt: str, alpha=None, lanes: int = 1) -> Block:
    """Quantize one block held by `lanes` adjacent lanes, len(xs) elements each.

    xs: Float32 list (this lane's elements, in channel order); len(xs) * lanes must equal the
    block size (16 NVFP4, 32 MXFP4). alpha: NVFP4 tensor scale (Float32), None for MXFP4.
    """
    _check_fmt(fmt)
    if len(xs) * lanes != BLOCK[fmt]:
        raise ValueError(f"{fmt} block is {BLOCK[fmt]} elements, got {len(xs)} x {lanes} lanes")
    return quantize_block_with_amax(xs, fmt, alpha, group_max(abs_max(xs), lanes))


def quantize_block_with_amax(xs: Sequence, fmt: str, alpha, amax) -> Block:
    """quantize_block when the block amax is already known (e.g. reduced another way)."""
    _check_fmt(fmt)
    if fmt == "nvfp4":
        if alpha is None:
            raise ValueError("NVFP4 needs the tensor scale alpha")
        byte, sf, d = nvfp4_block_scale(amax, alpha)
        vs = block_quotients(xs, d, amax)
        scale = sf
    else:
        if alpha is not None:
            raise ValueError("MXFP4 has no tensor scale; pass alpha=None")
        byte, d, inv = mxfp4_block_scale(amax)
        # x * 2^-e is torch.ldexp's product: exact unless it underflows (then RNE, as torch).
        vs = [mul_rn(x, inv) for x in xs]
        scale = d
    # The sign always comes from x: x / d and x * 2^-e have x's sign (also when they are 0).
    rounded = [e2m1_round_signed(v, f32_bits(x) & _SIGN) for v, x in zip(vs, xs)]
    return Block([c for c, _ in rounded], [v for _, v in rounded], byte, scale, d)


# Exponent fields bounding the fast division: 2^-60 <= d <= 2^60 and amax <= 2^60 * d.
_FAST_EXP_LO = 127 - 60
_FAST_EXP_HI = 127 + 60
_FAST_RANGE = 59


def fast_division_ok(d, amax) -> Boolean:
    """Whether block_quotients may use the reciprocal path for this block (see there)."""
    ed = f32_bits(d) >> 23
    ea = f32_bits(amax) >> 23
    in_range = (ed >= _FAST_EXP_LO) & (ed <= _FAST_EXP_HI) & (ea <= ed + _FAST_RANGE)
    return (d == Float32(0.0)) | in_range


def block_quotients(xs: Sequence, d, amax) -> list:
    """Quotients q ~ |x / d| for every x of one block whose E2M1 codes (e2m1_round_signed) are
    those of the IEEE quotient RN(x / d) (the sign is NOT reliable: callers take the sign of
    x). d == 0 gives 0 (formats divides by +inf there). amax: max |x| over the block.

    Division is the costliest step of NVFP4 quantization (div.rn.f32 is ~10 instructions plus a
    branch per element), so the common case shares one correctly rounded reciprocal
    y = RN(1 / d) per block and refines q0 = RN(x y) once with an FMA remainder:
        r0 = RN(x - q0 d), q1 = RN(q0 + r0 y)                 (3 instructions per element)
    |x y - x / d| <= 2^-24 |x / d|, so q0 is within 1.5 ulp of x / d and q1 is within half an
    ulp plus ~2^-23 ulp: q1 = RN(x / d) or, when x / d lies within ~2^-23 ulp of a midpoint,
    the float next to it. Adjacent floats have different E2M1 codes only if one of them is an
    E2M1 rounding boundary b (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5), i.e. only for x within a
    few ulps of b d. Those cases were checked exhaustively (every d mantissa, every boundary,
    every x within 10 ulps of RN(b d): 1.2e9 cases, no code differs; zero steps differ in
    millions), and the check is scale invariant while no intermediate under- or overflows,
    which 2^-60 <= d <= 2^60 and amax <= 2^60 d guarantee (fast_division_ok; quotients below
    2^-4 may be less accurate there, which cannot change their code: 0, sign from x).
    tests/test_quant_sm90.py repeats the check on a subset. Any other block (tiny or huge
    tensor scales only) takes div.rn.f32 per element: a per-lane branch, uniform in practice.
    """
    fast = fast_division_ok(d, amax)
    y = sel_f32(d > Float32(0.0), div_rn(1.0, d), 0.0)
    return _quotients(list(xs), d, y, fast)


@cute.jit
def _quotients(xs, d, y, fast):
    qs = list(xs)
    if fast:
        qs = [_refined_quotient(x, d, y) for x in xs]
    else:
        qs = [div_rn(x, d) for x in xs]
    return qs


def _refined_quotient(x, d, y) -> Float32:
    q = mul_rn(x, y)
    return fma_rn(fma_rn(q, -d, x), y, q)


def residues(xs: Sequence, block: Block) -> list:
    """r = x - d * value in FP32 (two roundings, formats' order: never an FMA)."""
    return [sub_rn(x, mul_rn(block.d, v)) for x, v in zip(xs, block.values)]


def operand_values(block: Block) -> list:
    """value * scale per element: exact, and exactly representable in bf16."""
    return [mul_rn(v, block.scale) for v in block.values]


def select_by_mask(rs: Sequence, mask, k: int) -> list:
    """The k entries of the 8-entry list rs whose bit is set in mask, lowest channel first.

    mask: Uint32 holding one selection byte with exactly k bits set (calibrate.Selection).
    Register-only compaction: walk the channels from 7 down to 0 and push each selected value
    onto the front of a k-slot queue (k selects per channel), so no dynamic indexing."""
    if len(rs) != 8 or k not in (1, 2, 4, 8):
        raise ValueError(f"select_by_mask takes 8 values and k in (1, 2, 4, 8), got {len(rs)}, {k}")
    if k == 8:
        return list(rs)
    mask = _u32(mask)
    out = [Float32(0.0)] * k
    for j in range(7, -1, -1):
        p = (mask & (1 << j)) != Uint32(0)
        out = [sel_f32(p, rs[j], out[0])] + [sel_f32(p, out[i - 1], out[i]) for i in range(1, k)]
    return out
