"""The package's import structure: no cycles, no hidden function-level imports, every module layered.

``lint-imports`` (pyproject.toml ``[tool.importlinter]``) checks that lower layers never import
higher ones; these tests check what it cannot: that the graph has no cycle at all, that imports of
the package sit at module level (where the linter and the reader see them), and that no module
escapes the layers contract by being left out of it.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

grimp = pytest.importorskip("grimp")

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "tvmfuse"
# The only lazy imports of the package itself: the compiler behind ``tvmfuse.compile`` / ``tune``
# and the CLI's compiler-side commands, so that ``import tvmfuse`` and ``tvmfuse run`` need the
# runtime only.
LAZY_ALLOWED = {
    ("tvmfuse/__init__.py", "tvmfuse.compiler"),
    ("tvmfuse/__init__.py", "tvmfuse.tune"),
    ("tvmfuse/__init__.py", "tvmfuse.llm"),
    ("tvmfuse/cli.py", "tvmfuse.compiler"),
    ("tvmfuse/cli.py", "tvmfuse.frontend"),
    ("tvmfuse/cli.py", "tvmfuse.llm"),  # compile --lm
    ("tvmfuse/cli.py", "tvmfuse.report"),
    ("tvmfuse/cli.py", "tvmfuse.tune"),
}


@pytest.fixture(scope="module")
def graph():
    sys.path.insert(0, str(ROOT))  # the checkout's tvmfuse, as lint-imports sees it
    try:
        return grimp.build_graph("tvmfuse", cache_dir=None)
    finally:
        sys.path.remove(str(ROOT))


def _module_of(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(path: Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = _module_of(path).split(".")
    if path.name != "__init__.py":
        base = base[:-1]
    base = base[: len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def test_no_import_cycle(graph):
    modules = sorted(graph.modules)
    index = {m: i for i, m in enumerate(modules)}
    cycles = []
    for m in modules:  # a cycle through m: m reaches one of its importers
        for importer in graph.find_modules_that_directly_import(m):
            if index[importer] > index[m] and graph.chain_exists(m, importer):
                cycles.append((m, importer))
    assert not cycles, f"import cycles (module, importer that it reaches back): {cycles}"


def test_package_imports_at_module_level():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.ImportFrom):
                    target = _resolve(path, node)
                elif isinstance(node, ast.Import):
                    target = next((a.name for a in node.names if a.name.startswith("tvmfuse")), "")
                else:
                    continue
                if target.startswith("tvmfuse") and (rel, ".".join(target.split(".")[:2])) \
                        not in LAZY_ALLOWED:
                    found.append(f"{rel}:{node.lineno} {fn.name}() imports {target}")
    assert not found, "function-level imports of the package (move them to the top):\n" + "\n".join(found)


def test_every_module_is_in_a_layer(graph):
    tomllib = pytest.importorskip("tomllib")
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    layers = next(c for c in config["contracts"] if c["type"] == "layers")["layers"]
    declared = {name.strip() for layer in layers for name in layer.replace("|", ":").split(":")}
    missing = [m for m in sorted(graph.modules) if m.count(".") >= 1
               and not any(m == d or m.startswith(d + ".") for d in declared)
               and m != "tvmfuse.rules"]  # the rules' package: its __init__ is the rule list
    assert not missing, f"modules in no layer of pyproject.toml [tool.importlinter]: {missing}"


# decorators that make a TVM object class of a Python class (tvm.ir.utils.derived_object and the
# relax expression functors built on it)
_DERIVED = {"mutator", "visitor", "derived_object"}


def _decorator_name(node: ast.expr) -> str:
    node = node.func if isinstance(node, ast.Call) else node
    return node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")


def test_tvm_derived_classes_sit_at_module_level():
    """tvm_ffi keeps every Python type passed to an FFI call alive for the process
    (``_DISPATCH_TYPE_KEEP_ALIVE`` in its ``function.pxi``). A ``@mutator`` class defined inside a
    function is a new type per call, kept with its closure: session 41 found a compiled LM's
    derived weights (3.3x the model) resident after the library was dropped. Such classes sit at
    module level and take their state in ``__init__`` (their one type is kept; each instance, with
    its state, is freed)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for fn in ast.walk(ast.parse(path.read_text())):
            if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            found += [f"{rel}:{node.lineno} class {node.name} in {fn.name}()" for node in ast.walk(fn)
                      if isinstance(node, ast.ClassDef)
                      and any(_decorator_name(d) in _DERIVED for d in node.decorator_list)]
    assert not found, "TVM-derived classes defined per call (move them to module level):\n" + "\n".join(found)
