"""Presum on linear_sm90_wgmma (issue 20 section 1): Qwen3-8B's four projections, NVFP4, M = 64,
128, 256, 512, 2048, whole layers (quant_sm90 + the GEMM, the tuner's policy:
resgen.cli.time_layer through bench/probes/layer_probe.py), each variant checked before it is
timed (presum against reference.linear(fold="presum") AND the exact fold's reference). Per
(shape, M), every one a linear_sm90_wgmma variant:
  "full_table":  the shipped table's fastest variant of the M-Ext workload (exact fold);
  "full_same":   its presum twin (same fields; its token tile now holds bn tokens, not bn / 2);
  "plain_table": the shipped table's fastest variant of the plain (W4A4) workload;
  "plain_twin":  ITS presum twin, on the M-Ext workload: presum's GEMM is the plain GEMM in
                 FP16, so plain's tiles are the natural start, and full / plain -> 1 is the
                 issue's target (full residue <= 1.05x plain);
  "prior":       the space's first presum variant by the family's prior.
On the H200 (carry .devcache), about 3 minutes:

    source .devcache/device/env.sh && RESGEN_CACHE_DIR=/tmp/resgen-cache \\
        timeout -k 5 -s INT 300 python3 bench/probes/wgmma_presum_probe.py     # JSON to $OUT

$OUT/wgmma_presum_probe.json: the rows (layer_probe's fields plus m, config) rewritten after
each variant, then "summary": per (config, M) the four shapes' sum where all four were checked
and timed, and the ratios full_* / plain_table."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import layer_probe  # noqa: E402
from resgen.search.linear_sm90_wgmma import FAMILY, Fold  # noqa: E402

ARCH = "sm_90a"
SHAPES = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]   # Qwen3-8B, TP1
MS = (64, 128, 2048, 256, 512)     # a cut-short run keeps the decode-batch rows first
CONFIGS = ("full_table", "full_same", "plain_table", "plain_twin", "prior")


def cases(winners: dict | None = None):
    """layer_probe cases per (M, shape): the five configurations (those that exist)."""
    for m, _n, _k, full, plain, fw, pw in layer_probe.mext_plain_pairs(FAMILY, MS, SHAPES,
                                                                       winners):
        out = []
        if fw is not None:
            out += [(full, fw, "full_table"),
                    (full, dataclasses.replace(fw, fold=Fold.PRESUM), "full_same")]
        if pw is not None:
            out += [(plain, pw, "plain_table"),
                    (full, dataclasses.replace(pw, fold=Fold.PRESUM), "plain_twin")]
        pres = [v for v in FAMILY.space(full, ARCH) if v.presum]
        out.append((full, min(pres, key=lambda v: FAMILY.prior(v, full)), "prior"))
        for p, v, name in out:
            yield p, FAMILY, v, {"m": m, "config": name}


def summary(rows: list[dict]) -> list[dict]:
    """Per M: each configuration's four-shape sum (us) where all four were checked and timed,
    and the M-Ext ones over plain_table's."""
    out = []
    for m in MS:
        sums = {}
        for cfg in CONFIGS:
            us = {(r["n"], r["k"]): r.get("us") for r in rows
                  if r.get("m") == m and r.get("config") == cfg and r.get("ok")}
            if all(us.get(s) for s in SHAPES):
                sums[cfg] = sum(us[s] for s in SHAPES)
        if not sums:
            continue
        row: dict = {"m": m, **{f"{c}_us": v for c, v in sums.items()}}
        base = sums.get("plain_table")
        if base:
            for c in ("full_table", "full_same", "plain_twin", "prior"):
                if c in sums:
                    row[f"{c}_over_plain"] = sums[c] / base
        out.append(row)
    return out


def main() -> int:
    rc, doc = layer_probe.summarized_probe(
        "wgmma_presum_probe", cases(), tag=lambda rec: f"m{rec['m']:<5d} {rec['config']:11s} ",
        summary=summary)
    for s in doc["summary"]:
        cells = "  ".join(f"{c} {s[c + '_us']:8.2f}" for c in CONFIGS if c + "_us" in s)
        ratios = "  ".join(f"{c}/plain {s[c + '_over_plain']:.3f}"
                           for c in ("full_table", "full_same", "plain_twin", "prior")
                           if c + "_over_plain" in s)
        print(f"M={s['m']:<5d} {cells}  |  {ratios}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
