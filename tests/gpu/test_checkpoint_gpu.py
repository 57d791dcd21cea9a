"""Imported checkpoints on the H200's real kernels (resgen.ops.Linear): every layer of a
checkpoint nvidia-modelopt wrote (tests/fixtures/modelopt/), fused q/k/v and gate/up, against
resgen.reference.linear on the same quantized weight (<= 3e-3 relative, no NaN); and a
Qwen3-8B-shaped q/k/v written by resgen's save_checkpoint, loaded, fused and served from the
shipped table (the fused shape is tuned; the parts' shapes are not)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from resgen import formats
from resgen import reference as R
from resgen.calibrate import prepare_weight, select_channels
from resgen.checkpoint import fuse_linears, load_checkpoint
from resgen.checkpoint.save import save_checkpoint
from resgen.ops import Linear

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
MO = Path(__file__).resolve().parent.parent / "fixtures" / "modelopt"
GROUPS = {"qkv": ("self_attn", "qkv"), "o": ("self_attn", "o"),
          "gate_up": ("mlp", ("gate", "up")), "down": ("mlp", ("down",))}


def _rel(y, ref):
    return float((y.float() - ref).norm() / ref.norm())


@pytest.mark.parametrize("name, comp", [("qwen3_nvfp4_fp8kv", "none"),
                                        ("qwen3_nvfp4_fp8kv", "full"),
                                        ("llama_mxfp4_sharded", "full")])
def test_modelopt_checkpoint_layers_on_the_kernels(name, comp):
    ck = load_checkpoint(MO / name)
    for group, (sub, parts) in GROUPS.items():
        w = fuse_linears([ck.linears[f"model.layers.0.{sub}.{p}_proj"] for p in parts],
                         on_mismatch="error")
        layer = Linear(w, comp)
        for m in (1, 7):
            x = (torch.randn(m, w.in_features, device="cuda") * 2).to(torch.bfloat16)
            y = layer(x)
            ref = R.linear(x.float(), w, comp)
            assert not bool(y.isnan().any())
            assert _rel(y, ref) <= 3e-3, (group, m, layer.plan(m).variant.name(), _rel(y, ref))


def test_fused_qwen3_8b_qkv_from_a_checkpoint_hits_the_tuned_table(tmp_path):
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(n, 4096, generator=g) * s for n, s in ((4096, 1.0), (1024, 0.6),
                                                              (1024, 0.8))]
    alpha = formats.nvfp4_global_scale(torch.stack([w.abs().amax() for w in ws]))
    isc = torch.tensor(4.0 / (6 * 448))
    sel = select_channels(torch.rand(4096, generator=g), 0.25)
    names = [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]
    for sub, selection in (("plain", None), ("kext", sel)):
        lin = {n: prepare_weight(w, "nvfp4", selection, input_scale=isc, global_scale=alpha)
               for n, w in zip(names, ws)}
        save_checkpoint(tmp_path / sub, config={"model_type": "qwen3"}, linears=lin, tensors={})
        ck = load_checkpoint(tmp_path / sub)
        fused = fuse_linears([ck.linears[n] for n in names], on_mismatch="error")
        assert fused.out_features == 6144 and "requantized" not in fused.meta
        for comp in (("none", "full") if selection is None else (0.25,)):
            layer = Linear(fused, comp)
            for m in (1, 16):
                x = (torch.randn(m, 4096, device="cuda") * 3).to(torch.bfloat16)
                y = layer(x)
                ref = R.linear(x.float(), fused, comp)
                assert not bool(y.isnan().any()) and _rel(y, ref) <= 3e-3
                print(f"{sub} {comp} M={m}: {layer.plan(m).source} "
                      f"{layer.plan(m).variant.name()} rel {_rel(y, ref):.2e}")
                if comp in ("none", "full"):
                    assert layer.plan(m).source != "default", layer.plan(m).source
