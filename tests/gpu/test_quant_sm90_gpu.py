"""quant_sm90 on the GPU: the device functions against torch / formats on millions of values,
then every output of every variant bit-exact against operand_reference on random and
adversarial inputs (ties, saturation, zeros, tiny, huge, mixed), both formats, all layouts,
K-Ext at every ratio, static and dynamic alpha; poisoned outputs, determinism, graph capture.

Run on the H200:
    source .devcache/device/env.sh && python3 -m pytest -m gpu -q tests/gpu/test_quant_sm90_gpu.py
"""

from __future__ import annotations

import importlib.util
import itertools
from pathlib import Path

import pytest
import torch

from resgen import formats as F
from resgen.kernels import quant_sm90 as Q

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DEV = "cuda"
ARCH = "sm_90a"


# ----------------------------------------------------------------------------- device functions


@pytest.fixture(scope="module")
def probe():
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_ptr

    from resgen.kernels.codegen import compile_entry

    path = Path(__file__).with_name("quant_probe_kernels.py")
    spec = importlib.util.spec_from_file_location("quant_probe_kernels", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    g = cute.AddressSpace.gmem
    fake = [make_ptr(cutlass.Float32, 0, g, 4), make_ptr(cutlass.Float32, 0, g, 4),
            make_ptr(cutlass.Uint32, 0, g, 4), cutlass.Int32(128), cuda.CUstream(0)]
    fn = compile_entry(mod.probe, fake, ARCH).fn

    def run(v: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        n = v.numel()
        assert n % 128 == 0
        v, d = v.to(DEV).contiguous(), d.to(DEV).contiguous()
        out = torch.full((mod.ROWS, n), -1, dtype=torch.int32, device=DEV)
        ptr = lambda t, dt: make_ptr(dt, t.data_ptr(), g, assumed_align=4)   # noqa: E731
        fn(ptr(v, cutlass.Float32), ptr(d, cutlass.Float32), ptr(out, cutlass.Uint32),
           cutlass.Int32(n), cuda.CUstream(torch.cuda.current_stream().cuda_stream))
        torch.cuda.synchronize()
        return out.cpu()

    return run


def _sweep() -> torch.Tensor:
    """Every 257th FP32 bit pattern (16.7M values: all exponents, dense mantissas) plus +-64 ulps
    around the E2M1 boundaries and the E4M3 rounding points; finite only, length % 128 == 0."""
    u = torch.arange(0, 1 << 32, 257, dtype=torch.int64)
    extra = [torch.arange(-64, 65) + int(torch.tensor([b], dtype=torch.float32)
                                           .view(torch.int32)) for b in
             (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 448.0, 464.0, 2.0 ** -9, 2.0 ** -10,
              1.5 * 2.0 ** -10, 2.0 ** -6)]
    u = torch.cat([u] + extra)
    u = torch.where(u >= 1 << 31, u - (1 << 32), u).to(torch.int32)
    v = u.view(torch.float32)
    v = v[torch.isfinite(v)]
    return v[: v.numel() // 128 * 128].contiguous()


def test_device_e4m3_e2m1_and_scales_match_torch(probe):
    v = _sweep()
    d = torch.ones_like(v)
    out = probe(v, d)
    a = v.abs()
    # e4m3: cvt.rn.satfinite.e4m3x2.f32 against torch's float8 cast (after formats' clamp)
    want = torch.clamp(a, max=448.0).to(torch.float8_e4m3fn).view(torch.uint8).to(torch.int32)
    assert torch.equal(out[0], want)
    code = F.e2m1_encode(v).to(torch.int32)
    assert torch.equal(out[1], code)
    assert torch.equal(out[2], F.e2m1_decode(code.to(torch.uint8)).view(torch.int32))
    # formats' E8M0 rule: floor(log2 amax) - 2 from frexp, clamped (checked against
    # formats.quantize on the CPU in tests/test_quant_sm90.py)
    e = torch.where(a > 0, torch.frexp(a).exponent.to(torch.int32) - 3,
                    torch.full_like(a, -127, dtype=torch.int32)).clamp(-127, 127)
    assert torch.equal(out[5], e + 127)
    # IEEE division by a tensor (a Python-scalar divisor is a reciprocal product on CUDA)
    alpha = torch.where(a == 0, torch.ones_like(a),
                        torch.clamp(a / torch.full_like(a, 2688.0),
                                    min=torch.finfo(torch.float32).tiny))
    assert torch.equal(out[6], alpha.view(torch.int32))
    b = torch.arange(v.numel()) & 0xFF
    dec = (b & 0x7F).to(torch.uint8).view(torch.float8_e4m3fn).float()
    ok = (b & 0x7F) != 0x7F
    assert torch.equal(out[7][ok], dec[ok].view(torch.int32))


def test_device_division_is_ieee(probe):
    g = torch.Generator().manual_seed(0)
    n = 1 << 22
    sf = torch.randint(0, 127, (n,), generator=g).to(torch.uint8).view(torch.float8_e4m3fn).float()
    alpha = (torch.rand(n, generator=g) + 0.5) * torch.exp2(torch.randint(-140, 120, (n,),
                                                                           generator=g).float())
    d = (alpha * sf).float()
    ratio = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 7.0, 1e-3, 1e9])[
        torch.randint(0, 11, (n,), generator=g)]
    x = (ratio.double() * d.double()).float()
    x = (x.view(torch.int32) + torch.randint(-2, 3, (n,), generator=g, dtype=torch.int32)
         ).view(torch.float32)
    x = torch.where(torch.isfinite(x), x, torch.zeros_like(x))
    x = x * torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    out = probe(x, d)
    pos = d > 0
    want = (x / d).abs()
    got = out[3].view(torch.float32).abs()
    # block_quotients (one Markstein step): IEEE's E2M1 codes, the quotient IEEE's or the
    # float next to it
    assert torch.equal(F.e2m1_encode(got[pos]), F.e2m1_encode(want[pos]))
    ulps = (got[pos].view(torch.int32).long() - want[pos].view(torch.int32).long()).abs()
    assert int(ulps.max()) <= 1
    assert not bool(got[~pos].any())                    # d == 0: +-0 (formats' x / inf)
    assert torch.equal(out[4].view(torch.float32)[pos].view(torch.int32),
                       (x / d)[pos].view(torch.int32))
    fast = out[8].bool()
    assert fast.float().mean() > 0.3 and (~fast).any()  # both paths exercised


def test_device_fast_paths_are_ieee(probe):
    """div6_rn, rcp_rn, nvfp4_block_scale (div6_rn, then div.rn by alpha) and bf16x2_abs_max
    against torch (IEEE on the CPU) on every exponent, tensor scales from 2^-149 to 2^127."""
    v = _sweep()
    g = torch.Generator().manual_seed(1)
    n = v.numel()
    e = torch.randint(-149, 128, (n,), generator=g)
    d = ((torch.rand(n, generator=g) + 1.0).double() * torch.exp2(e.double())).float()
    d = torch.where(torch.isfinite(d) & (d > 0), d, torch.ones_like(d))
    d[: n // 4] = 1.0                                   # alpha = 1: quotients = |v| / 6
    out = probe(v, d)
    a = v.abs()
    six = torch.full_like(a, 6.0)
    assert torch.equal(out[9], (a / six).view(torch.int32))
    assert torch.equal(out[10], (torch.ones_like(d) / d).view(torch.int32))
    want = torch.clamp((a / six) / d, max=448.0).to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(out[11], want.to(torch.int32))
    halves = []
    for t in (v, d):                                    # the four bf16 halves of (v, d)
        w = t.view(torch.int32)
        halves += [(w << 16).view(torch.float32), (w & -65536).view(torch.float32)]
    h = torch.stack(halves)
    ok = torch.isfinite(h).all(0)                       # no NaN / inf halves
    assert ok.float().mean() > 0.9
    m = h.abs().amax(0)
    assert torch.equal(out[12][ok], m[ok].view(torch.int32))


# ----------------------------------------------------------------------------- the kernels

_PROBLEMS = [  # (fmt, compensation, layout)
    ("nvfp4", "none", "plain"), ("nvfp4", "full", "row_pair"), ("nvfp4", "full", "tile8"),
    ("nvfp4", "0.125", "plain"), ("nvfp4", "0.25", "plain"), ("nvfp4", "0.5", "plain"),
    ("nvfp4", "1.0", "plain"),
    ("mxfp4", "none", "plain"), ("mxfp4", "full", "row_pair"), ("mxfp4", "full", "tile8"),
    ("mxfp4", "0.125", "plain"), ("mxfp4", "0.25", "plain"), ("mxfp4", "0.5", "plain"),
    ("mxfp4", "1.0", "plain"),
]
_TUNING = [(8, 4, 1, False), (16, 8, 2, True)]              # (ept, warps, unroll, persist)


def _full_space() -> list[tuple[int, int, int, bool]]:
    """The family's whole tuning space (one-shot and persistent grids)."""
    from resgen.search.quant_sm90 import QuantProblem, QuantSm90Family

    p = QuantProblem(fmt="nvfp4", compensation="full", m=1, k=4096)
    return [(v.ept, v.warps, v.unroll, v.persist) for v in QuantSm90Family().space(p, ARCH)]


_FULL_SPACE = _full_space()
_CACHE: dict = {}


def _kernel(cfg: Q.QuantConfig) -> Q.QuantKernel:
    if cfg not in _CACHE:
        _CACHE[cfg] = Q.compile_config(cfg, ARCH)[0]
    return _CACHE[cfg]


def _alphas(fmt: str, alpha_mode: str, x: torch.Tensor):
    if fmt == "mxfp4" or alpha_mode == "dynamic":
        return [None]
    cal = F.nvfp4_global_scale(x.float())
    return [cal, torch.tensor(2.0 ** -8), torch.tensor(1e-30), torch.tensor(1e30)]


def _run(kern: Q.QuantKernel, x, alpha, masks, row_multiple) -> Q.QuantOperand:
    out = kern.outputs(x.shape[0], row_multiple, DEV)
    op = out.operand
    for t in (op.codes, op.scales, op.xop):
        if t.numel():
            t.view(torch.uint8).fill_(0xFF)                 # poison: every byte must be written
    a = None if alpha is None else alpha.reshape(1).to(DEV, torch.float32)
    return kern(x, out, alpha=a, masks=masks)


def _check(kern: Q.QuantKernel, cfg: Q.QuantConfig, x, alpha, masks, row_multiple, label):
    from resgen.search.quant_sm90 import compare_operands

    got = _run(kern, x, alpha, masks, row_multiple)
    torch.cuda.synchronize()
    ref = Q.operand_reference(x, cfg.fmt, cfg.compensation, cfg.layout, row_multiple,
                              None if alpha is None else alpha, masks, cfg.kp_align)
    res = compare_operands(got, ref, cfg, label)
    assert res.ok, res.detail
    return got


def _configs():
    """Every problem x alpha mode: pack8 one-shot writing xop and writing both outputs, pack16
    persistent writing xop (codes-only pack16 runs in test_every_ratio_with_many_masks)."""
    for (fmt, comp, layout), (outputs, tuning) in itertools.product(
            _PROBLEMS, (("xop", _TUNING[0]), ("both", _TUNING[0]), ("xop", _TUNING[1]))):
        alphas = ("none",) if fmt == "mxfp4" else ("static", "dynamic")
        for alpha in alphas:
            for ept, warps, unroll, persist in (tuning,):
                yield Q.QuantConfig(fmt, comp, 1024, layout, ept=ept, warps=warps, unroll=unroll,
                                    persist=persist, write_codes=outputs != "xop",
                                    write_xop=outputs != "codes", alpha=alpha,
                                    kp_align=256 if "0.25" == comp else 64)


@pytest.mark.parametrize("cfg", list(_configs()), ids=lambda c: (
    f"{c.fmt}-{c.compensation}-{c.layout}-{'c' if c.write_codes else ''}"
    f"{'x' if c.write_xop else ''}-{c.alpha}-e{c.ept}w{c.warps}u{c.unroll}"
    f"{'p' if c.persist else ''}"))
def test_variant_bit_exact_on_all_input_kinds(cfg):
    kern = _kernel(cfg)
    masks = (Q.random_masks(cfg.k, cfg.compensation, seed=11, device=DEV)
             if cfg.mode == "kext" else None)
    rm = 16 if cfg.layout == "tile8" else 8
    for kind, m in itertools.product(Q.INPUT_KINDS, (1, 37)):
        x = Q.make_inputs(kind, m, cfg.k, seed=m * 7 + len(kind), device=DEV)
        for alpha in _alphas(cfg.fmt, cfg.alpha, x):
            _check(kern, cfg, x, alpha, masks, rm, f"{kind} m={m} alpha={alpha}")


@pytest.mark.parametrize("tuning", _FULL_SPACE,
                         ids=lambda t: f"e{t[0]}w{t[1]}u{t[2]}{'p' if t[3] else ''}")
@pytest.mark.parametrize("fmt,comp,layout,k", [("nvfp4", "full", "row_pair", 4096),
                                               ("mxfp4", "0.25", "plain", 12288)])
def test_whole_tuning_space_on_a_decode_and_a_prefill_shape(tuning, fmt, comp, layout, k):
    ept, warps, unroll, persist = tuning
    cfg = Q.QuantConfig(fmt, comp, k, layout, ept=ept, warps=warps, unroll=unroll,
                        persist=persist, alpha="static" if fmt == "nvfp4" else "none")
    if cfg.why_invalid():
        pytest.skip(cfg.why_invalid())
    kern = _kernel(cfg)
    masks = Q.random_masks(k, comp, seed=2, device=DEV) if cfg.mode == "kext" else None
    for m in (1, 300):
        x = Q.make_inputs("outliers", m, k, seed=m, device=DEV)
        alpha = F.nvfp4_global_scale(x.float()) if fmt == "nvfp4" else None
        _check(kern, cfg, x, alpha, masks, 8, f"m={m}")


@pytest.mark.parametrize("fmt,comp,layout,ept,unroll", [
    ("nvfp4", "full", "row_pair", 8, 2), ("nvfp4", "none", "plain", 16, 1),
    ("mxfp4", "0.125", "plain", 8, 1), ("nvfp4", "0.5", "plain", 16, 2),
    ("nvfp4", "full", "tile8", 8, 1)])
def test_persistent_grid_loops_over_many_tiles(fmt, comp, layout, ept, unroll):
    """A persistent variant capped to a few CTAs: every warp runs many loop iterations
    (prefetch, the last iteration's zero-row loads, tiles past the end, padding slots)."""
    k = 2048
    cfg = Q.QuantConfig(fmt, comp, k, layout, ept=ept, warps=4, unroll=unroll, persist=True,
                        alpha="static" if fmt == "nvfp4" else "none")
    kern = _kernel(cfg)
    masks = Q.random_masks(k, comp, seed=4, device=DEV) if cfg.mode == "kext" else None
    rm = 16 if layout == "tile8" else 8
    for cap in (1, 3, 7):
        kern.grid_cap = cap
        for m in (5, 131):
            x = Q.make_inputs("outliers", m, k, seed=m + cap, device=DEV)
            alpha = F.nvfp4_global_scale(x.float()) if fmt == "nvfp4" else None
            _check(kern, cfg, x, alpha, masks, rm, f"cap={cap} m={m}")
    kern.grid_cap = None


def test_every_ratio_with_many_masks():
    """K-Ext: several random selections per ratio, both formats, pack8 and pack16."""
    for fmt, comp, ept in itertools.product(("nvfp4", "mxfp4"), ("0.125", "0.25", "0.5", "1.0"),
                                            (8, 16)):
        cfg = Q.QuantConfig(fmt, comp, 2048, "plain", ept=ept, write_codes=True,
                            write_xop=ept == 8,           # pack16 here: codes + scales only
                            alpha="static" if fmt == "nvfp4" else "none")
        kern = _kernel(cfg)
        x = Q.make_inputs("randn", 24, 2048, seed=5, device=DEV)
        alpha = F.nvfp4_global_scale(x.float()) if fmt == "nvfp4" else None
        for seed in range(4):
            masks = Q.random_masks(2048, comp, seed=seed, device=DEV)
            _check(kern, cfg, x, alpha, masks, 1, f"{fmt} {comp} ept={ept} masks#{seed}")


def test_deterministic_and_graph_capturable():
    cfg = Q.QuantConfig("nvfp4", "full", 4096, "row_pair", ept=16, unroll=2, alpha="dynamic")
    kern = _kernel(cfg)
    x = Q.make_inputs("randn", 96, 4096, seed=3, device=DEV)
    a = _run(kern, x, None, None, 8)
    torch.cuda.synchronize()
    snap = [t.clone() for t in (a.codes, a.scales.view(torch.uint8), a.xop, a.alpha)]
    out = kern.outputs(96, 8, DEV)
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        kern(x, out)                                     # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        kern(x, out)
    for t in (out.operand.codes, out.operand.xop):
        t.view(torch.uint8).fill_(0xFF)
    graph.replay()
    torch.cuda.synchronize()
    op = out.operand
    for got, want in zip((op.codes, op.scales.view(torch.uint8), op.xop, op.alpha), snap):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_launcher_rejects_bad_calls():
    cfg = Q.QuantConfig("nvfp4", "0.5", 1024, "plain")
    kern = _kernel(cfg)
    out = kern.outputs(4, 1, DEV)
    x = Q.make_inputs("randn", 4, 1024, device=DEV)
    alpha = torch.ones(1, device=DEV)
    masks = Q.random_masks(1024, "0.5", device=DEV)
    with pytest.raises(ValueError):
        kern(x, out, alpha=alpha)                         # masks missing
    with pytest.raises(ValueError):
        kern(x, out, masks=masks)                         # static alpha missing
    with pytest.raises(ValueError):
        kern(x[:3].contiguous(), out, alpha=alpha, masks=masks)   # wrong m
    with pytest.raises(TypeError):
        kern(x.float(), out, alpha=alpha, masks=masks)    # not bf16
