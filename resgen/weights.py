"""Weight-side error reduction that is free at run time: better codes and scales, same format.

Every function here returns an ordinary resgen.formats.QuantizedTensor (E2M1 codes packed as
formats does, E4M3 / E8M0 block scales, the NVFP4 global scale amax(W) / 2688), so the kernels
and resgen.formats.dequantize read the result unchanged; only WHICH scale and code each block
holds differs from formats.quantize's amax / 6 rule.

amax       formats.quantize itself (the paper's weights).
search     per-block scale search: candidate scales amax / T for T in a grid around 6 (NVFP4;
           T = 4 is the "Four Over Six" choice of Cook et al., 2025) or the E8M0 exponent and its
           neighbours (MXFP4); each block keeps the candidate with the least (optionally
           activation-weighted) reconstruction error. The amax / 6 scale is always a candidate
           and wins ties, so the block error never increases.
4over6     search with T in {6, 4} only, unweighted (Four Over Six adaptive block scaling).
gptq       codes chosen column by column with second-order error feedback (the GPTQ
           procedure, Frantar et al., 2023) from calibration input statistics H = sum x x^T;
           each block's scale is picked by `search` when the sweep reaches it.

Importance weights: `importance` is a float [K] per input channel, e.g. E[x_i^2] over
calibration tokens: the expected squared output error of a row is then
sum_i E[x_i^2] (w_i - w_hat_i)^2 when input channels are uncorrelated (AWQ's view).
"""

from __future__ import annotations

from typing import Sequence

import torch

from . import formats
from .calibrate import QLinearWeight, Selection, extend_weight
from .formats import QuantizedTensor

__all__ = ["WEIGHT_METHODS", "NVFP4_TARGETS", "quantize_with_scales", "block_error",
           "search_scales", "four_over_six", "gptq", "prepare"]

WEIGHT_METHODS: tuple[str, ...] = ("amax", "search", "4over6", "gptq")
# Target block maxima: the block amax maps to E2M1 value T (T < 6 clips the largest elements
# to +-6 in exchange for a finer grid). 6 first: it is the formats.quantize rule.
NVFP4_TARGETS: tuple[float, ...] = (6.0, 6.5, 5.5, 5.0, 4.5, 4.0, 3.5)
_MX_SHIFTS: tuple[int, ...] = (0, 1, -1)


def _blocks(w: torch.Tensor, fmt: str) -> torch.Tensor:
    bs = formats.block_size(fmt)
    return w.reshape(*w.shape[:-1], w.shape[-1] // bs, bs)


def _check_weight(w: torch.Tensor, fmt: str) -> torch.Tensor:
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor weight, got {type(w).__name__}")
    if w.dim() != 2:
        raise ValueError(f"a linear weight is [N, K], got shape {tuple(w.shape)}")
    if w.shape[1] % formats.block_size(fmt):
        raise ValueError(f"{fmt} needs K to be a multiple of {formats.block_size(fmt)}, "
                         f"got K={w.shape[1]}")
    wf = w.detach().to(torch.float32)
    if not bool(torch.isfinite(wf).all()):
        raise ValueError("weight contains NaN or Inf")
    return wf


def _effective(scales: torch.Tensor, fmt: str, alpha: torch.Tensor | None) -> torch.Tensor:
    """Stored block scales [..., nb] -> effective FP32 scale d [..., nb, 1] (formats' order)."""
    if fmt == "nvfp4":
        return (alpha * scales.to(torch.float32)).unsqueeze(-1)
    return torch.ldexp(torch.ones(scales.shape, dtype=torch.float32, device=scales.device),
                       scales.to(torch.int32) - 127).unsqueeze(-1)


def _codes(wf: torch.Tensor, fmt: str, scales: torch.Tensor, alpha) -> torch.Tensor:
    """E2M1 codes uint8 [N, K] of wf under the given stored block scales."""
    blocks = _blocks(wf, fmt)
    d = _effective(scales, fmt, alpha)
    if fmt == "nvfp4":
        v = blocks / torch.where(d > 0, d, torch.full_like(d, float("inf")))
    else:
        v = torch.ldexp(blocks, 127 - scales.to(torch.int32).unsqueeze(-1))
    return formats.e2m1_encode(v).reshape(wf.shape)


def quantize_with_scales(w: torch.Tensor, fmt: str, scales: torch.Tensor,
                         global_scale: torch.Tensor | None = None) -> QuantizedTensor:
    """Quantize w: [N, K] with GIVEN stored block scales (codes by formats' rounding rule).

    scales: NVFP4 float8_e4m3fn [N, K // 16] (global_scale: float32 alpha, required);
            MXFP4 uint8 E8M0 [N, K // 32] (global_scale must be None).
    With the amax / 6 scales this returns exactly formats.quantize(w, fmt, global_scale).
    """
    wf = _check_weight(w, fmt)
    nb = wf.shape[1] // formats.block_size(fmt)
    if tuple(scales.shape) != (wf.shape[0], nb):
        raise ValueError(f"scales must be [{wf.shape[0]}, {nb}], got {tuple(scales.shape)}")
    if fmt == "nvfp4":
        if scales.dtype != torch.float8_e4m3fn or global_scale is None:
            raise TypeError("NVFP4 needs float8_e4m3fn scales and a global scale")
        alpha = formats._check_global_scale(global_scale, wf.device)
    else:
        if scales.dtype != torch.uint8 or global_scale is not None:
            raise TypeError("MXFP4 needs uint8 E8M0 scales and no global scale")
        alpha = None
    codes = _codes(wf, fmt, scales, alpha)
    return QuantizedTensor(fmt, formats.pack_fp4(codes), scales, alpha)


def block_error(w: torch.Tensor, q: QuantizedTensor,
                importance: torch.Tensor | None = None) -> torch.Tensor:
    """float64 [N, K // bs]: per-block sum_i importance_i * (w_i - dequantize(q)_i)^2."""
    err = (w.double() - formats.dequantize(q).double()) ** 2
    if importance is not None:
        err = err * _importance(importance, w.shape[1])
    return _blocks(err, q.fmt).sum(-1)


def _importance(importance: torch.Tensor, k: int) -> torch.Tensor:
    imp = torch.as_tensor(importance, dtype=torch.float64).reshape(-1)
    if imp.numel() != k:
        raise ValueError(f"importance has {imp.numel()} entries, the weight has K={k}")
    if not bool(torch.isfinite(imp).all()) or bool((imp < 0).any()):
        raise ValueError("importance must be finite and non-negative")
    return imp


def _candidate_scales(wf: torch.Tensor, fmt: str, alpha, targets: Sequence[float]):
    """Candidate stored scales, each [N, nb]; the first is formats' amax rule."""
    amax = _blocks(wf, fmt).abs().amax(-1)
    if fmt == "nvfp4":
        return [formats.e4m3_round((amax / t) / alpha) for t in targets]
    base = formats.quantize(wf, "mxfp4").scales.to(torch.int32)
    # Shifted exponents of all-zero blocks stay at the default (their codes are all zero).
    return [torch.where(amax > 0, (base + s).clamp(0, 254), base).to(torch.uint8)
            for s in _MX_SHIFTS]


def _scaled(blocks: torch.Tensor, fmt: str, scales: torch.Tensor, d: torch.Tensor):
    """blocks / effective scale, divided exactly as formats does (by d, or by 2^e)."""
    if fmt == "nvfp4":
        return blocks / torch.where(d > 0, d, torch.full_like(d, float("inf")))
    return torch.ldexp(blocks, 127 - scales.to(torch.int32).unsqueeze(-1))


def search_scales(w: torch.Tensor, fmt: str, *, importance: torch.Tensor | None = None,
                  targets: Sequence[float] = NVFP4_TARGETS,
                  global_scale: torch.Tensor | None = None) -> QuantizedTensor:
    """Per-block scale search. w: [N, K] float -> QuantizedTensor [N, K].

    importance: optional float [K] weights of the squared error (e.g. E[x^2]); None = plain MSE.
    targets: NVFP4 block-maximum targets (the first must be 6.0, the amax rule); MXFP4 tries
        the amax exponent and its two neighbours instead.
    global_scale: NVFP4 alpha; None -> formats.nvfp4_global_scale(w), as prepare_weight uses.
    Guarantee: every block's error is <= that of formats.quantize(w, fmt, global_scale).
    """
    wf = _check_weight(w, fmt)
    if fmt == "nvfp4":
        if not targets or float(targets[0]) != formats.E2M1_MAX:
            raise ValueError("the first NVFP4 target must be 6.0 (the amax rule)")
        if any(not (0 < float(t) <= 64) for t in targets):
            raise ValueError("NVFP4 targets must lie in (0, 64]")
        alpha = formats.nvfp4_global_scale(wf) if global_scale is None else \
            formats._check_global_scale(global_scale, wf.device)
    else:
        if global_scale is not None:
            raise ValueError("MXFP4 has no global scale")
        alpha = None
    blocks = _blocks(wf, fmt)
    imp = None if importance is None else \
        _blocks(_importance(importance, wf.shape[1]).to(torch.float32), fmt)
    best = None
    for sc in _candidate_scales(wf, fmt, alpha, targets):
        d = _effective(sc, fmt, alpha)
        grid = formats.e2m1_round(_scaled(blocks, fmt, sc, d))
        # Per-block error in float64 (candidates can differ by less than FP32 resolution).
        err = (blocks.double() - (d * grid).double()) ** 2
        err = (err if imp is None else err * imp.double()).sum(-1)
        if best is None:
            best = [err, sc.view(torch.uint8), grid]
            continue
        better = err < best[0]                    # strict: ties keep the earlier candidate
        best[0] = torch.where(better, err, best[0])
        best[1] = torch.where(better, sc.view(torch.uint8), best[1])
        best[2] = torch.where(better.unsqueeze(-1), grid, best[2])
    # The kept grid values are exact E2M1 values, so encoding them gives their codes.
    codes = formats.e2m1_encode(best[2]).reshape(wf.shape)
    scales = best[1].view(torch.float8_e4m3fn) if fmt == "nvfp4" else best[1]
    return QuantizedTensor(fmt, formats.pack_fp4(codes), scales, alpha)


def four_over_six(w: torch.Tensor, *, importance: torch.Tensor | None = None,
                  global_scale: torch.Tensor | None = None) -> QuantizedTensor:
    """NVFP4 adaptive block scaling: each block scales its amax to 6 or to 4, whichever errs less."""
    return search_scales(w, "nvfp4", importance=importance, targets=(6.0, 4.0),
                         global_scale=global_scale)


def gptq(w: torch.Tensor, hessian: torch.Tensor, fmt: str, *, damp: float = 0.01,
         block: int = 128, targets: Sequence[float] = NVFP4_TARGETS,
         global_scale: torch.Tensor | None = None) -> QuantizedTensor:
    """GPTQ-style code choice. w: [N, K] float; hessian: [K, K] sum of x x^T (float64).

    Columns are quantized left to right; each column's rounding error is pushed onto the
    not-yet-quantized columns through the inverse Hessian's Cholesky factor, so the OUTPUT
    error on the calibration inputs is minimised, not the weight error. A block's scale is
    chosen (search_scales with the Hessian diagonal as importance) when the sweep enters it,
    from the error-updated weights. Result: valid FP4 codes / scales in formats' layout.
    """
    wf = _check_weight(w, fmt)
    k = wf.shape[1]
    bs = formats.block_size(fmt)
    if tuple(hessian.shape) != (k, k):
        raise ValueError(f"hessian must be [{k}, {k}], got {tuple(hessian.shape)}")
    if block % bs:
        raise ValueError(f"block ({block}) must be a multiple of the format block size ({bs})")
    alpha = None
    if fmt == "nvfp4":
        alpha = formats.nvfp4_global_scale(wf) if global_scale is None else \
            formats._check_global_scale(global_scale, wf.device)
    h = hessian.to(torch.float64).clone()
    dead = torch.diagonal(h) == 0
    h[dead, dead] = 1.0
    work = wf.double().clone()
    work[:, dead] = 0.0
    diag_mean = float(torch.diagonal(h).mean())
    h += torch.eye(k, dtype=torch.float64) * damp * diag_mean
    hinv = torch.cholesky_inverse(torch.linalg.cholesky(h))
    u = torch.linalg.cholesky(hinv, upper=True)
    imp_all = torch.diagonal(h).clone()
    scales = []
    codes = torch.zeros(wf.shape, dtype=torch.uint8)
    for c0 in range(0, k, block):
        c1 = min(c0 + block, k)
        wb = work[:, c0:c1].clone()
        errs = torch.zeros_like(wb)
        ub = u[c0:c1, c0:c1]
        for g0 in range(0, c1 - c0, bs):
            # Choose this format block's scale from the error-updated weights.
            cols = slice(g0, g0 + bs)
            sub = search_scales(wb[:, cols].float(), fmt, importance=imp_all[c0 + g0: c0 + g0 + bs],
                                targets=targets, global_scale=alpha)
            scales.append(sub.scales)
            d32 = _effective(sub.scales, fmt, alpha).reshape(-1, 1)
            d = d32.reshape(-1).double()
            grid_cols = []
            for j in range(g0, g0 + bs):
                v = _scaled(wb[:, j].float().unsqueeze(-1), fmt, sub.scales.reshape(-1),
                            d32).squeeze(-1)
                grid = formats.e2m1_round(v)
                grid_cols.append(grid)
                e = (wb[:, j] - d * grid.double()) / ub[j, j]
                wb[:, j + 1:] -= e.unsqueeze(1) * ub[j, j + 1:].unsqueeze(0)
                errs[:, j] = e
            codes[:, c0 + g0: c0 + g0 + bs] = formats.e2m1_encode(torch.stack(grid_cols, -1))
        work[:, c1:] -= errs @ u[c0:c1, c1:]
    sc = torch.cat(scales, dim=-1)
    return QuantizedTensor(fmt, formats.pack_fp4(codes), sc, alpha)


def prepare(w: torch.Tensor, fmt: str, method: str = "amax", *,
            selection: Selection | None = None, importance: torch.Tensor | None = None,
            ext_importance: torch.Tensor | None = None, hessian: torch.Tensor | None = None,
            input_scale=None, base: QuantizedTensor | None = None,
            global_scale=None) -> QLinearWeight:
    """resgen.calibrate.prepare_weight with a weight-side method. w: [N, K] float.

    importance: [K] for the base columns (E[x^2]); ext_importance: [len(selection.indices)]
        for the K-Ext columns (E[r^2] of the selected channels: they multiply the residue).
    hessian: [K, K] for "gptq" (its K-Ext columns use `search` with ext_importance).
    base: a precomputed base QuantizedTensor [N, K] of this method (a cache: GPTQ's base does
        not depend on the selection); None computes it.
    The base part and the extension are quantized independently, as formats' blocks never
    straddle K; the NVFP4 global scale is amax(W) / 2688 for both (prepare_weight's rule), or
    global_scale when given (e.g. one alpha shared by layers that are fused at load).
    """
    if method not in WEIGHT_METHODS:
        raise ValueError(f"unknown weight method {method!r}; expected one of {WEIGHT_METHODS}")
    from .calibrate import prepare_weight

    if method == "amax":
        return prepare_weight(w, fmt, selection=selection, input_scale=input_scale,
                              global_scale=global_scale)
    wf = _check_weight(w, fmt)
    alpha = None
    if fmt == "nvfp4":
        alpha = formats.nvfp4_global_scale(wf) if global_scale is None else \
            formats._check_global_scale(global_scale, wf.device)
    elif global_scale is not None:
        raise ValueError("MXFP4 has no global scale")
    if base is not None:
        if base.fmt != fmt or tuple(base.shape) != tuple(wf.shape):
            raise ValueError("the precomputed base does not match the weight / format")
    elif method == "gptq":
        if hessian is None:
            raise ValueError("gptq needs the calibration hessian [K, K]")
        base = gptq(wf, hessian, fmt, global_scale=alpha)
    else:
        base = _search(wf, fmt, method, importance, alpha)
    parts = [base]
    if selection is not None:
        ext_w = extend_weight(wf, selection, fmt)[:, wf.shape[1]:]
        ext_imp = None
        if ext_importance is not None and method != "4over6":
            ext_imp = torch.nn.functional.pad(
                torch.as_tensor(ext_importance, dtype=torch.float64).reshape(-1),
                (0, ext_w.shape[1] - selection.indices.numel()))
        parts.append(_search(ext_w, fmt, "search" if method == "gptq" else method, ext_imp, alpha))
    q = formats.cat(parts)
    ref = prepare_weight(wf, fmt, selection=selection, input_scale=input_scale)
    return QLinearWeight(q, wf.shape[1], selection, ref.input_scale, {"weight_method": method})


def _search(wf, fmt, method, importance, alpha) -> QuantizedTensor:
    if method == "4over6":
        if fmt != "nvfp4":
            # Four Over Six is defined for NVFP4's free E4M3 scales; MXFP4 searches exponents.
            return search_scales(wf, fmt)
        return four_over_six(wf, global_scale=alpha)
    return search_scales(wf, fmt, importance=importance,
                         global_scale=alpha if fmt == "nvfp4" else None)
