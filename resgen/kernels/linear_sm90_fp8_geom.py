"""Geometry of the Hopper MXFP4-on-FP8 linear kernels (family linear_sm90_fp8), shared by the
template (resgen/templates/linear_sm90_fp8.py.j2), the host launcher and the CPU simulation.

Roles: Y[M, N] = X_hat[M, K] W_hat[N, K]^T with the TOKENS on the wgmma M dimension (operand
A, 64 tokens per consumer warpgroup, from shared memory) and the CHANNELS on its N dimension
(operand B, `bn` channels per CTA, from shared memory). Both operands are E4M3 bytes, K-major,
brought in by TMA in chunks of KC = 128 K (4 k32 blocks: one wgmma.m64nNk32.e4m3.e4m3 k-step
per block). A CTA covers bm = 64 * consumers tokens x bn channels.

Per stage (one chunk): the A box (bm x 128 bytes, 128-byte swizzle), the B box (bn x 128
bytes), and the two scale boxes, float32 (gpc x bm) and (gpc x bn), gpc = 4 / group promotion
groups per chunk (a group = `group` k32 blocks accumulated by the tensor core into a fresh
partial fragment, then promoted: acc += part * (sx * sw) in FP32).

wload = "fp4" (group 1 only): the B box is the packed E2M1 weight (bn x 64 bytes, plain
row-major staging buffer); converter warps expand it into the stage's E4M3 B tile (bn x 128,
the same swizzled layout) and arrive on a third barrier per stage (resgen.kernels.
linear_sm90_fp8_convert). Shared memory per stage then holds both.

Accumulator fragment of wgmma m64nN (f32), per thread (warp q of its warpgroup, lane = 4 g + t),
element 4 i + e (i < bn / 8, e < 4):  token row 16 q + g + 8 (e // 2), channel 8 i + 2 t + e % 2.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["KC", "K_BLOCK", "PRODUCER_REGS", "CONSUMER_REGS", "Fp8Geometry", "fragment_coord"]

KC = 128                 # K per chunk (stage): 128 E4M3 bytes = one 128-byte swizzle row
K_BLOCK = 32             # MXFP4 block = one fp8 wgmma k-step
PRODUCER_REGS = 40       # setmaxnreg of the producer warpgroup (2-consumer kernels)
CONSUMER_REGS = 232      # 128 x 40 + 256 x 232 = 168 x 384: the CTA's launch budget
_BAR_BYTES = 1024        # barriers and alignment slack


def fragment_coord(q: int, lane: int, i: int, e: int) -> tuple[int, int]:
    """(token row inside the warpgroup's 64, channel inside the CTA's bn) of accumulator
    element 4 i + e of lane `lane` in warp q (the wgmma m64nN f32 D fragment)."""
    g, t = lane // 4, lane % 4
    return 16 * q + g + 8 * (e // 2), 8 * i + 2 * t + e % 2


@dataclass(frozen=True)
class Fp8Geometry:
    """consumers: consumer warpgroups (64 tokens each); bn: channels per CTA (the wgmma N);
    stages: TMA ring depth; group: k32 blocks per promotion (1, 2, 4); parts: partial
    fragments (1: wait for each group before promoting it; 2: the next group's wgmmas run
    while the previous one is promoted); raster: "tok" (consecutive CTAs walk token tiles)
    or "ch"."""

    consumers: int = 2
    bn: int = 128
    stages: int = 4
    group: int = 1
    parts: int = 2
    raster: str = "tok"
    wload: str = "e4m3"

    def check(self) -> None:
        """Raise ValueError for a geometry no kernel is rendered for."""
        if self.consumers not in (1, 2):
            raise ValueError(f"consumers={self.consumers} (1 or 2)")
        if self.bn % 16 or not 16 <= self.bn <= 256:
            raise ValueError(f"bn={self.bn}: a multiple of 16 in [16, 256]")
        if self.group not in (1, 2, 4):
            raise ValueError(f"group={self.group} (1, 2 or 4 k32 blocks)")
        if self.parts not in (1, 2):
            raise ValueError(f"parts={self.parts} (1 or 2)")
        if not 2 <= self.stages <= 12:
            raise ValueError(f"stages={self.stages} (2..12)")
        if self.raster not in ("tok", "ch"):
            raise ValueError(f"raster={self.raster!r}")
        if self.wload not in ("e4m3", "fp4"):
            raise ValueError(f"wload={self.wload!r} (e4m3 or fp4)")
        if self.fp4 and self.group != 1:
            raise ValueError(f"wload=fp4 converts unscaled codes: group 1 only, not "
                             f"{self.group}")

    # ------------------------------------------------------------------ sizes
    @property
    def fp4(self) -> bool:
        """Whether the weight arrives packed E2M1 and is converted in the kernel."""
        return self.wload == "fp4"

    @property
    def bm(self) -> int:
        """Tokens per CTA."""
        return 64 * self.consumers

    @property
    def gpc(self) -> int:
        """Promotion groups per chunk."""
        return (KC // K_BLOCK) // self.group

    @property
    def threads(self) -> int:
        return 128 * (1 + self.consumers)

    @property
    def release_count(self) -> int:
        """Arrivals that free a stage: one per consumer warp."""
        return 4 * self.consumers

    @property
    def a_stage_bytes(self) -> int:
        return self.bm * KC

    @property
    def b_stage_bytes(self) -> int:
        """Weight bytes TMA brings per stage: E4M3 codes, or packed E2M1 (half)."""
        return self.bn * KC // 2 if self.fp4 else self.bn * KC

    @property
    def conv_iters(self) -> int:
        """Units (16 output bytes) per converter thread per chunk, rounded up."""
        from .linear_sm90_fp8_convert import CONV_THREADS

        return -(-self.bn * 8 // CONV_THREADS)

    @property
    def conv_full(self) -> int:
        """Converter iterations in which every one of the CONV_THREADS has a unit."""
        from .linear_sm90_fp8_convert import CONV_THREADS

        return self.bn * 8 // CONV_THREADS

    @property
    def scale_stage_bytes(self) -> int:
        """Scale bytes TMA brings per stage: float32 for both operands, or (fp4) E8M0 bytes
        for the weight's."""
        return 4 * self.gpc * self.bm + (1 if self.fp4 else 4) * self.gpc * self.bn

    @property
    def scale_iters(self) -> int:
        """E8M0 words (4 scales) per converter thread per chunk, rounded up (fp4)."""
        from .linear_sm90_fp8_convert import CONV_THREADS

        return -(-self.gpc * self.bn // 4 // CONV_THREADS)

    @property
    def tx_bytes(self) -> int:
        """Bytes the four TMA copies of one stage deliver (the full barrier's expect_tx)."""
        return self.a_stage_bytes + self.b_stage_bytes + self.scale_stage_bytes

    @property
    def smem_bytes(self) -> int:
        # the converted E4M3 B tile and float32 weight scales
        conv = self.bn * KC + 4 * self.gpc * self.bn if self.fp4 else 0
        return self.stages * (self.tx_bytes + conv) + _BAR_BYTES

    @property
    def acc_regs(self) -> int:
        """FP32 registers per consumer thread: the accumulator plus the partial fragments."""
        return (1 + self.parts) * self.bn // 2

    # ------------------------------------------------------------------ grid
    def tiles(self, rows: int, n: int) -> tuple[int, int]:
        """(token tiles, channel tiles)."""
        return -(-rows // self.bm), n // self.bn

    def grid(self, rows: int, n: int) -> tuple[int, int]:
        tt, ct = self.tiles(rows, n)
        return (tt, ct) if self.raster == "tok" else (ct, tt)

    def cta_tile(self, bx, by):
        """(token tile, channel tile) of CTA (bx, by)."""
        return (bx, by) if self.raster == "tok" else (by, bx)

    def stage_of(self, c):
        """(stage, parity) of chunk c in the ring."""
        return c % self.stages, (c // self.stages) % 2
