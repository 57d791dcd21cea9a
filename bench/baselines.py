"""Baselines every resgen benchmark compares against (see ../shared/BENCH.md).

- cuBLAS BF16: torch.matmul on bf16 operands.
- cuBLAS FP8: torch._scaled_mm with per-tensor scales (E4M3 x E4M3 -> bf16).
- Triton MXFP4 x BF16: tl.dot_scaled with E2M1 weights and E8M0 scales (Triton upcasts on Hopper).
- The HBM floor: bytes that must move / 4.45 TB/s (the H200's achieved read bandwidth).
All take a prepared operand set and return a zero-argument callable for the timer.
"""

from __future__ import annotations

from typing import Callable

import torch

HBM_BYTES_PER_S = 4.45e12

__all__ = ["HBM_BYTES_PER_S", "floor_us", "nvfp4_weight_bytes", "mxfp4_weight_bytes",
           "cublas_bf16", "cublas_fp8", "triton_mxfp4", "TRITON_AVAILABLE"]


def nvfp4_weight_bytes(n: int, k: int) -> int:
    """Packed E2M1 + one E4M3 scale per 16: 0.5625 bytes per weight."""
    return n * k // 2 + n * k // 16


def mxfp4_weight_bytes(n: int, k: int) -> int:
    """Packed E2M1 + one E8M0 scale per 32: 0.53125 bytes per weight."""
    return n * k // 2 + n * k // 32


def floor_us(nbytes: float) -> float:
    return nbytes / HBM_BYTES_PER_S * 1e6


def cublas_bf16(x: torch.Tensor, w: torch.Tensor) -> Callable[[], torch.Tensor]:
    """x: [M, K] bf16, w: [N, K] bf16 -> callable returning [M, N] bf16."""
    wt = w.t()
    return lambda: torch.matmul(x, wt)


def cublas_fp8(x: torch.Tensor, w: torch.Tensor) -> Callable[[], torch.Tensor]:
    """Per-tensor FP8 E4M3 (activation quantized per call, as a serving stack does)."""
    f8 = torch.float8_e4m3fn
    w_scale = (w.abs().amax().float() / 448.0).clamp(min=1e-12)
    w8 = (w.float() / w_scale).to(f8).t()          # column-major [K, N] for _scaled_mm
    one = torch.ones((), device=x.device)

    def run() -> torch.Tensor:
        x_scale = (x.abs().amax().float() / 448.0).clamp(min=1e-12)
        x8 = (x.float() / x_scale).to(f8)
        return torch._scaled_mm(x8, w8, scale_a=x_scale * one, scale_b=w_scale,
                                out_dtype=torch.bfloat16)

    return run


try:
    import triton
    import triton.language as tl

    TRITON_AVAILABLE = True
except Exception:       # pragma: no cover - Triton is present on the GPU machine
    TRITON_AVAILABLE = False


if TRITON_AVAILABLE:

    @triton.jit
    def _mxfp4_kernel(x_ptr, w_ptr, s_ptr, y_ptr, M, N, K: tl.constexpr,
                      BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        # x: [M, K] bf16; w: [K // 2, N] uint8 (two E2M1 codes along K per byte, low nibble
        # first); s: [N, K // 32] uint8 E8M0; y: [M, N] bf16.
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        rm = pid_m * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            rk = k0 + tl.arange(0, BK)
            rk2 = k0 // 2 + tl.arange(0, BK // 2)
            rs = k0 // 32 + tl.arange(0, BK // 32)
            a = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=rm[:, None] < M, other=0.0)
            b = tl.load(w_ptr + rk2[:, None] * N + rn[None, :])
            bs = tl.load(s_ptr + rn[:, None] * (K // 32) + rs[None, :])
            acc = tl.dot_scaled(a, None, "bf16", b, bs, "e2m1", acc)
        tl.store(y_ptr + rm[:, None] * N + rn[None, :], acc.to(tl.bfloat16), mask=rm[:, None] < M)


def triton_mxfp4(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                 bm: int = 16, bn: int = 64, bk: int = 128) -> Callable[[], torch.Tensor]:
    """x: [M, K] bf16; codes: uint8 [N, K/2] (ModelOpt packing); scales: uint8 E8M0 [N, K/32]."""
    if not TRITON_AVAILABLE:
        raise RuntimeError("Triton is not installed")
    m, k = x.shape
    n = codes.shape[0]
    w_kn = codes.t().contiguous()          # [K/2, N]: packed along K as tl.dot_scaled expects
    y = torch.empty(m, n, dtype=torch.bfloat16, device=x.device)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))

    def run() -> torch.Tensor:
        _mxfp4_kernel[grid](x, w_kn, scales, y, m, n, k, BM=bm, BN=bn, BK=bk)
        return y

    return run
