"""Imported checkpoints through resgen.ops.Linear on the CPU: the kernels' CPU simulations stand
in for the compiled kernels (as tests/test_ops.py does), the family defaults serve (no tuned
table), and every layer of a ModelOpt-written checkpoint, fused as the kernels want it, matches
resgen.reference.linear on the same quantized weight. The GPU run is
tests/gpu/test_checkpoint_gpu.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from resgen import reference as R
from resgen.checkpoint import fuse_linears, load_checkpoint
from resgen.ops import Linear

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fakefam import isolated_cache  # noqa: E402,F401
from test_linear_sm90_mma import _record_launcher_pointers  # noqa: E402
from test_ops import _Compiles, _empty_dispatcher, _quantizers, _rel  # noqa: E402

MO = Path(__file__).parent / "fixtures" / "modelopt"
pytestmark = pytest.mark.usefixtures("isolated_cache")
GROUPS = {"qkv": ("self_attn", "qkv"), "o": ("self_attn", "o"),
          "gate_up": ("mlp", ("gate", "up")), "down": ("mlp", ("down",))}


@pytest.mark.parametrize("name", ["qwen3_nvfp4_fp8kv", "llama_mxfp4_sharded"])
@pytest.mark.parametrize("comp", ["none", "full"])
def test_fused_modelopt_layers_on_the_simulated_kernels(name, comp, monkeypatch):
    registry = _record_launcher_pointers(monkeypatch)
    ck = load_checkpoint(MO / name)
    g = torch.Generator().manual_seed(0)
    for group, (sub, parts) in GROUPS.items():
        w = fuse_linears([ck.linears[f"model.layers.1.{sub}.{p}_proj"] for p in parts],
                         on_mismatch="error")
        layer = Linear(w, comp, device="cpu", dispatcher=_empty_dispatcher(),
                       compile_fn=_Compiles(registry), quantizer_fn=_quantizers([]))
        for m in (1, 4):
            x = (torch.randn(m, w.in_features, generator=g) * 2).to(torch.bfloat16)
            y = layer(x)
            ref = R.linear(x.float(), w, comp)
            assert y.shape == (m, w.out_features) and not bool(y.isnan().any())
            assert _rel(y, ref) <= 3e-3, (group, m, _rel(y, ref))
