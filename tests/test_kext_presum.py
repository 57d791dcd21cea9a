"""K-Ext presum as a workload value (issue 20 section 1: "the same works for K-Ext"), on the
CPU: LinearProblem's `fold` field (keys, validation, the GEMM's K), both Hopper linear families
serving it with presum variants only (space, default, compile keys shared with M-Ext presum),
the torch operand, the runner's check (its own fold's reference, not the exact fold's), the
simulated linear_sm90_wgmma and linear_sm90_mma layers, and resgen.ops.Linear(fold="presum")
through the engine's sim backend. The GPU half: tests/gpu/test_kext_presum_gpu.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from resgen import calibrate as C
from resgen import reference as R
from resgen.kernels import sm90_fp4_layout as L
from resgen.kernels.linear_sm90_wgmma_sim import SimulatedKernel
from resgen.search import linear_sm90_mma as MMA
from resgen.search import linear_sm90_wgmma as WG
from resgen.search.family import get_family
from resgen.search.sm90_linear import (KEXT_PRESUM_ONLY, check_folds, compare, gemm_weight,
                                       kp_of)
from resgen.search.variant import LinearProblem
from test_linear_sm90_mma import simulate_shuffled
from test_linear_sm90_wgmma_presum import _PresumReferenceQuantizer

ARCH = "sm_90a"


def _kext_weight(n: int, k: int, ratio: float, seed: int = 0, static: bool = True
                 ) -> C.QLinearWeight:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.exp(0.5 * torch.randn(n, 1, generator=g))
    st = C.ChannelStats(k)
    st.update(torch.randn(32, k, generator=g) * torch.exp(torch.randn(1, k, generator=g)))
    sel = C.select_channels(st.mean_abs(), ratio)
    isc = torch.tensor(8.0 / 2688) if static else None
    return C.prepare_weight(w, "nvfp4", sel, input_scale=isc)


def _x(m: int, k: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g) * torch.exp(torch.randn(1, k, generator=g))


# ----------------------------------------------------------------------------- the workload


def test_fold_is_keyed_only_when_presum_and_validated():
    exact = LinearProblem("nvfp4", "0.25", 16, 4096, 4096)
    presum = dataclasses.replace(exact, fold="presum")
    assert "fold" not in exact.as_dict() and exact.fold == "exact"
    assert presum.as_dict()["fold"] == "presum" and presum.digest() != exact.digest()
    # keys stored before the field existed parse as the exact fold, and round-trip
    assert LinearProblem.from_key(exact.key()) == exact
    assert LinearProblem.from_key(presum.key()) == presum
    # the GEMM's K: the extension for the exact fold, none for presum
    assert exact.k_ext(16) == 4096 + 1024 and presum.k_ext(16) == 4096
    assert kp_of(presum) == 4096 and presum.rows == 16 and presum.kext_presum
    with pytest.raises(ValueError, match="K-Ext fold"):
        LinearProblem("nvfp4", "full", 16, 4096, 4096, fold="presum")
    with pytest.raises(ValueError, match="K-Ext fold"):
        LinearProblem("nvfp4", "none", 16, 4096, 4096, fold="presum")
    with pytest.raises(ValueError, match="NVFP4 only"):
        LinearProblem("mxfp4", "0.25", 16, 4096, 4096, fold="presum")
    with pytest.raises(ValueError, match="not one of"):
        LinearProblem.from_dict({**exact.as_dict(), "fold": "both"})


def test_gemm_weight_is_the_base_for_kext_presum_only():
    qw = _kext_weight(64, 512, 0.25)
    p = LinearProblem("nvfp4", "0.25", 4, 64, 512, fold="presum")
    base = gemm_weight(qw, p)
    assert base.selection is None and base.in_features == 512
    assert base.q.codes.shape == (64, 256) and torch.equal(base.q.codes, qw.base().codes)
    assert base.input_scale is qw.input_scale
    assert gemm_weight(qw, dataclasses.replace(p, fold="exact")) is qw


# ----------------------------------------------------------------------------- the families


@pytest.mark.parametrize("m", [1, 16, 128, 2048])
def test_both_hopper_families_serve_kext_presum_with_presum_variants_only(m):
    for ratio in ("0.125", "0.5"):
        p = LinearProblem("nvfp4", ratio, m, 4096, 4096, fold="presum")
        for fam in (WG.FAMILY, MMA.FAMILY):
            space = fam.space(p, ARCH)
            assert space and all(v.presum for v in space), fam.NAME
            assert all(fam.why_invalid(v, p, ARCH) is None for v in space)
            d = fam.default(p, ARCH)
            assert d.presum and fam.why_invalid(d, p, ARCH) is None
            exact = dataclasses.replace(d, fold=WG.Fold.EXACT)
            assert fam.why_invalid(exact, p, ARCH) == KEXT_PRESUM_ONLY
            # the exact K-Ext workload keeps its exact-only space (presum is never silent)
            ex = dataclasses.replace(p, fold="exact")
            assert not any(v.presum for v in fam.space(ex, ARCH))
            assert fam.why_invalid(d, ex, ARCH) is not None
            # no fused mma variant (the fused prologue writes the exact BF16 operand)
            if fam is MMA.FAMILY:
                assert not any(v.fused for v in space)
            # the presum GEMM over K is M-Ext presum's kernel: one compile for both
            full = LinearProblem("nvfp4", "full", m, 4096, 4096)
            assert fam.compile_key(d, p) == fam.compile_key(d, full)
            assert fam.quantizer_layout(d, p) == "presum" and fam.gemm_rows(d, p) == m


def test_sm100_refuses_kext_presum():
    fam = get_family("linear_sm100_tc")
    p = LinearProblem("nvfp4", "0.25", 16, 4096, 4096, fold="presum")
    v = fam.default(dataclasses.replace(p, fold="exact"), "sm_100a")
    assert "Hopper fold" in fam.why_invalid(v, p, "sm_100a")


# ----------------------------------------------------------------------------- numerics


@pytest.mark.parametrize("static", [True, False])
@pytest.mark.parametrize("m, ratio", [(3, "0.25"), (40, "0.125")])
def test_simulated_wgmma_kext_presum_layer_is_the_presum_reference(m, ratio, static):
    """A presum variant on a K-Ext presum workload: the base weight in the wgmma layout, the
    quantizer's K-Ext presum rows, the simulated FP16 GEMM over K: the runner's check (the
    GEMM alone on make_presum_xop, then the whole layer) passes against
    reference.linear(ratio, fold="presum")."""
    p = LinearProblem("nvfp4", ratio, m, 128, 512, static_scale=static, fold="presum")
    v = WG.LinearSm90WgmmaVariant(1, 1, 32, 3, WG.Raster.CH, WG.Packing.NIB,
                                  fold=WG.Fold.PRESUM)
    assert WG.FAMILY.why_invalid(v, p, ARCH) is None
    r = WG.FAMILY.runner(SimulatedKernel(WG.geometry_of(v, p), torch.float16), v, p, "cpu")
    assert r.rows == m and not r.exact_too
    qw, wt = r.sets[0][0], r.sets[0][1]
    assert qw.selection is not None and r.masks is not None
    assert wt.kp == 512                          # the base weight: no extension columns
    q = _PresumReferenceQuantizer("static" if static else "dynamic", ratio)
    r.attach_quantizer(q)
    gemm = r.check_gemm()
    assert gemm.ok, gemm.detail
    whole = r.check_quantized()
    assert whole.ok, whole.detail
    assert q.calls == 1


def test_kext_presum_check_is_its_own_fold_and_has_teeth():
    """check_folds for a K-Ext presum workload (exact_too False) passes presum's reference and
    fails the exact fold's output where they differ by more than the tolerance, and plain's."""
    qw = _kext_weight(128, 1024, 0.5, seed=4)
    x = _x(32, 1024, seed=9) * 3
    presum = R.linear(x, qw, 0.5, fold="presum").to(torch.bfloat16)
    assert check_folds(presum, x, qw, 0.5, "presum", exact_too=False).ok
    plain = R.linear(x, qw, "none").to(torch.bfloat16)
    assert not check_folds(plain, x, qw, 0.5, "presum", exact_too=False).ok
    exact = R.linear(x, qw, 0.5).to(torch.bfloat16)
    own = compare(exact, R.linear(x, qw, 0.5, fold="presum"))
    # whichever way this draw falls, the check is against presum's reference alone
    assert check_folds(exact, x, qw, 0.5, "presum", exact_too=False).ok == own.ok


def test_simulated_mma_kext_presum_matches_the_presum_reference():
    """linear_sm90_mma's presum variant on a K-Ext presum workload: the base weight, the torch
    K-Ext presum operand (make_presum_xop), the thread-level simulation with CTAs shuffled."""
    m, n, k, ratio = 5, 64, 1024, "0.25"
    p = LinearProblem("nvfp4", ratio, m, n, k, fold="presum")
    v = MMA.FAMILY.default(p, ARCH)
    qw = _kext_weight(n, k, 0.25, seed=2)
    x = _x(m, k, seed=3) * 3
    geom = MMA.geometry_of(v, p)
    assert not geom.mext
    wt = L.prepare_sm90_weight(gemm_weight(qw, p), v.packing.value)
    xop, ax = MMA.FAMILY.torch_operand(v, x, qw, 0.25, MMA.FAMILY.xop_row_multiple(v, p))
    assert xop.dtype == torch.float16 and xop.shape[1] == k
    out, _ = simulate_shuffled(geom, wt, xop, m, m, ax, n, seed=m)
    res = compare(out, R.linear(x, qw, 0.25, fold="presum"))
    assert res.ok, res.detail


def test_ops_linear_serves_kext_presum_through_the_sim_backend():
    """resgen.ops.Linear(qweight, ratio, fold="presum"): the plan's problem carries the fold,
    its variant is a presum one (the family default: no table row), the quantizer stand-in is
    asked for the "presum" layout with the K-Ext masks, the GEMM's weight is the base part,
    and the layer matches reference.linear(ratio, fold="presum"). A bad fold is refused."""
    from resgen.engine.backend import _empty_dispatcher, _sim_compile, _sim_quantizer
    from resgen.ops import Linear

    qw = _kext_weight(128, 512, 0.25, seed=6)
    layer = Linear(qw, 0.25, fold="presum", device="cpu", family="linear_sm90_wgmma",
                   dispatcher=_empty_dispatcher(), compile_fn=_sim_compile,
                   quantizer_fn=_sim_quantizer)
    x = (torch.randn(7, 512) * 3).to(torch.bfloat16)
    y = layer(x)
    plan = layer.plan(7)
    assert plan.problem.fold == "presum" and plan.variant.presum
    assert plan.run.quantizer.layout == "presum" and plan.run.masks is not None
    assert plan.run.weight.kp == 512
    assert check_folds(y, x.float(), qw, 0.25, "presum", exact_too=False).ok
    with pytest.raises(ValueError, match="K-Ext fold"):
        Linear(qw, "full", fold="presum", device="cpu", compile_fn=_sim_compile,
               quantizer_fn=_sim_quantizer)
    with pytest.raises(ValueError, match="not one of"):
        Linear(qw, 0.25, fold="sum", device="cpu", compile_fn=_sim_compile,
               quantizer_fn=_sim_quantizer)


# ----------------------------------------------------------------------------- planning


def test_tune_and_bench_plan_kext_presum_workloads_on_request():
    """`--kext-folds exact,presum` plans each NVFP4 K-Ext workload twice (MXFP4 K-Ext and the
    other modes once); the default plans the exact fold only; linear_sm100_tc gets no presum
    job; a bad fold is a usage error naming it; the bench labels presum rows apart."""
    from resgen import cli
    from resgen.models import get_models, linear_problems, tuning_workloads

    models = get_models(["qwen3-8b"])
    both = linear_problems(models, 1, ["nvfp4", "mxfp4"], ["none", "full", "0.125"], [16],
                           kext_folds=["exact", "presum"])
    exact = linear_problems(models, 1, ["nvfp4", "mxfp4"], ["none", "full", "0.125"], [16])
    shapes = len(models[0].linear_shapes(1))
    assert len(both) == len(exact) + shapes
    presum = [p for p in both if p.kext_presum]
    assert presum and all(p.fmt == "nvfp4" and p.compensation == "0.125" for p in presum)
    assert not any(p.kext_presum for p in exact)
    with pytest.raises(ValueError, match="K-Ext folds"):
        linear_problems(models, 1, ["nvfp4"], ["0.125"], [16], kext_folds=["sum"])
    kw = dict(formats=["nvfp4"], compensations=["0.125"], m_buckets=[16],
              kext_folds=["exact", "presum"])
    assert any(p.kext_presum for p in tuning_workloads(WG.FAMILY, models, **kw))
    assert not any(p.kext_presum
                   for p in tuning_workloads(get_family("linear_sm100_tc"), models, **kw))
    args = cli.build_parser().parse_args(
        ["tune", "--model", "qwen3-8b", "--kext-folds", "exact,presum", "--plan"])
    assert args.kext_folds == ["exact", "presum"]
    row = {"problem": {"fmt": "nvfp4", "compensation": "0.125", "fold": "presum", "m": 16,
                       "n": 4096, "k": 4096}}
    assert cli._mode(row["problem"]) == "0.125+presum"
    assert cli._mode({"compensation": "0.125"}) == "0.125"


def test_warm_start_offers_the_plain_winners_as_presum_for_kext_presum():
    """A K-Ext presum workload with no rows of its own starts from its plain twin's fastest
    variants as presum twins (its GEMM is the plain one over K), valid for it."""
    from resgen.search.warmstart import WarmStart

    p = LinearProblem("nvfp4", "0.125", 128, 4096, 4096, fold="presum")
    plain = LinearProblem("nvfp4", "none", 128, 4096, 4096)
    pv = [WG.LinearSm90WgmmaVariant(2, 1, 128, 6), WG.LinearSm90WgmmaVariant(2, 1, 64, 4)]
    rows = [{"family": WG.FAMILY.NAME, "workload_digest": plain.digest(), "median_us": t,
             "variant_key": v.key()} for t, v in ((5.0, pv[0]), (6.0, pv[1]))]
    ws = WarmStart("table", "NVIDIA H200", lambda path, gpu: rows)
    got = ws.candidates(WG.FAMILY, p, ARCH, 4)
    assert got == [dataclasses.replace(v, fold=WG.Fold.PRESUM) for v in pv]
    assert all(WG.FAMILY.why_invalid(v, p, ARCH) is None for v in got)
    # the exact K-Ext workload is not offered presum twins
    assert ws.candidates(WG.FAMILY, dataclasses.replace(p, fold="exact"), ARCH, 4) == []


def test_runtime_serves_the_plain_twins_winner_as_presum_on_a_miss(tmp_path):
    """On a table without K-Ext presum rows (the shipped table with them deleted), the
    runtime serves a K-Ext presum workload its plain twin's tuned winner with fold "presum"
    (valid for it, logged once), the default where the twin's winner has no presum form (a
    fused mma variant at M = 1), and never a presum variant to the exact K-Ext workload; on
    the shipped table itself, from M = 16 on, its own tuned presum row."""
    import logging

    class _Keep(logging.Handler):
        def __init__(self) -> None:
            super().__init__(logging.WARNING)
            self.messages: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.messages.append(record.getMessage())

    # on the runtime's own logger, at WARNING: whatever another test did to propagation or
    # levels
    logger = logging.getLogger("resgen.runtime")
    keep, level = _Keep(), logger.level
    logger.addHandler(keep)
    logger.setLevel(logging.WARNING)
    try:
        _twin_checks(keep, tmp_path)
    finally:
        logger.removeHandler(keep)
        logger.setLevel(level)


def _table_without_kext_presum(tmp_path):
    """The shipped table, unpacked, with every K-Ext presum workload and its results
    deleted."""
    import shutil
    import sqlite3
    from pathlib import Path

    from resgen.db.store import unpack_xz
    from resgen.runtime import shipped_table

    src = shipped_table(Path(__file__).resolve().parents[1] / "tuned", "h200")
    out = tmp_path / "no_kext_presum.sqlite"
    shutil.copyfile(unpack_xz(src) if src.suffix == ".xz" else src, out)
    con = sqlite3.connect(out)
    ids = [i for (i,) in con.execute(
        "SELECT id FROM workloads WHERE key LIKE '%\"fold\":\"presum\"%'")]
    assert ids, "the shipped table holds K-Ext presum rows (kext_presum_s35)"
    con.executemany("DELETE FROM results WHERE workload_id = ?", [(i,) for i in ids])
    con.executemany("DELETE FROM workloads WHERE id = ?", [(i,) for i in ids])
    con.commit()
    con.close()
    return src, out


def _twin_checks(keep, tmp_path) -> None:
    from resgen.runtime import Device, Dispatcher

    shipped, stripped = _table_without_kext_presum(tmp_path)
    dev = Device("NVIDIA H200", "sm_90a")
    own = Dispatcher(paths=[shipped], device=dev)
    d = Dispatcher(paths=[stripped], device=dev)
    for m in (16, 128, 2048):
        p = LinearProblem("nvfp4", "0.125", m, 4096, 12288, fold="presum")
        plain = LinearProblem("nvfp4", "none", m, 4096, 12288)
        pv = d.lookup("linear", plain)
        v = d.lookup("linear", p)
        assert v == dataclasses.replace(pv, fold=type(pv.fold)("presum"))
        assert get_family(v.FAMILY).why_invalid(v, p, ARCH) is None
        assert d.source("linear", p).endswith("(plain twin as presum)")
        assert d.served("linear", p)[2] is None                    # no median of its own
        ex = d.lookup("linear", dataclasses.replace(p, fold="exact"))
        assert not getattr(ex, "presum", False)
        # the shipped table: the workload's own tuned row, with its median
        tv, src, med = own.served("linear", p)
        assert tv.presum and "plain twin" not in src and med is not None
    p1 = LinearProblem("nvfp4", "0.125", 1, 4096, 12288, fold="presum")
    v1 = d.lookup("linear", p1)
    assert d.source("linear", p1) == "default" and v1.presum
    assert sum("plain twin's tuned variant as presum" in m for m in keep.messages) == 3
