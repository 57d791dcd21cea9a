"""Tensor layouts of FP4 linear layers in checkpoints, and their conversion to QLinearWeight.

Per quantized linear module `m` (an HF module name, "model.layers.0.self_attn.q_proj"):

ModelOpt (layout "modelopt"; nvidia-modelopt 0.47 export_hf_checkpoint, checked on a checkpoint
it wrote: tests/fixtures/modelopt/)
    m.weight          uint8 [N, K/2]   two E2M1 codes per byte, EVEN element in the LOW nibble
                                       (NVFP4QTensor.quantize: (q[..., 1::2] << 4) | q[..., 0::2])
    m.weight_scale    NVFP4: float8_e4m3fn [N, K/16];  MXFP4: uint8 E8M0 [N, K/32] (bias 127)
    m.weight_scale_2  NVFP4 only: float32, one element: amax(W) / (6 * 448)
                      (get_weights_scaling_factor_2), so x_hat = code * weight_scale *
                      weight_scale_2: exactly resgen's alpha and d = alpha * sf
    m.input_scale     NVFP4 only: float32, one element: amax(x) / (6 * 448) from calibration
                      (get_activation_scaling_factor, maxbound 6): resgen's static activation
                      alpha. vLLM (modelopt.py, ModelOptNvFp4LinearMethod) quantizes x with
                      1 / input_scale and multiplies the GEMM by input_scale * weight_scale_2:
                      the same numbers. For q/k/v and gate/up it takes max(weight_scale_2)
                      without requantizing; ModelOpt's export makes them equal
                      (preprocess_linear_fusion), which the fixtures show.
    Checked on the fixtures: formats.dequantize of the import equals ModelOpt's own
    NVFP4QTensor / MXFP4QTensor.dequantize bit for bit, and resgen's quantization of the source
    weights with the same weight_scale_2 reproduces ModelOpt's NVFP4 codes and scales bit for
    bit (MXFP4 exponent rules differ: ModelOpt ceil(log2(amax / 6)), OCP / resgen
    floor(log2(amax)) - 2; decoding is the same). KV cache scales (m = ...k_proj / v_proj):
    m.k_scale / m.v_scale, amax / 448 for FP8 and NVFP4 KV caches alike.
compressed-tensors (layout "compressed-tensors"; compressed-tensors' NVFP4PackedCompressor and
its ModelOpt converter, entrypoints/convert/converters/modelopt_nvfp4.py)
    m.weight_packed        uint8 [N, K/2], same packing (pack_fp4_to_uint8: low nibble first)
    m.weight_scale         float8_e4m3fn [N, K/16] (NVFP4) / uint8 E8M0 [N, K/32] (MXFP4)
    m.weight_global_scale  NVFP4: float32, the RECIPROCAL: 1 / weight_scale_2
    m.input_global_scale   NVFP4, static activations: 1 / input_scale
    compressed-tensors dequantizes code * (weight_scale / weight_global_scale); resgen uses
    alpha = fp32(1 / weight_global_scale) and alpha * weight_scale, which may differ from it
    by one FP32 ulp of the effective scale (never more): the import is exact up to that.
resgen's own fields (written by resgen's export, ignored by other readers): resgen/resgen.json
(per layer compensation, the plan) and resgen/fields.safetensors with, for a K-Ext layer,
    m.resgen_ext_weight        uint8 [N, ext/2]  the selected weight columns (extension layout)
    m.resgen_ext_weight_scale  block scales of the extension (the layer's global scale)
    m.resgen_channel_mask      uint8 [K/8]       resgen.calibrate.Selection masks
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Mapping

import torch

from .. import formats
from ..calibrate import QLinearWeight, Selection
from .errors import CheckpointError
from .files import TensorInfo, TensorReader
from .spec import QuantSpec

__all__ = ["LinearEntry", "SUFFIXES", "find_linears", "build_linear", "check_scalar",
           "EXT_SUFFIXES"]

# role -> tensor-name suffix, per layout
SUFFIXES: dict[str, dict[str, str]] = {
    "modelopt": {"codes": "weight", "scales": "weight_scale", "global": "weight_scale_2",
                 "input": "input_scale"},
    "compressed-tensors": {"codes": "weight_packed", "scales": "weight_scale",
                           "global": "weight_global_scale", "input": "input_global_scale",
                           "shape": "weight_shape"},
}
EXT_SUFFIXES = {"codes": "resgen_ext_weight", "scales": "resgen_ext_weight_scale",
                "mask": "resgen_channel_mask"}
_SCALE_DTYPES = {"nvfp4": ("F8_E4M3",), "mxfp4": ("U8", "F8_E8M0")}


@dataclass(frozen=True)
class LinearEntry:
    """One quantized linear module found in the headers (nothing read yet).

    name: HF module name; fmt; n, k: out / in features; fields: role -> TensorInfo
    ("codes", "scales", optional "global", "input", "shape"); reciprocal: global scales stored
    as 1 / alpha (compressed-tensors); ext: resgen K-Ext roles -> TensorInfo, with ratio.
    """

    name: str
    fmt: str
    n: int
    k: int
    layout: str
    fields: Mapping[str, TensorInfo]
    reciprocal: bool = False
    ext: Mapping[str, TensorInfo] = field(default_factory=dict)
    ratio: float | None = None

    def tensor_names(self) -> list[str]:
        return [i.name for i in self.fields.values()]


def _err(msg: str, info: TensorInfo | None = None, tensor: str | None = None) -> CheckpointError:
    return CheckpointError(msg, file=None if info is None else info.file,
                           tensor=tensor if tensor is not None else
                           (None if info is None else info.name))


def find_linears(infos: Mapping[str, TensorInfo], spec: QuantSpec) -> dict[str, LinearEntry]:
    """Every quantized linear of the spec's layout, its tensors' dtypes and shapes checked."""
    suf = SUFFIXES[spec.layout]
    fmt, bs = spec.fmt, spec.group_size
    scale_sfx = "." + suf["scales"]
    out: dict[str, LinearEntry] = {}
    for sname, sinfo in infos.items():
        if not sname.endswith(scale_sfx):
            continue
        m = sname[: -len(scale_sfx)]
        cname = f"{m}.{suf['codes']}"
        if cname not in infos:
            raise _err(f"block scales without the packed weight {cname!r}", sinfo)
        codes = infos[cname]
        if codes.dtype != "U8":
            raise _err(f"has dtype {codes.dtype}, a packed FP4 weight is U8 (uint8)", codes)
        if len(codes.shape) != 2 or 0 in codes.shape:
            raise _err(f"has shape {list(codes.shape)}, a packed FP4 weight is [N, K/2]", codes)
        n, k = codes.shape[0], codes.shape[1] * 2
        if sinfo.dtype not in _SCALE_DTYPES[fmt]:
            raise _err(f"has dtype {sinfo.dtype}, {fmt} block scales are "
                       f"{' or '.join(_SCALE_DTYPES[fmt])}", sinfo)
        if k % bs or tuple(sinfo.shape) != (n, k // bs):
            raise _err(f"has shape {list(sinfo.shape)}, the weight {list(codes.shape)} "
                       f"(N={n}, K={k}) needs [{n}, {k / bs:g}] {fmt} scales of {bs} elements",
                       sinfo)
        if spec.is_excluded(m):
            raise _err(f"module {m!r} is in exclude_modules but holds {fmt} tensors", sinfo)
        fields = {"codes": codes, "scales": sinfo}
        for role in ("global", "input", "shape"):
            if role not in suf:
                continue
            name = f"{m}.{suf[role]}"
            info = infos.get(name)
            if info is None:
                if role == "global" and fmt == "nvfp4":
                    raise _err(f"NVFP4 module {m!r} lacks its tensor scale {name!r}",
                               sinfo, tensor=name)
                continue
            if role in ("global", "input"):
                if fmt == "mxfp4":
                    raise _err("MXFP4 has no tensor scale (E8M0 block scales only)", info)
                if info.dtype != "F32" or info.numel != 1:
                    raise _err(f"has dtype {info.dtype} shape {list(info.shape)}, a tensor "
                               "scale is one float32", info)
            else:
                if info.dtype not in ("I64", "I32") or info.shape != (2,):
                    raise _err(f"has dtype {info.dtype} shape {list(info.shape)}, "
                               "weight_shape is two integers", info)
            fields[role] = info
        zp = infos.get(f"{m}.weight_zero_point")
        if zp is not None:
            raise _err("asymmetric FP4 (a zero point) is not supported", zp)
        out[m] = LinearEntry(m, fmt, n, k, spec.layout, fields,
                             reciprocal=spec.layout == "compressed-tensors")
    return out


def check_scalar(t: torch.Tensor, info: TensorInfo, reciprocal: bool) -> torch.Tensor:
    """A tensor scale read from `info` -> resgen's alpha (float32 0-dim), or CheckpointError."""
    v = float(t.reshape(-1)[0])
    if not math.isfinite(v) or v <= 0:
        raise _err(f"tensor scale {v} is not a positive finite number", info)
    a = t.to(torch.float32).reshape(())
    if reciprocal:
        a = torch.reciprocal(a)
        if not bool(torch.isfinite(a)) or float(a) <= 0:
            raise _err(f"tensor scale 1 / {v} is not a positive finite float32", info)
    return a


def _check_scales(scales: torch.Tensor, fmt: str, info: TensorInfo) -> torch.Tensor:
    """Block scales -> the dtype QuantizedTensor holds; NaN / negative codes are errors."""
    bits = scales.view(torch.uint8)
    if fmt == "nvfp4":
        nan = (bits & 0x7F) == 0x7F
        neg = (bits & 0x80) != 0
        if bool(nan.any()):
            raise _err(f"{int(nan.sum())} E4M3 block scales are NaN", info)
        if bool((neg & (bits != 0x80)).any()):
            raise _err(f"{int((neg & (bits != 0x80)).sum())} E4M3 block scales are negative",
                       info)
        return bits.view(torch.float8_e4m3fn)
    nan = bits == 0xFF
    if bool(nan.any()):
        raise _err(f"{int(nan.sum())} E8M0 block scales are 255 (NaN)", info)
    return bits.clone() if scales.dtype != torch.uint8 else bits


def build_linear(entry: LinearEntry, reader: TensorReader,
                 scalars: Mapping[str, torch.Tensor]) -> QLinearWeight:
    """Read one linear's tensors -> QLinearWeight (K-Ext layout when it has an extension).

    scalars: tensor name -> alpha already read and checked (check_scalar) at load time.
    """
    f = entry.fields
    codes = reader.read(f["codes"])
    scales = _check_scales(reader.read(f["scales"]), entry.fmt, f["scales"])
    if "shape" in f:
        shp = [int(x) for x in reader.read(f["shape"]).tolist()]
        if shp != [entry.n, entry.k]:
            raise _err(f"is {shp}, the packed weight is [{entry.n}, {entry.k}]", f["shape"])
    gs = scalars[f["global"].name] if "global" in f else None
    isc = scalars[f["input"].name] if "input" in f else None
    meta = {"layout": entry.layout, "file": f["codes"].file.name}
    for role in ("global", "input"):
        if role in f:
            meta[f"shape.{role}"] = json.dumps(list(f[role].shape))
    sel = None
    if entry.ext:
        e = entry.ext
        mask = reader.read(e["mask"])
        try:
            sel = Selection(mask, entry.ratio)
        except ValueError as ex:
            raise _err(f"is not a valid channel selection for ratio {entry.ratio}: {ex}",
                       e["mask"]) from None
        ext = formats.extension_length(sel.indices.numel(), entry.fmt)
        bs = formats.block_size(entry.fmt)
        xc = reader.read(e["codes"])
        xs = _check_scales(reader.read(e["scales"]), entry.fmt, e["scales"])
        if sel.in_features != entry.k:
            raise _err(f"selects from K={sel.in_features}, the layer has K={entry.k}", e["mask"])
        if tuple(xc.shape) != (entry.n, ext // 2) or tuple(xs.shape) != (entry.n, ext // bs):
            raise _err(f"K-Ext extension shapes {list(xc.shape)} / {list(xs.shape)} do not fit "
                       f"N={entry.n}, ext={ext}", e["codes"])
        codes = torch.cat([codes, xc], dim=-1)
        scales = torch.cat([scales, xs], dim=-1)
    q = formats.QuantizedTensor(entry.fmt, codes, scales, gs)
    return QLinearWeight(q, entry.k, sel, isc, meta)
