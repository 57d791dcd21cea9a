"""Run-time ops served by the tuned kernels: `Linear` (FP4 linear layers: plain, M-Ext,
K-Ext; `FP4Linear` is its torch.nn.Module form) and `DecodeAttention` (ResAttn / plain
NVFP4-KV decode over a paged cache). Each looks up the tuned variant for the real shape
(resgen.runtime), compiles it once per process and keeps its buffers per shape class; see
resgen/ops/linear.py, resgen/ops/attention.py and resgen/ops/nn.py."""

from .attention import AttentionPlan, DecodeAttention
from .common import choose_variant, compile_cached
from .linear import LayerPlan, Linear
from .nn import FP4Linear

__all__ = ["Linear", "LayerPlan", "DecodeAttention", "AttentionPlan", "compile_cached",
           "choose_variant", "FP4Linear"]
