#!/usr/bin/env bash
# The presum fold of linear_sm90_wgmma (issue 20 section 1) on one H200 in one device call,
# about 6-8 minutes: (1) its GPU tests (tests/gpu/test_linear_sm90_wgmma_presum_gpu.py: the
# presum quantizer bit-exact, Qwen3-8B shapes at M = 64 / 128 / 2048 against
# reference.linear(fold="presum") and the exact fold, the FP16 rounding case, graph replay)
# and the existing wgmma layer / PDL / graph tests (the launcher changed), (2)
# bench/probes/wgmma_presum_probe.py: table exact fold, its presum twin, plain's table
# variant and ITS presum twin, whole layers. Run from the repository root with .devcache
# carried (scripts/devcache.sh):
#
#     bash bench/wgmma_presum_h200.sh    # device: nvidia-h200, carry [".devcache"], timeout_s 600
#
# Everything lands in $OUT (default /tmp/resgen-out): gpu_tests_wgmma_presum.{xml,log},
# gpu_tests_wgmma_layer.{xml,log}, wgmma_presum_probe.{json,log}.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/resgen-out}
mkdir -p "$OUT"
export OUT PYTHONUNBUFFERED=1
# shellcheck disable=SC1091
source .devcache/device/env.sh || { echo "no .devcache/device/env.sh: carry .devcache"; exit 2; }
export RESGEN_CACHE_DIR=/tmp/resgen-cache
RC=0

# 1. Correctness first.
timeout -k 10 200 python3 -m pytest -q -p no:cacheprovider -x \
    tests/gpu/test_linear_sm90_wgmma_presum_gpu.py --junitxml "$OUT/gpu_tests_wgmma_presum.xml" \
    > "$OUT/gpu_tests_wgmma_presum.log" 2>&1
T=$?
echo "gpu tests (tests/gpu/test_linear_sm90_wgmma_presum_gpu.py): rc=$T"
tail -n 8 "$OUT/gpu_tests_wgmma_presum.log"
[ "$T" -ne 0 ] && RC=$T
timeout -k 10 100 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_linear_sm90_wgmma_gpu.py \
    -k "whole_layer or pdl or graph" --junitxml "$OUT/gpu_tests_wgmma_layer.xml" \
    > "$OUT/gpu_tests_wgmma_layer.log" 2>&1
T=$?
echo "gpu tests (wgmma layer / PDL / graph): rc=$T"
tail -n 3 "$OUT/gpu_tests_wgmma_layer.log"
[ "$T" -ne 0 ] && RC=$T

# 2. Presum against the table's exact fold and plain, whole layers (JSON after every variant).
timeout -k 5 -s INT "${RESGEN_PROBE_S:-270}" python3 bench/probes/wgmma_presum_probe.py \
    > "$OUT/wgmma_presum_probe.log" 2>&1
T=$?
echo "wgmma_presum_probe: rc=$T"
tail -n 8 "$OUT/wgmma_presum_probe.log"
[ "$T" -ne 0 ] && RC=$T
exit "$RC"
