#!/usr/bin/env bash
# One device call that runs several GPU test files side by side on one GPU (they are
# compile-bound: 16 CPU cores compile while the GPU checks), each under its own time limit,
# JUnit XML and log per file packed into one $OUT/gpu_tests_TAG.tar.xz (a device call returns
# at most 8 files); a summary line per file is printed last and kept as $OUT/gpu_tests_TAG.txt.
# For a change that must not change behaviour (a refactor, a re-fingerprint): the family
# suites on the real GPU.
#
#     bash bench/gpu_tests_all.sh TAG tests/gpu/test_a_gpu.py tests/gpu/test_b_gpu.py ...
#
# (device: carry [".devcache"]). TEST_S (default 420) seconds per file; all files start at
# once, so the call takes about the slowest file's time.
set -u
cd "$(dirname "$0")/.." || exit 2
[ $# -ge 2 ] || { echo "usage: $0 TAG TEST_FILE [TEST_FILE ...]" >&2; exit 2; }
TAG=$1
shift
# shellcheck source=bench/h200_lib.sh
source bench/h200_lib.sh
h200_setup
h200_cute
for f in "$@"; do
    n=$(basename "$f" .py)
    (timeout -k 5 -s INT "${TEST_S:-420}" python3 -m pytest -q -p no:cacheprovider \
        --junitxml="$OUT/gpu_tests_${TAG}_$n.xml" "$f" > "$OUT/gpu_tests_${TAG}_$n.log" 2>&1
     echo $? > "$OUT/.rc_$n") &
done
wait
for f in "$@"; do
    n=$(basename "$f" .py)
    echo "$n: rc=$(cat "$OUT/.rc_$n") $(tail -1 "$OUT/gpu_tests_${TAG}_$n.log")"
    rm -f "$OUT/.rc_$n"
done > "$OUT/gpu_tests_$TAG.txt"
(cd "$OUT" && shopt -s nullglob && files=(gpu_tests_"${TAG}"_*.xml gpu_tests_"${TAG}"_*.log) \
    && [ ${#files[@]} -gt 0 ] && tar cJf "gpu_tests_$TAG.tar.xz" "${files[@]}" && rm -f "${files[@]}")
cat "$OUT/gpu_tests_$TAG.txt"
