"""Block-scaled FP4 formats: NVFP4 and MXFP4, bit-exact quantization and residues.

Everything in resgen is checked against this module, so every operation is spelled out in
FP32 in a fixed order that the GPU kernels reproduce:

NVFP4 (paper Eq. 8-10; NVIDIA's ModelOpt layout)
    alpha = amax(x) / (6 * 448)                  # FP32 tensor scale (or a static one)
    s     = amax_block / 6                       # per 16 elements, FP32 division
    sf    = E4M3_rne_sat(s / alpha)              # stored scale, saturating at 448
    d     = alpha * sf                           # FP32 product (the effective scale)
    code  = E2M1_rne_sat(x / d)                  # FP32 division, saturating at +-6
    x_hat = d * value(code)

MXFP4 (OCP MX v1.0)
    e     = clamp(floor(log2(amax_block)) - 2, -127, 127)     # per 32 elements
    code  = E2M1_rne_sat(x * 2^-e);  x_hat = value(code) * 2^e;  stored E8M0 = e + 127

Packing: two E2M1 codes per byte, the EVEN element in the LOW nibble. Codes keep the sign of
their input (IEEE): a negative value that rounds to zero is stored as -0 (0x8).

A block whose effective scale is zero (all-zero block, or an NVFP4 block whose scale underflows
E4M3 relative to alpha) has all-zero codes and dequantizes to exact zeros.

Device independence: every FP32 division above is an IEEE division on every device. torch on
CUDA computes `tensor / python_scalar` as tensor * RN(1 / scalar) (one ulp off for some
inputs), so this module only ever divides by tensors on the dividend's device; powers of two
(MXFP4) are built from their bits, not with torch.ldexp / pow (whose implementation varies by
torch version and device).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence

import torch

__all__ = [
    "FORMATS",
    "QuantizedTensor",
    "block_size",
    "quantize",
    "dequantize",
    "quantize_with_residue",
    "e2m1_values",
    "e2m1_encode",
    "e2m1_decode",
    "e2m1_round",
    "e4m3_round",
    "fp8_scale",
    "fp8_cast",
    "fp8_rowwise_quant",
    "pack_fp4",
    "unpack_fp4",
    "nvfp4_global_scale",
    "presum_fp16",
    "presum_weight",
    "residue_on_channels",
    "E2M1_MAX",
    "E4M3_MAX",
    "PRESUM_TOP",
]

Format = Literal["nvfp4", "mxfp4"]
FORMATS: tuple[str, ...] = ("nvfp4", "mxfp4")
_BLOCK = {"nvfp4": 16, "mxfp4": 32}

E2M1_MAX = 6.0
E4M3_MAX = 448.0
_E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Rounding boundaries between consecutive E2M1 magnitudes, with the direction a tie goes:
# to the even code (mantissa bit 0): 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4.
_BOUNDARIES = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False),
               (3.5, True), (5.0, False))
_ACCEPTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def block_size(fmt: str) -> int:
    """Elements per scale block: 16 for NVFP4, 32 for MXFP4."""
    _check_format(fmt)
    return _BLOCK[fmt]


def _check_format(fmt: str) -> None:
    if fmt not in _BLOCK:
        raise ValueError(f"unknown FP4 format {fmt!r}; expected one of {FORMATS}")


@dataclass(frozen=True)
class QuantizedTensor:
    """A block-scaled FP4 tensor of logical shape [..., K].

    codes:        uint8 [..., K // 2], two E2M1 codes per byte, even element in the low nibble.
    scales:       NVFP4: torch.float8_e4m3fn [..., K // 16];  MXFP4: uint8 E8M0 [..., K // 32].
    global_scale: NVFP4: float32 0-dim tensor alpha;  MXFP4: None.
    """

    fmt: str
    codes: torch.Tensor
    scales: torch.Tensor
    global_scale: torch.Tensor | None

    def __post_init__(self) -> None:
        """Shapes and dtypes are checked here (no device sync): one scale per block of codes,
        never a broadcast. NVFP4 may carry no global scale (per-row scales held elsewhere,
        e.g. ResAttn's queries); dequantize then needs apply_global_scale=False."""
        _check_format(self.fmt)
        for name, t in (("codes", self.codes), ("scales", self.scales)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"QuantizedTensor {name} must be a torch.Tensor, got "
                                f"{type(t).__name__}")
        if self.codes.dtype != torch.uint8 or self.codes.dim() == 0:
            raise ValueError(f"QuantizedTensor codes must be packed uint8 [..., K // 2], got "
                             f"{self.codes.dtype} {tuple(self.codes.shape)}")
        want = torch.float8_e4m3fn if self.fmt == "nvfp4" else torch.uint8
        if self.scales.dtype != want:
            raise ValueError(f"{self.fmt} scales must be {want}, got {self.scales.dtype}")
        bs = _BLOCK[self.fmt]
        k = self.codes.shape[-1] * 2
        expect = (*self.codes.shape[:-1], k // bs)
        if k % bs or tuple(self.scales.shape) != expect:
            raise ValueError(f"{self.fmt} codes {tuple(self.codes.shape)} (K = {k}) need scales "
                             f"of shape {expect} (one per {bs} elements), got "
                             f"{tuple(self.scales.shape)}")
        gs = self.global_scale
        if self.fmt == "mxfp4" and gs is not None:
            raise ValueError("MXFP4 has no global scale; pass global_scale=None")
        if gs is not None and (not isinstance(gs, torch.Tensor) or gs.numel() != 1
                               or not gs.dtype.is_floating_point):
            raise TypeError(f"an NVFP4 global_scale is a one-element float tensor, got "
                            f"{type(gs).__name__}")

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.codes.shape[:-1], self.codes.shape[-1] * 2))

    @property
    def block_size(self) -> int:
        return _BLOCK[self.fmt]

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def to(self, device: torch.device | str) -> "QuantizedTensor":
        gs = None if self.global_scale is None else self.global_scale.to(device)
        return QuantizedTensor(self.fmt, self.codes.to(device), self.scales.to(device), gs)

    def __getitem__(self, index) -> "QuantizedTensor":
        """Index the leading (row) dimensions; the K dimension is never sliced."""
        return QuantizedTensor(self.fmt, self.codes[index], self.scales[index], self.global_scale)

    def scale_values(self) -> torch.Tensor:
        """Block scales as float32 [..., K // block] WITHOUT the NVFP4 global scale. An E8M0
        code of 255 (NaN in OCP MX) or an E4M3 NaN is a ValueError, never a NaN result."""
        if self.fmt == "nvfp4":
            out = self.scales.to(torch.float32)
            if bool(torch.isnan(out).any()):
                raise ValueError("NVFP4 scales hold E4M3 NaN codes")
            return out
        if bool((self.scales == 255).any()):
            raise ValueError("MXFP4 scales hold the E8M0 NaN code 255")
        return _pow2(self.scales.to(torch.int32) - 127)


# ----------------------------------------------------------------------------- element codecs


def e2m1_values(device: torch.device | str = "cpu") -> torch.Tensor:
    """float32 [16]: the value of every E2M1 code 0..15 (code 8 is -0.0)."""
    mag = torch.tensor(_E2M1_GRID, dtype=torch.float32, device=device)
    return torch.cat([mag, -mag])


def e2m1_encode(v: torch.Tensor) -> torch.Tensor:
    """Round float32 values to E2M1 codes (uint8 0..15), nearest-even, saturating at +-6.

    The magnitude code is the number of rounding boundaries below |v| (a tie counts when it
    rounds up); accumulating comparisons in place is the fastest exact form on the CPU.
    """
    a = v.abs()
    code = torch.zeros(v.shape, dtype=torch.uint8, device=v.device)
    for bound, tie_up in _BOUNDARIES:
        code += (a >= bound) if tie_up else (a > bound)
    return code | (torch.signbit(v).to(torch.uint8) << 3)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """float32 values of E2M1 codes (uint8 0..15)."""
    return e2m1_values(codes.device)[codes.long()]


def e2m1_round(v: torch.Tensor) -> torch.Tensor:
    """float32 v -> the nearest E2M1 value, equal to e2m1_decode(e2m1_encode(v)) including the
    sign of zero, without materialising codes (fast path for fake quantization and searches).

    On [0, 2) the grid step is 0.5, on [2, 4) it is 1, on [4, 6] it is 2; torch.round breaks
    ties to even, which on each segment is exactly the even E2M1 code (x2 / x0.5 are exact).
    """
    a = v.abs()
    q = torch.where(a < 2, torch.round(a * 2) * 0.5,
                    torch.where(a < 4, torch.round(a), torch.round(a * 0.5) * 2))
    return torch.copysign(q.clamp_(max=E2M1_MAX), v)


def e4m3_round(v: torch.Tensor) -> torch.Tensor:
    """E4M3 (float8_e4m3fn) round-to-nearest-even of non-negative float32, saturating at 448."""
    return torch.clamp(v, max=E4M3_MAX).to(torch.float8_e4m3fn)


def fp8_scale(amax: torch.Tensor) -> torch.Tensor:
    """The FP8 E4M3 scale of a row's (or a tensor's) amax: max(amax * fp32(1 / 448), 1e-12)."""
    return (amax * (1.0 / E4M3_MAX)).clamp(min=1e-12)


def fp8_cast(xf: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 xf / scale (IEEE division, scale broadcast) clamped to +-448, rounded to E4M3
    (nearest even): the cast of every FP8 quantizer here (per row, per tensor, static)."""
    return (xf / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def fp8_rowwise_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row FP8 E4M3 quantization, the activations of FP8 W8A8 (the baselines) and of the
    W4A8 study mode: x [R, K] (any float dtype) -> (E4M3 [R, K], float32 scales [R, 1]) with

        scale = max(amax(|row|) * fp32(1 / 448), 1e-12)
        x8    = E4M3_rne(clamp(x / scale, +-448))          # FP32 IEEE division

    Dequantized: x8.float() * scale."""
    xf = x.float()
    scale = fp8_scale(xf.abs().amax(dim=-1, keepdim=True))
    return fp8_cast(xf, scale), scale


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K] codes -> uint8 [..., K // 2]; even element in the low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"cannot pack an odd number of FP4 codes ({codes.shape[-1]})")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K // 2] -> uint8 [..., K] codes."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)


# ----------------------------------------------------------------------------- checks


def _as_float32(x: torch.Tensor, fmt: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _ACCEPTED_DTYPES:
        raise TypeError(
            f"{fmt} quantization takes a float16/bfloat16/float32 tensor, got dtype {x.dtype}")
    if x.dim() == 0:
        raise ValueError("cannot quantize a 0-dim tensor: the last dimension is K")
    bs = _BLOCK[fmt]
    if x.shape[-1] % bs:
        raise ValueError(
            f"{fmt} needs the last dimension K to be a multiple of {bs}, got K={x.shape[-1]} "
            f"(resgen never pads silently; pad the channels explicitly)")
    xf = x.to(torch.float32)
    if not bool(torch.isfinite(xf).all()):
        raise ValueError(f"{fmt} quantization input contains NaN or Inf")
    return xf


def _ieee_div(a: torch.Tensor, divisor: float) -> torch.Tensor:
    """a / divisor as an IEEE FP32 division on every device (see the module docstring: a Python
    scalar divisor would make torch on CUDA multiply by its rounded reciprocal instead)."""
    return a / torch.full_like(a, divisor)


def _pow2(e: torch.Tensor) -> torch.Tensor:
    """float32 2^e, exactly, for int32 e in [-149, 127] (subnormal below -126), built from bits."""
    normal = torch.bitwise_left_shift(torch.clamp(e + 127, min=1), 23)
    sub = torch.bitwise_left_shift(torch.ones_like(e), torch.clamp(e + 149, min=0, max=22))
    return torch.where(e >= -126, normal, sub).to(torch.int32).view(torch.float32)


def nvfp4_global_scale(x: torch.Tensor) -> torch.Tensor:
    """Dynamic NVFP4 tensor scale alpha = amax(x) / (6 * 448) as a float32 0-dim tensor.

    An all-zero tensor gets alpha = 1 (any positive value works: every code is zero). An alpha
    that would underflow FP32 normals is raised to the smallest normal float32, which keeps
    s / alpha <= 448 and never divides by zero.
    """
    amax = x.detach().abs().amax().to(torch.float32) if x.numel() else torch.zeros(())
    alpha = _ieee_div(amax, E2M1_MAX * E4M3_MAX)
    tiny = torch.finfo(torch.float32).tiny
    alpha = torch.where(amax == 0, torch.ones_like(alpha), torch.clamp(alpha, min=tiny))
    return alpha.reshape(())


def _check_global_scale(global_scale, device) -> torch.Tensor:
    """A static NVFP4 tensor scale: a positive finite Python number or one-element tensor."""
    if isinstance(global_scale, torch.Tensor):
        if global_scale.numel() != 1 or not (global_scale.dtype.is_floating_point or
                                             global_scale.dtype in _INT_DTYPES):
            raise TypeError(f"NVFP4 global_scale must be one number, got a "
                            f"{global_scale.dtype} tensor of shape {tuple(global_scale.shape)}")
    elif isinstance(global_scale, bool) or not isinstance(global_scale, (int, float)):
        raise TypeError(f"NVFP4 global_scale must be a positive number or a one-element "
                        f"tensor, got {type(global_scale).__name__}")
    gs = torch.as_tensor(global_scale, dtype=torch.float32, device=device).reshape(())
    if not bool(torch.isfinite(gs)) or float(gs) <= 0:
        raise ValueError(f"NVFP4 global_scale must be a positive finite number, got {float(gs)}")
    return gs


# ----------------------------------------------------------------------------- quantize


def _quantize_blocks(xf: torch.Tensor, fmt: str, alpha: torch.Tensor | None):
    """xf: float32 [..., K] -> (codes uint8 [..., K], scales, effective scale f32 [..., K/bs, 1])."""
    bs = _BLOCK[fmt]
    blocks = xf.reshape(*xf.shape[:-1], xf.shape[-1] // bs, bs)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    if fmt == "nvfp4":
        if isinstance(alpha, torch.Tensor) and alpha.device != xf.device:
            alpha = alpha.to(xf.device)     # a CPU scalar divisor is not an IEEE division on CUDA
        sf = e4m3_round(_ieee_div(amax, E2M1_MAX) / alpha)
        d = alpha * sf.to(torch.float32)
        # A zero effective scale divides by +inf instead: finite / inf = +-0, exact zeros.
        v = blocks / torch.where(d > 0, d, torch.full_like(d, float("inf")))
        scales = sf.squeeze(-1)
    else:
        # floor(log2(amax)) exactly: amax = m * 2^E with m in [0.5, 1) -> E - 1.
        exp = torch.frexp(amax).exponent.to(torch.int32) - 1
        e = torch.where(amax > 0, exp - 2, torch.full_like(exp, -127)).clamp(-127, 127)
        v = blocks * _pow2(-e)          # exact unless it underflows (then RNE)
        d = _pow2(e)
        scales = (e + 127).to(torch.uint8).squeeze(-1)
    codes = e2m1_encode(v).reshape(xf.shape)
    return codes, scales, d


def quantize(x: torch.Tensor, fmt: str = "nvfp4", global_scale=None) -> QuantizedTensor:
    """Quantize x: [..., K] float to block-scaled FP4.

    fmt: "nvfp4" (K % 16 == 0) or "mxfp4" (K % 32 == 0).
    global_scale: NVFP4 only: a static tensor scale alpha (e.g. a calibrated ModelOpt
        input_scale); None computes alpha = amax(x) / 2688 from x. Must be None for MXFP4.
    """
    _check_format(fmt)
    xf = _as_float32(x, fmt)
    alpha = _resolve_alpha(xf, fmt, global_scale)
    codes, scales, _ = _quantize_blocks(xf, fmt, alpha)
    return QuantizedTensor(fmt, pack_fp4(codes), scales, alpha)


def _resolve_alpha(xf: torch.Tensor, fmt: str, global_scale) -> torch.Tensor | None:
    if fmt == "mxfp4":
        if global_scale is not None:
            raise ValueError("MXFP4 has no global scale; pass global_scale=None")
        return None
    if global_scale is None:
        return nvfp4_global_scale(xf)
    return _check_global_scale(global_scale, xf.device)


def dequantize(q: QuantizedTensor, *, apply_global_scale: bool = True) -> torch.Tensor:
    """QuantizedTensor -> float32 [..., K].

    NVFP4: x_hat = (alpha * sf) * value(code), in that FP32 order (the quantizer's order).
    apply_global_scale=False returns sf * value(code) instead: exact in FP32 (E2M1 x E4M3 needs
    at most 6 significant bits), which is what the reference GEMMs accumulate before applying
    the global scales once.
    """
    if not isinstance(q, QuantizedTensor):
        raise TypeError(f"dequantize takes a QuantizedTensor, got {type(q).__name__}")
    bs = q.block_size
    vals = e2m1_decode(unpack_fp4(q.codes))
    vals = vals.reshape(*vals.shape[:-1], vals.shape[-1] // bs, bs)
    scale = q.scale_values().unsqueeze(-1)
    if q.fmt == "nvfp4" and apply_global_scale:
        if q.global_scale is None:
            raise ValueError("this NVFP4 tensor has no global scale (its scales are kept "
                             "elsewhere): pass apply_global_scale=False")
        scale = q.global_scale * scale
    return (scale * vals).reshape(q.shape)


def _selected_indices(channels, k: int, device) -> torch.Tensor:
    if not isinstance(channels, torch.Tensor) and hasattr(channels, "indices"):
        idx = channels.indices
        if getattr(channels, "in_features", k) != k:
            raise ValueError(
                f"channel selection was made for K={channels.in_features}, input has K={k}")
    else:
        idx = torch.as_tensor(channels)
    if idx.dtype not in _INT_DTYPES or idx.dim() > 1:
        raise ValueError(f"selected channels must be a 1-D integer index tensor, got "
                         f"{idx.dtype} of shape {tuple(idx.shape)} (float indices are not "
                         "truncated)")
    idx = idx.to(device=device, dtype=torch.long).reshape(-1)
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= k):
        raise ValueError(f"selected channel indices must lie in [0, {k})")
    if idx.numel() != torch.unique(idx).numel():
        raise ValueError("selected channel indices repeat a channel")
    return idx


def extension_length(n_selected: int, fmt: str) -> int:
    """Channels of the K-Ext extension: n_selected rounded up to the format's block size."""
    bs = block_size(fmt)
    return -(-n_selected // bs) * bs


def quantize_with_residue(x: torch.Tensor, fmt: str = "nvfp4", channels=None,
                          global_scale=None) -> tuple[QuantizedTensor, QuantizedTensor]:
    """Quantize x: [..., K] and its residue R = x - dequantize(base).

    Returns (base, res). NVFP4: res has its own E4M3 block scales and SHARES base.global_scale
    (paper B.2); MXFP4: res has its own E8M0 scales.
    channels: None -> res covers all K channels (M-Ext). Otherwise a selection (an object with
        `.indices`, e.g. resgen.calibrate.Selection, or a 1-D index tensor in extension order):
        res holds R[..., indices] packed contiguously as the K-Ext extension, zero-padded to a
        multiple of the block size; res.shape[-1] == extension_length(len(indices), fmt).
    """
    _check_format(fmt)
    xf = _as_float32(x, fmt)
    alpha = _resolve_alpha(xf, fmt, global_scale)
    idx = None if channels is None else _selected_indices(channels, xf.shape[-1], xf.device)
    (codes, scales), (rcodes, rscales) = residue_pair(xf, fmt, alpha, idx)
    return (QuantizedTensor(fmt, pack_fp4(codes), scales, alpha),
            QuantizedTensor(fmt, pack_fp4(rcodes), rscales, alpha))


def residue_pair(xf: torch.Tensor, fmt: str, alpha: torch.Tensor | None,
                 idx: torch.Tensor | None = None):
    """Unchecked core of quantize_with_residue on float32 xf: [..., K].

    alpha may be any float32 tensor broadcastable to [..., K // block, 1] (one tensor scale per
    row, as ResAttn's query quantizer uses). Returns ((codes, scales), (res_codes, res_scales))
    with UNPACKED uint8 codes.
    """
    codes, scales, d = _quantize_blocks(xf, fmt, alpha)
    bs = _BLOCK[fmt]
    vals = e2m1_decode(codes).reshape(*xf.shape[:-1], xf.shape[-1] // bs, bs)
    residue = xf - (d * vals).reshape(xf.shape)
    if idx is not None:
        residue = residue.index_select(-1, idx)
        pad = extension_length(idx.numel(), fmt) - idx.numel()
        if pad:
            residue = torch.nn.functional.pad(residue, (0, pad))
    rcodes, rscales, _ = _quantize_blocks(residue, fmt, alpha)
    return (codes, scales), (rcodes, rscales)


def cat(parts: Sequence[QuantizedTensor]) -> QuantizedTensor:
    """Concatenate quantized tensors along K (blocks never straddle the seam).

    NVFP4 parts must share one global scale (as base and residue do)."""
    fmt = parts[0].fmt
    if any(p.fmt != fmt for p in parts):
        raise ValueError("cannot concatenate different FP4 formats")
    gs = parts[0].global_scale
    if fmt == "nvfp4" and any(not torch.equal(p.global_scale, gs) for p in parts):
        raise ValueError("NVFP4 parts must share one global scale to be concatenated")
    return QuantizedTensor(fmt, torch.cat([p.codes for p in parts], -1),
                           torch.cat([p.scales for p in parts], -1), gs)


# ----------------------------------------------------------------------------- presum fold

# MXFP4 presum: the power of two that puts a row's largest |value| in [2^11, 2^12) (FP16 holds
# up to 65504: 16x headroom; its normals start 25 binades lower).
PRESUM_TOP = 11


def _pow2_shift(amax: torch.Tensor) -> torch.Tensor:
    """int32 t = floor(log2(amax)) - PRESUM_TOP (0 where amax == 0), clamped to [-100, 100] so
    that 2^t and 2^-t are float32 normals."""
    exp = torch.frexp(amax).exponent.to(torch.int32) - 1
    t = torch.where(amax > 0, exp - PRESUM_TOP, torch.zeros_like(exp))
    return t.clamp(-100, 100)


def residue_on_channels(r: torch.Tensor, idx: torch.Tensor, k: int) -> torch.Tensor:
    """K-Ext residues moved back onto the channels they were taken from, for the presum fold.

    r: [..., E] the extension's values (the selected channels' residues in selection order,
    then the zero padding to the block: E >= len(idx)); idx: int64 [S] those channels
    (calibrate.Selection.indices). Returns [..., K] in r's dtype: r[..., i] at channel idx[i],
    zero elsewhere. The one definition of where a K-Ext residue lands in X_hat + R_hat
    (resgen.reference.linear, the quality study's fake-quant layers and quant_sm90's presum
    operand use it)."""
    idx = idx.to(device=r.device, dtype=torch.int64)
    if r.shape[-1] < idx.numel():
        raise ValueError(f"{r.shape[-1]} extension values for {idx.numel()} selected channels")
    out = torch.zeros(*r.shape[:-1], k, dtype=r.dtype, device=r.device)
    out[..., idx] = r[..., : idx.numel()]
    return out


def presum_fp16(s: torch.Tensor, fmt: str) -> torch.Tensor:
    """The activation operand of the pre-summed ("presum") fold, rounded once to FP16.

    s: float32 [..., K]: the base and residue operand values summed in FP32 (X_hat + R_hat;
    NVFP4 without the tensor scale alpha, which stays in the epilogue; K-Ext: each selected
    channel's residue added onto its base channel). Returns float32 [..., K], every value an
    FP16 value times 2^t:
      NVFP4: fp16_rne(s), t = 0. Unit values are multiples of 2^-10 (E2M1 steps of 0.5 times
             E4M3 scales >= 2^-9) and at most about 6 * 448 * (1 + 1/4), so every nonzero
             |s| is an FP16 normal: relative rounding error <= 2^-11, no overflow.
      MXFP4: per row (the last dimension: one token's operand row, which the GEMM's FP32
             epilogue can rescale), t = floor(log2(max |s|)) - PRESUM_TOP and
             fp16_rne(s * 2^-t) * 2^t: the row's largest value in [2^11, 2^12), relative
             error <= 2^-11 down to 2^-25 of the row's maximum (FP16 normals), absolute below.
    The one definition of the presum operand: resgen.reference and the quality study's
    fake-quant path both call it."""
    _check_format(fmt)
    s = s.to(torch.float32)
    if fmt == "nvfp4":
        return s.to(torch.float16).to(torch.float32)
    t = _pow2_shift(s.abs().amax(dim=-1, keepdim=True))
    return (s * _pow2(-t)).to(torch.float16).to(torch.float32) * _pow2(t)


def presum_weight(w: torch.Tensor, fmt: str) -> torch.Tensor:
    """The weight operand of the presum fold: the decoded FP4 weight (float [N, K], NVFP4
    without its tensor scale) as FP16 values times one power of two per layer, which must be
    exact (the fold rounds only the activation sum). NVFP4: E2M1 x E4M3 products are FP16
    values (6 significant bits, 2^-10 .. 2688). MXFP4: E2M1 x 2^e scaled by 2^-t (t from the
    layer's max |w| as in presum_fp16's rows) is exact while the layer's block scales span at
    most about 34 binades; a ValueError says when they do not. Returns float32 [N, K] equal to
    w (the check is the point)."""
    _check_format(fmt)
    wf = w.to(torch.float32)
    if fmt == "nvfp4":
        t = torch.zeros((), dtype=torch.int32, device=wf.device)
    else:
        t = _pow2_shift(wf.abs().amax())
    scaled = wf * _pow2(-t)
    w16 = scaled.to(torch.float16).to(torch.float32)
    if not torch.equal(w16, scaled):
        bad = int((w16 != scaled).sum())
        raise ValueError(f"presum: {bad} decoded {fmt} weight values are not exact in FP16 "
                         f"(after the layer's power-of-two shift 2^{int(-t)}): their block "
                         "scales span more than FP16's exponent range")
    return w16 * _pow2(t)
