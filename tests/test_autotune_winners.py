"""`with resgen.autotune():` records the problems resgen's custom ops look up and tunes them
(compile-only without a GPU: the real sm_90a compiles) into the named database; `resgen db
export --winners` writes only the winning row per workload and GPU, which re-imports
(`resgen db merge`) and serves the same variants through resgen.runtime."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fakefam  # noqa: E402
import standins as S  # noqa: E402
from fakefam import isolated_cache, make_env  # noqa: E402,F401
from test_linear_sm90_wgmma import _qweight  # noqa: E402

import resgen  # noqa: E402
from resgen.cli import main  # noqa: E402
from resgen.db import TuningDB  # noqa: E402
from resgen.ops import custom  # noqa: E402
from resgen.ops.nn import FP4Linear  # noqa: E402
from resgen.search.variant import AttentionProblem, LinearProblem  # noqa: E402

pytestmark = pytest.mark.usefixtures("isolated_cache")
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU (compile-only) behaviour")


def test_recording_sees_the_ops_calls_only_inside_the_block():
    mod = FP4Linear(_qweight("nvfp4"), "full", **S.linear_kwargs())
    attn = S.attention(8, 2, 64, 16)
    h = custom.register(attn)
    from resgen.kvcache import PagedKVCache

    g = torch.Generator().manual_seed(0)
    cache, bt, sl = PagedKVCache.from_dense([torch.randn(2, 40, 64, generator=g)],
                                            [torch.randn(2, 40, 64, generator=g)], 16)
    q = torch.randn(1, 8, 64, generator=g).bfloat16()
    mod(torch.randn(7, 512))                               # before: not recorded
    with resgen.autotune(tune=False) as rec:
        mod(torch.randn(3, 512))
        mod(torch.randn(2, 4, 512))                        # 8 rows
        mod(torch.randn(3, 512))                           # seen again: once
        torch.ops.resgen.decode_attention(q, *custom.cache_args(cache), bt, sl, 40, None, h)
    mod(torch.randn(5, 512))                               # after: not recorded
    lin = rec.problems["linear"]
    assert [p.m for p in lin] == [3, 8]
    assert lin[0] == LinearProblem("nvfp4", "full", 3, 128, 512, True)
    assert rec.problems["decode_attention"] == [AttentionProblem(1, 8, 2, 64, 64, 16, True,
                                                                 "f16")]
    assert rec.count() == 3


@no_gpu
def test_autotune_compiles_the_recorded_shapes_into_the_database(tmp_path):
    db = tmp_path / "mine.sqlite"
    mod = FP4Linear(_qweight("mxfp4"), "none", **S.linear_kwargs())
    with resgen.autotune(db=db, max_variants=2, workers=1) as rec:
        mod(torch.randn(3, 512))
    assert rec.db == db and rec.summary
    with TuningDB(db, readonly=True) as d:
        rows = d.rows()
    assert rows and {r["status"] for r in rows} <= {"compiled", "compile_failed"}
    assert any(r["status"] == "compiled" for r in rows)
    assert all(r["compile_only"] == 1 for r in rows)
    keys = {r["workload_key"] for r in rows}
    assert keys == {LinearProblem("mxfp4", "none", 3, 128, 512, True).key()}
    assert {r["family"] for r in rows} == {"linear_sm90_mma", "linear_sm90_wgmma"}


def test_winners_export_reimports_and_serves_the_same_variants(tmp_path, capsys):
    from resgen.runtime import Device, Dispatcher

    full = tmp_path / "full.sqlite"
    fakefam.tune_fake(full, ms=[1, 16], max_variants=6)
    fakefam.tune_fake(full, ms=[4], max_variants=4, env=make_env("Fake GPU 2"))
    win = tmp_path / "winners.sqlite"
    assert main(["db", "export", str(full), "--winners", "--out", str(win)]) == 0
    assert "'winners': 3" in capsys.readouterr().out
    with TuningDB(full, readonly=True) as a, TuningDB(win, readonly=True) as w:
        assert len(w) == 3 < len(a)
        assert w.verify().ok
        assert w.winner_ids() == {r["id"] for r in w.rows()}
        # every winner is the row the full database's winner rule picks
        want = {(r["workload_key"], r["gpu_name"], r["variant_key"])
                for r in a.rows() if r["id"] in a.winner_ids()}
        got = {(r["workload_key"], r["gpu_name"], r["variant_key"]) for r in w.rows()}
        assert got == want
    mine = tmp_path / "mine.sqlite"
    assert main(["db", "merge", str(win), "--into", str(mine)]) == 0
    assert "'added': 3" in capsys.readouterr().out
    # the runtime serves the same variant from the full table and from the shared winners
    prob = fakefam.FakeProblem(m=16, n=256, k=4096)
    dev = Device(make_env().gpu_name, make_env().arch)
    a = Dispatcher(paths=[full], device=dev).lookup("fake_gemm", prob)
    b = Dispatcher(paths=[mine], device=dev).lookup("fake_gemm", prob)
    assert a == b
    assert main(["db", "export", str(full), "--winners", "--out", str(win)]) == 2
    assert "exists" in capsys.readouterr().err
