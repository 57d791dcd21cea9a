"""Model registry: Qwen3 shapes per tensor-parallel degree, HF configs, workload lists."""

from __future__ import annotations

import json

import pytest

from resgen.models import (COMPENSATIONS, MODELS, ModelSpec, attention_problems, get_model,
                           linear_problems)
from resgen.search.variant import AttentionProblem, LinearProblem


def shapes(name, tp=1):
    return {s.name: (s.n, s.k) for s in get_model(name).linear_shapes(tp)}


def test_qwen3_8b_matches_the_benchmark_shapes():
    # ../shared/BENCH.md: qkv 6144x4096, o 4096x4096, gate/up 24576x4096, down 4096x12288.
    assert shapes("qwen3-8b") == {"qkv": (6144, 4096), "o": (4096, 4096),
                                  "gate_up": (24576, 4096), "down": (4096, 12288)}


@pytest.mark.parametrize("name,hidden,inter,heads,kv", [
    ("qwen3-4b", 2560, 9728, 32, 8), ("qwen3-8b", 4096, 12288, 32, 8),
    ("qwen3-32b", 5120, 25600, 64, 8)])
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_shapes_follow_the_config_formulas(name, hidden, inter, heads, kv, tp):
    s = shapes(name, tp)
    d = 128
    q, kvr = heads // tp * d, max(kv // tp, 1) * d
    assert s["qkv"] == (q + 2 * kvr, hidden)
    assert s["o"] == (hidden, q)
    assert s["gate_up"] == (2 * inter // tp, hidden)
    assert s["down"] == (hidden, inter // tp)
    g = get_model(name).attention(tp)
    assert (g.q_heads, g.kv_heads, g.head_dim) == (heads // tp, max(kv // tp, 1), d)


def test_kv_heads_are_replicated_beyond_their_count():
    m = get_model("qwen3-32b")
    g = m.attention(16)                      # 64 heads / 16 = 4 per rank; 8 KV heads < 16
    assert (g.q_heads, g.kv_heads) == (4, 1)
    assert {s.name: s.n for s in m.linear_shapes(16)}["qkv"] == (4 + 2) * 128
    with pytest.raises(ValueError):
        m.attention(3)                       # does not divide 64 heads
    with pytest.raises(ValueError):
        get_model("qwen3-8b").linear_shapes(0)
    with pytest.raises(ValueError):
        ModelSpec("odd", 64, 64, heads=12, kv_heads=8, head_dim=8, layers=1)
    with pytest.raises(ValueError):
        ModelSpec("x", 64, 64, heads=8, kv_heads=4, head_dim=8, layers=1).attention(3)


def test_registry_names_and_hf_configs(tmp_path):
    assert get_model("Qwen/Qwen3-8B") is MODELS["qwen3-8b"]
    assert get_model("QWEN3-4B") is MODELS["qwen3-4b"]
    cfg = {"hidden_size": 4096, "intermediate_size": 12288, "num_attention_heads": 32,
           "num_key_value_heads": 8, "head_dim": 128, "num_hidden_layers": 36,
           "model_type": "qwen3"}
    spec = get_model(cfg)
    assert spec.linear_shapes() == MODELS["qwen3-8b"].linear_shapes()
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    assert get_model(tmp_path / "m").linear_shapes(2) == MODELS["qwen3-8b"].linear_shapes(2)
    assert get_model(str(tmp_path / "m" / "config.json")).name == "m"
    # Llama-style config without head_dim or kv heads: derived.
    llama = {"hidden_size": 2048, "intermediate_size": 5632, "num_attention_heads": 16,
             "num_hidden_layers": 22}
    s = ModelSpec.from_hf_config(llama)
    assert (s.head_dim, s.kv_heads) == (128, 16)
    for bad in ({**llama, "hidden_size": 0}, {**llama, "num_attention_heads": "16"},
                {k: v for k, v in llama.items() if k != "intermediate_size"}):
        with pytest.raises(ValueError):
            ModelSpec.from_hf_config(bad)
    with pytest.raises(TypeError):
        ModelSpec.from_hf_config([1, 2])
    with pytest.raises(ValueError, match="unknown model"):
        get_model("qwen9-1t")
    (tmp_path / "bad.json").write_text("{nope")
    with pytest.raises(ValueError, match="not JSON"):
        get_model(tmp_path / "bad.json")


def test_workload_lists():
    m8 = get_model("qwen3-8b")
    ps = linear_problems([m8], 1, ("nvfp4", "mxfp4"), COMPENSATIONS, (1, 16))
    assert len(ps) == 4 * 2 * 6 * 2 and len(set(ps)) == len(ps)
    assert all(isinstance(p, LinearProblem) for p in ps)
    assert {(p.n, p.k) for p in ps} == {(6144, 4096), (4096, 4096), (24576, 4096),
                                        (4096, 12288)}
    assert {p.compensation for p in ps} == set(COMPENSATIONS)
    both = linear_problems([m8, m8], 1, ("nvfp4",), ("none",), (1,))
    assert len(both) == 4                                  # duplicates removed
    att = attention_problems([m8], 1, (1, 8), (8192, 32768))
    assert len(att) == 2 * 2 * 2 * 2 and all(isinstance(a, AttentionProblem) for a in att)
    assert {(a.q_heads, a.kv_heads, a.head_dim) for a in att} == {(32, 8, 128)}
    assert {a.compensation for a in att} == {True, False}
    assert {a.pv for a in att} == {"f16", "fp8"}


def test_linear_nk_is_linear_shapes_as_a_mapping():
    spec = MODELS["qwen3-8b"]
    assert spec.linear_nk(2) == {s.name: (s.n, s.k) for s in spec.linear_shapes(2)}
    assert list(spec.linear_nk()) == ["qkv", "o", "gate_up", "down"]
