"""Re-label a tuning table's fingerprints after the fingerprint DEFINITION changed (not the code).

    PYTHONPATH=. python scripts/refingerprint_table.py tuned/h200.sqlite.xz KERNEL_CODE_COMMIT

Used once, on 2026-11-30, when fingerprints started to cover the resgen.kernels modules a kernel
imports (resgen.kernels.codegen.kernel_modules_digest). For every row it first recomputes the
fingerprint under the OLD definition (rendered source, template files, options, arch,
versions) and refuses unless it equals the stored one (so the row was tuned with today's
templates), and refuses unless `git diff KERNEL_CODE_COMMIT -- resgen/kernels resgen/templates`
(codegen.py, the definition, excepted) is empty (so the kernel modules are the ones that were
measured). Only then is the fingerprint
rewritten under the new definition and the row checksum recomputed; timings are untouched.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import shutil
import sqlite3
import subprocess
import sys
import tempfile
from pathlib import Path

from resgen import __version__
from resgen.db.store import TuningDB, row_checksum
from resgen.kernels import codegen
from resgen.search import build
from resgen.search.family import get_family

ARCH = "sm_90a"


def old_fingerprint(source: str, template: str, options: str, arch: str, tdir) -> str:
    h = hashlib.sha256()
    for part in (source, codegen.template_digest(template, tdir), options, arch, __version__,
                 codegen.cute_dsl_version()):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def main(table: str, commit: str) -> int:
    # codegen.py holds the fingerprint definition itself (host code, imported by no kernel)
    diff = subprocess.run(["git", "diff", "--stat", commit, "--", "resgen/kernels",
                           "resgen/templates", ":!resgen/kernels/codegen.py"],
                          capture_output=True, text=True, check=True)
    if diff.stdout.strip():
        print(f"kernel code changed since {commit}:\n{diff.stdout}\nre-tune instead")
        return 1
    path = Path(table)
    work = Path(tempfile.mkdtemp()) / "t.sqlite"
    with lzma.open(path) if path.suffix == ".xz" else open(path, "rb") as f, open(work, "wb") as o:
        shutil.copyfileobj(f, o)
    con = sqlite3.connect(work)
    con.row_factory = sqlite3.Row
    rows = con.execute(
        "select r.*, v.family as fam, v.key as vkey, v.digest as vdig, w.key as wkey, "
        "w.digest as wdig, e.digest as edig from results r join variants v on v.id = "
        "r.variant_id join workloads w on w.id = r.workload_id join environments e on "
        "e.id = r.environment_id").fetchall()
    cache: dict[tuple, tuple[str, str]] = {}
    updates = []
    for r in rows:
        fam = get_family(r["fam"])
        v = fam.VARIANT.from_key(r["vkey"])
        p = fam.PROBLEM.from_key(r["wkey"])
        ck = fam.compile_key(v, p)
        key = (fam.NAME, v.key(), ck.key())
        if key not in cache:
            tdir = build._template_dir(fam)
            src = codegen.render(fam.TEMPLATE, fam.template_params(v, ck), tdir)
            opts = build.compile_options(fam)
            cache[key] = (old_fingerprint(src, fam.TEMPLATE, opts, ARCH, tdir),
                          codegen.fingerprint(src, fam.TEMPLATE, opts, ARCH, tdir))
        old, new = cache[key]
        if r["fingerprint"] != old:
            print(f"result {r['id']}: stored fingerprint is not today's templates'; re-tune")
            return 1
        row = dict(r)
        row["fingerprint"] = new
        updates.append((new, row_checksum(row, r["edig"], r["wdig"], r["vdig"]), r["id"]))
    with con:
        con.executemany("update results set fingerprint = ?, checksum = ? where id = ?", updates)
    con.close()
    with TuningDB(work, readonly=True) as db:
        rep = db.verify()
    print(json.dumps({"rows": len(updates), "compile_identities": len(cache), "verify_ok": rep.ok,
                      "errors": rep.errors[:5]}))
    if not rep.ok:
        return 1
    out = work.with_name("export" + "".join(path.suffixes))
    subprocess.run([sys.executable, "-m", "resgen", "db", "export", str(work), "--out",
                    str(out)], check=True)
    path.unlink(missing_ok=True)
    shutil.move(str(out), str(path))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
