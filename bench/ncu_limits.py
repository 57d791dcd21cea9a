"""What limits the kernels the shipped table dispatches, measured with Nsight Compute: the
Qwen3-8B decode projections at M = 1 (NVFP4; plain, M-Ext, and each one's variant run in the
other mode where valid, so that the residue's cost is one kernel measured twice; `--linear-m`
picks other M) and decode attention over a KV length of 32K for the Qwen3-8B (32/8/128) and
Qwen3-32B (64/8/128) geometries at batch 1 and 32 (ResAttn, plain NVFP4-KV, and the ResAttn
variant without the query residue).

On the GPU machine (profiles the second call of each case; the first warms caches and TLBs):

    source .devcache/device/env.sh && ncu --clock-control none --profile-from-start off \\
        --section SpeedOfLight --section ComputeWorkloadAnalysis --section InstructionStats \\
        --section WarpStateStats --section SchedulerStats --section Occupancy \\
        --section LaunchStats --csv --page raw --log-file $OUT/ncu_limits.csv \\
        python3 bench/ncu_limits.py > $OUT/ncu_limits.order.txt
    (`python3 bench/ncu_limits.py --linear-m 16 --no-attention`: the linear cases at M = 16;
    `--linear-m 1024 --no-attention --kext 0.125,1.0`: prefill with K-Ext next to M-Ext)

Every case is checked against the reference first (fresh inputs, poisoned output) and skipped
if wrong. Its profiled call sits in its own cudaProfilerStart / Stop window that begins with a
marker launch (torch.cuda._sleep, ATen's `spin_kernel`), so the CSV splits into cases without
knowing how many kernels each launches (xop layers: quantizer + GEMM; workspace attention:
attention + reduce). On the CPU, the table and JSON from the committed CSV:

    python bench/ncu_limits.py --summarize bench/results/h200/ncu_limits.csv.xz \\
        bench/results/h200/ncu_limits.order.txt --json bench/results/h200/ncu_limits.json \\
        > bench/results/h200/ncu_limits.md
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench" / "report"))

from report_io import ncu_number as _num, read_text  # noqa: E402

DB = ROOT / "tuned" / "h200.sqlite.xz"
LINEAR_SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096),
                 "down": (4096, 12288)}                      # Qwen3-8B, TP1: (N, K)
ATTENTION_GEOMETRIES = {"qwen3-8b": (32, 8, 128), "qwen3-32b": (64, 8, 128)}
ATTENTION_BATCHES = (1, 32)
KV_LEN = 32768
MARKER = "spin_kernel"
CASE_PREFIX = "CASE\t"

# Raw Nsight Compute metrics the table shows: (column, raw metric name, scale)
METRICS = (("us", "gpu__time_duration.sum", 1e-3),
           ("DRAM %", "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed", 1.0),
           ("SM %", "sm__throughput.avg.pct_of_peak_sustained_elapsed", 1.0),
           ("issue busy %", "smsp__issue_active.avg.pct_of_peak_sustained_active", 1.0),
           ("eligible warps", "smsp__warps_eligible.avg.per_cycle_active", 1.0),
           ("occupancy %", "sm__warps_active.avg.pct_of_peak_sustained_active", 1.0),
           ("tensor %", "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active", 1.0),
           ("instructions M", "smsp__inst_executed.sum", 1e-6),
           ("registers", "launch__registers_per_thread", 1.0),
           ("CTAs", "launch__grid_size", 1.0))
PIPE_RE = re.compile(r"^sm__inst_executed_pipe_(\w+?)\.avg\.pct_of_peak_sustained_active$")
STALL_RE = re.compile(r"^smsp__average_warps_issue_stalled_(\w+?)_per_issue_active\.ratio$")


@dataclass(frozen=True)
class Case:
    """One profiled call: a label, the family, the variant's key and the problem."""

    label: str
    family: Any
    variant: Any
    problem: Any


def cases(device: Any = None, linear_ms: tuple[int, ...] = (1,),
          attention: bool = True, kext: tuple[str, ...] = (), w4a16: bool = False
          ) -> Iterator[Case]:
    """The dispatched variants (shipped table; `device`: a resgen.runtime.Device to match its
    rows against, the current GPU by default), and each compensated variant without its
    residue where the family accepts that; `kext`: K-Ext ratios ("0.125", ..., "1.0") whose
    dispatched linear variants are profiled too; `w4a16`: the dispatched W4A16 layers too."""
    from resgen import runtime
    from resgen.search.family import get_family
    from resgen.search.variant import AttentionProblem, LinearProblem

    disp = runtime.Dispatcher(paths=[DB], device=device)
    arch = "sm_90a"

    def pair(op: str, plain: Any, comp: Any, tag: str) -> Iterator[Case]:
        vp, vc = disp.lookup(op, plain), disp.lookup(op, comp)
        fp, fc = get_family(type(vp).FAMILY), get_family(type(vc).FAMILY)
        yield Case(f"{tag} plain", fp, vp, plain)
        yield Case(f"{tag} compensated", fc, vc, comp)
        if vc.key() != vp.key() and fc.why_invalid(vc, plain, arch) is None:
            yield Case(f"{tag} compensated variant, no residue", fc, vc, plain)
        if vc.key() != vp.key() and fp.why_invalid(vp, comp, arch) is None:
            yield Case(f"{tag} plain variant, with residue", fp, vp, comp)

    for m in linear_ms:
        for name, (n, k) in LINEAR_SHAPES.items():
            yield from pair("linear", LinearProblem("nvfp4", "none", m, n, k),
                            LinearProblem("nvfp4", "full", m, n, k), f"linear {name} M={m}")
            for r in kext + (("w4a16",) if w4a16 else ()):
                pk = LinearProblem("nvfp4", r, m, n, k)
                vk = disp.lookup("linear", pk)
                yield Case(f"linear {name} M={m} " + ("W4A16" if r == "w4a16" else f"K-Ext {r}"),
                           get_family(type(vk).FAMILY), vk, pk)
    for geo, (qh, kvh, d) in ATTENTION_GEOMETRIES.items() if attention else ():
        for b in ATTENTION_BATCHES:
            def ap(comp: bool) -> AttentionProblem:
                return AttentionProblem(batch=b, q_heads=qh, kv_heads=kvh, head_dim=d,
                                        kv_len=KV_LEN, page_size=32, compensation=comp,
                                        pv="f16")
            yield from pair("decode_attention", ap(False), ap(True),
                            f"attention {geo} b={b} kv=32K")


def run(linear_ms: tuple[int, ...] = (1,), attention: bool = True,
        kext: tuple[str, ...] = (), w4a16: bool = False) -> int:
    """Check, warm and profile every case (the GPU part; ncu attaches from outside)."""
    import torch

    from resgen.search.build import compile_variant

    failures = 0
    for c in cases(linear_ms=linear_ms, attention=attention, kext=kext, w4a16=w4a16):
        out = compile_variant(c.family, c.variant, c.problem, "sm_90a")
        if not out.ok:
            print(f"SKIP\t{c.label}\t{c.variant.name()}\tcompile failed", flush=True)
            failures += 1
            continue
        r = c.family.runner(out.compiled, c.variant, c.problem, "cuda", n_sets=1, seed=0)
        if hasattr(r, "as_layer"):
            r.as_layer()                    # the whole layer, as the tuner and bench time it
        chk = r.check()
        if not chk.ok:
            print(f"SKIP\t{c.label}\t{c.variant.name()}\tcheck failed: {chk.detail}",
                  flush=True)
            failures += 1
            continue
        r()
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        torch.cuda._sleep(1000)            # the marker that opens this case's rows
        r()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        print(f"{CASE_PREFIX}{c.label}\t{c.variant.name()}\t{c.problem.key()}\t"
              f"rel_err={chk.rel_err:.3e}", flush=True)
        del r
        torch.cuda.empty_cache()
    return 1 if failures else 0


# ----------------------------------------------------------------------------- summary (CPU)


def load_rows(csv_text: str) -> list[dict[str, str]]:
    """The raw page's kernel rows in launch order (ncu's log lines and the units row dropped)."""
    text = "".join(line for line in csv_text.splitlines(True) if not line.startswith("=="))
    rows = list(csv.DictReader(io.StringIO(text)))
    return [r for r in rows if (r.get("ID") or "").strip().isdigit()]


def load_cases(order_text: str) -> list[dict[str, str]]:
    """The profiled cases in order, from the GPU run's stdout."""
    out = []
    for line in order_text.splitlines():
        if line.startswith(CASE_PREFIX):
            label, variant, problem, err = line[len(CASE_PREFIX):].split("\t")
            out.append({"label": label, "variant": variant, "problem": problem,
                        "rel_err": err.split("=", 1)[1]})
    return out


def split_cases(rows: list[dict[str, str]], n_cases: int) -> list[list[dict[str, str]]]:
    """Kernel rows per case: each case's rows follow its marker launch."""
    groups: list[list[dict[str, str]]] = []
    for r in rows:
        if MARKER in r.get("Kernel Name", ""):
            groups.append([])
        elif groups:
            groups[-1].append(r)
        else:
            raise ValueError(f"kernel {r.get('Kernel Name')!r} before the first marker")
    if len(groups) != n_cases:
        raise ValueError(f"{len(groups)} marker windows in the CSV, {n_cases} cases in the "
                         "order file")
    if any(not g for g in groups):
        raise ValueError("a case window holds no kernel")
    return groups


def kernel_summary(r: dict[str, str]) -> dict[str, Any]:
    """The table's figures for one kernel row, plus its busiest pipes and top stall reasons."""
    out: dict[str, Any] = {"kernel": r.get("Kernel Name", "")[:80]}
    for col, name, scale in METRICS:
        v = _num(r.get(name, ""))
        out[col] = None if v is None else v * scale
    pipes = {m.group(1): _num(v) for k, v in r.items() if (m := PIPE_RE.match(k))}
    stalls = {m.group(1): _num(v) for k, v in r.items() if (m := STALL_RE.match(k))}
    out["pipes %"] = dict(sorted(((k, v) for k, v in pipes.items() if v is not None),
                                 key=lambda kv: -kv[1])[:3])
    out["stalls"] = dict(sorted(((k, v) for k, v in stalls.items() if v is not None),
                                key=lambda kv: -kv[1])[:3])
    return out


def summarize(csv_text: str, order_text: str) -> list[dict[str, Any]]:
    """One record per case: its label, variant, and each of its kernels' figures."""
    cs = load_cases(order_text)
    groups = split_cases(load_rows(csv_text), len(cs))
    return [{**c, "kernels": [kernel_summary(r) for r in g]} for c, g in zip(cs, groups)]


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, dict):
        return ", ".join(f"{k} {x:.2f}" for k, x in v.items())
    return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"


def markdown(records: list[dict[str, Any]]) -> str:
    cols = [c for c, _, _ in METRICS] + ["pipes %", "stalls"]
    lines = ["| case | kernel | " + " | ".join(cols) + " |",
             "| --- | --- |" + " ---: |" * (len(cols) - 2) + " --- | --- |"]
    for rec in records:
        for i, k in enumerate(rec["kernels"]):
            name = rec["label"] if i == 0 else ""
            kname = k["kernel"].split("(")[0][:40]
            lines.append(f"| {name} | {kname} | " + " | ".join(_fmt(k[c]) for c in cols) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--summarize", nargs=2, metavar=("CSV", "ORDER"),
                    help="CPU: the table (stdout) from a run's CSV and order file")
    ap.add_argument("--json", type=Path, help="with --summarize: also write the records here")
    ap.add_argument("--linear-m", default="1",
                    help="comma-separated M of the linear cases (GPU run; default 1)")
    ap.add_argument("--no-attention", action="store_true",
                    help="GPU run: the linear cases only")
    ap.add_argument("--kext", default="",
                    help="GPU run: comma-separated K-Ext ratios to profile as well (e.g. "
                    "0.125,1.0)")
    ap.add_argument("--w4a16", action="store_true",
                    help="GPU run: the dispatched W4A16 linear layers as well")
    args = ap.parse_args(argv)
    if not args.summarize:
        return run(tuple(int(x) for x in args.linear_m.split(",")), not args.no_attention,
                   tuple(x for x in args.kext.split(",") if x), args.w4a16)
    csv_path, order_path = (Path(p) for p in args.summarize)
    records = summarize(read_text(csv_path), read_text(order_path))
    if args.json:
        args.json.write_text(json.dumps(records, indent=1) + "\n")
    print(f"# Nsight Compute: what limits the dispatched kernels\n\n"
          f"From `{csv_path.name}` and `{order_path.name}` (`bench/ncu_limits.py`; one "
          f"profiled call per case, boost clocks, ncu's cache flush between passes).\n")
    print(markdown(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
