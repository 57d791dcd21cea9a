"""Model-level quality evaluation of FP4 methods (CPU): SmolLM2-135M on the Jargon File.

fakequant   bit-exact fake-quant linear layers (checked against resgen.reference)
model       model / text loading, token splits, the linear layers that get quantized
capture     calibration statistics and captured layer inputs (forward hooks)
selection   channel-selection scores (the paper's mean |x| and the error-aware one)
evaluate    perplexity and per-layer output NMSE
report      the experiment grid behind `resgen report`; cli holds the entry points
"""
