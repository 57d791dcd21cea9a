"""The quality study on a user's model: model resolution (HF folder, GGUF file, checkpoint
markers), BOS the way the tokenizer adds it, model naming in the report, W4A16 as a method,
and `resgen report --model ... --text ...` end to end on a tiny offline model."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parent))

from quality_fixtures import make_model_dir, make_tokenizer, write_text  # noqa: E402

from resgen.quality import model as QM  # noqa: E402
from resgen.quality.study import Method, Study, StudyConfig  # noqa: E402


@pytest.fixture(scope="module")
def bos_model(tmp_path_factory):
    root = tmp_path_factory.mktemp("bosmodel")
    folder = make_model_dir(root / "TinyBosLlama-2L", add_bos=True, bias=True)
    text = write_text(root / "held_out.txt")
    return folder, text


def test_tokenizer_fixture_really_adds_bos():
    tok = make_tokenizer(add_bos=True)
    assert tok("w1 w2").input_ids == [1, 4, 5]
    assert tok("w1 w2", add_special_tokens=False).input_ids == [4, 5]


def test_bos_decision_follows_the_tokenizer():
    cfg = transformers.LlamaConfig(bos_token_id=1)
    yes = QM.decide_bos(make_tokenizer(add_bos=True), cfg)
    assert yes.token_id == 1 and yes.certain and "adds BOS" in yes.reason
    # explicitly configured not to add one: no BOS, no warning
    no = QM.decide_bos(make_tokenizer(add_bos=False, add_bos_flag=False), cfg)
    assert no.token_id is None and no.certain
    # adds nothing, says nothing, but the model defines BOS: cannot tell -> warn
    unsure = QM.decide_bos(make_tokenizer(add_bos=False), cfg)
    assert unsure.token_id is None and not unsure.certain and "--bos yes" in unsure.reason
    # nothing defines a BOS token at all: certain, none
    none_cfg = transformers.LlamaConfig(bos_token_id=None)
    tok = make_tokenizer(add_bos=False)
    tok.bos_token = None
    assert QM.decide_bos(tok, none_cfg).certain
    # forced
    assert QM.decide_bos(make_tokenizer(add_bos=False), cfg, "yes").token_id == 1
    assert QM.decide_bos(make_tokenizer(add_bos=True), cfg, "no").token_id is None
    with pytest.raises(ValueError, match="bos"):
        QM.decide_bos(None, cfg, "sometimes")


def test_smollm2_tokenizer_says_no_bos():
    """The default model's tokenizer adds none (add_bos_token False): unchanged windows."""
    try:
        tok = QM.load_tokenizer()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    ch = QM.decide_bos(tok, None)
    assert ch.token_id is None and ch.certain


def test_windows_start_with_bos_and_keep_their_length():
    ids = torch.arange(10, 1010)
    sp = QM.split_tokens(ids, seq_len=50, n_calib=3, n_eval=4, bos=1)
    assert sp.calib.shape == (3, 50) and sp.eval.shape == (4, 50)
    assert bool((sp.calib[:, 0] == 1).all()) and bool((sp.eval[:, 0] == 1).all())
    assert 1 not in sp.calib[:, 1:].tolist()[0]
    # the text part of each window is contiguous stream text
    row = sp.eval[0, 1:]
    assert torch.equal(row, torch.arange(int(row[0]), int(row[0]) + 49))
    assert sp.describe()["bos_token_id"] == 1
    plain = QM.split_tokens(ids, seq_len=50, n_calib=3, n_eval=4)
    assert plain.describe()["bos_token_id"] is None and bool((plain.calib[:, 0] != 1).all())


def test_load_tokens_adds_no_special_tokens(bos_model, tmp_path):
    folder, text = bos_model
    tok = QM.load_tokenizer(folder)
    ids = QM.load_tokens(tok, text)
    assert ids[0] != 1 and 1 not in ids.tolist()
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    with pytest.raises(ValueError, match="empty"):
        QM.load_tokens(tok, empty)


def test_resolve_model_kinds_and_errors(tmp_path, bos_model):
    folder, _ = bos_model
    assert QM.resolve_model(folder).kind == "hf"
    assert QM.resolve_model(folder).name == "TinyBosLlama-2L"
    g = tmp_path / "m.gguf"
    g.write_bytes(b"GGUF")
    assert QM.resolve_model(g) == QM.ModelSource("gguf", g, "m")
    assert QM.resolve_model(tmp_path).kind == "gguf"          # the folder's only GGUF file
    (tmp_path / "n.gguf").write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="2 GGUF files"):
        QM.resolve_model(tmp_path)
    with pytest.raises(FileNotFoundError, match="no such"):
        QM.resolve_model(tmp_path / "missing")
    txt = tmp_path / "w.txt"
    txt.write_text("x")
    with pytest.raises(ValueError, match="GGUF"):
        QM.resolve_model(txt)
    ck = tmp_path / "ckpt"
    ck.mkdir()
    (ck / "config.json").write_text(json.dumps({"quantization_config": {"quant_algo": "NVFP4"}}))
    assert QM.resolve_model(ck).kind == "checkpoint"
    assert QM.slug("SmolLM2-135M-Instruct") == "smollm2_135m_instruct"


def test_smollm2_gguf_file_resolves_to_the_default_model():
    try:
        folder = QM.smollm2_dir()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    src = QM.resolve_model(folder / QM.GGUF_FILE)
    assert src.kind == "gguf" and src.name == QM.DEFAULT_MODEL_NAME
    assert src.gguf_file == QM.GGUF_FILE and src.folder == folder


def test_a_non_llama_model_is_a_clear_error():
    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50)
    model = transformers.GPT2LMHeadModel(cfg)
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*Llama-style"):
        QM.quantizable_linears(model)


def test_study_on_a_bos_model_uses_bos_and_biases(bos_model):
    folder, text = bos_model
    cfg = StudyConfig(seq_len=32, n_calib=2, n_eval=2, n_nmse=1, n_grad=1, batch=2,
                      text=str(text), model_dir=str(folder))
    logs = []
    study = Study(cfg, log=logs.append)
    assert study.bos.token_id == 1 and study.bos.certain
    assert bool((study.split.eval[:, 0] == 1).all())
    assert study.model_info["name"] == "TinyBosLlama-2L"
    assert study.model_info["architecture"] == "LlamaForCausalLM"
    assert set(study.bias) == {f"layers.{i}.self_attn.{p}_proj" for i in range(2)
                               for p in "qkvo"}
    ref = study.evaluate(Method("nvfp4", "ref"))
    w16 = study.evaluate(Method("nvfp4", "w4a16"))
    w4 = study.evaluate(Method("nvfp4", "none"))
    assert w16["effective_bits"] == 16.0 and w4["effective_bits"] == 4.0
    # W4A16 errs less than W4A4 on every layer (weight error only + BF16 rounding)
    assert all(w16["layer_nmse"][n] < w4["layer_nmse"][n] for n in w4["layer_nmse"])
    assert ref["tokens"] == 2 * 31
    # without BOS the same text gives other windows and another reference perplexity
    nob = Study(StudyConfig(**{**cfg.__dict__, "bos": "no"}), log=logs.append)
    assert nob.bos.token_id is None
    assert nob.evaluate(Method("nvfp4", "ref"))["ppl"] != ref["ppl"]
    with pytest.raises(ValueError, match="W4A16"):
        Method("nvfp4", "w4a16", input_scale="static")
    assert Method("mxfp4", "w4a16").label() == "MXFP4 W4A16"


def test_report_cli_on_a_tiny_model(bos_model, tmp_path, capsys):
    """`resgen report --model <folder> --text <file>`: the JSON and markdown name the model,
    the text and the BOS; --resume continues from the partial file; --assemble rebuilds it."""
    from resgen.cli import main

    folder, text = bos_model
    out = tmp_path / "out"
    argv = ["report", "--model", str(folder), "--text", str(text), "--seq-len", "32",
            "--calib-seqs", "2", "--eval-seqs", "2", "--out", str(out), "--resume"]
    assert main(argv) == 0
    stem = "tinybosllama_2l"
    doc = json.loads((out / f"{stem}.json").read_text())
    assert doc["model"]["name"] == "TinyBosLlama-2L" and doc["model"]["source"] == str(folder)
    assert doc["title"] == "TinyBosLlama-2L on held_out.txt"
    assert doc["text"]["bos"]["token_id"] == 1 and doc["text"]["bos_token_id"] == 1
    labels = [r["method"]["label"] for r in doc["results"]]
    assert "NVFP4 W4A16" in labels and "MXFP4 W4A16" in labels and len(labels) == 15
    md = (out / f"{stem}.md").read_text()
    assert md.startswith("# Quality report: TinyBosLlama-2L on held_out.txt")
    assert "starts with BOS token 1" in md and "SmolLM2" not in md
    assert any("W4A16 (BF16 activations)" in t["target"] for t in doc["summary"]["targets"])
    partial = out / f"{stem}.partial.jsonl"
    n_lines = len(partial.read_text().splitlines())
    assert n_lines == 15
    capsys.readouterr()
    assert main(argv) == 0                                       # everything resumed
    assert "(resumed)" in capsys.readouterr().out
    assert len(partial.read_text().splitlines()) == n_lines
    (out / f"{stem}.json").unlink()
    assert main(argv[:-1] + ["--assemble"]) == 0
    again = json.loads((out / f"{stem}.json").read_text())
    assert again["model"]["name"] == "TinyBosLlama-2L" and again["missing"] == []
    assert [r["ppl"] for r in again["results"]] == [r["ppl"] for r in doc["results"]]


def test_report_cli_bad_input_is_one_line(tmp_path, capsys, bos_model):
    from resgen.cli import main

    _, text = bos_model
    assert main(["report", "--model", str(tmp_path / "nope"), "--text", str(text)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no such file or folder" in err[0]
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    assert main(["report", "--model", str(broken), "--text", str(text)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "broken" in err[0]
    folder, _ = bos_model
    assert main(["report", "--model", str(folder), "--text", str(tmp_path / "t.txt")]) == 2
    assert "--text" in capsys.readouterr().err
    bad = tmp_path / "bad.partial.jsonl"
    bad.write_text("not json\n")
    assert main(["report", "--model", str(folder), "--text", str(text), "--out",
                 str(tmp_path), "--stem", "bad", "--assemble"]) == 2
    assert "line 1" in capsys.readouterr().err


@pytest.fixture(scope="module")
def modelopt_ckpt(tmp_path_factory):
    """The ModelOpt NVFP4 fixture (written by nvidia-modelopt 0.47, tests/fixtures/modelopt)
    with a tokenizer beside it (the fixture has none; its vocabulary of 128 holds the
    fixture tokenizer's 63 ids)."""
    import shutil

    src = Path(__file__).parent / "fixtures" / "modelopt" / "llama_nvfp4_sharded"
    root = tmp_path_factory.mktemp("ckpt")
    dst = root / "llama_nvfp4_sharded"
    shutil.copytree(src, dst)
    make_tokenizer(add_bos=True).save_pretrained(dst)
    return dst, write_text(root / "t.txt", 2500, seed=3)


def test_study_on_a_modelopt_checkpoint(modelopt_ckpt):
    pytest.importorskip("resgen.checkpoint")
    from resgen import formats
    from resgen.checkpoint import load_checkpoint

    folder, text = modelopt_ckpt
    assert QM.resolve_model(folder).kind == "checkpoint"
    cfg = StudyConfig(seq_len=24, n_calib=2, n_eval=2, n_nmse=1, n_grad=1, batch=2,
                      text=str(text), model_dir=str(folder))
    study = Study(cfg, log=lambda s: None)
    assert study.model_info["kind"] == "checkpoint" and "dequantized" in \
        study.model_info["reference"]
    ck = load_checkpoint(folder, serve_check=False)
    name = "model.layers.1.mlp.down_proj"
    want = formats.dequantize(ck.linears[name].base())
    assert torch.equal(study.weight["layers.1.mlp.down_proj"], want)   # the reference
    qw = study.qweight("layers.1.mlp.down_proj", Method("nvfp4", "none"), "none")
    assert torch.equal(qw.q.codes, ck.linears[name].q.codes)           # its own codes
    assert qw.input_scale is None
    r = study.evaluate(Method("nvfp4", "w4a16"))
    # W4A16 on the checkpoint's own weights: only the BF16 rounding of activations is left
    assert max(r["layer_nmse"].values()) < 1e-4
    assert study.evaluate(Method("nvfp4", "none"))["ppl"] > 0



def test_report_cli_on_a_checkpoint(modelopt_ckpt, tmp_path):
    pytest.importorskip("resgen.checkpoint")
    from resgen.cli import main

    folder, text = modelopt_ckpt
    assert main(["report", "--model", str(folder), "--text", str(text), "--seq-len", "24",
                 "--calib-seqs", "2", "--eval-seqs", "2", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "llama_nvfp4_sharded.json").read_text())
    assert doc["model"]["kind"] == "checkpoint" and doc["model"]["name"] == "llama_nvfp4_sharded"
    assert doc["text"]["bos"]["token_id"] == 1
