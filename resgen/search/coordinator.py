"""The coordinator of a distributed tuning run: one optuna study on a PostgreSQL server
(optuna's RDBStorage, its heartbeat and its stale-trial retry) that every tuner process, one
per GPU on one or many hosts, draws its work from. Results stay where they are without a
coordinator: each process records every outcome in its host's own SQLite dispatch database
(resgen.db), and `resgen db merge` gathers the hosts' databases into the table that ships.
docs/distributed_tuning.md has the design and its rationale.

The study. One per environment (GPU name, arch, compute capability, SM count, driver, CUDA,
torch, CuTe DSL, resgen: resgen.search.record.Environment), named after the GPU and the
environment's digest: two GPU kinds, drivers or software versions never share a study, so only
results measured in one environment are ever compared. Its trials are of three kinds, told
apart by one user attribute (`resgen`, a JSON object):
- "workload": one per (run settings, stage, family, workload): the unit a process claims. A
  cover-stage trial runs the cover search (resgen.search.tuner); a "full" or "refine" trial
  runs the workload's search: a fixed candidate list (exhaustive space, ranked by the
  family's prior, a compile-only spread or covering subset) is first enqueued as one
  "variant" trial per candidate, a large space without a prior is searched by the seeded TPE
  sampler in the claiming process (each proposal depends on the previous timings, so one
  process at a time owns a workload's search; a retried search replays its seed and reuses
  the timings already reported, so the same variants are proposed and none is timed twice).
- "variant": one candidate of a fixed list, claimed by the process that opened the workload
  (in list order) or, when nothing else is waiting, by any other process (from the end).
- "result": one per evaluated (workload, variant, fingerprint): status, median, space index,
  when. This is the study's registry of what is known: a process about to time a variant
  first looks here, so no two processes time the same (workload, variant, fingerprint) in one
  environment, whichever run or host measured it, unless asked to re-measure (--no-resume
  with a run tag: only this run's results count).

Claiming is optuna's WAITING -> RUNNING transition (a row lock: one process wins). A claimed
trial is kept alive by a heartbeat thread; a trial whose heartbeat is older than the grace
period (its process was killed, its host died) is failed by the next process that looks
(optuna.storages.fail_stale_trials) and re-queued as a WAITING copy with the same attributes
(RetryHeartbeatStaleTrialCallback) up to `max_retry` times. A variant that was in flight in two
failed attempts of one workload's search is recorded as failed in that search instead of
being tried a third time.

The run settings (everything that changes which variants a workload's search evaluates:
arch, budget, search, stages, seed, policy, warm-start table, re-measure tag) are digested into
every workload and variant trial, so processes with different settings never take each
other's work, while results are shared between them.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import inspect
import json
import logging
import math
import os
import random
import threading
import time
import warnings
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import AbstractSet as Set
from typing import Any, Iterator, Mapping, Sequence

from .record import Environment, ResultRecord, Status, gpu_slug
from .variant import canonical_json, sha256_json

__all__ = ["CoordinatorConfig", "CoordinatorError", "Coordinator", "Item", "Known",
           "check_url", "redact", "study_name", "probe", "run_settings", "file_digest",
           "ATTR", "DRIVERS"]

log = logging.getLogger("resgen.coordinator")

ATTR = "resgen"                       # the user attribute every trial of the study carries
APP = "resgen-tuning"
DRIVERS = ("psycopg", "psycopg2", "pg8000")     # SQLAlchemy PostgreSQL drivers, preferred first
_DIST_HINT = "pip install 'resgen[dist]' (psycopg 3)"
_STRIKES = 2                           # in flight in this many failed attempts: given up


class CoordinatorError(RuntimeError):
    """The coordinator cannot be used (bad URL, no driver, server unreachable, a foreign
    study): the CLI prints the message as one line and exits with code 2."""


@dataclass(frozen=True)
class CoordinatorConfig:
    """Where the study lives and how its trials are kept alive (seconds)."""

    url: str
    heartbeat_s: int = 5          # a claimed trial's heartbeat period
    grace_s: int = 30             # no heartbeat this long: the trial is failed and re-queued
    max_retry: int = 2            # re-queues of one trial before it is given up
    poll_s: float = 1.0           # waiting for trials in flight elsewhere
    connect_timeout_s: int = 10
    run_tag: str | None = None    # names a re-measure run (--no-resume): same on every host

    def __post_init__(self) -> None:
        if not (isinstance(self.heartbeat_s, int) and self.heartbeat_s >= 1):
            raise ValueError("heartbeat_s must be an int >= 1")
        if not (isinstance(self.grace_s, int) and self.grace_s > self.heartbeat_s):
            raise ValueError("grace_s must be an int > heartbeat_s")
        if not (isinstance(self.max_retry, int) and self.max_retry >= 0):
            raise ValueError("max_retry must be an int >= 0")
        if not (self.poll_s > 0 and self.connect_timeout_s >= 1):
            raise ValueError("poll_s must be > 0 and connect_timeout_s >= 1")


def redact(url: str) -> str:
    """The URL with its password hidden (for messages)."""
    try:
        from sqlalchemy.engine import make_url

        return make_url(url).render_as_string(hide_password=True)
    except Exception:
        return "<unparseable URL>"


def check_url(url: str) -> str:
    """A usable SQLAlchemy URL for a PostgreSQL coordinator, with a driver that is installed
    (`postgresql://` picks the first of DRIVERS found). Raises CoordinatorError naming the
    problem: not a URL, not PostgreSQL, no driver."""
    import importlib.util

    try:
        from sqlalchemy.engine import make_url
        from sqlalchemy.exc import ArgumentError
    except ImportError:
        raise CoordinatorError(f"the coordinator needs SQLAlchemy: {_DIST_HINT}") from None
    try:
        u = make_url(url)
    except (ArgumentError, ValueError, TypeError) as e:
        raise CoordinatorError(f"coordinator {url!r} is not a database URL "
                               f"(postgresql://USER@HOST:PORT/DB): {e}") from None
    backend, _, driver = u.drivername.partition("+")
    if backend not in ("postgresql", "postgres"):
        raise CoordinatorError(f"coordinator {redact(url)}: need a PostgreSQL server URL "
                               f"(postgresql://...), not {backend!r}")
    if not u.host and not (u.query or {}).get("host"):
        raise CoordinatorError(f"coordinator {redact(url)}: the URL names no host")
    found = [d for d in DRIVERS if importlib.util.find_spec(d) is not None]
    if driver:
        if driver not in found and importlib.util.find_spec(driver) is None:
            raise CoordinatorError(f"coordinator {redact(url)}: the PostgreSQL driver "
                                   f"{driver!r} is not installed ({_DIST_HINT})")
    elif not found:
        raise CoordinatorError(f"no PostgreSQL driver for the coordinator is installed: "
                               f"{_DIST_HINT}")
    else:
        driver = found[0]
    return u.set(drivername=f"postgresql+{driver}").render_as_string(hide_password=False)


def study_name(env: Environment) -> str:
    """resgen-<gpu>-<environment digest>: one study per environment."""
    try:
        slug = gpu_slug(env.gpu_name)
    except ValueError:
        slug = "gpu"
    return f"resgen-{slug}-{env.digest[:16]}"


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="microseconds")


def _lock_key(*parts: Any) -> int:
    """A PostgreSQL advisory lock key (signed 64-bit) for `parts`."""
    return int(hashlib.sha256(canonical_json(list(parts)).encode()).hexdigest()[:15], 16)


@dataclass(frozen=True)
class Item:
    """A claimed (RUNNING) workload or variant trial."""

    trial_id: int
    number: int
    ident: Mapping[str, Any]          # the trial's `resgen` attribute
    retries: int = 0                  # how many times this trial was re-queued
    strikes: Mapping[str, int] = field(default_factory=dict)   # variant key -> failed attempts

    @property
    def kind(self) -> str:
        return str(self.ident["kind"])

    @property
    def stage(self) -> str:
        return str(self.ident["stage"])

    @property
    def family(self) -> str:
        return str(self.ident["family"])

    @property
    def problem_key(self) -> str:
        return str(self.ident["problem"])


@dataclass(frozen=True)
class Known:
    """A result in the study's registry."""

    status: str
    median_us: float | None
    space_index: int
    created: str
    fingerprint: str


def _parse(trial: Any) -> dict[str, Any] | None:
    raw = trial.user_attrs.get(ATTR)
    if not isinstance(raw, str):
        return None
    try:
        d = json.loads(raw)
    except (TypeError, ValueError):
        return None
    return d if isinstance(d, dict) and isinstance(d.get("kind"), str) else None


def _ident_key(d: Mapping[str, Any]) -> str:
    """What makes two work trials the same work (a re-queued copy shares it)."""
    keep = ("kind", "settings", "stage", "family", "wl", "variant", "fp")
    return canonical_json({k: d.get(k) for k in keep})


class Coordinator:
    """One process's connection to the study (see the module docstring). `settings` is the run
    settings digest; `since` (re-measure runs) is the UTC time before which results do not
    count."""

    def __init__(self, cfg: CoordinatorConfig, env: Environment, settings: str) -> None:
        self.cfg = cfg
        self.env = env
        self.settings = settings
        self.name = study_name(env)
        self.url = check_url(cfg.url)
        self._idents: dict[int, dict[str, Any] | None] = {}
        self._known: dict[tuple[str, str, str, str], list[Known]] = {}
        self._seen_results: set[int] = set()
        self._held: set[int] = set()
        self._held_lock = threading.Lock()
        self._stop = threading.Event()
        self._last_stale = 0.0
        self._salt = f"{os.getpid()}-{random.random()}"
        self.since: str | None = None
        self._connect()
        self._beat = threading.Thread(target=self._beat_loop, name="resgen-heartbeat",
                                      daemon=True)
        self._beat.start()

    # -- connection ------------------------------------------------------------------------------
    def _connect(self) -> None:
        try:
            import optuna
            from optuna.storages import RDBStorage
        except ImportError as e:
            raise CoordinatorError(f"the coordinator needs optuna's RDBStorage ({e}): "
                                   f"{_DIST_HINT}") from None
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self._optuna = optuna
        retry_cls = getattr(optuna.storages, "RetryHeartbeatStaleTrialCallback", None) or \
            optuna.storages.RetryFailedTrialCallback
        kw: dict[str, Any] = {"heartbeat_interval": self.cfg.heartbeat_s,
                              "grace_period": self.cfg.grace_s}
        cb_arg = ("heartbeat_stale_trial_callback"
                  if "heartbeat_stale_trial_callback" in inspect.signature(RDBStorage).parameters
                  else "failed_trial_callback")
        engine = {"pool_pre_ping": True,
                  "connect_args": {"connect_timeout": self.cfg.connect_timeout_s}}
        from sqlalchemy.exc import IntegrityError, ProgrammingError

        def creation_race(e: Exception) -> bool:
            # processes starting together race to create optuna's tables or the study: a
            # unique violation (IntegrityError), or CREATE TABLE of a table another process
            # just made (PostgreSQL's DuplicateTable / DuplicateObject, a ProgrammingError)
            if isinstance(e, IntegrityError):
                return True
            return isinstance(e, ProgrammingError) and "already exists" in str(e)

        for attempt in range(5):
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    kw[cb_arg] = retry_cls(max_retry=self.cfg.max_retry)
                    self.rdb = RDBStorage(self.url, engine_kwargs=engine, **kw)
                    self.study = optuna.create_study(study_name=self.name, storage=self.rdb,
                                                     direction="minimize", load_if_exists=True)
                break
            except (IntegrityError, ProgrammingError) as e:
                # the loser of a creation race retries and finds what the winner made
                if not creation_race(e):
                    raise CoordinatorError(f"cannot use the coordinator "
                                           f"{redact(self.cfg.url)}: {_first_line(e)}") from None
                if attempt == 4:
                    raise CoordinatorError(f"cannot set up the study on {redact(self.cfg.url)}: "
                                           "concurrent creation kept failing") from None
                time.sleep(0.2 + random.random() * 0.5)
            except ImportError as e:
                raise CoordinatorError(f"coordinator {redact(self.cfg.url)}: driver missing "
                                       f"({e}): {_DIST_HINT}") from None
            except Exception as e:
                raise CoordinatorError(f"cannot use the coordinator {redact(self.cfg.url)}: "
                                       f"{_first_line(e)}") from None
        self._sid = self.study._study_id
        self._claim_study()

    def _claim_study(self) -> None:
        """Mark the study as this environment's resgen study, or check that it is. Processes
        starting together race here: one may read the attributes between another's two
        writes (app set, environment not yet), so a missing attribute is written (the same
        value by every process of this environment) and only a DIFFERENT value refuses."""
        want = {"app": APP, "environment": self.env.as_dict()}
        attrs = self.study.user_attrs
        bad = {k: attrs[k] for k in want if k in attrs and attrs[k] != want[k]}
        if bad:
            raise CoordinatorError(f"study {self.name!r} on {redact(self.cfg.url)} is not this "
                                   f"environment's resgen study (attributes "
                                   f"{sorted(attrs)[:6]}); use another database")
        for k, v in want.items():
            if k not in attrs:
                self.study.set_user_attr(k, v)

    def close(self) -> None:
        self._stop.set()
        self._beat.join(timeout=self.cfg.heartbeat_s + 5)
        with contextlib.suppress(Exception):
            self.rdb.remove_session()
            self.rdb.engine.dispose()

    # -- heartbeat -------------------------------------------------------------------------------
    def _beat_loop(self) -> None:
        while not self._stop.wait(self.cfg.heartbeat_s):
            with self._held_lock:
                held = list(self._held)
            for tid in held:
                try:
                    self.rdb.record_heartbeat(tid)
                except Exception as e:       # the server went away: the trial goes stale
                    log.warning("heartbeat of trial %d failed: %s", tid, _first_line(e))

    @contextlib.contextmanager
    def holding(self, trial_id: int) -> Iterator[None]:
        """Keep `trial_id` alive while the block runs (the heartbeat thread beats for it)."""
        with self._held_lock:
            self._held.add(trial_id)
        try:
            yield
        finally:
            with self._held_lock:
                self._held.discard(trial_id)

    def _take(self, trial_id: int) -> bool:
        """WAITING -> RUNNING (one process wins). The heartbeat is recorded first, so a
        process killed right after winning leaves a trial that goes stale (a trial without
        any heartbeat would never be failed)."""
        from optuna.exceptions import UpdateFinishedTrialError
        from optuna.trial import TrialState

        try:
            self.rdb.record_heartbeat(trial_id)
            ok = self.rdb.set_trial_state_values(trial_id, TrialState.RUNNING)
        except UpdateFinishedTrialError:
            return False
        if ok:
            with self._held_lock:
                self._held.add(trial_id)
        return bool(ok)

    def fail_stale(self, force: bool = False) -> None:
        """Fail trials whose heartbeat is older than the grace period and re-queue them (at
        most once per heartbeat period unless forced)."""
        now = time.monotonic()
        if not force and now - self._last_stale < self.cfg.heartbeat_s:
            return
        self._last_stale = now
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                self._optuna.storages.fail_stale_trials(self.study)
            except Exception as e:
                log.warning("failing stale trials: %s", _first_line(e))

    # -- reading the study -----------------------------------------------------------------------
    def snapshot(self) -> list[tuple[Any, dict[str, Any]]]:
        """Every trial with its parsed `resgen` attribute (finished trials come from optuna's
        cache, so a refresh reads the unfinished ones and what is new); results are added to
        the registry."""
        out = []
        for t in self.study.get_trials(deepcopy=False):
            tid = t._trial_id
            if tid not in self._idents:
                self._idents[tid] = _parse(t)
            d = self._idents[tid]
            if d is None:
                continue
            if d["kind"] == "result" and tid not in self._seen_results and \
                    t.state.is_finished():
                self._seen_results.add(tid)
                self._add_known(d)
            out.append((t, d))
        return out

    def _add_known(self, d: Mapping[str, Any]) -> None:
        try:
            k = (str(d["family"]), str(d["wl"]), str(d["variant"]), str(d["fp"]))
            med = d.get("median_us")
            med = float(med) if isinstance(med, (int, float)) and math.isfinite(med) and \
                med > 0 else None
            status = str(d["status"])
            if status not in Status.ALL:
                return
            self._known.setdefault(k, []).append(
                Known(status, med if status == Status.OK else None, int(d["index"]),
                      str(d["created"]), str(d["fp"])))
        except (KeyError, TypeError, ValueError):
            return

    def lookup(self, family: str, workload_digest: str, variant_key: str, fingerprint: str
               ) -> Known | None:
        """The newest known result of exactly this evaluation (at or after `since`)."""
        got = self._known.get((family, workload_digest, variant_key, fingerprint), [])
        got = [k for k in got if self.since is None or k.created >= self.since]
        return max(got, key=lambda k: k.created) if got else None

    def known_for(self, family: str, workload_digest: str) -> list[tuple[str, Known]]:
        """(variant key, result) of every known evaluation of a workload (at or after since)."""
        return [(k[2], r) for k, rs in self._known.items()
                if k[0] == family and k[1] == workload_digest
                for r in rs if self.since is None or r.created >= self.since]

    def report(self, rec: ResultRecord, created: str | None = None) -> None:
        """Add the outcome of one evaluation to the registry (a finished "result" trial whose
        value is the median, +inf when nothing was timed)."""
        from optuna.trial import TrialState, create_trial

        med = rec.median_us if rec.status == Status.OK else None
        d = {"kind": "result", "family": rec.variant.FAMILY, "wl": rec.problem.digest(),
             "problem": rec.problem.key(), "variant": rec.variant.key(),
             "fp": rec.fingerprint, "status": rec.status, "median_us": med,
             "index": int(rec.space_index), "created": created or _now(),
             "pid": os.getpid()}
        self.rdb.create_new_trial(self._sid, template_trial=create_trial(
            state=TrialState.COMPLETE, value=float(med) if med is not None else math.inf,
            user_attrs={ATTR: canonical_json(d)}))
        self._add_known(d)

    # -- publishing work -------------------------------------------------------------------------
    @contextlib.contextmanager
    def _locked(self, *parts: Any) -> Iterator[None]:
        """A PostgreSQL advisory lock (session level: released if this process dies)."""
        from sqlalchemy import text

        key = _lock_key(self.name, *parts)
        conn = self.rdb.engine.connect()
        try:
            conn.execute(text("SELECT pg_advisory_lock(:k)"), {"k": key})
            conn.commit()
            yield
        finally:
            with contextlib.suppress(Exception):
                conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": key})
                conn.commit()
            conn.close()

    def _add_waiting(self, idents: Sequence[Mapping[str, Any]]) -> list[int]:
        from optuna.trial import TrialState, create_trial

        ids = []
        for d in idents:
            ids.append(self.rdb.create_new_trial(self._sid, template_trial=create_trial(
                state=TrialState.WAITING, user_attrs={ATTR: canonical_json(dict(d))})))
        return ids

    def publish(self, workloads: Sequence[Mapping[str, Any]]) -> int:
        """Make sure a WAITING workload trial exists for each of `workloads` (dicts with
        stage, family, problem, wl, fp, cls) under this run's settings; returns how many were
        added (0 when another process or an earlier run published them). Also fixes the
        run's start (`since`, for re-measure runs) the first time."""
        with self._locked("publish", self.settings):
            attr = f"run:{self.settings}"
            run = self.study.user_attrs.get(attr)
            if not isinstance(run, dict):
                run = {"created": _now()}
                self.study.set_user_attr(attr, run)
            have = {_ident_key(d) for _, d in self.snapshot() if d["kind"] == "workload"}
            new = []
            for w in workloads:
                d = {"kind": "workload", "settings": self.settings, **w}
                if _ident_key(d) not in have:
                    have.add(_ident_key(d))
                    new.append(d)
            self._add_waiting(new)
        self.run_created = str(run["created"])
        return len(new)

    def open_workload(self, item: Item, candidates: Sequence[Mapping[str, Any]]
                      ) -> dict[str, list[int]]:
        """Enqueue a claimed workload trial's fixed candidates as "variant" trials (those not
        enqueued by an earlier attempt); returns variant key -> its trial ids (a re-queued
        copy adds one)."""
        base = {k: item.ident[k] for k in ("settings", "stage", "family", "problem", "wl")}
        with self._locked("open", self.settings, item.stage, item.family, item.ident["wl"]):
            ids: dict[str, list[int]] = {}
            have: dict[str, list[int]] = {}
            for t, d in self.snapshot():
                if d["kind"] == "variant" and all(d.get(k) == v for k, v in base.items()):
                    have.setdefault(_ident_key(d), []).append(t._trial_id)
            new, order = [], []
            for c in candidates:
                d = {"kind": "variant", **base, **c, "owner": item.number}
                k = _ident_key(d)
                order.append((str(c["variant"]), k))
                if k not in have:
                    have[k] = []
                    new.append(d)
            for d, tid in zip(new, self._add_waiting(new)):
                have[_ident_key(d)].append(tid)
            for vkey, k in order:
                ids[vkey] = list(have[k])
        return ids

    # -- claiming work ---------------------------------------------------------------------------
    def claim(self, mine: set[tuple[str, str]], *, compiled: Set[str] = frozenset(),
              classes: Sequence[str] = (), deadline: float | None = None,
              should_stop: Any = None) -> Item | None:
        """Claim the next trial of this run's settings for one of the jobs in `mine`
        ((family, problem key) pairs). Order: cover-stage workload trials, then other
        workload trials whose cover stage is finished, then (stealing) other processes'
        variant trials; within each, those whose compile class (`classes`: this process's,
        most recent first) or compiled kernel (`compiled`) this process already has, then a
        per-process pseudo-random order (few collisions between processes). Waits while
        trials of `mine` are in flight elsewhere (they may finish, publish variant trials, or
        go stale and come back). None when nothing is left, or past `deadline` (time.time())."""
        from optuna.trial import TrialState

        rank = {c: i for i, c in enumerate(classes)}
        while True:
            if deadline is not None and time.time() > deadline:
                return None
            if should_stop is not None and should_stop():
                return None
            self.fail_stale()
            snap = self.snapshot()
            cover_state: dict[tuple[str, str], list[Any]] = {}
            for t, d in snap:
                if d["kind"] == "workload" and d.get("settings") == self.settings and \
                        d.get("stage") == "cover":
                    cover_state.setdefault((d["family"], d["problem"]), []).append(t.state)
            cands, pending = [], 0
            for t, d in snap:
                if d["kind"] not in ("workload", "variant") or \
                        d.get("settings") != self.settings or \
                        (d.get("family"), d.get("problem")) not in mine:
                    continue
                if t.state == TrialState.RUNNING:
                    pending += 1
                    continue
                if t.state != TrialState.WAITING:
                    continue
                if d["kind"] == "workload" and d["stage"] != "cover":
                    states = cover_state.get((d["family"], d["problem"]), [])
                    if any(s in (TrialState.WAITING, TrialState.RUNNING) for s in states):
                        pending += 1            # its cover stage is not finished yet
                        continue
                if d["kind"] == "workload":
                    tier = 0 if d["stage"] == "cover" else 1
                    near = (rank.get(str(d.get("cls")), len(rank)), 0)
                else:                   # another process's candidate: from the end of its list
                    tier, near = 2, (0 if d.get("ck") in compiled else 1, -int(d.get("pos", 0)))
                mix = hashlib.sha256(f"{self._salt}:{t.number}".encode()).hexdigest()
                cands.append(((tier, near, mix), t))
            cands.sort(key=lambda c: c[0])
            for _, t in cands:
                if self._take(t._trial_id):
                    return self._item(t)
            if not cands and pending == 0:
                return None
            time.sleep(self.cfg.poll_s)

    def _item(self, t: Any) -> Item:
        d = self._idents[t._trial_id] or {}
        hist = t.system_attrs.get("retry_history", [])
        strikes = {}
        raw = t.user_attrs.get("resgen_strikes")
        if isinstance(raw, str):
            with contextlib.suppress(TypeError, ValueError):
                strikes = {str(k): int(v) for k, v in json.loads(raw).items()}
        # The variant that was in flight when the previous attempt died gets a strike.
        inflight = t.user_attrs.get("resgen_inflight")
        if isinstance(inflight, str) and inflight and \
                t.system_attrs.get("failed_trial") is not None:
            strikes[inflight] = strikes.get(inflight, 0) + 1
            self.rdb.set_trial_user_attr(t._trial_id, "resgen_strikes", json.dumps(strikes))
        return Item(t._trial_id, t.number, d, len(hist) if isinstance(hist, list) else 0,
                    strikes)

    def struck(self, item: Item | None, variant_key: str) -> bool:
        """Whether `variant_key` was in flight in enough failed attempts of `item` to be
        given up (recorded as failed, not tried again)."""
        return item is not None and item.strikes.get(variant_key, 0) >= _STRIKES

    def mark_inflight(self, item: Item, variant_key: str | None) -> None:
        """Say which variant a workload search is running (a re-queued copy of the trial
        carries it, so a variant that keeps killing its process is given up)."""
        with contextlib.suppress(Exception):
            self.rdb.set_trial_user_attr(item.trial_id, "resgen_inflight", variant_key or "")

    def take_variant(self, trial_ids: Sequence[int]) -> tuple[str, int | None]:
        """The owner's claim of one candidate: ("mine", id) if it won a WAITING trial,
        ("done", id) if a trial of it finished, ("busy", None) if one is in flight elsewhere,
        ("lost", None) if every trial of it failed (re-queues used up)."""
        from optuna.trial import TrialState

        states = []
        for tid in trial_ids:
            try:
                states.append((tid, self.rdb.get_trial(tid).state))
            except Exception:
                continue
        for tid, st in states:
            if st == TrialState.COMPLETE:
                return "done", tid
        for tid, st in states:
            if st == TrialState.WAITING and self._take(tid):
                return "mine", tid
        if any(st in (TrialState.RUNNING, TrialState.WAITING) for _, st in states):
            return "busy", None
        return "lost", None

    def trial_state(self, trial_id: int) -> Any:
        return self.rdb.get_trial(trial_id).state

    def variant_value(self, trial_id: int) -> float | None:
        v = self.rdb.get_trial(trial_id).value
        return float(v) if v is not None and math.isfinite(v) else None

    def finish(self, trial_id: int, value: float | None) -> bool:
        """RUNNING -> COMPLETE with `value` (+inf when nothing was timed). False if the trial
        was meanwhile failed as stale (its re-queued copy then runs again: harmless, every
        evaluation it repeats is in the registry)."""
        from optuna.exceptions import UpdateFinishedTrialError
        from optuna.trial import TrialState

        with self._held_lock:
            self._held.discard(trial_id)
        v = float(value) if value is not None and math.isfinite(value) else math.inf
        try:
            return bool(self.rdb.set_trial_state_values(trial_id, TrialState.COMPLETE, [v]))
        except UpdateFinishedTrialError:
            log.warning("trial %d was failed as stale while this process ran it (raise "
                        "--coordinator-grace?)", trial_id)
            return False

    def release(self, trial_id: int) -> None:
        """Give a claimed trial back (time budget, Ctrl-C, a lost device): it is failed and a
        WAITING copy with the same attributes is queued (not counted as a retry)."""
        from optuna.exceptions import UpdateFinishedTrialError
        from optuna.trial import TrialState, create_trial

        with self._held_lock:
            self._held.discard(trial_id)
        try:
            t = self.rdb.get_trial(trial_id)
            if not self.rdb.set_trial_state_values(trial_id, TrialState.FAIL):
                return
        except UpdateFinishedTrialError:
            return                       # already failed as stale: its copy exists
        attrs = dict(t.user_attrs)
        attrs.pop("resgen_inflight", None)
        sysattrs = {k: copy.deepcopy(v) for k, v in t.system_attrs.items()
                    if k not in ("failed_trial",)}
        sysattrs["released_trial"] = t.number
        self.rdb.create_new_trial(self._sid, template_trial=create_trial(
            state=TrialState.WAITING, user_attrs=attrs, system_attrs=sysattrs))

    def progress(self, mine: set[tuple[str, str]]) -> dict[str, int]:
        """Counts of this run's trials (of `mine`) by state name."""
        out: dict[str, int] = {}
        for t, d in self.snapshot():
            if d["kind"] in ("workload", "variant") and d.get("settings") == self.settings and \
                    (d.get("family"), d.get("problem")) in mine:
                out[t.state.name] = out.get(t.state.name, 0) + 1
        return out

    def live_elsewhere(self) -> int:
        """RUNNING work trials of other run settings (another plan tuning in this
        environment right now)."""
        from optuna.trial import TrialState

        return sum(1 for t, d in self.snapshot() if d["kind"] in ("workload", "variant")
                   and d.get("settings") != self.settings and t.state == TrialState.RUNNING)


def probe(cfg: CoordinatorConfig, env: Environment) -> None:
    """Connect, open (or create) the environment's study and disconnect: CoordinatorError if
    the coordinator cannot be used (what `resgen tune` checks before anything runs)."""
    Coordinator(cfg, env, settings="probe").close()


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    msg = text[0] if text else ""
    return f"{type(e).__name__}: {msg}"[:400]


def run_settings(config: Any, warm_digest: str | None, run_tag: str | None) -> str:
    """The digest of what decides which variants a run's searches evaluate (TuneConfig
    fields, the warm-start table's content, the re-measure tag)."""
    keep = {k: getattr(config, k) for k in (
        "arch", "max_variants", "compile_only", "seed", "search", "coverage",
        "coverage_attempts", "warm_count", "preflight", "resume")}
    keep["policy"] = config.policy.as_dict()
    keep["warm_start"] = warm_digest
    keep["run_tag"] = run_tag
    return sha256_json(keep)[:20]


def file_digest(path: str | None) -> str | None:
    """sha256 of a file's bytes (the warm-start table: hosts may keep it at other paths)."""
    if not path:
        return None
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
