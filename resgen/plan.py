"""Layer-wise compensation planner (paper appendix E.1): one ratio per layer under a bit budget.

Candidate ratios: 0 (plain W4A4), 0.125, 0.25, 0.5 (K-Ext) and 1.0 (full residue, M-Ext).

Effective bits (the budget's unit; compute, not storage): a layer of N x K does FP4 work on
K base channels plus ext compensated ones, so
    bits(ratio) = 4 * (K + ext) / K,  ext = 0 (ratio 0), extension_length(K * ratio) (K-Ext),
                                      K (ratio 1.0: the residue product is a second K-wide GEMM)
and the model's effective bits are the layer-size (N * K) weighted mean. Integer costs
cost = 4 * N * (K + ext) make the budget check exact: a plan fits budget B when
    sum_l cost_l <= B * sum_l N_l K_l.
Budgets 4.5 / 5.0 / 5.5 therefore allow an average ratio of 0.125 / 0.25 / 0.375.

The choice is a multiple-choice knapsack, solved EXACTLY: by scipy's HiGHS MILP (default), or by
a dynamic program over the integer costs (reduced by their gcd) when that table is small.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

from . import formats

__all__ = ["PLAN_RATIOS", "LayerCost", "layer_cost", "effective_bits", "Plan", "solve"]

PLAN_RATIOS: tuple[float, ...] = (0.0, 0.125, 0.25, 0.5, 1.0)


@dataclass(frozen=True)
class LayerCost:
    """Shape of one linear layer for budget accounting: out_features N, in_features K."""

    n: int
    k: int

    @property
    def size(self) -> int:
        return self.n * self.k


def _ext(k: int, ratio: float, fmt: str) -> int:
    if ratio not in PLAN_RATIOS:
        raise ValueError(f"plan ratio must be one of {PLAN_RATIOS}, got {ratio!r}")
    if ratio == 0.0:
        return 0
    if ratio == 1.0:
        return k
    return formats.extension_length(int(round(k * ratio)), fmt)


def layer_cost(shape: LayerCost, ratio: float, fmt: str = "nvfp4") -> int:
    """Integer effective-bit cost 4 * N * (K + ext) of running the layer at `ratio`."""
    if shape.n <= 0 or shape.k <= 0 or shape.k % 8:
        raise ValueError(f"layer shape must be positive with K % 8 == 0, got {shape}")
    return 4 * shape.n * (shape.k + _ext(shape.k, ratio, fmt))


def effective_bits(shapes: Mapping[str, LayerCost], ratios: Mapping[str, float],
                   fmt: str = "nvfp4") -> float:
    """Size-weighted mean effective bits of a plan (layer name -> ratio)."""
    if set(shapes) != set(ratios):
        raise ValueError("the plan must give a ratio for exactly the layers in shapes")
    total = sum(s.size for s in shapes.values())
    return sum(layer_cost(shapes[n], ratios[n], fmt) for n in shapes) / total


@dataclass(frozen=True)
class Plan:
    """A solved plan: ratios (layer -> ratio), its total score and effective bits."""

    ratios: dict[str, float]
    score: float
    bits: float
    budget: float
    solver: str

    def to_json(self) -> dict:
        return {"ratios": self.ratios, "score": self.score, "effective_bits": self.bits,
                "budget": self.budget, "solver": self.solver}


def _validate(scores, shapes, budget):
    if set(scores) != set(shapes) or not scores:
        raise ValueError("scores and shapes must name the same, non-empty set of layers")
    for name, opts in scores.items():
        if not opts:
            raise ValueError(f"layer {name!r} has no candidate ratios")
        for r, s in opts.items():
            if r not in PLAN_RATIOS:
                raise ValueError(f"layer {name!r}: ratio {r!r} is not one of {PLAN_RATIOS}")
            if not math.isfinite(float(s)):
                raise ValueError(f"layer {name!r}: score for ratio {r} is not finite")
    if not math.isfinite(budget) or budget <= 0:
        raise ValueError(f"budget must be a positive number of effective bits, got {budget}")


def solve(scores: Mapping[str, Mapping[float, float]], shapes: Mapping[str, LayerCost],
          budget: float, *, fmt: str = "nvfp4", solver: str = "milp") -> Plan:
    """Minimise sum_l scores[l][ratio_l] subject to effective bits <= budget.

    scores: layer -> {ratio: estimated damage}; a layer may offer any subset of PLAN_RATIOS.
    shapes: layer -> LayerCost.  solver: "milp" (scipy HiGHS, exact) or "dp" (exact dynamic
    program over gcd-reduced integer costs). Raises ValueError when no plan fits the budget.
    """
    _validate(scores, shapes, budget)
    names = sorted(scores)
    opts = [sorted(scores[n]) for n in names]
    costs = [[layer_cost(shapes[n], r, fmt) for r in o] for n, o in zip(names, opts)]
    vals = [[float(scores[n][r]) for r in o] for n, o in zip(names, opts)]
    total = sum(shapes[n].size for n in names)
    # Exact rational budget: cost / total <= budget  <=>  cost <= floor(budget * total).
    cap = math.floor(budget * total + 1e-9)
    if sum(min(c) for c in costs) > cap:
        raise ValueError(f"no plan fits {budget} effective bits (the cheapest needs "
                         f"{sum(min(c) for c in costs) / total:.4f})")
    if solver == "milp":
        pick = _solve_milp(vals, costs, cap)
    elif solver == "dp":
        pick = _solve_dp(vals, costs, cap)
    else:
        raise ValueError(f"solver must be 'milp' or 'dp', got {solver!r}")
    ratios = {n: o[i] for n, o, i in zip(names, opts, pick)}
    score = sum(v[i] for v, i in zip(vals, pick))
    return Plan(ratios, score, effective_bits(shapes, ratios, fmt), budget, solver)


def _solve_milp(vals, costs, cap) -> list[int]:
    import numpy as np
    from scipy.optimize import Bounds, LinearConstraint, milp

    sizes = [len(v) for v in vals]
    nvar = sum(sizes)
    c = np.concatenate([np.asarray(v, dtype=np.float64) for v in vals])
    # Scores of different layers can differ by orders of magnitude; HiGHS's tolerances are
    # absolute, so normalise the objective (the argmin is unchanged).
    scale = float(np.abs(c).max()) or 1.0
    one_hot = np.zeros((len(vals), nvar))
    budget_row = np.zeros((1, nvar))
    j = 0
    for i, (cs, n) in enumerate(zip(costs, sizes)):
        one_hot[i, j: j + n] = 1.0
        budget_row[0, j: j + n] = cs
        j += n
    # Costs are integers up to ~1e9; normalising the row keeps HiGHS's feasibility tolerance
    # far below one cost unit.
    norm = float(budget_row.max())
    res = milp(c / scale,
               constraints=[LinearConstraint(one_hot, 1.0, 1.0),
                            LinearConstraint(budget_row / norm, -np.inf, cap / norm)],
               integrality=np.ones(nvar), bounds=Bounds(0, 1),
               options={"mip_rel_gap": 0.0, "presolve": True})
    if res.x is None:
        raise ValueError(f"the MILP solver found no plan: {res.message}")
    x = np.round(res.x).astype(int)
    pick, j = [], 0
    for _cs, n in zip(costs, sizes):
        pick.append(int(np.argmax(x[j: j + n])))
        j += n
    if sum(cs[i] for cs, i in zip(costs, pick)) > cap:
        raise ValueError("the MILP solution exceeds the budget (solver tolerance)")
    return pick


_DP_MAX_CELLS = 50_000_000


def _solve_dp(vals, costs, cap) -> list[int]:
    g = 0
    for cs in costs:
        for c in cs:
            g = math.gcd(g, c)
    units = [[c // g for c in cs] for cs in costs]
    base = sum(min(u) for u in units)
    width = cap // g - base                      # spare capacity above the cheapest plan
    extra = [[u - min(us) for u in us] for us in units]
    width = min(width, sum(max(e) for e in extra))
    if (width + 1) * len(vals) > _DP_MAX_CELLS:
        raise ValueError(f"the DP table would need {(width + 1) * len(vals)} cells; "
                         f"use solver='milp'")
    inf = float("inf")
    best = [0.0] * (width + 1)    # best[w]: least score of the layers so far using <= w extra
    choice: list[list[int]] = []
    for v, e in zip(vals, extra):
        new = [inf] * (width + 1)
        arg = [-1] * (width + 1)
        for w in range(width + 1):
            for i, (vi, ei) in enumerate(zip(v, e)):
                if ei <= w:
                    cand = best[w - ei] + vi
                    if cand < new[w]:
                        new[w], arg[w] = cand, i
        best = new
        choice.append(arg)
    pick = [0] * len(vals)
    w = width
    for layer in range(len(vals) - 1, -1, -1):
        i = choice[layer][w]
        pick[layer] = i
        w -= extra[layer][i]
    return pick
