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

import numpy as np

from autopar.search.dp import Factor

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
