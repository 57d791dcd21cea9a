"""What runs the engine's FP4 linears, KV appends and decode attention.

    "cuda"       the tuned kernels: resgen.ops.Linear (quantizer + GEMM from the dispatch
                 table, the family default with its one-time warning where the table has no
                 row), resgen.ops.DecodeAttention (ResAttn / plain NVFP4-KV) and the compiled
                 NVFP4 append kernel (resgen.kernels.attention_sm90.KVAppendSm90).
    "sim"        the same resgen.ops path on the CPU with the kernels' simulations standing in
                 for the GPU (as tests/test_ops.py does): linear_sm90_wgmma's thread-level
                 simulation (resgen.kernels.linear_sm90_wgmma_sim) behind the quantizer's torch
                 definition (resgen.kernels.quant_sm90.operand_reference); attention and append
                 from resgen.reference / PagedKVCache.append with the kernels' call contracts
                 (bf16, contiguous, int32 positions) asserted. Slow: small models only.
    "reference"  the fake-quant numerics of the CPU quality study (resgen.quality.fakequant:
                 weights dequantized once, activations quantize-dequantized in FP32, FP32
                 products), the reference append and resgen.reference.decode_attention. With
                 io="bf16" its linears take and return BF16-rounded values (the kernels'
                 interface); io="fp32" is the quality study's own FP32 model exactly.

Every backend's linear maps x [M, K] (its `io_dtype`) -> [M, N] and has warmup(ms); its
attention has the DecodeAttention call (q [B, Hq, D], cache, block_tables, seq_lens,
max_kv_len=, out=) and warmup([(batch, kv_len)]).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..calibrate import QLinearWeight

__all__ = ["BACKENDS", "Backend", "make_backend"]

BACKENDS = ("cuda", "sim", "reference")


class Backend:
    """The ops of one backend on one device (see the module docstring)."""

    name = "base"
    io_dtype = torch.bfloat16

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def linear(self, qweight: QLinearWeight, compensation: str | float,
               fold: str = "exact") -> Any:
        """The FP4 linear op of one projection; fold: a K-Ext layer's fold ("exact" |
        "presum": resgen.ops.Linear)."""
        raise NotImplementedError

    def attention(self, q_heads: int, kv_heads: int, head_dim: int, page_size: int,
                  compensation: bool, query: str = "nvfp4") -> Any:
        """The paged decode attention op: ResAttn (compensation), plain, or Q16 (query
        "q16": the FP16 query, compensation False)."""
        raise NotImplementedError

    def append(self, head_dim: int, kv_heads: int, page_size: int
               ) -> Callable[..., None]:
        raise NotImplementedError


class CudaBackend(Backend):
    name = "cuda"

    def linear(self, qweight: QLinearWeight, compensation: str | float,
               fold: str = "exact") -> Any:
        from ..ops import Linear

        return Linear(qweight, compensation, fold=fold, device=self.device)

    def attention(self, q_heads, kv_heads, head_dim, page_size, compensation, query="nvfp4"):
        from ..ops import DecodeAttention

        return DecodeAttention(q_heads, kv_heads, head_dim, page_size,
                               compensation=compensation, query=query)

    def append(self, head_dim, kv_heads, page_size):
        from ..kernels.attention_sm90 import KVAppendSm90, compile_append

        res, _ = compile_append(head_dim, kv_heads, page_size)     # raises if it fails
        return KVAppendSm90(res.fn, head_dim, kv_heads, page_size)


class _QuantizerStandIn:
    """A compiled quant_sm90 quantizer's stand-in: its operand from the quantizer's torch
    definition (resgen.kernels.quant_sm90.operand_reference, K padded to 256 as the linear
    families read it)."""

    class _Operand:
        def __init__(self, xop: torch.Tensor, alpha: torch.Tensor) -> None:
            self.xop, self.alpha = xop, alpha

    def __init__(self, fmt: str, compensation: str, alpha_mode: str,
                 layout: str | None = None) -> None:
        self.fmt, self.compensation = fmt, compensation
        from ..kernels.sm90_operand import xop_layout_for

        self.layout = layout or xop_layout_for(compensation)
        self.config = type("QuantConfig", (), {"alpha": alpha_mode, "layout": self.layout})()

    def outputs(self, m: int, row_multiple: int = 1, device: Any = "cpu") -> dict:
        return {"row_multiple": row_multiple}

    def __call__(self, x: torch.Tensor, outs: dict, alpha: torch.Tensor | None = None,
                 masks: torch.Tensor | None = None) -> "_QuantizerStandIn._Operand":
        from ..kernels.quant_sm90 import operand_reference

        if x.dtype != torch.bfloat16 or not x.is_contiguous():
            raise AssertionError("the quantizer takes contiguous bf16 activations")
        op = operand_reference(x, self.fmt, self.compensation, self.layout, outs["row_multiple"],
                               None if alpha is None else alpha.reshape(()), masks, 256)
        return self._Operand(op.xop, op.alpha)


def _sim_quantizer(p: Any, arch: str, layout: str | None = None) -> _QuantizerStandIn:
    alpha = "none" if p.fmt == "mxfp4" else ("static" if p.static_scale else "dynamic")
    return _QuantizerStandIn(p.fmt, p.compensation, alpha, layout)


def _sim_compile(fam: Any, v: Any, p: Any, arch: str) -> Any:
    from ..kernels.linear_sm90_wgmma_sim import SimulatedKernel
    from ..search import linear_sm90_wgmma as LW

    if fam.NAME != "linear_sm90_wgmma":
        raise ValueError(f"the sim backend simulates linear_sm90_wgmma, not {fam.NAME}")
    return SimulatedKernel(LW.geometry_of(v, p),
                           torch.float16 if v.presum else torch.bfloat16)


def _empty_dispatcher() -> Any:
    """A dispatcher with no tables: every lookup is the family default (no warning spam in
    the tests: the runtime warns once per bucket)."""
    from ..runtime import Device, Dispatcher

    return Dispatcher(paths=[], device=Device("NVIDIA H200", "sm_90a"))


class _RefAttention:
    """DecodeAttention's call on resgen.reference.decode_attention (FP32-exact P V, the
    kernels' f16 P is inside their tolerance), with the kernel's input contract checked."""

    def __init__(self, compensation: bool, io_dtype: torch.dtype, check_contract: bool,
                 query: str = "nvfp4") -> None:
        self.compensation, self.io_dtype = compensation, io_dtype
        self.check = check_contract
        self.query = query

    def warmup(self, shapes: Any) -> list:
        return []

    def __call__(self, q: torch.Tensor, cache: Any, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, *, max_kv_len: int | None = None,
                 out: torch.Tensor | None = None, sm_scale: float | None = None
                 ) -> torch.Tensor:
        from .. import reference as R

        if self.check:
            if q.dtype != torch.bfloat16 or not q.is_contiguous():
                raise AssertionError("the attention kernel takes a contiguous bf16 q")
            if block_tables.dtype != torch.int32 or seq_lens.dtype != torch.int32:
                raise AssertionError("block_tables and seq_lens must be int32")
        y = R.decode_attention(q.float(), cache, block_tables, seq_lens,
                               compensation=self.compensation, pv="fp32",
                               sm_scale=sm_scale, query=self.query).to(self.io_dtype)
        if out is None:
            return y
        out.copy_(y)
        return out


def _ref_append(check_contract: bool) -> Callable[..., None]:
    def append(cache: Any, k: torch.Tensor, v: torch.Tensor, block_tables: torch.Tensor,
               positions: torch.Tensor) -> None:
        if check_contract:
            if k.dtype != torch.bfloat16 or v.dtype != torch.bfloat16:
                raise AssertionError("the append kernel takes bf16 k and v")
            if not (k.is_contiguous() and v.is_contiguous()):
                raise AssertionError("the append kernel takes contiguous k and v")
            if positions.dtype != torch.int32 or block_tables.dtype != torch.int32:
                raise AssertionError("positions and block_tables must be int32")
        cache.append(k.float(), v.float(), block_tables, positions.long())
    return append


class SimBackend(Backend):
    name = "sim"

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.dispatcher = _empty_dispatcher()       # one: the default is warned once per bucket

    def linear(self, qweight, compensation, fold="exact"):
        from ..ops import Linear

        return Linear(qweight, compensation, fold=fold, device=self.device,
                      family="linear_sm90_wgmma", dispatcher=self.dispatcher,
                      compile_fn=_sim_compile, quantizer_fn=_sim_quantizer)

    def attention(self, q_heads, kv_heads, head_dim, page_size, compensation, query="nvfp4"):
        from ..ops import DecodeAttention

        # the op's planning runs (geometry check, dispatch per batch / KV class); the
        # reference stands in for the compiled kernel
        op = DecodeAttention(q_heads, kv_heads, head_dim, page_size,
                             compensation=compensation, query=query,
                             dispatcher=self.dispatcher, compile_fn=lambda f, v, p, a: None,
                             op_fn=lambda c, v, p: _RefAttention(p.compensation,
                                                                 torch.bfloat16, True,
                                                                 p.query))
        return op

    def append(self, head_dim, kv_heads, page_size):
        return _ref_append(True)


class _FakeQuantOp:
    """resgen.quality.fakequant.FakeQuantLinear as a backend linear: x [M, K] -> [M, N];
    io "bf16" rounds the output to BF16 like the kernels (the input arrives rounded)."""

    def __init__(self, qweight: QLinearWeight, compensation: str | float, io: str,
                 device: torch.device, fold: str = "exact") -> None:
        from ..quality.fakequant import FakeQuantLinear
        from .fakequant_ref import fakequant_args

        qweight, comp = fakequant_args(qweight, compensation)
        self.qweight, self.compensation = qweight, comp
        self.mod = FakeQuantLinear(qweight, comp, fold=fold).to(device)
        if isinstance(self.mod.input_scale, torch.Tensor):
            self.mod.input_scale = self.mod.input_scale.to(device)
        self.io = io
        self.k, self.n = qweight.in_features, qweight.out_features

    def warmup(self, ms: Any) -> list:
        return []

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.mod(x.float())
        return y.to(torch.bfloat16) if self.io == "bf16" else y


class ReferenceBackend(Backend):
    name = "reference"

    def __init__(self, device: torch.device, io: str = "bf16") -> None:
        super().__init__(device)
        if io not in ("bf16", "fp32"):
            raise ValueError(f"io must be 'bf16' or 'fp32', got {io!r}")
        self.io = io
        self.io_dtype = torch.bfloat16 if io == "bf16" else torch.float32

    def linear(self, qweight, compensation, fold="exact"):
        return _FakeQuantOp(qweight, compensation, self.io, self.device, fold)

    def attention(self, q_heads, kv_heads, head_dim, page_size, compensation, query="nvfp4"):
        return _RefAttention(compensation, self.io_dtype, False, query)

    def append(self, head_dim, kv_heads, page_size):
        return _ref_append(False)


def make_backend(name: str, device: torch.device | str | None = None, io: str = "bf16"
                 ) -> Backend:
    """The backend `name` (BACKENDS) on `device` (cuda: the current GPU; others: CPU)."""
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    if name == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("backend 'cuda' needs a CUDA GPU (use backend='sim' or "
                               "'reference' on the CPU)")
        dev = torch.device(device) if device is not None else torch.device(
            "cuda", torch.cuda.current_device())
        if dev.type != "cuda":
            raise ValueError(f"backend 'cuda' runs on a CUDA device, not {dev}")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        return CudaBackend(dev)
    dev = torch.device(device or "cpu")
    if name == "sim":
        if dev.type != "cpu":
            raise ValueError("backend 'sim' runs on the CPU")
        return SimBackend(dev)
    return ReferenceBackend(dev, io)
