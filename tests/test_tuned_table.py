"""The shipped dispatch table tuned/h200.sqlite: coverage and freshness.

The table tests are skipped (with the reason below) ONLY while neither tuned/h200.sqlite nor
tuned/h200.sqlite.xz exists; once
it exists, any gap in coverage or any result whose fingerprint no longer matches the current
templates fails: a template change without re-tuning fails CI. The audit itself is proven on
a synthetic table (good, stale, and incomplete) so the check cannot silently pass.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest

from resgen.db import TuningDB
from resgen.models import COMPENSATIONS, FORMATS, attention_problems, get_model, linear_problems
from resgen.runtime import Device, Dispatcher, shipped_table
from resgen.search.buckets import DEFAULT_ATTN_BATCHES, DEFAULT_KV_LENS, DEFAULT_M_BUCKETS
from resgen.search.build import memo_fingerprint, variant_fingerprint
from resgen.search.family import families, get_family
from resgen.search.record import Environment, ResultRecord, Status
from resgen.search.variant import AttentionProblem, LinearProblem

# tuned/h200.sqlite, or tuned/h200.sqlite.xz (compressed, as `resgen db export` writes it)
TABLE = shipped_table(Path(__file__).resolve().parent.parent / "tuned", "h200")
MODELS = ("qwen3-4b", "qwen3-8b", "qwen3-32b")
ARCH = "sm_90a"
ABSENT = "tuned/h200.sqlite not yet produced"


# The Hopper-native modes (issue 20) the shipped table covers too: W4A16 linear layers at the
# decode buckets and the prefill buckets, and the Q16 decode-attention query.
W4A16_M_BUCKETS = DEFAULT_M_BUCKETS + (256, 512, 2048)
# W4A4 prefill: plain, full M-Ext and the smallest K-Ext ratio at the prefill buckets, for all
# three models (the other K-Ext ratios at prefill: Qwen3-8B only, not required).
PREFILL_M_BUCKETS = (256, 512, 2048)
PREFILL_COMPENSATIONS = ("none", "full", "0.125")


def required_workloads() -> list:
    """Qwen3-4B/8B/32B at TP1: both formats, all W4A4 compensation modes at the default M
    buckets, plain / full / K-Ext 0.125 at the prefill buckets, and W4A16 at both
    (W4A16_M_BUCKETS), NVFP4 K-Ext presum from M = 16 (kext_presum_workloads); the default
    attention grid in the default modes (ResAttn, plain) and Q16, when the families exist."""
    specs = [get_model(m) for m in MODELS]
    fams = [f for f in families().values() if ARCH in f.ARCHS and not f.NAME.startswith("fake")]
    need = []
    if any(f.PROBLEM is LinearProblem for f in fams):
        need += linear_problems(specs, 1, FORMATS, COMPENSATIONS, DEFAULT_M_BUCKETS)
        need += linear_problems(specs, 1, FORMATS, PREFILL_COMPENSATIONS, PREFILL_M_BUCKETS)
        need += linear_problems(specs, 1, FORMATS, ("w4a16",), W4A16_M_BUCKETS)
        need += kext_presum_workloads()
    if any(f.PROBLEM is AttentionProblem for f in fams):
        need += attention_problems(specs, 1, DEFAULT_ATTN_BATCHES, DEFAULT_KV_LENS)
        need += attention_problems(specs, 1, DEFAULT_ATTN_BATCHES, DEFAULT_KV_LENS,
                                   modes=("q16",))
    return need


# K-Ext presum (LinearProblem fold "presum", issue 20): NVFP4 K-Ext at every ratio from M = 16
# on has rows of its own since kext_presum_s35 (tuned/README.md), required like every other
# workload, and what the runtime serves for it must be a valid presum variant. Below M = 16
# none is required: the runtime serves the plain twin's tuned winner as presum where it has a
# presum form (runtime.Dispatcher._presum_twin; at M = 1 / 4 plain's winners are fused
# linear_sm90_mma variants, which have none, and the default serves).
KEXT_PRESUM_M_BUCKETS = (16, 32, 64, 128) + PREFILL_M_BUCKETS


def kext_presum_workloads() -> list:
    specs = [get_model(m) for m in MODELS]
    return linear_problems(specs, 1, ("nvfp4",), [c for c in COMPENSATIONS
                                                  if c not in ("none", "full")],
                           KEXT_PRESUM_M_BUCKETS, kext_folds=("presum",))


def audit(path: Path) -> dict[str, list[str]]:
    """Problems of a shipped table, by check; every list empty means the table is good."""
    out: dict[str, list[str]] = {"intact": [], "fresh": [], "coverage": [], "runtime": []}
    with TuningDB(path, readonly=True) as db:
        rep = db.verify()
        rows = db.rows(status=Status.OK, compile_only=False)
    out["intact"] += rep.errors[:10]
    if not rows:
        out["intact"].append("no timed results")
        return out
    gpus = {(r["gpu_name"], r["arch"]) for r in rows}
    out["intact"] += [f"results from {g} / {a}" for g, a in gpus
                      if "H200" not in g or a != ARCH]
    cache: dict[tuple, str] = {}
    stale = 0
    for r in rows:
        try:
            fam = get_family(r["family"])
        except ValueError:
            out["fresh"].append(f"family {r['family']} is not in this checkout")
            continue
        v = fam.VARIANT.from_key(r["variant_key"])
        p = fam.PROBLEM.from_key(r["workload_key"])
        if memo_fingerprint(cache, fam, v, p, ARCH) != r["fingerprint"]:
            stale += 1
            if stale <= 5:
                out["fresh"].append(f"stale: {v.name()} {r['workload_key']}")
    if stale:
        out["fresh"].append(f"{stale} of {len(rows)} results were tuned with other templates, "
                            "compile options or versions: re-tune and re-export")
    have = defaultdict(set)
    for r in rows:
        have[r["workload_digest"]].add(r["family"])
    need = required_workloads()
    if not need:
        out["coverage"].append("no linear or attention family registered for sm_90a")
    missing = [p for p in need if p.digest() not in have]
    if missing:
        out["coverage"].append(f"{len(missing)} of {len(need)} workloads have no timed result, "
                               f"e.g. {[json.loads(p.key()) for p in missing[:3]]}")
    d = Dispatcher(paths=[path], device=Device(sorted(gpus)[0][0], ARCH))
    defaults = 0
    for p in need:
        v = d.lookup(type(p).OP, p)
        if get_family(type(v).FAMILY).why_invalid(v, p, ARCH) is not None:
            out["runtime"].append(f"invalid variant served for {p.key()}")
        if getattr(p, "kext_presum", False) and not getattr(v, "presum", False):
            out["runtime"].append(f"no presum variant served for {p.key()}")
        defaults += d.source(type(p).OP, p) == "default"
    if defaults:
        out["runtime"].append(f"{defaults} workloads fall back to the default variant")
    return out


@pytest.fixture(scope="module")
def shipped():
    if not TABLE.exists():
        pytest.skip(ABSENT)
    return audit(TABLE)


@pytest.mark.parametrize("check", ["intact", "fresh", "coverage", "runtime"])
def test_shipped_h200_table(shipped, check):
    assert not shipped[check], shipped[check]


def _synthetic(path: Path, need: list, *, fingerprint=None) -> None:
    env = Environment("NVIDIA H200", ARCH, "9.0", 132, "580.0", "13.0", "2.11", "4.8.1",
                      "0.1.0", False)
    with TuningDB(path) as db:
        for p in need:
            fam = next(f for f in families().values()
                       if f.PROBLEM is type(p) and ARCH in f.ARCHS
                       and not f.NAME.startswith("fake"))
            v = fam.default(p, ARCH)
            fp = fingerprint or variant_fingerprint(fam, v, p, ARCH)
            db.record(ResultRecord(problem=p, variant=v, environment=env, fingerprint=fp,
                                   status=Status.OK, space_index=0, median_us=10.0,
                                   samples_us=[10.0], policy={"tie_rel": 0.01}))


def test_audit_on_synthetic_tables(tmp_path):
    need = required_workloads()
    if not need:
        pytest.skip("no linear/attention family registered yet: nothing to audit against")
    good = tmp_path / "good.sqlite"
    _synthetic(good, need)
    assert audit(good) == {"intact": [], "fresh": [], "coverage": [], "runtime": []}
    stale = tmp_path / "stale.sqlite"
    _synthetic(stale, need, fingerprint="0" * 64)
    a = audit(stale)
    assert a["fresh"] and a["runtime"] and not a["coverage"]
    # Every other bucket missing: a coverage failure (the runtime would use a neighbour).
    partial = tmp_path / "partial.sqlite"
    _synthetic(partial, need[::2])
    a = audit(partial)
    assert a["coverage"] and not a["fresh"]
    # A whole format missing: nothing to fall back on at run time either.
    no_mx = tmp_path / "no_mx.sqlite"
    _synthetic(no_mx, [p for p in need if getattr(p, "fmt", None) != "mxfp4"])
    a = audit(no_mx)
    assert a["coverage"] and a["runtime"] and not a["fresh"]
    # K-Ext presum's own rows missing: a coverage failure even though the runtime would serve
    # the plain twins' winners as presum.
    no_presum = tmp_path / "no_presum.sqlite"
    _synthetic(no_presum, [p for p in need if not getattr(p, "kext_presum", False)])
    a = audit(no_presum)
    assert a["coverage"] and not a["fresh"]
