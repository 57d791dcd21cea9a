"""Counting the kernels a decode step's glue launches, per layer, on the CPU (issue 19).

`count_decode_glue(llm, batch)` runs one eager decode step of a loaded engine (any backend;
tests use the reference backend on a tiny model) under a TorchDispatchMode and lists every
aten op that would launch a kernel, attributed to its layer (or to the step outside the
layers), excluding what the backend's ops run inside themselves (projections, KV append,
decode attention: the model's kernels, not glue). What counts as one launch:

  - an aten op that computes (pointwise, reduction, copy, cast, cat, gather, in-place add ...);
    views (slice, unflatten, reshape of contiguous data, transpose, expand, alias) and
    allocations (empty*) launch nothing and are not counted;
  - a copy_ of a view onto the very same view (the write-back of `x[:b] += y`) counts none:
    aten's copy_ returns early there;
  - F.rms_norm counts once: on CUDA it is one fused kernel (aten::_fused_rms_norm), while the
    CPU composite decomposes it into several aten ops.

The CPU count is therefore the GPU's launch count of the same eager glue (one aten kernel per
op on CUDA), which bench/engine_speed.py's profile measures directly on the H200 (its
`kernels_per_step["glue"]`). Compiled glue (compile="glue") launches inductor's generated
kernels, invisible to a dispatch mode: `compiled_glue_kernels(llm)` compiles the regions with
inductor's C++ kernel profiling on and counts the generated kernels one profiled step calls
(C++ kernels on the CPU; the GPU's Triton fusion may group differently).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["GlueCount", "count_decode_glue", "compiled_glue_kernels", "launches_kernel"]

_NO_KERNEL = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
              "lift_fresh", "_local_scalar_dense", "sym_size", "sym_stride", "sym_numel"}


def launches_kernel(func: Any) -> bool:
    """Whether an aten op launches a kernel: not a view (an output aliasing an input without
    writing it) and not an allocation."""
    if func.__name__.split(".")[0] in _NO_KERNEL:
        return False
    for r in func._schema.returns:
        a = r.alias_info
        if a is not None and not a.is_write:
            return False
    return True


@dataclass
class GlueCount:
    """Kernel-launching glue ops of one decode step: per layer index (None: outside the
    layers: embedding gather, RoPE table gather, logits, state advance) a Counter of op
    names."""

    layers: int
    ops: dict[int | None, Counter] = field(default_factory=dict)

    def per_layer(self) -> float:
        """Mean launches per layer."""
        return sum(sum(c.values()) for k, c in self.ops.items() if k is not None) / self.layers

    def outside(self) -> int:
        return sum(self.ops.get(None, Counter()).values())

    def layer_ops(self, i: int = 1) -> Counter:
        return self.ops.get(i, Counter())

    def report(self) -> str:
        lines = [f"{self.per_layer():.1f} glue launches per layer, {self.outside()} per step "
                 "outside the layers"]
        for k in sorted(self.ops, key=lambda x: -1 if x is None else x):
            c = self.ops[k]
            what = ", ".join(f"{n} x{v}" if v > 1 else n for n, v in sorted(c.items()))
            lines.append(f"  {'step' if k is None else f'layer {k}'}: {sum(c.values())} "
                         f"({what})")
        return "\n".join(lines)


class _Counter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.layer: int | None = None
        self.paused = 0
        self.ops: dict[int | None, Counter] = {}

    def add(self, name: str) -> None:
        self.ops.setdefault(self.layer, Counter())[name] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):    # noqa: ANN001
        same = func is torch.ops.aten.copy_.default and _same_view(args[0], args[1])
        out = func(*args, **(kwargs or {}))
        if not self.paused and not same and launches_kernel(func):
            self.add(func.__name__.split(".")[0])
        return out


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    """copy_ of a view onto the same view (x[:b] += y's write-back): aten returns without a
    kernel."""
    return (isinstance(b, torch.Tensor) and a.data_ptr() == b.data_ptr()
            and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype)


class _Units(TorchFunctionMode):
    """F.rms_norm as one launch (CUDA's fused kernel): counted once, its CPU decomposition
    not counted."""

    def __init__(self, counter: _Counter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):    # noqa: ANN001
        if func is F.rms_norm and not self.counter.paused:
            self.counter.add("rms_norm")
            self.counter.paused += 1
            try:
                return func(*args, **(kwargs or {}))
            finally:
                self.counter.paused -= 1
        return func(*args, **(kwargs or {}))


class _Paused:
    """A backend op whose own torch ops are not glue."""

    def __init__(self, op: Any, counter: _Counter) -> None:
        self._op, self._counter = op, counter

    def __call__(self, *a: Any, **k: Any) -> Any:
        self._counter.paused += 1
        try:
            return self._op(*a, **k)
        finally:
            self._counter.paused -= 1

    def __getattr__(self, name: str) -> Any:
        return getattr(self._op, name)


def _instrument(model: Any, counter: _Counter) -> Callable[[], None]:
    """Wrap the backend's ops and the layer method of `model`; returns the undo."""
    undo: list[Callable[[], None]] = []
    for L in model.layers:
        for p in L.projections().values():
            op = p.op
            p.op = _Paused(op, counter)
            undo.append(lambda p=p, op=op: setattr(p, "op", op))
    for name in ("attn", "append"):
        op = getattr(model, name)
        if op is not None and not isinstance(op, _Paused):
            setattr(model, name, _Paused(op, counter))
            undo.append(lambda name=name, op=op: setattr(model, name, op))
    plans = dict(model.attn_plans)
    model.attn_plans = {k: _Paused(v, counter) for k, v in plans.items()}
    undo.append(lambda: setattr(model, "attn_plans", plans))
    layer = model._layer

    def counted(i: int, *a: Any, **k: Any) -> Any:
        counter.layer = i
        try:
            return layer(i, *a, **k)
        finally:
            counter.layer = None
    model._layer = counted
    undo.append(lambda: model.__dict__.pop("_layer", None))

    def restore() -> None:
        for u in reversed(undo):
            u()
    return restore


@torch.no_grad()
def count_decode_glue(llm: Any, batch: int = 1, context: int = 16) -> GlueCount:
    """The glue launches of one eager decode step of `batch` rows at `context` cached tokens
    (after one uncounted step that builds the plans). The engine must run its glue eagerly
    (compile="none"): a dispatch mode cannot see compiled kernels."""
    model = llm.model
    if getattr(getattr(model, "glue_fns", None), "mode", "none") != "none":
        raise ValueError("count_decode_glue counts eager glue: load the engine with "
                         "compile='none' (compiled_glue_kernels counts compiled regions)")
    pages = llm._reserve([context + 4] * batch)
    try:
        first = torch.zeros(batch, dtype=torch.int64, device=llm.device)
        llm._start_decode([context] * batch, first)
        r = llm.runner
        b = r.bucket(batch)
        r.step(b, context + 1)                        # plans, buffers (not counted)
        counter = _Counter()
        restore = _instrument(model, counter)
        try:
            with _Units(counter), counter:
                r.step(b, context + 2)
        finally:
            restore()
    finally:
        llm._release(pages)
    return GlueCount(len(model.layers), counter.ops)


@torch.no_grad()
def compiled_glue_kernels(llm: Any, batch: int = 1, context: int = 16) -> Counter:
    """The inductor kernels one decode step of `batch` rows launches, by kernel name (a
    Counter; sum = launches per step), for an engine loaded with compile="glue" on the CPU.
    Its decode regions of that batch bucket must not be compiled yet: they are compiled here
    with inductor's C++ kernel profiling on (each generated kernel a profiler event; the FX
    graph cache off so that they are generated, not loaded), then one step is profiled."""
    from torch._inductor import config as iconfig
    from torch.profiler import profile

    glue = llm.model.glue_fns
    if getattr(glue, "mode", "none") != "glue":
        raise ValueError("compiled_glue_kernels needs an engine loaded with compile='glue'")
    if llm.device.type != "cpu":
        raise ValueError("compiled_glue_kernels counts inductor's C++ kernels (CPU); on the "
                         "GPU profile a graph replay (bench/engine_speed.py)")
    r = llm.runner
    b = r.bucket(batch)
    if any(getattr(f, "calls", 0) for f in glue.regions("decode", b).values()):
        raise ValueError("the decode regions of this batch bucket are compiled already: "
                         "count on a freshly loaded engine")
    pages = llm._reserve([context + 4] * batch)
    try:
        llm._start_decode([context] * batch, torch.zeros(batch, dtype=torch.int64,
                                                         device=llm.device))
        with iconfig.patch({"fx_graph_cache": False, "cpp.enable_kernel_profile": True}):
            r.step(b, context + 1)                    # compiles the regions
        with profile() as prof:
            r.step(b, context + 2)
    finally:
        llm._release(pages)
    return Counter(e.name.split("cpp_fused_", 1)[1] for e in prof.events()
                   if "cpp_fused_" in e.name)
