"""Kernel family quant_sm90: the fused residue quantizer on Hopper (bf16 activations -> FP4
base + residue codes / scales and / or the exact BF16 GEMM operand xop).

The problem (QuantProblem, op "quantize") says what the consumer needs: format, compensation
mode, M, K, static or dynamic NVFP4 tensor scale, the operand row layout (plain, row_pair,
tile8), which outputs (codes + scales, xop, or both) and the xop column granularity. The
variant (QuantSm90Variant) repeats the layout / outputs / alpha choices, so that a variant key
alone names one kernel (why_invalid rejects a variant that does not match its problem), and
adds the tuning axes:
    ept      elements per lane: 8 (the paper's pack8: an NVFP4 block spans 2 lanes, a shuffle
             reduces its amax) or 16 (pack16: one NVFP4 block per lane, the per-block scale math
             done once per 16 elements; two 16-byte loads per lane)
    warps    warps per CTA (each warp owns one 32 * ept channel tile of one token at a time)
    unroll   warp tiles per warp, whose loads are all issued before any is quantized
    persist  a resident grid whose warps loop over the tiles, the next iteration's loads in
             flight while the current one is quantized (unroll = tiles per iteration)
Layout contract, numerics and costs: resgen/kernels/quant_sm90.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Sequence

import torch

from ..kernels import quant_sm90 as Q
from .family import CheckResult, KernelFamilyBase, register
from .variant import Choice, IntRange, LinearProblem, ProblemBase, VariantBase

__all__ = ["QLayout", "Outputs", "AlphaMode", "QuantProblem", "QuantSm90Variant",
           "QuantSm90Family", "QuantSm90Runner", "FAMILY", "config_of"]

_WARP_TILE_MIN = 32 * 8        # K must be a multiple of one pack8 warp tile (256 channels)


class QLayout(Choice):
    PLAIN = "plain"
    ROW_PAIR = "row_pair"
    TILE8 = "tile8"


class Outputs(Choice):
    CODES = "codes"      # codes + scales (ModelOpt layout)
    XOP = "xop"          # the exact BF16 operand of the Hopper GEMMs
    BOTH = "both"


class AlphaMode(Choice):
    STATIC = "static"    # NVFP4, calibrated tensor scale given: one pass over x
    DYNAMIC = "dynamic"  # NVFP4, alpha = amax(x) / 2688: an extra reduction kernel
    NONE = "none"        # MXFP4: no tensor scale


@dataclass(frozen=True, slots=True)
class QuantProblem(ProblemBase):
    """One quantizer call: x [m, k] bf16 -> the operand a linear kernel consumes.

    compensation: as LinearProblem ("none" | "full" | K-Ext ratio "0.125" .. "1.0").
    layout: "plain" (none / K-Ext) or "row_pair" / "tile8" (full: M-Ext).
    kp_align: xop columns are padded to this multiple (64, 128 or 256).
    """

    OP: ClassVar[str] = "quantize"
    fmt: str = field(default="nvfp4", metadata={"allowed": ("nvfp4", "mxfp4")})
    compensation: str = field(default="full", metadata={"allowed": Q.COMPENSATIONS})
    m: int = field(default=1, metadata={"range": IntRange(1, 1 << 20)})
    k: int = field(default=4096, metadata={"range": IntRange(256, 1 << 20)})
    static_scale: bool = True
    layout: str = field(default="row_pair", metadata={"allowed": Q.LAYOUTS})
    outputs: str = field(default="xop", metadata={"allowed": ("codes", "xop", "both")})
    kp_align: int = field(default=64, metadata={"range": IntRange(64, 256, pow2=True)})

    @classmethod
    def for_linear(cls, lp: LinearProblem, layout: str | None = None, outputs: str = "xop",
                   kp_align: int = 64) -> "QuantProblem":
        """The quantizer call in front of a linear layer (layout: row_pair for M-Ext unless
        given, plain otherwise)."""
        if layout is None:
            layout = "row_pair" if lp.compensation == "full" else "plain"
        return cls(fmt=lp.fmt, compensation=lp.compensation, m=lp.m, k=lp.k,
                   static_scale=lp.static_scale, layout=layout, outputs=outputs,
                   kp_align=kp_align)

    def alpha_mode(self) -> "AlphaMode":
        if self.fmt == "mxfp4":
            return AlphaMode.NONE
        return AlphaMode.STATIC if self.static_scale else AlphaMode.DYNAMIC


@dataclass(frozen=True, slots=True)
class QuantSm90Variant(VariantBase):
    FAMILY: ClassVar[str] = "quant_sm90"
    layout: QLayout = field(default=QLayout.ROW_PAIR, metadata={"short": "L"})
    outputs: Outputs = field(default=Outputs.XOP, metadata={"short": "o"})
    alpha: AlphaMode = field(default=AlphaMode.STATIC, metadata={"short": "a"})
    ept: int = field(default=8, metadata={"range": IntRange(8, 16, pow2=True), "short": "e"})
    warps: int = field(default=4, metadata={"range": IntRange(1, 8, pow2=True), "short": "w"})
    unroll: int = field(default=1, metadata={"range": IntRange(1, 4, pow2=True), "short": "u"})
    persist: bool = field(default=False, metadata={"short": "p"})


def config_of(variant: QuantSm90Variant, problem: QuantProblem) -> Q.QuantConfig:
    """The kernel configuration a (variant, problem) pair renders."""
    out = variant.outputs.value
    return Q.QuantConfig(fmt=problem.fmt, compensation=problem.compensation, k=problem.k,
                         layout=variant.layout.value, ept=variant.ept, warps=variant.warps,
                         unroll=variant.unroll, persist=variant.persist,
                         write_codes=out in ("codes", "both"),
                         write_xop=out in ("xop", "both"), alpha=variant.alpha.value,
                         kp_align=problem.kp_align)


class QuantSm90Family(KernelFamilyBase):
    NAME: ClassVar[str] = "quant_sm90"
    VARIANT: ClassVar[type] = QuantSm90Variant
    PROBLEM: ClassVar[type] = QuantProblem
    TEMPLATE: ClassVar[str] = Q.TEMPLATE
    ARCHS: ClassVar[tuple[str, ...]] = ("sm_90a",)
    ENTRY: ClassVar[str] = "entry"

    # ------------------------------------------------------------------ validity
    def problem_invalid(self, problem: QuantProblem) -> str | None:
        """Why the family cannot serve a problem at all (None if it can)."""
        if not isinstance(problem, QuantProblem):
            return f"not a QuantProblem: {type(problem).__name__}"
        if problem.k % _WARP_TILE_MIN:
            return (f"K={problem.k} is not a multiple of {_WARP_TILE_MIN} "
                    f"(32 lanes x 8 channels)")
        try:
            s = Q.operand_shape(problem.fmt, problem.compensation, problem.k, problem.m,
                                problem.layout, 16, problem.kp_align)
        except ValueError as e:
            return str(e)
        if problem.m * problem.k >= 1 << 31 or s.t_pad * s.kp >= 1 << 31:
            return "more than 2^31 elements: the kernel indexes with 32-bit integers"
        return None

    def why_invalid(self, variant: QuantSm90Variant, problem: QuantProblem,
                    arch: str) -> str | None:
        if arch not in self.ARCHS:
            return f"quant_sm90 runs on {self.ARCHS}, not {arch}"
        if not isinstance(variant, QuantSm90Variant):
            return f"not a QuantSm90Variant: {type(variant).__name__}"
        why = self.problem_invalid(problem)
        if why:
            return why
        if variant.layout.value != problem.layout:
            return f"layout {variant.layout.value} but the consumer needs {problem.layout}"
        if variant.outputs.value != problem.outputs:
            return f"writes {variant.outputs.value} but the consumer needs {problem.outputs}"
        if variant.alpha != problem.alpha_mode():
            return (f"alpha {variant.alpha.value} but the problem needs "
                    f"{problem.alpha_mode().value}")
        return config_of(variant, problem).why_invalid()

    # ------------------------------------------------------------------ space
    def space(self, problem: QuantProblem, arch: str) -> Sequence[QuantSm90Variant]:
        """Every candidate, in a fixed order: one-shot grids (ept, warps, unroll), then
        persistent grids (ept, warps 4 / 8, unroll 1 / 2); the layout, outputs and alpha fields
        are the problem's."""
        fixed = dict(layout=QLayout(problem.layout), outputs=Outputs(problem.outputs),
                     alpha=problem.alpha_mode())
        return ([QuantSm90Variant(ept=e, warps=w, unroll=u, **fixed)
                 for e in (8, 16) for w in (4, 8, 2) for u in (1, 2, 4)]
                + [QuantSm90Variant(ept=e, warps=w, unroll=u, persist=True, **fixed)
                   for e in (8, 16) for w in (4, 8) for u in (1, 2)])

    def default(self, problem: QuantProblem, arch: str) -> QuantSm90Variant:
        """pack8, 4 warps, no unroll: valid for every problem the family accepts."""
        why = self.problem_invalid(problem)
        if why:
            raise ValueError(f"quant_sm90 cannot run {problem.key()}: {why}")
        v = QuantSm90Variant(layout=QLayout(problem.layout), outputs=Outputs(problem.outputs),
                             alpha=problem.alpha_mode(), ept=8, warps=4, unroll=1)
        why = self.why_invalid(v, problem, arch)
        if why:
            raise ValueError(f"quant_sm90 cannot run {problem.key()}: {why}")
        return v

    # ------------------------------------------------------------------ codegen
    def template_params(self, variant: QuantSm90Variant, problem: QuantProblem) -> dict:
        return config_of(variant, problem).template_params()

    def compile_key(self, variant: QuantSm90Variant, problem: QuantProblem) -> QuantProblem:
        """M and T_pad are run-time arguments: one compile per everything else."""
        return replace(problem, m=1)

    def compile_args(self, variant: QuantSm90Variant, problem: QuantProblem) -> list[Any]:
        return Q.fake_args(config_of(variant, problem))

    def working_set_bytes(self, variant: QuantSm90Variant, problem: QuantProblem) -> int:
        """Bytes one input set moves: x read plus every output written."""
        s = config_of(variant, problem).shape(problem.m)
        out = problem.m * problem.k * 2
        if problem.outputs in ("codes", "both"):
            out += s.t_pad * (s.kq // 2 + s.kq // s.block)
        if problem.outputs in ("xop", "both"):
            out += s.t_pad * s.kp * 2
        return out

    # ------------------------------------------------------------------ running
    def runner(self, compiled: Any, variant: QuantSm90Variant, problem: QuantProblem,
               device: Any, n_sets: int = 1, seed: int = 0) -> "QuantSm90Runner":
        return QuantSm90Runner(compiled, variant, problem, device, n_sets, seed)

    def bind(self, compiled: Any, variant: QuantSm90Variant, problem: QuantProblem,
             device: Any) -> "QuantCodesOp":
        """The layer quantizer as a run-time op writing FP4 codes (resgen.ops.quantizer):
        op(x, alpha=None, masks=None) -> (codes, scales, alpha), fresh tensors per call, the
        workspace allocated now and kept."""
        return QuantCodesOp(Q.QuantKernel(config_of(variant, problem), compiled), problem,
                            torch.device(device))

    @staticmethod
    def operand_geometry(problem: QuantProblem) -> tuple[int, int]:
        """(rows T, columns KQ) of the operand for problem.m tokens and a row multiple of 1."""
        s = Q.operand_shape(problem.fmt, problem.compensation, problem.k, problem.m,
                            problem.layout, 1, problem.kp_align)
        return s.t_pad, s.kq


class QuantCodesOp:
    """A compiled quant_sm90 variant that writes codes and scales (outputs "codes"), called
    with fresh output tensors every time (see QuantSm90Family.bind)."""

    def __init__(self, kernel: Any, problem: QuantProblem, device: torch.device) -> None:
        if problem.outputs != "codes":
            raise ValueError("QuantCodesOp serves the 'codes' outputs")
        self.kernel, self.problem, self.device = kernel, problem, device
        scratch = kernel.outputs(1, device=device)
        self.workspace, self.dummy = scratch.workspace, scratch.dummy

    def __call__(self, x: torch.Tensor, alpha: torch.Tensor | None = None,
                 masks: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        p = self.problem
        s = Q.operand_shape(p.fmt, p.compensation, p.k, x.shape[0], p.layout, 1, p.kp_align)
        codes = torch.empty(s.t_pad, s.kq // 2, dtype=torch.uint8, device=self.device)
        scales = torch.empty(s.t_pad, s.kq // s.block, dtype=torch.uint8, device=self.device)
        if p.fmt == "nvfp4":
            scales = scales.view(torch.float8_e4m3fn)
        out_alpha = torch.ones(1, dtype=torch.float32, device=self.device)
        op = Q.QuantOperand(s, codes, scales, self.dummy[:0].view(torch.bfloat16),
                            out_alpha if p.fmt == "nvfp4" else None)
        res = self.kernel(x, Q.QuantOutputs(op, self.workspace, self.dummy),
                          alpha=alpha if self.kernel.config.alpha == "static" else None,
                          masks=masks)
        if p.fmt == "nvfp4" and res.alpha is not out_alpha:
            out_alpha = res.alpha.clone()         # static: the given scale, a fresh tensor
        return codes, scales, out_alpha


FAMILY = register(QuantSm90Family())


# ----------------------------------------------------------------------------- runner


class QuantSm90Runner:
    """n_sets input sets (x, static alpha, K-Ext masks, own output buffers) for one variant.

    The timed call is the whole quantization (amax reduction kernel included for dynamic
    alpha). check() quantizes fresh inputs of several kinds into 0xFF-poisoned outputs and
    requires every byte to equal resgen.kernels.quant_sm90.operand_reference.
    """

    def __init__(self, compiled: Any, variant: QuantSm90Variant, problem: QuantProblem,
                 device: Any, n_sets: int = 1, seed: int = 0):
        self.variant, self.problem = variant, problem
        self.config = config_of(variant, problem)
        self.kernel = Q.QuantKernel(self.config, compiled)
        self.device = torch.device(device)
        self.seed = seed
        self.masks = (Q.random_masks(problem.k, problem.compensation, seed, self.device)
                      if self.config.mode == "kext" else None)
        self.sets = []
        for i in range(max(1, n_sets)):
            x = Q.make_inputs("randn", problem.m, problem.k, seed + i, self.device)
            self.sets.append((x, self._alpha_for(x), self.kernel.outputs(problem.m,
                                                                          device=self.device)))
        self.cur = 0
        self._check_round = 0

    def _alpha_for(self, x: torch.Tensor) -> torch.Tensor | None:
        """A calibrated-style static alpha (the input's own amax rule) or None."""
        if self.config.alpha != "static":
            return None
        from .. import formats

        return formats.nvfp4_global_scale(x.float()).reshape(1).to(self.device)

    def bytes_per_set(self) -> int:
        return FAMILY.working_set_bytes(self.variant, self.problem)

    def rotate(self, i: int) -> None:
        self.cur = i % len(self.sets)

    def __call__(self) -> Q.QuantOperand:
        x, alpha, out = self.sets[self.cur]
        return self.kernel(x, out, alpha=alpha, masks=self.masks)

    def run_on(self, x: torch.Tensor, alpha: torch.Tensor | None, row_multiple: int = 1,
               masks: torch.Tensor | None = None) -> Q.QuantOperand:
        """Quantize x into freshly allocated, 0xFF-poisoned outputs; returns the operand."""
        out = self.kernel.outputs(x.shape[0], row_multiple, self.device)
        op = out.operand
        for t in (op.codes, op.scales, op.xop):
            if t.numel():
                t.view(torch.uint8).fill_(0xFF)
        if op.alpha is not None:
            op.alpha.fill_(float("nan"))
        if masks is None:
            masks = self.masks
        return self.kernel(x, out, alpha=alpha, masks=masks)

    def check(self) -> CheckResult:
        """Fresh inputs (random, ties, zeros, mixed in turn; at most 1024 tokens: the kernel
        is the same for every M), 0xFF-poisoned outputs, bit-exact comparison of every
        output with operand_reference (cached across the variants of one problem)."""
        kinds = ("randn", "ties", "zeros", "mixed")
        kind = kinds[self._check_round % len(kinds)]
        self._check_round += 1
        m = min(self.problem.m, _CHECK_MAX_M)
        row_multiple = 16 if self.config.layout == "tile8" else 8
        x, alpha, ref = _reference(self.problem, self.config.layout, kind,
                                   self.seed + 1000 + self._check_round, m, row_multiple,
                                   self.masks, self.device)
        got = self.run_on(x, None if alpha is None else alpha.reshape(1).to(self.device),
                          row_multiple)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return compare_operands(got, ref, self.config, f"{kind} m={m}")


_CHECK_MAX_M = 1024
_REF_CACHE: dict = {}


def _reference(problem: QuantProblem, layout: str, kind: str, seed: int, m: int,
               row_multiple: int, masks, device):
    """(x, static alpha or None, operand_reference) for one check input; the last few are
    kept so that every variant of a problem is checked against the same reference."""
    key = (problem.fmt, problem.compensation, problem.k, problem.static_scale, layout,
           problem.kp_align, kind, seed, m, row_multiple, str(device),
           None if masks is None else bytes(masks.cpu().numpy()))
    hit = _REF_CACHE.get(key)
    if hit is None:
        from .. import formats

        x = Q.make_inputs(kind, m, problem.k, seed, device)
        alpha = (formats.nvfp4_global_scale(x.float())
                 if problem.alpha_mode() == AlphaMode.STATIC else None)
        ref = Q.operand_reference(x, problem.fmt, problem.compensation, layout, row_multiple,
                                  alpha, masks, problem.kp_align)
        while len(_REF_CACHE) >= 4:
            _REF_CACHE.pop(next(iter(_REF_CACHE)))
        hit = _REF_CACHE[key] = (x, alpha, ref)
    return hit


def compare_operands(got: Q.QuantOperand, ref: Q.QuantOperand, config: Q.QuantConfig,
                     label: str = "") -> CheckResult:
    """Bit-exact comparison of the outputs a config writes. rel_err is the fraction of
    mismatching bytes (0 when exact); tolerance 0."""
    pairs = []
    if config.write_codes:
        pairs += [("codes", got.codes, ref.codes),
                  ("scales", got.scales.view(torch.uint8), ref.scales.view(torch.uint8))]
    if config.write_xop:
        pairs.append(("xop", got.xop.view(torch.int16), ref.xop.view(torch.int16)))
    if got.alpha is not None:
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
            idx = [int(i) for i in diff.nonzero()[0]]
            detail.append(f"{name}: {n} of {diff.numel()} differ, first at {idx} "
                          f"(got {a.cpu()[tuple(idx)].item()}, want {b.cpu()[tuple(idx)].item()})")
    frac = bad / max(total, 1)
    return CheckResult(bad == 0, frac, 0.0, "" if not bad else f"{label}: " + "; ".join(detail))
