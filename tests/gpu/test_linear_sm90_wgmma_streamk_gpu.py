"""linear_sm90_wgmma's stream-K variants (persistent CTAs) on an H200: Qwen3-8B shapes at
serving M in every mode the space offers them, checked twice on fresh random inputs with
NaN-poisoned outputs against resgen.reference.linear (3e-3; the second check sees the
semaphores the first left, which must be back at zero), bit-identical reruns; CTA counts
below the GPU's (tiles shared by two or more CTAs, every fixup path); CUDA-graph replay."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from resgen.search.linear_sm90_mma import Packing
from resgen.search.linear_sm90_wgmma import FAMILY, LinearSm90WgmmaVariant as V, Raster, \
    compile_once
from resgen.search.sm90_linear import Fold
from resgen.search.variant import LinearProblem

from runner_checks import check_graph_replay, check_runner  # tests/gpu/runner_checks.py

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ARCH = "sm_90a"


def _runner(v, p, n_sets=1, seed=0, sms=None):
    assert FAMILY.why_invalid(v, p, ARCH) is None, FAMILY.why_invalid(v, p, ARCH)
    out = compile_once(v, p, ARCH)
    assert out.ok, out.error
    assert out.spill_bytes == 0
    r = FAMILY.runner(out.compiled, v, p, "cuda", n_sets=n_sets, seed=seed)
    if sms is not None:
        r.launcher.sms = sms          # fewer persistent CTAs (the workspace is larger already)
    return r


CASES = [
    # (n, k, fmt, comp, m, variant)
    (6144, 4096, "nvfp4", "none", 64, V(2, 1, 64, 6, streamk=1)),
    (6144, 4096, "nvfp4", "none", 16, V(1, 1, 16, 8, streamk=2)),
    (24576, 4096, "nvfp4", "none", 128, V(2, 1, 128, 6, streamk=1)),
    (4096, 12288, "nvfp4", "full", 64, V(2, 1, 64, 6, streamk=1, fold=Fold.PRESUM)),
    (4096, 12288, "nvfp4", "full", 32, V(2, 1, 64, 4, streamk=1)),
    (4096, 4096, "mxfp4", "none", 128, V(1, 1, 128, 4, Raster.CH, Packing.NIB, streamk=1)),
    (6144, 4096, "nvfp4", "0.125", 64, V(2, 1, 64, 6, streamk=1)),
    (24576, 4096, "nvfp4", "none", 2048, V(2, 1, 128, 6, streamk=1)),
]


@pytest.mark.parametrize("n, k, fmt, comp, m, v", CASES,
                         ids=[f"{c[2]}-{c[3]}-{c[0]}x{c[1]}-m{c[4]}-{c[5].name()}" for c in CASES])
def test_streamk_qwen_shapes(n, k, fmt, comp, m, v):
    base = LinearProblem(fmt, comp, m, n, k)
    for mm in sorted({1, m, m + 5}):
        p = dataclasses.replace(base, m=mm)
        r = _runner(v, p, seed=mm)
        check_runner(r, v, mm, k)
        torch.cuda.synchronize()
        assert int(r.launcher.sem.abs().sum()) == 0


@pytest.mark.parametrize("sms", [1, 3, 7, 50])
def test_streamk_shared_tiles(sms):
    """Few CTAs for many units: every tile is shared (sms = 3, 7: two or three contributors,
    first-slot and other-slot fixups), or one CTA walks everything (sms = 1: full tiles only,
    one pipeline across all of them)."""
    p = LinearProblem("nvfp4", "none", 40, 1024, 2048)
    for v in (V(2, 1, 32, 4, streamk=1), V(1, 2, 64, 3, Raster.CH, streamk=1)):
        r = _runner(v, p, seed=sms, sms=sms)
        check_runner(r, v, p.m, p.k)
        assert int(r.launcher.sem.abs().sum()) == 0


def test_streamk_graph_replay_matches_eager():
    p = LinearProblem("nvfp4", "full", 64, 4096, 12288)
    v = V(2, 1, 64, 6, streamk=1, fold=Fold.PRESUM)
    check_graph_replay(_runner(v, p, n_sets=2))
