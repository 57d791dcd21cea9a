"""The check every linear GPU test makes of a family runner (imported by the tests in this
folder; pytest puts the folder on sys.path)."""

from __future__ import annotations

import torch


def check_runner(r, v, m: int, k: int, *, reruns: bool = True) -> None:
    """`r.check()` twice: each on fresh random inputs and NaN-poisoned outputs, against the
    FP32 reference of the same quantized values; the second sees whatever state the first
    left (barriers, split-K workspace). Then, where `reruns` and `v.deterministic`, two runs
    of one fresh (m, k) input must give bit-identical BF16 outputs."""
    for _ in range(2):
        res = r.check()
        assert res.ok, f"{v.name()} m={m}: {res.detail} (rel {res.rel_err:.3e})"
    if reruns and v.deterministic:
        x = torch.randn(m, k, device="cuda")
        a, b = r.run_on(x), r.run_on(x)
        torch.cuda.synchronize()
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), \
            f"{v.name()} m={m}: reruns differ"


def check_graph_replay(r) -> None:
    """A runner with two input sets and a launcher holding split-K / stream-K semaphores: input
    set 1 run eagerly, then captured into a CUDA graph over a NaN-poisoned output and replayed
    three times; the replays must equal the eager output bit for bit, and the semaphores must be
    back at zero after the eager run and after the replays."""
    r.rotate(1)
    eager = r().clone()
    torch.cuda.synchronize()
    assert int(r.launcher.sem.abs().sum()) == 0
    g = torch.cuda.CUDAGraph()
    r.out.fill_(float("nan"))
    with torch.cuda.graph(g):
        r()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    assert torch.equal(r.out.view(torch.int16), eager.view(torch.int16))
    assert int(r.launcher.sem.abs().sum()) == 0


def check_layer_graph_behind_the_quantizer(r) -> None:
    """A runner with two input sets and the layer quantizer attached (PDL variants right
    behind it): the whole layer checked twice on fresh inputs, then three layers captured in
    one CUDA graph (the programmatic edges let each GEMM start under its quantizer) and
    replayed over a NaN-poisoned output; it must equal an eager run on input set 1 bit for
    bit."""
    for _ in range(2):
        res = r.check_quantized()
        assert res.ok, f"{res.detail} (rel {res.rel_err:.3e})"
    r.rotate(1)
    eager = r().clone()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    r.out.fill_(float("nan"))
    with torch.cuda.graph(g):
        for _ in range(3):
            r()
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(r.out.view(torch.int16), eager.view(torch.int16))
