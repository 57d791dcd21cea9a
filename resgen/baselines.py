"""Baselines every resgen benchmark compares against (`resgen bench`, bench/*.py).

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
           "cublas_bf16", "cublas_fp8", "triton_mxfp4", "TRITON_AVAILABLE", "TRITON_FORMS"]


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


TRITON_FORMS: tuple[str, ...] = ("rhs", "swapped", "swapped_fast", "upcast")

if TRITON_AVAILABLE:

    @triton.jit
    def _mxfp4_rhs_kernel(x_ptr, w_ptr, s_ptr, y_ptr, M, N, K: tl.constexpr,
                          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        # Y[M, N] = x[M, K] (bf16) @ dequant(w)[K, N]: w [K // 2, N] uint8 (two E2M1 codes
        # along K per byte, first in the low nibble), s [N, K // 32] uint8 E8M0.
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

    @triton.jit
    def _mxfp4_swapped_kernel(w_ptr, s_ptr, x_ptr, y_ptr, M, N, K: tl.constexpr,
                              BN: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
                              FAST: tl.constexpr):
        # Y^T[N, M] = dequant(w)[N, K] @ x^T[K, M]: the weights are the scaled LHS in their
        # stored layout (w [N, K // 2] uint8, ModelOpt packing; s [N, K // 32]), the few
        # tokens sit on the narrow side.
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        rn = pid_n * BN + tl.arange(0, BN)
        rm = pid_m * BM + tl.arange(0, BM)
        acc = tl.zeros((BN, BM), dtype=tl.float32)
        for k0 in range(0, K, BK):
            rk = k0 + tl.arange(0, BK)
            rk2 = k0 // 2 + tl.arange(0, BK // 2)
            rs = k0 // 32 + tl.arange(0, BK // 32)
            a = tl.load(w_ptr + rn[:, None] * (K // 2) + rk2[None, :])
            a_s = tl.load(s_ptr + rn[:, None] * (K // 32) + rs[None, :])
            b = tl.load(x_ptr + rm[None, :] * K + rk[:, None], mask=rm[None, :] < M, other=0.0)
            acc = tl.dot_scaled(a, a_s, "e2m1", b, None, "bf16", acc, fast_math=FAST)
        tl.store(y_ptr + rm[None, :] * N + rn[:, None], acc.to(tl.bfloat16),
                 mask=rm[None, :] < M)

    @triton.jit
    def _e2m1_value(c):
        # c: int32 nibbles 0..15 -> float32 E2M1 value (sign bit 3, exponent bits 2-1,
        # mantissa bit 0; exponent 0 is subnormal: 0 or 0.5)
        e = (c >> 1) & 3
        m = (c & 1).to(tl.float32)
        v = tl.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * tl.exp2((e - 1).to(tl.float32)))
        return tl.where((c & 8) != 0, -v, v)

    @triton.jit
    def _mxfp4_upcast_kernel(x_ptr, w_ptr, s_ptr, y_ptr, M, N, K: tl.constexpr,
                             BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        # The same product with the E2M1 decode written out (nibbles -> values, times the
        # E8M0 power of two, exact in bf16) and a plain bf16 tl.dot: w [N, K // 2] uint8
        # (ModelOpt layout), s [N, K // 32].
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
            c = tl.load(w_ptr + rn[None, :] * (K // 2) + rk2[:, None]).to(tl.int32)  # [BK/2, BN]
            lo = _e2m1_value(c & 15)
            hi = _e2m1_value(c >> 4)
            w = tl.reshape(tl.permute(tl.join(lo, hi), (0, 2, 1)), (BK, BN))  # k = 2i, 2i + 1
            e = tl.load(s_ptr + rn[None, :] * (K // 32) + rs[:, None]).to(tl.float32)  # [BK/32, BN]
            w = tl.reshape(tl.reshape(w, (BK // 32, 32, BN)) * tl.exp2(e - 127.0)[:, None, :],
                           (BK, BN))
            acc = tl.dot(a, w.to(tl.bfloat16), acc)
        tl.store(y_ptr + rm[:, None] * N + rn[None, :], acc.to(tl.bfloat16), mask=rm[:, None] < M)


def triton_mxfp4(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                 form: str = "rhs") -> Callable[[], torch.Tensor]:
    """x: [M, K] bf16; codes: uint8 [N, K/2] (ModelOpt packing); scales: uint8 E8M0 [N, K/32].

    form: "rhs" (tl.dot_scaled with bf16 x as LHS and the E2M1 weights, repacked [K/2, N], as
    the scaled RHS), "swapped" / "swapped_fast" (the weights as the scaled LHS in their stored
    layout, tokens on the narrow side; fast_math off / on), "upcast" (E2M1 decoded by hand in
    Triton, plain bf16 tl.dot: a Triton path that does not depend on tl.dot_scaled). The
    benchmarks check every form against the dequantized weights before timing it (the "rhs"
    form returned wrong values on the H200 with Triton 3.6 in the first benchmark run)."""
    if not TRITON_AVAILABLE:
        raise RuntimeError("Triton is not installed")
    if form not in TRITON_FORMS:
        raise ValueError(f"unknown Triton form {form!r}; one of {TRITON_FORMS}")
    m, k = x.shape
    n = codes.shape[0]
    if k % 128:
        raise ValueError(f"K={k} is not a multiple of 128 (the Triton tiles' K step)")
    x = x.contiguous()
    codes, scales = codes.contiguous(), scales.contiguous()
    y = torch.empty(m, n, dtype=torch.bfloat16, device=x.device)
    if form == "rhs":
        w_kn = codes.t().contiguous()          # [K/2, N]: packed along K
        grid = (triton.cdiv(m, 16), triton.cdiv(n, 64))
        return lambda: (_mxfp4_rhs_kernel[grid](x, w_kn, scales, y, m, n, k,
                                                BM=16, BN=64, BK=128), y)[1]
    if form == "upcast":
        grid = (triton.cdiv(m, 16), triton.cdiv(n, 64))
        return lambda: (_mxfp4_upcast_kernel[grid](x, codes, scales, y, m, n, k,
                                                   BM=16, BN=64, BK=128), y)[1]
    fast = form == "swapped_fast"
    grid = (triton.cdiv(n, 64), triton.cdiv(m, 16))
    return lambda: (_mxfp4_swapped_kernel[grid](codes, scales, x, y, m, n, k, BN=64, BM=16,
                                                BK=128, FAST=fast), y)[1]
