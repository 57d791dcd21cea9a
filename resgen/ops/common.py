"""What the run-time ops share: the device check (a CUDA GPU of an arch resgen has kernels
for), choosing the variant for a problem (a pinned variant, checked with its family's
predicate, or the dispatch tables through resgen.runtime) and compiling it once per
process."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..search.family import KernelFamily
from ..search.variant import ProblemBase

if TYPE_CHECKING:
    import torch

__all__ = ["compile_cached", "choose_variant", "MAX_PLANS", "require_cuda_device",
           "SUPPORTED_GPUS", "UnsupportedDeviceError"]

MAX_PLANS = 256     # per op instance: shape classes whose plans (and buffers) are kept, LRU

_COMPILED: dict[tuple, Any] = {}

# The archs resgen's kernels are compiled for, with the GPUs that run them. sm_90a code runs
# only on compute capability 9.0 (arch-specific "a" targets are not forward compatible).
SUPPORTED_GPUS: dict[str, tuple[tuple[int, int], str]] = {
    "sm_90a": ((9, 0), "Hopper: H100, H200, H20, GH200"),
}
_CHECKED: dict[tuple[int, str], None] = {}


class UnsupportedDeviceError(RuntimeError):
    """No CUDA GPU, a CPU device, or a GPU the op's kernels cannot run on."""


def _supported_text(arch: str) -> str:
    cap, gpus = SUPPORTED_GPUS[arch]
    return f"{arch}: {gpus}, compute capability {cap[0]}.{cap[1]}"


def require_cuda_device(device: Any, arch: str, *, what: str = "this op",
                        simulated: bool = False) -> "torch.device":
    """The device an op runs on (device=None: the current CUDA device), checked once per
    (device, arch): a CUDA device whose compute capability runs `arch`'s kernels, else
    UnsupportedDeviceError naming the GPUs that do. simulated=True (the CPU tests stand
    simulations in for the kernels) skips the check: any device, CPU by default without a
    GPU."""
    import torch

    if simulated:
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) \
                if torch.cuda.is_available() else torch.device("cpu")
        return torch.device(device)
    if arch not in SUPPORTED_GPUS:
        raise UnsupportedDeviceError(
            f"{what}: no kernels for arch {arch!r}; supported: "
            + "; ".join(_supported_text(a) for a in SUPPORTED_GPUS))
    need = f"{what} needs a CUDA GPU ({_supported_text(arch)})"
    if not torch.cuda.is_available():
        raise UnsupportedDeviceError(f"{need}; torch sees no CUDA device")
    dev = torch.device("cuda", torch.cuda.current_device()) if device is None \
        else torch.device(device)
    if dev.type != "cuda":
        raise UnsupportedDeviceError(f"{need}; got device {str(dev)!r}")
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    if (dev.index, arch) not in _CHECKED:
        cap = tuple(torch.cuda.get_device_capability(dev))
        if cap != SUPPORTED_GPUS[arch][0]:
            raise UnsupportedDeviceError(
                f"{need}; {dev} is a {torch.cuda.get_device_name(dev)} (compute capability "
                f"{cap[0]}.{cap[1]}), which cannot run {arch} kernels")
        _CHECKED[(dev.index, arch)] = None
    return dev


def compile_cached(family: KernelFamily, variant: Any, problem: ProblemBase,
                   arch: str) -> Any:
    """The compiled kernel of `variant` for `problem` (memoized per family, variant, compile
    key and arch in this process). Raises RuntimeError with the compiler's message on failure."""
    from ..search import build

    key = (family.NAME, variant.key(), family.compile_key(variant, problem).key(), arch)
    if key not in _COMPILED:
        out = build.compile_variant(family, variant, problem, arch)
        if not out.ok:
            raise RuntimeError(f"{variant.name()} did not compile for {problem.key()} on "
                               f"{arch}: {out.error}")
        _COMPILED[key] = out.compiled
    return _COMPILED[key]


def choose_variant(op: str, problem: ProblemBase, arch: str, family: str | None = None,
                   variant: Any = None, dispatcher: Any = None
                   ) -> tuple[KernelFamily, Any, str]:
    """(family object, variant, where it came from) for `problem`: the pinned `variant` (a
    ValueError if its family's predicate rejects the problem), else the dispatcher's answer
    (default: the process-wide resgen.runtime dispatcher), optionally within `family`."""
    from ..search.family import get_family

    if variant is not None:
        fam = get_family(variant.FAMILY)
        why = fam.why_invalid(variant, problem, arch)
        if why is not None:
            raise ValueError(f"pinned variant {variant.name()} cannot run {problem.key()}: "
                             f"{why}")
        return fam, variant, "pinned"
    if dispatcher is None:
        from .. import runtime

        dispatcher = runtime.dispatcher()
    v = dispatcher.lookup(op, problem, family)
    return get_family(v.FAMILY), v, dispatcher.source(op, problem, family)
