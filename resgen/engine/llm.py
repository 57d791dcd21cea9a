"""resgen.load(...) -> LLM, and LLM.generate: checkpoints in, tokens out.

    import resgen
    llm = resgen.load("path/to/model", compensation="full", kv="nvfp4", fmt="nvfp4",
                      calib="some calibration text")
    outs = llm.generate(["Hello", "Tell me about FP4"], max_new_tokens=64, temperature=0.7,
                        top_p=0.9, seed=0)
    outs[0].text, outs[0].token_ids, outs[0].finish_reason; llm.last_stats

Generation: prompts of different lengths form one batch (up to max_batch; more are run in
batches of max_batch); each is prefilled (one ragged prefill, exact attention on the prompt),
its first token sampled from the prefill's last logits, then all rows advance one token per
decode step (a CUDA-graph replay on the GPU, then sampling on the device). Stop tokens: the
model's EOS ids (config, generation_config, tokenizer) and `stop` (token ids and / or strings;
a string stop truncates the text before it). A finished row keeps its batch slot until the
batch ends (no continuous batching). The host reads each step's tokens one step later than it
issues the next one, so the GPU never waits for the host; a batch whose rows have all stopped
thus runs one extra step.

Numerics note: dynamic NVFP4 activation scales are per tensor, i.e. per batch, so a
sequence's numbers then depend on its batch mates; static scales (calib=) and MXFP4 make every
row's quantization independent of the others.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from .backend import BACKENDS, make_backend
from .build import (FORMATS, calibrate, check_kext_fold, checkpoint_model, dense_model,
                    quantized_model)
from .calib import Calibration
from .config import DecoderConfig
from .glue import COMPILE_MODES, make_glue
from .graphs import DecodeRunner
from .kv import DenseKV, PagedKV, budget_from_free, bytes_per_token
from .model import DenseDecodeAttention
from .sampling import SamplingParams, sample
from .source import ModelSource, open_source

__all__ = ["LLM", "Completion", "load", "KV_KINDS", "ATTN_MODES"]

log = logging.getLogger("resgen.engine")
KV_KINDS = ("nvfp4", "bf16", "fp32")
ATTN_MODES = ("resattn", "plain", "q16")


@dataclass
class Completion:
    """One prompt's result: generated text (None without a tokenizer), token ids (without the
    prompt), finish_reason "stop" | "length", and the prompt's token count."""

    text: str | None
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int


@dataclass
class EngineOptions:
    """What resgen.load was asked for (kept on the LLM, reported by the CLI)."""

    fmt: str = "nvfp4"
    compensation: Any = "full"
    kext_fold: str = "exact"
    kv: str = "nvfp4"
    attn: str = "resattn"
    backend: str = "cuda"
    glue: str = "bf16"
    max_batch: int = 8
    max_seq_len: int | None = None
    kv_budget: int | None = None
    kv_fraction: float = 0.6
    page_size: int = 32
    graphs: bool = True
    prefill_tokens: int = 8192
    io: str = "bf16"
    compile: str = "none"
    extra: dict = field(default_factory=dict)


def _positive(name: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name} must be a positive integer, got {v!r}")
    return v


def resolve_compile(compile: str | None, backend: str) -> str:
    """resgen.load's compile mode: the one given, else "glue" on the CUDA backend and "none"
    on the CPU backends (see load's docstring)."""
    if compile is None:
        return "glue" if backend == "cuda" else "none"
    return compile


def load(model: Any, *, compensation: Any = "full", kext_fold: str = "exact",
         kv: str = "nvfp4", fmt: str = "nvfp4",
         attn: str | None = None, calib: Any = None, backend: str | None = None,
         glue: str | None = None, max_batch: int = 8, max_seq_len: int | None = None,
         kv_budget: int | None = None, kv_fraction: float = 0.6, page_size: int = 32,
         graphs: bool = True, tokenizer: Any = None, io: str = "bf16",
         device: Any = None, fallback_bf16: bool = False, compile: str | None = None) -> "LLM":
    """Load a model for generation on resgen's kernels.

    model:        a Hugging Face folder (BF16 / FP32 safetensors, or an FP4 checkpoint read
                  by resgen.checkpoint), a .gguf file, a loaded transformers model, or a
                  (config dict, {name: tensor}) pair.
    fmt:          "nvfp4" | "mxfp4" (quantize BF16 / FP32 weights at load) or "bf16" (no
                  quantization: the BF16 engine, cuBLAS).
    compensation: "none" (plain W4A4) | "full" (M-Ext) | "w4a16" (FP4 weights, BF16
                  activations never quantized: the mode docs/hopper_native.md recommends on
                  Hopper) | a K-Ext ratio | a per-layer plan
                  (resgen.plan.Plan or {layer: ratio}); see resgen.engine.build. For an FP4
                  checkpoint also "checkpoint": what resgen recorded in it.
    kext_fold:    how K-Ext layers meet their selected residues: "exact" (extension columns:
                  Blackwell's numerics) or "presum" (each residue added onto its base channel,
                  rounded once to FP16, one GEMM over K: K-Ext at plain cost on Hopper,
                  NVFP4 only; resgen.ops.Linear's fold).
    kv:           "nvfp4" (paged NVFP4 cache, append kernel, decode attention kernels) or
                  "bf16" (dense BF16 cache and SDPA: with fmt="bf16" the BF16 engine);
                  "fp32" for the reference backend.
    attn:         "resattn" (query residue compensated), "plain" (NVFP4-KV attention) or
                  "q16" (the FP16 query, never quantized, x NVFP4 K/V: more accurate than
                  ResAttn at plain cost); None: "q16" for compensation "w4a16" (nothing is
                  quantized but weights and the KV cache), else "resattn".
    calib:        calibration data: token ids (a list / tensor, or a list of such), text, a
                  Calibration or its file; gives static NVFP4 input scales and the K-Ext
                  channel selections. None: dynamic NVFP4 scales (K-Ext ratios then refused).
    backend:      "cuda" (default with a GPU), "sim" or "reference" (CPU; resgen.engine.backend).
    glue:         "bf16" (default on CUDA) or "fp32" (default on the CPU backends).
    max_batch, max_seq_len: decode batch rows and the longest prompt + new tokens.
    kv_budget:    KV cache bytes; None: kv_fraction of the GPU's free memory after the
                  weights (CUDA), or max_batch x max_seq_len tokens (CPU).
    graphs:       capture decode steps in CUDA graphs (CUDA only).
    io:           the reference backend's linear interface: "bf16" (as the kernels) or "fp32".
    fallback_bf16: an FP4 checkpoint's layers the kernels cannot serve run in BF16.
    compile:      "none" (the glue between the ops runs eagerly) or "glue" (each glue region
                  between the ops through torch.compile / TorchInductor, compiled on its first
                  call, before the step's CUDA-graph capture; a region that fails to compile
                  runs eagerly, noted in llm.glue_notes and last_stats; resgen.engine.glue).
                  None: "glue" on the CUDA backend (1.24x tokens/s at batch 1 on the H200,
                  docs/engine.md; its GPU tests passed), "none" on the CPU backends (whose
                  C++ inductor compiles are slow and which serve as references).
    """
    if backend is None:
        backend = "cuda" if torch.cuda.is_available() else "reference"
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if glue is None:
        glue = "bf16" if backend == "cuda" else "fp32"
    if glue not in ("bf16", "fp32"):
        raise ValueError(f"glue must be 'bf16' or 'fp32', got {glue!r}")
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
    if kv not in KV_KINDS:
        raise ValueError(f"kv must be one of {KV_KINDS}, got {kv!r}")
    check_kext_fold(kext_fold)
    if attn is None:
        attn = "q16" if compensation == "w4a16" else "resattn"
    if attn not in ATTN_MODES:
        raise ValueError(f"attn must be one of {ATTN_MODES}, got {attn!r}")
    if kv == "fp32" and backend != "reference":
        raise ValueError("kv='fp32' exists for the reference backend only")
    _positive("max_batch", max_batch)
    _positive("page_size", page_size)
    if not 0 < kv_fraction <= 1:
        raise ValueError(f"kv_fraction must lie in (0, 1], got {kv_fraction!r}")
    if kv_budget is not None:
        _positive("kv_budget", kv_budget)
    compile = resolve_compile(compile, backend)
    if compile not in COMPILE_MODES:
        raise ValueError(f"compile must be one of {COMPILE_MODES}, got {compile!r}")
    opts = EngineOptions(fmt=fmt, compensation=compensation, kext_fold=kext_fold, kv=kv,
                         attn=attn,
                         backend=backend, glue=glue, max_batch=max_batch,
                         max_seq_len=max_seq_len, kv_budget=kv_budget,
                         kv_fraction=kv_fraction, page_size=page_size, graphs=graphs, io=io,
                         compile=compile)
    return LLM(open_source(model, tokenizer, fallback_bf16), opts, calib, device)


class LLM:
    """A loaded model ready to generate (build it with resgen.load)."""

    def __init__(self, src: ModelSource, opts: EngineOptions, calib: Any = None,
                 device: Any = None) -> None:
        self.source, self.options = src, opts
        self.cfg = DecoderConfig.from_hf(src.config, name=src.name)
        self.backend = make_backend(opts.backend, device, opts.io)
        dev = self.backend.device
        self.device = dev
        self._tokenizer: Any = _UNSET
        self.last_stats: dict[str, Any] = {}
        t0 = time.perf_counter()
        self.calibration: Calibration | None = None
        if src.qlinears is not None:
            if opts.fmt == "bf16":
                raise ValueError(f"{src.name} is an FP4 checkpoint: fmt='bf16' cannot serve it")
            if calib is not None:
                log.warning("an FP4 checkpoint carries its own scales: calib is ignored")
            self.model = checkpoint_model(src, self.cfg, self.backend, opts.compensation, dev,
                                          opts.glue, opts.kext_fold)
        else:
            if opts.fmt == "bf16":      # the BF16 engine (FP32 with FP32 glue: the FP32 model)
                wdtype = torch.bfloat16 if opts.glue == "bf16" else torch.float32
            else:                       # quantization reads the checkpoint's own values
                wdtype = torch.bfloat16 if _all_bf16(src) else torch.float32
            dense = dense_model(src, self.cfg, dev, opts.glue, wdtype)
            if opts.fmt == "bf16":
                if calib is not None:
                    log.warning("fmt='bf16' quantizes nothing: calib is ignored")
                self.model = dense
            else:
                self.calibration = self._calibration(dense, calib)
                self.model = quantized_model(dense, self.backend, opts.fmt, opts.compensation,
                                             self.calibration, kext_fold=opts.kext_fold)
                del dense
        self.model.glue_fns = make_glue(opts.compile)
        self.load_s = time.perf_counter() - t0
        self._attach_kv()

    # ------------------------------------------------------------------ setup
    def _calibration(self, dense: Any, calib: Any) -> Calibration | None:
        if calib is None:
            return None
        if isinstance(calib, Calibration):
            return calib
        if isinstance(calib, (str, Path)) and Path(str(calib)).suffix == ".safetensors":
            return Calibration.load(calib)
        seqs = self._calib_tokens(calib)
        return calibrate(dense, seqs)

    def _calib_tokens(self, calib: Any) -> list[torch.Tensor]:
        if isinstance(calib, str):
            tok = self.tokenizer
            if tok is None:
                raise ValueError("calib is text but the model has no tokenizer: pass token ids")
            ids = tok(calib, return_tensors="pt").input_ids.reshape(-1)
            n = self.cfg.max_positions
            return [ids[i:i + min(n, 2048)] for i in range(0, ids.numel(), min(n, 2048))]
        if isinstance(calib, torch.Tensor):
            return [calib.reshape(-1)] if calib.dim() <= 1 else list(calib)
        if isinstance(calib, Sequence) and calib and all(isinstance(x, int) for x in calib):
            return [torch.tensor(calib, dtype=torch.int64)]
        if isinstance(calib, Sequence) and calib:
            return [torch.as_tensor(x, dtype=torch.int64).reshape(-1) for x in calib]
        raise TypeError("calib must be token ids, a list of token-id sequences, text, a "
                        "Calibration or a .safetensors calibration file")

    def _attach_kv(self) -> None:
        o, c, m = self.options, self.cfg, self.model
        max_len = o.max_seq_len or min(c.max_positions, 8192)
        max_len = min(_positive("max_seq_len", max_len), c.max_positions)
        self.max_seq_len = max_len
        kind = o.kv
        if o.kv_budget is not None:
            budget = o.kv_budget
        elif self.device.type == "cuda":
            budget = budget_from_free(o.kv_fraction, self.device)
        else:
            budget = bytes_per_token(c.layers, c.kv_heads, c.head_dim, kind) * \
                (o.max_batch * max_len + 2 * o.page_size)
        self.kv_budget = budget
        pages_per_seq = -(-max_len // o.page_size)
        if kind == "nvfp4":
            m.kv = PagedKV.create(c.layers, c.kv_heads, c.head_dim, budget, o.page_size,
                                  self.device, self.source.kv_scales)
            m.attn = self.backend.attention(c.heads, c.kv_heads, c.head_dim, o.page_size,
                                            o.attn == "resattn",
                                            query="q16" if o.attn == "q16" else "nvfp4")
            m.append = self.backend.append(c.head_dim, c.kv_heads, o.page_size)
            m.attn_io = self.backend.io_dtype
        else:
            dt = torch.bfloat16 if kind == "bf16" else torch.float32
            m.kv = DenseKV.create(c.layers, c.kv_heads, c.head_dim, budget, o.max_batch,
                                  max_len, dt, self.device)
            self.max_seq_len = m.kv.max_len
            m.attn = DenseDecodeAttention()
            m.attn.resolve(self.device, dt, c.kv_heads, c.group, c.head_dim)
        self.runner = DecodeRunner(m, o.max_batch, pages_per_seq, o.graphs)

    def resize_kv(self, max_batch: int | None = None, max_seq_len: int | None = None,
                  kv_budget: int | None = None) -> None:
        """Rebuild the KV cache and the decode runner (its CUDA graphs are dropped) for
        another batch size / sequence length / budget (None: keep; kv_budget 0: from the
        free memory again). The model is kept."""
        o = self.options
        if max_batch is not None:
            o.max_batch = _positive("max_batch", max_batch)
        if max_seq_len is not None:
            o.max_seq_len = _positive("max_seq_len", max_seq_len)
        if kv_budget is not None:
            o.kv_budget = kv_budget or None
        self.model.kv = self.model.attn = None
        self.model.attn_plans = {}
        self.runner = None
        if self.device.type == "cuda":
            import gc

            gc.collect()
            torch.cuda.empty_cache()
        self._attach_kv()

    # ------------------------------------------------------------------ info
    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is _UNSET:
            self._tokenizer = self.source.tokenizer()
        return self._tokenizer

    @property
    def glue_notes(self) -> list[str]:
        """Glue regions that failed to compile and run eagerly (compile="glue")."""
        return list(self.model.glue_fns.notes)

    def kv_info(self) -> dict[str, Any]:
        """The cache: kind, bytes per token over all layers (and BF16's, for comparison),
        capacity in tokens, budget in bytes."""
        c = self.cfg
        kind = self.model.kv.kind
        return {"kind": kind,
                "bytes_per_token": bytes_per_token(c.layers, c.kv_heads, c.head_dim, kind),
                "bf16_bytes_per_token": bytes_per_token(c.layers, c.kv_heads, c.head_dim,
                                                        "bf16"),
                "capacity_tokens": self.model.kv.capacity_tokens, "budget_bytes": self.kv_budget}

    def stop_ids(self) -> set[int]:
        """EOS ids of the config, the generation config and the tokenizer."""
        ids = set(self.cfg.eos_token_ids)
        e = self.source.generation.get("eos_token_id")
        if e is not None:
            ids.update(e if isinstance(e, (list, tuple)) else [e])
        tok = self.tokenizer
        if tok is not None and getattr(tok, "eos_token_id", None) is not None:
            ids.add(int(tok.eos_token_id))
        return {int(i) for i in ids}

    def encode(self, prompt: Any, chat: bool = False) -> list[int]:
        """A prompt (text, or token ids) -> token ids; chat=True applies the tokenizer's chat
        template to one user message (with the generation prompt)."""
        if isinstance(prompt, str):
            tok = self.tokenizer
            if tok is None:
                raise ValueError(f"{self.source.name} has no tokenizer: pass token ids")
            if chat:
                if not getattr(tok, "chat_template", None):
                    raise ValueError(f"{self.source.name}'s tokenizer has no chat template")
                ids = tok.apply_chat_template([{"role": "user", "content": prompt}],
                                              add_generation_prompt=True, tokenize=True)
                if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                    ids = ids["input_ids"]
                return [int(i) for i in ids]
            return [int(i) for i in tok(prompt).input_ids]
        if isinstance(prompt, torch.Tensor):
            prompt = prompt.reshape(-1).tolist()
        if isinstance(prompt, Sequence) and all(isinstance(i, int) and not isinstance(i, bool)
                                                for i in prompt):
            return list(prompt)
        raise TypeError("a prompt is a string or a sequence of token ids")

    # ------------------------------------------------------------------ generation
    def generate(self, prompts: Any, max_new_tokens: int = 64, temperature: float = 0.0,
                 top_p: float = 1.0, stop: Sequence[int | str] | None = None,
                 seed: int | None = None, chat: bool = False,
                 on_token: Callable[[int, int], None] | None = None) -> list[Completion]:
        """Generate for one prompt (str / token ids) or a list of them; see the module
        docstring. on_token(prompt index, token id) is called as tokens arrive (streaming).
        Returns one Completion per prompt, in order; llm.last_stats has the timings."""
        if isinstance(prompts, torch.Tensor):        # [T] one prompt, [B, T] a batch
            prompts = prompts.tolist() if prompts.dim() == 2 else prompts.reshape(-1).tolist()
        single = isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts and
                                               all(isinstance(i, int) for i in prompts))
        plist = [prompts] if single else list(prompts)
        if not plist:
            raise ValueError("no prompts")
        _positive("max_new_tokens", max_new_tokens)
        params = SamplingParams(temperature, top_p)
        stop_ids = self.stop_ids()
        stop_strs: list[str] = []
        for s in stop or []:
            if isinstance(s, str):
                if not s:
                    raise ValueError("an empty stop string")
                stop_strs.append(s)
            elif isinstance(s, int) and not isinstance(s, bool):
                stop_ids.add(s)
            else:
                raise TypeError(f"a stop is a token id or a string, got {s!r}")
        if stop_strs and self.tokenizer is None:
            raise ValueError("string stops need a tokenizer")
        seqs = [self.encode(p, chat) for p in plist]
        for i, s in enumerate(seqs):
            if not s:
                raise ValueError(f"prompt {i} has no tokens")
            if len(s) + max_new_tokens > self.max_seq_len:
                raise ValueError(f"prompt {i}: {len(s)} tokens + max_new_tokens "
                                 f"{max_new_tokens} exceed max_seq_len {self.max_seq_len}")
            bad = [t for t in s if not 0 <= t < self.cfg.vocab_size]
            if bad:
                raise ValueError(f"prompt {i}: token id {bad[0]} is outside the vocabulary "
                                 f"[0, {self.cfg.vocab_size})")
        gen = None
        if seed is not None:
            gen = torch.Generator(device=self.device).manual_seed(int(seed))
        elif not params.greedy:
            gen = torch.Generator(device=self.device)
            gen.seed()
        out: list[Completion] = []
        stats = {"prefill_tokens": 0, "prefill_s": 0.0, "decode_tokens": 0, "decode_s": 0.0,
                 "decode_steps": 0, "ttft_s": None}
        t_start = time.perf_counter()
        mb = self.options.max_batch
        for c0 in range(0, len(seqs), mb):
            chunk = seqs[c0:c0 + mb]
            cb = None if on_token is None else (lambda i, t, _o=c0: on_token(i + _o, t))
            out.extend(self._generate_batch(chunk, max_new_tokens, params, gen, stop_ids,
                                            stop_strs, cb, stats, t_start))
        stats["prefill_tok_s"] = stats["prefill_tokens"] / max(stats["prefill_s"], 1e-9)
        stats["decode_tok_s"] = stats["decode_tokens"] / max(stats["decode_s"], 1e-9)
        stats["graph_notes"] = list(self.runner.notes)
        stats["glue_notes"] = self.glue_notes
        self.last_stats = stats
        return out

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _reserve(self, totals: list[int]) -> list[list[int]] | None:
        """KV room for sequences of these total lengths (raises KVBudgetError); their block
        table rows written (rows 0..n-1; the rest point to the scratch page)."""
        m, st = self.model, self.runner.state
        if len(totals) > self.options.max_batch:
            raise ValueError(f"{len(totals)} sequences exceed max_batch "
                             f"{self.options.max_batch}")
        pages: list[list[int]] | None = None
        if m.kv.kind == "nvfp4":
            pages = m.kv.allocate(totals)
        else:
            m.kv.check(totals)
        bt = torch.zeros(st.block_tables.shape, dtype=torch.int32)
        if pages is not None:
            if max(len(p) for p in pages) > bt.shape[1]:
                m.kv.release(pages)
                raise ValueError("a sequence is longer than max_seq_len")
            for r, p in enumerate(pages):
                bt[r, :len(p)] = torch.tensor(p, dtype=torch.int32)
        st.block_tables.copy_(bt)
        return pages

    def _release(self, pages: list[list[int]] | None) -> None:
        if pages is not None:
            self.model.kv.release(pages)

    def _prefill_rows(self, seqs: list[list[int]]) -> torch.Tensor:
        """Prefill rows 0..n-1 (groups of at most prefill_tokens tokens) -> the last tokens'
        logits float32 [n, V]."""
        m, st = self.model, self.runner.state
        lens = [len(s) for s in seqs]
        tens = [torch.tensor(s, dtype=torch.int64) for s in seqs]
        out, i, n = [], 0, len(seqs)
        while i < n:
            j, tok = i, 0
            while j < n and (j == i or tok + lens[j] <= self.options.prefill_tokens):
                tok += lens[j]
                j += 1
            out.append(m.prefill(tens[i:j], list(range(i, j)), st.block_tables))
            i = j
        return torch.cat(out)

    def _start_decode(self, lens: list[int], first: torch.Tensor) -> None:
        """Decode state: row r feeds first[r] (device int64 [n]) at position lens[r]; rows
        past n are padding."""
        st, n = self.runner.state, len(lens)
        rows = torch.arange(st.tokens.shape[0])
        live = rows < n
        pos = torch.zeros_like(rows)
        pos[:n] = torch.tensor(lens)
        st.tokens.fill_(self.model.pad_id)
        st.tokens[:n].copy_(first)
        st.pos.copy_(pos)
        st.seq_lens.copy_(torch.where(live, pos + 1, 0).to(torch.int32))
        st.app_pos[:, 1].copy_(pos.to(torch.int32))
        st.active.copy_(live.to(torch.int32))

    def _generate_batch(self, seqs: list[list[int]], max_new: int, params: SamplingParams,
                        gen: torch.Generator | None, stop_ids: set[int], stop_strs: list[str],
                        on_token: Callable[[int, int], None] | None, stats: dict,
                        t_start: float) -> list[Completion]:
        st, n = self.runner.state, len(seqs)
        lens = [len(s) for s in seqs]
        pages = self._reserve([ln + max_new for ln in lens])
        try:
            b = self.runner.bucket(n)
            self._sync()
            t0 = time.perf_counter()
            first = sample(self._prefill_rows(seqs), params, gen)
            first_host = first.tolist()             # the one sync: the first tokens
            t1 = time.perf_counter()
            stats["prefill_tokens"] += sum(lens)
            stats["prefill_s"] += t1 - t0
            if stats["ttft_s"] is None:
                stats["ttft_s"] = t1 - t_start
            self._start_decode(lens, first)
            gen_ids: list[list[int]] = [[] for _ in range(n)]
            done = [False] * n
            reason = ["length"] * n

            def take(r: int, t: int) -> None:
                if done[r]:
                    return
                gen_ids[r].append(t)
                if on_token is not None:
                    on_token(r, t)
                if t in stop_ids:
                    done[r], reason[r] = True, "stop"
                elif stop_strs and any(s in self.tokenizer.decode(gen_ids[r])
                                       for s in stop_strs):
                    done[r], reason[r] = True, "stop"
                elif len(gen_ids[r]) >= max_new:
                    done[r] = True

            for r, t in enumerate(first_host):
                take(r, t)
            t2 = time.perf_counter()
            steps = 0
            max_len = max(lens) + 1
            pinned = self.device.type == "cuda"
            bufs = [torch.empty(n, dtype=torch.int64, pin_memory=pinned) for _ in range(2)]
            pending: tuple[torch.Tensor, Any] | None = None
            for s in range(max_new - 1):
                if all(done):
                    break
                logits = self.runner.step(b, max_len)
                nxt = sample(logits[:n], params, gen)
                st.tokens[:n].copy_(nxt)
                buf = bufs[s % 2]
                buf.copy_(nxt, non_blocking=pinned)
                ev = torch.cuda.Event() if pinned else None
                if ev is not None:
                    ev.record()
                steps += 1
                max_len += 1
                if pending is not None:
                    self._drain(pending, take)
                pending = (buf, ev)
            if pending is not None:
                self._drain(pending, take)
            self._sync()
            stats["decode_s"] += time.perf_counter() - t2
            stats["decode_steps"] += steps
            stats["decode_tokens"] += steps * n
        finally:
            self._release(pages)
        outs = []
        for r in range(n):
            ids = gen_ids[r]
            text = None
            if self.tokenizer is not None:
                text = self.tokenizer.decode(ids, skip_special_tokens=True)
                for s in stop_strs:
                    if s in text:
                        text = text[: text.index(s)]
            outs.append(Completion(text, ids, reason[r], lens[r]))
        return outs

    @staticmethod
    def _drain(pending: tuple[torch.Tensor, Any], take: Callable[[int, int], None]) -> None:
        buf, ev = pending
        if ev is not None:
            ev.synchronize()
        for r, t in enumerate(buf.tolist()):
            take(r, t)

    # ------------------------------------------------------------------ teacher forcing
    @torch.no_grad()
    def forced_decode(self, seqs: Sequence[Sequence[int]], prompt_lens: Sequence[int],
                      reduce: str = "nll") -> list[Any]:
        """Teacher forcing through the DECODE path: each sequence's first prompt_lens[i]
        tokens are prefilled, the rest fed one per decode step (the KV cache, the decode
        attention and the CUDA graphs of generation). reduce "logits": per sequence float32
        [n_i - p_i, V] (CPU), the logits predicting tokens p_i .. n_i - 1; "nll": per
        sequence (sum of -log p(token), count) over those tokens, reduced on the device."""
        import torch.nn.functional as F

        if reduce not in ("nll", "logits"):
            raise ValueError(f"reduce must be 'nll' or 'logits', got {reduce!r}")
        seqs = [list(s) for s in seqs]
        plen = [int(p) for p in prompt_lens]
        if len(plen) != len(seqs) or any(not 1 <= p < len(s) for p, s in zip(plen, seqs)):
            raise ValueError("every prompt length must lie in [1, len(sequence))")
        n = len(seqs)
        steps = max(len(s) - p for s, p in zip(seqs, plen)) - 1
        pages = self._reserve([p + steps + 1 for p in plen])
        dev = self.device
        try:
            b = self.runner.bucket(n)
            pad = [s + [0] * (p + steps + 1 - len(s)) for s, p in zip(seqs, plen)]
            feed = torch.tensor([row[p:p + steps + 1] for row, p in zip(pad, plen)],
                                dtype=torch.int64, device=dev)          # [n, steps + 1]
            want = torch.tensor([[1.0 if p + j < len(s) else 0.0 for j in range(steps + 1)]
                                 for s, p in zip(seqs, plen)], device=dev)
            nll = torch.zeros(n, dtype=torch.float64, device=dev)
            kept: list[list[torch.Tensor]] = [[] for _ in range(n)]

            def account(j: int, logits: torch.Tensor) -> None:
                if reduce == "nll":
                    lp = F.log_softmax(logits, dim=-1).gather(-1, feed[:, j:j + 1])[:, 0]
                    nll.sub_(lp.double() * want[:, j])
                else:
                    for r in range(n):
                        if want[r, j] > 0:
                            kept[r].append(logits[r].to("cpu", copy=True))
            first_logits = self._prefill_rows([s[:p] for s, p in zip(seqs, plen)])
            account(0, first_logits)
            self._start_decode(plen, feed[:, 0])
            max_len = max(plen) + 1
            st = self.runner.state
            for j in range(1, steps + 1):
                logits = self.runner.step(b, max_len)[:n]
                account(j, logits)
                st.tokens[:n].copy_(feed[:, j])
                max_len += 1
            self._sync()
        finally:
            self._release(pages)
        if reduce == "logits":
            return [torch.stack(k) for k in kept]
        counts = want.sum(1).tolist()
        return [(float(x), int(c)) for x, c in zip(nll.tolist(), counts)]

    # ------------------------------------------------------------------ scoring
    @torch.no_grad()
    def score(self, seqs: Sequence[Sequence[int]] | torch.Tensor, batch_tokens: int = 4096
              ) -> dict[str, float]:
        """Teacher-forced next-token NLL of whole sequences through the prefill path (exact
        attention on each sequence; no KV cache): {"nll" (mean, nats), "ppl", "tokens"}."""
        import math

        import torch.nn.functional as F

        tens = [torch.as_tensor(s, dtype=torch.int64).reshape(-1) for s in seqs]
        total, count, i = 0.0, 0, 0
        while i < len(tens):
            j, tok = i, 0
            while j < len(tens) and (j == i or tok + tens[j].numel() <= batch_tokens):
                tok += tens[j].numel()
                j += 1
            h = self.model.prefill(tens[i:j], store=False, want="hidden")
            s0 = 0
            for t in tens[i:j]:
                n = t.numel()
                lg = self.model.logits(h[s0:s0 + n - 1])
                total += float(F.cross_entropy(lg, t[1:].to(lg.device), reduction="sum")
                               .double())
                count += n - 1
                s0 += n
            i = j
        mean = total / max(count, 1)
        return {"nll": mean, "ppl": math.exp(mean), "tokens": count}


_UNSET = object()


def _all_bf16(src: ModelSource) -> bool:
    """Whether the source's projection weights are BF16 already (keep them so on the GPU)."""
    name = "model.layers.0.self_attn.q_proj.weight"
    return src.has(name) and src.tensors[name].dtype == torch.bfloat16
