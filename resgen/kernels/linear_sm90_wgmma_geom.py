"""Geometry and index math of the linear_sm90_wgmma kernels (Hopper prefill FP4 linear layer on
WGMMA), shared by the kernel template and the thread-level CPU simulation.

Every function works on Python ints (simulation, tests) and on CuTe DSL integers (the kernel),
so the addresses and fragment coordinates the kernel uses are exactly the ones the simulation
checks. Layouts: resgen.kernels.linear_sm90_wgmma_layout.

Work decomposition. The GEMM is swapped: Y^T[N, rows] = W[N, Kp] xop[rows, Kp]^T. A CTA owns
BM = 64 * consumers * m_wg output channels (m64 blocks mb0 .. mb0 + MB - 1, MB = consumers *
m_wg) and BN xop rows (tokens; 2 rows per token for M-Ext). Threads: warpgroup 0 is the producer
(one thread issues the copies), warpgroups 1 .. consumers compute; consumer warpgroup w owns the
m64 blocks w * m_wg .. + m_wg - 1 of the CTA (warp q of it rows 16 q .. 16 q + 15 of each).
K is walked in 64-column chunks, one chunk per pipeline stage:
    stage s = c % stages, use u = c // stages, full/empty mbarrier parity u & 1 (consumers wait
    on full with parity u & 1, the producer waits on empty with parity (u & 1) ^ 1, which passes
    at once for the first use of every stage: an mbarrier reports the phase before its current
    one as complete).
N, Kp and the row count are run-time values: one compiled kernel serves every shape.

Split-K (split_k = S > 1): grid z = S; CTA z walks chunks z * nk / S .. (z + 1) * nk / S - 1
(nk a multiple of 2 S: the consumers take chunks in pairs). Every consumer thread stores its raw
FP32 accumulators to a workspace slot of its (tile, split) with 16-byte stores (consecutive
threads, consecutive 16 bytes); the tile's semaphore counts arrivals; the CTA that arrives last
sums the S slots of each register in split order (so the result does not depend on which CTA
is last: bit-identical across runs), runs the epilogue, and resets the semaphore to zero.
Workspace layout (FP32): [tile][split][vector v][consumer thread][4], tile = grid y * grid x
index of the CTA's (x, y), v = 0 .. acc_regs / 4 - 1 over (m64 block mw, register 4 v').
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["WgGeometry", "STORES", "PLAIN_SEL", "MEXT_SEL", "RASTERS", "SLOT_ROW8", "SLOT_COL", "REC_WORD_BYTES",
           "record_bytes", "scale_bytes_per_group", "MAX_SPLIT"]

STORES: tuple[str, ...] = ("direct",)
RASTERS: tuple[str, ...] = ("tok", "ch")
PRODUCERS: tuple[str, ...] = ("wg", "warp")
REC_WORD_BYTES = 2048            # 4 warps x 32 lanes x 4 words of 4 bytes
# A fragment slot s = 0..7 (a0..a7) of k16 step j for lane (g, t) of warp q:
#   row = 16 q + g + SLOT_ROW8[s],  column (inside the 64-wide chunk) = 16 j + 2 t + SLOT_COL[s]
SLOT_ROW8 = (0, 0, 8, 8, 0, 0, 8, 8)
SLOT_COL = (0, 1, 0, 1, 8, 9, 8, 9)
# Epilogue byte-permute selectors (PRMT, default mode: result byte k = byte nibble_k of {a, b})
# as (even lane g, odd lane g) pairs. Plain: a = bf16x2(c0, c2) (token 2t: rows r0, r1),
# b = bf16x2(c1, c3) (token 2t + 1); keep = prmt(a, b, keep), send = prmt(a, b, send),
# recv = send of lane g ^ 1, out0 / out1 = prmt(keep, recv, out0 / out1) = channels (c, c + 1)
# at rows r0 / r1 of the lane's token. M-Ext: pk = bf16x2(c0 + c1, c2 + c3), recv = pk of lane
# g ^ 1, out = prmt(pk, recv, out).
PLAIN_SEL = {"keep": (0x3210, 0x7654), "send": (0x7654, 0x3210),
             "out0": (0x5410, 0x1054), "out1": (0x7632, 0x3276)}
MEXT_SEL = {"out": (0x5410, 0x3276)}
MAX_SPLIT = 16                   # K slices of one output tile (grid z)
PRODUCER_REGS = 40               # setmaxnreg of the producer warpgroup (2-consumer kernels)
CONSUMER_REGS = 232              # 128 x 40 + 256 x 232 = 168 x 384: the CTA's launch budget


def scale_bytes_per_group(fmt: str) -> int:
    """Scale bytes per (warp, lane group g) in a record: NVFP4 4 k16 blocks x 2 rows, MXFP4
    2 32-column blocks x 2 rows."""
    return 8 if fmt == "nvfp4" else 4


def record_bytes(fmt: str) -> int:
    """Bytes of one (m64 block, 64-column chunk) record: code words + scale bytes."""
    return REC_WORD_BYTES + 32 * scale_bytes_per_group(fmt)


@dataclass(frozen=True)
class WgGeometry:
    """Compile-time constants of one kernel (N, Kp and rows are run-time)."""

    fmt: str
    mext: bool
    packing: str
    consumers: int     # consumer warpgroups (1 or 2)
    m_wg: int          # m64 blocks per consumer warpgroup
    bn: int            # xop rows (wgmma N) per CTA
    stages: int
    raster: str        # "tok": grid x walks token tiles (a wave shares weights) | "ch"
    store: str = "direct"
    split_k: int = 1   # K slices (grid z); > 1: workspace + last-CTA reduction in split order
    pdl: bool = False  # programmatic dependent launch behind the quantizer (see the template)
    # who issues the copies: "wg" a producer warpgroup 0 whose warp 0 works (setmaxnreg moves
    # the other registers to 2 consumers), "warp" one producer warp after the consumer
    # warpgroup (1 consumer only): 160 threads, so the idle producer warps hold no registers
    # and more CTAs fit an SM
    producer: str = "wg"

    # ------------------------------------------------------------------ derived constants
    @property
    def nv(self) -> bool:
        return self.fmt == "nvfp4"

    @property
    def mb_cta(self) -> int:
        return self.consumers * self.m_wg

    @property
    def bm(self) -> int:
        return 64 * self.mb_cta

    @property
    def threads(self) -> int:
        return 128 * self.consumers + (32 if self.producer == "warp" else 128)

    @property
    def prod_wg(self) -> int:
        """The producer's warpgroup (warp // 4): 0, or after the consumers for "warp"."""
        return self.consumers if self.producer == "warp" else 0

    @property
    def prod_warp(self) -> int:
        """The one warp that issues the copies: the producer warpgroup's first."""
        return 4 * self.prod_wg

    @property
    def cons_wg0(self) -> int:
        """The first consumer warpgroup (consumer index wgi = warp // 4 - cons_wg0)."""
        return 0 if self.producer == "warp" else 1

    @property
    def cons_tid0(self) -> int:
        """The first consumer thread (consumer thread ctid = tid - cons_tid0)."""
        return 128 * self.cons_wg0

    @property
    def release_count(self) -> int:
        """Arrivals that free a stage: lane 0 of every consumer warp."""
        return 4 * self.consumers

    @property
    def rec_bytes(self) -> int:
        return record_bytes(self.fmt)

    @property
    def sb_bytes(self) -> int:
        return scale_bytes_per_group(self.fmt)

    @property
    def b_stage_bytes(self) -> int:
        return self.bn * 128

    @property
    def w_stage_bytes(self) -> int:
        return self.mb_cta * self.rec_bytes

    @property
    def tx_bytes(self) -> int:
        """Bytes the copies of one stage deliver (the full barrier's transaction count)."""
        return self.b_stage_bytes + self.w_stage_bytes

    @property
    def smem_bytes(self) -> int:
        """Shared memory of one CTA: barriers, B ring (1024-aligned, 128-byte swizzle), weight
        ring, plus alignment slack."""
        return 1024 + 16 * self.stages + self.stages * (self.b_stage_bytes + self.w_stage_bytes)

    @property
    def acc_regs(self) -> int:
        """FP32 accumulator registers per consumer thread."""
        return self.m_wg * self.bn // 2

    @property
    def tok_per_tile(self) -> int:
        """Output tokens per CTA (M-Ext: two xop rows per token)."""
        return self.bn // 2 if self.mext else self.bn

    def check(self) -> None:
        """Raise ValueError if the constants do not describe a kernel that can be built."""
        if self.fmt not in ("nvfp4", "mxfp4"):
            raise ValueError(f"unknown format {self.fmt!r}")
        if self.packing not in ("nib", "split"):
            raise ValueError(f"unknown packing {self.packing!r}")
        if self.consumers not in (1, 2):
            raise ValueError("consumers must be 1 or 2 warpgroups")
        if self.producer not in PRODUCERS:
            raise ValueError(f"producer must be one of {PRODUCERS}")
        if self.producer == "warp" and self.consumers != 1:
            raise ValueError("a one-warp producer serves one consumer warpgroup (two need "
                             "setmaxnreg, which moves registers per warpgroup)")
        if self.m_wg not in (1, 2):
            raise ValueError("m_wg must be 1 or 2 m64 blocks per warpgroup")
        if self.bn % 16 or not 16 <= self.bn <= 256:
            raise ValueError("bn must be a multiple of 16 in [16, 256] (wgmma n, M-Ext pairs)")
        if self.acc_regs > 128:
            raise ValueError(f"{self.acc_regs} accumulator registers per thread (at most 128)")
        if not 2 <= self.stages <= 12:
            raise ValueError("stages must be in [2, 12]")
        if self.raster not in RASTERS:
            raise ValueError(f"raster must be one of {RASTERS}")
        if self.store not in STORES:
            raise ValueError(f"store must be one of {STORES}")
        if self.smem_bytes > 227 * 1024:
            raise ValueError(f"{self.smem_bytes} bytes of shared memory (at most 227 KB)")
        if not 1 <= self.split_k <= MAX_SPLIT:
            raise ValueError(f"split_k must be in [1, {MAX_SPLIT}]")

    # ------------------------------------------------------------------ grid
    def grid(self, rows: Any, n: Any) -> tuple[Any, Any]:
        """(grid x, grid y) for `rows` xop rows and N output channels."""
        tt = (rows + (self.bn - 1)) // self.bn
        ct = n // self.bm
        return (tt, ct) if self.raster == "tok" else (ct, tt)

    def chunks_per_split(self, nk: Any) -> Any:
        """K chunks one CTA walks (nk must be a multiple of 2 * split_k)."""
        return nk // self.split_k

    def split_ok(self, nk: int) -> bool:
        """Whether nk chunks divide into split_k slices of whole chunk pairs."""
        return nk % (2 * self.split_k) == 0

    @property
    def cons_threads(self) -> int:
        """Consumer threads per CTA (the workspace slot's thread dimension)."""
        return 128 * self.consumers

    @property
    def acc_vecs(self) -> int:
        """16-byte accumulator vectors per consumer thread (m_wg blocks x bn / 8)."""
        return self.acc_regs // 4

    def ws_off(self, tile: Any, split: Any, v: Any, cthread: Any) -> Any:
        """Byte offset in the split-K workspace of accumulator vector v (registers 4 v .. 4 v
        + 3, m64 block v // (bn / 8)) of consumer thread `cthread` for (tile, split)."""
        return (((tile * self.split_k + split) * self.acc_vecs + v) * self.cons_threads
                + cthread) * 16

    def ws_floats(self, rows: int, n: int) -> int:
        """FP32 workspace a launch over `rows` xop rows and N channels needs (0 unsplit)."""
        if self.split_k == 1:
            return 0
        gx, gy = self.grid(rows, n)
        return gx * gy * self.split_k * self.acc_vecs * self.cons_threads * 4

    def sem_count(self, rows: int, n: int) -> int:
        """Semaphores (one per output tile) a launch needs (0 unsplit)."""
        if self.split_k == 1:
            return 0
        gx, gy = self.grid(rows, n)
        return gx * gy

    def cta_tile(self, bx: Any, by: Any) -> tuple[Any, Any]:
        """(token tile, channel tile) of CTA (bx, by)."""
        return (bx, by) if self.raster == "tok" else (by, bx)

    def stage_of(self, c: Any) -> tuple[Any, Any]:
        """(stage, full-barrier parity) of chunk c; the producer waits on the stage's empty
        barrier with the opposite parity."""
        return c % self.stages, (c // self.stages) % 2

    # ------------------------------------------------------------------ byte offsets
    def rec_off(self, mb: Any, c: Any, nk: Any) -> Any:
        """Global byte offset of the record of m64 block mb, chunk c (mb may be Int64)."""
        return (mb * nk + c) * self.rec_bytes

    def w_smem_off(self, stage: Any, blk: Any) -> Any:
        """Byte offset in the weight ring of block blk (0 .. MB - 1) of stage `stage`."""
        return (stage * self.mb_cta + blk) * self.rec_bytes

    @staticmethod
    def word_off(q: Any, lane: Any) -> Any:
        """Offset inside a record of the 16-byte word vector of lane `lane` of warp q."""
        return q * 512 + lane * 16

    def scale_off(self, q: Any, g: Any) -> Any:
        """Offset inside a record of the scale bytes of lane group g of warp q."""
        return REC_WORD_BYTES + (q * 8 + g) * self.sb_bytes

    def scale_select(self, j: int) -> tuple[int, int]:
        """(scale word, pair index i for sm90_fp4_decode.scale_pair) of k16 step j: the bytes
        2 (i % 2) (row r0) and 2 (i % 2) + 1 (row r1) of that word are the step's scales."""
        return (j // 2, j) if self.nv else (0, j // 2)

    # ------------------------------------------------------------------ fragment coordinates
    @staticmethod
    def a_coord(q: int, g: int, t: int, j: int, s: int) -> tuple[int, int]:
        """(row in the m64 block, column in the 64-wide chunk) of A fragment slot s (a0..a7)
        of k16 step j held by lane 4 g + t of warp q (the wgmma m64nNk16 register fragment)."""
        return 16 * q + g + SLOT_ROW8[s], 16 * j + 2 * t + SLOT_COL[s]

    @staticmethod
    def acc_coord(q: int, g: int, t: int, e: int) -> tuple[int, int]:
        """(row in the m64 block, column = xop row in the tile) of accumulator register e
        (= 4 i + 2 v1 + v0) of lane 4 g + t of warp q."""
        i, v1, v0 = e // 4, (e // 2) % 2, e % 2
        return 16 * q + g + 8 * v1, 8 * i + 2 * t + v0

    # ------------------------------------------------------------------ epilogue plan
    @staticmethod
    def select(odd: Any, pair: tuple[int, int]) -> Any:
        """The even- or odd-lane constant of `pair` (arithmetic, no branch: works on DSL ints)."""
        return pair[0] + odd * (pair[1] - pair[0])

    @staticmethod
    def store_lane(g: Any, t: Any, i: int, mext: bool) -> tuple[Any, Any]:
        """Direct store of n8 block i after the pair exchange with lane g ^ 1 (shuffle xor 4):
        (token offset in the tile, channel offset from the lane's row r0 = 16 q + g) of the
        lane's FIRST 32-bit store (two channels c, c + 1); the second store is 8 channels on.

        Plain: even g stores token 8 i + 2 t, odd g token 8 i + 2 t + 1, both at channels
        (r0 - (g & 1), + 1) and (r0 - (g & 1) + 8, + 1). M-Ext: token 4 i + t; even g stores
        channels (r0, r0 + 1), odd g (r0 - 1 + 8, r0 + 8): one store per lane."""
        odd = g % 2
        if mext:
            return 4 * i + t, 8 * odd - odd
        return 8 * i + 2 * t + odd, -odd
