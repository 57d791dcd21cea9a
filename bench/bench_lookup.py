"""Warm and cold `resgen.runtime.lookup` latency (target: warm <= 2 us).

    python bench/bench_lookup.py [--json OUT.json]

Builds a throw-away table with one tuned entry per Qwen3-8B linear workload (the family
default, fingerprinted against the current templates, as an H200 row), then times:
- cold: the first lookup of a problem (database load, bucket search, fingerprint, validity);
- warm: repeated lookups of already-seen problems through the module-level `lookup` and
  through `Dispatcher.lookup` (the in-memory cache).
Runs on a CPU; no GPU is needed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from resgen import runtime  # noqa: E402
from resgen.db import TuningDB  # noqa: E402
from resgen.models import COMPENSATIONS, get_model, linear_problems  # noqa: E402
from resgen.search.build import variant_fingerprint  # noqa: E402
from resgen.search.family import families_for  # noqa: E402
from resgen.search.record import Environment, ResultRecord, Status  # noqa: E402

ARCH = "sm_90a"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    fams = families_for("linear", ARCH)
    if not fams:
        print("no linear family registered for sm_90a: nothing to look up")
        return 2
    fam = fams[0]
    env = Environment("NVIDIA H200", ARCH, "9.0", 132, "-", "-", "-", "-", "-", False)
    probs = linear_problems([get_model("qwen3-8b")], 1, ("nvfp4", "mxfp4"), COMPENSATIONS,
                            (1, 4, 16, 64))
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "t.sqlite"
        with TuningDB(path) as db:
            for p in probs:
                v = fam.default(p, ARCH)
                db.record(ResultRecord(problem=p, variant=v, environment=env,
                                       fingerprint=variant_fingerprint(fam, v, p, ARCH),
                                       status=Status.OK, space_index=0, median_us=10.0,
                                       samples_us=[10.0], policy={"tie_rel": 0.01}))
        disp = runtime.reset(paths=[path], device=runtime.Device("NVIDIA H200", ARCH))
        real = [dataclasses.replace(p, m=m) for p in probs[::4] for m in (1, 3, 9, 50)]
        t0 = time.perf_counter()
        for p in real:
            runtime.lookup("linear", p)
        cold_us = (time.perf_counter() - t0) / len(real) * 1e6
        n = 200_000
        res = {}
        for label, fn in (("module lookup()", runtime.lookup), ("Dispatcher.lookup", disp.lookup)):
            runs = []
            for _ in range(7):
                t0 = time.perf_counter()
                for i in range(n):
                    fn("linear", real[i % len(real)])
                runs.append((time.perf_counter() - t0) / n * 1e6)
            res[label] = statistics.median(runs)
    print(f"cold lookup (first use, incl. database load): {cold_us:9.1f} us / problem")
    for label, us in res.items():
        print(f"warm {label:20s}: {us:9.3f} us  (target <= 2 us)")
    if args.json:
        from run_record import run_record

        args.json.write_text(json.dumps({"run": run_record(__file__), "cold_us": cold_us,
                                         "warm_us": res,
                                         "problems": len(real)}, indent=1))
    return 0 if max(res.values()) <= 2.0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
