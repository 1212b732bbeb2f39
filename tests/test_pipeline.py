"""Pipeline stages: the 1F1B cost worked by hand, and the joint search against brute force and the ILP.

The chain X -> mm1 -> relu -> mm2 -> Z (X 8x8, W1 8x16, W2 16x4) on 2 devices of the simple
profile (1 TFLOP/s, 1 GB/s and 1 us on mesh bit 0), cut before mm2 into 2 stages of one device
each, the batch run as 4 micro-batches of 2 rows:

- slots: M + S - 1 = 5; stage 0 holds min(S - 0, M) = 2 micro-batches' activations, stage 1 one.
- stage 0 per micro-batch: mm1 2x2x8x16 = 512 FLOPs, backward only dW1 (X is data): 2 x 512;
  relu 2x16 = 32 elements at 1 FLOP each, forward and backward: 2 x 32 (a vector op at the peak);
  receiving R's gradient (2x16 FP16 = 64 B) over bit 0: 1 us + 64 ns.
- stage 1 per micro-batch: mm2 2x2x16x4 = 256 FLOPs, backward dR and dW2: 3 x 256; receiving R:
  1 us + 64 ns.
- the step: 5 x the slower stage (stage 0), no gradient sync (one device a stage); the bubble 1 of 5
  slots.
- memory: stage 0 keeps W1 (128 elements x 12 B under SGD in mixed precision), X (2x8 FP16, loaded)
  and R (64 B, relu's backward needs it) for 2 micro-batches; stage 1 keeps W2 (64 x 12 B) and its
  received R (mm2's backward needs it for dW2) for 1.
"""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest
from onnx import TensorProto, helper

import autopar
from autopar.cost import CostModel
from autopar.errors import InfeasibleError
from autopar.graph import load_model
from autopar.search import repeats
from autopar.search.costing import build_problem
from autopar.search.cuts import _min_max_search, search_stages
from autopar.search.driver import SearchCache, SearchOptions, run_search
from autopar.search.floors import (
    compute_floor,
    copies_in,
    copy_floors,
    leanest_memory,
    least_fullest,
    shape_floor,
    stage_floor,
)
from autopar.search.pipeline import ONE_STAGE, PipelineShape, cut_crossings, cut_points, send_costs, stage_problem
from autopar.search.shape_search import ShapeSearch
from models.transformer import build_transformer
from tests.conftest import RESNET50, make_model, profile, run_cli, simple_profile_dict, weight
from tests.test_fold import residual_stack

SLOTS = 4 + 2 - 1
MM1 = 2 * 2 * 8 * 16 / 1e12
RELU = 2 * 16 / 1e12
MM2 = 2 * 2 * 16 * 4 / 1e12
SEND = 1e-6 + 64 / 1e9  # R or its gradient, 2x16 FP16, over bit 0
STAGE0 = SLOTS * (2 * MM1 + 2 * RELU + SEND)
STAGE1 = SLOTS * (3 * MM2 + SEND)
MEMORY0 = 128 * 12 + 2 * 8 * 2 + 2 * 64
MEMORY1 = 64 * 12 + 64


def chain():
    nodes = [
        helper.make_node("MatMul", ["X", "W1"], ["Y"], name="mm1"),
        helper.make_node("Relu", ["Y"], ["R"], name="relu"),
        helper.make_node("MatMul", ["R", "W2"], ["Z"], name="mm2"),
    ]
    inits = [weight("W1", [8, 16], 1), weight("W2", [16, 4], 2)]
    return make_model(nodes, [("X", TensorProto.FLOAT, [8, 8])], ["Z"], inits)


def simple():
    from autopar.cost import HardwareProfile

    return HardwareProfile.model_validate(simple_profile_dict())


def test_two_stages_of_four_micro_batches_by_hand():
    plan = autopar.plan(
        chain(), devices=2, cost_model=simple(), pipeline_stages=2, micro_batches=4, stage_starts=["mm2"]
    )
    assert STAGE0 > STAGE1
    assert plan.objective == pytest.approx(STAGE0, rel=1e-12)
    assert plan.memory_per_device == pytest.approx(MEMORY0, rel=1e-12)
    data = plan.to_dict()
    pipe = data["pipeline"]
    assert (pipe["schedule"], pipe["micro_batches"], pipe["bits"]) == ("1F1B", 4, [0])
    assert pipe["bubble_fraction"] == pytest.approx(1 / SLOTS)
    stages = pipe["stages"]
    assert [(s["first_op"], s["last_op"], s["first_device"], s["devices"]) for s in stages] == [
        ("mm1", "relu", 0, 1),
        ("mm2", "mm2", 1, 1),
    ]
    assert [s["micro_batches_in_flight"] for s in stages] == [2, 1]
    assert [s["memory_per_device_bytes"] for s in stages] == [MEMORY0, MEMORY1]
    assert stages[1]["step_time_s"] == pytest.approx(STAGE1, rel=1e-9)
    assert pipe["sends"] == [
        {
            "tensor": "R",
            "from_op": "relu",
            "to_op": "mm2",
            "from_stage": 0,
            "to_stage": 1,
            "bytes": 64,
            "gradient_bytes": 64,
            "link": "fast",
        }
    ]
    assert data["redistributions"] == [] and data["gradients"] == []  # the send is not a collective
    totals = data["totals"]
    assert totals["pipeline_bubble_s"] == pytest.approx(STAGE0 / SLOTS, rel=1e-9)
    assert totals["compute_s"] == pytest.approx(4 * (2 * MM1 + 2 * RELU), rel=1e-9)
    assert plan.degrees.pipeline == 2 and "pipeline 2" in str(plan.degrees)
    assert data["memory_plan"]["micro_batches"] == 4
    assert data["context"]["inputs"] == {"X": [2, 8]}  # one micro-batch's shapes


def fold_short(monkeypatch):
    monkeypatch.setattr(repeats, "MIN_FOLDED_COPIES", 2)


def every_cut(problem, shape):
    """The best plan over every choice of cuts, each stage searched on its own (brute force over cuts)."""
    best = None
    for cuts in itertools.combinations(cut_points(problem), shape.stages - 1):
        result = search_stages(problem, shape, starts=(0, *cuts))
        if result is not None and (best is None or result.time_s < best.time_s):
            best = result
    return best


@pytest.mark.parametrize(("blocks", "devices"), [(2, 4), (4, 8), (6, 16), (8, 4)])
def test_the_joint_search_equals_brute_force_over_cuts_stages_and_micro_batches(monkeypatch, blocks, devices):
    fold_short(monkeypatch)
    cost = CostModel(profile(peak=1e9))
    batch = 16
    results = {}
    floor = compute_floor(build_problem(load_model(residual_stack(blocks, batch=batch)), cost, devices))
    for stages in (1, 2, 4):
        if stages > devices:
            continue
        for micro in (1, 2, 4, 8):
            graph = load_model(residual_stack(blocks, batch=batch // micro))
            problem = build_problem(graph, cost, devices // stages)
            shape = PipelineShape(stages, micro)
            found = search_stages(problem, shape)
            brute = every_cut(problem, shape)
            assert (found is None) == (brute is None)
            if found is not None:
                assert found.time_s == pytest.approx(brute.time_s, rel=1e-12)
                results[(stages, micro)] = found.time_s
                assert found.time_s >= shape_floor(floor, devices, shape) * (1 - 1e-12)  # never below its bound
    # the planner takes the best shape of all
    plan = autopar.plan(residual_stack(blocks, batch=batch), devices=devices, cost_model=profile(peak=1e9))
    assert plan.objective == pytest.approx(min(results.values()), rel=1e-12)


def test_the_order_shapes_are_searched_in_changes_no_plan(monkeypatch):
    """Where memory binds, one stage's micro-batch counts are searched from a quarter of the way up (after a
    one-run check on the whole batch) and the first good plan refutes the rest: the plans are those the
    shapes' own order finds, byte for byte, and at the tighter memories more than one micro-batch wins."""
    fold_short(monkeypatch)
    model = residual_stack(4, width=8, batch=256)
    need = autopar.plan(model, devices=8, cost_model=profile(peak=1e9)).memory_per_device
    listed = []
    for share in (0.5, 0.35, 0.25):
        cost = profile(capacity=share * need, peak=1e9)
        plans = [autopar.plan(model, devices=8, cost_model=cost)]
        with monkeypatch.context() as patched:  # every shape in the list's own order, no check first
            patched.setattr(ShapeSearch, "_visiting", lambda self, shapes: (None, list(shapes)))
            plans.append(autopar.plan(model, devices=8, cost_model=cost))
        assert [untimed(plan) for plan in plans[:1]] == [untimed(plan) for plan in plans[1:]]
        listed.append(plans[0].search.choices.micro_batches)
    assert max(listed) > 1


def test_the_bound_a_plan_proves_holds_for_every_shape(monkeypatch):
    """Where memory binds, the plan proves a step no plan of any shape beats (the least of each searched
    shape's bound and its own step, `ShapeSearch._proved`): no shape's optimum, each planned alone by the ILP
    (exact where memory binds too) with its stages and micro-batches fixed, is faster."""
    fold_short(monkeypatch)
    model = residual_stack(4, width=8, batch=256)
    need = autopar.plan(model, devices=8, cost_model=profile(peak=1e9)).memory_per_device
    inexact = 0
    for share in (0.35, 0.25):
        cost = profile(capacity=share * need, peak=1e9)
        plan = autopar.plan(model, devices=8, cost_model=cost)
        search = plan.to_dict()["search"]
        bound = plan.objective if search["exact"] else search["lower_bound_s"]
        assert bound <= plan.objective * (1 + 1e-12)
        inexact += not search["exact"]
        for stages, micro in itertools.product((1, 2, 4), (1, 2, 4, 8)):
            try:
                alone = autopar.plan(
                    model, devices=8, cost_model=cost, pipeline_stages=stages, micro_batches=micro, search="ilp"
                )
            except InfeasibleError:
                continue
            assert alone.objective >= bound * (1 - 1e-12), (stages, micro)
    assert inexact


def untimed(plan: autopar.Plan) -> str:
    """A plan's JSON without the measured times (the only part that may differ between runs)."""

    def strip(value):
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if k not in ("time_s", "phases_s")}
        return [strip(v) for v in value] if isinstance(value, list) else value

    return json.dumps(strip(json.loads(plan.to_json())), sort_keys=True)


@pytest.mark.parametrize(("blocks", "devices", "micro"), [(4, 8, 2), (6, 4, 4), (8, 16, 1)])
def test_a_stage_floor_counting_whole_copies_bounds_every_stage_and_beats_the_operators_alone(
    monkeypatch, blocks, devices, micro
):
    fold_short(monkeypatch)
    model = residual_stack(blocks, batch=16 // micro)
    problem = build_problem(load_model(model), CostModel(profile(peak=1e9)), devices)
    shape = PipelineShape(2, micro)
    points = [0, *cut_points(problem), problem.size]
    copies = copy_floors(problem, shape, points)
    assert len(copies) == blocks - 1 or len(copies) == blocks  # the stack folds, and no cut splits a copy
    tighter = 0
    for a, b in itertools.combinations(points, 2):
        for index in range(shape.stages):
            sends = send_costs(problem, cut_crossings(problem, a, b), a, index, shape)
            stage = stage_problem(problem, a, b, shape, index, sends)
            within = copies_in(copies, a, b, sends, shape.slots)
            found = run_search(stage)
            exact = stage.objective(found.choice, found.choices)
            alone, counted = stage_floor(stage), stage_floor(stage, within)
            assert counted <= exact * (1 + 1e-12)  # a lower bound
            tighter += counted > alone * (1 + 1e-6)
    assert tighter > 0
    brute = every_cut(problem, shape)  # bounds prune, never change the answer: nothing beats the best plan,
    assert search_stages(problem, shape, SearchOptions(bound=brute.time_s)) is None  # and it beats a bound above it
    assert search_stages(problem, shape, SearchOptions(bound=brute.time_s * (1 + 1e-9))).time_s == pytest.approx(
        brute.time_s
    )


def _stacks(kind: str, batch: int):
    from tests.test_memory_plan import block_stack

    if kind == "blocks":  # folded runs that recompute
        return block_stack(blocks=6, batch=batch, width=8, hidden=32)
    if kind == "residual":  # a residual stream crossing each cut
        return residual_stack(4, batch=batch)
    # GPT layers: a copy ends in the residual Add whose output the next stage keeps (`_kept_across`)
    return build_transformer(kind="gpt", layers=4, hidden=64, heads=4, seq=32, vocab=256, batch=batch)


@pytest.mark.parametrize(("kind", "folded"), [("blocks", True), ("residual", True), ("gpt", True), ("gpt", False)])
@pytest.mark.parametrize(("stages", "micro"), [(2, 4), (4, 2), (2, 1)])
def test_the_leanest_memory_of_a_stage_bounds_its_memory_floor_wherever_the_cuts_put_it(
    monkeypatch, kind, folded, stages, micro
):
    """Every stage of every cut, at every place in the pipeline, needs at least `leanest_memory`'s bytes,
    recomputing or not (`memory_floor`: each operator at its leanest candidate and optimizer choice), and no
    more than the whole problem's floor held for the fullest stage's micro-batches (`_no_cut_fits` skips the
    bound below that); the bound is close where few activations cross, not a vacuous zero. Unfolded, every
    layer's activations are held for each micro-batch in flight (folded, they may be recomputed)."""
    if folded:
        fold_short(monkeypatch)
    problem = autopar.build(_stacks(kind, 16 // micro), 4, profile())
    shape = PipelineShape(stages, micro)
    points = [0, *cut_points(problem), problem.size]
    prefixes = leanest_memory(problem, shape, points)

    def lower(index: int, a: int, b: int) -> float:
        return float(prefixes[index][b] - prefixes[index][a])

    closest = 0.0
    for a, b in itertools.combinations(range(len(points)), 2):
        for index in range(stages):
            stage = stage_problem(problem, points[a], points[b], shape, index)
            floor = min(stage.memory_floor(False), stage.memory_floor(True))
            assert lower(index, a, b) <= floor * (1 + 1e-12)
            assert lower(index, a, b) <= shape.in_flight(0) * problem.memory_floor(False) * (1 + 1e-12)
            closest = max(closest, lower(index, a, b) / floor if floor else 0.0)
    assert closest > 0.9


@pytest.mark.parametrize("kind", ["blocks", "gpt"])
def test_a_shape_no_cut_fits_is_refuted_without_a_stage_and_brute_force_agrees(monkeypatch, kind):
    """Just below the least over cuts of the fullest stage's leanest memory, the cut search says nothing fits
    without building a stage, and every cut has a stage that does not fit; just above, it searches."""
    fold_short(monkeypatch)
    model, shape = _stacks(kind, 4), PipelineShape(2, 4)
    roomy = autopar.build(model, 4, profile())
    points = [0, *cut_points(roomy), roomy.size]
    prefixes = leanest_memory(roomy, shape, points)
    least = least_fullest(prefixes)[0]
    ends = range(1, len(points) - 1)
    every = [
        max(float(at[b] - at[a]) for at, (a, b) in zip(prefixes, itertools.pairwise((0, *cut, len(points) - 1))))
        for cut in itertools.combinations(ends, shape.stages - 1)
    ]
    assert least == pytest.approx(min(every), rel=1e-12)  # the min-max DP is brute force's
    _refuted_just_below(monkeypatch, model, shape, least)


@pytest.mark.parametrize(
    "name", ["hf_gpt_neox_dynamo.onnx", "hf_bloom_dynamo.onnx", "hf_olmoe_dynamo.onnx", "torch_llama_dynamo.onnx"]
)
def test_the_memory_refutation_holds_on_exports_it_was_not_made_on(monkeypatch, name):
    """On PyTorch exports of Hugging Face and torch modules (shared masks, rotary tables, experts): every stage
    of every cut at every place needs at least `leanest_memory`'s bytes, which some stage reaches; just below
    the least over cuts of the fullest stage's, the cut search builds no stage and every cut has a stage that
    does not fit; just above, it searches."""
    model, shape = f"tests/data/{name}", PipelineShape(2, 4)
    roomy = autopar.build(model, 4, profile())
    points = [0, *cut_points(roomy), roomy.size]
    prefixes = leanest_memory(roomy, shape, points)
    closest = 0.0
    for a, b in itertools.combinations(range(len(points)), 2):
        for index in range(shape.stages):
            stage = stage_problem(roomy, points[a], points[b], shape, index)
            floor = min(stage.memory_floor(False), stage.memory_floor(True))
            lower = float(prefixes[index][b] - prefixes[index][a])
            assert lower <= floor * (1 + 1e-12)
            closest = max(closest, lower / floor if floor else 0.0)  # a stage of free operators holds nothing
    assert closest > 0.99
    least = least_fullest(prefixes)[0]
    _refuted_just_below(monkeypatch, model, shape, least)


def _refuted_just_below(monkeypatch, model, shape: PipelineShape, least: float) -> None:
    """Just below ``least`` bytes a device (the least over cuts of the fullest stage's leanest memory), the cut
    search of a 2-stage ``shape`` builds no stage and every cut has a stage that does not fit; just above, it
    searches its stages."""
    built = []
    monkeypatch.setattr(
        "autopar.search.cuts.stage_problem", lambda *a, **k: built.append(a[1:3]) or stage_problem(*a, **k)
    )
    tight = autopar.build(model, 4, profile(capacity=least * (1 - 1e-6)))
    assert search_stages(tight, shape) is None and not built
    for cut in cut_points(tight):
        stages = [stage_problem(tight, 0, cut, shape, 0), stage_problem(tight, cut, tight.size, shape, 1)]
        assert any(min(stage.memory_floor(False), stage.memory_floor(True)) > least * (1 - 1e-6) for stage in stages)
    search_stages(autopar.build(model, 4, profile(capacity=least * (1 + 1e-6))), shape)
    assert built  # not refuted by the bound: its stages are searched


def _fitting_stages(problem, shape: PipelineShape, points):
    """Every stage of every cut at ``points`` that has a plan that fits: (its first and last points, its index,
    its problem, its plan)."""
    for a, b in itertools.combinations(points, 2):
        for index in range(shape.stages):
            stage = stage_problem(problem, a, b, shape, index)
            try:
                found = run_search(stage)
            except InfeasibleError:
                continue
            yield a, b, index, stage, found


@pytest.mark.parametrize(
    ("blocks", "batch", "devices", "micro", "share"), [(6, 64, 8, 2, 0.3), (5, 32, 4, 4, 1.0), (-4, 16, 4, 2, 0.5)]
)
def test_the_bound_at_a_memory_weight_never_refutes_a_stage_that_fits_faster(
    monkeypatch, blocks, batch, devices, micro, share
):
    """Where memory binds, a stage is refuted without a DP run when the Lagrangian bound at the hint's memory
    weight (the copies' bounds shared by every cut) cannot beat the best plan: never where a plan of the
    stage that fits is faster, at the weight it settles on or far from it, recomputing or not; sometimes just
    below its best; and the cut search with that hint still ends at brute force's plan. The floor of the ways a
    stage may fit (`_StageSearch._floors`) is no more than its plan either, and above the time-only floor where
    only recomputing plans fit. Told what to beat, the bound says minus infinity where it would be below it
    (stopping at the first way that is), and itself elsewhere."""
    from autopar.search.cuts import _StageSearch
    from tests.test_memory_plan import RC_PEAK, block_stack, leanest

    fold_short(monkeypatch)
    if blocks > 0:
        model = block_stack(blocks=blocks, batch=batch // micro, width=8, hidden=32)
    else:  # GPT layers: a copy ends in the residual Add whose output the next stage keeps (`_kept_across`)
        model = build_transformer(
            kind="gpt", layers=-blocks, hidden=64, heads=4, seq=32, vocab=256, batch=batch // micro
        )
    free = autopar.build(model, devices // 2, profile(peak=RC_PEAK))
    without, with_recompute = leanest(free, False), leanest(free, True)
    problem = autopar.build(
        model, devices // 2, profile(capacity=with_recompute + share * (without - with_recompute), peak=RC_PEAK)
    )
    shape = PipelineShape(2, micro)
    points = [0, *cut_points(problem), problem.size]
    search = _StageSearch(problem, shape, SearchOptions())
    search.copies = copy_floors(problem, shape, points)
    refuted, raised, weights = 0, 0, []
    for a, b, index, stage, found in _fitting_stages(problem, shape, points):  # (none else to refute wrongly)
        exact = stage.objective(found.choice, found.choices)
        weights += [found.memory_multiplier] if found.memory_multiplier > 0 else []
        crossings = cut_crossings(problem, a, b)
        kept = search._kept(search._key(a, b, index, crossings), a, b, index, crossings)
        sends = send_costs(problem, crossings, a, index, shape)
        floor = kept.floor  # recomputing or not, as the plan may fit
        assert floor < exact * (1 + 1e-9)
        plain = stage_floor(stage, copies_in(search.copies, a, b, sends, shape.slots))
        raised += floor > plain * (1 + 1e-9)  # only recomputing plans fit: they pay the forwards again
        for memory_weight in (found.memory_multiplier, 1e-12, 1e-10, 1e-8, 1e-6):
            search.hint = memory_weight
            if memory_weight > 0:
                bound = search._bound_at_hint(kept, a, b, index, memory_weight)
                assert bound < exact * (1 + 1e-9)
                refuted += bound >= exact * 0.999
                for beat in (0.5 * bound, bound, 2.0 * bound):  # told what to beat, it may stop at the first way
                    kept.at_weight.pop(memory_weight)
                    told = search._bound_at_hint(kept, a, b, index, memory_weight, beat)
                    assert told == (bound if bound >= beat else -math.inf)
                    kept.at_weight[memory_weight] = bound
    assert weights and refuted > 0  # memory binds, and the bound is close enough to refute
    assert raised > 0  # some stages fit only recomputing, and their floor says so
    brute = every_cut(problem, shape)
    for bound in (math.inf, brute.time_s * (1 + 1e-9), brute.time_s):
        found = search_stages(problem, shape, SearchOptions(bound=bound, hint=weights[0]))
        assert (found is None) == (bound == brute.time_s)
        assert found is None or found.time_s == pytest.approx(brute.time_s, rel=1e-12)


@pytest.mark.parametrize(
    ("blocks", "batch", "devices", "micro", "share", "tighter"), [(6, 64, 8, 2, 0.3, True), (-4, 16, 4, 2, 0.05, False)]
)
def test_a_shape_s_memory_floor_is_below_its_best_plan_at_every_weight_and_above_its_time_floor_at_some(
    monkeypatch, blocks, batch, devices, micro, share, tighter
):
    """Where memory binds, `MemoryFloors` bounds every plan of a shape from below at every memory weight, each
    stage by its Lagrangian less the weight times the capacity (a copy ending a stage of GPT layers sends its
    residual on, which the next stage keeps: `kept_sent`), and it is tighter than the time floor at some weight
    where a stage's plans trade much time for memory (the small GPT's stages recompute at little cost).
    The cut search that refutes shapes by it ends at brute force's plan, told a bound just above it or not."""
    from autopar.search.cuts import _StageSearch
    from autopar.search.floors import MemoryFloors, shape_floors
    from tests.test_memory_plan import RC_PEAK, block_stack, leanest

    fold_short(monkeypatch)
    if blocks > 0:
        model = block_stack(blocks=blocks, batch=batch // micro, width=8, hidden=32)
    else:
        model = build_transformer(
            kind="gpt", layers=-blocks, hidden=64, heads=4, seq=32, vocab=256, batch=batch // micro
        )
    free = autopar.build(model, devices // 2, profile(peak=RC_PEAK))
    without, with_recompute = leanest(free, False), leanest(free, True)
    capacity = profile(capacity=with_recompute + share * (without - with_recompute), peak=RC_PEAK)
    above = 0
    for stages in (2, 4):
        problem, shape = autopar.build(model, devices // stages, capacity), PipelineShape(stages, micro)
        points = [0, *cut_points(problem), problem.size]
        brute = every_cut(problem, shape)
        floors = shape_floors(problem, shape, points)
        search = _StageSearch(problem, shape, SearchOptions())
        blocks_whole = [block for block, _ in floors.copies]
        memory = MemoryFloors(problem, shape, points, floors.least, blocks_whole, search._copy_lagrangian, None)
        assert blocks_whole and memory.safe()
        best = brute.time_s if brute is not None else math.inf
        for memory_weight in (1e-12, 1e-10, 1e-9, 1e-8, 1e-7, 1e-6):
            alone = MemoryFloors(problem, shape, points, floors.least, blocks_whole, search._copy_lagrangian, None)
            at_weight = alone.add([memory_weight] * alone.places)
            assert at_weight <= best * (1 + 1e-9)
            above += at_weight > floors.seconds * (1 + 1e-6)
            assert memory.add([memory_weight] * memory.places) >= at_weight  # (every weight taken so far counts)
        if brute is None:
            continue
        for hint in (1e-10, 1e-8):
            for bound in (math.inf, brute.time_s * (1 + 1e-9), brute.time_s):
                found = search_stages(problem, shape, SearchOptions(bound=bound, hint=hint))
                assert (found is None) == (bound == brute.time_s)
                assert found is None or found.time_s == pytest.approx(brute.time_s, rel=1e-12)
    assert above > 0 or not tighter


def test_a_copy_s_bound_between_the_first_and_last_place_is_the_chord_below_its_own(monkeypatch):
    """A copy's Lagrangian bound is concave in the micro-batches its stage holds (every plan's is affine in
    them), so `MemoryFloors` reads a place between the first and the last off the chord of theirs: never above
    the place's own DP run, equal to it at the two ends and on the line where one plan is best at every place
    (as in these GPT layers), and the shape's floor stays below brute force's best plan at every weight (4
    stages over 4 micro-batches: 4, 3, 2 and 1 held)."""
    from autopar.search.cuts import _StageSearch
    from autopar.search.floors import MemoryFloors, shape_floors
    from tests.test_memory_plan import RC_PEAK, leanest

    fold_short(monkeypatch)
    stages, micro, devices = 4, 4, 16
    model = build_transformer(kind="gpt", layers=8, hidden=64, heads=4, seq=32, vocab=256, batch=64 // micro)
    free = autopar.build(model, devices // stages, profile(peak=RC_PEAK))
    without, with_recompute = leanest(free, False), leanest(free, True)
    capacity = profile(capacity=with_recompute + 0.3 * (without - with_recompute), peak=RC_PEAK)
    problem, shape = autopar.build(model, devices // stages, capacity), PipelineShape(stages, micro)
    assert [shape.in_flight(index) for index in range(stages)] == [4, 3, 2, 1]
    points = [0, *cut_points(problem), problem.size]
    floors = shape_floors(problem, shape, points)
    search = _StageSearch(problem, shape, SearchOptions())
    blocks = [block for block, _ in floors.copies]
    brute = every_cut(problem, shape)
    best = brute.time_s if brute is not None else math.inf
    affine = 0
    for memory_weight in (1e-10, 1e-8, 1e-6, 1e-4):
        memory = MemoryFloors(problem, shape, points, floors.least, blocks, search._copy_lagrangian, None)
        for recompute in (False, True):
            for end in (False, True):
                way = (memory_weight, recompute, end)
                own = [search._copy_lagrangian(blocks[1], index, *way) for index in range(stages)]
                assert all(own[i] >= (own[i - 1] + own[i + 1]) / 2 * (1 - 1e-9) for i in (1, 2))  # concave
                read = [memory._copy(blocks[1], index, *way) for index in range(stages)]
                assert read[0] == own[0] and read[3] == own[3]
                assert all(read[i] <= own[i] for i in (1, 2))
                if own[1] - own[0] == pytest.approx(own[2] - own[1], rel=1e-9, abs=1e-15):  # where the same plan
                    affine += 1  # stays best at every place, the chord is its line
                    assert all(read[i] == pytest.approx(own[i], rel=1e-8) for i in (1, 2))
        assert memory.add([memory_weight] * memory.places) <= best * (1 + 1e-9)
    assert affine > 0


def test_the_last_stage_s_memory_floor_bounds_a_copy_ending_it_only_at_the_last_point(monkeypatch):
    """The last stage ends at the last point, where a GPT's head follows its last layer: its bound stands at
    the last point alone (the time floor before it, where the cut search never asks), and the shape's floor
    is still no more than brute force's best plan. A copy's bound ending its stage takes no DP run of its own
    at any place: it comes from the run of the copy's own bound (`floors.least_below_and_less`)."""
    from autopar.search import cuts
    from autopar.search.cuts import _StageSearch
    from autopar.search.floors import MemoryFloors, least_below, least_below_and_less, shape_floors
    from tests.test_memory_plan import RC_PEAK, leanest

    fold_short(monkeypatch)
    runs: list[bool] = []  # per DP run over a copy, whether it gave the bound ending the stage too
    monkeypatch.setattr(cuts, "least_below", lambda *args: runs.append(False) or least_below(*args))
    monkeypatch.setattr(cuts, "least_below_and_less", lambda *args: runs.append(True) or least_below_and_less(*args))
    model = build_transformer(kind="gpt", layers=4, hidden=64, heads=4, seq=32, vocab=256, batch=8)
    free = autopar.build(model, 2, profile(peak=RC_PEAK))
    without, with_recompute = leanest(free, False), leanest(free, True)
    problem = autopar.build(
        model, 2, profile(capacity=with_recompute + 0.05 * (without - with_recompute), peak=RC_PEAK)
    )
    shape = PipelineShape(2, 2)
    points = [0, *cut_points(problem), problem.size]
    floors = shape_floors(problem, shape, points)
    search = _StageSearch(problem, shape, SearchOptions())
    memory = MemoryFloors(
        problem, shape, points, floors.least, [b for b, _ in floors.copies], search._copy_lagrangian, None
    )
    best = every_cut(problem, shape)
    for memory_weight in (1e-9, 1e-7, 1e-5):
        assert memory.add([memory_weight] * memory.places) <= (best.time_s if best else math.inf) * (1 + 1e-9)
    ended = {(key[1], key[4]) for key in search._copy_bounds}
    assert (shape.in_flight(0), True) in ended
    assert len(runs) == sum(not key[4] for key in search._copy_bounds)  # (none for a bound ending a stage)
    assert any(runs)
    ending = [at for at, end in enumerate(memory.ends[:-1]) if end is not None]  # a copy ends there
    last = memory.stage(1)
    assert ending and np.array_equal(last[:, ending], memory.base[:, ending])
    assert (last[:, -1] > memory.base[:, -1]).any()  # where it ends, memory counted bounds more


@pytest.mark.parametrize("memory_weight", [0.0, 1e-9, 1e-7])
def test_one_dp_run_keeping_the_sending_operator_gives_a_copy_s_bound_and_its_bound_ending_a_stage(
    monkeypatch, memory_weight
):
    """`least_below_and_less`: a DP run that keeps the operator a GPT layer sends its residual from gives, per
    candidate of it, the least of every plan taking it, so the copy's bound and its bound with the bytes sent
    taken off that operator's costs come from it alone, as two exact DP runs give them (up to the summing of
    plans tied in value)."""
    from autopar.search.dp import Elimination
    from autopar.search.floors import least_below, least_below_and_less
    from autopar.search.pipeline import kept_sent

    fold_short(monkeypatch)
    model = build_transformer(kind="gpt", layers=4, hidden=64, heads=4, seq=32, vocab=256, batch=8)
    problem, shape = autopar.build(model, 4), PipelineShape(2, 4)
    block = next(repeat.block(1) for repeat, _ in problem.folds)
    copy = stage_problem(problem, block.start, block.stop, shape, 0, {}, boundary=False)
    ((node, sent),) = ((n - block.start, b) for n, b in kept_sent(problem, {n: block.stop for n in block}).items())
    unary = copy.lagrangian(memory_weight, False)[0]
    less = (memory_weight + 1e-9) * shape.in_flight(0) * sent
    lowered = [*unary[:node], unary[node] - less, *unary[node + 1 :]]
    sizes = [len(costs) for costs in copy.node_time]
    both = least_below_and_less(copy, unary, node, less, Elimination(sizes, copy.factors, keep=(node,)))
    assert both is not None
    alone = least_below(copy, unary, False), least_below(copy, lowered, False)
    assert both == pytest.approx(alone, rel=1e-12, abs=0.0)
    assert alone[1] < alone[0] * (1 - 1e-6)  # (the bytes sent count: the two bounds differ)


def test_a_shape_its_first_place_refutes_takes_no_dp_run_for_the_other_places(monkeypatch):
    """`_StageSearch.memory_floor` bounds the first place first (the other stages at their time floors): where
    that alone is no less than the bound to beat, the shape is refuted with no DP run for any other place;
    elsewhere its floors are every place's, as taken all at once, and the cut search ends at brute force's plan."""
    from autopar.search.cuts import _FLOOR_WEIGHT, _StageSearch
    from autopar.search.floors import MemoryFloors, shape_floors
    from tests.test_memory_plan import RC_PEAK, block_stack, leanest

    fold_short(monkeypatch)
    model = block_stack(blocks=6, batch=32, width=8, hidden=32)
    free = autopar.build(model, 4, profile(peak=RC_PEAK))
    without, with_recompute = leanest(free, False), leanest(free, True)
    capacity = profile(capacity=with_recompute + 0.3 * (without - with_recompute), peak=RC_PEAK)
    problem, shape = autopar.build(model, 4, capacity), PipelineShape(2, 2)
    points = [0, *cut_points(problem), problem.size]
    floors = shape_floors(problem, shape, points)
    hint = 1e-9 / _FLOOR_WEIGHT
    blocks = [block for block, _ in floors.copies]

    def taken(places: int) -> tuple[MemoryFloors, float]:
        memory = MemoryFloors(
            problem,
            shape,
            points,
            floors.least,
            blocks,
            _StageSearch(problem, shape, SearchOptions())._copy_lagrangian,
            None,
        )
        return memory, memory.add([_FLOOR_WEIGHT * hint] * places)

    (every, whole), (_, alone) = taken(2), taken(1)
    assert floors.seconds <= alone <= whole and alone > floors.seconds * (1 + 1e-6)  # memory binds the first place

    def bounded(bound: float) -> tuple[MemoryFloors, set[int]]:
        search = _StageSearch(problem, shape, SearchOptions(hint=hint))
        search.copies = floors.copies
        found = search.memory_floor(points, floors.least, bound)
        assert found is not None
        return found, {key[1] for key in search._copy_bounds if key[2] > 0.0}  # the places DP runs were made for

    refuted, places = bounded(alone)
    assert float(refuted.before[-1][-1]) == alone and places == {shape.in_flight(0)}
    searched, places = bounded(alone * (1 + 1e-6))
    assert float(searched.before[-1][-1]) == whole and shape.in_flight(shape.stages - 1) in places
    assert all(np.array_equal(a, b) for a, b in zip(searched.before, every.before))
    brute = every_cut(problem, shape)
    assert brute is not None and alone <= brute.time_s * (1 + 1e-9)
    for bound in (brute.time_s * (1 + 1e-9), brute.time_s):
        found = search_stages(problem, shape, SearchOptions(bound=bound, hint=hint))
        assert (found is None) == (bound == brute.time_s)
        assert found is None or found.time_s == pytest.approx(brute.time_s, rel=1e-12)


def test_the_kept_bytes_a_cut_sends_on_are_at_least_what_the_stage_that_writes_them_frees(monkeypatch):
    """`kept_sent` counts every kept output read past a point, where `_kept_across` leaves out those another
    operator of the stage keeps: what it says a cut moves is never less."""
    from autopar.search.pipeline import _kept_across, kept_sent

    fold_short(monkeypatch)
    model = build_transformer(kind="gpt", layers=4, hidden=64, heads=4, seq=32, vocab=256, batch=8)
    problem = autopar.build(model, 4, profile())
    points = [0, *cut_points(problem), problem.size]
    compared = 0
    for a, b in itertools.pairwise(points):
        moved = _kept_across(problem, a, b, cut_crossings(problem, a, b))
        sent = kept_sent(problem, {node: b for node in range(a, b)})
        for node, change in moved.items():
            if float(np.min(change)) < 0:
                assert a + node in sent and (sent[a + node] >= -change - 1e-9).all()
                compared += 1
    assert compared > 0


def test_a_copy_s_bound_at_weight_zero_is_worked_out_once_for_every_place_and_is_each_place_s_own(monkeypatch):
    """A copy's Lagrangian bound at memory weight 0 is one DP run for every place of a shape: the micro-batches a
    place holds change its bytes alone, which weight 0 counts nothing of. Each place's bound, worked out alone
    in a search of its own, is that one; at a weight above 0 each place has its own."""
    from autopar.search.cuts import _StageSearch

    fold_short(monkeypatch)
    model = build_transformer(kind="gpt", layers=6, hidden=64, heads=4, seq=32, vocab=256, batch=8)
    problem = autopar.build(model, 4, profile())
    shape = PipelineShape(4, 4)  # four places, holding 4, 3, 2 and 1 micro-batches
    block = next(repeat.block(1) for repeat, _ in problem.folds if repeat.copies > 1)
    for recompute in (False, True):
        shared = _StageSearch(problem, shape, SearchOptions())
        alone = [
            _StageSearch(problem, shape, SearchOptions())._copy_lagrangian(block, i, 0.0, recompute) for i in range(4)
        ]
        assert [shared._copy_lagrangian(block, i, 0.0, recompute) for i in range(4)] == alone
        assert len(shared._copy_bounds) == 1 and len(set(alone)) == 1
        weighted = [shared._copy_lagrangian(block, i, 1e-9, recompute) for i in range(4)]
        own = [key for key in shared._copy_bounds if not key[4]]  # (not those ending a stage, which come with)
        assert len(own) == 5 and len(set(weighted)) == 4  # (more micro-batches held, more bytes)


@pytest.mark.parametrize("stages", [2, 4])
def test_a_shape_s_copy_floors_are_the_cut_search_s_own_copy_bounds_at_weight_zero(monkeypatch, stages):
    """`bound_shape` takes each copy's time floor (`copy_floors`) from the cut search (`_StageSearch.copy_time`):
    bit for bit the bound `copy_floors` works out alone on a copy of its own, and the copy problem and its
    planned elimination are then the memory floors' own, not made again (one solver per copy kind)."""
    from autopar.search import cuts
    from autopar.search.cuts import _StageSearch
    from autopar.search.floors import time_floors

    fold_short(monkeypatch)
    model = build_transformer(kind="gpt", layers=6, hidden=64, heads=4, seq=32, vocab=256, batch=8)
    problem = autopar.build(model, 4, profile())
    shape = PipelineShape(stages, 8 // stages)
    points = [0, *cut_points(problem), problem.size]
    alone = copy_floors(problem, shape, points)
    search = _StageSearch(problem, shape, SearchOptions())
    shared = copy_floors(problem, shape, points, search.copy_time)
    assert alone and shared == alone
    taken, own = time_floors(problem, shape, points, copy_time=search.copy_time), time_floors(problem, shape, points)
    assert taken.seconds == own.seconds and taken.copies == own.copies and np.array_equal(taken.least, own.least)
    kinds = {search.classes[block.start] for block, _ in alone}
    assert len(search._copy_solvers) == len(kinds) and len(search._copy_bounds) == len(kinds)
    planned = []
    monkeypatch.setattr(cuts.Solver, "of", lambda problem, _of=cuts.Solver.of: planned.append(problem) or _of(problem))
    block = alone[0][0]
    search._copy_lagrangian(block, 0, 1e-9, False)  # the memory floor's first place: the same copy problem
    assert not planned and len(search._copy_problems) == len(kinds)


def test_a_stage_refuted_at_a_memory_weight_hands_that_weight_to_the_next_stage_of_its_place(monkeypatch):
    """Where memory binds, a stage search that cannot beat its bound says at which memory weight its DP runs
    proved the most (`NothingFaster.weight`: the run whose Lagrangian bound is highest), and the cut search tries
    that weight first on the next stage of the same place, whose bound there (its copies' bounds shared) most
    often refutes it without a DP run. GPT layers, whose last copy in a stage ends in the residual Add the next
    stage keeps: that copy counts operator by operator, and the bound never passes the stage's own plan."""
    from autopar.search.cuts import _StageSearch
    from autopar.search.driver import NothingFaster
    from tests.test_memory_plan import RC_PEAK, leanest

    fold_short(monkeypatch)
    model = build_transformer(kind="gpt", layers=6, hidden=64, heads=4, seq=32, vocab=256, batch=8)
    free = autopar.build(model, 2, profile(peak=RC_PEAK))
    without, with_recompute = leanest(free, False), leanest(free, True)
    problem = autopar.build(model, 2, profile(capacity=with_recompute + 0.5 * (without - with_recompute), peak=RC_PEAK))
    shape = PipelineShape(2, 2)
    points = [0, *cut_points(problem), problem.size]
    handed = 0
    for a, b, index, stage, found in _fitting_stages(problem, shape, points):
        if not found.memory_multiplier:
            continue  # memory does not bind this stage: no weight to hand on
        exact = stage.objective(found.choice, found.choices)
        cache = SearchCache()
        with pytest.raises(NothingFaster) as beaten:
            run_search(stage, SearchOptions(bound=exact * (1 - 1e-3)), cache)
        runs = {w: p.floor - w * stage.cost.capacity for (w, _, scale), p in cache.runs.items() if w > 0}
        if not runs:  # refuted memory aside, or by what recomputing pays again: no weight to hand on
            assert beaten.value.weight == 0.0
            continue
        assert beaten.value.weight == max(runs, key=lambda w: runs[w])
        search = _StageSearch(problem, shape, SearchOptions())
        search.copies = copy_floors(problem, shape, points)
        assert search.time(a, b, index, exact * (1 - 1e-3))[1] is None
        assert search.hints[shape.in_flight(index)] == pytest.approx(beaten.value.weight, rel=1e-6)  # (its tie-break)
        crossings = cut_crossings(problem, a, b)
        kept = search._kept(search._key(a, b, index, crossings), a, b, index, crossings)
        assert search._bound_at_hint(kept, a, b, index, beaten.value.weight) < exact * (1 + 1e-9)
        handed += 1
    assert handed > 0


def test_the_transfers_of_alike_uses_are_worked_out_once_and_cost_what_each_stage_works_out_alone(monkeypatch):
    """`SentAlike` takes a boundary use's transfers from another stage's use of the same copy's operator, slot,
    tensor and link: every stage of every cut costs them bit for bit as it does alone, and far fewer are
    worked out than asked for."""
    from autopar.search.cuts import _StageSearch
    from autopar.search.pipeline import SentAlike

    fold_short(monkeypatch)
    model = build_transformer(kind="gpt", layers=6, hidden=64, heads=4, seq=32, vocab=256, batch=8)
    problem = autopar.build(model, 4, profile())
    shape = PipelineShape(4, 4)
    known = SentAlike(_StageSearch(problem, shape, SearchOptions()).classes)
    asked = 0
    for a, b in itertools.combinations([0, *cut_points(problem), problem.size], 2):
        crossings = cut_crossings(problem, a, b)
        for index in range(shape.stages):
            alone = send_costs(problem, crossings, a, index, shape)
            shared = send_costs(problem, crossings, a, index, shape, known)
            assert alone.keys() == shared.keys()
            assert all(np.array_equal(alone[node], shared[node]) for node in alone)
            asked += len(crossings.into) * (index > 0) + len(crossings.out) * (index < shape.stages - 1)
    assert 0 < len(known.found) < asked / 10


def test_a_stage_ending_in_a_folded_run_pays_what_its_last_operator_sends(monkeypatch):
    """A stage that ends with the last copy of a folded run sends that copy's output on: its last operator's
    costs are its own, not copy 0's last operator's, which the run's table holds. The DP's least (the
    Lagrangian, recomputing or not) is its plan's own cost to rounding, and its plan the ILP's."""
    from autopar.search.fold import Solver

    pytest.importorskip("highspy")
    fold_short(monkeypatch)
    model = build_transformer(kind="gpt", layers=6, hidden=64, heads=4, seq=32, vocab=256, batch=8)
    problem = autopar.build(model, 4, profile())
    shape = PipelineShape(2, 4)
    ended = 0
    for cut in cut_points(problem):
        stage = stage_problem(problem, 0, cut, shape, 0)
        runs = [repeat for repeat, _ in stage.folds if repeat.last(repeat.copies - 1) == stage.size - 1]
        if not runs or np.array_equal(stage.node_time[stage.size - 1], stage.node_time[runs[0].last(0)]):
            continue
        ended += 1
        for memory_weight, recompute in ((0.0, False), (1e-9, False), (1e-9, True)):
            unary = stage.lagrangian(memory_weight, recompute)[0]
            solver = Solver.of(stage)
            solver.bind(stage.main_factors(recompute), stage.recompute_folds if recompute else stage.folds)
            choice, least = solver.solve(unary)
            own = sum(float(u[c]) for u, c in zip(unary, choice))
            own += sum(f.value([choice[u] for u in scope]) for f, scope in stage.all_factors(recompute))
            assert least == pytest.approx(own, rel=1e-12)
        dp, ilp = run_search(stage), run_search(stage, SearchOptions(algorithm="ilp"))
        assert stage.objective(dp.choice, dp.choices) == pytest.approx(
            stage.objective(ilp.choice, ilp.choices), rel=1e-7
        )
    assert ended > 0


@pytest.mark.parametrize("cuts", [(0, 10), (0, 5, 15, 20)])
def test_each_stage_of_a_fixed_cut_equals_the_ilp(monkeypatch, cuts):
    pytest.importorskip("highspy")
    fold_short(monkeypatch)
    problem = build_problem(load_model(residual_stack(5, batch=4)), CostModel(profile(peak=1e9)), 4)
    shape = PipelineShape(len(cuts), 4)
    bounds = [*cuts, problem.size]
    for index in range(len(cuts)):
        stage = stage_problem(problem, bounds[index], bounds[index + 1], shape, index)
        dp, ilp = run_search(stage), run_search(stage, SearchOptions(algorithm="ilp"))
        assert stage.objective(dp.choice, dp.choices) == pytest.approx(
            stage.objective(ilp.choice, ilp.choices), rel=1e-7
        )


def test_folded_and_unfolded_stages_cost_every_assignment_alike(monkeypatch):
    fold_short(monkeypatch)
    graph = load_model(residual_stack(6, batch=8))
    cost = CostModel(profile(peak=1e9))
    folded, unfolded = build_problem(graph, cost, 4), build_problem(graph, cost, 4, fold=False)
    assert folded.folds and not unfolded.folds
    rng = np.random.default_rng(0)
    shape = PipelineShape(4, 2)
    for bounds in [(0, 10, 15, 25, folded.size), (0, 5, 20, 30, folded.size)]:
        for index in range(4):
            a, b = bounds[index], bounds[index + 1]
            one, two = stage_problem(folded, a, b, shape, index), stage_problem(unfolded, a, b, shape, index)
            for _ in range(20):
                choice = [int(rng.integers(len(one.candidates(i)))) for i in range(one.size)]
                assert one.objective(choice) == pytest.approx(two.objective(choice), rel=1e-12)
                assert one.memory(choice) == pytest.approx(two.memory(choice), rel=1e-12)


def test_one_stage_of_one_micro_batch_is_the_problem_itself():
    problem = build_problem(load_model(chain()), CostModel(simple()), 2)
    assert stage_problem(problem, 0, problem.size, ONE_STAGE, 0) is problem


def test_resnet50_keeps_one_stage_and_its_plan(resnet_plan):
    assert resnet_plan.pipeline is None and resnet_plan.degrees.pipeline == 1
    whole = autopar.plan(RESNET50, devices=8, pipeline_stages=1, micro_batches=1)
    assert whole.strategies == resnet_plan.strategies and whole.objective == resnet_plan.objective


def test_micro_batches_a_model_cannot_take_are_refused_for_that_reason(capsys):
    """An export that fixed its batch in a computed shape does not import at a smaller one: the
    sentence says so, not that nothing fits in memory."""
    argv = ["plan", "tests/data/hf_albert_dynamo.onnx", "--devices", "8", "--micro-batches", "2", "--quiet"]
    code, _, err = run_cli(capsys, *argv)
    assert code == 1 and err.count("\n") == 1
    assert "No plan with 2 micro-batches over 1 stage: the model does not take a batch of 2" in err
    assert "memory" not in err


def test_the_cli_takes_stages_micro_batches_and_cuts(tmp_path, capsys):
    path = tmp_path / "chain.onnx"
    path.write_bytes(chain().SerializeToString())
    argv = ["plan", str(path), "--devices", "2", "--format", "json", "--quiet"]
    code, out, err = run_cli(capsys, *argv, "--pipeline-stages", "2", "--micro-batches", "4", "--stage-starts", "mm2")
    assert code == 0, err
    data = json.loads(out)
    assert data["schema"] == "autopar.plan/3" and len(data["pipeline"]["stages"]) == 2
    code, _, err = run_cli(capsys, *argv, "--pipeline-stages", "3")
    assert code == 2 and "power of two" in err
    code, _, err = run_cli(capsys, *argv, "--stage-starts", "nosuch")
    assert code == 1 and "'nosuch'" in err and err.count("\n") == 1
    code, _, err = run_cli(capsys, *argv, "--pipeline-stages", "4", "--stage-starts", "mm2")
    assert code == 1 and "stage" in err


def test_the_mindspore_export_records_each_operator_s_stage_and_the_others_refuse(tmp_path):
    from autopar.export.mindspore import strategy_map

    plan = autopar.plan(
        chain(), devices=2, cost_model=simple(), pipeline_stages=2, micro_batches=4, stage_starts=["mm2"]
    )
    message = strategy_map(plan.file)
    assert {item.node_name: item.parallel_strategys.stage for item in message.parallel_strategy_item} == {
        "mm1": 0,
        "relu": 0,
        "mm2": 1,
    }
    written = autopar.export_plan(plan, "mindspore", tmp_path / "chain.ckpt")
    snippet = next(path for path in written if path.suffix == ".py").read_text()
    assert "pipeline_stages=2" in snippet and "micro_size=4" in snippet
    for to in ("jax", "onnx"):
        with pytest.raises(autopar.AutoparError, match="does not express pipeline stages"):
            autopar.export_plan(plan, to, tmp_path / f"chain.{to}")


def test_the_report_draws_the_1f1b_schedule():
    plan = autopar.plan(
        chain(), devices=2, cost_model=simple(), pipeline_stages=2, micro_batches=4, stage_starts=["mm2"]
    )
    page = plan._repr_html_()
    schedule = page[page.index("id='schedule'") :].split("</section>")[0]
    assert schedule.count("forward of micro-batch") == 2 * 4 and schedule.count("backward of micro-batch") == 2 * 4
    assert "20.0% of each stage's step" in schedule


class _TableStages:
    """A stand-in for `_StageSearch` over integer stage times (ties everywhere): the exact time where it
    beats ``beat``, else a bound no less than ``beat``, as the real search tells."""

    def __init__(self, shape, floors, extra):
        self.shape, self.floors, self.extra = shape, floors, extra
        self.searched = 0

    def exact(self, first, last, index):
        return sum(self.floors[first:last]) + self.extra[(first, last, index)]

    def time(self, first, last, index, beat=math.inf):
        floor = sum(self.floors[first:last])
        if floor >= beat:
            return floor, None
        self.searched += 1
        seconds = self.exact(first, last, index)
        return (seconds, "plan") if seconds < beat else (beat, None)


def _reference_cuts(stages, points, count):
    """(the least slowest stage, each stage's first operator): stage by stage from the last, the first
    place, in order, of the least, every candidate cut costed in full."""

    def best(index, b):  # (least slowest of stages 0..index with stage index ending at point b, where it starts)
        if index == 0:
            return stages.exact(0, points[b], 0), 0
        return min((max(best(index - 1, a)[0], stages.exact(points[a], points[b], index)), a) for a in range(index, b))

    least, _ = best(count - 1, len(points) - 1)
    cuts = [len(points) - 1]
    for index in range(count - 1, 0, -1):
        cuts.append(best(index, cuts[-1])[1])
    return least, tuple(points[b] for b in [0, *reversed(cuts[1:])])


@pytest.mark.parametrize("seed", range(60))
def test_the_cut_search_takes_the_first_of_the_least_from_the_last_stage_back(seed):
    """On integer stage times full of ties, at 2 to 5 stages and under any bound: the least slowest stage
    (as brute force over every cut finds it), and where cuts tie, each stage starting at the first place,
    in order, of the least, from the last stage back (each stage's best given its end)."""
    rng = np.random.default_rng(seed)
    points = [0, *sorted(rng.choice(np.arange(1, 12), size=int(rng.integers(3, 8)), replace=False).tolist()), 12]
    floors = rng.integers(0, 3, size=12).tolist()
    last = len(points) - 1
    for count in range(2, min(5, last) + 1):
        shape = PipelineShape(count, 8)
        extra = {(a, b, i): int(rng.integers(0, 4)) for a in points for b in points for i in range(count)}
        stages = _TableStages(shape, floors, extra)

        least, want = _reference_cuts(stages, points, count)
        brute = min(
            max(stages.exact(a, b, i) for i, (a, b) in enumerate(zip((0, *inner), (*inner, 12))))
            for inner in itertools.combinations(points[1:-1], count - 1)
        )
        assert least == brute
        for bound in (math.inf, least + 1, least, least - 1):
            found = _min_max_search(stages, points, count, lambda a, b: sum(floors[points[a] : points[b]]), bound)
            if least < bound:
                assert found is not None and found.time_s == least and found.starts == want
            else:
                assert found is None


def test_stages_made_with_the_arrays_earlier_stages_made_equal_those_made_alone():
    """`stage_problem` given the rescaled arrays the stages cut before from the same problem made (``made``,
    as the cut search keeps them) gives the stage it gives alone, array for array; and the copies of a folded
    run share their rescaled arrays as they share the problem's."""
    model = build_transformer(kind="gpt", layers=6, hidden=64, heads=4, seq=32, vocab=256, batch=8)
    problem = autopar.build(model, 4, profile())
    shape = PipelineShape(2, 4)
    points = [0, *cut_points(problem), problem.size]
    made: dict = {}

    def tables(stage):
        return [f.table for recompute in (False, True) for f, _ in stage.all_factors(recompute)]

    shared_any = False
    for a, b in itertools.combinations(points, 2):
        for index in range(shape.stages):
            alone = stage_problem(problem, a, b, shape, index)
            kept = stage_problem(problem, a, b, shape, index, made=made)
            for name in ("node_time", "node_communication", "node_memory", "node_activations"):
                assert all(np.array_equal(x, y) for x, y in zip(getattr(alone, name), getattr(kept, name)))
            assert all(np.array_equal(x, y) for x, y in zip(tables(alone), tables(kept)))
            again = stage_problem(problem, a, b, shape, index, made=made)  # made once: the same arrays
            assert all(x is y for x, y in zip(tables(kept), tables(again)))
            shared_any |= len({id(t) for t in tables(alone)}) < len(tables(alone))
    assert made and shared_any


def test_no_stage_starts_between_two_readers_of_one_weight_or_inside_one_module_node():
    """x -> MatMul(W) -> Relu -> MatMul(V) -> Add(b) -> Relu -> MatMul(W): W is read at both ends, so no cut
    falls between its readers (a stage owns its weights); without the second read of W, the cuts fall anywhere
    one activation crosses but between the MatMul and the Add the exporter recorded for one ``linear``."""
    from onnx import ModelProto, TensorProto, helper, numpy_helper

    def model(shared: bool) -> ModelProto:
        weights = {"W": (8, 8), "V": (8, 8), "U": (8, 8), "b": (8,)}
        last = "W" if shared else "U"
        nodes = [
            helper.make_node("MatMul", ["x", "W"], ["h1"], name="mm1"),
            helper.make_node("Relu", ["h1"], ["r1"], name="relu1"),
            helper.make_node("MatMul", ["r1", "V"], ["h2"], name="mm2"),
            helper.make_node("Add", ["h2", "b"], ["h3"], name="bias2"),
            helper.make_node("Relu", ["h3"], ["r2"], name="relu2"),
            helper.make_node("MatMul", ["r2", last], ["y"], name="mm3"),
        ]
        for node in nodes[2:4]:  # one module node, two operators
            entry = node.metadata_props.add()
            entry.key, entry.value = "pkg.torch.onnx.fx_node", "%linear : [num_users=1] = call_function[...]"
        initializers = [
            numpy_helper.from_array(np.ones(shape, dtype=np.float32), name) for name, shape in weights.items()
        ]
        graph = helper.make_graph(
            nodes,
            "g",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8])],
            [init for init in initializers if init.name != ("U" if shared else "")],
        )
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])

    index = {rule.op.name: node for node, rule in enumerate(autopar.build(model(False), 2).rules)}
    assert set(cut_points(autopar.build(model(False), 2))) == {index[name] for name in ("relu1", "mm2", "relu2", "mm3")}
    assert cut_points(autopar.build(model(True), 2)) == ()


def test_more_stages_than_the_cut_points_allow_are_refused_saying_which_weight_holds_them():
    """A tied language model (`tests.test_graph_tied`): its embedding is read by the lookup and, transposed, by the
    output product, so no stage starts between them; two stages are refused in one sentence that names the
    weight, where the search said nothing fit in memory. Untied, two stages plan; four are one too many."""
    from tests.test_graph_tied import _language_model

    with pytest.raises(autopar.AutoparError) as refused:
        autopar.plan(_language_model(tied=True), devices=8, pipeline_stages=2)
    assert str(refused.value) == (
        "The model has no place where a pipeline stage may start (none between 'lookup' and 'output', which both"
        " read weight 'embedding': one stage holds it; the embedding is tied to the output matrix: untie it before"
        " exporting to cut between them), so it cannot be cut into 2 stages; plan it with one."
    )
    assert autopar.plan(_language_model(tied=False), devices=8, pipeline_stages=2).degrees.pipeline == 2
    with pytest.raises(autopar.AutoparError, match=r"has 2 places where .* cut into 4 stages; ask for at most 2"):
        autopar.plan(_language_model(tied=False), devices=8, pipeline_stages=4)
