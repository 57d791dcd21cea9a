"""linear_sm90_wgmma with one producer warp (variant axis producer = "warp": one consumer
warpgroup, then one producer warp, 160 threads per CTA) on an H200: Qwen3-8B shapes at serving
M in every mode (plain NVFP4 / MXFP4, M-Ext exact and presum, K-Ext, split-K, PDL), checked
twice on fresh random inputs with NaN-poisoned outputs against resgen.reference.linear (3e-3;
the second check sees the barriers and split-K semaphores the first left), bit-identical
reruns, its output equal bit for bit to the warpgroup producer's (the same tiles, so the same
sums in the same order), the whole layer behind the quantizer with PDL, and CUDA-graph
replay."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from resgen.search.linear_sm90_mma import Packing
from resgen.search.linear_sm90_wgmma import FAMILY, LinearSm90WgmmaVariant as V, Producer, \
    Raster, compile_once
from resgen.search.sm90_linear import Fold
from resgen.search.variant import LinearProblem

# tests/gpu/runner_checks.py
from runner_checks import (check_graph_replay, check_layer_graph_behind_the_quantizer,
                           check_runner)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ARCH = "sm_90a"
W = Producer.WARP


def _runner(v, p, n_sets=1, seed=0):
    assert FAMILY.why_invalid(v, p, ARCH) is None, FAMILY.why_invalid(v, p, ARCH)
    out = compile_once(v, p, ARCH)
    assert out.ok, out.error
    assert out.spill_bytes == 0
    return FAMILY.runner(out.compiled, v, p, "cuda", n_sets=n_sets, seed=seed)


CASES = [
    # (n, k, fmt, comp, m, variant)
    (24576, 4096, "nvfp4", "none", 16, V(1, 1, 16, 8, producer=W)),
    (24576, 4096, "nvfp4", "none", 64, V(1, 1, 64, 4, producer=W)),
    (6144, 4096, "nvfp4", "none", 64, V(1, 1, 64, 6, split_k=2, pdl=True, producer=W)),
    (24576, 4096, "nvfp4", "none", 128, V(1, 1, 128, 8, producer=W)),
    (4096, 12288, "nvfp4", "full", 32, V(1, 1, 64, 4, split_k=4, pdl=True, producer=W)),
    (4096, 12288, "nvfp4", "full", 64, V(1, 1, 64, 6, fold=Fold.PRESUM, producer=W)),
    (4096, 4096, "mxfp4", "none", 128, V(1, 2, 128, 4, Raster.CH, Packing.NIB, producer=W)),
    (6144, 4096, "nvfp4", "0.125", 64, V(1, 1, 64, 6, producer=W)),
]


@pytest.mark.parametrize("n, k, fmt, comp, m, v", CASES,
                         ids=[f"{c[2]}-{c[3]}-{c[0]}x{c[1]}-m{c[4]}-{c[5].name()}" for c in CASES])
def test_producer_warp_qwen_shapes(n, k, fmt, comp, m, v):
    base = LinearProblem(fmt, comp, m, n, k)
    for mm in sorted({1, m, m + 5}):
        p = dataclasses.replace(base, m=mm)
        r = _runner(v, p, seed=mm)
        check_runner(r, v, mm, k)


@pytest.mark.parametrize("case", [1, 4])
def test_producer_warp_equals_the_warpgroup_producer(case):
    """The same tiles with either producer layout: the same wgmmas in the same order, so the
    BF16 outputs must be equal bit for bit."""
    n, k, fmt, comp, m, v = CASES[case]
    p = LinearProblem(fmt, comp, m, n, k)
    twin = dataclasses.replace(v, producer=Producer.WG)
    x = torch.randn(m, k, device="cuda")
    outs = []
    for var in (v, twin):
        r = _runner(var, p, seed=3)
        outs.append(r.run_on(x).clone())
        del r
    torch.cuda.synchronize()
    assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16))


def test_producer_warp_behind_the_quantizer_with_pdl_and_graph():
    """The PDL variant right behind quant_sm90: the whole layer checked twice, then three
    layers replayed in a CUDA graph against an eager run, bit for bit."""
    from resgen.kernels.quant_sm90 import QuantConfig, compile_config

    p = LinearProblem("nvfp4", "none", 24, 4096, 4096)
    v = V(1, 1, 32, 6, split_k=2, pdl=True, producer=W)
    qk = compile_config(QuantConfig("nvfp4", "none", p.k, "plain", write_codes=False,
                                    write_xop=True, alpha="static", kp_align=256))[0]
    r = _runner(v, p, n_sets=2)
    r.attach_quantizer(qk)
    check_layer_graph_behind_the_quantizer(r)


def test_producer_warp_graph_replay_and_semaphores_reset():
    p = LinearProblem("nvfp4", "full", 32, 4096, 12288)
    check_graph_replay(_runner(CASES[4][5], p, n_sets=2))
