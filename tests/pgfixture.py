"""A real PostgreSQL server for the coordinator tests: one throwaway cluster per test module
(scripts/pgcluster.py: initdb + pg_ctl in a temporary directory, on a free localhost port),
a fresh database per test, the server stopped and its directory removed at the end even when
a test fails (and at interpreter exit if pytest itself is stopped).

Without the PostgreSQL server binaries the tests FAIL, they do not skip: CI must run them
(.ci/run installs Debian's `postgresql` when initdb is missing)."""

from __future__ import annotations

import atexit
import importlib.util
import itertools
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load_pgcluster():
    spec = importlib.util.spec_from_file_location("resgen_pgcluster",
                                                  ROOT / "scripts" / "pgcluster.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["resgen_pgcluster"] = mod
    spec.loader.exec_module(mod)
    return mod


pgcluster = _load_pgcluster()
_counter = itertools.count()


@pytest.fixture(scope="module")
def pg_server():
    """A running throwaway cluster (stopped and removed after the module)."""
    try:
        cluster = pgcluster.Cluster(pgcluster.temp_root())
    except pgcluster.PgClusterError as e:
        pytest.fail(f"the coordinator tests need a PostgreSQL server: {e}")
    stop = atexit.register(cluster.stop)
    try:
        cluster.start()
    except pgcluster.PgClusterError as e:
        cluster.stop()
        pytest.fail(f"could not start a throwaway PostgreSQL cluster: {e}")
    try:
        yield cluster
    finally:
        cluster.stop()
        atexit.unregister(stop)
    assert not cluster.running(), "the PostgreSQL server is still running"


@pytest.fixture
def pg_url(pg_server):
    """The URL of a fresh, empty database on the module's server (dropped afterwards)."""
    import psycopg

    name = f"t{next(_counter)}"
    base = f"host=127.0.0.1 port={pg_server.port} user={pgcluster.USER} dbname=postgres"
    with psycopg.connect(base, autocommit=True) as c:
        c.execute(f"CREATE DATABASE {name}")
    yield f"postgresql://{pgcluster.USER}@127.0.0.1:{pg_server.port}/{name}"
    with psycopg.connect(base, autocommit=True) as c:
        c.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
