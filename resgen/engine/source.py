"""Where a model's weights come from: a Hugging Face folder, a GGUF file, a loaded transformers
model, or a config dict with its tensors (random weights for benchmarks).

    src = open_source("path/to/folder" | "model.gguf" | hf_model | (config_dict, tensors))
    src.config            # the HF config dict
    src.tensor(name)      # a dense tensor by its Hugging Face name (float, CPU or GPU)
    src.qlinears          # FP4 checkpoint linears by module name (resgen.checkpoint), or None
    src.tokenizer()       # transformers tokenizer from the folder / GGUF (offline), or None

A folder goes through resgen.checkpoint.load_checkpoint (its safetensors reader, FP4 linears
and KV scales) when that module is present; without it, through transformers'
from_pretrained. A GGUF file is loaded by transformers + gguf and dequantized to FP32, as
resgen.quality.model loads SmolLM2. Everything runs offline (HF_HUB_OFFLINE=1).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

__all__ = ["ModelSource", "open_source"]


@dataclass
class ModelSource:
    """A model's config and tensors by Hugging Face name (see the module docstring)."""

    config: dict
    tensors: Mapping[str, torch.Tensor]
    name: str = "model"
    qlinears: Mapping[str, Any] | None = None
    kv_scales: dict[int, tuple[float, float]] = field(default_factory=dict)
    tokenizer_fn: Callable[[], Any] | None = None
    generation: dict = field(default_factory=dict)

    def has(self, name: str) -> bool:
        return name in self.tensors

    def tensor(self, name: str) -> torch.Tensor:
        """The dense tensor `name`; a KeyError naming the tensor and the model otherwise."""
        try:
            t = self.tensors[name]
        except KeyError:
            raise KeyError(f"{self.name}: tensor {name!r} is missing") from None
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{self.name}: {name!r} is not a tensor")
        if not t.is_floating_point():
            raise TypeError(f"{self.name}: {name!r} is {t.dtype}, expected a float tensor")
        return t

    def tokenizer(self) -> Any:
        return None if self.tokenizer_fn is None else self.tokenizer_fn()


def _offline() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _quiet_transformers() -> None:
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def _tokenizer_loader(folder: Path, gguf_file: str | None) -> Callable[[], Any]:
    def load() -> Any:
        _offline()
        _quiet_transformers()
        from transformers import AutoTokenizer

        kw = {"gguf_file": gguf_file} if gguf_file else {}
        try:
            return AutoTokenizer.from_pretrained(str(folder), **kw)
        except (OSError, ValueError):
            return None             # a weights-only folder: generate() then takes token ids
    return load


def _generation(folder: Path) -> dict:
    p = folder / "generation_config.json"
    if p.is_file():
        try:
            return json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{p}: not JSON: {e}") from None
    return {}


def from_hf_model(model: Any, tokenizer: Any = None, name: str | None = None) -> ModelSource:
    """A loaded transformers causal LM (its state dict is read, not copied)."""
    cfg = model.config.to_dict()
    sd = dict(model.state_dict())
    gen = {}
    gc = getattr(model, "generation_config", None)
    if gc is not None:
        gen = {k: v for k, v in gc.to_dict().items() if v is not None}
    tok_fn = (lambda: tokenizer) if tokenizer is not None else None
    return ModelSource(cfg, sd, name or str(cfg.get("_name_or_path") or cfg.get("model_type")),
                       tokenizer_fn=tok_fn, generation=gen)


def _from_gguf(path: Path) -> ModelSource:
    _offline()
    _quiet_transformers()
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                     dtype=torch.float32)
    except ImportError as e:
        raise ImportError(f"{path}: reading GGUF needs the gguf package (pip install gguf): "
                          f"{e}") from None
    src = from_hf_model(model, name=path.stem)
    src.tokenizer_fn = _tokenizer_loader(path.parent, path.name)
    return src


def _from_folder(folder: Path) -> ModelSource:
    cfg_path = folder / "config.json"
    try:
        cfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_path}: not JSON: {e}") from None
    try:
        from ..checkpoint import load_checkpoint     # helper ckpt's loader, when present
    except ImportError:
        load_checkpoint = None
    if load_checkpoint is not None:
        ck = load_checkpoint(folder)
        src = ModelSource(dict(ck.config), ck.tensors, folder.name,
                          qlinears=ck.linears if ck.quant is not None else None,
                          kv_scales=dict(getattr(ck, "kv_scales", {}) or {}))
    else:
        _offline()
        _quiet_transformers()
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype="auto")
        src = from_hf_model(model, name=folder.name)
        src.config = cfg
    src.tokenizer_fn = _tokenizer_loader(folder, None)
    src.generation = _generation(folder)
    return src


def open_source(model: Any, tokenizer: Any = None) -> ModelSource:
    """A ModelSource from a folder, a .gguf file (or a folder holding exactly one), a loaded
    transformers model, a (config dict, {name: tensor}) pair, or a ModelSource."""
    if isinstance(model, ModelSource):
        return model
    if isinstance(model, tuple) and len(model) == 2 and isinstance(model[0], Mapping):
        cfg, tensors = model
        return ModelSource(dict(cfg), tensors, str(cfg.get("_name_or_path") or
                                                   cfg.get("model_type") or "model"),
                           tokenizer_fn=(lambda: tokenizer) if tokenizer is not None else None)
    if hasattr(model, "state_dict") and hasattr(model, "config"):
        return from_hf_model(model, tokenizer)
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"cannot load a model from a {type(model).__name__}: give a folder, a "
                        ".gguf file or a transformers model")
    path = Path(model)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file or folder")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"{path}: a model file must be .gguf (or give the checkpoint "
                             "folder)")
        return _from_gguf(path)
    if (path / "config.json").is_file():
        return _from_folder(path)
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return _from_gguf(ggufs[0])
    if len(ggufs) > 1:
        raise ValueError(f"{path}: holds {len(ggufs)} .gguf files; name one")
    raise ValueError(f"{path}: no config.json (a Hugging Face checkpoint folder) and no .gguf "
                     "file")
