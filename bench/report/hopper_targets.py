"""Issue 20's serving-batch and prefill targets (Hopper-native numerics, section 3), computed
from `resgen bench` reports (whole layers as the runtime dispatches them from the shipped
table, NVFP4, every baseline in the same run), so every closing figure comes from committed
files and one command:

    python bench/report/hopper_targets.py     # writes bench/results/h200/hopper_targets.md

Inputs (REPORTS): per model, reports in order of preference. A target row is computed from the
FIRST report that holds every sum it needs, so numerator and denominator always come from one
run; the row names its report. Every value is a ratio (or time) of four-shape sums (qkv, o,
gate/up, down) of medians (linear_targets.sums: rows whose check passed). Targets:
- plain time at M = 1 / 16 / 64 / 128 <= 30 / 34 / 45 / 70 us (Qwen3-8B), and for every model
  the speed-ups over cuBLAS BF16 those times mean (3.6x / 3.2x / 2.5x / 1.7x);
- plain faster than cuBLAS FP8 W8A8 with pre-quantized activations at M <= 64 and within 5 %
  of it at M = 128 (the per-tensor form, cuBLAS's fastest at these M: the lower bound; the
  rowwise form and the fused per-token form a serving engine runs are shown beside it);
- full residue (M-Ext) <= 1.05x plain at every M, prefill included;
- prefill plain >= 1.0x cuBLAS BF16 at M = 256 / 512 / 2048;
- W4A16 faster than plain W4A4 at every M (the issue's "it must be faster than resgen plain");
- K-Ext presum <= 1.05x plain at every K-Ext ratio and M a report holds (section 1's "K-Ext at
  plain cost on Hopper"; counted apart from section 3's targets), with the exact K-Ext fold /
  plain beside it (Blackwell's numerics, for comparison: no verdict);
and, as the measure of distance, resgen plain / the limit max(FP4 weight bytes at 4.45 TB/s,
the BF16 MMA work at BF16_MMA_FLOPS), the issue's limit column.
"""

from __future__ import annotations

import argparse
import lzma
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from linear_targets import sums  # noqa: E402
from report_io import load_json  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "results" / "h200"
# Latest first: s30d re-measured Qwen3-4B / 32B prefill (plain, W4A16) after the session-30
# prefill re-tune; s30b / s30c hold every M of those models on the table before it.
# s31b: plain and full M-Ext at every M on the table with the presum re-tune (session 31):
# the rows that need plain and full come from it; W4A16's from the s30 reports.
# s33: plain and full M-Ext at every M after the session-33 prefill re-tune of the presum
# winners (M = 256 / 512 / 2048, now warm-started from plain's winners); it supersedes s31b.
# s34: plain and full M-Ext at every M after session 34's decode re-tune (linear_sm90_mma
# presum reading the presum rows, M = 1 / 4 / 16 / 32) and the pack16 presum layer quantizer;
# it supersedes s33.
# s35: plain and K-Ext 0.125 / 0.5 in both folds at M = 16 / 64 / 128 / 256 / 2048 after the
# K-Ext presum tune (kext_presum_s35); rows that need full M-Ext or M = 1 come from s34.
# s37: plain, full M-Ext and W4A16 at every M on the s35 table with the plain layer quantizer
# at pack16 / 4 warps / unroll 1 (sm90_linear.LAYER_QUANT_CONFIG); K-Ext rows come from s35.
REPORTS: dict[str, tuple[str, ...]] = {
    "qwen3-8b": ("bench_s37_qwen3-8b.json.xz", "bench_s35_qwen3-8b.json.xz",
                 "bench_s34_qwen3-8b.json.xz",
                 "bench_s33_qwen3-8b.json.xz",
                 "bench_s31b_qwen3-8b.json.xz",
                 "bench_s30a_qwen3-8b.json.xz", "bench_s30b_qwen3-8b.json.xz"),
    "qwen3-4b": ("bench_s37_qwen3-4b.json.xz", "bench_s35_qwen3-4b.json.xz",
                 "bench_s34_qwen3-4b.json.xz",
                 "bench_s33_qwen3-4b.json.xz",
                 "bench_s31b_qwen3-4b.json.xz",
                 "bench_s30d_qwen3-4b.json.xz", "bench_s30b_qwen3-4b.json.xz"),
    "qwen3-32b": ("bench_s37_qwen3-32b.json.xz", "bench_s35_qwen3-32b.json.xz",
                  "bench_s34_qwen3-32b.json.xz",
                  "bench_s33_qwen3-32b.json.xz",
                  "bench_s31b_qwen3-32b.json.xz",
                  "bench_s30d_qwen3-32b.json.xz", "bench_s30c_qwen3-32b.json.xz"),
}
DECODE_US = {1: 30.0, 16: 34.0, 64: 45.0, 128: 70.0}           # Qwen3-8B plain targets
BF16_SPEEDUP = {1: 3.6, 16: 3.2, 64: 2.5, 128: 1.7}            # what those times mean
PREFILL_M = (256, 512, 2048)
ALL_M = tuple(DECODE_US) + PREFILL_M                          # decode, then prefill
KEXT_RATIOS = ("0.125", "0.25", "0.5", "1.0")
KEXT_PRESUM = "K-Ext presum <= 1.05x plain"
# rows without a verdict: measures of distance or comparison, not targets
INFO = ("plain / limit", "K-Ext exact fold / plain")
BF16_MMA_FLOPS = 7.9e14    # the limit column: 62 us at M = 128, 1000 us at 2048
FP8_FORMS = (("fp8_tensor_prequant_us", "per-tensor pre-quantized"),
             ("fp8_prequant_us", "rowwise pre-quantized"),
             ("fp8_fused_us", "fused per-token"))

Row = tuple[str, str, str, float, bool, str]   # model, target, where, value, met, report


class Reports:
    """A model's reports (name -> loaded JSON) with their sums per field, in preference order."""

    def __init__(self, names: tuple[str, ...], root: Path):
        self.names = names
        self.docs = [load_json(root / n) for n in names]
        self._sums: dict[tuple[int, str], dict] = {}

    def sums(self, i: int, field: str) -> dict:
        if (i, field) not in self._sums:
            self._sums[(i, field)] = sums(self.docs[i], field)
        return self._sums[(i, field)]

    def first(self, needs: list[tuple[str, str, int]]) -> tuple[int, list[float]] | None:
        """The first report holding every (field, compensation, m) sum of `needs`, and the
        sums; None if no report holds them all."""
        for i in range(len(self.docs)):
            got = [self.sums(i, f).get(("nvfp4", c, m)) for f, c, m in needs]
            if all(v is not None for v in got):
                return i, got
        return None

    def limit_us(self, i: int, m: int) -> float | None:
        """max(FP4 weight bytes at the HBM floor, the BF16 MMA work) of the four shapes."""
        rows = [r for r in self.docs[i]["rows"] if r["problem"]["m"] == m
                and r["problem"]["compensation"] == "none" and r["problem"]["fmt"] == "nvfp4"]
        if not rows:
            return None
        floor = sum(r["floor_us"] for r in rows)
        mma = sum(2.0 * m * r["problem"]["n"] * r["problem"]["k"] for r in rows)
        return max(floor, mma / BF16_MMA_FLOPS * 1e6)


def targets(model: str, rp: Reports) -> list[Row]:
    out: list[Row] = []

    def add(target: str, where: str, needs: list[tuple[str, str, int]], fn, ok) -> None:
        got = rp.first(needs)
        if got is None:
            return
        i, vals = got
        x = fn(*vals)
        out.append((model, target, where, x, ok(x), rp.names[i]))

    for m in DECODE_US:
        if model == "qwen3-8b":
            add(f"plain <= {DECODE_US[m]:.0f} us", f"M = {m}", [("resgen_us", "none", m)],
                lambda t: t, lambda t, m=m: t <= DECODE_US[m])
        add(f"plain >= {BF16_SPEEDUP[m]}x cuBLAS BF16", f"M = {m}",
            [("resgen_us", "none", m), ("bf16_us", "none", m)], lambda t, b: b / t,
            lambda x, m=m: x >= BF16_SPEEDUP[m])
        goal = 1.0 if m <= 64 else 0.95
        for key, name in FP8_FORMS:
            add(f"plain {'faster than' if m <= 64 else 'within 5% of'} cuBLAS FP8 W8A8, "
                f"{name}", f"M = {m}", [("resgen_us", "none", m), (key, "none", m)],
                lambda t, f: f / t, lambda x, goal=goal: x >= goal)
    for m in ALL_M:
        add("full residue <= 1.05x plain", f"M = {m}",
            [("resgen_us", "full", m), ("resgen_us", "none", m)], lambda f, p: f / p,
            lambda x: x <= 1.05)
    for m in PREFILL_M:
        add("prefill plain >= 1.0x cuBLAS BF16", f"M = {m}",
            [("resgen_us", "none", m), ("bf16_us", "none", m)], lambda t, b: b / t,
            lambda x: x >= 1.0)
    for m in ALL_M:
        add("W4A16 faster than plain W4A4", f"M = {m}",
            [("resgen_us", "w4a16", m), ("resgen_us", "none", m)], lambda w, p: p / w,
            lambda x: x > 1.0)
    for r in KEXT_RATIOS:
        for m in ALL_M:
            add(KEXT_PRESUM, f"ratio {r}, M = {m}",
                [("resgen_us", f"{r}+presum", m), ("resgen_us", "none", m)],
                lambda k, p: k / p, lambda x: x <= 1.05)
            add("K-Ext exact fold / plain", f"ratio {r}, M = {m}",
                [("resgen_us", r, m), ("resgen_us", "none", m)], lambda k, p: k / p,
                lambda x: False)
    for m in ALL_M:
        got = rp.first([("resgen_us", "none", m)])
        if got is not None:
            i, (t,) = got
            lim = rp.limit_us(i, m)
            if lim:
                out.append((model, "plain / limit (max of FP4 bytes, BF16 MMA)",
                            f"M = {m} (limit {lim:.1f} us)", t / lim, t / lim <= 1.0,
                            rp.names[i]))
    return out


def render(rows: list[Row]) -> str:
    goals = [r for r in rows if not r[1].startswith(INFO) and r[1] != KEXT_PRESUM]
    met, total = sum(r[4] for r in goals), len(goals)
    kext = [r for r in rows if r[1] == KEXT_PRESUM]
    lines = ["# hopper_targets: issue 20's serving-batch and prefill targets", "",
             "Generated by `python bench/report/hopper_targets.py` (ratios of four-shape sums, "
             "NVFP4, whole layers on the shipped table; every row from the one report it "
             "names; see the script's docstring). Value: a time in us where the target is a "
             "time, else a ratio with > 1 meaning resgen faster (a cost ratio for the full / "
             "plain and K-Ext rows, and resgen / limit for the limit rows).", "",
             f"Targets met: {met} of {total}." + (
                 f" K-Ext presum at plain cost (section 1, counted apart): "
                 f"{sum(r[4] for r in kext)} of {len(kext)}." if kext else ""), "",
             "| model | target | where | value | met | report |",
             "| --- | --- | --- | ---: | --- | --- |"]
    for model, target, where, x, ok, src in rows:
        val = f"{x:.2f} us" if target.endswith(" us") else f"{x:.3f}"
        verdict = "-" if target.startswith(INFO) else ("yes" if ok else "no")
        lines.append(f"| {model} | {target} | {where} | {val} | {verdict} | `{src}` |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", type=Path, default=RESULTS)
    ap.add_argument("--out", type=Path, default=RESULTS / "hopper_targets.md")
    a = ap.parse_args(argv)
    rows: list[Row] = []
    try:
        for model, names in REPORTS.items():
            rows += targets(model, Reports(names, a.results))
    except (OSError, ValueError, KeyError, TypeError, lzma.LZMAError) as e:  # one line
        print(f"hopper_targets: {e}", file=sys.stderr)
        return 2
    text = render(rows)
    a.out.write_text(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
