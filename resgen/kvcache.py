"""Paged NVFP4 KV cache: the layout, a reference append, and memory accounting.

Layout ("HND", one page holds `page_size` consecutive tokens of every KV head):
    k_codes, v_codes:   uint8              [num_pages, Hkv, page_size, D // 2]
    k_sf, v_sf:         float8_e4m3fn      [num_pages, Hkv, page_size, D // 16]
    k_scale, v_scale:   float32 0-dim      per-tensor NVFP4 global scales (1.0 by default, as in
                                           the paper's runs, or calibrated)
Each token's head vector of D values is quantized as D // 16 NVFP4 blocks along the head
dimension (the QK reduction dimension), with the static global scale.
block_tables: int32 [B, max_pages] maps a sequence's logical page i to a physical page.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import formats

__all__ = ["PagedKVCache", "kv_bytes_per_token"]


def kv_bytes_per_token(num_kv_heads: int, head_dim: int, fmt: str = "nvfp4") -> dict[str, float]:
    """Bytes one token occupies in the cache (K and V, all layers' one layer) vs BF16."""
    if fmt != "nvfp4":
        raise ValueError("the paged cache stores NVFP4 only")
    nv = 2 * num_kv_heads * (head_dim // 2 + head_dim // 16)
    bf = 2 * num_kv_heads * head_dim * 2
    return {"nvfp4": float(nv), "bf16": float(bf), "ratio": nv / bf}


@dataclass
class PagedKVCache:
    k_codes: torch.Tensor
    k_sf: torch.Tensor
    v_codes: torch.Tensor
    v_sf: torch.Tensor
    k_scale: torch.Tensor
    v_scale: torch.Tensor

    @classmethod
    def empty(cls, num_pages: int, num_kv_heads: int, head_dim: int, page_size: int = 32,
              k_scale: float = 1.0, v_scale: float = 1.0, device="cpu") -> "PagedKVCache":
        for name, v in (("num_pages", num_pages), ("num_kv_heads", num_kv_heads),
                        ("head_dim", head_dim), ("page_size", page_size)):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if head_dim % 16:
            raise ValueError(f"head_dim must be a multiple of 16 for NVFP4, got {head_dim}")
        shp = (num_pages, num_kv_heads, page_size)
        codes = lambda: torch.zeros(*shp, head_dim // 2, dtype=torch.uint8, device=device)  # noqa: E731
        sf = lambda: torch.zeros(*shp, head_dim // 16, dtype=torch.float8_e4m3fn, device=device)  # noqa: E731
        f32 = lambda v: formats._check_global_scale(v, device)  # noqa: E731
        return cls(codes(), sf(), codes(), sf(), f32(k_scale), f32(v_scale))

    @property
    def num_pages(self) -> int:
        return self.k_codes.shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.k_codes.shape[1]

    @property
    def page_size(self) -> int:
        return self.k_codes.shape[2]

    @property
    def head_dim(self) -> int:
        return self.k_codes.shape[3] * 2

    def _slots(self, block_tables: torch.Tensor, positions: torch.Tensor):
        page = block_tables[positions // self.page_size].long()
        if bool((page < 0).any()) or bool((page >= self.num_pages).any()):
            raise ValueError("block table points outside the cache")
        return page, (positions % self.page_size).long()

    def append(self, k: torch.Tensor, v: torch.Tensor, block_tables: torch.Tensor,
               positions: torch.Tensor) -> None:
        """Reference append: quantize new tokens into their pages (in place).

        k, v: [T, Hkv, D] float (T new tokens); block_tables: int [B, max_pages];
        positions: int [T, 2] rows of (sequence index, token position in that sequence).
        """
        if k.shape != v.shape or k.dim() != 3 or k.shape[1:] != (self.num_kv_heads, self.head_dim):
            raise ValueError(f"k and v must be [T, {self.num_kv_heads}, {self.head_dim}]")
        page, slot = self.append_slots(block_tables, positions)
        for src, codes, sf, gs in ((k, self.k_codes, self.k_sf, self.k_scale),
                                   (v, self.v_codes, self.v_sf, self.v_scale)):
            q = formats.quantize(src, "nvfp4", global_scale=gs)
            codes[page, :, slot] = q.codes
            sf[page, :, slot] = q.scales

    def append_slots(self, block_tables: torch.Tensor, positions: torch.Tensor):
        """(page, slot) index tensors [T] of new tokens: positions int [T, 2] rows of (sequence,
        token position), block_tables int [B, max_pages]. Raises if a page is outside."""
        seq, pos = positions[:, 0].long(), positions[:, 1].long()
        page = block_tables.long()[seq, pos // self.page_size]
        if bool((page < 0).any()) or bool((page >= self.num_pages).any()):
            raise ValueError("block table points outside the cache")
        return page, pos % self.page_size

    def gather_unit(self, block_table: torch.Tensor, n: int):
        """Dequantized K and V of one sequence WITHOUT global scales (exact in float64).

        block_table: int [max_pages]; returns (k, v), each float64 [Hkv, n, D].
        """
        pos = torch.arange(n, device=self.k_codes.device)
        page, slot = self._slots(block_table.to(self.k_codes.device), pos)
        out = []
        for codes, sf in ((self.k_codes, self.k_sf), (self.v_codes, self.v_sf)):
            q = formats.QuantizedTensor("nvfp4", codes[page, :, slot], sf[page, :, slot], None)
            vals = formats.dequantize(q, apply_global_scale=False).double()   # [n, Hkv, D]
            out.append(vals.transpose(0, 1))
        return out[0], out[1]

    def gather(self, block_table: torch.Tensor, n: int):
        """Dequantized K and V of one sequence (global scales applied), float32 [Hkv, n, D]."""
        k, v = self.gather_unit(block_table, n)
        return (k.float() * self.k_scale, v.float() * self.v_scale)

    @classmethod
    def from_dense(cls, ks: list[torch.Tensor], vs: list[torch.Tensor], page_size: int = 32,
                   k_scale: float = 1.0, v_scale: float = 1.0, shuffle: bool = True,
                   seed: int = 0):
        """Build a cache holding sequences ks[b], vs[b]: [Hkv, n_b, D] float.

        Pages are assigned in a shuffled order (shuffle=True) so tests exercise the block table.
        Returns (cache, block_tables int32 [B, max_pages], seq_lens int32 [B]).
        """
        hkv, _, d = ks[0].shape
        lens = [int(k.shape[1]) for k in ks]
        pages = [max(1, -(-n // page_size)) for n in lens]
        total = sum(pages)
        cache = cls.empty(total, hkv, d, page_size, k_scale, v_scale, device=ks[0].device)
        gen = torch.Generator().manual_seed(seed)
        order = torch.randperm(total, generator=gen) if shuffle else torch.arange(total)
        tables = torch.full((len(ks), max(pages)), -1, dtype=torch.int32)
        start = 0
        for b, p in enumerate(pages):
            tables[b, :p] = order[start:start + p].to(torch.int32)
            start += p
        for b, (k, v) in enumerate(zip(ks, vs)):
            n = lens[b]
            if n == 0:
                continue
            pos = torch.stack([torch.full((n,), b), torch.arange(n)], dim=1)
            cache.append(k.transpose(0, 1), v.transpose(0, 1), tables, pos)
        return cache, tables.to(ks[0].device), torch.tensor(lens, dtype=torch.int32,
                                                               device=ks[0].device)
