"""The package's layering, read from the source: which package imports which, and no cycle.

A package is a top-level subpackage or module of autopar (``autopar.search``, ``autopar.api``;
``autopar`` itself is the root). Every import counts wherever it is written (module level, inside
a function, ``importlib.import_module`` of a module named in a string), except under
``if TYPE_CHECKING:``, which never runs. The rules (DESIGN.md, "Layout"):

- the core (graph, ops, layout, redistribute, strategy, cost, search, lowering, and the small
  shared modules and values) never imports a verifier (spmd, runtime), an exporter or a face
  (report, api, cli), not even through another package;
- the cost model never depends on the search;
- the verifiers, the exporters, the report and the trainer (autopar.torch) read the plan lowering gives them,
  never the search;
- no cycle between packages.
"""

from __future__ import annotations

import ast
import graphlib
import importlib
import types
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

import autopar

PACKAGE_DIR = Path(autopar.__file__).resolve().parent
ROOT = "autopar"
CORE = (
    "autopar.graph",
    "autopar.ops",
    "autopar.layout",
    "autopar.redistribute",
    "autopar.strategy",
    "autopar.cost",
    "autopar.search",
    "autopar.lowering",
    "autopar.errors",
    "autopar.units",
    "autopar.limits",
    "autopar.progress",
    "autopar.options",
    "autopar.stdio",
)
READERS = ("autopar.spmd", "autopar.runtime", "autopar.export", "autopar.report", "autopar.torch")
FACES = (
    "autopar.spmd",
    "autopar.runtime",
    "autopar.export",
    "autopar.report",
    "autopar.torch",
    "autopar.api",
    "autopar.cli",
)

Graph = Mapping[str, set[str]]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(path): path for path in sorted(PACKAGE_DIR.rglob("*.py"))}


def package_of(module: str) -> str:
    """``autopar.search.dp`` -> ``autopar.search``; the root stays ``autopar``."""
    return ".".join(module.split(".")[:2])


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


def _lazy_targets(tree: ast.AST) -> set[str]:
    """Modules a file loads by name at run time: where it calls ``import_module``, every string
    naming an autopar module counts (the exporters' table of formats is such a list)."""
    calls = any(
        isinstance(node, ast.Call)
        and (
            (isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
            or (isinstance(node.func, ast.Name) and node.func.id in ("import_module", "__import__"))
        )
        for node in ast.walk(tree)
    )
    if not calls:
        return set()
    return {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and node.value in MODULES}


def module_imports(module: str, source: str) -> set[str]:
    """The autopar modules ``module`` imports, written as ``source``."""
    tree = ast.parse(source)
    found = set().union(*(_targets(module, node) for node in _imports(tree)), _lazy_targets(tree))
    return found - {module}


def module_graph() -> dict[str, set[str]]:
    return {module: module_imports(module, path.read_text(encoding="utf-8")) for module, path in MODULES.items()}


def package_graph(modules: Graph) -> dict[str, set[str]]:
    """Package -> the other packages its modules import."""
    packages: dict[str, set[str]] = {package_of(module): set() for module in modules}
    for module, targets in modules.items():
        mine = package_of(module)
        packages[mine] |= {package_of(target) for target in targets} - {mine}
    return packages


def reachable(graph: Graph, start: str) -> set[str]:
    """Every node ``start`` reaches (itself excluded unless on a cycle)."""
    seen: set[str] = set()
    todo = list(graph.get(start, ()))
    while todo:
        node = todo.pop()
        if node not in seen:
            seen.add(node)
            todo.extend(graph.get(node, ()))
    return seen


def cycle(graph: Graph) -> list[str] | None:
    """One cycle of ``graph`` (first node repeated at the end), or None."""
    try:
        tuple(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as exc:
        return list(exc.args[1])
    return None


def _in(name: str, packages: Iterable[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def violations(modules: Graph) -> list[str]:
    """Every broken layering rule, one line each (empty: the layering holds)."""
    packages = package_graph(modules)
    found = []
    for package in sorted(p for p in packages if _in(p, CORE)):
        for target in sorted(t for t in reachable(packages, package) if _in(t, FACES)):
            how = "imports" if target in packages[package] else "reaches"
            found.append(f"the core's {package} {how} {target}")
    if "autopar.search" in reachable(packages, "autopar.cost"):
        found.append("autopar.cost depends on autopar.search")
    for package in READERS:
        if "autopar.search" in packages.get(package, set()):
            found.append(f"{package} imports autopar.search (it reads the plan, not the search)")
    loop = cycle(packages)
    if loop is not None:
        found.append("package cycle: " + " -> ".join(loop))
    return found


def _edited(module: str, source: str) -> dict[str, set[str]]:
    """The module graph with one module's source replaced (to prove the rules catch a change)."""
    modules = module_graph()
    modules[module] = module_imports(module, source)
    return modules


# --- the layering holds ------------------------------------------------------------------------


def test_the_layering_holds():
    assert violations(module_graph()) == []


def test_no_import_cycle_between_modules():
    loop = cycle(module_graph())
    assert loop is None, "module cycle: " + " -> ".join(loop or [])


def test_the_packages_are_all_seen():
    packages = package_graph(module_graph())
    assert {ROOT, "autopar.api", "autopar.cli", *CORE, *READERS} <= set(packages)
    assert len([module for module in MODULES if _in(module, CORE)]) > 30


# --- the walk sees every kind of import ------------------------------------------------------


def test_the_walk_sees_the_package():
    modules = module_graph()
    # a module-level import, a function-level import and a `from package import module`
    assert "autopar.layout" in modules["autopar.lowering.planfile"]
    assert "autopar.lowering" in modules["autopar.cli.commands"]  # inside run_verify
    assert "autopar.ops.conv" in modules["autopar.ops"]  # from autopar.ops import conv, ...
    # importlib.import_module of a name in the formats table
    assert "autopar.export.onnx_sharding" in modules["autopar.export"]


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
    assert module_imports("autopar.layout", source) == {"autopar.cli"}


def test_a_lazy_import_by_name_counts():
    source = "import importlib\ndef f():\n    return importlib.import_module('autopar.report.text')\n"
    assert module_imports("autopar.layout", source) == {"autopar.report.text"}


# --- each rule fails when broken ---------------------------------------------------------------


def _with_function_import(module: str, statement: str) -> str:
    return MODULES[module].read_text(encoding="utf-8") + f"\n\ndef _added():\n    {statement}\n"


@pytest.mark.parametrize(
    ("module", "statement", "expected"),
    [
        ("autopar.cost.model", "from autopar.search import driver", "autopar.cost depends on autopar.search"),
        ("autopar.search.dp", "from autopar.export import export", "the core's autopar.search imports autopar.export"),
        ("autopar.graph", "import autopar.api", "the core's autopar.graph imports autopar.api"),
        ("autopar.lowering.plan", "from autopar.report import text", "the core's autopar.lowering imports"),
        (
            "autopar.spmd.runner",
            "from autopar.search.problem import SearchProblem",
            "autopar.spmd imports autopar.search",
        ),
        ("autopar.runtime.program", "import autopar.search.driver", "autopar.runtime imports autopar.search"),
        ("autopar.export.jax", "from autopar.search import driver", "autopar.export imports autopar.search"),
        ("autopar.report.text", "from autopar.search.problem import MemoryChoices", "autopar.report imports autopar."),
        ("autopar.layout", "from autopar.strategy import OpRule", "package cycle"),
    ],
)
def test_a_forbidden_import_is_caught(module, statement, expected):
    found = violations(_edited(module, _with_function_import(module, statement)))
    assert any(expected in line for line in found), found


def test_an_indirect_path_from_the_core_to_a_face_is_caught():
    # cost -> limits is allowed; limits -> cli makes the core reach a face through it
    found = violations(_edited("autopar.limits", _with_function_import("autopar.limits", "from autopar import cli")))
    assert "the core's autopar.cost reaches autopar.cli" in found


# --- names ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["autopar.lowering.plan", "autopar.api"])
def test_modules_import_as_modules(name):
    module = importlib.import_module(name)
    assert isinstance(module, types.ModuleType)
    assert module.__name__ == name


def test_api_function_names_are_not_modules():
    assert callable(autopar.plan) and not isinstance(autopar.plan, types.ModuleType)
    assert callable(autopar.verify) and not isinstance(autopar.verify, types.ModuleType)
    for name in ("plan", "verify", "export_plan"):
        assert not (PACKAGE_DIR / f"{name}.py").exists()
        assert not (PACKAGE_DIR / name).exists()
