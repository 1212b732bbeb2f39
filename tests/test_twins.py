"""Twin branches: found from the tables alone, and tying them keeps the DP's optimum exactly.

The interleaved rotary's diamond (two Gathers both feeding a Sub and an Add) is the case that
needs it: tied, Llama's layer is a chain again and 64 devices plan; the objective equals the
untied DP's, the unfolded DP's and the ILP's.
"""

from __future__ import annotations

import numpy as np
import pytest

import autopar
from autopar.cost import CostModel
from autopar.graph import load_model
from autopar.search.costing import build_problem
from autopar.search.dp import Elimination, Factor
from autopar.search.driver import SearchOptions, run_search
from autopar.search.fold import Solver
from autopar.search.twins import find_twins
from tests.conftest import profile
from tests.torch_llama import DATA

INTERLEAVED = DATA / "torch_llama_interleaved_dynamo.onnx"

# x -> (g0, g1) -> four products g_i -> m_ij -> (a, b) -> c: the rotary's diamond, as tables
X, G0, G1, M0A, M0B, M1A, M1B, A, B, C = range(10)
DIAMOND = [
    (X, G0, "read"),
    (X, G1, "read"),
    (G0, M0A, "product"),
    (G0, M0B, "product"),
    (G1, M1A, "product"),
    (G1, M1B, "product"),
    (M0A, A, "term"),
    (M1A, A, "term"),
    (M0B, B, "term"),
    (M1B, B, "term"),
    (A, C, "stack"),
    (B, C, "stack"),
]
KINDS = ["x", "g", "g", "m", "m", "m", "m", "ab", "ab", "c"]


def test_a_diamond_of_like_branches_ties_down_to_a_chain():
    ties = find_twins(10, DIAMOND, KINDS, [0] * 10)
    # the odd half takes the even half's candidates, then the Add the Sub's
    assert ties == {G1: G0, M1A: M0A, M1B: M0A, M0B: M0A, B: A}


@pytest.mark.parametrize(
    "change",
    [
        "costs",  # the Sub and the Add cost differently
        "table",  # one product reads its Gather through another table
        "between",  # a table joins the two halves
        "region",  # the halves lie in different parts of the search
    ],
)
def test_branches_that_differ_are_not_tied(change):
    edges, kinds, regions = list(DIAMOND), list(KINDS), [0] * 10
    if change == "costs":
        kinds[B] = "other"
    elif change == "table":
        edges[5] = (G1, M1B, "other product")
    elif change == "between":
        edges.append((G0, G1, "across"))
    else:
        regions[G1] = regions[M1A] = regions[M1B] = 1
    ties = find_twins(10, edges, kinds, regions)
    if change == "costs":
        assert B not in ties and A not in ties  # the Gathers still are twins
        assert ties.get(G1) == G0
    elif change == "table":
        assert G1 not in ties and G0 not in ties
    else:
        assert G1 not in ties and G0 not in ties


def _random_diamond(seed: int, sizes: int = 3) -> tuple[list[int], list[Factor], list[np.ndarray]]:
    """The diamond's factors with random tables, alike where the branches are alike."""
    rng = np.random.default_rng(seed)
    tables = {kind: rng.random((sizes, sizes)) for _, _, kind in DIAMOND}
    maps = np.arange(sizes)
    factors = [Factor((src, dst), (maps, maps), tables[kind]) for src, dst, kind in DIAMOND]
    by_kind = {kind: rng.random(sizes) for kind in set(KINDS)}
    return [sizes] * 10, factors, [by_kind[kind] for kind in KINDS]


def _total(factors: list[Factor], unary: list[np.ndarray], choice: list[int]) -> float:
    return sum(float(u[c]) for u, c in zip(unary, choice)) + sum(f.value([choice[u] for u in f.scope]) for f in factors)


def _brute_force(factors: list[Factor], unary: list[np.ndarray]) -> float:
    """The least total over every assignment, summed as one broadcast array."""
    rank = len(unary)
    total = np.zeros((1,) * rank)
    for node, costs in enumerate(unary):
        total = total + costs.reshape([-1 if axis == node else 1 for axis in range(rank)])
    for factor in factors:
        (i, j), table = factor.scope, factor.table
        total = total + table.reshape([table.shape[(i, j).index(a)] if a in (i, j) else 1 for a in range(rank)])
    return float(total.min())


@pytest.mark.parametrize("seed", range(20))
def test_tied_elimination_equals_brute_force(seed):
    sizes, factors, unary = _random_diamond(seed)
    ties = find_twins(10, DIAMOND, KINDS, [0] * 10)
    tied = Elimination(sizes, factors, ties=ties)
    choice = tied.run(unary).backtrack()
    assert all(choice[twin] == choice[partner] for twin, partner in ties.items())
    assert _total(factors, unary, choice) == pytest.approx(_brute_force(factors, unary), rel=1e-12)
    assert tied.largest < Elimination(sizes, factors).largest  # a chain: no table over four operators


def _cost() -> CostModel:
    return CostModel(profile())


def test_the_interleaved_rotary_is_a_chain_at_64_devices():
    """Untied, Llama's layer sums a table of 399 million entries at 64 devices (Llama-3-8B's: 3 billion)."""
    graph = load_model(INTERLEAVED)
    tied = build_problem(graph, _cost(), 64)
    untied = build_problem(graph, _cost(), 64, twins=False)
    types = {graph.ops[node].op_type for node in tied.ties}
    assert types == {"Gather", "Mul", "Add", "Unsqueeze"}  # odd half and the Add: the even half and the Sub stay
    # two rotations (queries, keys) in the folded block (every layer folds, the first too), six operators each
    assert len(tied.ties) == 12
    assert Solver.of(tied).largest < 5_000_000 < 100_000_000 < Solver.of(untied).largest


@pytest.mark.parametrize("devices", [4, 8])
def test_tied_objective_equals_untied_unfolded_and_ilp(devices):
    graph = load_model(INTERLEAVED)
    tied = build_problem(graph, _cost(), devices)
    unfolded = build_problem(graph, _cost(), devices, fold=False, twins=False)
    assert tied.ties and tied.folds
    found = unfolded.objective(run_search(tied).choice)
    assert found == pytest.approx(unfolded.objective(run_search(unfolded).choice), rel=1e-12)
    if devices == 4:
        assert found == pytest.approx(
            unfolded.objective(run_search(unfolded, SearchOptions(algorithm="ilp")).choice), rel=1e-9
        )


def test_models_without_twin_branches_have_no_ties():
    from models.transformer import build_transformer

    graph = load_model(build_transformer(kind="gpt", layers=4, hidden=64, heads=4, seq=16, vocab=128))
    assert not build_problem(graph, _cost(), 8).ties
    assert not build_problem(load_model(DATA / "torch_llama_dynamo.onnx"), _cost(), 8).ties


def test_a_tied_plan_verifies_with_gradients():
    plan = autopar.plan(INTERLEAVED, devices=16, batch=64)
    assert plan.strategies["node_select_4"] == plan.strategies["node_select_5"]
    report = autopar.verify(INTERLEAVED, plan, batch=64, gradients=True)
    assert report.ok, report.problems
