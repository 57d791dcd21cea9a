"""The Hopper activation operand "xop" in torch: its definition, what resgen.kernels.quant_sm90
writes on the GPU and both Hopper linear families read (layout: resgen.kernels.sm90_fp4_layout,
"Activation operand").

- make_xop(x, qweight, compensation): x [M, K] quantized into the exact-BF16 operand rows;
- make_presum_xop(x, qweight, compensation): NVFP4's pre-summed operand (M-Ext or K-Ext),
  fp16(X_hat + R_hat) per token (quant_sm90's layout "presum", read by both Hopper linear
  families' presum variants);
- operand_values(codes, scales, fmt): code value x block scale, the operand's values;
- xop_layout_for(compensation): the row layout a compensation mode uses.
"""

from __future__ import annotations

import torch

from .. import formats
from ..calibrate import QLinearWeight
from .sm90_fp4_layout import K_ALIGN, Sm90Weight, pad_to

__all__ = ["make_xop", "make_presum_xop", "xop_layout_for", "operand_values"]


def xop_layout_for(compensation) -> str:
    """The xop row layout a compensation mode uses with the swapped kernels."""
    return "row_pair" if compensation == "full" else "plain"


def operand_values(codes: torch.Tensor, scales: torch.Tensor, fmt: str) -> torch.Tensor:
    """float32 [..., K]: code value x block scale (alpha excluded): exact, and exact in BF16.

    codes: uint8 [..., K] unpacked; scales: NVFP4 float8_e4m3fn / MXFP4 uint8 [..., K/block].
    """
    bs = formats.block_size(fmt)
    vals = formats.e2m1_decode(codes)
    vals = vals.reshape(*vals.shape[:-1], vals.shape[-1] // bs, bs)
    if fmt == "nvfp4":
        sv = scales.to(torch.float32)
    else:
        sv = torch.ldexp(torch.ones_like(scales, dtype=torch.float32),
                         scales.to(torch.int32) - 127)
    return (vals * sv.unsqueeze(-1)).reshape(codes.shape)


def make_xop(x: torch.Tensor, qweight: QLinearWeight | Sm90Weight, compensation="none",
             t_multiple: int = 8) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Quantize activations x: [M, K] float into the GEMM operand, in torch.

    compensation: "none" (rows = tokens), "full" (M-Ext, row_pair: row 2j base of token j,
    2j + 1 its residue) or a K-Ext ratio (columns: K base, then the residue extension of the
    weight's selection). NVFP4 uses qweight.input_scale when set (static), else the dynamic
    tensor scale of x, shared by base and residue (formats.quantize_with_residue's rule).
    Returns (xop bf16 [T_pad, Kp], alpha_x float32 [1] or None for MXFP4), with
    T_pad = rows rounded up to t_multiple and Kp = (K or K + ext) rounded up to 256 (zeros).
    """
    if x.dim() != 2:
        raise ValueError(f"x must be [M, K], got shape {tuple(x.shape)}")
    fmt = qweight.fmt
    k = qweight.in_features
    if x.shape[1] != k:
        raise ValueError(f"x has K={x.shape[1]}, the weight expects {k}")
    if compensation not in ("none", "full"):
        sel = qweight.selection
        if sel is None or float(compensation) != sel.ratio:
            raise ValueError(f"compensation {compensation!r} needs a weight prepared with that "
                             f"K-Ext ratio")
        idx = sel.indices.to(x.device)
    else:
        idx = None
    xf = x.to(torch.float32)
    if not bool(torch.isfinite(xf).all()):
        raise ValueError("activations contain NaN or Inf")
    if fmt == "nvfp4":
        isc = qweight.input_scale
        alpha = (formats.nvfp4_global_scale(xf) if isc is None
                 else torch.as_tensor(isc, dtype=torch.float32, device=x.device).reshape(()))
    else:
        alpha = None
    (c, s), (rc, rs) = formats.residue_pair(xf, fmt, alpha, idx)
    base = operand_values(c, s, fmt)
    m = x.shape[0]
    if compensation == "none":
        rows = base
    elif compensation == "full":
        res = operand_values(rc, rs, fmt)
        rows = torch.stack([base, res], dim=1).reshape(2 * m, k)
    else:
        rows = torch.cat([base, operand_values(rc, rs, fmt)], dim=1)
    kp = pad_to(rows.shape[1], K_ALIGN)
    t_pad = pad_to(max(rows.shape[0], 1), t_multiple)
    xop = torch.zeros(t_pad, kp, dtype=torch.bfloat16, device=x.device)
    xop[: rows.shape[0], : rows.shape[1]] = rows.to(torch.bfloat16)
    a = None if alpha is None else alpha.reshape(1).to(torch.float32)
    return xop, a


def make_presum_xop(x: torch.Tensor, qweight: QLinearWeight | Sm90Weight,
                    compensation: str | float = "full", t_multiple: int = 8
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4's pre-summed operand in torch: x [M, K] float -> (xop float16 [T_pad, Kp],
    alpha_x float32 [1]), row j = resgen.formats.presum_fp16(X_hat + R_hat) of token j, zero
    rows and columns past M and K (Kp = K rounded up to 256). What quant_sm90 writes in layout
    "presum". compensation "full" (M-Ext): the unit values of make_xop's row pair, added in
    FP32; a K-Ext ratio: make_xop's extension columns (the selected channels' residues) put
    back on their channels (formats.residue_on_channels) and added onto the base."""
    if qweight.fmt != "nvfp4":
        raise ValueError(f"the presum operand is NVFP4 only (MXFP4 presum needs a per-row "
                         f"shift the quantizer does not emit), got {qweight.fmt}")
    m, k = x.shape
    if compensation == "full":
        pair, alpha = make_xop(x, qweight, "full", t_multiple=1)
        s = pair[0:2 * m:2, :k].float() + pair[1:2 * m:2, :k].float()
    elif compensation == "none":
        raise ValueError("plain W4A4 has no residue to pre-sum: use make_xop")
    else:
        ext, alpha = make_xop(x, qweight, compensation, t_multiple=1)
        sel = qweight.selection
        assert sel is not None                  # make_xop refused a weight without one
        s = ext[:m, :k].float() + formats.residue_on_channels(ext[:m, k:].float(),
                                                              sel.indices, k)
    kp = pad_to(k, K_ALIGN)
    xop = torch.zeros(pad_to(max(m, 1), t_multiple), kp, dtype=torch.float16, device=x.device)
    xop[:m, :k] = formats.presum_fp16(s, "nvfp4").to(torch.float16)
    assert alpha is not None
    return xop, alpha
