"""bench/ncu_limits.py on the CPU: the cases come from the shipped table, and the summary
splits a raw Nsight Compute CSV into cases at the marker launches (synthetic CSV)."""

from __future__ import annotations

import csv
import io
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import ncu_limits as N  # noqa: E402

METRIC_COLS = ["gpu__time_duration.sum",
               "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",
               "smsp__inst_executed.sum",
               "sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active",
               "sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active",
               "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio",
               "smsp__average_warps_issue_stalled_wait_per_issue_active.ratio"]


def fake_csv(kernels: list[tuple[str, list[str]]]) -> str:
    buf = io.StringIO()
    buf.write("==PROF== Connected to process 1\n")
    w = csv.writer(buf, quoting=csv.QUOTE_ALL)
    w.writerow(["ID", "Kernel Name"] + METRIC_COLS)
    w.writerow(["", "", "nsecond", "%", "inst", "%", "%", "", ""])     # the units row
    for i, (name, vals) in enumerate(kernels):
        w.writerow([str(i), name] + vals)
    return buf.getvalue()


def order(labels: list[str]) -> str:
    return "".join(f"{N.CASE_PREFIX}{lab}\tvariant_{i}\t{{}}\trel_err=1.000e-03\n"
                   for i, lab in enumerate(labels)) + "some other line\n"


def test_summary_splits_cases_at_markers_and_scales_metrics():
    marker = ("void at::cuda::spin_kernel(long)", ["1,000", "0", "10", "1", "1", "0", "0"])
    k1 = ("kernel_cutlass_linear_x", ["6,210", "51.5", "2,500,000", "30", "60", "4.5", "1.0"])
    q = ("kernel_cutlass_quant_y", ["1,500", "5", "100,000", "10", "20", "0.5", "2.5"])
    k2 = ("kernel_cutlass_linear_z", ["9,000", "70", "3,000,000", "40", "35", "6", "0.2"])
    text = fake_csv([marker, k1, marker, q, k2])
    recs = N.summarize(text, order(["a", "b"]))
    assert [r["label"] for r in recs] == ["a", "b"]
    assert [len(r["kernels"]) for r in recs] == [1, 2]
    a = recs[0]["kernels"][0]
    assert a["us"] == pytest.approx(6.21)
    assert a["instructions M"] == pytest.approx(2.5)
    assert a["DRAM %"] == pytest.approx(51.5)
    assert list(a["pipes %"]) == ["fma", "alu"]                    # busiest first
    assert list(a["stalls"]) == ["long_scoreboard", "wait"]
    assert recs[1]["kernels"][1]["us"] == pytest.approx(9.0)
    assert a["registers"] is None                                  # not in this CSV: no value
    md = N.markdown(recs)
    assert "| a | kernel_cutlass_linear_x |" in md and "fma 60.00" in md


def test_summary_rejects_a_csv_that_does_not_match_the_order_file():
    marker = ("spin_kernel", ["1"] * len(METRIC_COLS))
    k = ("kernel_cutlass_linear_x", ["1"] * len(METRIC_COLS))
    with pytest.raises(ValueError, match="marker windows"):
        N.summarize(fake_csv([marker, k]), order(["a", "b"]))
    with pytest.raises(ValueError, match="no kernel"):
        N.summarize(fake_csv([marker, marker, k]), order(["a", "b"]))
    with pytest.raises(ValueError, match="before the first marker"):
        N.summarize(fake_csv([k, marker, k]), order(["a"]))


def test_cases_are_the_shipped_tables_dispatched_variants():
    from resgen import runtime
    from resgen.search.family import get_family

    dev = runtime.Device("NVIDIA H200", "sm_90a")
    cs = list(N.cases(dev))
    labels = [c.label for c in cs]
    assert len(labels) == len(set(labels))
    disp = runtime.Dispatcher(paths=[N.DB], device=dev)
    for c in cs:
        assert get_family(type(c.variant).FAMILY) is c.family
        assert c.family.why_invalid(c.variant, c.problem, "sm_90a") is None
        if not c.label.endswith(("no residue", "with residue")):
            op = "linear" if c.label.startswith("linear") else "decode_attention"
            assert disp.lookup(op, c.problem).key() == c.variant.key()
            assert disp.source(op, c.problem) != "default"          # a table row, not a fallback
    # every shape / geometry point has its plain and compensated case
    for name in N.LINEAR_SHAPES:
        assert f"linear {name} M=1 plain" in labels
        assert f"linear {name} M=1 compensated" in labels
    assert sum(lab.startswith("attention") and lab.endswith(" plain") for lab in labels) == \
        len(N.ATTENTION_GEOMETRIES) * len(N.ATTENTION_BATCHES)


def test_kext_cases_are_the_dispatched_prefill_variants():
    from resgen import runtime

    dev = runtime.Device("NVIDIA H200", "sm_90a")
    cs = list(N.cases(dev, linear_ms=(1024,), attention=False, kext=("0.125", "1.0")))
    disp = runtime.Dispatcher(paths=[N.DB], device=dev)
    kx = [c for c in cs if "K-Ext" in c.label]
    assert len(kx) == 2 * len(N.LINEAR_SHAPES)
    for c in kx:
        assert c.problem.compensation in ("0.125", "1.0") and c.problem.m == 1024
        assert disp.lookup("linear", c.problem).key() == c.variant.key()
        assert c.family.why_invalid(c.variant, c.problem, "sm_90a") is None
    assert "linear down M=1024 K-Ext 1.0" in [c.label for c in cs]


def test_w4a16_cases_are_the_dispatched_w4a16_rows():
    from resgen import runtime

    dev = runtime.Device("NVIDIA H200", "sm_90a")
    cs = list(N.cases(dev, linear_ms=(64, 128), attention=False, w4a16=True))
    disp = runtime.Dispatcher(paths=[N.DB], device=dev)
    w4 = [c for c in cs if c.label.endswith("W4A16")]
    assert len(w4) == 2 * len(N.LINEAR_SHAPES)
    for c in w4:
        assert c.problem.compensation == "w4a16" and c.problem.m in (64, 128)
        assert disp.lookup("linear", c.problem).key() == c.variant.key()
        assert disp.source("linear", c.problem) != "default"      # a shipped W4A16 row
        assert c.family.why_invalid(c.variant, c.problem, "sm_90a") is None
    assert "linear gate_up M=128 W4A16" in [c.label for c in cs]
