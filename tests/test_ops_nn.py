"""FP4Linear as a real nn.Module on the CPU (the kernels' simulations stand in, as in
tests/test_ops.py): its buffers carry the quantized weight through state_dict /
load_state_dict / safetensors / .to() / deepcopy, the state-dict names are save_layers' (the
ModelOpt layout), and torch.compile traces it whole."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import standins as S  # noqa: E402
from fakefam import isolated_cache  # noqa: E402,F401
from test_linear_sm90_wgmma import _qweight  # noqa: E402

from resgen import reference as R  # noqa: E402
from resgen.calibrate import save_layers  # noqa: E402
from resgen.ops import custom  # noqa: E402
from resgen.ops.nn import FP4Linear  # noqa: E402

pytestmark = pytest.mark.usefixtures("isolated_cache")
CASES = [("nvfp4", "full", True), ("mxfp4", "none", False), ("nvfp4", "0.25", False)]


def _module(fmt, comp, static, bias=True, backend="kernels"):
    ratio = None if comp in ("none", "full") else float(comp)
    qw = _qweight(fmt, ratio=ratio, static=static)
    b = torch.randn(128, generator=torch.Generator().manual_seed(3)) if bias else None
    kw = S.linear_kwargs() if backend == "kernels" else {}
    return FP4Linear(qw, comp, b, backend=backend, name="layers.0.mlp.up_proj", **kw), qw


def _x(seed=0, m=3):
    return torch.randn(m, 512, generator=torch.Generator().manual_seed(seed)) * 2


@pytest.mark.parametrize("fmt, comp, static", CASES)
def test_state_dict_round_trip(fmt, comp, static, tmp_path):
    mod, qw = _module(fmt, comp, static)
    sd = mod.state_dict()
    want = {"weight", "weight_scale", "bias"}
    want |= {"weight_scale_2"} if fmt == "nvfp4" else set()
    want |= {"input_scale"} if static else set()
    want |= {"resgen_channel_mask", "resgen_ratio"} if comp == "0.25" else set()
    assert set(sd) == want
    # the names and tensors are save_layers' (ModelOpt's layout + resgen's fields)
    from safetensors.torch import load_file, save_file

    save_layers(tmp_path / "l.safetensors", {"m": qw})
    layers = load_file(tmp_path / "l.safetensors")
    for k, t in sd.items():
        if k != "bias":
            a, b = layers[f"m.{k}"], t
            assert a.dtype == b.dtype and a.shape == b.shape, k
            assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), k
    # through a file into an empty module of the same configuration
    save_file(sd, tmp_path / "sd.safetensors")
    fresh = FP4Linear.empty(512, 128, fmt, comp, ratio=None if comp == "none" or comp == "full"
                            else float(comp), static_scale=static, bias=True,
                            **S.linear_kwargs())
    x = _x(1)
    y0 = fresh(x)
    assert float(y0.abs().max()) < float(mod(x).abs().max())      # zeros + bias 0
    fresh.load_state_dict(load_file(tmp_path / "sd.safetensors"))
    assert torch.equal(fresh(x), mod(x))
    ref = R.linear(x.to(torch.bfloat16).float(), qw, comp if comp in ("none", "full")
                   else float(comp)) + mod.bias
    assert float((mod(x) - ref).norm() / ref.norm()) <= 3e-3


def test_to_dtype_keeps_the_format_and_rebuilds_the_op():
    mod, _ = _module("nvfp4", "full", True)
    x = _x(2)
    y = mod(x)
    h0 = mod.handle
    mod.to(torch.bfloat16)
    assert mod.weight_scale.dtype == torch.float8_e4m3fn
    assert mod.weight_scale_2.dtype == torch.float32 and mod.bias.dtype == torch.float32
    assert mod.handle != h0 and mod.handle in custom.handles()
    assert torch.equal(mod(x), y)
    mod.half()
    assert mod(x.half()).dtype == torch.float16 and mod.weight.dtype == torch.uint8
    mod.to("meta")
    assert mod.weight.device.type == "meta" and mod.op is None


def test_deepcopy_builds_its_own_op():
    mod, _ = _module("mxfp4", "none", False)
    twin = copy.deepcopy(mod)
    assert twin.handle != mod.handle and twin.op is not mod.op
    x = _x(4)
    assert torch.equal(twin(x), mod(x))


def test_load_state_dict_rejects_a_foreign_layout():
    mod, _ = _module("nvfp4", "none", False)
    sd = mod.state_dict()
    sd["weight_scale"] = sd["weight_scale"].view(torch.uint8)
    before = mod.weight_scale.clone()
    with pytest.raises(RuntimeError, match="weight_scale: dtype torch.uint8"):
        mod.load_state_dict(sd)
    assert torch.equal(mod.weight_scale.view(torch.uint8), before.view(torch.uint8))
    other, _ = _module("nvfp4", "none", True)
    with pytest.raises(RuntimeError, match="input_scale"):
        mod.load_state_dict(other.state_dict())


def test_reference_backend_and_w4a16():
    mod, qw = _module("nvfp4", "full", True, backend="reference")
    x = _x(5)
    ref = R.linear(x.to(torch.bfloat16).float(), qw, "full") + mod.bias
    torch.testing.assert_close(mod(x), ref, rtol=1e-2, atol=1e-2 * float(ref.abs().max()))
    w16 = FP4Linear(qw, "w4a16", backend="reference")
    want = R.linear_w4a16(x.to(torch.bfloat16).float(), qw).to(torch.bfloat16).float()
    assert torch.equal(w16(x), want)
    # the kernels backend serves W4A16 too (tests/test_w4a16.py): within the BF16 tolerance
    served = FP4Linear(qw, "w4a16", **S.linear_kwargs())(x)
    assert float((served - want).norm() / want.norm()) <= 3e-3
    with pytest.raises(ValueError, match="backend"):
        FP4Linear(qw, "none", backend="triton")


def test_fp4linear_compiles_whole():
    mod, _ = _module("nvfp4", "0.25", False)
    seq = torch.nn.Sequential(mod, torch.nn.GELU())
    x = _x(6)
    eager = seq(x)
    assert torch.equal(torch.compile(seq, backend="aot_eager", fullgraph=True)(x), eager)


def test_a_kernels_module_on_the_cpu_waits_for_the_gpu():
    """from_pretrained loads on the CPU and .cuda() follows: a kernels-backed FP4Linear whose
    buffers are on the CPU builds no op (no error at load), and calling it says to move the
    model to the GPU instead of running anything."""
    mod = FP4Linear.empty(64, 32, "nvfp4", "none", backend="kernels", name="layer.q")
    assert mod.op is None and mod.handle == ""
    with pytest.raises(RuntimeError, match=r"layer\.q: backend 'kernels' runs on a CUDA GPU.*"
                                           r"model\.cuda\(\)"):
        mod(torch.zeros(2, 64, dtype=torch.bfloat16))
