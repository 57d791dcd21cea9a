"""First H200 look at ragged K slices in linear_sm90_mma (a CTA's K groups split unevenly over
its warps): Qwen3-4B's layers whose K groups (of 256 columns) have no factor 4 or 8 (down:
K = 9728 = 38 groups; qkv and gate_up: K = 2560 = 10), NVFP4, M = 1, plain and M-Ext, whole
layers (fused quantization), each variant checked against resgen.reference.linear before it
is timed (resgen.cli.time_layer, the tuner's policy; bench/probes/layer_probe.py), beside the
layouts the tune13a table dispatched there (bench_qwen3_4b_table13.json.xz), timed in the same run
(results: bench/results/h200/ragged_probe.{json,log}):

    source .devcache/device/env.sh && RESGEN_CACHE_DIR=/tmp/resgen-cache \\
        timeout -k 5 -s INT 150 python3 bench/probes/ragged_probe.py       # JSON to $OUT

Prints one line per variant as it goes (R: ragged) and writes $OUT/ragged_probe.json after
each.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from layer_probe import ARCH, probe  # noqa: E402
from resgen.search.linear_sm90_mma import FAMILY, Act, LinearSm90Variant as V, Pipeline  # noqa: E402
from resgen.search.linear_sm90_mma import geometry_of  # noqa: E402
from resgen.search.linear_sm90_wgmma import FAMILY as WG  # noqa: E402
from resgen.search.linear_sm90_wgmma import LinearSm90WgmmaVariant as W  # noqa: E402
from resgen.search.variant import LinearProblem  # noqa: E402

F = dict(act=Act.FUSED)
CP, BK, DI, RG = Pipeline.CP_ASYNC, Pipeline.BULK, Pipeline.DIRECT, Pipeline.REGS
# (N, K) -> (table's layouts, ragged candidates); the table's differ per compensation only in
# PDL / prefetch details, so both modes time the same list
CASES = {
    (2560, 9728): ([(WG, W(1, 1, 16, 8, split_k=4, pdl=True)),
                    (FAMILY, V(4, 2, 1, 1, 1, RG, 1, pdl=True, cluster=2, **F))],
                   [V(1, 8, 1, 1, 1, CP, 3, pdl=True, **F), V(1, 8, 1, 1, 1, CP, 3, **F),
                    V(1, 8, 1, 1, 1, BK, 2, **F), V(1, 8, 1, 1, 1, DI, 1, l2_prefetch=2, **F),
                    V(2, 4, 1, 1, 1, CP, 3, **F)]),
    (6144, 2560): ([(FAMILY, V(4, 2, 1, 1, 1, RG, 1, **F))],
                   [V(1, 4, 1, 1, 1, CP, 3, **F), V(1, 8, 1, 1, 1, CP, 3, **F),
                    V(2, 4, 1, 1, 1, CP, 3, **F), V(1, 8, 1, 1, 1, DI, 1, l2_prefetch=2, **F)]),
    (19456, 2560): ([(FAMILY, V(4, 2, 1, 1, 1, RG, 1, **F))],
                    [V(2, 4, 1, 1, 1, CP, 3, **F), V(2, 4, 1, 1, 1, BK, 2, **F),
                     V(1, 8, 1, 1, 1, CP, 3, **F)]),
}


def _ragged(fam, v, p) -> bool:
    return fam is FAMILY and FAMILY.why_invalid(v, p, ARCH) is None and geometry_of(v, p).ragged


def cases():
    for comp in ("none", "full"):
        for (n, k), (table, ragged) in CASES.items():
            p = LinearProblem("nvfp4", comp, 1, n, k)
            for fam, v in [*table, *[(FAMILY, r) for r in ragged]]:
                yield p, fam, v, {"ragged": _ragged(fam, v, p)}


def main() -> int:
    return probe("ragged_probe", cases(), tag=lambda rec: "R " if rec["ragged"] else "  ")


if __name__ == "__main__":
    sys.exit(main())
