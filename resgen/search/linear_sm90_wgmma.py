"""Kernel family linear_sm90_wgmma: Hopper prefill FP4 linear layers (NVFP4 / MXFP4 weights
decoded exactly into the register A operand of wgmma.m64nNk16, activations through TMA,
plain / M-Ext fold / K-Ext). Design: docs/linear_sm90_wgmma.md.

The variant axes (LinearSm90WgmmaVariant) and what they change in the kernel
(resgen/templates/linear_sm90_wgmma.py.j2, geometry in resgen.kernels.linear_sm90_wgmma_geom):
    consumers   consumer warpgroups per CTA (1 or 2; with 2, setmaxnreg moves registers from
                the producer warpgroup to them)
    m_wg        m64 blocks (64 output channels) per consumer warpgroup: the CTA covers
                64 * consumers * m_wg channels
    bn          xop rows per CTA = the wgmma N (M-Ext: bn / 2 tokens)
    stages      shared-memory pipeline depth (TMA box of the activations + bulk copy of the
                weight records per stage)
    raster      grid order: "tok" (consecutive CTAs walk token tiles: a wave shares weight
                blocks) or "ch" (they walk channel blocks: a wave shares activation tiles)
    packing     weight nibble layout and decode ("split" / "nib", resgen.kernels.sm90_fp4_layout)
    split_k     K slices per output tile (grid z): more CTAs for layers with few channel tiles
                (decode and mid-size M); the slices meet in a workspace and the tile's last CTA
                sums them in split order (deterministic, one launch)
    pdl         programmatic dependent launch behind the layer quantizer: weight copies of the
                first stages before griddepcontrol.wait, activation boxes after it
    producer    "wg" (a producer warpgroup, warp 0 issuing) or "warp" (one consumer
                warpgroup, then one producer warp: 160 threads, more CTAs per SM); keyed only
                where not "wg". Valid, not enumerated
    fold        how M-Ext's base and residue meet: "exact" (row pairs as extra B rows, folded
                in the epilogue: Blackwell's numerics, twice the MMAs) or "presum" (the layer
                quantizer writes fp16(X_hat + R_hat), one row per token, quant_sm90 layout
                "presum"; the GEMM is the plain kernel in FP16, the weight decoded exactly in
                FP16: resgen.kernels.linear_sm90_wgmma_presum). NVFP4 M-Ext only. Checked
                against reference.linear(fold="presum") AND within the family tolerance of the
                exact fold's reference, so it serves the "full" workload and the tuner picks
                whichever is faster. An exact variant's key has no "fold" field (the keys of
                every variant stored before the axis are unchanged)
The epilogue stores 32-bit BF16 channel pairs straight from registers after a lane exchange
(no field: an smem + TMA store path is not implemented, so no key pretends otherwise).
N, K(+ext) and M are run-time arguments: one compile per (format, M-Ext or not, variant).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Sequence

import torch

from ..calibrate import QLinearWeight
from .family import register
from .sm90_linear import (KEXT_PRESUM_ONLY, PRESUM_MEXT_ONLY, TOLERANCE, Fold, Packing,
                          Sm90LinearFamily, presum_capable,
                          cached_weight_sets, compare, kp_of, pow2_ceil)
from .variant import UNKEYED_DEFAULT, Choice, IntRange, LinearProblem, VariantBase

__all__ = ["Raster", "Producer", "Fold", "LinearSm90WgmmaVariant", "LinearSm90WgmmaFamily",
           "FAMILY", "TOLERANCE", "compare", "geometry_of", "gemm_rows", "kp_of",
           "compile_once", "PRESUM_MEXT_ONLY", "PRESUM_NVFP4_ONLY"]

_SMEM_MAX = 227 * 1024
# consumer registers: accumulators + two A register sets + about 40 for addresses, scales,
# loop state and the epilogue; budget = what setmaxnreg gives (2 consumers) or 255
_REG_OVERHEAD = 40
_WS_MAX = 256 << 20          # split-K workspace bytes
_SMS = 132                   # H200 SMs (the prior's wave estimate)
_SPLITS = (1, 2, 4, 8, 3, 6)


class Raster(Choice):
    TOK = "tok"
    CH = "ch"


class Producer(Choice):
    """Who issues a CTA's copies: a producer warpgroup (its warp 0 works; "wg") or one
    producer warp after the single consumer warpgroup ("warp": 160 threads per CTA)."""
    WG = "wg"
    WARP = "warp"


PRESUM_NVFP4_ONLY = ("MXFP4 presum needs each token row's power-of-two shift (formats."
                     "presum_fp16: from max |X_hat + R_hat| over ALL of K) before the row is "
                     "written; the layer quantizer's warp tiles each see a slice of the row")


@dataclass(frozen=True, slots=True)
class LinearSm90WgmmaVariant(VariantBase):
    FAMILY: ClassVar[str] = "linear_sm90_wgmma"
    consumers: int = field(default=2, metadata={"range": IntRange(1, 2), "short": "c"})
    m_wg: int = field(default=1, metadata={"range": IntRange(1, 2), "short": "mw"})
    bn: int = field(default=128, metadata={"range": IntRange(16, 256), "short": "bn"})
    stages: int = field(default=4, metadata={"range": IntRange(2, 12), "short": "st"})
    raster: Raster = field(default=Raster.TOK, metadata={"short": "r"})
    packing: Packing = field(default=Packing.SPLIT, metadata={"short": "pk"})
    split_k: int = field(default=1, metadata={"range": IntRange(1, 16), "short": "sk"})
    pdl: bool = field(default=False, metadata={"short": "pdl"})
    # keyed (and named) only where it is not the default, as linear_sm90_mma's: the keys,
    # digests and stored rows of every exact variant are the ones they had before the axis
    fold: Fold = field(default=Fold.EXACT, metadata={"short": "fd", UNKEYED_DEFAULT: True})
    # persistent stream-K CTAs per SM (0: the grid schedule; resgen.kernels.
    # linear_sm90_wgmma_streamk). Keyed only where not 0, as fold. Valid, not enumerated
    streamk: int = field(default=0, metadata={"range": IntRange(0, 2), "short": "ps",
                                              UNKEYED_DEFAULT: True})
    # one producer warp instead of a producer warpgroup (consumers 1, grid schedule): the
    # three idle producer warps no longer hold registers, so more CTAs fit an SM. Keyed only
    # where not "wg", as fold. Valid, not enumerated: not yet measured against the table in one
    # run (docs/linear_sm90_wgmma.md, "One producer warp")
    producer: Producer = field(default=Producer.WG, metadata={"short": "pr",
                                                              UNKEYED_DEFAULT: True})

    @property
    def deterministic(self) -> bool:
        return True         # split-K partials are summed in split order by the last CTA

    @property
    def presum(self) -> bool:
        return self.fold == Fold.PRESUM


def gemm_rows(variant: LinearSm90WgmmaVariant, problem: LinearProblem) -> int:
    """The operand rows the GEMM reads: problem.rows (2 M for exact M-Ext), M for presum (one
    summed row per token)."""
    return problem.m if variant.presum else problem.rows


def geometry_of(variant: LinearSm90WgmmaVariant, problem: LinearProblem):
    """The kernel's WgGeometry (StreamKGeometry for a stream-K variant). Presum is the plain
    geometry (mext False: rows = tokens); its FP16 types and decode are the render's
    (template_params)."""
    from ..kernels.linear_sm90_wgmma_geom import WgGeometry

    mext = problem.compensation == "full" and not variant.presum
    kw: dict[str, Any] = dict(fmt=problem.fmt, mext=mext, packing=variant.packing.value,
                              consumers=variant.consumers, m_wg=variant.m_wg, bn=variant.bn,
                              stages=variant.stages, raster=variant.raster.value,
                              split_k=variant.split_k, pdl=bool(variant.pdl),
                              producer=variant.producer.value)
    if variant.streamk:
        from ..kernels.linear_sm90_wgmma_streamk import StreamKGeometry

        return StreamKGeometry(**kw, streamk=variant.streamk)
    return WgGeometry(**kw)


def _wave_cost(v: LinearSm90WgmmaVariant, p: LinearProblem) -> float:
    """Prior term for the grid, fitted to the H200 split-K study
    (bench/results/h200/linear_wgmma_splitk_check.log): CTAs per SM 1 with two consumer
    warpgroups, else 2 where shared memory allows; under one wave, 1.2 x the idle share of the
    SMs; past one wave, 1.5 x the idle share of the last wave; plus 0.15 per doubling of the
    split (workspace traffic)."""
    g = geometry_of(v, p)
    gx, gy = g.grid(gemm_rows(v, p), p.n)
    per_sm = 1 if v.consumers == 2 or g.smem_bytes > 113 * 1024 else 2
    waves = gx * gy * v.split_k / (_SMS * per_sm)
    idle = 1.2 * (1.0 - waves) if waves <= 1 else 1.5 * (1.0 - waves / math.ceil(waves))
    return idle + 0.15 * math.log2(v.split_k)


def _reg_estimate(v: LinearSm90WgmmaVariant) -> int:
    return v.m_wg * v.bn // 2 + 2 * 16 * v.m_wg + _REG_OVERHEAD


def _reg_budget(v: LinearSm90WgmmaVariant) -> int:
    from ..kernels.linear_sm90_wgmma_geom import CONSUMER_REGS

    return CONSUMER_REGS if v.consumers == 2 else 255


class LinearSm90WgmmaFamily(Sm90LinearFamily):
    NAME: ClassVar[str] = "linear_sm90_wgmma"
    VARIANT: ClassVar[type] = LinearSm90WgmmaVariant
    PROBLEM: ClassVar[type] = LinearProblem
    TEMPLATE: ClassVar[str] = "linear_sm90_wgmma.py.j2"
    ARCHS: ClassVar[tuple[str, ...]] = ("sm_90a",)
    ENTRY: ClassVar[str] = "entry"
    INPUT_SEED: ClassVar[int] = 7919

    # ------------------------------------------------------------------ validity
    def why_invalid(self, variant: LinearSm90WgmmaVariant, problem: LinearProblem,
                    arch: str) -> str | None:
        v, p = variant, problem
        if arch not in self.ARCHS:
            return f"linear_sm90_wgmma runs on {self.ARCHS}, not {arch}"
        if not isinstance(v, LinearSm90WgmmaVariant) or not isinstance(p, LinearProblem):
            return "not a LinearSm90WgmmaVariant / LinearProblem"
        if v.presum:
            if p.fmt != "nvfp4":
                return PRESUM_NVFP4_ONLY
            if not presum_capable(p):
                return PRESUM_MEXT_ONLY
        elif p.kext_presum:
            return KEXT_PRESUM_ONLY
        if v.producer == Producer.WARP:
            if v.consumers != 1:
                return ("a one-warp producer serves one consumer warpgroup (two need "
                        "setmaxnreg, which moves registers per warpgroup)")
            if v.streamk:
                return "the one-warp producer runs the grid schedule (streamk 0)"
        if v.streamk:
            if v.split_k != 1 or v.pdl:
                return "stream-K (streamk > 0) runs split_k 1 without PDL"
            if v.streamk == 2 and (v.consumers != 1 or _reg_estimate(v) > 120):
                return "two stream-K CTAs per SM need one consumer warpgroup and <= 120 registers"
        bm = 64 * v.consumers * v.m_wg
        if p.n % bm:
            return f"N={p.n} is not a multiple of the CTA's 64 * consumers * m_wg = {bm} channels"
        if v.bn % 16:
            return f"bn={v.bn} is not a multiple of 16 (wgmma N step 8, M-Ext row pairs)"
        acc = v.m_wg * v.bn // 2
        if acc > 128:
            return f"{acc} FP32 accumulators per thread (m_wg * bn / 2 > 128)"
        est, budget = _reg_estimate(v), _reg_budget(v)
        if est > budget:
            return f"register estimate {est} > {budget} (would spill)"
        g = geometry_of(v, p)
        if g.smem_bytes > _SMEM_MAX:
            return f"{g.smem_bytes} bytes of shared memory per CTA (at most {_SMEM_MAX})"
        nk = kp_of(p) // 64
        if nk % (2 * v.split_k):
            return (f"{nk} K chunks do not divide into {v.split_k} slices of whole chunk pairs")
        if v.stages > nk // v.split_k:
            return f"{v.stages} stages for {nk // v.split_k} K chunks per slice"
        rows = gemm_rows(v, p)
        if v.streamk:
            if v.streamk == 2 and g.smem_bytes > 113 * 1024:
                return (f"{g.smem_bytes} bytes of shared memory: two stream-K CTAs per SM fit "
                        "at most 113 KB each")
            return None
        if g.ws_floats(rows, p.n) * 4 > _WS_MAX:
            return f"split-K workspace of {g.ws_floats(rows, p.n) * 4} bytes (at most {_WS_MAX})"
        if v.raster == Raster.CH and -(-rows // v.bn) > 65535:
            return "raster 'ch' puts the token tiles on grid y (at most 65535)"
        if p.n // bm > 65535 and v.raster == Raster.TOK:
            return "raster 'tok' puts the channel tiles on grid y (at most 65535)"
        return None

    # ------------------------------------------------------------------ space
    _TILES = ((2, 1, 256), (2, 1, 128), (2, 2, 128), (2, 1, 192), (1, 2, 128), (1, 1, 256),
              (2, 1, 64), (1, 1, 128), (1, 1, 64), (2, 2, 64),
              (2, 1, 32), (1, 1, 32), (2, 2, 32), (2, 1, 16), (1, 1, 16),
              # decode: one consumer warpgroup streaming two m64 blocks (twice the weight bytes
              # in flight per stage; added after tune7, not yet measured)
              (1, 2, 64), (1, 2, 32), (1, 2, 16), (2, 2, 16))

    def space(self, problem: LinearProblem, arch: str) -> Sequence[LinearSm90WgmmaVariant]:
        """Every valid candidate in a fixed order: tiles (consumers, m_wg, bn) whose token tile
        does not exceed the rows by more than 2x (64 always allowed; the narrow 16 / 32 tiles,
        for decode-sized M, only where the rows fill at most 4 of them), 6 / 4 / 8 / 3 stages
        (a stage is released one chunk after its wgmmas were issued, so S stages keep S - 2
        chunks of copies in flight), both rasters and packings, split-K 1 / 2 / 4 / 8 / 3 / 6
        where the split CTAs stay within 4 per SM, and PDL off / on; then, for NVFP4 M-Ext, the
        same enumeration of presum variants (whose GEMM reads M rows, not 2 M), after the
        exact ones: the exact variants keep their space indices. A K-Ext presum workload
        (fold "presum") has the presum enumeration only."""
        out = [] if problem.kext_presum else self._enumerate(problem, arch, Fold.EXACT)
        if presum_capable(problem):
            out += self._enumerate(problem, arch, Fold.PRESUM)
        # stream-K variants (streamk > 0) are valid but not enumerated: slower than the grid
        # schedule at every measured point (docs/linear_sm90_wgmma.md, "Stream-K")
        if not out:
            out.append(self.default(problem, arch))
        return out

    def _enumerate(self, problem: LinearProblem, arch: str, fold: Fold
                   ) -> list[LinearSm90WgmmaVariant]:
        """space()'s enumeration for one fold (its token tiles sized to that fold's rows)."""
        rows = gemm_rows(LinearSm90WgmmaVariant(fold=fold), problem)
        out = []
        for packing in (Packing.SPLIT, Packing.NIB):
            for c, mw, bn in self._TILES:
                if bn > 64 and bn > 2 * rows:
                    continue
                if bn < 64 and 4 * bn < rows:      # narrow token tiles only for few rows
                    continue
                gx, gy = geometry_of(LinearSm90WgmmaVariant(c, mw, bn, fold=fold),
                                     problem).grid(rows, problem.n)
                tiles = gx * gy
                for sk in _SPLITS:
                    if sk > 1 and tiles * sk > 4 * _SMS:
                        continue
                    # 12-stage rings are valid but not enumerated: slower than 8 or 6 stages in
                    # 21 of 24 measured pairs (bench/results/h200/linear_wgmma_pdl_check.*)
                    for st in (6, 4, 8, 3):
                        for raster in (Raster.TOK, Raster.CH):
                            for pdl in (False, True):
                                v = LinearSm90WgmmaVariant(c, mw, bn, st, raster, packing, sk,
                                                           pdl, fold)
                                if self.why_invalid(v, problem, arch) is None:
                                    out.append(v)
        return out

    def prior(self, variant: LinearSm90WgmmaVariant, problem: LinearProblem) -> float:
        """Lower first (the tuner's ranked search): a token tile close to the rows (at least
        16, at most 128 for the first tries), one m64 block per consumer warpgroup, one
        consumer warpgroup for token tiles of 32 rows or fewer and two from 128, 6 stages,
        raster "tok", the split packing, and a grid that fills the SMs without a ragged last
        wave (_wave_cost): what won on the H200 at prefill sizes and in the split-K study."""
        v, p = variant, problem
        want = min(128, max(16, pow2_ceil(gemm_rows(v, p))))
        s = abs(math.log2(v.bn) - math.log2(want))
        # narrow token tiles (<= 32): one consumer warpgroup (two CTAs per SM) won in the
        # split-K study; wide ones (>= 128): two; at 64 it went either way (tune6)
        s += 0.3 if (v.consumers == 2 and v.bn <= 32) or (v.consumers == 1 and v.bn >= 128) \
            else 0.0
        s += 0.0 if v.m_wg == 1 else 0.4
        if v.bn <= 32:     # small stages: the deeper ring first
            s += {8: 0.0, 6: 0.1, 4: 0.3}.get(v.stages, 0.5)
        else:
            s += {6: 0.0, 4: 0.2, 8: 0.3}.get(v.stages, 0.5)
        s += 0.0 if v.raster == Raster.TOK else 0.3
        s += 0.0 if v.packing == Packing.SPLIT else 1.0
        # measured (bench/results/h200/linear_wgmma_pdl_check.*): 0.83-1.09x its non-PDL twin,
        # geometric mean 1.00, workload dependent: PDL is tried right after its twin
        s += 0.15 if v.pdl else 0.0
        s += _wave_cost(v, p)
        if v.presum:
            # NOT measured yet: presum halves M-Ext's MMAs and rows (the GEMM is the plain
            # one) for about 0.5-1.5 us more quantizer per layer: ahead of its exact twin
            s -= 0.3
        return s

    def default(self, problem: LinearProblem, arch: str) -> LinearSm90WgmmaVariant:
        """Valid for any N % 64 == 0: two consumer warpgroups of 64 channels where N allows,
        a token tile of 128 rows, 6 stages (fewer for very short K)."""
        c = 2 if problem.n % 128 == 0 else 1
        nk = kp_of(problem) // 64
        v = LinearSm90WgmmaVariant(consumers=c, m_wg=1, bn=128, stages=max(2, min(6, nk)),
                                   raster=Raster.TOK, packing=Packing.SPLIT,
                                   fold=Fold.PRESUM if problem.kext_presum else Fold.EXACT)
        why = self.why_invalid(v, problem, arch)
        if why is not None:
            raise ValueError(f"linear_sm90_wgmma cannot run {problem.key()}: {why}")
        return v

    # ------------------------------------------------------------------ codegen
    def template_params(self, variant: LinearSm90WgmmaVariant, problem: LinearProblem) -> dict:
        g = geometry_of(variant, problem)
        presum = variant.presum
        return {"fmt": g.fmt, "mext": bool(g.mext), "packing": g.packing,
                "consumers": int(g.consumers), "m_wg": int(g.m_wg), "bn": int(g.bn),
                "stages": int(g.stages), "raster": g.raster, "store": g.store,
                "split_k": int(g.split_k), "pdl": bool(g.pdl),
                # presum (the template substitutes only; an exact render is what it was before
                # the axis): the FP16 operand / A type, the FP16 decode and its module's import
                "fold": variant.fold.value,
                "a_type": "cutlass.Float16" if presum else "BFloat16",
                "decode": "DP.decode_chunk_f16" if presum else "D.decode_chunk",
                "presum_import": ", linear_sm90_wgmma_presum as DP" if presum else "",
                # stream-K (substituted as well; "" / WgGeometry render the grid kernel as it
                # was before the axis): resgen.kernels.linear_sm90_wgmma_streamk
                "streamk": bool(variant.streamk),
                "streamk_import": ", linear_sm90_wgmma_streamk as SKM" if variant.streamk
                else "",
                "geometry_cls": "SKM.StreamKGeometry" if variant.streamk else "WgGeometry",
                "streamk_arg": f", streamk={variant.streamk}" if variant.streamk else "",
                # the producer layout (substituted: "" renders the warpgroup producer as before)
                "producer_arg": (f', producer="{variant.producer.value}"'
                                 if variant.producer != Producer.WG else "")}

    def compile_key(self, variant: LinearSm90WgmmaVariant, problem: LinearProblem
                    ) -> LinearProblem:
        """N, K(+ext) and M are run-time: the kernel depends only on the format and on M-Ext
        or not (K-Ext is the plain kernel over K + ext, W4A16 the plain kernel on the BF16
        activations). Canonical m/n/k keep keys valid. A K-Ext presum workload runs the
        presum kernel over K: M-Ext presum's compile."""
        comp = "full" if problem.compensation == "full" or problem.kext_presum else "none"
        return LinearProblem(problem.fmt, comp, 1, 4096, 4096, True)

    def compile_args(self, variant: LinearSm90WgmmaVariant, problem: LinearProblem
                     ) -> list[Any]:
        import cuda.bindings.driver as cuda
        import cutlass
        import cutlass.cute as cute
        from cutlass.cute.runtime import make_ptr

        gm = cute.AddressSpace.gmem
        xdt = cutlass.Float16 if variant.presum else cutlass.BFloat16
        return [make_ptr(cutlass.Int32, 0, gm, 16), make_ptr(xdt, 0, gm, 16),
                make_ptr(cutlass.BFloat16, 0, gm, 16), make_ptr(cutlass.Float32, 0, gm, 4),
                make_ptr(cutlass.Float32, 0, gm, 4), make_ptr(cutlass.Float32, 0, gm, 16),
                make_ptr(cutlass.Int32, 0, gm, 4), cutlass.Int32(1), cutlass.Int32(1),
                cutlass.Int32(64 * variant.consumers * variant.m_wg), cutlass.Int32(2),
                *([cutlass.Int32(1)] if variant.streamk else []), cuda.CUstream(0)]

    def compile_module(self, path, variant: LinearSm90WgmmaVariant, problem: LinearProblem,
                       arch: str):
        """Compile the rendered module (build.compile_variant's hook) and refuse a kernel whose
        register budget cannot serve its setmaxnreg requests: setmaxnreg.inc blocks until the
        CTA's pool (launch registers x threads) has the registers, so a short pool would hang
        the GPU instead of failing."""
        from ..kernels import codegen
        from ..kernels.linear_sm90_wgmma_geom import CONSUMER_REGS, PRODUCER_REGS

        module = codegen.load_module(path)
        res = codegen.compile_entry(getattr(module, self.ENTRY),
                                    self.compile_args(variant, problem), arch)
        if res.ptx is not None and "setmaxnreg.inc" in res.ptx:
            need = 128 * PRODUCER_REGS + 128 * variant.consumers * CONSUMER_REGS
            have = None if res.registers is None else res.registers * 128 * (1 +
                                                                             variant.consumers)
            if have is None or have < need:
                raise RuntimeError(f"setmaxnreg needs a pool of {need} registers, the kernel "
                                   f"launches with {have} (registers {res.registers})")
        return res

    # ------------------------------------------------------------------ running
    def working_set_bytes(self, variant: LinearSm90WgmmaVariant, problem: LinearProblem) -> int:
        """Bytes of one input set (weight records + activation operand + output)."""
        from ..kernels.linear_sm90_wgmma_geom import record_bytes

        kp = kp_of(problem)
        rows = -(-gemm_rows(variant, problem) // 8) * 8      # make_xop pads to 8 rows
        return int(problem.n // 64 * kp // 64 * record_bytes(problem.fmt) + 4
                   + rows * kp * 2 + problem.m * problem.n * 2)

    # ------------------------------------------------------------------ launch (bind)
    def layout(self, qweight: QLinearWeight, packing: str) -> Any:
        """The weight in this family's layout (resgen.kernels.linear_sm90_wgmma_layout)."""
        from ..kernels.linear_sm90_wgmma_layout import prepare_wgmma_weight

        return prepare_wgmma_weight(qweight, packing)

    def xop_row_multiple(self, variant: LinearSm90WgmmaVariant, problem: LinearProblem) -> int:
        return 8

    def reads_past_rows(self, variant: LinearSm90WgmmaVariant) -> bool:
        """No: the TMA box reads rows past `rows` as zeros (the tensor map's extent is the
        real rows), so a W4A16 layer's BF16 activations are read in place where K = Kp."""
        return False

    def launcher(self, compiled: Any, variant: LinearSm90WgmmaVariant, problem: LinearProblem,
                 device: torch.device | str) -> Any:
        """resgen.kernels.linear_sm90_wgmma.WgmmaLauncher with the split-K workspace of
        `problem` reserved now (not at the first, perhaps captured, call)."""
        from ..kernels.linear_sm90_wgmma import WgmmaLauncher

        launch = WgmmaLauncher(compiled, geometry_of(variant, problem), device,
                               xop_dtype=torch.float16 if variant.presum else torch.bfloat16)
        launch.reserve(gemm_rows(variant, problem), problem.n)
        return launch

    def weight_sets(self, problem: LinearProblem, packing: str, device: Any, n_sets: int,
                    seed: int) -> list:
        return _weights(problem, packing, device, n_sets, seed)


FAMILY = register(LinearSm90WgmmaFamily())

_COMPILES: dict[tuple[str, str, str], Any] = {}


def compile_once(variant: LinearSm90WgmmaVariant, problem: LinearProblem, arch: str = "sm_90a"):
    """build.compile_variant, memoized in this process per (variant, compile key, arch): the
    GPU tests and the H200 bench share their compiles when they run in one process."""
    from . import build

    key = (variant.key(), FAMILY.compile_key(variant, problem).key(), arch)
    if key not in _COMPILES:
        _COMPILES[key] = build.compile_variant(FAMILY, variant, problem, arch)
    return _COMPILES[key]


# ----------------------------------------------------------------------------- input sets


_WEIGHTS: dict[tuple, list] = {}
_WEIGHTS_KEEP = 2       # prepared weight lists kept for the next variants / M of a layer


def _weights(problem: LinearProblem, packing: str, device, n_sets: int, seed: int) -> list:
    """[(qweight, WgWeight)] * n_sets for the layer of `problem` (any M), cached for the most
    recent layers: preparing big weights costs more than timing a variant."""
    from ..kernels.linear_sm90_wgmma_layout import prepare_wgmma_weight

    return cached_weight_sets(_WEIGHTS, _WEIGHTS_KEEP, prepare_wgmma_weight, problem,
                              packing, device, n_sets, seed)
