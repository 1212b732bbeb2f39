"""Elimination dynamic programming over the operator graph (OptCNN / MindSpore DP), exact.

The objective is a sum of node costs and pairwise edge costs, so eliminating operators one
at a time is exact: eliminating a node folds its cost and its edges into a new cost table
over its neighbours, minimised over the node's own choice. A chain node becomes an edge
between its neighbours (node elimination), parallel edges between the same two nodes add
up (edge elimination), and residual joins or multi-consumer tensors simply give a table over
three or more operators. The greedy order picks the node whose new table is smallest, so
ResNet's blocks never build a table over more than three operators.

Ties: every candidate list starts with the data-parallel strategy and a candidate's unary cost
carries a tiny penalty growing with its position (1e-9 of the data-parallel objective in
total), so exact and near-exact ties go to data parallel, as MindSpore's search does.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from autopar.search.problem import SearchProblem

TIE_BREAK_FRACTION = 1e-9


@dataclass
class _Factor:
    scope: tuple[int, ...]  # sorted node indices
    table: np.ndarray  # one axis per scope node, in scope order


def _expand(factor: _Factor, scope: tuple[int, ...], sizes: list[int]) -> np.ndarray:
    """View a factor's table over a larger scope (size-1 axes for the nodes it lacks)."""
    shape = [sizes[v] if v in factor.scope else 1 for v in scope]
    return factor.table.reshape(shape)


Elimination = list[tuple[int, tuple[int, ...]]]


def elimination_order(problem: SearchProblem) -> Elimination:
    """(node, the operators its elimination leaves a table over), in the greedy order.

    The order depends on the graph and the candidate counts only, so it is computed once per
    problem and its largest table is known before any arithmetic (`largest_table`).
    """
    sizes = [len(t) for t in problem.node_time]
    neighbours: list[set[int]] = [set() for _ in sizes]
    for i, j in problem.edges:
        neighbours[i].add(j)
        neighbours[j].add(i)
    remaining = set(range(len(sizes)))
    order: Elimination = []
    while remaining:
        v = min(remaining, key=lambda u: (_table_size(neighbours[u], sizes), len(neighbours[u]), u))
        rest = tuple(sorted(neighbours[v]))
        for u in rest:
            neighbours[u].discard(v)
            neighbours[u].update(w for w in rest if w != u)
        remaining.discard(v)
        order.append((v, rest))
    return order


def largest_table(problem: SearchProblem, order: Elimination) -> int:
    """Entries of the largest table the elimination builds (the eliminated node's axis included)."""
    sizes = [len(t) for t in problem.node_time]
    return max((sizes[v] * _table_size(set(rest), sizes) for v, rest in order), default=0)


def minimise(problem: SearchProblem, unary: list[np.ndarray], order: Elimination | None = None) -> list[int]:
    """Exact argmin of sum(unary[i][c_i]) + sum(edges[i,j][c_i, c_j]) by variable elimination."""
    n = problem.size
    sizes = [len(u) for u in unary]
    factors: dict[int, _Factor] = {}
    touching: list[set[int]] = [set() for _ in range(n)]
    keys = itertools.count()

    def add(factor: _Factor) -> None:
        key = next(keys)
        factors[key] = factor
        for v in factor.scope:
            touching[v].add(key)

    for v in range(n):
        add(_Factor((v,), np.asarray(unary[v], dtype=float)))
    for (i, j), matrix in sorted(problem.edges.items()):
        add(_Factor((i, j), matrix))

    records: list[tuple[int, tuple[int, ...], np.ndarray]] = []
    for v, rest in order if order is not None else elimination_order(problem):
        mine = sorted(touching[v])
        scope = tuple(sorted((v, *rest)))
        total = sum(_expand(factors[k], scope, sizes) for k in mine)
        total = np.broadcast_to(total, [sizes[u] for u in scope])
        axis = scope.index(v)
        best = np.argmin(total, axis=axis)
        table = np.min(total, axis=axis)
        for k in mine:
            for u in factors[k].scope:
                touching[u].discard(k)
            del factors[k]
        records.append((v, rest, best))
        if rest:
            add(_Factor(rest, np.ascontiguousarray(table)))
    choice = [0] * n
    for v, rest, best in reversed(records):
        choice[v] = int(best[tuple(choice[u] for u in rest)]) if rest else int(best)
    return choice


def _table_size(scope: set[int], sizes: list[int]) -> int:
    size = 1
    for u in scope:
        size *= sizes[u]
    return size


def tie_break_unary(problem: SearchProblem, base_objective: float) -> list[np.ndarray]:
    """Unary costs plus a position penalty small enough never to beat a real difference."""
    positions = sum(max(len(t) - 1, 0) for t in problem.node_time) or 1
    epsilon = TIE_BREAK_FRACTION * max(base_objective, 1e-12) / positions
    return [t + epsilon * np.arange(len(t)) for t in problem.node_time]
