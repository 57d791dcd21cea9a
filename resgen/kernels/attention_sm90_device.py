"""Device helpers of the sm_90a ResAttn decode and KV-append kernels (CuTe DSL, trace time).

Everything here runs while CuTe DSL traces a `@cute.kernel` body and emits straight-line code:
Python loops unroll, Python lists are register arrays indexed only by constants. Dynamic control
flow (the chunk loop, the epilogue branches) lives in the kernel bodies of the templates
resgen/templates/attention_sm90.py.j2 and kv_append_sm90.py.j2; the index maps come from
resgen.kernels.attention_sm90_maps, shared with the CPU emulator that proves them.

Numerics (hardware facts this relies on)
- E2M1 -> f16 by bit placement: per byte, h = s << 7 | (e1 e0 m) << 1 is the high byte of the
  f16 E2M1 x 2^-14 (code 1 = 0.5 becomes the subnormal 2^-15); prmt with a zero operand puts it
  into an f16x2 half. One mul.rn.f16x2 by (sf x 2^7) gives E2M1 x sf x 2^-7 exactly (<= 5
  significant bits, >= 2^-17 which f16 subnormals hold exactly; PTX f16 mul keeps subnormals
  without .ftz). E4M3 scales convert exactly with cvt.rn.f16x2.e4m3x2 (sm_89+).
- mma.sync f16 x f16 products are exact in FP32, so QK reproduces the reference up to FP32
  summation order; the 2^7 is folded into the score scale, the PV 2^7 into the epilogue.
- Scores live in log2 units (x log2 e), exp2 is ex2.approx.ftz.f32 (-inf -> +0).
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
from cutlass import Float32, Int32, Int64, Uint32
from cutlass.cutlass_dsl import select_
import cutlass.cute as cute

from . import attention_sm90_maps as M
from . import fp4_device as F4
from . import sm90_ptx as P
from .sm90_ptx import _as_f32 as _f32
from .sm90_ptx import _as_i32 as _i32
from .sm90_ptx import _as_i64 as _i64
from .sm90_ptx import _as_u32 as _u32

__all__ = ["AttnCfg", "LOG2E", "F16X2_128", "F16X2_2P14", "FP8_P_SCALE"]

LOG2E = 1.4426950408889634
F16X2_128 = 0x58005800        # (128, 128)
F16X2_2P14 = 0x74007400       # (2^14, 2^14)
FP8_P_SCALE = 256.0
NEG_INF = float("-inf")


@dataclass(frozen=True)
class AttnCfg:
    """Compile-time shape of one decode-attention kernel (rendered into the template)."""

    head_dim: int
    group: int
    page_size: int
    num_warps: int
    kc: int
    compensation: bool
    packing: str
    pv: str
    reduction: str
    prefetch: bool = False

    @property
    def nt(self) -> int:            # QK n8 tiles
        return M.n_qk_tiles(self.group, self.packing)

    @property
    def na(self) -> int:            # QK n8 accumulator tiles (stack: 2 operand tiles -> 1)
        return M.n_acc_tiles(self.group, self.packing)

    @property
    def nr(self) -> int:            # score registers per lane
        return M.n_score_regs(self.group, self.packing)

    @property
    def ks(self) -> int:            # QK k16 steps
        return self.head_dim // 16

    @property
    def mts(self) -> int:           # PV m16 tiles (head dims)
        return self.head_dim // 16

    @property
    def ncol(self) -> int:
        return 8 * self.nt

    @property
    def zt(self) -> int:            # 16-key tiles per chunk
        return self.kc // 16

    @property
    def threads(self) -> int:
        return 32 * self.num_warps


# ----------------------------------------------------------------------------- warp and select
# (the inline PTX these kernels emit is resgen.kernels.sm90_ptx's)


def shfl_idx(v, src):
    return cute.arch.shuffle_sync(v, offset=src)


def bfly_max(v, offsets=(4, 8, 16)) -> Float32:
    for off in offsets:
        v = P.fmax(v, cute.arch.shuffle_sync_bfly(v, offset=off))
    return v


def bfly_sum(v, offsets=(4, 8, 16)) -> Float32:
    for off in offsets:
        v = v + cute.arch.shuffle_sync_bfly(v, offset=off)
    return v


def imin(a, b):
    """min of two integers (DSL or Python)."""
    if isinstance(a, int) and isinstance(b, int):
        return min(a, b)
    return cutlass.min(a, b)


def imax(a, b):
    if isinstance(a, int) and isinstance(b, int):
        return max(a, b)
    return cutlass.max(a, b)


def sel_f32(p, a, b) -> Float32:
    return Float32(select_(p, _f32(a), _f32(b)))


def sel_u32(p, a, b) -> Uint32:
    return Uint32(select_(p, _u32(a), _u32(b)))


# ----------------------------------------------------------------------------- query split


def zero_fill_smem(base, nbytes: int, tid, threads: int) -> None:
    """All threads of the CTA clear nbytes (multiple of 4) of shared memory from base."""
    words = nbytes // 4
    for i in range((words + threads - 1) // threads):
        idx = tid + threads * i
        P.sts_u32_if(idx < words, base + idx * 4, 0)


def query_split(cfg: AttnCfg, q_group_addr, warp, lane, qs, alpha_s) -> None:
    """Quantize the GQA group's query rows into FP4 base (+ residue) operand columns.

    q_group_addr: Int64 address of the group's first bf16 row [G, D]; qs: shared [ncol, D]
    f16 operand values (value x block scale, exact), alpha_s: shared f32 per head. Each warp
    takes rows warp, warp + W, ...; lane holds D/32 consecutive dims, a 16-block spans
    16 / (D/32) lanes. Shared memory must be zero-filled first (absent columns stay zero).
    """
    d = cfg.head_dim
    per = d // 32
    lanes = 16 // per
    for i in range((cfg.group + cfg.num_warps - 1) // cfg.num_warps):
        j = warp + cfg.num_warps * i
        valid = j < cfg.group
        jj = imin(j, cfg.group - 1) if cfg.group > 1 else Int32(0)
        words = P.ld_nc_bytes(q_group_addr + Int64(jj) * (2 * d) + Int64(lane) * (2 * per),
                            2 * per)
        xs = []
        for w in words:
            lo, hi = F4.bf16x2_to_f32(w)
            xs += [lo, hi]
        amax = F4.group_max(F4.abs_max(xs), 32)
        alpha = F4.nvfp4_tensor_scale(amax)
        base = F4.quantize_block(xs, "nvfp4", alpha, lanes)
        cols = [(0, F4.operand_values(base))]
        if cfg.compensation:
            res = F4.quantize_block(F4.residues(xs, base), "nvfp4", alpha, lanes)
            cols.append((1, F4.operand_values(res)))
        for kind, vals in cols:
            col = M.qk_col(jj, kind, cfg.packing)
            row = qs + (col * d + lane * per) * 2
            for e in range(0, per, 2):
                P.sts_u32_if(valid, row + e * 2, P.pack_f16x2(vals[e], vals[e + 1]))
        P.sts_f32_if(valid & (lane == 0), alpha_s + jj * 4, alpha)


def load_q_frags(cfg: AttnCfg, qs, g, t) -> list:
    """B fragments of Q^T for every (n-tile, k-step): [nt][ks] -> (b0b1, b2b3)."""
    d = cfg.head_dim
    out = []
    for i in range(cfg.nt):
        row = qs + (8 * i + g) * (2 * d)
        per_k = []
        for kk in range(cfg.ks):
            regs = []
            for s0 in (2 * t, 2 * t + 8):
                lo = P.lds_u16(row + M.k_slot_dim(kk, s0, d) * 2)
                hi = P.lds_u16(row + M.k_slot_dim(kk, s0 + 1, d) * 2)
                regs.append(lo | (hi << 16))
            per_k.append(regs)
        out.append(per_k)
    return out


# ----------------------------------------------------------------------------- chunk data


def load_chunk(cfg: AttnCfg, kc_ptr, ksf_ptr, vc_ptr, vsf_ptr, row0, g, t):
    """Raw bytes of one chunk for this lane. row0: Int64 cache row (page * Hkv + h) * P + off.

    Returns (kw, ks, vw, vs): kw[z][rr] words of K row 16z+g+8rr (D/32 words), ks[z][rr] its
    scale word (D/64 bytes); vw[j] words of V row t+4j (D/64 words), vs[j] its scale word.
    """
    d = cfg.head_dim
    kw, ksc = [], []
    for z in range(cfg.zt):
        rows_w, rows_s = [], []
        for key in M.k_lane_keys(g, z):
            r = row0 + Int64(key)
            rows_w.append(P.ld_nc_bytes(kc_ptr + r * (d // 2) + Int64(M.k_lane_dims(t, d) // 2),
                                      d // 8))
            rows_s.append(P.ld_nc_bytes(ksf_ptr + r * (d // 16) + Int64(t * (d // 64)),
                                      max(1, d // 64))[0])
        kw.append(rows_w)
        ksc.append(rows_s)
    vw, vsc = [], []
    vsb = 2 if d == 256 else 1          # V scale bytes per lane and key
    voff = (g >> 1) if d == 64 else g * (d // 128)
    for key in M.v_lane_keys(t, cfg.kc):
        r = row0 + Int64(key)
        vw.append(P.ld_nc_bytes(vc_ptr + r * (d // 2) + Int64(g * (d // 16)), d // 16))
        vsc.append(P.ld_nc_bytes(vsf_ptr + r * (d // 16) + Int64(voff), vsb)[0])
    return kw, ksc, vw, vsc


def chunk_loc(cfg: AttnCfg, bt_row, q0, warp, c, count):
    """(physical page, key offset in the page) of the warp's chunk c, clamped to
    [0, count - 1]; (0, 0) when the warp has no chunk (a safe address that is never used)."""
    ok = count > 0
    cc = imax(imin(c, count - 1), 0)
    key0 = sel_i32(ok, (q0 + warp + cfg.num_warps * cc) * cfg.kc, 0)
    phys = sel_i32(ok, P.ld_global_s32(bt_row + Int64(key0 // cfg.page_size) * 4), 0)
    return phys, key0 % cfg.page_size


def chunk_row(cfg: AttnCfg, loc, hkv, h) -> Int64:
    """Cache row (page * Hkv + h) * page_size + offset of a chunk location."""
    phys, koff = loc
    return (Int64(phys) * Int64(hkv) + Int64(h)) * cfg.page_size + Int64(koff)


def flatten_chunk(chunk) -> list:
    """load_chunk's nested lists -> one flat list (loop-carried prefetch buffer)."""
    kw, ksc, vw, vsc = chunk
    return ([w for z in kw for row in z for w in row] + [x for z in ksc for x in z]
            + [w for key in vw for w in key] + list(vsc))


def unflatten_chunk(cfg: AttnCfg, flat) -> tuple:
    d = cfg.head_dim
    nk, nv = d // 32, max(1, d // 64)
    i = 0
    kw = []
    for _ in range(cfg.zt):
        kw.append([flat[i + r * nk: i + (r + 1) * nk] for r in range(2)])
        i += 2 * nk
    ksc = []
    for _ in range(cfg.zt):
        ksc.append([flat[i], flat[i + 1]])
        i += 2
    vw = []
    for _ in range(cfg.kc // 4):
        vw.append(flat[i:i + nv])
        i += nv
    vsc = flat[i:i + cfg.kc // 4]
    return kw, ksc, vw, vsc


def _k_scales(cfg: AttnCfg, sw) -> list:
    """Scale word of one key row -> f16x2 (s x 2^7, s x 2^7) per 16-block the lane covers."""
    d = cfg.head_dim
    out = []
    for pair in range(max(1, d // 128)):
        x = P.mul_f16x2(P.e4m3x2_to_f16x2(sw >> (16 * pair)), F16X2_128)
        out += [P.prmt(x, x, 0x1010, hex_imm=True), P.prmt(x, x, 0x3232, hex_imm=True)]
    return out


def _decode_k_word(w, scale) -> list:
    h = (M.h_even(w), M.h_odd(w))
    return [P.mul_f16x2(P.prmt_zero(h[odd], M.sel_f16_pair(lo, hi)), scale)
            for odd, lo, hi in M.K_WORD_REGS]


def qk_scores(cfg: AttnCfg, kw, ksc, bq) -> tuple[list, list]:
    """Raw (unscaled) folded scores: s_lo[r][z] (key 16z+g), s_hi[r][z] (key 16z+g+8)."""
    s_lo = [[None] * cfg.zt for _ in range(cfg.nr)]
    s_hi = [[None] * cfg.zt for _ in range(cfg.nr)]
    for z in range(cfg.zt):
        dec = []
        for rr in range(2):
            sc = _k_scales(cfg, ksc[z][rr])
            dec.append([_decode_k_word(w, sc[u >> 1]) for u, w in enumerate(kw[z][rr])])
        for i in range(cfg.na):
            acc = [Float32(0.0)] * 4
            acc_r = [Float32(0.0)] * 4          # stack: the residue products' own chain
            for kk in range(cfg.ks):
                u, v = kk >> 1, kk & 1
                a = [dec[0][u][2 * v], dec[1][u][2 * v], dec[0][u][2 * v + 1],
                     dec[1][u][2 * v + 1]]
                acc = list(P.mma_f16_16816(a, bq[i][kk], acc))
                if cfg.packing == "stack":
                    acc_r = list(P.mma_f16_16816(a, bq[cfg.na + i][kk], acc_r))
            if cfg.packing == "stack":          # the fold: base + residue scores, FP32
                acc = [acc[j] + acc_r[j] for j in range(4)]
            if cfg.packing == "pair":
                s_lo[i][z] = acc[0] + acc[1]
                s_hi[i][z] = acc[2] + acc[3]
            else:
                for r in range(2):
                    s_lo[r][z] = acc[r]
                    s_hi[r][z] = acc[2 + r]
    return s_lo, s_hi


def softmax_update(cfg: AttnCfg, s_lo, s_hi, cs, key0, g, seq_len, m, l, o):
    """Online softmax over one chunk (FP32, log2 units). Returns the new (m, l, o) and the
    probabilities p_lo, p_hi [r][z] (the caller must rebind m, l, o: the DSL tracer carries
    loop state through plain local variables only)."""
    m, l, o = list(m), list(l), [list(x) for x in o]
    ninf = Float32(NEG_INF)
    p_lo = [[None] * cfg.zt for _ in range(cfg.nr)]
    p_hi = [[None] * cfg.zt for _ in range(cfg.nr)]
    for r in range(cfg.nr):
        mx = ninf
        for z in range(cfg.zt):
            for arr, off in ((s_lo, 0), (s_hi, 8)):
                ok = (key0 + (16 * z + off) + g) < seq_len
                arr[r][z] = sel_f32(ok, arr[r][z] * cs[r], ninf)
                mx = P.fmax(mx, arr[r][z])
        mx = bfly_max(mx)
        m_new = P.fmax(m[r], mx)
        a_r = P.ex2_approx(m[r] - m_new)
        tot = Float32(0.0)
        for z in range(cfg.zt):
            p_lo[r][z] = P.ex2_approx(s_lo[r][z] - m_new)
            p_hi[r][z] = P.ex2_approx(s_hi[r][z] - m_new)
            tot = tot + p_lo[r][z] + p_hi[r][z]
        l[r] = l[r] * a_r + tot
        m[r] = m_new
        for mt in range(cfg.mts):
            o[mt][r] = o[mt][r] * a_r
            o[mt][2 + r] = o[mt][2 + r] * a_r
    return m, l, o, p_lo, p_hi


def _p_exchange(cfg: AttnCfg, xs, g, t) -> list:
    """Receiver (g, t) gathers its two B registers from lanes p_source_lanes(g, t)."""
    src_lo, src_hi = M.p_source_lanes(g, t)
    odd = (g & 1) == 1
    out = []
    for src in (src_lo, src_hi):
        got = shfl_idx(xs[0], src)
        other = shfl_idx(xs[1], src) if cfg.nr == 2 else Uint32(0)
        out.append(sel_u32(odd, other, got))
    return out


def _v_scale_pair(sa, sb, shift: int, mul) -> Uint32:
    pair = ((sa >> shift) & 0xFF) | (((sb >> shift) & 0xFF) << 8)
    x = P.e4m3x2_to_f16x2(pair)
    return P.mul_f16x2(x, mul) if mul is not None else x


def _decode_v_pair(wa, wb) -> list:
    out = []
    for sel in M.V_INTERLEAVE:
        x = P.prmt(wa, wb, sel, hex_imm=True)
        h = (M.h_even(x), M.h_odd(x))
        out += [P.prmt_zero(h[odd], M.sel_f16_pair(lo, hi)) for odd, lo, hi in M.V_PAIR_REGS]
    return out


def _v_regs(cfg: AttnCfg, vw, vsc, ja, jb, valid_a, valid_b, fp8: bool) -> list:
    """f16x2 (key a low, key b high) for each of the lane's D/8 head dims, scaled:
    f16 path: E2M1 x s x 2^-7;  fp8 path: E2M1 x s (exact f16, the value E4M3 rounds)."""
    d = cfg.head_dim
    sa = sel_u32(valid_a, vsc[ja], Uint32(0))      # masked keys: zero scale, never NaN
    sb = sel_u32(valid_b, vsc[jb], Uint32(0))
    regs = []
    for u in range(len(vw[ja])):
        shift = 8 * (u >> 1) if d == 256 else 0
        sc = _v_scale_pair(sa, sb, shift, None if fp8 else F16X2_128)
        for x in _decode_v_pair(vw[ja][u], vw[jb][u]):
            regs.append(P.mul_f16x2(P.mul_f16x2(x, F16X2_2P14), sc) if fp8 else P.mul_f16x2(x, sc))
    return regs


def pv_update(cfg: AttnCfg, vw, vsc, p_lo, p_hi, key0, g, t, seq_len, o) -> list:
    """O^T += V^T P^T for one chunk; returns the new O^T fragments."""
    o = [list(x) for x in o]
    def valid(j):
        return (key0 + t + 4 * j) < seq_len

    if cfg.pv == "f16":
        for z in range(cfg.zt):
            xs = [P.pack_f16x2(p_lo[r][z], p_hi[r][z]) for r in range(cfg.nr)]
            b = _p_exchange(cfg, xs, g, t)
            ja, jb, jc, jd = 4 * z, 4 * z + 2, 4 * z + 1, 4 * z + 3
            pa = _v_regs(cfg, vw, vsc, ja, jb, valid(ja), valid(jb), False)
            pc = _v_regs(cfg, vw, vsc, jc, jd, valid(jc), valid(jd), False)
            for mt in range(cfg.mts):
                a = [pa[2 * mt], pa[2 * mt + 1], pc[2 * mt], pc[2 * mt + 1]]
                o[mt] = list(P.mma_f16_16816(a, b, o[mt]))
        return o
    # fp8: one k32 step over the 32-key chunk
    xs = []
    for r in range(cfg.nr):
        lo = P.f32x2_to_e4m3x2(p_lo[r][0] * FP8_P_SCALE, p_hi[r][0] * FP8_P_SCALE)
        hi = P.f32x2_to_e4m3x2(p_lo[r][1] * FP8_P_SCALE, p_hi[r][1] * FP8_P_SCALE)
        xs.append(lo | (hi << 16))
    b = _p_exchange(cfg, xs, g, t)
    by_set = []
    for js in ((0, 2, 4, 6), (1, 3, 5, 7)):
        halves = []
        for ja, jb in ((js[0], js[1]), (js[2], js[3])):
            regs = _v_regs(cfg, vw, vsc, ja, jb, valid(ja), valid(jb), True)
            halves.append([P.f16x2_to_e4m3x2(x) for x in regs])
        by_set.append([lo | (hi << 16) for lo, hi in zip(*halves)])
    for mt in range(cfg.mts):
        a = [by_set[0][2 * mt], by_set[0][2 * mt + 1], by_set[1][2 * mt],
             by_set[1][2 * mt + 1]]
        o[mt] = P.mma_e4m3_16832(a, b, o[mt])
    return o


# ----------------------------------------------------------------------------- epilogue


def smem_bytes(cfg: AttnCfg) -> dict[str, int]:
    return M.smem_bytes(cfg.head_dim, cfg.group, cfg.num_warps, cfg.packing)


def store_warp_partials(cfg: AttnCfg, warp, g, t, m, l, o, wm, wl, wo) -> None:
    """Per head: warp's m (uniform over g), l summed over g, and O rows -> shared memory."""
    d = cfg.head_dim
    for r in range(cfg.nr):
        head = M.score_head(t, r, cfg.packing)
        ok = head < cfg.group
        lsum = bfly_sum(l[r])
        slot = (warp * cfg.group + imin(head, cfg.group - 1)) * 4
        P.sts_f32_if(ok & (g == 0), wm + slot, m[r])
        P.sts_f32_if(ok & (g == 0), wl + slot, lsum)
        obase = wo + (warp * cfg.group + imin(head, cfg.group - 1)) * (4 * d)
        for mt in range(cfg.mts):
            for c, row_off in ((r, 0), (2 + r, 8)):
                dim = M.v_row_dim(mt, g + row_off, d)
                P.sts_f32_if(ok, obase + dim * 4, o[mt][c])


def combine(parts) -> tuple:
    """[(m, l, o...)] -> (m*, l, [o...]): rescale to the largest m; m = -inf parts drop out."""
    mstar = parts[0][0]
    for p in parts[1:]:
        mstar = P.fmax(mstar, p[0])
    ninf = Float32(NEG_INF)
    lt = Float32(0.0)
    ot = [Float32(0.0)] * len(parts[0][2])
    for mw, lw, ow in parts:
        f = sel_f32(mw == ninf, Float32(0.0), P.ex2_approx(mw - mstar))
        lt = lt + lw * f
        ot = [a + b * f for a, b in zip(ot, ow)]
    return mstar, lt, ot


def cta_items(cfg: AttnCfg, tid) -> list:
    """(valid, head, dim) pairs this thread combines: 2 adjacent dims per item."""
    n = cfg.group * cfg.head_dim // 2
    per = (n + cfg.threads - 1) // cfg.threads
    out = []
    for i in range(per):
        idx = tid + cfg.threads * i
        ok = idx < n
        idx = imin(idx, n - 1)
        head = idx // (cfg.head_dim // 2)
        dim = (idx % (cfg.head_dim // 2)) * 2
        out.append((ok, head, dim))
    return out


def combine_warps(cfg: AttnCfg, tid, wm, wl, wo) -> list:
    """Combine the warps' partials held in shared memory -> per item (ok, head, dim, m, l,
    (o0, o1))."""
    d = cfg.head_dim
    out = []
    for ok, head, dim in cta_items(cfg, tid):
        parts = []
        for w in range(cfg.num_warps):
            slot = (w * cfg.group + head) * 4
            ob = wo + ((w * cfg.group + head) * d + dim) * 4
            parts.append((P.lds_f32(wm + slot), P.lds_f32(wl + slot),
                          [P.lds_f32(ob), P.lds_f32(ob + 4)]))
        mstar, lt, ot = combine(parts)
        out.append((ok, head, dim, mstar, lt, ot))
    return out


def post_scale(cfg: AttnCfg) -> float:
    """What O / l is multiplied by besides v_scale: 2^7 (f16 V carries 2^-7) or 2^-8 (FP8 P
    carries 2^8)."""
    return 128.0 if cfg.pv == "f16" else 1.0 / FP8_P_SCALE


def write_output(cfg: AttnCfg, group_row, items, vscale) -> None:
    """bf16 output pairs; group_row: Int64 address of the group's first output row. l == 0
    (an empty sequence) gives zeros."""
    for ok, head, dim, mstar, lt, ot in items:
        del mstar
        f = sel_f32(lt > Float32(0.0), vscale * Float32(post_scale(cfg)) / lt, Float32(0.0))
        addr = group_row + Int64(head * (2 * cfg.head_dim) + dim * 2)
        P.st_u32_if(ok, addr, P.pack_bf16x2(ot[0] * f, ot[1] * f))


def write_partial(cfg: AttnCfg, items, ws_o, ws_ml, part) -> None:
    """One split's (O [G, D], m, l [G]) -> workspace row `part` = (batch * Hkv + h) * S + s."""
    for ok, head, dim, mstar, lt, ot in items:
        ob = ws_o + (part * cfg.group + Int64(head)) * (4 * cfg.head_dim) + Int64(dim * 4)
        P.st_f32_if(ok, ob, ot[0])
        P.st_f32_if(ok, ob + 4, ot[1])
        mb = ws_ml + (part * cfg.group + Int64(head)) * 8
        P.st_f32_if(ok & (dim == 0), mb, mstar)
        P.st_f32_if(ok & (dim == 0), mb + 4, lt)


def reduce_init(cfg: AttnCfg, tid) -> list:
    """Streaming split combine: per item [m, l, o0, o1] starting empty."""
    return [[Float32(NEG_INF), Float32(0.0), Float32(0.0), Float32(0.0)]
            for _ in cta_items(cfg, tid)]


def reduce_step(cfg: AttnCfg, state, tid, ws_o, ws_ml, part) -> list:
    """Fold workspace row `part` into the running (m, l, O) of each item (L2 reads)."""
    ninf = Float32(NEG_INF)
    new = []
    for (m0, l0, o0, o1), (ok, head, dim) in zip(state, cta_items(cfg, tid)):
        del ok
        mb = ws_ml + (part * cfg.group + Int64(head)) * 8
        ob = ws_o + (part * cfg.group + Int64(head)) * (4 * cfg.head_dim) + Int64(dim * 4)
        mw, lw = P.ld_cg_f32(mb), P.ld_cg_f32(mb + 4)
        w0, w1 = P.ld_cg_f32(ob), P.ld_cg_f32(ob + 4)
        mn = P.fmax(m0, mw)
        f_old = sel_f32(m0 == ninf, Float32(0.0), P.ex2_approx(m0 - mn))
        f_new = sel_f32(mw == ninf, Float32(0.0), P.ex2_approx(mw - mn))
        new.append([mn, l0 * f_old + lw * f_new, o0 * f_old + w0 * f_new,
                    o1 * f_old + w1 * f_new])
    return new


def reduce_items(cfg: AttnCfg, state, tid) -> list:
    return [(ok, head, dim, st[0], st[1], [st[2], st[3]])
            for st, (ok, head, dim) in zip(state, cta_items(cfg, tid))]


def score_scales(cfg: AttnCfg, alpha_s, t, qk_scale) -> list:
    """Per score register: alpha_q(head) * k_scale * sm_scale * log2(e) * 2^7 (FP32)."""
    return [P.lds_f32(alpha_s + M.score_head(t, r, cfg.packing) * 4) * qk_scale
            for r in range(cfg.nr)]


def init_state(cfg: AttnCfg):
    """Online-softmax state of a lane: m [R] = -inf, l [R] = 0, O^T fragments [mts][4] = 0."""
    return ([Float32(NEG_INF)] * cfg.nr, [Float32(0.0)] * cfg.nr,
            [[Float32(0.0)] * 4 for _ in range(cfg.mts)])


# ----------------------------------------------------------------------------- KV append


def append_rows(head_dim: int, kv_heads: int, page_size: int, num_warps: int, warp, lane, tok,
                phys, slot, k_addr, v_addr, kc, ksf, vc, vsf, kscale, vscale) -> None:
    """Quantize token `tok`'s K and V rows ([Hkv, D] bf16 each) into cache row
    (phys * Hkv + h) * page_size + slot: codes (two per byte, even element low) and E4M3
    scales, exactly as formats.quantize with the static global scales kscale / vscale."""
    per = head_dim // 32
    lanes = 16 // per
    rows = 2 * kv_heads
    for i in range((rows + num_warps - 1) // num_warps):
        r = warp + num_warps * i
        ok = r < rows
        rr = imin(r, rows - 1)
        is_v = rr >= kv_heads
        h = rr - sel_i32(is_v, kv_heads, 0)
        src = sel_i64(is_v, v_addr, k_addr) + (Int64(tok) * kv_heads + Int64(h)) * (2 * head_dim)
        words = P.ld_nc_bytes(src + Int64(lane * 2 * per), 2 * per)
        xs = []
        for w in words:
            lo, hi = F4.bf16x2_to_f32(w)
            xs += [lo, hi]
        alpha = sel_f32(is_v, vscale, kscale)
        blk = F4.quantize_block(xs, "nvfp4", alpha, lanes)
        packed = F4.pack_codes(blk.codes)
        row = (Int64(phys) * kv_heads + Int64(h)) * page_size + Int64(slot)
        cbase = sel_i64(is_v, vc, kc) + row * (head_dim // 2) + Int64(lane * (per // 2))
        sbase = sel_i64(is_v, vsf, ksf) + row * (head_dim // 16)
        P.st_bytes_if(ok, cbase, packed, per // 2)
        first = (lane % lanes) == 0
        P.st_bytes_if(ok & first, sbase + Int64(lane // lanes), blk.scale_byte, 1)


def sel_i32(p, a, b) -> Int32:
    return Int32(select_(p, _i32(a), _i32(b)))


def sel_i64(p, a, b) -> Int64:
    return Int64(select_(p, _i64(a), _i64(b)))
