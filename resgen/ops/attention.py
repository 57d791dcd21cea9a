"""ResAttn decode over a paged NVFP4 KV cache, served by the tuned kernels.

    from resgen.ops import DecodeAttention
    attn = DecodeAttention(q_heads=32, kv_heads=8, head_dim=128)     # ResAttn, FP16 PV
    out = attn(q, cache, block_tables, seq_lens, max_kv_len=n)       # q: bf16 [B, Hq, D]

cache: resgen.kvcache.PagedKVCache (NVFP4 K/V, written by the append kernel or
PagedKVCache.from_dense); block_tables int32 [B, max_pages]; seq_lens int32 [B] (0 allowed:
zeros out). `compensation=False` is the plain NVFP4-KV kernel (no query residue);
`query="q16"` is Q16 (the query rounded to FP16, never quantized: more accurate than ResAttn
at plain cost, issue 20 section 2); pv "fp8" rounds V and P to E4M3 (the paper's PV numerics)
instead of FP16.

Per (batch, KV length rounded up to a power of two) the op builds a plan once: the variant
from `resgen.runtime` (buckets of batch and KV length; the tuned split count and reduction),
re-checked against the real longest sequence, compiled once per geometry and variant. Pass
`max_kv_len` (the longest sequence, known to a serving loop) to avoid reading seq_lens back
from the GPU. Build plans before CUDA graph capture (`warmup`).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

from ..search.family import KernelFamily, families_for, get_family
from ..search.variant import AttentionProblem
from . import common
from .common import choose_variant, compile_cached

__all__ = ["DecodeAttention", "AttentionPlan"]


@dataclass
class AttentionPlan:
    """What runs for one (batch, KV-length class): the looked-up problem, the variant, where
    it came from, and the bound kernel (its family's `bind`, e.g. attention_sm90's
    resgen.kernels.attention_sm90.DecodeAttentionSm90)."""

    problem: AttentionProblem
    variant: Any
    source: str
    op: Any


class DecodeAttention:
    """Decode attention of one layer geometry on the tuned attention kernels.

    q_heads, kv_heads, head_dim, page_size: the geometry (q_heads a multiple of kv_heads).
    compensation: True = ResAttn (query split into FP4 base + residue, scores added in FP32
                  before the softmax); False = plain NVFP4-KV; None (default) = True for
                  query "nvfp4", False for "q16" (which has no residue; True is refused).
    query:        "nvfp4" (the query quantized in-kernel: ResAttn / plain) or "q16" (the
                  BF16 query converted to FP16 in-kernel, exactly, never quantized).
    pv:           "f16" or "fp8" (a numerics choice, never made by the tuner).
    arch:         compile target (default: resgen.settings, the GPU's arch).
    family / variant / dispatcher / compile_fn / op_fn: as for resgen.ops.Linear; op_fn
                  ((compiled, variant, problem) -> callable like DecodeAttentionSm90)
                  replaces the family's `bind` (the CPU tests stand an emulation in for the
                  kernel).
    """

    def __init__(self, q_heads: int, kv_heads: int, head_dim: int, page_size: int = 32, *,
                 compensation: bool | None = None, pv: str = "f16", query: str = "nvfp4",
                 arch: str | None = None,
                 family: str | None = None, variant: Any = None, dispatcher: Any = None,
                 compile_fn: Callable[[Any, Any, AttentionProblem, str], Any] | None = None,
                 op_fn: Callable[[Any, Any, AttentionProblem], Any] | None = None) -> None:
        if kv_heads < 1 or q_heads % kv_heads:
            raise ValueError(f"q_heads = {q_heads} must be a positive multiple of kv_heads = "
                             f"{kv_heads}")
        if pv not in ("f16", "fp8"):
            raise ValueError(f"pv must be 'f16' or 'fp8', got {pv!r}")
        if query not in ("nvfp4", "q16"):
            raise ValueError(f"query must be 'nvfp4' or 'q16', got {query!r}")
        if compensation is None:
            compensation = query == "nvfp4"
        if query == "q16" and compensation:
            raise ValueError("query='q16' is never quantized, so there is no query residue to "
                             "compensate: leave compensation unset (or False)")
        if arch is None:
            from ..settings import settings

            arch = settings().arch
        geometry = AttentionProblem(1, q_heads, kv_heads, head_dim, 0, page_size,
                                    bool(compensation), pv, query)
        if variant is not None:
            fams = [get_family(variant.FAMILY)]
        elif family is not None:
            fams = [get_family(family)]
        else:
            fams = families_for("decode_attention", arch)
        whys = [f.problem_invalid(geometry) for f in fams] or [f"no family on {arch}"]
        if all(w is not None for w in whys):
            raise ValueError(f"no attention kernel for this geometry: {'; '.join(whys)}")
        common.require_cuda_device(None, arch, what="resgen.ops.DecodeAttention",
                                   simulated=bool(compile_fn or op_fn))
        self.q_heads, self.kv_heads, self.head_dim = q_heads, kv_heads, head_dim
        self.page_size, self.compensation, self.pv = page_size, bool(compensation), pv
        self.query = query
        self.arch, self.family, self.variant = arch, family, variant
        self._dispatcher = dispatcher
        self._compile = compile_fn or compile_cached
        self._op = op_fn
        self._plans: OrderedDict[tuple[int, int], AttentionPlan] = OrderedDict()

    def problem(self, batch: int, kv_len: int) -> AttentionProblem:
        return AttentionProblem(int(batch), self.q_heads, self.kv_heads, self.head_dim,
                                int(kv_len), self.page_size, self.compensation, self.pv,
                                self.query)

    def plan(self, batch: int, kv_len: int) -> AttentionPlan:
        """The plan for a batch whose longest sequence has kv_len tokens, cached per batch and
        power-of-two class of kv_len (c/2 < kv_len <= c)."""
        key = (int(batch), _pow2_ceil(int(kv_len)))
        plan = self._plans.get(key)
        if plan is None:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"no plan for batch {batch}, KV length {kv_len} yet: call "
                                   "warmup(...) before capturing a CUDA graph")
            plan, whole_class = self._build(*key, int(kv_len))
            if whole_class:
                self._plans[key] = plan
                while len(self._plans) > common.MAX_PLANS:     # most recently used kept
                    self._plans.popitem(last=False)
        else:
            self._plans.move_to_end(key)
        return plan

    def warmup(self, shapes: Iterable[tuple[int, int]]) -> list[AttentionPlan]:
        """Build the plans of these (batch, longest KV length) pairs now."""
        return [self.plan(b, n) for b, n in shapes]

    def _choose(self, p: AttentionProblem) -> tuple[KernelFamily, Any, str]:
        return choose_variant("decode_attention", p, self.arch, self.family, self.variant,
                              self._dispatcher)

    def _build(self, batch: int, kv_class: int, kv_len: int) -> tuple[AttentionPlan, bool]:
        """(plan, whether it serves the whole class). The class's top length is looked up
        (bounded caches in the runtime). The family's only length rule (no more splits than
        pages) gets easier with length, so a variant valid for the class's shortest length
        serves the whole class; where it is not, the real length is looked up and that plan
        serves this call only (a pinned variant too long for short sequences, say)."""
        p = self.problem(batch, kv_class)
        fam, v, src = self._choose(p)
        lo = self.problem(batch, kv_class // 2 + 1 if kv_class > 1 else kv_class)
        whole = fam.why_invalid(v, lo, self.arch) is None
        if not whole:
            p = self.problem(batch, kv_len)
            fam, v, src = self._choose(p)
            whole = fam.why_invalid(v, lo, self.arch) is None
        compiled = self._compile(fam, v, p, self.arch)
        op = self._op(compiled, v, p) if self._op is not None else \
            fam.bind(compiled, v, p, _device())
        return AttentionPlan(p, v, src, op), whole

    def __call__(self, q: torch.Tensor, cache: Any, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, *, max_kv_len: int | None = None,
                 out: torch.Tensor | None = None, sm_scale: float | None = None
                 ) -> torch.Tensor:
        """q: bf16 [B, Hq, D] -> bf16 [B, Hq, D] (into `out` if given)."""
        if not isinstance(q, torch.Tensor) or q.dim() != 3:
            raise ValueError("q must be a [B, Hq, D] tensor")
        if q.shape[1] != self.q_heads or q.shape[2] != self.head_dim:
            raise ValueError(f"q has shape {tuple(q.shape)}, the op expects "
                             f"[B, {self.q_heads}, {self.head_dim}]")
        if max_kv_len is None:
            if not isinstance(seq_lens, torch.Tensor) or seq_lens.numel() != q.shape[0]:
                raise ValueError("seq_lens must be a [B] tensor")
            max_kv_len = int(seq_lens.max()) if seq_lens.numel() else 0   # a device sync
        plan = self.plan(q.shape[0], max_kv_len)
        return plan.op(q, cache, block_tables, seq_lens, out=out, sm_scale=sm_scale)


def _pow2_ceil(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _device() -> torch.device:
    """Where the op runs: the current CUDA device (the kernels take CUDA tensors), else the
    CPU (tests with an emulation bound in)."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
