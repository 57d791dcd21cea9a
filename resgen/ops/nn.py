"""torch.nn front end of resgen.ops: drop-in modules for a model's linear layers.

    from resgen.ops.nn import FP4Linear
    from resgen.quality.model import quantizable_linears, replace_linears
    new = {name: FP4Linear.from_linear(lin, "nvfp4", "full", input_scale=s[name])
           for name, lin in quantizable_linears(model).items()}
    replace_linears(model, new)

The weight is quantized once when the module is built (resgen.calibrate.prepare_weight); each
forward runs resgen.ops.Linear on the activations rounded to BF16, adds the bias in FP32 and
returns the input's dtype. Build the modules on the device they will run on (the prepared weight and
the kernels' buffers live there; `Module.to` does not move them).
"""

from __future__ import annotations

from typing import Any

import torch

from ..calibrate import QLinearWeight, Selection, prepare_weight
from .common import require_cuda_device
from .linear import Linear

__all__ = ["FP4Linear"]


def _default_arch() -> str:
    from ..settings import settings

    return settings().arch


class FP4Linear(torch.nn.Module):
    """y = x W^T + b with W in NVFP4 / MXFP4 and x quantized on the fly (with residue
    compensation "none" / "full" / a K-Ext ratio), on the tuned kernels.

    qweight: the prepared weight; bias: float [N] or None; further keyword arguments go to
    resgen.ops.Linear (device, family, variant, dispatcher, ...)."""

    def __init__(self, qweight: QLinearWeight, compensation: str | float = "none",
                 bias: torch.Tensor | None = None, **linear_kwargs: Any) -> None:
        super().__init__()
        self.op = Linear(qweight, compensation, **linear_kwargs)
        self.in_features, self.out_features = self.op.k, self.op.n
        if bias is not None:
            if bias.shape != (self.out_features,):
                raise ValueError(f"bias must have shape ({self.out_features},), got "
                                 f"{tuple(bias.shape)}")
            bias = bias.detach().to(device=self.op.device, dtype=torch.float32)
        self.register_buffer("bias", bias)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, fmt: str = "nvfp4",
                    compensation: str | float = "none", *,
                    input_scale: torch.Tensor | float | None = None,
                    selection: Selection | None = None, **linear_kwargs: Any) -> "FP4Linear":
        """Quantize an nn.Linear's weight (offline): NVFP4 with a static activation scale
        (`input_scale`, e.g. amax / (6 * 448) from calibration) or dynamic scales (None),
        or MXFP4; a K-Ext ratio needs the calibrated channel `selection` of that ratio."""
        require_cuda_device(linear_kwargs.get("device"), linear_kwargs.get("arch") or _default_arch(),
                            what="resgen.ops.FP4Linear", simulated=bool(
                                linear_kwargs.get("compile_fn") or
                                linear_kwargs.get("quantizer_fn")))    # before quantizing
        w = linear.weight.detach().float().cpu()
        qw = prepare_weight(w, fmt, selection, input_scale=input_scale)
        bias = None if linear.bias is None else linear.bias.detach().float()
        return cls(qw, compensation, bias, **linear_kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.op(x.to(torch.bfloat16))
        if self.bias is not None:
            y = y.float() + self.bias         # one rounding to the output dtype
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"fmt={self.op.fmt}, compensation={self.op.compensation}, "
                f"bias={self.bias is not None}")
