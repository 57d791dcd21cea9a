"""The per-side worker of `resgen db refingerprint` (resgen/db/refingerprint.py).

Run as a child process with ONE resgen package on its path (the old code, materialised from
git, or the new code): `python -I -c BOOT ROOT MODE WORKDIR`, BOOT putting ROOT first on
sys.path and running this file, so the two resgen versions never meet in one interpreter.
This module imports no resgen at its top level: the parent imports it for the
normalisation functions, and the child imports the resgen under ROOT only inside `main`.

Jobs are read from `<workdir>/jobs.json`, results written to `<workdir>/results.json`.
A job is {"family", "workload_key", "variant_key", "workload_digest", "variant_digest",
"arch"}. Modes:
- "render": the row is parsed through that code's own typed space (VARIANT / PROBLEM
  from_key, stored digests matched), rendered, and fingerprinted with that code's own
  definition (resgen.search.build.variant_fingerprint); the result names the fingerprint's
  inputs that tier 1 compares (sha256 of the rendered source, the transitive kernel-module
  digest, the compile options) and the family's compile key (which rows share a render);
- "compile": the same render compiled for the job's arch on the CPU through the family's
  own compile hook (the one the tuner uses); the result holds sha256 of the raw and of the
  normalised PTX and host IR (see `normalise_ptx`, `normalise_host_ir`), and the normalised
  PTX is written to `<workdir>/<index>.ptx` for the parent's report.
A job that fails gives {"error": "..."} (never a traceback on the parent's terminal).
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from pathlib import Path
from typing import Any

# -- normalisation (used by both sides, and by the tests) ---------------------------------------
_BLOCK_COMMENT = re.compile(r"/\*.*?\*/", re.DOTALL)
_LINE_COMMENT = re.compile(r"//[^\n]*")
_DEBUG_DIRECTIVE = re.compile(r"^\s*\.(loc|file)\b[^\n]*$", re.MULTILINE)
_SYMBOL_DECL = re.compile(r"\.(?:entry|func)\s+(?:\([^)]*\)\s*)?([A-Za-z_$][\w$]*)")


def kernel_symbols(ptx: str) -> list[str]:
    """Names of the .entry / .func symbols a PTX module defines, in order of definition
    (a .func prototype and its body name the same symbol once)."""
    out: list[str] = []
    for m in _SYMBOL_DECL.finditer(_LINE_COMMENT.sub("", _BLOCK_COMMENT.sub("", ptx))):
        if m.group(1) not in out:
            out.append(m.group(1))
    return out


def rename_symbols(text: str, symbols: list[str]) -> str:
    """Every occurrence of a symbol replaced by `__sym<i>`, i its order of definition, also
    inside longer names (`<symbol>_param_<n>` in PTX, `@kernels_<symbol>` and the kernel-name
    strings of the host IR): a renamed kernel function gives the same text. Longest first,
    so a symbol that prefixes another does not split it."""
    order = sorted(range(len(symbols)), key=lambda i: -len(symbols[i]))
    if not order:
        return text
    pattern = re.compile("|".join(re.escape(symbols[i]) for i in order))
    index = {s: i for i, s in enumerate(symbols)}
    return pattern.sub(lambda m: f"__sym{index[m.group(0)]}", text)


def normalise_ptx(ptx: str) -> str:
    """PTX with only what cannot change the machine code removed: comments (the `//` header
    names the compiler build and version), `.loc` / `.file` debug line directives (line
    numbers move when a comment is added to a template), blank lines and trailing spaces, and
    the names of the module's .entry / .func symbols (a renamed kernel function renames its
    symbol; the instructions are the same). Instructions, directives, registers, constants,
    alignments and .reqntid / .maxnreg / shared sizes are kept byte for byte."""
    text = _LINE_COMMENT.sub("", _BLOCK_COMMENT.sub("", ptx))
    text = _DEBUG_DIRECTIVE.sub("", text)
    text = rename_symbols(text, kernel_symbols(ptx))
    lines = [ln.rstrip() for ln in text.splitlines()]
    return "\n".join(ln for ln in lines if ln.strip()) + "\n"


_BINARY_GLOBAL = re.compile(r'(llvm\.mlir\.global\s+internal\s+constant\s+@kernels_binary\()'
                            r'"(?:[^"\\]|\\.)*"')
_MLIR_LOC = re.compile(r"\s*loc\((?:[^()]|\([^()]*\))*\)")
_I8_ARRAY = re.compile(r"array<(\d+) x i8>")


def normalise_host_ir(ir: str, symbols: list[str]) -> str:
    """The compiled module's host side (grid and cluster dims, dynamic shared memory,
    launch attributes, argument marshalling: what the PTX does not show) with the embedded
    device binary elided (it is ptxas of the PTX compared separately), source locations
    dropped, and the kernel symbols renamed as in normalise_ptx. A rename also changes the
    length of the kernel-name strings (`!llvm.array<N x i8>` of the cudaLibraryGetKernel
    name): the lengths N of the i8 arrays declared on a line whose string literal holds a
    symbol become `#name` wherever they occur (a false match needs an unrelated byte array
    whose length moves in step with the name's; the launch-attribute arrays are 4 to 72
    bytes, the mangled names over 100)."""
    text = _BINARY_GLOBAL.sub(r'\1"<device binary>"', ir)
    text = _MLIR_LOC.sub("", text)
    lengths: set[str] = set()
    for line in text.splitlines():
        if '"' in line and any(s in line for s in symbols):
            lengths.update(_I8_ARRAY.findall(line))
    if lengths:
        text = _I8_ARRAY.sub(lambda m: "array<#name x i8>" if m.group(1) in lengths
                             else m.group(0), text)
    return rename_symbols(text, symbols)


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


# -- the child -----------------------------------------------------------------------------------
def _short_error(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:300]


def _parse(job: dict[str, Any]) -> tuple[Any, Any, Any]:
    from resgen.search.family import get_family

    fam = get_family(job["family"])
    p = fam.PROBLEM.from_key(job["workload_key"])
    v = fam.VARIANT.from_key(job["variant_key"])
    if p.digest() != job["workload_digest"]:
        raise ValueError("workload key does not match its stored digest")
    if v.digest() != job["variant_digest"]:
        raise ValueError("variant key does not match its stored digest")
    return fam, p, v


def _render(job: dict[str, Any], memo: dict[tuple, dict[str, Any]]) -> dict[str, Any]:
    from resgen.kernels import codegen
    from resgen.search import build

    fam, p, v = _parse(job)
    ck = fam.compile_key(v, p)
    key = (fam.NAME, v.key(), ck.key(), job["arch"])
    if key not in memo:
        tdir = build._template_dir(fam)
        source = codegen.render(fam.TEMPLATE, fam.template_params(v, ck), tdir)
        kmod = getattr(codegen, "kernel_modules_digest", None)
        memo[key] = {
            "fingerprint": build.variant_fingerprint(fam, v, p, job["arch"]),
            "source": sha(source),
            "kernel_modules": kmod(source) if kmod is not None else None,
            "options": build.compile_options(fam),
            "compile_key": ck.key()}
    return memo[key]


def _compile(job: dict[str, Any], outdir: Path, index: int) -> dict[str, Any]:
    from resgen.search import build

    fam, p, v = _parse(job)
    r = build.render_variant(fam, v, p, job["arch"])
    res = fam.compile_module(r.path, v, r.compile_problem, job["arch"])
    ptx = getattr(res, "ptx", None)
    if not ptx:
        raise RuntimeError("the compile kept no PTX")
    symbols = kernel_symbols(ptx)
    ir_mod = getattr(res.fn, "ir_module", None)
    if ir_mod is None:
        raise RuntimeError("the compiled function exposes no host IR (ir_module)")
    host = str(ir_mod)
    norm = normalise_ptx(ptx)
    (outdir / f"{index}.ptx").write_text(norm)
    (outdir / f"{index}.host").write_text(normalise_host_ir(host, symbols))
    return {"ptx_raw": sha(ptx), "ptx": sha(norm), "host_raw": sha(host),
            "host": sha(normalise_host_ir(host, symbols)), "symbols": symbols}


def main(root: str, mode: str, workdir: str) -> int:
    """Run the jobs of `<workdir>/jobs.json` with the resgen under `root`; results to
    `<workdir>/results.json` (a file, not stdout: imports may print)."""
    import resgen

    here = Path(resgen.__file__).resolve().parent.parent
    if here != Path(root).resolve():
        print(f"imported resgen from {here}, not {root}", file=sys.stderr)
        return 3
    work = Path(workdir)
    jobs = json.loads((work / "jobs.json").read_text())
    out: list[dict[str, Any]] = []
    memo: dict[tuple, dict[str, Any]] = {}
    for i, job in enumerate(jobs):
        try:
            if mode == "render":
                out.append(_render(job, memo))
            else:
                out.append(_compile(job, work, i))
        except Exception as e:       # one bad row is a finding, not the end of the run
            out.append({"error": _short_error(e)})
    (work / "results.json").write_text(json.dumps(out))
    return 0


# `python -I -c BOOT ROOT MODE WORKDIR`: BOOT puts ROOT first on sys.path and calls main
# (resgen/db/refingerprint.py starts it so).
if __name__ == "__main__":
    raise SystemExit(main(*sys.argv[1:]))
