"""The decoder layer's glue: the torch code between the backend's ops, in five regions.

One layer (x: [T, ...] rows; y_*: a projection op's raw output in its I/O dtype; the
projections' own casts and biases are part of the glue around them):

    attn_in    a = to_io(rmsnorm(h) * w_in)                                   (layer 0 only)
    qkv        q, k, v = split(finish(y_qkv)); q/k RMSNorm per head (Qwen3); RoPE;
               [decode, paged cache: q, k, v cast to the attention's dtype, contiguous]
    attn_out   h = h + finish(y_o);  a = to_io(rmsnorm(h) * w_post)
    mlp_mid    g, u = split(finish(y_gate_up));  m = to_io(silu(g) * u)
    mlp_out    h = h + finish(y_down) [* active rows];  a = to_io(rmsnorm(h) * w_next)
               (w_next: the next layer's input norm, so that the residual add and the next
               norm are one region; None for the last layer or where the caller must touch h
               between layers)

`finish` is the projection's epilogue (its bias added in FP32, one rounding to the glue dtype;
resgen.engine.model.Proj), `to_io` the cast to the next op's input dtype (no-op where equal).

`EagerGlue` runs the regions as written (the engine's default: exactly the torch ops a layer
always ran). `CompiledGlue` (`resgen.load(..., compile="glue")`) runs each region through
torch.compile (TorchInductor, fullgraph): elementwise / reduction chains fused into a few
Triton kernels on the GPU (C++ on the CPU). Decode regions are compiled with dynamic=False,
one fresh code object per (region, batch bucket), so every bucket owns exactly one graph (no
recompile limit is reached, no guard of one bucket fails over to another's kernels); prefill
regions are compiled once with torch's automatic dynamic shapes (the row count varies). A
region is compiled on its first call: in the engine that is the eager decode step that
precedes each CUDA-graph capture (resgen.engine.graphs), so captures replay compiled kernels
and never compile. A region whose compilation fails runs eagerly from then on (logged and
recorded in `notes`).

Numerics: inductor keeps intermediates in FP32 registers (no BF16 rounding between fused
ops), computes reductions in its own order and may contract a * b + c, so compiled glue is
not bit-identical to eager; tests/test_engine_glue.py states the bounds it holds.
"""

from __future__ import annotations

import logging
import types
from typing import Any, Callable

import torch
import torch.nn.functional as F

from .rope import apply_rope

__all__ = ["rms_norm", "finish", "to_io", "attn_in", "qkv", "attn_out", "mlp_mid", "mlp_out",
           "REGIONS", "EagerGlue", "CompiledGlue", "COMPILE_MODES", "make_glue"]

log = logging.getLogger("resgen.engine")

COMPILE_MODES = ("none", "glue")


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim times w: FP32 exactly as transformers' LlamaRMSNorm; other
    dtypes through torch's fused F.rms_norm (FP32 inside; one kernel on CUDA)."""
    if x.dtype == torch.float32:
        var = x.pow(2).mean(-1, keepdim=True)
        return w * (x * torch.rsqrt(var + eps))
    return F.rms_norm(x, (x.shape[-1],), w, eps)


def _rms_norm_rows(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm with a weight broadcast against x's leading dims too (w: [H, D] for x
    [T, H, D]): the FP32 formula of rms_norm, or torch's own F.rms_norm decomposition
    (torch._decomp's _fused_rms_norm: FP32 inside, the weight multiplied in FP32, one
    rounding), the math inductor compiles F.rms_norm to. For compiled regions only."""
    if x.dtype == torch.float32:
        return rms_norm(x, w, eps)
    up = x.float()
    r = torch.rsqrt(up.pow(2).mean(-1, keepdim=True) + eps)
    return (up * r * w).to(x.dtype)


def finish(y: torch.Tensor, bias: torch.Tensor | None, glue: torch.dtype) -> torch.Tensor:
    """A projection's epilogue: y [T, N] (its op's dtype) + bias float32 [N] in FP32, then one
    rounding to the glue dtype. The add promotes BF16 y to FP32 inside one kernel: the same
    values as y.float() + bias (BF16 -> FP32 is exact), one launch fewer."""
    if bias is not None:
        y = torch.add(y, bias)
    return y if y.dtype == glue else y.to(glue)


def to_io(x: torch.Tensor, io: torch.dtype | None) -> torch.Tensor:
    """x in the next op's input dtype (None: as it is)."""
    return x if io is None or x.dtype == io else x.to(io)


def attn_in(h: torch.Tensor, w: torch.Tensor, *, eps: float, io: torch.dtype | None
            ) -> torch.Tensor:
    """h [T, hidden] -> the QKV projection's input [T, hidden] (io dtype)."""
    return to_io(rms_norm(h, w, eps), io)


def qkv(y: torch.Tensor, bias: torch.Tensor | None, q_norm: torch.Tensor | None,
        k_norm: torch.Tensor | None, cs: torch.Tensor, *, heads: int,
        kv_heads: int, head_dim: int, eps: float, glue: torch.dtype,
        out_dtype: torch.dtype | None = None
        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused QKV output y [T, (Hq + 2 Hkv) D] -> q [T, Hq, D], k, v [T, Hkv, D] (q and k
    normed per head where q_norm / k_norm [D] are given, then rotated; cs: [T, 2, D] rows of
    resgen.engine.rope.rope_pairs). out_dtype: q, k, v cast to it and made contiguous
    (what the paged decode kernels take); None: glue-dtype views."""
    x = finish(y, bias, glue)
    nq, nkv = heads * head_dim, kv_heads * head_dim
    qk = x[:, : nq + nkv].unflatten(1, (heads + kv_heads, head_dim))
    v = x[:, nq + nkv:].unflatten(1, (kv_heads, head_dim))
    if q_norm is not None and k_norm is not None:
        if torch.compiler.is_compiling():
            # one reduction over every head with the per-head weights side by side: one
            # kernel for the norms and the rotation (no cat of two reductions to fuse across)
            w = torch.cat([q_norm.expand(heads, head_dim), k_norm.expand(kv_heads, head_dim)])
            qk = _rms_norm_rows(qk, w, eps)
        else:
            qk = torch.cat([rms_norm(qk[:, :heads], q_norm, eps),
                            rms_norm(qk[:, heads:], k_norm, eps)], dim=1)
    qk = apply_rope(qk, cs)          # q and k heads in one pass
    q, k = qk[:, :heads], qk[:, heads:]
    if out_dtype is not None:
        q, k, v = (t.to(out_dtype).contiguous() for t in (q, k, v))
    return q, k, v


def attn_out(h: torch.Tensor, y: torch.Tensor, bias: torch.Tensor | None, w: torch.Tensor, *,
             eps: float, glue: torch.dtype, io: torch.dtype | None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """h [T, hidden] + the O projection's y -> (h, the gate/up projection's input)."""
    h = h + finish(y, bias, glue)
    return h, to_io(rms_norm(h, w, eps), io)


def mlp_mid(y: torch.Tensor, *, intermediate: int, glue: torch.dtype, io: torch.dtype | None
            ) -> torch.Tensor:
    """The fused gate/up output y [T, 2 I] -> silu(gate) * up [T, I] (io dtype)."""
    gu = finish(y, None, glue)
    return to_io(F.silu(gu[:, :intermediate]) * gu[:, intermediate:], io)


def mlp_out(h: torch.Tensor, y: torch.Tensor, w_next: torch.Tensor | None,
            mask: torch.Tensor | None, *, eps: float, glue: torch.dtype,
            io: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """h + the down projection's y (times mask [T, 1] in h's dtype: padded decode rows kept
    at zero under an O bias) -> (h, the next layer's QKV input, or None without w_next)."""
    h = h + finish(y, None, glue)
    if mask is not None:
        h = h * mask
    if w_next is None:
        return h, None
    return h, to_io(rms_norm(h, w_next, eps), io)


REGIONS: dict[str, Callable[..., Any]] = {"attn_in": attn_in, "qkv": qkv,
                                          "attn_out": attn_out, "mlp_mid": mlp_mid,
                                          "mlp_out": mlp_out}


class EagerGlue:
    """The regions as plain torch calls."""

    mode = "none"

    def __init__(self) -> None:
        self.notes: list[str] = []

    def regions(self, phase: str, rows: int) -> dict[str, Callable[..., Any]]:
        """{region name: callable} for a decode step of `rows` rows or a prefill."""
        return REGIONS


def _fresh(fn: Callable[..., Any], tag: str) -> Callable[..., Any]:
    """fn with its own code object (dynamo keeps its compiled graphs per code object: one
    per region and batch bucket keeps their caches apart)."""
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{tag}")
    new = types.FunctionType(code, fn.__globals__, f"{fn.__name__}_{tag}", fn.__defaults__,
                             fn.__closure__)
    new.__kwdefaults__ = fn.__kwdefaults__
    return new


class _CompiledRegion:
    """One region under torch.compile, falling back to eager for good if compiling fails."""

    def __init__(self, name: str, tag: str, dynamic: bool | None, notes: list[str]) -> None:
        self.name, self.tag, self.notes = name, tag, notes
        self.eager = REGIONS[name]
        # emulate_precision_casts: BF16 intermediates rounded where eager rounds them (the
        # values eager glue produces, up to reduction order), at no memory traffic
        self.fn: Callable[..., Any] | None = torch.compile(
            _fresh(self.eager, tag), backend="inductor", fullgraph=True, dynamic=dynamic,
            options={"emulate_precision_casts": True})
        self.calls = 0

    def __call__(self, *args: Any, **kw: Any) -> Any:
        fn = self.fn
        if fn is None:
            return self.eager(*args, **kw)
        try:
            out = fn(*args, **kw)
        except Exception as e:          # inductor / dynamo could not build this region
            self.fn = None
            msg = (f"compiled glue: region {self.name} ({self.tag}) failed to compile, runs "
                   f"eagerly: {type(e).__name__}: {e}".splitlines()[0][:300])
            self.notes.append(msg)
            log.warning(msg)
            return self.eager(*args, **kw)
        self.calls += 1
        return out


class CompiledGlue:
    """The regions through torch.compile (see the module docstring)."""

    mode = "glue"

    def __init__(self) -> None:
        self.notes: list[str] = []
        self._sets: dict[tuple[str, int], dict[str, Callable[..., Any]]] = {}

    def regions(self, phase: str, rows: int) -> dict[str, Callable[..., Any]]:
        key = (phase, rows if phase == "decode" else 0)
        got = self._sets.get(key)
        if got is None:
            tag = f"decode_b{rows}" if phase == "decode" else "prefill"
            dyn = False if phase == "decode" else None
            got = {n: _CompiledRegion(n, tag, dyn, self.notes) for n in REGIONS}
            self._sets[key] = got
        return got

    def compiled(self) -> dict[tuple[str, int], list[str]]:
        """{(phase, rows): regions running compiled} (a failed one runs eagerly)."""
        return {k: [n for n, r in v.items() if getattr(r, "fn", None) is not None]
                for k, v in self._sets.items()}


def make_glue(mode: str) -> EagerGlue | CompiledGlue:
    """The glue runner of a compile mode ("none" | "glue")."""
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile must be one of {COMPILE_MODES}, got {mode!r}")
    return CompiledGlue() if mode == "glue" else EagerGlue()
