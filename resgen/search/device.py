"""The GPU as the tuner's processes share it: one exclusive lock per physical GPU around
prep + check + time, the health check after a failed variant (a broken CUDA context makes a
process useless: DeviceLost), and returning cached device memory between variants.

Tests replace `device_healthy` (the fake family's "poisoned context"); callers use it through
this module (`device.device_healthy(...)`) so that the replacement is seen."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

__all__ = ["gpu_lock", "gpu_lock_path", "DeviceLost", "device_healthy",
           "release_device_memory", "has_gpu"]


def has_gpu() -> bool:
    """True when torch sees a CUDA device."""
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


def gpu_lock_path(cache_dir: Path | None = None) -> str:
    """One lock file per physical GPU (its UUID), so tuners on different GPUs of one host
    (CUDA_VISIBLE_DEVICES) never wait for each other, and tuners sharing one GPU take turns.
    cache_dir: where the lock lives (default: resgen.settings' cache directory)."""
    if cache_dir is None:
        from ..settings import settings

        cache_dir = settings().cache_dir
    try:
        import torch

        tag = str(torch.cuda.get_device_properties(0).uuid)
    except Exception:
        tag = "0"
    tag = "".join(c for c in tag if c.isalnum() or c == "-")[:64] or "0"
    return str(Path(cache_dir) / f"gpu-{tag}.lock")


@contextlib.contextmanager
def gpu_lock(path: str | None) -> Iterator[None]:
    """Exclusive advisory lock on `path` (no-op for None): one process on the GPU at a time."""
    if path is None:
        yield
        return
    import fcntl

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)



_SPARE_CACHE_BYTES = 2 << 30


def release_device_memory(device: str, collect: bool = True) -> None:
    """Return this process's cached CUDA memory (outside the GPU lock): several tuner
    processes share the GPU, and one runner can hold many GB (a 64 x 128K-token KV cache is
    about 10 GB). After a workload (collect=True): every cached block, after a garbage
    collection if more than 2 GB are still allocated (tensors kept alive by reference
    cycles). After a variant: only when more than 2 GB sit cached and unused. (A collection
    costs tens of milliseconds in a process full of compiler objects.)"""
    try:
        import torch

        if not (str(device).startswith("cuda") and torch.cuda.is_available()):
            return
        if collect:
            if torch.cuda.memory_allocated() > _SPARE_CACHE_BYTES:
                import gc

                gc.collect()
        elif torch.cuda.memory_reserved() - torch.cuda.memory_allocated() < _SPARE_CACHE_BYTES:
            return
        torch.cuda.empty_cache()
    except Exception:       # a broken context is reported by the health check
        pass


class DeviceLost(RuntimeError):
    """A variant left the CUDA context unusable (e.g. an illegal address): its row is stored;
    this process must not run anything else."""


def device_healthy(device: str) -> bool:
    import torch

    if not str(device).startswith("cuda") or not torch.cuda.is_available():
        return True
    try:
        torch.cuda.synchronize()
        return float((torch.ones(1, device=device) + 1).item()) == 2.0
    except Exception:
        return False
