"""torch.nn front end of resgen.ops: drop-in modules for a model's linear layers.

    from resgen.ops.nn import FP4Linear
    mod = FP4Linear.from_linear(lin, "nvfp4", "full", input_scale=s)   # lin: an nn.Linear
    y = mod(x)                    # x: [..., K] any float dtype -> [..., N] in x's dtype

FP4Linear is a real nn.Module: the quantized weight lives in registered buffers named as the
ModelOpt Hugging Face export (and resgen.calibrate.save_layers) names them, so `state_dict()`,
`load_state_dict()`, `.to()` / `.cuda()` and a transformers model's `save_pretrained` carry it:

    weight                uint8 [N, (K + ext) / 2]   two E2M1 codes per byte, even element low
    weight_scale          NVFP4 float8_e4m3fn / MXFP4 uint8 E8M0 [N, (K + ext) / block]
    weight_scale_2        float32 []  NVFP4 weight tensor scale (absent for MXFP4)
    input_scale           float32 []  NVFP4 static activation scale (absent when dynamic)
    resgen_channel_mask   uint8 [K / 8]   K-Ext selection (absent otherwise)
    resgen_ratio          float32 []      its ratio
    bias                  float32 [N] (absent without a bias)

K is the module's configuration (in_features), not a tensor: the state dict holds exactly a
ModelOpt NVFP4 layer's tensors (plus resgen's K-Ext fields; save_layers also writes
resgen_in_features). `.to(dtype)` / `.half()` move these buffers but never change their dtypes (a float8 or float32
scale cast to BF16 would change the weight). After a move or a `load_state_dict` the run-time
op is rebuilt from the buffers (its plans, prepared weight layouts and compiled kernels are per
device and per weight).

forward: the activations rounded to BF16 go through torch.ops.resgen.linear (resgen.ops.custom:
opaque to torch.compile / torch.export, no graph break), the bias is added in FP32 and the
result returned in the input's dtype. backend="kernels" (default) runs resgen.ops.Linear, the
tuned kernels; backend="reference" runs resgen.ops.cpu.ReferenceLinear, the exact reference
(CPU, or any device; also "w4a16").
"""

from __future__ import annotations

from typing import Any

import torch

from .. import formats
from ..calibrate import QLinearWeight, Selection, prepare_weight
from . import custom
from .common import require_cuda_device
from .cpu import ReferenceLinear
from .linear import Linear

__all__ = ["FP4Linear", "BACKENDS"]

BACKENDS: tuple[str, ...] = ("kernels", "reference")
# buffers whose dtype is part of the format (never converted by Module.to(dtype))
_FIXED = ("weight", "weight_scale", "weight_scale_2", "input_scale", "resgen_channel_mask",
          "resgen_ratio", "bias")


def _comp_string(c: str | float) -> str:
    if c in ("none", "full", "w4a16"):
        return c
    return str(float(c))


def _default_arch() -> str:
    from ..settings import settings

    return settings().arch


class FP4Linear(torch.nn.Module):
    """y = x W^T + b with W in NVFP4 / MXFP4 and x quantized on the fly (residue compensation
    "none" / "full" / a K-Ext ratio), or x read as BF16 ("w4a16": the Hopper-native mode, the
    same compiled kernels as plain W4A4 without the activation quantizer).

    qweight: the prepared weight; bias: float [N] or None; backend: "kernels" | "reference";
    name: a label for the op's handle (e.g. the module path); further keyword arguments go to
    resgen.ops.Linear (device, family, variant, dispatcher, ...; the CPU tests pass the
    kernels' simulations there). The buffers live on `device` (default: the current CUDA
    device for the kernels, else the CPU)."""

    def __init__(self, qweight: QLinearWeight, compensation: str | float = "none",
                 bias: torch.Tensor | None = None, *, backend: str = "kernels", name: str = "",
                 **linear_kwargs: Any) -> None:
        super().__init__()
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        comp = _comp_string(compensation)
        self.fmt, self.compensation, self.backend, self.name = qweight.fmt, comp, backend, name
        self.in_features, self.out_features = qweight.in_features, qweight.out_features
        self.ratio = qweight.ratio
        self.static_scale = qweight.input_scale is not None
        self._linear_kwargs = dict(linear_kwargs)
        device = linear_kwargs.get("device")
        if device is None:
            device = (torch.device("cuda", torch.cuda.current_device())
                      if backend == "kernels" and torch.cuda.is_available() else "cpu")
        device = torch.device(device)
        self.register_buffer("weight", qweight.q.codes.to(device))
        self.register_buffer("weight_scale", qweight.q.scales.to(device))
        gs = qweight.q.global_scale
        self.register_buffer("weight_scale_2", None if gs is None else
                             gs.to(device=device, dtype=torch.float32).reshape(()))
        isc = qweight.input_scale
        self.register_buffer("input_scale", None if isc is None else
                             torch.as_tensor(isc, dtype=torch.float32).to(device).reshape(()))
        sel = qweight.selection
        self.register_buffer("resgen_channel_mask", None if sel is None else
                             sel.masks.to(device))
        self.register_buffer("resgen_ratio", None if sel is None else
                             torch.tensor(sel.ratio, dtype=torch.float32, device=device))
        if bias is not None:
            if bias.shape != (self.out_features,):
                raise ValueError(f"bias must have shape ({self.out_features},), got "
                                 f"{tuple(bias.shape)}")
            bias = bias.detach().to(device=device, dtype=torch.float32)
        self.register_buffer("bias", bias)
        self.op: Any = None
        self.handle = ""
        self._rebuild()
        self.register_load_state_dict_post_hook(lambda mod, keys: mod._rebuild())

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, fmt: str = "nvfp4",
                    compensation: str | float = "none", *,
                    input_scale: torch.Tensor | float | None = None,
                    selection: Selection | None = None, **kwargs: Any) -> "FP4Linear":
        """Quantize an nn.Linear's weight (offline): NVFP4 with a static activation scale
        (`input_scale`, e.g. amax / (6 * 448) from calibration) or dynamic scales (None),
        or MXFP4; a K-Ext ratio needs the calibrated channel `selection` of that ratio."""
        if kwargs.get("backend", "kernels") == "kernels":      # before quantizing
            require_cuda_device(kwargs.get("device"), kwargs.get("arch") or _default_arch(),
                                what="resgen.ops.FP4Linear",
                                simulated=bool(kwargs.get("compile_fn") or
                                               kwargs.get("quantizer_fn")))
        w = linear.weight.detach().float().cpu()
        qw = prepare_weight(w, fmt, selection, input_scale=input_scale)
        bias = None if linear.bias is None else linear.bias.detach().float()
        return cls(qw, compensation, bias, **kwargs)

    @classmethod
    def empty(cls, in_features: int, out_features: int, fmt: str = "nvfp4",
              compensation: str | float = "none", *, ratio: float | None = None,
              static_scale: bool = False, bias: bool = False, **kwargs: Any) -> "FP4Linear":
        """A module with the buffers of this configuration, zero-filled (the codes decode to
        zeros; an NVFP4 tensor scale of 1), for load_state_dict / from_pretrained to fill."""
        bs = formats.block_size(fmt)
        cpu = torch.device("cpu")   # explicit: transformers builds models under a meta context
        sel = None
        ext = 0
        if ratio is not None:
            from ..calibrate import select_channels

            sel = select_channels(torch.zeros(in_features, device=cpu), ratio)
            ext = sel.extension_length(fmt)
        width = in_features + ext
        scales = torch.zeros(out_features, width // bs, dtype=torch.uint8, device=cpu)
        if fmt == "nvfp4":
            scales = scales.view(torch.float8_e4m3fn)
        q = formats.QuantizedTensor(
            fmt, torch.zeros(out_features, width // 2, dtype=torch.uint8, device=cpu), scales,
            torch.ones((), device=cpu) if fmt == "nvfp4" else None)
        isc = torch.ones((), device=cpu) if static_scale and fmt == "nvfp4" else None
        qw = QLinearWeight(q, in_features, sel, isc)
        return cls(qw, compensation, torch.zeros(out_features, device=cpu) if bias else None,
                   **kwargs)

    def qweight(self) -> QLinearWeight:
        """The weight as a QLinearWeight over the current buffers (validated)."""
        k = self.in_features
        mask = self.resgen_channel_mask
        sel = None if mask is None else Selection(mask.cpu(), float(self.resgen_ratio))
        fmt = self.fmt
        want = torch.float8_e4m3fn if fmt == "nvfp4" else torch.uint8
        if self.weight.dtype != torch.uint8 or self.weight_scale.dtype != want:
            raise ValueError(f"{self.name or 'FP4Linear'}: weight must be uint8 and "
                             f"weight_scale {want}, got {self.weight.dtype} / "
                             f"{self.weight_scale.dtype}")
        ext = 0 if sel is None else sel.extension_length(fmt)
        if self.weight.shape[-1] * 2 != k + ext or \
                self.weight_scale.shape[-1] * formats.block_size(fmt) != k + ext:
            raise ValueError(f"{self.name or 'FP4Linear'}: weight {tuple(self.weight.shape)} / "
                             f"scales {tuple(self.weight_scale.shape)} do not fit K + ext = "
                             f"{k + ext}")
        gs = self.weight_scale_2
        q = formats.QuantizedTensor(fmt, self.weight, self.weight_scale,
                                    None if gs is None else gs.float().reshape(()))
        return QLinearWeight(q, k, sel, self.input_scale)

    def _rebuild(self) -> None:
        """(Re)build the run-time op from the buffers where they are now, and register it."""
        if self.weight.device.type == "meta":
            self.op, self.handle = None, ""
            return
        qw = self.qweight()
        if qw.fmt == "nvfp4" and not bool(torch.isfinite(qw.q.global_scale)):
            raise ValueError(f"{self.name or 'FP4Linear'}: weight_scale_2 is not finite")
        dev = self.weight.device
        simulated = bool(self._linear_kwargs.get("compile_fn") or
                         self._linear_kwargs.get("quantizer_fn"))
        if self.backend != "reference" and dev.type != "cuda" and not simulated:
            # the kernels run on a CUDA device only: built when the module is moved there
            # (from_pretrained loads on the CPU, then .cuda()); forward says so until then
            self.op, self.handle = None, ""
            return
        if self.backend == "reference":
            op: Any = ReferenceLinear(qw, self.compensation, device=dev)
        else:
            kw = {**self._linear_kwargs, "device": dev}
            op = Linear(qw, self.compensation, **kw)
        self.op = op
        self.handle = custom.register(op, self.name)

    # -- nn.Module ---------------------------------------------------------------------------
    def _apply(self, fn, recurse: bool = True):
        # Move resgen's buffers with fn but keep their dtypes: fn applied to a uint8 probe
        # gives the target device (Module.to converts floating-point tensors only).
        fixed = {n: self._buffers.get(n) for n in _FIXED}
        for n in fixed:
            self._buffers.pop(n, None)
        try:
            super()._apply(fn, recurse)
        finally:
            for n, t in fixed.items():
                if t is not None:
                    dev = fn(torch.empty(0, dtype=torch.uint8, device=t.device)).device
                    t = t.to(dev)
                self._buffers[n] = t
        self._rebuild()
        return self

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs) -> None:
        # load_state_dict would copy_ a tensor of another dtype into a buffer, converting its
        # values (uint8 scale bytes into float8 scales, say): a silent corruption of the
        # weight. The format's dtypes must match exactly.
        bad = []
        for n in _FIXED:
            t, mine = state_dict.get(prefix + n), self._buffers.get(n)
            if t is not None and mine is not None and t.dtype != mine.dtype:
                bad.append(prefix + n)
                error_msgs.append(f"{prefix}{n}: dtype {t.dtype}, this {self.fmt} FP4Linear "
                                  f"stores {mine.dtype} (no conversion)")
        if bad:         # nothing of a rejected tensor is copied in
            state_dict = {k: v for k, v in state_dict.items() if k not in bad}
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        for k in bad:
            if k in missing_keys:
                missing_keys.remove(k)

    def __getstate__(self) -> dict:
        # the op and its handle belong to this process and this module: a copy (deepcopy,
        # pickle) builds its own from the copied buffers
        state = dict(self.__dict__)
        state["op"], state["handle"] = None, ""
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._rebuild()

    def warmup(self, ms) -> list:
        """Build the op's plans of these row counts (before CUDA graph capture)."""
        return self.op.warmup(ms)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.op is None:
            raise RuntimeError(
                f"{self.name or 'FP4Linear'}: backend {self.backend!r} runs on a CUDA GPU and "
                f"this module is on {self.weight.device}: move the model to the GPU first "
                "(model.cuda()), or load it with backend='reference' for the CPU")
        y = torch.ops.resgen.linear(x.to(torch.bfloat16), self.handle)
        if self.bias is not None:
            y = y.float() + self.bias         # one rounding to the output dtype
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"fmt={self.fmt}, compensation={self.compensation}, "
                f"bias={self.bias is not None}, backend={self.backend}")
