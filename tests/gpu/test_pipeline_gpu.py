"""GPU: the pipeline end to end on real families (tuner -> database -> runtime)."""

from __future__ import annotations

import functools

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu


@pytest.fixture()
def gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


def _tune(tmp_path, family_op, problems, workers=1, max_variants=3,
          family="linear_sm90_mma"):
    """Tune `problems` with the named family (not "the first family of the op": the
    registry's order follows module names, and linear_sm90_fp8 sorts first)."""
    from resgen.search.device import gpu_lock_path
    from resgen.db import TuningDB
    from resgen.search.family import families_for
    from resgen.search.record import current_environment
    from resgen.search.orchestrate import Job, run_jobs
    from resgen.search.tuner import TuneConfig

    env = current_environment()
    fams = families_for(family_op, env.arch)
    if not fams:
        pytest.skip(f"no {family_op} family for {env.arch}")
    cfg = TuneConfig(arch=env.arch, max_variants=max_variants, time_budget_s=240,
                     gpu_lock=gpu_lock_path())
    db = tmp_path / "t.sqlite"
    if family not in {f.NAME for f in fams}:
        pytest.skip(f"no {family} family for {env.arch}")
    sums = run_jobs([Job(family, p.key()) for p in problems],
                    functools.partial(TuningDB, db), env, cfg, workers=workers)
    return db, sums


def test_tune_store_and_serve_linear(gpu, tmp_path):
    from resgen.db import TuningDB
    from resgen.runtime import Dispatcher
    from resgen.search.record import Status
    from resgen.search.variant import LinearProblem

    ps = [LinearProblem(fmt="nvfp4", compensation="none", m=1, n=4096, k=4096),
          LinearProblem(fmt="mxfp4", compensation="full", m=16, n=4096, k=4096)]
    db, sums = _tune(tmp_path, "linear", ps, workers=2)
    assert len(sums) == 2 and all(s.timed >= 1 and s.winner for s in sums), sums
    with TuningDB(db, readonly=True) as d:
        assert d.verify().ok
        ok = d.rows(status=Status.OK)
    assert ok and all(r["timing_mode"] == "graph" and r["median_us"] > 0.5 for r in ok)
    assert all(r["rel_err"] is not None and r["rel_err"] <= 3e-3 for r in ok)
    disp = Dispatcher(paths=[db])
    by_key = {s.problem_key: s for s in sums}          # summaries come in completion order
    for p in ps:
        s = by_key[p.key()]
        assert disp.lookup("linear", p).name() == s.winner
        assert disp.source("linear", p) != "default"
    # A real M between buckets is served a variant valid for it.
    from resgen.search.family import get_family

    p5 = LinearProblem(fmt="mxfp4", compensation="full", m=5, n=4096, k=4096)
    v = disp.lookup("linear", p5)
    assert get_family(type(v).FAMILY).why_invalid(v, p5, disp.arch) is None
