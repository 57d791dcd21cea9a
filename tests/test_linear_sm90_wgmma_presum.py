"""linear_sm90_wgmma's pre-summed fold (issue 20 section 1) on the CPU: the layer quantizer's
"presum" rows (quant_sm90), the FP16 weight decode's torch twin, the fold axis of the variant
(keys, validity, space), the render and its compile for sm_90a, and whole layers through the
thread-level simulation against reference.linear(fold="presum") and the exact fold."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from resgen import calibrate as C
from resgen import formats, reference
from resgen.kernels import quant_sm90 as Q
from resgen.kernels.linear_sm90_wgmma import WgmmaLauncher
from resgen.kernels.linear_sm90_wgmma_layout import fragment_values, prepare_wgmma_weight
from resgen.kernels.linear_sm90_wgmma_presum import fragment_values_f16
from resgen.kernels.linear_sm90_wgmma_sim import SimulatedKernel
from resgen.kernels.sm90_operand import make_presum_xop
from resgen.search.linear_sm90_wgmma import (FAMILY, PRESUM_MEXT_ONLY, PRESUM_NVFP4_ONLY, Fold,
                                             LinearSm90WgmmaVariant, Packing, Raster,
                                             gemm_rows, geometry_of)
from resgen.search.sm90_linear import check_folds
from resgen.search.variant import LinearProblem

ARCH = "sm_90a"


def _qweight(n: int, k: int, seed: int = 0, spread: float = 1.0) -> C.QLinearWeight:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.exp(spread * torch.randn(n, 1, generator=g))
    return C.prepare_weight(w, "nvfp4")


# ----------------------------------------------------------------------------- the weight


@pytest.mark.parametrize("packing", ["split", "nib"])
@pytest.mark.parametrize("spread", [0.5, 4.0])
def test_fp16_decode_gives_the_bf16_decodes_values(packing, spread):
    """decode_chunk_f16's bit operations (torch twin) give every A register the value of the
    BF16 decode, E2M1 x s_w x 2^-7, over weights whose block scales span E4M3's subnormals
    (spread 4: rows scaled over e^+-12)."""
    wt = prepare_wgmma_weight(_qweight(256, 512, spread=spread), packing)
    a, b = fragment_values(wt), fragment_values_f16(wt)
    assert torch.equal(a, b)
    assert bool((a != 0).any())
    if spread > 1:
        nz = a[a != 0].abs()
        assert float(nz.min()) < 2.0 ** -12       # small scales were exercised


def test_fp16_decode_refuses_mxfp4():
    w = torch.randn(64, 256)
    wt = prepare_wgmma_weight(C.prepare_weight(w, "mxfp4"), "split")
    with pytest.raises(ValueError, match="nvfp4"):
        fragment_values_f16(wt)


# ----------------------------------------------------------------------------- the operand


def test_quantizer_presum_rows_are_the_rounded_sum_of_the_row_pair():
    # seeded: with an unseeded draw, about 1 in 40 (the global RNG state left by the tests
    # before it) has every sum an FP16 value, and the "rounding happened" assertion fails
    x = (torch.randn(5, 512, generator=torch.Generator().manual_seed(0)) * 3).to(torch.bfloat16)
    pair = Q.operand_reference(x, "nvfp4", "full", "row_pair", 1, None, None, 256)
    op = Q.operand_reference(x, "nvfp4", "full", "presum", 8, None, None, 256)
    assert op.xop.dtype == torch.float16 and op.xop.shape == (8, 512)
    s = pair.xop[0::2].float() + pair.xop[1::2].float()
    assert torch.equal(op.xop[:5].float(), formats.presum_fp16(s, "nvfp4"))
    assert not bool(op.xop[5:].any())                 # padding rows are zero
    assert torch.equal(op.alpha, pair.alpha)
    # the FP16 rounding happened (some sums are not FP16 values), and it is RNE of the sum
    assert not torch.equal(op.xop[:5].float(), s)
    # make_presum_xop is the same operand built from make_xop's row pair
    qw = _qweight(64, 512)
    qw = dataclasses.replace(qw, input_scale=None)
    xop, ax = make_presum_xop(x.float(), qw, t_multiple=8)
    assert torch.equal(xop, op.xop) and torch.equal(ax, op.alpha)


def test_quantizer_presum_layout_is_validated():
    with pytest.raises(ValueError, match="NVFP4 only"):
        Q.operand_shape("mxfp4", "full", 512, 4, "presum")
    with pytest.raises(ValueError, match="does not fit"):
        Q.operand_shape("nvfp4", "none", 512, 4, "presum")
    s = Q.operand_shape("nvfp4", "full", 512, 5, "presum", row_multiple=8, kp_align=256)
    assert (s.t_pad, s.rows_per_slot, s.slots) == (8, 1, 8)
    bad = Q.QuantConfig("nvfp4", "full", 512, "presum", write_codes=True)
    assert "fp16 xop only" in bad.why_invalid()
    ok = Q.QuantConfig("nvfp4", "full", 512, "presum", write_codes=False, kp_align=256)
    assert ok.why_invalid() is None
    out = Q.QuantKernel(ok, compiled=None, registers=40).outputs(5, 8, "cpu")
    assert out.operand.xop.dtype == torch.float16 and out.operand.xop.shape == (8, 512)
    with pytest.raises(ValueError, match="no codes or scales"):
        Q.split_operand(Q.operand_reference(torch.randn(2, 512), "nvfp4", "full", "presum"))


def test_quantizer_presum_render_compiles_and_rounds_once():
    """The presum render writes no codes, sums in FP32 and rounds with cvt.rn.f16x2.f32 once
    per pair of channels (EPT / 2 per lane and warp tile, UNROLL tiles); the other layouts'
    kernels have none (the presum branch is trace-time Python)."""
    cfg = Q.QuantConfig("nvfp4", "full", 512, "presum", write_codes=False, alpha="dynamic",
                        kp_align=256)
    kern, res = Q.compile_config(cfg)
    assert res.ptx.count("cvt.rn.f16x2.f32") == cfg.unroll * cfg.ept // 2
    for layout in ("row_pair", "tile8"):            # trace-time branches: no presum code
        _, other = Q.compile_config(dataclasses.replace(cfg, layout=layout))
        assert "cvt.rn.f16x2.f32" not in other.ptx


# ----------------------------------------------------------------------------- the variant


def test_fold_axis_keys_and_validity():
    v = LinearSm90WgmmaVariant(fold=Fold.PRESUM)
    e = LinearSm90WgmmaVariant()
    assert "fold" not in e.as_dict() and not e.name().endswith("exact")
    assert v.as_dict()["fold"] == "presum" and v.name().endswith("_fdpresum")
    assert LinearSm90WgmmaVariant.from_dict(v.as_dict()) == v
    assert LinearSm90WgmmaVariant.from_dict(e.as_dict()) == e
    full = LinearProblem("nvfp4", "full", 64, 4096, 4096)
    assert FAMILY.why_invalid(v, full, ARCH) is None
    assert FAMILY.why_invalid(v, LinearProblem("mxfp4", "full", 64, 4096, 4096),
                              ARCH) == PRESUM_NVFP4_ONLY
    for comp in ("none", "0.25", "w4a16"):
        assert FAMILY.why_invalid(v, LinearProblem("nvfp4", comp, 64, 4096, 4096),
                                  ARCH) == PRESUM_MEXT_ONLY
    assert gemm_rows(v, full) == 64 and gemm_rows(e, full) == 128
    assert not geometry_of(v, full).mext and geometry_of(e, full).mext


def test_space_adds_presum_twins_after_the_exact_variants():
    p = LinearProblem("nvfp4", "full", 256, 4096, 4096)
    space = list(FAMILY.space(p, ARCH))
    first = next(i for i, v in enumerate(space) if v.presum)
    assert not any(v.presum for v in space[:first]) and all(v.presum for v in space[first:])
    # presum's token tiles follow M (256 rows), the exact fold's 2 M (512)
    assert max(v.bn for v in space[first:]) == 256
    assert not any(v.presum for v in FAMILY.space(LinearProblem("mxfp4", "full", 256, 4096,
                                                                4096), ARCH))
    assert not any(v.presum for v in FAMILY.space(LinearProblem("nvfp4", "none", 256, 4096,
                                                                4096), ARCH))


def test_presum_render_is_fp16_and_compiles_for_sm90a():
    from resgen.kernels import codegen

    p = LinearProblem("nvfp4", "full", 64, 256, 512)
    env = codegen._env()
    src = {f: env.get_template(FAMILY.TEMPLATE).render(
        **FAMILY.template_params(LinearSm90WgmmaVariant(fold=f), p)) for f in Fold}
    assert "linear_sm90_wgmma_presum" not in src[Fold.EXACT]
    assert "Float16" not in src[Fold.EXACT].replace("BFloat16", "")
    assert "linear_sm90_wgmma_presum as DP" in src[Fold.PRESUM]
    assert "DP.decode_chunk_f16" in src[Fold.PRESUM] and "cutlass.Float16," in src[Fold.PRESUM]
    v = LinearSm90WgmmaVariant(fold=Fold.PRESUM)
    path, _ = codegen.render_to_file(FAMILY.TEMPLATE, FAMILY.template_params(v, p), FAMILY.NAME)
    res = codegen.compile_entry(codegen.load_module(path).entry, FAMILY.compile_args(v, p), ARCH)
    assert "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16" in res.ptx
    assert "bf16" not in res.ptx.split("wgmma")[1][:60]
    # 16 FP16 multiplies per chunk, two chunks per main-loop iteration (the A double buffer)
    assert res.ptx.count("mul.rn.f16x2") == 32 and "mul.rn.bf16x2" not in res.ptx


# ----------------------------------------------------------------------------- whole layers


class _PresumReferenceQuantizer:
    """Duck-typed compiled quant_sm90 QuantKernel of layout "presum" for M-Ext ("full") or a
    K-Ext ratio: its operand from the torch definition (quant_sm90.operand_reference; K-Ext
    takes the layer's masks, M-Ext none)."""

    class _Op:
        def __init__(self, xop, alpha):
            self.xop, self.alpha = xop, alpha

    def __init__(self, alpha_mode: str, compensation: str = "full") -> None:
        self.config = type("Cfg", (), {"alpha": alpha_mode, "layout": "presum"})()
        self.compensation = compensation
        self.calls = 0

    def outputs(self, m, row_multiple=1, device="cpu"):
        return {"row_multiple": row_multiple}

    def __call__(self, x, outs, alpha=None, masks=None):
        assert x.dtype == torch.bfloat16
        assert (masks is None) == (self.compensation == "full")
        op = Q.operand_reference(x, "nvfp4", self.compensation, "presum", outs["row_multiple"],
                                 None if alpha is None else alpha.reshape(()), masks, 256)
        self.calls += 1
        return self._Op(op.xop, op.alpha)


@pytest.mark.parametrize("static", [True, False])
@pytest.mark.parametrize("m", [3, 40])
def test_simulated_presum_layer_matches_both_folds(m, static):
    """A presum variant's whole layer (the quantizer's presum rows, then the simulated FP16
    GEMM reading M rows) against reference.linear(fold="presum") and the exact fold (3e-3);
    the GEMM alone on make_presum_xop too (check_gemm)."""
    p = LinearProblem("nvfp4", "full", m, 128, 512, static_scale=static)
    v = LinearSm90WgmmaVariant(1, 1, 32, 3, Raster.CH, Packing.NIB, fold=Fold.PRESUM)
    assert FAMILY.why_invalid(v, p, ARCH) is None
    r = FAMILY.runner(SimulatedKernel(geometry_of(v, p), torch.float16), v, p, "cpu")
    assert r.rows == m
    q = _PresumReferenceQuantizer("static" if static else "dynamic")
    r.attach_quantizer(q)
    gemm = r.check_gemm()
    assert gemm.ok, gemm.detail
    whole = r.check_quantized()
    assert whole.ok, whole.detail
    assert q.calls == 1
    assert r.launcher.geom.mext is False


def test_presum_is_one_fp16_rounding_not_the_exact_fold():
    """Token 0's operand sums to 1 + 2^-12 and -1: the presum row rounds 1 + 2^-12 to 1 in
    FP16, so against an all-ones weight the presum GEMM gives exactly 0 where the exact fold
    gives 2^-12 x scale: the simulated kernel computes presum's numerics, not the fold's."""
    n, k = 64, 256
    qw = C.prepare_weight(torch.ones(n, k), "nvfp4")
    wt = prepare_wgmma_weight(qw, "split")
    v = LinearSm90WgmmaVariant(1, 1, 16, 2, Raster.TOK, Packing.SPLIT, fold=Fold.PRESUM)
    p = LinearProblem("nvfp4", "full", 2, n, k)
    launch = WgmmaLauncher(SimulatedKernel(geometry_of(v, p), torch.float16),
                           geometry_of(v, p), "cpu", xop_dtype=torch.float16)
    s = torch.zeros(2, k)
    s[0, 0], s[0, 1] = 1.0 + 2.0 ** -12, -1.0
    s[1, 5] = 1.0 + 2.0 ** -9
    xop = torch.zeros(8, k, dtype=torch.float16)
    xop[:2] = formats.presum_fp16(s, "nvfp4").to(torch.float16)
    out = torch.full((2, n), float("nan"), dtype=torch.bfloat16)
    ax = torch.ones(1)
    launch(wt, xop, 2, 2, ax, out)
    assert bool((out[0] == 0).all())     # the exact fold keeps token 0's 2^-12 x scale
    unit = formats.dequantize(qw.q, apply_global_scale=False).float()
    want = (s[1:2] @ unit.T) * float(qw.q.global_scale)
    assert torch.allclose(out[1].float(), want[0].to(torch.bfloat16).float())
    with pytest.raises(TypeError, match="float16"):
        launch(wt, xop.to(torch.bfloat16), 2, 2, ax, out)


def test_presum_check_catches_an_exact_fold_kernel():
    """check_folds, the check every presum variant passes, has teeth: an output with plain
    numerics (the residue dropped) fails it; presum's own reference passes it."""
    m = 8
    p = LinearProblem("nvfp4", "full", m, 128, 512)
    qw = _qweight(128, 512, seed=3)
    x = torch.randn(m, 512) * 3
    plain = reference.linear(x, qw, "none")
    res = check_folds(plain.to(torch.bfloat16), x, qw, "full", "presum")
    assert not res.ok
    good = reference.linear(x, qw, "full", fold="presum")
    assert check_folds(good.to(torch.bfloat16), x, qw, "full", "presum").ok
    assert p.rows == 2 * m


def test_warm_start_offers_the_plain_winners_presum_twins():
    """An M-Ext workload's warm start interleaves the presum twins of its plain twin's fastest
    rows (presum's GEMM is the plain GEMM) with its own exact-fold rows, presum first; MXFP4
    (no presum) keeps only its own rows."""
    from resgen.search.warmstart import WarmStart

    full = LinearProblem("nvfp4", "full", 128, 4096, 4096)
    plain = dataclasses.replace(full, compensation="none")
    pv = [LinearSm90WgmmaVariant(2, 1, 128, 6), LinearSm90WgmmaVariant(2, 1, 64, 4)]
    fv = LinearSm90WgmmaVariant(2, 1, 256, 6, Raster.CH)
    rows = [{"family": FAMILY.NAME, "workload_digest": plain.digest(), "median_us": t,
             "variant_key": v.key()} for t, v in ((5.0, pv[0]), (6.0, pv[1]))]
    rows.append({"family": FAMILY.NAME, "workload_digest": full.digest(), "median_us": 9.0,
                 "variant_key": fv.key()})
    ws = WarmStart("table", "NVIDIA H200", lambda path, gpu: rows)
    twins = [dataclasses.replace(v, fold=Fold.PRESUM) for v in pv]
    assert ws.candidates(FAMILY, full, ARCH, 4) == [twins[0], fv, twins[1]]
    assert ws.candidates(FAMILY, full, ARCH, 2) == [twins[0], fv]
    assert ws.candidates(FAMILY, plain, ARCH, 4) == pv
    mx = LinearProblem("mxfp4", "full", 128, 4096, 4096)
    rows += [{**r, "workload_digest": mx.digest() if r["variant_key"] == fv.key()
              else dataclasses.replace(mx, compensation="none").digest()} for r in list(rows)]
    ws = WarmStart("table", "NVIDIA H200", lambda path, gpu: rows)
    assert ws.candidates(FAMILY, mx, ARCH, 4) == [fv]


def test_ops_linear_serves_a_pinned_presum_variant_through_the_sim_backend():
    """resgen.ops.Linear with a presum variant pinned, on the CPU stand-ins the engine's sim
    backend uses: the plan asks the quantizer stand-in for the "presum" layout, the simulated
    FP16 GEMM reads M rows, and the layer matches both folds' references."""
    from resgen.engine.backend import _empty_dispatcher, _sim_compile, _sim_quantizer
    from resgen.ops import Linear

    qw = _qweight(128, 512, seed=5)
    v = LinearSm90WgmmaVariant(1, 1, 32, 3, Raster.TOK, Packing.SPLIT, fold=Fold.PRESUM)
    layer = Linear(qw, "full", device="cpu", family="linear_sm90_wgmma", variant=v,
                   dispatcher=_empty_dispatcher(), compile_fn=_sim_compile,
                   quantizer_fn=_sim_quantizer)
    x = (torch.randn(6, 512) * 3).to(torch.bfloat16)
    y = layer(x)
    plan = layer.plan(6)
    assert plan.variant == v and plan.run.quantizer.layout == "presum"
    assert check_folds(y, x.float(), qw, "full", "presum").ok
