"""Host side of the Hopper prefill FP4 linear kernels (family linear_sm90_wgmma).

- WgmmaLauncher: binds a compiled variant to torch CUDA tensors and launches it on the current
  stream (no synchronization: graph capturable). The activation operand comes from
  resgen.kernels.sm90_operand.make_xop (torch) or the fused quantizer quant_sm90 (kp_align=256):
  the same xop both families read. Split-K variants reduce through a workspace (FP32) and
  one semaphore per output tile (int32), owned by the launcher and zeroed once: the kernel
  leaves every semaphore at zero, and the workspace needs no clearing (each slot is written
  before it is read). They grow (outside CUDA-graph capture) when a launch needs more.
The CPU tests stand resgen.kernels.linear_sm90_wgmma_sim.SimulatedKernel in for the compiled
kernel: it reads and writes the raw addresses the launcher passes.

Layouts: resgen.kernels.linear_sm90_wgmma_layout; geometry: linear_sm90_wgmma_geom.
"""

from __future__ import annotations

from typing import Any

import torch

from .linear_sm90_wgmma_geom import WgGeometry
from .linear_sm90_wgmma_layout import WgWeight

__all__ = ["WgmmaLauncher", "check_launch"]

_GRID_Y_MAX = 65535


def check_launch(geom: WgGeometry, wt: WgWeight, xop: torch.Tensor, m: int, rows: int,
                 alpha_x: torch.Tensor | None, out: torch.Tensor,
                 xop_dtype: torch.dtype = torch.bfloat16) -> None:
    """Raise ValueError/TypeError unless these tensors fit the compiled variant (xop_dtype:
    bfloat16, or float16 for a presum variant)."""
    if wt.fmt != geom.fmt or wt.packing != geom.packing:
        raise ValueError(f"weight is {wt.fmt}/{wt.packing}, the kernel {geom.fmt}/{geom.packing}")
    n = wt.out_features
    if n % geom.bm:
        raise ValueError(f"N={n} is not a multiple of the CTA's {geom.bm} channels")
    if wt.kp % 128:
        raise ValueError(f"Kp={wt.kp} is not a multiple of 128 (chunk pairs)")
    if not geom.split_ok(wt.nk):
        raise ValueError(f"{wt.nk} K chunks do not divide into {geom.split_k} slices of whole "
                         "chunk pairs")
    if xop.dtype != xop_dtype or xop.dim() != 2 or xop.shape[1] != wt.kp:
        raise TypeError(f"xop must be {xop_dtype} [rows, {wt.kp}], got {xop.dtype} "
                        f"{tuple(xop.shape)}")
    if not xop.is_contiguous() or not out.is_contiguous():
        raise ValueError("xop and out must be contiguous")
    if not 1 <= rows <= xop.shape[0]:
        raise ValueError(f"rows={rows} outside [1, {xop.shape[0]}] (xop rows)")
    if geom.mext and rows != 2 * m:
        raise ValueError(f"M-Ext reads 2 m = {2 * m} xop rows, got rows={rows}")
    if not geom.mext and rows != m:
        raise ValueError(f"rows={rows} must equal m={m} without M-Ext")
    if out.dtype != torch.bfloat16 or out.dim() != 2 or out.shape[1] != n or out.shape[0] < m:
        raise TypeError(f"out must be bf16 [>= {m}, {n}], got {out.dtype} {tuple(out.shape)}")
    if geom.nv and (alpha_x is None or alpha_x.dtype != torch.float32 or alpha_x.numel() != 1):
        raise ValueError("NVFP4 needs alpha_x: a float32 tensor of one element")
    gx, gy = geom.grid(rows, n)
    if gy > _GRID_Y_MAX and not getattr(geom, "streamk", 0):
        raise ValueError(f"grid y {gy} exceeds {_GRID_Y_MAX}: use raster 'tok' or fewer rows")
    devs = {wt.records.device, xop.device, out.device}
    if alpha_x is not None:
        devs.add(alpha_x.device)
    if len(devs) != 1:
        raise ValueError(f"tensors on several devices: {sorted(map(str, devs))}")


class WgmmaLauncher:
    """A compiled linear_sm90_wgmma variant launched on torch CUDA tensors (current stream).

    The compiled entry takes (records, xop, out, alpha_x, alpha_w, workspace, semaphores, m,
    rows, N, nk[, ctas], stream) as raw device pointers and ints (ctas: stream-K variants'
    persistent CTAs, StreamKGeometry.ctas on this GPU's SMs). xop_dtype: the operand's type,
    bfloat16 (exact unit values or W4A16's activations) or float16 (a presum variant: the
    layer quantizer's fp16(X_hat + R_hat) rows, resgen.kernels.linear_sm90_wgmma_presum)."""

    def __init__(self, compiled: Any, geom: WgGeometry, device: torch.device | str,
                 xop_dtype: torch.dtype = torch.bfloat16, sms: int | None = None):
        if xop_dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"xop_dtype must be bfloat16 or float16, got {xop_dtype}")
        self.compiled = compiled
        self.geom = geom
        self.xop_dtype = xop_dtype
        # stream-K (StreamKGeometry): the GPU's SMs size the persistent grid (sms overrides,
        # e.g. for a simulation on the CPU; a CPU device without it assumes the H200's 132)
        self.streamk = int(getattr(geom, "streamk", 0))
        if sms is None:
            dev = torch.device(device)
            sms = (torch.cuda.get_device_properties(dev).multi_processor_count
                   if dev.type == "cuda" else 132)
        self.sms = int(sms)
        self.one = torch.ones(1, dtype=torch.float32, device=device)
        self.ws = torch.zeros(4, dtype=torch.float32, device=device)
        self.sem = torch.zeros(1, dtype=torch.int32, device=device)
        self._ptrs: dict[tuple[int, str, int], Any] = {}

    def reserve(self, rows: int, n: int) -> None:
        """Grow the split-K workspace / semaphores to what a launch over rows x N needs (done
        by every launch; call it ahead of CUDA graph capture, as resgen.ops plans do)."""
        self._reserve(rows, n)

    def _reserve(self, rows: int, n: int) -> None:
        """Grow the split-K workspace / semaphores to what a launch over rows x N needs."""
        if self.streamk:
            # the workspace of the largest persistent grid: independent of K
            ctas = self.streamk * self.sms
            wsf, sems = self.geom.ws_floats(rows, n, ctas), self.geom.sem_count(rows, n, ctas)
        else:
            wsf, sems = self.geom.ws_floats(rows, n), self.geom.sem_count(rows, n)
        if wsf <= self.ws.numel() and sems <= self.sem.numel():
            return
        if self.ws.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("the split-K workspace must grow before CUDA-graph capture: "
                               "launch this shape once eagerly first")
        if wsf > self.ws.numel():
            self.ws = torch.zeros(wsf, dtype=torch.float32, device=self.ws.device)
        if sems > self.sem.numel():
            self.sem = torch.zeros(sems, dtype=torch.int32, device=self.sem.device)

    def _ptr(self, t: torch.Tensor, align: int) -> Any:
        key = (t.data_ptr(), str(t.dtype), align)
        p = self._ptrs.get(key)
        if p is None:
            import cutlass
            import cutlass.cute as cute
            from cutlass.cute.runtime import make_ptr

            dt = {torch.int32: cutlass.Int32, torch.bfloat16: cutlass.BFloat16,
                  torch.float16: cutlass.Float16, torch.float32: cutlass.Float32}[t.dtype]
            if t.data_ptr() % align:
                raise ValueError(f"a {t.dtype} buffer is not {align}-byte aligned")
            p = make_ptr(dt, t.data_ptr(), cute.AddressSpace.gmem, assumed_align=align)
            self._ptrs[key] = p
        return p

    def __call__(self, wt: WgWeight, xop: torch.Tensor, m: int, rows: int,
                 alpha_x: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
        """out: bf16 [>= m, N], rows 0..m-1 written; xop: bf16 (presum: fp16) [>= rows, Kp]
        contiguous."""
        check_launch(self.geom, wt, xop, m, rows, alpha_x, out, self.xop_dtype)
        self._reserve(rows, wt.out_features)
        ax = alpha_x if alpha_x is not None else self.one
        import cuda.bindings.driver as cuda

        # CPU tensors only reach here in tests that stand a simulation in for the kernel
        stream = cuda.CUstream(torch.cuda.current_stream(xop.device).cuda_stream
                               if xop.is_cuda else 0)
        ctas = ([self.geom.ctas(rows, wt.out_features, wt.nk, self.sms)] if self.streamk
                else [])
        self.compiled(self._ptr(wt.records, 16), self._ptr(xop, 16), self._ptr(out, 16),
                      self._ptr(ax, 4), self._ptr(wt.alpha, 4), self._ptr(self.ws, 16),
                      self._ptr(self.sem, 4), int(m), int(rows),
                      int(wt.out_features), int(wt.nk), *ctas, stream)
        return out
