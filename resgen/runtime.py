"""Run-time dispatch: `lookup(op, problem)` -> the tuned variant for this GPU.

Databases are consulted in order (resgen.settings): an explicit path, RESGEN_DB, the user's
cache database, then the shipped `tuned/<gpu>.sqlite` for this GPU (tuned/h200.sqlite on the
H200; or its xz-compressed form tuned/h200.sqlite.xz). Tuned buckets are tried nearest first,
and for the same bucket the database earlier in that order answers (an exact bucket in the
shipped table beats a neighbouring bucket in the cache database). A row is acceptable only if
- it is a timed "ok" result from an environment with this GPU's name and arch;
- its checksum matches its content (a row `resgen db verify` reports as altered or torn is
  never served; checked once per table load) and its workload and variant keys match their
  stored digests;
- its median, space index and measurement policy pass the range checks of
  resgen.search.record.stored_timing (a positive finite median, a tie band in
  [0, MAX_TIE_REL]): one bad row is skipped (one warning per table), never a crash;
- its variant parses through `VARIANT.from_dict` (nothing from a file is trusted);
- its fingerprint equals the one the current templates, compile options, arch, resgen and
  CuTe DSL produce for it (a stale row is never served);
- `why_invalid(variant, real problem, arch)` is None: a bucketed entry is re-checked against
  the REAL problem, and if the bucket's best valid variant does not exist, the next bucket is
  tried (buckets at or above the real value first, nearest first; then those below).
Within a bucket the acceptable rows compete only under one measurement policy, the newest
(version, then name) present: a policy version can change what is timed (tune v2 times linear
layers whole, v1 timed the GEMM alone), so medians of different versions are not compared.
A K-Ext presum linear workload (LinearProblem fold "presum") with no acceptable row of its own
is served its plain twin's answer (same format, M, N, K, scale, compensation "none") as a
presum variant where that is valid: the presum GEMM is the plain one over K in FP16 (source
"... (plain twin as presum)", no median; logged once per (op, bucket)).
Otherwise the family's default is returned and a warning is logged once per (op, bucket).
A real value served from a bucket more than 2x below it (prefill M from the decode buckets)
is logged once per (op, bucket) too: valid, but tuned for another regime.
A missing, corrupt, foreign or newer-schema file is skipped with one warning: never a crash.

Answers are cached in memory per (op, problem, family); a warm lookup is one dict access
(bench/bench_lookup.py measures it; tests/test_runtime.py asserts a loose bound).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

from .db import DatabaseError, MissingDatabaseError, TuningDB, row_checksum
from .search.buckets import bucket_fields, bucket_rank, without_buckets
from .search.build import memo_fingerprint
from .search.family import KernelFamily, families_for, get_family
from .search.record import (DEFAULT_TIE_REL, Status, arch_of_capability, gpu_slug, pick_winner,
                            stored_timing)
from .search.variant import ProblemBase, VariantBase, canonical_json
from .settings import settings

__all__ = ["Device", "Dispatcher", "lookup", "dispatcher", "reset", "default_db_paths",
           "shipped_table"]

log = logging.getLogger("resgen.runtime")


@dataclass(frozen=True)
class Device:
    """What the runtime matches database environments against."""

    gpu_name: str
    arch: str

    @staticmethod
    def current(index: int = 0) -> "Device | None":
        try:
            import torch

            if not torch.cuda.is_available():
                return None
            p = torch.cuda.get_device_properties(index)
            return Device(p.name, arch_of_capability(p.major, p.minor))
        except Exception:
            return None


def default_db_paths(device: Device | None, explicit: str | Path | None = None) -> list[Path]:
    s = settings()
    out: list[Path] = []
    for p in (explicit, s.db_path, s.user_db):
        if p is not None and Path(p) not in out:
            out.append(Path(p))
    if device is not None:
        try:
            out.append(shipped_table(s.tuned_dir, gpu_slug(device.gpu_name)))
        except ValueError:
            pass
    return out


def shipped_table(tuned_dir: Path, slug: str) -> Path:
    """`<tuned_dir>/<slug>.sqlite`, or its xz-compressed form `<slug>.sqlite.xz` when only
    that exists (TuningDB reads either)."""
    plain = Path(tuned_dir) / f"{slug}.sqlite"
    packed = plain.with_name(plain.name + ".xz")
    return packed if not plain.exists() and packed.exists() else plain


@dataclass
class _Row:
    family: str
    variant: VariantBase
    median_us: float
    space_index: int
    fingerprint: str
    tie_rel: float
    policy: tuple[int, str] = (0, "")      # (version, name) of the measurement policy

    def as_pick(self) -> dict[str, Any]:
        return {"median_us": self.median_us, "space_index": self.space_index, "row": self,
                "tiebreak": f"{self.family}\0{self.variant.key()}"}


@dataclass
class _Entry:
    """One tuned workload (a bucket) of one database."""

    problem: ProblemBase
    buckets: tuple[int, ...]
    rows: list[_Row] = field(default_factory=list)


class _Table:
    """The acceptable rows of one database for one device, indexed for lookup.

    A row is skipped (never a crash, one warning per table with the counts by reason) when its
    checksum does not match its content (altered or torn: what `resgen db verify` reports),
    its family is unknown, its workload or variant key does not parse or does not match its
    stored digest, or its median, space index or policy is out of range
    (resgen.search.record.stored_timing)."""

    def __init__(self, path: Path, device: Device, warn: Any) -> None:
        # entries[op][non-bucket key] -> [_Entry]
        self.entries: dict[str, dict[str, list[_Entry]]] = defaultdict(lambda: defaultdict(list))
        with TuningDB(path, readonly=True) as db:
            rows = db.rows(status=Status.OK, gpu_name=device.gpu_name, arch=device.arch,
                           compile_only=False)
        by_workload: dict[str, _Entry] = {}
        # Rows repeat workloads and variants (12629 rows, 1464 workloads, 449 variants in the
        # shipped H200 table): each distinct key is parsed and validated once.
        parsed: dict[tuple[str, str, str], Any] = {}

        def parse(cls: Any, key: Any, digest: Any) -> Any:
            k = (cls.__qualname__, str(key), str(digest))
            if k not in parsed:
                try:
                    obj = cls.from_key(key)
                    if obj.digest() != digest:
                        raise ValueError("key does not match its stored digest")
                    parsed[k] = obj
                except Exception as e:        # remembered: the same key fails the same way
                    parsed[k] = ValueError(f"{cls.__name__} key: {e}"[:200])
            out = parsed[k]
            if isinstance(out, ValueError):
                raise out
            return out

        skipped: Counter[str] = Counter()
        for r in rows:
            try:
                if row_checksum(r, r["environment_digest"], r["workload_digest"],
                                r["variant_digest"]) != r["checksum"]:
                    raise ValueError("checksum mismatch (row altered or torn)")
                fam = get_family(r["family"])
                problem = parse(fam.PROBLEM, r["workload_key"], r["workload_digest"])
                variant = parse(fam.VARIANT, r["variant_key"], r["variant_digest"])
                timing = stored_timing(r)
            except Exception as e:       # bad checksum, family, key or numbers: skip the row
                skipped[str(e)[:160]] += 1
                continue
            entry = by_workload.get(r["workload_digest"])
            if entry is None:
                fields = bucket_fields(type(problem))
                entry = _Entry(problem, tuple(int(getattr(problem, f)) for f in fields))
                by_workload[r["workload_digest"]] = entry
                nb = canonical_json(without_buckets(problem))
                self.entries[type(problem).OP][nb].append(entry)
            entry.rows.append(_Row(r["family"], variant, timing.median_us, timing.space_index,
                                   r["fingerprint"], timing.tie_rel, timing.policy))
        if skipped:
            why = "; ".join(f"{n} x {msg}" for msg, n in skipped.most_common(3))
            warn(("rows", str(path)), f"{path}: skipped {sum(skipped.values())} of {len(rows)} "
                                      f"timed rows ({why})")


class Dispatcher:
    """Resolves (op, problem) to a variant; see the module docstring."""

    def __init__(self, paths: Sequence[str | Path] | None = None, device: Device | None = None,
                 explicit: str | Path | None = None) -> None:
        self.device = device if device is not None else Device.current()
        self.arch = self.device.arch if self.device is not None else settings().arch
        self.paths = [Path(p) for p in paths] if paths is not None else \
            default_db_paths(self.device, explicit)
        # Paths the user named: a missing one is worth a warning (the cache DB is optional).
        self._explicit = ({Path(p) for p in paths} if paths is not None else
                          {Path(p) for p in (explicit, settings().db_path) if p is not None})
        self._cache: dict[tuple, VariantBase] = {}
        self._source: dict[tuple, str] = {}
        self._median: dict[tuple, float] = {}
        self._tables: list[tuple[Path, _Table]] | None = None
        self._fp: dict[tuple[str, str, str, str], str] = {}   # build.memo_fingerprint
        self._warned: set = set()
        self._lock = threading.RLock()

    # -- public -------------------------------------------------------------------------------
    def lookup(self, op: str, problem: ProblemBase, family: str | None = None) -> VariantBase:
        """The variant to run for `problem` (see the module docstring)."""
        key = (op, problem, family)
        try:
            return self._cache[key]
        except KeyError:
            pass
        with self._lock:
            v, src, med = self._resolve(op, problem, family)
            self._cache[key] = v
            self._source[key] = src
            if med is not None:
                self._median[key] = med
        return v

    def source(self, op: str, problem: ProblemBase, family: str | None = None) -> str:
        """Where the answer came from: a database path and bucket, or "default"."""
        self.lookup(op, problem, family)
        return self._source[(op, problem, family)]

    def served(self, op: str, problem: ProblemBase, family: str | None = None
               ) -> tuple[VariantBase, str, float | None]:
        """(variant, source, its stored median in us or None for the default): what
        `resgen show` prints for a tuned workload."""
        v = self.lookup(op, problem, family)
        key = (op, problem, family)
        return v, self._source[key], self._median.get(key)

    def tuned(self, op: str | None = None) -> list[tuple[str, ProblemBase]]:
        """Every distinct (op, tuned problem) of the acceptable rows of this device's
        tables, in table order."""
        out: dict[tuple[str, str], tuple[str, ProblemBase]] = {}
        for _, table in self._load():
            for o, by_nb in table.entries.items():
                if op is not None and o != op:
                    continue
                for entries in by_nb.values():
                    for e in entries:
                        out.setdefault((o, e.problem.key()), (o, e.problem))
        return list(out.values())

    # -- internals -------------------------------------------------------------------------
    def _warn(self, key: Any, msg: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(msg)

    def _load(self) -> list[tuple[Path, _Table]]:
        if self._tables is not None:
            return self._tables
        tables = []
        for p in self.paths:
            if self.device is None:
                break
            try:
                tables.append((p, _Table(p, self.device, self._warn)))
            except MissingDatabaseError:
                if p in self._explicit:
                    self._warn(("db", str(p)), f"tuning database {p} does not exist")
            except DatabaseError as e:
                self._warn(("db", str(p)), f"ignoring tuning database: {e}")
            except Exception as e:        # anything else from a bad file: still no crash
                self._warn(("db", str(p)), f"ignoring tuning database {p}: "
                                           f"{type(e).__name__}: {e}")
        self._tables = tables
        return tables

    def _families(self, op: str, problem: ProblemBase, family: str | None
                  ) -> list[KernelFamily]:
        if family is not None:
            fams = [get_family(family)]
        else:
            fams = [f for f in families_for(op, self.arch) if f.PROBLEM is type(problem)]
            fams.sort(key=lambda f: f.NAME)
        if not fams:
            raise ValueError(f"no kernel family for op {op!r}, problem "
                             f"{type(problem).__name__} on {self.arch}")
        return fams

    def _warn_far(self, op: str, nb: str, fields: tuple[str, ...], real: tuple[int, ...],
                  buckets: tuple[int, ...]) -> None:
        """Warn once per (op, problem class, bucket) when a real value is served from a tuned
        bucket more than 2x below it (e.g. prefill M from the decode buckets): valid, but
        tuned for another regime (split-K for one token tile, say)."""
        far = {f: (r, b) for f, r, b in zip(fields, real, buckets) if r > 2 * max(int(b), 1)}
        if far:
            what = ", ".join(f"{f} = {r} from the bucket {b}" for f, (r, b) in far.items())
            self._warn(("far", op, nb, tuple(buckets)),
                       f"{op} {nb}: {what} (the largest tuned at or below it); tune buckets "
                       f"near it for this workload (e.g. resgen tune --m-buckets ...)")

    def _current_fp(self, fam: KernelFamily, v: VariantBase, tuned: ProblemBase) -> str:
        """The fingerprint v would have now; computed once per compile class
        (build.memo_fingerprint); "" (matching no row) if it cannot be computed."""
        try:
            return memo_fingerprint(self._fp, fam, v, tuned, self.arch)
        except Exception as e:
            self._warn(("fp", fam.NAME), f"cannot fingerprint {v.name()}: {e}")
            return ""

    def _valid(self, fam: KernelFamily, row: _Row, real: ProblemBase) -> bool:
        try:
            return fam.why_invalid(row.variant, real, self.arch) is None
        except Exception:
            return False

    def _resolve(self, op: str, problem: ProblemBase, family: str | None
                 ) -> tuple[VariantBase, str, float | None]:
        if not isinstance(problem, ProblemBase) or type(problem).OP != op:
            raise ValueError(f"problem {problem!r} is not a {op!r} problem")
        fams = self._families(op, problem, family)
        by_name = {f.NAME: f for f in fams}
        fields = bucket_fields(type(problem))
        real = tuple(int(getattr(problem, f)) for f in fields)
        nb = canonical_json(without_buckets(problem))
        # Nearest bucket first; for the same bucket, the database earlier in the order.
        cands = sorted(((bucket_rank(real, e.buckets), i, path, e)
                        for i, (path, table) in enumerate(self._load())
                        for e in table.entries.get(op, {}).get(nb, ())),
                       key=lambda c: (c[0], c[1]))
        for _, _, path, entry in cands:
            ok = []
            stale = 0
            for r in entry.rows:
                fam = by_name.get(r.family)
                if fam is None:
                    continue
                if r.fingerprint != self._current_fp(fam, r.variant, entry.problem):
                    stale += 1
                elif self._valid(fam, r, problem):
                    ok.append(r)
            if stale:      # said once per database and op, whoever answers in the end
                self._warn(("stale", str(path), op),
                           f"{path}: ignoring stale {op} results (tuned with other templates, "
                           f"compile options or versions; e.g. {stale} for {nb} "
                           f"{dict(zip(fields, entry.buckets))}): re-tune, `resgen show "
                           f"--db {path}` marks them STALE")
            if ok:      # medians compare only under one policy: the newest one present
                newest = max(r.policy for r in ok)
                ok = [r for r in ok if r.policy == newest]
            win = pick_winner([r.as_pick() for r in ok],
                              min((r.tie_rel for r in ok), default=DEFAULT_TIE_REL))
            if win is not None:
                self._warn_far(op, nb, fields, real, entry.buckets)
                return (win["row"].variant, f"{path} bucket {dict(zip(fields, entry.buckets))}",
                        win["row"].median_us)
        bucket = tuple(1 << max(0, (int(x) - 1)).bit_length() for x in real)
        twin = self._presum_twin(op, problem, family)
        if twin is not None:
            self._warn(("twin", op, nb, bucket),
                       f"no tuned entry for {op} {nb} {dict(zip(fields, bucket))}: serving its "
                       f"plain twin's tuned variant as presum ({twin[1]})")
            return twin
        # Miss: the family default, loud once per (op, bucket).
        self._warn(("miss", op, nb, bucket),
                   f"no tuned entry for {op} {nb} {dict(zip(fields, bucket))} on "
                   f"{self.device.gpu_name if self.device else 'no GPU'}; using the default")
        for fam in fams:
            d = fam.default(problem, self.arch)
            if fam.why_invalid(d, problem, self.arch) is None:
                return d, "default", None
        raise ValueError(f"no family accepts {problem.key()} on {self.arch}: even the "
                         f"default variant is invalid")

    def _presum_twin(self, op: str, problem: ProblemBase, family: str | None
                     ) -> tuple[VariantBase, str, None] | None:
        """For a K-Ext presum workload: (its plain twin's tuned variant with fold "presum",
        source, None) where the twin is tuned (not a default), has a fold axis and is valid
        for the workload; else None. (bench/results/h200/kext_presum_probe_s34: the presum
        twins of plain's winners ran K-Ext 0.125 at 1.03-1.07x plain's time from M = 16 on.)"""
        if not getattr(problem, "kext_presum", False):
            return None
        plain = problem.plain_twin()  # type: ignore[attr-defined]
        v, src = self.lookup(op, plain, family), self.source(op, plain, family)
        fold = getattr(v, "fold", None)
        if src == "default" or fold is None:
            return None
        tw = replace(v, fold=type(fold)("presum"))  # type: ignore[type-var]
        if get_family(v.FAMILY).why_invalid(tw, problem, self.arch) is not None:
            return None
        return tw, f"{src} (plain twin as presum)", None


_DISPATCHER: Dispatcher | None = None


def dispatcher() -> Dispatcher:
    global _DISPATCHER
    if _DISPATCHER is None:
        _DISPATCHER = Dispatcher()
    return _DISPATCHER


def reset(paths: Sequence[str | Path] | None = None, device: Device | None = None,
          explicit: str | Path | None = None) -> Dispatcher:
    """Replace the process-wide dispatcher (after tuning, or in tests)."""
    global _DISPATCHER
    _DISPATCHER = Dispatcher(paths, device, explicit)
    return _DISPATCHER


def lookup(op: str, problem: ProblemBase, family: str | None = None) -> VariantBase:
    """The tuned variant for `problem` on this GPU (process-wide dispatcher)."""
    d = _DISPATCHER
    if d is None:
        d = dispatcher()
    return d.lookup(op, problem, family)
