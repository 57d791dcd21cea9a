"""Kernel family attention_sm90: ResAttn decode attention over a paged NVFP4 KV cache on Hopper.

The same family with `AttentionProblem.compensation = False` is the plain NVFP4-KV baseline
(the query residue column stays zero, or "dense" packing drops it). The kernel and its maps:
resgen/templates/attention_sm90.py.j2, resgen.kernels.attention_sm90_{device,maps}; the CPU
emulator resgen.kernels.attention_sm90_emu proves the maps against resgen.reference.

Variant axes (AttentionSm90Variant) and what they change:
    num_warps   warps per CTA; a warp runs its own online softmax over chunks warp, warp + W,
                ... of the CTA's split; the CTA combines its warps through shared memory
    kc          keys per chunk (16 or 32 = one or two m16 key tiles per loop iteration)
    packing     query columns of the QK tile: "pair" (base j, residue j adjacent: fold in a
                lane), "dense" (one column per head; plain only: halves the QK MMAs at G = 8)
                or "stack" (ResAttn only: dense base and residue operand tiles, two MMA
                chains folded in FP32; pair's MMAs with dense's score registers)
    splits      KV splits per (batch, KV head) (a run-time argument: one compile serves all)
    prefetch    register double buffer: the next chunk's K/V bytes load while this one is
                computed, the block-table entry one chunk further ahead, and the first chunk's
                loads are issued before the in-kernel query split
    reduction   how the splits meet: "none" (one split), "workspace" (partials + a second
                reduce kernel) or "lastcta" (partials, the last CTA of a head reduces; one
                launch, deterministic). Chosen per (batch, KV-length bucket, heads) by the
                tuner; `preset` is the fallback rule.
Workload fields that change numerics, not speed: compensation, pv (f16 | fp8), query
(nvfp4 | q16). query="q16" (issue 20 section 2) is the FP16 query, never quantized: no query
split stage and no residue chain (compensation False), one FP16 column per head, so its only
packing is "dense"; every other axis is as for plain.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Sequence

import torch

from .family import CheckResult, KernelFamilyBase, compare, register
from .variant import AttentionProblem, Choice, IntRange, VariantBase

__all__ = ["Packing", "Reduction", "AttentionSm90Variant", "AttentionSm90Family", "FAMILY",
           "preset", "TOLERANCE", "SMS_H200", "compare", "random_cache", "shape_of",
           "reg_estimate", "MAX_REGS_EST"]

SMS_H200 = 132
TOLERANCE = {"f16": 3e-3, "fp8": 2e-2}   # BF16 output rounding; E4M3 P/V rounding (fp8)
HEAD_DIMS = (64, 128, 256)
MAX_GROUP = 8
MIN_PAGES_PER_SPLIT = 8
MAX_SPLITS = 128


class Packing(Choice):
    PAIR = "pair"
    DENSE = "dense"
    STACK = "stack"


class Reduction(Choice):
    NONE = "none"
    WORKSPACE = "workspace"
    LASTCTA = "lastcta"


@dataclass(frozen=True, slots=True)
class AttentionSm90Variant(VariantBase):
    FAMILY: ClassVar[str] = "attention_sm90"
    num_warps: int = field(default=4, metadata={"range": IntRange(1, 8, pow2=True), "short": "w"})
    kc: int = field(default=32, metadata={"range": IntRange(16, 32, pow2=True), "short": "kc"})
    packing: Packing = field(default=Packing.PAIR, metadata={"short": "pk"})
    splits: int = field(default=1, metadata={"range": IntRange(1, MAX_SPLITS), "short": "s"})
    reduction: Reduction = field(default=Reduction.NONE, metadata={"short": "red"})
    prefetch: bool = field(default=True, metadata={"short": "pf"})


MAX_REGS_EST = 250       # ptxas reached 250-255 registers without spills at estimates 244


def reg_estimate(variant: AttentionSm90Variant, problem: AttentionProblem) -> int:
    """Live registers per lane, fitted to ptxas on sm_90a (measured without prefetch: 123 / 155
    / 250 / 96 for D128 G4 / D128 G8 / D256 G8 / D64 G2; with it: 167 / 222 for D128 G4 / G8,
    211 / 255 for D256 G4 / G8 with kc 16): O^T fragments, query B fragments, one (two with
    prefetch) chunk of raw K/V words, and a base."""
    from ..kernels.attention_sm90_maps import n_qk_tiles

    d, kc = problem.head_dim, variant.kc
    zt = kc // 16
    raw = zt * 2 * (d // 32) + zt * 2 + (kc // 4) * max(1, d // 64) + kc // 4
    nt = n_qk_tiles(problem.q_heads // problem.kv_heads, variant.packing.value)
    return 40 + 4 * (d // 16) + 2 * nt * (d // 16) + raw * (2 if variant.prefetch else 1)


def shape_of(variant: AttentionSm90Variant, problem: AttentionProblem):
    """The compile-time shape (resgen.kernels.attention_sm90.AttnShape) of a variant."""
    from ..kernels.attention_sm90 import AttnShape

    return AttnShape(head_dim=problem.head_dim, group=problem.q_heads // problem.kv_heads,
                     page_size=problem.page_size, num_warps=variant.num_warps, kc=variant.kc,
                     compensation=problem.compensation, packing=variant.packing.value,
                     pv=problem.pv, reduction=variant.reduction.value,
                     prefetch=variant.prefetch, query=problem.query)


def _pages(problem: AttentionProblem) -> int:
    return max(1, math.ceil(problem.kv_len / problem.page_size))


def preset(problem: AttentionProblem, sms: int = SMS_H200) -> AttentionSm90Variant:
    """The fallback rule (no timing): 4 warps, 32-key chunks where the page allows, dense
    packing for plain groups > 4 and stack for ResAttn groups > 4 (the H200 probe:
    bench/results/h200/stack_probe.log), and enough splits for about 3 CTAs per SM (the kernel keeps
    4 resident at ~128 registers), but at least MIN_PAGES_PER_SPLIT pages per split so the
    in-kernel query split and the partial write stay small next to the KV stream; more than
    one split reduces in the last CTA (one launch); prefetch where the registers allow."""
    kc = 32 if problem.page_size % 32 == 0 else 16
    group = problem.q_heads // max(1, problem.kv_heads)
    packing = Packing.PAIR
    if group > 4:
        packing = Packing.STACK if problem.compensation else Packing.DENSE
    if problem.query == "q16":
        packing = Packing.DENSE
    ctas = problem.batch * problem.kv_heads
    want = math.ceil(3 * sms / max(1, ctas))
    cap = max(1, _pages(problem) // MIN_PAGES_PER_SPLIT)
    splits = max(1, min(want, cap, MAX_SPLITS))
    red = Reduction.NONE if splits == 1 else Reduction.LASTCTA
    v = AttentionSm90Variant(num_warps=4, kc=kc, packing=packing, splits=splits,
                             reduction=red, prefetch=True)
    if reg_estimate(v, problem) > MAX_REGS_EST:
        v = replace(v, prefetch=False)
    return v


class AttentionSm90Family(KernelFamilyBase):
    NAME: ClassVar[str] = "attention_sm90"
    VARIANT: ClassVar[type] = AttentionSm90Variant
    PROBLEM: ClassVar[type] = AttentionProblem
    TEMPLATE: ClassVar[str] = "attention_sm90.py.j2"
    ARCHS: ClassVar[tuple[str, ...]] = ("sm_90a",)
    ENTRY: ClassVar[str] = "entry"

    # ------------------------------------------------------------------ validity
    def problem_invalid(self, p: AttentionProblem) -> str | None:
        """Why no variant can run this problem (None if some can)."""
        if p.head_dim not in HEAD_DIMS:
            return f"head_dim {p.head_dim} not in {HEAD_DIMS}"
        if p.q_heads % p.kv_heads:
            return f"{p.q_heads} query heads are not a multiple of {p.kv_heads} KV heads"
        group = p.q_heads // p.kv_heads
        if group > MAX_GROUP:
            return f"GQA group of {group} heads > {MAX_GROUP} (one n8 PV tile)"
        if p.page_size % 16:
            return f"page_size {p.page_size} is not a multiple of 16 (one m16 key tile)"
        if p.pv == "fp8" and p.page_size % 32:
            return "pv=fp8 runs one m16n8k32 step per 32-key chunk: page_size % 32 != 0"
        return None

    def why_invalid(self, variant: AttentionSm90Variant, problem: AttentionProblem,
                    arch: str) -> str | None:
        v, p = variant, problem
        if arch not in self.ARCHS:
            return f"attention_sm90 runs on {self.ARCHS}, not {arch}"
        if not isinstance(v, AttentionSm90Variant) or not isinstance(p, AttentionProblem):
            return "not an AttentionSm90Variant / AttentionProblem"
        why = self.problem_invalid(p)
        if why:
            return why
        if v.num_warps not in (2, 4, 8):
            return f"num_warps {v.num_warps} not in (2, 4, 8)"
        if p.page_size % v.kc:
            return f"page_size {p.page_size} is not a multiple of kc={v.kc}"
        if p.pv == "fp8" and v.kc != 32:
            return "pv=fp8 needs kc=32 (one m16n8k32 PV step per chunk)"
        if p.query == "q16" and v.packing != Packing.DENSE:
            return "query=q16 has one FP16 column per head: packing must be dense"
        if v.packing == Packing.DENSE and p.compensation:
            return "dense packing has no residue column (plain NVFP4-KV only)"
        if v.packing == Packing.STACK and not p.compensation:
            return "stack packing stacks the query residue (ResAttn only; plain: dense)"
        if (v.splits > 1) != (v.reduction != Reduction.NONE):
            return ("splits > 1 needs reduction workspace/lastcta" if v.splits > 1
                    else f"reduction={v.reduction.value} with a single split")
        if v.splits > 1 and v.splits > _pages(p):
            return f"{v.splits} splits > {_pages(p)} pages (empty splits)"
        est = reg_estimate(v, p)
        if est > MAX_REGS_EST:
            return f"register estimate {est} > {MAX_REGS_EST} (would spill)"
        from ..kernels.attention_sm90_maps import SMEM_LIMIT, smem_bytes

        smem = sum(smem_bytes(p.head_dim, p.q_heads // p.kv_heads, v.num_warps,
                              v.packing.value).values())
        if smem > SMEM_LIMIT:
            return f"{smem} bytes of shared memory > {SMEM_LIMIT} (static limit)"
        return None

    # ------------------------------------------------------------------ space
    def space(self, problem: AttentionProblem, arch: str) -> Sequence[AttentionSm90Variant]:
        """Every valid candidate, fixed order: packing, warps, chunk, split count, reduction,
        prefetch. Split counts: 1, the preset's count x 1/4, 1/2, 1, 2, 4 and the largest
        allowed (at least MIN_PAGES_PER_SPLIT pages per split, at most MAX_SPLITS)."""
        if self.problem_invalid(problem):
            return []
        packs = [Packing.PAIR, Packing.DENSE if not problem.compensation else Packing.STACK]
        if problem.query == "q16":
            packs = [Packing.DENSE]
        cap = max(1, _pages(problem) // MIN_PAGES_PER_SPLIT)
        s0 = preset(problem).splits
        top = min(cap, MAX_SPLITS)
        splits = sorted({s for s in (1, s0 // 4, s0 // 2, s0, 2 * s0, 4 * s0, top)
                         if 1 <= s <= top})
        out = []
        for pk in packs:
            for w in (4, 8):
                for kc in (32, 16):
                    for s in splits:
                        reds = (Reduction.NONE,) if s == 1 else (Reduction.LASTCTA,
                                                                 Reduction.WORKSPACE)
                        for red in reds:
                            for pf in (True, False):
                                v = AttentionSm90Variant(w, kc, pk, s, red, pf)
                                if self.why_invalid(v, problem, arch) is None:
                                    out.append(v)
        pre = preset(problem)
        if self.why_invalid(pre, problem, arch) is None and pre not in out:
            out.append(pre)
        return out

    def default(self, problem: AttentionProblem, arch: str) -> AttentionSm90Variant:
        """The preset rule's variant (valid for every problem the family accepts)."""
        v = preset(problem)
        why = self.why_invalid(v, problem, arch)
        if why is not None:
            raise ValueError(f"attention_sm90 cannot run {problem.key()}: {why}")
        return v

    # ------------------------------------------------------------------ codegen
    def template_params(self, variant: AttentionSm90Variant, problem: AttentionProblem) -> dict:
        """Typed fields only; the split count is a run-time argument and not rendered."""
        from ..kernels.attention_sm90 import attention_template_params

        sh = shape_of(variant, problem)
        params = attention_template_params(sh, variant_name=replace(variant, splits=1).name())
        return {k: (int(x) if isinstance(x, int) and not isinstance(x, bool) else x)
                for k, x in params.items()}

    def compile_key(self, variant: AttentionSm90Variant,
                    problem: AttentionProblem) -> AttentionProblem:
        """Batch, KV length and head counts are run-time arguments (only the group size is
        compiled in): one compile serves every bucket of a geometry."""
        group = problem.q_heads // problem.kv_heads
        return replace(problem, batch=1, kv_len=0, q_heads=group, kv_heads=1)

    def compile_args(self, variant: AttentionSm90Variant, problem: AttentionProblem) -> list:
        from ..kernels.attention_sm90 import attention_args

        return attention_args()

    # ------------------------------------------------------------------ running
    def working_set_bytes(self, variant: AttentionSm90Variant, problem: AttentionProblem) -> int:
        from ..kernels.attention_sm90 import decode_hbm_bytes

        return decode_hbm_bytes([problem.kv_len] * problem.batch, problem.kv_heads,
                                problem.head_dim, problem.q_heads)

    def bind(self, compiled: Any, variant: AttentionSm90Variant, problem: AttentionProblem,
             device: torch.device | str) -> Any:
        """The decode step of a compiled variant: a resgen.kernels.attention_sm90.
        DecodeAttentionSm90, op(q, cache, block_tables, seq_lens, out=None, sm_scale=None)
        (q: bf16 [B, Hq, D] -> bf16 [B, Hq, D]), with the split workspace of the problem's
        batch on a CUDA `device` allocated now (not at the first, perhaps captured, call).
        What resgen.ops.DecodeAttention serves and AttentionSm90Runner times."""
        from ..kernels.attention_sm90 import DecodeAttentionSm90

        op = DecodeAttentionSm90(compiled, shape_of(variant, problem), variant.splits)
        device = torch.device(device)
        if device.type == "cuda":
            if device.index is None:      # the workspace is keyed by the tensors' device
                device = torch.device("cuda", torch.cuda.current_device())
            op.workspace(problem.batch, problem.kv_heads, device)
        return op

    def runner(self, compiled: Any, variant: AttentionSm90Variant, problem: AttentionProblem,
               device: Any, n_sets: int = 1, seed: int = 0) -> "AttentionSm90Runner":
        return AttentionSm90Runner(compiled, variant, problem, device, n_sets, seed)

    def bind_append(self, head_dim: int, kv_heads: int, page_size: int,
                    arch: str = "sm_90a") -> Any:
        """The KV append of a cache geometry (not tuned: one kernel per geometry, compiled
        once per process by resgen.kernels.attention_sm90.compile_append): a KVAppendSm90,
        op(cache, k, v, block_tables, positions). What resgen.ops.kv_append serves."""
        from ..kernels.attention_sm90 import KVAppendSm90, compile_append

        res, _ = compile_append(head_dim, kv_heads, page_size, arch=arch)
        return KVAppendSm90(res.fn, head_dim, kv_heads, page_size)


FAMILY = register(AttentionSm90Family())


# ----------------------------------------------------------------------------- runner


def random_cache(batch: int, kv_heads: int, head_dim: int, kv_len: int, page_size: int,
                 device, gen: torch.Generator):
    """A random (but valid) paged cache for timing: uniform codes, E4M3 scales in
    [2^-3, 1], pages in shuffled order. Returns (cache, block_tables, seq_lens)."""
    from ..kvcache import PagedKVCache

    ppseq = max(1, math.ceil(kv_len / page_size))
    pages = batch * ppseq
    cache = PagedKVCache.empty(pages, kv_heads, head_dim, page_size, device=device)
    for codes, sf in ((cache.k_codes, cache.k_sf), (cache.v_codes, cache.v_sf)):
        codes.copy_(torch.randint(0, 256, codes.shape, generator=gen, device=device,
                                  dtype=torch.uint8))
        e = torch.rand(sf.shape, generator=gen, device=device) * 3 - 3
        sf.copy_(torch.exp2(e).to(torch.float8_e4m3fn))
    order = torch.randperm(pages, generator=gen, device=device).to(torch.int32)
    tables = order.reshape(batch, ppseq).contiguous()
    lens = torch.full((batch,), kv_len, dtype=torch.int32, device=device)
    return cache, tables, lens


class AttentionSm90Runner:
    """n_sets random caches of the problem's geometry (cold L2 by rotation), one compiled
    variant bound by the family's `bind` (what resgen.ops.DecodeAttention serves). The timed
    call is the whole decode step: in-kernel query split, attention and the split reduction
    (a second launch for reduction "workspace")."""

    def __init__(self, compiled, variant, problem, device, n_sets, seed):
        self.variant, self.problem = variant, problem
        self.device = torch.device(device)
        self.shape = shape_of(variant, problem)
        self.op = FAMILY.bind(compiled, variant, problem, self.device)
        gen = torch.Generator(device=self.device).manual_seed(seed)
        self.gen = torch.Generator(device=self.device).manual_seed(seed + 1)
        p = problem
        self.sets = []
        for _ in range(max(1, n_sets)):
            cache, bt, sl = random_cache(p.batch, p.kv_heads, p.head_dim, p.kv_len,
                                         p.page_size, self.device, gen)
            q = torch.randn(p.batch, p.q_heads, p.head_dim, generator=gen,
                            device=self.device).to(torch.bfloat16)
            self.sets.append((q, cache, bt, sl))
        self.out = torch.empty(p.batch, p.q_heads, p.head_dim, dtype=torch.bfloat16,
                               device=self.device)
        self.cur = 0

    def rotate(self, i: int) -> None:
        self.cur = i % len(self.sets)

    def __call__(self) -> torch.Tensor:
        q, cache, bt, sl = self.sets[self.cur]
        return self.op(q, cache, bt, sl, out=self.out)

    def check_lengths(self) -> list[int]:
        """Sequence lengths of a check: the problem's (capped at 4096), a partial page, one
        token and an empty sequence (zeros expected)."""
        n = max(1, min(self.problem.kv_len, 4096))
        ps = self.problem.page_size
        return [n, ps + 5, 1, 0][:max(1, min(4, self.problem.batch + 3))]

    def check(self) -> CheckResult:
        """Fresh random K/V (quantized by the reference append) and queries, NaN-poisoned
        output, vs resgen.reference.decode_attention on the same cache."""
        from .. import reference
        from ..kvcache import PagedKVCache

        p = self.problem
        lens = self.check_lengths()
        ks = [torch.randn(p.kv_heads, n, p.head_dim, generator=self.gen, device=self.device)
              for n in lens]
        vs = [torch.randn(p.kv_heads, n, p.head_dim, generator=self.gen, device=self.device)
              for n in lens]
        cache, bt, sl = PagedKVCache.from_dense(ks, vs, page_size=p.page_size)
        q = (torch.randn(len(lens), p.q_heads, p.head_dim, generator=self.gen,
                         device=self.device) * 2).to(torch.bfloat16)
        out = torch.full_like(q, float("nan"))
        self.op(q, cache, bt.to(torch.int32).contiguous(), sl.to(torch.int32), out=out)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        ref = reference.decode_attention(q.float(), cache, bt, sl, compensation=p.compensation,
                                         pv="fp32" if p.pv == "f16" else "fp8", query=p.query)
        res = compare(out, ref, TOLERANCE[p.pv])
        if res.ok and lens[-1] == 0 and bool(out[-1].float().abs().max() != 0):
            return CheckResult(False, res.rel_err, res.tolerance,
                               "empty sequence did not produce zeros")
        return res
