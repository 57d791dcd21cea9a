"""Kernel family quant_sm100: the fused residue quantizer on Blackwell (sm_100a): bf16 activations
-> FP4 base + residue codes and block scales in the operand layout tcgen05 block-scaled MMA
reads (resgen.kernels.sm100_layout / sm100_operand), row_pair / tile8 (M-Ext) or plain rows
with the K-Ext extension, scale factors tile-padded for the consuming GEMM's MMA tile.
Compiled for sm_100a on the CPU and checked there byte for byte through its store-addressing
simulation (resgen.kernels.quant_sm100_sim); never run: there is no Blackwell GPU here.

The problem (QuantSm100Problem, op "quantize") says what the consuming linear_sm100_tc variant
reads: format, compensation, M, K, static or dynamic NVFP4 tensor scale, the row layout and
the SF tile (the GEMM's activation rows per MMA tile, 8..128). The variant repeats the layout
and alpha mode (a variant key alone names one kernel) and adds the tuning axes ept (8: the
paper's pack8, a block over 2 lanes; 16: one NVFP4 block per lane), warps, unroll.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Sequence

import torch

from ..kernels import quant_sm100 as Q
from ..kernels.sm100_layout import act_rows, sf_cols, sf_rows
from .cover import covering_subset
from .family import CheckResult, KernelFamilyBase, register
from .variant import Choice, IntRange, LinearProblem, ProblemBase, VariantBase

__all__ = ["QLayout", "AlphaMode", "QuantSm100Problem", "QuantSm100Variant",
           "QuantSm100Family", "QuantSm100Runner", "FAMILY", "config_of", "covering_cases",
           "ptx_problems", "poison_written", "compare_operands"]

ARCH = "sm_100a"


class QLayout(Choice):
    PLAIN = "plain"
    ROW_PAIR = "row_pair"
    TILE8 = "tile8"


class AlphaMode(Choice):
    STATIC = "static"
    DYNAMIC = "dynamic"
    NONE = "none"


@dataclass(frozen=True, slots=True)
class QuantSm100Problem(ProblemBase):
    """One quantizer call in front of a linear_sm100_tc GEMM: x [m, k] bf16 -> its operand.

    compensation: as LinearProblem; layout: plain (none / K-Ext) or row_pair / tile8 (M-Ext);
    sf_tile: activation rows of the GEMM's MMA tile (scale factors tile-padded below 128)."""

    OP: ClassVar[str] = "quantize"
    fmt: str = field(default="nvfp4", metadata={"allowed": ("nvfp4", "mxfp4")})
    compensation: str = field(default="full", metadata={"allowed": Q.COMPENSATIONS})
    m: int = field(default=1, metadata={"range": IntRange(1, 1 << 20)})
    k: int = field(default=4096, metadata={"range": IntRange(256, 1 << 20)})
    static_scale: bool = True
    layout: str = field(default="row_pair", metadata={"allowed": ("plain", "row_pair",
                                                                  "tile8")})
    sf_tile: int = field(default=8, metadata={"range": IntRange(8, 128, pow2=True)})

    @classmethod
    def for_linear(cls, lp: LinearProblem, layout: str | None = None,
                   sf_tile: int | None = None) -> "QuantSm100Problem":
        """The quantizer in front of a linear layer: row_pair for M-Ext unless given, the SF
        tile of the linear_sm100_tc default for that many rows unless given."""
        if layout is None:
            layout = "row_pair" if lp.compensation == "full" else "plain"
        if sf_tile is None:
            sf_tile = Q.default_sf_tile(act_rows(lp.m, layout))
        return cls(fmt=lp.fmt, compensation=lp.compensation, m=lp.m, k=lp.k,
                   static_scale=lp.static_scale, layout=layout, sf_tile=sf_tile)

    def alpha_mode(self) -> AlphaMode:
        if self.fmt == "mxfp4":
            return AlphaMode.NONE
        return AlphaMode.STATIC if self.static_scale else AlphaMode.DYNAMIC


@dataclass(frozen=True, slots=True)
class QuantSm100Variant(VariantBase):
    FAMILY: ClassVar[str] = "quant_sm100"
    layout: QLayout = field(default=QLayout.ROW_PAIR, metadata={"short": "L"})
    alpha: AlphaMode = field(default=AlphaMode.STATIC, metadata={"short": "a"})
    ept: int = field(default=8, metadata={"range": IntRange(8, 16, pow2=True), "short": "e"})
    warps: int = field(default=4, metadata={"range": IntRange(1, 8, pow2=True), "short": "w"})
    unroll: int = field(default=1, metadata={"range": IntRange(1, 4, pow2=True), "short": "u"})


def config_of(variant: QuantSm100Variant, problem: QuantSm100Problem) -> Q.QuantSm100Config:
    return Q.QuantSm100Config(fmt=problem.fmt, compensation=problem.compensation, k=problem.k,
                              layout=variant.layout.value, sf_tile=problem.sf_tile,
                              ept=variant.ept, warps=variant.warps, unroll=variant.unroll,
                              alpha=variant.alpha.value)


class QuantSm100Family(KernelFamilyBase):
    NAME: ClassVar[str] = "quant_sm100"
    VARIANT: ClassVar[type] = QuantSm100Variant
    PROBLEM: ClassVar[type] = QuantSm100Problem
    TEMPLATE: ClassVar[str] = Q.TEMPLATE
    ARCHS: ClassVar[tuple[str, ...]] = (ARCH,)
    ENTRY: ClassVar[str] = "entry"

    def why_invalid(self, variant: QuantSm100Variant, problem: QuantSm100Problem,
                    arch: str) -> str | None:
        if arch not in self.ARCHS:
            return f"quant_sm100 runs on {self.ARCHS}, not {arch}"
        if not isinstance(variant, QuantSm100Variant) or \
                not isinstance(problem, QuantSm100Problem):
            return "not a QuantSm100Variant / QuantSm100Problem"
        if variant.layout.value != problem.layout:
            return f"layout {variant.layout.value} but the consumer needs {problem.layout}"
        if variant.alpha != problem.alpha_mode():
            return (f"alpha {variant.alpha.value} but the problem needs "
                    f"{problem.alpha_mode().value}")
        if problem.m * problem.k >= 1 << 31:
            return "more than 2^31 elements: the kernel indexes with 32-bit integers"
        return config_of(variant, problem).why_invalid()

    def space(self, problem: QuantSm100Problem, arch: str) -> Sequence[QuantSm100Variant]:
        """ept x warps x unroll (layout and alpha are the problem's), valid ones only."""
        fixed = dict(layout=QLayout(problem.layout), alpha=problem.alpha_mode())
        out = [QuantSm100Variant(ept=e, warps=w, unroll=u, **fixed)
               for e in (8, 16) for w in (4, 8, 2) for u in (1, 2, 4)]
        return [v for v in out if self.why_invalid(v, problem, arch) is None]

    def default(self, problem: QuantSm100Problem, arch: str) -> QuantSm100Variant:
        """pack8, 4 warps, no unroll."""
        v = QuantSm100Variant(layout=QLayout(problem.layout), alpha=problem.alpha_mode(),
                              ept=8, warps=4, unroll=1)
        why = self.why_invalid(v, problem, arch)
        if why:
            raise ValueError(f"quant_sm100 cannot run {problem.key()}: {why}")
        return v

    def template_params(self, variant: QuantSm100Variant, problem: QuantSm100Problem) -> dict:
        return config_of(variant, problem).template_params()

    def compile_key(self, variant: QuantSm100Variant, problem: QuantSm100Problem
                    ) -> QuantSm100Problem:
        """M and the slots are run-time arguments; static / dynamic alpha is the variant's."""
        return replace(problem, m=1)

    def compile_args(self, variant: QuantSm100Variant, problem: QuantSm100Problem) -> list:
        return Q.fake_args(config_of(variant, problem))

    def working_set_bytes(self, variant: QuantSm100Variant, problem: QuantSm100Problem) -> int:
        c = config_of(variant, problem)
        rows = act_rows(problem.m, problem.layout)
        return (problem.m * problem.k * 2 + rows * c.kp // 2
                + sf_rows(rows, problem.sf_tile) * sf_cols(c.kp, problem.fmt))

    def runner(self, compiled: Any, variant: QuantSm100Variant, problem: QuantSm100Problem,
               device: Any, n_sets: int = 1, seed: int = 0) -> "QuantSm100Runner":
        return QuantSm100Runner(compiled, variant, problem, device, n_sets, seed)


FAMILY = register(QuantSm100Family())


class QuantSm100Runner:
    """n_sets input sets (x, static alpha, K-Ext masks, own outputs) for one variant. check()
    quantizes fresh inputs into 0xFF-poisoned outputs and requires every byte (codes, scale
    factors, alpha) to equal resgen.kernels.sm100_operand.operand_reference."""

    def __init__(self, compiled: Any, variant: QuantSm100Variant, problem: QuantSm100Problem,
                 device: Any, n_sets: int = 1, seed: int = 0):
        from ..calibrate import Selection
        from ..kernels.quant_inputs import make_inputs, random_masks

        self.variant, self.problem = variant, problem
        self.config = config_of(variant, problem)
        self.kernel = Q.QuantSm100Kernel(self.config, compiled)
        self.device = torch.device(device)
        self.seed = seed
        self._make_inputs = make_inputs
        self.masks = (random_masks(problem.k, problem.compensation, seed, self.device)
                      if self.config.mode == "kext" else None)
        self.selection = (None if self.masks is None else
                          Selection(self.masks.cpu(), float(problem.compensation)))
        self.sets = []
        for i in range(max(1, n_sets)):
            x = make_inputs("randn", problem.m, problem.k, seed + i, self.device)
            self.sets.append((x, self._alpha_for(x), self.kernel.outputs(problem.m,
                                                                          self.device)))
        self.cur = 0
        self._round = 0

    def _alpha_for(self, x: torch.Tensor) -> torch.Tensor | None:
        if self.config.alpha != "static":
            return None
        from .. import formats

        return formats.nvfp4_global_scale(x.float()).reshape(1).to(self.device)

    def rotate(self, i: int) -> None:
        self.cur = i % len(self.sets)

    def __call__(self):
        x, alpha, out = self.sets[self.cur]
        return self.kernel(x, out, alpha=alpha, masks=self.masks)

    def check(self) -> CheckResult:
        from ..kernels.sm100_operand import operand_reference

        kinds = ("randn", "ties", "zeros", "mixed")
        kind = kinds[self._round % len(kinds)]
        self._round += 1
        m = min(self.problem.m, 1024)
        x = self._make_inputs(kind, m, self.problem.k, self.seed + 1000 + self._round,
                              self.device)
        alpha = self._alpha_for(x)
        ref = operand_reference(x.float(), self.problem.fmt, self.problem.compensation,
                                self.problem.layout, self.problem.sf_tile,
                                None if alpha is None else alpha.reshape(()),
                                self.selection, Q.slots_for(m, self.problem.layout))
        out = self.kernel.outputs(m, self.device)
        poison_written(out, self.config)
        got = self.kernel(x, out, alpha=alpha, masks=self.masks)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return compare_operands(got, ref, f"{kind} m={m}")


def poison_written(out: Any, config: Any) -> None:
    """0xFF into every code byte and scale factor the kernel must write (the real columns of
    every row; the padding stays zero, as the host allocated it and the GEMM needs it)."""
    from ..kernels.sm100_operand import pack_sf

    op = out.operand
    op.codes[:, : config.kq // 2] = 0xFF
    bs = 16 if config.fmt == "nvfp4" else 32
    ones = torch.zeros(op.rows, sf_cols(config.kp, config.fmt), dtype=torch.uint8,
                       device=op.sf.device)
    ones[:, : config.kq // bs] = 1
    mark = pack_sf(ones, config.sf_tile, op.rows)
    op.sf[mark != 0] = 0xFF
    if op.alpha is not None:
        op.alpha.fill_(float("nan"))


def compare_operands(got, ref, label: str = "") -> CheckResult:
    """Bit-exact comparison of two Sm100Operands (codes, scale factors, alpha); rel_err is the
    fraction of mismatching bytes."""
    pairs = [("codes", got.codes, ref.codes), ("sf", got.sf, ref.sf)]
    if ref.alpha is not None:
        pairs.append(("alpha", got.alpha.view(torch.int32), ref.alpha.view(torch.int32)))
    bad, total, detail = 0, 0, []
    for name, a, b in pairs:
        if a.shape != b.shape:
            return CheckResult(False, float("inf"), 0.0,
                               f"{label}: {name} shape {tuple(a.shape)} != {tuple(b.shape)}")
        diff = a.cpu() != b.cpu()
        n = int(diff.sum())
        bad += n
        total += diff.numel()
        if n:
            detail.append(f"{name}: {n} of {diff.numel()} differ")
    return CheckResult(bad == 0, bad / max(total, 1), 0.0,
                       "" if not bad else f"{label}: " + "; ".join(detail))


# ----------------------------------------------------------------------------- compile checks


def covering_cases() -> list[tuple[QuantSm100Problem, QuantSm100Variant]]:
    """(problem, variant) pairs covering every format, compensation mode, row layout, alpha
    mode, SF tile and every value of ept / warps / unroll at least once (greedy set cover):
    what CI compiles for sm_100a."""
    probs = []
    for fmt, comp, layout, static in (("nvfp4", "full", "row_pair", True),
                                      ("nvfp4", "full", "tile8", False),
                                      ("mxfp4", "none", "plain", True),
                                      ("nvfp4", "0.125", "plain", True),
                                      ("mxfp4", "0.5", "plain", True)):
        for sf_tile in (8, 16, 32, 64, 128):
            lp = LinearProblem(fmt, comp, 4, 4096, 4096, static_scale=static)
            qp = QuantSm100Problem.for_linear(lp, layout=layout, sf_tile=sf_tile)
            try:
                FAMILY.default(qp, ARCH)
            except ValueError:            # tile8 rows need an SF tile of 16 or more
                continue
            probs.append(qp)
    items = [(p, v) for p in probs for v in FAMILY.space(p, ARCH)]
    p1 = probs[0]
    items.append((p1, replace(FAMILY.default(p1, ARCH), warps=1)))

    def pairs(item):
        p, v = item
        return ({(f, getattr(v, f)) for f in v.__dataclass_fields__}
                | {("fmt", p.fmt), ("comp", Q._mode(p.compensation)), ("sf_tile", p.sf_tile)})

    return covering_subset(items, pairs)


def ptx_problems(variant: QuantSm100Variant, problem: QuantSm100Problem, ptx: str) -> list[str]:
    """What is wrong with a compiled quantizer's PTX (empty: nothing)."""
    bad = []
    if ".target sm_100a" not in ptx:
        bad.append("not sm_100a")
    entries = ptx.count(".entry")
    if entries != (2 if variant.alpha == AlphaMode.DYNAMIC else 1):
        bad.append(f"{entries} kernels (the amax kernel exactly with dynamic alpha)")
    if "griddepcontrol.launch_dependents" not in ptx:
        bad.append("no griddepcontrol.launch_dependents (PDL for the GEMM behind)")
    if "st.global.b8" not in ptx and "st.global.u8" not in ptx:
        bad.append("no byte stores (scale factors)")
    if ".ftz" in ptx:
        bad.append("flush-to-zero arithmetic (formats keeps subnormals)")
    if "ld.local" in ptx or "st.local" in ptx:
        bad.append("local memory")
    return bad
