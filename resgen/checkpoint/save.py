"""save_checkpoint: write a Hugging Face folder in ModelOpt's NVFP4 / MXFP4 layout.

What is written (the layout resgen.checkpoint.layouts documents, as nvidia-modelopt 0.47's
export_hf_checkpoint writes it, so vLLM's modelopt loaders and resgen read it):
  model.safetensors, or model-0000i-of-0000n.safetensors + model.safetensors.index.json
      per quantized linear m: m.weight (uint8 [N, K/2]), m.weight_scale (E4M3 [N, K/16] or
      E8M0 uint8 [N, K/32]), NVFP4: m.weight_scale_2 and m.input_scale (float32, 0-dim as
      ModelOpt writes them, or the shape the imported checkpoint had), then every other tensor
      unchanged (embeddings, norms, biases, lm_head, excluded linears, KV scales)
  hf_quant_config.json  {"producer", "quantization": {"quant_algo", "kv_cache_quant_algo",
                         "group_size" (NVFP4), "exclude_modules"}}
  config.json           the model config with ModelOpt's "quantization_config" block
  resgen/resgen.json, resgen/fields.safetensors   resgen's own fields, only when there is
      something to say (K-Ext extensions and channel masks, full-residue layers, a plan,
      calibration facts); other readers never open the resgen/ folder (vLLM and transformers
      read the files the index names, or model.safetensors).
A K-Ext layer's m.weight is its base part [N, K/2] (what any NVFP4 reader expects); the
extension lives in resgen/fields.safetensors.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import torch

from ..calibrate import QLinearWeight
from .errors import CheckpointError
from .files import INDEX_FILE, SINGLE_FILE
from .layouts import EXT_SUFFIXES
from .load import RESGEN_FIELDS, RESGEN_JSON
from .spec import GROUP_SIZE, HF_QUANT_CONFIG

__all__ = ["save_checkpoint", "modelopt_tensors", "quant_configs", "RESGEN_FORMAT_VERSION"]

RESGEN_FORMAT_VERSION = 1
_DEFAULT_SHARD = 5 * (1 << 30)


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("resgen")
    except Exception:
        return "0"


def _scalar(t: torch.Tensor, meta: Mapping[str, str], role: str) -> torch.Tensor:
    shape = json.loads(meta.get(f"shape.{role}", "[]"))
    return t.detach().to(torch.float32).reshape(shape).clone()


def modelopt_tensors(name: str, w: QLinearWeight) -> tuple[dict[str, torch.Tensor],
                                                           dict[str, torch.Tensor]]:
    """One linear -> (ModelOpt tensors of the model files, resgen K-Ext fields)."""
    base = w.base() if w.selection is not None else w.q
    out = {f"{name}.weight": base.codes.contiguous(),
           f"{name}.weight_scale": base.scales.contiguous()}
    if w.fmt == "nvfp4":
        if w.q.global_scale is None:
            raise CheckpointError("an NVFP4 weight without its tensor scale", tensor=name)
        out[f"{name}.weight_scale_2"] = _scalar(w.q.global_scale, w.meta, "global")
        if w.input_scale is not None:
            out[f"{name}.input_scale"] = _scalar(w.input_scale, w.meta, "input")
    elif w.input_scale is not None:
        raise CheckpointError("an MXFP4 weight with a static input scale (MXFP4 has none)",
                              tensor=name)
    ext: dict[str, torch.Tensor] = {}
    if w.selection is not None:
        x = w.extension()
        ext = {f"{name}.{EXT_SUFFIXES['codes']}": x.codes.contiguous(),
               f"{name}.{EXT_SUFFIXES['scales']}": x.scales.contiguous(),
               f"{name}.{EXT_SUFFIXES['mask']}": w.selection.masks.contiguous()}
    return out, ext


def quant_configs(fmt: str, exclude_modules: Sequence[str], kv_cache_quant_algo: str | None,
                  producer: Mapping[str, str]) -> tuple[dict, dict]:
    """(hf_quant_config.json, config.json's quantization_config) as ModelOpt 0.47 writes them."""
    algo = {"nvfp4": "NVFP4", "mxfp4": "mxfp4"}[fmt]
    q: dict[str, Any] = {"quant_algo": algo, "kv_cache_quant_algo": kv_cache_quant_algo}
    if fmt == "nvfp4":
        q["group_size"] = GROUP_SIZE[fmt]
    q["exclude_modules"] = list(exclude_modules)
    hf = {"producer": dict(producer), "quantization": q}
    qc: dict[str, Any] = {}
    if fmt == "nvfp4":
        args = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16}
        qc["config_groups"] = {"group_0": {"input_activations": dict(args),
                                           "weights": dict(args), "targets": ["Linear"]}}
    qc.update({"ignore": list(exclude_modules), "quant_algo": algo})
    # as ModelOpt 0.47 writes it: an FP8 KV cache as arguments, an NVFP4 one by name
    if kv_cache_quant_algo == "FP8":
        qc["kv_cache_scheme"] = {"dynamic": False, "num_bits": 8, "type": "float"}
    elif kv_cache_quant_algo is not None:
        qc["kv_cache_scheme"] = kv_cache_quant_algo
    qc.update({"producer": dict(producer), "quant_method": "modelopt"})
    return hf, qc


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _unshare(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors that share storage (views of one buffer, one selection mask
    used by q/k/v, tied weights handed in twice): every later sharer gets its own copy."""
    seen: set[int] = set()
    out = dict(tensors)
    for name, t in out.items():
        ptr = t.untyped_storage().data_ptr() if t.numel() else 0
        if ptr and ptr in seen:
            out[name] = t.clone()
        seen.add(ptr)
    return out


def _write_shards(out: Path, tensors: Mapping[str, torch.Tensor], max_bytes: int,
                  progress: Any = None) -> list[Path]:
    from safetensors.torch import save_file

    tensors = _unshare(tensors)
    groups: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        b = _nbytes(t)
        if groups[-1] and size + b > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += b
    paths = []
    if len(groups) == 1:
        save_file({n: tensors[n] for n in groups[0]}, str(out / SINGLE_FILE),
                  metadata={"format": "pt"})
        return [out / SINGLE_FILE]
    wmap = {}
    total = len(groups)
    for i, names in enumerate(groups, 1):
        fname = f"model-{i:05d}-of-{total:05d}.safetensors"
        save_file({n: tensors[n] for n in names}, str(out / fname), metadata={"format": "pt"})
        wmap.update({n: fname for n in names})
        paths.append(out / fname)
        if progress is not None:
            progress(i, total)
    index = {"metadata": {"total_size": sum(_nbytes(t) for t in tensors.values())},
             "weight_map": wmap}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return paths


def save_checkpoint(out: str | Path, *, config: Mapping[str, Any],
                    linears: Mapping[str, QLinearWeight], tensors: Mapping[str, torch.Tensor],
                    exclude_modules: Iterable[str] = (), kv_cache_quant_algo: str | None = None,
                    compensation: Mapping[str, str] | None = None,
                    resgen: Mapping[str, Any] | None = None,
                    hf_quant_config: Mapping[str, Any] | None = None,
                    producer: Mapping[str, str] | None = None,
                    max_shard_bytes: int = _DEFAULT_SHARD) -> list[Path]:
    """Write a checkpoint folder (created if missing; existing model files are replaced).

    linears: module -> QLinearWeight (one FP4 format); tensors: every other tensor by name.
    compensation: module -> "none" | "full" | a K-Ext ratio string, recorded in
        resgen/resgen.json (a layer with a channel selection must name its own ratio).
    resgen: extra JSON-able fields for resgen/resgen.json (e.g. "plan", "calibration").
    hf_quant_config: write this hf_quant_config.json instead of building one (round trips).
    Returns the model files written.
    """
    out = Path(out)
    fmts = {w.fmt for w in linears.values()}
    if len(fmts) > 1:
        raise CheckpointError(f"one checkpoint holds one FP4 format, got {sorted(fmts)}")
    fmt = fmts.pop() if fmts else None
    model: dict[str, torch.Tensor] = {}
    fields: dict[str, torch.Tensor] = {}
    comp = dict(compensation or {})
    layers: dict[str, dict[str, str]] = {}
    for name, w in linears.items():
        mt, ext = modelopt_tensors(name, w)
        model.update(mt)
        fields.update(ext)
        c = comp.pop(name, None)
        if w.selection is not None:
            r = str(float(w.selection.ratio))
            if c not in (None, r):
                raise CheckpointError(f"compensation {c!r} for a K-Ext weight of ratio {r}",
                                      tensor=name)
            c = r
        elif c not in (None, "none", "full"):
            raise CheckpointError(f"compensation {c!r} needs a K-Ext weight (channel selection)",
                                  tensor=name)
        if c is not None:
            layers[name] = {"compensation": c}
    if comp:
        raise CheckpointError(f"compensation given for modules that are not quantized linears: "
                              f"{sorted(comp)[:3]}")
    for name, t in tensors.items():
        if name in model:
            raise CheckpointError("given both as a tensor and as a quantized linear's field",
                                  tensor=name)
        if not isinstance(t, torch.Tensor):
            raise CheckpointError(f"is a {type(t).__name__}, not a tensor", tensor=name)
        model[name] = t.detach().contiguous()
    if max_shard_bytes <= 0 or not math.isfinite(max_shard_bytes):
        raise ValueError("max_shard_bytes must be positive")
    out.mkdir(parents=True, exist_ok=True)
    for old in [out / SINGLE_FILE, out / INDEX_FILE, *out.glob("model-*-of-*.safetensors")]:
        if old.is_file():
            old.unlink()
    paths = _write_shards(out, model, max_shard_bytes)
    cfg = dict(config)
    if fmt is not None:
        prod = dict(producer or {"name": "resgen", "version": _version()})
        hf, qc = quant_configs(fmt, list(exclude_modules), kv_cache_quant_algo, prod)
        if hf_quant_config is not None:
            hf = dict(hf_quant_config)
        else:
            cfg["quantization_config"] = qc
        (out / HF_QUANT_CONFIG).write_text(json.dumps(hf, indent=4) + "\n")
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    doc = dict(resgen or {})
    if fields or any(v["compensation"] != "none" for v in layers.values()) or doc:
        from safetensors.torch import save_file

        (out / RESGEN_JSON).parent.mkdir(exist_ok=True)
        doc = {"format_version": RESGEN_FORMAT_VERSION, "fmt": fmt, **doc, "layers": layers}
        (out / RESGEN_JSON).write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
        if fields:
            save_file(_unshare(fields), str(out / RESGEN_FIELDS), metadata={"format": "pt"})
    return paths
