"""GPU check + benchmark of attention_sm90 (ResAttn decode over a paged NVFP4 KV cache, H200).

    mkdir -p .devcache && cp -r ../shared/device .devcache/
    source .devcache/device/env.sh && RESGEN_CACHE_DIR=/tmp/resgen-cache \
        python3 bench/gpu_attention_check.py            # about 5-6 minutes; JSON to $OUT

1. Checks: the device primitives against the CPU emulator bit for bit (probe kernel), the append
   kernel bit-exact against PagedKVCache.append, and every timed variant against
   resgen.reference.decode_attention (fresh inputs incl. empty / length-1 / partial-page
   sequences, NaN-poisoned output; rel err <= 3e-3 f16 PV, <= 2e-2 fp8 PV).
2. Timing (resgen.search.timing.measure, policy cold-l2-graph: CUDA graph of many launches,
   caches rotated past 2 x the 60 MB L2, median of 7), per geometry x batch x KV length:
   ResAttn (f16 PV; a few split counts around the preset rule, last-CTA and workspace
   reductions; best kept), the same family without the query residue (plain NVFP4-KV, same
   candidates + dense packing), ResAttn with FP8 PV at the best split, torch SDPA with BF16 KV
   (enable_gqa), and the NVFP4 HBM floor (decode_hbm_bytes / 4.45 TB/s).
   Geometries: Qwen3-8B 32/8/128, Qwen3-32B 64/8/128, a head-dim-256 layer 16/2/256 (the
   full-attention layers of Qwen3-Next-80B-A3B). Batch {1, 8, 32, 64}; KV {8K, 32K, 128K}, and
   512K for batch <= 8 where memory allows.
A failing variant / configuration is recorded and skipped. A time budget
(RESGEN_BENCH_BUDGET_S, default 330 s) stops starting new configurations. FlashInfer is not
measured (its wheel is 101 MB, above the 64 MiB that can travel to the GPU machine).
Prints a short table last; writes $OUT/attention_sm90_check.json and a plot
($OUT/attention_sm90_check.svg, see bench/plot_attention.py).
"""

from __future__ import annotations

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
sys.path.insert(0, str(ROOT / "tests" / "gpu"))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402

from resgen.kernels.attention_sm90 import decode_hbm_bytes  # noqa: E402
from resgen.search import build  # noqa: E402
from resgen.search.attention_sm90 import (FAMILY, AttentionSm90Variant, Packing,  # noqa: E402
                                          Reduction, preset)
from resgen.search.timing import DEFAULT_POLICY, measure  # noqa: E402
from resgen.search.variant import AttentionProblem  # noqa: E402

ARCH = "sm_90a"
HBM = 4.45e12
OUT = Path(os.environ.get("OUT", "bench/results/h200"))
BUDGET_S = float(os.environ.get("RESGEN_BENCH_BUDGET_S", "330"))
T0 = time.time()
GEOMS = {"qwen3-8b": (32, 8, 128), "qwen3-32b": (64, 8, 128), "d256": (16, 2, 256)}
BATCHES = (1, 8, 32, 64)
KV_LENS = (8192, 32768, 131072, 524288)
REPORT: dict = {"checks": [], "configs": [], "errors": [], "compiles": []}
_COMPILED: dict[str, object] = {}


def left() -> float:
    return BUDGET_S - (time.time() - T0)


def log(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def err(where: str, e: BaseException) -> None:
    REPORT["errors"].append({"where": where, "error": f"{type(e).__name__}: {e}",
                             "trace": traceback.format_exc()[-2000:]})
    log(f"ERROR {where}: {type(e).__name__}: {str(e)[:300]}")


def compiled(v: AttentionSm90Variant, p: AttentionProblem):
    key = v.key() + FAMILY.compile_key(v, p).key()
    if key not in _COMPILED:
        out = build.compile_variant(FAMILY, v, p, ARCH)
        REPORT["compiles"].append({"variant": v.key(), "compile_problem":
                                   FAMILY.compile_key(v, p).key(), "ok": out.ok,
                                   "seconds": out.seconds, "registers": out.registers,
                                   "spill_bytes": out.spill_bytes, "error": out.error,
                                   "fingerprint": out.fingerprint})
        if not out.ok:
            raise RuntimeError(f"compile failed: {(out.error or '')[:500]}")
        _COMPILED[key] = out.compiled
    return _COMPILED[key]


def checked_runner(v: AttentionSm90Variant, p: AttentionProblem, n_sets: int):
    fn = compiled(v, p)
    r = FAMILY.runner(fn, v, p, "cuda", n_sets=n_sets, seed=1)
    ck = r.check()
    REPORT["checks"].append({"variant": v.key(), "problem": p.key(), "ok": ck.ok,
                             "rel_err": ck.rel_err, "tol": ck.tolerance, "detail": ck.detail})
    if not ck.ok:
        raise RuntimeError(f"check failed: {ck.detail}")
    return r


def time_variant(v: AttentionSm90Variant, p: AttentionProblem) -> dict:
    n_sets = DEFAULT_POLICY.sets_for(FAMILY.working_set_bytes(v, p))
    r = checked_runner(v, p, n_sets)
    t = measure(r, DEFAULT_POLICY, n_sets=len(r.sets))
    del r
    return {"variant": v.key(), "name": v.name(), "us": t.median_us, "q10": t.quantiles_us,
            "mode": t.mode, "n_sets": t.n_sets, "launches": t.launches}


class SdpaRunner:
    """torch SDPA decode with BF16 K/V [B, Hkv, L, D] (GQA native), rotated sets."""

    def __init__(self, b, hq, hkv, d, n, n_sets):
        self.sets = []
        for _ in range(n_sets):
            q = torch.randn(b, hq, 1, d, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(b, hkv, n, d, device="cuda", dtype=torch.bfloat16)
            v = torch.randn(b, hkv, n, d, device="cuda", dtype=torch.bfloat16)
            self.sets.append((q, k, v))
        self.cur = 0

    def rotate(self, i):
        self.cur = i % len(self.sets)

    def __call__(self):
        q, k, v = self.sets[self.cur]
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)


def time_sdpa(b, hq, hkv, d, n) -> dict:
    per_set = 2 * b * hkv * n * d * 2
    free = torch.cuda.mem_get_info()[0]
    n_sets = DEFAULT_POLICY.sets_for(per_set)
    if per_set * n_sets > 0.6 * free:
        return {"us": None, "skipped": f"BF16 KV {per_set / 1e9:.1f} GB x {n_sets} exceeds memory"}
    r = SdpaRunner(b, hq, hkv, d, n, n_sets)
    t = measure(r, DEFAULT_POLICY, n_sets=n_sets)
    del r
    return {"us": t.median_us, "mode": t.mode, "n_sets": n_sets}


def candidates(p: AttentionProblem) -> list[AttentionSm90Variant]:
    """The preset, twice its split count (last CTA), the preset's split with the workspace
    reduction, the preset with prefetch toggled, and the preset with 8 warps."""
    base = preset(p)
    s = base.splits
    out = [base, dataclasses.replace(base, splits=min(128, 2 * s), reduction=Reduction.LASTCTA)]
    if s > 1:
        out.append(dataclasses.replace(base, reduction=Reduction.WORKSPACE))
    out.append(dataclasses.replace(base, prefetch=not base.prefetch))
    out.append(dataclasses.replace(base, num_warps=8))
    return [v for v in dict.fromkeys(out) if FAMILY.why_invalid(v, p, ARCH) is None]


def best_of(vs, p, label) -> dict:
    rows = []
    for v in vs:
        if left() < 0:
            break
        try:
            rows.append(time_variant(v, p))
        except Exception as e:
            err(f"{label} {v.name()} {p.key()}", e)
    ok = [r for r in rows if r.get("us")]
    best = min(ok, key=lambda r: r["us"]) if ok else None
    return {"best": best, "all": rows}


def checks() -> None:
    """Primitive probe + append bit-exactness + a short reference check (pytest functions)."""
    import test_attention_sm90_gpu as T

    for name, fn, args in (("probe", T.test_device_primitives_match_the_emulator_bit_for_bit, ()),
                           ("append d128", T.test_append_is_bit_exact, (128, 8, 32)),
                           ("append d256", T.test_append_is_bit_exact, (256, 2, 64)),
                           ("graph replay", T.test_cuda_graph_replay_matches_eager, ()),
                           ("reruns + counters", T.test_reruns_are_bit_identical_and_counters_rearm,
                            ())):
        try:
            fn(*args)
            REPORT["checks"].append({"name": name, "ok": True})
            log(f"check {name}: ok")
        except Exception as e:
            REPORT["checks"].append({"name": name, "ok": False, "detail": str(e)[:1000]})
            err(f"check {name}", e)


def run_config(geom: str, b: int, n: int) -> None:
    hq, hkv, d = GEOMS[geom]
    floor = decode_hbm_bytes([n] * b, hkv, d, hq) / HBM * 1e6
    need = decode_hbm_bytes([n] * b, hkv, d, hq) * 3
    if need > 0.6 * torch.cuda.mem_get_info()[0]:
        log(f"skip {geom} B={b} L={n}: cache does not fit")
        return
    p = AttentionProblem(batch=b, q_heads=hq, kv_heads=hkv, head_dim=d, kv_len=n)
    pp = dataclasses.replace(p, compensation=False)
    entry = {"geom": geom, "q_heads": hq, "kv_heads": hkv, "head_dim": d, "batch": b,
             "kv_len": n, "floor_us": floor}
    entry["resattn"] = best_of(candidates(p), p, "resattn")
    rb = entry["resattn"]["best"]
    # plain NVFP4-KV: the same kernel configuration without the residue (+ dense packing,
    # which halves the QK MMAs for groups of 8)
    plain_c = [AttentionSm90Variant.from_key(rb["variant"])] if rb else candidates(pp)[:1]
    if hq // hkv > 4:
        plain_c.append(dataclasses.replace(plain_c[0], packing=Packing.DENSE))
    plain_c = [v for v in plain_c if FAMILY.why_invalid(v, pp, ARCH) is None]
    entry["plain"] = best_of(plain_c, pp, "plain")
    if rb is not None and left() > 0:
        v8 = AttentionSm90Variant.from_key(rb["variant"])
        entry["resattn_fp8"] = best_of([v8], dataclasses.replace(p, pv="fp8"), "fp8")
    if left() > 0:
        try:
            entry["sdpa"] = time_sdpa(b, hq, hkv, d, n)
        except Exception as e:
            err(f"sdpa {geom} B={b} L={n}", e)
            entry["sdpa"] = {"us": None, "error": str(e)[:300]}
    REPORT["configs"].append(entry)
    torch.cuda.empty_cache()
    r = (entry["resattn"]["best"] or {}).get("us")
    log(f"{geom} B={b} L={n}: resattn {r} us, floor {floor:.1f} us")


def summary_table() -> str:
    hdr = (f"{'geom':10s} {'B':>3s} {'KV':>7s} {'ResAttn':>9s} {'plain':>9s} {'R/P':>5s} "
           f"{'fp8PV':>8s} {'SDPA':>9s} {'xSDPA':>6s} {'floor':>8s} {'%floor':>6s}")
    lines = [hdr, "-" * len(hdr)]
    for e in REPORT["configs"]:
        r = (e["resattn"]["best"] or {}).get("us")
        pl = (e["plain"]["best"] or {}).get("us")
        f8 = ((e.get("resattn_fp8") or {}).get("best") or {}).get("us")
        sd = (e.get("sdpa") or {}).get("us")

        def f(x, w=9, p=1):
            return f"{x:{w}.{p}f}" if x else " " * (w - 1) + "-"
        lines.append(f"{e['geom']:10s} {e['batch']:3d} {e['kv_len'] // 1024:6d}K {f(r)} {f(pl)} "
                     f"{f(r / pl if r and pl else None, 5, 2)} {f(f8, 8)} {f(sd)} "
                     f"{f(sd / r if sd and r else None, 6, 2)} {f(e['floor_us'], 8)} "
                     f"{f(100 * e['floor_us'] / r if r else None, 6, 0)}")
    return "\n".join(lines)


def env() -> dict:
    from resgen.kernels.codegen import cute_dsl_version

    props = torch.cuda.get_device_properties(0)
    drv = None
    try:
        import subprocess
        drv = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout.strip()
    except Exception:
        pass
    return {"gpu": props.name, "sms": props.multi_processor_count, "driver": drv,
            "torch": torch.__version__, "cute_dsl": cute_dsl_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "policy": DEFAULT_POLICY.as_dict(), "hbm_bytes_per_s": HBM,
            "flashinfer": "not measured: flashinfer-python 0.7.4 wheel is 101 MB, over the "
                          "64 MiB that can be carried to the GPU machine (no network there)"}


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    REPORT["env"] = env()
    log(f"{REPORT['env']['gpu']}, budget {BUDGET_S:.0f} s")
    checks()
    order = []
    for n in KV_LENS:
        for b in BATCHES:
            if n == 524288 and b > 8:
                continue
            for geom in GEOMS:
                order.append((geom, b, n))
    # most informative first: the targets are stated at KV >= 32K
    order.sort(key=lambda c: (c[2] == 524288, c[2] == 8192, c[1] == 64, c[0]))
    for geom, b, n in order:
        if left() < 0:
            log("time budget reached: remaining configurations skipped")
            REPORT["skipped_for_budget"] = True
            break
        try:
            run_config(geom, b, n)
        except Exception as e:
            err(f"config {geom} B={b} L={n}", e)
        with open(OUT / "attention_sm90_check.json", "w") as f:
            json.dump(REPORT, f, indent=1, default=str)
    table = summary_table()
    REPORT["table"] = table
    with open(OUT / "attention_sm90_check.json", "w") as f:
        json.dump(REPORT, f, indent=1, default=str)
    try:
        from plot_attention import render
        (OUT / "attention_sm90_check.svg").write_text(render(REPORT))
    except Exception as e:
        err("plot", e)
    n_bad = sum(1 for c in REPORT["checks"] if not c.get("ok"))
    print()
    print(f"checks: {len(REPORT['checks']) - n_bad} ok, {n_bad} failed; errors: "
          f"{len(REPORT['errors'])}; {time.time() - T0:.0f} s")
    print(table)


if __name__ == "__main__":
    main()
