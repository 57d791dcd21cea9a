"""W4A16 behind linear_sm90_mma's fused prologue (issue 20): the operand "copy".

W4A16 (compensation "w4a16": FP4 weights, BF16 activations never quantized) multiplies the
BF16 activations themselves by the exactly decoded weight. A fused variant's main loop reads
its operand tile (TOK rows of the CTA's K range, resgen.kernels.linear_sm90_mma_geom) from shared
memory as exact BF16 values; for W4A16 those values ARE the activations, so the prologue copies
each (token, block) item of x [m, K] into the tile instead of quantizing it, and the epilogue
scales by alpha_x alpha_w with alpha_x = 1 (the launch path passes a one, as it does for the
W4A16 xop variants). Everything else is the fused kernel as it is: the work items, the tile
addresses, rows past M (never written: an MMA's B row n feeds only accumulator column n, whose
token is never stored), Kp padding columns (zeros), PDL, and the cluster (the items dealt over
the cluster's CTAs and each stored into every peer's tile through distributed shared memory:
each CTA then reads 1 / cluster of the activation bytes from L2).

Every linear_sm90_mma render imports this module (the template substitutes only); its COPY
constant (template parameter operand) picks the copy at trace time.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

from .linear_sm90_mma_geom import Geometry

__all__ = ["A16Geometry", "a16_geometry", "copy_words"]


@dataclass(frozen=True)
class A16Geometry(Geometry):
    """Geometry of a W4A16 fused kernel: Geometry's index math, with the prologue's base items
    copied (operand "copy"); one operand row per token, no K-Ext extension."""

    operand: str = "copy"

    def check(self) -> None:
        super().check()
        if self.operand != "copy":
            raise ValueError(f"A16Geometry of operand {self.operand!r}")
        if not self.fused:
            raise ValueError("the W4A16 copy is the fused prologue's (xop variants read the "
                             "activations as their operand already)")
        if self.mext or self.ksel:
            raise ValueError("W4A16 has no residue rows and no K-Ext extension")


def a16_geometry(g: Geometry) -> A16Geometry:
    """The W4A16 twin of a plain (mext False, ksel 0) fused geometry."""
    return A16Geometry(**{f.name: getattr(g, f.name) for f in dataclasses.fields(Geometry)})


def copy_words(load: Callable[[Any], tuple], a: Any, bs: int) -> list:
    """The bs BF16 values at global address a (one quantization block's span of x, 16-byte
    aligned) as operand words: bs / 8 16-byte loads (`load`: the template's LD_X), packed
    pairs with element 0 low, exactly the layout operand_words gives a quantized block."""
    words: list = []
    for q in range(bs // 8):
        words.extend(load(a + 16 * q))
    return words
