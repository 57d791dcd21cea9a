"""Thread-level CPU simulation of attention_sm100's tile math (resgen.kernels.attention_sm100_geom
gives every index; nothing here runs on a GPU).

What is simulated, per (sequence, KV head, split) and 128-key tile, as the kernel does it:
    the loader's shared-memory image: K codes at k_code_offset (the swizzled K-major operand),
    K scale-factor words at k_sf_word_offset (the tcgen05 SF atom), read back through the same
    maps as the MMA's operand (every byte written once, none overlapping);
    the QK MMA as its definition (float64 sum of E2M1 x E4M3 products, rounded to FP32 once:
    what resgen.reference computes, so the tensor core's internal order is not what is
    proven) into a TMEM image [128 lanes, qk_n columns];
    every epilogue thread's score loads with the variant's shape (sm100_layout.tmem_frag), the
    fold s = (S_base + S_res) * fac in FP32 (add.rn then mul.rn), each (key, head) folded by
    exactly one thread;
    the online softmax in FP32 (base 2): tile max, m_new, corr = exp2(m - m_new),
    p = exp2(s - m_new), P = fp16(p), l = l corr + the tile's sum (per thread, then a lane
    butterfly, then the 4 warps in order);
    V decoded to FP16 (checked exact), O_t = P.V as its definition (float64 -> FP32),
    O = O corr + O_t; the split reduction in split order (lastcta and combine compute the same
    sums, so they are bit-identical).
exp2 is torch's FP32 exp2, not the device's ex2.approx (at most 2 ulp apart): outputs are
compared with the reference to a tolerance; the folded scores bit-exactly.
"""

from __future__ import annotations

import math

import torch

from .attention_sm100_geom import (KEYS, AttnSm100Geometry, k_code_offset, k_sf_word_offset,
                                   split_tiles)
from .attention_sm100 import query_values
from .sm100_layout import tmem_frag

__all__ = ["simulate", "SimResult", "fold_scores"]


class SimResult:
    def __init__(self, out, scores, partials):
        self.out = out               # float32 [B, Hq, D] (before the BF16 store)
        self.scores = scores         # {(b, h, key): float32 [group]}: the folded FP32 scores
        self.partials = partials     # {(b, h): [(O [group, D], m [group], l [group])]}


def _f32(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float32)


def _smem_k_tile(g: AttnSm100Geometry, kc: torch.Tensor, ksf: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The loader's writes of one tile: kc uint8 [128, D/2], ksf uint8 [128, D/16] -> the K
    codes' and SF atom's shared-memory images (poisoned where unwritten; a double write
    fails)."""
    rb = g.row_bytes
    img = torch.full((KEYS * rb,), -1, dtype=torch.int32)
    sfi = torch.full((g.k_sf_tile_bytes,), -1, dtype=torch.int32)
    for r in range(KEYS):
        for c in range(rb // 16):
            o = k_code_offset(r, c, rb)
            if bool((img[o:o + 16] >= 0).any()):
                raise AssertionError(f"K code chunk ({r}, {c}) overlaps another")
            img[o:o + 16] = kc[r, 16 * c:16 * c + 16].to(torch.int32)
        for grp in range(g.head_dim // 64):
            o = k_sf_word_offset(r, grp, g.sf_cols)
            if bool((sfi[o:o + 4] >= 0).any()):
                raise AssertionError(f"K scale word ({r}, {grp}) overlaps another")
            sfi[o:o + 4] = ksf[r, 4 * grp:4 * grp + 4].to(torch.int32)
    return img, sfi


def _mma_view(g: AttnSm100Geometry, img: torch.Tensor, sfi: torch.Tensor) -> torch.Tensor:
    """The MMA's operand values [128, D] float64 read from the images through the maps."""
    from .. import formats

    rb = g.row_bytes
    kc = torch.empty(KEYS, rb, dtype=torch.int32)
    ks = torch.empty(KEYS, g.head_dim // 16, dtype=torch.int32)
    for r in range(KEYS):
        for c in range(rb // 16):
            o = k_code_offset(r, c, rb)
            kc[r, 16 * c:16 * c + 16] = img[o:o + 16]
        for grp in range(g.head_dim // 64):
            o = k_sf_word_offset(r, grp, g.sf_cols)
            ks[r, 4 * grp:4 * grp + 4] = sfi[o:o + 4]
    if bool((kc < 0).any()) or bool((ks < 0).any()):
        raise AssertionError("the MMA reads shared memory the loader never wrote")
    codes = formats.unpack_fp4(kc.to(torch.uint8))
    vals = formats.e2m1_decode(codes).double()
    sf = ks.to(torch.uint8).view(torch.float8_e4m3fn).double()
    return vals * sf.repeat_interleave(16, dim=1)


def _butterfly_sum(vals: dict[int, torch.Tensor], holders: list[int]) -> torch.Tensor:
    """The warp's lane butterfly over the threads holding one head (xor masks that keep the
    holder set), FP32; returns the common result."""
    hs = set(holders)
    v = dict(vals)
    for mask in (16, 8, 4, 2, 1):
        if all((t ^ mask) in hs for t in hs):
            v = {t: _f32(v[t] + v[t ^ mask]) for t in hs}
    res = {float(x) for x in v.values()}
    if len(res) != 1:
        raise AssertionError("the butterfly left threads with different sums")
    return v[holders[0]]


def fold_scores(g: AttnSm100Geometry, tmem: torch.Tensor, fac: torch.Tensor
                ) -> tuple[torch.Tensor, dict]:
    """Every epilogue thread's score loads and fold. tmem: float32 [128, qk_n] (the S image);
    fac: float32 [pv_n]. Returns (s float32 [128, group], per warp: {(thread, head): [(key,
    value)]}, the register ownership the softmax sums follow)."""
    s = torch.full((KEYS, g.group), float("nan"), dtype=torch.float32)
    own: dict = {}
    plan = g.ld_plan()
    for w in range(4):
        for t in range(32):
            for ins in plan[t]:
                regs = {}
                for lane_off, j, rb, rr in ins.items:
                    for r in (rb, rr):
                        if r < 0:
                            continue
                        dl, dc = tmem_frag(g.tmem_shape, t, r)
                        regs[r] = tmem[32 * w + ins.lane + dl, ins.col + dc]
                    key = 32 * w + ins.lane + lane_off
                    v = regs[rb] if rr < 0 else _f32(regs[rb] + regs[rr])
                    v = _f32(v * fac[j])
                    if not torch.isnan(s[key, j]):
                        raise AssertionError(f"score (key {key}, head {j}) folded twice")
                    s[key, j] = v
                    own.setdefault((w, j), {}).setdefault(t, []).append(key)
    if bool(torch.isnan(s).any()):
        raise AssertionError("a score was never folded")
    return s, own


def simulate(q: torch.Tensor, cache, block_tables: torch.Tensor, seq_lens: torch.Tensor,
             g: AttnSm100Geometry, splits: int = 1, sm_scale: float | None = None
             ) -> SimResult:
    """The kernel's result for q: [B, Hq, D] float on the cache (float32 [B, Hq, D])."""
    b, hq, d = q.shape
    hkv = cache.num_kv_heads
    scale = sm_scale if sm_scale is not None else d ** -0.5
    qv, _, _, fac = query_values(q.float(), g, float(cache.k_scale), scale)
    out = torch.zeros(b, hq, d, dtype=torch.float32)
    scores: dict = {}
    partials: dict = {}
    ps = g.page_size
    for bi in range(b):
        n = int(seq_lens[bi])
        tiles = math.ceil(n / KEYS) if n else 0
        for h in range(hkv):
            parts = []
            for z in range(splits):
                t0, t1 = split_tiles(tiles, splits, z)
                m = torch.full((g.group,), -math.inf, dtype=torch.float32)
                el = torch.zeros(g.group, dtype=torch.float32)
                o = torch.zeros(g.group, d, dtype=torch.float32)
                for tile in range(t0, t1):
                    keys = torch.arange(KEYS) + tile * KEYS
                    ok = keys < n
                    ent, slot = keys // ps, keys % ps
                    page = block_tables[bi, ent.clamp(max=block_tables.shape[1] - 1)].long()
                    kc = cache.k_codes[page, h, slot]
                    ksf = cache.k_sf[page, h, slot].view(torch.uint8)
                    kc = torch.where(ok[:, None], kc, torch.zeros_like(kc))
                    ksf = torch.where(ok[:, None], ksf, torch.zeros_like(ksf))
                    img, sfi = _smem_k_tile(g, kc, ksf)
                    kv = _mma_view(g, img, sfi)
                    tmem = _f32(kv @ qv[bi, h].T)                     # [128, qk_n]
                    s, own = fold_scores(g, tmem, fac[bi, h])
                    s = torch.where(ok[:, None], s, torch.full_like(s, -math.inf))
                    for key in range(KEYS):
                        if ok[key]:
                            scores[(bi, h, int(keys[key]))] = s[key].clone()
                    mt = s.amax(0)
                    mn = torch.maximum(m, mt)
                    corr = torch.where(mn == -math.inf, torch.ones_like(m), torch.exp2(m - mn))
                    p = torch.exp2(s - mn)                          # 0 where masked
                    tsum = torch.zeros(g.group, dtype=torch.float32)
                    for j in range(g.group):
                        wsum = []
                        for w in range(4):
                            holders = own[(w, j)]
                            part = {}
                            for t, ks_ in holders.items():
                                acc = torch.zeros((), dtype=torch.float32)
                                for key in ks_:
                                    acc = _f32(acc + p[key, j])
                                part[t] = acc
                            wsum.append(_butterfly_sum(part, sorted(holders)))
                        acc = wsum[0]
                        for x in wsum[1:]:
                            acc = _f32(acc + x)
                        tsum[j] = acc
                    el = _f32(_f32(el * corr) + tsum)
                    p16 = p.to(torch.float16).double()               # [128, group]
                    vc = cache.v_codes[page, h, slot]
                    vsf = cache.v_sf[page, h, slot]
                    vdec = cache_unit_rows(vc, vsf)
                    v16 = vdec.to(torch.float16)
                    if not bool((v16.double() == vdec).all()):
                        raise AssertionError("V's E2M1 x E4M3 value is not exact in FP16")
                    v16 = torch.where(ok[:, None], v16, torch.zeros_like(v16))
                    ot = _f32(p16.T @ v16.double())                  # [group, D]
                    o = _f32(_f32(o * corr[:, None]) + ot)
                    m = mn
                parts.append((o, m, el))
            partials[(bi, h)] = parts
            out[bi, h * g.group:(h + 1) * g.group] = reduce_splits(parts) * float(cache.v_scale)
    return SimResult(out, scores, partials)


def cache_unit_rows(codes: torch.Tensor, sf: torch.Tensor) -> torch.Tensor:
    """codes uint8 [n, D/2], sf E4M3 [n, D/16] -> float64 [n, D] (E2M1 x E4M3, no alpha)."""
    from .. import formats

    c = formats.unpack_fp4(codes)
    vals = formats.e2m1_decode(c).double()
    return vals * sf.double().repeat_interleave(16, dim=1)


def reduce_splits(parts: list) -> torch.Tensor:
    """The split reduction (lastcta and combine alike), in split order: M = max m_z,
    L = sum l_z exp2(m_z - M), O = sum O_z exp2(m_z - M), out = O / L (0 where L = 0)."""
    mm = parts[0][1]
    for _, m, _ in parts[1:]:
        mm = torch.maximum(mm, m)
    big_l = torch.zeros_like(mm)
    big_o = torch.zeros_like(parts[0][0])
    for o, m, el in parts:
        w = torch.where(m == -math.inf, torch.zeros_like(m), torch.exp2(m - mm))
        big_l = _f32(big_l + _f32(el * w))
        big_o = _f32(big_o + _f32(o * w[:, None]))
    safe = torch.where(big_l == 0, torch.ones_like(big_l), big_l)
    return torch.where(big_l[:, None] == 0, torch.zeros_like(big_o), _f32(big_o / safe[:, None]))
