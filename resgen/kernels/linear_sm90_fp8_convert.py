"""The in-kernel E2M1 -> E4M3 weight conversion of the linear_sm90_fp8 kernels with
wload = "fp4" (pure Python: the constants and index math the template uses, and their
bit-level reference for the CPU tests and the emulation).

The weight stays packed E2M1 in HBM (ModelOpt packing: two codes per byte, the even element in
the low nibble; a 32-bit word holds 8 consecutive K elements, element j in nibble j). TMA
brings a chunk's bn x 64 packed bytes into a plain row-major staging buffer; three converter
warps of the producer warpgroup expand it into the bn x 128-byte E4M3 tile the wgmma B
descriptor reads (128-byte swizzle), 16 output bytes (one "unit": 16 consecutive K of one
channel) per step:

    in  = ld.shared.v2 [staging + 8 u]                  8 bytes = 16 codes
    per 32-bit input word w (codes k0..k7), output words o0 (k0..k3), o1 (k4..k7):
        o0 = prmt(T_LO, T_HI, w & 0x7777) | ((prmt(NEG, NEG, w) << 7) & 0x80808080)
        o1 = the same on w >> 16
    st.shared.v4 [tile + b_unit_offset(u)]

prmt (default mode) picks byte (selector & 7) of the 8-byte pool {T_HI, T_LO}; with the
selector's bit 3 set it instead replicates that byte's bit 7. So the first prmt maps each
masked magnitude 0..7 to its E4M3 byte (E2M1 0, 0.5, 1, 1.5, 2, 3, 4, 6 -> 0x00, 0x30, 0x38,
0x3C, 0x40, 0x44, 0x48, 0x4C: exact, every E2M1 value is an E4M3 value), and the second, fed
the unmasked codes and a pool of 0x80 bytes, gives 0x80 for a positive code and 0xFF for a
negative one: bit 0 of each byte is the sign, shifted to bit 7 (the word shift's spill into
the next byte is masked) and merged by one LOP3. 11 integer ops per 8 weights plus the shared
load / store; code 8 (-0) becomes 0x80 (-0).

The block scales arrive as E8M0 bytes (Kp / 32 x N, 1 byte per 32 weights) into a second
staging buffer; the same warps expand them to the float32 2^(b - 127) the promotion reads, 4
per step (b << 23, or 0x00400000 = 2^-127 for b = 0; b = 255, NaN in E8M0, never reaches the
kernel: the operand refuses it).

Only promotion group 1 loads FP4: the codes go to the tensor core unscaled and the E8M0 block
scale is applied at promotion, as for wload = "e4m3" group 1. Folding (groups 2 / 4) during
conversion would need a per-(channel, block) exponent shift of the table (T + 8 d per byte,
exact only while every folded code stays an E4M3 normal, d in [-5, 6]; subnormal targets need
their own table) and a shift operand in HBM; not built (docs/linear_sm90_fp8.md).
"""

from __future__ import annotations

__all__ = ["E4M3_OF_MAG", "T_LO", "T_HI", "NEG", "MAG_MASK", "SIGN_BITS", "CONV_WARP0",
           "CONV_THREADS", "PACKED_CHUNK", "BATCH", "prmt_ref", "convert_word_ref", "lut16",
           "units_per_chunk", "staging_unit_offset", "b_unit_offset", "E8M0_ZERO_BITS",
           "e8m0_word_ref", "scale_items_per_chunk"]

E4M3_OF_MAG = (0x00, 0x30, 0x38, 0x3C, 0x40, 0x44, 0x48, 0x4C)   # E2M1 magnitude code 0..7
T_LO = E4M3_OF_MAG[0] | E4M3_OF_MAG[1] << 8 | E4M3_OF_MAG[2] << 16 | E4M3_OF_MAG[3] << 24
T_HI = E4M3_OF_MAG[4] | E4M3_OF_MAG[5] << 8 | E4M3_OF_MAG[6] << 16 | E4M3_OF_MAG[7] << 24
NEG = 0x80808080          # the sign prmt's pool: 0x80 selected as is, 0xFF sign-replicated
MAG_MASK = 0x7777
SIGN_BITS = 0x80808080
CONV_WARP0 = 1            # converter warps: 1, 2, 3 of the producer warpgroup (0 issues TMA)
CONV_THREADS = 96
PACKED_CHUNK = 64         # packed bytes per channel per chunk (128 K)
BATCH = 4                 # units whose shared loads a converter thread issues together


def prmt_ref(a: int, b: int, c: int) -> int:
    """PTX prmt.b32 d, a, b, c (default mode) on Python ints."""
    pool = (a & 0xFFFFFFFF) | (b & 0xFFFFFFFF) << 32
    d = 0
    for i in range(4):
        sel = (c >> (4 * i)) & 0xF
        byte = (pool >> (8 * (sel & 7))) & 0xFF
        if sel & 8:
            byte = 0xFF if byte & 0x80 else 0x00
        d |= byte << (8 * i)
    return d


def convert_word_ref(w: int) -> tuple[int, int]:
    """The converter on one packed word (8 codes) -> two E4M3 words, as the kernel does it."""
    out = []
    for h in (w & 0xFFFFFFFF, (w & 0xFFFFFFFF) >> 16):
        mag = prmt_ref(T_LO, T_HI, h & MAG_MASK)
        neg = prmt_ref(NEG, NEG, h)
        out.append(mag | ((neg << 7) & SIGN_BITS))
    return out[0], out[1]


def lut16() -> list[int]:
    """E4M3 byte of every E2M1 code 0..15, read off convert_word_ref (code in nibble 0)."""
    return [convert_word_ref(c)[0] & 0xFF for c in range(16)]


E8M0_ZERO_BITS = 0x00400000      # float32 2^-127 (subnormal): E8M0 byte 0


def e8m0_word_ref(w: int) -> tuple[int, int, int, int]:
    """Four E8M0 bytes (byte j of w) -> the float32 bit patterns of 2^(b - 127), as the
    kernel's scale converter computes them."""
    out = []
    for j in range(4):
        b = (w >> (8 * j)) & 0xFF
        out.append(b << 23 if b else E8M0_ZERO_BITS)
    return out[0], out[1], out[2], out[3]


def scale_items_per_chunk(bn: int, gpc: int) -> int:
    """4-byte E8M0 words of one chunk's weight scales (gpc x bn bytes)."""
    return gpc * bn // 4


def units_per_chunk(bn: int) -> int:
    """16-byte output units of one chunk's B tile (bn channels x 128 K)."""
    return bn * 8


def staging_unit_offset(u):
    """Byte offset in the staging buffer (row-major bn x 64) of unit u's 8 packed bytes."""
    return u * 8


def b_unit_offset(u):
    """Byte offset in the B tile (K-major, 128-byte swizzle: 16-byte chunk index XOR row mod
    8) of unit u = 8 n + k16 (channel n, K bytes 16 k16 .. 16 k16 + 15)."""
    n = u >> 3
    return n * 128 + (((u & 7) ^ (n & 7)) << 4)
