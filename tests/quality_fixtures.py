"""Tiny offline models for the quality study's tests: a random Llama with a word-level
tokenizer that adds BOS the way Llama's does (a TemplateProcessing post-processor "<s> $A"),
saved as a Hugging Face folder, and a text written from its vocabulary.

No offline model in this environment needs BOS (SmolLM2's tokenizer adds none), so the BOS
path is tested on this one: tokenizers builds the tokenizer, transformers saves it with the
model (tokenizer.json + config.json + model.safetensors), and resgen loads the folder like any
user's model.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

WORDS = [f"w{i}" for i in range(60)]
SPECIAL = ["<unk>", "<s>", "</s>"]


def make_tokenizer(add_bos: bool = True, add_bos_flag: bool | None = None):
    """A PreTrainedTokenizerFast over WORDS; add_bos: its post-processor prepends <s> (id 1).
    add_bos_flag: pass add_bos_token explicitly, as a tokenizer_config.json does (None: not
    given)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIAL + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    kw = {} if add_bos_flag is None else {"add_bos_token": add_bos_flag}
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", **kw)


def make_model_dir(folder: Path, *, add_bos: bool = True, bias: bool = False,
                   seed: int = 0) -> Path:
    """Save a tiny random Llama (2 layers, hidden 64) + the tokenizer under folder; bias: q/k/v
    biases (Qwen2-style). Returns folder."""
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=len(SPECIAL) + len(WORDS), hidden_size=64,
                                   intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=128, bos_token_id=1, eos_token_id=2,
                                   attention_bias=bias)
    model = transformers.LlamaForCausalLM(cfg).eval()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    make_tokenizer(add_bos).save_pretrained(folder)
    return folder


def write_text(path: Path, n_words: int = 3000, seed: int = 0) -> Path:
    """A text of n_words uniformly random words of WORDS (fixed seed; a random model learns
    nothing from structure, only the token count matters)."""
    rnd = random.Random(seed)
    words = [rnd.choice(WORDS) for _ in range(n_words)]
    path.write_text(" ".join(words) + "\n")
    return path
