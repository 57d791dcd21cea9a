"""What reading a decode layer's bytes costs on this GPU with no kernel of ours: the practical
floor the M = 1 decode layers are compared with (the HBM floor of BENCH.md assumes 4.45 TB/s
from the first byte; small layers never get there: launch, ramp and tail are fixed costs).

    source .devcache/device/env.sh && python3 bench/probes/gpu_read_floor.py      # JSON to $OUT

For each size (the NVFP4 weight + scale bytes of the Qwen3-8B projections, plus a sweep),
torch reads the bytes under the same timing policy as the tuner and `resgen bench`
(resgen.search.timing.DEFAULT_POLICY: CUDA graph of many launches, input sets rotated past
2 x the L2, median of repetitions):
  - "sum":  torch.sum of an FP32 buffer (read-only; torch's vectorized reduction kernel);
  - "copy": a device-to-device copy of the buffer (reads and writes: 2 x the bytes).
Reported: microseconds per launch, effective read bandwidth, and the HBM floor at 4.45 TB/s.
Compare with the per-layer times of `resgen bench` (bench_qwen3_8b_table10.log, M = 1). What
the H200 run showed (bench/results/h200/read_floor.json): torch's sum is no floor at these
sizes (about 8 us of fixed cost: 9.6 us for the o layer's 9.4 MB, 20.5 us for gate_up's
56.6 MB, slower than resgen's layers); the copy streams 14-57 MB at 3.95-3.99 TB/s of read +
write traffic (89-90 % of 4.45 TB/s) and 9.4 MB at 3.39 TB/s, the rate a streaming kernel can
sustain at those sizes. Runs in well under a minute.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

HBM = 4.45e12


def nvfp4_bytes(n: int, k: int) -> int:
    """NVFP4 weight bytes of an N x K layer: codes (K / 2 per row) + E4M3 scales (K / 16)."""
    return n * (k // 2 + k // 16)


def sizes() -> dict[str, int]:
    from resgen.models import get_model

    out = {f"qwen3-8b {name}": nvfp4_bytes(n, k)
           for name, (n, k) in get_model("qwen3-8b").linear_nk().items()}
    for mb in (1, 2, 4, 8, 16, 32, 64, 128, 256):
        out[f"{mb} MiB"] = mb << 20
    return out


class _Reader:
    def __init__(self, nbytes: int, n_sets: int, mode: str):
        words = nbytes // 4
        # FP32 ones: an int32 sum into int64 ran at 0.5-0.7 TB/s on the H200 even at 256 MiB
        # (bound by its arithmetic); the FP32 sum reaches 3.9 TB/s there
        self.bufs = [torch.ones(words, dtype=torch.float32, device="cuda") for _ in range(n_sets)]
        self.dst = torch.empty_like(self.bufs[0]) if mode == "copy" else None
        self.out = torch.empty((), dtype=torch.float32, device="cuda")
        self.mode, self.cur = mode, 0

    def rotate(self, i: int) -> None:
        self.cur = i % len(self.bufs)

    def __call__(self):
        b = self.bufs[self.cur]
        if self.mode == "copy":
            return self.dst.copy_(b)
        return torch.sum(b, dim=0, out=self.out)


def main() -> int:
    from resgen.search.timing import DEFAULT_POLICY, measure

    rows = []
    for name, nbytes in sizes().items():
        n_sets = DEFAULT_POLICY.sets_for(nbytes)
        for mode in ("sum", "copy"):
            t = measure(_Reader(nbytes, n_sets, mode), DEFAULT_POLICY, n_sets=n_sets)
            moved = nbytes * (2 if mode == "copy" else 1)
            rows.append({"name": name, "bytes": nbytes, "mode": mode, "us": t.median_us,
                         "q": t.quantiles_us, "graph": t.mode, "n_sets": n_sets,
                         "tb_per_s": moved / (t.median_us * 1e-6) / 1e12,
                         "floor_us": moved / HBM * 1e6})
            torch.cuda.empty_cache()
    props = torch.cuda.get_device_properties(0)
    rep = {"gpu": props.name, "torch": torch.__version__, "policy": DEFAULT_POLICY.as_dict(),
           "hbm_bytes_per_s": HBM, "rows": rows}
    out = Path(os.environ.get("OUT", ROOT / "bench" / "results" / "h200"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "read_floor.json").write_text(json.dumps(rep, indent=1))
    print(f"{'size':22s} {'MB':>8s} {'mode':5s} {'us':>8s} {'TB/s':>6s} {'floor us':>9s} "
          f"{'% floor':>7s}")
    for r in rows:
        print(f"{r['name']:22s} {r['bytes'] / 1e6:8.2f} {r['mode']:5s} {r['us']:8.2f} "
              f"{r['tb_per_s']:6.2f} {r['floor_us']:9.2f} {100 * r['floor_us'] / r['us']:7.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
