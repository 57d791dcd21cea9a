"""The SQLite dispatch database (sqlite-utils for schema and queries, plain SQL for writes).

Tables (schema version 2; a version-1 file is read as is and upgraded in place when opened
for writing: version 2 only adds results.phase_s):
- meta(key, value): app = "resgen-tuning", schema_version = 1;
- environments: GPU name, arch, compute capability, SM count, driver, CUDA, torch, CuTe DSL,
  resgen versions, compile_only; identified by the sha256 of those fields (digest);
- workloads: op, canonical problem key (M is the bucket), and its fmt / compensation / m / n / k
  as plain columns for humans (NULL where the op has no such field);
- variants: family, canonical variant key, name;
- results: one row per (workload, variant, fingerprint, environment) with status, space order,
  median / quantiles / every sample, launches, input sets, timing mode, the measurement policy,
  reference error, error text, registers, spills, compile seconds, time, phase_s (JSON: seconds
  the tuner spent on this variant per phase: compile, wait for the GPU lock, prep, check,
  time), and a checksum over the row's content (by digests, so it survives `merge`; phase_s
  joins the checksum only when present, so version-1 rows keep theirs).

Writes: every result is its own `BEGIN IMMEDIATE` transaction (workload, variant and
environment rows included), WAL journal, a busy timeout and a retry loop, so several tuner
processes can write one file at once and a killed writer loses at most the row in flight.
synchronous=NORMAL: in WAL mode a commit then survives any crash or kill of the writing
process (only an OS crash or power loss can roll back the last commits), and a commit costs
no fsync, which matters when a tuner writes two rows per variant while holding the GPU.
A file that is not SQLite, not ours, or newer than this code raises a DatabaseError subclass.

Shipped tables may be xz-compressed (`tuned/h200.sqlite.xz`: the tuning results of three
models compress about 8x, and the repository travels to the GPU machine under a size limit).
Opening one read-only unpacks it once into `<cache_dir>/tables/` under the digest of its
compressed bytes and reads that copy; `export_sqlite` writes one when the name ends in .xz.
"""

from __future__ import annotations

import json
import os
import random
import sqlite3
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, TypeVar
from urllib.parse import quote

import sqlite_utils

from ..search.record import (DEFAULT_TIE_REL, Environment, ResultRecord, Status, pick_winner,
                             stored_timing)
from ..search.variant import ProblemBase, VariantBase, canonical_json, sha256_json
from .errors import (CorruptDatabaseError, DatabaseError, ForeignDatabaseError,
                     MissingDatabaseError, NewerSchemaError)

__all__ = ["SCHEMA_VERSION", "APP", "TuningDB", "VerifyReport", "row_checksum", "unpack_xz",
           "warm_start_rows"]

SCHEMA_VERSION = 2
_OLDEST_READABLE = 1       # version 1 lacks results.phase_s (added by version 2)
APP = "resgen-tuning"
_SQLITE_MAGIC = b"SQLite format 3\x00"
_TABLES = ("meta", "environments", "workloads", "variants", "results")
T = TypeVar("T")

# Result columns covered by the checksum, in addition to the three digests.
_RESULT_FIELDS = ("fingerprint", "space_index", "status", "median_us", "q10_us", "q90_us",
                  "samples", "launches", "n_sets", "timing_mode", "policy", "policy_name",
                  "rel_err", "error", "registers", "spill_bytes", "compile_s", "created")
_ENV_FIELDS = ("gpu_name", "arch", "compute_capability", "sm_count", "driver", "cuda", "torch",
               "cute_dsl", "resgen", "compile_only")
_WORKLOAD_COLUMNS = ("fmt", "compensation", "m", "n", "k")


def _now() -> str:
    """UTC ISO time; microseconds so that rows order against a run's start time
    (TuneConfig.resume_since) even within one second."""
    return datetime.now(timezone.utc).isoformat(timespec="microseconds")


def row_checksum(row: Mapping[str, Any], env_digest: str, workload_digest: str,
                 variant_digest: str) -> str:
    """sha256 over a result's content, with the referenced rows named by their digests."""
    body = {k: row.get(k) for k in _RESULT_FIELDS}
    if row.get("phase_s") is not None:
        body["phase_s"] = row["phase_s"]
    body.update(env=env_digest, workload=workload_digest, variant=variant_digest)
    return sha256_json(body)


@dataclass
class VerifyReport:
    ok: bool
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)


def _check_header(path: Path) -> bool:
    """True if the file is empty (a new database), raise if it is not an SQLite file."""
    try:
        with open(path, "rb") as f:
            head = f.read(len(_SQLITE_MAGIC))
    except OSError as e:
        raise CorruptDatabaseError(f"{path}: cannot read ({e})") from None
    if not head:
        return True
    if head != _SQLITE_MAGIC:
        raise CorruptDatabaseError(f"{path}: not an SQLite database (bad header)")
    return False


def unpack_xz(path: Path) -> Path:
    """The decompressed copy of an xz-compressed table: `<cache_dir>/tables/<stem>-<digest
    of the compressed bytes>.sqlite`, written once (to a temporary name, then renamed, so
    concurrent readers never see half a file)."""
    import hashlib
    import lzma

    from ..settings import settings

    try:
        data = path.read_bytes()
    except OSError as e:
        raise CorruptDatabaseError(f"{path}: cannot read ({e})") from None
    stem = path.name[:-len(".xz")]
    stem = stem[:-len(".sqlite")] if stem.endswith(".sqlite") else stem
    dest = settings().cache_dir / "tables" / \
        f"{stem}-{hashlib.sha256(data).hexdigest()[:16]}.sqlite"
    if dest.exists():
        return dest
    try:
        raw = lzma.decompress(data)
    except lzma.LZMAError as e:
        raise CorruptDatabaseError(f"{path}: not a valid xz file ({e})") from None
    tmp = dest.with_name(f"{dest.name}.{os.getpid()}.tmp")
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_bytes(raw)
        os.replace(tmp, dest)
    except OSError as e:
        raise DatabaseError(f"{path}: cannot unpack into {dest.parent} ({e})") from None
    return dest


class TuningDB:
    """One tuning database file.

    readonly=True opens with SQLite's read-only mode (falling back to immutable mode for a
    file in a read-only directory, e.g. a shipped table) and never creates anything. A path
    ending in .xz is a compressed table: read-only, read from its unpacked copy (`source`
    keeps the path given).
    """

    def __init__(self, path: str | os.PathLike, *, readonly: bool = False, create: bool = True,
                 busy_timeout_s: float = 60.0) -> None:
        self.path = self.source = Path(path)
        self.readonly = readonly
        self.busy_timeout_s = busy_timeout_s
        if self.path.suffix == ".xz":
            if not readonly:
                raise DatabaseError(f"{self.path}: a compressed table opens read-only")
            if not self.path.exists():
                raise MissingDatabaseError(f"{self.path}: no such tuning database")
            self.path = unpack_xz(self.path)
        try:
            self._open(create)
        except DatabaseError as e:
            if self.source == self.path:
                raise
            # name the file the caller gave, not the unpacked cache copy
            raise type(e)(str(e).replace(str(self.path), f"{self.source} (unpacked)")) \
                from None

    def _open(self, create: bool) -> None:
        readonly = self.readonly
        exists = self.path.exists()
        if not exists and (readonly or not create):
            raise MissingDatabaseError(f"{self.path}: no such tuning database")
        empty = _check_header(self.path) if exists else True
        if empty and readonly:
            raise CorruptDatabaseError(f"{self.path}: empty file, not a tuning database")
        if not exists:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self.conn = self._connect()
        try:
            self.db = sqlite_utils.Database(self.conn)
            self._open_schema()
        except BaseException:
            self.conn.close()
            raise

    # -- connection and schema ----------------------------------------------------------
    def _connect(self) -> sqlite3.Connection:
        timeout = self.busy_timeout_s
        if not self.readonly:
            conn = sqlite3.connect(str(self.path), timeout=timeout, isolation_level=None,
                                   check_same_thread=False)
            conn.execute(f"PRAGMA busy_timeout = {int(timeout * 1000)}")
            conn.execute("PRAGMA synchronous = NORMAL")        # see the module docstring
            return conn
        uri = "file:" + quote(str(self.path.resolve()))
        for suffix in ("?mode=ro", "?mode=ro&immutable=1"):
            conn = sqlite3.connect(uri + suffix, uri=True, timeout=timeout,
                                   isolation_level=None, check_same_thread=False)
            try:
                conn.execute("SELECT count(*) FROM sqlite_master").fetchone()
                return conn
            except sqlite3.OperationalError:
                # A WAL file in a directory we cannot write: no -shm can be made; read it as
                # an immutable snapshot instead.
                conn.close()
            except sqlite3.DatabaseError as e:
                conn.close()
                raise CorruptDatabaseError(f"{self.path}: {e}") from None
        raise CorruptDatabaseError(f"{self.path}: cannot open read-only")

    def _open_schema(self) -> None:
        try:
            tables = set(self.db.table_names())
        except sqlite3.DatabaseError as e:
            raise CorruptDatabaseError(f"{self.path}: {e}") from None
        if not tables:
            if self.readonly:
                raise ForeignDatabaseError(f"{self.path}: an empty SQLite file, not a tuning "
                                           "database")
            self._set_wal()
            self._write(self._create_schema)
            return
        self._check_meta(tables)
        if not self.readonly:
            self._set_wal()
            if self.schema_version < SCHEMA_VERSION:
                self._write(self._upgrade)

    def _upgrade(self) -> None:
        """Version 1 -> 2 (inside the write lock; another process may have done it)."""
        (v,) = self.conn.execute("SELECT value FROM meta WHERE key = 'schema_version'"
                                 ).fetchone()
        if int(v) < 2:
            cols = {r[1] for r in self.conn.execute("PRAGMA table_info(results)")}
            if "phase_s" not in cols:
                self.conn.execute("ALTER TABLE results ADD COLUMN phase_s TEXT")
            self.conn.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'",
                              (str(SCHEMA_VERSION),))
        self.schema_version = SCHEMA_VERSION

    def _set_wal(self) -> None:
        for _ in range(50):
            try:
                mode = self.conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
                if str(mode).lower() == "wal":
                    return
            except sqlite3.OperationalError as e:
                if not _is_busy(e):
                    raise
            time.sleep(0.05 + random.random() * 0.05)
        raise DatabaseError(f"{self.path}: could not switch to WAL journal mode")

    def _check_meta(self, tables: set[str]) -> None:
        if "meta" not in tables:
            raise ForeignDatabaseError(f"{self.path}: not a resgen tuning database "
                                       f"(tables: {sorted(tables)[:8]})")
        try:
            meta = {r["key"]: r["value"] for r in self.db.query("SELECT key, value FROM meta")}
        except sqlite3.DatabaseError as e:
            raise ForeignDatabaseError(f"{self.path}: unreadable meta table ({e})") from None
        if meta.get("app") != APP:
            raise ForeignDatabaseError(f"{self.path}: meta.app is {meta.get('app')!r}, "
                                       f"not {APP!r}")
        try:
            version = int(meta.get("schema_version", ""))
        except ValueError:
            raise CorruptDatabaseError(f"{self.path}: schema_version "
                                       f"{meta.get('schema_version')!r} is not an int") from None
        if version > SCHEMA_VERSION:
            raise NewerSchemaError(f"{self.path}: schema version {version} is newer than this "
                                   f"resgen understands ({SCHEMA_VERSION}); upgrade resgen")
        if version < _OLDEST_READABLE:
            raise CorruptDatabaseError(f"{self.path}: schema version {version} is unknown")
        missing = set(_TABLES) - tables
        if missing:
            raise CorruptDatabaseError(f"{self.path}: missing tables {sorted(missing)}")
        self.schema_version = version

    def _create_schema(self) -> None:
        # Re-check inside the write lock: another process may have created it meanwhile.
        tables = set(self.db.table_names())
        if tables:
            self._check_meta(tables)
            return
        db = self.db
        db.table("meta").create({"key": str, "value": str}, pk="key")
        db.table("environments").create(
            {"id": int, "digest": str, "gpu_name": str, "arch": str, "compute_capability": str,
             "sm_count": int, "driver": str, "cuda": str, "torch": str, "cute_dsl": str,
             "resgen": str, "compile_only": int, "created": str},
            pk="id", not_null={"digest", "gpu_name", "arch", "compile_only"})
        db.table("workloads").create(
            {"id": int, "digest": str, "op": str, "key": str, "fmt": str, "compensation": str,
             "m": int, "n": int, "k": int, "created": str},
            pk="id", not_null={"digest", "op", "key"})
        db.table("variants").create(
            {"id": int, "digest": str, "family": str, "key": str, "name": str},
            pk="id", not_null={"digest", "family", "key", "name"})
        db.table("results").create(
            {"id": int, "workload_id": int, "variant_id": int, "environment_id": int,
             "fingerprint": str, "space_index": int, "status": str, "median_us": float,
             "q10_us": float, "q90_us": float, "samples": str, "launches": int, "n_sets": int,
             "timing_mode": str, "policy": str, "policy_name": str, "rel_err": float,
             "error": str, "registers": int, "spill_bytes": int, "compile_s": float,
             "created": str, "checksum": str, "phase_s": str},
            pk="id",
            not_null={"workload_id", "variant_id", "environment_id", "fingerprint", "status",
                      "space_index", "checksum"},
            foreign_keys=[("workload_id", "workloads", "id"), ("variant_id", "variants", "id"),
                          ("environment_id", "environments", "id")])
        for t in ("environments", "workloads", "variants"):
            db.table(t).create_index(["digest"], unique=True)
        db.table("results").create_index(["workload_id", "variant_id", "fingerprint",
                                          "environment_id"], unique=True)
        db.table("results").create_index(["status", "environment_id"])
        self.conn.execute("INSERT INTO meta(key, value) VALUES ('app', ?), "
                          "('schema_version', ?), ('created', ?)",
                          (APP, str(SCHEMA_VERSION), _now()))
        self.schema_version = SCHEMA_VERSION

    def close(self) -> None:
        self.conn.close()

    def __enter__(self) -> "TuningDB":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- transactions ---------------------------------------------------------------------
    def _write(self, fn: Callable[[], T]) -> T:
        """Run fn in one BEGIN IMMEDIATE transaction, retrying while another writer holds the
        lock (the busy timeout waits inside SQLite; this loop covers what it does not)."""
        if self.readonly:
            raise DatabaseError(f"{self.path}: opened read-only")
        deadline = time.monotonic() + self.busy_timeout_s
        delay = 0.01
        while True:
            try:
                self.conn.execute("BEGIN IMMEDIATE")
            except sqlite3.OperationalError as e:
                if _is_busy(e) and time.monotonic() < deadline:
                    time.sleep(delay * (1 + random.random()))
                    delay = min(delay * 2, 0.5)
                    continue
                raise DatabaseError(f"{self.path}: {e}") from None
            try:
                out = fn()
                self.conn.execute("COMMIT")
                return out
            except BaseException as e:
                if self.conn.in_transaction:
                    self.conn.execute("ROLLBACK")
                if (isinstance(e, sqlite3.OperationalError) and _is_busy(e)
                        and time.monotonic() < deadline):
                    time.sleep(delay * (1 + random.random()))
                    delay = min(delay * 2, 0.5)
                    continue
                if isinstance(e, sqlite3.DatabaseError):
                    raise DatabaseError(f"{self.path}: {e}") from e
                raise

    def _ensure(self, table: str, digest: str, row: Mapping[str, Any]) -> int:
        cols = ["digest", *row]
        self.conn.execute(
            f"INSERT OR IGNORE INTO {table} ({', '.join(cols)}) "
            f"VALUES ({', '.join('?' * len(cols))})", (digest, *row.values()))
        (rid,) = self.conn.execute(f"SELECT id FROM {table} WHERE digest = ?",
                                   (digest,)).fetchone()
        return int(rid)

    def _ensure_environment(self, env: Environment) -> int:
        d = env.as_dict()
        d["compile_only"] = int(d["compile_only"])
        d["created"] = _now()
        return self._ensure("environments", env.digest, d)

    def _ensure_workload(self, problem: ProblemBase) -> int:
        row: dict[str, Any] = {"op": type(problem).OP, "key": problem.key()}
        for c in _WORKLOAD_COLUMNS:
            v = getattr(problem, c, None)
            row[c] = v if isinstance(v, (int, str)) and not isinstance(v, bool) else None
        row["created"] = _now()
        return self._ensure("workloads", problem.digest(), row)

    def _ensure_variant(self, variant: VariantBase) -> int:
        return self._ensure("variants", variant.digest(),
                            {"family": type(variant).FAMILY, "key": variant.key(),
                             "name": variant.name()})

    # -- the interface the tuner uses ---------------------------------------------------------
    def record(self, rec: ResultRecord, *, replace: bool = False) -> bool:
        """Store one result in its own transaction. An existing row for the same (workload,
        variant, fingerprint, environment) is kept unless replace=True. True if written."""
        def tx() -> bool:
            env_id = self._ensure_environment(rec.environment)
            wl_id = self._ensure_workload(rec.problem)
            var_id = self._ensure_variant(rec.variant)
            row = {
                "fingerprint": rec.fingerprint, "space_index": int(rec.space_index),
                "status": rec.status, "median_us": _f(rec.median_us), "q10_us": _f(rec.q10_us),
                "q90_us": _f(rec.q90_us),
                "samples": canonical_json([float(s) for s in rec.samples_us]),
                "launches": rec.launches, "n_sets": rec.n_sets, "timing_mode": rec.timing_mode,
                "policy": canonical_json(dict(rec.policy)) if rec.policy else None,
                "policy_name": (rec.policy or {}).get("name"), "rel_err": _f(rec.rel_err),
                "error": rec.error, "registers": rec.registers,
                "spill_bytes": rec.spill_bytes, "compile_s": _f(rec.compile_s),
                "created": _now(),
                "phase_s": canonical_json({k: round(float(v), 6)
                                           for k, v in rec.phase_s.items()})
                if rec.phase_s else None}
            row["checksum"] = row_checksum(row, rec.environment.digest, rec.problem.digest(),
                                           rec.variant.digest())
            cols = ["workload_id", "variant_id", "environment_id", *row]
            vals = [wl_id, var_id, env_id, *row.values()]
            sql = (f"INSERT INTO results ({', '.join(cols)}) "
                   f"VALUES ({', '.join('?' * len(cols))})")
            if replace:
                sets = ", ".join(f"{c} = excluded.{c}" for c in row)
                sql += (" ON CONFLICT(workload_id, variant_id, fingerprint, environment_id) "
                        f"DO UPDATE SET {sets}")
            else:
                sql = sql.replace("INSERT INTO", "INSERT OR IGNORE INTO", 1)
            return self.conn.execute(sql, vals).rowcount > 0
        return self._write(tx)

    def add_workload(self, problem: ProblemBase) -> int:
        """Commit a workload (its own transaction); returns its id."""
        return self._write(lambda: self._ensure_workload(problem))

    def find(self, problem: ProblemBase, variant: VariantBase, fingerprint: str,
             environment: Environment) -> dict[str, Any] | None:
        """The stored result of exactly this (workload, variant, fingerprint, environment)."""
        rows = list(self.db.query(
            "SELECT r.* FROM results r JOIN workloads w ON w.id = r.workload_id "
            "JOIN variants v ON v.id = r.variant_id "
            "JOIN environments e ON e.id = r.environment_id "
            "WHERE w.digest = ? AND v.digest = ? AND r.fingerprint = ? AND e.digest = ?",
            [problem.digest(), variant.digest(), fingerprint, environment.digest]))
        return rows[0] if rows else None

    def timed_rows(self, problem: ProblemBase, environment: Environment
                   ) -> list[dict[str, Any]]:
        """The timed ("ok") results of one workload in one environment: variant_key,
        fingerprint, median_us, space_index, created (the tuner's view of what is known)."""
        return list(self.db.query(
            "SELECT v.key AS variant_key, r.fingerprint AS fingerprint, r.median_us AS "
            "median_us, r.space_index AS space_index, r.created AS created "
            "FROM results r JOIN workloads w ON w.id = r.workload_id "
            "JOIN variants v ON v.id = r.variant_id "
            "JOIN environments e ON e.id = r.environment_id "
            "WHERE w.digest = ? AND e.digest = ? AND r.status = ?",
            [problem.digest(), environment.digest, Status.OK]))

    def __len__(self) -> int:
        return int(self.conn.execute("SELECT count(*) FROM results").fetchone()[0])

    def count(self, since: str | None = None) -> int:
        """Results stored (created at or after `since`, a UTC ISO time, when given)."""
        if since is None:
            return len(self)
        return int(self.conn.execute("SELECT count(*) FROM results WHERE created >= ?",
                                     (since,)).fetchone()[0])

    # -- reading ---------------------------------------------------------------------------
    def rows(self, *, op: str | None = None, status: str | None = None,
             gpu_name: str | None = None, arch: str | None = None,
             compile_only: bool | None = None) -> list[dict[str, Any]]:
        """Results joined with their workload, variant and environment."""
        where: list[str] = []
        args: list[Any] = []
        for col, val in (("w.op", op), ("r.status", status), ("e.gpu_name", gpu_name),
                         ("e.arch", arch)):
            if val is not None:
                where.append(f"{col} = ?")
                args.append(val)
        if compile_only is not None:
            where.append("e.compile_only = ?")
            args.append(int(compile_only))
        sql = ("SELECT r.*, w.op AS op, w.key AS workload_key, w.digest AS workload_digest, "
               "v.family AS family, v.key AS variant_key, v.name AS variant_name, "
               "v.digest AS variant_digest, e.digest AS environment_digest, "
               "e.gpu_name AS gpu_name, e.arch AS arch, e.compile_only AS compile_only "
               "FROM results r JOIN workloads w ON w.id = r.workload_id "
               "JOIN variants v ON v.id = r.variant_id "
               "JOIN environments e ON e.id = r.environment_id")
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY w.id, r.space_index, r.id"
        try:
            return list(self.db.query(sql, args))
        except sqlite3.DatabaseError as e:
            raise CorruptDatabaseError(f"{self.path}: {e}") from None

    def best(self, problem: ProblemBase, *, gpu_name: str, arch: str,
             accept: Callable[[Mapping[str, Any]], bool] = lambda row: True,
             tie_rel: float | None = None) -> Mapping[str, Any] | None:
        """Winning timed row for exactly this workload on this GPU and arch, among rows that
        `accept` (the runtime passes a current-fingerprint and validity check)."""
        rows = [r for r in self.rows(status=Status.OK, gpu_name=gpu_name, arch=arch)
                if r["workload_digest"] == problem.digest() and _timing_ok(r) and accept(r)]
        return pick_winner(rows, _tie_rel(rows) if tie_rel is None else tie_rel)

    def set_fingerprints(self, updates: Iterable[tuple[int, str]]) -> dict[str, int]:
        """Give results new fingerprints ((result id, fingerprint) pairs) and the checksums
        over them, all in ONE transaction (an interrupt leaves every row as it was); timings
        and everything else are untouched. Only `resgen db refingerprint` calls this, after
        proving the kernels identical. A row whose (workload, variant, new fingerprint,
        environment) already exists keeps its fingerprint ("already_present")."""
        todo = list(updates)

        def tx() -> dict[str, int]:
            written = present = 0
            for rid, fp in todo:
                cur = self.conn.execute(
                    "SELECT r.*, e.digest AS ed, w.digest AS wd, v.digest AS vd FROM results r "
                    "JOIN workloads w ON w.id = r.workload_id JOIN variants v ON "
                    "v.id = r.variant_id JOIN environments e ON e.id = r.environment_id "
                    "WHERE r.id = ?", (int(rid),))
                row = cur.fetchone()
                if row is None:
                    raise DatabaseError(f"{self.path}: no result {rid}")
                d = dict(zip([c[0] for c in cur.description], row))
                clash = self.conn.execute(
                    "SELECT 1 FROM results WHERE workload_id = ? AND variant_id = ? AND "
                    "fingerprint = ? AND environment_id = ? AND id != ?",
                    (d["workload_id"], d["variant_id"], fp, d["environment_id"], d["id"])
                ).fetchone()
                if clash is not None:
                    present += 1
                    continue
                d["fingerprint"] = fp
                self.conn.execute("UPDATE results SET fingerprint = ?, checksum = ? WHERE id = ?",
                                  (fp, row_checksum(d, d["ed"], d["wd"], d["vd"]), d["id"]))
                written += 1
            return {"written": written, "already_present": present}
        return self._write(tx)

    def environments(self) -> list[dict[str, Any]]:
        return list(self.db.query("SELECT * FROM environments ORDER BY id"))

    # -- maintenance -----------------------------------------------------------------------
    def verify(self, parse: Callable[[str, str], str | None] | None = None) -> VerifyReport:
        """Integrity check, foreign keys, meta, row checksums, statuses, range checks of the
        timed rows' numbers (resgen.search.record.stored_timing) and (with `parse`, called as
        parse(kind, key_json) -> error or None) that every key still parses. Damage of any
        kind (damaged pages, keys that are not JSON objects, text where numbers belong) is
        reported as an error, never raised."""
        rep = VerifyReport(ok=True)
        try:
            res = [r[0] for r in self.conn.execute("PRAGMA integrity_check")]
        except sqlite3.DatabaseError as e:
            rep.errors.append(f"integrity_check: {e}")
            res = []
        if res and res != ["ok"]:
            rep.errors.append("integrity_check: " + "; ".join(str(x) for x in res[:5]))
        try:
            fk = self.conn.execute("PRAGMA foreign_key_check").fetchall()
            if fk:
                rep.errors.append(f"{len(fk)} rows reference missing workloads/variants/envs")
        except sqlite3.DatabaseError as e:
            rep.errors.append(f"foreign_key_check: {e}")
        try:
            rows = self.rows()
        except DatabaseError as e:
            rep.errors.append(f"results: unreadable ({e})")
            rows = []
        for row in rows:
            rid = row["id"]
            try:
                want = row_checksum(row, row["environment_digest"], row["workload_digest"],
                                    row["variant_digest"])
            except (TypeError, ValueError) as e:
                want = f"unhashable: {e}"
            if want != row["checksum"]:
                rep.errors.append(f"result {rid}: checksum mismatch (row altered or torn)")
            if row["status"] not in Status.ALL:
                rep.errors.append(f"result {rid}: unknown status {_short(row['status'])}")
            if row["status"] == Status.OK:
                try:
                    stored_timing(row)
                except ValueError as e:
                    rep.errors.append(f"result {rid}: {_short(str(e), 120)}")
        for t, kind in (("workloads", "workload"), ("variants", "variant")):
            try:
                keyed = list(self.db.query(f"SELECT id, digest, key FROM {t}"))
            except sqlite3.DatabaseError as e:
                rep.errors.append(f"{t}: unreadable ({e})")
                continue
            for r in keyed:
                try:
                    obj = json.loads(r["key"])
                    if sha256_json(obj) != r["digest"]:
                        rep.errors.append(f"{t} {r['id']}: digest does not match its key")
                except (TypeError, ValueError, RecursionError):
                    rep.errors.append(f"{t} {r['id']}: key is not JSON")
                    continue
                if not isinstance(obj, dict):
                    rep.errors.append(f"{t} {r['id']}: key is a JSON {type(obj).__name__}, "
                                      "not an object")
                    continue
                if parse is not None:
                    try:
                        err = parse(kind, r["key"])
                    except Exception as e:       # a parser bug is a finding, not a crash
                        err = f"{type(e).__name__}: {e}"
                    if err:
                        rep.warnings.append(f"{t} {r['id']}: {_short(str(err), 200)}")
        for t in _TABLES:
            try:
                rep.counts[t] = self.db[t].count
            except sqlite3.DatabaseError as e:
                rep.errors.append(f"{t}: cannot count rows ({e})")
        rep.ok = not rep.errors
        return rep

    def merge_from(self, other: "TuningDB",
                   keep: Callable[[Mapping[str, Any]], bool] | None = None) -> dict[str, int]:
        """Copy every result of `other` not already here (same workload, variant, fingerprint
        and environment), one transaction per result; rows failing their checksum are skipped,
        and so are rows for which `keep` (if given) returns False (counted as "dropped": e.g.
        results tuned with templates this checkout no longer has). A row here that only says
        a variant was started and never finished (its process was killed) or interrupted is
        replaced by `other`'s finished outcome of it ("finished_marker": a distributed run
        re-runs such a variant on another host; resgen.search.distributed)."""
        added = skipped = bad = dropped = finished = 0
        envs = {e["digest"]: e for e in other.environments()}
        for row in other.rows():
            try:
                intact = row_checksum(row, row["environment_digest"], row["workload_digest"],
                                      row["variant_digest"]) == row["checksum"]
            except (TypeError, ValueError):      # e.g. a BLOB where text belongs
                intact = False
            if not intact:
                bad += 1
                continue
            if keep is not None and not keep(row):
                dropped += 1
                continue
            env = dict(envs[row["environment_digest"]])

            def tx(row=row, env=env) -> str:
                env_id = self._ensure("environments", env["digest"],
                                      {k: env[k] for k in (*_ENV_FIELDS, "created")})
                src_w = other.conn.execute(
                    "SELECT op, key, fmt, compensation, m, n, k, created FROM workloads "
                    "WHERE digest = ?", (row["workload_digest"],)).fetchone()
                wl_id = self._ensure("workloads", row["workload_digest"], dict(zip(
                    ("op", "key", "fmt", "compensation", "m", "n", "k", "created"), src_w)))
                var_id = self._ensure("variants", row["variant_digest"],
                                      {"family": row["family"], "key": row["variant_key"],
                                       "name": row["variant_name"]})
                vals = {k: row[k] for k in _RESULT_FIELDS}
                if row.get("phase_s") is not None:
                    vals["phase_s"] = row["phase_s"]
                vals["checksum"] = row["checksum"]
                cols = ["workload_id", "variant_id", "environment_id", *vals]
                cur = self.conn.execute(
                    f"INSERT OR IGNORE INTO results ({', '.join(cols)}) "
                    f"VALUES ({', '.join('?' * len(cols))})",
                    [wl_id, var_id, env_id, *vals.values()])
                if cur.rowcount > 0:
                    return "added"
                if _is_marker(row):
                    return "already_present"
                here = self.conn.execute(
                    "SELECT status, error FROM results WHERE workload_id = ? AND variant_id = ? "
                    "AND fingerprint = ? AND environment_id = ?",
                    (wl_id, var_id, row["fingerprint"], env_id)).fetchone()
                if here is None or not _is_marker({"status": here[0], "error": here[1]}):
                    return "already_present"
                new = {k: v for k, v in vals.items() if k != "phase_s"}
                new["phase_s"] = vals.get("phase_s")      # the checksum covers it if present
                sets = ", ".join(f"{c} = ?" for c in new)
                self.conn.execute(
                    f"UPDATE results SET {sets} WHERE workload_id = ? AND variant_id = ? AND "
                    "fingerprint = ? AND environment_id = ?",
                    [*new.values(), wl_id, var_id, row["fingerprint"], env_id])
                return "finished_marker"
            got = self._write(tx)
            if got == "added":
                added += 1
            elif got == "finished_marker":
                finished += 1
            else:
                skipped += 1
        return {"added": added, "already_present": skipped, "bad_checksum": bad,
                "dropped": dropped, "finished_marker": finished}

    def winner_ids(self, keep: Callable[[Mapping[str, Any]], bool] | None = None) -> set[int]:
        """Result ids of the winning timed row per (workload, GPU name, arch): among the "ok"
        rows (that `keep` accepts) under the newest measurement policy present (version,
        then name: medians of different policies are not compared, as resgen.runtime does),
        the lowest median with ties to the lowest space index (pick_winner)."""
        groups: dict[tuple, list[dict[str, Any]]] = {}
        for r in self.rows(status=Status.OK, compile_only=False):
            if keep is not None and not keep(r):
                continue
            groups.setdefault((r["workload_digest"], r["gpu_name"], r["arch"]), []).append(r)
        out: set[int] = set()
        for rows in groups.values():
            def pol(r: Mapping[str, Any]) -> tuple[int, str]:
                try:
                    d = json.loads(r["policy"] or "{}")
                    return int(d.get("version", 0)), str(d.get("name", ""))
                except (ValueError, TypeError):
                    return 0, ""
            newest = max(pol(r) for r in rows)
            rows = [r for r in rows if pol(r) == newest]
            win = pick_winner(rows, _tie_rel(rows))
            if win is not None:
                out.add(int(win["id"]))
        return out

    def export_winners(self, dest: str | os.PathLike,
                       keep: Callable[[Mapping[str, Any]], bool] | None = None
                       ) -> dict[str, int]:
        """A new tuning database at `dest` holding only the winner rows (winner_ids) with
        their workloads, variants and environments: small enough to share, and a database
        like any other (`resgen db merge` imports it, RESGEN_DB serves it). The rows keep
        their checksums. Returns {"workloads": winners written, "rows_scanned": ...}."""
        dest = Path(dest)
        if dest.exists():
            raise FileExistsError(f"{dest} exists; remove it first")
        ids = self.winner_ids(keep)
        with TuningDB(dest) as out:
            counts = out.merge_from(self, keep=lambda row: int(row["id"]) in ids)
        return {"winners": counts["added"], "rows_scanned": len(self),
                "bad_checksum": counts["bad_checksum"]}

    def export_json(self) -> dict[str, Any]:
        """Every result joined with its workload, variant and environment (plain data)."""
        out = []
        for r in self.rows():
            d = dict(r)
            for k in ("samples", "policy", "workload_key", "variant_key", "phase_s"):
                if d.get(k):
                    d[k] = json.loads(d[k])
            out.append(d)
        return {"app": APP, "schema_version": SCHEMA_VERSION,
                "environments": self.environments(), "results": out}

    def export_sqlite(self, dest: str | os.PathLike) -> Path:
        """A compact, checkpointed copy in rollback-journal mode (what tuned/ ships: a WAL
        file cannot be read from a read-only directory without its -shm); xz-compressed when
        `dest` ends in .xz, at preset 9 (its 64 MiB dictionary spans a whole table: about 6 %
        smaller than preset 6 on the shipped one; a 31 MB table takes about 14 s to compress)."""
        dest = Path(dest)
        if dest.exists():
            raise FileExistsError(f"{dest} exists; remove it first")
        dest.parent.mkdir(parents=True, exist_ok=True)
        plain = dest.with_name(f"{dest.name}.{os.getpid()}.tmp") if dest.suffix == ".xz" \
            else dest
        self.conn.execute("VACUUM INTO ?", (str(plain),))
        c = sqlite3.connect(str(plain), isolation_level=None)
        try:
            c.execute("PRAGMA journal_mode=DELETE")
        finally:
            c.close()
        if plain != dest:
            import lzma

            try:
                dest.write_bytes(lzma.compress(plain.read_bytes(), preset=9))
            finally:
                plain.unlink()
        return dest


def _is_marker(row: Mapping[str, Any]) -> bool:
    """A row that records no outcome: the variant's process died while running it, or Ctrl-C
    stopped it (resgen.search.tuner writes these; resume tries an interrupted one again)."""
    from ..search.tuner import INTERRUPTED, UNFINISHED

    return row.get("status") == Status.RUN_FAILED and row.get("error") in (UNFINISHED,
                                                                           INTERRUPTED)


def _short(x: Any, n: int = 60) -> str:
    """repr of untrusted text, cut to n characters (escapes control characters)."""
    r = repr(x)
    return r if len(r) <= n else r[:n - 3] + "..."


def warm_start_rows(path: str, gpu_name: str | None) -> list[dict[str, Any]]:
    """The timed rows of `path` on GPU `gpu_name` (any fingerprint): what a warm start reads
    (resgen.search.warmstart; TuneConfig.warm_start_reader)."""
    with TuningDB(path, readonly=True) as db:
        return db.rows(status=Status.OK, gpu_name=gpu_name, compile_only=False)


def _f(x: float | None) -> float | None:
    return None if x is None else float(x)


def _is_busy(e: sqlite3.OperationalError) -> bool:
    msg = str(e).lower()
    return "locked" in msg or "busy" in msg


def _timing_ok(row: Mapping[str, Any]) -> bool:
    """The row's checksum matches and its numbers pass stored_timing's range checks."""
    try:
        stored_timing(row)
    except ValueError:
        return False
    return row_checksum(row, row["environment_digest"], row["workload_digest"],
                        row["variant_digest"]) == row["checksum"]


def _tie_rel(rows: Iterable[Mapping[str, Any]]) -> float:
    """The tie band recorded in the rows' policy (the smallest valid one if they differ)."""
    rels = []
    for r in rows:
        try:
            rels.append(stored_timing(r).tie_rel)
        except ValueError:
            pass
    return min(rels) if rels else DEFAULT_TIE_REL
