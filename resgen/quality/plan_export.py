"""Solve a compensation plan on a model and export it as a resgen FP4 checkpoint.

The checkpoint is resgen.calibrate.save_layers' safetensors file with one entry per decoder
projection, named as in the Hugging Face model ("model.layers.3.mlp.down_proj"):
  ratio 0      plain FP4 weight, no selection
  K-Ext ratio  the weight in the extended layout + its channel mask (resgen_channel_mask)
  ratio 1.0    plain FP4 weight (full residue reuses the base weight, paper E.3)
and the header metadata "resgen_plan" holds JSON {"budget", "fmt", "effective_bits",
"ratios": {layer: ratio}, "score", "weights"}: the runtime reads ratio 1.0 from there.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..calibrate import save_layers
from ..plan import layer_cost
from .study import Method, Study, StudyConfig

__all__ = ["export_plan", "PLAN_METADATA_KEY"]

PLAN_METADATA_KEY = "resgen_plan"


def export_plan(config: StudyConfig, out: str | Path, *, budget: float, fmt: str = "nvfp4",
                score: str = "mean_abs", weights: str = "amax",
                study: Study | None = None) -> str:
    """Calibrate, score, solve and write the checkpoint; returns the printed table.

    study: an already calibrated Study to reuse (its config wins); None builds one.
    """
    m = Method(fmt, "plan", score=score, weights=weights, budget=budget)
    if study is None:
        study = Study(config, need_hessian=weights == "gptq", log=lambda s: None)
    elif weights == "gptq" and not study.need_hessian:
        raise ValueError("weights='gptq' needs a Study calibrated with need_hessian=True")
    plan = study.plan(m)
    scores = study.plan_scores(m)
    shapes = study.shapes()
    layers = {}
    for name, r in plan.ratios.items():
        comp = {0.0: "none", 1.0: "full"}.get(r, r)
        layers[f"model.{name}"] = study.qweight(name, m, comp)
    meta = {"budget": budget, "fmt": fmt, "effective_bits": plan.bits, "score": score,
            "weights": weights, "solver": plan.solver, "objective": plan.score,
            "ratios": {f"model.{n}": r for n, r in plan.ratios.items()}}
    save_layers(out, layers, metadata={PLAN_METADATA_KEY: json.dumps(meta)})
    lines = [f"{'layer':34s} {'N x K':>11s} {'ratio':>6s} {'bits':>6s} {'score':>10s} "
             f"{'score@0':>10s}"]
    for name in shapes:
        r = plan.ratios[name]
        s = shapes[name]
        lines.append(f"{name:34s} {f'{s.n}x{s.k}':>11s} {r:6.3f} "
                     f"{layer_cost(s, r, fmt) / s.size:6.3f} {scores[name][r]:10.3e} "
                     f"{scores[name][0.0]:10.3e}")
    counts = {r: sum(1 for v in plan.ratios.values() if v == r) for r in sorted(set(
        plan.ratios.values()))}
    lines.append(f"{fmt} budget {budget}: effective bits {plan.bits:.4f}, layers per ratio "
                 f"{counts}, objective {plan.score:.4e} (all plain: "
                 f"{sum(v[0.0] for v in scores.values()):.4e})")
    return "\n".join(lines) + "\n"
