"""A pure-torch simulation of the linear_sm100_tc kernel, CTA by CTA and thread by thread, for CPU
tests (there is no Blackwell GPU here: this and the sm_100a compiles are what exists).

What it follows from the kernel, with the same index functions
(resgen.kernels.linear_sm100_tc_geom, which the template imports):
  - the grid: CTA (x, y, z) -> its A rows (a 2-SM pair's 128-row halves), B rows and K tiles;
  - the TMA tiles as the kernel requests them: codes rows of the tile (rows past the tensor
    read as zeros, as TMA fills them), and the tile's scale factors from the flat atom-layout
    bytes at SF rows tile x round_up(tile_rows, 128) + local row (sf_offset); so a quantizer
    or host layout that put a scale anywhere else shows up as a mismatch;
  - the MMA as its definition (C[i, j] = sum_k A[i, k] sfA B[j, k] sfB), the sum formed in
    float64 and rounded to FP32 once: exactly what resgen.reference.linear computes, so what
    this proves is every index and the fold, not the tensor core's internal summation order;
  - the accumulator as a TMEM image [128 lanes, tile_n columns] per CTA (NaN outside the
    accumulator columns), read by each epilogue warp w (lanes 32 w .. + 31) with the TMEM
    load shape's fragment map taken from CUTLASS's SM100_TMEM_LOAD_* traits (their DstLayout
    shapes and strides, evaluated here independently of linear_sm100_tc_geom.tmem_frag);
  - the fold plan (Sm100Geometry.ld_plan: register pairs), mul.rn / add.rn in FP32 and
    cvt.rn.bf16 exactly as the template issues them, and the store path: predicated global
    stores, or the shared-memory staging tile and one bulk copy per existing token row;
  - split-K: "workspace" partials at ws[z, tok, ch] and the semaphore's last CTA summing in
    split order (any CTA order gives the same bits), or "atomic" red.add into ws[tok, ch] in
    CTA order, the last CTA reading and re-zeroing; the semaphores must end at zero.
Every output element of the real tokens is written exactly once (asserted) and nothing else is.
"""

from __future__ import annotations

import random

import torch

from .linear_sm100_tc import Sm100Weight
from .sm100_operand import Sm100Operand, unit_values
from .linear_sm100_tc_geom import Sm100Geometry
from .sm100_layout import SF_ATOM_ROWS, round_up, sf_offset, tmem_span

__all__ = ["simulate_kernel", "traits_frag"]

# CUTLASS include/cute/atom/copy_traits_sm100.hpp, SM100_TMEM_LOAD_<shape><rep>x: DstLayout
# (thread, value bit) -> bit of the (row bits + DP_b x lane) reference space, written as
# ((t0, t1), (v0, v1[, v2])) shapes and strides for repetition 1 and the stride of the
# repetition mode (x2 and up add a mode of `rep` elements with it; the row bits per lane are
# row_bits x rep).
_TRAITS = {
    # shape: (thread shape, thread stride(rep), value shape, value stride(rep), row bits/rep)
    "32x32b": ((32,), lambda rep: (32 * rep,), (32, 1), lambda rep: (1, 32), 32),
    "16x256b": ((4, 8), lambda rep: (64, 256 * rep), (64, 2),
                lambda rep: (1, 2048 * rep), 256),
    "16x128b": ((4, 8), lambda rep: (32, 128 * rep), (32, 2),
                lambda rep: (1, 1024 * rep), 128),
}


def traits_frag(shape: str, rep: int) -> list[list[tuple[int, int]]]:
    """[thread][register] -> (lane, column) of tcgen05.ld.<shape>.x<rep>, evaluated from the
    CUTLASS traits' DstLayout (see _TRAITS)."""
    tshape, tstride, vshape, vstride, row_bits = _TRAITS[shape]
    ts = tstride(rep)
    vs = vstride(rep)
    bits_per_lane = row_bits * rep
    out = []
    for t in range(32):
        if len(tshape) == 1:
            tbit = t * ts[0]
        else:
            tbit = (t % tshape[0]) * ts[0] + (t // tshape[0]) * ts[1]
        regs = []
        n_inner = vshape[0] * vshape[1]
        for r in range(tmem_span(shape, rep)[2]):
            v = r * 32                                  # first bit of register r
            q, v = divmod(v, n_inner)                   # repetition index (x2 and up)
            v0, v1 = v % vshape[0], v // vshape[0]
            bit = tbit + v0 * vs[0] + v1 * vs[1] + q * row_bits
            lane, rbit = divmod(bit, bits_per_lane)
            regs.append((lane, rbit // 32))
        out.append(regs)
    return out


def _bf16(v: torch.Tensor) -> torch.Tensor:
    return v.to(torch.float32).to(torch.bfloat16)


def simulate_kernel(g: Sm100Geometry, wt: Sm100Weight, op: Sm100Operand, out: torch.Tensor,
                    ws: torch.Tensor | None = None, sem: torch.Tensor | None = None,
                    seed: int = 0) -> torch.Tensor:
    """Run the kernel's work on the CPU into out: bf16 [>= m, N] (poison it first). ws / sem:
    the launcher's split-K workspace (float32, zero) and semaphores (int32, zero)."""
    g.check()
    m, rows = op.m, op.rows
    if op.layout != g.layout or op.kp != g.kp or wt.kp != g.kp or op.sf_tile != g.act_sf_tile:
        raise AssertionError("operand / weight do not match the geometry")
    kp, v = g.kp, g.sfv
    cols = g.sfc
    # unit values of every row, each scale read where the kernel's TMA tile reads it
    w_codes = wt.codes.cpu()
    a_codes = op.codes.cpu()
    w_sf, a_sf = wt.sf.cpu(), op.sf.cpu()
    fac = torch.ones((), dtype=torch.float32) if g.fmt == "mxfp4" else \
        (op.alpha.cpu().float().reshape(()) * wt.alpha.cpu().float().reshape(()))
    plan = g.ld_plan()
    frag = traits_frag(g.tmem_shape, g.tmem_rep)
    th = torch.arange(128)
    th_w, th_t = th // 32, th % 32
    fr_l = torch.tensor([[lc[0] for lc in frag[t]] for t in range(32)])[th_t]
    fr_c = torch.tensor([[lc[1] for lc in frag[t]] for t in range(32)])[th_t]
    a_is_w = g.swap
    a_rows_ext = wt.rows if a_is_w else rows        # tensor extents (TMA zero-fills past them)
    b_rows_ext = rows if a_is_w else wt.rows
    gx, gy, gz = g.grid(rows)
    ctas = [(x, y, z) for x in range(gx) for y in range(gy) for z in range(gz)]
    random.Random(seed).shuffle(ctas)
    written = torch.zeros(out.shape[0], g.n, dtype=torch.int32)
    sem_state: dict[tuple[int, int], int] = {}
    b_sf_tile = round_up(g.tile_n, SF_ATOM_ROWS)     # the SFB TMA tile (rows)

    def tile_values(codes, sfbytes, r0, n_rows, ext, sf_base):
        """float32 [n_rows, Kp] of rows r0.. of an operand as TMA + the SF tile give them."""
        vals = torch.zeros(n_rows, kp, dtype=torch.float32)
        live = max(0, min(n_rows, ext - r0))
        if live:
            rr = torch.arange(live).reshape(-1, 1)
            bb = torch.arange(kp // v).reshape(1, -1)
            offs = sf_offset(sf_base + rr, bb, cols)
            if int(offs.max()) >= sfbytes.numel():
                raise AssertionError("a scale-factor tile read past the end of its buffer")
            sfv_ = sfbytes[offs]
            vals[:live] = unit_values(codes[r0: r0 + live], sfv_, g.fmt)
        return vals

    for (x, y, z) in ctas:
        a0, b0 = g.cta_origin(x, y)
        k0, k1 = (t * g.tile_k for t in g.k_tiles(z))
        a_codes_t = w_codes if a_is_w else a_codes
        b_codes_t = a_codes if a_is_w else w_codes
        a_sf_t = w_sf if a_is_w else a_sf
        b_sf_t = a_sf if a_is_w else w_sf
        # SF rows the kernel's TMA tiles read: A (128-row SF atoms): the CTA's rows a0..;
        # B: SF tile y of round_up(tile_n, 128) rows (tile-padded below 128 rows)
        A = tile_values(a_codes_t, a_sf_t, a0, g.cta_m, a_rows_ext, a0)
        B = tile_values(b_codes_t, b_sf_t, b0, g.tile_n, b_rows_ext, y * b_sf_tile)
        tm = torch.full((SF_ATOM_ROWS, g.tmem_alloc), float("nan"), dtype=torch.float32)
        tm[:, : g.tile_n] = (A[:, k0:k1].double() @ B[:, k0:k1].double().T).float()
        if a_is_w:
            tok0, ch0 = b0 // g.rpt, a0
        else:
            tok0, ch0 = a0 // g.rpt, b0
        stage = None
        if g.store == "tma" and g.split_k == 1:
            stage = torch.full((g.tokens_per_tile, g.channels_per_cta), float("nan"),
                               dtype=torch.bfloat16)
            staged = torch.zeros(g.tokens_per_tile, g.channels_per_cta, dtype=torch.int32)
        # every epilogue thread at once: thread T = 32 w + t of warp w (TMEM lanes 32 w ..)
        tl_all, cl_all, val_all = [], [], []
        for ins in plan:
            lanes = 32 * th_w.reshape(-1, 1) + ins.lane + fr_l
            colsj = ins.col + fr_c
            if bool(((lanes < 0) | (lanes >= SF_ATOM_ROWS) | (colsj < 0)
                     | (colsj >= g.tile_n)).any()):
                raise AssertionError("TMEM read outside the accumulator")
            regs = tm[lanes, colsj]                         # [128 threads, registers]
            for rb, rr in ins.pairs:
                tl, cl, res = g.out_coord(lanes[:, rb], colsj[:, rb])
                if bool((torch.as_tensor(res) != 0).any()):
                    raise AssertionError("a fold result taken from a residue element")
                val = regs[:, rb] * fac
                if rr >= 0:
                    ptl, pcl, pres = g.out_coord(lanes[:, rr], colsj[:, rr])
                    if not (torch.equal(ptl, tl) and torch.equal(pcl, cl)
                            and bool((pres == 1).all())):
                        raise AssertionError("fold pairs the wrong elements")
                    val = val + regs[:, rr] * fac           # mul.rn, mul.rn, add.rn (FP32)
                tl_all.append(tl)
                cl_all.append(cl)
                val_all.append(val)
        tl_v, cl_v, val_v = torch.cat(tl_all), torch.cat(cl_all), torch.cat(val_all)
        tok_v, ch_v = tok0 + tl_v, ch0 + cl_v
        live = (tok_v < m) & (ch_v < g.n)
        if g.split_k > 1:
            if g.reduce == "workspace":
                ws[((z * m + tok_v) * g.n + ch_v)[live]] = val_v[live]
            else:
                ws.index_put_(((tok_v * g.n + ch_v)[live],), val_v[live], accumulate=True)
        elif stage is not None:
            staged.index_put_((tl_v, cl_v), torch.ones_like(tl_v, dtype=torch.int32),
                              accumulate=True)
            stage[tl_v, cl_v] = _bf16(val_v)
            if bool((staged != 1).any()):
                raise AssertionError("the staging tile is not written exactly once")
            for tl in range(g.tokens_per_tile):
                if tok0 + tl < m:
                    out[tok0 + tl, ch0: ch0 + g.channels_per_cta] = stage[tl]
                    written[tok0 + tl, ch0: ch0 + g.channels_per_cta] += 1
        else:
            out[tok_v[live], ch_v[live]] = _bf16(val_v[live])
            written.index_put_((tok_v[live], ch_v[live]),
                               torch.ones(int(live.sum()), dtype=torch.int32), accumulate=True)
        if g.split_k > 1:
            key = (x, y)
            old = sem_state.get(key, 0)
            sem_state[key] = old + 1
            if old == g.split_k - 1:                      # the last CTA of this tile
                tk, cc = tok_v[live], ch_v[live]
                if g.reduce == "workspace":
                    tot = torch.zeros(tk.shape, dtype=torch.float32)
                    for s_ in range(g.split_k):                # split order, FP32 adds
                        tot = tot + ws[(s_ * m + tk) * g.n + cc]
                else:
                    tot = ws[tk * g.n + cc].clone()
                    ws[tk * g.n + cc] = 0.0
                out[tk, cc] = _bf16(tot)
                written.index_put_((tk, cc), torch.ones(tk.numel(), dtype=torch.int32),
                                   accumulate=True)
                sem_state[key] = 0
    if sem is not None and any(sem_state.values()):
        raise AssertionError("a split-K semaphore did not return to zero")
    if bool((written[:m] != 1).any()) or bool((written[m:] != 0).any()):
        raise AssertionError("outputs not written exactly once "
                             f"(min {int(written[:m].min())}, max {int(written.max())})")
    if g.reduce == "atomic" and ws is not None and bool((ws != 0).any()):
        raise AssertionError("the atomic workspace was not re-zeroed")
    return out
