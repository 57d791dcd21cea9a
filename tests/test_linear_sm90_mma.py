"""linear_sm90_mma on the CPU: the frag16 layout and bit tricks proved exact by the emulator,
the variant space and predicate, and compile-only checks of the kernel for sm_90a."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from resgen import calibrate as C
from resgen import formats as F
from resgen import reference as R
from resgen.kernels import sm90_fp4_layout as L
from resgen.kernels.sm90_operand import make_xop, operand_values, xop_layout_for


def _qweight(fmt, n=48, k=512, seed=0, ratio=None, input_scale=None):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.exp(torch.randn(n, 1, generator=g))
    x = torch.randn(7, k, generator=g)
    sel = None
    if ratio is not None:
        st = C.ChannelStats(k)
        st.update(x)
        sel = C.select_channels(st.mean_abs(), ratio)
    return x, C.prepare_weight(w, fmt, sel, input_scale=input_scale)


def _adversarial_nvfp4(n=32, k=256, seed=0) -> C.QLinearWeight:
    """Every code (with -0) against every non-negative finite E4M3 scale, zero blocks included."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    codes[0, :16] = torch.arange(16, dtype=torch.uint8)
    sbytes = torch.arange(0, 0x7F, dtype=torch.uint8)            # 0x7F is NaN
    nb = n * k // 16
    sb = sbytes[torch.randint(0, len(sbytes), (nb,), generator=g)]
    sb[: len(sbytes)] = sbytes                                     # each scale at least once
    scales = sb.view(torch.float8_e4m3fn).reshape(n, k // 16)
    # zero-scale blocks carry zero codes (what the quantizer produces)
    zero = (scales.to(torch.float32) == 0).repeat_interleave(16, dim=1)
    codes = torch.where(zero, torch.zeros_like(codes), codes)
    q = F.QuantizedTensor("nvfp4", F.pack_fp4(codes), scales, torch.tensor(0.37))
    return C.QLinearWeight(q, k)


def _adversarial_mxfp4(n=32, k=256, seed=0) -> C.QLinearWeight:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    codes[0, :16] = torch.arange(16, dtype=torch.uint8)
    e = torch.randint(9, 136, (n, k // 32), generator=g, dtype=torch.int32)
    e[0, 0], e[0, 1] = 9, 135
    e[1, 0] = 3                                                    # tiny but all-zero block
    codes[1, :32] = torch.tensor([0, 8] * 16, dtype=torch.uint8)   # +0 / -0 only
    q = F.QuantizedTensor("mxfp4", F.pack_fp4(codes), e.to(torch.uint8), None)
    return C.QLinearWeight(q, k)


# ----------------------------------------------------------------------------- layout


@pytest.mark.parametrize("packing", L.PACKINGS)
@pytest.mark.parametrize("make", [_adversarial_nvfp4, _adversarial_mxfp4])
def test_fragment_values_are_exact_dequantized_weights(make, packing):
    """Decoded pair x expanded scale, multiplied in BF16, equals w_hat / alpha * 2^-7 bit for
    bit at every (row, column): -0, subnormal E2M1 x 2^-126, every scale byte."""
    qw = make()
    wt = L.prepare_sm90_weight(qw, packing)
    frag = L.fragment_weight_values(wt)
    dense = L.dense_from_fragments(frag)
    ref = F.dequantize(qw.q, apply_global_scale=False)
    assert torch.equal(dense * 128, ref)
    # signs too: torch.equal treats -0 == +0, so compare sign bits of the BF16 values
    assert torch.equal(torch.signbit(dense * 128), torch.signbit(ref))


def _place(codes, s, packing):
    if packing == "nib":
        return codes << L._NIB_SHIFT[s]
    return ((codes & 7) << L._SPLIT_MAG[s]) | ((codes >> 3) << L._SPLIT_SIGN[s])


@pytest.mark.parametrize("packing", L.PACKINGS)
def test_pair_decode_of_every_code_is_e2m1_times_2_pow_minus_126(packing):
    codes = torch.arange(16, dtype=torch.int64)
    used = 0
    for s in range(8):
        pos = _place(torch.tensor([15]), s, packing)
        assert int(pos) & used == 0, "two slots share a bit"
        used |= int(pos)
        w = _place(codes, s, packing)
        w = torch.where(w >= 2 ** 31, w - 2 ** 32, w).to(torch.int32)
        r = L.decode_pairs(w, packing)                             # [16, 4]
        p, half = L._SLOT_ROW[s] + 2 * (L._SLOT_COL[s] // 2), L._SLOT_COL[s] % 2
        bits = (r[:, p] >> (16 * half)) & 0xFFFF
        val = L._bf16_halves(bits)[:, 0].float()
        assert torch.equal(val, F.e2m1_values() * 2.0 ** -126)
        assert torch.equal(torch.signbit(val), torch.signbit(F.e2m1_values()))
        others = [q for q in range(4) if q != p]
        assert bool((r[:, others] == 0).all()), "a code leaked into another pair"
        assert bool(((r[:, p] >> (16 * (1 - half))) & 0xFFFF == 0).all()), "leak into the pair"
    assert used == 0xFFFFFFFF


@pytest.mark.parametrize("fmt", F.FORMATS)
def test_scale_expansion_matches_brief_formula_and_value(fmt):
    # every byte prep can emit: NVFP4 ((8 + 9) << 3) | 7 = 143 at most, MXFP4 E <= 135
    b = torch.arange(144 if fmt == "nvfp4" else L._MX_E_MAX + 1, dtype=torch.int64)
    bits = L.expand_scale_bits(b, fmt)
    assert torch.equal(bits, L._prmt_imad_expand(b, fmt))
    assert torch.equal(bits & 0xFFFF, bits >> 16)
    val = L._bf16_halves(bits)[:, 0].float()
    if fmt == "nvfp4":
        e, f = (b >> 3) - 9, b & 7
        want = torch.ldexp(1 + f.float() / 8, (e + 119).int())
    else:
        want = torch.ldexp(torch.ones(len(b)), (b - 127 + 119).int())
    assert torch.equal(val, want)


def test_nvfp4_scale_bytes_cover_every_e4m3_value():
    v = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn)
    q = F.QuantizedTensor("nvfp4", torch.zeros(len(v), 8, dtype=torch.uint8),
                          v.reshape(-1, 1), torch.tensor(1.0))
    b = L.scale_bytes(q).reshape(-1).to(torch.int64)
    e, f = (b >> 3) - 9, b & 7
    got = torch.ldexp(1 + f.float() / 8, e.int())
    want = v.to(torch.float32)
    nz = want > 0
    assert torch.equal(got[nz], want[nz])
    assert bool((b[~nz] == 0).all())


def test_mxfp4_scale_range_is_checked():
    qw = _adversarial_mxfp4()
    codes = F.unpack_fp4(qw.q.codes)
    big = qw.q.scales.clone()
    big[2, 0] = 136
    with pytest.raises(ValueError, match="above"):
        L.prepare_sm90_weight(C.QLinearWeight(F.QuantizedTensor("mxfp4", qw.q.codes, big, None),
                                               qw.in_features))
    small = qw.q.scales.clone()
    small[2, 0] = 8
    assert bool((codes[2, :32] & 7).any())
    with pytest.raises(ValueError, match="below"):
        L.prepare_sm90_weight(C.QLinearWeight(F.QuantizedTensor("mxfp4", qw.q.codes, small,
                                                                 None), qw.in_features))


def test_prepare_rejects_bad_shapes_and_packing():
    _, qw = _qweight("nvfp4", n=40)
    with pytest.raises(ValueError, match="% 16"):
        L.prepare_sm90_weight(qw)
    _, qw = _qweight("nvfp4")
    with pytest.raises(ValueError, match="packing"):
        L.prepare_sm90_weight(qw, packing="zigzag")


def test_layout_shapes_and_padding():
    _, qw = _qweight("nvfp4", n=32, k=320)                  # K not a multiple of 256
    wt = L.prepare_sm90_weight(qw)
    assert wt.kp == 512 and wt.kw == 320
    assert wt.words.shape == (2, 8, 32, 4) and wt.words.dtype == torch.int32
    assert wt.scales.shape == (2, 2, 32, 8) and wt.scales.dtype == torch.uint8
    dense = L.dense_from_fragments(L.fragment_weight_values(wt))
    assert bool((dense[:, 320:] == 0).all())
    _, qm = _qweight("mxfp4", n=32, k=320)
    wm = L.prepare_sm90_weight(qm)
    assert wm.scales.shape == (2, 2, 16, 8)


def test_word_bits_follow_the_documented_map():
    """Place one distinct code per (row, column) and read it back from the documented bits."""
    n, k = 16, 256
    codes = (torch.arange(n * k) % 15 + 1).reshape(n, k).to(torch.uint8)
    q = F.QuantizedTensor("nvfp4", F.pack_fp4(codes), torch.ones(n, k // 16).to(
        torch.float8_e4m3fn), torch.tensor(1.0))
    wt = L.prepare_sm90_weight(C.QLinearWeight(q, k))
    words = wt.words.to(torch.int64) & 0xFFFFFFFF
    for kq in (0, 3):
        for lane in (0, 5, 31):
            g, t = lane // 4, lane % 4
            for j in range(4):
                w = int(words[0, kq, lane, j])
                for s in range(8):
                    row = g + 8 * L._SLOT_ROW[s]
                    col = 64 * kq + 16 * t + 4 * j + L._SLOT_COL[s]
                    assert (w >> L._NIB_SHIFT[s]) & 0xF == int(codes[row, col])


# ----------------------------------------------------------------------------- emulator


@pytest.mark.parametrize("packing", L.PACKINGS)
@pytest.mark.parametrize("fmt", F.FORMATS)
@pytest.mark.parametrize("comp", ["none", "full", 0.125, 0.25, 0.5, 1.0])
def test_emulator_matches_reference_linear(fmt, comp, packing):
    ratio = comp if isinstance(comp, float) else None
    x, qw = _qweight(fmt, ratio=ratio, seed=7)
    wt = L.prepare_sm90_weight(qw, packing)
    xop, ax = make_xop(x, qw, comp)
    y = L.emulate_linear_sm90_mma(xop, wt, x.shape[0], xop_layout_for(comp), ax)
    ref = R.linear(x, qw, comp)
    rel = float((y.double() - ref.double()).norm() / ref.double().norm())
    assert rel < 1e-6, rel
    # the BF16 output the kernel stores is within BF16 rounding
    yb = y.to(torch.bfloat16).float()
    assert float((yb - ref).norm() / ref.norm()) < 3e-3


@pytest.mark.parametrize("make", [_adversarial_nvfp4, _adversarial_mxfp4])
def test_emulator_exact_on_adversarial_weights(make):
    qw = make()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, qw.in_features, generator=g) * 10
    wt = L.prepare_sm90_weight(qw)
    for comp in ("none", "full"):
        xop, ax = make_xop(x, qw, comp)
        y = L.emulate_linear_sm90_mma(xop, wt, 5, xop_layout_for(comp), ax)
        ref = R.linear(x, qw, comp)
        assert float((y - ref).norm() / ref.norm()) < 1e-6


def test_emulator_uses_the_static_input_scale():
    x, qw = _qweight("nvfp4", input_scale=0.01)
    xop, ax = make_xop(x, qw, "full")
    assert float(ax) == pytest.approx(0.01)
    y = L.emulate_linear_sm90_mma(xop, L.prepare_sm90_weight(qw), x.shape[0], "row_pair", ax)
    ref = R.linear(x, qw, "full")
    assert float((y - ref).norm() / ref.norm()) < 1e-6


def test_make_xop_values_are_exact_bf16_and_padded():
    x, qw = _qweight("nvfp4", k=320, ratio=0.25)
    xop, ax = make_xop(x, qw, 0.25, t_multiple=16)
    ext = qw.selection.extension_length("nvfp4")
    assert xop.shape == (16, L.pad_to(320 + ext, 256)) and xop.dtype == torch.bfloat16
    base, res = F.quantize_with_residue(x, "nvfp4", channels=qw.selection)
    bv = operand_values(F.unpack_fp4(base.codes), base.scales, "nvfp4")
    rv = operand_values(F.unpack_fp4(res.codes), res.scales, "nvfp4")
    assert torch.equal(xop[:7, :320].float(), bv)
    assert torch.equal(xop[:7, 320:320 + ext].float(), rv)
    assert bool((xop[7:] == 0).all()) and bool((xop[:, 320 + ext:] == 0).all())
    xop2, _ = make_xop(x, qw, "full")
    assert torch.equal(xop2[0:14:2, :320].float(), bv)


def test_make_xop_rejects_mismatched_inputs():
    x, qw = _qweight("nvfp4")
    with pytest.raises(ValueError, match="K-Ext"):
        make_xop(x, qw, 0.25)
    with pytest.raises(ValueError, match="expects"):
        make_xop(x[:, :256], qw)
    bad = x.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        make_xop(bad, qw)


# ----------------------------------------------------------------------------- variants

from resgen.kernels.linear_sm90_mma_geom import Geometry  # noqa: E402
from resgen.kernels.linear_sm90_mma_sim import simulate_kernel  # noqa: E402
from resgen.search import family as family_registry  # noqa: E402
from resgen.search.linear_sm90_mma import (FAMILY, Act, Fold, LinearSm90Variant,  # noqa: E402
                                           Packing, Pipeline, Reduction, compare, geometry_of)
from resgen.search.variant import LinearProblem  # noqa: E402

ARCH = "sm_90a"
QWEN = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]


def simulate_shuffled(geom, wt, xin, m, rows, ax, n, seed, masks=None):
    """simulate_kernel into a NaN-poisoned bf16 [m, n] output with the CTAs in a shuffled
    order (random.Random(seed)): (out, its split-K workspace)."""
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16)
    gx, gy, gz = geom.grid(rows)
    order = [(a, b, z) for a in range(gx) for b in range(gy) for z in range(gz)]
    random.Random(seed).shuffle(order)
    ws = torch.zeros(max(geom.ws_floats(rows, m), 1))
    simulate_kernel(geom, wt, xin, m, rows, ax, out, ws=ws, cta_order=order, masks=masks)
    return out, ws


def test_family_is_registered():
    assert family_registry.get_family("linear_sm90_mma") is FAMILY


def test_variant_key_changes_with_every_field():
    base = LinearSm90Variant()
    other = {"warps_m": 2, "warps_k": 4, "m_tiles": 2, "n_tiles": 2, "groups": 2,
             "pipeline": Pipeline.REGS, "stages": 2, "l2_prefetch": 2, "split_k": 2,
             "reduce": Reduction.WORKSPACE, "packing": Packing.NIB, "act": Act.FUSED,
             "pdl": True, "cluster": 2, "fold": Fold.PRESUM}
    assert set(other) == {f.name for f in dataclasses.fields(LinearSm90Variant)}
    keys = {base.key()}
    for name, value in other.items():
        v = dataclasses.replace(base, **{name: value})
        assert v.key() not in keys, name
        keys.add(v.key())
        assert LinearSm90Variant.from_key(v.key()) == v
        assert LinearSm90Variant.from_dict(v.as_dict()) == v


def test_variant_from_dict_rejects_bad_values():
    d = LinearSm90Variant().as_dict()
    for field_name, bad in (("warps_m", 3), ("m_tiles", 8), ("reduce", "sum"),
                            ("packing", "nibble"), ("pipeline", "tma"), ("stages", 9),
                            ("groups", 3)):
        dd = dict(d, **{field_name: bad})
        with pytest.raises(ValueError):
            LinearSm90Variant.from_dict(dd)


@pytest.mark.parametrize("v, p, reason", [
    (LinearSm90Variant(), LinearProblem(n=40, k=4096), "multiple of 16"),
    (LinearSm90Variant(warps_m=8, warps_k=2), LinearProblem(), "warps"),
    (LinearSm90Variant(warps_m=4, m_tiles=4), LinearProblem(n=128, k=4096), "N=128"),
    (LinearSm90Variant(split_k=2), LinearProblem(), "needs reduce"),
    (LinearSm90Variant(reduce=Reduction.ATOMIC), LinearProblem(), "without split_k"),
    (LinearSm90Variant(warps_m=1, warps_k=4, split_k=4, reduce=Reduction.WORKSPACE),
     LinearProblem(k=4096 + 256), "do not split evenly"),
    (LinearSm90Variant(m_tiles=4, groups=2, pipeline=Pipeline.REGS, stages=1),
     LinearProblem(), "register estimate"),
    (LinearSm90Variant(pipeline=Pipeline.CP_ASYNC, stages=1), LinearProblem(), "stages >= 2"),
    (LinearSm90Variant(pipeline=Pipeline.DIRECT, stages=3), LinearProblem(), "only applies"),
    (LinearSm90Variant(warps_m=2, warps_k=4, m_tiles=4, groups=2, stages=8),
     LinearProblem(n=4096, k=16384), "shared memory"),
    (LinearSm90Variant(warps_m=1, warps_k=8, stages=8), LinearProblem(k=4096), "stages for"),
    (LinearSm90Variant(warps_m=2, warps_k=4, l2_prefetch=8), LinearProblem(k=4096),
     "prefetch 8 iterations ahead of 4"),
    (LinearSm90Variant(warps_m=4, warps_k=1, stages=4, l2_prefetch=2), LinearProblem(),
     "does nothing"),
    (LinearSm90Variant(cluster=2), LinearProblem(), "act=fused only"),
    (LinearSm90Variant(warps_m=4, act=Act.FUSED, cluster=4), LinearProblem(n=128, k=4096),
     "clusters of 4"),
])
def test_why_invalid_gives_reasons(v, p, reason):
    why = FAMILY.why_invalid(v, p, ARCH)
    assert why is not None and reason in why, why


def test_why_invalid_rejects_other_arches():
    assert "sm_90a" in FAMILY.why_invalid(LinearSm90Variant(), LinearProblem(), "sm_100a")


@pytest.mark.parametrize("fmt", F.FORMATS)
@pytest.mark.parametrize("comp", ["none", "full", "0.125", "1.0"])
@pytest.mark.parametrize("n, k", QWEN + [(48, 320)])
def test_space_is_valid_deterministic_and_holds_the_default(fmt, comp, n, k):
    p = LinearProblem(fmt=fmt, compensation=comp, m=4, n=n, k=k)
    space = FAMILY.space(p, ARCH)
    assert space and space == FAMILY.space(p, ARCH)
    assert len({v.key() for v in space}) == len(space)
    assert all(FAMILY.why_invalid(v, p, ARCH) is None for v in space)
    d = FAMILY.default(p, ARCH)
    assert FAMILY.why_invalid(d, p, ARCH) is None
    assert any(v == d for v in space) or len(space) > 0


def test_compile_key_drops_m_only():
    v = LinearSm90Variant()
    a = FAMILY.compile_key(v, LinearProblem(m=1, compensation="full"))
    b = FAMILY.compile_key(v, LinearProblem(m=16, compensation="full"))
    c = FAMILY.compile_key(v, LinearProblem(m=16, compensation="none"))
    assert a == b and a != c
    assert FAMILY.template_params(v, a) == FAMILY.template_params(v, b)


# ----------------------------------------------------------------------------- kernel simulation

_DIRECT = dict(pipeline=Pipeline.DIRECT, stages=1)
_REGS = dict(pipeline=Pipeline.REGS, stages=1)
SIM_CASES = [
    ("nvfp4", "none", 3, dict(warps_m=2, warps_k=1, stages=3)),
    ("nvfp4", "full", 3, dict(warps_m=4, warps_k=1, packing=Packing.NIB, **_REGS)),
    ("mxfp4", "full", 5, dict(warps_m=1, warps_k=2, m_tiles=2, n_tiles=2, stages=2)),
    ("nvfp4", "1.0", 9, dict(warps_m=2, warps_k=2, split_k=2, reduce=Reduction.WORKSPACE,
                             groups=1, **_DIRECT)),
    ("mxfp4", "none", 9, dict(warps_m=4, warps_k=1, split_k=2, reduce=Reduction.ATOMIC,
                              l2_prefetch=1, **_DIRECT)),
    ("nvfp4", "0.125", 2, dict(warps_m=1, warps_k=1, m_tiles=4, groups=1, stages=6)),
    ("mxfp4", "full", 11, dict(warps_m=2, warps_k=1, n_tiles=4, split_k=2, groups=2,
                               reduce=Reduction.WORKSPACE, packing=Packing.NIB, **_REGS)),
    # the bulk ring: refills (stages < iterations), two tiles and two groups per iteration,
    # MXFP4 scale slots (16 per vector), K-Ext's extended K
    ("nvfp4", "none", 3, dict(warps_m=2, warps_k=1, pipeline=Pipeline.BULK, stages=3)),
    ("mxfp4", "full", 5, dict(warps_m=1, warps_k=1, m_tiles=2, n_tiles=2, groups=2,
                              pipeline=Pipeline.BULK, stages=2)),
    ("nvfp4", "0.125", 2, dict(warps_m=1, warps_k=1, m_tiles=4, pipeline=Pipeline.BULK,
                               stages=2)),
]


@pytest.mark.parametrize("fmt", F.FORMATS)
@pytest.mark.parametrize("v", [LinearSm90Variant(2, 2, 2, 1, 2, Pipeline.BULK, 3),
                               LinearSm90Variant(1, 8, 1, 1, 1, Pipeline.BULK, 4)])
def test_bulk_copies_put_each_byte_where_the_lanes_read_it(fmt, v):
    """The copy-engine transfers of one slot are 16-byte aligned, add up to the mbarrier's
    transaction bytes, never overlap, and put every weight byte at the lane offset the
    cp_async ring uses (sw_off) and every scale vector at its scale slot's ss_off."""
    p = LinearProblem(fmt=fmt, n=4096, k=4096)
    g = geometry_of(v, p)
    mt0, grp0 = 3 * g.m_tiles, 2 * g.gs
    for warp in (0, g.warps_m * g.warps_k - 1):
        for it, slot in ((0, 0), (g.nit - 1, (g.nit - 1) % g.stages)):
            cps = g.bulk_copies(mt0, grp0, it, warp, slot)
            assert sum(nb for *_, nb in cps) == g.bulk_tx_bytes
            dst: dict[tuple[bool, int], int] = {}
            for is_scale, soff, goff, nb in cps:
                assert soff % 16 == 0 and goff % 16 == 0 and nb % 16 == 0
                for b in range(0, nb, 8):
                    assert (is_scale, soff + b) not in dst
                    dst[(is_scale, soff + b)] = goff + b
            for u in range(g.groups):
                grp = grp0 + it * g.groups + u
                for mt in range(g.m_tiles):
                    for lane in range(32):
                        for i in range(4):
                            so = g.sw_off(warp, slot, u, mt, i, lane)
                            assert dst[(False, so)] == g.w_off(mt0 + mt, grp * 4 + i, lane)
                    for sl in range(g.sl):
                        assert dst[(True, g.ss_off(warp, slot, u, mt, sl))] == \
                            g.s_off(mt0 + mt, grp, sl)
    assert g.smem_bytes == (g.warps_m * g.warps_k * g.stages * (g.groups * g.m_tiles * 2304 + 8)
                            + (g.warps_k - 1) * g.warps_m * g.acc * 32 * 4)


def test_bulk_ring_validity_rules():
    p = LinearProblem(n=4096, k=4096)                     # 16 K groups
    ok = LinearSm90Variant(1, 8, 1, 1, 1, Pipeline.BULK, 2)
    assert FAMILY.why_invalid(ok, p, ARCH) is None
    assert "stages >= 2" in FAMILY.why_invalid(dataclasses.replace(ok, stages=1), p, ARCH)
    assert "bulk ring of 3 stages for 2" in FAMILY.why_invalid(
        dataclasses.replace(ok, stages=3), p, ARCH)
    assert "within the bulk ring" in FAMILY.why_invalid(
        dataclasses.replace(ok, l2_prefetch=2), p, ARCH)
    assert any(v.pipeline == Pipeline.BULK for v in FAMILY.space(
        LinearProblem("nvfp4", "full", 1, 24576, 4096), ARCH))


@pytest.mark.parametrize("v", [LinearSm90Variant(2, 2, 2, 1, 2, Pipeline.CP_ASYNC, 3),
                               LinearSm90Variant(1, 8, 1, 1, 1, Pipeline.CP_ASYNC, 6)])
def test_cp_async_ring_offsets_are_disjoint_and_in_bounds(v):
    """Every (warp, slot, group, tile, chunk, lane) owns its own 16 bytes of the ring."""
    g = geometry_of(v, LinearProblem(n=4096, k=4096))
    seen_w, seen_s = set(), set()
    for warp in range(g.warps_m * g.warps_k):
        for slot in range(g.stages):
            for u in range(g.groups):
                for mt in range(g.m_tiles):
                    for lane in range(32):
                        for i in range(4):
                            seen_w.add(g.sw_off(warp, slot, u, mt, i, lane))
                        seen_s.add(g.ss_off(warp, slot, u, mt, lane))
    n_w = g.warps_m * g.warps_k * g.stages * g.groups * g.m_tiles
    assert len(seen_w) == n_w * 128 and min(seen_w) == 0 and max(seen_w) == n_w * 2048 - 16
    assert len(seen_s) == n_w * 32 and max(seen_s) == n_w * 256 - 8


@pytest.mark.parametrize("fmt, comp, m, fields", SIM_CASES)
def test_kernel_simulation_matches_emulator_bit_for_bit(fmt, comp, m, fields):
    """The template's index math (shared Geometry) + PTX fragment semantics reproduce the
    emulator's BF16 output exactly, for CTAs run in a shuffled order."""
    _check_xop_simulation(fmt, comp, m, fields, 1024)


# ragged K slices: the CTA's K groups split unevenly over its warps (slices of floor / ceil
# groups, the long slices' last iteration behind a runtime guard); K = 1280 is 5 groups of
# 256, 2560 is 10 (Qwen3-4B's hidden size), K-Ext 0.125 at 4096 is 18
RAGGED_SIM_CASES = [
    ("nvfp4", "none", 3, 1280, dict(warps_m=1, warps_k=4, stages=3)),
    ("mxfp4", "full", 2, 2560, dict(warps_m=1, warps_k=4, **_DIRECT, l2_prefetch=1)),
    ("nvfp4", "full", 1, 2560, dict(warps_m=2, warps_k=4, pipeline=Pipeline.BULK, stages=2)),
    ("nvfp4", "none", 5, 2560, dict(warps_m=1, warps_k=4, split_k=2, stages=2,
                                    reduce=Reduction.WORKSPACE)),
    ("mxfp4", "0.125", 1, 4096, dict(warps_m=1, warps_k=8, pipeline=Pipeline.BULK, stages=2)),
]


@pytest.mark.parametrize("fmt, comp, m, k, fields", RAGGED_SIM_CASES)
def test_ragged_k_slices_simulation_matches_emulator_bit_for_bit(fmt, comp, m, k, fields):
    v = LinearSm90Variant(**fields)
    g = geometry_of(v, LinearProblem(fmt=fmt, compensation=comp, m=m, n=64, k=k))
    assert g.ragged
    _check_xop_simulation(fmt, comp, m, fields, k)


@pytest.mark.parametrize("cg, wk", [(5, 4), (10, 4), (38, 8), (19, 8), (18, 8), (9, 2),
                                    (16, 8)])
def test_ragged_slices_cover_the_cta_range_once(cg, wk):
    """Warp slices tile the CTA's K groups in order, lengths gs or gs - 1 (gs = ceil)."""
    g = Geometry("nvfp4", False, "split", 16, cg * 4 * 2, 1, wk, 1, 1, 1, "direct", 1, 0, 2,
                 "workspace")
    assert g.cg == cg and g.ragged == bool(cg % wk)
    starts = [g.wstart(w) for w in range(wk + 1)]
    assert starts[0] == 0 and starts[-1] == cg
    lens = [g.slice_groups(w) for w in range(wk)]
    assert sum(lens) == cg and set(lens) <= {g.gs, g.gs - 1} and max(lens) == g.gs
    # the second CTA along split-K starts where the first ends
    assert g.warp_coords(torch.tensor([0]), 0, 1, 0)[6].item() == cg


def _check_xop_simulation(fmt, comp, m, fields, k):

    n = 64
    p = LinearProblem(fmt=fmt, compensation=comp, m=m, n=n, k=k)
    v = LinearSm90Variant(**fields)
    assert FAMILY.why_invalid(v, p, ARCH) is None, FAMILY.why_invalid(v, p, ARCH)
    ratio = p.ratio
    x, qw = _qweight(fmt, n=n, k=k, seed=11, ratio=ratio)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    geom = geometry_of(v, p)
    wt = L.prepare_sm90_weight(qw, v.packing.value)
    c = ratio if ratio is not None else comp
    xop, ax = make_xop(x, qw, c, t_multiple=geom.tok)
    out, ws = simulate_shuffled(geom, wt, xop, m, p.rows, ax, n, seed=5)
    emu = L.emulate_linear_sm90_mma(xop, wt, m, xop_layout_for(c), ax).to(torch.bfloat16)
    assert torch.equal(out.view(torch.int16), emu.view(torch.int16))
    assert compare(out, R.linear(x, qw, c)).ok
    if v.reduce == Reduction.ATOMIC:     # the next call accumulates into it again
        assert bool((ws == 0).all()), "atomic workspace not left at zero"



# ----------------------------------------------------------------------------- fused quantization

_FUSED = dict(act=Act.FUSED)
# (fmt, comp, K, m the kernel is compiled for, m it runs, variant fields)
FUSED_SIM_CASES = [
    ("nvfp4", "none", 1024, 3, 3, dict(warps_m=2, warps_k=2, stages=3, **_FUSED)),
    ("nvfp4", "full", 1024, 5, 5, dict(warps_m=2, warps_k=1, n_tiles=2, stages=2, pdl=True,
                                       **_FUSED)),
    # compiled for one token (2-row tiles), run with five: partial n8 tiles over 5 CTAs in z
    ("nvfp4", "full", 1024, 1, 5, dict(warps_m=1, warps_k=2, split_k=2,
                                       reduce=Reduction.WORKSPACE, **_DIRECT, **_FUSED)),
    ("mxfp4", "full", 1024, 3, 4, dict(warps_m=4, warps_k=1, m_tiles=1, packing=Packing.NIB,
                                       **_REGS, **_FUSED)),
    ("mxfp4", "none", 320, 2, 7, dict(warps_m=2, warps_k=2, stages=2, **_FUSED)),  # K padding
    # K-Ext: split_k=2 puts base, extension and padding columns in the second CTA's range
    ("nvfp4", "0.125", 1024, 2, 2, dict(warps_m=2, warps_k=1, split_k=5,
                                        reduce=Reduction.ATOMIC, **_DIRECT, **_FUSED)),
    ("nvfp4", "0.5", 1024, 4, 3, dict(warps_m=1, warps_k=2, stages=2, pdl=True, **_FUSED)),
    ("mxfp4", "1.0", 1024, 1, 2, dict(warps_m=2, warps_k=2, groups=2, **_REGS, **_FUSED)),
    ("mxfp4", "0.25", 2048, 9, 9, dict(warps_m=2, warps_k=1, n_tiles=2, split_k=2,
                                       reduce=Reduction.WORKSPACE, stages=2, **_FUSED)),
    # clusters: the items dealt over 2 / 4 CTAs (K-Ext extension and padding included)
    ("nvfp4", "full", 1024, 3, 3, dict(warps_m=1, warps_k=2, stages=3, cluster=4, **_FUSED)),
    ("mxfp4", "0.125", 2048, 2, 2, dict(warps_m=2, warps_k=1, split_k=3, cluster=2,
                                        reduce=Reduction.WORKSPACE, **_DIRECT, **_FUSED)),
    # the bulk ring behind the fused prologue (PDL: filled before the wait)
    ("nvfp4", "full", 1024, 1, 1, dict(warps_m=2, warps_k=1, pipeline=Pipeline.BULK, stages=2,
                                       pdl=True, **_FUSED)),
    ("mxfp4", "0.25", 2048, 9, 9, dict(warps_m=2, warps_k=1, n_tiles=2, split_k=2,
                                       reduce=Reduction.WORKSPACE, pipeline=Pipeline.BULK,
                                       stages=3, **_FUSED)),
    # ragged K slices behind the fused prologue (the tile columns follow each warp's start)
    ("nvfp4", "full", 2560, 1, 1, dict(warps_m=1, warps_k=4, stages=3, **_FUSED)),
    ("mxfp4", "0.125", 4096, 2, 2, dict(warps_m=1, warps_k=8, pipeline=Pipeline.BULK,
                                        stages=2, pdl=True, **_FUSED)),
    ("nvfp4", "none", 1280, 3, 3, dict(warps_m=2, warps_k=4, **_DIRECT, cluster=2,
                                       **_FUSED)),
]


@pytest.mark.parametrize("fmt, comp, k, m_compiled, m, fields", FUSED_SIM_CASES)
def test_fused_simulation_matches_emulator_bit_for_bit(fmt, comp, k, m_compiled, m, fields):
    """The fused prologue's work items, K-Ext source/mask mapping, operand-tile addresses and
    partial-tile predicates reproduce, bit for bit, the xop path's emulator on the operand
    make_xop builds from the same bf16 activations (static alpha)."""

    n = 64
    p = LinearProblem(fmt=fmt, compensation=comp, m=m_compiled, n=n, k=k)
    v = LinearSm90Variant(**fields)
    assert FAMILY.why_invalid(v, p, ARCH) is None, FAMILY.why_invalid(v, p, ARCH)
    ratio = p.ratio
    isc = 0.02 if fmt == "nvfp4" else None
    _, qw = _qweight(fmt, n=n, k=k, seed=13, ratio=ratio, input_scale=isc)
    x = (torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * 3).to(torch.bfloat16)
    geom = geometry_of(v, p)
    assert geom.fused and geom.tok <= 8 * geom.n_tiles
    wt = L.prepare_sm90_weight(qw, v.packing.value)
    c = ratio if ratio is not None else comp
    xop, ax = make_xop(x.float(), qw, c, t_multiple=8)
    rows = 2 * m if comp == "full" else m
    masks = qw.selection.masks if ratio is not None else None
    out, ws = simulate_shuffled(geom, wt, x, m, rows, ax, n, seed=3, masks=masks)
    emu = L.emulate_linear_sm90_mma(xop, wt, m, xop_layout_for(c), ax).to(torch.bfloat16)
    assert torch.equal(out.view(torch.int16), emu.view(torch.int16))
    assert compare(out, R.linear(x.float(), qw, c)).ok


def test_fused_tile_rows_follow_the_compiled_rows():
    f = dict(warps_m=2, warps_k=2, stages=2, act=Act.FUSED)
    cases = [("none", 1, 1, 1), ("full", 1, 1, 2), ("none", 5, 1, 8), ("full", 5, 2, 16),
             ("full", 16, 4, 32), ("none", 16, 1, 8), ("full", 64, 8, 64)]
    for comp, m, nt, tok in cases:
        p = LinearProblem("nvfp4", comp, m, 4096, 4096)
        v = LinearSm90Variant(n_tiles=nt, **f)
        assert geometry_of(v, p).tok == tok
        ck = FAMILY.compile_key(v, p)
        assert geometry_of(v, ck).tok == tok            # a compile serves its rows ...
        assert FAMILY.compile_key(v, ck) == ck
    # ... and M buckets with the same tile share it
    v = LinearSm90Variant(n_tiles=2, **f)
    assert FAMILY.compile_key(v, LinearProblem("nvfp4", "full", 5, 4096, 4096)) == \
        FAMILY.compile_key(v, LinearProblem("nvfp4", "full", 8, 4096, 4096))


@pytest.mark.parametrize("comp, m_compiled, m, fields", [
    ("none", 1, 37, dict(m_tiles=2, n_tiles=2)),
    ("full", 1, 19, dict(m_tiles=2, n_tiles=4)),
    ("none", 3, 7, dict(act=Act.FUSED, warps_m=2, warps_k=2, stages=2)),
    ("full", 1, 3, dict(act=Act.FUSED, warps_m=2, warps_k=2, stages=2)),
    ("full", 1, 40, dict(n_tiles=2, fold=Fold.PRESUM)),
])
def test_epilogue_plan_stores_each_output_once_from_its_accumulators(comp, m_compiled, m,
                                                                     fields):
    """Geometry.epilogue_plan (the fold / store plan the kernel's store_tile / atomic_tile
    and the simulation read) against the PTX ISA's accumulator fragment: lane 4 g + t holds
    c[e] of (channel 16 mt + g + 8 (e // 2), column 8 nt + 2 t + e % 2). Every accumulator
    element of the CTA feeds exactly one output, the one of its own channel and token
    (column // 2 for M-Ext's row pairs: base + residue folded), and the outputs the row
    predicate keeps are the CTA's real (token, channel) pairs, each once (a fused kernel
    compiled for fewer rows than it runs: partial n8 tiles, rows past TOK not stored)."""
    p = LinearProblem("nvfp4", comp, m_compiled, 256, 4096)
    v = LinearSm90Variant(**fields)
    assert FAMILY.why_invalid(v, p, ARCH) is None, FAMILY.why_invalid(v, p, ARCH)
    g_ = geometry_of(v, p)
    rpt = 2 if g_.mext else 1
    for bz in range(g_.grid(m * rpt)[2]):
        bx = 1
        used, stored = set(), []
        for wm in range(g_.warps_m):
            for lane in range(32):
                _, _, _, g, t, mt0, _, row0, _ = g_.warp_coords(wm * 32 + lane, bx, 0, bz)
                for mt in range(g_.m_tiles):
                    for nt in range(g_.n_tiles):
                        ep = g_.epilogue_plan(mt, nt, mt0, row0, g, t)
                        for r in ep.rows:
                            tok = ep.token(r)
                            for idx, dch in ((r.lo, 0), (r.hi, 8)):
                                for e in idx:
                                    assert (wm, lane, mt, nt, e) not in used
                                    used.add((wm, lane, mt, nt, e))
                                    ch = 16 * (mt0 + mt) + g + 8 * (e // 2)
                                    col = 8 * nt + 2 * t + e % 2
                                    assert ep.ch + dch == ch
                                    assert tok == (bz * g_.tok + col) // rpt
                                if g_.out_ok(ep.local_row(r), tok, m):
                                    stored.append((tok, ep.ch + dch))
        assert len(used) == g_.warps_m * 32 * g_.acc
        tok0 = bz * g_.tok // rpt
        toks = range(tok0, min(m, tok0 + g_.tok // rpt))
        chans = range(bx * g_.warps_m * g_.m_tiles * 16, (bx + 1) * g_.warps_m * g_.m_tiles * 16)
        assert sorted(stored) == [(tk, c) for tk in toks for c in chans]


@pytest.mark.parametrize("v, p, reason", [
    (LinearSm90Variant(act=Act.FUSED), LinearProblem(static_scale=False), "static NVFP4"),
    (LinearSm90Variant(act=Act.FUSED, n_tiles=2), LinearProblem(m=4), "n8 tiles past"),
    (LinearSm90Variant(act=Act.FUSED, warps_m=1, warps_k=8, stages=3),
     LinearProblem(compensation="full", m=8, k=12288), "shared memory"),
    (LinearSm90Variant(act=Act.FUSED, warps_m=4, warps_k=1, stages=2),
     LinearProblem(fmt="mxfp4", compensation="0.125", k=4096 + 128), "whole blocks"),
])
def test_why_invalid_fused(v, p, reason):
    why = FAMILY.why_invalid(v, p, ARCH)
    assert why is not None and reason in why, why


# ----------------------------------------------------------------------------- compile (sm_90a)

_CP, _DI, _RG, _BK = Pipeline.CP_ASYNC, Pipeline.DIRECT, Pipeline.REGS, Pipeline.BULK
COMPILE_CASES = [
    (LinearProblem("nvfp4", "none", 1, 4096, 4096), LinearSm90Variant(4, 2, 1, 1, 1, _CP, 4)),
    (LinearProblem("nvfp4", "full", 4, 24576, 4096),
     LinearSm90Variant(2, 2, 2, 1, 2, _RG, 1, l2_prefetch=3, packing=Packing.NIB)),
    (LinearProblem("mxfp4", "full", 16, 4096, 12288),
     LinearSm90Variant(1, 4, 1, 4, 1, _DI, 1, l2_prefetch=2, split_k=2,
                       reduce=Reduction.WORKSPACE)),
    (LinearProblem("mxfp4", "none", 16, 6144, 4096),
     LinearSm90Variant(4, 1, 1, 2, 1, _CP, 3, split_k=4, reduce=Reduction.ATOMIC)),
    (LinearProblem("nvfp4", "0.125", 2, 4096, 4096),
     LinearSm90Variant(8, 1, 1, 1, 1, _CP, 2, split_k=2, reduce=Reduction.WORKSPACE)),
    (LinearProblem("nvfp4", "full", 64, 4096, 4096), LinearSm90Variant(2, 4, 1, 8, 1, _CP, 2)),
    # fused quantization, PDL
    (LinearProblem("nvfp4", "full", 1, 4096, 4096),
     LinearSm90Variant(1, 8, 1, 1, 1, _CP, 3, act=Act.FUSED, pdl=True)),
    (LinearProblem("nvfp4", "none", 16, 24576, 4096),
     LinearSm90Variant(4, 2, 1, 2, 1, _RG, 1, l2_prefetch=8, act=Act.FUSED, pdl=True)),
    (LinearProblem("mxfp4", "0.125", 3, 6144, 4096),
     LinearSm90Variant(2, 2, 1, 1, 1, _DI, 1, l2_prefetch=1, split_k=3,
                       reduce=Reduction.WORKSPACE, act=Act.FUSED)),
    (LinearProblem("nvfp4", "none", 1, 4096, 4096),
     LinearSm90Variant(1, 4, 1, 1, 1, _DI, 1, l2_prefetch=4, pdl=True)),
    # a cluster sharing the fused quantization (distributed shared memory)
    (LinearProblem("nvfp4", "full", 1, 24576, 4096),
     LinearSm90Variant(4, 2, 1, 1, 1, _RG, 1, act=Act.FUSED, cluster=4)),
    (LinearProblem("mxfp4", "0.125", 3, 6144, 4096),
     LinearSm90Variant(2, 2, 1, 1, 1, _CP, 3, split_k=3, reduce=Reduction.WORKSPACE,
                       act=Act.FUSED, pdl=True, cluster=2)),
    # the bulk ring (copy engine + per-slot mbarriers): xop, fused + PDL, MXFP4 scales,
    # two m16 tiles and two groups per iteration
    (LinearProblem("nvfp4", "none", 1, 24576, 4096), LinearSm90Variant(4, 2, 1, 1, 1, _BK, 2)),
    (LinearProblem("nvfp4", "full", 1, 4096, 12288),
     LinearSm90Variant(1, 8, 1, 1, 1, _BK, 4, act=Act.FUSED, pdl=True)),
    (LinearProblem("mxfp4", "full", 4, 6144, 4096),
     LinearSm90Variant(2, 2, 2, 1, 2, _BK, 3, act=Act.FUSED, cluster=2)),
    # ragged K slices (Qwen3-4B down: 38 groups over 8 warps; gate_up: 10 over 4)
    (LinearProblem("nvfp4", "none", 1, 2560, 9728),
     LinearSm90Variant(1, 8, 1, 1, 1, _CP, 3, act=Act.FUSED, pdl=True)),
    (LinearProblem("nvfp4", "full", 1, 2560, 9728),
     LinearSm90Variant(1, 8, 1, 1, 1, _BK, 2, act=Act.FUSED)),
    (LinearProblem("mxfp4", "none", 4, 19456, 2560),
     LinearSm90Variant(2, 4, 1, 1, 1, _DI, 1, l2_prefetch=2)),
]


def _compile(v, p, tmp_path):
    from resgen.kernels import codegen

    ck = FAMILY.compile_key(v, p)
    path, _ = codegen.render_to_file(FAMILY.TEMPLATE, FAMILY.template_params(v, ck),
                                     FAMILY.NAME, root=tmp_path)
    mod = codegen.load_module(path)
    return codegen.compile_entry(getattr(mod, FAMILY.ENTRY), FAMILY.compile_args(v, ck), ARCH)


@pytest.mark.parametrize("p, v", COMPILE_CASES, ids=lambda x: x.name() if hasattr(x, "name")
                         else f"{x.fmt}-{x.compensation}-{x.n}x{x.k}")
def test_compiles_for_sm90a_without_spills(p, v, tmp_path):
    assert FAMILY.why_invalid(v, p, ARCH) is None
    res = _compile(v, p, tmp_path)
    ptx = res.ptx
    assert ptx and ".target sm_90a" in ptx
    assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in ptx
    assert "mul.rn.bf16x2" in ptx and "mul.rn.ftz" not in ptx
    assert ("cp.async.bulk.prefetch.L2.global" in ptx) == (v.l2_prefetch > 0)
    if v.pipeline == Pipeline.CP_ASYNC:
        assert "cp.async.cg.shared.global" in ptx and "cp.async.wait_group" in ptx
    elif v.pipeline == Pipeline.BULK:
        # the copy engine fills the ring: no per-lane global weight loads or cp.async
        assert "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes" in ptx
        assert "mbarrier.try_wait.parity" in ptx and "fence.proxy.async.shared::cta" in ptx
        assert "ld.global.nc.L1::no_allocate" not in ptx and "cp.async.cg" not in ptx
    else:
        assert "ld.global.nc.L1::no_allocate.v4.u32" in ptx
    assert "ld.local" not in ptx and "st.local" not in ptx
    assert res.spill_bytes == 0, f"{res.spill_bytes} bytes of local memory"
    assert res.registers is not None and res.registers <= 255
    # the per-iteration MMA count: 4 chunks x 4 k16 steps x MT x NT per group
    per_group = 16 * v.m_tiles * v.n_tiles
    assert ptx.count("mma.sync") % per_group == 0
    if v.reduce == Reduction.WORKSPACE:
        assert "atom.global.acq_rel.gpu.add.u32" in ptx and "fence.acq_rel.gpu" in ptx
    if v.reduce == Reduction.ATOMIC:
        assert "red.global.add.f32" in ptx and ptx.count(".entry") == 2
    if v.fused and v.cluster == 1:
        assert "st.shared.v4.u32" in ptx and "bar.sync" in ptx
    if v.fused:
        assert "ld.global.nc.v4.u32" not in ptx or not v.pdl
    else:
        assert "st.shared.v4.u32" not in ptx
    # a cluster stores the operand tile into every peer (distributed shared memory) between
    # the start barrier and the release/acquire barrier
    assert ("st.shared::cluster.v4.u32" in ptx) == (v.cluster > 1)
    if v.cluster > 1:
        assert ptx.count("mapa.shared::cluster.u32") >= v.cluster
        i_start = ptx.index("barrier.cluster.arrive.relaxed")
        i_wait = ptx.index("barrier.cluster.wait.acquire")
        i_store = ptx.index("st.shared::cluster.v4.u32")
        i_rel = ptx.index("barrier.cluster.arrive.release")
        assert i_start < i_wait < i_store < i_rel
        assert "st.shared.v4.u32" not in ptx
    assert ("griddepcontrol.launch_dependents" in ptx) == v.pdl
    assert ("griddepcontrol.wait" in ptx) == v.pdl
    if v.pdl:
        # activations are read (coherently, never through the .nc path that ptxas may hoist)
        # only after the wait; only weight-side data may be requested before it
        head = ptx[:ptx.index("griddepcontrol.wait")]
        assert "ld.global.v4.u32" not in head and "ld.global.f32" not in head
        assert "ld.global.nc.v4.u32" not in ptx


def test_compile_through_the_build_helper(tmp_path, monkeypatch):
    """The tuner's path (render -> fingerprint -> compile) works for the default variant."""
    from resgen.search import build

    p = LinearProblem("nvfp4", "full", 8, 4096, 4096)
    out = build.compile_variant(FAMILY, FAMILY.default(p, ARCH), p, ARCH)
    assert out.ok, out.error
    assert out.spill_bytes == 0 and out.registers and len(out.fingerprint) == 64


# ----------------------------------------------------------------------------- runner plumbing


class _SimulatedKernel:
    """Stands in for a compiled variant on the CPU: maps the raw pointers the launcher passes
    (entry order: words, scales, xop, out, alpha_x, alpha_w, ws, sem, m, rows, stream) back to
    the tensors and runs the thread-level simulation on them."""

    def __init__(self, geom, registry):
        self.geom, self.registry = geom, registry
        self.calls = 0

    def __call__(self, wp, sp, xp, yp, axp, awp, wsp, semp, mp, m, rows, stream):
        t = {name: self.registry[p._pointer] for name, p in
             (("w", wp), ("s", sp), ("x", xp), ("y", yp), ("ax", axp), ("aw", awp),
              ("ws", wsp), ("sem", semp), ("mk", mp))}
        g = self.geom
        wt = L.Sm90Weight(g.fmt, g.packing, g.n, 0, g.kp, t["w"].view(g.n // 16, g.kq, 32, 4),
                          t["s"].view(g.n // 16, g.ng, g.sl, 8), t["aw"])
        xop = t["x"].view(-1, g.k if g.fused else g.kp)
        out = t["y"].view(-1, g.n)
        simulate_kernel(g, wt, xop, m, rows, t["ax"], out, ws=t["ws"], sem=t["sem"],
                        masks=t["mk"] if g.ksel else None)
        self.calls += 1


@pytest.mark.parametrize("fmt, comp, fields", [
    ("nvfp4", "full", dict(warps_m=2, warps_k=2, split_k=2, reduce=Reduction.WORKSPACE,
                           stages=2)),
    ("mxfp4", "1.0", dict(warps_m=4, warps_k=1, split_k=2, reduce=Reduction.ATOMIC,
                           pipeline=Pipeline.DIRECT, stages=1)),
])
def test_runner_check_and_calls_on_cpu_with_the_simulation(fmt, comp, fields, monkeypatch):
    """Runner + launcher plumbing (input sets, rotation, poisoned checks, workspace and
    semaphore reuse across calls) with the simulation standing in for the GPU kernel: the
    timed call is the bound layer (the quantizer's torch stand-in in front), gemm_only() the
    GEMM alone on the torch-quantized operand of a set."""
    registry = _record_launcher_pointers(monkeypatch)
    p = LinearProblem(fmt, comp, 3, 64, 1024)
    v = LinearSm90Variant(**fields)
    assert FAMILY.why_invalid(v, p, ARCH) is None
    fake = _SimulatedKernel(geometry_of(v, p), registry)
    r = FAMILY.runner(fake, v, p, "cpu", n_sets=2, seed=0)
    c = p.ratio if p.ratio is not None else comp
    q = _TorchQuantizer(r.sets[0][0], c, "static" if fmt == "nvfp4" else "none")
    r.attach_quantizer(q)
    for _ in range(2):
        res = r.check()                          # the GEMM alone, then the whole layer
        assert res.ok, res.detail
    r.rotate(1)
    y1 = r().clone()
    r.rotate(0)
    y0 = r().clone()
    assert not torch.equal(y0, y1)               # the sets differ
    assert q.calls == 4
    qw1, wt1, _, _, _ = r.sets[1]
    xq, aq = make_xop(r.xbs[1].float(), qw1, c, t_multiple=r.geom.tok)
    emu = L.emulate_linear_sm90_mma(xq, wt1, 3, xop_layout_for(c), aq)
    assert torch.equal(y1.view(torch.int16), emu.to(torch.bfloat16).view(torch.int16))
    g = r.gemm_only()
    g.rotate(1)
    yg = g().clone()
    xop1, ax1 = r.operand(1)                     # built by the call above
    assert r.sets[1][3] is xop1
    emu = L.emulate_linear_sm90_mma(xop1, wt1, 3, xop_layout_for(c), ax1).to(torch.bfloat16)
    assert torch.equal(yg.view(torch.int16), emu.view(torch.int16))
    assert fake.calls == 7
    assert FAMILY.working_set_bytes(v, p) >= wt1.nbytes()


def _record_launcher_pointers(monkeypatch) -> dict:
    """data_ptr -> tensor for every tensor the LinearSm90Launcher passes to a kernel, so that
    _SimulatedKernel can find the tensors behind the pointers it receives."""
    from resgen.kernels import linear_sm90_mma as H

    registry: dict = {}
    orig = H.LinearSm90Launcher._ptr

    def record(self, t, align):
        registry[t.data_ptr()] = t
        return orig(self, t, align)

    monkeypatch.setattr(H.LinearSm90Launcher, "_ptr", record)
    return registry


class _TorchQuantizer:
    """Duck-typed stand-in for a compiled quant_sm90 QuantKernel (make_xop in torch)."""

    class _Op:
        def __init__(self, xop, alpha):
            self.xop, self.alpha = xop, alpha

    def __init__(self, qweight, comp, alpha_mode):
        self.qw, self.comp = qweight, comp
        self.config = type("Cfg", (), {"alpha": alpha_mode})()
        self.calls = 0

    def outputs(self, m, row_multiple=1, device="cpu"):
        return {"row_multiple": row_multiple}

    def __call__(self, x, outs, alpha=None, masks=None):
        assert x.dtype == torch.bfloat16
        assert (alpha is not None) == (self.config.alpha == "static")
        assert (masks is not None) == (self.comp not in ("none", "full"))
        if masks is not None:
            assert torch.equal(masks.cpu(), self.qw.selection.masks)
        xop, ax = make_xop(x.float(), self.qw, self.comp, t_multiple=outs["row_multiple"])
        self.calls += 1
        return self._Op(xop, alpha if alpha is not None else ax)


@pytest.mark.parametrize("fmt, comp", [("nvfp4", "full"), ("mxfp4", "full"),
                                       ("nvfp4", "0.25")])
def test_runner_with_a_quantizer_in_front(fmt, comp, monkeypatch):
    registry = _record_launcher_pointers(monkeypatch)
    p = LinearProblem(fmt, comp, 2, 64, 1024)
    v = LinearSm90Variant(warps_m=4, warps_k=1, stages=3)
    if p.ratio is not None:
        v = dataclasses.replace(v, warps_m=2, warps_k=1, stages=2)
    assert FAMILY.why_invalid(v, p, ARCH) is None, FAMILY.why_invalid(v, p, ARCH)
    r = FAMILY.runner(_SimulatedKernel(geometry_of(v, p), registry), v, p, "cpu", n_sets=1)
    c = comp if p.ratio is None else p.ratio
    q = _TorchQuantizer(r.sets[0][0], c, "static" if fmt == "nvfp4" else "none")
    r.attach_quantizer(q)
    res = r.check_quantized()
    assert res.ok, res.detail
    r()
    assert q.calls == 2


@pytest.mark.parametrize("act", ["xop", "fused"])
def test_as_layer_puts_the_quantizer_in_front_of_xop_variants_only(act, monkeypatch):
    """as_layer() (what the tuner and `resgen bench` time): xop variants get the layer
    quantizer, the check covers the GEMM and then the whole layer; fused ones stay as they
    are (they quantize in their own prologue)."""
    import resgen.search.sm90_linear as SL

    registry = _record_launcher_pointers(monkeypatch)
    p = LinearProblem("nvfp4", "full", 2, 64, 1024)
    v = LinearSm90Variant(warps_m=4, warps_k=1, stages=3, act=Act(act))
    assert FAMILY.why_invalid(v, p, ARCH) is None, FAMILY.why_invalid(v, p, ARCH)
    r = FAMILY.runner(_SimulatedKernel(geometry_of(v, p), registry), v, p, "cpu", n_sets=3)
    made = []

    def fake_layer_quantizer(problem, arch="sm_90a", layout=None):
        assert problem == p and layout in (None, "row_pair")
        made.append(_TorchQuantizer(r.sets[0][0], "full", "static"))
        return made[-1]

    monkeypatch.setattr(SL, "layer_quantizer", fake_layer_quantizer)
    r.as_layer()
    if act == "fused":
        assert not made and r.quantizer is None
        assert r.check().ok
        return
    assert r.quantizer is made[0]
    res = r.check()
    assert res.ok, res.detail
    assert made[0].calls == 1                 # check() ran the whole-layer check too
    for i in range(3):
        r.rotate(i)
        r()
    assert made[0].calls == 4                 # and the timed call is quantizer + GEMM
    # behind the quantizer no set's torch-quantized operand was ever built (tuning cost)
    assert all(xop is None and ax is None for _, _, _, xop, ax in r.sets)
    xop, ax = r.operand(2)                    # built on demand, then kept
    assert r.sets[2][3] is xop and r.operand(2)[0] is xop
    assert r.bytes_per_set() == r.sets[0][1].nbytes() + r.sets[0][3].numel() * 2


def test_weight_sets_are_copies_in_their_own_memory():
    """Input sets exist for cold-L2 rotation: set 0 is a random layer, the others copies of
    its prepared weight in distinct memory; asking for more sets extends the cached list."""
    from resgen.search.linear_sm90_mma import _weight_sets

    p = LinearProblem("nvfp4", "0.25", 1, 64, 1024)
    a = _weight_sets(p, "split", "cpu", 2, seed=5)
    b = _weight_sets(p, "split", "cpu", 4, seed=5)
    assert len(a) == 2 and len(b) == 4 and b[0][1] is a[0][1]
    w0 = b[0][1]
    for qw, wt in b[1:]:
        assert qw is b[0][0]
        assert wt.words.data_ptr() != w0.words.data_ptr()
        assert wt.scales.data_ptr() != w0.scales.data_ptr()
        assert torch.equal(wt.words, w0.words) and torch.equal(wt.scales, w0.scales)
        assert wt.selection is w0.selection and wt.kw == w0.kw
    assert _weight_sets(p, "split", "cpu", 3, seed=5) == b[:3]


def test_prior_puts_the_h200_winning_patterns_first():
    """The ranked search tries, right after the default, what won whole-layer timings on the
    H200: fused 4 x 2 CTAs on a 2-slot bulk ring for a wide M = 1 layer (then the register
    pipeline), fused 1 x 8 cp.async for a long-K one, and the xop operand once the token
    count grows."""
    def first(p):
        return min(FAMILY.space(p, ARCH), key=lambda v: (FAMILY.prior(v, p), v.key()))

    for comp in ("none", "full"):
        p = LinearProblem("nvfp4", comp, 1, 24576, 4096)
        v = first(p)
        assert (v.warps_m, v.warps_k, v.pipeline, v.stages, v.act, v.pdl) == \
            (4, 2, Pipeline.BULK, 2, Act.FUSED, False)
        ranked = sorted(FAMILY.space(p, ARCH), key=lambda v: (FAMILY.prior(v, p), v.key()))
        assert any(r.pipeline == Pipeline.REGS and (r.warps_m, r.warps_k) == (4, 2)
                   for r in ranked[:4])
    v = first(LinearProblem("nvfp4", "full", 1, 4096, 12288))
    assert (v.warps_m, v.warps_k, v.pipeline, v.stages, v.act) == (1, 8, Pipeline.CP_ASYNC, 3,
                                                                   Act.FUSED)
    v = first(LinearProblem("nvfp4", "none", 16, 24576, 4096))
    assert v.act == Act.XOP and v.n_tiles == 2 and v.split_k == 1
    v = first(LinearProblem("nvfp4", "none", 1, 6144, 4096, static_scale=False))
    assert v.act == Act.XOP                  # fused needs a static NVFP4 scale


def test_compare_is_the_shared_check_at_the_linear_tolerance():
    """linear_sm90_mma.compare and attention_sm90.compare are resgen.search.family.compare: NaN /
    Inf (an unwritten poisoned element) fails whatever the tolerance, the error is relative,
    and the linear one defaults to the BF16-rounding tolerance."""
    from resgen.search import attention_sm90, family, linear_sm90_mma

    assert attention_sm90.compare is family.compare
    ref = torch.ones(4, 8)
    out = ref.clone()
    out[0, 0] = 1 + 2 ** -10                                          # exact in float32
    res = linear_sm90_mma.compare(out, ref)
    assert res.ok and res.tolerance == linear_sm90_mma.TOLERANCE
    assert res.rel_err == pytest.approx(2 ** -10 / 32 ** 0.5, rel=1e-12)
    assert not family.compare(out, ref, 1e-5).ok
    out[1, 1] = float("nan")
    bad = family.compare(out, ref, 1.0)
    assert not bad.ok and "1 of 32 outputs NaN/Inf" in bad.detail
    assert family.compare(torch.zeros(3), torch.zeros(3), 0.0).ok      # zero reference
