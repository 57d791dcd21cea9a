"""Run one variant of every Hopper kernel family once on a small problem, for
`compute-sanitizer --tool memcheck` (it checks every launch of this process):

    compute-sanitizer --tool memcheck --error-exitcode 9 python3 tests/gpu/sanitize_families.py

Each family's default variant (plus a fused-quantization linear variant, a bulk-ring linear
variant with PDL, two ragged-K-slice linear variants, a split-K WGMMA variant and a PDL +
split-K WGMMA variant) is compiled with the
pipeline, run through its runner's check() (fresh inputs, poisoned outputs, reference), and
the result printed; the exit code is non-zero if a check fails.
"""

from __future__ import annotations

import dataclasses
import sys
import time

import torch

from resgen.search import build
from resgen.search.attention_sm90 import Packing as AttnPacking
from resgen.search.attention_sm90 import Reduction as AttnReduction
from resgen.search.family import get_family
from resgen.search.linear_sm90_mma import Act, Pipeline
from resgen.search.quant_sm90 import QuantProblem
from resgen.search.variant import AttentionProblem, LinearProblem

ARCH = "sm_90a"


def main() -> int:
    lp = LinearProblem("nvfp4", "full", 3, 256, 1024)
    lin = get_family("linear_sm90_mma")
    fused = [v for v in lin.space(lp, ARCH) if v.act == Act.FUSED
             and lin.why_invalid(v, lp, ARCH) is None][:1]
    cases = [(lin, lin.default(lp, ARCH), lp), *[(lin, v, lp) for v in fused]]
    # the bulk ring (copy engine into shared memory, per-slot mbarriers), refilled: 4
    # iterations through 2 slots, behind the fused prologue, PDL
    bulk = dataclasses.replace(lin.default(lp, ARCH), warps_m=1, warps_k=1, n_tiles=1,
                               pipeline=Pipeline.BULK, stages=2, l2_prefetch=0, split_k=1,
                               act=Act.FUSED, pdl=True)
    assert lin.why_invalid(bulk, lp, ARCH) is None, lin.why_invalid(bulk, lp, ARCH)
    cases.append((lin, bulk, lp))
    # ragged K slices: 5 K groups over 4 warps (one long slice runs its guarded last
    # iteration), on the bulk ring behind the fused prologue and with direct loads (xop)
    rp = LinearProblem("nvfp4", "full", 3, 256, 1280)
    for rv in (dataclasses.replace(bulk, warps_k=4), dataclasses.replace(
            lin.default(rp, ARCH), warps_m=1, warps_k=4, pipeline=Pipeline.DIRECT, stages=1,
            l2_prefetch=1, split_k=1)):
        assert lin.why_invalid(rv, rp, ARCH) is None, lin.why_invalid(rv, rp, ARCH)
        cases.append((lin, rv, rp))
    qf = get_family("quant_sm90")
    qp = QuantProblem.for_linear(lp, kp_align=256)
    cases.append((qf, qf.default(qp, ARCH), qp))
    wg = get_family("linear_sm90_wgmma")
    wp = LinearProblem("nvfp4", "full", 40, 256, 1024)
    cases.append((wg, wg.default(wp, ARCH), wp))
    # split-K (workspace slots, semaphores, the last CTA's reads of every slice)
    wsplit = dataclasses.replace(wg.default(wp, ARCH), bn=32, stages=2, split_k=4)
    assert wg.why_invalid(wsplit, wp, ARCH) is None
    cases.append((wg, wsplit, wp))
    # PDL (weight copies issued before griddepcontrol.wait) with split-K 2
    wpdl = dataclasses.replace(wsplit, split_k=2, stages=4, pdl=True)
    assert wg.why_invalid(wpdl, wp, ARCH) is None
    cases.append((wg, wpdl, wp))
    af = get_family("attention_sm90")
    ap = AttentionProblem(batch=2, q_heads=8, kv_heads=2, head_dim=128, kv_len=300)
    cases.append((af, af.default(ap, ARCH), ap))
    # stack packing (two operand tiles into one accumulator), G = 8, last-CTA reduction
    ap8 = AttentionProblem(batch=2, q_heads=16, kv_heads=2, head_dim=128, kv_len=300)
    stack = dataclasses.replace(af.default(ap8, ARCH), packing=AttnPacking.STACK, splits=2,
                                reduction=AttnReduction.LASTCTA)
    assert af.why_invalid(stack, ap8, ARCH) is None
    cases.append((af, stack, ap8))
    # Q16 (the FP16 query stage, dense packing), G = 8, last-CTA reduction
    aq = AttentionProblem(batch=2, q_heads=16, kv_heads=2, head_dim=128, kv_len=300,
                          compensation=False, query="q16")
    q16 = dataclasses.replace(af.default(aq, ARCH), splits=2, reduction=AttnReduction.LASTCTA)
    assert af.why_invalid(q16, aq, ARCH) is None
    cases.append((af, q16, aq))
    failed = 0
    for fam, v, p in cases:
        t0 = time.time()
        out = build.compile_variant(fam, v, p, ARCH)
        if not out.ok:
            print(f"{fam.NAME} {v.name()}: COMPILE FAILED {out.error[:300]}")
            failed += 1
            continue
        res = fam.runner(out.compiled, v, p, "cuda", n_sets=1, seed=1).check()
        torch.cuda.synchronize()
        failed += not res.ok
        print(f"{fam.NAME:18s} {v.name()}: ok={res.ok} rel={res.rel_err:.2e} "
              f"{res.detail} ({time.time() - t0:.1f} s)", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
