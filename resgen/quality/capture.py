"""Forward/backward hooks that record what the quantizers need from real model runs.

Linear layers that read the same tensor (q/k/v read the attention input, gate/up the MLP input)
share one "input site", so their statistics are recorded once:
    site_of("layers.3.self_attn.k_proj") == "layers.3.attn_in".
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .. import formats
from ..calibrate import ChannelStats
from .fakequant import qdq
from .model import quantizable_linears

__all__ = ["site_of", "SiteStats", "calibrate_sites", "capture_inputs", "capture_grads"]

_SITES = {"self_attn.q_proj": "attn_in", "self_attn.k_proj": "attn_in",
          "self_attn.v_proj": "attn_in", "self_attn.o_proj": "o_in", "mlp.gate_proj": "mlp_in",
          "mlp.up_proj": "mlp_in", "mlp.down_proj": "down_in"}


def site_of(name: str) -> str:
    """Input site of a quantizable linear named 'layers.<i>.<proj>'."""
    prefix, _, rest = name.partition(".")
    idx, _, proj = rest.partition(".")
    if prefix != "layers" or proj not in _SITES:
        raise ValueError(f"not a quantizable linear name: {name!r}")
    return f"layers.{idx}.{_SITES[proj]}"


@dataclass
class SiteStats:
    """Calibration statistics of one input site (K input channels), float64 sums.

    channel:  ChannelStats (mean |x|, mean x^2) -- the paper's selection score.
    res_sq:   fmt -> [K] sum of squared activation residues r = x - qdq(x) (dynamic scale per
              forward call, as at run time) -- the error-aware selection score.
    amax:     largest |x| seen (a static NVFP4 input_scale is amax / 2688).
    hessian:  [K, K] sum of x x^T (GPTQ), or None when not requested.
    """

    channel: ChannelStats
    res_sq: dict[str, torch.Tensor] = field(default_factory=dict)
    amax: float = 0.0
    hessian: torch.Tensor | None = None

    @property
    def count(self) -> int:
        return self.channel.count

    def mean_res_sq(self, fmt: str) -> torch.Tensor:
        """float64 [K]: E[r_i^2] for the format."""
        return self.res_sq[fmt] / max(self.count, 1)

    def input_scale(self) -> torch.Tensor:
        """Static NVFP4 activation tensor scale from the calibration amax (float32 0-dim)."""
        return formats.nvfp4_global_scale(torch.tensor(self.amax))

    def update(self, x: torch.Tensor, fmts: tuple[str, ...], hessian: bool) -> None:
        x2 = x.detach().reshape(-1, x.shape[-1]).to(torch.float32)
        self.channel.update(x2)
        self.amax = max(self.amax, float(x2.abs().max()))
        for fmt in fmts:
            r = x2 - qdq(x2, fmt)
            acc = self.res_sq.setdefault(fmt, torch.zeros(x2.shape[-1], dtype=torch.float64))
            acc += (r.double() ** 2).sum(0)
        if hessian:
            # FP32 product per call (fast), accumulated across calls in float64.
            h = (x2.T @ x2).double()
            self.hessian = h if self.hessian is None else self.hessian + h


def _batches(seqs: torch.Tensor, batch: int):
    for i in range(0, seqs.shape[0], batch):
        yield seqs[i: i + batch]


def _site_modules(model) -> dict[str, torch.nn.Module]:
    """One linear per input site (the first that reads it)."""
    out: dict[str, torch.nn.Module] = {}
    for name, mod in quantizable_linears(model).items():
        out.setdefault(site_of(name), mod)
    return out


@torch.no_grad()
def calibrate_sites(model, seqs: torch.Tensor, *, batch: int = 4,
                    fmts: tuple[str, ...] = formats.FORMATS,
                    hessian: bool = False) -> dict[str, SiteStats]:
    """Run the FP32 model over seqs: int64 [S, T] and record SiteStats for every input site."""
    stats: dict[str, SiteStats] = {}
    handles = []
    for site, mod in _site_modules(model).items():
        stats[site] = SiteStats(ChannelStats(mod.in_features))

        def hook(_m, args, _site=site):
            stats[_site].update(args[0], fmts, hessian)

        handles.append(mod.register_forward_pre_hook(hook))
    try:
        for ids in _batches(seqs, batch):
            model(input_ids=ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return stats


@torch.no_grad()
def capture_inputs(model, seqs: torch.Tensor, *, batch: int = 4) -> dict[str, torch.Tensor]:
    """Site -> float32 [S * T, K]: every input row the FP32 model feeds each site on seqs."""
    rows: dict[str, list[torch.Tensor]] = {}
    handles = []
    for site, mod in _site_modules(model).items():
        def hook(_m, args, _site=site):
            x = args[0].detach()
            rows.setdefault(_site, []).append(x.reshape(-1, x.shape[-1]).float().clone())

        handles.append(mod.register_forward_pre_hook(hook))
    try:
        for ids in _batches(seqs, batch):
            model(input_ids=ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return {site: torch.cat(parts) for site, parts in rows.items()}


@torch.enable_grad()
def capture_grads(model, seqs: torch.Tensor, *, batch: int = 2) -> dict[str, torch.Tensor]:
    """Linear name -> float32 [S * T, N]: dLoss/dy of every quantizable linear's output.

    The loss is the FP32 model's mean next-token cross-entropy over seqs: int64 [S, T]; the
    weights stay frozen, gradients flow from the input embeddings only.
    """
    grads: dict[str, list[torch.Tensor]] = {}
    handles = []
    for name, mod in quantizable_linears(model).items():
        def hook(_m, _args, out, _name=name):
            def store(g, _n=_name):
                grads.setdefault(_n, []).append(g.detach().reshape(-1, g.shape[-1]).float())
            out.register_hook(store)

        handles.append(mod.register_forward_hook(hook))
    try:
        for ids in _batches(seqs, batch):
            emb = model.get_input_embeddings()(ids).detach().requires_grad_(True)
            out = model(inputs_embeds=emb, labels=ids, use_cache=False)
            # Scale so the per-token gradients do not depend on how seqs were batched.
            (out.loss * ids.shape[0] / seqs.shape[0]).backward()
    finally:
        for h in handles:
            h.remove()
    # Backward visits layers last to first within a batch; the batches arrive in order.
    return {name: torch.cat(parts) for name, parts in grads.items()}
