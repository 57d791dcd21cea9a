#!/usr/bin/env bash
# Makes .distcache (ignored): what `resgen tune --coordinator` needs on the GPU machine beyond
# .devcache (scripts/devcache.sh), for bench/dist_tune_h200x2.sh:
# - wheels/: optuna's relational-storage stack that devcache.sh leaves out (sqlalchemy,
#   greenlet, alembic, mako, from ../shared/device/wheels or $1) and psycopg 3 for CPython
#   3.12 (pip download);
# - pg.tar.xz: a PostgreSQL 16 server (initdb, pg_ctl, postgres, PL/pgSQL, the snowball
#   dictionaries initdb loads, share/) taken from the pgserver wheel, whose manylinux build
#   needs only libc and zlib; bench/dist_tune_h200x2.sh unpacks it into /tmp/pg, where
#   scripts/pgcluster.py finds it.
# About 14 MiB: too much to travel with .devcache (49.8 MiB) and the tracked tree in one
# device call, so the check takes two calls (see bench/dist_tune_h200x2.sh).
#
#     scripts/distcache.sh [SHARED_DEVICE_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
src=${1:-../shared/device}
dest=${DISTCACHE_DEST:-.distcache}
py=${PYTHON:-python3}
[ -d "$src/wheels" ] || { echo "distcache: $src/wheels not found" >&2; exit 2; }
rm -rf "$dest"
mkdir -p "$dest/wheels"
for w in sqlalchemy greenlet alembic mako; do
  cp "$src"/wheels/"$w"-*.whl "$dest/wheels/"
done
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$dest/wheels" \
  psycopg==3.3.9 psycopg-binary==3.3.9 pgserver==0.1.4
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$py" -m zipfile -e "$dest"/wheels/pgserver-*.whl "$tmp/whl"
rm -f "$dest"/wheels/pgserver-*.whl
b=pgserver/pginstall                  # the binaries' RPATH is $ORIGIN/../../../pgserver.libs
mkdir -p "$tmp/min/$b/bin" "$tmp/min/$b/lib/postgresql" "$tmp/min/pgserver.libs"
for f in postgres initdb pg_ctl; do
  cp "$tmp/whl/$b/bin/$f" "$tmp/min/$b/bin/" && chmod +x "$tmp/min/$b/bin/$f"
done
cp "$tmp/whl/$b/lib/postgresql/plpgsql.so" "$tmp/whl/$b/lib/postgresql/dict_snowball.so" \
   "$tmp/min/$b/lib/postgresql/"
cp -r "$tmp/whl/$b/share" "$tmp/min/$b/"
rm -rf "$tmp/min/$b/share/postgresql/extension/vector"*
cp "$tmp"/whl/pgserver.libs/libpq-*.so* "$tmp/min/pgserver.libs/"
tar cJf "$dest/pg.tar.xz" -C "$tmp/min" .
du -sk "$dest" | awk '{printf "distcache: %s holds %.1f MiB of disk\n", $2, $1 / 1024}'
