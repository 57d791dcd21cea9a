#!/usr/bin/env bash
# Makes .devcache (ignored): the CuTe DSL / optuna / sqlite-utils bundle the GPU machine needs,
# copied from ../shared/device (or $1), without the wheels of optuna's relational storage
# (sqlalchemy, greenlet, alembic, mako: 5.5 MB). resgen's tuner only makes in-memory optuna
# studies, which never import them, and one device call carries at most 64 MiB: the tracked
# tree plus this folder (tests/test_repo_footprint.py keeps the tree's share in check).
#
#     scripts/devcache.sh            # then carry [".devcache"] and `source .devcache/device/env.sh`
#
# DEVCACHE_DEST overrides the destination (default .devcache in the project root).
set -euo pipefail
cd "$(dirname "$0")/.."
src=${1:-../shared/device}
dest=${DEVCACHE_DEST:-.devcache}
[ -f "$src/env.sh" ] || { echo "devcache: $src/env.sh not found" >&2; exit 2; }
rm -rf "$dest"
mkdir -p "$dest"
cp -r "$src" "$dest/device"
rm -f "$dest"/device/wheels/sqlalchemy-*.whl "$dest"/device/wheels/greenlet-*.whl \
      "$dest"/device/wheels/alembic-*.whl "$dest"/device/wheels/mako-*.whl
du -sk "$dest" | awk '{printf "devcache: %s holds %.1f MiB of disk\n", $2, $1 / 1024}'
