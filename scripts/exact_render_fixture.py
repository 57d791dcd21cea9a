"""Write the render-identity fixture of linear_sm90_mma's exact-fold variants.

    PYTHONPATH=/path/to/main/checkout python scripts/exact_render_fixture.py \
        tests/fixtures/linear_sm90_mma_renders.json.xz [COMMIT] [--pairs-from OLD.json.xz]

(resgen is imported from PYTHONPATH, the table read from this checkout's tuned/.)

Run on the commit whose renders must be preserved (it was run on main 48c1103, before the
"presum" fold was added to the family). For every (variant, compile key) pair it records the
first 12 hex digits of the sha256 of the rendered kernel source, for the winner of every
linear_sm90_mma workload of the shipped table (tuned/h200.sqlite.xz; 719 distinct renders over
both formats, every compensation, fused and xop), stored as canonical keys. The test
(tests/test_linear_sm90_mma_presum.py) renders each with the checkout under test: one changed
byte fails, as does a change to a resgen.kernels module the renders import (digest stored).

--pairs-from re-pins the same (variant, compile key) pairs as an earlier fixture with this
checkout's renders: after a change whose kernels were proven unchanged (every shipped row
PTX- and host-IR-equal, `resgen db refingerprint --check-ptx auto`), so the fixture keeps
guarding the same kernels. Re-pinned at 1213aef (issue 18: module renames, one epilogue, the
substitute-only template; 48c1103's pairs) and at 67ed6c9 (linear_sm90_mma_presum reads the
presum rows: renders unchanged, the module digest moved; 454 table rows PTX-equal).
"""
from __future__ import annotations

import hashlib
import json
import lzma
import subprocess
import sys
from pathlib import Path

from resgen.db import TuningDB
from resgen.kernels import codegen
from resgen.runtime import shipped_table
from resgen.search.family import get_family
from resgen.search.record import Status

ARCH = "sm_90a"
ROOT = Path(__file__).resolve().parent.parent


def render_sha(fam, v, p) -> str:
    """sha256 of the source the family renders for variant v on problem p (compile key)."""
    ck = fam.compile_key(v, p)
    src = codegen.render(fam.TEMPLATE, fam.template_params(v, ck))
    return hashlib.sha256(src.encode()).hexdigest()


def pairs() -> list[tuple[str, str]]:
    """(variant key, problem key) pairs of the table's winners (the fixture must stay small:
    tests/test_repo_footprint.py)."""
    fam = get_family("linear_sm90_mma")
    out: dict[tuple[str, str], None] = {}
    with TuningDB(shipped_table(ROOT / "tuned", "h200"), readonly=True) as db:
        rows = [r for r in db.rows(status=Status.OK, compile_only=False)
                if r["family"] == fam.NAME]
    best: dict[str, dict] = {}
    for r in rows:
        w = r["workload_key"]
        if w not in best or r["median_us"] < best[w]["median_us"]:
            best[w] = r
    for w in sorted(best):
        r = best[w]
        v = fam.VARIANT.from_key(r["variant_key"])
        p = fam.PROBLEM.from_key(w)
        out[(v.key(), fam.compile_key(v, p).key())] = None
    return list(out)


def pairs_from(fixture: str) -> list[tuple[str, str]]:
    """The (variant key, compile key) pairs an earlier fixture pinned."""
    doc = json.loads(lzma.decompress(Path(fixture).read_bytes()))
    return [(vk, pk) for vk, pk, _ in doc["renders"]]


def main(argv: list[str]) -> int:
    old = None
    if "--pairs-from" in argv:
        i = argv.index("--pairs-from")
        if i + 1 >= len(argv):
            print("--pairs-from needs a fixture path", file=sys.stderr)
            return 2
        old = argv[i + 1]
        argv = argv[:i] + argv[i + 2:]
    if len(argv) not in (2, 3):
        print("usage: python scripts/exact_render_fixture.py OUT.json.xz [COMMIT] "
              "[--pairs-from OLD.json.xz]\n"
              "(COMMIT: the label to record where resgen is not a git checkout, e.g. a "
              "`git archive` of that commit)", file=sys.stderr)
        return 2
    fam = get_family("linear_sm90_mma")
    entries = []
    for vk, pk in (pairs_from(old) if old else pairs()):
        v, p = fam.VARIANT.from_key(vk), fam.PROBLEM.from_key(pk)
        entries.append([vk, pk, render_sha(fam, v, p)[:12]])
    import resgen

    src_root = Path(resgen.__file__).resolve().parent.parent       # where resgen came from
    commit = argv[2] if len(argv) == 3 else subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=src_root, capture_output=True,
        text=True).stdout.strip()
    v0, p0 = fam.VARIANT.from_key(entries[0][0]), fam.PROBLEM.from_key(entries[0][1])
    src0 = codegen.render(fam.TEMPLATE, fam.template_params(v0, fam.compile_key(v0, p0)))
    # the resgen.kernels modules an exact render imports (transitively), hashed: they must not
    # change either (every exact render imports the same ones)
    doc = {"family": fam.NAME, "commit": commit, "arch": ARCH,
           "kernel_modules_digest": codegen.kernel_modules_digest(src0), "renders": entries}
    Path(argv[1]).write_bytes(lzma.compress(json.dumps(doc, separators=(",", ":")).encode()))
    print(f"{len(entries)} renders from {commit} -> {argv[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
