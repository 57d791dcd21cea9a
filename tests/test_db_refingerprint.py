"""`resgen db refingerprint`: rows move to the new code's fingerprints only where the kernel is
provably the same (tier 1: same render and kernel modules; tier 2: same normalised PTX and
host IR from CPU compiles); stale, differing and hostile rows are left alone and listed.

The "old" code is a temporary git repository holding a copy of this checkout's resgen with
one edit undone (so the edit is what the new code, this checkout, gained); the stored
fingerprints are what that old code's own resgen.search.build.variant_fingerprint gives,
computed in a child process that imports only the old package.
"""

from __future__ import annotations

import json
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

import resgen
from resgen import cli
from resgen.db import DatabaseError, TuningDB, row_checksum
from resgen.db import refingerprint as rf
from resgen.db.refingerprint_child import kernel_symbols, normalise_host_ir, normalise_ptx
from resgen.runtime import Device, Dispatcher
from resgen.search.build import variant_fingerprint
from resgen.search.family import get_family
from resgen.search.record import Environment, ResultRecord, Status
from resgen.search.variant import sha256_json

ROOT = Path(resgen.__file__).resolve().parent.parent
H200 = Device("NVIDIA H200", "sm_90a")
ENV = Environment(gpu_name="NVIDIA H200", arch="sm_90a", compute_capability="9.0", sm_count=132,
                  driver="d", cuda="c", torch="t", cute_dsl="q", resgen="r", compile_only=False)
ATTN = get_family("attention_sm90")
QUANT = get_family("quant_sm90")
QP = ('{"compensation":"%s","fmt":"nvfp4","k":2560,"kp_align":64,"layout":"%s","m":1,'
      '"op":"quantize","outputs":"xop","static_scale":true}')
QV = ('{"alpha":"static","ept":8,"family":"quant_sm90","layout":"%s","outputs":"xop",'
      '"persist":false,"unroll":1,"warps":4}')
LINEAR_KEY = ('{"act":"xop","cluster":1,"family":"linear_sm90_mma","groups":1,"l2_prefetch":0,'
              '"m_tiles":1,"n_tiles":1,"packing":"split","pdl":false,"pipeline":"cp_async",'
              '"reduce":"none","split_k":1,"stages":3,"warps_k":2,"warps_m":1}')
ATTN_TEMPLATE = "resgen/templates/attention_sm90.py.j2"
# The old code's template had a comment that only reduction "workspace" rendered (the
# substitute-only template has no such choice any more): the new code dropped it, so renders
# with reduction "none" are the same in both and the workspace ones differ.
ATTN_ANCHOR = "THREADS = CFG.threads\n"
ATTN_OLD = ("THREADS = CFG.threads{{ '  # + reduce_kernel' if reduction == 'workspace' "
            "else '' }}\n")     # an expression: trim_blocks would eat a block tag's newline


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    from resgen.settings import settings

    monkeypatch.setenv("RESGEN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("RESGEN_DB", raising=False)
    settings.cache_clear()
    yield
    settings.cache_clear()


def old_repo(tmp_path: Path, edits: dict[str, list[tuple[str, str]]]) -> Path:
    """A git repository whose one commit is this checkout's resgen with `edits` applied
    ({path: [(text now, text then)]}, each text present exactly once)."""
    repo = tmp_path / "old_repo"
    shutil.copytree(ROOT / "resgen", repo / "resgen",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for rel, subs in edits.items():
        f = repo / rel
        text = f.read_text()
        for now, then in subs:
            assert text.count(now) == 1, (rel, now)
            text = text.replace(now, then)
        f.write_text(text)
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "old"], check=True)
    return repo


def old_fingerprints(root: Path, items: list[tuple[str, str, str]]) -> list[str]:
    """variant_fingerprint of (family, workload key, variant key) under the resgen at root."""
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); import resgen; "
            "assert resgen.__file__.startswith(sys.argv[1]), resgen.__file__; "
            "from resgen.search.family import get_family; "
            "from resgen.search.build import variant_fingerprint as vf; "
            "print(json.dumps([vf(get_family(f), get_family(f).VARIANT.from_key(v), "
            "get_family(f).PROBLEM.from_key(w), 'sm_90a') for f, w, v in "
            "json.loads(sys.argv[2])]))")
    out = subprocess.run([sys.executable, "-I", "-c", code, str(root), json.dumps(items)],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def store(path: Path, fam, problem, variant, fp: str, median: float = 5.0) -> int:
    with TuningDB(path) as db:
        db.record(ResultRecord(problem=problem, variant=variant, environment=ENV,
                               fingerprint=fp, status=Status.OK, median_us=median,
                               samples_us=[median], space_index=0,
                               policy={"tie_rel": 0.01, "name": "t", "version": 2}))
        return max(r["id"] for r in db.rows())


def hostile(path: Path, family: str, vkey: str) -> int:
    """A result whose variant row says `family` with key `vkey`, digests and checksum
    consistent (so only parsing can refuse it)."""
    con = sqlite3.connect(path)
    try:
        digest = sha256_json(json.loads(vkey))
        con.execute("INSERT INTO variants (digest, family, key, name) VALUES (?, ?, ?, ?)",
                    (digest, family, vkey, "hostile"))
        vid = con.execute("SELECT id FROM variants WHERE digest = ?", (digest,)).fetchone()[0]
        cur = con.execute("SELECT * FROM results LIMIT 1")
        base = dict(zip([d[0] for d in cur.description], cur.fetchone()))
        ed, wd = con.execute(
            "SELECT e.digest, w.digest FROM environments e, workloads w WHERE e.id = ? AND "
            "w.id = ?", (base["environment_id"], base["workload_id"])).fetchone()
        row = {k: base[k] for k in base if k not in ("id", "variant_id", "checksum")}
        row["checksum"] = row_checksum(row, ed, wd, digest)
        cols = ["variant_id", *row]
        con.execute(f"INSERT INTO results ({', '.join(cols)}) VALUES "
                    f"({', '.join('?' * len(cols))})", [vid, *row.values()])
        con.commit()
        return int(con.execute("SELECT max(id) FROM results").fetchone()[0])
    finally:
        con.close()


def attention_rows(tmp_path: Path, db: Path) -> tuple[Path, object, dict[str, int]]:
    """The attention template lost a comment that reduction "none" renders did not use (the
    old code's block above): one row per reduction, fingerprinted by the old code; returns
    (repo, problem, ids)."""
    repo = old_repo(tmp_path, {ATTN_TEMPLATE: [(ATTN_ANCHOR, ATTN_OLD)]})
    p = ATTN.PROBLEM.from_key('{"batch":1,"compensation":true,"head_dim":128,"kv_heads":8,'
                              '"kv_len":8192,"op":"decode_attention","page_size":32,'
                              '"pv":"f16","q_heads":32}')
    space = ATTN.space(p, "sm_90a")
    picks = {red: next(v for v in space if v.reduction == red) for red in ("none", "workspace")}
    fps = old_fingerprints(repo, [(ATTN.NAME, p.key(), v.key()) for v in picks.values()])
    ids = {red: store(db, ATTN, p, v, fp) for (red, v), fp in zip(picks.items(), fps)}
    return repo, p, ids


def fingerprints(db: Path) -> dict[int, str]:
    with TuningDB(db, readonly=True) as t:
        return {int(r["id"]): r["fingerprint"] for r in t.rows()}


def test_tier1_migrates_an_unused_template_line_and_the_runtime_serves_it_again(tmp_path):
    db = tmp_path / "t.sqlite"
    repo, p, ids = attention_rows(tmp_path, db)
    # one more row, tuned with neither code (stale before the change), and hostile ones
    nones = [v for v in ATTN.space(p, "sm_90a") if v.reduction == "none"]
    ids["stale"] = store(db, ATTN, p, nones[1], "0" * 64, median=1.0)
    ids["current"] = store(db, ATTN, p, nones[2],      # tuned with the new code already
                           variant_fingerprint(ATTN, nones[2], p, "sm_90a"), median=9.0)
    ids["no_family"] = hostile(db, "no_such_family", '{"family":"no_such_family","x":1}')
    ids["wrong_family"] = hostile(db, "linear_sm90_mma", LINEAR_KEY)   # on an attention row
    ids["bad_key"] = hostile(db, "attention_sm90", '{"family":"attention_sm90","kc":"many"}')
    before = fingerprints(db)
    # before: only the row tuned with the new code is served (the faster one is stale)
    assert Dispatcher(paths=[db], device=H200).lookup("decode_attention", p) == nones[2]

    dry = rf.refingerprint(db, "HEAD", repo=repo, check_ptx="never", dry_run=True)
    assert fingerprints(db) == before
    s = rf.refingerprint(db, "HEAD", repo=repo, check_ptx="never")
    assert (dry.tier1, dry.written, s.tier1, s.unchanged, s.written) == (2, 0, 2, 1, 1)
    assert (s.rows, s.tier2, s.differing, s.stale, s.unparseable) == (7, 0, 1, 1, 3)
    after = fingerprints(db)
    assert after[ids["none"]] != before[ids["none"]]
    assert {k: v for k, v in after.items() if k != ids["none"]} == \
        {k: v for k, v in before.items() if k != ids["none"]}
    assert "not compiled" in s.left[ids["workspace"]]
    assert "stale" in s.left[ids["stale"]]
    for k in ("no_family", "wrong_family", "bad_key"):
        assert s.left[ids[k]].startswith(("old code:", "new code:")), s.left[ids[k]]
    with TuningDB(db, readonly=True) as t:
        assert t.verify().ok
    d = Dispatcher(paths=[db], device=H200)
    assert d.source("decode_attention", p).startswith(str(db))
    assert d.lookup("decode_attention", p) == nones[0]     # 5 us, beats the current 9 us


def test_xz_table_in_place_and_to_out_through_the_cli(tmp_path, capsys):
    db = tmp_path / "t.sqlite"
    repo, p, ids = attention_rows(tmp_path, db)
    xz = tmp_path / "t.sqlite.xz"
    with TuningDB(db, readonly=True) as t:
        t.export_sqlite(xz)
    raw = xz.read_bytes()
    out = tmp_path / "new.sqlite.xz"
    s = rf.refingerprint(xz, "HEAD", repo=repo, check_ptx="never", out=out)
    assert xz.read_bytes() == raw and s.written == 1
    assert Dispatcher(paths=[out], device=H200).source("decode_attention", p).startswith(
        str(out))
    # in place through the CLI (--repo: the repository --from names)
    code = cli.main(["db", "refingerprint", "--db", str(xz), "--from", "HEAD", "--repo",
                     str(repo), "--check-ptx", "never"])
    text = capsys.readouterr().out
    assert code == 1 and "tier 1 1 " in text and "not compiled" in text, text
    assert xz.read_bytes() != raw
    assert Dispatcher(paths=[xz], device=H200).source("decode_attention", p).startswith(
        str(xz))
    # winners only: the faster row is the workspace one (both stored at 5 us: lower id wins)
    s3 = rf.refingerprint(db, "HEAD", repo=repo, check_ptx="never", winners_only=True,
                          dry_run=True)
    assert s3.rows == 1


QUANT_TEMPLATE = "resgen/templates/quant_sm90.py.j2"


def test_tier2_compiles_a_renamed_kernel_identical_and_a_changed_constant_different(tmp_path):
    """The old template had a comment the new one lost, the kernel function under another
    name, and the M-Ext row-pair layout's rows swapped (a real change for row_pair variants,
    dead code for plain ones). Plain: the source differs, raw PTX differs (the symbol),
    normalised PTX and host IR are equal -> tier 2. Row-pair: differs -> left alone."""
    text = (ROOT / QUANT_TEMPLATE).read_text()
    n = text.count("quant_kernel")
    assert n >= 2
    edits = [("        return 2 * j, 2 * j + 1\n", "        return 2 * j + 1, 2 * j\n"),
             ("ZERO_OFF = AMAX_CTAS * 4", "# a comment the new template lost\nZERO_OFF = "
                                          "AMAX_CTAS * 4")]
    repo = old_repo(tmp_path, {QUANT_TEMPLATE: edits})
    f = repo / QUANT_TEMPLATE
    f.write_text(f.read_text().replace("quant_kernel", "quant_kernel_old"))
    subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t",
                    "commit", "-qam", "renamed"], check=True)
    db = tmp_path / "t.sqlite"
    rows = {lay: (QUANT.PROBLEM.from_key(QP % (comp, lay)), QUANT.VARIANT.from_key(QV % lay))
            for lay, comp in (("plain", "none"), ("row_pair", "full"))}
    fps = old_fingerprints(repo, [(QUANT.NAME, p.key(), v.key()) for p, v in rows.values()])
    ids = {lay: store(db, QUANT, p, v, fp) for (lay, (p, v)), fp in zip(rows.items(), fps)}
    s = rf.refingerprint(db, "HEAD", repo=repo, workers=2)
    assert (s.tier1, s.tier2, s.differing, s.compiles) == (0, 1, 1, 4), s.lines()
    assert s.tier2_raw_equal == 0           # the symbol rename is what normalisation removed
    assert s.left[ids["row_pair"]].startswith("kernel differs"), s.left
    assert fingerprints(db)[ids["plain"]] != fps[0]
    assert fingerprints(db)[ids["row_pair"]] == fps[1]
    p, _ = rows["plain"]
    assert Dispatcher(paths=[db], device=H200).source("quantize", p).startswith(str(db))


PTX = """//
// Generated by NVIDIA NVVM Compiler
// Cuda compilation tools, release {rel}
//
.version 9.4
.target sm_90a
	// .globl	{name}
.visible .entry {name}(
	.param .u64 .ptr .global .align 16 {name}_param_0,
	.param .u32 {name}_param_1
)
.reqntid {threads}, 1, 1
{{
	.loc 1 {line} 0
	ld.param.u64 %rd1, [{name}_param_0];
	mov.u32 %r1, {const};   /* a note */
	ret;
}}
"""


def test_ptx_normalisation_removes_comments_debug_lines_and_symbol_names_only():
    base = dict(rel="13.4", name="kernel_a_0", threads=128, line=7, const=4)
    a = PTX.format(**base)
    assert kernel_symbols(a) == ["kernel_a_0"]
    for same in ({"rel": "12.9"}, {"name": "kernel_renamed_0"}, {"line": 99}):
        b = PTX.format(**{**base, **same})
        assert a != b and normalise_ptx(a) == normalise_ptx(b), same
    for other in ({"threads": 256}, {"const": 5}):
        assert normalise_ptx(a) != normalise_ptx(PTX.format(**{**base, **other})), other
    # a parameter name of another symbol is not a parameter of this one
    assert "kernel_b_0_param_0" in normalise_ptx(a.replace("ret;", "// kernel_b_0\n"
                                                           "ld.u32 %r2, [kernel_b_0_param_0];"))
    host = ('llvm.mlir.global internal constant @kernels_binary("\\01kernel_a_0\\00")\n'
            'llvm.call @launch(%grid) : (i32) -> () loc("/tmp/x.py":3:1)\n')
    host2 = host.replace("\\01kernel_a_0", "\\02zz").replace(":3:1", ":9:9")
    assert normalise_host_ir(host, ["kernel_a_0"]) == normalise_host_ir(host2, ["kernel_a_0"])
    assert normalise_host_ir(host, []) != normalise_host_ir(host.replace("%grid", "%g2"), [])
    # a renamed kernel: its name string and that string's length move, nothing else
    name = ('%1 = llvm.mlir.constant("{s}\\00") : !llvm.array<{n} x i8>\n'
            '%2 = llvm.alloca %0 x !llvm.array<{n} x i8> : (i32) -> !llvm.ptr\n'
            '%3 = llvm.alloca %0 x !llvm.array<64 x i8> : (i32) -> !llvm.ptr\n')
    old, new = "kernel_long_name_0", "kernel_nm_0"
    a, b = (name.format(s=s, n=len(s) + 1) for s in (old, new))
    assert normalise_host_ir(a, [old]) == normalise_host_ir(b, [new])
    assert "array<64 x i8>" in normalise_host_ir(a, [old])
    assert normalise_host_ir(a, [old]) != normalise_host_ir(b.replace("<64 x", "<65 x"), [new])


def test_set_fingerprints_is_one_transaction_and_keeps_existing_keys(tmp_path):
    db = tmp_path / "t.sqlite"
    p = QUANT.PROBLEM.from_key(QP % ("none", "plain"))
    v = QUANT.VARIANT.from_key(QV % "plain")
    a = store(db, QUANT, p, v, "a" * 64)
    b = store(db, QUANT, p, v, "b" * 64)
    with TuningDB(db) as t:
        assert t.set_fingerprints([(a, "b" * 64)]) == {"written": 0, "already_present": 1}
        assert t.set_fingerprints([(a, "c" * 64)]) == {"written": 1, "already_present": 0}
        with pytest.raises(DatabaseError, match="no result"):
            t.set_fingerprints([(b, "d" * 64), (10 ** 6, "e" * 64)])   # no such row: rollback
        assert t.verify().ok
    assert fingerprints(db) == {a: "c" * 64, b: "b" * 64}


def test_cli_errors_are_one_line(tmp_path, capsys, monkeypatch):
    db = tmp_path / "t.sqlite"
    store(db, QUANT, QUANT.PROBLEM.from_key(QP % ("none", "plain")),
          QUANT.VARIANT.from_key(QV % "plain"), "a" * 64)
    cases = [(["--db", str(tmp_path / "missing.sqlite"), "--from", "HEAD"], "no such"),
             (["--db", str(db), "--from", "no-such-rev-xyz"], "unknown git revision")]
    for args, want in cases:
        assert cli.main(["db", "refingerprint", *args]) == 2
        err = capsys.readouterr().err.strip()
        assert want in err and len(err.splitlines()) == 1, err
    monkeypatch.setattr(rf, "package_root", lambda: tmp_path)        # not a git checkout
    assert cli.main(["db", "refingerprint", "--db", str(db), "--from", "HEAD"]) == 2
    err = capsys.readouterr().err.strip()
    assert "not a git checkout" in err and len(err.splitlines()) == 1, err
    bad = tmp_path / "junk.sqlite"
    bad.write_bytes(b"not sqlite at all" * 10)
    monkeypatch.setattr(rf, "package_root", lambda: ROOT)
    assert cli.main(["db", "refingerprint", "--db", str(bad), "--from", "HEAD"]) == 2
    err = capsys.readouterr().err.strip()
    assert "not an SQLite database" in err and len(err.splitlines()) == 1, err



def test_a_table_changed_during_the_run_is_never_mixed_in(tmp_path, monkeypatch):
    """The rows are read from a snapshot: a row added to --db while the renders / compiles
    run is absent from --out (built from the snapshot), and in place the changed file is
    refused with one message and left as it is."""
    db = tmp_path / "t.sqlite"
    repo, p, ids = attention_rows(tmp_path, db)
    nones = [v for v in ATTN.space(p, "sm_90a") if v.reduction == "none"]
    real = rf._run_side

    writes = iter(nones[3:5])

    def side_that_changes_the_table(*a, **k):
        if not getattr(side_that_changes_the_table, "done", False):
            side_that_changes_the_table.done = True
            store(db, ATTN, p, next(writes), "1" * 64, median=2.0)   # a concurrent writer
        return real(*a, **k)

    monkeypatch.setattr(rf, "_run_side", side_that_changes_the_table)
    out = tmp_path / "new.sqlite"
    s = rf.refingerprint(db, "HEAD", repo=repo, check_ptx="never", out=out)
    assert s.written == 1 and s.rows == 2
    assert len(fingerprints(out)) == 2 and len(fingerprints(db)) == 3
    side_that_changes_the_table.done = False
    before = db.read_bytes()
    with pytest.raises(rf.RefingerprintError, match="changed while the refingerprint ran"):
        rf.refingerprint(db, "HEAD", repo=repo, check_ptx="never")
    assert len(fingerprints(db)) == 4 and db.read_bytes() != before    # only the writer's row
