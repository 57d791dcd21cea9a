"""Host side of the Blackwell FP4 linear kernels (family linear_sm100_tc): the operand layouts
tcgen05 block-scaled MMA reads, the activation operand in torch, and the launcher.

Layouts (index math in resgen.kernels.linear_sm100_geom):
- codes: uint8 [rows, Kp / 2], K-major, two E2M1 codes per byte, the even element in the low
  nibble (resgen.formats.pack_fp4's order, which is CUTLASS's Float4E2M1FN order); Kp = K (or
  K + ext) rounded up to 256 with zero codes.
- scale factors: uint8, the tcgen05 block-scaled atom layout (sf_offset) over
  sf_rows(rows, tile) rows x sf_cols(Kp) SF columns; NVFP4 stores E4M3 bytes
  (torch.float8_e4m3fn's bits), MXFP4 E8M0 bytes. Padding scale factors are zero (their codes
  are zero as well).
- weights (Sm100Weight): N rows rounded up to 128 (zero rows), SF rows untiled; alpha_w the
  NVFP4 tensor scale (1.0 for MXFP4, unused).
- activation operand (Sm100Operand, what quant_sm100 writes on the GPU): `rows` rows in the
  layout "plain" / "row_pair" / "tile8" (act_row), SF tile-padded for the MMA tile that reads
  them (sf_row with the tile's activation rows: linear_sm100_geom.Sm100Geometry.act_sf_tile).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .. import formats
from ..calibrate import QLinearWeight
from .linear_sm100_geom import (act_row, act_rows, round_up, sf_cols, sf_offset, sf_row,
                                sf_rows, sf_vec)

__all__ = ["K_ALIGN_SM100", "Sm100Weight", "Sm100Operand", "prepare_sm100_weight",
           "make_operand", "pack_sf", "unpack_sf", "unit_values", "layout_for",
           "LinearSm100Launcher"]

K_ALIGN_SM100 = 256          # Kp granularity: one 256-wide K tile (4 MMAs of K = 64)
_W_ROW_ALIGN = 128           # weight rows: whole 128-row SF atoms


def layout_for(compensation: Any, layout: str | None = None) -> str:
    """The activation row layout of a compensation mode ("full" -> row_pair unless tile8)."""
    if compensation == "full":
        return layout or "row_pair"
    if layout not in (None, "plain"):
        raise ValueError(f"layout {layout!r} is for M-Ext (compensation 'full') only")
    return "plain"


def _sf_bytes(scales: torch.Tensor, fmt: str) -> torch.Tensor:
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
class Sm100Weight:
    """A linear weight in the tcgen05 operand layout (see the module docstring)."""

    fmt: str
    out_features: int          # N
    kp: int                    # padded reduction length (K or K + ext)
    codes: torch.Tensor        # uint8 [round_up(N, 128), Kp / 2]
    sf: torch.Tensor           # uint8 [round_up(N, 128) * sf_cols(Kp)] atom layout
    alpha: torch.Tensor        # float32 [1]

    @property
    def rows(self) -> int:
        return self.codes.shape[0]

    def nbytes(self) -> int:
        return self.codes.numel() + self.sf.numel() + 4


def prepare_sm100_weight(qweight: QLinearWeight) -> Sm100Weight:
    """The offline weight layout of linear_sm100_tc (the same for every variant: A and B tiles
    of 128 / 256 rows read whole SF atoms, TMA zero-fills rows past N)."""
    q = qweight.q
    fmt = q.fmt
    n, kw = q.shape[0], q.shape[1]
    kp = round_up(kw, K_ALIGN_SM100)
    rows = round_up(n, _W_ROW_ALIGN)
    codes = torch.zeros(rows, kp // 2, dtype=torch.uint8, device=q.codes.device)
    codes[:n, : kw // 2] = q.codes
    sfb = torch.zeros(n, sf_cols(kp, fmt), dtype=torch.uint8, device=q.codes.device)
    s = _sf_bytes(q.scales, fmt)
    sfb[:, : s.shape[1]] = s
    sf = pack_sf(sfb, _W_ROW_ALIGN, rows)
    alpha = (torch.ones(1, dtype=torch.float32, device=q.codes.device) if fmt == "mxfp4"
             else q.global_scale.to(torch.float32).reshape(1).clone())
    return Sm100Weight(fmt, n, kp, codes, sf, alpha)


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
    """Quantize activations x: [M, K] float into the tcgen05 activation operand, in torch (the
    same quantization as resgen.reference.linear: formats.quantize_with_residue with the
    weight's static input scale when set).

    compensation: "none" (rows = tokens), "full" (M-Ext, rows in `layout`: row_pair or tile8)
    or a K-Ext ratio (columns: K base, then the residue extension of the weight's selection).
    """
    if x.dim() != 2:
        raise ValueError(f"x must be [M, K], got shape {tuple(x.shape)}")
    fmt = qweight.fmt
    k = qweight.in_features
    if x.shape[1] != k:
        raise ValueError(f"x has K={x.shape[1]}, the weight expects {k}")
    lay = layout_for(compensation, layout)
    channels = None
    if compensation not in ("none", "full"):
        sel = qweight.selection
        if sel is None or float(compensation) != sel.ratio:
            raise ValueError(f"compensation {compensation!r} needs a weight prepared with that "
                             "K-Ext ratio")
        channels = sel
    base, res = formats.quantize_with_residue(x, fmt, channels=channels,
                                              global_scale=qweight.input_scale)
    m = x.shape[0]
    kw = k if channels is None else k + res.shape[-1]
    kp = round_up(kw, K_ALIGN_SM100)
    rows = act_rows(m, lay)
    dev = x.device
    codes = torch.zeros(rows, kp // 2, dtype=torch.uint8, device=dev)
    sfb = torch.zeros(rows, sf_cols(kp, fmt), dtype=torch.uint8, device=dev)
    bsf, rsf = _sf_bytes(base.scales, fmt), _sf_bytes(res.scales, fmt)
    tok = torch.arange(m, device=dev)
    if lay == "plain":
        codes[:m, : k // 2] = base.codes
        sfb[:m, : bsf.shape[1]] = bsf
        if channels is not None:
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


class LinearSm100Launcher:
    """A compiled linear_sm100_tc variant launched on torch CUDA tensors (current stream).

    The compiled entry takes (A codes, B codes, SFA, SFB, out, alpha_x, alpha_w, workspace,
    semaphores, m, rows, stream) as raw device pointers; which of weight and activation is A
    is the variant's operand swap (a host-side choice). The split-K workspace (FP32) and
    semaphores (int32) are owned here, zeroed once: the kernels leave them at zero."""

    def __init__(self, compiled: Any, geom: Any, max_rows: int, device: torch.device | str):
        self.compiled = compiled
        self.geom = geom
        self.max_rows = max_rows
        g = geom
        m_max = max(1, max_rows // g.rpt + 16)
        ws = 4
        if g.reduce == "workspace":
            ws = g.split_k * m_max * g.n
        elif g.reduce == "atomic":
            ws = m_max * g.n
        gx, gy, _ = g.grid(max_rows)
        self.ws = torch.zeros(max(ws, 4), dtype=torch.float32, device=device)
        self.sem = torch.zeros(max(gx * gy, 1), dtype=torch.int32, device=device)
        self.one = torch.ones(1, dtype=torch.float32, device=device)
        self._ptrs: dict[tuple[int, str, int], Any] = {}

    def _ptr(self, t: torch.Tensor, kind: str, align: int) -> Any:
        key = (t.data_ptr(), kind, align)
        p = self._ptrs.get(key)
        if p is None:
            import cutlass
            import cutlass.cute as cute
            from cutlass.cute.runtime import make_ptr

            dt = {"fp4": cutlass.Float4E2M1FN, "e4m3": cutlass.Float8E4M3FN,
                  "e8m0": cutlass.Float8E8M0FNU, "bf16": cutlass.BFloat16,
                  "f32": cutlass.Float32, "i32": cutlass.Int32}[kind]
            if t.data_ptr() % align:
                raise ValueError(f"a {kind} buffer is not {align}-byte aligned")
            p = make_ptr(dt, t.data_ptr(), cute.AddressSpace.gmem, assumed_align=align)
            self._ptrs[key] = p
        return p

    def __call__(self, wt: Sm100Weight, op: Sm100Operand, out: torch.Tensor) -> torch.Tensor:
        """out: bf16 [>= m, N], rows 0..m-1 written."""
        import cuda.bindings.driver as cuda

        g = self.geom
        if wt.kp != g.kp or wt.out_features != g.n or wt.fmt != g.fmt:
            raise ValueError("weight does not match the compiled variant (format, N, Kp)")
        if op.kp != g.kp or op.fmt != g.fmt or op.layout != g.layout:
            raise ValueError(f"operand ({op.fmt}, {op.layout}, Kp {op.kp}) does not match the "
                             f"variant ({g.fmt}, {g.layout}, Kp {g.kp})")
        if op.sf_tile != g.act_sf_tile:
            raise ValueError(f"operand scale factors are tile-padded for {op.sf_tile} rows, "
                             f"the variant reads tiles of {g.act_sf_tile}")
        if op.rows > self.max_rows:
            raise ValueError(f"{op.rows} operand rows; the workspace was sized for "
                             f"{self.max_rows}")
        if out.shape[-1] != g.n or out.dtype != torch.bfloat16 or out.shape[0] < op.m \
                or not out.is_contiguous():
            raise ValueError(f"out must be contiguous bf16 [>= {op.m}, {g.n}]")
        sfk = "e4m3" if g.fmt == "nvfp4" else "e8m0"
        wc, ws_ = self._ptr(wt.codes, "fp4", 32), self._ptr(wt.sf, sfk, 32)
        ac, as_ = self._ptr(op.codes, "fp4", 32), self._ptr(op.sf, sfk, 32)
        a, b, sfa, sfb = (wc, ac, ws_, as_) if g.swap else (ac, wc, as_, ws_)
        ax = op.alpha if op.alpha is not None else self.one
        stream = cuda.CUstream(torch.cuda.current_stream(out.device).cuda_stream
                               if out.is_cuda else 0)
        self.compiled(a, b, sfa, sfb, self._ptr(out, "bf16", 16), self._ptr(ax, "f32", 4),
                      self._ptr(wt.alpha, "f32", 4), self._ptr(self.ws, "f32", 16),
                      self._ptr(self.sem, "i32", 4), int(op.m), int(op.rows), stream)
        return out
