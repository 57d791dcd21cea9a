"""What a tuning run will do, before it does it: workloads per family, unique problems, compile
classes, compiles and an estimate of the GPU seconds, printed by `resgen tune` (and alone by
`resgen tune --plan`).

The estimate is a cost model, not a promise. Per evaluated variant the GPU is held for prep
(input sets; once per workload when the family has a `prepare` hook), the reference check and
the timing; the timing part follows the measurement policy (eager warm-up and probe launches,
graph capture, warm-up and timed replays). When the output database already holds rows with
per-phase seconds (resgen.db stores them with every result), their medians per family replace
the model's constants, and the plan says so.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from .family import KernelFamily
from .timing import MeasurementPolicy
from .tuner import TuneConfig, compile_class, stages_of
from .variant import ProblemBase

__all__ = ["CostModel", "FamilyPlan", "RunPlan", "plan_run", "measured_costs", "table"]


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain-text table: a header, a rule, left-aligned columns (`resgen` output)."""
    cells = [[str(h) for h in headers]] + [["" if c is None else str(c) for c in r]
                                           for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


@dataclass(frozen=True)
class CostModel:
    """Seconds per step, before anything was measured (H200 host, CuTe DSL 4.8.1: a decode
    kernel compiles in about 0.5 s on one core, bench/results/h200)."""

    prep_s: float = 0.03          # input sets (a guess: families cache big weights)
    check_s: float = 0.01         # one reference check (kernel + reference + compare)
    launch_us: float = 25.0       # host cost of one launch through a Python launcher
    kernel_us: float = 15.0       # a typical decode kernel
    n_sets: int = 4               # a typical number of rotated input sets
    graph_s: float = 0.003        # capture + instantiate + teardown of one CUDA graph
    compile_s: float = 1.0        # one compile on one core

    def time_s(self, policy: MeasurementPolicy) -> float:
        """GPU-held seconds of one timing under `policy`."""
        launches = policy.launches_for(self.kernel_us, self.n_sets)
        host = (self.n_sets + 8 + launches) * self.launch_us * 1e-6    # warm-up, probe, capture
        device = (policy.warmup_replays + policy.repetitions) * launches * self.kernel_us * 1e-6
        return host + device + self.graph_s


def measured_costs(rows: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, float]]:
    """Median seconds per phase and family over result rows that stored phase_s (rows of
    resgen.db.TuningDB.rows()); phases a family never recorded are absent."""
    per: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        raw = r.get("phase_s")
        if not raw:
            continue
        try:
            phases = json.loads(raw) if isinstance(raw, str) else dict(raw)
        except (TypeError, ValueError):
            continue
        for k, v in phases.items():
            if isinstance(v, (int, float)) and v >= 0:
                per[r["family"]][k].append(float(v))
    out: dict[str, dict[str, float]] = {}
    for fam, phases in per.items():
        out[fam] = {k: statistics.median(v) for k, v in phases.items() if v}
        out[fam]["rows"] = float(max(len(v) for v in phases.values()))
    return out


@dataclass
class FamilyPlan:
    family: str
    workloads: int
    per_model: dict[str, int]
    classes: int
    hooks: list[str]
    variants_per_workload: float      # what the run may evaluate (max_variants)
    prep_s: float
    check_s: float
    time_s: float
    compile_s: float
    source: str                       # "model" | "measured (N rows)"

    @property
    def gpu_s_per_variant(self) -> float:
        prep = 0.0 if "prepare" in self.hooks else self.prep_s
        return prep + self.check_s + self.time_s

    def gpu_s(self, variants: float) -> float:
        """GPU-held seconds to evaluate `variants` candidates of every workload."""
        per_workload = (self.prep_s if "prepare" in self.hooks else 0.0)
        return self.workloads * (per_workload + variants * self.gpu_s_per_variant)

    def compiles(self) -> tuple[int, int]:
        """(fewest, most) compiles: every workload of a class sharing its candidates, or
        none of them doing so."""
        v = int(self.variants_per_workload)
        return self.classes * v, self.workloads * v


@dataclass
class RunPlan:
    families: list[FamilyPlan]
    unique_workloads: int             # distinct problems (families of one op share them)
    stages: tuple[str, ...]
    workers: int
    budget_s: float | None
    policy: str
    max_variants: int
    notes: list[str] = field(default_factory=list)

    @property
    def workloads(self) -> int:
        """Tuning jobs: (family, workload) pairs."""
        return sum(f.workloads for f in self.families)

    def gpu_s(self, variants: float) -> float:
        return sum(f.gpu_s(variants) for f in self.families)

    def variants_in_budget(self) -> float | None:
        """Variants per workload the budget pays for if the GPU is the bottleneck."""
        if self.budget_s is None:
            return None
        one = self.gpu_s(1.0)
        base = sum(f.workloads * (f.prep_s if "prepare" in f.hooks else 0.0)
                   for f in self.families)
        per = one - base
        return max(0.0, (self.budget_s - base) / per) if per > 0 else None

    def as_dict(self) -> dict[str, Any]:
        return {"stages": list(self.stages), "workers": self.workers, "budget_s": self.budget_s,
                "unique_workloads": self.unique_workloads,
                "policy": self.policy, "max_variants": self.max_variants,
                "workloads": self.workloads, "gpu_s_cover": self.gpu_s(1.0),
                "gpu_s_max_variants": self.gpu_s(self.max_variants),
                "variants_in_budget": self.variants_in_budget(), "notes": self.notes,
                "compile_s_per_process": [
                    sum(f.compiles()[i] * f.compile_s for f in self.families)
                    / max(self.workers, 1) for i in (0, 1)],
                "families": [{**f.__dict__, "gpu_s_per_variant": f.gpu_s_per_variant,
                              "compiles": f.compiles()} for f in self.families]}

    def text(self) -> str:
        rows = []
        for f in self.families:
            lo, hi = f.compiles()
            models = " ".join(f"{m}:{n}" for m, n in f.per_model.items())
            rows.append([f.family, f.workloads, models, f.classes, f"{lo}-{hi}",
                         f"{f.gpu_s_per_variant * 1e3:.0f}", f"{f.gpu_s(1.0):.0f}",
                         f"{f.gpu_s(f.variants_per_workload):.0f}",
                         ",".join(f.hooks) or "-", f.source])
        head = (f"PLAN: {self.workloads} tuning jobs (family x workload) over "
                f"{self.unique_workloads} unique workloads, stages {'+'.join(self.stages)}, "
                f"{self.workers} process(es), policy {self.policy}, up to {self.max_variants} "
                f"variants per workload, budget {self.budget_s or 'none'} s")
        lines = [head, table(["family", "workloads", "per model (before dedupe)", "classes",
                              "compiles", "ms/variant", "GPU s: 1/wl",
                              f"{self.max_variants}/wl", "hooks", "costs"], rows)]
        # (GPU s: the GPU held for one / max_variants evaluated variants of every job)
        fit = self.variants_in_budget()
        lines.append(f"estimated GPU seconds: {self.gpu_s(1.0):.0f} for one variant per "
                     f"workload, {self.gpu_s(self.max_variants):.0f} for "
                     f"{self.max_variants}" + ("" if fit is None else
                                                f"; the budget pays for about {fit:.1f} "
                                                "variants per workload"))
        lo = sum(f.compiles()[0] * f.compile_s for f in self.families) / max(self.workers, 1)
        hi = sum(f.compiles()[1] * f.compile_s for f in self.families) / max(self.workers, 1)
        lines.append(f"estimated compile wall seconds on {self.workers} process(es): {lo:.0f} "
                     f"(every class shares its candidates) to {hi:.0f} (none do); compiles "
                     "overlap the GPU work of other processes")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def plan_run(problems: Mapping[str, Sequence[ProblemBase]],
             per_model: Mapping[str, Mapping[str, int]], fams: Mapping[str, KernelFamily],
             config: TuneConfig, workers: int, cost: CostModel = CostModel(),
             measured: Mapping[str, Mapping[str, float]] | None = None) -> RunPlan:
    """The plan of a run over `problems` (per family name, already deduplicated across
    models); `per_model` counts each model's workloads before deduplication."""
    out = []
    for name, probs in problems.items():
        fam = fams[name]
        classes = {compile_class(fam, p, config.arch) for p in probs}
        hooks = [h for h in ("prepare", "prior", "model_problems", "working_set_bytes")
                 if fam.defines(h)]
        m = dict((measured or {}).get(name, {}))
        src = f"measured ({int(m['rows'])} rows)" if m else "model"
        out.append(FamilyPlan(
            family=name, workloads=len(probs), per_model=dict(per_model.get(name, {})),
            classes=len(classes), hooks=hooks, variants_per_workload=config.max_variants,
            prep_s=m.get("prep", cost.prep_s), check_s=m.get("check", cost.check_s),
            time_s=m.get("time", cost.time_s(config.policy)),
            compile_s=m.get("compile", cost.compile_s), source=src))
    unique = len({p.key() for probs in problems.values() for p in probs})
    plan = RunPlan(out, unique, stages_of(config), workers, config.time_budget_s,
                   config.policy.label, config.max_variants)
    total = plan.workloads
    if config.time_budget_s and not config.compile_only:
        cover = plan.gpu_s(1.0)
        if cover > 0.8 * config.time_budget_s:
            plan.notes.append(f"one variant per job already needs about {cover:.0f} s "
                              f"of GPU time ({total} jobs): the budget may not cover "
                              "every workload; drop families, formats or buckets")
    return plan
