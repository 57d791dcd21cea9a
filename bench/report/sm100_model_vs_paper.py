"""The analytical B200 model of linear_sm100_tc (resgen.kernels.linear_sm100_tc_model) against
the paper's published B200 measurements (../shared/paper/resserve-paper.txt): predictions,
never measurements (there is no Blackwell GPU here). CPU only, about a minute:

    python bench/report/sm100_model_vs_paper.py  # bench/results/cpu/sm100_model_vs_paper.{json,md}

Rows (paper figure: what it measured; the model's configuration):
- Fig. 4a / 4b: plain NVFP4 GEMM, N = K = 4096, fixed tiles (quantization excluded). 4a's two
  end points are the model's fit; its middle widths and all of 4b are predictions.
- Fig. 6a: swapped vs unswapped plain GEMM, N = K = 4096 (paper: 128 x 64 tiles both ways;
  here unswapped tiles are 128 tokens x 128 channels, the narrowest linear_sm100_tc allows).
- Sec. 6.2.1 / Fig. 18 / 19: M-Ext / plain, whole layer (quantizer + GEMM, each the model's
  best over the space), median over the paper's 22 projection shapes per M = 1..64, NVFP4
  (paper 1.031-1.078) and MXFP4 (1.06-1.14).
- App. D.1 / Fig. 16: full K-Ext (ratio 1.0) / M-Ext, N = K = 4096, M = 1..128, tiles 128 x
  64 / 128 x 128, 3 stages, no cluster (paper: M-Ext 1.47-1.48x faster).
- Sec. 6.2.2 / Fig. 9: prefill K-Ext 0.125 / plain and 1.0 / plain at M = 1024, 2048, median
  over the Qwen3 4B / 8B / 32B shapes (the paper's 17-shape list is not in its text; paper:
  1.11-1.14 and 1.69-1.97).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

# the paper's 22 B200 projection shapes (Fig. 18 / 19 panel titles): (label, N, K)
SHAPES_22 = [
    ("Qwen3-4B QKV", 6144, 2560), ("Qwen3-4B Output", 2560, 4096),
    ("Qwen3-4B Gate/Up", 19456, 2560), ("Qwen3-4B Down", 2560, 9728),
    ("Qwen3-8B QKV", 6144, 4096), ("Qwen3-8B Output", 4096, 4096),
    ("Qwen3-8B Gate/Up", 24576, 4096), ("Qwen3-8B Down", 4096, 12288),
    ("Qwen3-32B QKV", 10240, 5120), ("Qwen3-32B Output", 5120, 8192),
    ("Qwen3-32B Gate/Up", 51200, 5120), ("Qwen3-32B Down", 5120, 25600),
    ("Qwen3.8-27B QKV", 14336, 5120), ("Qwen3.8-27B Linear QKVZ", 16384, 5120),
    ("Qwen3.8-27B Output", 5120, 6144), ("Qwen3.8-27B Gate/Up", 34816, 5120),
    ("Qwen3.8-27B Down", 5120, 17408), ("Qwen3.8-Max QKV TP16", 2560, 8192),
    ("Qwen3.8-Max QKVZ TP16", 2304, 8192), ("Qwen3.8-Max Output TP16", 8192, 1024),
    ("Qwen3.8-Max Output TP8", 8192, 2048), ("Qwen3.8-Max QKV TP8", 4608, 8192),
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/cpu/sm100_model_vs_paper")
    args = ap.parse_args(argv)

    from dataclasses import replace

    from resgen.kernels.linear_sm100_tc_model import (B200, fig4a_geometry, fit_fig4a,
                                                      max_stages, quantizer_us)
    from resgen.kernels.linear_sm100_tc_model import predict as predict_g
    from resgen.search.linear_sm100_tc import FAMILY, RowLayout, geometry_of, mode_of
    from resgen.search.linear_sm100_tc import LinearSm100Variant as V
    from resgen.search.variant import LinearProblem as P

    def predict(v, p):
        return predict_g(geometry_of(v, p), p.m)

    def deepest(v, p):
        return replace(v, stages=max_stages(geometry_of(v, p)))

    layer_us = FAMILY.predicted_layer_us

    rows = []

    def row(what, paper, model, note=""):
        rows.append({"what": what, "paper": paper, "model": model, "note": note})

    # Fig. 4a: tile width at B = 8
    for w, paper in ((8, 4.95), (16, None), (32, None), (64, 5.46)):
        row(f"Fig. 4a GEMM us, B = 8, tile 128 x {w}", paper,
            round(predict_g(fig4a_geometry(w), 8).total_us, 2),
            "fitted point" if paper is not None else "prediction")
    # Fig. 4b: fixed tiles, B = 128 .. 512
    for b, w, paper in ((128, 64, 5.68), (256, 64, 5.80), (512, 64, 8.70), (512, 128, 7.31)):
        p = P("nvfp4", "none", b, 4096, 4096)
        v = deepest(V(tile_n=w, tmem_rep=min(w, 32)), p)
        pr = predict(v, p)
        row(f"Fig. 4b GEMM us, B = {b}, tile 128 x {w}", paper, round(pr.total_us, 2),
            f"{pr.ctas} CTAs, {pr.occupancy}/SM")
    # Fig. 6a: swap
    for m in (1, 8, 32, 64):
        p = P("nvfp4", "none", m, 4096, 4096)
        sw = deepest(V(tile_n=64, tmem_rep=32), p)
        un = deepest(V(swap=False, tile_n=128, tmem_rep=32), p)
        ratio = predict(un, p).total_us / predict(sw, p).total_us
        row(f"Fig. 6a unswapped / swapped GEMM, M = {m}",
            "1.04-1.10 (M = 1-32), ~1.0 (M = 64)", round(ratio, 3),
            "unswapped 128 tokens x 128 channels here")
    # M-Ext / plain over the 22 shapes
    for fmt, paper in (("nvfp4", "1.031-1.078"), ("mxfp4", "1.06-1.14")):
        for m in (1, 2, 4, 8, 16, 32, 64):
            ratios = [layer_us(P(fmt, "full", m, n, k)) / layer_us(P(fmt, "none", m, n, k))
                      for _, n, k in SHAPES_22]
            row(f"M-Ext / plain whole layer, {fmt}, M = {m}, median of 22 shapes", paper,
                round(statistics.median(ratios), 3),
                f"range {min(ratios):.3f}-{max(ratios):.3f}")
    # full K-Ext vs M-Ext (Fig. 16)
    def fig16_us(p):
        """The paper's Fig. 16 choice: 128 x 64 or 128 x 128 tiles, 3 stages, no cluster (and
        for K-Ext either orientation), the fastest the model predicts, plus the quantizer."""
        lay = RowLayout.ROW_PAIR if p.compensation == "full" else RowLayout.PLAIN
        cands = [V(tile_n=tn, stages=3, swap=sw, layout=lay, tmem_rep=32)
                 for tn in (64, 128) for sw in (True, False)]
        ok = [v for v in cands if FAMILY.why_invalid(v, p, "sm_100a") is None]
        return (quantizer_us(p.fmt, mode_of(p), p.m, p.k)
                + min(predict(v, p).total_us for v in ok))

    for m in (1, 8, 32, 128):
        k_ext = fig16_us(P("nvfp4", "1.0", m, 4096, 4096))
        m_ext = fig16_us(P("nvfp4", "full", m, 4096, 4096))
        row(f"Fig. 16 full K-Ext / M-Ext whole layer, M = {m}", "1.47-1.48",
            round(k_ext / m_ext, 3), "tiles 128 x 64 / 128 x 128, 3 stages, no cluster")
    # prefill
    qwen3 = [s for s in SHAPES_22 if s[0].startswith("Qwen3-")]
    for m in (1024, 2048):
        for comp, paper in (("0.125", "1.11-1.14"), ("1.0", "1.69-1.97")):
            ratios = [layer_us(P("nvfp4", comp, m, n, k)) / layer_us(P("nvfp4", "none", m, n, k))
                      for _, n, k in qwen3]
            row(f"Fig. 9 prefill K-Ext {comp} / plain, M = {m}, median of 12 Qwen3 shapes",
                paper, round(statistics.median(ratios), 3),
                f"range {min(ratios):.3f}-{max(ratios):.3f}")

    fixed, gbps = fit_fig4a()
    hw = B200().fitted()
    report = {"command": "python bench/report/sm100_model_vs_paper.py",
              "what": "analytical model predictions vs the paper's published B200 figures; "
                      "nothing measured", "fit": {"fixed_us": fixed, "sm_gbps": gbps},
              "machine": {k: getattr(hw, k) for k in hw.__dataclass_fields__}, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    lines = ["| comparison | paper (B200, measured) | model (predicted) | note |",
             "| --- | --- | --- | --- |"]
    lines += [f"| {r['what']} | {r['paper'] if r['paper'] is not None else '-'} | "
              f"{r['model']} | {r['note']} |" for r in rows]
    args.out.with_suffix(".md").write_text(
        "Generated by `python bench/report/sm100_model_vs_paper.py` (predictions of "
        "resgen.kernels.linear_sm100_tc_model; nothing measured).\n\n" + "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
