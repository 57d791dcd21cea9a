"""GPU check + benchmark of linear_sm90_mma (Hopper decode FP4 linear) on the Qwen3-8B shapes,
timed as BENCH.md asks: the WHOLE layer (BF16 activations in, online quantization included).

    scripts/devcache.sh
    source .devcache/device/env.sh && RESGEN_CACHE_DIR=/tmp/resgen-cache \\
        python3 bench/gpu_linear_check.py            # about 6 minutes; JSON to $OUT

What is measured (shapes qkv 6144x4096, o 4096x4096, gate/up 24576x4096, down 4096x12288):
- "layer": the whole linear layer. Fused variants (act=fused: each CTA quantizes its K range
  of x with a static alpha in the GEMM's prologue) are ONE launch; xop variants are timed with
  the separate quantizer in front (quant_sm90 + GEMM, two launches). Checked against
  resgen.reference.linear on the same bf16 activations first (NaN-poisoned output,
  rel err <= 3e-3).
- "gemm": xop variants on a prepared operand (GEMM + fold + epilogue only), for comparison.
- PDL variants (pdl=True) launch with programmatic stream serialization: the next layer's
  weight prologue overlaps this layer's tail. Their times come from back-to-back launches of
  the same layer, i.e. the overlap a decode step gets when the kernel before also lets its
  dependents launch early; the table shows them in their own column.
Plan: phase 1, M = 1, NVFP4 plain and M-Ext, ~30 candidates per shape and mode (the fused
patterns with and without PDL, the xop default alone and behind the quantizer, xop patterns);
phase 2 the same at M = 16, MXFP4 at M = 1 with M = 1's best, K-Ext 0.125 at M = 1; phase 3
M = 2, 4, 8, 32, 64 with the best of M = 1 and M = 16, M = 128, MXFP4 and K-Ext at M = 16.
Baselines in the same process and run (interleaved with the candidates): cuBLAS BF16
(torch.matmul), cuBLAS FP8 (torch._scaled_mm, per-tensor, activation quantized per call) at
every M, Triton tl.dot_scaled MXFP4 x BF16 (bench/baselines.py; guarded) at M = 1 and 16.
Timing: resgen.search.timing.measure, policy cold-l2-graph (CUDA graph of many launches,
input sets rotated past 2 x the 60 MB L2, median of 7).

RESGEN_BENCH_PLAN=cluster runs a different, one-phase plan instead: the cluster study (the fused
winning patterns with cluster = 1, 2, 4 CTAs sharing one quantization, NVFP4 plain and M-Ext
at M = 1, 4, 16 and MXFP4 M-Ext at M = 1), JSON $OUT/linear_cluster_check.json, a per-cluster
summary table last.

Candidates compile in RESGEN_BENCH_WORKERS spawned processes (default: CPU cores - 2, at most
14); one process at a time holds the GPU (file lock). A process whose kernel hangs longer than
RESGEN_BENCH_HANG_S (60) is killed and replaced; a broken CUDA context replaces the process;
every failure is recorded, nothing stops the run. Tasks not started before the time budget
RESGEN_BENCH_BUDGET_S (340) are skipped; the run is killed at the budget + 120 s with the partial
JSON written. Prints a short table last; writes $OUT/linear_sm90_check.json.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import queue as _queue
import sys
import threading
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from resgen.models import get_model  # noqa: E402

ARCH = "sm_90a"
OUT = Path(os.environ.get("OUT", "bench/results/h200"))
BUDGET_S = float(os.environ.get("RESGEN_BENCH_BUDGET_S", "340"))
HANG_S = float(os.environ.get("RESGEN_BENCH_HANG_S", "60"))
GRACE_S = 120.0
_QWEN3_8B = get_model("qwen3-8b").linear_nk()
SHAPES = {name: _QWEN3_8B[name] for name in ("gate_up", "down", "qkv", "o")}   # priority
PLAN = os.environ.get("RESGEN_BENCH_PLAN", "full")
WORKERS = int(os.environ.get("RESGEN_BENCH_WORKERS",
                             str(max(2, min(14, (os.cpu_count() or 4) - 2)))))
MS_PHASE2 = (16, 4, 64, 8, 2, 32)        # priority order (a budget cut drops the last)
BASE_MS = (1, 2, 4, 8, 16, 32, 64, 128)
T0 = time.time()


def left() -> float:
    return BUDGET_S - (time.time() - T0)


# ----------------------------------------------------------------------------- candidates


def _patterns():
    from resgen.search.linear_sm90 import Pipeline, Reduction

    CP, DI, RG = Pipeline.CP_ASYNC, Pipeline.DIRECT, Pipeline.REGS
    N, W, A = Reduction.NONE, Reduction.WORKSPACE, Reduction.ATOMIC
    ALL = -1                                   # l2_prefetch = every iteration up front
    # (warps_m, warps_k, m_tiles, pipeline, stages, l2_prefetch, split_k, reduce)
    fused = [(1, 8, 1, CP, 3, 0, 1, N), (1, 8, 1, DI, 1, ALL, 1, N), (1, 4, 1, CP, 3, 0, 1, N),
             (1, 4, 1, DI, 1, 1, 1, N), (2, 4, 1, CP, 3, 0, 1, N), (4, 2, 1, RG, 1, 0, 1, N),
             (4, 2, 1, RG, 1, ALL, 1, N), (2, 2, 2, CP, 4, 0, 1, N), (1, 4, 1, CP, 3, 0, 2, W),
             (1, 8, 1, CP, 3, 0, 2, A), (1, 4, 1, DI, 1, ALL, 2, A), (1, 4, 2, CP, 3, 0, 1, N),
             (1, 2, 1, CP, 3, 0, 3, W), (1, 2, 1, DI, 1, ALL, 3, A), (2, 2, 1, DI, 1, 1, 3, W),
             (1, 2, 1, CP, 3, 0, 1, N)]
    gemm = [(1, 8, 1, CP, 3, 0, 1, N), (4, 2, 1, RG, 1, 0, 1, N), (1, 4, 1, DI, 1, 1, 1, N),
            (1, 8, 1, DI, 1, ALL, 1, N)]
    return fused, gemm


def _make(pat, nt, act, pdl, p):
    """The variant of pattern `pat` for problem p, or None if it is not valid there."""
    from resgen.search.linear_sm90 import FAMILY, LinearSm90Variant, Packing, geometry_of

    wm, wk, mt, pl, st, l2, sk, red = pat
    try:
        v = LinearSm90Variant(wm, wk, mt, nt, 1, pl, st, 0, sk, red, Packing.SPLIT, act, pdl)
        if l2 < 0:
            nit = geometry_of(v, p).nit
            if nit < 1 or nit > 8:
                return None
            l2 = nit
        v = dataclasses.replace(v, l2_prefetch=l2)
    except (ValueError, ZeroDivisionError):
        return None
    return v if FAMILY.why_invalid(v, p, ARCH) is None else None


def _nt_for(p) -> int:
    from resgen.kernels.linear_sm90_geom import pow2_ceil

    return min(8, pow2_ceil(-(-p.rows // 8)))


def adapt(v, p):
    """v's configuration for problem p (another M): token tile for the rows, then halved
    token tiles / more K splits until it fits (shared memory of fused tiles, registers)."""
    from resgen.search.linear_sm90 import FAMILY, Reduction

    nt = _nt_for(p)
    tries = []
    for n in (nt, max(1, nt // 2), max(1, nt // 4)):
        tries.append(dataclasses.replace(v, n_tiles=n))
        for sk in (2, 4, 3, 6):
            if sk > v.split_k:
                red = v.reduce if v.split_k > 1 else Reduction.WORKSPACE
                tries.append(dataclasses.replace(v, n_tiles=n, split_k=sk, reduce=red,
                                                 l2_prefetch=min(v.l2_prefetch, 1)))
    for c in tries:
        if FAMILY.why_invalid(c, p, ARCH) is None:
            return c
    return None


def phase1_tasks(p) -> list[tuple[str, object]]:
    """(kind, variant) candidates for a problem at its own M: every fused pattern with and
    without PDL (adapted to the rows where it does not fit as is), the default xop variant
    alone and behind the quantizer, and the xop patterns with PDL."""
    from resgen.search.linear_sm90 import FAMILY, Act, LinearSm90Variant, Packing

    fused, gemm = _patterns()
    nt = _nt_for(p)
    out = []
    for pat in fused:
        for pdl in (True, False):
            v = _make(pat, nt, Act.FUSED, pdl, p)
            if v is None and p.rows > 8:
                wm, wk, mt, pl, st, l2, sk, red = pat
                try:
                    v = adapt(LinearSm90Variant(wm, wk, mt, 1, 1, pl, st, max(l2, 0), sk, red,
                                                Packing.SPLIT, Act.FUSED, pdl), p)
                except ValueError:
                    v = None
            if v is not None:
                out.append(("layer", v))
    d = FAMILY.default(p, ARCH)
    out.append(("gemm", d))
    out.append(("layer", d))                          # quant_sm90 + GEMM, two launches
    for pat in gemm:
        v = _make(pat, nt, Act.XOP, True, p)
        if v is not None and v != d:
            out.append(("gemm", v))
    seen, uniq = set(), []
    for kind, v in out:
        if (kind, v.key()) not in seen:
            seen.add((kind, v.key()))
            uniq.append((kind, v))
    return uniq


# ----------------------------------------------------------------------------- workers


def _quantizer(p, cache):
    from resgen.kernels.quant_sm90 import QuantConfig, compile_config

    key = (p.fmt, p.compensation, p.k)
    if key not in cache:
        cfg = QuantConfig(fmt=p.fmt, compensation=p.compensation, k=p.k,
                          layout="row_pair" if p.compensation == "full" else "plain",
                          write_codes=False, write_xop=True,
                          alpha="none" if p.fmt == "mxfp4" else "static", kp_align=256)
        cache[key] = compile_config(cfg)[0]
    return cache[key]


def worker_main(idx: int, q_in, q_out, lock_path: str, deadline: float) -> None:
    """Compile, check and time tasks from q_in; one message per task on q_out."""
    import fcntl

    import torch

    from resgen.search import build
    from resgen.search.linear_sm90 import FAMILY, LinearSm90Variant
    from resgen.search.timing import DEFAULT_POLICY, measure
    from resgen.search.variant import LinearProblem

    torch.cuda.init()
    compiled: dict[tuple[str, str], object] = {}
    qcache: dict = {}
    while True:
        task = q_in.get()
        if task is None:
            break
        q_out.put(("claim", idx, task["id"]))
        rec = dict(task)
        if time.time() > deadline:
            rec["error"] = "skipped: time budget"
            q_out.put(("done", idx, rec))
            continue
        off = [k for k in ("pdl", "fused") if os.path.exists(f"{lock_path}.skip_{k}")
               and (task["pdl"] if k == "pdl" else task["act"] == "fused")]
        if off:
            rec["error"] = f"skipped: {off[0]} variants hung or crashed repeatedly"
            q_out.put(("done", idx, rec))
            continue
        try:
            p = LinearProblem.from_key(task["problem"])
            v = LinearSm90Variant.from_key(task["variant"])
            ck = (v.key(), FAMILY.compile_key(v, p).key())
            if ck not in compiled:
                t = time.time()
                out = build.compile_variant(FAMILY, v, p, ARCH)
                compiled[ck] = out
                rec.update(compile_s=round(time.time() - t, 2), registers=out.registers,
                           spill_bytes=out.spill_bytes)
            out = compiled[ck]
            if not out.ok:
                rec["error"] = "compile failed: " + (out.error or "")[:1500]
                q_out.put(("done", idx, rec))
                continue
            quant = None
            if task["kind"] == "layer" and not v.fused:
                quant = _quantizer(p, qcache)
            with open(lock_path, "a+") as lk:
                fcntl.flock(lk.fileno(), fcntl.LOCK_EX)
                try:
                    q_out.put(("start", idx, task["id"]))
                    n_sets = DEFAULT_POLICY.sets_for(FAMILY.working_set_bytes(v, p))
                    r = FAMILY.runner(out.compiled, v, p, "cuda", n_sets=n_sets, seed=0)
                    if quant is not None:
                        r.attach_quantizer(quant)
                        chk = r.check_quantized()
                    else:           # the GEMM alone on a torch operand (fused: the layer)
                        r = r.gemm_only()
                        chk = r.check()
                    rec["rel_err"] = chk.rel_err if math.isfinite(chk.rel_err) else None
                    if not chk.ok:
                        rec["error"] = "check failed: " + chk.detail
                    else:
                        tm = measure(r, DEFAULT_POLICY, n_sets)
                        rec.update(median_us=tm.median_us, q10_us=tm.quantile_us(0.1),
                                   q90_us=tm.quantile_us(0.9), timing_mode=tm.mode,
                                   timing_note=tm.note, launches=tm.launches, n_sets=n_sets)
                    del r
                    torch.cuda.synchronize()
                finally:
                    fcntl.flock(lk.fileno(), fcntl.LOCK_UN)
        except Exception as e:
            rec["error"] = f"{type(e).__name__}: {e}"[:1500]
            rec["traceback"] = traceback.format_exc()[-2000:]
            try:
                torch.cuda.synchronize()
            except Exception:
                q_out.put(("done", idx, rec))
                q_out.put(("lost", idx, f"CUDA context broken by {task.get('name')}"))
                os._exit(3)
        q_out.put(("done", idx, rec))


class Pool:
    """Worker processes with their own task queues (tasks of one layer stay on the processes
    assigned to it: prepared weights are reused); hung or dead processes are replaced."""

    def __init__(self, n: int, lock_path: str, target=None):
        import multiprocessing as mp

        self.ctx = mp.get_context("spawn")
        self.n, self.lock = n, lock_path
        self.target = target or worker_main
        # SimpleQueue: put() writes the pipe synchronously, so a message sent just before a
        # process dies is never lost (a Queue's feeder thread would drop it)
        self.q_out = self.ctx.SimpleQueue()
        self.q_in = [self.ctx.Queue() for _ in range(n)]
        self.procs = [self._spawn(i) for i in range(n)]
        self.inflight: dict[int, tuple[int, float]] = {}
        self.claimed: dict[int, int] = {}
        self.broken: dict[str, int] = {}
        self.respawns = 0

    def _spawn(self, i: int):
        p = self.ctx.Process(target=self.target, daemon=True,
                             args=(i, self.q_in[i], self.q_out, self.lock,
                                   T0 + BUDGET_S))
        p.start()
        return p

    def _breaker(self, task: dict) -> None:
        """Two hung / crashed PDL tasks (or three fused ones) switch the rest of that kind
        off: a systematic failure must not eat the budget 60 s at a time."""
        for kind, hit, limit in (("pdl", task.get("pdl"), 2),
                                 ("fused", task.get("act") == "fused", 3)):
            if hit:
                self.broken[kind] = self.broken.get(kind, 0) + 1
                if self.broken[kind] >= limit:
                    Path(f"{self.lock}.skip_{kind}").touch()

    def _replace(self, i: int, why: str) -> None:
        REPORT["errors"].append(f"worker {i}: {why}")
        try:
            self.procs[i].kill()
        except Exception:
            pass
        self.inflight.pop(i, None)
        self.claimed.pop(i, None)
        if self.respawns < 3 * self.n:
            self.respawns += 1
            self.procs[i] = self._spawn(i)

    def run(self, tasks: list[dict], slots_per_group: int) -> list[dict]:
        """Run tasks (dicts with "id" and "group"); returns their records."""
        groups: dict[str, list[dict]] = {}
        for t in tasks:
            groups.setdefault(t["group"], []).append(t)
        w = 0
        for ts in groups.values():
            ws = [(w + j) % self.n for j in range(min(slots_per_group, self.n))]
            w = (w + len(ws)) % self.n
            for j, t in enumerate(ts):
                self.q_in[ws[j % len(ws)]].put(t)
        want = {t["id"]: t for t in tasks}
        got: dict[int, dict] = {}
        byid = want
        while len(got) < len(want):
            if time.time() > T0 + BUDGET_S + GRACE_S:
                for i in range(self.n):
                    self.procs[i].kill()
                REPORT["errors"].append("hard stop: budget + grace passed")
                break
            try:
                # liveness first, then emptiness: a process found dead before an empty pipe
                # has had every message it wrote read already
                dead = [i for i in range(self.n) if not self.procs[i].is_alive()]
                if self.q_out.empty():
                    if not dead:
                        time.sleep(0.2)
                    raise _queue.Empty
                kind, i, obj = self.q_out.get()
            except _queue.Empty:
                now = time.time()
                for i, (tid, t0) in list(self.inflight.items()):
                    if now - t0 > HANG_S:
                        got[tid] = dict(byid[tid], error=f"hung > {HANG_S:.0f} s: killed")
                        self._breaker(byid[tid])
                        self._replace(i, f"task {tid} hung")
                for i in dead:
                    if not self.procs[i].is_alive():
                        # messages are written synchronously, so the claim of the task it
                        # died holding (if any) has arrived
                        tid = self.claimed.get(i)
                        if tid is not None and tid in byid and tid not in got:
                            got[tid] = dict(byid[tid], error="worker died while running it")
                            self._breaker(byid[tid])
                        self._replace(i, f"died (exit code {self.procs[i].exitcode})")
                continue
            if kind == "claim":
                self.claimed[i] = obj
            elif kind == "start":
                self.inflight[i] = (obj, time.time())
            elif kind == "done":
                self.inflight.pop(i, None)
                self.claimed.pop(i, None)
                if obj["id"] in want:
                    got[obj["id"]] = obj
            elif kind == "lost":
                tid = self.claimed.get(i)
                if tid in byid:
                    self._breaker(byid[tid])
                self.inflight.pop(i, None)
                self.procs[i].join(timeout=5)
                self._replace(i, obj)
        return [got.get(t["id"], dict(t, error="not run")) for t in tasks]

    def close(self) -> None:
        for q in self.q_in:
            q.put(None)
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()


# ----------------------------------------------------------------------------- baselines


REPORT: dict = {"tasks": [], "baselines": [], "errors": []}


def _timed(name, make_sets, bytes_per_set):
    import torch

    from resgen.search.timing import DEFAULT_POLICY, CallableRunner, measure

    n_sets = DEFAULT_POLICY.sets_for(bytes_per_set)
    fns = make_sets(n_sets)
    t = measure(CallableRunner(fns), DEFAULT_POLICY, n_sets)
    del fns
    torch.cuda.synchronize()
    return t


def baselines(lock_path: str, stop: threading.Event) -> None:
    """cuBLAS BF16 / FP8 at every M, Triton MXFP4 at M = 1, 16 (and 2M rows: the M-Ext
    GEMM). One hold of the GPU lock for all of them (a flock is not fair: taking it per
    baseline against 14 workers could starve this thread), while the workers compile."""
    import fcntl

    import torch

    import baselines as B
    from resgen import formats as F

    def locked(fn):
        return fn()

    lk = open(lock_path, "a+")
    fcntl.flock(lk.fileno(), fcntl.LOCK_EX)
    try:
        _baselines(B, F, torch, locked, stop)
    finally:
        fcntl.flock(lk.fileno(), fcntl.LOCK_UN)
        lk.close()


def _baselines(B, F, torch, locked, stop) -> None:

    jobs = []
    for m in BASE_MS:
        for shape, (n, k) in SHAPES.items():
            for name in ("cublas_bf16", "cublas_fp8"):
                jobs.append((name, shape, n, k, m))
    for m in (1, 16):
        for shape, (n, k) in SHAPES.items():
            for rows in (m, 2 * m):
                jobs.append(("triton_mxfp4", shape, n, k, rows))
    for name, shape, n, k, m in jobs:
        if stop.is_set() or left() < 0:
            break
        rec = {"baseline": name, "shape": shape, "m": m}
        try:
            if name == "triton_mxfp4":
                rec.update(locked(lambda: _triton(B, F, n, k, m)))
            else:
                make = B.cublas_bf16 if name == "cublas_bf16" else B.cublas_fp8_torch_quant
                per = n * k * 2 if name == "cublas_bf16" else n * k

                def sets(cnt, make=make, n=n, k=k, m=m):
                    return [make(torch.randn(m, k, device="cuda", dtype=torch.bfloat16),
                                 torch.randn(n, k, device="cuda", dtype=torch.bfloat16))
                            for _ in range(cnt)]

                t = locked(lambda: _timed(name, sets, per))
                rec.update(median_us=t.median_us, timing_mode=t.mode)
        except Exception as e:
            rec["error"] = f"{type(e).__name__}: {e}"[:800]
            try:
                torch.cuda.synchronize()
            except Exception:
                REPORT["errors"].append("baselines: CUDA context broken; stopping baselines")
                REPORT["baselines"].append(rec)
                return
        REPORT["baselines"].append(rec)


def _triton(B, F, n, k, m) -> dict:
    """Triton MXFP4 x BF16 (bench/baselines.py triton_mxfp4), every form: each checked against
    the dequantized weights (rel err <= 1e-2) and timed only if right; the record keeps every
    form's outcome and the fastest correct one as median_us (the bf16-LHS "rhs" form returned
    wrong values on the H200 with Triton 3.6, rel err 1.4)."""
    import torch

    if not B.TRITON_AVAILABLE:
        return {"error": "Triton not importable"}
    g = torch.Generator(device="cuda").manual_seed(1)
    w = torch.randn(n, k, generator=g, device="cuda")
    q = F.quantize(w, "mxfp4")
    x = torch.randn(m, k, generator=g, device="cuda").to(torch.bfloat16)
    ref = x.float() @ F.dequantize(q).T
    pool = [q]                 # weight sets for the cold-L2 rotation, made as needed
    forms: dict = {}
    for form in B.TRITON_FORMS:
        rec: dict = {}
        try:
            y = B.triton_mxfp4(x, q.codes, q.scales, form=form)().float()
            rel = float((y - ref).norm() / ref.norm())
            rec["rel_err"] = rel
            if not math.isfinite(rel) or rel > 1e-2:
                rec["check"] = f"rel err {rel:.3e} vs the dequantized weights"
            else:
                def sets(cnt, form=form):
                    while len(pool) < cnt:
                        pool.append(F.quantize(torch.randn(n, k, generator=g, device="cuda"),
                                               "mxfp4"))
                    return [B.triton_mxfp4(x, qq.codes, qq.scales, form=form)
                            for qq in pool[:cnt]]

                t = _timed("triton", sets, n * k // 2 + n * k // 32)
                rec.update(median_us=t.median_us, timing_mode=t.mode)
        except Exception as e:
            rec["error"] = f"{type(e).__name__}: {e}"[:300]
        forms[form] = rec
    out: dict = {"forms": forms}
    ok = {f: r["median_us"] for f, r in forms.items() if "median_us" in r}
    if ok:
        best = min(ok, key=ok.get)
        out.update(median_us=ok[best], form=best, rel_err=forms[best]["rel_err"])
    else:
        out["check"] = "no Triton form matched the dequantized weights"
    return out


# ----------------------------------------------------------------------------- plan


_NEXT_ID = [0]


def task(phase: str, shape: str, p, kind: str, v) -> dict:
    _NEXT_ID[0] += 1
    return {"id": _NEXT_ID[0], "phase": phase, "shape": shape, "fmt": p.fmt,
            "mode": p.compensation, "m": p.m, "problem": p.key(), "variant": v.key(),
            "name": v.name().split(":", 1)[1], "kind": kind, "act": v.act.value,
            "pdl": bool(v.pdl), "group": f"{shape}/{p.fmt}/{p.compensation}"}


def ranked(recs, **match) -> list[dict]:
    """Timed records matching `match`, fastest first. Eagerly timed ones (graph capture
    failed: CPU launch gaps included) are not comparable and left out."""
    ok = [r for r in recs if r.get("median_us") and r.get("timing_mode") != "eager"
          and all(r.get(k) == v for k, v in match.items())]
    return sorted(ok, key=lambda r: r["median_us"])


def _picks(recs: list[dict], shape: str, mode: str) -> tuple[list[str], str | None]:
    """Best fused configurations of a (shape, mode) run (top 2 and the best without PDL)
    and the best xop one."""
    rs = [r for r in recs if r["shape"] == shape and r["mode"] == mode and r["fmt"] == "nvfp4"]
    picks = [r["variant"] for r in ranked(rs, kind="layer", act="fused")[:2]]
    nopdl = ranked(rs, kind="layer", act="fused", pdl=False)
    if nopdl and nopdl[0]["variant"] not in picks:
        picks.append(nopdl[0]["variant"])
    gemm = ranked(rs, kind="gemm")
    return picks, (gemm[0]["variant"] if gemm else None)


def _adapted(out: list, shape: str, p, keys, kinds=("layer",)) -> None:
    from resgen.search.linear_sm90 import LinearSm90Variant

    for key in keys:
        v = adapt(LinearSm90Variant.from_key(key), p)
        if v is not None:
            for kind in kinds:
                if kind == "layer" or not v.fused:
                    out.append(task("2", shape, p, kind, v))


def _unique(out: list[dict]) -> list[dict]:
    seen, uniq = set(), []
    for t in out:
        key = (t["kind"], t["problem"], t["variant"])
        if key not in seen:
            seen.add(key)
            uniq.append(t)
    return uniq


def phase2_tasks(p1: list[dict]) -> list[dict]:
    """M = 16 as broadly as M = 1 (its winners need not be M = 1's), MXFP4 at M = 1 with
    M = 1's best configurations, K-Ext 0.125 at M = 1 with its own candidates."""
    from resgen.search.variant import LinearProblem

    out = []
    for shape, (n, k) in SHAPES.items():
        for mode in ("none", "full"):
            p = LinearProblem("nvfp4", mode, 16, n, k)
            out += [task("2", shape, p, kind, v) for kind, v in phase1_tasks(p)]
        for mode in ("none", "full"):
            picks, xop = _picks(p1, shape, mode)
            _adapted(out, shape, LinearProblem("mxfp4", mode, 1, n, k),
                     picks + ([xop] if xop else []))
        out += _kext_tasks(shape, LinearProblem("nvfp4", "0.125", 1, n, k))
    return _unique(out)


def _kext_tasks(shape, p) -> list[dict]:
    """K-Ext: its own candidates (K + extension = 18 or 54 K groups), PDL ones first."""
    cands = [v for kind, v in phase1_tasks(p) if kind == "layer" and (v.pdl or not v.fused)]
    return [task("2", shape, p, "layer", v)
            for v in cands[:6] + [v for v in cands[6:] if not v.fused][:1]]


def phase3_tasks(p1: list[dict], p2: list[dict]) -> list[dict]:
    """The other M with the best configurations of M = 1 and M = 16 (fused and xop: layer and
    GEMM), M = 128 with the best M = 16 ones, MXFP4 and K-Ext 0.125 at M = 16."""
    import dataclasses as dc

    from resgen.search.linear_sm90 import LinearSm90Variant
    from resgen.search.variant import LinearProblem

    out = []
    for shape, (n, k) in SHAPES.items():
        for mode in ("none", "full"):
            picks1, xop1 = _picks(p1, shape, mode)
            picks16, xop16 = _picks(p2, shape, mode)
            keys = list(dict.fromkeys(picks1 + picks16))
            xops = list(dict.fromkeys([x for x in (xop1, xop16) if x]))
            for m in MS_PHASE2:
                if m == 16:
                    continue
                p = LinearProblem("nvfp4", mode, m, n, k)
                _adapted(out, shape, p, keys)
                _adapted(out, shape, p, xops, kinds=("layer", "gemm"))
            p128 = LinearProblem("nvfp4", mode, 128, n, k)
            top = picks16[:1]
            if top:                            # the best configuration with PDL toggled
                v0 = LinearSm90Variant.from_key(top[0])
                top.append(dc.replace(v0, pdl=not v0.pdl).key())
            _adapted(out, shape, p128, top + xops[-1:])
            _adapted(out, shape, LinearProblem("mxfp4", mode, 16, n, k),
                     picks16 + xops[-1:])
        out += _kext_tasks(shape, LinearProblem("nvfp4", "0.125", 16, n, k))
    order = {m: i for i, m in enumerate(MS_PHASE2 + (128,))}
    klass = {("nvfp4", "none"): 0, ("nvfp4", "full"): 0, ("mxfp4", "none"): 1,
             ("mxfp4", "full"): 1, ("nvfp4", "0.125"): 2}
    return sorted(_unique(out), key=lambda t: (t["m"] == 128, klass[(t["fmt"], t["mode"])],
                                               order.get(t["m"], 99)))


def cluster_tasks() -> list[dict]:
    """The cluster study: each fused winning pattern (adapted to the rows) with 1, 2 and 4 CTAs
    per cluster, without PDL, for every shape."""
    from resgen.search.linear_sm90 import (FAMILY, Act, LinearSm90Variant, Packing, Pipeline,
                                           Reduction)
    from resgen.search.variant import LinearProblem

    CP, DI, RG = Pipeline.CP_ASYNC, Pipeline.DIRECT, Pipeline.REGS
    N, W = Reduction.NONE, Reduction.WORKSPACE
    pats = [(4, 2, 1, RG, 1, 0, 1, N), (1, 8, 1, CP, 3, 0, 1, N), (2, 4, 1, CP, 3, 0, 1, N),
            (1, 8, 1, DI, 1, 2, 1, N), (4, 2, 1, RG, 1, 0, 2, W)]
    probs = [(fmt, mode, m) for m in (1, 4, 16) for fmt, mode in (("nvfp4", "none"),
                                                                   ("nvfp4", "full"))]
    probs.append(("mxfp4", "full", 1))
    out = []
    for fmt, mode, m in probs:
        for shape, (n, k) in SHAPES.items():
            p = LinearProblem(fmt, mode, m, n, k)
            for wm, wk, mt, pl, st, l2, sk, red in pats:
                base = adapt(LinearSm90Variant(wm, wk, mt, 1, 1, pl, st, l2, sk, red,
                                               Packing.SPLIT, Act.FUSED, False), p)
                if base is None:
                    continue
                for cl in (1, 2, 4):
                    v = dataclasses.replace(base, cluster=cl)
                    if FAMILY.why_invalid(v, p, ARCH) is None:
                        out.append(task("c", shape, p, "layer", v))
    return _unique(out)


def cluster_table() -> list[str]:
    """Per (fmt, mode, M): the sum over the four shapes of the best layer time with each
    cluster size, and per shape the best of each."""
    recs = [r for r in REPORT["tasks"] if r.get("phase") == "c"]
    cls = (1, 2, 4)
    lines = [f"{'fmt':5} {'mode':5} {'M':>3} {'shape':7} " + " ".join(f"{'cl' + str(c):>7}"
                                                                   for c in cls)
             + "  best/cl1"]
    keys = sorted({(r["fmt"], r["mode"], r["m"]) for r in recs})
    for fmt, mode, m in keys:
        sums = {c: 0.0 for c in cls}
        for shape in SHAPES:
            best = {}
            for c in cls:
                rs = [r for r in ranked(recs, shape=shape, fmt=fmt, mode=mode, m=m)
                      if json.loads(r["variant"])["cluster"] == c]
                best[c] = rs[0]["median_us"] if rs else math.nan
                sums[c] += best[c]
            top = min((best[c] for c in cls if best[c] == best[c]), default=math.nan)
            lines.append(f"{fmt:5} {mode:5} {m:>3} {shape:7} "
                         + " ".join(f"{best[c]:7.2f}" for c in cls)
                         + f"  {top / best[1]:.3f}")
        top = min(sums.values())
        lines.append(f"{fmt:5} {mode:5} {m:>3} {'sum':7} " + " ".join(f"{sums[c]:7.2f}"
                                                                  for c in cls)
                     + f"  {top / sums[1]:.3f}")
    return lines


# ----------------------------------------------------------------------------- report


def environment() -> dict:
    from resgen.search.record import current_environment
    from resgen.search.timing import DEFAULT_POLICY

    env = dataclasses.asdict(current_environment())
    env["date"] = datetime.datetime.now(datetime.timezone.utc).isoformat()
    env["policy"] = DEFAULT_POLICY.as_dict()
    env["policy_label"] = DEFAULT_POLICY.label
    env["timed_op"] = ("kind=layer: the whole layer from bf16 activations (fused: one launch; "
                       "xop: quant_sm90 + GEMM); kind=gemm: GEMM + fold + epilogue on a "
                       "prepared operand; pdl=true: back-to-back launches overlap")
    return env


def short(name: str) -> str:
    """A variant name without its default-valued fields (u1, pksplit, sk1_rednone, l20...)."""
    drop = ("u1", "pksplit", "st1", "l20", "sk1", "rednone", "nopdl")
    parts = [x for x in name.split("_") if x not in drop]
    return "_".join(parts).replace("plcp_async", "cp").replace("pldirect", "direct").replace(
        "plregs", "regs").replace("actfused", "fused").replace("actxop", "xop")


def table() -> list[str]:
    import baselines as B

    recs = REPORT["tasks"]
    base = {(b["baseline"], b["shape"], b["m"]): b.get("median_us") for b in REPORT["baselines"]}
    lines = [f"{'shape':7} {'fmt':5} {'mode':5} {'M':>3} {'layer':>7} {'%fl':>4} {'xBF16':>5} "
             f"{'xFP8':>5} {'pdl':>7} {'xBF16':>5} {'gemm':>7} {'ext/pl':>6}  best layer "
             f"variant (non-PDL)"]
    sums: dict[tuple, list[float]] = {}
    for fmt in ("nvfp4", "mxfp4"):
        for mode in ("none", "full", "0.125"):
            for m in (1,) + tuple(sorted(MS_PHASE2)) + (128,):
                for shape, (n, k) in SHAPES.items():
                    sel = dict(shape=shape, fmt=fmt, mode=mode, m=m)
                    lay = ranked(recs, kind="layer", pdl=False, **sel)
                    pdl = ranked(recs, kind="layer", **sel)
                    gemm = ranked(recs, kind="gemm", **sel)
                    if not lay and not pdl:
                        continue
                    floor = B.floor_us(B.nvfp4_weight_bytes(n, k) if fmt == "nvfp4"
                                       else B.mxfp4_weight_bytes(n, k))
                    bf = base.get(("cublas_bf16", shape, m))
                    f8 = base.get(("cublas_fp8", shape, m))
                    lu = lay[0]["median_us"] if lay else math.nan
                    pu = pdl[0]["median_us"] if pdl else math.nan
                    gu = gemm[0]["median_us"] if gemm else math.nan
                    ratio = ""
                    if mode != "none":
                        pl = ranked(recs, kind="layer", pdl=False, shape=shape, fmt=fmt,
                                    mode="none", m=m)
                        if pl and lay:
                            ratio = f"{lu / pl[0]['median_us']:.3f}"
                    s = sums.setdefault((fmt, mode, m), [0.0, 0.0, 0.0, 0.0, 0])
                    s[0] += lu
                    s[1] += pu
                    s[2] += bf or math.nan
                    s[3] += f8 or math.nan
                    s[4] += 1
                    name = short(lay[0]["name"]) if lay else "(pdl) " + short(pdl[0]["name"])
                    lines.append(
                        f"{shape:7} {fmt:5} {mode:5} {m:>3} {lu:7.2f} {100 * floor / lu:4.0f} "
                        f"{(bf or math.nan) / lu:5.2f} {(f8 or math.nan) / lu:5.2f} "
                        f"{pu:7.2f} {(bf or math.nan) / pu:5.2f} {gu:7.2f} {ratio:>6}  "
                        f"{name}")
    lines.append("")
    for (fmt, mode, m), (lu, pu, bf, f8, cnt) in sorted(sums.items(),
                                                        key=lambda kv: (kv[0][0], kv[0][1],
                                                                        kv[0][2])):
        if cnt != len(SHAPES):
            continue
        lines.append(f"sum {fmt} {mode:5} M={m:>3}: layer {lu:7.2f} us x{bf / lu:4.2f} BF16 "
                     f"x{f8 / lu:4.2f} FP8 | with PDL {pu:7.2f} us x{bf / pu:4.2f} BF16 "
                     f"x{f8 / pu:4.2f} FP8 (BF16 {bf:.2f}, FP8 {f8:.2f}; targets x3.5 / x2.0)")
    for fmt in ("nvfp4", "mxfp4"):
        for m in (1,) + tuple(sorted(MS_PHASE2)) + (128,):
            pl, ex = sums.get((fmt, "none", m)), sums.get((fmt, "full", m))
            if pl and ex and pl[4] == ex[4] == len(SHAPES):
                lines.append(f"M-Ext/plain {fmt} M={m:>3} (sum of 4 shapes): layer "
                             f"{ex[0] / pl[0]:.3f}, best with PDL {ex[1] / pl[1]:.3f} "
                             f"(target <= 1.03)")
    for shape in SHAPES:
        for m in (1, 16):
            for rows, label in ((m, "plain"), (2 * m, "M-Ext")):
                t = base.get(("triton_mxfp4", shape, rows))
                mine = ranked(recs, kind="layer", shape=shape, fmt="mxfp4",
                              mode="none" if label == "plain" else "full", m=m)
                if t and mine:
                    us = mine[0]["median_us"]
                    lines.append(f"triton mxfp4 {shape:7} M={m:>2} {label}: {t:7.2f} us, ours "
                                 f"{us:6.2f} us -> x{t / us:.2f}"
                                 f" (target x5 for M-Ext)")
    return lines


def write(path: Path) -> None:
    path.write_text(json.dumps(REPORT, indent=1, default=str))


def main(argv: list[str] | None = None) -> None:
    """argv: the command-line flags (None: none; the RESGEN_BENCH_* environment variables are
    their defaults, so the commands cited in bench/results/h200 still work)."""
    global T0, OUT, BUDGET_S, HANG_S, PLAN, WORKERS
    import argparse

    from resgen.search.timing import DEFAULT_POLICY
    from run_record import run_record

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget-s", type=float, default=BUDGET_S,
                    help="seconds before no new task starts (RESGEN_BENCH_BUDGET_S, else 340)")
    ap.add_argument("--hang-s", type=float, default=HANG_S,
                    help="a task silent this long is killed (RESGEN_BENCH_HANG_S, else 60)")
    ap.add_argument("--plan", choices=("full", "cluster"), default=PLAN,
                    help="the three phases, or the cluster study (RESGEN_BENCH_PLAN)")
    ap.add_argument("--workers", type=int, default=WORKERS,
                    help="compile/check/time processes (RESGEN_BENCH_WORKERS, else "
                         "cores - 2, 2..14)")
    ap.add_argument("--out", type=Path, default=OUT, help="output folder (default: $OUT)")
    args = ap.parse_args([] if argv is None else argv)
    OUT, BUDGET_S, HANG_S, PLAN, WORKERS = (args.out, args.budget_s, args.hang_s, args.plan,
                                            args.workers)
    REPORT["run"] = run_record(__file__, [] if argv is None else argv, policy=DEFAULT_POLICY,
                               budget_s=BUDGET_S, plan=PLAN, workers=WORKERS)
    # the run's budget counts from here, not from the import (an in-process caller such as
    # the tests imports the module long before it calls main(): on a loaded CPU the
    # watchdog then fired at once and killed pytest with exit code 4)
    T0 = time.time()
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / ("linear_cluster_check.json" if PLAN == "cluster" else
                  "linear_sm90_check.json")
    try:
        REPORT["environment"] = environment()
    except Exception as e:
        REPORT["errors"].append(f"environment: {type(e).__name__}: {e}")

    finished = threading.Event()

    def watchdog():
        while time.time() < T0 + BUDGET_S + GRACE_S + 30:
            if finished.wait(2):
                return              # main() returned (in-process callers, e.g. the tests)
        REPORT["errors"].append("watchdog: run exceeded budget + grace; partial results")
        write(path)
        os._exit(4)

    threading.Thread(target=watchdog, daemon=True).start()
    try:
        _main_body(path)
    finally:
        finished.set()


def _main_body(path: Path) -> None:
    import torch

    nw = WORKERS
    lock = f"/tmp/resgen_linear_bench_{os.getpid()}.lock"
    pool = Pool(nw, lock)
    stop = threading.Event()
    bt = threading.Thread(target=baselines, args=(lock, stop), daemon=True)
    torch.cuda.init()
    bt.start()
    if PLAN == "cluster":
        tc = cluster_tasks()
        print(f"[{time.time() - T0:6.1f} s] cluster study: {len(tc)} tasks on {nw} workers",
              flush=True)
        REPORT["tasks"] += pool.run(tc, slots_per_group=-(-nw // 8))
        write(path)
    else:
        run_phases(pool, nw, path)
    stop.set()
    bt.join(timeout=60)
    pool.close()
    REPORT["seconds"] = round(time.time() - T0, 1)
    lines = table() + ([""] + cluster_table() if PLAN == "cluster" else [])
    REPORT["table"] = lines
    write(path)
    _report(lines, path)


def run_phases(pool, nw: int, path: Path) -> None:
    """The full plan: phase 1 (M = 1, NVFP4 plain and M-Ext, every shape), then phases 2 and 3
    built from the results before them (see the module docstring)."""
    from resgen.search.variant import LinearProblem

    tasks1 = []
    for shape, (n, k) in SHAPES.items():
        for mode in ("none", "full"):
            p = LinearProblem("nvfp4", mode, 1, n, k)
            tasks1 += [task("1", shape, p, kind, v) for kind, v in phase1_tasks(p)]
    print(f"[{time.time() - T0:6.1f} s] phase 1: {len(tasks1)} tasks on {nw} workers",
          flush=True)
    r1 = pool.run(tasks1, slots_per_group=-(-nw // 8))
    REPORT["tasks"] += r1
    write(path)
    print(f"[{time.time() - T0:6.1f} s] phase 1 done: "
          f"{sum(1 for r in r1 if r.get('median_us'))} timed, "
          f"{sum(1 for r in r1 if r.get('error'))} failed/skipped", flush=True)
    tasks2 = phase2_tasks(r1)
    print(f"[{time.time() - T0:6.1f} s] phase 2: {len(tasks2)} tasks", flush=True)
    r2 = pool.run(tasks2, slots_per_group=max(1, -(-nw // 16)))
    REPORT["tasks"] += r2
    write(path)
    tasks3 = phase3_tasks(r1, r2)
    print(f"[{time.time() - T0:6.1f} s] phase 3: {len(tasks3)} tasks", flush=True)
    r3 = pool.run(tasks3, slots_per_group=max(1, -(-nw // 16)))
    REPORT["tasks"] += r3
    write(path)


def _report(lines: list[str], path: Path) -> None:
    """Print the short table (rows at M = 1, 16, 64, every summary line) and the failures."""
    recs = REPORT["tasks"]
    failed = [r for r in recs if r.get("error") and not r["error"].startswith("skipped")]
    skipped = [r for r in recs if str(r.get("error", "")).startswith("skipped")]
    eager = [r for r in recs if r.get("timing_mode") == "eager"]
    keep = [ln for ln in lines if not ln or ln.split()[0] not in SHAPES
            or ln.split()[3] in ("M", "1", "16", "64")]
    print("\n".join(keep))
    for r in failed[:10]:
        print(f"  FAILED {r['shape']} {r['fmt']} {r['mode']} M={r['m']} {r['kind']} "
              f"{short(r['name'])}: {r['error'][:160]}")
    for b in REPORT["baselines"]:
        if b.get("error") or b.get("check"):
            print(f"  BASELINE {b['baseline']} {b['shape']} M={b['m']}: "
                  f"{(b.get('error') or b.get('check'))[:160]}")
    for err in REPORT["errors"][:6]:
        print("  ERROR", err[:300])
    print(f"linear_sm90_mma on {REPORT.get('environment', {}).get('gpu_name', '?')}: "
          f"{len(recs)} tasks, {sum(1 for r in recs if r.get('median_us'))} timed, "
          f"{len(failed)} failed, {len(skipped)} skipped (budget), {len(eager)} timed eagerly "
          f"(graph capture failed), {REPORT['seconds']} s")
    print(f"JSON: {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
