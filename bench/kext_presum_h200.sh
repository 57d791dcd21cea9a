#!/usr/bin/env bash
# K-Ext presum (LinearProblem fold "presum", issue 20 section 1) on one H200 in one device
# call, about 7 minutes: (1) its GPU tests (tests/gpu/test_kext_presum_gpu.py: both Hopper
# families' presum variants behind the real K-Ext presum quantizer, Qwen3-8B shapes, against
# reference.linear(ratio, fold="presum"); resgen.ops.Linear(fold="presum") and its graph
# replay), (2) the dispatched-layer GPU tests on the shipped table (tests/gpu/test_ops_gpu.py),
# (3) bench/probes/kext_presum_probe.py: K-Ext presum vs the exact K-Ext fold vs plain, whole
# layers. Run from the repository root with .devcache carried (scripts/devcache.sh):
#
#     bash bench/kext_presum_h200.sh       # device: nvidia-h200, carry [".devcache"]
#
# Everything lands in $OUT (default /tmp/resgen-out): gpu_tests_kext_presum.{xml,log},
# gpu_tests_ops.{xml,log}, kext_presum_probe.{json,log}. TEST_S / OPS_S / PROBE_S: each step's
# time limit (default 200 / 100 / 150 s; the probe gets SIGINT, then writes its summary).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/resgen-out}
mkdir -p "$OUT"
export OUT PYTHONUNBUFFERED=1
# shellcheck disable=SC1091
source .devcache/device/env.sh || { echo "no .devcache/device/env.sh: carry .devcache"; exit 2; }
export RESGEN_CACHE_DIR=${RESGEN_CACHE_DIR:-/tmp/resgen-cache}
RC=0
timeout -k 10 "${TEST_S:-200}" python3 -m pytest -q -p no:cacheprovider \
    tests/gpu/test_kext_presum_gpu.py --junitxml "$OUT/gpu_tests_kext_presum.xml" \
    > "$OUT/gpu_tests_kext_presum.log" 2>&1
T=$?
echo "gpu tests (tests/gpu/test_kext_presum_gpu.py): rc=$T"
tail -n 6 "$OUT/gpu_tests_kext_presum.log"
[ "$T" -ne 0 ] && RC=$T
timeout -k 10 "${OPS_S:-100}" python3 -m pytest -q -p no:cacheprovider tests/gpu/test_ops_gpu.py \
    -k "dispatched_layer or graph_of_warmed or fp4linear" --junitxml "$OUT/gpu_tests_ops.xml" \
    > "$OUT/gpu_tests_ops.log" 2>&1
T=$?
echo "gpu tests (tests/gpu/test_ops_gpu.py, dispatched layers): rc=$T"
tail -n 3 "$OUT/gpu_tests_ops.log"
[ "$T" -ne 0 ] && RC=$T
timeout -k 5 -s INT "${PROBE_S:-150}" python3 bench/probes/kext_presum_probe.py \
    > "$OUT/kext_presum_probe.log" 2>&1
T=$?
echo "kext_presum_probe: rc=$T"
tail -n 6 "$OUT/kext_presum_probe.log"
[ "$T" -ne 0 ] && RC=$T
exit "$RC"
