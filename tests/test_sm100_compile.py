"""sm_100a compiles on the CPU (CuTe DSL with the arch named; no Blackwell GPU exists here): a
covering subset of every sm_100a family (every value of every axis at least once) through the
tuner's build path, with PTX checks (block-scaled tcgen05 MMA of the right kind, TMEM loads of
the chosen shape, the store path, no local memory) and the compile time of each variant
recorded (pytest's record_property; printed with -s). The same cover with its JSON record:
bench/sm100_compile_cover.py."""

from __future__ import annotations

import pytest

from resgen.search import build
from resgen.search import linear_sm100_tc as L
from resgen.search import quant_sm100 as Q

ARCH = "sm_100a"
LINEAR = L.covering_cases()
QUANT = Q.covering_cases()


def test_the_covers_hold_every_axis_value():
    import dataclasses

    for cases, fam in ((LINEAR, L.FAMILY), (QUANT, Q.FAMILY)):
        assert cases and all(fam.why_invalid(v, p, ARCH) is None for p, v in cases)
        for f in dataclasses.fields(fam.VARIANT):
            assert len({getattr(v, f.name) for _, v in cases}) >= 1
    lin = {f: {getattr(v, f) for _, v in LINEAR} for f in L.LinearSm100Variant.__dataclass_fields__}
    assert lin["tile_n"] == {8, 16, 32, 64, 128, 256} and lin["tile_m"] == {128, 256}
    assert lin["tmem_shape"] == set(L.TmemShape) and lin["layout"] == set(L.RowLayout)
    assert lin["reduce"] == set(L.Reduction) and lin["store"] == set(L.Store)
    assert lin["swap"] == {True, False} and lin["tile_k"] == {128, 256}
    assert {p.fmt for p, _ in LINEAR} == {"nvfp4", "mxfp4"}
    assert {L.mode_of(p) for p, _ in LINEAR} == {"plain", "mext", "kext"}


@pytest.mark.parametrize("p, v", LINEAR, ids=[v.name().split(":")[1] for _, v in LINEAR])
def test_linear_sm100_tc_compiles_for_sm100a(p, v, record_property, capsys):
    out = build.compile_variant(L.FAMILY, v, p, ARCH)
    assert out.ok, out.error
    record_property("compile_s", round(out.seconds, 3))
    with capsys.disabled():
        print(f"\n  {v.name()} [{p.fmt} {p.compensation} m={p.m}]: compiled in "
              f"{out.seconds:.2f} s, {out.registers} registers")
    assert out.spill_bytes == 0 and out.registers and out.registers <= 255
    ptx = out.compiled.artifacts.PTX
    assert L.ptx_problems(v, p, ptx) == []


@pytest.mark.parametrize("p, v", QUANT, ids=[v.name().split(":")[1] + f"-{p.compensation}"
                                             for p, v in QUANT])
def test_quant_sm100_compiles_for_sm100a(p, v, record_property):
    out = build.compile_variant(Q.FAMILY, v, p, ARCH)
    assert out.ok, out.error
    record_property("compile_s", round(out.seconds, 3))
    assert out.spill_bytes == 0
    assert Q.ptx_problems(v, p, out.compiled.artifacts.PTX) == []


def test_ptx_check_rejects_the_wrong_kernel():
    """The PTX check is not vacuous: a variant's PTX checked as another variant's fails."""
    (p0, v0), (p1, v1) = LINEAR[0], next((p, v) for p, v in LINEAR
                                         if v.tmem_shape != LINEAR[0][1].tmem_shape)
    out = build.compile_variant(L.FAMILY, v0, p0, ARCH)
    assert out.ok
    assert L.ptx_problems(v1, p1, out.compiled.artifacts.PTX)
