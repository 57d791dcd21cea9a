#!/usr/bin/env bash
# The presum fold of linear_sm90_mma (issue 20 section 1) on one H200 in one device call,
# about 8-9 minutes: (1) its GPU tests (tests/gpu/test_linear_sm90_mma_presum_gpu.py: Qwen3-8B
# shapes, M = 1, 16, 64, 128, against reference.linear(fold="presum") and the exact fold; the
# FP16 rounding case; graph replay), (2, opt-in) the covering GPU test of NVFP4 M-Ext, whose
# covering subset now holds presum variants too, (3) bench/probes/presum_probe.py: exact vs
# presum for the same tile configuration (and presum with half the n8 tiles: the same tokens
# per CTA), whole layers. Run from the repository root with
# .devcache carried (scripts/devcache.sh):
#
#     bash bench/presum_h200.sh       # device: nvidia-h200, carry [".devcache"], timeout_s 600
#
# Everything lands in $OUT (default /tmp/resgen-out): gpu_tests_presum.{xml,log},
# gpu_tests_cover_full.{xml,log}, presum_probe.{json,log}. Step (2) runs only with
# RESGEN_PRESUM_COVER=1 (the probe then has less time: its JSON keeps what it measured).
set -u
cd "$(dirname "$0")/.." || exit 2
# shellcheck source=bench/h200_lib.sh
source bench/h200_lib.sh
h200_setup
h200_cute

# 1. Correctness first.
h200_pytest gpu_tests_presum 200 8 tests/gpu/test_linear_sm90_mma_presum_gpu.py

# 2. The covering subset of the NVFP4 M-Ext space (exact and presum variants), M = 1 .. 40.
PROBE_S=340
if [ "${RESGEN_PRESUM_COVER:-0}" = "1" ]; then
    PROBE_S=190
    h200_pytest gpu_tests_cover_full 150 5 tests/gpu/test_linear_sm90_mma_gpu.py \
        -k "test_covering_variants and nvfp4-full"
fi

# 3. Exact vs presum, same tiles, whole layers (JSON rewritten after every variant).
h200_step presum_probe "$PROBE_S" 12 python3 bench/probes/presum_probe.py
exit "$H200_RC"
