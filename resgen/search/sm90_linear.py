"""What the Hopper linear families share (linear_sm90_mma: decode, resgen/search/linear_sm90_mma.py;
linear_sm90_wgmma: prefill, resgen/search/linear_sm90_wgmma.py): the one launch path of a
linear layer, the runner that times exactly it, and their common pieces (the weight packing
axis, Kp, the tolerance, the layer quantizer, random layers, the weight-set cache).

One launch path. `Sm90LinearFamily.bind(compiled, variant, problem, weight, device, ...)`
returns the whole layer, run(xb, out): BF16 activations in, the layer quantizer (quant_sm90)
writing the exact-BF16 operand and then the GEMM for variants that read a prepared operand, or
one launch of a fused variant that quantizes in its own prologue. resgen.ops.Linear serves
that `run`; the tuner's runner (`Sm90LinearRunner`) binds every input set with the same `bind`
(one GEMM launcher shared by the sets, as one plan has one) and times `binding(xb, out)`, so
what is timed is what is served by construction.

A family built on `Sm90LinearFamily` provides `layout` (the weight in its layout), `launcher`
(a compiled variant's GEMM launch: the kernels' LinearSm90Launcher / WgmmaLauncher),
`needs_quantizer`, `xop_row_multiple` (the operand's row padding), `reads_past_rows` (whether
the GEMM loads operand rows past the real ones) and `weight_sets` (its bounded cache of
prepared random layers).

W4A16 (compensation "w4a16": FP4 weights, BF16 activations never quantized). The GEMMs that
read the exact-BF16 operand xop [T_pad, Kp] (linear_sm90_mma's xop variants, every
linear_sm90_wgmma variant) multiply it by the exactly decoded weight with FP32 accumulation
and scale by alpha_x alpha_w in the FP32 epilogue. With xop = the activations rounded to BF16
(zero-padded to T_pad rows and Kp columns) and alpha_x = 1 they compute
resgen.reference.linear_w4a16 up to FP32 summation order, with the SAME compiled kernels (same
templates and fingerprints as plain W4A4: a W4A16 workload renders the plain kernel). The
stage in front is `W4A16Operand`: the caller's buffer read in place where it already is the
operand (K = Kp, rows the GEMM reads = M, 16-byte aligned), else one copy into a zero-padded
buffer; no quantizer. A fused linear_sm90_mma variant serves W4A16 in one launch: its
prologue copies the CTA's BF16 activation rows into the shared-memory operand tile its main loop
reads (operand "copy", resgen.kernels.linear_sm90_mma_a16: a render of its own) instead of
quantizing them, alpha_x = 1 again.

The torch operand both families read is resgen.kernels.sm90_operand.make_xop.
"""

from __future__ import annotations

import dataclasses
from dataclasses import replace
from typing import Any, Callable, ClassVar

import torch

from ..calibrate import QLinearWeight, static_alpha
from ..kernels.sm90_fp4_layout import K_ALIGN, pad_to
from ..kernels.sm90_operand import xop_layout_for
from .family import CheckResult, KernelFamilyBase
from .family import compare as family_compare
from .variant import Choice, LinearProblem, VariantBase

__all__ = ["Packing", "Fold", "PRESUM_MEXT_ONLY", "KEXT_PRESUM_ONLY", "presum_capable",
           "gemm_weight", "TOLERANCE", "compare", "kp_of", "pow2_ceil",
           "compensation_of",
           "quantizer_k", "QUANT_K_ALIGN", "reference_output", "fold_of", "check_folds",
           "bf16_operand",
           "W4A16Operand", "LAYER_QUANT_CONFIG", "layer_quant_config", "layer_quantizer",
           "random_layer",
           "cached_weight_sets", "clone_tensors",
           "LinearBinding", "Sm90LinearFamily", "Sm90LinearRunner"]

TOLERANCE = 3e-3          # BF16 output rounding


def pow2_ceil(v: int) -> int:
    """The smallest power of two >= v (v >= 1)."""
    return 1 << max(0, int(v) - 1).bit_length()


class Fold(Choice):
    """How M-Ext's base and residue products meet: "exact" (two products folded in FP32:
    Blackwell's numerics) or "presum" (X_hat + R_hat rounded once to FP16, one product:
    resgen.reference.linear(fold="presum")). A variant axis of both Hopper linear families."""

    EXACT = "exact"
    PRESUM = "presum"


PRESUM_MEXT_ONLY = ("presum sums the residue into the base: it needs compensation 'full' "
                    "(M-Ext) or a K-Ext workload with fold='presum' (plain W4A4 / W4A16 have no "
                    "residue; K-Ext presum adds residues onto base channels, which moves the "
                    "output by 3-6e-3, beyond the exact fold's 3e-3 check, so it is the "
                    "workload's choice, never the tuner's: docs/hopper_native.md)")
KEXT_PRESUM_ONLY = ("a K-Ext presum workload (fold='presum') runs the presum GEMM over the base "
                    "weight: presum variants only")


def presum_capable(problem: LinearProblem) -> bool:
    """Whether presum variants can serve `problem`: NVFP4 M-Ext (a kernel choice within the
    exact fold's check) or a K-Ext workload with fold "presum" (the only variants it has)."""
    return problem.fmt == "nvfp4" and (problem.compensation == "full" or problem.kext_presum)


def gemm_weight(qweight: QLinearWeight, problem: LinearProblem) -> QLinearWeight:
    """The weight the GEMM of `problem` multiplies: qweight, or for a K-Ext presum workload
    its base part [N, K] (no selection: the residues ride on their base channels; the
    selection's masks still go to the layer quantizer)."""
    if not problem.kext_presum or qweight.selection is None:
        return qweight
    return QLinearWeight(qweight.base(), qweight.in_features, None, qweight.input_scale,
                         qweight.meta)


class Packing(Choice):
    """Weight nibble layout and its decode (resgen.kernels.sm90_fp4_layout): "nib" as in the design
    brief, "split": sign apart from magnitude (fewer integer ops)."""

    NIB = "nib"
    SPLIT = "split"


def compare(out: torch.Tensor, ref: torch.Tensor, tol: float = TOLERANCE) -> CheckResult:
    """resgen.search.family.compare at the linear families' tolerance (BF16 output
    rounding)."""
    return family_compare(out, ref, tol)


def kp_of(problem: LinearProblem) -> int:
    """Kp: the kernels' padded reduction length (K, or K + ext, rounded up to 256)."""
    block = 16 if problem.fmt == "nvfp4" else 32
    return pad_to(problem.k_ext(block), K_ALIGN)


def compensation_of(problem: LinearProblem) -> str | float:
    """The compensation as resgen.reference / make_xop take it: "none", "full" or the K-Ext
    ratio (float); "w4a16" for W4A16 (reference_output, bf16_operand)."""
    return problem.ratio if problem.ratio is not None else problem.compensation


QUANT_K_ALIGN = 256      # quant_sm90 tiles K by warps of 32 lanes x 8 values


def quantizer_k(problem: LinearProblem) -> int:
    """The K the layer quantizer runs at: problem.k, or, where quant_sm90 cannot tile it
    (K % 256 != 0, e.g. SmolLM2's 576 or Qwen2.5-0.5B's 896), K rounded up to 256 with the
    activations copied into zero columns first. That is exact for plain, M-Ext and dynamic or
    static scales: zero columns quantize to zero codes in whole zero blocks (K is a multiple
    of the block), leave the NVFP4 amax unchanged, and the operand's columns K..Kp are the
    zeros the GEMM's Kp padding expects anyway. K-Ext is refused there: its extension columns
    start at K in the weight's layout. The GEMM kernel and weight layout are unchanged (both
    already pad to Kp = K rounded up to 256)."""
    if problem.k % QUANT_K_ALIGN == 0:
        return problem.k
    if problem.ratio is not None:
        raise ValueError(f"K-Ext at K = {problem.k} needs the layer quantizer, which tiles K "
                         f"by {QUANT_K_ALIGN}: serve this layer with a fused variant (static "
                         "NVFP4 or MXFP4, decode-sized M) or plain / M-Ext")
    return pad_to(problem.k, QUANT_K_ALIGN)


def reference_output(x: torch.Tensor, qweight: QLinearWeight, comp: str | float,
                     fold: str = "exact") -> torch.Tensor:
    """The reference a linear kernel is checked against: resgen.reference.linear_w4a16 for
    "w4a16", else resgen.reference.linear(x, qweight, comp, fold=fold). x: float [M, K] ->
    float32 [M, N]."""
    from .. import reference

    if comp == "w4a16":
        return reference.linear_w4a16(x, qweight)
    return reference.linear(x, qweight, comp, fold=fold)  # type: ignore[arg-type]


def fold_of(variant: Any) -> str:
    """The variant's fold ("exact" for families and variants without the axis)."""
    f = getattr(variant, "fold", "exact")
    return str(getattr(f, "value", f))


def check_folds(out: torch.Tensor, x: torch.Tensor, qweight: QLinearWeight,
                comp: str | float, fold: str, exact_too: bool = True) -> CheckResult:
    """out against the reference of its own fold; a presum variant of an exact-fold workload
    (M-Ext) ALSO against the exact fold's reference at the same tolerance (it serves the exact
    fold's workload: issue 20, "verify that, don't assume it"; exact_too). The worse result
    counts. A K-Ext presum workload (exact_too False) is checked against its own fold's
    reference only: its numerics are the presum fold's by the user's choice."""
    res = compare(out, reference_output(x, qweight, comp, fold))
    if fold == "exact" or not exact_too or not res.ok:
        return res
    ex = compare(out, reference_output(x, qweight, comp))
    if not ex.ok:
        return dataclasses.replace(ex, detail=f"{ex.detail} against the exact fold")
    return res if res.rel_err >= ex.rel_err else ex


def _w4a16_alpha(problem: LinearProblem, device: Any) -> torch.Tensor | None:
    """W4A16's alpha_x: one (float32 [1]) for NVFP4 kernels, None for MXFP4 (they take none)."""
    return (torch.ones(1, dtype=torch.float32, device=device) if problem.fmt == "nvfp4"
            else None)


def bf16_operand(x: torch.Tensor, kp: int, t_multiple: int = 8) -> torch.Tensor:
    """The W4A16 operand in torch: x: float [M, K] rounded to BF16, zero-padded to
    bf16 [T_pad, Kp] (T_pad = M rounded up to t_multiple): what W4A16Operand hands the GEMM,
    the counterpart of make_xop for the quantized modes."""
    if x.dim() != 2:
        raise ValueError(f"x must be [M, K], got shape {tuple(x.shape)}")
    m, k = x.shape
    if kp < k:
        raise ValueError(f"Kp = {kp} < K = {k}")
    xop = torch.zeros(pad_to(max(m, 1), t_multiple), kp, dtype=torch.bfloat16,
                      device=x.device)
    xop[:m, :k] = x.to(torch.bfloat16)
    return xop


class W4A16Operand:
    """The stage in front of the GEMM of a W4A16 layer: the BF16 activations as the operand.

    m, k: the call's rows and K; kp: the GEMM's padded K (kp_of); row_multiple: the rows the
    GEMM reads are M rounded up to it where `reads_past_rows` (linear_sm90_mma's unpredicated
    xop loads), else exactly M (linear_sm90_wgmma's TMA box reads rows past M as zeros).
    `stage(xb)` (xb: bf16 [M, K] contiguous) returns the operand: xb itself where it already
    is one (K = Kp, the GEMM reads M rows, 16-byte aligned: no launch at all), else a
    zero-padded bf16 [T_pad, Kp] buffer owned here with xb copied into its first M rows and K
    columns (one device copy; the padding stays zero)."""

    def __init__(self, m: int, k: int, kp: int, row_multiple: int, reads_past_rows: bool,
                 device: torch.device | str) -> None:
        self.m, self.k, self.kp = int(m), int(k), int(kp)
        self.rows = pad_to(max(self.m, 1), row_multiple) if reads_past_rows else self.m
        self.device = torch.device(device)
        self.in_place = self.k == self.kp and self.rows == self.m
        self.buf: torch.Tensor | None = None
        if not self.in_place:
            self._buffer()

    def _buffer(self) -> torch.Tensor:
        if self.buf is None:
            if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("the W4A16 operand buffer is allocated on first use: call "
                                   "the layer once eagerly (warmup) before capturing")
            self.buf = torch.zeros(self.rows, self.kp, dtype=torch.bfloat16,
                                   device=self.device)
        return self.buf

    def __call__(self, xb: torch.Tensor) -> torch.Tensor:
        if xb.dtype != torch.bfloat16 or xb.shape != (self.m, self.k):
            raise ValueError(f"W4A16 activations must be bf16 [{self.m}, {self.k}], got "
                             f"{xb.dtype} {tuple(xb.shape)}")
        if self.in_place and xb.is_contiguous() and xb.data_ptr() % 16 == 0:
            return xb
        buf = self._buffer()
        buf[: self.m, : self.k].copy_(xb)
        return buf


_LAYER_QUANT: dict[tuple, Any] = {}

# The layer quantizer's configuration where it was measured in the layer's form (xop only,
# kp_align 256, every row bit-exact first, over Qwen3-8B's four layers): pack16 (one NVFP4 block
# per lane), 4 warps, unroll 1, one-shot grid, against the QuantConfig defaults (pack8, 4 warps,
# unroll 2):
# - M-Ext presum rows: 0.88-0.98x the defaults' four-layer sums at M = 16, 64, 128, 512, 2048
#   (bench/results/h200/quant_layer_config_probe_s33 and _s34), the best single configuration;
# - plain W4A4 NVFP4 rows: 0.92 / 0.89 / 0.99 / 0.92 / 1.00 / 0.97x at M = 16 / 32 / 64 / 128 /
#   512 / 2048 (quant_layer_config_probe_s37 and _s37b), the best single configuration over
#   those M (pack8 with unroll 1 is as fast at M = 16 / 64, slower at 32 and 2048).
# Other layouts (row pairs, K-Ext extensions, MXFP4) keep the defaults: not measured.
LAYER_QUANT_CONFIG: dict[str, Any] = {"ept": 16, "warps": 4, "unroll": 1, "persist": False}
# (layout, compensation) of the measured NVFP4 layer quantizers
_LAYER_QUANT_MEASURED = frozenset({("presum", "full"), ("plain", "none")})


def layer_quant_config(problem: LinearProblem, layout: str | None = None) -> Any:
    """The quant_sm90 QuantConfig of `problem`'s layer quantizer (see layer_quantizer):
    LAYER_QUANT_CONFIG for the measured NVFP4 layouts (M-Ext presum rows, plain W4A4 rows)
    where K allows it (K a multiple of 512 for pack16), the QuantConfig defaults otherwise."""
    from ..kernels.quant_sm90 import QuantConfig

    comp = problem.compensation
    if problem.w4a16:
        raise ValueError("W4A16 has no activation quantizer: its operand is the BF16 "
                         "activations (W4A16Operand)")
    alpha = "none" if problem.fmt == "mxfp4" else ("static" if problem.static_scale
                                                   else "dynamic")
    if layout is None:
        layout = xop_layout_for(comp)
    cfg = QuantConfig(fmt=problem.fmt, compensation=comp, k=quantizer_k(problem),
                      layout=layout, write_codes=False, write_xop=True, alpha=alpha,
                      kp_align=256)
    if problem.fmt == "nvfp4" and (layout, comp) in _LAYER_QUANT_MEASURED:
        tuned = replace(cfg, **LAYER_QUANT_CONFIG)
        if tuned.why_invalid() is None:
            return tuned
    return cfg


def layer_quantizer(problem: LinearProblem, arch: str = "sm_90a", layout: str | None = None
                    ) -> Any:
    """The quant_sm90 kernel a whole layer puts in front of a GEMM that reads the exact BF16
    operand (xop, kp_align 256): layer_quant_config's configuration, row-pair rows for M-Ext
    (or `layout`: "presum", the FP16 sum rows the presum variants read), the K-Ext extension
    for a ratio, the problem's alpha (static NVFP4, dynamic NVFP4: amax pass + quantizer,
    MXFP4: none). Compiled once per process per configuration and arch (about 0.1-0.7 s on a
    CPU)."""
    from ..kernels.quant_sm90 import compile_config

    cfg = layer_quant_config(problem, layout)
    key = (cfg, arch)
    if key not in _LAYER_QUANT:
        _LAYER_QUANT[key] = compile_config(cfg, arch)[0]
    return _LAYER_QUANT[key]


def random_layer(problem: LinearProblem, device: Any, gen: torch.Generator) -> QLinearWeight:
    """A random weight (heavy-tailed rows) prepared for `problem` (with a channel selection
    for K-Ext, a static input scale for static NVFP4)."""
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


def cached_weight_sets(cache: dict[tuple, list], keep: int,
                       prepare: Callable[[QLinearWeight, str], Any], problem: LinearProblem,
                       packing: str, device: Any, n_sets: int, seed: int) -> list:
    """[(qweight, prepare(qweight, packing))] * n_sets for the layer of `problem` (M plays no
    part), held in `cache` for the `keep` most recent layers (oldest dropped first; a later
    call with more sets extends the list). Each family passes its own cache and layout. Set 0
    is a random layer; the others are copies of it in their own memory (see below)."""
    key = (replace(problem, m=1).key(), packing, str(device), seed)
    n_sets = max(1, n_sets)
    sets = cache.get(key)
    if sets is not None and len(sets) >= n_sets:
        return sets[:n_sets]
    if sets is None:
        while len(cache) >= keep:
            cache.pop(next(iter(cache)))
        gen = torch.Generator(device=device).manual_seed(seed)
        qw = random_layer(problem, device, gen)
        sets = [(qw, prepare(gemm_weight(qw, problem), packing))]
    sets = list(sets)                       # lists handed out earlier stay as they were
    while len(sets) < n_sets:
        # Further sets exist to make every timed launch read its weights from HBM (cold L2):
        # what matters is distinct memory, not distinct values (the kernels have no
        # data-dependent paths), so they are copies of the first prepared weight, not new
        # random layers (a layer's first preparation took 0.3-0.5 s of GPU-locked time per
        # workload in the H200 tuning runs; a copy is a device memcpy). Checks use set 0.
        sets.append((sets[0][0], clone_tensors(sets[0][1])))
    cache[key] = sets
    return sets[:n_sets]


def clone_tensors(obj: Any) -> Any:
    """A shallow copy of a prepared-weight dataclass with every tensor field cloned (new
    device memory, same values)."""
    return dataclasses.replace(obj, **{f.name: getattr(obj, f.name).clone()
                                       for f in dataclasses.fields(obj)
                                       if isinstance(getattr(obj, f.name), torch.Tensor)})


def _kext_masks(qw: QLinearWeight, problem: LinearProblem, device: torch.device
                ) -> torch.Tensor | None:
    """The K-Ext channel masks (uint8 [K / 8]) on `device` for a K-Ext problem, else None."""
    if qw.selection is None or problem.ratio is None:
        return None
    return qw.selection.masks.to(device)


# ----------------------------------------------------------------------------- the launch


class LinearBinding:
    """One compiled linear variant bound to one prepared weight: `binding(xb, out)` runs the
    whole layer (xb: bf16 [M, K] contiguous, M = problem.m; out: bf16 [M, N], written).

    fused:     the variant quantizes in its own prologue: one launch of the GEMM on xb with
               the static NVFP4 scale (MXFP4: none) and the K-Ext masks; for W4A16 its
               prologue copies xb (operand "copy"), alpha_x = 1;
    W4A16:     (xop variants) the GEMM reads xb itself as its exact-BF16 operand
               (W4A16Operand: in place, or copied into a zero-padded buffer), alpha_x = 1; no
               quantizer;
    otherwise: the quantizer writes the operand into its outputs (allocated here, for M
               rows, padded to the GEMM's row multiple), then the GEMM reads it.
    Nothing is allocated per call, so a bound layer can be captured in a CUDA graph (after
    one eager call)."""

    def __init__(self, launcher: Any, problem: LinearProblem, weight: Any,
                 device: torch.device, *, fused: bool, quantizer: Any, row_multiple: int,
                 alpha: torch.Tensor | None, masks: torch.Tensor | None,
                 reads_past_rows: bool = True, rows: int | None = None) -> None:
        self.launcher, self.problem, self.weight = launcher, problem, weight
        # the GEMM's operand rows (problem.rows unless the family says otherwise: presum)
        self.m, self.rows = problem.m, problem.rows if rows is None else rows
        self.fused, self.masks = fused, masks
        self.xpad: torch.Tensor | None = None
        self.stage: W4A16Operand | None = None
        self._qkw: dict[str, Any] = {}
        if problem.w4a16:
            if quantizer is not None:
                raise ValueError("W4A16 has no activation quantizer in front")
            if masks is not None:
                raise ValueError("W4A16 reads no K-Ext masks")
            # alpha_x = 1: the operand is the activations themselves (MXFP4 kernels take none)
            self.quantizer, self.outs = None, None
            self.alpha = _w4a16_alpha(problem, device)
            if fused:
                # one launch: the prologue copies xb into the operand tile (no stage)
                return
            self.stage = W4A16Operand(problem.m, problem.k, kp_of(problem), row_multiple,
                                      reads_past_rows, device)
            return
        if fused:
            if quantizer is not None:
                raise ValueError("a fused variant quantizes in its own prologue: no quantizer")
            if problem.fmt == "nvfp4" and alpha is None:
                raise ValueError("a fused NVFP4 variant needs a weight with a static "
                                 "input_scale")
            self.quantizer, self.outs, self.alpha = None, None, alpha
            return
        if quantizer is None:
            raise ValueError("a variant that reads a prepared operand needs the layer "
                             "quantizer in front")
        self.quantizer = quantizer
        kq = quantizer_k(problem)
        if kq != problem.k:
            # the activations copied into zero columns up to the quantizer's K (exact: see
            # quantizer_k); allocated once here, so the bound layer stays capturable
            self.xpad = torch.zeros(problem.m, kq, dtype=torch.bfloat16, device=device)
        self.outs = quantizer.outputs(problem.m, row_multiple=row_multiple, device=device)
        static = quantizer.config.alpha == "static"
        if static and alpha is None:
            raise ValueError("the layer quantizer takes the static NVFP4 scale: the weight "
                             "has no input_scale")
        self.alpha = alpha if static else None
        self._qkw = {} if masks is None else {"masks": masks}

    def __call__(self, xb: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        if self.stage is not None:
            return self.launcher(self.weight, self.stage(xb), self.m, self.rows, self.alpha,
                                 out)
        if self.fused:
            return self.launcher(self.weight, xb, self.m, self.rows, self.alpha, out,
                                 self.masks)
        if self.xpad is not None:
            self.xpad[:, : self.problem.k].copy_(xb)
            xb = self.xpad
        op = self.quantizer(xb, self.outs, alpha=self.alpha, **self._qkw)
        return self.launcher(self.weight, op.xop, self.m, self.rows, op.alpha, out)


def _presum(variant: VariantBase) -> bool:
    """Whether the variant runs the presum fold (both Hopper linear families' variants have a
    `fold` axis; other variants, none)."""
    return getattr(variant, "fold", Fold.EXACT) == Fold.PRESUM


class Sm90LinearFamily(KernelFamilyBase):
    """The run-time half of a Hopper linear family (see the module docstring); the search
    half (variant, space, predicate, codegen) is each family's own."""

    # seed multiplier of a problem's activation generator (kept per family: the timed inputs
    # of existing tables came from these)
    INPUT_SEED: ClassVar[int] = 1000003

    # ------------------------------------------------------------------ per family
    def layout(self, qweight: QLinearWeight, packing: str) -> Any:
        """The prepared weight in this family's layout (offline work)."""
        raise NotImplementedError

    def launcher(self, compiled: Any, variant: VariantBase, problem: LinearProblem,
                 device: torch.device | str) -> Any:
        """The GEMM launch of a compiled variant for `problem` on `device`:
        launch(weight, xop_or_x, m, rows, alpha_x, out[, masks]) -> out, with its split-K
        workspace sized for the problem now (not at a captured call)."""
        raise NotImplementedError

    def needs_quantizer(self, variant: VariantBase) -> bool:
        """True where the variant reads a prepared operand (the layer quantizer in front)."""
        return True

    def xop_row_multiple(self, variant: VariantBase, problem: LinearProblem) -> int:
        """The operand's rows are padded to this multiple (the GEMM reads whole tiles)."""
        raise NotImplementedError

    def gemm_rows(self, variant: VariantBase, problem: LinearProblem) -> int:
        """The operand rows the GEMM launch reads: problem.rows (2 M for M-Ext row pairs), M
        for a presum variant (one summed row per token)."""
        return problem.m if _presum(variant) else problem.rows

    def quantizer_layout(self, variant: VariantBase, problem: LinearProblem) -> str:
        """The quant_sm90 row layout the variant reads: row pairs for M-Ext, "presum" for a
        presum variant (fp16(X_hat + R_hat), one row per token), else plain."""
        if _presum(variant):
            return "presum"
        return xop_layout_for(problem.compensation)

    def torch_operand(self, variant: VariantBase, x: torch.Tensor, qweight: QLinearWeight,
                      compensation: Any, t_multiple: int
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(xop, alpha_x): the operand quantizer_layout's quantizer writes, built in torch
        (resgen.kernels.sm90_operand.make_xop; presum: make_presum_xop)."""
        if _presum(variant):
            from ..kernels.sm90_operand import make_presum_xop

            return make_presum_xop(x, qweight, compensation, t_multiple=t_multiple)
        from ..kernels.sm90_operand import make_xop

        return make_xop(x, qweight, compensation, t_multiple=t_multiple)

    def reads_past_rows(self, variant: VariantBase) -> bool:
        """Whether the GEMM loads operand rows past the real ones (up to xop_row_multiple):
        then a W4A16 operand needs those rows allocated. True (the safe answer) unless the
        family knows better."""
        return True

    def weight_sets(self, problem: LinearProblem, packing: str, device: Any, n_sets: int,
                    seed: int) -> list:
        """[(qweight, prepared weight)] * n_sets of a random layer (cached_weight_sets)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ shared
    def quantizer_problem(self, problem: LinearProblem) -> LinearProblem:
        """`problem` at the K the layer quantizer runs at (quantizer_k)."""
        return replace(problem, k=quantizer_k(problem))

    def default_quantizer(self, problem: LinearProblem, variant: VariantBase | None = None
                          ) -> Any:
        """The layer quantizer `bind` puts in front when given none (layer_quantizer for this
        family's arch, in the layout `variant` reads: quantizer_layout)."""
        layout = None if variant is None else self.quantizer_layout(variant, problem)
        return layer_quantizer(problem, self.ARCHS[0], layout)

    def warm(self, variant: VariantBase, problem: LinearProblem) -> None:
        """The tuner's pre-lock hook: compile the layer quantizer the runner will bind (none
        for W4A16)."""
        if self.needs_quantizer(variant) and not problem.w4a16:
            self.default_quantizer(problem, variant)

    def bind(self, compiled: Any, variant: VariantBase, problem: LinearProblem, weight: Any,
             device: torch.device | str, *, quantizer: Any = None,
             alpha: torch.Tensor | None = None, masks: torch.Tensor | None = None,
             launcher: Any = None) -> LinearBinding:
        """The whole layer of `problem` on `weight` (this family's layout): run(xb, out).

        quantizer: the layer quantizer in front of a variant that reads a prepared operand (a
                   compiled quant_sm90 QuantKernel, or a stand-in with its outputs(),
                   __call__ and config.alpha); None: default_quantizer(problem). Must be None
                   for a fused variant and for W4A16 (whose operand is the BF16
                   activations: W4A16Operand in front of an xop variant, the fused
                   prologue's copy in a fused one).
        alpha:     the static NVFP4 activation scale (resgen.calibrate.static_alpha: float32
                   [1] on device), or None (MXFP4, dynamic NVFP4).
        masks:     the K-Ext channel masks (uint8 [K / 8] on device) for a K-Ext problem, else
                   None.
        launcher:  the GEMM launch to use (self.launcher(...)); None: a new one. A runner
                   shares one across its input sets; a runtime plan has its own."""
        device = torch.device(device)
        fused = not self.needs_quantizer(variant)
        if not fused and quantizer is None and not problem.w4a16:
            quantizer = self.default_quantizer(problem, variant)
        if launcher is None:
            launcher = self.launcher(compiled, variant, problem, device)
        return LinearBinding(launcher, problem, weight, device, fused=fused,
                             quantizer=quantizer,
                             row_multiple=self.xop_row_multiple(variant, problem),
                             alpha=None if problem.w4a16 else alpha, masks=masks,
                             reads_past_rows=self.reads_past_rows(variant),
                             rows=self.gemm_rows(variant, problem))

    def input_sets(self, problem: LinearProblem, packing: str, device: Any, n_sets: int,
                   seed: int, fused: bool = False) -> list:
        """[(qweight, weight, x, operand, alpha_x)] * n_sets: cached weights, fresh
        activations x (float32 [M, K]). operand: for fused variants x itself as bf16 [M, K]
        (alpha_x its static scale; W4A16: one, float32 [1], MXFP4 None); otherwise None
        until the runner's operand(i) builds the torch-quantized xop on first use."""
        gen = torch.Generator(device=device).manual_seed(seed * self.INPUT_SEED + problem.m)
        sets = []
        for qw, wt in self.weight_sets(problem, packing, device, n_sets, seed):
            x = torch.randn(problem.m, problem.k, generator=gen, device=device)
            if fused:
                sets.append((qw, wt, x, x.to(torch.bfloat16).contiguous(),
                             _w4a16_alpha(problem, device) if problem.w4a16
                             else static_alpha(qw, device)))
            else:
                sets.append((qw, wt, x, None, None))
        return sets

    def runner(self, compiled: Any, variant: VariantBase, problem: LinearProblem,
               device: Any, n_sets: int = 1, seed: int = 0, *,
               quantizer: Any = None) -> "Sm90LinearRunner":
        return Sm90LinearRunner(self, compiled, variant, problem, device, n_sets, seed,
                                quantizer=quantizer)


# ----------------------------------------------------------------------------- the runner


class Sm90LinearRunner:
    """n_sets complete input sets (a prepared weight + activations each) of one linear
    problem and one compiled variant, bound by the family's `bind`: the timed call is
    `bindings[cur](xb, out)`, the whole layer the runtime serves (BENCH.md: BF16 activations
    in; fused variants one launch, the others quant_sm90 + the GEMM).

    Variants that read a prepared operand are bound when a quantizer is attached
    (attach_quantizer, or as_layer / the first call or check: the default layer quantizer);
    fused ones (W4A16 too: the prologue copies) and W4A16 layers (no quantizer: W4A16Operand
    in front) at once. check(): for
    those, first the GEMM alone on a torch-quantized operand (check_gemm), then the whole
    layer (check_quantized); the worse counts.

    Test and probe hooks (not what is timed or served): run_on(x) runs the GEMM on x quantized
    in torch (make_xop), operand(i) builds set i's torch operand (about a hundred small torch
    ops: on first use only; a runner behind the quantizer never needs it), gemm_only() a
    runner-like view that times the GEMM alone on those operands."""

    def __init__(self, family: Sm90LinearFamily, compiled: Any, variant: Any,
                 problem: LinearProblem, device: Any, n_sets: int = 1, seed: int = 0, *,
                 quantizer: Any = None) -> None:
        self.family, self.compiled = family, compiled
        self.variant, self.problem = variant, problem
        self.device = torch.device(device)
        self.gen = torch.Generator(device=self.device).manual_seed(seed + 1)
        self.comp = compensation_of(problem)
        self.fold = fold_of(variant)
        # a K-Ext presum workload is checked against its own fold only (check_folds)
        self.exact_too = not problem.kext_presum
        self.m, self.rows = problem.m, family.gemm_rows(variant, problem)
        self.fused = not family.needs_quantizer(variant)
        self.w4a16 = problem.w4a16
        self.launcher = family.launcher(compiled, variant, problem, self.device)
        self.geom = self.launcher.geom
        self.xop_multiple = family.xop_row_multiple(variant, problem)
        self.sets = family.input_sets(problem, variant.packing.value, self.device, n_sets,
                                      seed, self.fused)
        self.masks = _kext_masks(self.sets[0][0], problem, self.device)
        self.out = torch.empty(self.m, problem.n, dtype=torch.bfloat16, device=self.device)
        self.quantizer: Any = None
        self.bindings: list[LinearBinding] | None = None
        self.xbs: list[torch.Tensor] = []
        self.cur = 0
        if self.fused or self.w4a16:
            if quantizer is not None:
                raise ValueError("a fused variant quantizes in its own prologue: no quantizer"
                                 if self.fused else "W4A16 has no activation quantizer")
            self._bind(None)
        elif quantizer is not None:
            self.attach_quantizer(quantizer)

    # ------------------------------------------------------------------ binding
    def _bind(self, quantizer: Any) -> None:
        per_weight: dict[int, tuple] = {}          # the sets share one qweight (copies of it)
        bindings, xbs = [], []
        for qw, wt, x, operand, _ in self.sets:
            if id(qw) not in per_weight:
                per_weight[id(qw)] = (static_alpha(qw, self.device), self._masks_of(qw))
            alpha, masks = per_weight[id(qw)]
            bindings.append(self.family.bind(self.compiled, self.variant, self.problem, wt,
                                             self.device, quantizer=quantizer, alpha=alpha,
                                             masks=masks, launcher=self.launcher))
            xbs.append(operand if self.fused else x.to(torch.bfloat16).contiguous())
        self.quantizer, self.bindings, self.xbs = quantizer, bindings, xbs

    def _masks_of(self, qw: QLinearWeight) -> torch.Tensor | None:
        """The K-Ext masks of qw on the device (set 0's kept: every set shares its weight)."""
        return self.masks if qw is self.sets[0][0] else _kext_masks(qw, self.problem,
                                                                    self.device)

    def attach_quantizer(self, qkernel: Any) -> None:
        """Bind the whole layer behind this quantizer (a compiled quant_sm90 QuantKernel
        writing the xop with kp_align 256, or a stand-in): two launches per call."""
        if self.fused:
            raise ValueError("a fused variant quantizes in its own prologue: no quantizer")
        if self.w4a16:
            raise ValueError("W4A16 has no activation quantizer")
        self._bind(qkernel)

    def as_layer(self) -> None:
        """Bind the whole layer now (the default layer quantizer in front of variants that
        read a prepared operand; fused variants are bound already). The tuner calls it before
        the check, so the quantizer's compile is not timed as part of the check."""
        if self.bindings is None:
            self.attach_quantizer(self.family.default_quantizer(self.problem, self.variant))

    def _bound(self) -> list[LinearBinding]:
        if self.bindings is None:
            self.as_layer()
        assert self.bindings is not None
        return self.bindings

    # ------------------------------------------------------------------ timed call
    def rotate(self, i: int) -> None:
        self.cur = i % len(self.sets)

    def __call__(self) -> torch.Tensor:
        return self._bound()[self.cur](self.xbs[self.cur], self.out)

    # ------------------------------------------------------------------ checks
    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def check(self) -> CheckResult:
        """The whole layer vs resgen.reference.linear (check_quantized; W4A16:
        reference.linear_w4a16; a presum variant vs the presum AND the exact fold: check_folds),
        preceded for variants that read a prepared operand by the GEMM alone on a torch-built
        operand (check_gemm): fresh random activations, NaN-poisoned outputs."""
        if not self.fused:
            gemm = self.check_gemm()
            if not gemm.ok:
                return gemm
        return self.check_quantized()

    def check_quantized(self) -> CheckResult:
        """Fresh bf16 activations through the bound layer vs resgen.reference.linear on the
        same bf16 values, into a NaN-poisoned output."""
        binding = self._bound()[0]
        qw = self.sets[0][0]
        xb = (torch.randn(self.m, self.problem.k, generator=self.gen, device=self.device)
              * 3).to(torch.bfloat16)
        out = torch.full((self.m, self.problem.n), float("nan"), dtype=torch.bfloat16,
                         device=self.device)
        binding(xb, out)
        self._sync()
        return check_folds(out, xb.float(), qw, self.comp, self.fold, self.exact_too)

    def check_gemm(self) -> CheckResult:
        """Fresh random activations quantized in torch (bf16-rounded for fused variants;
        W4A16: the bf16-rounded activations as the operand), the GEMM alone into a
        NaN-poisoned output, vs the reference (reference_output)."""
        qw = self.sets[0][0]
        x = torch.randn(self.m, self.problem.k, generator=self.gen, device=self.device) * 3
        if self.fused:
            x = x.to(torch.bfloat16).float()
        out = self.run_on(x)
        self._sync()
        return check_folds(out, x, qw, self.comp, self.fold, self.exact_too)

    # ------------------------------------------------------------------ test hooks
    def run_on(self, x: torch.Tensor, set_index: int = 0) -> torch.Tensor:
        """The GEMM on x: [m', K] with set `set_index`'s weight, into a NaN-poisoned output.
        Variants that read a prepared operand get x quantized in torch (make_xop; W4A16:
        bf16_operand); fused variants take x rounded to bf16."""
        qw, wt, _, _, _ = self.sets[set_index]
        m = x.shape[0]
        out = torch.full((m, self.problem.n), float("nan"), dtype=torch.bfloat16,
                         device=self.device)
        rows = self.family.gemm_rows(self.variant, dataclasses.replace(self.problem, m=m))
        if self.fused:
            xb = x.to(torch.bfloat16).contiguous()
            ax = (_w4a16_alpha(self.problem, self.device) if self.w4a16
                  else static_alpha(qw, self.device))
            self.launcher(wt, xb, m, rows, ax, out, self._masks_of(qw))
            return out
        xop, ax = self._torch_operand(x, qw)
        self.launcher(wt, xop, m, rows, ax, out)
        return out

    def _torch_operand(self, x: torch.Tensor, qw: QLinearWeight
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(xop, alpha_x) built in torch: make_xop, or for W4A16 bf16_operand with alpha_x 1
        (NVFP4; MXFP4 kernels take none)."""
        if self.w4a16:
            return (bf16_operand(x, kp_of(self.problem), self.xop_multiple),
                    _w4a16_alpha(self.problem, x.device))
        return self.family.torch_operand(self.variant, x, qw, self.comp, self.xop_multiple)

    def operand(self, i: int) -> tuple[torch.Tensor, Any]:
        """(xop, alpha_x) of input set i, built by make_xop on first use (fused: x as bf16
        and its static scale). Raises while a CUDA graph is being captured (the torch
        quantization would be captured with the kernel): call it, or run the set once
        eagerly, before capturing."""
        qw, wt, x, xop, ax = self.sets[i]
        if xop is None:
            if x.is_cuda and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"input set {i}'s operand is built on first use; run the "
                                   "set once eagerly (or call operand(i)) before capturing")
            xop, ax = self._torch_operand(x, qw)
            self.sets[i] = (qw, wt, x, xop, ax)
        return xop, ax

    def bytes_per_set(self) -> int:
        wt = self.sets[0][1]
        return wt.nbytes() + self.operand(0)[0].numel() * 2

    def gemm_only(self) -> "_GemmOnly":
        """A runner-like view (rotate / __call__ / check) that runs the GEMM alone on each
        set's torch-quantized operand: for probes of the kernel without the layer quantizer
        (fused variants: their whole layer, they have no separate GEMM). Not what the tuner
        times or the runtime serves."""
        return _GemmOnly(self)


class _GemmOnly:
    """Sm90LinearRunner.gemm_only(); shares the runner's sets, launcher and output."""

    def __init__(self, runner: Sm90LinearRunner) -> None:
        self.runner = runner

    @property
    def out(self) -> torch.Tensor:
        return self.runner.out

    def rotate(self, i: int) -> None:
        self.runner.rotate(i)

    def __call__(self) -> torch.Tensor:
        r = self.runner
        qw, wt, _, _, _ = r.sets[r.cur]
        xop, ax = r.operand(r.cur)
        if r.fused:             # xop is x itself (bf16), ax its static scale
            return r.launcher(wt, xop, r.m, r.rows, ax, r.out, r._masks_of(qw))
        return r.launcher(wt, xop, r.m, r.rows, ax, r.out)

    def check(self) -> CheckResult:
        return self.runner.check_gemm()
