"""Geometry and index math of the linear_sm100_tc kernels (Blackwell, tcgen05 block-scaled FP4
MMA), shared by the kernel template, the host side and the CPU simulation.

Every function here is pure integer math on Python ints; the ones the kernel calls with device
values (tmem_frag, the epilogue's output coordinates) use only +, *, //, % with a Python-int
divisor, so they work on CuTe DSL integers too and the kernel computes exactly the indices the
simulation checks.

The GEMM the kernel runs (CuTe DSL, tcgen05.mma.cta_group::{1,2}.kind::mxf4nvf4 / mxf4
.block_scale, operands K-major in shared memory, accumulator in tensor memory):
    C[i, j] = sum_k A[i, k] sfA[i, k / V] B[j, k] sfB[j, k / V]       (V = 16 NVFP4, 32 MXFP4)
Operand swap (host side: which tensor the launcher passes as A):
    swap = True   A = weights [N, Kp], B = activation rows [R, Kp]: TMEM lane = output channel,
                  TMEM column = activation row (the few decode rows on the MMA's narrow N)
    swap = False  A = activation rows, B = weights: lane = activation row, column = channel
Activation rows and scale-factor layout: resgen.kernels.sm100_layout (shared with quant_sm100).
M-Ext fold (the paper's semantics): y[t, c] = bf16(C[base(t), c] * f + C[residue(t), c] * f),
two FP32 products and one FP32 add, after the TMEM load, in one thread's registers;
f = alpha_x alpha_w (NVFP4; MXFP4: 1, its scales are inside the MMA). That is
resgen.reference.linear's formula term by term.

TMEM load fragments (which register of which thread holds which accumulator element):
resgen.kernels.sm100_layout.tmem_frag. From them,
the M-Ext pair of a swapped row_pair tile (adjacent columns) is thread-local with .32x32b
(rep >= 2) and .16x256b but not .16x128b; a swapped tile8 pair (columns c, c + 8) with
.32x32b x16+, .16x256b x2+, .16x128b x4+; an unswapped tile8 pair (lanes l, l + 8) with the
two .16x shapes only; an unswapped row_pair pair (lanes 2u, 2u + 1) never. ld_plan builds the
register pairs and proves them for all 32 threads, or says why it cannot.

Work decomposition: grid (x, y, z) = (A tiles x cta_group, B tiles, split_k), clusters of
(cluster_m, cluster_n, 1) CTAs; CTA (x, y, z) owns C rows a0 = (x // cta_group) tile_m +
(x % cta_group) 128 .. + 128 (a 2-SM MMA of tile_m = 256 puts each CTA's 128 rows in its own
TMEM), columns b0 = y tile_n .. + tile_n, and K tiles [z kt / split_k, (z + 1) kt / split_k)
of kt = Kp / tile_k. Warps 0-3 are the epilogue (warp w reads TMEM lanes 32 w .. + 31), warp 4
issues the MMAs, warp 5 the TMA loads.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from .sm100_layout import (MMA_K, ROW_LAYOUTS, SF_ATOM_BYTES, SF_ATOM_COLS, SF_ATOM_ROWS,
                           SMEM_BYTES, TMEM_COLS, TMEM_SHAPES, act_row, act_rows, pow2_ceil,
                           round_up, sf_cols, sf_offset, sf_row, sf_rows, sf_vec, tmem_frag,
                           tmem_span, token_of_row)

__all__ = ["MMA_K", "SF_ATOM_ROWS", "SF_ATOM_COLS", "SF_ATOM_BYTES", "ROW_LAYOUTS",
           "TMEM_SHAPES", "EPI_WARPS", "THREADS", "TMEM_COLS", "SMEM_BYTES", "sf_vec",
           "sf_cols", "sf_offset", "sf_row", "sf_rows", "act_rows", "act_row",
           "token_of_row", "tmem_frag", "tmem_span", "Sm100Geometry", "FoldPlanError",
           "pow2_ceil", "round_up"]

EPI_WARPS = 4              # warps 0..3: epilogue (one TMEM sub-partition each)
MMA_WARP = 4
TMA_WARP = 5
THREADS = 32 * 6
_BARRIER_BYTES = 1024      # mbarriers, TMEM address slot, split-K flag (rounded up)


class FoldPlanError(ValueError):
    """A TMEM load shape cannot give each thread whole base-residue pairs."""


@dataclass(frozen=True)
class LdInstr:
    """One TMEM load of an epilogue warp: its lane / column offsets inside the warp's 32-lane
    sub-partition and the accumulator tile, and the register pairs it folds."""

    lane: int
    col: int
    pairs: tuple[tuple[int, int], ...]   # (base register, residue register or -1)


def _out_coord(swap: bool, layout: str, i: Any, j: Any) -> tuple[Any, Any, Any]:
    """C element (row i, column j) of a tile -> (token, channel, is_residue) in the tile."""
    if swap:
        tok, res = token_of_row(j, layout)
        return tok, i, res
    tok, res = token_of_row(i, layout)
    return tok, j, res


@functools.lru_cache(maxsize=1024)
def _ld_plan(mode: str, layout: str, swap: bool, tile_n: int, shape: str, rep: int
             ) -> tuple[LdInstr, ...]:
    lanes, cols, nreg = tmem_span(shape, rep)
    if tile_n % cols:
        raise ValueError(f".{shape}.x{rep} loads {cols} columns; the accumulator tile has "
                         f"{tile_n}, not a multiple")
    return tuple(LdInstr(lane0, col0, _pairs(mode, layout, swap, shape, rep, lane0, col0))
                 for lane0 in range(0, 32, lanes) for col0 in range(0, tile_n, cols))


def _pairs(mode: str, layout: str, swap: bool, shape: str, rep: int, lane0: int, col0: int
           ) -> tuple[tuple[int, int], ...]:
    """Register pairs (base, residue) of one load, the same for every thread, proven for all
    32 threads and every sub-partition; residue -1 without M-Ext."""
    nreg = tmem_span(shape, rep)[2]
    if mode != "mext":
        return tuple((r, -1) for r in range(nreg))
    step = 1 if layout == "row_pair" else 8          # base row -> its residue row
    pairs = []
    for rb in range(nreg):
        dl, dc = tmem_frag(shape, 0, rb)
        i, j = lane0 + dl, col0 + dc
        if _out_coord(swap, layout, i, j)[2]:
            continue
        pi, pj = (i, j + step) if swap else (i + step, j)
        hit = [r for r in range(nreg)
               if (lane0 + tmem_frag(shape, 0, r)[0], col0 + tmem_frag(shape, 0, r)[1])
               == (pi, pj)]
        if not hit:
            raise FoldPlanError(
                f"{'swapped' if swap else 'unswapped'} {layout} tile: the residue of "
                f"C[{i}, {j}] is not in the same thread's registers of .{shape}.x{rep}")
        pairs.append((rb, hit[0]))
    for t in range(32):
        for q in range(EPI_WARPS):
            for rb, rr in pairs:
                bl, bc = tmem_frag(shape, t, rb)
                rl, rc = tmem_frag(shape, t, rr)
                tb = _out_coord(swap, layout, 32 * q + lane0 + bl, col0 + bc)
                tr = _out_coord(swap, layout, 32 * q + lane0 + rl, col0 + rc)
                if tb[:2] != tr[:2] or (tb[2], tr[2]) != (0, 1):
                    raise FoldPlanError(f".{shape}.x{rep}: thread {t} pairs {tb} with {tr}")
    if 2 * len(pairs) != nreg:
        raise FoldPlanError(f".{shape}.x{rep}: {nreg} registers do not split into "
                            "base-residue pairs")
    return tuple(pairs)


@dataclass(frozen=True)
class Sm100Geometry:
    """Compile-time constants of one linear_sm100_tc kernel (a variant specialized on N, Kp)."""

    fmt: str
    mode: str            # "plain" | "mext" | "kext"
    layout: str          # activation rows: "plain" | "row_pair" | "tile8"
    swap: bool           # weights are the MMA's A operand (tokens on the narrow N side)
    n: int               # output channels
    kp: int              # reduction length as the MMA sees it (K or K + ext, padded)
    tile_m: int          # MMA M: 128 (cta_group 1) or 256 (cta_group 2)
    tile_n: int          # MMA N: 8..256
    tile_k: int          # K per pipeline stage: 128 or 256 (2 or 4 MMAs)
    cta_group: int       # 1 or 2 (2-SM MMA: a CTA pair shares one 256-row tile)
    cluster_m: int
    cluster_n: int
    stages: int          # TMA -> MMA shared-memory ring depth
    tmem_shape: str      # "32x32b" | "16x256b" | "16x128b"
    tmem_rep: int        # .x<rep>
    store: str           # "direct" (st.global from registers) | "tma" (shared memory, bulk copy)
    split_k: int
    reduce: str          # "none" | "workspace" (partials + semaphore, split order) | "atomic"

    # ------------------------------------------------------------------ derived
    @property
    def sfv(self) -> int:
        return sf_vec(self.fmt)

    @property
    def rpt(self) -> int:
        """Activation rows per token (2 for M-Ext)."""
        return 2 if self.mode == "mext" else 1

    @property
    def cta_m(self) -> int:
        """C rows (TMEM lanes) one CTA holds: always 128."""
        return self.tile_m // self.cta_group

    @property
    def kt(self) -> int:
        """K tiles of the whole reduction."""
        return self.kp // self.tile_k

    @property
    def kt_split(self) -> int:
        """K tiles of one CTA (split-K splits evenly)."""
        return self.kt // self.split_k

    @property
    def w_tile(self) -> int:
        """Weight rows (channels) of one MMA tile."""
        return self.tile_m if self.swap else self.tile_n

    @property
    def a_tile(self) -> int:
        """Activation rows of one MMA tile."""
        return self.tile_n if self.swap else self.tile_m

    @property
    def act_sf_tile(self) -> int:
        """Rows of the MMA tile the activation's SF tensor is tile-padded for (128: whole
        atoms, no padding)."""
        return min(self.tile_n, SF_ATOM_ROWS) if self.swap else SF_ATOM_ROWS

    @property
    def w_rows(self) -> int:
        """Weight rows as stored: N padded to whole weight tiles."""
        return round_up(self.n, self.w_tile)

    @property
    def sfc(self) -> int:
        return sf_cols(self.kp, self.fmt)

    @property
    def tokens_per_tile(self) -> int:
        """Tokens of one activation tile (a CTA's for swap, a CTA's 128 lanes otherwise)."""
        rows = self.tile_n if self.swap else self.cta_m
        return rows // self.rpt

    @property
    def channels_per_cta(self) -> int:
        return self.cta_m if self.swap else self.tile_n

    # ------------------------------------------------------------------ budgets
    @property
    def tmem_acc_cols(self) -> int:
        return self.tile_n

    @property
    def tmem_sf_cols(self) -> int:
        """TMEM columns of the SFA and SFB tiles (CUTLASS's blockscaled example: 4 columns
        per 32 SF rows and MMA instruction of the K tile; SFB rows rounded up to 128)."""
        kblk = self.tile_k // MMA_K
        sfa = (self.cta_m // 32) * kblk
        sfb = (round_up(self.tile_n, SF_ATOM_ROWS) // 32) * kblk
        return sfa + sfb

    @property
    def tmem_alloc(self) -> int:
        """Columns the CTA allocates (a power of two >= 32)."""
        return max(32, pow2_ceil(self.tmem_acc_cols + self.tmem_sf_cols))

    @property
    def stage_bytes(self) -> int:
        """Shared memory of one pipeline stage (A, B, SFA, SFB tiles of one CTA)."""
        a = self.cta_m * self.tile_k // 2
        b = (self.tile_n // self.cta_group) * self.tile_k // 2
        sfa = self.cta_m * self.tile_k // self.sfv
        sfb = round_up(self.tile_n, SF_ATOM_ROWS) * self.tile_k // self.sfv
        return a + b + sfa + sfb

    @property
    def epi_smem_bytes(self) -> int:
        """The store path's staging tile (tma): the CTA's outputs as bf16."""
        if self.store != "tma":
            return 0
        return self.tokens_per_tile * self.channels_per_cta * 2

    @property
    def smem_bytes(self) -> int:
        return self.stages * self.stage_bytes + self.epi_smem_bytes + _BARRIER_BYTES

    @property
    def regs_per_ld(self) -> int:
        return tmem_span(self.tmem_shape, self.tmem_rep)[2]

    # ------------------------------------------------------------------ grid
    def grid(self, act_rows_: int) -> tuple[int, int, int]:
        """Launch grid for act_rows_ activation rows (rounded up to whole clusters)."""
        a_rows = self.w_rows if self.swap else act_rows_
        b_rows = act_rows_ if self.swap else self.w_rows
        gx = -(-a_rows // self.tile_m) * self.cta_group
        gy = -(-b_rows // self.tile_n)
        return (round_up(gx, self.cluster_m), round_up(gy, self.cluster_n), self.split_k)

    def cta_origin(self, x: Any, y: Any) -> tuple[Any, Any]:
        """(first C row, first C column) of CTA (x, y)."""
        return (x // self.cta_group) * self.tile_m + (x % self.cta_group) * self.cta_m, \
            y * self.tile_n

    def k_tiles(self, z: Any) -> tuple[Any, Any]:
        """[first, end) K tiles of split z."""
        return z * self.kt_split, (z + 1) * self.kt_split

    # ------------------------------------------------------------------ epilogue
    def out_coord(self, i: Any, j: Any) -> tuple[Any, Any, Any]:
        """C element (row i, column j) of the CTA's tile -> (token, channel, is_residue),
        token and channel relative to the tile's first."""
        return _out_coord(self.swap, self.layout, i, j)

    def ld_plan(self) -> tuple[LdInstr, ...]:
        """The TMEM loads of one epilogue warp, covering its 32 lanes x tile_n columns, each
        with the register pairs it folds; raises FoldPlanError / ValueError when the shape
        cannot (cached per (mode, layout, swap, tile_n, shape, rep): nothing else enters)."""
        return _ld_plan(self.mode, self.layout, self.swap, self.tile_n, self.tmem_shape,
                        self.tmem_rep)

    # ------------------------------------------------------------------ check
    def check(self) -> None:
        """Raise ValueError for constants the kernel cannot run (why_invalid catches these
        first, with the axis named)."""
        if self.fmt not in ("nvfp4", "mxfp4"):
            raise ValueError(f"unknown format {self.fmt!r}")
        if self.mode not in ("plain", "mext", "kext"):
            raise ValueError(f"unknown mode {self.mode!r}")
        if (self.mode == "mext") != (self.layout in ("row_pair", "tile8")):
            raise ValueError("M-Ext uses the row_pair or tile8 rows, everything else plain")
        if self.cta_group not in (1, 2) or self.tile_m != 128 * self.cta_group:
            raise ValueError(f"tile_m {self.tile_m} with cta_group {self.cta_group}")
        step = 8 * self.cta_group
        if not (step <= self.tile_n <= 256 and self.tile_n % step == 0):
            raise ValueError(f"tile_n {self.tile_n}: {step} <= N <= 256, N % {step} == 0")
        if self.tile_k not in (128, 256) or self.kp % self.tile_k:
            raise ValueError(f"tile_k {self.tile_k} for Kp {self.kp}")
        if self.kt % self.split_k:
            raise ValueError(f"{self.kt} K tiles over split_k {self.split_k}")
        if (self.split_k > 1) != (self.reduce != "none"):
            raise ValueError("split_k > 1 needs a reduction and only then")
        if self.tile_n < SF_ATOM_ROWS and SF_ATOM_ROWS % self.tile_n:
            raise ValueError(f"tile_n {self.tile_n} does not divide the 128-row SF atom")
        if not self.swap and self.tile_n % SF_ATOM_ROWS:
            raise ValueError("unswapped weights as B need a channel tile of 128 or 256")
        if self.mode == "mext" and self.a_tile % (2 if self.layout == "row_pair" else 16):
            raise ValueError(f"{self.layout} rows do not tile {self.a_tile} activation rows")
        if self.cluster_m % self.cta_group:
            raise ValueError("a 2-SM MMA needs cluster_m to be a multiple of 2")
        if self.tmem_alloc > TMEM_COLS:
            raise ValueError(f"{self.tmem_alloc} TMEM columns (at most {TMEM_COLS})")
        if self.smem_bytes > SMEM_BYTES:
            raise ValueError(f"{self.smem_bytes} bytes of shared memory (at most {SMEM_BYTES})")
        if self.store == "tma" and self.n % self.channels_per_cta:
            raise ValueError("the tma store writes whole channel tiles")
        self.ld_plan()
