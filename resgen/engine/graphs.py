"""Decode steps replayed from CUDA graphs, one per (batch bucket, KV-length class).

A step of b live rows runs at the smallest batch bucket >= b (1, 2, 4, ..., max_batch; the
padded rows attend to nothing and write a scratch page) and at the KV class of its longest row
(a power of two >= 64: the attention plan's class, the dense cache's window). The first step
at a new (bucket, class) builds every plan (resgen.ops warmup: compiles, buffers), runs eagerly
(that is the real step, and the warm-up torch.cuda.graphs asks for) and is then captured; later
steps replay it. The graph reads and advances the static DecodeState itself, so a step costs
one replay. All graphs share one memory pool.

Capture follows the README's "CUDA graphs" lesson: Python garbage is collected before and the
collector is off during the capture (a finalizer unloading a CUDA module mid-capture breaks
it); a failed capture is retried once, then that (bucket, class) runs eagerly (recorded in
`notes`).
"""

from __future__ import annotations

import gc
from typing import Any

import torch

from .model import DecodeState, DecoderModel

__all__ = ["DecodeRunner", "MIN_KV_CLASS", "batch_buckets"]

MIN_KV_CLASS = 64
_MISSING = object()


def batch_buckets(max_batch: int) -> list[int]:
    """Powers of two below max_batch, then max_batch."""
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return out + [max_batch]


class DecodeRunner:
    """Runs decode steps of `model` over a static DecodeState (see the module docstring).
    graphs=False: every step eagerly (the CPU backends; a debugging aid on the GPU)."""

    def __init__(self, model: DecoderModel, max_batch: int, max_pages: int, graphs: bool
                 ) -> None:
        self.model = model
        self.max_batch = max_batch
        self.state = DecodeState.create(max_batch, max_pages, model.cfg.vocab_size,
                                        model.device)
        self.use_graphs = bool(graphs) and model.device.type == "cuda"
        self.buckets = batch_buckets(max_batch)
        self.graphs: dict[tuple[int, int], Any] = {}
        self.pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self.notes: list[str] = []

    def bucket(self, n: int) -> int:
        for b in self.buckets:
            if b >= n:
                return b
        raise ValueError(f"{n} rows exceed max_batch = {self.max_batch}")

    def kv_class(self, max_len: int) -> int:
        c = max(MIN_KV_CLASS, 1 << max(0, max_len - 1).bit_length())
        kv = self.model.kv
        if kv.kind != "nvfp4":
            c = min(c, kv.max_len)
        return c

    def step(self, b: int, max_len: int) -> torch.Tensor:
        """One decode step of the first b rows (a bucket) whose longest row holds max_len
        tokens after it -> the logits view float32 [b, V]."""
        c = self.kv_class(max_len)
        key = (b, c)
        g = self.graphs.get(key, _MISSING)
        if g is _MISSING:
            self.model.warmup(b, c)
            self.model.decode(self.state, b, c)
            self.graphs[key] = self._capture(b, c) if self.use_graphs else None
        elif g is None:
            self.model.decode(self.state, b, c)
        else:
            g.replay()
        return self.state.logits[:b]

    def _capture(self, b: int, c: int) -> Any:
        from ..search.timing import capture_with_retry

        def capture() -> torch.cuda.CUDAGraph:
            torch.cuda.synchronize()
            gc.collect()
            graph = torch.cuda.CUDAGraph()
            was = gc.isenabled()
            gc.disable()
            try:
                with torch.cuda.graph(graph, pool=self.pool):
                    self.model.decode(self.state, b, c)
            finally:
                if was:
                    gc.enable()
            return graph

        graph, note = capture_with_retry(capture, torch.cuda.synchronize)
        if note:
            self.notes.append(f"batch {b}, KV class {c}: {note}")
        return graph
