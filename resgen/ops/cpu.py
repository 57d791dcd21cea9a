"""CPU stand-ins with the run-time ops' call contracts, computed by resgen.reference (the
oracle every kernel is checked against): run a quantized model's numerics where no H200 is,
and stand in for the kernels in CPU tests of everything above resgen.ops.

    ReferenceLinear(qweight, comp)   like resgen.ops.Linear: bf16 [..., K] -> bf16 [..., N],
                                     also "w4a16" (resgen.reference.linear_w4a16)
    ReferenceAttention(hq, hkv, d)   like resgen.ops.DecodeAttention (reference.decode_attention,
                                     FP16-rounded P as the kernels' "f16" PV)
    ReferenceAppend(hkv, d, page)    like resgen.ops.kv_append.KVAppend (PagedKVCache.append)

The kernels equal these up to summation order (linear and attention within the families'
3e-3 relative tolerance, the append bit for bit); these are exact, so they are slower (float64
products) and carry no plans, variants or compiled code.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from .. import reference as R
from ..calibrate import QLinearWeight

__all__ = ["ReferenceLinear", "ReferenceAttention", "ReferenceAppend"]


class ReferenceLinear:
    """y = bf16(reference.linear(x, qweight, compensation)); compensation "none" | "full" |
    a K-Ext ratio | "w4a16"."""

    def __init__(self, qweight: QLinearWeight, compensation: str | float = "none", *,
                 device: torch.device | str = "cpu") -> None:
        if compensation == "w4a16":
            comp: Any = "w4a16"
        elif compensation in ("none", "full"):
            comp = compensation
        else:
            comp = float(compensation)
            R.check_compensation(comp, qweight)
        self.compensation = comp if isinstance(comp, str) else str(comp)
        self._comp = comp
        self.device = torch.device(device)
        self.qweight = qweight
        self.fmt = qweight.fmt
        self.k, self.n = qweight.in_features, qweight.out_features
        # the dequantized weight without its global scale, kept (exact in FP32: E2M1 x E4M3
        # or x 2^e products): dequantizing per call dominated the CPU cost of a whole model
        from .. import formats

        self._unit = formats.dequantize(qweight.q, apply_global_scale=False).float()

    def warmup(self, ms: Iterable[int]) -> list:
        return []

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16:
            raise TypeError(f"expected bfloat16 activations, got "
                            f"{getattr(x, 'dtype', type(x).__name__)}")
        if x.dim() < 1 or x.shape[-1] != self.k:
            raise ValueError(f"activations of shape {tuple(x.shape)}: the last dimension must "
                             f"be K = {self.k}")
        if x.numel() == 0:
            return x.new_empty((*x.shape[:-1], self.n))
        if self._comp == "w4a16":
            y = R.linear_w4a16(x.float(), self.qweight, weight_unit=self._unit)
        else:
            y = R.linear(x.float(), self.qweight, self._comp, weight_unit=self._unit)
        return y.to(torch.bfloat16)


class ReferenceAttention:
    """Decode attention over a paged NVFP4 cache by resgen.reference.decode_attention."""

    def __init__(self, q_heads: int, kv_heads: int, head_dim: int, page_size: int = 32, *,
                 compensation: bool | None = None, pv: str = "f16",
                 query: str = "nvfp4") -> None:
        if kv_heads < 1 or q_heads % kv_heads:
            raise ValueError(f"q_heads = {q_heads} must be a positive multiple of kv_heads = "
                             f"{kv_heads}")
        if pv not in ("f16", "fp8"):
            raise ValueError(f"pv must be 'f16' or 'fp8', got {pv!r}")
        self.q_heads, self.kv_heads, self.head_dim = q_heads, kv_heads, head_dim
        if query not in ("nvfp4", "q16"):
            raise ValueError(f"query must be 'nvfp4' or 'q16', got {query!r}")
        if compensation is None:
            compensation = query == "nvfp4"
        self.page_size, self.compensation, self.pv = page_size, bool(compensation), pv
        self.query = query

    def warmup(self, shapes: Iterable[tuple[int, int]]) -> list:
        return []

    def __call__(self, q: torch.Tensor, cache: Any, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, *, max_kv_len: int | None = None,
                 out: torch.Tensor | None = None, sm_scale: float | None = None
                 ) -> torch.Tensor:
        if not isinstance(q, torch.Tensor) or q.dim() != 3 or q.shape[1:] != (
                self.q_heads, self.head_dim):
            raise ValueError(f"q must be [B, {self.q_heads}, {self.head_dim}]")
        y = R.decode_attention(q.float(), cache, block_tables, seq_lens,
                               compensation=self.compensation, pv=self.pv,
                               sm_scale=sm_scale, query=self.query).to(torch.bfloat16)
        if out is None:
            return y
        out.copy_(y)
        return out


class ReferenceAppend:
    """The reference append (PagedKVCache.append), with KVAppend's call contract."""

    def __init__(self, kv_heads: int, head_dim: int, page_size: int = 32) -> None:
        self.kv_heads, self.head_dim, self.page_size = kv_heads, head_dim, page_size

    def warmup(self) -> None:
        return None

    def __call__(self, cache: Any, k: torch.Tensor, v: torch.Tensor,
                 block_tables: torch.Tensor, positions: torch.Tensor) -> None:
        if k.shape != v.shape or k.dim() != 3 or k.shape[1:] != (self.kv_heads, self.head_dim):
            raise ValueError(f"k and v must be [T, {self.kv_heads}, {self.head_dim}]")
        if k.shape[0]:
            cache.append(k.float(), v.float(), block_tables, positions)
