"""Which quantization a checkpoint folder declares: hf_quant_config.json / quantization_config.

Read as the tools that write them define them (sources read 2026-12, see docs/checkpoints.md):

ModelOpt (nvidia-modelopt 0.47 `export_hf_checkpoint`, what vLLM serves as modelopt_fp4)
    hf_quant_config.json  {"producer": {"name": "modelopt", "version"},
                           "quantization": {"quant_algo": "NVFP4" | "mxfp4",
                                            "kv_cache_quant_algo": null | "FP8" | "NVFP4",
                                            "group_size": 16 (NVFP4 only),
                                            "exclude_modules": ["lm_head", "model.layers.0*"]}}
    config.json["quantization_config"] = {"quant_method": "modelopt", "quant_algo", "ignore",
                                          "config_groups", "producer"} (written beside it)
    exclude_modules are wildcards where only '*' is special, matched against the whole module
    name (vLLM: re.fullmatch(re.escape(p).replace('\\*', '.*'))).
compressed-tensors (llm-compressor; compressed-tensors 0.x)
    config.json["quantization_config"] = {"quant_method": "compressed-tensors",
        "format": "nvfp4-pack-quantized" | "mxfp4-pack-quantized", "config_groups":
        {name: {"targets": [...], "weights": {"num_bits": 4, "type": "float", "group_size":
        16 | 32, "strategy": "tensor_group" | "group"}, "input_activations": {...}}},
        "ignore": ["lm_head", "re:.*mlp.gate$"], "kv_cache_scheme": ...}
    ignore entries are module names or "re:<regex>" (matched with re.match).
gpt-oss style {"quant_method": "mxfp4"} quantizes MoE experts only (`*_blocks` / `*_scales`);
resgen serves dense decoders, so it is refused with that reason.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from .errors import CheckpointError

__all__ = ["QuantSpec", "read_quant_spec", "HF_QUANT_CONFIG", "GROUP_SIZE"]

HF_QUANT_CONFIG = "hf_quant_config.json"
GROUP_SIZE = {"nvfp4": 16, "mxfp4": 32}
_ALGOS = {"NVFP4": "nvfp4", "MXFP4": "mxfp4"}
# Known ModelOpt algorithms that are not W4A4 NVFP4 / MXFP4, with why resgen does not read them.
_REFUSED = {
    "NVFP4_AWQ": "AWQ pre_quant_scale smoothing is not applied by resgen's kernels",
    "NVFP4_SVD": "SVDQuant's low-rank branch is not applied by resgen's kernels",
    "W4A16_NVFP4": "weight-only NVFP4 (BF16 activations); resgen's kernels are W4A4",
    "W4A8_NVFP4_FP8": "FP8 activations; resgen's kernels quantize activations to FP4",
    "W4A8_MXFP4_FP8": "FP8 activations; resgen's kernels quantize activations to FP4",
    "MIXED_PRECISION": "per-layer mixed formats are not read (only one FP4 format per model)",
}


@dataclass(frozen=True)
class QuantSpec:
    """The declared quantization of a checkpoint.

    producer:  who wrote it ("modelopt", "resgen", "compressed-tensors", ...).
    layout:    tensor naming: "modelopt" (weight / weight_scale / weight_scale_2 / input_scale)
               or "compressed-tensors" (weight_packed / weight_scale / weight_global_scale /
               input_global_scale, reciprocal global scales).
    fmt:       "nvfp4" | "mxfp4".  group_size: 16 | 32.
    quant_algo: as written ("NVFP4", "mxfp4", "nvfp4-pack-quantized", ...).
    exclude_modules: modules left unquantized, as written (wildcards / "re:" patterns).
    kv_cache_quant_algo: "FP8" / "NVFP4" / None (ModelOpt), or compressed-tensors' scheme type.
    raw: the whole declaration as read.  source: the file it was read from.
    """

    producer: str
    layout: str
    fmt: str
    group_size: int
    quant_algo: str
    exclude_modules: tuple[str, ...] = ()
    kv_cache_quant_algo: str | None = None
    raw: Mapping[str, Any] = field(default_factory=dict)
    source: str = ""

    def is_excluded(self, module: str) -> bool:
        """Whether `module` (an HF module name, e.g. "lm_head") is named by exclude_modules."""
        for pat in self.exclude_modules:
            if pat.startswith("re:"):
                if re.match(pat[3:], module):
                    return True
            elif re.fullmatch(re.escape(pat).replace(r"\*", ".*"), module):
                return True
        return False


def _fail(msg: str, src: Path) -> CheckpointError:
    return CheckpointError(msg, file=src)


def _str_list(v: Any, what: str, src: Path) -> tuple[str, ...]:
    if v is None:
        return ()
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise _fail(f"{what} must be a list of module names, got {v!r}", src)
    for x in v:
        if x.startswith("re:"):
            try:
                re.compile(x[3:])
            except re.error as e:
                raise _fail(f"{what} entry {x!r} is not a valid regex ({e})", src) from None
    return tuple(v)


def _algo_fmt(algo: Any, group_size: Any, src: Path) -> tuple[str, int]:
    if not isinstance(algo, str):
        raise _fail(f"quant_algo must be a string, got {algo!r}", src)
    fmt = _ALGOS.get(algo.upper())
    if fmt is None:
        why = _REFUSED.get(algo.upper())
        if why:
            raise _fail(f"quant_algo {algo!r} is not supported: {why}", src)
        raise _fail(f"unknown quant_algo {algo!r}: resgen reads NVFP4 and MXFP4 (ModelOpt) and "
                    "compressed-tensors nvfp4/mxfp4-pack-quantized", src)
    gs = GROUP_SIZE[fmt]
    if group_size is not None and group_size != gs:
        raise _fail(f"{algo} with group_size {group_size!r}: {fmt} blocks are {gs} elements", src)
    return fmt, gs


def _modelopt(q: Mapping[str, Any], producer: str, raw: Mapping[str, Any], src: Path,
              ignore_key: str) -> QuantSpec:
    fmt, gs = _algo_fmt(q.get("quant_algo"), q.get("group_size"), src)
    kv = q.get("kv_cache_quant_algo")
    if kv is not None and not isinstance(kv, str):
        raise _fail(f"kv_cache_quant_algo must be a string or null, got {kv!r}", src)
    excl = q.get("exclude_modules", q.get(ignore_key))
    return QuantSpec(producer, "modelopt", fmt, gs, q["quant_algo"],
                     _str_list(excl, "exclude_modules", src), kv, raw, str(src))


def _compressed_tensors(qc: Mapping[str, Any], src: Path) -> QuantSpec:
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise _fail("compressed-tensors quantization_config has no config_groups", src)
    fmts = set()
    top = qc.get("format")
    for gname, g in groups.items():
        w = g.get("weights") if isinstance(g, dict) else None
        if not isinstance(w, dict):
            raise _fail(f"config group {gname!r} has no weights arguments", src)
        form = g.get("format") or top
        if w.get("num_bits") != 4 or w.get("type") != "float":
            raise _fail(f"config group {gname!r} quantizes weights to {w.get('num_bits')}-bit "
                        f"{w.get('type')}: resgen reads FP4 (nvfp4/mxfp4-pack-quantized)", src)
        if form == "nvfp4-pack-quantized" and w.get("group_size") == 16:
            fmts.add("nvfp4")
        elif form == "mxfp4-pack-quantized" and w.get("group_size") == 32:
            fmts.add("mxfp4")
        else:
            raise _fail(f"config group {gname!r}: format {form!r} with group_size "
                        f"{w.get('group_size')!r} is not nvfp4-pack-quantized (16) or "
                        "mxfp4-pack-quantized (32)", src)
        acts = g.get("input_activations")
        if acts is not None and (not isinstance(acts, dict) or acts.get("num_bits") != 4):
            raise _fail(f"config group {gname!r} keeps activations at "
                        f"{acts.get('num_bits') if isinstance(acts, dict) else acts!r} bits: "
                        "resgen's kernels are W4A4", src)
    if len(fmts) != 1:
        raise _fail(f"config groups mix formats {sorted(fmts)}: one FP4 format per model", src)
    fmt = fmts.pop()
    kv = qc.get("kv_cache_scheme")
    kv_algo = None
    if isinstance(kv, dict):
        kv_algo = f"{kv.get('type', '?')}{kv.get('num_bits', '')}"
    return QuantSpec("compressed-tensors", "compressed-tensors", fmt, GROUP_SIZE[fmt],
                     str(top or f"{fmt}-pack-quantized"),
                     _str_list(qc.get("ignore"), "ignore", src), kv_algo, qc, str(src))


def read_quant_spec(folder: Path, config: Mapping[str, Any]) -> QuantSpec | None:
    """The folder's quantization, or None for an unquantized checkpoint.

    Which declaration wins follows vLLM (get_quant_config): config.json's quantization_config
    decides the method; for "modelopt" the richer hf_quant_config.json beside it is read when
    present (ModelOpt writes both). Without a quantization_config, hf_quant_config.json alone
    declares a ModelOpt checkpoint. (compressed-tensors' ModelOpt converter copies the old
    hf_quant_config.json into its output: config.json's compressed-tensors block wins there.)
    """
    folder = Path(folder)
    hf = folder / HF_QUANT_CONFIG
    qc = config.get("quantization_config")
    src = folder / "config.json"
    if qc is not None and not isinstance(qc, dict):
        raise _fail(f"quantization_config must be an object, got {type(qc).__name__}", src)
    method = None if qc is None else qc.get("quant_method")
    if hf.is_file() and method in (None, "modelopt"):
        try:
            doc = json.loads(hf.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise _fail(f"not JSON ({type(e).__name__})", hf) from None
        q = doc.get("quantization") if isinstance(doc, dict) else None
        if not isinstance(q, dict):
            raise _fail('has no "quantization" object', hf)
        prod = doc.get("producer")
        name = prod.get("name") if isinstance(prod, dict) else None
        return _modelopt(q, str(name or "modelopt"), doc, hf, "exclude_modules")
    if qc is None:
        return None
    if method == "modelopt":
        inner = qc.get("quantization") if isinstance(qc.get("quantization"), dict) else qc
        prod = qc.get("producer")
        name = prod.get("name") if isinstance(prod, dict) else None
        return _modelopt(inner, str(name or "modelopt"), qc, src, "ignore")
    if method == "compressed-tensors":
        return _compressed_tensors(qc, src)
    if method == "mxfp4":
        raise _fail("quant_method 'mxfp4' (gpt-oss style `_blocks` / `_scales`) quantizes MoE "
                    "experts only; resgen serves dense decoders (ModelOpt or compressed-tensors "
                    "MXFP4 linears are read)", src)
    raise _fail(f"unsupported quant_method {method!r}: resgen reads ModelOpt (NVFP4, MXFP4) and "
                "compressed-tensors (nvfp4/mxfp4-pack-quantized) checkpoints", src)
