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

    python bench/probes/ncu_sass_wgmma.py --summarize ncu_sass_wgmma.sass.csv[.xz] \\
        ncu_sass_wgmma.order.txt
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
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "report"))

from report_io import ncu_number, read_text  # noqa: E402
from resgen.search.variant import LinearProblem  # noqa: E402

CASES = ((6144, 4096, 64), (24576, 4096, 64), (24576, 4096, 128))   # (N, K, M): qkv, gate_up


def launch_all() -> None:
    """The dispatched plain NVFP4 GEMM of each case (it must be a linear_sm90_wgmma row of the
    shipped table), twice each."""
    import layer_probe

    from resgen.search.family import get_family

    lookup = layer_probe.dispatched_lookup()
    for n, k, m in CASES:
        p = LinearProblem("nvfp4", "none", m, n, k)
        v, _ = lookup(p)
        fam = get_family(type(v).FAMILY)
        if fam.NAME != "linear_sm90_wgmma":
            print(f"SKIP {n}x{k} M={m}: the table serves {fam.NAME}", flush=True)
            continue
        layer_probe.launch_twice(fam, v, p, f"{n}x{k} M={m} {v.name()}")


# Where an instruction belongs in the kernel's loop, by its SASS opcode (first match wins; a
# branch right after an mbarrier try_wait is the wait's spin loop)
PHASES = (("mbarrier wait (try_wait spin)", re.compile(r"^SYNCS\.PHASECHK")),
          ("mbarrier arrive / init", re.compile(r"^SYNCS\.")),
          ("wgmma issue / wait", re.compile(r"^(HGMMA|WARPGROUP)")),
          ("TMA / bulk copy issue", re.compile(r"^(UTMALDG|UBLKCP|UTMA|UBLK)")),
          ("shared loads", re.compile(r"^LDS")),
          ("global loads / stores", re.compile(r"^(LDG|STG|RED|ATOM|LD\.|ST\.)")),
          ("control (branch, barrier, exit)",
           re.compile(r"^(BRA|BAR|BSYNC|BSSY|WARPSYNC|EXIT|NANOSLEEP|BPT)")),
          ("FP / FP16 (decode scale, epilogue)",
           re.compile(r"^(HMUL2|HFMA2|HADD2|FMUL|FADD|FFMA|F2F|F2FP)")),
          ("integer ALU (decode, addresses)", re.compile(r".")))
SAMPLES = "Warp Stall Sampling (All Samples)"


def _num(v: str | None) -> float:
    """A source-page cell's number; 0 where it holds none (report_io.ncu_number)."""
    return ncu_number(v or "0") or 0.0


def _opcode(source: str) -> str:
    """The SASS opcode of a source-page line (its predicate guard dropped)."""
    return re.sub(r"^@!?U?P\w+\s+", "", source.strip())


def split_kernels(text: str) -> list[list[dict[str, str]]]:
    """The source page export: per profiled launch a "Kernel Name" line, then a CSV block
    (header "Address","Source",...) of its SASS instructions; the blocks' rows, in launch
    order."""
    lines = text.splitlines()
    starts = [i for i, ln in enumerate(lines) if ln.startswith('"Kernel Name"')]
    out = []
    for a, b in zip(starts, starts[1:] + [len(lines)]):
        block = [ln for ln in lines[a + 1:b] if ln.startswith('"')]
        out.append(list(csv.DictReader(io.StringIO("\n".join(block)))))
    return out


def phases(rows: list[dict[str, str]]) -> dict[str, float]:
    """Share of the launch's warp samples per PHASES entry (a branch right after a try_wait
    counts as the wait)."""
    total = sum(_num(r.get(SAMPLES)) for r in rows) or 1.0
    share: dict[str, float] = {}
    prev = ""
    for r in rows:
        op = _opcode(r.get("Source") or "")
        if op.startswith("BRA") and prev.startswith("SYNCS.PHASECHK"):
            name = PHASES[0][0]
        else:
            name = next(n for n, rx in PHASES if rx.search(op))
        share[name] = share.get(name, 0.0) + _num(r.get(SAMPLES)) / total
        prev = op
    return share


def ledger(rows: list[dict[str, str]], top: int = 12) -> str:
    """Markdown: the launch's warp samples per phase, then its `top` SASS instructions by
    samples with their two largest stall reasons (the source page's stall_* columns)."""
    if not rows:
        return "(no rows)"
    total = sum(_num(r.get(SAMPLES)) for r in rows) or 1.0
    stall_cols = [c for c in rows[0] if c.startswith("stall_") and "Not Issued" not in c]
    execd = sum(_num(r.get("Instructions Executed")) for r in rows)
    out = [f"{int(total)} warp samples, {execd / 1e6:.2f} M warp instructions executed", "",
           "| phase | share of warp samples |", "| --- | ---: |"]
    out += [f"| {n} | {100 * v:.1f} % |"
            for n, v in sorted(phases(rows).items(), key=lambda t: -t[1])]
    out += ["", "| SASS | share | top stall reasons |", "| --- | ---: | --- |"]
    for r in sorted(rows, key=lambda r: -_num(r.get(SAMPLES)))[:top]:
        why = sorted(((c, _num(r.get(c))) for c in stall_cols), key=lambda t: -t[1])[:2]
        out.append(f"| `{(r.get('Source') or '').strip()[:64]}` | "
                   f"{100 * _num(r.get(SAMPLES)) / total:.1f} % | "
                   + ", ".join(f"{c[6:]} {v:.0f}" for c, v in why if v > 0) + " |")
    return "\n".join(out)


def summarize(sass_csv: str, order: str) -> str:
    """Markdown ledgers of the second launch of every profiled variant (`order`: the probe's
    stdout under ncu; lines starting with "==" are ncu's own)."""
    blocks = split_kernels(read_text(Path(sass_csv)))
    names = [ln.strip() for ln in read_text(Path(order)).splitlines()
             if ln.strip() and not ln.startswith("==") and not ln.startswith("SKIP")]
    if len(blocks) != 2 * len(names):
        raise SystemExit(f"{len(blocks)} profiled launches for {len(names)} variants "
                         "(want 2 each)")
    out = []
    for i, name in enumerate(names):
        out += [f"## {name}", "", ledger(blocks[2 * i + 1]), ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--summarize", nargs=2, metavar=("SASS_CSV", "ORDER"),
                    help="print the ledgers of a source-page export and its order file")
    args = ap.parse_args(argv)
    if not args.summarize:
        launch_all()
        return 0
    print(summarize(*args.summarize))
    return 0


if __name__ == "__main__":
    sys.exit(main())
