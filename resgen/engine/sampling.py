"""Next-token choice on the device: greedy, or temperature + nucleus (top-p) sampling.

sample(logits [B, V] float32, params, generator) -> int64 [B], no host sync. Sampling draws
from a torch.Generator seeded per generate() call, so a seed reproduces a run (same prompts,
same batch); greedy is argmax (ties: the lowest id).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["SamplingParams", "sample"]


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 = greedy; top_p in (0, 1] keeps the smallest set of most likely tokens
    whose probability reaches top_p."""

    temperature: float = 0.0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        t, p = self.temperature, self.top_p
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t >= 0 or \
                t == float("inf"):
            raise ValueError(f"temperature must be a finite number >= 0, got {t!r}")
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
            raise ValueError(f"top_p must lie in (0, 1], got {p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def sample(logits: torch.Tensor, params: SamplingParams,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """logits: float32 [B, V] -> token ids int64 [B] (see the module docstring)."""
    if params.greedy:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sp, idx = probs.sort(dim=-1, descending=True)
        # drop a token when the tokens before it already reach top_p (the first always stays)
        drop = (sp.cumsum(dim=-1) - sp) >= params.top_p
        sp = sp.masked_fill(drop, 0.0)
        pick = torch.multinomial(sp, 1, generator=generator)
        return idx.gather(-1, pick).squeeze(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
