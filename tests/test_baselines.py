"""resgen.baselines / resgen.baselines_marlin on the CPU: the argument checks, the Marlin
loader's errors, the Marlin scale preparation (a permutation; nothing lost in the S0E5M3 and
E8M0 forms), the FP8 rowwise quantizer's math, and `resgen bench`'s table and sums with every
baseline column (fake timings). The kernels themselves: tests/gpu/test_baselines_gpu.py."""

from __future__ import annotations

import pytest
import torch

from resgen import baselines as B
from resgen import baselines_marlin as BM
from resgen import formats


@pytest.fixture
def no_marlin_cache(monkeypatch):
    monkeypatch.setattr(BM, "_LIB", None)


def test_loader_names_the_missing_library_and_the_fix(monkeypatch, tmp_path, no_marlin_cache):
    missing = tmp_path / "nope" / "libmarlin.so"
    monkeypatch.setenv(BM.LIB_ENV, str(missing))
    with pytest.raises(BM.MarlinUnavailable) as e:
        BM.load()
    assert str(missing) in str(e.value) and "bench/marlin_setup.sh" in str(e.value)
    assert B.MarlinUnavailable is BM.MarlinUnavailable


def test_loader_rejects_a_file_that_is_not_a_library(monkeypatch, tmp_path, no_marlin_cache):
    junk = tmp_path / "libmarlin_fp4_sm90a.so"
    junk.write_bytes(b"not an ELF file")
    monkeypatch.setenv(BM.LIB_ENV, str(junk))
    with pytest.raises(BM.MarlinUnavailable, match="does not load"):
        BM.load()


def test_default_path_is_the_ignored_peers_folder(monkeypatch):
    monkeypatch.delenv(BM.LIB_ENV, raising=False)
    assert BM.lib_path().parts[-3:] == (".peers", "marlin", "libmarlin_fp4_sm90a.so")
    ignore = (BM.DEFAULT_LIB.parents[2] / ".gitignore").read_text().split()
    assert "/.peers/" in ignore


def test_marlin_fp4_checks_arguments_before_loading(monkeypatch, tmp_path, no_marlin_cache):
    monkeypatch.setenv(BM.LIB_ENV, str(tmp_path / "absent.so"))
    q = formats.quantize(torch.randn(128, 256), "nvfp4")
    x = torch.randn(4, 256).to(torch.bfloat16)
    with pytest.raises(ValueError, match="one of"):
        B.marlin_fp4(x, q, "int4")
    with pytest.raises(ValueError, match="weights are nvfp4"):
        B.marlin_fp4(x, q, "mxfp4")
    with pytest.raises(ValueError, match="bf16 activations"):
        B.marlin_fp4(x.float(), q, "nvfp4")
    with pytest.raises(ValueError, match="K=128, weights K=256"):
        B.marlin_fp4(x[:, :128], q, "nvfp4")
    with pytest.raises(ValueError, match="QuantizedTensor"):
        B.marlin_fp4(x, torch.zeros(128, 128, dtype=torch.uint8), "nvfp4")
    odd = formats.quantize(torch.randn(96, 256), "nvfp4")
    with pytest.raises(ValueError, match="N % 64"):
        B.marlin_fp4(x, odd, "nvfp4")
    short = formats.quantize(torch.randn(128, 64), "nvfp4")
    with pytest.raises(ValueError, match="K % 128"):
        B.marlin_fp4(x[:, :64], short, "nvfp4")
    # valid arguments reach the loader, whose error names the library
    with pytest.raises(BM.MarlinUnavailable, match="absent.so"):
        B.marlin_fp4(x, q, "nvfp4")


def test_scale_permutation_is_vllms_and_a_permutation():
    perm = BM._scale_perm()
    assert sorted(perm) == list(range(64)) and perm[:9] == [0, 8, 16, 24, 32, 40, 48, 56, 1]
    s = torch.arange(8 * 128, dtype=torch.float32).reshape(8, 128)
    p = BM.permute_scales(s, 128)
    assert p.shape == s.shape
    for g in range(8):                   # each row of 128 is two blocks of 64, each permuted
        for blk in range(2):
            got = p[g, 64 * blk:64 * blk + 64]
            assert torch.equal(got, s[g, 64 * blk:64 * blk + 64][perm])


def _s0e5m3_value(b: torch.Tensor) -> torch.Tensor:
    """Marlin's NVFP4 scale byte: the top 8 bits of a half after its sign (5 exponent bits,
    bias 15, 3 mantissa bits)."""
    u = b.view(torch.uint8).to(torch.int32)
    e, mant = u >> 3, (u & 7).float()
    return torch.where(e == 0, torch.zeros_like(mant), (1 + mant / 8) * torch.exp2(e - 15.0))


def test_nvfp4_scales_keep_every_value_through_marlins_s0e5m3_form():
    w = torch.randn(128, 512)
    q = formats.quantize(w, "nvfp4")
    n, k = 128, 512
    s = BM.permute_scales(q.scales.t().contiguous().to(torch.bfloat16), n)      # [K/16, N]
    out, factor = BM.nvfp4_process_scales(s)
    assert out.dtype == torch.float8_e4m3fn and out.shape == (k // 16, n)
    assert factor >= 1.0 and factor == 2.0 ** round(torch.tensor(factor).log2().item())
    inter = s.float().view(-1, 4)[:, [0, 2, 1, 3]].reshape(k // 16, n)
    back = _s0e5m3_value(out) / 2 ** 7 / factor
    assert torch.equal(back, inter)                          # exact: E4M3 fits in 5e3m
    gs = BM.nvfp4_process_global_scale(q.global_scale, factor)
    assert gs.shape == (1,) and gs.dtype == torch.float32
    assert gs.item() == pytest.approx(q.global_scale.item() * 2.0 ** 119 / factor, rel=1e-7)


def test_nvfp4_small_scales_are_rescaled_not_zeroed():
    s = torch.full((2, 64), 2.0 ** -6, dtype=torch.bfloat16)   # far below 448: factor > 1
    out, factor = BM.nvfp4_process_scales(s)
    assert factor > 1.0
    assert torch.equal(_s0e5m3_value(out) / 2 ** 7 / factor, s.float())


def test_mxfp4_scales_are_the_bytes_of_vllms_bf16_route():
    q = formats.quantize(torch.randn(128, 512) * torch.logspace(-30, 30, 512), "mxfp4")
    codes = q.scales.t().contiguous()                                        # [K/32, N]
    out = BM.mxfp4_process_scales(BM.permute_scales(codes, 128))
    assert out.dtype == torch.float8_e8m0fnu and out.shape == (16, 128)
    # vLLM: view E8M0, to bf16, permute, interleave as values, back to E8M0
    s = BM.permute_scales(codes.view(torch.float8_e8m0fnu).to(torch.bfloat16), 128)
    want = s.view(-1, 4)[:, [0, 2, 1, 3]].view(16, -1).to(torch.float8_e8m0fnu)
    assert torch.equal(out.view(torch.uint8), want.view(torch.uint8))
    assert len(set(codes.flatten().tolist())) > 20              # a wide range of exponents
    with pytest.raises(ValueError, match="uint8"):
        BM.mxfp4_process_scales(codes.float())


def test_fp8_rowwise_quant_math():
    x = torch.randn(4, 64) * torch.tensor([[1.0], [100.0], [1e-3], [0.0]])
    x8, s = B.fp8_rowwise_quant(x)
    assert x8.dtype == torch.float8_e4m3fn and s.shape == (4, 1) and s.dtype == torch.float32
    assert torch.equal(s[:3, 0], (x[:3].abs().amax(1) * B.INV_E4M3_MAX))
    assert s[3, 0].item() == pytest.approx(1e-12)
    assert torch.all(x8[3].float() == 0)
    assert torch.all(x8.float().abs().amax(1)[:3] <= B.E4M3_MAX)
    # each row's maximum lands on (or one rounding step below) 448 and the rest within 1/16
    rec = x8.float() * s
    assert torch.allclose(rec[:3], x[:3], rtol=2 ** -3, atol=float(s.max()) * 2 ** -9)


def test_fp8_forms_check_their_shapes():
    w = torch.randn(64, 128).to(torch.bfloat16)
    with pytest.raises(ValueError, match="multiples of 16"):
        B.cublas_fp8_prequant(torch.randn(3, 128).to(torch.bfloat16), w)
    with pytest.raises(ValueError, match="K=64"):
        B.cublas_fp8_fused(torch.randn(16, 64).to(torch.bfloat16), w)
    with pytest.raises(ValueError, match="2-D float"):
        B.cublas_fp8_prequant(torch.randn(16), w)


@pytest.mark.skipif(B.TRITON_AVAILABLE, reason="Triton present: the GPU test runs the kernel")
def test_fused_fp8_says_triton_is_missing():
    w = torch.randn(64, 128).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="Triton is not installed"):
        B.cublas_fp8_fused(torch.randn(16, 128).to(torch.bfloat16), w)


def _row(fmt, comp, m, n, k, us, **base):
    r = {"problem": {"fmt": fmt, "compensation": comp, "m": m, "n": n, "k": k},
         "resgen_us": us, "floor_us": 1.0, "variant": "v"}
    r.update(base)
    return r


def test_bench_table_has_every_baseline_column():
    from resgen.cli import BASELINE_COLUMNS, _bench_table

    fp8 = dict(fp8_us=50.0, fp8_prequant_us=20.0, fp8_fused_us=25.0,
               fp8_tensor_prequant_us=16.0, fp8_static_us=32.0)
    rows = [_row("nvfp4", "none", 1, 4096, 4096, 10.0, bf16_us=40.0, marlin_us=15.0, **fp8),
            _row("nvfp4", "w4a16", 1, 4096, 4096, 8.0, bf16_us=40.0, **fp8),
            _row("mxfp4", "none", 1, 4096, 4096, None, bf16_us=40.0, triton_us=30.0)]
    text = _bench_table(rows)
    lines = text.splitlines()
    head = lines[0].split()
    for col in ("bf16", "fp8tq", "fp8pre", "fp8fused", "fp8tpre", "fp8static", "marlin"):
        assert f"x{col}" not in head and col in head          # "<col> us" then "x <col>"
    assert [k for k, _ in BASELINE_COLUMNS] == ["bf16_us", "fp8_us", "fp8_prequant_us",
                                                "fp8_fused_us", "fp8_tensor_prequant_us",
                                                "fp8_static_us", "marlin_us", "triton_us"]
    cells = lines[2].split() if set(lines[1]) <= set("-+ |") else lines[1].split()
    # fmt comp M NxK resgen %floor | 7 times | 8 ratios | x none | variant
    assert cells[:6] == ["nvfp4", "none", "1", "4096x4096", "10.00", "10"]
    assert cells[6:13] == ["40.00", "50.00", "20.00", "25.00", "16.00", "32.00", "15.00"]
    assert cells[13:21] == ["4.00", "5.00", "2.00", "2.50", "1.60", "3.20", "1.50", "-"]
    assert cells[21:] == ["1.00", "v"]
    w4 = [ln for ln in lines if "w4a16" in ln][0].split()
    assert w4[12] == "-" and w4[19] == "-" and w4[21] == "1.25"    # no Marlin; none / w4a16
    mx = [ln for ln in lines if "mxfp4" in ln][0].split()
    assert mx[4] == "-" and mx[20] == "-"                          # no resgen time: no ratio


def test_fp8_tensor_quant_math():
    x = torch.randn(8, 64) * 5
    x8, s = B.fp8_tensor_quant(x)
    assert x8.dtype == torch.float8_e4m3fn and s.shape == () and s.dtype == torch.float32
    assert s.item() == (x.abs().amax() * B.INV_E4M3_MAX).item()
    assert x8.float().abs().max().item() == B.E4M3_MAX            # the maximum lands on 448
    assert torch.allclose(x8.float() * s, x, rtol=2 ** -3, atol=float(s) * 2 ** -9)
    # a static scale is used as given, and values past it clamp to +-448 (never inf / NaN)
    y8, t = B.fp8_tensor_quant(x, torch.tensor(s.item() / 4))
    assert t.item() == pytest.approx(s.item() / 4)
    assert y8.float().abs().max().item() == B.E4M3_MAX and torch.isfinite(y8.float()).all()
    z8, zs = B.fp8_tensor_quant(torch.zeros(2, 32))
    assert zs.item() == pytest.approx(1e-12) and torch.all(z8.float() == 0)


def test_per_tensor_prequant_matches_its_operands_on_cpu_when_scaled_mm_runs():
    """The form's arithmetic against the FP32 product of its own operands (where this torch
    build runs _scaled_mm on the CPU; on the GPU, tests/gpu/test_baselines_gpu.py)."""
    x = torch.randn(16, 128).to(torch.bfloat16)
    w = (torch.randn(64, 128) / 128 ** 0.5).to(torch.bfloat16)
    try:
        out = B.cublas_fp8_tensor_prequant(x, w)()
    except (RuntimeError, NotImplementedError) as e:
        pytest.skip(f"torch._scaled_mm does not run on this CPU build: {e}")
    x8, xs = B.fp8_tensor_quant(x)
    w8, ws = B.fp8_tensor_quant(w)
    ref = (x8.float() * xs) @ (w8.float() * ws).T
    assert float((out.float() - ref).norm() / ref.norm()) <= 1e-2


def test_bench_sums_name_every_fp8_form_and_marlin():
    from resgen.cli import _bench_sums

    fp8 = dict(fp8_us=50.0, fp8_prequant_us=20.0, fp8_fused_us=25.0,
               fp8_tensor_prequant_us=16.0, fp8_static_us=32.0)
    rows = [_row("nvfp4", "none", 16, 4096, 4096, 10.0, bf16_us=40.0, marlin_us=15.0, **fp8),
            _row("nvfp4", "none", 16, 6144, 4096, 10.0, bf16_us=40.0, marlin_us=15.0, **fp8)]
    (line,) = _bench_sums(rows)
    assert line == ("sum nvfp4 none M=16 over 2 layers: 20.00 us; cuBLAS BF16 80.00 us (x4.00); "
                    "cuBLAS FP8 torch-quant 100.00 us (x5.00); cuBLAS FP8 prequant 40.00 us "
                    "(x2.00); cuBLAS FP8 fused-quant 50.00 us (x2.50); cuBLAS FP8 per-tensor "
                    "prequant 32.00 us (x1.60); cuBLAS FP8 static-scale 64.00 us (x3.20); "
                    "Marlin W4A16 30.00 us (x1.50); HBM floor 2.00 us (10%)")
    rows[1].pop("marlin_us")             # one layer without Marlin: no Marlin sum
    assert "Marlin" not in _bench_sums(rows)[0]
