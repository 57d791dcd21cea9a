"""Inline PTX for thread-block clusters on Hopper (CuTe DSL, trace time): distributed shared
memory stores and the cluster barrier, as linear_sm90_mma's shared fused quantization uses them.

    mapa_cluster(saddr, rank) -> caddr     mapa.shared::cluster.u32: the same shared-memory
                                           location in CTA `rank` of the cluster
    st_cluster_v4(caddr, w0, w1, w2, w3)   st.shared::cluster.v4.u32 into a peer's shared memory
                                           (ordered before barrier.cluster.arrive's release)
    cluster_rank()                         %cluster_ctarank
    cluster_start_arrive()                 barrier.cluster.arrive.relaxed: the "this CTA runs"
                                           phase a kernel waits on before its first remote store
    cluster_sync_arrive(), cluster_sync_wait()   barrier.cluster.arrive.release /
                                           barrier.cluster.wait.acquire (every thread of every
                                           CTA of the cluster)

Kept apart from sm90_ptx so that the kernels which use no cluster keep their fingerprints.
"""

from __future__ import annotations

from cutlass import Int32
from cutlass.cutlass_dsl import T, dsl_user_op

from .sm90_ptx import _asm, _u32

__all__ = ["mapa_cluster", "st_cluster_v4", "cluster_rank", "cluster_start_arrive",
           "cluster_sync_arrive", "cluster_sync_wait"]


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
