"""Calibration for the engine: per input site, the largest |x| (a static NVFP4 input scale is
amax / 2688, resgen.formats.nvfp4_global_scale) and the mean |x| per channel (the paper's K-Ext
selection score, resgen.calibrate.select_channels).

Sites are named as resgen.quality.capture names them: layers.<i>.attn_in (the q/k/v input,
read by the fused qkv), o_in, mlp_in (gate/up) and down_in. The statistics come from the
unquantized model (the engine's dense form) over the calibration tokens, as the quality study
calibrates its FP32 model.

A Calibration saves to a small safetensors file: amax per site, and either the scores or only
the channel masks of given ratios (`save(path, ratios=(0.125,))`: 1 byte per 8 channels, stored as <site>.mask125), so
a GPU run can quantize the same weights as a CPU run did.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from .. import formats
from ..calibrate import RATIOS, Selection, select_channels

__all__ = ["SITES", "LINEAR_SITE", "site_name", "SiteCalibration", "Calibration"]

SITES = ("attn_in", "o_in", "mlp_in", "down_in")
LINEAR_SITE = {"qkv": "attn_in", "o": "o_in", "gate_up": "mlp_in", "down": "down_in"}


def site_name(layer: int, linear: str) -> str:
    """layers.<i>.<site> of the engine's fused linear `linear` (qkv, o, gate_up, down)."""
    return f"layers.{layer}.{LINEAR_SITE[linear]}"


@dataclass
class SiteCalibration:
    """One input site: amax, and sum |x| per channel over `count` tokens (float64 [K]) or the
    channel masks per ratio when loaded from a masks-only file."""

    amax: float = 0.0
    sum_abs: torch.Tensor | None = None
    count: int = 0
    masks: dict[float, torch.Tensor] = field(default_factory=dict)

    def update(self, x: torch.Tensor) -> None:
        x2 = x.detach().reshape(-1, x.shape[-1]).to(torch.float64)
        if not bool(torch.isfinite(x2).all()):
            raise ValueError("calibration activations contain NaN or Inf")
        self.amax = max(self.amax, float(x2.abs().max()))
        s = x2.abs().sum(0).cpu()
        self.sum_abs = s if self.sum_abs is None else self.sum_abs + s
        self.count += x2.shape[0]

    def input_scale(self) -> torch.Tensor:
        """The static NVFP4 activation tensor scale (float32 0-dim)."""
        if self.amax <= 0:
            raise ValueError("calibration saw only zeros at this site")
        return formats.nvfp4_global_scale(torch.tensor(self.amax, dtype=torch.float32))

    def selection(self, ratio: float) -> Selection:
        ratio = float(ratio)
        if ratio in self.masks:
            return Selection(self.masks[ratio], ratio)
        if self.sum_abs is None or self.count == 0:
            raise ValueError(f"this calibration holds no channel scores and no masks for "
                             f"ratio {ratio}")
        return select_channels(self.sum_abs / self.count, ratio)


@dataclass
class Calibration:
    """Sites by name (see the module docstring); `tokens` counts the calibration tokens."""

    sites: dict[str, SiteCalibration] = field(default_factory=dict)
    tokens: int = 0

    def site(self, name: str) -> SiteCalibration:
        try:
            return self.sites[name]
        except KeyError:
            raise KeyError(f"the calibration has no site {name!r}") from None

    def recorder(self, layer: int):
        """A callback (site, x) -> None that records layer `layer`'s sites."""
        def record(site: str, x: torch.Tensor) -> None:
            self.sites.setdefault(f"layers.{layer}.{site}", SiteCalibration()).update(x)
        return record

    def save(self, path: str | Path, ratios: tuple[float, ...] | None = None) -> None:
        """Write amax per site and, with `ratios`, only those channel masks (else the mean
        |x| scores, float32)."""
        from safetensors.torch import save_file

        t: dict[str, torch.Tensor] = {}
        for name, s in sorted(self.sites.items()):
            t[f"{name}.amax"] = torch.tensor(s.amax, dtype=torch.float32)
            if ratios is None:
                if s.sum_abs is None:
                    raise ValueError(f"site {name} has no scores to save")
                t[f"{name}.mean_abs"] = (s.sum_abs / s.count).float()
            else:
                for r in ratios:
                    t[f"{name}.mask{round(float(r) * 1000)}"] = s.selection(r).masks.contiguous()
        save_file(t, str(path), metadata={"resgen_engine_calibration": "1",
                                          "tokens": str(self.tokens)})

    @classmethod
    def load(cls, path: str | Path) -> "Calibration":
        from safetensors import safe_open

        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"{p}: no such calibration file")
        try:
            f = safe_open(str(p), framework="pt")
        except Exception as e:
            raise ValueError(f"{p}: not a safetensors file: {e}") from None
        with f:
            meta = f.metadata() or {}
            if meta.get("resgen_engine_calibration") != "1":
                raise ValueError(f"{p}: not a resgen engine calibration file")
            cal = cls(tokens=int(meta.get("tokens", "0")))
            for key in f.keys():
                name, _, what = key.rpartition(".")
                site = cal.sites.setdefault(name, SiteCalibration())
                t = f.get_tensor(key)
                if what == "amax":
                    site.amax = float(t)
                    if not site.amax > 0 or site.amax == float("inf"):
                        raise ValueError(f"{p}: {key} = {site.amax} is not a positive finite "
                                         "amax")
                elif what == "mean_abs":
                    site.sum_abs, site.count = t.double(), 1
                elif what.startswith("mask") and what[4:].isdigit():
                    r = int(what[4:]) / 1000
                    if r not in RATIOS:
                        raise ValueError(f"{p}: {key}: ratio {r} is not one of {RATIOS}")
                    site.masks[r] = Selection(t, r).masks
                else:
                    raise ValueError(f"{p}: unexpected tensor {key!r}")
        return cal
