"""A small fake kernel family registered only by the tests: a pure-Python "kernel" whose
runner reports deterministic fake timings, so the tuner, database, runtime and CLI are tested
without a GPU. Its template (tests/templates/fake_kernel.py.j2) is rendered, fingerprinted
and imported like a real one; compile failures and check failures are injected on purpose.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from resgen.kernels import codegen
from resgen.search.family import CheckResult, KernelFamilyBase, register
from resgen.search.timing import summarize
from resgen.search.variant import Choice, IntRange, ProblemBase, VariantBase

TEMPLATES = Path(__file__).resolve().parent / "templates"
COMPILES: list[tuple[str, str]] = []      # (variant key, compile-problem key) per real compile


class Pack(Choice):
    A = "a"
    B = "b"


@dataclass(frozen=True, slots=True)
class FakeVariant(VariantBase):
    FAMILY: ClassVar[str] = "fake_gemm"
    tile: int = dataclasses.field(default=8, metadata={"range": IntRange(8, 64, pow2=True)})
    stages: int = dataclasses.field(default=1, metadata={"range": IntRange(1, 4)})
    pack: Pack = Pack.A
    split: bool = False


@dataclass(frozen=True, slots=True)
class FakeProblem(ProblemBase):
    OP: ClassVar[str] = "fake_gemm"
    fmt: str = dataclasses.field(default="nvfp4", metadata={"allowed": ("nvfp4", "mxfp4")})
    compensation: str = dataclasses.field(
        default="none", metadata={"allowed": ("none", "full", "0.125", "0.25", "0.5", "1.0")})
    m: int = dataclasses.field(default=1, metadata={"range": IntRange(1, 1 << 20)})
    n: int = dataclasses.field(default=256, metadata={"range": IntRange(16, 1 << 20)})
    k: int = dataclasses.field(default=256, metadata={"range": IntRange(16, 1 << 20)})


def fake_us(v: FakeVariant, p: FakeProblem) -> float:
    """Deterministic 'time': best tile is the one nearest the row count, fewer stages cost
    a little less, split-K pays off only for long K."""
    rows = 2 * p.m if p.compensation == "full" else p.m
    t = p.n * p.k / 1e6 + 1.0
    t *= 1.0 + 0.3 * abs(math.log2(v.tile) - math.log2(max(8, min(64, rows))))
    t *= 1.0 + 0.05 * v.stages
    t *= 0.7 if (v.split and p.k >= 4096) else 1.0
    t *= 1.02 if v.pack is Pack.B else 1.0
    return round(t, 6)


class FakeRunner:
    def __init__(self, v: FakeVariant, p: FakeProblem, fn: Any, n_sets: int,
                 inputs: "FakeInputs | None" = None) -> None:
        self.v, self.p, self.fn, self.n_sets, self.set = v, p, fn, n_sets, 0
        self.calls = 0
        self.inputs = inputs
        if inputs is not None:
            # The prepare contract: inputs of this problem with at least n_sets sets.
            assert inputs.problem_key == p.key() and inputs.n_sets >= n_sets

    def rotate(self, i: int) -> None:
        assert 0 <= i < self.n_sets
        self.set = i

    def __call__(self) -> Any:
        self.calls += 1
        return self.fn([1, 2])

    def check(self) -> CheckResult:
        if HANG and self.v == FakeVariant(tile=8, stages=2, pack=Pack.A, split=False):
            import time

            time.sleep(3600)                           # a kernel that never finishes
        if KILL and self.v == FakeVariant(tile=8, stages=3, pack=Pack.A, split=False):
            import os
            import signal

            os.kill(os.getpid(), signal.SIGKILL)       # a segfaulting / killed tuner process
        if POISON and self.v == FakeVariant(tile=8, stages=4, pack=Pack.A, split=False):
            _POISONED[0] = True
            raise RuntimeError("CUDA error: an illegal memory access was encountered (fake)")
        if self.v.split and self.v.pack is Pack.B:
            return CheckResult(False, 0.5, 3e-3, "injected wrong answer (split with pack b)")
        return CheckResult(True, 1e-4, 3e-3)


def fake_timer(runner: FakeRunner, policy: Any, n_sets: int):
    """Stands in for timing.measure: three samples of the fake time, median = fake time."""
    t = fake_us(runner.v, runner.p)
    runner()
    return summarize([t * 0.999, t, t * 1.001], policy, launches=n_sets * 4, n_sets=n_sets,
                     mode="fake")


class FakeFamily(KernelFamilyBase):
    NAME: ClassVar[str] = "fake_gemm"
    VARIANT: ClassVar[type] = FakeVariant
    PROBLEM: ClassVar[type] = FakeProblem
    TEMPLATE: ClassVar[str] = "fake_kernel.py.j2"
    TEMPLATE_DIR: ClassVar[Path] = TEMPLATES
    ARCHS: ClassVar[tuple[str, ...]] = ("sm_90a", "sm_100a")

    def space(self, problem: FakeProblem, arch: str) -> list[FakeVariant]:
        return [FakeVariant(tile=t, stages=s, pack=pk, split=sp)
                for t in (8, 16, 32, 64) for s in (1, 2, 3, 4) for pk in Pack
                for sp in (False, True)]

    def why_invalid(self, v: FakeVariant, p: FakeProblem, arch: str) -> str | None:
        rows = 2 * p.m if p.compensation == "full" else p.m
        if v.tile > max(8, rows):
            return f"tile {v.tile} is wider than the {rows} token rows"
        if v.split and p.k % 1024:
            return f"split-K needs K % 1024 == 0 (K = {p.k})"
        if v.stages == 4 and arch == "sm_90a" and v.tile == 64:
            return "4 stages of 64-wide tiles exceed sm_90a shared memory"
        return None

    def default(self, p: FakeProblem, arch: str) -> FakeVariant:
        return FakeVariant()

    def template_params(self, v: FakeVariant, p: FakeProblem) -> dict[str, Any]:
        return {"tile": v.tile, "stages": v.stages, "pack": v.pack.value, "split": v.split,
                "n": p.n, "k": p.k}

    def compile_key(self, v: FakeVariant, p: FakeProblem) -> FakeProblem:
        return dataclasses.replace(p, m=1)         # M is a run-time argument

    def compile_args(self, v: FakeVariant, p: FakeProblem) -> list[Any]:
        return []

    def compile_module(self, path: Path, v: FakeVariant, p: FakeProblem, arch: str):
        COMPILES.append((v.key(), p.key()))
        mod = codegen.load_module(path)
        if mod.FAIL:
            raise RuntimeError(mod.FAIL)
        return codegen.CompileResult(mod.entry, None, mod.REGISTERS, 0, 0.001)

    def runner(self, compiled: Any, v: FakeVariant, p: FakeProblem, device: Any,
               n_sets: int = 1, seed: int = 0, inputs: "FakeInputs | None" = None
               ) -> FakeRunner:
        return FakeRunner(v, p, compiled, n_sets, inputs)


@dataclass
class FakeInputs:
    """What fake_prepare builds: stands for a problem's input sets and reference output."""

    problem_key: str
    n_sets: int
    seed: int


PREPARED: list[tuple[str, int]] = []        # (problem key, n_sets) per fake_prepare call


def fake_prepare(self: FakeFamily, problem: FakeProblem, device: Any, n_sets: int,
                 seed: int) -> FakeInputs:
    """The optional `prepare` hook (attached by tests, or by FAKEFAM_PREPARE=1)."""
    PREPARED.append((problem.key(), n_sets))
    return FakeInputs(problem.key(), n_sets, seed)


def fake_prior(self: FakeFamily, v: FakeVariant, p: FakeProblem) -> float:
    """The optional `prior` hook: a perfect predictor (the fake time itself)."""
    return fake_us(v, p)


FAMILY = register(FakeFamily())
if __import__("os").environ.get("FAKEFAM_PREPARE"):
    FakeFamily.prepare = fake_prepare
if __import__("os").environ.get("FAKEFAM_PRIOR"):
    FakeFamily.prior = fake_prior

# FAKEFAM_POISON=1: the variant (tile 8, 4 stages, pack a, no split) "breaks the CUDA context"
# of the process that runs it (the tuner's health check then fails), to test that a tuner
# process is replaced and the run goes on.
POISON = bool(__import__("os").environ.get("FAKEFAM_POISON"))
KILL = bool(__import__("os").environ.get("FAKEFAM_KILL"))      # (8, 3, a, no split) dies
HANG = bool(__import__("os").environ.get("FAKEFAM_HANG"))      # (8, 2, a, no split) hangs
_POISONED = [False]
if POISON:
    import resgen.search.tuner as _tuner

    _tuner._device_healthy = lambda device: not _POISONED[0]


def make_env(gpu_name: str = "Fake GPU", arch: str = "sm_90a", compile_only: bool = False):
    from resgen.search.record import Environment

    return Environment(gpu_name=gpu_name, arch=arch, compute_capability="9.0", sm_count=132,
                       driver="999.0", cuda="13.0", torch="t", cute_dsl="c", resgen="r",
                       compile_only=compile_only)


def tune_fake(db_path: Path, ms=(1, 4, 16, 64), *, env=None, k: int = 4096, n: int = 256,
              compensation: str = "none", timer=fake_timer, **config: Any):
    """Tune the fake family for several M buckets into db_path; returns the summaries."""
    import functools

    from resgen.db import TuningDB
    from resgen.search.tuner import Job, TuneConfig, run_jobs

    env = env or make_env()
    cfg = TuneConfig(arch=env.arch, compile_only=env.compile_only, **config)
    jobs = [Job(FakeFamily.NAME, FakeProblem(m=m, n=n, k=k, compensation=compensation).key())
            for m in ms]
    return run_jobs(jobs, functools.partial(TuningDB, db_path), env, cfg, timer=timer)


import pytest  # noqa: E402  (fixtures below are imported by the test modules)


@pytest.fixture(autouse=False)
def isolated_cache(tmp_path, monkeypatch):
    """Rendered modules and the user's database under tmp_path; no RESGEN_DB leaks in."""
    from resgen.settings import settings

    monkeypatch.setenv("RESGEN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("RESGEN_DB", raising=False)
    monkeypatch.setenv("RESGEN_TUNED_DIR", str(tmp_path / "tuned"))
    settings.cache_clear()
    yield tmp_path
    settings.cache_clear()


def writer_main(db_path: str, tag: str, count: int) -> None:
    """Write `count` results (forever if count < 0) as fast as possible, printing
    "committed <i>" after each commit returns (used by the concurrency and SIGKILL tests)."""
    import sys

    from resgen.db import TuningDB
    from resgen.search.record import ResultRecord, Status

    env = make_env(gpu_name=f"Fake GPU {tag}")
    db = TuningDB(db_path, busy_timeout_s=120)
    i = 0
    while count < 0 or i < count:
        p = FakeProblem(m=1 + i % 1000, n=16 * (1 + i // 1000), k=4096)
        v = FakeVariant(tile=8, stages=1 + i % 4)
        med = 1.0 + i
        db.record(ResultRecord(problem=p, variant=v, environment=env, fingerprint=f"fp-{tag}",
                               status=Status.OK, space_index=i % 7, median_us=med,
                               q10_us=med, q90_us=med, samples_us=[med] * 50, launches=64,
                               n_sets=4, timing_mode="graph", policy={"tie_rel": 0.01},
                               rel_err=1e-4, error="x" * 2000))
        print(f"committed {i}", flush=True)
        sys.stdout.flush()
        i += 1
    db.close()


def subprocess_env() -> dict:
    import os

    env = dict(os.environ)
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join([root, str(Path(__file__).resolve().parent),
                                         env.get("PYTHONPATH", "")])
    return env
