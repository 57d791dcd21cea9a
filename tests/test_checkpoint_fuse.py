"""fuse_linears: q/k/v -> qkv and gate/up -> gate_up, exact where the scales agree, and what
requantizing changes where they do not."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from resgen import formats, reference
from resgen.calibrate import prepare_weight, select_channels
from resgen.checkpoint import CheckpointError, fuse_linears, load_checkpoint

MO = Path(__file__).parent / "fixtures" / "modelopt"


@pytest.mark.parametrize("name", ["qwen3_nvfp4_fp8kv", "llama_mxfp4_sharded"])
@pytest.mark.parametrize("group", [("self_attn", "qkv"), ("mlp", ("gate", "up"))])
def test_fusing_a_modelopt_export_is_exact(name, group):
    ck = load_checkpoint(MO / name)
    sub, parts = group
    ws = [ck.linears[f"model.layers.1.{sub}.{p}_proj"] for p in parts]
    f = fuse_linears(ws, on_mismatch="error")       # ModelOpt shares the scales: no mismatch
    assert f.out_features == sum(w.out_features for w in ws)
    assert torch.equal(f.q.codes, torch.cat([w.q.codes for w in ws]))
    assert torch.equal(f.q.scales.view(torch.uint8),
                       torch.cat([w.q.scales.view(torch.uint8) for w in ws]))
    assert "requantized" not in f.meta and f.meta["fused_parts"] == str(len(ws))
    assert torch.equal(formats.dequantize(f.q), torch.cat([formats.dequantize(w.q) for w in ws]))
    # the fused layer computes exactly what the parts compute (same quantized activations)
    x = torch.randn(3, f.in_features, generator=torch.Generator().manual_seed(1))
    assert torch.equal(reference.linear(x, f), torch.cat([reference.linear(x, w) for w in ws], -1))


def _two(alpha_ratio: float, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(32, 64, generator=g)
    b = torch.randn(48, 64, generator=g) * alpha_ratio
    return prepare_weight(a, "nvfp4"), prepare_weight(b, "nvfp4")


def test_mismatched_tensor_scales_error_or_requantize():
    a, b = _two(0.37)
    assert not torch.equal(a.q.global_scale, b.q.global_scale)
    with pytest.raises(CheckpointError, match="unfused"):
        fuse_linears([a, b], on_mismatch="error")
    f = fuse_linears([a, b])
    assert torch.equal(f.q.global_scale, torch.maximum(a.q.global_scale, b.q.global_scale))
    assert f.meta["requantized"] == "1"
    # the part holding the larger scale keeps its bytes
    assert torch.equal(f.q.codes[:32], a.q.codes)
    assert torch.equal(f.q.scales[:32].view(torch.uint8), a.q.scales.view(torch.uint8))
    # the other is re-expressed under the shared scale: close, not exact
    exact = formats.dequantize(b.q)
    got = formats.dequantize(f.q)[32:]
    rel = float((got - exact).norm() / exact.norm())
    print(f"requantized part: relative change {rel:.3e} of its dequantized weight")
    assert 0 < rel < 0.1
    # ... and never worse than one FP4 step of its block: |change| <= d' * 2 (the widest gap)
    d_new = (f.q.global_scale * f.q.scales[32:].float()).repeat_interleave(16, -1)
    assert bool(((got - exact).abs() <= 2 * d_new + 1e-30).all())


def test_power_of_two_scale_ratio_requantizes_exactly():
    g = torch.Generator().manual_seed(3)
    a = torch.randn(32, 64, generator=g)
    a[0, 0] = 40.0                      # pin amax(a) so alpha_a / alpha_b is exactly 4
    b = a[16:].clone() / 4
    b[0, 0] = 10.0
    qa, qb = prepare_weight(a, "nvfp4"), prepare_weight(b, "nvfp4")
    assert float(qa.q.global_scale) == 4 * float(qb.q.global_scale)
    f = fuse_linears([qa, qb])
    assert f.meta["requantized"] == "1"
    assert torch.equal(formats.dequantize(f.q)[32:], formats.dequantize(qb.q))


def test_input_scales_kext_and_shape_checks():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 64, generator=g)
    a = prepare_weight(w[:32], "nvfp4", input_scale=0.01)
    b = prepare_weight(w[32:], "nvfp4", input_scale=0.02)
    b = type(b)(formats.QuantizedTensor("nvfp4", b.q.codes, b.q.scales, a.q.global_scale),
                b.in_features, None, b.input_scale)
    with pytest.raises(CheckpointError, match="input scales"):
        fuse_linears([a, b], on_mismatch="error")
    assert float(fuse_linears([a, b]).input_scale) == pytest.approx(0.02)
    sel = select_channels(torch.rand(64, generator=g), 0.25)
    other = select_channels(torch.rand(64, generator=g), 0.25)
    ka, kb = prepare_weight(w[:32], "mxfp4", sel), prepare_weight(w[32:], "mxfp4", sel)
    f = fuse_linears([ka, kb])
    assert f.selection is sel and f.q.shape == (64, 64 + 32)
    x = torch.randn(2, 64, generator=g)
    assert torch.equal(reference.linear(x, f, 0.25),
                       torch.cat([reference.linear(x, ka, 0.25), reference.linear(x, kb, 0.25)], -1))
    with pytest.raises(ValueError, match="selection"):
        fuse_linears([ka, prepare_weight(w[32:], "mxfp4", other)])
    with pytest.raises(ValueError, match="selection"):
        fuse_linears([ka, prepare_weight(w[32:], "mxfp4")])
    with pytest.raises(ValueError, match="format"):
        fuse_linears([prepare_weight(w, "nvfp4"), prepare_weight(w, "mxfp4")])
    with pytest.raises(ValueError, match="K="):
        fuse_linears([prepare_weight(w, "mxfp4"), prepare_weight(w[:, :32], "mxfp4")])
    with pytest.raises(ValueError, match="on_mismatch"):
        fuse_linears([a], on_mismatch="max")
    with pytest.raises(ValueError):
        fuse_linears([])
