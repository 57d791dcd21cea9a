"""A CPU simulation of the quant_sm100 kernel's work decomposition and stores, for tests (there is
no Blackwell GPU here).

It walks the grid as the template does (CTA, unroll step, warp -> warp tile t; tile -> token
slot j and channel chunk c; lane -> its EPT channels), takes each lane's values from
resgen.formats (the per-block math of the device, resgen.kernels.fp4_device, is formats' bit-for-
bit twin; the Hopper quantizer's tests check that), and performs exactly the template's stores:
codes (4 or 8 bytes per lane, element 0 in the low nibble) at row x Kp / 2 + col / 2, a scale
byte by each block's lead lane at sm100_layout.sf_offset(sf_row(row, SF_TILE), col / BS, SFC),
the residue row at act_row(j, residue), the K-Ext extension of each lane at column
K + (ch0 / 8) KSEL with its scale by the lane of every R_LANES. Every byte lands in a byte image
of the outputs; a byte stored twice with different values, or a store outside the buffers,
fails. The result must equal sm100_operand.operand_reference byte for byte.
"""

from __future__ import annotations

import torch

from .. import formats
from ..calibrate import Selection
from .quant_sm100 import QuantSm100Config, QuantSm100Outputs
from .sm100_layout import act_row, sf_cols, sf_offset, sf_row
from .sm100_operand import Sm100Operand, sf_bytes

__all__ = ["simulate_quant"]


def simulate_quant(c: QuantSm100Config, x: torch.Tensor, out: QuantSm100Outputs,
                   alpha: float | None = None, masks: torch.Tensor | None = None
                   ) -> Sm100Operand:
    """Quantize x: [m, K] bf16 into out's buffers as the kernel would. alpha: the static NVFP4
    tensor scale (None: dynamic, from x; MXFP4: unused); masks: K-Ext uint8 [K / 8]."""
    if c.why_invalid():
        raise ValueError(c.why_invalid())
    op = out.operand
    m, k = x.shape
    bs = formats.block_size(c.fmt)
    ept, warps, unroll = c.ept, c.warps, c.unroll
    nc = k // (32 * ept)
    total = out.slots * nc
    tpc = warps * unroll
    n_ctas = -(-total // tpc)
    lanes_b = max(1, bs // ept)
    bpl = max(1, ept // bs)
    ks = c.ksel * ept // 8
    r_lanes = bs // ks if ks else 0
    kp2 = c.kp // 2
    sfc = sf_cols(c.kp, c.fmt)
    sel = None if c.mode != "kext" else Selection(masks.cpu(), float(c.compensation))
    xf = torch.zeros(out.slots, k)
    xf[:m] = x.float().cpu()
    gs = None
    if c.fmt == "nvfp4":
        gs = (formats.nvfp4_global_scale(x.float().cpu()) if alpha is None
              else torch.tensor(float(alpha), dtype=torch.float32))
    base, res = formats.quantize_with_residue(xf, c.fmt, channels=sel, global_scale=gs)
    bcodes = formats.unpack_fp4(base.codes)
    rcodes = formats.unpack_fp4(res.codes)
    bsf, rsf = sf_bytes(base.scales, c.fmt), sf_bytes(res.scales, c.fmt)
    codes_img = op.codes.cpu().reshape(-1).clone()
    sf_img = op.sf.cpu().clone()
    seen: dict[tuple[str, int], int] = {}

    def put(img, name, off, val):
        if not 0 <= off < img.numel():
            raise AssertionError(f"{name} store at {off} outside the buffer ({img.numel()})")
        key = (name, off)
        if key in seen and seen[key] != val:
            raise AssertionError(f"{name} byte {off} stored twice with different values")
        seen[key] = val
        img[off] = val

    def store_codes(row, col, codes):
        for i in range(0, len(codes), 2):
            put(codes_img, "codes", row * kp2 + (col + i) // 2,
                int(codes[i]) | (int(codes[i + 1]) << 4) if i + 1 < len(codes) else int(codes[i]))

    for cta in range(n_ctas):
        for u in range(unroll):
            for w in range(warps):
                t = cta * tpc + u * warps + w
                if t >= total:
                    continue                          # predicated off: stores nothing
                j, ch = divmod(t, nc)
                rb = act_row(j, False, c.layout) if c.mode == "mext" else j
                rr = act_row(j, True, c.layout) if c.mode == "mext" else j
                for lane in range(32):
                    ch0 = ch * 32 * ept + lane * ept
                    store_codes(rb, ch0, bcodes[j, ch0:ch0 + ept])
                    if lane % lanes_b == 0:
                        for b in range(bpl):
                            col = ch0 + b * bs
                            put(sf_img, "sf", sf_offset(sf_row(rb, c.sf_tile), col // bs, sfc),
                                int(bsf[j, col // bs]))
                    if c.mode == "mext":
                        store_codes(rr, ch0, rcodes[j, ch0:ch0 + ept])
                        if lane % lanes_b == 0:
                            for b in range(bpl):
                                col = ch0 + b * bs
                                put(sf_img, "sf", sf_offset(sf_row(rr, c.sf_tile), col // bs,
                                                            sfc), int(rsf[j, col // bs]))
                    elif c.mode == "kext":
                        e0 = (ch0 // 8) * c.ksel
                        col = k + e0
                        if ks == 1:
                            # the even lane of each pair stores both nibbles
                            if lane % 2 == 0:
                                store_codes(rb, col, rcodes[j, e0:e0 + 2])
                        else:
                            store_codes(rb, col, rcodes[j, e0:e0 + ks])
                        if lane % r_lanes == 0:
                            put(sf_img, "sf", sf_offset(sf_row(rb, c.sf_tile), col // bs, sfc),
                                int(rsf[j, e0 // bs]))
    codes = codes_img.reshape(op.codes.shape).to(op.codes.device)
    sf = sf_img.to(op.sf.device)
    op.codes.copy_(codes)
    op.sf.copy_(sf)
    a = None
    if c.fmt == "nvfp4":
        a = gs.reshape(1).to(torch.float32).to(op.codes.device)
    return Sm100Operand(op.fmt, m, op.rows, op.layout, op.sf_tile, op.codes, op.sf, a)
