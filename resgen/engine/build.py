"""Building a DecoderModel from a ModelSource: the dense form (BF16 / FP32 linears), its
calibration, and the FP4 form on a backend's kernels.

Fusion: q/k/v and gate/up are concatenated along N before quantizing, so they hit the tuned
fused shapes (qkv, gate_up) with ONE NVFP4 weight tensor scale computed from the fused
weight's amax. That quantizes exactly the fused weight (no requantization, nothing lost: the
per-16 block scales never straddle rows); it differs from quantizing q, k, v separately only
in the tensor scale each row's block scales are relative to. FP4 checkpoints are fused by
resgen.checkpoint.fuse_linears (requantizing exactly when the parts' global scales differ).

Compensation: "none" (plain W4A4), "full" (M-Ext), a K-Ext ratio (0.125 / 0.25 / 0.5 / 1.0:
needs calibration for the channel selection), or a per-layer plan (a resgen.plan.Plan or a
mapping {layer name: ratio}; names as the quality study and the planner write them,
"layers.3.self_attn.q_proj", or the engine's "layers.3.qkv"; ratio 0 = none, 1 = full). A
fused projection runs one compensation: where a plan gives q/k/v (or gate/up) different
ratios, the largest is used (logged).
"""

from __future__ import annotations

import logging
from typing import Any, Mapping

import torch

from ..calibrate import QLinearWeight, prepare_weight
from ..models import KEXT_FOLDS
from .backend import Backend
from .calib import LINEAR_SITE, Calibration, site_name
from .config import DecoderConfig
from .model import DecoderModel, DenseLinear, LayerOps, Proj
from .source import ModelSource

__all__ = ["HF_PARTS", "dense_model", "quantized_model", "compensation_of", "calibrate",
           "FORMATS"]

log = logging.getLogger("resgen.engine")

FORMATS = ("nvfp4", "mxfp4", "bf16")
# engine projection -> its Hugging Face modules, in fused (N) order
HF_PARTS = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
            "o": ("self_attn.o_proj",), "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
            "down": ("mlp.down_proj",)}
_RATIO_NAMES = {0.0: "none", 1.0: "full"}


def _prefix(i: int) -> str:
    return f"model.layers.{i}."


def _norms(src: ModelSource, cfg: DecoderConfig, i: int, device: torch.device,
           dtype: torch.dtype) -> dict[str, torch.Tensor | None]:
    p = _prefix(i)

    def get(name: str) -> torch.Tensor:
        return src.tensor(p + name).to(device, dtype)
    out: dict[str, torch.Tensor | None] = {"in_norm": get("input_layernorm.weight"),
                                           "post_norm": get("post_attention_layernorm.weight"),
                                           "q_norm": None, "k_norm": None}
    if cfg.qk_norm:
        out["q_norm"], out["k_norm"] = get("self_attn.q_norm.weight"), \
            get("self_attn.k_norm.weight")
    return out


def _bias(src: ModelSource, cfg: DecoderConfig, i: int, proj: str, device: torch.device
          ) -> torch.Tensor | None:
    """float32 [N] on `device`: the fused projection's bias, or None."""
    want = cfg.qkv_bias if proj == "qkv" else (cfg.o_bias if proj == "o" else False)
    if not want:
        return None
    b = torch.cat([src.tensor(_prefix(i) + part + ".bias").float() for part in HF_PARTS[proj]])
    if b.shape != (cfg.linear_shapes()[proj][0],):
        raise ValueError(f"layer {i} {proj} bias has shape {tuple(b.shape)}")
    return b.to(device)


def _check_shape(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} has shape {tuple(t.shape)}, the config needs {shape}")


def _head_weights(src: ModelSource, cfg: DecoderConfig) -> tuple[torch.Tensor, torch.Tensor,
                                                                 torch.Tensor]:
    embed = src.tensor("model.embed_tokens.weight")
    _check_shape("model.embed_tokens.weight", embed, (cfg.vocab_size, cfg.hidden))
    if cfg.tie_embeddings or not src.has("lm_head.weight"):
        if not cfg.tie_embeddings:
            raise KeyError(f"{src.name}: tensor 'lm_head.weight' is missing and the config "
                           "does not tie the embeddings")
        head = embed
    else:
        head = src.tensor("lm_head.weight")
        _check_shape("lm_head.weight", head, (cfg.vocab_size, cfg.hidden))
    return embed, src.tensor("model.norm.weight"), head


def dense_model(src: ModelSource, cfg: DecoderConfig, device: torch.device, glue: str,
                weight_dtype: torch.dtype) -> DecoderModel:
    """The unquantized model: fused BF16 / FP32 linears (DenseLinear), keeping the source
    values for quantization."""
    from .model import GLUE

    g = GLUE[glue]
    shapes = cfg.linear_shapes()
    layers = []
    for i in range(cfg.layers):
        projs = {}
        for proj, parts in HF_PARTS.items():
            ws = []
            for part in parts:
                name = _prefix(i) + part + ".weight"
                ws.append(src.tensor(name))
            w = torch.cat(ws).to(device) if len(ws) > 1 else ws[0].to(device)
            _check_shape(f"layer {i} {proj} ({' + '.join(parts)})", w, shapes[proj])
            projs[proj] = Proj(DenseLinear(w, weight_dtype), weight_dtype, g,
                               _bias(src, cfg, i, proj, device))
        layers.append(LayerOps(**projs, **_norms(src, cfg, i, device, g)))
    embed, norm, head = _head_weights(src, cfg)
    head_dtype = torch.bfloat16 if glue == "bf16" else torch.float32
    m = DecoderModel(cfg, layers, embed, norm, head.to(head_dtype), glue, device,
                     weight_dtype)
    return m


def compensation_of(spec: Any, cfg: DecoderConfig) -> dict[tuple[int, str], str]:
    """{(layer, projection): "none" | "full" | "w4a16" | K-Ext ratio string} for every fused
    projection (see the module docstring). In a per-layer plan, "w4a16" (no activation
    quantization) must name every part of a fused projection or none of them."""
    from ..ops.linear import _compensation_string

    ratios = getattr(spec, "ratios", spec)
    if not isinstance(ratios, Mapping):
        c = _compensation_string(spec)
        return {(i, p): c for i in range(cfg.layers) for p in HF_PARTS}
    out: dict[tuple[int, str], str] = {}
    for i in range(cfg.layers):
        for proj, parts in HF_PARTS.items():
            names = [f"layers.{i}.{part}" for part in parts]
            got = [ratios.get(n, ratios.get("model." + n)) for n in names]
            if all(r is None for r in got):
                r = ratios.get(f"layers.{i}.{proj}")
                if r is None:
                    raise ValueError(f"the compensation plan has no entry for layer {i} "
                                     f"{proj} ({', '.join(names)})")
                got = [r]
            if "w4a16" in got:
                if any(r != "w4a16" for r in got):
                    raise ValueError(f"the compensation plan gives layer {i} {proj} "
                                     f"({', '.join(names)}) W4A16 for some parts only: a "
                                     "fused projection quantizes its activations for all or "
                                     "none")
                out[(i, proj)] = "w4a16"
                continue
            vals = [_plan_value(r, names) for r in got if r is not None]
            if len(set(vals)) > 1:
                log.warning("plan gives layer %d %s different ratios %s: the fused projection "
                            "runs the largest", i, proj, vals)
            out[(i, proj)] = _compensation_string(_RATIO_NAMES.get(max(vals), max(vals)))
    return out


def _plan_value(r: Any, names: list[str]) -> float:
    if r in ("none", "full"):
        return 0.0 if r == "none" else 1.0
    try:
        return float(r)
    except (TypeError, ValueError):
        raise ValueError(f"plan ratio {r!r} for {names[0]} is not a number") from None


def linear_fold(compensation: Any, kext_fold: str) -> str:
    """The fold a projection's op runs: kext_fold ("exact" | "presum") for a K-Ext ratio,
    "exact" for every other mode (M-Ext's presum is the tuner's choice inside the op)."""
    check_kext_fold(kext_fold)
    return "exact" if compensation in ("none", "full", "w4a16") else kext_fold


def check_kext_fold(kext_fold: str) -> None:
    """ValueError naming the value unless it is one of resgen.models.KEXT_FOLDS."""
    if kext_fold not in KEXT_FOLDS:
        raise ValueError(f"kext_fold must be one of {KEXT_FOLDS}, got {kext_fold!r}")


def quantized_model(dense: DecoderModel, backend: Backend, fmt: str, compensation: Any,
                    calib: Calibration | None, quant_device: torch.device | None = None,
                    kext_fold: str = "exact") -> DecoderModel:
    """The FP4 model on `backend` from a dense model's source weights: per fused projection,
    resgen.calibrate.prepare_weight (fmt; the K-Ext selection and the static NVFP4 input scale
    from `calib` where given, else dynamic scales) and backend.linear (K-Ext layers with
    `kext_fold`: linear_fold). The dense weights are dropped from the result (norms,
    embeddings and the LM head are shared)."""
    check_kext_fold(kext_fold)                       # before any work
    if fmt not in ("nvfp4", "mxfp4"):
        raise ValueError(f"fmt must be 'nvfp4' or 'mxfp4' to quantize, got {fmt!r}")
    cfg = dense.cfg
    comps = compensation_of(compensation, cfg)
    qdev = quant_device or dense.device
    layers = []
    for i, L in enumerate(dense.layers):
        projs = {}
        for proj, p in L.projections().items():
            comp = comps[(i, proj)]
            ratio = None if comp in ("none", "full", "w4a16") else float(comp)
            site = calib.site(site_name(i, proj)) if calib is not None else None
            if ratio is not None and site is None:
                raise ValueError(f"compensation ratio {comp} (K-Ext) needs a channel "
                                 "selection: pass calib= (token ids, text or a calibration "
                                 "file)")
            sel = site.selection(ratio) if ratio is not None else None
            isc = site.input_scale() if (site is not None and fmt == "nvfp4") else None
            w = p.op.source.to(qdev).float()
            qw = prepare_weight(w, fmt, sel, input_scale=isc)
            del w
            projs[proj] = Proj(backend.linear(qw, comp, linear_fold(comp, kext_fold)),
                               backend.io_dtype, dense.glue, p.bias, qw, comp)
        layers.append(LayerOps(**projs, in_norm=L.in_norm, post_norm=L.post_norm,
                               q_norm=L.q_norm, k_norm=L.k_norm))
    m = DecoderModel.__new__(DecoderModel)
    m.__dict__.update(dense.__dict__)
    m.layers = layers
    m.io_dtype = backend.io_dtype
    m.pad_rows = backend.name != "reference"
    return m


def checkpoint_model(src: ModelSource, cfg: DecoderConfig, backend: Backend, compensation: Any,
                     device: torch.device, glue: str, kext_fold: str = "exact"
                     ) -> DecoderModel:
    """The FP4 model of an FP4 checkpoint (src.qlinears, resgen.checkpoint): q/k/v and
    gate/up fused with resgen.checkpoint.fuse_linears. A projection with a part the checkpoint
    left unquantized (its exclude_modules, or a BF16 fallback) runs dense in BF16, its
    quantized parts dequantized (exact FP4 values, rounded once to BF16); logged.
    compensation "checkpoint": each projection as resgen recorded it (resgen/resgen.json;
    "full" where it says nothing)."""
    from ..checkpoint import fuse_linears
    from .model import GLUE

    if compensation == "checkpoint":
        ck = src.checkpoint
        compensation = {}
        for i in range(cfg.layers):
            for proj, parts in HF_PARTS.items():
                for part in parts:
                    c = ck.compensation(_prefix(i) + part) if ck is not None else None
                    compensation[f"layers.{i}.{part}"] = c or "full"
    comps = compensation_of(compensation, cfg)
    shapes = cfg.linear_shapes()
    g = GLUE[glue]
    layers = []
    for i in range(cfg.layers):
        projs = {}
        for proj, parts in HF_PARTS.items():
            names = [_prefix(i) + part for part in parts]
            bias = _bias(src, cfg, i, proj, device)
            if all(n in src.qlinears for n in names):
                qws = [src.qlinears[n] for n in names]
                qw: QLinearWeight = fuse_linears(qws) if len(qws) > 1 else qws[0]
                if (qw.out_features, qw.in_features) != shapes[proj]:
                    raise ValueError(f"{src.name}: layer {i} {proj} is {qw.out_features} x "
                                     f"{qw.in_features}, the config needs {shapes[proj]}")
                comp = comps[(i, proj)]
                projs[proj] = Proj(backend.linear(qw, comp, linear_fold(comp, kext_fold)),
                                   backend.io_dtype, g, bias, qw, comp)
                continue
            ws = []
            for n in names:
                if n in src.qlinears:
                    from .. import formats

                    ws.append(formats.dequantize(src.qlinears[n].q)[:, : shapes[proj][1]])
                else:
                    ws.append(src.tensor(n + ".weight"))
            log.warning("%s: layer %d %s is not quantized in the checkpoint: served in BF16",
                        src.name, i, proj)
            w = torch.cat([x.to(torch.bfloat16) for x in ws]).to(device)
            _check_shape(f"layer {i} {proj}", w, shapes[proj])
            projs[proj] = Proj(DenseLinear(w, torch.bfloat16), torch.bfloat16, g, bias)
        layers.append(LayerOps(**projs, **_norms(src, cfg, i, device, g)))
    embed, norm, head = _head_weights(src, cfg)
    head_dtype = torch.bfloat16 if glue == "bf16" else torch.float32
    m = DecoderModel(cfg, layers, embed, norm, head.to(head_dtype), glue, device,
                     backend.io_dtype)
    m.pad_rows = backend.name != "reference"
    return m


@torch.no_grad()
def calibrate(dense: DecoderModel, seqs: list[torch.Tensor], batch_tokens: int = 4096
              ) -> Calibration:
    """Site statistics (resgen.engine.calib) of the dense model over token sequences."""
    cal = Calibration()
    group: list[torch.Tensor] = []
    n = 0

    def flush() -> None:
        if group:
            dense.prefill(group, store=False, want="none", record=cal.recorder)
            group.clear()
    for s in seqs:
        if n + s.numel() > batch_tokens:
            flush()
            n = 0
        group.append(s)
        n += s.numel()
    flush()
    cal.tokens = sum(int(s.numel()) for s in seqs)
    if not cal.sites:
        raise ValueError("no calibration tokens")
    return cal


__all__ += ["checkpoint_model", "LINEAR_SITE"]
