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


def test_runtime_on_a_b200_serves_attention_sm100_rows(tmp_path):
    """The runtime on an sm_100 device (a faked device record: no Blackwell here) looks up
    decode_attention in sm_100a rows: the faster attention_sm100 row wins, another compile key
    falls back to attention_sm100's default, and an sm_90a device never serves them."""
    import dataclasses

    from resgen.runtime import Device, Dispatcher
    from resgen.search import attention_sm100 as A
    from resgen.search.build import variant_fingerprint
    from resgen.search.record import Environment, ResultRecord, arch_of_capability

    assert arch_of_capability(10, 0) == "sm_100a"
    env = Environment(gpu_name="NVIDIA B200", arch="sm_100a", compute_capability="10.0",
                      sm_count=148, driver="x", cuda="x", torch="x", cute_dsl="x", resgen="x",
                      compile_only=False)
    p = A.COVER_PROBLEMS[0]
    sp = A.FAMILY.space(p, "sm_100a")
    win = next(v for v in sp if v != A.FAMILY.default(p, "sm_100a"))
    path = tmp_path / "b200.sqlite"
    with TuningDB(path) as db:
        for v, us in ((win, 5.0), (sp[0] if sp[0] != win else sp[1], 6.0)):
            db.record(ResultRecord(problem=p, variant=v, environment=env,
                                   fingerprint=variant_fingerprint(A.FAMILY, v, p, "sm_100a"),
                                   status=Status.OK, median_us=us, samples_us=[us],
                                   space_index=sp.index(v), policy={"tie_rel": 0.01}))
    d = Dispatcher(paths=[path], device=Device("NVIDIA B200", "sm_100a"))
    assert d.lookup("decode_attention", p) == win
    assert "b200.sqlite" in d.source("decode_attention", p)
    miss = dataclasses.replace(p, head_dim=256, page_size=256)
    assert d.lookup("decode_attention", miss) == A.FAMILY.default(miss, "sm_100a")
    assert d.source("decode_attention", miss) == "default"
    hopper = Dispatcher(paths=[path], device=Device("NVIDIA H200", "sm_90a"))
    assert hopper.lookup("decode_attention", p).FAMILY != "attention_sm100"
