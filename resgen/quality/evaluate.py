"""Perplexity and per-layer output NMSE of fake-quantized models."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..reference import nmse

__all__ = ["perplexity", "paired_nll_difference", "layer_nmse", "gap_closed",
           "nmse_reduction"]


@torch.no_grad()
def perplexity(model, seqs: torch.Tensor, *, batch: int = 4) -> dict:
    """Next-token perplexity of model on seqs: int64 [S, T] (S * (T - 1) predictions).

    Returns {"ppl", "nll" (mean, nats), "tokens", "seq_nll" (each sequence's mean nll, for
    paired comparisons of two methods on the same sequences)}; the sums are in float64, so
    they do not depend on the batch size beyond FP32 rounding of the logits.
    """
    total, count = 0.0, 0
    per_seq: list[float] = []
    for i in range(0, seqs.shape[0], batch):
        ids = seqs[i: i + batch]
        logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()
        flat, tgt = logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)
        total += float(F.cross_entropy(flat, tgt, reduction="sum").double())
        tok = F.cross_entropy(flat, tgt, reduction="none").double()
        per_seq += tok.reshape(ids.shape[0], -1).mean(dim=1).tolist()
        count += ids[:, 1:].numel()
    mean = total / count
    return {"ppl": math.exp(mean), "nll": mean, "tokens": count, "seq_nll": per_seq}


def paired_nll_difference(a: list[float], b: list[float]) -> dict[str, float]:
    """Per-sequence mean nll of two methods on the same sequences -> {"mean": mean of a - b,
    "se": its standard error (sample std / sqrt(n)), "n"}; n >= 2."""
    if len(a) != len(b) or len(a) < 2:
        raise ValueError(f"need two equal-length per-sequence lists of >= 2, got {len(a)}, "
                         f"{len(b)}")
    d = torch.tensor(a, dtype=torch.float64) - torch.tensor(b, dtype=torch.float64)
    return {"mean": float(d.mean()), "se": float(d.std() / math.sqrt(len(a))), "n": len(a)}


@torch.no_grad()
def layer_nmse(module: torch.nn.Module, x: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None = None) -> float:
    """Pooled output NMSE of a (quantized) linear module on x: [M, K] against x @ weight^T
    (+ bias: [N]) in float64 (the unquantized FP32 layer: weight and activation error are both
    counted)."""
    ref = x.double() @ weight.double().T
    if bias is not None:
        ref = ref + bias.double()
    return nmse(module(x).double(), ref)


def gap_closed(ppl_method: float, ppl_plain: float, ppl_ref: float) -> float:
    """Fraction of the plain-W4A4 -> reference perplexity gap that a method recovers."""
    gap = ppl_plain - ppl_ref
    if gap <= 0:
        raise ValueError("plain W4A4 is not worse than the reference: no gap to close")
    return (ppl_plain - ppl_method) / gap


def nmse_reduction(method: dict[str, float], plain: dict[str, float]) -> dict[str, float]:
    """Per-layer NMSE dicts (layer -> NMSE) -> summary of the reduction vs plain W4A4.

    mean_layer: mean over layers of 1 - nmse_m / nmse_plain (each layer counts once, the
        paper's per-input pooled metric applied layer by layer);
    geomean: 1 - geometric mean of the per-layer ratios;
    Negative values mean a larger error than plain W4A4.
    """
    names = sorted(plain)
    ratios = torch.tensor([method[n] / plain[n] for n in names], dtype=torch.float64)
    return {"mean_layer": float(1 - ratios.mean()),
            "geomean": float(1 - torch.exp(torch.log(ratios).mean())),
            "layers": len(names)}
