"""How accurate is the pre-summed fold ("presum", issue 20 section 1)? CPU only, no kernel.

presum: Y = fp16(X_hat + R_hat) W_hat^T, one product (resgen.reference.linear(...,
fold="presum"), the numerics in resgen.formats.presum_fp16); the exact fold is the two-product
form Blackwell computes (resgen.reference.linear, fold "exact"). Measured here:

1. layer outputs, random heavy-tailed activations on Qwen3-8B shapes (M = 32): the relative
   error ||presum - exact|| / ||exact|| in float64, and of the BF16-rounded presum output (what
   a kernel's check would see) against the 3e-3 the kernels are held to; M-Ext ("full") and
   K-Ext 0.125 / 0.25 / 0.5; NVFP4 (dynamic and static scale) and MXFP4;
2. the same on the real activations of SmolLM2-135M (the quality study's captured inputs of
   every decoder projection, 512 held-out rows each), with each layer's output NMSE against
   the FP32 layer for both folds;
3. perplexity of the whole model under both folds (the quality study's calibration and
   held-out windows), with the paired per-window difference and its standard error: the noise
   band is 2 standard errors of the paired mean NLL difference over the held-out windows;
4. the ResAttn query analogue (reference.decode_attention(..., fold="presum")) on random
   queries and NVFP4 KV, Qwen3-8B geometry, against the attention family's tolerance.

    python bench/presum_accuracy.py [--quick] [--parts random,attention,smollm2]
        [--out bench/results/quality/presum_accuracy.json]

writes the JSON (--parts: only those parts, replacing them in an existing file; each part
records the command that produced it) and prints a short table last. --quick: smaller shapes
and the quality study's smoke-test size (a CPU test runs it).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from resgen import calibrate as C  # noqa: E402
from resgen import reference as R  # noqa: E402

TOLERANCE = 3e-3            # the linear kernels' check (resgen.search.sm90_linear.TOLERANCE)
COMPS = ("full", 0.125, 0.25, 0.5)
PPL_COMPS = ("full", 0.125, 0.5)        # perplexity: M-Ext and the K-Ext ends (CPU time)
# Qwen3-8B's projection shapes with distinct (N, K); gate_up (24576 x 4096) has qkv's K and
# would only repeat a random 4096-deep layer at four times the CPU cost
QWEN3_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "down": (4096, 12288)}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _heavy(m: int, k: int, g: torch.Generator) -> torch.Tensor:
    """Activations with per-channel scales spread over e^N(0, 1) and a few 30x outliers."""
    x = torch.randn(m, k, generator=g) * torch.exp(torch.randn(1, k, generator=g))
    out = torch.randint(0, k, (max(1, k // 256),), generator=g)
    x[:, out] *= 30
    return x


def _weight(n: int, k: int, fmt: str, g: torch.Generator, ratio, xcal, static: bool):
    w = torch.randn(n, k, generator=g) * torch.exp(0.5 * torch.randn(n, 1, generator=g)) / k ** .5
    sel = None
    if ratio is not None:
        st = C.ChannelStats(k)
        st.update(xcal)
        sel = C.select_channels(st.mean_abs(), ratio)
    isc = (xcal.abs().amax() / 2688).reshape(()) if fmt == "nvfp4" and static else None
    return C.prepare_weight(w, fmt, sel, input_scale=isc), w


def layer_errors(x: torch.Tensor, qw, w: torch.Tensor, comp, plain: bool = True) -> dict:
    """Both folds on x against each other and against the FP32 layer x W^T (and plain W4A4
    against it where `plain`)."""
    exact = R.linear(x, qw, comp)
    pre = R.linear(x, qw, comp, fold="presum")
    truth = x.double() @ w.double().T
    out = {"rel_presum_vs_exact": _rel(pre, exact),
           "rel_bf16_presum_vs_exact": _rel(pre.to(torch.bfloat16), exact),
           "rel_bf16_exact_vs_exact": _rel(exact.to(torch.bfloat16), exact),
           "nmse_exact": R.nmse(exact.double(), truth),
           "nmse_presum": R.nmse(pre.double(), truth)}
    if plain:
        out["nmse_plain"] = R.nmse(R.linear(x, qw, "none").double(), truth)
    return out


def random_layers(quick: bool, seed: int = 0) -> list[dict]:
    shapes = {"small": (512, 1024)} if quick else QWEN3_8B
    m = 8 if quick else 32
    out = []
    for fmt, static in (("nvfp4", False), ("nvfp4", True), ("mxfp4", False)):
        for j, (name, (n, k)) in enumerate(shapes.items()):
            g = torch.Generator().manual_seed(seed + 1000 * j + n + k)
            xcal = _heavy(64, k, g)
            for comp in COMPS:
                qw, w = _weight(n, k, fmt, g, None if comp == "full" else comp, xcal, static)
                x = _heavy(m, k, g)
                rec = {"fmt": fmt, "static_scale": static, "shape": name, "n": n, "k": k,
                       "m": m, "comp": comp, **layer_errors(x, qw, w, comp)}
                out.append(rec)
                print(f"random {fmt}{' static' if static else ''} {name} {comp}: "
                      f"presum/exact {rec['rel_presum_vs_exact']:.2e}", flush=True)
    return out


# ----------------------------------------------------------------------------- SmolLM2


class _PresumStudy:
    """The quality study with FakeQuantLinear's fold chosen per evaluation."""

    def __init__(self, quick: bool, log=print, **sizes: int):
        import dataclasses

        from resgen.quality.study import Study, StudyConfig

        cfg = StudyConfig.quick() if quick else StudyConfig()
        cfg = dataclasses.replace(cfg, **{k: v for k, v in sizes.items() if v})
        self.study = Study(cfg, log=log)
        self.cfg = cfg

    def modules(self, m, fold: str) -> dict:
        from resgen.quality.fakequant import FakeQuantLinear
        from resgen.quality.study import Method

        st = self.study
        out = {}
        for name in st.weight:
            comp = {0.0: "none", 1.0: "full"}.get(m.comp, m.comp)
            out[name] = FakeQuantLinear(st.qweight(name, m, comp), comp, st.bias.get(name),
                                        fold=fold if comp not in ("none", "w4a16") else "exact")
        assert isinstance(m, Method)
        return out

    @torch.no_grad()
    def window_nll(self, mods: dict | None) -> list[float]:
        """Mean next-token NLL (nats) of every held-out window under the given modules (the
        quality study's perplexity, kept per window for the paired noise estimate)."""
        import torch.nn.functional as TF

        from resgen.quality.model import replace_linears

        st = self.study
        seqs, b = st.split.eval, st.config.batch
        old = replace_linears(st.model, mods) if mods is not None else None
        out: list[float] = []
        try:
            for i in range(0, seqs.shape[0], b):
                ids = seqs[i: i + b]
                logits = st.model(input_ids=ids, use_cache=False).logits[:, :-1].float()
                nll = TF.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                       ids[:, 1:].reshape(-1), reduction="none")
                out += nll.double().reshape(ids.shape[0], -1).mean(1).tolist()
        finally:
            if old is not None:
                replace_linears(st.model, old)
        return out


def smollm2(quick: bool, **sizes: int) -> dict:
    """sizes: StudyConfig fields to override (seq_len, n_calib, n_eval)."""
    from resgen.quality.capture import site_of
    from resgen.quality.study import Method

    t0 = time.time()

    def say(what: str) -> None:
        print(f"[{time.time() - t0:7.1f} s] smollm2 {what}", flush=True)

    ps = _PresumStudy(quick, **sizes)
    st = ps.study
    res: dict = {"model": "SmolLM2-135M", "config": dict(st.config.__dict__),
                 "layers": len(st.weight), "load_s": round(time.time() - t0, 1),
                 "noise": "paired: per held-out window, NLL(presum) - NLL(exact); within "
                          "noise when |mean| <= 2 standard errors of that mean"}
    say("loaded and calibrated")
    ref_nll = ps.window_nll(None)
    res["ref"] = {"ppl": math.exp(statistics.fmean(ref_nll)), "window_nll": ref_nll}
    layer_recs, ppl_recs = [], []
    for fmt in ("nvfp4", "mxfp4"):
        plain = ps.window_nll(ps.modules(Method(fmt, "none"), "exact"))
        w16 = ps.window_nll(ps.modules(Method(fmt, "w4a16"), "exact"))
        ppl_recs.append({"fmt": fmt, "comp": "none", "fold": "exact",
                         "ppl": math.exp(statistics.fmean(plain)), "window_nll": plain})
        ppl_recs.append({"fmt": fmt, "comp": "w4a16", "fold": "exact",
                         "ppl": math.exp(statistics.fmean(w16)), "window_nll": w16})
        say(f"{fmt} plain and w4a16 perplexity")
        for comp in COMPS:
            m = Method(fmt, comp)
            # layer outputs on the captured inputs, through the reference (float64)
            rels, rels16, n_ex, n_pre = [], [], [], []
            for name in st.weight:
                qw = st.qweight(name, m, comp)
                x = st.nmse_inputs[site_of(name)]
                e = layer_errors(x, qw, st.weight[name], comp, plain=False)
                rels.append(e["rel_presum_vs_exact"])
                rels16.append(e["rel_bf16_presum_vs_exact"])
                n_ex.append(e["nmse_exact"])
                n_pre.append(e["nmse_presum"])
            layer_recs.append({
                "fmt": fmt, "comp": comp, "layers": len(rels),
                "rel_presum_vs_exact_max": max(rels),
                "rel_presum_vs_exact_median": statistics.median(rels),
                "rel_bf16_presum_vs_exact_max": max(rels16),
                "layers_over_tolerance_bf16": sum(r > TOLERANCE for r in rels16),
                "mean_nmse_exact": statistics.fmean(n_ex),
                "mean_nmse_presum": statistics.fmean(n_pre),
                "mean_nmse_ratio_presum_over_exact": statistics.fmean(
                    p / e for p, e in zip(n_pre, n_ex))})
            say(f"{fmt} {comp}: layers presum/exact max {max(rels):.2e}, NMSE ratio "
                f"{layer_recs[-1]['mean_nmse_ratio_presum_over_exact']:.4f}")
            if comp not in PPL_COMPS:
                continue
            nll = {fold: ps.window_nll(ps.modules(m, fold)) for fold in ("exact", "presum")}
            d = [b - a for a, b in zip(nll["exact"], nll["presum"])]
            se = statistics.stdev(d) / math.sqrt(len(d)) if len(d) > 1 else float("nan")
            for fold in ("exact", "presum"):
                ppl_recs.append({"fmt": fmt, "comp": comp, "fold": fold,
                                 "ppl": math.exp(statistics.fmean(nll[fold])),
                                 "window_nll": nll[fold]})
            ppl_recs[-1]["paired_dnll_mean"] = statistics.fmean(d)
            ppl_recs[-1]["paired_dnll_se"] = se
            ppl_recs[-1]["within_noise"] = abs(statistics.fmean(d)) <= 2 * se
            say(f"{fmt} {comp}: ppl {ppl_recs[-2]['ppl']:.3f} -> {ppl_recs[-1]['ppl']:.3f}")
    res["layer_outputs"] = layer_recs
    res["perplexity"] = ppl_recs
    res["seconds"] = round(time.time() - t0, 1)
    return res


# ----------------------------------------------------------------------------- attention


def attention(quick: bool, seed: int = 0) -> list[dict]:
    from resgen.kvcache import PagedKVCache
    from resgen.search.attention_sm90 import TOLERANCE as ATOL

    hq, hkv, d = (8, 2, 64) if quick else (32, 8, 128)
    lens = [256, 40] if quick else [4096, 1000, 17, 2048]
    out = []
    for qscale in (1.0, 8.0):
        g = torch.Generator().manual_seed(seed)
        ks = [torch.randn(hkv, n, d, generator=g) for n in lens]
        vs = [torch.randn(hkv, n, d, generator=g) for n in lens]
        cache, bt, sl = PagedKVCache.from_dense(ks, vs, page_size=32)
        q = _heavy(len(lens) * hq, d, g).reshape(len(lens), hq, d) * qscale
        exact = R.decode_attention(q, cache, bt, sl)
        pre = R.decode_attention(q, cache, bt, sl, fold="presum")
        plain = R.decode_attention(q, cache, bt, sl, compensation=False)
        truth = R.attention_fp32(q, ks, vs)
        out.append({"q_heads": hq, "kv_heads": hkv, "head_dim": d, "lens": lens,
                    "query_scale": qscale, "tolerance_f16": ATOL["f16"],
                    "rel_presum_vs_exact": _rel(pre, exact),
                    "rel_plain_vs_exact": _rel(plain, exact),
                    "nmse_exact": R.nmse(exact.double(), truth.double()),
                    "nmse_presum": R.nmse(pre.double(), truth.double()),
                    "nmse_plain": R.nmse(plain.double(), truth.double())})
    return out


# ----------------------------------------------------------------------------- main


def summary(res: dict) -> str:
    lines = ["| part | fmt | comp | presum vs exact (max rel) | bf16(presum) vs exact "
             "(max rel; check 3e-3) | NMSE presum / exact | ppl exact -> presum "
             "(paired dNLL +- SE) |", "|---|---|---|---:|---:|---:|---|"]
    rnd = res.get("random", [])
    for fmt, static in (("nvfp4", False), ("nvfp4", True), ("mxfp4", False)):
        for comp in COMPS:
            rs = [r for r in rnd if r["fmt"] == fmt and r["static_scale"] == static
                  and r["comp"] == comp]
            if not rs:
                continue
            ratio = statistics.fmean(r["nmse_presum"] / r["nmse_exact"] for r in rs)
            lines.append(f"| random | {fmt}{' static' if static else ''} | {comp} | "
                         f"{max(r['rel_presum_vs_exact'] for r in rs):.2e} | "
                         f"{max(r['rel_bf16_presum_vs_exact'] for r in rs):.2e} | "
                         f"{ratio:.4f} | - |")
    sm = res.get("smollm2")
    if sm:
        for lr in sm["layer_outputs"]:
            pp = {p["fold"]: p for p in sm["perplexity"]
                  if p["fmt"] == lr["fmt"] and p["comp"] == lr["comp"]}
            ppl = "-"
            if "presum" in pp:
                pe, pr = pp["exact"], pp["presum"]
                ppl = (f"{pe['ppl']:.3f} -> {pr['ppl']:.3f} ({pr['paired_dnll_mean']:+.1e} "
                       f"+- {pr['paired_dnll_se']:.1e})")
            lines.append(f"| SmolLM2 | {lr['fmt']} | {lr['comp']} | "
                         f"{lr['rel_presum_vs_exact_max']:.2e} | "
                         f"{lr['rel_bf16_presum_vs_exact_max']:.2e} | "
                         f"{lr['mean_nmse_ratio_presum_over_exact']:.4f} | {ppl} |")
    for a in res.get("attention", []):
        lines.append(f"| attention q x{a['query_scale']:g} | nvfp4 | ResAttn | "
                     f"{a['rel_presum_vs_exact']:.2e} | - (tol {a['tolerance_f16']}) | "
                     f"{a['nmse_presum'] / a['nmse_exact']:.4f} | - |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--parts", default="random,attention,smollm2")
    p.add_argument("--seq-len", type=int, default=0, help="SmolLM2: window length (default: "
                   "the quality study's 512)")
    p.add_argument("--calib-seqs", type=int, default=0, help="SmolLM2: calibration windows")
    p.add_argument("--eval-seqs", type=int, default=0, help="SmolLM2: held-out windows")
    p.add_argument("--out", type=Path, default=ROOT / "bench/results/quality/presum_accuracy.json")
    a = p.parse_args(argv)
    parts = [x for x in a.parts.split(",") if x]
    sizes = {"seq_len": a.seq_len, "n_calib": a.calib_seqs, "n_eval": a.eval_seqs}
    run = {"random": random_layers, "attention": attention,
           "smollm2": lambda quick: smollm2(quick, **sizes)}
    if not parts or set(parts) - set(run):
        print(f"presum_accuracy: --parts from {sorted(run)}", file=sys.stderr)
        return 2
    res: dict = {}
    if a.out.exists() and set(parts) != set(run):
        res = json.loads(a.out.read_text())
    res.update({"what": "presum fold vs the exact fold (issue 20 section 1), CPU, float64 "
                        "reference arithmetic", "tolerance": TOLERANCE})
    cmd = "python bench/presum_accuracy.py" + (" --quick" if a.quick else "") + \
        f" --parts {','.join(parts)}" + "".join(
            f" --{flag} {v}" for flag, v in (("seq-len", a.seq_len), ("calib-seqs", a.calib_seqs),
                                              ("eval-seqs", a.eval_seqs)) if v)
    for part in parts:
        t0 = time.time()
        out = run[part](a.quick)
        res[part] = out
        res.setdefault("provenance", {})[part] = {
            "command": cmd, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "host": platform.node(), "torch": torch.__version__,
            "seconds": round(time.time() - t0, 1)}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=1))
    print(summary(res))
    print(f"-> {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
