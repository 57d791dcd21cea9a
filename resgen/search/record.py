"""What one tuning step produces: the environment it ran in and one result record.

The tuner (this layer) produces records; the dispatch database (resgen.db, a higher layer)
stores them and the runtime reads them back. The winner rule lives here so that the tuner's
summary, `resgen show` and the runtime agree: the lowest median wins, and results within the
policy's relative noise band of it are ties, resolved by the family's fixed space order.
"""

from __future__ import annotations

import platform
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from .. import __version__
from ..settings import arch_of_capability  # noqa: F401  (re-exported: one definition)
from .variant import ProblemBase, VariantBase, sha256_json

__all__ = ["Environment", "current_environment", "compile_only_environment", "gpu_slug",
           "arch_of_capability", "Status", "ResultRecord", "pick_winner", "MAX_TIE_REL",
           "MAX_MEDIAN_US", "DEFAULT_TIE_REL", "StoredTiming", "stored_timing"]


class Status:
    """Result status values (a result row's `status` column)."""

    OK = "ok"                          # checked against the reference, then timed
    COMPILED = "compiled"              # compile-only pre-flight: compiled, never run
    COMPILE_FAILED = "compile_failed"  # rendering or compiling raised
    CHECK_FAILED = "check_failed"      # ran, but the output disagreed with the reference
    RUN_FAILED = "run_failed"          # preparing inputs, running or timing raised

    ALL = (OK, COMPILED, COMPILE_FAILED, CHECK_FAILED, RUN_FAILED)


def gpu_slug(gpu_name: str) -> str:
    """"NVIDIA H200" -> "h200" (the shipped table's file stem, tuned/<slug>.sqlite)."""
    words = [w for w in gpu_name.replace("-", " ").split() if w.upper() != "NVIDIA"]
    if not words:
        raise ValueError(f"cannot derive a table name from GPU name {gpu_name!r}")
    return "".join(c for c in words[0].lower() if c.isalnum())


@dataclass(frozen=True)
class Environment:
    """Where results were produced. `digest` identifies it in the database."""

    gpu_name: str
    arch: str
    compute_capability: str
    sm_count: int
    driver: str
    cuda: str
    torch: str
    cute_dsl: str
    resgen: str
    compile_only: bool

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def digest(self) -> str:
        return sha256_json(self.as_dict())

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Environment":
        names = set(cls.__dataclass_fields__)
        if set(d) != names:
            raise ValueError(f"environment fields {sorted(d)} != {sorted(names)}")
        return cls(**{k: d[k] for k in names})


def _versions() -> dict[str, str]:
    from ..kernels.codegen import cute_dsl_version

    try:
        import torch

        tv = str(torch.__version__)
    except Exception:          # the database layer can be used without torch
        tv = "absent"
    return {"torch": tv, "cute_dsl": cute_dsl_version(), "resgen": __version__}


def compile_only_environment(arch: str) -> Environment:
    """The environment of a compile-only pre-flight (no GPU; nothing timed)."""
    v = _versions()
    return Environment(gpu_name=f"none (compile-only, {platform.machine()})", arch=arch,
                       compute_capability="", sm_count=0, driver="", cuda="",
                       torch=v["torch"], cute_dsl=v["cute_dsl"], resgen=v["resgen"],
                       compile_only=True)


def _driver_version() -> str:
    try:
        from cuda.bindings import driver

        (err,) = driver.cuInit(0)
        err, ver = driver.cuDriverGetVersion()
        if int(err) == 0:
            return f"{ver // 1000}.{(ver % 1000) // 10}"
    except Exception:
        pass
    return "unknown"


def current_environment(device: int = 0) -> Environment:
    """Facts of CUDA device `device` (needs a GPU)."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("current_environment() needs a CUDA GPU")
    props = torch.cuda.get_device_properties(device)
    v = _versions()
    return Environment(gpu_name=props.name, arch=arch_of_capability(props.major, props.minor),
                       compute_capability=f"{props.major}.{props.minor}",
                       sm_count=int(props.multi_processor_count), driver=_driver_version(),
                       cuda=str(torch.version.cuda), torch=v["torch"], cute_dsl=v["cute_dsl"],
                       resgen=v["resgen"], compile_only=False)


@dataclass
class ResultRecord:
    """One (workload, variant, fingerprint, environment) outcome; timings in microseconds."""

    problem: ProblemBase
    variant: VariantBase
    environment: Environment
    fingerprint: str
    status: str
    space_index: int
    median_us: float | None = None
    q10_us: float | None = None
    q90_us: float | None = None
    samples_us: Sequence[float] = ()
    launches: int | None = None
    n_sets: int | None = None
    timing_mode: str | None = None
    policy: Mapping[str, Any] = field(default_factory=dict)
    rel_err: float | None = None
    error: str | None = None
    registers: int | None = None
    spill_bytes: int | None = None
    compile_s: float | None = None
    # Seconds the tuner spent on this variant by phase ("compile", "wait" for the GPU lock,
    # "prep" of inputs, reference "check", "time"): where a tuning run's time goes.
    phase_s: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.status not in Status.ALL:
            raise ValueError(f"status {self.status!r} is not one of {Status.ALL}")
        if self.status == Status.OK and (self.median_us is None or not self.median_us > 0):
            raise ValueError("an ok result needs a positive median_us")


# Range checks on what a stored row says (a table is untrusted input): a tie band outside
# [0, MAX_TIE_REL] would let one row decide by space order alone (1e9) or empty the tie set
# (negative, NaN); a median must be a positive finite number of microseconds.
DEFAULT_TIE_REL = 0.01
MAX_TIE_REL = 0.25
MAX_MEDIAN_US = 1e9                 # 1000 s for one launch: anything above is not a timing
_MAX_INDEX = 1 << 31
_MAX_POLICY_VERSION = 1 << 20


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def check_tie_rel(x: Any) -> float:
    """A stored or given tie band, range-checked: a number in [0, MAX_TIE_REL]."""
    if not _number(x) or not 0.0 <= float(x) <= MAX_TIE_REL:   # NaN fails the comparison
        raise ValueError(f"tie_rel {x!r} is not a number in [0, {MAX_TIE_REL}]")
    return float(x)


@dataclass(frozen=True)
class StoredTiming:
    """The numbers of one stored timed row the winner rule reads, range-checked."""

    median_us: float
    space_index: int
    tie_rel: float
    policy: tuple[int, str]          # (version, name) of the measurement policy


def stored_timing(row: Mapping[str, Any]) -> StoredTiming:
    """Parse and range-check a stored "ok" row's median_us, space_index and policy (JSON text
    or a mapping with tie_rel, version, name; missing keys take their defaults). Raises
    ValueError naming the bad field: the caller skips the row (one bad row never decides or
    breaks a lookup)."""
    import json
    import math

    med = row.get("median_us")
    if not _number(med) or not (0.0 < float(med) <= MAX_MEDIAN_US) or \
            not math.isfinite(float(med)):
        raise ValueError(f"median_us {med!r} is not a positive number of microseconds")
    idx = row.get("space_index")
    if isinstance(idx, bool) or not isinstance(idx, int) or not 0 <= idx < _MAX_INDEX:
        raise ValueError(f"space_index {idx!r} is not a non-negative int")
    raw = row.get("policy")
    if raw is None or raw == "":
        pol: Any = {}
    elif isinstance(raw, Mapping):
        pol = raw
    else:
        try:
            pol = json.loads(raw)
        except (TypeError, ValueError, RecursionError):
            raise ValueError("policy is not JSON") from None
    if not isinstance(pol, Mapping):
        raise ValueError(f"policy is a JSON {type(pol).__name__}, not an object")
    tie = check_tie_rel(pol.get("tie_rel", DEFAULT_TIE_REL))
    ver = pol.get("version", 0)
    if isinstance(ver, bool) or not isinstance(ver, int) or not 0 <= ver < _MAX_POLICY_VERSION:
        raise ValueError(f"policy version {ver!r} is not a non-negative int")
    name = pol.get("name", "")
    if not isinstance(name, str) or len(name) > 200:
        raise ValueError("policy name is not a short string")
    return StoredTiming(float(med), idx, tie, (ver, name))


def pick_winner(rows: Iterable[Mapping[str, Any]], tie_rel: float = DEFAULT_TIE_REL
                ) -> Mapping[str, Any] | None:
    """The winning row among timed rows (keys "median_us", "space_index").

    Lowest median; any row within `tie_rel` (relative) of it is a tie, and ties go to the
    lowest space_index (the family's fixed order), so noise never flips a near-tie winner;
    then the lower median; last the row's content (its "tiebreak" text, else family and
    variant key), so that the answer depends only on which rows there are, never on their
    order (every rank of a tensor-parallel group must dispatch the same variant: rows of two
    families of one op can share a space index and a median).
    tie_rel must lie in [0, MAX_TIE_REL] (ValueError otherwise); rows whose median is not a
    positive finite number take no part.
    """
    import math

    tie_rel = check_tie_rel(tie_rel)
    timed = [r for r in rows if _number(r.get("median_us"))
             and math.isfinite(float(r["median_us"])) and float(r["median_us"]) > 0]
    if not timed:
        return None
    best = min(float(r["median_us"]) for r in timed)
    near = [r for r in timed if float(r["median_us"]) <= best * (1.0 + tie_rel)]
    return min(near, key=lambda r: (int(r["space_index"]), float(r["median_us"]),
                                    _content(r)))


def _content(row: Mapping[str, Any]) -> str:
    t = row.get("tiebreak")
    if t is not None:
        return str(t)
    return f"{row.get('family', '')}\0{row.get('variant_key', row.get('key', ''))}"
