"""Regenerate tests/fixtures/modelopt/: tiny checkpoints written by NVIDIA ModelOpt itself.

Needs nvidia-modelopt (PyPI; not a resgen dependency) in the running interpreter. On a CPU
machine (how the committed fixtures were made; modelopt 0.47.0, transformers 5.24, torch 2.13):

    python -m venv /tmp/mo-venv
    echo /path/to/resgen/.venv/lib/python3.11/site-packages > \
        /tmp/mo-venv/lib/python3.11/site-packages/resgen-venv.pth   # reuse torch/transformers
    /tmp/mo-venv/bin/pip install --no-deps nvidia-modelopt==0.47.0 ninja nvidia-ml-py pulp \
        omegaconf pydantic regex rich PyYAML
    /tmp/mo-venv/bin/python scripts/make_modelopt_fixture.py tests/fixtures/modelopt

Each fixture is a 2-layer, hidden-64 decoder with random weights (seeded), calibrated by
ModelOpt's mtq.quantize on random tokens and written by modelopt.torch.export.
export_hf_checkpoint, exactly as a user exports a real model:
  qwen3_nvfp4_fp8kv    Qwen3 (q/k norms, tied embeddings), NVFP4_DEFAULT_CFG + FP8_KV_CFG,
                       one model.safetensors
  llama_nvfp4_sharded  Llama, NVFP4_DEFAULT_CFG + NVFP4_KV_CFG, max_shard_size 60KB
                       (two shards + model.safetensors.index.json)
  llama_mxfp4_sharded  Llama, MXFP4_DEFAULT_CFG, two shards + index
  llama_nvfp4_partial  Llama, NVFP4_DEFAULT_CFG with layer 1's MLP and layer 0's o_proj left
                       unquantized: exclude_modules as ModelOpt's wildcard summary writes it
and, when compressed-tensors is installed (pip install --no-deps compressed-tensors==0.20.1
loguru psutil), ../compressed_tensors/qwen3_nvfp4_fp8kv: the first one converted by
compressed-tensors' own ModelOpt converter (llm-compressor's NVFP4 layout);
plus, per fixture, <name>.reference.safetensors beside the folder (inside it, a reader that
globs *.safetensors would take it for weights): ModelOpt's own dequantization (NVFP4QTensor /
MXFP4QTensor.dequantize, float32) and the source BF16 weight of two layer-0 linears; and
<name>/FIXTURE.json (versions, configs). About 180 KiB per fixture.
"""

from __future__ import annotations

import copy
import json
import shutil
import sys
from pathlib import Path

import torch

LAYERS = ("model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj")


def _model(kind: str):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    if kind == "qwen3":
        cfg = Qwen3Config(head_dim=16, tie_word_embeddings=True,
                          architectures=["Qwen3ForCausalLM"], **common)
        return Qwen3ForCausalLM(cfg).eval().to(torch.bfloat16)
    cfg = LlamaConfig(tie_word_embeddings=False, architectures=["LlamaForCausalLM"], **common)
    return LlamaForCausalLM(cfg).eval().to(torch.bfloat16)


def _calibrate(model) -> None:
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _ in range(2):
            model(torch.randint(0, 128, (2, 16), generator=g))


def make(out: Path, name: str, kind: str, base: str, kv: str | None, shard: str,
         disable: tuple[str, ...] = ()) -> None:
    import modelopt
    import modelopt.torch.quantization as mtq
    import transformers
    from modelopt.torch.export import export_hf_checkpoint
    from modelopt.torch.quantization.qtensor import MXFP4QTensor, NVFP4QTensor
    from safetensors.torch import load_file, save_file

    model = _model(kind)
    source = {m: model.get_submodule(m).weight.detach().clone() for m in LAYERS}
    cfg = copy.deepcopy(getattr(mtq, base))
    if kv:
        cfg["quant_cfg"] = list(cfg["quant_cfg"]) + list(getattr(mtq, kv)["quant_cfg"])
    cfg["quant_cfg"] = list(cfg["quant_cfg"]) + [{"quantizer_name": p, "enable": False}
                                                 for p in disable]
    model = mtq.quantize(model, cfg, _calibrate)
    folder = out / name
    if folder.exists():
        shutil.rmtree(folder)
    export_hf_checkpoint(model, export_dir=str(folder), max_shard_size=shard)
    tensors = {}
    for f in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    ref = {}
    for m in LAYERS if not disable else ():
        w, s = tensors[f"{m}.weight"], tensors[f"{m}.weight_scale"]
        shape = torch.Size((w.shape[0], w.shape[1] * 2))
        if base.startswith("NVFP4"):
            deq = NVFP4QTensor(shape, torch.float32, w).dequantize(
                dtype=torch.float32, scale=s, double_scale=tensors[f"{m}.weight_scale_2"],
                block_sizes={-1: 16})
        else:
            deq = MXFP4QTensor(shape, torch.float32, w).dequantize(
                dtype=torch.float32, scale=s, block_sizes={-1: 32})
        ref[f"{m}.modelopt_dequant"] = deq.contiguous()
        ref[f"{m}.source"] = source[m].contiguous()
    if ref:
        save_file(ref, str(out / f"{name}.reference.safetensors"))
    (folder / "FIXTURE.json").write_text(json.dumps({
        "written_by": "scripts/make_modelopt_fixture.py", "modelopt": modelopt.__version__,
        "transformers": transformers.__version__, "torch": torch.__version__,
        "model": kind, "quant_cfg": base, "kv_cfg": kv, "max_shard_size": shard,
        "disabled_quantizers": list(disable),
        "reference_layers": [] if disable else list(LAYERS)}, indent=1) + "\n")
    print(f"{folder}: {sorted(p.name for p in folder.iterdir())}")


def make_compressed_tensors(src: Path, dst: Path) -> None:
    """Convert a ModelOpt NVFP4 fixture with compressed-tensors' own converter
    (entrypoints.convert.ModelOptNvfp4Converter: weight -> weight_packed, 1 / weight_scale_2 ->
    weight_global_scale, 1 / input_scale -> input_global_scale, KV scales to BF16). Its
    output keeps a copy of the old hf_quant_config.json, as real converted checkpoints do."""
    import compressed_tensors
    from compressed_tensors.entrypoints.convert import ModelOptNvfp4Converter, convert_checkpoint
    from compressed_tensors.quantization import QuantizationArgs

    if dst.exists():
        shutil.rmtree(dst)
    kv = QuantizationArgs(num_bits=8, type="float", strategy="tensor", dynamic=False,
                          symmetric=True)
    conv = ModelOptNvfp4Converter(ignore=["lm_head", "re:.*embed_tokens"], targets=["Linear"],
                                  kv_cache_scheme=kv)
    convert_checkpoint(str(src), str(dst), conv, max_workers=1, device="cpu")
    info = json.loads((dst / "FIXTURE.json").read_text())
    info.update({"converted_by": "compressed_tensors.entrypoints.convert.ModelOptNvfp4Converter",
                 "compressed_tensors": compressed_tensors.__version__,
                 "converted_from": f"tests/fixtures/modelopt/{src.name}"})
    (dst / "FIXTURE.json").write_text(json.dumps(info, indent=1) + "\n")
    print(f"{dst}: {sorted(p.name for p in dst.iterdir())}")


def main(argv: list[str]) -> int:
    out = Path(argv[0] if argv else "tests/fixtures/modelopt")
    out.mkdir(parents=True, exist_ok=True)
    make(out, "qwen3_nvfp4_fp8kv", "qwen3", "NVFP4_DEFAULT_CFG", "FP8_KV_CFG", "10GB")
    make(out, "llama_nvfp4_sharded", "llama", "NVFP4_DEFAULT_CFG", "NVFP4_KV_CFG", "60KB")
    make(out, "llama_mxfp4_sharded", "llama", "MXFP4_DEFAULT_CFG", None, "60KB")
    make(out, "llama_nvfp4_partial", "llama", "NVFP4_DEFAULT_CFG", None, "10GB",
         disable=("*layers.1.mlp*", "*layers.0.self_attn.o_proj*"))
    try:
        import compressed_tensors  # noqa: F401
    except ImportError:
        print("compressed-tensors is not installed: the compressed_tensors fixture is skipped")
        return 0
    make_compressed_tensors(out / "qwen3_nvfp4_fp8kv",
                            out.parent / "compressed_tensors" / "qwen3_nvfp4_fp8kv")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
