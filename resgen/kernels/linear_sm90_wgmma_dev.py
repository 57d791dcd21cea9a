"""Trace-time device helpers of the linear_sm90_wgmma kernels (CuTe DSL). The template
(resgen/templates/linear_sm90_wgmma.py.j2) owns the control flow; these emit straight-line code
from resgen.kernels.sm90_ptx's primitives (the bulk copies, the mbarrier wait, the shared and
split-K loads / stores the template calls are there) and the Hopper FP4 weight decode
(resgen.kernels.sm90_fp4_decode). Shared-memory addresses are 32-bit (`Int32`), global ones
64-bit (`Int64`).

    decode_chunk(words, swords, ...)     16 A-fragment registers (bf16x2) of one 64-column
                                         chunk: pair decode, scale expansion, BF16 multiply
    store_block(...)                     the epilogue of one n8 block (pack, exchange, store)
    lane_selectors(geom, odd)            the lane's run-time PRMT selectors
"""

from __future__ import annotations

from typing import Sequence

from cutlass import Float32, Int32, Int64, Uint32

from . import sm90_ptx as P
from .linear_sm90_wgmma_geom import MEXT_SEL, PLAIN_SEL, WgGeometry
from .sm90_fp4_decode import DECODERS, scale_pair

__all__ = ["decode_chunk", "store_block", "lane_selectors"]


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
        P.st_u32(addr, P.prmt_r(pk, P.shfl_xor4(pk), sels["out"]), ok)
    else:
        a = P.cvt_bf16x2(v[0] * fac, v[2] * fac)
        b = P.cvt_bf16x2(v[1] * fac, v[3] * fac)
        keep = P.prmt_r(a, b, sels["keep"])
        recv = P.shfl_xor4(P.prmt_r(a, b, sels["send"]))
        P.st_u32(addr, P.prmt_r(keep, recv, sels["out0"]), ok)
        P.st_u32(addr + 16, P.prmt_r(keep, recv, sels["out1"]), ok)


def lane_selectors(geom: WgGeometry, odd) -> dict:
    """The lane's run-time PRMT selectors (odd = g & 1)."""
    table = MEXT_SEL if geom.mext else PLAIN_SEL
    return {k: Uint32(WgGeometry.select(odd, pair)) for k, pair in table.items()}
