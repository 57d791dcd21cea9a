"""Device helpers of the linear_sm90_fp8 kernels (CuTe DSL, trace time): the mbarrier wait
with a watchdog (a broken pipeline traps instead of hanging the GPU) and the E2M1 -> E4M3
word converter of wload = "fp4" (its math and reference: linear_sm90_fp8_convert)."""

from __future__ import annotations

from cutlass import Int32, Uint32
from cutlass._mlir import ir
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from .linear_sm90_fp8_convert import E8M0_ZERO_BITS, MAG_MASK, NEG, SIGN_BITS, T_HI, T_LO

__all__ = ["WATCHDOG_NS", "wait_parity", "fp4x8_to_e4m3", "e8m0x4_to_f32", "ld_shared_u32"]

WATCHDOG_NS = 2_000_000_000      # 2 s: every wait in these kernels is over in microseconds


@dsl_user_op
def ld_shared_u32(saddr, *, loc=None, ip=None) -> Uint32:
    """One 32-bit shared-memory load at the 32-bit address `saddr` (this family's own copy:
    a family imports no other family's modules, and resgen.kernels.sm90_ptx's bytes are
    hashed into every sm_90 family's fingerprints)."""
    return Uint32(llvm.inline_asm(
        T.i32(), [Int32(saddr).ir_value(loc=loc, ip=ip)], "ld.shared.u32 $0, [$1];",
        "=r,r,~{memory}", has_side_effects=True, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


@dsl_user_op
def wait_parity(mbar, parity, *, loc=None, ip=None) -> None:
    """Block until the phase of the mbarrier at shared address `mbar` (32-bit) with parity
    `parity` has completed (acquire, CTA scope); trap after WATCHDOG_NS of waiting."""
    llvm.inline_asm(
        None, [Int32(mbar).ir_value(loc=loc, ip=ip), Int32(parity).ir_value(loc=loc, ip=ip)],
        "{\n .reg .pred p;\n .reg .u64 t0, t1;\n"
        " mbarrier.try_wait.parity.shared::cta.b64 p, [$0], $1;\n"
        " @p bra F8_DONE;\n"
        " mov.u64 t0, %globaltimer;\n"
        "F8_RETRY:\n"
        " mbarrier.try_wait.parity.shared::cta.b64 p, [$0], $1;\n"
        " @p bra F8_DONE;\n"
        " mov.u64 t1, %globaltimer;\n"
        " sub.u64 t1, t1, t0;\n"
        f" setp.lt.u64 p, t1, {WATCHDOG_NS};\n"
        " @p bra F8_RETRY;\n"
        " trap;\n"
        "F8_DONE:\n}",
        "r,r,~{memory}", has_side_effects=True, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


def _half(src: str, dst: str) -> str:
    return (f" and.b32 s, {src}, {MAG_MASK:#x};\n prmt.b32 a, tl, th, s;\n"
            f" prmt.b32 b, sv, sv, {src};\n shl.b32 b, b, 7;\n and.b32 b, b, {SIGN_BITS:#x};\n"
            f" or.b32 {dst}, a, b;\n")


@dsl_user_op
def fp4x8_to_e4m3(w, *, loc=None, ip=None) -> tuple:
    """One packed word (8 E2M1 codes, element j in nibble j) -> two E4M3 words (elements
    0..3, 4..7), exactly as linear_sm90_fp8_convert.convert_word_ref."""
    st = llvm.inline_asm(
        ir.Type.parse("!llvm.struct<(i32,i32)>"), [Uint32(w).ir_value(loc=loc, ip=ip)],
        "{\n .reg .b32 tl, th, sv, h, s, a, b;\n"
        f" mov.b32 tl, {T_LO:#x};\n mov.b32 th, {T_HI:#x};\n mov.b32 sv, {NEG:#x};\n"
        + _half("$2", "$0") + " shr.u32 h, $2, 16;\n" + _half("h", "$1") + "}",
        "=&r,=&r,r", has_side_effects=False, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)
    return tuple(Uint32(llvm.extractvalue(T.i32(), st, [i], loc=loc, ip=ip)) for i in range(2))


@dsl_user_op
def e8m0x4_to_f32(w, *, loc=None, ip=None) -> tuple:
    """Four E8M0 bytes (byte j of w) -> four float32 bit patterns 2^(b - 127) (as Uint32), as
    linear_sm90_fp8_convert.e8m0_word_ref."""
    body = "".join(
        f" bfe.u32 e, $4, {8 * j}, 8;\n shl.b32 e, e, 23;\n setp.eq.u32 z, e, 0;\n"
        f" selp.b32 ${j}, {E8M0_ZERO_BITS:#x}, e, z;\n" for j in range(4))
    st = llvm.inline_asm(
        ir.Type.parse("!llvm.struct<(i32,i32,i32,i32)>"), [Uint32(w).ir_value(loc=loc, ip=ip)],
        "{\n .reg .b32 e;\n .reg .pred z;\n" + body + "}", "=&r,=&r,=&r,=&r,r",
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc, ip=ip)
    return tuple(Uint32(llvm.extractvalue(T.i32(), st, [i], loc=loc, ip=ip)) for i in range(4))
