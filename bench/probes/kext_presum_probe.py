"""K-Ext presum against the exact K-Ext fold and plain W4A4 (issue 20 section 1: "the same
works for K-Ext ... K-Ext at plain cost on Hopper"), whole layers on the H200, before any
K-Ext presum row is tuned.

Per K-Ext ratio of KP_RATIOS (default 0.125; e.g. "0.125,0.25"), M of KP_MS (default 1,
16, 128, 2048) and Qwen3-8B projection (N, K):
  - plain:  the shipped table's fastest row of the plain NVFP4 workload (any family, fused
            included): what `resgen.ops.Linear(qweight, "none")` serves;
  - exact:  the table's fastest row of the exact K-Ext workload (LinearProblem fold "exact");
  - presum: the K-Ext presum workload (fold "presum") on the presum twin of each Hopper
            family's fastest plain xop row (its GEMM is the plain one over K in FP16), and
            each family's first presum variant by its prior.
Every variant is compiled, checked against resgen.reference.linear (presum: fold="presum")
on fresh inputs into a poisoned output, then timed as the whole layer under the tuner's
policy (resgen.cli.time_layer), layer quantizer included. On the H200 (carry .devcache):

    source .devcache/device/env.sh && RESGEN_CACHE_DIR=/tmp/resgen-cache \\
        timeout -k 5 -s INT 240 python3 bench/probes/kext_presum_probe.py

$OUT/kext_presum_probe.json: rows (bench/probes/layer_probe.py's fields plus ratio, m, role),
rewritten after each variant, then "summary": per (ratio, M) the four-shape sums of plain,
exact and the best presum per shape, and presum / plain, exact / plain."""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import layer_probe  # noqa: E402

from resgen.search.family import get_family  # noqa: E402
from resgen.search.sm90_linear import Fold  # noqa: E402
from resgen.search.variant import LinearProblem  # noqa: E402

ARCH = layer_probe.ARCH
QWEN3_8B = ((6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288))
RATIOS = tuple(os.environ.get("KP_RATIOS", "0.125").split(","))
MS = tuple(int(m) for m in os.environ.get("KP_MS", "1,16,128,2048").split(","))
FAMILIES = ("linear_sm90_mma", "linear_sm90_wgmma")


def cases():
    best = layer_probe.table_best(FAMILIES)
    xop = {f: layer_probe.table_xop_winners(get_family(f)) for f in FAMILIES}
    for ratio in RATIOS:
        for m in MS:
            for n, k in QWEN3_8B:
                plain = LinearProblem("nvfp4", "none", m, n, k)
                exact = LinearProblem("nvfp4", ratio, m, n, k)
                presum = LinearProblem("nvfp4", ratio, m, n, k, fold="presum")
                tag = {"ratio": ratio, "m": m}
                for role, p in (("plain", plain), ("exact", exact)):
                    if p.key() in best:
                        _, fname, v = best[p.key()]
                        yield p, get_family(fname), v, {**tag, "role": role}
                seen = set()
                for fname in FAMILIES:
                    fam = get_family(fname)
                    cands = []
                    w = xop[fname].get(plain.key())
                    if w is not None:
                        cands.append(("presum_twin", dataclasses.replace(w, fold=Fold.PRESUM)))
                    space = sorted(fam.space(presum, ARCH), key=lambda v: fam.prior(v, presum))
                    if space:
                        cands.append(("presum_prior", space[0]))
                    for how, v in cands:
                        if (fname, v) in seen or fam.why_invalid(v, presum, ARCH):
                            continue
                        seen.add((fname, v))
                        yield presum, fam, v, {**tag, "role": "presum", "how": how,
                                               "family": fname}


def summary(rows: list[dict]) -> list[dict]:
    out = []
    for ratio in RATIOS:
        for m in MS:
            sums: dict[str, float] = {}
            complete = True
            for n, k in QWEN3_8B:
                for role in ("plain", "exact", "presum"):
                    ts = [r["us"] for r in rows if r.get("ok") and r.get("us")
                          and r["ratio"] == ratio and r["m"] == m and r["role"] == role
                          and r["n"] == n and r["k"] == k]
                    if not ts:
                        complete = False
                        continue
                    sums[role] = sums.get(role, 0.0) + min(ts)
            if not complete:
                continue
            out.append({"ratio": ratio, "m": m, **{f"{k}_us": v for k, v in sums.items()},
                        "presum_over_plain": sums["presum"] / sums["plain"],
                        "exact_over_plain": sums["exact"] / sums["plain"]})
    return out


def main() -> int:
    rc, doc = layer_probe.summarized_probe(
        "kext_presum_probe", cases(),
        tag=lambda r: f"{r['ratio']} m{r['m']:<5d} {r['role']:6s} ", summary=summary)
    for s in doc["summary"]:
        print(f"K-Ext {s['ratio']} M={s['m']:<5d} plain {s['plain_us']:8.2f}  exact "
              f"{s['exact_us']:8.2f} ({s['exact_over_plain']:.3f})  presum {s['presum_us']:8.2f}"
              f" ({s['presum_over_plain']:.3f})", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
