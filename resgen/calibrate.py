"""Selective compensation: calibration statistics, block-local channel selection, K-Ext weights.

Block-local selection (paper 5.3, B.1): within every group of 8 consecutive input channels,
exactly k = 8 * ratio channels are chosen by a calibration score, one 8-bit mask per group.
Because every group contributes the same number of channels, the fused quantizer can write
the residue extension without any run-time reordering.

The K-Ext identity this module maintains (paper Eq. 6):
    [X_hat | R_hat_S] @ [W | W_S]_hat^T  ==  X_hat W_hat^T + R_hat_S W_hat_S^T
where [W | W_S] is extended OFFLINE (selected input channels copied after the base ones,
zero-padded to the format's block) and quantized in that extended layout.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

import torch

from . import formats
from .formats import QuantizedTensor

__all__ = [
    "RATIOS",
    "GROUP",
    "ChannelStats",
    "Selection",
    "select_channels",
    "QLinearWeight",
    "prepare_weight",
    "static_alpha",
    "extend_weight",
    "save_layers",
    "load_layers",
    "read_metadata",
]

GROUP = 8
RATIOS: tuple[float, ...] = (0.125, 0.25, 0.5, 1.0)


def _check_ratio(ratio: float) -> int:
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or ratio not in RATIOS:
        raise ValueError(f"compensation ratio must be one of {RATIOS}, got {ratio!r}")
    return int(round(GROUP * ratio))


class ChannelStats:
    """Streaming per-channel activation statistics over calibration tokens (constant memory).

    update(x) takes x: [..., K] activations; the statistics are sums in float64, so the result
    does not depend on how the tokens were batched (up to float64 rounding).
    """

    def __init__(self, in_features: int):
        self.in_features = in_features
        self.count = 0
        self.sum_abs = torch.zeros(in_features, dtype=torch.float64)
        self.sum_sq = torch.zeros(in_features, dtype=torch.float64)

    def update(self, x: torch.Tensor) -> None:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"expected activations with K={self.in_features}, got {x.shape[-1]}")
        x2 = x.detach().reshape(-1, self.in_features).to("cpu", torch.float64)
        if not bool(torch.isfinite(x2).all()):
            raise ValueError("calibration activations contain NaN or Inf")
        self.count += x2.shape[0]
        self.sum_abs += x2.abs().sum(0)
        self.sum_sq += (x2 * x2).sum(0)

    def mean_abs(self) -> torch.Tensor:
        """float64 [K]: mean |x| per channel (the paper's salience score)."""
        if self.count == 0:
            raise ValueError("no calibration tokens were recorded")
        return self.sum_abs / self.count

    def mean_sq(self) -> torch.Tensor:
        """float64 [K]: mean x^2 per channel."""
        if self.count == 0:
            raise ValueError("no calibration tokens were recorded")
        return self.sum_sq / self.count


@dataclass(frozen=True)
class Selection:
    """Block-local channel selection for one linear layer.

    masks: uint8 [K // 8]; bit j of masks[g] selects channel 8 * g + j.
    ratio: the compensation ratio (k = 8 * ratio channels per group).
    """

    masks: torch.Tensor
    ratio: float

    def __post_init__(self):
        k = _check_ratio(self.ratio)
        if self.masks.dtype != torch.uint8 or self.masks.dim() != 1:
            raise ValueError("selection masks must be a 1-D uint8 tensor (one byte per group)")
        bits = torch.tensor([1 << j for j in range(GROUP)], dtype=torch.uint8)
        per_group = ((self.masks.unsqueeze(-1) & bits) != 0).sum(-1)
        if bool((per_group != k).any()):
            raise ValueError(f"every 8-channel group must select exactly {k} channels "
                             f"for ratio {self.ratio}")

    @property
    def in_features(self) -> int:
        return self.masks.numel() * GROUP

    @property
    def k(self) -> int:
        return int(round(GROUP * self.ratio))

    @property
    def indices(self) -> torch.Tensor:
        """int64 [K * ratio]: selected channels, group by group, ascending within a group."""
        bits = torch.tensor([1 << j for j in range(GROUP)], dtype=torch.uint8)
        sel = ((self.masks.unsqueeze(-1) & bits) != 0).reshape(-1)
        return torch.nonzero(sel).reshape(-1)

    def extension_length(self, fmt: str) -> int:
        return formats.extension_length(self.indices.numel(), fmt)


def select_channels(scores: torch.Tensor, ratio: float) -> Selection:
    """Top-k = 8 * ratio channels inside every group of 8 by score (ties: lower index wins).

    scores: [K] float (e.g. ChannelStats.mean_abs()); K % 8 == 0.
    """
    k = _check_ratio(ratio)
    scores = torch.as_tensor(scores).reshape(-1).to(torch.float64)
    if scores.numel() % GROUP:
        raise ValueError(f"K={scores.numel()} is not a multiple of the group size {GROUP}")
    if not bool(torch.isfinite(scores).all()):
        raise ValueError("channel scores contain NaN or Inf")
    groups = scores.reshape(-1, GROUP)
    order = torch.sort(-groups, dim=-1, stable=True).indices[:, :k]
    masks = (torch.ones_like(order, dtype=torch.int64) << order).sum(-1).to(torch.uint8)
    return Selection(masks, ratio)


def extend_weight(w: torch.Tensor, selection: Selection, fmt: str) -> torch.Tensor:
    """W: [N, K] float -> [N, K + ext] float: selected input channels appended, zero-padded."""
    if w.shape[-1] != selection.in_features:
        raise ValueError(f"weight has K={w.shape[-1]}, selection was made for "
                         f"K={selection.in_features}")
    sel = w.index_select(-1, selection.indices.to(w.device))
    pad = selection.extension_length(fmt) - sel.shape[-1]
    return torch.cat([w, torch.nn.functional.pad(sel, (0, pad))], dim=-1)


@dataclass(frozen=True)
class QLinearWeight:
    """A linear layer's FP4 weight, prepared offline.

    q:            QuantizedTensor [N, K] (no selection) or [N, K + ext] (K-Ext layout).
    in_features:  K, the base reduction length.
    selection:    the K-Ext channel selection, or None.
    input_scale:  NVFP4 static activation tensor scale (ModelOpt input_scale) or None (dynamic).
    """

    q: QuantizedTensor
    in_features: int
    selection: Selection | None = None
    input_scale: torch.Tensor | None = None
    meta: Mapping[str, str] = field(default_factory=dict)

    @property
    def fmt(self) -> str:
        return self.q.fmt

    @property
    def out_features(self) -> int:
        return self.q.codes.shape[0]

    @property
    def ratio(self) -> float | None:
        return None if self.selection is None else self.selection.ratio

    def base(self) -> QuantizedTensor:
        """The base weight [N, K]: identical to quantize(W) because blocks never straddle K."""
        k = self.in_features
        bs = self.q.block_size
        return QuantizedTensor(self.q.fmt, self.q.codes[:, : k // 2], self.q.scales[:, : k // bs],
                               self.q.global_scale)

    def extension(self) -> QuantizedTensor:
        """The selected weight rows W_S quantized in the extended layout [N, ext]."""
        if self.selection is None:
            raise ValueError("this weight has no K-Ext extension")
        k = self.in_features
        bs = self.q.block_size
        return QuantizedTensor(self.q.fmt, self.q.codes[:, k // 2:], self.q.scales[:, k // bs:],
                               self.q.global_scale)


def static_alpha(qweight: QLinearWeight, device: torch.device | str) -> torch.Tensor | None:
    """The static NVFP4 activation tensor scale as the Hopper kernels and the layer quantizer
    take it: float32 [1] on `device`; None for MXFP4 (no tensor scale) and for an NVFP4
    weight with dynamic activation scales (no input_scale)."""
    if qweight.fmt != "nvfp4" or qweight.input_scale is None:
        return None
    return torch.as_tensor(qweight.input_scale, dtype=torch.float32, device=device).reshape(1)


def prepare_weight(w: torch.Tensor, fmt: str, selection: Selection | None = None,
                   input_scale=None, global_scale=None) -> QLinearWeight:
    """Quantize a linear weight W: [N, K] (out x in) offline, optionally in the K-Ext layout.

    global_scale: NVFP4 tensor scale alpha to use instead of amax(W) / 2688 (e.g. one alpha
    shared by q/k/v so they fuse exactly, as ModelOpt's export does); None for MXFP4.
    """
    if w.dim() != 2:
        raise ValueError(f"a linear weight is [out_features, in_features], got shape {tuple(w.shape)}")
    full = w if selection is None else extend_weight(w, selection, fmt)
    if fmt == "nvfp4":
        # The extension only copies channels, so amax (and alpha) is that of W itself.
        alpha = formats.nvfp4_global_scale(w.float()) if global_scale is None else global_scale
        q = formats.quantize(full, fmt, global_scale=alpha)
    else:
        q = formats.quantize(full, fmt, global_scale=global_scale)
    isc = None
    if input_scale is not None:
        if fmt != "nvfp4":
            raise ValueError("input_scale is an NVFP4 tensor scale; MXFP4 has none")
        isc = formats._check_global_scale(input_scale, "cpu")
    return QLinearWeight(q, w.shape[1], selection, isc)


# ----------------------------------------------------------------------------- safetensors I/O

_FORMAT_KEY = "resgen_format"
_VERSION_KEY = "resgen_checkpoint_version"
_CHECKPOINT_VERSION = "1"


def save_layers(path: str | Path, layers: Mapping[str, QLinearWeight],
                metadata: Mapping[str, str] | None = None) -> None:
    """Write prepared layers with safetensors, ModelOpt field names plus resgen's own.

    metadata: extra string entries for the file header (e.g. a compensation plan under
    "resgen_plan"); keys must not collide with resgen's own.

    Per layer `name`: name.weight (uint8 packed E2M1 [N, K(+ext)/2]), name.weight_scale (E4M3 or
    E8M0 uint8), name.weight_scale_2 (NVFP4 alpha), name.input_scale (NVFP4, static only),
    name.resgen_channel_mask (uint8 [K/8]), name.resgen_ratio and name.resgen_in_features.
    """
    from safetensors.torch import save_file

    fmts = {layer.fmt for layer in layers.values()}
    if len(fmts) > 1:
        raise ValueError("one checkpoint file holds one FP4 format")
    tensors: dict[str, torch.Tensor] = {}
    for name, layer in layers.items():
        tensors[f"{name}.weight"] = layer.q.codes.contiguous()
        tensors[f"{name}.weight_scale"] = layer.q.scales.contiguous()
        if layer.q.global_scale is not None:
            tensors[f"{name}.weight_scale_2"] = layer.q.global_scale.reshape(())
        if layer.input_scale is not None:
            tensors[f"{name}.input_scale"] = layer.input_scale.reshape(())
        tensors[f"{name}.resgen_in_features"] = torch.tensor(layer.in_features, dtype=torch.int64)
        if layer.selection is not None:
            tensors[f"{name}.resgen_channel_mask"] = layer.selection.masks.contiguous()
            tensors[f"{name}.resgen_ratio"] = torch.tensor(layer.selection.ratio,
                                                           dtype=torch.float32)
    meta = {_FORMAT_KEY: fmts.pop() if fmts else "", _VERSION_KEY: _CHECKPOINT_VERSION,
            "resgen_layers": json.dumps(sorted(layers))}
    for key, value in (metadata or {}).items():
        if key in meta or not isinstance(key, str) or not isinstance(value, str):
            raise ValueError(f"metadata entry {key!r} is reserved or not a str -> str pair")
        meta[key] = value
    save_file(tensors, str(path), metadata=meta)


def load_layers(path: str | Path) -> dict[str, QLinearWeight]:
    """Read layers written by save_layers. A checkpoint is untrusted input: the format,
    every field's presence, dtype and shape (2-D packed weights, one scale per block, row
    counts that agree), the global and input scales (positive finite numbers) and the channel
    masks are validated, and any problem is a ValueError naming the file, the layer and the
    field (a file that is not safetensors included)."""
    try:
        from safetensors import SafetensorError, safe_open
    except ImportError:                       # older safetensors: no exported error class
        from safetensors import safe_open

        SafetensorError = OSError             # type: ignore[misc,assignment]  # noqa: N806
    try:
        f = safe_open(str(path), framework="pt")
    except FileNotFoundError:
        raise ValueError(f"{path}: no such checkpoint file") from None
    except (SafetensorError, OSError, ValueError) as e:
        raise ValueError(f"{path}: not a safetensors checkpoint ({e})") from None
    with f:
        meta = f.metadata() or {}
        if meta.get(_VERSION_KEY) != _CHECKPOINT_VERSION:
            raise ValueError(f"{path}: not a resgen checkpoint of version {_CHECKPOINT_VERSION} "
                             f"(metadata {_VERSION_KEY} = {meta.get(_VERSION_KEY)!r})")
        fmt = meta.get(_FORMAT_KEY)
        if fmt not in formats.FORMATS:
            raise ValueError(f"{path}: metadata {_FORMAT_KEY} = {fmt!r} is not one of "
                             f"{formats.FORMATS}")
        try:
            names = json.loads(meta["resgen_layers"])
        except KeyError:
            raise ValueError(f"{path}: metadata entry 'resgen_layers' is missing") from None
        except (TypeError, ValueError, RecursionError):
            raise ValueError(f"{path}: metadata entry 'resgen_layers' is not JSON") from None
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise ValueError(f"{path}: metadata entry 'resgen_layers' is not a list of names")
        keys = set(f.keys())
        out: dict[str, QLinearWeight] = {}
        for name in names:
            try:
                out[name] = _load_layer(f, keys, name, fmt)
            except (TypeError, ValueError, RuntimeError) as e:
                raise ValueError(f"{path}: layer {name!r}: {e}") from None
        return out


def _load_layer(f, keys: set[str], name: str, fmt: str) -> QLinearWeight:
    """One layer of load_layers (errors name the field; the caller adds file and layer)."""
    def get(suffix: str, required: bool = False) -> torch.Tensor | None:
        key = f"{name}.{suffix}"
        if key not in keys:
            if required:
                raise ValueError(f"field {suffix} is missing")
            return None
        return f.get_tensor(key)

    def number(suffix: str, t: torch.Tensor) -> float:
        if t.numel() != 1 or t.dtype.is_complex or t.dtype == torch.bool:
            raise ValueError(f"{suffix} must be one number, got shape {tuple(t.shape)}")
        return float(t.reshape(()).double())

    codes, scales = get("weight", True), get("weight_scale", True)
    if codes.dtype != torch.uint8 or codes.dim() != 2:
        raise ValueError(f"weight must be packed uint8 [N, K / 2], got {codes.dtype} "
                         f"{tuple(codes.shape)}")
    want = torch.float8_e4m3fn if fmt == "nvfp4" else torch.uint8
    if scales.dtype != want or scales.dim() != 2:
        raise ValueError(f"weight_scale (block scales) must be {want} [N, K / "
                         f"{formats.block_size(fmt)}], got "
                         f"{scales.dtype} {tuple(scales.shape)}")
    if scales.shape[0] != codes.shape[0]:
        raise ValueError(f"weight has {codes.shape[0]} rows, weight_scale {scales.shape[0]}")
    if scales.shape[-1] * formats.block_size(fmt) != codes.shape[-1] * 2:
        raise ValueError("weight_scale does not match the weight's width (one scale per "
                         f"{formats.block_size(fmt)} elements)")
    gs = get("weight_scale_2")
    if (gs is None) != (fmt == "mxfp4"):
        raise ValueError(f"weight_scale_2 {'is missing' if gs is None else 'is present'}: "
                         f"{fmt} {'needs' if fmt == 'nvfp4' else 'has no'} global scale")
    if gs is not None:
        gs = formats._check_global_scale(number("weight_scale_2", gs), "cpu")
    mask = get("resgen_channel_mask")
    ratio = get("resgen_ratio")
    if (mask is None) != (ratio is None):
        raise ValueError("resgen_channel_mask and resgen_ratio come together")
    sel = None if mask is None else Selection(mask, number("resgen_ratio", ratio))
    kt = get("resgen_in_features", True)
    if kt.dtype.is_floating_point or kt.numel() != 1:
        raise ValueError("resgen_in_features must be one integer")
    k = int(kt.reshape(()))
    ext = 0 if sel is None else sel.extension_length(fmt)
    if k <= 0 or codes.shape[-1] * 2 != k + ext:
        raise ValueError(f"the weight is {codes.shape[-1] * 2} wide, resgen_in_features + "
                         f"extension = {k} + {ext}")
    if sel is not None and sel.in_features != k:
        raise ValueError(f"resgen_channel_mask covers {sel.in_features} channels, K = {k}")
    isc = get("input_scale")
    if isc is not None:
        if fmt != "nvfp4":
            raise ValueError("input_scale is an NVFP4 tensor scale; MXFP4 has none")
        isc = formats._check_global_scale(number("input_scale", isc), "cpu")
    q = QuantizedTensor(fmt, codes, scales, gs)
    return QLinearWeight(q, k, sel, isc)


def read_metadata(path: str | Path) -> dict[str, str]:
    """The safetensors header metadata of a checkpoint written by save_layers."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return dict(f.metadata() or {})
