"""Fast fake-quantized (quantize-dequantize) FP4 linear layers for whole-model evaluation.

resgen.reference.linear is the oracle: it keeps codes and scales and reduces in float64. A
whole-model perplexity run on the CPU needs something cheaper with the same numerics, so this
module computes every quantized value directly in FP32, in the same operation order as
resgen.formats (so x_hat is BIT-identical to dequantize(quantize(x))), and multiplies the
dequantized operands with F.linear in FP32. tests/test_quality_fakequant.py proves both facts:
qdq == formats round trip bit for bit, and FakeQuantLinear == reference.linear to FP32 rounding.

Method semantics (paper Eq. 5-6):
    "none"  plain W4A4            y = X_hat W_hat^T
    "full"  full residue (M-Ext)  y = X_hat W_hat^T + R_hat W_hat^T  (two products, FP32 add)
    ratio   K-Ext                 y = X_hat W_hat^T + R_hat_S W_hat_S^T, where W_S is the
                                  selected weight columns quantized in the extended layout
    "w4a16" FP4 weights only      y = bf16(X) W_hat^T (resgen.reference.linear_w4a16)
    "w4a8"  FP8 activations       y = fp8_rowwise(X) W_hat^T: E4M3 with one scale per token
                                  (resgen.reference.linear_w4a8)
fold="presum" (resgen.reference.linear's fold): y = fp16(X_hat + R_hat) W_hat^T, one product,
    the sum rounded by resgen.formats.presum_fp16 (K-Ext: the selected residues added onto
    their base channels; the extension weight unused).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import formats
from ..calibrate import QLinearWeight

__all__ = ["qdq", "qdq_with_residue", "FakeQuantLinear", "COMPENSATIONS_EXTRA"]

# Compensation values of the study beyond resgen.reference.Compensation (no activation FP4).
COMPENSATIONS_EXTRA: tuple[str, ...] = ("w4a16", "w4a8")

_BLOCK = {"nvfp4": 16, "mxfp4": 32}


def _effective_scale(blocks: torch.Tensor, fmt: str, alpha: torch.Tensor | None) -> torch.Tensor:
    """blocks: float32 [..., nb, bs] -> effective scale d float32 [..., nb, 1] (formats' order)."""
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    if fmt == "nvfp4":
        sf = formats.e4m3_round((amax / formats.E2M1_MAX) / alpha).to(torch.float32)
        return alpha * sf
    exp = torch.frexp(amax).exponent.to(torch.int32) - 1
    e = torch.where(amax > 0, exp - 2, torch.full_like(exp, -127)).clamp(-127, 127)
    return torch.ldexp(torch.ones_like(amax), e)


def qdq(x: torch.Tensor, fmt: str, alpha: torch.Tensor | None = None) -> torch.Tensor:
    """x: float32 [..., K] -> dequantize(quantize(x, fmt, alpha)) as float32 [..., K].

    alpha: NVFP4 tensor scale (float32 0-dim, or broadcastable to [..., K // 16, 1]); None
    computes the dynamic one. Ignored (must be None) for MXFP4.
    """
    bs = _BLOCK[fmt]
    if fmt == "nvfp4" and alpha is None:
        alpha = formats.nvfp4_global_scale(x)
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // bs, bs)
    d = _effective_scale(blocks, fmt, alpha)
    # A zero effective scale divides by +inf: finite / inf = +-0, exact zeros (as formats does).
    v = blocks / torch.where(d > 0, d, torch.full_like(d, float("inf")))
    return (d * formats.e2m1_round(v)).reshape(x.shape)


def qdq_with_residue(x: torch.Tensor, fmt: str, alpha: torch.Tensor | None = None,
                     idx: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x: float32 [..., K] -> (x_hat [..., K], r_hat [..., K or ext]) as float32.

    r_hat is the quantized residue R = x - x_hat (NVFP4: sharing x's tensor scale, paper B.2).
    idx: K-Ext channel indices; r_hat then holds R[..., idx] zero-padded to the block size and
    quantized in that extension layout.
    """
    if fmt == "nvfp4" and alpha is None:
        alpha = formats.nvfp4_global_scale(x)
    x_hat = qdq(x, fmt, alpha)
    res = x - x_hat
    if idx is not None:
        res = res.index_select(-1, idx)
        pad = formats.extension_length(idx.numel(), fmt) - idx.numel()
        if pad:
            res = F.pad(res, (0, pad))
    return x_hat, qdq(res, fmt, alpha)


class FakeQuantLinear(torch.nn.Module):
    """Drop-in replacement of nn.Linear (no bias) running an FP4 method in fake-quant FP32.

    qweight: the prepared weight (resgen.calibrate.prepare_weight, or a weight-side method's
        result wrapped in QLinearWeight): its codes/scales are dequantized ONCE here.
    compensation: "none", "full", the ratio of qweight.selection, or "w4a16" (activations
        rounded to BF16, not quantized).
    bias: float [N] or None, added in FP32 (exact in every method).
    fold: "exact" | "presum" (see the module docstring; W4A16 has no fold).
    x: [..., K] float -> y: [..., N] in x's dtype.
    """

    def __init__(self, qweight: QLinearWeight, compensation="none",
                 bias: torch.Tensor | None = None, fold: str = "exact"):
        super().__init__()
        from ..reference import FOLDS, check_compensation

        if compensation not in COMPENSATIONS_EXTRA:
            check_compensation(compensation, qweight)
        if fold not in FOLDS:
            raise ValueError(f"fold must be one of {FOLDS}, got {fold!r}")
        if fold == "presum" and compensation in COMPENSATIONS_EXTRA:
            raise ValueError(f"{compensation} has no residue to pre-sum")
        self.fold = fold
        if fold == "presum":            # the weight must be exact in FP16 (raises otherwise)
            formats.presum_weight(formats.dequantize(qweight.q, apply_global_scale=False)
                                  [:, : qweight.in_features], qweight.fmt)
        self.fmt = qweight.fmt
        self.compensation = compensation
        k = qweight.in_features
        w = formats.dequantize(qweight.q)
        self.register_buffer("w_base", w[:, :k].contiguous(), persistent=False)
        self.register_buffer("w_ext", w[:, k:].contiguous() if w.shape[1] > k else None,
                             persistent=False)
        idx = None
        if compensation not in ("none", "full", *COMPENSATIONS_EXTRA):
            idx = qweight.selection.indices
        self.register_buffer("idx", idx, persistent=False)
        if bias is not None:
            bias = bias.detach().to(torch.float32).reshape(w.shape[0])
        self.register_buffer("bias", bias, persistent=False)
        self.input_scale = qweight.input_scale
        self.in_features = k
        self.out_features = w.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        xf = x.reshape(-1, self.in_features).to(torch.float32)
        if self.compensation == "w4a16":
            y = F.linear(xf.to(torch.bfloat16).to(torch.float32), self.w_base, self.bias)
            return y.reshape(*lead, -1).to(x.dtype)
        if self.compensation == "w4a8":
            x8, s = formats.fp8_rowwise_quant(xf)
            y = F.linear(x8.to(torch.float32) * s, self.w_base, self.bias)
            return y.reshape(*lead, -1).to(x.dtype)
        alpha = None
        if self.fmt == "nvfp4":
            alpha = (self.input_scale if self.input_scale is not None
                     else formats.nvfp4_global_scale(xf))
        if self.compensation == "none":
            y = F.linear(qdq(xf, self.fmt, alpha), self.w_base)
        elif self.fold == "presum":
            x_hat, r_hat = qdq_with_residue(xf, self.fmt, alpha, self.idx)
            y = F.linear(self._presum(x_hat, r_hat, alpha), self.w_base)
        elif self.compensation == "full":
            x_hat, r_hat = qdq_with_residue(xf, self.fmt, alpha)
            y = F.linear(x_hat, self.w_base) + F.linear(r_hat, self.w_base)
        else:
            x_hat, r_hat = qdq_with_residue(xf, self.fmt, alpha, self.idx)
            y = F.linear(x_hat, self.w_base) + F.linear(r_hat, self.w_ext)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, -1).to(x.dtype)

    def _presum(self, x_hat: torch.Tensor, r_hat: torch.Tensor,
                alpha: torch.Tensor | None) -> torch.Tensor:
        """fp16(X_hat + R_hat) as float32 [M, K] (formats.presum_fp16 on the unit values:
        NVFP4 divided by alpha, multiplied back after the rounding)."""
        if self.idx is not None:             # K-Ext: the residues back onto their channels
            r_hat = formats.residue_on_channels(r_hat, self.idx, x_hat.shape[-1])
        if self.fmt == "nvfp4":
            a = torch.as_tensor(alpha, dtype=torch.float32, device=x_hat.device).reshape(())
            return formats.presum_fp16(x_hat / a + r_hat / a, "nvfp4") * a
        return formats.presum_fp16(x_hat + r_hat, "mxfp4")

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"fmt={self.fmt}, compensation={self.compensation}, "
                f"bias={self.bias is not None}" + (", fold=presum" if self.fold == "presum"
                                                   else ""))
