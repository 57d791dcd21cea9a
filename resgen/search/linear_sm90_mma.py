"""Kernel family linear_sm90_mma: Hopper decode FP4 linear layers (NVFP4 / MXFP4 weights, BF16
mma.sync on exactly decoded values, operand swap, M-Ext fold, K-Ext, split-K).

The variant axes (LinearSm90Variant) and what they change in the kernel
(resgen/templates/linear_sm90_mma.py.j2, geometry in resgen.kernels.linear_sm90_mma_geom):
    warps_m, warps_k   warps per CTA along output channels / along K (in-CTA split-K, reduced
                       through shared memory in warp order)
    m_tiles            m16 tiles (16 output channels) per warp
    n_tiles            n8 tiles (8 xop rows) per CTA: the token tile is 8 n_tiles rows
    groups             4-chunk K groups (256 columns) per main-loop iteration
    pipeline, stages   how weight/scale loads run ahead of use: "direct" (loaded in the
                       iteration that uses them; other warps hide the latency), "regs" (register
                       double buffer of the next iteration; ptxas may sink those loads),
                       "cp_async" (per-lane cp.async.cg into a shared-memory ring of `stages`
                       iterations, stages - 1 in flight; each lane reads back only what it
                       copied, so no barrier is needed), "bulk" (the same ring filled by the
                       copy engine: one lane per warp issues cp.async.bulk copies of whole
                       iterations completing on a per-slot mbarrier; all `stages` iterations
                       in flight, no per-lane copy instructions or address registers)
    l2_prefetch        iterations ahead whose weight/scale spans lane 0 asks the copy engine to
                       pull into L2 (cp.async.bulk.prefetch.L2; 0 = none): later loads hit L2
    split_k, reduce    CTAs along K and how their partials meet: "atomic" (FP32 red.global into
                       a workspace, then a convert kernel; not deterministic) or "workspace"
                       (partials + per-tile semaphore, the last CTA sums in split order; one
                       launch, deterministic)
    packing            weight nibble layout and its decode ("nib" as in the design brief,
                       "split": sign apart from magnitude, 30% fewer integer ops)
    act                activation source: "xop" (the exact-BF16 operand a quantizer wrote to
                       global memory) or "fused" (each CTA quantizes its K range of the BF16
                       activations into shared memory with resgen.kernels.fp4_device: the
                       variant IS the whole layer; static NVFP4 alpha or MXFP4; for W4A16 the
                       prologue copies the BF16 activations instead, resgen.kernels.
                       linear_sm90_mma_a16)
    cluster            fused only: CTAs of neighbouring channel blocks launched as one cluster
                       that quantize the operand tile once between them (each 1 / cluster of
                       the blocks, stored into every peer's shared memory); 1 = each CTA
                       quantizes its whole tile (W4A16: copies; each CTA then reads 1 / cluster
                       of the activations from L2)
    pdl                programmatic dependent launch: the kernel lets the next one launch at
                       once, issues its weight prologue (cp.async ring / register buffer / L2
                       bulk prefetch of the first l2_prefetch iterations), then waits for the
                       previous kernel before reading activations or writing anything
    fold               how M-Ext's base and residue meet: "exact" (the residue rows ride as
                       extra MMA rows, the epilogue folds row pairs: Blackwell's numerics, twice
                       the MMAs) or "presum" (each token's base + residue summed in FP32 and
                       rounded once to FP16 by the layer quantizer, quant_sm90's layout
                       "presum"; ONE FP16 MMA against the weight decoded exactly in FP16, no
                       fold: resgen.kernels.linear_sm90_mma_presum). Presum is
                       valid for compensation "full" (M-Ext), NVFP4, xop variants only (PRESUM_*
                       below say why not elsewhere); it is a kernel choice of the "full"
                       workload, checked against reference.linear(fold="presum") AND within
                       the family tolerance of the exact fold's reference, so the tuner picks
                       whichever is faster. Keys: an exact variant's key has no "fold" field
                       (keys, digests and names of every stored exact variant are unchanged)
                       and a key without one parses as "exact".
Fused variants also depend on the problem's row count: a CTA's operand tile holds
TOK = min(8 n_tiles, next power of two >= rows) xop rows (compile_key keeps that much of M).
W4A16 fused variants render the template's operand "copy" (their own kernel and compile key;
the compile key keeps the compensation "w4a16"); W4A16 xop variants render the plain kernel.
Not implemented yet (no field, so no key pretends otherwise): activations staged through shared
memory by ldmatrix, output through shared memory, wgmma.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Sequence

import torch

from ..calibrate import QLinearWeight
from .family import register
from .sm90_linear import (KEXT_PRESUM_ONLY, PRESUM_MEXT_ONLY, TOLERANCE, Fold, Packing,
                          Sm90LinearFamily, presum_capable,
                          cached_weight_sets, compare, kp_of, layer_quantizer, pow2_ceil,
                          random_layer)
from .variant import UNKEYED_DEFAULT, Choice, IntRange, LinearProblem, VariantBase

__all__ = ["Packing", "Pipeline", "Reduction", "Act", "Fold", "PRESUM_MEXT_ONLY",
           "PRESUM_NVFP4_ONLY", "PRESUM_XOP_ONLY", "LinearSm90Variant", "LinearSm90Family",
           "FAMILY", "TOLERANCE", "compare", "geometry_of", "kp_of", "rows_of", "tok_rows_of",
           "layer_quantizer", "random_layer"]

_MAX_REGS_EST = 240        # estimated live registers above which a variant would spill


class Pipeline(Choice):
    DIRECT = "direct"
    REGS = "regs"
    CP_ASYNC = "cp_async"
    BULK = "bulk"


class Reduction(Choice):
    NONE = "none"
    ATOMIC = "atomic"
    WORKSPACE = "workspace"


class Act(Choice):
    XOP = "xop"
    FUSED = "fused"


# Where presum cannot run, and why (why_invalid returns these; PRESUM_MEXT_ONLY: sm90_linear).
PRESUM_NVFP4_ONLY = ("MXFP4 presum needs each token row's power-of-two shift (formats."
                     "presum_fp16: from max |X_hat + R_hat| over ALL of K) before its first MMA;"
                     " a CTA of this kernel sees only its K range and the quantizer does not "
                     "emit the shift")
PRESUM_XOP_ONLY = ("presum reads the quantizer's presum rows (fp16(X_hat + R_hat)); the fused "
                   "prologue writes the exact BF16 operand (fused presum is not built)")


@dataclass(frozen=True, slots=True)
class LinearSm90Variant(VariantBase):
    FAMILY: ClassVar[str] = "linear_sm90_mma"
    warps_m: int = field(default=4, metadata={"range": IntRange(1, 8, pow2=True), "short": "wm"})
    warps_k: int = field(default=2, metadata={"range": IntRange(1, 8, pow2=True), "short": "wk"})
    m_tiles: int = field(default=1, metadata={"range": IntRange(1, 4, pow2=True), "short": "mt"})
    n_tiles: int = field(default=1, metadata={"range": IntRange(1, 8, pow2=True), "short": "nt"})
    groups: int = field(default=1, metadata={"range": IntRange(1, 2), "short": "u"})
    pipeline: Pipeline = field(default=Pipeline.CP_ASYNC, metadata={"short": "pl"})
    stages: int = field(default=4, metadata={"range": IntRange(1, 8), "short": "st"})
    l2_prefetch: int = field(default=0, metadata={"range": IntRange(0, 8), "short": "l2"})
    split_k: int = field(default=1, metadata={"range": IntRange(1, 16), "short": "sk"})
    reduce: Reduction = field(default=Reduction.NONE, metadata={"short": "red"})
    packing: Packing = field(default=Packing.SPLIT, metadata={"short": "pk"})
    act: Act = field(default=Act.XOP, metadata={"short": "act"})
    pdl: bool = field(default=False, metadata={"short": "pdl"})
    cluster: int = field(default=1, metadata={"range": IntRange(1, 4, pow2=True), "short": "cl"})
    # keyed (and named) only where it is not the default: the keys, digests and stored rows
    # of every exact variant are the ones they had before the axis existed
    fold: Fold = field(default=Fold.EXACT, metadata={"short": "fd", UNKEYED_DEFAULT: True})

    @property
    def deterministic(self) -> bool:
        return self.reduce != Reduction.ATOMIC

    @property
    def presum(self) -> bool:
        return self.fold == Fold.PRESUM

    @property
    def fused(self) -> bool:
        return self.act == Act.FUSED


def rows_of(problem: LinearProblem) -> int:
    return problem.rows


def tok_rows_of(variant: LinearSm90Variant, problem: LinearProblem) -> int:
    """Fused: xop rows of a CTA's operand tile (a power of two, at most 8 n_tiles); 0 for xop."""
    if not variant.fused:
        return 0
    return min(8 * variant.n_tiles, pow2_ceil(problem.rows))


def _ksel(problem: LinearProblem) -> int:
    return 0 if problem.ratio is None else int(round(8 * problem.ratio))


def geometry_of(variant: LinearSm90Variant, problem: LinearProblem):
    """The kernel's Geometry (presum: resgen.kernels.linear_sm90_mma_presum.PresumGeometry, whose
    GEMM rows are tokens: mext False; W4A16 fused: resgen.kernels.linear_sm90_mma_a16.A16Geometry,
    whose prologue copies the activations)."""
    from ..kernels.linear_sm90_mma_geom import Geometry

    fused = variant.fused
    if variant.presum:
        from ..kernels.linear_sm90_mma_presum import presum_geometry

        return presum_geometry(geometry_of(replace(variant, fold=Fold.EXACT),
                                           problem.plain_twin()))
    g = Geometry(fmt=problem.fmt, mext=problem.compensation == "full",
                 packing=variant.packing.value, n=problem.n, kq=kp_of(problem) // 64,
                 warps_m=variant.warps_m, warps_k=variant.warps_k, m_tiles=variant.m_tiles,
                 n_tiles=variant.n_tiles, groups=variant.groups,
                 pipeline=variant.pipeline.value, stages=variant.stages,
                 l2_prefetch=variant.l2_prefetch,
                 split_k=variant.split_k, reduce=variant.reduce.value,
                 act=variant.act.value, pdl=bool(variant.pdl),
                 k=problem.k if fused else 0, ksel=_ksel(problem) if fused else 0,
                 tok_rows=tok_rows_of(variant, problem), cluster=variant.cluster)
    if fused and problem.w4a16:
        from ..kernels.linear_sm90_mma_a16 import a16_geometry

        return a16_geometry(g)
    return g


def _why_not_fused(v: LinearSm90Variant, p: LinearProblem) -> str | None:
    """Why the fused activation source cannot run p (None: it can). W4A16 (no activation
    scale, no extension) copies the activations in the prologue under the same rules."""
    bs = 16 if p.fmt == "nvfp4" else 32
    if p.fmt == "nvfp4" and not p.static_scale and not p.w4a16:
        return ("fused quantization needs a static NVFP4 activation scale (a dynamic one is "
                "an amax over all of x: a separate pass)")
    if p.k % bs or p.k % 8:
        return f"fused quantization needs K={p.k} to be a multiple of {max(bs, 8)}"
    ks = _ksel(p)
    if ks and (p.k * ks // 8) % bs:
        return "fused K-Ext needs an extension of whole blocks (K * ratio % block == 0)"
    tok = tok_rows_of(v, p)
    if 8 * (v.n_tiles - 1) >= tok:
        return f"n8 tiles past the {tok} operand rows of a CTA"
    return None


def _why_not_presum(v: LinearSm90Variant, p: LinearProblem) -> str | None:
    """Why the presum fold cannot run v on p (None: it can): NVFP4 M-Ext or a K-Ext presum
    workload, xop only."""
    if p.fmt != "nvfp4":
        return PRESUM_NVFP4_ONLY
    if not presum_capable(p):
        return PRESUM_MEXT_ONLY
    if v.fused:
        return PRESUM_XOP_ONLY
    return None


def _reg_estimate(v: LinearSm90Variant, p: LinearProblem | None = None) -> int:
    """Registers per thread a variant needs, fitted to ptxas's counts for sm_90a (see
    docs/linear_sm90_mma.md): accumulators 4 MT NT; B words 8 NT per chunk, twice when MT > 1
    (ptxas loads the next chunk's while the current one multiplies); weight/scale words per
    iteration held by the pipeline (direct ~8 per group and tile in flight, the register
    double buffer two full iterations of 18, cp_async 6 per tile read back per chunk).
    Variants above _MAX_REGS_EST spilled in every compile tried; the fused prologue's
    quantization needs about 72 (MXFP4 blocks of 32: more) on its own."""
    held = {Pipeline.DIRECT: 8 * v.groups * v.m_tiles, Pipeline.REGS: 36 * v.groups * v.m_tiles,
            Pipeline.CP_ASYNC: 6 * v.m_tiles, Pipeline.BULK: 6 * v.m_tiles}[v.pipeline]
    b = 8 * v.n_tiles * (2 if v.m_tiles > 1 else 1)
    est = 40 + 4 * v.m_tiles * v.n_tiles + b + held
    if v.fused:
        est = max(est, 72 if p is None or p.fmt == "nvfp4" else 96)
    return est


class LinearSm90Family(Sm90LinearFamily):
    NAME: ClassVar[str] = "linear_sm90_mma"
    VARIANT: ClassVar[type] = LinearSm90Variant
    PROBLEM: ClassVar[type] = LinearProblem
    TEMPLATE: ClassVar[str] = "linear_sm90_mma.py.j2"
    ARCHS: ClassVar[tuple[str, ...]] = ("sm_90a",)
    ENTRY: ClassVar[str] = "entry"

    # ------------------------------------------------------------------ validity
    def why_invalid(self, variant: LinearSm90Variant, problem: LinearProblem,
                    arch: str) -> str | None:
        v, p = variant, problem
        if arch not in self.ARCHS:
            return f"linear_sm90_mma runs on {self.ARCHS}, not {arch}"
        if not isinstance(v, LinearSm90Variant) or not isinstance(p, LinearProblem):
            return "not a LinearSm90Variant / LinearProblem"
        if v.presum:
            why = _why_not_presum(v, p)
            if why is not None:
                return why
        elif p.kext_presum:
            return KEXT_PRESUM_ONLY
        if p.n % 16:
            return f"N={p.n} is not a multiple of 16 (one m16 tile)"
        warps = v.warps_m * v.warps_k
        if warps > 8:
            return f"{warps} warps per CTA (at most 8)"
        if p.n % (16 * v.m_tiles * v.warps_m):
            return (f"N={p.n} is not a multiple of 16 * m_tiles * warps_m = "
                    f"{16 * v.m_tiles * v.warps_m}")
        ng = kp_of(p) // 256
        if ng % v.split_k:
            return f"Kp/256 = {ng} K groups do not split evenly over split_k = {v.split_k}"
        cg = ng // v.split_k
        if cg % v.warps_k:
            # ragged K slices: warp slices of floor / ceil(cg / warps_k) groups
            if v.groups != 1 or v.pipeline == Pipeline.REGS:
                return (f"{cg} K groups per CTA split unevenly over warps_k = {v.warps_k}: "
                        "ragged slices need one group per iteration and the direct, cp_async "
                        "or bulk pipeline")
            if cg < v.warps_k:
                return f"{cg} K groups per CTA for {v.warps_k} K slices"
        elif (cg // v.warps_k) % v.groups:
            return (f"{cg // v.warps_k} K groups per warp do not split into iterations of "
                    f"{v.groups}")
        ringed = v.pipeline in (Pipeline.CP_ASYNC, Pipeline.BULK)
        if ringed != (v.stages > 1):
            return (f"the {v.pipeline.value} pipeline needs stages >= 2" if ringed
                    else f"stages={v.stages} only applies to the cp_async and bulk pipelines")
        if (v.split_k > 1) != (v.reduce != Reduction.NONE):
            return ("split_k > 1 needs reduce atomic/workspace" if v.split_k > 1
                    else f"reduce={v.reduce.value} without split_k > 1")
        if v.fused:
            why = _why_not_fused(v, p)
            if why is not None:
                return why
        if v.cluster > 1:
            if not v.fused:
                return "a cluster shares the fused quantization: act=fused only"
            if (p.n // (16 * v.m_tiles * v.warps_m)) % v.cluster:
                return f"the channel blocks do not split into clusters of {v.cluster}"
        est = _reg_estimate(v, p)
        if est > _MAX_REGS_EST:
            return f"register estimate {est} > {_MAX_REGS_EST} (would spill)"
        geom = geometry_of(v, p)
        smem = geom.smem_bytes
        if smem > 227 * 1024:
            return f"{smem} bytes of shared memory per CTA (at most 227 KB)"
        nit = geom.nit
        if v.pipeline == Pipeline.CP_ASYNC and v.stages > nit + 1:
            return f"{v.stages} stages for {nit} iterations per warp"
        if v.pipeline == Pipeline.BULK and v.stages > nit:
            return f"a bulk ring of {v.stages} stages for {nit} iterations per warp"
        # l2_prefetch == nit: the whole K slice is requested up front (with PDL: before the
        # wait for the previous kernel)
        if v.l2_prefetch > nit:
            return f"L2 prefetch {v.l2_prefetch} iterations ahead of {nit} per warp"
        if v.pipeline == Pipeline.CP_ASYNC and 0 < v.l2_prefetch < v.stages:
            return "an L2 prefetch closer than the cp.async ring's depth does nothing"
        if v.pipeline == Pipeline.BULK and 0 < v.l2_prefetch <= v.stages:
            return "an L2 prefetch within the bulk ring's depth does nothing"
        try:
            geom.check()
        except ValueError as e:       # every rule above should have caught it first
            return str(e)
        return None

    # ------------------------------------------------------------------ space
    # (warps_m, warps_k, m_tiles): from many short K slices per CTA (small N, long K: the
    # per-warp chain of dependent iterations is what bounds small layers) to many channels
    _CONFIGS = ((1, 8, 1), (1, 4, 1), (2, 4, 1), (4, 2, 1), (2, 2, 2), (1, 4, 2), (4, 1, 2),
                (2, 2, 1), (8, 1, 1))

    def _pipes(self, nit: int) -> list[tuple[Pipeline, int, int]]:
        """(pipeline, stages, l2_prefetch) candidates for nit iterations per warp; "all"
        prefetches (l2_prefetch = nit) request the warp's whole K slice up front (with PDL:
        while the previous kernel still runs)."""
        out = [(Pipeline.CP_ASYNC, 3, 0), (Pipeline.CP_ASYNC, 4, 0), (Pipeline.REGS, 1, 0),
               (Pipeline.DIRECT, 1, 1), (Pipeline.DIRECT, 1, 2), (Pipeline.BULK, 2, 0),
               (Pipeline.BULK, 4, 0)]
        if 2 < nit <= 8:
            out += [(Pipeline.DIRECT, 1, nit), (Pipeline.REGS, 1, nit)]
        return out

    def space(self, problem: LinearProblem, arch: str) -> Sequence[LinearSm90Variant]:
        """The candidates worth timing, in a fixed order (every one valid): the _CONFIGS
        channel/K warp layouts x the pipelines x a token tile covering the rows in one or two
        z tiles x cross-CTA split-K (only where channel blocks alone leave the 132 SMs of an
        H200 short: fewer than 264 CTAs) x activation source (fused only where it can run)
        x PDL x (fused) clusters of 1 or 2 CTAs sharing the quantization (K + extension
        lengths with a factor 3 also split over 3 CTAs), then, where the presum fold runs
        (NVFP4 M-Ext: _why_not_presum), the presum twin of every exact xop variant. The nib
        packing, 2-group iterations and clusters of 4 lost everywhere on the H200
        (bench/results/h200/
        linear_cluster_check.log for the clusters) and are valid variants outside the
        space."""
        if problem.kext_presum:
            # the presum GEMM is the plain one over K: plain's exact xop variants, twinned
            twins = [replace(v, fold=Fold.PRESUM) for v in self.space(problem.plain_twin(), arch)
                     if not v.fused and not v.presum]
            return list(dict.fromkeys(tw for tw in twins
                                      if self.why_invalid(tw, problem, arch) is None)) \
                or [self.default(problem, arch)]
        rows = problem.rows
        nt_full = min(8, pow2_ceil(-(-rows // 8)))
        nts = [nt_full] + ([nt_full // 2] if nt_full > 1 else [])
        ng = kp_of(problem) // 256
        acts = [Act.XOP]
        if _why_not_fused(LinearSm90Variant(act=Act.FUSED, n_tiles=1), problem) is None:
            acts.append(Act.FUSED)
        out = []
        for wm, wk, mt in self._CONFIGS:
            nit = -(-ng // wk)     # iterations of the longest slice (ragged if ng % wk)
            ctas = problem.n // (16 * mt * wm)
            splits = [(1, Reduction.NONE)]
            if ctas < 264:
                splits += [(2, Reduction.WORKSPACE), (2, Reduction.ATOMIC),
                           (4, Reduction.WORKSPACE)]
            if ng % 3 == 0:
                # K + extension of 18 groups (K-Ext 0.125 at K = 4096) splits by 3 only
                splits += [(3, Reduction.WORKSPACE), (3, Reduction.ATOMIC)]
            for pl, st, l2 in self._pipes(nit):
                for nt in nts:
                    for sk, red in splits:
                        for act in acts:
                            for pdl in (False, True):
                                for cl in ((1, 2) if act == Act.FUSED else (1,)):
                                    l2s = l2 // sk if l2 > 2 else l2   # "all" of a split slice
                                    v = LinearSm90Variant(wm, wk, mt, nt, 1, pl, st, l2s, sk,
                                                          red, Packing.SPLIT, act, pdl, cl)
                                    if self.why_invalid(v, problem, arch) is None:
                                        out.append(v)
        if _why_not_presum(LinearSm90Variant(fold=Fold.PRESUM), problem) is None:
            # the presum twin of every exact xop variant (same tiles and pipeline), after the
            # exact ones: the exact variants keep their space indices
            out += [tw for tw in (replace(v, fold=Fold.PRESUM) for v in out if not v.fused)
                    if self.why_invalid(tw, problem, arch) is None]
        d = self.default(problem, arch)
        if d not in out:
            out.insert(0, d)
        return list(dict.fromkeys(out))

    # (warps_m, warps_k, m_tiles, pipeline) in the order they won whole-layer timings on the
    # H200 (bench/results/h200/final_linear_sm90_check.log): wide layers (N >= 16384) 4 x 2
    # warps with the register double buffer; the others the most K slices per CTA.
    # The bulk ring's first H200 run (bench/results/h200/bulk_probe.json, M = 1, fused): 4 x 2
    # warps with a 2-slot bulk ring beat the register buffer on gate_up (plain 16.73 vs
    # 17.11 us, M-Ext 17.47 vs 19.01 with a cluster of 2); on down it lost to the cp.async
    # ring (12.6-13.5 vs 10.75 us), so elsewhere it ranks like the cp.async ring of its layout.
    _WIDE_FIRST = ((4, 2, 1, Pipeline.BULK), (4, 2, 1, Pipeline.REGS),
                   (2, 4, 1, Pipeline.CP_ASYNC),
                   (1, 8, 1, Pipeline.CP_ASYNC), (1, 8, 1, Pipeline.DIRECT),
                   (2, 2, 2, Pipeline.REGS), (4, 2, 1, Pipeline.CP_ASYNC))
    _NARROW_FIRST = ((1, 8, 1, Pipeline.CP_ASYNC), (1, 8, 1, Pipeline.DIRECT),
                     (2, 4, 1, Pipeline.CP_ASYNC), (1, 4, 1, Pipeline.CP_ASYNC),
                     (4, 2, 1, Pipeline.REGS), (2, 2, 2, Pipeline.REGS))

    def prior(self, variant: LinearSm90Variant, problem: LinearProblem) -> float:
        """Lower first: the tuner's cover stage starts from the lowest, and its search ranks
        the candidates after the default and the seeds by it (with a prior the search is
        "ranked", so a short budget still reaches the patterns that won on the H200).
        Decode-sized token counts (<= 8 operand rows) prefer the fused
        quantizer (one launch) where it can run, larger ones the xop operand; the warp layout
        and pipeline by the H200 ranking above; the token tile covering all rows; no split-K
        for wide layers (splits only where channel blocks leave SMs idle); stages 3 (4 won 10 of
        the 106 M <= 16 workloads that timed it in the tune4 table); fused
        tiles of two or more operand rows (M-Ext, M >= 2) quantized once per cluster of 2 CTAs,
        one-row tiles per CTA (linear_cluster_check.log: 0.81-0.95 of the cluster-1 time
        summed over the four Qwen3-8B shapes at M = 4 and 16, 0.98 for M-Ext at M = 1, 1.06
        for plain M = 1), on the bulk ring from four rows (its M-Ext at M = 1, two rows, ran
        17.47 us without a cluster in bulk_probe.json, 20.18 with one in tune13a); W4A16
        ranks its fused variants (the prologue copies) the same way, except that its tiles
        prefer no cluster (nothing to compute once for the cluster; unmeasured); PDL
        variants after their non-PDL twins."""
        v, p = variant, problem
        rows = p.rows
        order = self._WIDE_FIRST if p.n >= 16384 else self._NARROW_FIRST
        key = (v.warps_m, v.warps_k, v.m_tiles, v.pipeline)
        if key not in order and v.pipeline == Pipeline.BULK:
            key = (v.warps_m, v.warps_k, v.m_tiles, Pipeline.CP_ASYNC)
        s = float(order.index(key)) if key in order else float(len(order) + 2)
        can_fuse = _why_not_fused(replace(v, act=Act.FUSED), p) is None
        if can_fuse and rows <= 8:
            s += 0.0 if v.fused else 3.0
        elif v.fused:
            s += 3.0
        nt_full = min(8, pow2_ceil(-(-rows // 8)))
        s += 0.0 if v.n_tiles == nt_full else 1.0
        ctas = p.n // (16 * v.m_tiles * v.warps_m)
        if v.split_k > 1:
            s += 2.0 if ctas >= 264 else (0.5 if rows >= 32 else 1.5)
        s += 0.5 if v.reduce == Reduction.ATOMIC else 0.0
        if v.pipeline == Pipeline.CP_ASYNC:
            s += 0.0 if v.stages == 3 else 1.5
        if v.pipeline == Pipeline.BULK:
            s += 0.2 if v.stages == 2 else 1.0
        if v.pipeline == Pipeline.DIRECT:
            s += 0.0 if v.l2_prefetch == 2 else 0.4
        if v.pipeline == Pipeline.REGS:
            s += 0.0 if v.l2_prefetch == 0 else 0.4
        if v.fused:
            # the bulk ring at M-Ext M = 1 (2 rows): cluster 1 (bulk_probe.json: 17.47 us on
            # gate_up; tune13 timed the cluster-2 twin at 20.18 against plain 17.35)
            want = 2 if rows >= (4 if v.pipeline == Pipeline.BULK else 2) else 1
            if p.w4a16:
                # NOT measured yet: a copy has no arithmetic for a cluster to share, only L2
                # reads, against the cluster's two barriers: cluster 1 first
                want = 1
            s += 0.0 if v.cluster == want else 0.3
        s += 1.2 if v.pdl else 0.0
        if v.presum:
            # NOT measured yet: presum halves the MMAs of M-Ext, which pays where the MMAs
            # matter (from 32 operand rows, M >= 16: ahead of its exact twin); below that the
            # extra B-load arithmetic may cost more than it saves (behind its twin)
            s += -0.5 if rows >= 32 else 0.5
        return s

    def default(self, problem: LinearProblem, arch: str) -> LinearSm90Variant:
        """The runtime's fallback (valid for any N % 16 == 0; activation operand from a
        quantizer, no PDL), chosen by what won on the H200 (run of 2026-11-30): wide layers
        (N >= 16384) 4 x 2 warps with the register double buffer; narrower ones the most K
        slices per CTA (8, 4, 2 warps along K) with a 3-stage cp.async ring; a token tile
        covering up to 32 xop rows."""
        if problem.kext_presum:
            # the plain default's presum twin (an xop variant: the plain GEMM over K in FP16)
            tw = replace(self.default(problem.plain_twin(), arch), fold=Fold.PRESUM)
            why = self.why_invalid(tw, problem, arch)
            if why is not None:
                raise ValueError(f"linear_sm90_mma cannot run {problem.key()}: {why}")
            return tw
        ng = kp_of(problem) // 256
        nt = min(4, pow2_ceil(-(-problem.rows // 8)))
        cands = []
        if problem.n >= 16384:
            cands.append(LinearSm90Variant(4, 2, 1, nt, 1, Pipeline.REGS, 1, 0, 1,
                                           Reduction.NONE, Packing.SPLIT))
        for wk in (8, 4, 2):
            if ng % wk == 0 and ng // wk >= 2:
                cands.append(LinearSm90Variant(1, wk, 1, nt, 1, Pipeline.CP_ASYNC,
                                               min(3, ng // wk + 1), 0, 1, Reduction.NONE,
                                               Packing.SPLIT))
        for v in cands:
            if self.why_invalid(v, problem, arch) is None:
                return v
        # anything else: the most K-split of (4, 2, 1) warps that divides the K groups
        wk = next(w for w in (4, 2, 1) if ng % w == 0)
        wm = 4 // wk
        while wm > 1 and problem.n % (16 * wm):
            wm //= 2
        nit = ng // wk
        v = LinearSm90Variant(warps_m=wm, warps_k=wk, m_tiles=1, n_tiles=1, groups=1,
                              pipeline=Pipeline.CP_ASYNC if nit >= 2 else Pipeline.DIRECT,
                              stages=min(4, nit + 1) if nit >= 2 else 1, split_k=1,
                              reduce=Reduction.NONE, packing=Packing.SPLIT)
        why = self.why_invalid(v, problem, arch)
        if why is not None:
            raise ValueError(f"linear_sm90_mma cannot run {problem.key()}: {why}")
        return v

    # ------------------------------------------------------------------ codegen
    def template_params(self, variant: LinearSm90Variant, problem: LinearProblem) -> dict:
        g = geometry_of(variant, problem)
        return {"fmt": g.fmt, "mext": bool(g.mext), "packing": g.packing, "n": int(g.n),
                "kq": int(g.kq), "warps_m": int(g.warps_m), "warps_k": int(g.warps_k),
                "m_tiles": int(g.m_tiles), "n_tiles": int(g.n_tiles),
                "groups": int(g.groups), "pipeline": g.pipeline, "stages": int(g.stages),
                "l2_prefetch": int(g.l2_prefetch),
                "split_k": int(g.split_k), "reduce": g.reduce, "act": g.act,
                "pdl": bool(g.pdl), "k": int(g.k), "ksel": int(g.ksel),
                "tok_rows": int(g.tok_rows), "cluster": int(g.cluster),
                "fold": variant.fold.value, "operand": getattr(g, "operand", "quantize")}

    def compile_key(self, variant: LinearSm90Variant, problem: LinearProblem) -> LinearProblem:
        """M is a run-time argument (the grid's token tiles): one compile per (fmt, mode, N,
        K(+ext)); fused variants keep the rows of their operand tile (tok_rows_of), so M
        buckets that share it share a compile (a W4A16 fused key keeps compensation "w4a16":
        its prologue copies, a kernel of its own). A W4A16 xop variant runs the plain kernel
        (on the BF16 activations, alpha_x = 1): its compile key is the plain one, so both
        share one compile and one fingerprint."""
        if variant.fused:
            rpt = 2 if problem.compensation == "full" else 1
            return replace(problem, m=max(1, tok_rows_of(variant, problem) // rpt))
        if problem.w4a16:
            return replace(problem, compensation="none", m=1)
        if problem.kext_presum:
            # the presum GEMM over K: M-Ext presum's kernel of the same N and K
            return replace(problem, compensation="full", fold="exact", m=1)
        return replace(problem, m=1)

    def compile_args(self, variant: LinearSm90Variant, problem: LinearProblem) -> list[Any]:
        import cuda.bindings.driver as cuda
        import cutlass
        import cutlass.cute as cute
        from cutlass.cute.runtime import make_ptr

        gm = cute.AddressSpace.gmem
        return [make_ptr(cutlass.Int32, 0, gm, 16), make_ptr(cutlass.Uint8, 0, gm, 16),
                make_ptr(cutlass.BFloat16, 0, gm, 16), make_ptr(cutlass.BFloat16, 0, gm, 16),
                make_ptr(cutlass.Float32, 0, gm, 4), make_ptr(cutlass.Float32, 0, gm, 4),
                make_ptr(cutlass.Float32, 0, gm, 16), make_ptr(cutlass.Int32, 0, gm, 4),
                make_ptr(cutlass.Uint8, 0, gm, 4), cutlass.Int32(1), cutlass.Int32(1),
                cuda.CUstream(0)]

    # ------------------------------------------------------------------ running
    def working_set_bytes(self, variant: LinearSm90Variant, problem: LinearProblem) -> int:
        """Bytes of one input set (weights + scales + activation operand + output)."""
        kp = kp_of(problem)
        per_w = 0.5 + (1 / 16 if problem.fmt == "nvfp4" else 1 / 32)
        rows = self.gemm_rows(variant, problem)
        t_pad = -(-rows // (8 * variant.n_tiles)) * 8 * variant.n_tiles
        return int(problem.n * kp * per_w + t_pad * kp * 2 + problem.m * problem.n * 2)

    # ------------------------------------------------------------------ launch (bind)
    def layout(self, qweight: QLinearWeight, packing: str) -> Any:
        """The weight in this family's layout (resgen.kernels.sm90_fp4_layout.Sm90Weight)."""
        from ..kernels.sm90_fp4_layout import prepare_sm90_weight

        return prepare_sm90_weight(qweight, packing)

    def needs_quantizer(self, variant: LinearSm90Variant) -> bool:
        """xop variants read the layer quantizer's operand; fused ones quantize themselves."""
        return not variant.fused

    def xop_row_multiple(self, variant: LinearSm90Variant, problem: LinearProblem) -> int:
        """Operand rows are padded to whole token tiles (presum: TOK tokens, one summed row
        each)."""
        return geometry_of(variant, problem).tok

    def launcher(self, compiled: Any, variant: LinearSm90Variant, problem: LinearProblem,
                 device: torch.device | str) -> Any:
        """resgen.kernels.linear_sm90_mma.LinearSm90Launcher with the split-K workspace and
        semaphores of `problem`; refuses a kernel compiled for another compile key."""
        from ..kernels.linear_sm90_mma import LinearSm90Launcher

        from .build import COMPILE_KEY_ATTR

        made_for = getattr(compiled, COMPILE_KEY_ATTR, None)
        want = self.compile_key(variant, problem).key()
        if made_for is not None and made_for != want:
            # The host geometry (grid, operand tile) comes from `problem`; a kernel compiled
            # for another key would silently skip rows (seen on the H200 when a fused kernel
            # compiled for one token was run with three).
            raise ValueError(f"{variant.name()} was compiled for {made_for}, not for {want}")
        g = geometry_of(variant, problem)
        grows = self.gemm_rows(variant, problem)          # the GEMM's rows (presum: tokens)
        return LinearSm90Launcher(compiled, g, ws_floats=g.ws_floats(grows, problem.m),
                                  sem_count=g.sem_count(grows), device=device)

    def weight_sets(self, problem: LinearProblem, packing: str, device: Any, n_sets: int,
                    seed: int) -> list:
        return _weight_sets(problem, packing, device, n_sets, seed)


FAMILY = register(LinearSm90Family())


_WEIGHTS: dict[tuple, list] = {}
_WEIGHTS_KEEP = 3       # weight-set lists kept for reuse by the next variants / M buckets


def _weight_sets(problem: LinearProblem, packing: str, device, n_sets: int, seed: int) -> list:
    """[(qweight, Sm90Weight)] * n_sets for the problem's layer (M plays no part), cached for
    the few most recent layers: preparing big weights costs more than timing a variant."""
    from ..kernels.sm90_fp4_layout import prepare_sm90_weight

    return cached_weight_sets(_WEIGHTS, _WEIGHTS_KEEP, prepare_sm90_weight, problem, packing,
                              device, n_sets, seed)
