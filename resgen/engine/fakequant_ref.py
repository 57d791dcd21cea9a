"""The CPU quality study's fake-quant model, built from an engine's own FP4 weights.

`fakequant_linears(llm)` gives, per Hugging Face module (model.layers.<i>.self_attn.q_proj,
...), an nn.Module running resgen.quality.fakequant.FakeQuantLinear on the rows of the
engine's fused weight that belong to that module (q/k/v and gate/up split back by rows: the
same codes, block scales and tensor scale the engine's kernels read), plus the module's bias.
Swapped into the FP32 transformers model (`swap_linears`), that is the reference the engine is
compared with: same weights, same static input scales and K-Ext selections, the quality
study's numerics.

io "fp32" is the quality study exactly; io "bf16" rounds each linear's input and output to
BF16, the kernels' interface. `perturb` (relative, e.g. 1e-7) multiplies every linear input
and every FP32 product by (1 + perturb * N(0, 1)) from a seeded generator, before the BF16
roundings (that is where FP32 summation order, in the kernels and in the glue, acts): the
noise band of section 3. `set_perturbation(mods, eps, seed)` sets it on all modules.
"""

from __future__ import annotations

from typing import Any

import torch

from ..calibrate import QLinearWeight
from ..formats import QuantizedTensor
from .build import HF_PARTS

__all__ = ["FakeQuantProj", "fakequant_linears", "module_weights", "swap_linears",
           "slice_rows", "set_perturbation"]


def fakequant_args(qweight: QLinearWeight, compensation: str | float
                   ) -> tuple[QLinearWeight, str | float]:
    """(qweight, compensation) as FakeQuantLinear takes them: "none" / "full" / "w4a16" stay
    strings, a K-Ext ratio becomes a float; the modes without K-Ext read no selection, so a
    weight prepared with one (the engine's calibration) is passed without it."""
    modes = ("none", "full", "w4a16")
    comp = compensation if compensation in modes else float(compensation)
    if comp in modes and qweight.selection is not None:
        qweight = QLinearWeight(qweight.base(), qweight.in_features, None,
                                qweight.input_scale, qweight.meta)
    return qweight, comp


def slice_rows(qw: QLinearWeight, start: int, stop: int) -> QLinearWeight:
    """Rows [start, stop) of a prepared weight (same tensor scale, selection, input scale)."""
    q = qw.q
    return QLinearWeight(QuantizedTensor(q.fmt, q.codes[start:stop], q.scales[start:stop],
                                         q.global_scale), qw.in_features, qw.selection,
                         qw.input_scale, qw.meta)


class FakeQuantProj(torch.nn.Module):
    """nn.Linear stand-in: FakeQuantLinear (+ bias), io / perturb as in the module docstring.

    With `rows` (start, stop) it is one part of a fused projection: the first part called
    with an input computes the whole fused product and its siblings (called with the same
    input tensor, as transformers' attention and MLP call q/k/v and gate/up) read their rows
    from it, so the reference forms each product in the engine's summation order (a split
    F.linear rounds differently in FP32, and over 30 layers of FP4 codes on rounding
    midpoints that alone moves W4A4 logits by several percent)."""

    def __init__(self, qweight: QLinearWeight, compensation: str | float,
                 bias: torch.Tensor | None, io: str = "fp32",
                 rows: tuple[int, int] | None = None, shared: dict | None = None) -> None:
        from ..quality.fakequant import FakeQuantLinear

        super().__init__()
        qweight, comp = fakequant_args(qweight, compensation)
        if io not in ("fp32", "bf16"):
            raise ValueError(f"io must be 'fp32' or 'bf16', got {io!r}")
        self.rows = rows
        self.shared = shared if shared is not None else {}
        if "fq" not in self.shared:
            self.shared["fq"] = FakeQuantLinear(qweight, comp)
            self.shared["bias"] = None if bias is None else bias.detach().float().cpu()
        self.fq = self.shared["fq"]
        self.io = io
        self.perturb = 0.0
        self.generator: torch.Generator | None = None
        self.in_features = self.fq.in_features
        self.out_features = self.fq.out_features if rows is None else rows[1] - rows[0]

    def _full(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        if self.perturb:
            xf = xf * (1 + self.perturb * torch.randn(xf.shape, generator=self.generator))
        if self.io == "bf16":
            xf = xf.to(torch.bfloat16).float()
        y = self.fq(xf)
        if self.perturb:                # where a kernel's summation order acts
            y = y * (1 + self.perturb * torch.randn(y.shape, generator=self.generator))
        if self.io == "bf16":
            y = y.to(torch.bfloat16).float()
        if self.shared["bias"] is not None:
            y = y + self.shared["bias"]
        return y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sh = self.shared
        if self.rows is None:
            return self._full(x).to(x.dtype)
        if sh.get("x") is not x or sh.get("version") != x._version:
            sh["x"], sh["version"], sh["y"] = x, x._version, self._full(x)
        return sh["y"][..., self.rows[0]:self.rows[1]].to(x.dtype)


def _splits(cfg: Any) -> dict[str, tuple[int, ...]]:
    return {"qkv": (cfg.q_size, cfg.kv_size, cfg.kv_size), "o": (cfg.hidden,),
            "gate_up": (cfg.intermediate, cfg.intermediate), "down": (cfg.hidden,)}


def module_weights(llm: Any) -> dict[str, QLinearWeight]:
    """{HF module name ("model.layers.3.self_attn.q_proj"): its rows of the engine's fused FP4
    weight (CPU)}: what a checkpoint of this engine's quantization holds."""
    out: dict[str, QLinearWeight] = {}
    for i, L in enumerate(llm.model.layers):
        for proj, p in L.projections().items():
            if p.qweight is None:
                raise ValueError("the engine's projections are not FP4 (fmt='bf16')")
            qw = p.qweight
            qw = QLinearWeight(qw.q.to("cpu"), qw.in_features, qw.selection,
                               None if qw.input_scale is None else qw.input_scale.cpu(),
                               qw.meta)
            start = 0
            for part, n in zip(HF_PARTS[proj], _splits(llm.cfg)[proj]):
                out[f"model.layers.{i}.{part}"] = slice_rows(qw, start, start + n)
                start += n
    return out


def fakequant_linears(llm: Any, io: str = "fp32", fused: bool = True
                      ) -> dict[str, FakeQuantProj]:
    """{HF module name (without the "model." prefix, as resgen.quality names them): module}
    from an engine's FP4 projections (see the module docstring). fused=False: every HF module
    multiplies its own rows (the quality study's per-module products)."""
    splits = _splits(llm.cfg)
    out: dict[str, FakeQuantProj] = {}
    for i, L in enumerate(llm.model.layers):
        for proj, p in L.projections().items():
            if p.qweight is None:
                raise ValueError("the engine's projections are not FP4 (fmt='bf16')")
            qw = QLinearWeight(p.qweight.q.to("cpu"), p.qweight.in_features,
                               p.qweight.selection,
                               None if p.qweight.input_scale is None
                               else p.qweight.input_scale.cpu(), p.qweight.meta)
            bias = None if p.bias is None else p.bias.cpu()
            shared: dict = {}
            start = 0
            for part, n in zip(HF_PARTS[proj], splits[proj]):
                name = f"layers.{i}.{part}"
                if len(splits[proj]) == 1:
                    out[name] = FakeQuantProj(qw, p.compensation, bias, io)
                elif fused:
                    out[name] = FakeQuantProj(qw, p.compensation, bias, io, (start, start + n),
                                              shared)
                else:
                    b = None if bias is None else bias[start:start + n]
                    out[name] = FakeQuantProj(slice_rows(qw, start, start + n),
                                              p.compensation, b, io)
                start += n
    return out


def set_perturbation(mods: dict[str, FakeQuantProj], eps: float, seed: int | None) -> None:
    """Every module perturbs by `eps` from one generator seeded with `seed` (eps 0: off)."""
    gen = None if seed is None else torch.Generator().manual_seed(seed)
    for m in mods.values():
        m.perturb, m.generator = eps, gen


def swap_linears(model: Any, new: dict[str, torch.nn.Module]) -> dict[str, torch.nn.Module]:
    """Swap a transformers model's modules named as fakequant_linears names them; returns the
    previous ones (swap them back to restore)."""
    old = {}
    for name, mod in new.items():
        parent_name, _, attr = f"model.{name}".rpartition(".")
        parent = model.get_submodule(parent_name)
        old[name] = getattr(parent, attr)
        setattr(parent, attr, mod)
    return old
