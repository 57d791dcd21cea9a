"""linear_sm100_tc on the CPU (there is no Blackwell GPU): the sm_100a layouts and TMEM fragment
maps against CuTe DSL's own layouts, the fold plans of every TMEM load shape, the variant /
validity / space tables, the thread-level simulation bit for bit against resgen.reference, the
runner on the simulation, the runtime's sm_100a lookup with a faked B200 device, and the
analytical latency model. Compiles: tests/test_sm100_compile.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from resgen import calibrate as C
from resgen import reference as R
from resgen.kernels import linear_sm100_tc as LK
from resgen.kernels.linear_sm100_tc_geom import FoldPlanError, Sm100Geometry
from resgen.kernels.linear_sm100_tc_sim import simulate_kernel, traits_frag
from resgen.kernels.sm100_layout import (act_row, act_rows, sf_offset, sf_row, tmem_frag,
                                         tmem_span, token_of_row)
from resgen.kernels.sm100_operand import make_operand, pack_sf, unpack_sf
from resgen.search.family import get_family
from resgen.search.linear_sm100_tc import (FAMILY, LinearSm100Variant, Reduction, RowLayout,
                                           Store, TmemShape, geometry_of, kp_of)
from resgen.kernels.linear_sm100_tc_model import (FIG4A_M, PAPER_FIG4A, B200,
                                                  fig4a_geometry, fit_fig4a, max_stages,
                                                  predict)
from resgen.search.variant import LinearProblem

ARCH = "sm_100a"
V = LinearSm100Variant
P = LinearProblem


def _layer(fmt, comp, n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.exp(0.5 * torch.randn(n, 1, generator=g))
    sel = None
    if comp not in ("none", "full"):
        st = C.ChannelStats(k)
        st.update(torch.randn(64, k, generator=g))
        sel = C.select_channels(st.mean_abs(), float(comp))
    isc = torch.tensor(4.0 / (6 * 448)) if fmt == "nvfp4" else None
    return C.prepare_weight(w, fmt, sel, input_scale=isc)


def _comp(comp):
    return comp if comp in ("none", "full") else float(comp)


# ----------------------------------------------------------------------------- layouts


def test_sf_offset_is_cutlass_tile_atom_to_shape_sf():
    """The scale-factor address every sm_100a writer uses equals the layout CuTe DSL builds for
    tcgen05 block-scaled MMA (evaluated at trace time, no GPU), NVFP4 and MXFP4 blocks."""
    import cutlass
    import cutlass.cute as cute
    import cutlass.utils.blockscaled_layout as bsl

    got = []

    @cute.jit
    def trace():
        for rows, kp, vec in ((256, 512, 16), (384, 768, 32)):
            lay = bsl.tile_atom_to_shape_SF((rows, kp, 1), vec)
            for r in cutlass.range_constexpr(0, rows, 5):
                for b in cutlass.range_constexpr(0, kp // vec, 3):
                    got.append((kp // vec, r, b, int(cute.crd2idx((r, b * vec, 0), lay))))

    cute.compile(trace, options=f"--gpu-arch {ARCH}")
    assert len(got) > 1000
    for cols, r, b, want in got:
        assert sf_offset(r, b, cols) == want, (cols, r, b)


@pytest.mark.parametrize("shape", ["32x32b", "16x256b", "16x128b"])
def test_tmem_frag_is_cute_dsl_tmem_copy_partition(shape):
    """Which accumulator element lands in which register of which thread: the closed form the
    template and the fold plan use equals CuTe DSL's own tcgen05 TMEM-load partition (every
    thread of the 4 epilogue warps) and the map evaluated from CUTLASS's traits."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.nvgpu import tcgen05

    reps = {"32x32b": (2, 8), "16x256b": (1, 2), "16x128b": (2, 4)}[shape]
    ops = {"32x32b": tcgen05.Ld32x32bOp, "16x256b": tcgen05.Ld16x256bOp,
           "16x128b": tcgen05.Ld16x128bOp}[shape]
    got = []

    @cute.jit
    def trace():
        n = 32
        ptr = cute.make_ptr(cutlass.Float32, 0, cute.AddressSpace.tmem, assumed_align=16)
        mma = cute.make_tiled_mma(tcgen05.MmaMXF4NVF4Op(
            cutlass.Float8E4M3FN, (128, n, 64), tcgen05.CtaGroup.ONE,
            tcgen05.OperandSource.SMEM))
        acc = cute.make_tensor(ptr, mma.make_fragment_C(mma.partition_shape_C((128, n))).layout)
        ident = cute.make_identity_tensor((128, n))
        for rep in reps:
            op = ops(getattr(tcgen05.Repetition, f"x{rep}"))
            tc = tcgen05.make_tmem_copy(cute.make_copy_atom(op, cutlass.Float32),
                                        acc[((None, None), 0, 0)])
            for t in cutlass.range_constexpr(0, 128, 3):
                c = tc.get_slice(t).partition_D(ident)
                got.append((rep, t, [tuple(int(x) for x in c[i]) for i in range(cute.size(c))]))

    cute.compile(trace, options=f"--gpu-arch {ARCH}")
    assert got
    for rep, t, coords in got:
        lanes, cols, nreg = tmem_span(shape, rep)
        fr = traits_frag(shape, rep)
        expect = set()
        for lane0 in range(0, 32, lanes):           # CuTe tiles the warp's 32 lanes x 32 cols
            for col0 in range(0, 32, cols):
                for r in range(nreg):
                    dl, dc = tmem_frag(shape, t % 32, r)
                    assert fr[t % 32][r] == (dl, dc)
                    expect.add((32 * (t // 32) + lane0 + dl, col0 + dc))
        assert set(coords) == expect, (shape, rep, t)


def test_act_rows_layouts_and_sf_packing_round_trip():
    for lay in ("row_pair", "tile8"):
        rows = act_rows(11, lay)
        seen = set()
        for t in range(11):
            for res in (False, True):
                r = act_row(t, res, lay)
                assert token_of_row(r, lay) == (t, int(res)) and r < rows
                seen.add(r)
        assert len(seen) == 22
    g = torch.Generator().manual_seed(0)
    for tile in (8, 32, 128):
        sf = torch.randint(1, 255, (20, 12), generator=g, dtype=torch.uint8)
        flat = pack_sf(sf, tile)
        assert torch.equal(unpack_sf(flat, 20, 12, tile), sf)
        assert int((flat != 0).sum()) == sf.numel()        # padding stays zero
    # tile padding: tile z's rows start at SF row 128 z
    assert [sf_row(r, 8) for r in (0, 7, 8, 17)] == [0, 7, 128, 257]


def test_weight_layout_holds_every_code_and_scale():
    qw = _layer("nvfp4", "0.25", 200, 512)
    wt = LK.prepare_sm100_weight(qw)
    assert wt.codes.shape == (256, 768 // 2) and wt.kp == 768
    assert torch.equal(wt.codes[:200, : qw.q.codes.shape[1]], qw.q.codes)
    assert int(wt.codes[200:].abs().sum()) == 0
    sf = unpack_sf(wt.sf, 256, 48, 128)
    assert torch.equal(sf[:200, : qw.q.scales.shape[1]], qw.q.scales.view(torch.uint8))


# ----------------------------------------------------------------------------- fold plans


def _geo(**kw):
    d = dict(fmt="nvfp4", mode="mext", layout="row_pair", swap=True, n=256, kp=512,
             tile_m=128, tile_n=32, tile_k=256, cta_group=1, cluster_m=1, cluster_n=1,
             stages=2, tmem_shape="32x32b", tmem_rep=8, store="direct", split_k=1,
             reduce="none")
    d.update(kw)
    return Sm100Geometry(**d)


# (swap, layout, shape, rep) -> thread-local pairs exist
FOLD_TABLE = [
    (True, "row_pair", "32x32b", 2, True), (True, "row_pair", "32x32b", 1, False),
    (True, "row_pair", "16x256b", 1, True), (True, "row_pair", "16x128b", 4, False),
    (True, "tile8", "32x32b", 16, True), (True, "tile8", "32x32b", 8, False),
    (True, "tile8", "16x256b", 2, True), (True, "tile8", "16x256b", 1, False),
    (True, "tile8", "16x128b", 4, True), (True, "tile8", "16x128b", 2, False),
    (False, "tile8", "16x256b", 2, True), (False, "tile8", "16x128b", 4, True),
    (False, "tile8", "32x32b", 8, False), (False, "row_pair", "16x256b", 2, False),
    (False, "row_pair", "32x32b", 8, False),
]


@pytest.mark.parametrize("swap, layout, shape, rep, ok", FOLD_TABLE)
def test_fold_plan_pairs_base_and_residue_in_one_thread(swap, layout, shape, rep, ok):
    """The paper's Fig. 5: which activation row layout and TMEM load shape keep each base and
    residue accumulator in the same thread's registers. A plan exists exactly then, and then
    every thread of every sub-partition folds each output once from its own registers."""
    g = _geo(swap=swap, layout=layout, tmem_shape=shape, tmem_rep=rep,
             tile_n=32 if swap else 128)
    if not ok:
        with pytest.raises(FoldPlanError):
            g.ld_plan()
        return
    plan = g.ld_plan()
    outs = []
    for q in range(4):
        for t in range(32):
            for ins in plan:
                for rb, rr in ins.pairs:
                    bl, bc = tmem_frag(shape, t, rb)
                    rl, rc = tmem_frag(shape, t, rr)
                    b = g.out_coord(32 * q + ins.lane + bl, ins.col + bc)
                    r = g.out_coord(32 * q + ins.lane + rl, ins.col + rc)
                    assert b[:2] == r[:2] and (b[2], r[2]) == (0, 1)
                    outs.append(b[:2])
    assert len(outs) == len(set(outs)) == g.tokens_per_tile * g.channels_per_cta


# ----------------------------------------------------------------------------- variants


def test_family_is_registered_for_sm100a_only():
    assert get_family("linear_sm100_tc") is FAMILY
    assert FAMILY.ARCHS == ("sm_100a",)
    p = P("nvfp4", "none", 1, 4096, 4096)
    assert "sm_100a" in FAMILY.why_invalid(FAMILY.default(p, ARCH), p, "sm_90a")


def test_variant_key_changes_with_every_field():
    base = V()
    alts = dict(tile_m=256, tile_n=16, tile_k=128, cluster_m=2, cluster_n=2, stages=3,
                swap=False, layout=RowLayout.TILE8, tmem_shape=TmemShape.S16X128B,
                tmem_rep=4, store=Store.TMA, split_k=2, reduce=Reduction.ATOMIC)
    assert set(alts) == {f.name for f in dataclasses.fields(V)}
    keys = {base.key()}
    for name, val in alts.items():
        v = dataclasses.replace(base, **{name: val})
        assert v.key() not in keys and V.from_key(v.key()) == v
        keys.add(v.key())


@pytest.mark.parametrize("d", [
    {"tile_n": 24}, {"tile_m": 192}, {"tile_k": 64}, {"tmem_rep": 3}, {"layout": "pairs"},
    {"tmem_shape": "16x64b"}, {"store": "smem"}, {"swap": 1}, {"split_k": 0},
])
def test_variant_from_dict_rejects_bad_values(d):
    raw = dict(V().as_dict())
    raw.update(d)
    with pytest.raises(ValueError):
        V.from_dict(raw)


PM = P("nvfp4", "full", 4, 4096, 4096)
PN = P("nvfp4", "none", 1, 4096, 4096)


@pytest.mark.parametrize("v, p, reason", [
    (V(layout=RowLayout.PLAIN), PM, "row_pair or tile8"),
    (V(layout=RowLayout.ROW_PAIR), PN, "is for M-Ext"),
    (V(tile_m=256, cluster_m=2, tile_n=8), PN, "tile_n >= 16"),
    (V(swap=False, tile_n=64), PN, "channel tile of 128 or 256"),
    (V(layout=RowLayout.TILE8, tile_n=8), PM, "groups of 16"),
    (V(tile_m=256, cluster_m=1, tile_n=16), PN, "multiple of 2"),
    (V(cluster_m=4, cluster_n=8), PN, "at most 16"),
    (V(split_k=3, reduce=Reduction.WORKSPACE), PN, "do not split evenly"),
    (V(split_k=2), PN, "needs reduce"),
    (V(reduce=Reduction.ATOMIC), PN, "without split_k"),
    (V(split_k=2, reduce=Reduction.WORKSPACE, store=Store.TMA), PN, "store tma"),
    (V(stages=6), P("nvfp4", "none", 1, 4096, 1024), "K tiles per CTA"),
    (V(tmem_shape=TmemShape.S16X256B, tmem_rep=64), PN, "at most 128"),
    (V(tmem_rep=16), PN, "accumulator tile has 8"),
    (V(layout=RowLayout.ROW_PAIR, tmem_shape=TmemShape.S16X128B, tmem_rep=2), PM,
     "not in the same thread"),
    (V(tile_n=256, tmem_rep=32, stages=9, layout=RowLayout.ROW_PAIR),
     P("nvfp4", "full", 128, 4096, 4096), "shared memory"),
    (V(store=Store.TMA, tile_m=128), P("nvfp4", "none", 1, 4096 + 64, 4096), "channel tiles"),
    (V(), P("nvfp4", "none", 1, 4100, 4096), "multiple of 8"),
    (V(swap=False, tile_n=256, tmem_shape=TmemShape.S16X128B, tmem_rep=16, split_k=2,
       reduce=Reduction.ATOMIC), P("mxfp4", "0.5", 64, 6144, 4096), "spill"),
])
def test_why_invalid_gives_reasons(v, p, reason):
    why = FAMILY.why_invalid(v, p, ARCH)
    assert why is not None and reason in why, why


def test_tmem_columns_bound_the_tile():
    g = _geo(mode="plain", layout="plain", tile_n=256, tmem_rep=32)
    assert g.tmem_alloc == 512 and g.tmem_acc_cols + g.tmem_sf_cols == 256 + 16 + 32


PROBLEMS = [P("nvfp4", "none", 1, 4096, 4096), P("nvfp4", "full", 1, 24576, 4096),
            P("mxfp4", "full", 16, 4096, 12288), P("nvfp4", "0.125", 64, 6144, 4096),
            P("mxfp4", "none", 300, 4096, 4096)]


@pytest.mark.parametrize("p", PROBLEMS, ids=lambda p: f"{p.fmt}-{p.compensation}-m{p.m}")
def test_space_is_valid_deterministic_and_holds_the_default(p):
    sp = FAMILY.space(p, ARCH)
    assert sp and sp == FAMILY.space(p, ARCH) and len(set(sp)) == len(sp)
    assert FAMILY.default(p, ARCH) in sp
    for v in sp:
        assert FAMILY.why_invalid(v, p, ARCH) is None, v.name()


def test_space_covers_every_axis():
    """Across the decode and prefill problems every value of every searched axis appears."""
    seen: dict[str, set] = {f.name: set() for f in dataclasses.fields(V)}
    for p in PROBLEMS:
        for v in FAMILY.space(p, ARCH):
            for f in dataclasses.fields(V):
                seen[f.name].add(getattr(v, f.name))
    assert seen["tile_m"] == {128, 256} and seen["swap"] == {True, False}
    assert seen["layout"] == set(RowLayout) and seen["tmem_shape"] == set(TmemShape)
    assert seen["store"] == set(Store) and seen["reduce"] == set(Reduction)
    assert {8, 16, 32, 64, 128, 256} <= seen["tile_n"] and {1, 2, 4} <= seen["split_k"]


def test_compile_key_drops_m_and_the_scale_source():
    v = FAMILY.default(PM, ARCH)
    ck = FAMILY.compile_key(v, dataclasses.replace(PM, m=7, static_scale=False))
    assert ck == dataclasses.replace(PM, m=1)


def test_template_params_are_the_geometry():
    v = V(tile_n=16, layout=RowLayout.TILE8, tmem_shape=TmemShape.S16X256B, tmem_rep=2)
    tp = FAMILY.template_params(v, PM)
    assert Sm100Geometry(**tp) == geometry_of(v, PM)
    assert tp["kp"] == kp_of(PM) == 4096


# ----------------------------------------------------------------------------- simulation

SIM_CASES = [
    # (fmt, comp, m, n, k, variant fields): every TMEM load shape, both row layouts and
    # orientations, plain / M-Ext / K-Ext, 1-SM and 2-SM, both store paths
    ("nvfp4", "none", 3, 256, 512, {}),
    ("nvfp4", "full", 3, 256, 512, dict(layout=RowLayout.ROW_PAIR)),
    ("mxfp4", "full", 3, 256, 512, dict(layout=RowLayout.ROW_PAIR, tmem_rep=2)),
    ("nvfp4", "full", 5, 256, 512, dict(layout=RowLayout.ROW_PAIR, tile_n=16,
                                        tmem_shape=TmemShape.S16X256B, tmem_rep=1)),
    ("mxfp4", "full", 5, 256, 512, dict(layout=RowLayout.TILE8, tile_n=16,
                                        tmem_shape=TmemShape.S16X256B, tmem_rep=2)),
    ("nvfp4", "full", 9, 256, 512, dict(layout=RowLayout.TILE8, tile_n=32,
                                        tmem_shape=TmemShape.S16X128B, tmem_rep=4)),
    ("nvfp4", "full", 9, 256, 512, dict(layout=RowLayout.TILE8, tile_n=32, tmem_rep=16)),
    ("nvfp4", "none", 20, 128, 512, dict(tile_n=16, tmem_shape=TmemShape.S16X128B,
                                         tmem_rep=2)),
    ("nvfp4", "0.25", 3, 256, 512, dict(tmem_rep=8)),
    ("mxfp4", "0.5", 30, 256, 512, dict(tile_n=32, tmem_shape=TmemShape.S16X256B,
                                        tmem_rep=4)),
    ("nvfp4", "full", 40, 256, 512, dict(swap=False, tile_n=128, layout=RowLayout.TILE8,
                                         tmem_shape=TmemShape.S16X256B, tmem_rep=4)),
    ("mxfp4", "none", 150, 256, 512, dict(swap=False, tile_n=128, tmem_rep=32)),
    ("nvfp4", "full", 5, 384, 512, dict(tile_m=256, cluster_m=2, tile_n=16,
                                        layout=RowLayout.ROW_PAIR, tmem_rep=16)),
    ("nvfp4", "none", 5, 256, 512, dict(store=Store.TMA, tile_n=16, tmem_rep=16)),
    ("nvfp4", "full", 5, 256, 512, dict(store=Store.TMA, tile_n=16, layout=RowLayout.TILE8,
                                        tmem_shape=TmemShape.S16X128B, tmem_rep=4)),
    ("nvfp4", "none", 3, 200, 512, {}),                      # N padded to the 128-row tile
]


def _simulate(fmt, comp, m, n, k, fields, seed=0, x=None):
    qw = _layer(fmt, comp, n, k, seed)
    v = dataclasses.replace(V(stages=2), **fields)
    p = P(fmt, comp, m, n, k)
    assert FAMILY.why_invalid(v, p, ARCH) is None, FAMILY.why_invalid(v, p, ARCH)
    g = geometry_of(v, p)
    if x is None:
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed + 1)) * 3
    wt = LK.prepare_sm100_weight(qw)
    op = make_operand(x, qw, _comp(comp), g.layout, g.act_sf_tile)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16)
    ws = torch.zeros(g.split_k * m * n + 4)
    sem = torch.zeros(64, dtype=torch.int32)
    simulate_kernel(g, wt, op, out, ws, sem, seed=seed)
    return x, qw, out, ws


@pytest.mark.parametrize("fmt, comp, m, n, k, fields", SIM_CASES)
def test_kernel_simulation_is_bit_exact_against_the_reference(fmt, comp, m, n, k, fields):
    """The kernel's tile math, thread by thread (grid, TMA tiles with their scale factors at
    the tile-padded SF rows, TMEM image, TMEM loads of the variant's shape, fold plan,
    mul.rn / add.rn, bf16 conversion, store path) reproduces resgen.reference.linear's BF16
    output exactly, every output written once."""
    x, qw, out, _ = _simulate(fmt, comp, m, n, k, fields)
    ref = R.linear(x, qw, _comp(comp)).to(torch.bfloat16)
    assert torch.equal(out.view(torch.int16), ref.view(torch.int16))


@pytest.mark.parametrize("reduce", [Reduction.WORKSPACE, Reduction.ATOMIC])
def test_split_k_simulation_sums_the_partials(reduce):
    """Split-K: each split's folded FP32 partial, summed by the tile's last CTA (in split order
    for "workspace": the same bits whatever order the CTAs ran in); the semaphores end at zero
    and the atomic workspace is re-zeroed (asserted by the simulation)."""
    fields = dict(split_k=4, reduce=reduce, layout=RowLayout.ROW_PAIR)
    x, qw, out, ws = _simulate("nvfp4", "full", 5, 256, 1024, fields, seed=3)
    ref = R.linear(x, qw, "full")
    rel = float((out.float() - ref).norm() / ref.norm())
    assert rel < 3e-3
    if reduce == Reduction.WORKSPACE:
        _, _, out2, _ = _simulate("nvfp4", "full", 5, 256, 1024, fields, seed=3, x=x)
        assert torch.equal(out.view(torch.int16), out2.view(torch.int16))
        # against the definition: per split, fp32(partial) folded, summed in split order
        kp = 1024
        opr = make_operand(x, qw, "full", "row_pair", 8)
        from resgen.kernels.sm100_operand import unit_values
        wt = LK.prepare_sm100_weight(qw)
        W = unit_values(wt.codes, unpack_sf(wt.sf, wt.rows, kp // 16, 128), "nvfp4")[:256]
        X = unit_values(opr.codes, unpack_sf(opr.sf, opr.rows, kp // 16, 8), "nvfp4")
        f = (opr.alpha * wt.alpha).reshape(())
        tot = torch.zeros(5, 256)
        for s in range(4):
            ks = slice(s * 256, (s + 1) * 256)
            c = (X[:, ks].double() @ W[:, ks].double().T).float()
            tot = tot + (c[0::2] * f + c[1::2] * f)
        assert torch.equal(out.view(torch.int16), tot.to(torch.bfloat16).view(torch.int16))


def test_simulation_catches_a_misplaced_scale_factor():
    """A quantizer that wrote its scale factors untiled (not tile-padded for the GEMM's 8-row
    tile) gives a wrong result, which the simulation shows: the layout is checked, not
    assumed."""
    qw = _layer("nvfp4", "none", 256, 512)
    x = torch.randn(20, 512, generator=torch.Generator().manual_seed(1))
    v = V(stages=2)
    p = P("nvfp4", "none", 20, 256, 512)
    g = geometry_of(v, p)
    wt = LK.prepare_sm100_weight(qw)
    good = make_operand(x, qw, "none", "plain", 8)
    untiled = make_operand(x, qw, "none", "plain", 128).sf
    sf = torch.zeros_like(good.sf)
    sf[: untiled.numel()] = untiled
    bad = dataclasses.replace(good, sf=sf)
    out = torch.full((20, 256), float("nan"), dtype=torch.bfloat16)
    simulate_kernel(g, wt, bad, out)
    ref = R.linear(x, qw, "none").to(torch.bfloat16)
    assert not torch.equal(out.view(torch.int16), ref.view(torch.int16))


# ----------------------------------------------------------------------------- runner


class _SimulatedKernel:
    """Stands in for a compiled variant on the CPU: takes the tensors the launcher passes
    (entry order: A, B, SFA, SFB, out, alpha_x, alpha_w, ws, sem, m, rows, stream) and runs the
    thread-level simulation on them."""

    def __init__(self, geom):
        self.g = geom
        self.calls = 0

    def __call__(self, a, b, sfa, sfb, y, ax, aw, ws, sem, m, rows, stream):
        from resgen.kernels.sm100_operand import Sm100Operand

        g = self.g
        wc, ac, wsf, asf = (a, b, sfa, sfb) if g.swap else (b, a, sfb, sfa)
        wt = LK.Sm100Weight(g.fmt, g.n, g.kp, wc, wsf, aw)
        op = Sm100Operand(g.fmt, m, rows, g.layout, g.act_sf_tile, ac[:rows], asf,
                          None if g.fmt == "mxfp4" else ax)
        simulate_kernel(g, wt, op, y, ws, sem)
        self.calls += 1


class _SimQuantizer:
    """Stands in for a compiled quant_sm100 kernel on the CPU: the real QuantSm100Kernel host
    code (outputs, argument checks) with its store simulation as the "device"."""

    def __init__(self, geom, comp, k):
        from resgen.kernels.quant_sm100 import QuantSm100Config, QuantSm100Kernel
        from resgen.kernels.quant_sm100_sim import simulate_quant

        alpha = "none" if geom.fmt == "mxfp4" else "static"
        self.config = QuantSm100Config(geom.fmt, comp, k, geom.layout, geom.act_sf_tile,
                                       alpha=alpha)
        self.calls = 0
        cfg = self.config

        def device(x, alpha_t, masks, codes, sf, ws, m, slots, stream):
            from resgen.kernels.quant_sm100 import QuantSm100Outputs
            from resgen.kernels.sm100_operand import Sm100Operand

            m, slots = int(getattr(m, "value", m)), int(getattr(slots, "value", slots))
            out = QuantSm100Outputs(Sm100Operand(cfg.fmt, m, codes.shape[0], cfg.layout,
                                                 cfg.sf_tile, codes, sf, None), slots, ws, ws)
            a = float(alpha_t.reshape(-1)[0]) if cfg.alpha == "static" else None
            simulate_quant(cfg, x, out, a, masks if cfg.mode == "kext" else None)
            self.calls += 1

        self.kernel = QuantSm100Kernel(cfg, device)

    def outputs(self, m, device):
        return self.kernel.outputs(m, device)

    def __call__(self, xb, outs, alpha=None, masks=None):
        return self.kernel(xb, outs, alpha=alpha, masks=masks)


@pytest.mark.parametrize("fmt, comp, fields", [
    ("nvfp4", "full", dict(layout=RowLayout.ROW_PAIR, split_k=2,
                           reduce=Reduction.WORKSPACE)),
    ("mxfp4", "0.25", dict(tile_n=16, tmem_shape=TmemShape.S16X256B, tmem_rep=2)),
])
def test_runner_binds_the_served_layer_on_cpu_with_the_simulations(fmt, comp, fields,
                                                                   monkeypatch):
    """The tuner's runner times exactly family.bind's layer (quantizer + GEMM, the call
    resgen.ops serves), here with both kernels simulated: the GEMM check, the whole-layer
    check, set rotation, and the bound layer bit-exact against the reference on the
    quantized bf16 activations."""
    from resgen.kernels import quant_sm100 as QK

    monkeypatch.setattr(LK.LinearSm100Launcher, "_ptr", lambda self, t, kind, align: t)
    monkeypatch.setattr(QK.QuantSm100Kernel, "_ptr", staticmethod(lambda t, dt, align: t))
    p = P(fmt, comp, 3, 256, 512)
    v = dataclasses.replace(FAMILY.default(p, ARCH), stages=2, **fields)
    assert FAMILY.why_invalid(v, p, ARCH) is None
    g = geometry_of(v, p)
    fake = _SimulatedKernel(g)
    quant = _SimQuantizer(g, comp, 512)
    r = FAMILY.runner(fake, v, p, "cpu", n_sets=2, seed=0, quantizer=quant)
    for _ in range(2):
        res = r.check()
        assert res.ok, res.detail
    r.rotate(1)
    y1 = r().clone()
    r.rotate(0)
    y0 = r().clone()
    assert not torch.equal(y0, y1) and quant.calls >= 4
    qw, _, x1, _ = r.sets[1]
    ref = R.linear(x1.to(torch.bfloat16).float(), qw, _comp(comp)).to(torch.bfloat16)
    assert torch.equal(y1.view(torch.int16), ref.view(torch.int16))
    # the served path is the same binding: bind on the same weight gives the same bits
    wt = r.sets[1][1]
    from resgen.calibrate import static_alpha
    masks = qw.selection.masks if qw.selection is not None else None
    run = FAMILY.bind(fake, v, p, wt, "cpu", quantizer=quant, alpha=static_alpha(qw, "cpu"),
                      masks=masks)
    y = torch.full_like(y1, float("nan"))
    run(x1.to(torch.bfloat16).contiguous(), y)
    assert torch.equal(y.view(torch.int16), y1.view(torch.int16))


def test_launcher_rejects_mismatched_operands(monkeypatch):
    monkeypatch.setattr(LK.LinearSm100Launcher, "_ptr", lambda self, t, kind, align: t)
    p = P("nvfp4", "full", 3, 256, 512)
    v = dataclasses.replace(FAMILY.default(p, ARCH), stages=2)
    g = geometry_of(v, p)
    qw = _layer("nvfp4", "full", 256, 512)
    wt = LK.prepare_sm100_weight(qw)
    x = torch.randn(3, 512)
    launch = LK.LinearSm100Launcher(_SimulatedKernel(g), g, 16, "cpu")
    out = torch.empty(3, 256, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="does not match the variant"):
        launch(wt, make_operand(x, qw, "full", "tile8", 8), out)
    with pytest.raises(ValueError, match="tile-padded"):
        launch(wt, make_operand(x, qw, "full", "row_pair", 128), out)
    with pytest.raises(ValueError, match="out must be"):
        launch(wt, make_operand(x, qw, "full", "row_pair", 8), out[:, :128])


# ----------------------------------------------------------------------------- runtime


def test_runtime_on_a_b200_serves_sm100a_rows(tmp_path):
    """The runtime on an sm_100 device (a faked device record: no Blackwell here) reads only
    sm_100a rows of its GPU, validates and fingerprints them like Hopper's, and falls back to
    linear_sm100_tc's default on a miss; an H200 record never sees them."""
    from resgen.db import TuningDB
    from resgen.runtime import Device, Dispatcher
    from resgen.search.build import variant_fingerprint
    from resgen.search.record import Environment, ResultRecord, Status, arch_of_capability

    assert arch_of_capability(10, 0) == "sm_100a"
    env = Environment(gpu_name="NVIDIA B200", arch="sm_100a", compute_capability="10.0",
                      sm_count=148, driver="x", cuda="x", torch="x", cute_dsl="x", resgen="x",
                      compile_only=False)
    p = P("nvfp4", "full", 1, 4096, 4096)
    sp = FAMILY.space(p, ARCH)
    win = next(v for v in sp if v.tmem_shape == TmemShape.S16X256B)
    path = tmp_path / "b200.sqlite"
    with TuningDB(path) as db:
        for v, us in ((win, 5.0), (sp[0], 6.0)):
            db.record(ResultRecord(problem=p, variant=v, environment=env,
                                   fingerprint=variant_fingerprint(FAMILY, v, p, ARCH),
                                   status=Status.OK, median_us=us, samples_us=[us],
                                   space_index=sp.index(v), policy={"tie_rel": 0.01}))
    d = Dispatcher(paths=[path], device=Device("NVIDIA B200", "sm_100a"))
    assert d.lookup("linear", p) == win and "b200.sqlite" in d.source("linear", p)
    assert d.lookup("linear", dataclasses.replace(p, m=2)) == win     # bucket 1 -> m = 2 ok
    miss = P("mxfp4", "none", 1, 4096, 4096)
    assert d.lookup("linear", miss) == FAMILY.default(miss, ARCH)
    h200 = Dispatcher(paths=[path], device=Device("NVIDIA B200", "sm_90a"))
    assert h200.lookup("linear", p).FAMILY != "linear_sm100_tc"


# ----------------------------------------------------------------------------- model


def test_model_reproduces_the_two_fitted_fig4a_points():
    """The model's two fitted parameters go exactly through the paper's Fig. 4a points (plain
    NVFP4 GEMM, N = K = 4096, B = 8, tile widths 8 and 64, the deepest ring that fits, as
    CUTLASS's examples choose): a fit, not a claim."""
    fixed, gbps = fit_fig4a()
    assert B200().fitted().fixed_us == pytest.approx(fixed) and 100 < gbps < 1000
    p = P("nvfp4", "none", FIG4A_M, 4096, 4096)
    for w, us in PAPER_FIG4A:
        g = fig4a_geometry(w)
        assert g.stages == max_stages(g) >= 8
        v = V(tile_n=w, tmem_rep=min(w, 32), stages=g.stages)
        assert geometry_of(v, p) == g and FAMILY.why_invalid(v, p, ARCH) is None
        b = predict(g, FIG4A_M)
        assert b.ctas == 32 and b.total_us == pytest.approx(us, abs=1e-6), (w, b)


def test_model_terms_follow_the_bytes_and_tiles():
    p = P("nvfp4", "none", 1, 4096, 4096)
    v = FAMILY.default(p, ARCH)
    b1 = predict(geometry_of(v, p), 1)
    p2 = dataclasses.replace(p, k=8192)
    b2 = predict(geometry_of(v, p2), 1)
    assert b2.cta_bytes == 2 * b1.cta_bytes and b2.total_us > b1.total_us
    vs = dataclasses.replace(v, split_k=4, reduce=Reduction.WORKSPACE)
    sk = predict(geometry_of(vs, p), 1)
    assert sk.ctas == 4 * b1.ctas and sk.mem_us < b1.mem_us and sk.reduce_us > 0
    mx = predict(geometry_of(v, dataclasses.replace(p, fmt="mxfp4")), 1)
    assert mx.cta_bytes < b1.cta_bytes                  # E8M0 per 32: half the SF bytes
    for q in PROBLEMS:
        sp = FAMILY.space(q, ARCH)
        pri = [FAMILY.prior(x, q) for x in sp]
        assert all(t > 0 for t in pri) and len(set(pri)) > 1
    best, _ = FAMILY.best_predicted(p)
    assert FAMILY.prior(best, p) == min(FAMILY.prior(x, p) for x in FAMILY.space(p, ARCH))


def test_tmem_load_wrapper_register_counts():
    """sm100_ptx.tmem_ld's register count per shape and repetition, and what it refuses."""
    from resgen.kernels import sm100_ptx as PX

    assert [PX.tmem_ld_expected_count(s, 4) for s in ("32x32b", "16x256b", "16x128b")] == \
        [4, 16, 8]
    for shape in ("32x32b", "16x256b", "16x128b"):
        for rep in (1, 2, 4, 8):
            assert PX.tmem_ld_expected_count(shape, rep) == tmem_span(shape, rep)[2]
    with pytest.raises(ValueError, match="shape"):
        PX.tmem_ld_expected_count("16x64b", 1)
    with pytest.raises(ValueError, match="repetition"):
        PX.tmem_ld_expected_count("32x32b", 3)
    with pytest.raises(ValueError, match="at most 128"):
        PX.tmem_ld_expected_count("16x256b", 64)
