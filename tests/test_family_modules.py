"""How kernel families are laid out and found (resgen.search.family): every family module of
resgen/search is found by its name and registers its family; each module of resgen/search and
resgen/kernels belongs to one family or is a module the families share; no family imports
another family's modules (the exceptions, by design, are listed below with why); inline PTX is
emitted only by the primitives module of each arch. Also the hook defaults of
KernelFamilyBase and the one place the compile target comes from (resgen.settings)."""

from __future__ import annotations

import ast
import re
import math
from pathlib import Path

import pytest

from resgen import settings as S
from resgen.kernels.codegen import _IMPORT_LINE
from resgen.search import family as F
from resgen.search.variant import AttentionProblem, LinearProblem

ROOT = Path(__file__).resolve().parent.parent / "resgen"

# Modules no family owns, with what they are. A new module of resgen/search or resgen/kernels
# is either named after its family (<family module>[_<part>]) or listed here.
SHARED = {
    "search/__init__": "package",
    "search/family": "the family interface, its hook defaults and the registry",
    "search/variant": "typed variants and problems",
    "search/build": "render, fingerprint, compile",
    "search/buckets": "workload buckets",
    "search/cover": "covering subsets of a space",
    "search/record": "result records and the winner rule",
    "search/timing": "the measurement policy and timer",
    "search/tuneplan": "planning a tuning run",
    "search/tuner": "the tuner (the search of one workload)",
    "search/orchestrate": "the tuner's processes: job queue, workers, Ctrl-C",
    "search/device": "GPU locks and device health for the tuner's workers",
    "search/coordinator": "the coordinator's optuna study on PostgreSQL (distributed tuning)",
    "search/distributed": "a tuning run's processes drawing work from the coordinator",
    "search/warmstart": "warm-starting a search from stored results",
    "search/sm90_linear": "what the two Hopper linear families share: bind (the launch path "
                          "of a layer), the runner, the layer quantizer",
    "kernels/__init__": "package",
    "kernels/codegen": "Jinja2 rendering, fingerprints, cute.compile",
    "kernels/cubin": "reading a cubin's resource usage",
    "kernels/fp4_device": "the FP4 math on the device (decode, block quantization)",
    "kernels/sm90_ptx": "the inline-PTX wrappers of sm_90a and later (the one module of them; "
                        "sm100_ptx adds Blackwell's)",
    "kernels/sm90_operand": "the Hopper activation operand xop in torch (make_xop): what "
                            "quant_sm90 writes and both Hopper linear families read",
    "kernels/sm90_fp4_decode": "the device side of the Hopper FP4 weight layout (scale "
                               "expansion, pair decoders), used by both Hopper linear families",
    "kernels/sm90_fp4_layout": "the Hopper FP4 weight layout (frag16) and its CPU emulator, "
                               "used by both Hopper linear families",
    "kernels/quant_inputs": "the layer quantizers' check inputs (activation kinds, random "
                            "K-Ext masks), shared by quant_sm90 and quant_sm100",
    "search/sm100_linear": "what the Blackwell linear family and its quantizer share: the "
                           "layer quantizer in front of the GEMM",
    "kernels/sm100_ptx": "Blackwell (sm_100a) inline-PTX wrappers (TMEM loads, bulk stores)",
    "kernels/sm100_layout": "the sm_100a operand rows, scale-factor atom layout and TMEM "
                            "load fragments (index math)",
    "kernels/sm100_operand": "the sm_100a activation operand in torch (its definition) and "
                             "scale-factor packing",
}

# (importer, imported): the imports across families, each with why it is there. All are by
# design (a linear layer is its quantizer family in front of its GEMM family); the debt of
# issue 18 (a family reaching into another's modules) is paid, and a new entry needs a
# reason of that kind.
ALLOWED = {
    # shared modules importing a family's modules
    ("search/sm90_linear", "kernels/quant_sm90"):
        "by design: a linear layer is the layer quantizer (quant_sm90) in front of the GEMM",
    ("search/sm100_linear", "search/quant_sm100"):
        "by design: a Blackwell linear layer is quant_sm100 in front of the GEMM",
    ("search/sm100_linear", "kernels/quant_sm100"):
        "by design, the same: compiling the layer quantizer",
    # one family's kernel module importing another's
    ("kernels/linear_sm90_wgmma_presum", "kernels/linear_sm90_mma_presum"):
        "the FP16 weight decode (F16_DECODERS, scale_pair_f16) lives in linear_sm90_mma_presum, "
        "which every linear_sm90_mma render imports: moving it into a shared module moves "
        "their transitive digest, so all their stored rows past refingerprint's tier 1. Move "
        "it with the next linear_sm90_mma re-tune",
}


def _family_stems() -> list[str]:
    return [m.rsplit(".", 1)[1] for m in F.family_modules()]


def _owner(stem: str) -> str | None:
    """The family module a module belongs to: the longest family-module name it is, or
    starts with followed by "_" (should one family's name begin another's, the longer wins)."""
    cands = [f for f in _family_stems() if stem == f or stem.startswith(f + "_")]
    return max(cands, key=len) if cands else None


def _template_owner(name: str) -> str:
    """The family module of a template: the family rendering it (TEMPLATE), else the family
    whose kernel modules render it (the KV append kernel: attention_sm90's host module)."""
    extra = {"kv_append_sm90.py.j2": "attention_sm90"}
    for fam in F.families().values():
        if fam.TEMPLATE == name and type(fam).__module__.startswith("resgen.search."):
            return type(fam).__module__.rsplit(".", 1)[1]
    return extra[name]


def _imports(source: str, package: str) -> set[str]:
    """'search/x' / 'kernels/x' for every resgen.search / resgen.kernels module the source
    imports, anywhere in it (function-level imports included)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            names.add(base)
            names |= {f"{base}.{a.name}" for a in node.names}
    out = set()
    for name in names:
        p = name.split(".")
        if len(p) >= 3 and p[0] == "resgen" and p[1] in ("search", "kernels") and \
                (ROOT / p[1] / f"{p[2]}.py").is_file():
            out.add(f"{p[1]}/{p[2]}")
    return out


def _modules() -> dict[str, tuple[str, str]]:
    """'search/x' etc. -> (source, package); templates -> (their import statements,
    resgen.kernels)."""
    out = {}
    for d in ("search", "kernels"):
        for path in sorted((ROOT / d).glob("*.py")):
            out[f"{d}/{path.stem}"] = (path.read_text(), f"resgen.{d}")
    for path in sorted((ROOT / "templates").glob("*.j2")):
        # a substituted import clause (linear_sm90_wgmma's presum module) is blanked here and
        # checked in the renders that carry it (test_substituted_imports_follow_the_rule)
        text = re.sub(r"\{\{[^}]*\}\}", "", path.read_text())
        src = "\n".join(m.group(0).strip() for m in _IMPORT_LINE.finditer(text))
        out[f"templates/{path.name}"] = (src, "resgen.kernels")
    return out


def test_substituted_imports_follow_the_rule():
    """The presum render of linear_sm90_wgmma imports, through its substituted clause, its own
    family's modules and shared ones only (as the template's static imports must)."""
    from resgen.kernels import codegen

    F.families()            # every family registered in its usual order before the import below
    from resgen.search.linear_sm90_wgmma import FAMILY, Fold, LinearSm90WgmmaVariant
    from resgen.search.variant import LinearProblem

    p = LinearProblem("nvfp4", "full", 64, 256, 512)
    src = codegen._env().get_template(FAMILY.TEMPLATE).render(
        **FAMILY.template_params(LinearSm90WgmmaVariant(fold=Fold.PRESUM), p))
    deps = _imports("\n".join(m.group(0).strip() for m in _IMPORT_LINE.finditer(src)),
                    "resgen.kernels")
    assert "kernels/linear_sm90_wgmma_presum" in deps
    bad = [d for d in deps if _owner_of(d) not in (None, "linear_sm90_wgmma")]
    assert not bad, bad


def _owner_of(module: str) -> str | None:
    where, name = module.split("/")
    return _template_owner(name) if where == "templates" else _owner(name)


# ----------------------------------------------------------------------------- discovery


def _registers(path: Path) -> bool:
    """Whether a module calls register(...) at its top level."""
    for node in ast.parse(path.read_text()).body:
        for sub in ast.walk(node):
            if isinstance(sub, ast.Call) and getattr(sub.func, "id", None) == "register":
                if not isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                    return True
    return False


def test_family_modules_are_found_by_name_and_each_registers_its_family():
    found = F.family_modules()
    registering = sorted(f"resgen.search.{p.stem}" for p in (ROOT / "search").glob("*.py")
                         if p.stem != "family" and _registers(p))
    assert found == registering
    assert {"resgen.search.linear_sm90_mma", "resgen.search.linear_sm90_wgmma",
            "resgen.search.attention_sm90", "resgen.search.quant_sm90"} <= set(found)
    by_module = {type(f).__module__ for f in F.families().values()}
    assert set(found) <= by_module
    assert {"linear_sm90_mma", "linear_sm90_wgmma", "attention_sm90",
            "quant_sm90"} <= set(F.families())


@pytest.mark.parametrize("name, is_family", [
    ("attention_sm90", True), ("linear_sm90_wgmma", True), ("gemm_sm100", True),
    ("gemm_sm100a", True), ("sm90_linear", False), ("family", False), ("tuner", False),
    ("sm90", False)])
def test_the_family_module_naming_rule(name, is_family):
    assert bool(F.FAMILY_MODULE.match(name)) == is_family


# ----------------------------------------------------------------------------- layout


def test_every_module_belongs_to_a_family_or_is_shared():
    unowned = [m for m in _modules() if not m.startswith("templates/")
               and _owner_of(m) is None and m not in SHARED]
    assert not unowned, f"name these after their family or list them in SHARED: {unowned}"
    owned_and_shared = [m for m in SHARED if _owner_of(m) is not None]
    assert not owned_and_shared
    stale = [m for m in SHARED if m not in _modules()]
    assert not stale, f"SHARED lists modules that no longer exist: {stale}"


def test_no_family_imports_another_familys_modules():
    """A family module (resgen/search/<fam>.py, resgen/kernels/<fam>*.py, its templates)
    imports its own modules and the shared ones; a shared module imports no family's. Every
    exception is in ALLOWED, and ALLOWED holds no exception that is gone."""
    seen, bad = set(), []
    for mod, (src, pkg) in _modules().items():
        mine = _owner_of(mod)
        for dep in _imports(src, pkg):
            theirs = _owner_of(dep)
            if theirs is None or theirs == mine:
                continue
            if (mod, dep) in ALLOWED:
                seen.add((mod, dep))
            else:
                bad.append(f"{mod} ({mine or 'shared'}) imports {dep} ({theirs})")
    assert not bad, "\n".join(bad)
    assert seen == set(ALLOWED), f"no longer needed: {sorted(set(ALLOWED) - seen)}"


# Modules that may emit inline PTX: one primitives module per arch. Any other module calling
# llvm.inline_asm would be listed here with its reason (none is).
PTX_MODULES = {"kernels/sm90_ptx", "kernels/sm100_ptx"}
INLINE_ASM_EXCEPTIONS: dict[str, str] = {}


# sm90_ptx's emission helpers: a module importing one emits inline PTX through it
_EMITTERS = {"inline_asm", "_asm", "_pure", "_effect", "_volatile"}


def _calls_inline_asm(source: str) -> bool:
    """Whether the source names llvm's inline_asm (`llvm.inline_asm(...)`, or the function
    imported under any name) or imports one of sm90_ptx's emission helpers, anywhere."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in ("inline_asm", "_asm"):
            return True
        if isinstance(node, ast.ImportFrom) and any(a.name in _EMITTERS for a in node.names):
            return True
    return False


def test_inline_ptx_is_emitted_only_by_the_arch_primitives_modules():
    """llvm.inline_asm is called in kernels/sm90_ptx.py and kernels/sm100_ptx.py only: every
    other kernel module and every template builds on their wrappers (issue 18)."""
    emitting = {f"kernels/{p.stem}" for p in (ROOT / "kernels").glob("*.py")
                if _calls_inline_asm(p.read_text())}
    emitting |= {f"templates/{p.name}" for p in (ROOT / "templates").glob("*.j2")
                 if "inline_asm" in p.read_text()}
    assert "kernels/sm90_ptx" in emitting                   # the scan sees the real one
    assert emitting - PTX_MODULES == set(INLINE_ASM_EXCEPTIONS), \
        f"inline PTX outside the primitives modules: {sorted(emitting - PTX_MODULES)}"
    assert _calls_inline_asm("from cutlass._mlir.dialects.llvm import inline_asm as f")
    assert _calls_inline_asm("from .sm90_ptx import _asm, _u32")
    assert not _calls_inline_asm("from cutlass._mlir.dialects import llvm\nllvm.bitcast(a, b)")


def test_kernels_import_no_higher_layer():
    """resgen.kernels (rendered and host-side kernel code) never imports the search layer or
    anything above it."""
    higher = ("resgen.search", "resgen.db", "resgen.runtime", "resgen.ops", "resgen.cli")
    for path in sorted((ROOT / "kernels").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                name = node.module or ""
                if node.level == 2:
                    name = "resgen." + name
                elif node.level == 1:
                    name = "resgen.kernels." + name
            elif isinstance(node, ast.Import):
                name = node.names[0].name
            else:
                continue
            assert not name.startswith(higher), f"{path.name} imports {name}"


def test_ops_import_no_family_module():
    """resgen.ops reaches the families only through the registry and their interface."""
    fams = set(F.family_modules())
    for path in sorted((ROOT / "ops").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level == 2:
                    base = "resgen." + base
                assert base not in fams and not base.startswith("resgen.kernels"), \
                    f"{path.name} imports {base}"


# ----------------------------------------------------------------------------- hooks


class _Minimal(F.KernelFamilyBase):
    NAME = "minimal_sm90"


def test_hook_defaults():
    fam = _Minimal()
    v, p = None, LinearProblem("nvfp4", "full", 4, 256, 1024)
    assert fam.problem_invalid(p) is None
    assert fam.warm(v, p) is None
    assert math.isnan(fam.prior(v, p))
    assert fam.model_problems([], tp=1, formats=["nvfp4"], compensations=["full"],
                              m_buckets=[1]) is None
    with pytest.raises(ValueError, match="no run-time path"):
        fam.bind(object(), v, p)
    with pytest.raises(NotImplementedError):
        fam.space(p, "sm_90a")
    assert (fam.COMPILE_OPTIONS, fam.TEMPLATE_DIR, fam.ENTRY) == ("", None, None)
    # the working-set estimate by problem type (weights + operand rows + x + y for linear)
    per_w = 0.5 + 1 / 16
    assert fam.working_set_bytes(v, p) == int(256 * 1024 * per_w + 8 * 1024 * 2
                                              + 4 * 1024 * 2 + 4 * 256 * 2)
    a = AttentionProblem(2, 8, 2, 64, 100, 16)
    assert fam.working_set_bytes(v, a) == int(2 * 100 * 2 * 64 * 2 * (0.5 + 1 / 16)
                                              + 2 * 8 * 64 * 4)


def test_defines_tells_overridden_hooks_apart():
    class WithPrior(_Minimal):
        def prior(self, variant, problem):
            return 1.0

    assert not _Minimal().defines("prior") and WithPrior().defines("prior")
    assert not WithPrior().defines("prepare")
    fam = _Minimal()
    fam.prepare = lambda *a: None              # an instance attribute counts too
    assert fam.defines("prepare")
    assert F.get_family("linear_sm90_mma").defines("prior")
    assert F.get_family("linear_sm90_mma").defines("warm")
    assert not F.get_family("attention_sm90").defines("prior")
    assert F.get_family("attention_sm90").defines("bind")


def test_register_refuses_a_family_without_the_base():
    class Duck:
        NAME = "duck_sm90"

    with pytest.raises(TypeError, match="KernelFamilyBase"):
        F.register(Duck())
    assert "duck_sm90" not in F.families()


# ----------------------------------------------------------------------------- arch


def test_compile_target_comes_from_the_device_else_the_setting(monkeypatch):
    monkeypatch.delenv("RESGEN_ARCH", raising=False)
    S.settings.cache_clear()
    try:
        monkeypatch.setattr(S, "device_arch", lambda: None)
        assert S.settings().arch == S.DEFAULT_ARCH == "sm_90a"
        monkeypatch.setenv("RESGEN_ARCH", "sm_100a")
        S.settings.cache_clear()
        assert S.settings().arch == "sm_100a"
        monkeypatch.setattr(S, "device_arch", lambda: "sm_90a")      # a GPU wins
        assert S.settings().arch == "sm_90a"
    finally:
        S.settings.cache_clear()
    assert S.arch_of_capability(9, 0) == "sm_90a" and S.arch_of_capability(8, 9) == "sm_89"
    from resgen.search.record import arch_of_capability

    assert arch_of_capability is S.arch_of_capability


def test_generic_entry_points_default_to_the_settings_arch(monkeypatch):
    """The tuner's config, the checkpoint / Hugging Face servability checks and the layer
    quantizer take their arch default from resgen.settings (not a literal sm_90a): with
    RESGEN_ARCH=sm_100a and no GPU, they ask the sm_100a families."""
    from resgen.checkpoint.serve import why_unservable
    from resgen.hf import kernel_support
    from resgen.search.tuner import TuneConfig

    monkeypatch.setattr(S, "device_arch", lambda: None)
    monkeypatch.setenv("RESGEN_ARCH", "sm_100a")
    S.settings.cache_clear()
    try:
        assert TuneConfig().arch == "sm_100a"
        # N = 100 is refused by every family, each arch's families with their own reasons
        for fn in (lambda a: why_unservable("nvfp4", 100, 4096, "none", a),
                   lambda a: kernel_support("nvfp4", "none", 100, 4096, True, a)):
            assert fn(None) == fn("sm_100a") != fn("sm_90a")
            assert "linear_sm100_tc" in fn(None) and "linear_sm90_mma" not in fn(None)
    finally:
        S.settings.cache_clear()
    assert TuneConfig().arch == S.settings().arch


def test_ops_take_their_default_arch_from_settings(monkeypatch):
    import torch

    from resgen import calibrate as C
    from resgen.ops import DecodeAttention, Linear

    monkeypatch.setenv("RESGEN_ARCH", "sm_100a")
    monkeypatch.setattr(S, "device_arch", lambda: None)
    S.settings.cache_clear()
    try:
        qw = C.prepare_weight(torch.randn(64, 256), "mxfp4")
        stand_in = lambda *a: None  # noqa: E731  (a simulated op: no CUDA device check)
        assert Linear(qw, "none", device="cpu", compile_fn=stand_in).arch == "sm_100a"
        # sm_100a's attention family (attention_sm100) answers, not sm_90a's: it refuses
        # head_dim 64 with its own reason
        with pytest.raises(ValueError, match="head_dim 64 not in"):
            DecodeAttention(8, 2, 64)
        assert DecodeAttention(8, 2, 64, arch="sm_90a", op_fn=stand_in).arch == "sm_90a"
    finally:
        S.settings.cache_clear()


def test_experimental_families_come_last():
    """families() keeps registration order but puts opt-in families last, so "the first
    family of an op" serves by default (linear_sm90_fp8 sorts first by module name)."""
    names = list(F.families())
    flags = [F.families()[n].EXPERIMENTAL for n in names]
    assert flags == sorted(flags)
    linear = [n for n in names if F.families()[n].PROBLEM is LinearProblem
              and "sm_90a" in F.families()[n].ARCHS]
    assert linear[0] == "linear_sm90_mma" and linear[-1] == "linear_sm90_fp8"
