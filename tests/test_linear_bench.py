"""bench/gpu_linear_check.py on the CPU: the candidate plan (every task a valid variant of its
problem, the fused / PDL / xop kinds present, priorities) and the worker pool's bookkeeping
(claims, results, a hung and a dying worker replaced, budget skips) with a stub worker."""

from __future__ import annotations

import os
import random
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import gpu_linear_check as B  # noqa: E402
from resgen.search.linear_sm90 import FAMILY, LinearSm90Variant  # noqa: E402
from resgen.search.variant import LinearProblem  # noqa: E402


def _phase1():
    tasks = []
    for shape, (n, k) in B.SHAPES.items():
        for mode in ("none", "full"):
            p = LinearProblem("nvfp4", mode, 1, n, k)
            tasks += [B.task("1", shape, p, kind, v) for kind, v in B.phase1_tasks(p)]
    return tasks


def test_plan_tasks_are_valid_and_cover_the_kinds():
    t1 = _phase1()
    rng = random.Random(0)
    for t in t1:
        t["median_us"] = rng.uniform(5, 20)
    t2 = B.phase2_tasks(t1)
    for t in t2:
        t["median_us"] = rng.uniform(5, 20)
    t3 = B.phase3_tasks(t1, t2)
    for t in t1 + t2 + t3:
        p = LinearProblem.from_key(t["problem"])
        v = LinearSm90Variant.from_key(t["variant"])
        assert FAMILY.why_invalid(v, p, "sm_90a") is None, (t["name"], p.key())
        assert t["act"] == v.act.value and t["pdl"] == v.pdl
        if t["kind"] == "gemm":
            assert not v.fused
    kinds = {(t["kind"], t["act"], t["pdl"]) for t in t1}
    assert {("layer", "fused", True), ("layer", "fused", False), ("gemm", "xop", True),
            ("layer", "xop", False)} <= kinds
    per_layer = {(t["shape"], t["mode"]) for t in t1}
    assert len(per_layer) == 8
    ms = {(t["fmt"], t["mode"], t["m"]) for t in t2 + t3}
    for m in B.MS_PHASE2 + (128,):
        assert ("nvfp4", "none", m) in ms and ("nvfp4", "full", m) in ms
    for key in (("mxfp4", "full", 1), ("mxfp4", "none", 16), ("nvfp4", "0.125", 1),
                ("nvfp4", "0.125", 16)):
        assert key in ms
    m16 = [t for t in t2 if t["m"] == 16 and t["mode"] == "full" and t["shape"] == "o"]
    assert len({t["variant"] for t in m16}) >= 15           # M = 16 searched broadly
    assert t3[0]["fmt"] == "nvfp4" and t3[0]["mode"] in ("none", "full")
    assert t3[-1]["m"] == 128
    ids = [t["id"] for t in t1 + t2 + t3]
    assert len(ids) == len(set(ids))


def stub_worker(idx, q_in, q_out, lock_path, deadline):
    """Behaves as the bench worker; a task's "name" says what to do."""
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
        if task["name"] == "die":
            os._exit(7)
        q_out.put(("start", idx, task["id"]))
        if task["name"] == "hang":
            time.sleep(3600)
        if task["name"] == "lost":
            q_out.put(("done", idx, dict(rec, error="broke the context")))
            q_out.put(("lost", idx, "CUDA context broken"))
            os._exit(3)
        time.sleep(0.01)
        rec["median_us"] = 1.0 + task["id"]
        q_out.put(("done", idx, rec))


@pytest.mark.slow
def test_pool_replaces_hung_and_dead_workers(monkeypatch, tmp_path):
    monkeypatch.setattr(B, "HANG_S", 3.0)
    monkeypatch.setattr(B, "BUDGET_S", time.time() - B.T0 + 60.0)
    monkeypatch.setattr(B, "GRACE_S", 10.0)
    monkeypatch.setattr(B, "REPORT", {"tasks": [], "baselines": [], "errors": []})
    tasks = [{"id": i, "group": f"g{i % 3}", "name": "ok", "pdl": False, "act": "xop"}
             for i in range(24)]
    tasks[5]["name"] = "hang"
    tasks[11]["name"] = "die"
    tasks[17]["name"] = "lost"
    pool = B.Pool(3, str(tmp_path / "lock"), target=stub_worker)
    try:
        out = pool.run(tasks, slots_per_group=1)
    finally:
        pool.close()
    assert [r["id"] for r in out] == list(range(24))
    assert "hung" in out[5]["error"] and "died" in out[11]["error"]
    assert out[17]["error"] == "broke the context"
    ok = [r for r in out if r["name"] == "ok"]
    assert all(r.get("median_us") == 1.0 + r["id"] for r in ok)
    assert len(B.REPORT["errors"]) == 3


@pytest.mark.slow
def test_pool_skips_tasks_past_the_budget(monkeypatch, tmp_path):
    monkeypatch.setattr(B, "REPORT", {"tasks": [], "baselines": [], "errors": []})
    monkeypatch.setattr(B, "BUDGET_S", time.time() - B.T0 - 1.0)     # already over
    monkeypatch.setattr(B, "GRACE_S", 20.0)
    tasks = [{"id": i, "group": "g", "name": "ok", "pdl": False, "act": "xop"}
             for i in range(4)]
    pool = B.Pool(2, str(tmp_path / "lock"), target=stub_worker)
    try:
        out = pool.run(tasks, slots_per_group=2)
    finally:
        pool.close()
    assert all(r["error"] == "skipped: time budget" for r in out)


def fake_worker(idx, q_in, q_out, lock_path, deadline):
    """A worker that times nothing: a median derived from the task (fused PDL fastest)."""
    while True:
        task = q_in.get()
        if task is None:
            break
        q_out.put(("claim", idx, task["id"]))
        rec = dict(task)
        base = 3.0 + (task["id"] % 17) * 0.5 + task["m"] * 0.1
        rec["median_us"] = base * (0.8 if task["pdl"] else 1.0) * (0.9 if task["act"] ==
                                                                    "fused" else 1.0)
        rec["timing_mode"] = "graph"
        q_out.put(("done", idx, rec))


@pytest.mark.slow
def test_main_end_to_end_with_a_fake_worker(monkeypatch, tmp_path):
    """The whole script's flow (plan, both phases, report, table) with workers that time
    nothing and baselines replaced by fixed numbers."""
    import json

    monkeypatch.setattr(B, "REPORT", {"tasks": [], "baselines": [], "errors": []})
    monkeypatch.setattr(B, "OUT", tmp_path)
    monkeypatch.setattr(B, "worker_main", fake_worker)
    monkeypatch.setattr(B, "environment", lambda: {"gpu_name": "fake"})

    def fake_baselines(lock, stop):
        for m in B.BASE_MS:
            for shape in B.SHAPES:
                for name, us in (("cublas_bf16", 50.0), ("cublas_fp8", 25.0)):
                    B.REPORT["baselines"].append({"baseline": name, "shape": shape, "m": m,
                                                  "median_us": us})
        for shape in B.SHAPES:
            for rows in (1, 2, 16, 32):
                B.REPORT["baselines"].append({"baseline": "triton_mxfp4", "shape": shape,
                                              "m": rows, "median_us": 80.0})

    monkeypatch.setattr(B, "baselines", fake_baselines)
    import torch

    monkeypatch.setattr(torch.cuda, "init", lambda: None)
    B.main(["--workers", "3", "--out", str(tmp_path)])
    monkeypatch.undo()
    rep = json.loads((tmp_path / "linear_sm90_check.json").read_text())
    assert rep["tasks"] and all(t.get("median_us") for t in rep["tasks"])
    assert rep["run"]["argv"] == ["--workers", "3", "--out", str(tmp_path)]
    assert rep["run"]["command"].startswith("python3 bench/gpu_linear_check.py --workers 3")
    assert rep["run"]["policy"]["name"] == "cold-l2-graph" and rep["run"]["workers"] == 3
    sums = [ln for ln in rep["table"] if ln.startswith("sum nvfp4")]
    assert any("none  M=  1" in ln for ln in sums) and any("full  M= 16" in ln for ln in sums)
    assert any(ln.startswith("triton mxfp4") for ln in rep["table"])


@pytest.mark.slow
def test_repeated_pdl_hangs_switch_pdl_off(monkeypatch, tmp_path):
    monkeypatch.setattr(B, "HANG_S", 2.0)
    monkeypatch.setattr(B, "BUDGET_S", time.time() - B.T0 + 60.0)
    monkeypatch.setattr(B, "GRACE_S", 10.0)
    monkeypatch.setattr(B, "REPORT", {"tasks": [], "baselines": [], "errors": []})
    tasks = [{"id": i, "group": "g", "name": "hang" if i < 2 else "ok", "pdl": i % 2 == 0
              or i < 2, "act": "xop"} for i in range(8)]
    pool = B.Pool(1, str(tmp_path / "lock"), target=breaker_worker)
    try:
        out = pool.run(tasks, slots_per_group=1)
    finally:
        pool.close()
    assert "hung" in out[0]["error"] and "hung" in out[1]["error"]
    for r in out[2:]:
        if r["pdl"]:
            assert r["error"].startswith("skipped: pdl")
        else:
            assert r.get("median_us")


def breaker_worker(idx, q_in, q_out, lock_path, deadline):
    """stub_worker that honours the skip flags like the bench worker."""
    while True:
        task = q_in.get()
        if task is None:
            break
        q_out.put(("claim", idx, task["id"]))
        rec = dict(task)
        if task["pdl"] and os.path.exists(f"{lock_path}.skip_pdl"):
            rec["error"] = "skipped: pdl variants hung or crashed repeatedly"
            q_out.put(("done", idx, rec))
            continue
        q_out.put(("start", idx, task["id"]))
        if task["name"] == "hang":
            time.sleep(3600)
        rec["median_us"] = 1.0
        q_out.put(("done", idx, rec))
