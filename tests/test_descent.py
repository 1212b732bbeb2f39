"""Improving a plan the search could not prove best: one operator at a time, and exactly around its hubs."""

from __future__ import annotations

import numpy as np
import pytest

from autopar.search.descent import HUB_NEIGHBOURS, _value, condition_on_hubs, descend
from autopar.search.dp import Factor
from autopar.search.fold import Solver


def _hub_and_chain(seed: int, length: int = HUB_NEIGHBOURS + 4, size: int = 3) -> tuple[list, list]:
    """A chain of operators, each joined to the next, and one hub joined to every one of them (a tensor every
    layer reads), with random costs."""
    rng = np.random.default_rng(seed)
    unary = [rng.random(size) for _ in range(length + 1)]
    identity = np.arange(size)
    factors = []
    for node in range(1, length):
        factors.append((Factor((node, node + 1), (identity, identity), rng.random((size, size))), (node, node + 1)))
    for node in range(1, length + 1):
        factors.append((Factor((0, node), (identity, identity), 2 * rng.random((size, size))), (0, node)))
    return unary, factors


@pytest.mark.parametrize("seed", range(6))
def test_held_at_the_best_plan_s_hub_the_search_finds_the_best_plan(seed):
    unary, factors = _hub_and_chain(seed)
    best, best_value = Solver(sizes=[len(u) for u in unary], factors=[f for f, _ in factors]).solve(unary)
    assert _value(unary, factors, best) == pytest.approx(best_value, rel=1e-12)
    start = [best[0]] + [(c + 1) % 3 for c in best[1:]]  # every operator but the hub moved off the best plan
    found = condition_on_hubs(unary, factors, start)
    assert _value(unary, factors, found) == pytest.approx(best_value, rel=1e-12)


@pytest.mark.parametrize("seed", range(6))
def test_the_plan_is_never_worse_than_the_one_given_nor_than_one_move_at_a_time(seed):
    unary, factors = _hub_and_chain(seed)
    start = [int(np.argmax(u)) for u in unary]
    moved = descend(unary, factors, start)
    found = condition_on_hubs(unary, factors, moved)
    assert _value(unary, factors, found) <= _value(unary, factors, moved) <= _value(unary, factors, start)


def test_without_a_hub_the_plan_is_left_as_it_is():
    unary, factors = _hub_and_chain(0, length=HUB_NEIGHBOURS - 1)
    start = [0] * len(unary)
    assert condition_on_hubs(unary, factors, start) == start


def test_held_hubs_search_a_folded_run_as_its_copies_one_by_one():
    """With the hubs held, a folded run's copies read them alike, so the search folds them (given the runs):
    the same objective as searching the copies one by one, on a GPT whose layers share their weights' Transposes
    (each a hub, read by all ten layers), from a plan taking each operator's cheapest candidate."""
    from autopar.cost import CostModel
    from autopar.graph import load_model
    from autopar.search import costing
    from autopar.search.costing import build_problem
    from tests.conftest import profile
    from tests.plain_gpt import build_plain_gpt

    patched = pytest.MonkeyPatch()
    patched.setattr(costing, "_weight_only", lambda graph, rules, shared: [])  # the Transposes free to split
    try:
        model = build_plain_gpt(layers=10, hidden=64, heads=4, seq=16, vocab=128, batch=8, shared_layers=True)
        problem = build_problem(load_model(model), CostModel(profile()), 4)
    finally:
        patched.undo()
    ((repeat, _),) = problem.folds
    unary, factors = list(problem.node_time), problem.all_factors(False)
    neighbours = [{u for _, scope in factors if node in scope for u in scope} - {node} for node in range(len(unary))]
    hubs = [node for node, around in enumerate(neighbours) if len(around) > HUB_NEIGHBOURS]
    assert hubs and all(hub not in repeat.folded and hub != repeat.last(-1) for hub in hubs)  # folded, then
    start = [int(np.argmin(costs)) for costs in unary]
    one_by_one = condition_on_hubs(unary, factors, start)
    folded = condition_on_hubs(unary, factors, start, folded=(problem.factors, problem.folds))
    assert _value(unary, factors, folded) == pytest.approx(_value(unary, factors, one_by_one), rel=1e-12)
    assert _value(unary, factors, folded) < _value(unary, factors, start)
