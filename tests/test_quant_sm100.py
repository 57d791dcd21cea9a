"""quant_sm100 on the CPU: the operand it must write (sm100_operand.operand_reference) against
resgen.formats, the kernel's work decomposition and stores simulated byte for byte against it,
the configuration / variant / problem tables, and the runner with the simulation standing in
for the kernel (compiles: tests/test_sm100_compile.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from resgen import formats as F
from resgen.calibrate import Selection
from resgen.kernels import quant_sm100 as Q
from resgen.kernels.quant_sm100_sim import simulate_quant
from resgen.kernels.quant_inputs import make_inputs, random_masks
from resgen.kernels.sm100_layout import act_row
from resgen.kernels.sm100_operand import Sm100Operand, operand_reference, unpack_sf
from resgen.search import quant_sm100 as S
from resgen.search.variant import LinearProblem

ARCH = "sm_100a"
CASES = [
    # (fmt, compensation, layout, sf_tile, ept, warps, unroll, alpha)
    ("nvfp4", "full", "row_pair", 8, 8, 4, 1, "static"),
    ("nvfp4", "full", "tile8", 16, 16, 2, 2, "dynamic"),
    ("mxfp4", "full", "row_pair", 32, 8, 8, 4, "none"),
    ("mxfp4", "none", "plain", 128, 16, 4, 1, "none"),
    ("nvfp4", "none", "plain", 64, 8, 1, 2, "static"),
    ("nvfp4", "0.125", "plain", 8, 8, 4, 2, "static"),
    ("nvfp4", "0.25", "plain", 16, 16, 4, 1, "dynamic"),
    ("mxfp4", "0.5", "plain", 8, 8, 2, 1, "none"),
    ("mxfp4", "1.0", "plain", 128, 16, 8, 2, "none"),
    ("nvfp4", "0.5", "plain", 32, 8, 8, 4, "static"),
]


def _cfg(fmt, comp, layout, sf_tile, ept, warps, unroll, alpha, k=512):
    return Q.QuantSm100Config(fmt, comp, k, layout, sf_tile, ept, warps, unroll, alpha)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("kind", ["randn", "ties", "zeros", "mixed"])
def test_kernel_stores_reproduce_the_reference_operand(case, kind):
    """The template's grid / warp tile / lane decomposition, row map, K-Ext columns and every
    code and scale-factor address (tile-padded atoms), simulated, write exactly the bytes of
    operand_reference into 0xFF-poisoned buffers (padding left zero), for 13 tokens (tile8
    pads to 16 slots)."""
    c = _cfg(*case)
    m = 13
    x = make_inputs(kind, m, c.k, seed=hash((case, kind)) % 1000)
    masks = random_masks(c.k, c.compensation, 5) if c.mode == "kext" else None
    sel = None if masks is None else Selection(masks, float(c.compensation))
    alpha = F.nvfp4_global_scale(x.float()) if c.alpha == "static" else None
    out = Q.QuantSm100Kernel(c, None).outputs(m, "cpu")
    S.poison_written(out, c)
    got = simulate_quant(c, x, out, None if alpha is None else float(alpha), masks)
    ref = operand_reference(x.float(), c.fmt, c.compensation, c.layout, c.sf_tile, alpha, sel,
                            Q.slots_for(m, c.layout))
    res = S.compare_operands(got, ref, kind)
    assert res.ok, res.detail


def test_reference_operand_holds_formats_quantization():
    """operand_reference's bytes are resgen.formats' codes and scales at the layout's rows and
    tile-padded SF rows (the definition both families share)."""
    x = make_inputs("randn", 5, 512, seed=1)
    base, res = F.quantize_with_residue(x, "nvfp4", global_scale=None)
    op = operand_reference(x.float(), "nvfp4", "full", "tile8", 16)
    assert op.rows == 16 and op.sf_tile == 16
    sf = unpack_sf(op.sf, op.rows, 32, 16)
    for t in range(5):
        rb, rr = act_row(t, False, "tile8"), act_row(t, True, "tile8")
        assert torch.equal(op.codes[rb, :256], base.codes[t])
        assert torch.equal(op.codes[rr, :256], res.codes[t])
        assert torch.equal(sf[rb, :32], base.scales[t].view(torch.uint8))
        assert torch.equal(sf[rr, :32], res.scales[t].view(torch.uint8))
    assert float(op.alpha) == float(base.global_scale)


@pytest.mark.parametrize("kw, reason", [
    (dict(layout="plain", compensation="full"), "M-Ext uses row_pair or tile8"),
    (dict(layout="row_pair", compensation="none"), "does not fit"),
    (dict(sf_tile=12), "power of 2"),
    (dict(layout="tile8", sf_tile=8), "groups of 16"),
    (dict(ept=4), "8 or 16"),
    (dict(k=4000), "warp tile"),
    (dict(warps=3), "1, 2, 4 or 8"),
    (dict(unroll=3), "1, 2 or 4"),
    (dict(alpha="none"), "does not fit nvfp4"),
    (dict(fmt="mxfp4", alpha="static"), "does not fit mxfp4"),
    (dict(compensation="0.125", layout="plain", k=256 + 128), "warp tile"),
    (dict(ept=16, unroll=4), "spills"),
])
def test_config_validity_table(kw, reason):
    base = dict(fmt="nvfp4", compensation="full", k=4096, layout="row_pair", sf_tile=8)
    base.update(kw)
    why = Q.QuantSm100Config(**base).why_invalid()
    assert why is not None and reason in why, why


def test_problem_for_linear_and_variant_tables():
    lp = LinearProblem("nvfp4", "full", 3, 4096, 4096)
    qp = S.QuantSm100Problem.for_linear(lp)
    assert (qp.layout, qp.sf_tile, qp.alpha_mode()) == ("row_pair", 8, S.AlphaMode.STATIC)
    assert S.QuantSm100Problem.for_linear(dataclasses.replace(lp, m=100)).sf_tile == 128
    sp = S.FAMILY.space(qp, ARCH)
    assert sp and S.FAMILY.default(qp, ARCH) in sp
    assert all(S.FAMILY.why_invalid(v, qp, ARCH) is None for v in sp)
    v = sp[0]
    assert "layout" in S.FAMILY.why_invalid(dataclasses.replace(v, layout=S.QLayout.TILE8),
                                            qp, ARCH)
    assert "alpha" in S.FAMILY.why_invalid(dataclasses.replace(v, alpha=S.AlphaMode.DYNAMIC),
                                           qp, ARCH)
    assert "sm_100a" in S.FAMILY.why_invalid(v, qp, "sm_90a")
    assert S.FAMILY.compile_key(v, dataclasses.replace(qp, m=77)) == dataclasses.replace(qp, m=1)
    with pytest.raises(ValueError):
        S.QuantSm100Problem.from_dict({**qp.as_dict(), "sf_tile": 24})
    tp = S.FAMILY.template_params(v, qp)
    assert tp["kp"] == 4096 and tp["sfc"] == 256 and tp["sf_tile"] == 8


class _SimCompiled:
    """Stands in for a compiled quant_sm100 entry on the CPU: the launcher's arguments are the
    tensors themselves (make_ptr patched); runs the store simulation into them."""

    def __init__(self, c):
        self.c = c
        self.calls = []

    def __call__(self, x, alpha, masks, codes, sf, ws, m, slots, stream):
        c = self.c
        m, slots = int(getattr(m, "value", m)), int(getattr(slots, "value", slots))
        self.calls.append((m, slots))
        rows = codes.shape[0]
        out = Q.QuantSm100Outputs(Sm100Operand(c.fmt, m, rows, c.layout, c.sf_tile, codes, sf,
                                               None), slots, ws, ws)
        a = float(alpha.reshape(-1)[0]) if c.alpha == "static" else None
        op = simulate_quant(c, x, out, a, masks if c.mode == "kext" else None)
        if c.alpha == "dynamic":
            alpha.copy_(op.alpha)


@pytest.mark.parametrize("fmt, comp, static", [("nvfp4", "full", True), ("nvfp4", "0.25", False),
                                               ("mxfp4", "full", True)])
def test_runner_checks_byte_exact_with_a_simulated_kernel(fmt, comp, static, monkeypatch):
    monkeypatch.setattr(Q.QuantSm100Kernel, "_ptr", staticmethod(lambda t, dt, align: t))
    lp = LinearProblem(fmt, comp, 5, 4096, 512, static_scale=static)
    qp = S.QuantSm100Problem.for_linear(lp)
    v = S.FAMILY.default(qp, ARCH)
    fake = _SimCompiled(S.config_of(v, qp))
    r = S.FAMILY.runner(fake, v, qp, "cpu", n_sets=2)
    for _ in range(3):
        res = r.check()
        assert res.ok, res.detail
    r.rotate(1)
    op = r()
    assert fake.calls[-1] == (5, Q.slots_for(5, qp.layout)) and op.codes.shape[0] == op.rows
