"""One decoder layer's decode step measured end to end: the projections, the attention and the
torch glue between them chained in ONE CUDA graph, resgen against BF16 (the step that
bench/report/decode_layer_model.py can only approximate by summing kernels measured alone).

Per layer (Qwen3 geometry, batch B tokens, every sequence KV_LEN long):

    a = rmsnorm(h); q, k, v = split(QKV(a))
    append k, v to the layer's KV cache (at position KV_LEN - 1, so replays keep the length)
    h = h + O(attention(q, layer's KV cache))
    a = rmsnorm(h); g, u = split(GATE_UP(a))
    h = h + DOWN(silu(g) * u)

Stacks: "bf16" (F.linear on BF16 weights = cuBLAS, SDPA over a BF16 KV cache [B, Hkv, L, D]),
"plain" (resgen.ops.Linear W4A4 NVFP4 + the NVFP4 append kernel + DecodeAttention plain
NVFP4-KV) and "compensated" (M-Ext + ResAttn), each from the shipped dispatch table; the BF16
stack appends with a copy into its cache. Left out of every stack alike: RoPE, Qwen3's per-head
q/k norms, the LM head. LAYERS distinct layers (own weights and caches, together larger
than the 60 MB L2) are chained and timed under the tuner's measurement policy
(resgen.search.timing.measure: a CUDA graph of many chains, median of repetitions); the time
per layer is that over LAYERS. Before timing, every kernel of each resgen stack is checked
against its reference on its own input (teacher forcing, see ResgenStack.check: projections
and attention <= 3e-3 relative, the KV append bit-exact); the drift of the whole chain from the
chained references is recorded too. The torch glue alone (GlueStack) is timed as well, so the
kernels' share can be read off. Static NVFP4 input scales come from one BF16 pass
(amax / 2688 per projection, as a calibration would).

    source .devcache/device/env.sh && timeout -k 5 -s INT 540 python3 bench/decode_step.py
        # -> $OUT/decode_step.json, table last   (--model, --batch, --kv-len, --layers,
        #    --profile: each stack's kernels inside the chain)

Status: CPU-tested (tests/test_decode_step.py: the chain through resgen.ops with the kernels'
simulations, the per-kernel check and that it names a wrong kernel); run on the H200:
bench/results/h200/decode_step.json.xz (.log; xz-compressed when committed), indexed in
bench/results/h200/README.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from resgen import formats  # noqa: E402
from resgen import reference as R  # noqa: E402
from resgen.calibrate import QLinearWeight, prepare_weight  # noqa: E402
from resgen.models import ModelSpec, get_model  # noqa: E402
from resgen.search import attention_sm90, linear_sm90_mma  # noqa: E402
from resgen.search.family import compare  # noqa: E402

PROJ = ("qkv", "o", "gate_up", "down")
STACKS = ("bf16", "plain", "compensated")
LINEAR_TOL = linear_sm90_mma.TOLERANCE          # the linear kernels' check: BF16 output rounding
ATTN_TOL = attention_sm90.TOLERANCE["f16"]      # attention with FP16 P V, FP32-exact reference


def rmsnorm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x: bf16 [B, H] -> bf16 (unit weight): torch's F.rms_norm, as a serving loop calls it
    (one fused kernel on CUDA, FP32 inside; the first H200 runs spent 14 us of a layer in
    an eager FP32 formula of six kernels per norm)."""
    return F.rms_norm(x, (x.shape[-1],), eps=eps)


@dataclasses.dataclass
class LayerWeights:
    """One layer's BF16 weights [out, in]: qkv, o, gate_up, down."""

    w: dict[str, torch.Tensor]

    @staticmethod
    def random(spec: ModelSpec, gen: torch.Generator, device: Any) -> "LayerWeights":
        d, hq, hkv = spec.head_dim, spec.heads, spec.kv_heads
        shapes = {"qkv": ((hq + 2 * hkv) * d, spec.hidden), "o": (spec.hidden, hq * d),
                  "gate_up": (2 * spec.intermediate, spec.hidden),
                  "down": (spec.hidden, spec.intermediate)}
        return LayerWeights({name: (torch.randn(n, k, generator=gen, device=device)
                                    / k ** 0.5).to(torch.bfloat16)
                             for name, (n, k) in shapes.items()})


def step_layer(spec: ModelSpec, h: torch.Tensor, proj: Callable[[str, torch.Tensor], Any],
               store_kv: Callable[[torch.Tensor, torch.Tensor], None],
               attend: Callable[[torch.Tensor], torch.Tensor],
               seen: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """One layer's step with the stack's projections `proj(name, x)`, KV append
    `store_kv(k, v)` (each [B, Hkv, D]) and attention `attend(q [B, Hq, D]) -> [B, Hq, D]`
    (bf16 throughout). `seen`: records each projection's input (for the static input scales)."""
    b = h.shape[0]
    d, hq, hkv = spec.head_dim, spec.heads, spec.kv_heads

    def p(name: str, x: torch.Tensor) -> torch.Tensor:
        if seen is not None:
            seen[name] = x
        return proj(name, x)

    qkv = p("qkv", rmsnorm(h))
    q = qkv[:, : hq * d].reshape(b, hq, d).contiguous()     # the attention kernel's layout
    kv = qkv[:, hq * d:].reshape(b, 2, hkv, d)
    store_kv(kv[:, 0].contiguous(), kv[:, 1].contiguous())
    h = h + p("o", attend(q).reshape(b, hq * d))
    gu = p("gate_up", rmsnorm(h))
    g, u = gu[:, : spec.intermediate], gu[:, spec.intermediate:]
    return h + p("down", F.silu(g) * u)                     # SwiGLU in BF16


class Bf16Stack:
    """F.linear (cuBLAS) and SDPA over BF16 KV caches [B, Hkv, L, D], one per layer."""

    def __init__(self, spec: ModelSpec, weights: list[LayerWeights], batch: int, kv_len: int,
                 gen: torch.Generator, device: Any) -> None:
        self.spec, self.weights = spec, weights
        shape = (batch, spec.kv_heads, kv_len, spec.head_dim)
        self.kv = [(torch.randn(shape, generator=gen, device=device).to(torch.bfloat16),
                    torch.randn(shape, generator=gen, device=device).to(torch.bfloat16))
                   for _ in weights]

    def layer(self, i: int, h: torch.Tensor, seen: dict | None = None) -> torch.Tensor:
        k, v = self.kv[i]

        def store(kn: torch.Tensor, vn: torch.Tensor) -> None:
            k[:, :, -1].copy_(kn)
            v[:, :, -1].copy_(vn)

        def attend(q: torch.Tensor) -> torch.Tensor:
            o = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, enable_gqa=True)
            return o.squeeze(2)
        return step_layer(self.spec, h, lambda n, x: F.linear(x, self.weights[i].w[n]),
                          store, attend, seen)

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        for i in range(len(self.weights)):
            h = self.layer(i, h)
        return h


class ResgenStack:
    """resgen.ops.Linear per projection (static NVFP4 input scales) and
    resgen.ops.DecodeAttention over one paged NVFP4 cache per layer.

    linear_kwargs / attention_kwargs: passed to the ops; append_fn: (cache, k, v, block_tables,
    positions) -> None, default the compiled NVFP4 append kernel (the CPU test stands
    simulations and the reference append in)."""

    def __init__(self, spec: ModelSpec, weights: list[LayerWeights],
                 input_scales: list[dict[str, float]], compensated: bool, batch: int,
                 kv_len: int, page_size: int, gen: torch.Generator, device: Any,
                 linear_kwargs: dict | None = None, attention_kwargs: dict | None = None,
                 append_fn: Callable[..., None] | None = None) -> None:
        from resgen.ops import DecodeAttention, Linear
        from resgen.search.attention_sm90 import random_cache

        self.spec, self.batch, self.kv_len = spec, batch, kv_len
        comp = "full" if compensated else "none"
        self.qweights: list[dict[str, QLinearWeight]] = []
        self.linears: list[dict[str, Any]] = []
        for lw, sc in zip(weights, input_scales):
            qws = {n: prepare_weight(lw.w[n].float(), "nvfp4", input_scale=sc[n])
                   for n in PROJ}
            self.qweights.append(qws)
            self.linears.append({n: Linear(qws[n], comp, device=device,
                                           **(linear_kwargs or {})) for n in PROJ})
        self.compensated = compensated
        self.attn = DecodeAttention(spec.heads, spec.kv_heads, spec.head_dim, page_size,
                                    compensation=compensated, **(attention_kwargs or {}))
        self.caches = [random_cache(batch, spec.kv_heads, spec.head_dim, kv_len, page_size,
                                    device, gen) for _ in weights]
        # the new token of every sequence goes to its last position (the length stays)
        self.positions = torch.stack([torch.arange(batch, device=device),
                                      torch.full((batch,), kv_len - 1, device=device)],
                                     1).to(torch.int32)
        if append_fn is None:
            from resgen.kernels.attention_sm90 import KVAppendSm90, compile_append

            res, _ = compile_append(spec.head_dim, spec.kv_heads, page_size)
            append_fn = KVAppendSm90(res.fn, spec.head_dim, spec.kv_heads, page_size)
        self.append = append_fn

    def warmup(self) -> None:
        """Build every plan (compile, buffers) so the step can be captured."""
        for lin in self.linears:
            for op in lin.values():
                op.warmup([self.batch])
        self.attn.warmup([(self.batch, self.kv_len)])

    def layer(self, i: int, h: torch.Tensor) -> torch.Tensor:
        cache, bt, sl = self.caches[i]
        return step_layer(self.spec, h, lambda n, x: self.linears[i][n](x),
                          lambda k, v: self.append(cache, k, v, bt, self.positions),
                          lambda q: self.attn(q, cache, bt, sl, max_kv_len=self.kv_len))

    def reference_layer(self, i: int, h: torch.Tensor) -> torch.Tensor:
        """The same step from resgen.reference in FP32, rounded to BF16 between ops."""
        cache, bt, sl = self.caches[i]
        comp = "full" if self.compensated else "none"

        def proj(n: str, x: torch.Tensor) -> torch.Tensor:
            return R.linear(x.float(), self.qweights[i][n], comp).to(torch.bfloat16)

        def store(k: torch.Tensor, v: torch.Tensor) -> None:
            cache.append(k.float(), v.float(), bt, self.positions.long())

        def attend(q: torch.Tensor) -> torch.Tensor:
            return R.decode_attention(q.float(), cache, bt, sl, compensation=self.compensated,
                                      pv="fp32").to(torch.bfloat16)
        return step_layer(self.spec, h, proj, store, attend)

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        for i in range(len(self.caches)):
            h = self.layer(i, h)
        return h

    def check(self, h: torch.Tensor) -> dict[str, Any]:
        """Every kernel of every layer against its reference on the kernel's OWN input (teacher
        forcing): each projection vs resgen.reference.linear (tolerance LINEAR_TOL), the KV
        append bit for bit vs the reference append (which then overwrites the same slots), the
        attention vs resgen.reference.decode_attention on that cache (ATTN_TOL); no NaN / Inf.
        The step then continues with the kernel's output.

        Returns ok, rel_err (the worst projection or attention error), ops (the worst check per
        op name), and drift: ||out - ref|| / ||ref|| of the last hidden state against the step
        chained through the references alone. Drift is not a kernel check: an FP32 summation
        order that differs by one BF16 ulp flips some FP4 codes of the next quantization, and
        over a few layers the two chains part by about the method's own quantization error
        (so plain drifts about ten times further than compensated)."""
        comp = "full" if self.compensated else "none"
        ops: dict[str, dict[str, Any]] = {}

        def record(name: str, res: dict[str, Any]) -> None:
            old = ops.get(name)
            if old is None or (old["ok"] and not res["ok"]) or (
                    old["ok"] == res["ok"] and res["rel_err"] > old["rel_err"]):
                ops[name] = res

        out = h
        for i in range(len(self.caches)):
            cache, bt, sl = self.caches[i]

            def proj(n: str, x: torch.Tensor) -> torch.Tensor:
                y = self.linears[i][n](x)
                ref = R.linear(x.float(), self.qweights[i][n], comp)
                record(n, dataclasses.asdict(compare(y, ref, LINEAR_TOL)))
                return y

            def store(k: torch.Tensor, v: torch.Tensor) -> None:
                self.append(cache, k, v, bt, self.positions)
                page, slot = cache.append_slots(bt, self.positions)
                fields = (cache.k_codes, cache.k_sf, cache.v_codes, cache.v_sf)
                got = [f[page, :, slot].view(torch.uint8).clone() for f in fields]
                cache.append(k.float(), v.float(), bt, self.positions.long())
                diff = sum(int((g != f[page, :, slot].view(torch.uint8)).sum())
                           for g, f in zip(got, fields))
                record("append", {"ok": diff == 0, "rel_err": float(diff), "tolerance": 0.0,
                                  "detail": f"{diff} bytes differ from the reference append"
                                  if diff else ""})

            def attend(q: torch.Tensor) -> torch.Tensor:
                o = self.attn(q, cache, bt, sl, max_kv_len=self.kv_len)
                ref = R.decode_attention(q.float(), cache, bt, sl,
                                         compensation=self.compensated, pv="fp32")
                record("attention", dataclasses.asdict(compare(o, ref, ATTN_TOL)))
                return o
            out = step_layer(self.spec, out, proj, store, attend)
        ref = h
        for i in range(len(self.caches)):
            ref = self.reference_layer(i, ref)
        finite = bool(torch.isfinite(out.float()).all())
        drift = float((out.float() - ref.float()).norm() / ref.float().norm())
        worst = max(r["rel_err"] for r in ops.values() if r["tolerance"] > 0)
        ok = finite and all(r["ok"] for r in ops.values())
        detail = "; ".join(f"{n}: {r['detail']}" for n, r in ops.items() if not r["ok"])
        return {"ok": ok, "rel_err": worst, "ops": ops, "drift": drift,
                "detail": detail if finite else "non-finite output; " + detail}


class GlueStack:
    """The step's torch glue alone (norms, splits, copies, residual adds, SwiGLU): projections
    and attention return preallocated BF16 outputs and the append does nothing. Every stack
    runs this same glue, so a stack's time minus the glue's is that of its own kernels."""

    def __init__(self, spec: ModelSpec, layers: int, batch: int, device: Any) -> None:
        d, hq, hkv = spec.head_dim, spec.heads, spec.kv_heads
        width = {"qkv": (hq + 2 * hkv) * d, "o": spec.hidden, "gate_up": 2 * spec.intermediate,
                 "down": spec.hidden}
        self.spec, self.layers = spec, layers
        self.out = {n: torch.zeros(batch, w, dtype=torch.bfloat16, device=device)
                    for n, w in width.items()}
        self.attn_out = torch.zeros(batch, hq, d, dtype=torch.bfloat16, device=device)

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        for _ in range(self.layers):
            h = step_layer(self.spec, h, lambda n, x: self.out[n], lambda k, v: None,
                           lambda q: self.attn_out)
        return h


def input_scales(spec: ModelSpec, bf16: Bf16Stack, h: torch.Tensor) -> list[dict[str, float]]:
    """Per layer and projection: amax of its input in one BF16 pass / 2688 (static NVFP4)."""
    out = []
    for i in range(len(bf16.weights)):
        seen: dict[str, torch.Tensor] = {}
        h = bf16.layer(i, h, seen)
        out.append({n: max(float(seen[n].float().abs().max()), 1e-6)
                    / (formats.E2M1_MAX * formats.E4M3_MAX)
                    for n in PROJ})
    return out


class _Chain:
    """A resgen.search.timing runner over one input: the stack applied to h (no input sets to
    rotate: the LAYERS distinct layers already stream more bytes than the L2 holds)."""

    def __init__(self, stack: Callable[[torch.Tensor], torch.Tensor], h: torch.Tensor):
        self.stack, self.h = stack, h

    def rotate(self, i: int) -> None:
        pass

    def __call__(self) -> torch.Tensor:
        return self.stack(self.h)


def time_stack(stack: Callable[[torch.Tensor], torch.Tensor], h: torch.Tensor) -> dict:
    """The chain under the tuner's measurement policy (CUDA graph of many calls, median of
    repetitions): microseconds per call of all LAYERS layers."""
    from resgen.search.timing import DEFAULT_POLICY, measure

    t = measure(_Chain(stack, h), DEFAULT_POLICY, n_sets=1)
    # only graph replays compare (an eager chain pays Python launch overhead per kernel)
    return {"us": t.median_us if t.mode == "graph" else None, "median_us": t.median_us,
            "q": t.quantiles_us, "launches": t.launches, "mode": t.mode, "note": t.note}


def kernel_summary(spans: list[tuple[str, float, float]], chains: int,
                   top: int = 12) -> dict[str, Any]:
    """Kernel spans (name, start us, end us) of `chains` replays of one chain -> per chain:
    wall (first start to last end), busy (union of the spans: time some kernel runs), gaps
    (wall - busy: the GPU idle between dependent kernels), kernels (count) and the `top`
    names by time, each {"name", "us", "count"} per chain."""
    if not spans:
        return {"wall_us": 0.0, "busy_us": 0.0, "gap_us": 0.0, "kernels": 0.0, "top": []}
    spans = sorted(spans, key=lambda t: t[1])
    busy, cur_s, cur_e = 0.0, spans[0][1], spans[0][2]
    for _, a, b in spans[1:]:
        if a > cur_e:
            busy += cur_e - cur_s
            cur_s, cur_e = a, b
        else:
            cur_e = max(cur_e, b)
    busy += cur_e - cur_s
    wall = max(e for _, _, e in spans) - spans[0][1]
    per: dict[str, list[float]] = {}
    for name, a, b in spans:
        acc = per.setdefault(name, [0.0, 0])
        acc[0] += b - a
        acc[1] += 1
    names = sorted(per.items(), key=lambda kv: -kv[1][0])[:top]
    return {"wall_us": wall / chains, "busy_us": busy / chains, "gap_us": (wall - busy) / chains,
            "kernels": len(spans) / chains,
            "top": [{"name": n[:120], "us": t / chains, "count": c / chains}
                    for n, (t, c) in names]}


def profile_stack(stack: Callable[[torch.Tensor], torch.Tensor], h: torch.Tensor,
                  chains: int = 10) -> dict[str, Any]:
    """One chain captured in a CUDA graph, replayed `chains` times back to back under
    torch.profiler (CUPTI kernel records): kernel_summary of what ran. Warm L2 from the
    previous replay is possible only for what the LAYERS layers do not evict."""
    from torch.profiler import ProfilerActivity, profile

    from resgen.search.timing import capture_graph, capture_with_retry

    graph, note = capture_with_retry(lambda: capture_graph(_Chain(stack, h), 1, 1),
                                     torch.cuda.synchronize)
    if graph is None:
        return {**kernel_summary([], chains), "note": note}
    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(chains):
            graph.replay()
        torch.cuda.synchronize()
    spans = [(e.name, float(e.time_range.start), float(e.time_range.end))
             for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
             and "memcpy" not in e.name.lower() and "memset" not in e.name.lower()]
    return {**kernel_summary(spans, chains), "note": note}


def run_point(spec: ModelSpec, batch: int, kv_len: int, layers: int,
              page_size: int = 32, profile: bool = False) -> dict[str, Any]:
    """The three stacks (and the glue) at one (batch, KV length): check, then time; with
    `profile`, also each one's kernels in the chain (profile_stack)."""
    dev = torch.device("cuda", torch.cuda.current_device())   # indexed, as tensors report it
    gen = torch.Generator(device=dev).manual_seed(batch * 7919 + kv_len)
    weights = [LayerWeights.random(spec, gen, dev) for _ in range(layers)]
    h0 = torch.randn(batch, spec.hidden, generator=gen, device=dev).to(torch.bfloat16)
    rec: dict[str, Any] = {"model": spec.name, "batch": batch, "kv_len": kv_len,
                           "layers": layers}
    bf16 = Bf16Stack(spec, weights, batch, kv_len, gen, dev)
    scales = input_scales(spec, bf16, h0)
    rec["bf16"] = time_stack(bf16, h0)
    glue = GlueStack(spec, layers, batch, dev)
    rec["glue"] = time_stack(glue, h0)
    if profile:
        rec["bf16"]["profile"] = profile_stack(bf16, h0)
        rec["glue"]["profile"] = profile_stack(glue, h0)
    bf16 = None                                     # free its KV caches before the others
    torch.cuda.empty_cache()
    for name in ("plain", "compensated"):
        st = ResgenStack(spec, weights, scales, name == "compensated", batch, kv_len,
                         page_size, gen, dev)
        st.warmup()
        chk = st.check(h0)
        rec[name] = {"check": chk}
        if chk["ok"]:
            rec[name].update(time_stack(st, h0))
            if profile:
                rec[name]["profile"] = profile_stack(st, h0)
        rec[name]["variants"] = {n: st.linears[0][n].plan(batch).variant.name() for n in PROJ}
        rec[name]["attention"] = st.attn.plan(batch, kv_len).variant.name()
        st = None
        torch.cuda.empty_cache()
    return rec


def table(rows: list[dict[str, Any]]) -> str:
    """Per layer: each stack's time and ratios; the torch glue every stack runs ("glue") and
    the compensated stack's ratio without it ("kern x bf16"); each resgen stack's worst
    per-kernel check and its drift from the reference chain (plain / compensated)."""
    head = ("model", "B", "KV", "bf16 us/layer", "plain", "x bf16", "compensated", "x bf16",
            "comp/plain", "glue", "kern x bf16", "check", "drift")
    lines = [" ".join(f"{h:>13s}" for h in head)]
    for r in rows:
        per = {s: (r[s].get("us") or float("nan")) / r["layers"] for s in STACKS + ("glue",)}
        chk = "/".join(f"{r[s]['check']['rel_err']:.0e}" for s in ("plain", "compensated"))
        drift = "/".join(f"{r[s]['check']['drift']:.0e}" for s in ("plain", "compensated"))
        kern = (per["bf16"] - per["glue"]) / (per["compensated"] - per["glue"])
        lines.append(" ".join(f"{x:>13s}" for x in (
            r["model"], str(r["batch"]), f"{r['kv_len'] // 1024}K", f"{per['bf16']:.1f}",
            f"{per['plain']:.1f}", f"{per['bf16'] / per['plain']:.2f}",
            f"{per['compensated']:.1f}", f"{per['bf16'] / per['compensated']:.2f}",
            f"{per['compensated'] / per['plain']:.3f}", f"{per['glue']:.1f}", f"{kern:.2f}",
            chk, drift)))
    return "\n".join(lines)


def profile_table(rows: list[dict[str, Any]]) -> str:
    """Per layer, from the profiled replays: wall, busy (some kernel running), gap (idle
    between dependent kernels) and kernel count of each stack; then each stack's top kernels."""
    head = ("model", "B", "KV", "stack", "wall us", "busy us", "gap us", "kernels")
    lines = [" ".join(f"{h:>12s}" for h in head)]
    tops = []
    for r in rows:
        for st in ("glue",) + STACKS:
            pr = r.get(st, {}).get("profile")
            if not pr:
                continue
            n = r["layers"]
            lines.append(" ".join(f"{x:>12s}" for x in (
                r["model"], str(r["batch"]), f"{r['kv_len'] // 1024}K", st,
                f"{pr['wall_us'] / n:.1f}", f"{pr['busy_us'] / n:.1f}",
                f"{pr['gap_us'] / n:.1f}", f"{pr['kernels'] / n:.1f}")))
            tops.append(f"{r['model']} B={r['batch']} KV={r['kv_len']} {st}: " + "; ".join(
                f"{k['us'] / n:.1f} us x{k['count'] / n:g} {k['name'][:60]}"
                for k in pr["top"][:6]))
    return "\n".join(tops + lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3-8b,qwen3-32b")
    ap.add_argument("--batch", default="1,8,32")
    ap.add_argument("--kv-len", default="4096,32768")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--profile", action="store_true",
                    help="also record each stack's kernels in the chain (torch.profiler)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("decode_step needs a CUDA GPU", file=sys.stderr)
        return 2
    out = Path(os.environ.get("OUT", "bench/results/h200"))
    out.mkdir(parents=True, exist_ok=True)
    from resgen.search.timing import DEFAULT_POLICY
    from run_record import run_record

    run = run_record(__file__, argv, policy=DEFAULT_POLICY)
    rows: list[dict[str, Any]] = []
    for m in args.model.split(","):
        for b in (int(x) for x in args.batch.split(",")):
            for n in (int(x) for x in args.kv_len.split(",")):
                try:
                    rows.append(run_point(get_model(m), b, n, args.layers,
                                          profile=args.profile))
                except Exception as e:                  # reported, the next point still runs
                    rows.append({"model": m, "batch": b, "kv_len": n,
                                 "error": f"{type(e).__name__}: {e}"[:500]})
                print(f"{m} B={b} KV={n}: " + (rows[-1].get("error") or ", ".join(
                    f"{s} {(rows[-1][s].get('us') or float('nan')) / args.layers:.1f} us/layer"
                    for s in STACKS + ("glue",))), flush=True)
                (out / "decode_step.json").write_text(json.dumps(
                    {"run": run, "gpu": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    if args.profile:
        print(profile_table([r for r in rows if "error" not in r]))
    print(table([r for r in rows if "error" not in r]))
    return 0 if all("error" not in r and r["plain"]["check"]["ok"]
                    and r["compensated"]["check"]["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
