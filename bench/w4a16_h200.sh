#!/usr/bin/env bash
# W4A16 (compensation "w4a16": BF16 activations, the plain FP4 kernels) on one H200 in one
# device call, about 5 minutes: (1) its GPU tests, (2) a short tune of Qwen3-8B's W4A16
# linear workloads (warm-started from the shipped table's plain rows), (3) resgen bench of
# plain W4A4 against W4A16 on the same layers from that table. Run from the repository root
# with .devcache carried (scripts/devcache.sh):
#
#     bash bench/w4a16_h200.sh        # device: nvidia-h200, carry [".devcache"], timeout_s 600
#
# Everything lands in $OUT (default /tmp/resgen-out): gpu_tests_w4a16.{xml,log},
# w4a16.sqlite + w4a16_tune.{json,log}, bench_w4a16.{json,log}. Environment:
# RESGEN_W4A16_TESTS (1: run the GPU tests first, default), RESGEN_W4A16_BUDGET (tuning
# seconds, default 120), RESGEN_W4A16_FORMATS (default nvfp4), RESGEN_W4A16_M (M buckets and
# bench rows, default 1,16,64,128).
set -u
cd "$(dirname "$0")/.." || exit 2
# shellcheck source=bench/h200_lib.sh
source bench/h200_lib.sh
h200_setup
h200_cute
BUDGET=${RESGEN_W4A16_BUDGET:-120}
FORMATS=${RESGEN_W4A16_FORMATS:-nvfp4}
MS=${RESGEN_W4A16_M:-1,16,64,128}

# 1. Correctness first: the served W4A16 layers against resgen.reference.linear_w4a16.
if [ "${RESGEN_W4A16_TESTS:-1}" = "1" ]; then
    h200_pytest gpu_tests_w4a16 240 5 tests/gpu/test_w4a16_gpu.py
fi

# 2. Tune the W4A16 workloads (the plain twins' timed variants are tried first: xop ones,
#    and fused ones with the W4A16 copy prologue); the progress lines stay in the log.
h200_step w4a16_tune $((BUDGET + 90)) 0 python3 -m resgen tune --model qwen3-8b --ops linear \
    --compensations w4a16 --formats "$FORMATS" --m-buckets "$MS" --db "$OUT/w4a16.sqlite" \
    --time-budget "$BUDGET" --hard-stop 30 --warm-start tuned/h200.sqlite.xz \
    --json "$OUT/w4a16_tune.json"
grep -v -E '^tune: [0-9]+/[0-9]+ workloads' "$OUT/w4a16_tune.log" | tail -n 12

# 3. Plain W4A4 (shipped table) against W4A16 (the new rows), whole layers, one run.
RESGEN_DB="$OUT/w4a16.sqlite" h200_step bench_w4a16 240 45 python3 -m resgen bench \
    --model qwen3-8b --m "$MS" --formats "$FORMATS" --compensations none,w4a16 \
    --out "$OUT/bench_w4a16.json"
exit "$H200_RC"
