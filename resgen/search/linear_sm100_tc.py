"""Kernel family linear_sm100_tc: Blackwell (sm_100a) FP4 linear layers on tcgen05 block-scaled
MMA (NVFP4: kind::mxf4nvf4, E4M3 scales per 16; MXFP4: E8M0 scales per 32), accumulators in
tensor memory, operand swap, the M-Ext fold after the TMEM load, K-Ext, split-K.
Design and numbers: docs/linear_sm100.md. Nothing of this family has run on a GPU: there is
no Blackwell machine here; it compiles for sm_100a on the CPU and its tile math is simulated
(resgen.kernels.linear_sm100_tc_sim).

The variant axes (LinearSm100Variant) and what they change in the kernel
(resgen/templates/linear_sm100_tc.py.j2, geometry in resgen.kernels.linear_sm100_tc_geom):
    tile_m      MMA M: 128 (one SM) or 256 (a 2-SM CTA pair, tcgen05 cta_group::2)
    tile_n      MMA N (8..256, a power of two): with swap, activation rows per tile (the
                narrow side: decode rows fit a tile of 8-32); without, channels (128 / 256)
    tile_k      K per pipeline stage: 128 or 256 (2 or 4 MMAs of K = 64)
    cluster_m, cluster_n   CTAs per cluster along M / N (TMA multicast of the shared operand;
                a 2-SM tile needs cluster_m even)
    stages      depth of the TMA -> MMA shared-memory ring
    swap        weights as the MMA's A operand (True) or B (False): a host-side choice of which
                tensor is passed as A
    layout      activation rows: plain (none / K-Ext), row_pair or tile8 (M-Ext: where the
                base and residue rows sit, which decides which TMEM load shapes keep each
                base-residue pair in one thread)
    tmem_shape, tmem_rep   the epilogue's tcgen05.ld: .32x32b / .16x256b / .16x128b and its
                repetition count .x<rep> (registers per load: rep, 4 rep, 2 rep)
    store       "direct" (st.global from registers) or "tma" (a bf16 shared-memory tile, one
                bulk copy per token row)
    split_k, reduce   CTAs along K and how they meet: "workspace" (partials + per-tile
                semaphore, the last CTA sums in split order: deterministic) or "atomic"
                (red.global.add, the last CTA converts and re-zeroes; not deterministic)
Not implemented (no field, so no key pretends otherwise): a persistent tile scheduler, PDL,
activation quantization fused into the GEMM (the layer is quant_sm100 + this kernel, as in the
paper: its quantizer writes the layout the GEMM reads).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Sequence

import torch

from ..kernels.linear_sm100_tc_geom import FoldPlanError, Sm100Geometry
from ..kernels.sm100_layout import act_rows, pow2_ceil, round_up, tmem_span
from .cover import covering_subset
from .family import CheckResult, KernelFamilyBase, register
from .family import compare as family_compare
from .variant import Choice, IntRange, LinearProblem, VariantBase

__all__ = ["RowLayout", "TmemShape", "Store", "Reduction", "WeightPacking",
           "LinearSm100Variant", "LinearSm100Family", "FAMILY", "TOLERANCE", "ARCH",
           "geometry_of", "kp_of", "mode_of", "LinearSm100Runner", "Sm100LinearBinding",
           "covering_cases", "ptx_problems"]

TOLERANCE = 3e-3
ARCH = "sm_100a"
_WS_MAX = 256 << 20          # split-K workspace bytes
_SMS = 148                   # B200 SMs (NVIDIA's published figure; the space's wave rule)
K_ALIGN = 256


class RowLayout(Choice):
    PLAIN = "plain"
    ROW_PAIR = "row_pair"
    TILE8 = "tile8"


class TmemShape(Choice):
    S32X32B = "32x32b"
    S16X256B = "16x256b"
    S16X128B = "16x128b"


class Store(Choice):
    DIRECT = "direct"
    TMA = "tma"


class WeightPacking(Choice):
    TCGEN05 = "tcgen05"


class Reduction(Choice):
    NONE = "none"
    WORKSPACE = "workspace"
    ATOMIC = "atomic"


@dataclass(frozen=True, slots=True)
class LinearSm100Variant(VariantBase):
    FAMILY: ClassVar[str] = "linear_sm100_tc"
    tile_m: int = field(default=128, metadata={"range": IntRange(128, 256, pow2=True),
                                               "short": "m"})
    tile_n: int = field(default=8, metadata={"range": IntRange(8, 256, pow2=True),
                                             "short": "n"})
    tile_k: int = field(default=256, metadata={"range": IntRange(128, 256, pow2=True),
                                               "short": "k"})
    cluster_m: int = field(default=1, metadata={"range": IntRange(1, 4, pow2=True),
                                                "short": "cm"})
    cluster_n: int = field(default=1, metadata={"range": IntRange(1, 4, pow2=True),
                                                "short": "cn"})
    stages: int = field(default=4, metadata={"range": IntRange(2, 12), "short": "st"})
    swap: bool = field(default=True, metadata={"short": "sw"})
    layout: RowLayout = field(default=RowLayout.PLAIN, metadata={"short": "L"})
    tmem_shape: TmemShape = field(default=TmemShape.S32X32B, metadata={"short": "t"})
    tmem_rep: int = field(default=8, metadata={"range": IntRange(1, 128, pow2=True),
                                               "short": "x"})
    store: Store = field(default=Store.DIRECT, metadata={"short": "s"})
    split_k: int = field(default=1, metadata={"range": IntRange(1, 16), "short": "sk"})
    reduce: Reduction = field(default=Reduction.NONE, metadata={"short": "red"})

    @property
    def cta_group(self) -> int:
        return self.tile_m // 128

    @property
    def packing(self) -> "WeightPacking":
        """The weight layout (not a field: one layout for every variant; resgen.ops asks)."""
        return WeightPacking.TCGEN05

    @property
    def deterministic(self) -> bool:
        return self.reduce != Reduction.ATOMIC


# Blackwell's block-scaled MMAs take FP4 operands: a sum rounded to FP16 is not one
KEXT_PRESUM_SM90 = ("K-Ext presum (fold='presum') is a Hopper fold (an FP16 operand): "
                    "linear_sm100_tc runs the exact K-Ext fold")


def mode_of(problem: LinearProblem) -> str:
    if problem.compensation == "none":
        return "plain"
    return "mext" if problem.compensation == "full" else "kext"


def kp_of(problem: LinearProblem) -> int:
    """Kp: the MMA's reduction length (K, or K + ext, rounded up to one 256-wide K tile)."""
    block = 16 if problem.fmt == "nvfp4" else 32
    return round_up(problem.k_ext(block), K_ALIGN)


def geometry_of(variant: LinearSm100Variant, problem: LinearProblem) -> Sm100Geometry:
    v = variant
    return Sm100Geometry(fmt=problem.fmt, mode=mode_of(problem), layout=v.layout.value,
                         swap=bool(v.swap), n=problem.n, kp=kp_of(problem), tile_m=v.tile_m,
                         tile_n=v.tile_n, tile_k=v.tile_k, cta_group=v.cta_group,
                         cluster_m=v.cluster_m, cluster_n=v.cluster_n, stages=v.stages,
                         tmem_shape=v.tmem_shape.value, tmem_rep=v.tmem_rep,
                         store=v.store.value, split_k=v.split_k, reduce=v.reduce.value)


@functools.lru_cache(maxsize=4096)
def _plan_error(g: Sm100Geometry) -> str | None:
    """Why the geometry's TMEM load plan cannot run (cached: the plan proves every pair for
    every thread)."""
    try:
        g.ld_plan()
    except (FoldPlanError, ValueError) as e:
        return str(e)
    return None


class LinearSm100Family(KernelFamilyBase):
    NAME: ClassVar[str] = "linear_sm100_tc"
    VARIANT: ClassVar[type] = LinearSm100Variant
    PROBLEM: ClassVar[type] = LinearProblem
    TEMPLATE: ClassVar[str] = "linear_sm100_tc.py.j2"
    ARCHS: ClassVar[tuple[str, ...]] = (ARCH,)
    ENTRY: ClassVar[str] = "entry"

    # ------------------------------------------------------------------ validity
    def problem_invalid(self, problem: Any) -> str | None:
        """KernelFamilyBase's refusals, and K-Ext presum (a Hopper fold: no tuning job)."""
        if isinstance(problem, LinearProblem) and problem.kext_presum:
            return KEXT_PRESUM_SM90
        return super().problem_invalid(problem)

    def why_invalid(self, variant: LinearSm100Variant, problem: LinearProblem,
                    arch: str) -> str | None:
        v, p = variant, problem
        if arch not in self.ARCHS:
            return f"linear_sm100_tc runs on {self.ARCHS}, not {arch}"
        if not isinstance(v, LinearSm100Variant) or not isinstance(p, LinearProblem):
            return "not a LinearSm100Variant / LinearProblem"
        if p.kext_presum:
            return KEXT_PRESUM_SM90
        mext = p.compensation == "full"
        if mext and v.layout == RowLayout.PLAIN:
            return "M-Ext needs base and residue rows: layout row_pair or tile8"
        if not mext and v.layout != RowLayout.PLAIN:
            return f"layout {v.layout.value} is for M-Ext; {p.compensation} uses plain rows"
        if p.n % 8:
            return f"N={p.n} is not a multiple of 8 (16-byte output rows)"
        if v.cta_group == 2 and v.tile_n < 16:
            return "a 2-SM MMA (tile_m 256) needs tile_n >= 16"
        if not v.swap and v.tile_n < 128:
            return ("without swap the weights are the B operand: a channel tile of 128 or 256 "
                    "(whole 128-row scale-factor atoms)")
        if mext and v.layout == RowLayout.TILE8:
            a_tile = v.tile_n if v.swap else 128
            if a_tile % 16:
                return f"tile8 rows come in groups of 16; the activation tile has {a_tile}"
        if v.cluster_m % v.cta_group:
            return "a 2-SM MMA needs cluster_m to be a multiple of 2 (the CTA pair)"
        if v.cluster_m * v.cluster_n > 16:
            return f"a cluster of {v.cluster_m * v.cluster_n} CTAs (at most 16)"
        kp = kp_of(p)
        kt = kp // v.tile_k
        if kt % v.split_k:
            return f"Kp/{v.tile_k} = {kt} K tiles do not split evenly over split_k = {v.split_k}"
        if (v.split_k > 1) != (v.reduce != Reduction.NONE):
            return ("split_k > 1 needs reduce workspace/atomic" if v.split_k > 1
                    else f"reduce={v.reduce.value} without split_k > 1")
        if not v.swap and v.tmem_shape == TmemShape.S16X128B and v.split_k > 1:
            # sm_100a compile (2026-12-01 pre-flight): 254 registers and 112 bytes of local
            # memory for 256-channel tiles; 206-214 registers without split-K
            return ("unswapped .16x128b loads with split-K spill (the second half's address "
                    "math for 2 values per lane and repetition)")
        if v.split_k > 1 and v.store == Store.TMA:
            return "split-K's last CTA stores from registers: store tma needs split_k = 1"
        if v.stages > max(2, kt // v.split_k):
            return f"{v.stages} stages for {kt // v.split_k} K tiles per CTA"
        lanes, cols, regs = tmem_span(v.tmem_shape.value, v.tmem_rep)
        if regs > 128:
            return f".{v.tmem_shape.value}.x{v.tmem_rep} loads {regs} registers (at most 128)"
        if v.tile_n % cols:
            return (f".{v.tmem_shape.value}.x{v.tmem_rep} loads {cols} columns; the "
                    f"accumulator tile has {v.tile_n}")
        g = geometry_of(v, p)
        if v.store == Store.TMA and p.n % g.channels_per_cta:
            return (f"the tma store writes whole channel tiles of {g.channels_per_cta}; "
                    f"N={p.n} is not a multiple")
        why = _plan_error(g)
        if why is not None:
            return why
        if g.tmem_alloc > 512:
            return f"{g.tmem_alloc} TMEM columns per CTA (at most 512)"
        if g.smem_bytes > 227 * 1024:
            return f"{g.smem_bytes} bytes of shared memory per CTA (at most 227 KB)"
        if v.reduce == Reduction.WORKSPACE and v.split_k * p.m * p.n * 4 > _WS_MAX:
            return "split-K workspace over 256 MB"
        try:
            g.check()
        except ValueError as e:          # every rule above should have caught it first
            return str(e)
        return None

    # ------------------------------------------------------------------ space
    def _layouts(self, problem: LinearProblem) -> list[RowLayout]:
        if problem.compensation == "full":
            return [RowLayout.ROW_PAIR, RowLayout.TILE8]
        return [RowLayout.PLAIN]

    @staticmethod
    def _token_tiles(rows: int) -> list[int]:
        """Tile widths for `rows` activation rows: the one covering them all (8..256) and half
        of it (twice the tiles along N)."""
        full = min(256, max(8, pow2_ceil(rows)))
        return [full] + ([full // 2] if full > 8 else [])

    @staticmethod
    def _tmem_options(tile_n: int) -> list[tuple[TmemShape, int]]:
        """Per shape, the loads covering min(tile_n, 16) and min(tile_n, 64) columns."""
        out = []
        for shape in TmemShape:
            per = tmem_span(shape.value, 1)[1]
            for cols in dict.fromkeys((min(tile_n, 16), min(tile_n, 64))):
                if cols % per == 0:
                    out.append((shape, cols // per))
        return out

    def space(self, problem: LinearProblem, arch: str) -> Sequence[LinearSm100Variant]:
        """The candidates worth timing, in a fixed order (every one valid): per activation
        row layout, swapped tiles covering the rows in one or two tiles (and, from 64 rows,
        unswapped 128 / 256-channel tiles), 1-SM and 2-SM MMAs (clusters of 1 and 2 CTAs
        along M), K tiles of 256, 3 / 4 / 6 / 8 stages, every TMEM load shape at two repetition
        counts, both store paths, and split-K by 2 / 4 (workspace and atomic) where the
        tiles alone leave the 148 SMs of a B200 short."""
        out = []
        m = problem.m
        kt = kp_of(problem) // 256
        for layout in self._layouts(problem):
            rows = act_rows(m, layout.value)
            shapes = [(True, tn) for tn in self._token_tiles(rows)]
            if rows >= 64:
                shapes += [(False, 128), (False, 256)]
            for swap, tn in shapes:
                for tm, cms in ((128, (1, 2)), (256, (2,))):
                    for cm in cms:
                        a_rows = problem.n if swap else rows
                        b_rows = rows if swap else problem.n
                        tiles = -(-a_rows // tm) * -(-b_rows // tn)
                        splits = [(1, Reduction.NONE)]
                        if tiles < _SMS:
                            splits += [(s, r) for s in (2, 4) if kt % s == 0
                                       for r in (Reduction.WORKSPACE, Reduction.ATOMIC)]
                        for st in (3, 4, 6, 8):
                            for sk, red in splits:
                                for store in (Store.DIRECT, Store.TMA):
                                    for shape, rep in self._tmem_options(tn):
                                        v = LinearSm100Variant(tm, tn, 256, cm, 1, st, swap,
                                                               layout, shape, rep, store, sk,
                                                               red)
                                        if self.why_invalid(v, problem, arch) is None:
                                            out.append(v)
        d = self.default(problem, arch)
        if d not in out:
            out.insert(0, d)
        return list(dict.fromkeys(out))

    def default(self, problem: LinearProblem, arch: str) -> LinearSm100Variant:
        """The runtime's fallback: swapped 128-channel tiles covering up to 256 activation rows
        (row_pair for M-Ext), 256-wide K tiles, the deepest ring of at most 4 stages that fits,
        .32x32b loads of up to 32 columns, direct stores, no split, no cluster."""
        layout = RowLayout.ROW_PAIR if problem.compensation == "full" else RowLayout.PLAIN
        rows = act_rows(problem.m, layout.value)
        tn = min(256, max(8, pow2_ceil(rows)))
        kt = kp_of(problem) // 256
        for st in (4, 3, 2):
            v = LinearSm100Variant(128, tn, 256, 1, 1, min(st, max(2, kt)), True, layout,
                                   TmemShape.S32X32B, min(tn, 32), Store.DIRECT, 1,
                                   Reduction.NONE)
            if self.why_invalid(v, problem, arch) is None:
                return v
        v = replace(v, tile_k=128, stages=2)
        why = self.why_invalid(v, problem, arch)
        if why is not None:
            raise ValueError(f"linear_sm100_tc cannot run {problem.key()}: {why}")
        return v

    def prior(self, variant: LinearSm100Variant, problem: LinearProblem) -> float:
        """The analytical B200 latency model's prediction in microseconds (lower first;
        resgen.kernels.linear_sm100_tc_model, docs/linear_sm100.md): the tuner's order on
        Blackwell until measurements exist. Never measured: there is no Blackwell GPU here."""
        from ..kernels.linear_sm100_tc_model import predict

        return predict(geometry_of(variant, problem), problem.m).total_us

    # ------------------------------------------------------------------ codegen
    def template_params(self, variant: LinearSm100Variant, problem: LinearProblem) -> dict:
        g = geometry_of(variant, problem)
        return {"fmt": g.fmt, "mode": g.mode, "layout": g.layout, "swap": bool(g.swap),
                "n": int(g.n), "kp": int(g.kp), "tile_m": int(g.tile_m),
                "tile_n": int(g.tile_n), "tile_k": int(g.tile_k),
                "cta_group": int(g.cta_group), "cluster_m": int(g.cluster_m),
                "cluster_n": int(g.cluster_n), "stages": int(g.stages),
                "tmem_shape": g.tmem_shape, "tmem_rep": int(g.tmem_rep), "store": g.store,
                "split_k": int(g.split_k), "reduce": g.reduce}

    def compile_key(self, variant: LinearSm100Variant, problem: LinearProblem) -> LinearProblem:
        """M is a run-time argument (tokens and operand rows; the grid and the TMA descriptors
        follow it): one compile per (format, mode, N, K(+ext)); the activation tensor scale
        is read from memory either way, so static_scale plays no part either."""
        return replace(problem, m=1, static_scale=True)

    def compile_args(self, variant: LinearSm100Variant, problem: LinearProblem) -> list[Any]:
        import cuda.bindings.driver as cuda
        import cutlass
        import cutlass.cute as cute
        from cutlass.cute.runtime import make_ptr

        gm = cute.AddressSpace.gmem
        sf = cutlass.Float8E4M3FN if problem.fmt == "nvfp4" else cutlass.Float8E8M0FNU
        return [make_ptr(cutlass.Float4E2M1FN, 0, gm, 32),
                make_ptr(cutlass.Float4E2M1FN, 0, gm, 32), make_ptr(sf, 0, gm, 32),
                make_ptr(sf, 0, gm, 32), make_ptr(cutlass.BFloat16, 0, gm, 16),
                make_ptr(cutlass.Float32, 0, gm, 4), make_ptr(cutlass.Float32, 0, gm, 4),
                make_ptr(cutlass.Float32, 0, gm, 16), make_ptr(cutlass.Int32, 0, gm, 4),
                cutlass.Int32(1), cutlass.Int32(1), cuda.CUstream(0)]

    # ------------------------------------------------------------------ running
    def working_set_bytes(self, variant: LinearSm100Variant, problem: LinearProblem) -> int:
        """Bytes of one input set (weights + scale factors + activation operand + output)."""
        kp = kp_of(problem)
        per_w = 0.5 + (1 / 16 if problem.fmt == "nvfp4" else 1 / 32)
        rows = act_rows(problem.m, variant.layout.value)
        return int(round_up(problem.n, 128) * kp * per_w + rows * kp * per_w * 2
                   + problem.m * problem.n * 2 + problem.m * problem.k * 2)

    # ------------------------------------------------------------------ the launch
    def layout(self, qweight: Any, packing: str | None = None) -> Any:
        """The weight in the tcgen05 operand layout (one layout for every variant: `packing`
        is accepted for resgen.ops and must be None or "tcgen05")."""
        from ..kernels.linear_sm100_tc import prepare_sm100_weight

        if packing not in (None, WeightPacking.TCGEN05.value):
            raise ValueError(f"linear_sm100_tc has one weight layout (tcgen05), not {packing!r}")
        return prepare_sm100_weight(qweight)

    def needs_quantizer(self, variant: LinearSm100Variant) -> bool:
        """Every variant reads a prepared operand: quant_sm100 in front (the paper's split)."""
        return True

    def launcher(self, compiled: Any, variant: LinearSm100Variant, problem: LinearProblem,
                 device: Any) -> Any:
        """The GEMM launch of a compiled variant, its split-K workspace sized for `problem`."""
        from ..kernels.linear_sm100_tc import LinearSm100Launcher

        rows = act_rows(problem.m, variant.layout.value)
        return LinearSm100Launcher(compiled, geometry_of(variant, problem), max(rows, 16),
                                   device)

    def default_quantizer(self, variant: LinearSm100Variant, problem: LinearProblem) -> Any:
        """The layer quantizer `bind` puts in front when given none (resgen.search
        .sm100_linear.layer_quantizer for the variant's row layout and SF tile)."""
        from .sm100_linear import layer_quantizer

        g = geometry_of(variant, problem)
        return layer_quantizer(problem, g.layout, g.act_sf_tile)

    def warm(self, variant: LinearSm100Variant, problem: LinearProblem) -> None:
        """The tuner's pre-lock hook: compile the layer quantizer the runner will bind."""
        self.default_quantizer(variant, problem)

    def bind(self, compiled: Any, variant: LinearSm100Variant, problem: LinearProblem,
             weight: Any, device: Any, *, quantizer: Any = None, alpha: Any = None,
             masks: Any = None, launcher: Any = None) -> "Sm100LinearBinding":
        """The whole layer of `problem` on `weight` (layout()): run(xb, out), quant_sm100
        writing the operand (its outputs allocated here, for problem.m tokens), then the GEMM.

        quantizer: a compiled quant_sm100 kernel (or a stand-in with outputs() and __call__)
        writing this variant's operand layout; None: default_quantizer. alpha: the static NVFP4
        scale (resgen.calibrate.static_alpha) or None; masks: the K-Ext masks or None;
        launcher: the GEMM launch to share (self.launcher(...)); None: a new one."""
        device = torch.device(device)
        if quantizer is None:
            quantizer = self.default_quantizer(variant, problem)
        if launcher is None:
            launcher = self.launcher(compiled, variant, problem, device)
        return Sm100LinearBinding(launcher, quantizer, problem, weight, device, alpha, masks)

    def runner(self, compiled: Any, variant: LinearSm100Variant, problem: LinearProblem,
               device: Any, n_sets: int = 1, seed: int = 0, *,
               quantizer: Any = None) -> "LinearSm100Runner":
        return LinearSm100Runner(compiled, variant, problem, device, n_sets, seed,
                                 quantizer=quantizer)

    # ------------------------------------------------------------------ model helpers
    def best_predicted(self, problem: LinearProblem, keep: Any = None) -> tuple[Any, Any]:
        """(variant, Breakdown) of the space's variant the B200 model predicts fastest (keep:
        an optional filter)."""
        from ..kernels.linear_sm100_tc_model import predict

        cands = [v for v in self.space(problem, ARCH) if keep is None or keep(v)]
        if not cands:
            raise ValueError(f"no variant of the space passes the filter for {problem.key()}")
        scored = [(predict(geometry_of(v, problem), problem.m), v) for v in cands]
        b, v = min(scored, key=lambda s: s[0].total_us)
        return v, b

    def predicted_layer_us(self, problem: LinearProblem, keep: Any = None) -> float:
        """Predicted whole layer (the quantizer stand-in + the best predicted GEMM)."""
        from ..kernels.linear_sm100_tc_model import quantizer_us

        return (quantizer_us(problem.fmt, mode_of(problem), problem.m, problem.k)
                + self.best_predicted(problem, keep)[1].total_us)


FAMILY = register(LinearSm100Family())


def compare(out: torch.Tensor, ref: torch.Tensor, tol: float = TOLERANCE) -> CheckResult:
    """resgen.search.family.compare at the linear tolerance (BF16 output rounding)."""
    return family_compare(out, ref, tol)


# ----------------------------------------------------------------------------- runner


def random_layer(problem: LinearProblem, device, gen: torch.Generator):
    """A random weight (heavy-tailed rows) prepared for `problem`."""
    from .. import calibrate as C

    n, k = problem.n, problem.k
    w = torch.randn(n, k, generator=gen, device=device)
    w = w * torch.exp(0.5 * torch.randn(n, 1, generator=gen, device=device))
    sel = None
    if problem.ratio is not None:
        xc = torch.randn(64, k, generator=gen, device=device)
        st = C.ChannelStats(k)
        st.update(xc)
        sel = C.select_channels(st.mean_abs(), problem.ratio)
    isc = None
    if problem.fmt == "nvfp4" and problem.static_scale:
        isc = torch.tensor(4.0 / (6 * 448))          # activations ~ N(0, 1): amax about 4
    return C.prepare_weight(w, problem.fmt, sel, input_scale=isc)


def _compensation(problem: LinearProblem) -> Any:
    return problem.ratio if problem.ratio is not None else problem.compensation


_WEIGHTS: dict[tuple, list] = {}
_WEIGHTS_KEEP = 3


def _weight_sets(problem: LinearProblem, device, n_sets: int, seed: int) -> list:
    """[(qweight, Sm100Weight)] * n_sets for the problem's layer (M plays no part), the first
    random, the others copies in their own memory (cold-L2 rotation reads distinct memory);
    cached for the few most recent layers."""
    import dataclasses

    key = (replace(problem, m=1).key(), str(device), seed)
    sets = _WEIGHTS.get(key)
    if sets is None:
        while len(_WEIGHTS) >= _WEIGHTS_KEEP:
            _WEIGHTS.pop(next(iter(_WEIGHTS)))
        gen = torch.Generator(device=device).manual_seed(seed)
        qw = random_layer(problem, device, gen)
        sets = [(qw, FAMILY.layout(qw))]
    sets = list(sets)
    while len(sets) < max(1, n_sets):
        w0 = sets[0][1]
        sets.append((sets[0][0], dataclasses.replace(w0, codes=w0.codes.clone(),
                                                     sf=w0.sf.clone(), alpha=w0.alpha.clone())))
    _WEIGHTS[key] = sets
    return sets[:max(1, n_sets)]


class Sm100LinearBinding:
    """One compiled linear_sm100_tc variant bound to one prepared weight: `binding(xb, out)`
    runs the whole layer (xb: bf16 [M, K] contiguous, M = problem.m; out: bf16 [M, N]):
    quant_sm100 writes the operand into its outputs (allocated here once), the GEMM reads it.
    Nothing is allocated per call, so a bound layer can be captured in a CUDA graph (after one
    eager call). What resgen.ops serves and the runner times."""

    def __init__(self, launcher: Any, quantizer: Any, problem: LinearProblem, weight: Any,
                 device: torch.device, alpha: Any, masks: Any) -> None:
        self.launcher, self.quantizer = launcher, quantizer
        self.problem, self.weight = problem, weight
        self.outs = quantizer.outputs(problem.m, device)
        static = getattr(getattr(quantizer, "config", None), "alpha", None) == "static"
        if static and alpha is None:
            raise ValueError("the layer quantizer takes the static NVFP4 scale: the weight "
                             "has no input_scale")
        self.alpha = alpha if static else None
        self.masks = masks

    def __call__(self, xb: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        op = self.quantizer(xb, self.outs, alpha=self.alpha, masks=self.masks)
        return self.launcher(self.weight, op, out)


class LinearSm100Runner:
    """n_sets input sets (a prepared weight + activations each) of one problem and one
    compiled variant, bound by the family's `bind`: the timed call is `bindings[cur](xb, out)`,
    the whole layer the runtime serves (quant_sm100 + the GEMM). The layer is bound when a
    quantizer is attached (attach_quantizer, or as_layer / the first call or check: the
    default layer quantizer). check(): the GEMM alone on the torch-made operand
    (check_gemm), then the whole layer (check_quantized); the worse counts."""

    def __init__(self, compiled, variant, problem, device, n_sets, seed, *, quantizer=None):
        from .build import COMPILE_KEY_ATTR

        made_for = getattr(compiled, COMPILE_KEY_ATTR, None)
        if made_for is not None and made_for != FAMILY.compile_key(variant, problem).key():
            raise ValueError(f"{variant.name()} was compiled for {made_for}, not for "
                             f"{FAMILY.compile_key(variant, problem).key()}")
        self.compiled = compiled
        self.variant, self.problem = variant, problem
        self.geom = geometry_of(variant, problem)
        self.device = torch.device(device)
        self.gen = torch.Generator(device=self.device).manual_seed(seed + 1)
        self.comp = _compensation(problem)
        self.m = problem.m
        self.rows = act_rows(problem.m, variant.layout.value)
        xgen = torch.Generator(device=self.device).manual_seed(seed * 1000003 + problem.m)
        self.sets = [(qw, wt, torch.randn(self.m, problem.k, generator=xgen,
                                          device=self.device), None)
                     for qw, wt in _weight_sets(problem, self.device, n_sets, seed)]
        self.out = torch.empty(self.m, problem.n, dtype=torch.bfloat16, device=self.device)
        self.launcher = FAMILY.launcher(compiled, variant, problem, self.device)
        self.quantizer: Any = None
        self.bindings: list | None = None
        self.xbs: list = []
        self.cur = 0
        if quantizer is not None:
            self.attach_quantizer(quantizer)

    def attach_quantizer(self, qkernel: Any) -> None:
        """Bind the whole layer behind this quantizer (a compiled quant_sm100 kernel writing
        this variant's operand layout, or a stand-in): two launches per call."""
        from ..calibrate import static_alpha

        bindings, xbs = [], []
        for qw, wt, x, _ in self.sets:
            masks = (qw.selection.masks.to(self.device)
                     if qw.selection is not None and self.problem.ratio is not None else None)
            bindings.append(FAMILY.bind(self.compiled, self.variant, self.problem, wt,
                                        self.device, quantizer=qkernel,
                                        alpha=static_alpha(qw, self.device), masks=masks,
                                        launcher=self.launcher))
            xbs.append(x.to(torch.bfloat16).contiguous())
        self.quantizer, self.bindings, self.xbs = qkernel, bindings, xbs

    def as_layer(self) -> None:
        """Bind the whole layer now with the default layer quantizer (the tuner calls it
        before the check)."""
        if self.bindings is None:
            self.attach_quantizer(FAMILY.default_quantizer(self.variant, self.problem))

    def _bound(self) -> list:
        if self.bindings is None:
            self.as_layer()
        assert self.bindings is not None
        return self.bindings

    def rotate(self, i: int) -> None:
        self.cur = i % len(self.sets)

    def __call__(self) -> torch.Tensor:
        return self._bound()[self.cur](self.xbs[self.cur], self.out)

    def operand(self, i: int):
        """The torch-made operand of input set i (built on first use; test hooks only)."""
        from ..kernels.sm100_operand import make_operand

        qw, wt, x, op = self.sets[i]
        if op is None:
            op = make_operand(x, qw, self.comp, self.geom.layout, self.geom.act_sf_tile)
            self.sets[i] = (qw, wt, x, op)
        return op

    def gemm(self, i: int) -> torch.Tensor:
        """The GEMM alone on set i's torch-made operand (a probe, not what is timed)."""
        return self.launcher(self.sets[i][1], self.operand(i), self.out)

    def run_on(self, x: torch.Tensor, set_index: int = 0) -> torch.Tensor:
        """The GEMM on x: [m', K] quantized in torch with set `set_index`'s weight, into a
        NaN-poisoned output."""
        from ..kernels.sm100_operand import make_operand

        qw, wt, _, _ = self.sets[set_index]
        out = torch.full((x.shape[0], self.problem.n), float("nan"), dtype=torch.bfloat16,
                         device=self.device)
        self.launcher(wt, make_operand(x, qw, self.comp, self.geom.layout,
                                       self.geom.act_sf_tile), out)
        return out

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def check(self) -> CheckResult:
        """check_gemm, then (if it passed) check_quantized."""
        gemm = self.check_gemm()
        return gemm if not gemm.ok else self.check_quantized()

    def check_gemm(self) -> CheckResult:
        """Fresh activations quantized in torch, the GEMM alone into a NaN-poisoned output,
        vs resgen.reference.linear."""
        from .. import reference

        x = torch.randn(self.m, self.problem.k, generator=self.gen, device=self.device) * 3
        out = self.run_on(x)
        self._sync()
        return compare(out, reference.linear(x, self.sets[0][0], self.comp))

    def check_quantized(self) -> CheckResult:
        """Fresh bf16 activations through the bound layer (quantizer + GEMM) into a
        NaN-poisoned output vs resgen.reference.linear on the same bf16 values."""
        from .. import reference

        binding = self._bound()[0]
        xb = (torch.randn(self.m, self.problem.k, generator=self.gen, device=self.device)
              * 3).to(torch.bfloat16)
        out = torch.full((self.m, self.problem.n), float("nan"), dtype=torch.bfloat16,
                         device=self.device)
        binding(xb, out)
        self._sync()
        return compare(out, reference.linear(xb.float(), self.sets[0][0], self.comp))


# ----------------------------------------------------------------------------- compile checks

COVER_PROBLEMS = (LinearProblem("nvfp4", "full", 1, 4096, 4096),
                  LinearProblem("mxfp4", "none", 16, 4096, 4096),
                  LinearProblem("nvfp4", "0.25", 64, 4096, 4096),
                  LinearProblem("mxfp4", "full", 64, 4096, 4096))


def _extras() -> list[tuple[LinearProblem, LinearSm100Variant]]:
    """Axis values outside the searched space, each in one valid variant: 128-wide K tiles,
    clusters along N and of 4 along M, 2-stage rings."""
    p = COVER_PROBLEMS[1]
    base = FAMILY.default(p, ARCH)
    return [(p, replace(base, tile_k=128, stages=2)), (p, replace(base, cluster_n=2)),
            (p, replace(base, cluster_n=4)), (p, replace(base, cluster_m=4, stages=3))]


def covering_cases() -> list[tuple[LinearProblem, LinearSm100Variant]]:
    """(problem, variant) pairs in which every value of every variant axis the space holds,
    the valid values outside it of the small axes (_extras), every format and every
    compensation mode appear at least once (greedy set cover, first on ties): what CI
    compiles for sm_100a."""
    items = [(p, v) for p in COVER_PROBLEMS for v in FAMILY.space(p, ARCH)] + _extras()

    def pairs(item):
        p, v = item
        return ({(f, getattr(v, f)) for f in v.__dataclass_fields__}
                | {("fmt", p.fmt), ("mode", mode_of(p))})

    return covering_subset(items, pairs)


def ptx_problems(variant: LinearSm100Variant, problem: LinearProblem, ptx: str) -> list[str]:
    """What is wrong with a compiled variant's PTX (empty: nothing): the block-scaled tcgen05
    MMA of the format's kind and block size and CTA group, one per MMA of a K tile; the TMEM
    loads of exactly the variant's shape and repetition, as many as the epilogue plan has,
    each waited on; scale factors copied into TMEM; TMA loads (multicast in a cluster or a
    2-SM pair); the store path and split-K reduction's instructions; the fold's FP32
    mul/add; no local memory."""
    g = geometry_of(variant, problem)
    cg = g.cta_group
    block = "block16" if problem.fmt == "nvfp4" else "block32"
    bad = []

    def need(s, why):
        if s not in ptx:
            bad.append(f"no {s!r} ({why})")

    need(".target sm_100a", "the arch")
    mma = f"tcgen05.mma.cta_group::{cg}.kind::mxf4nvf4.block_scale.{block}"
    if ptx.count(mma) != g.tile_k // 64:
        bad.append(f"{ptx.count(mma)} x {mma!r}, want {g.tile_k // 64} (one per MMA of a K "
                   "tile)")
    if ptx.count("tcgen05.mma") != ptx.count(mma):
        bad.append("another tcgen05.mma kind")
    ld = f"tcgen05.ld.sync.aligned.{g.tmem_shape}.x{g.tmem_rep}.b32"
    if ptx.count(ld) != len(g.ld_plan()):
        bad.append(f"{ptx.count(ld)} x {ld!r}, want {len(g.ld_plan())} (the epilogue plan)")
    if ptx.count("tcgen05.ld.") != ptx.count(ld):
        bad.append("a TMEM load of another shape")
    if ptx.count("tcgen05.wait::ld.sync.aligned") < ptx.count(ld):
        bad.append("a TMEM load without tcgen05.wait::ld")
    need(f"tcgen05.cp.cta_group::{cg}.32x128b.warpx4", "scale factors into TMEM")
    need(f"tcgen05.alloc.cta_group::{cg}", "TMEM allocation")
    need("cp.async.bulk.tensor", "TMA loads")
    if g.cluster_m * g.cluster_n > 1 or cg == 2:
        need(".multicast::cluster", "TMA multicast in the cluster")
    if g.mode == "mext":
        need("add.rn.f32", "the fold's FP32 add")
    need("mul.rn.f32", "alpha in FP32")
    if g.split_k == 1 and g.store == "tma":
        need("cp.async.bulk.global.shared::cta.bulk_group", "the tma store path")
        need("fence.proxy.async.shared::cta", "smem writes visible to the copy engine")
    if g.split_k == 1 and g.store == "direct":
        need("st.global.b16", "the direct store path")
        if "cp.async.bulk.global.shared" in ptx:
            bad.append("a bulk store in a direct-store variant")
    if g.reduce == "workspace":
        need("st.global.f32", "split-K partials")
        need("ld.global.cg.f32", "the last CTA reads the partials from L2")
    if g.reduce == "atomic":
        need("red.global.add.f32", "split-K atomics")
    if g.split_k > 1:
        need("atom.global.acq_rel.gpu.add.u32", "the per-tile semaphore")
    if "ld.local" in ptx or "st.local" in ptx:
        bad.append("local memory")
    return bad
