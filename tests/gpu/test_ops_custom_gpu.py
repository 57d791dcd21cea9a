"""resgen's custom ops on the H200 with the real kernels: opcheck of every op's fake against
the kernel, and a decode step built on the ops (Qwen3-8B attention geometry: fused QKV, KV
append, ResAttn, o_proj; FP4Linear modules) under torch.compile(mode="reduce-overhead",
fullgraph=True): no graph break, no CUDA-graph skip, outputs equal to eager on fresh inputs
(bit for bit where every dispatched linear variant is deterministic; the attention split
reduction is), the appends written to the cache, and the later calls replayed as CUDA graphs
(cudaGraphLaunch in the profile)."""

from __future__ import annotations

import gc

import pytest
import torch

from resgen import calibrate as C
from resgen.kvcache import PagedKVCache
from resgen.ops import DecodeAttention, Linear, custom
from resgen.ops.kv_append import KVAppend
from resgen.ops.nn import FP4Linear
from resgen.ops.quantizer import LayerQuantizer

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

HQ, HKV, D, PAGE, HID = 32, 8, 128, 32, 4096
CAP = 1024                      # tokens per sequence the cache holds (the plan's KV bound)


def _qweight(n, k, seed, fmt="nvfp4"):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.02
    isc = torch.tensor(4.0 / 2688) if fmt == "nvfp4" else None
    return C.prepare_weight(w, fmt, input_scale=isc)


def _cache(batch, lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    pages = CAP // PAGE
    cache = PagedKVCache.empty(batch * pages, HKV, D, PAGE, device="cuda")
    bt = torch.arange(batch * pages, dtype=torch.int32).reshape(batch, pages)
    bt = bt[:, torch.randperm(pages, generator=g)].contiguous().cuda()
    for b, n in enumerate(lens):
        pos = torch.stack([torch.full((n,), b), torch.arange(n)], 1).cuda()
        cache.append(torch.randn(n, HKV, D, generator=g).cuda(),
                     torch.randn(n, HKV, D, generator=g).cuda(), bt, pos)
    return cache, bt


@pytest.mark.parametrize("comp", ["none", "full"])
def test_opcheck_linear_and_quantize_on_the_kernels(comp):
    lin = Linear(_qweight(1024, 4096, 1), comp)
    h = custom.register(lin)
    x = torch.randn(3, 4096, device="cuda").to(torch.bfloat16)
    torch.library.opcheck(torch.ops.resgen.linear.default, (x, h))
    q = LayerQuantizer("nvfp4", comp, 4096, input_scale=4.0 / 2688)
    hq = custom.register(q)
    torch.library.opcheck(torch.ops.resgen.quantize.default, (x, hq))
    from resgen.kernels.quant_sm90 import operand_reference

    codes, scales, alpha = torch.ops.resgen.quantize(x, hq)
    ref = operand_reference(x, "nvfp4", comp, q.layout, 1,
                            torch.tensor(4.0 / 2688, device="cuda"), None, 64)
    assert torch.equal(codes, ref.codes)
    assert torch.equal(scales.view(torch.uint8), ref.scales.view(torch.uint8))


def test_opcheck_attention_and_append_on_the_kernels():
    attn = DecodeAttention(HQ, HKV, D, PAGE)
    app = KVAppend(HKV, D, PAGE)
    ha, hp = custom.register(attn), custom.register(app)
    cache, bt = _cache(2, [300, 40])
    sl = torch.tensor([300, 40], dtype=torch.int32, device="cuda")
    q = torch.randn(2, HQ, D, device="cuda").to(torch.bfloat16)
    torch.library.opcheck(torch.ops.resgen.decode_attention.default,
                          (q, *custom.cache_args(cache), bt, sl, CAP, None, ha))
    k = torch.randn(2, HKV, D, device="cuda").to(torch.bfloat16)
    pos = torch.tensor([[0, 300], [1, 40]], dtype=torch.int32, device="cuda")
    torch.library.opcheck(torch.ops.resgen.kv_append.default,
                          (k, k, *custom.cache_args(cache), bt, pos, hp))


class _Step(torch.nn.Module):
    """A decode step on the ops: fused QKV (FP4Linear, M-Ext), KV append, ResAttn, o_proj."""

    def __init__(self, batch, lens):
        super().__init__()
        self.qkv = FP4Linear(_qweight((HQ + 2 * HKV) * D, HID, 1), "full", name="qkv")
        self.o = FP4Linear(_qweight(HID, HQ * D, 2), "full", name="o")
        self.attn, self.app = DecodeAttention(HQ, HKV, D, PAGE), KVAppend(HKV, D, PAGE)
        self.ha, self.hp = custom.register(self.attn), custom.register(self.app)
        cache, bt = _cache(batch, lens)
        for name, t in zip(("k_codes", "k_sf", "v_codes", "v_sf", "k_scale", "v_scale"),
                           custom.cache_args(cache)):
            self.register_buffer(name, t)
            torch._dynamo.mark_static_address(t)      # a KV cache, as HF's StaticCache does
        self.register_buffer("bt", bt)

    def warmup(self, batch):
        self.qkv.warmup([batch])
        self.o.warmup([batch])
        self.attn.warmup([(batch, CAP)])
        self.app.warmup()

    def forward(self, x, seq_lens, positions):
        b = x.shape[0]
        qkv = self.qkv(x)
        q = qkv[:, :HQ * D].reshape(b, HQ, D).contiguous()
        k = qkv[:, HQ * D:(HQ + HKV) * D].reshape(b, HKV, D).contiguous()
        v = qkv[:, (HQ + HKV) * D:].reshape(b, HKV, D).contiguous()
        cache = (self.k_codes, self.k_sf, self.v_codes, self.v_sf, self.k_scale, self.v_scale)
        torch.ops.resgen.kv_append(k, v, *cache, self.bt, positions, self.hp)
        o = torch.ops.resgen.decode_attention(q, *cache, self.bt, seq_lens, CAP, None, self.ha)
        return self.o(o.reshape(b, HQ * D)) + x


def test_compiled_decode_step_replays_in_cuda_graphs_like_eager():
    from torch._dynamo.utils import counters

    batch, lens = 4, [500, 37, 900, 128]
    step = _Step(batch, lens)
    step.warmup(batch)
    start = {n: b.clone() for n, b in step.named_buffers()}

    def reset():
        for n, b in step.named_buffers():
            b.copy_(start[n])

    g = torch.Generator(device="cuda").manual_seed(3)
    inputs = []
    for i in range(4):                  # step i appends token lens + i
        x = torch.randn(batch, HID, device="cuda", generator=g).to(torch.bfloat16)
        sl = torch.tensor([n + i + 1 for n in lens], dtype=torch.int32, device="cuda")
        pos = torch.tensor([[b, n + i] for b, n in enumerate(lens)], dtype=torch.int32,
                           device="cuda")
        inputs.append((x, sl, pos))
    eager = [step(*a).clone() for a in inputs]
    after_eager = step.k_codes.clone()
    reset()
    counters.clear()
    gc.collect()
    compiled = torch.compile(step, mode="reduce-overhead", fullgraph=True)
    outs = []
    for i, a in enumerate(inputs[:3]):
        torch.compiler.cudagraph_mark_step_begin()
        outs.append(compiled(*a).clone())
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.compiler.cudagraph_mark_step_begin()
        outs.append(compiled(*inputs[3]).clone())
        torch.cuda.synchronize()
    names = {e.key for e in prof.key_averages()}
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    assert any("cudaGraphLaunch" in n for n in names), sorted(names)[:40]
    exact = all(getattr(m.op.plan(batch).variant, "deterministic", True)
                for m in (step.qkv, step.o))
    for i, (o, e) in enumerate(zip(outs, eager)):
        assert not bool(o.isnan().any())
        if exact:
            assert torch.equal(o.view(torch.int16), e.view(torch.int16)), i
        else:       # FP32 atomics (split-K) add in another order: BF16 rounding noise only
            rel = float((o.float() - e.float()).norm() / e.float().norm())
            assert rel <= 2e-3, (i, rel)
    assert torch.equal(step.k_codes, after_eager)       # the appends reached the cache
