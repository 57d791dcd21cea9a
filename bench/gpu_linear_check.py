"""GPU check + benchmark of linear_sm90_mma (Hopper decode FP4 linear) on the Qwen3-8B shapes.

    mkdir -p .devcache && cp -r ../shared/device .devcache/
    source .devcache/device/env.sh && RESGEN_CACHE_DIR=/tmp/resgen-cache \
        python3 bench/gpu_linear_check.py                  # about 5 minutes; JSON to $OUT

For each shape (qkv 6144x4096, o 4096x4096, gate/up 24576x4096, down 4096x12288), NVFP4 plain and
M-Ext: a dozen candidate variants are compiled, checked against resgen.reference.linear (fresh
random inputs, NaN-poisoned output, rel err <= 3e-3) and timed at M = 1 (all candidates), 4, 16
(the best, with token tiles sized for the rows) and 64 (the best two); MXFP4 with the best NVFP4
configurations at M = 1 and 16; cuBLAS BF16 (torch.matmul) and FP8 (torch._scaled_mm) at the
same M. Timing: resgen.search.timing.measure, policy cold-l2-graph (CUDA graph of many launches,
input sets rotated past 2 x the 60 MB L2, median of 7). Most entries time the GEMM + fold + epilogue
on a prepared activation operand; for the best NVFP4 variant per (shape, mode, M in {1, 16})
the whole layer is timed too: quant_sm90 (default config, xop only) + the GEMM, two launches
(column "q+g us", BENCH.md's protocol). A variant that fails to compile, check or run is recorded and
skipped; a time budget (RESGEN_BENCH_BUDGET_S, default 330 s) stops timing new entries.
Prints a short table last; writes $OUT/linear_sm90_check.json.
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
from resgen.search import build  # noqa: E402
from resgen.search.linear_sm90 import (FAMILY, LinearSm90Variant, Packing,  # noqa: E402
                                       Pipeline, Reduction)
from resgen.search.timing import DEFAULT_POLICY, measure  # noqa: E402
from resgen.search.variant import LinearProblem  # noqa: E402

ARCH = "sm_90a"
OUT = Path(os.environ.get("OUT", "bench/results/h200"))
BUDGET_S = float(os.environ.get("RESGEN_BENCH_BUDGET_S", "330"))
T0 = time.time()
# most important first: the time budget may stop the last ones
SHAPES = {"gate_up": (24576, 4096), "down": (4096, 12288), "qkv": (6144, 4096),
          "o": (4096, 4096)}
REPORT: dict = {"compiles": [], "entries": [], "baselines": [], "errors": []}
_COMPILED: dict[str, object] = {}


def left() -> float:
    return BUDGET_S - (time.time() - T0)


def candidates(p: LinearProblem, nt: int) -> list[LinearSm90Variant]:
    """Hand-picked decode configurations, the valid ones for p (token tile nt)."""
    S, N = Packing.SPLIT, Packing.NIB
    W, A, Z = Reduction.WORKSPACE, Reduction.ATOMIC, Reduction.NONE
    CP, DI, RG = Pipeline.CP_ASYNC, Pipeline.DIRECT, Pipeline.REGS

    def V(wm, wk, mt=1, pl=CP, st=4, sk=1, red=Z, pk=S, u=1, l2=0):
        return LinearSm90Variant(wm, wk, mt, nt, u, pl, st, l2, sk, red, pk)

    raw = [
        V(1, 4), V(4, 1), V(2, 2), V(1, 8), V(2, 4), V(4, 2), V(2, 2, 2),
        V(1, 4, st=3), V(1, 8, st=3), V(1, 4, pl=DI, st=1), V(4, 2, pl=RG, st=1),
        V(4, 1, pl=DI, st=1, l2=2), V(1, 4, pl=DI, st=1, l2=1),
        V(1, 4, sk=2, red=W), V(1, 8, st=3, sk=2, red=W), V(1, 4, sk=2, red=A),
        V(1, 4, u=2, st=3), V(1, 4, pk=N),
    ]
    out = []
    for v in raw:
        if FAMILY.why_invalid(v, p, ARCH) is None and v not in out:
            out.append(v)
    return out


def compiled(v: LinearSm90Variant, p: LinearProblem):
    key = v.key() + FAMILY.compile_key(v, p).key()
    if key not in _COMPILED:
        t = time.time()
        out = build.compile_variant(FAMILY, v, p, ARCH)
        REPORT["compiles"].append({"variant": v.key(), "problem": FAMILY.compile_key(v, p).key(),
                                   "ok": out.ok, "seconds": round(time.time() - t, 2),
                                   "registers": out.registers, "spill_bytes": out.spill_bytes,
                                   "fingerprint": out.fingerprint, "error": out.error})
        _COMPILED[key] = out.compiled if out.ok else None
    return _COMPILED[key]


_QUANT: dict[tuple, object] = {}


def quantizer_for(p: LinearProblem):
    """The fused quantizer (quant_sm90, default configuration, xop only, kp_align 256) in
    front of problem p; compiled once per (fmt, compensation, K)."""
    from resgen.kernels.quant_sm90 import QuantConfig, compile_config

    key = (p.fmt, p.compensation, p.k, p.static_scale)
    if key not in _QUANT:
        alpha = "none" if p.fmt == "mxfp4" else ("static" if p.static_scale else "dynamic")
        layout = "row_pair" if p.compensation == "full" else "plain"
        cfg = QuantConfig(p.fmt, p.compensation, p.k, layout, write_codes=False,
                          write_xop=True, alpha=alpha, kp_align=256)
        _QUANT[key] = compile_config(cfg)[0]
    return _QUANT[key]


def run_entry(shape: str, p: LinearProblem, v: LinearSm90Variant,
              with_quantizer: bool = False) -> dict | None:
    """Compile (cached), check, time one (problem, variant); None if it failed. With the
    quantizer: the timed call is quant_sm90 + the GEMM (BENCH.md's linear-layer protocol)."""
    rec = {"shape": shape, "problem": p.key(), "variant": v.key(), "name": v.name(),
           "fmt": p.fmt, "mode": p.compensation, "m": p.m, "quantizer": with_quantizer}
    try:
        fn = compiled(v, p)
        if fn is None:
            rec["error"] = "compile failed"
            REPORT["entries"].append(rec)
            return None
        n_sets = DEFAULT_POLICY.sets_for(FAMILY.working_set_bytes(v, p))
        r = FAMILY.runner(fn, v, p, "cuda", n_sets=n_sets, seed=0)
        if with_quantizer:
            r.attach_quantizer(quantizer_for(p))
        chk = r.check_quantized() if with_quantizer else r.check()
        rec["check"] = {"ok": chk.ok, "rel_err": chk.rel_err, "detail": chk.detail}
        if not chk.ok:
            rec["error"] = "check failed: " + chk.detail
            REPORT["entries"].append(rec)
            return None
        if v.deterministic and not with_quantizer:
            x = torch.randn(p.m, p.k, device="cuda")
            a, b = r.run_on(x), r.run_on(x)
            rec["bit_identical_rerun"] = bool(torch.equal(a.view(torch.int16),
                                                          b.view(torch.int16)))
        t = measure(r, DEFAULT_POLICY, n_sets)
        rec["timing"] = dataclasses.asdict(t)
        rec["median_us"] = t.median_us
        REPORT["entries"].append(rec)
        return rec
    except Exception as e:
        rec["error"] = f"{type(e).__name__}: {e}"[:2000]
        rec["traceback"] = traceback.format_exc()[-3000:]
        REPORT["entries"].append(rec)
        torch.cuda.synchronize()
        return None


class _MatmulRunner:
    def __init__(self, fns):
        self.fns, self.i = fns, 0

    def rotate(self, i: int) -> None:
        self.i = i % len(self.fns)

    def __call__(self):
        return self.fns[self.i]()


def baseline(shape: str, n: int, k: int, m: int) -> None:
    for name, make in (("cublas_bf16", B.cublas_bf16), ("cublas_fp8", B.cublas_fp8)):
        rec = {"shape": shape, "m": m, "baseline": name}
        try:
            n_sets = DEFAULT_POLICY.sets_for(n * k * 2 if name == "cublas_bf16" else n * k)
            fns = []
            for _ in range(n_sets):
                w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                fns.append(make(x, w))
            t = measure(_MatmulRunner(fns), DEFAULT_POLICY, n_sets)
            rec["median_us"] = t.median_us
            rec["timing"] = dataclasses.asdict(t)
            del fns
        except Exception as e:
            rec["error"] = f"{type(e).__name__}: {e}"[:1000]
        REPORT["baselines"].append(rec)


def best(entries: list[dict]) -> dict | None:
    ok = [e for e in entries if e and e.get("median_us")]
    return min(ok, key=lambda e: e["median_us"]) if ok else None


def shape_block(shape: str, n: int, k: int) -> None:
    for m in (1, 4, 16, 64):
        if left() > 0:
            baseline(shape, n, k, m)
    ranked: dict[str, list[LinearSm90Variant]] = {}
    for mode in ("none", "full"):
        p1 = LinearProblem("nvfp4", mode, 1, n, k)
        res = [run_entry(shape, p1, v) for v in candidates(p1, 1) if left() > 0]
        order = sorted([r for r in res if r], key=lambda r: r["median_us"])
        top = [LinearSm90Variant.from_key(r["variant"]) for r in order]
        ranked[mode] = top
        p4 = dataclasses.replace(p1, m=4)
        for v in top[:5]:
            if left() > 0:
                run_entry(shape, p4, v)
        p16 = dataclasses.replace(p1, m=16)
        nt16 = min(4, -(-p16.rows // 8))
        for v in top[:3]:
            for nt in sorted({1, nt16}):
                vv = dataclasses.replace(v, n_tiles=nt)
                if left() > 0 and FAMILY.why_invalid(vv, p16, ARCH) is None:
                    run_entry(shape, p16, vv)
        p64 = dataclasses.replace(p1, m=64)
        for v in top[:1]:
            for nt in (4, 8):
                vv = dataclasses.replace(v, n_tiles=nt)
                if left() > 0 and FAMILY.why_invalid(vv, p64, ARCH) is None:
                    run_entry(shape, p64, vv)
    for mode in ("none", "full"):            # the whole layer: quantizer + GEMM
        for m in (1, 16):
            p = LinearProblem("nvfp4", mode, m, n, k)
            b = best([e for e in REPORT["entries"] if e["shape"] == shape and e["m"] == m
                      and e["mode"] == mode and e["fmt"] == "nvfp4"
                      and not e.get("quantizer")])
            if b is not None and left() > 0:
                run_entry(shape, p, LinearSm90Variant.from_key(b["variant"]),
                          with_quantizer=True)
    for mode in ("none", "full"):
        for m in (1, 16):
            p = LinearProblem("mxfp4", mode, m, n, k)
            nt = 1 if m == 1 else min(4, -(-p.rows // 8))
            for v in ranked.get(mode, [])[:2]:
                vv = dataclasses.replace(v, n_tiles=nt)
                if left() > 0 and FAMILY.why_invalid(vv, p, ARCH) is None:
                    run_entry(shape, p, vv)


def environment() -> dict:
    from resgen.search.record import current_environment

    env = dataclasses.asdict(current_environment())
    env["date"] = datetime.datetime.now(datetime.timezone.utc).isoformat()
    env["policy"] = DEFAULT_POLICY.as_dict()
    env["policy_label"] = DEFAULT_POLICY.label
    env["timed_op"] = ("entries with quantizer=false: GEMM + fold + epilogue on a prepared "
                       "activation operand; quantizer=true: quant_sm90 + GEMM")
    return env


def table() -> list[str]:
    ents = [e for e in REPORT["entries"] if e.get("median_us") and not e.get("quantizer")]
    qents = [e for e in REPORT["entries"] if e.get("median_us") and e.get("quantizer")]
    bases = {(b["shape"], b["m"], b["baseline"]): b.get("median_us")
             for b in REPORT["baselines"]}
    lines = [f"{'shape':8} {'fmt':5} {'mode':4} {'M':>3} {'us':>7} {'%floor':>6} "
             f"{'xBF16':>6} {'xFP8':>5} {'ext/pl':>6} {'q+g us':>7}  best variant (GEMM only)"]
    sums: dict[tuple, float] = {}
    qsums: dict[tuple, float] = {}
    for shape, (n, k) in SHAPES.items():
        floor = {"nvfp4": B.floor_us(B.nvfp4_weight_bytes(n, k)),
                 "mxfp4": B.floor_us(B.mxfp4_weight_bytes(n, k))}
        for fmt in ("nvfp4", "mxfp4"):
            for m in (1, 4, 16, 64):
                plain = None
                for mode in ("none", "full"):
                    b = best([e for e in ents if e["shape"] == shape and e["fmt"] == fmt
                              and e["mode"] == mode and e["m"] == m])
                    if b is None:
                        continue
                    us = b["median_us"]
                    bf = bases.get((shape, m, "cublas_bf16"))
                    f8 = bases.get((shape, m, "cublas_fp8"))
                    ratio = ""
                    if mode == "none":
                        plain = us
                    elif plain:
                        ratio = f"{us / plain:.3f}"
                    sums.setdefault((fmt, mode, m), 0.0)
                    sums[(fmt, mode, m)] += us
                    qb = best([e for e in qents if e["shape"] == shape and e["fmt"] == fmt
                               and e["mode"] == mode and e["m"] == m])
                    qus = qb["median_us"] if qb else math.nan
                    if qb:
                        qsums.setdefault((fmt, mode, m), 0.0)
                        qsums[(fmt, mode, m)] += qus
                    lines.append(
                        f"{shape:8} {fmt:5} {mode:4} {m:>3} {us:7.2f} "
                        f"{100 * floor[fmt] / us:5.0f}% "
                        f"{(bf / us if bf else math.nan):6.2f} {(f8 / us if f8 else math.nan):5.2f} "
                        f"{ratio:>6} {qus:7.2f}  {b['name'].split(':', 1)[1]}")
    for (fmt, mode, m), s in sorted(sums.items()):
        bf = sum(bases.get((sh, m, "cublas_bf16")) or math.nan for sh in SHAPES)
        f8 = sum(bases.get((sh, m, "cublas_fp8")) or math.nan for sh in SHAPES)
        q = qsums.get((fmt, mode, m))
        qtxt = (f"; with quantizer {q:.2f} us, x{bf / q:.2f} / x{f8 / q:.2f}"
                if q is not None else "")
        lines.append(f"sum of 4 shapes {fmt} {mode} M={m}: GEMM {s:.2f} us, x{bf / s:.2f} vs "
                     f"cuBLAS BF16 ({bf:.2f} us), x{f8 / s:.2f} vs FP8{qtxt} "
                     f"(targets: x3.5 / x2.0)")
    return lines


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    try:
        REPORT["environment"] = environment()
    except Exception as e:
        REPORT["errors"].append(f"environment: {type(e).__name__}: {e}")
    path = OUT / "linear_sm90_check.json"
    for shape, (n, k) in SHAPES.items():
        try:
            shape_block(shape, n, k)
        except Exception as e:
            REPORT["errors"].append(f"{shape}: {type(e).__name__}: {e}\n"
                                    f"{traceback.format_exc()[-2000:]}")
        done = [e for e in REPORT["entries"] if e["shape"] == shape]
        print(f"[{time.time() - T0:6.1f} s] {shape}: {len(done)} entries, "
              f"{sum(1 for e in done if 'error' in e)} failed", flush=True)
        path.write_text(json.dumps(REPORT, indent=1, default=str))     # partial results
    REPORT["seconds"] = round(time.time() - T0, 1)
    lines = table()
    REPORT["table"] = lines
    path.write_text(json.dumps(REPORT, indent=1, default=str))
    failed = [e for e in REPORT["entries"] if "error" in e]
    nondet = [e for e in REPORT["entries"] if e.get("bit_identical_rerun") is False]
    print(f"linear_sm90_mma on {REPORT.get('environment', {}).get('gpu_name', '?')}: "
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
    main()
