#!/usr/bin/env bash
# vLLM's Marlin W4A16 and the two fair FP8 W8A8 forms as `resgen bench` baselines, on one
# H200 in two back-to-back device calls (the Marlin library and .devcache do not fit in one
# 64 MiB carry together; /tmp survives between calls on a warm machine):
#
#   here:    bash bench/marlin_setup.sh          # builds the ignored .peers/marlin/ (2 MB)
#   call A:  bash bench/marlin_h200.sh tests     # carry [".peers"], timeout_s 300, ~1-2 min
#            copies the library to /tmp/marlin, runs tests/gpu/test_baselines_gpu.py (Marlin
#            NVFP4 / MXFP4 and both rowwise FP8 forms against their references at Qwen3-8B's
#            shapes, M = 1, 16, 64, 128); needs no CuTe DSL
#   call B:  bash bench/marlin_h200.sh bench     # carry [".devcache"], timeout_s 600, ~6-8 min
#            resgen bench, Qwen3-8B, M = 1, 16, 64, 128, plain and W4A16, NVFP4 then MXFP4,
#            every baseline per layer and per-M sums, Marlin from /tmp/marlin (without it the
#            bench says why and times the rest)
#
# Everything lands in $OUT (default /tmp/resgen-out): gpu_tests_baselines.{xml,log},
# bench_marlin_{nvfp4,mxfp4}.{json,log}. RESGEN_MARLIN_M overrides the M list.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/resgen-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
LIBDIR=/tmp/marlin
MS=${RESGEN_MARLIN_M:-1,16,64,128}
case "${1:-}" in
tests)
    if [ -f .peers/marlin/libmarlin_fp4_sm90a.so ]; then
        mkdir -p "$LIBDIR" && cp .peers/marlin/* "$LIBDIR/"
    fi
    cat "$LIBDIR/build.json" 2>/dev/null || echo "no Marlin library: carry .peers (bench/marlin_setup.sh)"
    RESGEN_MARLIN_LIB="$LIBDIR/libmarlin_fp4_sm90a.so" timeout -k 10 280 python3 -m pytest -q \
        -p no:cacheprovider tests/gpu/test_baselines_gpu.py \
        --junitxml "$OUT/gpu_tests_baselines.xml" > "$OUT/gpu_tests_baselines.log" 2>&1
    RC=$?
    echo "gpu tests (tests/gpu/test_baselines_gpu.py): rc=$RC"
    tail -n 25 "$OUT/gpu_tests_baselines.log"
    exit $RC
    ;;
bench)
    # shellcheck disable=SC1091
    source .devcache/device/env.sh || { echo "no .devcache/device/env.sh: carry .devcache"; exit 2; }
    export RESGEN_CACHE_DIR=/tmp/resgen-cache RESGEN_MARLIN_LIB="$LIBDIR/libmarlin_fp4_sm90a.so"
    RC=0
    for FMT in nvfp4 mxfp4; do
        timeout -k 10 270 python3 -m resgen bench --model qwen3-8b --m "$MS" --formats "$FMT" \
            --compensations none,w4a16 --out "$OUT/bench_marlin_$FMT.json" \
            > "$OUT/bench_marlin_$FMT.log" 2>&1
        T=$?
        echo "bench $FMT: rc=$T"
        grep -E '^(sum|note)' "$OUT/bench_marlin_$FMT.log" || tail -n 20 "$OUT/bench_marlin_$FMT.log"
        [ "$T" -ne 0 ] && RC=$T
    done
    exit $RC
    ;;
*)
    echo "usage: bash bench/marlin_h200.sh tests|bench (see the header)" >&2
    exit 2
    ;;
esac
