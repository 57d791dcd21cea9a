"""The engine's KV caches, their sizing and the request check.

    NVFP4  one resgen.kvcache.PagedKVCache per layer (the append kernel's and the attention
           kernels' layout), all layers sharing one page numbering and one block table per
           sequence; page 0 is a scratch page that padded batch rows write into.
    dense  BF16 (or FP32 for the reference engine) K and V per layer, [rows, max_len, Hkv, D]:
           one row per batch slot, read by decode attention up to each row's length.

Sizing: an explicit byte budget, or a fraction of the GPU's free memory after the weights
(`budget_from_free`). A request (prompt lengths + max_new_tokens) that does not fit raises
KVBudgetError (a ValueError) naming what it needs and what the cache holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kvcache import PagedKVCache

__all__ = ["KVBudgetError", "bytes_per_token", "PagedKV", "DenseKV", "budget_from_free"]

SCRATCH_PAGE = 0


class KVBudgetError(ValueError):
    """A request needs more KV cache than the engine holds."""


def bytes_per_token(layers: int, kv_heads: int, head_dim: int, kind: str) -> int:
    """Bytes one token's K and V take over all layers: NVFP4 (codes + E4M3 block scales),
    BF16 or FP32."""
    per = {"nvfp4": head_dim // 2 + head_dim // 16, "bf16": 2 * head_dim,
           "fp32": 4 * head_dim}[kind]
    return 2 * layers * kv_heads * per


def budget_from_free(fraction: float, device: torch.device) -> int:
    """`fraction` of the GPU's free memory now (after the weights are loaded), in bytes."""
    if device.type != "cuda":
        raise ValueError("sizing the KV cache from free memory needs a CUDA device; give "
                         "kv_budget= (bytes) on the CPU")
    free, _ = torch.cuda.mem_get_info(device)
    return int(free * fraction)


@dataclass
class PagedKV:
    """NVFP4 paged caches of all layers and their page allocator."""

    caches: list[PagedKVCache]
    page_size: int
    num_pages: int

    kind = "nvfp4"

    @classmethod
    def create(cls, layers: int, kv_heads: int, head_dim: int, budget: int, page_size: int,
               device: torch.device, kv_scales: dict[int, tuple[float, float]] | None = None
               ) -> "PagedKV":
        per_page = bytes_per_token(layers, kv_heads, head_dim, "nvfp4") * page_size
        pages = budget // per_page
        if pages < 2:
            raise KVBudgetError(f"a KV budget of {budget} bytes holds {pages} pages of "
                                f"{page_size} tokens ({per_page} bytes each over {layers} "
                                "layers); at least 2 are needed (one is the scratch page)")
        scales = kv_scales or {}
        caches = [PagedKVCache.empty(int(pages), kv_heads, head_dim, page_size,
                                     *scales.get(i, (1.0, 1.0)), device=device)
                  for i in range(layers)]
        kv = cls(caches, page_size, int(pages))
        kv.reset()
        return kv

    def reset(self) -> None:
        self.free = list(range(self.num_pages - 1, SCRATCH_PAGE, -1))

    @property
    def capacity_tokens(self) -> int:
        return (self.num_pages - 1) * self.page_size

    def pages_for(self, tokens: int) -> int:
        return max(1, -(-tokens // self.page_size))

    def allocate(self, lengths: list[int]) -> list[list[int]]:
        """Pages for sequences of these total lengths (prompt + new tokens); raises
        KVBudgetError when they do not fit (nothing is taken then)."""
        need = [self.pages_for(n) for n in lengths]
        if sum(need) > len(self.free):
            raise KVBudgetError(
                f"{len(lengths)} sequences of {sum(lengths)} tokens (prompt + max_new_tokens) "
                f"need {sum(need)} KV pages of {self.page_size} tokens; the NVFP4 cache has "
                f"{len(self.free)} free of {self.num_pages - 1} ({self.capacity_tokens} "
                "tokens): shorten the prompts or max_new_tokens, batch fewer prompts, or "
                "raise kv_budget")
        return [[self.free.pop() for _ in range(n)] for n in need]

    def release(self, pages: list[list[int]]) -> None:
        for p in pages:
            self.free.extend(reversed(p))


@dataclass
class DenseKV:
    """Dense K and V per layer: [rows, max_len, Hkv, D] in `dtype`."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    rows: int
    max_len: int

    @property
    def kind(self) -> str:
        return "bf16" if self.k[0].dtype == torch.bfloat16 else "fp32"

    @classmethod
    def create(cls, layers: int, kv_heads: int, head_dim: int, budget: int, rows: int,
               max_len: int, dtype: torch.dtype, device: torch.device) -> "DenseKV":
        kind = "bf16" if dtype == torch.bfloat16 else "fp32"
        per_tok = bytes_per_token(layers, kv_heads, head_dim, kind)
        fit = budget // (per_tok * rows)
        if fit < 1:
            raise KVBudgetError(f"a KV budget of {budget} bytes holds no token for {rows} "
                                f"rows ({per_tok} bytes per token in {kind})")
        max_len = int(min(max_len, fit))
        shape = (rows, max_len, kv_heads, head_dim)
        k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        return cls(k, v, rows, max_len)

    @property
    def capacity_tokens(self) -> int:
        return self.rows * self.max_len

    def check(self, lengths: list[int]) -> None:
        if len(lengths) > self.rows:
            raise KVBudgetError(f"{len(lengths)} sequences in one batch; the dense KV cache "
                                f"has {self.rows} rows (max_batch)")
        worst = max(lengths)
        if worst > self.max_len:
            raise KVBudgetError(f"a sequence of {worst} tokens (prompt + max_new_tokens) does "
                                f"not fit the dense KV cache's {self.max_len} tokens per row: "
                                "shorten it or raise kv_budget")
