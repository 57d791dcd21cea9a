"""Geometry and index math of the linear_sm90_mma kernels, shared by the kernel template and a
pure-Python simulation of the kernel that the CPU tests run.

Every offset function works on Python ints (simulation) and on CuTe DSL integers (the kernel
passes Int32 / Int64 values; byte offsets that can exceed 2^31 are formed from an Int64 first
factor), so the addresses the kernel computes are exactly the ones the simulation checks.

Work decomposition (grid x = channel blocks, y = K splits, z = token tiles):
    CTA (bx, by, bz), warp w = wm + WM wk, lane = 4 g + t
    m16 tiles   (bx WM + wm) MT .. + MT
    K groups    slice s = by WK + wk of SPLIT WK equal slices, GS = NG / (SPLIT WK) groups each
                (a group = 4 chunks of 64 columns = one scale vector); an iteration eats U groups
    xop rows    bz TOK .. + TOK; n8 tile nt holds rows bz TOK + 8 nt + 0..7 (those past TOK,
                when TOK < 8 NT, belong to no tile of this CTA: their B values are zero and
                nothing is stored for them)

Activation source ("act"):
    xop     the exact-BF16 operand prepared by a quantizer, bf16 [T_pad, Kp] in global memory;
            TOK = 8 NT
    fused   the CTA quantizes its own operand tile from the BF16 activations x [m, K] into
            shared memory before the main loop: TOK rows (TOK <= 8 NT, a power of two) x KCTA =
            Kp / SPLIT columns (the CTA's K range), row stride KCTA * 2 + 16 bytes (the 16-byte
            skew makes the 8 rows of an n8 tile hit different banks). Work items are
            (token, BS-column block) pairs of the CTA's real tokens, handed to threads
            round-robin; an item writes base (+ residue row for M-Ext) or a K-Ext extension
            block (recomputing the 8 / KSEL base blocks it selects residues from) or zeros.
            With a cluster of CL CTAs along x (CL > 1: CTAs of neighbouring channel blocks,
            same K range and tokens, so the same operand tile), the items are dealt over the
            CL x threads of the cluster and every item is stored into the tile of each CTA of
            the cluster (distributed shared memory): each CTA quantizes 1 / CL of its tile.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Geometry"]


@dataclass(frozen=True)
class Geometry:
    """Compile-time constants of one kernel (a variant specialized on N and Kp)."""

    fmt: str
    mext: bool
    packing: str
    n: int
    kq: int            # Kp / 64
    warps_m: int
    warps_k: int
    m_tiles: int
    n_tiles: int
    groups: int        # U
    pipeline: str      # "direct" | "regs" | "cp_async" | "bulk"
    stages: int        # cp_async: ring depth (iterations in flight + 1); bulk: ring depth
                       # (iterations in flight); else 1
    l2_prefetch: int   # iterations ahead that lane 0 bulk-prefetches into L2 (0: none)
    split_k: int
    reduce: str        # "none" | "atomic" | "workspace"
    act: str = "xop"   # "xop" | "fused"
    pdl: bool = False  # programmatic dependent launch (griddepcontrol)
    k: int = 0         # real input channels K (fused; 0: unused)
    ksel: int = 0      # K-Ext channels selected per 8-channel group (0: no extension)
    tok_rows: int = 0  # fused: xop rows per CTA (TOK); 0 for xop (TOK = 8 NT)
    cluster: int = 1   # fused: CTAs along x that share one quantization of the operand tile

    # ------------------------------------------------------------------ derived constants
    @property
    def nv(self) -> bool:
        return self.fmt == "nvfp4"

    @property
    def fused(self) -> bool:
        return self.act == "fused"

    @property
    def ng(self) -> int:
        return self.kq // 4

    @property
    def kp(self) -> int:
        return self.kq * 64

    @property
    def threads(self) -> int:
        return 32 * self.warps_m * self.warps_k

    @property
    def cg(self) -> int:
        """K groups of one CTA's range (cross-CTA split-K splits evenly)."""
        return self.ng // self.split_k

    @property
    def ragged(self) -> bool:
        """The CTA's groups do not split evenly over its warps_k K slices: slice wk takes
        groups [wk cg / WK, (wk + 1) cg / WK) (floors), so slices differ by at most one group
        and only the last iteration (gs - 1) is conditional (one group per iteration)."""
        return self.cg % self.warps_k != 0

    @property
    def gs(self) -> int:
        """Groups of the longest K slice of a warp."""
        return -(-self.cg // self.warps_k)

    def wstart(self, wk: Any) -> Any:
        """First group of warp slice wk inside the CTA's range (wk may be a device value)."""
        if not self.ragged:
            return wk * self.gs
        return (wk * self.cg) // self.warps_k

    def slice_groups(self, wk: Any) -> Any:
        """Groups of warp slice wk (gs or, when ragged, possibly gs - 1)."""
        return self.wstart(wk + 1) - self.wstart(wk)

    @property
    def nit(self) -> int:
        return self.gs // self.groups

    @property
    def grid_x(self) -> int:
        return self.n // (16 * self.m_tiles * self.warps_m)

    @property
    def tok(self) -> int:
        """xop rows per CTA."""
        return self.tok_rows if self.fused else 8 * self.n_tiles

    @property
    def rpt(self) -> int:
        """xop rows per token (M-Ext: base + residue)."""
        return 2 if self.mext else 1

    @property
    def sl(self) -> int:
        return 32 if self.nv else 16

    @property
    def acc(self) -> int:
        return self.m_tiles * self.n_tiles * 4

    @property
    def tile(self) -> int:
        """FP32 accumulator values per CTA after the in-CTA K reduction."""
        return self.warps_m * self.acc * 32

    # fused operand tile
    @property
    def bs(self) -> int:
        """Quantization block (16 NVFP4, 32 MXFP4)."""
        return 16 if self.nv else 32

    @property
    def kcta(self) -> int:
        """xop columns of one CTA's K range."""
        return self.kp // self.split_k

    @property
    def nb(self) -> int:
        """Quantization blocks per row of the CTA's K range."""
        return self.kcta // self.bs

    @property
    def kqe(self) -> int:
        """Operand columns before padding: K, or K + extension (K-Ext)."""
        return self.k + self.k * self.ksel // 8

    @property
    def xs_stride(self) -> int:
        return self.kcta * 2 + 16

    @property
    def xs_bytes(self) -> int:
        return self.tok * self.xs_stride if self.fused else 0

    @property
    def nsrc(self) -> int:
        """K-Ext: base blocks one extension block selects its residues from."""
        return 8 // self.ksel if self.ksel else 0

    @property
    def ringed(self) -> bool:
        """Weights and scales go through a per-warp shared-memory ring (cp_async, bulk)."""
        return self.pipeline in ("cp_async", "bulk")

    @property
    def smem_bytes(self) -> int:
        """Shared memory of one CTA: cp.async / bulk rings (+ the bulk ring's mbarriers) +
        in-CTA reduction + fused operand tile + flag."""
        ring = 0
        if self.ringed:
            ring = self.warps_m * self.warps_k * self.stages * self.groups * self.m_tiles * 2304
        if self.pipeline == "bulk":
            ring += self.warps_m * self.warps_k * self.stages * 8
        red = (self.warps_k - 1) * self.warps_m * self.acc * 32 * 4
        return ring + red + self.xs_bytes + (16 if self.reduce == "workspace" else 0)

    def check(self) -> None:
        """Raise ValueError if the constants do not describe a runnable kernel."""
        if self.pipeline not in ("direct", "regs", "cp_async", "bulk"):
            raise ValueError(f"unknown pipeline {self.pipeline!r}")
        if self.act not in ("xop", "fused"):
            raise ValueError(f"unknown activation source {self.act!r}")
        if self.ringed != (self.stages > 1):
            raise ValueError("stages > 1 exactly for the cp_async and bulk pipelines")
        if self.smem_bytes > 227 * 1024:
            raise ValueError("shared memory above 227 KB per CTA")
        if self.n % (16 * self.m_tiles * self.warps_m):
            raise ValueError("N must be a multiple of 16 * m_tiles * warps_m")
        if self.kq % 4 or self.ng % self.split_k:
            raise ValueError("K groups must split evenly over split_k")
        if self.ragged:
            if self.groups != 1 or self.pipeline == "regs":
                raise ValueError("ragged K slices: one group per iteration, and the direct, "
                                 "cp_async or bulk pipeline")
            if self.warps_k & (self.warps_k - 1) or self.cg < self.warps_k:
                raise ValueError("ragged K slices: warps_k a power of two, at most the CTA's "
                                 "K groups")
        elif self.gs % self.groups:
            raise ValueError("K groups must split evenly over split_k * warps_k * groups")
        if (self.split_k > 1) != (self.reduce != "none"):
            raise ValueError("split_k > 1 needs a reduction, split_k == 1 none")
        if self.fused:
            t = self.tok
            if t < self.rpt or t > 8 * self.n_tiles or t & (t - 1):
                raise ValueError("fused: TOK must be a power of two in [rows per token, 8 NT]")
            if self.k <= 0 or self.k % self.bs or self.k % 8 or self.kqe > self.kp:
                raise ValueError("fused: K must be a positive multiple of the block and of 8, "
                                 "K (+ extension) <= Kp")
            if self.ksel not in (0, 1, 2, 4, 8) or (self.ksel and self.mext):
                raise ValueError("fused: KSEL must be 0, 1, 2, 4 or 8 (K-Ext only)")
            if self.ksel and (self.k * self.ksel // 8) % self.bs:
                raise ValueError("fused K-Ext: the extension must fill whole blocks")
        elif self.tok_rows or self.ksel:
            raise ValueError("tok_rows / ksel only apply to the fused activation source")
        if self.cluster not in (1, 2, 4):
            raise ValueError("cluster must be 1, 2 or 4 CTAs")
        if self.cluster > 1 and not self.fused:
            raise ValueError("a cluster shares the fused quantization: fused variants only")
        if self.grid_x % self.cluster:
            raise ValueError("the channel blocks (grid x) must be a multiple of the cluster")

    def grid(self, rows: int) -> tuple[int, int, int]:
        return self.grid_x, self.split_k, -(-rows // self.tok)

    def ws_floats(self, rows: int, m: int) -> int:
        """FP32 workspace the launch needs."""
        if self.reduce == "atomic":
            return m * self.n
        if self.reduce == "workspace":
            gx, gy, gz = self.grid(rows)
            return gx * gz * gy * self.tile
        return 0

    def sem_count(self, rows: int) -> int:
        if self.reduce != "workspace":
            return 0
        gx, _, gz = self.grid(rows)
        return gx * gz

    # ------------------------------------------------------------------ per-thread coordinates
    def warp_coords(self, tid: Any, bx: Any, by: Any, bz: Any):
        """(lane, wm, wk, g, t, mt0, grp0, row0, sl) of thread tid of CTA (bx, by, bz)."""
        lane = tid % 32
        warp = tid // 32
        wm = warp % self.warps_m
        wk = warp // self.warps_m
        g = lane // 4
        t = lane % 4
        mt0 = (bx * self.warps_m + wm) * self.m_tiles
        grp0 = by * self.cg + self.wstart(wk)
        row0 = bz * self.tok
        sl = lane if self.nv else 2 * g + t // 2
        return lane, wm, wk, g, t, mt0, grp0, row0, sl

    # ------------------------------------------------------------------ byte offsets
    def w_off(self, mt: Any, kq: Any, lane: Any) -> Any:
        """Weight vector (16 bytes) of lane at (m16 tile, chunk); mt may be Int64."""
        return ((mt * self.kq + kq) * 32 + lane) * 16

    def s_off(self, mt: Any, grp: Any, sl: Any) -> Any:
        """Scale vector (8 bytes) of scale slot sl at (m16 tile, group)."""
        return ((mt * self.ng + grp) * self.sl + sl) * 8

    def x_off(self, row: Any, kq: Any, t: Any) -> Any:
        """First of the lane's two 16-byte activation vectors of chunk kq (row may be Int64):
        columns 64 kq + 16 t .. + 15 of xop row `row`."""
        return (row * self.kp + kq * 64 + 16 * t) * 2

    def y_off(self, tok: Any, ch: Any) -> Any:
        """BF16 output element (token, channel); tok may be Int64."""
        return (tok * self.n + ch) * 2

    def acc_coords(self, mt: int, nt: int, e: int, mt0: Any, row0: Any, g: Any, t: Any):
        """(channel, xop row) of accumulator element e (c0..c3) of tile (mt, nt)."""
        ch = (mt0 + mt) * 16 + g + 8 * (e // 2)
        row = row0 + 8 * nt + 2 * t + e % 2
        return ch, row

    # ------------------------------------------------------------------ epilogue
    @property
    def partial_tile(self) -> bool:
        """Rows of an n8 tile past TOK belong to no tile of this CTA (fused, TOK < 8 NT)."""
        return self.tok < 8 * self.n_tiles

    def epilogue_plan(self, mt: int, nt: int, mt0: Any, row0: Any, g: Any,
                      t: Any) -> EpiloguePlan:
        """The fold / store plan of accumulator tile (mt, nt) of lane (g, t) of the warp whose
        first m16 tile is mt0 and first xop row row0 (warp_coords): M-Ext folds the base and
        residue columns into one token, plain (and presum) stores each column's token."""
        ch, row = self.acc_coords(mt, nt, 0, mt0, row0, g, t)
        rloc = 8 * nt + 2 * t
        if self.mext:
            return EpiloguePlan(ch, row // 2, rloc, _MEXT_ROWS)
        return EpiloguePlan(ch, row, rloc, _PLAIN_ROWS)

    def out_ok(self, rloc: Any, tok: Any, m: Any) -> Any:
        """Row predicate of an output row: its token is a real one (< m) and, when tiles are
        partial, its xop row rloc (EpiloguePlan.local_row) is one of the CTA's TOK rows."""
        ok = tok < m
        if self.partial_tile:
            ok = ok & (rloc < self.tok)
        return ok

    def out_factor(self, alphas: Any, two7: Any) -> Any:
        """The epilogue factor fac: alpha_x alpha_w 2^7 (NVFP4) or 2^7 (MXFP4); the operand
        and the decoded weights carry 2^-7 (docs/linear_sm90.md, "Numerics"). two7: 2^7 in
        the caller's FP32 type; alphas(): (alpha_x, alpha_w), called for NVFP4 only (the
        kernel's loads)."""
        if not self.nv:
            return two7
        ax, aw = alphas()
        return ax * aw * two7

    def sw_off(self, warp: Any, slot: Any, u: int, mt: int, i: int, lane: Any) -> Any:
        """cp.async ring: the lane's 16-byte weight vector (chunk i of group u, tile mt)."""
        return (((((warp * self.stages + slot) * self.groups + u) * self.m_tiles + mt) * 4 + i)
                * 512 + lane * 16)

    def ss_off(self, warp: Any, slot: Any, u: int, mt: int, lane: Any) -> Any:
        """cp.async ring: the lane's 8-byte scale vector (group u, tile mt)."""
        return ((((warp * self.stages + slot) * self.groups + u) * self.m_tiles + mt) * 256
                + lane * 8)

    # ------------------------------------------------------------------ bulk ring
    @property
    def bulk_tx_bytes(self) -> int:
        """Bytes one iteration's bulk copies complete on its mbarrier: per (group, m16 tile)
        the 4 chunks' weights (2048) and the group's scale vectors (SL x 8)."""
        return self.groups * self.m_tiles * (2048 + self.sl * 8)

    def bar_off(self, warp: Any, slot: Any) -> Any:
        """Byte offset of the mbarrier of ring slot `slot` of warp `warp`."""
        return (warp * self.stages + slot) * 8

    def bulk_copies(self, mt0: Any, grp0: Any, it: Any, warp: Any, slot: Any):
        """The copy-engine transfers that fill ring slot `slot` of warp `warp` with iteration
        `it`: (is_scale, shared-memory byte offset in its ring, global byte offset, bytes).
        Each lands exactly where the cp_async pipeline's lanes would have put the same bytes
        (sw_off / ss_off), except that a scale slot's 8 bytes sit at position SL (not at the
        lane): a lane reads them back at ss_off(..., sl)."""
        out = []
        for u in range(self.groups):
            grp = grp0 + it * self.groups + u
            for mt in range(self.m_tiles):
                out.append((False, self.sw_off(warp, slot, u, mt, 0, 0),
                            self.w_off(mt0 + mt, grp * 4, 0), 2048))
                out.append((True, self.ss_off(warp, slot, u, mt, 0),
                            self.s_off(mt0 + mt, grp, 0), self.sl * 8))
        return out

    def prefetch_spans(self, mt0: Any, grp0: Any, it: Any):
        """(byte offset, bytes) of the weight and scale spans iteration `it` of a warp reads,
        one pair per m16 tile: U groups are contiguous in both layouts."""
        out = []
        for mt in range(self.m_tiles):
            grp = grp0 + it * self.groups
            out.append((self.w_off(mt0 + mt, grp * 4, 0), self.groups * 2048))
            out.append((self.s_off(mt0 + mt, grp, 0), self.groups * self.sl * 8))
        return out

    def ws_off(self, tile: Any, split: Any, wm: Any, q: int, lane: Any) -> Any:
        """FP32 element of the workspace reduction: CTA tile, split index, accumulator q."""
        return ((tile * self.split_k + split) * self.tile + (wm * self.acc + q) * 32 + lane) * 4

    # ------------------------------------------------------------------ fused operand tile
    def xs_row(self, rloc: Any) -> Any:
        """Shared-memory byte offset of local xop row rloc (0 .. TOK - 1) of the tile."""
        return rloc * self.xs_stride

    def xs_col(self, wk: Any, it: Any, u: int, i: int, t: Any) -> Any:
        """Byte offset inside a tile row of the lane's first 16-byte B vector: chunk i of group
        u of iteration it of warp slice wk, columns 16 t .. 16 t + 15 of that chunk."""
        return ((((self.wstart(wk) + it * self.groups + u) * 4 + i) * 64) + 16 * t) * 2

    def item_start(self, rank: Any, tid: Any) -> Any:
        """First work item of thread tid of cluster rank `rank` (items advance by
        item_step)."""
        return rank * self.threads + tid

    @property
    def item_step(self) -> int:
        return self.threads * self.cluster

    def item(self, it: Any) -> tuple[Any, Any]:
        """Work item -> (token of the tile, block of the CTA's K range)."""
        tk = it // self.nb
        return tk, it - tk * self.nb

    def item_col(self, by: Any, b: Any) -> Any:
        """xop column of block b of K split by."""
        return by * self.kcta + b * self.bs

    def ext_src(self, col: Any) -> Any:
        """K-Ext: the first input channel whose residue extension column col (>= K) selects
        from; the extension block reads 8 / KSEL base blocks from there."""
        return (col - self.k) * 8 // self.ksel

    def x_elem(self, tok: Any, ch: Any) -> Any:
        """Byte offset of x[tok, ch] (bf16 [m, K]); tok may be Int64."""
        return (tok * self.k + ch) * 2


# ----------------------------------------------------------------------------- epilogue plan
# (Geometry.epilogue_plan: the fold / store plan the kernel and the simulation share)


def _plus(v: Any, d: int) -> Any:
    """v + d, and v itself for d = 0 (no add of zero is emitted into the kernel)."""
    return v + d if d else v


def _fold(acc: Any, o: int, idx: tuple[int, ...]) -> Any:
    """acc[o + q] summed over q in idx, in that order (one term: the value itself)."""
    v = acc[o + idx[0]]
    for q in idx[1:]:
        v = v + acc[o + q]
    return v


@dataclass(frozen=True)
class EpilogueRow:
    """One output row of a lane's m16 x n8 accumulator tile. The tile's c0 c1 / c2 c3 hold
    channels ch / ch + 8 at accumulator columns 2t, 2t + 1 (Geometry.acc_coords); this row is
    token `tok + col` of the EpiloguePlan and takes
        Y[tok + col, ch]     = fac x (sum of c[q], q in lo)
        Y[tok + col, ch + 8] = fac x (sum of c[q], q in hi)."""

    col: int                  # token offset from the plan's first token
    lo: tuple[int, ...]       # accumulator elements (0..3) folded into channel ch
    hi: tuple[int, ...]       # ... into channel ch + 8


# M-Ext: columns 2t, 2t + 1 are one token's base and residue rows, folded (c0 + c1, c2 + c3)
_MEXT_ROWS = (EpilogueRow(0, (0, 1), (2, 3)),)
# plain (and presum, whose accumulator columns are tokens: one product, no fold): one token
# per column
_PLAIN_ROWS = (EpilogueRow(0, (0,), (2,)), EpilogueRow(1, (1,), (3,)))


@dataclass(frozen=True)
class EpiloguePlan:
    """Where a lane's m16 x n8 accumulator tile (mt, nt) goes: Geometry.epilogue_plan. Pure
    index math on Python ints (simulation: int / torch [lanes]) or DSL integers (kernel);
    the kernel's store / atomic epilogues and the simulation's both read it, so the fold,
    the output coordinates and the row predicate are written once."""

    ch: Any                             # channel of c0 / c1 (c2 / c3: ch + 8)
    tok: Any                            # token of the first row (M-Ext: xop row // 2)
    rloc: Any                           # xop row of column 2t relative to the CTA's first
    rows: tuple[EpilogueRow, ...]

    def token(self, r: EpilogueRow) -> Any:
        """Output token of row r."""
        return _plus(self.tok, r.col)

    def local_row(self, r: EpilogueRow) -> Any:
        """Row r's position among the CTA's xop rows (M-Ext: its base row's), for the row
        predicate (Geometry.out_ok)."""
        return _plus(self.rloc, r.col)

    def values(self, acc: Any, o: int, r: EpilogueRow, fac: Any) -> tuple[Any, Any]:
        """Row r's (channel ch, channel ch + 8) FP32 values: the folded accumulators times the
        epilogue factor fac (Geometry.out_factor). acc[o + 0..3]: the tile's c0..c3."""
        return _fold(acc, o, r.lo) * fac, _fold(acc, o, r.hi) * fac
