"""The interface every kernel family implements, and the family registry.

A family (e.g. "linear_sm90_mma": the Hopper decode FP4 linear layer) ties together a variant
dataclass, its space and validity predicate, a Jinja2 template, the arguments CuTe DSL compiles
against, and a runner that prepares real inputs, checks a variant against the reference and
times it. The tuner, the database and the runtime only ever talk to this interface.

Optional hooks: a family may define any of these; callers look them up with getattr and fall
back to the behaviour in brackets, so families that lack them keep working unchanged.
- `working_set_bytes(variant, problem) -> int`: bytes one input set occupies (sizes the
  cold-L2 rotation) [an estimate from the problem type, resgen.search.tuner];
- `prepare(problem, device, n_sets, seed) -> inputs`: build the problem's input sets once
  (weights, activations, the check's fresh inputs and reference output, anything opaque to
  the caller). The tuner then calls `runner(compiled, variant, problem, device, n_sets=n,
  seed=seed, inputs=inputs)` for every variant of that workload, with n <= the n_sets the
  inputs were prepared for (the runner uses the first n sets). The check must still run the
  variant on inputs that are not among the timed sets, into a freshly poisoned output, and
  compare with the reference; a reference computed once inside `inputs` and shared by the
  variants is fine. The tuner drops `inputs` when the workload is done (or right after the
  variant when n_sets x working_set_bytes exceeds TuneConfig.keep_inputs_bytes); a family
  may keep what workloads share (e.g. one weight for every M bucket of a shape) in its own
  bounded cache. [runner(...) without inputs: each runner prepares its own];
- `warm(variant, problem) -> None`: CPU-only preparation the runner will need (e.g. compiling a
  helper kernel), called by the tuner before it takes the GPU lock.
- `prior(variant, problem) -> float`: lower first: the order in which candidates are tried
  when the budget is smaller than the space (e.g. a predicted time in microseconds); NaN or an
  exception means "no opinion" (tried last, space order) [the space order, or optuna];
- `model_problems(models, tp=, formats=, compensations=, m_buckets=) -> [problem]`: the
  workloads `resgen tune --model` plans for this family [derived from the linear layers];
- `COMPILE_OPTIONS`, `TEMPLATE_DIR`, `ENTRY`, `compile_module(...)`: see resgen.search.build.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Protocol, Sequence, runtime_checkable

from .variant import ProblemBase, VariantBase

__all__ = ["KernelFamily", "Runner", "CheckResult", "compare", "register", "get_family",
           "families", "families_for"]


@dataclass
class CheckResult:
    """Outcome of comparing one variant's output with the reference."""

    ok: bool
    rel_err: float          # ||out - ref|| / ||ref||
    tolerance: float
    detail: str = ""        # why it failed (NaN, unwritten outputs, error too large, ...)


def compare(out: Any, ref: Any, tol: float) -> CheckResult:
    """A kernel's output against its reference: ||out - ref|| / ||ref|| <= tol, and no NaN /
    Inf anywhere (outputs are poisoned before a check, so an element left unwritten fails).
    out, ref: torch tensors of one shape (any float dtype; compared in float64)."""
    import math

    o = out.float()
    bad = int((~o.isfinite()).sum())
    if bad:
        return CheckResult(False, math.inf, tol, f"{bad} of {o.numel()} outputs NaN/Inf "
                                                 "(unwritten or overflow)")
    den = float(ref.double().norm())
    rel = float((o.double() - ref.double()).norm()) / den if den else float(o.abs().max())
    ok = rel <= tol
    return CheckResult(ok, rel, tol, "" if ok else f"rel err {rel:.3e} > {tol}")


@runtime_checkable
class Runner(Protocol):
    """A compiled variant bound to prepared inputs for one problem on one device."""

    def __call__(self) -> Any:
        """Run the whole timed operation once (e.g. activation quantization + GEMM + fold)."""

    def check(self) -> CheckResult:
        """Fresh random inputs, poisoned outputs, compare with the reference."""

    def rotate(self, i: int) -> None:
        """Switch to input set i (cold-L2 rotation); sets are prepared up front."""


class KernelFamily(Protocol):
    NAME: ClassVar[str]
    VARIANT: ClassVar[type[VariantBase]]
    PROBLEM: ClassVar[type[ProblemBase]]
    TEMPLATE: ClassVar[str]
    ARCHS: ClassVar[tuple[str, ...]]          # e.g. ("sm_90a",)

    def space(self, problem: ProblemBase, arch: str) -> Sequence[VariantBase]:
        """Every candidate variant in a fixed, deterministic order (ties resolve to earlier)."""

    def why_invalid(self, variant: VariantBase, problem: ProblemBase, arch: str) -> str | None:
        """None if the variant can run this problem on this arch, else the reason."""

    def default(self, problem: ProblemBase, arch: str) -> VariantBase:
        """A safe variant valid for any problem the family accepts (the runtime's fallback)."""

    def template_params(self, variant: VariantBase, problem: ProblemBase) -> dict[str, Any]:
        """Ints/bools/enum values the template renders with (never raw database strings)."""

    def compile_key(self, variant: VariantBase, problem: ProblemBase) -> ProblemBase:
        """The part of the problem a compiled kernel is specialized on (e.g. with m dropped if
        M is a run-time argument), so one compile serves many M buckets."""

    def compile_args(self, variant: VariantBase, problem: ProblemBase) -> list[Any]:
        """Arguments for cute.compile (fake tensors / constants): compiling needs no GPU."""

    def runner(self, compiled: Any, variant: VariantBase, problem: ProblemBase,
               device: Any, n_sets: int = 1, seed: int = 0) -> Runner:
        """Prepare n_sets input sets on `device` and bind the compiled kernel."""


_REGISTRY: dict[str, KernelFamily] = {}


def register(family: KernelFamily) -> KernelFamily:
    _REGISTRY[family.NAME] = family
    return family


_BUILTIN = ("resgen.search.linear_sm90", "resgen.search.quant_sm90",
            "resgen.search.attention_sm90", "resgen.search.linear_sm90_wgmma",
            "resgen.search.linear_sm100_tc", "resgen.search.quant_sm100")


def _load_builtin() -> None:
    # Family implementations live in resgen/search/<family>.py (the search layer may import
    # resgen.kernels, never the reverse) and register themselves on import.
    import importlib

    for mod in _BUILTIN:
        try:
            importlib.import_module(mod)
        except ModuleNotFoundError as e:   # a family not written yet
            if e.name != mod:
                raise


def get_family(name: str) -> KernelFamily:
    _load_builtin()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown kernel family {name!r}; known: {sorted(_REGISTRY)}") from None


def families() -> dict[str, KernelFamily]:
    _load_builtin()
    return dict(_REGISTRY)


def families_for(op: str, arch: str) -> list[KernelFamily]:
    return [f for f in families().values() if f.PROBLEM.OP == op and arch in f.ARCHS]


Factory = Callable[[], KernelFamily]
