"""What the fused activation prologue of linear_sm90_mma costs, measured: Qwen3-8B qkv
(6144 x 4096) and down (4096 x 12288), NVFP4, M = 1 and 4, plain and M-Ext, on one warp layout
per shape (the shipped table's: 2 x 4 warps for qkv, 1 x 8 for down; 3-stage cp.async ring),
with the activation source varied: fused per CTA, fused once per cluster of 2 / 4 CTAs
(distributed shared memory), xop (quant_sm90 in front) without / with PDL; each with and
without an L2 prefetch of the warp's whole K slice issued before the prologue (not in the
tuner's space yet: the cp.async ring keeps only 2 iterations in flight while a fused CTA
quantizes). Every variant is checked against resgen.reference.linear before it is timed as
the whole layer (resgen.cli.time_layer, the tuner's policy; bench/probes/layer_probe.py):

    source .devcache/device/env.sh && RESGEN_CACHE_DIR=/tmp/resgen-cache \\
        timeout -k 5 -s INT 200 python3 bench/probes/prologue_probe.py      # JSON to $OUT

Questions it answers (docs/linear_sm90_mma.md, "Where M-Ext costs"): how much of M-Ext / plain
at M = 1 is the residue's share of the per-CTA quantization (fused M-Ext - fused plain
against xop M-Ext - xop plain), how the fused prologue grows from M = 1 to 4 (the shipped
table switches down to xop at M = 4), and whether an up-front L2 prefetch hides it.
Prints one line per variant (tag: M, source, L2) and writes $OUT/prologue_probe.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from layer_probe import probe  # noqa: E402
from resgen.search.linear_sm90_mma import FAMILY, Act, LinearSm90Variant as V, Pipeline  # noqa: E402
from resgen.search.linear_sm90_mma import geometry_of  # noqa: E402
from resgen.search.variant import LinearProblem  # noqa: E402

# (N, K) -> (warps_m, warps_k)
SHAPES = {(6144, 4096): (2, 4), (4096, 12288): (1, 8)}
# (label, act, pdl, cluster)
SOURCES = [("fused", Act.FUSED, True, 1), ("fused-cl2", Act.FUSED, True, 2),
           ("fused-cl4", Act.FUSED, True, 4), ("xop", Act.XOP, False, 1),
           ("xop-pdl", Act.XOP, True, 1)]


def cases():
    for m in (1, 4):
        for comp in ("none", "full"):
            for (n, k), (wm, wk) in SHAPES.items():
                p = LinearProblem("nvfp4", comp, m, n, k)
                nt = 1 if p.rows <= 8 else 2
                for label, act, pdl, cl in SOURCES:
                    base = V(wm, wk, 1, nt, 1, Pipeline.CP_ASYNC, 3, 0, act=act, pdl=pdl,
                             cluster=cl)
                    nit = geometry_of(base, p).nit
                    for l2 in (0, nit):
                        v = V(wm, wk, 1, nt, 1, Pipeline.CP_ASYNC, 3, l2, act=act, pdl=pdl,
                              cluster=cl)
                        yield p, FAMILY, v, {"m": m, "source": label, "l2_all": l2 > 0}


def main() -> int:
    return probe("prologue_probe", cases(),
                 tag=lambda r: f"M={r['m']:<2d} {r['source']:9s} {'L2' if r['l2_all'] else '  '} ")


if __name__ == "__main__":
    sys.exit(main())
