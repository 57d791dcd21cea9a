"""Device helpers of the linear_sm90_fp8 kernels (CuTe DSL, trace time): this family's
mbarrier wait and the two converters of wload = "fp4", each resgen.kernels.sm90_ptx's
primitive with this family's parameters (its labels; the tables of linear_sm90_fp8_convert,
where the conversion's math and bit-level reference live)."""

from __future__ import annotations

from . import sm90_ptx as P
from .linear_sm90_fp8_convert import E8M0_ZERO_BITS, MAG_MASK, NEG, SIGN_BITS, T_HI, T_LO

__all__ = ["wait_parity", "fp4x8_to_e4m3", "e8m0x4_to_f32"]


def wait_parity(mbar, parity) -> None:
    """sm90_ptx.wait_parity (trap after sm90_ptx.WATCHDOG_NS) with this family's PTX labels."""
    P.wait_parity(mbar, parity, "F8")


def fp4x8_to_e4m3(w) -> tuple:
    """One packed word (8 E2M1 codes, element j in nibble j) -> two E4M3 words (elements
    0..3, 4..7), exactly as linear_sm90_fp8_convert.convert_word_ref."""
    return P.e2m1x8_to_e4m3x8(w, T_LO, T_HI, NEG, MAG_MASK, SIGN_BITS)


def e8m0x4_to_f32(w) -> tuple:
    """Four E8M0 bytes (byte j of w) -> four float32 bit patterns 2^(b - 127) (as Uint32), as
    linear_sm90_fp8_convert.e8m0_word_ref."""
    return P.e8m0x4_to_f32(w, E8M0_ZERO_BITS)
