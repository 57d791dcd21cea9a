"""resgen.engine on the CPU with tiny random Llama / Qwen2 / Qwen3 models (transformers builds
them from a config): the reference backend against transformers' own model with the quality
study's fake-quant layers on the engine's weights (bit for bit in FP32), the decode path and
the paged NVFP4 cache against transformers with an NVFP4-quantized KV cache, the kernels'
CPU simulations against the reference backend, batching, sampling, stops, KV budgets, bad
input and the CLI. SmolLM2's real weights: tests/test_engine_smollm2.py."""

from __future__ import annotations

import json
import logging

import pytest
import torch

transformers = pytest.importorskip("transformers")

import resgen  # noqa: E402
from resgen import formats  # noqa: E402
from resgen.engine.config import DecoderConfig, RopeConfig  # noqa: E402
from resgen.engine.fakequant_ref import fakequant_linears, swap_linears  # noqa: E402
from resgen.engine.kv import KVBudgetError, bytes_per_token  # noqa: E402

transformers.logging.set_verbosity_error()
logging.getLogger("resgen.runtime").setLevel(logging.ERROR)   # sim: no tuned table rows

VOCAB = 320


def tiny_model(kind: str, seed: int = 0, layers: int = 2):
    """A random transformers causal LM of the family (4 query / 2 KV heads of 64, hidden
    128): weights ~ N(0, 1/K), norms near 1, biases ~ N(0, 0.25)."""
    cls = {"qwen3": transformers.Qwen3Config, "qwen2": transformers.Qwen2Config,
           "llama": transformers.LlamaConfig}[kind]
    cfg = cls(vocab_size=VOCAB, hidden_size=128, intermediate_size=256,
              num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
              head_dim=64, max_position_embeddings=512, tie_word_embeddings=kind != "llama",
              eos_token_id=None, bos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    m = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.5 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    m.requires_grad_(False)
    return m


CALIB = [torch.randint(0, VOCAB, (48,), generator=torch.Generator().manual_seed(7))]


def _load(m, **kw):
    opts = dict(backend="reference", max_batch=4, max_seq_len=64, page_size=16)
    opts.update(kw)
    return resgen.load(m, **opts)


@torch.no_grad()
def _hf_logits(m, seq):
    return m(torch.tensor([seq])).logits[0].float()


# ----------------------------------------------------------------------------- config / RoPE


def test_config_families_and_refusals():
    base = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    llama = DecoderConfig.from_hf({**base, "model_type": "llama", "eos_token_id": [5, 7]})
    assert (llama.head_dim, llama.qkv_bias, llama.qk_norm, llama.eos_token_ids) == \
        (16, False, False, (5, 7))
    assert llama.linear_shapes() == {"qkv": (128, 64), "o": (64, 64), "gate_up": (256, 64),
                                     "down": (64, 128)}
    q2 = DecoderConfig.from_hf({**base, "model_type": "qwen2", "tie_word_embeddings": True})
    assert q2.qkv_bias and not q2.o_bias and q2.tie_embeddings
    q3 = DecoderConfig.from_hf({**base, "model_type": "qwen3", "head_dim": 32,
                                "attention_bias": True})
    assert q3.qk_norm and q3.qkv_bias and q3.o_bias and q3.q_size == 128
    for bad, match in (({"model_type": "gpt2"}, "model_type"),
                       ({"model_type": "llama", "hidden_act": "gelu"}, "hidden_act"),
                       ({"model_type": "qwen2", "use_sliding_window": True}, "sliding"),
                       ({"model_type": "llama", "mlp_bias": True}, "mlp_bias"),
                       ({"model_type": "llama", "num_key_value_heads": 3}, "multiple"),
                       ({"model_type": "llama", "rope_scaling": {"type": "dynamic",
                                                                 "factor": 2.0}}, "dynamic"),
                       ({"model_type": "llama", "partial_rotary_factor": 0.5}, "partial"),
                       ({"model_type": "llama", "vocab_size": 0}, "vocab_size")):
        with pytest.raises(ValueError, match=match):
            DecoderConfig.from_hf({**base, **bad})


@pytest.mark.parametrize("scaling", [
    None,
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096,
     "beta_fast": 16, "beta_slow": 2, "mscale": 1.0, "mscale_all_dim": 0.5},
])
def test_rope_matches_transformers(scaling):
    """inv_freq and the attention factor equal transformers' rotary embedding's."""
    from resgen.engine.rope import inv_freq

    cfg = dict(vocab_size=100, hidden_size=512, intermediate_size=128, num_hidden_layers=1,
               num_attention_heads=4, num_key_value_heads=2, head_dim=128,
               max_position_embeddings=32768, rope_theta=500000.0)
    if scaling is not None:
        cfg["rope_scaling"] = dict(scaling)
    hf_cfg = transformers.LlamaConfig(**cfg)
    emb = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(hf_cfg)
    ours = DecoderConfig.from_hf({**cfg, "model_type": "llama"})
    f, att = inv_freq(ours.rope, 128)
    assert torch.equal(f, emb.inv_freq.float()), (f - emb.inv_freq).abs().max()
    assert att == pytest.approx(emb.attention_scaling, rel=1e-12)
    assert (ours.rope.type == "default") == (scaling is None)


def test_rope_config_reads_transformers5_rope_parameters():
    r = RopeConfig.from_hf({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}})
    assert (r.theta, r.type) == (1e6, "default")
    with pytest.raises(ValueError, match="factor"):
        RopeConfig.from_hf({"rope_scaling": {"rope_type": "linear"}})


# ----------------------------------------------------------------------------- numerics


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("fmt, comp", [("nvfp4", "none"), ("nvfp4", "full"), ("mxfp4", "full"),
                                       ("nvfp4", 0.25), ("nvfp4", "w4a16"), ("mxfp4", "w4a16")])
def test_prefill_equals_the_fakequant_model_bit_for_bit(kind, fmt, comp):
    """The reference engine (FP32 glue, FP32 linear I/O) gives the same logits as
    transformers' model with the quality study's FakeQuantLinear on the engine's weights
    (static NVFP4 scales and the K-Ext selection from the engine's calibration)."""
    m = tiny_model(kind)
    llm = _load(m, fmt=fmt, compensation=comp, kv="fp32", io="fp32", calib=CALIB)
    if fmt == "nvfp4":
        assert all(p.qweight.input_scale is not None for L in llm.model.layers
                   for p in L.projections().values())
    seq = [5, 6, 7, 8, 9, 10, 11, 250, 3]
    h = llm.model.prefill([torch.tensor(seq)], store=False, want="hidden")
    got = llm.model.logits(h)
    old = swap_linears(m, fakequant_linears(llm))
    try:
        ref = _hf_logits(m, seq)
    finally:
        swap_linears(m, old)
    assert torch.equal(got, ref), float((got - ref).abs().max())
    assert not torch.equal(got, _hf_logits(m, seq))        # the FP4 model is not the FP32 one


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_decode_path_equals_the_model(kind):
    """Teacher forcing through the decode steps (dense FP32 cache, unquantized weights) gives
    the logits of transformers' full-sequence forward (FP32 summation order only)."""
    m = tiny_model(kind)
    llm = _load(m, fmt="bf16", kv="fp32")
    seqs = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [3, 4, 100, 200, 201, 202]]
    got = llm.forced_decode(seqs, [3, 2], reduce="logits")
    for g, s, p in zip(got, seqs, (3, 2)):
        ref = _hf_logits(m, s)[p - 1: len(s) - 1]
        assert g.shape == ref.shape
        assert float((g - ref).norm() / ref.norm()) < 1e-5


class _QdqCache(transformers.DynamicCache):
    """transformers' cache storing K and V quantized to NVFP4 (global scale 1, blocks of 16
    along the head dim: resgen.kvcache's layout); prompts attend exactly, decode steps read
    the quantized cache, as the engine does."""

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        def qdq(x):
            return formats.dequantize(formats.quantize(x.float(), "nvfp4", global_scale=1.0))
        keys, values = super().update(qdq(key_states), qdq(value_states), layer_idx, *args,
                                      **kwargs)
        if key_states.shape[-2] > 1:
            return key_states, value_states
        return keys, values


@torch.no_grad()
def _hf_qdq_decode(m, seq, p):
    cache = _QdqCache()
    out = m(torch.tensor([seq[:p]]), past_key_values=cache, use_cache=True)
    logits = [out.logits[0, -1]]
    for t in seq[p:-1]:
        out = m(torch.tensor([[t]]), past_key_values=cache, use_cache=True)
        logits.append(out.logits[0, -1])
    return torch.stack(logits).float()


class _ExactAttention:
    """The decode attention call on unquantized queries over the dequantized cache."""

    def warmup(self, shapes):
        return []

    def __call__(self, q, cache, bt, sl, *, max_kv_len=None, out=None, sm_scale=None):
        from resgen import reference as R

        kv = [cache.gather(bt[b], int(sl[b])) for b in range(q.shape[0])]
        return R.attention_fp32(q.float(), [k for k, _ in kv], [v for _, v in kv])


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_paged_nvfp4_cache_holds_the_quantized_kv(kind):
    """The paged NVFP4 cache (append, block tables, scratch page) holds exactly the NVFP4 K/V
    transformers' quantized cache holds: with exact attention over it the decode logits agree
    to FP32 rounding; ResAttn's query quantization then adds a small error, plain NVFP4-KV
    attention (query quantized without residue) a larger one; Q16 (the query rounded to FP16
    only) a far smaller one than ResAttn."""
    m = tiny_model(kind)
    seq, p = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23], 3
    ref = _hf_qdq_decode(m, seq, p)
    errs = {}
    for attn in ("exact", "resattn", "plain", "q16"):
        llm = _load(m, fmt="bf16", kv="nvfp4", io="fp32",
                    attn="resattn" if attn == "exact" else attn)
        if attn == "exact":
            llm.model.attn = _ExactAttention()
        got = llm.forced_decode([seq], [p], reduce="logits")[0]
        errs[attn] = float((got - ref).norm() / ref.norm())
    assert errs["exact"] < 1e-5, errs
    assert errs["resattn"] < 0.05 and errs["resattn"] < errs["plain"], errs
    assert errs["q16"] < 0.2 * errs["resattn"], errs


def test_attention_mode_defaults_to_q16_for_w4a16_only():
    m = tiny_model("qwen3", layers=1)
    assert _load(m, compensation="w4a16").options.attn == "q16"
    assert _load(m, compensation="w4a16", attn="resattn").options.attn == "resattn"
    assert _load(m, fmt="bf16", kv="nvfp4").options.attn == "resattn"
    with pytest.raises(ValueError, match="attn"):
        _load(m, attn="fp16")


@pytest.mark.parametrize("kind, comp", [("qwen2", "full"), ("qwen3", "full"),
                                        ("qwen3", "w4a16")])
def test_sim_backend_runs_the_kernel_path_like_the_reference(kind, comp):
    """The kernels' CPU simulations behind resgen.ops (quantizer operand or, for W4A16, the
    BF16 operand; wgmma simulation, attention / append contracts) give the reference
    backend's logits (BF16 interface) up to summation order, and the same greedy tokens."""
    m = tiny_model(kind, layers=1)
    kw = dict(fmt="nvfp4", compensation=comp, kv="nvfp4", calib=CALIB)
    sim, ref = _load(m, backend="sim", **kw), _load(m, backend="reference", **kw)
    assert type(sim.model.layers[0].qkv.op).__name__ == "Linear"     # resgen.ops.Linear
    seqs = [[5, 6, 7, 8, 9, 10, 11], [3, 4, 100]]
    a = sim.forced_decode(seqs, [4, 2], reduce="logits")
    b = ref.forced_decode(seqs, [4, 2], reduce="logits")
    for x, y in zip(a, b):
        assert bool(torch.isfinite(x).all())
        assert float((x - y).norm() / y.norm()) < 2e-2
    assert [o.token_ids for o in sim.generate(seqs, max_new_tokens=3)] == \
        [o.token_ids for o in ref.generate(seqs, max_new_tokens=3)]


def test_engine_serves_kext_presum_on_the_sim_backend_like_the_reference():
    """resgen.load(..., compensation=0.25, kext_fold="presum"): every projection's op runs the
    K-Ext presum workload (resgen.ops.Linear's fold; the reference backend's fake-quant layers
    the same fold), the sim backend's logits equal the reference's up to summation order, and
    the presum model differs from the exact-fold one (its own numerics). A bad fold is
    refused before any work."""
    m = tiny_model("qwen3", layers=1)
    kw = dict(fmt="nvfp4", compensation=0.25, kv="nvfp4", calib=CALIB, kext_fold="presum")
    sim, ref = _load(m, backend="sim", **kw), _load(m, backend="reference", **kw)
    op = sim.model.layers[0].qkv.op
    assert type(op).__name__ == "Linear" and op.fold == "presum"
    assert op.problem(4).kext_presum
    assert ref.model.layers[0].qkv.op.mod.fold == "presum"
    seqs = [[5, 6, 7, 8, 9, 10, 11], [3, 4, 100]]
    a = sim.forced_decode(seqs, [4, 2], reduce="logits")
    b = ref.forced_decode(seqs, [4, 2], reduce="logits")
    exact = _load(m, backend="reference", **{**kw, "kext_fold": "exact"})
    c = exact.forced_decode(seqs, [4, 2], reduce="logits")
    for x, y, z in zip(a, b, c):
        assert bool(torch.isfinite(x).all())
        assert float((x - y).norm() / y.norm()) < 2e-2
        assert not torch.equal(y, z)
    with pytest.raises(ValueError, match="kext_fold"):
        _load(m, **{**kw, "kext_fold": "sum"})


# ----------------------------------------------------------------------------- generation


@pytest.fixture(scope="module")
def qwen2_llm():
    """Qwen2 (biases), NVFP4 static scales + full residue, paged NVFP4 cache, ResAttn."""
    return _load(tiny_model("qwen2"), fmt="nvfp4", compensation="full", kv="nvfp4",
                 calib=CALIB)


def test_batch_of_different_lengths_equals_solo_runs(qwen2_llm):
    prompts = [[5, 6, 7, 8, 9, 10, 11], [3, 4, 100, 200], [1] * 13]
    batch = qwen2_llm.generate(prompts, max_new_tokens=6)
    solo = [qwen2_llm.generate(p, max_new_tokens=6)[0] for p in prompts]
    assert [o.token_ids for o in batch] == [o.token_ids for o in solo]
    assert all(len(o.token_ids) == 6 and o.finish_reason == "length" for o in batch)
    assert [o.prompt_tokens for o in batch] == [7, 4, 13]
    s = qwen2_llm.last_stats
    assert s["prefill_tokens"] == 13 and s["decode_steps"] == 5 and s["decode_tokens"] == 5
    # more prompts than max_batch (4) run in batches of 4, in order
    many = qwen2_llm.generate(prompts + prompts[:2], max_new_tokens=6)
    assert [o.token_ids for o in many] == [o.token_ids for o in batch + batch[:2]]
    # the pages are given back after every batch
    kv = qwen2_llm.model.kv
    assert len(kv.free) == kv.num_pages - 1


def test_greedy_is_the_argmax_of_the_teacher_forced_logits(qwen2_llm):
    p = [5, 6, 7, 8]
    toks = qwen2_llm.generate(p, max_new_tokens=5)[0].token_ids
    logits = qwen2_llm.forced_decode([p + toks], [len(p)], reduce="logits")[0]
    assert logits.argmax(-1).tolist() == toks


def test_sampling_is_reproducible_with_a_seed(qwen2_llm):
    kw = dict(max_new_tokens=8, temperature=1.5, top_p=0.95)
    a = qwen2_llm.generate([[5, 6, 7], [9, 9]], seed=3, **kw)
    b = qwen2_llm.generate([[5, 6, 7], [9, 9]], seed=3, **kw)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    others = {tuple(qwen2_llm.generate([5, 6, 7], seed=s, **kw)[0].token_ids)
              for s in range(4, 8)}
    assert len(others) > 1
    greedy = qwen2_llm.generate([5, 6, 7], max_new_tokens=8)[0].token_ids
    tiny_p = qwen2_llm.generate([5, 6, 7], max_new_tokens=8, temperature=1.0, top_p=1e-6,
                                seed=0)[0].token_ids
    assert tiny_p == greedy             # top-p this small keeps only the most likely token


def test_stop_tokens(qwen2_llm):
    p = [5, 6, 7, 8]
    toks = qwen2_llm.generate(p, max_new_tokens=8)[0].token_ids
    stop = toks[2]
    k = toks.index(stop)
    out = qwen2_llm.generate([p, [3, 4]], max_new_tokens=8, stop=[stop])
    assert out[0].token_ids == toks[:k + 1] and out[0].finish_reason == "stop"
    # the model's EOS ids stop too (config / generation_config)
    qwen2_llm.source.generation["eos_token_id"] = [stop]
    try:
        assert qwen2_llm.generate(p, max_new_tokens=8)[0].token_ids == toks[:k + 1]
    finally:
        qwen2_llm.source.generation.pop("eos_token_id")


def test_kv_budget_errors_and_bytes_per_token():
    m = tiny_model("llama", layers=1)
    per_tok = bytes_per_token(1, 2, 64, "nvfp4")
    assert per_tok == 2 * 2 * (32 + 4) and bytes_per_token(1, 2, 64, "bf16") == 2 * 2 * 128
    with pytest.raises(KVBudgetError, match="pages"):
        _load(m, fmt="bf16", kv="nvfp4", kv_budget=per_tok * 16)         # one page
    llm = _load(m, fmt="bf16", kv="nvfp4", kv_budget=per_tok * 16 * 3)   # 2 usable pages
    info = llm.kv_info()
    assert info["capacity_tokens"] == 32 and info["bytes_per_token"] == per_tok
    assert info["bytes_per_token"] / info["bf16_bytes_per_token"] == pytest.approx(0.28125)
    llm.generate([1, 2, 3], max_new_tokens=20)                           # 23 tokens: 2 pages
    with pytest.raises(KVBudgetError, match="need 4 KV pages"):
        llm.generate([[1, 2, 3], [4, 5, 6]], max_new_tokens=20)
    assert len(llm.model.kv.free) == 2                                   # nothing leaked
    dense = _load(m, fmt="bf16", kv="bf16", kv_budget=bytes_per_token(1, 2, 64, "bf16") *
                  4 * 10, max_batch=4)
    assert dense.max_seq_len == 10
    with pytest.raises(ValueError, match="max_seq_len"):
        dense.generate([1, 2, 3], max_new_tokens=8)


def test_bad_input_is_a_clear_error(qwen2_llm):
    m = tiny_model("llama", layers=1)
    for kw, err, match in ((dict(fmt="fp8"), ValueError, "fmt"),
                           (dict(kv="int8"), ValueError, "kv"),
                           (dict(compensation="half"), ValueError, "compensation"),
                           (dict(compensation=0.25), ValueError, "calib"),
                           (dict(attn="flash"), ValueError, "attn"),
                           (dict(backend="tpu"), ValueError, "backend"),
                           (dict(max_batch=0), ValueError, "max_batch"),
                           (dict(kv="fp32", backend="sim"), ValueError, "reference")):
        with pytest.raises(err, match=match):
            _load(m, **kw)
    with pytest.raises(RuntimeError, match="CUDA"):
        if torch.cuda.is_available():
            raise RuntimeError("CUDA present: nothing to check")
        _load(m, backend="cuda")
    for prompts, kw, match in (([[]], {}, "no tokens"), ([], {}, "no prompts"),
                               ("hi", {}, "tokenizer"),
                               ([1, 2, VOCAB], dict(max_new_tokens=4), "vocabulary"),
                               ([1, 2], dict(max_new_tokens=0), "max_new_tokens"),
                               ([1] * 60, dict(max_new_tokens=8), "max_seq_len"),
                               ([1, 2], dict(temperature=-1.0), "temperature"),
                               ([1, 2], dict(top_p=0.0), "top_p"),
                               ([1, 2], dict(stop=[1.5]), "stop"),
                               ([[1.5, 2]], dict(max_new_tokens=4), "token ids")):
        with pytest.raises((ValueError, TypeError), match=match):
            qwen2_llm.generate(prompts, **kw)
    sd = dict(m.state_dict())
    cfg = m.config.to_dict()
    del sd["model.layers.0.mlp.up_proj.weight"]
    with pytest.raises(KeyError, match="up_proj"):
        _load((cfg, sd), fmt="bf16")
    sd = dict(m.state_dict())
    sd["model.layers.0.self_attn.o_proj.weight"] = torch.zeros(128, 100)
    with pytest.raises(ValueError, match="o_proj"):
        _load((cfg, sd), fmt="bf16")
    with pytest.raises(FileNotFoundError):
        resgen.load("/no/such/model")


def test_a_plan_sets_each_fused_projection(qwen2_llm, caplog):
    from resgen.engine.build import compensation_of

    cfg = qwen2_llm.cfg
    plan = {f"layers.{i}.{p}": 0.0 for i in range(2) for p in
            ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
             "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    plan["layers.1.self_attn.k_proj"] = 0.25
    plan["layers.0.mlp.down_proj"] = 1.0
    with caplog.at_level(logging.WARNING, "resgen.engine"):
        c = compensation_of(plan, cfg)
    assert c[(1, "qkv")] == "0.25" and c[(0, "down")] == "full" and c[(0, "qkv")] == "none"
    assert "largest" in caplog.text
    del plan["layers.1.mlp.down_proj"]
    with pytest.raises(ValueError, match="no entry"):
        compensation_of(plan, cfg)
    m = tiny_model("qwen2")
    llm = _load(m, fmt="nvfp4", compensation={**plan, "layers.1.mlp.down_proj": 0.5},
                calib=CALIB)
    assert llm.model.layers[1].qkv.compensation == "0.25"
    assert llm.model.layers[1].down.qweight.selection.ratio == 0.5
    assert llm.generate([5, 6], max_new_tokens=2)[0].token_ids


def test_calibration_file_round_trip(tmp_path, qwen2_llm):
    from resgen.engine.calib import Calibration

    cal = qwen2_llm.calibration
    assert cal.tokens == 48 and len(cal.sites) == 2 * 4
    full, masks = tmp_path / "scores.safetensors", tmp_path / "masks.safetensors"
    cal.save(full)
    cal.save(masks, ratios=(0.125, 0.5))
    for path in (full, masks):
        back = Calibration.load(path)
        for name, s in cal.sites.items():
            assert torch.equal(back.site(name).input_scale(), s.input_scale())
            for r in (0.125, 0.5):
                assert torch.equal(back.site(name).selection(r).masks, s.selection(r).masks)
    with pytest.raises(ValueError, match="no channel scores"):
        Calibration.load(masks).site("layers.0.attn_in").selection(0.25)
    m = tiny_model("qwen2")
    a = _load(m, fmt="nvfp4", compensation=0.5, calib=str(masks))
    b = _load(m, fmt="nvfp4", compensation=0.5, calib=CALIB)
    for La, Lb in zip(a.model.layers, b.model.layers):
        for pa, pb in zip(La.projections().values(), Lb.projections().values()):
            assert torch.equal(pa.qweight.q.codes, pb.qweight.q.codes)
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="safetensors"):
        Calibration.load(bad)


def test_a_saved_folder_loads(tmp_path):
    m = tiny_model("qwen3")
    m.save_pretrained(tmp_path / "m")
    (tmp_path / "m" / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    llm = resgen.load(tmp_path / "m", backend="reference", fmt="bf16", kv="fp32",
                      max_seq_len=64)
    assert 7 in llm.stop_ids()
    seq = [5, 6, 7, 8]
    got = llm.model.logits(llm.model.prefill([torch.tensor(seq)], store=False, want="hidden"))
    assert float((got - _hf_logits(m, seq)).abs().max()) == 0.0


@pytest.mark.parametrize("fmt, comp", [("nvfp4", "full"), ("mxfp4", "0.25")])
def test_an_fp4_checkpoint_loads_through_resgen_checkpoint(tmp_path, fmt, comp):
    """An engine's quantization written in ModelOpt's layout (resgen.checkpoint.
    save_checkpoint, per HF module, q/k/v and gate/up unfused) and loaded back through
    resgen.checkpoint (fuse_linears: equal tensor scales, so the bytes are restacked) runs the
    same numbers: bit-equal logits on the decode path, the same tokens."""
    from resgen.checkpoint import save_checkpoint
    from resgen.engine.fakequant_ref import module_weights

    m = tiny_model("qwen2")
    a = _load(m, fmt=fmt, compensation=comp, kv="nvfp4", calib=CALIB)
    linears = module_weights(a)
    tensors = {k: v for k, v in m.state_dict().items()
               if k.removesuffix(".weight") not in linears and k != "lm_head.weight"}
    save_checkpoint(tmp_path / "ck", config=m.config.to_dict(), linears=linears,
                    tensors=tensors,
                    compensation={n: comp for n in linears})
    b = resgen.load(tmp_path / "ck", backend="reference", compensation="checkpoint",
                    kv="nvfp4", max_batch=4, max_seq_len=64, page_size=16)
    assert b.source.qlinears is not None and b.calibration is None
    for La, Lb in zip(a.model.layers, b.model.layers):
        for pa, pb in zip(La.projections().values(), Lb.projections().values()):
            assert pb.compensation == pa.compensation
            assert torch.equal(pa.qweight.q.codes, pb.qweight.q.codes)
    seqs = [[5, 6, 7, 8, 9, 10], [3, 4, 100]]
    for x, y in zip(a.forced_decode(seqs, [3, 2], reduce="logits"),
                    b.forced_decode(seqs, [3, 2], reduce="logits")):
        assert torch.equal(x, y)
    with pytest.raises(ValueError, match="FP4 checkpoint"):
        resgen.load(tmp_path / "ck", backend="reference", fmt="bf16")


def test_dense_decode_attention_reads_each_row_to_its_length():
    from resgen import reference as R
    from resgen.engine.model import DenseDecodeAttention

    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 8, 64, generator=g)
    k, v = torch.randn(3, 100, 2, 64, generator=g), torch.randn(3, 100, 2, 64, generator=g)
    lens = torch.tensor([37, 64, 0], dtype=torch.int32)
    att = DenseDecodeAttention()
    assert att.resolve(torch.device("cpu"), torch.float32, 2, 4, 64) == "masked"
    got = att(q, k, v, lens, 64 ** -0.5, window=64)
    ref = R.attention_fp32(q, [k[b, : int(n)].transpose(0, 1) for b, n in enumerate(lens)],
                           [v[b, : int(n)].transpose(0, 1) for b, n in enumerate(lens)])
    assert float((got - ref).abs().max()) < 1e-5 and bool((got[2] == 0).all())


def test_decode_runner_buckets():
    from resgen.engine.graphs import MIN_KV_CLASS, batch_buckets

    assert batch_buckets(1) == [1] and batch_buckets(6) == [1, 2, 4, 6]
    assert batch_buckets(8) == [1, 2, 4, 8]
    llm = _load(tiny_model("llama", layers=1), fmt="bf16", kv="nvfp4", max_batch=6)
    r = llm.runner
    assert not r.use_graphs                            # CPU: eager steps
    assert [r.bucket(n) for n in (1, 3, 5, 6)] == [1, 4, 6, 6]
    assert [r.kv_class(n) for n in (1, 64, 65, 300)] == [MIN_KV_CLASS, 64, 128, 512]
    with pytest.raises(ValueError, match="max_batch"):
        r.bucket(7)


# ----------------------------------------------------------------------------- CLI


def _tokenizer_folder(path):
    """A word-level tokenizer over VOCAB ids (w0 .. w319), saved with transformers."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(VOCAB)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="w0",
                                                eos_token="w2")
    fast.save_pretrained(path)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli") / "tiny"
    tiny_model("llama").save_pretrained(d)
    _tokenizer_folder(d)
    return d


def test_cli_generate_streams_and_reports_speed(model_dir, capsys):
    from resgen.cli import main

    rc = main(["generate", "--model", str(model_dir), "--prompt", "w5 w6 w7",
               "--max-new-tokens", "4", "--backend", "reference", "--compensation", "none",
               "--max-seq-len", "64"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    lines = out.out.strip().splitlines()
    assert lines[-1].startswith("prefill: 3 tokens") and "decode:" in lines[-1]
    assert "time to first token" in lines[-1]
    assert all(w.startswith("w") for w in lines[0].split())
    rc = main(["generate", "--model", str(model_dir), "--prompt", "w5 w6", "--prompt", "w9",
               "--max-new-tokens", "3", "--backend", "reference", "--fmt", "mxfp4",
               "--max-seq-len", "64"])
    out = capsys.readouterr()
    assert rc == 0 and out.out.count("--- prompt") == 2


@pytest.mark.parametrize("args, match", [
    (["--model", "/no/such/dir"], "no such file"),
    (["--compensation", "0.3"], "K-Ext ratio"),
    (["--compensation", "0.25"], "calib"),
    (["--kv-budget", "1K"], "pages"),
    (["--max-seq-len", "8", "--max-new-tokens", "20"], "max_seq_len"),
    (["--calib", "/no/such/text.txt"], "calibration file"),
    (["--top-p", "2"], "top-p"),
    (["--backend", "cuda"], "CUDA"),
])
def test_cli_bad_input_is_one_line_and_exit_2(model_dir, capsys, args, match):
    from resgen.cli import main

    if "cuda" in args and torch.cuda.is_available():
        pytest.skip("a GPU is present")
    base = ["generate", "--model", str(model_dir), "--prompt", "w5 w6", "--backend",
            "reference", "--max-seq-len", "64"]
    rc = main(base + args)
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert len(err.splitlines()) == 1 and err.startswith("resgen generate: error:"), err
    assert match in err, err


def test_a_plan_gives_w4a16_to_whole_fused_projections_only():
    """W4A16 in a per-layer plan: a fused projection whose parts all say "w4a16" runs it; one
    part alone saying it is refused by name (the fused GEMM reads one activation operand)."""
    from types import SimpleNamespace

    from resgen.engine.build import HF_PARTS, compensation_of

    cfg = SimpleNamespace(layers=1)
    plan = {f"layers.0.{part}": "full" for parts in HF_PARTS.values() for part in parts}
    for part in HF_PARTS["qkv"]:
        plan[f"layers.0.{part}"] = "w4a16"
    got = compensation_of(plan, cfg)
    assert got[(0, "qkv")] == "w4a16" and got[(0, "down")] == "full"
    plan[f"layers.0.{HF_PARTS['qkv'][0]}"] = "full"
    with pytest.raises(ValueError, match=r"layer 0 qkv .*W4A16 for some parts only"):
        compensation_of(plan, cfg)
