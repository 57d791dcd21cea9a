"""The run plan of `resgen tune`: cost model, measured costs, per-family estimates."""

from __future__ import annotations

import json

import pytest

import fakefam
from fakefam import FakeFamily, FakeProblem, isolated_cache  # noqa: F401
from resgen.search.timing import DEFAULT_POLICY, TUNE_POLICY
from resgen.search.tuneplan import CostModel, measured_costs, plan_run, table
from resgen.search.tuner import TuneConfig

pytestmark = pytest.mark.usefixtures("isolated_cache")
FAM = fakefam.FAMILY


def _problems(ns=(256, 512), ms=(1, 4, 16)):
    return [FakeProblem(m=m, n=n, k=4096) for n in ns for m in ms]


def test_cost_model_follows_the_policy():
    c = CostModel()
    assert 0 < c.time_s(TUNE_POLICY) < c.time_s(DEFAULT_POLICY)
    slower = CostModel(kernel_us=100.0)
    assert slower.time_s(TUNE_POLICY) > c.time_s(TUNE_POLICY)


def test_measured_costs_are_medians_per_family():
    rows = [{"family": "a", "phase_s": json.dumps({"time": t, "check": 0.01})}
            for t in (0.01, 0.03, 0.02)]
    rows += [{"family": "b", "phase_s": None}, {"family": "b", "phase_s": "not json"},
             {"family": "c", "phase_s": {"prep": 0.5}}]
    m = measured_costs(rows)
    assert m["a"] == {"time": 0.02, "check": 0.01, "rows": 3.0}
    assert "b" not in m and m["c"]["prep"] == 0.5


def test_plan_counts_workloads_classes_and_gpu_seconds(monkeypatch):
    probs = _problems()
    cfg = TuneConfig(max_variants=4, time_budget_s=100.0, coverage=True)
    plan = plan_run({FAM.NAME: probs}, {FAM.NAME: {"m1": 6, "m2": 6}}, {FAM.NAME: FAM},
                    cfg, workers=7)
    (f,) = plan.families
    assert f.workloads == plan.workloads == 6 and f.classes == 2   # M is a run-time argument
    assert f.source == "model" and f.compiles() == (2 * 4, 6 * 4)
    per = f.gpu_s_per_variant
    assert plan.gpu_s(1) == pytest.approx(6 * per) and plan.gpu_s(4) == pytest.approx(24 * per)
    assert plan.variants_in_budget() == pytest.approx(100.0 / (6 * per))
    assert plan.stages == ("cover", "refine")
    text = plan.text()
    assert "PLAN: 6 tuning jobs (family x workload) over 6 unique workloads" in text
    assert "m1:6 m2:6" in text and plan.unique_workloads == 6
    d = plan.as_dict()
    assert d["workloads"] == 6 and d["families"][0]["compiles"] == (8, 24)
    # A prepare hook moves the prep cost from every variant to every workload.
    monkeypatch.setattr(FakeFamily, "prepare", fakefam.fake_prepare, raising=False)
    plan2 = plan_run({FAM.NAME: probs}, {}, {FAM.NAME: FAM}, cfg, workers=7)
    (g,) = plan2.families
    assert "prepare" in g.hooks
    assert g.gpu_s_per_variant == pytest.approx(per - f.prep_s)
    assert plan2.gpu_s(4) == pytest.approx(6 * (f.prep_s + 4 * g.gpu_s_per_variant))
    # Measured phase seconds replace the model's constants; a budget too small says so.
    monkeypatch.delattr(FakeFamily, "prepare")
    meas = {FAM.NAME: {"prep": 1.0, "check": 2.0, "time": 3.0, "rows": 9.0}}
    plan3 = plan_run({FAM.NAME: probs}, {}, {FAM.NAME: FAM},
                     TuneConfig(max_variants=4, time_budget_s=10.0), workers=1, measured=meas)
    (h,) = plan3.families
    assert h.source == "measured (9 rows)" and h.gpu_s_per_variant == 6.0
    assert plan3.notes and "may not cover every workload" in plan3.notes[0]


def test_table_layout():
    t = table(["a", "long header"], [[1, None], ["xyz", 2.5]])
    lines = t.splitlines()
    assert lines[0] == "a    long header" and set(lines[1]) == {"-", " "}
    assert lines[2].rstrip() == "1" and lines[3] == "xyz  2.5"
