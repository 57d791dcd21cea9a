"""linear_sm90_fp8 (MXFP4 W4A4 on the FP8 tensor cores) on an H200: a covering subset of a
small problem's space at several M, the Qwen3-8B shapes at M = 64, 128, 256, 2048 (group 1
and a folded group 4 variant); fresh random inputs, NaN-poisoned outputs,
||out - ref|| / ||ref|| <= 3e-3 vs resgen.reference.linear, bit-identical reruns, and for
group 1 the output equal bit for bit to the CPU emulation's (resgen.kernels.
linear_sm90_fp8_sim: exact tensor-core partials, the kernel's promotion order). For group > 1
the fraction of outputs that differ from the emulation is reported (a reduced-precision FP8
accumulator can round folded partials; only the reference tolerance is asserted there).
The FP4 weight load (wload = "fp4": packed E2M1 in HBM, converted to E4M3 in shared memory by
the kernel, group 1) is held to the same checks, and its output must equal the E4M3-load
kernel's of the same geometry bit for bit (the same codes reach the tensor core)."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from resgen.kernels.linear_sm90_fp8_sim import simulate
from resgen.search.cover import covering_subset
from resgen.search.variant import LinearProblem
from resgen.settings import settings

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or
                                 torch.cuda.get_device_capability() != (9, 0),
                                 reason="needs a Hopper (sm_90) GPU")]

ARCH = "sm_90a"
SMALL = LinearProblem("mxfp4", "none", 200, 384, 768)
QWEN = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]   # qkv, o, gate/up, down


@pytest.fixture(autouse=True, scope="module")
def _opted_in():
    old = os.environ.get("RESGEN_EXPERIMENTAL")
    os.environ["RESGEN_EXPERIMENTAL"] = "linear_sm90_fp8"
    settings.cache_clear()
    yield
    if old is None:
        os.environ.pop("RESGEN_EXPERIMENTAL", None)
    else:
        os.environ["RESGEN_EXPERIMENTAL"] = old
    settings.cache_clear()


def _family():
    from resgen.search.linear_sm90_fp8 import FAMILY

    return FAMILY


def _compiled(v):
    from resgen.search.linear_sm90_fp8 import compile_once

    out = compile_once(v, ARCH)            # shared with bench/linear_sm90_fp8_h200.py
    assert out.ok, out.error
    assert out.spill_bytes == 0
    return out.compiled


def check_variant(v, p: LinearProblem, seed: int = 0) -> dict:
    """Reference check (twice), rerun determinism and the emulation comparison of variant v
    on problem p; returns {"rel_err", "sim_mismatch"} (the fraction of bf16 outputs that
    differ from the emulation's)."""
    fam = _family()
    assert fam.why_invalid(v, p, ARCH) is None, fam.why_invalid(v, p, ARCH)
    r = fam.runner(_compiled(v), v, p, "cuda", n_sets=1, seed=seed)
    for _ in range(2):
        res = r.check()
        assert res.ok, f"{v.name()} m={p.m} n={p.n} k={p.k}: {res.detail} ({res.rel_err:.3e})"
    w, x = r.sets[0]
    a = torch.full((p.m, p.n), float("nan"), dtype=torch.bfloat16, device="cuda")
    b = torch.full_like(a, float("nan"))
    r.launcher(w, x, p.m, a)
    r.launcher(w, x, p.m, b)
    torch.cuda.synchronize()
    assert torch.equal(a.view(torch.int16), b.view(torch.int16)), f"{v.name()}: reruns differ"
    sim = simulate(x, w, p.m).to(torch.bfloat16)
    mismatch = float((a.view(torch.int16) != sim.view(torch.int16)).float().mean())
    if v.group == 1 and p.compensation == "none":    # W4A8's partials are not exact
        assert mismatch == 0.0, (f"{v.name()} m={p.m}: {mismatch:.2e} of the outputs differ "
                                 "from the exact-partial emulation")
    return {"rel_err": res.rel_err, "sim_mismatch": mismatch}


def _small_space():
    return covering_subset(_family().space(SMALL, ARCH))


def test_the_covering_subset_spans_every_axis():
    cover = _small_space()
    assert {v.group for v in cover} == {1, 2, 4}
    assert {v.parts for v in cover} == {1, 2} and {v.consumers for v in cover} == {1, 2}
    assert {v.wload.value for v in cover} == {"e4m3", "fp4"}


# wload in the test ids: bench/linear_sm90_fp8_h200.py runs `-k "not fp4"` (with the E4M3
# timing) before `-k fp4`, so a broken FP4 kernel cannot take the E4M3 results with it
WLOADS = ["e4m3", "fp4"]


@pytest.mark.parametrize("wload", WLOADS)
@pytest.mark.parametrize("m", [1, 64, 130, 200])
def test_covering_subset_small(m, wload):
    p = dataclasses.replace(SMALL, m=m)
    for i, v in enumerate(_small_space()):
        if v.wload.value == wload and _family().why_invalid(v, p, ARCH) is None:
            out = check_variant(v, p, seed=i)
            print(f"{v.name()} m={m}: rel {out['rel_err']:.2e}, "
                  f"emulation mismatch {out['sim_mismatch']:.2e}")


def _qwen_variants():
    from resgen.search.linear_sm90_fp8 import LinearSm90Fp8Variant, WLoad

    return [LinearSm90Fp8Variant(2, 128, 4, 1, 2), LinearSm90Fp8Variant(2, 128, 4, 4, 2),
            LinearSm90Fp8Variant(2, 128, 4, 1, 2, wload=WLoad.FP4)]


@pytest.mark.parametrize("wload", WLOADS)
@pytest.mark.parametrize("n, k", QWEN)
@pytest.mark.parametrize("m", [64, 128, 256, 2048])
def test_qwen3_8b_shapes(n, k, m, wload):
    if wload == "fp4" and m > 256:
        pytest.skip("the FP4 load matters where HBM bounds; M > 256 saves device time")
    p = LinearProblem("mxfp4", "none", m, n, k)
    for v in _qwen_variants():
        if v.wload.value != wload:
            continue
        out = check_variant(v, p, seed=m)
        print(f"{v.name()} {n}x{k} m={m}: rel {out['rel_err']:.2e}, "
              f"emulation mismatch {out['sim_mismatch']:.2e}")


@pytest.mark.parametrize("n, k", QWEN[:2])
@pytest.mark.parametrize("m", [1, 64, 128, 2048])
def test_w4a8_qwen3_8b_shapes(n, k, m):
    """W4A8 (E4M3 per-token activations): the same kernels, checked (twice, NaN-poisoned
    output) against resgen.reference.linear_w4a8 within the family's tolerance, reruns bit
    for bit; the fraction of outputs that differ from the exact-partial emulation is printed
    (Hopper's FP8 accumulator rounds these partials), not asserted."""
    p = LinearProblem("mxfp4", "w4a8", m, n, k)
    for v in _qwen_variants():
        if v.wload.value == "e4m3":
            out = check_variant(v, p, seed=m + 1)
            print(f"w4a8 {v.name()} {n}x{k} m={m}: rel {out['rel_err']:.2e}, "
                  f"emulation mismatch {out['sim_mismatch']:.2e}")


def _fp4_variants():
    """FP4-load geometries beyond the covering subset's (one consumer, one partial, bn 64);
    (1, 128, 4, 1, 2) is also timed by bench/linear_sm90_fp8_h200.py."""
    from resgen.search.linear_sm90_fp8 import LinearSm90Fp8Variant, WLoad

    return [LinearSm90Fp8Variant(1, 128, 4, 1, 2, wload=WLoad.FP4),
            LinearSm90Fp8Variant(1, 64, 6, 1, 1, wload=WLoad.FP4)]


@pytest.mark.parametrize("m, n, k", [(1, 384, 768), (130, 384, 768), (200, 4096, 4096)])
def test_fp4_load_equals_the_e4m3_load_bit_for_bit(m, n, k):
    """Each FP4-load variant (these and the covering subset's) against the reference and,
    bit for bit, the emulation (check_variant); where the E4M3-load twin of the same geometry
    is compiled anyway, against it on the same weight and activations: identical bf16."""
    fam = _family()
    p = LinearProblem("mxfp4", "none", m, n, k)
    fp4 = _fp4_variants() + [v for v in _small_space() if v.wload.value == "fp4"]
    for v in fp4:
        if fam.why_invalid(v, p, ARCH) is not None:
            continue
        check_variant(v, p, seed=m + n)         # group 1: equal to the emulation, asserted
        e4 = dataclasses.replace(v, wload=type(v.wload)("e4m3"))
        if e4 not in _small_space() + _qwen_variants():
            continue                             # (no extra compile for the twin)
        r = fam.runner(_compiled(v), v, p, "cuda", n_sets=1, seed=7)
        x = r.sets[0][1]
        w8 = fam.layout(r.qweight, 1)
        a = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        b = torch.full_like(a, float("nan"))
        r.launcher(r.sets[0][0], x, m, a)
        fam.launcher(_compiled(e4), e4, p, "cuda")(w8, x, m, b)
        torch.cuda.synchronize()
        assert not bool(a.isnan().any())
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), (
            f"{v.name()} m={m}: the FP4 load differs from the E4M3 load")
        print(f"{v.name()} m={m} n={n} k={k}: equal to {e4.name()}")


@pytest.mark.parametrize("wload", WLOADS)
def test_the_whole_layer_binding_and_bad_input(wload):
    """bind() as the runtime would serve it: bf16 activations in, bf16 out; a wrong K is a
    clear error before any launch."""
    fam = _family()
    from resgen.search.linear_sm90_fp8 import LinearSm90Fp8Variant
    from resgen.search.sm90_linear import random_layer

    from resgen.reference import linear
    from resgen.search.linear_sm90_fp8 import WLoad
    from resgen.search.sm90_linear import compare

    p = LinearProblem("mxfp4", "none", 96, 512, 1024)
    qw = random_layer(p, "cuda", torch.Generator(device="cuda").manual_seed(3))
    for v in (LinearSm90Fp8Variant(2, 128, 4, 2, 2),
              LinearSm90Fp8Variant(2, 128, 4, 1, 2, wload=WLoad.FP4)):
        if v.wload.value != wload:
            continue
        run = fam.bind(_compiled(v), v, p, fam.layout(qw, v.group, v.wload), "cuda")
        xb = torch.randn(96, 1024, device="cuda").to(torch.bfloat16)
        out = torch.full((96, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
        run(xb, out)
        torch.cuda.synchronize()
        res = compare(out, linear(xb.float(), qw, "none"))
        assert res.ok, f"{v.name()}: {res.detail}"
        with pytest.raises(ValueError, match="1024"):
            run(torch.randn(96, 1000, device="cuda").to(torch.bfloat16), out)
