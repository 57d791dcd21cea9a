"""Does linear_sm90_wgmma with one producer warp (variant axis producer = "warp": one consumer
warpgroup, then one producer warp, 160 threads, so 4-5 CTAs fit an SM where the warpgroup
producer's 256 threads allow 2-3) beat the table's layers at serving M? Session 37's SASS
ledger (ncu_sass_wgmma_s37) puts the consumer warps of the M = 64-128 GEMMs at 51-60 % of their
samples in the FP4 decode and 18-24 % in mbarrier waits, with 1-2 warps per scheduler: latency
that more resident consumer warpgroups could hide. NVFP4 plain, Qwen3-8B's four projections,
whole layers under the tuner's policy (resgen.cli.time_layer through
bench/probes/layer_probe.py: compiled, checked against the reference on fresh inputs into a
poisoned output, and only then timed), per (M, shape):
  "table":  what the runtime dispatches from the shipped table ("table_exact": the table's own
            row for the M; a stale fingerprint makes the runtime fall back to a smaller
            bucket's row, which the summary does not compare against);
  "twin":   the table's linear_sm90_wgmma variant with one consumer warpgroup (its own tiles
            where it has one, else half the channel tile, twice the CTAs, and the same channel
            tile on one warpgroup, m_wg doubled) and the producer warp, at its own stages and
            at 3 / 4 / 6 / 8 stages (more CTAs per SM may want a shallower ring);
  "pw":     where the table serves linear_sm90_mma: one-consumer producer-warp wgmma tiles
            covering the rows (bn 16 / 32 / 64), 4 and 8 stages, split-K 1 / 2 / 4.
On the H200, one device call (carry .devcache):

    source .devcache/device/env.sh && RESGEN_CACHE_DIR=/tmp/resgen-cache \\
        timeout -k 5 -s INT 200 python3 bench/probes/producer_probe.py    # JSON to $OUT

PP_MS (default 16,32,64,128) and PP_MODELS (default qwen3-8b) restrict it; no case starts
after --budget-s seconds (default 170). $OUT/producer_probe.json: layer_probe's rows (plus
model, m, layer, config) rewritten after each variant, then "summary": per (model, M, layer)
the table's time and the best producer-warp time (+ variant), and per (model, M) the
four-shape sums where both were timed."""

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
from resgen.search.linear_sm90_wgmma import (FAMILY, LinearSm90WgmmaVariant,  # noqa: E402
                                             Producer)
from resgen.search.variant import LinearProblem  # noqa: E402

ARCH = "sm_90a"
MODELS = tuple(os.environ.get("PP_MODELS", "qwen3-8b").split(","))
MS = tuple(int(m) for m in os.environ.get("PP_MS", "16,32,64,128").split(","))
STAGES = (3, 4, 6, 8)


def candidates(p: LinearProblem, table: Any) -> list[tuple[str, LinearSm90WgmmaVariant]]:
    """The producer-warp candidates for p (deduplicated, every one valid)."""
    out: list[tuple[str, LinearSm90WgmmaVariant]] = []
    if isinstance(table, LinearSm90WgmmaVariant):
        # one consumer warpgroup: its own tiles, or for a two-consumer winner half the channel
        # tile (twice the CTAs) and the same channel tile on one warpgroup (m_wg doubled)
        mws = [table.m_wg] if table.consumers == 1 else [table.m_wg, 2 * table.m_wg]
        for mw in mws:
            base = replace(table, producer=Producer.WARP, consumers=1, m_wg=mw)
            for st in dict.fromkeys((table.stages,) + STAGES):
                out.append(("twin", replace(base, stages=st)))
    else:
        bn = 16
        while bn < min(p.rows, 64):
            bn *= 2
        for st in (4, 8):
            for sk in (1, 2, 4):
                out.append(("pw", LinearSm90WgmmaVariant(1, 1, bn, st, split_k=sk,
                                                         producer=Producer.WARP)))
    seen: set = set()
    keep = []
    for cfg, v in out:
        if v not in seen and FAMILY.why_invalid(v, p, ARCH) is None:
            seen.add(v)
            keep.append((cfg, v))
    return keep


def plan(lookup: Callable[[LinearProblem], tuple[Any, str]]) -> Iterator[tuple]:
    """layer_probe cases (problem, family, variant, extra) per (model, M, shape): the table's
    dispatched variant, then the producer-warp candidates."""
    from resgen.search.family import get_family

    for model in MODELS:
        for m in MS:
            for shape in get_model(model).linear_shapes():
                p = LinearProblem("nvfp4", "none", m, shape.n, shape.k)
                base = {"model": model, "m": m, "layer": shape.name}
                tv, src = lookup(p)
                # the table's own row for this M (not a smaller bucket's or the default,
                # which is what the runtime serves when the row's fingerprint is stale)
                exact = f"bucket {{'m': {m}}}" in src
                yield p, get_family(type(tv).FAMILY), tv, {**base, "config": "table",
                                                            "source": src,
                                                            "table_exact": exact}
                for cfg, v in candidates(p, tv):
                    yield p, FAMILY, v, {**base, "config": cfg, "source": "pinned"}


def summary(rows: list[dict]) -> dict:
    """{"layers": per (model, M, layer) the table's us (only from the table's own row for
    that M: "table_exact") and the best producer-warp us (+ variant, pw / table), "sums": per
    (model, M) both four-shape sums and the sum of per-layer minima where every layer had
    both}."""
    layers = []
    for key in dict.fromkeys((r.get("model"), r.get("m"), r.get("layer")) for r in rows):
        sel = [r for r in rows if (r.get("model"), r.get("m"), r.get("layer")) == key
               and r.get("ok") and r.get("us")]
        table = [r for r in sel if r["config"] == "table" and r.get("table_exact")]
        pw = sorted((r for r in sel if r["config"] != "table"), key=lambda r: r["us"])
        rec: dict[str, Any] = {"model": key[0], "m": key[1], "layer": key[2],
                               "table_us": table[0]["us"] if table else None,
                               "table_variant": table[0]["variant"] if table else None,
                               "pw_us": pw[0]["us"] if pw else None,
                               "pw_variant": pw[0]["variant"] if pw else None}
        if rec["table_us"] and rec["pw_us"]:
            rec["pw_over_table"] = rec["pw_us"] / rec["table_us"]
        layers.append(rec)
    sums = []
    for model, m in dict.fromkeys((r["model"], r["m"]) for r in layers):
        sel = [r for r in layers if (r["model"], r["m"]) == (model, m)]
        if len(sel) == 4 and all(r["table_us"] and r["pw_us"] for r in sel):
            t = sum(r["table_us"] for r in sel)
            best = sum(min(r["table_us"], r["pw_us"]) for r in sel)
            sums.append({"model": model, "m": m, "table_us": t,
                         "pw_us": sum(r["pw_us"] for r in sel), "best_us": best,
                         "best_over_table": best / t})
    return {"layers": layers, "sums": sums}


def table(s: dict) -> list[str]:
    """The short table printed last."""
    cell = layer_probe.cell
    out = [f"{'model':9s} {'M':>3s} {'layer':8s} {'table':>8s} {'pw':>8s} {'pw/table':>8s}"
           "  best producer-warp variant"]

    for r in s["layers"]:
        ratio = cell(r.get("pw_over_table"), 8, 3)
        out.append(f"{r['model']:9s} {r['m']:3d} {r['layer']:8s} {cell(r['table_us'])} "
                   f"{cell(r['pw_us'])} {ratio}  {(r['pw_variant'] or '')[18:]}")
    for t in s["sums"]:
        out.append(f"{t['model']} M={t['m']}: sums table {t['table_us']:.2f} us, producer "
                   f"warp {t['pw_us']:.2f}, per-layer best {t['best_us']:.2f} "
                   f"({t['best_over_table']:.3f}x table)")
    return out


def main(argv: list[str] | None = None) -> int:
    return layer_probe.run_dispatched_probe(
        "producer_probe", __doc__, argv, 170.0, plan,
        tag=lambda rec: f"{rec['model']} m{rec['m']} {rec['config']:5s} ",
        summary=summary, table=table)


if __name__ == "__main__":
    sys.exit(main())
