"""The package's import graph: no cycle (function-level imports included), and the core never imports its faces."""

from __future__ import annotations

import ast
import importlib
import types
from pathlib import Path

import networkx as nx
import pytest

import autopar

PACKAGE_DIR = Path(autopar.__file__).resolve().parent
CORE = (
    "autopar.graph",
    "autopar.ops",
    "autopar.layout",
    "autopar.redistribute",
    "autopar.strategy",
    "autopar.cost",
    "autopar.search",
    "autopar.lowering",
    "autopar.spmd",
    "autopar.runtime",
)
FACES = ("autopar.report", "autopar.cli", "autopar.api")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(path): path for path in sorted(PACKAGE_DIR.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement, at any depth, except under ``if TYPE_CHECKING:`` (never executed)."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:  # the else branch does run
                visit(child)
            return
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _targets(module: str, node: ast.Import | ast.ImportFrom) -> set[str]:
    """The autopar modules one import statement in ``module`` loads by name."""
    if isinstance(node, ast.Import):
        names = {alias.name for alias in node.names}
    else:
        if node.level:
            is_package = MODULES[module].name == "__init__.py"
            base = module.split(".")
            base = base[: len(base) - node.level + (1 if is_package else 0)]
            prefix = ".".join(base + ([node.module] if node.module else []))
        else:
            prefix = node.module or ""
        names = set()
        for alias in node.names:
            child = f"{prefix}.{alias.name}"
            names.add(child if child in MODULES else prefix)
    return {name for name in names if name in MODULES}


def import_graph() -> nx.DiGraph:
    graph = nx.DiGraph()
    graph.add_nodes_from(MODULES)
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in _imports(tree):
            for target in _targets(module, node):
                if target != module:
                    graph.add_edge(module, target)
    return graph


def test_the_walk_sees_the_package():
    graph = import_graph()
    assert {"autopar", "autopar.api", "autopar.cli", "autopar.ops.registry", "autopar.lowering.planfile"} <= set(graph)
    # a module-level import, a function-level import and a relative-free `from package import module`
    assert graph.has_edge("autopar.lowering.planfile", "autopar.layout")
    assert graph.has_edge("autopar.cli", "autopar.lowering")  # inside _run_verify
    assert graph.has_edge("autopar.ops", "autopar.ops.conv")  # from autopar.ops import conv, ...
    assert not graph.has_edge("autopar.ops.loss", "autopar.graph.types")  # under `if TYPE_CHECKING:`


def test_the_walk_resolves_relative_imports():
    tree = ast.parse("from . import registry\nfrom .base import OpSpec\nfrom .. import layout\n")
    found = [_targets("autopar.ops.conv", node) for node in _imports(tree)]
    assert found == [{"autopar.ops.registry"}, {"autopar.ops.base"}, {"autopar.layout"}]
    package = [_targets("autopar.ops", node) for node in _imports(ast.parse("from . import conv\n"))]
    assert package == [{"autopar.ops.conv"}]


def test_type_checking_imports_are_skipped_but_function_imports_are_not():
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    import autopar.api\n"
        "def f():\n    import autopar.cli\n"
    )
    found = set().union(*(_targets("autopar.layout", node) for node in _imports(ast.parse(source))))
    assert found == {"autopar.cli"}


def test_no_import_cycle():
    graph = import_graph()
    try:
        cycle = nx.find_cycle(graph)
    except nx.NetworkXNoCycle:
        cycle = None
    assert cycle is None, "import cycle: " + " -> ".join(f"{a} -> {b}" for a, b in cycle)
    assert nx.is_directed_acyclic_graph(graph)


def _in(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == prefix or module.startswith(prefix + ".") for prefix in prefixes)


def test_core_never_imports_the_faces():
    graph = import_graph()
    core = [module for module in graph if _in(module, CORE)]
    assert len(core) > 30
    bad = sorted((module, target) for module in core for target in graph.successors(module) if _in(target, FACES))
    assert bad == []
    # not even indirectly
    reached = sorted(
        (module, target) for module in core for target in nx.descendants(graph, module) if _in(target, FACES)
    )
    assert reached == []


@pytest.mark.parametrize("name", ["autopar.lowering.plan", "autopar.api"])
def test_modules_import_as_modules(name):
    module = importlib.import_module(name)
    assert isinstance(module, types.ModuleType)
    assert module.__name__ == name


def test_api_function_names_are_not_modules():
    assert callable(autopar.plan) and not isinstance(autopar.plan, types.ModuleType)
    assert callable(autopar.verify) and not isinstance(autopar.verify, types.ModuleType)
    assert not (Path(autopar.__file__).parent / "plan.py").exists()
    assert not (Path(autopar.__file__).parent / "verify.py").exists()
    assert not (Path(autopar.__file__).parent / "plan").exists()
    assert not (Path(autopar.__file__).parent / "verify").exists()
