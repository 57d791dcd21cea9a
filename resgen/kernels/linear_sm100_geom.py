"""Geometry and index math of the linear_sm100_tc kernels (Blackwell, tcgen05 block-scaled FP4
MMA), shared by the kernel template, the host-side layouts, the quantizer and the CPU
simulation.

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
Activation rows (what the quantizer writes; R rows for T tokens):
    plain     row t = token t (plain W4A4 and K-Ext, whose extension is extra K columns)
    row_pair  row 2t = base of token t, 2t + 1 = its residue (M-Ext)
    tile8     per 16 rows: 8 base rows (tokens 8b..8b+7), then their 8 residue rows (M-Ext)
M-Ext fold (the paper's semantics): y[t, c] = bf16(C[base(t), c] * f + C[residue(t), c] * f),
two FP32 products and one FP32 add, after the TMEM load, in one thread's registers;
f = alpha_x alpha_w (NVFP4; MXFP4: 1, its scales are inside the MMA). That is
resgen.reference.linear's formula term by term.

Scale factors (SF) live in the tcgen05 block-scaled layout (CUTLASS BlockScaledBasicChunk, the
layout CUTLASS's tile_atom_to_shape_SF builds): 512-byte atoms of 128 rows x 4 SF columns,
    offset(r, b) = ((r // 128) * (SFC // 4) + b // 4) * 512 + (r % 32) * 16
                   + ((r // 32) % 4) * 4 + b % 4
for row r and SF column b = k // V (SFC = SF columns, a multiple of 4). The MMA's scale-factor
tile is always 128 rows, so an operand whose MMA tile has fewer rows (the B operand with a
tile of 8..64 activation rows) is stored "tile-padded": the rows of tile z start at SF row
128 z (sf_row). The weights as A (swap) or as B with a channel tile of 128 / 256 rows need no
padding.

TMEM loads (tcgen05.ld.sync.aligned.<shape>.x<rep>.b32; a warp reaches only the 32 lanes
32 (warp % 4) .. + 31 of its sub-partition): register r of thread t holds, relative to the
instruction's (lane, column) address (tmem_frag; the PTX ISA fragment layouts, CUTLASS
SM100_TMEM_LOAD_* traits, checked against CuTe DSL's own partition in the tests):
    32x32b   lane t,               column r                         (rep columns, 32 lanes)
    16x256b  lane t//4 + 8 h,      column 8 q + 2 (t % 4) + j       (r = j + 2 h + 4 q)
    16x128b  lane t//4 + 8 h,      column 4 q + t % 4               (r = h + 2 q)
so the M-Ext pair of a swapped row_pair tile (adjacent columns) is thread-local with .32x32b
(rep >= 2) and .16x256b but not .16x128b; a swapped tile8 pair (columns c, c + 8) with
.32x32b x16+, .16x256b x2+, .16x128b x4+; an unswapped tile8 pair (lanes l, l + 8) with the
two .16x shapes only; an unswapped row_pair pair (lanes 2u, 2u + 1) never. fold_plan builds the
register pairs and proves them for all 32 threads, or says why it cannot.

Work decomposition: grid (x, y, z) = (A tiles x cta_group, B tiles, split_k), clusters of
(cluster_m, cluster_n, 1) CTAs; CTA (x, y, z) owns C rows a0 = (x // cta_group) tile_m +
(x % cta_group) 128 .. + 128 (a 2-SM MMA of tile_m = 256 puts each CTA's 128 rows in its own
TMEM), columns b0 = y tile_n .. + tile_n, and K tiles [z kt / split_k, (z + 1) kt / split_k)
of kt = Kp / tile_k. Warps 0-3 are the epilogue (warp w reads TMEM lanes 32 w .. + 31), warp 4
issues the MMAs, warp 5 the TMA loads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["MMA_K", "SF_ATOM_ROWS", "SF_ATOM_COLS", "SF_ATOM_BYTES", "ROW_LAYOUTS",
           "TMEM_SHAPES", "EPI_WARPS", "THREADS", "TMEM_COLS", "SMEM_BYTES", "sf_vec",
           "sf_cols", "sf_offset", "sf_row", "sf_rows", "act_rows", "act_row",
           "token_of_row", "tmem_frag", "tmem_span", "Sm100Geometry", "FoldPlanError",
           "pow2_ceil", "round_up"]

MMA_K = 64                 # K of one block-scaled FP4 MMA instruction
SF_ATOM_ROWS = 128
SF_ATOM_COLS = 4
SF_ATOM_BYTES = SF_ATOM_ROWS * SF_ATOM_COLS
ROW_LAYOUTS = ("plain", "row_pair", "tile8")
TMEM_SHAPES = ("32x32b", "16x256b", "16x128b")
EPI_WARPS = 4              # warps 0..3: epilogue (one TMEM sub-partition each)
MMA_WARP = 4
TMA_WARP = 5
THREADS = 32 * 6
TMEM_COLS = 512            # tensor memory columns per SM (128 lanes x 512 x 32 bit)
SMEM_BYTES = 227 * 1024    # dynamic shared memory per CTA (sm_100)
_BARRIER_BYTES = 1024      # mbarriers, TMEM address slot, split-K flag (rounded up)


def pow2_ceil(v: int) -> int:
    """The smallest power of two >= v (v >= 1)."""
    return 1 << max(0, int(v) - 1).bit_length()


def round_up(v: int, m: int) -> int:
    return -(-int(v) // m) * m


def sf_vec(fmt: str) -> int:
    """Elements per scale factor: 16 (NVFP4, E4M3) or 32 (MXFP4, E8M0)."""
    if fmt not in ("nvfp4", "mxfp4"):
        raise ValueError(f"unknown FP4 format {fmt!r}")
    return 16 if fmt == "nvfp4" else 32


def sf_cols(kp: int, fmt: str) -> int:
    """SF columns of a row of kp elements (a multiple of 4: whole atoms)."""
    return round_up(kp // sf_vec(fmt), SF_ATOM_COLS)


def sf_offset(r: Any, b: Any, cols: int) -> Any:
    """Byte offset of the scale factor of row r, SF column b, in an SF tensor of `cols` SF
    columns (tcgen05 block-scaled atom layout, see the module docstring)."""
    return (((r // SF_ATOM_ROWS) * (cols // SF_ATOM_COLS) + b // SF_ATOM_COLS) * SF_ATOM_BYTES
            + (r % 32) * 16 + ((r // 32) % 4) * 4 + b % SF_ATOM_COLS)


def sf_row(row: Any, tile_rows: int) -> Any:
    """The SF row of operand row `row` for an MMA tile of tile_rows rows (tile-padded when the
    tile has fewer than 128 rows: tile z's rows start at SF row 128 z)."""
    if tile_rows >= SF_ATOM_ROWS:
        return row
    return (row // tile_rows) * SF_ATOM_ROWS + row % tile_rows


def sf_rows(rows: int, tile_rows: int) -> int:
    """Rows an SF tensor must have for `rows` operand rows (whole 128-row atoms)."""
    if tile_rows >= SF_ATOM_ROWS:
        return round_up(max(rows, 1), SF_ATOM_ROWS)
    return -(-max(rows, 1) // tile_rows) * SF_ATOM_ROWS


def act_rows(tokens: int, layout: str) -> int:
    """Activation operand rows for `tokens` tokens in `layout`."""
    if layout == "plain":
        return tokens
    if layout == "row_pair":
        return 2 * tokens
    if layout == "tile8":
        return 16 * -(-tokens // 8)
    raise ValueError(f"unknown activation row layout {layout!r}; known: {ROW_LAYOUTS}")


def act_row(token: Any, residue: bool, layout: str) -> Any:
    """The operand row of token's base (residue=False) or residue row."""
    if layout == "plain":
        if residue:
            raise ValueError("the plain layout has no residue rows")
        return token
    if layout == "row_pair":
        return 2 * token + (1 if residue else 0)
    if layout == "tile8":
        return (token // 8) * 16 + token % 8 + (8 if residue else 0)
    raise ValueError(f"unknown activation row layout {layout!r}")


def token_of_row(row: Any, layout: str) -> tuple[Any, Any]:
    """(token, is_residue 0/1) of operand row `row`."""
    if layout == "plain":
        return row, 0
    if layout == "row_pair":
        return row // 2, row % 2
    if layout == "tile8":
        return (row // 16) * 8 + row % 8, (row % 16) // 8
    raise ValueError(f"unknown activation row layout {layout!r}")


def tmem_frag(shape: str, t: Any, r: int) -> tuple[Any, Any]:
    """(lane, column) offsets of register r of thread t (0..31) of one tcgen05.ld.<shape>
    relative to its TMEM address (the repetition count only sets how many registers exist)."""
    if shape == "32x32b":
        return t, r
    if shape == "16x256b":
        j, h, q = r % 2, (r // 2) % 2, r // 4
        return t // 4 + 8 * h, 8 * q + 2 * (t % 4) + j
    if shape == "16x128b":
        h, q = r % 2, r // 2
        return t // 4 + 8 * h, 4 * q + t % 4
    raise ValueError(f"unknown TMEM load shape {shape!r}; known: {TMEM_SHAPES}")


_REGS_PER_REP = {"32x32b": 1, "16x256b": 4, "16x128b": 2}


def tmem_span(shape: str, rep: int) -> tuple[int, int, int]:
    """(lanes, columns, registers per thread) one tcgen05.ld.<shape>.x<rep> covers."""
    if shape == "32x32b":
        return 32, rep, rep
    if shape == "16x256b":
        return 16, 8 * rep, 4 * rep
    if shape == "16x128b":
        return 16, 4 * rep, 2 * rep
    raise ValueError(f"unknown TMEM load shape {shape!r}; known: {TMEM_SHAPES}")


class FoldPlanError(ValueError):
    """A TMEM load shape cannot give each thread whole base-residue pairs."""


@dataclass(frozen=True)
class LdInstr:
    """One TMEM load of an epilogue warp: its lane / column offsets inside the warp's 32-lane
    sub-partition and the accumulator tile, and the register pairs it folds."""

    lane: int
    col: int
    pairs: tuple[tuple[int, int], ...]   # (base register, residue register or -1)


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
        """Rows of the MMA tile the activation's SF tensor is tile-padded for."""
        return self.tile_n if self.swap else SF_ATOM_ROWS

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
        """C element (row i, column j) -> (token, channel, is_residue)."""
        if self.swap:
            tok, res = token_of_row(j, self.layout)
            return tok, i, res
        tok, res = token_of_row(i, self.layout)
        return tok, j, res

    def ld_plan(self) -> tuple[LdInstr, ...]:
        """The TMEM loads of one epilogue warp, covering its 32 lanes x tile_n columns, each
        with the register pairs it folds; raises FoldPlanError / ValueError when the shape
        cannot."""
        lanes, cols, nreg = tmem_span(self.tmem_shape, self.tmem_rep)
        if self.tile_n % cols:
            raise ValueError(f".{self.tmem_shape}.x{self.tmem_rep} loads {cols} columns; the "
                             f"accumulator tile has {self.tile_n}, not a multiple")
        out = []
        for lane0 in range(0, 32, lanes):
            for col0 in range(0, self.tile_n, cols):
                out.append(LdInstr(lane0, col0, self._pairs(lane0, col0, nreg)))
        return tuple(out)

    def _pairs(self, lane0: int, col0: int, nreg: int) -> tuple[tuple[int, int], ...]:
        """Register pairs (base, residue) of one load, the same for every thread, proven for
        all 32 threads and every sub-partition; residue -1 without M-Ext."""
        if self.mode != "mext":
            return tuple((r, -1) for r in range(nreg))
        pairs = []
        for rb in range(nreg):
            dl, dc = tmem_frag(self.tmem_shape, 0, rb)
            i, j = lane0 + dl, col0 + dc
            _, _, res = self.out_coord(i, j)
            if res:
                continue
            # the partner element of thread 0's register rb
            pi, pj = (i, j + self._partner_step(j)) if self.swap else \
                (i + self._partner_step(i), j)
            hit = [r for r in range(nreg)
                   if (lane0 + tmem_frag(self.tmem_shape, 0, r)[0],
                       col0 + tmem_frag(self.tmem_shape, 0, r)[1]) == (pi, pj)]
            if not hit:
                raise FoldPlanError(
                    f"{'swapped' if self.swap else 'unswapped'} {self.layout} tile: the "
                    f"residue of C[{i}, {j}] is not in the same thread's registers of "
                    f".{self.tmem_shape}.x{self.tmem_rep}")
            pairs.append((rb, hit[0]))
        for t in range(32):
            for q in range(EPI_WARPS):
                for rb, rr in pairs:
                    bl, bc = tmem_frag(self.tmem_shape, t, rb)
                    rl, rc = tmem_frag(self.tmem_shape, t, rr)
                    tb = self.out_coord(32 * q + lane0 + bl, col0 + bc)
                    tr = self.out_coord(32 * q + lane0 + rl, col0 + rc)
                    if tb[:2] != tr[:2] or (tb[2], tr[2]) != (0, 1):
                        raise FoldPlanError(
                            f".{self.tmem_shape}.x{self.tmem_rep}: thread {t} pairs "
                            f"{tb} with {tr}")
        if 2 * len(pairs) != nreg:
            raise FoldPlanError(f".{self.tmem_shape}.x{self.tmem_rep}: {nreg} registers do "
                                f"not split into base-residue pairs")
        return tuple(pairs)

    def _partner_step(self, idx: int) -> int:
        """Offset from a base row of the activation tile to its residue row."""
        return 1 if self.layout == "row_pair" else 8

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
