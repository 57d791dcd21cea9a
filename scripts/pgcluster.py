#!/usr/bin/env python3
"""A throwaway PostgreSQL cluster in a directory of its own: initdb, start on a free localhost
port, stop, remove. What the coordinator tests (tests/test_coordinator.py) and the multi-GPU
tuning script (bench/dist_tune_h200x2.sh) run `resgen tune --coordinator` against.

    python3 scripts/pgcluster.py start DIR [--bin BINDIR]   # prints the server's URL
    python3 scripts/pgcluster.py stop DIR                   # stops it and removes DIR

Binaries (initdb, pg_ctl, postgres): --bin, else $RESGEN_PG_BIN, else pg_ctl on PATH, else
the newest /usr/lib/postgresql/<version>/bin (Debian's `postgresql` package), else the
pgserver wheel's copy under /tmp/pg (bench/dist_tune_h200x2.sh unpacks it there).
PostgreSQL refuses to run as root; as root (CI, the GPU machine) the server runs as the
`postgres` user if it exists, else as `nobody`. The cluster trades durability for speed
(fsync off): it holds a tuning run's coordination, never the results themselves (those are in
each tuner's own SQLite database).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["Cluster", "find_bindir", "PgClusterError"]

PGSERVER_BIN = Path("/tmp/pg/pgserver/pginstall/bin")     # bench/dist_tune_h200x2.sh
USER = "resgen"                                              # the cluster's superuser
_INFO = "cluster.txt"                                        # DIR/cluster.txt: port, user


class PgClusterError(RuntimeError):
    """The cluster could not be made, started or stopped (the message says why)."""


def find_bindir(explicit: str | os.PathLike | None = None) -> Path | None:
    """The directory holding initdb, pg_ctl and postgres, or None (see the module docstring)."""
    cands: list[Path] = []
    for c in (explicit, os.environ.get("RESGEN_PG_BIN")):
        if c:
            cands.append(Path(c))
    on_path = shutil.which("pg_ctl")
    if on_path:
        cands.append(Path(on_path).resolve().parent)
    debian = Path("/usr/lib/postgresql")
    if debian.is_dir():
        def version(p: Path) -> tuple[int, ...]:
            try:
                return tuple(int(x) for x in p.name.split("."))
            except ValueError:
                return (0,)
        cands += [d / "bin" for d in sorted(debian.iterdir(), key=version, reverse=True)]
    cands.append(PGSERVER_BIN)
    for d in cands:
        if all((d / b).is_file() and os.access(d / b, os.X_OK)
               for b in ("initdb", "pg_ctl", "postgres")):
            return d
    return None


def _free_port() -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _server_user() -> str | None:
    """Who runs the server: None (this user) unless we are root."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        try:
            pwd.getpwnam(name)
            return name
        except KeyError:
            continue
    raise PgClusterError("running as root and neither a 'postgres' nor a 'nobody' user exists "
                         "(PostgreSQL refuses to run as root)")


class Cluster:
    """One throwaway cluster in `root` (created if missing; removed by stop())."""

    def __init__(self, root: str | os.PathLike, bindir: str | os.PathLike | None = None,
                 port: int | None = None, user: str | None = None) -> None:
        found = find_bindir(bindir)
        if found is None:
            raise PgClusterError(
                "PostgreSQL server binaries (initdb, pg_ctl, postgres) not found: install "
                "Debian's 'postgresql' package (apt-get install postgresql) or set "
                "RESGEN_PG_BIN to their directory")
        self.bindir = found
        self.root = Path(root)
        self.port = port
        self.user = user if user is not None else _server_user()

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def url(self) -> str:
        """The SQLAlchemy URL of the cluster's default database."""
        if self.port is None:
            raise PgClusterError(f"{self.root}: not started")
        return f"postgresql://{USER}@127.0.0.1:{self.port}/postgres"

    def _run(self, args: list[str], timeout: float = 120.0, check: bool = True
             ) -> subprocess.CompletedProcess:
        cmd = [str(self.bindir / args[0]), *args[1:]]
        if self.user is not None:
            runuser = shutil.which("runuser")
            cmd = ([runuser, "-u", self.user, "--", *cmd] if runuser else
                   ["setpriv", f"--reuid={self.user}", f"--regid={self.user}",
                    "--init-groups", *cmd])
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                                 stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise PgClusterError(f"{args[0]} took more than {timeout:.0f} s") from None
        if check and out.returncode != 0:
            tail = (out.stderr or out.stdout).strip().splitlines()[-3:]
            raise PgClusterError(f"{args[0]} failed (exit {out.returncode}): "
                                 + " | ".join(tail))
        return out

    def start(self, timeout: float = 60.0) -> "Cluster":
        """initdb (first time) and start on a free port; returns self."""
        self.root.mkdir(parents=True, exist_ok=True)
        if self.user is not None:
            pw = pwd.getpwnam(self.user)
            os.chown(self.root, pw.pw_uid, pw.pw_gid)
        if not (self.data / "PG_VERSION").exists():
            self._run(["initdb", "-D", str(self.data), "-U", USER, "--auth=trust",
                       "-E", "UTF8", "--locale=C", "--no-sync"], timeout=timeout)
        last = ""
        for _ in range(3):                  # a free port can be taken before the server binds
            self.port = self.port or _free_port()
            opts = (f"-p {self.port} -c listen_addresses=127.0.0.1 "
                    f"-c unix_socket_directories={self.root} -c fsync=off "
                    "-c synchronous_commit=off -c full_page_writes=off "
                    "-c max_connections=300 -c shared_buffers=32MB")
            out = self._run(["pg_ctl", "-D", str(self.data), "-o", opts, "-l",
                             str(self.root / "server.log"), "-w", "-t", str(int(timeout)),
                             "start"], timeout=timeout + 10, check=False)
            if out.returncode == 0:
                (self.root / _INFO).write_text(f"{self.port}\n{self.user or ''}\n")
                return self
            last = (out.stderr or out.stdout).strip().splitlines()[-1:] or [""]
            last = last[0]
            self.port = None
        log = self.root / "server.log"
        tail = log.read_text(errors="replace").strip().splitlines()[-2:] if log.exists() else []
        raise PgClusterError(f"pg_ctl start failed: {last} {' | '.join(tail)}")

    def stop(self, remove: bool = True) -> None:
        """Stop the server (fast shutdown; SIGKILL of the postmaster if that fails) and remove
        the directory. Safe to call twice, or on a cluster that never started."""
        try:
            if (self.data / "postmaster.pid").exists():
                out = self._run(["pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "-t",
                                 "30", "stop"], timeout=45, check=False)
                if out.returncode != 0:
                    self._kill()
        finally:
            if remove:
                shutil.rmtree(self.root, ignore_errors=True)

    def _kill(self) -> None:
        try:
            pid = int((self.data / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        for _ in range(50):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)

    def running(self) -> bool:
        """Whether the postmaster of this cluster is alive."""
        try:
            pid = int((self.data / "postmaster.pid").read_text().split()[0])
            os.kill(pid, 0)
            return True
        except (OSError, ValueError, IndexError):
            return False

    @classmethod
    def attach(cls, root: str | os.PathLike, bindir: str | None = None) -> "Cluster":
        """The cluster `start` made in `root` (its port and user from root/cluster.txt)."""
        info = (Path(root) / _INFO).read_text().splitlines()
        c = cls(root, bindir, port=int(info[0]), user=(info[1] or None) if len(info) > 1
                else None)
        return c

    def __enter__(self) -> "Cluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def temp_root() -> Path:
    """A fresh directory under the system temp dir (short: the server's Unix socket path
    must stay under 107 characters)."""
    return Path(tempfile.mkdtemp(prefix="resgen-pg-", dir="/tmp" if Path("/tmp").is_dir()
                                 else None))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("action", choices=["start", "stop"])
    p.add_argument("dir", type=Path)
    p.add_argument("--bin", default=None, help="directory of initdb, pg_ctl, postgres")
    a = p.parse_args(argv)
    try:
        if a.action == "start":
            print(Cluster(a.dir, a.bin).start().url)
        else:
            if (a.dir / _INFO).exists():
                Cluster.attach(a.dir, a.bin).stop()
            else:
                shutil.rmtree(a.dir, ignore_errors=True)
    except PgClusterError as e:
        print(f"pgcluster: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
