"""Host (Python) cost of one eager resgen.ops.Linear call, with no-op stand-ins for the kernel
and the quantizer, so only the op's own dispatch, checks, allocation and launcher plumbing are
timed. CPU:

    PYTHONPATH=. python3 bench/ops_host_overhead.py

Prints microseconds per call (the README quotes the figure of the 2-core development machine).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import torch  # noqa: E402

from resgen.ops import Linear  # noqa: E402
from resgen.search.linear_sm90_wgmma import LinearSm90WgmmaVariant  # noqa: E402


class _NoopQuantizer:
    class config:  # noqa: N801  (duck-typed QuantKernel.config)
        alpha = "static"

    class _Op:
        def __init__(self, xop, alpha):
            self.xop, self.alpha = xop, alpha

    def __init__(self, k: int):
        self.xop = torch.zeros(16, k, dtype=torch.bfloat16)

    def outputs(self, m, row_multiple=1, device="cpu"):
        return None

    def __call__(self, xb, outs, alpha=None, masks=None):
        return self._Op(self.xop, alpha)


def host_us(n_calls: int = 2000, k: int = 4096, n: int = 4096) -> float:
    from test_linear_sm90_wgmma import _qweight

    q = _NoopQuantizer(k)
    layer = Linear(_qweight("nvfp4", n=n, k=k), "full", device="cpu",
                   variant=LinearSm90WgmmaVariant(1, 1, 16, 3),
                   compile_fn=lambda *a: (lambda *b: None), quantizer_fn=lambda p, a: q)
    x = torch.randn(1, k).to(torch.bfloat16)
    for _ in range(100):
        layer(x)
    t = time.perf_counter()
    for _ in range(n_calls):
        layer(x)
    return (time.perf_counter() - t) / n_calls * 1e6


if __name__ == "__main__":
    print(f"eager Linear call, no-op kernel and quantizer: {host_us():.1f} us of host time")
