"""Is fused W4A16 (linear_sm90_mma's fused variants with the copy prologue, issue 20: one
launch reading TOK activation rows) faster than plain W4A4 at decode M? Qwen3-8B's four
projections, NVFP4, M = 1, 4, 8, whole layers under the tuner's policy (resgen.cli.time_layer
through bench/probes/layer_probe.py: compiled, checked against the reference on fresh inputs
into a poisoned output, and only then timed, CUDA graph over cold-L2 rotated input sets), per
(M, shape):
  "plain":      what the runtime dispatches for plain W4A4 from the shipped table
                (resgen.runtime.Dispatcher lookup; its fused winners at these M);
  "w4a16_xop":  the W4A16 path before the copy prologue: what the runtime dispatches for the
                W4A16 workload if that is not fused, else the table's fastest xop variant of it
                (or of its plain twin);
  "w4a16_fused" (config "twin"): the plain winner's variant itself on W4A16, where it is a
                fused linear_sm90_mma variant valid for W4A16 (the same tiles, copy instead of
                quantization); (configs "prior1", "prior2"): the W4A16 space's first two fused
                variants by the family's prior (what the tuner times first).
On the H200, one device call of about 2 minutes (carry .devcache):

    source .devcache/device/env.sh && RESGEN_CACHE_DIR=/tmp/resgen-cache \\
        timeout -k 5 -s INT 170 python3 bench/probes/w4a16_fused_probe.py    # JSON to $OUT

No case starts after --budget-s seconds (default 110; M = 1 first, so a cut-short run keeps
the issue's case). $OUT/w4a16_fused_probe.json: layer_probe's rows (plus m, role,
config, source) rewritten after each variant, then "summary": per M and shape the plain, W4A16
xop and best fused W4A16 times, and per M the four shapes' sums where all three were timed."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable, Iterator

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import layer_probe  # noqa: E402
from resgen.search.linear_sm90_mma import FAMILY, LinearSm90Variant  # noqa: E402
from resgen.search.variant import LinearProblem  # noqa: E402

ARCH = "sm_90a"
SHAPES = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]   # Qwen3-8B, TP1
NAMES = {(6144, 4096): "qkv", (4096, 4096): "o", (24576, 4096): "gate_up",
         (4096, 12288): "down"}
MS = (1, 4, 8)


def xop_winners() -> dict[str, LinearSm90Variant]:
    """workload key -> the shipped table's fastest linear_sm90_mma xop variant."""
    return layer_probe.table_xop_winners(FAMILY)


def plan(lookup: Callable[[LinearProblem], tuple[Any, str]],
         winners: dict[str, LinearSm90Variant]) -> Iterator[tuple]:
    """layer_probe cases (problem, family, variant, extra) per (M, shape): plain, W4A16 xop,
    then the fused W4A16 candidates (deduplicated). lookup(problem) -> (variant, source)."""
    from resgen.search.family import get_family

    for m in MS:
        for n, k in SHAPES:
            plain = LinearProblem("nvfp4", "none", m, n, k)
            w16 = LinearProblem("nvfp4", "w4a16", m, n, k)
            base = {"m": m, "layer": NAMES[(n, k)]}
            pv, psrc = lookup(plain)
            yield plain, get_family(type(pv).FAMILY), pv, {**base, "role": "plain",
                                                           "config": "table", "source": psrc}
            xv, xsrc = lookup(w16)
            if getattr(xv, "fused", False):
                xv = winners.get(w16.key()) or winners.get(plain.key()) or \
                    FAMILY.default(w16, ARCH)
                xsrc = "table xop"
            yield w16, get_family(type(xv).FAMILY), xv, {**base, "role": "w4a16_xop",
                                                         "config": "table", "source": xsrc}
            cands: list[tuple[str, LinearSm90Variant]] = []
            if isinstance(pv, LinearSm90Variant) and pv.fused and \
                    FAMILY.why_invalid(pv, w16, ARCH) is None:
                cands.append(("twin", pv))
            fused = sorted((v for v in FAMILY.space(w16, ARCH) if v.fused),
                           key=lambda v: FAMILY.prior(v, w16))
            seen = {v for _, v in cands}
            for i, v in enumerate([v for v in fused if v not in seen][:2]):
                cands.append((f"prior{i + 1}", v))
            for cfg, v in cands:
                yield w16, FAMILY, v, {**base, "role": "w4a16_fused", "config": cfg,
                                       "source": "pinned"}


def summary(rows: list[dict]) -> dict:
    """{"layers": per (M, layer) plain / W4A16 xop / best fused W4A16 us (+ its variant and
    fused / plain), "sums": per M the four shapes' sums where all three were timed}."""
    layers = []
    for m in MS:
        for n, k in SHAPES:
            sel = [r for r in rows if r.get("m") == m and r["n"] == n and r["k"] == k
                   and r.get("ok") and r.get("us")]
            plain = [r["us"] for r in sel if r["role"] == "plain"]
            xop = [r["us"] for r in sel if r["role"] == "w4a16_xop"]
            fused = sorted((r for r in sel if r["role"] == "w4a16_fused"), key=lambda r: r["us"])
            rec: dict[str, Any] = {"m": m, "layer": NAMES[(n, k)],
                                   "plain_us": plain[0] if plain else None,
                                   "w4a16_xop_us": xop[0] if xop else None,
                                   "w4a16_fused_us": fused[0]["us"] if fused else None,
                                   "fused_variant": fused[0]["variant"] if fused else None,
                                   "fused_config": fused[0]["config"] if fused else None}
            if rec["plain_us"] and rec["w4a16_fused_us"]:
                rec["fused_over_plain"] = rec["w4a16_fused_us"] / rec["plain_us"]
            layers.append(rec)
    sums = []
    for m in MS:
        sel = [r for r in layers if r["m"] == m]
        if len(sel) == len(SHAPES) and all(r["plain_us"] and r["w4a16_xop_us"]
                                           and r["w4a16_fused_us"] for r in sel):
            p, x, f = (sum(r[c] for r in sel) for c in
                       ("plain_us", "w4a16_xop_us", "w4a16_fused_us"))
            sums.append({"m": m, "plain_us": p, "w4a16_xop_us": x, "w4a16_fused_us": f,
                         "fused_over_plain": f / p, "xop_over_plain": x / p})
    return {"layers": layers, "sums": sums}


def table(s: dict) -> list[str]:
    """The short table printed last."""
    cell = layer_probe.cell
    out = [f"{'M':>2s} {'layer':8s} {'plain':>8s} {'a16 xop':>8s} {'a16 fused':>9s} "
           f"{'fused/plain':>11s}  best fused W4A16"]

    for r in s["layers"]:
        ratio = cell(r.get("fused_over_plain"), 11, 3)
        out.append(f"{r['m']:2d} {r['layer']:8s} {cell(r['plain_us'])} {cell(r['w4a16_xop_us'])} "
                   f"{cell(r['w4a16_fused_us'])} {ratio}  {r['fused_config'] or ''} "
                   f"{(r['fused_variant'] or '')[16:]}")
    for t in s["sums"]:
        out.append(f"M={t['m']}: sums plain {t['plain_us']:.2f} us, W4A16 xop "
                   f"{t['w4a16_xop_us']:.2f} ({t['xop_over_plain']:.3f}x), W4A16 fused "
                   f"{t['w4a16_fused_us']:.2f} ({t['fused_over_plain']:.3f}x plain)")
    return out


def main(argv: list[str] | None = None) -> int:
    return layer_probe.run_dispatched_probe(
        "w4a16_fused_probe", __doc__, argv, 110.0, lambda lookup: plan(lookup, xop_winners()),
        tag=lambda rec: f"m{rec['m']} {rec['role']:11s} {rec['config']:6s} ",
        summary=summary, table=table)


if __name__ == "__main__":
    sys.exit(main())
