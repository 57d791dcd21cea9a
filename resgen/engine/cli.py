"""`resgen generate`: stream a completion to the terminal.

    resgen generate --model <hf dir | .gguf> --prompt "..." [--prompt ...] [--chat]
        [--max-new-tokens 128] [--temperature 0] [--top-p 1] [--seed S] [--stop TEXT]
        [--fmt nvfp4|mxfp4|bf16] [--compensation none|full|0.125|...] [--kext-fold exact|presum]
        [--kv nvfp4|bf16]
        [--attn resattn|plain|q16] [--calib text-file | calibration.safetensors]
        [--backend cuda|sim|reference] [--max-batch N] [--max-seq-len N] [--kv-budget 4G]

One prompt streams its tokens as they arrive; several are generated as one batch and printed
in order. The last line gives prefill and decode tokens per second and the time to the first
token. Bad input (a missing model, an unknown option value, a request that does not fit the
KV cache) is one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ..argtypes import positive_int

__all__ = ["add_parser", "run", "parse_bytes"]

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_bytes(text: str) -> int:
    """'4G', '512M', '1.5G', '1000000' -> bytes (binary units; a trailing B / iB is fine)."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = t[-1:] if t[-1:] in _UNITS and not t[-1:].isdigit() else ""
    num = t[: len(t) - len(unit)]
    try:
        v = float(num)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 4G or 512M") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive size")
    return int(v * _UNITS[unit])




def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the `generate` subcommand to a subparsers object."""
    g = subparsers.add_parser("generate", help="generate text from a checkpoint on resgen's "
                              "kernels (streams tokens)",
                              description=__doc__.split("\n\n")[0])
    g.add_argument("--model", required=True, help="Hugging Face folder or .gguf file")
    g.add_argument("--prompt", action="append", required=True,
                   help="prompt text (repeat for a batch)")
    g.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")
    g.add_argument("--max-new-tokens", type=positive_int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=None, help="stop text (repeatable)")
    g.add_argument("--fmt", choices=("nvfp4", "mxfp4", "bf16"), default="nvfp4")
    g.add_argument("--compensation", default="full",
                   help="none | full | w4a16 (FP4 weights, BF16 activations: the Hopper "
                        "mode) | a K-Ext ratio (0.125, 0.25, 0.5, 1.0)")
    g.add_argument("--kext-fold", choices=("exact", "presum"), default="exact",
                   help="K-Ext layers: exact (extension columns, Blackwell's numerics) or "
                        "presum (residues onto their base channels, one FP16 GEMM: K-Ext at "
                        "plain cost on Hopper, NVFP4)")
    g.add_argument("--kv", choices=("nvfp4", "bf16", "fp32"), default="nvfp4")
    g.add_argument("--attn", choices=("resattn", "plain", "q16"), default=None,
                   help="decode attention over the NVFP4 KV cache (default: q16 with "
                        "--compensation w4a16, else resattn)")
    g.add_argument("--calib", default=None,
                   help="calibration text file, or a .safetensors calibration file")
    g.add_argument("--backend", choices=("cuda", "sim", "reference"), default=None,
                   help="default: cuda with a GPU, else reference (CPU)")
    g.add_argument("--max-batch", type=positive_int, default=None)
    g.add_argument("--max-seq-len", type=positive_int, default=None)
    g.add_argument("--kv-budget", type=parse_bytes, default=None,
                   help="KV cache size (e.g. 4G); default: 60%% of free GPU memory")
    g.add_argument("--no-graphs", action="store_true", help="run decode steps eagerly")
    g.add_argument("--compile", choices=("none", "glue"), default=None,
                   help="glue: the torch glue between the kernels through torch.compile "
                        "(fused; compiled on the first step of each batch size); none: "
                        "eager glue; default: glue on a GPU, none on the CPU backends")
    return g


def _calib(path: str | None) -> Any:
    if path is None:
        return None
    from pathlib import Path

    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{p}: no such calibration file")
    if p.suffix == ".safetensors":
        return str(p)
    import gzip

    opener = gzip.open if p.suffix == ".gz" else open
    with opener(p, "rt", encoding="utf-8", errors="replace") as f:
        return f.read()


class _Printer:
    """Streams one sequence's text: decodes all its tokens and prints what is new."""

    def __init__(self, tok: Any, out: Any) -> None:
        self.tok, self.out, self.ids, self.shown = tok, out, [], ""

    def __call__(self, i: int, t: int) -> None:
        self.ids.append(t)
        if self.tok is None:
            self.out.write(f"{t} ")
        else:
            text = self.tok.decode(self.ids, skip_special_tokens=True)
            if text.startswith(self.shown):
                self.out.write(text[len(self.shown):])
                self.shown = text
        self.out.flush()


def run(args: argparse.Namespace) -> int:
    """Run `resgen generate` (exit code: 0, or 2 on bad input with one line on stderr)."""
    try:
        return _run(args)
    except (FileNotFoundError, ValueError, TypeError, KeyError, ImportError,
            NotImplementedError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"resgen generate: error: {msg}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        print(f"resgen generate: error: {e}".splitlines()[0], file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    import torch

    from .llm import load

    if not 0 < args.top_p <= 1:
        raise ValueError(f"--top-p must lie in (0, 1], got {args.top_p}")
    if not args.temperature >= 0:
        raise ValueError(f"--temperature must be >= 0, got {args.temperature}")
    backend = args.backend or ("cuda" if torch.cuda.is_available() else "reference")
    n = len(args.prompt)
    kw: dict[str, Any] = {"max_batch": args.max_batch or max(1, n)}
    if args.max_seq_len is not None:
        kw["max_seq_len"] = args.max_seq_len
    if args.kv_budget is not None:
        kw["kv_budget"] = args.kv_budget
    llm = load(args.model, compensation=args.compensation, kext_fold=args.kext_fold,
               kv=args.kv, fmt=args.fmt,
               attn=args.attn, calib=_calib(args.calib), backend=backend,
               graphs=not args.no_graphs, compile=args.compile, **kw)
    out = sys.stdout
    info = llm.kv_info()
    header = (f"# {llm.cfg.name} ({llm.cfg.family}, {llm.cfg.layers} layers) on {backend}: "
              f"fmt {args.fmt}, compensation {args.compensation}, KV {info['kind']} "
              f"{info['bytes_per_token']} B/token (BF16 {info['bf16_bytes_per_token']}), "
              f"{info['capacity_tokens']} tokens")
    stream = _Printer(llm.tokenizer, out) if n == 1 else None
    res = llm.generate(args.prompt if n > 1 else args.prompt[0],
                       max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                       top_p=args.top_p, stop=args.stop, seed=args.seed, chat=args.chat,
                       on_token=stream)
    if stream is not None:
        if res[0].text is not None and res[0].text.startswith(stream.shown):
            out.write(res[0].text[len(stream.shown):])      # what a stop string kept back
        out.write("\n")
    else:
        for i, r in enumerate(res):
            out.write(f"--- prompt {i} ({r.finish_reason})\n")
            out.write((r.text if r.text is not None else " ".join(map(str, r.token_ids)))
                      + "\n")
    print(header, file=sys.stderr)
    s = llm.last_stats
    ttft = s["ttft_s"] * 1e3 if s["ttft_s"] is not None else float("nan")
    print(f"prefill: {s['prefill_tokens']} tokens, {s['prefill_tok_s']:.1f} tok/s; decode: "
          f"{s['decode_tokens']} tokens, {s['decode_tok_s']:.1f} tok/s; time to first token "
          f"{ttft:.1f} ms", file=out)
    return 0
