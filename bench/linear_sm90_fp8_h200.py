"""GPU check + timing of linear_sm90_fp8 (MXFP4 W4A4 on Hopper's FP8 tensor cores, issue 20
section 3) on Qwen3-8B's four projections, in one process (about 4-6 minutes, compiles
included):

    source .devcache/device/env.sh && RESGEN_CACHE_DIR=/tmp/resgen-cache \\
        timeout -k 10 -s INT 590 python3 bench/linear_sm90_fp8_h200.py     # JSON to $OUT

1. Correctness: tests/gpu/test_linear_sm90_fp8_gpu.py run in-process by pytest (its compiles
   are shared with the timing: resgen.search.linear_sm90_fp8.compile_once). `--no-tests`
   skips it; a failed test file does not stop the timing, but every timed variant is checked
   again here (reference, NaN-poisoned output) and skipped when it fails.
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
--budget-s caps the timing part (default 420 s); SIGINT or a CUDA error ends the run with what
it has. Writes $OUT/linear_sm90_fp8_h200.json (+ _pytest.xml) and prints a table last.
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


def order_m(ms: list[int]) -> list[int]:
    """The targets first: 2048 (prefill) and 128 (the FP8 crossover), then the rest."""
    first = [m for m in (2048, 128) if m in ms]
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--m", default="64,128,256,2048")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--variants", type=parse_variant, nargs="*", default=None,
                    help="c,bn,stages,group,parts,raster[,wload] (default: VARIANTS)")
    ap.add_argument("--budget-s", type=float, default=420.0)
    ap.add_argument("--no-tests", action="store_true")
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
    ms = order_m([int(x) for x in args.m.split(",")])
    shapes = [s for s in args.shapes.split(",")]
    report: dict = {"run": run_record(__file__, argv, policy=DEFAULT_POLICY),
                    "device": torch.cuda.get_device_name(0) if torch.cuda.is_available()
                    else None, "tests": None, "compiles": {}, "rows": [], "errors": []}
    path = out_dir / "linear_sm90_fp8_h200.json"

    def save() -> None:
        path.write_text(json.dumps(report, indent=1))

    if not args.no_tests:
        from gpu_pytest import run_test_file

        test = Path(__file__).resolve().parent.parent / "tests/gpu/test_linear_sm90_fp8_gpu.py"
        report["tests"] = run_test_file(test, out_dir / "linear_sm90_fp8_pytest.xml", ["-s"])
        print(f"gpu tests: exit {report['tests']['exit_code']}, "
              f"{report['tests']['passed']} passed, {report['tests']['failed']} failed",
              flush=True)
        save()
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
    save()
    start = time.time()
    gen = torch.Generator(device="cuda").manual_seed(0)
    try:
        for m in ms:
            for name in shapes:
                n, k = SHAPES[name]
                if time.time() - start > args.budget_s:
                    report["errors"].append(f"budget reached before {name} m={m}")
                    raise StopIteration
                row: dict = {"shape": name, "n": n, "k": k, "m": m, "variants": {}}
                nb = _sets(2 * (m * k + n * k + m * n))
                tb = measure(bf16_runner(m, n, k, nb, gen), DEFAULT_POLICY, nb)
                row["bf16_us"], row["bf16_mode"] = tb.median_us, tb.mode
                nf = _sets(m * k + n * k + 2 * m * n)
                tf = measure(fp8_runner(m, n, k, nf, gen), DEFAULT_POLICY, nf)
                row["fp8_us"], row["fp8_mode"] = tf.median_us, tf.mode
                p = LinearProblem("mxfp4", "none", m, n, k)
                for v in variants:
                    c = report["compiles"].get(v.name(), {})
                    why = FAMILY.why_invalid(v, p, ARCH)
                    if why is not None or not c.get("ok"):
                        continue
                    try:
                        sets = _sets(FAMILY.working_set_bytes(v, p))
                        r = FAMILY.runner(compile_once(v, ARCH).compiled, v, p, "cuda",
                                          n_sets=sets, seed=m)
                        chk = r.check()
                        ent: dict = {"ok": chk.ok, "rel_err": chk.rel_err,
                                     "wload": v.wload.value}
                        if chk.ok:
                            tv = measure(r, DEFAULT_POLICY, sets)
                            ent.update(us=tv.median_us, mode=tv.mode, note=tv.note)
                        row["variants"][v.name()] = ent
                        del r
                    except Exception as e:
                        row["variants"][v.name()] = {"ok": False,
                                                     "error": f"{type(e).__name__}: {e}"}
                        if "CUDA" in str(e):
                            raise
                timed = {k2: e["us"] for k2, e in row["variants"].items() if "us" in e}
                if timed:
                    best = min(timed, key=lambda k2: timed[k2])
                    row["best"] = best
                    row["best_us"] = timed[best]
                    row["tflops"] = 2 * m * n * k / timed[best] / 1e6
                    row["vs_bf16"] = row["bf16_us"] / timed[best]
                    row["vs_fp8"] = row["fp8_us"] / timed[best]
                    by: dict = {}
                    for k2, us in timed.items():
                        wl = row["variants"][k2]["wload"]
                        if wl not in by or us < by[wl][1]:
                            by[wl] = (k2, us)
                    row["best_by_wload"] = {wl: {"variant": k2, "us": us}
                                            for wl, (k2, us) in by.items()}
                report["rows"].append(row)
                save()
                print(f"{name:8s} m={m:5d} bf16 {row['bf16_us']:8.1f} fp8 {row['fp8_us']:8.1f} "
                      f"ours {row.get('best_us', float('nan')):8.1f} us "
                      f"({row.get('best', '-')})", flush=True)
                torch.cuda.empty_cache()
    except StopIteration:
        pass
    except (KeyboardInterrupt, RuntimeError) as e:     # a CUDA error poisons the context
        report["errors"].append(f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}")
    save()
    print("\nshape     M      bf16 us   fp8 us   ours us   x bf16   x fp8   e4m3 us   fp4 us"
          "   best")
    for r in report["rows"]:
        if "best_us" in r:
            bw = {wl: e["us"] for wl, e in r.get("best_by_wload", {}).items()}
            print(f"{r['shape']:8s} {r['m']:5d} {r['bf16_us']:9.1f} {r['fp8_us']:8.1f} "
                  f"{r['best_us']:9.1f} {r['vs_bf16']:8.2f} {r['vs_fp8']:7.2f} "
                  f"{bw.get('e4m3', float('nan')):9.1f} {bw.get('fp4', float('nan')):8.1f}   "
                  f"{r['best']}")
        else:
            print(f"{r['shape']:8s} {r['m']:5d} {r['bf16_us']:9.1f} {r['fp8_us']:8.1f}   "
                  "no variant passed")
    print(f"wrote {path}")
    return 0 if not report["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
