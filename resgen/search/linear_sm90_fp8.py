"""Kernel family linear_sm90_fp8: MXFP4 W4A4 (plain, compensation "none") on Hopper's FP8
tensor cores, exactly up to FP32 summation order (issue 20, section 3). Design and open
questions: docs/linear_sm90_fp8.md.

EXPERIMENTAL, OPT-IN: never measured on a GPU yet, so it is out of the default tune set, the
runtime's fallbacks and the shipped table's coverage. Every predicate answer is "experimental"
unless RESGEN_EXPERIMENTAL names the family (resgen.settings); then
`RESGEN_EXPERIMENTAL=linear_sm90_fp8 resgen tune --families linear_sm90_fp8 ...` tunes it. Its
runner times the GEMM alone on pre-quantized activations (no device quantizer writes its
operand yet), so its rows are not comparable with the whole-layer rows of the other families.
resgen.ops does not serve it (no needs_quantizer / quantizer_problem: ops.Linear refuses it
with "has no run-time path"); `bind` (torch operand stage + GEMM) is for tests and benches.

The kernel (resgen/templates/linear_sm90_fp8.py.j2): wgmma.m64nNk32.f32.e4m3.e4m3, tokens on
the wgmma M (64 per consumer warpgroup), channels on its N; both operands E4M3 bytes in
shared memory (TMA, 128-byte swizzle). E2M1 -> E4M3 for the weights: offline (wload "e4m3":
1 byte per FP4 value, W4 numerics, W8 storage) or in the kernel (wload "fp4": packed E2M1 in
HBM, group 1); for the activations per call in torch (Fp8ActivationStage). Promotion: every
`group` k32 blocks the tensor core's partial fragment is added into the FP32 accumulator
times the two group scales (resgen.kernels.
linear_sm90_fp8_operand: group 1 = the E8M0 block scales, exact by construction; group 2 / 4 =
the block scales folded into the codes within E4M3's exact range, refused where a group spans
more than 14 binades).

Variant axes (LinearSm90Fp8Variant):
    consumers   consumer warpgroups (64 tokens each): bm = 64 or 128 tokens per CTA
    bn          channels per CTA (the wgmma N)
    stages      TMA ring depth (chunks of 128 K)
    group       k32 blocks per promotion (1, 2, 4): fewer FP32 promotions per MMA
    parts       partial fragments (1: wait for each group, 2: promote one while the next runs)
    raster      grid order ("tok": consecutive CTAs walk token tiles, "ch": channel tiles)
    wload       the weight in HBM: "e4m3" (one E4M3 byte per value, converted offline) or
                "fp4" (packed E2M1, half the bytes, converted to E4M3 in shared memory by
                the producer warpgroup's warps 1-3: resgen.kernels.linear_sm90_fp8_convert;
                group 1 only)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Sequence

import torch

from ..calibrate import QLinearWeight
from .family import CheckResult, KernelFamilyBase, register
from .sm90_linear import TOLERANCE, compare, random_layer
from .variant import Choice, IntRange, LinearProblem, VariantBase

__all__ = ["Raster", "WLoad", "LinearSm90Fp8Variant", "LinearSm90Fp8Family", "FAMILY",
           "geometry_of", "enabled", "compile_once", "Fp8Runner", "Fp8Binding"]

NAME = "linear_sm90_fp8"
_SMEM_MAX = 227 * 1024
_REG_OVERHEAD = 40
_SMS = 132


def enabled() -> bool:
    """Whether this experimental family is opted in (RESGEN_EXPERIMENTAL, resgen.settings)."""
    from ..settings import settings

    return NAME in settings().experimental


class Raster(Choice):
    TOK = "tok"
    CH = "ch"


class WLoad(Choice):
    E4M3 = "e4m3"
    FP4 = "fp4"


@dataclass(frozen=True, slots=True)
class LinearSm90Fp8Variant(VariantBase):
    FAMILY: ClassVar[str] = NAME
    consumers: int = field(default=2, metadata={"range": IntRange(1, 2), "short": "c"})
    bn: int = field(default=128, metadata={"range": IntRange(16, 256), "short": "bn"})
    stages: int = field(default=4, metadata={"range": IntRange(2, 12), "short": "st"})
    group: int = field(default=1, metadata={"range": IntRange(1, 4), "short": "g"})
    parts: int = field(default=2, metadata={"range": IntRange(1, 2), "short": "p"})
    raster: Raster = field(default=Raster.TOK, metadata={"short": "r"})
    wload: WLoad = field(default=WLoad.E4M3, metadata={"short": "w"})

    @property
    def deterministic(self) -> bool:
        return True


def geometry_of(variant: LinearSm90Fp8Variant):
    from ..kernels.linear_sm90_fp8_geom import Fp8Geometry

    return Fp8Geometry(consumers=variant.consumers, bn=variant.bn, stages=variant.stages,
                       group=variant.group, parts=variant.parts, raster=variant.raster.value,
                        wload=variant.wload.value)


def kp_of(problem: LinearProblem) -> int:
    from ..kernels.linear_sm90_fp8_operand import kp_fp8

    return kp_fp8(problem.k)


class LinearSm90Fp8Family(KernelFamilyBase):
    EXPERIMENTAL: ClassVar[bool] = True
    NAME: ClassVar[str] = NAME
    VARIANT: ClassVar[type] = LinearSm90Fp8Variant
    PROBLEM: ClassVar[type] = LinearProblem
    TEMPLATE: ClassVar[str] = "linear_sm90_fp8.py.j2"
    ARCHS: ClassVar[tuple[str, ...]] = ("sm_90a",)
    ENTRY: ClassVar[str] = "entry"
    INPUT_SEED: ClassVar[int] = 104729

    # ------------------------------------------------------------------ validity
    def problem_invalid(self, problem: LinearProblem) -> str | None:
        if not enabled():
            return (f"{NAME} is experimental (not yet measured on a GPU): opt in with "
                    f"RESGEN_EXPERIMENTAL={NAME}")
        if not isinstance(problem, LinearProblem):
            return "not a LinearProblem"
        if problem.fmt != "mxfp4":
            return (f"{NAME} runs MXFP4 only (power-of-two block scales); NVFP4 has no exact "
                    "form on the FP8 tensor cores (resgen.kernels.linear_sm90_fp8_operand)")
        if problem.compensation not in ("none", "w4a8"):
            return (f"{NAME} runs plain W4A4 and W4A8 only (compensation 'none' / 'w4a8'), "
                    f"not {problem.compensation}")
        if problem.n % 64:
            return f"N={problem.n} is not a multiple of 64"
        return None

    def why_invalid(self, variant: LinearSm90Fp8Variant, problem: LinearProblem,
                    arch: str) -> str | None:
        v, p = variant, problem
        if arch not in self.ARCHS:
            return f"{NAME} runs on {self.ARCHS}, not {arch}"
        if not isinstance(v, LinearSm90Fp8Variant):
            return "not a LinearSm90Fp8Variant"
        why = self.problem_invalid(p)
        if why is not None:
            return why
        g = geometry_of(v)
        try:
            g.check()
        except ValueError as e:
            return str(e)
        if p.n % v.bn:
            return f"N={p.n} is not a multiple of bn={v.bn}"
        budget = 232 if v.consumers == 2 else 255
        if g.acc_regs + _REG_OVERHEAD > budget:
            return (f"{g.acc_regs} accumulator registers + {_REG_OVERHEAD} > {budget} "
                    "(would spill)")
        if g.smem_bytes > _SMEM_MAX:
            return f"{g.smem_bytes} bytes of shared memory per CTA (at most {_SMEM_MAX})"
        nk = kp_of(p) // 128
        if v.stages > nk:
            return f"{v.stages} stages for {nk} K chunks"
        tt, ct = g.tiles(p.m, p.n)
        if (ct if v.raster == Raster.TOK else tt) > 65535:
            return "grid y over 65535"
        return None

    def model_problems(self, models: Sequence[Any], *, tp: int, formats: Sequence[str],
                       compensations: Sequence[Any], m_buckets: Sequence[int]
                       ) -> list[LinearProblem]:
        """The models' MXFP4 plain layers at the M buckets from 64 on (prefill: the tiles
        are 64 or 128 tokens); none unless opted in, so `resgen tune` without
        RESGEN_EXPERIMENTAL plans nothing for this family."""
        comps = [c for c in ("none", "w4a8") if c in compensations]
        if not enabled() or "mxfp4" not in formats or not comps:
            return []
        out: list[LinearProblem] = []
        for spec in models:
            for sh in spec.linear_shapes(tp):
                for c in comps:
                    for m in m_buckets:
                        p = LinearProblem("mxfp4", c, int(m), int(sh.n), int(sh.k), True)
                        if p.m >= 64 and p not in out and self.problem_invalid(p) is None:
                            out.append(p)
        return out

    # ------------------------------------------------------------------ space
    _TILES = ((2, 128), (2, 64), (1, 128), (1, 192), (1, 256), (2, 192), (1, 64))

    def space(self, problem: LinearProblem, arch: str) -> Sequence[LinearSm90Fp8Variant]:
        """Every valid candidate in a fixed order: tiles (consumers, bn), E4M3 weights at
        groups 1 / 2 / 4 then FP4 weights (group 1), parts 2 / 1, 4 / 6 / 3 stages, both
        rasters. Empty when the family is not opted in (or cannot run the problem)."""
        out: list[LinearSm90Fp8Variant] = []
        if self.problem_invalid(problem) is not None:
            return out
        for c, bn in self._TILES:
            for wload, group in ((WLoad.E4M3, 1), (WLoad.E4M3, 2), (WLoad.E4M3, 4),
                                 (WLoad.FP4, 1)):
                for parts in (2, 1):
                    for st in (4, 6, 3):
                        for raster in (Raster.TOK, Raster.CH):
                            v = LinearSm90Fp8Variant(c, bn, st, group, parts, raster, wload)
                            if self.why_invalid(v, problem, arch) is None:
                                out.append(v)
        return out

    def prior(self, variant: LinearSm90Fp8Variant, problem: LinearProblem) -> float:
        """Lower first: fewer promotions (group 4 before 2 before 1: each promotion is
        bn / 2 FP32 multiply-adds per thread per group, against 16 bn MACs per k32 on the
        tensor core), double-buffered partials, two consumer warpgroups, bn 128, 4 stages,
        raster "tok", and a grid without a ragged last wave; the FP4 load (group 1) a little
        ahead of E4M3 group 1 at M <= 256 (half the weight bytes), behind above. Unmeasured:
        a guess."""
        v, p = variant, problem
        g = geometry_of(v)
        s = {4: 0.0, 2: 0.3, 1: 0.8}[v.group] + (0.0 if v.parts == 2 else 0.4)
        if v.wload == WLoad.FP4:
            s += -0.2 if p.m <= 256 else 0.2
        s += 0.0 if v.consumers == 2 else 0.3
        s += abs(math.log2(v.bn / 128)) * 0.5
        s += {4: 0.0, 6: 0.1, 3: 0.3}.get(v.stages, 0.5)
        s += 0.0 if v.raster == Raster.TOK else 0.2
        tt, ct = g.tiles(p.m, p.n)
        waves = tt * ct / _SMS
        s += 1.2 * (1 - waves) if waves <= 1 else 1.5 * (1 - waves / math.ceil(waves))
        return s

    def default(self, problem: LinearProblem, arch: str) -> LinearSm90Fp8Variant:
        """Group 1 (exact for every input), two consumer warpgroups, bn 128 where N allows
        (else 64), 4 stages. Returned even when the family is not opted in (why_invalid then
        says so), so the runtime's fallback loop moves on to the next family."""
        bn = 128 if problem.n % 128 == 0 else 64
        return LinearSm90Fp8Variant(consumers=2, bn=bn, stages=4, group=1, parts=2)

    # ------------------------------------------------------------------ codegen
    def template_params(self, variant: LinearSm90Fp8Variant, problem: LinearProblem) -> dict:
        g = geometry_of(variant)
        return {"consumers": int(g.consumers), "bn": int(g.bn), "stages": int(g.stages),
                "group": int(g.group), "parts": int(g.parts), "raster": g.raster,
                "wload": g.wload}

    def compile_key(self, variant: LinearSm90Fp8Variant, problem: LinearProblem
                    ) -> LinearProblem:
        """M, N and K are run-time: one compile per variant (W4A8 runs the same kernel: only
        the activation operand differs, E4M3 values with per-token scales)."""
        return LinearProblem("mxfp4", "none", 1, 4096, 4096, True)

    def compile_args(self, variant: LinearSm90Fp8Variant, problem: LinearProblem
                     ) -> list[Any]:
        import cuda.bindings.driver as cuda
        import cutlass
        import cutlass.cute as cute
        from cutlass.cute.runtime import make_ptr

        gm = cute.AddressSpace.gmem
        fp4 = variant.wload == WLoad.FP4
        wdt = cutlass.Uint8 if fp4 else cutlass.Float8E4M3FN
        sdt = cutlass.Uint8 if fp4 else cutlass.Float32
        return [make_ptr(cutlass.Float8E4M3FN, 0, gm, 16), make_ptr(cutlass.Float32, 0, gm, 16),
                make_ptr(wdt, 0, gm, 16), make_ptr(sdt, 0, gm, 16),
                make_ptr(cutlass.BFloat16, 0, gm, 16), cutlass.Int32(1), cutlass.Int32(16),
                cutlass.Int32(variant.bn), cutlass.Int32(256), cuda.CUstream(0)]

    def compile_module(self, path, variant: LinearSm90Fp8Variant, problem: LinearProblem,
                       arch: str):
        """Compile the rendered module and refuse a kernel whose register pool cannot serve
        its setmaxnreg requests (setmaxnreg.inc would block forever, not fail)."""
        from ..kernels import codegen
        from ..kernels.linear_sm90_fp8_geom import CONSUMER_REGS, PRODUCER_REGS

        module = codegen.load_module(path)
        res = codegen.compile_entry(getattr(module, self.ENTRY),
                                    self.compile_args(variant, problem), arch)
        if res.ptx is not None and "setmaxnreg.inc" in res.ptx:
            need = 128 * PRODUCER_REGS + 128 * variant.consumers * CONSUMER_REGS
            have = None if res.registers is None else res.registers * 128 * (
                1 + variant.consumers)
            if have is None or have < need:
                raise RuntimeError(f"setmaxnreg needs a pool of {need} registers, the kernel "
                                   f"launches with {have} (registers {res.registers})")
        return res

    # ------------------------------------------------------------------ running
    def working_set_bytes(self, variant: LinearSm90Fp8Variant, problem: LinearProblem) -> int:
        """Bytes of one input set: weight codes (E4M3 or packed E2M1) + activation codes,
        their group scales, the output."""
        kp = kp_of(problem)
        ng = kp // (32 * variant.group)
        rows = -(-problem.m // 16) * 16
        fp4 = variant.wload == WLoad.FP4
        wk = kp // 2 if fp4 else kp
        return int(problem.n * (wk + (1 if fp4 else 4) * ng) + rows * (kp + 4 * ng)
                   + problem.m * problem.n * 2)

    def layout(self, qweight: QLinearWeight, group: int, wload: WLoad | str = WLoad.E4M3
               ) -> Any:
        """The weight as the kernel reads it (resgen.kernels.linear_sm90_fp8_operand):
        wload e4m3: an Fp8Operand (fold_operand: E4M3 codes [N, Kp], group scales
        [Kp / (32 group), N]); fp4 (group 1): an Fp4Operand (packed E2M1 [N, Kp / 2], E8M0 block
        scale bytes [Kp / 32, N])."""
        from ..kernels.linear_sm90_fp8_operand import fold_operand, fp4_operand, kp_fp8

        if qweight.fmt != "mxfp4" or qweight.selection is not None:
            raise ValueError(f"{NAME} takes a plain MXFP4 weight (no K-Ext selection)")
        kp = kp_fp8(qweight.in_features)
        if WLoad(wload) == WLoad.FP4:
            if group != 1:
                raise ValueError(f"wload=fp4 is group 1 only, not {group}")
            return fp4_operand(qweight.q, kp, 16)
        return fold_operand(qweight.q, group, kp, 16)

    def launcher(self, compiled: Any, variant: LinearSm90Fp8Variant, problem: LinearProblem,
                 device: torch.device | str) -> Any:
        from ..kernels.linear_sm90_fp8 import Fp8Launcher

        return Fp8Launcher(compiled, geometry_of(variant), device)

    def bind(self, compiled: Any, variant: LinearSm90Fp8Variant, problem: LinearProblem,
             weight: Any, device: torch.device | str, *, launcher: Any = None,
             **unused: Any) -> "Fp8Binding":
        """The whole layer: run(xb, out), xb bf16 [M, K] -> out bf16 [M, N], the activations'
        operand built in torch per call (Fp8ActivationStage: not capturable, not fast)."""
        for key in ("quantizer", "alpha", "masks"):
            if unused.get(key) is not None:
                raise ValueError(f"{NAME} takes no {key} (MXFP4 plain only)")
        if launcher is None:
            launcher = self.launcher(compiled, variant, problem, device)
        return Fp8Binding(launcher, problem, weight)

    def runner(self, compiled: Any, variant: LinearSm90Fp8Variant, problem: LinearProblem,
               device: Any, n_sets: int = 1, seed: int = 0) -> "Fp8Runner":
        return Fp8Runner(self, compiled, variant, problem, device, n_sets, seed)


class Fp8Binding:
    """One compiled variant bound to one prepared weight (Fp8Operand): `binding(xb, out)`."""

    def __init__(self, launcher: Any, problem: LinearProblem, weight: Any) -> None:
        from ..kernels.linear_sm90_fp8 import Fp8ActivationStage

        self.launcher, self.problem, self.weight = launcher, problem, weight
        self.stage = Fp8ActivationStage(problem.k, weight.kp, weight.group,
                                        problem.compensation)

    def __call__(self, xb: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return self.launcher(self.weight, self.stage(xb), xb.shape[0], out)


class Fp8Runner:
    """n_sets input sets (a prepared weight + pre-quantized activations each) of one problem
    and one compiled variant. The timed call is the GEMM alone on set `cur` (the activations'
    operand built beforehand: no device quantizer for it exists yet); check() runs the whole
    bound layer (torch operand stage + GEMM) on fresh activations into a NaN-poisoned output
    against resgen.reference.linear."""

    def __init__(self, family: LinearSm90Fp8Family, compiled: Any,
                 variant: LinearSm90Fp8Variant, problem: LinearProblem, device: Any,
                 n_sets: int = 1, seed: int = 0) -> None:
        from ..kernels.linear_sm90_fp8 import Fp8ActivationStage

        self.family, self.variant, self.problem = family, variant, problem
        self.device = torch.device(device)
        self.launcher = family.launcher(compiled, variant, problem, self.device)
        gen = torch.Generator(device=self.device).manual_seed(seed * family.INPUT_SEED
                                                              + problem.m)
        self.gen = torch.Generator(device=self.device).manual_seed(seed + 1)
        self.qweight = random_layer(problem, self.device, gen)
        w0 = family.layout(self.qweight, variant.group, variant.wload)
        stage = Fp8ActivationStage(problem.k, w0.kp, variant.group, problem.compensation)
        self.sets = []
        for i in range(max(1, n_sets)):
            w = w0 if i == 0 else _clone_operand(w0)
            x = torch.randn(problem.m, problem.k, generator=gen, device=self.device)
            self.sets.append((w, stage(x)))
        self.binding = family.bind(compiled, variant, problem, w0, self.device,
                                   launcher=self.launcher)
        self.out = torch.empty(problem.m, problem.n, dtype=torch.bfloat16, device=self.device)
        self.cur = 0

    def rotate(self, i: int) -> None:
        self.cur = i % len(self.sets)

    def __call__(self) -> torch.Tensor:
        w, x = self.sets[self.cur]
        return self.launcher(w, x, self.problem.m, self.out)

    def check(self) -> CheckResult:
        from ..reference import linear, linear_w4a8

        xb = (torch.randn(self.problem.m, self.problem.k, generator=self.gen,
                          device=self.device) * 3).to(torch.bfloat16)
        out = torch.full((self.problem.m, self.problem.n), float("nan"),
                         dtype=torch.bfloat16, device=self.device)
        self.binding(xb, out)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        ref = (linear_w4a8(xb.float(), self.qweight) if self.problem.compensation == "w4a8"
               else linear(xb.float(), self.qweight, "none"))
        return compare(out, ref, TOLERANCE)


def _clone_operand(op: Any) -> Any:
    from ..kernels.linear_sm90_fp8_operand import Fp4Operand, Fp8Operand

    if isinstance(op, Fp4Operand):
        return Fp4Operand(op.packed.clone(), op.scales.clone(), op.rows, op.group)
    return Fp8Operand(op.codes.clone(), op.scales.clone(), op.rows, op.group)


FAMILY = register(LinearSm90Fp8Family())

_COMPILES: dict[tuple[str, str], Any] = {}


def compile_once(variant: LinearSm90Fp8Variant, arch: str = "sm_90a"):
    """build.compile_variant, memoized in this process per (variant, arch)."""
    from . import build

    key = (variant.key(), arch)
    if key not in _COMPILES:
        _COMPILES[key] = build.compile_variant(FAMILY, variant,
                                               FAMILY.compile_key(variant, LinearProblem("mxfp4")),
                                               arch)
    return _COMPILES[key]
