"""Compiled glue (resgen.load(..., compile="glue"): the torch glue between the kernels through
torch.compile / Triton) on the GPU engine with tiny random Qwen2 / Qwen3 models: against the
eager glue, its CUDA-graph replays against its own eager steps (the compiled kernels are
captured, deterministic), and fewer glue kernels in a profiled replay.

    source .devcache/device/env.sh && python3 -m pytest -q tests/gpu/test_engine_glue_gpu.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "gpu"))
sys.path.insert(0, str(ROOT / "bench"))

pytest.importorskip("transformers")

import test_engine_gpu as EG  # noqa: E402
from resgen.engine import glue as G  # noqa: E402
from test_engine import tiny_model  # noqa: E402
from test_engine_gpu import PLENS, SEQS  # noqa: E402


def _cuda(m, **kw):
    """test_engine_gpu's engine with the serving glue (BF16) unless told otherwise."""
    return EG._cuda(m, **{"glue": "bf16", **kw})


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
@pytest.mark.parametrize("fmt, comp, kv", [("nvfp4", "full", "nvfp4"),
                                           ("bf16", "none", "bf16")])
def test_compiled_glue_follows_eager_glue(kind, fmt, comp, kv):
    """Teacher-forced logits, compiled vs eager BF16 glue, both in CUDA graphs: the prefill's
    (first predicted position) within 2e-2, every decode step's within 0.15 for the FP4 engine
    (a rounding moved by Triton's reduction order or rsqrt can flip an FP4 code of the next
    quantization, as in test_engine_gpu's GPU-vs-CPU bounds) and 2e-2 for the BF16 engine (no
    FP4 code to flip). Printed: whether they are bit-identical (they are on the CPU, C++
    inductor with emulate_precision_casts). Every region ran compiled, every step captured."""
    m = tiny_model(kind)
    kw = dict(fmt=fmt, compensation=comp, kv=kv)
    if fmt == "bf16":
        kw.pop("compensation")
        kw["calib"] = None
    c = _cuda(m, compile="glue", **kw)
    e = _cuda(m, **kw)
    got = c.forced_decode(SEQS, PLENS, reduce="logits")
    want = e.forced_decode(SEQS, PLENS, reduce="logits")
    bound = 0.15 if fmt != "bf16" else 2e-2
    for x, y in zip(got, want):
        assert bool(torch.isfinite(x).all())
        print(f"{kind} {fmt}: bit-identical {torch.equal(x, y)}, prefill {_rel(x[:1], y[:1]):.2e}"
              f", all {_rel(x, y):.2e}")
        assert _rel(x[:1], y[:1]) < 2e-2
        assert _rel(x, y) < bound
    assert c.glue_notes == [], c.glue_notes
    ran = c.model.glue_fns.compiled()
    assert set(ran[("decode", 2)]) == set(G.REGIONS)
    assert c.runner.graphs and all(g is not None for g in c.runner.graphs.values()), \
        c.runner.notes


def test_compiled_glue_graph_replays_equal_its_eager_steps():
    """The compiled regions inside the engine's CUDA graphs replay exactly what they compute
    eagerly (compiled before the capture; Triton's kernels deterministic)."""
    m = tiny_model("qwen3")
    a = _cuda(m, fmt="nvfp4", compensation="full", kv="nvfp4", compile="glue", graphs=True)
    b = _cuda(m, fmt="nvfp4", compensation="full", kv="nvfp4", compile="glue", graphs=False)
    for x, y in zip(a.forced_decode(SEQS, PLENS, reduce="logits"),
                    b.forced_decode(SEQS, PLENS, reduce="logits")):
        assert torch.equal(x, y)
    assert any(g is not None for g in a.runner.graphs.values())
    gen = a.generate(SEQS, max_new_tokens=8)
    assert [o.token_ids for o in gen] == [o.token_ids for o in a.generate(SEQS,
                                                                          max_new_tokens=8)]
    assert a.last_stats["glue_notes"] == [] and not a.last_stats["graph_notes"]


def test_compiled_glue_launches_fewer_glue_kernels_per_replay():
    """bench/engine_speed.py's batch-1 profile of one graph replay (tiny Qwen3, context 64):
    glue kernels (everything but resgen's and cuBLAS's) per step, compiled < eager."""
    import engine_speed as ES

    m = tiny_model("qwen3")
    per = {}
    for mode in ("none", "glue"):
        llm = _cuda(m, fmt="nvfp4", compensation="full", kv="nvfp4", compile=mode,
                    max_batch=1)
        ov = ES.overhead_point(llm, 64, 4, ES.Timer(llm.device))
        assert "kernels_per_step" in ov, ov
        per[mode] = ov["kernels_per_step"]
    print("kernels per replay:", per)
    assert per["glue"]["glue"] < per["none"]["glue"]
    assert per["glue"]["resgen"] == per["none"]["resgen"]
