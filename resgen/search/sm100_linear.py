"""What the Blackwell linear family (linear_sm100_tc) and its quantizer (quant_sm100) share: the
layer quantizer a whole linear layer puts in front of the GEMM (by design: a layer is the
quantizer writing the operand layout the GEMM reads, then the GEMM).
"""

from __future__ import annotations

from typing import Any

from .variant import LinearProblem

__all__ = ["layer_quantizer"]

_LAYER_QUANT: dict[Any, Any] = {}
ARCH = "sm_100a"


def layer_quantizer(problem: LinearProblem, layout: str, sf_tile: int) -> Any:
    """The compiled quant_sm100 kernel (its default configuration) writing the operand of a
    linear_sm100_tc variant with activation row layout `layout` and scale factors tile-padded
    for `sf_tile` rows, with the problem's alpha (static NVFP4, dynamic NVFP4: amax pass +
    quantizer, MXFP4: none). Compiled once per process per configuration."""
    from ..kernels.quant_sm100 import compile_config
    from .quant_sm100 import FAMILY, QuantSm100Problem, config_of

    qp = QuantSm100Problem.for_linear(problem, layout=layout, sf_tile=sf_tile)
    cfg = config_of(FAMILY.default(qp, ARCH), qp)
    if cfg not in _LAYER_QUANT:
        _LAYER_QUANT[cfg] = compile_config(cfg, ARCH)[0]
    return _LAYER_QUANT[cfg]
