"""vLLM's Marlin FP4 x BF16 GEMM (W4A16, NVFP4 and MXFP4 weights) as a `resgen bench` baseline.

The kernel is vLLM's own (csrc/quantization/marlin/ of the vLLM source distribution), built
outside the project tree by bench/marlin_setup.sh into the ignored .peers/marlin/ as a plain
CUDA shared library with a C ABI (bench/marlin_capi.cu); this module calls it through ctypes
with raw device pointers, so no torch ABI is involved. RESGEN_MARLIN_LIB overrides the path.

The weight preparation follows vLLM's prepare_fp4_layer_for_marlin (vllm/model_executor/
layers/quantization/utils/marlin_utils_fp4.py, W4A16, bf16 params): Marlin's own repack kernel
(gptq_marlin_repack, num_bits 4) on the [K / 8, N] int32 view of the codes, the scales
transposed to [K / group, N], permuted (marlin_permute_scales) and processed (NVFP4: E4M3 ->
S0E5M3 with a power-of-two rescale and the global scale compensated; MXFP4: the [0, 2, 1, 3]
interleave, E8M0 kept). It runs once, on the GPU, before any timing; the GEMM call itself is
what vLLM's apply_fp4_marlin_linear runs (FP32 global reduction on, atomic add off: vLLM's
defaults), into a preallocated output.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from .formats import QuantizedTensor

LIB_ENV = "RESGEN_MARLIN_LIB"
DEFAULT_LIB = (Path(__file__).resolve().parent.parent / ".peers" / "marlin"
               / "libmarlin_fp4_sm90a.so")
CAPI_VERSION = 1
GROUP_SIZE = {"nvfp4": 16, "mxfp4": 32}
TILE_N, TILE_K = 64, 128          # the shapes this baseline takes (no padding path)
MAX_THREAD_N = 256                # marlin.cuh max_thread_n: the FP32 reduce buffer's width
LOCKS_PER_SM = 4                  # vLLM's MARLIN_MAX_BLOCKS_PER_SM

__all__ = ["LIB_ENV", "MarlinUnavailable", "MarlinFP4Weight", "lib_path", "load",
           "check_args", "permute_scales", "nvfp4_process_scales", "nvfp4_process_global_scale",
           "mxfp4_process_scales", "prepare", "gemm", "marlin_fp4"]


class MarlinUnavailable(RuntimeError):
    """The Marlin library is not built or does not load (the message says which and why)."""


_LIB: ctypes.CDLL | None = None


def lib_path() -> Path:
    """Where the library is looked for: $RESGEN_MARLIN_LIB, else .peers/marlin/ of the tree."""
    env = os.environ.get(LIB_ENV)
    return Path(env) if env else DEFAULT_LIB


def load() -> ctypes.CDLL:
    """The loaded Marlin library; MarlinUnavailable (naming the path and the fix) if absent."""
    global _LIB
    if _LIB is not None:
        return _LIB
    path = lib_path()
    if not path.is_file():
        raise MarlinUnavailable(
            f"Marlin library not found at {path}: build it with `bash bench/marlin_setup.sh` "
            f"(on a machine with nvcc and PyPI access) and carry .peers/marlin, or set "
            f"{LIB_ENV}")
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        if "libcudart" not in str(e) or not _preload_cudart():
            raise MarlinUnavailable(f"Marlin library {path} does not load: {e}") from e
        try:
            lib = ctypes.CDLL(str(path))
        except OSError as e2:
            raise MarlinUnavailable(f"Marlin library {path} does not load: {e2}") from e2
    try:
        ver = lib.marlin_capi_version()
    except AttributeError as e:
        raise MarlinUnavailable(f"{path} is not a resgen Marlin library: {e}") from e
    if ver != CAPI_VERSION:
        raise MarlinUnavailable(f"{path} has C API version {ver}, this resgen wants "
                                f"{CAPI_VERSION}: rebuild with bench/marlin_setup.sh")
    vp, i = ctypes.c_void_p, ctypes.c_int
    lib.marlin_capi_repack_fp4.argtypes = [vp, vp, i, i, vp, ctypes.c_char_p, i]
    lib.marlin_capi_repack_fp4.restype = i
    lib.marlin_capi_gemm_fp4.argtypes = [vp, vp, vp, vp, vp, vp, i, i, i, i, vp, i, i, i, vp,
                                         ctypes.c_char_p, i]
    lib.marlin_capi_gemm_fp4.restype = i
    lib.marlin_capi_sms.restype = i
    _LIB = lib
    return lib


def _preload_cudart() -> bool:
    """Load libcudart.so.13 globally from the nvidia pip packages torch cu13 uses (the library
    links it by soname; torch normally has it loaded already). True if one loaded."""
    import glob
    import importlib.util

    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        for cand in sorted(glob.glob(os.path.join(root, "*", "lib", "libcudart.so.13*"))):
            try:
                ctypes.CDLL(cand, mode=ctypes.RTLD_GLOBAL)
                return True
            except OSError:
                continue
    return False


def check_args(x: torch.Tensor, q: QuantizedTensor, fmt: str) -> None:
    """x: bf16 [M, K]; q: fmt's QuantizedTensor of [N, K] weights. ValueError naming the
    problem: an unknown or mismatched format, a wrong dtype / rank, K mismatch, N % 64 or
    K % 128 (Marlin's thread tiles; this baseline has no padding path)."""
    if fmt not in GROUP_SIZE:
        raise ValueError(f"Marlin FP4 format must be one of {tuple(GROUP_SIZE)}, got {fmt!r}")
    if not isinstance(q, QuantizedTensor):
        raise ValueError(f"Marlin weights must be a QuantizedTensor, got {type(q).__name__}")
    if q.fmt != fmt:
        raise ValueError(f"weights are {q.fmt}, the Marlin call asked for {fmt}")
    if x.dtype != torch.bfloat16 or x.dim() != 2:
        raise ValueError(f"Marlin W4A16 takes bf16 activations [M, K], got {x.dtype} "
                         f"{tuple(x.shape)}")
    if q.codes.dim() != 2:
        raise ValueError(f"Marlin weights must be 2-D [N, K], got {tuple(q.shape)}")
    n, k = q.codes.shape[0], q.codes.shape[1] * 2
    if x.shape[1] != k:
        raise ValueError(f"activations have K={x.shape[1]}, weights K={k}")
    if n % TILE_N or k % TILE_K:
        raise ValueError(f"Marlin needs N % {TILE_N} == 0 and K % {TILE_K} == 0, got "
                         f"N={n} K={k}")
    if x.shape[0] < 1:
        raise ValueError("Marlin needs M >= 1")


def _scale_perm() -> list[int]:
    # vLLM marlin_utils.get_scale_perms()[0] (grouped scales, 16-bit activations)
    return [i + 8 * j for i in range(8) for j in range(8)]


def permute_scales(s: torch.Tensor, size_n: int) -> torch.Tensor:
    """[K / group, N] -> the same shape in Marlin's order (vLLM marlin_permute_scales, grouped
    case: group < K, 16-bit activations)."""
    perm = _scale_perm()
    return s.reshape(-1, len(perm))[:, perm].reshape(-1, size_n).contiguous()


def nvfp4_process_scales(s: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Permuted E4M3 scales (as bf16 values, [K / 16, N]) -> (float8_e4m3fn bytes holding
    Marlin's S0E5M3 form, the power-of-two factor they were multiplied by), as vLLM's
    nvfp4_marlin_process_scales with bf16 activations."""
    s = s.to(torch.half)
    s = s.view(-1, 4)[:, [0, 2, 1, 3]].view(s.size(0), -1)
    factor = 1.0
    wf = s.float() * 2 ** 7
    nz = wf > 0
    if bool(nz.any()):
        mx = wf[nz].max()
        if float(mx) < 448 * 2 ** 7:
            factor = float((448 * 2 ** 7 / mx).log2().floor().exp2())
    if factor > 1.0:
        s = (s.float() * factor).to(torch.half)
    s = s * 2 ** 7
    s[s < 2] = 0
    s = (s.view(torch.int16) << 1).view(torch.float8_e4m3fn)
    return s[:, 1::2].contiguous(), factor


def nvfp4_process_global_scale(alpha: torch.Tensor, factor: float) -> torch.Tensor:
    """The NVFP4 global (tensor) scale alpha -> float32 [1] for Marlin with bf16 activations
    (vLLM nvfp4_marlin_process_global_scale: times 2^(126 - 7); then / factor)."""
    return (alpha.float().reshape(1) * 2.0 ** (2 ** 7 - 2 ** 1 - 7) / factor).contiguous()


def mxfp4_process_scales(s: torch.Tensor) -> torch.Tensor:
    """Permuted E8M0 scales ([K / 32, N], uint8 codes) -> float8_e8m0fnu in Marlin's
    interleave (vLLM mxfp4_marlin_process_scales, 16-bit activations). vLLM permutes them as
    bf16 values and casts back to E8M0: the same bytes for every finite E8M0 value (powers of
    two 2^-127..2^127 are exact in bf16), so the bytes are permuted directly here."""
    if s.dtype != torch.uint8:
        raise ValueError(f"MXFP4 scales must be uint8 E8M0 codes, got {s.dtype}")
    s = s.reshape(-1, 4)[:, [0, 2, 1, 3]].reshape(s.size(0), -1)
    return s.contiguous().view(torch.float8_e8m0fnu)


@dataclass
class MarlinFP4Weight:
    """One layer's weights in Marlin's form (device tensors): qweight int32 [K / 16, 2 N],
    scales [K / group, N] (1 byte each), global_scale float32 [1] (NVFP4) or None, locks
    int32 [SMs * 4] (zeroed; Marlin resets them after each call)."""

    fmt: str
    n: int
    k: int
    qweight: torch.Tensor
    scales: torch.Tensor
    global_scale: torch.Tensor | None
    locks: torch.Tensor


def _stream() -> ctypes.c_void_p:
    return ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)


def _raise(lib_rc: int, err: ctypes.Array, what: str) -> None:
    if lib_rc:
        raise RuntimeError(f"Marlin {what}: {err.value.decode(errors='replace')}")


def prepare(q: QuantizedTensor) -> MarlinFP4Weight:
    """resgen FP4 weights (on the GPU) -> Marlin's form (the repack runs Marlin's kernel)."""
    lib = load()
    fmt = q.fmt
    if fmt not in GROUP_SIZE:
        raise ValueError(f"Marlin FP4 format must be one of {tuple(GROUP_SIZE)}, got {fmt!r}")
    n, k = q.codes.shape[0], q.codes.shape[1] * 2
    if n % TILE_N or k % TILE_K:
        raise ValueError(f"Marlin needs N % {TILE_N} == 0 and K % {TILE_K} == 0, got "
                         f"N={n} K={k}")
    dev = q.codes.device
    b = q.codes.contiguous().view(torch.int32).t().contiguous()      # [K / 8, N]
    qweight = torch.empty(k // 16, 2 * n, dtype=torch.int32, device=dev)
    err = ctypes.create_string_buffer(512)
    _raise(lib.marlin_capi_repack_fp4(b.data_ptr(), qweight.data_ptr(), k, n, _stream(),
                                      err, len(err)), err, "repack")
    if fmt == "nvfp4":
        if q.global_scale is None:
            raise ValueError("NVFP4 weights without a global scale (Marlin needs alpha)")
        s = permute_scales(q.scales.t().contiguous().to(torch.bfloat16), n)
        scales, factor = nvfp4_process_scales(s)
        gs: torch.Tensor | None = nvfp4_process_global_scale(q.global_scale, factor)
    else:
        codes = q.scales.contiguous().view(torch.uint8).t().contiguous()        # [K / 32, N]
        scales = mxfp4_process_scales(permute_scales(codes, n))
        gs = None
    locks = torch.zeros(lib.marlin_capi_sms() * LOCKS_PER_SM, dtype=torch.int32, device=dev)
    return MarlinFP4Weight(fmt, n, k, qweight, scales, gs, locks)


def gemm(x: torch.Tensor, w: MarlinFP4Weight, out: torch.Tensor,
         c_tmp: torch.Tensor) -> torch.Tensor:
    """out[M, N] bf16 = x[M, K] bf16 @ dequant(w)^T; c_tmp: float32 reduce buffer
    (see c_tmp_numel)."""
    lib = load()
    m = x.shape[0]
    err = ctypes.create_string_buffer(512)
    gs = w.global_scale.data_ptr() if w.global_scale is not None else None
    _raise(lib.marlin_capi_gemm_fp4(
        x.data_ptr(), w.qweight.data_ptr(), out.data_ptr(), c_tmp.data_ptr(),
        w.scales.data_ptr(), gs, m, w.n, w.k, x.stride(0), w.locks.data_ptr(),
        int(w.fmt == "nvfp4"), 0, 1, _stream(), err, len(err)), err, "GEMM")
    return out


def c_tmp_numel(m: int, sms: int) -> int:
    """Floats of Marlin's FP32 reduce buffer: SMs x min(64, M rounded up to 16) x 256 (as
    marlin_gemm allocates it)."""
    return sms * min(64, -(-m // 16) * 16) * MAX_THREAD_N


def marlin_fp4(x: torch.Tensor, q: QuantizedTensor, fmt: str,
               out: torch.Tensor | None = None) -> Callable[[], torch.Tensor]:
    """x: bf16 [M, K] (CUDA); q: fmt ("nvfp4" / "mxfp4") weights [N, K] -> a callable
    returning x @ dequant(q)^T as bf16 [M, N], written into out (allocated if None). The
    arguments are checked first (ValueError), then the library is loaded (MarlinUnavailable
    if absent) and the weights repacked, once, here: the callable is only the GEMM."""
    check_args(x, q, fmt)
    lib = load()
    if not x.is_cuda or not q.codes.is_cuda:
        raise ValueError("Marlin runs on CUDA tensors; x or the weights are on the CPU")
    w = prepare(q)
    m = x.shape[0]
    if x.stride(1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16:
        x = x.contiguous()
    if out is None:
        out = torch.empty(m, w.n, dtype=torch.bfloat16, device=x.device)
    elif out.shape != (m, w.n) or out.dtype != torch.bfloat16 or not out.is_contiguous():
        raise ValueError(f"out must be contiguous bf16 [{m}, {w.n}], got {out.dtype} "
                         f"{tuple(out.shape)}")
    c_tmp = torch.empty(c_tmp_numel(m, lib.marlin_capi_sms()), dtype=torch.float32,
                        device=x.device)
    return lambda: gemm(x, w, out, c_tmp)
