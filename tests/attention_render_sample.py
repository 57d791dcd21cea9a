"""The render sample of tests/test_attention_q16.py's identity check (importable by a plain
python on any resgen checkout: it uses only APIs that main at e045ab3 has).

    python tests/attention_render_sample.py > tests/fixtures/attention_sm90_render.json

writes {sha256-16 of (compile workload key, variant key with splits 1): sha256-16 of the rendered
kernel source} (splits is a run-time argument, never rendered) for every variant of the
attention_sm90 space of a sample of plain / ResAttn workloads (every packing, warp count,
chunk, reduction, prefetch, head dim, PV mode), and under "kernel_modules" the digest of the
resgen.kernels modules they import: what a change must leave byte-identical unless a
refingerprint proves the new renders' kernels equal (tests/test_attention_q16.py).
"""

from __future__ import annotations

import hashlib
import json
import sys


def problems() -> list:
    from resgen.search.variant import AttentionProblem

    out = []
    for hq, hkv, d, page in ((32, 8, 128, 32), (64, 8, 128, 32), (8, 2, 64, 16),
                             (16, 2, 256, 64), (12, 2, 128, 32), (2, 2, 128, 32)):
        for comp in (True, False):
            for pv in ("f16", "fp8"):
                for b, n in ((1, 8192), (8, 32768), (64, 1000)):
                    out.append(AttentionProblem(batch=b, q_heads=hq, kv_heads=hkv, head_dim=d,
                                                kv_len=n, page_size=page, compensation=comp,
                                                pv=pv))
    return out


def _sha16(s: str) -> str:
    return hashlib.sha256(s.encode()).hexdigest()[:16]


def render_digests() -> dict[str, str]:
    from dataclasses import replace

    from resgen.kernels import codegen
    from resgen.search.attention_sm90 import FAMILY

    out: dict[str, str] = {}
    mods = set()
    for p in problems():
        for v in FAMILY.space(p, "sm_90a"):
            ck = FAMILY.compile_key(v, p)
            src = codegen.render(FAMILY.TEMPLATE, FAMILY.template_params(v, ck))
            what = f"{ck.key()}|{replace(v, splits=1).key()}"
            out[_sha16(what)] = _sha16(src)
            mods.add(codegen.kernel_modules_digest(src)[:16])
    # the resgen.kernels modules those renders import (transitively): part of every fingerprint
    out["kernel_modules"] = ",".join(sorted(mods))
    return out


if __name__ == "__main__":
    json.dump(render_digests(), sys.stdout, indent=0, sort_keys=True)
    sys.stdout.write("\n")
