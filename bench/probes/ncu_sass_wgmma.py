"""Where inside linear_sm90_wgmma's GEMM the serving-M time goes, per SASS instruction: the
shipped table's plain NVFP4 winners for Qwen3-8B qkv and gate_up at M = 64 and gate_up at
M = 128 (the layers the Nsight Compute summaries put at DRAM 12-36 %, tensor pipe 25-54 %,
no unit saturated), launched under Nsight Compute with warp-state PC sampling
(SourceCounters), then the source page exported per SASS instruction. On the H200 (carry
.devcache), one device call:

    source .devcache/device/env.sh && \\
    ncu --clock-control none --kernel-name regex:kernel_cutlass_gemm_kernel \\
        --section SourceCounters --section WarpStateStats --section SpeedOfLight \\
        --import-source no -o $OUT/ncu_sass_wgmma python3 bench/probes/ncu_sass_wgmma.py \\
        > $OUT/ncu_sass_wgmma.order.txt && \\
    ncu -i $OUT/ncu_sass_wgmma.ncu-rep --page source --csv --print-source sass \\
        > $OUT/ncu_sass_wgmma.sass.csv

Each GEMM runs twice (bench/probes/layer_probe.launch_twice: the first warms caches); the
order file names the variant of each pair. Here, the ledger of the second launch of each:

    python bench/probes/ncu_sass_wgmma.py --summarize ncu_sass_wgmma.sass.csv[.xz]
"""

from __future__ import annotations

import argparse
import csv
import io
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from resgen.search.variant import LinearProblem  # noqa: E402

CASES = ((6144, 4096, 64), (24576, 4096, 64), (24576, 4096, 128))   # (N, K, M): qkv, gate_up


def launch_all() -> None:
    """The dispatched plain NVFP4 GEMM of each case (it must be a linear_sm90_wgmma row of the
    shipped table), twice each."""
    import layer_probe

    from resgen.runtime import Dispatcher
    from resgen.search.family import get_family

    disp = Dispatcher()
    for n, k, m in CASES:
        p = LinearProblem("nvfp4", "none", m, n, k)
        v = disp.lookup("linear", p)
        fam = get_family(type(v).FAMILY)
        if fam.NAME != "linear_sm90_wgmma":
            print(f"SKIP {n}x{k} M={m}: the table serves {fam.NAME}", flush=True)
            continue
        layer_probe.launch_twice(fam, v, p, f"{n}x{k} M={m} {v.name()}")


# Where an instruction belongs in the kernel's loop, by its SASS opcode (first match wins)
PHASES = (("mbarrier wait (try_wait loop)", re.compile(r"SYNCS\.PHASECHK|SYNCS\.ARRIVE.*TRYWAIT")),
          ("mbarrier arrive / expect_tx", re.compile(r"SYNCS\.")),
          ("wgmma", re.compile(r"HGMMA|WARPGROUP")),
          ("TMA / bulk copy", re.compile(r"UTMALDG|UBLKCP|UTMACMDFLUSH|UBLKPF")),
          ("shared loads", re.compile(r"^LDS|^LDSM")),
          ("global loads / stores", re.compile(r"^LDG|^STG|^RED|^ATOM")),
          ("branch / barrier", re.compile(r"^BRA|^BAR|^BSYNC|^BSSY|^WARPSYNC|^EXIT|^NANOSLEEP")),
          ("integer / FP ALU (decode, addressing)", re.compile(r".")))


def _rows(text: str) -> list[dict[str, str]]:
    """The source page's CSV rows (every line from the first quoted header on)."""
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith('"')), None)
    if start is None:
        raise SystemExit("no CSV header in the source page export")
    return list(csv.DictReader(io.StringIO("\n".join(lines[start:]))))


def _num(v: str | None) -> float:
    try:
        return float((v or "0").replace(",", ""))
    except ValueError:
        return 0.0


def ledger(rows: list[dict[str, str]], top: int = 25) -> str:
    """Markdown: warp-state samples summed per phase (PHASES), then the `top` SASS instructions
    by samples with their two largest stall reasons. The samples column is the source page's
    "Warp Stall Sampling (All Samples)"; stall columns are those named stall_* or containing
    "Stall"."""
    if not rows:
        return "(no rows)"
    cols = list(rows[0])
    samp = next((c for c in cols if "Sampling (All" in c), None) or \
        next((c for c in cols if "Samples" in c), None)
    src = next((c for c in cols if c.lower() in ("source", "sass")), cols[1] if len(cols) > 1
               else cols[0])
    if samp is None:
        return "no warp-sampling column in: " + ", ".join(cols)
    stall_cols = [c for c in cols if c != samp and ("stall" in c.lower())
                  and "Sampling" not in c]
    total = sum(_num(r.get(samp)) for r in rows) or 1.0
    phase: dict[str, float] = {}
    for r in rows:
        op = (r.get(src) or "").strip().lstrip("@!P0123456789T ").strip()
        name = next(n for n, rx in PHASES if rx.search(op))
        phase[name] = phase.get(name, 0.0) + _num(r.get(samp))
    out = ["| phase | share of warp samples |", "| --- | ---: |"]
    out += [f"| {n} | {100 * s / total:.1f} % |" for n, s in
            sorted(phase.items(), key=lambda t: -t[1])]
    out += ["", "| SASS | share | top stall reasons |", "| --- | ---: | --- |"]
    for r in sorted(rows, key=lambda r: -_num(r.get(samp)))[:top]:
        reasons = sorted(((c, _num(r.get(c))) for c in stall_cols), key=lambda t: -t[1])[:2]
        why = ", ".join(f"{c} {v:.0f}" for c, v in reasons if v > 0)
        out.append(f"| `{(r.get(src) or '').strip()[:70]}` | "
                   f"{100 * _num(r.get(samp)) / total:.1f} % | {why} |")
    return "\n".join(out)


def split_kernels(text: str) -> list[str]:
    """The source page export holds one CSV block per profiled kernel launch, each after a
    line naming the kernel; the blocks, in launch order."""
    blocks, cur = [], []
    for ln in text.splitlines():
        if ln.startswith('"') or not cur and not ln.strip():
            cur.append(ln)
        elif cur and any(c.startswith('"') for c in cur):
            blocks.append("\n".join(cur))
            cur = [] if not ln.startswith('"') else [ln]
    if cur and any(c.startswith('"') for c in cur):
        blocks.append("\n".join(cur))
    return blocks


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--summarize", metavar="SASS_CSV", help="print the ledgers of an export")
    args = ap.parse_args(argv)
    if not args.summarize:
        launch_all()
        return 0
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "report"))
    from report_io import read_text

    blocks = split_kernels(read_text(Path(args.summarize)))
    for i, b in enumerate(blocks):
        print(f"\n## profiled launch {i + 1} of {len(blocks)}\n")
        print(ledger(_rows(b)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
