"""Q16 decode attention (FP16 query x NVFP4 K/V, the query never quantized; issue 20 section 2)
on the CPU: the reference numerics against the FP32 attention, the workload key (old keys
parse as before), the family's space, the lane-level emulation against the Q16 reference,
render identity of every existing variant with the pinned renders, and sm_90a compiles."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from resgen import reference as R
from resgen.kernels.attention_sm90_emu import EmuConfig, emulate_decode_attention
from resgen.kvcache import PagedKVCache
from resgen.search.attention_sm90 import FAMILY, AttentionSm90Variant, Packing, preset
from resgen.search.variant import AttentionProblem

ARCH = "sm_90a"
HERE = Path(__file__).resolve().parent


# ----------------------------------------------------------------------------- numerics


def test_query_fp16_is_exact_for_bf16_and_never_overflows():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 5, 128, generator=g)
    q[0, 0] *= 1e30                      # far beyond FP16's 65504
    q[0, 1] *= 1e-30                     # far below FP16's smallest subnormal
    q[1, 2] = 0.0                        # an all-zero row
    q[2, 3, :4] = torch.tensor([3e38, -1e-3, 7.0, 0.0])   # BF16's range end next to small values
    q = q.bfloat16().float()
    q16, scale = R.query_fp16(q)
    assert q16.shape == q.shape and scale.shape == (3, 5, 1)
    assert bool(torch.isfinite(q16).all()) and bool((q16.abs() < 2 ** 15).all())
    assert torch.equal(q16.half().float(), q16)                   # FP16 values
    e = torch.log2(scale)
    assert torch.equal(e, e.round())                              # powers of two
    amax = q.abs().amax(-1, keepdim=True)
    nz = amax > 0
    ratio = amax[nz] / scale[nz]
    assert bool(((ratio >= 2 ** 14) & (ratio < 2 ** 15)).all())
    # exact wherever the element is >= amax * 2^-31 (every element here but the 1e-3 and 0.0
    # next to 3e38, which underflow to zero: an error <= amax * 2^-39)
    exact = (q.abs() >= amax * 2.0 ** -31) | (q == 0)
    assert torch.equal((q16 * scale)[exact], q[exact])
    err = ((q16 * scale) - q).abs()
    assert bool((err <= amax * 2.0 ** -39).all())
    assert float(scale[1, 2, 0]) == 2.0 ** -126 and bool((q16[1, 2] == 0).all())
    with pytest.raises(ValueError, match="NaN"):
        R.query_fp16(torch.tensor([[float("nan"), 1.0]]))


def test_the_kernel_and_the_reference_use_one_scale_offset():
    pytest.importorskip("cutlass.cute", reason="CuTe DSL not installed")
    from resgen.kernels import attention_sm90_q16_device as Q

    assert Q.Q16_EXP_OFFSET == R.Q16_EXP_OFFSET


def _cache(seed, bsz=3, hkv=2, group=4, d=128, n=300, outliers=False, bf16=True):
    g = torch.Generator().manual_seed(seed)
    ks = [torch.randn(hkv, n, d, generator=g) for _ in range(bsz)]
    vs = [torch.randn(hkv, n, d, generator=g) for _ in range(bsz)]
    cache, bt, sl = PagedKVCache.from_dense(ks, vs, page_size=32)
    q = torch.randn(bsz, hkv * group, d, generator=g) * 2
    if outliers:            # a few channels 20x larger, as real queries have
        idx = torch.randint(0, d, (bsz, hkv * group, 4), generator=g)
        q.scatter_(-1, idx, torch.randn(bsz, hkv * group, 4, generator=g) * 40)
    if bf16:
        q = q.bfloat16().float()
    kd, vd = [], []
    for b in range(bsz):
        ku, vu = cache.gather_unit(bt[b], n)
        kd.append(ku * float(cache.k_scale))
        vd.append(vu * float(cache.v_scale))
    return q, cache, bt, sl, (ks, vs), (kd, vd)


MODES = {"plain": dict(compensation=False), "resattn": dict(compensation=True),
         "presum": dict(compensation=True, fold="presum"),
         "q16": dict(compensation=False, query="q16")}


@pytest.mark.parametrize("outliers", [False, True], ids=["random", "outliers"])
def test_q16_is_closer_to_the_fp32_attention_than_resattn_and_plain(outliers):
    """Against FP32 attention over the same decoded NVFP4 K/V (what the query mode alone
    changes), measured: BF16 queries, random / outlier-heavy: plain NMSE 3.6e-2 / 2.9e-2,
    ResAttn 2.2e-4 / 8.2e-4, presum 2.2e-4 / 8.2e-4, Q16 below 1e-12 (the BF16 query is exact
    in FP16: only float64 summation order is left); FP32 queries: Q16 ~1.1e-7 (one FP16
    rounding), over 1000x below ResAttn."""
    q, cache, bt, sl, _, (kd, vd) = _cache(0, outliers=outliers)
    ref = R.attention_fp32(q.double(), [k for k in kd], [v for v in vd])
    err = {m: R.nmse(R.decode_attention(q, cache, bt, sl, **kw), ref) for m, kw in MODES.items()}
    assert err["q16"] < 1e-12, err
    assert err["resattn"] > 1e-5 and err["plain"] > 10 * err["resattn"], err
    assert err["presum"] > 1e-5, err              # presum rounds the quantized query: no gain
    q32, cache, bt, sl, _, (kd, vd) = _cache(1, outliers=outliers, bf16=False)
    ref = R.attention_fp32(q32.double(), kd, vd)
    e16 = R.nmse(R.decode_attention(q32, cache, bt, sl, **MODES["q16"]), ref)
    eres = R.nmse(R.decode_attention(q32, cache, bt, sl, **MODES["resattn"]), ref)
    assert 0 < e16 < 1e-3 * eres, (e16, eres)


def test_q16_total_error_is_no_worse_than_resattn_over_seeds():
    """Against FP32 attention on the unquantized K/V, the NVFP4 K/V error dominates every mode
    (NMSE ~3e-2 random, ~1e-1 with outliers); averaged over 4 seeds Q16 is not worse than
    ResAttn (the query error it removes is the only difference) and far better than plain."""
    for outliers in (False, True):
        tot = {"plain": 0.0, "resattn": 0.0, "q16": 0.0}
        for seed in range(4):
            q, cache, bt, sl, (ks, vs), _ = _cache(seed, bsz=2, n=200, outliers=outliers)
            full = R.attention_fp32(q, ks, vs)
            for m in tot:
                tot[m] += R.nmse(R.decode_attention(q, cache, bt, sl, **MODES[m]), full)
        assert tot["q16"] <= 1.02 * tot["resattn"] and tot["q16"] < 0.9 * tot["plain"], tot


def test_reference_refuses_q16_with_a_residue():
    q, cache, bt, sl, _, _ = _cache(0, bsz=1, n=40)
    for kw in (dict(compensation=True), dict(compensation=False, fold="presum")):
        with pytest.raises(ValueError, match="q16"):
            R.decode_attention(q, cache, bt, sl, query="q16", **kw)
    with pytest.raises(ValueError, match="query must be"):
        R.decode_attention(q, cache, bt, sl, compensation=False, query="fp16")


# ----------------------------------------------------------------------------- workload key


def test_attention_key_keeps_old_keys_and_separates_q16():
    old = AttentionProblem(batch=8, kv_len=8192, compensation=False)
    assert "query" not in json.loads(old.key())       # written before the field existed
    legacy = json.dumps({k: v for k, v in json.loads(old.key()).items()})
    assert AttentionProblem.from_key(legacy) == old and old.query == "nvfp4"
    q16 = dataclasses.replace(old, query="q16")
    assert q16.key() != old.key() and q16.digest() != old.digest()
    assert AttentionProblem.from_key(q16.key()) == q16
    with pytest.raises(ValueError, match="compensation must be False"):
        AttentionProblem(compensation=True, query="q16")
    with pytest.raises(ValueError, match="query"):
        AttentionProblem.from_dict({**json.loads(old.key()), "query": "fp16"})
    with pytest.raises(ValueError, match="compensation must be False"):
        AttentionProblem.from_dict({**json.loads(old.key()), "compensation": True,
                                    "query": "q16"})


# ----------------------------------------------------------------------------- family


def _q16(**kw) -> AttentionProblem:
    return AttentionProblem(**{"compensation": False, "query": "q16", **kw})


@pytest.mark.parametrize("hq, hkv, d, page", [(32, 8, 128, 32), (64, 8, 128, 32),
                                              (8, 8, 64, 16), (16, 2, 256, 64)])
def test_q16_space_is_dense_valid_and_holds_the_preset(hq, hkv, d, page):
    for b, n in ((1, 8192), (32, 32768)):
        p = _q16(batch=b, q_heads=hq, kv_heads=hkv, head_dim=d, kv_len=n, page_size=page)
        space = FAMILY.space(p, ARCH)
        assert space and all(v.packing == Packing.DENSE for v in space)
        assert all(FAMILY.why_invalid(v, p, ARCH) is None for v in space)
        assert preset(p) in space and FAMILY.default(p, ARCH) == preset(p)
        plain = dataclasses.replace(p, query="nvfp4")
        dense_plain = [v for v in FAMILY.space(plain, ARCH) if v.packing == Packing.DENSE]
        assert space == dense_plain         # the same axes as plain's dense variants
    pair = AttentionSm90Variant(packing=Packing.PAIR)
    assert "dense" in FAMILY.why_invalid(pair, _q16(), ARCH)


def test_q16_changes_the_render_and_the_compile_key():
    from resgen.kernels import codegen

    p = _q16(batch=8, kv_len=8192)
    v = preset(p)
    plain = dataclasses.replace(p, query="nvfp4")
    ck, ckp = FAMILY.compile_key(v, p), FAMILY.compile_key(v, plain)
    assert ck.key() != ckp.key()
    src = codegen.render(FAMILY.TEMPLATE, FAMILY.template_params(v, ck))
    src_p = codegen.render(FAMILY.TEMPLATE, FAMILY.template_params(v, ckp))
    assert "attention_sm90_q16_device as Q16" in src and "Q16.query_stage_q16(" in src
    assert "query_split(" not in src and "q16 helpers digest:" in src
    assert "Q16.query_stage_q16(" not in src_p and "D.query_split(" in src_p
    # the substitute-only template imports both query-stage modules in every render, so the
    # kernel modules (and their digest) are shared; the renders differ
    assert codegen.kernel_modules_digest(src) == codegen.kernel_modules_digest(src_p)
    assert src != src_p
    # issue 18: the template substitutes only (no Jinja control blocks): checked for every
    # template by test_codegen.test_kernel_templates_only_substitute


def test_renders_are_byte_identical_to_the_pinned_substitute_only_template():
    """Every variant of the sample's plain / ResAttn spaces renders exactly as the fixture
    pins and imports the same resgen.kernels modules, so no change moves an attention
    fingerprint unnoticed. The fixture was rewritten when the template became substitute-only
    (issue 18: no `{% if %}`; every shipped attention row was proven PTX- and host-IR-equal
    to the branching template by `resgen db refingerprint --check-ptx auto`, tier 2,
    tuned/README.md); before that it pinned e045ab3's renders through the Q16 change. Re-pinned
    at 1213aef (issue 18: one inline-PTX module sm90_ptx, so the kernel-module digest moved),
    every shipped attention row again proven equal at tier 2.
    Rewrite it only with such a proof: `python tests/attention_render_sample.py >
    tests/fixtures/attention_sm90_render.json`."""
    import sys
    sys.path.insert(0, str(HERE))
    try:
        import attention_render_sample as S
    finally:
        sys.path.remove(str(HERE))
    want = json.loads((HERE / "fixtures" / "attention_sm90_render.json").read_text())
    got = S.render_digests()
    assert len(want) == 673 and got.keys() == want.keys()
    bad = [k for k in want if got[k] != want[k]]
    assert not bad, f"{len(bad)} renders differ from the pinned ones (e.g. {bad[:3]})"


# ----------------------------------------------------------------------------- emulation


EMU_CASES = [
    # lens, hq, hkv, d, page, cfg
    ([70, 0, 1, 33], 8, 2, 128, 32, EmuConfig(compensation=False, packing="dense",
                                              query="q16")),
    ([90, 45], 16, 2, 128, 32, EmuConfig(compensation=False, packing="dense", query="q16",
                                         num_splits=3, num_warps=2)),
    ([100, 17], 8, 8, 64, 16, EmuConfig(compensation=False, packing="dense", query="q16",
                                        kc=16)),
    ([60, 5], 12, 2, 256, 64, EmuConfig(compensation=False, packing="dense", query="q16",
                                        num_splits=2)),
    ([129], 6, 2, 128, 32, EmuConfig(compensation=False, packing="dense", query="q16",
                                     num_warps=8, pv="fp8")),
]


@pytest.mark.parametrize("case", EMU_CASES, ids=lambda c: f"{c[5]}")
def test_emulated_q16_kernel_matches_the_q16_reference(case):
    """The lane-level emulation of the Q16 data path (FP16 columns, row scales in the alpha
    slot, dense packing) against reference Q16 on fresh random inputs with outlier channels
    and a huge-magnitude row (no FP16 overflow)."""
    lens, hq, hkv, d, page, cfg = case
    g = torch.Generator().manual_seed(sum(lens) + d)
    ks = [torch.randn(hkv, n, d, generator=g) * 2 for n in lens]
    vs = [torch.randn(hkv, n, d, generator=g) for n in lens]
    cache, bt, sl = PagedKVCache.from_dense(ks, vs, page_size=page)
    q = torch.randn(len(lens), hq, d, generator=g) * 2
    q[:, :, 3] *= 30
    q[0, 0] *= 1e6                     # 2e6: a plain BF16 -> FP16 cast would overflow
    q = q.bfloat16().float()
    out = emulate_decode_attention(q, cache, bt, sl, cfg)
    pv = "fp32" if cfg.pv == "f16" else "fp8"
    ref = R.decode_attention(q, cache, bt, sl, compensation=False, query="q16", pv=pv)
    assert bool(torch.isfinite(out).all())         # NaN never passes
    for b, n in enumerate(lens):
        if n == 0:
            assert torch.equal(out[b], torch.zeros_like(out[b]))
    rel = float((out - ref).norm() / ref.norm())
    assert rel < (2e-4 if cfg.pv == "f16" else 2e-2), rel
    plain = R.decode_attention(q, cache, bt, sl, compensation=False, pv=pv)
    assert float((out - plain).norm() / plain.norm()) > 5 * rel    # not the plain path


def test_emulator_refuses_a_q16_config_with_a_residue():
    with pytest.raises(ValueError, match="q16"):
        EmuConfig(query="q16")
    with pytest.raises(ValueError, match="query"):
        EmuConfig(query="int8")


def test_ops_decode_attention_q16_arguments():
    from resgen.ops import DecodeAttention

    common = dict(arch=ARCH, compile_fn=lambda f, v, p, a: None, op_fn=lambda c, v, p: None)
    a = DecodeAttention(32, 8, 128, query="q16", **common)
    assert a.compensation is False and a.problem(8, 8192).query == "q16"
    assert DecodeAttention(32, 8, 128, **common).compensation is True       # ResAttn default
    with pytest.raises(ValueError, match="residue"):
        DecodeAttention(32, 8, 128, query="q16", compensation=True, **common)
    with pytest.raises(ValueError, match="query"):
        DecodeAttention(32, 8, 128, query="fp16", **common)


# ----------------------------------------------------------------------------- sm_90a builds


Q16_COMPILE_CASES = [
    (dict(batch=8, kv_len=8192), None),                                      # Qwen3-8B preset
    (dict(batch=1, q_heads=64, kv_heads=8, kv_len=32768),
     dict(num_warps=8, kc=16, prefetch=False)),                              # 32B, no prefetch
]


@pytest.mark.parametrize("case", Q16_COMPILE_CASES, ids=["8b-preset", "32b-w8-kc16"])
def test_q16_compiles_for_sm90a_without_spills(case):
    pytest.importorskip("cutlass.cute", reason="CuTe DSL not installed")
    from resgen.search.build import compile_variant

    kw, over = case
    p = _q16(**kw)
    v = preset(p) if over is None else dataclasses.replace(preset(p), **over)
    assert FAMILY.why_invalid(v, p, ARCH) is None
    out = compile_variant(FAMILY, v, p, ARCH)
    assert out.ok, out.error
    assert out.registers is not None and out.registers <= 255
    assert out.spill_bytes == 0, f"{out.spill_bytes} bytes of local memory"


# ----------------------------------------------------------------------------- the GPU probe


def _probe():
    import importlib.util

    path = HERE.parent / "bench" / "probes" / "q16_probe.py"
    spec = importlib.util.spec_from_file_location("q16_probe", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_q16_probe_plan_is_valid_and_compiles_little():
    """bench/probes/q16_probe.py: 12 points x 3 modes, every candidate valid for its mode, and
    few distinct compiles (the device call is sized by them: about 15 s each)."""
    P = _probe()
    pts = P.points()
    assert len(pts) == 12 and pts[0][2] == 32768
    idents = set()
    for geom, b, n in pts:
        for mode in P.MODES:
            p = P.problem(geom, b, n, mode)
            assert p.query == ("q16" if mode == "q16" else "nvfp4")
            assert p.compensation == (mode == "resattn")
            vs = P.candidates(p)
            assert vs and all(FAMILY.why_invalid(v, p, ARCH) is None for v in vs)
            if mode == "q16":
                assert all(v.packing == Packing.DENSE for v in vs)
            idents |= {P.compile_identity(v, p) for v in vs}
    assert len(idents) <= 16, len(idents)


def test_q16_probe_summary_table():
    P = _probe()
    rows = [{"point": "qwen3-8b b=8 kv=32K", "q16": {"best": {"us": 50.0}},
             "plain": {"best": {"us": 49.0}}, "resattn": {"best": {"us": 52.0}},
             "flashinfer": {"us": 80.0}},
            {"point": "qwen3-32b b=1 kv=8K", "q16": {"best": None}, "plain": {"best": None},
             "resattn": None}]
    lines = P.summary(rows)
    assert len(lines) == 3 and "q16/plain" in lines[0]
    assert "1.020" in lines[1] and "0.962" in lines[1] and "80.00" in lines[1]
    assert lines[2].split()[-1] == "-"


def test_tune_attention_modes():
    """`resgen tune --attn-modes`: q16 workloads only when asked (not in the default list until
    the shipped table covers them), bad names refused."""
    from resgen.models import get_model, tuning_workloads

    m8 = [get_model("qwen3-8b")]
    default = tuning_workloads(FAMILY, m8, attn_batches=[1, 8], kv_lens=[8192])
    assert default and all(p.query == "nvfp4" for p in default)
    assert {p.compensation for p in default} == {True, False}
    q16 = tuning_workloads(FAMILY, m8, attn_batches=[1, 8], kv_lens=[8192], attn_modes=["q16"])
    assert len(q16) == len(default) // 2
    assert all(p.query == "q16" and not p.compensation for p in q16)
    with pytest.raises(ValueError, match="attention modes"):
        tuning_workloads(FAMILY, m8, attn_modes=["q8"])
