#!/usr/bin/env bash
# Issue 24's GPU check on nvidia-h200-x2: `resgen tune` for qwen3-8b on one GPU, then on both
# GPUs of the host against one coordinator (a throwaway PostgreSQL cluster started on the
# host), the two databases merged: wall time vs one GPU, and the merged table's coverage vs the
# single-GPU table's (bench/dist_tune.py does the work; JSON and logs in $OUT).
#
# One device call carries at most 64 MiB: the CuTe DSL bundle (.devcache, scripts/devcache.sh,
# 49.8 MiB) and the coordinator's wheels and server (.distcache, scripts/distcache.sh,
# 13 MiB) do not travel together with the tree, so the check takes two calls on one machine,
# the second right after the first (a warm machine keeps /tmp and the carried .devcache):
#
#     call 1, kind nvidia-h200-x2, carry [".devcache"]:   bash bench/dist_tune_h200x2.sh baseline
#     call 2, same machine,         carry [".distcache"]:  bash bench/dist_tune_h200x2.sh distributed
#
# Environment: RESGEN_DIST_ARGS (extra `resgen tune` arguments), RESGEN_DIST_BUDGET (each
# tune's --time-budget, default 420 s: not meant to bind).
set -u
cd "$(dirname "$0")/.."
phase=${1:-all}
OUT=${OUT:-/tmp/resgen-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# shellcheck disable=SC1091
source .devcache/device/env.sh || {
    echo "no .devcache/device/env.sh: call 1 carries .devcache; call 2 must reach the same,"\
         "still warm machine (a fresh one starts bare: run both calls again)"; exit 2; }
if [ "$phase" != baseline ]; then
    [ -f .distcache/pg.tar.xz ] || { echo "no .distcache: make it with scripts/distcache.sh"\
                                          "and carry it"; exit 2; }
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
        .distcache/wheels/*.whl || exit 2
    mkdir -p /tmp/pg && tar xJf .distcache/pg.tar.xz -C /tmp/pg || exit 2
    python3 -c "import sqlalchemy, psycopg, optuna.storages" || exit 2
fi
nvidia-smi --query-gpu=index,name,memory.used --format=csv,noheader || true
python3 bench/dist_tune.py --phase "$phase" --gpus 2 --model qwen3-8b \
    --budget "${RESGEN_DIST_BUDGET:-420}" --tune-args "${RESGEN_DIST_ARGS:-}" --out "$OUT" \
    --work /tmp/resgen-dist
