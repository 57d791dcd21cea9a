"""Where the presum layer's time goes (issue 20 section 1: full residue <= 1.05x plain):
Qwen3-8B's four projections, NVFP4, linear_sm90_wgmma, M = 64 / 128 / 512 / 2048. Per (shape,
M) three layers, each checked first (resgen.cli.time_layer's check: fresh inputs, poisoned
output; presum against both references) and then timed three ways under the tuner's policy
(resgen.search.timing.measure: cold L2, CUDA graph, the same input sets):
  "layer":  the bound layer (quantizer + GEMM), what the tuner and `resgen bench` time;
  "quant":  the layer's quantizer alone (quant_sm90 in the variant's layout, into the
            layer's own buffers);
  "gemm":   the GEMM alone, reading the operand that quantizer wrote.
Configurations: "plain" (the shipped table's plain winner, layout "plain"), "full" (the
table's M-Ext winner: a presum variant, layout "presum") and "plain_twin" (the plain
winner's presum twin on the M-Ext workload: the same GEMM tiles in FP16). So full / plain
splits into the quantizer's extra work (presum's residue quantization) and the GEMM's.

On the H200 (carry .devcache), about 2-3 minutes:

    source .devcache/device/env.sh && RESGEN_CACHE_DIR=/tmp/resgen-cache \\
        timeout -k 5 -s INT 240 python3 bench/probes/presum_split_probe.py     # JSON to $OUT

$OUT/presum_split_probe.json: rows {m, n, k, config, variant, rel_err, layer_us, quant_us,
gemm_us} rewritten after each, then "summary": per (config, M) the four shapes' sums."""

from __future__ import annotations

import dataclasses
import os
import sys
import traceback
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import layer_probe  # noqa: E402

from resgen.search.build import compile_variant  # noqa: E402
from resgen.search.linear_sm90_wgmma import FAMILY, Fold  # noqa: E402
from resgen.search.timing import DEFAULT_POLICY, measure  # noqa: E402
from resgen.search.tuner import working_set_bytes  # noqa: E402
from resgen.search.variant import LinearProblem  # noqa: E402

ARCH = "sm_90a"
SHAPES = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]   # Qwen3-8B, TP1
MS = (64, 128, 2048, 512)
CONFIGS = ("plain", "full", "plain_twin")
PARTS = ("layer", "quant", "gemm")


class _Part:
    """A timing view of a bound runner: rotate(i) / __call__ run one part of set i's layer."""

    def __init__(self, runner: Any, part: str) -> None:
        self.runner, self.part, self.cur = runner, part, 0
        self.ops: dict[int, Any] = {}

    def rotate(self, i: int) -> None:
        self.cur = i
        self.runner.rotate(i)

    def __call__(self) -> Any:
        if self.part == "layer":
            return self.runner()
        b = self.runner.bindings[self.cur]
        xb = self.runner.xbs[self.cur]
        if b.xpad is not None:
            b.xpad[:, : b.problem.k].copy_(xb)
            xb = b.xpad
        if self.part == "quant":
            return b.quantizer(xb, b.outs, alpha=b.alpha, **b._qkw)
        if self.cur not in self.ops:       # the operand of this set, written once (eager)
            self.ops[self.cur] = b.quantizer(xb, b.outs, alpha=b.alpha, **b._qkw)
        op = self.ops[self.cur]
        return b.launcher(b.weight, op.xop, b.m, b.rows, op.alpha, self.runner.out)


def split(v: Any, p: LinearProblem, cache: dict) -> dict:
    """Check the layer, then time its three parts: {rel_err, layer_us, quant_us, gemm_us} or
    {ok: False, detail} or {error}."""
    why = FAMILY.why_invalid(v, p, ARCH)
    if why:
        return {"invalid": why}
    try:
        ck = (v.key(), FAMILY.compile_key(v, p).key())
        out = cache.get(ck) or compile_variant(FAMILY, v, p, ARCH)
        cache[ck] = out
        if not out.ok:
            return {"error": str(out.error)[:600]}
        n_sets = DEFAULT_POLICY.sets_for(working_set_bytes(FAMILY, v, p))
        runner = FAMILY.runner(out.compiled, v, p, "cuda", n_sets=n_sets, seed=0)
        runner.as_layer()
        chk = runner.check()
        if not chk.ok:
            return {"ok": False, "rel_err": chk.rel_err, "detail": chk.detail}
        rec: dict = {"ok": True, "rel_err": chk.rel_err}
        for part in PARTS:
            rec[f"{part}_us"] = measure(_Part(runner, part), DEFAULT_POLICY, n_sets).median_us
        return rec
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"[:600], "trace": traceback.format_exc()[-1500:]}


def cases(winners: dict | None = None):
    """(problem, variant, record fields) per (M, shape, configuration)."""
    for m, n, k, full, plain, fw, pw in layer_probe.mext_plain_pairs(FAMILY, MS, SHAPES,
                                                                     winners):
        out = []
        if pw is not None:
            out += [(plain, pw, "plain"),
                    (full, dataclasses.replace(pw, fold=Fold.PRESUM), "plain_twin")]
        if fw is not None:
            out.insert(1, (full, fw, "full"))
        for p, v, name in out:
            yield p, v, {"m": m, "n": n, "k": k, "config": name}


def summary(rows: list[dict]) -> list[dict]:
    """Per (M, configuration): the four shapes' sums of each part where all four were timed,
    and each over plain's."""
    out = []
    for m in MS:
        sums: dict[str, dict[str, float]] = {}
        for cfg in CONFIGS:
            got = {(r["n"], r["k"]): r for r in rows
                   if r["m"] == m and r["config"] == cfg and r.get("ok")}
            if all(s in got for s in SHAPES):
                sums[cfg] = {part: sum(got[s][f"{part}_us"] for s in SHAPES) for part in PARTS}
        if not sums:
            continue
        row: dict = {"m": m, "sums_us": sums}
        if "plain" in sums:
            row["over_plain"] = {c: {part: sums[c][part] / sums["plain"][part] for part in PARTS}
                                 for c in sums if c != "plain"}
        out.append(row)
    return out


def main(tag: Callable[[dict], str] = lambda r: f"m{r['m']:<5d} {r['config']:10s}") -> int:
    outdir = Path(os.environ.get("OUT", "bench/results/h200"))
    outdir.mkdir(parents=True, exist_ok=True)
    path = outdir / "presum_split_probe.json"
    rows: list[dict] = []
    cache: dict = {}
    rc = 0
    try:
        for p, v, extra in cases():
            rec = {**extra, "variant": v.name(), **split(v, p, cache)}
            rows.append(rec)
            cells = ("  ".join(f"{part} {rec[part + '_us']:8.2f}" for part in PARTS)
                     if rec.get("ok") else str(rec.get("invalid") or rec.get("error")
                                               or rec.get("detail"))[:160])
            print(f"{tag(rec)} {p.n}x{p.k} {v.name()[:64]:64s} {cells}", flush=True)
            layer_probe.write_rows(path, rows)
    except KeyboardInterrupt:
        print("presum_split_probe: interrupted, summarizing the rows so far", flush=True)
        rc = 124
    doc = layer_probe.write_rows(path, rows, summary=summary(rows))
    for s in doc["summary"]:
        for c, parts in s["sums_us"].items():
            ratio = s.get("over_plain", {}).get(c)
            extra = ("  /plain " + " ".join(f"{part} {ratio[part]:.3f}" for part in PARTS)
                     if ratio else "")
            print(f"M={s['m']:<5d} {c:10s} " + " ".join(f"{part} {parts[part]:8.2f}"
                                                         for part in PARTS) + extra)
    if any(r.get("error") or r.get("ok") is False for r in rows):
        rc = rc or 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
