"""Inline PTX for the Hopper decode GEMMs (CuTe DSL, trace time).

Each function emits one PTX instruction (or a tiny braced block) through `llvm.inline_asm` and
returns DSL scalars. Addresses are raw 64-bit generic/global addresses (`Int64`); alignment is
the caller's promise. Pure instructions are emitted without side effects (the compiler may
schedule, CSE or drop them); loads of read-only kernel inputs are pure; stores, reductions,
atomics and fences are not.

    ld_stream_v4(addr)            ld.global.nc.L1::no_allocate.v4.u32: weights, read once
    ld_stream_v2(addr)            the same, 8 bytes (scale vectors)
    ld_cached_v4(addr, pred)      ld.global.nc.v4.u32 under a predicate, zeros when off
                                  (activations: re-read by every warp, keep them in L1)
    ld_dep_v4(addr, pred)         ld.global.v4.u32 (weak, L1-cached) under a predicate: data the
                                  PREVIOUS kernel writes, read after griddepcontrol.wait. Never
                                  .nc there: ptxas treats .nc data as constant for the kernel's
                                  lifetime and hoists such loads above the wait (seen in SASS)
    ld_dep_f32(addr), ld_dep_u16(addr), ld_dep_u32(addr)   the same, scalars
    ld_nc_v4(addr), ld_dep_v4u(addr)   the two above without a predicate (a predicated load needs
                                  its outputs zeroed first: 2 CS2R per load in SASS)
    ld_cg_f32(addr)               ld.global.cg.f32 (L2 only: partial sums other CTAs wrote)
    ld_f32(addr)                  ld.global.nc.f32 (kernel-constant scalars)
    cp_async_16(saddr, gaddr)     cp.async.cg.shared.global 16 bytes (L2 only), cp_async_8 (.ca, 8)
    ld_shared_v4(saddr), ld_shared_v2(saddr)   ordered after cp.async.wait_group (side effects)
    ld_shared_v4_pred(saddr, pred)  the same under a predicate, zeros when off
    st_shared_v4(saddr, w0, w1, w2, w3)        st.shared.v4.u32 (ordered before a barrier)
    opaque64(*vals) -> vals       the 64-bit values passed through a side-effecting asm: nothing
                                  computed from the results is CSE'd with (or kept live from)
                                  what was computed from the inputs before it
    opaque32(*vals) -> vals       the same for 32-bit integers
    grid_dep_launch()             griddepcontrol.launch_dependents (PDL: the next kernel in the
                                  stream may start its prologue)
    grid_dep_wait(*addrs) -> addrs  griddepcontrol.wait, then the addresses passed through: every
                                  access derived from the returned values depends on the wait,
                                  so no compiler can hoist it above (PDL: inputs the previous
                                  kernel writes)
    prefetch_l2_bulk(gaddr, nbytes, pred)     cp.async.bulk.prefetch.L2.global when pred != 0
    prmt(a, b, sel)               byte permute
    mul_bf16x2(a, b)              mul.rn.bf16x2 (no .ftz exists for bf16: subnormals kept)
    mma_bf16_16816(a, b, c)       mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32
    cvt_bf16x2(lo, hi)            cvt.rn.bf16x2.f32 (lo in the low half)
    st_u16(addr, v, pred), st_u32(addr, v, pred), st_f32(addr, v)
    red_add_f32(addr, v)          red.global.add.f32 (relaxed, gpu scope)
    red_add_f32_pred(addr, v, p)  the same under a predicate
    atom_add_u32(addr, v) -> old  atom.global.acq_rel.gpu.add.u32
    fence_gpu()                   fence.acq_rel.gpu
"""

from __future__ import annotations

from cutlass import Float32, Int32, Int64, Uint32
from cutlass._mlir import ir
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

__all__ = ["ld_stream_v4", "ld_stream_v2", "ld_cached_v4", "ld_cg_f32", "ld_f32",
           "ld_dep_v4", "ld_dep_f32", "ld_dep_u16", "ld_dep_u32", "ld_nc_v4", "ld_dep_v4u",
           "cp_async_16", "cp_async_8", "ld_shared_v4", "ld_shared_v2", "ld_shared_v4_pred",
           "st_shared_v4", "grid_dep_launch", "grid_dep_wait", "opaque64", "opaque32", "prefetch_l2_bulk", "prmt", "mul_bf16x2",
           "mma_bf16_16816", "cvt_bf16x2", "st_u16", "st_u32", "st_f32", "red_add_f32", "red_add_f32_pred",
           "atom_add_u32", "fence_gpu"]


def _struct(n: int, elt: str) -> ir.Type:
    return ir.Type.parse("!llvm.struct<(" + ",".join([elt] * n) + ")>")


def _asm(ret, operands, text, cons, effects=False, loc=None, ip=None):
    return llvm.inline_asm(ret, operands, text, cons, has_side_effects=effects,
                           is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
                           loc=loc, ip=ip)


def _unpack(st, n: int, cls, ty, loc=None, ip=None):
    return tuple(cls(llvm.extractvalue(ty, st, [i], loc=loc, ip=ip)) for i in range(n))


def _i64(v, loc=None, ip=None):
    return Int64(v).ir_value(loc=loc, ip=ip)


def _u32(v, loc=None, ip=None):
    return Uint32(v).ir_value(loc=loc, ip=ip)


def _f32(v, loc=None, ip=None):
    return Float32(v).ir_value(loc=loc, ip=ip)


@dsl_user_op
def ld_stream_v4(addr, *, loc=None, ip=None) -> tuple:
    st = _asm(_struct(4, "i32"), [_i64(addr, loc, ip)],
              "ld.global.nc.L1::no_allocate.v4.u32 {$0,$1,$2,$3}, [$4];",
              "=r,=r,=r,=r,l", loc=loc, ip=ip)
    return _unpack(st, 4, Uint32, T.i32(), loc, ip)


@dsl_user_op
def ld_stream_v2(addr, *, loc=None, ip=None) -> tuple:
    st = _asm(_struct(2, "i32"), [_i64(addr, loc, ip)],
              "ld.global.nc.L1::no_allocate.v2.u32 {$0,$1}, [$2];",
              "=r,=r,l", loc=loc, ip=ip)
    return _unpack(st, 2, Uint32, T.i32(), loc, ip)


@dsl_user_op
def ld_cached_v4(addr, pred, *, loc=None, ip=None) -> tuple:
    st = _asm(_struct(4, "i32"), [_i64(addr, loc, ip), Int32(pred).ir_value(loc=loc, ip=ip)],
              "{\n .reg .pred p;\n setp.ne.b32 p, $5, 0;\n"
              " mov.b32 $0, 0;\n mov.b32 $1, 0;\n mov.b32 $2, 0;\n mov.b32 $3, 0;\n"
              " @p ld.global.nc.v4.u32 {$0,$1,$2,$3}, [$4];\n}",
              "=&r,=&r,=&r,=&r,l,r", loc=loc, ip=ip)
    return _unpack(st, 4, Uint32, T.i32(), loc, ip)


@dsl_user_op
def ld_dep_v4(addr, pred, *, loc=None, ip=None) -> tuple:
    st = _asm(_struct(4, "i32"), [_i64(addr, loc, ip), Int32(pred).ir_value(loc=loc, ip=ip)],
              "{\n .reg .pred p;\n setp.ne.b32 p, $5, 0;\n"
              " mov.b32 $0, 0;\n mov.b32 $1, 0;\n mov.b32 $2, 0;\n mov.b32 $3, 0;\n"
              " @p ld.global.v4.u32 {$0,$1,$2,$3}, [$4];\n}",
              "=&r,=&r,=&r,=&r,l,r", loc=loc, ip=ip)
    return _unpack(st, 4, Uint32, T.i32(), loc, ip)


@dsl_user_op
def ld_nc_v4(addr, *, loc=None, ip=None) -> tuple:
    st = _asm(_struct(4, "i32"), [_i64(addr, loc, ip)],
              "ld.global.nc.v4.u32 {$0,$1,$2,$3}, [$4];", "=r,=r,=r,=r,l", loc=loc, ip=ip)
    return _unpack(st, 4, Uint32, T.i32(), loc, ip)


@dsl_user_op
def ld_dep_v4u(addr, *, loc=None, ip=None) -> tuple:
    st = _asm(_struct(4, "i32"), [_i64(addr, loc, ip)],
              "ld.global.v4.u32 {$0,$1,$2,$3}, [$4];", "=r,=r,=r,=r,l", loc=loc, ip=ip)
    return _unpack(st, 4, Uint32, T.i32(), loc, ip)


@dsl_user_op
def ld_dep_f32(addr, *, loc=None, ip=None) -> Float32:
    return Float32(_asm(T.f32(), [_i64(addr, loc, ip)], "ld.global.f32 $0, [$1];", "=f,l",
                        loc=loc, ip=ip))


@dsl_user_op
def ld_dep_u16(addr, *, loc=None, ip=None) -> Uint32:
    return Uint32(_asm(T.i32(), [_i64(addr, loc, ip)], "ld.global.u16 $0, [$1];", "=r,l",
                       loc=loc, ip=ip))


@dsl_user_op
def ld_dep_u32(addr, *, loc=None, ip=None) -> Uint32:
    return Uint32(_asm(T.i32(), [_i64(addr, loc, ip)], "ld.global.u32 $0, [$1];", "=r,l",
                       loc=loc, ip=ip))


@dsl_user_op
def ld_cg_f32(addr, *, loc=None, ip=None) -> Float32:
    return Float32(_asm(T.f32(), [_i64(addr, loc, ip)], "ld.global.cg.f32 $0, [$1];", "=f,l",
                        effects=True, loc=loc, ip=ip))


@dsl_user_op
def ld_f32(addr, *, loc=None, ip=None) -> Float32:
    return Float32(_asm(T.f32(), [_i64(addr, loc, ip)], "ld.global.nc.f32 $0, [$1];", "=f,l",
                        loc=loc, ip=ip))


@dsl_user_op
def cp_async_16(saddr, gaddr, *, loc=None, ip=None) -> None:
    _asm(None, [Int32(saddr).ir_value(loc=loc, ip=ip), _i64(gaddr, loc, ip)],
         "cp.async.cg.shared.global [$0], [$1], 16;", "r,l,~{memory}", effects=True,
         loc=loc, ip=ip)


@dsl_user_op
def cp_async_8(saddr, gaddr, *, loc=None, ip=None) -> None:
    # .cg only takes 16 bytes; .ca (L1-allocating) for the 8-byte scale vectors
    _asm(None, [Int32(saddr).ir_value(loc=loc, ip=ip), _i64(gaddr, loc, ip)],
         "cp.async.ca.shared.global [$0], [$1], 8;", "r,l,~{memory}", effects=True,
         loc=loc, ip=ip)


@dsl_user_op
def ld_shared_v4(saddr, *, loc=None, ip=None) -> tuple:
    st = _asm(_struct(4, "i32"), [Int32(saddr).ir_value(loc=loc, ip=ip)],
              "ld.shared.v4.u32 {$0,$1,$2,$3}, [$4];", "=r,=r,=r,=r,r,~{memory}",
              effects=True, loc=loc, ip=ip)
    return _unpack(st, 4, Uint32, T.i32(), loc, ip)


@dsl_user_op
def ld_shared_v2(saddr, *, loc=None, ip=None) -> tuple:
    st = _asm(_struct(2, "i32"), [Int32(saddr).ir_value(loc=loc, ip=ip)],
              "ld.shared.v2.u32 {$0,$1}, [$2];", "=r,=r,r,~{memory}", effects=True,
              loc=loc, ip=ip)
    return _unpack(st, 2, Uint32, T.i32(), loc, ip)


@dsl_user_op
def ld_shared_v4_pred(saddr, pred, *, loc=None, ip=None) -> tuple:
    st = _asm(_struct(4, "i32"), [Int32(saddr).ir_value(loc=loc, ip=ip),
                                  Int32(pred).ir_value(loc=loc, ip=ip)],
              "{\n .reg .pred p;\n setp.ne.b32 p, $5, 0;\n"
              " mov.b32 $0, 0;\n mov.b32 $1, 0;\n mov.b32 $2, 0;\n mov.b32 $3, 0;\n"
              " @p ld.shared.v4.u32 {$0,$1,$2,$3}, [$4];\n}",
              "=&r,=&r,=&r,=&r,r,r,~{memory}", effects=True, loc=loc, ip=ip)
    return _unpack(st, 4, Uint32, T.i32(), loc, ip)


@dsl_user_op
def st_shared_v4(saddr, w0, w1, w2, w3, *, loc=None, ip=None) -> None:
    _asm(None, [Int32(saddr).ir_value(loc=loc, ip=ip)] + [_u32(w, loc, ip) for w in (w0, w1, w2, w3)],
         "st.shared.v4.u32 [$0], {$1,$2,$3,$4};", "r,r,r,r,r,~{memory}", effects=True,
         loc=loc, ip=ip)


@dsl_user_op
def opaque64(*vals, loc=None, ip=None) -> tuple:
    n = len(vals)
    body = "".join(f"\n mov.b64 ${i}, ${n + i};" for i in range(n))
    cons = ",".join(["=l"] * n + ["l"] * n)
    st = _asm(_struct(n, "i64"), [_i64(a, loc, ip) for a in vals], "{" + body + "\n}", cons,
              effects=True, loc=loc, ip=ip)
    return _unpack(st, n, Int64, T.i64(), loc, ip)


@dsl_user_op
def opaque32(*vals, loc=None, ip=None) -> tuple:
    n = len(vals)
    body = "".join(f"\n mov.b32 ${i}, ${n + i};" for i in range(n))
    cons = ",".join(["=r"] * n + ["r"] * n)
    st = _asm(_struct(n, "i32"), [Int32(a).ir_value(loc=loc, ip=ip) for a in vals],
              "{" + body + "\n}", cons, effects=True, loc=loc, ip=ip)
    return _unpack(st, n, Int32, T.i32(), loc, ip)


@dsl_user_op
def grid_dep_launch(*, loc=None, ip=None) -> None:
    _asm(None, [], "griddepcontrol.launch_dependents;", "~{memory}", effects=True, loc=loc, ip=ip)


@dsl_user_op
def grid_dep_wait(*addrs, loc=None, ip=None) -> tuple:
    """griddepcontrol.wait; returns the 64-bit addresses unchanged but data-dependent on it."""
    n = len(addrs)
    body = "griddepcontrol.wait;" + "".join(f"\n mov.b64 ${i}, ${n + i};" for i in range(n))
    cons = ",".join(["=l"] * n + ["l"] * n + ["~{memory}"])
    st = _asm(_struct(n, "i64"), [_i64(a, loc, ip) for a in addrs], "{\n" + body + "\n}",
              cons, effects=True, loc=loc, ip=ip)
    return _unpack(st, n, Int64, T.i64(), loc, ip)


@dsl_user_op
def prefetch_l2_bulk(gaddr, nbytes: int, pred, *, loc=None, ip=None) -> None:
    """One thread asks the copy engine to pull nbytes (multiple of 16) into L2."""
    _asm(None, [_i64(gaddr, loc, ip), Int32(pred).ir_value(loc=loc, ip=ip)],
         "{\n .reg .pred p;\n setp.ne.b32 p, $1, 0;\n"
         f" @p cp.async.bulk.prefetch.L2.global [$0], {int(nbytes)};\n}}",
         "l,r", effects=True, loc=loc, ip=ip)


@dsl_user_op
def prmt(a, b, sel: int, *, loc=None, ip=None) -> Uint32:
    return Uint32(_asm(T.i32(), [_u32(a, loc, ip), _u32(b, loc, ip)],
                       f"prmt.b32 $0, $1, $2, {int(sel)};", "=r,r,r", loc=loc, ip=ip))


@dsl_user_op
def mul_bf16x2(a, b, *, loc=None, ip=None) -> Uint32:
    return Uint32(_asm(T.i32(), [_u32(a, loc, ip), _u32(b, loc, ip)],
                       "mul.rn.bf16x2 $0, $1, $2;", "=r,r,r", loc=loc, ip=ip))


@dsl_user_op
def mma_bf16_16816(a, b, c, *, loc=None, ip=None) -> tuple:
    """a: 4 x Uint32 (bf16x2), b: 2 x Uint32, c: 4 x Float32 -> 4 x Float32 (d = a b + c)."""
    ops = ([_u32(v, loc, ip) for v in a] + [_u32(v, loc, ip) for v in b]
           + [_f32(v, loc, ip) for v in c])
    st = _asm(_struct(4, "f32"), ops,
              "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
              "{$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, {$10,$11,$12,$13};",
              "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", loc=loc, ip=ip)
    return _unpack(st, 4, Float32, T.f32(), loc, ip)


@dsl_user_op
def cvt_bf16x2(lo, hi, *, loc=None, ip=None) -> Uint32:
    return Uint32(_asm(T.i32(), [_f32(hi, loc, ip), _f32(lo, loc, ip)],
                       "cvt.rn.bf16x2.f32 $0, $1, $2;", "=r,f,f", loc=loc, ip=ip))


@dsl_user_op
def st_u16(addr, v, pred, *, loc=None, ip=None) -> None:
    """Store the low 16 bits of v when pred != 0."""
    _asm(None, [_i64(addr, loc, ip), _u32(v, loc, ip), Int32(pred).ir_value(loc=loc, ip=ip)],
         "{\n .reg .pred p;\n .reg .b16 h;\n setp.ne.b32 p, $2, 0;\n"
         " cvt.u16.u32 h, $1;\n @p st.global.b16 [$0], h;\n}",
         "l,r,r", effects=True, loc=loc, ip=ip)


@dsl_user_op
def st_u32(addr, v, pred, *, loc=None, ip=None) -> None:
    _asm(None, [_i64(addr, loc, ip), _u32(v, loc, ip), Int32(pred).ir_value(loc=loc, ip=ip)],
         "{\n .reg .pred p;\n setp.ne.b32 p, $2, 0;\n @p st.global.b32 [$0], $1;\n}",
         "l,r,r", effects=True, loc=loc, ip=ip)


@dsl_user_op
def st_f32(addr, v, *, loc=None, ip=None) -> None:
    _asm(None, [_i64(addr, loc, ip), _f32(v, loc, ip)], "st.global.f32 [$0], $1;", "l,f",
         effects=True, loc=loc, ip=ip)


@dsl_user_op
def red_add_f32(addr, v, *, loc=None, ip=None) -> None:
    _asm(None, [_i64(addr, loc, ip), _f32(v, loc, ip)], "red.global.add.f32 [$0], $1;", "l,f",
         effects=True, loc=loc, ip=ip)


@dsl_user_op
def red_add_f32_pred(addr, v, pred, *, loc=None, ip=None) -> None:
    """red.global.add.f32 when pred != 0."""
    _asm(None, [_i64(addr, loc, ip), _f32(v, loc, ip), Int32(pred).ir_value(loc=loc, ip=ip)],
         "{\n .reg .pred p;\n setp.ne.b32 p, $2, 0;\n @p red.global.add.f32 [$0], $1;\n}",
         "l,f,r", effects=True, loc=loc, ip=ip)


@dsl_user_op
def atom_add_u32(addr, v, *, loc=None, ip=None) -> Uint32:
    return Uint32(_asm(T.i32(), [_i64(addr, loc, ip), _u32(v, loc, ip)],
                       "atom.global.acq_rel.gpu.add.u32 $0, [$1], $2;", "=r,l,r,~{memory}",
                       effects=True, loc=loc, ip=ip))


@dsl_user_op
def fence_gpu(*, loc=None, ip=None) -> None:
    _asm(None, [], "fence.acq_rel.gpu;", "~{memory}", effects=True, loc=loc, ip=ip)
