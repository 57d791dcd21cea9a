"""The interface every kernel family implements, its defaults, and the family registry.

A family (e.g. "linear_sm90_mma": the Hopper decode FP4 linear layer) ties together a variant
dataclass, its space and validity predicate, a Jinja2 template, the arguments CuTe DSL compiles
against, ONE launch path (`bind`: what the runtime serves) and a runner that prepares input
sets, checks a bound variant against the reference and times exactly that bound call. The
tuner, the database, the runtime and resgen.ops only ever talk to this interface.

Every registered family derives from `KernelFamilyBase` (register() refuses anything else). It
must define the members marked "required" below; the others are hooks whose defaults say what
a family without them gets, so callers make plain calls:
- `problem_invalid(problem) -> str | None`: why no variant can run the problem [None];
- `working_set_bytes(variant, problem) -> int`: bytes one input set occupies (sizes the
  cold-L2 rotation) [an estimate from the problem type];
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
  bounded cache. [not defined: runner(...) without inputs, each runner prepares its own];
- `warm(variant, problem) -> None`: CPU-only preparation the runner will need (e.g. compiling a
  helper kernel), called by the tuner before it takes the GPU lock [nothing];
- `prior(variant, problem) -> float`: lower first: the order in which candidates are tried
  when the budget is smaller than the space (e.g. a predicted time in microseconds); NaN or an
  exception means "no opinion" (tried last, space order) [not defined: the space order, or
  optuna];
- `model_problems(models, tp=, formats=, compensations=, m_buckets=) -> [problem] | None`: the
  workloads `resgen tune --model` plans for this family [None: derived from the linear
  layers by the CLI];
- `bind(compiled, variant, problem, ...) -> run`: the launch path of a compiled variant, shared
  by the runtime (resgen.ops) and the family's runner [a ValueError: no run-time path];
- `COMPILE_OPTIONS`, `TEMPLATE_DIR`, `ENTRY`, `compile_module(...)`: see resgen.search.build
  ["", resgen/templates, the module's ENTRY or `entry`, render + cute.compile of the entry].
`defines(hook)` says whether a family overrides a hook's default (the tuner ranks by a prior and
shares prepared inputs only where a family defines them; `resgen tune --plan` lists them).

Families are discovered, not listed: every module of resgen/search whose name names an arch
(`<op>_sm<NN>[a]`, optionally `_<suffix>`, e.g. `attention_sm90`, `linear_sm90_wgmma`) is a
family module and registers its family on import (tests/test_family_modules.py holds every
module to that convention).
"""

from __future__ import annotations

import warnings

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar, Protocol, Sequence, runtime_checkable

from .variant import LinearProblem, ProblemBase, VariantBase

__all__ = ["KernelFamily", "KernelFamilyBase", "LinearFamily", "Runner", "CheckResult",
           "compare", "register", "get_family", "families", "families_for", "FAMILY_MODULE"]


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
        """Run the whole timed operation once (e.g. activation quantization + GEMM + fold):
        the family's bound call, the one the runtime serves."""

    def check(self) -> CheckResult:
        """Fresh random inputs, poisoned outputs, compare with the reference."""

    def rotate(self, i: int) -> None:
        """Switch to input set i (cold-L2 rotation); sets are prepared up front."""


class KernelFamilyBase:
    """What every kernel family is: the required members (they raise NotImplementedError
    here) and the optional hooks with their defaults (see the module docstring)."""

    NAME: ClassVar[str]
    VARIANT: ClassVar[type[VariantBase]]
    PROBLEM: ClassVar[type[ProblemBase]]
    TEMPLATE: ClassVar[str]
    ARCHS: ClassVar[tuple[str, ...]]          # e.g. ("sm_90a",)
    COMPILE_OPTIONS: ClassVar[str] = ""       # extra cute.compile options (fingerprinted)
    EXPERIMENTAL: ClassVar[bool] = False      # opt-in through RESGEN_EXPERIMENTAL only
    TEMPLATE_DIR: ClassVar[Path | None] = None  # None: resgen/templates
    ENTRY: ClassVar[str | None] = None        # None: the rendered module's ENTRY, or "entry"

    # ------------------------------------------------------------------ required
    def space(self, problem: ProblemBase, arch: str) -> Sequence[VariantBase]:
        """Every candidate variant in a fixed, deterministic order (ties resolve to earlier)."""
        raise NotImplementedError

    def why_invalid(self, variant: VariantBase, problem: ProblemBase, arch: str) -> str | None:
        """None if the variant can run this problem on this arch, else the reason."""
        raise NotImplementedError

    def default(self, problem: ProblemBase, arch: str) -> VariantBase:
        """A safe variant valid for any problem the family accepts (the runtime's fallback)."""
        raise NotImplementedError

    def template_params(self, variant: VariantBase, problem: ProblemBase) -> dict[str, Any]:
        """Ints/bools/enum values the template renders with (never raw database strings)."""
        raise NotImplementedError

    def compile_key(self, variant: VariantBase, problem: ProblemBase) -> ProblemBase:
        """The part of the problem a compiled kernel is specialized on (e.g. with m dropped if
        M is a run-time argument), so one compile serves many M buckets."""
        raise NotImplementedError

    def compile_args(self, variant: VariantBase, problem: ProblemBase) -> list[Any]:
        """Arguments for cute.compile (fake tensors / constants): compiling needs no GPU."""
        raise NotImplementedError

    def runner(self, compiled: Any, variant: VariantBase, problem: ProblemBase,
               device: Any, n_sets: int = 1, seed: int = 0) -> Runner:
        """Prepare n_sets input sets on `device` and bind the compiled kernel (through
        `bind`, where the family has a run-time path)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ hooks
    def problem_invalid(self, problem: ProblemBase) -> str | None:
        """Why no variant of this family can run `problem` (None: some may). The default
        refuses W4A8 linear problems (FP8 activations), which only the FP8 tensor-core family
        (linear_sm90_fp8, which overrides this) computes."""
        if isinstance(problem, LinearProblem) and problem.compensation == "w4a8":
            return (f"{self.NAME} has no W4A8 (FP8-activation) kernels: W4A8 runs on "
                    f"linear_sm90_fp8 only")
        return None

    def working_set_bytes(self, variant: VariantBase, problem: ProblemBase) -> int:
        """Bytes one input set occupies (sizes the cold-L2 rotation): estimated from the
        problem type (linear: weights + operand rows + activations + output; decode
        attention: the NVFP4 KV cache + queries; activation-shaped problems: input plus twice
        its size written; anything else 0)."""
        d = problem.as_dict()
        if type(problem).OP == "linear":
            from ..formats import block_size

            fmt, k, n, m = d["fmt"], d["k"], d["n"], d["m"]
            kw = problem.k_ext(block_size(fmt)) if isinstance(problem, LinearProblem) else k
            per_weight = 0.5 + (1 / 16 if fmt == "nvfp4" else 1 / 32)
            rows = 2 * m if d.get("compensation") == "full" else m
            return int(n * kw * per_weight + rows * kw * 2 + m * k * 2 + m * n * 2)
        if type(problem).OP == "decode_attention":
            kv = d["batch"] * d["kv_len"] * d["kv_heads"] * d["head_dim"] * 2 * (0.5 + 1 / 16)
            return int(kv + d["batch"] * d["q_heads"] * d["head_dim"] * 4)
        if isinstance(d.get("m"), int) and isinstance(d.get("k"), int):
            # An activation-shaped problem (e.g. the quantizer): bf16 input plus up to twice its
            # size written (base + residue operand rows).
            return 6 * d["m"] * d["k"]
        return 0

    def prepare(self, problem: ProblemBase, device: Any, n_sets: int, seed: int) -> Any:
        """Input sets shared by the variants of one workload; only called where the family
        defines it (`defines("prepare")`)."""
        raise NotImplementedError(f"family {self.NAME} prepares no shared inputs")

    def warm(self, variant: VariantBase, problem: ProblemBase) -> None:
        """CPU-only work the runner will need, done before the GPU lock (none by default)."""

    def prior(self, variant: VariantBase, problem: ProblemBase) -> float:
        """Lower first; NaN = no opinion. Used only where the family defines it."""
        return math.nan

    def model_problems(self, models: Sequence[Any], *, tp: int, formats: Sequence[str],
                       compensations: Sequence[Any], m_buckets: Sequence[int]
                       ) -> list[ProblemBase] | None:
        """The workloads `resgen tune --model` plans for this family; None: derive them from
        the models' linear layers (resgen.cli)."""
        return None

    def bind(self, compiled: Any, variant: VariantBase, problem: ProblemBase,
             *args: Any, **kwargs: Any) -> Any:
        """The launch path of a compiled variant (what resgen.ops serves and the runner
        times). A family without one cannot be served."""
        raise ValueError(f"family {self.NAME} has no run-time path (bind)")

    def compile_module(self, path: Path, variant: VariantBase, problem: ProblemBase,
                       arch: str) -> Any:
        """Compile the rendered module at `path` (resgen.search.build.compile_variant's step):
        by default cute.compile of its entry with compile_args and COMPILE_OPTIONS. Returns a
        resgen.kernels.codegen.CompileResult."""
        from ..kernels import codegen
        from .build import compile_options, entry_of

        module = codegen.load_module(path)
        return codegen.compile_entry(entry_of(self, module), self.compile_args(variant, problem),
                                     arch, compile_options(self))

    # ------------------------------------------------------------------ introspection
    def defines(self, hook: str) -> bool:
        """Whether this family overrides KernelFamilyBase's default for `hook`."""
        if hook in vars(self):
            return True
        mine = getattr(type(self), hook, None)
        return mine is not None and mine is not getattr(KernelFamilyBase, hook, None)


# The type every caller names; a family is a KernelFamilyBase subclass.
KernelFamily = KernelFamilyBase


@runtime_checkable
class LinearFamily(Protocol):
    """What a linear-layer family adds for the runtime (resgen.ops.Linear): the weight in its
    layout and the bound whole layer (see resgen.search.sm90_linear for the Hopper ones)."""

    NAME: ClassVar[str]

    def layout(self, qweight: Any, packing: str) -> Any:
        """The prepared weight (resgen.calibrate.QLinearWeight) in this family's layout."""

    def needs_quantizer(self, variant: VariantBase) -> bool:
        """True where the variant reads a prepared operand (a layer quantizer in front)."""

    def quantizer_problem(self, problem: ProblemBase) -> ProblemBase:
        """The problem the layer quantizer in front of `problem`'s GEMM is built for (e.g. K
        rounded up to the quantizer's tiling); raises ValueError if none can serve it."""

    def bind(self, compiled: Any, variant: VariantBase, problem: ProblemBase, weight: Any,
             device: Any, *, quantizer: Any = None, alpha: Any = None, masks: Any = None
             ) -> Callable[[Any, Any], Any]:
        """run(xb, out): xb bf16 [M, K] contiguous -> out bf16 [M, N]."""


_REGISTRY: dict[str, KernelFamilyBase] = {}

# A family module's name: <op>_sm<NN>[letter][_<suffix>] (e.g. attention_sm90, quant_sm90,
# linear_sm90_wgmma); modules the families share name the arch first (sm90_linear).
FAMILY_MODULE = re.compile(r"^[a-z][a-z0-9]*(?:_[a-z0-9]+)*?_sm\d+[a-z]?(?:_[a-z0-9_]+)?$")
_DISCOVERED = False


def register(family: KernelFamilyBase) -> KernelFamilyBase:
    """Add a family to the registry (family modules call it on import)."""
    if not isinstance(family, KernelFamilyBase):
        raise TypeError(f"{type(family).__name__} is not a KernelFamilyBase: a kernel family "
                        "derives from resgen.search.family.KernelFamilyBase")
    _REGISTRY[family.NAME] = family
    return family


def family_modules() -> list[str]:
    """The family modules of resgen/search (by the naming convention above), sorted."""
    import pkgutil

    from . import __path__ as search_path

    return sorted(f"{__package__}.{m.name}" for m in pkgutil.iter_modules(search_path)
                  if FAMILY_MODULE.match(m.name))


def _load_builtin() -> None:
    # Family implementations live in resgen/search/<family module>.py (the search layer may
    # import resgen.kernels, never the reverse) and register themselves on import.
    global _DISCOVERED
    if _DISCOVERED:
        return
    import importlib

    for mod in family_modules():
        importlib.import_module(mod)
    _DISCOVERED = True


def get_family(name: str) -> KernelFamilyBase:
    _load_builtin()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown kernel family {name!r}; known: {sorted(_REGISTRY)}") from None


_WARNED_EXPERIMENTAL: set[frozenset[str]] = set()


def _experimental_families() -> list[str]:
    _load_builtin()
    return sorted(n for n, f in _REGISTRY.items() if f.EXPERIMENTAL)


def unknown_experimental() -> list[str]:
    """Names in RESGEN_EXPERIMENTAL (resgen.settings) that are no registered experimental
    family: a typo there opts nothing in, which families() warns about once."""
    from ..settings import settings

    return sorted(settings().experimental - set(_experimental_families()))


def families() -> dict[str, KernelFamilyBase]:
    """Every registered family by name: in registration order (family modules are imported
    in module-name order), the experimental (opt-in) ones last, so the first family of an op
    is one that serves by default (linear_sm90_fp8 sorts before linear_sm90_mma by name)."""
    bad = unknown_experimental()
    if bad and frozenset(bad) not in _WARNED_EXPERIMENTAL:
        _WARNED_EXPERIMENTAL.add(frozenset(bad))
        warnings.warn(f"RESGEN_EXPERIMENTAL names {bad}, which are no experimental kernel "
                      f"family (those are {_experimental_families()}): nothing is opted in "
                      "for them", stacklevel=2)
    return dict(sorted(_REGISTRY.items(), key=lambda kv: kv[1].EXPERIMENTAL))


def families_for(op: str, arch: str) -> list[KernelFamilyBase]:
    return [f for f in families().values() if f.PROBLEM.OP == op and arch in f.ARCHS]


Factory = Callable[[], KernelFamilyBase]
