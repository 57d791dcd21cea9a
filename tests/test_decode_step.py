"""bench/decode_step.py on the CPU: a small Qwen3-like model's layers chained through the real
resgen.ops path (the linear kernels' CPU simulations and the attention reference standing in
for the GPU kernels), checked against the reference step, plus the BF16 stack and the table.
The GPU run itself (CUDA graphs, timings) is the script's main."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))

import decode_step as S  # noqa: E402
from fakefam import isolated_cache  # noqa: E402,F401  (the fixture below)
from resgen.models import ModelSpec  # noqa: E402
from resgen.search import linear_sm90_mma as LS  # noqa: E402
from resgen.search import linear_sm90_wgmma as LW  # noqa: E402
from test_ops import _Compiles, _empty_dispatcher, _quantizers, _RefAttention  # noqa: E402

pytestmark = pytest.mark.usefixtures("isolated_cache")
SPEC = ModelSpec("tiny", hidden=256, intermediate=512, heads=4, kv_heads=2, head_dim=64,
                 layers=2)


def _stacks(compensated: bool, batch: int = 3, kv_len: int = 40):
    gen = torch.Generator().manual_seed(1)
    weights = [S.LayerWeights.random(SPEC, gen, "cpu") for _ in range(2)]
    h0 = (torch.randn(batch, SPEC.hidden, generator=gen) * 2).to(torch.bfloat16)
    bf16 = S.Bf16Stack(SPEC, weights, batch, kv_len, gen, "cpu")
    scales = S.input_scales(SPEC, bf16, h0)
    v = LW.LinearSm90WgmmaVariant(1, 2, 16, 3, LW.Raster.CH, LS.Packing.NIB)
    lin = dict(variant=v, compile_fn=_Compiles(), quantizer_fn=_quantizers([]))
    ref_op = _RefAttention([])

    def op_fn(compiled, vv, p):             # the kernel's launcher refuses strided inputs
        op = ref_op(compiled, vv, p)

        def checked(q, *args, **kw):
            assert q.is_contiguous(), "the attention kernel needs a contiguous [B, Hq, D] q"
            return op(q, *args, **kw)
        return checked
    att = dict(dispatcher=_empty_dispatcher(), compile_fn=lambda f, vv, p, a: object(),
               op_fn=op_fn)
    appended = []

    def append_fn(cache, k, v, bt, pos):    # the reference append with the kernel's contract
        assert k.dtype == v.dtype == torch.bfloat16 and k.is_contiguous() and v.is_contiguous()
        assert pos.dtype == torch.int32 and pos.tolist() == [[b, kv_len - 1] for b in
                                                             range(batch)]
        appended.append(k.shape)
        cache.append(k.float(), v.float(), bt, pos.long())
    st = S.ResgenStack(SPEC, weights, scales, compensated, batch, kv_len, 16, gen, "cpu",
                       linear_kwargs=lin, attention_kwargs=att, append_fn=append_fn)
    st.appended = appended
    # the BF16 stack attends over the same (dequantized, BF16-exact) KV as the FP4 stack
    for i, (cache, bt, sl) in enumerate(st.caches):
        kv = [cache.gather(bt[b], int(sl[b])) for b in range(batch)]
        bf16.kv[i] = tuple(torch.stack([x[j] for x in kv]).to(torch.bfloat16) for j in (0, 1))
    return bf16, st, h0, scales


@pytest.mark.parametrize("compensated", [False, True])
def test_resgen_step_matches_the_reference_step(compensated):
    bf16, st, h0, scales = _stacks(compensated)
    assert len(scales) == 2 and all(s[n] > 0 for s in scales for n in S.PROJ)
    st.warmup()
    chk = st.check(h0)
    assert chk["ok"] and chk["rel_err"] <= S.LINEAR_TOL, chk      # ok: no NaN / Inf either
    assert set(chk["ops"]) == set(S.PROJ) | {"append", "attention"}
    assert chk["ops"]["append"]["rel_err"] == 0                   # bit-exact bytes
    assert 0 <= chk["drift"] < 0.3
    # check() runs the step twice (kernels, then the references alone); st(h0) once more
    assert st.appended == [(3, SPEC.kv_heads, SPEC.head_dim)] * 2     # once per layer
    st.appended.clear()
    out = st(h0)
    assert out.shape == h0.shape and out.dtype == torch.bfloat16
    # FP4 weights and activations against BF16: different, but the same computation
    ref = bf16(h0).float()
    rel = float((out.float() - ref).norm() / ref.norm())
    assert 1e-3 < rel < 0.3, rel


def test_check_names_the_kernel_that_is_wrong():
    _, st, h0, _ = _stacks(True)
    st.warmup()
    good = st.linears[1]["o"]
    st.linears[1]["o"] = lambda x: (good(x).float() * 1.01).to(torch.bfloat16)   # 1% off
    good_append = st.append

    def bad_append(cache, k, v, bt, pos):    # a flipped code byte in the new K token
        good_append(cache, k, v, bt, pos)
        page, slot = cache.append_slots(bt, pos)
        cache.k_codes[page[0], 0, slot[0], 0] ^= 0x11
    st.append = bad_append
    chk = st.check(h0)
    assert not chk["ok"]
    assert not chk["ops"]["o"]["ok"] and chk["ops"]["o"]["rel_err"] > S.LINEAR_TOL
    assert not chk["ops"]["append"]["ok"] and chk["ops"]["append"]["rel_err"] >= 1
    assert all(chk["ops"][n]["ok"] for n in ("qkv", "gate_up", "down", "attention"))
    assert "o: rel err" in chk["detail"] and "append:" in chk["detail"]


def test_glue_stack_runs_the_step_without_kernels():
    glue = S.GlueStack(SPEC, 2, 3, "cpu")
    h = torch.randn(3, SPEC.hidden).to(torch.bfloat16)
    # zero projections: the residual stream passes through unchanged
    assert torch.equal(glue(h), h)


def test_compensation_brings_the_step_closer_to_bf16():
    bf16, plain, h0, _ = _stacks(False)
    _, comp, _, _ = _stacks(True)
    ref = bf16(h0).float()
    e = {name: float((st(h0).float() - ref).norm() / ref.norm())
         for name, st in (("plain", plain), ("comp", comp))}
    assert e["comp"] < e["plain"], e


def test_table_reports_per_layer_ratios():
    row = {"model": "qwen3-8b", "batch": 32, "kv_len": 32768, "layers": 4,
           "bf16": {"us": 4000.0}, "glue": {"us": 400.0},
           "plain": {"us": 2000.0, "check": {"rel_err": 1e-3, "drift": 0.1}},
           "compensated": {"us": 2200.0, "check": {"rel_err": 2e-3, "drift": 0.02}}}
    line = S.table([row]).splitlines()[1].split()
    assert line[:3] == ["qwen3-8b", "32", "32K"]
    assert line[3:] == ["1000.0", "500.0", "2.00", "550.0", "1.82", "1.100", "100.0", "2.00",
                        "1e-03/2e-03", "1e-01/2e-02"]


def test_kernel_summary_splits_wall_into_busy_and_gaps():
    # two chains of: a [0, 10], b [12, 20] overlapping c [18, 25]; then a [30, 40], b [42, 50]
    spans = [("a", 0, 10), ("b", 12, 20), ("c", 18, 25), ("a", 30, 40), ("b", 42, 50)]
    r = S.kernel_summary(spans, chains=2)
    assert r["wall_us"] == 25.0                     # 50 us over 2 chains
    assert r["busy_us"] == (10 + 13 + 10 + 8) / 2   # the c overlap counted once
    assert r["gap_us"] == r["wall_us"] - r["busy_us"]
    assert r["kernels"] == 2.5
    assert [k["name"] for k in r["top"]] == ["a", "b", "c"]
    assert r["top"][0] == {"name": "a", "us": 10.0, "count": 1.0}
    assert S.kernel_summary([], 3)["wall_us"] == 0.0


def test_profile_table_lists_each_profiled_stack():
    pr = {"wall_us": 400.0, "busy_us": 300.0, "gap_us": 100.0, "kernels": 80.0,
          "top": [{"name": "gemm", "us": 120.0, "count": 4.0}]}
    row = {"model": "qwen3-8b", "batch": 1, "kv_len": 4096, "layers": 4,
           "bf16": {"us": 1.0, "profile": pr}, "glue": {"us": 1.0},
           "plain": {"us": 1.0}, "compensated": {"us": 1.0, "profile": pr}}
    out = S.profile_table([row]).splitlines()
    assert out[0].startswith("qwen3-8b B=1 KV=4096 bf16: 30.0 us x1 gemm")
    assert out[-1].split() == ["qwen3-8b", "1", "4K", "compensated", "100.0", "75.0", "25.0",
                               "20.0"]
