"""GPU check + timing of linear_sm90_fp8 (MXFP4 W4A4 on Hopper's FP8 tensor cores, issue 20
section 3) on Qwen3-8B's four projections, in one process (estimated 7-9.5 minutes with the
command below, about 11 compiles included; unmeasured; at the timeout it stops with what it
has):

    source .devcache/device/env.sh && RESGEN_CACHE_DIR=/tmp/resgen-cache \\
        timeout -k 10 -s INT 570 python3 bench/linear_sm90_fp8_h200.py --budget-s 300

Two phases (PHASES), E4M3 weight load first, then FP4 (so a broken FP4 kernel cannot take
the E4M3 results with it), each:
1. Correctness: tests/gpu/test_linear_sm90_fp8_gpu.py's part for that load (`-k "not fp4"` /
   `-k fp4`) run in-process by pytest (its compiles are shared with the timing:
   resgen.search.linear_sm90_fp8.compile_once). `--no-tests` skips it; a failed test does
   not stop the timing, but every timed variant is checked again here (reference,
   NaN-poisoned output) and skipped when it fails.
2. Per shape (qkv 6144x4096, o 4096x4096, gate/up 24576x4096, down 4096x12288) and M
   (--m, default 64, 128, 256, 2048; 2048 and 128 first):
   - cuBLAS BF16: torch.matmul on bf16 operands;
   - cuBLAS FP8: torch._scaled_mm on PRE-quantized E4M3 operands (per-tensor scales): the
     GEMM alone, like ours;
   - linear_sm90_fp8: each variant of --variants (default VARIANTS) valid for the shape, the
     GEMM alone on pre-built operands (activations: E4M3 codes + group scales, no device
     quantizer writes them yet; weights: E4M3 codes for wload e4m3, packed E2M1 + block
     scales for wload fp4, converted in the kernel), each checked first. The row's best
     per weight load is recorded too (best_by_wload).
   Timing: resgen.search.timing.measure, policy cold-l2-graph (CUDA graph, input sets rotated
   past 2x L2). Ratios: bf16_us / ours and fp8_us / ours (> 1: ours faster).
The issue's targets: faster than cuBLAS FP8 at M = 128, >= 1.5x cuBLAS BF16 at M = 256..2048.
--compensation w4a8 times the W4A8 mode instead (E4M3 per-token activations: the same
kernels, the activation operand from linear_sm90_fp8_operand.token_operand, each variant
checked against resgen.reference.linear_w4a8 within the family's tolerance).
--budget-s caps the timing (default 420 s, tests and compiles not counted: 60 % for the E4M3
phase, the rest and what it left for FP4); SIGINT or a CUDA error ends the run with what it
has. Writes $OUT/linear_sm90_fp8_h200.json (+ _pytest_<wload>.xml), prints a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from resgen.search.linear_sm90_fp8 import (FAMILY, LinearSm90Fp8Variant,  # noqa: E402
                                           Raster, WLoad, compile_once)
from resgen.search.timing import DEFAULT_POLICY, CallableRunner, measure  # noqa: E402
from resgen.search.variant import LinearProblem  # noqa: E402

ARCH = "sm_90a"
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096),
          "down": (4096, 12288)}
# (consumers, bn, stages, group, parts, raster, wload); the fp4 pair is compiled by the GPU
# test file too (shared compiles)
VARIANTS = [(2, 128, 4, 1, 2, "tok", "e4m3"), (2, 128, 4, 2, 2, "tok", "e4m3"),
            (2, 128, 4, 4, 2, "tok", "e4m3"), (1, 128, 4, 4, 2, "tok", "e4m3"),
            (2, 192, 4, 4, 1, "tok", "e4m3"), (2, 64, 6, 4, 2, "tok", "e4m3"),
            (2, 128, 4, 1, 2, "tok", "fp4"), (1, 128, 4, 1, 2, "tok", "fp4")]


def parse_variant(s: str) -> LinearSm90Fp8Variant:
    """'c,bn,stages,group,parts,raster[,wload]' -> a variant (wload default e4m3)."""
    f = s.split(",")
    if len(f) not in (6, 7):
        raise argparse.ArgumentTypeError(
            f"variant {s!r}: c,bn,stages,group,parts,raster[,wload]")
    return LinearSm90Fp8Variant(int(f[0]), int(f[1]), int(f[2]), int(f[3]), int(f[4]),
                                Raster(f[5]), WLoad(f[6] if len(f) == 7 else "e4m3"))


def order_m(ms: list[int], first_m: tuple[int, ...] = (2048, 128)) -> list[int]:
    """first_m first (default the targets: 2048 prefill, 128 the FP8 crossover), then the
    rest in the given order."""
    first = [m for m in first_m if m in ms]
    return first + [m for m in ms if m not in first]


def bf16_runner(m: int, n: int, k: int, n_sets: int, gen: torch.Generator) -> CallableRunner:
    fns = []
    for _ in range(n_sets):
        x = torch.randn(m, k, generator=gen, device="cuda").to(torch.bfloat16)
        wt = torch.randn(n, k, generator=gen, device="cuda").to(torch.bfloat16).t()
        fns.append(lambda x=x, wt=wt: torch.matmul(x, wt))
    return CallableRunner(fns)


def fp8_runner(m: int, n: int, k: int, n_sets: int, gen: torch.Generator) -> CallableRunner:
    """torch._scaled_mm on pre-quantized E4M3 operands (per-tensor scales)."""
    f8 = torch.float8_e4m3fn
    fns = []
    for _ in range(n_sets):
        x = torch.randn(m, k, generator=gen, device="cuda")
        w = torch.randn(n, k, generator=gen, device="cuda")
        sx = (x.abs().amax() / 448.0).float()
        sw = (w.abs().amax() / 448.0).float()
        x8 = (x / sx).to(f8)
        w8 = (w / sw).to(f8).t()            # column-major [K, N]
        fns.append(lambda x8=x8, w8=w8, sx=sx, sw=sw: torch._scaled_mm(
            x8, w8, scale_a=sx, scale_b=sw, out_dtype=torch.bfloat16))
    return CallableRunner(fns)


def _sets(nbytes: int) -> int:
    return DEFAULT_POLICY.sets_for(nbytes)


# (weight load, pytest -k selection of the GPU test file, share of --budget-s, M order);
# e4m3 first: a broken FP4 kernel (a trap poisons the CUDA context) cannot take the E4M3
# results with it; the FP4 load's M where HBM bounds first
PHASES = [("e4m3", "not fp4", 0.6, (2048, 128)), ("fp4", "fp4", 0.4, (128, 64))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--m", default="64,128,256,2048")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--variants", type=parse_variant, nargs="*", default=None,
                    help="c,bn,stages,group,parts,raster[,wload] (default: VARIANTS)")
    ap.add_argument("--budget-s", type=float, default=420.0)
    ap.add_argument("--no-tests", action="store_true")
    ap.add_argument("--compensation", choices=("none", "w4a8"), default="none",
                    help="none: MXFP4 W4A4 (exact); w4a8: FP8 E4M3 per-token activations x "
                    "MXFP4 weights (the same kernels, checked against reference.linear_w4a8)")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/resgen-out"))
    args = ap.parse_args(argv)
    from run_record import run_record

    from resgen.settings import settings

    # the family is experimental (opt-in): this script is its measurement
    names = {n for n in os.environ.get("RESGEN_EXPERIMENTAL", "").split(",") if n}
    os.environ["RESGEN_EXPERIMENTAL"] = ",".join(sorted(names | {FAMILY.NAME}))
    settings.cache_clear()

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    variants = args.variants or [parse_variant(",".join(map(str, v))) for v in VARIANTS]
    ms = [int(x) for x in args.m.split(",")]
    shapes = [s for s in args.shapes.split(",")]
    report: dict = {"run": run_record(__file__, argv, policy=DEFAULT_POLICY),
                    "device": torch.cuda.get_device_name(0) if torch.cuda.is_available()
                    else None, "compensation": args.compensation, "tests": {},
                    "compiles": {}, "rows": [], "errors": []}
    path = out_dir / "linear_sm90_fp8_h200.json"
    rows: dict[tuple[str, int], dict] = {}

    def save() -> None:
        report["rows"] = list(rows.values())
        path.write_text(json.dumps(report, indent=1))

    gen = torch.Generator(device="cuda").manual_seed(0)
    timing_s = 0.0                  # seconds spent timing (tests and compiles not counted)
    try:
        for wload, select, share, first_m in PHASES:
            phase = [v for v in variants if v.wload.value == wload]
            if not phase:
                continue
            if not args.no_tests:
                run_tests(report, out_dir, wload, select)
                save()
            compile_all(report, phase)
            save()
            budget = timing_s + share * args.budget_s if wload == "e4m3" else args.budget_s
            todo = [(m, name) for m in order_m(ms, first_m) for name in shapes]
            for i, (m, name) in enumerate(todo):
                if timing_s > budget:
                    report["errors"].append(f"{wload}: budget reached before {name} m={m} "
                                            f"({len(todo) - i} rows left)")
                    break
                t = time.time()
                time_row(rows, report, name, m, phase, gen, args.compensation)
                timing_s += time.time() - t
                save()
    except (KeyboardInterrupt, RuntimeError) as e:     # a CUDA error poisons the context
        report["errors"].append(f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}")
    save()
    print_table(report["rows"])
    print(f"wrote {path}")
    return 0 if not report["errors"] else 1


def run_tests(report: dict, out_dir: Path, wload: str, select: str) -> None:
    """The GPU test file's `-k select` part in this process (compiles shared)."""
    from gpu_pytest import run_test_file

    test = Path(__file__).resolve().parent.parent / "tests/gpu/test_linear_sm90_fp8_gpu.py"
    res = run_test_file(test, out_dir / f"linear_sm90_fp8_pytest_{wload}.xml",
                        ["-s", "-k", select])
    report["tests"][wload] = res
    print(f"gpu tests ({wload}): exit {res['exit_code']}, {res['passed']} passed, "
          f"{res['failed']} failed", flush=True)


def compile_all(report: dict, variants: list[LinearSm90Fp8Variant]) -> None:
    for v in variants:
        t = time.time()
        try:
            res = compile_once(v, ARCH)
            report["compiles"][v.name()] = {"ok": res.ok, "seconds": round(time.time() - t, 2),
                                            "registers": res.registers,
                                            "spill_bytes": res.spill_bytes,
                                            "error": None if res.ok else str(res.error)[-500:]}
        except Exception as e:          # recorded, the variant skipped
            report["compiles"][v.name()] = {"ok": False, "error": f"{type(e).__name__}: {e}"}


def time_row(rows: dict, report: dict, name: str, m: int,
             variants: list[LinearSm90Fp8Variant], gen: torch.Generator,
             compensation: str = "none") -> None:
    """Time `variants` (checked first) on shape `name` at M = m into rows[(name, m)]; the
    cuBLAS baselines once per row."""
    n, k = SHAPES[name]
    row = rows.get((name, m))
    if row is None:
        row = {"shape": name, "n": n, "k": k, "m": m, "variants": {}}
        nb = _sets(2 * (m * k + n * k + m * n))
        tb = measure(bf16_runner(m, n, k, nb, gen), DEFAULT_POLICY, nb)
        row["bf16_us"], row["bf16_mode"] = tb.median_us, tb.mode
        nf = _sets(m * k + n * k + 2 * m * n)
        tf = measure(fp8_runner(m, n, k, nf, gen), DEFAULT_POLICY, nf)
        row["fp8_us"], row["fp8_mode"] = tf.median_us, tf.mode
        rows[(name, m)] = row
    p = LinearProblem("mxfp4", compensation, m, n, k)
    for v in variants:
        c = report["compiles"].get(v.name(), {})
        if FAMILY.why_invalid(v, p, ARCH) is not None or not c.get("ok"):
            continue
        try:
            sets = _sets(FAMILY.working_set_bytes(v, p))
            r = FAMILY.runner(compile_once(v, ARCH).compiled, v, p, "cuda", n_sets=sets,
                              seed=m)
            chk = r.check()
            ent: dict = {"ok": chk.ok, "rel_err": chk.rel_err, "wload": v.wload.value}
            if chk.ok:
                tv = measure(r, DEFAULT_POLICY, sets)
                ent.update(us=tv.median_us, mode=tv.mode, note=tv.note)
            row["variants"][v.name()] = ent
            del r
        except Exception as e:
            row["variants"][v.name()] = {"ok": False, "error": f"{type(e).__name__}: {e}",
                                         "wload": v.wload.value}
            if "CUDA" in str(e):
                raise
    timed = {k2: e["us"] for k2, e in row["variants"].items() if "us" in e}
    if timed:
        best = min(timed, key=lambda k2: timed[k2])
        row.update(best=best, best_us=timed[best], tflops=2 * m * n * k / timed[best] / 1e6,
                   vs_bf16=row["bf16_us"] / timed[best], vs_fp8=row["fp8_us"] / timed[best])
        by: dict = {}
        for k2, us in timed.items():
            wl = row["variants"][k2]["wload"]
            if wl not in by or us < by[wl]["us"]:
                by[wl] = {"variant": k2, "us": us}
        row["best_by_wload"] = by
    print(f"{name:8s} m={m:5d} bf16 {row['bf16_us']:8.1f} fp8 {row['fp8_us']:8.1f} "
          f"ours {row.get('best_us', float('nan')):8.1f} us ({row.get('best', '-')})",
          flush=True)
    torch.cuda.empty_cache()


def print_table(rows: list[dict]) -> None:
    print("\nshape     M      bf16 us   fp8 us   ours us   x bf16   x fp8   e4m3 us   fp4 us"
          "   best")
    for r in rows:
        if "best_us" in r:
            bw = {wl: e["us"] for wl, e in r.get("best_by_wload", {}).items()}
            print(f"{r['shape']:8s} {r['m']:5d} {r['bf16_us']:9.1f} {r['fp8_us']:8.1f} "
                  f"{r['best_us']:9.1f} {r['vs_bf16']:8.2f} {r['vs_fp8']:7.2f} "
                  f"{bw.get('e4m3', float('nan')):9.1f} {bw.get('fp4', float('nan')):8.1f}   "
                  f"{r['best']}")
        else:
            print(f"{r['shape']:8s} {r['m']:5d} {r['bf16_us']:9.1f} {r['fp8_us']:8.1f}   "
                  "no variant passed")


if __name__ == "__main__":
    sys.exit(main())
