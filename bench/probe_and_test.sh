#!/usr/bin/env bash
# One device call that checks a kernel change before it is merged: a probe (a bench/*.py that
# checks and times variants, JSON to $OUT) and a GPU test file, side by side on two GPUs when
# the machine has two (nvidia-h200-x2: the probe on GPU 0, the tests on GPU 1), one after the
# other otherwise; then compute-sanitizer memcheck of tests/gpu/sanitize_families.py. Logs,
# JUnit XML and the probe's JSON land in $OUT; the tails are printed last.
#
#     bash bench/probe_and_test.sh bench/probes/prologue_probe.py tests/gpu/test_linear_sm90_mma_gpu.py run10
#
# (device: carry [".devcache"]). Time limits: PROBE_S (default 170), TESTS_S (300),
# MEMCHECK_S (100) seconds: 570 s one after the other, inside one call's 600.
set -u
cd "$(dirname "$0")/.." || exit 2
[ $# -ge 2 ] || { echo "usage: $0 PROBE.py TEST_FILE [TAG]" >&2; exit 2; }
PROBE=$1
TESTS=$2
TAG=${3:-run}
# shellcheck source=bench/h200_lib.sh
source bench/h200_lib.sh
h200_setup
h200_cute
NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
NAME=$(basename "$PROBE" .py)

run_probe() {
    CUDA_VISIBLE_DEVICES=0 timeout -k 5 -s INT "${PROBE_S:-170}" python3 "$PROBE" \
        > "$OUT/$NAME.log" 2>&1
    local rc=$?
    echo "probe rc=$rc" >> "$OUT/$NAME.log"
    return $rc
}
run_tests() {
    CUDA_VISIBLE_DEVICES=$1 timeout -k 5 "${TESTS_S:-300}" python3 -m pytest -q -m gpu \
        -p no:cacheprovider "$TESTS" --junitxml="$OUT/gpu_tests_$TAG.xml" \
        > "$OUT/gpu_tests_$TAG.log" 2>&1
    local rc=$?
    echo "pytest rc=$rc" >> "$OUT/gpu_tests_$TAG.log"
    return $rc
}

if [ "$NGPU" -ge 2 ]; then
    run_probe &
    PID=$!
    run_tests 1
    TRC=$?
    wait "$PID"
    PRC=$?
else
    run_probe
    PRC=$?
    run_tests 0
    TRC=$?
fi
CUDA_VISIBLE_DEVICES=0 timeout -k 5 "${MEMCHECK_S:-100}" compute-sanitizer --tool memcheck \
    --error-exitcode 9 --log-file "$OUT/memcheck_$TAG.log" \
    python3 tests/gpu/sanitize_families.py > "$OUT/memcheck_${TAG}_stdout.txt" 2>&1
MRC=$?
echo "memcheck rc=$MRC" >> "$OUT/memcheck_${TAG}_stdout.txt"

echo "== $NAME ($NGPU GPU(s))"; tail -n 40 "$OUT/$NAME.log"
echo "== $TESTS"; tail -n 6 "$OUT/gpu_tests_$TAG.log"
echo "== memcheck"; tail -n 8 "$OUT/memcheck_${TAG}_stdout.txt"
[ -f "$OUT/memcheck_$TAG.log" ] && tail -n 2 "$OUT/memcheck_$TAG.log"
# non-zero if any step failed (each step's own code is in its log)
exit $(( PRC != 0 || TRC != 0 || MRC != 0 ))
