"""Repeated blocks: found from structure alone, folded exactly (folded DP == unfolded DP == ILP == brute force)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper

from autopar.cost import CostModel
from autopar.graph import load_model
from autopar.search import fold, repeats
from autopar.search.costing import build_problem
from autopar.search.driver import SearchOptions, run_search
from autopar.search.fold import CopyRuns, Solver, min_plus
from autopar.search.pipeline import PipelineShape, stage_problem
from models.transformer import build_preset
from tests.conftest import make_model, profile, weight


def residual_stack(blocks: int, width: int = 8, batch: int = 8, widths: list[int] | None = None, fan_out: bool = True):
    """x -> [MatMul, Relu, MatMul, Add(x), Relu] * blocks, with the block input read twice (fan-out)."""
    nodes, inits = [], []
    x = "X"
    for b in range(blocks):
        hidden = (widths or [2 * width] * blocks)[b]
        nodes += [
            helper.make_node("MatMul", [x, f"W{b}a"], [f"h{b}"], name=f"n{b * 7}"),
            helper.make_node("Relu", [f"h{b}"], [f"r{b}"], name=f"n{b * 7 + 1}"),
            helper.make_node("MatMul", [f"r{b}", f"W{b}b"], [f"o{b}"], name=f"n{b * 7 + 2}"),
            helper.make_node("Add", [f"o{b}", x if fan_out else f"o{b}"], [f"s{b}"], name=f"n{b * 7 + 3}"),
            helper.make_node("Relu", [f"s{b}"], [f"y{b}"], name=f"n{b * 7 + 4}"),
        ]
        inits += [weight(f"W{b}a", [width, hidden], 2 * b), weight(f"W{b}b", [hidden, width], 2 * b + 1)]
        x = f"y{b}"
    nodes.append(helper.make_node("ReduceSum", [x], ["loss"], name="loss", keepdims=0))
    return make_model(nodes, [("X", TensorProto.FLOAT, [batch, width])], ["loss"], inits)


@pytest.fixture(autouse=True)
def fold_short_runs(monkeypatch):
    """Fold runs of two copies too: small stacks exercise every part of the folding."""
    monkeypatch.setattr(repeats, "MIN_FOLDED_COPIES", 2)


def folded_and_unfolded(model, devices: int, peak: float = 1e9):
    graph = load_model(model)
    cost = CostModel(profile(peak=peak))
    return build_problem(graph, cost, devices), build_problem(graph, cost, devices, fold=False)


@pytest.mark.parametrize("blocks", [3, 4, 6])
@pytest.mark.parametrize("devices", [4, 16])
def test_folded_equals_unfolded_and_ilp_on_residual_stacks(blocks, devices):
    folded, unfolded = folded_and_unfolded(residual_stack(blocks), devices)
    assert [(r.period, r.copies) for r, _ in folded.folds] == [(5, blocks - 1)]
    fast = unfolded.objective(run_search(folded).choice)
    slow = unfolded.objective(run_search(unfolded).choice)
    assert fast == pytest.approx(slow, rel=1e-12)
    pytest.importorskip("highspy")
    exact = unfolded.objective(run_search(unfolded, SearchOptions(algorithm="ilp")).choice)
    assert fast == pytest.approx(exact, rel=1e-7)


def test_two_blocks_are_not_folded():
    folded, _ = folded_and_unfolded(residual_stack(2), 4)
    assert folded.folds == []


def test_by_default_only_runs_long_enough_to_pay_are_folded(monkeypatch):
    monkeypatch.setattr(repeats, "MIN_FOLDED_COPIES", 4)
    assert folded_and_unfolded(residual_stack(4), 4)[0].folds == []
    assert [(r.period, r.copies) for r, _ in folded_and_unfolded(residual_stack(5), 4)[0].folds] == [(5, 4)]


def test_a_block_that_differs_in_one_shape_is_not_folded_with_the_others():
    folded, unfolded = folded_and_unfolded(residual_stack(5, widths=[16, 16, 16, 32, 16]), 8)
    for repeat, _ in folded.folds:
        assert not any(3 * 5 <= node < 4 * 5 for k in range(1, repeat.copies) for node in repeat.block(k))
    assert unfolded.objective(run_search(folded).choice) == pytest.approx(
        unfolded.objective(run_search(unfolded).choice), rel=1e-12
    )


def test_transformer_layers_fold_whatever_the_node_names():
    model = build_preset("bert-base", layers=4, hidden=64, heads=2, seq=16, batch=4)
    scrambled = build_preset("bert-base", layers=4, hidden=64, heads=2, seq=16, batch=4)
    order = np.random.default_rng(0).permutation(len(scrambled.graph.node))
    for node, k in zip(scrambled.graph.node, order):
        node.name = f"op_{k}"
    runs = []
    for m in (model, scrambled):
        folded, unfolded = folded_and_unfolded(m, 8)
        runs.append([(r.start, r.period, r.copies) for r, _ in folded.folds])
        assert unfolded.objective(run_search(folded).choice) == pytest.approx(
            unfolded.objective(run_search(unfolded).choice), rel=1e-12
        )
    assert runs[0] == runs[1] and runs[0], "the same layers are found whatever the names"


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    blocks=st.integers(3, 4),
    ops=st.lists(st.sampled_from(["Relu", "Sigmoid", "MatMul", "Transpose"]), min_size=1, max_size=2),
    peak=st.sampled_from([1e6, 1e9]),
)
def test_folded_equals_brute_force_on_generated_stacks(blocks, ops, peak):
    nodes, inits, x, n = [], [], "X", 0
    for _ in range(blocks):
        for kind in ops:
            out = f"t{n}"
            if kind == "MatMul":
                inits.append(weight(f"W{n}", [4, 4], n))
                nodes.append(helper.make_node("MatMul", [x, f"W{n}"], [out], name=f"n{n}"))
            elif kind == "Transpose":
                nodes.append(helper.make_node("Transpose", [x], [out], name=f"n{n}", perm=[1, 0]))
            else:
                nodes.append(helper.make_node(kind, [x], [out], name=f"n{n}"))
            x, n = out, n + 1
    nodes.append(helper.make_node("ReduceSum", [x], ["loss"], name="loss", keepdims=0))
    model = make_model(nodes, [("X", TensorProto.FLOAT, [4, 4])], ["loss"], inits)
    folded, unfolded = folded_and_unfolded(model, 2, peak)
    found = unfolded.objective(run_search(folded).choice)
    ranges = [range(len(unfolded.candidates(i))) for i in range(unfolded.size)]
    best = min(unfolded.objective(c) for c in itertools.product(*ranges))
    assert found == pytest.approx(best, rel=1e-9, abs=1e-18)


def test_min_plus_product_matches_its_definition():
    rng = np.random.default_rng(1)
    a, b = rng.random((5, 7)), rng.random((7, 3))
    product, middle = min_plus(a, b)
    expected = (a[:, :, None] + b[None, :, :]).min(axis=1)
    assert np.array_equal(product, expected)
    assert np.array_equal(
        np.take_along_axis(a, middle, axis=1)[:, :, None].squeeze(-1) + b[middle, np.arange(3)], product
    )


def test_overlap_windows_do_not_depend_on_folding(monkeypatch):
    """A gradient sync hides behind the backward back to its block's start, folded or not: same optimum."""
    from autopar.search import repeats as repeats_module
    from autopar.search.driver import run_search
    from models.transformer import build_preset

    monkeypatch.setattr(repeats_module, "MIN_FOLDED_COPIES", 2)
    graph = load_model(build_preset("gpt2", layers=4, hidden=64, heads=2, seq=16, vocab=128, batch=8))
    folded = build_problem(graph, CostModel(profile()), 8)
    unfolded = build_problem(graph, CostModel(profile()), 8, fold=False)
    assert folded.folds and not unfolded.folds
    assert sum(float(h.max()) for h in folded.node_hidden) > 0  # overlap is at work
    best = folded.objective(run_search(folded).choice)
    assert best == pytest.approx(unfolded.objective(run_search(unfolded).choice), rel=1e-12)


@pytest.mark.parametrize("shape", [(1, 3, 5), (7, 4, 2), (33, 17, 9)])
def test_a_min_plus_product_split_between_threads_is_the_same_bit_for_bit(shape, monkeypatch):
    """A large product's rows are split between threads: every entry and every argmin (the first of equal
    sums) is what one thread finds, ties included."""
    from autopar.search import dp, fold

    rows, inner, columns = shape
    rng = np.random.default_rng(rows)
    a = rng.integers(0, 4, (rows, inner)).astype(float)  # small integers: many equal sums
    b = rng.integers(0, 4, (inner, columns)).astype(float)
    alone = fold.min_plus(a, b)
    monkeypatch.setattr(dp, "_PARALLEL_CELLS", 1)
    monkeypatch.setattr(fold, "_PRODUCT_CHUNK_CELLS", 8)
    shared = fold.min_plus(a, b)
    assert np.array_equal(alone[0], shared[0]) and np.array_equal(alone[1], shared[1])
    assert np.array_equal(alone[0], (a[:, :, None] + b[None, :, :]).min(axis=1))
    assert np.array_equal(alone[1], (a[:, :, None] + b[None, :, :]).argmin(axis=1))


def test_a_relaxed_run_bounds_the_optimum_from_below_and_its_plan_from_above(monkeypatch):
    """Where searching a run copy by copy would split its steps, each copy reads the operators the copies share
    (here the shared layers' weight Transposes, free to split) in its own best layout: one chain again. Its value
    is then no more than the exact optimum, and its plan, costed as it is, no less, on 20 random costs (each copy's
    alike, as the fold takes them)."""
    from autopar.search import costing
    from autopar.search.dp import TableLimits
    from autopar.search.fold import Solver
    from tests.plain_gpt import build_plain_gpt

    monkeypatch.setattr(costing, "_weight_only", lambda graph, rules, shared: [])
    model = build_plain_gpt(layers=6, hidden=64, heads=4, seq=16, vocab=128, batch=8, shared_layers=True)
    problem = build_problem(load_model(model), CostModel(profile()), 2)  # (on 4 devices: 8 s an exact solve)
    exact = Solver.of(problem)
    (run,) = exact.runs
    assert exact.exact and run.shared  # whole, the copies' chain is one per joint class of what they share
    relaxed = Solver.of(problem, TableLimits(exact.largest, 300))  # copy by copy, this would split its steps
    assert relaxed.relaxed == (0,) and not relaxed.splits and not relaxed.exact
    factors = problem.all_factors(False)

    def objective(unary, choice):
        edges = sum(factor.value([choice[u] for u in scope]) for factor, scope in factors)
        return sum(float(u[c]) for u, c in zip(unary, choice)) + edges

    rng = np.random.default_rng(7)
    ratios = []
    for _ in range(20):
        scaled: dict[int, np.ndarray] = {}  # the copies share their costs' arrays: random, they still do
        unary = [scaled.setdefault(id(t), t * rng.uniform(0.5, 2.0, len(t))) for t in problem.node_time]
        best_choice, best = exact.solve(unary)
        choice, bound = relaxed.solve(unary)
        assert objective(unary, best_choice) == pytest.approx(best, rel=1e-12)
        assert bound <= best * (1 + 1e-12)
        assert objective(unary, choice) >= best * (1 - 1e-12)
        ratios.append(bound / best)
    assert min(ratios) > 0.99  # what a copy gains reading them its own way is little here (0.1 % at most)


def test_stages_cut_from_one_problem_share_their_copies_elimination():
    """Stages of one place with different numbers of copies, cut from one problem with their arrays shared (as
    the cut search cuts them), run one copy elimination between them where their copies' costs are the same,
    and one elimination of their first copy (which reads the stage before, so is no copy of their run: `_Lead`):
    the later stage takes the earlier one's (`CopyRuns`) and solves as it solves alone."""
    problem = build_problem(load_model(residual_stack(8, batch=8)), CostModel(profile(peak=1e9)), 4)
    shape, made, copies = PipelineShape(2, 4), {}, CopyRuns()
    starts = [block.start for block in (problem.folds[0][0].block(k) for k in (2, 4))]
    for start in starts:
        stage = stage_problem(problem, start, problem.size, shape, 1, made=made)
        assert stage.folds and stage.folds[0][0].copies >= 2
        unary = list(stage.node_time)
        solver = Solver.of(stage, copies=copies)
        assert solver.lead is not None and solver.lead.eliminated  # the stage's first copy, eliminated on its own
        assert solver.solve(unary) == Solver.of(stage).solve(unary)
    assert len(copies) == 2  # the run's copy and the stages' first copy: each eliminated once for both stages


def test_a_later_stage_eliminates_its_first_copy_on_its_own_as_its_main_graph_did(monkeypatch):
    """A later stage's first copy reads what the stage before sends, so it is no copy of the stage's run: it is
    eliminated on its own (`fold._Lead`), down to its last operator, which the run reads. Its plan and value are
    the main graph's that eliminated it before, on costs the copies share and costs of their own."""
    problem = build_problem(load_model(residual_stack(6, batch=8)), CostModel(profile(peak=1e9)), 4)
    start = problem.folds[0][0].block(2).start
    stage = stage_problem(problem, start, problem.size, PipelineShape(2, 4), 1)
    led = Solver.of(stage)
    assert led.lead is not None and led.lead.keep == (problem.folds[0][0].period - 1,)
    monkeypatch.setattr(fold._Lead, "of", classmethod(lambda cls, *args: None))
    plain = Solver.of(stage)
    assert plain.lead is None
    factors = stage.all_factors(False)
    rng = np.random.default_rng(3)
    for _ in range(10):
        scaled: dict[int, np.ndarray] = {}
        unary = [scaled.setdefault(id(t), t * rng.uniform(0.5, 2.0, len(t))) for t in stage.node_time]
        choice, value = led.solve(unary)
        plain_choice, plain_value = plain.solve(unary)
        objective = sum(float(u[c]) for u, c in zip(unary, choice))
        objective += sum(factor.value([choice[u] for u in scope]) for factor, scope in factors)
        assert value == pytest.approx(plain_value, rel=1e-12)
        assert objective == pytest.approx(plain_value, rel=1e-12)
        assert choice == plain_choice
