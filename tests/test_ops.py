"""resgen.ops on the CPU. Linear: the CPU simulations of the two linear families stand in for
the compiled kernels and the quantizer's torch definition for quant_sm90, so the whole run-time
path (dispatch, per-M plans, weight layouts, launchers, quantizer buffers, K-Ext masks) is
checked against resgen.reference.linear. DecodeAttention: its planning (dispatch per batch and
KV-length class, the class-floor rule, pinned variants), with the reference standing in for
the kernel. The GPU path is tests/gpu/test_ops_gpu.py."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

from resgen import reference as R
from resgen.kernels.linear_sm90_wgmma_sim import SimulatedKernel
from resgen.ops import Linear
from resgen.runtime import Device, Dispatcher
from resgen.search import linear_sm90_mma as LS
from resgen.search import linear_sm90_wgmma as LW
from resgen.search.variant import LinearProblem

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fakefam import isolated_cache, make_env  # noqa: E402,F401
from test_linear_sm90_mma import _record_launcher_pointers, _SimulatedKernel  # noqa: E402
from test_linear_sm90_wgmma import _qweight, _ReferenceQuantizer  # noqa: E402

ARCH = "sm_90a"
pytestmark = pytest.mark.usefixtures("isolated_cache")


class _Compiles:
    """compile_fn: a simulation per (variant, problem), counting the compiles asked for."""

    def __init__(self, registry=None):
        self.registry, self.calls = registry, []

    def __call__(self, fam, v, p, arch):
        assert arch == ARCH
        self.calls.append((fam.NAME, v, p.m))
        if fam.NAME == "linear_sm90_wgmma":
            return SimulatedKernel(LW.geometry_of(v, p))
        return _SimulatedKernel(LS.geometry_of(v, p), self.registry)


def _quantizers(made):
    def make(p, arch):
        alpha = "none" if p.fmt == "mxfp4" else ("static" if p.static_scale else "dynamic")
        made.append(_ReferenceQuantizer(p.fmt, p.compensation, alpha))
        return made[-1]
    return make


def _empty_dispatcher():
    return Dispatcher(paths=[], device=Device("NVIDIA H200", ARCH))


def _rel(y, ref):
    return float((y.float() - ref).norm() / ref.norm())


@pytest.mark.parametrize("fmt, comp", [("nvfp4", "none"), ("nvfp4", "full"), ("mxfp4", "full"),
                                       ("nvfp4", 0.25), ("mxfp4", "0.5")])
def test_wgmma_layer_matches_the_reference(fmt, comp):
    qw = _qweight(fmt, ratio=None if comp in ("none", "full") else float(comp))
    v = LW.LinearSm90WgmmaVariant(1, 2, 16, 3, LW.Raster.CH, LS.Packing.NIB)
    compiles, made = _Compiles(), []
    layer = Linear(qw, comp, device="cpu", variant=v, compile_fn=compiles,
                   quantizer_fn=_quantizers(made))
    g = torch.Generator().manual_seed(3)
    for m in (5, 2, 5):
        x = (torch.randn(m, 512, generator=g) * 3).to(torch.bfloat16)
        y = layer(x)
        assert y.dtype == torch.bfloat16 and y.shape == (m, 128)
        ref = R.linear(x.float(), qw, comp if comp in ("none", "full") else float(comp))
        assert not bool(y.isnan().any()) and _rel(y, ref) <= 3e-3
    # one plan (compile, quantizer, buffers) per row count, one weight layout for both
    assert [c[2] for c in compiles.calls] == [5, 2] and len(made) == 2
    assert list(layer._weights) == [("linear_sm90_wgmma", "nib")]
    assert layer.plan(5).source == "pinned" and layer.plan(5).variant == v


def test_wgmma_plan_reserves_the_split_workspace(monkeypatch):
    """A plan holds its split-K workspace before the first call (CUDA graph capture after
    warmup must not allocate)."""
    import resgen.kernels.linear_sm90_wgmma as K

    made = []
    orig = K.WgmmaLauncher.__init__

    def spy(self, *a, **kw):
        orig(self, *a, **kw)
        made.append(self)

    qw = _qweight("nvfp4")
    v = LW.LinearSm90WgmmaVariant(1, 1, 16, 2, split_k=4)
    layer = Linear(qw, "full", device="cpu", variant=v, compile_fn=_Compiles(),
                   quantizer_fn=_quantizers([]))
    monkeypatch.setattr(K.WgmmaLauncher, "__init__", spy)
    layer.warmup([5])
    g = LW.geometry_of(v, layer.problem(5))
    assert made[0].ws.numel() >= g.ws_floats(10, 128) > 4
    assert made[0].sem.numel() >= g.sem_count(10, 128)


def test_leading_dims_and_empty_input():
    qw = _qweight("nvfp4")
    v = LW.LinearSm90WgmmaVariant(1, 1, 16, 3)
    layer = Linear(qw, "full", device="cpu", variant=v, compile_fn=_Compiles(),
                   quantizer_fn=_quantizers([]))
    x = torch.randn(2, 3, 512).to(torch.bfloat16)
    y = layer(x)
    assert y.shape == (2, 3, 128)
    ref = R.linear(x.float().reshape(6, 512), qw, "full").reshape(2, 3, 128)
    assert _rel(y, ref) <= 3e-3
    assert layer(torch.empty(0, 512, dtype=torch.bfloat16)).shape == (0, 128)


@pytest.mark.parametrize("act", ["xop", "fused"])
@pytest.mark.parametrize("comp", ["full", "0.25"])
def test_mma_layer_xop_and_fused(act, comp, monkeypatch):
    """linear_sm90_mma through the dispatcher's default (xop, behind the quantizer) and a
    pinned fused variant (one launch, the K-Ext masks passed to the kernel)."""
    registry = _record_launcher_pointers(monkeypatch)
    qw = _qweight("nvfp4", n=64, k=1024, ratio=None if comp == "full" else float(comp))
    made = []
    kw = dict(device="cpu", compile_fn=_Compiles(registry), quantizer_fn=_quantizers(made))
    if act == "fused":
        v = LS.LinearSm90Variant(warps_m=4, warps_k=1, stages=3, act=LS.Act.FUSED)
        layer = Linear(qw, comp, variant=v, **kw)
    else:
        layer = Linear(qw, comp, family="linear_sm90_mma", dispatcher=_empty_dispatcher(), **kw)
    x = (torch.randn(3, 1024) * 2).to(torch.bfloat16)
    y = layer(x)
    ref = R.linear(x.float(), qw, comp if comp == "full" else float(comp))
    assert _rel(y, ref) <= 3e-3
    plan = layer.plan(3)
    assert plan.family == "linear_sm90_mma"
    assert (len(made) == 0) == (act == "fused")
    if act == "xop":
        assert plan.source == "default"


def test_a_kext_weight_serves_plain_and_mext_with_its_base():
    qw = _qweight("nvfp4", ratio=0.5)
    v = LW.LinearSm90WgmmaVariant(1, 1, 16, 3)
    layer = Linear(qw, "none", device="cpu", variant=v, compile_fn=_Compiles(),
                   quantizer_fn=_quantizers([]))
    assert layer.qweight.selection is None and layer.masks is None
    x = torch.randn(4, 512).to(torch.bfloat16)
    assert _rel(layer(x), R.linear(x.float(), qw, "none")) <= 3e-3


def test_dispatch_from_a_table_row(tmp_path):
    """The variant comes from the dispatch database when one answers (bucket M = 4 for 3
    rows); a problem the table lacks falls back to the family default."""
    qw = _qweight("mxfp4")
    v = LW.LinearSm90WgmmaVariant(1, 1, 16, 4, LW.Raster.TOK, LS.Packing.SPLIT, 2)
    p4 = LinearProblem("mxfp4", "full", 4, 128, 512)
    assert LW.FAMILY.why_invalid(v, p4, ARCH) is None
    db = tmp_path / "t.sqlite"
    _store_ok_row(db, v, p4)
    d = Dispatcher(paths=[db], device=Device("NVIDIA H200", ARCH))
    layer = Linear(qw, "full", device="cpu", dispatcher=d, compile_fn=_Compiles(),
                   quantizer_fn=_quantizers([]))
    plan = layer.plan(3)
    assert plan.variant == v and "bucket {'m': 4}" in plan.source
    x = torch.randn(3, 512).to(torch.bfloat16)
    assert _rel(layer(x), R.linear(x.float(), qw, "full")) <= 3e-3
    other = Linear(_qweight("mxfp4", n=64), "full", device="cpu", dispatcher=d,
                   family="linear_sm90_wgmma", compile_fn=_Compiles(),
                   quantizer_fn=_quantizers([]))
    assert other.plan(3).source == "default"


def _store_ok_row(db, v, p):
    """One timed ok row for (v, p) under the current fingerprint, as the tuner writes it."""
    from resgen.db import TuningDB
    from resgen.search.build import variant_fingerprint
    from resgen.search.record import ResultRecord, Status

    with TuningDB(db) as t:
        t.record(ResultRecord(
            problem=p, variant=v, environment=make_env("NVIDIA H200", ARCH),
            fingerprint=variant_fingerprint(LW.FAMILY, v, p, ARCH), status=Status.OK,
            median_us=10.0, samples_us=[10.0], space_index=0, policy={"tie_rel": 0.01}))


@pytest.mark.parametrize("bad, err", [
    (lambda x: x.float(), TypeError),
    (lambda x: x[:, :256], ValueError),
    (lambda x: x.numpy(), TypeError),
])
def test_bad_input_is_a_clear_error(bad, err):
    qw = _qweight("nvfp4")
    layer = Linear(qw, "none", device="cpu", variant=LW.LinearSm90WgmmaVariant(1, 1, 16, 3),
                   compile_fn=_Compiles(), quantizer_fn=_quantizers([]))
    with pytest.raises(err):
        layer(bad(torch.randn(2, 512).to(torch.bfloat16)))


def test_bad_configuration_is_a_clear_error():
    qw = _qweight("nvfp4")
    with pytest.raises(ValueError, match="ratio"):
        Linear(qw, 0.25, device="cpu")              # no selection for a K-Ext ratio
    with pytest.raises(ValueError, match="ratio"):
        Linear(_qweight("nvfp4", ratio=0.5), "0.25", device="cpu")
    with pytest.raises(ValueError, match="K-Ext ratio"):
        Linear(qw, "0.3", device="cpu")
    with pytest.raises(ValueError, match="compensation"):
        Linear(qw, "half", device="cpu")
    wide = LW.LinearSm90WgmmaVariant(2, 2, 16, 3)     # 256-channel CTA tiles, N = 128
    layer = Linear(qw, "none", device="cpu", variant=wide, compile_fn=_Compiles(),
                   quantizer_fn=_quantizers([]))
    with pytest.raises(ValueError, match="cannot run"):
        layer(torch.randn(1, 512).to(torch.bfloat16))


# ----------------------------------------------------------------------------- attention


class _RefAttention:
    """op_fn stand-in: resgen.reference.decode_attention with the kernel's call signature."""

    def __init__(self, made):
        self.made = made

    def __call__(self, compiled, v, p):
        self.made.append((v, p))

        def op(q, cache, bt, sl, out=None, sm_scale=None):
            y = R.decode_attention(q.float(), cache, bt, sl, compensation=p.compensation,
                                   pv="fp32" if p.pv == "f16" else "fp8").to(torch.bfloat16)
            if out is None:
                return y
            out.copy_(y)
            return out
        return op


def _attn(made, **kw):
    from resgen.ops import DecodeAttention

    compiles = []
    op = DecodeAttention(8, 2, 64, 16, dispatcher=_empty_dispatcher(),
                         compile_fn=lambda f, v, p, a: compiles.append((v, p)) or object(),
                         op_fn=_RefAttention(made), **kw)
    return op, compiles


def test_decode_attention_plans_per_batch_and_length_class():
    from resgen.kvcache import PagedKVCache

    made = []
    attn, compiles = _attn(made)
    g = torch.Generator().manual_seed(0)
    lens = [40, 7, 0]
    ks = [torch.randn(2, n, 64, generator=g) for n in lens]
    vs = [torch.randn(2, n, 64, generator=g) for n in lens]
    cache, bt, sl = PagedKVCache.from_dense(ks, vs, page_size=16)
    q = torch.randn(3, 8, 64, generator=g).to(torch.bfloat16)
    out = attn(q, cache, bt, sl)                       # longest = 40 -> class 64
    ref = R.decode_attention(q.float(), cache, bt, sl, compensation=True, pv="fp32")
    assert torch.equal(out, ref.to(torch.bfloat16))
    assert bool((out[2] == 0).all())                   # the empty sequence
    plan = attn.plan(3, 40)
    assert (plan.problem.batch, plan.problem.kv_len) == (3, 64) and plan.source == "default"
    # the whole class 33..64 reuses the plan; 65 is a new class; another batch a new plan
    for n in (33, 64):
        assert attn.plan(3, n) is plan
    assert attn.plan(3, 65) is not plan and attn.plan(4, 40) is not plan
    assert len(compiles) == 3
    # max_kv_len given: no read of seq_lens; into `out`
    buf = torch.empty_like(q)
    assert attn(q, cache, bt, sl, max_kv_len=40, out=buf) is buf


def test_decode_attention_falls_back_to_the_class_floor_and_checks_pins():
    from resgen.search.attention_sm90 import AttentionSm90Variant, Packing, Reduction

    # 4 splits need >= 4 pages: fine at 64 keys (page 16) but not at 33 (3 pages)
    v = AttentionSm90Variant(num_warps=4, kc=16, packing=Packing.PAIR, splits=4,
                             reduction=Reduction.LASTCTA, prefetch=True)

    class _Pinned:
        def lookup(self, op, p, family=None):
            return v if p.kv_len >= 64 else dataclasses.replace(v, splits=2)

        def source(self, op, p, family=None):
            return f"table kv {p.kv_len}"

    from resgen.ops import DecodeAttention

    made = []
    attn = DecodeAttention(8, 2, 64, 16, dispatcher=_Pinned(), op_fn=_RefAttention(made),
                           compile_fn=lambda f, vv, p, a: object())
    plan = attn.plan(1, 40)          # class 64: its variant needs 4 pages, 33 keys have 3
    assert plan.variant.splits == 2 and plan.problem.kv_len == 40
    assert attn.plan(1, 40) is plan          # 2 splits fit the whole class: cached
    assert attn.plan(1, 64) is plan
    # a pinned 4-split variant fits 64 keys but not the class floor (33): per call only
    pinned = DecodeAttention(8, 2, 64, 16, variant=v, op_fn=_RefAttention([]),
                             compile_fn=lambda f, vv, p, a: object())
    with pytest.raises(ValueError, match="cannot run"):
        pinned.plan(1, 20)
    first = pinned.plan(1, 64)
    assert first.variant == v and first.problem.kv_len == 64
    assert pinned.plan(1, 64) is not first
    with pytest.raises(ValueError, match="cannot run"):
        pinned.plan(1, 40)


def test_decode_attention_bad_input():
    from resgen.ops import DecodeAttention

    with pytest.raises(ValueError, match="multiple"):
        DecodeAttention(6, 4, 64)
    with pytest.raises(ValueError, match="pv"):
        DecodeAttention(8, 2, 64, pv="bf16")
    with pytest.raises(ValueError, match="geometry"):
        DecodeAttention(8, 2, 96)
    attn, _ = _attn([])
    with pytest.raises(ValueError, match="expects"):
        attn(torch.zeros(1, 4, 64, dtype=torch.bfloat16), None, None, torch.zeros(1))


# ----------------------------------------------------------------------------- nn front end


def test_fp4linear_from_an_nn_linear():
    from resgen.ops.nn import FP4Linear

    torch.manual_seed(0)
    lin = torch.nn.Linear(512, 128, bias=True)
    v = LW.LinearSm90WgmmaVariant(1, 1, 16, 3)
    mod = FP4Linear.from_linear(lin, "nvfp4", "full", input_scale=4.0 / (6 * 448),
                                device="cpu", variant=v, compile_fn=_Compiles(),
                                quantizer_fn=_quantizers([]))
    assert "compensation=full" in repr(mod) and mod.bias.dtype == torch.float32
    x = torch.randn(2, 3, 512)
    y = mod(x)
    assert y.dtype == torch.float32 and y.shape == (2, 3, 128)
    xb = x.to(torch.bfloat16).float().reshape(6, 512)
    ref = R.linear(xb, mod.op.qweight, "full") + lin.bias.detach()
    assert _rel(y.reshape(6, 128), ref) <= 3e-3
    with pytest.raises(ValueError, match="bias"):
        FP4Linear(mod.op.qweight, "none", torch.zeros(5), device="cpu", variant=v,
                  compile_fn=_Compiles(), quantizer_fn=_quantizers([]))


def test_plans_are_bounded(monkeypatch):
    import resgen.ops.common as OC

    monkeypatch.setattr(OC, "MAX_PLANS", 3)
    layer = Linear(_qweight("nvfp4"), "none", device="cpu",
                   variant=LW.LinearSm90WgmmaVariant(1, 1, 16, 3), compile_fn=_Compiles(),
                   quantizer_fn=_quantizers([]))
    first = layer.plan(1)
    for m in (2, 3, 1, 4):          # 1 is used again, so 2 is the oldest when 4 arrives
        layer.plan(m)
    assert list(layer._plans) == [3, 1, 4] and layer.plan(1) is first


# ----------------------------------------------------------------------------- served == tuned
#
# One launch path per family: resgen.ops serves `family.bind(...)` and the tuner's runner times
# the same bound call. With the kernels' CPU simulations standing in for the compiled kernels
# (and the quantizer's torch definition for quant_sm90, the attention emulator for the decode
# kernel), the served op and the runner must agree bit for bit on the same inputs.


def _sim_kernel(fam, v, p, registry):
    if fam.NAME == "linear_sm90_wgmma":
        return SimulatedKernel(LW.geometry_of(v, p))
    return _SimulatedKernel(LS.geometry_of(v, p), registry)


_BIND_CASES = [
    ("linear_sm90_mma", LS.LinearSm90Variant(warps_m=4, warps_k=1, stages=3)),
    ("linear_sm90_mma", LS.LinearSm90Variant(warps_m=2, warps_k=2, stages=2, split_k=2,
                                             reduce=LS.Reduction.WORKSPACE)),
    ("linear_sm90_mma", LS.LinearSm90Variant(warps_m=4, warps_k=1, stages=3, act=LS.Act.FUSED)),
    ("linear_sm90_wgmma", LW.LinearSm90WgmmaVariant(1, 1, 16, 3)),
    ("linear_sm90_wgmma", LW.LinearSm90WgmmaVariant(1, 1, 16, 2, LW.Raster.CH, LS.Packing.NIB,
                                                    2)),
]


@pytest.mark.parametrize("fam_name, v", _BIND_CASES, ids=lambda x: getattr(x, "name",
                                                                          lambda: x)())
@pytest.mark.parametrize("fmt, comp", [("nvfp4", "none"), ("nvfp4", "full"), ("mxfp4", "full"),
                                       ("nvfp4", "0.5")])
def test_served_linear_is_the_tuned_call_bit_for_bit(fam_name, v, fmt, comp, monkeypatch):
    """The tuner's runner (family.runner, as_layer, check, then the timed call on input set 1)
    and resgen.ops.Linear on that set's weight and BF16 activations give the same bits, for
    plain, M-Ext and K-Ext: the quantizer in front (the default one of `bind`, here the
    quantizer's torch definition) and the GEMM are one code path. Both also match the
    reference."""
    import resgen.search.sm90_linear as SL
    from resgen.search.family import get_family

    registry = _record_launcher_pointers(monkeypatch)
    fam = get_family(fam_name)
    p = LinearProblem(fmt, comp, 3, 64, 1024)
    assert fam.why_invalid(v, p, ARCH) is None, fam.why_invalid(v, p, ARCH)
    made = []

    def quantizer(problem, arch="sm_90a", layout=None):
        assert problem == p and arch == ARCH
        assert layout in (None, "row_pair" if p.compensation == "full" else "plain")
        alpha = "none" if fmt == "mxfp4" else "static"
        made.append(_ReferenceQuantizer(fmt, comp, alpha))
        return made[-1]

    monkeypatch.setattr(SL, "layer_quantizer", quantizer)
    compiled = _sim_kernel(fam, v, p, registry)
    r = fam.runner(compiled, v, p, "cpu", n_sets=2, seed=11)
    r.as_layer()                                # what the tuner does before check and timing
    chk = r.check()
    assert chk.ok, chk.detail
    r.rotate(1)
    tuned = r().clone()
    qw, xb = r.sets[1][0], r.xbs[1]
    layer = Linear(qw, comp, device="cpu", variant=v, compile_fn=lambda *a: compiled)
    served = layer(xb)
    assert not bool(served.isnan().any())
    assert torch.equal(served.view(torch.int16), tuned.view(torch.int16))
    assert len(made) == (0 if v.FAMILY == "linear_sm90_mma" and v.fused else 2)
    assert layer.plan(3).source == "pinned"
    ref = R.linear(xb.float(), qw, comp if comp in ("none", "full") else float(comp))
    assert _rel(served, ref) <= 3e-3


class _EmulatedDecodeAttention:
    """Stands in for resgen.kernels.attention_sm90.DecodeAttentionSm90 on the CPU (same
    constructor and call): the lane-level emulation of the kernel (attention_sm90_emu) with
    the variant's warps, chunk, packing and split count, rounded to BF16 like the kernel."""

    made: list = []

    def __init__(self, fn, shape, num_splits):
        from resgen.kernels.attention_sm90_emu import EmuConfig

        self.fn, self.shape, self.num_splits = fn, shape, num_splits
        self.cfg = EmuConfig(compensation=shape.compensation, packing=shape.packing,
                             pv=shape.pv, num_warps=shape.num_warps, num_splits=num_splits,
                             kc=shape.kc, query=shape.query)
        self.workspaces = []
        _EmulatedDecodeAttention.made.append(self)

    def workspace(self, batch, kv_heads, device):
        self.workspaces.append((batch, kv_heads, str(device)))

    def __call__(self, q, cache, block_tables, seq_lens, out=None, sm_scale=None):
        from resgen.kernels.attention_sm90_emu import emulate_decode_attention

        y = emulate_decode_attention(q.float(), cache, block_tables, seq_lens, self.cfg,
                                     sm_scale).to(torch.bfloat16)
        if out is None:
            return y
        out.copy_(y)
        return out


@pytest.mark.parametrize("compensation", [True, False, "q16"])
def test_served_attention_is_the_tuned_call_bit_for_bit(compensation, monkeypatch):
    """attention_sm90: the runner's bound op (family.bind) and resgen.ops.DecodeAttention
    without op_fn (so through the same family.bind) give the same bits on the runner's paged
    cache, ResAttn, plain NVFP4-KV and Q16, 2 KV splits reduced in the last CTA."""
    import resgen.kernels.attention_sm90 as KA
    from resgen.ops import DecodeAttention
    from resgen.search.attention_sm90 import (FAMILY, AttentionSm90Variant, Packing,
                                              Reduction)
    from resgen.search.variant import AttentionProblem

    monkeypatch.setattr(KA, "DecodeAttentionSm90", _EmulatedDecodeAttention)
    monkeypatch.setattr(_EmulatedDecodeAttention, "made", [])
    query = "q16" if compensation == "q16" else "nvfp4"     # Q16: the FP16 query, dense
    compensation = compensation is True
    p = AttentionProblem(2, 8, 2, 64, 64, 16, compensation, "f16", query)
    v = AttentionSm90Variant(num_warps=4, kc=16,
                             packing=Packing.DENSE if query == "q16" else Packing.PAIR,
                             splits=2, reduction=Reduction.LASTCTA, prefetch=True)
    assert FAMILY.why_invalid(v, p, ARCH) is None
    compiled = object()
    r = FAMILY.runner(compiled, v, p, "cpu", n_sets=1, seed=4)
    chk = r.check()
    assert chk.ok, chk.detail
    tuned = r().clone()
    q, cache, bt, sl = r.sets[0]
    attn = DecodeAttention(8, 2, 64, 16, compensation=None if query == "q16" else compensation,
                           query=query, variant=v, compile_fn=lambda f, vv, pp, a: compiled)
    served = attn(q, cache, bt, sl, max_kv_len=64)
    assert attn.plan(2, 64).problem == p
    assert torch.equal(served.view(torch.int16), tuned.view(torch.int16))
    assert not bool(served.isnan().any()) and bool(served.abs().sum() > 0)
    runner_op, served_op = _EmulatedDecodeAttention.made
    assert served_op.fn is runner_op.fn is compiled
    assert (served_op.shape, served_op.num_splits) == (runner_op.shape, runner_op.num_splits)


class _TiledQuantizer(_ReferenceQuantizer):
    """The reference quantizer with the real quant_sm90's K rule: it refuses a K that its
    warps (32 lanes x 8 values) cannot tile, and records the K it was given."""

    def __init__(self, p, *args):
        from resgen.kernels.quant_sm90 import QuantConfig

        alpha = "none" if p.fmt == "mxfp4" else ("static" if p.static_scale else "dynamic")
        cfg = QuantConfig(fmt=p.fmt, compensation=p.compensation, k=p.k,
                          layout="row_pair" if p.compensation == "full" else "plain",
                          write_codes=False, write_xop=True, alpha=alpha, kp_align=256)
        assert cfg.why_invalid() is None, cfg.why_invalid()
        super().__init__(p.fmt, p.compensation, alpha)
        self.k = p.k

    def __call__(self, x, outs, alpha=None, masks=None):
        assert x.shape[1] == self.k
        return super().__call__(x, outs, alpha=alpha, masks=masks)


@pytest.mark.parametrize("fam", ["linear_sm90_mma", "linear_sm90_wgmma"])
@pytest.mark.parametrize("fmt, static", [("nvfp4", True), ("nvfp4", False), ("mxfp4", True)])
@pytest.mark.parametrize("comp", ["none", "full"])
def test_a_k_the_quantizer_cannot_tile_is_served_through_zero_columns(fam, fmt, static, comp,
                                                                       monkeypatch):
    """K = 576 (SmolLM2's hidden size; 896 for Qwen2.5-0.5B): the real layer quantizer tiles
    K by 256, so the family pads the activations with zero columns up to 768 before it, and
    the result equals the reference on the real K (zero columns add nothing and leave the
    NVFP4 amax alone)."""
    from resgen.kernels.quant_sm90 import QuantConfig

    alpha = "static" if static else "dynamic"
    bad = QuantConfig(fmt=fmt, compensation=comp, k=576, write_codes=False, write_xop=True,
                      layout="row_pair" if comp == "full" else "plain",
                      alpha="none" if fmt == "mxfp4" else alpha, kp_align=256)
    assert bad.why_invalid() is not None          # the real quantizer refuses K = 576
    qw = _qweight(fmt, n=64, k=576, static=static)
    made = []
    registry = _record_launcher_pointers(monkeypatch) if fam == "linear_sm90_mma" else None
    layer = Linear(qw, comp, device="cpu", family=fam, dispatcher=_empty_dispatcher(),
                   compile_fn=_Compiles(registry), quantizer_fn=lambda p, a: made.append(
                       _TiledQuantizer(p)) or made[-1])
    g = torch.Generator().manual_seed(5)
    for m in (1, 7, 40):
        x = (torch.randn(m, 576, generator=g) * 3).to(torch.bfloat16)
        y = layer(x)
        assert layer.plan(m).family == fam and layer.plan(m).source == "default"
        ref = R.linear(x.float(), qw, comp)
        assert not bool(y.isnan().any()) and _rel(y, ref) <= 3e-3
    assert made and all(q.k == 768 for q in made)


@pytest.mark.parametrize("fam", ["linear_sm90_mma", "linear_sm90_wgmma"])
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_kext_at_a_k_the_quantizer_cannot_tile_runs_the_layer_zero_padded(fam, fmt,
                                                                          monkeypatch):
    """K-Ext at K = 576: the extension follows K in the weight, so the layer itself runs at
    K = 768 (zero channels, resgen.calibrate.pad_in_features) and equals the reference of the
    real layer; the quantizer sees a K it can tile."""
    from resgen.ops.linear import KEXT_K_ALIGN
    from resgen.search.sm90_linear import QUANT_K_ALIGN

    assert KEXT_K_ALIGN == QUANT_K_ALIGN
    qw = _qweight(fmt, n=64, k=576, ratio=0.125)
    made = []
    registry = _record_launcher_pointers(monkeypatch) if fam == "linear_sm90_mma" else None
    layer = Linear(qw, 0.125, device="cpu", family=fam, dispatcher=_empty_dispatcher(),
                   compile_fn=_Compiles(registry), quantizer_fn=lambda p, a: made.append(
                       _TiledQuantizer(p)) or made[-1])
    assert layer.k == 768 and layer.k_in == 576 and layer.problem(3).k == 768
    g = torch.Generator().manual_seed(6)
    for m in (3, 33):
        x = (torch.randn(m, 576, generator=g) * 3).to(torch.bfloat16)
        y = layer(x)
        ref = R.linear(x.float(), qw, 0.125)
        assert not bool(y.isnan().any()) and _rel(y, ref) <= 3e-3
    assert made and all(q.k == 768 for q in made)
    with pytest.raises(ValueError, match="K = 576"):
        layer(torch.zeros(2, 768, dtype=torch.bfloat16))


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("ratio", [None, 0.125, 0.5])
def test_pad_in_features_is_exact(fmt, ratio):
    from resgen.calibrate import pad_in_features

    qw = _qweight(fmt, n=32, k=576, ratio=ratio)
    pw = pad_in_features(qw, 768)
    assert pw.in_features == 768 and pw.out_features == 32
    comp = "none" if ratio is None else ratio
    x = torch.randn(5, 576) * 2
    xp = torch.cat([x, torch.zeros(5, 192)], 1)
    assert torch.equal(R.linear(xp, pw, comp), R.linear(x, qw, comp))
    if ratio is not None:
        assert torch.equal(R.linear(xp, pw, "full"), R.linear(x, qw, "full"))
        assert pw.selection.indices[: qw.selection.indices.numel()].equal(qw.selection.indices)
    with pytest.raises(ValueError, match="cannot pad"):
        pad_in_features(qw, 500)
