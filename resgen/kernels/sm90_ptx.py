"""Inline PTX for sm_90a and later (CuTe DSL, trace time): the one module whose functions emit
`llvm.inline_asm`, shared by every Hopper family; resgen.kernels.sm100_ptx adds the Blackwell
instructions on top of it (tests/test_family_modules.py checks that no other module emits
inline PTX).

Each function emits one PTX instruction (or a tiny braced block) through `_asm` and returns
DSL scalars. Addresses are raw 64-bit generic/global addresses (`Int64`) or 32-bit
shared-window addresses (`Int32`); alignment is the caller's promise. Pure instructions are
emitted without side effects (the compiler may schedule, CSE or drop them); loads of
read-only kernel inputs are pure; stores, reductions, atomics, fences and loads of data other
threads write are not.

Two calling conventions, both emitting through `_asm`:
- DSL ops (`@dsl_user_op`, source locations threaded; predicates are integers, `!= 0` = on):
  what the linear families' templates call;
- plain trace-time functions (predicates are DSL Booleans, `*_if` names): what
  resgen.kernels.fp4_device builds the FP4 math from and the attention kernels call.

Global memory, loads
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
    ld_cg_v4_f32(addr)            ld.global.cg.v4.f32 (split-K slots, after the semaphore's
                                  acquire)
    ld_f32(addr)                  ld.global.nc.f32 (kernel-constant scalars)
    ld_global_v4(addr, l1=False)  ld.global.nc[.L1::no_allocate].v4.b32 (plain; l1=True keeps
                                  the line in L1 for a second load of the same sectors)
    ld_global_u32 / ld_global_s32 / ld_global_u16 / ld_global_u8(addr)   ld.global.nc scalars
                                  (plain; sub-word loads zero-extended)
    ld_nc_bytes(addr, nbytes)     1..32 bytes read once (L1::no_allocate) as 32-bit words (plain)
Global memory, stores and atomics
    st_u16(addr, v, pred), st_u32(addr, v, pred), st_f32(addr, v)
    st_v4_f32(addr, v0, v1, v2, v3)   st.global.v4.f32 (split-K workspace slot)
    red_add_f32(addr, v)          red.global.add.f32 (relaxed, gpu scope)
    red_add_f32_pred(addr, v, p)  the same under a predicate
    atom_add_u32(addr, v) -> old  atom.global.acq_rel.gpu.add.u32
    st_global_v4 / st_global_v2 / st_global_u32 / st_global_u16 / st_global_u8(addr, w..,
                                  pred=None)   plain stores of the low bits of w, predicated on
                                  an optional DSL Boolean (PTX predication, no branch)
    st_global_s32(addr, v)        st.global.b32 of an Int32 (plain)
    st_f32_if(pred, addr, v), st_u32_if(pred, addr, v), st_bytes_if(pred, addr, w, nbytes)
                                  plain predicated stores (the low nbytes = 1, 2, 4 of w)
    atom_add_s32(addr, v) -> old  atom.acq_rel.gpu.global.add.s32 (plain)
Shared memory
    ld_shared_v4(saddr), ld_shared_v2(saddr)   ordered after cp.async.wait_group (side effects)
    ld_shared_v4_pred(saddr, pred)  the same under a predicate, zeros when off
    ld_shared_u32(saddr)          ld.shared.u32 (a scale word)
    st_shared_v4(saddr, w0, w1, w2, w3)        st.shared.v4.u32 (ordered before a barrier)
    lds_u32 / lds_u16 / lds_f32(saddr), sts_u32 / sts_f32(saddr, v),
    sts_u32_if / sts_f32_if(pred, saddr, v)    plain shared-memory scalars (side effects, no
                                  memory clobber: they are ordered among themselves)
Asynchronous copies and mbarriers
    cp_async_16(saddr, gaddr)     cp.async.cg.shared.global 16 bytes (L2 only), cp_async_8 (.ca, 8)
    prefetch_l2_bulk(gaddr, nbytes, pred)     cp.async.bulk.prefetch.L2.global when pred != 0
    bulk_g2s(sdst, gsrc, nbytes, mbar)   cp.async.bulk global -> shared, completing `nbytes`
                                  transaction bytes on the mbarrier at `mbar`
    wait_parity(mbar, parity, label="WG")   mbarrier.try_wait.parity loop; traps if the wait
                                  lasts more than WATCHDOG_NS (a protocol bug becomes a launch
                                  error instead of a hung process)
Thread-block clusters (distributed shared memory)
    mapa_cluster(saddr, rank) -> caddr     mapa.shared::cluster.u32: the same shared-memory
                                  location in CTA `rank` of the cluster
    st_cluster_v4(caddr, w0, w1, w2, w3)   st.shared::cluster.v4.u32 into a peer's shared memory
                                  (ordered before barrier.cluster.arrive's release)
    cluster_rank()                %cluster_ctarank
    cluster_start_arrive()        barrier.cluster.arrive.relaxed: the "this CTA runs" phase a
                                  kernel waits on before its first remote store
    cluster_sync_arrive(), cluster_sync_wait()   barrier.cluster.arrive.release /
                                  barrier.cluster.wait.acquire (every thread of every CTA)
Ordering, PDL, warp exchange
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
    fence_gpu(memory_clobber=True)   fence.acq_rel.gpu
    shfl_xor4(v)                  shfl.sync.bfly by 4 lanes (the partner lane g ^ 1)
Integer and byte operations
    prmt(a, b, sel, hex_imm=False)   byte permute, immediate selector; prmt_r(a, b, sel) with a
                                  run-time selector; prmt_zero(a, sel) with a zero second word
    max_u32(a, b), max_u32_imm(a, imm)
Exact FP32 arithmetic (plain; explicit rounding, no .ftz: IEEE results, subnormals kept, and
ptxas never contracts an explicitly rounded mul/add pair into an FMA)
    div_rn, mul_rn, add_rn, sub_rn(a, b), fma_rn(a, b, c), rcp_rn(a), fabs(a), fmin, fmax(a, b)
    ex2_approx(x)                 ex2.approx.ftz.f32 (-inf -> +0)
Packed BF16 / FP16
    mul_bf16x2(a, b)              mul.rn.bf16x2 (no .ftz exists for bf16: subnormals kept)
    mul_f16x2(a, b)               mul.rn.f16x2 (no .ftz: FP16 subnormal inputs and results kept)
    cvt_bf16x2(lo, hi), cvt_f16x2(lo, hi)   cvt.rn.{bf16x2,f16x2}.f32 (lo in the low half)
    pack_bf16x2(lo, hi), pack_f16x2(lo, hi)  the same conversions, plain, operands passed lo first
    max_xorsign_abs_bf16x2(a, b)  max.xorsign.abs.bf16x2 (pairwise max of magnitudes; plain)
    f32_of_f16_lo(v)              cvt.f32.f16 of the low half (plain)
FP8 / E8M0 conversions (plain unless marked)
    e4m3x2_to_f16x2(v)            two E4M3 bytes (low 16 bits) -> f16x2, exact
    f16x2_to_e4m3x2(v)            f16x2 -> two E4M3 bytes, RNE, satfinite
    f32x2_to_e4m3x2(lo, hi)       two FP32 -> two E4M3 bytes, RNE, satfinite
    f32_to_e4m3x2(v)              one FP32 -> its E4M3 byte in both bytes, RNE, satfinite
    e2m1x8_to_e4m3x8(w, lut_lo, lut_hi, sign_pool, mag_mask, sign_bits)   DSL op: 8 packed E2M1
                                  codes -> two words of E4M3 bytes through prmt table lookups
                                  (the tables and the method: resgen.kernels.
                                  linear_sm90_fp8_convert, which passes them)
    e8m0x4_to_f32(w, zero_bits)   DSL op: four E8M0 bytes -> the float32 bits of 2^(b - 127)
                                  (byte 0 -> zero_bits)
Tensor-core MMA (mma.sync, FP32 accumulators)
    mma_bf16_16816(a, b, c)       m16n8k16.row.col.f32.bf16.bf16.f32
    mma_f16_16816(a, b, c)        m16n8k16.row.col.f32.f16.f16.f32
    mma_e4m3_16832(a, b, c)       m16n8k32.row.col.f32.e4m3.e4m3.f32 (plain, returns a list)

Forms kept apart. A few instructions are emitted in two spellings: prmt's selector in decimal
(DSL op) or hex (`hex_imm`, fp4_device's and attention_sm90's); cvt_* and pack_* pass the
same two operands in opposite orders, which numbers PTX registers differently; fence_gpu
without the memory clobber is attention_sm90's; the plain loads and stores differ from the DSL
ops in their predicate convention. Each stored kernel's PTX contains its form and the tuned
table is fingerprinted on it, so they stay until the families that use them are re-tuned.
"""

from __future__ import annotations

from cutlass import Float32, Int32, Int64, Uint32
from cutlass._mlir import ir
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op, select_

__all__ = ["ld_stream_v4", "ld_stream_v2", "ld_cached_v4", "ld_cg_f32", "ld_cg_v4_f32", "ld_f32",
           "ld_dep_v4", "ld_dep_f32", "ld_dep_u16", "ld_dep_u32", "ld_nc_v4", "ld_dep_v4u",
           "ld_global_v4", "ld_global_u32", "ld_global_s32", "ld_global_u16", "ld_global_u8",
           "ld_nc_bytes",
           "st_u16", "st_u32", "st_f32", "st_v4_f32", "red_add_f32", "red_add_f32_pred",
           "atom_add_u32", "st_global_v4", "st_global_v2", "st_global_u32", "st_global_u16",
           "st_global_u8", "st_global_s32", "st_f32_if", "st_u32_if", "st_bytes_if",
           "atom_add_s32",
           "ld_shared_v4", "ld_shared_v2", "ld_shared_v4_pred", "ld_shared_u32", "st_shared_v4",
           "lds_u32", "lds_u16", "lds_f32", "sts_u32", "sts_f32", "sts_u32_if", "sts_f32_if",
           "cp_async_16", "cp_async_8", "prefetch_l2_bulk", "bulk_g2s", "wait_parity",
           "WATCHDOG_NS",
           "mapa_cluster", "st_cluster_v4", "cluster_rank", "cluster_start_arrive",
           "cluster_sync_arrive", "cluster_sync_wait",
           "opaque64", "opaque32", "grid_dep_launch", "grid_dep_wait", "fence_gpu", "shfl_xor4",
           "prmt", "prmt_r", "prmt_zero", "max_u32", "max_u32_imm",
           "div_rn", "mul_rn", "add_rn", "sub_rn", "fma_rn", "rcp_rn", "fabs", "fmin", "fmax",
           "ex2_approx",
           "mul_bf16x2", "mul_f16x2", "cvt_bf16x2", "cvt_f16x2", "pack_bf16x2", "pack_f16x2",
           "max_xorsign_abs_bf16x2", "f32_of_f16_lo",
           "e4m3x2_to_f16x2", "f16x2_to_e4m3x2", "f32x2_to_e4m3x2", "f32_to_e4m3x2",
           "e2m1x8_to_e4m3x8", "e8m0x4_to_f32",
           "mma_bf16_16816", "mma_f16_16816", "mma_e4m3_16832"]

WATCHDOG_NS = 2_000_000_000      # 2 s: every mbarrier wait of these kernels is over in us


# ----------------------------------------------------------------------------- emission


def _asm(ret, operands, text, cons, effects=False, loc=None, ip=None):
    """The one llvm.inline_asm call: ret None (no result), an LLVM type or a struct of them;
    operands: MLIR values; effects: never removed, merged or moved across other effects."""
    return llvm.inline_asm(ret, operands, text, cons, has_side_effects=effects,
                           is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
                           loc=loc, ip=ip)


def _struct(n: int, elt: str) -> ir.Type:
    return ir.Type.parse("!llvm.struct<(" + ",".join([elt] * n) + ")>")


def _unpack(st, n: int, cls, ty, loc=None, ip=None):
    return tuple(cls(llvm.extractvalue(ty, st, [i], loc=loc, ip=ip)) for i in range(n))


# DSL ops: operand -> MLIR value
def _i64(v, loc=None, ip=None):
    return Int64(v).ir_value(loc=loc, ip=ip)


def _u32(v, loc=None, ip=None):
    return Uint32(v).ir_value(loc=loc, ip=ip)


def _f32(v, loc=None, ip=None):
    return Float32(v).ir_value(loc=loc, ip=ip)


def _i32(v, loc=None, ip=None):
    return Int32(v).ir_value(loc=loc, ip=ip)


# plain functions: operand -> DSL scalar (also resgen.kernels.fp4_device's coercions)
def _as_u32(v) -> Uint32:
    return v if isinstance(v, Uint32) else Uint32(v)


def _as_f32(v) -> Float32:
    return v if isinstance(v, Float32) else Float32(v)


def _as_i32(v) -> Int32:
    return v if isinstance(v, Int32) else Int32(v)


def _as_i64(a) -> Int64:
    return a if isinstance(a, Int64) else Int64(a)


def _pure(ret_type, template: str, constraints: str, *operands):
    """A plain pure instruction (DSL scalar operands); the compiler may CSE or move it."""
    return _asm(ret_type, [o.ir_value() for o in operands], template, constraints)


def _effect(template: str, constraints: str, *operands) -> None:
    """A plain instruction with side effects and no result (stores, fences)."""
    _asm(None, [o.ir_value() for o in operands], template, constraints, effects=True)


def _volatile(ret_type, template: str, constraints: str, *operands):
    """A plain value-returning instruction that must not be moved or merged (atomics, loads
    of data other threads write)."""
    return _asm(ret_type, [o.ir_value() for o in operands], template, constraints, effects=True)


def _flag(pred) -> Uint32:
    """A DSL Boolean as 1 / 0 (a predicate operand of the plain functions)."""
    return _as_u32(select_(pred, Uint32(1), Uint32(0)))


# ----------------------------------------------------------------------------- global loads


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
def ld_cg_v4_f32(gaddr, *, loc=None, ip=None) -> tuple:
    st = _asm(_struct(4, "f32"), [Int64(gaddr).ir_value(loc=loc, ip=ip)],
              "ld.global.cg.v4.f32 {$0, $1, $2, $3}, [$4];", "=f,=f,=f,=f,l,~{memory}",
              effects=True, loc=loc, ip=ip)
    return _unpack(st, 4, Float32, T.f32(), loc, ip)


@dsl_user_op
def ld_f32(addr, *, loc=None, ip=None) -> Float32:
    return Float32(_asm(T.f32(), [_i64(addr, loc, ip)], "ld.global.nc.f32 $0, [$1];", "=f,l",
                        loc=loc, ip=ip))


def ld_global_v4(addr, l1: bool = False) -> tuple[Uint32, Uint32, Uint32, Uint32]:
    """16-byte load through the read-only path (addr 16-byte aligned).

    l1=False: L1::no_allocate (the bytes are used once). l1=True: cached in L1, for access
    patterns where a second load reads the other half of the same 32-byte sectors (lanes 32
    bytes apart), which would otherwise fetch every sector from L2 twice."""
    hint = "" if l1 else ".L1::no_allocate"
    r = _asm(_struct(4, "i32"), [_as_i64(addr).ir_value()],
             f"ld.global.nc{hint}.v4.b32 {{$0, $1, $2, $3}}, [$4];", "=r,=r,=r,=r,l")
    return _unpack(r, 4, Uint32, T.i32())


def ld_global_u32(addr) -> Uint32:
    return Uint32(_pure(T.i32(), "ld.global.nc.b32 $0, [$1];", "=r,l", _as_i64(addr)))


def ld_global_s32(addr) -> Int32:
    return Int32(_pure(T.i32(), "ld.global.nc.b32 $0, [$1];", "=r,l", _as_i64(addr)))


def ld_global_u16(addr) -> Uint32:
    """Zero-extended 16-bit load."""
    return Uint32(_pure(T.i32(), "ld.global.nc.u16 $0, [$1];", "=r,l", _as_i64(addr)))


def ld_global_u8(addr) -> Uint32:
    """Zero-extended 8-bit load."""
    return Uint32(_pure(T.i32(), "ld.global.nc.u8 $0, [$1];", "=r,l", _as_i64(addr)))


def ld_nc_bytes(addr, nbytes: int) -> list:
    """nbytes (1, 2, 4, 8, 16 or 32) from a global address aligned to min(nbytes, 16), read
    once (L1::no_allocate): ceil(nbytes / 4) Uint32 words (sub-word loads zero-extended into
    one word)."""
    a = _as_i64(addr)
    if nbytes == 1:
        return [Uint32(_pure(T.i32(), "ld.global.nc.L1::no_allocate.u8 $0, [$1];", "=r,l", a))]
    if nbytes == 2:
        return [Uint32(_pure(T.i32(), "ld.global.nc.L1::no_allocate.u16 $0, [$1];", "=r,l", a))]
    if nbytes == 4:
        return [Uint32(_pure(T.i32(), "ld.global.nc.L1::no_allocate.b32 $0, [$1];", "=r,l", a))]
    if nbytes == 8:
        r = _asm(_struct(2, "i32"), [a.ir_value()],
                 "ld.global.nc.L1::no_allocate.v2.b32 {$0, $1}, [$2];", "=r,=r,l")
        return list(_unpack(r, 2, Uint32, T.i32()))
    if nbytes == 16:
        return list(ld_global_v4(a))
    if nbytes == 32:
        return list(ld_global_v4(a)) + list(ld_global_v4(a + 16))
    raise ValueError(f"unsupported load size {nbytes}")


# ----------------------------------------------------------------------------- global stores


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
def st_v4_f32(gaddr, v0, v1, v2, v3, *, loc=None, ip=None) -> None:
    _asm(None, [Int64(gaddr).ir_value(loc=loc, ip=ip)]
         + [Float32(v).ir_value(loc=loc, ip=ip) for v in (v0, v1, v2, v3)],
         "st.global.v4.f32 [$0], {$1, $2, $3, $4};", "l,f,f,f,f,~{memory}", effects=True,
         loc=loc, ip=ip)


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


def _store(op: str, operands: str, addr, words, pred) -> None:
    """`op [addr], operands;` optionally predicated on a DSL Boolean (PTX predication, no branch)."""
    args = [_as_i64(addr)] + [_as_u32(w) for w in words]
    cons = "l" + ",r" * len(words)
    if pred is None:
        _effect(f"{op} [$0], {operands};", cons, *args)
    else:
        n = len(args)
        _effect(f"{{ .reg .pred p; setp.ne.b32 p, ${n}, 0; @p {op} [$0], {operands}; }}",
                cons + ",r", *args, Uint32(select_(pred, _as_u32(1), _as_u32(0))))


def st_global_v4(addr, w0, w1, w2, w3, pred=None) -> None:
    """16-byte store (addr 16-byte aligned); pred: optional Boolean, store only where true."""
    _store("st.global.v4.b32", "{$1, $2, $3, $4}", addr, (w0, w1, w2, w3), pred)


def st_global_v2(addr, w0, w1, pred=None) -> None:
    _store("st.global.v2.b32", "{$1, $2}", addr, (w0, w1), pred)


def st_global_u32(addr, w, pred=None) -> None:
    _store("st.global.b32", "$1", addr, (w,), pred)


def st_global_u16(addr, w, pred=None) -> None:
    """Stores the low 16 bits of w (PTX lets st take a wider register than its type)."""
    _store("st.global.b16", "$1", addr, (w,), pred)


def st_global_u8(addr, w, pred=None) -> None:
    """Stores the low 8 bits of w."""
    _store("st.global.b8", "$1", addr, (w,), pred)


def st_global_s32(addr, v) -> None:
    _effect("st.global.b32 [$0], $1;", "l,r", _as_i64(addr), _as_i32(v))


def st_f32_if(pred, addr, v) -> None:
    _effect("{ .reg .pred p; setp.ne.b32 p, $0, 0; @p st.global.f32 [$1], $2; }",
            "r,l,f", _flag(pred), _as_i64(addr), _as_f32(v))


def st_u32_if(pred, addr, v) -> None:
    _effect("{ .reg .pred p; setp.ne.b32 p, $0, 0; @p st.global.b32 [$1], $2; }",
            "r,l,r", _flag(pred), _as_i64(addr), _as_u32(v))


def st_bytes_if(pred, addr, w, nbytes: int) -> None:
    """Store the low nbytes (1, 2 or 4) of the word w when pred."""
    op = {1: "b8", 2: "b16", 4: "b32"}[nbytes]
    _effect(f"{{ .reg .pred p; setp.ne.b32 p, $0, 0; @p st.global.{op} [$1], $2; }}",
            "r,l,r", _flag(pred), _as_i64(addr), _as_u32(w))


def atom_add_s32(addr, v) -> Int32:
    """Atomic add at GPU scope with acquire-release semantics; returns the old value."""
    return Int32(_volatile(T.i32(), "atom.acq_rel.gpu.global.add.s32 $0, [$1], $2;", "=r,l,r",
                           _as_i64(addr), _as_i32(v)))


# ----------------------------------------------------------------------------- shared memory


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
def ld_shared_u32(saddr, *, loc=None, ip=None) -> Uint32:
    return Uint32(_asm(T.i32(), [_i32(saddr, loc, ip)], "ld.shared.u32 $0, [$1];",
                       "=r,r,~{memory}", effects=True, loc=loc, ip=ip))


@dsl_user_op
def st_shared_v4(saddr, w0, w1, w2, w3, *, loc=None, ip=None) -> None:
    _asm(None, [Int32(saddr).ir_value(loc=loc, ip=ip)] + [_u32(w, loc, ip) for w in (w0, w1, w2, w3)],
         "st.shared.v4.u32 [$0], {$1,$2,$3,$4};", "r,r,r,r,r,~{memory}", effects=True,
         loc=loc, ip=ip)


def lds_u32(addr) -> Uint32:
    return Uint32(_volatile(T.i32(), "ld.shared.b32 $0, [$1];", "=r,r", _as_i32(addr)))


def lds_u16(addr) -> Uint32:
    return Uint32(_volatile(T.i32(), "ld.shared.u16 $0, [$1];", "=r,r", _as_i32(addr)))


def lds_f32(addr) -> Float32:
    return Float32(_volatile(T.f32(), "ld.shared.f32 $0, [$1];", "=f,r", _as_i32(addr)))


def sts_u32(addr, v) -> None:
    _effect("st.shared.b32 [$0], $1;", "r,r", _as_i32(addr), _as_u32(v))


def sts_f32(addr, v) -> None:
    _effect("st.shared.f32 [$0], $1;", "r,f", _as_i32(addr), _as_f32(v))


def sts_u32_if(pred, addr, v) -> None:
    _effect("{ .reg .pred p; setp.ne.b32 p, $0, 0; @p st.shared.b32 [$1], $2; }",
            "r,r,r", _flag(pred), _as_i32(addr), _as_u32(v))


def sts_f32_if(pred, addr, v) -> None:
    _effect("{ .reg .pred p; setp.ne.b32 p, $0, 0; @p st.shared.f32 [$1], $2; }",
            "r,r,f", _flag(pred), _as_i32(addr), _as_f32(v))


# ----------------------------------------------------------------------------- async copies


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
def prefetch_l2_bulk(gaddr, nbytes: int, pred, *, loc=None, ip=None) -> None:
    """One thread asks the copy engine to pull nbytes (multiple of 16) into L2."""
    _asm(None, [_i64(gaddr, loc, ip), Int32(pred).ir_value(loc=loc, ip=ip)],
         "{\n .reg .pred p;\n setp.ne.b32 p, $1, 0;\n"
         f" @p cp.async.bulk.prefetch.L2.global [$0], {int(nbytes)};\n}}",
         "l,r", effects=True, loc=loc, ip=ip)


@dsl_user_op
def bulk_g2s(sdst, gsrc, nbytes: int, mbar, *, loc=None, ip=None) -> None:
    """Copy nbytes (multiple of 16; both addresses 16-byte aligned) from global to shared
    memory with the copy engine; completion counts against the mbarrier's transaction bytes."""
    if nbytes % 16:
        raise ValueError("bulk copies move multiples of 16 bytes")
    _asm(None, [_i32(sdst, loc, ip), Int64(gsrc).ir_value(loc=loc, ip=ip), _i32(mbar, loc, ip)],
         "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes "
         f"[$0], [$1], {int(nbytes)}, [$2];",
         "r,l,r,~{memory}", effects=True, loc=loc, ip=ip)


@dsl_user_op
def wait_parity(mbar, parity, label: str = "WG", *, loc=None, ip=None) -> None:
    """Block until the phase of the mbarrier at shared address `mbar` (32-bit) with parity
    `parity` has completed (acquire, CTA scope); trap after WATCHDOG_NS of waiting.

    label: the prefix of the loop's two PTX labels. They are local to the braced block, so
    any name works; each family passes the one its stored kernels were compiled with ("WG":
    linear_sm90_mma, linear_sm90_wgmma; "F8": linear_sm90_fp8)."""
    _asm(None, [_i32(mbar, loc, ip), _i32(parity, loc, ip)],
         "{\n .reg .pred p;\n .reg .u64 t0, t1;\n"
         " mbarrier.try_wait.parity.shared::cta.b64 p, [$0], $1;\n"
         f" @p bra {label}_DONE;\n"
         " mov.u64 t0, %globaltimer;\n"
         f"{label}_RETRY:\n"
         " mbarrier.try_wait.parity.shared::cta.b64 p, [$0], $1;\n"
         f" @p bra {label}_DONE;\n"
         " mov.u64 t1, %globaltimer;\n"
         " sub.u64 t1, t1, t0;\n"
         f" setp.lt.u64 p, t1, {WATCHDOG_NS};\n"
         f" @p bra {label}_RETRY;\n"
         " trap;\n"
         f"{label}_DONE:\n}}",
         "r,r,~{memory}", effects=True, loc=loc, ip=ip)


# ----------------------------------------------------------------------------- clusters


@dsl_user_op
def mapa_cluster(saddr, rank, *, loc=None, ip=None) -> Int32:
    return Int32(_asm(T.i32(), [Int32(saddr).ir_value(loc=loc, ip=ip),
                                Int32(rank).ir_value(loc=loc, ip=ip)],
                      "mapa.shared::cluster.u32 $0, $1, $2;", "=r,r,r", loc=loc, ip=ip))


@dsl_user_op
def st_cluster_v4(caddr, w0, w1, w2, w3, *, loc=None, ip=None) -> None:
    _asm(None, [Int32(caddr).ir_value(loc=loc, ip=ip)]
         + [_u32(w, loc, ip) for w in (w0, w1, w2, w3)],
         "st.shared::cluster.v4.u32 [$0], {$1,$2,$3,$4};", "r,r,r,r,r,~{memory}", effects=True,
         loc=loc, ip=ip)


@dsl_user_op
def cluster_rank(*, loc=None, ip=None) -> Int32:
    return Int32(_asm(T.i32(), [], "mov.u32 $0, %cluster_ctarank;", "=r", loc=loc, ip=ip))


@dsl_user_op
def cluster_start_arrive(*, loc=None, ip=None) -> None:
    _asm(None, [], "barrier.cluster.arrive.relaxed;", "~{memory}", effects=True, loc=loc, ip=ip)


@dsl_user_op
def cluster_sync_arrive(*, loc=None, ip=None) -> None:
    _asm(None, [], "barrier.cluster.arrive.release;", "~{memory}", effects=True, loc=loc, ip=ip)


@dsl_user_op
def cluster_sync_wait(*, loc=None, ip=None) -> None:
    _asm(None, [], "barrier.cluster.wait.acquire;", "~{memory}", effects=True, loc=loc, ip=ip)


# ----------------------------------------------------------------------------- ordering


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
def fence_gpu(memory_clobber: bool = True, *, loc=None, ip=None) -> None:
    """fence.acq_rel.gpu. memory_clobber=False leaves out the asm's memory clobber, as the
    attention kernels (whose memory accesses are all side-effecting asm, ordered among
    themselves) were compiled."""
    _asm(None, [], "fence.acq_rel.gpu;", "~{memory}" if memory_clobber else "", effects=True,
         loc=loc, ip=ip)


@dsl_user_op
def shfl_xor4(v, *, loc=None, ip=None) -> Uint32:
    return Uint32(_asm(T.i32(), [Uint32(v).ir_value(loc=loc, ip=ip)],
                       "shfl.sync.bfly.b32 $0, $1, 4, 31, -1;", "=r,r", effects=True,
                       loc=loc, ip=ip))


# ----------------------------------------------------------------------------- integer


@dsl_user_op
def prmt(a, b, sel: int, hex_imm: bool = False, *, loc=None, ip=None) -> Uint32:
    """Byte permute with an immediate selector, written in decimal or (hex_imm) hex: the same
    instruction, two spellings of the stored kernels' PTX (see "Forms kept apart")."""
    imm = f"{sel:#x}" if hex_imm else f"{int(sel)}"
    return Uint32(_asm(T.i32(), [_u32(a, loc, ip), _u32(b, loc, ip)],
                       f"prmt.b32 $0, $1, $2, {imm};", "=r,r,r", loc=loc, ip=ip))


@dsl_user_op
def prmt_r(a, b, sel, *, loc=None, ip=None) -> Uint32:
    return Uint32(_asm(T.i32(), [Uint32(a).ir_value(loc=loc, ip=ip),
                                 Uint32(b).ir_value(loc=loc, ip=ip),
                                 Uint32(sel).ir_value(loc=loc, ip=ip)],
                       "prmt.b32 $0, $1, $2, $3;", "=r,r,r,r", loc=loc, ip=ip))


def prmt_zero(a, selector: int) -> Uint32:
    """prmt with a zero second operand (bytes 4..7 read as 0)."""
    return Uint32(_pure(T.i32(), f"prmt.b32 $0, $1, 0, {selector:#x};", "=r,r", _as_u32(a)))


def max_u32(a, b) -> Uint32:
    return Uint32(_pure(T.i32(), "max.u32 $0, $1, $2;", "=r,r,r", _as_u32(a), _as_u32(b)))


def max_u32_imm(a, imm: int) -> Uint32:
    return Uint32(_pure(T.i32(), f"max.u32 $0, $1, {int(imm)};", "=r,r", _as_u32(a)))


# ----------------------------------------------------------------------------- FP32


def _f32_op(instr: str, a, b) -> Float32:
    return Float32(_pure(T.f32(), f"{instr} $0, $1, $2;", "=f,f,f", _as_f32(a), _as_f32(b)))


def div_rn(a, b) -> Float32:
    """IEEE a / b, round to nearest even, subnormals kept (div.rn.f32)."""
    return _f32_op("div.rn.f32", a, b)


def rcp_rn(a) -> Float32:
    """IEEE 1 / a, round to nearest even (rcp.rn.f32: MUFU.RCP plus one correction on sm_90).

    Note: its slow-path subroutine saves a register on the stack; in register-heavy kernels
    ptxas then spills around it, which div_rn(1.0, a) (what block_quotients uses) avoids."""
    return Float32(_pure(T.f32(), "rcp.rn.f32 $0, $1;", "=f,f", _as_f32(a)))


def mul_rn(a, b) -> Float32:
    """IEEE a * b (mul.rn.f32): never fused with a following add."""
    return _f32_op("mul.rn.f32", a, b)


def add_rn(a, b) -> Float32:
    return _f32_op("add.rn.f32", a, b)


def sub_rn(a, b) -> Float32:
    return _f32_op("sub.rn.f32", a, b)


def fma_rn(a, b, c) -> Float32:
    """a * b + c with one rounding (fma.rn.f32)."""
    return Float32(_pure(T.f32(), "fma.rn.f32 $0, $1, $2, $3;", "=f,f,f,f",
                         _as_f32(a), _as_f32(b), _as_f32(c)))


def fabs(a) -> Float32:
    """|a| (clears the sign bit; ptxas folds it into the consumer's operand)."""
    return Float32(_pure(T.f32(), "abs.f32 $0, $1;", "=f,f", _as_f32(a)))


def fmin(a, b) -> Float32:
    return _f32_op("min.f32", a, b)


def fmax(a, b) -> Float32:
    return _f32_op("max.f32", a, b)


def ex2_approx(x) -> Float32:
    return Float32(_pure(T.f32(), "ex2.approx.ftz.f32 $0, $1;", "=f,f", _as_f32(x)))


# ----------------------------------------------------------------------------- packed 16-bit


@dsl_user_op
def mul_bf16x2(a, b, *, loc=None, ip=None) -> Uint32:
    return Uint32(_asm(T.i32(), [_u32(a, loc, ip), _u32(b, loc, ip)],
                       "mul.rn.bf16x2 $0, $1, $2;", "=r,r,r", loc=loc, ip=ip))


@dsl_user_op
def mul_f16x2(a, b, *, loc=None, ip=None) -> Uint32:
    return Uint32(_asm(T.i32(), [_u32(a, loc, ip), _u32(b, loc, ip)],
                       "mul.rn.f16x2 $0, $1, $2;", "=r,r,r", loc=loc, ip=ip))


@dsl_user_op
def cvt_bf16x2(lo, hi, *, loc=None, ip=None) -> Uint32:
    return Uint32(_asm(T.i32(), [_f32(hi, loc, ip), _f32(lo, loc, ip)],
                       "cvt.rn.bf16x2.f32 $0, $1, $2;", "=r,f,f", loc=loc, ip=ip))


@dsl_user_op
def cvt_f16x2(lo, hi, *, loc=None, ip=None) -> Uint32:
    # PTX packs the FIRST source operand into the upper half
    return Uint32(_asm(T.i32(), [_f32(hi, loc, ip), _f32(lo, loc, ip)],
                       "cvt.rn.f16x2.f32 $0, $1, $2;", "=r,f,f", loc=loc, ip=ip))


def pack_f16x2(lo, hi) -> Uint32:
    """cvt.rn.f16x2.f32: lo -> low half, hi -> high half (PTX puts the first source high)."""
    return Uint32(_pure(T.i32(), "cvt.rn.f16x2.f32 $0, $2, $1;", "=r,f,f", _as_f32(lo),
                        _as_f32(hi)))


def pack_bf16x2(lo, hi) -> Uint32:
    return Uint32(_pure(T.i32(), "cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,f,f", _as_f32(lo),
                        _as_f32(hi)))


def max_xorsign_abs_bf16x2(a, b) -> Uint32:
    """max.xorsign.abs.bf16x2 (sm_86+): per half the larger magnitude, its sign bit the XOR of
    the inputs' signs."""
    return Uint32(_pure(T.i32(), "max.xorsign.abs.bf16x2 $0, $1, $2;", "=r,r,r", _as_u32(a),
                        _as_u32(b)))


def f32_of_f16_lo(v) -> Float32:
    return Float32(_pure(T.f32(), "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $1; "
                         "cvt.f32.f16 $0, lo; }", "=f,r", _as_u32(v)))


# ----------------------------------------------------------------------------- FP8 / E8M0


def e4m3x2_to_f16x2(v) -> Uint32:
    """Low 16 bits of v = two E4M3 bytes -> f16x2 (byte 0 -> low half), exact."""
    return Uint32(_pure(T.i32(), "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $1; "
                        "cvt.rn.f16x2.e4m3x2 $0, lo; }", "=r,r", _as_u32(v)))


def f16x2_to_e4m3x2(v) -> Uint32:
    """f16x2 -> two E4M3 bytes (low half -> byte 0), RNE, saturating at +-448."""
    return Uint32(_pure(T.i32(), "{ .reg .b16 r; cvt.rn.satfinite.e4m3x2.f16x2 r, $1; "
                        "cvt.u32.u16 $0, r; }", "=r,r", _as_u32(v)))


def f32x2_to_e4m3x2(lo, hi) -> Uint32:
    """Two FP32 -> two E4M3 bytes (lo -> byte 0), RNE, saturating."""
    return Uint32(_pure(T.i32(), "{ .reg .b16 r; cvt.rn.satfinite.e4m3x2.f32 r, $2, $1; "
                        "cvt.u32.u16 $0, r; }", "=r,f,f", _as_f32(lo), _as_f32(hi)))


def f32_to_e4m3x2(v) -> Uint32:
    """One FP32 -> its E4M3 byte (RNE, satfinite; +inf -> 448) in both low bytes."""
    return Uint32(_pure(T.i32(),
                        "{ .reg .b16 t; cvt.rn.satfinite.e4m3x2.f32 t, $1, $1; "
                        "cvt.u32.u16 $0, t; }", "=r,f", _as_f32(v)))


def _lut_half(src: str, dst: str, mag_mask: int, sign_bits: int) -> str:
    return (f" and.b32 s, {src}, {mag_mask:#x};\n prmt.b32 a, tl, th, s;\n"
            f" prmt.b32 b, sv, sv, {src};\n shl.b32 b, b, 7;\n and.b32 b, b, {sign_bits:#x};\n"
            f" or.b32 {dst}, a, b;\n")


@dsl_user_op
def e2m1x8_to_e4m3x8(w, lut_lo: int, lut_hi: int, sign_pool: int, mag_mask: int,
                     sign_bits: int, *, loc=None, ip=None) -> tuple:
    """One packed word (8 E2M1 codes, element j in nibble j) -> two words of E4M3 bytes
    (elements 0..3, 4..7): per 16-bit half, prmt(lut_lo, lut_hi, half & mag_mask) picks each
    magnitude's byte and prmt(sign_pool, sign_pool, half) << 7 & sign_bits its sign (the
    tables and why: resgen.kernels.linear_sm90_fp8_convert)."""
    st = _asm(_struct(2, "i32"), [Uint32(w).ir_value(loc=loc, ip=ip)],
              "{\n .reg .b32 tl, th, sv, h, s, a, b;\n"
              f" mov.b32 tl, {lut_lo:#x};\n mov.b32 th, {lut_hi:#x};\n"
              f" mov.b32 sv, {sign_pool:#x};\n"
              + _lut_half("$2", "$0", mag_mask, sign_bits) + " shr.u32 h, $2, 16;\n"
              + _lut_half("h", "$1", mag_mask, sign_bits) + "}",
              "=&r,=&r,r", loc=loc, ip=ip)
    return _unpack(st, 2, Uint32, T.i32(), loc, ip)


@dsl_user_op
def e8m0x4_to_f32(w, zero_bits: int, *, loc=None, ip=None) -> tuple:
    """Four E8M0 bytes (byte j of w) -> four float32 bit patterns 2^(b - 127) (as Uint32):
    b << 23, and zero_bits (2^-127, a subnormal) for b = 0."""
    body = "".join(
        f" bfe.u32 e, $4, {8 * j}, 8;\n shl.b32 e, e, 23;\n setp.eq.u32 z, e, 0;\n"
        f" selp.b32 ${j}, {zero_bits:#x}, e, z;\n" for j in range(4))
    st = _asm(_struct(4, "i32"), [Uint32(w).ir_value(loc=loc, ip=ip)],
              "{\n .reg .b32 e;\n .reg .pred z;\n" + body + "}", "=&r,=&r,=&r,=&r,r",
              loc=loc, ip=ip)
    return _unpack(st, 4, Uint32, T.i32(), loc, ip)


# ----------------------------------------------------------------------------- MMA


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
def mma_f16_16816(a, b, c, *, loc=None, ip=None) -> tuple:
    """a: 4 x Uint32 (f16x2), b: 2 x Uint32, c: 4 x Float32 -> 4 x Float32 (d = a b + c)."""
    ops = ([_u32(v, loc, ip) for v in a] + [_u32(v, loc, ip) for v in b]
           + [_f32(v, loc, ip) for v in c])
    st = _asm(_struct(4, "f32"), ops,
              "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
              "{$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, {$10,$11,$12,$13};",
              "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", loc=loc, ip=ip)
    return _unpack(st, 4, Float32, T.f32(), loc, ip)


def mma_e4m3_16832(a, b, c) -> list:
    """mma.sync m16n8k32 e4m3 x e4m3 + f32 -> f32 (sm_89+). a: 4 regs, b: 2 regs, c: 4
    Float32."""
    r = _asm(_struct(4, "f32"), [x.ir_value() for x in (*map(_as_u32, a), *map(_as_u32, b),
                                                         *map(_as_f32, c))],
             "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {$0,$1,$2,$3}, {$4,$5,$6,$7}, "
             "{$8,$9}, {$10,$11,$12,$13};",
             "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f")
    return list(_unpack(r, 4, Float32, T.f32()))
