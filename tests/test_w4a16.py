"""W4A16 (compensation "w4a16": FP4 weights, BF16 activations never quantized) through the
pipeline on the CPU: the problem and its keys, validity (fused variants refused with a
reason), the compile key and fingerprint (the plain kernel: nothing goes stale), the operand
stage (in place or one padding copy), the runner's checks, resgen.ops.Linear / FP4Linear
served through the kernels' CPU simulations against resgen.reference.linear_w4a16, and the
CLI. The H200 half is tests/gpu/test_w4a16_gpu.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fakefam import isolated_cache  # noqa: E402,F401
from test_linear_sm90 import _record_launcher_pointers, _SimulatedKernel  # noqa: E402
from test_linear_sm90_wgmma import _qweight  # noqa: E402

from resgen import reference as R  # noqa: E402
from resgen.kernels.linear_sm90_wgmma_sim import SimulatedKernel  # noqa: E402
from resgen.ops import Linear  # noqa: E402
from resgen.runtime import Device, Dispatcher  # noqa: E402
from resgen.search import linear_sm90 as LS  # noqa: E402
from resgen.search import linear_sm90_wgmma as LW  # noqa: E402
from resgen.search import sm90_linear as SL  # noqa: E402
from resgen.search.build import variant_fingerprint  # noqa: E402
from resgen.search.variant import LinearProblem  # noqa: E402

ARCH = "sm_90a"
TOL = SL.TOLERANCE
pytestmark = pytest.mark.usefixtures("isolated_cache")


def _rel(y, ref):
    return float((y.float() - ref).norm() / ref.norm())


class _Compiles:
    """compile_fn: the family's CPU simulation per (variant, problem), recording the compile
    keys asked for."""

    def __init__(self, registry=None):
        self.registry, self.keys = registry, []

    def __call__(self, fam, v, p, arch):
        self.keys.append(fam.compile_key(v, p))
        if fam.NAME == "linear_sm90_wgmma":
            return SimulatedKernel(LW.geometry_of(v, p))
        return _SimulatedKernel(LS.geometry_of(v, p), self.registry)


def _no_quantizer(p, arch):
    raise AssertionError(f"W4A16 asked for a layer quantizer ({p.key()})")


# ----------------------------------------------------------------------------- problem, keys


def test_problem_key_and_fields():
    p = LinearProblem("nvfp4", "w4a16", 3, 128, 512)
    assert p.w4a16 and p.ratio is None and p.rows == 3 and p.k_ext(16) == 512
    keys = {LinearProblem("nvfp4", c, 3, 128, 512).key()
            for c in ("none", "full", "0.125", "0.25", "0.5", "1.0", "w4a16")}
    assert len(keys) == 7                       # its own DB key
    assert LinearProblem.from_key(p.key()) == p
    with pytest.raises(ValueError, match="compensation"):
        LinearProblem("nvfp4", "w4a8", 3, 128, 512)


def test_fused_variants_are_invalid_with_a_reason_and_outside_the_space():
    p = LinearProblem("nvfp4", "w4a16", 1, 4096, 4096)
    fused = LS.LinearSm90Variant(warps_m=1, warps_k=8, stages=3, act=LS.Act.FUSED)
    assert LS.FAMILY.why_invalid(fused, LinearProblem("nvfp4", "none", 1, 4096, 4096),
                                 ARCH) is None
    why = LS.FAMILY.why_invalid(fused, p, ARCH)
    assert why is not None and "W4A16" in why and "prologue" in why
    space = LS.FAMILY.space(p, ARCH)
    assert space and not any(v.fused for v in space)
    assert all(LS.FAMILY.why_invalid(v, p, ARCH) is None for v in space)
    # the xop part of the plain space, exactly
    plain = [v for v in LS.FAMILY.space(LinearProblem("nvfp4", "none", 1, 4096, 4096), ARCH)
             if not v.fused]
    assert space == plain
    wspace = LW.FAMILY.space(LinearProblem("mxfp4", "w4a16", 64, 4096, 4096), ARCH)
    assert wspace == LW.FAMILY.space(LinearProblem("mxfp4", "none", 64, 4096, 4096), ARCH)


@pytest.mark.parametrize("fam, v", [
    (LS.FAMILY, LS.LinearSm90Variant(warps_m=1, warps_k=8, stages=3)),
    (LS.FAMILY, LS.LinearSm90Variant(warps_m=4, warps_k=2, pipeline=LS.Pipeline.BULK,
                                     stages=2, split_k=2, reduce=LS.Reduction.WORKSPACE,
                                     pdl=True)),
    (LW.FAMILY, LW.LinearSm90WgmmaVariant(2, 1, 128, 6)),
    (LW.FAMILY, LW.LinearSm90WgmmaVariant(1, 1, 32, 8, split_k=4, pdl=True)),
])
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_w4a16_renders_the_plain_kernel(fam, v, fmt):
    """Same compile key, template parameters and fingerprint as plain W4A4: the shipped
    table's kernels serve W4A16 and no stored row changes."""
    for m in (1, 16, 128):
        w16, plain = (LinearProblem(fmt, c, m, 4096, 4096) for c in ("w4a16", "none"))
        assert fam.why_invalid(v, w16, ARCH) is None
        assert fam.compile_key(v, w16) == fam.compile_key(v, plain)
        assert fam.template_params(v, fam.compile_key(v, w16)) == \
            fam.template_params(v, fam.compile_key(v, plain))
    assert variant_fingerprint(fam, v, w16, ARCH) == variant_fingerprint(fam, v, plain, ARCH)


def test_no_layer_quantizer_for_w4a16():
    with pytest.raises(ValueError, match="no activation quantizer"):
        SL.layer_quantizer(LinearProblem("nvfp4", "w4a16", 1, 128, 512))


# ----------------------------------------------------------------------------- operand stage


def test_operand_in_place_where_it_already_is_one():
    xb = torch.randn(5, 512).to(torch.bfloat16)
    # wgmma-like: TMA reads rows past M as zeros, K = Kp -> the caller's buffer, no copy
    st = SL.W4A16Operand(5, 512, 512, 8, False, "cpu")
    assert st.in_place and st.buf is None and st(xb) is xb
    # a misaligned view is copied (into a buffer made on first use)
    flat = torch.zeros(5 * 512 + 1, dtype=torch.bfloat16)
    mis = flat[1:].view(5, 512)
    mis.copy_(xb)
    out = st(mis)
    assert out is st.buf and torch.equal(out, xb)
    # mma-like: unpredicated loads of whole token tiles -> padded rows, zero past M
    st = SL.W4A16Operand(5, 512, 512, 8, True, "cpu")
    assert not st.in_place and st.buf.shape == (8, 512)
    out = st(xb)
    assert torch.equal(out[:5], xb) and not bool(out[5:].any())
    assert SL.W4A16Operand(8, 512, 512, 8, True, "cpu").in_place   # whole tiles already
    # K < Kp: zero columns past K
    st = SL.W4A16Operand(3, 320, 512, 1, False, "cpu")
    out = st(torch.ones(3, 320, dtype=torch.bfloat16))
    assert out.shape == (3, 512) and bool((out[:, :320] == 1).all()) and \
        not bool(out[:, 320:].any())
    with pytest.raises(ValueError, match="bf16"):
        st(torch.ones(3, 320))
    # bf16_operand is the same operand built in torch (tests, gemm_only probes)
    x = torch.randn(3, 320)
    assert torch.equal(SL.bf16_operand(x, 512, 8)[:3], st(x.to(torch.bfloat16)))


# ----------------------------------------------------------------------------- served layers


@pytest.mark.parametrize("fmt, m, k", [("nvfp4", 5, 512), ("mxfp4", 16, 512),
                                       ("nvfp4", 3, 320)])
def test_wgmma_layer_serves_w4a16(fmt, m, k):
    qw = _qweight(fmt, k=k)
    v = LW.LinearSm90WgmmaVariant(1, 2, 16, 3 if k == 512 else 2, LW.Raster.CH,
                                  LS.Packing.NIB)
    compiles = _Compiles()
    layer = Linear(qw, "w4a16", device="cpu", variant=v, compile_fn=compiles,
                   quantizer_fn=_no_quantizer)
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(m, k, generator=g) * 3).to(torch.bfloat16)
    y = layer(x)
    ref = R.linear_w4a16(x.float(), qw)
    assert y.dtype == torch.bfloat16 and not bool(y.isnan().any())
    assert _rel(y, ref) <= TOL
    # the mode is really W4A16: plain W4A4 on the same inputs is much further off
    assert _rel(R.linear(x.float(), qw, "none"), ref) > 20 * TOL
    # the kernel compiled is the plain one; the operand read in place where K = Kp
    assert compiles.keys[0].compensation == "none"
    stage = layer.plan(m).run.stage
    assert stage.in_place == (k == 512)


@pytest.mark.parametrize("fmt, m", [("nvfp4", 3), ("nvfp4", 8), ("mxfp4", 5)])
def test_mma_layer_serves_w4a16_from_the_default(fmt, m, monkeypatch):
    """linear_sm90_mma through the dispatcher's default (an xop variant): the activations
    copied into a zero-padded operand of whole token tiles (in place when M fills them)."""
    registry = _record_launcher_pointers(monkeypatch)
    qw = _qweight(fmt, n=64, k=1024)
    layer = Linear(qw, "w4a16", device="cpu", family="linear_sm90_mma",
                   dispatcher=Dispatcher(paths=[], device=Device("NVIDIA H200", ARCH)),
                   compile_fn=_Compiles(registry), quantizer_fn=_no_quantizer)
    x = (torch.randn(m, 1024, generator=torch.Generator().manual_seed(m)) * 2
         ).to(torch.bfloat16)
    y = layer(x)
    assert _rel(y, R.linear_w4a16(x.float(), qw)) <= TOL
    plan = layer.plan(m)
    assert plan.source == "default" and not plan.variant.fused
    assert plan.run.stage.in_place == (m % LS.geometry_of(plan.variant, plan.problem).tok == 0)


def test_pinned_fused_variant_refuses_w4a16():
    qw = _qweight("nvfp4", n=64, k=1024)
    v = LS.LinearSm90Variant(warps_m=4, warps_k=1, stages=3, act=LS.Act.FUSED)
    layer = Linear(qw, "w4a16", device="cpu", variant=v, compile_fn=_Compiles(),
                   quantizer_fn=_no_quantizer)
    with pytest.raises(ValueError, match="W4A16"):
        layer(torch.randn(1, 1024).to(torch.bfloat16))


def test_a_kext_weight_serves_w4a16_with_its_base():
    qw = _qweight("nvfp4", ratio=0.5)
    layer = Linear(qw, "w4a16", device="cpu", variant=LW.LinearSm90WgmmaVariant(1, 1, 16, 3),
                   compile_fn=_Compiles(), quantizer_fn=_no_quantizer)
    assert layer.qweight.selection is None and layer.masks is None
    assert layer.problem(4).static_scale          # keyed static: no activation scale
    x = torch.randn(4, 512).to(torch.bfloat16)
    assert _rel(layer(x), R.linear_w4a16(x.float(), qw)) <= TOL


def test_fp4linear_kernels_backend_serves_w4a16():
    import standins as S

    from resgen.ops.nn import FP4Linear

    qw = _qweight("mxfp4")
    bias = torch.randn(128)
    mod = FP4Linear(qw, "w4a16", bias, **S.linear_kwargs())
    x = torch.randn(3, 512) * 2
    ref = R.linear_w4a16(x.to(torch.bfloat16).float(), qw) + bias
    assert mod.compensation == "w4a16" and _rel(mod(x), ref) <= TOL


# ----------------------------------------------------------------------------- the runner


def test_runner_checks_and_times_the_w4a16_layer(monkeypatch):
    registry = _record_launcher_pointers(monkeypatch)
    p = LinearProblem("nvfp4", "w4a16", 3, 64, 1024)
    v = LS.LinearSm90Variant(warps_m=2, warps_k=2, split_k=2, reduce=LS.Reduction.WORKSPACE,
                             stages=2)
    fake = _SimulatedKernel(LS.geometry_of(v, p), registry)
    LS.FAMILY.warm(v, p)                          # no quantizer to compile
    r = LS.FAMILY.runner(fake, v, p, "cpu", n_sets=2, seed=0)
    assert r.bindings is not None                 # bound at once: nothing in front to attach
    res = r.check()
    assert res.ok, res.detail
    r.as_layer()
    r.rotate(1)
    y1 = r().clone()
    assert _rel(y1, R.linear_w4a16(r.xbs[1].float(), r.sets[1][0])) <= TOL
    yg = r.gemm_only()().clone()                  # the GEMM on set 1's torch operand
    assert torch.equal(yg, y1)
    with pytest.raises(ValueError, match="no activation quantizer"):
        r.attach_quantizer(object())
    fused = LS.LinearSm90Variant(warps_m=4, warps_k=1, stages=3, act=LS.Act.FUSED)
    with pytest.raises(ValueError, match="W4A16"):
        LS.FAMILY.runner(fake, fused, p, "cpu")


def test_a_wrong_kernel_fails_the_w4a16_check(monkeypatch):
    """The check compares with linear_w4a16: a kernel that quantizes its operand to MXFP4
    (W4A4) instead of reading it as BF16 fails it."""
    from resgen import formats
    from resgen.kernels import linear_sm90_wgmma_sim as WS

    orig = WS.simulate_launch

    def w4a4(geom, wt, xop, m, rows, alpha_x):
        q = formats.dequantize(formats.quantize(xop.float(), "mxfp4")).to(torch.bfloat16)
        return orig(geom, wt, q, m, rows, alpha_x)

    monkeypatch.setattr(WS, "simulate_launch", w4a4)
    p = LinearProblem("mxfp4", "w4a16", 4, 128, 512)
    v = LW.LinearSm90WgmmaVariant(1, 1, 16, 3)
    r = LW.FAMILY.runner(SimulatedKernel(LW.geometry_of(v, p)), v, p, "cpu")
    res = r.check()
    assert not res.ok and res.rel_err > 10 * TOL


# ----------------------------------------------------------------------------- CLI


def test_tune_plan_lists_w4a16_workloads(capsys):
    from resgen.cli import main

    rc = main(["tune", "--model", "qwen3-8b", "--compensations", "w4a16", "--formats",
               "nvfp4", "--m-buckets", "1,16", "--ops", "linear", "--plan"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "linear_sm90_mma" in out and "linear_sm90_wgmma" in out


def test_bench_sums_compare_w4a16_with_plain():
    from resgen.cli import _bench_sums

    def row(comp, us, n):
        return {"problem": {"fmt": "nvfp4", "compensation": comp, "m": 16, "n": n},
                "resgen_us": us, "bf16_us": 20.0}

    lines = _bench_sums([row("none", 10.0, 1), row("none", 6.0, 2), row("w4a16", 8.0, 1),
                         row("w4a16", 4.0, 2)])
    w = next(x for x in lines if "w4a16" in x)
    assert "12.00 us" in w and "resgen none 16.00 us (x1.33)" in w


def test_warm_start_uses_the_plain_twin_of_a_w4a16_workload():
    """No rows for the W4A16 workload: its plain twin's xop winners are the hint (the fused
    ones are skipped: invalid for W4A16); a workload with rows of its own keeps them."""
    from resgen.search.warmstart import WarmStart

    plain = LinearProblem("nvfp4", "none", 1, 4096, 4096)
    w16 = LinearProblem("nvfp4", "w4a16", 1, 4096, 4096)
    fused = LS.LinearSm90Variant(warps_m=1, warps_k=8, stages=3, act=LS.Act.FUSED)
    xop = LS.LinearSm90Variant(warps_m=2, warps_k=4, stages=3)
    other = LS.LinearSm90Variant(warps_m=1, warps_k=4, stages=4)
    rows = [{"family": LS.FAMILY.NAME, "workload_digest": plain.digest(), "median_us": t,
             "variant_key": v.key()} for t, v in ((5.0, fused), (6.0, xop))]
    ws = WarmStart("table", "NVIDIA H200", lambda path, gpu: rows)
    assert ws.candidates(LS.FAMILY, w16, ARCH, 4) == [xop]
    assert ws.candidates(LS.FAMILY, plain, ARCH, 4) == [fused, xop]
    rows.append({"family": LS.FAMILY.NAME, "workload_digest": w16.digest(), "median_us": 7.0,
                 "variant_key": other.key()})
    ws = WarmStart("table", "NVIDIA H200", lambda path, gpu: rows)
    assert ws.candidates(LS.FAMILY, w16, ARCH, 4) == [other]


def test_linear_modes_are_the_problem_modes():
    import dataclasses

    from resgen.models import COMPENSATIONS, LINEAR_MODES

    field = {f.name: f for f in dataclasses.fields(LinearProblem)}["compensation"]
    assert set(field.metadata["allowed"]) == set(LINEAR_MODES)
    assert "w4a16" not in COMPENSATIONS       # the shipped table does not cover it yet


def test_the_device_script_tests_tunes_then_benches(tmp_path):
    """bench/w4a16_h200.sh with recording stand-ins for python3 (tests/test_device_scripts):
    the GPU tests, then the W4A16 tune (linear families, warm-started from the shipped
    table), then the bench of plain against W4A16; a failing step fails the call."""
    import subprocess

    from test_device_scripts import _fake_repo

    repo, env = _fake_repo(tmp_path, "bench/w4a16_h200.sh")
    r = subprocess.run(["bash", str(repo / "bench" / "w4a16_h200.sh")], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    calls = (tmp_path / "calls.log").read_text().splitlines()
    steps = [c for c in calls if " -m pytest " in c or " resgen " in c]
    assert len(steps) == 3
    assert "tests/gpu/test_w4a16_gpu.py" in steps[0]
    assert " resgen tune " in steps[1] and "--compensations w4a16" in steps[1] and \
        "--ops linear" in steps[1] and "--warm-start tuned/h200.sqlite.xz" in steps[1]
    assert " resgen bench " in steps[2] and "--compensations none,w4a16" in steps[2]
    env["FAKE_FAIL"] = "resgen bench"
    r = subprocess.run(["bash", str(repo / "bench" / "w4a16_h200.sh")], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 3 and "bench: rc=3" in r.stdout
