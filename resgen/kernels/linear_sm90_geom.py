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
    xop rows    bz TOK .. + TOK, TOK = 8 NT (n8 tile nt: rows bz TOK + 8 nt + 0..7)
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
    pipeline: str      # "direct" | "regs" | "cp_async"
    stages: int        # cp_async: ring depth (iterations in flight + 1); else 1
    l2_prefetch: int   # iterations ahead that lane 0 bulk-prefetches into L2 (0: none)
    split_k: int
    reduce: str        # "none" | "atomic" | "workspace"

    # ------------------------------------------------------------------ derived constants
    @property
    def nv(self) -> bool:
        return self.fmt == "nvfp4"

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
    def gs(self) -> int:
        return self.ng // (self.split_k * self.warps_k)

    @property
    def nit(self) -> int:
        return self.gs // self.groups

    @property
    def grid_x(self) -> int:
        return self.n // (16 * self.m_tiles * self.warps_m)

    @property
    def tok(self) -> int:
        return 8 * self.n_tiles

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

    @property
    def smem_bytes(self) -> int:
        """Shared memory of one CTA: cp.async rings + in-CTA reduction + flag."""
        ring = 0
        if self.pipeline == "cp_async":
            ring = self.warps_m * self.warps_k * self.stages * self.groups * self.m_tiles * 2304
        red = (self.warps_k - 1) * self.warps_m * self.acc * 32 * 4
        return ring + red + (16 if self.reduce == "workspace" else 0)

    def check(self) -> None:
        """Raise ValueError if the constants do not describe a runnable kernel."""
        if self.pipeline not in ("direct", "regs", "cp_async"):
            raise ValueError(f"unknown pipeline {self.pipeline!r}")
        if (self.pipeline == "cp_async") != (self.stages > 1):
            raise ValueError("stages > 1 exactly for the cp_async pipeline")
        if self.smem_bytes > 227 * 1024:
            raise ValueError("shared memory above 227 KB per CTA")
        if self.n % (16 * self.m_tiles * self.warps_m):
            raise ValueError("N must be a multiple of 16 * m_tiles * warps_m")
        if self.kq % 4 or self.ng % (self.split_k * self.warps_k * self.groups):
            raise ValueError("K groups must split evenly over split_k * warps_k * groups")
        if (self.split_k > 1) != (self.reduce != "none"):
            raise ValueError("split_k > 1 needs a reduction, split_k == 1 none")

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
        grp0 = (by * self.warps_k + wk) * self.gs
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

    def sw_off(self, warp: Any, slot: Any, u: int, mt: int, i: int, lane: Any) -> Any:
        """cp.async ring: the lane's 16-byte weight vector (chunk i of group u, tile mt)."""
        return (((((warp * self.stages + slot) * self.groups + u) * self.m_tiles + mt) * 4 + i)
                * 512 + lane * 16)

    def ss_off(self, warp: Any, slot: Any, u: int, mt: int, lane: Any) -> Any:
        """cp.async ring: the lane's 8-byte scale vector (group u, tile mt)."""
        return ((((warp * self.stages + slot) * self.groups + u) * self.m_tiles + mt) * 256
                + lane * 8)

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
