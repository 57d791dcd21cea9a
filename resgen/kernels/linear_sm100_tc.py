"""Host side of the Blackwell FP4 linear kernels (family linear_sm100_tc): the weight layout and
the launcher. The activation operand (what quant_sm100 writes) and the scale-factor packing are
the arch's: resgen.kernels.sm100_operand.

Weights (Sm100Weight): codes uint8 [round_up(N, 128), Kp / 2] K-major (zero rows past N, zero
columns past K or K + ext), scale factors in the tcgen05 atom layout over those rows (untiled:
the weight tiles are 128 or 256 rows, whole atoms; TMA zero-fills rows past the tensor), and
alpha_w (the NVFP4 tensor scale; 1.0 for MXFP4, unused). One layout for every variant.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..calibrate import QLinearWeight
from .sm100_layout import round_up, sf_cols
from .sm100_operand import K_ALIGN_SM100, Sm100Operand, pack_sf, sf_bytes

__all__ = ["Sm100Weight", "prepare_sm100_weight", "LinearSm100Launcher"]

_W_ROW_ALIGN = 128           # weight rows: whole 128-row SF atoms


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
    s = sf_bytes(q.scales, fmt)
    sfb[:, : s.shape[1]] = s
    sf = pack_sf(sfb, _W_ROW_ALIGN, rows)
    alpha = (torch.ones(1, dtype=torch.float32, device=q.codes.device) if fmt == "mxfp4"
             else q.global_scale.to(torch.float32).reshape(1).clone())
    return Sm100Weight(fmt, n, kp, codes, sf, alpha)


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
