"""The pipeline-shape search (`autopar.search.shape_search`): which shapes it lists, the order it visits
them in, how ties go, and what one shape's plan tells of another's."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from autopar.graph import Graph, load_model
from autopar.options import PlanOptions
from autopar.search.pipeline import ONE_STAGE, PipelineShape
from autopar.search.shape_search import ShapeResult, ShapeSearch, _visiting_order, _wins
from models.transformer import build_transformer
from tests.conftest import profile


def _shape_search(model, options: PlanOptions) -> ShapeSearch:
    """The shape search `autopar.plan` makes for a model file under ``options``."""

    def imports(micro_batches: int) -> Graph:
        return load_model(model, batch=8 // micro_batches)

    return ShapeSearch(load_model(model), options, options.costs(), imports)


def test_a_tie_between_shapes_goes_to_the_shape_listed_first_whichever_is_searched_first():
    found = {shape: ShapeResult(None, None, None, 2.0, shape) for shape in (ONE_STAGE, PipelineShape(1, 4))}
    rank = {ONE_STAGE: 0, PipelineShape(1, 4): 1}
    assert _wins(found[ONE_STAGE], found[PipelineShape(1, 4)], rank)
    assert not _wins(found[PipelineShape(1, 4)], found[ONE_STAGE], rank)
    faster = ShapeResult(None, None, None, 1.0, PipelineShape(1, 4))
    assert _wins(faster, found[ONE_STAGE], rank)


def test_one_stage_micro_batch_counts_are_visited_from_a_quarter_of_the_way_up_the_others_after_the_stages():
    shapes = [ONE_STAGE, *(PipelineShape(1, m) for m in (2, 3, 4, 6, 8, 12, 16, 24)), PipelineShape(2, 8)]
    order = _visiting_order(shapes)
    assert [(s.stages, s.micro_batches) for s in order] == [
        (1, 1),
        (1, 4),
        (2, 8),
        (1, 3),
        (1, 2),
        (1, 6),
        (1, 8),
        (1, 12),
        (1, 16),
        (1, 24),
    ]
    assert sorted(order, key=shapes.index) == shapes  # every shape, once
    assert _visiting_order(shapes[:3]) == shapes[:3]  # too few counts to reorder


def test_one_stage_micro_batches_pass_forks_through_where_the_whole_batch_does(monkeypatch):
    """Where meeting takes the whole batch's search over its limits, every one-stage micro-batch problem's
    forks pass through from the start (no second build to meet the same limits); stages' problems still
    meet where they can."""
    model = build_transformer(kind="gpt", layers=2, hidden=64, heads=4, seq=32, vocab=256, batch=8)
    asked = _refusing_to_meet(monkeypatch, (8,))
    options = PlanOptions.resolve(4, profile(peak=1e9), None)
    shapes = _shape_search(model, options)
    assert not shapes.single.forks_meet and asked == [(8, True)]
    assert not shapes.problem(1, 2).forks_meet and asked[1:] == []  # passing through needs no check
    assert shapes.problem(2, 2).forks_meet and asked[1:] == [(4, True)]


def test_a_micro_batch_count_whose_forks_pass_through_bounds_no_multiple_of_it_where_the_whole_batch_meets(
    monkeypatch,
):
    """A plan of 4 micro-batches is one of 2, at least as fast, only if its candidates are there: where the
    2-micro-batch problem's forks pass through and the whole batch's meet, a 4-micro-batch problem may meet,
    so the 2's fastest plan bounds nothing (`ShapeSearch._fewer_micro_batches_win`)."""
    model = build_transformer(kind="gpt", layers=2, hidden=64, heads=4, seq=32, vocab=256, batch=8)
    asked = _refusing_to_meet(monkeypatch, (4,))
    options = PlanOptions.resolve(4, profile(peak=1e9), None)
    shapes = _shape_search(model, options)
    two, four = PipelineShape(1, 2), PipelineShape(1, 4)
    passing = shapes.problem(1, 2)
    assert shapes.single.forks_meet and not passing.forks_meet and asked == [(8, True), (4, True)]
    shapes._note_fastest(passing, two, 5.0)
    assert not shapes._fewer_micro_batches_win(four, 1.0)
    shapes._note_fastest(shapes.problem(1, 4), four, 5.0)  # its forks meet: it bounds its multiples
    assert shapes._fewer_micro_batches_win(PipelineShape(1, 8), 1.0)


def _refusing_to_meet(monkeypatch, batches: tuple[int, ...]) -> list[tuple[int, bool]]:
    """Costing finds the forks' meeting layouts past its table limits at these batches: the checks asked
    for, as (batch, whether forks meet), are listed."""
    from autopar.search import costing

    asked: list[tuple[int, bool]] = []
    exact = costing._Planned.exact

    def refusing(self) -> bool:
        graph = self.flow.graph
        batch = graph.tensor(graph.inputs[0]).shape[0]
        asked.append((batch, self.meet))
        return not (self.meet and batch in batches) and exact(self)

    monkeypatch.setattr(costing._Planned, "exact", refusing)
    return asked


def test_the_relaxation_of_a_micro_batch_count_is_no_slower_than_its_own_plans():
    """The whole batch's problem relaxed to a micro-batch's (activations and inputs shrunk, the splits the
    micro-batch lacks priced out) bounds that count's own problem from below: its fastest plan memory aside,
    and its best plan that fits, at capacities where memory binds and where it does not, and so does its
    Lagrangian bound at every memory weight (`memory_bound`), above the bound memory aside where memory binds;
    and every candidate the micro-batch's operators have is one the relaxation keeps."""
    from autopar.errors import InfeasibleError
    from autopar.search.driver import SearchOptions, fastest_bound, memory_bound, run_search
    from autopar.search.pipeline import stage_problem
    from autopar.search.shape_search import lacking_splits

    model = build_transformer(kind="gpt", layers=2, hidden=64, heads=4, seq=32, vocab=256, batch=16)
    compared = bound_by_memory = raised = 0
    for capacity in (0.5e6, 0.7e6, 2e6, 1e12):
        options = PlanOptions.resolve(16, profile(capacity=capacity, peak=1e9), None)
        shapes = ShapeSearch(load_model(model), options, options.costs(), lambda m: load_model(model, batch=16 // m))
        single = shapes.single
        for micro in (2, 4, 8):
            lacking = lacking_splits(single, shapes._graph(micro))
            assert lacking is not None
            own = shapes.problem(1, micro)
            for node, (rule, lacks) in enumerate(zip(single.rules, lacking)):
                kept = {c for c, lack in zip(rule.candidates, lacks) if not lack}
                assert set(own.rules[node].candidates) <= kept, rule.op.name
            shape = PipelineShape(1, micro)
            relaxed = single.micro_batch_relaxation(1 / micro, lacking, 1e3)
            stage = stage_problem(own, 0, own.size, shape, 0)
            least, fastest = fastest_bound(relaxed, SearchOptions())
            try:
                found = run_search(stage)
            except InfeasibleError:  # nothing of the micro-batches fits: nothing to bound
                continue
            seconds = stage.objective(found.choice, found.choices)
            compared += 1
            bound_by_memory += found.memory_multiplier > 0 or found.choices.recompute
            assert least <= seconds * (1 + 1e-9)
            if fastest is not None and found.fastest_s is not None:
                assert fastest <= found.fastest_s * (1 + 1e-9)
            relaxed_plan = run_search(relaxed)
            assert relaxed.objective(relaxed_plan.choice, relaxed_plan.choices) <= seconds * (1 + 1e-9)
            for weight in (1e-12, 1e-10, 1e-8, 1e-6):  # memory counted: still no faster than its best plan that fits
                counted = memory_bound(relaxed, SearchOptions(bound=0.0), weight, least)  # (every way run)
                assert least <= counted <= seconds * (1 + 1e-9)
                raised += counted > least * (1 + 1e-6)
                assert memory_bound(relaxed, SearchOptions(bound=counted), weight, least) == counted  # (refuted)
                short = memory_bound(relaxed, SearchOptions(bound=counted * (1 + 1e-9)), weight, least)
                assert short == least  # not refuted: the bound memory aside comes back
    assert compared >= 9 and bound_by_memory >= 3 and raised > 0


def test_counts_the_relaxation_refutes_are_not_built_and_the_plan_is_the_same(monkeypatch):
    """GPT at batch 16 on 16 devices with 2 MB each: 2 and 4 micro-batches are refuted on the whole batch's
    relaxed problem, never built; the plan is the one searching them gives."""
    import autopar
    from autopar.search import shape_search

    model = build_transformer(kind="gpt", layers=4, hidden=64, heads=4, seq=32, vocab=256, batch=16)
    cost = profile(capacity=2e6, peak=1e9)
    refuted = _counting_refutations(monkeypatch)
    built = _counting_builds(monkeypatch)
    relaxed = autopar.plan(model, devices=16, cost_model=cost)
    assert sorted(refuted) == [2, 4] and not {(1, 2), (1, 4)} & set(built)
    monkeypatch.setattr(shape_search.ShapeSearch, "_relaxation_refutes", lambda self, shape, bound: False)
    searched = autopar.plan(model, devices=16, cost_model=cost)
    assert _same_but_times(relaxed, searched)


def test_counts_refuted_with_memory_counted_are_not_built_and_the_plan_is_the_same(monkeypatch):
    """Where memory binds the one-stage plans, a count the relaxation does not refute memory aside may be refuted
    with memory counted (`memory_bound`, at the hint's weight), never built; the plan is the one searching
    every count gives (GPT at batch 16 on 8 devices with 1.5 MB each). `_memory_may_refute`, a guess about
    cost, is told yes here."""
    import autopar
    from autopar.search import driver, shape_search

    model = build_transformer(kind="gpt", layers=8, hidden=64, heads=4, seq=32, vocab=256, batch=16)
    cost = profile(capacity=1.5e6, peak=1e9)
    monkeypatch.setattr(shape_search.ShapeSearch, "_memory_may_refute", lambda self, least, bound: self._hint > 0)
    counted: list[bool] = []
    bounding = driver.memory_bound

    def memory_bound(problem, options, weight, least, solver=None):
        found = bounding(problem, options, weight, least, solver)
        counted.append(least < options.bound <= found)
        return found

    monkeypatch.setattr(shape_search, "memory_bound", memory_bound)
    refuted = _counting_refutations(monkeypatch)
    with_memory = autopar.plan(model, devices=8, cost_model=cost)
    assert any(counted) and len(refuted) >= sum(counted)
    monkeypatch.setattr(shape_search.ShapeSearch, "_relaxation_refutes", lambda self, shape, bound: False)
    assert _same_but_times(with_memory, autopar.plan(model, devices=8, cost_model=cost))


def test_counts_relaxed_together_are_bounded_below_their_own_best_plans(monkeypatch):
    """One relaxation of the whole batch for several one-stage counts (`ShapeSearch._relax_together`: the bytes
    that grow with the batch at the least share, only what every count lacks priced out) bounds from below the
    plan that fits each count's own search finds (its best where that search is exact, as it is with memory
    unbounded; else no less than the best), at every memory weight, memory binding or not; and with memory
    counted it bounds more than memory aside somewhere."""
    import math

    from autopar.errors import InfeasibleError
    from autopar.search import driver, shape_search
    from autopar.search.driver import run_search
    from autopar.search.pipeline import stage_problem

    model = build_transformer(kind="gpt", layers=6, hidden=64, heads=4, seq=32, vocab=256, batch=24)
    counted: list[tuple[float, float]] = []  # (memory aside, memory counted), every way run

    def memory_bound(problem, options, weight, least, solver=None):
        found = driver.memory_bound(problem, dataclasses.replace(options, bound=0.0), weight, least, solver)
        counted.append((least, found))
        return found

    monkeypatch.setattr(shape_search, "memory_bound", memory_bound)
    monkeypatch.setattr(shape_search.ShapeSearch, "_memory_may_refute", lambda self, least, bound: True)
    compared = 0
    for capacity in (0.8e6, 1.5e6, 1e12):
        options = PlanOptions.resolve(8, profile(capacity=capacity, peak=1e9), None)
        shapes = ShapeSearch(load_model(model), options, options.costs(), lambda m: load_model(model, batch=24 // m))
        best: dict[int, float] = {}
        for micro in (2, 3, 4, 6, 8, 12):
            own = shapes.problem(1, micro)
            stage = stage_problem(own, 0, own.size, PipelineShape(1, micro), 0)
            try:
                found = run_search(stage)
            except InfeasibleError:
                best[micro] = math.inf  # (nothing fits: any bound holds)
                continue
            best[micro] = stage.objective(found.choice, found.choices)
        least = min(best.values())
        for weight in (1e-10, 1e-9, 1e-8, 1e-7):
            shapes._hint, shapes._together, shapes._together_at = weight, {}, math.inf
            shapes._relax_together(PipelineShape(1, 2), least, [3, 4, 6, 8, 12])
            assert sorted(shapes._together) == [2, 3, 4, 6, 8, 12]
            for micro, seconds in best.items():
                assert shapes._together[micro] <= seconds * (1 + 1e-9), (capacity, weight, micro)
                compared += seconds < math.inf
    assert compared >= 40
    assert any(found > aside * (1 + 1e-6) for aside, found in counted)


def test_counts_relaxed_together_are_refuted_unbuilt_and_the_plan_is_the_same(monkeypatch):
    """Where one relaxation for the one-stage counts left to visit bounds them all above the best plan
    (`ShapeSearch._relax_together`), none of them is built, and the plan is the one searching every count gives
    (GPT at batch 16 on 8 devices with 1 MB each; `_memory_may_refute`, a guess about cost, told yes)."""
    import autopar
    from autopar.search import shape_search

    model = build_transformer(kind="gpt", layers=4, hidden=64, heads=4, seq=32, vocab=256, batch=16)
    cost = profile(capacity=1e6, peak=1e9)
    monkeypatch.setattr(shape_search.ShapeSearch, "_memory_may_refute", lambda self, least, bound: self._hint > 0)
    together: list[set[int]] = []
    relaxing = shape_search.ShapeSearch._relax_together

    def relax_together(self, shape, bound, later):
        relaxing(self, shape, bound, later)
        together.append({count for count, least in self._together.items() if least >= bound})

    monkeypatch.setattr(shape_search.ShapeSearch, "_relax_together", relax_together)
    refuted = _counting_refutations(monkeypatch)
    built = _counting_builds(monkeypatch)
    relaxed = autopar.plan(model, devices=8, cost_model=cost)
    jointly = set().union(*together)
    assert len(jointly) >= 2 and jointly <= set(refuted)
    assert not {(1, count) for count in jointly} & set(built)
    monkeypatch.setattr(shape_search.ShapeSearch, "_relaxation_refutes", lambda self, shape, bound: False)
    assert _same_but_times(relaxed, autopar.plan(model, devices=8, cost_model=cost))


def test_a_micro_batch_relaxation_s_bytes_fall_with_the_share():
    """`_shrinks_with_share`, the premise `_relax_together` reads, holds on a model that may recompute (six layers,
    a folded run), and there every candidate's bytes in the relaxation, with its parameters' state whole or
    under the parallel optimizer, recomputing or not, are no more at a smaller share (a plan's bytes are their
    sum). Where what recomputing frees were more than the activations, the premise fails and bytes rise."""
    from autopar.search.memory import MemoryChoices
    from autopar.search.shape_search import _shrinks_with_share

    model = build_transformer(kind="gpt", layers=6, hidden=64, heads=4, seq=32, vocab=256, batch=16)
    options = PlanOptions.resolve(8, profile(capacity=1e6, peak=1e9), None)
    single = ShapeSearch(load_model(model), options, options.costs(), lambda m: load_model(model, batch=16 // m)).single
    assert single.recompute_memory and single.sharded and _shrinks_with_share(single)
    nothing = [np.zeros(len(rule.candidates), dtype=bool) for rule in single.rules]

    def rises(problem) -> bool:  # some candidate's bytes are more at a smaller share
        relaxed = [problem.micro_batch_relaxation(share, nothing, 1.0) for share in (1.0, 0.5, 0.25)]
        for recompute in (False, True):
            choices = MemoryChoices(sharded=frozenset(problem.sharded), recompute=recompute)
            for node in range(problem.size):
                for whole in (MemoryChoices(recompute=recompute), choices):
                    held = [r.node_arrays(node, whole)[1] for r in relaxed]
                    if (held[1] > held[0]).any() or (held[2] > held[1]).any():
                        return True
        return False

    assert not rises(single)
    node, freed = next(iter(single.recompute_memory.items()))
    freeing_more = {**single.recompute_memory, node: freed - 2.0 * single.node_activations[node] - 1.0}
    wrong = dataclasses.replace(single, recompute_memory=freeing_more)
    assert not _shrinks_with_share(wrong) and rises(wrong)


def _counting_refutations(monkeypatch, rule: str = "_relaxation_refutes") -> list[int]:
    """The micro-batch counts a rule of `ShapeSearch` refutes (the relaxation, `_relaxation_refutes`, unless
    another is named), listed as it does."""
    from autopar.search import shape_search

    refuted: list[int] = []
    relaxing = getattr(shape_search.ShapeSearch, rule)

    def counted(self, shape, bound):
        found = relaxing(self, shape, bound)
        refuted.extend([shape.micro_batches] if found else [])
        return found

    monkeypatch.setattr(shape_search.ShapeSearch, rule, counted)
    return refuted


def _counting_builds(monkeypatch) -> list[tuple[int, int]]:
    """The shapes (stages, micro-batches) whose problems the shape search builds (`ShapeSearch.problem`), in order."""
    from autopar.search import shape_search

    built: list[tuple[int, int]] = []
    building = shape_search.ShapeSearch.problem
    monkeypatch.setattr(
        shape_search.ShapeSearch, "problem", lambda self, s, m: built.append((s, m)) or building(self, s, m)
    )
    return built


def _same_but_times(a, b) -> bool:
    """Two plans' files equal but for measured times."""
    import json

    def strip(value):
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if k not in ("time_s", "phases_s")}
        if isinstance(value, list):
            return [strip(v) for v in value]
        return value

    return strip(json.loads(a.to_json())) == strip(json.loads(b.to_json()))


def test_a_hugging_face_export_plans_the_same_with_counts_refuted_on_the_relaxation(tmp_path, monkeypatch):
    """Hugging Face's GPT-2 (a random-initialised configuration), exported by torch's legacy exporter with a
    dynamic batch, at batch 128 on 16 devices with 1 MB each: 2 micro-batches are refuted on the whole batch's
    relaxed problem, unbuilt, and the plan is the one searching every count gives."""
    import autopar
    from autopar.search import shape_search

    torch = pytest.importorskip("torch")
    hf = pytest.importorskip("transformers")
    config = hf.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64)
    torch.manual_seed(0)
    gpt2 = hf.GPT2LMHeadModel(config).eval()

    class WithLoss(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gpt2 = gpt2

        def forward(self, ids, labels):
            return self.gpt2(input_ids=ids, labels=labels).loss

    ids = torch.randint(0, 256, (8, 32))
    path = tmp_path / "gpt2.onnx"
    batch = {0: "batch"}
    torch.onnx.export(
        WithLoss(),
        (ids, ids),
        str(path),
        dynamo=False,
        input_names=["ids", "labels"],
        dynamic_axes={"ids": batch, "labels": batch},
        opset_version=17,
    )
    refuted = _counting_refutations(monkeypatch)
    options = dict(batch=128, devices=16, cost_model="ascend910", memory_reserve=int(32e9 - 1e6))
    relaxed = autopar.plan(path, **options)
    assert refuted == [2]
    monkeypatch.setattr(shape_search.ShapeSearch, "_relaxation_refutes", lambda self, shape, bound: False)
    assert _same_but_times(relaxed, autopar.plan(path, **options))


@pytest.mark.parametrize("capacity", [0.6e6, 1e12])
def test_a_larger_micro_batch_s_relaxation_never_refutes_a_stage_shape_that_has_a_plan_as_fast(capacity):
    """The relaxation of a shape's problem at fewer micro-batches (`smaller_batch_floor`) bounds the plans of as
    many stages over more micro-batches from below: at the bound of their best plan (found by the exact cut
    search), it never refutes them, memory binding or not; and with a bound of twice that plan, no lower."""
    from autopar.search.cuts import bounded_search_stages
    from autopar.search.driver import SearchOptions
    from autopar.search.shape_search import smaller_batch_floor

    model = build_transformer(kind="gpt", layers=2, hidden=64, heads=4, seq=32, vocab=256, batch=24)
    options = PlanOptions.resolve(8, profile(capacity=capacity, peak=1e9), None)
    shapes = ShapeSearch(load_model(model), options, options.costs(), lambda m: load_model(model, batch=24 // m))
    compared = 0
    for stages, fewer, more in ((2, 2, 4), (2, 3, 4), (2, 4, 8), (4, 3, 6), (2, 6, 12)):
        larger, shape = shapes.problem(stages, fewer), PipelineShape(stages, more)
        found, _ = bounded_search_stages(shapes.problem(stages, more), shape, SearchOptions())
        if found is None:  # nothing fits
            continue
        compared += 1
        floor = smaller_batch_floor(larger, fewer, shapes._graph(more), shape, found.time_s * (1 + 1e-9))
        assert floor is not None and floor < found.time_s * (1 + 1e-9)
        loose = smaller_batch_floor(larger, fewer, shapes._graph(more), shape, 2 * found.time_s)
        assert loose is not None and loose <= found.time_s * (1 + 1e-9)
        assert floor > 0.5 * found.time_s  # it bounds something: most of the step
    assert compared >= 3


def test_a_smaller_micro_batch_s_premise_is_checked():
    """Sizes that do not shrink by the share, or a graph of other operators, give no floor (`_sizes_shrink`)."""
    from autopar.search.shape_search import _sizes_shrink

    model = build_transformer(kind="gpt", layers=2, hidden=64, heads=4, seq=32, vocab=256, batch=24)
    six, three = load_model(model, batch=6), load_model(model, batch=3)
    assert _sizes_shrink(six, three, 4, 8)
    assert not _sizes_shrink(three, six, 8, 4)  # larger, not smaller
    assert not _sizes_shrink(six, three, 4, 5)  # 3 is less than 4 / 5 of 6
    other = load_model(build_transformer(kind="gpt", layers=1, hidden=64, heads=4, seq=32, vocab=256, batch=3))
    assert not _sizes_shrink(six, other, 4, 8)


@pytest.mark.parametrize("memory_raised", [False, True])
def test_a_larger_micro_batch_s_floor_is_not_tried_where_memory_raised_that_shape_s_bound(monkeypatch, memory_raised):
    """`_smaller_batch_refutes` leaves memory out, so where memory raised the bound of the shape held for it
    (`_bounded`: the bound past its stages' floors), it is not tried and the shape is built (a guess about cost:
    the answer is the same either way); elsewhere it is, and refutes where its floor meets the bound."""
    import types

    from autopar.search import shape_search

    model = build_transformer(kind="gpt", layers=2, hidden=64, heads=4, seq=32, vocab=256, batch=24)
    options = PlanOptions.resolve(8, profile(peak=1e9), None)
    shapes = ShapeSearch(load_model(model), options, options.costs(), lambda m: load_model(model, batch=24 // m))
    floors = types.SimpleNamespace(seconds=1.0)
    bounded = types.SimpleNamespace(seconds=2.0 if memory_raised else 1.0, floors=floors)
    monkeypatch.setattr(shape_search, "bound_shape", lambda problem, shape, searching: bounded)
    held = shapes.problem(2, 2)
    assert held is not None
    shapes._stages_built[2] = (2, held)
    assert shapes._bounded(held, PipelineShape(2, 2), 3.0) is bounded
    tried: list[PipelineShape] = []

    def floor(problem, micro, graph, shape, bound):
        tried.append(shape)
        return 4.0

    monkeypatch.setattr(shape_search, "smaller_batch_floor", floor)
    assert shapes._smaller_batch_refutes(PipelineShape(2, 4), 3.0) is not memory_raised
    assert tried == ([] if memory_raised else [PipelineShape(2, 4)])


@pytest.mark.parametrize("capacity", [0.6e6, 1e12])
def test_counts_relaxed_together_never_refute_a_stage_shape_that_has_a_plan_as_fast(capacity):
    """`counts_floor` (the whole batch on one stage's devices relaxed to several micro-batch counts of a stage
    count) bounds every count's best plan (the exact cut search's) from below, memory binding or not, memory
    counted at any weight: told that plan's step, it never reaches it; told twice that, no higher. And it bounds
    most of the step."""
    from autopar.search.costing import build_with_latency
    from autopar.search.cuts import bounded_search_stages
    from autopar.search.driver import SearchOptions
    from autopar.search.shape_search import counts_floor

    model = build_transformer(kind="gpt", layers=2, hidden=64, heads=4, seq=32, vocab=256, batch=24)
    options = PlanOptions.resolve(8, profile(capacity=capacity, peak=1e9), None)
    shapes = ShapeSearch(load_model(model), options, options.costs(), lambda m: load_model(model, batch=24 // m))
    compared = 0
    for stages, counts in ((2, (2, 3)), (2, (2, 3, 4, 6)), (2, (8, 12, 24)), (4, (4, 6, 8, 12)), (4, (12, 24))):
        whole, latency = build_with_latency(shapes.graph, shapes.cost, 8 // stages)
        best = []
        for count in counts:
            shape = PipelineShape(stages, count)
            found, _ = bounded_search_stages(shapes.problem(stages, count), shape, SearchOptions())
            best += [found.time_s] if found is not None else []  # (none where nothing fits)
        if not best:
            continue
        compared += 1
        least = min(best)
        graphs = {count: shapes._graph(count) for count in counts}
        for weight in (0.0, 1e-10, 1e-9, 1e-8):
            for told in (least * (1 + 1e-9), 2 * least):
                searching = SearchOptions(bound=told, hint=weight)
                floor = counts_floor(whole, latency, graphs, PipelineShape(stages, counts[0]), searching)
                assert floor is not None and floor <= least * (1 + 1e-9), (stages, counts, weight)
        assert floor > 0.5 * least  # it bounds something: most of the step
    assert compared >= 3


def test_counts_relaxed_together_premise_is_checked():
    """No floor where a count's sizes do not shrink with it (`_sizes_shrink`), nor where the whole batch's forks
    pass through (a count's meet: their candidates are not among the whole batch's)."""
    from autopar.search.costing import build_problem, build_with_latency
    from autopar.search.driver import SearchOptions
    from autopar.search.shape_search import counts_floor

    model = build_transformer(kind="gpt", layers=2, hidden=64, heads=4, seq=32, vocab=256, batch=24)
    options = PlanOptions.resolve(8, profile(peak=1e9), None)
    cost, graph = options.costs(), load_model(model)
    whole, latency = build_with_latency(graph, cost, 4)
    shape, searching = PipelineShape(2, 2), SearchOptions(bound=1.0)
    graphs = {2: load_model(model, batch=12), 3: load_model(model, batch=8)}
    assert counts_floor(whole, latency, graphs, shape, searching) is not None
    assert counts_floor(whole, latency, {2: graphs[3], 3: graphs[2]}, shape, searching) is None  # sizes grow
    passing = build_problem(graph, cost, 4, meet=False)
    assert not passing.forks_meet
    assert counts_floor(passing, latency, graphs, shape, searching) is None


def test_stage_counts_relaxed_together_are_refuted_unbuilt_and_the_plan_is_the_same(monkeypatch):
    """Where the groups of a stage count's micro-batch counts left to visit are bounded above the best plan
    (`ShapeSearch._relax_counts`), those counts are not built, and the plan is the one building every count
    gives (GPT at batch 24 on 8 devices in 2 stages with 1 MB each; `_relaxes_counts` and `_COUNTS_RELAXED`,
    guesses about cost, told yes)."""
    import autopar
    from autopar.search import shape_search

    model = build_transformer(kind="gpt", layers=4, hidden=64, heads=4, seq=32, vocab=256, batch=24)
    options = dict(devices=8, cost_model=profile(capacity=1e6, peak=1e9), pipeline_stages=2)
    monkeypatch.setattr(shape_search, "_COUNTS_RELAXED", 2)
    monkeypatch.setattr(shape_search.ShapeSearch, "_relaxes_counts", lambda self, shape, bound: True)
    refuted = _counting_refutations(monkeypatch, "_counts_refute")
    built = _counting_builds(monkeypatch)
    relaxed = autopar.plan(model, **options)
    assert refuted and not {(2, count) for count in refuted} & set(built)
    monkeypatch.setattr(shape_search.ShapeSearch, "_counts_refute", lambda self, shape, bound: False)
    assert _same_but_times(relaxed, autopar.plan(model, **options))
