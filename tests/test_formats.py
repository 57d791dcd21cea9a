"""NVFP4 / MXFP4 numerics against independent oracles (exhaustive grids, hand-computed cases)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import example, given, settings, strategies as st

from resgen import formats as F

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


# ----------------------------------------------------------------------------- oracles


def oracle_e2m1(v: float) -> int:
    """Nearest E2M1 magnitude by brute force; ties to the even code (mantissa bit 0)."""
    a = min(abs(v), 6.0)
    best = min(range(8), key=lambda c: (abs(E2M1[c] - a), c & 1))
    return best | (8 if math.copysign(1.0, v) < 0 else 0)


def e4m3_grid() -> list[float]:
    """Every non-negative finite E4M3 value, built from the bit fields (not from torch)."""
    vals = []
    for e in range(16):
        for m in range(8):
            if e == 15 and m == 7:      # NaN in float8_e4m3fn
                continue
            vals.append(m / 8 * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return sorted(vals)


def oracle_e4m3(v: float) -> float:
    grid = e4m3_grid()
    if v >= 448:
        return 448.0
    bits = {g: i for i, g in enumerate(grid)}   # index parity == mantissa parity
    return min(grid, key=lambda g: (abs(g - v), bits[g] & 1))


# ----------------------------------------------------------------------------- element codecs


def test_e2m1_grid_roundtrip_and_values():
    codes = torch.arange(16, dtype=torch.uint8)
    vals = F.e2m1_decode(codes)
    assert vals[:8].tolist() == E2M1
    assert vals[8:].tolist() == [-v for v in E2M1]
    assert F.e2m1_encode(vals).tolist() == [c if c != 8 else 8 for c in range(16)]


def test_e2m1_ties_round_to_even_and_saturate():
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    expect = [0, 2, 2, 4, 4, 6, 6]   # 0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0
    got = F.e2m1_encode(torch.tensor(ties)).tolist()
    assert got == expect
    assert F.e2m1_encode(torch.tensor([-0.25, 6.5, -100.0, 1e30])).tolist() == [8, 7, 15, 7]


def test_e2m1_encode_matches_bruteforce_oracle():
    g = torch.Generator().manual_seed(1)
    vals = torch.cat([
        torch.randn(3000, generator=g) * 3,
        torch.tensor([m for a, b in zip(E2M1, E2M1[1:]) for m in ((a + b) / 2,)]),
        torch.nextafter(torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]),
                        torch.tensor(10.0)),
        torch.nextafter(torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]),
                        torch.tensor(-10.0)),
        torch.tensor([0.0, -0.0, 6.0, -6.0, 7.0]),
    ])
    got = F.e2m1_encode(vals).tolist()
    assert got == [oracle_e2m1(float(v)) for v in vals]


def test_e4m3_round_matches_exhaustive_grid():
    grid = e4m3_grid()
    assert len(grid) == 127 and grid[-1] == 448.0 and grid[1] == 2.0 ** -9
    mids = [(a + b) / 2 for a, b in zip(grid, grid[1:])]
    g = torch.Generator().manual_seed(2)
    rnd = (torch.rand(2000, generator=g) * 460).tolist() + \
          (torch.rand(500, generator=g) * 0.02).tolist()
    probe = grid + mids + rnd + [449.0, 464.0, 1e6]
    got = F.e4m3_round(torch.tensor(probe, dtype=torch.float32)).float().tolist()
    expect = [oracle_e4m3(float(torch.tensor(v, dtype=torch.float32))) for v in probe]
    assert got == expect


def test_pack_order_even_element_low_nibble():
    codes = torch.tensor([[1, 2, 3, 15]], dtype=torch.uint8)
    packed = F.pack_fp4(codes)
    assert packed.tolist() == [[0x21, 0xF3]]
    assert torch.equal(F.unpack_fp4(packed), codes)


# ----------------------------------------------------------------------------- NVFP4


def test_nvfp4_hand_computed_block():
    # amax 6 with alpha = 1/448: s = 1, s/alpha = 448 (exact E4M3), d = alpha * 448 = 1.
    x = torch.tensor([E2M1 + [-v for v in E2M1]], dtype=torch.float32)
    q = F.quantize(x, "nvfp4", global_scale=1 / 448)
    assert q.scales.float().tolist() == [[448.0]]
    assert F.unpack_fp4(q.codes).tolist() == [list(range(8)) + [8, 9, 10, 11, 12, 13, 14, 15]]
    assert torch.equal(F.dequantize(q), x)


def test_nvfp4_scale_rounding_and_dynamic_alpha():
    # Block amax 5 -> s = 5/6; alpha = amax(x)/2688 with amax(x) = 10 (second block).
    x = torch.zeros(1, 32)
    x[0, 0] = 5.0
    x[0, 16] = 10.0
    q = F.quantize(x, "nvfp4")
    alpha = torch.tensor(10.0) / 2688
    assert torch.equal(q.global_scale, alpha)
    s0 = torch.tensor(5.0) / 6 / alpha          # 224.0000.. -> E4M3 224
    assert q.scales.float()[0, 0] == oracle_e4m3(float(s0))
    assert q.scales.float()[0, 1] == 448.0
    d0 = alpha * q.scales.float()[0, 0]
    assert F.unpack_fp4(q.codes)[0, 0] == oracle_e2m1(float(torch.tensor(5.0) / d0))


def test_nvfp4_code_ties_inside_a_block():
    # alpha = 1/448 and a 6.0 in the block make d = 1 exactly, so x / d are the tie points.
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    x = torch.tensor([[6.0] + ties + [-t for t in ties] + [0.0]])
    q = F.quantize(x, "nvfp4", global_scale=1 / 448)
    codes = F.unpack_fp4(q.codes)[0].tolist()
    assert codes[1:8] == [0, 2, 2, 4, 4, 6, 6]
    assert codes[8:15] == [8, 10, 10, 12, 12, 14, 14]


def test_nvfp4_static_scale_saturates_scale_and_codes():
    x = torch.full((1, 16), 1000.0)
    q = F.quantize(x, "nvfp4", global_scale=0.01)   # s/alpha = 16666 -> 448; x/d = 223 -> 6
    assert q.scales.float().tolist() == [[448.0]]
    assert F.dequantize(q).unique().tolist() == [pytest.approx(6 * 4.48)]


@pytest.mark.parametrize("fmt", F.FORMATS)
def test_zero_tiny_and_huge_blocks(fmt):
    bs = F.block_size(fmt)
    x = torch.zeros(3, bs * 2)
    x[1, :bs] = 1e-40       # float32 subnormals
    x[2, :bs] = 3e38
    x[2, bs:] = -1e-38
    for q in F.quantize_with_residue(x, fmt):
        d = F.dequantize(q)
        assert torch.isfinite(d).all()
        assert torch.equal(d[0], torch.zeros(bs * 2))
    d = F.dequantize(F.quantize(x, fmt))
    assert (d[2, :bs] > 1e38).all()


def test_all_zero_tensor_nvfp4_has_unit_alpha():
    q = F.quantize(torch.zeros(2, 16), "nvfp4")
    assert float(q.global_scale) == 1.0
    assert torch.equal(F.dequantize(q), torch.zeros(2, 16))


def test_nvfp4_scale_underflow_gives_exact_zero_block():
    x = torch.zeros(1, 32)
    x[0, 0] = 1.0
    x[0, 16:] = 1e-6         # s/alpha = 1e-6/6/(1/2688) = 4.5e-4 < 2^-10: E4M3 rounds to 0
    q = F.quantize(x, "nvfp4")
    assert q.scales.float()[0, 1] == 0
    assert torch.equal(F.dequantize(q)[0, 16:], torch.zeros(16))


# ----------------------------------------------------------------------------- MXFP4


def test_mxfp4_shared_exponent_and_codes():
    x = torch.zeros(1, 32)
    x[0, 0] = 5.0           # floor(log2 5) = 2 -> e = 0 -> stored 127
    x[0, 1] = 2.6           # 2.6 -> 3 (between 2 and 3, closer to 3)
    x[0, 2] = 7.9           # saturates to 6
    q = F.quantize(x, "mxfp4")
    assert q.scales.tolist() == [[127]]
    assert F.unpack_fp4(q.codes)[0, :3].tolist() == [6, 5, 7]
    x2 = torch.full((1, 32), 0.1)   # floor(log2 0.1) = -4 -> e = -6
    q2 = F.quantize(x2, "mxfp4")
    assert q2.scales.tolist() == [[121]]
    assert F.dequantize(q2)[0, 0] == 6 * 2.0 ** -6   # 0.1 * 64 = 6.4 -> 6


def test_mxfp4_exponent_clamps():
    x = torch.zeros(2, 32)
    x[1, 0] = 1e-45          # floor(log2) = -149 -> clamp -127
    q = F.quantize(x, "mxfp4")
    assert q.scales.tolist() == [[0], [0]]


def test_mxfp4_idempotent_and_power_of_two_invariant():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, 128, generator=g) * 4
    q = F.quantize(x, "mxfp4")
    q2 = F.quantize(F.dequantize(q), "mxfp4")
    assert torch.equal(q.codes, q2.codes) and torch.equal(q.scales, q2.scales)
    for k in (-5, 3):
        qk = F.quantize(x * 2.0 ** k, "mxfp4")
        assert torch.equal(qk.codes, q.codes)
        assert torch.equal(qk.scales.int(), q.scales.int() + k)


def test_nvfp4_global_scale_invariance():
    # Scaling x by 2^k scales dynamic alpha by 2^k and leaves codes and block scales unchanged.
    g = torch.Generator().manual_seed(4)
    x = torch.randn(4, 64, generator=g)
    q = F.quantize(x, "nvfp4")
    q8 = F.quantize(x * 8, "nvfp4")
    assert torch.equal(q.codes, q8.codes) and torch.equal(q.scales, q8.scales)
    assert torch.equal(q8.global_scale, q.global_scale * 8)


# ----------------------------------------------------------------------------- residue


@pytest.mark.parametrize("fmt", F.FORMATS)
def test_residue_shrinks_nmse_by_10x(fmt):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(256, 512, generator=g)
    base, res = F.quantize_with_residue(x, fmt)
    e_base = ((x - F.dequantize(base)) ** 2).sum() / (x ** 2).sum()
    e_full = ((x - F.dequantize(base) - F.dequantize(res)) ** 2).sum() / (x ** 2).sum()
    assert e_full * 10 < e_base
    if fmt == "nvfp4":
        assert torch.equal(res.global_scale, base.global_scale)
    else:
        assert res.global_scale is None


def test_residue_is_quantized_difference_exactly():
    g = torch.Generator().manual_seed(6)
    x = torch.randn(4, 64, generator=g)
    base, res = F.quantize_with_residue(x, "nvfp4")
    r = x - F.dequantize(base)
    q = F.quantize(r, "nvfp4", global_scale=base.global_scale)
    assert torch.equal(q.codes, res.codes) and torch.equal(q.scales, res.scales)
    assert torch.equal(F.quantize(x, "nvfp4").codes, base.codes)


@pytest.mark.parametrize("fmt", F.FORMATS)
def test_residue_selected_channels_padded_extension(fmt):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(3, 64, generator=g)
    idx = torch.tensor([1, 9, 17, 25, 33, 41, 49, 57])      # 8 channels: needs padding
    base, res = F.quantize_with_residue(x, fmt, channels=idx)
    bs = F.block_size(fmt)
    assert res.shape == (3, bs)
    full = F.dequantize(res)
    assert torch.equal(full[:, 8:], torch.zeros(3, bs - 8))
    r = (x - F.dequantize(base))[:, idx]
    expect = F.dequantize(F.quantize(torch.nn.functional.pad(r, (0, bs - 8)), fmt,
                                     global_scale=base.global_scale))
    assert torch.equal(full, expect)


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize("fmt", F.FORMATS)
def test_error_paths(fmt):
    bs = F.block_size(fmt)
    with pytest.raises(ValueError, match="multiple of"):
        F.quantize(torch.zeros(2, bs + 2), fmt)
    with pytest.raises(ValueError, match="NaN or Inf"):
        F.quantize(torch.tensor([[float("nan")] * bs]), fmt)
    with pytest.raises(ValueError, match="NaN or Inf"):
        F.quantize_with_residue(torch.tensor([[float("inf")] * bs]), fmt)
    with pytest.raises(TypeError, match="dtype"):
        F.quantize(torch.zeros(2, bs, dtype=torch.int32), fmt)
    with pytest.raises(TypeError):
        F.quantize([[0.0] * bs], fmt)
    with pytest.raises(ValueError, match="0-dim"):
        F.quantize(torch.tensor(1.0), fmt)
    with pytest.raises(ValueError, match="channel indices"):
        F.quantize_with_residue(torch.zeros(1, bs), fmt, channels=torch.tensor([bs]))


def test_error_paths_format_and_global_scale():
    with pytest.raises(ValueError, match="unknown FP4 format"):
        F.quantize(torch.zeros(1, 32), "fp4")
    with pytest.raises(ValueError, match="unknown FP4 format"):
        F.block_size("int4")
    with pytest.raises(ValueError, match="no global scale"):
        F.quantize(torch.zeros(1, 32), "mxfp4", global_scale=1.0)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="positive finite"):
            F.quantize(torch.zeros(1, 16), "nvfp4", global_scale=bad)
    with pytest.raises(ValueError, match="odd number"):
        F.pack_fp4(torch.zeros(3, dtype=torch.uint8))


def test_cat_requires_shared_global_scale():
    a = F.quantize(torch.ones(1, 16), "nvfp4")
    b = F.quantize(torch.ones(1, 16) * 2, "nvfp4")
    with pytest.raises(ValueError, match="share one global scale"):
        F.cat([a, b])
    base, res = F.quantize_with_residue(torch.randn(2, 32), "nvfp4")
    assert F.cat([base, res]).shape == (2, 64)


# ----------------------------------------------------------------------------- properties

_floats = st.floats(min_value=-1e4, max_value=1e4, allow_nan=False, width=32)


@settings(max_examples=60, deadline=None)
@given(st.lists(_floats, min_size=32, max_size=32), st.sampled_from(F.FORMATS))
@example([0.0] * 31 + [29.0], "mxfp4")      # saturation: 29 / 4 = 7.25 -> 6, error 5 = 1.25 units
def test_property_dequantize_error_bounded_by_block_step(vals, fmt):
    x = torch.tensor([vals], dtype=torch.float32)
    q = F.quantize(x, fmt)
    xh = F.dequantize(q)
    bs = F.block_size(fmt)
    scale = q.scale_values().repeat_interleave(bs, -1)
    if fmt == "nvfp4":
        scale = scale * q.global_scale
    # The largest E2M1 gap is 2 (4 -> 6): rounding errs by at most one scale unit (plus FP32
    # rounding in the scale product). NVFP4's amax maps to <= 6 up to the E4M3 rounding of the
    # scale (relative 2^-4, so saturation costs < 0.4 unit); MXFP4's power-of-two scale maps
    # amax into [4, 8), and saturating (6, 8) to 6 costs up to 2 units.
    units = 2.0 if fmt == "mxfp4" else 1.0
    ok = (x - xh).abs() <= scale * units * (1 + 1e-6) + 1e-30
    assert torch.isfinite(xh).all()
    assert bool(ok.all())


@settings(max_examples=60, deadline=None)
@given(st.lists(_floats, min_size=16, max_size=16))
def test_property_sign_symmetry_and_code_range(vals):
    x = torch.tensor([vals], dtype=torch.float32)
    q = F.quantize(x, "nvfp4")
    qn = F.quantize(-x, "nvfp4")
    c, cn = F.unpack_fp4(q.codes), F.unpack_fp4(qn.codes)
    assert int(c.max()) <= 15
    assert torch.equal(q.scales, qn.scales)
    assert torch.equal(F.e2m1_decode(c), -F.e2m1_decode(cn))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(min_value=-100, max_value=100, allow_nan=False, width=32),
                min_size=64, max_size=64), st.sampled_from(F.FORMATS))
def test_property_residue_never_increases_error(vals, fmt):
    x = torch.tensor([vals], dtype=torch.float32)
    base, res = F.quantize_with_residue(x, fmt)
    e0 = ((x - F.dequantize(base)) ** 2).sum()
    e1 = ((x - F.dequantize(base) - F.dequantize(res)) ** 2).sum()
    assert e1 <= e0 * (1 + 1e-6) + 1e-30
