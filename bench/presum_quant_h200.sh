#!/usr/bin/env bash
# One device call for the rest of issue 20's presum gap (full / plain 1.04-1.06 at M = 64-512,
# `docs/hopper_native.md`, session 33): where the presum layer's time goes, then whether a
# non-default quantizer configuration closes it. Both probes are checked before they time and
# write their JSON after every row, so a cut run still leaves what it measured.
#   1. bench/probes/presum_split_probe.py: the dispatched plain / full layers (and full's
#      plain-tiles twin) of Qwen3-8B, quantizer and GEMM timed apart, M = 64 / 128 / 512 / 2048;
#   2. bench/probes/quant_layer_config_probe.py: every quant_sm90 configuration in the layer's
#      form, layouts QLC_LAYOUTS (default "presum"), M = QLC_MS (default 64,128,512,2048).
#
#     bash bench/presum_quant_h200.sh      # device: nvidia-h200, carry [".devcache"], ~5 min
#
# SPLIT_S / CONFIG_S: each probe's time limit (default 200 / 300 s; SIGINT, then its summary).
set -u
cd "$(dirname "$0")/.." || exit 2
# shellcheck source=bench/h200_lib.sh
source bench/h200_lib.sh
h200_setup
h200_cute
export QLC_LAYOUTS=${QLC_LAYOUTS:-presum} QLC_MS=${QLC_MS:-64,128,512,2048}
h200_step presum_split_probe "${SPLIT_S:-200}" 14 python3 bench/probes/presum_split_probe.py
h200_step quant_layer_config_probe "${CONFIG_S:-300}" 10 \
    python3 bench/probes/quant_layer_config_probe.py
exit "$H200_RC"
