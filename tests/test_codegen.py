"""Keys, spaces and predicates of every registered family; rendering, fingerprints and
compile-only through the pipeline (resgen.search.build)."""

from __future__ import annotations

import dataclasses
import enum
import importlib
import json
import shutil
import typing
from pathlib import Path

import jinja2
import pytest

import fakefam
from fakefam import FakeFamily, FakeProblem, FakeVariant, isolated_cache  # noqa: F401
from resgen.kernels import codegen
from resgen.search import family as family_mod
from resgen.search.build import compile_variant, render_variant, variant_fingerprint
from resgen.search.family import KernelFamilyBase, families
from resgen.search.variant import (AttentionProblem, LinearProblem, ProblemBase, VariantBase,
                                   _to_jsonable)

pytestmark = pytest.mark.usefixtures("isolated_cache")
TEMPLATES = Path(__file__).resolve().parent / "templates"


def representative_problems(fam) -> list[ProblemBase]:
    if fam.PROBLEM is LinearProblem:
        return [LinearProblem(fmt=f, compensation=c, m=m, n=4096, k=4096)
                for f in ("nvfp4", "mxfp4") for c in ("none", "full", "0.25") for m in (1, 16)]
    if fam.PROBLEM is AttentionProblem:
        return [AttentionProblem(batch=b, kv_len=L) for b in (1, 8) for L in (1000, 8192)]
    return [fam.PROBLEM()]


def _alternatives(cls, f: dataclasses.Field, value):
    """Other legal values of one field, most different first."""
    tp = typing.get_type_hints(cls)[f.name]
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return [m for m in tp if m is not value]
    if tp is bool:
        return [not value]
    if tp is int:
        rng = f.metadata.get("range")
        cands = [value * 2, value // 2, value + 1, value - 1]
        if rng is not None:
            cands += [rng.lo, rng.hi]
            cands = [c for c in cands if rng.lo <= c <= rng.hi
                     and not (rng.pow2 and c & (c - 1))]
        return [c for c in dict.fromkeys(cands) if c != value]
    if tp is str:
        allowed = f.metadata.get("allowed") or (value + "x",)
        return [a for a in allowed if a != value]
    if tp is float:
        return [value * 2 + 1]
    if typing.get_origin(tp) is tuple:
        return [tuple(value) + (1,), tuple(value)[:-1]] if value else [(1,)]
    raise AssertionError(f"unhandled field type {tp}")


def assert_keys_separate(obj) -> int:
    """Changing any one field changes key() and digest(), and the key parses back."""
    cls = type(obj)
    assert cls.from_key(obj.key()) == obj
    json.loads(obj.key())
    changed = 0
    for f in dataclasses.fields(cls):
        for alt in _alternatives(cls, f, getattr(obj, f.name)):
            d = obj.as_dict()
            d[f.name] = _to_jsonable(alt)
            try:
                other = cls.from_dict(d)
            except ValueError:
                continue
            assert other.key() != obj.key(), f"{cls.__name__}.{f.name} does not change the key"
            assert other.digest() != obj.digest()
            assert cls.from_key(other.key()) == other
            changed += 1
            break
        else:
            raise AssertionError(f"no legal alternative value for {cls.__name__}.{f.name}")
    return changed


def _families_of(module: str) -> list:
    """The families a discovered family module (resgen.search.family.family_modules)
    registers."""
    importlib.import_module(module)
    fams = [f for f in families().values() if type(f).__module__ == module]
    assert fams, f"{module} imported but registered no family"
    return fams


def test_key_separation_problems_and_fake_family():
    for p in (LinearProblem(compensation="0.25"),
              LinearProblem(compensation="0.125", m=7, static_scale=False),
              AttentionProblem(compensation=False), FakeProblem(m=3)):
        # (plain attention: from ResAttn, query="q16" is no legal alternative, no residue;
        # linear: NVFP4 K-Ext, where fold="presum" is legal)
        assert assert_keys_separate(p) == len(dataclasses.fields(p))
    for v in FakeFamily().space(FakeProblem(), "sm_90a")[::7]:
        assert assert_keys_separate(v) == 4


@pytest.mark.parametrize("module", family_mod.family_modules())
def test_key_separation_registered_families(module):
    for fam in _families_of(module):
        for arch in fam.ARCHS:
            for p in representative_problems(fam)[:2]:
                v = fam.default(p, arch)
                assert isinstance(v, fam.VARIANT) and isinstance(v, VariantBase)
                assert assert_keys_separate(v) == len(dataclasses.fields(v))
                assert fam.VARIANT.FAMILY == fam.NAME
                # Keys of other variants in the space separate too.
                for other in list(fam.space(p, arch))[::17][:6]:
                    assert_keys_separate(other)


def served_problems(fam) -> list[ProblemBase]:
    """The representative problems a family does not refuse as a whole (its declared domain:
    `problem_invalid`; e.g. linear_sm90_fp8 runs MXFP4 W4A4 at M >= 64 only), with the wider
    linear M buckets added for families that serve none of the default ones."""
    probs = [p for p in representative_problems(fam) if fam.problem_invalid(p) is None]
    if not probs and fam.PROBLEM is LinearProblem:
        probs = [p for p in (LinearProblem(fmt=f, compensation=c, m=m, n=4096, k=4096)
                             for f in ("nvfp4", "mxfp4") for c in ("none", "full")
                             for m in (64, 128)) if fam.problem_invalid(p) is None]
    return probs


@pytest.mark.parametrize("module", family_mod.family_modules())
def test_space_and_predicate_tables_registered_families(module, monkeypatch):
    from resgen.settings import settings

    fams = _families_of(module)
    # experimental families (resgen.settings' RESGEN_EXPERIMENTAL) are checked opted in
    monkeypatch.setenv("RESGEN_EXPERIMENTAL", ",".join(f.NAME for f in fams))
    settings.cache_clear()
    try:
        cases = []
        for f in fams:
            served = served_problems(f)
            assert served, f"{f.NAME} serves none of the representative problems"
            cases += [(f, a, p) for a in f.ARCHS for p in served]
        _check_space_and_predicates(cases)
    finally:
        monkeypatch.delenv("RESGEN_EXPERIMENTAL")
        settings.cache_clear()


def _check_space_and_predicates(cases: list) -> None:
    for fam, arch, p in cases:
        if True:
            space = list(fam.space(p, arch))
            assert space == list(fam.space(p, arch)), "space order must be deterministic"
            assert len({v.key() for v in space}) == len(space), "duplicate variants"
            n_valid = 0
            for v in space:
                why = fam.why_invalid(v, p, arch)
                assert why is None or (isinstance(why, str) and why.strip())
                n_valid += why is None
                if why is None:
                    params = fam.template_params(v, fam.compile_key(v, p))
                    for k, x in params.items():
                        assert isinstance(x, (int, float, bool, str, enum.Enum, tuple)), \
                            (k, type(x))
            d = fam.default(p, arch)
            assert fam.why_invalid(d, p, arch) is None, (p, d)
            assert n_valid >= 1


FAKE_TABLE = [
    # (variant, problem, arch, reason fragment or None)
    (FakeVariant(tile=8), FakeProblem(m=1), "sm_90a", None),
    (FakeVariant(tile=16), FakeProblem(m=1), "sm_90a", "wider than the 1 token rows"),
    (FakeVariant(tile=16), FakeProblem(m=8, compensation="full"), "sm_90a", None),
    (FakeVariant(tile=32), FakeProblem(m=8, compensation="full"), "sm_90a", "16 token rows"),
    (FakeVariant(split=True), FakeProblem(k=4096), "sm_90a", None),
    (FakeVariant(split=True), FakeProblem(k=4000), "sm_90a", "K % 1024"),
    (FakeVariant(tile=64, stages=4), FakeProblem(m=64), "sm_90a", "shared memory"),
    (FakeVariant(tile=64, stages=4), FakeProblem(m=64), "sm_100a", None),
]


@pytest.mark.parametrize("v,p,arch,why", FAKE_TABLE)
def test_fake_predicate_table(v, p, arch, why):
    got = FakeFamily().why_invalid(v, p, arch)
    assert (got is None) if why is None else (why in got)


PARAMS = {"tile": 16, "stages": 2, "pack": "a", "split": True, "n": 512, "k": 1024}


def test_render_snapshot_and_header():
    from resgen import __version__

    src = codegen.render("fake_kernel.py.j2", PARAMS, TEMPLATES)
    header, body = src.split("\n", 1)
    assert header == (f"# generated by resgen {__version__} from templates/fake_kernel.py.j2 "
                      "- do not edit")
    assert body == (TEMPLATES / "fake_kernel.expected.py").read_text()
    compile(src, "fake_kernel.py", "exec")


@pytest.mark.parametrize("template", sorted(p.name for p in codegen.TEMPLATE_DIR.glob("*.j2")))
def test_kernel_templates_only_substitute(template):
    """Templates substitute (STYLE.md 6, issue 18): Jinja's lexer finds no statement
    (`{% if %}`, `{% for %}`, ...), line statement or Jinja comment in any kernel template,
    only `{{ }}` substitutions; a kernel's choices are substituted names and constants, or
    trace-time Python on them (`cutlass.const_expr`) in the rendered module."""
    tokens = {kind for _, kind, _ in jinja2.Environment().lex(
        (codegen.TEMPLATE_DIR / template).read_text())}
    assert "variable_begin" in tokens
    assert not tokens & {"block_begin", "comment_begin", "linestatement_begin",
                         "linecomment_begin", "raw_begin"}


def test_strict_undefined_rejects_missing_parameters():
    with pytest.raises(jinja2.UndefinedError, match="tile"):
        codegen.render("fake_kernel.py.j2", {k: v for k, v in PARAMS.items() if k != "tile"},
                       TEMPLATES)


def test_render_to_file_writes_only_when_changed(isolated_cache):  # noqa: F811
    root = isolated_cache / "gen"
    p1, s1 = codegen.render_to_file("fake_kernel.py.j2", PARAMS, "fake", root, TEMPLATES)
    stamp = p1.stat().st_mtime_ns
    p2, s2 = codegen.render_to_file("fake_kernel.py.j2", PARAMS, "fake", root, TEMPLATES)
    assert (p1, s1) == (p2, s2) and p2.stat().st_mtime_ns == stamp
    p3, _ = codegen.render_to_file("fake_kernel.py.j2", {**PARAMS, "tile": 32}, "fake", root,
                                   TEMPLATES)
    assert p3 != p1 and p3.read_text() != p1.read_text()
    assert p1.read_text() == s1
    assert codegen.load_module(p1).TILE == 16


def test_fingerprint_covers_source_template_options_arch(tmp_path):
    src = codegen.render("fake_kernel.py.j2", PARAMS, TEMPLATES)
    base = codegen.fingerprint(src, "fake_kernel.py.j2", "", "sm_90a", TEMPLATES)
    assert base == codegen.fingerprint(src, "fake_kernel.py.j2", "", "sm_90a", TEMPLATES)
    assert len({base,
                codegen.fingerprint(src + "#", "fake_kernel.py.j2", "", "sm_90a", TEMPLATES),
                codegen.fingerprint(src, "fake_kernel.py.j2", "-O2", "sm_90a", TEMPLATES),
                codegen.fingerprint(src, "fake_kernel.py.j2", "", "sm_100a", TEMPLATES)}) == 4
    tdir = tmp_path / "t"
    shutil.copytree(TEMPLATES, tdir)
    (tdir / "fake_kernel.py.j2").write_text((tdir / "fake_kernel.py.j2").read_text() + " ")
    assert codegen.fingerprint(src, "fake_kernel.py.j2", "", "sm_90a", tdir) != base
    (tdir / "_shared.j2").write_text("{# included by convention #}")
    t2 = codegen.template_digest("fake_kernel.py.j2", tdir)
    (tdir / "_shared.j2").write_text("{# changed #}")
    assert codegen.template_digest("fake_kernel.py.j2", tdir) != t2


def test_variant_fingerprint_is_shared_across_m_buckets():
    fam = FakeFamily()
    v = FakeVariant(tile=8, stages=2)
    fps = {variant_fingerprint(fam, v, FakeProblem(m=m, k=4096), "sm_90a") for m in (1, 4, 64)}
    assert len(fps) == 1                                  # M is a run-time argument
    r = render_variant(fam, v, FakeProblem(m=4, k=4096), "sm_90a")
    assert r.fingerprint in fps and r.compile_problem == FakeProblem(m=1, k=4096)
    assert variant_fingerprint(fam, v, FakeProblem(k=8192), "sm_90a") not in fps
    assert variant_fingerprint(fam, v, FakeProblem(k=4096), "sm_100a") not in fps


# -- a tiny real CuTe DSL family: the default compile path (module ENTRY + compile_entry) ---
@dataclasses.dataclass(frozen=True, slots=True)
class TinyVariant(VariantBase):
    FAMILY: typing.ClassVar[str] = "fake_tiny_cute"
    threads: int = dataclasses.field(default=128, metadata={"range": fakefam.IntRange(32, 1024,
                                                                                      True)})
    scale: int = 2


class TinyCute(KernelFamilyBase):
    NAME = "fake_tiny_cute"
    VARIANT = TinyVariant
    PROBLEM = FakeProblem
    TEMPLATE = "tiny_cute.py.j2"
    TEMPLATE_DIR = TEMPLATES
    ARCHS = ("sm_90a", "sm_100a")

    def template_params(self, v, p):
        return {"threads": v.threads, "scale": v.scale}

    def compile_key(self, v, p):
        return FakeProblem(n=p.n)

    def compile_args(self, v, p):
        import cutlass
        from cutlass.cute.runtime import make_fake_compact_tensor

        return [make_fake_compact_tensor(cutlass.Float32, (p.n,)),
                make_fake_compact_tensor(cutlass.Float32, (p.n,))]


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_compile_only_tiny_cute_family(arch):
    pytest.importorskip("cutlass")
    out = compile_variant(TinyCute(), TinyVariant(threads=64, scale=3), FakeProblem(n=1024), arch)
    assert out.ok, out.error
    assert out.compiled is not None and out.seconds > 0
    assert isinstance(out.registers, int) and out.registers > 0
    assert out.spill_bytes == 0
    bad = compile_variant(TinyCute(), TinyVariant(threads=64, scale=3), FakeProblem(n=1024),
                          "sm_12345")
    assert not bad.ok and bad.error                       # recorded, not raised


# -- every real template family compiles through the pipeline (CPU, named arch) -------------
@pytest.mark.parametrize("module", family_mod.family_modules())
def test_compile_only_every_registered_template_family(module):
    pytest.importorskip("cutlass")
    for fam in _families_of(module):
        for arch in fam.ARCHS:
            p = representative_problems(fam)[0]
            v = fam.default(p, arch)
            out = compile_variant(fam, v, p, arch)
            assert out.ok, f"{fam.NAME} {v.name()} on {arch}: {out.error}"
            assert out.fingerprint == variant_fingerprint(fam, v, p, arch)
            assert out.spill_bytes in (None, 0), f"{v.name()} spills {out.spill_bytes} bytes"


def test_fingerprint_covers_imported_kernel_modules(tmp_path, monkeypatch):
    """Editing a device helper a kernel imports (directly or through another helper) changes
    the fingerprint, like editing its template; unrelated modules do not."""
    import hashlib

    from resgen.kernels import codegen as cg

    (tmp_path / "helper_a.py").write_text("from . import helper_b\nX = 1\n")
    (tmp_path / "helper_b.py").write_text("Y = 2\n")
    (tmp_path / "unrelated.py").write_text("Z = 3\n")
    monkeypatch.setattr(cg, "_KERNELS_DIR", tmp_path)
    src = ("import cutlass\nfrom resgen.kernels.helper_a import (X,\n    X as X2)\n"
           "def f():\n    return X\n")

    def digest():
        cg._module_closure.cache_clear()
        return cg.kernel_modules_digest(src)

    d0 = digest()
    (tmp_path / "unrelated.py").write_text("Z = 4\n")
    assert digest() == d0
    (tmp_path / "helper_b.py").write_text("Y = 5\n")
    d1 = digest()
    assert d1 != d0
    (tmp_path / "helper_a.py").write_text("from . import helper_b\nX = 6\n")
    assert digest() != d1
    assert cg.kernel_modules_digest("import os\n") == hashlib.sha256().hexdigest()
    cg._module_closure.cache_clear()
