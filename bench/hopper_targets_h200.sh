#!/usr/bin/env bash
# One device call for issue 20's target table (bench/report/hopper_targets.py reads what it
# writes): optionally some GPU test files first (side by side, bench/gpu_tests_all.sh), then
# `resgen bench` per model on the shipped table, NVFP4, plain / full M-Ext / W4A16 at the
# decode and prefill M, with every baseline `resgen bench` times (cuBLAS BF16, the five FP8
# W8A8 forms, Marlin W4A16 when .peers/marlin is carried, the HBM floor). The timing runs only
# after the tests have finished, so they do not share the GPU.
#
#     TESTS="tests/gpu/test_baselines_gpu.py ..." MODELS=qwen3-8b bash bench/hopper_targets_h200.sh
#
# (device: carry [".devcache", ".peers/marlin"]). Variables: TAG (file names, default s30),
# MODELS (comma-separated, default qwen3-8b), MS (default 1,16,64,128,256,512,2048), COMPS
# (default none,full,w4a16), KEXT_FOLDS (K-Ext folds for K-Ext ratios in COMPS, default
# exact; e.g. exact,presum), TESTS (default none), TEST_S (seconds per test file, 300),
# BENCH_S (seconds per model's bench, default 590).
# Writes $OUT/bench_TAG_MODEL.json and .log per model (and the tests' two files).
set -u
cd "$(dirname "$0")/.." || exit 2
# shellcheck source=bench/h200_lib.sh
source bench/h200_lib.sh
h200_setup
h200_cute
TAG=${TAG:-s30}
MS=${MS:-1,16,64,128,256,512,2048}
COMPS=${COMPS:-none,full,w4a16}
KEXT_FOLDS=${KEXT_FOLDS:-exact}
if [ -n "${TESTS:-}" ]; then
    # shellcheck disable=SC2086
    TEST_S=${TEST_S:-300} bash bench/gpu_tests_all.sh "$TAG" $TESTS
fi
MODELS=${MODELS:-qwen3-8b}
for m in ${MODELS//,/ }; do
    t0=$(date +%s)
    h200_step "bench_${TAG}_$m" "${BENCH_S:-590}" 0 python3 -m resgen bench --model "$m" \
        --m "$MS" --formats nvfp4 --compensations "$COMPS" --kext-folds "$KEXT_FOLDS" \
        --out "$OUT/bench_${TAG}_$m.json"
    echo "bench $m: $(( $(date +%s) - t0 )) s" | tee -a "$OUT/bench_${TAG}_$m.log"
    grep '^sum ' "$OUT/bench_${TAG}_$m.log" | cut -c1-220
done
exit "$H200_RC"
