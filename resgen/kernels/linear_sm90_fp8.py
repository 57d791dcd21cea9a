"""Host side of the Hopper MXFP4-on-FP8 linear kernels (family linear_sm90_fp8).

Fp8Launcher binds a compiled variant to torch CUDA tensors and launches it on the current
stream (no synchronization, nothing allocated per call: graph capturable). Its operands are
resgen.kernels.linear_sm90_fp8_operand.Fp8Operand (or, for wload = "fp4", the weight as an
Fp4Operand: packed E2M1, converted in the kernel): the weight's (prepared offline) and the
activations' (built per call by Fp8ActivationStage, in torch: no device quantizer writes this
operand yet). Geometry: linear_sm90_fp8_geom.
"""

from __future__ import annotations

from typing import Any

import torch

from ..formats import quantize
from .linear_sm90_fp8_geom import KC, Fp8Geometry
from .linear_sm90_fp8_operand import (ROW_MULTIPLE, Fp4Operand, Fp8Operand, fold_operand,
                                      token_operand)

__all__ = ["Fp8Launcher", "Fp8ActivationStage", "check_launch"]

_GRID_Y_MAX = 65535


def check_launch(geom: Fp8Geometry, w: Fp8Operand | Fp4Operand, x: Fp8Operand, m: int,
                 out: torch.Tensor) -> None:
    """Raise ValueError/TypeError unless these tensors fit the compiled variant."""
    n = w.rows
    if isinstance(w, Fp4Operand) != geom.fp4:
        raise TypeError(f"the kernel loads its weight as {geom.wload}, got a "
                        f"{type(w).__name__} (Fp4Operand for fp4, Fp8Operand for e4m3)")
    if w.group != geom.group or x.group != geom.group:
        raise ValueError(f"operands of group {w.group} (weight) / {x.group} (activations), "
                         f"the kernel promotes every {geom.group} k32 blocks")
    if w.kp != x.kp or w.kp % (2 * KC):
        raise ValueError(f"Kp {w.kp} (weight) / {x.kp} (activations): equal, a multiple of "
                         f"{2 * KC}")
    if n % geom.bn or w.rows_pad != n:
        raise ValueError(f"N={n} (padded {w.rows_pad}) is not a multiple of bn={geom.bn}")
    if isinstance(w, Fp4Operand):
        if w.packed.dtype != torch.uint8 or not w.packed.is_contiguous():
            raise TypeError("weight codes must be contiguous uint8 packed E2M1 bytes")
    for name, op in (("weight", w), ("activation", x)):
        codes = op.packed if isinstance(op, Fp4Operand) else op.codes
        if codes.dtype != torch.uint8 or not codes.is_contiguous():
            raise TypeError(f"{name} codes must be contiguous uint8 E4M3 bytes")
        sdt = torch.uint8 if isinstance(op, Fp4Operand) else torch.float32
        if op.scales.dtype != sdt or not op.scales.is_contiguous() or \
                tuple(op.scales.shape) != (op.kp // (32 * op.group), op.rows_pad):
            raise TypeError(f"{name} scales must be contiguous {sdt} "
                            f"[{op.kp // (32 * op.group)}, {op.rows_pad}]")
    if x.rows_pad % 4:
        raise ValueError(f"activation rows padded to {x.rows_pad}: a multiple of 4 (TMA)")
    if not 1 <= m <= x.rows:
        raise ValueError(f"m={m} outside [1, {x.rows}] (the operand's rows)")
    if out.dtype != torch.bfloat16 or out.dim() != 2 or out.shape[1] != n or \
            out.shape[0] < m or not out.is_contiguous():
        raise TypeError(f"out must be contiguous bf16 [>= {m}, {n}], got {out.dtype} "
                        f"{tuple(out.shape)}")
    gx, gy = geom.grid(x.rows_pad, n)
    if gy > _GRID_Y_MAX:
        raise ValueError(f"grid y {gy} exceeds {_GRID_Y_MAX}")
    devs = {w.scales.device, x.codes.device, out.device}
    if len(devs) != 1:
        raise ValueError(f"tensors on several devices: {sorted(map(str, devs))}")


class Fp8ActivationStage:
    """The activations' operand in torch: xb [m, K] (bf16 or float) -> Fp8Operand with
    `group`. compensation "none" (W4A4): MXFP4 (formats.quantize, the reference's quantizer),
    folded (fold_operand; FoldRangeError where a group cannot be folded exactly); "w4a8": E4M3
    values with one scale per token (token_operand: formats.fp8_rowwise_quant). About a dozen
    torch ops (and, for W4A4, one host sync: the fold's range check): correct, not fast, not
    capturable. A device quantizer writing this operand is the missing piece for serving
    (docs/linear_sm90_fp8.md)."""

    def __init__(self, k: int, kp: int, group: int, compensation: str = "none") -> None:
        if compensation not in ("none", "w4a8"):
            raise ValueError(f"compensation {compensation!r}: 'none' (W4A4) or 'w4a8'")
        self.k, self.kp, self.group = int(k), int(kp), int(group)
        self.compensation = compensation

    def __call__(self, xb: torch.Tensor) -> Fp8Operand:
        if xb.dim() != 2 or xb.shape[1] != self.k:
            raise ValueError(f"activations must be [M, {self.k}], got {tuple(xb.shape)}")
        if self.compensation == "w4a8":
            return token_operand(xb, self.group, self.kp, ROW_MULTIPLE)
        return fold_operand(quantize(xb.float(), "mxfp4"), self.group, self.kp, ROW_MULTIPLE)


class Fp8Launcher:
    """A compiled linear_sm90_fp8 variant launched on torch CUDA tensors (current stream).

    The compiled entry takes (xq, sx, wq, sw, out, m, rows, N, Kp, stream): raw device
    pointers and ints."""

    def __init__(self, compiled: Any, geom: Fp8Geometry, device: torch.device | str):
        self.compiled = compiled
        self.geom = geom
        self.device = torch.device(device)
        self._ptrs: dict[tuple[int, str], Any] = {}

    def _ptr(self, t: torch.Tensor, fp8: bool = False) -> Any:
        """A cached CuTe pointer to t: E4M3 where fp8, else by t's dtype (uint8: packed
        E2M1 bytes)."""
        key = (t.data_ptr(), "fp8" if fp8 else str(t.dtype))
        p = self._ptrs.get(key)
        if p is None:
            import cutlass
            import cutlass.cute as cute
            from cutlass.cute.runtime import make_ptr

            dt = cutlass.Float8E4M3FN if fp8 else {torch.bfloat16: cutlass.BFloat16,
                                                   torch.float32: cutlass.Float32,
                                                   torch.uint8: cutlass.Uint8}[t.dtype]
            if t.data_ptr() % 16:
                raise ValueError(f"a {t.dtype} buffer is not 16-byte aligned")
            p = make_ptr(dt, t.data_ptr(), cute.AddressSpace.gmem, assumed_align=16)
            self._ptrs[key] = p
        return p

    def __call__(self, w: Fp8Operand | Fp4Operand, x: Fp8Operand, m: int, out: torch.Tensor
                 ) -> torch.Tensor:
        """out: bf16 [>= m, N], rows 0..m-1 written."""
        check_launch(self.geom, w, x, m, out)
        wp = self._ptr(w.packed) if isinstance(w, Fp4Operand) else self._ptr(w.codes, True)
        import cuda.bindings.driver as cuda

        stream = cuda.CUstream(torch.cuda.current_stream(out.device).cuda_stream
                               if out.is_cuda else 0)
        self.compiled(self._ptr(x.codes, True), self._ptr(x.scales), wp,
                      self._ptr(w.scales), self._ptr(out), int(m), int(x.rows_pad),
                      int(w.rows), int(w.kp), stream)
        return out
