"""First H200 probe of attention_sm90's "stack" packing (ResAttn's query residue stacked along
the head dim: base and residue operand tiles feed ONE FP32 accumulator tile) against "pair"
(base and residue in adjacent columns, folded in a lane) and the plain NVFP4-KV kernel
("dense" at G = 8, "pair" at G <= 4), at the points where ResAttn / plain was worst
(bench/results/h200/attention_targets.md; Nsight Compute in ncu_limits.md: at G = 8 the pair
variants hold 168-224 registers against dense's 128-174, half the occupancy).

    source .devcache/device/env.sh && timeout -k 5 -s INT 170 python3 bench/probes/stack_probe.py

Per (geometry, batch, KV length) each packing runs the same small set of layouts (warps,
prefetch; the split count and reduction of the fallback rule, and one split where the batch
fills the GPU). Every variant is checked against resgen.reference.decode_attention first
(fresh inputs, poisoned output) and timed under the tuner's policy (resgen.cli.time_layer).
One line per variant; $OUT/stack_probe.json is rewritten after each, so a run cut short keeps
what it measured.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Iterator

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

GEOMS = {"qwen3-32b": (64, 8, 128), "qwen3-8b": (32, 8, 128), "d256": (16, 2, 256)}
POINTS = [("qwen3-32b", 1, 32768), ("qwen3-32b", 8, 32768), ("qwen3-32b", 32, 32768),
          ("qwen3-32b", 64, 131072), ("qwen3-8b", 1, 32768),
          ("qwen3-8b", 32, 32768), ("d256", 8, 32768)]


def cases() -> Iterator[tuple[str, object, object]]:
    """(tag, variant, problem) in run order; invalid ones are yielded too (and reported)."""
    from resgen.search.attention_sm90 import Packing, Reduction, preset
    from resgen.search.variant import AttentionProblem

    for geom, batch, kv in POINTS:
        hq, hkv, d = GEOMS[geom]
        group = hq // hkv
        for comp, packs in ((True, (Packing.PAIR, Packing.STACK)),
                            (False, (Packing.DENSE if group > 4 else Packing.PAIR,))):
            p = AttentionProblem(batch=batch, q_heads=hq, kv_heads=hkv, head_dim=d, kv_len=kv,
                                 compensation=comp)
            base = preset(p)
            splits = sorted({base.splits, 1} if batch * hkv >= 132 else {base.splits})
            for pk in packs:
                for s in splits:
                    red = Reduction.NONE if s == 1 else Reduction.LASTCTA
                    for w in (4, 8):
                        for pf in (True, False):
                            v = dataclasses.replace(base, packing=pk, num_warps=w, kc=32,
                                                    splits=s, reduction=red, prefetch=pf)
                            mode = "ResAttn" if comp else "plain"
                            yield f"{geom} b={batch} kv={kv // 1024}K {mode} {pk.value}", v, p


def main() -> int:
    import torch

    from layer_probe import check_and_time
    from resgen.search.family import get_family
    from resgen.search.timing import DEFAULT_POLICY

    fam = get_family("attention_sm90")
    out = Path(os.environ.get("OUT", "bench/results/h200"))
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    compiled: dict = {}
    for tag, v, p in cases():
        rec = {"tag": tag, "variant": v.name(), "problem": json.loads(p.key()),
               **check_and_time(fam, v, p, compiled)}
        rec["registers"] = getattr(compiled.get(
            (fam.NAME, v.key(), fam.compile_key(v, p).key())), "registers", None)
        rows.append(rec)
        us = f"{rec['us']:9.2f} us" if rec.get("us") else \
            (rec.get("invalid") or rec.get("error") or rec.get("detail") or "")[:60]
        print(f"{tag:40s} {v.name():52s} {us} rel {rec.get('rel_err', float('nan')):.1e}",
              flush=True)
        (out / "stack_probe.json").write_text(json.dumps(
            {"gpu": torch.cuda.get_device_name(), "policy": DEFAULT_POLICY.as_dict(),
             "rows": rows}, indent=1))
        torch.cuda.empty_cache()
    return 0 if all(r.get("ok", True) and "error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
