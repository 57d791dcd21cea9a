"""Checkpoints in and out: ModelOpt / compressed-tensors FP4 import, resgen's ModelOpt export.

    from resgen.checkpoint import load_checkpoint, Checkpoint, fuse_linears, CheckpointError

load      load_checkpoint / Checkpoint: an HF folder -> QLinearWeight per quantized linear +
          lazy tensors (resgen.checkpoint.load)
spec      the quantization declaration (hf_quant_config.json / quantization_config)
layouts   the FP4 tensor layouts (ModelOpt, compressed-tensors, resgen's K-Ext fields)
files     safetensors discovery, header checks, lazy reads
fuse      fuse_linears: q/k/v -> qkv, gate/up -> gate_up
serve     why_unservable: the kernel families' verdict on a layer shape
errors    CheckpointError (a ValueError naming the file, the tensor and the problem)
"""

from .errors import CheckpointError
from .fuse import fuse_linears
from .load import Checkpoint, load_checkpoint
from .spec import QuantSpec

__all__ = ["load_checkpoint", "Checkpoint", "fuse_linears", "QuantSpec", "CheckpointError"]
