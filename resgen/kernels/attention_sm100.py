"""Host side of attention_sm100: the query operand (its definition, in torch), the compile
arguments and the decode op (workspace, launch). Written for a B200 and never run: there is no
Blackwell GPU here.

The query operand (prepared per decode step before the attention kernel, as the paper's
"separate query quantization kernel"; here in torch, a device quantizer is not built):
resgen.reference.quantize_query(q, scale="row") splits each head row into NVFP4 base and
residue (E2M1 codes, E4M3 scales per 16, a per-row dynamic alpha); the rows of one
(sequence, KV head) go to the S columns of the variant's qlayout (attention_sm100_geom.q_col),
padding rows are zero codes with scale 0:
    codes  uint8 [B * Hkv, qk_n, D / 2]   (element 0 in the low nibble, formats.pack_fp4)
    sf     uint8 [B * Hkv, 128 x sf_cols]  (E4M3 bytes in the tcgen05 scale-factor atom, the
                                            tile padded to 128 rows)
    fac    float32 [B * Hkv, pv_n]         (alpha_q of head j x k_scale x sm_scale x log2(e):
                                            the factor applied after the fold)
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .attention_sm100_geom import KEYS, AttnSm100Geometry, q_col
from .sm100_layout import sf_offset

__all__ = ["query_operand", "query_values", "attention_args", "DecodeAttentionSm100",
           "LOG2E"]

LOG2E = 1.4426950408889634


def query_values(q: torch.Tensor, g: AttnSm100Geometry, k_scale: float, sm_scale: float
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q: [B, Hq, D] float -> (unit values float64 [B, Hkv, qk_n, D] of the operand rows,
    E2M1 codes uint8 [B, Hkv, qk_n, D], E4M3 scale bytes uint8 [B, Hkv, qk_n, D / 16],
    fac float32 [B, Hkv, pv_n])."""
    from .. import formats
    from ..reference import quantize_query

    b, hq, d = q.shape
    hkv = hq // g.group
    base, res, alpha = quantize_query(q, scale="row")
    parts = [(base, 0)] + ([(res, 1)] if g.compensation else [])
    vals = torch.zeros(b, hkv, g.qk_n, d, dtype=torch.float64, device=q.device)
    codes = torch.zeros(b, hkv, g.qk_n, d, dtype=torch.uint8, device=q.device)
    sfb = torch.zeros(b, hkv, g.qk_n, d // 16, dtype=torch.uint8, device=q.device)
    for qt, r in parts:
        u = formats.dequantize(qt, apply_global_scale=False).double().reshape(b, hkv, g.group, d)
        c = formats.unpack_fp4(qt.codes).reshape(b, hkv, g.group, d)
        s = qt.scales.view(torch.uint8).reshape(b, hkv, g.group, d // 16)
        for j in range(g.group):
            col = q_col(j, r, g.qlayout, g.qk_n)
            vals[:, :, col], codes[:, :, col], sfb[:, :, col] = u[:, :, j], c[:, :, j], s[:, :, j]
    fac = torch.zeros(b, hkv, g.pv_n, dtype=torch.float32, device=q.device)
    a = alpha.reshape(b, hkv, g.group).double()
    fac[:, :, :g.group] = (a * float(k_scale) * sm_scale * LOG2E).float()
    return vals, codes, sfb, fac


def query_operand(q: torch.Tensor, g: AttnSm100Geometry, k_scale: float, sm_scale: float
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's query inputs (codes, sf, fac; see the module docstring)."""
    from .. import formats

    b, hq, d = q.shape
    hkv = hq // g.group
    _, codes, sfb, fac = query_values(q, g, k_scale, sm_scale)
    packed = formats.pack_fp4(codes.reshape(b * hkv, g.qk_n, d))
    sf = torch.zeros(b * hkv, 128 * g.sf_cols, dtype=torch.uint8, device=q.device)
    r = torch.arange(g.qk_n).repeat_interleave(d // 16)
    col = torch.arange(d // 16).repeat(g.qk_n)
    off = sf_offset(r, col, g.sf_cols).to(q.device)
    sf[:, off] = sfb.reshape(b * hkv, -1)
    return packed.contiguous(), sf, fac.reshape(b * hkv, g.pv_n).contiguous()


def attention_args() -> list[Any]:
    """cute.compile arguments of the template's entry, in DecodeAttentionSm100's call order:
    k_codes, k_sf, v_codes, v_sf, q codes, q sf (uint8), fac (float32), block tables, sequence
    lengths (int32), out (bf16), workspace (float32), counters (int32), v_scale, batch, KV
    heads, block-table stride, splits, tiles (not read), reserved (not read), stream."""
    import cuda.bindings.driver as cuda
    import cutlass
    from cutlass.cute.runtime import make_ptr

    import cutlass.cute as cute

    gm = cute.AddressSpace.gmem
    u8 = cutlass.Uint8
    return [make_ptr(u8, 0, gm, 16), make_ptr(u8, 0, gm, 16), make_ptr(u8, 0, gm, 16),
            make_ptr(u8, 0, gm, 16), make_ptr(u8, 0, gm, 16), make_ptr(u8, 0, gm, 16),
            make_ptr(cutlass.Float32, 0, gm, 16), make_ptr(cutlass.Int32, 0, gm, 4),
            make_ptr(cutlass.Int32, 0, gm, 4), make_ptr(cutlass.BFloat16, 0, gm, 16),
            make_ptr(cutlass.Float32, 0, gm, 16), make_ptr(cutlass.Int32, 0, gm, 4),
            cutlass.Float32(1.0), cutlass.Int32(1), cutlass.Int32(1), cutlass.Int32(1),
            cutlass.Int32(1), cutlass.Int32(1), cutlass.Int32(0), cuda.CUstream(0)]


class DecodeAttentionSm100:
    """op(q, cache, block_tables, seq_lens, out=None, sm_scale=None): q bf16 [B, Hq, D] ->
    bf16 [B, Hq, D]; the query operand in torch (query_operand), then the compiled kernel
    (its split reduction inside: lastcta, or the combine kernel launched by the same entry).
    Never run (no Blackwell GPU here)."""

    def __init__(self, compiled: Any, geom: AttnSm100Geometry, splits: int) -> None:
        self.compiled, self.g, self.splits = compiled, geom, max(1, int(splits))
        self._ws: dict = {}

    def workspace(self, batch: int, kv_heads: int, device: torch.device):
        """(partials float32 [B Hkv splits, pv_n, D + 2], counters int32 [B Hkv], zeroed)."""
        key = (batch, kv_heads, str(device))
        if key not in self._ws:
            n = batch * kv_heads
            self._ws[key] = (torch.zeros(n * self.splits * self.g.pv_n * (self.g.head_dim + 2),
                                         dtype=torch.float32, device=device),
                             torch.zeros(n, dtype=torch.int32, device=device))
        return self._ws[key]

    def __call__(self, q, cache, block_tables, seq_lens, out=None, sm_scale=None):
        b, hq, d = q.shape
        hkv = cache.num_kv_heads
        scale = sm_scale if sm_scale is not None else d ** -0.5
        codes, sf, fac = query_operand(q.float(), self.g, float(cache.k_scale), scale)
        if out is None:
            out = torch.empty(b, hq, d, dtype=torch.bfloat16, device=q.device)
        ws, cnt = self.workspace(b, hkv, q.device)
        self.compiled(cache.k_codes.data_ptr(), cache.k_sf.data_ptr(),
                      cache.v_codes.data_ptr(), cache.v_sf.data_ptr(), codes.data_ptr(),
                      sf.data_ptr(), fac.data_ptr(), block_tables.data_ptr(),
                      seq_lens.data_ptr(), out.data_ptr(), ws.data_ptr(), cnt.data_ptr(),
                      float(cache.v_scale), b, hkv, block_tables.shape[1], self.splits,
                      math.ceil(block_tables.shape[1] * cache.page_size / KEYS), 0,
                      torch.cuda.current_stream().cuda_stream)
        return out
