"""The search's code keeps to its shape: no function over 80 lines or with more than 8 parameters.

Compiled kernels (`autopar.search.native_jit`) take arrays, not values that hold them, so their parameters
are their arrays. `WAITING` listed the functions that predated the rule until each was split; it is empty
and stays so: a new function past the rule fails here.
"""

from __future__ import annotations

import ast
from pathlib import Path

SEARCH = Path(__file__).resolve().parents[1] / "autopar" / "search"
MOST_LINES, MOST_PARAMETERS = 80, 8
COMPILED = {"native_jit.py"}
WAITING: set[str] = set()


def _past_the_rule() -> set[str]:
    found = set()
    for path in sorted(SEARCH.glob("*.py")):
        if path.name in COMPILED:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            arguments = node.args
            names = [a.arg for a in (*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs)]
            count = len([n for n in names if n not in ("self", "cls")]) + bool(arguments.vararg) + bool(arguments.kwarg)
            lines = (node.end_lineno or node.lineno) - node.lineno + 1
            if lines > MOST_LINES or count > MOST_PARAMETERS:
                found.add(f"{path.name}:{node.name}")
    return found


def test_no_function_of_the_search_is_past_the_rule_but_those_waiting_to_be_split():
    assert _past_the_rule() == WAITING
