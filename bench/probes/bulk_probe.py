"""First H200 look at the bulk ring of linear_sm90_mma (pipeline "bulk"): the shipped table's
M = 1 winners of the two widest Qwen3-8B layers against bulk-ring twins, NVFP4 plain and M-Ext,
whole layers (fused quantization), each checked against resgen.reference.linear before it is
timed (resgen.cli.time_layer, the tuner's policy; bench/probes/layer_probe.py). About a minute:

    source .devcache/device/env.sh && RESGEN_CACHE_DIR=/tmp/resgen-cache \\
        timeout -k 5 -s INT 90 python3 bench/probes/bulk_probe.py          # JSON to $OUT

Prints one line per variant as it goes and writes $OUT/bulk_probe.json after each.
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
# (N, K) -> variants: the table's M = 1 winners' layouts first, then bulk twins
CASES = {
    (24576, 4096): [V(4, 2, 1, 1, 1, Pipeline.REGS, 1, **F),
                    V(4, 2, 1, 1, 1, Pipeline.REGS, 1, cluster=2, **F),
                    V(2, 4, 1, 1, 1, Pipeline.CP_ASYNC, 3, **F),
                    V(4, 2, 1, 1, 1, Pipeline.BULK, 2, **F),
                    V(4, 2, 1, 1, 1, Pipeline.BULK, 4, **F),
                    V(2, 4, 1, 1, 1, Pipeline.BULK, 2, **F)],
    (4096, 12288): [V(1, 8, 1, 1, 1, Pipeline.CP_ASYNC, 3, pdl=True, **F),
                    V(1, 8, 1, 1, 1, Pipeline.BULK, 2, pdl=True, **F),
                    V(1, 8, 1, 1, 1, Pipeline.BULK, 4, pdl=True, **F),
                    V(2, 4, 1, 1, 1, Pipeline.BULK, 2, **F)],
}


def main() -> int:
    return probe("bulk_probe", ((LinearProblem("nvfp4", comp, 1, n, k), FAMILY, v, {})
                                for comp in ("none", "full")
                                for (n, k), vs in CASES.items() for v in vs))


if __name__ == "__main__":
    sys.exit(main())
