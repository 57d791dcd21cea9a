"""A pure-torch simulation of the linear_sm90_mma kernel, thread by thread (vectorized over the
32 lanes of a warp), for CPU tests.

It follows the template's control flow (CTAs, warps, K iterations, in-CTA and cross-CTA split-K,
fold, epilogue) with the SAME address functions (resgen.kernels.linear_sm90_mma_geom.Geometry) on
byte images of the buffers the kernel receives, and models the PTX it emits:
  ld.global (little-endian words), prmt + integer multiply-add (scale expansion), the pair decode
  bit operations, mul.rn.bf16x2, mma.sync.m16n8k16.row.col (fragment ownership as in the PTX ISA:
  lane = 4 g + t; A: a0a1 = (g, 2t..2t+1), a2a3 = (g+8, 2t..), a4a5 = (g, 2t+8..),
  a6a7 = (g+8, 2t+8..); B: b0b1 = (k 2t..2t+1, n g), b2b3 = (k 2t+8.., n g);
  C: c0c1 = (g, n 2t..2t+1), c2c3 = (g+8, n 2t..)), cvt.rn.bf16x2.f32 and predicated stores.
A wrong stride, fragment slot or fold in the index math shows up as a mismatch against
resgen.reference.linear, without a GPU.

Presum variants (fold "presum", resgen.kernels.linear_sm90_mma_presum.PresumGeometry): the B
fragment of token r is row r of quant_sm90's "presum" operand (float16, fp16(X_hat + R_hat),
read as plain reads its BF16 row), the weight pairs decode to FP16 bits
(the module's decoders, shared with the device code) times the FP16 scale (mul.rn.f16x2), the
MMA takes FP16 halves, and the epilogue is the plain one (tokens in the accumulator columns).

Fused variants (act "fused"): each CTA's operand tile is built in a NaN-poisoned byte image of
its shared memory by walking the kernel's work items with the same Geometry functions; the
per-block quantization itself is resgen.formats (the device code calls resgen.kernels.fp4_device,
its bit-exact GPU twin, which the quant_sm90 GPU tests check), so what this proves is the item
decomposition, the K-Ext source/mask mapping and every tile address. W4A16 fused variants
(resgen.kernels.linear_sm90_mma_a16.A16Geometry, operand "copy") store each item's BF16 activations
as they are (no quantization; alpha_x is the one the launch path passes).
"""

from __future__ import annotations

import torch

from .. import formats
from .sm90_fp4_layout import Sm90Weight, _bf16_halves, decode_pairs
from .sm90_fp4_decode import SCALE_CONSTS
from .linear_sm90_mma_geom import Geometry
from .linear_sm90_mma_presum import F16_DECODERS, PRESUM_SCALE_CONSTS

__all__ = ["simulate_kernel"]

_M32 = 0xFFFFFFFF


class _Mem:
    """A flat little-endian byte image with word loads."""

    def __init__(self, t: torch.Tensor):
        self.b = t.contiguous().view(torch.uint8).reshape(-1).to(torch.int64)

    def words(self, off: torch.Tensor, n: int) -> list[torch.Tensor]:
        """n consecutive uint32 at byte offsets off [lanes] -> list of n int64 [lanes]."""
        if bool((off % 4 != 0).any()):
            raise AssertionError("misaligned load")
        out = []
        for q in range(n):
            o = off + 4 * q
            if bool((o < 0).any()) or bool((o + 3 >= self.b.numel()).any()):
                raise AssertionError("out-of-bounds load")
            w = (self.b[o] | (self.b[o + 1] << 8) | (self.b[o + 2] << 16) | (self.b[o + 3] << 24))
            out.append(w)
        return out


def _bf16_mul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """mul.rn.bf16x2 on int64 bit patterns (products here are exact; RNE otherwise)."""
    p = (_bf16_halves(a).float() * _bf16_halves(b).float()).to(torch.bfloat16)
    h = p.view(torch.int16).to(torch.int64) & 0xFFFF
    return h[..., 0] | (h[..., 1] << 16)


def _halves_f64(r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    h = _bf16_halves(r).double()
    return h[..., 0], h[..., 1]


def _f16_halves(r: torch.Tensor) -> torch.Tensor:
    """int64 f16x2 bit patterns [...] -> float16 [..., 2] (low half first)."""
    h = torch.stack([r & 0xFFFF, (r >> 16) & 0xFFFF], dim=-1)
    return torch.where(h >= 2 ** 15, h - 2 ** 16, h).to(torch.int16).view(torch.float16)


def _f16_halves_f64(r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    h = _f16_halves(r).double()
    return h[..., 0], h[..., 1]


def _f16_bits(v: torch.Tensor) -> torch.Tensor:
    """float [...] -> int64 FP16 bit patterns (RNE: cvt.rn.f16 / mul.rn.f16)."""
    return v.to(torch.float16).view(torch.int16).to(torch.int64) & 0xFFFF


def _f16_mul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """mul.rn.f16x2 on int64 bit patterns (the product of two FP16 values rounded once: the
    float64 product is exact, 11 x 11 bits)."""
    p = _f16_halves(a).double() * _f16_halves(b).double()
    h = _f16_bits(p)
    return h[..., 0] | (h[..., 1] << 16)


def _mma(a: list[torch.Tensor], b: list[torch.Tensor], c: list[torch.Tensor],
         halves=_halves_f64) -> list[torch.Tensor]:
    """mma.m16n8k16 for one warp: a: 4 x int64 [32], b: 2 x int64 [32], c: 4 x float32 [32];
    halves: the operand type's bits -> values (BF16; _f16_halves_f64 for the FP16 MMA)."""
    lane = torch.arange(32)
    g, t = lane // 4, lane % 4
    A = torch.zeros(16, 16, dtype=torch.float64)
    B = torch.zeros(16, 8, dtype=torch.float64)
    C = torch.zeros(16, 8, dtype=torch.float64)
    for reg, (row_off, k_off) in enumerate(((0, 0), (8, 0), (0, 8), (8, 8))):
        lo, hi = halves(a[reg])
        A[g + row_off, 2 * t + k_off] = lo
        A[g + row_off, 2 * t + 1 + k_off] = hi
    for reg, k_off in enumerate((0, 8)):
        lo, hi = halves(b[reg])
        B[2 * t + k_off, g] = lo
        B[2 * t + 1 + k_off, g] = hi
    C[g, 2 * t], C[g, 2 * t + 1] = c[0].double(), c[1].double()
    C[g + 8, 2 * t], C[g + 8, 2 * t + 1] = c[2].double(), c[3].double()
    D = (A @ B + C).float()
    return [D[g, 2 * t], D[g, 2 * t + 1], D[g + 8, 2 * t], D[g + 8, 2 * t + 1]]


def _scale(sw: torch.Tensor, i: int, fmt: str, consts=SCALE_CONSTS
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """scale_pair: PRMT picks byte 2 (i % 2) (row r0) / + 1 (row r1) into b | b << 16, IMAD
    (consts: BF16 scales; PRESUM_SCALE_CONSTS for presum's FP16 ones)."""
    mul, add = consts[fmt]
    out = []
    for byte in (2 * (i % 2), 2 * (i % 2) + 1):
        b = (sw >> (8 * byte)) & 0xFF
        out.append(((b | (b << 16)) * mul + add) & _M32)
    return out[0], out[1]


def _cvt_bf16(v: torch.Tensor) -> torch.Tensor:
    return v.float().to(torch.bfloat16)


def _operand_bits(codes: torch.Tensor, scales: torch.Tensor, fmt: str) -> torch.Tensor:
    """int64 bf16 bit patterns of code value x block scale (exact in bf16)."""
    from .sm90_operand import operand_values

    v = operand_values(codes, scales, fmt).to(torch.bfloat16)
    return v.view(torch.int16).to(torch.int64) & 0xFFFF


def _put_bits(tile: torch.Tensor, off: int, bits: torch.Tensor) -> None:
    """Little-endian bf16 values at byte offset off of a byte image (16-byte aligned stores)."""
    if off % 16 or off < 0 or off + 2 * bits.numel() > tile.numel():
        raise AssertionError("misaligned or out-of-bounds shared store")
    b = torch.stack([bits & 0xFF, bits >> 8], dim=-1).reshape(-1)
    tile[off:off + b.numel()] = b


def _fused_tile(G: Geometry, x: torch.Tensor, alpha_x, masks, m: int, by: int,
                bz: int) -> "_Mem":
    """The operand tile CTA (*, by, bz) builds in shared memory (byte image, 0xFF elsewhere)."""
    tile = torch.full((G.xs_bytes,), 0xFF, dtype=torch.int64)
    alpha = None if not G.nv else alpha_x.float().reshape(())
    tok0 = bz * (G.tok // G.rpt)
    ntok = min(G.tok // G.rpt, m - tok0)
    xf = x.float()
    copy = getattr(G, "operand", "quantize") == "copy"
    xbits = x.contiguous().view(torch.int16).to(torch.int64) & 0xFFFF if copy else None
    # the items as the kernel deals them: thread tid of cluster rank r takes item_start(r, tid),
    # then every item_step-th; each item is stored into every CTA of the cluster (same tile)
    walk = [it for r in range(G.cluster) for tid in range(G.threads)
            for it in range(G.item_start(r, tid), ntok * G.nb, G.item_step)]
    if sorted(walk) != list(range(ntok * G.nb)):
        raise AssertionError("the cluster's threads do not cover every work item exactly once")
    for item in walk:
        tk, b = G.item(item)
        col = G.item_col(by, b)
        tok = tok0 + tk
        if copy and col < G.k:
            _put_bits(tile, G.xs_row(tk) + b * G.bs * 2, xbits[tok, col:col + G.bs])
        elif col < G.k:
            (c, sc), (rc, rsc) = formats.residue_pair(xf[tok:tok + 1, col:col + G.bs], G.fmt,
                                                      alpha)
            off = G.xs_row(G.rpt * tk) + b * G.bs * 2
            _put_bits(tile, off, _operand_bits(c, sc, G.fmt).reshape(-1))
            if G.mext:
                _put_bits(tile, off + G.xs_stride, _operand_bits(rc, rsc, G.fmt).reshape(-1))
        elif col < G.kqe:
            src = G.ext_src(col)
            span = xf[tok:tok + 1, src:src + G.nsrc * G.bs]
            mk = masks[src // 8:src // 8 + G.nsrc * G.bs // 8].to(torch.int64)
            bits = (mk[:, None] >> torch.arange(8)) & 1
            idx = torch.nonzero(bits.reshape(-1)).reshape(-1)
            if idx.numel() != G.bs:
                raise AssertionError("an extension block must select exactly one block")
            _, (rc, rsc) = formats.residue_pair(span, G.fmt, alpha, idx)
            _put_bits(tile, G.xs_row(tk) + b * G.bs * 2, _operand_bits(rc, rsc, G.fmt).reshape(-1))
        else:
            for r in range(G.rpt):
                _put_bits(tile, G.xs_row(G.rpt * tk + r) + b * G.bs * 2,
                          torch.zeros(G.bs, dtype=torch.int64))
    mem = _Mem.__new__(_Mem)
    mem.b = tile
    return mem


def simulate_kernel(geom: Geometry, wt: Sm90Weight, xop: torch.Tensor, m: int, rows: int,
                    alpha_x: torch.Tensor | None, out: torch.Tensor,
                    ws: torch.Tensor | None = None, sem: torch.Tensor | None = None,
                    cta_order: list[tuple[int, int, int]] | None = None,
                    masks: torch.Tensor | None = None) -> torch.Tensor:
    """Run the kernel's logic on CPU tensors; writes out (bf16 [>= m, N]) like the kernel.

    xop: the operand (xop variants) or x: bf16 [m, K] (fused variants; alpha_x is then the
    static NVFP4 scale and masks the K-Ext selection, uint8 [K / 8]).
    cta_order: the order CTAs run in (default: grid order); the workspace reduction must give
    the same bits for any order. ws/sem: the persistent workspace and semaphores (zeroed if
    None), checked to be back at zero afterwards like the kernel leaves them.
    """
    geom.check()
    if wt.kp != geom.kp or wt.out_features != geom.n or wt.packing != geom.packing:
        raise ValueError("weight does not match the geometry")
    G = geom
    presum = getattr(G, "fold", "exact") == "presum"
    wmem, smem_, xmem = _Mem(wt.words), _Mem(wt.scales), _Mem(xop)
    gx, gy, gz = G.grid(rows)
    ws = torch.zeros(max(G.ws_floats(rows, m), 1)) if ws is None else ws
    sem = torch.zeros(max(G.sem_count(rows), 1), dtype=torch.int32) if sem is None else sem
    fac = G.out_factor(lambda: (alpha_x.float().reshape(()), wt.alpha.float().reshape(())),
                       torch.tensor(128.0, dtype=torch.float32))
    y = out.view(torch.int16)
    order = cta_order or [(x, yy, z) for z in range(gz) for yy in range(gy) for x in range(gx)]
    lane = torch.arange(32)
    for bx, by, bz in order:
        accs = {}
        if G.fused:
            tmem = _fused_tile(G, xop, alpha_x, masks, m, by, bz)
        for warp in range(G.warps_m * G.warps_k):
            tid = warp * 32 + lane
            ln, wm, wk, g, t, mt0, grp0, row0, sl = G.warp_coords(tid, bx, by, bz)
            acc = [[[torch.zeros(32) for _ in range(4)] for _ in range(G.n_tiles)]
                   for _ in range(G.m_tiles)]
            ring = {}                                     # cp_async: smem byte offset -> word

            def fetch(it):
                """Global loads of iteration it: words[u][mt][i] (4 each), scales[u][mt]."""
                wv = [[[wmem.words(G.w_off(mt0 + mt, (grp0 + it * G.groups + u) * 4 + i, ln), 4)
                        for i in range(4)] for mt in range(G.m_tiles)] for u in range(G.groups)]
                sv = [[smem_.words(G.s_off(mt0 + mt, grp0 + it * G.groups + u, sl), 2)
                       for mt in range(G.m_tiles)] for u in range(G.groups)]
                return wv, sv

            def issue(it, slot):
                wv, sv = fetch(it)
                for u in range(G.groups):
                    for mt in range(G.m_tiles):
                        for i in range(4):
                            base = G.sw_off(warp, slot, u, mt, i, ln)
                            for q in range(4):
                                _ring_put(ring, base + 4 * q, wv[u][mt][i][q])
                        sbase = G.ss_off(warp, slot, u, mt, ln) + (1 << 40)
                        for q in range(2):
                            _ring_put(ring, sbase + 4 * q, sv[u][mt][q])

            uses: dict[int, int] = {}                     # bulk: slot -> fills so far
            filled: dict[int, int] = {}                   # bulk: slot -> iteration in it

            def issue_bulk(it, slot):
                """Lane 0's copy-engine fills of slot `slot` with iteration it (bulk)."""
                if slot in filled:
                    raise AssertionError("bulk refill of a slot not yet read")
                total = 0
                for is_scale, soff, goff, nb in G.bulk_copies(int(mt0[0]), int(grp0[0]), it,
                                                              warp, slot):
                    if soff % 16 or goff % 16 or nb % 16:
                        raise AssertionError("bulk copy not 16-byte aligned")
                    mem = smem_ if is_scale else wmem
                    src = mem.words(torch.arange(goff, goff + nb, 4), 1)[0]
                    _ring_put(ring, torch.arange(soff, soff + nb, 4) + (1 << 40) * is_scale,
                              src)
                    total += nb
                if total != G.bulk_tx_bytes:
                    raise AssertionError("bulk copies do not add up to the mbarrier's bytes")
                uses[slot] = uses.get(slot, 0) + 1
                filled[slot] = it

            def read(slot, it=None):
                if G.pipeline == "bulk":
                    # the kernel waits for phase parity (it // S) & 1 of the slot's mbarrier:
                    # the fill it waits for must be the slot's (it // S)-th
                    if filled.get(slot) != it or uses[slot] - 1 != it // G.stages:
                        raise AssertionError("bulk read of a slot holding another iteration")
                    del filled[slot]
                sidx = sl if G.pipeline == "bulk" else ln
                wv = [[[[_ring_get(ring, G.sw_off(warp, slot, u, mt, i, ln) + 4 * q)
                         for q in range(4)] for i in range(4)] for mt in range(G.m_tiles)]
                      for u in range(G.groups)]
                sv = [[[_ring_get(ring, G.ss_off(warp, slot, u, mt, sidx) + (1 << 40) + 4 * q)
                        for q in range(2)] for mt in range(G.m_tiles)] for u in range(G.groups)]
                return wv, sv

            # this warp's iterations: G.nit, or one fewer for the short slices of a ragged split
            nitw = int(G.slice_groups(int(wk[0]))) // G.groups
            for it in range(nitw):      # L2 prefetch spans (lane 0) stay inside the buffers
                for q, (off, nb) in enumerate(G.prefetch_spans(mt0[0], grp0[0], it)):
                    size = (wmem if q % 2 == 0 else smem_).b.numel()
                    if int(off) < 0 or int(off) + nb > size:
                        raise AssertionError("L2 prefetch span out of bounds")
            if G.pipeline == "cp_async":
                for s0 in range(G.stages - 1):
                    if s0 < nitw:
                        issue(s0, s0)
            if G.pipeline == "bulk":
                for s0 in range(min(G.stages, nitw)):
                    issue_bulk(s0, s0)
            for it in range(nitw):
                if G.pipeline == "cp_async":
                    nxt = it + G.stages - 1
                    if nxt < nitw:
                        issue(nxt, nxt % G.stages)
                    wall, sall = read(it % G.stages)
                elif G.pipeline == "bulk":
                    # read the slot, then (the warp synchronized) refill it S iterations on
                    wall, sall = read(it % G.stages, it)
                    if it + G.stages < nitw:
                        issue_bulk(it + G.stages, it % G.stages)
                else:
                    wall, sall = fetch(it)
                for u in range(G.groups):
                    grp = grp0 + it * G.groups + u
                    wv, sv = wall[u], sall[u]
                    for i in range(4):
                        xw = []
                        for nt in range(G.n_tiles):
                            r = row0 + 8 * nt + g
                            # unpredicated, as the kernel: rows past the real ones feed
                            # only columns that are never stored
                            if G.fused:
                                rloc = (8 * nt + g) % G.tok
                                a = G.xs_row(rloc) + G.xs_col(wk, it, u, i, t)
                                mem = tmem
                            elif presum:        # the quantizer's FP16 presum row
                                a = G.x_off(G.xb_row(r), grp * 4 + i, t)
                                mem = xmem
                            else:
                                a = G.x_off(r, grp * 4 + i, t)
                                mem = xmem
                            xw.append(mem.words(a, 8))
                        for mt in range(G.m_tiles):
                            if presum:
                                s0, s1 = _scale(sv[mt][i // 2], i, G.fmt, PRESUM_SCALE_CONSTS)
                            else:
                                s0, s1 = _scale(sv[mt][i // 2], i, G.fmt)
                            for j in range(4):
                                if presum:
                                    rl = F16_DECODERS[G.packing](wv[mt][i][j] & _M32)
                                    rl = [q & _M32 for q in rl]
                                    a4 = [_f16_mul(rl[0], s0), _f16_mul(rl[1], s1),
                                          _f16_mul(rl[2], s0), _f16_mul(rl[3], s1)]
                                else:
                                    rp = decode_pairs(_as_i32(wv[mt][i][j]), G.packing)
                                    a4 = [_bf16_mul(rp[:, 0], s0), _bf16_mul(rp[:, 1], s1),
                                          _bf16_mul(rp[:, 2], s0), _bf16_mul(rp[:, 3], s1)]
                                halves = _f16_halves_f64 if presum else _halves_f64
                                for nt in range(G.n_tiles):
                                    acc[mt][nt] = _mma(a4, [xw[nt][2 * j], xw[nt][2 * j + 1]],
                                                       acc[mt][nt], halves)
            accs[(warp % G.warps_m, warp // G.warps_m)] = acc
        # in-CTA split-K, warp order
        for wm in range(G.warps_m):
            acc = accs[(wm, 0)]
            for s in range(1, G.warps_k):
                other = accs[(wm, s)]
                for mt in range(G.m_tiles):
                    for nt in range(G.n_tiles):
                        for e in range(4):
                            acc[mt][nt][e] = acc[mt][nt][e] + other[mt][nt][e]
            tid = wm * 32 + lane
            ln, _, _, g, t, mt0, _, row0, _ = G.warp_coords(tid, bx, by, bz)
            if G.reduce == "none":
                _store(G, acc, y, fac, mt0, row0, g, t, m)
            elif G.reduce == "atomic":
                _atomic(G, acc, ws, fac, mt0, row0, g, t, m)
            else:
                tile = bz * G.grid_x + bx
                for q in range(G.acc):
                    mt, nt, e = q // (4 * G.n_tiles), (q // 4) % G.n_tiles, q % 4
                    ws.view(-1)[G.ws_off(tile, by, wm, q, ln) // 4] = acc[mt][nt][e]
        if G.reduce == "workspace":
            tile = bz * G.grid_x + bx
            old = int(sem[tile])
            sem[tile] += 1
            if old == G.split_k - 1:
                sem[tile] = 0
                for wm in range(G.warps_m):
                    tid = wm * 32 + lane
                    ln, _, _, g, t, mt0, _, row0, _ = G.warp_coords(tid, bx, by, bz)
                    acc = [[[None] * 4 for _ in range(G.n_tiles)] for _ in range(G.m_tiles)]
                    for q in range(G.acc):
                        mt, nt, e = q // (4 * G.n_tiles), (q // 4) % G.n_tiles, q % 4
                        v = torch.zeros(32)
                        for s in range(G.split_k):
                            v = v + ws.view(-1)[G.ws_off(tile, s, wm, q, ln) // 4]
                        acc[mt][nt][e] = v
                    _store(G, acc, y, fac, mt0, row0, g, t, m)
    if G.reduce == "atomic":       # the convert kernel
        vals = ws.view(-1)[: m * G.n]
        out.view(-1)[: m * G.n] = _cvt_bf16(vals)
        ws.view(-1)[: m * G.n] = 0
    if bool((sem != 0).any()):
        raise AssertionError("semaphores not reset")
    return out


def _ring_put(ring: dict, off: torch.Tensor, w: torch.Tensor) -> None:
    """Per-lane shared-memory words (the ring is private to the warp in the kernel too)."""
    if bool((off % 4 != 0).any()):
        raise AssertionError("misaligned shared store")
    for o, v in zip(off.tolist(), w.tolist()):
        ring[o] = v


def _ring_get(ring: dict, off: torch.Tensor) -> torch.Tensor:
    try:
        return torch.tensor([ring[o] for o in off.tolist()], dtype=torch.int64)
    except KeyError:
        raise AssertionError("shared-memory read of a slot never written") from None


def _as_i32(w: torch.Tensor) -> torch.Tensor:
    w = w & _M32
    return torch.where(w >= 2 ** 31, w - 2 ** 32, w).to(torch.int32)


def _put(y16: torch.Tensor, off: torch.Tensor, v: torch.Tensor, ok: torch.Tensor) -> None:
    """Predicated BF16 stores at byte offsets off."""
    if bool((off % 2 != 0).any()):
        raise AssertionError("misaligned store")
    idx = (off // 2)[ok]
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= y16.numel()):
        raise AssertionError("out-of-bounds store")
    y16.view(-1)[idx] = _cvt_bf16(v[ok]).view(torch.int16)


def _planned(G: Geometry, acc, fac, mt0, row0, g, t, m):
    """The epilogue's stores as G.epilogue_plan says (the fold, scale and row predicate that
    store_tile and atomic_tile share): (token, channel, v0, v1, ok) per plan row; v0 / v1 go
    to channels ch and ch + 8 of the token's output row where ok."""
    for mt in range(G.m_tiles):
        for nt in range(G.n_tiles):
            ep = G.epilogue_plan(mt, nt, mt0, row0, g, t)
            for r in ep.rows:
                v0, v1 = ep.values(acc[mt][nt], 0, r, fac)
                tok = ep.token(r)
                yield tok, ep.ch, v0, v1, G.out_ok(ep.local_row(r), tok, m)


def _store(G: Geometry, acc, y16, fac, mt0, row0, g, t, m) -> None:
    """The kernel's store_tile: fold, scale and store as G.epilogue_plan says."""
    for tok, ch, v0, v1, ok in _planned(G, acc, fac, mt0, row0, g, t, m):
        a = G.y_off(tok, ch)
        _put(y16, a, v0, ok)
        _put(y16, a + 16, v1, ok)


def _atomic(G: Geometry, acc, ws, fac, mt0, row0, g, t, m) -> None:
    """The kernel's atomic_tile: fold and scale as G.epilogue_plan says, add into ws."""
    flat = ws.view(-1)
    for tok, ch, v0, v1, ok in _planned(G, acc, fac, mt0, row0, g, t, m):
        idx = (G.y_off(tok, ch) * 2 // 4)[ok]
        flat.index_add_(0, idx, v0[ok])
        flat.index_add_(0, idx + 8, v1[ok])
