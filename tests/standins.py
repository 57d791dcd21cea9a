"""The kernels' CPU simulations as resgen.ops objects, for tests above resgen.ops (custom ops,
nn modules, the transformers integration): the same stand-ins tests/test_ops.py uses.

linear:    resgen.ops.Linear with linear_sm90_wgmma's thread-level simulation for the compiled
           kernel and the quantizer's torch definition for quant_sm90 (tests/test_ops.py);
quantizer: resgen.ops.quantizer.LayerQuantizer with tests/test_quant_sm90.FakeCompiled (the
           device algorithms emulated at the raw addresses the launcher passes);
attention: resgen.ops.DecodeAttention with the lane-level emulator of the ResAttn kernel
           (resgen.kernels.attention_sm90_emu) for the bound kernel;
append:    resgen.ops.kv_append.KVAppend with the reference append (the kernel is bit-exact to
           it on the H200).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from resgen.kernels.linear_sm90_wgmma_sim import SimulatedKernel  # noqa: E402
from resgen.ops import DecodeAttention, Linear  # noqa: E402
from resgen.ops.cpu import ReferenceAppend  # noqa: E402
from resgen.ops.kv_append import KVAppend  # noqa: E402
from resgen.ops.quantizer import LayerQuantizer  # noqa: E402
from resgen.runtime import Device, Dispatcher  # noqa: E402
from resgen.search import linear_sm90_wgmma as LW  # noqa: E402

ARCH = "sm_90a"
WGMMA = LW.LinearSm90WgmmaVariant(1, 1, 16, 3)      # 64-channel tiles: N % 64 == 0


def empty_dispatcher() -> Dispatcher:
    return Dispatcher(paths=[], device=Device("NVIDIA H200", ARCH))


class _Compiles:
    def __init__(self):
        self.calls = []

    def __call__(self, fam, v, p, arch):
        assert fam.NAME == "linear_sm90_wgmma" and arch == ARCH
        self.calls.append(p.m)
        return SimulatedKernel(LW.geometry_of(v, p))


def _quantizer(p, arch):
    from test_linear_sm90_wgmma import _ReferenceQuantizer

    alpha = "none" if p.fmt == "mxfp4" else ("static" if p.static_scale else "dynamic")
    return _ReferenceQuantizer(p.fmt, p.compensation, alpha)


def linear(qweight, compensation="none", variant=WGMMA, **kw) -> Linear:
    """A Linear on the CPU with the wgmma simulation (pinned variant)."""
    return Linear(qweight, compensation, device="cpu", variant=variant, compile_fn=_Compiles(),
                  quantizer_fn=_quantizer, **kw)


def linear_kwargs(variant=WGMMA) -> dict:
    """Keyword arguments that make a Linear (or FP4Linear) run the simulation."""
    return dict(device="cpu", variant=variant, compile_fn=_Compiles(), quantizer_fn=_quantizer)


def quantizer(fmt, compensation, k, **kw) -> LayerQuantizer:
    from test_quant_sm90 import FakeCompiled

    from resgen.search.quant_sm90 import config_of

    return LayerQuantizer(fmt, compensation, k, device="cpu", dispatcher=empty_dispatcher(),
                          compile_fn=lambda fam, v, p, arch: FakeCompiled(config_of(v, p)), **kw)


def _emulated(compiled, v, p):
    from resgen.kernels.attention_sm90_emu import EmuConfig, emulate_decode_attention

    cfg = EmuConfig(compensation=p.compensation, packing=v.packing.value, pv=p.pv,
                    num_warps=v.num_warps, num_splits=v.splits, kc=v.kc)

    def op(q, cache, bt, sl, out=None, sm_scale=None):
        y = emulate_decode_attention(q.float(), cache, bt, sl, cfg, sm_scale).to(torch.bfloat16)
        if out is None:
            return y
        out.copy_(y)
        return out
    return op


def attention(q_heads, kv_heads, head_dim, page_size=16, **kw) -> DecodeAttention:
    return DecodeAttention(q_heads, kv_heads, head_dim, page_size,
                           dispatcher=empty_dispatcher(),
                           compile_fn=lambda f, v, p, a: object(), op_fn=_emulated, **kw)


def append(kv_heads, head_dim, page_size=16) -> KVAppend:
    return KVAppend(kv_heads, head_dim, page_size,
                    kernel_fn=lambda: ReferenceAppend(kv_heads, head_dim, page_size))
