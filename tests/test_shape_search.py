"""The pipeline-shape search (`autopar.search.shape_search`): which shapes it lists, the order it visits
them in, how ties go, and what one shape's plan tells of another's."""

from __future__ import annotations

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
