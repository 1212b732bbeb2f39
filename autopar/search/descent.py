"""Improving a plan the search could not prove best: each operator in turn takes its best candidate given its
neighbours' (iterated conditional modes, Besag 1986).

Where an elimination was split (`autopar.search.dp._split`), the plan backtracked through the split tables
need not be the best one: a step chose its operator against tables that were lower bounds. Re-choosing
one operator with every other fixed is exact for that operator, so each move lowers the objective or
leaves it, and a few sweeps reach a plan no single change improves. The lower bound is untouched; only
the gap narrows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from autopar.search.dp import TABLE_LIMITS, Factor, TableLimits
from autopar.search.repeats import Repeat

if TYPE_CHECKING:
    from autopar.search.fold import RunEdges

SWEEPS = 8
"""Sweeps over every operator at most; each after the first moves only where a neighbour moved."""


def descend(
    unary: Sequence[np.ndarray], factors: Sequence[tuple[Factor, tuple[int, ...]]], choice: Sequence[int]
) -> list[int]:
    """The plan ``choice`` with each operator moved to its best candidate given the others, until none moves.

    ``factors``: every edge table with the operators it joins (a folded run's in every copy).

    >>> table = np.array([[0.0, 5.0], [5.0, 0.0]])
    >>> edge = Factor((0, 1), (np.arange(2), np.arange(2)), table)
    >>> descend([np.array([0.0, 1.0]), np.array([3.0, 0.0])], [(edge, (0, 1))], [1, 1])
    [1, 1]
    >>> descend([np.array([0.0, 9.0]), np.array([3.0, 0.0])], [(edge, (0, 1))], [1, 1])
    [0, 0]
    """
    choice = list(choice)
    touching: list[list[tuple[Factor, tuple[int, ...]]]] = [[] for _ in unary]
    for factor, scope in factors:
        for node in set(scope):
            touching[node].append((factor, scope))
    pending = set(range(len(unary)))
    for _ in range(SWEEPS):
        moved: set[int] = set()
        for node in sorted(pending):
            costs = np.array(unary[node], dtype=float)
            for factor, scope in touching[node]:
                costs += _row(factor, scope, node, choice)
            best = int(np.argmin(costs))
            if costs[best] < costs[choice[node]]:
                choice[node] = best
                moved.add(node)
        if not moved:
            break
        pending = {u for node in moved for _, scope in touching[node] for u in scope} | moved
    return choice


def _row(factor: Factor, scope: tuple[int, ...], node: int, choice: Sequence[int]) -> np.ndarray:
    """The factor's cost for every candidate of ``node``, the other operators at their chosen candidates."""
    index = tuple(m if u == node else m[choice[u]] for m, u in zip(factor.maps, scope))
    return factor.table[index]


HUB_NEIGHBOURS = 8
"""An operator joined by edges to more than this many others is a hub: a tensor every layer reads (a
rotary table, an attention mask). A transformer's other operators have at most five neighbours."""

ROUNDS = 4
"""Rounds of `condition_on_hubs` at most; each after the first runs only where the last improved the plan and
moved a hub."""


def condition_on_hubs(
    unary: Sequence[np.ndarray],
    factors: Sequence[tuple[Factor, tuple[int, ...]]],
    choice: Sequence[int],
    limits: TableLimits = TABLE_LIMITS,
    folded: tuple[Sequence[Factor], Sequence[tuple[Repeat, RunEdges]]] | None = None,
) -> list[int]:
    """The plan ``choice`` improved by searching exactly with its hubs (`HUB_NEIGHBOURS`) held where they are.

    A hub keeps its candidates in every table from the first layer that reads it to the last, which is
    what passes the table limits on a model whose layers all read one tensor (a Llama's rotary tables and
    mask at 128 devices: 222 split steps). With each hub at one candidate the rest is a chain again,
    searched exactly; then each operator, hubs included, takes its best candidate given the others
    (`descend`), and again while the plan improves and a hub moves. The result is the best plan with those hubs' layouts
    (where that search is within the limits), never worse than ``choice``. Given ``folded`` (the factors
    outside the problem's folded runs, and the runs, as `SearchProblem` holds them), the search with the hubs
    held folds the runs, where no hub is in a run's copies or before it (whose place a later copy's last
    operator takes): a run's copies read the hubs alike, so they stay alike.

    >>> hub = Factor((0, 1), (np.arange(2), np.arange(2)), np.array([[0.0, 4.0], [4.0, 0.0]]))
    >>> edges = [(Factor((0, u), hub.maps, hub.table), (0, u)) for u in range(1, 11)]
    >>> unary = [np.zeros(2)] + [np.array([3.0, 0.0])] * 10
    >>> condition_on_hubs(unary, edges, [1] * 11) == [1] * 11
    True
    """
    neighbours: list[set[int]] = [set() for _ in unary]
    for _, scope in factors:
        for node in scope:
            neighbours[node].update(u for u in scope if u != node)
    hubs = [node for node, around in enumerate(neighbours) if len(around) > HUB_NEIGHBOURS]
    if not hubs:
        return list(choice)
    from autopar.search.fold import RunEdges, Solver  # the solver's module builds on this one's tables

    if folded is not None and any(hub in run.folded or hub == run.last(-1) for run, _ in folded[1] for hub in hubs):
        folded = None  # a hub inside a run, or before it: held, its copies would differ
    best, best_value = list(choice), _value(unary, factors, choice)
    for _ in range(ROUNDS):
        held = {hub: best[hub] for hub in hubs}
        sizes = [1 if node in held else len(costs) for node, costs in enumerate(unary)]
        held_unary = [costs[[held[node]]] if node in held else costs for node, costs in enumerate(unary)]
        if folded is None:
            kept = [_held(factor, scope, held) for factor, scope in factors]
            solver = Solver(sizes=sizes, factors=kept, limits=limits)
        else:
            main, runs = folded
            kept = [_held(factor, factor.scope, held) for factor in main]
            held_runs = [
                (run, RunEdges(_each_held(edges.first, held), _each_held(edges.later, held))) for run, edges in runs
            ]
            solver = Solver(sizes=sizes, factors=kept, folds=held_runs, limits=limits)
        found, _ = solver.solve(held_unary)
        moved = descend(unary, factors, [held.get(node, c) for node, c in enumerate(found)])
        value = _value(unary, factors, moved)
        if not value < best_value:
            break
        best, best_value = moved, value
        if all(best[hub] == at for hub, at in held.items()):
            break  # the hubs stayed: the next round would search the same problem
    return best


def _held(factor: Factor, scope: tuple[int, ...], held: dict[int, int]) -> Factor:
    """The factor over ``scope`` with each held operator at its one candidate: its table sliced to that
    candidate's class, so the tables' shapes, and the elimination planned on them, are the same wherever
    the hubs are held (`dp.Elimination` plans each structure once)."""
    if not any(u in held for u in scope):
        return Factor(scope, factor.maps, factor.table)
    table, maps = factor.table, []
    for axis, (m, u) in enumerate(zip(factor.maps, scope)):
        if u in held:
            table = np.take(table, [m[held[u]]], axis=axis)
            m = np.zeros(1, dtype=m.dtype)
        maps.append(m)
    return Factor(scope, tuple(maps), table)


def _each_held(factors: Sequence[Factor], held: dict[int, int]) -> tuple[Factor, ...]:
    """`_held` of each of a run's edges, over its own scope (copy 0's)."""
    return tuple(_held(factor, factor.scope, held) for factor in factors)


def _value(
    unary: Sequence[np.ndarray], factors: Sequence[tuple[Factor, tuple[int, ...]]], choice: Sequence[int]
) -> float:
    """The objective of ``choice``: every operator's own cost and every edge's, in a fixed order."""
    total = sum(float(costs[c]) for costs, c in zip(unary, choice))
    for factor, scope in factors:
        total += float(factor.table[tuple(m[choice[u]] for m, u in zip(factor.maps, scope))])
    return total
