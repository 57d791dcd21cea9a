"""Exact fold vs presum for the SAME tile configuration of linear_sm90_mma (issue 20 section 1):
Qwen3-8B's four projections, NVFP4 M-Ext, M = 1, 16, 64, 128, whole layers (quant_sm90 +
the GEMM, the tuner's policy: resgen.cli.time_layer through bench/probes/layer_probe.py), each
variant checked before it is timed (presum against reference.linear(fold="presum") and the
exact fold's reference). Per (shape, M) two tile configurations, each timed exact, presum with
the same fields ("same") and presum with half the n8 tiles ("half_nt": the same tokens per CTA,
as an n8 tile holds 8 tokens in presum and 4 in the exact fold):
  "table": the shipped table's fastest linear_sm90_mma xop variant of that M-Ext workload;
  "prior": the space's first exact xop variant by the family's prior.
On the H200, one device call of about 4 minutes (carry .devcache; bench/presum_h200.sh runs
the GPU tests first, then this):

    source .devcache/device/env.sh && RESGEN_CACHE_DIR=/tmp/resgen-cache \\
        timeout -k 5 -s INT 420 python3 bench/probes/presum_probe.py      # JSON to $OUT

$OUT/presum_probe.json: the rows (layer_probe's fields plus m, config, fold) rewritten after
each variant, then "summary": per (config, M) the four shapes' exact and presum sums and their
ratio (only where all eight were checked and timed)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import layer_probe  # noqa: E402
from resgen.search.linear_sm90_mma import FAMILY, Fold, LinearSm90Variant  # noqa: E402
from resgen.search.variant import LinearProblem  # noqa: E402

ARCH = "sm_90a"
SHAPES = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]   # Qwen3-8B, TP1
MS = (64, 128, 16, 1)      # the M where presum should matter first (a cut-short run keeps them)


def table_winners() -> dict[str, LinearSm90Variant]:
    """workload key -> the shipped table's fastest linear_sm90_mma xop variant."""
    return layer_probe.table_xop_winners(FAMILY)


def configs(p: LinearProblem, winners: dict[str, LinearSm90Variant]
            ) -> list[tuple[str, LinearSm90Variant]]:
    """(config name, exact xop variant) whose presum twin is valid for p."""
    out = []
    if p.key() in winners:
        out.append(("table", winners[p.key()]))
    exact = [v for v in FAMILY.space(p, ARCH) if not v.presum and not v.fused]
    out.append(("prior", min(exact, key=lambda v: FAMILY.prior(v, p))))
    return [(name, v) for name, v in out
            if FAMILY.why_invalid(dataclasses.replace(v, fold=Fold.PRESUM), p, ARCH) is None]


def cases(winners: dict[str, LinearSm90Variant] | None = None):
    """layer_probe cases: every config exact, then its presum twin, per (M, shape)."""
    winners = table_winners() if winners is None else winners
    for m in MS:
        for n, k in SHAPES:
            p = LinearProblem("nvfp4", "full", m, n, k)
            for name, v in configs(p, winners):
                for fold in (Fold.EXACT, Fold.PRESUM):
                    yield (p, FAMILY, dataclasses.replace(v, fold=fold),
                           {"m": m, "config": name, "fold": fold.value, "pair": "same"})
                half = dataclasses.replace(v, fold=Fold.PRESUM, n_tiles=v.n_tiles // 2)
                if v.n_tiles > 1 and FAMILY.why_invalid(half, p, ARCH) is None:
                    yield (p, FAMILY, half,
                           {"m": m, "config": name, "fold": "presum", "pair": "half_nt"})


def summary(rows: list[dict]) -> list[dict]:
    """Per (config, M, pair): the four shapes' exact / presum sums (us) and presum / exact,
    where all eight were checked and timed (half_nt: the shapes that have a half twin)."""
    out = []
    for cfg in ("table", "prior"):
        for m in MS:
            sel = [r for r in rows if r.get("config") == cfg and r.get("m") == m]
            exact = {(r["n"], r["k"]): r.get("us") for r in sel
                     if r["fold"] == "exact" and r.get("ok")}
            for pair in ("same", "half_nt"):
                pres = {(r["n"], r["k"]): r.get("us") for r in sel if r["fold"] == "presum"
                        and r["pair"] == pair and r.get("ok")}
                shapes = [s for s in SHAPES if exact.get(s) and pres.get(s)]
                if pair == "same" and len(shapes) < len(SHAPES) or not shapes:
                    continue
                e, q = sum(exact[s] for s in shapes), sum(pres[s] for s in shapes)
                out.append({"config": cfg, "m": m, "pair": pair, "shapes": len(shapes),
                            "exact_us": e, "presum_us": q, "presum_over_exact": q / e})
    return out


def main() -> int:
    rc, doc = layer_probe.summarized_probe(
        "presum_probe", cases(), tag=lambda rec: f"m{rec['m']:<3d} {rec['config']:5s} ",
        summary=summary)
    for s in doc["summary"]:
        print(f"{s['config']:5s} {s['pair']:7s} M={s['m']:<4d} ({s['shapes']} shapes) exact "
              f"{s['exact_us']:8.2f} us  presum {s['presum_us']:8.2f} us  presum/exact "
              f"{s['presum_over_exact']:.3f}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
