"""First H200 look at the bulk ring of linear_sm90_mma (pipeline "bulk"): the shipped table's
M = 1 winners of the two widest Qwen3-8B layers against bulk-ring twins, NVFP4 plain and M-Ext,
whole layers (fused quantization), each checked against resgen.reference.linear before it is
timed (resgen.cli.time_layer, the tuner's policy). About a minute:

    source .devcache/device/env.sh && RESGEN_CACHE_DIR=/tmp/resgen-cache \\
        timeout -k 5 -s INT 90 python3 bench/bulk_probe.py          # JSON to $OUT

Prints one line per variant as it goes and writes $OUT/bulk_probe.json after each.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from resgen.cli import time_layer  # noqa: E402
from resgen.search.linear_sm90 import FAMILY, Act, LinearSm90Variant as V, Pipeline  # noqa: E402
from resgen.search.timing import DEFAULT_POLICY  # noqa: E402
from resgen.search.variant import LinearProblem  # noqa: E402

ARCH = "sm_90a"
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
    out = Path(os.environ.get("OUT", "bench/results/h200"))
    out.mkdir(parents=True, exist_ok=True)
    rows, cache = [], {}
    for comp in ("none", "full"):
        for (n, k), vs in CASES.items():
            p = LinearProblem("nvfp4", comp, 1, n, k)
            for v in vs:
                rec = {"n": n, "k": k, "comp": comp, "variant": v.name()}
                why = FAMILY.why_invalid(v, p, ARCH)
                if why:
                    rec["invalid"] = why
                else:
                    try:
                        t = time_layer(FAMILY, v, p, ARCH, cache, DEFAULT_POLICY)
                        rec.update(ok=t["check"]["ok"], rel_err=t["check"]["rel_err"],
                                   us=t.get("resgen_us"), detail=t["check"].get("detail"))
                    except Exception as e:               # compile or launch failure
                        rec["error"] = f"{type(e).__name__}: {e}"[:600]
                        rec["trace"] = traceback.format_exc()[-1500:]
                rows.append(rec)
                us = rec.get("us")
                print(f"{comp:4s} {n}x{k} {v.name()[16:70]:54s} "
                      + (f"{us:7.2f} us rel {rec['rel_err']:.1e}" if us else
                         str(rec.get("invalid") or rec.get("error") or rec.get("detail"))[:160]),
                      flush=True)
                (out / "bulk_probe.json").write_text(json.dumps(
                    {"gpu": torch.cuda.get_device_name(0), "policy": DEFAULT_POLICY.as_dict(),
                     "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
