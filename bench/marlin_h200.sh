#!/usr/bin/env bash
# vLLM's Marlin W4A16 and the two fair FP8 W8A8 forms as `resgen bench` baselines, on one
# H200. First, here: bash bench/marlin_setup.sh (builds the ignored .peers/marlin/, 0.5 MB).
#
# One device call (carry [".devcache", ".peers"]: about 62-63.5 MiB with the 12-13 MiB tree,
# close to the 64 MiB limit: the two-call form below is the safe one):
#   bash bench/marlin_h200.sh all                # timeout_s 600, about 7-9 min
# or two back-to-back calls (/tmp survives between calls on a warm machine):
#   bash bench/marlin_h200.sh tests              # carry [".peers"], timeout_s 300, ~1-2 min
#   bash bench/marlin_h200.sh bench              # carry [".devcache"], timeout_s 600, ~6-8 min
#
# tests: copies the library to /tmp/marlin, runs tests/gpu/test_baselines_gpu.py (Marlin NVFP4 /
#        MXFP4 and both rowwise FP8 forms against their references at Qwen3-8B's shapes,
#        M = 1, 16, 64, 128); needs no CuTe DSL.
# bench: resgen bench, Qwen3-8B, M = 1, 16, 64, 128, plain and W4A16, NVFP4 then MXFP4, every
#        baseline per layer and the per-M sums; Marlin from /tmp/marlin (without it the bench
#        says why and times the rest).
# Everything lands in $OUT (default /tmp/resgen-out): gpu_tests_baselines.{xml,log},
# bench_marlin_{nvfp4,mxfp4}.{json,log}. RESGEN_MARLIN_M overrides the M list; T_TESTS /
# T_BENCH the per-step time limits. The two-call form leaves more time per bench (a bench
# killed by its limit writes no JSON).
set -u
cd "$(dirname "$0")/.." || exit 2
# shellcheck source=bench/h200_lib.sh
source bench/h200_lib.sh
h200_setup
LIBDIR=/tmp/marlin
MS=${RESGEN_MARLIN_M:-1,16,64,128}
# per-step limits (s): alone, tests 280 and each bench 270; in `all`, 150 and 215 (600 in all)
if [ "${1:-}" = all ]; then T_TESTS=${T_TESTS:-150}; T_BENCH=${T_BENCH:-215}
else T_TESTS=${T_TESTS:-280}; T_BENCH=${T_BENCH:-270}; fi
run_tests() {
    if [ -f .peers/marlin/libmarlin_fp4_sm90a.so ]; then
        mkdir -p "$LIBDIR" && cp .peers/marlin/* "$LIBDIR/"
    fi
    cat "$LIBDIR/build.json" 2>/dev/null || echo "no Marlin library: carry .peers (bench/marlin_setup.sh)"
    RESGEN_MARLIN_LIB="$LIBDIR/libmarlin_fp4_sm90a.so" timeout -k 10 "$T_TESTS" python3 -m pytest -q \
        -p no:cacheprovider tests/gpu/test_baselines_gpu.py \
        --junitxml "$OUT/gpu_tests_baselines.xml" > "$OUT/gpu_tests_baselines.log" 2>&1
    local RC=$?
    echo "gpu tests (tests/gpu/test_baselines_gpu.py): rc=$RC"
    tail -n 25 "$OUT/gpu_tests_baselines.log"
    return $RC
}
run_bench() {
    h200_cute
    export RESGEN_MARLIN_LIB="$LIBDIR/libmarlin_fp4_sm90a.so"
    local RC=0 T FMT
    for FMT in nvfp4 mxfp4; do
        timeout -k 10 "$T_BENCH" python3 -m resgen bench --model qwen3-8b --m "$MS" --formats "$FMT" \
            --compensations none,w4a16 --out "$OUT/bench_marlin_$FMT.json" \
            > "$OUT/bench_marlin_$FMT.log" 2>&1
        T=$?
        echo "bench $FMT: rc=$T"
        grep -E '^(sum|note)' "$OUT/bench_marlin_$FMT.log" || tail -n 20 "$OUT/bench_marlin_$FMT.log"
        [ "$T" -ne 0 ] && RC=$T
    done
    return $RC
}
case "${1:-}" in
tests) run_tests ;;
bench) run_bench ;;
all)
    run_tests
    A=$?
    run_bench
    B=$?
    [ "$A" -ne 0 ] && exit "$A"
    exit "$B"
    ;;
*)
    echo "usage: bash bench/marlin_h200.sh tests|bench|all (see the header)" >&2
    exit 2
    ;;
esac
