"""linear_sm90_mma's "presum" fold on the CPU (issue 20 section 1): exact renders unchanged
(byte for byte against main's, and their kernel modules), the fold axis in keys / validity /
space, the FP16 decode and scale bit tricks proved exact, the thread-level simulation against
reference.linear(fold="presum") AND the exact fold, a case only the FP16 rounding explains, the
runner's checks (a kernel that drops the residue fails), and sm_90a compiles."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import lzma
from pathlib import Path

import pytest
import torch

from resgen import calibrate as C
from resgen import formats as F
from resgen import reference as R
from resgen.kernels import codegen
from resgen.kernels import sm90_fp4_layout as L
from resgen.kernels import linear_sm90_mma_presum as PS
from resgen.kernels.linear_sm90_mma_sim import _f16_halves, _f16_mul, _scale, simulate_kernel
from resgen.search.linear_sm90_mma import (FAMILY, PRESUM_MEXT_ONLY, PRESUM_NVFP4_ONLY,
                                           PRESUM_XOP_ONLY, Act, Fold, LinearSm90Variant, Packing,
                                           Pipeline, Reduction, compare, geometry_of)
from resgen.search.variant import LinearProblem
from test_linear_sm90_mma import _record_launcher_pointers, simulate_shuffled
from test_linear_sm90_wgmma_presum import _PresumReferenceQuantizer

ARCH = "sm_90a"
FIXTURE = Path(__file__).parent / "fixtures" / "linear_sm90_mma_renders.json.xz"
PRESUM = dict(fold=Fold.PRESUM)


def _render(v, p) -> str:
    return codegen.render(FAMILY.TEMPLATE, FAMILY.template_params(v, FAMILY.compile_key(v, p)))


# ----------------------------------------------------------------------------- render identity


def test_exact_renders_are_byte_identical_to_main():
    """Every exact variant of the fixture (the winners of every workload of the shipped table
    at main 48c1103, before the presum fold; re-pinned with those pairs at 1213aef by
    scripts/exact_render_fixture.py --pairs-from, after issue 18's renames, one epilogue and
    substitute-only template, and at 67ed6c9, after linear_sm90_mma_presum's change to the
    presum rows (every render byte-identical, only the module digest moved); each time a
    tier-2 refingerprint proved the table's kernels PTX- and host-IR-equal) renders the same
    source today, and the resgen.kernels modules those
    renders import are unchanged: the shipped table's results still describe these kernels
    (what its re-fingerprint relies on)."""
    doc = json.loads(lzma.decompress(FIXTURE.read_bytes()))
    assert doc["family"] == FAMILY.NAME and doc["commit"] == "67ed6c9"
    assert len(doc["renders"]) > 700
    bad, digests = [], set()
    for vk, pk, want in doc["renders"]:
        v, p = FAMILY.VARIANT.from_key(vk), FAMILY.PROBLEM.from_key(pk)
        assert not v.presum and v.key() == vk       # the stored keys parse back unchanged
        src = _render(v, p)
        if hashlib.sha256(src.encode()).hexdigest()[:12] != want:
            bad.append(v.name())
        digests.add(codegen.kernel_modules_digest(src))
    assert not bad, f"{len(bad)} exact renders changed, e.g. {bad[:3]}"
    assert digests == {doc["kernel_modules_digest"]}


def test_presum_render_is_its_own_kernel():
    from resgen.search.build import variant_fingerprint

    p = LinearProblem("nvfp4", "full", 16, 4096, 4096)
    v = LinearSm90Variant(warps_m=1, warps_k=8, n_tiles=4, stages=3)
    ex, pr = _render(v, p), _render(dataclasses.replace(v, **PRESUM), p)
    assert ex != pr
    assert 'PRESUM = "presum" == "presum"' in pr and 'PRESUM = "exact" == "presum"' in ex
    # the substitute-only template imports the presum module in every render (issue 18), so
    # the kernel modules are shared; the renders, hence the fingerprints, differ
    assert "from resgen.kernels import linear_sm90_mma_presum as PS" in pr
    assert codegen.kernel_modules_digest(ex) == codegen.kernel_modules_digest(pr)
    assert variant_fingerprint(FAMILY, v, p, ARCH) != \
        variant_fingerprint(FAMILY, dataclasses.replace(v, **PRESUM), p, ARCH)


# ----------------------------------------------------------------------------- keys and validity


def test_fold_keys_old_keys_parse_as_exact():
    v = LinearSm90Variant()
    d = v.as_dict()
    assert "fold" not in d and "fdexact" not in v.name()
    assert LinearSm90Variant.from_dict(d) == v and LinearSm90Variant.from_dict(d).fold == Fold.EXACT
    assert LinearSm90Variant.from_dict({**d, "fold": "exact"}) == v
    w = dataclasses.replace(v, **PRESUM)
    assert json.loads(w.key())["fold"] == "presum" and w.name().endswith("_fdpresum")
    assert w.key() != v.key() and w.digest() != v.digest()
    assert LinearSm90Variant.from_key(w.key()) == w
    with pytest.raises(ValueError, match="fold"):
        LinearSm90Variant.from_dict({**d, "fold": "sum"})


@pytest.mark.parametrize("p, fields, reason", [
    (LinearProblem("nvfp4", "none", 16, 4096, 4096), {}, PRESUM_MEXT_ONLY),
    (LinearProblem("nvfp4", "w4a16", 16, 4096, 4096), {}, PRESUM_MEXT_ONLY),
    (LinearProblem("nvfp4", "0.125", 16, 4096, 4096), {}, PRESUM_MEXT_ONLY),
    (LinearProblem("mxfp4", "full", 16, 4096, 4096), {}, PRESUM_NVFP4_ONLY),
    (LinearProblem("nvfp4", "full", 1, 4096, 4096), dict(act=Act.FUSED), PRESUM_XOP_ONLY),
])
def test_why_invalid_presum(p, fields, reason):
    v = LinearSm90Variant(warps_m=1, warps_k=8, stages=3, **fields, **PRESUM)
    assert FAMILY.why_invalid(v, p, ARCH) == reason
    assert FAMILY.why_invalid(dataclasses.replace(v, fold=Fold.EXACT), p, ARCH) is None


@pytest.mark.parametrize("m", [1, 16, 64, 128])
def test_space_offers_the_presum_twin_of_every_exact_xop_variant(m):
    p = LinearProblem("nvfp4", "full", m, 6144, 4096)
    space = list(FAMILY.space(p, ARCH))
    exact = [v for v in space if not v.presum]
    presum = [v for v in space if v.presum]
    assert presum and space[:len(exact)] == exact          # the exact indices are unchanged
    assert {dataclasses.replace(v, fold=Fold.EXACT) for v in presum} == \
        {v for v in exact if not v.fused}
    assert all(FAMILY.why_invalid(v, p, ARCH) is None for v in presum)
    for other in (dataclasses.replace(p, fmt="mxfp4"), dataclasses.replace(p, compensation="none")):
        assert not any(v.presum for v in FAMILY.space(other, ARCH))


def test_prior_ranks_presum_by_rows():
    """Unmeasured guess, stated in the prior: ahead of its exact twin from 32 operand rows."""
    v = LinearSm90Variant(warps_m=1, warps_k=8, n_tiles=4, stages=3)
    w = dataclasses.replace(v, **PRESUM)
    big, small = LinearProblem("nvfp4", "full", 16, 4096, 4096), LinearProblem(
        "nvfp4", "full", 2, 4096, 4096)
    assert FAMILY.prior(w, big) < FAMILY.prior(v, big)
    assert FAMILY.prior(w, small) > FAMILY.prior(v, small)


# ----------------------------------------------------------------------------- FP16 bit tricks


def _place(codes, s, packing):
    if packing == "nib":
        return codes << L._NIB_SHIFT[s]
    return ((codes & 7) << L._SPLIT_MAG[s]) | ((codes >> 3) << L._SPLIT_SIGN[s])


@pytest.mark.parametrize("packing", L.PACKINGS)
def test_f16_pair_decode_of_every_code_is_e2m1_times_2_pow_minus_14(packing):
    codes = torch.arange(16, dtype=torch.int64)
    for s in range(8):
        w = _place(codes, s, packing)
        r = PS.F16_DECODERS[packing](w)
        p, half = L._SLOT_ROW[s] + 2 * (L._SLOT_COL[s] // 2), L._SLOT_COL[s] % 2
        vals = _f16_halves(r[p] & 0xFFFFFFFF)[:, half].float()
        assert torch.equal(vals, F.e2m1_values() * 2.0 ** -14)
        assert torch.equal(torch.signbit(vals), torch.signbit(F.e2m1_values()))
        for q in range(4):
            rest = (r[q] & 0xFFFFFFFF) >> (16 * (1 - half)) & 0xFFFF if q == p else \
                r[q] & 0xFFFFFFFF
            assert bool((rest == 0).all()), "a code leaked into another pair or half"


def test_f16_weight_is_exact_for_every_code_and_scale_byte():
    """decode (E2M1 x 2^-14) x S16(b) in mul.rn.f16x2 = E2M1 x s_w x 2^-7 exactly, for every
    code and every scale byte sm90_fp4_layout.scale_bytes can emit (NVFP4: 0 and 9 << 3 .. 143)."""
    codes = torch.arange(16, dtype=torch.int64)
    r0 = PS.decode_split_f16(_place(codes, 0, "split"))[0] & 0xFFFF      # low half of pair 0
    for b in range(144):
        if 0 < b < 8:
            continue                                   # E' >= -9: bytes 1..7 never occur
        sw = torch.tensor([b | (b << 8)], dtype=torch.int64)
        s0, _ = _scale(sw, 0, "nvfp4", PS.PRESUM_SCALE_CONSTS)
        assert int(s0) & 0xFFFF == int(s0) >> 16 and (int(s0) & 0x7C00) != 0x7C00
        got = _f16_halves(_f16_mul(r0, s0.expand(16)))[:, 0].double()
        s_w = 0.0 if b == 0 else 2.0 ** ((b >> 3) - 9) * (1 + (b & 7) / 8)
        if b:
            assert float(_f16_halves(s0)[0, 0]) == s_w * 128
            assert torch.equal(got, F.e2m1_values().double() * s_w * 2.0 ** -7)


def test_presum_b_words_are_the_presum_rows_words():
    """The B load of a presum variant is plain's: the lane's two 16-byte loads of the token's
    presum row, its FP16 words as they are (the quantizer already summed and rounded); the
    geometry's res_off is 0 and anything else is refused."""
    loads = []

    def load(a):
        loads.append(a)
        return tuple(range(a, a + 4))

    assert PS.presum_b_words(load, 100, 0) == list(range(100, 104)) + list(range(116, 120))
    assert loads == [100, 116]
    with pytest.raises(ValueError, match="res_off must be 0"):
        PS.presum_b_words(load, 100, 64)
    p = LinearProblem("nvfp4", "full", 5, 64, 1024)
    g = geometry_of(LinearSm90Variant(warps_m=2, warps_k=2, stages=3, **PRESUM), p)
    assert g.res_off == 0 and g.xop_rows_per_token == 1 and g.xb_row(7) == 7


# ----------------------------------------------------------------------------- simulation


def _layer(n, k, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.exp(torch.randn(n, 1, generator=g))
    return None, C.prepare_weight(w, "nvfp4")


_DI = dict(pipeline=Pipeline.DIRECT, stages=1)
_RG = dict(pipeline=Pipeline.REGS, stages=1)
SIM_CASES = [
    (1, 1024, dict(warps_m=2, warps_k=2, stages=3)),
    (3, 1024, dict(warps_m=1, warps_k=4, packing=Packing.NIB, **_DI, l2_prefetch=1)),
    (16, 1024, dict(warps_m=2, warps_k=1, m_tiles=2, n_tiles=2, **_RG, pdl=True)),
    (20, 1024, dict(warps_m=1, warps_k=2, n_tiles=2, split_k=2, reduce=Reduction.WORKSPACE,
                    stages=2)),
    (9, 1024, dict(warps_m=4, warps_k=1, split_k=2, reduce=Reduction.ATOMIC, **_DI)),
    (5, 1024, dict(warps_m=2, warps_k=1, pipeline=Pipeline.BULK, stages=2)),
    (7, 2560, dict(warps_m=1, warps_k=4, stages=3)),                  # ragged K slices
]


@pytest.mark.parametrize("m, k, fields", SIM_CASES)
def test_presum_simulation_matches_both_references(m, k, fields):
    """The kernel's logic (shared geometry, FP16 decode / sum / MMA, plain epilogue) on fresh
    random activations into a NaN-poisoned output, CTAs shuffled: within the family tolerance
    of reference.linear(fold="presum") and of the exact fold's reference; far from plain."""
    n = 64
    p = LinearProblem("nvfp4", "full", m, n, k)
    v = LinearSm90Variant(**fields, **PRESUM)
    assert FAMILY.why_invalid(v, p, ARCH) is None, FAMILY.why_invalid(v, p, ARCH)
    _, qw = _layer(n, k, seed=11 + m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(100 + m)) * 3
    geom = geometry_of(v, p)
    assert isinstance(geom, PS.PresumGeometry) and not geom.mext
    wt = L.prepare_sm90_weight(qw, v.packing.value)
    xop, ax = FAMILY.torch_operand(v, x, qw, "full", FAMILY.xop_row_multiple(v, p))
    assert xop.dtype == torch.float16 and xop.shape[0] % geom.tok == 0   # the presum rows
    out, ws = simulate_shuffled(geom, wt, xop, m, m, ax, n, seed=m)
    res = compare(out, R.linear(x, qw, "full", fold="presum"))
    assert res.ok, res.detail
    res = compare(out, R.linear(x, qw, "full"))
    assert res.ok, res.detail
    assert not compare(out, R.linear(x, qw, "none")).ok
    if v.reduce == Reduction.ATOMIC:
        assert bool((ws == 0).all())


def test_presum_reads_the_fp16_rows_exactly():
    """The GEMM takes the quantizer's FP16 sums as they are: token 0's operand (1 + 2^-10, -1)
    is exact in FP16 but not in BF16, so on a weight of equal values the kernel gives c 2^-10
    (reading it as BF16 would give 0); token 1 checks an ordinary value. Against the float64
    product of the same operand and the FP16-exact weight."""
    n, k = 64, 256
    qw = C.prepare_weight(torch.ones(n, k), "nvfp4")
    p = LinearProblem("nvfp4", "full", 2, n, k)
    v = LinearSm90Variant(warps_m=4, warps_k=1, **_DI, **PRESUM)
    geom = geometry_of(v, p)
    xop = torch.zeros(geom.tok, L.pad_to(k, 256), dtype=torch.float16)
    xop[0, 0], xop[0, 1] = 1.0 + 2.0 ** -10, -1.0                # token 0
    xop[1, 5] = 1.0 + 2.0 ** -9                                   # token 1
    ax = torch.ones(1)
    wt = L.prepare_sm90_weight(qw, "split")
    out = torch.full((2, n), float("nan"), dtype=torch.bfloat16)
    simulate_kernel(geom, wt, xop, 2, 2, ax, out)
    w16 = F.presum_weight(F.dequantize(qw.q, apply_global_scale=False), "nvfp4").double()
    want = (xop[:2, :k].double() @ w16.T) * float(qw.q.global_scale)
    assert torch.equal(out.float(), want.to(torch.bfloat16).float())
    assert bool((out[0] != 0).all())


# ----------------------------------------------------------------------------- runner


class _SimKernel:
    """A compiled presum variant's stand-in (tests/test_linear_sm90_mma.py's _SimulatedKernel
    idea): maps the launcher's pointers back to tensors and runs the simulation; drop_odd
    zeroes every other token's operand row first (a wrong kernel the checks must catch)."""

    def __init__(self, geom, registry, drop_odd=False):
        self.geom, self.registry, self.drop = geom, registry, drop_odd

    def __call__(self, wp, sp, xp, yp, axp, awp, wsp, semp, mp, m, rows, stream):
        t = {name: self.registry[ptr._pointer] for name, ptr in
             (("w", wp), ("s", sp), ("x", xp), ("y", yp), ("ax", axp), ("aw", awp),
              ("ws", wsp), ("sem", semp))}
        g = self.geom
        assert rows == m, "a presum kernel's rows are the tokens"
        wt = L.Sm90Weight(g.fmt, g.packing, g.n, 0, g.kp, t["w"].view(g.n // 16, g.kq, 32, 4),
                          t["s"].view(g.n // 16, g.ng, g.sl, 8), t["aw"])
        xop = t["x"].view(-1, g.kp)
        if self.drop:
            xop = xop.clone()
            xop[1::2] = 0
        simulate_kernel(g, wt, xop, m, rows, t["ax"], t["y"].view(-1, g.n), ws=t["ws"],
                        sem=t["sem"])


@pytest.mark.parametrize("drop", [False, True])
def test_runner_checks_presum_against_both_folds(drop, monkeypatch):
    registry = _record_launcher_pointers(monkeypatch)
    p = LinearProblem("nvfp4", "full", 5, 64, 1024)
    v = LinearSm90Variant(warps_m=2, warps_k=2, split_k=2, reduce=Reduction.WORKSPACE,
                          stages=2, **PRESUM)
    assert FAMILY.why_invalid(v, p, ARCH) is None
    r = FAMILY.runner(_SimKernel(geometry_of(v, p), registry, drop), v, p, "cpu", n_sets=1)
    assert r.fold == "presum" and r.xop_multiple == 8
    r.attach_quantizer(_PresumReferenceQuantizer("static"))
    res = r.check()
    assert res.ok != drop, res.detail
    if not drop:
        y = r().clone()
        assert bool(y.isfinite().all())


def test_launcher_refuses_rows_that_are_not_tokens():
    from resgen.kernels.linear_sm90_mma import LinearSm90Launcher

    p = LinearProblem("nvfp4", "full", 3, 64, 1024)
    v = LinearSm90Variant(warps_m=2, warps_k=2, stages=3, **PRESUM)
    g = geometry_of(v, p)
    _, qw = _layer(64, 1024, 0)
    wt = L.prepare_sm90_weight(qw, "split")
    xop = torch.zeros(g.tok, 1024, dtype=torch.float16)
    out = torch.zeros(3, 64, dtype=torch.bfloat16)
    la = LinearSm90Launcher(lambda *a: None, g, 4, 1, "cpu")
    with pytest.raises(ValueError, match="rows must be m = 3"):
        la(wt, xop, 3, 6, torch.ones(1), out)
    with pytest.raises(ValueError, match="xop must be float16"):
        la(wt, xop.to(torch.bfloat16), 3, 3, torch.ones(1), out)
    with pytest.raises(ValueError, match=f"hold {g.tok} rows"):
        la(wt, xop[:2], 3, 3, torch.ones(1), out)
    la(wt, xop, 3, 3, torch.ones(1), out)


# ----------------------------------------------------------------------------- sm_90a compiles

COMPILE_CASES = [
    (LinearProblem("nvfp4", "full", 64, 4096, 4096),
     LinearSm90Variant(1, 8, 1, 8, 1, Pipeline.CP_ASYNC, 3, **PRESUM)),
    (LinearProblem("nvfp4", "full", 16, 24576, 4096),
     LinearSm90Variant(4, 2, 1, 2, 1, Pipeline.BULK, 2, pdl=True, **PRESUM)),
    (LinearProblem("nvfp4", "full", 128, 4096, 12288),
     LinearSm90Variant(2, 2, 2, 4, 1, Pipeline.REGS, 1, split_k=2,
                       reduce=Reduction.WORKSPACE, **PRESUM)),
]


@pytest.mark.parametrize("p, v", COMPILE_CASES, ids=lambda x: x.name() if hasattr(x, "name")
                         else f"{x.n}x{x.k}-m{x.m}")
def test_presum_compiles_for_sm90a_without_spills(p, v, tmp_path):
    assert FAMILY.why_invalid(v, p, ARCH) is None
    ck = FAMILY.compile_key(v, p)
    path, _ = codegen.render_to_file(FAMILY.TEMPLATE, FAMILY.template_params(v, ck),
                                     FAMILY.NAME, root=tmp_path)
    res = codegen.compile_entry(getattr(codegen.load_module(path), FAMILY.ENTRY),
                                FAMILY.compile_args(v, ck), ARCH)
    ptx = res.ptx
    assert ptx and ".target sm_90a" in ptx
    n_mma = ptx.count("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32")
    assert n_mma and n_mma % (16 * v.m_tiles * v.n_tiles) == 0
    assert ".bf16.bf16" not in ptx and "mul.rn.bf16x2" not in ptx
    assert "mul.rn.f16x2" in ptx and "ftz" not in ptx
    # no rounding in the GEMM: it reads the quantizer's FP16 sums as they are
    assert "cvt.rn.f16x2.f32" not in ptx
    assert "ld.local" not in ptx and "st.local" not in ptx
    assert res.spill_bytes == 0 and res.registers is not None and res.registers <= 255


# ----------------------------------------------------------------------------- the H200 run


def test_presum_h200_script_runs_tests_then_probe(tmp_path):
    """bench/presum_h200.sh with recording stand-ins for python3 (tests/test_device_scripts):
    the presum GPU tests, the NVFP4 M-Ext covering test, then the probe; a failing step makes
    the exit code non-zero."""
    from test_device_scripts import _fake_repo, run_script

    repo, env = _fake_repo(tmp_path, "bench/presum_h200.sh")
    r = run_script(repo, "bench/presum_h200.sh", env, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    calls = (tmp_path / "calls.log").read_text().splitlines()
    assert len(calls) == 2
    assert "tests/gpu/test_linear_sm90_mma_presum_gpu.py" in calls[0]
    assert "bench/probes/presum_probe.py" in calls[1]
    env["RESGEN_PRESUM_COVER"] = "1"
    (tmp_path / "calls.log").unlink()
    r = run_script(repo, "bench/presum_h200.sh", env, timeout=120)
    calls = (tmp_path / "calls.log").read_text().splitlines()
    assert r.returncode == 0 and len(calls) == 3
    assert "test_linear_sm90_mma_gpu.py" in calls[1] and "nvfp4-full" in calls[1]
    env["FAKE_FAIL"] = "presum_probe"
    r = run_script(repo, "bench/presum_h200.sh", env, timeout=120)
    assert r.returncode == 3


def test_presum_probe_pairs_each_config_with_its_twin(monkeypatch, tmp_path):
    """The probe's plan (CPU): every (M, shape) has the prior's config and, where the table
    has an xop winner, that one, each exact then presum with identical other fields; its
    summary needs all four shapes of both folds."""
    import sys

    sys.path[:0] = [str(Path(__file__).resolve().parent.parent / "bench" / "probes")]
    import presum_probe as PP

    cases = list(PP.cases())
    assert {c[3]["m"] for c in cases} == {1, 16, 64, 128}
    exact = {}
    for p, _, v, e in cases:
        assert FAMILY.why_invalid(v, p, ARCH) is None and v.presum == (e["fold"] == "presum")
        key = (p, e["config"])
        if e["fold"] == "exact":
            exact[key] = v
            continue
        nt = exact[key].n_tiles // (2 if e["pair"] == "half_nt" else 1)
        assert v == dataclasses.replace(exact[key], fold=Fold.PRESUM, n_tiles=nt)
    assert sum(1 for c in cases if c[3]["config"] == "prior" and c[3]["pair"] == "same") == 32
    rows = [{**e, "n": p.n, "k": p.k, "ok": True, "us": 2.0 if e["fold"] == "presum" else 4.0}
            for p, _, _, e in cases]
    s = PP.summary(rows)
    assert {(d["config"], d["m"]) for d in s if d["pair"] == "same"} >= \
        {("prior", m) for m in PP.MS}
    assert all(d["presum_over_exact"] == 0.5 for d in s)
    first = next(i for i, r in enumerate(rows) if r["pair"] == "same" and r["fold"] == "presum")
    rows[first]["ok"] = False
    assert len(PP.summary(rows)) == len(s) - 1


# ----------------------------------------------------------------------------- the runtime


def test_the_runtime_serves_a_presum_row_and_it_is_the_tuned_call(tmp_path, monkeypatch):
    """A presum variant stored as the winner of an M-Ext workload (its key carries the fold)
    is what resgen.ops.Linear dispatches for that bucket, and the served layer gives the
    tuner runner's bits (the quantizer's torch definition in front, the simulation as the
    kernel), within 3e-3 of both folds' references; an exact row of another bucket is served
    exact."""
    import resgen.search.sm90_linear as SL
    from fakefam import make_env
    from test_linear_sm90_wgmma import _ReferenceQuantizer

    from resgen.db import TuningDB
    from resgen.ops import Linear
    from resgen.runtime import Device, Dispatcher
    from resgen.search.build import variant_fingerprint
    from resgen.search.record import ResultRecord, Status

    monkeypatch.setenv("RESGEN_CACHE_DIR", str(tmp_path / "cache"))
    registry = _record_launcher_pointers(monkeypatch)
    n, k = 64, 1024
    v = LinearSm90Variant(warps_m=2, warps_k=2, stages=3, **PRESUM)
    ex = LinearSm90Variant(warps_m=4, warps_k=1, stages=3)
    p4, p16 = (LinearProblem("nvfp4", "full", m, n, k) for m in (4, 16))
    db = tmp_path / "t.sqlite"
    with TuningDB(db) as t:
        for var, p in ((v, p4), (ex, p16)):
            t.record(ResultRecord(
                problem=p, variant=var, environment=make_env("NVIDIA H200", ARCH),
                fingerprint=variant_fingerprint(FAMILY, var, p, ARCH), status=Status.OK,
                median_us=10.0, samples_us=[10.0], space_index=0, policy={"tie_rel": 0.01}))
        stored = {r["variant_key"] for r in t.rows()}
    assert v.key() in stored and '"fold"' in v.key() and '"fold"' not in ex.key()

    def compile_fn(fam, var, p, arch):
        return _SimKernel(geometry_of(var, p), registry)

    def quantizer(problem, arch="sm_90a", layout=None):
        assert layout in (None, "row_pair", "presum")
        if layout == "presum":
            return _PresumReferenceQuantizer("static")
        return _ReferenceQuantizer("nvfp4", "full", "static")

    monkeypatch.setattr(SL, "layer_quantizer", quantizer)
    r = FAMILY.runner(compile_fn(FAMILY, v, p4, ARCH), v, p4, "cpu", n_sets=2, seed=5)
    r.as_layer()
    assert r.check().ok
    r.rotate(1)
    tuned = r().clone()
    qw, xb = r.sets[1][0], r.xbs[1]
    d = Dispatcher(paths=[db], device=Device("NVIDIA H200", ARCH))
    layer = Linear(qw, "full", device="cpu", dispatcher=d, compile_fn=compile_fn,
                   quantizer_fn=quantizer)
    plan = layer.plan(4)
    assert plan.variant == v and plan.variant.presum
    served = layer(xb)
    assert torch.equal(served.view(torch.int16), tuned.view(torch.int16))
    for fold in ("presum", "exact"):
        assert compare(served, R.linear(xb.float(), qw, "full", fold=fold)).ok
    assert layer.plan(16).variant == ex
