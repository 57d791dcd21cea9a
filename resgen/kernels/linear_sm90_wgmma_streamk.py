"""Stream-K work decomposition of linear_sm90_wgmma (persistent CTAs), shared by the kernel
template (streamk renders only: every other render neither imports this module nor changes) and
the CPU simulation.

Why: the grid schedule launches one CTA per (token tile, channel tile[, K slice]). At serving M
most Qwen3 layers have too few tiles for the 132 SMs or a ragged last wave: Qwen3-8B qkv at
M = 64 runs 96 CTAs (48 channel tiles x split-K 2) on 132 SMs, gate_up at M = 128 runs 192
tiles in 1.45 waves (bench/results/h200/ncu_limits_s35_m64.md). Stream-K gives every CTA the
same share of the work instead.

Work units: a tile t (tiles = tt x ct, tt = ceil(rows / bn) token tiles, ct = N / bm channel
tiles; raster "tok": t = ch_tile * tt + tok_tile, "ch": t = tok_tile * ct + ch_tile) holds
nq = nk / 2 chunk pairs; unit u = t * nq + q is chunk pair q of tile t, U = tiles * nq units.
The launch has P = min(U, streamk x SMs) CTAs; CTA i walks the units
    [unit_start(i), unit_start(i + 1)),   unit_start(i) = floor(i U / P),
in order, with ONE pipeline across them (the ring's stage / parity count the CTA's chunks, not
a tile's), so weight loads of the next tile stay in flight during a tile's epilogue. Its units
fall into segments, one per tile they touch.

A tile whose units all belong to one CTA is stored by it directly. Otherwise its contributors
are the CTAs cta_of(t nq) .. cta_of(t nq + nq - 1) (i0 .. i1); each parks its raw FP32
accumulators of the segment in its workspace slot, the tile's semaphore counts arrivals, and the
CTA that arrives last sums the slots in contributor order i0, i0 + 1, .., i1 (so the result
does not depend on which CTA is last: bit-identical across runs at a given P), runs the
epilogue and resets the semaphore to zero. Slots: a contributor's segment is either its FIRST
segment (it starts inside the tile: i > i0) or its LAST one (i = i0: it ends inside the tile),
so two slots per CTA suffice: slot(i, t) = 2 i + (1 if i == i0 else 0).
Workspace (FP32): [slot][vector v][consumer thread][4] (2 P slots), one semaphore per tile.
No CTA ever waits for another, so the schedule is correct even where not all P CTAs are resident.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .linear_sm90_wgmma_geom import WgGeometry

__all__ = ["StreamKGeometry", "STREAMK_MAX"]

STREAMK_MAX = 2                  # persistent CTAs per SM


@dataclass(frozen=True)
class StreamKGeometry(WgGeometry):
    """WgGeometry of a stream-K kernel: streamk CTAs per SM, persistent (split_k 1, no PDL)."""

    streamk: int = 1

    def check(self) -> None:
        super().check()
        if not 1 <= self.streamk <= STREAMK_MAX:
            raise ValueError(f"streamk must be in [1, {STREAMK_MAX}] CTAs per SM")
        if self.split_k != 1:
            raise ValueError("stream-K replaces split-K: split_k must be 1")
        if self.pdl:
            raise ValueError("stream-K kernels are not built with PDL")

    # ------------------------------------------------------------------ work units
    def tile_grid(self, rows: Any, n: Any) -> tuple[Any, Any]:
        """(token tiles tt, channel tiles ct): the grid schedule's tile counts."""
        return self.cta_tile(*self.grid(rows, n))

    def units(self, rows: int, n: int, nk: int) -> int:
        """U: chunk-pair units of a launch."""
        tt, ct = self.tile_grid(rows, n)
        return tt * ct * (nk // 2)

    def ctas(self, rows: int, n: int, nk: int, sms: int) -> int:
        """P: CTAs of a launch on a GPU with `sms` SMs (at most one per unit)."""
        return max(1, min(self.units(rows, n, nk), self.streamk * sms))

    @staticmethod
    def unit_start(i: Any, units: Any, ctas: Any) -> Any:
        """First unit of CTA i (CTA ctas ends at `units`)."""
        return (i * units) // ctas

    @staticmethod
    def cta_of(u: Any, units: Any, ctas: Any) -> Any:
        """The CTA whose units contain unit u: the largest i with unit_start(i) <= u."""
        return ((u + 1) * ctas + units - 1) // units - 1

    def tile_coords(self, t: Any, tt: Any, ct: Any) -> tuple[Any, Any]:
        """(token tile, channel tile) of tile t."""
        if self.raster == "tok":
            return t % tt, t // tt
        return t // ct, t % ct

    @staticmethod
    def slot(i: Any, first: Any) -> Any:
        """Workspace slot of CTA i's partial segment of a tile whose first contributor is
        `first` (see the module docstring; i >= first, so 1 // (i - first + 1) is 1 exactly
        when i == first: integer arithmetic the kernel shares)."""
        return 2 * i + 1 // (i - first + 1)

    def sk_ws_off(self, slot: Any, v: Any, cthread: Any) -> Any:
        """Byte offset of accumulator vector v of consumer thread `cthread` in slot `slot`."""
        return ((slot * self.acc_vecs + v) * self.cons_threads + cthread) * 16

    # ------------------------------------------------------------------ host buffers
    def ws_floats(self, rows: int, n: int, ctas: int | None = None) -> int:
        """FP32 workspace of a launch with `ctas` CTAs (two slots each)."""
        if ctas is None:
            raise ValueError("a stream-K workspace depends on the launch's CTA count")
        return 2 * ctas * self.acc_vecs * self.cons_threads * 4

    def sem_count(self, rows: int, n: int, ctas: int | None = None) -> int:
        """Semaphores of a launch: one per tile."""
        tt, ct = self.tile_grid(rows, n)
        return tt * ct

    def segments(self, i: int, rows: int, n: int, nk: int, ctas: int
                 ) -> list[tuple[int, int, int]]:
        """CTA i's segments as (tile, first pair, end pair) in the tile's chunk pairs (the
        kernel's consumer loop; Python ints)."""
        nq = nk // 2
        units = self.units(rows, n, nk)
        u0, u1 = self.unit_start(i, units, ctas), self.unit_start(i + 1, units, ctas)
        out = []
        for t in range(u0 // nq, (u1 - 1) // nq + 1):
            a0, a1 = max(u0, t * nq), min(u1, t * nq + nq)
            out.append((t, a0 - t * nq, a1 - t * nq))
        return out

    def contributors(self, t: int, units: int, nq: int, ctas: int) -> tuple[int, int]:
        """(i0, i1): the first and last CTA holding units of tile t."""
        return (self.cta_of(t * nq, units, ctas), self.cta_of(t * nq + nq - 1, units, ctas))
