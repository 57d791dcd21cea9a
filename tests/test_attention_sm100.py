"""attention_sm100 on the CPU: the space and its predicates, keys with the arch, the B200 model
prior, the TMEM load / fold plans for every load shape, the loader's shared-memory maps, and
the thread-level simulation against resgen.reference's ResAttn on fresh random inputs
(folded FP32 scores bit-exact; outputs to the FP16-P tolerance; split reductions)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from resgen import reference
from resgen.kernels import attention_sm100_geom as G
from resgen.kernels.attention_sm100 import query_values
from resgen.kernels.attention_sm100_sim import fold_scores, simulate
from resgen.kvcache import PagedKVCache
from resgen.search import attention_sm100 as A
from resgen.search.family import families_for
from resgen.search.variant import AttentionProblem

ARCH = "sm_100a"
P0 = AttentionProblem(batch=1, q_heads=32, kv_heads=8, head_dim=128, kv_len=8192,
                      page_size=32, compensation=True)


def test_registered_for_sm100a_only():
    assert A.FAMILY in families_for("decode_attention", ARCH)
    assert A.FAMILY not in families_for("decode_attention", "sm_90a")
    assert A.FAMILY.why_invalid(A.FAMILY.default(P0, ARCH), P0, "sm_90a")


@pytest.mark.parametrize("p", A.COVER_PROBLEMS, ids=lambda p: f"d{p.head_dim}-c{p.compensation}")
def test_space_is_valid_holds_the_default_and_prior_ranks(p):
    space = A.FAMILY.space(p, ARCH)
    d = A.FAMILY.default(p, ARCH)
    assert space and d in space and len(set(space)) == len(space)
    assert all(A.FAMILY.why_invalid(v, p, ARCH) is None for v in space)
    pri = [A.FAMILY.prior(v, p) for v in space]
    assert all(math.isfinite(x) and x > 0 for x in pri) and len(set(pri)) > 1


def test_invalid_combinations_give_their_reason():
    V, p = A.AttentionSm100Variant, P0
    why = lambda v, q=p: A.FAMILY.why_invalid(v, q, ARCH)  # noqa: E731
    assert "qlayout pair or half" in why(V(qlayout=A.QLayout.PLAIN))
    assert "plain NVFP4-KV" in why(V(), dataclasses.replace(p, compensation=False))
    assert "needs reduction" in why(V(splits=4))
    assert "single split" in why(V(reduction=A.Reduction.LASTCTA))
    assert "not in the thread's registers" in why(V(A.QLayout.PAIR, A.TmemShape.S16X128B, 2))
    assert "not in the thread's registers" in why(V(A.QLayout.HALF, A.TmemShape.S16X256B, 1))
    assert "columns" in why(V(tmem_rep=16))            # 16 columns of an 8-column tile
    big = dataclasses.replace(p, head_dim=256, page_size=256)
    assert "single-buffered" in why(V(stages=3))       # no ring yet: stages=1 only
    assert all(v.stages == 1 for v in A.FAMILY.space(big, ARCH))
    assert "head_dim" in A.FAMILY.problem_invalid(dataclasses.replace(p, head_dim=64))
    assert "pv=fp8" in A.FAMILY.problem_invalid(dataclasses.replace(p, pv="fp8"))
    assert "page_size" in A.FAMILY.problem_invalid(dataclasses.replace(p, page_size=48))
    assert "splits" in why(V(splits=64, reduction=A.Reduction.LASTCTA),
                           dataclasses.replace(p, kv_len=1000))


def test_compile_key_drops_runtime_sizes_and_split_count():
    v = A.FAMILY.default(P0, ARCH)
    k1 = A.FAMILY.compile_key(v, P0)
    k2 = A.FAMILY.compile_key(v, dataclasses.replace(P0, batch=32, kv_len=100))
    assert k1 == k2 and k1.q_heads == 4 and k1.kv_heads == 1
    assert "splits" not in A.FAMILY.template_params(v, P0)
    assert A.FAMILY.template_params(v, P0) == A.FAMILY.template_params(
        dataclasses.replace(v, splits=1, reduction=A.Reduction.NONE), P0) | {
        "reduction": v.reduction.value}


@pytest.mark.parametrize("shape, rep, lay, group", [
    ("32x32b", 8, "pair", 4), ("32x32b", 4, "pair", 2), ("32x32b", 16, "half", 8),
    ("16x256b", 1, "pair", 4), ("16x256b", 2, "half", 8), ("16x128b", 2, "half", 4),
    ("16x128b", 4, "half", 8), ("16x128b", 1, "plain", 8), ("32x32b", 8, "plain", 8)])
def test_fold_plan_lands_every_score_once(shape, rep, lay, group):
    """Every accumulator element of a random S image is read by the thread the plan names,
    and each (key, head)'s fold uses exactly its base and residue columns."""
    g = G.AttnSm100Geometry(128, group, 32, lay != "plain", lay, shape, rep, 2, "none")
    g.check()
    gen = torch.Generator().manual_seed(group * 31 + rep)
    tmem = torch.randn(G.KEYS, g.qk_n, generator=gen)
    fac = torch.rand(g.pv_n, generator=gen) + 0.5
    s, _ = fold_scores(g, tmem, fac)
    for j in range(group):
        want = tmem[:, G.q_col(j, 0, lay, g.qk_n)]
        if lay != "plain":
            want = want + tmem[:, G.q_col(j, 1, lay, g.qk_n)]
        assert torch.equal(s[:, j], (want * fac[j]).float())


def test_loader_maps_are_bijections_onto_the_tiles():
    for d in (128, 256):
        rb = d // 2
        offs = {G.k_code_offset(r, c, rb) for r in range(G.KEYS) for c in range(rb // 16)}
        assert offs == set(range(0, G.KEYS * rb, 16))
        sfc = G.AttnSm100Geometry(d, 4, 32, True, "pair", "32x32b", 8, 2, "none").sf_cols
        words = {G.k_sf_word_offset(r, g, sfc) for r in range(G.KEYS) for g in range(d // 64)}
        assert words == set(range(0, G.KEYS * sfc, 4))
    # the swizzle really permutes chunks within 8-row atoms (SW128: chunk c of row r at c ^ r)
    assert G.k_code_offset(3, 0, 128) == 3 * 128 + 16 * 3


def _case(seed, lens, hkv, group, d, ps, scale=2.0):
    gen = torch.Generator().manual_seed(seed)
    ks = [torch.randn(hkv, n, d, generator=gen) for n in lens]
    vs = [torch.randn(hkv, n, d, generator=gen) for n in lens]
    cache, bt, sl = PagedKVCache.from_dense(ks, vs, page_size=ps, k_scale=0.5, v_scale=2.0)
    q = (torch.randn(len(lens), hkv * group, d, generator=gen) * scale).to(torch.bfloat16)
    return q.float(), cache, bt, sl


SIM = [  # (variant, group, head_dim, page_size, lens, compensation)
    (A.AttentionSm100Variant(A.QLayout.PAIR, A.TmemShape.S32X32B, 8, 1), 4, 128, 32,
     [300, 1, 0], True),
    (A.AttentionSm100Variant(A.QLayout.HALF, A.TmemShape.S16X128B, 2, 1, 3,
                             A.Reduction.LASTCTA), 4, 128, 16, [700, 129], True),
    (A.AttentionSm100Variant(A.QLayout.PAIR, A.TmemShape.S16X256B, 1, 1, 2,
                             A.Reduction.COMBINE), 4, 256, 256, [400], True),
    (A.AttentionSm100Variant(A.QLayout.HALF, A.TmemShape.S32X32B, 16, 1), 8, 128, 128,
     [260], True),
    (A.AttentionSm100Variant(A.QLayout.PLAIN, A.TmemShape.S16X128B, 2, 1), 8, 128, 32,
     [333, 5], False),
]


@pytest.mark.parametrize("v, group, d, ps, lens, comp", SIM,
                         ids=[f"{c[0].name().split(':')[1]}-g{c[1]}-d{c[2]}" for c in SIM])
def test_simulation_matches_reference(v, group, d, ps, lens, comp):
    q, cache, bt, sl = _case(hash((group, d, ps)) % 1000, lens, 2, group, d, ps)
    p = AttentionProblem(batch=len(lens), q_heads=2 * group, kv_heads=2, head_dim=d,
                         kv_len=max(lens), page_size=ps, compensation=comp)
    assert A.FAMILY.why_invalid(v, p, ARCH) is None
    g = A.geometry_of(v, p)
    res = simulate(q, cache, bt, sl, g, splits=v.splits)
    # the folded FP32 scores, bit-exact against the reference's fold (its own formula:
    # fp32(Q_hat K^T) + fp32(R_hat K^T), then the FP32 factor)
    base, rq, alpha = reference.quantize_query(q, scale="row")
    from resgen import formats
    qu = formats.dequantize(base, apply_global_scale=False).double()
    ru = formats.dequantize(rq, apply_global_scale=False).double()
    _, _, _, fac = query_values(q, g, float(cache.k_scale), d ** -0.5)
    for b, n in enumerate(lens):
        if n == 0:
            continue
        ku, _ = cache.gather_unit(bt[b], n)
        for h in range(2):
            hs = slice(h * group, (h + 1) * group)
            s = (qu[b, hs] @ ku[h].T).float()
            if comp:
                s = s + (ru[b, hs] @ ku[h].T).float()
            want = (s * fac[b, h, :group, None]).float()
            got = torch.stack([res.scores[(b, h, k)] for k in range(n)], 1)
            assert torch.equal(got, want)
    ref = reference.decode_attention(q, cache, bt, sl, compensation=comp, pv="fp32")
    ref16 = reference.decode_attention(q, cache, bt, sl, compensation=comp, pv="f16")
    rel = float((res.out - ref).norm() / ref.norm())
    assert rel < 2e-4, rel                         # FP16 P, FP32 sums: far inside 3e-3
    assert float((res.out - ref16).norm() / ref16.norm()) < 2e-4
    if lens[-1] == 0:
        assert bool((res.out[-1] == 0).all())
    assert bool(torch.isfinite(res.out).all())


def test_split_reductions_agree_and_are_deterministic():
    q, cache, bt, sl = _case(7, [900], 1, 4, 128, 32)
    p = AttentionProblem(batch=1, q_heads=4, kv_heads=1, head_dim=128, kv_len=900,
                         page_size=32)
    V = A.AttentionSm100Variant
    one = simulate(q, cache, bt, sl, A.geometry_of(V(), p), splits=1).out
    for red in (A.Reduction.LASTCTA, A.Reduction.COMBINE):
        outs = [simulate(q, cache, bt, sl, A.geometry_of(V(splits=s, reduction=red), p),
                         splits=s).out for s in (3, 7)]
        for o in outs:
            # P is rounded to FP16 against each split's own running max: not bit-equal
            assert float((o - one).norm() / one.norm()) < 5e-4
        if red == A.Reduction.LASTCTA:
            first = outs
        else:
            assert all(torch.equal(a, b) for a, b in zip(first, outs))


def test_model_prefers_fewer_splits_when_heads_fill_the_gpu():
    p = dataclasses.replace(P0, batch=64, kv_len=4096)
    V = A.AttentionSm100Variant
    one = A.FAMILY.prior(V(), p)
    many = A.FAMILY.prior(V(splits=16, reduction=A.Reduction.LASTCTA), p)
    assert one < many
    q = dataclasses.replace(P0, batch=1, kv_len=32768)
    assert A.FAMILY.prior(V(splits=16, reduction=A.Reduction.LASTCTA), q) < A.FAMILY.prior(
        V(), q)


def test_tuning_plans_only_the_workloads_the_family_serves():
    """`resgen tune` gives attention_sm100 no pv=fp8 / Q16 workload (refused as a whole: not
    built), where attention_sm90 takes both P.V forms of the same grid."""
    from resgen.models import get_model, tuning_workloads
    from resgen.search.family import get_family

    spec = [get_model("qwen3-8b")]
    kw = dict(attn_batches=(1, 8), kv_lens=(8192,), attn_pv=("f16", "fp8"),
              attn_modes=("resattn", "plain", "q16"))
    mine = tuning_workloads(A.FAMILY, spec, **kw)
    hopper = tuning_workloads(get_family("attention_sm90"), spec, **kw)
    assert mine and all(p.pv == "f16" and p.query == "nvfp4" for p in mine)
    assert all(A.FAMILY.problem_invalid(p) is None for p in mine)
    assert {p.pv for p in hopper} == {"f16", "fp8"} and len(hopper) > len(mine)
