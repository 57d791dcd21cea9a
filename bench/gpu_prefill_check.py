"""GPU check + benchmark of linear_sm90_wgmma (Hopper prefill FP4 linear on WGMMA) on the
Qwen3-8B shapes at prefill sizes, in one process (about 8 minutes):

    scripts/devcache.sh
    source .devcache/device/env.sh && RESGEN_CACHE_DIR=/tmp/resgen-cache \\
        timeout -k 10 -s INT 590 python3 bench/gpu_prefill_check.py      # JSON to $OUT

1. Correctness: tests/gpu/test_linear_sm90_wgmma_gpu.py run in-process by pytest (every variant
   of a small M-Ext problem, a covering subset for both formats and every compensation mode,
   the Qwen3-8B shapes, the quantizer in front, graph replay, subnormal codes); its compiles are
   shared with the timing below (resgen.search.linear_sm90_wgmma.compile_once). `--no-tests`
   skips it. If a kernel error poisoned the CUDA context the timing is skipped.
2. Per shape (gate/up 24576x4096, down 4096x12288, qkv 6144x4096, o 4096x4096):
   - cuBLAS BF16 (torch.matmul) at M = 128 .. 2048;
   - variant selection: a handful of tile configurations, each checked against
     resgen.reference.linear (fresh random inputs, NaN-poisoned output, rel err <= 3e-3, plus a
     bit-identical rerun) and timed on the GEMM alone (prepared activation operand) for NVFP4
     plain; the best two per (shape, M) go on;
   - the whole layer (quant_sm90 writing the xop + the GEMM, two launches: BENCH.md's
     protocol), checked and timed for NVFP4 plain, M-Ext (full) and K-Ext 0.125 / 0.25 / 0.5 /
     1.0, and MXFP4 plain at M = 2048, with the best GEMM variant of that (shape, M).
   M = 2048 and 1024 (the targets) run first, smaller M while the budget lasts
   (RESGEN_BENCH_BUDGET_S, default 280 s for this part; RESGEN_TOTAL_S, default 560 s from the
   start, caps everything). Timing: resgen.search.timing.measure, policy cold-l2-graph.
A variant that fails to compile, check or run is recorded and skipped; a CUDA error that
poisons the context (e.g. a kernel watchdog trap) or SIGINT ends the run with what it has.
Prints a short table last; writes $OUT/linear_sm90_wgmma_prefill.json and
$OUT/linear_sm90_wgmma_pytest.xml.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import baselines as B  # noqa: E402
from resgen.models import get_model  # noqa: E402
from resgen.search.linear_sm90_mma import Packing  # noqa: E402
from resgen.search.linear_sm90_wgmma import (FAMILY, LinearSm90WgmmaVariant,  # noqa: E402
                                             Raster, compile_once)
from resgen.search.timing import DEFAULT_POLICY, CallableRunner, measure  # noqa: E402
from resgen.search.variant import LinearProblem  # noqa: E402

ARCH = "sm_90a"
DEVICE = "cuda"                    # a CPU dry run (tests) swaps in the simulation
OUT = Path(os.environ.get("OUT", "bench/results/h200"))
BUDGET_S = float(os.environ.get("RESGEN_BENCH_BUDGET_S", "280"))
TOTAL_S = float(os.environ.get("RESGEN_TOTAL_S", "560"))
TEST_FILE = Path(__file__).resolve().parent.parent / "tests" / "gpu" / \
    "test_linear_sm90_wgmma_gpu.py"
T_START = time.time()
T0 = time.time()                   # start of the timing part (reset after the tests)
_QWEN3_8B = get_model("qwen3-8b").linear_nk()
SHAPES = {name: _QWEN3_8B[name] for name in ("gate_up", "down", "qkv", "o")}   # priority
MS_FIRST = (2048, 1024)
MS_LATER = (512, 256, 128)
MODES = ("none", "full", "0.125", "0.25", "0.5", "1.0")
REPORT: dict = {"compiles": [], "entries": [], "baselines": [], "errors": []}
_COMPILED: dict[str, object] = {}        # compile key -> in-process callable (or None)
_QUANT: dict[tuple, object] = {}
_BROKEN: list[str] = []            # set once a CUDA error poisoned the context


class ContextBroken(RuntimeError):
    pass


def left() -> float:
    return min(BUDGET_S - (time.time() - T0), TOTAL_S - (time.time() - T_START))


def candidates(m: int) -> list[LinearSm90WgmmaVariant]:
    """Hand-picked tile configurations, most promising first (large M: 128-256 channels x
    128-256 rows; small M: narrower token tiles so that more CTAs fill the 132 SMs)."""
    V = LinearSm90WgmmaVariant
    big = [V(2, 2, 128, 8), V(2, 1, 256, 6), V(2, 1, 128, 6), V(2, 1, 256, 6, Raster.CH),
           V(2, 1, 192, 6), V(2, 2, 128, 8, Raster.TOK, Packing.NIB)]
    small = [V(2, 1, 128, 6), V(2, 1, 64, 8), V(1, 1, 64, 8), V(2, 2, 64, 8), V(1, 2, 128, 6)]
    return big if m >= 1024 else small


def _sticky_check() -> None:
    """Raise ContextBroken if the CUDA context no longer works (sticky kernel error)."""
    try:
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        torch.zeros(1, device=DEVICE).add_(1).item()
    except Exception as e:
        _BROKEN.append(f"{type(e).__name__}: {e}"[:500])
        raise ContextBroken(_BROKEN[-1]) from None


def compiled(v: LinearSm90WgmmaVariant, p: LinearProblem):
    key = v.key() + FAMILY.compile_key(v, p).key()
    if key not in _COMPILED:
        out = compile_once(v, p, ARCH)
        REPORT["compiles"].append({"variant": v.key(), "problem": FAMILY.compile_key(v, p).key(),
                                   "ok": out.ok, "seconds": out.seconds,
                                   "registers": out.registers, "spill_bytes": out.spill_bytes,
                                   "fingerprint": out.fingerprint, "error": out.error})
        _COMPILED[key] = out.compiled if out.ok else None
    return _COMPILED[key]


def quantizer_for(p: LinearProblem):
    """quant_sm90 (default configuration, xop only, kp_align 256) in front of problem p."""
    from resgen.kernels.quant_sm90 import QuantConfig, compile_config

    key = (p.fmt, p.compensation, p.k, p.static_scale)
    if key not in _QUANT:
        alpha = "none" if p.fmt == "mxfp4" else ("static" if p.static_scale else "dynamic")
        layout = "row_pair" if p.compensation == "full" else "plain"
        cfg = QuantConfig(p.fmt, p.compensation, p.k, layout, write_codes=False,
                          write_xop=True, alpha=alpha, kp_align=256)
        _QUANT[key] = compile_config(cfg)[0]
    return _QUANT[key]


def run_entry(shape: str, p: LinearProblem, v: LinearSm90WgmmaVariant,
              with_quantizer: bool) -> dict | None:
    """Compile (cached), check, time one (problem, variant); None if it failed."""
    if _BROKEN:
        raise ContextBroken(_BROKEN[0])
    rec = {"shape": shape, "problem": p.key(), "variant": v.key(), "name": v.name(),
           "fmt": p.fmt, "mode": p.compensation, "m": p.m, "quantizer": with_quantizer}
    try:
        fn = compiled(v, p)
        if fn is None:
            rec["error"] = "compile failed"
            REPORT["entries"].append(rec)
            return None
        n_sets = DEFAULT_POLICY.sets_for(FAMILY.working_set_bytes(v, p))
        r = FAMILY.runner(fn, v, p, DEVICE, n_sets=n_sets, seed=0)
        if with_quantizer:
            r.attach_quantizer(quantizer_for(p))
        timed = r if with_quantizer else r.gemm_only()      # the GEMM alone on a torch operand
        chk = r.check_quantized() if with_quantizer else timed.check()
        rec["check"] = {"ok": chk.ok, "rel_err": chk.rel_err, "detail": chk.detail}
        if not chk.ok:
            rec["error"] = "check failed: " + chk.detail
            REPORT["entries"].append(rec)
            return None
        if not with_quantizer:
            x = torch.randn(p.m, p.k, device=DEVICE)
            a, b = r.run_on(x), r.run_on(x)
            rec["bit_identical_rerun"] = bool(torch.equal(a.view(torch.int16),
                                                          b.view(torch.int16)))
        t = measure(timed, DEFAULT_POLICY, n_sets)
        rec["timing"] = dataclasses.asdict(t)
        rec["median_us"] = t.median_us
        rec["tflops"] = 2.0 * p.rows * p.n * (kp_eff(p)) / (t.median_us * 1e-6) / 1e12
        REPORT["entries"].append(rec)
        return rec
    except ContextBroken:
        raise
    except Exception as e:
        rec["error"] = f"{type(e).__name__}: {e}"[:2000]
        rec["traceback"] = traceback.format_exc()[-3000:]
        REPORT["entries"].append(rec)
        _sticky_check()
        return None


def kp_eff(p: LinearProblem) -> int:
    """Reduction length of the useful work (K, or K + ext)."""
    return p.k_ext(16 if p.fmt == "nvfp4" else 32)


def baseline(shape: str, n: int, k: int, m: int) -> None:
    rec = {"shape": shape, "m": m, "baseline": "cublas_bf16"}
    try:
        n_sets = DEFAULT_POLICY.sets_for(n * k * 2 + m * k * 2)
        fns = []
        for _ in range(n_sets):
            w = torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16)
            x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
            fns.append(B.cublas_bf16(x, w))
        t = measure(CallableRunner(fns), DEFAULT_POLICY, n_sets)
        rec["median_us"] = t.median_us
        rec["tflops"] = 2.0 * m * n * k / (t.median_us * 1e-6) / 1e12
        rec["timing"] = dataclasses.asdict(t)
        del fns
    except Exception as e:
        rec["error"] = f"{type(e).__name__}: {e}"[:1000]
    REPORT["baselines"].append(rec)


def best(entries: list[dict]) -> dict | None:
    ok = [e for e in entries if e and e.get("median_us")]
    return min(ok, key=lambda e: e["median_us"]) if ok else None


def select(shape: str, n: int, k: int, m: int) -> list[LinearSm90WgmmaVariant]:
    """GEMM-only NVFP4 plain timings of the candidates; the best two, fastest first."""
    p = LinearProblem("nvfp4", "none", m, n, k)
    res = []
    for v in candidates(m):
        if left() > 0 and FAMILY.why_invalid(v, p, ARCH) is None:
            res.append(run_entry(shape, p, v, with_quantizer=False))
    order = sorted([r for r in res if r], key=lambda r: r["median_us"])
    return [LinearSm90WgmmaVariant.from_key(r["variant"]) for r in order[:2]]


def layer_block(shape: str, n: int, k: int, m: int) -> None:
    """Whole-layer timings of every mode at one M with the selected variants."""
    top = select(shape, n, k, m)
    if not top:
        return
    for mode in MODES:
        p = LinearProblem("nvfp4", mode, m, n, k)
        for v in top[:2] if mode in ("none", "full") else top[:1]:
            if left() > 0 and FAMILY.why_invalid(v, p, ARCH) is None:
                run_entry(shape, p, v, with_quantizer=True)
    if m == 2048:
        p = LinearProblem("mxfp4", "none", m, n, k)
        if left() > 0 and FAMILY.why_invalid(top[0], p, ARCH) is None:
            run_entry(shape, p, top[0], with_quantizer=False)
            run_entry(shape, p, top[0], with_quantizer=True)


def environment() -> dict:
    from resgen.search.record import current_environment

    env = dataclasses.asdict(current_environment())
    env["date"] = datetime.datetime.now(datetime.timezone.utc).isoformat()
    env["policy"] = DEFAULT_POLICY.as_dict()
    env["policy_label"] = DEFAULT_POLICY.label
    env["timed_op"] = ("entries with quantizer=false: GEMM + fold + epilogue on a prepared "
                       "activation operand; quantizer=true: quant_sm90 + GEMM (whole layer)")
    return env


def table() -> list[str]:
    """Whole-layer (quantizer + GEMM) medians per (shape, M): plain vs cuBLAS BF16, then each
    compensation relative to plain; '-' where nothing was measured."""
    q = [e for e in REPORT["entries"] if e.get("median_us") and e.get("quantizer")]
    g = [e for e in REPORT["entries"] if e.get("median_us") and not e.get("quantizer")]
    bases = {(b["shape"], b["m"]): b.get("median_us") for b in REPORT["baselines"]}

    def us(entries, shape, m, mode, fmt="nvfp4"):
        b = best([e for e in entries if e["shape"] == shape and e["m"] == m
                  and e["mode"] == mode and e["fmt"] == fmt])
        return b["median_us"] if b else math.nan

    lines = [f"{'shape':8} {'M':>5} {'cuBLAS':>8} {'plain':>8} {'xBF16':>6} {'TF/s':>5} "
             f"{'gemm':>8} {'Mext/pl':>7} {'K.125':>6} {'K.25':>6} {'K.5':>6} {'K1.0':>6} "
             f"{'K1/Mext':>7}"]
    ratios: dict[str, list[float]] = {"xbf16": [], "k125": [], "mext_vs_k1": []}
    for shape, (n, k) in SHAPES.items():
        for m in MS_FIRST + MS_LATER:
            pl = us(q, shape, m, "none")
            bf = bases.get((shape, m)) or math.nan
            if math.isnan(pl) and math.isnan(bf):
                continue
            full = us(q, shape, m, "full")
            kx = {r: us(q, shape, m, r) for r in ("0.125", "0.25", "0.5", "1.0")}
            tf = 2.0 * m * n * k / (pl * 1e-6) / 1e12 if pl == pl else math.nan
            lines.append(
                f"{shape:8} {m:>5} {bf:8.1f} {pl:8.1f} {bf / pl:6.2f} {tf:5.0f} "
                f"{us(g, shape, m, 'none'):8.1f} {full / pl:7.3f} "
                + " ".join(f"{kx[r] / pl:6.3f}" for r in ("0.125", "0.25", "0.5", "1.0"))
                + f" {kx['1.0'] / full:7.3f}")
            if m in MS_FIRST:
                ratios["xbf16"].append(bf / pl)
                ratios["k125"].append(kx["0.125"] / pl)
                ratios["mext_vs_k1"].append(kx["1.0"] / full)
        mx = us(q, shape, 2048, "none", "mxfp4")
        if mx == mx:
            lines.append(f"{shape:8}  2048 MXFP4 plain whole layer {mx:.1f} us "
                         f"(x{(bases.get((shape, 2048)) or math.nan) / mx:.2f} vs cuBLAS BF16)")

    def fmt(xs):
        xs = [x for x in xs if x == x]
        return f"min {min(xs):.3f} / max {max(xs):.3f}" if xs else "n/a"

    lines.append(f"targets at M = 1024-2048 (whole layer): plain vs cuBLAS BF16 >= 0.9: "
                 f"{fmt(ratios['xbf16'])}; K-Ext 0.125 / plain <= 1.10: {fmt(ratios['k125'])}; "
                 f"K-Ext 1.0 / M-Ext >= 1.5: {fmt(ratios['mext_vs_k1'])}")
    return lines


def run_tests() -> bool:
    """The GPU test module in this process; False if interrupted or the context is broken."""
    import pytest

    from gpu_pytest import run_test_file

    res = run_test_file(TEST_FILE, OUT / "linear_sm90_wgmma_pytest.xml", ["--maxfail=20"])
    res["seconds"] = round(res["seconds"], 1)
    REPORT["tests"] = res
    print(f"[{time.time() - T_START:6.1f} s] GPU tests: {res['passed']} passed, "
          f"{res['failed']} failed (exit {res['exit_code']})", flush=True)
    if res["exit_code"] == int(pytest.ExitCode.INTERRUPTED):
        return False
    try:
        _sticky_check()
    except ContextBroken as e:
        REPORT["errors"].append(f"CUDA context broken after the tests: {e}")
        return False
    return True


def main(argv: list[str] | None = None) -> None:
    """argv: the command-line flags (None: none; the environment variables of the module
    docstring are their defaults, so the commands cited in bench/results/h200 still work)."""
    global T0, OUT, BUDGET_S, TOTAL_S
    import argparse

    from run_record import run_record

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget-s", type=float, default=BUDGET_S,
                    help="seconds for the layer timings (default: RESGEN_BENCH_BUDGET_S, "
                         "else 280)")
    ap.add_argument("--total-s", type=float, default=TOTAL_S,
                    help="seconds from the start that cap everything (default: "
                         "RESGEN_TOTAL_S, else 560)")
    ap.add_argument("--out", type=Path, default=OUT, help="output folder (default: $OUT)")
    ap.add_argument("--no-tests", action="store_true", help="skip the GPU test file")
    args = ap.parse_args([] if argv is None else argv)
    OUT, BUDGET_S, TOTAL_S = args.out, args.budget_s, args.total_s
    REPORT["run"] = run_record(__file__, [] if argv is None else argv, policy=DEFAULT_POLICY,
                               budget_s=BUDGET_S, total_s=TOTAL_S)
    OUT.mkdir(parents=True, exist_ok=True)
    try:
        REPORT["environment"] = environment()
    except Exception as e:
        REPORT["errors"].append(f"environment: {type(e).__name__}: {e}")
    path = OUT / "linear_sm90_wgmma_prefill.json"
    go = True
    if not args.no_tests:
        try:
            go = run_tests()
        except KeyboardInterrupt:
            go = False
            REPORT["errors"].append("interrupted during the GPU tests")
        path.write_text(json.dumps(REPORT, indent=1, default=str))
    T0 = time.time()
    try:
        for ms in (MS_FIRST, MS_LATER) if go else ():
            for shape, (n, k) in SHAPES.items():
                for m in ms:
                    if left() <= 0:
                        break
                    try:
                        baseline(shape, n, k, m)
                        layer_block(shape, n, k, m)
                    except ContextBroken:
                        raise
                    except Exception as e:
                        REPORT["errors"].append(f"{shape} M={m}: {type(e).__name__}: {e}\n"
                                                f"{traceback.format_exc()[-2000:]}")
                        _sticky_check()
                    done = [e for e in REPORT["entries"] if e["shape"] == shape and e["m"] == m]
                    print(f"[{time.time() - T0:6.1f} s] {shape} M={m}: {len(done)} entries, "
                          f"{sum(1 for e in done if 'error' in e)} failed", flush=True)
                    path.write_text(json.dumps(REPORT, indent=1, default=str))
    except ContextBroken as e:
        REPORT["errors"].append(f"CUDA context broken, run stopped: {e}")
    except KeyboardInterrupt:
        REPORT["errors"].append("interrupted (SIGINT): partial results")
    REPORT["seconds"] = round(time.time() - T_START, 1)
    lines = table()
    REPORT["table"] = lines
    path.write_text(json.dumps(REPORT, indent=1, default=str))
    failed = [e for e in REPORT["entries"] if "error" in e]
    nondet = [e for e in REPORT["entries"] if e.get("bit_identical_rerun") is False]
    tests = REPORT.get("tests")
    if tests:
        print(f"GPU tests: {tests['passed']} passed, {tests['failed']} failed, "
              f"{tests['seconds']} s")
        for r in [r for r in tests["rows"] if r["outcome"] == "failed"][:6]:
            print(f"  TEST FAILED {r['test']}: {r['detail'][-300:]}")
    print(f"linear_sm90_wgmma on {REPORT.get('environment', {}).get('gpu_name', '?')}: "
          f"{len(REPORT['entries'])} entries, {len(failed)} failed, {len(nondet)} "
          f"non-deterministic, {sum(1 for c in REPORT['compiles'] if not c['ok'])} compile "
          f"errors, {REPORT['seconds']} s")
    for e in failed[:8]:
        print(f"  FAILED {e['shape']} {e['fmt']} {e['mode']} M={e['m']} {e['name']}: "
              f"{e['error'][:150]}")
    for err in REPORT["errors"][:4]:
        print("  ERROR", err[:300])
    print("\n".join(lines))
    print(f"JSON: {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
