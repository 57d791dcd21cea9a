"""The ops say at construction that they need a CUDA GPU of a supported arch (issue 22 items
10 and 15): without one, on a CPU device, or on a GPU whose compute capability cannot run the
sm_90a kernels; the CPU tests' simulations (compile_fn / quantizer_fn / op_fn stand-ins) are
exempt and keep building on the CPU."""

from __future__ import annotations

import pytest
import torch

import resgen.ops.common as OC
from resgen.calibrate import prepare_weight
from resgen.ops import DecodeAttention, FP4Linear, Linear
from resgen.ops.common import UnsupportedDeviceError, require_cuda_device


def _qw():
    return prepare_weight(torch.randn(64, 256), "nvfp4")


def _no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def _fake_gpu(monkeypatch, cap, name):
    OC._CHECKED.clear()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: cap)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: name)


@pytest.mark.parametrize("build", [
    lambda: Linear(_qw(), "full"),
    lambda: Linear(_qw(), "none", device="cpu"),
    lambda: DecodeAttention(8, 2, 64),
    lambda: FP4Linear.from_linear(torch.nn.Linear(256, 64), "nvfp4", "full"),
], ids=["Linear", "Linear-cpu", "DecodeAttention", "FP4Linear"])
def test_no_gpu_is_said_at_construction(monkeypatch, build):
    _no_cuda(monkeypatch)
    with pytest.raises(UnsupportedDeviceError, match=r"needs a CUDA GPU \(sm_90a: Hopper.*H200"):
        build()


def test_a_cpu_device_is_refused_even_with_a_gpu(monkeypatch):
    _fake_gpu(monkeypatch, (9, 0), "NVIDIA H200")
    with pytest.raises(UnsupportedDeviceError, match="got device 'cpu'"):
        require_cuda_device("cpu", "sm_90a", what="resgen.ops.Linear")


def test_an_unsupported_gpu_is_named(monkeypatch):
    _fake_gpu(monkeypatch, (8, 0), "NVIDIA A100-SXM4-80GB")
    with pytest.raises(UnsupportedDeviceError, match=r"A100.*compute capability 8\.0.*sm_90a"):
        Linear(_qw(), "none")
    with pytest.raises(UnsupportedDeviceError, match="no kernels for arch 'sm_100a'"):
        require_cuda_device(None, "sm_100a")
    _fake_gpu(monkeypatch, (9, 0), "NVIDIA H200")
    assert require_cuda_device(None, "sm_90a") == torch.device("cuda", 0)
    assert require_cuda_device("cuda", "sm_90a") == torch.device("cuda", 0)


def test_simulations_still_build_on_the_cpu(monkeypatch):
    _no_cuda(monkeypatch)
    layer = Linear(_qw(), "none", compile_fn=lambda *a: None, quantizer_fn=lambda *a: None)
    assert layer.device == torch.device("cpu")
    DecodeAttention(8, 2, 64, compile_fn=lambda *a: object(), op_fn=lambda *a: None)
