"""Probe kernels for the GPU tests: apply resgen.kernels.fp4_device functions element by element
so that each device function is compared with torch / resgen.formats on millions of values.

probe(v, d, out) for i < n (n a multiple of 128), one thread per element:
    out[0, i] = e4m3_encode(|v|)                         (byte)
    out[1, i] = e2m1_round(v) code
    out[2, i] = bits of e2m1_round(v) value
    out[3, i] = bits of block_quotients([v], d, |v|)[0]  (fast path where allowed)
    out[4, i] = bits of div_rn(v, d)
    out[5, i] = mxfp4_block_scale(|v|) byte
    out[6, i] = bits of nvfp4_tensor_scale(|v|)
    out[7, i] = bits of e4m3_decode(i & 0xFF)
    out[8, i] = fast_division_ok(d, |v|)
    out[9, i] = bits of div6_rn(|v|)
    out[10, i] = bits of rcp_rn(d)
    out[11, i] = nvfp4_block_scale(|v|, d) byte               (d as the tensor scale alpha)
    out[12, i] = bits of bf16x2_abs_max([bits of v, bits of d])  (their halves as bf16)
"""

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, Uint32

from resgen.kernels import fp4_device as fd

ROWS = 13


@cute.kernel
def probe_kernel(v_ptr: cute.Pointer, d_ptr: cute.Pointer, out_ptr: cute.Pointer, n: Int32):
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    i = bidx * 128 + tidx
    v = fd.ld_global_f32(v_ptr.toint() + Int64(i) * 4)
    d = fd.ld_global_f32(d_ptr.toint() + Int64(i) * 4)
    a = fd.fabs(v)
    code, value = fd.e2m1_round(v)
    byte, _, _ = fd.mxfp4_block_scale(a)
    res = [fd.e4m3_encode(a), code, fd.f32_bits(value),
           fd.f32_bits(fd.block_quotients([v], d, a)[0]), fd.f32_bits(fd.div_rn(v, d)), byte,
           fd.f32_bits(fd.nvfp4_tensor_scale(a)), fd.f32_bits(fd.e4m3_decode(Uint32(i) & 0xFF)),
           fd.sel_u32(fd.fast_division_ok(d, a), 1, 0), fd.f32_bits(fd.div6_rn(a)),
           fd.f32_bits(fd.rcp_rn(d)), fd.nvfp4_block_scale(a, d)[0],
           fd.f32_bits(fd.bf16x2_abs_max([fd.f32_bits(v), fd.f32_bits(d)]))]
    base = out_ptr.toint() + Int64(i) * 4
    for r in cutlass.range_constexpr(ROWS):
        fd.st_global_u32(base + Int64(n) * (4 * r), res[r])


@cute.jit
def probe(v_ptr: cute.Pointer, d_ptr: cute.Pointer, out_ptr: cute.Pointer, n: Int32,
          stream: cuda.CUstream):
    probe_kernel(v_ptr, d_ptr, out_ptr, n).launch(grid=[n // 128, 1, 1], block=[128, 1, 1],
                                                  stream=stream)
