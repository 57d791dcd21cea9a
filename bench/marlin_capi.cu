// A C ABI over vLLM's Marlin FP4 x BF16 GEMM (W4A16: NVFP4 and MXFP4 weights) and its
// weight repack, for resgen's baseline (resgen/baselines_marlin.py calls it through ctypes
// with raw device pointers, so the library does not depend on any torch ABI).
//
// Built by bench/marlin_setup.sh from the vLLM source distribution, outside the project tree:
// this file holds no vLLM code; it includes, from the build folder,
//   marlin_host.inc   marlin.cu's host code (config choice + launch loop: marlin::marlin_mm),
//                     cut out verbatim, without its torch::stable front end (marlin_gemm)
//   repack_kernel.inc gptq_marlin_repack.cu's kernel (marlin::gptq_marlin_repack_kernel)
//   kernel_selector.h generate_kernels.py's selector, filtered to BF16 x FE2M1f -> BF16
// and the kernel instantiations are compiled from generate_kernels.py's own output file.
//
// Every entry point returns 0 on success, else 1 with a message in err (errlen bytes).
#include <cstdio>
#include <cstring>
#include <exception>

#include "kernel.h"

namespace marlin {
#include "marlin_host.inc"
#include "repack_kernel.inc"
}  // namespace marlin

static int fail(char* err, int errlen, const char* msg) {
  if (err && errlen > 0) {
    std::snprintf(err, errlen, "%s", msg);
  }
  return 1;
}

static int cuda_status(char* err, int errlen, const char* where) {
  cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess) return 0;
  char buf[512];
  std::snprintf(buf, sizeof(buf), "%s: CUDA error %s", where, cudaGetErrorString(e));
  return fail(err, errlen, buf);
}

extern "C" {

// The library's interface version (resgen/baselines_marlin.py checks it).
int marlin_capi_version() { return 1; }

// Number of SMs of the current device (the lock workspace holds 4 ints per SM, as vLLM's
// get_marlin_workspace allocates).
int marlin_capi_sms() {
  int dev = 0, sms = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  return sms;
}

// Marlin's weight repack (num_bits 4, 16-bit activations), as vLLM's gptq_marlin_repack:
// b_q [K / 8, N] int32 (eight E2M1 codes along K per word, first in the low nibble) ->
// out [K / 16, N * 2] int32. K % 16 == 0, N % 64 == 0.
int marlin_capi_repack_fp4(const void* b_q, void* out, int size_k, int size_n, void* stream,
                           char* err, int errlen) {
  try {
    STD_TORCH_CHECK(size_k % marlin::tile_k_size == 0, "size_k = ", size_k,
                    " is not divisible by tile_k_size = ", marlin::tile_k_size);
    STD_TORCH_CHECK(size_n % marlin::tile_n_size == 0, "size_n = ", size_n,
                    " is not divisible by tile_n_size = ", marlin::tile_n_size);
    int dev = 0, blocks = 0, max_shared_mem = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&blocks, cudaDevAttrMultiProcessorCount, dev);
    cudaDeviceGetAttribute(&max_shared_mem, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
    STD_TORCH_CHECK(max_shared_mem > 0, "no shared memory attribute");
    auto kernel = marlin::gptq_marlin_repack_kernel<marlin::repack_threads, 4, false>;
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, max_shared_mem);
    kernel<<<blocks, marlin::repack_threads, max_shared_mem, (cudaStream_t)stream>>>(
        (const uint32_t*)b_q, (uint32_t*)out, size_k, size_n);
  } catch (const std::exception& e) {
    return fail(err, errlen, e.what());
  }
  return cuda_status(err, errlen, "gptq_marlin_repack_kernel");
}

// C[M, N] bf16 = A[M, K] bf16 (row stride lda elements) x dequant(B) with B repacked by
// marlin_capi_repack_fp4; scales [K / group, N] (Marlin-permuted and processed as vLLM's
// prepare_fp4_layer_for_marlin does): nvfp4 != 0: E4M3-derived S0E5M3 bytes, group 16,
// global_scale: float32 [1] (processed); nvfp4 == 0: E8M0, group 32, global_scale NULL.
// c_tmp: float32 workspace for the FP32 reduction (sms * min(64, ceil16(M)) * 256 floats),
// locks: int32 [sms * 4], zeroed once (Marlin resets them after each call).
int marlin_capi_gemm_fp4(const void* a, const void* b, void* c, void* c_tmp,
                         const void* scales, const void* global_scale, int size_m,
                         int size_n, int size_k, int lda, void* locks, int nvfp4,
                         int use_atomic_add, int use_fp32_reduce, void* stream, char* err,
                         int errlen) {
  try {
    int dev = 0, sms = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    int group_size = nvfp4 ? 16 : 32;
    STD_TORCH_CHECK(size_k % group_size == 0, "size_k = ", size_k,
                    " is not divisible by the group size ", group_size);
    STD_TORCH_CHECK(size_n % marlin::min_thread_n == 0, "size_n = ", size_n,
                    " is not divisible by min_thread_n = ", marlin::min_thread_n);
    STD_TORCH_CHECK(size_k % marlin::tile_size == 0, "size_k = ", size_k,
                    " is not divisible by tile_size = ", marlin::tile_size);
    STD_TORCH_CHECK(lda % 8 == 0, "lda = ", lda, " is not a multiple of 8");
    STD_TORCH_CHECK(!nvfp4 || global_scale != nullptr,
                    "NVFP4 needs the (processed) global scale");
    vllm::ScalarType s_type = nvfp4 ? vllm::kFE4M3fn : vllm::kFE8M0fnu;
    marlin::marlin_mm(a, b, c, c_tmp, nullptr, nullptr, (void*)scales,
                      nvfp4 ? (void*)global_scale : nullptr, nullptr, size_m, size_n,
                      size_k, lda, locks, vllm::kBFloat16, vllm::kFE2M1f, vllm::kBFloat16,
                      s_type, false, false, size_k / group_size, group_size, dev,
                      (cudaStream_t)stream, -1, -1, sms, use_atomic_add != 0,
                      use_fp32_reduce != 0, false);
  } catch (const std::exception& e) {
    return fail(err, errlen, e.what());
  }
  return cuda_status(err, errlen, "Marlin");
}

}  // extern "C"
