"""CPU emulation of the linear_sm90_fp8 kernels' arithmetic (resgen/templates/
linear_sm90_fp8.py.j2), element by element in the kernel's order.

For output (token t, channel c) the kernel walks the promotion groups j = 0, 1, .. in K order:
    part_j = sum over the group's 32 * group k of xq[t, k] * wq[c, k]       (the tensor core)
    acc    = acc + part_j * (sx[j, t] * sw[j, c])                           (FP32, CUDA cores)
and stores bf16(acc). sx * sw is a product of powers of two (exact in FP32 unless it
underflows) and so is part_j * (sx * sw): the only FP32 rounding of the promotion is the
addition, the same whether or not the compiler contracts it into an FMA.

part_j is modelled as the exact sum rounded once to FP32 (`simulate`). For group = 1 that IS
the tensor core's result: 32 products of E2M1 values are multiples of 1/4 below 36, their sum a
multiple of 1/4 of magnitude <= 1152 (13 significant bits), exact in any accumulator of at
least 13 bits - and Hopper's FP8 wgmma keeps about 14 (DeepSeek-V3 report / DeepGEMM), so the
kernel's FP32 output should equal the emulation bit for bit (tests/gpu checks it). For
group > 1 the folded codes carry 2^d, d in [-8, 6], and a group's sum can need up to
13 + 2 + 28 bits: a reduced-precision accumulator may round it where the model does not;
`simulate(..., acc_bits=b)` models such an accumulator crudely (each group's exact sum rounded
to b significant bits) to bound the effect, which only the GPU can measure.
A wload = "fp4" weight (Fp4Operand) enters as the E4M3 operand its in-kernel converter builds
(linear_sm90_fp8_operand.expand_fp4: the converter's bit math), the rest is the same.
"""

from __future__ import annotations

import torch

from .linear_sm90_fp8_geom import K_BLOCK
from .linear_sm90_fp8_operand import Fp4Operand, Fp8Operand, expand_fp4

__all__ = ["simulate", "round_to_bits"]


def round_to_bits(v: torch.Tensor, bits: int) -> torch.Tensor:
    """float64 v rounded to `bits` significant bits (round to nearest even)."""
    m, e = torch.frexp(v)
    scale = torch.ldexp(torch.ones_like(m), torch.full_like(e, bits))
    return torch.ldexp(torch.round(m * scale) / scale, e)


def simulate(x: Fp8Operand, w: Fp8Operand | Fp4Operand, m: int | None = None,
             acc_bits: int | None = None) -> torch.Tensor:
    """The kernel's FP32 accumulator before the BF16 store: float32 [m, N].

    x: the activations' operand (rows >= m), w: the weight's (rows = N); one group size.
    acc_bits: None = the tensor core's group sums exact, then rounded to FP32; b = each group
    sum first rounded to b significant bits (a reduced-precision accumulator model)."""
    if isinstance(w, Fp4Operand):
        w = expand_fp4(w)
    if x.group != w.group or x.kp != w.kp:
        raise ValueError(f"operands differ: group {x.group} / {w.group}, Kp {x.kp} / {w.kp}")
    m = x.rows if m is None else m
    n = w.rows
    gk = K_BLOCK * x.group
    ng = x.kp // gk
    xv = x.values()[:m].double().reshape(m, ng, gk)
    wv = w.values()[:n].double().reshape(n, ng, gk)
    sx, sw = x.scales[:, :m], w.scales[:, :n]
    acc = torch.zeros(m, n, dtype=torch.float32, device=xv.device)
    for j in range(ng):
        part = xv[:, j] @ wv[:, j].T                  # exact in float64 (<= 43 bits)
        if acc_bits is not None:
            part = round_to_bits(part, acc_bits)
        s = sx[j].unsqueeze(1) * sw[j].unsqueeze(0)   # float32, powers of two
        acc = acc + part.float() * s
    return acc
