"""Shared driver of the small H200 probes (bench/probes/bulk_probe.py,
bench/probes/ragged_probe.py, ...): each variant of a list is compiled, checked against
resgen.reference.linear (fresh inputs, poisoned output) and, if correct, timed as the whole
layer under the tuner's policy (resgen.cli.time_layer); one line is printed per variant as it
goes and $OUT/<name>.json is rewritten after each, so a probe cut short by its timeout keeps
what it measured."""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from resgen.cli import time_layer  # noqa: E402
from resgen.search.timing import DEFAULT_POLICY  # noqa: E402
from resgen.search.variant import LinearProblem  # noqa: E402

ARCH = "sm_90a"
# (problem, family, variant, extra fields of the record)
Case = tuple[LinearProblem, Any, Any, dict]


def table_best(families: Iterable[str], xop_only: bool = False
               ) -> dict[str, tuple[float, str, Any]]:
    """workload key -> (median us, family, variant) of the shipped table's fastest timed row
    among `families` (xop_only: only variants that read a prepared operand, not fused)."""
    from resgen.db import TuningDB
    from resgen.runtime import shipped_table
    from resgen.search.family import get_family
    from resgen.search.record import Status

    names = set(families)
    root = Path(__file__).resolve().parents[2]
    best: dict[str, tuple[float, str, Any]] = {}
    with TuningDB(shipped_table(root / "tuned", "h200"), readonly=True) as db:
        for r in db.rows(status=Status.OK, compile_only=False):
            if r["family"] not in names:
                continue
            v = get_family(r["family"]).VARIANT.from_key(r["variant_key"])
            w = r["workload_key"]
            if xop_only and getattr(v, "fused", False):
                continue
            if w not in best or r["median_us"] < best[w][0]:
                best[w] = (r["median_us"], r["family"], v)
    return best


def table_xop_winners(family: Any) -> dict[str, Any]:
    """workload key -> the shipped table's fastest timed variant of `family` that reads a
    prepared operand (not fused): the tuned xop tiles a probe starts from."""
    return {w: v for w, (_, _, v) in table_best([family.NAME], xop_only=True).items()}


def mext_plain_pairs(family: Any, ms: Iterable[int], shapes: Iterable[tuple[int, int]],
                     winners: dict | None = None
                     ) -> Iterator[tuple[int, int, int, LinearProblem, LinearProblem, Any, Any]]:
    """Per M of `ms` and (N, K) of `shapes`: (m, n, k, full, plain, full's winner, plain's
    winner), the NVFP4 M-Ext and plain problems and the shipped table's xop winners of
    `family` for them (None where it has none; `winners`: table_xop_winners' map)."""
    winners = table_xop_winners(family) if winners is None else winners
    for m in ms:
        for n, k in shapes:
            full = LinearProblem("nvfp4", "full", m, n, k)
            plain = LinearProblem("nvfp4", "none", m, n, k)
            yield m, n, k, full, plain, winners.get(full.key()), winners.get(plain.key())


def write_rows(path: Path, rows: list[dict], **extra: Any) -> dict:
    """Write a probe's JSON: the GPU, the timing policy, `rows` and `extra` (e.g. summary=);
    returns the document."""
    doc = {"gpu": torch.cuda.get_device_name(0), "policy": DEFAULT_POLICY.as_dict(),
           "rows": rows, **extra}
    path.write_text(json.dumps(doc, indent=1))
    return doc


def launch_twice(fam: Any, v: Any, p: Any, label: str) -> bool:
    """Compile `v` for `p`, bind one input set as the whole layer (fam.runner + as_layer) and
    launch it twice (under Nsight Compute the first launch warms instruction caches and TLBs,
    the second is the one a summary reads), then print `label` (the order files of the ncu
    probes) and free it. False (printing SKIP) where it does not compile."""
    from resgen.search.build import compile_variant

    out = compile_variant(fam, v, p, ARCH)
    if not out.ok:
        print(f"SKIP {label}: {(out.error or 'compile failed')[:200]}", flush=True)
        return False
    r = fam.runner(out.compiled, v, p, "cuda", n_sets=1, seed=0)
    r.as_layer()
    torch.cuda.synchronize()
    for _ in range(2):
        r()
    torch.cuda.synchronize()
    print(label, flush=True)
    del r
    torch.cuda.empty_cache()
    return True


def budgeted(cases: Iterable[Case], budget_s: float, name: str = "probe",
             clock: Callable[[], float] = time.monotonic) -> Iterator[Case]:
    """The cases, none started after budget_s seconds from the first (a probe's cut that keeps
    the cases it put first; `name` labels the stop message)."""
    t0 = clock()
    for c in cases:
        if clock() - t0 > budget_s:
            print(f"{name}: budget of {budget_s:.0f} s spent, stopping", flush=True)
            return
        yield c


def check_and_time(fam: Any, v: Any, p: Any, cache: dict) -> dict:
    """One variant: {"invalid": why} or {ok, rel_err, us, detail} (checked first, then timed
    as the whole layer) or {error, trace}; `cache` memoizes compiles across calls."""
    why = fam.why_invalid(v, p, ARCH)
    if why:
        return {"invalid": why}
    try:
        t = time_layer(fam, v, p, ARCH, cache, DEFAULT_POLICY)
        return {"ok": t["check"]["ok"], "rel_err": t["check"]["rel_err"],
                "us": t.get("resgen_us"), "detail": t["check"].get("detail")}
    except Exception as e:                       # compile or launch failure
        return {"error": f"{type(e).__name__}: {e}"[:600],
                "trace": traceback.format_exc()[-1500:]}


def probe(name: str, cases: Iterable[Case],
          tag: Callable[[dict], str] = lambda rec: "") -> int:
    """Run every case in order; rows of $OUT/<name>.json: n, k, comp, variant, the extra
    fields, then invalid / ok + rel_err + us (+ detail) / error + trace."""
    out = Path(os.environ.get("OUT", "bench/results/h200"))
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    cache: dict = {}
    for p, fam, v, extra in cases:
        rec = {"n": p.n, "k": p.k, "comp": p.compensation, "variant": v.name(), **extra,
               **check_and_time(fam, v, p, cache)}
        rows.append(rec)
        us = rec.get("us")
        print(f"{p.compensation:4s} {p.n}x{p.k} {tag(rec)}{v.name()[:72]:72s} "
              + (f"{us:7.2f} us rel {rec['rel_err']:.1e}" if us else
                 str(rec.get("invalid") or rec.get("error") or rec.get("detail"))[:160]),
              flush=True)
        write_rows(out / f"{name}.json", rows)
    return 0


def cell(v: float | None, width: int = 8, digits: int = 2) -> str:
    """A probe table's number cell: v right-aligned in `width` with `digits` decimals, or "-"
    where nothing was measured."""
    return f"{v:{width}.{digits}f}" if v else f"{'-':>{width}s}"


def dispatched_lookup() -> Callable[[Any], tuple[Any, str]]:
    """problem -> (the variant the runtime dispatches for it, where from: Dispatcher.source)
    on this machine's GPU and the shipped table."""
    from resgen.runtime import Dispatcher

    disp = Dispatcher()
    return lambda p: (disp.lookup("linear", p), disp.source("linear", p))


def run_dispatched_probe(name: str, doc: str, argv: list[str] | None, budget_s: float,
                         plan: Callable[[Callable[[Any], tuple[Any, str]]], Iterable[Case]],
                         tag: Callable[[dict], str], summary: Callable[[list[dict]], Any],
                         table: Callable[[Any], list[str]]) -> int:
    """The main() of a probe that starts from the dispatched variants: --budget-s (default
    budget_s), plan(lookup) cut by budgeted(), summarized_probe(), then table(summary)
    printed last. `doc`: the probe's docstring (its first line is the --help text)."""
    import argparse

    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--budget-s", type=float, default=budget_s,
                    help=f"start no case after this many seconds (default {budget_s:.0f})")
    args = ap.parse_args(argv)
    rc, out = summarized_probe(name, budgeted(plan(dispatched_lookup()), args.budget_s, name),
                               tag=tag, summary=summary)
    print("\n".join(table(out["summary"])))
    return rc


def summarized_probe(name: str, cases: Iterable[Case], tag: Callable[[dict], str],
                     summary: Callable[[list[dict]], Any]) -> tuple[int, dict]:
    """probe(), then its JSON gains "summary": summary(rows), also when a `timeout -s INT`
    cut the run short (rc 124: the rows measured so far). Returns (rc, the written doc)."""
    try:
        rc = probe(name, cases, tag=tag)
    except KeyboardInterrupt:
        print(f"{name}: interrupted, summarizing the rows so far", flush=True)
        rc = 124
    path = Path(os.environ.get("OUT", "bench/results/h200")) / f"{name}.json"
    doc = json.loads(path.read_text())
    doc["summary"] = summary(doc["rows"])
    path.write_text(json.dumps(doc, indent=1))
    return rc, doc
