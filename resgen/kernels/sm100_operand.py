"""The sm_100a activation operand (what quant_sm100 writes, what linear_sm100_tc reads), its
scale-factor packing, and the definition of its values in torch (resgen.formats): the host side
of resgen.kernels.sm100_layout.

- codes: uint8 [rows, Kp / 2], K-major, two E2M1 codes per byte, the even element in the low
  nibble (resgen.formats.pack_fp4's order, which is CUTLASS's Float4E2M1FN order); Kp = K (or
  K + ext) rounded up to 256 with zero codes.
- scale factors: uint8, the tcgen05 block-scaled atom layout (sf_offset) over
  sf_rows(rows, tile) rows x sf_cols(Kp) SF columns; NVFP4 stores E4M3 bytes
  (torch.float8_e4m3fn's bits), MXFP4 E8M0 bytes. Padding scale factors are zero (their codes
  are zero as well).
- rows in the layout "plain" / "row_pair" / "tile8" (act_row), SF tile-padded for the MMA tile
  of activation rows that reads them (sf_row).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .. import formats
from ..calibrate import QLinearWeight
from .sm100_layout import (act_row, act_rows, round_up, sf_cols, sf_offset, sf_row, sf_rows,
                           sf_vec)

__all__ = ["K_ALIGN_SM100", "Sm100Operand", "make_operand", "pack_sf", "unpack_sf",
           "sf_bytes", "unit_values", "layout_for", "operand_reference"]

K_ALIGN_SM100 = 256          # Kp granularity: one 256-wide K tile (4 MMAs of K = 64)


def layout_for(compensation: Any, layout: str | None = None) -> str:
    """The activation row layout of a compensation mode ("full" -> row_pair unless tile8)."""
    if compensation == "full":
        return layout or "row_pair"
    if layout not in (None, "plain"):
        raise ValueError(f"layout {layout!r} is for M-Ext (compensation 'full') only")
    return "plain"


def sf_bytes(scales: torch.Tensor, fmt: str) -> torch.Tensor:
    """uint8 bytes of a QuantizedTensor's scales (E4M3 bits / E8M0 values)."""
    if fmt == "nvfp4":
        return scales.contiguous().view(torch.uint8)
    return scales.to(torch.uint8)


def pack_sf(sf: torch.Tensor, tile: int, total_rows: int | None = None) -> torch.Tensor:
    """Scale bytes sf: uint8 [R, C] (row r, SF column b) -> the flat tcgen05 atom layout for an
    MMA tile of `tile` rows (sf_row), zero-filled: uint8 [sf_rows(total_rows or R, tile) *
    sf_cols]. C is padded to a multiple of 4 SF columns."""
    r, c = sf.shape
    rows = r if total_rows is None else total_rows
    cols = round_up(c, 4)
    out = torch.zeros(sf_rows(rows, tile) * cols, dtype=torch.uint8, device=sf.device)
    ri = torch.arange(r, device=sf.device).reshape(-1, 1)
    bi = torch.arange(c, device=sf.device).reshape(1, -1)
    off = sf_offset(sf_row(ri, tile), bi, cols)
    out[off.reshape(-1)] = sf.reshape(-1)
    return out


def unpack_sf(flat: torch.Tensor, rows: int, cols: int, tile: int) -> torch.Tensor:
    """The inverse of pack_sf: uint8 [rows, cols] (cols a multiple of 4)."""
    ri = torch.arange(rows, device=flat.device).reshape(-1, 1)
    bi = torch.arange(cols, device=flat.device).reshape(1, -1)
    return flat[sf_offset(sf_row(ri, tile), bi, cols).reshape(-1)].reshape(rows, cols)


def unit_values(codes: torch.Tensor, sf: torch.Tensor, fmt: str) -> torch.Tensor:
    """float32 [rows, Kp]: code value x its block scale (no tensor scale), from packed codes
    uint8 [rows, Kp / 2] and scale bytes uint8 [rows, >= Kp / V]."""
    v = sf_vec(fmt)
    vals = formats.e2m1_decode(formats.unpack_fp4(codes))
    kp = vals.shape[-1]
    sfb = sf[:, : kp // v]
    if fmt == "nvfp4":
        s = sfb.contiguous().view(torch.float8_e4m3fn).to(torch.float32)
    else:
        s = torch.ldexp(torch.ones_like(sfb, dtype=torch.float32), sfb.to(torch.int32) - 127)
    return (vals.reshape(*vals.shape[:-1], kp // v, v) * s.unsqueeze(-1)).reshape(vals.shape)


@dataclass(frozen=True)
class Sm100Operand:
    """Quantized activation rows in the tcgen05 operand layout."""

    fmt: str
    m: int                     # tokens
    rows: int                  # operand rows (act_rows(m, layout))
    layout: str
    sf_tile: int               # the MMA tile (activation rows) the SF is tile-padded for
    codes: torch.Tensor        # uint8 [rows, Kp / 2]
    sf: torch.Tensor           # uint8 flat, sf_rows(rows, sf_tile) * sf_cols(Kp)
    alpha: torch.Tensor | None  # float32 [1] (NVFP4) or None

    @property
    def kp(self) -> int:
        return self.codes.shape[1] * 2


def make_operand(x: torch.Tensor, qweight: QLinearWeight, compensation: Any = "none",
                 layout: str | None = None, sf_tile: int = 128) -> Sm100Operand:
    """Quantize activations x: [M, K] float into the tcgen05 activation operand, in torch, with
    the weight's static input scale (when set) and K-Ext selection: the same quantization as
    resgen.reference.linear (formats.quantize_with_residue).

    compensation: "none" (rows = tokens), "full" (M-Ext, rows in `layout`: row_pair or tile8)
    or a K-Ext ratio (columns: K base, then the residue extension of the weight's selection).
    """
    if x.dim() != 2:
        raise ValueError(f"x must be [M, K], got shape {tuple(x.shape)}")
    if x.shape[1] != qweight.in_features:
        raise ValueError(f"x has K={x.shape[1]}, the weight expects {qweight.in_features}")
    selection = None
    if compensation not in ("none", "full"):
        sel = qweight.selection
        if sel is None or float(compensation) != sel.ratio:
            raise ValueError(f"compensation {compensation!r} needs a weight prepared with that "
                             "K-Ext ratio")
        selection = sel
    return operand_reference(x, qweight.fmt, compensation, layout, sf_tile,
                             qweight.input_scale, selection)


def operand_reference(x: torch.Tensor, fmt: str, compensation: Any = "none",
                      layout: str | None = None, sf_tile: int = 128, global_scale=None,
                      selection: Any = None, slots: int | None = None) -> Sm100Operand:
    """Every byte of the sm_100a activation operand, from resgen.formats (the definition the
    quant_sm100 kernel is checked against). x: [m, K]; global_scale: NVFP4 static alpha or
    None (dynamic, from x); selection: the K-Ext channels (calibrate.Selection) or None;
    slots: token slots written (>= m; default: those the layout needs), the ones past m
    quantized as zero tokens (all-zero bytes)."""
    lay = layout_for(compensation, layout)
    m, k = x.shape
    base, res = formats.quantize_with_residue(x, fmt, channels=selection,
                                              global_scale=global_scale)
    kw = k if selection is None else k + res.shape[-1]
    kp = round_up(kw, K_ALIGN_SM100)
    rows = act_rows(m, lay)
    if slots is not None:
        rows = max(rows, act_rows(slots, lay))
    dev = x.device
    codes = torch.zeros(rows, kp // 2, dtype=torch.uint8, device=dev)
    sfb = torch.zeros(rows, sf_cols(kp, fmt), dtype=torch.uint8, device=dev)
    bsf, rsf = sf_bytes(base.scales, fmt), sf_bytes(res.scales, fmt)
    tok = torch.arange(m, device=dev)
    if lay == "plain":
        codes[:m, : k // 2] = base.codes
        sfb[:m, : bsf.shape[1]] = bsf
        if selection is not None:
            codes[:m, k // 2: kw // 2] = res.codes
            sfb[:m, bsf.shape[1]: bsf.shape[1] + rsf.shape[1]] = rsf
    else:
        rb, rr = act_row(tok, False, lay), act_row(tok, True, lay)
        codes[rb, : k // 2] = base.codes
        codes[rr, : k // 2] = res.codes
        sfb[rb, : bsf.shape[1]] = bsf
        sfb[rr, : rsf.shape[1]] = rsf
    sf = pack_sf(sfb, sf_tile, rows)
    alpha = None if fmt == "mxfp4" else base.global_scale.to(torch.float32).reshape(1)
    return Sm100Operand(fmt, m, rows, lay, sf_tile, codes, sf, alpha)
