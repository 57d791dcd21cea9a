"""resgen.hf on the H200: a transformers model's generate() on resgen's kernels (FP4Linear on
the dispatched linear kernels, the "resgen" attention on the paged NVFP4 cache with the append
and ResAttn kernels).

- teacher-forced through the ResgenCache, the kernels' logits equal the reference backend's
  (resgen.ops.cpu on the GPU: the exact reference of every op) within BF16 summation-order
  noise, prompts of different lengths (left padding) included;
- for the same ModelOpt-layout FP4 checkpoint, from_pretrained + generate gives the same
  greedy tokens as the engine (resgen.load, CUDA backend, CUDA graphs).

The model: Llama architecture with random weights at shapes the kernels serve (hidden 2048,
16 query / 4 KV heads of 128, MLP 4096, 2 layers), BF16; its lm_head scaled up so greedy
choices are not near-ties (random models have flat logits)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import resgen.hf as H  # noqa: E402
from logitcheck import assert_teacher_forced_agree  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _config():
    return transformers.LlamaConfig(vocab_size=1024, hidden_size=2048, intermediate_size=4096,
                                    num_hidden_layers=2, num_attention_heads=16,
                                    num_key_value_heads=4, head_dim=128,
                                    max_position_embeddings=1024, pad_token_id=0,
                                    tie_word_embeddings=False)


def _model(seed=0):
    torch.manual_seed(seed)
    m = transformers.LlamaForCausalLM(_config()).eval()
    with torch.no_grad():
        m.lm_head.weight.mul_(30.0)
    return m.to(device="cuda", dtype=torch.bfloat16)


def _batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 1024, (2, 12), generator=g)
    mask = torch.ones_like(ids)
    ids[1, :5], mask[1, :5] = 0, 0
    return ids.cuda(), mask.cuda()


@torch.no_grad()
def _teacher_forced(model, ids, mask, tokens):
    """Prefill + one decode call per given token [B, n] through a fresh ResgenCache; returns
    logits [B, n + 1, V] (the last position of each call)."""
    cache = H.new_cache()
    kw = H.cache_kwargs(cache, model)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    out = [model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True,
                 **kw).logits[:, -1]]
    for j in range(tokens.shape[1]):
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
        pos = pos[:, -1:] + 1
        out.append(model(input_ids=tokens[:, j:j + 1], attention_mask=mask, position_ids=pos,
                         use_cache=True, **kw).logits[:, -1])
    return torch.stack(out, 1).float()


def test_generate_on_the_kernels_matches_the_reference_backend():
    kern, ref = _model(), _model()
    H.quantize(kern, "nvfp4", "full", kv="nvfp4")                       # the kernels
    H.quantize(ref, "nvfp4", "full", kv="nvfp4", backend="reference")
    assert all(m.backend == "kernels" for m in H.quantized_layers(kern).values())
    ids, mask = _batch()
    out = kern.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    assert out.shape == (2, 20)
    toks = out[:, 12:19]
    a = _teacher_forced(kern, ids, mask, toks)
    b = _teacher_forced(ref, ids, mask, toks)
    assert not bool(a.isnan().any())
    rel = float((a - b).norm() / b.norm())
    assert rel < 2e-2, rel
    assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_same_greedy_tokens_as_the_engine_for_the_same_checkpoint(tmp_path):
    """A ModelOpt-layout NVFP4 checkpoint (resgen.checkpoint.save_checkpoint; q/k/v and
    gate/up share their weight tensor scales so the engine fuses them exactly; static input
    scales) served two ways: the engine and from_pretrained through ModelOptResgenQuantizer.
    Teacher-forced on HF's greedy tokens, the engine's logits are HF's: the prefill's to 2^-5
    of the largest logit (BF16 glue on both sides, fused vs separate projections), the decode
    steps' to 10 % (FP4 codes of the cache and the next activations flip under one-ulp
    differences: see tests/test_hf.py's CPU twin), and the greedy choices agree wherever HF's
    top-2 margin exceeds the step's difference."""
    pytest.importorskip("resgen.engine")
    import resgen
    from resgen.calibrate import prepare_weight
    from resgen.checkpoint import save_checkpoint

    m = _model(3).float().cpu()
    linears, tensors = {}, {}
    groups = {"self_attn": ("q_proj", "k_proj", "v_proj"), "mlp": ("gate_proj", "up_proj")}
    for name, t in m.state_dict().items():
        mod = name.rsplit(".", 1)[0]
        if name.endswith(".weight") and mod.split(".")[-1].endswith("_proj"):
            continue
        tensors[name] = t.to(torch.bfloat16)
    for i, layer in enumerate(m.model.layers):
        for part, projs in [("self_attn", groups["self_attn"] + ("o_proj",)),
                            ("mlp", groups["mlp"] + ("down_proj",))]:
            ws = {p: getattr(getattr(layer, part), p).weight.detach().clone() for p in projs}
            shared = max(float(ws[p].abs().max()) for p in groups[part])
            for p in groups[part]:
                ws[p][0, 0] = shared            # one amax -> one weight_scale_2 per group
            for p, w in ws.items():
                linears[f"model.layers.{i}.{part}.{p}"] = prepare_weight(
                    w, "nvfp4", input_scale=torch.tensor(3.0 / 2688))
    save_checkpoint(tmp_path / "ck", config=m.config.to_dict(), linears=linears,
                    tensors=tensors)
    prompts = [[5, 17, 33, 9, 64, 42, 7, 300, 11], [7, 99, 3, 501]]
    llm = resgen.load(tmp_path / "ck", compensation="full", kv="nvfp4")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ck",
                                                           dtype=torch.bfloat16).cuda()
    assert all(q.backend == "kernels" for q in H.quantized_layers(hf).values())
    n = max(map(len, prompts))
    ids = torch.tensor([[0] * (n - len(p)) + p for p in prompts], device="cuda")
    mask = torch.tensor([[0] * (n - len(p)) + [1] * len(p) for p in prompts], device="cuda")
    out = hf.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                      pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    got = [row[n:].tolist() for row in out.sequences]
    hf_logits = torch.stack(out.logits, 1).float().cpu()                  # [B, 8, V]
    eng_logits = llm.forced_decode([p + g for p, g in zip(prompts, got)],
                                   [len(p) for p in prompts], reduce="logits")
    for r in range(len(prompts)):
        assert_teacher_forced_agree(hf_logits[r], eng_logits[r], got[r], 2.0 ** -5, 0.10, r)
