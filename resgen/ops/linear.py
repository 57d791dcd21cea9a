"""FP4 linear layers served by the tuned kernels.

    from resgen.ops import Linear
    layer = Linear(qweight, "full")      # a QLinearWeight (resgen.calibrate.prepare_weight)
    y = layer(x)                         # x: bf16 [..., K] on the GPU -> bf16 [..., N]

For each row count M the layer builds a plan once:
  1. the variant: `resgen.runtime` looks up the LinearProblem (format, compensation, M, N, K,
     static or dynamic NVFP4 scale) in the dispatch databases (the shipped `tuned/` table, the
     user's cache, RESGEN_DB), M mapped to the tuned buckets, never an invalid or stale row; a
     miss serves the family default (warned once). `family=` pins a family, `variant=` a
     variant (checked with its family's predicate for every M);
  2. the kernel: compiled once per (family, variant, compile key, arch) in this process, from
     the fingerprinted on-disk render cache;
  3. the weight: prepared once per (family, packing) in that family's layout
     (`family.layout`: offline work, not repeated per call);
  4. the launch: `family.bind(...)`, the family's one launch path, the same call its tuner
     runner timed: the launcher's split-K workspace / semaphores and, for variants that read
     a prepared operand, the layer quantizer (quant_sm90, row pairs for M-Ext, the K-Ext
     extension for a ratio) with its outputs for M rows.
A call then runs the whole layer: BF16 activations in, quantizer + GEMM (two launches; fused
linear_sm90_mma variants quantize in their own prologue: one launch; W4A16: the GEMM reads
the activations themselves, in place or after one padding copy, or a fused variant copies them
in its prologue: one launch), BF16 out, a new tensor.

Compensation: "none" (plain W4A4), "full" (M-Ext: base and residue products added in FP32 in
registers), a K-Ext ratio (0.125 / 0.25 / 0.5 / 1.0, the weight prepared with a selection of
that ratio) or "w4a16" (FP4 weights, BF16 activations never quantized: the Hopper-native mode,
resgen.reference.linear_w4a16; the same compiled kernels as plain, alpha_x = 1, except the
fused ones' copy prologue); a weight
prepared with a selection also serves "none" / "full" / "w4a16" (its base part).

Build the plans of the row counts a CUDA graph will use (`warmup(ms)`) before capturing: a
missing plan allocates and may compile, which capture forbids (raised as an error). A layer,
like its launchers, must not run on two streams at once.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

from ..calibrate import QLinearWeight, pad_in_features, static_alpha
from ..search.family import KernelFamily, LinearFamily
from ..search.sm90_linear import gemm_weight
from ..search.variant import LinearProblem
from . import common
from .common import choose_variant, compile_cached

__all__ = ["Linear", "LayerPlan", "KEXT_K_ALIGN"]

# K of a K-Ext layer is padded to this (the Hopper layer quantizer's K tiling,
# resgen.search.sm90_linear.QUANT_K_ALIGN; tests/test_ops.py keeps the two equal)
KEXT_K_ALIGN = 256


@dataclass
class LayerPlan:
    """What runs for one row count: the problem, the variant and where it came from, and
    `run(xb, out)` (xb: bf16 [M, K] contiguous, out: bf16 [M, N])."""

    problem: LinearProblem
    family: str
    variant: Any
    source: str
    run: Callable[[torch.Tensor, torch.Tensor], Any]


class Linear:
    """A quantized linear layer y = x W^T (+ residue compensation) on the tuned kernels.

    qweight:      resgen.calibrate.QLinearWeight (NVFP4 or MXFP4; any device: copied to
                  `device` once).
    compensation: "none" | "full" | a K-Ext ratio (float or its string) | "w4a16".
    fold:         a K-Ext layer's fold: "exact" (extension columns against W_S: Blackwell's
                  numerics) or "presum" (each selected residue added onto its base channel,
                  rounded once to FP16, one GEMM with the base weight: K-Ext at plain cost on
                  Hopper, NVFP4 only; numerics resgen.reference.linear(ratio, fold="presum")).
                  M-Ext's presum is the tuner's choice within the exact fold's check.
    device:       the CUDA device to run on (default: the current one).
    arch:         compile target (default: resgen.settings, the GPU's arch).
    family / variant: pin a kernel family / one variant instead of the dispatch table.
    dispatcher:   a resgen.runtime.Dispatcher (default: the process-wide one).
    compile_fn, quantizer_fn: replace the compile step ((family, variant, problem, arch) ->
                  compiled kernel) and the layer quantizer ((problem, arch) -> quantizer,
                  asked for only by variants that need one; default: the family's); the
                  CPU tests stand simulations in for both.
    """

    def __init__(self, qweight: QLinearWeight, compensation: str | float = "none", *,
                 fold: str = "exact",
                 device: torch.device | str | None = None, arch: str | None = None,
                 family: str | None = None, variant: Any = None, dispatcher: Any = None,
                 compile_fn: Callable[[Any, Any, LinearProblem, str], Any] | None = None,
                 quantizer_fn: Callable[[LinearProblem, str], Any] | None = None) -> None:
        from ..reference import check_compensation

        comp = _compensation_string(compensation)
        ratio = None if comp in ("none", "full", "w4a16") else float(comp)
        # the fold is validated as the workload's field (K-Ext, NVFP4 only for "presum")
        kind = LinearProblem(qweight.fmt, comp, 1, max(16, qweight.out_features),
                             max(16, qweight.in_features), True, fold)
        if comp != "w4a16":
            check_compensation(ratio if ratio is not None else comp, qweight)
        if ratio is None and qweight.selection is not None:
            # a K-Ext weight serves plain / M-Ext through its base part
            qweight = QLinearWeight(qweight.base(), qweight.in_features, None,
                                    qweight.input_scale, qweight.meta)
        self.k_in = qweight.in_features          # the caller's K
        if ratio is not None and self.k_in % KEXT_K_ALIGN:
            # K-Ext behind the layer quantizer needs K in whole quantizer tiles, and its
            # extension follows K in the weight: the layer itself runs at K rounded up, with
            # zero input channels (exact; resgen.calibrate.pad_in_features), the activations
            # copied into a zero-padded buffer per plan. Plain / M-Ext pad only in front of
            # the quantizer (the family's bind).
            qweight = pad_in_features(qweight, -(-self.k_in // KEXT_K_ALIGN) * KEXT_K_ALIGN)
        if arch is None:
            from ..settings import settings

            arch = settings().arch
        self.device = common.require_cuda_device(
            device, arch, what="resgen.ops.Linear", simulated=bool(compile_fn or quantizer_fn))
        self.qweight = _to_device(qweight, self.device)
        # K-Ext channel masks (uint8 [K / 8]) on the device, for the quantizer / fused kernels
        self.masks = (qweight.selection.masks.to(self.device)
                      if qweight.selection is not None else None)
        self.compensation, self.fold = comp, fold
        # the weight the GEMM multiplies (a K-Ext presum layer: the base part; its masks
        # above still select the residue channels for the quantizer)
        self._gemm_qweight = gemm_weight(self.qweight, kind)
        self.fmt = qweight.fmt
        self.k, self.n = qweight.in_features, qweight.out_features
        # MXFP4 has no tensor scale, W4A16 no activation scale at all: their workloads are
        # keyed like static ones
        self.static_scale = (self.fmt == "mxfp4" or comp == "w4a16"
                             or qweight.input_scale is not None)
        self.arch = arch
        # the static NVFP4 activation scale (float32 [1]) the kernels take; None for MXFP4
        # and dynamic NVFP4
        self.alpha = static_alpha(self.qweight, self.device)
        self.family, self.variant = family, variant
        if variant is not None and family is not None and variant.FAMILY != family:
            raise ValueError(f"variant {variant.name()} is not of family {family}")
        self._dispatcher = dispatcher
        self._compile = compile_fn or compile_cached
        self._quantizer = quantizer_fn
        self._weights: dict[tuple[str, str], Any] = {}
        self._plans: OrderedDict[int, LayerPlan] = OrderedDict()

    # -- planning ---------------------------------------------------------------------------
    def problem(self, m: int) -> LinearProblem:
        """The LinearProblem of a call with m token rows."""
        return LinearProblem(self.fmt, self.compensation, int(m), self.n, self.k,
                             self.static_scale, self.fold)

    def plan(self, m: int) -> LayerPlan:
        """The plan for m rows (built on first use, then cached; the most recently used
        resgen.ops.common.MAX_PLANS are kept, so prefill lengths that never repeat do not
        accumulate buffers)."""
        plan = self._plans.get(m)
        if plan is None:
            if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"no plan for M = {m} yet: call warmup([{m}, ...]) before "
                                   "capturing a CUDA graph (a plan allocates and may compile)")
            plan = self._plans[m] = self._build(m)
            while len(self._plans) > common.MAX_PLANS:
                self._plans.popitem(last=False)
        else:
            self._plans.move_to_end(m)
        return plan

    def warmup(self, ms: Iterable[int]) -> list[LayerPlan]:
        """Build the plans of these row counts now (e.g. before CUDA graph capture)."""
        return [self.plan(int(m)) for m in ms]

    def _choose(self, p: LinearProblem) -> tuple[KernelFamily, Any, str]:
        return choose_variant("linear", p, self.arch, self.family, self.variant,
                              self._dispatcher)

    def _weight(self, fam: LinearFamily, v: Any) -> Any:
        packing = v.packing.value
        key = (fam.NAME, packing)
        if key not in self._weights:
            self._weights[key] = fam.layout(self._gemm_qweight, packing)
        return self._weights[key]

    def _build(self, m: int) -> LayerPlan:
        p = self.problem(m)
        fam, v, source = self._choose(p)
        if not isinstance(fam, LinearFamily):
            raise ValueError(f"family {fam.NAME} has no run-time path in resgen.ops")
        compiled = self._compile(fam, v, p, self.arch)
        quantizer = None
        if self._quantizer is not None and fam.needs_quantizer(v) and not p.w4a16:
            # at the quantizer's K (rounded up to its tiling where needed: the family pads),
            # in the row layout the variant reads (a presum variant: "presum", passed only
            # then, so a stand-in of the (problem, arch) form serves every other variant)
            qp = fam.quantizer_problem(p)
            layout = fam.quantizer_layout(v, p) if hasattr(fam, "quantizer_layout") else None
            if layout in (None, "row_pair" if p.compensation == "full" else "plain"):
                quantizer = self._quantizer(qp, self.arch)
            else:
                quantizer = self._quantizer(qp, self.arch, layout=layout)
        run = fam.bind(compiled, v, p, self._weight(fam, v), self.device, quantizer=quantizer,
                       alpha=self.alpha, masks=self.masks if p.ratio is not None else None)
        if self.k != self.k_in:          # a padded K-Ext layer (see __init__)
            run = _ZeroPadded(run, m, self.k_in, self.k, self.device)
        return LayerPlan(p, fam.NAME, v, source, run)

    # -- calling ----------------------------------------------------------------------------
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: bf16 [..., K] on the layer's device -> bf16 [..., N]."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"expected a torch.Tensor, got {type(x).__name__}")
        if x.dtype != torch.bfloat16:
            raise TypeError(f"expected bfloat16 activations, got {x.dtype}")
        if x.device != self.device:
            raise ValueError(f"activations are on {x.device}, the layer on {self.device}")
        if x.dim() < 1 or x.shape[-1] != self.k_in:
            raise ValueError(f"activations of shape {tuple(x.shape)}: the last dimension must "
                             f"be K = {self.k_in}")
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.k_in).contiguous()
        m = x2.shape[0]
        plan = self.plan(m) if m else None
        out = torch.empty(m, self.n, dtype=torch.bfloat16, device=self.device)
        if plan is not None:
            plan.run(x2, out)
        return out.reshape(*lead, self.n)


class _ZeroPadded:
    """run(xb, out) of a layer padded to K (pad_in_features): xb [m, K_in] copied into the
    first K_in columns of a zero buffer [m, K] allocated once (capturable)."""

    def __init__(self, run: Callable[[torch.Tensor, torch.Tensor], Any], m: int, k_in: int,
                 k: int, device: torch.device) -> None:
        self.run, self.k_in = run, k_in
        self.buf = torch.zeros(m, k, dtype=torch.bfloat16, device=device)

    def __call__(self, xb: torch.Tensor, out: torch.Tensor) -> Any:
        self.buf[:, : self.k_in].copy_(xb)
        return self.run(self.buf, out)


_KEXT = ("0.125", "0.25", "0.5", "1.0")


def _compensation_string(c: str | float) -> str:
    if isinstance(c, str):
        if c in ("none", "full", "w4a16"):
            return c
        try:
            c = float(c)
        except ValueError:
            raise ValueError(f"compensation must be 'none', 'full', 'w4a16' or a K-Ext ratio "
                             f"{_KEXT}, got {c!r}") from None
    s = str(float(c))
    if s not in _KEXT:
        raise ValueError(f"K-Ext ratio must be one of {_KEXT}, got {c!r}")
    return s


def _to_device(qw: QLinearWeight, device: torch.device) -> QLinearWeight:
    """The codes, scales and tensor scale on `device` (the selection stays where it is: its
    masks reach the kernels through Linear.masks)."""
    scale = qw.input_scale
    if isinstance(scale, torch.Tensor):
        scale = scale.to(device)
    return dataclasses.replace(qw, q=qw.q.to(device), input_scale=scale)
