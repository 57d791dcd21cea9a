"""resgen.ops.Linear on an H200 with the real kernels and the shipped dispatch table: Qwen3-8B
layer shapes at decode and mid-size M, NVFP4 / MXFP4, plain / M-Ext / K-Ext; fresh random
activations vs resgen.reference.linear on the same quantized weight (||out - ref|| / ||ref||
<= 3e-3, no NaN), bit-identical reruns, and a CUDA graph of the warmed-up plans replaying
bit-identical to eager calls."""

from __future__ import annotations

import pytest
import torch

from resgen import calibrate as C
from resgen import reference as R
from resgen.ops import Linear
from resgen.search.variant import LinearProblem

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _qweight(fmt, n, k, ratio=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.exp(0.5 * torch.randn(n, 1, generator=g))
    sel = None
    if ratio is not None:
        st = C.ChannelStats(k)
        st.update(torch.randn(16, k, generator=g) * torch.exp(torch.randn(1, k, generator=g)))
        sel = C.select_channels(st.mean_abs(), ratio)
    isc = torch.tensor(4.0 / (6 * 448)) if fmt == "nvfp4" else None
    return C.prepare_weight(w, fmt, sel, input_scale=isc)


def _rel(y, ref):
    return float((y.float() - ref).norm() / ref.norm())


@pytest.mark.parametrize("fmt, comp, n, k", [
    ("nvfp4", "none", 6144, 4096), ("nvfp4", "full", 4096, 12288),
    ("mxfp4", "full", 4096, 4096), ("nvfp4", 0.25, 6144, 4096)])
def test_dispatched_layer_matches_the_reference(fmt, comp, n, k):
    qw = _qweight(fmt, n, k, ratio=None if comp in ("none", "full") else comp)
    layer = Linear(qw, comp)
    for m in (1, 3, 16, 100):
        x = (torch.randn(m, k, device="cuda") * 3).to(torch.bfloat16)
        y = layer(x)
        ref = R.linear(x.float(), qw, comp)
        assert not bool(y.isnan().any())
        assert _rel(y, ref) <= 3e-3, (m, layer.plan(m).variant.name(), _rel(y, ref))
        again = layer(x)
        if layer.plan(m).variant.deterministic:
            assert torch.equal(y.view(torch.int16), again.view(torch.int16))


def test_graph_of_warmed_up_plans_replays_like_eager():
    qw = _qweight("nvfp4", 4096, 4096)
    layer = Linear(qw, "full")
    layer.warmup([1, 8])
    xs = [(torch.randn(m, 4096, device="cuda")).to(torch.bfloat16) for m in (1, 8)]
    eager = [layer(x).clone() for x in xs]
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = [layer(x) for x in xs]
    for o in outs:
        o.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    for o, e in zip(outs, eager):
        assert torch.equal(o.view(torch.int16), e.view(torch.int16))
    with pytest.raises(RuntimeError, match="warmup"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            layer(torch.zeros(5, 4096, device="cuda", dtype=torch.bfloat16))


@pytest.mark.parametrize("q_heads, kv_heads, compensation, pv", [
    (32, 8, True, "f16"), (64, 8, True, "f16"), (32, 8, False, "f16"), (32, 8, True, "fp8")])
def test_dispatched_decode_attention_matches_the_reference(q_heads, kv_heads, compensation,
                                                           pv):
    from resgen.kvcache import PagedKVCache
    from resgen.ops import DecodeAttention
    from resgen.search.attention_sm90 import TOLERANCE, compare

    g = torch.Generator(device="cuda").manual_seed(0)
    lens = [3000, 37, 1, 0, 512]
    ks = [torch.randn(kv_heads, n, 128, generator=g, device="cuda") for n in lens]
    vs = [torch.randn(kv_heads, n, 128, generator=g, device="cuda") for n in lens]
    cache, bt, sl = PagedKVCache.from_dense(ks, vs, page_size=32)
    bt, sl = bt.to(torch.int32).contiguous(), sl.to(torch.int32)
    attn = DecodeAttention(q_heads, kv_heads, 128, 32, compensation=compensation, pv=pv)
    q = (torch.randn(len(lens), q_heads, 128, generator=g, device="cuda") * 2).to(
        torch.bfloat16)
    out = attn(q, cache, bt, sl)
    ref = R.decode_attention(q.float(), cache, bt, sl, compensation=compensation,
                             pv="fp32" if pv == "f16" else "fp8")
    res = compare(out, ref, TOLERANCE[pv])
    assert res.ok, (attn.plan(len(lens), 3000).variant.name(), res.detail)
    assert bool((out[3] == 0).all())
    again = attn(q, cache, bt, sl, max_kv_len=3000)
    assert torch.equal(out.view(torch.int16), again.view(torch.int16))


def test_fp4linear_module_on_the_gpu():
    from resgen.ops import FP4Linear

    torch.manual_seed(0)
    lin = torch.nn.Linear(4096, 6144, bias=True, device="cuda")
    mod = FP4Linear.from_linear(lin, "mxfp4", "full")
    x = torch.randn(4, 4096, device="cuda")
    y = mod(x)
    ref = R.linear(x.to(torch.bfloat16).float(), mod.op.qweight, "full") + lin.bias.detach()
    assert y.dtype == torch.float32 and _rel(y, ref) <= 3e-3


def test_decode_attention_graph_after_warmup():
    from resgen.kvcache import PagedKVCache
    from resgen.ops import DecodeAttention

    g = torch.Generator(device="cuda").manual_seed(1)
    lens = [5000, 4100]
    ks = [torch.randn(8, n, 128, generator=g, device="cuda") for n in lens]
    vs = [torch.randn(8, n, 128, generator=g, device="cuda") for n in lens]
    cache, bt, sl = PagedKVCache.from_dense(ks, vs, page_size=32)
    bt, sl = bt.to(torch.int32).contiguous(), sl.to(torch.int32)
    attn = DecodeAttention(32, 8, 128)
    attn.warmup([(2, 5000)])
    q = torch.randn(2, 32, 128, generator=g, device="cuda").to(torch.bfloat16)
    out = torch.empty_like(q)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        attn(q, cache, bt, sl, max_kv_len=5000, out=out)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    eager = attn(q, cache, bt, sl, max_kv_len=5000)
    assert torch.equal(out.view(torch.int16), eager.view(torch.int16))


# ----------------------------------------------------------------------------- served == tuned


def _bind_cases():
    from resgen.search import linear_sm90_mma as LS
    from resgen.search import linear_sm90_wgmma as LW

    return [("linear_sm90_mma", LS.LinearSm90Variant(1, 8, 1, 1, 1, LS.Pipeline.CP_ASYNC, 3)),
            ("linear_sm90_mma", LS.LinearSm90Variant(1, 8, 1, 1, 1, LS.Pipeline.CP_ASYNC, 3,
                                                     act=LS.Act.FUSED, pdl=True)),
            ("linear_sm90_mma", LS.LinearSm90Variant(1, 4, 1, 1, 1, LS.Pipeline.CP_ASYNC, 3,
                                                     0, 2, LS.Reduction.WORKSPACE)),
            ("linear_sm90_wgmma", LW.LinearSm90WgmmaVariant(1, 1, 32, 6, LW.Raster.TOK,
                                                            LS.Packing.SPLIT, 2, True))]


@pytest.mark.parametrize("case", range(4))
@pytest.mark.parametrize("fmt, comp", [("nvfp4", "none"), ("nvfp4", "full"), ("mxfp4", "full"),
                                       ("nvfp4", "0.25")])
def test_served_layer_is_the_tuned_call_bit_for_bit(case, fmt, comp):
    """The tuner's runner (family.runner, as_layer, check, the timed call on set 1) and
    resgen.ops.Linear on that set's weight and activations run the same bound layer
    (family.bind): bit-identical outputs with the real kernels and quantizer."""
    from resgen.ops.common import compile_cached
    from resgen.search.family import get_family

    name, v = _bind_cases()[case]
    fam = get_family(name)
    p = LinearProblem(fmt, comp, 3, 4096, 4096)
    assert fam.why_invalid(v, p, "sm_90a") is None, fam.why_invalid(v, p, "sm_90a")
    compiled = compile_cached(fam, v, p, "sm_90a")
    r = fam.runner(compiled, v, p, "cuda", n_sets=2, seed=5)
    r.as_layer()
    chk = r.check()
    assert chk.ok, chk.detail
    r.rotate(1)
    tuned = r().clone()
    layer = Linear(r.sets[1][0], comp, variant=v)
    served = layer(r.xbs[1])
    torch.cuda.synchronize()
    assert torch.equal(served.view(torch.int16), tuned.view(torch.int16)), v.name()
