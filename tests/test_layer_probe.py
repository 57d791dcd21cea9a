"""CPU test of bench/probes/layer_probe.py (the driver of bench/probes/bulk_probe.py,
bench/probes/ragged_probe.py and bench/probes/prologue_probe.py) with a fake timer: every case
is recorded once, invalid variants say why, failures keep their error, and the JSON is rewritten
after each case."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path[:0] = [str(BENCH), str(BENCH / "probes")]

import layer_probe  # noqa: E402
import prologue_probe  # noqa: E402
import ragged_probe  # noqa: E402
from resgen.search.linear_sm90_mma import FAMILY, LinearSm90Variant, Pipeline  # noqa: E402
from resgen.search.variant import LinearProblem  # noqa: E402


def _fake_gpu(monkeypatch, tmp_path, fake_time_layer) -> None:
    """layer_probe on the CPU: `fake_time_layer` for resgen.cli.time_layer, a named fake
    GPU, and $OUT in tmp_path."""
    monkeypatch.setattr(layer_probe, "time_layer", fake_time_layer)
    monkeypatch.setattr(layer_probe.torch.cuda, "get_device_name", lambda i: "Fake GPU")
    monkeypatch.setenv("OUT", str(tmp_path))


def test_probe_records_every_case(tmp_path, monkeypatch):
    calls = []

    def fake_time_layer(fam, v, p, arch, cache, policy):
        calls.append(v.name())
        if v.warps_k == 4:
            raise RuntimeError("compile failed")
        return {"check": {"ok": True, "rel_err": 1e-3}, "resgen_us": 5.0}

    _fake_gpu(monkeypatch, tmp_path, fake_time_layer)
    p = LinearProblem("nvfp4", "none", 1, 2560, 9728)
    ok = LinearSm90Variant(1, 8, 1, 1, 1, Pipeline.CP_ASYNC, 3)
    bad = LinearSm90Variant(1, 8, 1, 1, 2, Pipeline.CP_ASYNC, 3)      # ragged needs U = 1
    err = LinearSm90Variant(1, 4, 1, 1, 1, Pipeline.CP_ASYNC, 3)
    assert layer_probe.probe("t", [(p, FAMILY, v, {"x": i}) for i, v in
                                   enumerate((ok, bad, err))]) == 0
    rows = json.loads((tmp_path / "t.json").read_text())["rows"]
    assert [r["x"] for r in rows] == [0, 1, 2] and len(calls) == 2
    assert rows[0]["us"] == 5.0 and rows[0]["ok"]
    assert "ragged" in rows[1]["invalid"]
    assert rows[2]["error"] == "RuntimeError: compile failed"


def test_ragged_probe_cases_are_valid_and_mostly_ragged():
    cases = list(ragged_probe.cases())
    assert all(fam.why_invalid(v, p, layer_probe.ARCH) is None for p, fam, v, _ in cases)
    assert sum(extra["ragged"] for *_, extra in cases) == 24


def test_prologue_probe_pairs_each_source_with_and_without_the_l2_prefetch():
    """Every (M, compensation, shape, source) is probed twice: without an L2 prefetch and with
    the warp's whole K slice (l2_prefetch = its iterations, deeper than the 3-stage ring);
    only down's fused M-Ext tile at M = 4 (8 operand rows x 12288 columns) does not fit."""
    cases = list(prologue_probe.cases())
    assert len(cases) == 2 * 2 * 2 * len(prologue_probe.SOURCES) * 2
    invalid = [(p, ex) for p, fam, v, ex in cases if fam.why_invalid(v, p, layer_probe.ARCH)]
    assert {(p.m, p.compensation, p.k, ex["source"].startswith("fused"))
            for p, ex in invalid} == {(4, "full", 12288, True)}
    for _p, _fam, v, ex in cases:
        assert (v.l2_prefetch > v.stages) == ex["l2_all"]


def test_stack_probe_pairs_every_resattn_layout_with_its_stack_twin():
    import stack_probe

    from resgen.search.family import get_family

    fam = get_family("attention_sm90")
    cases = list(stack_probe.cases())
    by_tag: dict[str, list] = {}
    for tag, v, p in cases:
        by_tag.setdefault(tag, []).append((v, p))
    for tag, vs in by_tag.items():
        if " ResAttn pair" in tag:
            twins = by_tag[tag.replace("ResAttn pair", "ResAttn stack")]
            assert [dataclasses.replace(v, packing=twins[0][0].packing) for v, _ in vs] == \
                [v for v, _ in twins]
            assert all(p.compensation for _, p in vs + twins)
    # most layouts are valid (d256's prefetching twins exceed the register estimate)
    valid = [c for c in cases if fam.why_invalid(c[1], c[2], "sm_90a") is None]
    assert len(valid) >= 0.9 * len(cases)


def test_deep_ring_probe_cases_are_valid_and_reach_past_the_space():
    """Every case is a valid variant, and each shape probes rings deeper than the tuned space
    holds (bulk 2 / 4 slots, cp.async 3 / 4)."""
    import deep_ring_probe as D

    for (n, k), vs in D.CASES.items():
        for comp in ("none", "full"):
            p = LinearProblem("nvfp4", comp, 1, n, k)
            assert all(FAMILY.why_invalid(v, p, layer_probe.ARCH) is None for v in vs)
            space = set(FAMILY.space(p, layer_probe.ARCH))
            assert any(v.stages >= 6 and v not in space for v in vs)


def test_w4a16_fused_probe_plans_checks_and_reports(tmp_path, monkeypatch):
    """bench/probes/w4a16_fused_probe.py on the CPU: per (M, shape) the plain table winner,
    the W4A16 xop path and up to three fused W4A16 candidates (each valid for W4A16, the
    plain winner's own variant first where it is fused), M = 1 first, the budget stops new
    cases, and the summary / table come from checked, timed rows only (a failed check is never
    the best)."""
    import w4a16_fused_probe as W

    from resgen.runtime import Device, Dispatcher

    disp = Dispatcher(device=Device("NVIDIA H200", "sm_90a"))      # the shipped table

    def lookup(p):
        return disp.lookup("linear", p), disp.source("linear", p)

    cases = list(W.plan(lookup, W.xop_winners()))
    assert [c[3]["m"] for c in cases][:3] == [1, 1, 1]
    for m in W.MS:
        for n, k in W.SHAPES:
            sel = [c for c in cases if c[3]["m"] == m and c[0].n == n and c[0].k == k]
            roles = [c[3]["role"] for c in sel]
            assert roles[:2] == ["plain", "w4a16_xop"] and 1 <= roles.count("w4a16_fused") <= 3
            plain, xop, fused = sel[0], sel[1], sel[2:]
            assert plain[0].compensation == "none" and xop[0].compensation == "w4a16"
            assert not getattr(xop[2], "fused", False)
            assert all(c[2].fused and c[1].why_invalid(c[2], c[0], "sm_90a") is None
                       and c[0].w4a16 for c in fused)
            assert len({c[2] for c in fused}) == len(fused)
            if getattr(plain[2], "fused", False) and m == 1:
                assert fused[0][3]["config"] == "twin" and fused[0][2] == plain[2]
    ticks = iter(range(100))
    # t0 = 0; the cases asked for at 1 and 2 start, the one at 3 does not
    assert len(list(layer_probe.budgeted(iter(cases), 2.5, clock=lambda: next(ticks)))) == 2

    def fake_time_layer(fam, v, p, arch, cache, policy):
        fz = getattr(v, "fused", False)              # (wgmma variants have no act axis)
        us = {"none": 6.0, "w4a16": 8.0}[p.compensation] - (3.0 if fz and p.w4a16 else 0)
        ok = not (fz and p.w4a16 and v.cluster == 2)           # a failing check: not timed
        return {"check": {"ok": ok, "rel_err": 1e-3 if ok else 0.5},
                **({"resgen_us": us + 0.01 * getattr(v, "warps_k", 1)} if ok else {})}

    _fake_gpu(monkeypatch, tmp_path, fake_time_layer)
    monkeypatch.setattr(W, "plan", lambda lookup, winners: iter(cases))
    monkeypatch.setattr(W, "xop_winners", lambda: {})
    assert W.main(["--budget-s", "1000"]) == 0
    doc = json.loads((tmp_path / "w4a16_fused_probe.json").read_text())
    assert len(doc["rows"]) == len(cases)
    s = doc["summary"]
    assert len(s["layers"]) == len(W.MS) * len(W.SHAPES) and len(s["sums"]) == len(W.MS)
    for r in s["layers"]:
        assert r["w4a16_fused_us"] < r["plain_us"] < r["w4a16_xop_us"]
        assert "_cl2" not in r["fused_variant"]
    assert all(abs(t["plain_us"] - sum(r["plain_us"] for r in s["layers"] if r["m"] == t["m"]))
               < 1e-9 for t in s["sums"])
    assert W.table(s)[-1].startswith("M=8: sums plain")


def test_fused_serving_probe_plans_checks_and_reports(tmp_path, monkeypatch):
    """bench/probes/fused_serving_probe.py on the CPU: per (model, M, shape) the dispatched
    table variant first, then linear_sm90_mma candidates (each valid, none twice; the M = 4 / 1
    fused winner widened to the rows' token tile and to half of it, its xop twins, then the
    prior's first fused variants), Qwen3-8B M = 16 first; the summary and table come from
    checked, timed rows only (a failed check is never the best)."""
    import fused_serving_probe as F

    from resgen.runtime import Device, Dispatcher

    disp = Dispatcher(device=Device("NVIDIA H200", "sm_90a"))      # the shipped table

    def lookup(p):
        return disp.lookup("linear", p), disp.source("linear", p)

    winners = F.fused_winners()
    assert winners and all(v.fused for v in winners.values())
    cases = list(F.plan(lookup, winners))
    assert (cases[0][3]["model"], cases[0][3]["m"]) == ("qwen3-8b", 16)
    keys = list(dict.fromkeys((c[3]["model"], c[3]["m"], c[3]["layer"]) for c in cases))
    assert len(keys) == len(F.MODELS) * len(F.MS) * 4
    for key in keys:
        sel = [c for c in cases if (c[3]["model"], c[3]["m"], c[3]["layer"]) == key]
        assert sel[0][3]["config"] == "table" and len(sel) >= 2
        p = sel[0][0]
        assert all(c[0] == p and c[0].compensation == "none" for c in sel)
        cands = sel[1:]
        assert all(c[1].why_invalid(c[2], p, "sm_90a") is None for c in cands)
        assert len({c[2] for c in cands}) == len(cands)
        assert all(c[2].fused == (c[3]["config"] != "m4xop") for c in cands)
        fused = cands
        assert sum(c[3]["config"].startswith("prior") for c in fused) <= F.N_PRIOR
        for c in fused:
            if c[3]["config"] in ("m4twin", "m1twin"):
                small = 4 if c[3]["config"] == "m4twin" else 1
                w = winners[LinearProblem("nvfp4", "none", small, p.n, p.k).key()]
                assert c[2].n_tiles in (F.n8_tiles(p.rows), max(1, F.n8_tiles(p.rows) // 2))
                assert dataclasses.replace(c[2], n_tiles=w.n_tiles) == w
            if c[3]["config"] == "m4xop":
                assert c[2].cluster == 1 and c[2].n_tiles <= F.n8_tiles(p.rows)
    assert [F.n8_tiles(r) for r in (1, 8, 9, 16, 32, 64, 128)] == [1, 1, 2, 2, 4, 8, 8]

    def fake_time_layer(fam, v, p, arch, cache, policy):
        fz = getattr(v, "fused", False)
        ok = not (fz and v.cluster == 1)                         # a failing check: not timed
        xop = getattr(v, "act", None) is not None and not fz and v.cluster == 1 and \
            v.pdl and v.warps_m > 1                    # some xop twins: faster than the table
        us = 9.0 if fz else (5.0 if xop else 6.0)
        return {"check": {"ok": ok, "rel_err": 1e-3 if ok else 0.5},
                **({"resgen_us": us + 0.01 * getattr(v, "warps_k", 1)} if ok else {})}

    _fake_gpu(monkeypatch, tmp_path, fake_time_layer)
    monkeypatch.setattr(F, "plan", lambda lookup, winners: iter(cases))
    monkeypatch.setattr(F, "fused_winners", lambda: {})
    assert F.main(["--budget-s", "1000"]) == 0
    doc = json.loads((tmp_path / "fused_serving_probe.json").read_text())
    assert len(doc["rows"]) == len(cases)
    s = doc["summary"]
    assert len(s["layers"]) == len(keys)
    for r in s["layers"]:
        if r["fused_us"] is not None:
            assert r["fused_us"] > r["table_us"] and "_cl1" not in r["fused_variant"]
            assert abs(r["fused_over_table"] - r["fused_us"] / r["table_us"]) < 1e-12
        if r["xop_us"] is not None:
            assert "_actxop_" in r["xop_variant"]
    for t in s["sums"]:
        sel = [r for r in s["layers"] if (r["model"], r["m"]) == (t["model"], t["m"])]
        assert abs(t["table_us"] - sum(r["table_us"] for r in sel)) < 1e-9
        best = sum(min(u for u in (r["table_us"], r["fused_us"], r["xop_us"]) if u)
                   for r in sel)
        assert abs(t["best_us"] - best) < 1e-9 and t["best_us"] <= t["table_us"]
    assert "sums table" in F.table(s)[-1]


def test_producer_probe_plans_checks_and_reports(tmp_path, monkeypatch):
    """bench/probes/producer_probe.py on the CPU: per (M, shape) the dispatched table variant,
    then producer-warp linear_sm90_wgmma candidates only (valid, none twice); the summary
    compares only against the table's own row for the M ("table_exact"), never against a
    fallback to a smaller bucket."""
    import producer_probe as PP

    from resgen.runtime import Device, Dispatcher
    from resgen.search.linear_sm90_wgmma import FAMILY as WG, Producer

    disp = Dispatcher(device=Device("NVIDIA H200", "sm_90a"))      # the shipped table

    def lookup(p):
        return disp.lookup("linear", p), disp.source("linear", p)

    cases = list(PP.plan(lookup))
    keys = list(dict.fromkeys((c[3]["m"], c[3]["layer"]) for c in cases))
    assert len(keys) == len(PP.MS) * 4
    for key in keys:
        sel = [c for c in cases if (c[3]["m"], c[3]["layer"]) == key]
        assert sel[0][3]["config"] == "table" and sel[0][3]["table_exact"]
        cands = sel[1:]
        assert cands and len({c[2] for c in cands}) == len(cands)
        assert all(c[1] is WG and c[2].producer == Producer.WARP and c[2].consumers == 1
                   and WG.why_invalid(c[2], c[0], "sm_90a") is None for c in cands)

    def fake_time_layer(fam, v, p, arch, cache, policy):
        pw = getattr(v, "producer", None) == Producer.WARP
        return {"check": {"ok": True, "rel_err": 1e-3},
                "resgen_us": (4.0 if pw else 5.0) + 0.01 * getattr(v, "stages", 1)}

    # one layer's table row falls back (a stale fingerprint): no ratio for it
    fell = keys[0]
    staled = [(p, f, v, {**e, "table_exact": False} if (e["m"], e["layer"]) == fell
               and e["config"] == "table" else e) for p, f, v, e in cases]
    _fake_gpu(monkeypatch, tmp_path, fake_time_layer)
    monkeypatch.setattr(PP, "plan", lambda lookup: iter(staled))
    assert PP.main(["--budget-s", "1000"]) == 0
    s = json.loads((tmp_path / "producer_probe.json").read_text())["summary"]
    by = {(r["m"], r["layer"]): r for r in s["layers"]}
    assert by[fell]["table_us"] is None and "pw_over_table" not in by[fell]
    assert all(r["pw_over_table"] < 1 for k, r in by.items() if k != fell)
    assert [t["m"] for t in s["sums"]] == [m for m in PP.MS if m != fell[0]]
    assert "per-layer best" in PP.table(s)[-1]


def test_ncu_sass_ledger_splits_launches_and_prices_phases(tmp_path):
    """bench/probes/ncu_sass_wgmma.py's summary of a source-page export: one CSV block per
    launch after its "Kernel Name" line, the second launch of each variant in the order file,
    samples per phase (a branch right after a try_wait is the wait), stall reasons."""
    import ncu_sass_wgmma as S

    hdr = ('"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed",'
           '"stall_long_sb","stall_math","stall_long_sb (Not Issued)"')

    def block(scale):
        rows = [("SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R1], R2", 1, 0, 0),
                ("@P0   BRA 0x10", 3, 3, 0), ("LOP3.LUT R3, R4, 0xf, RZ, 0xc0, !PT", 4, 0, 2),
                ("HMUL2.BF16_V2 R5, R5, R6", 1, 0, 1),
                ("HGMMA.64x64x16.F32.BF16 R24, R72, gdesc[UR4], R24", 1, 0, 0)]
        return ['"Kernel Name","kernel_x"', hdr] + [
            f'"0x{i:x}","      {src}","{n * scale}","10","{lsb * scale}","{math}","0"'
            for i, (src, n, lsb, math) in enumerate(rows)]
    csv_text = "\n".join(block(1) + block(10))
    (tmp_path / "s.csv").write_text(csv_text + "\n")
    (tmp_path / "o.txt").write_text("==PROF== Connected\n6144x4096 M=64 v1\n==PROF== x\n")
    doc = S.summarize(str(tmp_path / "s.csv"), str(tmp_path / "o.txt"))
    assert doc.startswith("## 6144x4096 M=64 v1") and "100 warp samples" in doc
    share = S.phases(S.split_kernels(csv_text)[1])
    assert abs(share["mbarrier wait (try_wait spin)"] - 0.4) < 1e-9
    assert abs(share["integer ALU (decode, addresses)"] - 0.4) < 1e-9
    assert abs(share["wgmma issue / wait"] - 0.1) < 1e-9
    assert "long_sb 30" in doc and "Not Issued" not in doc
    (tmp_path / "o2.txt").write_text("a\nb\n")
    with pytest.raises(SystemExit, match="want 2 each"):
        S.summarize(str(tmp_path / "s.csv"), str(tmp_path / "o2.txt"))
