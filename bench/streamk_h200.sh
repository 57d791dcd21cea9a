#!/usr/bin/env bash
# linear_sm90_wgmma's stream-K schedule (persistent CTAs, the `streamk` axis) on one H200 in
# one device call, about 8 minutes: (1) its GPU tests (tests/gpu/test_linear_sm90_wgmma_streamk_gpu.py:
# Qwen3-8B shapes at serving M in every mode, tiles shared by several CTAs, graph replay),
# (2) bench/probes/streamk_probe.py: the table's winners against their stream-K twins, whole
# layers. Run from the repository root with .devcache carried (scripts/devcache.sh):
#
#     bash bench/streamk_h200.sh       # device: nvidia-h200, carry [".devcache"]
#
# Everything lands in $OUT (default /tmp/resgen-out): gpu_tests_streamk.{xml,log},
# streamk_probe.{json,log}. TEST_S / PROBE_S: each step's time limit (default 200 / 330 s;
# SIGINT, then what it has). STREAMK_ONLY=comp:M limits the probe to one point.
set -u
cd "$(dirname "$0")/.." || exit 2
# shellcheck source=bench/h200_lib.sh
source bench/h200_lib.sh
h200_setup
h200_cute
h200_pytest gpu_tests_streamk "${TEST_S:-200}" 8 tests/gpu/test_linear_sm90_wgmma_streamk_gpu.py
h200_step streamk_probe "${PROBE_S:-330}" 12 python3 bench/probes/streamk_probe.py
exit "$H200_RC"
