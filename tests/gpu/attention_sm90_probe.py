"""Probe kernel for tests/gpu/test_attention_sm90_gpu.py: runs the attention device helpers and
the resgen.kernels.sm90_ptx wrappers they call on known inputs so their inline PTX (prmt, f16x2
multiplies, E4M3 conversions, mma.sync operand order, ex2) can be compared bit for bit with the
CPU emulator (resgen.kernels.attention_sm90_emu).

Lane i reads 8 input words at inp + 32 i and writes 32 output words at out + 128 i:
    in:  w (K word), sk (two K scale bytes), wa, wb (V words of keys a, b), sv (V scale bytes
         of a in byte 0, b in byte 1), f0, f1 (two FP32 values as bits), x (any word)
    out: [0:4] K word decoded and scaled by the first K scale;  [4:6] the two K scales as
         f16x2 (s*2^7, s*2^7);  [6:14] V pair decoded and scaled;  [14] the V scale pair;
         [15] pack_f16x2(f0, f1);  [16] f32x2_to_e4m3x2(f0, f1);  [17] f16x2_to_e4m3x2(x);
         [18] e4m3x2_to_f16x2(x);  [19] pack_bf16x2(f0, f1);  [20:24] mma_f16_16816 of the lanes'
         fragments A = {w, wa, wb, x}, B = {wa, wb}, C = {f0, f1, f0, f1};  [24:28] mma_e4m3_16832
         of the same registers;  [28] ex2_approx(f0) bits;  [29:32] zero
"""

from __future__ import annotations

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Int64

from resgen.kernels import attention_sm90_device as D
from resgen.kernels import sm90_ptx as P

CFG = D.AttnCfg(head_dim=128, group=4, page_size=32, num_warps=1, kc=32, compensation=True,
                packing="pair", pv="f16", reduction="none")


def _probe_body(a, o):
    w, sk, wa, wb = P.ld_nc_bytes(a, 16)
    sv, f0b, f1b, x = P.ld_nc_bytes(a + 16, 16)
    f0 = D.F4.bits_f32(f0b)
    f1 = D.F4.bits_f32(f1b)
    res = []
    ks = D._k_scales(CFG, sk)
    res += D._decode_k_word(w, ks[0])
    res += ks[:2]
    sc = D._v_scale_pair(sv, sv >> 8, 0, D.F16X2_128)
    res += [P.mul_f16x2(r, sc) for r in D._decode_v_pair(wa, wb)]
    res.append(sc)
    res.append(P.pack_f16x2(f0, f1))
    res.append(P.f32x2_to_e4m3x2(f0, f1))
    res.append(P.f16x2_to_e4m3x2(x))
    res.append(P.e4m3x2_to_f16x2(x))
    res.append(P.pack_bf16x2(f0, f1))
    res += [D.F4.f32_bits(v) for v in P.mma_f16_16816([w, wa, wb, x], [wa, wb], [f0, f1, f0, f1])]
    res += [D.F4.f32_bits(v) for v in P.mma_e4m3_16832([w, wa, wb, x], [wa, wb], [f0, f1, f0, f1])]
    res.append(D.F4.f32_bits(P.ex2_approx(f0)))
    res += [cutlass.Uint32(0)] * 3
    for i in range(0, 32, 4):
        D.F4.st_global_v4(o + i * 4, *res[i:i + 4])


@cute.kernel
def probe_kernel(inp: cute.Pointer, out: cute.Pointer):
    tid, _, _ = cute.arch.thread_idx()
    _probe_body(inp.toint() + Int64(tid) * 32, out.toint() + Int64(tid) * 128)


@cute.jit
def probe(inp: cute.Pointer, out: cute.Pointer, stream: cuda.CUstream):
    probe_kernel(inp, out).launch(grid=[1, 1, 1], block=[32, 1, 1], stream=stream)
