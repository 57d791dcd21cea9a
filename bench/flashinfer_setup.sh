#!/usr/bin/env bash
# Device call A of the FlashInfer peer (see bench/flashinfer_peer.py), carry [".fi"]:
#     bash bench/flashinfer_setup.sh
# Unpacks .fi/ (bench/flashinfer_pack.sh) into /tmp/fi/site, then JIT-compiles and checks
# the fa2 NVFP4 decode modules (python3 bench/flashinfer_peer.py --warm; JSON to $OUT).
set -euo pipefail
cd "$(dirname "$0")/.."
SITE=/tmp/fi/site
ls .fi/flashinfer-python-*.tar.xz .fi/apache_tvm_ffi-*.whl >/dev/null
if [ ! -f "$SITE/.ok" ]; then
    mkdir -p "$SITE"
    tar xJf .fi/flashinfer-python-*.tar.xz -C "$SITE"
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" \
        .fi/apache_tvm_ffi-*.whl
    touch "$SITE/.ok"
fi
export RESGEN_FLASHINFER="$SITE" FLASHINFER_CUDA_ARCH_LIST=9.0a PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD:${PYTHONPATH:-}"
python3 bench/flashinfer_peer.py --warm
