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
# time limit (default 200 / 100 / 150 s; SIGINT, then what it has).
set -u
cd "$(dirname "$0")/.." || exit 2
# shellcheck source=bench/h200_lib.sh
source bench/h200_lib.sh
h200_setup
h200_cute
h200_pytest gpu_tests_kext_presum "${TEST_S:-200}" 6 tests/gpu/test_kext_presum_gpu.py
h200_pytest gpu_tests_ops "${OPS_S:-100}" 3 tests/gpu/test_ops_gpu.py \
    -k "dispatched_layer or graph_of_warmed or fp4linear"
h200_step kext_presum_probe "${PROBE_S:-150}" 6 python3 bench/probes/kext_presum_probe.py
exit "$H200_RC"
