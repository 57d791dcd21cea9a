"""bench/engine_correctness.py and bench/engine_speed.py on the CPU: every piece the GPU runs
call, on a tiny random model, with the reference backend or the kernels' simulations standing
in for the GPU (the GPU runs themselves are the scripts' mains)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))

pytest.importorskip("transformers")

import engine_correctness as EC  # noqa: E402
import engine_speed as ES  # noqa: E402
import resgen  # noqa: E402
from test_engine import CALIB, _tokenizer_folder, tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    import transformers

    d = tmp_path_factory.mktemp("tok")
    _tokenizer_folder(d)
    tok = transformers.AutoTokenizer.from_pretrained(d)
    return tiny_model("qwen2", layers=1), tok


def test_correctness_cpu_reference_and_gpu_side_agree(tiny, tmp_path):
    model, tok = tiny
    g = torch.Generator().manual_seed(3)
    calib = torch.randint(0, 320, (2, 24), generator=g)
    evals = torch.randint(0, 320, (2, 12), generator=g)
    setup = EC.Setup(seq_len=12, n_calib=2, n_eval=2, seeds=2, new_tokens=3, batch=2)
    prompts = ["w5 w6 w7", "w9 w10"]
    cf = tmp_path / "calib.safetensors"
    cpu = EC.cpu_run(model, tok, calib, evals, setup, cf, [("nvfp4", "full"),
                                                           ("mxfp4", "0.125")], prompts,
                     log=lambda s: None, greedy_methods=(("nvfp4", "full"),))
    assert cf.is_file() and cf.stat().st_size < 4096          # amax + masks only
    rec = cpu["methods"]["nvfp4/full"]
    for io in ("bf16", "fp32"):
        b = rec[io]["band"]
        assert b["n"] == 3 and b["min"] <= rec[io]["ppl"] <= b["max"]
        assert math_ok(rec[io]["ppl"])
    assert len(rec["hashes"]) == 4 and len(rec["greedy"]) == 2
    assert "greedy" not in cpu["methods"]["mxfp4/0.125"]
    json.dumps(cpu)
    # the GPU side's function, with the reference backend standing in
    out = EC.gpu_method(model, tok, "nvfp4", "full", cf, evals, prompts, setup, rec,
                        backend="reference", check_seqs=[evals[0].tolist()])
    assert out["hashes_equal"] is True
    assert abs(out["ppl_glue_fp32"] / rec["bf16"]["ppl"] - 1) < 1e-6   # the same numerics
    assert out["teacher_forced"]["ok"], out["teacher_forced"]
    assert out["greedy_common_prefix"] == [3, 3]
    assert math_ok(out["ppl_decode_path_glue_fp32"]) and math_ok(out["ppl_glue_bf16"])
    assert EC.inside(out["ppl_glue_fp32"], rec["bf16"]["band"]) == out["inside_band_bf16io"]
    line = EC.table({"methods": {"nvfp4/full": out}, "cpu": cpu}).splitlines()[1]
    assert line.startswith("nvfp4 full residue |") and "ok" in line


def math_ok(x: float) -> bool:
    return x == x and 1 < x < 1e6


def test_teacher_forced_checks_run_the_kernel_path_and_name_a_wrong_kernel(tiny):
    model, _ = tiny
    llm = resgen.load(model, backend="sim", fmt="nvfp4", compensation="full", kv="nvfp4",
                      calib=CALIB, max_batch=2, max_seq_len=32, page_size=16)
    res = EC.teacher_forced(llm, [[5, 6, 7, 8, 9, 10, 11, 12]], [4])
    assert res["ok"], res
    # one prefill and three decode steps: 4 projections each, 4 appends, 3 attentions
    assert res["calls"] == {"linear": 16, "append": 4, "attention": 3}
    assert res["ops"]["append"]["rel_err"] == 0
    bad = resgen.load(model, backend="reference", fmt="nvfp4", compensation="full",
                      kv="nvfp4", calib=CALIB, max_batch=2, max_seq_len=32, page_size=16)
    o = bad.model.layers[0].o
    good = o.op
    o.op = lambda x: (good(x).float() * 1.01).to(x.dtype)      # a kernel 1% off
    o.op.warmup = good.warmup
    res = EC.teacher_forced(bad, [[5, 6, 7, 8, 9, 10]], [4])
    assert not res["ok"] and not res["ops"]["linear"]["ok"]
    assert "layers.0.o" in res["ops"]["linear"]["where"]


def test_a_captured_layer_is_checked_teacher_forced(tmp_path):
    from resgen.engine.backend import _empty_dispatcher, _ref_append, _RefAttention, \
        _sim_compile, _sim_quantizer

    m = tiny_model("qwen2", layers=2)
    ids = torch.randint(0, 320, (20,), generator=torch.Generator().manual_seed(4))
    cal = torch.randint(0, 320, (40,), generator=torch.Generator().manual_seed(5))
    cap = EC.capture_layer(m, ids, 1, cal)
    assert cap["q"].shape == (20, 4, 64) and cap["v"].shape == (20, 2, 64)
    assert cap["x.down_in"].shape == (20, 256) and cap["w.qkv"].shape == (512, 128)
    path = tmp_path / "layer.safetensors"
    EC.capture_file(cap, path, (4, 2))
    d = _empty_dispatcher()
    lin = dict(family="linear_sm90_wgmma", dispatcher=d, compile_fn=_sim_compile,
               quantizer_fn=_sim_quantizer)
    att = dict(dispatcher=d, compile_fn=lambda *a: None,
               op_fn=lambda c, v, p: _RefAttention(p.compensation, torch.bfloat16, True))
    res = EC.check_layer(path, torch.device("cpu"), lin, att, _ref_append(True))
    assert res["ok"], res
    assert res["calls"] == {"linear": 2 * 3 * 3, "append": 1, "attention": 4}   # 3 projections


def test_speed_script_cpu_mode(tmp_path, capsys):
    out = tmp_path / "speed.json"
    rc = ES.main(["--cpu", "--stacks", "comp,w4a16,bf16,hf", "--batches", "1,2", "--out",
                  str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    res = json.loads(out.read_text())
    assert set(res["stacks"]) == {"comp", "w4a16", "bf16", "hf"}
    assert all(p["tok_s"] > 0 for p in res["stacks"]["w4a16"]["points"] if p["fits"])
    comp = res["stacks"]["comp"]
    assert comp["kv"]["kind"] == "nvfp4" and comp["prefill"]["prefill_tok_s"] > 0
    pts = {(p["batch"], p["context"]): p for p in comp["points"]}
    assert set(pts) == {(1, 64), (1, 128), (2, 64), (2, 128)}
    assert all(p["tok_s"] > 0 for p in pts.values() if p["fits"])
    assert res["stacks"]["bf16"]["kv"]["kind"] == "bf16"
    assert "comp/bf16" in text.splitlines()[-8] or "comp/bf16" in text
    assert "estimate:" in text


def test_speed_helpers():
    cfg = ES.qwen3_config()
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]) == \
        (4096, 36, 151936)
    w = ES.RandomWeights(ES.tiny_config(), torch.device("cpu"))
    a, b = w["model.layers.0.mlp.down_proj.weight"], w["model.layers.0.mlp.down_proj.weight"]
    assert torch.equal(a, b) and a.dtype == torch.bfloat16 and a.shape == (128, 256)
    assert float(a.float().std()) == pytest.approx(256 ** -0.5, rel=0.1)
    assert not torch.equal(w["model.layers.0.mlp.up_proj.weight"],
                           w["model.layers.0.mlp.gate_proj.weight"])
    assert ES.classify("kernel_cutlass_linear_kernel_x") == "resgen"
    assert ES.classify("nvjet_sm90_tst_192x8") == "cublas"
    assert ES.classify("void at::native::vectorized_layer_norm_kernel") == "glue"
    assert ES.estimate(["comp", "hf"], [1, 8], [8192], [(1, 8192)]) > 0


def test_speed_points_stay_inside_the_kv_they_size():
    """Every step a decode point runs stays inside the dense BF16 cache the stack sized (the
    H200's first run indexed past its rows: 2 + 2 x steps steps ran, steps + 4 were sized).
    On the CPU an index past the cache raises, so the stack's points carry no error."""
    cfg = ES.tiny_config()
    rec = ES.run_engine_stack("bf16", cfg, torch.device("cpu"), [1, 2], [64], 24, 32,
                              "reference", lambda s: None)
    assert [p.get("error") for p in rec["points"]] == [None, None]
    assert all(p["fits"] for p in rec["points"])


def test_merged_speed_runs_keep_every_runs_points():
    """--merge: a stack measured in two runs keeps the points of both (the later run's point
    replacing the earlier's at the same batch and context)."""
    a = {"stacks": {"comp": {"points": [{"batch": 1, "context": 8192, "tok_s": 250.0}],
                             "prefill": {"length": 2048}}}}
    b = {"stacks": {"comp": {"points": [{"batch": 32, "context": 8192, "tok_s": 3500.0},
                                        {"batch": 1, "context": 8192, "tok_s": 260.0}]},
                    "plain": {"points": [{"batch": 32, "context": 8192, "tok_s": 3700.0}]}}}
    m = ES.merge_runs([a, b])
    assert {(p["batch"], p["tok_s"]) for p in m["stacks"]["comp"]["points"]} == \
        {(1, 260.0), (32, 3500.0)}
    assert m["stacks"]["comp"]["prefill"] == {"length": 2048} and "plain" in m["stacks"]


def test_compare_of_a_bad_file_is_one_line(tmp_path, capsys):
    """engine_correctness --compare with a missing or foreign JSON: one line, exit 2."""
    bad = tmp_path / "not_a_run.json"
    bad.write_text('{"methods": {}}')
    for path in (tmp_path / "missing.json", bad):
        assert EC.main(["--compare", str(path)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("engine_correctness --compare:"), err


def test_speed_compiled_glue_stacks_and_their_ratio_column():
    """X-compiled is engine stack X with compile="glue"; the table gives X-c / X per point."""
    assert ES.engine_spec("comp-compiled") == {**ES.ENGINE["comp"], "compile": "glue"}
    assert ES.engine_spec("comp") == {**ES.ENGINE["comp"], "compile": "none"}
    assert ES.engine_spec("hf-compiled") is None and not ES.known("hf-compiled")
    assert ES.known("w4a16-compiled") and ES.known("hf")
    assert ES.main(["--stacks", "comp,nope-compiled", "--cpu"]) == 2
    pt = {"batch": 1, "context": 8192, "fits": True}
    res = {"stacks": {"comp": {"points": [{**pt, "tok_s": 250.0}]},
                      "comp-compiled": {"points": [{**pt, "tok_s": 300.0}]}}}
    text = ES.table(res)
    head, row = text.splitlines()[:2]
    assert "comp-c/comp" in head and "comp-compiled" in head
    assert row.split()[-1] == "1.20"
    assert ES.estimate(["comp-compiled"], [1, 8], [8192], []) > \
        ES.estimate(["comp"], [1, 8], [8192], [])
