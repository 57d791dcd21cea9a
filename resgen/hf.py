"""transformers integration: a Hugging Face causal LM on resgen's kernels.

    import resgen.hf
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).cuda()
    resgen.hf.quantize(model, fmt="nvfp4", compensation="full", kv="nvfp4")
    out = model.generate(ids, max_new_tokens=32)      # FP4 linears + ResAttn on NVFP4 KV
    model.save_pretrained(out_dir)                    # FP4 buffers + quantization_config
    again = AutoModelForCausalLM.from_pretrained(out_dir, device_map="cuda")   # resgen modules

What `quantize` does, in place:
- every nn.Linear except `modules_to_not_convert` (default the lm_head) becomes a
  resgen.ops.nn.FP4Linear (codes / scales / global scales as buffers, forward through the
  torch.ops.resgen.linear custom op). A K-Ext ratio or a static NVFP4 activation scale needs
  calibration tokens (`calib`); a layer the kernels cannot serve is an error naming it (or,
  with skip_unsupported=True, stays in its original precision and is listed in the config);
- kv="nvfp4": the model's attention implementation becomes "resgen" (registered with
  transformers' AttentionInterface and AttentionMaskInterface) and generate() gets a
  ResgenCache (a transformers Cache subclass) holding every layer's K/V in resgen's paged
  NVFP4 cache. Prefill attends exactly (SDPA over the prompt's own K/V, plus the cache's
  dequantized prefix when one exists), then appends the valid (unpadded) tokens to the pages
  through torch.ops.resgen.kv_append; each decode step appends its token and runs
  torch.ops.resgen.decode_attention (ResAttn, or plain NVFP4-KV with kv_compensation=False)
  over the pages. Left-padded batches are supported: only the tokens the attention mask keeps
  are stored, so each sequence's pages hold exactly its own tokens. Beam search, cache
  cropping (assisted decoding) and torch.compile of the HF model are not supported with
  this cache (use resgen.ops' custom ops directly for compiled decode steps);
- model.config.quantization_config becomes a ResgenConfig (quant_method "resgen"), so
  save_pretrained writes a checkpoint that from_pretrained reloads through ResgenHfQuantizer
  (registered with transformers' register_quantizer / register_quantization_config, the way
  its own quantizers are): the FP4 modules are built on the meta device before the weights
  load, the tensors keep their stored dtypes, and the ops are built after loading.

ModelOpt exports (quant_method "modelopt", NVFP4 / MXFP4) load the same way once resgen.hf is
imported (ModelOptResgenQuantizer, registered only when the installed transformers has no
"modelopt" quantizer of its own): the stored tensors fill FP4Linear buffers of the same names;
they are served with full residue compensation and the NVFP4 KV cache (the config's
compensation / kv fields; a ModelOpt export does not carry them).

backend="reference" runs resgen.ops.cpu's exact reference operators instead of the kernels
(CPU, or any device): the CPU tests run SmolLM2 that way.

Tested with transformers 5.24 (CPU, this repository's CI) and written against 5.17's cache
and attention interfaces (the GPU machine): `cache` / `past_key_values` keyword names are both
handled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import torch

from . import formats
from .ops import custom
from .ops.nn import FP4Linear

__all__ = ["quantize", "ResgenCache", "ResgenConfig", "ResgenHfQuantizer", "new_cache",
           "cache_kwargs",
           "resgen_attention", "ATTN_IMPLEMENTATION", "kernel_support", "quantized_layers",
           "ModelOptConfig", "ModelOptResgenQuantizer", "load_backend"]

ATTN_IMPLEMENTATION = "resgen"
PAGE_SIZE = 32


# ----------------------------------------------------------------------------- linears


def kernel_support(fmt: str, compensation: str, n: int, k: int, static_scale: bool,
                   arch: str | None = None) -> str | None:
    """None if a linear kernel family serves (fmt, compensation, N, K) on arch (default:
    resgen.settings'), else why not (every family's reason)."""
    from .settings import settings

    arch = arch or settings().arch
    from .search.family import families_for
    from .search.variant import LinearProblem

    try:
        p = LinearProblem(fmt, compensation, 1, n, k, fmt == "mxfp4" or static_scale)
    except ValueError as e:
        return str(e)
    reasons = []
    for fam in families_for("linear", arch):
        try:
            d = fam.default(p, arch)
            why = fam.why_invalid(d, p, arch)
        except (ValueError, TypeError) as e:
            why = str(e)
        if why is None:
            return None
        reasons.append(f"{fam.NAME}: {why}")
    return "; ".join(reasons) or f"no linear kernel family for {arch}"


def _excluded(name: str, patterns: Iterable[str]) -> bool:
    return any(name == p or name.endswith("." + p) or name.startswith(p + ".")
               for p in patterns)


def _linears(model: torch.nn.Module, exclude: Iterable[str]) -> dict[str, torch.nn.Linear]:
    return {n: m for n, m in model.named_modules()
            if type(m) is torch.nn.Linear and not _excluded(n, exclude)}


@torch.no_grad()
def _calibrate(model, names: dict[str, torch.nn.Linear], calib: torch.Tensor, batch: int):
    """Per linear: (ChannelStats of its inputs, amax) over the calibration tokens."""
    from .calibrate import ChannelStats

    stats = {n: [ChannelStats(m.in_features), 0.0] for n, m in names.items()}
    hooks = []
    for n, m in names.items():
        def hook(_m, args, _n=n):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).float()
            stats[_n][0].update(x)
            stats[_n][1] = max(stats[_n][1], float(x.abs().max()))
        hooks.append(m.register_forward_pre_hook(hook))
    dev = next(model.parameters()).device
    try:
        for i in range(0, calib.shape[0], batch):
            model(input_ids=calib[i: i + batch].to(dev), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return stats


def _set_module(model: torch.nn.Module, name: str, new: torch.nn.Module) -> None:
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, new)


def quantized_layers(model: torch.nn.Module) -> dict[str, FP4Linear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, FP4Linear)}


def quantize(model: torch.nn.Module, fmt: str = "nvfp4", compensation: str | float = "full",
             kv: str | None = "nvfp4", *, backend: str = "kernels",
             calib: torch.Tensor | None = None, input_scale: str = "auto",
             modules_to_not_convert: Iterable[str] = ("lm_head",),
             skip_unsupported: bool = False, kv_compensation: bool = True, pv: str = "f16",
             calib_batch: int = 4, arch: str | None = None,
             attention_kwargs: dict | None = None, append_kwargs: dict | None = None,
             **linear_kwargs: Any) -> torch.nn.Module:
    """Quantize a transformers causal LM in place for resgen (see the module docstring).

    fmt: "nvfp4" | "mxfp4"; compensation: "none" | "full" | a K-Ext ratio (0.125 ... 1.0) |
    "w4a16" (BF16 activations, on the kernels or the reference); kv: "nvfp4" (resgen's paged
    cache and ResAttn) or None (the model's own attention and cache); calib: int64 [S, T]
    calibration token ids (needed for a K-Ext ratio and for static NVFP4 activation scales);
    input_scale: "static" (the calibration amax / 2688, as ModelOpt's input_scale), "dynamic"
    (per call), or "auto" (static when calib is given and fmt is NVFP4). linear_kwargs go to
    resgen.ops.Linear, attention_kwargs to resgen.ops.DecodeAttention and append_kwargs to
    KVAppend (the CPU tests stand the kernels' simulations in there). Returns the model.
    """
    formats.block_size(fmt)
    comp = compensation if compensation in ("none", "full", "w4a16") else \
        str(float(compensation))
    ratio = None if comp in ("none", "full", "w4a16") else float(comp)
    if input_scale not in ("auto", "static", "dynamic"):
        raise ValueError(f"input_scale must be auto, static or dynamic, got {input_scale!r}")
    static = (input_scale == "static" or (input_scale == "auto" and calib is not None)) \
        and fmt == "nvfp4" and comp != "w4a16"
    if (ratio is not None or static) and calib is None:
        raise ValueError("a K-Ext ratio and static activation scales need calibration tokens "
                         "(calib=int64 [S, T])")
    if kv not in (None, "nvfp4"):
        raise ValueError(f"kv must be 'nvfp4' or None, got {kv!r}")
    exclude = tuple(modules_to_not_convert)
    names = _linears(model, exclude)
    if not names:
        raise ValueError("no nn.Linear to quantize (all excluded, or already quantized)")
    skipped: dict[str, str] = {}
    for n, m in names.items():
        why = None
        if m.in_features % formats.block_size(fmt):
            why = f"K = {m.in_features} is not a multiple of the {fmt} block"
        elif ratio is not None and (m.in_features * ratio) % formats.block_size(fmt):
            why = f"K * {ratio} is not a multiple of the {fmt} block (K-Ext extension)"
        elif backend == "kernels":
            why = kernel_support(fmt, comp, m.out_features, m.in_features, static, arch)
        if why is not None:
            skipped[n] = why
    if skipped and not skip_unsupported:
        first = next(iter(skipped))
        raise ValueError(f"{len(skipped)} layer(s) cannot be served by resgen's {fmt} "
                         f"{comp} kernels, e.g. {first} "
                         f"[{names[first].out_features} x {names[first].in_features}]: "
                         f"{skipped[first]} (pass skip_unsupported=True to keep them in "
                         "their original precision)")
    todo = {n: m for n, m in names.items() if n not in skipped}
    stats = _calibrate(model, todo, calib, calib_batch) if calib is not None else {}
    layers: dict[str, dict] = {}
    for n, lin in todo.items():
        sel = None
        isc = None
        if ratio is not None:
            from .calibrate import select_channels

            sel = select_channels(stats[n][0].mean_abs(), ratio)
        if static:
            isc = formats.nvfp4_global_scale(torch.tensor(stats[n][1]))
        dev = lin.weight.device
        kw = dict(linear_kwargs)
        kw.setdefault("device", dev)
        mod = FP4Linear.from_linear(lin, fmt, comp, input_scale=isc, selection=sel,
                                    backend=backend, name=n, **kw)
        _set_module(model, n, mod)
        layers[n] = {"in_features": lin.in_features, "out_features": lin.out_features,
                     "bias": lin.bias is not None}
    cfg = ResgenConfig(fmt=fmt, compensation=comp, ratio=ratio, static_scale=static, kv=kv,
                       kv_compensation=kv_compensation, pv=pv, backend=backend,
                       load_backend="auto",
                       modules_to_not_convert=list(exclude) + sorted(skipped),
                       layers=sorted(layers), skipped=skipped)
    model.config.quantization_config = cfg
    model.is_quantized = True
    if kv == "nvfp4":
        _install_attention(model, cfg, attention_kwargs or {}, append_kwargs or {})
    return model


def load_backend(requested: str = "auto") -> str:
    """The backend a loaded checkpoint runs on: "auto" is the kernels with a CUDA GPU, the
    reference operators without one (a CPU has no resgen kernels)."""
    if requested != "auto":
        return requested
    return "kernels" if torch.cuda.is_available() else "reference"


def _with_backend(cfg, backend: str):
    import copy

    out = copy.copy(cfg)
    out.backend = backend
    return out


# ----------------------------------------------------------------------------- attention


@dataclass
class _AttnOps:
    """The shared attention ops of one model geometry and their handles."""

    attn: Any
    append: Any
    attn_handle: str
    append_handle: str
    q_heads: int
    kv_heads: int
    head_dim: int


def _geometry(config) -> tuple[int, int, int]:
    cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    hq = cfg.num_attention_heads
    hkv = getattr(cfg, "num_key_value_heads", None) or hq
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // hq
    return hq, hkv, d


def _make_attn_ops(config, cfg: "ResgenConfig", attention_kwargs: dict,
                   append_kwargs: dict) -> _AttnOps:
    from .ops.cpu import ReferenceAppend, ReferenceAttention

    hq, hkv, d = _geometry(config)
    if cfg.backend == "reference":
        attn: Any = ReferenceAttention(hq, hkv, d, PAGE_SIZE, compensation=cfg.kv_compensation,
                                       pv=cfg.pv)
        app: Any = ReferenceAppend(hkv, d, PAGE_SIZE)
    else:
        from .ops import DecodeAttention
        from .ops.kv_append import KVAppend

        attn = DecodeAttention(hq, hkv, d, PAGE_SIZE, compensation=cfg.kv_compensation,
                               pv=cfg.pv, **attention_kwargs)
        app = KVAppend(hkv, d, PAGE_SIZE, **append_kwargs)
    return _AttnOps(attn, app, custom.register(attn, "attention"),
                    custom.register(app, "kv_append"), hq, hkv, d)


def _register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN_IMPLEMENTATION, resgen_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)


def _capture_cache(module, args, kwargs):
    # the attention module's cache argument ("cache" from transformers 5.2x, before it
    # "past_key_values"); the attention function reads it from the module
    module._resgen_cache = kwargs.get("cache", kwargs.get("past_key_values"))


def _install_attention(model, cfg: "ResgenConfig", attention_kwargs: dict | None = None,
                       append_kwargs: dict | None = None,
                       kv_alphas: dict[int, tuple[float, float]] | None = None) -> None:
    """kv_alphas: layer -> (k, v) NVFP4 global scales of its pages (a ModelOpt checkpoint's
    k/v_scale / 6); layers without one use the cache's scales (default 1)."""
    _register_attention()
    ops = _make_attn_ops(model.config, cfg, attention_kwargs or {}, append_kwargs or {})
    model._resgen_attn_ops = ops                     # keeps the weakly registered ops alive
    n = 0
    for m in model.modules():
        if hasattr(m, "layer_idx") and hasattr(m, "o_proj") and not getattr(
                m, "_resgen_hooked", False):
            m._resgen_attn = ops
            if kv_alphas and m.layer_idx in kv_alphas:
                m._resgen_kv_alphas = kv_alphas[m.layer_idx]
            m.register_forward_pre_hook(_capture_cache, with_kwargs=True)
            m._resgen_hooked = True
            n += 1
    if n == 0:
        raise ValueError("kv='nvfp4': no attention module with a layer_idx and o_proj found "
                         "(a Llama-style decoder is needed)")
    if hasattr(model, "set_attn_implementation"):
        try:
            model.set_attn_implementation(ATTN_IMPLEMENTATION)
        except (ValueError, TypeError, AttributeError):
            model.config._attn_implementation = ATTN_IMPLEMENTATION
    else:
        model.config._attn_implementation = ATTN_IMPLEMENTATION
    _wrap_generate_cache(model)


def _wrap_generate_cache(model) -> None:
    """generate() without a user cache gets a ResgenCache instead of the default DynamicCache
    (written under whichever name the installed transformers uses)."""
    if getattr(model, "_resgen_generate_wrapped", False) or not hasattr(
            model, "_prepare_cache_for_generation"):
        return
    orig = model._prepare_cache_for_generation

    def prepare(generation_config, model_kwargs, *args, **kwargs):
        out = orig(generation_config, model_kwargs, *args, **kwargs)
        for key in ("cache", "past_key_values"):
            c = model_kwargs.get(key)
            if c is not None and type(c).__name__ == "DynamicCache" and c.get_seq_length() == 0:
                model_kwargs[key] = new_cache(model)
        return out

    model._prepare_cache_for_generation = prepare
    model._resgen_generate_wrapped = True


def _valid_new(attention_mask: torch.Tensor | None, b: int, s: int) -> torch.Tensor | None:
    """bool [s]: which of the s new tokens of row b the mask keeps (None: all)."""
    if attention_mask is None:
        return None
    row = attention_mask[b, 0, -1, -s:] if attention_mask.dim() == 4 else attention_mask[b, -s:]
    return row if row.dtype == torch.bool else row > torch.finfo(row.dtype).min / 2


def resgen_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None,
                     dropout: float = 0.0, **kwargs: Any):
    """transformers attention function "resgen". query: [B, Hq, S, D]; key, value: [B, Hkv,
    S_kv, D] (the new tokens when the cache is a ResgenCache) -> ([B, S, Hq, D], None).

    With a ResgenCache: prefill (S > 1) exact SDPA over the cache's dequantized prefix and
    the new tokens, then the new tokens appended; decode (S == 1) append + the decode
    attention op over the paged NVFP4 cache. With any other cache or none: SDPA over the
    given K/V (the model's own numerics)."""
    cache = getattr(module, "_resgen_cache", None)
    ops = getattr(module, "_resgen_attn", None)
    if not isinstance(cache, ResgenCache) or ops is None:
        return _sdpa(query, key, value, attention_mask, scaling)
    layer = cache.layer(module.layer_idx)
    bsz, hq, s, d = query.shape
    scale = scaling if scaling is not None else d ** -0.5
    layer.ensure(bsz, ops.kv_heads, d, query.device,
                 getattr(module, "_resgen_kv_alphas", None))
    if s == 1 and layer.lengths_host and max(layer.lengths_host) > 0:
        keep = [bool(_valid_new(attention_mask, b, 1)[0]) if attention_mask is not None
                else True for b in range(bsz)]
        rows = [b for b in range(bsz) if keep[b]]
        layer.append(ops, key[:, :, 0], value[:, :, 0], rows)
        cargs = custom.cache_args(layer.pages)
        o = torch.ops.resgen.decode_attention(
            query[:, :, 0].to(torch.bfloat16).contiguous(), *cargs, layer.block_tables,
            layer.lengths, max(layer.lengths_host), float(scale), ops.attn_handle)
        return o.to(query.dtype).unsqueeze(1), None
    out = torch.zeros(bsz, s, hq, d, dtype=query.dtype, device=query.device)
    group = hq // ops.kv_heads
    for b in range(bsz):
        valid = _valid_new(attention_mask, b, s)
        idx = (torch.arange(s, device=query.device) if valid is None
               else torch.nonzero(valid).reshape(-1))
        n_prev = layer.lengths_host[b]
        kb, vb = key[b][:, idx], value[b][:, idx]
        if n_prev:
            pk, pv = layer.pages.gather(layer.block_tables[b], n_prev)
            kb = torch.cat([pk.to(kb.dtype), kb], dim=1)
            vb = torch.cat([pv.to(vb.dtype), vb], dim=1)
        # query i sees the prefix and the kept new tokens at positions <= i
        pos_new = idx.reshape(1, -1)
        qpos = torch.arange(s, device=query.device).reshape(-1, 1)
        allow = torch.cat([torch.ones(s, n_prev, dtype=torch.bool, device=query.device),
                           pos_new <= qpos], dim=1)
        if allow.shape[1] == 0:
            continue
        ob = torch.nn.functional.scaled_dot_product_attention(
            query[b].unsqueeze(0), kb.repeat_interleave(group, 0).unsqueeze(0),
            vb.repeat_interleave(group, 0).unsqueeze(0), attn_mask=allow, scale=scale)[0]
        ob = torch.nan_to_num(ob)                # pad queries that see nothing
        out[b] = ob.transpose(0, 1)
        layer.append(ops, key[b][:, idx].transpose(0, 1), value[b][:, idx].transpose(0, 1),
                     [b] * int(idx.numel()), sequence_major=True)
    return out, None


def _sdpa(query, key, value, attention_mask, scaling):
    hq, hkv = query.shape[1], key.shape[1]
    if hq != hkv:
        key = key.repeat_interleave(hq // hkv, 1)
        value = value.repeat_interleave(hq // hkv, 1)
    causal = attention_mask is None and query.shape[2] > 1
    o = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, is_causal=causal, scale=scaling)
    return o.transpose(1, 2).contiguous(), None


# ----------------------------------------------------------------------------- cache


def _cache_base():
    from transformers.cache_utils import Cache, CacheLayerMixin

    return Cache, CacheLayerMixin


class _LayerState:
    """One layer's paged NVFP4 K/V: a page pool (resgen.kvcache.PagedKVCache), block tables
    int32 [B, pages per row], the stored tokens per row (device int32 [B] and host list), and
    how many tokens transformers has seen (padding included)."""

    def __init__(self, page_size: int = PAGE_SIZE, k_scale: float | None = None,
                 v_scale: float | None = None):
        # None: the layer's checkpoint scales when the model has them (ensure), else 1
        self.page_size, self.k_scale, self.v_scale = page_size, k_scale, v_scale
        self.pages = None
        self.block_tables: torch.Tensor | None = None
        self.lengths: torch.Tensor | None = None
        self.lengths_host: list[int] = []
        self.rows_pages: list[list[int]] = []
        self.next_page = 0
        self.seen = 0

    def ensure(self, batch: int, kv_heads: int, head_dim: int, device,
               alphas: tuple[float, float] | None = None) -> None:
        """Allocates the pool on first use; alphas: the layer's (k, v) NVFP4 global scales
        from the checkpoint, used where the cache was not given explicit ones."""
        from .kvcache import PagedKVCache

        if self.pages is None:
            ka, va = alphas if alphas is not None else (1.0, 1.0)
            self.k_scale = ka if self.k_scale is None else self.k_scale
            self.v_scale = va if self.v_scale is None else self.v_scale
            self.pages = PagedKVCache.empty(max(batch, 1) * 4, kv_heads, head_dim,
                                            self.page_size, self.k_scale, self.v_scale,
                                            device=device)
            self.block_tables = torch.zeros(batch, 1, dtype=torch.int32, device=device)
            self.lengths = torch.zeros(batch, dtype=torch.int32, device=device)
            self.lengths_host = [0] * batch
            self.rows_pages = [[] for _ in range(batch)]
        elif len(self.lengths_host) != batch:
            raise ValueError(f"the ResgenCache holds {len(self.lengths_host)} sequences; this "
                             f"call has {batch} (use a new cache per batch)")

    def _grow_pool(self, need: int) -> None:
        from .kvcache import PagedKVCache

        old = self.pages
        n = max(need, 2 * old.num_pages)
        new = PagedKVCache.empty(n, old.num_kv_heads, old.head_dim, old.page_size,
                                 self.k_scale, self.v_scale, device=old.k_codes.device)
        for name in ("k_codes", "k_sf", "v_codes", "v_sf"):
            getattr(new, name)[: old.num_pages].copy_(getattr(old, name))
        self.pages = new

    def _reserve(self, b: int, upto: int) -> bool:
        """Pages for row b's tokens 0 .. upto - 1; True if a page was added."""
        want = -(-upto // self.page_size)
        added = False
        while len(self.rows_pages[b]) < want:
            if self.next_page >= self.pages.num_pages:
                self._grow_pool(self.next_page + 1)
            self.rows_pages[b].append(self.next_page)
            self.next_page += 1
            added = True
        return added

    def _tables(self, device) -> None:
        """block_tables int32 [B, max pages of a row] from the host page lists (unused entries
        0, a valid page: the kernels read a row's table only up to its length)."""
        width = max(1, max(len(p) for p in self.rows_pages))
        bt = torch.zeros(len(self.rows_pages), width, dtype=torch.int32)
        for i, ps in enumerate(self.rows_pages):
            if ps:
                bt[i, :len(ps)] = torch.tensor(ps, dtype=torch.int32)
        self.block_tables = bt.to(device)

    def append(self, ops: _AttnOps, k: torch.Tensor, v: torch.Tensor, rows: list[int],
               sequence_major: bool = False) -> None:
        """k, v: [T, Hkv, D] (sequence_major: T tokens of the rows listed, in order) or the
        decode form [B, Hkv, D] with rows the batch rows kept. Appends at each row's end."""
        if not rows:
            return
        if not sequence_major:
            sel = torch.tensor(rows, device=k.device)
            k, v = k.index_select(0, sel), v.index_select(0, sel)
        pos = []
        added = False
        for b in rows:
            n = self.lengths_host[b]
            pos.append((b, n))
            self.lengths_host[b] = n + 1
            added |= self._reserve(b, n + 1)
        if added:
            self._tables(k.device)
        positions = torch.tensor(pos, dtype=torch.int32, device=k.device)
        torch.ops.resgen.kv_append(k.to(torch.bfloat16).contiguous(),
                                   v.to(torch.bfloat16).contiguous(),
                                   *custom.cache_args(self.pages), self.block_tables, positions,
                                   ops.append_handle)
        self.lengths = torch.tensor(self.lengths_host, dtype=torch.int32, device=k.device)


def cache_kwargs(cache, model=None) -> dict:
    """{name: cache} for generate() / forward(): "cache" where the installed transformers's
    model forward names it so (5.2x), else "past_key_values" (5.17 and before)."""
    import inspect

    if model is None:
        from transformers import LlamaForCausalLM as model
    params = inspect.signature(type(model).forward if not isinstance(model, type)
                               else model.forward).parameters
    return {"cache" if "cache" in params else "past_key_values": cache}


def new_cache(model=None, *, page_size: int = PAGE_SIZE, k_scale: float | None = None,
              v_scale: float | None = None) -> "ResgenCache":
    """A fresh ResgenCache for one generate() call (one batch). k_scale / v_scale: the
    NVFP4 global scales of every layer's K / V pages; None: each layer's scales from the
    ModelOpt checkpoint it was loaded from (k_scale / 6, as resgen.load), else 1."""
    return ResgenCache(page_size=page_size, k_scale=k_scale, v_scale=v_scale)


def _define_cache_classes():
    Cache, CacheLayerMixin = _cache_base()

    class ResgenCacheLayer(CacheLayerMixin):
        """One decoder layer of a ResgenCache (see _LayerState); update() only counts the
        tokens: the "resgen" attention function stores them, since it knows the mask."""

        is_compileable = False
        is_croppable = False
        is_sliding = False

        def __init__(self, page_size: int = PAGE_SIZE, k_scale: float | None = None,
                     v_scale: float | None = None):
            super().__init__()
            self.state = _LayerState(page_size, k_scale, v_scale)

        def lazy_initialization(self, key_states, value_states) -> None:
            self.device = key_states.device
            self.is_initialized = True

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            self.state.seen += key_states.shape[-2]
            return key_states, value_states

        def get_mask_sizes(self, query_length: int, *args) -> tuple[int, int]:
            return self.state.seen + query_length, 0

        def get_seq_length(self) -> int:
            return self.state.seen

        def get_max_length(self) -> int:
            return -1

        def reset(self) -> None:
            st = self.state
            self.state = _LayerState(st.page_size, st.k_scale, st.v_scale)

        def reorder_cache(self, beam_idx) -> None:
            raise NotImplementedError("resgen's paged NVFP4 cache does not support beam search")

        def crop(self, max_length: int) -> None:
            raise NotImplementedError("resgen's paged NVFP4 cache cannot be cropped (assisted "
                                      "decoding)")

        def batch_repeat_interleave(self, repeats: int) -> None:
            raise NotImplementedError("resgen's paged NVFP4 cache cannot repeat its batch")

        def batch_select_indices(self, indices) -> None:
            raise NotImplementedError("resgen's paged NVFP4 cache cannot select batch rows")

        def offload(self):
            return None

        def prefetch(self):
            return None

    class ResgenCache(Cache):
        """A transformers Cache over resgen's paged NVFP4 KV cache, one ResgenCacheLayer per
        decoder layer (created as layers first call it)."""

        def __init__(self, page_size: int = PAGE_SIZE, k_scale: float | None = None,
                     v_scale: float | None = None, **kwargs):
            self._layer_kw = dict(page_size=page_size, k_scale=k_scale, v_scale=v_scale)
            super().__init__(layer_class_to_replicate=lambda: ResgenCacheLayer(
                **self._layer_kw))

        def layer(self, idx: int) -> _LayerState:
            while len(self.layers) <= idx:
                self.layers.append(ResgenCacheLayer(**self._layer_kw))
            return self.layers[idx].state

        def kv_bytes(self) -> int:
            """Bytes of the page pools (all layers)."""
            total = 0
            for lay in self.layers:
                p = lay.state.pages
                if p is not None:
                    total += sum(t.numel() * t.element_size()
                                 for t in (p.k_codes, p.k_sf, p.v_codes, p.v_sf))
            return total

    return ResgenCacheLayer, ResgenCache


try:
    ResgenCacheLayer, ResgenCache = _define_cache_classes()
except ImportError:          # transformers missing: the rest of resgen works without it
    ResgenCacheLayer = ResgenCache = None


# ----------------------------------------------------------------------------- HfQuantizer


def _define_quantizer():
    from transformers.quantizers import HfQuantizer, register_quantization_config, \
        register_quantizer
    from transformers.utils.quantization_config import QuantizationConfigMixin

    @register_quantization_config("resgen")
    class ResgenConfig(QuantizationConfigMixin):
        """quant_method "resgen": how resgen.hf.quantize converted the model (saved in
        config.json by save_pretrained; read back by ResgenHfQuantizer)."""

        def __init__(self, fmt: str = "nvfp4", compensation: str = "full",
                     ratio: float | None = None, static_scale: bool = False,
                     kv: str | None = "nvfp4", kv_compensation: bool = True, pv: str = "f16",
                     backend: str = "kernels", modules_to_not_convert: list | None = None,
                     layers: list | None = None, skipped: dict | None = None,
                     load_backend: str = "auto", **kwargs):
            self.quant_method = "resgen"
            self.fmt, self.compensation, self.ratio = fmt, compensation, ratio
            self.static_scale, self.kv, self.kv_compensation, self.pv = \
                static_scale, kv, kv_compensation, pv
            # backend: what quantize() ran; load_backend: what from_pretrained builds ("auto":
            # the kernels with a GPU, else the reference operators)
            self.backend, self.load_backend = backend, load_backend
            self.modules_to_not_convert = list(modules_to_not_convert or ["lm_head"])
            self.layers = list(layers or [])
            self.skipped = dict(skipped or {})
            formats.block_size(fmt)

        def to_dict(self) -> dict:
            return {"quant_method": "resgen", "fmt": self.fmt,
                    "compensation": self.compensation, "ratio": self.ratio,
                    "static_scale": self.static_scale, "kv": self.kv,
                    "kv_compensation": self.kv_compensation, "pv": self.pv,
                    "backend": self.backend, "load_backend": self.load_backend,
                    "modules_to_not_convert": self.modules_to_not_convert,
                    "layers": self.layers, "skipped": self.skipped}

    @register_quantizer("resgen")
    class ResgenHfQuantizer(HfQuantizer):
        """Loads a checkpoint that resgen.hf.quantize + save_pretrained wrote: FP4Linear
        modules (empty, on the meta device) replace the listed nn.Linear layers before the
        weights load; the ops are built after."""

        requires_calibration = True          # resgen checkpoints are pre-quantized

        def validate_environment(self, *args, **kwargs):
            if not self.pre_quantized:
                raise ValueError("quant_method 'resgen' loads resgen checkpoints; to quantize a "
                                 "model, load it unquantized and call resgen.hf.quantize")

        def _process_model_before_weight_loading(self, model, **kwargs):
            cfg = self.quantization_config
            backend = load_backend(cfg.load_backend)
            mods = dict(model.named_modules())
            for name in cfg.layers:
                lin = mods.get(name)
                if not isinstance(lin, torch.nn.Linear):
                    raise ValueError(f"resgen checkpoint: layer {name} is not an nn.Linear of "
                                     f"this {type(model).__name__}")
                new = FP4Linear.empty(lin.in_features, lin.out_features, cfg.fmt,
                                      cfg.compensation, ratio=cfg.ratio,
                                      static_scale=cfg.static_scale,
                                      bias=lin.bias is not None, backend=backend,
                                      name=name, device="meta")
                _set_module(model, name, new)
            return model

        def _process_model_after_weight_loading(self, model, **kwargs):
            for m in quantized_layers(model).values():
                m._rebuild()
            cfg = self.quantization_config
            if cfg.kv == "nvfp4":
                _install_attention(model, _with_backend(cfg, load_backend(cfg.load_backend)))
            return model

        def get_new_dtype(self, converter, param, dtype):
            return dtype          # the empty module's dtype: FP4Linear buffers keep theirs

        @property
        def is_serializable(self) -> bool:
            return True

        @property
        def is_trainable(self) -> bool:
            return False

    return ResgenConfig, ResgenHfQuantizer


try:
    ResgenConfig, ResgenHfQuantizer = _define_quantizer()
except ImportError:
    ResgenConfig = ResgenHfQuantizer = None


_MODELOPT_ALGOS = {"NVFP4": "nvfp4", "MXFP4": "mxfp4"}


def _wildcard(pattern: str, name: str) -> bool:
    """ModelOpt's exclude pattern: '*' is the only special character, matched against the
    whole module name (vLLM's re.fullmatch(re.escape(p).replace('\\*', '.*')))."""
    import re

    return re.fullmatch(re.escape(pattern).replace("\\*", ".*"), name) is not None


def _checkpoint_kv_alphas(model) -> dict[int, tuple[float, float]]:
    """layer -> (k, v) NVFP4 page scales from the ModelOpt checkpoint folder the model was
    loaded from (resgen.checkpoint: the same parse and checks as resgen.load); {} when the
    model's name_or_path is not a local folder or the checkpoint stores no KV scales."""
    from pathlib import Path

    from .checkpoint import load_checkpoint

    where = getattr(getattr(model, "config", None), "_name_or_path", None)
    if not where or not Path(where).is_dir():
        return {}
    return load_checkpoint(where, serve_check=False).kv_cache_alphas()


def _define_modelopt_quantizer():
    from transformers.quantizers import HfQuantizer, register_quantization_config, \
        register_quantizer
    from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING
    from transformers.utils.quantization_config import QuantizationConfigMixin

    if "modelopt" in AUTO_QUANTIZER_MAPPING:      # transformers reads ModelOpt itself
        return None, None

    @register_quantization_config("modelopt")
    class ModelOptConfig(QuantizationConfigMixin):
        """A ModelOpt NVFP4 / MXFP4 export's quantization_config (quant_method "modelopt",
        quant_algo, ignore), served by resgen: compensation (default "full") and kv are
        resgen's choices, not the checkpoint's."""

        def __init__(self, quant_algo: str = "NVFP4", ignore: list | None = None,
                     compensation: str = "full", kv: str | None = "nvfp4",
                     load_backend: str = "auto", **kwargs):
            self.quant_method = "modelopt"
            algo = str(quant_algo).upper()
            if algo not in _MODELOPT_ALGOS:
                raise ValueError(f"ModelOpt quant_algo {quant_algo!r}: resgen serves NVFP4 and "
                                 "MXFP4 (W4A4) only")
            self.quant_algo, self.fmt = algo, _MODELOPT_ALGOS[algo]
            # ModelOpt never quantizes the lm_head; an export may leave it off the list
            self.ignore = list(dict.fromkeys(list(ignore or kwargs.get("exclude_modules")
                                                  or []) + ["lm_head"]))
            self.compensation, self.kv, self.load_backend = compensation, kv, load_backend
            self.kv_compensation, self.pv, self.ratio = True, "f16", None
            self.extra = {k: v for k, v in kwargs.items() if k != "exclude_modules"}

        def to_dict(self) -> dict:
            return {"quant_method": "modelopt", "quant_algo": self.quant_algo,
                    "ignore": self.ignore, **self.extra}

    @register_quantizer("modelopt")
    class ModelOptResgenQuantizer(HfQuantizer):
        """from_pretrained of a ModelOpt HF export: every nn.Linear outside `ignore` becomes
        an empty FP4Linear (on the meta device) whose buffers are ModelOpt's tensor names
        (weight, weight_scale, weight_scale_2, input_scale), so the checkpoint loads into
        them as stored; q/k/v and gate/up stay separate modules (each with its own global
        scale, served unfused); the KV cache scales ModelOpt writes (k/v_scale, amax / 448)
        become each layer's NVFP4 page scales (k_scale / 6, as resgen.load), read from the
        checkpoint folder; a model loaded from elsewhere runs its pages at global scale 1."""

        requires_calibration = True

        def validate_environment(self, *args, **kwargs):
            if not self.pre_quantized:
                raise ValueError("quant_method 'modelopt' loads ModelOpt checkpoints")

        def _process_model_before_weight_loading(self, model, **kwargs):
            cfg = self.quantization_config
            backend = load_backend(cfg.load_backend)
            for name, lin in list(model.named_modules()):
                if type(lin) is not torch.nn.Linear or any(_wildcard(p, name)
                                                           for p in cfg.ignore):
                    continue
                new = FP4Linear.empty(lin.in_features, lin.out_features, cfg.fmt,
                                      cfg.compensation, static_scale=cfg.fmt == "nvfp4",
                                      bias=lin.bias is not None, backend=backend, name=name,
                                      device="meta")
                _set_module(model, name, new)
            return model

        def _process_model_after_weight_loading(self, model, **kwargs):
            for m in quantized_layers(model).values():
                m._rebuild()
            cfg = self.quantization_config
            if cfg.kv == "nvfp4":
                cfg.backend = load_backend(cfg.load_backend)
                _install_attention(model, cfg, kv_alphas=_checkpoint_kv_alphas(model))
            return model

        def get_new_dtype(self, converter, param, dtype):
            return dtype

        @property
        def is_serializable(self) -> bool:
            return True

        @property
        def is_trainable(self) -> bool:
            return False

    return ModelOptConfig, ModelOptResgenQuantizer


try:
    ModelOptConfig, ModelOptResgenQuantizer = _define_modelopt_quantizer()
except ImportError:
    ModelOptConfig = ModelOptResgenQuantizer = None

