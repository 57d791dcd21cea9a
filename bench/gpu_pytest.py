"""Run one GPU test file inside a benchmark process (so its compiles stay warm for the timing
that follows) and summarize the outcome for the benchmark's JSON report. Shared by
bench/gpu_attention_check.py and bench/gpu_prefill_check.py."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Sequence


class Collect:
    """pytest plugin: outcome and duration of every test phase that did not simply pass."""

    def __init__(self):
        self.rows: list[dict] = []

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or report.outcome != "passed":
            self.rows.append({"test": report.nodeid.split("::", 1)[-1][:200],
                              "when": report.when, "outcome": report.outcome,
                              "seconds": round(report.duration, 3),
                              "detail": str(report.longrepr)[-1500:] if report.failed else ""})


def run_test_file(test_file: Path, xml: Path, extra_args: Sequence[str] = ()) -> dict:
    """pytest -m gpu on test_file in this process, JUnit XML to xml; returns {"exit_code",
    "seconds", "passed", "failed", "skipped", "rows"} (rows: Collect's, one per test call
    and per phase that did not pass)."""
    import pytest

    col = Collect()
    t = time.time()
    code = pytest.main(["-q", "-m", "gpu", "-p", "no:cacheprovider", *extra_args,
                        f"--junitxml={xml}", str(test_file)], plugins=[col])
    rows = col.rows
    return {"exit_code": int(code), "seconds": time.time() - t,
            "passed": sum(r["outcome"] == "passed" for r in rows),
            "failed": sum(r["outcome"] == "failed" for r in rows),
            "skipped": sum(r["outcome"] == "skipped" for r in rows), "rows": rows}
