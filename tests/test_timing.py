"""Measurement policy and statistics (CPU); the CUDA-graph timer itself is checked on the GPU."""

from __future__ import annotations

import json
import random
import statistics

import numpy as np
import pytest

from resgen.search.timing import (DEFAULT_POLICY, TUNE_POLICY, MeasurementPolicy, measure,
                                  policy_named, quantile, summarize)


def test_policy_serialization_round_trip():
    p = MeasurementPolicy(repetitions=9, quantiles=(0.25, 0.5, 0.75), tie_rel=0.02)
    d = json.loads(json.dumps(p.as_dict()))
    assert MeasurementPolicy.from_dict(d) == p
    assert p.label.startswith("cold-l2-graph@v1:")
    assert p.label != DEFAULT_POLICY.label                 # the label tracks every field
    with pytest.raises(ValueError):
        MeasurementPolicy.from_dict({**d, "surprise": 1})
    with pytest.raises(ValueError):
        MeasurementPolicy.from_dict({k: v for k, v in d.items() if k != "name"})


def test_tune_policy_is_named_cheaper_and_still_cold():
    assert TUNE_POLICY.name != DEFAULT_POLICY.name and TUNE_POLICY.label != DEFAULT_POLICY.label
    assert policy_named("tune") is TUNE_POLICY and policy_named("bench") is DEFAULT_POLICY
    assert policy_named("cold-l2-graph-tune") is TUNE_POLICY
    with pytest.raises(ValueError, match="unknown measurement policy"):
        policy_named("fast")
    assert TUNE_POLICY.repetitions >= 5 and TUNE_POLICY.quantiles == DEFAULT_POLICY.quantiles
    # Same cold-L2 rule (input sets past 2 x L2) ...
    for ws in (1 << 16, 10 << 20, 56 << 20, 200 << 20):
        assert TUNE_POLICY.sets_for(ws) == DEFAULT_POLICY.sets_for(ws)
    # ... and fewer launches per graph, always a multiple of the sets.
    for est_us in (1.0, 5.0, 20.0, 100.0):
        for n in (1, 3, 13, 64):
            t, d = TUNE_POLICY.launches_for(est_us, n), DEFAULT_POLICY.launches_for(est_us, n)
            assert t % n == 0 and t <= d
            assert t >= min(TUNE_POLICY.min_launches, d)
    assert MeasurementPolicy.from_dict(TUNE_POLICY.as_dict()) == TUNE_POLICY


@pytest.mark.parametrize("bad", [dict(repetitions=0), dict(min_launches=0),
                                 dict(min_launches=9, max_launches=8), dict(quantiles=(1.5,)),
                                 dict(tie_rel=1.0), dict(flush_factor=0), dict(max_sets=0)])
def test_policy_rejects_nonsense(bad):
    with pytest.raises(ValueError):
        MeasurementPolicy(**bad)


def test_quantiles_match_numpy():
    rng = random.Random(7)
    for n in (1, 2, 5, 8, 31):
        xs = sorted(rng.uniform(1, 100) for _ in range(n))
        for q in (0.0, 0.1, 0.25, 0.5, 0.9, 1.0):
            assert quantile(xs, q) == pytest.approx(float(np.quantile(xs, q)), rel=1e-12)
    with pytest.raises(ValueError):
        quantile([], 0.5)


def test_summarize_statistics():
    samples = [5.0, 1.0, 3.0, 2.0, 4.0, 100.0]               # one outlier
    t = summarize(samples, DEFAULT_POLICY, launches=64, n_sets=4, mode="graph")
    assert t.median_us == statistics.median(samples) == 3.5
    assert t.quantiles_us == {"q10": pytest.approx(float(np.quantile(samples, 0.1))),
                              "q50": 3.5, "q90": pytest.approx(float(np.quantile(samples, 0.9)))}
    assert t.samples_us == tuple(samples)                    # every sample, in order
    assert t.quantile_us(0.9) == t.quantiles_us["q90"]
    assert t.policy == DEFAULT_POLICY.as_dict()
    for bad in ([], [1.0, float("nan")], [1.0, -2.0], [0.0]):
        with pytest.raises(ValueError):
            summarize(bad, DEFAULT_POLICY, launches=1, n_sets=1, mode="graph")


def test_rotation_sets_cover_l2():
    p = DEFAULT_POLICY
    for bytes_per_set in (1, 10**5, 9_437_184, 56_623_104, 2 * 10**8, 10**10):
        n = p.sets_for(bytes_per_set)
        assert 1 <= n <= p.max_sets
        if n < p.max_sets:
            assert n * bytes_per_set >= p.flush_factor * p.l2_bytes
            assert n == 1 or (n - 1) * bytes_per_set < p.flush_factor * p.l2_bytes
    assert p.sets_for(None) == p.max_sets


def test_launches_per_graph():
    p = DEFAULT_POLICY
    assert p.launches_for(4.0, 13) % 13 == 0
    assert p.min_launches <= p.launches_for(1e6, 1) <= p.min_launches
    assert p.launches_for(0.5, 1) == p.max_launches
    n = p.launches_for(10.0, 3)
    assert n % 3 == 0 and abs(n * 10.0 - p.target_replay_us) <= 3 * 10.0
    assert p.launches_for(1e6, 64) == 64                    # at least one pass over the sets
    with pytest.raises(ValueError):
        p.launches_for(1.0, 0)


def test_measure_refuses_without_gpu():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present; covered by the gpu test")
    with pytest.raises(RuntimeError, match="CUDA"):
        measure(object(), DEFAULT_POLICY, 1)


@pytest.mark.gpu
def test_measure_on_gpu_times_a_copy_plausibly():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")

    class CopyRunner:
        """Copies 64 MB per call; rotation over sets makes the L2 cold."""

        def __init__(self, n_sets):
            self.src = [torch.randn(16 << 20, device="cuda") for _ in range(n_sets)]
            self.dst = torch.empty_like(self.src[0])
            self.i = 0

        def rotate(self, i):
            self.i = i

        def __call__(self):
            self.dst.copy_(self.src[self.i])

    n = DEFAULT_POLICY.sets_for(64 << 20)
    t = measure(CopyRunner(n), DEFAULT_POLICY, n)
    assert t.mode == "graph", t.note
    gbps = 2 * (64 << 20) / (t.median_us * 1e-6) / 1e9       # read + write
    assert 500 < gbps < 6000, gbps                           # plausible HBM3e figures
    assert t.launches % n == 0 and len(t.samples_us) == DEFAULT_POLICY.repetitions


def test_callable_runner_rotates_over_its_sets():
    from resgen.search.timing import CallableRunner

    r = CallableRunner([lambda: "a", lambda: "b", lambda: "c"])
    assert r() == "a"
    r.rotate(4)
    assert r() == "b"
    r.rotate(2)
    assert r() == "c"


def test_capture_is_retried_once_and_failures_are_recorded():
    from resgen.search.timing import capture_with_retry

    syncs = []
    tries = iter([RuntimeError("capture invalidated"), "graph"])

    def flaky():
        r = next(tries)
        if isinstance(r, Exception):
            raise r
        return r
    g, note = capture_with_retry(flaky, lambda: syncs.append(1))
    assert g == "graph" and syncs == [1]
    assert note == "graph capture failed, retried: RuntimeError: capture invalidated"

    def broken():
        raise ValueError("no")
    g, note = capture_with_retry(broken, lambda: syncs.append(2))
    assert g is None and syncs == [1, 2, 2]
    assert note.count("graph capture failed") == 2
    assert note.endswith("timed eagerly: ValueError: no")
    assert capture_with_retry(lambda: "g", lambda: None) == ("g", "")
