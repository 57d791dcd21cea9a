"""resgen's inference engine: Llama / Qwen2 / Qwen3 checkpoints in, tokens out, on the tuned
FP4 kernels.

    import resgen
    llm = resgen.load("model_dir_or.gguf", compensation="full", kv="nvfp4", fmt="nvfp4")
    print(llm.generate("Hello", max_new_tokens=32)[0].text)

Modules (each importing only those above it):
    config    DecoderConfig / RopeConfig from a Hugging Face config (families, RoPE types)
    rope      inverse frequencies (default, linear, llama3, yarn) and cos / sin tables
    source    model sources: HF folder (resgen.checkpoint), GGUF, transformers model, tensors
    calib     calibration statistics (static NVFP4 input scales, K-Ext selections) and files
    backend   the ops: "cuda" kernels, "sim" (the kernels' CPU simulations), "reference"
    kv        paged NVFP4 and dense KV caches, sizing, the request check
    model     the decoder forward: ragged prefill, one decode step
    build     dense / quantized / FP4-checkpoint models (q/k/v and gate/up fused)
    sampling  greedy and temperature / top-p sampling on the device
    graphs    decode steps in CUDA graphs per (batch bucket, KV class)
    llm       resgen.load and LLM.generate
    cli       `resgen generate`
"""

from .config import DecoderConfig, RopeConfig
from .llm import LLM, Completion, load

__all__ = ["load", "LLM", "Completion", "DecoderConfig", "RopeConfig"]
