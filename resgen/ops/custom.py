"""resgen's kernels as torch.library custom ops (namespace `resgen`), opaque to torch.compile
and torch.export, with fake (meta) implementations.

    torch.ops.resgen.linear(x, handle) -> y                 plain / M-Ext / K-Ext linear
    torch.ops.resgen.quantize(x, handle) -> (codes, scales, alpha)     layer quantizer
    torch.ops.resgen.decode_attention(q, k_codes, k_sf, v_codes, v_sf, k_scale, v_scale,
                                      block_tables, seq_lens, max_kv_len, sm_scale, handle) -> o
    torch.ops.resgen.kv_append(k, v, k_codes!, k_sf!, v_codes!, v_sf!, k_scale, v_scale,
                               block_tables, positions, handle)     (mutates the cache)

A handle is a string naming a registered op object (`register`): a resgen.ops.Linear, a
LayerQuantizer, a DecodeAttention or a KVAppend (or an object with the same call contract,
e.g. resgen.ops.cpu's reference stand-ins, registered with its kind). This is vLLM's pattern for its attention op
(`unified_attention(..., layer_name)`, registered with direct_register_custom_op), chosen here
for the same reasons:
- the op object holds what cannot be a tensor argument: the per-shape plans (the variant the
  dispatch table picks for each M or KV-length class, possibly of different kernel families
  with different weight layouts), the compiled kernels and their workspaces. Passing the weight
  as tensors would fix one layout; the dispatch picks the family per shape;
- a string is a constant to dynamo (guarded by equality, never turned into a SymInt the way an
  int module attribute can be under automatic dynamic shapes when one frame serves many
  layers), so the graph holds one opaque call per layer and no guard or recompile depends on
  resgen's Python; inside the op the kernels launch on the current stream without a host sync
  (the plans exist after the first eager call or `warmup`), which is what CUDA graphs need, so
  torch.compile(mode="reduce-overhead") captures resgen's launches in its graphs;
- tensors that change between steps are real arguments: activations, and the KV cache, which
  kv_append declares as mutated so that the compiler orders appends before the attention that
  reads them (functionalization sees the dependency).
Handles are process-local: an exported program (torch.export) calls the op objects registered
under its handles, so it runs in the process that built them (or one that registered equal
ones under the same names, e.g. by quantizing the model again with resgen.hf.quantize).

The registry holds weak references: an op lives as long as its owner (e.g. FP4Linear) does.

The cache's E4M3 scale tensors travel as uint8 bit patterns (`cache_args(cache)` gives the six
cache arguments as views of the cache's storage): float8 tensors as op arguments are not
supported by every check and backend on the CPU (opcheck's schema test cannot compare them),
and bytes are what a kernel reads anyway.

Attention's plan depends on the longest KV length; `max_kv_len` is that bound as a plain int.
Under torch.compile pass a constant (e.g. the cache's tokens per sequence) so one graph serves
every step: the kernel reads the real lengths from seq_lens, and a plan for a longer class
serves shorter sequences (the batch's shorter rows are served the same way).
"""

from __future__ import annotations

import itertools
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from ..kvcache import PagedKVCache
from .attention import DecodeAttention
from .cpu import ReferenceAppend, ReferenceAttention, ReferenceLinear
from .kv_append import KVAppend
from .linear import Linear
from .quantizer import LayerQuantizer

__all__ = ["register", "resolve", "unregister", "handles", "cache_args", "NAMESPACE", "OPS",
           "Recorder", "recording", "push_recorder", "pop_recorder"]

NAMESPACE = "resgen"
OPS = ("linear", "quantize", "decode_attention", "kv_append")

_KINDS: dict[type, str] = {Linear: "linear", LayerQuantizer: "quantize",
                           DecodeAttention: "decode_attention", KVAppend: "kv_append",
                           ReferenceLinear: "linear", ReferenceAttention: "decode_attention",
                           ReferenceAppend: "kv_append"}
_HANDLES: "weakref.WeakValueDictionary[str, Any]" = weakref.WeakValueDictionary()
_COUNTER = itertools.count()


def register(obj: Any, name: str = "", kind: str | None = None) -> str:
    """Register an op object; returns its handle "<kind>:<n>[:<name>]" (name: a label such as
    the module path, kept in the graph for readers). kind: one of OPS, needed only for an
    object of another class with the same call contract (a test's simulation, say)."""
    if kind is None:
        kind = next((k for cls, k in _KINDS.items() if isinstance(obj, cls)), None)
        if kind is None:
            raise TypeError(f"not a resgen op object: {type(obj).__name__} (expected one of "
                            f"{', '.join(sorted({c.__name__ for c in _KINDS}))}, or pass kind)")
    elif kind not in OPS:
        raise ValueError(f"kind must be one of {OPS}, got {kind!r}")
    handle = f"{kind}:{next(_COUNTER)}" + (f":{name}" if name else "")
    _HANDLES[handle] = obj
    return handle


def unregister(handle: str) -> None:
    _HANDLES.pop(handle, None)


def handles() -> list[str]:
    """The handles registered now (live objects only)."""
    return list(_HANDLES.keys())


def resolve(handle: str, kind: str | None = None) -> Any:
    """The op object registered under `handle` (an op of that kind, if given)."""
    obj = _HANDLES.get(handle)
    if obj is None:
        raise KeyError(f"no resgen op is registered under {handle!r} in this process "
                       "(handles are process-local; register the op objects first)")
    if kind is not None and handle.split(":", 1)[0] != kind:
        raise TypeError(f"handle {handle!r} names a {type(obj).__name__}, not a {kind} op")
    return obj


@dataclass
class Recorder:
    """The distinct problems the ops looked up while it was active, per op name, in first-
    seen order (resgen.autotune tunes them)."""

    problems: dict[str, list] = field(default_factory=dict)
    summary: list = field(default_factory=list)
    db: Any = None

    def add(self, op: str, problem: Any) -> None:
        seen = self.problems.setdefault(op, [])
        if problem not in seen:
            seen.append(problem)

    def count(self) -> int:
        return sum(len(v) for v in self.problems.values())


_LOCAL = threading.local()


def push_recorder() -> Recorder:
    """Start recording on this thread (nested recorders: the innermost records)."""
    stack = getattr(_LOCAL, "stack", None)
    if stack is None:
        stack = _LOCAL.stack = []
    rec = Recorder()
    stack.append(rec)
    return rec


def pop_recorder(rec: Recorder) -> None:
    _LOCAL.stack.remove(rec)


def recording() -> Recorder | None:
    """The innermost active recorder of this thread, or None."""
    stack = getattr(_LOCAL, "stack", None)
    return stack[-1] if stack else None


def _record(op: str, obj: Any, *shape: int) -> None:
    """Tell an active `resgen.autotune()` which problem this call looks up (cheap no-op
    otherwise; stand-ins without a `problem` method are not recorded)."""
    rec = recording()
    if rec is not None and hasattr(obj, "problem"):
        try:
            rec.add(op, obj.problem(*shape))
        except (ValueError, TypeError):
            pass            # a shape the family cannot key: the call itself reports it


def _cache(k_codes, k_sf, v_codes, v_sf, k_scale, v_scale) -> PagedKVCache:
    """The PagedKVCache over the op's tensors; k_sf / v_sf arrive as uint8 E4M3 bit patterns
    (see the module docstring) and are viewed back as float8_e4m3fn (same storage)."""
    for name, t in (("k_sf", k_sf), ("v_sf", v_sf)):
        if t.dtype != torch.uint8:
            raise TypeError(f"{name} must be the E4M3 scale bytes as uint8 (cache.{name}.view("
                            f"torch.uint8)), got {t.dtype}")
    return PagedKVCache(k_codes, k_sf.view(torch.float8_e4m3fn), v_codes,
                        v_sf.view(torch.float8_e4m3fn), k_scale, v_scale)


def cache_args(cache: PagedKVCache) -> tuple[torch.Tensor, ...]:
    """A PagedKVCache as the ops' six cache arguments (k_codes, k_sf, v_codes, v_sf as uint8,
    k_scale, v_scale): views of the cache's own storage, so kv_append writes the cache."""
    return (cache.k_codes, cache.k_sf.view(torch.uint8), cache.v_codes,
            cache.v_sf.view(torch.uint8), cache.k_scale, cache.v_scale)


# ----------------------------------------------------------------------------- linear


@torch.library.custom_op(f"{NAMESPACE}::linear", mutates_args=())
def linear(x: torch.Tensor, handle: str) -> torch.Tensor:
    """x: bf16 [..., K] -> bf16 [..., N] through the Linear registered under handle."""
    op = resolve(handle, "linear")
    m = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0
    if m:
        _record("linear", op, m)
    return op(x)


@linear.register_fake
def _linear_fake(x: torch.Tensor, handle: str) -> torch.Tensor:
    op = resolve(handle, "linear")
    if x.dtype != torch.bfloat16:
        raise TypeError(f"resgen.linear takes bfloat16 activations, got {x.dtype}")
    if x.dim() < 1 or x.shape[-1] != op.k:
        raise ValueError(f"activations of shape {tuple(x.shape)}: the last dimension must be "
                         f"K = {op.k}")
    return x.new_empty((*x.shape[:-1], op.n), dtype=torch.bfloat16)


# ----------------------------------------------------------------------------- quantizer


@torch.library.custom_op(f"{NAMESPACE}::quantize", mutates_args=())
def quantize(x: torch.Tensor, handle: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x: bf16 [M, K] -> (codes uint8 [T, KQ/2], scales [T, KQ/block], alpha float32 [1])."""
    op = resolve(handle, "quantize")
    if x.dim() == 2 and x.shape[0]:
        _record("quantize", op, x.shape[0])
    return op(x)


@quantize.register_fake
def _quantize_fake(x: torch.Tensor, handle: str):
    op = resolve(handle, "quantize")
    if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != op.k:
        raise ValueError(f"resgen.quantize takes bf16 [M, {op.k}], got {x.dtype} "
                         f"{tuple(x.shape)}")
    cs, ss = op.output_shapes(x.shape[0])
    sdt = torch.float8_e4m3fn if op.fmt == "nvfp4" else torch.uint8
    return (x.new_empty(cs, dtype=torch.uint8), x.new_empty(ss, dtype=sdt),
            x.new_empty((1,), dtype=torch.float32))


# ----------------------------------------------------------------------------- attention


@torch.library.custom_op(f"{NAMESPACE}::decode_attention", mutates_args=())
def decode_attention(q: torch.Tensor, k_codes: torch.Tensor, k_sf: torch.Tensor,
                     v_codes: torch.Tensor, v_sf: torch.Tensor, k_scale: torch.Tensor,
                     v_scale: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                     max_kv_len: int, sm_scale: float | None, handle: str) -> torch.Tensor:
    """q: bf16 [B, Hq, D] over the paged NVFP4 cache (its six tensors) -> bf16 [B, Hq, D]."""
    op = resolve(handle, "decode_attention")
    if q.dim() == 3 and q.shape[0] and max_kv_len > 0:
        # the plan's key: the batch and the power-of-two class of the longest sequence
        _record("decode_attention", op, q.shape[0], 1 << max(0, max_kv_len - 1).bit_length())
    return op(q, _cache(k_codes, k_sf, v_codes, v_sf, k_scale, v_scale), block_tables,
              seq_lens, max_kv_len=max_kv_len, sm_scale=sm_scale)


@decode_attention.register_fake
def _decode_attention_fake(q, k_codes, k_sf, v_codes, v_sf, k_scale, v_scale, block_tables,
                           seq_lens, max_kv_len, sm_scale, handle):
    op = resolve(handle, "decode_attention")
    if q.dim() != 3 or q.shape[1] != op.q_heads or q.shape[2] != op.head_dim:
        raise ValueError(f"q has shape {tuple(q.shape)}, the op expects "
                         f"[B, {op.q_heads}, {op.head_dim}]")
    return torch.empty_like(q, dtype=torch.bfloat16)


# ----------------------------------------------------------------------------- KV append


@torch.library.custom_op(f"{NAMESPACE}::kv_append",
                         mutates_args=("k_codes", "k_sf", "v_codes", "v_sf"))
def kv_append(k: torch.Tensor, v: torch.Tensor, k_codes: torch.Tensor, k_sf: torch.Tensor,
              v_codes: torch.Tensor, v_sf: torch.Tensor, k_scale: torch.Tensor,
              v_scale: torch.Tensor, block_tables: torch.Tensor, positions: torch.Tensor,
              handle: str) -> None:
    """k, v: bf16 [T, Hkv, D] quantized into the cache's pages (in place)."""
    resolve(handle, "kv_append")(_cache(k_codes, k_sf, v_codes, v_sf, k_scale, v_scale), k, v,
                              block_tables, positions)


@kv_append.register_fake
def _kv_append_fake(k, v, k_codes, k_sf, v_codes, v_sf, k_scale, v_scale, block_tables,
                    positions, handle) -> None:
    resolve(handle, "kv_append")
    return None
