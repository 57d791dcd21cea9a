"""Every way a checkpoint can be bad gives a CheckpointError naming the file, the tensor and the
problem (issue 19 section 1, issue 22 item 6's bar): damaged copies of the ModelOpt fixtures."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

from resgen.checkpoint import CheckpointError, load_checkpoint

MO = Path(__file__).parent / "fixtures" / "modelopt"
Q3 = "qwen3_nvfp4_fp8kv"          # one model.safetensors
LL = "llama_nvfp4_sharded"        # two shards + index
MX = "llama_mxfp4_sharded"
SH1 = "model-00001-of-00002.safetensors"
Q = "model.layers.0.self_attn.q_proj"


def fixture(tmp_path: Path, name: str) -> Path:
    dst = tmp_path / name
    shutil.copytree(MO / name, dst)
    return dst


def rewrite(path: Path, mutate: Callable[[dict], None]) -> None:
    t = load_file(str(path))
    mutate(t)
    save_file(t, str(path), metadata={"format": "pt"})


def edit_json(path: Path, mutate: Callable[[dict], object]) -> None:
    d = json.loads(path.read_text())
    r = mutate(d)
    path.write_text(json.dumps(d if r is None else r))


def expect(folder: Path, *needles: str, access: str | None = None) -> CheckpointError:
    with pytest.raises(CheckpointError) as e:
        ck = load_checkpoint(folder)
        if access is not None:
            ck.linears[access]
    msg = str(e.value)
    for n in needles:
        assert n in msg, (n, msg)
    assert "\n" not in msg
    return e.value


def set_(name: str, value: torch.Tensor) -> Callable[[dict], None]:
    def f(t: dict) -> None:
        t[name] = value
    return f


def drop(name: str) -> Callable[[dict], None]:
    def f(t: dict) -> None:
        del t[name]
    return f


# (fixture, file, mutation, substrings of the message)
TENSOR_CASES = {
    "nan_weight_scale_2": (Q3, "model.safetensors", set_(f"{Q}.weight_scale_2",
                           torch.tensor(float("nan"))), ["weight_scale_2", "positive finite"]),
    "inf_weight_scale_2": (Q3, "model.safetensors", set_(f"{Q}.weight_scale_2",
                           torch.tensor(float("inf"))), ["weight_scale_2", "inf"]),
    "negative_weight_scale_2": (Q3, "model.safetensors", set_(f"{Q}.weight_scale_2",
                                torch.tensor(-1.0)), ["weight_scale_2", "-1.0"]),
    "zero_input_scale": (Q3, "model.safetensors", set_(f"{Q}.input_scale", torch.tensor(0.0)),
                         ["input_scale", "0.0", "positive"]),
    "nan_input_scale": (LL, SH1, set_(f"{Q}.input_scale", torch.tensor(float("nan"))),
                        ["input_scale", SH1, "nan"]),
    "f16_weight_scale_2": (Q3, "model.safetensors", set_(f"{Q}.weight_scale_2",
                           torch.tensor(1e-4, dtype=torch.float16)), ["weight_scale_2", "F16"]),
    "weight_int8": (Q3, "model.safetensors", lambda t: t.update(
        {f"{Q}.weight": t[f"{Q}.weight"].view(torch.int8)}), [f"{Q}.weight", "I8", "U8"]),
    "weight_3d": (Q3, "model.safetensors", lambda t: t.update(
        {f"{Q}.weight": t[f"{Q}.weight"].reshape(1, 64, 32)}), [f"{Q}.weight", "[1, 64, 32]"]),
    "scale_f32": (Q3, "model.safetensors", lambda t: t.update(
        {f"{Q}.weight_scale": t[f"{Q}.weight_scale"].float()}), ["weight_scale", "F32",
                                                                 "F8_E4M3"]),
    "scale_rows": (Q3, "model.safetensors", lambda t: t.update(
        {f"{Q}.weight_scale": t[f"{Q}.weight_scale"][:60].contiguous()}),
        ["weight_scale", "[60, 4]", "N=64"]),
    "scale_cols": (Q3, "model.safetensors", lambda t: t.update(
        {f"{Q}.weight_scale": t[f"{Q}.weight_scale"][:, :3].contiguous()}),
        ["weight_scale", "[64, 3]", "K=64"]),
    "missing_weight_scale_2": (Q3, "model.safetensors", drop(f"{Q}.weight_scale_2"),
                               ["weight_scale_2", "lacks"]),
    "scale_without_weight": (Q3, "model.safetensors", drop(f"{Q}.weight"),
                             ["weight_scale", "without the packed weight"]),
    "mxfp4_with_weight_scale_2": (MX, SH1, set_(f"{Q}.weight_scale_2", torch.tensor(1e-4)),
                                  ["weight_scale_2", "MXFP4 has no tensor scale"]),
    "tensor_the_index_does_not_list": (LL, SH1, set_("model.extra", torch.zeros(3)),
                                       ["model.extra", "does not list"]),
    "mxfp4_scale_e4m3": (MX, SH1, lambda t: t.update(
        {f"{Q}.weight_scale": t[f"{Q}.weight_scale"].view(torch.float8_e4m3fn)}),
        ["weight_scale", "F8_E4M3", "mxfp4"]),
    "k_without_v": (Q3, "model.safetensors", drop("model.layers.1.self_attn.v_proj.v_scale"),
                    ["k_proj.k_scale", "layer 1", "no v_scale"]),
    "nan_k_scale": (Q3, "model.safetensors", set_("model.layers.0.self_attn.k_proj.k_scale",
                    torch.tensor(float("nan"))), ["k_scale", "KV cache scale nan"]),
    "zero_point": (Q3, "model.safetensors", set_(f"{Q}.weight_zero_point",
                                                 torch.zeros(64, 4, dtype=torch.uint8)),
                   ["weight_zero_point", "asymmetric"]),
}


@pytest.mark.parametrize("case", sorted(TENSOR_CASES))
def test_bad_tensor_is_named(case, tmp_path):
    name, fname, mutate, needles = TENSOR_CASES[case]
    folder = fixture(tmp_path, name)
    before = set(load_file(str(folder / fname)))
    rewrite(folder / fname, mutate)
    index = folder / "model.safetensors.index.json"
    if index.is_file() and case != "tensor_the_index_does_not_list":
        added = set(load_file(str(folder / fname))) - before
        edit_json(index, lambda d: d["weight_map"].update({n: fname for n in added}))
    err = expect(folder, fname, *needles)
    assert err.file is not None and err.file.endswith(fname)
    assert err.tensor is not None


def _scale_bits(folder: Path, fname: str, value: int) -> None:
    def f(t: dict) -> None:
        s = t[f"{Q}.weight_scale"].view(torch.uint8).clone()
        s[3, 1] = value
        t[f"{Q}.weight_scale"] = s.view(t[f"{Q}.weight_scale"].dtype)
    rewrite(folder / fname, f)


@pytest.mark.parametrize("name,fname,bits,needle", [
    (Q3, "model.safetensors", 0x7F, "E4M3 block scales are NaN"),
    (Q3, "model.safetensors", 0xFF, "E4M3 block scales are NaN"),
    (Q3, "model.safetensors", 0xB8, "negative"),
    (MX, SH1, 0xFF, "255 (NaN)"),
])
def test_nan_or_negative_block_scales_fail_when_read(name, fname, bits, needle, tmp_path):
    folder = fixture(tmp_path, name)
    _scale_bits(folder, fname, bits)
    ck = load_checkpoint(folder)         # headers are fine: the values are checked on read
    with pytest.raises(CheckpointError) as e:
        ck.linears[Q]
    assert needle in str(e.value) and f"{Q}.weight_scale" in str(e.value)
    assert fname in str(e.value)
    ck.linears["model.layers.1.self_attn.q_proj"]      # the others still read


def test_excluded_module_with_fp4_tensors(tmp_path):
    folder = fixture(tmp_path, Q3)
    edit_json(folder / "hf_quant_config.json",
              lambda d: d["quantization"]["exclude_modules"].append("model.layers.0.self_attn*"))
    expect(folder, "exclude_modules", "model.layers.0.self_attn", "model.safetensors")


def test_missing_shard(tmp_path):
    folder = fixture(tmp_path, LL)
    (folder / "model-00002-of-00002.safetensors").unlink()
    expect(folder, "missing shard model-00002-of-00002.safetensors", "model.safetensors.index")


def test_index_points_at_the_wrong_shard(tmp_path):
    folder = fixture(tmp_path, LL)
    edit_json(folder / "model.safetensors.index.json",
              lambda d: d["weight_map"].update({"lm_head.weight": SH1}))
    expect(folder, SH1, "lm_head.weight", "does not hold it")


@pytest.mark.parametrize("content,needle", [
    ("not json", "not JSON"), (json.dumps([1, 2]), "weight_map"),
    (json.dumps({"weight_map": {"x": "../etc/passwd"}}), "not a file name"),
])
def test_bad_index(content, needle, tmp_path):
    folder = fixture(tmp_path, LL)
    (folder / "model.safetensors.index.json").write_text(content)
    expect(folder, "model.safetensors.index.json", needle)


def test_shards_without_index(tmp_path):
    folder = fixture(tmp_path, LL)
    (folder / "model.safetensors.index.json").unlink()
    expect(folder, "without their model.safetensors.index.json")


@pytest.mark.parametrize("data,needle", [
    (b"hello, I am a text file\n", "not a safetensors file"),
    (b"\x01\x00", "shorter than"),
    ((19).to_bytes(8, "little") + b"{not json at all!!}", "header is not JSON"),
    ((2).to_bytes(8, "little") + b"[]", "not a JSON object"),
])
def test_not_safetensors(data, needle, tmp_path):
    folder = fixture(tmp_path, Q3)
    (folder / "model.safetensors").write_bytes(data)
    expect(folder, "model.safetensors", needle)


def test_truncated_file(tmp_path):
    folder = fixture(tmp_path, Q3)
    p = folder / "model.safetensors"
    p.write_bytes(p.read_bytes()[:-100])
    expect(folder, "model.safetensors", "truncated")


def test_header_lies_about_a_tensor(tmp_path):
    folder = fixture(tmp_path, Q3)
    p = folder / "model.safetensors"
    raw = p.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    hdr = json.loads(raw[8: 8 + n])
    hdr["model.norm.weight"]["dtype"] = "F32"       # 64 BF16 = 128 bytes, F32 would be 256
    new = json.dumps(hdr, separators=(",", ":")).encode()
    new += b" " * (n - len(new)) if len(new) <= n else b""
    assert len(new) == n
    p.write_bytes(raw[:8] + new + raw[8 + n:])
    expect(folder, "model.norm.weight", "needs 256")


@pytest.mark.parametrize("algo,needle", [
    ("FP8", "unknown quant_algo 'FP8'"), ("W4A16_AWQ", "unknown quant_algo"),
    ("NVFP4_AWQ", "pre_quant_scale"), ("W4A16_NVFP4", "weight-only"),
    ("MIXED_PRECISION", "mixed"), (7, "must be a string"),
])
def test_unknown_or_unsupported_quant_algo(algo, needle, tmp_path):
    folder = fixture(tmp_path, Q3)
    edit_json(folder / "hf_quant_config.json",
              lambda d: d["quantization"].update({"quant_algo": algo}))
    expect(folder, "hf_quant_config.json", needle)


def test_bad_group_size_and_exclude_list(tmp_path):
    folder = fixture(tmp_path, Q3)
    edit_json(folder / "hf_quant_config.json",
              lambda d: d["quantization"].update({"group_size": 32}))
    expect(folder, "hf_quant_config.json", "group_size 32", "16")
    edit_json(folder / "hf_quant_config.json",
              lambda d: d["quantization"].update({"group_size": 16, "exclude_modules": "lm_head"}))
    expect(folder, "exclude_modules must be a list")
    (folder / "hf_quant_config.json").write_text("{")
    expect(folder, "hf_quant_config.json", "not JSON")
    (folder / "hf_quant_config.json").write_text("[]")
    expect(folder, "hf_quant_config.json", '"quantization"')


@pytest.mark.parametrize("qc,needle", [
    ({"quant_method": "mxfp4"}, "MoE experts only"),
    ({"quant_method": "gptq", "bits": 4}, "unsupported quant_method 'gptq'"),
    ("nvfp4", "must be an object"),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {
        "num_bits": 8, "type": "int"}}}}, "8-bit int"),
    ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "config_groups":
        {"g": {"weights": {"num_bits": 4, "type": "float", "group_size": 16},
               "input_activations": {"num_bits": 8}}}}, "W4A4"),
    ({"quant_method": "compressed-tensors", "config_groups": {}}, "no config_groups"),
])
def test_bad_quantization_config(qc, needle, tmp_path):
    folder = fixture(tmp_path, Q3)
    (folder / "hf_quant_config.json").unlink()
    edit_json(folder / "config.json", lambda d: d.update({"quantization_config": qc}))
    expect(folder, "config.json", needle)


@pytest.mark.parametrize("content,needle", [
    (None, "no config.json"), (b"{oops", "not JSON"), (b"\xff\xfe\x00", "not UTF-8"),
    (b"[1]", "not a JSON object"),
])
def test_bad_config(content, needle, tmp_path):
    folder = fixture(tmp_path, Q3)
    if content is None:
        (folder / "config.json").unlink()
    else:
        (folder / "config.json").write_bytes(content)
    expect(folder, needle)


def test_not_a_folder_and_no_weights(tmp_path):
    expect(tmp_path / "nope", "not a folder")
    (tmp_path / "f.safetensors").write_bytes(b"x")
    expect(tmp_path / "f.safetensors", "not a folder")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "config.json").write_text("{}")
    expect(tmp_path / "d", "no model.safetensors")
    (tmp_path / "d" / "pytorch_model.bin").write_bytes(b"x")
    expect(tmp_path / "d", "pickle")


def test_bad_resgen_fields(tmp_path):
    folder = fixture(tmp_path, Q3)
    (folder / "resgen").mkdir()
    j = folder / "resgen" / "resgen.json"
    j.write_text(json.dumps({"layers": {Q: {"compensation": "0.3"}}}))
    expect(folder, "resgen.json", Q, "unknown compensation '0.3'")
    j.write_text(json.dumps({"layers": {Q: {"compensation": "0.25"}}}))
    expect(folder, "resgen.json", Q, "needs", "resgen_ext_weight")
    j.write_text(json.dumps({"fmt": "mxfp4", "layers": {}}))
    expect(folder, "resgen.json", "mxfp4 layers")
    j.write_text("[")
    expect(folder, "resgen.json", "not JSON")
