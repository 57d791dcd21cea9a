"""An analytical latency model of attention_sm100 on a B200: the tuner's prior on Blackwell.

Nothing here is measured: there is no Blackwell GPU in this workplace, and the paper publishes
no absolute B200 attention latency (Fig. 10 gives ResAttn / TRT-LLM speedups only: median
1.19x, up to 1.40x over 48 configurations), so the model is not fitted to attention at all.

Published (NVIDIA B200 datasheet): 148 SMs, 8 TB/s HBM3e, 9 PFLOPS dense FP4, 2.25 PFLOPS
dense FP16/BF16 tensor, 228 KB shared memory and 512 TMEM columns per SM.
Copied, knowingly, from linear_sm100_tc's model (fitted there to the paper's Fig. 4a GEMM; a
family does not import another's modules): fixed_us 3.71 (launch, prologue, fill and drain of
a CTA) and sm_gbps 302 (what one SM's loads stream when alone).
Assumed (named fields): dram_latency_us 0.5 (the ring's bandwidth-delay bound), clock 1.9
GHz, 64 cycles per TMEM load + wait (+ 1 per register), 2 cycles per decoded V value per
thread (the E2M1 x E4M3 -> FP16 decode: a few integer / f16x2 ops per pair), 8 cycles per
score per thread for the fold, scale, max, exp2 and sum (+ one shuffle tree and a shared-memory
exchange per tile: 120 cycles), lastcta 0.8 us (the counter round trip and the last CTA's reads
of the partials), combine 2.0 us (a second launch in a graph) plus its partial reads, 1.0 us per CTA wave
(a CTA's prologue and tail: TMEM allocation, barrier init, the query operand and its scale
factors into shared memory / TMEM, the partial's write).
Per CTA: max(its KV bytes over min(sm_gbps, the ring bound, its share of HBM), tiles x (MMA +
epilogue) at the published rates): the ring overlaps loads with compute; the MMA and the
epilogue of one tile are serial (the scores feed the softmax, P feeds P.V).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .attention_sm100_geom import KEYS, AttnSm100Geometry

__all__ = ["B200", "Breakdown", "predict", "kv_bytes"]


@dataclass(frozen=True)
class B200:
    sms: int = 148
    hbm_gbps: float = 8000.0
    fp4_flops: float = 9e15
    f16_flops: float = 2.25e15
    smem_per_sm: int = 228 * 1024
    tmem_cols: int = 512
    fixed_us: float = 3.71
    sm_gbps: float = 302.0
    dram_latency_us: float = 0.5
    clock_ghz: float = 1.9
    tmem_ld_cycles: int = 64
    v_decode_cycles: float = 2.0
    score_cycles: float = 8.0
    tile_sync_cycles: int = 120
    lastcta_us: float = 0.8
    combine_us: float = 2.0
    cta_us: float = 1.0


@dataclass(frozen=True)
class Breakdown:
    total_us: float
    mem_us: float
    compute_us: float
    reduce_us: float
    ctas: int
    waves: int
    occupancy: int


def kv_bytes(head_dim: int, keys: int) -> int:
    """NVFP4 K and V bytes of `keys` keys of one KV head (codes + E4M3 scales)."""
    return 2 * keys * (head_dim // 2 + head_dim // 16)


def predict(g: AttnSm100Geometry, batch: int, kv_heads: int, kv_len: int, splits: int,
            hw: B200 = B200()) -> Breakdown:
    """Predicted latency of one decode step (batch sequences of kv_len keys)."""
    tiles = max(1, math.ceil(kv_len / KEYS))
    per_split = math.ceil(tiles / max(1, splits))
    ctas = batch * kv_heads * max(1, splits)
    occ = max(1, min(hw.smem_per_sm // max(1, g.smem_bytes), hw.tmem_cols // g.tmem_alloc))
    waves = math.ceil(ctas / (hw.sms * occ))
    resident = min(ctas, hw.sms * occ)
    cta_bytes = per_split * kv_bytes(g.head_dim, KEYS)
    ring_gbps = g.stages * g.stage_bytes / (hw.dram_latency_us * 1e-6) / 1e9
    share_gbps = hw.hbm_gbps / max(1, resident)
    gbps = min(hw.sm_gbps / max(1, occ) if occ > 1 else hw.sm_gbps, ring_gbps, share_gbps)
    mem_us = cta_bytes / (gbps * 1e9) * 1e6
    cyc = 1e-3 / hw.clock_ghz                   # us per cycle
    qk = 2 * KEYS * g.qk_n * g.head_dim / (hw.fp4_flops / hw.sms) * 1e6
    pv = 2 * KEYS * g.pv_n * g.head_dim / (hw.f16_flops / hw.sms) * 1e6
    loads = len(g.ld_plan()[0])
    epi = (loads * (hw.tmem_ld_cycles + g.regs_per_ld)
           + g.q_rows * hw.score_cycles + hw.tile_sync_cycles
           + g.head_dim * hw.v_decode_cycles
           + g.pv_m_tiles * (hw.tmem_ld_cycles + g.pv_n) + g.o_regs) * cyc
    compute_us = per_split * (qk + pv + epi) * occ
    red = 0.0
    if splits > 1:
        part = batch * kv_heads * splits * g.group * (g.head_dim + 2) * 4
        red = part / (hw.hbm_gbps * 1e9) * 1e6 + (hw.lastcta_us if g.reduction == "lastcta"
                                                  else hw.combine_us)
    total = hw.fixed_us + waves * (hw.cta_us + max(mem_us, compute_us)) + red
    return Breakdown(total, mem_us * waves, compute_us * waves, red, ctas, waves, occ)
