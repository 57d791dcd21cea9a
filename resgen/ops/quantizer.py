"""The layer quantizer (family quant_sm90) as a run-time op: BF16 activations -> the FP4
operand in the ModelOpt byte layout, with the residue for compensation.

    from resgen.ops.quantizer import LayerQuantizer
    quant = LayerQuantizer("nvfp4", "full", k=4096, input_scale=s)
    codes, scales, alpha = quant(x)        # x: bf16 [M, K] on the GPU

Outputs (resgen.kernels.quant_sm90's operand, without the BF16 xop):
    codes   uint8 [T, KQ / 2]    two E2M1 codes per byte, even element in the low nibble
    scales  NVFP4 float8_e4m3fn / MXFP4 uint8 E8M0 [T, KQ / block]
    alpha   float32 [1]          NVFP4 tensor scale (the static one, or the computed dynamic
                                 one); 1.0 for MXFP4, which has none
Rows T and columns KQ by compensation: "none" T = M, KQ = K; "full" (layout row_pair) T = 2M,
row 2j the base of token j and row 2j + 1 its residue; a K-Ext ratio T = M, KQ = K + ext (the
selected channels' residue appended, resgen.formats.quantize_with_residue's order).

Per row count M a plan is built once: the variant from resgen.runtime (op "quantize", outputs
"codes"), compiled once per process and bound by its family (quant_sm90's `bind`, reached
through the family registry), with its workspace; every call returns fresh output tensors (a
custom op must not hand out buffers a later call overwrites). Build plans before CUDA graph
capture (`warmup`).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

from .. import formats
from ..calibrate import GROUP
from ..search.family import get_family
from ..settings import settings
from . import common
from .common import choose_variant, compile_cached

__all__ = ["LayerQuantizer", "QuantPlan", "operand_rows"]

FAMILY = "quant_sm90"


def operand_rows(m: Any, layout: str) -> Any:
    """Rows T of the operand for m tokens and a row multiple of 1 (plain m, row_pair 2m, tile8
    16 ceil(m / 8)); plain integer arithmetic, so it also works on symbolic sizes."""
    if layout == "plain":
        return m
    if layout == "row_pair":
        return 2 * m
    if layout == "tile8":
        return 16 * ((m + 7) // 8)
    raise ValueError(f"unknown operand layout {layout!r}")


@dataclass
class QuantPlan:
    """What runs for one row count: the problem, the variant and where it came from, and the
    bound op (the family's bind: op(x, alpha, masks) -> (codes, scales, alpha))."""

    problem: Any
    variant: Any
    source: str
    op: Any


class LayerQuantizer:
    """Quantize a layer's activations to FP4 (+ residue) on the tuned quant_sm90 kernels.

    fmt, compensation ("none" | "full" | a K-Ext ratio string "0.125" ...), k: the layer.
    input_scale: NVFP4 static tensor scale (float or 0-dim tensor), None = dynamic.
    masks: K-Ext channel masks (uint8 [K / 8], a calibrate.Selection's masks).
    layout: operand rows for M-Ext ("row_pair" default, or "tile8"); plain otherwise.
    compile_fn ((family, variant, problem, arch) -> compiled) lets the CPU tests stand a
    simulation in for the kernel, as in resgen.ops.Linear.
    """

    def __init__(self, fmt: str, compensation: str, k: int, *,
                 input_scale: torch.Tensor | float | None = None,
                 masks: torch.Tensor | None = None, layout: str | None = None,
                 device: torch.device | str | None = None, arch: str | None = None,
                 variant: Any = None, dispatcher: Any = None,
                 compile_fn: Callable[[Any, Any, Any, str], Any] | None = None) -> None:
        formats.block_size(fmt)
        comp = compensation if compensation in ("none", "full") else str(float(compensation))
        mode = {"none": "plain", "full": "mext"}.get(comp, "kext")
        if layout is None:
            layout = "row_pair" if mode == "mext" else "plain"
        if (mode == "mext") == (layout == "plain"):
            raise ValueError(f"layout {layout!r} does not fit compensation {comp!r}")
        if fmt == "mxfp4" and input_scale is not None:
            raise ValueError("input_scale is an NVFP4 tensor scale; MXFP4 has none")
        if (mode == "kext") != (masks is not None):
            raise ValueError("K-Ext needs the channel masks, and only K-Ext takes them")
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) \
                if torch.cuda.is_available() else torch.device("cpu")
        self.device = torch.device(device)
        self.fmt, self.compensation, self.k, self.layout = fmt, comp, int(k), layout
        self.mode = mode
        self.static_scale = fmt == "mxfp4" or input_scale is not None
        self.alpha = (None if input_scale is None else
                      torch.as_tensor(input_scale, dtype=torch.float32)
                      .reshape(1).to(self.device))
        self.masks = None if masks is None else masks.to(self.device)
        self.arch, self.variant = arch or settings().arch, variant
        self._family = get_family(FAMILY)
        self._dispatcher = dispatcher
        self._compile = compile_fn or compile_cached
        self._plans: OrderedDict[int, QuantPlan] = OrderedDict()
        self.problem(1)             # validates K against the family now, not at a call

    @property
    def ext(self) -> int:
        """K-Ext extension channels (the selected channels padded to the block), else 0."""
        if self.mode != "kext":
            return 0
        ksel = int(round(GROUP * float(self.compensation)))
        return formats.extension_length(self.k * ksel // GROUP, self.fmt)

    def problem(self, m: int) -> Any:
        p = self._family.PROBLEM(fmt=self.fmt, compensation=self.compensation, m=int(m),
                                 k=self.k, static_scale=self.static_scale, layout=self.layout,
                                 outputs="codes", kp_align=64)
        why = self._family.problem_invalid(p)
        if why is not None:
            raise ValueError(f"no quantizer for {p.key()}: {why}")
        return p

    def output_shapes(self, m: Any) -> tuple[tuple, tuple]:
        """((T, KQ / 2), (T, KQ / block)) for m tokens (symbolic m allowed)."""
        kq = self.k + self.ext
        t = operand_rows(m, self.layout)
        return (t, kq // 2), (t, kq // formats.block_size(self.fmt))

    def plan(self, m: int) -> QuantPlan:
        plan = self._plans.get(m)
        if plan is None:
            if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"no quantizer plan for M = {m} yet: call warmup([{m}, ...]) "
                                   "before capturing a CUDA graph")
            plan = self._plans[m] = self._build(m)
            while len(self._plans) > common.MAX_PLANS:
                self._plans.popitem(last=False)
        else:
            self._plans.move_to_end(m)
        return plan

    def warmup(self, ms: Iterable[int]) -> list[QuantPlan]:
        return [self.plan(int(m)) for m in ms]

    def _build(self, m: int) -> QuantPlan:
        p = self.problem(m)
        fam, v, src = choose_variant("quantize", p, self.arch, None, self.variant,
                                     self._dispatcher)
        compiled = self._compile(fam, v, p, self.arch)
        return QuantPlan(p, v, src, fam.bind(compiled, v, p, self.device))

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: bf16 [M, K] contiguous on the op's device -> (codes, scales, alpha)."""
        if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16 or x.dim() != 2:
            raise TypeError("x must be a bf16 [M, K] tensor")
        if x.shape[1] != self.k:
            raise ValueError(f"x has K = {x.shape[1]}, the quantizer expects {self.k}")
        if x.device != self.device:
            raise ValueError(f"x is on {x.device}, the quantizer on {self.device}")
        m = x.shape[0]
        if m == 0:
            (t, cw), (_, sw) = self.output_shapes(0)
            sdt = torch.float8_e4m3fn if self.fmt == "nvfp4" else torch.uint8
            return (torch.empty(t, cw, dtype=torch.uint8, device=self.device),
                    torch.empty(t, sw, dtype=torch.uint8, device=self.device).view(sdt),
                    torch.ones(1, dtype=torch.float32, device=self.device))
        return self.plan(m).op(x.contiguous(), alpha=self.alpha, masks=self.masks)
