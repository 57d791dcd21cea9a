"""CPU emulation of the sm_90a ResAttn decode kernel's data path, lane by lane.

The emulator evaluates exactly what each of the 32 lanes of a warp holds: the bytes a lane
loads (its addresses come from resgen.kernels.attention_sm90_maps, the same functions the
template uses), the E2M1 -> f16 bit decode and prmt byte moves on 32-bit words, the f16 scale
multiplies, the probability exchange between lanes, and the online softmax in FP32. Matrix
products are formed the way mma.sync defines them: the fragments of all lanes are assembled
into A, B, C by the PTX fragment layout (an independent definition, written out below) and
multiplied exactly. If a map were inconsistent (a query dim paired with the wrong key dim, a
probability sent to the wrong slot), the result would not match resgen.reference, which is
what tests/test_attention_sm90.py checks.

It is slow (Python loops over CTAs, warps and chunks); use it on small problems.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .. import formats
from ..kvcache import PagedKVCache
from ..reference import query_fp16, quantize_query
from . import attention_sm90_maps as M

__all__ = ["EmuConfig", "emulate_decode_attention", "prmt", "decode_k_word", "decode_v_pair",
           "f16x2_values", "FP8_P_SCALE", "LOG2E"]

LOG2E = 1.4426950408889634
FP8_P_SCALE = 256.0          # probabilities are scaled by 2^8 before E4M3 rounding
_LANE = torch.arange(32)
_G = _LANE >> 2
_T = _LANE & 3


@dataclass(frozen=True)
class EmuConfig:
    """The variant fields that change the data path (see resgen.search.attention_sm90)."""

    compensation: bool = True
    packing: str = "pair"        # "pair" | "dense" | "stack"
    pv: str = "f16"              # "f16" | "fp8"
    num_warps: int = 4
    num_splits: int = 1
    kc: int = 32                 # keys per chunk (16 or 32)
    query: str = "nvfp4"         # "nvfp4" (query split) | "q16" (FP16 query, dense, plain)

    def __post_init__(self) -> None:
        if self.query not in ("nvfp4", "q16"):
            raise ValueError(f"query must be 'nvfp4' or 'q16', got {self.query!r}")
        if self.query == "q16" and (self.compensation or self.packing != "dense"):
            raise ValueError("query='q16' runs with compensation=False and packing='dense'")


# ----------------------------------------------------------------------------- 32-bit words


def _words(b: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 4n] -> int64 [..., n] little-endian 32-bit words."""
    x = b.to(torch.int64).reshape(*b.shape[:-1], -1, 4)
    return x[..., 0] | (x[..., 1] << 8) | (x[..., 2] << 16) | (x[..., 3] << 24)


def prmt(a: torch.Tensor, b: torch.Tensor, sel: int) -> torch.Tensor:
    """PTX prmt.b32 (default mode): byte k of the result is byte sel[4k+2:4k] of {b, a}."""
    out = torch.zeros_like(a)
    for k in range(4):
        s = (sel >> (4 * k)) & 0xF
        if s & 8:
            raise ValueError("sign-replicating selectors are not used by the kernel")
        src = a if s < 4 else b
        out |= ((src >> (8 * (s & 3))) & 0xFF) << (8 * k)
    return out


def _f16_of_bits(x: torch.Tensor) -> torch.Tensor:
    x = x & 0xFFFF
    return torch.where(x >= 32768, x - 65536, x).to(torch.int16).view(torch.float16)


def _bits_of_f16(v: torch.Tensor) -> torch.Tensor:
    return v.to(torch.float16).view(torch.int16).to(torch.int64) & 0xFFFF


def f16x2_values(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """f16x2 word -> (low, high) as float32 (exact)."""
    return _f16_of_bits(w).float(), _f16_of_bits(w >> 16).float()


def _pack_f16x2(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """cvt.rn.f16x2.f32: round each FP32 value to f16 (nearest even)."""
    return _bits_of_f16(lo) | (_bits_of_f16(hi) << 16)


def _hmul2(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """mul.rn.f16x2: the FP32 product of two f16 is exact, so one rounding to f16 = IEEE."""
    alo, ahi = f16x2_values(a)
    blo, bhi = f16x2_values(b)
    return _pack_f16x2(alo * blo, ahi * bhi)


def _e4m3_to_f16x2(lo_byte: torch.Tensor, hi_byte: torch.Tensor) -> torch.Tensor:
    """cvt.rn.f16x2.e4m3x2 (exact: every E4M3 value is an f16 normal)."""
    def val(x):
        return (x & 0xFF).to(torch.uint8).view(torch.float8_e4m3fn).float()
    return _pack_f16x2(val(lo_byte), val(hi_byte))


def _e4m3_bytes(v: torch.Tensor) -> torch.Tensor:
    """cvt.rn.satfinite.e4m3 of float values -> bytes (int64)."""
    c = torch.clamp(v, -formats.E4M3_MAX, formats.E4M3_MAX).to(torch.float8_e4m3fn)
    return c.view(torch.uint8).to(torch.int64)


def _e4m3_value(byte: torch.Tensor) -> torch.Tensor:
    return (byte & 0xFF).to(torch.uint8).view(torch.float8_e4m3fn).float()


_F16_128 = 0x58005800          # f16x2 (128, 128)
_F16_2P14 = 0x74007400         # f16x2 (2^14, 2^14)


def decode_k_word(w: torch.Tensor) -> list[torch.Tensor]:
    """Word of 8 E2M1 codes -> R0..R3 f16x2 words of E2M1 x 2^-14 (dims per M.K_WORD_REGS)."""
    h = (M.h_even(w), M.h_odd(w))
    zero = torch.zeros_like(w)
    return [prmt(h[odd], zero, M.sel_f16_pair(lo, hi)) for odd, lo, hi in M.K_WORD_REGS]


def decode_v_pair(wa: torch.Tensor, wb: torch.Tensor) -> list[torch.Tensor]:
    """Words of keys a and b (same 8 dims) -> 8 f16x2 words (key a low, key b high) for word
    dims 0..7 in order, values E2M1 x 2^-14."""
    out = []
    zero = torch.zeros_like(wa)
    for sel in M.V_INTERLEAVE:
        x = prmt(wa, wb, sel)
        h = (M.h_even(x), M.h_odd(x))
        out += [prmt(h[odd], zero, M.sel_f16_pair(lo, hi)) for odd, lo, hi in M.V_PAIR_REGS]
    return out


# ----------------------------------------------------------------------------- mma.sync


def _fill_pairs(mat, rows, cols, words, lo_hi=f16x2_values):
    lo, hi = lo_hi(words)
    mat[rows, cols] = lo.double()
    mat[rows, cols + 1] = hi.double()


def _mma_f16(a: list, b: list, c: torch.Tensor) -> torch.Tensor:
    """m16n8k16 f16 -> f32. a: 4 x [32] f16x2 words, b: 2 x [32], c: [32, 4] f32."""
    A = torch.zeros(16, 16, dtype=torch.float64)
    B = torch.zeros(16, 8, dtype=torch.float64)
    g, t = _G, _T
    _fill_pairs(A, g, 2 * t, a[0])
    _fill_pairs(A, g + 8, 2 * t, a[1])
    _fill_pairs(A, g, 2 * t + 8, a[2])
    _fill_pairs(A, g + 8, 2 * t + 8, a[3])
    lo, hi = f16x2_values(b[0])
    B[2 * t, g], B[2 * t + 1, g] = lo.double(), hi.double()
    lo, hi = f16x2_values(b[1])
    B[2 * t + 8, g], B[2 * t + 9, g] = lo.double(), hi.double()
    return _mma_out(A @ B, c)


def _mma_out(prod: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    C = torch.zeros(16, 8, dtype=torch.float64)
    g, t = _G, _T
    C[g, 2 * t], C[g, 2 * t + 1] = c[:, 0].double(), c[:, 1].double()
    C[g + 8, 2 * t], C[g + 8, 2 * t + 1] = c[:, 2].double(), c[:, 3].double()
    D = (prod + C).float()
    return torch.stack([D[g, 2 * t], D[g, 2 * t + 1], D[g + 8, 2 * t], D[g + 8, 2 * t + 1]], 1)


def _mma_e4m3(a: list, b: list, c: torch.Tensor) -> torch.Tensor:
    """m16n8k32 e4m3 -> f32. a: 4 x [32] words of 4 E4M3 bytes, b: 2 x [32]."""
    A = torch.zeros(16, 32, dtype=torch.float64)
    B = torch.zeros(32, 8, dtype=torch.float64)
    g, t = _G, _T
    for reg, (r0, k0) in enumerate(((0, 0), (8, 0), (0, 16), (8, 16))):
        for i in range(4):
            A[g + r0, 4 * t + k0 + i] = _e4m3_value(a[reg] >> (8 * i)).double()
    for reg, k0 in enumerate((0, 16)):
        for i in range(4):
            B[4 * t + k0 + i, g] = _e4m3_value(b[reg] >> (8 * i)).double()
    return _mma_out(A @ B, c)


# ----------------------------------------------------------------------------- one CTA


def _query_operands(qrows: torch.Tensor, group: int, cfg: EmuConfig, d: int):
    """In-kernel query split: f16 operand columns Qs [ncol, d] and per-head alpha [8 x ntiles].
    Q16: the FP16 query columns and their power-of-two row scales (query_stage_q16)."""
    if cfg.query == "q16":
        q16, scale = query_fp16(qrows.float())
        qs = torch.zeros(8 * M.n_qk_tiles(group, "dense"), d)
        alphas = torch.zeros(8)
        for head in range(group):
            qs[M.qk_col(head, 0, "dense")] = q16[head]
            alphas[head] = scale[head, 0]
        return qs, alphas
    base, res, alpha = quantize_query(qrows.float()[None], scale="row")
    bu = formats.dequantize(base, apply_global_scale=False)[0]
    ru = formats.dequantize(res, apply_global_scale=False)[0]
    nt = M.n_qk_tiles(group, cfg.packing)
    qs = torch.zeros(8 * nt, d)
    for i in range(nt):
        for c in range(8):
            head, kind = M.qk_col_head(i, c, cfg.packing)
            if head < group and (kind == 0 or cfg.compensation):
                qs[8 * i + c] = (bu if kind == 0 else ru)[head]
    alphas = torch.zeros(8)
    alphas[:group] = alpha[0, :, 0]
    assert torch.equal(qs.half().float(), qs), "query operands must be exact in f16"
    return qs, alphas


def _b_frags(qs: torch.Tensor, i: int, kk: int, d: int) -> list[torch.Tensor]:
    g, t = _G, _T
    regs = []
    for s0 in (2 * t, 2 * t + 8):
        lo = qs[8 * i + g, M.k_slot_dim(kk, s0, d)]
        hi = qs[8 * i + g, M.k_slot_dim(kk, s0 + 1, d)]
        regs.append(_pack_f16x2(lo, hi))
    return regs


def _warp(cache, h, phys_of, seq_len, q0, end, warp, cfg, qs, alphas, qk_scale, d, group):
    """One warp's online softmax over its chunks -> (m [R], l [R] per lane, O frags)."""
    kc, nw = cfg.kc, cfg.num_warps
    nt = M.n_qk_tiles(group, cfg.packing)
    na = M.n_acc_tiles(group, cfg.packing)
    nr = M.n_score_regs(group, cfg.packing)
    ks = d // 16
    mts = d // 16
    g, t = _G, _T
    m = torch.full((nr, 32), -math.inf)
    l = torch.zeros(nr, 32)
    o = torch.zeros(mts, 32, 4)
    cscale = [alphas[M.score_head(t, r, cfg.packing)].float() * qk_scale for r in range(nr)]
    bq = {(i, kk): _b_frags(qs, i, kk, d) for i in range(nt) for kk in range(ks)}
    count = M.warp_chunks(q0, end, warp, nw)
    kcodes, ksf = cache.k_codes, cache.k_sf.view(torch.uint8)
    vcodes, vsf = cache.v_codes, cache.v_sf.view(torch.uint8)
    for c in range(max(0, count)):
        q = q0 + warp + nw * c
        page = (q * kc) // cache.page_size
        koff = (q * kc) % cache.page_size
        phys = phys_of(page)
        kbase = koff                                    # key row offset inside the page
        # ---- QK
        s_lo = [[None] * (kc // 16) for _ in range(nr)]
        s_hi = [[None] * (kc // 16) for _ in range(nr)]
        for z in range(kc // 16):
            dec = []
            for key in M.k_lane_keys(g, z):
                col0 = M.k_lane_dims(t, d) // 2                     # byte offset in the row
                lane_bytes = kcodes[phys, h][(kbase + key)[:, None],
                                             col0[:, None] + torch.arange(d // 8)]
                words = _words(lane_bytes)                          # [32, d/32]
                nsb = max(1, d // 64)
                sbytes = ksf[phys, h][(kbase + key)[:, None],
                                      (t * (d // 64))[:, None] + torch.arange(nsb)]
                sbytes = sbytes.to(torch.int64)
                per_word = []
                for u in range(d // 32):
                    sb = sbytes[:, u >> 1]
                    scale = _hmul2(_e4m3_to_f16x2(sb, sb), torch.full_like(sb, _F16_128))
                    per_word.append([_hmul2(r_, scale) for r_ in decode_k_word(words[:, u])])
                dec.append(per_word)
            for i in range(na):
                acc = torch.zeros(32, 4)
                acc_r = torch.zeros(32, 4)              # stack: the residue products' chain
                for kk in range(ks):
                    u, v = kk >> 1, kk & 1
                    a = [dec[0][u][2 * v], dec[1][u][2 * v], dec[0][u][2 * v + 1],
                         dec[1][u][2 * v + 1]]
                    acc = _mma_f16(a, bq[(i, kk)], acc)
                    if cfg.packing == "stack":
                        acc_r = _mma_f16(a, bq[(na + i, kk)], acc_r)
                if cfg.packing == "stack":              # FP32 fold, as the kernel
                    acc = acc + acc_r
                if cfg.packing == "pair":
                    s_lo[i][z] = acc[:, 0] + acc[:, 1]
                    s_hi[i][z] = acc[:, 2] + acc[:, 3]
                else:
                    for r in range(2):
                        s_lo[r][z] = acc[:, r]
                        s_hi[r][z] = acc[:, 2 + r]
        # ---- online softmax (FP32, scores in log2 units)
        p_lo = [[None] * (kc // 16) for _ in range(nr)]
        p_hi = [[None] * (kc // 16) for _ in range(nr)]
        alpha_r = []
        for r in range(nr):
            mx = torch.full((32,), -math.inf)
            for z in range(kc // 16):
                for arr, off in ((s_lo, 0), (s_hi, 8)):
                    key = q * kc + 16 * z + g + off
                    val = torch.where(key < seq_len, arr[r][z] * cscale[r],
                                      torch.tensor(-math.inf))
                    arr[r][z] = val
                    mx = torch.maximum(mx, val)
            mx = mx.reshape(8, 4).amax(0).repeat(8)                 # butterfly over g
            m_new = torch.maximum(m[r], mx)
            a_r = torch.exp2(m[r] - m_new)
            tot = torch.zeros(32)
            for z in range(kc // 16):
                p_lo[r][z] = torch.exp2(s_lo[r][z] - m_new)
                p_hi[r][z] = torch.exp2(s_hi[r][z] - m_new)
                tot = tot + p_lo[r][z] + p_hi[r][z]
            l[r] = l[r] * a_r + tot
            m[r] = m_new
            alpha_r.append(a_r)
        for r in range(nr):
            o[:, :, r] *= alpha_r[r]
            o[:, :, 2 + r] *= alpha_r[r]
        # ---- V
        vkeys = M.v_lane_keys(t, kc)                                # kc/4 x [32]
        vw, vs = [], []
        for key in vkeys:
            rows = (kbase + key)[:, None]
            lane_bytes = vcodes[phys, h][rows, (g * (d // 16))[:, None] + torch.arange(d // 16)]
            vw.append(_words(lane_bytes))                           # [32, d/64]
            valid = (q * kc + key) < seq_len
            blocks = []
            for u in range(d // 64):
                blk = ((d // 8) * g + 8 * u) // 16
                sb = vsf[phys, h][kbase + key, blk].to(torch.int64)
                blocks.append(torch.where(valid, sb, torch.zeros_like(sb)))
            vs.append(blocks)
        src_lo, src_hi = M.p_source_lanes(g, t)
        rsel = g & 1
        if cfg.pv == "f16":
            for z in range(kc // 16):
                xs = [_pack_f16x2(p_lo[r][z], p_hi[r][z]) for r in range(nr)]
                b = []
                for src in (src_lo, src_hi):
                    got = xs[0][src]
                    if nr == 2:
                        got = torch.where(rsel == 1, xs[1][src], got)
                    else:
                        got = torch.where(rsel == 1, torch.zeros_like(got), got)
                    b.append(got)
                pairs = []
                for ja, jb in ((4 * z, 4 * z + 2), (4 * z + 1, 4 * z + 3)):
                    regs = []
                    for u in range(vw[ja].shape[1]):
                        sc = _hmul2(_e4m3_to_f16x2(vs[ja][u], vs[jb][u]),
                                    torch.full_like(vs[ja][u], _F16_128))
                        regs += [_hmul2(x, sc) for x in decode_v_pair(vw[ja][:, u], vw[jb][:, u])]
                    pairs.append(regs)
                for mt in range(mts):
                    a = [pairs[0][2 * mt], pairs[0][2 * mt + 1], pairs[1][2 * mt],
                         pairs[1][2 * mt + 1]]
                    o[mt] = _mma_f16(a, b, o[mt])
        else:
            xs = []
            for r in range(nr):
                byts = [_e4m3_bytes(p * FP8_P_SCALE) for p in
                        (p_lo[r][0], p_hi[r][0], p_lo[r][1], p_hi[r][1])]
                xs.append(byts[0] | (byts[1] << 8) | (byts[2] << 16) | (byts[3] << 24))
            b = []
            for src in (src_lo, src_hi):
                got = xs[0][src]
                got = torch.where(rsel == 1, xs[1][src] if nr == 2 else torch.zeros_like(got), got)
                b.append(got)
            # A regs: per dim, bytes of keys j = (0, 2, 4, 6) (reg0/1) and (1, 3, 5, 7) (reg2/3)
            dims = {}
            for jset in ((0, 2, 4, 6), (1, 3, 5, 7)):
                per_dim = None
                for pa, pb in ((jset[0], jset[1]), (jset[2], jset[3])):
                    regs = []
                    for u in range(vw[pa].shape[1]):
                        sc = _e4m3_to_f16x2(vs[pa][u], vs[pb][u])
                        for x in decode_v_pair(vw[pa][:, u], vw[pb][:, u]):
                            exact = _hmul2(_hmul2(x, torch.full_like(x, _F16_2P14)), sc)
                            lo, hi = f16x2_values(exact)
                            regs.append(_e4m3_bytes(lo) | (_e4m3_bytes(hi) << 8))
                    per_dim = regs if per_dim is None else [x | (y << 16) for x, y in
                                                            zip(per_dim, regs)]
                dims[jset[0]] = per_dim
            for mt in range(mts):
                a = [dims[0][2 * mt], dims[0][2 * mt + 1], dims[1][2 * mt], dims[1][2 * mt + 1]]
                o[mt] = _mma_e4m3(a, b, o[mt])
    return m, l, o


def _warp_partials(m, l, o, d, group, cfg):
    """Per head: (m, l summed over lanes, O [d]) of one warp, from the lane fragments."""
    nr = m.shape[0]
    g, t = _G, _T
    heads = {}
    for r in range(nr):
        for tt in range(4):
            head = int(M.score_head(tt, r, cfg.packing))
            if head >= group:
                continue
            sel = t == tt
            mh = m[r][sel][0]
            assert torch.all(m[r][sel] == mh)
            lh = l[r][sel].sum()
            od = torch.zeros(d)
            for mt in range(d // 16):
                for row_off, ci in ((0, r), (8, 2 + r)):
                    dims = M.v_row_dim(mt, g[sel] + row_off, d)
                    od[dims] = o[mt, sel, ci]
            heads[head] = (mh, lh, od)
    return heads


def _combine(parts):
    """[(m, l, O)] -> (m*, l, O) with m = -inf parts contributing nothing."""
    ms = torch.stack([p[0] for p in parts])
    mstar = ms.max()
    lt = torch.zeros(())
    ot = torch.zeros_like(parts[0][2])
    for mw, lw, ow in parts:
        f = torch.tensor(0.0) if mw == -math.inf else torch.exp2(mw - mstar)
        lt = lt + lw * f
        ot = ot + ow * f
    return mstar, lt, ot


def emulate_decode_attention(q: torch.Tensor, cache: PagedKVCache, block_tables: torch.Tensor,
                             seq_lens: torch.Tensor, cfg: EmuConfig = EmuConfig(),
                             sm_scale: float | None = None) -> torch.Tensor:
    """What the kernel computes, before its final BF16 rounding.

    q: [B, Hq, D] (bf16 values); returns float32 [B, Hq, D]; empty sequences give zeros.
    """
    bsz, hq, d = q.shape
    hkv = cache.num_kv_heads
    group = hq // hkv
    scale = sm_scale if sm_scale is not None else d ** -0.5
    # host-side constant: sm_scale * log2(e) * 2^7 (the 2^7 undoes the K decode's 2^-7)
    qk_host = torch.tensor(scale * LOG2E * 128.0, dtype=torch.float32)
    qk_scale = cache.k_scale.float() * qk_host
    out = torch.zeros(bsz, hq, d)
    for b in range(bsz):
        n = int(seq_lens[b])
        for h in range(hkv):
            qs, alphas = _query_operands(q[b, h * group:(h + 1) * group], group, cfg, d)
            split_parts = {j: [] for j in range(group)}
            for s in range(cfg.num_splits):
                q0, q1, nch = M.chunk_range(n, s, cfg.num_splits, cache.page_size, cfg.kc)
                end = min(q1, nch)
                warp_parts = {j: [] for j in range(group)}
                for w in range(cfg.num_warps):
                    m, l, o = _warp(cache, h, lambda p: int(block_tables[b, p]), n, q0, end, w,
                                    cfg, qs, alphas, qk_scale, d, group)
                    for head, part in _warp_partials(m, l, o, d, group, cfg).items():
                        warp_parts[head].append(part)
                for j in range(group):
                    split_parts[j].append(_combine(warp_parts[j]))
            for j in range(group):
                _, lt, ot = _combine(split_parts[j])
                if float(lt) > 0:
                    post = 128.0 if cfg.pv == "f16" else 1.0 / FP8_P_SCALE
                    out[b, h * group + j] = ot * (cache.v_scale.float() * post / lt)
    return out
