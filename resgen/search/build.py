"""Render, fingerprint and compile one variant of a kernel family.

Shared by the tuner (which compiles and stores the fingerprint with every result) and the
runtime (which recomputes the fingerprint to refuse results of a changed template). A variant
is rendered against `family.compile_key(variant, problem)`, the part of the problem the kernel
is specialized on, so every M bucket that shares a compile key shares one source file, one
fingerprint and one compile.

Family attributes this module uses (defaults in resgen.search.family.KernelFamilyBase):
- `COMPILE_OPTIONS: str`   extra cute.compile options (part of the fingerprint; "");
- `TEMPLATE_DIR: Path`     where TEMPLATE lives (None: resgen/templates; tests use their own);
- `ENTRY: str`             name of the @cute.jit entry in the rendered module (None: the
                            module's own `ENTRY` attribute, else a function named `entry`);
- `compile_module(path, variant, problem, arch) -> codegen.CompileResult`: compile the rendered
  module (default: cute.compile of the entry; families with several kernels, or test families
  without CuTe DSL, define their own).
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..kernels import codegen
from .family import KernelFamily
from .variant import ProblemBase, VariantBase

__all__ = ["Rendered", "CompileOutcome", "compile_options", "render_variant",
           "variant_fingerprint", "memo_fingerprint", "compile_variant", "entry_of"]


def compile_options(family: KernelFamily) -> str:
    return str(family.COMPILE_OPTIONS or "")


def _template_dir(family: KernelFamily) -> Path | None:
    d = family.TEMPLATE_DIR
    return Path(d) if d is not None else None


COMPILE_KEY_ATTR = "resgen_compile_key"


@dataclass(frozen=True)
class Rendered:
    path: Path
    source: str
    fingerprint: str
    compile_problem: ProblemBase


def render_variant(family: KernelFamily, variant: VariantBase, problem: ProblemBase,
                   arch: str) -> Rendered:
    """Render the variant's module to the cache directory (written only when changed)."""
    ck = family.compile_key(variant, problem)
    params = family.template_params(variant, ck)
    tdir = _template_dir(family)
    path, source = codegen.render_to_file(family.TEMPLATE, params, family.NAME, template_dir=tdir)
    fp = codegen.fingerprint(source, family.TEMPLATE, compile_options(family), arch, tdir)
    return Rendered(path, source, fp, ck)


def variant_fingerprint(family: KernelFamily, variant: VariantBase, problem: ProblemBase,
                        arch: str) -> str:
    """The fingerprint the variant would have now, without writing any file."""
    ck = family.compile_key(variant, problem)
    tdir = _template_dir(family)
    source = codegen.render(family.TEMPLATE, family.template_params(variant, ck), tdir)
    return codegen.fingerprint(source, family.TEMPLATE, compile_options(family), arch, tdir)


def memo_fingerprint(cache: dict, family: KernelFamily, variant: VariantBase,
                     problem: ProblemBase, arch: str) -> str:
    """variant_fingerprint, memoized in `cache` per compile class: the fingerprint depends on
    the workload only through `family.compile_key` (every M bucket of a shape shares it). The
    caller owns the cache and its lifetime (templates do not change under one table load)."""
    key = (family.NAME, variant.key(), family.compile_key(variant, problem).key(), arch)
    if key not in cache:
        cache[key] = variant_fingerprint(family, variant, problem, arch)
    return cache[key]


@dataclass
class CompileOutcome:
    """What compiling one variant produced. `compiled` is the in-process callable (never
    pickled: CuTe DSL compiled functions live in the process that compiled them)."""

    ok: bool
    fingerprint: str
    seconds: float | None = None
    registers: int | None = None
    spill_bytes: int | None = None
    error: str | None = None
    compiled: Any = None

    def stats(self) -> "CompileOutcome":
        """A picklable copy without the compiled function."""
        return CompileOutcome(self.ok, self.fingerprint, self.seconds, self.registers,
                              self.spill_bytes, self.error, None)


def entry_of(family: KernelFamily, module: Any) -> Any:
    name = family.ENTRY or getattr(module, "ENTRY", None) or "entry"
    fn = getattr(module, name, None)
    if fn is None:
        raise AttributeError(f"rendered module {module.__name__} of family {family.NAME} has no "
                             f"entry {name!r} (set ENTRY on the family or the module)")
    return fn


def format_error(e: BaseException, limit: int = 4000) -> str:
    """Exception type, message and the innermost traceback lines, bounded for storage."""
    tb = "".join(traceback.format_exception(type(e), e, e.__traceback__)[-6:])
    text = f"{type(e).__name__}: {e}\n{tb}"
    return text if len(text) <= limit else text[:limit // 2] + "\n...\n" + text[-limit // 2:]


def compile_variant(family: KernelFamily, variant: VariantBase, problem: ProblemBase,
                    arch: str) -> CompileOutcome:
    """Render and compile; never raises for a kernel problem (the error is in the outcome)."""
    try:
        r = render_variant(family, variant, problem, arch)
    except Exception as e:
        return CompileOutcome(False, "", error="render: " + format_error(e))
    try:
        res = family.compile_module(r.path, variant, r.compile_problem, arch)
    except Exception as e:
        return CompileOutcome(False, r.fingerprint, error=format_error(e))
    try:
        # Runners can then refuse a kernel compiled for another compile key (e.g. a fused
        # linear kernel whose operand tile was sized for fewer tokens).
        setattr(res.fn, COMPILE_KEY_ATTR, r.compile_problem.key())
    except (AttributeError, TypeError):
        pass
    return CompileOutcome(True, r.fingerprint, res.seconds, res.registers, res.spill_bytes,
                          None, res.fn)
