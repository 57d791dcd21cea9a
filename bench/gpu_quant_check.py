#!/usr/bin/env python3
"""H200: check every quant_sm90 variant bit-exactly, then time it (CUDA graph, cold-L2
rotation) at M in {1, 16, 2048, 8192} for K in {4096, 12288}; print a table (us, GB/s, % of
4.45 TB/s; best one-shot and best persistent grid side by side) and write raw JSON (registers,
stack frame bytes and the persistent grid cap per variant). One failing variant never stops
the run; a time budget (default 140 s) skips what is left, saying so.

    source .devcache/device/env.sh && python3 bench/gpu_quant_check.py --out "$OUT"

Bytes counted per call: x read once (twice with dynamic alpha: the amax kernel reads it too)
plus every output byte written (codes, scales, xop with its padding rows / columns).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from resgen import formats as F  # noqa: E402
from resgen.kernels import codegen  # noqa: E402
from resgen.kernels import quant_sm90 as Q  # noqa: E402

HBM = 4.45e12
ARCH = "sm_90a"
# (label, fmt, compensation, layout, outputs, alpha): most important first
CONFIGS = [
    ("nv-mext-xop", "nvfp4", "full", "row_pair", "xop", "static"),
    ("nv-plain-xop", "nvfp4", "none", "plain", "xop", "static"),
    ("mx-mext-xop", "mxfp4", "full", "row_pair", "xop", "none"),
    ("nv-kext.125-xop", "nvfp4", "0.125", "plain", "xop", "static"),
    ("nv-mext-both", "nvfp4", "full", "row_pair", "both", "static"),
    ("nv-mext-xop-dyn", "nvfp4", "full", "row_pair", "xop", "dynamic"),
    ("mx-kext.125-xop", "mxfp4", "0.125", "plain", "xop", "none"),
    ("nv-kext.5-xop", "nvfp4", "0.5", "plain", "xop", "static"),
    ("nv-mext-tile8-xop", "nvfp4", "full", "tile8", "xop", "static"),
    ("nv-plain-codes", "nvfp4", "none", "plain", "codes", "static"),
]
# (ept, warps, unroll, persist): one-shot grids, then persistent grids
TUNINGS = [(8, 4, 1, False), (8, 4, 2, False), (16, 4, 2, False),
           (8, 4, 1, True), (8, 4, 2, True), (16, 4, 1, True), (8, 8, 2, True)]
KS = (4096, 12288)
MS = (1, 16, 2048, 8192)
CHECK_MS = ((1, "randn"), (16, "ties"), (16, "zeros"), (16, "mixed"), (2048, "outliers"))


def env_info() -> dict:
    info = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
            "cuda": torch.version.cuda, "cute_dsl": codegen.cute_dsl_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "sms": torch.cuda.get_device_properties(0).multi_processor_count}
    try:
        import cuda.bindings.driver as cu

        err, ver = cu.cuDriverGetVersion()
        info["driver"] = int(ver)
    except Exception as e:                                   # informational only
        info["driver"] = f"unknown ({type(e).__name__})"
    return info


def bytes_moved(cfg: Q.QuantConfig, s: Q.OperandShape) -> int:
    b = s.m * cfg.k * 2 * (2 if cfg.alpha == "dynamic" else 1)
    if cfg.write_codes:
        b += s.t_pad * (s.kq // 2 + s.kq // s.block)
    if cfg.write_xop:
        b += s.t_pad * s.kp * 2
    return b


_X: dict = {}


def timing_input(m: int, k: int, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Input set i for timing (x bf16 on the GPU, its static alpha), shared by all variants."""
    if (m, k, i) not in _X:
        g = torch.Generator(device="cuda").manual_seed(1000 * i + m)
        x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
        _X[(m, k, i)] = (x, F.nvfp4_global_scale(x.float()).reshape(1))
    return _X[(m, k, i)]


class Timed:
    """Runner protocol for resgen.search.timing.measure: n_sets inputs with own outputs."""

    def __init__(self, kern: Q.QuantKernel, cfg: Q.QuantConfig, m: int, n_sets: int, masks):
        self.kern, self.masks, self.cur = kern, masks, 0
        self.sets = []
        rm = 16 if cfg.layout == "tile8" else 1
        for i in range(n_sets):
            x, a = timing_input(m, cfg.k, i)
            self.sets.append((x, a if cfg.alpha == "static" else None,
                              kern.outputs(m, rm, "cuda")))

    def rotate(self, i: int) -> None:
        self.cur = i % len(self.sets)

    def __call__(self):
        x, a, out = self.sets[self.cur]
        return self.kern(x, out, alpha=a, masks=self.masks)


def check(kern, cfg, refs, masks) -> tuple[bool, str]:
    from resgen.search.quant_sm90 import compare_operands

    for m, kind in CHECK_MS:
        key = (cfg.fmt, cfg.compensation, cfg.layout, cfg.k, m, kind, cfg.alpha)
        rm = 16 if cfg.layout == "tile8" else 8
        if key not in refs:            # inputs and references shared by every tuning
            x = Q.make_inputs(kind, m, cfg.k, seed=m, device="cuda")
            alpha = F.nvfp4_global_scale(x.float()) if cfg.alpha == "static" else None
            refs[key] = (x, alpha, Q.operand_reference(x, cfg.fmt, cfg.compensation,
                                                       cfg.layout, rm, alpha, masks,
                                                       cfg.kp_align))
        x, alpha, ref = refs[key]
        out = kern.outputs(m, rm, "cuda")
        op = out.operand
        for t in (op.codes, op.scales, op.xop):
            if t.numel():
                t.view(torch.uint8).fill_(0xFF)
        got = kern(x, out, alpha=None if alpha is None else alpha.reshape(1).cuda(),
                   masks=masks)
        torch.cuda.synchronize()
        res = compare_operands(got, ref, cfg, f"{kind} m={m}")
        if not res.ok:
            return False, res.detail[:600]
    return True, ""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "bench/results/h200"))
    ap.add_argument("--budget-s", type=float, default=140.0)
    ap.add_argument("--quick", action="store_true",
                    help="first 3 configs; 2 one-shot and 2 persistent tunings")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA GPU: nothing to do")
        return 2
    from resgen.search.timing import DEFAULT_POLICY, measure

    policy = dataclasses.replace(DEFAULT_POLICY, target_replay_us=1000.0, repetitions=5)
    t0 = time.perf_counter()
    configs = CONFIGS[:3] if args.quick else CONFIGS
    tunings = [TUNINGS[i] for i in (0, 1, 4, 5)] if args.quick else TUNINGS
    rows, records, refs = [], [], {}
    n_ok = n_fail = n_skip = 0
    for label, fmt, comp, layout, outputs, alpha in configs:
        for k in KS:
            masks = (Q.random_masks(k, comp, seed=1, device="cuda") if Q.ksel_of(comp)
                     else None)
            best: dict[int, tuple[float, str, int]] = {}
            best_kind: dict[tuple[int, bool], float] = {}     # (M, persist) -> us
            for ept, warps, unroll, persist in tunings:
                cfg = Q.QuantConfig(fmt, comp, k, layout, ept=ept, warps=warps, unroll=unroll,
                                    persist=persist, write_codes=outputs != "xop",
                                    write_xop=outputs != "codes", alpha=alpha)
                rec = {"config": label, "k": k, "quant_config": dataclasses.asdict(cfg),
                       "timings": {}}
                records.append(rec)
                if time.perf_counter() - t0 > args.budget_s:
                    rec["status"] = "skipped: time budget"
                    n_skip += 1
                    continue
                why = cfg.why_invalid()
                if why:
                    rec["status"] = f"invalid: {why}"
                    continue
                try:
                    kern, cres = Q.compile_config(cfg, ARCH)
                    rec.update(compile_s=round(cres.seconds, 3), registers=kern.registers,
                               frame_bytes=Q.quant_kernel_resources(
                                   getattr(cres.fn.artifacts, "CUBIN", None)).get("frame"),
                               max_ctas=kern.max_ctas(torch.device("cuda", 0)))
                    ok, detail = check(kern, cfg, refs, masks)
                    rec["check"] = "pass" if ok else f"FAIL {detail}"
                    if not ok:
                        n_fail += 1
                        continue
                    n_ok += 1
                    for m in MS:
                        s = cfg.shape(m, 16 if layout == "tile8" else 1)
                        nb = bytes_moved(cfg, s)
                        n_sets = policy.sets_for(nb)
                        tm = measure(Timed(kern, cfg, m, n_sets, masks), policy, n_sets)
                        us = tm.median_us
                        rec["timings"][str(m)] = {"median_us": us, "bytes": nb,
                                                   "quantiles_us": tm.quantiles_us,
                                                   "mode": tm.mode, "n_sets": n_sets,
                                                   "launches": tm.launches}
                        name = f"e{ept}w{warps}u{unroll}{'p' if persist else ''}"
                        if m not in best or us < best[m][0]:
                            best[m] = (us, name, nb)
                        best_kind[(m, persist)] = min(us, best_kind.get((m, persist), us))
                    rec["status"] = "ok"
                except Exception as e:
                    n_fail += 1
                    rec["status"] = "error"
                    rec["error"] = "".join(traceback.format_exception(e))[-2000:]
                    print(f"[error] {label} K={k} e{ept}w{warps}u{unroll}"
                          f"{'p' if persist else ''}: "
                          f"{type(e).__name__}: {str(e)[:200]}", flush=True)
            for m, (us, name, nb) in sorted(best.items()):
                rows.append((label, k, m, name, us, nb / us / 1e3,
                             best_kind.get((m, False)), best_kind.get((m, True))))
            print(f"[{time.perf_counter() - t0:6.1f}s] {label} K={k}: "
                  + ", ".join(f"M={m} {us:.2f}us ({name})" for m, (us, name, _) in
                              sorted(best.items())), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "quant_sm90_h200.json"
    from run_record import run_record

    path.write_text(json.dumps({"run": run_record(__file__, policy=policy),
                                "env": env_info(), "policy": policy.as_dict(),
                                "hbm_bytes_per_s": HBM, "records": records,
                                "summary": {"variants_passed": n_ok, "failed": n_fail,
                                            "skipped": n_skip,
                                            "seconds": time.perf_counter() - t0}}, indent=1))
    print(f"\nquant_sm90 on {torch.cuda.get_device_name(0)}: {n_ok} variants bit-exact, "
          f"{n_fail} failed, {n_skip} skipped (budget); JSON: {path}")
    print(f"{'config':20s} {'K':>6s} {'M':>5s} {'best':>10s} {'us':>9s} {'GB/s':>8s} "
          f"{'%HBM':>6s} {'1shot us':>9s} {'persist us':>10s}")

    def fmt_us(v):
        return f"{v:.2f}" if v is not None else "-"

    for label, k, m, name, us, gbs, one, per in rows:
        print(f"{label:20s} {k:6d} {m:5d} {name:>10s} {us:9.2f} {gbs:8.0f} "
              f"{100 * gbs * 1e9 / HBM:6.1f} {fmt_us(one):>9s} {fmt_us(per):>10s}")
    return 0 if n_fail == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
