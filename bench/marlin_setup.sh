#!/usr/bin/env bash
# Build vLLM's Marlin FP4 x BF16 GEMM (W4A16, NVFP4 and MXFP4 weights) as a plain CUDA shared
# library with a C ABI, for resgen's `marlin_fp4` baseline (resgen/baselines_marlin.py).
# Run HERE, on the development machine (it reaches PyPI and has nvcc; no GPU needed):
#     bash bench/marlin_setup.sh
# Steps, all outside the project tree except the result:
#   1. the vLLM sdist (pip download --no-binary :all: --no-clean, no install) unpacked into
#      $MARLIN_PEERS (default /work/peers): csrc/quantization/marlin/, csrc/core/;
#   2. generate_kernels.py (vLLM's own generator, arch 9.0) into a build folder; its
#      BF16 x FE2M1f -> BF16 instantiation file (NVFP4 and MXFP4 scales, every thread config
#      vLLM builds for them) is compiled, split into parts to use both cores, and its
#      kernel_selector.h is filtered to those configs;
#   3. marlin.cu's host code (marlin::marlin_mm) and gptq_marlin_repack.cu's kernel are cut out
#      verbatim (without their torch front ends) and compiled with our binding,
#      bench/marlin_capi.cu, for sm_90a (no torch dependency: the .so loads next to any torch
#      build; it needs libcudart.so.13, which torch cu13 loads first); fatbin compressed
#      (--compress-mode=size, as vLLM): about 0.5 MB;
#   4. the result into the ignored folder .peers/marlin/: libmarlin_fp4_sm90a.so and
#      build.json (vLLM version, nvcc version, size, sha256).
# Only torch's header-only headers (torch/headeronly, used by vLLM's scalar_type.hpp and
# STD_TORCH_CHECK) are needed at build time: any torch install provides them.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VER=${VLLM_VERSION:-0.33.0}
PEERS=${MARLIN_PEERS:-/work/peers}
SRC="$PEERS/vllm-$VER"
BUILD="$PEERS/marlin-build-$VER"
OUTDIR="$ROOT/.peers/marlin"
NVCC=${NVCC:-nvcc}
JOBS=${JOBS:-2}
PARTS=${PARTS:-4}
PY=${PYTHON:-python3}

if [ ! -d "$SRC/csrc/quantization/marlin" ]; then
    mkdir -p "$PEERS/vllm_dl"
    if [ -f "$PEERS/vllm_dl/vllm-$VER.tar.gz" ]; then
        tar xzf "$PEERS/vllm_dl/vllm-$VER.tar.gz" -C "$PEERS"
    else
        # The source is all that is wanted. pip's metadata step fails here (vLLM's setup
        # needs a CUDA torch; --no-build-isolation keeps it from installing one first), and
        # then pip saves no tarball; --no-clean keeps the unpacked tree in its TMPDIR.
        tmp="$PEERS/piptmp"
        rm -rf "$tmp" && mkdir -p "$tmp"
        TMPDIR="$tmp" "$PY" -m pip download --no-deps --no-binary :all: --no-build-isolation \
            --no-clean "vllm==$VER" -d "$PEERS/vllm_dl" || true
        if [ -f "$PEERS/vllm_dl/vllm-$VER.tar.gz" ]; then
            tar xzf "$PEERS/vllm_dl/vllm-$VER.tar.gz" -C "$PEERS"
        else
            tree=$(ls -d "$tmp"/pip-download-*/vllm_* | head -1)
            grep -qx "Version: $VER" "$tree/PKG-INFO"
            mv "$tree" "$SRC"
        fi
        rm -rf "$tmp"
    fi
fi
grep -qx "Version: $VER" "$SRC/PKG-INFO"
MSRC="$SRC/csrc/quantization/marlin"
TORCH_INC=$("$PY" -c "import os, torch; print(os.path.join(os.path.dirname(torch.__file__), 'include'))")
test -f "$TORCH_INC/torch/headeronly/util/Exception.h"

mkdir -p "$BUILD/gen" "$BUILD/obj" "$OUTDIR"
"$PY" "$MSRC/generate_kernels.py" 9.0 "$BUILD/gen" >/dev/null
"$PY" - "$MSRC" "$BUILD" "$PARTS" <<'PYEOF'
import re, sys
from pathlib import Path
msrc, build, parts = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
gen = build / "gen"
KEEP = ("a_type == vllm::kBFloat16 && b_type == vllm::kFE2M1f && c_type == vllm::kBFloat16 "
        "&& s_type == vllm::")
# kernel_selector.h: "if (cond)\n  kernel = X;\n" / "else if (cond)\n  kernel = X;\n" pairs
lines = (gen / "kernel_selector.h").read_text().splitlines()
pairs, i = [], 0
while i < len(lines):
    m = re.match(r"^(?:else )?if \((.*)\)$", lines[i])
    if m and i + 1 < len(lines) and lines[i + 1].startswith("  kernel = "):
        pairs.append((m.group(1), lines[i + 1]))
        i += 2
    else:
        i += 1
kept = [(c, k) for c, k in pairs if c.startswith(KEEP) and
        ("kFE4M3fn && threads" in c or "kFE8M0fnu && threads" in c)]
assert kept, "no BF16 x FE2M1f configs in kernel_selector.h"
sel = "// filtered by bench/marlin_setup.sh: BF16 x FE2M1f -> BF16 (NVFP4, MXFP4)\n"
sel += "".join(f"{'if' if j == 0 else 'else if'} ({c})\n{k}\n" for j, (c, k) in enumerate(kept))
(build / "kernel_selector.h").write_text(sel)
# the instantiation file, split into parts
inst = (gen / "sm80_kernel_bfloat16_fe2m1f_bfloat16.cu").read_text()
head, _, body = inst.partition("namespace MARLIN_NAMESPACE_NAME {")
decls = [d.strip() for d in body.rsplit("}", 1)[0].split(";") if d.strip()]
assert len(decls) == len(kept), (len(decls), len(kept))
for p in range(parts):
    chunk = decls[p::parts]
    (build / f"inst_{p}.cu").write_text(
        head + "namespace MARLIN_NAMESPACE_NAME {\n\n" + ";\n\n".join(chunk) + ";\n\n}\n")
# marlin.cu's host code: MarlinDefault / MarlinFuncPtr, then the #else branch up to the end
# of marlin_mm (the closing "}  // namespace marlin"), without the namespace lines
src = (msrc / "marlin.cu").read_text()
ns = src.index("namespace marlin {\n") + len("namespace marlin {\n")
pre = src[ns:src.index("#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 750")]
start = src.index("#else\n", ns) + len("#else\n")
end = src.index("}  // namespace marlin", start)
(build / "marlin_host.inc").write_text(
    "// cut from vLLM csrc/quantization/marlin/marlin.cu by bench/marlin_setup.sh\n"
    + pre + src[start:end])
rep = (msrc / "gptq_marlin_repack.cu").read_text()
a = rep.index("namespace marlin {\n") + len("namespace marlin {\n")
b = rep.index("}  // namespace marlin", a)
(build / "repack_kernel.inc").write_text(
    "// cut from vLLM csrc/quantization/marlin/gptq_marlin_repack.cu by bench/marlin_setup.sh\n"
    + rep[a:b])
print(f"{len(kept)} Marlin configs in {parts} parts")
PYEOF

FLAGS=(-O3 -std=c++17 -Xcompiler -fPIC -gencode arch=compute_90a,code=sm_90a
       --expt-relaxed-constexpr -DMARLIN_NAMESPACE_NAME=marlin
       -static-global-template-stub=false   # as vLLM builds with CUDA 13: the selector
                                             # refers to instantiations in other files
       --compress-mode=size                  # as vLLM (CUDA >= 12.8): a smaller carry
       -I"$BUILD" -I"$MSRC" -I"$SRC/csrc" -I"$TORCH_INC")
# objects built with other flags are rebuilt
if [ "$(cat "$BUILD/obj/flags.txt" 2>/dev/null)" != "${FLAGS[*]}" ]; then
    rm -f "$BUILD"/obj/*.o
    echo "${FLAGS[*]}" > "$BUILD/obj/flags.txt"
fi
compile() {   # src obj
    if [ ! -f "$2" ] || [ "$1" -nt "$2" ]; then "$NVCC" "${FLAGS[@]}" -c "$1" -o "$2"; fi
}
objs=()
pids=()
for p in $(seq 0 $((PARTS - 1))); do
    compile "$BUILD/inst_$p.cu" "$BUILD/obj/inst_$p.o" & pids+=($!)
    objs+=("$BUILD/obj/inst_$p.o")
    while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do sleep 2; done
done
compile "$ROOT/bench/marlin_capi.cu" "$BUILD/obj/capi.o" & pids+=($!)
objs+=("$BUILD/obj/capi.o")
for pid in "${pids[@]}"; do wait "$pid"; done
# cudart: shared (soname libcudart.so.13, which torch cu13 has loaded before the library is
# opened). A static cudart (or libstdc++) would pull glibc 2.34+ symbol versions
# (pthread / dl) from this machine's glibc, which the GPU image may not have.
"$NVCC" -shared -cudart shared -gencode arch=compute_90a,code=sm_90a "${objs[@]}" \
    -o "$OUTDIR/libmarlin_fp4_sm90a.so"
"$PY" - "$OUTDIR" "$VER" "$NVCC" <<'PYEOF'
import json, subprocess, sys, hashlib
from pathlib import Path
out, ver, nvcc = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
so = out / "libmarlin_fp4_sm90a.so"
nv = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout.strip()
json.dump({"vllm": ver, "arch": "sm_90a", "nvcc": nv.splitlines()[-1], "cudart": "shared",
           "sha256": hashlib.sha256(so.read_bytes()).hexdigest(),
           "bytes": so.stat().st_size, "capi_version": 1}, open(out / "build.json", "w"),
          indent=1)
PYEOF
ls -l "$OUTDIR"
