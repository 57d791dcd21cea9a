"""attention_sm100 compiles for sm_100a on the CPU (CuTe DSL with the arch named; no Blackwell
GPU exists here): the family's covering subset (every value of every variant axis of its cover
problems, both head dims, ResAttn and plain; attention_sm100.covering_cases) through the tuner's
build path, each with the family's PTX check (tcgen05.mma kind::mxf4nvf4 block16 for QK and
kind::f16 for P.V, score loads of the variant's tcgen05.ld shape and repetition, the O loads,
scale factors into TMEM, the FP32 fold, ex2, the split reduction's instructions, no local
memory), no spills, and the compile time recorded (record_property; printed with -s)."""

from __future__ import annotations

import dataclasses

import pytest

from resgen.search import attention_sm100 as A
from resgen.search import build

CASES = A.covering_cases()


def test_the_cover_holds_every_axis_value():
    assert CASES and all(A.FAMILY.why_invalid(v, p, A.ARCH) is None for p, v in CASES)
    space = [v for p in A.COVER_PROBLEMS for v in A.FAMILY.space(p, A.ARCH)]
    for f in dataclasses.fields(A.AttentionSm100Variant):
        if f.name == "splits":          # a run-time argument: 1 and more than 1
            assert {v.splits > 1 for _, v in CASES} == {True, False}
            continue
        assert {getattr(v, f.name) for _, v in CASES} == {getattr(v, f.name) for v in space}
    assert {(v.qlayout, v.tmem_shape) for _, v in CASES} >= {
        (A.QLayout.PAIR, A.TmemShape.S32X32B)}
    assert {p.head_dim for p, _ in CASES} == set(A.HEAD_DIMS)
    assert {p.compensation for p, _ in CASES} == {True, False}
    assert set(A.Reduction) == {v.reduction for _, v in CASES}
    assert set(A.TmemShape) == {v.tmem_shape for _, v in CASES}


@pytest.mark.parametrize("p, v", CASES, ids=[f"d{p.head_dim}-{v.name().split(':')[1]}"
                                             for p, v in CASES])
def test_attention_sm100_compiles_for_sm100a(p, v, record_property, capsys):
    out = build.compile_variant(A.FAMILY, v, p, A.ARCH)
    assert out.ok, out.error
    record_property("compile_s", round(out.seconds, 3))
    with capsys.disabled():
        print(f"\n  {v.name()} [D {p.head_dim} G {p.q_heads // p.kv_heads} page "
              f"{p.page_size} comp {p.compensation}]: compiled in {out.seconds:.2f} s, "
              f"{out.registers} registers, {out.spill_bytes} B local")
    assert out.spill_bytes == 0 and out.registers and out.registers <= 255
    ptx = out.compiled.artifacts.PTX
    assert A.ptx_problems(v, p, ptx) == []
    g = A.geometry_of(v, p)
    assert "tcgen05.mma.cta_group::1.kind::mxf4nvf4.block_scale.block16" in ptx
    assert f"tcgen05.ld.sync.aligned.{g.tmem_shape}.x{g.tmem_rep}.b32" in ptx
    assert ".local" not in ptx
    assert ptx.count("tcgen05.mma.cta_group::1.kind::mxf4nvf4") >= 1


def test_ptx_check_rejects_the_wrong_kernel():
    """The PTX check is not vacuous: one variant's PTX checked as a variant of another load
    shape (and reduction) fails."""
    (p0, v0) = CASES[0]
    p1, v1 = next((p, v) for p, v in CASES if v.tmem_shape != v0.tmem_shape
                  and v.reduction != v0.reduction)
    out = build.compile_variant(A.FAMILY, v0, p0, A.ARCH)
    assert out.ok, out.error
    bad = A.ptx_problems(v1, p1, out.compiled.artifacts.PTX)
    assert any("tcgen05.ld" in b or "TMEM load" in b for b in bad), bad
