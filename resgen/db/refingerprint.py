"""`resgen db refingerprint`: move a tuning table's rows to the fingerprints of a code change
that provably leaves their kernels unchanged, so the change does not need a re-tune.

    resgen db refingerprint --db tuned/h200.sqlite.xz --from GIT_REV [--out PATH]
        [--workers N] [--winners-only] [--family F] [--check-ptx auto|always|never]
        [--dry-run] [--repo PATH]

The old code is `git archive GIT_REV resgen` of the repository holding the running resgen
(or --repo), unpacked into a temporary directory; the new code is the running resgen's tree.
Each side runs in its own child processes (resgen/db/refingerprint_child.py), so the two
packages never share an interpreter. For every stored row (or every workload's winner, the
rows `resgen db export --winners` keeps) whose checksum holds, each side parses the row's
workload and variant through its own typed space (digests matched: nothing read from the
file is trusted), renders it and fingerprints it with its own definition. Then:

- old fingerprint != stored: the row was already stale before the change: left alone;
- new fingerprint == stored: nothing to do (nothing changed for it, or it was re-tuned with
  the new code already; counted with tier 1 as "fingerprint unchanged");
- tier 1, no compile: the new rendered source is byte-identical to the old one, and the
  transitive resgen.kernels module digest, the compile options and the family's compile key
  (what the compile arguments are made from) are unchanged: the only fingerprint input that
  moved is a template byte this render does not use, so the kernel is the same by
  construction;
- tier 2 (`--check-ptx`, default auto: only rows tier 1 cannot decide; always: every row;
  never: none): both renders compiled for the row's arch on the CPU, each with its own
  code's compile hook and arguments, once per side and compile class; identical when the
  normalised PTX (refingerprint_child.normalise_ptx: comments, debug line directives and
  kernel symbol names removed, nothing else) AND the normalised host IR (grid, cluster,
  shared memory, launch attributes; the device binary elided) are equal. Changed compile
  options are never identical here (they reach ptxas, after the PTX);
- everything else (a kernel that really changed, a render or compile that fails, a row the
  new code does not parse) is left untouched and listed.

Identical rows get the new fingerprint and the row checksum over it (resgen.db.store
row_checksum), in one transaction through TuningDB.set_fingerprints: an interrupt leaves the
file as it was. A row whose new (workload, variant, fingerprint, environment) already exists
(re-tuned meanwhile) keeps its old fingerprint and is counted. `--out` writes a copy (xz when
its name ends in .xz, as `resgen db export` does) and leaves --db alone; in place (the
default), the table is rewritten through a temporary file renamed over the original. The rows
are read from a snapshot taken at the start and the written table is that snapshot updated, so
a --db file replaced during the run is never mixed in; in place, such a change refuses the
write (nothing written). The written table must pass `resgen db verify`.

Not covered, as in the fingerprint itself: host code outside the rendered module (a family's
`bind` / runner in resgen/search). Renamed families or changed variant fields change the
stored keys, which this tool does not rewrite.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from . import refingerprint_child as child
from .errors import DatabaseError
from .store import TuningDB, row_checksum

__all__ = ["RefingerprintError", "Summary", "materialise", "refingerprint", "package_root"]

_CHILD = Path(child.__file__).resolve()
# `python -I -c _BOOT ROOT MODE WORKDIR CHILD`: ROOT's resgen first on the path (-I: no
# PYTHONPATH, no user site, no current directory), then the child's main.
_BOOT = ("import runpy, sys; sys.path.insert(0, sys.argv[1]); g = runpy.run_path(sys.argv[4]); "
         "raise SystemExit(g['main'](*sys.argv[1:4]))")


class RefingerprintError(Exception):
    """A problem with the inputs (not a git checkout, unknown revision, missing database):
    the CLI prints it as one line."""


@dataclass
class Summary:
    """What a run found; `rows` lists every row left alone with why (id -> reason)."""

    rows: int = 0
    tier1: int = 0
    unchanged: int = 0              # of tier1: the fingerprint did not move at all
    tier2: int = 0
    differing: int = 0
    stale: int = 0
    unparseable: int = 0
    damaged: int = 0
    already_present: int = 0
    written: int = 0
    jobs: int = 0                   # distinct (family, workload, variant, arch) per side
    compile_classes: int = 0        # tier 2: distinct renders compiled (per side)
    compiles: int = 0
    seconds: float = 0.0
    phase_s: dict[str, float] = field(default_factory=dict)
    left: dict[int, str] = field(default_factory=dict)
    tier2_raw_equal: int = 0         # of tier2: raw PTX and host IR already equal
    verify_ok: bool | None = None    # `resgen db verify` of the written table (None: none)

    def as_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in vars(self).items() if k != "left"}
        d["left_alone"] = len(self.left)
        return d

    def lines(self, limit: int = 20) -> list[str]:
        """The report the CLI prints: counts, then up to `limit` rows left alone."""
        ident = self.tier1 + self.tier2
        pct = 100.0 * ident / self.rows if self.rows else 0.0
        out = [f"rows {self.rows}: identical {ident} ({pct:.1f} %): tier 1 {self.tier1} "
               f"(fingerprint unchanged {self.unchanged}), tier 2 {self.tier2} "
               f"(raw PTX and host IR equal {self.tier2_raw_equal}); differing "
               f"{self.differing}, stale before the change {self.stale}, unparseable "
               f"{self.unparseable}, damaged {self.damaged}; already present with the new "
               f"fingerprint {self.already_present}; written {self.written}",
               f"jobs per side {self.jobs}, compiles {self.compiles}, {self.seconds:.1f} s (" +
               ", ".join(f"{k} {v:.1f} s" for k, v in self.phase_s.items()) + ")"]
        kinds = Counter(why.split(":")[0] for why in self.left.values())
        if kinds:
            out.append("left alone: " + ", ".join(f"{n} x {k}" for k, n in kinds.most_common()))
        for rid, why in list(self.left.items())[:limit]:
            out.append(f"  result {rid}: {why}")
        if len(self.left) > limit:
            out.append(f"  ... {len(self.left) - limit} more rows left alone")
        return out


def package_root() -> Path:
    """The directory holding the running resgen package (the new side)."""
    import resgen

    return Path(resgen.__file__).resolve().parent.parent


def _git(repo: Path, *args: str, binary: bool = False) -> Any:
    try:
        return subprocess.run(["git", "-C", str(repo), *args], capture_output=True,
                              check=False, text=not binary)
    except FileNotFoundError:
        raise RefingerprintError("git is not installed") from None


def materialise(repo: Path, rev: str, dest: Path) -> Path:
    """`git archive REV resgen` of `repo` unpacked under `dest`; returns dest (the old
    side's root, holding dest/resgen)."""
    top = _git(repo, "rev-parse", "--show-toplevel")
    if top.returncode != 0:
        raise RefingerprintError(f"{repo} is not a git checkout (needed to materialise "
                                 f"--from {rev}; --repo names the repository)")
    got = _git(repo, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}")
    if got.returncode != 0:
        raise RefingerprintError(f"unknown git revision {rev!r} in {top.stdout.strip()}")
    commit = got.stdout.strip()
    arch = _git(Path(top.stdout.strip()), "archive", "--format=tar", commit, "resgen",
                binary=True)
    if arch.returncode != 0:
        msg = arch.stderr.decode(errors="replace").strip().splitlines()
        raise RefingerprintError(f"git archive {rev} resgen failed: "
                                 f"{msg[-1] if msg else 'no message'}")
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(arch.stdout)) as tar:
        tar.extractall(dest, filter="data")
    if not (dest / "resgen" / "__init__.py").is_file():
        raise RefingerprintError(f"revision {rev} has no resgen package")
    return dest


def _run_side(root: Path, mode: str, jobs: list[dict[str, Any]], work: Path, cache: Path,
              workers: int) -> list[dict[str, Any]]:
    """Run `jobs` with the resgen under `root` in up to `workers` child processes (contiguous
    chunks, so renders that share a compile class stay in one child's memo)."""
    if not jobs:
        return []
    n = max(1, min(workers, len(jobs)))
    size = -(-len(jobs) // n)
    chunks = [jobs[i:i + size] for i in range(0, len(jobs), size)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["RESGEN_CACHE_DIR"] = str(cache)            # each side renders into its own cache
    env["CUTE_DSL_DISABLE_FILE_CACHING"] = "1"      # every compile is this side's own

    def one(i: int) -> list[dict[str, Any]]:
        d = work / f"{mode}{i}"
        d.mkdir(parents=True, exist_ok=True)
        (d / "jobs.json").write_text(json.dumps(chunks[i]))
        p = subprocess.run([sys.executable, "-I", "-c", _BOOT, str(root), mode, str(d),
                            str(_CHILD)], capture_output=True, text=True, env=env,
                           cwd=str(work), check=False)
        res = d / "results.json"
        if p.returncode != 0 or not res.is_file():
            tail = (p.stderr or p.stdout or "").strip().splitlines()
            raise RefingerprintError(f"the {mode} worker for {root} failed (exit "
                                     f"{p.returncode}): {tail[-1] if tail else 'no output'}")
        got = json.loads(res.read_text())
        for j, r in enumerate(got):
            if "ptx" in r:
                r["ptx_file"] = str(d / f"{j}.ptx")
        return got

    with ThreadPoolExecutor(len(chunks)) as pool:
        parts = list(pool.map(one, range(len(chunks))))
    return [r for part in parts for r in part]


def _job(row: Mapping[str, Any]) -> dict[str, Any]:
    return {k: row[k] for k in ("family", "workload_key", "variant_key", "workload_digest",
                                "variant_digest", "arch")}


def _first_difference(a: str, b: str) -> str:
    """The first line where two normalised PTX files differ (for the report)."""
    try:
        la, lb = Path(a).read_text().splitlines(), Path(b).read_text().splitlines()
    except OSError:
        return ""
    for i, (x, y) in enumerate(zip(la, lb)):
        if x != y:
            return f"PTX line {i + 1}: {x.strip()[:60]!r} -> {y.strip()[:60]!r}"
    return f"PTX lengths {len(la)} -> {len(lb)} lines" if len(la) != len(lb) else "host IR"


def _intact(row: Mapping[str, Any]) -> bool:
    try:
        return row_checksum(row, row["environment_digest"], row["workload_digest"],
                            row["variant_digest"]) == row["checksum"]
    except (TypeError, ValueError):
        return False


def _classes(rows: Iterable[Mapping[str, Any]]) -> tuple[list[dict[str, Any]], list[int]]:
    """The distinct jobs of `rows` and, per row, the index of its job."""
    index: dict[str, int] = {}
    jobs: list[dict[str, Any]] = []
    which = []
    for r in rows:
        j = _job(r)
        k = json.dumps(j, sort_keys=True)
        if k not in index:
            index[k] = len(jobs)
            jobs.append(j)
        which.append(index[k])
    return jobs, which


def refingerprint(db_path: str | os.PathLike, from_rev: str, *, out: str | os.PathLike | None
                  = None, workers: int = 1, winners_only: bool = False,
                  check_ptx: str = "auto", dry_run: bool = False,
                  repo: str | os.PathLike | None = None,
                  new_root: str | os.PathLike | None = None,
                  families: Sequence[str] | None = None) -> Summary:
    """Migrate the fingerprints of `db_path` from the code at `from_rev` to the code at
    `new_root` (default: the running resgen; `repo` is the git repository `from_rev` names,
    default new_root's); `workers` child processes per side (both sides run at once, so
    2 x workers in all); `families`: only rows of these families (a staged migration).
    See the module docstring; returns the Summary (nothing is written with dry_run)."""
    if check_ptx not in ("auto", "always", "never"):
        raise RefingerprintError(f"--check-ptx must be auto, always or never, not "
                                 f"{check_ptx!r}")
    t0 = time.perf_counter()
    src = Path(db_path)
    if not src.exists():
        raise RefingerprintError(f"{src}: no such tuning database")
    new = Path(new_root).resolve() if new_root is not None else package_root()
    repo = Path(repo) if repo is not None else new
    summary = Summary()
    with tempfile.TemporaryDirectory(prefix="resgen_refp_") as tmp_s:
        tmp = Path(tmp_s)
        old = materialise(repo, from_rev, tmp / "old")
        t = time.perf_counter()
        # The rows are read from a snapshot, and the write edits that snapshot: a file
        # replaced while the (long) compile phase runs is never mixed with the rows read
        # before; in place, a changed file is refused at the write (_write).
        snap, src_digest = tmp / "source.sqlite", _file_digest(src)
        try:
            with TuningDB(src, readonly=True) as db:
                db.export_sqlite(snap)
            with TuningDB(snap, readonly=True) as db:
                rows = db.rows()
                keep = db.winner_ids() if winners_only else None
        except DatabaseError as e:
            raise RefingerprintError(str(e)) from None
        summary.phase_s["read"] = time.perf_counter() - t
        todo = []
        for r in rows:
            if keep is not None and int(r["id"]) not in keep:
                continue
            if families is not None and r["family"] not in families:
                continue
            summary.rows += 1
            if not _intact(r):
                summary.damaged += 1
                summary.left[int(r["id"])] = "checksum mismatch (row altered or torn)"
                continue
            todo.append(r)
        jobs, which = _classes(todo)
        summary.jobs = len(jobs)
        t = time.perf_counter()
        with ThreadPoolExecutor(2) as pool:
            f_old = pool.submit(_run_side, old, "render", jobs, tmp / "w_old", tmp / "c_old",
                                workers)
            f_new = pool.submit(_run_side, new, "render", jobs, tmp / "w_new", tmp / "c_new",
                                workers)
            r_old, r_new = f_old.result(), f_new.result()
        summary.phase_s["render"] = time.perf_counter() - t
        verdict: dict[int, str] = {}        # job index -> "tier1" | "unchanged" | "compile"
        reason: dict[int, str] = {}
        for i, (o, n) in enumerate(zip(r_old, r_new)):
            if "error" in o:
                reason[i] = f"old code: {o['error']}"
            elif "error" in n:
                reason[i] = f"new code: {n['error']}"
            elif n["fingerprint"] == o["fingerprint"]:
                verdict[i] = "unchanged"
            elif n["options"] != o["options"]:
                reason[i] = "compile options changed"
            elif (n["source"] == o["source"] and n["kernel_modules"] == o["kernel_modules"]
                  and o["kernel_modules"] is not None
                  and n["compile_key"] == o["compile_key"]):
                verdict[i] = "tier1"
            else:
                verdict[i] = "compile"
            if check_ptx == "always" and verdict.get(i) == "tier1":
                verdict[i] = "compile:tier1"
        # stale rows are not compiled: their old fingerprint is not the stored one
        need = sorted({which[k] for k, r in enumerate(todo)
                       if verdict.get(which[k], "").startswith("compile")
                       and "error" not in r_old[which[k]]
                       and r_old[which[k]]["fingerprint"] == r["fingerprint"]})
        if check_ptx == "never":
            need = []
        # one compile per side and compile class (family, variant, compile key, arch: the
        # render depends on nothing else), shared by every job of that class
        classes: dict[tuple, list[int]] = {}
        for i in need:
            j = jobs[i]
            key = (j["family"], j["variant_key"], r_old[i]["compile_key"],
                   r_new[i]["compile_key"], j["arch"])
            classes.setdefault(key, []).append(i)
        t = time.perf_counter()
        ptx_ok: dict[int, bool] = {}
        if classes:
            members = list(classes.values())
            cjobs = [jobs[m[0]] for m in members]
            with ThreadPoolExecutor(2) as pool:
                f_old = pool.submit(_run_side, old, "compile", cjobs, tmp / "w_old",
                                    tmp / "c_old", workers)
                f_new = pool.submit(_run_side, new, "compile", cjobs, tmp / "w_new",
                                    tmp / "c_new", workers)
                c_old, c_new = f_old.result(), f_new.result()
            summary.compiles = 2 * len(cjobs)
            summary.compile_classes = len(cjobs)
            for group, o, n in zip(members, c_old, c_new):
                if "error" in o or "error" in n:
                    why = f"compile failed: {(o.get('error') or n.get('error'))}"
                    same = False
                else:
                    same = o["ptx"] == n["ptx"] and o["host"] == n["host"]
                    why = ("raw" if o["ptx_raw"] == n["ptx_raw"] and
                           o["host_raw"] == n["host_raw"] else "") if same else \
                        "kernel differs: " + _first_difference(o["ptx_file"], n["ptx_file"])
                for i in group:
                    ptx_ok[i] = same
                    if why:
                        reason[i] = why
        summary.phase_s["compile"] = time.perf_counter() - t
        updates: list[tuple[int, str]] = []
        for k, r in enumerate(todo):
            i, rid = which[k], int(r["id"])
            o, n = r_old[i], r_new[i]
            if "error" not in n and n["fingerprint"] == r["fingerprint"]:
                summary.tier1 += 1          # already the new code's (or nothing moved)
                summary.unchanged += 1
                continue
            if "error" in o or "error" in n:
                summary.unparseable += 1
                summary.left[rid] = reason[i]
                continue
            if o["fingerprint"] != r["fingerprint"]:
                summary.stale += 1
                summary.left[rid] = "stale before the change (the old code's fingerprint is " \
                                    "not the stored one)"
                continue
            v = verdict.get(i)
            if v is None:
                summary.differing += 1
                summary.left[rid] = reason[i]
                continue
            if v.startswith("compile") and not ptx_ok.get(i, False):
                summary.differing += 1
                summary.left[rid] = reason.get(i, "not compiled (--check-ptx never)")
                continue
            if v in ("tier1", "compile:tier1"):
                summary.tier1 += 1
            else:
                summary.tier2 += 1
                summary.tier2_raw_equal += reason.get(i) == "raw"
            updates.append((rid, n["fingerprint"]))
        t = time.perf_counter()
        if not dry_run and (updates or out is not None):
            summary.written, summary.already_present = _write(snap, src, src_digest, out,
                                                              updates)
            with TuningDB(Path(out) if out is not None else src, readonly=True) as db:
                rep = db.verify()
            summary.verify_ok = rep.ok
            if not rep.ok:
                raise RefingerprintError(f"the written table fails `resgen db verify`: "
                                         f"{rep.errors[0]}")
        summary.phase_s["write"] = time.perf_counter() - t
    summary.seconds = time.perf_counter() - t0
    return summary


def _file_digest(path: Path) -> str:
    """sha256 of a file's bytes (is it still the file the rows were read from?)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _write(snap: Path, src: Path, src_digest: str, out: str | os.PathLike | None,
           updates: Sequence[tuple[int, str]]) -> tuple[int, int]:
    """Apply `updates` (result id, new fingerprint) to the snapshot `snap` of `src` read at
    the start, then write it to `out` (a new file) or over `src` (in place: only if src is
    still the file the snapshot came from, else nothing is written). Returns (rows
    written, rows whose new key already existed)."""
    dest = Path(out) if out is not None else src
    if out is not None and dest.exists():
        raise RefingerprintError(f"{dest} exists; remove it first")
    if out is None and _file_digest(src) != src_digest:
        raise RefingerprintError(f"{src} changed while the refingerprint ran: nothing "
                                 "written (run it again, or give --out)")
    try:
        with TuningDB(snap, create=False) as db:
            counts = db.set_fingerprints(updates)
            final = dest.with_name(f".{dest.name}.{os.getpid()}.tmp{''.join(dest.suffixes)}")
            final.unlink(missing_ok=True)
            db.export_sqlite(final)
            os.replace(final, dest)        # atomic: an interrupt leaves the old file
    except DatabaseError as e:
        raise RefingerprintError(str(e)) from None
    return counts["written"], counts["already_present"]

