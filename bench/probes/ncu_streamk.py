"""Why stream-K (linear_sm90_wgmma's `streamk` axis) lost to the grid schedule in
streamk_probe.py: the same GEMMs side by side, grid (the table's winner, its twins without PDL
and without split-K) against stream-K (one and two CTAs per SM), Qwen3-8B NVFP4 plain, qkv at
M = 64, gate_up at M = 16 and 2048. Two modes, one device call:

    python3 bench/probes/ncu_streamk.py --time      # whole layers: $OUT/ncu_streamk_time.json
    python3 bench/probes/ncu_streamk.py --ctas      # qkv M = 64 stream-K at 48 / 96 / 132 CTAs
    ncu --clock-control none --kernel-name regex:kernel_cutlass_.*(gemm|streamk)_kernel \\
        --section SpeedOfLight --section Occupancy --section LaunchStats \\
        --section WarpStateStats --section SchedulerStats --csv --page details \\
        --log-file $OUT/ncu_streamk.csv python3 bench/probes/ncu_streamk.py \\
        > $OUT/ncu_streamk.order.txt

Under ncu every layer runs twice (the first launch warms caches and TLBs); the order file names
the variant of each pair of profiled GEMM launches. The table (the second launch of each pair):

    python bench/probes/ncu_streamk.py --summarize ncu_streamk.csv[.xz] ncu_streamk.order.txt
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from resgen.search.linear_sm90_wgmma import FAMILY, LinearSm90WgmmaVariant  # noqa: E402
from resgen.search.variant import LinearProblem  # noqa: E402

V = LinearSm90WgmmaVariant
CASES = [
    ((6144, 4096, 64), [V(2, 1, 64, 6, split_k=2, pdl=True), V(2, 1, 64, 6, split_k=2),
                        V(2, 1, 64, 6), V(2, 1, 64, 6, streamk=1)]),
    ((24576, 4096, 16), [V(1, 1, 16, 8), V(1, 1, 16, 8, streamk=1), V(1, 1, 16, 8, streamk=2)]),
    ((24576, 4096, 2048), [V(2, 1, 256, 4), V(2, 1, 256, 4, streamk=1)]),
]


def cases():
    for (n, k, m), vs in CASES:
        p = LinearProblem("nvfp4", "none", m, n, k)
        for v in vs:
            yield p, v


def launch_all() -> None:
    import layer_probe

    for p, v in cases():
        layer_probe.launch_twice(FAMILY, v, p, f"{p.n}x{p.k} M={p.m} {v.name()}")


SUMMARY = ("Duration", "Grid Size", "DRAM Throughput", "Compute (SM) Throughput",
           "Achieved Occupancy", "Registers Per Thread", "Block Limit Registers",
           "Waves Per SM", "No Eligible", "Warp Cycles Per Issued Instruction",
           "Issued Warp Per Scheduler")


def summarize(csv_path: str, order_path: str) -> str:
    """A markdown table of SUMMARY's metrics per profiled variant (its second launch)."""
    import csv
    import io

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "report"))
    from report_io import read_text

    lines = [ln for ln in read_text(Path(csv_path)).splitlines() if ln.startswith('"')]
    rows = list(csv.reader(io.StringIO("\n".join(lines))))
    hdr = rows[0]
    col = {h: hdr.index(h) for h in ("ID", "Grid Size", "Metric Name", "Metric Value")}
    per: dict[str, dict[str, str]] = {}
    for r in rows[1:]:
        d = per.setdefault(r[col["ID"]], {"Grid Size": r[col["Grid Size"]]})
        d[r[col["Metric Name"]]] = r[col["Metric Value"]]
    names = [ln.strip() for ln in read_text(Path(order_path)).splitlines() if ln.strip()]
    ids = list(per)
    if len(ids) != 2 * len(names):
        raise SystemExit(f"{len(ids)} profiled launches for {len(names)} variants (want 2 each)")
    out = ["| shape | variant | " + " | ".join(SUMMARY) + " |",
           "| --- | --- |" + " ---: |" * len(SUMMARY)]
    for i, name in enumerate(names):
        shape, m, var = name.split()
        d = per[ids[2 * i + 1]]
        out.append(f"| {shape} {m} | {var.split(':')[1]} | "
                   + " | ".join(d.get(k, "") for k in SUMMARY) + " |")
    return "\n".join(out)


def ctas_sweep() -> int:
    """Where the stream-K CTA loses its time: qkv at M = 64 (48 tiles x 32 chunk pairs) with
    the persistent grid forced to 48 CTAs (each exactly one whole tile: no fixup, one segment:
    the grid kernel's work per CTA), 96 (half a tile each, as split-K 2) and 132, against the
    grid kernel unsplit and split-K 2 (no PDL); whole layers under the tuner's policy, checked
    first. $OUT/ncu_streamk_ctas.json."""
    import json
    import os

    import torch

    from resgen.search.build import compile_variant
    from resgen.search.timing import DEFAULT_POLICY, measure
    from resgen.search.tuner import working_set_bytes

    p = LinearProblem("nvfp4", "none", 64, 6144, 4096)
    runs = [(V(2, 1, 64, 6), None), (V(2, 1, 64, 6, split_k=2), None)] + \
        [(V(2, 1, 64, 6, streamk=1), c) for c in (48, 96, 132)]
    rows = []
    for v, ctas in runs:
        out = compile_variant(FAMILY, v, p, "sm_90a")
        assert out.ok, out.error
        n_sets = DEFAULT_POLICY.sets_for(working_set_bytes(FAMILY, v, p))
        r = FAMILY.runner(out.compiled, v, p, "cuda", n_sets=n_sets, seed=0)
        if ctas is not None:
            r.launcher.sms = ctas              # streamk 1: ctas = sms
        r.as_layer()
        chk = r.check()
        us = measure(r, DEFAULT_POLICY, n_sets).median_us if chk.ok else None
        rows.append({"variant": v.name(), "ctas": ctas, "ok": chk.ok, "rel_err": chk.rel_err,
                     "us": us})
        print(f"{v.name():64s} ctas={ctas} ok={chk.ok} {us}", flush=True)
        del r
        torch.cuda.empty_cache()
    out_dir = Path(os.environ.get("OUT", "."))
    (out_dir / "ncu_streamk_ctas.json").write_text(json.dumps(
        {"gpu": torch.cuda.get_device_name(0), "policy": DEFAULT_POLICY.as_dict(),
         "problem": p.key(), "rows": rows}, indent=1))
    return 0


def main() -> int:
    if "--ctas" in sys.argv:
        return ctas_sweep()
    if "--summarize" in sys.argv:
        i = sys.argv.index("--summarize")
        print(summarize(sys.argv[i + 1], sys.argv[i + 2]))
        return 0
    if "--time" in sys.argv:
        from layer_probe import probe

        return probe("ncu_streamk_time", ((p, FAMILY, v, {"m": p.m}) for p, v in cases()),
                     tag=lambda r: f"M={r['m']:<5d} ")
    launch_all()
    return 0


if __name__ == "__main__":
    sys.exit(main())
