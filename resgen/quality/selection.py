"""Channel-selection scores for K-Ext (block-local: exactly k channels per 8-channel group).

"mean_abs"  the paper's salience: E|x_i| over calibration tokens.
"error"     error-aware: the output error the channel's residue causes when left
            uncompensated, E[r_i^2] * ||W[:, i]||^2, where r = x - qdq(x) is the activation
            residue of the format (dynamic scale per call) and W the layer weight [N, K].
            Compensating channel i removes (almost all of) r_i W[:, i] from the output, so this
            is the diagonal estimate of the output-error reduction that choosing it buys.
Both go through resgen.calibrate.select_channels, so the layout contract is unchanged.
"""

from __future__ import annotations

import torch

from ..calibrate import Selection, select_channels
from .capture import SiteStats

__all__ = ["SCORES", "channel_scores", "select"]

SCORES: tuple[str, ...] = ("mean_abs", "error")


def channel_scores(kind: str, stats: SiteStats, weight: torch.Tensor, fmt: str) -> torch.Tensor:
    """float64 [K] selection score of every input channel. weight: [N, K] float."""
    if kind == "mean_abs":
        return stats.channel.mean_abs()
    if kind == "error":
        col_sq = (weight.double() ** 2).sum(0)
        return stats.mean_res_sq(fmt) * col_sq
    raise ValueError(f"unknown selection score {kind!r}; expected one of {SCORES}")


def select(kind: str, stats: SiteStats, weight: torch.Tensor, fmt: str,
           ratio: float) -> Selection:
    """Block-local Selection of 8 * ratio channels per group by the named score."""
    return select_channels(channel_scores(kind, stats, weight, fmt), ratio)
