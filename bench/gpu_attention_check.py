"""GPU check + benchmark of attention_sm90 (ResAttn decode over a paged NVFP4 KV cache, H200),
in one process, sized for about 3.5 minutes of wall time (plus up to 16 compiles of the shipped
table's variants: give it RESGEN_BENCH_BUDGET_S=240 and a 270 s timeout):

    source .devcache/device/env.sh && RESGEN_CACHE_DIR=/tmp/resgen-cache \\
        timeout -k 10 -s INT 225 python3 bench/gpu_attention_check.py

1. Correctness: tests/gpu/test_attention_sm90_gpu.py run in-process by pytest (the primitive
   probe bit for bit against the CPU emulator; every packing / reduction / PV path / chunk size /
   head dim against resgen.reference with variable lengths, partial pages, empty and length-1
   sequences; batch 1..64; bit-identical reruns, re-armed counters, CUDA-graph replay; kernel vs
   emulator; the append kernel bit-exact). Its compiles are shared with the timing below.
2. Timing (resgen.search.timing.measure, DEFAULT_POLICY: CUDA graph of many launches, input sets
   rotated past 2 x the 60 MB L2 when one set is smaller than that, median of 7), per point of
   the issue's grid: geometries Qwen3-8B 32/8/128, Qwen3-32B 64/8/128 and a head-dim-256 layer
   16/2/256; batch {1, 8, 32, 64}; KV {8K, 32K, 128K}:
   - ResAttn (f16 PV): the preset rule's variant and the same with twice / half its split
     count (one compile serves all split counts), plus the variant the runtime dispatches from
     the shipped table (tuned/h200.sqlite.xz) where the table has the workload; best kept, and
     the table's own timing reported ("table" in the JSON);
   - plain NVFP4-KV (no query residue): the best ResAttn configuration without the residue
     ("pair" packing for groups <= 4; "dense" packing for groups of 8, which halves its QK
     MMAs), plus the table's plain variant;
   - torch SDPA with BF16 KV: the GQA call (enable_gqa=True) and the group-as-query-rows call
     (q [B, Hkv, G, D], no mask: the same decode), flash / efficient / cuDNN backends only
     (never the math fallback, which would materialize the repeated KV); the faster is kept;
   - the NVFP4 HBM floor: decode_hbm_bytes / 4.45 TB/s.
   Every timed variant is first checked against the reference (once per variant and geometry),
   and the best ResAttn variant again on the timed data (last batch row, full KV length).
3. If time is left: ResAttn with FP8 PV (the paper's choice) at KV 32K, and KV 512K for
   batch <= 8.
The time budget (RESGEN_BENCH_BUDGET_S, default 205 s from the start) stops starting new points;
a failing variant / point is recorded and skipped; SIGINT (timeout -s INT) ends the run with
the results so far. JSON is rewritten after every point. Output in $OUT (default
bench/results/h200): attention_sm90_check.json, attention_sm90_check.svg
(bench/report/plot_attention.py), attention_sm90_pytest.xml. A short table is printed last.
FlashInfer's fa2 decode (NVFP4 KV on the same cache bytes, BF16 query) is timed at every point
as a peer when RESGEN_FLASHINFER points at an unpacked FlashInfer (bench/flashinfer_peer.py
says how it reaches the GPU machine); otherwise the JSON says why it is absent.
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
for _p in (ROOT, ROOT / "tests" / "gpu", ROOT / "bench", ROOT / "bench" / "report"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import torch  # noqa: E402

import flashinfer_peer  # noqa: E402
from resgen.kernels.attention_sm90 import decode_hbm_bytes  # noqa: E402
from resgen.search.attention_sm90 import (FAMILY, MAX_SPLITS, AttentionSm90Variant,  # noqa: E402
                                          Packing, Reduction, preset)
from resgen.search.timing import DEFAULT_POLICY  # noqa: E402
from resgen.search.variant import AttentionProblem  # noqa: E402

ARCH = "sm_90a"
HBM = 4.45e12
TEST_FILE = ROOT / "tests" / "gpu" / "test_attention_sm90_gpu.py"
GEOMS = {"qwen3-8b": (32, 8, 128), "qwen3-32b": (64, 8, 128), "d256": (16, 2, 256)}
BATCHES = (1, 8, 32, 64)
KV_LENS = (8192, 32768, 131072)
EXTRA_KV = 524288
CHECK_LEN = 4096


# ----------------------------------------------------------------------------- plan (CPU-testable)


def grid_order() -> list[tuple[str, int, int]]:
    """The grid's points, most informative first (the targets are stated at KV >= 32K; the
    cheap batch-1/8 points before batch 64), so a budget stop loses the least."""
    pts = [(g, b, n) for n in KV_LENS for b in BATCHES for g in GEOMS]
    return sorted(pts, key=lambda c: (c[2] == 8192, c[1] == 64, c[2] != 32768, c[1], c[2],
                                      list(GEOMS).index(c[0])))


def problem_of(geom: str, b: int, n: int, **kw) -> AttentionProblem:
    hq, hkv, d = GEOMS[geom]
    return AttentionProblem(batch=b, q_heads=hq, kv_heads=hkv, head_dim=d, kv_len=n, **kw)


def table_variant(p: AttentionProblem, dispatcher=None) -> AttentionSm90Variant | None:
    """What the runtime dispatches for p from the shipped table (resgen.runtime), or None where
    the table has no acceptable row for it (the runtime would serve the family default)."""
    from resgen import runtime

    d = dispatcher if dispatcher is not None else runtime.dispatcher()
    v = d.lookup(AttentionProblem.OP, p, FAMILY.NAME)
    if d.source(AttentionProblem.OP, p, FAMILY.NAME) == "default":
        return None
    return v if FAMILY.why_invalid(v, p, ARCH) is None else None


def resattn_candidates(p: AttentionProblem, table: AttentionSm90Variant | None = None
                       ) -> list[AttentionSm90Variant]:
    """The preset and the same with 2x / 0.5x its split count (one compile per reduction),
    then the table's variant (if given and not among them)."""
    base = preset(p)
    out = [base]
    for s in (2 * base.splits, base.splits // 2):
        s = min(s, MAX_SPLITS)
        if s >= 1:
            out.append(dataclasses.replace(
                base, splits=s, reduction=Reduction.NONE if s == 1 else Reduction.LASTCTA))
    if table is not None:
        out.append(table)
    return [v for v in dict.fromkeys(out) if FAMILY.why_invalid(v, p, ARCH) is None]


def plain_candidates(best: AttentionSm90Variant, p: AttentionProblem,
                     table: AttentionSm90Variant | None = None) -> list[AttentionSm90Variant]:
    """Plain NVFP4-KV at ResAttn's best configuration: pair packing for groups <= 4 (the
    same MMAs as ResAttn), dense packing for larger groups (one column per head); then the
    table's plain variant (if given and different)."""
    pp = dataclasses.replace(p, compensation=False)
    dense = p.q_heads // p.kv_heads > 4
    v = dataclasses.replace(best, packing=Packing.DENSE if dense else Packing.PAIR)
    out = [v] if FAMILY.why_invalid(v, pp, ARCH) is None else [preset(pp)]
    if table is not None and table not in out and FAMILY.why_invalid(table, pp, ARCH) is None:
        out.append(table)
    return out


def _table_row(timed: dict, v: AttentionSm90Variant | None) -> dict | None:
    """The timing row of the table's variant among the timed ones (None if absent)."""
    if v is None:
        return None
    return next((r for r in timed["all"] if r["variant"] == v.key()), None)


def floor_us(p: AttentionProblem) -> float:
    return decode_hbm_bytes([p.kv_len] * p.batch, p.kv_heads, p.head_dim, p.q_heads) / HBM * 1e6


# ----------------------------------------------------------------------------- run state


class Bench:
    def __init__(self, out_dir: Path, budget_s: float):
        self.out_dir, self.budget_s, self.t0 = out_dir, budget_s, time.time()
        self.report: dict = {"tests": {}, "checks": [], "configs": [], "extras": [],
                             "errors": [], "compiles": []}
        self._checked: dict[tuple, dict] = {}

    def left(self) -> float:
        return self.budget_s - (time.time() - self.t0)

    def log(self, msg: str) -> None:
        print(f"[{time.time() - self.t0:6.1f}s] {msg}", flush=True)

    def err(self, where: str, e: BaseException) -> None:
        self.report["errors"].append({"where": where, "error": f"{type(e).__name__}: {e}"[:2000],
                                      "trace": traceback.format_exc()[-2000:]})
        self.log(f"ERROR {where}: {type(e).__name__}: {str(e)[:300]}")

    def save(self) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.report["compiles"] = compile_stats()
        self.report["elapsed_s"] = time.time() - self.t0
        with open(self.out_dir / "attention_sm90_check.json", "w") as f:
            json.dump(self.report, f, indent=1, default=str)


def compile_stats() -> list[dict]:
    T = sys.modules.get("test_attention_sm90_gpu")
    if T is None:
        return []
    return [{"identity": json.loads(k), "seconds": o.seconds, "registers": o.registers,
             "spill_bytes": o.spill_bytes, "fingerprint": o.fingerprint}
            for k, o in T.COMPILED.items()]


# ----------------------------------------------------------------------------- 1. tests


def run_tests(bench: Bench) -> bool:
    """Run the GPU test module in this process. False if it was interrupted."""
    import pytest

    from gpu_pytest import run_test_file

    bench.out_dir.mkdir(parents=True, exist_ok=True)
    res = run_test_file(TEST_FILE, bench.out_dir / "attention_sm90_pytest.xml")
    bench.report["tests"] = res
    bench.log(f"GPU tests: {res['passed']} passed, {res['failed']} failed "
              f"(exit {res['exit_code']})")
    bench.save()
    return res["exit_code"] != int(pytest.ExitCode.INTERRUPTED)


# ----------------------------------------------------------------------------- 2. timing


class _Sets:
    """n_sets random paged caches + queries of one problem (cold L2 by rotation), shared by
    every ResAttn / plain variant timed at the point."""

    def __init__(self, p: AttentionProblem, n_sets: int, seed: int = 1, device: str = "cuda"):
        from resgen.search.attention_sm90 import random_cache

        gen = torch.Generator(device=device).manual_seed(seed)
        self.sets = []
        for _ in range(n_sets):
            cache, bt, sl = random_cache(p.batch, p.kv_heads, p.head_dim, p.kv_len,
                                         p.page_size, device, gen)
            q = torch.randn(p.batch, p.q_heads, p.head_dim, generator=gen,
                            device=device).to(torch.bfloat16)
            self.sets.append((q, cache, bt, sl))
        self.out = torch.empty(p.batch, p.q_heads, p.head_dim, dtype=torch.bfloat16,
                               device=device)


class _OpRunner:
    def __init__(self, op, sets: _Sets):
        self.op, self.s, self.cur = op, sets, 0

    def rotate(self, i: int) -> None:
        self.cur = i % len(self.s.sets)

    def __call__(self):
        q, cache, bt, sl = self.s.sets[self.cur]
        return self.op(q, cache, bt, sl, out=self.s.out)


def _check(bench: Bench, v: AttentionSm90Variant, p: AttentionProblem) -> dict:
    """Variant vs reference on fresh inputs (lengths CHECK_LEN, a partial page, 1, 0); once per
    variant and geometry (the check's inputs do not depend on batch or KV length >= 4096)."""
    import test_attention_sm90_gpu as T

    key = (v.key(), p.q_heads, p.kv_heads, p.head_dim, p.compensation, p.pv,
           min(p.kv_len, CHECK_LEN))
    if key not in bench._checked:
        row = {"variant": v.key(), "problem": p.key(), "ok": True, "detail": ""}
        try:
            T._run_check(v, p, [min(p.kv_len, CHECK_LEN), p.page_size + 5, 1, 0], seed=11)
        except AssertionError as e:
            row.update(ok=False, detail=str(e)[:1000])
        bench._checked[key] = row
        bench.report["checks"].append(row)
    return bench._checked[key]


def time_variants(bench: Bench, vs, p: AttentionProblem, sets: _Sets, label: str) -> dict:
    """Check, then time each variant on the shared sets; {"best": row | None, "all": rows}."""
    import test_attention_sm90_gpu as T
    from resgen.kernels.attention_sm90 import DecodeAttentionSm90
    from resgen.search.attention_sm90 import shape_of
    from resgen.search.timing import measure

    rows = []
    for v in vs:
        if bench.left() < -10:
            break
        try:
            ck = _check(bench, v, p)
            if not ck["ok"]:
                raise RuntimeError(f"check failed: {ck['detail'][:300]}")
            op = DecodeAttentionSm90(T.compiled(v, p).compiled, shape_of(v, p), v.splits)
            t = measure(_OpRunner(op, sets), DEFAULT_POLICY, n_sets=len(sets.sets))
            rows.append({"variant": v.key(), "name": v.name(), "us": t.median_us,
                         "q": t.quantiles_us, "mode": t.mode, "n_sets": t.n_sets,
                         "launches": t.launches})
        except Exception as e:
            bench.err(f"{label} {v.name()} {p.key()}", e)
    ok = [r for r in rows if r.get("us")]
    return {"best": min(ok, key=lambda r: r["us"]) if ok else None, "all": rows}


class _SdpaRunner:
    def __init__(self, sets, gqa: bool):
        self.sets, self.gqa, self.cur = sets, gqa, 0

    def rotate(self, i: int) -> None:
        self.cur = i % len(self.sets)

    def __call__(self):
        from torch.nn.functional import scaled_dot_product_attention as sdpa

        q, k, v = self.sets[self.cur]
        if self.gqa:                                 # q [B, Hq, 1, D], k/v [B, Hkv, L, D]
            return sdpa(q, k, v, enable_gqa=True)
        b, hq, _, d = q.shape                        # group rows as queries of their KV head
        return sdpa(q.view(b, k.shape[1], hq // k.shape[1], d), k, v)


def time_sdpa(p: AttentionProblem) -> dict:
    """Both SDPA forms on the same rotated BF16 sets; "us" is the faster form's median."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from resgen.search.timing import measure

    b, hq, hkv, d, n = p.batch, p.q_heads, p.kv_heads, p.head_dim, p.kv_len
    per_set = 2 * b * hkv * n * d * 2
    n_sets = DEFAULT_POLICY.sets_for(per_set)
    if per_set * n_sets > 0.7 * torch.cuda.mem_get_info()[0]:
        return {"us": None, "skipped": f"BF16 KV {per_set / 1e9:.1f} GB x {n_sets} > memory"}
    gen = torch.Generator(device="cuda").manual_seed(2)
    sets = [(torch.randn(b, hq, 1, d, generator=gen, device="cuda", dtype=torch.bfloat16),
             torch.randn(b, hkv, n, d, generator=gen, device="cuda", dtype=torch.bfloat16),
             torch.randn(b, hkv, n, d, generator=gen, device="cuda", dtype=torch.bfloat16))
            for _ in range(n_sets)]
    res: dict = {"n_sets": n_sets}
    outs = {}
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                      SDPBackend.CUDNN_ATTENTION]):
        for name, gqa in (("gqa", True), ("rows", False)):
            try:
                r = _SdpaRunner(sets, gqa)
                outs[name] = r().float().reshape(b, hkv, hq // hkv, d)
                t = measure(r, DEFAULT_POLICY, n_sets=n_sets)
                res[name] = {"us": t.median_us, "q": t.quantiles_us, "mode": t.mode}
            except Exception as e:
                res[name] = {"us": None, "error": f"{type(e).__name__}: {e}"[:300]}
    if len(outs) == 2:                   # the two calls must compute the same attention
        res["forms_max_abs_diff"] = float((outs["gqa"] - outs["rows"]).abs().max())
    del sets, outs
    us = [r["us"] for r in (res["gqa"], res["rows"]) if r.get("us")]
    res["us"] = min(us) if us else None
    return res


def row_check(v: AttentionSm90Variant, p: AttentionProblem, sets: _Sets) -> dict:
    """The timed configuration on the timed data: the last batch row of set 0 (its pages lie
    anywhere in the pool: > 2^31-byte caches exercise 64-bit addressing) vs the reference."""
    import test_attention_sm90_gpu as T
    from resgen import reference as R
    from resgen.kernels.attention_sm90 import DecodeAttentionSm90
    from resgen.search.attention_sm90 import TOLERANCE, compare, shape_of

    op = DecodeAttentionSm90(T.compiled(v, p).compiled, shape_of(v, p), v.splits)
    q, cache, bt, sl = sets.sets[0]
    out = torch.full_like(q, float("nan"))
    op(q, cache, bt, sl, out=out)
    torch.cuda.synchronize()
    r = p.batch - 1
    ref = R.decode_attention(q[r:r + 1].float(), cache, bt[r:r + 1], sl[r:r + 1],
                             compensation=p.compensation,
                             pv="fp32" if p.pv == "f16" else "fp8")
    res = compare(out[r:r + 1], ref, TOLERANCE[p.pv])
    return {"variant": v.key(), "ok": res.ok, "rel_err": res.rel_err, "detail": res.detail}


def run_point(bench: Bench, geom: str, b: int, n: int) -> dict | None:
    p = problem_of(geom, b, n)
    need = decode_hbm_bytes([n] * b, p.kv_heads, p.head_dim, p.q_heads)
    n_sets = DEFAULT_POLICY.sets_for(need)
    if need * (n_sets + 1) > 0.6 * torch.cuda.mem_get_info()[0]:
        bench.log(f"skip {geom} B={b} L={n}: cache does not fit")
        return None
    entry = {"geom": geom, "q_heads": p.q_heads, "kv_heads": p.kv_heads,
             "head_dim": p.head_dim, "batch": b, "kv_len": n, "floor_us": floor_us(p)}
    sets = _Sets(p, n_sets)
    pp = dataclasses.replace(p, compensation=False)
    tv, tpv = table_variant(p), table_variant(pp)
    entry["resattn"] = time_variants(bench, resattn_candidates(p, tv), p, sets, "resattn")
    best = entry["resattn"]["best"]
    bv = AttentionSm90Variant.from_key(best["variant"]) if best else preset(p)
    entry["plain"] = time_variants(bench, plain_candidates(bv, p, tpv), pp, sets, "plain")
    entry["table"] = {"resattn": _table_row(entry["resattn"], tv),
                      "plain": _table_row(entry["plain"], tpv)}
    if best:
        try:
            entry["row_check"] = row_check(bv, p, sets)
            if not entry["row_check"]["ok"]:
                bench.log(f"ROW CHECK FAILED {geom} B={b} L={n}: {entry['row_check']['detail']}")
        except Exception as e:
            bench.err(f"row check {geom} B={b} L={n}", e)
    if flashinfer_peer.load() is not None and bench.left() > -10:
        try:
            entry["flashinfer"] = flashinfer_peer.time_sets(sets.sets, sets.out)
            if not entry["flashinfer"]["check"]["ok"]:
                bench.log(f"FLASHINFER CHECK FAILED {geom} B={b} L={n}: "
                          f"{entry['flashinfer']['check']['detail']}")
        except Exception as e:
            bench.err(f"flashinfer {geom} B={b} L={n}", e)
    del sets
    torch.cuda.empty_cache()
    try:
        entry["sdpa"] = time_sdpa(p)
    except Exception as e:
        bench.err(f"sdpa {geom} B={b} L={n}", e)
        entry["sdpa"] = {"us": None, "error": str(e)[:300]}
    torch.cuda.empty_cache()
    r = (best or {}).get("us")
    pl = (entry["plain"]["best"] or {}).get("us")
    sd = entry["sdpa"].get("us")
    fi = (entry.get("flashinfer") or {}).get("us")
    bench.log(f"{geom} B={b} L={n // 1024}K: ResAttn {r and round(r, 1)} us, plain "
              f"{pl and round(pl, 1)} us, SDPA {sd and round(sd, 1)} us"
              + (f", FlashInfer {round(fi, 1)} us" if fi else "")
              + f", floor {entry['floor_us']:.1f} us")
    return entry


def fp8_point(bench: Bench, entry: dict) -> None:
    """ResAttn with FP8 PV at the point's best f16-PV configuration, into entry["resattn_fp8"]."""
    best = (entry.get("resattn") or {}).get("best")
    if not best:
        return
    p = problem_of(entry["geom"], entry["batch"], entry["kv_len"], pv="fp8")
    sets = _Sets(p, DEFAULT_POLICY.sets_for(
        decode_hbm_bytes([p.kv_len] * p.batch, p.kv_heads, p.head_dim, p.q_heads)))
    v = AttentionSm90Variant.from_key(best["variant"])
    if FAMILY.why_invalid(v, p, ARCH) is None:
        entry["resattn_fp8"] = time_variants(bench, [v], p, sets, "fp8")
    del sets
    torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- report


def _f(x, w=9, p=1) -> str:
    return f"{x:{w}.{p}f}" if x else " " * (w - 1) + "-"


def summary_table(configs: list[dict]) -> str:
    with_fi = any((e.get("flashinfer") or {}).get("us") for e in configs)
    hdr = (f"{'geom':10s} {'B':>3s} {'KV':>5s} {'ResAttn':>9s} {'plain':>9s} {'R/P':>5s} "
           f"{'fp8PV':>8s} {'SDPA':>9s} {'xSDPA':>6s} {'floor':>8s} {'%floor':>6s} "
           f"{'table':>9s}" + (f" {'FlashInf':>9s} {'xFI':>5s}" if with_fi else ""))
    lines = [hdr, "-" * len(hdr)]
    for e in configs:
        r = ((e.get("resattn") or {}).get("best") or {}).get("us")
        pl = ((e.get("plain") or {}).get("best") or {}).get("us")
        f8 = ((e.get("resattn_fp8") or {}).get("best") or {}).get("us")
        sd = (e.get("sdpa") or {}).get("us")
        tb = (((e.get("table") or {}).get("resattn")) or {}).get("us")
        fi = (e.get("flashinfer") or {}).get("us")
        lines.append(f"{e['geom']:10s} {e['batch']:3d} {e['kv_len'] // 1024:4d}K {_f(r)} "
                     f"{_f(pl)} {_f(r / pl if r and pl else None, 5, 2)} {_f(f8, 8)} {_f(sd)} "
                     f"{_f(sd / r if sd and r else None, 6, 2)} {_f(e['floor_us'], 8)} "
                     f"{_f(100 * e['floor_us'] / r if r else None, 6, 0)} {_f(tb)}"
                     + (f" {_f(fi)} {_f(fi / r if fi and r else None, 5, 2)}"
                        if with_fi else ""))
    return "\n".join(lines)


def targets(configs: list[dict]) -> dict:
    """The issue's targets over the measured points: speedup vs SDPA-BF16 >= 2.9 at KV >= 32K,
    >= 85% of the NVFP4 floor, ResAttn / plain <= 1.05 (min / max over points)."""
    sp, fl, rp = [], [], []
    for e in configs:
        r = ((e.get("resattn") or {}).get("best") or {}).get("us")
        pl = ((e.get("plain") or {}).get("best") or {}).get("us")
        sd = (e.get("sdpa") or {}).get("us")
        if not r:
            continue
        fl.append(e["floor_us"] / r)
        if sd and e["kv_len"] >= 32768:
            sp.append(sd / r)
        if pl:
            rp.append(r / pl)
    return {"min_speedup_vs_sdpa_kv_ge_32k": min(sp, default=None),
            "min_floor_share": min(fl, default=None),
            "max_resattn_over_plain": max(rp, default=None), "points": len(configs)}


def env() -> dict:
    from resgen.kernels.codegen import cute_dsl_version

    props = torch.cuda.get_device_properties(0)
    return {"gpu": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
            "cute_dsl": cute_dsl_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "policy": DEFAULT_POLICY.as_dict(), "hbm_bytes_per_s": HBM,
            "flashinfer": flashinfer_peer.version()
            or f"not measured: {flashinfer_peer.why_not()}"}


def finish(bench: Bench) -> None:
    rep = bench.report
    rep["table"] = summary_table(rep["configs"])
    rep["targets"] = targets(rep["configs"])
    bench.save()
    try:
        from plot_attention import render
        (bench.out_dir / "attention_sm90_check.svg").write_text(render(rep))
    except Exception as e:
        bench.err("plot", e)
        bench.save()
    tests = rep.get("tests") or {}
    n_bad = sum(not c["ok"] for c in rep["checks"])
    print()
    rows = [e["row_check"] for e in rep["configs"] + rep["extras"] if "row_check" in e]
    n_bad += sum(not r["ok"] for r in rows)
    print(f"GPU tests: {tests.get('passed', '-')} passed, {tests.get('failed', '-')} failed; "
          f"bench checks: {len(rep['checks']) + len(rows) - n_bad} ok, {n_bad} failed; errors: "
          f"{len(rep['errors'])}; points: {len(rep['configs'])}/{len(grid_order())}; "
          f"{time.time() - bench.t0:.0f} s")
    for r in tests.get("rows", []):
        if r["outcome"] == "failed":
            print(f"  FAILED {r['test'][:150]}")
    print("targets:", json.dumps({k: (round(v, 3) if isinstance(v, float) else v)
                                  for k, v in rep["targets"].items()}))
    print(rep["table"])
    if rep["extras"]:
        print(summary_table(rep["extras"]).split("\n", 2)[2])


def main(argv: list[str]) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget-s", type=float,
                    default=float(os.environ.get("RESGEN_BENCH_BUDGET_S", "205")),
                    help="seconds before no new point starts (default: RESGEN_BENCH_BUDGET_S, "
                         "else 205)")
    ap.add_argument("--out", type=Path,
                    default=Path(os.environ.get("OUT", ROOT / "bench" / "results" / "h200")),
                    help="output folder (default: $OUT, else bench/results/h200)")
    ap.add_argument("--no-tests", action="store_true", help="skip the GPU test file")
    args = ap.parse_args(argv)
    from run_record import run_record

    bench = Bench(args.out, args.budget_s)
    bench.report["run"] = run_record(__file__, argv, policy=DEFAULT_POLICY,
                                     budget_s=args.budget_s)
    try:
        bench.report["env"] = env()
        bench.log(f"{bench.report['env']['gpu']}, budget {bench.budget_s:.0f} s")
        if not args.no_tests and not run_tests(bench):
            raise KeyboardInterrupt
        for geom, b, n in grid_order():
            if bench.left() < 0:
                bench.log("time budget reached: remaining points skipped")
                bench.report["skipped_for_budget"] = True
                break
            try:
                e = run_point(bench, geom, b, n)
                if e:
                    bench.report["configs"].append(e)
            except Exception as e:
                bench.err(f"point {geom} B={b} L={n}", e)
            bench.save()
        # extras while time is left: FP8 PV at KV 32K, then KV 512K at batch <= 8
        for e in [c for c in bench.report["configs"] if c["kv_len"] == 32768 and c["batch"] == 8]:
            if bench.left() < 15:
                break
            try:
                fp8_point(bench, e)
            except Exception as ex:
                bench.err(f"fp8 {e['geom']} B={e['batch']} L={e['kv_len']}", ex)
            bench.save()
        for geom, b in [(g, b) for b in (1, 8) for g in GEOMS]:
            if bench.left() < 15:
                break
            try:
                e = run_point(bench, geom, b, EXTRA_KV)
                if e:
                    bench.report["extras"].append(e)
            except Exception as ex:
                bench.err(f"extra {geom} B={b} L={EXTRA_KV}", ex)
            bench.save()
    except KeyboardInterrupt:
        bench.report["interrupted"] = True
        bench.log("interrupted: writing the results so far")
    finish(bench)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
