"""The quality pipeline on a tiny random Llama (no download): hooks, evaluation, report."""

from __future__ import annotations

import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from resgen import formats  # noqa: E402
from resgen.calibrate import load_layers, prepare_weight, read_metadata, save_layers  # noqa: E402
from resgen.quality import report  # noqa: E402
from resgen.quality.capture import calibrate_sites, capture_grads, capture_inputs, site_of  # noqa: E402
from resgen.quality.evaluate import gap_closed, layer_nmse, nmse_reduction, perplexity  # noqa: E402
from resgen.quality.fakequant import FakeQuantLinear, qdq  # noqa: E402
from resgen.quality.model import quantizable_linears, replace_linears, split_tokens  # noqa: E402
from resgen.quality.selection import channel_scores, select  # noqa: E402
from resgen.quality.study import Method  # noqa: E402


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.requires_grad_(False)
    seqs = torch.randint(0, 96, (3, 16))
    return model, seqs


def test_split_is_disjoint_and_sized():
    ids = torch.arange(1000)
    sp = split_tokens(ids, seq_len=50, n_calib=4, n_eval=6)
    assert sp.calib.shape == (4, 50) and sp.eval.shape == (6, 50)
    assert int(sp.calib.max()) < sp.boundary <= int(sp.eval.min())
    with pytest.raises(ValueError):
        split_tokens(ids, seq_len=400, n_calib=4, n_eval=1)


def test_site_names():
    assert site_of("layers.3.self_attn.k_proj") == "layers.3.attn_in"
    assert site_of("layers.0.mlp.up_proj") == site_of("layers.0.mlp.gate_proj")
    with pytest.raises(ValueError):
        site_of("layers.0.mlp.act_fn")


def test_calibration_statistics_match_captured_inputs(tiny):
    model, seqs = tiny
    stats = calibrate_sites(model, seqs, batch=2, hessian=True)
    rows = capture_inputs(model, seqs, batch=3)
    assert set(stats) == set(rows) and len(stats) == 2 * 4
    for site, x in rows.items():
        st = stats[site]
        assert st.count == x.shape[0] == seqs.numel()
        torch.testing.assert_close(st.channel.mean_abs(), x.double().abs().mean(0))
        torch.testing.assert_close(st.hessian, x.double().T @ x.double(), rtol=1e-5, atol=1e-4)
        assert st.amax == pytest.approx(float(x.abs().max()))
        # Residue energy is per forward call (dynamic scale): batch 2 then 1 sequence.
        r = torch.cat([x[:32] - qdq(x[:32], "nvfp4"), x[32:] - qdq(x[32:], "nvfp4")])
        torch.testing.assert_close(st.mean_res_sq("nvfp4"), (r.double() ** 2).mean(0))


def test_error_aware_scores_weight_the_residue_by_column_norms(tiny):
    model, seqs = tiny
    st = calibrate_sites(model, seqs, batch=3)["layers.0.attn_in"]
    w = torch.randn(32, 64)
    w[:, 5] = 0.0                       # a channel no output reads: nothing to compensate
    s = channel_scores("error", st, w, "nvfp4")
    assert float(s[5]) == 0.0
    torch.testing.assert_close(s, st.mean_res_sq("nvfp4") * (w.double() ** 2).sum(0))
    sel = select("error", st, w, "nvfp4", 0.25)
    per_group = torch.zeros(8, dtype=torch.long).index_add_(
        0, sel.indices // 8, torch.ones_like(sel.indices))
    assert bool((per_group == 2).all())                   # exactly k = 2 per 8-channel group
    assert 5 not in sel.indices.tolist()
    with pytest.raises(ValueError):
        channel_scores("random", st, w, "nvfp4")


def test_grads_align_with_outputs(tiny):
    model, seqs = tiny
    g = capture_grads(model, seqs, batch=2)
    lin = quantizable_linears(model)
    assert set(g) == set(lin)
    for name, mod in lin.items():
        assert g[name].shape == (seqs.numel(), mod.out_features)
    # Batching must not change the gradients (the loss is rescaled per batch).
    g1 = capture_grads(model, seqs, batch=3)
    for name in lin:
        torch.testing.assert_close(g[name], g1[name], rtol=1e-4, atol=1e-7)
    assert float(g["layers.1.mlp.down_proj"].abs().sum()) > 0


def test_quantized_model_perplexity_and_layer_nmse(tiny):
    model, seqs = tiny
    ref = perplexity(model, seqs, batch=2)
    assert ref["tokens"] == 3 * 15 and math.isclose(ref["ppl"], math.exp(ref["nll"]))
    lin = quantizable_linears(model)
    x = capture_inputs(model, seqs)
    out = {}
    for comp in ("none", "full"):
        mods = {n: FakeQuantLinear(prepare_weight(m.weight, "mxfp4"), comp)
                for n, m in lin.items()}
        out[comp] = {n: layer_nmse(mods[n], x[site_of(n)], lin[n].weight) for n in lin}
        old = replace_linears(model, mods)
        try:
            q = perplexity(model, seqs, batch=3)
        finally:
            replace_linears(model, old)
        assert q["tokens"] == ref["tokens"] and q["ppl"] != ref["ppl"]
    assert all(isinstance(m, torch.nn.Linear) for m in quantizable_linears(model).values())
    assert perplexity(model, seqs, batch=2)["ppl"] == pytest.approx(ref["ppl"], rel=1e-6)
    red = nmse_reduction(out["full"], out["none"])
    assert red["layers"] == len(lin) and red["mean_layer"] > 0     # full residue helps


def test_gap_closed_and_reduction_arithmetic():
    assert gap_closed(15.0, 20.0, 10.0) == pytest.approx(0.5)
    assert gap_closed(25.0, 20.0, 10.0) == pytest.approx(-0.5)
    with pytest.raises(ValueError):
        gap_closed(1.0, 10.0, 12.0)
    red = nmse_reduction({"a": 0.5, "b": 2.0}, {"a": 1.0, "b": 2.0})
    assert red["mean_layer"] == pytest.approx(0.25)
    assert red["geomean"] == pytest.approx(1 - math.sqrt(0.5))


def test_method_validation_and_grid():
    with pytest.raises(ValueError):
        Method("mxfp4", "full", input_scale="static")
    with pytest.raises(ValueError):
        Method("nvfp4", "plan")
    with pytest.raises(ValueError):
        Method("nvfp4", 0.3)
    paper = report.methods_for("paper")
    full = report.methods_for("full")
    assert len(set(paper)) == len(paper) and len(set(full)) == len(full)
    assert set(paper) <= set(full)
    assert Method("nvfp4", 0.25, score="error") in full
    with pytest.raises(ValueError):
        report.methods_for("everything")


def _fake_results():
    names = ["layers.0.self_attn.q_proj", "layers.0.mlp.down_proj"]
    res = [{"method": Method("nvfp4", "ref").to_json(), "ppl": 10.0}]
    ppl = {"none": 20.0, "full": 14.0}
    for fmt in formats.FORMATS:
        for comp, p in ppl.items():
            res.append({"method": Method(fmt, comp).to_json(), "ppl": p + (fmt == "mxfp4"),
                        "effective_bits": 4.0 if comp == "none" else 8.0,
                        "layer_nmse": {n: (1.0 if comp == "none" else 0.7) for n in names}})
    return res


def test_summary_targets_and_markdown():
    res = _fake_results()
    s = report.summarize(res)
    full_nv = next(r for r in s["rows"] if r["label"] == "NVFP4 full residue")
    assert full_nv["gap_closed"] == pytest.approx(0.6)
    assert full_nv["nmse_reduction"]["mean_layer"] == pytest.approx(0.3)
    t = {x["target"].split(":")[0]: x for x in s["targets"]}
    assert t["nvfp4 full residue"]["met"]
    doc = {"suite": "paper", "summary": s, "results": res,
           "model": {"reference": "r", "n_linear_layers": 2, "kept_fp32": "e"},
           "text": {"source": "t", "total_tokens": 1, "calib_tokens": 1, "calib_sequences": 1,
                    "seq_len": 1, "eval_tokens": 1, "eval_sequences": 1,
                    "nmse_rows_per_layer": 1},
           "numerics": {"activation_scale": "dynamic"}, "timings": {"total_s": 60.0},
           "machine": {"cpu_threads": 2}}
    md = report.to_markdown(doc)
    assert "| NVFP4 full residue | 8.000 | 14.000 | 60.0% | 30.0% (30.0%) |" in md
    assert "layers.0.mlp.down_proj" in md


def test_checkpoint_metadata_round_trip(tmp_path):
    w = torch.randn(16, 64)
    layers = {"model.layers.0.mlp.down_proj": prepare_weight(w, "nvfp4")}
    path = tmp_path / "plan.safetensors"
    save_layers(path, layers, metadata={"resgen_plan": '{"budget": 5.0}'})
    assert read_metadata(path)["resgen_plan"] == '{"budget": 5.0}'
    assert set(load_layers(path)) == set(layers)
    with pytest.raises(ValueError):
        save_layers(path, layers, metadata={"resgen_format": "mxfp4"})     # reserved key


def test_cli_rejects_bad_arguments():
    from resgen.quality.cli import plan_main, report_main

    with pytest.raises(SystemExit):
        plan_main(["--budget", "3.0"])                    # below plain FP4's 4 bits
    with pytest.raises(SystemExit):
        plan_main(["--budget", "5.0", "--fmt", "int4"])
    with pytest.raises(SystemExit):
        report_main(["--suite", "all"])
    with pytest.raises(SystemExit):
        report_main(["--eval-seqs", "0"])


def test_study_plan_export_on_a_tiny_model(tiny, tmp_path):
    import json

    from resgen.plan import effective_bits
    from resgen.quality.plan_export import export_plan
    from resgen.quality.study import Study, StudyConfig

    model, _ = tiny
    cfg = StudyConfig(seq_len=16, n_calib=3, n_eval=2, n_nmse=1, n_grad=2, batch=2)
    tokens = torch.randint(0, 96, (400,), generator=torch.Generator().manual_seed(1))
    study = Study(cfg, need_hessian=True, model=model, tokens=tokens, log=lambda s: None)
    m = Method("nvfp4", "plan", score="error", budget=5.0)
    scores = study.plan_scores(m)
    for name, sc in scores.items():
        # More compensation never hurts much: full residue beats plain on every layer.
        assert sc[1.0] < sc[0.0], name
    out = tmp_path / "plan.safetensors"
    table = export_plan(cfg, out, budget=5.0, study=study)
    assert "effective bits" in table
    meta = json.loads(read_metadata(out)["resgen_plan"])
    layers = load_layers(out)
    assert set(layers) == set(meta["ratios"]) == {f"model.{n}" for n in study.weight}
    assert meta["effective_bits"] <= 5.0 + 1e-12
    ratios = {n[len("model."):]: r for n, r in meta["ratios"].items()}
    assert effective_bits(study.shapes(), ratios) == pytest.approx(meta["effective_bits"])
    for name, r in meta["ratios"].items():
        # K-Ext layers carry their selection; plain and full layers store the base weight.
        assert layers[name].ratio == (r if r not in (0.0, 1.0) else None)
    res = study.evaluate(m)
    assert res["effective_bits"] == pytest.approx(meta["effective_bits"])
    with pytest.raises(ValueError):
        Study(cfg, model=model, log=lambda s: None)          # no tokens for a preloaded model


def test_planner_is_compared_with_the_best_uniform_ratio_at_no_fewer_bits():
    res = _fake_results()
    nmse = {"layers.0.self_attn.q_proj": 0.8, "layers.0.mlp.down_proj": 0.8}
    for comp, score, bits, ppl in [(0.125, "mean_abs", 4.54, 18.0), (0.125, "error", 4.54, 17.5),
                                   (0.25, "mean_abs", 5.0, 16.0)]:
        res.append({"method": Method("nvfp4", comp, score=score).to_json(), "ppl": ppl,
                    "effective_bits": bits, "layer_nmse": nmse})
    res.append({"method": Method("nvfp4", "plan", score="error", budget=4.5).to_json(),
                "ppl": 17.7, "effective_bits": 4.5, "layer_nmse": nmse})
    s = report.summarize(res)
    t = [x for x in s["targets"] if x["target"].startswith("NVFP4 plan")]
    assert len(t) == 1
    # The comparison is the error-score 0.125 run (best at the fewest bits >= 4.5), which wins.
    assert t[0]["measured"] == {"plan_ppl": 17.7, "uniform_ppl": 17.5} and not t[0]["met"]


def test_summary_of_a_partial_run_skips_what_is_missing():
    """An assembled report of an interrupted run: a format without its plain / full rows is
    left out of the targets instead of failing."""
    res = [r for r in _fake_results() if r["method"]["fmt"] == "nvfp4"]
    s = report.summarize(res)
    assert {t["target"].split(" ")[0] for t in s["targets"]} == {"nvfp4"}
    assert report.summarize(res[:1])["rows"] == []


def test_perplexity_reports_each_sequences_nll(tiny):
    model, seqs = tiny
    r = perplexity(model, seqs, batch=2)
    assert len(r["seq_nll"]) == seqs.shape[0]
    # equal-length sequences: the mean of the per-sequence means is the overall mean
    assert sum(r["seq_nll"]) / len(r["seq_nll"]) == pytest.approx(r["nll"], rel=1e-6)
    one = perplexity(model, seqs[1:2], batch=1)
    assert one["seq_nll"][0] == pytest.approx(r["seq_nll"][1], rel=1e-6)


def test_paired_nll_difference():
    from resgen.quality.evaluate import paired_nll_difference

    d = paired_nll_difference([1.0, 2.0, 3.0], [0.5, 1.5, 2.0])
    assert d["mean"] == pytest.approx((0.5 + 0.5 + 1.0) / 3) and d["n"] == 3
    assert d["se"] == pytest.approx(torch.tensor([0.5, 0.5, 1.0]).std().item() / math.sqrt(3))
    with pytest.raises(ValueError, match="equal-length"):
        paired_nll_difference([1.0, 2.0], [1.0])


def test_presum_methods_validate_label_and_keep_old_records_matching():
    ps = Method("nvfp4", "full", fold="presum")
    assert ps.label() == "NVFP4 full residue fold=presum" and ps.to_json()["fold"] == "presum"
    assert "fold" not in Method("nvfp4", "full").to_json()     # records written before folds
    assert Method("nvfp4", 0.25, fold="presum").label().endswith("fold=presum")
    for comp in ("none", "w4a16", "ref"):
        with pytest.raises(ValueError, match="needs a residue"):
            Method("nvfp4", comp, fold="presum")
    with pytest.raises(ValueError, match="fold must be one of"):
        Method("nvfp4", "full", fold="sum")
    hop = report.methods_for("hopper")
    assert len(set(hop)) == len(hop) == 13
    for fmt in formats.FORMATS:
        assert {Method(fmt, "full"), Method(fmt, "full", fold="presum"),
                Method(fmt, "w4a16"), Method(fmt, "none")} <= set(hop)
    assert not any(m.fold == "presum" for m in report.methods_for("full"))


def _with_presum(delta_nll: list[float], nmse_scale: float = 1.0, seq: bool = True):
    res = _fake_results()
    base = [2.0, 2.5, 3.0, 2.2]
    for r in res:
        if r["method"]["comp"] != "ref":
            r["seq_nll"] = list(base) if seq else None
    full = next(r for r in res if r["method"]["label"] == "NVFP4 full residue")
    ps = {**full, "method": Method("nvfp4", "full", fold="presum").to_json(),
          "ppl": full["ppl"] * 1.001,
          "layer_nmse": {n: v * nmse_scale for n, v in full["layer_nmse"].items()},
          "seq_nll": [b + d for b, d in zip(base, delta_nll)] if seq else None}
    return res + [ps]


def _presum_row(res):
    s = report.summarize(res)
    rows = [t for t in s["targets"] if "pre-summed" in t["target"]]
    assert len(rows) == 1 and rows[0]["target"].startswith("nvfp4 full residue")
    # the exact fold's own rows are still the exact fold's (the presum record is not taken)
    full_nv = next(r for r in s["rows"] if r["label"] == "NVFP4 full residue")
    assert full_nv["ppl"] == 14.0
    return rows[0]


def test_presum_target_is_a_paired_test_with_teeth():
    # differences that straddle zero: within 2 SE -> met
    assert _presum_row(_with_presum([0.01, -0.012, 0.008, -0.006]))["met"] is True
    # a systematic shift, far outside 2 SE -> not met
    assert _presum_row(_with_presum([0.05, 0.051, 0.049, 0.05]))["met"] is False
    # equal to rounding (below 1e-4 nats) whatever the SE -> met
    assert _presum_row(_with_presum([3e-9, 4e-9, 5e-9, 4e-9]))["met"] is True
    # the perplexity agrees but the layer NMSE is 5 % worse -> not met
    assert _presum_row(_with_presum([0.0, 0.0, 0.0, 0.0], nmse_scale=1.05))["met"] is False
    # an old record without per-sequence nll: not measured, never a pass
    row = _presum_row(_with_presum([0, 0, 0, 0], seq=False))
    assert row["met"] is None and "nll_diff" not in row["measured"]
