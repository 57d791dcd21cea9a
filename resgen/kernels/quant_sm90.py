"""Host side of the fused residue quantizer (family quant_sm90): operand layouts, a torch
reference of every output, kernel configuration, compilation and launch on torch CUDA tensors.

The operand (what the Hopper GEMMs consume, as resgen.kernels.sm90_operand defines it)
--------------------------------------------------------------------------------------
For activations x: [m, K] bf16 the quantizer writes one operand of T_pad rows:

    codes  uint8 [T_pad, KQ / 2]      E2M1 codes, two per byte, even element in the low nibble
    scales NVFP4 float8_e4m3fn / MXFP4 uint8 E8M0 [T_pad, KQ / bs]     (bs = 16 / 32)
    xop    bf16 [T_pad, KP]           each value EXACTLY e2m1_value(code) * block scale (NVFP4:
                                      the E4M3 value, WITHOUT alpha; MXFP4: 2^e); KP = KQ rounded
                                      up to a multiple of kp_align, the extra columns zero
    alpha  float32 [1]                NVFP4 tensor scale (input when static, output when
                                      dynamic), shared by base and residue

KP's granularity kp_align (64, 128 or 256) is the consuming GEMM's choice (64 in the issue;
linear_sm90_mma uses 256, resgen.kernels.sm90_fp4_layout.K_ALIGN).
Columns: KQ = K for plain and M-Ext; K-Ext: KQ = K + ext, the base channels then the selected
residue channels (block-local masks, group order, ascending inside a group) zero-padded to the
block size (formats.extension_length): codes/scales[:, :KQ] is formats.cat([base, res]); K-Ext
in layout presum: KQ = K, the residues added onto their base channels.
Rows (`layout`), token j = 0..m-1:
    plain    (compensation none / K-Ext): row j = token j
    row_pair  (M-Ext): row 2j = base of token j, row 2j + 1 = its residue
    tile8    (M-Ext): per 16 rows, 8 base rows (tokens 8b..8b+7) then their 8 residue rows
    presum   (M-Ext or K-Ext, NVFP4, xop only): row j = fp16(X_hat + R_hat) of token j, the
             pre-summed fold's operand (resgen.formats.presum_fp16: the two unit values added
             in FP32 and rounded once to FP16; K-Ext: R_hat is the selected channels'
             residues on their channels, formats.residue_on_channels): xop is float16
             [T_pad, KP], no codes or scales (issue 20 section 1; linear_sm90_wgmma's
             fold="presum" variants read the M-Ext form; the K-Ext form is the operand of
             reference.linear(ratio, fold="presum"), whose GEMM is not built yet)
T_pad = the rows the layout needs (m, 2m, 16 * ceil(m / 8)) rounded up to a multiple of
lcm(row_multiple, granule) (granule 1 / 2 / 16). Rows past the real tokens are all zero (codes,
scales and xop): the kernel writes them as the quantization of a zero token.

Cost of the NVFP4 tensor scale: "static" (a calibrated alpha, as ModelOpt's input_scale) is one
pass: x is read once. "dynamic" computes alpha = amax(x) / 2688 exactly as
formats.nvfp4_global_scale, which needs the amax of the whole tensor before any block can be
quantized: a separate reduction kernel reads x a second time (about +2 B per element of HBM
traffic, i.e. ~+30-40 % for M-Ext operands at large M) plus one extra launch (~2-3 us at small
M); the quantizer then reduces the reduction kernel's 128 partial maxima in every warp.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .. import formats
from ..calibrate import GROUP, Selection
# the check inputs are shared with quant_sm100 (re-exported: Q.make_inputs, Q.random_masks)
from .quant_inputs import INPUT_KINDS, make_inputs, random_masks

__all__ = [
    "COMPENSATIONS", "LAYOUTS", "MEXT_LAYOUTS", "ALPHA_MODES", "KP_ALIGNS", "TEMPLATE",
    "FAMILY", "AMAX_CTAS", "xop_dtype",
    "mode_of", "ksel_of", "OperandShape", "operand_shape", "row_map",
    "QuantOperand", "operand_reference", "xop_reference", "split_operand",
    "INPUT_KINDS", "make_inputs", "random_masks",
    "QuantConfig", "QuantOutputs", "QuantKernel", "compile_config", "fake_args",
    "WORKSPACE_FLOATS", "quant_kernel_resources", "quant_kernel_registers", "ctas_per_sm",
]

COMPENSATIONS: tuple[str, ...] = ("none", "full", "0.125", "0.25", "0.5", "1.0")
LAYOUTS: tuple[str, ...] = ("plain", "row_pair", "tile8", "presum")
ALPHA_MODES: tuple[str, ...] = ("static", "dynamic", "none")
TEMPLATE = "quant_sm90.py.j2"
FAMILY = "quant_sm90"
AMAX_CTAS = 128          # CTAs of the dynamic-alpha reduction kernel (= partial maxima)
AMAX_THREADS = 256
KP_ALIGNS: tuple[int, ...] = (64, 128, 256)   # xop column granularities a GEMM may ask for
_GRANULE = {"plain": 1, "row_pair": 2, "tile8": 16, "presum": 1}
# layouts whose rows hold one token's base AND residue (M-Ext)
MEXT_LAYOUTS: tuple[str, ...] = ("row_pair", "tile8", "presum")


def mode_of(compensation: str) -> str:
    """"plain" (no residue), "mext" (full residue as extra rows) or "kext" (selected residue
    channels appended along K)."""
    if compensation not in COMPENSATIONS:
        raise ValueError(f"compensation must be one of {COMPENSATIONS}, got {compensation!r}")
    return {"none": "plain", "full": "mext"}.get(compensation, "kext")


def ksel_of(compensation: str) -> int:
    """K-Ext channels selected per 8-channel group (0 unless K-Ext)."""
    if mode_of(compensation) != "kext":
        return 0
    return int(round(GROUP * float(compensation)))


@dataclass(frozen=True)
class OperandShape:
    """Geometry of one quantizer call (see the module docstring)."""

    fmt: str
    compensation: str
    k: int
    m: int
    layout: str
    row_multiple: int
    kp_align: int = 64

    @property
    def mode(self) -> str:
        return mode_of(self.compensation)

    @property
    def block(self) -> int:
        return formats.block_size(self.fmt)

    @property
    def ksel(self) -> int:
        return ksel_of(self.compensation)

    @property
    def ext(self) -> int:
        """K-Ext extension channels (selected channels padded to the block), else 0."""
        if self.mode != "kext":
            return 0
        return formats.extension_length(self.k * self.ksel // GROUP, self.fmt)

    @property
    def kq(self) -> int:
        """Operand channels: K + ext for K-Ext's appended residues, K otherwise (also K-Ext
        "presum", whose residues are added onto their base channels)."""
        return self.k + (0 if self.layout == "presum" else self.ext)

    @property
    def kp(self) -> int:
        return -(-self.kq // self.kp_align) * self.kp_align

    @property
    def rows_per_slot(self) -> int:
        return 2 if self.layout in ("row_pair", "tile8") else 1

    @property
    def t_pad(self) -> int:
        need = {"plain": self.m, "row_pair": 2 * self.m, "presum": self.m,
                "tile8": 16 * -(-self.m // 8)}[self.layout]
        mult = math.lcm(self.row_multiple, _GRANULE[self.layout])
        return -(-need // mult) * mult

    @property
    def slots(self) -> int:
        """Token slots the kernel writes (real tokens first, then zero tokens)."""
        return self.t_pad // self.rows_per_slot


def operand_shape(fmt: str, compensation: str, k: int, m: int, layout: str = "plain",
                  row_multiple: int = 1, kp_align: int = 64) -> OperandShape:
    """Validated OperandShape; ValueError on any inconsistency."""
    formats.block_size(fmt)
    mode = mode_of(compensation)
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    fits = {"plain": ("plain",), "mext": MEXT_LAYOUTS, "kext": ("plain", "presum")}[mode]
    if layout not in fits:
        raise ValueError(f"layout {layout!r} does not fit compensation {compensation!r}: M-Ext "
                         f"(full) uses row_pair, tile8 or presum, K-Ext plain or presum, W4A4 "
                         f"plain")
    if layout == "presum" and fmt != "nvfp4":
        raise ValueError("layout 'presum' is NVFP4 only: MXFP4 presum needs each row's "
                         "power-of-two shift from max |X_hat + R_hat| over all of K "
                         "(formats.presum_fp16), which a warp tile of one row does not see")
    if not isinstance(k, int) or k <= 0 or k % formats.block_size(fmt) or k % GROUP:
        raise ValueError(f"K={k} must be a positive multiple of {formats.block_size(fmt)} "
                         f"(the {fmt} block) and of {GROUP}")
    if not isinstance(m, int) or m < 1:
        raise ValueError(f"m (tokens) must be a positive int, got {m!r}")
    if not isinstance(row_multiple, int) or row_multiple < 1:
        raise ValueError(f"row_multiple must be a positive int, got {row_multiple!r}")
    if kp_align not in KP_ALIGNS:
        raise ValueError(f"kp_align must be one of {KP_ALIGNS}, got {kp_align!r}")
    return OperandShape(fmt, compensation, k, m, layout, row_multiple, kp_align)


def row_map(m: int, layout: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(base rows, residue rows) int64 [m] of tokens 0..m-1; residue rows None for "plain"
    and "presum" (one summed row per token)."""
    j = torch.arange(m, dtype=torch.int64)
    if layout in ("plain", "presum"):
        return j, None
    if layout == "row_pair":
        return 2 * j, 2 * j + 1
    if layout == "tile8":
        rb = 16 * (j // 8) + j % 8
        return rb, rb + 8
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


@dataclass
class QuantOperand:
    """The quantizer's outputs (see the module docstring); alpha is None for MXFP4."""

    shape: OperandShape
    codes: torch.Tensor
    scales: torch.Tensor
    xop: torch.Tensor
    alpha: torch.Tensor | None


def _masks_for(shape: OperandShape, masks) -> torch.Tensor | None:
    if shape.mode != "kext":
        if masks is not None:
            raise ValueError(f"channel masks are only used by K-Ext, not {shape.compensation!r}")
        return None
    if masks is None:
        raise ValueError("K-Ext needs the channel selection masks (uint8 [K / 8])")
    if isinstance(masks, Selection):
        if masks.ratio != float(shape.compensation):
            raise ValueError(f"selection ratio {masks.ratio} does not match compensation "
                             f"{shape.compensation}")
        masks = masks.masks
    masks = torch.as_tensor(masks)
    if masks.dtype != torch.uint8 or masks.shape != (shape.k // GROUP,):
        raise ValueError(f"masks must be uint8 [{shape.k // GROUP}], got {masks.dtype} "
                         f"{tuple(masks.shape)}")
    Selection(masks.cpu(), float(shape.compensation))   # validates k bits per group
    return masks


def operand_reference(x: torch.Tensor, fmt: str = "nvfp4", compensation: str = "none",
                      layout: str = "plain", row_multiple: int = 1, global_scale=None,
                      masks=None, kp_align: int = 64) -> QuantOperand:
    """Every output of the quantizer, built in torch from resgen.formats (the definition).

    x: [m, K] float (bf16 in practice); global_scale: NVFP4 static alpha or None (dynamic);
    masks: K-Ext selection (uint8 [K / 8] or calibrate.Selection). Runs on x's device.
    """
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError("x must be a 2-D tensor [m, K]")
    shape = operand_shape(fmt, compensation, x.shape[1], x.shape[0], layout, row_multiple,
                          kp_align)
    mk = _masks_for(shape, masks)
    dev = x.device
    if shape.mode == "plain":
        base = formats.quantize(x, fmt, global_scale=global_scale)
        res = None
    else:
        sel = None if mk is None else Selection(mk.cpu(), float(compensation))
        base, res = formats.quantize_with_residue(x, fmt, channels=sel, global_scale=global_scale)
    t, bs = shape.t_pad, shape.block
    if layout == "presum":
        # one FP16 row per token: the unit base + residue values summed in FP32, rounded once
        # (K-Ext: each selected channel's residue added onto its base channel)
        r = formats.dequantize(res, apply_global_scale=False).float()
        if shape.mode == "kext":
            assert sel is not None
            r = formats.residue_on_channels(r, sel.indices, shape.k)
        s = formats.dequantize(base, apply_global_scale=False).float() + r
        xop16 = torch.zeros(t, shape.kp, dtype=torch.float16, device=dev)
        xop16[: shape.m, : shape.k] = formats.presum_fp16(s, fmt).to(torch.float16)
        none = torch.zeros(t, 0, dtype=torch.uint8, device=dev)
        return QuantOperand(shape, none, none.view(torch.float8_e4m3fn), xop16,
                            base.global_scale.reshape(1).clone())
    codes = torch.zeros(t, shape.kq // 2, dtype=torch.uint8, device=dev)
    scales = torch.zeros(t, shape.kq // bs, dtype=torch.uint8, device=dev)
    xop = torch.zeros(t, shape.kp, dtype=torch.bfloat16, device=dev)

    def put(rows, q: formats.QuantizedTensor, c0: int = 0) -> None:
        n = q.codes.shape[-1] * 2
        codes[rows, c0 // 2:(c0 + n) // 2] = q.codes
        scales[rows, c0 // bs:(c0 + n) // bs] = _scale_bytes(q.scales)
        xop[rows, c0:c0 + n] = formats.dequantize(q, apply_global_scale=False).to(torch.bfloat16)

    rb, rr = row_map(shape.m, layout)
    rb = rb.to(dev)
    put(rb, base)
    if shape.mode == "mext":
        put(rr.to(dev), res)
    elif shape.mode == "kext":
        put(rb, res, shape.k)
    if fmt == "nvfp4":
        scales = scales.view(torch.float8_e4m3fn)
    alpha = None if base.global_scale is None else base.global_scale.reshape(1).clone()
    return QuantOperand(shape, codes, scales, xop, alpha)


def _scale_bytes(s: torch.Tensor) -> torch.Tensor:
    return s.view(torch.uint8) if s.dtype == torch.float8_e4m3fn else s


def xop_reference(x: torch.Tensor, fmt: str = "nvfp4", compensation: str = "none",
                  layout: str = "plain", row_multiple: int = 1, global_scale=None,
                  masks=None, kp_align: int = 64) -> torch.Tensor:
    """bf16 [T_pad, KP]: the exact BF16 GEMM operand (see operand_reference)."""
    return operand_reference(x, fmt, compensation, layout, row_multiple, global_scale,
                             masks, kp_align).xop


def split_operand(op: QuantOperand) -> tuple[formats.QuantizedTensor,
                                             formats.QuantizedTensor | None]:
    """(base [m, K], residue [m, K] (M-Ext) / [m, ext] (K-Ext) / None) as formats tensors,
    read back from the operand's codes and scales (the inverse of the layout)."""
    s = op.shape
    if s.layout == "presum":
        raise ValueError("a presum operand holds fp16(X_hat + R_hat) only: no codes or scales "
                         "to split")
    bs = s.block
    gs = None if op.alpha is None else op.alpha.reshape(())
    sc = op.scales
    rb, rr = row_map(s.m, s.layout)
    rb = rb.to(op.codes.device)
    kq2, k2, kb = s.kq // 2, s.k // 2, s.k // bs
    base = formats.QuantizedTensor(s.fmt, op.codes[rb, :k2], sc[rb, :kb], gs)
    if s.mode == "plain":
        return base, None
    if s.mode == "mext":
        rr = rr.to(op.codes.device)
        return base, formats.QuantizedTensor(s.fmt, op.codes[rr, :k2], sc[rr, :kb], gs)
    return base, formats.QuantizedTensor(s.fmt, op.codes[rb, k2:kq2], sc[rb, kb:], gs)


# ----------------------------------------------------------------------------- kernel config


@dataclass(frozen=True)
class QuantConfig:
    """Everything a rendered quant_sm90 kernel is specialized on.

    ept: elements per lane (8: Algorithm 1's pack8; 16: pack16, one NVFP4 block per lane);
    warps: warps per CTA; unroll: warp tiles per warp, loads issued together (per loop
    iteration with persist); persist: a resident grid whose warps loop over the tiles with the
    next iteration's loads in flight (see the template);
    write_codes / write_xop: which outputs exist; alpha: "static" | "dynamic" (NVFP4) or
    "none" (MXFP4); kp_align: the xop column granularity the consuming GEMM needs.
    """

    fmt: str
    compensation: str
    k: int
    layout: str
    ept: int = 8
    warps: int = 4
    unroll: int = 2
    persist: bool = False
    write_codes: bool = True
    write_xop: bool = True
    alpha: str = "static"
    kp_align: int = 64

    @property
    def mode(self) -> str:
        return mode_of(self.compensation)

    @property
    def ksel(self) -> int:
        return ksel_of(self.compensation)

    def shape(self, m: int = 1, row_multiple: int = 1) -> OperandShape:
        return operand_shape(self.fmt, self.compensation, self.k, m, self.layout, row_multiple,
                             self.kp_align)

    def why_invalid(self) -> str | None:
        """None if this configuration can be rendered and run, else the reason."""
        try:
            shape = self.shape()
        except ValueError as e:
            return str(e)
        if self.ept not in (8, 16):
            return f"ept={self.ept}: elements per lane must be 8 or 16"
        if self.k % (32 * self.ept):
            return f"K={self.k} is not a multiple of a warp tile (32 lanes x {self.ept})"
        if self.warps not in (1, 2, 4, 8):
            return f"warps={self.warps} must be 1, 2, 4 or 8"
        if self.unroll not in (1, 2, 4):
            return f"unroll={self.unroll} must be 1, 2 or 4"
        if not (self.write_codes or self.write_xop):
            return "writes nothing: enable codes or xop"
        if self.layout == "presum" and (self.write_codes or not self.write_xop):
            return "layout 'presum' writes the fp16 xop only (no codes / scales)"
        want = ("none",) if self.fmt == "mxfp4" else ("static", "dynamic")
        if self.alpha not in want:
            return f"alpha={self.alpha!r} does not fit {self.fmt} (allowed: {want})"
        if shape.mode == "kext" and shape.ext != self.k * self.ksel // GROUP:
            return "K-Ext extension would need padding inside a block (K * ratio % block != 0)"
        return None

    def template_params(self) -> dict[str, Any]:
        reason = self.why_invalid()
        if reason:
            raise ValueError(f"invalid quant_sm90 config: {reason}")
        s = self.shape()
        return {
            "fmt": self.fmt, "mode": s.mode, "ksel": s.ksel, "layout": self.layout,
            "ept": self.ept, "warps": self.warps, "unroll": self.unroll,
            "persist": bool(self.persist),
            "write_codes": bool(self.write_codes), "write_xop": bool(self.write_xop),
            "alpha": self.alpha, "k": self.k, "kq": s.kq, "kp": s.kp,
            "amax_ctas": AMAX_CTAS, "amax_threads": AMAX_THREADS,
            "device_digest": _device_digest(),
        }


def xop_dtype(layout: str) -> torch.dtype:
    """The xop's element type: float16 for "presum" (fp16(X_hat + R_hat)), else bfloat16 (the
    exact unit values)."""
    return torch.float16 if layout == "presum" else torch.bfloat16


def _device_digest() -> str:
    """sha256 of fp4_device.py, rendered into every module so that the fingerprint of a
    rendered kernel changes when the device math it imports changes."""
    path = Path(__file__).with_name("fp4_device.py")
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def fake_args(config: QuantConfig) -> list[Any]:
    """cute.compile arguments (null pointers with the alignment the kernel assumes, dynamic
    m / slots, a null stream): compiling needs no GPU."""
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_ptr

    g = cute.AddressSpace.gmem

    def ptr(dt, align):
        return make_ptr(dt, 0, g, assumed_align=align)

    return [ptr(cutlass.BFloat16, 16), ptr(cutlass.Float32, 4), ptr(cutlass.Uint8, 2),
            ptr(cutlass.Uint8, 16), ptr(cutlass.Uint8, 1), ptr(cutlass.BFloat16, 16),
            ptr(cutlass.Float32, 16), cutlass.Int32(1), cutlass.Int32(1), cutlass.Int32(1),
            cuda.CUstream(0)]


WORKSPACE_FLOATS = AMAX_CTAS + 16   # partial maxima, then 64 bytes that stay zero


@dataclass
class QuantOutputs:
    """Device buffers of one call shape: the operand plus the kernel's scratch."""

    operand: QuantOperand
    workspace: torch.Tensor        # float32 [AMAX_CTAS + 16]: partial maxima (dynamic alpha),
    #                                then 64 zero bytes the kernel reads for padding slots
    dummy: torch.Tensor = field(repr=False)   # stands in for outputs a variant does not write


def quant_kernel_resources(cubin: bytes | None) -> dict[str, int]:
    """{"registers", "frame"} (registers per thread, stack frame bytes: 0 = no spills) of the
    module's quant_kernel, from the .nv.info attributes keyed by kernel symbol (a dynamic-alpha
    module also holds the amax kernel, which codegen's first-kernel figures describe)."""
    out: dict[str, int] = {}
    if not cubin:
        return out
    import struct

    from .cubin import _sections

    try:
        secs = dict(_sections(cubin))
        symtab, strtab = secs.get(".symtab", b""), secs.get(".strtab", b"")

        def sym_name(i: int) -> str:                   # Elf64_Sym is 24 bytes, st_name first
            (off,) = struct.unpack_from("<I", symtab, 24 * i)
            return strtab[off:strtab.index(b"\0", off)].decode()

        for name, data in secs.items():
            if name != ".nv.info" and not name.startswith(".nv.info."):
                continue
            pos = 0
            while pos + 4 <= len(data):
                fmt, attr, size = struct.unpack_from("<BBH", data, pos)
                # EIATTR_REGCOUNT (0x2f), EIATTR_FRAME_SIZE (0x11): (symbol, value)
                if fmt == 0x04 and attr in (0x2F, 0x11) and size >= 8:
                    sym, val = struct.unpack_from("<II", data, pos + 4)
                    if "quant_kernel" in sym_name(sym):
                        out["registers" if attr == 0x2F else "frame"] = val
                pos += 4 + (size if fmt == 0x04 else 0)
    except (ValueError, struct.error, IndexError):
        return {}
    return out


def quant_kernel_registers(cubin: bytes | None) -> int | None:
    """Registers per thread of the module's quant_kernel; None if unknown."""
    return quant_kernel_resources(cubin).get("registers")


def ctas_per_sm(warps: int, registers: int | None) -> int:
    """CTAs of `warps` warps resident on one sm_90 SM: 64 warps, 65536 registers (allocated
    per thread in multiples of 8), 32 CTAs; an unknown register count is taken as 64."""
    threads = 32 * warps
    regs = -(-(registers or 64) // 8) * 8
    return max(1, min(32, 2048 // threads, 65536 // (regs * threads)))


class QuantKernel:
    """A compiled quant_sm90 variant; call it on torch CUDA tensors.

    kern = compile_config(QuantConfig("nvfp4", "full", 4096, "row_pair"))
    out = kern.outputs(m, row_multiple=16, device=x.device)
    kern(x, out, alpha=alpha)            # alpha: float32 [1] (static); masks: K-Ext
    """

    def __init__(self, config: QuantConfig, compiled: Any, registers: int | None = None):
        reason = config.why_invalid()
        if reason:
            raise ValueError(f"invalid quant_sm90 config: {reason}")
        self.config = config
        self.compiled = compiled
        if registers is None:
            registers = quant_kernel_registers(
                getattr(getattr(compiled, "artifacts", None), "CUBIN", None))
        self.registers = registers
        self.grid_cap: int | None = None     # overrides max_ctas (tests: force many loops)
        self._max_ctas: dict[Any, int] = {}

    def max_ctas(self, device: torch.device) -> int:
        """The persistent grid's cap on `device`: SMs x resident CTAs per SM."""
        if self.grid_cap is not None:
            return self.grid_cap
        if device not in self._max_ctas:
            sms = (torch.cuda.get_device_properties(device).multi_processor_count
                   if device.type == "cuda" else 132)
            self._max_ctas[device] = sms * ctas_per_sm(self.config.warps, self.registers)
        return self._max_ctas[device]

    def outputs(self, m: int, row_multiple: int = 1, device="cuda") -> QuantOutputs:
        """Allocate the operand buffers for m tokens (contents undefined until a call)."""
        c = self.config
        s = c.shape(m, row_multiple)
        dev = torch.device(device)
        dummy = torch.zeros(64, dtype=torch.uint8, device=dev)
        codes = (torch.empty(s.t_pad, s.kq // 2, dtype=torch.uint8, device=dev)
                 if c.write_codes else dummy[:0])
        scales = (torch.empty(s.t_pad, s.kq // s.block, dtype=torch.uint8, device=dev)
                  if c.write_codes else dummy[:0])
        if c.fmt == "nvfp4":
            scales = scales.view(torch.float8_e4m3fn)
        xop = (torch.empty(s.t_pad, s.kp, dtype=xop_dtype(c.layout), device=dev)
               if c.write_xop else dummy[:0].view(torch.bfloat16))
        alpha = torch.ones(1, dtype=torch.float32, device=dev) if c.fmt == "nvfp4" else None
        ws = torch.zeros(WORKSPACE_FLOATS, dtype=torch.float32, device=dev)
        return QuantOutputs(QuantOperand(s, codes, scales, xop, alpha), ws, dummy)

    def __call__(self, x: torch.Tensor, out: QuantOutputs, alpha: torch.Tensor | None = None,
                 masks: torch.Tensor | None = None, stream: Any = None) -> QuantOperand:
        """Quantize x: [m, K] bf16 (CUDA, contiguous) into `out` on the current stream.

        alpha: float32 [1] device tensor, required for static NVFP4 (it becomes
        out.operand.alpha); dynamic NVFP4 writes the computed alpha to out.operand.alpha.
        masks: uint8 [K / 8] on x's device (K-Ext only; a calibrate.Selection's masks).
        Nothing here synchronizes with the device, so calls can be captured in a CUDA graph."""
        import cuda.bindings.driver as cuda
        import cutlass
        import cutlass.cute as cute
        from cutlass.cute.runtime import make_ptr

        c = self.config
        op = out.operand
        s = op.shape
        simulated = getattr(self.compiled, "SIMULATED", False)   # CPU tests' stand-in
        if x.device != op.xop.device or (x.device.type != "cuda" and not simulated):
            raise ValueError(f"x must be on the outputs' CUDA device ({op.xop.device})")
        if x.dtype != torch.bfloat16 or x.dim() != 2 or not x.is_contiguous():
            raise TypeError(f"x must be a contiguous 2-D bf16 tensor, got {x.dtype} "
                            f"{tuple(x.shape)}")
        if x.shape != (s.m, c.k):
            raise ValueError(f"x is {tuple(x.shape)}, outputs were allocated for "
                             f"{(s.m, c.k)}")
        if s.m * c.k >= 2 ** 31 or s.t_pad * s.kp >= 2 ** 31:
            raise ValueError("tensor too large for 32-bit element indexing")
        if c.alpha == "static":
            if alpha is None or alpha.dtype != torch.float32 or alpha.numel() != 1:
                raise ValueError("static NVFP4 needs alpha: a float32 device tensor of 1 element")
            if alpha.device != x.device:
                raise ValueError("alpha must be on x's device")
            alpha_t = alpha
            op.alpha = alpha            # the operand's alpha is the tensor scale used
        else:
            if alpha is not None:
                raise ValueError(f"alpha is computed by this variant ({c.alpha}); pass None")
            alpha_t = op.alpha if op.alpha is not None else out.dummy
        m_t = masks
        if s.mode == "kext":
            # Shape / dtype / device only: the per-group bit counts (validated when the
            # calibrate.Selection was made) would need a device->host copy, which is not
            # allowed while a CUDA graph is being captured.
            if isinstance(masks, Selection):
                masks = masks.masks
            if (not isinstance(masks, torch.Tensor) or masks.dtype != torch.uint8
                    or masks.shape != (c.k // GROUP,) or masks.device != x.device):
                raise ValueError(f"K-Ext needs masks: uint8 [{c.k // GROUP}] on {x.device}")
            m_t = masks
        elif masks is not None:
            raise ValueError("masks are only used by K-Ext")
        else:
            m_t = out.dummy
        g = cute.AddressSpace.gmem

        def p(t: torch.Tensor, dt, align: int):
            if t.data_ptr() % align:
                raise ValueError(f"buffer at {t.data_ptr():#x} is not {align}-byte aligned")
            return make_ptr(dt, t.data_ptr(), g, assumed_align=align)

        if stream is None:
            stream = cuda.CUstream(torch.cuda.current_stream(x.device).cuda_stream
                                   if x.is_cuda else 0)
        self.compiled(
            p(x, cutlass.BFloat16, 16), p(alpha_t, cutlass.Float32, 4), p(m_t, cutlass.Uint8, 2),
            p(op.codes if c.write_codes else out.dummy, cutlass.Uint8, 16),
            p(op.scales if c.write_codes else out.dummy, cutlass.Uint8, 1),
            p(op.xop if c.write_xop else out.dummy, cutlass.BFloat16, 16),
            p(out.workspace, cutlass.Float32, 16), cutlass.Int32(s.m), cutlass.Int32(s.slots),
            cutlass.Int32(self.max_ctas(x.device)), stream)
        return op


def compile_config(config: QuantConfig, arch: str = "sm_90a"):
    """Render, import and compile one configuration; returns (QuantKernel, CompileResult)."""
    from . import codegen

    path, _ = codegen.render_to_file(TEMPLATE, config.template_params(), FAMILY)
    module = codegen.load_module(path)
    res = codegen.compile_entry(module.entry, fake_args(config), arch)
    return QuantKernel(config, res.fn), res
