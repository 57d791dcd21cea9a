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
    4096 / 2 + 128 x 4096 / 16 (the SFB tile is always 128 rows). At W = 8 the 32 CTAs move
    the whole 9.5 MB weight in about the HBM time (1.19 us at 8 TB/s), so that point is
    HBM-bound in the model and W = 64 per-SM-bound; the fit (fit_fig4a) solves the two
    equations with the model's own epilogue terms subtracted: fixed_us ~ 3.7 us,
    sm_gbps ~ 300 GB/s.
Assumed (not published; each is a named field):
    dram_latency_us  0.5: the latency a stage ring must cover (bandwidth-delay product: a
                     ring of S stages of B bytes streams at most S B / latency per SM). The
                     fit takes the paper's kernel at its deepest ring (CUTLASS's examples fill
                     shared memory with stages), where this bound does not bind
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

import functools
import math
from dataclasses import dataclass, replace

from .linear_sm100_tc_geom import Sm100Geometry
from .sm100_layout import act_rows, round_up

__all__ = ["B200", "Breakdown", "predict", "fit_fig4a", "max_stages", "PAPER_FIG4A",
           "QUANT_H200_US", "quantizer_us", "fig4a_geometry", "FIG4A_M"]

# Paper Fig. 4a: (tile width W, microseconds) at B = 8, N = K = 4096, plain NVFP4 GEMM
PAPER_FIG4A = ((8, 4.95), (64, 5.46))


def fig4a_geometry(w: int) -> Sm100Geometry:
    """The kernel standing for the paper's Fig. 4a GEMM at tile width w (plain NVFP4, N = K =
    4096): swapped 128 x w tiles, .32x32b loads of up to 32 columns, direct stores, the deepest
    ring that fits (what CUTLASS's blockscaled examples choose)."""
    g = Sm100Geometry(fmt="nvfp4", mode="plain", layout="plain", swap=True, n=4096, kp=4096,
                      tile_m=128, tile_n=w, tile_k=256, cta_group=1, cluster_m=1,
                      cluster_n=1, stages=2, tmem_shape="32x32b", tmem_rep=min(w, 32),
                      store="direct", split_k=1, reduce="none")
    return replace(g, stages=max_stages(g))


FIG4A_M = 8          # B = 8 activation rows


@functools.lru_cache(maxsize=1)
def fit_fig4a() -> tuple[float, float]:
    """(fixed_us, sm_gbps) through the two Fig. 4a points: the model is
    t = fixed + max(HBM term, per-SM bytes / sm_gbps) + epilogue terms, so the fit solves the
    two equations for each assignment of "HBM-bound" / "SM-bound" to the two points and keeps
    the solution that is consistent with the max (see the module docstring)."""
    hw = B200(fixed_us=0.0, sm_gbps=1e9)
    pts = []
    for w, t in PAPER_FIG4A:
        q = _parts(fig4a_geometry(w), FIG4A_M, hw)
        pts.append((t - q["epi_us"], q["dram_bytes"] / (hw.hbm_gbps * 1e9) * 1e6,
                    q["per_sm_bytes"]))
    for bound in (("sm", "sm"), ("hbm", "sm"), ("sm", "hbm")):
        (t0, h0, b0), (t1, h1, b1) = pts
        if bound == ("sm", "sm"):
            inv = (t1 - t0) / (b1 - b0)                     # us per byte
            fixed = t0 - b0 * inv
        elif bound == ("hbm", "sm"):
            fixed = t0 - h0
            inv = (t1 - fixed) / b1
        else:
            fixed = t1 - h1
            inv = (t0 - fixed) / b0
        if inv <= 0:
            continue
        ok = all(abs(fixed + max(h, b * inv) - t) < 1e-9 for t, h, b in pts)
        if ok:
            return fixed, 1e-3 / inv                       # bytes/us -> GB/s
    raise ValueError("the Fig. 4a points admit no consistent fit")


def max_stages(g: Sm100Geometry, smem: int = 227 * 1024) -> int:
    """The deepest ring of g's tiles that fits shared memory (at most the CTA's K tiles)."""
    free = smem - (g.smem_bytes - g.stages * g.stage_bytes)
    return max(2, min(free // g.stage_bytes, g.kt_split))


@dataclass(frozen=True)
class B200:
    """The machine the model describes (published, fitted and assumed figures)."""

    sms: int = 148
    hbm_gbps: float = 8000.0
    fp4_dense_tflops: float = 9000.0
    smem_per_sm: int = 228 * 1024
    tmem_cols: int = 512
    fixed_us: float | None = None          # None: fitted to Fig. 4a (fit_fig4a)
    sm_gbps: float | None = None
    dram_latency_us: float = 0.5
    clock_ghz: float = 1.9
    tmem_ld_cycles: int = 64
    st_cycles: int = 4
    bulk_us: float = 0.35
    atomic_us: float = 0.8

    def fitted(self) -> "B200":
        """This machine with the Fig. 4a fit filling the parameters left None."""
        if self.fixed_us is not None and self.sm_gbps is not None:
            return self
        fixed, gbps = fit_fig4a()
        return replace(self, fixed_us=fixed if self.fixed_us is None else self.fixed_us,
                       sm_gbps=gbps if self.sm_gbps is None else self.sm_gbps)


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


def _parts(g: Sm100Geometry, m: int, hw: "B200") -> dict:
    """The model's terms for one launch of g on m tokens (hw's fixed_us / sm_gbps set)."""
    rows = act_rows(m, g.layout)
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
    w_rows = round_up(g.n, 128)
    dram = w_rows * g.kp // 2 + w_rows * g.kp // g.sfv + rows * g.kp // 2 \
        + rows * g.kp // g.sfv + m * g.n * 2
    # the ring's bytes in flight bound one SM's stream (bandwidth-delay product)
    inflight = g.stages * g.stage_bytes * per_sm
    sm_bw = min(hw.sm_gbps * 1e9, inflight / (hw.dram_latency_us * 1e-6))
    per_sm_bytes = waves * per_sm * cta_bytes
    mem_s = max(dram / (hw.hbm_gbps * 1e9), per_sm_bytes / sm_bw)
    macs = g.cta_m * g.tile_n * k_cta
    mma_s = waves * per_sm * macs * 2 / (hw.fp4_dense_tflops * 1e12 / hw.sms)
    cyc = 1e-3 / hw.clock_ghz                               # microseconds per cycle
    plan = g.ld_plan()
    tmem_us = len(plan) * (hw.tmem_ld_cycles + g.regs_per_ld) * cyc
    outs = sum(len(ins.pairs) for ins in plan)            # values per thread
    if g.split_k > 1:
        store_us = outs * hw.st_cycles * cyc * 2             # partial out, result out
        ws_bytes = g.split_k * m * g.n * 4
        reduce_us = hw.atomic_us + 2 * ws_bytes / (hw.hbm_gbps * 1e9) * 1e6
    elif g.store == "tma":
        store_us = outs * cyc + hw.bulk_us
        reduce_us = 0.0
    else:
        store_us = outs * hw.st_cycles * cyc
        reduce_us = 0.0
    return dict(mem_us=mem_s * 1e6, mma_us=mma_s * 1e6, tmem_us=waves * tmem_us,
                store_us=waves * store_us, reduce_us=reduce_us, ctas=ctas, waves=waves,
                occupancy=occ, cta_bytes=cta_bytes, dram_bytes=dram,
                per_sm_bytes=per_sm_bytes,
                epi_us=waves * (tmem_us + store_us) + reduce_us)


def predict(g: Sm100Geometry, m: int, hw: "B200 | None" = None) -> Breakdown:
    """The model's latency of the kernel g on m tokens (the GEMM; the quantizer in front of it
    is quant_sm100's and costs the same for every GEMM variant of one operand layout)."""
    hw = (hw or B200()).fitted()
    q = _parts(g, m, hw)
    total = hw.fixed_us + max(q["mem_us"], q["mma_us"]) + q["epi_us"]
    return Breakdown(total, hw.fixed_us, q["mem_us"], q["mma_us"], q["tmem_us"], q["store_us"],
                     q["reduce_us"], q["ctas"], q["waves"], q["occupancy"], q["cta_bytes"],
                     q["dram_bytes"])


# ----------------------------------------------------------------------------- whole layer

# The quantizer in front of the GEMM: no B200 figure exists here, so the model uses the only
# measured quantizer times of this workplace, quant_sm90 on the H200 at K = 4096 (fastest
# variant per configuration, CUDA-graph medians, bench/results/h200/final_quant_sm90_check
# .json.xz): tokens -> microseconds. MXFP4 plain was not measured: NVFP4 plain stands in.
# They write the BF16 xop (2 B per element) where quant_sm100 writes FP4 codes (0.56 B):
# an overestimate of the bytes, the same launch and latency floor.
QUANT_H200_US = {
    ("nvfp4", "plain"): ((1, 1.438), (16, 1.691), (2048, 10.894), (8192, 34.464)),
    ("nvfp4", "mext"): ((1, 1.479), (16, 1.610), (2048, 16.233), (8192, 53.134)),
    ("nvfp4", "kext"): ((1, 1.648), (16, 1.910), (2048, 12.014), (8192, 39.492)),
    ("mxfp4", "plain"): ((1, 1.438), (16, 1.691), (2048, 10.894), (8192, 34.464)),
    ("mxfp4", "mext"): ((1, 1.412), (16, 1.820), (2048, 14.586), (8192, 50.870)),
    ("mxfp4", "kext"): ((1, 1.414), (16, 1.736), (2048, 11.261), (8192, 38.176)),
}


def quantizer_us(fmt: str, mode: str, m: int, k: int) -> float:
    """The activation quantizer's time for m x k activations (H200 stand-in, QUANT_H200_US):
    piecewise linear in M x K, scaled from the K = 4096 measurements; mode "plain" | "mext" |
    "kext"."""
    pts = QUANT_H200_US[(fmt, mode)]
    x = m * k / 4096
    for (m0, t0), (m1, t1) in zip(pts, pts[1:]):
        if x <= m1 or (m1, t1) == pts[-1]:
            return t0 + (t1 - t0) * (x - m0) / (m1 - m0) if x >= m0 else t0
    return pts[-1][1]
