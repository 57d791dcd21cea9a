"""The engine's speed on a Qwen3-8B-shaped model, the way users measure it (issue 19, section 4).

Model: the registry's Qwen3-8B (resgen.models, with Qwen3-8B's published vocabulary 151936,
RoPE theta 1e6, eps 1e-6, untied head), random BF16 weights at realistic scales (projections
N(0, 1/K), embeddings N(0, 1), norms 1 +- 0.05), generated on the GPU from a seed per tensor.
Static NVFP4 input scales come from one BF16 pass over 256 random tokens (the engine's own
calibration on its dense model), as bench/decode_step.py does.

Stacks (one process, interleaved as far as memory allows; --stacks):
    comp   resgen: NVFP4 W4A4 with full residue (M-Ext), ResAttn over the paged NVFP4 KV cache
    plain  resgen: NVFP4 W4A4, plain NVFP4-KV attention
    w4a16  resgen: NVFP4 weights, BF16 activations (the Hopper mode), ResAttn
    bf16   the same engine with BF16 weights (cuBLAS) and a dense BF16 KV cache (SDPA /
           varlen FlashAttention), the same glue and the same CUDA graphs: baseline (a)
    hf     transformers BF16 with a static cache and torch.compile (generate with
           cache_implementation="static", which compiles the decoding step): baseline (b)
    X-compiled  engine stack X (comp, plain, w4a16, bf16) with compile="glue": the glue
           between the kernels through torch.compile (resgen/engine/glue.py), compiled on
           each batch bucket's first step, before its graph capture (first_step_s includes
           the compile); the table adds X-compiled / X

Per (batch, context) point: decode tokens/s of the serving loop (graph replay + greedy
sampling + the next-token copy, as LLM.generate runs it, without the per-step host read) over
--steps steps, and the graph replay alone. The KV cache is NOT filled by a real prefill: every
sequence's first `context` positions hold random NVFP4 codes / scales (resgen) or random BF16
values (bf16 engine), which costs the same bytes to read; transformers gets a real prefill
(its static cache cannot be filled otherwise). A point whose KV does not fit the GPU is
reported as such. Prefill: tokens/s and time to first token of one 2K-token prompt
(LLM.generate with max_new_tokens=1, warm). Engine overhead at batch 1 (8K context): the
graph's kernels under torch.profiler, split into resgen kernels, cuBLAS (LM head; BF16
weights), torch glue, and idle gaps; "overhead" is everything but the model's kernels (resgen's
and the cuBLAS LM head): glue kernels + idle gaps in the graph + the serving loop's sampling and
token copy (its step time minus the replay's), as a fraction of the serving step.

    source .devcache/device/env.sh && python3 bench/engine_speed.py --quick   # ~6 min
    python3 bench/engine_speed.py --stacks comp,plain       # call 1 (~9 min)
    python3 bench/engine_speed.py --stacks bf16,hf          # call 2 (~8 min)
        # -> $OUT/engine_speed.json; a table last (ratios across stacks of the same run)
    python3 bench/engine_speed.py --merge a.json b.json     # one table over two runs
    python3 bench/engine_speed.py --stacks comp,comp-compiled --batches 1,8,64 \
        --contexts 8192                # compiled glue vs eager glue (~7 min)

--cpu runs the same code on a tiny Qwen3 config with the reference backend (no graphs, no
compile): what tests/test_engine_bench.py runs.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import zlib
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

STACKS = ("comp", "plain", "w4a16", "bf16", "hf")
ENGINE = {"comp": dict(fmt="nvfp4", compensation="full", kv="nvfp4", attn="resattn"),
          "plain": dict(fmt="nvfp4", compensation="none", kv="nvfp4", attn="plain"),
          # the Hopper mode (docs/hopper_native.md): FP4 weights, BF16 activations, ResAttn
          "w4a16": dict(fmt="nvfp4", compensation="w4a16", kv="nvfp4", attn="resattn"),
          "bf16": dict(fmt="bf16", kv="bf16")}
COMPILED = "-compiled"          # suffix: the engine stack with compile="glue"


def engine_spec(stack: str) -> dict[str, Any] | None:
    """resgen.load's options of an engine stack (None: not an engine stack)."""
    base, comp = (stack[: -len(COMPILED)], "glue") if stack.endswith(COMPILED) else \
        (stack, "none")
    if base not in ENGINE:
        return None
    return {**ENGINE[base], "compile": comp}


def known(stack: str) -> bool:
    return stack == "hf" or engine_spec(stack) is not None


def qwen3_config(name: str = "qwen3-8b") -> dict:
    """An HF config dict of the registry model (Qwen3's published non-shape fields)."""
    from resgen.models import get_model

    s = get_model(name)
    return {"model_type": "qwen3", "_name_or_path": s.name, "vocab_size": 151936,
            "hidden_size": s.hidden, "intermediate_size": s.intermediate,
            "num_hidden_layers": s.layers, "num_attention_heads": s.heads,
            "num_key_value_heads": s.kv_heads, "head_dim": s.head_dim, "rms_norm_eps": 1e-6,
            "rope_theta": 1e6, "max_position_embeddings": 40960, "tie_word_embeddings": False,
            "attention_bias": False, "hidden_act": "silu", "torch_dtype": "bfloat16"}


def tiny_config() -> dict:
    return {**qwen3_config(), "_name_or_path": "tiny-qwen3", "vocab_size": 512,
            "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
            "max_position_embeddings": 2048}


class RandomWeights(Mapping[str, torch.Tensor]):
    """The model's tensors by HF name, generated on access (deterministic per name)."""

    def __init__(self, cfg: dict, device: torch.device, dtype: torch.dtype = torch.bfloat16,
                 seed: int = 0) -> None:
        self.cfg, self.device, self.dtype, self.seed = cfg, device, dtype, seed
        h, i, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
        q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
        per = {"self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
               "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q),
               "mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h),
               "mlp.down_proj.weight": (h, i), "input_layernorm.weight": (h,),
               "post_attention_layernorm.weight": (h,), "self_attn.q_norm.weight": (d,),
               "self_attn.k_norm.weight": (d,)}
        self.shapes = {f"model.layers.{n}.{k}": v for n in range(cfg["num_hidden_layers"])
                       for k, v in per.items()}
        self.shapes.update({"model.embed_tokens.weight": (cfg["vocab_size"], h),
                            "model.norm.weight": (h,), "lm_head.weight": (cfg["vocab_size"], h)})

    def __getitem__(self, name: str) -> torch.Tensor:
        shape = self.shapes[name]
        g = torch.Generator(device=self.device).manual_seed(
            self.seed * 1000003 + zlib.crc32(name.encode()))
        x = torch.randn(shape, generator=g, device=self.device, dtype=torch.float32)
        if len(shape) == 1:
            x = 1 + 0.05 * x
        elif "embed" not in name:
            x = x / shape[1] ** 0.5
        return x.to(self.dtype)

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)

    def __contains__(self, name: object) -> bool:
        return name in self.shapes


# ----------------------------------------------------------------------------- timing


def headroom(steps: int) -> int:
    """Tokens a point decodes past its context: decode_point runs 2 + 2 x steps steps (first
    step, warm step, the serving loop, the replays), overhead_point 7 + 2 x steps; the KV is
    sized and reserved for them (positions past the dense cache's rows would index out of
    bounds; past a row's reserved pages the paged cache would read page 0)."""
    return 2 * steps + 16


class Timer:
    """CUDA events on the GPU, perf_counter on the CPU: milliseconds of fn() x reps."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def __call__(self, fn: Callable[[], Any], reps: int) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(reps):
                fn()
            b.record()
            b.synchronize()
            return a.elapsed_time(b) / reps
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t) * 1e3 / reps


def fill_kv(llm: Any, batch: int, ctx: int, steps: int, seed: int = 0) -> list | None:
    """Rows 0..batch-1 hold ctx random cached tokens each (see the module docstring) and feed
    a random token at position ctx; room for `steps` more. Returns the pages (to release)."""
    m = llm.model
    pages = llm._reserve([ctx + steps + 2] * batch)
    dev = llm.device
    g = torch.Generator(device=dev).manual_seed(seed)
    kv = m.kv
    if kv.kind == "nvfp4":
        used = torch.tensor(sorted(p for ps in pages for p in ps), device=dev)
        for c in kv.caches:
            for codes, sf in ((c.k_codes, c.k_sf), (c.v_codes, c.v_sf)):
                codes[used] = torch.randint(0, 256, (len(used), *codes.shape[1:]),
                                            generator=g, device=dev, dtype=torch.uint8)
                e = torch.rand((len(used), *sf.shape[1:]), generator=g, device=dev) * 3 - 3
                sf.view(torch.uint8)[used] = torch.exp2(e).to(torch.float8_e4m3fn).view(
                    torch.uint8)
    else:
        for t in kv.k + kv.v:
            t[:batch, :ctx].normal_(generator=g)
    first = torch.randint(0, llm.cfg.vocab_size, (batch,), generator=g, device=dev)
    llm._start_decode([ctx] * batch, first)
    return pages


def decode_point(llm: Any, batch: int, ctx: int, steps: int, timer: Timer) -> dict[str, Any]:
    """Decode tokens/s at (batch, ctx) (module docstring); the KV filled by fill_kv."""
    from resgen.engine.sampling import SamplingParams, sample

    pages = fill_kv(llm, batch, ctx, headroom(steps))
    try:
        st, r = llm.runner.state, llm.runner
        b = r.bucket(batch)
        length = [ctx + 1]
        greedy = SamplingParams()

        def serve() -> None:           # one generate() step (its host read excepted)
            logits = r.step(b, length[0])
            st.tokens[:batch].copy_(sample(logits[:batch], greedy))
            length[0] += 1

        t0 = time.perf_counter()
        serve()                        # plans, compiles, the eager step and the capture
        first_s = time.perf_counter() - t0
        serve()
        ms = timer(serve, steps)
        replay = timer(lambda: r.step(b, length[0]), steps)
        return {"batch": batch, "context": ctx, "step_ms": ms, "replay_ms": replay,
                "tok_s": batch * 1e3 / ms, "first_step_s": first_s,
                "graph": r.graphs.get((b, r.kv_class(length[0]))) is not None,
                "notes": list(r.notes)}
    finally:
        llm._release(pages)


def prefill_point(llm: Any, length: int, reps: int = 3) -> dict[str, Any]:
    """Time to first token and prefill tokens/s of one `length`-token prompt (warm)."""
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, llm.cfg.vocab_size, (length,), generator=g).tolist()
    llm.generate([prompt], max_new_tokens=1)        # plans for this row count
    ttft, pre = [], []
    for _ in range(reps):
        llm.generate([prompt], max_new_tokens=1)
        ttft.append(llm.last_stats["ttft_s"])
        pre.append(llm.last_stats["prefill_s"])
    t, p = sorted(ttft)[reps // 2], sorted(pre)[reps // 2]
    return {"length": length, "ttft_ms": t * 1e3, "prefill_ms": p * 1e3,
            "prefill_tok_s": length / p}


def classify(name: str) -> str:
    if name.startswith("kernel_cutlass"):
        return "resgen"
    if name.startswith(("nvjet", "cublas", "sm90_xmma", "cutlass")) or "gemm" in name.lower():
        return "cublas"
    return "glue"


def overhead_point(llm: Any, ctx: int, steps: int, timer: Timer) -> dict[str, Any]:
    """Batch 1 at ctx: where a decode step's time goes (module docstring)."""
    from torch.profiler import ProfilerActivity, profile

    pages = fill_kv(llm, 1, ctx, headroom(steps))
    try:
        r = llm.runner
        length = [ctx + 1]

        def step() -> None:
            r.step(1, length[0])

        step()
        step()
        replay = timer(step, steps)
        g = r.graphs.get((1, r.kv_class(length[0])))
        if g is None:
            return {"context": ctx, "note": "no CUDA graph (eager steps): not profiled",
                    "replay_ms": replay}
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                g.replay()
            torch.cuda.synchronize()
        spans = sorted((e.name, float(e.time_range.start), float(e.time_range.end))
                       for e in prof.events()
                       if e.device_type == torch.autograd.DeviceType.CUDA
                       and "memcpy" not in e.name.lower() and "memset" not in e.name.lower())
        by: dict[str, float] = {"resgen": 0.0, "cublas": 0.0, "glue": 0.0}
        counts: dict[str, int] = {"resgen": 0, "cublas": 0, "glue": 0}
        for n, a, b in spans:
            by[classify(n)] += (b - a) / 5
            counts[classify(n)] += 1
        order = sorted(spans, key=lambda s: s[1])
        wall = (max(s[2] for s in order) - order[0][1]) / 5 if order else 0.0
        busy = sum(by.values())
        from resgen.engine.sampling import SamplingParams, sample

        st = llm.runner.state

        def serve() -> None:
            st.tokens[:1].copy_(sample(r.step(1, length[0])[:1], SamplingParams()))
        serve_ms = timer(serve, steps)
        idle = max(0.0, wall - busy)
        return {"context": ctx, "replay_ms": replay, "serve_step_ms": serve_ms,
                "profile_wall_us": wall, "kernels_us": by,
                "kernels_per_step": {k: v / 5 for k, v in counts.items()},
                "idle_gap_us": idle,
                # everything but the model's kernels (resgen's and the cuBLAS LM head):
                # torch glue kernels and idle gaps inside the graph, plus the serving loop's
                # sampling and token copy outside it
                "overhead_fraction": ((wall - by["resgen"] - by["cublas"]) / 1e3 +
                                      max(0.0, serve_ms - replay)) / serve_ms if wall else None,
                "glue_fraction": by["glue"] / wall if wall else None,
                "idle_fraction": idle / wall if wall else None,
                "host_fraction": max(0.0, serve_ms - replay) / serve_ms}
    finally:
        llm._release(pages)


# ----------------------------------------------------------------------------- stacks


def build_engine(stack: str, cfg: dict, device: torch.device, max_batch: int,
                 max_seq_len: int, backend: str, kv_fraction: float,
                 kv_budget: int | None = None) -> Any:
    import resgen

    weights = RandomWeights(cfg, device)
    calib = [torch.randint(0, cfg["vocab_size"], (256,),
                           generator=torch.Generator().manual_seed(2))]
    kw = engine_spec(stack)
    if kw is None:
        raise ValueError(f"not an engine stack: {stack!r}")
    return resgen.load((cfg, weights), backend=backend, max_batch=max_batch,
                       max_seq_len=max_seq_len, kv_fraction=kv_fraction, kv_budget=kv_budget,
                       calib=calib if kw["fmt"] != "bf16" else None,
                       graphs=device.type == "cuda", **kw)


def kv_bytes_needed(cfg: dict, batch: int, max_ctx: int, prefill_len: int,
                    page_size: int = 32) -> int:
    """NVFP4 KV bytes for `batch` rows of max_ctx tokens plus a page of slack per row, and one
    prefill prompt: what the bench's points use, with 25 % on top."""
    from resgen.engine.kv import bytes_per_token

    bpt = bytes_per_token(cfg["num_hidden_layers"], cfg["num_key_value_heads"],
                          cfg["head_dim"], "nvfp4")
    tokens = batch * (max_ctx + 2 * page_size) + prefill_len + 2 * page_size
    return int(tokens * bpt * 1.25)


def fits(llm: Any, batch: int, ctx: int, steps: int) -> str | None:
    kv = llm.model.kv
    need = batch * (ctx + headroom(steps) + 2)
    if kv.kind == "nvfp4":
        pages = batch * kv.pages_for(ctx + headroom(steps) + 2)
        if pages > kv.num_pages - 1:
            return f"needs {pages} KV pages, {kv.num_pages - 1} fit ({need} tokens)"
        return None
    if batch > kv.rows or ctx + headroom(steps) + 2 > kv.max_len:
        return f"dense KV of {kv.rows} x {kv.max_len} tokens cannot hold {batch} x {ctx}"
    return None


def run_engine_stack(stack: str, cfg: dict, device: torch.device, batches: list[int],
                     contexts: list[int], steps: int, prefill_len: int, backend: str,
                     log: Callable[[str], None]) -> dict[str, Any]:
    """Every point of one resgen-engine stack (comp / plain / w4a16 / bf16)."""
    timer = Timer(device)
    max_ctx = max(contexts) + headroom(steps) + 8
    spec = engine_spec(stack)
    if spec is None:
        raise ValueError(f"not an engine stack: {stack!r}")
    rec: dict[str, Any] = {"stack": stack, "points": [], "config": spec}
    t0 = time.perf_counter()
    dense_kv = spec["kv"] != "nvfp4"
    # The paged cache holds what the points need (every row at the longest context, a page of
    # slack per row, the prefill prompt), not a fraction of free memory: at Qwen3-32B, 85 % of
    # the free memory left too little for the step's workspace (OOM on the H200, 2026-12-02).
    paged_budget = None if dense_kv else kv_bytes_needed(cfg, max(batches), max_ctx,
                                                         prefill_len)
    llm = build_engine(stack, cfg, device, 1 if dense_kv else max(batches),
                       max(max_ctx, prefill_len + 8), backend, 0.85, paged_budget)
    rec["load_s"] = time.perf_counter() - t0
    rec["kv"] = llm.kv_info()
    rec["dense_attention"] = getattr(llm.model.attn, "mode", None)   # BF16 engine: varlen | masked
    log(f"{stack}: loaded in {rec['load_s']:.0f} s; KV {rec['kv']}; attention "
        f"{rec['dense_attention'] or 'resgen.ops.DecodeAttention'}")
    try:
        rec["prefill"] = prefill_point(llm, prefill_len)
        log(f"{stack}: prefill {rec['prefill']}")
    except Exception as e:
        rec["prefill"] = {"error": f"{type(e).__name__}: {e}"[:300]}
    for b in batches:
        if dense_kv:               # rows are batch slots: one cache per batch size
            need = max(c for c in contexts) + headroom(steps) + 8
            llm.resize_kv(max_batch=b, max_seq_len=min(need, llm.cfg.max_positions),
                          kv_budget=0)
        for c in contexts:
            why = fits(llm, b, c, steps)
            if why is not None:
                rec["points"].append({"batch": b, "context": c, "fits": False, "note": why})
                log(f"{stack} B={b} ctx={c}: does not fit ({why})")
                continue
            try:
                p = decode_point(llm, b, c, steps, timer)
                p["fits"] = True
            except Exception as e:
                p = {"batch": b, "context": c, "fits": None,
                     "error": f"{type(e).__name__}: {e}"[:400]}
            rec["points"].append(p)
            log(f"{stack} B={b} ctx={c}: " + (p.get("error") or
                                               f"{p['tok_s']:.1f} tok/s ({p['step_ms']:.3f} ms)"))
    rec["glue_notes"] = llm.glue_notes
    if device.type == "cuda" and 1 in batches:
        if dense_kv:
            llm.resize_kv(max_batch=1, max_seq_len=min(max_ctx, llm.cfg.max_positions),
                          kv_budget=0)
        ctx = 8192 if 8192 in contexts else contexts[0]
        try:
            rec["overhead"] = overhead_point(llm, ctx, steps, timer)
        except Exception as e:
            rec["overhead"] = {"error": f"{type(e).__name__}: {e}"[:300]}
    del llm
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    rec["seconds"] = time.perf_counter() - t0
    return rec


def run_hf(cfg: dict, device: torch.device, points: list[tuple[int, int]], steps: int,
           log: Callable[[str], None], compile_step: bool = True) -> dict[str, Any]:
    """transformers BF16, static cache, compiled decoding step (module docstring): per
    (batch, context), decode tokens/s = batch x steps / (t(prefill + 1 + steps tokens) -
    t(prefill + 1 token)), both generate() calls timed after a warm-up call of that shape."""
    import transformers

    transformers.logging.set_verbosity_error()
    rec: dict[str, Any] = {"stack": "hf", "transformers": transformers.__version__,
                           "points": []}
    t0 = time.perf_counter()
    hcfg = transformers.Qwen3Config(**{k: v for k, v in cfg.items()
                                       if k not in ("model_type", "_name_or_path",
                                                    "torch_dtype")})
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(hcfg, dtype=torch.bfloat16)
    model.eval()
    weights = RandomWeights(cfg, device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in weights:
                p.copy_(weights[name])
    rec["load_s"] = time.perf_counter() - t0
    kw = dict(do_sample=False, cache_implementation="static" if compile_step else None,
              pad_token_id=0)

    def gen(ids: torch.Tensor, n: int) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t

    for b, c in points:
        g = torch.Generator().manual_seed(b * 7 + c)
        ids = torch.randint(1, cfg["vocab_size"], (b, c), generator=g).to(device)
        try:
            t1 = time.perf_counter()
            gen(ids, steps + 1)                       # compile + warm-up of this shape
            warm = time.perf_counter() - t1
            one = gen(ids, 1)
            full = gen(ids, steps + 1)
            ms = (full - one) * 1e3 / steps
            p = {"batch": b, "context": c, "step_ms": ms, "tok_s": b * 1e3 / ms,
                 "ttft_ms": one * 1e3, "first_call_s": warm, "fits": True}
        except torch.cuda.OutOfMemoryError as e:
            p = {"batch": b, "context": c, "fits": False, "note": f"OOM: {e}"[:200]}
        except Exception as e:
            p = {"batch": b, "context": c, "fits": None,
                 "error": f"{type(e).__name__}: {e}"[:400]}
        rec["points"].append(p)
        log(f"hf B={b} ctx={c}: " + (p.get("error") or p.get("note") or
                                      f"{p['tok_s']:.1f} tok/s (first call {p['first_call_s']:.0f} s)"))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    model = None                      # free the weights before the next stack
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    rec["seconds"] = time.perf_counter() - t0
    return rec


# ----------------------------------------------------------------------------- report


def _point(rec: dict | None, b: int, c: int) -> dict | None:
    if rec is None:
        return None
    for p in rec["points"]:
        if p["batch"] == b and p["context"] == c:
            return p
    return None


def merge_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One result from several runs' JSON: per stack, the points of every run (a later run's
    point at the same batch and context replaces an earlier one's), the first prefill and
    overhead records found. Ratios in a merged table compare different runs."""
    stacks: dict[str, dict[str, Any]] = {}
    for run in runs:
        for name, rec in run["stacks"].items():
            into = stacks.setdefault(name, {"stack": name, "points": []})
            for k in ("prefill", "overhead", "config", "kv"):
                if rec.get(k) and not into.get(k):
                    into[k] = rec[k]
            have = {(p["batch"], p["context"]): i for i, p in enumerate(into["points"])}
            for p in rec.get("points", []):
                key = (p["batch"], p["context"])
                if key in have:
                    into["points"][have[key]] = p
                else:
                    have[key] = len(into["points"])
                    into["points"].append(p)
    return {"stacks": stacks}


def table(res: dict[str, Any]) -> str:
    """Decode tokens/s per point and stack; ratios of decode tokens/s comp / bf16, comp / hf,
    comp / plain, w4a16 / comp (of the same JSON; before 2026-12-02 the comp / plain column
    was headed "plain/comp" though it held comp / plain); prefill and overhead lines."""
    st = res["stacks"]
    pts = sorted({(p["batch"], p["context"]) for r in st.values() for p in r["points"]})
    names = [s for s in STACKS if s in st] + [s for s in st if s not in STACKS]
    compiled = [s for s in names if s.endswith(COMPILED) and s[: -len(COMPILED)] in st]
    head = ["B", "ctx"] + names + ["comp/bf16", "comp/hf", "comp/plain", "w4a16/comp"] + \
        [s.replace(COMPILED, "-c") + "/" + s[: -len(COMPILED)] for s in compiled]
    lines = [" ".join(f"{h:>10s}" for h in head)]

    def tok(s: str, b: int, c: int) -> float | None:
        p = _point(st.get(s), b, c)
        return p.get("tok_s") if p else None

    for b, c in pts:
        row = [str(b), f"{c // 1024}K" if c % 1024 == 0 else str(c)]
        for s in names:
            p = _point(st[s], b, c)
            row.append("-" if p is None else ("no fit" if p.get("fits") is False else (
                "error" if "error" in p else f"{p['tok_s']:.1f}")))
        comp, bf, hf, plain, w16 = (tok(s, b, c) for s in ("comp", "bf16", "hf", "plain",
                                                            "w4a16"))
        pairs = [(comp, bf), (comp, hf), (comp, plain), (w16, comp)] + \
            [(tok(s, b, c), tok(s[: -len(COMPILED)], b, c)) for s in compiled]
        for a, d in pairs:
            row.append(f"{a / d:.2f}" if a and d else "-")
        lines.append(" ".join(f"{x:>10s}" for x in row))
    for s, r in st.items():
        pre = r.get("prefill")
        if pre and "ttft_ms" in pre:
            lines.append(f"{s}: prefill {pre['length']} tokens {pre['prefill_tok_s']:.0f} "
                         f"tok/s, time to first token {pre['ttft_ms']:.1f} ms")
        ov = r.get("overhead")
        if ov and "kernels_us" in ov:
            k = ov["kernels_us"]
            lines.append(f"{s}: batch 1 ctx {ov['context']}: graph {ov['profile_wall_us']:.0f}"
                         f" us = resgen {k['resgen']:.0f} + cuBLAS {k['cublas']:.0f} + glue "
                         f"{k['glue']:.0f} + idle {ov['idle_gap_us']:.0f} us; serving step "
                         f"{1e3 * ov['serve_step_ms']:.0f} us; overhead (glue + idle + host) "
                         f"{100 * ov['overhead_fraction']:.1f}% (glue "
                         f"{100 * ov['glue_fraction']:.1f}%, idle "
                         f"{100 * ov['idle_fraction']:.1f}%, host "
                         f"{100 * ov['host_fraction']:.1f}%); glue kernels per step "
                         f"{ov.get('kernels_per_step', {}).get('glue', float('nan')):.0f}")
    return "\n".join(lines)


def estimate(stacks: list[str], batches: list[int], contexts: list[int],
             hf_points: list[tuple[int, int]]) -> float:
    """Seconds, roughly: load + compiles per engine stack, a few s per point, HF compiles."""
    t = 0.0
    for s in stacks:
        if s == "hf":
            t += 40 + 100 * len(hf_points)
        else:
            t += 60 + 40 + 4 * len(batches) * len(contexts)
            if s.endswith(COMPILED):        # inductor: the prefill's and each bucket's regions
                t += 40 + 45 * len(batches)
    return t


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--stacks", default="comp,plain,w4a16,bf16,hf")
    ap.add_argument("--batches", default="1,8,32,64,128")
    ap.add_argument("--contexts", default="1024,8192,32768")
    ap.add_argument("--hf-points", default="1x8192,8x8192,1x1024",
                    help="BxCTX list for transformers (each compiles)")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--prefill-len", type=int, default=2048)
    ap.add_argument("--quick", action="store_true", help="batches 1,8,64; context 8K; hf 1x8K")
    ap.add_argument("--cpu", action="store_true", help="tiny model, reference backend")
    ap.add_argument("--merge", nargs="+", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.merge:
        res = merge_runs([json.loads(p.read_text()) for p in args.merge])
        res["merged_from"] = [str(p) for p in args.merge]
        print("(stacks from different runs: ratios across runs)")
        print(table(res))
        return 0
    stacks = [s for s in args.stacks.split(",") if s]
    bad = [s for s in stacks if not known(s)]
    if bad:
        print(f"unknown stacks {bad}; known {STACKS} and the engine stacks with "
              f"'{COMPILED}'", file=sys.stderr)
        return 2
    batches = [int(x) for x in args.batches.split(",")]
    contexts = [int(x) for x in args.contexts.split(",")]
    hf_points = [tuple(int(v) for v in x.split("x")) for x in args.hf_points.split(",") if x]
    if args.quick:
        batches, contexts, hf_points = [1, 8, 64], [8192], [(1, 8192)]
    if args.cpu:
        dev, backend, cfg = torch.device("cpu"), "reference", tiny_config()
        batches, contexts = [b for b in batches if b <= 4] or [1, 2], [64, 128]
        hf_points = [(1, 64)]
        args.steps, args.prefill_len = min(args.steps, 4), 32
    else:
        if not torch.cuda.is_available():
            print("engine_speed needs a CUDA GPU (or --cpu)", file=sys.stderr)
            return 2
        dev, backend, cfg = torch.device("cuda", torch.cuda.current_device()), "cuda", \
            qwen3_config(args.model)
    est = estimate(stacks, batches, contexts, hf_points)
    print(f"estimate: about {est / 60:.0f} min for stacks {stacks}, batches {batches}, "
          f"contexts {contexts}, hf {hf_points}", flush=True)
    out = args.out or Path(os.environ.get("OUT", "bench/results/engine")) / "engine_speed.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {"model": cfg["_name_or_path"], "torch": torch.__version__,
                           "gpu": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
                           "steps": args.steps, "kv_fill": "random (no prefill)",
                           "stacks": {}}

    def log(s: str) -> None:
        print(s, flush=True)

    for s in stacks:
        try:
            if s == "hf":
                res["stacks"][s] = run_hf(cfg, dev, hf_points, args.steps, log,
                                          compile_step=dev.type == "cuda")
            else:
                res["stacks"][s] = run_engine_stack(s, cfg, dev, batches, contexts,
                                                    args.steps, args.prefill_len, backend, log)
        except Exception as e:
            res["stacks"][s] = {"stack": s, "points": [],
                                "error": f"{type(e).__name__}: {e}"[:500]}
            log(f"{s}: {res['stacks'][s]['error']}")
        out.write_text(json.dumps(res, indent=1, default=str))
    print(table(res))
    errors = [s for s, r in res["stacks"].items() if "error" in r or
              any("error" in p for p in r["points"])]
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
