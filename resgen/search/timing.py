"""Measurement: a named, recorded policy and the CUDA-graph, cold-L2 timer.

Policy "cold-l2-graph" (stored, as a dict, with every timing):
- cold L2: the runner holds `n_sets` complete input sets (weights or KV included) whose total
  size is at least `flush_factor` x the L2 size (the H200 has 60 MB of L2), and consecutive
  launches cycle through them, so a launch never finds its operands left in L2 by the previous
  launch of the same set;
- one CUDA graph holds `launches` launches (a multiple of n_sets), so the few-microsecond
  decode kernels are not timed with the CPU's launch overhead in between;
- `warmup_replays` replays are discarded; `repetitions` replays are each timed by a pair of
  CUDA events; a sample is replay time / launches;
- the statistic is the median of the samples; the quantiles and every sample are kept.

Two named policies: DEFAULT_POLICY ("cold-l2-graph", what `resgen bench` and the benchmark
scripts report) and TUNE_POLICY ("cold-l2-graph-tune", what `resgen tune` ranks variants with:
the same cold-L2 rotation and graph replay, fewer launches per graph and five repetitions, so
one variant costs a few milliseconds of GPU time; still a median with quantiles). Every timing
stores the full policy dict, so rows from either can be told apart in the database.

The runner (resgen.search.family.Runner) must launch its kernels on
`torch.cuda.current_stream()`: graph capture records only that stream. If capture fails, the
same loop is timed eagerly and the timing says mode="eager" (CPU launch gaps included).
"""

from __future__ import annotations

import gc
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Mapping, Sequence

from .variant import sha256_json

__all__ = ["MeasurementPolicy", "DEFAULT_POLICY", "TUNE_POLICY", "POLICIES", "policy_named",
           "Timing", "summarize", "quantile", "measure", "CallableRunner", "capture_graph",
           "capture_with_retry"]


@dataclass(frozen=True)
class MeasurementPolicy:
    """How a variant is timed; see the module docstring."""

    name: str = "cold-l2-graph"
    version: int = 1
    l2_bytes: int = 60 * 1000 * 1000       # H200: 60 MB of L2
    flush_factor: float = 2.0              # rotated bytes >= flush_factor x L2
    max_sets: int = 64
    target_replay_us: float = 2000.0       # launches per graph chosen to fill about this much
    min_launches: int = 16
    max_launches: int = 512
    warmup_replays: int = 2
    repetitions: int = 7                   # BENCH.md: median of >= 5 repetitions
    quantiles: tuple[float, ...] = (0.1, 0.5, 0.9)
    tie_rel: float = 0.01                  # medians within 1% are ties (fixed order decides)
    graph: bool = True

    def __post_init__(self) -> None:
        if self.repetitions < 1 or self.warmup_replays < 0:
            raise ValueError("repetitions must be >= 1 and warmup_replays >= 0")
        if not (1 <= self.min_launches <= self.max_launches):
            raise ValueError("need 1 <= min_launches <= max_launches")
        if self.max_sets < 1 or self.flush_factor <= 0 or self.l2_bytes <= 0:
            raise ValueError("max_sets, flush_factor and l2_bytes must be positive")
        if not all(0.0 <= q <= 1.0 for q in self.quantiles):
            raise ValueError("quantiles must lie in [0, 1]")
        from .record import MAX_TIE_REL

        if not 0.0 <= self.tie_rel <= MAX_TIE_REL:     # what the winner rule accepts
            raise ValueError(f"tie_rel must lie in [0, {MAX_TIE_REL}]")

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["quantiles"] = list(self.quantiles)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "MeasurementPolicy":
        if not isinstance(d, Mapping):
            raise ValueError("a policy must be a mapping")
        names = set(cls.__dataclass_fields__)
        if set(d) != names:
            raise ValueError(f"policy fields {sorted(d)} != {sorted(names)}")
        kw = dict(d)
        kw["quantiles"] = tuple(float(q) for q in kw["quantiles"])
        return cls(**kw)

    @property
    def label(self) -> str:
        """name@v<version>:<digest8>, e.g. for tables; the full dict is what gets stored."""
        return f"{self.name}@v{self.version}:{sha256_json(self.as_dict())[:8]}"

    def sets_for(self, bytes_per_set: int | None) -> int:
        """Input sets needed so that the rotated bytes exceed flush_factor x L2."""
        if bytes_per_set is None or bytes_per_set <= 0:
            return self.max_sets
        need = math.ceil(self.flush_factor * self.l2_bytes / bytes_per_set)
        return max(1, min(self.max_sets, need))

    def launches_for(self, est_launch_us: float, n_sets: int) -> int:
        """Launches per graph: about target_replay_us of work, a multiple of n_sets."""
        if n_sets < 1:
            raise ValueError("n_sets must be >= 1")
        want = self.target_replay_us / max(est_launch_us, 1e-3)
        n = int(min(self.max_launches, max(self.min_launches, math.ceil(want))))
        n = max(n, n_sets)
        return -(-n // n_sets) * n_sets


DEFAULT_POLICY = MeasurementPolicy()

# Ranking variants needs less than reporting a number: a graph of about 400 us of work (at
# least 8 launches, at most 128; still a multiple of the input sets, so every launch reads
# operands that are not in L2), one warm-up replay and five timed replays (BENCH.md: median of
# at least 5). Medians within 2 % are ties (the fixed space order decides), twice the
# benchmark policy's band because five samples are noisier than seven.
# Version 2 (2026-11-30): the tuner times linear layers whole (quantizer + GEMM for variants
# that read a prepared operand, see resgen.search.tuner); version-1 rows timed the GEMM alone.
TUNE_POLICY = MeasurementPolicy(name="cold-l2-graph-tune", version=2, target_replay_us=400.0,
                                min_launches=8, max_launches=128, warmup_replays=1,
                                repetitions=5, tie_rel=0.02)

POLICIES: dict[str, MeasurementPolicy] = {"bench": DEFAULT_POLICY, "tune": TUNE_POLICY}


def policy_named(name: str) -> MeasurementPolicy:
    """"bench" or "tune" (or a policy's own name, e.g. "cold-l2-graph-tune")."""
    for key, pol in POLICIES.items():
        if name in (key, pol.name):
            return pol
    raise ValueError(f"unknown measurement policy {name!r}; known: {sorted(POLICIES)}")


def quantile(sorted_xs: Sequence[float], q: float) -> float:
    """Linear-interpolation quantile of sorted data (numpy's default method)."""
    if not sorted_xs:
        raise ValueError("quantile of no samples")
    pos = q * (len(sorted_xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_xs) - 1)
    return float(sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (pos - lo))


@dataclass(frozen=True)
class Timing:
    """Per-launch times in microseconds."""

    median_us: float
    quantiles_us: dict[str, float]
    samples_us: tuple[float, ...]
    launches: int
    n_sets: int
    mode: str                          # "graph" | "eager"
    policy: dict[str, Any] = field(default_factory=dict)
    note: str = ""

    def quantile_us(self, q: float) -> float | None:
        return self.quantiles_us.get(_qname(q))


def _qname(q: float) -> str:
    return f"q{round(q * 100):02d}"


def summarize(samples_us: Sequence[float], policy: MeasurementPolicy = DEFAULT_POLICY,
              *, launches: int, n_sets: int, mode: str, note: str = "") -> Timing:
    """Statistics of per-launch samples under `policy`."""
    xs = sorted(float(s) for s in samples_us)
    if not xs:
        raise ValueError("no samples")
    if any(not math.isfinite(s) or s <= 0 for s in xs):
        raise ValueError(f"samples must be finite and positive, got {xs}")
    return Timing(median_us=quantile(xs, 0.5),
                  quantiles_us={_qname(q): quantile(xs, q) for q in policy.quantiles},
                  samples_us=tuple(float(s) for s in samples_us), launches=launches,
                  n_sets=n_sets, mode=mode, policy=policy.as_dict(), note=note)


def capture_graph(runner: Any, n_sets: int, launches: int):
    """A CUDA graph of `launches` runner calls (rotating over `n_sets` input sets), after one
    warm-up call on a side stream; Python's collector is run first and kept off during the
    capture (see below)."""
    import torch

    # Warm up on a side stream before capture (as torch.cuda.graphs recommends) so lazy
    # initialisation inside the runner does not happen during capture.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        runner.rotate(0)
        runner()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    # No Python garbage collection during the capture: a collected object whose finalizer
    # releases a CUDA resource (a compiled kernel's module, say) makes a call that global
    # capture mode forbids, and the capture fails. Collect now instead (torch.cuda.graph no
    # longer does by default).
    gc.collect()
    graph = torch.cuda.CUDAGraph()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph):
            for j in range(launches):
                runner.rotate(j % n_sets)
                runner()
    finally:
        if was_enabled:
            gc.enable()
    torch.cuda.synchronize()
    return graph


def capture_with_retry(capture: Callable[[], Any], sync: Callable[[], None],
                       attempts: int = 2) -> tuple[Any, str]:
    """(graph, note): `capture()` tried up to `attempts` times; a failure is recorded in the
    note and followed by `sync()`. None when every attempt failed (the caller times eagerly,
    which stays valid). Why: a capture fails when something outside it breaks global capture
    mode (on the H200: a dead kernel's finalizer run by Python's collector, which capture_graph
    now prevents; README, "CUDA graphs"); the retry keeps a timing run going if anything
    else does."""
    notes: list[str] = []
    for attempt in range(attempts):
        try:
            return capture(), " ".join(notes)
        except Exception as e:     # recorded in the timing
            what = "timed eagerly" if attempt == attempts - 1 else "retried"
            notes.append(f"graph capture failed, {what}: {type(e).__name__}: {e}"[:240])
            sync()
    return None, " ".join(notes)


def _time_calls(fn, reps: int) -> list[float]:
    """Milliseconds of `reps` calls of fn, each between its own pair of CUDA events."""
    import torch

    out = []
    for _ in range(reps):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end))
    return out


class CallableRunner:
    """The runner `measure` needs, over prepared zero-argument callables: one per input set,
    rotate(i) selects set i % len (baselines such as torch.matmul on n_sets operand sets)."""

    def __init__(self, fns: Sequence[Callable[[], Any]]) -> None:
        self.fns, self.i = list(fns), 0

    def rotate(self, i: int) -> None:
        self.i = i % len(self.fns)

    def __call__(self) -> Any:
        return self.fns[self.i]()


def measure(runner: Any, policy: MeasurementPolicy = DEFAULT_POLICY, n_sets: int = 1
            ) -> Timing:
    """Time `runner` (prepared with `n_sets` input sets) under `policy` on the current GPU."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("measure() needs a CUDA GPU")
    if n_sets < 1:
        raise ValueError("n_sets must be >= 1")

    def eager_loop(count: int):
        def run() -> None:
            for j in range(count):
                runner.rotate(j % n_sets)
                runner()
        return run

    # Eager warm-up over every set, then a rough per-launch estimate to size the graph from
    # the best of two 4-launch loops (sets 0..3 may now sit in L2: an under-estimate only
    # lengthens the graph, within max_launches; 4 launches keep the probe cheap when there
    # are 64 small sets).
    eager_loop(n_sets)()
    torch.cuda.synchronize()
    probe = 4
    est_us = min(_time_calls(eager_loop(probe), 2)) * 1000.0 / probe
    launches = policy.launches_for(est_us, n_sets)

    mode, note, run = "eager", "", eager_loop(launches)
    if policy.graph:
        graph, note = capture_with_retry(lambda: capture_graph(runner, n_sets, launches),
                                         torch.cuda.synchronize)
        if graph is not None:
            mode, run = "graph", graph.replay
    for _ in range(policy.warmup_replays):
        run()
    torch.cuda.synchronize()
    samples = [ms * 1000.0 / launches for ms in _time_calls(run, policy.repetitions)]
    return summarize(samples, policy, launches=launches, n_sets=n_sets, mode=mode, note=note)
