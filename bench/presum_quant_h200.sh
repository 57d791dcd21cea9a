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
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/resgen-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OUT
# shellcheck disable=SC1091
source .devcache/device/env.sh || { echo "no .devcache/device/env.sh: carry .devcache"; exit 2; }
export RESGEN_CACHE_DIR=${RESGEN_CACHE_DIR:-/tmp/resgen-cache}
export QLC_LAYOUTS=${QLC_LAYOUTS:-presum} QLC_MS=${QLC_MS:-64,128,512,2048}
rc=0
timeout -k 5 -s INT "${SPLIT_S:-200}" python3 bench/probes/presum_split_probe.py \
    > "$OUT/presum_split_probe.log" 2>&1 || rc=1
tail -14 "$OUT/presum_split_probe.log"
timeout -k 5 -s INT "${CONFIG_S:-300}" python3 bench/probes/quant_layer_config_probe.py \
    > "$OUT/quant_layer_config_probe.log" 2>&1 || rc=1
tail -10 "$OUT/quant_layer_config_probe.log"
exit $rc
