"""Device helpers of the linear_sm90_fp8 kernels (CuTe DSL, trace time): the mbarrier wait
with a watchdog (a broken pipeline traps instead of hanging the GPU)."""

from __future__ import annotations

from cutlass import Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op

__all__ = ["WATCHDOG_NS", "wait_parity"]

WATCHDOG_NS = 2_000_000_000      # 2 s: every wait in these kernels is over in microseconds


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
