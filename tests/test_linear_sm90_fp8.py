"""linear_sm90_fp8 on the CPU: the E4M3 fold of MXFP4 proved exact (and refused where it
cannot be), the NVFP4 non-fold claim checked value by value, the kernel's arithmetic
(linear_sm90_fp8_sim) against resgen.reference.linear, the opt-in gate, the variant space and
predicate, the launcher's argument checks, and compile-only checks for sm_90a; for the FP4
weight load (wload = "fp4") the in-kernel converter's table (all 16 codes) and index math
(every byte of the swizzled B tile written once, where CuTe DSL's layout puts it)."""

from __future__ import annotations

import re

import pytest
import torch

from resgen import calibrate as C
from resgen import formats as F
from resgen import reference as R
from resgen.kernels import linear_sm90_fp8_convert as CV
from resgen.kernels import linear_sm90_fp8_operand as O
from resgen.kernels.linear_sm90_fp8 import Fp8ActivationStage, check_launch
from resgen.kernels.linear_sm90_fp8_geom import Fp8Geometry, fragment_coord
from resgen.kernels.linear_sm90_fp8_sim import simulate
from resgen.search import linear_sm90_fp8 as S
from resgen.search.family import compare
from resgen.search.variant import LinearProblem
from resgen.settings import settings

ARCH = "sm_90a"


@pytest.fixture
def opted_in(monkeypatch):
    monkeypatch.setenv("RESGEN_EXPERIMENTAL", "something_else,linear_sm90_fp8")
    settings.cache_clear()
    yield
    settings.cache_clear()


@pytest.fixture
def opted_out(monkeypatch):
    monkeypatch.delenv("RESGEN_EXPERIMENTAL", raising=False)
    settings.cache_clear()
    yield
    settings.cache_clear()


def _mx(rows: int, k: int, seed: int, spread: float = 1.0) -> F.QuantizedTensor:
    """Random MXFP4 rows with block amaxes spread over about 2^(+-3 spread) (and zeros)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g)
    x = x * torch.exp2(spread * 3 * torch.randn(rows, k // 32, 1, generator=g)).expand(
        rows, k // 32, 32).reshape(rows, k)
    x[0, :32] = 0.0                                   # an all-zero block
    return F.quantize(x, "mxfp4")


def _unfold(op: O.Fp8Operand) -> torch.Tensor:
    """float64 [R_pad, Kp]: code value x group scale, the value the operand stands for."""
    gk = 32 * op.group
    s = op.scales.t().double().repeat_interleave(gk, dim=1)
    return op.values().double() * s


# ----------------------------------------------------------------------------- numerics


def test_every_e2m1_value_times_2_to_d_is_e4m3_exactly_for_d_in_the_fold_range():
    v = F.e2m1_values()
    for d in range(O.FOLD_MIN, O.FOLD_MAX + 1):
        p = v * 2.0 ** d
        assert torch.equal(p.to(torch.float8_e4m3fn).float(), p), d
    for d in (O.FOLD_MIN - 1, O.FOLD_MAX + 1):     # and the range is tight
        p = v * 2.0 ** d
        assert not torch.equal(p.to(torch.float8_e4m3fn).float(), p), d


@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("k, kp", [(512, 512), (320, 512)])
def test_fold_operand_represents_the_mxfp4_values_exactly(group, k, kp):
    q = _mx(37, k, seed=group + k)
    op = O.fold_operand(q, group, kp)
    assert op.codes.shape == (48, kp) and op.scales.shape == (kp // (32 * group), 48)
    want = torch.zeros(48, kp, dtype=torch.float64)
    want[:37, :k] = F.dequantize(q).double()
    assert torch.equal(_unfold(op), want)
    assert torch.equal(op.codes[37:], torch.zeros_like(op.codes[37:]))


def test_fold_refuses_a_group_wider_than_14_binades_and_takes_14():
    codes = F.pack_fp4(torch.full((2, 128), 2, dtype=torch.uint8))      # all 1.0
    scales = torch.full((2, 4), 127, dtype=torch.uint8)
    scales[0, 1] = 127 + 14                                             # span 14: foldable
    scales[1, 3] = 127 - 15                                             # span 15
    q = F.QuantizedTensor("mxfp4", codes, scales, None)
    with pytest.raises(O.FoldRangeError, match=r"row 1, promotion group 0 .*15 binades"):
        O.fold_operand(q, 4, 256)
    ok = O.fold_operand(q[0:1], 4, 256)
    assert torch.equal(_unfold(ok)[0, :128], F.dequantize(q[0:1]).double()[0])
    O.fold_operand(q, 1, 256)                       # group 1 never folds: always exact


def test_fold_refuses_nvfp4_and_bad_arguments():
    qn = F.quantize(torch.randn(4, 64), "nvfp4")
    with pytest.raises(ValueError, match="MXFP4"):
        O.fold_operand(qn, 1, 256)
    q = _mx(4, 64, 0)
    with pytest.raises(ValueError, match="group=3"):
        O.fold_operand(q, 3, 256)
    with pytest.raises(ValueError, match="Kp=32"):
        O.fold_operand(q, 1, 32)


def test_nvfp4_scales_fold_exactly_only_with_a_3_bit_significand():
    """The docstring's claim (resgen.kernels.linear_sm90_fp8_operand): v * s is E4M3 for every
    E2M1 v iff s's significand is 1, 1.25 or 1.5 (mantissa f in {0, 2, 4}; normal scales well
    inside the range); for the other 5 significands v = 1.5, 3, 6 fail."""
    ok = O.nvfp4_fold_exact()                                 # [8 magnitudes, 127 scales]
    mid = range(0x18, 0x50)                                   # 2^-4 .. 2^2.9: no range limit
    for b in mid:
        f = b & 7
        if f in (0, 2, 4):
            assert bool(ok[:, b].all()), hex(b)
        else:
            assert not bool(ok[3, b]) and not bool(ok[5, b]) and not bool(ok[7, b]), hex(b)
            assert bool(ok[[0, 1, 2, 4, 6], b].all()), hex(b)


def test_fragment_coordinates_cover_the_tile_once():
    seen = set()
    for q in range(4):
        for lane in range(32):
            for i in range(128 // 8):
                for e in range(4):
                    seen.add(fragment_coord(q, lane, i, e))
    assert seen == {(r, c) for r in range(64) for c in range(128)}


def _probe_accumulators(consumers: int, bn: int) -> dict:
    """The (row, column) the CuTe DSL assigns to every accumulator element of every consumer
    thread of this family's tiled MMA (FP8 SS wgmma, atom layout (consumers, 1, 1))."""
    import cutlass
    import cutlass.cute as cute
    import cutlass.utils.hopper_helpers as sm90_utils
    from cutlass import Float8E4M3FN, Float32
    from cutlass.cute.nvgpu import OperandMajorMode

    out: dict = {}

    @cute.jit
    def probe():
        tm = sm90_utils.make_trivial_tiled_mma(
            Float8E4M3FN, Float8E4M3FN, OperandMajorMode.K, OperandMajorMode.K, Float32,
            (consumers, 1, 1), (64, bn))
        for tid in cutlass.range_constexpr(128 * consumers):
            thr = tm.get_slice(tid)
            c = thr.partition_C(cute.make_identity_tensor((64 * consumers, bn)))
            out[tid] = [tuple(int(x) for x in c[i]) for i in range(cute.size(c))]

    cute.compile(probe, options="--gpu-arch sm_90a")
    return out


@pytest.mark.parametrize("consumers, bn", [(1, 64), (2, 128)])
def test_accumulator_fragment_matches_the_cute_tiled_mma(consumers, bn):
    """Consumer thread tid (warpgroup tid // 128, warp q, lane) holds exactly the coordinates
    the promotion and the epilogue assume: fragment_coord(q, lane, i, e) with rows offset by
    64 per warpgroup, element 4 i + e (the PTX ISA's wgmma m64nN D fragment). The template
    slices by warpgroup (get_slice(wg * 128): thread 0's view) for the fragment shapes; the
    register-to-coordinate map of each thread is the hardware's, this one."""
    got = _probe_accumulators(consumers, bn)
    for tid in range(128 * consumers):
        wgi, q, lane = tid // 128, tid % 128 // 32, tid % 32
        want = [(64 * wgi + r, c) for r, c in
                (fragment_coord(q, lane, i, e) for i in range(bn // 8) for e in range(4))]
        assert got[tid] == want, tid


# ----------------------------------------------------------------------------- fp4 load


def test_prmt_reference_follows_the_ptx_definition():
    a, b = 0x03020100, 0x87868584
    assert CV.prmt_ref(a, b, 0x3210) == a and CV.prmt_ref(a, b, 0x7654) == b
    assert CV.prmt_ref(a, b, 0x0123) == 0x00010203
    # selector bit 3: the selected byte's bit 7 replicated (bytes 4..7 of b are >= 0x80)
    assert CV.prmt_ref(a, b, 0x8C0C) == 0x00FF00FF       # 0x84 -> FF, 0x00, FF, 0x00 -> 00


def test_the_converter_maps_every_e2m1_code_to_its_e4m3_byte_in_every_nibble():
    """All 16 codes, at each of the 8 nibble positions of a word, among random neighbours:
    the converted byte is the E4M3 encoding of the code's E2M1 value (-0 -> 0x80)."""
    want = O.e4m3_bytes(F.e2m1_values()).tolist()
    assert CV.lut16() == want
    assert want[8] == 0x80 and want[0] == 0x00
    g = torch.Generator().manual_seed(0)
    for code in range(16):
        for pos in range(8):
            for _ in range(4):
                nib = torch.randint(0, 16, (8,), generator=g).tolist()
                nib[pos] = code
                w = sum(c << (4 * j) for j, c in enumerate(nib))
                o0, o1 = CV.convert_word_ref(w)
                got = [(o0 >> (8 * j)) & 0xFF for j in range(4)] + \
                      [(o1 >> (8 * j)) & 0xFF for j in range(4)]
                assert got == [want[c] for c in nib], (code, pos, hex(w))


def test_the_scale_converter_maps_every_e8m0_byte_to_its_float32_power_of_two():
    """Bytes 0..254 (255 is E8M0's NaN, refused by the operand) at every byte position: the
    float32 bits are pow2_f32(b - 127)'s, 2^-127 (subnormal) for b = 0 included; and the
    converter's items cover a chunk's gpc x bn scales once (bn 16 .. 256)."""
    b = torch.arange(255, dtype=torch.int32)
    want = O.pow2_f32(b - 127).view(torch.int32).tolist()
    assert want[0] == CV.E8M0_ZERO_BITS
    for pos in range(4):
        for v in range(255):
            w = (v << (8 * pos)) | (0x7E << (8 * ((pos + 1) % 4)))
            got = CV.e8m0_word_ref(w)
            assert got[pos] == want[v], (pos, v)
            assert got[(pos + 1) % 4] == want[0x7E]
    for bn in (16, 64, 128, 192, 256):
        g = Fp8Geometry(bn=bn, wload="fp4")
        items = CV.scale_items_per_chunk(bn, g.gpc)
        hit = [ct + it * CV.CONV_THREADS for ct in range(CV.CONV_THREADS)
               for it in range(g.scale_iters) if ct + it * CV.CONV_THREADS < items]
        assert sorted(hit) == list(range(items)) and 4 * items == g.gpc * bn


def _probe_b_layout(bn: int, stages: int) -> dict:
    """CuTe DSL's offset (bytes) of every (channel, k, stage) of this family's B buffer
    (make_smem_layout_b: K-major E4M3, 128-byte swizzle), as the wgmma descriptor reads it."""
    import cutlass
    import cutlass.cute as cute
    import cutlass.utils.hopper_helpers as sm90_utils
    from cutlass import Float8E4M3FN
    from cutlass.tensor_utils import LayoutEnum

    out: dict = {}

    @cute.jit
    def probe():
        bl = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (128, bn, 128), Float8E4M3FN,
                                           stages)
        for s in cutlass.range_constexpr(stages):
            for n in cutlass.range_constexpr(bn):
                for k in cutlass.range_constexpr(128):
                    out[(n, k, s)] = int(bl((n, k, s)))

    cute.compile(probe, options="--gpu-arch sm_90a")
    return out


@pytest.mark.parametrize("bn, stages", [(64, 2), (48, 1), (192, 1)])
def test_the_converter_writes_every_byte_of_the_swizzled_b_tile_once(bn, stages):
    """The template's converter loop emulated over all 96 threads and every stage: each
    16-byte unit is converted by exactly one (thread, iteration), the bytes it stores land
    exactly where CuTe DSL's B layout puts (channel, k), every byte of the stages' tiles is
    written once, and the value there is the E4M3 code of the packed element (n, k)."""
    geom = Fp8Geometry(consumers=2, bn=bn, stages=max(stages, 2), group=1, wload="fp4")
    lay = _probe_b_layout(bn, stages)
    g = torch.Generator().manual_seed(bn)
    codes = torch.randint(0, 16, (stages, bn, 128), generator=g, dtype=torch.uint8)
    staging = F.pack_fp4(codes).reshape(stages, -1)              # [stages, bn * 64] bytes
    assert staging.shape[1] == bn * CV.PACKED_CHUNK
    tile = [None] * (stages * bn * 128)
    units = CV.units_per_chunk(bn)
    # the template's unguarded (batched) iterations have a unit for every thread
    assert (geom.conv_full - 1) * CV.CONV_THREADS + CV.CONV_THREADS - 1 < units
    assert geom.conv_iters - geom.conv_full in (0, 1)
    done = [0] * units
    for s in range(stages):
        done = [0] * units
        for ct in range(CV.CONV_THREADS):
            for it in range(geom.conv_iters):
                u = ct + it * CV.CONV_THREADS
                if u >= units:
                    continue
                done[u] += 1
                src = CV.staging_unit_offset(u)
                b = staging[s, src:src + 8].tolist()
                w0 = b[0] | b[1] << 8 | b[2] << 16 | b[3] << 24
                w1 = b[4] | b[5] << 8 | b[6] << 16 | b[7] << 24
                words = CV.convert_word_ref(w0) + CV.convert_word_ref(w1)
                dst = s * bn * 128 + CV.b_unit_offset(u)
                for j in range(16):
                    assert tile[dst + j] is None, (s, u, j)
                    tile[dst + j] = (words[j // 4] >> (8 * (j % 4))) & 0xFF
        assert done == [1] * units
    assert all(t is not None for t in tile)
    lut = CV.lut16()
    for (n, k, s), off in lay.items():
        assert tile[off] == lut[int(codes[s, n, k])], (n, k, s)


def test_fp4_operand_expands_to_the_group1_e4m3_operand():
    """The packed weight operand (what HBM holds) through the converter's bit math equals the
    offline E4M3 operand byte for byte, with the same scales; padding is zero."""
    q = _mx(37, 320, seed=4)
    op = O.fp4_operand(q, 512)
    assert op.packed.shape == (48, 256) and op.scales.shape == (16, 48) and op.kp == 512
    assert op.scales.dtype == torch.uint8
    assert torch.equal(op.scales[:10, :37], q.scales.t())           # the E8M0 bytes as they are
    assert not bool(op.scales[10:].any()) and not bool(op.scales[:, 37:].any())
    assert torch.equal(op.packed[:37, :160], q.codes)
    assert not bool(op.packed[37:].any()) and not bool(op.packed[:, 160:].any())
    ref = O.fold_operand(q, 1, 512)
    ex = O.expand_fp4(op)
    assert torch.equal(ex.codes, ref.codes) and torch.equal(ex.scales, ref.scales)
    with pytest.raises(ValueError, match="MXFP4"):
        O.fp4_operand(F.quantize(torch.randn(4, 64), "nvfp4"), 256)
    with pytest.raises(ValueError, match="Kp=48"):
        O.fp4_operand(q, 48)


def test_fp4_load_is_group_1_only():
    with pytest.raises(ValueError, match="group 1 only"):
        Fp8Geometry(group=2, wload="fp4").check()
    with pytest.raises(ValueError, match="wload"):
        Fp8Geometry(wload="e2m1").check()
    g = Fp8Geometry(bn=128, stages=4, wload="fp4")
    g.check()
    assert g.b_stage_bytes == 128 * 64
    assert g.scale_stage_bytes == 4 * 4 * 128 + 4 * 128           # E8M0 weight scales
    assert g.smem_bytes == Fp8Geometry(bn=128, stages=4).smem_bytes + 4 * (128 * 64 + 4 * 128)


# ----------------------------------------------------------------------------- emulation


def _layer(n: int, k: int, seed: int) -> C.QLinearWeight:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.exp(torch.randn(n, 1, generator=g))
    return C.prepare_weight(w, "mxfp4")


@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("m, n, k", [(1, 64, 256), (37, 128, 512), (130, 192, 320)])
def test_emulated_kernel_matches_the_reference(group, m, n, k):
    qw = _layer(n, k, seed=m + group)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k + group)) * 3
    kp = O.kp_fp8(k)
    w = O.fold_operand(qw.q, group, kp)
    xo = Fp8ActivationStage(k, kp, group)(x)
    y = simulate(xo, w, m)
    ref = R.linear(x, qw, "none")
    res = compare(y, ref, 1e-6)                     # FP32 summation order only
    assert res.ok, res.detail
    assert compare(y.to(torch.bfloat16), ref, 3e-3).ok
    if group == 1:                                  # the FP4-load kernel's values: the same
        assert torch.equal(simulate(xo, O.fp4_operand(qw.q, kp), m), y)


def test_group1_partials_are_exact_in_a_14_bit_accumulator():
    """With group 1 every tensor-core partial has <= 13 significant bits: a 14-bit accumulator
    model gives the same result bit for bit; a folded group 4 can need more."""
    qw = _layer(128, 1024, 3)
    x = torch.randn(64, 1024, generator=torch.Generator().manual_seed(5)) * 3
    w1 = O.fold_operand(qw.q, 1, 1024)
    x1 = Fp8ActivationStage(1024, 1024, 1)(x)
    assert torch.equal(simulate(x1, w1, 64, acc_bits=14), simulate(x1, w1, 64))
    assert torch.equal(simulate(x1, w1, 64, acc_bits=13), simulate(x1, w1, 64))
    w4 = O.fold_operand(qw.q, 4, 1024)
    x4 = Fp8ActivationStage(1024, 1024, 4)(x)
    assert compare(simulate(x4, w4, 64), simulate(x1, w1, 64), 1e-6).ok
    # a group whose blocks' scales differ: the folded partial 18432 + 3 + 2 * 1536 needs 15
    # bits, which a 14-bit accumulator rounds; the same data unfolded (group 1) does not
    wq = F.QuantizedTensor("mxfp4", F.pack_fp4(torch.full((16, 128), 3, dtype=torch.uint8)),
                           torch.full((16, 4), 127, dtype=torch.uint8), None)
    xc = torch.tensor([7] * 32 + [1] * 96, dtype=torch.uint8).repeat(16, 1)
    xs = torch.tensor([127, 118, 127, 127], dtype=torch.uint8).repeat(16, 1)
    xq = F.QuantizedTensor("mxfp4", F.pack_fp4(xc), xs, None)
    a4, b4 = O.fold_operand(xq, 4, 256), O.fold_operand(wq, 4, 256)
    a1, b1 = O.fold_operand(xq, 1, 256), O.fold_operand(wq, 1, 256)
    exact = simulate(a4, b4)
    assert float(exact[0, 0]) == 1.5 * 32 * (6 + 0.5 / 512 + 0.5 + 0.5)
    assert not torch.equal(simulate(a4, b4, acc_bits=14), exact)
    assert torch.equal(simulate(a1, b1, acc_bits=14), simulate(a1, b1))
    assert torch.equal(simulate(a1, b1), exact)


# ----------------------------------------------------------------------------- family


P8B = LinearProblem("mxfp4", "none", 256, 4096, 4096)


def test_out_of_every_default_path_unless_opted_in(opted_out):
    fam = S.FAMILY
    assert "experimental" in fam.problem_invalid(P8B)
    d = fam.default(P8B, ARCH)
    assert "RESGEN_EXPERIMENTAL" in fam.why_invalid(d, P8B, ARCH)
    assert fam.space(P8B, ARCH) == []
    from resgen.models import get_model

    assert fam.model_problems([get_model("qwen3-8b")], tp=1, formats=["mxfp4"],
                              compensations=["none"], m_buckets=[256]) == []


def test_predicate_and_space_when_opted_in(opted_in):
    fam = S.FAMILY
    assert fam.problem_invalid(P8B) is None
    assert "NVFP4" in fam.problem_invalid(LinearProblem("nvfp4", "none", 256, 4096, 4096))
    assert "plain" in fam.problem_invalid(LinearProblem("mxfp4", "full", 256, 4096, 4096))
    space = fam.space(P8B, ARCH)
    assert space and all(fam.why_invalid(v, P8B, ARCH) is None for v in space)
    assert {v.group for v in space} == {1, 2, 4} and {v.parts for v in space} == {1, 2}
    assert {v.group for v in space if v.wload == S.WLoad.FP4} == {1}
    assert "group 1 only" in fam.why_invalid(
        S.LinearSm90Fp8Variant(group=2, wload=S.WLoad.FP4), P8B, ARCH)
    assert len({v.key() for v in space}) == len(space)
    for n in (4096, 6144, 24576, 1024 + 64):
        p = LinearProblem("mxfp4", "none", 512, n, 4096)
        assert fam.why_invalid(fam.default(p, ARCH), p, ARCH) is None, n
    spill = S.LinearSm90Fp8Variant(2, 256, 4, 1, 1)
    assert "spill" in fam.why_invalid(spill, P8B, ARCH)
    assert "bn=192" in fam.why_invalid(S.LinearSm90Fp8Variant(1, 192), P8B, ARCH)
    probs = fam.model_problems([__import__("resgen.models", fromlist=["x"]).get_model(
        "qwen3-8b")], tp=1, formats=["mxfp4", "nvfp4"], compensations=["none", "full"],
        m_buckets=[16, 256])
    assert probs and all(p.fmt == "mxfp4" and p.compensation == "none" and p.m == 256
                         for p in probs)


def test_every_variant_field_changes_the_key():
    base = S.LinearSm90Fp8Variant()
    others = [S.LinearSm90Fp8Variant(consumers=1), S.LinearSm90Fp8Variant(bn=64),
              S.LinearSm90Fp8Variant(stages=6), S.LinearSm90Fp8Variant(group=4),
              S.LinearSm90Fp8Variant(parts=1), S.LinearSm90Fp8Variant(raster=S.Raster.CH),
              S.LinearSm90Fp8Variant(wload=S.WLoad.FP4)]
    keys = {base.key()} | {v.key() for v in others}
    assert len(keys) == 1 + len(others)


def test_launch_checks_name_the_problem():
    geom = Fp8Geometry(consumers=2, bn=64, group=1)
    qw = _layer(64, 256, 0)
    w = O.fold_operand(qw.q, 1, 256)
    x = Fp8ActivationStage(256, 256, 1)(torch.randn(5, 256))
    out = torch.empty(5, 64, dtype=torch.bfloat16)
    check_launch(geom, w, x, 5, out)
    with pytest.raises(ValueError, match="group"):
        check_launch(Fp8Geometry(bn=64, group=2), w, x, 5, out)
    with pytest.raises(ValueError, match="m=6"):
        check_launch(geom, w, x, 6, out)
    with pytest.raises(TypeError, match="bf16"):
        check_launch(geom, w, x, 5, out.float())
    with pytest.raises(ValueError, match="bn=128"):
        check_launch(Fp8Geometry(bn=128), w, x, 5, out)
    w4 = O.fp4_operand(qw.q, 256)
    g4 = Fp8Geometry(consumers=2, bn=64, group=1, wload="fp4")
    check_launch(g4, w4, x, 5, out)
    with pytest.raises(TypeError, match="loads its weight as fp4"):
        check_launch(g4, w, x, 5, out)
    with pytest.raises(TypeError, match="loads its weight as e4m3"):
        check_launch(geom, w4, x, 5, out)


# ----------------------------------------------------------------------------- compile


COMPILE_CASES = [(P8B, S.LinearSm90Fp8Variant(2, 128, 4, 1, 2)),
                 (LinearProblem("mxfp4", "none", 2048, 6144, 4096),
                  S.LinearSm90Fp8Variant(1, 192, 3, 4, 1, S.Raster.CH)),
                 (P8B, S.LinearSm90Fp8Variant(2, 128, 4, 1, 2, wload=S.WLoad.FP4)),
                 (LinearProblem("mxfp4", "none", 64, 4096, 4096),
                  S.LinearSm90Fp8Variant(1, 64, 6, 1, 1, wload=S.WLoad.FP4))]


@pytest.mark.parametrize("p, v", COMPILE_CASES, ids=lambda x: x.name() if hasattr(x, "name")
                         else str(x.n))
def test_compiles_for_sm90a(p, v, tmp_path, opted_in):
    from resgen.kernels import codegen

    fam = S.FAMILY
    assert fam.why_invalid(v, p, ARCH) is None
    ck = fam.compile_key(v, p)
    path, _ = codegen.render_to_file(fam.TEMPLATE, fam.template_params(v, ck), fam.NAME,
                                     root=tmp_path)
    res = fam.compile_module(path, v, ck, ARCH)
    ptx = res.ptx
    assert ptx and ".target sm_90a" in ptx
    shape = f"wgmma.mma_async.sync.aligned.m64n{v.bn}k32.f32.e4m3.e4m3"
    # the main loop body: two chunks x 4 k32 steps, whatever the promotion group
    assert ptx.count(shape) == 8
    assert ptx.count("wgmma.mma_async") == 8
    assert ptx.count("cp.async.bulk.tensor") == 4            # codes x 2, scales x 2
    assert ("setmaxnreg.inc" in ptx) == (v.consumers == 2)
    assert "wgmma.fence.sync.aligned" in ptx and "wgmma.wait_group.sync.aligned" in ptx
    assert re.search(r"wgmma\.wait_group\.sync\.aligned\s+" + str(v.parts - 1), ptx)
    assert res.spill_bytes == 0
    g = S.geometry_of(v)
    if v.wload == S.WLoad.FP4:
        # the converter: 4 prmt per word, 2 words per v2 load, one v4 store per unit, the
        # proxy fence before the converted-barrier arrival
        assert ptx.count("prmt.b32") == 8 * g.conv_iters
        assert ptx.count("st.shared.v4") == g.conv_iters + g.scale_iters
        assert ptx.count("bfe.u32") == 4 * g.scale_iters           # E8M0 -> float32
        assert ptx.count("fence.proxy.async.shared::cta") == 1
    else:
        assert "prmt.b32" not in ptx and "fence.proxy.async" not in ptx


# ----------------------------------------------------------------------------- plumbing


class _SimLauncher:
    """The emulation standing in for a compiled kernel behind the real launch checks."""

    def __init__(self, geom, rows_written=None):
        self.geom, self.rows_written = geom, rows_written

    def __call__(self, w, x, m, out):
        check_launch(self.geom, w, x, m, out)
        k = m if self.rows_written is None else self.rows_written
        out[:k] = simulate(x, w, m)[:k].to(torch.bfloat16)
        return out


@pytest.mark.parametrize("rows_written, ok, wload", [(None, True, S.WLoad.E4M3),
                                                     (3, False, S.WLoad.E4M3),
                                                     (None, True, S.WLoad.FP4)])
def test_runner_and_binding_with_the_emulation_standing_in(monkeypatch, opted_in,
                                                           rows_written, ok, wload):
    fam = S.FAMILY
    v = S.LinearSm90Fp8Variant(2, 64, 3, 1 if wload == S.WLoad.FP4 else 2, 2, wload=wload)
    p = LinearProblem("mxfp4", "none", 9, 128, 256)
    monkeypatch.setattr(type(fam), "launcher",
                        lambda self, c, var, prob, dev: _SimLauncher(S.geometry_of(var),
                                                                     rows_written))
    r = fam.runner(None, v, p, "cpu", n_sets=2, seed=1)
    res = r.check()
    assert res.ok == ok, res.detail
    if not ok:
        assert "NaN" in res.detail                      # rows left unwritten are caught
    r.rotate(1)
    y = r()
    assert y.shape == (9, 128)
    with pytest.raises(ValueError, match="no masks"):
        fam.bind(None, v, p, r.sets[0][0], "cpu", masks=torch.zeros(4))


def test_the_h200_bench_plans_valid_variants_for_every_qwen3_shape(opted_in):
    """bench/linear_sm90_fp8_h200.py's CPU half: its variant list parses, every variant is
    valid for some Qwen3-8B projection at the benchmarked M, every shape has a valid
    variant, and the targets' M come first."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "bench/linear_sm90_fp8_h200.py"
    spec = importlib.util.spec_from_file_location("linear_sm90_fp8_h200", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    vs = [mod.parse_variant(",".join(map(str, v))) for v in mod.VARIANTS]
    assert len({v.key() for v in vs}) == len(vs)
    for m in (64, 128, 256, 2048):
        probs = [LinearProblem("mxfp4", "none", m, n, k) for n, k in mod.SHAPES.values()]
        for v in vs:
            assert any(S.FAMILY.why_invalid(v, p, ARCH) is None for p in probs), v.name()
        for p in probs:
            assert any(S.FAMILY.why_invalid(v, p, ARCH) is None for v in vs), p.key()
    assert mod.order_m([64, 128, 256, 2048]) == [2048, 128, 64, 256]
    with pytest.raises(Exception, match="c,bn"):
        mod.parse_variant("2,128")


def test_an_unknown_experimental_name_warns_once(monkeypatch):
    """RESGEN_EXPERIMENTAL with a name that is no experimental family (a typo) opts nothing
    in: families() says so once per set of unknown names, naming the known ones; a correct
    name does not warn."""
    import warnings

    from resgen.search import family as F

    monkeypatch.setattr(F, "_WARNED_EXPERIMENTAL", set())
    monkeypatch.setenv("RESGEN_EXPERIMENTAL", "linear_sm90_fp9")
    settings.cache_clear()
    try:
        assert F.unknown_experimental() == ["linear_sm90_fp9"]
        with pytest.warns(UserWarning, match=r"linear_sm90_fp9.*linear_sm90_fp8"):
            F.families()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            F.families()                                    # once
            monkeypatch.setenv("RESGEN_EXPERIMENTAL", "linear_sm90_fp8")
            settings.cache_clear()
            assert F.unknown_experimental() == []
            F.families()
    finally:
        settings.cache_clear()


# ----------------------------------------------------------------------------- W4A8


@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("m, n, k", [(1, 64, 256), (37, 128, 512), (130, 192, 320)])
def test_w4a8_operand_through_the_emulation_is_the_w4a8_reference(group, m, n, k):
    """W4A8 = the same kernel with E4M3 activations and per-token scales: the emulation
    (exact partials) equals resgen.reference.linear_w4a8 to FP32 rounding, and a 14-bit
    accumulator model of Hopper's FP8 sums stays within the check's BF16 tolerance."""
    qw = _layer(n, k, seed=3 * m + group)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k + 7 * group)) * 3
    x[0, :5] = 0.0
    kp = O.kp_fp8(k)
    w = O.fold_operand(qw.q, group, kp)
    xo = Fp8ActivationStage(k, kp, group, "w4a8")(x)
    assert xo.scales.shape == (kp // (32 * group), xo.rows_pad)
    assert torch.all(xo.scales[:, :m] == xo.scales[:1, :m])        # one scale per token
    ref = R.linear_w4a8(x, qw)
    y = simulate(xo, w, m)
    res = compare(y, ref, 1e-5)
    assert res.ok, res.detail
    assert compare(simulate(xo, w, m, acc_bits=14), ref, S.TOLERANCE).ok
    # it is not W4A4: the plain reference is far off on the same inputs
    assert not compare(y, R.linear(x, qw, "none"), S.TOLERANCE).ok


def test_w4a8_problem_is_the_fp8_familys_only(opted_in):
    from resgen.models import get_model, tuning_workloads
    from resgen.search.family import get_family

    p = LinearProblem("mxfp4", "w4a8", 256, 4096, 4096)
    assert p.ratio is None and p.rows == 256 and not p.w4a16
    assert S.FAMILY.problem_invalid(p) is None
    assert S.FAMILY.space(p, ARCH)
    for name in ("linear_sm90_mma", "linear_sm90_wgmma", "linear_sm100_tc"):
        why = get_family(name).problem_invalid(p)
        assert why is not None and "linear_sm90_fp8 only" in why
    q8 = [get_model("qwen3-8b")]
    kw = dict(tp=1, formats=["mxfp4"], compensations=["none", "w4a8"], m_buckets=[1, 256])
    assert not [w for w in tuning_workloads(get_family("linear_sm90_wgmma"), q8, **kw)
                if w.compensation == "w4a8"]
    fp8 = tuning_workloads(S.FAMILY, q8, **kw)
    assert {w.compensation for w in fp8} == {"none", "w4a8"} and all(w.m >= 64 for w in fp8)
    with pytest.raises(ValueError, match="w4a8"):
        Fp8ActivationStage(256, 256, 1, "full")


def test_w4a8_runner_checks_against_the_w4a8_reference(monkeypatch, opted_in):
    fam = S.FAMILY
    v = S.LinearSm90Fp8Variant(2, 64, 3, 2, 2)
    p = LinearProblem("mxfp4", "w4a8", 9, 128, 256)
    monkeypatch.setattr(type(fam), "launcher",
                        lambda self, c, var, prob, dev: _SimLauncher(S.geometry_of(var)))
    r = fam.runner(None, v, p, "cpu", n_sets=1, seed=2)
    res = r.check()
    assert res.ok, res.detail
    # a kernel fed the W4A4 operand instead fails the W4A8 check
    monkeypatch.setattr(r.binding.stage, "compensation", "none")
    assert not r.check().ok
