"""The `resgen` CLI on a CPU machine: tune falls back to the compile-only pre-flight, show,
db verify / merge / export, the report/plan delegation, `python -m resgen`."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import types

import pytest

import fakefam
from fakefam import isolated_cache, make_env, subprocess_env  # noqa: F401
from resgen.cli import main
from resgen.db import TuningDB
from resgen.search.record import Status

pytestmark = pytest.mark.usefixtures("isolated_cache")

torch = pytest.importorskip("torch")
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU behaviour")

TUNE = ["tune", "--model", "qwen3-8b", "--families", "fake_gemm", "--import", "fakefam",
        "--formats", "nvfp4", "--compensations", "none,full", "--m-buckets", "1,16"]


@no_gpu
@pytest.mark.parametrize("jobs", ["1", "2"])
def test_tune_without_gpu_runs_the_compile_only_preflight(tmp_path, capsys, jobs):
    db = tmp_path / "pre.sqlite"
    rc = main(TUNE + ["--db", str(db), "--jobs", jobs, "--json", str(tmp_path / "s.json"),
                      "--full-preflight"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "No CUDA GPU found" in err and "COMPILE-ONLY" in err
    assert "COMPILE-ONLY PRE-FLIGHT (nothing was run or timed)" in out
    assert "fake_gemm" in out
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["mode"] == "compile-only" and summary["environment"]["compile_only"]
    # 4 Qwen3-8B shapes x 2 compensations x 2 M buckets.
    assert len(summary["workloads"]) == 16
    with TuningDB(db, readonly=True) as d:
        rows = d.rows()
        assert rows and {r["status"] for r in rows} <= {Status.COMPILED, Status.COMPILE_FAILED}
        assert {r["compile_only"] for r in rows} == {1}
        assert all(r["median_us"] is None for r in rows)
        assert {r["arch"] for r in rows} == {"sm_90a"}
        keys = {json.loads(r["workload_key"])["n"] for r in rows}
        assert keys == {6144, 4096, 24576}
    # Resume: a second run compiles nothing new.
    fakefam.COMPILES.clear()
    assert main(TUNE + ["--db", str(db), "--jobs", "1", "--full-preflight"]) == 0
    assert fakefam.COMPILES == []


@no_gpu
def test_default_cpu_preflight_compiles_a_covering_subset(tmp_path, capsys):
    """Issue 22 item 16: without a GPU the default pre-flight compiles a covering subset: every
    value of every workload field in some workload, every axis value of each chosen
    workload's valid space in some compiled variant; its plan speaks of no GPU seconds."""
    import dataclasses

    from resgen.models import get_model, tuning_workloads
    from resgen.search.cover import covering_subset

    db = tmp_path / "pre.sqlite"
    rc = main(TUNE + ["--db", str(db), "--jobs", "1", "--json", str(tmp_path / "s.json")])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "covering subset" in err and "--full-preflight" in err
    assert "GPU s" not in err and "GPU seconds" not in err
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["preflight"] == "cover"
    chosen = [fakefam.FakeProblem.from_key(w["problem_key"]) for w in summary["workloads"]]
    every = tuning_workloads(fakefam.FAMILY, [get_model("qwen3-8b")], formats=["nvfp4"],
                             compensations=["none", "full"], m_buckets=[1, 16])
    assert 1 <= len(chosen) < len(every) == 16
    for f in dataclasses.fields(fakefam.FakeProblem):
        assert {getattr(p, f.name) for p in chosen} == {getattr(p, f.name) for p in every}
    with TuningDB(db, readonly=True) as d:
        rows = d.rows()
    for p in chosen:
        valid = [v for v in fakefam.FAMILY.space(p, "sm_90a")
                 if fakefam.FAMILY.why_invalid(v, p, "sm_90a") is None]
        got = [fakefam.FakeVariant.from_key(r["variant_key"]) for r in rows
               if r["workload_key"] == p.key()]
        for f in dataclasses.fields(fakefam.FakeVariant):
            assert {getattr(v, f.name) for v in got} == {getattr(v, f.name) for v in valid}
        assert len(got) <= len(covering_subset(valid)) + 1      # the default may add one


def test_tune_gpu_path_with_fake_timings(tmp_path, capsys, monkeypatch):
    """The GPU code path of `tune` (worker processes, GPU lock, timing, winners), with the
    device facts and the timer faked so it runs on a CPU."""
    import resgen.cli as cli
    import resgen.search.record as record
    from resgen.runtime import Device, Dispatcher

    monkeypatch.setattr(cli, "_has_gpu", lambda: True)
    monkeypatch.setattr(record, "current_environment", lambda device=0: make_env())
    db = tmp_path / "gpu.sqlite"
    rc = main(TUNE + ["--db", str(db), "--jobs", "2", "--timer", "fakefam:fake_timer",
                      "--max-variants", "5", "--time-budget", "120", "--json",
                      str(tmp_path / "s.json")])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "TUNING SUMMARY" in out and "COMPILE-ONLY" not in out + err
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["mode"] == "tune" and len(summary["workloads"]) == 16
    assert all(w["winner"] and w["evaluated"] <= 5 for w in summary["workloads"])
    with TuningDB(db, readonly=True) as d:
        ok = d.rows(status=Status.OK)
        assert ok and {r["gpu_name"] for r in ok} == {"Fake GPU"}
        assert all(r["timing_mode"] == "fake" for r in ok)
    disp = Dispatcher(paths=[db], device=Device("Fake GPU", "sm_90a"))
    for w in summary["workloads"]:
        p = fakefam.FakeProblem.from_key(w["problem_key"])
        assert disp.lookup(p.OP, p).name() == w["winner"]
    # Cover + refine stages by default, the tune policy, the plan and the phase totals.
    assert summary["stages"] == ["cover", "refine"]
    assert summary["policy"]["name"] == "cold-l2-graph-tune"
    assert summary["plan"]["workloads"] == 16 and summary["plan"]["families"]
    assert set(summary["phase_s"]) == {"compile", "wait", "prep", "check", "time"}
    assert summary["phase_s"]["time"] > 0
    assert all(w["stage"] == "cover+refine" for w in summary["workloads"]), \
        [(w["stage"], w["search"], w["stopped_by"], w["error"], w["timed"])
         for w in summary["workloads"] if w["stage"] != "cover+refine"]
    assert "PLAN: 16 tuning jobs (family x workload) over 16 unique" in err
    assert "seconds by phase" in out
    assert "GPU held" in out and "TOTAL" in out
    with TuningDB(db, readonly=True) as d:
        assert all(json.loads(r["phase_s"])["time"] >= 0 for r in d.rows(status=Status.OK))
        assert {r["policy_name"] for r in d.rows(status=Status.OK)} == {"cold-l2-graph-tune"}
    # A later plan on the same database uses the measured phase seconds.
    assert main(TUNE + ["--db", str(db), "--plan"]) == 0
    out = capsys.readouterr().out
    assert "measured (" in out and "PLAN:" in out


@no_gpu
def test_plan_for_several_models_prints_and_touches_nothing(tmp_path, capsys):
    db = tmp_path / "never.sqlite"
    base = ["tune", "--families", "fake_gemm", "--import", "fakefam", "--plan", "--db",
            str(db), "--time-budget", "420"]
    assert main(base + ["--model", "all"]) == 0
    out = capsys.readouterr().out
    # 3 models x 4 projections (all 12 shapes distinct) x 2 formats x 6 modes x 6 buckets.
    assert "PLAN: 864 tuning jobs (family x workload) over 864 unique workloads, stages " \
        "cover+refine, 14 process(es)" in out
    assert "qwen3-4b:288 qwen3-8b:288 qwen3-32b:288" in out
    assert "estimated GPU seconds" in out and "compile wall seconds" in out
    assert not db.exists()
    # The same model twice: planned once.
    assert main(base + ["--model", "qwen3-8b,Qwen/Qwen3-8B"]) == 0
    assert "over 288 unique workloads" in capsys.readouterr().out
    assert main(base + ["--model", "qwen3-8b", "--compile-only"]) == 0
    out = capsys.readouterr().out
    assert "PLAN (compile-only pre-flight, cover)" in out
    assert "GPU s" not in out and "GPU seconds" not in out
    assert main(base + ["--model", "qwen3-8b", "--compile-only", "--full-preflight"]) == 0
    assert "PLAN (compile-only pre-flight, full): 288 workloads" in capsys.readouterr().out


@no_gpu
def test_tune_shards_partition_the_workloads(tmp_path, capsys):
    """--shard I/N: N runs (e.g. one per GPU) tune disjoint workloads that together are every
    workload once; a bad shard is refused by the parser."""
    seen = []
    for i in range(3):
        s = tmp_path / f"s{i}.json"
        assert main(TUNE + ["--db", str(tmp_path / f"d{i}.sqlite"), "--jobs", "1",
                            "--shard", f"{i}/3", "--json", str(s), "--full-preflight"]) == 0
        seen.append([(w["family"], w["problem_key"])
                     for w in json.loads(s.read_text())["workloads"]])
    capsys.readouterr()
    flat = [k for part in seen for k in part]
    assert len(flat) == len(set(flat)) == 16 and all(5 <= len(part) <= 6 for part in seen)
    assert main(TUNE + ["--db", str(tmp_path / "p.sqlite"), "--plan", "--shard", "1/3"]) == 0
    assert "shard-1/3:5" in capsys.readouterr().out
    for bad in ("3/3", "x", "1/0", "-1/2"):
        with pytest.raises(SystemExit):
            main(TUNE + ["--db", str(tmp_path / "p.sqlite"), "--shard", bad])


@no_gpu
def test_show_verify_merge_export(tmp_path, capsys):
    a, b = tmp_path / "a.sqlite", tmp_path / "b.sqlite"
    fakefam.tune_fake(a, ms=[1, 16], max_variants=6)                 # timed, fake GPU
    fakefam.tune_fake(b, ms=[4], max_variants=4, env=make_env("Fake GPU 2"))
    capsys.readouterr()
    assert main(["show", "--db", str(a), "--import", "fakefam"]) == 0
    out = capsys.readouterr().out
    assert "winner" in out and "fake_gemm:tile" in out and "yes" in out
    assert out.count("\nfake_gemm") == 2                           # two workloads
    assert main(["db", "verify", str(a), "--import", "fakefam"]) == 0
    assert "OK" in capsys.readouterr().out
    merged = tmp_path / "m.sqlite"
    assert main(["db", "merge", str(a), str(b), "--into", str(merged)]) == 0
    with TuningDB(merged, readonly=True) as d, TuningDB(a, readonly=True) as da, \
            TuningDB(b, readonly=True) as dbb:
        assert len(d) == len(da) + len(dbb)
    # --fresh-only keeps the rows whose fingerprint the current checkout reproduces
    import resgen.search.build as build

    fresh = tmp_path / "fresh.sqlite"
    capsys.readouterr()
    assert main(["db", "merge", str(a), "--into", str(fresh), "--fresh-only"]) == 0
    assert "'dropped': 0" in capsys.readouterr().out
    with TuningDB(fresh, readonly=True) as d, TuningDB(a, readonly=True) as da:
        assert len(d) == len(da)
        stale_key = da.rows()[0]["variant_key"]
    real = build.variant_fingerprint

    def changed(fam, v, p, arch):     # as if one variant's template had changed since
        return "0" * 64 if v.key() == stale_key else real(fam, v, p, arch)

    build.variant_fingerprint = changed
    try:
        part = tmp_path / "part.sqlite"
        assert main(["db", "merge", str(a), "--into", str(part), "--fresh-only"]) == 0
    finally:
        build.variant_fingerprint = real
    with TuningDB(part, readonly=True) as d, TuningDB(a, readonly=True) as da:
        n_stale = sum(1 for r in da.rows() if r["variant_key"] == stale_key)
        assert n_stale >= 1 and len(d) == len(da) - n_stale
        assert all(r["variant_key"] != stale_key for r in d.rows())
    assert f"'dropped': {n_stale}" in capsys.readouterr().out
    assert main(["db", "export", str(merged), "--out", str(tmp_path / "x.json")]) == 0
    js = json.loads((tmp_path / "x.json").read_text())
    assert len(js["results"]) == len(TuningDB(merged, readonly=True))
    assert main(["db", "export", str(merged), "--out", str(tmp_path / "ship.sqlite")]) == 0
    assert main(["db", "verify", str(tmp_path / "ship.sqlite")]) == 0
    # Damage is reported with a non-zero exit code.
    c = sqlite3.connect(a)
    c.execute("UPDATE results SET median_us = median_us / 2")
    c.commit()
    c.close()
    capsys.readouterr()
    assert main(["db", "verify", str(a)]) == 1
    assert "checksum" in capsys.readouterr().out
    junk = tmp_path / "junk.sqlite"
    junk.write_bytes(b"not a database at all" * 10)
    assert main(["db", "verify", str(junk)]) == 2
    assert "not an SQLite database" in capsys.readouterr().err
    assert main(["show", "--db", str(junk)]) == 2


def test_report_and_plan_are_delegated(monkeypatch):
    seen = {}
    fake = types.ModuleType("resgen.quality.cli")
    fake.report_main = lambda argv: seen.setdefault("report", argv) and 0
    fake.plan_main = lambda argv: (seen.setdefault("plan", argv), 3)[1]
    monkeypatch.setitem(sys.modules, "resgen.quality.cli", fake)
    import resgen.quality as q

    monkeypatch.setattr(q, "cli", fake, raising=False)
    assert main(["report", "--quick", "--fmt", "nvfp4"]) == 0
    assert main(["plan", "--model", "x", "--budget", "5.0"]) == 3
    assert seen == {"report": ["--quick", "--fmt", "nvfp4"],
                    "plan": ["--model", "x", "--budget", "5.0"]}


@no_gpu
def test_bench_needs_a_gpu(capsys):
    assert main(["bench", "--model", "qwen3-8b"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_bad_arguments(capsys):
    with pytest.raises(SystemExit):
        main(["tune", "--model", "qwen3-8b", "--m-buckets", "1,zero"])
    with pytest.raises(SystemExit):
        main(["tune"])
    assert main(TUNE[:3] + ["--families", "nope", "--compile-only"]) == 2
    assert "unknown families" in capsys.readouterr().err


def test_python_dash_m_resgen(tmp_path):
    r = subprocess.run([sys.executable, "-m", "resgen", "--help"], capture_output=True,
                       text=True, env=subprocess_env(), timeout=120)
    assert r.returncode == 0 and "tune" in r.stdout and "report" in r.stdout
    fakefam.tune_fake(tmp_path / "a.sqlite", ms=[1], max_variants=2)
    r = subprocess.run([sys.executable, "-m", "resgen", "db", "verify",
                        str(tmp_path / "a.sqlite")], capture_output=True, text=True,
                       env=subprocess_env(), timeout=120)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr


def test_bench_sums_add_layers_per_format_mode_and_m():
    from resgen.cli import _bench_sums

    def row(m, us, bf16, fp8=None, tri=None, floor=1.0):
        r = {"problem": {"fmt": "mxfp4", "compensation": "full", "m": m}, "resgen_us": us,
             "bf16_us": bf16, "floor_us": floor}
        r.update({k: v for k, v in (("fp8_us", fp8), ("triton_us", tri)) if v})
        return r

    lines = _bench_sums([row(1, 2.0, 6.0, tri=10.0), row(1, 3.0, 9.0, tri=15.0),
                         row(16, 4.0, 8.0), row(16, None, 8.0)])
    assert lines[0] == ("sum mxfp4 full M=1 over 2 layers: 5.00 us; cuBLAS BF16 15.00 us "
                        "(x3.00); Triton MXFP4 25.00 us (x5.00); HBM floor 2.00 us (40%)")
    assert lines[1] == "sum mxfp4 full M=16: incomplete (2 layers)"


def test_time_layer_compiles_once_per_key_checks_then_times(monkeypatch, isolated_cache):
    """resgen bench's (and bench/probes/gpu_splitk_check.py's) per-variant step on the fake family:
    one compile per compile key across M, the whole-layer time of a correct variant, no time
    and the check's detail for a wrong one."""
    import dataclasses

    from resgen import cli
    from resgen.search import timing

    monkeypatch.setattr(timing, "measure", fakefam.fake_timer)
    fam, p = fakefam.FakeFamily(), fakefam.FakeProblem(m=4, k=4096)
    good = fakefam.FakeVariant(tile=8)
    bad = fakefam.FakeVariant(tile=8, split=True, pack=fakefam.Pack.B)   # injected wrong
    compiled: dict = {}
    fakefam.COMPILES.clear()
    r1 = cli.time_layer(fam, good, p, "sm_90a", compiled, timing.DEFAULT_POLICY)
    r2 = cli.time_layer(fam, good, dataclasses.replace(p, m=2), "sm_90a", compiled,
                        timing.DEFAULT_POLICY)
    assert len(fakefam.COMPILES) == 1
    assert r1["check"]["ok"] and r1["resgen_us"] == pytest.approx(fakefam.fake_us(good, p))
    assert r2["resgen_us"] == pytest.approx(fakefam.fake_us(good, dataclasses.replace(p, m=2)))
    r3 = cli.time_layer(fam, bad, p, "sm_90a", compiled, timing.DEFAULT_POLICY)
    assert not r3["check"]["ok"] and "resgen_us" not in r3
    assert "injected" in r3["check"]["detail"]


def test_tune_refuses_a_warm_start_table_it_cannot_use(tmp_path, capsys):
    """--warm-start names an earlier table: a missing, corrupt or tampered one is a clear
    error before anything is tuned (a typo must not silently lose the hint)."""
    bad = tmp_path / "bad.sqlite"
    bad.write_bytes(b"not a database at all")
    for path in (tmp_path / "absent.sqlite", bad):
        rc = main(TUNE + ["--db", str(tmp_path / "t.sqlite"), "--warm-start", str(path),
                          "--plan"])
        err = capsys.readouterr().err
        assert rc == 2 and "--warm-start" in err and str(path) in err
    good = tmp_path / "good.sqlite"
    fakefam.tune_fake(good, ms=[1], max_variants=2)
    assert main(TUNE + ["--db", str(tmp_path / "t.sqlite"), "--warm-start", str(good),
                        "--plan"]) == 0
    capsys.readouterr()
    with sqlite3.connect(good) as c:                     # tamper with a stored median
        c.execute("UPDATE results SET median_us = median_us / 2")
    rc = main(TUNE + ["--db", str(tmp_path / "t.sqlite"), "--warm-start", str(good), "--plan"])
    err = capsys.readouterr().err
    assert rc == 2 and "fails verification" in err
