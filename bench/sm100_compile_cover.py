"""Compile sm_100a variants on the CPU (no Blackwell GPU exists here) and record, per variant,
the compile time, registers, local memory and what its PTX check found; JSON out, a short table
last.

    python bench/sm100_compile_cover.py                      # the CI cover (every axis value)
    python bench/sm100_compile_cover.py --wide --out bench/results/cpu/sm100_compile_wide.json

--cover (default): linear_sm100_tc.covering_cases() + quant_sm100.covering_cases() +
attention_sm100.covering_cases(), what tests/test_sm100_compile.py and
tests/test_attention_sm100_compile.py compile. --wide adds, for the Qwen3-8B linear shapes at M in
--m (default 1, 16, 128), every format and compensation, the --per best variants of the
analytical prior and --spread more spread evenly over the space: the larger covering run
(minutes; not in CI).
Nothing is run: compile-only, as `resgen tune --arch sm_100a --compile-only`.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def wide_cases(ms, per: int, spread: int):
    from resgen.models import get_model
    from resgen.search import linear_sm100_tc as L
    from resgen.search.variant import LinearProblem

    out = []
    for s in get_model("qwen3-8b").linear_shapes(1):
        for fmt in ("nvfp4", "mxfp4"):
            for comp in ("none", "full", "0.125"):
                for m in ms:
                    p = LinearProblem(fmt, comp, m, s.n, s.k)
                    sp = L.FAMILY.space(p, L.ARCH)
                    ranked = sorted(sp, key=lambda v: L.FAMILY.prior(v, p))[:per]
                    step = max(1, len(sp) // max(1, spread))
                    pick = list(dict.fromkeys(ranked + sp[::step][:spread]))
                    out += [(p, v) for v in pick]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--wide", action="store_true", help="add the Qwen3-8B sample")
    ap.add_argument("--m", type=lambda t: [int(x) for x in t.split(",")], default=[1, 16, 128])
    ap.add_argument("--per", type=int, default=2, help="best-prior variants per workload")
    ap.add_argument("--spread", type=int, default=1, help="spread variants per workload")
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/cpu/sm100_compile_cover.json")
    args = ap.parse_args(argv)

    from resgen.kernels.codegen import cute_dsl_version
    from resgen.search import build
    from resgen.search import attention_sm100 as A
    from resgen.search import linear_sm100_tc as L
    from resgen.search import quant_sm100 as Q

    cases = ([(L, p, v) for p, v in L.covering_cases()]
             + [(Q, p, v) for p, v in Q.covering_cases()]
             + [(A, p, v) for p, v in A.covering_cases()])
    if args.wide:
        seen = {(p.key(), v.key()) for _, p, v in cases}
        cases += [(L, p, v) for p, v in wide_cases(args.m, args.per, args.spread)
                  if (p.key(), v.key()) not in seen]
    rows = []
    t0 = time.time()
    for mod, p, v in cases:
        out = build.compile_variant(mod.FAMILY, v, p, "sm_100a")
        probs = (mod.ptx_problems(v, p, out.compiled.artifacts.PTX) if out.ok
                 else ["compile failed"])
        rows.append({"family": mod.FAMILY.NAME, "problem": p.as_dict(), "variant": v.as_dict(),
                     "name": v.name(), "ok": out.ok, "seconds": out.seconds,
                     "registers": out.registers, "spill_bytes": out.spill_bytes,
                     "ptx_problems": probs, "error": (out.error or "")[:2000]})
        what = (f"{p.fmt} {p.compensation} m={p.m}" if hasattr(p, "fmt")
                else f"D {p.head_dim} G {p.q_heads // p.kv_heads} comp {p.compensation}")
        print(f"{len(rows):4d}/{len(cases)} {v.name()} {what}: "
              f"{'ok' if out.ok else 'FAILED'} {out.seconds or 0:.2f} s, "
              f"{out.registers} regs, {out.spill_bytes} B local"
              + (f", PTX: {probs}" if probs else ""), flush=True)
    import subprocess

    try:
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    report = {"command": "python " + " ".join([Path(__file__).name] + (argv or sys.argv[1:])),
              "commit": commit,
              "arch": "sm_100a", "what": "compile-only (CuTe DSL on the CPU); nothing run",
              "cute_dsl": cute_dsl_version(), "machine": platform.machine(),
              "wall_s": time.time() - t0, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    bad = [r for r in rows if not r["ok"] or r["spill_bytes"] or r["ptx_problems"]]
    secs = sorted(r["seconds"] for r in rows if r["ok"])
    print(f"\n{len(rows)} variants, {len(rows) - len(bad)} clean (compiled, no local memory, "
          f"PTX as expected), {len(bad)} not; compile s median "
          f"{secs[len(secs) // 2] if secs else 0:.2f}, max {secs[-1] if secs else 0:.2f}; "
          f"wall {report['wall_s']:.0f} s -> {args.out}")
    for r in bad:
        print(f"  {r['name']}: ok={r['ok']} spill={r['spill_bytes']} {r['ptx_problems']}")
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
