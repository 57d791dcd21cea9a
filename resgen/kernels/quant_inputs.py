"""Check inputs of the layer quantizers (quant_sm90, quant_sm100): activations of every kind
that stresses a rounding path (make_inputs) and random K-Ext channel selections
(random_masks), for the CPU tests, the GPU tests and the families' runner checks.
"""

from __future__ import annotations

import torch

from ..calibrate import GROUP, RATIOS

__all__ = ["INPUT_KINDS", "make_inputs", "random_masks"]

# the K-Ext compensations as the quantizers name them ("0.125" ... "1.0") -> the ratio
_KEXT_RATIOS = {str(r): r for r in RATIOS}

INPUT_KINDS: tuple[str, ...] = ("randn", "outliers", "ties", "zeros", "tiny", "huge", "mixed")


def make_inputs(kind: str, m: int, k: int, seed: int = 0, device="cpu") -> torch.Tensor:
    """Test activations x: [m, K] bf16 of one kind (CPU tests, GPU tests and runner checks).

    randn     normal values with per-token scales spanning 1e-3..1e3
    outliers  randn plus a few 100x channels (the calibration-sensitive case)
    ties      blocks whose amax is 6 (so d = 1 for alpha = 1 / 2^-8 static or MXFP4) filled with
              E2M1 midpoints 0.25, 0.75, ..., 5 and grid values, both signs, and the x = 2688
              element that makes the dynamic NVFP4 alpha exactly 1
    zeros     all-zero tokens, -0.0 blocks and zero blocks next to non-zero ones
    tiny      bf16 subnormals and values near FLT_MIN (scale underflow, subnormal d)
    huge      values near the bf16 maximum (3.39e38)
    mixed     tiny and huge values inside the same block (quotients that underflow)
    """
    if kind not in INPUT_KINDS:
        raise ValueError(f"kind must be one of {INPUT_KINDS}, got {kind!r}")
    if m < 1 or k % 32:
        raise ValueError("need m >= 1 and K a multiple of 32")
    g = torch.Generator().manual_seed(seed)
    if kind in ("randn", "outliers"):
        scale = torch.exp(torch.empty(m, 1).uniform_(-7, 7, generator=g))
        x = torch.randn(m, k, generator=g) * scale
        if kind == "outliers":
            ch = torch.randint(0, k, (max(1, k // 256),), generator=g)
            x[:, ch] *= 100.0
    elif kind == "ties":
        grid = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0,
                             0.0, 0.125, 5.5])
        x = grid[torch.randint(0, grid.numel(), (m, k), generator=g)]
        x = x * torch.where(torch.rand(m, k, generator=g) < 0.5, -1.0, 1.0)
        blocks = x.view(m, k // 16, 16)
        blocks[:, :, 0] = 6.0 * torch.where(torch.rand(m, k // 16, generator=g) < 0.5, -1.0, 1.0)
        x[0, -1] = 2688.0
    elif kind == "zeros":
        x = torch.randn(m, k, generator=g)
        x[::2] = 0.0
        blocks = x.view(m, k // 16, 16)
        blocks[:, ::3] = -0.0
        blocks[:, 1::5] = 0.0
    elif kind == "tiny":
        e = torch.randint(-140, -118, (m, k), generator=g).to(torch.float32)
        x = torch.ldexp(torch.rand(m, k, generator=g) + 0.5, e.to(torch.int32))
        x = x * torch.where(torch.rand(m, k, generator=g) < 0.5, -1.0, 1.0)
    elif kind == "huge":
        x = (torch.rand(m, k, generator=g) * 2 - 1) * 3.3e38
    else:
        e = torch.randint(-130, 127, (m, k), generator=g).to(torch.int32)
        x = torch.ldexp(torch.rand(m, k, generator=g) + 0.5, e)
        x = x * torch.where(torch.rand(m, k, generator=g) < 0.5, -1.0, 1.0)
    x = x.to(torch.bfloat16)
    if not bool(torch.isfinite(x.float()).all()):      # bf16 rounding of the huge kind
        x = torch.nan_to_num(x, posinf=3.3e38, neginf=-3.3e38)
    return x.to(device)


def random_masks(k: int, compensation: str, seed: int = 0, device="cpu") -> torch.Tensor:
    """uint8 [K / 8]: a random block-local selection for a K-Ext compensation ratio ("0.125",
    "0.25", "0.5" or "1.0": ksel channels of every 8-channel group, ksel = 8 x ratio)."""
    if compensation not in _KEXT_RATIOS:
        raise ValueError(f"{compensation!r} is not a K-Ext ratio")
    ks = int(round(GROUP * _KEXT_RATIOS[compensation]))
    g = torch.Generator().manual_seed(seed)
    order = torch.rand(k // GROUP, GROUP, generator=g).argsort(dim=-1)[:, :ks]
    masks = (torch.ones_like(order) << order).sum(-1).to(torch.uint8)
    return masks.to(device)
