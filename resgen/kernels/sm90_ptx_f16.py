"""Hopper inline-PTX wrappers for FP16 operands (CuTe DSL, trace time).

The FP16 twins of resgen.kernels.sm90_ptx's BF16 primitives, in their own module because the
fingerprint of every kernel covers the resgen.kernels modules it imports: the BF16 kernels of
linear_sm90_mma import sm90_ptx, so adding to it would stale every stored result of that family.
Only the kernels that use FP16 operands (linear_sm90_mma's "presum" fold) import this one.
Conventions as in sm90_ptx (pure instructions, no side effects).

    mul_f16x2(a, b)         mul.rn.f16x2 (no .ftz: FP16 subnormal inputs and results kept)
    mma_f16_16816(a, b, c)  mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32
    cvt_f16x2(lo, hi)       cvt.rn.f16x2.f32 (round to nearest even; lo in the low half)
"""

from __future__ import annotations

from cutlass import Float32, Uint32
from cutlass.cutlass_dsl import T, dsl_user_op

# sm90_ptx's private inline-asm helpers, imported, not copied (one definition of the emission)
from .sm90_ptx import _asm, _f32, _struct, _u32, _unpack

__all__ = ["mul_f16x2", "mma_f16_16816", "cvt_f16x2"]


@dsl_user_op
def mul_f16x2(a, b, *, loc=None, ip=None) -> Uint32:
    return Uint32(_asm(T.i32(), [_u32(a, loc, ip), _u32(b, loc, ip)],
                       "mul.rn.f16x2 $0, $1, $2;", "=r,r,r", loc=loc, ip=ip))


@dsl_user_op
def mma_f16_16816(a, b, c, *, loc=None, ip=None) -> tuple:
    """a: 4 x Uint32 (f16x2), b: 2 x Uint32, c: 4 x Float32 -> 4 x Float32 (d = a b + c)."""
    ops = ([_u32(v, loc, ip) for v in a] + [_u32(v, loc, ip) for v in b]
           + [_f32(v, loc, ip) for v in c])
    st = _asm(_struct(4, "f32"), ops,
              "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
              "{$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, {$10,$11,$12,$13};",
              "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", loc=loc, ip=ip)
    return _unpack(st, 4, Float32, T.f32(), loc, ip)


@dsl_user_op
def cvt_f16x2(lo, hi, *, loc=None, ip=None) -> Uint32:
    # PTX packs the FIRST source operand into the upper half
    return Uint32(_asm(T.i32(), [_f32(hi, loc, ip), _f32(lo, loc, ip)],
                       "cvt.rn.f16x2.f32 $0, $1, $2;", "=r,f,f", loc=loc, ip=ip))
