"""Geometry and index math of attention_sm100 (ResAttn decode attention on Blackwell, tcgen05),
shared by the kernel template, the host side and the CPU simulation (pure integer math on
Python ints; what the kernel calls with device values uses only +, *, //, %, ^ with Python-int
constants, so it works on CuTe DSL integers too).

One CTA per (KV split, KV head, sequence). Per tile of KEYS = 128 keys (the MMA's M, operand
swap: the keys on TMEM lanes, the few query rows of the GQA group on the MMA's narrow N):
    S[key, c] = sum_d K[key, d] sfK[key, d / 16] Qop[c, d] sfQ[c, d / 16]
        tcgen05.mma.cta_group::1.kind::mxf4nvf4.block_scale.block16, M = 128, N = qk_n,
        K = head_dim (head_dim / 64 instructions), FP32 accumulator in TMEM columns
        [S_COL, S_COL + qk_n)
    the query operand's rows (columns of S) hold the group's base and residue rows:
        qlayout "plain" (no residue): column j = head j
        qlayout "pair":  column 2 j = base of head j, 2 j + 1 = its residue
        qlayout "half":  column j = base, column qk_n / 2 + j = residue
    epilogue (warps 0-3, warp w owns TMEM lanes 32 w .. + 31 = keys): tcgen05.ld of the
        variant's shape, s = S_base * c + S_res * c in FP32 (mul.rn / add.rn, never an FMA:
        the paper's fold; c = alpha_q k_scale sm_scale log2(e)), online softmax per head
        (base 2), P = exp2(s - m) rounded to FP16 into shared memory [pv_n, KEYS] (K-major
        B operand of P.V)
    V: NVFP4 codes x E4M3 scales decoded exactly to FP16 into shared memory [KEYS, head_dim]
        (the MN-major A operand of P.V: V's scale groups run along head_dim, not along the
        keys, which are P.V's reduction, so V cannot feed a block-scaled MMA directly)
    O_t[d, j] = sum_key V[key, d] P[j, key]: tcgen05.mma.kind::f16, M = 128 dims per
        instruction (head_dim / 128 of them), N = pv_n, K = 16 keys (KEYS / 16 steps), into
        TMEM columns [O_COL, O_COL + pv_n (head_dim / 128)); the epilogue loads O_t with
        .32x32b (thread = one head dim) and keeps O = O corr + O_t in registers (FP32)
Split-KV: split z of `splits` owns tiles [z T / S, (z + 1) T / S) of the sequence's
T = ceil(n / KEYS) tiles (contiguous key ranges); partials (O unnormalized, m, l) go to a
workspace; "lastcta": the last CTA of a (sequence, head) (an atomic counter) reduces in split
order; "combine": a second kernel reduces. Both are deterministic and compute the same sums.

Shared memory byte offsets written by the loader threads:
    K codes: the canonical K-major swizzled layout of tcgen05 operands (8-row atoms, rows of
        head_dim / 2 bytes; 64-byte rows: SW64 = Swizzle<2,4,3>, 128-byte: SW128 =
        Swizzle<3,4,3>, 32-byte: SW32 = Swizzle<1,4,3>): 16-byte chunk c of key row r sits at
        atom (r // 8) * 8 * row_bytes + (r % 8) * row_bytes + 16 (c ^ ((r % 8) >> shift))
    K scale factors: the tcgen05 scale-factor atom (sm100_layout.sf_offset, 128 rows): the
        4 scales of group g of key r are one 32-bit word at sf_offset(r, 4 g, sf_cols)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from .sm100_layout import (MMA_K, SF_ATOM_ROWS, SMEM_BYTES, TMEM_COLS, TMEM_SHAPES, pow2_ceil,
                           round_up, sf_offset, tmem_frag, tmem_span)

__all__ = ["KEYS", "EPI_WARPS", "THREADS", "QLAYOUTS", "REDUCTIONS", "AttnSm100Geometry",
           "FoldPlanError", "LdInstr", "q_col", "col_head", "swizzle_shift",
           "k_code_offset", "k_sf_word_offset", "split_tiles", "TMEM_SHAPES", "TMEM_COLS",
           "SMEM_BYTES", "MMA_K", "PV_K"]

KEYS = 128                 # keys per tile: the block-scaled MMA's M (cta_group::1)
PV_K = 16                  # K of one kind::f16 MMA
EPI_WARPS = 4              # warps 0-3: loads, epilogue, softmax, V decode
MMA_WARP = 4               # warp 4 issues the MMAs
THREADS = 32 * 5
QLAYOUTS = ("plain", "pair", "half")
REDUCTIONS = ("none", "lastcta", "combine")
_BARRIER_BYTES = 1024      # mbarriers, TMEM address slot, the last-CTA flag, softmax exchange
_SWIZZLE_SHIFT = {32: 1, 64: 2, 128: 3}   # row bytes -> bits of the XOR mask (SW32/64/128)


class FoldPlanError(ValueError):
    """A TMEM load shape cannot give each thread whole base-residue score pairs."""


def q_col(j: Any, residue: int, qlayout: str, qk_n: int) -> Any:
    """The S column (query operand row) of head j's base (residue 0) or residue (1)."""
    if qlayout == "plain":
        if residue:
            raise ValueError("qlayout plain has no residue columns")
        return j
    if qlayout == "pair":
        return 2 * j + residue
    if qlayout == "half":
        return j + (qk_n // 2) * residue
    raise ValueError(f"unknown qlayout {qlayout!r}; known: {QLAYOUTS}")


def col_head(c: int, qlayout: str, qk_n: int) -> tuple[int, int]:
    """(head, residue) of S column c (head may be >= the group: a padding column)."""
    if qlayout == "plain":
        return c, 0
    if qlayout == "pair":
        return c // 2, c % 2
    if qlayout == "half":
        h = qk_n // 2
        return c % h, c // h
    raise ValueError(f"unknown qlayout {qlayout!r}; known: {QLAYOUTS}")


def swizzle_shift(row_bytes: int) -> int:
    if row_bytes not in _SWIZZLE_SHIFT:
        raise ValueError(f"K-major rows of {row_bytes} bytes have no canonical swizzle here")
    return _SWIZZLE_SHIFT[row_bytes]


def k_code_offset(r: Any, c: Any, row_bytes: int) -> Any:
    """Byte offset of 16-byte chunk c of key row r in a K-major swizzled operand tile (see the
    module docstring)."""
    sh = swizzle_shift(row_bytes)
    return (r // 8) * (8 * row_bytes) + (r % 8) * row_bytes + 16 * (c ^ ((r % 8) >> (3 - sh)))


def k_sf_word_offset(r: Any, g: Any, sf_cols: int) -> Any:
    """Byte offset of the 32-bit word holding scale factors 4 g .. 4 g + 3 of key row r."""
    return sf_offset(r, 4 * g, sf_cols)


def split_tiles(tiles: int, splits: int, z: int) -> tuple[int, int]:
    """[first, end) tiles of split z (contiguous, sizes differing by at most one)."""
    return (z * tiles) // splits, ((z + 1) * tiles) // splits


@dataclass(frozen=True)
class LdInstr:
    """One S load of an epilogue warp: lane / column offsets inside the warp's 32 lanes and
    the S tile, and per head held: (lane offset in the load, head, base reg, residue reg)."""

    lane: int
    col: int
    items: tuple[tuple[int, int, int, int], ...]


@functools.lru_cache(maxsize=1024)
def _ld_plan(qlayout: str, group: int, qk_n: int, shape: str, rep: int
             ) -> tuple[tuple[LdInstr, ...], ...]:
    """Per thread t (0..31): its loads, each with the (lane, head, base, residue) items it
    folds; proves that every (lane, head < group) of the warp's 32 lanes is folded by exactly
    one thread, with its base and residue in that thread's registers of one load."""
    lanes, cols, nreg = tmem_span(shape, rep)
    if qk_n % cols:
        raise ValueError(f".{shape}.x{rep} loads {cols} columns; the score tile has {qk_n}")
    seen: dict[tuple[int, int], int] = {}
    per_thread = []
    for t in range(32):
        ins = []
        for lane0 in range(0, 32, lanes):
            for col0 in range(0, qk_n, cols):
                held = {}
                for r in range(nreg):
                    dl, dc = tmem_frag(shape, t, r)
                    held[(lane0 + dl, col0 + dc)] = r
                items = []
                for (lane, c), r in sorted(held.items()):
                    j, res = col_head(c, qlayout, qk_n)
                    if res or j >= group:
                        continue
                    rr = -1
                    if qlayout != "plain":
                        pc = q_col(j, 1, qlayout, qk_n)
                        if (lane, pc) not in held:
                            raise FoldPlanError(
                                f"qlayout {qlayout}: the residue of head {j} (column {pc}) "
                                f"is not in the thread's registers of .{shape}.x{rep}")
                        rr = held[(lane, pc)]
                    if (lane, j) in seen:
                        raise FoldPlanError(f"score (lane {lane}, head {j}) folded twice")
                    seen[(lane, j)] = t
                    items.append((lane - lane0, j, r, rr))
                ins.append(LdInstr(lane0, col0, tuple(items)))
        per_thread.append(tuple(ins))
    if len(seen) != 32 * group:
        raise FoldPlanError(f"{len(seen)} of {32 * group} scores folded")
    return tuple(per_thread)


@dataclass(frozen=True)
class AttnSm100Geometry:
    """Everything the kernel is specialized on (the compile key's fields and the variant's)."""

    head_dim: int
    group: int
    page_size: int
    compensation: bool
    qlayout: str
    tmem_shape: str
    tmem_rep: int
    stages: int
    reduction: str

    # ------------------------------------------------------------------ sizes
    @property
    def q_rows(self) -> int:
        return self.group * (2 if self.compensation else 1)

    @property
    def qk_n(self) -> int:
        """The QK MMA's N: query operand rows padded to a power of two >= 8."""
        return max(8, pow2_ceil(self.q_rows))

    @property
    def pv_n(self) -> int:
        """The P.V MMA's N: one column per head, padded to a power of two >= 8."""
        return max(8, pow2_ceil(self.group))

    @property
    def row_bytes(self) -> int:
        return self.head_dim // 2

    @property
    def sf_cols(self) -> int:
        """Scale-factor columns of a key row (head_dim / 16, whole atoms of 4)."""
        return round_up(self.head_dim // 16, 4)

    @property
    def qk_mmas(self) -> int:
        return self.head_dim // MMA_K

    @property
    def pv_m_tiles(self) -> int:
        return self.head_dim // 128

    @property
    def pv_mmas(self) -> int:
        return self.pv_m_tiles * (KEYS // PV_K)

    @property
    def tmem_sf_cols(self) -> int:
        """SF columns in TMEM (CUTLASS's blockscaled layout: 4 columns per 32 SF rows per MMA
        instruction; both tiles are 128 rows: the query's is padded to one atom)."""
        return 2 * (SF_ATOM_ROWS // 32) * self.qk_mmas

    @property
    def s_col(self) -> int:
        return 0

    @property
    def o_col(self) -> int:
        return self.qk_n

    @property
    def tmem_cols(self) -> int:
        return self.qk_n + self.pv_n * self.pv_m_tiles + self.tmem_sf_cols

    @property
    def tmem_alloc(self) -> int:
        return max(32, pow2_ceil(self.tmem_cols))

    @property
    def k_tile_bytes(self) -> int:
        return KEYS * self.row_bytes

    @property
    def k_sf_tile_bytes(self) -> int:
        return KEYS * self.sf_cols

    @property
    def v_raw_bytes(self) -> int:
        return KEYS * self.row_bytes + KEYS * (self.head_dim // 16)

    @property
    def stage_bytes(self) -> int:
        """One ring stage: K codes, K scale factors (MMA layouts) and the raw V page bytes."""
        return self.k_tile_bytes + self.k_sf_tile_bytes + self.v_raw_bytes

    @property
    def v16_bytes(self) -> int:
        return KEYS * self.head_dim * 2

    @property
    def p_bytes(self) -> int:
        return self.pv_n * KEYS * 2

    @property
    def q_bytes(self) -> int:
        return self.qk_n * self.row_bytes + SF_ATOM_ROWS * self.sf_cols

    @property
    def smem_bytes(self) -> int:
        return (self.stages * self.stage_bytes + self.v16_bytes + self.p_bytes + self.q_bytes
                + _BARRIER_BYTES)

    @property
    def regs_per_ld(self) -> int:
        return tmem_span(self.tmem_shape, self.tmem_rep)[2]

    @property
    def o_regs(self) -> int:
        """FP32 output accumulators per epilogue thread (head dims x heads)."""
        return self.pv_m_tiles * self.pv_n

    # ------------------------------------------------------------------ plans
    def ld_plan(self) -> tuple[tuple[LdInstr, ...], ...]:
        return _ld_plan(self.qlayout, self.group, self.qk_n, self.tmem_shape, self.tmem_rep)

    def thread_plan(self) -> tuple[LdInstr, ...]:
        """The loads of thread 0, the pattern every thread runs (its items' heads and
        registers are thread-independent when the kernel can use one code path): raises
        FoldPlanError where the threads' register pairs differ."""
        plans = self.ld_plan()
        sig = [[[(j, rb, rr) for _, j, rb, rr in ins.items] for ins in p] for p in plans]
        shapes = {tuple(tuple(tuple(x) for x in s) for s in p) for p in sig}
        if self.tmem_shape == "32x32b" and len(shapes) != 1:
            raise FoldPlanError("threads differ in their register pairs")
        return plans[0]

    def check(self) -> None:
        """Raise ValueError for a geometry the kernel cannot run (the family's why_invalid
        gives the same reasons first)."""
        if self.head_dim not in (128, 256):
            raise ValueError(f"head_dim {self.head_dim}: P.V runs M = 128 dims per MMA")
        if self.qlayout not in QLAYOUTS or (self.qlayout == "plain") == self.compensation:
            raise ValueError(f"qlayout {self.qlayout} with compensation={self.compensation}")
        if self.reduction not in REDUCTIONS:
            raise ValueError(f"unknown reduction {self.reduction!r}")
        if KEYS % self.page_size and self.page_size % KEYS:
            raise ValueError(f"page_size {self.page_size} neither divides nor is a multiple "
                             f"of the {KEYS}-key tile")
        if self.page_size % 8:
            raise ValueError(f"page_size {self.page_size} is not a multiple of 8 (atoms)")
        if self.tmem_alloc > TMEM_COLS:
            raise ValueError(f"{self.tmem_alloc} TMEM columns (at most {TMEM_COLS})")
        if self.smem_bytes > SMEM_BYTES:
            raise ValueError(f"{self.smem_bytes} bytes of shared memory (at most {SMEM_BYTES})")
        if self.regs_per_ld > 128:
            raise ValueError(f".{self.tmem_shape}.x{self.tmem_rep} loads {self.regs_per_ld} "
                             "registers (at most 128)")
        self.ld_plan()

    # ------------------------------------------------------------------ index maps
    def key_page(self, tile: Any, r: Any) -> tuple[Any, Any]:
        """(block-table entry, slot in the page) of key r of tile `tile` of a sequence."""
        key = tile * KEYS + r
        return key // self.page_size, key % self.page_size
