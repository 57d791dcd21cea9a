"""Baselines every resgen benchmark compares against (`resgen bench`, bench/*.py).

- cuBLAS BF16: torch.matmul on bf16 operands.
- cuBLAS FP8 W8A8 (E4M3 x E4M3 -> bf16, torch._scaled_mm), five forms:
  - cublas_fp8_prequant: rowwise scales (per token [M, 1], per output channel [1, N]), the
    activations quantized once outside the timed call: the rowwise GEMM alone;
  - cublas_fp8_tensor_prequant: per-tensor scales (one for x, one for w), the activations
    quantized once outside the timed call. cuBLAS picks faster kernels for per-tensor scales
    at small M than for rowwise ones, so this is the lower bound of a W8A8 layer (the
    issue-20 figure of 61 us at M = 1 is this form);
  - cublas_fp8_static: per-tensor scales with the activation scale static (calibrated once,
    as a static-scale FP8 checkpoint carries it): one Triton cast kernel then the per-tensor
    GEMM, as a serving engine runs such a checkpoint;
  - cublas_fp8_fused: the same GEMM behind one fused per-token quantization kernel (Triton),
    as a serving engine runs a W8A8 layer;
  - cublas_fp8_torch_quant: per-tensor scales, the activation quantized per call by several
    torch ops (the first FP8 baseline; slower than BF16 at small M, so it flatters resgen;
    kept because the stored `fp8_us` numbers of the retired gpu_linear_check.py use it).
- Triton MXFP4 x BF16: tl.dot_scaled with E2M1 weights and E8M0 scales (Triton upcasts on Hopper).
- vLLM's Marlin FP4 x BF16 (W4A16, NVFP4 and MXFP4): resgen.baselines_marlin (built by
  bench/marlin_setup.sh, outside the tree).
- The HBM floor: bytes that must move / 4.45 TB/s (the H200's achieved read bandwidth).
All take a prepared operand set and return a zero-argument callable for the timer.
"""

from __future__ import annotations

from typing import Callable

import torch

from . import baselines_marlin, formats
from .baselines_marlin import MarlinUnavailable

HBM_BYTES_PER_S = 4.45e12

__all__ = ["HBM_BYTES_PER_S", "floor_us", "nvfp4_weight_bytes", "mxfp4_weight_bytes",
           "cublas_bf16", "cublas_fp8_torch_quant", "cublas_fp8_prequant", "cublas_fp8_fused",
           "cublas_fp8_tensor_prequant", "cublas_fp8_static", "fp8_tensor_quant",
           "fp8_tensor_quant_triton", "fp8_rowwise_quant", "fp8_weight_rowwise", "triton_mxfp4",
           "marlin_fp4",
           "MarlinUnavailable", "TRITON_AVAILABLE", "TRITON_FORMS"]

E4M3_MAX = formats.E4M3_MAX
INV_E4M3_MAX = 1.0 / E4M3_MAX    # scales are amax * fp32(1/448) in both quantizers


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


def cublas_fp8_torch_quant(x: torch.Tensor, w: torch.Tensor) -> Callable[[], torch.Tensor]:
    """x: [M, K] bf16 (M % 16 == 0), w: [N, K] bf16 -> callable returning [M, N] bf16.
    Per-tensor FP8 E4M3, the activation quantized per call by torch ops (amax, divide, cast:
    several kernels). Formerly `cublas_fp8`."""
    f8 = torch.float8_e4m3fn
    w_scale = (w.abs().amax().float() / E4M3_MAX).clamp(min=1e-12)
    w8 = (w.float() / w_scale).to(f8).t()          # column-major [K, N] for _scaled_mm
    one = torch.ones((), device=x.device)

    def run() -> torch.Tensor:
        x_scale = (x.abs().amax().float() / E4M3_MAX).clamp(min=1e-12)
        x8 = (x.float() / x_scale).to(f8)
        return torch._scaled_mm(x8, w8, scale_a=x_scale * one, scale_b=w_scale,
                                out_dtype=torch.bfloat16)

    return run


def fp8_rowwise_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [R, K] (any float dtype) -> (E4M3 [R, K], float32 scales [R, 1]):
    resgen.formats.fp8_rowwise_quant (the one definition), with a shape check. The torch
    reference of the fused kernel, and the quantizer of the weights (per output channel) and
    of the pre-quantized activations."""
    _check_2d_float(x, "fp8_rowwise_quant input")
    return formats.fp8_rowwise_quant(x)


def fp8_weight_rowwise(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w: [N, K] -> (E4M3 [K, N] column-major view for _scaled_mm, float32 scale_b [1, N])."""
    w8, ws = fp8_rowwise_quant(w)
    return w8.t(), ws.reshape(1, -1).contiguous()


def fp8_tensor_quant(x: torch.Tensor, scale: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [R, K] (any float dtype) -> (E4M3 [R, K], float32 0-d scale): per-tensor FP8 with
    scale = max(amax(|x|) * fp32(1 / 448), 1e-12) unless a (static, calibrated) scale is given,
    and x8 = clamp(x / scale, +-448) (IEEE division, round to nearest even in the cast). The
    torch reference of fp8_tensor_quant_triton and the quantizer of the per-tensor forms."""
    _check_2d_float(x, "fp8_tensor_quant input")
    xf = x.float()
    scale = formats.fp8_scale(xf.abs().amax()) if scale is None else scale.reshape(()).float()
    return formats.fp8_cast(xf, scale), scale


def _check_2d_float(x: torch.Tensor, what: str) -> None:
    if x.dim() != 2 or not x.is_floating_point():
        raise ValueError(f"{what} must be a 2-D float tensor, got {x.dtype} {tuple(x.shape)}")


def _check_fp8_gemm_args(x: torch.Tensor, w: torch.Tensor) -> None:
    """The shapes torch._scaled_mm takes: x [M, K], w [N, K], M, K, N multiples of 16."""
    _check_2d_float(x, "FP8 activations x")
    _check_2d_float(w, "FP8 weights w")
    (m, k), (n, kw) = x.shape, w.shape
    if k != kw:
        raise ValueError(f"x has K={k}, w has K={kw}")
    if m % 16 or k % 16 or n % 16:
        raise ValueError(f"torch._scaled_mm needs M, K and N multiples of 16, got M={m} K={k} "
                         f"N={n} (pad the activation rows)")


def cublas_fp8_prequant(x: torch.Tensor, w: torch.Tensor) -> Callable[[], torch.Tensor]:
    """x: [M, K] bf16 (M % 16 == 0), w: [N, K] bf16 -> callable returning [M, N] bf16:
    rowwise-scaled torch._scaled_mm on activations quantized HERE, once (not in the timed
    call): the GEMM alone, the lower bound of a W8A8 layer."""
    _check_fp8_gemm_args(x, w)
    w8, ws = fp8_weight_rowwise(w)
    x8, xs = fp8_rowwise_quant(x)
    return lambda: torch._scaled_mm(x8, w8, scale_a=xs, scale_b=ws, out_dtype=torch.bfloat16)


def cublas_fp8_tensor_prequant(x: torch.Tensor, w: torch.Tensor) -> Callable[[], torch.Tensor]:
    """x: [M, K] bf16 (M % 16 == 0), w: [N, K] bf16 -> callable returning [M, N] bf16:
    per-tensor-scaled torch._scaled_mm on activations quantized HERE, once (not in the timed
    call): the lower bound of a W8A8 layer."""
    _check_fp8_gemm_args(x, w)
    w8, ws = fp8_tensor_quant(w)
    x8, xs = fp8_tensor_quant(x)
    w8t = w8.t()
    return lambda: torch._scaled_mm(x8, w8t, scale_a=xs, scale_b=ws, out_dtype=torch.bfloat16)


def cublas_fp8_static(x: torch.Tensor, w: torch.Tensor) -> Callable[[], torch.Tensor]:
    """x: [M, K] bf16 (M % 16 == 0), w: [N, K] bf16 -> callable returning [M, N] bf16: a
    static per-tensor activation scale (calibrated here, once, on x itself, as a static-scale
    FP8 checkpoint carries one), then per call one Triton cast kernel (fp8_tensor_quant's math
    with that scale) and per-tensor torch._scaled_mm: a serving engine's static-FP8 layer."""
    _check_fp8_gemm_args(x, w)
    if not TRITON_AVAILABLE:
        raise RuntimeError("Triton is not installed (the static FP8 cast is a Triton kernel)")
    w8, ws = fp8_tensor_quant(w)
    w8t = w8.t()
    x = x.contiguous()
    _, xs = fp8_tensor_quant(x)
    x8 = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)

    def run() -> torch.Tensor:
        _launch_fp8_cast(x, x8, xs)
        return torch._scaled_mm(x8, w8t, scale_a=xs, scale_b=ws, out_dtype=torch.bfloat16)

    return run


_CAST_BLOCK = 2048


def _launch_fp8_cast(x: torch.Tensor, x8: torch.Tensor, scale: torch.Tensor) -> None:
    n = x.numel()
    _fp8_cast_kernel[(triton.cdiv(n, _CAST_BLOCK),)](x, x8, scale, n, BLOCK=_CAST_BLOCK)


def fp8_tensor_quant_triton(x: torch.Tensor, scale: torch.Tensor
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """The static cast kernel alone (for its check against fp8_tensor_quant): x [R, K] bf16
    CUDA, scale a float32 0-d CUDA tensor -> (E4M3 [R, K], that scale)."""
    if not TRITON_AVAILABLE:
        raise RuntimeError("Triton is not installed")
    _check_2d_float(x, "fp8_tensor_quant_triton input")
    x = x.contiguous()
    x8 = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scale = scale.reshape(()).float()
    _launch_fp8_cast(x, x8, scale)
    return x8, scale


def cublas_fp8_fused(x: torch.Tensor, w: torch.Tensor) -> Callable[[], torch.Tensor]:
    """x: [M, K] bf16 (M % 16 == 0), w: [N, K] bf16 -> callable returning [M, N] bf16: one
    fused per-token quantization kernel (Triton: amax, scale, cast, one program per row;
    the math of fp8_rowwise_quant) then rowwise-scaled torch._scaled_mm (scale_a [M, 1],
    scale_b [1, N]), as a serving engine runs a W8A8 layer."""
    _check_fp8_gemm_args(x, w)
    if not TRITON_AVAILABLE:
        raise RuntimeError("Triton is not installed (the fused FP8 quantizer is a Triton "
                           "kernel)")
    w8, ws = fp8_weight_rowwise(w)
    x = x.contiguous()
    m, k = x.shape
    x8 = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    xs = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    block = min(4096, triton.next_power_of_2(k))

    def run() -> torch.Tensor:
        _fp8_rowwise_quant_kernel[(m,)](x, x8, xs, k, INV_MAX=INV_E4M3_MAX, BLOCK=block)
        return torch._scaled_mm(x8, w8, scale_a=xs, scale_b=ws, out_dtype=torch.bfloat16)

    return run


def fp8_rowwise_quant_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused kernel alone (for its check against fp8_rowwise_quant): x [R, K] bf16 CUDA ->
    (E4M3 [R, K], float32 [R, 1])."""
    if not TRITON_AVAILABLE:
        raise RuntimeError("Triton is not installed")
    _check_2d_float(x, "fp8_rowwise_quant_triton input")
    x = x.contiguous()
    r, k = x.shape
    x8 = torch.empty(r, k, dtype=torch.float8_e4m3fn, device=x.device)
    xs = torch.empty(r, 1, dtype=torch.float32, device=x.device)
    _fp8_rowwise_quant_kernel[(r,)](x, x8, xs, k, INV_MAX=INV_E4M3_MAX,
                                    BLOCK=min(4096, triton.next_power_of_2(k)))
    return x8, xs


def marlin_fp4(x: torch.Tensor, q, fmt: str,
               out: torch.Tensor | None = None) -> Callable[[], torch.Tensor]:
    """vLLM's Marlin W4A16 GEMM (see resgen.baselines_marlin.marlin_fp4): x bf16 [M, K], q the
    fmt ("nvfp4" / "mxfp4") QuantizedTensor of the [N, K] weights, repacked once here."""
    return baselines_marlin.marlin_fp4(x, q, fmt, out=out)


try:
    import triton
    import triton.language as tl

    TRITON_AVAILABLE = True
except Exception:       # pragma: no cover - Triton is present on the GPU machine
    TRITON_AVAILABLE = False


TRITON_FORMS: tuple[str, ...] = ("rhs", "swapped", "swapped_fast", "upcast")

if TRITON_AVAILABLE:

    @triton.jit
    def _fp8_rowwise_quant_kernel(x_ptr, y_ptr, s_ptr, K, INV_MAX: tl.constexpr,
                                  BLOCK: tl.constexpr):
        # One program per row of x [R, K] bf16: amax over the row, scale = max(amax * INV_MAX,
        # 1e-12) into s [R, 1] float32, y = clamp(x / scale, +-448) as E4M3 (fp8_rowwise_quant)
        row = tl.program_id(0).to(tl.int64)
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK):
            rk = k0 + tl.arange(0, BLOCK)
            v = tl.load(x_ptr + row * K + rk, mask=rk < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(v))
        scale = tl.maximum(tl.max(amax, axis=0) * INV_MAX, 1e-12)
        tl.store(s_ptr + row, scale)
        for k0 in range(0, K, BLOCK):
            rk = k0 + tl.arange(0, BLOCK)
            v = tl.load(x_ptr + row * K + rk, mask=rk < K, other=0.0).to(tl.float32)
            q = tl.clamp(tl.math.div_rn(v, scale), -448.0, 448.0)   # IEEE, as torch
            tl.store(y_ptr + row * K + rk, q.to(tl.float8e4nv), mask=rk < K)

    @triton.jit
    def _fp8_cast_kernel(x_ptr, y_ptr, s_ptr, n, BLOCK: tl.constexpr):
        # y = clamp(x / s, +-448) as E4M3 over n elements of x (bf16), s a float32 scalar
        # (fp8_tensor_quant with a given scale)
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        s = tl.load(s_ptr)
        v = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
        q = tl.clamp(tl.math.div_rn(v, s), -448.0, 448.0)
        tl.store(y_ptr + offs, q.to(tl.float8e4nv), mask=offs < n)

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
