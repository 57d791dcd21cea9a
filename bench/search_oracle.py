"""Does the tuner's search find the winners? An offline study on recorded H200 timings
(issue 20 section 5). CPU only.

The search history (the shipped table until session 29; see below) holds, per linear workload,
every variant the tuner timed on the H200 with its median. Taking those medians as an oracle,
this script replays search strategies at equal budgets (number of variants evaluated) over
each workload's TIMED variants and records the best median found after b evaluations,
relative to the best median the table holds for the workload:

  ranked   the tuner's order for a family with a prior (resgen.search.tuner): the prior's first
           choice, the family default, then the prior order (lower first, space order on ties);
  tpe      the tuner's own optuna search (resgen.search.tuner._optuna_search: multivariate TPE
           over the variant fields, the head enqueued first) seeded with the ranked order's
           first `--head` picks, over the timed variants (a sampled combination that was not
           timed is told as pruned and costs no budget, as an invalid one does in the tuner);
  cmaes    optuna's CMA-ES (needs the `cmaes` package) over the same fields encoded as ordinal
           integers (values in space order), the same head enqueued; CMA-ES has no categorical
           form, so this is its only applicable encoding;
  random   a uniformly shuffled order (the floor any strategy should beat).
Stochastic strategies run with three seeds.

What this measures and what it cannot: the oracle covers only variants that were timed. The
table's timed sets were themselves chosen mostly by the ranked order (plus the cover stage, seeds
and warm starts), so they are biased toward what the prior likes; a strategy that would explore
beyond them cannot be credited here. The study measures ORDERING QUALITY within the timed set,
not exploration beyond it.

Since session 29 the shipped table holds each workload's winner only (its non-winning rows went
stale in the issue-18 refingerprint); the history this study replays is the table of commit
6be1828: `git show 6be1828:tuned/h200.sqlite.xz > /tmp/h200-history.sqlite.xz`, then
`--table /tmp/h200-history.sqlite.xz`.

    python bench/search_oracle.py [--table tuned/h200.sqlite.xz] [--min-timed 32]
        [--workloads 60] [--out bench/results/cpu/search_oracle.json]

writes the JSON and prints a table last (geometric-mean best-found / best-known per budget, and
the share of workloads whose best-known variant, within the policy's 1% tie band, was found).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import lzma
import math
import random
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from resgen.search.family import get_family  # noqa: E402
from resgen.search.tuner import _optuna_search  # noqa: E402
from resgen.search.variant import LinearProblem, _to_jsonable, canonical_json  # noqa: E402

BUDGETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
SEEDS = (0, 1, 2)
TIE = 0.01                   # the tune policy's tie band: within 1% counts as found
FAMILIES = ("linear_sm90_mma", "linear_sm90_wgmma")


@dataclasses.dataclass
class Workload:
    family: str
    problem: LinearProblem
    timed: dict[str, float]          # variant key -> median us
    variants: dict[str, Any]         # variant key -> parsed variant (valid for the problem)
    space_index: dict[str, int]

    @property
    def best(self) -> float:
        return min(self.timed.values())


def _open(table: Path) -> sqlite3.Connection:
    if table.suffix == ".xz":
        tmp = Path(tempfile.mkdtemp(prefix="resgen_oracle_")) / table.stem
        tmp.write_bytes(lzma.decompress(table.read_bytes()))
        table = tmp
    return sqlite3.connect(f"file:{table}?mode=ro", uri=True)


def load(table: Path, min_timed: int, arch: str = "sm_90a") -> list[Workload]:
    """Linear workloads with at least min_timed timed ok rows whose variants parse and are
    valid for the workload under the current predicates."""
    con = _open(table)
    rows = con.execute(
        "select v.family, w.key, v.key, r.median_us, r.space_index from results r "
        "join variants v on v.id = r.variant_id join workloads w on w.id = r.workload_id "
        "where r.status = 'ok' and r.median_us is not null and r.median_us > 0").fetchall()
    by: dict[tuple[str, str], list] = {}
    for fam, wkey, vkey, med, idx in rows:
        if fam in FAMILIES:
            by.setdefault((fam, wkey), []).append((vkey, float(med), int(idx)))
    out = []
    for (fam, wkey), rs in sorted(by.items()):
        if len(rs) < min_timed:
            continue
        f = get_family(fam)
        p = LinearProblem.from_key(wkey)
        timed, variants, sidx = {}, {}, {}
        for vkey, med, idx in rs:
            try:
                v = f.VARIANT.from_key(vkey)
            except ValueError:
                continue
            if f.why_invalid(v, p, arch) is not None:
                continue
            k = v.key()
            if k not in timed or med < timed[k]:
                timed[k], variants[k], sidx[k] = med, v, idx
        if len(timed) >= min_timed:
            out.append(Workload(fam, p, timed, variants, sidx))
    return out


def sample(workloads: list[Workload], n: int, seed: int = 0) -> list[Workload]:
    """Up to n workloads, half per family where both have enough, spread over M (sorted by
    (M, N, K, mode) and taken evenly)."""
    out = []
    per = {f: [w for w in workloads if w.family == f] for f in FAMILIES}
    share = {f: n // 2 for f in FAMILIES}
    for f in FAMILIES:                      # a family with fewer gives its share away
        other = FAMILIES[1 - FAMILIES.index(f)]
        if len(per[f]) < share[f]:
            share[other] += share[f] - len(per[f])
            share[f] = len(per[f])
    for f, ws in per.items():
        ws = sorted(ws, key=lambda w: (w.problem.m, w.problem.n, w.problem.k,
                                       w.problem.compensation, w.problem.fmt))
        k = min(share[f], len(ws))
        out += [ws[(i * len(ws)) // k] for i in range(k)] if k else []
    return out


# ----------------------------------------------------------------------------- strategies


def ranked_order(w: Workload, arch: str = "sm_90a") -> list[str]:
    """The tuner's order with a prior and coverage (cover stage, then refine): the prior's
    first choice, the family default, then the prior order; restricted to the timed keys."""
    f = get_family(w.family)
    vs = list(w.variants.values())

    def score(v) -> float:
        try:
            x = float(f.prior(v, w.problem))
        except Exception:
            return math.inf
        return x if math.isfinite(x) else math.inf

    order = sorted(vs, key=lambda v: (score(v), w.space_index[v.key()]))
    keys = [v.key() for v in order]
    try:
        d = f.default(w.problem, arch).key()
    except ValueError:
        d = None
    head = keys[:1] + ([d] if d is not None and d in w.timed and d != keys[0] else [])
    return head + [k for k in keys if k not in head]


def run_ranked(w: Workload, budget: int, seed: int = 0, head: int = 0) -> list[float]:
    return [w.timed[k] for k in ranked_order(w)[:budget]]


def run_random(w: Workload, budget: int, seed: int, head: int = 0) -> list[float]:
    keys = sorted(w.timed)
    random.Random(seed).shuffle(keys)
    return [w.timed[k] for k in keys[:budget]]


def _evaluator(w: Workload) -> tuple[Callable[[Any], float], list[float]]:
    trace: list[float] = []

    def evaluate(v) -> float:
        med = w.timed[v.key()]
        trace.append(med)
        return med
    return evaluate, trace


def run_tpe(w: Workload, budget: int, seed: int, head: int = 2) -> list[float]:
    """The tuner's optuna search over the timed variants (ordered as the ranked order, so
    the categorical values appear in prior order), with the ranked order's first picks."""
    order = [w.variants[k] for k in ranked_order(w)]
    evaluate, trace = _evaluator(w)
    _optuna_search(order, order[:head], evaluate, budget, lambda: False, seed)
    return trace


def run_cmaes(w: Workload, budget: int, seed: int, head: int = 2) -> list[float]:
    """optuna's CmaEsSampler over the variant fields as ordinal integers (each field's values
    sorted, i.e. in numeric / enum order), the ranked order's first picks enqueued; a sampled
    combination that was not timed is pruned (no budget)."""
    import warnings

    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    order = [w.variants[k] for k in ranked_order(w)]
    names = [f.name for f in dataclasses.fields(order[0])]
    choices: dict[str, list[str]] = {}
    for n in names:
        vals = sorted({canonical_json(_to_jsonable(getattr(v, n))) for v in order},
                      key=lambda s: (isinstance(json.loads(s), str), json.loads(s)))
        if len(vals) > 1:
            choices[n] = vals

    def params(v) -> dict[str, int]:
        return {n: choices[n].index(canonical_json(_to_jsonable(getattr(v, n))))
                for n in choices}

    by = {tuple(params(v).values()): v for v in order}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sampler = optuna.samplers.CmaEsSampler(seed=seed, n_startup_trials=0,
                                               warn_independent_sampling=False)
        study = optuna.create_study(direction="minimize", sampler=sampler)
        for v in order[:head]:
            study.enqueue_trial(params(v))
        trace: list[float] = []
        seen: dict[str, float] = {}
        attempts = 0
        while len(seen) < budget and attempts < 20 * budget + 100:
            attempts += 1
            t = study.ask()
            key = tuple(t.suggest_int(n, 0, len(vals) - 1) for n, vals in choices.items())
            v = by.get(key)
            if v is None:
                study.tell(t, state=optuna.trial.TrialState.PRUNED)
                continue
            if v.key() not in seen:
                seen[v.key()] = w.timed[v.key()]
                trace.append(seen[v.key()])
            study.tell(t, seen[v.key()])
    return trace


STRATEGIES: dict[str, tuple[Callable[..., list[float]], bool]] = {
    "ranked": (run_ranked, False), "tpe": (run_tpe, True), "cmaes": (run_cmaes, True),
    "random": (run_random, True)}


def curve(trace: Sequence[float], best: float, budgets: Sequence[int]) -> list[float]:
    """best found after b evaluations / best known, per budget (a trace shorter than b: the
    strategy stopped; its best so far counts)."""
    out = []
    for b in budgets:
        part = trace[:b]
        out.append(min(part) / best if part else math.inf)
    return out


def study(workloads: list[Workload], strategies: Sequence[str], head: int,
          budgets: Sequence[int] = BUDGETS, log=print) -> dict:
    bmax = max(budgets)
    per: dict[str, list[dict]] = {s: [] for s in strategies}
    for i, w in enumerate(workloads):
        for s in strategies:
            fn, stochastic = STRATEGIES[s]
            for seed in (SEEDS if stochastic else (0,)):
                t0 = time.perf_counter()
                trace = fn(w, bmax, seed, head)
                per[s].append({"workload": i, "seed": seed,
                               "curve": curve(trace, w.best, budgets),
                               "evaluated": len(trace),
                               "seconds": round(time.perf_counter() - t0, 3)})
        if (i + 1) % 10 == 0:
            log(f"  {i + 1}/{len(workloads)} workloads", flush=True)
    summary: dict[str, dict] = {}
    for s, recs in per.items():
        seeds = sorted({r["seed"] for r in recs})
        by_seed = []
        for seed in seeds:
            rs = [r for r in recs if r["seed"] == seed]
            gm = [math.exp(statistics.fmean(math.log(r["curve"][j]) for r in rs))
                  for j in range(len(budgets))]
            found = [sum(r["curve"][j] <= 1 + TIE for r in rs) / len(rs)
                     for j in range(len(budgets))]
            by_seed.append({"seed": seed, "geomean_ratio": gm, "found_share": found})
        summary[s] = {"seeds": by_seed,
                      "geomean_ratio_mean": [statistics.fmean(b["geomean_ratio"][j]
                                                              for b in by_seed)
                                             for j in range(len(budgets))],
                      "found_share_mean": [statistics.fmean(b["found_share"][j]
                                                            for b in by_seed)
                                           for j in range(len(budgets))]}
    return {"budgets": list(budgets), "per_workload": per, "summary": summary}


def table(res: dict, strategies: Sequence[str]) -> str:
    b = res["budgets"]
    head = "| strategy | " + " | ".join(f"b={x}" for x in b) + " |"
    lines = [head, "|---|" + "---:|" * len(b)]
    for s in strategies:
        sm = res["summary"][s]
        lines.append(f"| {s} best/known | " + " | ".join(f"{x:.3f}" for x in
                                                       sm["geomean_ratio_mean"]) + " |")
    for s in strategies:
        sm = res["summary"][s]
        lines.append(f"| {s} found | " + " | ".join(f"{100 * x:.0f}%" for x in
                                                  sm["found_share_mean"]) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--table", type=Path, default=ROOT / "tuned/h200.sqlite.xz")
    p.add_argument("--min-timed", type=int, default=32)
    p.add_argument("--workloads", type=int, default=60)
    p.add_argument("--head", type=int, default=2,
                   help="prior picks enqueued before the optuna samplers")
    p.add_argument("--strategies", default="ranked,tpe,cmaes,random")
    p.add_argument("--out", type=Path, default=ROOT / "bench/results/cpu/search_oracle.json")
    a = p.parse_args(argv)
    strategies = [s for s in a.strategies.split(",") if s]
    unknown = set(strategies) - set(STRATEGIES)
    if unknown:
        print(f"search_oracle: unknown strategies {sorted(unknown)}", file=sys.stderr)
        return 2
    if "cmaes" in strategies:
        try:
            import cmaes  # noqa: F401
        except ImportError:
            print("search_oracle: cmaes is not installed (pip install cmaes): skipping CMA-ES")
            strategies.remove("cmaes")
    t0 = time.time()
    every = load(a.table, a.min_timed)
    if not every:
        print(f"search_oracle: {a.table} has no linear workload with >= {a.min_timed} timed "
              "variants (a winners-only table? see the module docstring for the history "
              "table)", file=sys.stderr)
        return 2
    ws = sample(every, a.workloads)
    print(f"{len(every)} linear workloads with >= {a.min_timed} timed valid variants; "
          f"studying {len(ws)}", flush=True)
    res = study(ws, strategies, a.head)
    res["workloads"] = [{"family": w.family, "problem": json.loads(w.problem.key()),
                         "timed": len(w.timed), "best_us": w.best} for w in ws]
    res.update({"table": str(a.table.relative_to(ROOT) if a.table.is_relative_to(ROOT)
                             else a.table), "min_timed": a.min_timed, "head": a.head,
                "eligible_workloads": len(every), "tie": TIE,
                "command": "python bench/search_oracle.py " + " ".join(argv or sys.argv[1:]),
                "seconds": round(time.time() - t0, 1),
                "caveat": "the oracle covers only variants that were timed: ordering quality "
                          "within the timed set, not exploration beyond it"})
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res))
    print(table(res, strategies))
    print(f"-> {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
