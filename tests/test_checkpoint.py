"""Checkpoint import (resgen.checkpoint.load_checkpoint) on checkpoints ModelOpt itself wrote.

tests/fixtures/modelopt/ holds three tiny checkpoints written by nvidia-modelopt 0.47's
export_hf_checkpoint on this CPU machine (scripts/make_modelopt_fixture.py regenerates them):
Qwen3 NVFP4 + FP8 KV (one file), Llama NVFP4 + NVFP4 KV (two shards + index), Llama MXFP4 (two
shards + index); tests/fixtures/compressed_tensors/ the first one converted by compressed-tensors'
own ModelOpt converter. Each <name>.reference.safetensors holds ModelOpt's own dequantization of
two layers. Here: the layout field by field, values bit for bit against ModelOpt's dequantize,
fusing, the bit-for-bit round trip, and (tests/test_checkpoint_errors.py) every error path.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from resgen import formats
from resgen.calibrate import QLinearWeight, prepare_weight, select_channels
from resgen.checkpoint import CheckpointError, load_checkpoint
from resgen.checkpoint.files import TensorReader, discover
from resgen.checkpoint.save import save_checkpoint
from resgen.checkpoint.serve import why_unservable

FIX = Path(__file__).parent / "fixtures"
MO = FIX / "modelopt"
NVFP4 = ("qwen3_nvfp4_fp8kv", "llama_nvfp4_sharded")
ALL = (*NVFP4, "llama_mxfp4_sharded")
PROJ = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
LINEARS = [f"model.layers.{i}.{p}" for i in range(2) for p in PROJ]


def raw_tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("name", ALL)
def test_modelopt_export_loads_field_by_field(name):
    folder = MO / name
    ck = load_checkpoint(folder)
    hf = json.loads((folder / "hf_quant_config.json").read_text())
    fmt = "mxfp4" if "mxfp4" in name else "nvfp4"
    assert ck.quant.fmt == fmt and ck.quant.producer == "modelopt"
    assert ck.quant.layout == "modelopt"
    assert ck.quant.group_size == (16 if fmt == "nvfp4" else 32)
    assert ck.quant.exclude_modules == tuple(hf["quantization"]["exclude_modules"])
    assert ck.quant.kv_cache_quant_algo == hf["quantization"]["kv_cache_quant_algo"]
    assert sorted(ck.linears) == sorted(LINEARS)
    raw = raw_tensors(folder)
    roles = ("weight", "weight_scale", "weight_scale_2", "input_scale")
    for m in LINEARS:
        w = ck.linears[m]
        assert isinstance(w, QLinearWeight) and w.fmt == fmt and w.selection is None
        n, k = raw[f"{m}.weight"].shape[0], raw[f"{m}.weight"].shape[1] * 2
        assert (w.out_features, w.in_features) == (n, k)
        assert w.q.codes.dtype == torch.uint8 and torch.equal(w.q.codes, raw[f"{m}.weight"])
        want_scale = torch.float8_e4m3fn if fmt == "nvfp4" else torch.uint8
        assert w.q.scales.dtype == want_scale == raw[f"{m}.weight_scale"].dtype
        assert torch.equal(as_bytes(w.q.scales), as_bytes(raw[f"{m}.weight_scale"]))
        assert tuple(w.q.scales.shape) == (n, k // ck.quant.group_size)
        if fmt == "nvfp4":
            assert w.q.global_scale.dtype == torch.float32 and w.q.global_scale.dim() == 0
            assert torch.equal(w.q.global_scale, raw[f"{m}.weight_scale_2"].reshape(()))
            assert torch.equal(w.input_scale, raw[f"{m}.input_scale"].reshape(()))
        else:
            assert w.q.global_scale is None and w.input_scale is None
            assert f"{m}.weight_scale_2" not in raw and f"{m}.input_scale" not in raw
        for r in roles:
            assert f"{m}.{r}" not in ck.tensors
    # everything else is in tensors, unchanged, and nothing is in both
    rest = {n for n in raw if not any(n == f"{m}.{r}" for m in LINEARS for r in roles)}
    assert set(ck.tensors) == rest
    for n in rest:
        assert ck.tensors[n].dtype == raw[n].dtype and torch.equal(ck.tensors[n], raw[n])
    assert ck.tensors.info("model.norm.weight").dtype == "BF16"


@pytest.mark.parametrize("name", ALL)
def test_dequantized_weights_equal_modelopt_dequantize_bit_for_bit(name):
    ck = load_checkpoint(MO / name)
    ref = load_file(str(MO / f"{name}.reference.safetensors"))
    layers = json.loads((MO / name / "FIXTURE.json").read_text())["reference_layers"]
    for m in layers:
        ours = formats.dequantize(ck.linears[m].q)
        theirs = ref[f"{m}.modelopt_dequant"]
        assert ours.dtype == theirs.dtype == torch.float32
        assert torch.equal(ours, theirs), m
        src = ref[f"{m}.source"].float()
        rel = float((ours - src).norm() / src.norm())
        assert 0 < rel < 0.15, (m, rel)      # FP4 weight error of a random Gaussian weight


@pytest.mark.parametrize("name", NVFP4)
def test_kv_cache_scales_and_modelopt_shared_scales(name):
    ck = load_checkpoint(MO / name)
    raw = raw_tensors(MO / name)
    assert sorted(ck.kv_scales) == [0, 1]
    for i, (ks, vs) in ck.kv_scales.items():
        assert ks == float(raw[f"model.layers.{i}.self_attn.k_proj.k_scale"])
        assert vs == float(raw[f"model.layers.{i}.self_attn.v_proj.v_scale"])
        # ModelOpt unifies the tensor scales of parts that read one input (fusable exactly)
        for group in (("q", "k", "v"), ("gate", "up")):
            sub = "self_attn" if group[0] == "q" else "mlp"
            ws = {float(raw[f"model.layers.{i}.{sub}.{p}_proj.weight_scale_2"]) for p in group}
            xs = {float(raw[f"model.layers.{i}.{sub}.{p}_proj.input_scale"]) for p in group}
            assert len(ws) == 1 and len(xs) == 1


def test_kv_cache_alphas_are_the_nvfp4_cache_global_scales():
    ck = load_checkpoint(MO / "llama_nvfp4_sharded")            # NVFP4 KV, amax / 448
    al = ck.kv_cache_alphas()
    for i, (ks, vs) in ck.kv_scales.items():
        assert al[i] == (float(torch.tensor(ks) / 6), float(torch.tensor(vs) / 6))
        # alpha * 6 * 448 is the calibrated amax, as formats.nvfp4_global_scale defines alpha
        amax = torch.tensor(ks) * 448
        assert al[i][0] == pytest.approx(float(formats.nvfp4_global_scale(amax)), rel=1e-6)


def test_mxfp4_has_no_kv_scales_and_qwen3_keeps_its_norms():
    assert load_checkpoint(MO / "llama_mxfp4_sharded").kv_scales == {}
    ck = load_checkpoint(MO / "qwen3_nvfp4_fp8kv")
    assert ck.tensors["model.layers.0.self_attn.q_norm.weight"].shape == (16,)
    assert "lm_head.weight" not in ck.tensors       # tied: ModelOpt writes the embedding only
    assert ck.config["tie_word_embeddings"] is True


@pytest.mark.parametrize("name", ALL)
def test_round_trip_is_bit_for_bit(name, tmp_path):
    src = MO / name
    ck = load_checkpoint(src)
    hf = json.loads((src / "hf_quant_config.json").read_text())
    out = tmp_path / "out"
    save_checkpoint(out, config=ck.config, linears=dict(ck.linears), tensors=ck.tensors,
                    hf_quant_config=hf, max_shard_bytes=60_000)
    a, b = discover(src), discover(out)
    assert set(a) == set(b)
    ra, rb = TensorReader(), TensorReader()
    for n in a:
        x, y = ra.read(a[n]), rb.read(b[n])
        assert (x.dtype, tuple(x.shape)) == (y.dtype, tuple(y.shape)), n
        assert torch.equal(as_bytes(x), as_bytes(y)), n
    assert json.loads((out / "hf_quant_config.json").read_text()) == hf
    assert not (out / "resgen").exists()     # nothing resgen-specific to say about it
    again = load_checkpoint(out)
    for m in LINEARS:
        assert torch.equal(formats.dequantize(again.linears[m].q),
                           formats.dequantize(ck.linears[m].q))


def test_compressed_tensors_conversion_reads_the_same_weights():
    """compressed-tensors' converter renamed the fields and inverted the tensor scales."""
    mo = load_checkpoint(MO / "qwen3_nvfp4_fp8kv")
    ct = load_checkpoint(FIX / "compressed_tensors" / "qwen3_nvfp4_fp8kv")
    assert ct.quant.layout == ct.quant.producer == "compressed-tensors"
    assert ct.quant.fmt == "nvfp4" and ct.quant.is_excluded("model.embed_tokens")
    raw = raw_tensors(FIX / "compressed_tensors" / "qwen3_nvfp4_fp8kv")
    assert sorted(ct.linears) == sorted(LINEARS)
    ulps = 0
    for m in LINEARS:
        a, b = mo.linears[m], ct.linears[m]
        assert torch.equal(b.q.codes, raw[f"{m}.weight_packed"])
        assert torch.equal(a.q.codes, b.q.codes)
        assert torch.equal(as_bytes(a.q.scales), as_bytes(b.q.scales))
        inv = torch.reciprocal(raw[f"{m}.weight_global_scale"].float()).reshape(())
        assert torch.equal(b.q.global_scale, inv)
        # 1 / (1 / x) in FP32 is x or one ulp from it: the documented import difference
        for x, y in ((a.q.global_scale, b.q.global_scale), (a.input_scale, b.input_scale)):
            d = abs(int(x.view(torch.int32)) - int(y.view(torch.int32)))
            assert d <= 1
            ulps += d
    assert ulps > 0           # some scales really moved by the ulp (the fixture shows it)
    for i in (0, 1):
        for j in (0, 1):
            assert ct.kv_scales[i][j] == pytest.approx(mo.kv_scales[i][j], rel=2 ** -8)


def test_unquantized_folder_has_no_linears(tmp_path):
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    ck = load_checkpoint(tmp_path)
    assert ck.quant is None and len(ck.linears) == 0 and ck.kv_scales == {} and ck.resgen == {}
    sd = model.state_dict()
    assert "model.layers.0.self_attn.q_proj.weight" in ck.tensors
    for n in ck.tensors:
        assert torch.equal(ck.tensors[n], sd[n]), n


def _kext_layers(fmt: str, n: int = 64, k: int = 64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    sel = select_channels(torch.rand(k, generator=g), 0.25)
    isc = formats.nvfp4_global_scale(torch.tensor(3.0)) if fmt == "nvfp4" else None
    return {"model.layers.0.mlp.down_proj": prepare_weight(w, fmt, sel, input_scale=isc),
            "model.layers.0.mlp.up_proj": prepare_weight(w[:32], fmt, input_scale=isc)}


@pytest.mark.parametrize("fmt", formats.FORMATS)
def test_resgen_kext_fields_round_trip(fmt, tmp_path):
    layers = _kext_layers(fmt)
    comp = {"model.layers.0.mlp.up_proj": "full"}
    cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"]}
    save_checkpoint(tmp_path, config=cfg, linears=layers, compensation=comp,
                    tensors={"model.norm.weight": torch.ones(64)}, resgen={"plan": {"b": 5}})
    ck = load_checkpoint(tmp_path)
    assert ck.quant.producer == "resgen" and ck.quant.fmt == fmt
    for m, w in layers.items():
        got = ck.linears[m]
        assert torch.equal(got.q.codes, w.q.codes) and torch.equal(
            as_bytes(got.q.scales), as_bytes(w.q.scales))
        assert got.in_features == w.in_features
        if w.selection is not None:
            assert got.selection.ratio == w.selection.ratio
            assert torch.equal(got.selection.masks, w.selection.masks)
        else:
            assert got.selection is None
    assert ck.compensation("model.layers.0.mlp.down_proj") == "0.25"
    assert ck.compensation("model.layers.0.mlp.up_proj") == "full"
    assert ck.resgen["plan"] == {"b": 5}
    # other readers see a plain ModelOpt layer: the base weight [N, K/2] in the model file
    raw = raw_tensors(tmp_path)
    assert tuple(raw["model.layers.0.mlp.down_proj.weight"].shape) == (64, 32)
    assert not any("resgen" in n for n in raw)
    cfgj = json.loads((tmp_path / "config.json").read_text())
    assert cfgj["quantization_config"]["quant_method"] == "modelopt"


def test_unservable_layer_is_named_and_falls_back_only_on_request(tmp_path):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(24, 64, generator=g)             # N = 24: not a multiple of 16
    lin = {"model.layers.0.self_attn.k_proj": prepare_weight(w, "nvfp4")}
    save_checkpoint(tmp_path, config={"model_type": "llama"}, linears=lin, tensors={})
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(tmp_path)
    msg = str(e.value)
    assert "model.layers.0.self_attn.k_proj" in msg and "N=24" in msg and "16" in msg
    assert "model.safetensors" in msg and "fallback_bf16" in msg
    ck = load_checkpoint(tmp_path, fallback_bf16=True)
    assert len(ck.linears) == 0
    assert "N=24" in ck.fallback["model.layers.0.self_attn.k_proj"]
    wb = ck.tensors["model.layers.0.self_attn.k_proj.weight"]
    assert wb.dtype == torch.bfloat16
    assert torch.equal(wb, formats.dequantize(lin["model.layers.0.self_attn.k_proj"].q)
                       .to(torch.bfloat16))
    assert load_checkpoint(tmp_path, serve_check=False).linears.entry(
        "model.layers.0.self_attn.k_proj").n == 24


def test_why_unservable_asks_the_families():
    assert why_unservable("nvfp4", 4096, 4096) is None
    assert why_unservable("mxfp4", 6144, 4096, "full") is None
    assert "multiple of 16" in why_unservable("nvfp4", 100, 64)
    assert "block of 32" in why_unservable("mxfp4", 64, 48)


def test_lazy_tensors_read_on_access_only(tmp_path, monkeypatch):
    shutil.copytree(MO / "llama_nvfp4_sharded", tmp_path / "c")
    calls = []
    orig = TensorReader.read

    def spy(self, info):
        calls.append(info.name)
        return orig(self, info)

    monkeypatch.setattr(TensorReader, "read", spy)
    ck = load_checkpoint(tmp_path / "c")
    # at load: only the tensor scales and KV scales (one float each)
    assert calls and all(n.endswith(("_scale_2", "input_scale", "k_scale", "v_scale"))
                         for n in calls)
    calls.clear()
    _ = ck.tensors["lm_head.weight"]
    assert calls == ["lm_head.weight"]
    calls.clear()
    _ = ck.linears["model.layers.1.mlp.up_proj"]
    assert sorted(calls) == ["model.layers.1.mlp.up_proj.weight",
                             "model.layers.1.mlp.up_proj.weight_scale"]


@pytest.mark.parametrize("name", ALL)
def test_resgen_quantizes_the_source_weights_as_modelopt_did(name):
    """Same weight, same tensor scale: resgen's NVFP4 quantization reproduces ModelOpt's codes
    and block scales bit for bit. MXFP4 differs by rule: ModelOpt picks the E8M0 exponent
    ceil(log2(amax / 6)) and rounds E2M1 ties down (MXFP4QTensor.quantize), resgen the OCP MX
    rule floor(log2(amax)) - 2 with round-to-nearest-even; both decode by the same formula,
    which is all an import needs, and resgen's error is the smaller here."""
    ck = load_checkpoint(MO / name)
    ref = load_file(str(MO / f"{name}.reference.safetensors"))
    for m in json.loads((MO / name / "FIXTURE.json").read_text())["reference_layers"]:
        src = ref[f"{m}.source"].float()
        theirs = ck.linears[m]
        ours = prepare_weight(src, ck.quant.fmt, global_scale=theirs.q.global_scale)
        same = (torch.equal(ours.q.codes, theirs.q.codes) and
                torch.equal(as_bytes(ours.q.scales), as_bytes(theirs.q.scales)))
        err = [float((formats.dequantize(q.q) - src).norm() / src.norm()) for q in (ours, theirs)]
        if ck.quant.fmt == "nvfp4":
            assert same, m
            assert torch.equal(theirs.q.global_scale, formats.nvfp4_global_scale(src)) or \
                float(theirs.q.global_scale) > float(formats.nvfp4_global_scale(src))
        else:
            assert not same and err[0] < err[1], (m, err)


def test_compressed_tensors_mxfp4_layout(tmp_path):
    """compressed-tensors' MXFP4PackedCompressor layout (weight_packed + uint8 E8M0
    weight_scale, no global scale, format mxfp4-pack-quantized), built field by field from the
    ModelOpt MXFP4 fixture: the same codes and scales read back."""
    src = MO / "llama_mxfp4_sharded"
    dst = tmp_path / "ct"
    shutil.copytree(src, dst)
    (dst / "hf_quant_config.json").unlink()
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    for f in sorted(dst.glob("model-*.safetensors")):
        t = load_file(str(f))
        for m in LINEARS:
            if f"{m}.weight" in t:
                t[f"{m}.weight_packed"] = t.pop(f"{m}.weight")
                index["weight_map"][f"{m}.weight_packed"] = index["weight_map"].pop(
                    f"{m}.weight")
        from safetensors.torch import save_file
        save_file(t, str(f), metadata={"format": "pt"})
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 4, "type": "float", "strategy": "group", "group_size": 32,
            "symmetric": True, "dynamic": False, "scale_dtype": "torch.uint8"},
            "input_activations": {"num_bits": 4, "type": "float", "strategy": "group",
                                  "group_size": 32, "dynamic": True}}},
        "ignore": ["lm_head"], "quantization_status": "compressed"}
    (dst / "config.json").write_text(json.dumps(cfg))
    a, b = load_checkpoint(src), load_checkpoint(dst)
    assert b.quant.layout == "compressed-tensors" and b.quant.fmt == "mxfp4"
    assert sorted(a.linears) == sorted(b.linears)
    for m in LINEARS:
        assert torch.equal(a.linears[m].q.codes, b.linears[m].q.codes)
        assert torch.equal(a.linears[m].q.scales, b.linears[m].q.scales)
        assert b.linears[m].q.global_scale is None


def test_partially_quantized_export_and_modelopt_wildcards():
    """ModelOpt left layer 1's MLP and layer 0's o_proj unquantized and summarised them as
    exclude_modules wildcards; those weights are ordinary tensors, the rest linears."""
    ck = load_checkpoint(MO / "llama_nvfp4_partial")
    excluded = {"model.layers.0.self_attn.o_proj", "model.layers.1.mlp.gate_proj",
                "model.layers.1.mlp.up_proj", "model.layers.1.mlp.down_proj"}
    assert "model.layers.1.mlp*" in ck.quant.exclude_modules
    assert sorted(ck.linears) == sorted(set(LINEARS) - excluded)
    for m in excluded:
        assert ck.quant.is_excluded(m)
        w = ck.tensors[f"{m}.weight"]
        assert w.dtype == torch.bfloat16 and w.dim() == 2
        assert f"{m}.weight_scale" not in ck.tensors
    for m in ck.linears:
        assert not ck.quant.is_excluded(m)
    spec = ck.quant
    assert spec.is_excluded("lm_head") and not spec.is_excluded("lm_head2")
    assert not spec.is_excluded("model.layers.10.mlp.up_proj")     # layers.1 is not layers.10
    assert spec.is_excluded("model.layers.1.mlpx")                 # a prefix glob, as vLLM reads it
