"""linear_sm90_wgmma's presum fold on an H200 (issue 20 section 1).

- quant_sm90's layout "presum" (M-Ext, and K-Ext at every ratio) is bit-exact against its
  torch definition (quant_sm90.operand_reference: fp16(X_hat + R_hat) per token,
  formats.presum_fp16; K-Ext: formats.residue_on_channels) on every
  input kind, static and dynamic alpha, pack8 and pack16, one-shot and persistent grids, into
  NaN-poisoned (0xFF) buffers;
- presum variants (the space's first by the prior, and the presum twins of the default and of
  a split-K / narrow-tile variant) on Qwen3-8B's four projections, NVFP4 M-Ext, M = 64, 128,
  2048: the runner's check (the GEMM alone on make_presum_xop, then the whole layer behind
  the real quant_sm90 presum quantizer) against reference.linear(fold="presum") AND the exact
  fold's reference at 3e-3, fresh random inputs, NaN-poisoned outputs, twice, then
  bit-identical reruns;
- a hand-made operand whose result is decided by the single FP16 rounding;
- CUDA-graph replay of a bound presum layer (PDL behind the quantizer)."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from resgen import calibrate as C
from resgen import formats
from resgen.kernels import quant_sm90 as Q
from resgen.kernels.linear_sm90_wgmma_layout import prepare_wgmma_weight
from resgen.search.linear_sm90_wgmma import (FAMILY, Fold, LinearSm90WgmmaVariant, Packing,
                                             Raster, compile_once)
from resgen.search.variant import LinearProblem

from runner_checks import check_runner  # tests/gpu/runner_checks.py

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ARCH = "sm_90a"
DEV = "cuda"
QWEN3_8B = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]


def _compiled(v: LinearSm90WgmmaVariant, p: LinearProblem):
    out = compile_once(v, p, ARCH)
    assert out.ok, out.error
    assert out.spill_bytes == 0
    return out.compiled


# ----------------------------------------------------------------------------- quantizer


_QCACHE: dict = {}


def _qconfigs():
    for alpha, (ept, warps, unroll, persist) in itertools.product(
            ("static", "dynamic"), ((8, 4, 2, False), (16, 4, 2, True), (8, 8, 4, True))):
        yield Q.QuantConfig("nvfp4", "full", 1024, "presum", ept=ept, warps=warps,
                            unroll=unroll, persist=persist, write_codes=False, write_xop=True,
                            alpha=alpha, kp_align=256)


@pytest.mark.parametrize("cfg", list(_qconfigs()), ids=lambda c: (
    f"{c.alpha}-e{c.ept}w{c.warps}u{c.unroll}{'p' if c.persist else ''}"))
def test_presum_quantizer_is_bit_exact(cfg):
    if cfg not in _QCACHE:
        _QCACHE[cfg] = Q.compile_config(cfg, ARCH)[0]
    kern = _QCACHE[cfg]
    for kind, m in itertools.product(Q.INPUT_KINDS, (1, 37)):
        x = Q.make_inputs(kind, m, cfg.k, seed=m * 7 + len(kind), device=DEV)
        alphas = [None] if cfg.alpha == "dynamic" else [formats.nvfp4_global_scale(x.float()),
                                                        torch.tensor(2.0 ** -8)]
        for alpha in alphas:
            out = kern.outputs(m, 8, DEV)
            out.operand.xop.view(torch.uint8).fill_(0xFF)        # NaN: every byte written
            a = None if alpha is None else alpha.reshape(1).to(DEV, torch.float32)
            got = kern(x, out, alpha=a)
            torch.cuda.synchronize()
            ref = Q.operand_reference(x, "nvfp4", "full", "presum", 8,
                                      None if alpha is None else alpha.to(DEV), None, 256)
            assert got.xop.dtype == torch.float16
            assert torch.equal(got.xop.view(torch.int16), ref.xop.view(torch.int16)), \
                f"{kind} m={m} alpha={alpha}: {(got.xop != ref.xop).sum()} values differ"
            assert torch.equal(got.alpha, ref.alpha.to(DEV))


def _kext_qconfigs():
    for comp, (ept, warps, unroll, persist) in itertools.product(
            ("0.125", "0.25", "0.5", "1.0"), ((8, 4, 2, False), (16, 4, 1, True))):
        yield Q.QuantConfig("nvfp4", comp, 1024, "presum", ept=ept, warps=warps,
                            unroll=unroll, persist=persist, write_codes=False, write_xop=True,
                            alpha="static", kp_align=256)


@pytest.mark.parametrize("cfg", list(_kext_qconfigs()), ids=lambda c: (
    f"{c.compensation}-e{c.ept}w{c.warps}u{c.unroll}{'p' if c.persist else ''}"))
def test_kext_presum_quantizer_is_bit_exact(cfg):
    """K-Ext in layout presum (each selected channel's quantized residue added onto its base
    channel, rounded once to FP16) against operand_reference, two mask draws."""
    if cfg not in _QCACHE:
        _QCACHE[cfg] = Q.compile_config(cfg, ARCH)[0]
    kern = _QCACHE[cfg]
    for (kind, m), seed in itertools.product(itertools.product(Q.INPUT_KINDS, (1, 37)), (3, 4)):
        x = Q.make_inputs(kind, m, cfg.k, seed=m * 7 + len(kind) + seed, device=DEV)
        masks = Q.random_masks(cfg.k, cfg.compensation, seed=seed, device=DEV)
        alpha = formats.nvfp4_global_scale(x.float()).reshape(1).to(DEV, torch.float32)
        out = kern.outputs(m, 8, DEV)
        out.operand.xop.view(torch.uint8).fill_(0xFF)            # NaN: every byte written
        got = kern(x, out, alpha=alpha, masks=masks)
        torch.cuda.synchronize()
        ref = Q.operand_reference(x, "nvfp4", cfg.compensation, "presum", 8, alpha, masks, 256)
        assert got.xop.dtype == torch.float16 and got.xop.shape == ref.xop.shape
        assert torch.equal(got.xop.view(torch.int16), ref.xop.view(torch.int16)), \
            f"{kind} m={m} seed={seed}: {(got.xop != ref.xop).sum()} values differ"


# ----------------------------------------------------------------------------- GEMM


def _variants(p: LinearProblem) -> list[LinearSm90WgmmaVariant]:
    """The prior's first presum variant, the default's presum twin and a split-K, narrow-tile
    one-consumer presum variant (where valid)."""
    space = [v for v in FAMILY.space(p, ARCH) if v.presum]
    assert space, "no presum variant in the NVFP4 M-Ext space"
    out = [min(space, key=lambda v: FAMILY.prior(v, p)),
           dataclasses.replace(FAMILY.default(p, ARCH), fold=Fold.PRESUM)]
    sk = LinearSm90WgmmaVariant(1, 1, 32, 8, Raster.CH, Packing.NIB, 2, True, Fold.PRESUM)
    if FAMILY.why_invalid(sk, p, ARCH) is None:
        out.append(sk)
    return list(dict.fromkeys(out))


@pytest.mark.parametrize("m", (64, 128, 2048))
@pytest.mark.parametrize("n, k", QWEN3_8B, ids=lambda s: str(s))
def test_presum_qwen3_8b(n, k, m):
    p = LinearProblem("nvfp4", "full", m, n, k)
    for v in _variants(p):
        assert FAMILY.why_invalid(v, p, ARCH) is None, FAMILY.why_invalid(v, p, ARCH)
        r = FAMILY.runner(_compiled(v, p), v, p, DEV, n_sets=1, seed=m)
        assert r.rows == m
        r.as_layer()                       # the real quant_sm90 presum quantizer in front
        assert r.quantizer.config.layout == "presum"
        check_runner(r, v, m, k)


def test_presum_rounds_once_to_fp16_on_the_gpu():
    """Token 0's sum 1 + 2^-12 and -1 (FP16 rounds the first to 1) on an all-ones weight:
    exactly 0 with presum; token 1 (1 + 2^-9, an FP16 value) gives the weight row sum."""
    n, k = 128, 256
    qw = C.prepare_weight(torch.ones(n, k), "nvfp4")
    p = LinearProblem("nvfp4", "full", 2, n, k)
    v = LinearSm90WgmmaVariant(1, 1, 16, 2, Raster.TOK, Packing.SPLIT, fold=Fold.PRESUM)
    launch = FAMILY.launcher(_compiled(v, p), v, p, DEV)
    wt = prepare_wgmma_weight(qw, "split")
    wt = dataclasses.replace(wt, **{f.name: getattr(wt, f.name).to(DEV)
                                    for f in dataclasses.fields(wt)
                                    if isinstance(getattr(wt, f.name), torch.Tensor)})
    s = torch.zeros(2, k)
    s[0, 0], s[0, 1] = 1.0 + 2.0 ** -12, -1.0
    s[1, 5] = 1.0 + 2.0 ** -9
    xop = torch.zeros(8, k, dtype=torch.float16)
    xop[:2] = formats.presum_fp16(s, "nvfp4").to(torch.float16)
    out = torch.full((2, n), float("nan"), dtype=torch.bfloat16, device=DEV)
    launch(wt, xop.to(DEV), 2, 2, torch.ones(1, device=DEV), out)
    torch.cuda.synchronize()
    assert bool((out[0] == 0).all())
    unit = formats.dequantize(qw.q, apply_global_scale=False).float()
    want = ((s[1:2] @ unit.T) * float(qw.q.global_scale)).to(torch.bfloat16)
    assert torch.equal(out[1].cpu(), want[0])


def test_presum_layer_replays_in_a_cuda_graph():
    p = LinearProblem("nvfp4", "full", 128, 4096, 4096)
    v = dataclasses.replace(_variants(p)[0], pdl=True)
    assert FAMILY.why_invalid(v, p, ARCH) is None
    r = FAMILY.runner(_compiled(v, p), v, p, DEV, n_sets=1, seed=3)
    r.as_layer()
    assert r.check().ok
    eager = r().clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        r()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        r()
    r.out.fill_(float("nan"))
    g.replay()
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(r.out.view(torch.int16), eager.view(torch.int16))
