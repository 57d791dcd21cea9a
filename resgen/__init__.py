"""resgen: accurate and fast FP4 LLM inference with residue compensation (ResServe).

Layers, each importing only those before it:
formats -> calibrate / kvcache -> reference -> kernels (templates) -> search -> db -> runtime
-> ops -> cli.
"""

__version__ = "0.1.0"


def load(model, **kwargs):
    """Load a model for generation on resgen's kernels: resgen.engine.load (its docstring
    lists the options), e.g. ``resgen.load("dir", compensation="full", kv="nvfp4")``."""
    from .engine import load as _load

    return _load(model, **kwargs)


def autotune(**kwargs):
    """``with resgen.autotune():`` record the shapes resgen's custom ops run inside the block
    and tune them into the user's database on exit: resgen.autotuning.autotune (its docstring
    lists the options)."""
    from .autotuning import autotune as _autotune

    return _autotune(**kwargs)
