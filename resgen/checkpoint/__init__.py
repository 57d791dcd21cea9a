"""Checkpoints in and out: ModelOpt / compressed-tensors FP4 import, resgen's ModelOpt export.

    from resgen.checkpoint import load_checkpoint, Checkpoint, fuse_linears, CheckpointError

load      load_checkpoint / Checkpoint: an HF folder -> QLinearWeight per quantized linear +
          lazy tensors (resgen.checkpoint.load)
spec      the quantization declaration (hf_quant_config.json / quantization_config)
layouts   the FP4 tensor layouts (ModelOpt, compressed-tensors, resgen's K-Ext fields)
files     safetensors discovery, header checks, lazy reads
fuse      fuse_linears: q/k/v -> qkv, gate/up -> gate_up
serve     why_unservable: the kernel families' verdict on a layer shape
save      save_checkpoint: the ModelOpt layout + resgen's fields
quantize  the `resgen quantize` pipeline (calibration, weight methods, plan); cli its parser
errors    CheckpointError (a ValueError naming the file, the tensor and the problem)

The names are imported on first use, so `resgen --help` (which registers the quantize parser
from resgen.checkpoint.cli) does not import torch.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

__all__ = ["load_checkpoint", "Checkpoint", "fuse_linears", "QuantSpec", "CheckpointError",
           "save_checkpoint"]

_WHERE = {"load_checkpoint": "load", "Checkpoint": "load", "fuse_linears": "fuse",
          "QuantSpec": "spec", "CheckpointError": "errors", "save_checkpoint": "save"}


def __getattr__(name: str) -> Any:
    mod = _WHERE.get(name)
    if mod is None:
        raise AttributeError(f"module 'resgen.checkpoint' has no attribute {name!r}")
    return getattr(import_module(f".{mod}", __name__), name)


def __dir__() -> list[str]:
    return sorted(__all__)
