"""The KV append (kv_append_sm90) as a run-time op: new tokens' K and V quantized to NVFP4
into their pages of a resgen.kvcache.PagedKVCache, in place.

    from resgen.ops.kv_append import KVAppend
    append = KVAppend(kv_heads=8, head_dim=128, page_size=32)
    append(cache, k, v, block_tables, positions)   # k, v: bf16 [T, Hkv, D]; positions [T, 2]

The kernel comes from the attention family (`bind_append`: compiled once per geometry and
process, and kept: a compiled kernel collected during a CUDA graph capture breaks the
capture) on the first call or `warmup()`; it is bit-exact to PagedKVCache.append, the
reference (tests/gpu/test_attention_sm90_gpu.py).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["KVAppend"]


class KVAppend:
    """Append to a paged NVFP4 KV cache of one geometry on the append kernel.

    kernel_fn: () -> callable(cache, k, v, block_tables, positions), building the kernel (the
    CPU tests pass the reference append, PagedKVCache.append, in its place).
    """

    def __init__(self, kv_heads: int, head_dim: int, page_size: int = 32, *,
                 arch: str = "sm_90a", kernel_fn: Callable[[], Any] | None = None) -> None:
        if kv_heads < 1 or head_dim % 16 or page_size < 1:
            raise ValueError(f"no append kernel for kv_heads {kv_heads}, head_dim {head_dim} "
                             f"(a multiple of 16), page_size {page_size}")
        self.kv_heads, self.head_dim, self.page_size = kv_heads, head_dim, page_size
        self.arch = arch
        self._make = kernel_fn or self._compile
        self._kernel: Any = None

    def _compile(self) -> Any:
        from ..search.family import get_family

        return get_family("attention_sm90").bind_append(self.head_dim, self.kv_heads,
                                                        self.page_size, self.arch)

    def warmup(self) -> Any:
        """Compile (and load) the kernel now, e.g. before CUDA graph capture."""
        if self._kernel is None:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("the KV append kernel is not built yet: call warmup() "
                                   "before capturing a CUDA graph")
            self._kernel = self._make()
        return self._kernel

    def __call__(self, cache: Any, k: torch.Tensor, v: torch.Tensor,
                 block_tables: torch.Tensor, positions: torch.Tensor) -> None:
        """k, v: bf16 [T, Hkv, D]; block_tables int32 [B, max_pages]; positions int32 [T, 2]
        rows of (sequence, token position). Writes the cache in place."""
        if (cache.num_kv_heads, cache.head_dim, cache.page_size) != (
                self.kv_heads, self.head_dim, self.page_size):
            raise ValueError(f"cache geometry (Hkv {cache.num_kv_heads}, D {cache.head_dim}, "
                             f"page {cache.page_size}) differs from this op's "
                             f"({self.kv_heads}, {self.head_dim}, {self.page_size})")
        if k.shape != v.shape or k.dim() != 3 or k.shape[1:] != (self.kv_heads, self.head_dim):
            raise ValueError(f"k and v must be [T, {self.kv_heads}, {self.head_dim}]")
        self.warmup()(cache, k, v, block_tables, positions)
