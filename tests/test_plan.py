"""Planner: budget accounting and exact optimality against brute force."""

from __future__ import annotations

import itertools
import random

import pytest

from resgen.plan import PLAN_RATIOS, LayerCost, effective_bits, layer_cost, solve


def test_layer_cost_counts_base_and_compensated_channels():
    s = LayerCost(n=64, k=576)
    assert layer_cost(s, 0.0) == 4 * 64 * 576
    assert layer_cost(s, 1.0) == 8 * 64 * 576                 # a second K-wide product
    # 72 selected channels pad to 80 in NVFP4 (16-blocks) and to 96 in MXFP4 (32-blocks).
    assert layer_cost(s, 0.125, "nvfp4") == 4 * 64 * (576 + 80)
    assert layer_cost(s, 0.125, "mxfp4") == 4 * 64 * (576 + 96)
    assert layer_cost(LayerCost(8, 1024), 0.25) == 4 * 8 * (1024 + 256)
    with pytest.raises(ValueError):
        layer_cost(s, 0.3)
    with pytest.raises(ValueError):
        layer_cost(LayerCost(4, 12), 0.0)


def test_effective_bits_is_size_weighted():
    shapes = {"a": LayerCost(16, 1024), "b": LayerCost(48, 1024)}
    # a at full (8 bits) is a quarter of the weights: 0.25 * 8 + 0.75 * 4 = 5.
    assert effective_bits(shapes, {"a": 1.0, "b": 0.0}) == pytest.approx(5.0)
    assert effective_bits(shapes, {"a": 0.25, "b": 0.25}) == pytest.approx(5.0)
    with pytest.raises(ValueError):
        effective_bits(shapes, {"a": 1.0})


def _brute(scores, shapes, budget, fmt):
    names = sorted(scores)
    total = sum(shapes[n].size for n in names)
    best = None
    for combo in itertools.product(*[sorted(scores[n]) for n in names]):
        cost = sum(layer_cost(shapes[n], r, fmt) for n, r in zip(names, combo))
        if cost > budget * total + 1e-9:
            continue
        val = sum(scores[n][r] for n, r in zip(names, combo))
        if best is None or val < best[0] - 1e-12:
            best = (val, combo)
    return best


def _instance(rng: random.Random, n_layers: int):
    shapes = {f"l{i}": LayerCost(rng.choice([16, 32, 48]), rng.choice([64, 128, 256]))
              for i in range(n_layers)}
    scores = {}
    for name in shapes:
        # Damage shrinks with the ratio (as measured), at a random per-layer scale; some
        # layers offer only part of the candidates.
        scale = 10 ** rng.uniform(-3, 2)
        opts = PLAN_RATIOS if rng.random() < 0.7 else rng.sample(PLAN_RATIOS, 3)
        scores[name] = {r: scale * (1 - r) ** 2 * rng.uniform(0.5, 1.5) for r in opts}
    return scores, shapes


@pytest.mark.parametrize("solver", ["milp", "dp"])
@pytest.mark.parametrize("seed", range(12))
def test_solver_matches_brute_force(solver, seed):
    rng = random.Random(seed)
    scores, shapes = _instance(rng, rng.randint(2, 5))
    fmt = rng.choice(["nvfp4", "mxfp4"])
    budget = rng.choice([4.5, 5.0, 5.5, 6.5])
    want = _brute(scores, shapes, budget, fmt)
    if want is None:
        with pytest.raises(ValueError):
            solve(scores, shapes, budget, fmt=fmt, solver=solver)
        return
    plan = solve(scores, shapes, budget, fmt=fmt, solver=solver)
    assert plan.score == pytest.approx(want[0], rel=1e-9, abs=1e-12)
    assert plan.bits <= budget + 1e-12
    assert plan.bits == pytest.approx(effective_bits(shapes, plan.ratios, fmt))
    assert all(plan.ratios[n] in scores[n] for n in shapes)


def test_hand_checked_instance():
    # Two equal layers, budget 5.0 allows 1 bit extra on average: either one layer at full
    # (8 + 4) / 2 = 6 bits is too much; 0.5 + 0.0 -> (6 + 4) / 2 = 5 fits, as does 0.25 + 0.25.
    shapes = {"a": LayerCost(16, 128), "b": LayerCost(16, 128)}
    scores = {"a": {0.0: 10.0, 0.25: 4.0, 0.5: 1.0, 1.0: 0.0},
              "b": {0.0: 3.0, 0.25: 2.0, 0.5: 1.5, 1.0: 0.0}}
    for solver in ("milp", "dp"):
        plan = solve(scores, shapes, 5.0, solver=solver)
        assert plan.ratios == {"a": 0.5, "b": 0.0}               # 4.0 beats 4+2=6, 10+1.5
        assert plan.score == pytest.approx(4.0)
        assert plan.bits == pytest.approx(5.0)


def test_bad_inputs_are_rejected():
    shapes = {"a": LayerCost(16, 128)}
    with pytest.raises(ValueError):
        solve({"a": {0.3: 1.0}}, shapes, 5.0)
    with pytest.raises(ValueError):
        solve({"b": {0.0: 1.0}}, shapes, 5.0)
    with pytest.raises(ValueError):
        solve({"a": {0.5: 1.0}}, shapes, 4.5)                    # cheapest needs 6 bits
    with pytest.raises(ValueError):
        solve({"a": {0.0: float("nan")}}, shapes, 5.0)
    with pytest.raises(ValueError):
        solve({"a": {0.0: 1.0}}, shapes, 5.0, solver="greedy")
