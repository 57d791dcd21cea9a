"""resgen's torch.library custom ops on the CPU: every op's fake implementation checked with
torch.library.opcheck against its CPU simulation (tests/standins.py: the same kernel stand-ins
as tests/test_ops.py), the results against resgen.reference, and a model using the ops traced
whole by torch.compile (fullgraph: no graph break inside resgen) and torch.export (opaque
calls). The CUDA-graph replay under torch.compile(mode="reduce-overhead") is
tests/gpu/test_ops_custom_gpu.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import standins as S  # noqa: E402
from fakefam import isolated_cache  # noqa: E402,F401
from test_linear_sm90_wgmma import _qweight  # noqa: E402

from resgen import reference as R  # noqa: E402
from resgen.kernels import quant_sm90 as Q  # noqa: E402
from resgen.kvcache import PagedKVCache  # noqa: E402
from resgen.ops import custom  # noqa: E402

pytestmark = pytest.mark.usefixtures("isolated_cache")
OPCHECK_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor",
                 "test_aot_dispatch_dynamic")


def _rel(y, ref):
    return float((y.float() - ref.float()).norm() / ref.float().norm())


@pytest.mark.parametrize("fmt, comp", [("nvfp4", "none"), ("nvfp4", "full"), ("mxfp4", "full"),
                                       ("nvfp4", "0.25")])
def test_linear_op(fmt, comp):
    ratio = None if comp in ("none", "full") else float(comp)
    qw = _qweight(fmt, ratio=ratio)
    lin = S.linear(qw, comp)
    h = custom.register(lin, "layers.0.q_proj")
    assert h.startswith("linear:") and h.endswith(":layers.0.q_proj")
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(2, 3, 512, generator=g) * 2).to(torch.bfloat16)
    torch.library.opcheck(torch.ops.resgen.linear.default, (x, h), test_utils=OPCHECK_UTILS)
    y = torch.ops.resgen.linear(x, h)
    assert y.shape == (2, 3, 128) and y.dtype == torch.bfloat16 and not y.isnan().any()
    ref = R.linear(x.float(), qw, ratio if ratio is not None else comp)
    assert _rel(y, ref) <= 3e-3
    assert torch.equal(y, lin(x))


def test_linear_fake_rejects_bad_input():
    lin = S.linear(_qweight("nvfp4"), "none")          # the registry holds it weakly
    h = custom.register(lin)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(4, 512, dtype=torch.bfloat16)
        assert torch.ops.resgen.linear(x, h).shape == (4, 128)
        with pytest.raises(TypeError, match="bfloat16"):
            torch.ops.resgen.linear(x.float(), h)
        with pytest.raises(ValueError, match="K = 512"):
            torch.ops.resgen.linear(x[:, :256], h)


def test_handles_are_weak_and_typed():
    lin = S.linear(_qweight("nvfp4"), "none")
    h = custom.register(lin)
    assert h in custom.handles() and custom.resolve(h, "linear") is lin
    with pytest.raises(TypeError, match="not a quantize op"):
        custom.resolve(h, "quantize")
    del lin
    import gc

    gc.collect()
    assert h not in custom.handles()
    with pytest.raises(KeyError, match="process-local"):
        custom.resolve(h)
    with pytest.raises(TypeError, match="not a resgen op"):
        custom.register(object())
    with pytest.raises(ValueError, match="kind"):
        custom.register(object(), kind="matmul")


@pytest.mark.parametrize("fmt, comp, static", [("nvfp4", "full", True), ("nvfp4", "none", False),
                                               ("mxfp4", "0.25", False),
                                               ("nvfp4", "0.5", True)])
def test_quantize_op(fmt, comp, static):
    k, m = 512, 5
    masks = Q.random_masks(k, comp, 0, "cpu") if comp not in ("none", "full") else None
    isc = torch.tensor(3.0 / 2688) if static else None
    quant = S.quantizer(fmt, comp, k, input_scale=isc, masks=masks)
    h = custom.register(quant)
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(m, k, generator=g) * 2).to(torch.bfloat16)
    torch.library.opcheck(torch.ops.resgen.quantize.default, (x, h), test_utils=OPCHECK_UTILS)
    codes, scales, alpha = torch.ops.resgen.quantize(x, h)
    ref = Q.operand_reference(x, fmt, comp, quant.layout, 1, isc, masks, 64)
    assert torch.equal(codes, ref.codes) and torch.equal(scales.view(torch.uint8),
                                                         ref.scales.view(torch.uint8))
    if fmt == "nvfp4":
        assert torch.equal(alpha, ref.alpha)
    else:
        assert float(alpha) == 1.0
    assert codes.shape[0] == (2 * m if comp == "full" else m)
    # the kernel's bytes decode to formats.quantize_with_residue's values
    assert scales.dtype == (torch.float8_e4m3fn if fmt == "nvfp4" else torch.uint8)


def test_quantize_rejects_bad_configuration():
    with pytest.raises(ValueError, match="masks"):
        S.quantizer("nvfp4", "0.25", 512)
    with pytest.raises(ValueError, match="MXFP4"):
        S.quantizer("mxfp4", "none", 512, input_scale=1.0)
    with pytest.raises(ValueError, match="layout"):
        S.quantizer("nvfp4", "none", 512, layout="row_pair")
    # K = 200 is below every quantizer's range: the problem says so at construction
    with pytest.raises(ValueError, match="no quantizer|k=200 must be in"):
        S.quantizer("nvfp4", "none", 200)


def _cache_problem(lens, hkv=2, d=64, page=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    ks = [torch.randn(hkv, n, d, generator=g) * 2 for n in lens]
    vs = [torch.randn(hkv, n, d, generator=g) for n in lens]
    return PagedKVCache.from_dense(ks, vs, page_size=page)


def _cache_args(cache):
    return custom.cache_args(cache)


@pytest.mark.parametrize("compensation", [True, False])
def test_decode_attention_op(compensation):
    attn = S.attention(8, 2, 64, 16, compensation=compensation)
    h = custom.register(attn, "layers.0.attn")
    cache, bt, sl = _cache_problem([37, 5])
    q = (torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(4)) * 2).bfloat16()
    args = (q, *_cache_args(cache), bt, sl, 64, None, h)
    torch.library.opcheck(torch.ops.resgen.decode_attention.default, args,
                          test_utils=OPCHECK_UTILS)
    o = torch.ops.resgen.decode_attention(*args)
    ref = R.decode_attention(q.float(), cache, bt, sl, compensation=compensation, pv="fp32")
    assert o.dtype == torch.bfloat16 and _rel(o, ref) <= 3e-3
    # max_kv_len is the plan's bound: a larger one serves the same sequences
    o2 = torch.ops.resgen.decode_attention(q, *_cache_args(cache), bt, sl, 128, None, h)
    assert _rel(o2, ref) <= 3e-3


def test_kv_append_op_mutates_the_cache_like_the_reference():
    app = S.append(2, 64, 16)
    h = custom.register(app)
    cache, bt, sl = _cache_problem([20, 3], seed=1)
    g = torch.Generator().manual_seed(5)
    k = torch.randn(2, 2, 64, generator=g).bfloat16()
    v = torch.randn(2, 2, 64, generator=g).bfloat16()
    pos = torch.tensor([[0, 20], [1, 3]], dtype=torch.int32)
    torch.library.opcheck(torch.ops.resgen.kv_append.default,
                          (k, v, *_cache_args(cache), bt, pos, h), test_utils=OPCHECK_UTILS)
    want, _, _ = _cache_problem([20, 3], seed=1)
    want.append(k.float(), v.float(), bt, pos)
    got, _, _ = _cache_problem([20, 3], seed=1)
    torch.ops.resgen.kv_append(k, v, *_cache_args(got), bt, pos, h)
    for name in ("k_codes", "k_sf", "v_codes", "v_sf"):
        assert torch.equal(getattr(got, name).view(torch.uint8),
                           getattr(want, name).view(torch.uint8)), name
    with pytest.raises(ValueError, match="geometry"):
        bad = PagedKVCache.empty(4, 1, 64, 16)
        torch.ops.resgen.kv_append(k[:, :1], v[:, :1], *_cache_args(bad), bt, pos, h)
    with pytest.raises(TypeError, match="uint8"):
        args = list(_cache_args(got))
        args[1] = got.k_sf
        torch.ops.resgen.kv_append(k, v, *args, bt, pos, h)


class _Decoder(torch.nn.Module):
    """One decode step: projections, KV append, attention, output projection, on the ops."""

    def __init__(self, q, kv, o, attn, app, cache, bt):
        super().__init__()
        self.hq, self.q, self.kv, self.o = q, custom.register(q), custom.register(kv), \
            custom.register(o)
        self.attn, self.app = custom.register(attn), custom.register(app)
        self._keep = (q, kv, o, attn, app)
        for name, t in zip(("k_codes", "k_sf", "v_codes", "v_sf", "k_scale", "v_scale"),
                           custom.cache_args(cache)):
            self.register_buffer(name, t)
        self.register_buffer("bt", bt)

    def forward(self, x, seq_lens, positions):
        b = x.shape[0]
        q = torch.ops.resgen.linear(x, self.q).view(b, 8, 64)
        kv = torch.ops.resgen.linear(x, self.kv).view(b, 2, 2, 64)
        cache = (self.k_codes, self.k_sf, self.v_codes, self.v_sf, self.k_scale, self.v_scale)
        torch.ops.resgen.kv_append(kv[:, 0].contiguous(), kv[:, 1].contiguous(), *cache,
                                   self.bt, positions, self.app)
        o = torch.ops.resgen.decode_attention(q.contiguous(), *cache, self.bt, seq_lens, 64,
                                              None, self.attn)
        return torch.ops.resgen.linear(o.reshape(b, 512), self.o)


def _decoder():
    import test_linear_sm90_wgmma as T

    g = torch.Generator().manual_seed(8)

    def qw(n, k, seed):
        w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
        return T.C.prepare_weight(w, "nvfp4", input_scale=torch.tensor(4.0 / 2688))

    cache, bt, _ = _cache_problem([30, 9], seed=2)
    mod = _Decoder(S.linear(qw(512, 512, 1), "full"), S.linear(qw(256, 512, 2), "full"),
                   S.linear(qw(512, 512, 3), "none"), S.attention(8, 2, 64, 16),
                   S.append(2, 64, 16), cache, bt)
    x = (torch.randn(2, 512, generator=g)).bfloat16()
    sl = torch.tensor([31, 10], dtype=torch.int32)
    pos = torch.tensor([[0, 30], [1, 9]], dtype=torch.int32)
    return mod, x, sl, pos


def test_a_model_on_the_ops_compiles_whole_and_exports():
    """torch.compile(fullgraph=True) would raise on a graph break; the compiled step and the
    exported program equal eager (the cache is reset between runs: the step appends)."""
    mod, x, sl, pos = _decoder()
    start = {n: b.clone() for n, b in mod.named_buffers()}

    def reset():
        for n, b in mod.named_buffers():
            b.copy_(start[n])

    eager = mod(x, sl, pos)
    appended = mod.k_codes.clone()
    assert not torch.equal(appended, start["k_codes"])      # the append happened
    reset()
    compiled = torch.compile(mod, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x, sl, pos), eager)
    assert torch.equal(mod.k_codes, appended)               # the mutation reached the buffer
    reset()
    ep = torch.export.export(mod, (x, sl, pos))
    targets = [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]
    assert sum("resgen.linear" in t for t in targets) == 3
    assert any("resgen.decode_attention" in t for t in targets)
    assert any("resgen.kv_append" in t for t in targets)
    assert torch.equal(ep.module()(x, sl, pos), eager)
