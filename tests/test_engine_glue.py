"""The engine's decode-step glue (resgen/engine/glue.py, issue 19): its kernel launches counted
per layer on the CPU (resgen.engine.glue_count), the eager reductions bit for bit, and the
compiled glue (resgen.load(..., compile="glue"), TorchInductor's C++ backend here) against the
eager glue on tiny models with the reference backend.

Counts of main 48c1103 measured with the same tool (tiny Qwen3 / Qwen2, 4 query / 2 KV heads,
NVFP4 paged cache, reference backend, batch 1, BF16 glue): 13 launches per layer for both
families, 10 per step outside the layers; the eager reductions here: Qwen3 12 per layer,
Qwen2 11, 7 outside the layers."""

from __future__ import annotations

import logging
from collections import Counter

import pytest
import torch

transformers = pytest.importorskip("transformers")

import resgen  # noqa: E402
from resgen.engine import glue as G  # noqa: E402
from resgen.engine.glue_count import compiled_glue_kernels, count_decode_glue  # noqa: E402
from resgen.engine.rope import apply_rope, rope_pairs, rope_tables, signed_sin  # noqa: E402
from test_engine import CALIB, tiny_model  # noqa: E402

logging.getLogger("resgen.runtime").setLevel(logging.ERROR)

SEQS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16], [3, 4, 100, 200, 201, 202, 7]]
PLENS = [4, 2]


def _load(m, **kw):
    opts = dict(backend="reference", max_batch=4, max_seq_len=64, page_size=16, calib=CALIB)
    opts.update(kw)
    return resgen.load(m, **opts)


# ----------------------------------------------------------------------------- counting


@pytest.mark.parametrize("kind, per_layer, ops", [
    ("qwen3", 12, {"rms_norm": 4, "cat": 1, "mul": 2, "add": 4, "silu": 1}),
    ("qwen2", 11, {"rms_norm": 2, "_to_copy": 1, "mul": 2, "add": 5, "silu": 1}),
])
def test_decode_glue_launches_per_layer(kind, per_layer, ops):
    """A steady layer's launches at batch 1 with BF16 glue (the serving setting), op by op:
    RMSNorms (input, post-attention, Qwen3's q and k, and the next layer's input norm or the
    final norm, which this layer's last region computes), RoPE as one broadcast multiply and
    two in-place half adds (main: mul, roll, mul, add), the residual adds, SwiGLU; Qwen2's
    q/k/v bias in one promoting add plus the cast back to BF16 (main: cast, add, cast).
    Outside the layers: 7 (main 10: the cos / sin gather is one, the final norm moved into the
    last layer, the logits' FP32 cast is the copy into the state)."""
    llm = _load(tiny_model(kind), glue="bf16", kv="nvfp4")
    c = count_decode_glue(llm, batch=1)
    print(c.report())
    assert c.layer_ops(1) == Counter(ops)
    assert sum(c.layer_ops(1).values()) == per_layer < 13
    assert sum(c.layer_ops(0).values()) == per_layer + 1       # layer 0 norms its own input
    assert c.outside() == 7 < 10
    assert sum(sum(v.values()) for v in c.ops.values()) == 2 * per_layer + 1 + 7


def test_decode_glue_batch_rows_add_only_the_kernels_contiguous_copies():
    """At batch 4 the paged kernels' contiguous q / k / v are three copies per layer (views
    at batch 1); nothing else depends on the batch."""
    m = tiny_model("qwen3")
    one = count_decode_glue(_load(m, glue="bf16", kv="nvfp4"), batch=1)
    four = count_decode_glue(_load(m, glue="bf16", kv="nvfp4"), batch=4)
    assert four.layer_ops(1) - one.layer_ops(1) == Counter({"clone": 3})
    assert four.outside() == one.outside()


def test_counting_refuses_compiled_glue():
    llm = _load(tiny_model("qwen3"), glue="bf16", compile="glue")
    with pytest.raises(ValueError, match="compile='none'"):
        count_decode_glue(llm)
    with pytest.raises(ValueError, match="compile must be one of"):
        _load(tiny_model("qwen3"), compile="max-autotune")


# ----------------------------------------------------------------------------- eager reductions


def test_rope_in_three_launches_equals_the_rotate_half_formula_bit_for_bit():
    """apply_rope (one multiply by [cos, rolled signed sin], two in-place half adds) equals
    x * cos + rotate_half(x) * sin with the products rounded separately (transformers' order),
    in FP32 and BF16, on positions far apart."""
    from resgen.engine.config import RopeConfig

    g = torch.Generator().manual_seed(0)
    cos, sin = rope_tables(RopeConfig(1e6), 64, 4096)
    pos = torch.tensor([0, 1, 17, 4095])
    for dt in (torch.float32, torch.bfloat16):
        x = torch.randn(4, 6, 64, generator=g).to(dt)
        c, s = cos[pos].to(dt), sin[pos].to(dt)
        h = 32
        rot = torch.cat([-x[..., h:], x[..., :h]], dim=-1)
        want = x * c[:, None] + rot * s[:, None]
        got = apply_rope(x, rope_pairs(cos, sin).to(dt)[pos])
        assert torch.equal(got, want)
        assert torch.equal(signed_sin(sin)[pos].to(dt), torch.cat([-s[:, :h], s[:, h:]], -1))


def test_bias_epilogue_equals_the_fp32_add_and_one_rounding():
    g = torch.Generator().manual_seed(1)
    y = torch.randn(5, 96, generator=g).bfloat16()
    b = torch.randn(96, generator=g)
    assert torch.equal(G.finish(y, b, torch.bfloat16), (y.float() + b).bfloat16())
    assert torch.equal(G.finish(y, b, torch.float32), y.float() + b)
    assert G.finish(y, None, torch.bfloat16) is y


# ----------------------------------------------------------------------------- compiled glue


def _close(a: torch.Tensor, b: torch.Tensor) -> float:
    assert bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all())
    return float((a - b).norm() / b.norm())


def test_compiled_glue_follows_eager_on_the_fp32_model():
    """The FP32 model (fmt "bf16" with FP32 glue: FP32 weights, FP32 dense KV, no quantization
    anywhere, so a rounding difference is not amplified by an FP4 code flip): teacher-forced
    logits of the prefill and of every decode step, compiled glue vs eager, within 1e-5
    relative. Not bit for bit: inductor sums the RMSNorm reductions in its own order and its
    C++ may contract a * b + c (measured here: below 1e-5 relative, not zero). Every region
    ran compiled (none fell back to eager), decode at the batch bucket and prefill."""
    m = tiny_model("qwen3")
    kw = dict(fmt="bf16", glue="fp32", kv="fp32")
    eager = _load(m, **kw)
    comp = _load(m, compile="glue", **kw)
    for x, y in zip(comp.forced_decode(SEQS, PLENS, reduce="logits"),
                    eager.forced_decode(SEQS, PLENS, reduce="logits")):
        assert _close(x, y) < 1e-5
    assert comp.glue_notes == []
    ran = comp.model.glue_fns.compiled()
    assert set(ran[("decode", 2)]) == set(G.REGIONS) and ("prefill", 0) in ran
    calls = {n: f.calls for n, f in comp.model.glue_fns.regions("decode", 2).items()}
    assert calls["qkv"] > 0 and calls["mlp_out"] > 0
    assert comp.score(SEQS)["nll"] == pytest.approx(eager.score(SEQS)["nll"], rel=1e-5)


def test_compiled_glue_serving_path_and_its_kernel_count():
    """The serving glue (BF16 glue, NVFP4 weights with full residue, paged NVFP4 KV, the
    reference backend's BF16 kernel interface): inductor fuses each region into one C++
    kernel (9 launches per step for two layers, eager 25), and the teacher-forced logits of
    the prefill and every decode step equal eager bit for bit on the CPU: BF16 intermediates
    are rounded where eager rounds them (inductor's emulate_precision_casts) and each BF16
    RMSNorm reduces in FP32 over one head / row, where the C++ reduction order happens to
    give eager's values (measured; the FP32 model above is not bit-identical). Greedy
    generation equal too."""
    m = tiny_model("qwen3")
    kw = dict(glue="bf16", kv="nvfp4", compensation="full")
    kernels = compiled_glue_kernels(_load(m, compile="glue", **kw), batch=1)
    print("inductor kernels per decode step:", kernels)
    eager = count_decode_glue(_load(m, **kw), batch=1)
    eager_regions = sum(sum(eager.layer_ops(i).values()) for i in range(2))
    # one C++ kernel per region call: attn_in once, then four regions per layer
    assert sum(kernels.values()) == 1 + 4 * 2 < eager_regions
    comp, eager = _load(m, compile="glue", **kw), _load(m, **kw)
    x, y = (llm.forced_decode(SEQS, PLENS, reduce="logits") for llm in (comp, eager))
    for a, b in zip(x, y):
        assert bool(torch.isfinite(a).all()) and torch.equal(a, b)
    ga = comp.generate(SEQS, max_new_tokens=6)
    gb = eager.generate(SEQS, max_new_tokens=6)
    assert [o.token_ids for o in ga] == [o.token_ids for o in gb]
    assert comp.last_stats["glue_notes"] == []
    assert set(comp.model.glue_fns.compiled()[("decode", 2)]) == set(G.REGIONS)


def test_a_region_that_fails_to_compile_runs_eagerly_and_is_noted():
    """A compile failure (here: a region whose compiled callable raises) is noted once and
    that region runs eagerly from then on; with every other region eager as well, the
    engine's logits equal the eager engine's bit for bit."""
    m = tiny_model("qwen3")
    llm = _load(m, glue="bf16", compile="glue")
    glue = llm.model.glue_fns

    def broken(*a, **k):
        raise RuntimeError("no C++ compiler")
    for phase, rows in (("decode", 1), ("prefill", 0)):
        for name, region in glue.regions(phase, rows).items():
            region.fn = broken if (phase, name) == ("decode", "mlp_mid") else None
    a = llm.forced_decode([SEQS[0]], [4], reduce="logits")[0]
    b = _load(m, glue="bf16").forced_decode([SEQS[0]], [4], reduce="logits")[0]
    assert torch.equal(a, b)
    assert len(llm.glue_notes) == 1 and "mlp_mid" in llm.glue_notes[0]
    assert "no C++ compiler" in llm.glue_notes[0]
    assert glue.regions("decode", 1)["mlp_mid"].fn is None


def test_compile_default_is_glue_on_cuda_only():
    """resgen.load(compile=None) compiles the glue on the CUDA backend and runs it eagerly on
    the CPU backends; a given mode is kept as given; the reference engine loads eager."""
    from resgen.engine.llm import resolve_compile

    assert resolve_compile(None, "cuda") == "glue"
    assert [resolve_compile(None, b) for b in ("sim", "reference")] == ["none", "none"]
    assert resolve_compile("none", "cuda") == "none" and resolve_compile("glue", "sim") == "glue"
    assert _load(tiny_model("qwen3")).options.compile == "none"


@pytest.mark.parametrize("flag, want", [([], None), (["--compile", "glue"], "glue"),
                                        (["--compile", "none"], "none")])
def test_cli_generate_passes_compile(monkeypatch, capsys, flag, want):
    """`resgen generate --compile glue` loads with compile="glue" (default None: resgen.load
    picks glue on the CUDA backend, none on the CPU ones); a bad
    value is argparse's usage error."""
    from resgen.cli import main
    from resgen.engine import llm as L

    seen = {}

    def fake_load(model, **kw):
        seen.update(kw)
        raise ValueError("stop here")
    monkeypatch.setattr(L, "load", fake_load)
    assert main(["generate", "--model", "m", "--prompt", "x", "--backend", "reference"]
                + flag) == 2
    assert seen["compile"] == want and "stop here" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", "--model", "m", "--prompt", "x", "--compile", "max"])
