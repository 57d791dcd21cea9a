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
cd "$(dirname "$0")/.." || exit 2
# shellcheck source=bench/h200_lib.sh
source bench/h200_lib.sh
h200_setup
h200_cute

# 1. Correctness first.
h200_pytest gpu_tests_wgmma_presum 200 8 -x tests/gpu/test_linear_sm90_wgmma_presum_gpu.py
h200_pytest gpu_tests_wgmma_layer 100 3 tests/gpu/test_linear_sm90_wgmma_gpu.py \
    -k "whole_layer or pdl or graph"

# 2. Presum against the table's exact fold and plain, whole layers (JSON after every variant).
h200_step wgmma_presum_probe "${RESGEN_PROBE_S:-270}" 8 python3 bench/probes/wgmma_presum_probe.py
exit "$H200_RC"
