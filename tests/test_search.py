"""The elimination DP is exact: it equals brute force over `candidates` on random small graphs."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper

import autopar
from autopar.cost import CostModel
from autopar.graph import load_model
from autopar.search.costing import build_problem, build_with_latency
from autopar.search.dp import Elimination, Factor, TableLimits, tie_break_unary
from autopar.search.driver import SearchOptions, data_parallel_choice, run_search
from autopar.search.fold import Solver, minimise
from tests.conftest import every_plan, make_model, profile, random_model

BRUTE_FORCE_LIMIT = 3000
DATA = Path(__file__).resolve().parent / "data"


def brute_force(problem):
    ranges = [range(len(problem.candidates(i))) for i in range(problem.size)]
    best, best_choice = float("inf"), None
    for choice in itertools.product(*ranges):
        value = problem.objective(choice)
        if value < best:
            best, best_choice = value, choice
    return best, best_choice


@settings(max_examples=220, deadline=None, suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1), devices=st.sampled_from([2, 4]), peak=st.sampled_from([1e6, 1e9, 1e12]))
def test_dp_equals_brute_force_on_random_graphs(seed, devices, peak):
    model = random_model(seed)
    problem = build_problem(load_model(model), CostModel(profile(peak=peak)), devices)
    space = np.prod([float(len(problem.candidates(i))) for i in range(problem.size)])
    assume(space <= BRUTE_FORCE_LIMIT)
    best, _ = brute_force(problem)
    result = run_search(problem)
    assert problem.objective(result.choice) == pytest.approx(best, rel=1e-8, abs=1e-18)
    # and without the tie-break penalty the elimination is exact to rounding
    exact = minimise(problem, problem.node_time)
    assert problem.objective(exact) == pytest.approx(best, rel=1e-12, abs=1e-18)


def test_dp_matches_public_api_brute_force():
    """The outside view: enumerate `autopar.candidates` and score with `autopar.evaluate`."""
    model = random_model(7)
    prof = profile()
    cands = autopar.candidates(model, devices=2)
    plan = autopar.plan(model, devices=2, cost_model=prof)
    problem = autopar.build(model, 2, prof)
    names = list(cands)
    best = min(
        problem.objective([cands[n].index(s) for n, s in zip(names, combo)])
        for combo in itertools.product(*(cands[n] for n in names))
    )
    assert plan.objective == pytest.approx(best, rel=1e-9)
    assert plan.objective == pytest.approx(autopar.evaluate(model, 2, plan.strategies, cost_model=prof), rel=1e-12)


def test_the_latency_twin_is_the_problem_with_its_edges_at_zero_bytes():
    """`build_with_latency`: its first problem is `build_problem`'s, table for table; its twin has the same
    operators, each edge no dearer (its collectives' latency, no bytes), and some edge cheaper (bytes cost)."""
    model, cost = random_model(11), CostModel(profile())
    plain = build_problem(load_model(model), cost, 4)
    problem, latency = build_with_latency(load_model(model), cost, 4)
    assert len(problem.factors) == len(plain.factors) == len(latency.factors) > 0
    for ours, theirs, least in zip(problem.factors, plain.factors, latency.factors):
        assert ours.scope == theirs.scope == least.scope
        assert np.array_equal(ours.table, theirs.table)
        assert (least.table <= ours.table).all() and (least.table >= 0.0).all()
    assert any((least.table < ours.table).any() for ours, least in zip(problem.factors, latency.factors))
    for name in ("node_time", "node_memory", "node_compute"):
        for ours, theirs, least in zip(getattr(problem, name), getattr(plain, name), getattr(latency, name)):
            assert np.array_equal(ours, theirs) and np.array_equal(ours, least)


def test_ties_go_to_data_parallel():
    # a Relu chain: every split of the same size costs the same; the batch split must win
    nodes = [helper.make_node("Relu", ["X"], ["a"], name="r1"), helper.make_node("Relu", ["a"], ["b"], name="r2")]
    model = make_model(nodes, [("X", TensorProto.FLOAT, [8, 8])], ["b"])
    plan = autopar.plan(model, devices=4, cost_model=profile(peak=1e6))
    assert plan.strategies == {"r1": ((4, 1),), "r2": ((4, 1),)}


def test_memory_capacity_is_respected():
    model = random_model(3)
    unconstrained = build_problem(load_model(model), CostModel(profile()), 4)
    fastest = run_search(unconstrained).choice
    need = unconstrained.memory(fastest)
    lean = minimise(unconstrained, unconstrained.node_memory)
    floor = unconstrained.memory(lean)
    assume_capacity = (need + floor) / 2
    if floor >= need:
        pytest.skip("the fastest plan is already the leanest for this graph")
    problem = build_problem(load_model(model), CostModel(profile(capacity=assume_capacity)), 4)
    result = run_search(problem)
    chosen = (result.choice, result.choices)
    assert problem.memory(*chosen) <= assume_capacity
    feasible = [plan for plan in every_plan(problem) if problem.memory(*plan) <= assume_capacity]
    best_feasible = min(problem.objective(*plan) for plan in feasible)
    # The constrained DP minimises time + lambda * memory, so no assignment beats its plan on time without using
    # more memory (it need not be the best feasible plan: that is the ILP's job).
    time, memory = problem.objective(*chosen), problem.memory(*chosen)
    dominating = [p for p in feasible if problem.objective(*p) < time * (1 - 1e-12) and problem.memory(*p) <= memory]
    assert not dominating, (chosen, time, memory, dominating[:3])
    try:
        import highspy  # noqa: F401
    except ImportError:
        return
    from autopar.search.ilp import solve_ilp

    exact = solve_ilp(problem, assume_capacity)
    assert problem.memory(*exact) <= assume_capacity * (1 + 1e-9)
    assert problem.objective(*exact) == pytest.approx(best_feasible, rel=1e-9)


def test_infeasible_memory_is_a_clear_error():
    with pytest.raises(autopar.AutoparError, match="Nothing fits in device memory"):
        autopar.plan(random_model(3), devices=2, cost_model=profile(capacity=1.0))


def test_data_parallel_choice_is_the_first_candidate():
    problem = build_problem(load_model(random_model(11)), CostModel(profile()), 4)
    for rule, c in zip(problem.rules, data_parallel_choice(problem)):
        assert rule.candidates[c] == rule.data_parallel


def test_tie_break_never_outweighs_a_real_difference():
    problem = build_problem(load_model(random_model(5)), CostModel(profile()), 2)
    base = problem.objective(data_parallel_choice(problem))
    unary = tie_break_unary(problem.node_time, base)
    total_penalty = sum(float(u[-1] - t[-1]) for u, t in zip(unary, problem.node_time))
    assert 0 <= total_penalty <= 1e-9 * base * 1.0000001


def _ring(seed: int, apart_classes: int) -> tuple[list[int], list[Factor], list[np.ndarray]]:
    """Six operators in a chain (0..5) and operator 6 reading both ends, as T5's shifted labels are read
    by the decoder's first operator and by the loss; operator 6's three candidates show
    ``apart_classes`` layouts."""
    rng = np.random.default_rng(seed)
    three = np.arange(3)
    ends = np.minimum(three, apart_classes - 1)
    factors = [Factor((i, i + 1), (three, three), rng.random((3, 3))) for i in range(5)]
    factors += [Factor((end, 6), (three, ends), rng.random((3, apart_classes))) for end in (0, 5)]
    return [3] * 7, factors, [rng.random(3) for _ in range(7)]


def _brute_force_total(factors: list[Factor], unary: list[np.ndarray]) -> tuple[float, float]:
    """(the least total over every assignment, a function giving any assignment's total)."""

    def total(choice) -> float:
        edges = sum(f.value([choice[u] for u in f.scope]) for f in factors)
        return sum(float(u[c]) for u, c in zip(unary, choice)) + edges

    return min(total(c) for c in itertools.product(*(range(len(u)) for u in unary))), total


@pytest.mark.parametrize("seed", range(8))
def test_an_operator_of_one_layout_joins_nothing_and_stays_exact(seed):
    """Eliminated apart, the one-class operator leaves the ring a chain: no table over three operators."""
    sizes, factors, unary = _ring(seed, apart_classes=1)
    elimination = Elimination(sizes, factors)
    best, total = _brute_force_total(factors, unary)
    assert total(elimination.run(unary).backtrack()) == pytest.approx(best, rel=1e-12)
    assert elimination.largest == 9
    sizes, factors, unary = _ring(seed, apart_classes=2)  # two layouts: the ring must be closed by a table of 3
    assert Elimination(sizes, factors).largest == 18


@pytest.mark.parametrize("name", ["hf_t5_legacy", "hf_swin_legacy"])
def test_exports_dp_equals_ilp(name):
    """Two exports where splitting pays: T5, whose shifted labels are read at both ends (by the decoder's first
    operator, and whole by the loss), and Swin, whose elimination takes operators of one layout apart (the
    one-class path above): the DP's plan scores what HiGHS's exact ILP finds."""
    pytest.importorskip("highspy")
    problem = build_problem(load_model(DATA / f"{name}.onnx"), CostModel(profile(peak=1e9)), 4)
    if name == "hf_swin_legacy":
        assert any(step.apart for step in Solver.of(problem).main.steps)
    dp = problem.objective(run_search(problem).choice)
    assert dp == pytest.approx(problem.objective(run_search(problem, SearchOptions(algorithm="ilp")).choice), rel=1e-9)


def _routed_cycle(seed: int) -> tuple[list[int], list[Factor], list[np.ndarray]]:
    """A mixture of experts' routing in miniature: operators 1 and 3 (eight layouts each, the dispatch and
    combine Einsums) meet through operator 2 (two layouts, a Reshape between them: the experts) and
    through 4 and 5 (the routing tensors), which the router, operator 0, feeds along with 1."""
    rng = np.random.default_rng(seed)
    sizes = [3, 8, 2, 8, 6, 4]
    edges = [(0, 1), (1, 2), (2, 3), (1, 4), (4, 5), (5, 3), (0, 4), (0, 5)]
    factors = [
        Factor((a, b), (np.arange(sizes[a]), np.arange(sizes[b])), rng.random((sizes[a], sizes[b]))) for a, b in edges
    ]
    return sizes, factors, [rng.random(n) for n in sizes]


@pytest.mark.parametrize("seed", range(3))
def test_weighted_fill_closes_a_cycle_over_its_cheapest_operator(seed, monkeypatch):
    """Every local rule eliminates the two-layout operator 2 first (its table is the smallest) and so joins
    the two eight-layout operators, which the cycle through 4 and 5 must then carry together: a table of
    3 x 8 x 8 x 3 = 576 entries at best. Weighted min-fill sees the pair of eight-layout neighbours it would
    join and keeps operator 2 for the end: no table over both, 288 entries at most. Under a limit between
    the two, only that order plans (a cheap first order is kept without trying the others, so the limit
    is what makes the search look further); it is exact (brute force over all 9,216 assignments)."""
    sizes, factors, unary = _routed_cycle(seed)
    assert Elimination(sizes, factors).largest == 576
    elimination = Elimination(sizes, factors, limits=TableLimits(entries=300))
    assert elimination.largest == 288 and elimination.exact
    best, total = _brute_force_total(factors, unary)
    assert total(elimination.run(unary).backtrack()) == pytest.approx(best, rel=1e-12)


def test_an_elimination_with_refused_orders_is_freed_when_dropped_without_the_collector(monkeypatch):
    """An order refused as too large is let go of once another order plans, and so is every exact order's
    refusal where the elimination is then split (`dp._split`): no cycle runs through a frame (a refusal's
    traceback holds it), which holds the elimination and, through its callers, a whole search until the
    cycle collector runs."""
    import gc
    import weakref

    sizes, factors, _ = _routed_cycle(0)
    planned: list[weakref.ref] = []
    structure = Elimination._structure
    monkeypatch.setattr(Elimination, "_structure", lambda self: planned.append(weakref.ref(self)) or structure(self))
    collecting = gc.isenabled()
    gc.disable()
    try:
        elimination = Elimination(sizes, factors, limits=TableLimits(entries=300))  # only weighted fill plans
        assert elimination.largest == 288
        del elimination
        elimination = Elimination(sizes, factors, limits=TableLimits(entries=100))  # every exact order refused
        assert not elimination.exact
        del elimination
        assert len(planned) == 2 and all(held() is None for held in planned)
    finally:
        if collecting:
            gc.enable()


@pytest.mark.parametrize("seed", range(12))
def test_an_elimination_past_its_limits_answers_with_a_plan_and_a_lower_bound(seed):
    """Where every exact order passes the table limits, steps are split into groups within them: the value
    `run` gives is at most the least total (brute force over every assignment), and the plan it backtracks
    costs at least that; within the limits the value is the plan's total, the optimum."""
    sizes, factors, unary = _routed_cycle(seed)
    best, total = _brute_force_total(factors, unary)
    exact = Elimination(sizes, factors).run(unary)
    assert exact.value == pytest.approx(best, rel=1e-12) == total(exact.backtrack())
    for entries in (100, 40, 20):
        elimination = Elimination(sizes, factors, limits=TableLimits(entries=entries, left=entries))
        assert not elimination.exact and elimination.largest <= max(entries, 64)
        solved = elimination.run(unary)
        assert solved.value <= best * (1 + 1e-12)
        assert total(solved.backtrack()) >= best * (1 - 1e-12)


@pytest.mark.parametrize("cells", [1, 7, 64, 1 << 18])
def test_a_step_sums_and_minimises_the_same_in_slabs_of_rows_or_of_blocks(cells, monkeypatch):
    """A row larger than a slab is summed a block of its second axis at a time: every entry is the
    broadcast sum's minimum, bit for bit, whatever the slab and however the parts broadcast."""
    from autopar.search import dp

    monkeypatch.setattr(dp, "_SLAB_CELLS", cells)
    rng = np.random.default_rng(cells)
    for shape in [(5, 9, 4), (3, 1, 6), (1, 40, 3), (6, 7, 2, 5), (4, 11)]:
        for _ in range(4):
            parts = [
                rng.random(tuple(n if rng.random() < 0.6 else 1 for n in shape)) for _ in range(rng.integers(1, 4))
            ]
            parts.append(rng.random(shape))
            whole = parts[0]
            for part in parts[1:]:
                whole = whole + part
            assert np.array_equal(dp._sum_min(parts), whole.min(axis=-1))


def test_an_elimination_of_a_structure_planned_before_takes_its_plan(monkeypatch):
    """Planning reads the structure only (candidate counts, scopes, class maps, table shapes, kept operators,
    ties, the limits), so a second elimination of the same structure in one plan (`autopar.context`) takes the
    first one's plan without planning, and runs to the same minimum on other tables; a class map or a limit
    that differs plans anew, and so does an elimination in another plan."""
    from autopar.context import opened

    sizes, factors, unary = _routed_cycle(0)
    rng = np.random.default_rng(1)
    other = [Factor(f.scope, f.maps, rng.random(f.table.shape)) for f in factors]
    alone = Elimination(sizes, other).run(unary).backtrack()
    with opened():
        first = Elimination(sizes, factors)
        planned = []
        with monkeypatch.context() as patched:
            patched.setattr(Elimination, "_plan", lambda self, *args: planned.append(args) or pytest.fail("planned"))
            again = Elimination(sizes, other)
        assert again.steps is first.steps and not planned
        assert again.run(unary).backtrack() == alone
        merged = [Factor(f.scope, (np.zeros_like(f.maps[0]), f.maps[1]), f.table[:1]) for f in factors[:1]]
        assert Elimination(sizes, merged + factors[1:]).steps is not first.steps
        assert Elimination(sizes, factors, limits=TableLimits(entries=300)).steps is not first.steps
    assert Elimination(sizes, factors).steps is not first.steps  # another plan plans anew


def test_a_search_given_the_runs_of_one_before_it_takes_them_and_finds_the_same_plan(monkeypatch):
    """`SearchCache`: a second search of one problem takes the first's solver and its DP runs at the weights
    both try (the fastest plan's, at weight 0) and finds the plan a search without them finds; it serves
    no other problem, even an equal one."""
    from autopar.search.driver import SearchCache

    model = random_model(3)
    problem = build_problem(load_model(model), CostModel(profile()), 4)
    cache = SearchCache()
    first = run_search(problem, cache=cache)
    assert cache.solver is not None and (0.0, False, 1.0) in cache.runs
    runs = []
    original = Solver.solve
    monkeypatch.setattr(Solver, "solve", lambda self, unary: runs.append(1) or original(self, unary))
    again = run_search(problem, cache=cache)
    assert not runs and again.choice == first.choice
    assert run_search(problem).choice == first.choice and runs
    other = build_problem(load_model(model), CostModel(profile()), 4)
    with pytest.raises(ValueError, match="one problem"):
        run_search(other, cache=cache)


def test_a_bounded_search_brackets_the_ilp_optimum():
    """The gap is honest: on 20 random problems small enough for HiGHS's exact ILP, searched with table limits
    so small that most steps are split, the lower bound the search gives is at most the ILP's optimum and
    its plan is at least as slow; half of them with so little memory that it binds (the bound is then
    Lagrangian). Within today's limits the same problems are exact: the bound is the plan's own time."""
    pytest.importorskip("highspy")
    from autopar.errors import InfeasibleError

    split = bound_by_memory = 0
    for seed in range(20):
        model = load_model(random_model(seed))
        problem = build_problem(model, CostModel(profile(peak=1e8)), 8)
        if seed % 2:  # a device with room for half of what the fastest plan needs over the leanest
            fastest = run_search(problem)
            floor = problem.memory_floor(False)
            capacity = floor + 0.5 * (problem.memory(fastest.choice, fastest.choices) - floor)
            problem = build_problem(model, CostModel(profile(capacity=capacity, peak=1e8)), 8)
        try:
            optimum = run_search(problem, SearchOptions(algorithm="ilp"))
        except InfeasibleError:
            continue
        best = problem.objective(optimum.choice, optimum.choices)
        exact = run_search(problem)
        if exact.exact:
            assert exact.bound_s == problem.objective(exact.choice, exact.choices) == pytest.approx(best, rel=1e-9)
        found = run_search(problem, SearchOptions(table_limits=TableLimits(entries=16, left=4)))
        planned = problem.objective(found.choice, found.choices)
        assert found.bound_s is not None and found.bound_s <= best * (1 + 1e-9) + 1e-15
        assert planned >= best * (1 - 1e-9)
        split += found.steps_split > 0
        bound_by_memory += found.memory_multiplier > 0
    assert split >= 10 and bound_by_memory >= 3
