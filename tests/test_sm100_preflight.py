"""`resgen tune --arch sm_100a --compile-only`: the real Blackwell pre-flight on a CPU machine
(both sm_100a families render, fingerprint and compile for their workloads; rows are stored
under a compile-only sm_100a environment the runtime never serves); no Hopper family is
offered for sm_100a and no Blackwell family for sm_90a."""

from __future__ import annotations

import json

from fakefam import isolated_cache  # noqa: F401
import pytest

from resgen.cli import main
from resgen.db import TuningDB
from resgen.search.family import families
from resgen.search.record import Status

pytestmark = pytest.mark.usefixtures("isolated_cache")


def test_families_by_arch():
    on = {a: {f.NAME for f in families().values() if a in f.ARCHS and f.NAME != "fake_gemm"}
          for a in ("sm_90a", "sm_100a")}      # fake_gemm: the tests' own family
    assert on["sm_100a"] == {"linear_sm100_tc", "quant_sm100", "attention_sm100"}
    assert not on["sm_100a"] & on["sm_90a"]


def test_tune_compile_only_for_sm100a(tmp_path, capsys):
    db = tmp_path / "b200.sqlite"
    rc = main(["tune", "--model", "qwen3-8b", "--arch", "sm_100a", "--compile-only",
               "--formats", "nvfp4", "--compensations", "full", "--m-buckets", "1",
               "--max-variants", "1", "--jobs", "1", "--db", str(db),
               "--families", "linear_sm100_tc,quant_sm100",
               "--json", str(tmp_path / "s.json")])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "arch sm_100a" in err and "COMPILE-ONLY PRE-FLIGHT" in out
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["arch"] == "sm_100a" and summary["environment"]["compile_only"]
    fams = {w["family"] for w in summary["workloads"]}
    assert fams == {"linear_sm100_tc", "quant_sm100"}
    with TuningDB(db, readonly=True) as d:
        rows = d.rows()
    assert rows and {r["arch"] for r in rows} == {"sm_100a"}
    assert {r["status"] for r in rows} == {Status.COMPILED}
    assert all(r["spill_bytes"] == 0 for r in rows)
    assert {json.loads(r["workload_key"])["n"] for r in rows
            if r["family"] == "linear_sm100_tc"} == {6144, 4096, 24576}
