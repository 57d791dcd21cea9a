"""One check shared by the CPU and GPU tests that compare resgen's engine with transformers'
generate on the same checkpoint (tests/test_hf.py, tests/gpu/test_hf_gpu.py)."""

from __future__ import annotations

import torch


def assert_teacher_forced_agree(want: torch.Tensor, have: torch.Tensor, tokens: list[int],
                                prefill_rel: float, decode_rel: float, tag: object = None
                                ) -> None:
    """want, have: float [S, V], the logits predicting tokens[0 .. S-1] (transformers' greedy
    tokens) from transformers' generate and from the engine teacher-forced on those tokens.
    The prefill's row (0) agrees to prefill_rel and every row to decode_rel of the largest
    |logit| of want; the engine's greedy choice is want's token wherever want's margin
    between its token and the engine's choice exceeds that row's largest difference."""
    assert have.shape == want.shape and bool(torch.isfinite(have).all()), tag
    diff = (have - want).abs().amax(-1)                                  # [S]
    top = float(want.abs().max())
    assert float(diff[0]) <= prefill_rel * top, (tag, diff.tolist(), top)
    assert float(diff.max()) <= decode_rel * top, (tag, diff.tolist(), top)
    for t, tok in enumerate(tokens):
        pick = int(have[t].argmax())
        margin = float(want[t, tok] - want[t, pick])
        assert pick == tok or margin <= float(diff[t]), (tag, t, pick, tok, margin)
