"""W4A16 (compensation "w4a16": FP4 weights, BF16 activations never quantized) through the
pipeline on the CPU: the problem and its keys, validity, the compile key and fingerprint (xop
variants: the plain kernel, nothing goes stale; fused variants: the operand "copy" render of
their own, every other render byte-identical), the operand stage (in place or one padding
copy), the fused copy prologue's thread-level simulation and sm_90a compile, the runner's
checks, resgen.ops.Linear / FP4Linear served through the kernels' CPU simulations against
resgen.reference.linear_w4a16, and the CLI. The H200 half is tests/gpu/test_w4a16_gpu.py."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import lzma
import random
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fakefam import isolated_cache  # noqa: E402,F401
from test_linear_sm90_mma import _record_launcher_pointers, _SimulatedKernel  # noqa: E402
from test_linear_sm90_wgmma import _qweight  # noqa: E402

from resgen import reference as R  # noqa: E402
from resgen.kernels import codegen  # noqa: E402
from resgen.kernels import sm90_fp4_layout as L  # noqa: E402
from resgen.kernels import linear_sm90_mma_a16 as A16  # noqa: E402
from resgen.kernels.linear_sm90_mma_sim import simulate_kernel  # noqa: E402
from resgen.kernels.linear_sm90_wgmma_sim import SimulatedKernel  # noqa: E402
from resgen.ops import Linear  # noqa: E402
from resgen.runtime import Device, Dispatcher  # noqa: E402
from resgen.search import linear_sm90_mma as LS  # noqa: E402
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
            for c in ("none", "full", "0.125", "0.25", "0.5", "1.0", "w4a16", "w4a8")}
    assert len(keys) == 8                       # its own DB key
    assert LinearProblem.from_key(p.key()) == p
    with pytest.raises(ValueError, match="compensation"):
        LinearProblem("nvfp4", "w8a8", 3, 128, 512)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("m", [1, 3, 8, 16])
def test_the_w4a16_space_has_the_fused_variants_of_plain(fmt, m):
    """Fused variants are valid for W4A16 under plain's (static scale) rules: the W4A16 space
    is the static plain space, variant for variant, and the prior ranks them as plain's (fused
    first up to 8 rows), except that W4A16's copy prefers no cluster."""
    p = LinearProblem(fmt, "w4a16", m, 4096, 4096)
    plain_p = LinearProblem(fmt, "none", m, 4096, 4096)
    space = LS.FAMILY.space(p, ARCH)
    assert any(v.fused for v in space) and any(not v.fused for v in space)
    assert all(LS.FAMILY.why_invalid(v, p, ARCH) is None for v in space)
    assert space == LS.FAMILY.space(plain_p, ARCH)
    best = min(space, key=lambda v: LS.FAMILY.prior(v, p))
    assert best.fused == (m <= 8)
    for v in space:
        d = LS.FAMILY.prior(v, p) - LS.FAMILY.prior(v, plain_p)
        if not v.fused or m == 1:       # (at one row plain's fused tiles want no cluster)
            assert d == 0.0, v.name()
        else:                           # only the cluster preference differs
            assert abs(abs(d) - 0.3) < 1e-9 or d == 0.0, v.name()
    if m >= 4:      # plain's fused tiles of 4+ rows prefer a cluster of 2, W4A16's none
        fz = [v for v in space if v.fused]
        assert min(fz, key=lambda v: LS.FAMILY.prior(v, p)).cluster == 1
        assert min(fz, key=lambda v: LS.FAMILY.prior(v, plain_p)).cluster == 2


def test_w4a16_fused_validity_follows_plain_rules():
    fused = LS.LinearSm90Variant(warps_m=1, warps_k=8, stages=3, act=LS.Act.FUSED)
    p = LinearProblem("nvfp4", "w4a16", 1, 4096, 4096)
    assert LS.FAMILY.why_invalid(fused, p, ARCH) is None
    # no activation scale: keyed static, and valid even if a caller keys it dynamic
    assert LS.FAMILY.why_invalid(fused, LinearProblem("nvfp4", "w4a16", 1, 4096, 4096,
                                                      False), ARCH) is None
    why = LS.FAMILY.why_invalid(dataclasses.replace(fused, n_tiles=2), p, ARCH)
    assert why is not None and "n8 tiles past" in why
    why = LS.FAMILY.why_invalid(fused, LinearProblem("nvfp4", "w4a16", 1, 4096, 4104), ARCH)
    assert why is not None and "multiple of 16" in why


def test_wgmma_space_is_plain():
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


# ----------------------------------------------------------------------------- fused: the copy

FIXTURE = Path(__file__).parent / "fixtures" / "linear_sm90_mma_renders.json.xz"
_F = dict(act=LS.Act.FUSED)


def _render(v, p) -> str:
    fam = LS.FAMILY
    return codegen.render(fam.TEMPLATE, fam.template_params(v, fam.compile_key(v, p)))


def test_plain_full_and_kext_fused_renders_are_unchanged():
    """No change since the fixture was pinned moved a fused kernel: every fused (and xop)
    winner of the fixture (plain, M-Ext, K-Ext, both formats; scripts/exact_render_fixture.py,
    last re-pinned at 1213aef under a tier-2 refingerprint proof) renders the same bytes and
    imports the same kernel modules (so the table's rows are re-fingerprinted, not re-tuned)."""
    doc = json.loads(lzma.decompress(FIXTURE.read_bytes()))
    comps = set()
    bad = []
    for vk, pk, want in doc["renders"]:
        v, p = LS.FAMILY.VARIANT.from_key(vk), LS.FAMILY.PROBLEM.from_key(pk)
        assert not p.w4a16
        if not v.fused:
            continue
        comps.add("kext" if p.ratio is not None else p.compensation)
        ck = LS.FAMILY.compile_key(v, p)
        assert LS.FAMILY.template_params(v, ck)["operand"] == "quantize"
        src = _render(v, p)
        if hashlib.sha256(src.encode()).hexdigest()[:12] != want:
            bad.append(v.name())
        assert codegen.kernel_modules_digest(src) == doc["kernel_modules_digest"]
    assert comps == {"none", "full", "kext"}
    assert not bad, f"{len(bad)} fused renders changed, e.g. {bad[:3]}"


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_w4a16_fused_is_its_own_kernel_and_key(fmt):
    """A W4A16 fused variant: compile key with compensation "w4a16" and the TOK rows of fused
    keys, its own template parameters, render and fingerprint (the kernel modules are every
    render's); the M buckets sharing a tile share the compile."""
    v = LS.LinearSm90Variant(warps_m=1, warps_k=8, stages=3, pdl=True, **_F)
    for m, tok in ((1, 1), (3, 4), (8, 8)):
        w16, plain = (LinearProblem(fmt, c, m, 4096, 4096) for c in ("w4a16", "none"))
        ck, pk = LS.FAMILY.compile_key(v, w16), LS.FAMILY.compile_key(v, plain)
        assert ck.compensation == "w4a16" and ck.m == tok == pk.m
        assert ck.key() != pk.key() and ck.digest() != pk.digest()
        tw, tp = LS.FAMILY.template_params(v, ck), LS.FAMILY.template_params(v, pk)
        assert tw == {**tp, "operand": "copy"} and tp["operand"] == "quantize"
        src, psrc = _render(v, w16), _render(v, plain)
        assert src != psrc
        assert 'COPY = "copy" == "copy"' in src and 'COPY = "quantize" == "copy"' in psrc
        # the substitute-only template imports linear_sm90_mma_a16 in every render (issue 18):
        # the kernel modules are shared, the renders and fingerprints differ
        assert "from resgen.kernels import linear_sm90_mma_a16 as A16" in src
        assert codegen.kernel_modules_digest(src) == codegen.kernel_modules_digest(psrc)
        assert variant_fingerprint(LS.FAMILY, v, w16, ARCH) != \
            variant_fingerprint(LS.FAMILY, v, plain, ARCH)
        assert isinstance(LS.geometry_of(v, w16), A16.A16Geometry)
        assert not isinstance(LS.geometry_of(v, plain), A16.A16Geometry)
    assert LS.FAMILY.compile_key(v, LinearProblem(fmt, "w4a16", 3, 4096, 4096)) == \
        LS.FAMILY.compile_key(v, LinearProblem(fmt, "w4a16", 4, 4096, 4096))
    # xop variants of W4A16 still render the plain kernel
    x = dataclasses.replace(v, act=LS.Act.XOP)
    assert _render(x, LinearProblem(fmt, "w4a16", 3, 4096, 4096)) == \
        _render(x, LinearProblem(fmt, "none", 3, 4096, 4096))


def test_a16_geometry_refuses_what_it_cannot_copy():
    v = LS.LinearSm90Variant(warps_m=1, warps_k=8, stages=3, **_F)
    g = LS.geometry_of(v, LinearProblem("nvfp4", "none", 1, 4096, 4096))
    A16.a16_geometry(g).check()
    for comp in ("full", "0.125"):          # valid fused geometries W4A16 cannot copy into
        gc = LS.geometry_of(v, LinearProblem("nvfp4", comp, 1, 4096, 4096))
        gc.check()
        with pytest.raises(ValueError, match="residue"):
            A16.a16_geometry(gc).check()
    xop = LS.geometry_of(dataclasses.replace(v, act=LS.Act.XOP),
                         LinearProblem("nvfp4", "none", 1, 4096, 4096))
    with pytest.raises(ValueError, match="fused"):
        A16.a16_geometry(xop).check()


_DI = dict(pipeline=LS.Pipeline.DIRECT, stages=1)
_WS = LS.Reduction.WORKSPACE
# (fmt, K, M, variant fields): M = 1, 3, 5, 8 (TOK 1, 4, 8, 8), clusters of 2 / 4, split-K
# (workspace, atomic), Kp padding (K = 1088: zero columns to Kp = 1280), ragged K slices,
# the four pipelines, PDL
A16_SIM_CASES = [
    ("nvfp4", 4096, 1, dict(warps_m=1, warps_k=8, stages=3, pdl=True)),
    ("mxfp4", 1024, 1, dict(warps_m=2, warps_k=2, **_DI, l2_prefetch=1)),
    ("nvfp4", 1088, 3, dict(warps_m=2, warps_k=4, **_DI, cluster=2)),
    ("mxfp4", 2048, 3, dict(warps_m=2, warps_k=1, split_k=2, reduce=_WS, stages=2,
                            cluster=2)),
    ("nvfp4", 1024, 8, dict(warps_m=1, warps_k=2, stages=3, cluster=4)),
    ("mxfp4", 2048, 8, dict(warps_m=2, warps_k=1, split_k=2, reduce=LS.Reduction.ATOMIC,
                            pipeline=LS.Pipeline.BULK, stages=2, pdl=True)),
    ("nvfp4", 2560, 5, dict(warps_m=1, warps_k=4, stages=3, n_tiles=1)),
    ("mxfp4", 1024, 8, dict(warps_m=4, warps_k=1, pipeline=LS.Pipeline.REGS, stages=1)),
]


def _sim(v, p, qw, x, order_seed=None):
    """The thread-level simulation of v on p (x: bf16 [M, K]; fused: x itself; xop: the
    W4A16 operand) into a NaN-poisoned output, CTAs in a shuffled order."""
    geom = LS.geometry_of(v, p)
    wt = L.prepare_sm90_weight(qw, v.packing.value)
    m = x.shape[0]
    one = torch.ones(1) if p.fmt == "nvfp4" else None
    src = x if v.fused else SL.bf16_operand(x.float(), geom.kp, geom.tok)
    out = torch.full((m, p.n), float("nan"), dtype=torch.bfloat16)
    gx, gy, gz = geom.grid(m)
    order = [(a, b, z) for a in range(gx) for b in range(gy) for z in range(gz)]
    random.Random(order_seed).shuffle(order)
    ws = torch.zeros(max(geom.ws_floats(m, m), 1))
    simulate_kernel(geom, wt, src, m, m, one, out, ws=ws, cta_order=order)
    return out


@pytest.mark.parametrize("fmt, k, m, fields", A16_SIM_CASES)
def test_w4a16_fused_simulation_matches_the_reference(fmt, k, m, fields):
    """The copy prologue's work items and tile addresses (NaN-poisoned shared memory, rows
    past M never written) give reference.linear_w4a16 up to FP32 summation order, and the
    SAME bits as the W4A16 xop twin (same tiles, same summation order) on the zero-padded
    operand; plain W4A4's fused kernel on the same inputs is far off."""
    n = 64
    p = LinearProblem(fmt, "w4a16", m, n, k)
    v = LS.LinearSm90Variant(**fields, **_F)
    assert LS.FAMILY.why_invalid(v, p, ARCH) is None, LS.FAMILY.why_invalid(v, p, ARCH)
    qw = _qweight(fmt, n=n, k=k, seed=m)
    x = (torch.randn(m, k, generator=torch.Generator().manual_seed(k + m)) * 3
         ).to(torch.bfloat16)
    ref = R.linear_w4a16(x.float(), qw)
    y = _sim(v, p, qw, x, order_seed=m)
    assert not bool(y.isnan().any())
    res = SL.compare(y, ref)
    assert res.ok, res.detail
    yx = _sim(dataclasses.replace(v, act=LS.Act.XOP, cluster=1), p, qw, x, order_seed=1)
    if v.reduce != LS.Reduction.ATOMIC:
        assert torch.equal(y.view(torch.int16), yx.view(torch.int16))
    plain = _sim(v, dataclasses.replace(p, compensation="none"), qw, x, order_seed=m) \
        if fmt == "mxfp4" else None
    if plain is not None:       # (NVFP4 plain fused needs a static scale this weight lacks)
        assert _rel(plain, ref) > 20 * TOL


def test_the_fused_w4a16_check_catches_a_quantizing_prologue(monkeypatch):
    """The runner's check of a fused W4A16 variant compares with linear_w4a16: the same
    variant's plain (quantizing) prologue behind the W4A16 launch path fails it."""
    from resgen.kernels import linear_sm90_mma_sim as LSS

    registry = _record_launcher_pointers(monkeypatch)
    p = LinearProblem("mxfp4", "w4a16", 3, 64, 1024)
    v = LS.LinearSm90Variant(warps_m=2, warps_k=2, stages=2, **_F)
    good = LS.FAMILY.runner(_SimulatedKernel(LS.geometry_of(v, p), registry), v, p, "cpu")
    assert good.check().ok
    plain_geom = LS.geometry_of(v, dataclasses.replace(p, compensation="none"))
    assert not hasattr(plain_geom, "operand") and hasattr(LS.geometry_of(v, p), "operand")
    orig = LSS.simulate_kernel

    def quantizing(geom, *a, **kw):
        return orig(plain_geom, *a, **kw)

    monkeypatch.setattr(sys.modules["test_linear_sm90_mma"], "simulate_kernel", quantizing)
    bad = LS.FAMILY.runner(_SimulatedKernel(LS.geometry_of(v, p), registry), v, p, "cpu")
    res = bad.check()
    assert not res.ok and res.rel_err > 10 * TOL


def test_runner_checks_and_times_the_fused_w4a16_layer(monkeypatch):
    """Fused W4A16: bound at once (one launch, no quantizer, no stage), checked against
    linear_w4a16, every input set's timed call equal to the reference, gemm_only the same
    launch on the same activations."""
    registry = _record_launcher_pointers(monkeypatch)
    p = LinearProblem("nvfp4", "w4a16", 3, 64, 1024)
    v = LS.LinearSm90Variant(warps_m=2, warps_k=2, split_k=2, reduce=LS.Reduction.WORKSPACE,
                             stages=2, cluster=2, **_F)
    fake = _SimulatedKernel(LS.geometry_of(v, p), registry)
    LS.FAMILY.warm(v, p)
    r = LS.FAMILY.runner(fake, v, p, "cpu", n_sets=2, seed=0)
    assert r.fused and r.bindings is not None
    assert all(b.stage is None and b.quantizer is None for b in r.bindings)
    assert float(r.bindings[0].alpha) == 1.0
    res = r.check()
    assert res.ok, res.detail
    for i in (1, 0):
        r.rotate(i)
        y = r().clone()
        assert _rel(y, R.linear_w4a16(r.xbs[i].float(), r.sets[i][0])) <= TOL
    yg = r.gemm_only()().clone()
    assert torch.equal(yg, y)
    with pytest.raises(ValueError, match="no quantizer"):
        r.attach_quantizer(object())
    with pytest.raises(ValueError, match="masks"):
        LS.FAMILY.bind(fake, v, p, r.sets[0][1], "cpu", masks=torch.zeros(128, dtype=torch.uint8))


@pytest.mark.parametrize("p, fields", [
    (LinearProblem("nvfp4", "w4a16", 1, 4096, 4096),
     dict(warps_m=1, warps_k=8, stages=3, pdl=True)),
    (LinearProblem("mxfp4", "w4a16", 8, 6144, 4096),
     dict(warps_m=2, warps_k=2, m_tiles=2, pipeline=LS.Pipeline.BULK, stages=3, cluster=2)),
])
def test_w4a16_fused_compiles_for_sm90a_without_quantizing(p, fields, tmp_path):
    """sm_90a PTX of the copy prologue: the MMA main loop, shared-memory (cluster:
    distributed) stores of the operand tile, no spills, and none of the quantizer's
    arithmetic (the block amax) that the plain twin's PTX has."""
    v = LS.LinearSm90Variant(**fields, **_F)
    assert LS.FAMILY.why_invalid(v, p, ARCH) is None
    ptxs = []
    for q in (p, dataclasses.replace(p, compensation="none")):
        ck = LS.FAMILY.compile_key(v, q)
        path, _ = codegen.render_to_file(LS.FAMILY.TEMPLATE, LS.FAMILY.template_params(v, ck),
                                         LS.FAMILY.NAME, root=tmp_path)
        mod = codegen.load_module(path)
        res = codegen.compile_entry(getattr(mod, LS.FAMILY.ENTRY),
                                    LS.FAMILY.compile_args(v, ck), ARCH)
        assert res.ptx and ".target sm_90a" in res.ptx
        assert not res.spill_bytes
        ptxs.append(res.ptx)
    a16, plain = ptxs
    assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in a16
    store = "st.shared::cluster.v4" if v.cluster > 1 else "st.shared.v4"
    assert store in a16
    for op in ("abs.f32", "max.f32"):
        assert op in plain and op not in a16, op


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


@pytest.mark.parametrize("fmt, m", [("nvfp4", 1), ("mxfp4", 3)])
def test_pinned_fused_variant_serves_w4a16_in_one_launch(fmt, m, monkeypatch):
    """resgen.ops.Linear with a fused variant: the layer is the kernel alone on the caller's
    activations (no operand stage, no quantizer), compiled for the W4A16 copy."""
    registry = _record_launcher_pointers(monkeypatch)
    qw = _qweight(fmt, n=64, k=1024)
    v = LS.LinearSm90Variant(warps_m=4, warps_k=1, stages=3, act=LS.Act.FUSED)
    compiles = _Compiles(registry)
    layer = Linear(qw, "w4a16", device="cpu", variant=v, compile_fn=compiles,
                   quantizer_fn=_no_quantizer)
    x = (torch.randn(m, 1024, generator=torch.Generator().manual_seed(m)) * 2
         ).to(torch.bfloat16)
    y = layer(x)
    ref = R.linear_w4a16(x.float(), qw)
    assert not bool(y.isnan().any()) and _rel(y, ref) <= TOL
    assert _rel(R.linear(x.float(), qw, "none"), ref) > 20 * TOL
    plan = layer.plan(m)
    assert plan.run.fused and plan.run.stage is None and plan.run.quantizer is None
    ck = compiles.keys[0]
    assert ck.compensation == "w4a16" and ck.m == LS.tok_rows_of(v, plan.problem)


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
    """No rows for the W4A16 workload: its plain twin's winners are the hint (xop and fused:
    a fused one serves W4A16 with the copy prologue); a workload with rows of its own keeps
    them."""
    from resgen.search.warmstart import WarmStart

    plain = LinearProblem("nvfp4", "none", 1, 4096, 4096)
    w16 = LinearProblem("nvfp4", "w4a16", 1, 4096, 4096)
    fused = LS.LinearSm90Variant(warps_m=1, warps_k=8, stages=3, act=LS.Act.FUSED)
    xop = LS.LinearSm90Variant(warps_m=2, warps_k=4, stages=3)
    other = LS.LinearSm90Variant(warps_m=1, warps_k=4, stages=4)
    rows = [{"family": LS.FAMILY.NAME, "workload_digest": plain.digest(), "median_us": t,
             "variant_key": v.key()} for t, v in ((5.0, fused), (6.0, xop))]
    ws = WarmStart("table", "NVIDIA H200", lambda path, gpu: rows)
    assert ws.candidates(LS.FAMILY, w16, ARCH, 4) == [fused, xop]
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
    from test_device_scripts import _fake_repo, run_script

    repo, env = _fake_repo(tmp_path, "bench/w4a16_h200.sh")
    r = run_script(repo, "bench/w4a16_h200.sh", env, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    calls = (tmp_path / "calls.log").read_text().splitlines()
    steps = [c for c in calls if " -m pytest " in c or " resgen " in c]
    assert len(steps) == 3
    assert "tests/gpu/test_w4a16_gpu.py" in steps[0]
    assert " resgen tune " in steps[1] and "--compensations w4a16" in steps[1] and \
        "--ops linear" in steps[1] and "--warm-start tuned/h200.sqlite.xz" in steps[1]
    assert " resgen bench " in steps[2] and "--compensations none,w4a16" in steps[2]
    env["FAKE_FAIL"] = "resgen bench"
    r = run_script(repo, "bench/w4a16_h200.sh", env, timeout=120)
    assert r.returncode == 3 and "bench_w4a16: rc=3" in r.stdout
