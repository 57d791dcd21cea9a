"""linear_sm90_wgmma on the CPU: the wg64 layout and decode proved exact, the wgmma fragment
coordinates checked against the CuTe DSL's own partitions, the kernel's data path simulated
thread by thread against resgen.reference.linear, the mbarrier pipeline protocol stepped in
random interleavings, the variant space and predicate, compile-only checks for sm_90a, and the
launcher / runner plumbing with the simulation standing in for the GPU."""

from __future__ import annotations

import dataclasses

import re

import pytest
import torch

from resgen import calibrate as C
from resgen import formats as F
from resgen import reference as R
from resgen.kernels import sm90_fp4_layout as L
from resgen.kernels import linear_sm90_wgmma_layout as W
from resgen.kernels.sm90_operand import make_xop
from resgen.kernels.linear_sm90_wgmma import WgmmaLauncher
from resgen.kernels.linear_sm90_wgmma_geom import WgGeometry, record_bytes
from resgen.kernels.linear_sm90_wgmma_sim import (SimulatedKernel, cvt_bf16x2, prmt,
                                                  simulate_launch, simulate_pipeline)
from resgen.search.linear_sm90_mma import Packing
from resgen.search.linear_sm90_wgmma import (FAMILY, LinearSm90WgmmaVariant, Producer, Raster,
                                             geometry_of, kp_of)
from resgen.search.variant import LinearProblem

ARCH = "sm_90a"


def _qweight(fmt, n=128, k=512, seed=0, ratio=None, static=True):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.exp(torch.randn(n, 1, generator=g))
    sel = None
    if ratio is not None:
        st = C.ChannelStats(k)
        st.update(torch.randn(16, k, generator=g) * torch.exp(torch.randn(1, k, generator=g)))
        sel = C.select_channels(st.mean_abs(), ratio)
    isc = torch.tensor(4.0 / (6 * 448)) if (fmt == "nvfp4" and static) else None
    return C.prepare_weight(w, fmt, sel, input_scale=isc)


def _adversarial(fmt, n=64, k=256, seed=0) -> C.QLinearWeight:
    """Every code (with -0 and the subnormal 0.5) against every usable scale."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    codes[0, :16] = torch.arange(16, dtype=torch.uint8)
    if fmt == "nvfp4":
        sbytes = torch.arange(0, 0x7F, dtype=torch.uint8)          # 0x7F is NaN
        sb = sbytes[torch.randint(0, len(sbytes), (n * k // 16,), generator=g)]
        sb[: len(sbytes)] = sbytes
        scales = sb.view(torch.float8_e4m3fn).reshape(n, k // 16)
        zero = (scales.to(torch.float32) == 0).repeat_interleave(16, dim=1)
        codes = torch.where(zero, torch.zeros_like(codes), codes)
        q = F.QuantizedTensor("nvfp4", F.pack_fp4(codes), scales, torch.tensor(0.37))
    else:
        e = torch.randint(9, 136, (n, k // 32), generator=g, dtype=torch.int32)
        e[0, 0], e[0, 1] = 9, 135
        e[1, 0] = 3                                                 # tiny but all-zero block
        codes[1, :32] = torch.tensor([0, 8] * 16, dtype=torch.uint8)
        q = F.QuantizedTensor("mxfp4", F.pack_fp4(codes), e.to(torch.uint8), None)
    return C.QLinearWeight(q, k)


# ----------------------------------------------------------------------------- layout


def test_chunk_permutation_is_a_bijection():
    perm = W.chunk_permutation()
    assert sorted(perm.tolist()) == list(range(64))


@pytest.mark.parametrize("packing", L.PACKINGS)
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_fragments_decode_to_the_exact_weights(fmt, packing):
    """Bit decode x expanded scale byte, multiplied in BF16, placed with the wgmma A fragment
    coordinates, equals w_hat / alpha x 2^-7 bit for bit (signs of zero included)."""
    qw = _adversarial(fmt)
    wt = W.prepare_wgmma_weight(qw, packing)
    assert wt.records.shape == (1, 256 // 64, record_bytes(fmt) // 4)
    dense = W.dense_weight_values(wt)
    ref = F.dequantize(qw.q, apply_global_scale=False)
    assert torch.equal(dense * 128, ref)
    assert torch.equal(torch.signbit(dense * 128), torch.signbit(ref))


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_kext_weights_and_padding(fmt):
    qw = _qweight(fmt, n=64, k=512, ratio=0.125)
    wt = W.prepare_wgmma_weight(qw, "split")
    kw = qw.q.shape[1]
    assert wt.kw == kw and wt.kp == L.pad_to(kw, 256) and wt.kp > kw
    dense = W.dense_weight_values(wt)
    assert torch.equal(dense[:, :kw] * 128, F.dequantize(qw.q, apply_global_scale=False))
    assert not bool(dense[:, kw:].any())                          # zero-code padding


def test_prep_rejects_bad_weights():
    with pytest.raises(ValueError, match="% 64"):
        W.prepare_wgmma_weight(_qweight("nvfp4", n=96, k=256))
    with pytest.raises(ValueError, match="packing"):
        W.prepare_wgmma_weight(_qweight("nvfp4", n=64, k=256), "bogus")
    q = _adversarial("mxfp4")
    bad = q.q.scales.clone()
    bad[5, 3] = 140                                                # |w| >= 2^13: not exact
    with pytest.raises(ValueError, match="MXFP4"):
        W.prepare_wgmma_weight(C.QLinearWeight(F.QuantizedTensor("mxfp4", q.q.codes, bad,
                                                                  None), q.in_features))


# ----------------------------------------------------------------------------- fragments


_PROBE: dict = {}


def _probe_fragments(bn: int) -> dict:
    """Coordinates the CuTe DSL assigns to every thread's A (64 x 64, 4 k16 blocks) and
    accumulator (64 x bn) register elements of the RS BF16 wgmma this family compiles."""
    import cutlass
    import cutlass.cute as cute
    import cutlass.utils.hopper_helpers as sm90_utils
    from cutlass import BFloat16, Float32
    from cutlass.cute.nvgpu import OperandMajorMode, warpgroup

    out: dict = {}

    @cute.jit
    def probe():
        tm = sm90_utils.make_trivial_tiled_mma(
            BFloat16, BFloat16, OperandMajorMode.K, OperandMajorMode.K, Float32, (1, 1, 1),
            (64, bn), warpgroup.OperandSource.RMEM)
        for tid in cutlass.range_constexpr(128):
            thr = tm.get_slice(tid)
            a = thr.partition_A(cute.make_identity_tensor((64, 64)))
            c = thr.partition_C(cute.make_identity_tensor((64, bn)))
            out[("A", tid)] = [tuple(int(x) for x in a[i]) for i in range(cute.size(a))]
            out[("C", tid)] = [tuple(int(x) for x in c[i]) for i in range(cute.size(c))]

    cute.compile(probe, options="--gpu-arch sm_90a")
    return out


@pytest.mark.parametrize("bn", [64, 256])
def test_register_fragments_match_the_cute_wgmma_layout(bn):
    """The A fragment element 8 j + 2 r + h of thread (q, g, t) sits at a_coord(q, g, t, j,
    2 r + h) (so register r of k16 step j is the bf16x2 pair the decode writes), and the
    accumulator element e at acc_coord(q, g, t, e): the ALayout_64x16 / CLayout_64xN of
    CuTe's SM90 RS GMMA atoms, i.e. the PTX ISA wgmma m64nNk16 register fragments."""
    got = _PROBE.setdefault(bn, _probe_fragments(bn))
    for tid in range(128):
        q, lane = tid // 32, tid % 32
        g, t = lane // 4, lane % 4
        want_a = [WgGeometry.a_coord(q, g, t, j, s) for j in range(4) for s in range(8)]
        assert got[("A", tid)] == want_a, tid
        want_c = [WgGeometry.acc_coord(q, g, t, e) for e in range(bn // 2)]
        assert got[("C", tid)] == want_c, tid


# ----------------------------------------------------------------------------- simulation


def test_prmt_and_cvt_follow_ptx():
    a = torch.tensor([0x33221100], dtype=torch.int64)
    b = torch.tensor([0x77665544], dtype=torch.int64)
    assert int(prmt(a, b, 0x5410)) == 0x55441100
    assert int(prmt(a, b, 0x3276)) == 0x33227766
    assert int(prmt(a, b, 0x7654)) == 0x77665544
    lo, hi = torch.tensor([1.0]), torch.tensor([-2.0])
    assert int(cvt_bf16x2(lo, hi)) == 0xC0003F80


# (consumers, m_wg, bn, stages, raster, split_k); a split that does not divide the chunks of
# a case falls back to 2
_GEOMS = [(2, 1, 32, 3, "tok", 1), (1, 2, 16, 2, "ch", 2), (1, 1, 64, 4, "tok", 4),
          (2, 2, 16, 2, "tok", 2)]


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("comp", ["none", "full", 0.125, 1.0])
def test_simulated_kernel_matches_the_reference(fmt, comp):
    """Every output written (NaN-poisoned buffer), within 3e-3 of reference.linear, and equal
    to the reference rounded to BF16 except for rare one-ulp FP32 summation-order ties."""
    n, k = 256, 512
    qw = _qweight(fmt, n=n, k=k, ratio=None if comp in ("none", "full") else comp)
    mext = comp == "full"
    for packing in ("split", "nib"):
        wt = W.prepare_wgmma_weight(qw, packing)
        for i, (c, mw, bn, st, ras, sk) in enumerate(_GEOMS):
            geom = WgGeometry(fmt, mext, packing, c, mw, bn, st, ras, split_k=sk)
            if not geom.split_ok(wt.nk):
                geom = WgGeometry(fmt, mext, packing, c, mw, bn, st, ras, split_k=2)
            if n % geom.bm:
                continue
            m = (5, 17, 40, 1)[i]
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(i)) * 3
            xop, ax = make_xop(x, qw, comp, t_multiple=8)
            out = simulate_launch(geom, wt, xop, m, 2 * m if mext else m, ax)
            ref = R.linear(x, qw, comp)
            assert not bool(out.isnan().any())
            rel = float((out.double() - ref.double()).norm() / ref.double().norm())
            assert rel <= 3e-3, (packing, geom, rel)
            diff = (out.view(torch.int16).int() - ref.to(torch.bfloat16).view(torch.int16).int())
            assert int(diff.abs().max()) <= 1 and float((diff != 0).float().mean()) < 0.02


def test_simulation_ignores_xop_rows_past_rows():
    """TMA zero-fills rows >= rows: garbage in the xop's padding rows must not leak."""
    qw = _qweight("nvfp4", n=128, k=256)
    wt = W.prepare_wgmma_weight(qw)
    x = torch.randn(3, 256)
    xop, ax = make_xop(x, qw, "none", t_multiple=8)
    geom = WgGeometry("nvfp4", False, "split", 2, 1, 16, 2, "tok")
    clean = simulate_launch(geom, wt, xop, 3, 3, ax)
    xop[3:] = 1e4
    assert torch.equal(simulate_launch(geom, wt, xop, 3, 3, ax).view(torch.int16),
                       clean.view(torch.int16))


@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.parametrize("consumers", [1, 2])
@pytest.mark.parametrize("stages", [2, 3, 4, 6, 12])
def test_pipeline_protocol_never_deadlocks_or_races(consumers, stages, pdl):
    geom = WgGeometry("nvfp4", False, "split", consumers, 1, 128, stages, "tok", pdl=pdl)
    for nk in (2, 4, 6, 22):
        for seed in range(6):
            tr = simulate_pipeline(geom, nk, seed)
            assert sorted((w, c) for w, c, _ in tr.reads) == \
                [(w, c) for w in range(consumers) for c in range(nk)]


def test_pipeline_model_catches_a_pdl_prologue_that_expects_too_few_bytes():
    """Not vacuous for PDL either: a prologue arrival that expected only the weight bytes
    would let a consumer read a stage whose activation box has not landed."""

    class Short(WgGeometry):
        @property
        def tx_bytes(self):
            return self.w_stage_bytes

    geom = Short("nvfp4", False, "split", 2, 1, 128, 4, "tok", pdl=True)
    with pytest.raises(AssertionError):
        for seed in range(20):
            simulate_pipeline(geom, 8, seed)


def test_pipeline_model_catches_a_wrong_parity():
    """The model is not vacuous: a producer that skips the empty wait overwrites live stages."""

    class Eager(WgGeometry):
        def stage_of(self, c):
            s, ph = super().stage_of(c)
            return s, ph if c % 2 else (ph ^ 1 if c >= self.stages else ph)

    geom = Eager("nvfp4", False, "split", 2, 1, 128, 2, "tok")
    with pytest.raises(AssertionError):
        for seed in range(20):
            simulate_pipeline(geom, 8, seed)


# ----------------------------------------------------------------------------- variants


def test_variant_keys_round_trip():
    v = LinearSm90WgmmaVariant(2, 1, 192, 5, Raster.CH, Packing.NIB)
    assert LinearSm90WgmmaVariant.from_key(v.key()) == v
    assert "linear_sm90_wgmma" in v.name() and v.deterministic


@pytest.mark.parametrize("v, p, reason", [
    (LinearSm90WgmmaVariant(2, 1), LinearProblem(n=4096 + 64), "multiple of the CTA"),
    (LinearSm90WgmmaVariant(2, 2, 256), LinearProblem(), "accumulators"),
    (LinearSm90WgmmaVariant(1, 1, 72), LinearProblem(), "multiple of 16"),
    (LinearSm90WgmmaVariant(2, 1, 256, 8), LinearProblem(), "shared memory"),
    (LinearSm90WgmmaVariant(2, 1, 128, 6), LinearProblem(k=256), "K chunks"),
    (LinearSm90WgmmaVariant(2, 1, 32, 4, split_k=3), LinearProblem(k=4096), "whole chunk pairs"),
    (LinearSm90WgmmaVariant(2, 1, 32, 6, split_k=16), LinearProblem(k=4096), "per slice"),
])
def test_why_invalid_reasons(v, p, reason):
    why = FAMILY.why_invalid(v, p, ARCH)
    assert why is not None and reason in why, why


def test_producer_warp_is_valid_keyed_only_when_set_and_not_enumerated():
    """The one-warp producer (axis producer = "warp"): one consumer warpgroup on the grid
    schedule; keyed (and named) only when set, so every stored key is unchanged; the space
    does not enumerate it (not yet measured against the table in one run)."""
    p = LinearProblem("nvfp4", "none", 64, 24576, 4096)
    v = LinearSm90WgmmaVariant(1, 1, 64, 6, producer=Producer.WARP)
    assert FAMILY.why_invalid(v, p, ARCH) is None
    assert LinearSm90WgmmaVariant.from_key(v.key()) == v and v.name().endswith("_prwarp")
    assert "producer" not in LinearSm90WgmmaVariant(1, 1, 64, 6).key()
    assert '"producer":"warp"' in v.key()
    assert "one consumer warpgroup" in FAMILY.why_invalid(
        LinearSm90WgmmaVariant(2, 1, 64, 6, producer=Producer.WARP), p, ARCH)
    assert "grid schedule" in FAMILY.why_invalid(
        LinearSm90WgmmaVariant(1, 1, 64, 6, producer=Producer.WARP, streamk=1), p, ARCH)
    for q in (p, LinearProblem("nvfp4", "full", 16, 4096, 12288)):
        assert not any(u.producer == Producer.WARP for u in FAMILY.space(q, ARCH))
    # the roles: consumers at warps 0-3, the producer warp 4 (160 threads); the warpgroup
    # producer keeps warpgroup 0 and the consumers after it
    g, w = geometry_of(v, p), geometry_of(LinearSm90WgmmaVariant(1, 1, 64, 6), p)
    assert (g.threads, g.prod_wg, g.prod_warp, g.cons_wg0, g.cons_tid0) == (160, 1, 4, 0, 0)
    assert (w.threads, w.prod_wg, w.prod_warp, w.cons_wg0, w.cons_tid0) == (256, 0, 0, 1, 128)
    assert geometry_of(LinearSm90WgmmaVariant(2, 1, 64, 6), p).threads == 384
    with pytest.raises(ValueError, match="one consumer warpgroup"):
        dataclasses.replace(g, consumers=2).check()
    with pytest.raises(ValueError, match="producer must be"):
        dataclasses.replace(g, producer="lane").check()


def test_producer_is_substituted_only_when_set():
    """A warpgroup-producer render constructs its geometry exactly as before the axis (its
    PTX stayed equal: the table's refingerprint); a producer-warp render passes the field."""
    from resgen.kernels import codegen

    p = LinearProblem("nvfp4", "none", 64, 24576, 4096)
    wg, pw = (codegen.render(FAMILY.TEMPLATE, FAMILY.template_params(v, FAMILY.compile_key(v, p)))
              for v in (LinearSm90WgmmaVariant(1, 1, 64, 6),
                        LinearSm90WgmmaVariant(1, 1, 64, 6, producer=Producer.WARP)))
    assert "producer=" not in wg.split("G.check()")[0]
    assert 'pdl=False, producer="warp")' in pw
    assert wg.count("wg == G.prod_wg") == pw.count("wg == G.prod_wg") == 2


def test_why_invalid_arch_and_types():
    assert "sm_90a" in FAMILY.why_invalid(LinearSm90WgmmaVariant(), LinearProblem(), "sm_100a")


@pytest.mark.parametrize("n, k", [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)])
@pytest.mark.parametrize("comp", ["none", "full", "0.125", "1.0"])
def test_space_is_valid_and_nonempty(n, k, comp):
    for m in (128, 2048):
        p = LinearProblem("nvfp4", comp, m, n, k)
        space = FAMILY.space(p, ARCH)
        assert space and len(space) == len(set(space))
        assert all(FAMILY.why_invalid(v, p, ARCH) is None for v in space)
        assert FAMILY.why_invalid(FAMILY.default(p, ARCH), p, ARCH) is None


def test_small_problems_have_a_default():
    p = LinearProblem("mxfp4", "none", 1, 64, 128)
    v = FAMILY.default(p, ARCH)
    assert v.consumers == 1 and FAMILY.why_invalid(v, p, ARCH) is None
    assert FAMILY.space(p, ARCH)


def test_compile_key_drops_m_n_k_and_kext():
    v = LinearSm90WgmmaVariant()
    a = FAMILY.compile_key(v, LinearProblem("nvfp4", "none", 1, 4096, 4096))
    b = FAMILY.compile_key(v, LinearProblem("nvfp4", "0.25", 2048, 24576, 12288, False))
    c = FAMILY.compile_key(v, LinearProblem("nvfp4", "full", 7, 4096, 4096))
    assert a == b and a != c
    assert FAMILY.template_params(v, a) == FAMILY.template_params(
        v, LinearProblem("nvfp4", "0.5", 9, 128, 256))


def test_kp_matches_the_quantizer_operand():
    from resgen.kernels.quant_sm90 import operand_shape

    for fmt in ("nvfp4", "mxfp4"):
        for comp in ("none", "full", "0.125", "0.25", "0.5", "1.0"):
            p = LinearProblem(fmt, comp, 4, 4096, 4096)
            layout = "row_pair" if comp == "full" else "plain"
            assert kp_of(p) == operand_shape(fmt, comp, 4096, 4, layout, 1, 256).kp


# ----------------------------------------------------------------------------- compile


COMPILE_CASES = [
    (LinearProblem("nvfp4", "none", 2048, 4096, 4096), LinearSm90WgmmaVariant(2, 1, 256, 4)),
    (LinearProblem("nvfp4", "full", 1024, 24576, 4096),
     LinearSm90WgmmaVariant(2, 2, 128, 4, Raster.CH, Packing.NIB)),
    (LinearProblem("mxfp4", "none", 2048, 6144, 4096), LinearSm90WgmmaVariant(1, 2, 128, 6)),
    (LinearProblem("mxfp4", "full", 256, 4096, 12288), LinearSm90WgmmaVariant(1, 1, 64, 3)),
    (LinearProblem("nvfp4", "0.125", 512, 4096, 4096), LinearSm90WgmmaVariant(2, 1, 192, 5)),
    (LinearProblem("nvfp4", "full", 128, 4096, 4096), LinearSm90WgmmaVariant(2, 1, 64, 8)),
    # split-K (decode / mid-size M on layers with few channel tiles)
    (LinearProblem("nvfp4", "full", 16, 4096, 12288),
     LinearSm90WgmmaVariant(2, 1, 32, 6, Raster.TOK, Packing.SPLIT, 4)),
    (LinearProblem("mxfp4", "none", 16, 6144, 4096),
     LinearSm90WgmmaVariant(1, 1, 16, 4, Raster.CH, Packing.NIB, 8)),
    (LinearProblem("nvfp4", "none", 64, 4096, 4096),
     LinearSm90WgmmaVariant(2, 2, 64, 4, Raster.TOK, Packing.SPLIT, 2)),
    # programmatic dependent launch behind the quantizer (with and without split-K)
    (LinearProblem("nvfp4", "full", 32, 6144, 4096),
     LinearSm90WgmmaVariant(1, 1, 64, 6, Raster.TOK, Packing.SPLIT, 2, True)),
    (LinearProblem("mxfp4", "none", 1024, 4096, 4096),
     LinearSm90WgmmaVariant(2, 1, 128, 4, Raster.CH, Packing.NIB, 1, True)),
    # a deep ring for a narrow token tile, one warpgroup over two m64 blocks
    (LinearProblem("nvfp4", "none", 16, 24576, 4096),
     LinearSm90WgmmaVariant(1, 2, 16, 12, Raster.TOK, Packing.SPLIT, 1, True)),
    # one producer warp after the consumer warpgroup (160 threads): plain, M-Ext with split-K
    # and PDL, MXFP4
    (LinearProblem("nvfp4", "none", 64, 24576, 4096),
     LinearSm90WgmmaVariant(1, 1, 64, 6, producer=Producer.WARP)),
    (LinearProblem("nvfp4", "full", 32, 4096, 12288),
     LinearSm90WgmmaVariant(1, 1, 64, 4, Raster.TOK, Packing.SPLIT, 4, True,
                            producer=Producer.WARP)),
    (LinearProblem("mxfp4", "none", 16, 24576, 4096),
     LinearSm90WgmmaVariant(1, 2, 16, 8, Raster.CH, Packing.NIB, producer=Producer.WARP)),
]


def _compile(v, p, tmp_path):
    from resgen.kernels import codegen

    ck = FAMILY.compile_key(v, p)
    path, _ = codegen.render_to_file(FAMILY.TEMPLATE, FAMILY.template_params(v, ck),
                                     FAMILY.NAME, root=tmp_path)
    return FAMILY.compile_module(path, v, ck, ARCH)


@pytest.mark.parametrize("p, v", COMPILE_CASES, ids=lambda x: x.name() if hasattr(x, "name")
                         else f"{x.fmt}-{x.compensation}")
def test_compiles_for_sm90a(p, v, tmp_path):
    assert FAMILY.why_invalid(v, p, ARCH) is None
    res = _compile(v, p, tmp_path)
    ptx = res.ptx
    assert ptx and ".target sm_90a" in ptx
    shape = f"wgmma.mma_async.sync.aligned.m64n{v.bn}k16.f32.bf16.bf16"
    # the main loop body: two chunks x 4 k16 steps x m_wg blocks, A from registers ({...} a)
    assert ptx.count(shape) == 8 * v.m_wg
    assert re.search(re.escape(shape) + r" \{[^}]*\}, \{%r\d+, %r\d+, %r\d+, %r\d+\}, %rd\d+",
                     ptx)
    # the accumulate flag of every wgmma is the constant 1 (not the atom's default 0)
    for reg in set(re.findall(r"setp\.ne\.b32 p, (%r\d+), 0;\s*\n\s*wgmma\.mma_async", ptx)):
        assert re.search(rf"mov\.b32\s+{re.escape(reg)}, 1;", ptx), reg
    assert "wgmma.fence.sync.aligned" in ptx and "wgmma.wait_group.sync.aligned" in ptx
    assert "cp.async.bulk.tensor.2d.shared::cta.global" in ptx
    assert "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes" in ptx
    assert ("setmaxnreg" in ptx) == (v.consumers == 2)
    # launch bounds (.reqntid + .minnctapersm 1) make ptxas launch with the whole register
    # file, so the producer's setmaxnreg.dec frees what the consumers' .inc asks for
    assert ".minnctapersm 1" in ptx
    # the CTA: a producer warpgroup (or one producer warp) and the consumer warpgroups
    assert re.search(rf"\.reqntid {geometry_of(v, p).threads}, 1, 1", ptx)
    assert geometry_of(v, p).threads == 128 * v.consumers + (
        32 if v.producer == Producer.WARP else 128)
    if v.consumers == 2:
        assert res.registers == 168
    assert "mul.rn.bf16x2" in ptx and "ftz" not in ptx
    assert "shfl.sync.bfly.b32" in ptx and "trap;" in ptx
    # two elections in the producer (barrier arrival + weight copies; the TMA copy's own):
    # a TMA copy issued from an already single-lane branch would nest a third, whose
    # elect.sync over 32 lanes would then wait for lanes that never come
    assert ptx.count("elect.sync") == 2 + 2 * v.pdl  # PDL: the prologue has both kinds too
    # PDL: the producer's first weight copies come before its griddepcontrol.wait, which comes
    # before any activation box; the consumers wait once more before the epilogue (ptxas may
    # duplicate the producer's wait into both paths around its prologue loop)
    assert (ptx.count("griddepcontrol.wait") >= 2) == v.pdl
    assert ("griddepcontrol.wait" in ptx) == v.pdl
    if v.pdl:
        first_wait = ptx.index("griddepcontrol.wait")
        assert ptx.index("cp.async.bulk.shared::cluster.global") < first_wait
        assert ptx.index("cp.async.bulk.tensor") > first_wait
    assert "ld.local" not in ptx and "st.local" not in ptx
    assert res.spill_bytes == 0, f"{res.spill_bytes} bytes of local memory"
    assert res.registers is not None and res.registers <= 255
    # split-K: partials out with 16-byte stores, the semaphore, the consumers-only barrier,
    # the last CTA's L2 reads of every slice (one per slice and accumulator vector)
    split = v.split_k > 1
    assert ("st.global.v4.f32" in ptx) == split
    assert ("atom.global.acq_rel.gpu.add.u32" in ptx) == split
    assert ("fence.acq_rel.gpu" in ptx) == split
    assert (re.search(r"bar\.sync\s+1, " + str(128 * v.consumers), ptx) is not None) == split
    assert ptx.count("ld.global.cg.v4.f32") == (v.split_k * v.m_wg * v.bn // 8 if split else 0)


def test_compile_through_the_build_helper():
    from resgen.search import build

    p = LinearProblem("nvfp4", "full", 1024, 4096, 4096)
    out = build.compile_variant(FAMILY, FAMILY.default(p, ARCH), p, ARCH)
    assert out.ok, out.error
    assert out.spill_bytes == 0 and len(out.fingerprint) == 64


# ----------------------------------------------------------------------------- plumbing


@pytest.mark.parametrize("comp", ["none", "full", "0.25"])
def test_runner_with_the_simulation(comp):
    """The family runner and the launcher end to end on the CPU: the simulated kernel reads the
    raw addresses and ints the launcher passes (order, sizes, alignment) and writes there.
    check() runs the GEMM on a torch-quantized operand, then the bound layer (the quantizer's
    torch definition in front); the timed call is the bound layer."""
    p = LinearProblem("nvfp4", comp, 5, 128, 256)
    v = LinearSm90WgmmaVariant(2, 1, 16, 2)
    assert FAMILY.why_invalid(v, p, ARCH) is None
    fake = SimulatedKernel(geometry_of(v, p))
    q = _ReferenceQuantizer("nvfp4", comp, "static")
    r = FAMILY.runner(fake, v, p, "cpu", n_sets=2, seed=3, quantizer=q)
    res = r.check()
    assert res.ok, res.detail
    assert q.calls == 1
    r.rotate(1)
    out = r()
    assert q.calls == 2
    assert out.shape == (5, 128) and not bool(out.isnan().any())
    kp = kp_of(p)
    assert fake.calls == [(5, 10 if comp == "full" else 5, 128, kp // 64)] * 3
    assert FAMILY.working_set_bytes(v, p) >= r.bytes_per_set()


@pytest.mark.parametrize("comp", ["none", "full"])
def test_split_k_runner_with_the_simulation(comp):
    """Split-K plumbing: the launcher sizes the workspace and semaphores for the grid, the
    simulated kernel finds them big enough and the semaphores at zero; results within the
    tolerance; K that does not split into whole chunk pairs is refused before launching."""
    p = LinearProblem("nvfp4", comp, 5, 128, 1024)
    v = LinearSm90WgmmaVariant(1, 1, 16, 2, Raster.TOK, Packing.SPLIT, 4)
    assert FAMILY.why_invalid(v, p, ARCH) is None
    geom = geometry_of(v, p)
    r = FAMILY.runner(SimulatedKernel(geom), v, p, "cpu", n_sets=1, seed=5,
                      quantizer=_ReferenceQuantizer("nvfp4", comp, "static"))
    res = r.check()
    assert res.ok, res.detail
    rows = p.rows
    assert r.launcher.ws.numel() >= geom.ws_floats(rows, 128) > 0
    assert r.launcher.sem.numel() >= geom.sem_count(rows, 128) == 2 * -(-rows // 16)
    assert FAMILY.why_invalid(v, LinearProblem("nvfp4", comp, 5, 128, 768), ARCH) is not None
    qw = _qweight("nvfp4", n=128, k=768)
    wt = W.prepare_wgmma_weight(qw)
    xop, ax = make_xop(torch.randn(5, 768), qw, "none", t_multiple=8)
    with pytest.raises(ValueError, match="whole chunk pairs"):
        WgmmaLauncher(SimulatedKernel(geom), geom, "cpu")(
            wt, xop, 5, 5, ax, torch.empty(5, 128, dtype=torch.bfloat16))


def test_split_k_in_the_space_and_ranked_by_waves():
    """Layers with few channel tiles get split-K candidates, ranked first by the prior where
    they fill the GPU; wide layers at prefill sizes get none."""
    down = LinearProblem("nvfp4", "full", 16, 4096, 12288)
    space = FAMILY.space(down, ARCH)
    assert {v.split_k for v in space} >= {1, 2, 4, 8}
    best = min(space, key=lambda v: FAMILY.prior(v, down))
    assert best.split_k > 1, best
    wide = LinearProblem("nvfp4", "none", 2048, 24576, 4096)
    assert {v.split_k for v in FAMILY.space(wide, ARCH)} == {1}


class _ReferenceQuantizer:
    """Duck-typed compiled quant_sm90 QuantKernel: the quantizer's operand (kp_align 256) from
    its torch definition, resgen.kernels.quant_sm90.operand_reference."""

    class _Op:
        def __init__(self, xop, alpha):
            self.xop, self.alpha = xop, alpha

    def __init__(self, fmt, comp, alpha_mode):
        self.fmt, self.comp = fmt, comp
        self.config = type("Cfg", (), {"alpha": alpha_mode})()
        self.calls = 0

    def outputs(self, m, row_multiple=1, device="cpu"):
        return {"row_multiple": row_multiple}

    def __call__(self, x, outs, alpha=None, masks=None):
        from resgen.kernels.quant_sm90 import mode_of, operand_reference

        assert x.dtype == torch.bfloat16
        assert (masks is not None) == (mode_of(self.comp) == "kext")
        layout = "row_pair" if self.comp == "full" else "plain"
        op = operand_reference(x, self.fmt, self.comp, layout, outs["row_multiple"],
                               None if alpha is None else alpha.reshape(()), masks, 256)
        self.calls += 1
        return self._Op(op.xop, op.alpha)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("comp", ["none", "full", "0.5"])
def test_runner_behind_the_quantizer_operand(fmt, comp):
    """The quantizer's xop (its column order and K-Ext extension order, its row pairs) is the
    operand this family reads: whole-layer check with the quantizer's torch definition."""
    p = LinearProblem(fmt, comp, 6, 128, 512)
    v = LinearSm90WgmmaVariant(1, 2, 16, 3, Raster.CH, Packing.NIB)
    r = FAMILY.runner(SimulatedKernel(geometry_of(v, p)), v, p, "cpu", n_sets=1)
    q = _ReferenceQuantizer(fmt, comp, "static" if fmt == "nvfp4" else "none")
    r.attach_quantizer(q)
    res = r.check_quantized()
    assert res.ok, res.detail
    r()
    assert q.calls == 2
    assert r.sets[0][3] is None               # the torch operand is never built behind it


def test_launcher_rejects_mismatches():
    qw = _qweight("nvfp4", n=128, k=256)
    wt = W.prepare_wgmma_weight(qw)
    x = torch.randn(4, 256)
    xop, ax = make_xop(x, qw, "none")
    geom = WgGeometry("nvfp4", False, "split", 2, 1, 16, 2, "tok")
    launch = WgmmaLauncher(SimulatedKernel(geom), geom, "cpu")
    out = torch.empty(4, 128, dtype=torch.bfloat16)
    launch(wt, xop, 4, 4, ax, out)
    with pytest.raises(ValueError, match="rows"):
        launch(wt, xop, 4, 8, ax, out)
    with pytest.raises(ValueError, match="alpha_x"):
        launch(wt, xop, 4, 4, None, out)
    with pytest.raises(TypeError, match="xop"):
        launch(wt, xop.float(), 4, 4, ax, out)
    with pytest.raises(ValueError, match="aligned"):
        launch(wt, xop, 3, 3, ax, torch.empty(4 * 128 + 1, dtype=torch.bfloat16)[1:]
               .view(4, 128)[:3])
    nib = WgGeometry("nvfp4", False, "nib", 2, 1, 16, 2, "tok")
    with pytest.raises(ValueError, match="nib"):
        WgmmaLauncher(SimulatedKernel(nib), nib, "cpu")(wt, xop, 4, 4, ax, out)
    g64 = WgGeometry("nvfp4", False, "split", 1, 2, 16, 2, "tok")
    with pytest.raises(ValueError, match="multiple"):
        WgmmaLauncher(SimulatedKernel(g64), g64, "cpu")(
            W.prepare_wgmma_weight(_qweight("nvfp4", n=64, k=256)), xop, 4, 4, ax,
            torch.empty(4, 64, dtype=torch.bfloat16))


def test_compile_refuses_a_register_pool_that_would_hang_setmaxnreg(monkeypatch, tmp_path):
    """A kernel launched with fewer registers than the producer's .dec frees plus the
    consumers' .inc asks for would block in setmaxnreg.inc forever: the family refuses it."""
    from resgen.kernels import codegen

    class Res:
        ptx = "setmaxnreg.dec.sync.aligned.u32 40;\nsetmaxnreg.inc.sync.aligned.u32 232;"
        registers = 96

    monkeypatch.setattr(codegen, "load_module", lambda path: type("M", (), {"entry": None}))
    monkeypatch.setattr(codegen, "compile_entry", lambda *a, **k: Res())
    p = LinearProblem("nvfp4", "none", 128, 4096, 4096)
    with pytest.raises(RuntimeError, match="setmaxnreg"):
        FAMILY.compile_module(tmp_path / "x.py", LinearSm90WgmmaVariant(2, 1, 64, 4), p, ARCH)
    Res.registers = 168
    assert FAMILY.compile_module(tmp_path / "x.py", LinearSm90WgmmaVariant(2, 1, 64, 4), p,
                                 ARCH) is not None


def test_prior_prefers_a_token_tile_close_to_the_rows():
    for m, comp, bn in ((1, "none", 16), (16, "full", 32), (64, "none", 64), (2048, "none", 128)):
        p = LinearProblem("nvfp4", comp, m, 24576, 4096)
        best = min((v for v in FAMILY.space(p, ARCH) if not v.presum),
                   key=lambda v: (FAMILY.prior(v, p), v.key()))
        # one consumer warpgroup (two CTAs per SM) for the narrow token tiles
        # 8-stage rings first for narrow token tiles (small stages), 6 otherwise
        assert best.bn == bn and best.stages == (8 if bn <= 32 else 6), (m, comp, best)
        if bn != 64:
            assert best.consumers == (1 if bn <= 32 else 2), (m, comp, best)
    # presum's GEMM reads M rows, not 2 M: its token tile follows the tokens, and the prior
    # ranks it ahead of the exact fold (NVFP4 M-Ext)
    p = LinearProblem("nvfp4", "full", 16, 24576, 4096)
    best = min(FAMILY.space(p, ARCH), key=lambda v: (FAMILY.prior(v, p), v.key()))
    assert best.presum and best.bn == 16, best
