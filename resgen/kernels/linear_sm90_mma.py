"""Host side of the Hopper decode FP4 linear kernels (family linear_sm90_mma).

LinearSm90Launcher binds a compiled variant to torch CUDA tensors (workspace and semaphores for
cross-CTA split-K) and launches it on the current stream. An "xop" variant takes the prepared
operand (resgen.kernels.sm90_operand.make_xop in torch, quant_sm90 on the GPU); a "fused"
variant takes the BF16 activations x [m, K] themselves (plus the static NVFP4 alpha and, for
K-Ext, the selection masks) and quantizes them in its prologue.

Layouts are documented in resgen.kernels.sm90_fp4_layout.
"""

from __future__ import annotations

from typing import Any

import torch

from .sm90_fp4_layout import Sm90Weight

__all__ = ["LinearSm90Launcher"]


class LinearSm90Launcher:
    """A compiled linear_sm90_mma variant launched on torch CUDA tensors (current stream).

    The compiled entry takes (words, scales, xop or x, out, alpha_x, alpha_w, workspace,
    semaphores, masks, m, rows, stream) as raw device pointers; the workspace (FP32) and
    semaphores (int32) are owned here, zeroed once: the kernels leave them at zero after every
    call.
    """

    def __init__(self, compiled: Any, geom: Any, ws_floats: int, sem_count: int,
                 device: torch.device | str):
        self.compiled = compiled
        self.geom = geom
        self.ws = torch.zeros(max(ws_floats, 4), dtype=torch.float32, device=device)
        self.sem = torch.zeros(max(sem_count, 1), dtype=torch.int32, device=device)
        self.one = torch.ones(1, dtype=torch.float32, device=device)
        self.nomask = torch.zeros(4, dtype=torch.uint8, device=device)
        self._ptrs: dict[tuple[int, str, int], Any] = {}

    def _ptr(self, t: torch.Tensor, align: int) -> Any:
        key = (t.data_ptr(), str(t.dtype), align)
        p = self._ptrs.get(key)
        if p is None:
            import cutlass
            import cutlass.cute as cute
            from cutlass.cute.runtime import make_ptr

            dt = {torch.int32: cutlass.Int32, torch.uint8: cutlass.Uint8,
                  torch.bfloat16: cutlass.BFloat16, torch.float32: cutlass.Float32}[t.dtype]
            if t.data_ptr() % align:
                raise ValueError(f"a {t.dtype} buffer is not {align}-byte aligned")
            p = make_ptr(dt, t.data_ptr(), cute.AddressSpace.gmem, assumed_align=align)
            self._ptrs[key] = p
        return p

    def __call__(self, wt: Sm90Weight, xop: torch.Tensor, m: int, rows: int,
                 alpha_x: torch.Tensor | None, out: torch.Tensor,
                 masks: torch.Tensor | None = None) -> torch.Tensor:
        """out: bf16 [>= m, N], rows 0..m-1 written.

        xop variants: xop bf16 [>= rows rounded up to the token tile, Kp] contiguous (make_xop
        and quant_sm90 pad to it), alpha_x the operand's NVFP4 scale; presum: float16, rows = m
        (quant_sm90's "presum" rows, sm90_operand.make_presum_xop).
        fused variants: xop is x itself, bf16 [m, K] contiguous; alpha_x the STATIC NVFP4
        activation scale (float32 [1]); masks uint8 [K / 8] for K-Ext."""
        import cuda.bindings.driver as cuda

        g = self.geom
        if wt.kp != g.kp or wt.out_features != g.n or wt.packing != g.packing:
            raise ValueError("weight does not match the compiled variant (N, Kp, packing)")
        # presum (resgen.kernels.linear_sm90_mma_presum): the operand is quant_sm90's "presum"
        # rows, float16, one per token
        presum = getattr(g, "fold", "exact") == "presum"
        if presum and rows != m:
            raise ValueError(f"a presum variant reads one summed row per token: rows must be "
                             f"m = {m}, got {rows}")
        krows = rows
        if g.fused:
            if xop.dtype != torch.bfloat16 or xop.dim() != 2 or xop.shape != (m, g.k):
                raise ValueError(f"a fused variant takes x: bf16 [{m}, {g.k}]")
            if rows != g.rpt * m:
                raise ValueError(f"rows must be {g.rpt} * m for this variant")
            if g.nv and (alpha_x is None or alpha_x.numel() != 1
                         or alpha_x.dtype != torch.float32):
                raise ValueError("a fused NVFP4 variant needs the static alpha_x (float32 [1])")
            if g.ksel:
                if (masks is None or masks.dtype != torch.uint8 or masks.shape != (g.k // 8,)
                        or masks.device != xop.device):
                    raise ValueError(f"fused K-Ext needs masks: uint8 [{g.k // 8}] on "
                                     f"{xop.device}")
            elif masks is not None:
                raise ValueError("masks are only used by fused K-Ext variants")
        else:
            want = torch.float16 if presum else torch.bfloat16
            if xop.dtype != want or xop.dim() != 2 or xop.shape[1] != g.kp:
                raise ValueError(f"xop must be {str(want).removeprefix('torch.')} "
                                 f"[rows, {g.kp}]")
            t_pad = -(-krows // g.tok) * g.tok
            if xop.shape[0] < t_pad:
                raise ValueError(f"xop must hold {t_pad} rows (the rows rounded up to the "
                                 f"token tile of {g.tok}: the kernel reads whole tiles)")
            if masks is not None:
                raise ValueError("masks are only used by fused K-Ext variants")
        if not xop.is_contiguous() or not out.is_contiguous():
            raise ValueError("xop/x and out must be contiguous")
        if out.shape[-1] != g.n or out.dtype != torch.bfloat16 or out.shape[0] < m:
            raise ValueError(f"out must be bf16 [>= {m}, {g.n}]")
        if g.ws_floats(krows, m) > self.ws.numel() or g.sem_count(krows) > self.sem.numel():
            raise ValueError("the workspace was sized for fewer rows")
        ax = alpha_x if alpha_x is not None else self.one
        mk = masks if masks is not None else self.nomask
        # CPU tensors only reach here in tests that stand a simulation in for the kernel
        stream = cuda.CUstream(torch.cuda.current_stream(xop.device).cuda_stream
                               if xop.is_cuda else 0)
        # presum's FP16 rows travel as the same bytes behind the kernel's bf16 operand pointer
        # (the kernel loads words: the element type is only the signature's)
        xbits = xop.view(torch.bfloat16) if presum else xop
        self.compiled(self._ptr(wt.words, 16), self._ptr(wt.scales, 16), self._ptr(xbits, 16),
                      self._ptr(out, 16), self._ptr(ax, 4), self._ptr(wt.alpha, 4),
                      self._ptr(self.ws, 16), self._ptr(self.sem, 4), self._ptr(mk, 4),
                      int(m), int(krows), stream)
        return out
