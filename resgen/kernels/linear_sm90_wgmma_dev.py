"""Trace-time device helpers of the linear_sm90_wgmma kernels (CuTe DSL; inline PTX where the
DSL has no exact equivalent). The template (resgen/templates/linear_sm90_wgmma.py.j2) owns the
control flow; these emit straight-line code. Shared-memory addresses are 32-bit (`Int32`),
global ones 64-bit (`Int64`).

    bulk_g2s(sdst, gsrc, nbytes, mbar)   cp.async.bulk global -> shared, completing `nbytes`
                                         transaction bytes on the mbarrier at `mbar`
    wait_parity(mbar, parity)            mbarrier.try_wait.parity loop; traps if the wait
                                         lasts more than WATCHDOG_NS (a protocol bug becomes a
                                         launch error instead of a hung process)
    ld_shared_u32(saddr)                 one 32-bit shared load (MXFP4 scale word)
    shfl_xor4(v)                         shfl.sync.bfly by 4 lanes (the partner lane g ^ 1)
    prmt_r(a, b, sel)                    byte permute with a run-time selector
    decode_chunk(words, swords, ...)     16 A-fragment registers (bf16x2) of one 64-column
                                         chunk: pair decode, scale expansion, BF16 multiply
    store_block(...)                     the epilogue of one n8 block (pack, exchange, store)
    st_v4_f32(gaddr, v0, v1, v2, v3)     st.global.v4.f32 (split-K workspace slot)
    ld_cg_v4_f32(gaddr)                  ld.global.cg.v4.f32 (the last CTA reads the slots at
                                         L2, after the semaphore's acquire)
"""

from __future__ import annotations

from typing import Sequence

from cutlass import Float32, Int32, Int64, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from . import sm90_ptx as P
from .linear_sm90_mma_dev import DECODERS, scale_pair
from .linear_sm90_wgmma_geom import MEXT_SEL, PLAIN_SEL, WgGeometry

__all__ = ["WATCHDOG_NS", "bulk_g2s", "wait_parity", "ld_shared_u32", "shfl_xor4", "prmt_r",
           "decode_chunk", "store_block", "lane_selectors", "st_v4_f32", "ld_cg_v4_f32"]

WATCHDOG_NS = 2_000_000_000      # 2 s: every wait in these kernels is over in microseconds


def _asm(ret, operands, text, cons, effects=False, loc=None, ip=None):
    return llvm.inline_asm(ret, operands, text, cons, has_side_effects=effects,
                           is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
                           loc=loc, ip=ip)


def _i32(v, loc=None, ip=None):
    return Int32(v).ir_value(loc=loc, ip=ip)


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
def wait_parity(mbar, parity, *, loc=None, ip=None) -> None:
    """Block until the phase of the mbarrier at shared address `mbar` with parity `parity`
    has completed (acquire, CTA scope); trap after WATCHDOG_NS of waiting."""
    _asm(None, [_i32(mbar, loc, ip), _i32(parity, loc, ip)],
         "{\n .reg .pred p;\n .reg .u64 t0, t1;\n"
         " mbarrier.try_wait.parity.shared::cta.b64 p, [$0], $1;\n"
         " @p bra WG_DONE;\n"
         " mov.u64 t0, %globaltimer;\n"
         "WG_RETRY:\n"
         " mbarrier.try_wait.parity.shared::cta.b64 p, [$0], $1;\n"
         " @p bra WG_DONE;\n"
         " mov.u64 t1, %globaltimer;\n"
         " sub.u64 t1, t1, t0;\n"
         f" setp.lt.u64 p, t1, {WATCHDOG_NS};\n"
         " @p bra WG_RETRY;\n"
         " trap;\n"
         "WG_DONE:\n}",
         "r,r,~{memory}", effects=True, loc=loc, ip=ip)


@dsl_user_op
def st_v4_f32(gaddr, v0, v1, v2, v3, *, loc=None, ip=None) -> None:
    _asm(None, [Int64(gaddr).ir_value(loc=loc, ip=ip)]
         + [Float32(v).ir_value(loc=loc, ip=ip) for v in (v0, v1, v2, v3)],
         "st.global.v4.f32 [$0], {$1, $2, $3, $4};", "l,f,f,f,f,~{memory}", effects=True,
         loc=loc, ip=ip)


@dsl_user_op
def ld_cg_v4_f32(gaddr, *, loc=None, ip=None) -> tuple:
    st = _asm(P._struct(4, "f32"), [Int64(gaddr).ir_value(loc=loc, ip=ip)],
              "ld.global.cg.v4.f32 {$0, $1, $2, $3}, [$4];", "=f,=f,=f,=f,l,~{memory}",
              effects=True, loc=loc, ip=ip)
    return P._unpack(st, 4, Float32, T.f32(), loc, ip)


@dsl_user_op
def ld_shared_u32(saddr, *, loc=None, ip=None) -> Uint32:
    return Uint32(_asm(T.i32(), [_i32(saddr, loc, ip)], "ld.shared.u32 $0, [$1];",
                       "=r,r,~{memory}", effects=True, loc=loc, ip=ip))


@dsl_user_op
def shfl_xor4(v, *, loc=None, ip=None) -> Uint32:
    return Uint32(_asm(T.i32(), [Uint32(v).ir_value(loc=loc, ip=ip)],
                       "shfl.sync.bfly.b32 $0, $1, 4, 31, -1;", "=r,r", effects=True,
                       loc=loc, ip=ip))


@dsl_user_op
def prmt_r(a, b, sel, *, loc=None, ip=None) -> Uint32:
    return Uint32(_asm(T.i32(), [Uint32(a).ir_value(loc=loc, ip=ip),
                                 Uint32(b).ir_value(loc=loc, ip=ip),
                                 Uint32(sel).ir_value(loc=loc, ip=ip)],
                       "prmt.b32 $0, $1, $2, $3;", "=r,r,r,r", loc=loc, ip=ip))


def decode_chunk(geom: WgGeometry, words: Sequence[Uint32], swords: Sequence[Uint32]
                 ) -> list[Uint32]:
    """A registers of the 4 k16 steps of one chunk: [4 j + r] = (a_{2r}, a_{2r+1}) of step j
    (r = 0: row r0, k 2t; 1: row r1; 2: row r0, k 2t + 8; 3: row r1, k 2t + 8)."""
    decode = DECODERS[geom.packing]
    out: list[Uint32] = []
    for j in range(4):
        wi, i = geom.scale_select(j)
        s0, s1 = scale_pair(swords[wi], i, geom.fmt)
        r = decode(words[j])
        out += [P.mul_bf16x2(r[0], s0), P.mul_bf16x2(r[1], s1),
                P.mul_bf16x2(r[2], s0), P.mul_bf16x2(r[3], s1)]
    return out


def store_block(geom: WgGeometry, v: Sequence[Float32], fac: Float32, sels: dict,
                yaddr0: Int64, n: Int32, tok0: Int32, i: int, g, t, m: Int32) -> None:
    """Epilogue of n8 block i: v = accumulators 4 i .. 4 i + 3 of the lane; scale by fac,
    round to BF16, exchange with lane g ^ 1, store 32-bit channel pairs (token < m only).
    yaddr0: byte address of Y[0, r0 + channel offset of the lane's first store]; sels: the
    lane's PRMT selectors (WgGeometry.select of PLAIN_SEL / MEXT_SEL)."""
    tok_off, _ = WgGeometry.store_lane(g, t, i, geom.mext)
    tok = tok0 + tok_off
    ok = Int32(tok < m)
    addr = yaddr0 + Int64(tok) * Int64(n) * 2
    if geom.mext:
        pk = P.cvt_bf16x2((v[0] + v[1]) * fac, (v[2] + v[3]) * fac)
        P.st_u32(addr, prmt_r(pk, shfl_xor4(pk), sels["out"]), ok)
    else:
        a = P.cvt_bf16x2(v[0] * fac, v[2] * fac)
        b = P.cvt_bf16x2(v[1] * fac, v[3] * fac)
        keep = prmt_r(a, b, sels["keep"])
        recv = shfl_xor4(prmt_r(a, b, sels["send"]))
        P.st_u32(addr, prmt_r(keep, recv, sels["out0"]), ok)
        P.st_u32(addr + 16, prmt_r(keep, recv, sels["out1"]), ok)


def lane_selectors(geom: WgGeometry, odd) -> dict:
    """The lane's run-time PRMT selectors (odd = g & 1)."""
    table = MEXT_SEL if geom.mext else PLAIN_SEL
    return {k: Uint32(WgGeometry.select(odd, pair)) for k, pair in table.items()}
