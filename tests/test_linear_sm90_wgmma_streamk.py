"""linear_sm90_wgmma's stream-K schedule (persistent CTAs, resgen.kernels.linear_sm90_wgmma_streamk)
on the CPU: the unit partition and fixup slots proved exhaustive and unique, the simulated kernel
against resgen.reference.linear with CTA counts that make tiles shared by two or three CTAs, the
pipeline protocol across segments, the launcher's CTA count and buffers, the variant predicate
(the axis is valid but not enumerated), and compile-only checks of the rendered kernel for
sm_90a."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from resgen import reference as R
from resgen.kernels import linear_sm90_wgmma_layout as W
from resgen.kernels.linear_sm90_wgmma import WgmmaLauncher
from resgen.kernels.linear_sm90_wgmma_sim import (SimulatedKernel, simulate_launch,
                                                  simulate_pipeline)
from resgen.kernels.linear_sm90_wgmma_streamk import StreamKGeometry
from resgen.kernels.sm90_operand import make_xop
from resgen.search.linear_sm90_mma import Packing
from resgen.search.linear_sm90_wgmma import (FAMILY, LinearSm90WgmmaVariant as V, Raster,
                                             geometry_of)
from resgen.search.sm90_linear import Fold
from resgen.search.variant import LinearProblem

from test_linear_sm90_wgmma import _qweight, _ReferenceQuantizer  # noqa: E402

ARCH = "sm_90a"


def _geom(**kw) -> StreamKGeometry:
    base = dict(fmt="nvfp4", mext=False, packing="split", consumers=2, m_wg=1, bn=16, stages=4,
                raster="tok")
    base.update(kw)
    g = StreamKGeometry(**base)
    g.check()
    return g


# ----------------------------------------------------------------------------- partition


@pytest.mark.parametrize("raster", ["tok", "ch"])
def test_units_cover_every_tile_once_and_slots_are_unique(raster):
    """Every chunk pair of every tile belongs to exactly one CTA's segment; cta_of inverts
    unit_start; a shared tile's contributors are consecutive CTAs whose workspace slots never
    collide with another tile's (each CTA uses at most its two)."""
    g = _geom(raster=raster)
    for rows, n, nk in [(16, 128, 8), (40, 256, 6), (17, 384, 24), (64, 128, 2)]:
        units = g.units(rows, n, nk)
        ntt, nct = g.tile_grid(rows, n)
        nq = nk // 2
        for ctas in sorted({1, 2, 3, 5, 7, 13, units - 1, units} - {0}):
            if ctas < 1 or ctas > units:
                continue
            seen = {}
            slots = {}
            for i in range(ctas):
                u0, u1 = g.unit_start(i, units, ctas), g.unit_start(i + 1, units, ctas)
                assert u1 > u0
                for u in range(u0, u1):
                    assert g.cta_of(u, units, ctas) == i
                for tile, q0, q1 in g.segments(i, rows, n, nk, ctas):
                    assert 0 <= q0 < q1 <= nq
                    for q in range(q0, q1):
                        assert (tile, q) not in seen
                        seen[(tile, q)] = i
                    i0, i1 = g.contributors(tile, units, nq, ctas)
                    assert i0 <= i <= i1
                    if i0 != i1:
                        s = g.slot(i, i0)
                        assert s in (2 * i, 2 * i + 1) and s not in slots
                        slots[s] = tile
            assert len(seen) == ntt * nct * nq
            tiles = {g.tile_coords(t, ntt, nct) for t in range(ntt * nct)}
            assert tiles == {(a, b) for a in range(ntt) for b in range(nct)}
            assert g.ctas(rows, n, nk, sms=10 ** 6) == units


def test_geometry_refuses_split_k_and_pdl():
    with pytest.raises(ValueError, match="split_k"):
        _geom(split_k=2)
    with pytest.raises(ValueError, match="PDL"):
        _geom(pdl=True)
    with pytest.raises(ValueError, match="streamk"):
        _geom(streamk=3)
    with pytest.raises(ValueError, match="CTA count"):
        _geom().ws_floats(16, 128)


# ----------------------------------------------------------------------------- simulation


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("comp", ["none", "full", 0.125])
def test_simulated_streamk_kernel_matches_the_reference(fmt, comp):
    """Every output written (NaN-poisoned), within 3e-3 of reference.linear and equal to its
    BF16 rounding but for rare one-ulp summation ties, for CTA counts from one per tile to
    several CTAs sharing each tile."""
    n, k = 256, 512
    qw = _qweight(fmt, n=n, k=k, ratio=None if comp in ("none", "full") else comp)
    mext = comp == "full"
    for packing in ("split", "nib"):
        wt = W.prepare_wgmma_weight(qw, packing)
        for i, (c, mw, bn, ras, m) in enumerate([(2, 1, 16, "tok", 5), (1, 1, 32, "ch", 40),
                                                 (1, 2, 64, "tok", 17), (2, 2, 16, "ch", 1)]):
            g = _geom(fmt=fmt, mext=mext, packing=packing, consumers=c, m_wg=mw, bn=bn,
                      raster=ras)
            rows = 2 * m if mext else m
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(i)) * 3
            xop, ax = make_xop(x, qw, comp, t_multiple=8)
            ref = R.linear(x, qw, comp)
            units = g.units(rows, n, wt.nk)
            for ctas in sorted({1, 3, 7, units}):
                out = simulate_launch(g, wt, xop, m, rows, ax, ctas=min(ctas, units))
                assert not bool(out.isnan().any())
                rel = float((out.double() - ref.double()).norm() / ref.double().norm())
                assert rel <= 3e-3, (packing, g, ctas, rel)
                diff = (out.view(torch.int16).int()
                        - ref.to(torch.bfloat16).view(torch.int16).int())
                assert int(diff.abs().max()) <= 1 and float((diff != 0).float().mean()) < 0.02


@pytest.mark.parametrize("consumers", [1, 2])
@pytest.mark.parametrize("stages", [2, 3, 6])
def test_pipeline_protocol_across_segments(consumers, stages):
    """One ring across the tiles a CTA touches: a segment's first chunk releases nothing and
    its last is released after wait_group 0; no race, no deadlock, every chunk read once."""
    g = _geom(consumers=consumers, stages=stages)
    for segs in ([2], [2, 4], [6, 2, 2], [2, 2, 2, 2, 2], [4, 10]):
        nk = sum(segs)
        for seed in range(4):
            tr = simulate_pipeline(g, nk, seed, segments=segs)
            assert sorted((w, c) for w, c, _ in tr.reads) == \
                [(w, c) for w in range(consumers) for c in range(nk)]
    with pytest.raises(ValueError, match="cover"):
        simulate_pipeline(g, 6, 0, segments=[2, 2])


# ----------------------------------------------------------------------------- plumbing


@pytest.mark.parametrize("comp", ["none", "full"])
def test_runner_passes_the_persistent_cta_count(comp):
    """The family runner end to end on the CPU: the launcher sizes the workspace for
    streamk x SMs CTAs and one semaphore per tile, passes min(units, streamk x SMs) CTAs, and
    the simulated kernel (which checks both) writes the layer within the tolerance."""
    p = LinearProblem("nvfp4", comp, 5, 128, 1024)
    v = V(1, 1, 16, 3, streamk=2)
    assert FAMILY.why_invalid(v, p, ARCH) is None
    geom = geometry_of(v, p)
    assert isinstance(geom, StreamKGeometry) and geom.streamk == 2
    fake = SimulatedKernel(geom)
    r = FAMILY.runner(fake, v, p, "cpu", n_sets=1, seed=2,
                      quantizer=_ReferenceQuantizer("nvfp4", comp, "static"))
    res = r.check()
    assert res.ok, res.detail
    rows = p.rows
    units = geom.units(rows, 128, 1024 // 64)          # 2 channel tiles x 8 pairs (x1 or x1)
    assert fake.calls[-1] == (5, rows, 128, 16, min(units, 2 * 132))
    assert r.launcher.ws.numel() >= geom.ws_floats(rows, 128, 2 * 132)
    assert r.launcher.sem.numel() >= geom.sem_count(rows, 128)
    # a small GPU: fewer CTAs than units, tiles shared (the launcher's sms override)
    qw = _qweight("nvfp4", n=128, k=1024)
    wt = W.prepare_wgmma_weight(qw)
    x = torch.randn(5, 1024)
    xop, ax = make_xop(x, qw, comp, t_multiple=8)
    out = torch.full((5, 128), float("nan"), dtype=torch.bfloat16)
    fake3 = SimulatedKernel(geom)
    WgmmaLauncher(fake3, geom, "cpu", sms=3)(wt, xop, 5, rows, ax, out)
    assert fake3.calls == [(5, rows, 128, 16, 6)]
    ref = R.linear(x, qw, comp)
    assert float((out.double() - ref.double()).norm() / ref.double().norm()) <= 3e-3


def test_streamk_variants_are_valid_but_not_enumerated():
    """Measured slower than the grid schedule everywhere (docs/linear_sm90_wgmma.md): the tuner
    never spends time on them, a caller may still pin one; the axis is keyed only when set."""
    for p in (LinearProblem("nvfp4", "none", 64, 6144, 4096),
              LinearProblem("nvfp4", "full", 128, 24576, 4096),
              LinearProblem("mxfp4", "none", 2048, 4096, 12288)):
        space = FAMILY.space(p, ARCH)
        assert space and not any(v.streamk for v in space)
        for v in space[:20]:
            twin = dataclasses.replace(v, split_k=1, pdl=False, streamk=1)
            assert FAMILY.why_invalid(twin, p, ARCH) is None, twin
    assert "streamk" not in V(2, 1, 64, 6).key() and '"streamk":1' in V(2, 1, 64, 6,
                                                                        streamk=1).key()
    assert V(2, 1, 64, 6, streamk=1).name().endswith("_ps1")


@pytest.mark.parametrize("v, reason", [
    (V(2, 1, 64, 6, split_k=2, streamk=1), "split_k 1 without PDL"),
    (V(2, 1, 64, 6, pdl=True, streamk=1), "split_k 1 without PDL"),
    (V(2, 1, 64, 6, streamk=2), "one consumer warpgroup"),
    (V(1, 1, 64, 12, streamk=2), "113 KB"),
])
def test_why_invalid_streamk(v, reason):
    assert reason in (FAMILY.why_invalid(v, LinearProblem("nvfp4", "none", 128, 4096, 4096),
                                         ARCH) or "")


def test_streamk_is_selected_by_substitution():
    """The template substitutes (STYLE.md 6): every render defines both entries, STREAMK picks
    one; only stream-K renders import the stream-K geometry module (so a grid kernel's
    transitive module digest is what it was before the axis) and construct its geometry."""
    from resgen.kernels import codegen

    p = LinearProblem("nvfp4", "none", 64, 6144, 4096)
    for v, want in ((V(2, 1, 64, 6), False), (V(2, 1, 64, 6, streamk=1), True)):
        src = codegen.render(FAMILY.TEMPLATE, FAMILY.template_params(v, FAMILY.compile_key(v, p)))
        assert "{%" not in src and "def streamk_kernel(" in src and "def entry_streamk(" in src
        assert f"STREAMK = {want}" in src
        assert (", linear_sm90_wgmma_streamk as SKM" in src) == want
        assert ("SKM.StreamKGeometry(" in src) == want and ("G = WgGeometry(" in src) != want
    grid, sk = (codegen.render(FAMILY.TEMPLATE, FAMILY.template_params(v, FAMILY.compile_key(v, p)))
                for v in (V(2, 1, 64, 6), V(2, 1, 64, 6, streamk=1)))
    assert codegen.kernel_modules_digest(grid) != codegen.kernel_modules_digest(sk)


STREAMK_COMPILE_CASES = [
    (LinearProblem("nvfp4", "none", 64, 6144, 4096), V(2, 1, 64, 6, streamk=1)),
    (LinearProblem("nvfp4", "full", 128, 4096, 12288),
     V(1, 1, 64, 4, Raster.CH, Packing.NIB, streamk=2, fold=Fold.PRESUM)),
    (LinearProblem("mxfp4", "full", 64, 24576, 4096), V(2, 2, 64, 4, streamk=1)),
]


@pytest.mark.parametrize("p, v", STREAMK_COMPILE_CASES, ids=lambda x: x.name()
                         if hasattr(x, "name") else f"{x.fmt}-{x.compensation}")
def test_streamk_compiles_for_sm90a(p, v, tmp_path):
    """The persistent kernel: one grid dimension from the CTA count, the main loop's wgmmas,
    the fixup (16-byte partial stores, the tile semaphore, the consumers-only barrier, L2
    reads of the first contributor's slot and of the others' in a loop), no PDL, no spills."""
    from resgen.kernels import codegen

    assert FAMILY.why_invalid(v, p, ARCH) is None
    ck = FAMILY.compile_key(v, p)
    path, _ = codegen.render_to_file(FAMILY.TEMPLATE, FAMILY.template_params(v, ck),
                                     FAMILY.NAME, root=tmp_path)
    res = FAMILY.compile_module(path, v, ck, ARCH)
    ptx = res.ptx
    assert ptx and ".target sm_90a" in ptx
    ab = "f16.f16" if v.presum else "bf16.bf16"
    shape = f"wgmma.mma_async.sync.aligned.m64n{v.bn}k16.f32.{ab}"
    assert ptx.count(shape) == 8 * v.m_wg
    assert "cp.async.bulk.tensor.2d.shared::cta.global" in ptx
    assert "griddepcontrol" not in ptx
    assert "st.global.v4.f32" in ptx and "atom.global.acq_rel.gpu.add.u32" in ptx
    assert re.search(r"bar\.sync\s+1, " + str(128 * v.consumers), ptx)
    assert ptx.count("ld.global.cg.v4.f32") == 2 * v.m_wg * v.bn // 8
    assert ("setmaxnreg" in ptx) == (v.consumers == 2)
    assert "ld.local" not in ptx and "st.local" not in ptx
    assert res.spill_bytes == 0 and res.registers is not None and res.registers <= 255
