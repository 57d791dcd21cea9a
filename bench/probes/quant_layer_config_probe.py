"""The layer quantizer's configuration (issue 20 section 1: full residue <= 1.05x plain).
`sm90_linear.layer_quantizer` ran quant_sm90's QuantConfig defaults (pack8, 4 warps,
unroll 2, one-shot grid) in every layout until session 34; this probe's rows (s33: M = 512 /
2048, s34: M = 16 / 64 / 128) moved the M-Ext presum layout to pack16, 4 warps, unroll 1, and
s37's (plain, M = 16 / 32 / 64 / 128, then 512 / 2048) the plain W4A4 layout too
(`sm90_linear.LAYER_QUANT_CONFIG`); "default" here is still the QuantConfig defaults.
bench/probes/presum_split_probe.py measured the
presum layout's quantizer at 1.23-1.56x the plain one's over Qwen3-8B's four layers. Here every
configuration of quant_sm90's search space (ept 8 / 16, warps, unroll, persistent grids), in
the layer's form (xop only, kp_align 256, static NVFP4 scale), for layouts "plain" (W4A4) and
"presum" (M-Ext), K = 4096 / 12288 (Qwen3-8B's two input widths), M = 64 / 128 / 512 / 2048:
each compiled, checked bit-exact against quant_sm90.operand_reference on fresh N(0, 1)
inputs into a 0xFF-poisoned operand, then timed under the tuner's policy
(resgen.search.timing.measure: cold L2, CUDA graph). On the H200 (carry .devcache):

    source .devcache/device/env.sh && RESGEN_CACHE_DIR=/tmp/resgen-cache \\
        timeout -k 5 -s INT 300 python3 bench/probes/quant_layer_config_probe.py

A whole run needs about 250 s of device time; QLC_LAYOUTS (e.g. "presum") and QLC_MS (e.g.
"512,2048") restrict it (the summary then covers what was run).

$OUT/quant_layer_config_probe.json: rows {layout, k, m, config, ok, us}, rewritten after each
configuration, then "summary": per (layout, M) the default's and the best single
configuration's sum over Qwen3-8B's four layers (K = 4096 three times, 12288 once)."""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import layer_probe  # noqa: E402
import torch  # noqa: E402

from resgen import formats  # noqa: E402
from resgen.kernels import quant_sm90 as Q  # noqa: E402
from resgen.search.timing import DEFAULT_POLICY, measure  # noqa: E402

ARCH = "sm_90a"
LAYOUTS = {"plain": "none", "presum": "full"}        # layout -> compensation
LAYOUTS = {k: v for k, v in LAYOUTS.items()
           if k in os.environ.get("QLC_LAYOUTS", ",".join(LAYOUTS)).split(",")}
KS = (4096, 12288)
MS = tuple(int(m) for m in os.environ.get("QLC_MS", "64,128,512,2048").split(","))
LAYER_KS = (4096, 4096, 4096, 12288)                 # Qwen3-8B: qkv, o, gate_up, down
DEV = torch.device("cuda")


def configs(layout: str, k: int) -> list[Q.QuantConfig]:
    """The QuantConfig defaults first (what layer_quantizer runs), then quant_sm90's search
    space (resgen.search.quant_sm90.QuantSm90Family.space's grid) in the layer's form."""
    base = dict(fmt="nvfp4", compensation=LAYOUTS[layout], k=k, layout=layout,
                write_codes=False, write_xop=True, alpha="static", kp_align=256)
    out = [Q.QuantConfig(**base)]
    out += [Q.QuantConfig(**base, ept=e, warps=w, unroll=u)
            for e in (8, 16) for w in (4, 8, 2) for u in (1, 2, 4)]
    out += [Q.QuantConfig(**base, ept=e, warps=w, unroll=u, persist=True)
            for e in (8, 16) for w in (4, 8) for u in (1, 2)]
    return [c for c in dict.fromkeys(out) if c.why_invalid() is None]


def name(c: Q.QuantConfig) -> str:
    return f"e{c.ept}_w{c.warps}_u{c.unroll}_{'p' if c.persist else 'nop'}"


class _Timed:
    """rotate(i) / __call__ for measure(): the kernel on input set i into its own buffers."""

    def __init__(self, kern, xs, outs, alpha) -> None:
        self.kern, self.xs, self.outs, self.alpha, self.cur = kern, xs, outs, alpha, 0

    def rotate(self, i: int) -> None:
        self.cur = i

    def __call__(self):
        return self.kern(self.xs[self.cur], self.outs[self.cur], alpha=self.alpha)


def run_one(kern, layout: str, k: int, m: int, seed: int) -> dict:
    """Check bit-exact (poisoned operand, fresh inputs), then time."""
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(DEV, torch.bfloat16)
    alpha = formats.nvfp4_global_scale(x.float()).reshape(1).to(DEV, torch.float32)
    out = kern.outputs(m, 8, DEV)
    out.operand.xop.view(torch.uint8).fill_(0xFF)
    got = kern(x, out, alpha=alpha)
    torch.cuda.synchronize()
    ref = Q.operand_reference(x, "nvfp4", LAYOUTS[layout], layout, 8, alpha, None, 256)
    n = min(got.xop.shape[0], ref.xop.shape[0])
    if not torch.equal(got.xop[:n].view(torch.int16), ref.xop[:n].view(torch.int16)):
        return {"ok": False, "detail": f"{int((got.xop[:n] != ref.xop[:n]).sum())} values differ"}
    per_set = m * k * 2 + out.operand.xop.numel() * 2
    n_sets = DEFAULT_POLICY.sets_for(per_set)
    xs = [torch.randn(m, k, generator=torch.Generator().manual_seed(seed + 1 + i))
          .to(DEV, torch.bfloat16) for i in range(n_sets)]
    outs = [kern.outputs(m, 8, DEV) for _ in range(n_sets)]
    t = measure(_Timed(kern, xs, outs, alpha), DEFAULT_POLICY, n_sets)
    return {"ok": True, "us": t.median_us}


def summary(rows: list[dict]) -> list[dict]:
    """Per (layout, M): the default's four-layer sum and the best single configuration's
    (the same configuration at both K), where every needed row was timed."""
    out = []
    for layout in LAYOUTS:
        for m in MS:
            t: dict[str, dict[int, float]] = {}
            for r in rows:
                if r["layout"] == layout and r["m"] == m and r.get("ok"):
                    t.setdefault(r["config"], {})[r["k"]] = r["us"]
            sums = {c: sum(v[k] for k in LAYER_KS) for c, v in t.items()
                    if all(k in v for k in KS)}
            if "default" not in sums:
                continue
            best = min(sums, key=sums.get)
            out.append({"layout": layout, "m": m, "default_us": sums["default"],
                        "best": best, "best_us": sums[best],
                        "best_over_default": sums[best] / sums["default"],
                        "per_config_us": sums})
    return out


def main() -> int:
    outdir = Path(os.environ.get("OUT", "bench/results/h200"))
    outdir.mkdir(parents=True, exist_ok=True)
    path = outdir / "quant_layer_config_probe.json"
    rows: list[dict] = []
    rc = 0
    try:
        for layout in LAYOUTS:
            for k in KS:
                for i, c in enumerate(configs(layout, k)):
                    cname = "default" if i == 0 else name(c)
                    try:
                        kern = Q.compile_config(c, ARCH)[0]
                    except Exception as e:
                        rows.append({"layout": layout, "k": k, "config": cname, "m": None,
                                     "error": f"{type(e).__name__}: {e}"[:400]})
                        rc = 1
                        continue
                    for m in MS:
                        try:
                            rec = run_one(kern, layout, k, m, seed=m + k)
                        except Exception as e:
                            rec = {"error": f"{type(e).__name__}: {e}"[:400],
                                   "trace": traceback.format_exc()[-800:]}
                        rows.append({"layout": layout, "k": k, "m": m, "config": cname,
                                     **rec})
                        if not rec.get("ok"):
                            rc = 1
                        print(f"{layout:6s} K={k:<6d} M={m:<5d} {cname:14s} "
                              + (f"{rec['us']:8.2f} us" if rec.get("ok") else
                                 str(rec.get("detail") or rec.get("error"))[:120]), flush=True)
                    layer_probe.write_rows(path, rows)
    except KeyboardInterrupt:
        print("quant_layer_config_probe: interrupted, summarizing the rows so far", flush=True)
        rc = 124
    doc = layer_probe.write_rows(path, rows, summary=summary(rows))
    for s in doc["summary"]:
        print(f"{s['layout']:6s} M={s['m']:<5d} default {s['default_us']:8.2f}  "
              f"best {s['best']:14s} {s['best_us']:8.2f}  ({s['best_over_default']:.3f})")
    return rc


if __name__ == "__main__":
    sys.exit(main())
