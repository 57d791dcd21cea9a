"""Kernel family attention_sm100: ResAttn decode attention over the paged NVFP4 KV cache on
Blackwell (sm_100a): tcgen05 block-scaled QK (kind::mxf4nvf4, block16) with the query's base
and residue rows on the MMA's narrow N, the score fold in FP32 after the TMEM load, online
softmax, P.V on tcgen05 kind::f16 with V decoded exactly to FP16, split-KV.
Design and status: docs/attention_sm100.md. Nothing of this family has run on a GPU: there is
no Blackwell machine here; it compiles for sm_100a on the CPU and its tile math is simulated
(resgen.kernels.attention_sm100_sim).

Variant axes (AttentionSm100Variant) and what they change
(resgen/templates/attention_sm100.py.j2, geometry in resgen.kernels.attention_sm100_geom):
    qlayout     where the query's base and residue rows sit among the QK MMA's N columns:
                "plain" (no residue), "pair" (base j, residue j adjacent) or "half" (bases,
                then residues at + qk_n / 2): with the load shape it decides whether each
                base-residue score pair lands in one thread's registers
    tmem_shape, tmem_rep   the score load: tcgen05.ld .32x32b / .16x256b / .16x128b .x<rep>
    stages      depth of the shared-memory ring of K / V tiles (128 keys each); the template
                is single-buffered (no ring yet), so only stages = 1 is valid: the axis stays
                in the key so that ring variants, once built, are new keys
    splits      KV splits per (sequence, KV head); a run-time argument (one compile serves all)
    reduction   "none" (one split), "lastcta" (partials, the last CTA of a head reduces in
                split order: one launch) or "combine" (partials, a second kernel reduces)
Not axes (no field, so no key pretends otherwise): keys per tile (128, the 1-SM block-scaled
MMA's M; a 2-SM tile of 256 keys would pair two CTAs of one (sequence, head) in a cluster for
work that splits freely along the sequence anyway), P.V numerics (a workload field,
AttentionProblem.pv, as on Hopper: only "f16" is built here; "fp8" would be tcgen05
kind::f8f6f4 and is refused with that reason), the FP16 query (query="q16": refused).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Sequence

import torch

from ..kernels.attention_sm100_geom import KEYS, AttnSm100Geometry, FoldPlanError
from ..kernels.sm100_layout import SMEM_BYTES, TMEM_COLS, tmem_span
from .cover import covering_subset
from .family import CheckResult, KernelFamilyBase, compare, register
from .variant import AttentionProblem, Choice, IntRange, VariantBase

__all__ = ["QLayout", "TmemShape", "Reduction", "AttentionSm100Variant", "AttentionSm100Family",
           "FAMILY", "ARCH", "TOLERANCE", "geometry_of", "covering_cases", "ptx_problems",
           "HEAD_DIMS", "MAX_GROUP"]

ARCH = "sm_100a"
TOLERANCE = 3e-3            # BF16 output rounding and FP16 P, as attention_sm90's f16 PV
HEAD_DIMS = (128, 256)
MAX_GROUP = 16
MAX_SPLITS = 64
MIN_TILES_PER_SPLIT = 2
_SMS = 148


class QLayout(Choice):
    PLAIN = "plain"
    PAIR = "pair"
    HALF = "half"


class TmemShape(Choice):
    S32X32B = "32x32b"
    S16X256B = "16x256b"
    S16X128B = "16x128b"


class Reduction(Choice):
    NONE = "none"
    LASTCTA = "lastcta"
    COMBINE = "combine"


@dataclass(frozen=True, slots=True)
class AttentionSm100Variant(VariantBase):
    FAMILY: ClassVar[str] = "attention_sm100"
    qlayout: QLayout = field(default=QLayout.PAIR, metadata={"short": "q"})
    tmem_shape: TmemShape = field(default=TmemShape.S32X32B, metadata={"short": "t"})
    tmem_rep: int = field(default=8, metadata={"range": IntRange(1, 128, pow2=True),
                                                "short": "x"})
    stages: int = field(default=1, metadata={"range": IntRange(1, 8), "short": "st"})
    splits: int = field(default=1, metadata={"range": IntRange(1, MAX_SPLITS), "short": "s"})
    reduction: Reduction = field(default=Reduction.NONE, metadata={"short": "red"})


def geometry_of(variant: AttentionSm100Variant, problem: AttentionProblem) -> AttnSm100Geometry:
    return AttnSm100Geometry(head_dim=problem.head_dim,
                             group=problem.q_heads // max(1, problem.kv_heads),
                             page_size=problem.page_size, compensation=problem.compensation,
                             qlayout=variant.qlayout.value, tmem_shape=variant.tmem_shape.value,
                             tmem_rep=variant.tmem_rep, stages=variant.stages,
                             reduction=variant.reduction.value)


@functools.lru_cache(maxsize=4096)
def _plan_error(g: AttnSm100Geometry) -> str | None:
    try:
        g.ld_plan()
    except (FoldPlanError, ValueError) as e:
        return str(e)
    return None


def _tiles(problem: AttentionProblem) -> int:
    return max(1, math.ceil(problem.kv_len / KEYS))


class AttentionSm100Family(KernelFamilyBase):
    NAME: ClassVar[str] = "attention_sm100"
    VARIANT: ClassVar[type] = AttentionSm100Variant
    PROBLEM: ClassVar[type] = AttentionProblem
    TEMPLATE: ClassVar[str] = "attention_sm100.py.j2"
    ARCHS: ClassVar[tuple[str, ...]] = (ARCH,)
    ENTRY: ClassVar[str] = "entry"

    # ------------------------------------------------------------------ validity
    def problem_invalid(self, p: AttentionProblem) -> str | None:
        if p.head_dim not in HEAD_DIMS:
            return (f"head_dim {p.head_dim} not in {HEAD_DIMS} (P.V runs M = 128 head dims "
                    "per kind::f16 MMA; M = 64's TMEM layout is not built)")
        if p.q_heads % p.kv_heads:
            return f"{p.q_heads} query heads are not a multiple of {p.kv_heads} KV heads"
        group = p.q_heads // p.kv_heads
        if group > MAX_GROUP:
            return f"GQA group of {group} heads > {MAX_GROUP} (2 G query rows on N <= 32)"
        if p.page_size % 8:
            return f"page_size {p.page_size} is not a multiple of 8 (8-row operand atoms)"
        if KEYS % p.page_size and p.page_size % KEYS:
            return (f"page_size {p.page_size} neither divides nor is a multiple of the "
                    f"{KEYS}-key tile")
        if p.pv != "f16":
            return ("pv=fp8 (E4M3 P x E4M3 V, tcgen05 kind::f8f6f4) is not built on sm_100a; "
                    "V is decoded exactly to FP16 (pv=f16)")
        if p.query != "nvfp4":
            return "query=q16 (the FP16 query on kind::f16) is not built on sm_100a"
        return None

    def why_invalid(self, variant: AttentionSm100Variant, problem: AttentionProblem,
                    arch: str) -> str | None:
        v, p = variant, problem
        if arch not in self.ARCHS:
            return f"attention_sm100 runs on {self.ARCHS}, not {arch}"
        if not isinstance(v, AttentionSm100Variant) or not isinstance(p, AttentionProblem):
            return "not an AttentionSm100Variant / AttentionProblem"
        why = self.problem_invalid(p)
        if why:
            return why
        if p.compensation and v.qlayout == QLayout.PLAIN:
            return "ResAttn has base and residue query rows: qlayout pair or half"
        if not p.compensation and v.qlayout != QLayout.PLAIN:
            return f"qlayout {v.qlayout.value} places residue rows; plain NVFP4-KV has none"
        if (v.splits > 1) != (v.reduction != Reduction.NONE):
            return ("splits > 1 needs reduction lastcta/combine" if v.splits > 1
                    else f"reduction={v.reduction.value} with a single split")
        if v.splits > _tiles(p):
            return f"{v.splits} splits > {_tiles(p)} tiles of {KEYS} keys (empty splits)"
        if v.stages != 1:
            return (f"stages={v.stages}: the kernel is single-buffered (one K / V tile in "
                    "shared memory, no ring yet): stages=1 only")
        g = geometry_of(v, p)
        lanes, cols, regs = tmem_span(v.tmem_shape.value, v.tmem_rep)
        if regs > 128:
            return f".{v.tmem_shape.value}.x{v.tmem_rep} loads {regs} registers (at most 128)"
        if g.qk_n % cols:
            return (f".{v.tmem_shape.value}.x{v.tmem_rep} loads {cols} columns; the score "
                    f"tile has {g.qk_n} (N of the QK MMA)")
        why = _plan_error(g)
        if why is not None:
            return why
        if g.tmem_alloc > TMEM_COLS:
            return f"{g.tmem_alloc} TMEM columns per CTA (at most {TMEM_COLS})"
        if g.smem_bytes > SMEM_BYTES:
            return (f"{g.smem_bytes} bytes of shared memory per CTA for {v.stages} stages "
                    f"(at most {SMEM_BYTES})")
        if g.o_regs + 2 * regs > 160:
            return (f"{g.o_regs} output accumulators + {regs} score registers per thread: over "
                    "the register budget (would spill)")
        try:
            g.check()
        except ValueError as e:
            return str(e)
        return None

    # ------------------------------------------------------------------ space
    @staticmethod
    def _tmem_options(qk_n: int) -> list[tuple[TmemShape, int]]:
        """Per shape, the loads covering the whole score tile and half of it."""
        out = []
        for shape in TmemShape:
            per = tmem_span(shape.value, 1)[1]
            for c in dict.fromkeys((qk_n, qk_n // 2)):
                if c >= per and c % per == 0:
                    out.append((shape, c // per))
        return out

    def _splits(self, problem: AttentionProblem) -> list[int]:
        s0 = self.default(problem, ARCH).splits if not self.problem_invalid(problem) else 1
        top = min(MAX_SPLITS, max(1, _tiles(problem) // MIN_TILES_PER_SPLIT))
        return sorted({s for s in (1, s0 // 2, s0, 2 * s0) if 1 <= s <= top})

    def space(self, problem: AttentionProblem, arch: str) -> Sequence[AttentionSm100Variant]:
        """Every valid candidate in a fixed order: query layout, score load (every shape at the
        repetitions covering the whole and half the tile), one stage (single-buffered), split counts
        1 and the default's x 1/2, 1, 2 (at least MIN_TILES_PER_SPLIT tiles a split), both
        reductions."""
        if self.problem_invalid(problem) or arch not in self.ARCHS:
            return []
        lays = [QLayout.PAIR, QLayout.HALF] if problem.compensation else [QLayout.PLAIN]
        g0 = geometry_of(AttentionSm100Variant(qlayout=lays[0]), problem)
        out = []
        for lay in lays:
            for shape, rep in self._tmem_options(g0.qk_n):
                for st in (1,):
                    for s in self._splits(problem):
                        reds = ([Reduction.NONE] if s == 1
                                else [Reduction.LASTCTA, Reduction.COMBINE])
                        for red in reds:
                            v = AttentionSm100Variant(lay, shape, rep, st, s, red)
                            if self.why_invalid(v, problem, arch) is None:
                                out.append(v)
        d = self.default(problem, arch)
        if d not in out:
            out.insert(0, d)
        return out

    def default(self, problem: AttentionProblem, arch: str) -> AttentionSm100Variant:
        """The fallback rule: pair (ResAttn) or plain rows, .32x32b loads of the whole score
        tile, one stage (the kernel is single-buffered), enough splits for about two CTAs per
        B200 SM but at least MIN_TILES_PER_SPLIT tiles a split, reduced in the last CTA."""
        why = self.problem_invalid(problem)
        if why:
            raise ValueError(f"attention_sm100 cannot run {problem.key()}: {why}")
        lay = QLayout.PAIR if problem.compensation else QLayout.PLAIN
        g = geometry_of(AttentionSm100Variant(qlayout=lay), problem)
        ctas = problem.batch * problem.kv_heads
        want = math.ceil(2 * _SMS / max(1, ctas))
        cap = max(1, _tiles(problem) // MIN_TILES_PER_SPLIT)
        s = max(1, min(want, cap, MAX_SPLITS))
        red = Reduction.NONE if s == 1 else Reduction.LASTCTA
        for st in (1,):
            v = AttentionSm100Variant(lay, TmemShape.S32X32B, g.qk_n, st, s, red)
            if self.why_invalid(v, problem, arch) is None:
                return v
        raise ValueError(f"attention_sm100 cannot run {problem.key()}: "
                         f"{self.why_invalid(v, problem, arch)}")

    def prior(self, variant: AttentionSm100Variant, problem: AttentionProblem) -> float:
        """The analytical B200 model's prediction in microseconds (never measured)."""
        from ..kernels.attention_sm100_model import predict

        return predict(geometry_of(variant, problem), problem.batch, problem.kv_heads,
                       problem.kv_len, variant.splits).total_us

    # ------------------------------------------------------------------ codegen
    def template_params(self, variant: AttentionSm100Variant, problem: AttentionProblem) -> dict:
        """Typed fields only; the split count is a run-time argument and not rendered."""
        g = geometry_of(variant, problem)
        return {"head_dim": int(g.head_dim), "group": int(g.group),
                "page_size": int(g.page_size), "compensation": bool(g.compensation),
                "qlayout": g.qlayout, "tmem_shape": g.tmem_shape, "tmem_rep": int(g.tmem_rep),
                "stages": int(g.stages), "reduction": g.reduction}

    def compile_key(self, variant: AttentionSm100Variant,
                    problem: AttentionProblem) -> AttentionProblem:
        """Batch, KV length and head counts are run-time arguments (only the group is
        compiled in), as for attention_sm90."""
        group = problem.q_heads // problem.kv_heads
        return replace(problem, batch=1, kv_len=0, q_heads=group, kv_heads=1)

    def compile_args(self, variant: AttentionSm100Variant, problem: AttentionProblem) -> list:
        from ..kernels.attention_sm100 import attention_args

        return attention_args()

    # ------------------------------------------------------------------ running
    def bind(self, compiled: Any, variant: AttentionSm100Variant, problem: AttentionProblem,
             device: torch.device | str) -> Any:
        """The decode step of a compiled variant: resgen.kernels.attention_sm100.
        DecodeAttentionSm100, op(q, cache, block_tables, seq_lens, out=None, sm_scale=None)
        (q: bf16 [B, Hq, D] -> bf16 [B, Hq, D]), its split workspace for the problem's batch
        allocated now. Never run: there is no Blackwell GPU here."""
        from ..kernels.attention_sm100 import DecodeAttentionSm100

        op = DecodeAttentionSm100(compiled, geometry_of(variant, problem), variant.splits)
        device = torch.device(device)
        if device.type == "cuda":
            op.workspace(problem.batch, problem.kv_heads, device)
        return op

    def runner(self, compiled: Any, variant: AttentionSm100Variant, problem: AttentionProblem,
               device: Any, n_sets: int = 1, seed: int = 0) -> "AttentionSm100Runner":
        return AttentionSm100Runner(compiled, variant, problem, device, n_sets, seed)


FAMILY = register(AttentionSm100Family())


class AttentionSm100Runner:
    """n_sets random caches of the problem's geometry, the compiled variant bound by the
    family's `bind`; the timed call is the whole decode step (query operand, attention, split
    reduction). check(): fresh K/V and queries, a NaN-poisoned output, against
    resgen.reference.decode_attention on the same cache. Written for a B200, never run."""

    def __init__(self, compiled, variant, problem, device, n_sets, seed):
        from ..kvcache import PagedKVCache

        self.variant, self.problem = variant, problem
        self.device = torch.device(device)
        self.op = FAMILY.bind(compiled, variant, problem, self.device)
        self.gen = torch.Generator(device=self.device).manual_seed(seed + 1)
        gen = torch.Generator(device=self.device).manual_seed(seed)
        p = problem
        self.sets = []
        for _ in range(max(1, n_sets)):
            ks = [torch.randn(p.kv_heads, p.kv_len, p.head_dim, generator=gen,
                              device=self.device) for _ in range(p.batch)]
            cache, bt, sl = PagedKVCache.from_dense(ks, ks, page_size=p.page_size)
            q = torch.randn(p.batch, p.q_heads, p.head_dim, generator=gen,
                            device=self.device).to(torch.bfloat16)
            self.sets.append((q, cache, bt.to(torch.int32), sl.to(torch.int32)))
        self.out = torch.empty(p.batch, p.q_heads, p.head_dim, dtype=torch.bfloat16,
                               device=self.device)
        self.cur = 0

    def rotate(self, i: int) -> None:
        self.cur = i % len(self.sets)

    def __call__(self) -> torch.Tensor:
        q, cache, bt, sl = self.sets[self.cur]
        return self.op(q, cache, bt, sl, out=self.out)

    def check(self) -> CheckResult:
        from .. import reference
        from ..kvcache import PagedKVCache

        p = self.problem
        lens = [max(1, min(p.kv_len, 4096)), p.page_size + 5, 1, 0]
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
                                         pv="fp32")
        return compare(out, ref, TOLERANCE)


# ----------------------------------------------------------------------------- compile checks

COVER_PROBLEMS = (AttentionProblem(batch=1, q_heads=32, kv_heads=8, head_dim=128, kv_len=8192,
                                   page_size=32, compensation=True),
                  AttentionProblem(batch=8, q_heads=64, kv_heads=8, head_dim=128,
                                   kv_len=32768, page_size=32, compensation=False),
                  AttentionProblem(batch=1, q_heads=16, kv_heads=4, head_dim=256,
                                   kv_len=8192, page_size=256, compensation=True))


def covering_cases() -> list[tuple[AttentionProblem, AttentionSm100Variant]]:
    """(problem, variant) pairs in which every value of every variant axis of the spaces of
    COVER_PROBLEMS (split counts as "1" / "more than 1": it is a run-time argument), both
    head dims and both modes appear at least once (greedy set cover): what CI compiles."""
    items: list[Any] = [(p, v) for p in COVER_PROBLEMS for v in FAMILY.space(p, ARCH)]

    def pairs(item):
        p, v = item
        out = {(f, getattr(v, f)) for f in v.__dataclass_fields__ if f != "splits"}
        return out | {("split", v.splits > 1), ("d", p.head_dim), ("comp", p.compensation)}

    return covering_subset(items, pairs)


def ptx_problems(variant: AttentionSm100Variant, problem: AttentionProblem, ptx: str
                 ) -> list[str]:
    """What is wrong with a compiled variant's PTX (empty: nothing): the block-scaled QK MMA
    (kind::mxf4nvf4, block16, cta_group::1), the P.V MMA (kind::f16), score loads of exactly
    the variant's shape and repetition, each waited on, the O loads (.32x32b), scale factors
    copied into TMEM, the fold's FP32 mul / add, ex2, the split reduction's instructions, no
    local memory."""
    g = geometry_of(variant, problem)
    bad = []

    def need(s, why):
        if s not in ptx:
            bad.append(f"no {s!r} ({why})")

    need(".target sm_100a", "the arch")
    need("tcgen05.mma.cta_group::1.kind::mxf4nvf4.block_scale.block16", "the QK MMA")
    need("tcgen05.mma.cta_group::1.kind::f16", "the P.V MMA")
    kinds = {"kind::mxf4nvf4", "kind::f16"}
    for line in ptx.splitlines():
        if "tcgen05.mma" in line and not any(k in line for k in kinds):
            bad.append(f"another tcgen05.mma kind: {line.strip()}")
            break
    ld = f"tcgen05.ld.sync.aligned.{g.tmem_shape}.x{g.tmem_rep}.b32"
    want = len(g.ld_plan()[0])
    if ptx.count(ld) < want:
        bad.append(f"{ptx.count(ld)} x {ld!r}, want >= {want} (the score plan)")
    old = f"tcgen05.ld.sync.aligned.32x32b.x{g.pv_n}.b32"
    need(old, "the O loads")
    others = [s for s in ("32x32b", "16x256b", "16x128b")
              for line in ptx.splitlines()
              if f"tcgen05.ld.sync.aligned.{s}." in line
              and f".{s}.x{g.tmem_rep}." not in line and f"32x32b.x{g.pv_n}." not in line]
    if others:
        bad.append(f"a TMEM load of another shape ({others[0]})")
    if ptx.count("tcgen05.wait::ld.sync.aligned") < 2:
        bad.append("TMEM loads without tcgen05.wait::ld")
    need("tcgen05.cp.cta_group::1.32x128b.warpx4", "scale factors into TMEM")
    need("tcgen05.alloc.cta_group::1", "TMEM allocation")
    need("mul.rn.f32", "the fold's FP32 products")
    if problem.compensation:
        need("add.rn.f32", "the fold's FP32 add")
    need("ex2.approx", "the softmax's exp2")
    if g.reduction == "lastcta":
        need("atom.global.acq_rel.gpu.add.u32", "the last-CTA counter")
        need("ld.global.cg.f32", "the last CTA reads the partials from L2")
    if g.reduction in ("lastcta", "combine"):
        need("st.global.f32", "split partials")
    if "ld.local" in ptx or "st.local" in ptx:
        bad.append("local memory")
    return bad
