"""`resgen quantize` on tiny random models (CPU): the written folder is ModelOpt's layout field by
field (compared with a checkpoint ModelOpt wrote), its numbers are the ones resgen's own
functions give for the calibration, it loads in resgen, fuses exactly and round-trips; bad
requests are one line and exit code 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

transformers = pytest.importorskip("transformers")

from resgen import formats, reference  # noqa: E402
from resgen.calibrate import prepare_weight  # noqa: E402
from resgen.checkpoint import fuse_linears, load_checkpoint  # noqa: E402
from resgen.checkpoint.files import TensorReader, discover  # noqa: E402
from resgen.checkpoint.save import save_checkpoint  # noqa: E402
from resgen.cli import main  # noqa: E402

MO = Path(__file__).parent / "fixtures" / "modelopt"
TEXT = ("The Jargon File is a comprehensive compendium of hacker slang illuminating many "
        "aspects of hackish tradition, folklore, and humor. " * 12)


def tiny_model(folder: Path, arch: str = "llama", intermediate: int = 128,
               seed: int = 0) -> Path:
    """A 2-layer, hidden-64 decoder with a character tokenizer, saved in BF16."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = sorted(set(TEXT))
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{c: i + 3 for i, c in enumerate(chars)}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>",
                                  eos_token="</s>")
    torch.manual_seed(seed)
    common = dict(vocab_size=len(vocab), hidden_size=64, intermediate_size=intermediate,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=256)
    if arch == "qwen2":
        cfg = transformers.Qwen2Config(**common)
        model = transformers.Qwen2ForCausalLM(cfg)
    elif arch == "qwen3":
        cfg = transformers.Qwen3Config(head_dim=16, tie_word_embeddings=True, **common)
        model = transformers.Qwen3ForCausalLM(cfg)
    else:
        cfg = transformers.LlamaConfig(**common)
        model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():           # realistic-ish spread: a few large input channels
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(1 + 4 * (torch.rand(p.shape[1]) > 0.9))
    model.to(torch.bfloat16).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def calib(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("calib") / "calib.txt"
    p.write_text(TEXT)
    return p


def quantize(args: list[str], capsys) -> tuple[int, str, str]:
    capsys.readouterr()                 # drop what building the tiny model printed
    rc = main(["quantize", "--no-progress", *args])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def raw(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def site_inputs(src: Path, calib: Path, seq_len: int) -> dict[str, torch.Tensor]:
    """Independent capture of every projection's input on the same sequences."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from resgen.checkpoint.quantize import _calib_tokens

    tok = AutoTokenizer.from_pretrained(src)
    m = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    seqs, _ = _calib_tokens(tok, calib, seq_len, 16)
    rows: dict[str, list[torch.Tensor]] = {}
    hs = []
    for name, mod in m.named_modules():
        if isinstance(mod, torch.nn.Linear) and ".layers." in name:
            hs.append(mod.register_forward_pre_hook(
                lambda _m, a, n=name: rows.setdefault(n, []).append(a[0].reshape(-1, a[0].shape[-1]))))
    with torch.no_grad():
        m(input_ids=seqs, use_cache=False)
    for h in hs:
        h.remove()
    return {n: torch.cat(v) for n, v in rows.items()}, m


def test_nvfp4_export_is_the_modelopt_layout_field_by_field(tmp_path, calib, capsys):
    src = tiny_model(tmp_path / "src")
    out = tmp_path / "out"
    rc, so, se = quantize(["--model", str(src), "--calib", str(calib), "--seq-len", "128",
                           "--out", str(out)], capsys)
    assert rc == 0, se
    assert "q_proj" in so and "wrote" in so and "weight NMSE" in so
    mo = MO / "llama_nvfp4_sharded"
    # hf_quant_config.json and config.json's quantization_config: ModelOpt's keys and values
    ours = json.loads((out / "hf_quant_config.json").read_text())
    theirs = json.loads((mo / "hf_quant_config.json").read_text())
    assert ours.keys() == theirs.keys() and ours["producer"]["name"] == "resgen"
    assert ours["quantization"].keys() == theirs["quantization"].keys()
    assert ours["quantization"]["quant_algo"] == "NVFP4"
    assert ours["quantization"]["group_size"] == 16
    assert ours["quantization"]["exclude_modules"] == ["lm_head", "model.embed_tokens"]
    qc, tqc = (json.loads((d / "config.json").read_text())["quantization_config"]
               for d in (out, mo))
    assert set(qc) == set(tqc) - {"kv_cache_scheme"}     # no KV quantization here
    assert qc["quant_method"] == "modelopt" and qc["quant_algo"] == "NVFP4"
    assert qc["config_groups"] == tqc["config_groups"] and qc["ignore"] == tqc["ignore"]
    # every quantized module has exactly ModelOpt's fields, dtypes and ranks
    a, b = raw(out), raw(mo)
    roles = lambda t, m: {n[len(m) + 1:]: (v.dtype, v.dim()) for n, v in t.items()  # noqa: E731
                          if n.startswith(m + ".") and "." not in n[len(m) + 1:]}
    for proj in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                 "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
        m = f"model.layers.1.{proj}"
        ra, rb = roles(a, m), roles(b, m)
        rb.pop("k_scale", None)
        rb.pop("v_scale", None)              # the fixture also has a KV cache scale
        assert ra == rb, (m, ra, rb)
    assert set(a) - {n for n in a if ".layers." in n} == set(b) - {
        n for n in b if ".layers." in n}      # embed, norm, lm_head: the same tensors
    # tokenizer files were copied and the folder loads (with its resgen fields)
    assert (out / "tokenizer.json").is_file() and (out / "tokenizer_config.json").is_file()
    ck = load_checkpoint(out)
    assert ck.quant.producer == "resgen" and len(ck.linears) == 14
    assert ck.resgen["calibration"]["seq_len"] == 128 and ck.resgen["weights"] == "amax"
    assert all(ck.compensation(m) == "none" for m in ck.linears)
    transformers.AutoTokenizer.from_pretrained(out)


def test_nvfp4_export_numbers_come_from_the_calibration(tmp_path, calib, capsys):
    src = tiny_model(tmp_path / "src", seed=1)
    out = tmp_path / "out"
    rc, _, se = quantize(["--model", str(src), "--calib", str(calib), "--seq-len", "128",
                          "--out", str(out)], capsys)
    assert rc == 0, se
    ck = load_checkpoint(out)
    xs, model = site_inputs(src, calib, 128)
    source = load_checkpoint(src)
    groups = (("self_attn", "qkv"), ("self_attn", "o"), ("mlp", ("gate", "up")),
              ("mlp", ("down",)))
    for i in range(2):
        for sub, parts in groups:
            names = [f"model.layers.{i}.{sub}.{p}_proj" for p in parts]
            ws = [model.get_submodule(n).weight.detach().float() for n in names]
            alpha = formats.nvfp4_global_scale(torch.stack([w.abs().amax() for w in ws]))
            isc = formats.nvfp4_global_scale(xs[names[0]].abs().amax())
            for n, w in zip(names, ws):
                got = ck.linears[n]
                want = prepare_weight(w, "nvfp4", input_scale=isc, global_scale=alpha)
                assert torch.equal(got.q.global_scale, alpha), n
                assert torch.equal(got.input_scale, isc), n
                assert torch.equal(got.q.codes, want.q.codes), n
                assert torch.equal(got.q.scales.view(torch.uint8),
                                   want.q.scales.view(torch.uint8)), n
    # unquantized tensors pass through bit for bit (BF16 as stored)
    for n in ck.tensors:
        assert torch.equal(ck.tensors[n], source.tensors[n]), n
    # q/k/v and gate/up fuse exactly, and compute what the parts compute
    qkv = fuse_linears([ck.linears[f"model.layers.0.self_attn.{p}_proj"] for p in "qkv"],
                       on_mismatch="error")
    x = xs["model.layers.0.self_attn.q_proj"][:5]
    assert torch.equal(reference.linear(x, qkv), torch.cat(
        [reference.linear(x, ck.linears[f"model.layers.0.self_attn.{p}_proj"]) for p in "qkv"],
        -1))
    # and re-saving what was loaded is bit for bit
    again = tmp_path / "again"
    hf = json.loads((out / "hf_quant_config.json").read_text())
    save_checkpoint(again, config=ck.config, linears=dict(ck.linears), tensors=ck.tensors,
                    hf_quant_config=hf, compensation={m: ck.compensation(m) for m in ck.linears},
                    resgen={k: v for k, v in ck.resgen.items() if k not in ("layers",
                                                                            "format_version",
                                                                            "fmt")})
    da, db = discover(out), discover(again)
    r = TensorReader()
    assert set(da) == set(db)
    for n in da:
        assert torch.equal(r.read(da[n]).reshape(-1).view(torch.uint8),
                           r.read(db[n]).reshape(-1).view(torch.uint8)), n


def test_mxfp4_kext_export_selects_per_site_and_round_trips(tmp_path, calib, capsys):
    src = tiny_model(tmp_path / "src", arch="qwen2", seed=2)   # q/k/v biases
    out = tmp_path / "out"
    rc, so, se = quantize(["--model", str(src), "--calib", str(calib), "--fmt", "mxfp4",
                           "--compensation", "0.25", "--weights", "search", "--score", "error",
                           "--seq-len", "128", "--out", str(out)], capsys)
    assert rc == 0, se
    assert "0.25" in so
    ck = load_checkpoint(out)
    assert ck.quant.fmt == "mxfp4" and ck.quant.quant_algo == "mxfp4"
    hf = json.loads((out / "hf_quant_config.json").read_text())
    assert hf["quantization"].keys() == json.loads(
        (MO / "llama_mxfp4_sharded" / "hf_quant_config.json").read_text())["quantization"].keys()
    for i in range(2):
        qkv = [ck.linears[f"model.layers.{i}.self_attn.{p}_proj"] for p in "qkv"]
        assert all(w.selection is not None and w.selection.ratio == 0.25 for w in qkv)
        assert all(torch.equal(w.selection.masks, qkv[0].selection.masks) for w in qkv)
        assert ck.compensation(f"model.layers.{i}.self_attn.q_proj") == "0.25"
        fused = fuse_linears(qkv, on_mismatch="error")
        x = torch.randn(3, 64)
        assert torch.equal(reference.linear(x, fused, 0.25),
                           torch.cat([reference.linear(x, w, 0.25) for w in qkv], -1))
        # biases stay, in the source dtype
        b = ck.tensors[f"model.layers.{i}.self_attn.q_proj.bias"]
        assert b.dtype == torch.bfloat16 and b.shape == (64,)
    # other readers see plain MXFP4 weights [N, K/2]; the extension is in resgen/
    m = raw(out)
    assert tuple(m["model.layers.0.mlp.down_proj.weight"].shape) == (64, 64)
    ext = load_file(str(out / "resgen" / "fields.safetensors"))
    assert "model.layers.0.mlp.down_proj.resgen_ext_weight" in ext
    assert (out / "model.safetensors").is_file() and not any(
        "resgen" in n for n in m)


def test_plan_export_shares_ratios_within_fusion_groups(tmp_path, calib, capsys):
    src = tiny_model(tmp_path / "src", arch="qwen3", seed=3)
    out = tmp_path / "out"
    rc, so, se = quantize(["--model", str(src), "--calib", str(calib), "--plan", "--budget",
                           "5.0", "--seq-len", "64", "--calib-seqs", "4", "--out", str(out)],
                          capsys)
    assert rc == 0, se
    ck = load_checkpoint(out)
    plan = ck.resgen["plan"]
    assert plan["budget"] == 5.0 and plan["effective_bits"] <= 5.0 + 1e-9
    for i in range(2):
        for parts, sub in (("qkv", "self_attn"), (("gate", "up"), "mlp")):
            comps = {ck.compensation(f"model.layers.{i}.{sub}.{p}_proj") for p in parts}
            assert len(comps) == 1
    comps = {ck.compensation(m) for m in ck.linears}
    assert comps - {"none"}, "a 5-bit budget buys some compensation"
    assert "plan at 5.0 bits" in so
    assert ck.config["tie_word_embeddings"] is True and "lm_head.weight" not in ck.tensors


def test_unservable_layers_fail_or_fall_back(tmp_path, calib, capsys):
    src = tiny_model(tmp_path / "src", intermediate=40, seed=4)     # gate/up N = 40
    out = tmp_path / "out"
    rc, so, se = quantize(["--model", str(src), "--calib", str(calib), "--seq-len", "64",
                           "--out", str(out)], capsys)
    assert rc == 2 and se.count("\n") == 1
    assert "gate_proj" in se and "N=40" in se and "--fallback-bf16" in se
    assert not out.exists() and not (tmp_path / "out.partial").exists()
    rc, so, se = quantize(["--model", str(src), "--calib", str(calib), "--seq-len", "64",
                           "--fallback-bf16", "--out", str(out)], capsys)
    assert rc == 0, se
    ck = load_checkpoint(out)
    # gate/up: N = 40 (not a multiple of 16); down: K = 40 (not a multiple of the 16 block)
    fb = {f"model.layers.{i}.mlp.{p}_proj" for i in range(2) for p in ("gate", "up", "down")}
    assert fb.isdisjoint(ck.linears) and len(ck.linears) == 8
    assert "K=40" in ck.resgen["fallback_bf16"]["model.layers.0.mlp.down_proj"]
    assert set(ck.quant.exclude_modules) >= fb
    for m in fb:
        assert ck.tensors[f"{m}.weight"].dtype == torch.bfloat16
    assert set(ck.resgen["fallback_bf16"]) == fb


@pytest.mark.parametrize("extra,needle", [
    (["--calib", "/nonexistent.txt"], "no such file"),
    (["--plan"], "--plan and --budget"),
    (["--plan", "--budget", "5", "--compensation", "full"], "drop --compensation"),
])
def test_cli_errors_are_one_line(extra, needle, tmp_path, calib, capsys):
    src = tiny_model(tmp_path / "src")
    args = ["--model", str(src), "--calib", str(calib), "--out", str(tmp_path / "o"), *extra]
    rc, so, se = quantize(args, capsys)
    assert rc == 2 and needle in se and se.count("\n") == 1 and so == ""
    assert not (tmp_path / "o").exists()


def test_cli_refuses_quantized_missing_and_nonempty(tmp_path, calib, capsys):
    out = tmp_path / "o"
    rc, _, se = quantize(["--model", str(MO / "qwen3_nvfp4_fp8kv"), "--calib", str(calib),
                          "--out", str(out)], capsys)
    assert rc == 2 and "already quantized" in se and se.count("\n") == 1
    rc, _, se = quantize(["--model", str(tmp_path / "none"), "--calib", str(calib),
                          "--out", str(out)], capsys)
    assert rc == 2 and "no such folder" in se
    out.mkdir()
    (out / "x").write_text("keep me")
    rc, _, se = quantize(["--model", str(MO / "qwen3_nvfp4_fp8kv"), "--calib", str(calib),
                          "--out", str(out)], capsys)
    assert rc == 2 and "not empty" in se and (out / "x").read_text() == "keep me"
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{")
    rc, _, se = quantize(["--model", str(bad), "--calib", str(calib), "--out",
                          str(tmp_path / "o2")], capsys)
    assert rc == 2 and "config.json" in se and "not JSON" in se
    for bad in (["--compensation", "0.3"], ["--budget", "9"], ["--fmt", "fp8"],
                ["--seq-len", "0"], []):
        capsys.readouterr()
        with pytest.raises(SystemExit) as e:       # argparse's own checks: one line, exit 2
            main(["quantize", "--model", "x", *([] if not bad else ["--calib", str(calib)]),
                  "--out", "o", *bad])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1 and err.startswith("resgen quantize")
