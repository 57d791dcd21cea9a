#!/usr/bin/env bash
# Pack FlashInfer for the GPU machine (run HERE, on the development machine, which can reach
# PyPI; the GPU machine cannot). Writes the ignored folder .fi/:
#   .fi/flashinfer-python-0.7.4.tar.xz   the wheel's package tree as one solid xz archive
#                                         (about 24 MB, where the zip wheel is 101 MB: over
#                                         the 64 MiB one device call can carry)
#   .fi/apache_tvm_ffi-*.whl              its FFI layer (cp312, the GPU image's Python), not
#                                         on the GPU image
# Everything else FlashInfer imports is on the GPU image (torch, numpy, einops, tabulate,
# requests, tqdm, click, packaging, nvidia-ml-py, ninja, nvcc); CuTe DSL, cuDNN frontend,
# cuda-tile and nccl4py are imported lazily and not needed by the fa2 decode path.
# Then see bench/flashinfer_peer.py for the two device calls.
set -euo pipefail
cd "$(dirname "$0")/.."
VER=${FLASHINFER_VERSION:-0.7.4}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --no-deps -d "$tmp" "flashinfer-python==$VER"
python3 -m pip download -q --no-deps -d "$tmp" "apache-tvm-ffi>=0.1.11,<0.2" \
    --python-version 3.12 --only-binary=:all: \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64
mkdir -p "$tmp/tree" .fi
rm -f .fi/flashinfer-python-*.tar.xz .fi/apache_tvm_ffi-*.whl
python3 -m zipfile -e "$tmp"/flashinfer_python-"$VER"-*.whl "$tmp/tree"
tar -C "$tmp/tree" -cf - . | xz -9 -T0 > ".fi/flashinfer-python-$VER.tar.xz"
cp "$tmp"/apache_tvm_ffi-*.whl .fi/
ls -l .fi
