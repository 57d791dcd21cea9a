"""attention_sm90 on an H200: device primitives bit for bit against the CPU emulator, every
reduction mode / packing / PV path / chunk size on fresh random inputs with NaN-poisoned
outputs against resgen.reference (variable lengths, lengths not a multiple of the page size,
batch 1..64, empty (zeros) and length-1 sequences), bit-identical reruns, last-CTA counters
re-armed, CUDA-graph replay, and the append kernel bit-exact to PagedKVCache.append.
Q16 (query "q16": the FP16 query, never quantized) the same way, plus queries whose plain
BF16 -> FP16 cast would overflow, and Q16 closer to the FP32 attention than ResAttn."""

from __future__ import annotations

import dataclasses
import json
import math
import zlib

import pytest
import torch

from resgen import reference as R
from resgen.kvcache import PagedKVCache
from resgen.search import build
from resgen.search.attention_sm90 import (FAMILY, TOLERANCE, AttentionSm90Variant, Packing,
                                          Reduction, compare, shape_of)
from resgen.search.variant import AttentionProblem

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ARCH = "sm_90a"
# compile identity -> CompileOutcome; shared with bench/gpu_attention_check.py, which runs this
# module in-process first (the split count is a run-time argument: not part of the identity)
COMPILED: dict[str, object] = {}


def compile_identity(v: AttentionSm90Variant, p: AttentionProblem) -> str:
    """What a compile depends on: the rendered template parameters (no batch, KV length, head
    counts beyond the group, or split count)."""
    return json.dumps(FAMILY.template_params(v, FAMILY.compile_key(v, p)), sort_keys=True)


def compiled(v: AttentionSm90Variant, p: AttentionProblem):
    """CompileOutcome of (v, p), compiled once per identity (asserts it compiled, no spills)."""
    key = compile_identity(v, p)
    if key not in COMPILED:
        out = build.compile_variant(FAMILY, v, p, ARCH)
        assert out.ok, out.error
        assert out.spill_bytes == 0, f"{out.spill_bytes} bytes of local memory"
        COMPILED[key] = out
    return COMPILED[key]


def _op(v: AttentionSm90Variant, p: AttentionProblem):
    from resgen.kernels.attention_sm90 import DecodeAttentionSm90

    assert FAMILY.why_invalid(v, p, ARCH) is None, FAMILY.why_invalid(v, p, ARCH)
    return DecodeAttentionSm90(compiled(v, p).compiled, shape_of(v, p), v.splits)


def _inputs(lens, hq, hkv, d, page, seed, k_scale=1.0, v_scale=1.0, q_hostile=False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    ks = [torch.randn(hkv, n, d, generator=g, device="cuda") * 2 for n in lens]
    vs = [torch.randn(hkv, n, d, generator=g, device="cuda") for n in lens]
    cache, bt, sl = PagedKVCache.from_dense(ks, vs, page_size=page, k_scale=k_scale,
                                            v_scale=v_scale, seed=seed)
    q = torch.randn(len(lens), hq, d, generator=g, device="cuda") * 2
    if q_hostile:           # outlier channels, a row past FP16's range, a tiny and a zero row
        q[:, :, 5] *= 40
        q[0, 0] *= 1e6
        q[-1, -1] *= 1e-20
        q[0, -1] = 0
    q = q.to(torch.bfloat16)
    return q, cache, bt, sl, ks, vs


def _run_check(v, p, lens, seed=0, k_scale=1.0, v_scale=1.0, q_hostile=False):
    op = _op(v, p)
    q, cache, bt, sl, _, _ = _inputs(lens, p.q_heads, p.kv_heads, p.head_dim, p.page_size, seed,
                                     k_scale, v_scale, q_hostile)
    out = torch.full_like(q, float("nan"))
    op(q, cache, bt, sl, out=out)
    torch.cuda.synchronize()
    # The reference runs on CUDA here: it must compute the same bits as on the CPU (IEEE
    # divisions only; tests/test_attention_sm90.py checks that on the inputs of the first H200
    # run, where a Python-scalar division in quantize_query flipped plain-path query codes).
    ref = R.decode_attention(q.float(), cache, bt, sl, compensation=p.compensation,
                             pv="fp32" if p.pv == "f16" else "fp8", query=p.query)
    res = compare(out, ref, TOLERANCE[p.pv])
    assert res.ok, f"{v.name()} {p.key()} lens={lens}: {res.detail} (rel {res.rel_err:.3e})"
    for b, n in enumerate(lens):
        if n == 0:
            assert torch.equal(out[b].float(), torch.zeros_like(out[b].float())), \
                "empty sequence must give zeros"
    return op, (q, cache, bt, sl), out


# ----------------------------------------------------------------------------- primitives


def _probe_expected(inp: torch.Tensor) -> torch.Tensor:
    """What the probe kernel must write, from the CPU emulator's definitions. inp: int64
    [32, 8] of uint32 values. Returns int64 [32, 32] (words 20..28 are compared separately)."""
    from resgen.kernels import attention_sm90_emu as E

    w, sk, wa, wb, sv, f0b, f1b, x = (inp[:, i] for i in range(8))
    f0, f1 = _as_f32(f0b), _as_f32(f1b)
    out = torch.zeros(32, 32, dtype=torch.int64)
    x128 = E._hmul2(E._e4m3_to_f16x2(sk & 0xFF, (sk >> 8) & 0xFF),
                    torch.full_like(sk, 0x58005800))
    k0 = E.prmt(x128, x128, 0x1010)
    k1 = E.prmt(x128, x128, 0x3232)
    for i, r in enumerate(E.decode_k_word(w)):
        out[:, i] = E._hmul2(r, k0)
    out[:, 4], out[:, 5] = k0, k1
    sc = E._hmul2(E._e4m3_to_f16x2(sv & 0xFF, (sv >> 8) & 0xFF), torch.full_like(sv, 0x58005800))
    for i, r in enumerate(E.decode_v_pair(wa, wb)):
        out[:, 6 + i] = E._hmul2(r, sc)
    out[:, 14] = sc
    out[:, 15] = E._pack_f16x2(f0, f1)
    out[:, 16] = E._e4m3_bytes(f0) | (E._e4m3_bytes(f1) << 8)
    lo, hi = E.f16x2_values(x)
    out[:, 17] = E._e4m3_bytes(lo) | (E._e4m3_bytes(hi) << 8)
    out[:, 18] = E._e4m3_to_f16x2(x & 0xFF, (x >> 8) & 0xFF)
    bf = torch.stack([f0, f1], 1).to(torch.bfloat16).view(torch.int16).to(torch.int64) & 0xFFFF
    out[:, 19] = bf[:, 0] | (bf[:, 1] << 16)
    return out


def _as_f32(words: torch.Tensor) -> torch.Tensor:
    """int64 tensor of uint32 bit patterns -> float32 with those bits."""
    w = torch.where(words >= 1 << 31, words - (1 << 32), words)
    return w.to(torch.int32).view(torch.float32)


def _run_probe(inp: torch.Tensor) -> torch.Tensor:
    import sys
    from pathlib import Path

    import cutlass
    from resgen.kernels import codegen
    from resgen.kernels.attention_sm90 import _fake_ptr, _ptr, _stream
    from cutlass.cute.runtime import make_fake_stream

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import attention_sm90_probe as P

    res = codegen.compile_entry(P.probe, [_fake_ptr(cutlass.Uint32), _fake_ptr(cutlass.Uint32),
                                          make_fake_stream()], ARCH)
    dev_in = torch.where(inp >= 1 << 31, inp - (1 << 32), inp).to(torch.int32).cuda()
    dev_out = torch.zeros(32 * 32, dtype=torch.int32, device="cuda")
    res.fn(_ptr(dev_in, cutlass.Uint32), _ptr(dev_out, cutlass.Uint32), _stream())
    torch.cuda.synchronize()
    return dev_out.cpu().to(torch.int64).reshape(32, 32) & 0xFFFFFFFF


def _words(gen, n, mask=0xFFFFFFFF):
    return torch.randint(0, 1 << 32, (n,), generator=gen, dtype=torch.int64) & mask


def test_device_primitives_match_the_emulator_bit_for_bit():
    from resgen.kernels import attention_sm90_emu as E

    gen = torch.Generator().manual_seed(1)
    # launch 1: unrestricted codes, every E4M3 scale byte pattern of interest
    inp = torch.stack([_words(gen, 32) for _ in range(8)], 1)
    inp[:, 1] = torch.randint(1, 127, (32,), generator=gen) | (torch.randint(1, 127, (32,),
                                                                             generator=gen) << 8)
    inp[:, 4] = torch.randint(0, 127, (32,), generator=gen) | (torch.randint(0, 127, (32,),
                                                                             generator=gen) << 8)
    vals = torch.randn(32, 2, generator=gen) * torch.tensor([1.0, 300.0])
    inp[:, 5] = vals[:, 0].view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    inp[:, 6] = vals[:, 1].view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    halves = (torch.randn(32, 2, generator=gen) * 50).half().view(torch.int16).to(torch.int64)
    inp[:, 7] = (halves[:, 0] & 0xFFFF) | ((halves[:, 1] & 0xFFFF) << 16)
    got = _run_probe(inp)
    want = _probe_expected(inp)
    names = ["k0", "k1", "k2", "k3", "ks0", "ks1"] + [f"v{i}" for i in range(8)] + \
        ["vsc", "pack_f16x2", "f32->e4m3", "f16->e4m3", "e4m3->f16", "pack_bf16x2"]
    for i, name in enumerate(names):
        if name == "e4m3->f16":                # e4m3 NaN bytes: compare values NaN-aware
            a = torch.stack(E.f16x2_values(got[:, i]))
            b = torch.stack(E.f16x2_values(want[:, i]))
            assert torch.equal(torch.isnan(a), torch.isnan(b))
            assert torch.equal(a.nan_to_num(), b.nan_to_num()), name
            continue
        assert torch.equal(got[:, i], want[:, i]), f"{name}: {got[:4, i]} vs {want[:4, i]}"
    # launch 2: finite f16 / E4M3 fragments (bit 6 of every byte clear) for the mma checks
    inp2 = inp.clone()
    for c in (0, 2, 3, 7):
        inp2[:, c] &= 0xBFBFBFBF
    got2 = _run_probe(inp2)
    w, wa, wb, x = (inp2[:, c] for c in (0, 2, 3, 7))
    f0, f1 = _as_f32(inp2[:, 5]), _as_f32(inp2[:, 6])
    c = torch.stack([f0, f1, f0, f1], 1)
    # operand order is what this checks (a wrong order gives O(1) errors); the tolerances
    # only allow for the tensor cores' FP32 (f16) / reduced-precision (e4m3) accumulation
    for off, fn, rtol, atol in ((20, E._mma_f16, 1e-5, 1e-4), (24, E._mma_e4m3, 1e-4, 1e-3)):
        want_mma = fn([w, wa, wb, x], [wa, wb], c)
        got_mma = _as_f32(got2[:, off:off + 4])
        assert torch.allclose(got_mma, want_mma, rtol=rtol, atol=atol), (off, got_mma[:2],
                                                                          want_mma[:2])
    ex = _as_f32(got2[:, 28])
    assert torch.allclose(ex, torch.exp2(f0), rtol=1e-6)


# ----------------------------------------------------------------------------- attention


def _p(**kw) -> AttentionProblem:
    return AttentionProblem(**kw)


VARIANTS = [
    (AttentionSm90Variant(), _p()),
    (AttentionSm90Variant(prefetch=False), _p()),
    (AttentionSm90Variant(prefetch=False, splits=3, reduction=Reduction.LASTCTA), _p()),
    (AttentionSm90Variant(splits=3, reduction=Reduction.LASTCTA), _p()),
    (AttentionSm90Variant(splits=4, reduction=Reduction.WORKSPACE), _p()),
    (AttentionSm90Variant(num_warps=8, kc=16, splits=2, reduction=Reduction.LASTCTA), _p()),
    (AttentionSm90Variant(kc=16), _p(page_size=16)),
    (AttentionSm90Variant(splits=5, reduction=Reduction.LASTCTA), _p(page_size=64)),
    (AttentionSm90Variant(splits=2, reduction=Reduction.LASTCTA), _p(q_heads=64)),
    (AttentionSm90Variant(), _p(compensation=False)),
    (AttentionSm90Variant(packing=Packing.DENSE, splits=2, reduction=Reduction.WORKSPACE),
     _p(q_heads=64, compensation=False)),
    (AttentionSm90Variant(splits=2, reduction=Reduction.LASTCTA), _p(pv="fp8")),
    (AttentionSm90Variant(packing=Packing.STACK), _p(q_heads=64)),
    (AttentionSm90Variant(packing=Packing.STACK, prefetch=False, splits=3,
                          reduction=Reduction.WORKSPACE), _p(q_heads=64)),
    (AttentionSm90Variant(packing=Packing.STACK, num_warps=8, kc=16, splits=2,
                          reduction=Reduction.LASTCTA), _p(q_heads=40, kv_heads=8)),
    (AttentionSm90Variant(packing=Packing.STACK, splits=2, reduction=Reduction.LASTCTA),
     _p(q_heads=64, pv="fp8")),
    (AttentionSm90Variant(packing=Packing.STACK, prefetch=False),
     _p(q_heads=16, kv_heads=2, head_dim=256)),
    (AttentionSm90Variant(splits=3, reduction=Reduction.LASTCTA, prefetch=False),
     _p(q_heads=16, kv_heads=2, head_dim=256)),
    (AttentionSm90Variant(num_warps=2, prefetch=False),
     _p(q_heads=12, kv_heads=2, head_dim=256, pv="fp8")),
    (AttentionSm90Variant(kc=16, splits=2, reduction=Reduction.WORKSPACE),
     _p(q_heads=8, kv_heads=2, head_dim=256, page_size=16)),
    (AttentionSm90Variant(splits=2, reduction=Reduction.WORKSPACE),
     _p(q_heads=4, kv_heads=4, head_dim=64)),
    (AttentionSm90Variant(kc=16), _p(q_heads=6, kv_heads=2, head_dim=64, page_size=16)),
]


@pytest.mark.parametrize("case", VARIANTS, ids=lambda c: f"{c[0].name()}-{c[1].key()}")
def test_variant_matches_reference_on_variable_lengths(case):
    v, p = case
    lens = [300, 0, 1, 33, p.page_size, p.page_size + 1, 129]
    _run_check(v, p, lens, seed=zlib.crc32((v.key() + p.key()).encode()) % 1000)


def test_batch_1_to_64_and_global_scales():
    v = AttentionSm90Variant(splits=4, reduction=Reduction.LASTCTA)
    p = _p()
    for bsz in (1, 2, 17, 64):
        g = torch.Generator().manual_seed(bsz)
        lens = torch.randint(0, 200, (bsz,), generator=g).tolist()
        lens[0] = max(lens[0], 1)
        _run_check(v, p, lens, seed=bsz, k_scale=0.37, v_scale=2.5)


def test_long_sequence_many_splits():
    v = AttentionSm90Variant(splits=128, reduction=Reduction.LASTCTA)
    _run_check(v, _p(kv_len=40000), [40000, 3], seed=7)
    v = AttentionSm90Variant(splits=16, reduction=Reduction.WORKSPACE)
    _run_check(v, _p(kv_len=40000), [40000, 12345], seed=8)


def test_reruns_are_bit_identical_and_counters_rearm():
    for v in (AttentionSm90Variant(), AttentionSm90Variant(splits=6, reduction=Reduction.LASTCTA),
              AttentionSm90Variant(splits=6, reduction=Reduction.WORKSPACE)):
        op, (q, cache, bt, sl), first = _run_check(v, _p(), [500, 64, 0, 7], seed=3)
        for _ in range(3):
            again = op(q, cache, bt, sl)
            torch.cuda.synchronize()
            assert torch.equal(again.view(torch.int16), first.view(torch.int16)), v.name()
        _, _, cnt = op.workspace(q.shape[0], cache.num_kv_heads, q.device)
        assert int(cnt.abs().sum()) == 0, "last-CTA counters must be re-armed"


def test_cuda_graph_replay_matches_eager():
    v = AttentionSm90Variant(splits=4, reduction=Reduction.LASTCTA)
    op, (q, cache, bt, sl), first = _run_check(v, _p(), [700, 33], seed=4)
    out = torch.empty_like(q)
    op(q, cache, bt, sl, out=out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        op(q, cache, bt, sl, out=out)
    out.zero_()
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.view(torch.int16), first.view(torch.int16))


@pytest.mark.parametrize("packing", [Packing.PAIR, Packing.STACK])
def test_kernel_matches_emulator_closely(packing):
    from resgen.kernels.attention_sm90_emu import EmuConfig, emulate_decode_attention

    v = AttentionSm90Variant(splits=2, reduction=Reduction.LASTCTA, packing=packing)
    op, (q, cache, bt, sl), out = _run_check(v, _p(q_heads=16, kv_heads=2), [90, 40], seed=5)
    cpu = PagedKVCache(*(getattr(cache, f.name).cpu() for f in dataclasses.fields(cache)))
    emu = emulate_decode_attention(q.float().cpu(), cpu, bt.cpu(), sl.cpu(),
                                   EmuConfig(num_splits=2, packing=packing.value))
    rel = float((out.float().cpu() - emu).norm() / emu.norm())
    assert rel < 3e-3, rel


# ----------------------------------------------------------------------------- Q16


def _q16(**kw) -> AttentionProblem:
    return AttentionProblem(**{"compensation": False, "query": "q16", **kw})


_DENSE = Packing.DENSE
Q16_VARIANTS = [
    (AttentionSm90Variant(packing=_DENSE), _q16()),
    (AttentionSm90Variant(packing=_DENSE, prefetch=False), _q16()),
    (AttentionSm90Variant(packing=_DENSE, splits=3, reduction=Reduction.LASTCTA), _q16()),
    (AttentionSm90Variant(packing=_DENSE, splits=4, reduction=Reduction.WORKSPACE), _q16()),
    (AttentionSm90Variant(packing=_DENSE, num_warps=8, kc=16, splits=2,
                          reduction=Reduction.LASTCTA), _q16(q_heads=64)),
    (AttentionSm90Variant(packing=_DENSE, kc=16), _q16(page_size=16)),
    (AttentionSm90Variant(packing=_DENSE, splits=2, reduction=Reduction.LASTCTA),
     _q16(pv="fp8")),
    (AttentionSm90Variant(packing=_DENSE, prefetch=False, splits=2,
                          reduction=Reduction.LASTCTA),
     _q16(q_heads=16, kv_heads=2, head_dim=256)),
    (AttentionSm90Variant(packing=_DENSE, splits=2, reduction=Reduction.WORKSPACE),
     _q16(q_heads=4, kv_heads=4, head_dim=64)),
    (AttentionSm90Variant(packing=_DENSE, kc=16), _q16(q_heads=6, kv_heads=2, head_dim=64,
                                                        page_size=16)),
]


@pytest.mark.parametrize("case", Q16_VARIANTS, ids=lambda c: f"{c[0].name()}-{c[1].key()}")
def test_q16_variant_matches_the_q16_reference(case):
    v, p = case
    lens = [300, 0, 1, 33, p.page_size, p.page_size + 1, 129]
    seed = zlib.crc32((v.key() + p.key()).encode()) % 1000
    _run_check(v, p, lens, seed=seed)
    _run_check(v, p, lens, seed=seed + 1, q_hostile=True)     # no FP16 overflow, exact scale


def test_q16_reruns_graph_replay_and_the_emulator():
    from resgen.kernels.attention_sm90_emu import EmuConfig, emulate_decode_attention

    v = AttentionSm90Variant(packing=Packing.DENSE, splits=4, reduction=Reduction.LASTCTA)
    op, (q, cache, bt, sl), first = _run_check(v, _q16(), [700, 33, 0], seed=6, q_hostile=True)
    for _ in range(2):
        again = op(q, cache, bt, sl)
        torch.cuda.synchronize()
        assert torch.equal(again.view(torch.int16), first.view(torch.int16))
    out = torch.empty_like(q)
    op(q, cache, bt, sl, out=out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        op(q, cache, bt, sl, out=out)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.view(torch.int16), first.view(torch.int16))
    cpu = PagedKVCache(*(getattr(cache, f.name).cpu() for f in dataclasses.fields(cache)))
    emu = emulate_decode_attention(q.float().cpu(), cpu, bt.cpu(), sl.cpu(),
                                   EmuConfig(compensation=False, packing="dense",
                                             query="q16", num_splits=4))
    rel = float((first.float().cpu() - emu).norm() / emu.norm())
    assert rel < 3e-3, rel


def test_q16_is_closer_to_the_fp32_attention_than_resattn_and_plain():
    """The three kernels on one cache and one query set vs FP32 attention over the decoded
    NVFP4 K/V (what the query mode changes): Q16's error is the BF16 output rounding only."""
    lens = [2000, 517, 64]
    q, cache, bt, sl, _, _ = _inputs(lens, 32, 8, 128, 32, seed=11, q_hostile=False)
    q[:, :, 7] *= 20                                        # outlier channel
    kd, vd = [], []
    for b, n in enumerate(lens):
        ku, vu = cache.gather_unit(bt[b], n)
        kd.append(ku * float(cache.k_scale))
        vd.append(vu * float(cache.v_scale))
    exact = R.attention_fp32(q.double(), kd, vd)
    err = {}
    for name, v, p in (("q16", AttentionSm90Variant(packing=Packing.DENSE), _q16()),
                       ("resattn", AttentionSm90Variant(), _p()),
                       ("plain", AttentionSm90Variant(), _p(compensation=False))):
        out = torch.full_like(q, float("nan"))
        _op(v, p)(q, cache, bt, sl, out=out)
        torch.cuda.synchronize()
        assert bool(torch.isfinite(out).all()), name
        err[name] = R.nmse(out.float(), exact)
    assert err["q16"] < 0.5 * err["resattn"] < 0.5 * err["plain"], err


# ----------------------------------------------------------------------------- append


@pytest.mark.parametrize("d,hkv,page", [(128, 8, 32), (64, 2, 16), (256, 2, 64)])
def test_append_is_bit_exact(d, hkv, page):
    from resgen.kernels.attention_sm90 import KVAppendSm90, compile_append

    res, _ = compile_append(d, hkv, page)
    app = KVAppendSm90(res.fn, d, hkv, page)
    g = torch.Generator(device="cuda").manual_seed(d)
    bsz, n = 5, 3 * page + 7
    pages = bsz * math.ceil(n / page)
    tables = torch.randperm(pages, device="cuda").to(torch.int32).reshape(bsz, -1).contiguous()
    k = torch.randn(bsz * n, hkv, d, generator=g, device="cuda") * 3
    v = torch.randn(bsz * n, hkv, d, generator=g, device="cuda")
    # adversarial rows: zeros, one huge value, tiny values (subnormal E4M3 scales), exact ties
    k[0] = 0
    k[1, :, 5] = 3e4
    k[2] = k[2] * 1e-6
    v[3] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * (d // 8),
                        device="cuda")
    k, v = k.to(torch.bfloat16), v.to(torch.bfloat16)
    pos = torch.stack([torch.arange(bsz, device="cuda").repeat_interleave(n),
                       torch.arange(n, device="cuda").repeat(bsz)], 1).to(torch.int32)
    for ks, vs in ((1.0, 1.0), (0.05, 3.0)):
        ref = PagedKVCache.empty(pages, hkv, d, page, ks, vs, device="cuda")
        got = PagedKVCache.empty(pages, hkv, d, page, ks, vs, device="cuda")
        for cache in (ref, got):                     # the same poison in unwritten slots
            for c in (cache.k_codes, cache.v_codes, cache.k_sf.view(torch.uint8),
                      cache.v_sf.view(torch.uint8)):
                c.fill_(0xAB)
        ref.append(k.float(), v.float(), tables, pos.long())
        # decode: one token per sequence, then the rest (prefill) in one call
        first = pos[:, 1] == 0
        app(got, k[first].contiguous(), v[first].contiguous(), tables, pos[first].contiguous())
        app(got, k[~first].contiguous(), v[~first].contiguous(), tables,
            pos[~first].contiguous())
        torch.cuda.synchronize()
        for name in ("k_codes", "v_codes"):
            assert torch.equal(getattr(got, name), getattr(ref, name)), name
        for name in ("k_sf", "v_sf"):
            assert torch.equal(getattr(got, name).view(torch.uint8),
                               getattr(ref, name).view(torch.uint8)), name
