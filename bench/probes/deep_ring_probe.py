"""Deep weight rings for the M = 1 decode layers of linear_sm90_mma: the tuned space holds
bulk rings of 2 / 4 slots and cp.async rings of 3 / 4, so a CTA has at most 4 iterations of
its warps' weights in flight while its fused prologue quantizes x. Qwen3-8B down (K = 12288:
6-12 iterations per warp, the longest prologue, 61% of the NVFP4 floor) and gate_up, NVFP4
plain and M-Ext, whole layers, each variant checked against resgen.reference.linear before it
is timed (bench/probes/layer_probe.py; the table's variant first, then deeper rings of 6 / 8 slots
with layouts that keep one wave of CTAs on the 132 SMs). About two minutes:

    source .devcache/device/env.sh && RESGEN_CACHE_DIR=/tmp/resgen-cache \\
        timeout -k 5 -s INT 300 python3 bench/probes/deep_ring_probe.py      # JSON to $OUT
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from layer_probe import probe  # noqa: E402
from resgen.search.linear_sm90_mma import FAMILY, Act, LinearSm90Variant as V, Pipeline  # noqa: E402
from resgen.search.variant import LinearProblem  # noqa: E402

F = dict(act=Act.FUSED)
B, C = Pipeline.BULK, Pipeline.CP_ASYNC
CASES = {
    (4096, 12288): [V(1, 8, 1, 1, 1, C, 3, pdl=True, **F),          # the table's (M = 1)
                    V(1, 8, 1, 1, 1, B, 2, pdl=True, **F),
                    V(1, 8, 1, 1, 1, B, 4, pdl=True, **F),
                    V(1, 8, 1, 1, 1, B, 6, pdl=True, **F),
                    V(1, 8, 1, 1, 1, C, 6, pdl=True, **F),
                    V(2, 4, 1, 1, 1, B, 4, pdl=True, **F),
                    V(2, 4, 1, 1, 1, B, 6, pdl=True, **F),
                    V(2, 4, 1, 1, 1, B, 8, pdl=True, **F),
                    V(2, 4, 1, 1, 1, B, 8, pdl=True, cluster=2, **F),
                    V(2, 4, 1, 1, 1, C, 8, pdl=True, **F),
                    V(1, 4, 2, 1, 1, B, 4, pdl=True, **F),
                    V(1, 4, 2, 1, 1, B, 6, pdl=True, **F),
                    V(1, 4, 2, 1, 1, B, 8, pdl=True, **F)],
    (24576, 4096): [V(4, 2, 1, 1, 1, B, 2, **F),                    # the table's M-Ext
                    V(4, 2, 1, 1, 1, B, 4, **F),
                    V(4, 2, 1, 1, 1, B, 8, **F),
                    V(4, 2, 1, 1, 1, B, 8, pdl=True, **F),
                    V(2, 4, 1, 1, 1, B, 4, pdl=True, **F)],
}


def main() -> int:
    return probe("deep_ring_probe", ((LinearProblem("nvfp4", comp, 1, n, k), FAMILY, v, {})
                                     for (n, k), vs in CASES.items() for comp in ("none", "full")
                                     for v in vs))


if __name__ == "__main__":
    sys.exit(main())
