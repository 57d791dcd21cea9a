"""An analytical latency model of linear_sm100_tc on a B200: the tuner's prior on Blackwell and
the predictions docs/linear_sm100.md compares with the paper's published B200 measurements.

Nothing here is measured: there is no Blackwell GPU in this workplace. The constants are
NVIDIA's published B200 figures, two parameters fitted to two published points of the paper
(Fig. 4a), and assumptions named as such.

Published (NVIDIA B200 / DGX B200 datasheet):
    148 SMs, 8 TB/s HBM3e, 9 PFLOPS dense FP4 tensor (18 with 2:4 sparsity),
    256 KB tensor memory and 228 KB shared memory per SM.
Fitted to the paper's Fig. 4a (plain NVFP4 GEMM, N = K = 4096, B = 8 activation rows, one
128 x W tile per 128 channels, quantization excluded: 4.95 us at W = 8, 5.46 us at W = 64):
    fixed_us     launch, prologue (TMEM allocation, barriers, descriptor prefetch), pipeline
                 fill and epilogue drain of one CTA
    sm_gbps      bytes per second one SM pulls through its TMA loads when it is alone
                 (the per-CTA stream is what bounds a decode GEMM with 32 CTAs on 148 SMs)
    Each point's bytes per CTA: A + SFA = 128 x 4096 / 2 + 128 x 4096 / 16, B + SFB = W x
    4096 / 2 + 128 x 4096 / 16 (the SFB tile is always 128 rows); the two equations give
    sm_gbps = 112 KiB / 0.51 us and fixed_us = 4.95 us - (336 KiB / sm_gbps).
Assumed (not published; each is a named field):
    dram_latency_us  1.0: the latency a stage ring must cover (bandwidth-delay product)
    clock_ghz        1.9: SM clock, for per-instruction costs
    tmem_ld_cycles   64: issue + tcgen05.wait::ld of one TMEM load, plus one cycle per
                     register per lane (the data)
    st_cycles        4: one predicated st.global per thread and value (direct store)
    bulk_us          0.35: a shared-memory tile's bulk copy out and its wait (tma store)
    atomic_us        0.8: the split-K semaphore round trip and the last CTA's partial reads
    smem_per_sm      228 KB; occupancy = min(shared memory, TMEM columns) CTAs per SM
The MMA runs at the published dense FP4 rate per SM (9e15 / 148 FLOP/s), linear in the tile's
N (no minimum N cost assumed), overlapped with the loads (the warp-specialized ring).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..kernels.sm100_layout import act_rows, round_up
from .variant import LinearProblem

__all__ = ["B200", "Breakdown", "predict", "fit_fig4a", "PAPER_FIG4A"]

# Paper Fig. 4a: (tile width W, microseconds) at B = 8, N = K = 4096, plain NVFP4 GEMM
PAPER_FIG4A = ((8, 4.95), (64, 5.46))


def _fig4a_cta_bytes(w: int, k: int = 4096) -> int:
    return 128 * k // 2 + 128 * k // 16 + w * k // 2 + 128 * k // 16


def fit_fig4a() -> tuple[float, float]:
    """(fixed_us, sm_gbps) through the two Fig. 4a points (exact solution, see the module
    docstring)."""
    (w0, t0), (w1, t1) = PAPER_FIG4A
    b0, b1 = _fig4a_cta_bytes(w0), _fig4a_cta_bytes(w1)
    bw = (b1 - b0) / ((t1 - t0) * 1e-6)
    return t0 - b0 / bw * 1e6, bw / 1e9


_FIXED_US, _SM_GBPS = fit_fig4a()


@dataclass(frozen=True)
class B200:
    """The machine the model describes (published, fitted and assumed figures)."""

    sms: int = 148
    hbm_gbps: float = 8000.0
    fp4_dense_tflops: float = 9000.0
    smem_per_sm: int = 228 * 1024
    tmem_cols: int = 512
    fixed_us: float = _FIXED_US
    sm_gbps: float = _SM_GBPS
    dram_latency_us: float = 1.0
    clock_ghz: float = 1.9
    tmem_ld_cycles: int = 64
    st_cycles: int = 4
    bulk_us: float = 0.35
    atomic_us: float = 0.8


@dataclass(frozen=True)
class Breakdown:
    """Predicted microseconds of one GEMM launch, by part."""

    total_us: float
    fixed_us: float
    mem_us: float
    mma_us: float
    tmem_us: float
    store_us: float
    reduce_us: float
    ctas: int
    waves: int
    occupancy: int
    cta_bytes: int
    dram_bytes: int


def predict(variant, problem: LinearProblem, hw: B200 = B200()) -> Breakdown:
    """The model's latency of `variant` on `problem` (the GEMM; the quantizer in front of it is
    quant_sm100's and costs the same for every GEMM variant of one operand layout)."""
    from .linear_sm100_tc import geometry_of

    g = geometry_of(variant, problem)
    rows = act_rows(problem.m, g.layout)
    gx, gy, gz = g.grid(rows)
    ctas = gx * gy * gz
    occ = max(1, min(hw.smem_per_sm // max(1, g.smem_bytes), hw.tmem_cols // g.tmem_alloc))
    per_sm = min(occ, math.ceil(ctas / hw.sms))          # CTAs an SM runs at once
    waves = math.ceil(ctas / (hw.sms * occ))
    k_cta = g.kp // g.split_k
    a_bytes = g.cta_m * k_cta // 2 + g.cta_m * k_cta // g.sfv
    b_bytes = (g.tile_n // g.cta_group) * k_cta // 2 \
        + round_up(g.tile_n, 128) * k_cta // g.sfv
    cta_bytes = a_bytes + b_bytes
    w_rows = round_up(problem.n, 128)
    dram = w_rows * g.kp // 2 + w_rows * g.kp // g.sfv + rows * g.kp // 2 \
        + rows * g.kp // g.sfv + problem.m * problem.n * 2
    # the ring's bytes in flight bound one SM's stream (bandwidth-delay product)
    inflight = g.stages * g.stage_bytes * per_sm
    sm_bw = min(hw.sm_gbps * 1e9, inflight / (hw.dram_latency_us * 1e-6))
    mem_s = max(dram / (hw.hbm_gbps * 1e9), waves * per_sm * cta_bytes / sm_bw)
    macs = g.cta_m * g.tile_n * k_cta
    mma_s = waves * per_sm * macs * 2 / (hw.fp4_dense_tflops * 1e12 / hw.sms)
    cyc = 1e-3 / hw.clock_ghz                               # microseconds per cycle
    plan = g.ld_plan()
    tmem_us = len(plan) * (hw.tmem_ld_cycles + g.regs_per_ld) * cyc
    outs = sum(len(ins.pairs) for ins in plan)            # values per thread
    if g.split_k > 1:
        store_us = outs * hw.st_cycles * cyc * 2             # partial out, result out
        ws_bytes = g.split_k * problem.m * problem.n * 4
        reduce_us = hw.atomic_us + 2 * ws_bytes / (hw.hbm_gbps * 1e9) * 1e6
    elif g.store == "tma":
        store_us = outs * cyc + hw.bulk_us
        reduce_us = 0.0
    else:
        store_us = outs * hw.st_cycles * cyc
        reduce_us = 0.0
    mem_us, mma_us = mem_s * 1e6, mma_s * 1e6
    total = hw.fixed_us + max(mem_us, mma_us) + waves * (tmem_us + store_us) + reduce_us
    return Breakdown(total, hw.fixed_us, mem_us, mma_us, waves * tmem_us, waves * store_us,
                     reduce_us, ctas, waves, occ, cta_bytes, dram)
