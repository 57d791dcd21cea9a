"""Kernel family linear_sm90_mma: Hopper decode FP4 linear layers (NVFP4 / MXFP4 weights, BF16
mma.sync on exactly decoded values, operand swap, M-Ext fold, K-Ext, split-K).

The variant axes (LinearSm90Variant) and what they change in the kernel
(resgen/templates/linear_sm90_mma.py.j2, geometry in resgen.kernels.linear_sm90_geom):
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
                       copied, so no barrier is needed)
    l2_prefetch        iterations ahead whose weight/scale spans lane 0 asks the copy engine to
                       pull into L2 (cp.async.bulk.prefetch.L2; 0 = none): later loads hit L2
    split_k, reduce    CTAs along K and how their partials meet: "atomic" (FP32 red.global into
                       a workspace, then a convert kernel; not deterministic) or "workspace"
                       (partials + per-tile semaphore, the last CTA sums in split order; one
                       launch, deterministic)
    packing            weight nibble layout and its decode ("nib" as in the design brief,
                       "split": sign apart from magnitude, 30% fewer integer ops)
Not implemented yet (no field, so no key pretends otherwise): activations staged through shared
memory (ldmatrix), output through shared memory, the quantizer fused into the prologue.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Sequence

import torch

from .family import CheckResult, register
from .variant import Choice, IntRange, LinearProblem, VariantBase

__all__ = ["Packing", "Pipeline", "Reduction", "LinearSm90Variant", "LinearSm90Family", "FAMILY",
           "TOLERANCE", "geometry_of", "kp_of", "rows_of"]

TOLERANCE = 3e-3
_MAX_REGS_EST = 232        # estimated live registers above which a variant would spill


class Packing(Choice):
    NIB = "nib"
    SPLIT = "split"


class Pipeline(Choice):
    DIRECT = "direct"
    REGS = "regs"
    CP_ASYNC = "cp_async"


class Reduction(Choice):
    NONE = "none"
    ATOMIC = "atomic"
    WORKSPACE = "workspace"


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

    @property
    def deterministic(self) -> bool:
        return self.reduce != Reduction.ATOMIC


def kp_of(problem: LinearProblem) -> int:
    """Kp: the kernel's padded reduction length (K, or K + ext, rounded up to 256)."""
    from ..kernels.layouts import K_ALIGN, pad_to

    block = 16 if problem.fmt == "nvfp4" else 32
    return pad_to(problem.k_ext(block), K_ALIGN)


def rows_of(problem: LinearProblem) -> int:
    return problem.rows


def geometry_of(variant: LinearSm90Variant, problem: LinearProblem):
    from ..kernels.linear_sm90_geom import Geometry

    return Geometry(fmt=problem.fmt, mext=problem.compensation == "full",
                    packing=variant.packing.value, n=problem.n, kq=kp_of(problem) // 64,
                    warps_m=variant.warps_m, warps_k=variant.warps_k, m_tiles=variant.m_tiles,
                    n_tiles=variant.n_tiles, groups=variant.groups,
                    pipeline=variant.pipeline.value, stages=variant.stages,
                    l2_prefetch=variant.l2_prefetch,
                    split_k=variant.split_k, reduce=variant.reduce.value)


def _reg_estimate(v: LinearSm90Variant) -> int:
    # weight + scale words live in registers: one iteration (two with the register double
    # buffer; cp_async reads them from shared memory one chunk at a time)
    per_iter = v.groups * v.m_tiles * 18
    held = {Pipeline.DIRECT: per_iter, Pipeline.REGS: 2 * per_iter,
            Pipeline.CP_ASYNC: v.m_tiles * 6}[v.pipeline]
    return 40 + held + 8 * v.n_tiles + 4 * v.m_tiles * v.n_tiles


class LinearSm90Family:
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
        if p.n % 16:
            return f"N={p.n} is not a multiple of 16 (one m16 tile)"
        warps = v.warps_m * v.warps_k
        if warps > 8:
            return f"{warps} warps per CTA (at most 8)"
        if p.n % (16 * v.m_tiles * v.warps_m):
            return (f"N={p.n} is not a multiple of 16 * m_tiles * warps_m = "
                    f"{16 * v.m_tiles * v.warps_m}")
        ng = kp_of(p) // 256
        div = v.split_k * v.warps_k * v.groups
        if ng % div:
            return (f"Kp/256 = {ng} K groups do not split evenly over split_k * warps_k * "
                    f"groups = {div}")
        if (v.pipeline == Pipeline.CP_ASYNC) != (v.stages > 1):
            return ("the cp_async pipeline needs stages >= 2" if v.pipeline == Pipeline.CP_ASYNC
                    else f"stages={v.stages} only applies to the cp_async pipeline")
        if (v.split_k > 1) != (v.reduce != Reduction.NONE):
            return ("split_k > 1 needs reduce atomic/workspace" if v.split_k > 1
                    else f"reduce={v.reduce.value} without split_k > 1")
        est = _reg_estimate(v)
        if est > _MAX_REGS_EST:
            return f"register estimate {est} > {_MAX_REGS_EST} (would spill)"
        smem = geometry_of(v, p).smem_bytes
        if smem > 227 * 1024:
            return f"{smem} bytes of shared memory per CTA (at most 227 KB)"
        nit = geometry_of(v, p).nit
        if v.pipeline == Pipeline.CP_ASYNC and v.stages > nit + 1:
            return f"{v.stages} stages for {nit} iterations per warp"
        if v.l2_prefetch >= nit:
            return f"L2 prefetch {v.l2_prefetch} iterations ahead of {nit} per warp"
        if v.pipeline == Pipeline.CP_ASYNC and 0 < v.l2_prefetch < v.stages:
            return "an L2 prefetch closer than the cp.async ring's depth does nothing"
        return None

    # ------------------------------------------------------------------ space
    def space(self, problem: LinearProblem, arch: str) -> Sequence[LinearSm90Variant]:
        """Every valid candidate, in a fixed order. Token tiles are limited to the ones that
        cover the rows without more than doubling them; split_k only where the CTAs along
        channels alone leave the 132 SMs of an H200 under-filled."""
        rows = problem.rows
        nts = [nt for nt in (1, 2, 4, 8) if nt == 1 or 8 * nt <= 2 * max(rows, 8)]
        out = []
        for packing in (Packing.SPLIT, Packing.NIB):
            for wm, wk in ((4, 1), (2, 2), (1, 4), (8, 1), (4, 2), (2, 4), (1, 8)):
                for mt in (1, 2, 4):
                    for nt in nts:
                        for u in (1, 2):
                            for pl, st, l2 in ((Pipeline.CP_ASYNC, 4, 0),
                                               (Pipeline.CP_ASYNC, 2, 0),
                                               (Pipeline.CP_ASYNC, 6, 0),
                                               (Pipeline.DIRECT, 1, 0), (Pipeline.DIRECT, 1, 2),
                                               (Pipeline.REGS, 1, 0), (Pipeline.REGS, 1, 2)):
                                for sk, red in ((1, Reduction.NONE),
                                                (2, Reduction.WORKSPACE),
                                                (4, Reduction.WORKSPACE),
                                                (2, Reduction.ATOMIC),
                                                (4, Reduction.ATOMIC)):
                                    v = LinearSm90Variant(wm, wk, mt, nt, u, pl, st, l2, sk,
                                                          red, packing)
                                    if sk > 1 and problem.n // (16 * mt * wm) >= 264:
                                        continue
                                    if self.why_invalid(v, problem, arch) is None:
                                        out.append(v)
        if not out:                     # tiny problems: fewer than 4 warps fit
            out.append(self.default(problem, arch))
        return out

    def default(self, problem: LinearProblem, arch: str) -> LinearSm90Variant:
        """Valid for any N % 16 == 0: the most K-split of (4, 2, 1) warps that divides the K
        groups, the rest of 4 warps along channels where N allows."""
        ng = kp_of(problem) // 256
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
                "split_k": int(g.split_k), "reduce": g.reduce}

    def compile_key(self, variant: LinearSm90Variant, problem: LinearProblem) -> LinearProblem:
        """M is a run-time argument (the grid's token tiles): one compile per (fmt, mode, N,
        K(+ext))."""
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
                cutlass.Int32(1), cutlass.Int32(1), cuda.CUstream(0)]

    # ------------------------------------------------------------------ running
    def working_set_bytes(self, variant: LinearSm90Variant, problem: LinearProblem) -> int:
        """Bytes of one input set (weights + scales + activation operand + output)."""
        kp = kp_of(problem)
        per_w = 0.5 + (1 / 16 if problem.fmt == "nvfp4" else 1 / 32)
        t_pad = -(-problem.rows // (8 * variant.n_tiles)) * 8 * variant.n_tiles
        return int(problem.n * kp * per_w + t_pad * kp * 2 + problem.m * problem.n * 2)

    def runner(self, compiled: Any, variant: LinearSm90Variant, problem: LinearProblem,
               device: Any, n_sets: int = 1, seed: int = 0) -> "LinearSm90Runner":
        return LinearSm90Runner(compiled, variant, problem, device, n_sets, seed)


FAMILY = register(LinearSm90Family())


# ----------------------------------------------------------------------------- runner


def random_layer(problem: LinearProblem, device, gen: torch.Generator):
    """A random weight (heavy-tailed rows) prepared for `problem`, and its calibration x."""
    from .. import calibrate as C

    n, k = problem.n, problem.k
    w = torch.randn(n, k, generator=gen, device=device)
    w = w * torch.exp(0.5 * torch.randn(n, 1, generator=gen, device=device))
    sel = None
    if problem.ratio is not None:
        xc = torch.randn(64, k, generator=gen, device=device)
        st = C.ChannelStats(k)
        st.update(xc)
        sel = C.select_channels(st.mean_abs(), problem.ratio)
    isc = None
    if problem.fmt == "nvfp4" and problem.static_scale:
        isc = torch.tensor(4.0 / (6 * 448))          # activations ~ N(0, 1): amax about 4
    return C.prepare_weight(w, problem.fmt, sel, input_scale=isc)


def _compensation(problem: LinearProblem):
    return problem.ratio if problem.ratio is not None else problem.compensation


_SETS: dict[tuple, list] = {}
_SETS_KEEP = 2          # input-set lists kept for reuse by the next variants of a problem


def _input_sets(problem: LinearProblem, packing: str, t_multiple: int, device, n_sets: int,
                seed: int) -> list:
    """[(qweight, Sm90Weight, x, xop, alpha_x)] * n_sets, cached for the few most recent
    problems: preparing big weights costs more than timing a variant."""
    from ..kernels.layouts import prepare_sm90_weight
    from ..kernels.linear_sm90 import make_xop

    key = (problem.key(), packing, t_multiple, str(device), n_sets, seed)
    if key in _SETS:
        return _SETS[key]
    while len(_SETS) >= _SETS_KEEP:
        _SETS.pop(next(iter(_SETS)))
    gen = torch.Generator(device=device).manual_seed(seed)
    sets = []
    for _ in range(max(1, n_sets)):
        qw = random_layer(problem, device, gen)
        wt = prepare_sm90_weight(qw, packing)
        x = torch.randn(problem.m, problem.k, generator=gen, device=device)
        xop, ax = make_xop(x, qw, _compensation(problem), t_multiple=t_multiple)
        sets.append((qw, wt, x, xop, ax))
    _SETS[key] = sets
    return sets


class LinearSm90Runner:
    """n_sets complete input sets (weights + activation operand), one compiled variant.

    The timed call is the GEMM (+ fold + epilogue; + convert kernel for atomic split-K) on a
    prepared activation operand: activation quantization is NOT included until the fused
    quantizer (quant_sm90) is wired in front of it.
    """

    def __init__(self, compiled, variant, problem, device, n_sets, seed):
        from ..kernels.linear_sm90 import LinearSm90Launcher

        self.variant, self.problem = variant, problem
        self.geom = geometry_of(variant, problem)
        self.device = torch.device(device)
        self.gen = torch.Generator(device=self.device).manual_seed(seed + 1)
        self.comp = _compensation(problem)
        self.m, self.rows = problem.m, problem.rows
        self.sets = _input_sets(problem, variant.packing.value, self.geom.tok, self.device,
                                n_sets, seed)
        self.out = torch.empty(self.m, problem.n, dtype=torch.bfloat16, device=self.device)
        self.quantizer = None
        self.qsets: list = []
        self.launcher = LinearSm90Launcher(compiled, self.geom,
                                           ws_floats=self.geom.ws_floats(self.rows, self.m),
                                           sem_count=self.geom.sem_count(self.rows),
                                           device=self.device)
        self.cur = 0

    def bytes_per_set(self) -> int:
        _, wt, _, xop, _ = self.sets[0]
        return wt.nbytes() + xop.numel() * 2

    def rotate(self, i: int) -> None:
        self.cur = i % len(self.sets)

    def attach_quantizer(self, qkernel: Any) -> None:
        """Time the whole layer as BENCH.md asks: the fused quantizer (a compiled
        resgen.kernels.quant_sm90.QuantKernel writing the xop with kp_align 256) on bf16
        activations, then the GEMM on its operand; two launches per call."""
        self.quantizer = qkernel
        self.qsets = []
        for qw, _, x, _, _ in self.sets:
            outs = qkernel.outputs(self.m, row_multiple=self.geom.tok, device=self.device)
            alpha = None
            if qkernel.config.alpha == "static":
                alpha = torch.as_tensor(qw.input_scale, dtype=torch.float32,
                                        device=self.device).reshape(1)
            self.qsets.append((x.to(torch.bfloat16).contiguous(), outs, alpha))

    def _quantized_call(self, xb, outs, alpha, wt, out) -> torch.Tensor:
        op = self.quantizer(xb, outs, alpha=alpha)
        return self.launcher(wt, op.xop, xb.shape[0], self.rows, op.alpha, out)

    def __call__(self) -> torch.Tensor:
        _, wt, _, xop, ax = self.sets[self.cur]
        if self.quantizer is not None:
            xb, outs, alpha = self.qsets[self.cur]
            return self._quantized_call(xb, outs, alpha, wt, self.out)
        return self.launcher(wt, xop, self.m, self.rows, ax, self.out)

    def check_quantized(self) -> CheckResult:
        """Fresh bf16 activations through the attached quantizer and the GEMM vs
        resgen.reference.linear on the same bf16 values."""
        from .. import reference

        if self.quantizer is None:
            raise ValueError("no quantizer attached")
        qw, wt, _, _, _ = self.sets[0]
        _, outs, alpha = self.qsets[0]
        xb = (torch.randn(self.m, self.problem.k, generator=self.gen, device=self.device)
              * 3).to(torch.bfloat16)
        out = torch.full((self.m, self.problem.n), float("nan"), dtype=torch.bfloat16,
                         device=self.device)
        self._quantized_call(xb, outs, alpha, wt, out)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return compare(out, reference.linear(xb.float(), qw, self.comp))

    def run_on(self, x: torch.Tensor, set_index: int = 0) -> torch.Tensor:
        """Quantize x in torch, run the kernel on set `set_index`'s weight; poisoned output."""
        from ..kernels.linear_sm90 import make_xop

        qw, wt, _, _, _ = self.sets[set_index]
        xop, ax = make_xop(x, qw, self.comp, t_multiple=self.geom.tok)
        out = torch.full((x.shape[0], self.problem.n), float("nan"), dtype=torch.bfloat16,
                         device=self.device)
        rows = 2 * x.shape[0] if self.comp == "full" else x.shape[0]
        self.launcher(wt, xop, x.shape[0], rows, ax, out)
        return out

    def check(self) -> CheckResult:
        """Fresh random activations, NaN-poisoned output, vs resgen.reference.linear."""
        from .. import reference

        qw = self.sets[0][0]
        x = torch.randn(self.m, self.problem.k, generator=self.gen, device=self.device) * 3
        out = self.run_on(x)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        ref = reference.linear(x, qw, self.comp)
        return compare(out, ref)


def compare(out: torch.Tensor, ref: torch.Tensor, tol: float = TOLERANCE) -> CheckResult:
    """||out - ref|| / ||ref|| <= tol, no NaN/Inf anywhere (poisoned outputs must be written)."""
    o = out.float()
    bad = int((~torch.isfinite(o)).sum())
    if bad:
        return CheckResult(False, math.inf, tol, f"{bad} of {o.numel()} outputs NaN/Inf "
                                                 f"(unwritten or overflow)")
    den = float(ref.double().norm())
    rel = float((o.double() - ref.double()).norm()) / den if den else float(o.abs().max())
    ok = rel <= tol
    return CheckResult(ok, rel, tol, "" if ok else f"rel err {rel:.3e} > {tol}")
