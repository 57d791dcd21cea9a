"""Does linear_sm90_mma's fused activation prologue (each CTA quantizes its K range of the BF16
rows itself: one launch, no layer quantizer) beat the table's winners at M = 16 / 32? The
family's prior ranks fused variants last above 8 operand rows (+3.0), so with about 7 variants
timed per workload the tuner rarely reached them there; at M = 16 the separate quantizer costs
2.8-3.1 us per layer under Nsight Compute (ncu_limits_s35_m16.md), 11.6 us of Qwen3-8B's
four-layer sum. NVFP4 plain, whole layers under the tuner's policy (resgen.cli.time_layer
through bench/probes/layer_probe.py: compiled, checked against the reference on fresh inputs
into a poisoned output, and only then timed, CUDA graph over cold-L2 rotated input sets), per
(model, M, shape):
  "table":   what the runtime dispatches from the shipped table;
  "m4twin":  the shipped table's fused winner at M = 4 (else M = 1) for the shape, with its
             token tile widened to cover the rows (n_tiles = the rows' n8 count, and half of
             it: two z tiles), where valid ("m1twin" when it is the M = 1 winner);
  "m4xop":   the same tiles reading the layer quantizer's operand instead (act xop, no
             cluster), PDL off and on: is it the prologue or the tiles that lose;
  "priorN":  the space's first fused variants by the family's prior (FSP_PRIOR of them).
On the H200, one device call (carry .devcache):

    source .devcache/device/env.sh && RESGEN_CACHE_DIR=/tmp/resgen-cache \\
        timeout -k 5 -s INT 300 python3 bench/probes/fused_serving_probe.py    # JSON to $OUT

FSP_MODELS (default qwen3-8b,qwen3-4b,qwen3-32b), FSP_MS (default 16,32) and FSP_PRIOR
(default 6) restrict it; no case starts after --budget-s seconds (default 240; Qwen3-8B
M = 16 first). $OUT/fused_serving_probe.json: layer_probe's rows (plus model, m, layer,
config) rewritten after each variant, then "summary": per (model, M, layer) the table's and the
best fused time, and per (model, M) the four shapes' sums where both were timed."""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Iterator

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import layer_probe  # noqa: E402
from resgen.models import get_model  # noqa: E402
from resgen.search.linear_sm90_mma import FAMILY, Act, LinearSm90Variant  # noqa: E402
from resgen.search.variant import LinearProblem  # noqa: E402

ARCH = "sm_90a"
MODELS = tuple(os.environ.get("FSP_MODELS", "qwen3-8b,qwen3-4b,qwen3-32b").split(","))
MS = tuple(int(m) for m in os.environ.get("FSP_MS", "16,32").split(","))
N_PRIOR = int(os.environ.get("FSP_PRIOR", "6"))


def n8_tiles(rows: int) -> int:
    """The space's covering token tile: n8 tiles for `rows` operand rows (at most 8)."""
    t = 1
    while 8 * t < rows and t < 8:
        t *= 2
    return t


def fused_winners() -> dict[str, LinearSm90Variant]:
    """workload key -> the shipped table's fastest linear_sm90_mma variant where it is fused."""
    best = layer_probe.table_best([FAMILY.NAME])
    return {w: v for w, (_, _, v) in best.items() if getattr(v, "fused", False)}


def candidates(p: LinearProblem, winners: dict[str, LinearSm90Variant]
               ) -> list[tuple[str, LinearSm90Variant]]:
    """The candidates for p (deduplicated, every one valid): the M = 4 / 1 fused winner
    widened, its xop twins, then the prior's first N_PRIOR fused variants."""
    out: list[tuple[str, LinearSm90Variant]] = []
    for small in (4, 1):
        w = winners.get(LinearProblem(p.fmt, p.compensation, small, p.n, p.k).key())
        if w is None:
            continue
        nt = n8_tiles(p.rows)
        for t in dict.fromkeys((nt, max(1, nt // 2))):
            v = replace(w, n_tiles=t)
            if FAMILY.why_invalid(v, p, ARCH) is None:
                out.append(("m4twin" if small == 4 else "m1twin", v))
        for t in dict.fromkeys((nt, max(1, nt // 2))):
            for pdl in (False, True):
                v = replace(w, n_tiles=t, act=Act.XOP, cluster=1, pdl=pdl)
                if FAMILY.why_invalid(v, p, ARCH) is None:
                    out.append(("m4xop", v))
        break
    fused = sorted((v for v in FAMILY.space(p, ARCH) if v.act == Act.FUSED),
                   key=lambda v: FAMILY.prior(v, p))
    seen = {v for _, v in out}
    for i, v in enumerate([v for v in fused if v not in seen][:N_PRIOR]):
        out.append((f"prior{i + 1}", v))
    return out


def plan(lookup: Callable[[LinearProblem], tuple[Any, str]],
         winners: dict[str, LinearSm90Variant]) -> Iterator[tuple]:
    """layer_probe cases (problem, family, variant, extra) per (model, M, shape): the table's
    dispatched variant, then the fused candidates."""
    from resgen.search.family import get_family

    for model in MODELS:
        spec = get_model(model)
        for m in MS:
            for shape in spec.linear_shapes():
                p = LinearProblem("nvfp4", "none", m, shape.n, shape.k)
                base = {"model": model, "m": m, "layer": shape.name}
                tv, src = lookup(p)
                yield p, get_family(type(tv).FAMILY), tv, {**base, "config": "table",
                                                            "source": src}
                for cfg, v in candidates(p, winners):
                    if v != tv:
                        yield p, FAMILY, v, {**base, "config": cfg, "source": "pinned"}


def summary(rows: list[dict]) -> dict:
    """{"layers": per (model, M, layer) the table's us, the best fused us (+ variant, config,
    fused / table) and the best xop twin's us (+ variant), "sums": per (model, M) the table's
    and the fused four-shape sums where all were timed, and the sum of per-layer minima over
    all three}."""
    layers = []
    keys = list(dict.fromkeys((r.get("model"), r.get("m"), r.get("layer")) for r in rows))
    for model, m, layer in keys:
        sel = [r for r in rows if (r.get("model"), r.get("m"), r.get("layer")) ==
               (model, m, layer) and r.get("ok") and r.get("us")]
        table = [r["us"] for r in sel if r["config"] == "table"]
        fused = sorted((r for r in sel if r["config"] not in ("table", "m4xop")),
                       key=lambda r: r["us"])
        xop = sorted((r for r in sel if r["config"] == "m4xop"), key=lambda r: r["us"])
        rec: dict[str, Any] = {"model": model, "m": m, "layer": layer,
                               "table_us": table[0] if table else None,
                               "table_variant": next((r["variant"] for r in sel
                                                      if r["config"] == "table"), None),
                               "fused_us": fused[0]["us"] if fused else None,
                               "fused_variant": fused[0]["variant"] if fused else None,
                               "fused_config": fused[0]["config"] if fused else None,
                               "xop_us": xop[0]["us"] if xop else None,
                               "xop_variant": xop[0]["variant"] if xop else None}
        if rec["table_us"] and rec["fused_us"]:
            rec["fused_over_table"] = rec["fused_us"] / rec["table_us"]
        layers.append(rec)
    sums = []
    for model, m in dict.fromkeys((r["model"], r["m"]) for r in layers):
        sel = [r for r in layers if (r["model"], r["m"]) == (model, m)]
        if len(sel) == 4 and all(r["table_us"] and r["fused_us"] for r in sel):
            t = sum(r["table_us"] for r in sel)
            f = sum(r["fused_us"] for r in sel)
            best = sum(min(u for u in (r["table_us"], r["fused_us"], r["xop_us"]) if u)
                       for r in sel)
            sums.append({"model": model, "m": m, "table_us": t, "fused_us": f,
                         "best_us": best, "best_over_table": best / t})
    return {"layers": layers, "sums": sums}


def table(s: dict) -> list[str]:
    """The short table printed last."""
    cell = layer_probe.cell
    out = [f"{'model':9s} {'M':>3s} {'layer':8s} {'table':>8s} {'xop twin':>8s} {'fused':>8s} "
           f"{'f/table':>8s}  best fused"]

    for r in s["layers"]:
        ratio = cell(r.get("fused_over_table"), 8, 3)
        out.append(f"{r['model']:9s} {r['m']:3d} {r['layer']:8s} {cell(r['table_us'])} "
                   f"{cell(r['xop_us'])} {cell(r['fused_us'])} {ratio}  {r['fused_config'] or ''} "
                   f"{(r['fused_variant'] or '')[16:]}")
    for t in s["sums"]:
        out.append(f"{t['model']} M={t['m']}: sums table {t['table_us']:.2f} us, all fused "
                   f"{t['fused_us']:.2f}, per-layer best {t['best_us']:.2f} "
                   f"({t['best_over_table']:.3f}x table)")
    return out


def main(argv: list[str] | None = None) -> int:
    return layer_probe.run_dispatched_probe(
        "fused_serving_probe", __doc__, argv, 240.0, lambda lookup: plan(lookup, fused_winners()),
        tag=lambda rec: f"{rec['model']} m{rec['m']} {rec['config']:7s} ",
        summary=summary, table=table)


if __name__ == "__main__":
    sys.exit(main())
