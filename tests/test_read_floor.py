"""bench/probes/gpu_read_floor.py on the CPU: its sizes are the NVFP4 bytes whose HBM floor the
benchmarks report (the Qwen3-8B M = 1 floors of `resgen bench`: 3.18 / 2.12 / 12.72 / 6.36 us)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench" / "probes"))

import gpu_read_floor as G  # noqa: E402


def test_sizes_are_the_layers_nvfp4_bytes():
    s = G.sizes()
    floors = {k.split()[-1]: round(v / G.HBM * 1e6, 2) for k, v in s.items()
              if k.startswith("qwen3-8b")}
    assert floors == {"qkv": 3.18, "o": 2.12, "gate_up": 12.72, "down": 6.36}
    assert G.nvfp4_bytes(16, 64) == 16 * (32 + 4)
    assert s["1 MiB"] == 1 << 20 and all(v % 4 == 0 for v in s.values())
