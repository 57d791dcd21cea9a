#!/usr/bin/env bash
# What every bench/*_h200.sh device script shares, sourced (not run) from the repository root:
#
#     cd "$(dirname "$0")/.." && source bench/h200_lib.sh && h200_setup && h200_cute
#
# h200_setup: $OUT (default /tmp/resgen-out) made and exported, PYTHONUNBUFFERED=1,
#   RESGEN_CACHE_DIR (default /tmp/resgen-cache), H200_RC=0 (the script's exit code so far).
# h200_cute: CuTe DSL from the carried .devcache (scripts/devcache.sh), or exit 2 saying so.
# h200_step NAME LIMIT_S TAIL CMD...: CMD under `timeout -s INT` (a probe or pytest then writes
#   what it has; SIGKILL 10 s later), stdout and stderr to $OUT/NAME.log; prints "NAME: rc=N"
#   and the log's last TAIL lines; a non-zero rc becomes H200_RC and is returned.
# h200_pytest NAME LIMIT_S TAIL PYTEST_ARGS...: h200_step of `python3 -m pytest -q` with JUnit
#   XML to $OUT/NAME.xml.
# A script ends with `exit "$H200_RC"`.

h200_setup() {
    OUT=${OUT:-/tmp/resgen-out}
    mkdir -p "$OUT" || exit 2
    export OUT PYTHONUNBUFFERED=1
    export RESGEN_CACHE_DIR=${RESGEN_CACHE_DIR:-/tmp/resgen-cache}
    H200_RC=0
}

h200_cute() {
    # shellcheck disable=SC1091
    source .devcache/device/env.sh || {
        echo "no .devcache/device/env.sh: carry .devcache (scripts/devcache.sh)"; exit 2; }
}

h200_step() {
    local name=$1 limit=$2 tail_n=$3 rc
    shift 3
    timeout -k 10 -s INT "$limit" "$@" > "$OUT/$name.log" 2>&1
    rc=$?
    echo "$name: rc=$rc"
    tail -n "$tail_n" "$OUT/$name.log"
    [ "$rc" -ne 0 ] && H200_RC=$rc
    return "$rc"
}

h200_pytest() {
    local name=$1 limit=$2 tail_n=$3
    shift 3
    h200_step "$name" "$limit" "$tail_n" python3 -m pytest -q -p no:cacheprovider \
        --junitxml "$OUT/$name.xml" "$@"
}
