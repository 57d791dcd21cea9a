"""Host side of the sm_90a ResAttn kernels: render + compile, launch on torch CUDA tensors.

Two kernels (CuTe DSL templates under resgen/templates):
- attention_sm90.py.j2: decode attention over the paged NVFP4 KV cache (resgen.kvcache layout,
  unchanged), with the BF16 query split into FP4 base + residue inside the kernel. One CTA per
  (KV head, split, batch); the split reduction is "none" (one split), "workspace" (partials +
  a second reduce kernel) or "lastcta" (partials, the last CTA of a head reduces; one launch).
- kv_append_sm90.py.j2: quantize new BF16 K/V tokens into their pages, bit-exact to
  PagedKVCache.append.

Compiled functions take raw device pointers (CuTe DSL Pointers) and scalars; the wrappers here
check shapes, dtypes, devices and alignment (clear TypeError / ValueError), own the split
workspace and the last-CTA counters, and launch on torch's current stream (CUDA-graph safe:
nothing here synchronizes or allocates once the workspace exists).
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..kvcache import PagedKVCache, kv_bytes_per_token
from . import codegen

__all__ = ["HELPER_FILES", "helpers_digest", "AttnShape", "attention_template_params",
           "append_template_params", "compile_attention", "compile_append", "attention_args",
           "append_args", "DecodeAttentionSm90", "KVAppendSm90", "decode_hbm_bytes",
           "ATTN_TEMPLATE", "APPEND_TEMPLATE", "LOG2E"]

ATTN_TEMPLATE = "attention_sm90.py.j2"
APPEND_TEMPLATE = "kv_append_sm90.py.j2"
LOG2E = 1.4426950408889634
_HERE = Path(__file__).resolve().parent
HELPER_FILES = (_HERE / "attention_sm90_device.py", _HERE / "attention_sm90_maps.py",
                _HERE / "fp4_device.py", _HERE / "sm90_ptx.py")
# Q16 renders import one more helper module; it is digested on its own (q16_digest) so that
# the digest every existing render carries stays what it was.
Q16_HELPER_FILES = (_HERE / "attention_sm90_q16_device.py",)
QUERY_MODES = ("nvfp4", "q16")


def _digest(files) -> str:
    h = hashlib.sha256()
    for p in files:
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def helpers_digest() -> str:
    """sha256 (16 hex) of the device helper modules the templates call: rendered into the
    kernel source so that editing a helper changes the kernel fingerprint."""
    return _digest(HELPER_FILES)


def q16_digest() -> str:
    """sha256 (16 hex) of the Q16 query stage's helper module (rendered into Q16 kernels)."""
    return _digest(Q16_HELPER_FILES)


@dataclass(frozen=True)
class AttnShape:
    """Compile-time shape + variant fields of a decode-attention kernel.

    The same fields as resgen.kernels.attention_sm90_device.AttnCfg, kept as a copy on purpose:
    that module imports CuTe DSL (an optional extra) at import time, and shapes, template
    parameters and HBM accounting must work without it. A test checks the two field lists
    agree."""

    head_dim: int
    group: int
    page_size: int
    num_warps: int
    kc: int
    compensation: bool
    packing: str
    pv: str
    reduction: str
    prefetch: bool = False
    # "nvfp4" (the query split in-kernel) or "q16" (FP16 query: compensation False, packing
    # "dense"). Not an AttnCfg field: the device module every existing kernel imports stays
    # unchanged, and the Q16 stage lives in attention_sm90_q16_device.
    query: str = "nvfp4"

    def __post_init__(self) -> None:
        if self.query not in QUERY_MODES:
            raise ValueError(f"query must be one of {QUERY_MODES}, got {self.query!r}")
        if self.query == "q16" and (self.compensation or self.packing != "dense"):
            raise ValueError("a q16 kernel has one FP16 column per head: compensation=False "
                             "and packing='dense'")

    def cfg(self):
        from .attention_sm90_device import AttnCfg   # imports CuTe DSL

        return AttnCfg(**{k: v for k, v in self.__dict__.items() if k != "query"})


_REDUCTION_DOC = {
    "none": "the BF16 output (one split).",
    "workspace": "a partial (O, m, l) per split; a second kernel reduces the splits.",
    "lastcta": "a partial (O, m, l) per split; the last CTA of each (batch, head) to finish "
               "reduces them."}


def _attention_header(shape: AttnShape, name: str) -> str:
    """The rendered kernel's leading comment: what it computes, its variant and the digests
    of the device-helper modules it imports (so the fingerprint follows them)."""
    if shape.query == "q16":
        lines = ["Q16 decode attention (FP16 query, never quantized) over a paged NVFP4 KV "
                 "cache, sm_90a (CuTe DSL).", f"variant: {name}",
                 f"device helpers digest: {helpers_digest()}",
                 f"q16 helpers digest: {q16_digest()}", "",
                 "One CTA per (KV head, split, batch) handles the whole GQA group: it converts "
                 "the group's BF16 queries to FP16 operand columns in shared memory (one "
                 "power-of-two scale per head, exact),"]
    else:
        lines = ["ResAttn decode attention over a paged NVFP4 KV cache, sm_90a (CuTe DSL).",
                 f"variant: {name}", f"device helpers digest: {helpers_digest()}", "",
                 "One CTA per (KV head, split, batch) handles the whole GQA group: it splits "
                 "the group's BF16 queries into FP4 base (+ residue) operands in shared memory,"]
    lines += [f"then each warp runs an online softmax over its chunks of {shape.kc} keys (QK and "
              "PV on mma.sync with K/V decoded from NVFP4 in registers), the warps are "
              "combined through shared memory, and the epilogue writes "
              + _REDUCTION_DOC[shape.reduction]]
    return "\n".join(("# " + ln).rstrip() for ln in lines)


def attention_template_params(shape: AttnShape, variant_name: str = "") -> dict[str, Any]:
    """The attention template's substitutions (it has no branches): the shape's fields, the
    header comment, and the query stage's function (Q16: the FP16 conversion of
    attention_sm90_q16_device; else the FP4 base / residue split of attention_sm90_device;
    the template imports both modules, so every render's fingerprint follows both).
    The prefetch and reduction choices are CFG fields the kernel reads with const_expr."""
    name = variant_name or repr(shape)
    q16 = shape.query == "q16"
    return {**shape.__dict__, "variant_name": name,
            "header": _attention_header(shape, name),
            "query_stage": "Q16.query_stage_q16" if q16 else "D.query_split",
            "query_stage_doc": ("Q16: the BF16 rows to FP16, one power-of-two scale per head, "
                                "exact, no residue") if q16 else
                               "the FP4 base / residue split, in-kernel"}


def append_template_params(head_dim: int, kv_heads: int, page_size: int,
                           num_warps: int = 4) -> dict[str, Any]:
    return {"head_dim": head_dim, "kv_heads": kv_heads, "page_size": page_size,
            "num_warps": num_warps, "helpers_digest": helpers_digest()}


def _fake_ptr(dtype):
    from cutlass.cute.runtime import make_ptr
    from cutlass.cute.typing import AddressSpace

    # The address is never dereferenced at compile time; alignment 16 is part of the type
    # and matches what the launch wrappers check.
    return make_ptr(dtype, 16, AddressSpace.gmem, assumed_align=16)


def attention_args() -> list:
    """Fake arguments cute.compile needs for the attention entry (no GPU)."""
    import cutlass
    from cutlass.cute.runtime import make_fake_stream

    p = _fake_ptr
    return [p(cutlass.BFloat16), p(cutlass.Uint8), p(cutlass.Uint8), p(cutlass.Uint8),
            p(cutlass.Uint8), p(cutlass.Float32), p(cutlass.Float32), p(cutlass.Int32),
            p(cutlass.Int32), p(cutlass.BFloat16), p(cutlass.Float32), p(cutlass.Float32),
            p(cutlass.Int32), cutlass.Int32(1), cutlass.Int32(1), cutlass.Int32(1),
            cutlass.Int32(1), cutlass.Float32(1.0), make_fake_stream()]


def append_args() -> list:
    import cutlass
    from cutlass.cute.runtime import make_fake_stream

    p = _fake_ptr
    return [p(cutlass.BFloat16), p(cutlass.BFloat16), p(cutlass.Int32), p(cutlass.Int32),
            p(cutlass.Uint8), p(cutlass.Uint8), p(cutlass.Uint8), p(cutlass.Uint8),
            p(cutlass.Float32), p(cutlass.Float32), cutlass.Int32(1), cutlass.Int32(1),
            make_fake_stream()]


def _render_load(template: str, params: dict, family: str):
    path, source = codegen.render_to_file(template, params, family)
    return codegen.load_module(path), source


def compile_attention(shape: AttnShape, arch: str = "sm_90a", variant_name: str = ""):
    """Render, import and compile one decode-attention kernel. Returns (CompileResult, source)."""
    mod, source = _render_load(ATTN_TEMPLATE, attention_template_params(shape, variant_name),
                               "attention_sm90")
    return codegen.compile_entry(mod.entry, attention_args(), arch), source


@functools.lru_cache(maxsize=None)
def compile_append(head_dim: int, kv_heads: int, page_size: int, num_warps: int = 4,
                   arch: str = "sm_90a"):
    """(CompileResult, rendered source) of the KV append kernel for this geometry, compiled
    once per process and kept (like resgen.ops' kernels): a compiled kernel that dies is
    unloaded by its finalizer, and when Python's collector runs that finalizer during a CUDA
    graph capture, the capture fails (measured on the H200: README, "CUDA graphs")."""
    mod, source = _render_load(APPEND_TEMPLATE,
                               append_template_params(head_dim, kv_heads, page_size, num_warps),
                               "kv_append_sm90")
    return codegen.compile_entry(mod.entry, append_args(), arch), source


# ----------------------------------------------------------------------------- launches


def _ptr(t: torch.Tensor, dtype):
    from cutlass.cute.runtime import make_ptr
    from cutlass.cute.typing import AddressSpace

    if t.data_ptr() % 16:
        raise ValueError(f"tensor of shape {tuple(t.shape)} is not 16-byte aligned")
    return make_ptr(dtype, t.data_ptr(), AddressSpace.gmem, assumed_align=16)


def _stream():
    import cuda.bindings.driver as cuda

    return cuda.CUstream(torch.cuda.current_stream().cuda_stream)


def _check(t: torch.Tensor, name: str, dtype: torch.dtype, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{name} must be {dtype}, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def _check_cache(cache: PagedKVCache, device: torch.device) -> None:
    for name in ("k_codes", "v_codes"):
        _check(getattr(cache, name), name, torch.uint8, device)
    for name in ("k_sf", "v_sf"):
        _check(getattr(cache, name), name, torch.float8_e4m3fn, device)
    for name in ("k_scale", "v_scale"):
        _check(getattr(cache, name), name, torch.float32, device)


class DecodeAttentionSm90:
    """A compiled decode-attention variant bound to its launch parameters.

    call(q, cache, block_tables, seq_lens, out=None, sm_scale=None) -> out
      q: [B, Hq, D] bf16 CUDA; cache: PagedKVCache on the same device (HND layout);
      block_tables: [B, max_pages] int32; seq_lens: [B] int32 (0 allowed: zeros out);
      out: [B, Hq, D] bf16 (allocated if None).
    num_splits: KV splits per (batch, head) (1 for reduction "none").
    """

    def __init__(self, fn: Any, shape: AttnShape, num_splits: int):
        if shape.reduction == "none" and num_splits != 1:
            raise ValueError("reduction 'none' needs num_splits == 1")
        if num_splits < 1:
            raise ValueError(f"num_splits must be >= 1, got {num_splits}")
        self.fn = fn
        self.shape = shape
        self.num_splits = num_splits
        self._ws: dict[tuple, tuple] = {}

    def workspace(self, batch: int, kv_heads: int, device: torch.device):
        """(O partials f32, (m, l) f32, counters int32): allocated once per (B, Hkv, device);
        the counters start at zero and the last CTA re-arms them."""
        key = (batch, kv_heads, str(device))
        ws = self._ws.get(key)
        if ws is None:
            s, g, d = self.num_splits, self.shape.group, self.shape.head_dim
            n = batch * kv_heads * (s if self.shape.reduction != "none" else 1)
            ws = (torch.empty(n * g * d, dtype=torch.float32, device=device),
                  torch.empty(n * g * 2, dtype=torch.float32, device=device),
                  torch.zeros(batch * kv_heads, dtype=torch.int32, device=device))
            self._ws[key] = ws
        return ws

    def __call__(self, q: torch.Tensor, cache: PagedKVCache, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, out: torch.Tensor | None = None,
                 sm_scale: float | None = None) -> torch.Tensor:
        import cutlass

        if not isinstance(q, torch.Tensor):
            raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
        dev = q.device
        _check(q, "q", torch.bfloat16, dev)
        _check_cache(cache, dev)
        _check(block_tables, "block_tables", torch.int32, dev)
        _check(seq_lens, "seq_lens", torch.int32, dev)
        bsz, hq, d = q.shape
        hkv = cache.num_kv_heads
        sh = self.shape
        if d != sh.head_dim or cache.head_dim != d:
            raise ValueError(f"kernel compiled for head_dim {sh.head_dim}, got q {d} / cache "
                             f"{cache.head_dim}")
        if hq != hkv * sh.group:
            raise ValueError(f"kernel compiled for {sh.group} query heads per KV head, got "
                             f"{hq} query / {hkv} KV heads")
        if cache.page_size != sh.page_size:
            raise ValueError(f"kernel compiled for page size {sh.page_size}, cache has "
                             f"{cache.page_size}")
        if block_tables.dim() != 2 or block_tables.shape[0] != bsz or seq_lens.shape != (bsz,):
            raise ValueError("block_tables must be [B, max_pages] and seq_lens [B]")
        if out is None:
            out = torch.empty_like(q)
        else:
            _check(out, "out", torch.bfloat16, dev)
            if out.shape != q.shape:
                raise ValueError(f"out must have shape {tuple(q.shape)}")
        if dev.type != "cuda":
            raise ValueError("DecodeAttentionSm90 runs on CUDA tensors")
        scale = sm_scale if sm_scale is not None else d ** -0.5
        ws_o, ws_ml, cnt = self.workspace(bsz, hkv, dev)
        self.fn(_ptr(q, cutlass.BFloat16), _ptr(cache.k_codes, cutlass.Uint8),
                _ptr(cache.k_sf, cutlass.Uint8), _ptr(cache.v_codes, cutlass.Uint8),
                _ptr(cache.v_sf, cutlass.Uint8), _ptr(cache.k_scale, cutlass.Float32),
                _ptr(cache.v_scale, cutlass.Float32), _ptr(block_tables, cutlass.Int32),
                _ptr(seq_lens, cutlass.Int32), _ptr(out, cutlass.BFloat16),
                _ptr(ws_o, cutlass.Float32), _ptr(ws_ml, cutlass.Float32),
                _ptr(cnt, cutlass.Int32), cutlass.Int32(bsz), cutlass.Int32(hkv),
                cutlass.Int32(block_tables.shape[1]), cutlass.Int32(self.num_splits),
                cutlass.Float32(scale * LOG2E * 128.0), _stream())
        return out


class KVAppendSm90:
    """A compiled append kernel: quantize new tokens into the cache (in place).

    call(cache, k, v, block_tables, positions): k, v [T, Hkv, D] bf16 CUDA; positions [T, 2]
    int32 rows of (sequence, token position); block_tables [B, max_pages] int32.
    """

    def __init__(self, fn: Any, head_dim: int, kv_heads: int, page_size: int):
        self.fn = fn
        self.head_dim, self.kv_heads, self.page_size = head_dim, kv_heads, page_size

    def __call__(self, cache: PagedKVCache, k: torch.Tensor, v: torch.Tensor,
                 block_tables: torch.Tensor, positions: torch.Tensor) -> None:
        import cutlass

        if not isinstance(k, torch.Tensor):
            raise TypeError(f"k must be a torch.Tensor, got {type(k).__name__}")
        dev = k.device
        _check(k, "k", torch.bfloat16, dev)
        _check(v, "v", torch.bfloat16, dev)
        _check_cache(cache, dev)
        _check(block_tables, "block_tables", torch.int32, dev)
        _check(positions, "positions", torch.int32, dev)
        if k.shape != v.shape or k.dim() != 3 or k.shape[1:] != (self.kv_heads, self.head_dim):
            raise ValueError(f"k and v must be [T, {self.kv_heads}, {self.head_dim}]")
        if (cache.num_kv_heads, cache.head_dim, cache.page_size) != (
                self.kv_heads, self.head_dim, self.page_size):
            raise ValueError("cache geometry differs from the compiled append kernel")
        if positions.shape != (k.shape[0], 2):
            raise ValueError(f"positions must be [{k.shape[0]}, 2]")
        if dev.type != "cuda":
            raise ValueError("KVAppendSm90 runs on CUDA tensors")
        if k.shape[0] == 0:
            return
        self.fn(_ptr(k, cutlass.BFloat16), _ptr(v, cutlass.BFloat16),
                _ptr(positions, cutlass.Int32), _ptr(block_tables, cutlass.Int32),
                _ptr(cache.k_codes, cutlass.Uint8), _ptr(cache.k_sf, cutlass.Uint8),
                _ptr(cache.v_codes, cutlass.Uint8), _ptr(cache.v_sf, cutlass.Uint8),
                _ptr(cache.k_scale, cutlass.Float32), _ptr(cache.v_scale, cutlass.Float32),
                cutlass.Int32(k.shape[0]), cutlass.Int32(block_tables.shape[1]), _stream())


def decode_hbm_bytes(seq_lens, num_kv_heads: int, head_dim: int, q_heads: int) -> int:
    """Bytes a decode step must move at least: every cached token's K and V codes + scales,
    the BF16 queries and outputs (the HBM floor's numerator)."""
    per_tok = kv_bytes_per_token(num_kv_heads, head_dim)["nvfp4"]
    lens = [int(x) for x in seq_lens]
    return int(sum(lens) * per_tok + 2 * len(lens) * q_heads * head_dim * 2)
