"""load_checkpoint: a Hugging Face folder (BF16 / FP16 / FP32, or FP4) -> Checkpoint.

    from resgen.checkpoint import load_checkpoint, fuse_linears
    ck = load_checkpoint("Qwen3-8B-NVFP4")         # config.json (+ hf_quant_config.json),
                                                  # model.safetensors or shards + index
    ck.quant                 # QuantSpec | None (None: an unquantized checkpoint)
    ck.linears["model.layers.0.self_attn.q_proj"]  # QLinearWeight, read on access
    ck.tensors["model.embed_tokens.weight"]        # every other tensor, read on access
    ck.kv_scales[0]          # (k_scale, v_scale) of layer 0 if the checkpoint has them
    qkv = fuse_linears([ck.linears[f"model.layers.0.self_attn.{p}_proj"] for p in "qkv"])

What is checked at load (nothing large is read): config.json is a UTF-8 JSON object; the
quantization declaration is one resgen reads (resgen.checkpoint.spec); every safetensors header
(resgen.checkpoint.files: dtype, shape, byte range; the index's shards exist and hold what it
says); every quantized linear's tensor dtypes and shapes (resgen.checkpoint.layouts); every
tensor scale (weight_scale_2, input_scale, KV scales) is a positive finite number; every layer
is servable by resgen's kernels (resgen.checkpoint.serve) unless serve_check=False. Block scales
(NaN or negative E4M3 / E8M0 codes) are checked when a linear is read. Any failure is a
CheckpointError naming the file, the tensor and the problem.

A layer the kernels cannot serve is an error naming it and why; with fallback_bf16=True it is
dequantized to BF16 instead (exact FP4 values rounded once to BF16), appears in ck.tensors as
"<module>.weight" and in ck.fallback with the reason, and not in ck.linears.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Mapping

import torch

from .. import formats
from ..calibrate import QLinearWeight
from .errors import CheckpointError
from .files import LazyTensors, TensorInfo, TensorReader, discover, read_header
from .layouts import EXT_SUFFIXES, LinearEntry, build_linear, check_scalar, find_linears
from .spec import QuantSpec, read_quant_spec

__all__ = ["Checkpoint", "load_checkpoint", "LazyLinears", "RESGEN_DIR", "RESGEN_JSON",
           "RESGEN_FIELDS"]

RESGEN_DIR = "resgen"
RESGEN_JSON = "resgen/resgen.json"
RESGEN_FIELDS = "resgen/fields.safetensors"
_KV = re.compile(r"^(?:.*\.)?layers\.(\d+)\.self_attn\.(?:(?:k_proj|v_proj|attn)\.)?([kv])_scale$")


class LazyLinears(Mapping[str, QLinearWeight]):
    """Module name -> QLinearWeight, read from the files on every access (keep what you need).

    entry(name) gives the header facts (fmt, N, K, layout, tensor names) without reading.
    """

    def __init__(self, entries: Mapping[str, LinearEntry],
                 build: Callable[[LinearEntry], QLinearWeight]) -> None:
        self._entries = dict(entries)
        self._build = build

    def __getitem__(self, name: str) -> QLinearWeight:
        return self._build(self._entries[name])

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def entry(self, name: str) -> LinearEntry:
        return self._entries[name]

    def __repr__(self) -> str:
        return f"LazyLinears({len(self)} linears)"


@dataclass
class Checkpoint:
    """A loaded checkpoint folder (see the module docstring).

    path:      the folder.  config: config.json as a dict.
    quant:     the declared quantization, or None for a BF16 / FP16 / FP32 checkpoint.
    linears:   quantized linear modules by HF module name -> QLinearWeight (input_scale set
               when the checkpoint has a static one); empty for an unquantized checkpoint.
    tensors:   every other tensor by its HF name (embeddings, norms, biases, lm_head, excluded
               linears' weights, KV scale tensors), read on access.
    kv_scales: layer index -> (k_scale, v_scale) as stored (ModelOpt: amax / 448 for FP8 and
               NVFP4 KV caches alike, unified_export_hf.py).
    resgen:    resgen's own fields (resgen/resgen.json: per-layer compensation, plan), or {}.
    fallback:  modules served in BF16 on request (fallback_bf16=True) -> why the kernels
               cannot serve them.
    """

    path: Path
    config: dict
    quant: QuantSpec | None
    linears: LazyLinears
    tensors: LazyTensors
    kv_scales: dict[int, tuple[float, float]] = field(default_factory=dict)
    resgen: dict = field(default_factory=dict)
    fallback: dict[str, str] = field(default_factory=dict)

    @property
    def fmt(self) -> str | None:
        return None if self.quant is None else self.quant.fmt

    def kv_cache_alphas(self) -> dict[int, tuple[float, float]]:
        """layer -> (k, v) NVFP4 global scales for resgen.kvcache.PagedKVCache (its k_scale /
        v_scale: alpha = amax / (6 * 448)), from the stored kv_scales, which ModelOpt writes as
        amax / 448 for FP8 and NVFP4 KV caches alike (unified_export_hf.py,
        kv_cache_max_bound = 448): alpha = k_scale / 6, an FP32 division."""
        six = torch.tensor(6.0)
        return {i: tuple(float(torch.tensor(v, dtype=torch.float32) / six) for v in kv)
                for i, kv in self.kv_scales.items()}

    def compensation(self, module: str) -> str | None:
        """resgen's recorded compensation of a module ("none" | "full" | a K-Ext ratio string),
        or None when the checkpoint does not say (not written by resgen)."""
        layer = (self.resgen.get("layers") or {}).get(module)
        return None if layer is None else layer.get("compensation")


def _read_config(folder: Path) -> dict:
    path = folder / "config.json"
    if not path.is_file():
        raise CheckpointError("no config.json (a Hugging Face model folder has one)", file=folder)
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise CheckpointError("not UTF-8 text", file=path) from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"not JSON ({e.msg} at line {e.lineno})", file=path) from None
    if not isinstance(cfg, dict):
        raise CheckpointError("not a JSON object", file=path)
    return cfg


def _read_resgen(folder: Path, fmt: str | None, entries: dict[str, LinearEntry]
                 ) -> tuple[dict, dict[str, TensorInfo]]:
    jpath = folder / RESGEN_JSON
    if not jpath.is_file():
        return {}, {}
    try:
        doc = json.loads(jpath.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"not JSON ({type(e).__name__})", file=jpath) from None
    if not isinstance(doc, dict) or not isinstance(doc.get("layers", {}), dict):
        raise CheckpointError('not a JSON object with a "layers" object', file=jpath)
    if doc.get("fmt") not in (None, fmt):
        raise CheckpointError(f"describes {doc.get('fmt')} layers, the checkpoint is {fmt}",
                              file=jpath)
    fpath = folder / RESGEN_FIELDS
    infos: dict[str, TensorInfo] = read_header(fpath)[0] if fpath.is_file() else {}
    for m, layer in doc.get("layers", {}).items():
        if not isinstance(layer, dict):
            raise CheckpointError("layer entry is not an object", file=jpath, tensor=m)
        comp = layer.get("compensation", "none")
        if comp not in ("none", "full", "0.125", "0.25", "0.5", "1.0"):
            raise CheckpointError(f"unknown compensation {comp!r}", file=jpath, tensor=m)
        names = {r: f"{m}.{s}" for r, s in EXT_SUFFIXES.items()}
        has = [n in infos for n in names.values()]
        if comp in ("none", "full"):
            if any(has):
                raise CheckpointError(f"has K-Ext tensors but compensation {comp!r}",
                                      file=fpath, tensor=m)
            continue
        if not all(has):
            missing = [n for n, h in zip(names.values(), has) if not h]
            raise CheckpointError(f"K-Ext ratio {comp} needs {missing} in {RESGEN_FIELDS}",
                                  file=jpath, tensor=m)
        if m not in entries:
            raise CheckpointError("K-Ext fields for a module that is not a quantized linear",
                                  file=jpath, tensor=m)
        ext = {r: infos[n] for r, n in names.items()}
        for r, dt in (("codes", ("U8",)), ("mask", ("U8",))):
            if ext[r].dtype not in dt:
                raise CheckpointError(f"has dtype {ext[r].dtype}, expected U8", file=fpath,
                                      tensor=ext[r].name)
        want = {"nvfp4": ("F8_E4M3",), "mxfp4": ("U8", "F8_E8M0")}[fmt]
        if ext["scales"].dtype not in want:
            raise CheckpointError(f"has dtype {ext['scales'].dtype}, {fmt} scales are "
                                  f"{' or '.join(want)}", file=fpath, tensor=ext["scales"].name)
        e = entries[m]
        entries[m] = LinearEntry(e.name, e.fmt, e.n, e.k, e.layout, e.fields, e.reciprocal,
                                 ext, float(comp))
    return doc, infos


def load_checkpoint(path: str | Path, *, fallback_bf16: bool = False,
                    serve_check: bool = True, arch: str | None = None) -> Checkpoint:
    """Open a Hugging Face checkpoint folder (see the module docstring for what is checked).

    fallback_bf16: serve layers the kernels cannot run in BF16 instead of failing.
    serve_check: False skips the kernel-servability check (e.g. CPU-only fake-quant use).
    arch: the target the servability check asks about (default: resgen.settings' arch).
    """
    folder = Path(path)
    if not folder.is_dir():
        raise CheckpointError("not a folder (a checkpoint is a Hugging Face model folder)",
                              file=folder)
    config = _read_config(folder)
    spec = read_quant_spec(folder, config)
    infos = discover(folder)
    reader = TensorReader()
    entries = find_linears(infos, spec) if spec is not None else {}
    resgen, ext_infos = _read_resgen(folder, None if spec is None else spec.fmt, entries)
    if ext_infos and spec is None:
        raise CheckpointError("resgen K-Ext fields in an unquantized checkpoint",
                              file=folder / RESGEN_FIELDS)

    # Tensor scales: tiny, read and checked now.
    scalars: dict[str, torch.Tensor] = {}
    for e in entries.values():
        for role in ("global", "input"):
            info = e.fields.get(role)
            if info is not None:
                scalars[info.name] = check_scalar(reader.read(info), info, e.reciprocal)
    used = {n for e in entries.values() for n in e.tensor_names()}
    rest = {n: i for n, i in infos.items() if n not in used}
    kv = _kv_scales(rest, reader)

    def build(e: LinearEntry) -> QLinearWeight:
        return build_linear(e, reader, scalars)

    fallback: dict[str, str] = {}
    sources: dict[str, Callable[[], torch.Tensor]] = {
        n: (lambda i=i: reader.read(i)) for n, i in rest.items()}
    if serve_check:
        from .serve import why_unservable

        for m, e in list(entries.items()):
            comp = "none" if e.ratio is None else str(e.ratio)
            why = why_unservable(e.fmt, e.n, e.k, comp, arch)
            if why is None:
                continue
            if not fallback_bf16:
                raise CheckpointError(
                    f"resgen's kernels cannot serve this {e.fmt} layer (N={e.n}, K={e.k}): "
                    f"{why}; load with fallback_bf16=True (CLI: --fallback-bf16) to run it in "
                    "BF16", file=e.fields["codes"].file, tensor=m)
            fallback[m] = why
            del entries[m]
            sources[f"{m}.weight"] = (lambda e=e: _dequantize_bf16(build(e)))
    return Checkpoint(folder, config, spec, LazyLinears(entries, build),
                      LazyTensors(sources, rest), kv, resgen, fallback)


def _dequantize_bf16(w: QLinearWeight) -> torch.Tensor:
    return formats.dequantize(w.base()).to(torch.bfloat16)


def _kv_scales(rest: Mapping[str, TensorInfo], reader: TensorReader
               ) -> dict[int, tuple[float, float]]:
    found: dict[int, dict[str, float]] = {}
    where: dict[int, TensorInfo] = {}
    for name, info in rest.items():
        m = _KV.match(name)
        if not m:
            continue
        if info.numel != 1 or info.dtype not in ("F32", "BF16", "F16"):
            raise CheckpointError(f"has dtype {info.dtype} shape {list(info.shape)}, a KV cache "
                                  "scale is one float", file=info.file, tensor=name)
        v = float(reader.read(info).float().reshape(-1)[0])
        if not (v > 0 and v < float("inf")):
            raise CheckpointError(f"KV cache scale {v} is not a positive finite number",
                                  file=info.file, tensor=name)
        layer = int(m.group(1))
        if m.group(2) in found.setdefault(layer, {}):
            raise CheckpointError(f"layer {layer} has two {m.group(2)}_scale tensors",
                                  file=info.file, tensor=name)
        found[layer][m.group(2)] = v
        where[layer] = info
    out = {}
    for layer, kv in sorted(found.items()):
        if set(kv) != {"k", "v"}:
            have = next(iter(kv))
            raise CheckpointError(f"layer {layer} has a {have}_scale but no "
                                  f"{'v' if have == 'k' else 'k'}_scale",
                                  file=where[layer].file, tensor=where[layer].name)
        out[layer] = (kv["k"], kv["v"])
    return out
