"""Inline PTX for the Blackwell (sm_100a) families, beyond what CuTe DSL's tcgen05 module gives
(CuTe DSL, trace time).

CuTe DSL provides the block-scaled MMA (tcgen05.mma ... .block_scale), the TMA loads, the
scale-factor copy into tensor memory (tcgen05.cp), TMEM allocation and the mbarrier pipelines;
the resgen sm_100a kernels use those as NVIDIA's blockscaled examples do. What they add here:

    tmem_ld(shape, rep, taddr) -> tuple    tcgen05.ld.sync.aligned.<shape>.x<rep>.b32 for
                                  shape "32x32b" (rep registers), "16x256b" (4 rep), "16x128b"
                                  (2 rep), from TMEM address taddr (lane << 16 | column). Which
                                  accumulator element lands in which register is
                                  resgen.kernels.linear_sm100_tc_geom.tmem_frag (the PTX ISA's
                                  fragment layouts, the same maps CUTLASS's SM100_TMEM_LOAD
                                  traits encode); the epilogue's fold plan is built from it. The
                                  load is side-effecting so it stays after the accumulator
                                  barrier wait that precedes it.
    tmem_wait_ld(*vals) -> vals   tcgen05.wait::ld.sync.aligned with the loaded registers passed
                                  through it ("+r"): every use of the returned values depends on
                                  the wait, so no compiler moves arithmetic on them above it
    tmem_ld_expected_count(shape, rep)     registers one thread receives (trace-time int)
    bulk_s2g(gaddr, saddr, nbytes, pred)   cp.async.bulk.global.shared::cta.bulk_group when
                                  pred != 0: the copy engine writes nbytes (multiple of 16) of
                                  shared memory to global memory (the linear epilogue's "tma"
                                  store path)
    bulk_commit(), bulk_wait0()   cp.async.bulk.commit_group / wait_group 0
    fence_async_shared()          fence.proxy.async.shared::cta: generic-proxy shared-memory
                                  writes visible to the async proxy (TMA store) before it reads
    named_bar_sync(bar, threads)  bar.sync bar, threads: the epilogue warps alone
    mul_f32(a, b), add_f32(a, b)  mul.rn.f32 / add.rn.f32: never contracted into an FMA, so the
                                  M-Ext fold rounds exactly as resgen.reference.linear does
    st_shared_u16(saddr, v), st_shared_u32(saddr, v), ld_shared_u32(saddr)   shared-memory
                                  scalars (side effects: ordered with the barriers around them)
    st_f32_pred(addr, v, pred), ld_cg_f32_pred(addr, pred)   split-K partials (L2 only on the
                                  way back: other CTAs wrote them); the load gives 0 when off
    atom_add_u32_pred(addr, v, pred) -> old   atom.global.acq_rel.gpu.add.u32 when pred != 0
    tcgen05_fence_before(), tcgen05_fence_after()   tcgen05.fence::before_thread_sync /
                                  ::after_thread_sync: order tcgen05 operations (TMEM loads,
                                  MMAs) across a thread barrier or mbarrier wait (added for
                                  attention_sm100)

Generic wrappers (the same PTX on every arch) are re-exported from sm90_ptx so that each piece
of PTX is written once: st_u16, st_u32, fence_gpu, grid_dep_launch, opaque32, opaque64, ld_f32
(ld.global.nc.f32), cvt_bf16x2, red_add_f32_pred. The quantizer's FP4 math is fp4_device's
(bit operations, the GPU twin of resgen.formats), not sm_100's cvt.rn.satfinite.e2m1x2: that
instruction's agreement with formats could not be checked without a Blackwell GPU.
"""

from __future__ import annotations

from cutlass import Float32, Int32, Uint32
from cutlass.cutlass_dsl import T, dsl_user_op

from .sm90_ptx import (_asm, _f32, _i64, _struct, _u32, _unpack, cvt_bf16x2, fence_gpu,
                       grid_dep_launch, ld_f32, opaque32, opaque64, red_add_f32_pred, st_u16,
                       st_u32)

__all__ = ["TMEM_LD_SHAPES", "tmem_ld_expected_count", "tmem_ld", "tmem_wait_ld", "bulk_s2g",
           "bulk_commit", "bulk_wait0", "fence_async_shared", "named_bar_sync", "mul_f32",
           "add_f32", "st_shared_u16", "st_shared_u32", "ld_shared_u32", "st_f32_pred",
           "ld_cg_f32_pred", "atom_add_u32_pred", "tcgen05_fence_before",
           "tcgen05_fence_after", "st_u16", "st_u32", "ld_f32", "cvt_bf16x2", "red_add_f32_pred", "fence_gpu", "grid_dep_launch", "opaque32", "opaque64"]

# registers per thread and repetition of each TMEM load shape (PTX ISA, tcgen05.ld)
TMEM_LD_SHAPES: dict[str, int] = {"32x32b": 1, "16x256b": 4, "16x128b": 2}
_REPS = (1, 2, 4, 8, 16, 32, 64, 128)


def tmem_ld_expected_count(shape: str, rep: int) -> int:
    """Registers one thread receives from tcgen05.ld.<shape>.x<rep> (at most 128 here)."""
    if shape not in TMEM_LD_SHAPES:
        raise ValueError(f"unknown TMEM load shape {shape!r}; known: {sorted(TMEM_LD_SHAPES)}")
    if rep not in _REPS:
        raise ValueError(f"TMEM load repetition .x{rep} is not one of {_REPS}")
    n = TMEM_LD_SHAPES[shape] * rep
    if n > 128:
        raise ValueError(f".{shape}.x{rep} loads {n} registers per thread (at most 128)")
    return n


@dsl_user_op
def tmem_ld(shape: str, rep: int, taddr, *, loc=None, ip=None) -> tuple:
    """tcgen05.ld.sync.aligned.<shape>.x<rep>.b32: the warp's registers from TMEM address taddr
    (Int32: lane in the high 16 bits, column in the low). Returns Float32 values (the raw b32
    accumulator bits); call tmem_wait_ld on them before use."""
    n = tmem_ld_expected_count(shape, rep)
    regs = ",".join(f"${i}" for i in range(n))
    st = _asm(_struct(n, "f32"), [Int32(taddr).ir_value(loc=loc, ip=ip)],
              f"tcgen05.ld.sync.aligned.{shape}.x{rep}.b32 {{{regs}}}, [${n}];",
              ",".join(["=f"] * n + ["r", "~{memory}"]), effects=True, loc=loc, ip=ip)
    return _unpack(st, n, Float32, T.f32(), loc, ip)


@dsl_user_op
def tmem_wait_ld(*vals, loc=None, ip=None) -> tuple:
    """tcgen05.wait::ld.sync.aligned; returns vals unchanged but data-dependent on the wait."""
    n = len(vals)
    cons = ",".join(["=f"] * n + [str(i) for i in range(n)] + ["~{memory}"])
    st = _asm(_struct(n, "f32"), [_f32(v, loc, ip) for v in vals],
              "tcgen05.wait::ld.sync.aligned;", cons, effects=True, loc=loc, ip=ip)
    return _unpack(st, n, Float32, T.f32(), loc, ip)


@dsl_user_op
def bulk_s2g(gaddr, saddr, nbytes: int, pred, *, loc=None, ip=None) -> None:
    if nbytes % 16 or nbytes <= 0:
        raise ValueError(f"a bulk copy moves a positive multiple of 16 bytes, not {nbytes}")
    _asm(None, [_i64(gaddr, loc, ip), Int32(saddr).ir_value(loc=loc, ip=ip),
                Int32(pred).ir_value(loc=loc, ip=ip)],
         "{\n .reg .pred p;\n setp.ne.b32 p, $2, 0;\n"
         f" @p cp.async.bulk.global.shared::cta.bulk_group [$0], [$1], {int(nbytes)};\n}}",
         "l,r,r,~{memory}", effects=True, loc=loc, ip=ip)


@dsl_user_op
def bulk_commit(*, loc=None, ip=None) -> None:
    _asm(None, [], "cp.async.bulk.commit_group;", "~{memory}", effects=True, loc=loc, ip=ip)


@dsl_user_op
def bulk_wait0(*, loc=None, ip=None) -> None:
    _asm(None, [], "cp.async.bulk.wait_group 0;", "~{memory}", effects=True, loc=loc, ip=ip)


@dsl_user_op
def fence_async_shared(*, loc=None, ip=None) -> None:
    _asm(None, [], "fence.proxy.async.shared::cta;", "~{memory}", effects=True, loc=loc, ip=ip)


@dsl_user_op
def named_bar_sync(bar: int, threads: int, *, loc=None, ip=None) -> None:
    _asm(None, [], f"bar.sync {int(bar)}, {int(threads)};", "~{memory}", effects=True, loc=loc,
         ip=ip)


@dsl_user_op
def mul_f32(a, b, *, loc=None, ip=None) -> Float32:
    return Float32(_asm(T.f32(), [_f32(a, loc, ip), _f32(b, loc, ip)], "mul.rn.f32 $0, $1, $2;",
                        "=f,f,f", loc=loc, ip=ip))


@dsl_user_op
def add_f32(a, b, *, loc=None, ip=None) -> Float32:
    return Float32(_asm(T.f32(), [_f32(a, loc, ip), _f32(b, loc, ip)], "add.rn.f32 $0, $1, $2;",
                        "=f,f,f", loc=loc, ip=ip))


@dsl_user_op
def st_shared_u16(saddr, v, *, loc=None, ip=None) -> None:
    _asm(None, [Int32(saddr).ir_value(loc=loc, ip=ip), _u32(v, loc, ip)],
         "{\n .reg .b16 h;\n cvt.u16.u32 h, $1;\n st.shared.b16 [$0], h;\n}",
         "r,r,~{memory}", effects=True, loc=loc, ip=ip)


@dsl_user_op
def st_shared_u32(saddr, v, pred, *, loc=None, ip=None) -> None:
    _asm(None, [Int32(saddr).ir_value(loc=loc, ip=ip), _u32(v, loc, ip),
                Int32(pred).ir_value(loc=loc, ip=ip)],
         "{\n .reg .pred p;\n setp.ne.b32 p, $2, 0;\n @p st.shared.b32 [$0], $1;\n}",
         "r,r,r,~{memory}", effects=True, loc=loc, ip=ip)


@dsl_user_op
def ld_shared_u32(saddr, *, loc=None, ip=None) -> Uint32:
    return Uint32(_asm(T.i32(), [Int32(saddr).ir_value(loc=loc, ip=ip)],
                       "ld.shared.b32 $0, [$1];", "=r,r,~{memory}", effects=True, loc=loc,
                       ip=ip))


@dsl_user_op
def st_f32_pred(addr, v, pred, *, loc=None, ip=None) -> None:
    _asm(None, [_i64(addr, loc, ip), _f32(v, loc, ip), Int32(pred).ir_value(loc=loc, ip=ip)],
         "{\n .reg .pred p;\n setp.ne.b32 p, $2, 0;\n @p st.global.f32 [$0], $1;\n}",
         "l,f,r,~{memory}", effects=True, loc=loc, ip=ip)


@dsl_user_op
def ld_cg_f32_pred(addr, pred, *, loc=None, ip=None) -> Float32:
    return Float32(_asm(T.f32(), [_i64(addr, loc, ip), Int32(pred).ir_value(loc=loc, ip=ip)],
                        "{\n .reg .pred p;\n setp.ne.b32 p, $2, 0;\n mov.b32 $0, 0;\n"
                        " @p ld.global.cg.f32 $0, [$1];\n}", "=&f,l,r,~{memory}",
                        effects=True, loc=loc, ip=ip))


@dsl_user_op
def atom_add_u32_pred(addr, v, pred, *, loc=None, ip=None) -> Uint32:
    return Uint32(_asm(T.i32(), [_i64(addr, loc, ip), _u32(v, loc, ip),
                                 Int32(pred).ir_value(loc=loc, ip=ip)],
                       "{\n .reg .pred p;\n setp.ne.b32 p, $3, 0;\n mov.b32 $0, 0;\n"
                       " @p atom.global.acq_rel.gpu.add.u32 $0, [$1], $2;\n}",
                       "=&r,l,r,r,~{memory}", effects=True, loc=loc, ip=ip))


@dsl_user_op
def tcgen05_fence_before(*, loc=None, ip=None) -> None:
    _asm(None, [], "tcgen05.fence::before_thread_sync;", "~{memory}", effects=True, loc=loc,
         ip=ip)


@dsl_user_op
def tcgen05_fence_after(*, loc=None, ip=None) -> None:
    _asm(None, [], "tcgen05.fence::after_thread_sync;", "~{memory}", effects=True, loc=loc,
         ip=ip)
