"""resgen: accurate and fast FP4 LLM inference with residue compensation (ResServe).

Layers, each importing only those before it:
formats -> calibrate / kvcache -> reference -> kernels (templates) -> search -> db -> runtime
-> ops -> cli.
"""

__version__ = "0.1.0"
