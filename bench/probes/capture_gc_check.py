"""Python's garbage collector inside a CUDA graph capture, on the H200: a compiled kernel that
dies unloads its module in its finalizer, and if the collector runs that finalizer during a
capture (global mode), the capture fails ("operation failed due to a previous error during
capture"). Four captures of the same two torch ops, each with garbage made just before it:

1. no garbage, gc.collect() inside the capture (the control);
2. a freshly compiled KV append kernel (compile_append's uncached body), launched once and
   left in a reference cycle, gc.collect() inside the capture: expected to FAIL (the
   mechanism; a kernel never launched has no module loaded and fails nothing);
3. a dead bench/decode_step.py compensated stack in a reference cycle, gc.collect() inside
   the capture: resgen.ops and compile_append keep their kernels, so nothing of resgen dies;
4. the case-2 garbage, captured through resgen.search.timing.capture_graph (collects first and
   keeps the collector off during the capture).

    source .devcache/device/env.sh && RESGEN_CACHE_DIR=/tmp/resgen-cache \\
        timeout 150 python3 bench/probes/capture_gc_check.py      # -> $OUT/capture_gc_check.json
"""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402


def capture_with_collection(ops: Callable[[], None]) -> str:
    """'ok' or the first line of the error: ops() captured with a gc.collect() in the middle."""
    graph = torch.cuda.CUDAGraph()
    gc.disable()
    try:
        with torch.cuda.graph(graph):
            ops()
            gc.collect()
            ops()
        torch.cuda.synchronize()
        return "ok"
    except Exception as e:                     # the outcome is the measurement
        torch.cuda.synchronize()
        return "FAILED: " + str(e).splitlines()[0][:160]
    finally:
        gc.enable()


def dead_append_kernel() -> None:
    """A freshly compiled append kernel, launched once (its module is loaded at the first
    launch), wrapped in a launcher that refers to itself."""
    from resgen.kernels.attention_sm90 import KVAppendSm90, compile_append
    from resgen.kvcache import PagedKVCache

    res, _ = compile_append.__wrapped__(128, 8, 32)
    app = KVAppendSm90(res.fn, 128, 8, 32)
    dev = torch.device("cuda", torch.cuda.current_device())
    cache = PagedKVCache.empty(1, 8, 128, 32, device=dev)
    k = torch.randn(1, 8, 128, device=dev).to(torch.bfloat16)
    app(cache, k, k, torch.zeros(1, 1, dtype=torch.int32, device=dev),
        torch.zeros(1, 2, dtype=torch.int32, device=dev))
    torch.cuda.synchronize()
    app.cycle = app


def dead_stack() -> None:
    """A warmed-up, used compensated Qwen3-8B decode stack (one layer) that refers to itself."""
    import decode_step as S
    from resgen.models import get_model

    spec, dev = get_model("qwen3-8b"), torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator(device=dev).manual_seed(1)
    weights = [S.LayerWeights.random(spec, gen, dev)]
    h0 = torch.randn(1, spec.hidden, generator=gen, device=dev).to(torch.bfloat16)
    scales = S.input_scales(spec, S.Bf16Stack(spec, weights, 1, 4096, gen, dev), h0)
    st = S.ResgenStack(spec, weights, scales, True, 1, 4096, 32, gen, dev)
    st.warmup()
    st(h0)
    torch.cuda.synchronize()
    st.cycle = st


def main() -> int:
    from resgen.search.timing import capture_graph

    x = torch.randn(1 << 20, device="cuda")

    def ops() -> None:
        (x * 2).add_(1)

    class Runner:
        def rotate(self, i: int) -> None:
            pass

        def __call__(self) -> None:
            ops()

    results = {}
    gc.collect()
    results["no garbage"] = capture_with_collection(ops)
    dead_append_kernel()
    results["dead append kernel, collected inside"] = capture_with_collection(ops)
    gc.collect()
    dead_stack()
    results["dead decode stack, collected inside"] = capture_with_collection(ops)
    dead_append_kernel()
    try:
        capture_graph(Runner(), 1, 1)
        results["dead append kernel, timing.capture_graph"] = "ok"
    except Exception as e:                     # the outcome is the measurement
        results["dead append kernel, timing.capture_graph"] = "FAILED: " + str(e).splitlines()[0]
    for k, v in results.items():
        print(f"{k:40s} {v}")
    out = Path(os.environ.get("OUT", "bench/results/h200"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "capture_gc_check.json").write_text(json.dumps(
        {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "results": results},
        indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
