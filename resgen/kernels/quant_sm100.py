"""Host side of the sm_100a fused residue quantizer (family quant_sm100): configuration, output
buffers, compilation and launch. What it writes is resgen.kernels.sm100_operand's operand
(definition: operand_reference); the template is resgen/templates/quant_sm100.py.j2.

The outputs are allocated zeroed once per call shape and reused: the kernel writes every real
code and scale factor of the `slots` token slots (slots past m as zero tokens) and never the
padding (columns past K + ext up to Kp, scale-factor rows of the tile padding), which must stay
zero for the GEMM (a zero code times a zero scale).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .. import formats
from ..calibrate import GROUP, Selection
from .sm100_layout import act_rows, pow2_ceil, round_up, sf_cols, sf_rows
from .sm100_operand import K_ALIGN_SM100, Sm100Operand, layout_for

__all__ = ["TEMPLATE", "FAMILY", "AMAX_CTAS", "WORKSPACE_FLOATS", "QuantSm100Config",
           "QuantSm100Outputs", "QuantSm100Kernel", "compile_config", "fake_args",
           "slots_for"]

TEMPLATE = "quant_sm100.py.j2"
FAMILY = "quant_sm100"
AMAX_CTAS = 128
AMAX_THREADS = 256
WORKSPACE_FLOATS = AMAX_CTAS + 16   # partial maxima, then 64 bytes that stay zero
COMPENSATIONS = ("none", "full", "0.125", "0.25", "0.5", "1.0")


def _mode(compensation: str) -> str:
    if compensation not in COMPENSATIONS:
        raise ValueError(f"compensation must be one of {COMPENSATIONS}, got {compensation!r}")
    return {"none": "plain", "full": "mext"}.get(compensation, "kext")


def slots_for(m: int, layout: str) -> int:
    """Token slots the kernel writes for m tokens (tile8 rounds up to groups of 8)."""
    return act_rows(m, layout) // (1 if layout == "plain" else 2)


@dataclass(frozen=True)
class QuantSm100Config:
    """Everything a rendered quant_sm100 kernel is specialized on.

    layout: the GEMM's activation rows; sf_tile: activation rows of the GEMM's MMA tile (the
    scale factors are tile-padded below 128); ept / warps / unroll: as quant_sm90 (elements per
    lane, warps per CTA, warp tiles per warp issued together); alpha: "static" | "dynamic"
    (NVFP4) or "none" (MXFP4)."""

    fmt: str
    compensation: str
    k: int
    layout: str
    sf_tile: int = 128
    ept: int = 8
    warps: int = 4
    unroll: int = 2
    alpha: str = "static"

    @property
    def mode(self) -> str:
        return _mode(self.compensation)

    @property
    def ksel(self) -> int:
        return 0 if self.mode != "kext" else int(round(GROUP * float(self.compensation)))

    @property
    def ext(self) -> int:
        if self.mode != "kext":
            return 0
        return formats.extension_length(self.k * self.ksel // GROUP, self.fmt)

    @property
    def kq(self) -> int:
        return self.k + self.ext

    @property
    def kp(self) -> int:
        return round_up(self.kq, K_ALIGN_SM100)

    def why_invalid(self) -> str | None:
        """None if this configuration can be rendered and run, else the reason."""
        try:
            bs = formats.block_size(self.fmt)
            mode = self.mode
        except ValueError as e:
            return str(e)
        if (mode == "mext") != (self.layout in ("row_pair", "tile8")):
            return (f"layout {self.layout!r} does not fit compensation {self.compensation!r}: "
                    "M-Ext uses row_pair or tile8, everything else plain")
        if self.sf_tile not in (8, 16, 32, 64, 128):
            return f"sf_tile {self.sf_tile}: the GEMM's MMA tile has 8..128 rows (a power of 2)"
        if self.layout == "tile8" and self.sf_tile < 16:
            return "tile8 rows come in groups of 16: the GEMM's tile has at least 16 rows"
        if self.ept not in (8, 16):
            return f"ept={self.ept}: elements per lane must be 8 or 16"
        if self.k % (32 * self.ept) or self.k % bs:
            return f"K={self.k} is not a multiple of a warp tile (32 lanes x {self.ept})"
        if self.warps not in (1, 2, 4, 8):
            return f"warps={self.warps} must be 1, 2, 4 or 8"
        if self.unroll not in (1, 2, 4):
            return f"unroll={self.unroll} must be 1, 2 or 4"
        if self.ept == 16 and self.unroll == 4:
            # sm_100a compiles (2026-12-01 pre-flight): 8-16 bytes of local memory at 72-80
            # registers: four tiles of 16 elements live across the quantization
            return "ept 16 x unroll 4 spills (four 16-element tiles of x live at once)"
        want = ("none",) if self.fmt == "mxfp4" else ("static", "dynamic")
        if self.alpha not in want:
            return f"alpha={self.alpha!r} does not fit {self.fmt} (allowed: {want})"
        if mode == "kext" and self.ext != self.k * self.ksel // GROUP:
            return "K-Ext extension would need padding inside a block (K * ratio % block != 0)"
        return None

    def template_params(self) -> dict[str, Any]:
        reason = self.why_invalid()
        if reason:
            raise ValueError(f"invalid quant_sm100 config: {reason}")
        return {"fmt": self.fmt, "mode": self.mode, "ksel": self.ksel, "layout": self.layout,
                "ept": self.ept, "warps": self.warps, "unroll": self.unroll,
                "alpha": self.alpha, "k": self.k, "kq": self.kq, "kp": self.kp,
                "sfc": sf_cols(self.kp, self.fmt), "sf_tile": self.sf_tile,
                "amax_ctas": AMAX_CTAS, "amax_threads": AMAX_THREADS}


def fake_args(config: QuantSm100Config) -> list[Any]:
    """cute.compile arguments (null pointers, dynamic m / slots, a null stream)."""
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_ptr

    g = cute.AddressSpace.gmem

    def ptr(dt, align):
        return make_ptr(dt, 0, g, assumed_align=align)

    return [ptr(cutlass.BFloat16, 16), ptr(cutlass.Float32, 4), ptr(cutlass.Uint8, 2),
            ptr(cutlass.Uint8, 16), ptr(cutlass.Uint8, 1), ptr(cutlass.Float32, 16),
            cutlass.Int32(1), cutlass.Int32(1), cuda.CUstream(0)]


@dataclass
class QuantSm100Outputs:
    """Device buffers of one call shape: the operand (zeroed once) and the kernel's scratch."""

    operand: Sm100Operand
    slots: int
    workspace: torch.Tensor        # float32 [WORKSPACE_FLOATS]
    dummy: torch.Tensor


class QuantSm100Kernel:
    """A compiled quant_sm100 variant; call it on torch CUDA tensors.

    kern = compile_config(QuantSm100Config("nvfp4", "full", 4096, "row_pair", sf_tile=8))[0]
    out = kern.outputs(m, device=x.device)
    op = kern(x, out, alpha=alpha)      # an Sm100Operand for linear_sm100_tc
    """

    def __init__(self, config: QuantSm100Config, compiled: Any):
        reason = config.why_invalid()
        if reason:
            raise ValueError(f"invalid quant_sm100 config: {reason}")
        self.config = config
        self.compiled = compiled

    @staticmethod
    def _ptr(t: torch.Tensor, dt: Any, align: int) -> Any:
        import cutlass.cute as cute
        from cutlass.cute.runtime import make_ptr

        if t.data_ptr() % align:
            raise ValueError(f"buffer at {t.data_ptr():#x} is not {align}-byte aligned")
        return make_ptr(dt, t.data_ptr(), cute.AddressSpace.gmem, assumed_align=align)

    def outputs(self, m: int, device: Any = "cuda") -> QuantSm100Outputs:
        c = self.config
        dev = torch.device(device)
        slots = slots_for(m, c.layout)
        rows = act_rows(m, c.layout)
        codes = torch.zeros(rows, c.kp // 2, dtype=torch.uint8, device=dev)
        sf = torch.zeros(sf_rows(rows, c.sf_tile) * sf_cols(c.kp, c.fmt), dtype=torch.uint8,
                         device=dev)
        alpha = torch.ones(1, dtype=torch.float32, device=dev) if c.fmt == "nvfp4" else None
        op = Sm100Operand(c.fmt, m, rows, layout_for(c.compensation, c.layout), c.sf_tile,
                          codes, sf, alpha)
        return QuantSm100Outputs(op, slots,
                                 torch.zeros(WORKSPACE_FLOATS, dtype=torch.float32, device=dev),
                                 torch.zeros(64, dtype=torch.uint8, device=dev))

    def __call__(self, x: torch.Tensor, out: QuantSm100Outputs, qweight: Any = None,
                 alpha: torch.Tensor | None = None, masks: Any = None,
                 stream: Any = None) -> Sm100Operand:
        """Quantize x: [m, K] bf16 (contiguous, the outputs' device) into `out`.

        qweight: a calibrate.QLinearWeight to take the static alpha (input_scale) and the K-Ext
        masks from; or alpha (float32 [1] device tensor, static NVFP4) and masks (uint8 [K/8])
        given directly. Dynamic NVFP4 writes the computed alpha to the operand."""
        import cuda.bindings.driver as cuda
        import cutlass

        c = self.config
        op = out.operand
        if x.dtype != torch.bfloat16 or x.dim() != 2 or not x.is_contiguous():
            raise TypeError(f"x must be a contiguous 2-D bf16 tensor, got {x.dtype} "
                            f"{tuple(x.shape)}")
        if x.shape != (op.m, c.k) or x.device != op.codes.device:
            raise ValueError(f"x is {tuple(x.shape)} on {x.device}; the outputs were allocated "
                             f"for {(op.m, c.k)} on {op.codes.device}")
        if qweight is not None:
            if c.alpha == "static":
                if qweight.input_scale is None:
                    raise ValueError("static NVFP4 needs a weight with an input_scale")
                alpha = torch.as_tensor(qweight.input_scale, dtype=torch.float32,
                                        device=x.device).reshape(1)
            if c.mode == "kext":
                masks = qweight.selection
        if isinstance(masks, Selection):
            masks = masks.masks.to(x.device)
        if c.alpha == "static":
            if alpha is None or alpha.dtype != torch.float32 or alpha.numel() != 1:
                raise ValueError("static NVFP4 needs alpha: a float32 device tensor of 1 element")
            op = Sm100Operand(op.fmt, op.m, op.rows, op.layout, op.sf_tile, op.codes, op.sf,
                              alpha)
            alpha_t = alpha
        else:
            alpha_t = op.alpha if op.alpha is not None else out.dummy
        if c.mode == "kext":
            if (not isinstance(masks, torch.Tensor) or masks.dtype != torch.uint8
                    or masks.shape != (c.k // GROUP,) or masks.device != x.device):
                raise ValueError(f"K-Ext needs masks: uint8 [{c.k // GROUP}] on {x.device}")
            m_t = masks
        else:
            m_t = out.dummy
        p = self._ptr
        if stream is None:
            stream = cuda.CUstream(torch.cuda.current_stream(x.device).cuda_stream
                                   if x.is_cuda else 0)
        self.compiled(p(x, cutlass.BFloat16, 16), p(alpha_t, cutlass.Float32, 4),
                      p(m_t, cutlass.Uint8, 2), p(op.codes, cutlass.Uint8, 16),
                      p(op.sf, cutlass.Uint8, 1), p(out.workspace, cutlass.Float32, 16),
                      cutlass.Int32(op.m), cutlass.Int32(out.slots), stream)
        return op


def compile_config(config: QuantSm100Config, arch: str = "sm_100a"):
    """Render, import and compile one configuration; returns (QuantSm100Kernel, CompileResult)."""
    from . import codegen

    path, _ = codegen.render_to_file(TEMPLATE, config.template_params(), FAMILY)
    module = codegen.load_module(path)
    res = codegen.compile_entry(module.entry, fake_args(config), arch)
    return QuantSm100Kernel(config, res.fn), res


def default_sf_tile(rows: int) -> int:
    """The SF tile the linear_sm100_tc default reads for `rows` activation rows."""
    return min(128, max(8, pow2_ceil(rows)))
