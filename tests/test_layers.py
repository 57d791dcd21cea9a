"""Lower layers never import higher ones (STYLE.md: formats -> calibrate -> kernels -> search
-> db -> runtime -> ops -> integration -> cli), function-level imports included: e.g. the
tuner's warm start reads an earlier table through an injected reader, not resgen.db."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "resgen"
# package or module -> the resgen packages/modules it must never import
FORBIDDEN = {
    "search": ("db", "runtime", "ops", "cli", "models", "quality", "engine", "checkpoint"),
    "kernels": ("search", "db", "runtime", "ops", "cli", "models"),
    "db": ("runtime", "ops", "cli"),
    "runtime.py": ("ops", "cli"),
    "formats.py": ("calibrate", "kernels", "search", "db", "runtime", "ops", "cli"),
}


def _imports(path: Path) -> set[str]:
    """resgen submodules (first component) a file imports, absolute or relative."""
    tree = ast.parse(path.read_text())
    rel = path.relative_to(PKG).parts
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[1] for a in node.names
                    if a.name.startswith("resgen.") and a.name.count(".") >= 1}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(rel[:-1])[:len(rel) - node.level]
                mod = base + (node.module.split(".") if node.module else [])
                if not mod:                     # from .. import x: x is the submodule
                    out |= {a.name for a in node.names}
                    continue
                out.add(mod[0])
            elif node.module and node.module.startswith("resgen."):
                out.add(node.module.split(".")[1])
    return out


@pytest.mark.parametrize("where", sorted(FORBIDDEN))
def test_no_upward_imports(where):
    target = PKG / where
    files = sorted(target.rglob("*.py")) if target.is_dir() else [target]
    bad = []
    for f in files:
        for mod in _imports(f) & set(FORBIDDEN[where]):
            bad.append(f"{f.relative_to(PKG)} imports resgen.{mod}")
    assert not bad, bad


ROOT = PKG.parent


@pytest.mark.parametrize("folder", ["tests/gpu", "bench", "examples"])
def test_gpu_tests_and_scripts_import_names_that_exist(folder):
    """The GPU tests and bench scripts run only on the GPU machine: a name they import from
    resgen that no longer exists (a refactor) is caught here, on the CPU."""
    import importlib

    missing = []
    for f in sorted((ROOT / folder).rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and not node.level and \
                    (node.module or "").split(".")[0] == "resgen":
                try:
                    mod = importlib.import_module(node.module)
                except ImportError as e:
                    if "resgen" in str(e):
                        missing.append(f"{f.relative_to(ROOT)}: {node.module} ({e})")
                    continue             # a third-party module the CPU image lacks
                for a in node.names:
                    if a.name != "*" and not hasattr(mod, a.name):
                        try:
                            importlib.import_module(f"{node.module}.{a.name}")
                        except ImportError:
                            missing.append(f"{f.relative_to(ROOT)}: {node.module}.{a.name}")
    assert not missing, missing
