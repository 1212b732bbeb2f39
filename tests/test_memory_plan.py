"""Memory reliefs and memory accounting, worked out by hand or cross-checked exactly.

The parallel optimizer (ZeRO-2) and recomputation are searched only when the fastest plan does
not fit; `--frozen` parameters carry no gradient, state or sync; `--no-overlap` hides nothing;
the activations a plan keeps are what each backward needs, each counted once.

Bytes per parameter element in mixed precision (the simple profile: 4 B master, 4 B momentum):
the FP16 working copy (2) plus master, FP16 gradient and momentum (4 + 2 + 4 = 10) split over the
optimizer shards, so 12 B whole, 7 B over 2 shards; a frozen parameter is 4 B.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import autopar
from autopar.cost import HardwareProfile
from autopar.lowering.lower import gradient_sync
from autopar.search.driver import SearchOptions, run_search
from autopar.search.fold import minimise
from autopar.search.memory import MemoryChoices
from autopar.search.pipeline import PipelineShape, stage_problem
from autopar.search.problem import SearchProblem
from tests.conftest import (
    every_plan,
    make_model,
    profile,
    random_model,
    run_cli,
    simple_profile_dict,
    two_matmul_chain,
    weight,
)

REPO = Path(__file__).resolve().parents[1]
RESNET50 = REPO / "models" / "resnet50.onnx"


def simple(capacity: float = 1e12) -> HardwareProfile:
    return HardwareProfile.model_validate(simple_profile_dict(capacity))


def items_total(problem: SearchProblem, choice, choices: MemoryChoices) -> float:
    return sum(nbytes for node, c in enumerate(choice) for _, _, nbytes in problem.memory_items(node, c, choices))


# --- the parallel optimizer ---------------------------------------------------------------------

# Z = (X @ W1) @ W2 with X 16x8, W1 8x16, W2 16x4 on 4 devices (bit 0 the 1 GB/s level, bit 1 the
# 100 MB/s one with 10 us latency).
CHAIN = dict(batch=16, d_in=8, d_hidden=16, d_out=4)
# Leanest without a parallel optimizer: mm1 splits W1's columns 4 ways and reads X whole
# (X 16x8 FP16 = 256 B, W1 32 elements x 12 B, Y 16x16 / 4 FP16 = 128 B kept for dW2), mm2 splits
# W2's columns 4 ways (16 elements x 12 B).
LEANEST_PLAIN = 256 + 32 * 12 + 128 + 16 * 12
# Leanest with one: mm1 splits the batch and W1's columns 2 ways each (X 64 elements = 128 B, W1
# 64 elements replicated over the batch bit: 2 optimizer shards, 7 B each, Y 64 elements = 128 B),
# mm2 as above.
LEANEST_SHARDED = 128 + 64 * 7 + 128 + 16 * 12
CAPACITY = (LEANEST_PLAIN + LEANEST_SHARDED) // 2  # 928: only a plan with a parallel optimizer fits


def scatter_or_gather_bit1(nbytes: float) -> float:
    """A ReduceScatter (or AllGather) of ``nbytes`` over mesh bit 1: latency scaled by the 1 MB bucket."""
    return 1e-5 * nbytes / 1e6 + nbytes / 2 / 1e8


def test_leanest_plans_with_and_without_the_parallel_optimizer_by_hand():
    assert (LEANEST_PLAIN, LEANEST_SHARDED, CAPACITY) == (960, 896, 928)
    problem = autopar.build(two_matmul_chain(**CHAIN), 4, simple())
    assert sorted(problem.sharded) == [0, 1]
    plans = list(every_plan(problem))
    assert min(problem.memory(*plan) for plan in plans if not plan[1].sharded) == LEANEST_PLAIN
    assert min(problem.memory(*plan) for plan in plans if plan[1].sharded) == LEANEST_SHARDED


def test_parallel_optimizer_is_chosen_when_only_it_fits():
    # one stage over the whole batch: micro-batches and pipeline stages are other ways to fit
    plan = autopar.plan(
        two_matmul_chain(**CHAIN), devices=4, cost_model=simple(CAPACITY), micro_batches=1, pipeline_stages=1
    )
    data = plan.to_dict()
    # mm1: batch on bit 1, W1's columns on bit 0; mm2: batch on bit 1, the contraction on bit 0 (Y stays put)
    assert plan.strategies == {"mm1": ((2, 1), (1, 2)), "mm2": ((2, 2), (2, 1))}
    assert data["memory_plan"]["parallel_optimizer"] == ["W1", "W2"]
    assert data["memory_plan"]["recompute"] == []
    syncs = {entry["parameter"]: entry for entry in data["gradient_sync"]}
    for name, local_elements in (("W1", 64), ("W2", 32)):
        nbytes = local_elements * 2  # FP16 gradient
        entry = syncs[name]
        assert entry["collective"] == "ReduceScatter"
        assert entry["optimizer_shards"] == 2 and entry["group_size"] == 2 and entry["bits"] == [1]
        assert entry["bytes"] == nbytes
        # ReduceScatter of the gradient, then AllGather of the updated weights
        assert entry["seconds"] == pytest.approx(2 * scatter_or_gather_bit1(nbytes), rel=1e-11)
    # X 64 elements FP16, W1 64 x 7 B, Y 64 elements FP16 (kept for dW2), W2 32 x 7 B
    assert plan.memory_per_device == 128 + 64 * 7 + 128 + 32 * 7 == CAPACITY
    totals = data["totals"]
    assert totals["memory_per_device_bytes"] == CAPACITY
    assert totals["memory_breakdown"] == {"parameter_state": 64 * 7 + 32 * 7, "activations": 128, "inputs": 128}
    # time: compute 2x(4096 / 4) + 3x(2048 / 4) FLOPs at 1 TFLOP/s; the partial Z (8x4 FP16 = 64 B) is
    # AllReduced over bit 0, unfused; W1's ReduceScatter and both AllGathers are exposed, W2's ReduceScatter
    # hides behind mm1's fastest backward (4096 / 4 FLOPs).
    compute = 2 * 4096 / 4 / 1e12 + 3 * 2048 / 4 / 1e12
    z_allreduce = 2 * (1e-6 + 64 / 2 / 1e9)
    syncs_s = 2 * scatter_or_gather_bit1(128) + 2 * scatter_or_gather_bit1(64)
    hidden = 4096 / 4 / 1e12
    assert totals["hidden_communication_s"] == pytest.approx(hidden, rel=1e-11)
    assert plan.objective == pytest.approx(compute + z_allreduce + syncs_s - hidden, rel=1e-11)


def test_parallel_optimizer_plan_equals_brute_force_and_the_ilp():
    problem = autopar.build(two_matmul_chain(**CHAIN), 4, simple(CAPACITY))
    fitting = [plan for plan in every_plan(problem) if problem.memory(*plan) <= CAPACITY]
    assert fitting and all(choices.sharded for _, choices in fitting)  # only the parallel optimizer fits
    best = min(problem.objective(*plan) for plan in fitting)
    dp = run_search(problem)
    assert dp.choices.sharded and not dp.choices.recompute
    assert problem.memory(dp.choice, dp.choices) <= CAPACITY
    assert problem.objective(dp.choice, dp.choices) == pytest.approx(best, rel=1e-12)
    # the breakdown sums to the memory per device, for every plan and every set of parallel optimizers
    for choice, choices in every_plan(problem):
        assert items_total(problem, choice, choices) == pytest.approx(problem.memory(choice, choices), rel=1e-12)
    pytest.importorskip("highspy")
    ilp = run_search(problem, SearchOptions(algorithm="ilp"))
    assert problem.memory(ilp.choice, ilp.choices) <= CAPACITY
    assert problem.objective(ilp.choice, ilp.choices) == pytest.approx(best, rel=1e-9)


AMPLE = [
    pytest.param(lambda: two_matmul_chain(**CHAIN), 4, id="chain-16x8x16x4-4dev"),
    pytest.param(two_matmul_chain, 2, id="chain-golden-2dev"),
    pytest.param(lambda: two_matmul_chain(batch=8, d_in=64, d_hidden=256, d_out=64), 2, id="chain-megatron-2dev"),
    pytest.param(lambda: random_model(3), 4, id="random3-4dev"),
]


@pytest.mark.parametrize("make, devices", AMPLE)
def test_with_ample_memory_the_parallel_optimizer_is_taken_only_where_it_is_faster(make, devices):
    """Memory to spare, nothing is recomputed, and an operator's parameters take the parallel optimizer only where
    that makes it faster (each rank updating its shard, its ReduceScatter and AllGather costing what the
    AllReduce does): the plan is brute force's fastest over every plan, with or without it."""
    model = make()
    plan = autopar.plan(model, devices=devices, cost_model=profile(peak=1e9))
    data = plan.to_dict()
    assert data["memory_plan"]["recompute"] == [] and not plan.search.choices.recompute
    assert data["gradient_sync"], "the model has trainable parameters"
    problem = plan.problem
    for node in plan.search.choices.sharded:
        c = plan.choice[node]
        assert problem.sharded[node].time[c] < problem.node_time[node][c]
    for entry in data["gradient_sync"]:
        # sharded on a dimension the shards divide: a ReduceScatter; where none divides, the state is a flat
        # slice and the gradient is summed whole (an AllReduce, its cost the same)
        scattered = entry.get("optimizer_shards") is not None and "dim" in entry
        assert entry["collective"] in ((None, "ReduceScatter") if scattered else (None, "AllReduce"))
    plans = list(every_plan(problem))
    assert plan.objective == pytest.approx(min(problem.objective(*p) for p in plans), rel=1e-9)


def test_time_ties_keep_the_plain_allreduce():
    """A parallel optimizer exactly as fast as the AllReduce (and leaner) is not taken when memory is ample."""
    problem = autopar.build(two_matmul_chain(**CHAIN), 4, simple())
    tied = {
        node: dataclasses.replace(alternative, time=problem.node_time[node].copy())
        for node, alternative in problem.sharded.items()
    }
    for node, alternative in problem.sharded.items():
        assert (alternative.memory < problem.node_memory[node]).any()
    problem = dataclasses.replace(problem, sharded=tied)
    unary, takes = problem.lagrangian(0.0, False)
    assert takes == [None] * problem.size
    for node in range(problem.size):
        np.testing.assert_array_equal(unary[node], problem.node_time[node])
    _, weighed = problem.lagrangian(1.0, False)  # weighing memory, the leaner tie is taken
    assert any(t is not None and t.any() for t in weighed)
    found = run_search(problem)
    assert found.choices.sharded == frozenset()
    assert all(entry.optimizer_shards is None for entry in gradient_sync(problem, found.choice, found.choices))


# --- recomputation ------------------------------------------------------------------------------


def block_stack(blocks: int = 5, batch: int = 16, width: int = 8, hidden: int = 64) -> onnx.ModelProto:
    """X -> [MatMul(W_a), Relu, MatMul(W_b)] x blocks -> ReduceSum.

    Kept for backward: each Relu's output (for itself and the second MatMul's dW_b) and each second
    MatMul's output (the next block's dW_a); the first MatMul's output is kept by nobody. The repeated
    run starts at block 0's second MatMul (the operator before it, a Relu, is every copy's last), so
    blocks 1-4 fold as 4 copies of [MatMul, MatMul, Relu] shifted by one.
    """
    nodes, inits, x = [], [], "X"
    for b in range(blocks):
        nodes += [
            helper.make_node("MatMul", [x, f"W{b}a"], [f"h{b}"], name=f"b{b}_mm1"),
            helper.make_node("Relu", [f"h{b}"], [f"r{b}"], name=f"b{b}_relu"),
            helper.make_node("MatMul", [f"r{b}", f"W{b}b"], [f"y{b}"], name=f"b{b}_mm2"),
        ]
        inits += [weight(f"W{b}a", [width, hidden], 2 * b), weight(f"W{b}b", [hidden, width], 2 * b + 1)]
        x = f"y{b}"
    nodes.append(helper.make_node("ReduceSum", [x], ["loss"], name="loss", keepdims=0))
    return make_model(nodes, [("X", TensorProto.FLOAT, [batch, width])], ["loss"], inits)


def leanest(problem: SearchProblem, recompute: bool) -> float:
    """The least memory of any plan (each operator at its leaner optimizer choice), exactly: bytes per
    candidate dwarf the edge seconds minimise adds."""
    both = MemoryChoices(frozenset(problem.sharded), recompute)
    unary = []
    for node in range(problem.size):
        memory = problem.node_arrays(node, MemoryChoices(recompute=recompute))[1]
        if node in problem.sharded:
            memory = np.minimum(memory, problem.node_arrays(node, both)[1])
        unary.append(memory)
    choice = minimise(problem, unary)
    return sum(float(u[c]) for u, c in zip(unary, choice))


def test_memory_floor_is_the_leanest_plans_memory():
    """The driver skips a kind of plan whose floor does not fit without running the DP: the floor must
    be exactly what the DP's leanest plan needs."""
    problem = autopar.build(block_stack(), 2, profile(peak=1e9))
    stage = stage_problem(problem, 0, problem.size, PipelineShape(2, 4), 0)  # (its copies' arrays shared, rescaled)
    for cut in (problem, stage):
        for recompute in (False, True):
            assert cut.memory_floor(recompute) == pytest.approx(leanest(cut, recompute), rel=1e-12)


RC_DEVICES, RC_PEAK = 2, 1e9
RUN = range(2, 2 + 4 * 3)  # the folded operators: 4 copies of 3, from b0_mm2


def test_recomputation_is_chosen_when_only_it_fits():
    model = block_stack()
    free = autopar.build(model, RC_DEVICES, profile(peak=RC_PEAK))
    assert [(r.start, r.period, r.copies) for r, _ in free.folds] == [(RUN.start, 3, 4)]
    without, with_recompute = leanest(free, False), leanest(free, True)
    assert with_recompute < without
    capacity = (without + with_recompute) / 2
    whole = {"micro_batches": 1, "pipeline_stages": 1}  # micro-batches and stages are other ways to fit
    plan = autopar.plan(model, devices=RC_DEVICES, cost_model=profile(capacity=capacity, peak=RC_PEAK), **whole)
    fastest = autopar.plan(model, devices=RC_DEVICES, cost_model=profile(peak=RC_PEAK))
    assert fastest.memory_per_device > capacity and not fastest.search.choices.recompute
    problem, choice, choices = plan.problem, list(plan.choice), plan.search.choices
    data = plan.to_dict()
    assert choices.recompute
    assert data["memory_plan"]["recompute"] == ["b0_mm2"]
    assert data["memory_plan"]["recompute"] == [block["first_op"] for block in data["search"]["repeated_blocks"]]

    # memory: what the plan says, what the problem says, and the same strategies without recomputation
    # less 3/4 of the outputs kept inside each copy (one block's activations are held while rebuilt)
    memory = problem.memory(choice, choices)
    assert memory <= capacity
    assert plan.memory_per_device == memory
    assert data["totals"]["memory_per_device_bytes"] == round(memory)
    assert problem.memory(choice, MemoryChoices(choices.sharded)) > capacity  # it fits only by recomputing
    inside = 0.0
    for node in RUN:
        rule = problem.rules[node]
        if (node - RUN.start) % 3 == 2:
            continue  # each copy's last operator: its output is the next block's input, kept
        for name, layout in zip(rule.op.outputs, rule.candidate_layouts(choice[node])[1]):
            if name in problem.kept:
                inside += layout.local_numel(problem.graph.tensor(name).shape) * 2
    assert inside > 0
    assert problem.memory(choice, MemoryChoices(choices.sharded)) - memory == pytest.approx(3 / 4 * inside, rel=1e-12)
    # the breakdown sums to the memory per device
    assert items_total(problem, choice, choices) == pytest.approx(memory, rel=1e-12)
    assert sum(data["totals"]["memory_breakdown"].values()) == pytest.approx(round(memory), abs=2)

    # time: every folded operator's forward again, at its strategy (compute-bound at 1 GFLOP/s)
    forward = 0.0
    for node in RUN:
        seconds = problem.rules[node].op.flops / 2 ** sum(problem.candidates(node)[choice[node]]) / RC_PEAK
        assert float(problem.recompute_time[node][choice[node]]) == pytest.approx(seconds, rel=1e-12)
        forward += seconds
    assert forward > 0
    assert plan.objective >= fastest.objective + forward * (1 - 1e-12)
    compute = sum(float(problem.node_compute[i][c]) for i, c in enumerate(choice)) + forward
    assert data["totals"]["compute_s"] == pytest.approx(compute, rel=1e-11)

    # the DP's plan is the ILP's (solved with and without recomputation) at this capacity
    pytest.importorskip("highspy")
    ilp = run_search(problem, SearchOptions(algorithm="ilp"))
    assert ilp.choices.recompute
    assert problem.memory(ilp.choice, ilp.choices) <= capacity * (1 + 1e-12)
    assert plan.objective == pytest.approx(problem.objective(ilp.choice, ilp.choices), rel=1e-9)


def test_the_warnings_say_which_memory_measures_were_asked_for_and_which_memory_made():
    """Recomputation and micro-batches the search took to fit are said as such; the same asked for with room to
    spare are said as asked (the plan file records which: ``search.asked``)."""
    from autopar.lowering.advice import plan_warnings
    from autopar.lowering.planfile import read_plan_file

    model = block_stack()
    free = autopar.build(model, RC_DEVICES, profile(peak=RC_PEAK))
    capacity = (leanest(free, False) + leanest(free, True)) / 2
    whole = {"micro_batches": 1, "pipeline_stages": 1}
    made = autopar.plan(model, devices=RC_DEVICES, cost_model=profile(capacity=capacity, peak=RC_PEAK), **whole)
    assert made.file.search.asked == ["micro_batches"]  # (one micro-batch, asked: it warns of none)
    said = plan_warnings(made.file)
    assert [s for s in said if "recompute" in s] == [
        "To fit in memory, the repeated blocks from b0_mm2 recompute their forward pass in the backward."
    ]
    asked = autopar.plan(model, devices=RC_DEVICES, cost_model=profile(peak=RC_PEAK), micro_batches=2, recompute=True)
    assert asked.file.search.asked == ["micro_batches", "recompute"]
    assert not asked.search.memory_multiplier  # room to spare
    assert plan_warnings(asked.file) == [
        "As asked, the repeated blocks from b0_mm2 recompute their forward pass in the backward.",
        "As asked, the step accumulates gradients over 2 micro-batches; the operators' shapes and costs are one"
        " micro-batch's.",
    ]
    assert read_plan_file(json.loads(asked.to_json())).search.asked == ["micro_batches", "recompute"]
    searched = autopar.plan(model, devices=RC_DEVICES, cost_model=profile(peak=RC_PEAK))
    assert "asked" not in searched.to_dict()["search"]  # (absent where none: other plans are as they were)


@pytest.mark.parametrize("share", [0.25, 0.75])
def test_recomputation_under_any_capacity_fits_and_never_beats_the_ilp(share):
    """Between the two leanest plans both solvers recompute and fit; the DP's Lagrangian walk returns the
    best plan on the (time, memory) hull, which may be slower than the ILP's exact optimum, never faster."""
    model = block_stack(batch=64, width=8, hidden=32)
    free = autopar.build(model, 4, profile(peak=RC_PEAK))
    without, with_recompute = leanest(free, False), leanest(free, True)
    capacity = with_recompute + share * (without - with_recompute)
    problem = autopar.build(model, 4, profile(capacity=capacity, peak=RC_PEAK))
    dp = run_search(problem)
    assert dp.choices.recompute and problem.memory(dp.choice, dp.choices) <= capacity
    assert items_total(problem, dp.choice, dp.choices) == pytest.approx(problem.memory(dp.choice, dp.choices))
    pytest.importorskip("highspy")
    ilp = run_search(problem, SearchOptions(algorithm="ilp"))
    assert ilp.choices.recompute and problem.memory(ilp.choice, ilp.choices) <= capacity * (1 + 1e-12)
    assert problem.objective(ilp.choice, ilp.choices) <= problem.objective(dp.choice, dp.choices) * (1 + 1e-9)


def test_memory_items_sum_to_the_memory_under_any_memory_choices():
    """The breakdown (memory_items) and the searched memory agree term for term, whatever is chosen."""
    problem = autopar.build(block_stack(), 4, profile(peak=RC_PEAK))
    rng = random.Random(0)
    optional = sorted(problem.sharded)
    for _ in range(60):
        choice = [rng.randrange(len(problem.candidates(i))) for i in range(problem.size)]
        choices = MemoryChoices(frozenset(n for n in optional if rng.random() < 0.5), rng.random() < 0.5)
        assert items_total(problem, choice, choices) == pytest.approx(problem.memory(choice, choices), rel=1e-12)


# --- frozen parameters --------------------------------------------------------------------------


def test_frozen_parameter_has_no_sync_and_four_bytes_per_element():
    model = two_matmul_chain()  # X 4x8, W1 8x16, W2 16x4 on 2 devices
    trained = autopar.plan(model, devices=2, cost_model=simple(), mode="data_parallel")
    frozen = autopar.plan(model, devices=2, cost_model=simple(), mode="data_parallel", frozen=["W2"])
    assert [entry["parameter"] for entry in trained.gradient_sync()] == ["W1", "W2"]
    assert [entry["parameter"] for entry in frozen.gradient_sync()] == ["W1"]
    # X 2x8 FP16, W1 128 x 12 B, Y 2x16 FP16 kept for dW2, W2 64 x 12 B
    assert trained.memory_per_device == 32 + 128 * 12 + 64 + 64 * 12
    # W2 64 x 4 B; Y is no longer kept (mm2's backward needs only W2, for dY)
    assert frozen.memory_per_device == 32 + 128 * 12 + 64 * 4
    assert frozen.to_dict()["totals"]["memory_breakdown"] == {
        "parameter_state": 128 * 12 + 64 * 4,
        "activations": 0,
        "inputs": 32,
    }


def test_frozen_in_auto_parallel_and_by_glob():
    model = two_matmul_chain()
    trained = autopar.plan(model, devices=2, cost_model=simple())
    by_name = autopar.plan(model, devices=2, cost_model=simple(), frozen=["W2"])
    by_glob = autopar.plan(model, devices=2, cost_model=simple(), frozen=["*2"])
    as_string = autopar.plan(model, devices=2, cost_model=simple(), frozen="W2")
    assert all(entry["parameter"] != "W2" for entry in by_name.gradient_sync())
    assert [entry["parameter"] for entry in by_name.gradient_sync()] == ["W1"]
    assert by_name.memory_per_device < trained.memory_per_device
    # whole on both devices: X 4x8 FP16, W1 128 x 12 B, (Y 4x16 FP16 kept only while W2 trains), W2 64 x 12 or 4 B
    assert trained.strategies == by_name.strategies == {"mm1": ((1, 1), (1, 1)), "mm2": ((1, 1), (1, 1))}
    assert trained.memory_per_device == 64 + 128 * 12 + 128 + 64 * 12
    assert by_name.memory_per_device == 64 + 128 * 12 + 64 * 4
    for other in (by_glob, as_string):
        assert other.to_dict()["gradient_sync"] == by_name.to_dict()["gradient_sync"]
        assert other.memory_per_device == by_name.memory_per_device
        assert other.objective == by_name.objective
    everything = autopar.plan(model, devices=2, cost_model=simple(), frozen=["W?"])
    assert everything.gradient_sync() == []
    assert everything.to_dict()["totals"]["memory_breakdown"]["parameter_state"] == (128 + 64) * 4


@pytest.mark.parametrize("patterns", [["W3"], ["W1", "V*"]])
def test_frozen_pattern_matching_nothing_is_one_sentence(patterns):
    with pytest.raises(autopar.AutoparError) as info:
        autopar.plan(two_matmul_chain(), devices=2, cost_model=simple(), frozen=patterns)
    message = str(info.value)
    assert repr(patterns[-1]) in message
    assert "\n" not in message and message.endswith(".") and ". " not in message


@pytest.fixture
def chain_path(tmp_path) -> Path:
    path = tmp_path / "chain.onnx"
    onnx.save(two_matmul_chain(), str(path))
    return path


def test_cli_frozen(capsys, chain_path):
    code, out, err = run_cli(capsys, "plan", chain_path, "--devices", "2", "--frozen", "W2", "--format", "json")
    assert code == 0, err
    data = json.loads(out)
    assert [entry["parameter"] for entry in data["gradient_sync"]] == ["W1"]
    code, out, err = run_cli(capsys, "plan", chain_path, "--devices", "2", "--frozen", "W3", "--quiet")
    assert code == 1 and out == ""
    assert err.startswith("autopar: error:") and "'W3'" in err
    assert err.endswith("\n") and err.count("\n") == 1 and "Traceback" not in err


# --- overlap ------------------------------------------------------------------------------------


def test_cli_no_overlap_hides_nothing_and_matches_evaluate(capsys):
    code, out, err = run_cli(capsys, "plan", RESNET50, "--devices", "8", "--no-overlap", "--format", "json")
    assert code == 0, err
    data = json.loads(out)
    totals = data["totals"]
    assert totals["hidden_communication_s"] == 0
    assert totals["gradient_sync_s"] > 0
    strategies = {op["name"]: op["strategy"] for op in data["ops"]}
    step = autopar.evaluate(str(RESNET50), 8, strategies, overlap=False)
    assert totals["step_time_s"] == pytest.approx(step, rel=1e-11)
    assert data["objective_s"] == pytest.approx(step, rel=1e-11)
    # with overlap the same strategies are faster by what the backward hides
    assert autopar.evaluate(str(RESNET50), 8, strategies) < step

    code, out, err = run_cli(capsys, "plan", RESNET50, "--devices", "8", "--format", "json")
    assert code == 0, err
    overlapped = json.loads(out)["totals"]
    assert overlapped["hidden_communication_s"] > 0
    assert overlapped["step_time_s"] < totals["step_time_s"]


# --- activations kept for backward --------------------------------------------------------------


def scalar(name: str, value: float = 2.0) -> onnx.TensorProto:
    """A scalar initializer: a constant, not a trainable weight."""
    return numpy_helper.from_array(np.array(value, dtype=np.float32), name)


X_8x16 = [("X", TensorProto.FLOAT, [8, 16])]
HALF_8x16_FP16 = 8 * 16 // 2 * 2  # an 8x16 activation split over the batch of 2 devices, FP16: 128 B


def kept_and_activations(model: onnx.ModelProto, frozen=()) -> tuple[frozenset[str], int]:
    """(the activations some backward keeps, their bytes per device under data parallel on 2 devices)."""
    problem = autopar.build(model, 2, simple(), frozen=frozen)
    plan = autopar.plan(model, devices=2, cost_model=simple(), mode="data_parallel", frozen=frozen)
    return problem.kept, plan.to_dict()["totals"]["memory_breakdown"]["activations"]


def test_mul_by_a_constant_keeps_nothing():
    nodes = [
        helper.make_node("MatMul", ["X", "W"], ["h"], name="mm"),
        helper.make_node("Mul", ["h", "C"], ["out"], name="mul"),
    ]
    model = make_model(nodes, X_8x16, ["out"], [weight("W", [16, 16]), scalar("C")])
    problem = autopar.build(model, 2, simple())
    assert problem.graph.tensor("C").kind == "constant"
    # mm keeps X (an input, resident anyway) for dW; Mul's dh is the gradient times C
    assert kept_and_activations(model) == (frozenset(), 0)


def test_mul_of_two_activations_keeps_both():
    nodes = [
        helper.make_node("MatMul", ["X", "W1"], ["a"], name="mm1"),
        helper.make_node("MatMul", ["X", "W2"], ["b"], name="mm2"),
        helper.make_node("Mul", ["a", "b"], ["out"], name="mul"),
    ]
    model = make_model(nodes, X_8x16, ["out"], [weight("W1", [16, 16]), weight("W2", [16, 16], 1)])
    assert kept_and_activations(model) == (frozenset({"a", "b"}), 2 * HALF_8x16_FP16)


def test_where_keeps_only_its_condition():
    nodes = [
        helper.make_node("Greater", ["X", "Z"], ["cond"], name="gt"),
        helper.make_node("MatMul", ["X", "W1"], ["a"], name="mm1"),
        helper.make_node("MatMul", ["X", "W2"], ["b"], name="mm2"),
        helper.make_node("Where", ["cond", "a", "b"], ["out"], name="where"),
    ]
    inits = [weight("W1", [16, 16]), weight("W2", [16, 16], 1), scalar("Z", 0.0)]
    model = make_model(nodes, X_8x16, ["out"], inits)
    # the 8x16 boolean condition, split over the batch: 64 one-byte elements
    assert kept_and_activations(model) == (frozenset({"cond"}), 64)


def test_where_with_a_constant_condition_keeps_nothing():
    mask = numpy_helper.from_array(np.tril(np.ones((8, 16), dtype=bool)), "M")
    nodes = [
        helper.make_node("MatMul", ["X", "W1"], ["a"], name="mm1"),
        helper.make_node("MatMul", ["X", "W2"], ["b"], name="mm2"),
        helper.make_node("Where", ["M", "a", "b"], ["out"], name="where"),
    ]
    model = make_model(nodes, X_8x16, ["out"], [weight("W1", [16, 16]), weight("W2", [16, 16], 1), mask])
    assert autopar.build(model, 2, simple()).graph.tensor("M").kind == "constant"
    assert kept_and_activations(model) == (frozenset(), 0)


def test_a_tensor_read_by_two_matmuls_counts_once():
    nodes = [
        helper.make_node("MatMul", ["X", "W1"], ["h"], name="mm1"),
        helper.make_node("MatMul", ["h", "W2"], ["a"], name="mm2"),
        helper.make_node("MatMul", ["h", "W3"], ["b"], name="mm3"),
        helper.make_node("Add", ["a", "b"], ["out"], name="add"),
    ]
    inits = [weight("W1", [16, 16]), weight("W2", [16, 16], 1), weight("W3", [16, 16], 2)]
    model = make_model(nodes, X_8x16, ["out"], inits)
    assert kept_and_activations(model) == (frozenset({"h"}), HALF_8x16_FP16)


def test_relu_keeps_its_output_not_its_input():
    nodes = [
        helper.make_node("MatMul", ["X", "W"], ["h"], name="mm"),
        helper.make_node("Relu", ["h"], ["r"], name="relu"),
    ]
    model = make_model(nodes, X_8x16, ["r"], [weight("W", [16, 16])])
    assert kept_and_activations(model) == (frozenset({"r"}), HALF_8x16_FP16)


def frozen_chain() -> onnx.ModelProto:
    """X @ W0 -> x, x @ W1 -> y, y @ W2 -> z."""
    nodes = [
        helper.make_node("MatMul", ["X", "W0"], ["x"], name="mm0"),
        helper.make_node("MatMul", ["x", "W1"], ["y"], name="mm1"),
        helper.make_node("MatMul", ["y", "W2"], ["z"], name="mm2"),
    ]
    inits = [weight("W0", [16, 16]), weight("W1", [16, 16], 1), weight("W2", [16, 16], 2)]
    return make_model(nodes, X_8x16, ["z"], inits)


def test_a_frozen_weights_matmul_keeps_nothing_of_an_input_without_gradient():
    model = frozen_chain()
    # all trained: mm1 keeps x for dW1, mm2 keeps y for dW2
    assert kept_and_activations(model) == (frozenset({"x", "y"}), 2 * HALF_8x16_FP16)
    # W0 and W1 frozen: x and y need no gradient, mm1 has no backward at all; mm2 still keeps y for dW2
    problem = autopar.build(model, 2, simple(), frozen=["W0", "W1"])
    assert not problem.requires_grad["x"] and not problem.requires_grad["y"]
    assert kept_and_activations(model, frozen=["W0", "W1"]) == (frozenset({"y"}), HALF_8x16_FP16)
    # W2 frozen: mm2 needs only W2 (for dy), so y is not kept; x still is (dW1)
    assert kept_and_activations(model, frozen=["W2"]) == (frozenset({"x"}), HALF_8x16_FP16)


def test_div_of_a_constant_by_an_activation_keeps_the_denominator_or_the_quotient():
    nodes = [
        helper.make_node("MatMul", ["X", "W"], ["h"], name="mm"),
        helper.make_node("Div", ["C", "h"], ["out"], name="div"),
    ]
    model = make_model(nodes, X_8x16, ["out"], [weight("W", [16, 16]), scalar("C")])
    kept, activations = kept_and_activations(model)
    assert kept & {"h", "out"}
    assert activations == HALF_8x16_FP16


@pytest.mark.parametrize("share", [0.25, 0.75])
def test_a_hinted_memory_walk_ends_at_the_same_plan_in_no_more_runs(share, monkeypatch):
    """The walk's first run at a hinted weight (a like problem's multiplier) is a hull vertex like any
    other: from the settled weight, or ten times off either way, the walk ends at the plan it finds
    unhinted; from the settled weight it ends at the same weight in fewer DP runs."""
    from autopar.search.fold import Solver

    model = block_stack(batch=64, width=8, hidden=32)
    free = autopar.build(model, 4, profile(peak=RC_PEAK))
    without, with_recompute = leanest(free, False), leanest(free, True)
    problem = autopar.build(
        model, 4, profile(capacity=with_recompute + share * (without - with_recompute), peak=RC_PEAK)
    )
    runs = []
    minimise = Solver.solve
    monkeypatch.setattr(Solver, "solve", lambda self, unary: runs.append(1) or minimise(self, unary))
    plain = run_search(problem)
    plain_runs = len(runs)
    assert plain.memory_multiplier > 0  # memory binds: the walk ran
    for scale in (1.0, 10.0, 0.1):
        runs.clear()
        hinted = run_search(problem, SearchOptions(hint=plain.memory_multiplier * scale))
        assert (hinted.choice, hinted.choices) == (plain.choice, plain.choices)
        if scale == 1.0:  # the settled weight: the same weight comes back, in fewer runs
            assert hinted.memory_multiplier == pytest.approx(plain.memory_multiplier, rel=1e-9)
            assert len(runs) < plain_runs


@pytest.mark.parametrize("share", [0.1, 0.25, 0.5, 0.75, 0.9])
def test_a_walk_widening_from_a_hint_ends_where_the_plain_secant_walk_does(share, monkeypatch):
    """While the leanest plan is the only one known to fit, the walk's weight grows at most a factor a run
    (`_WIDEN`, then its powers): every run is still a hull vertex between the ends, so from any hint the walk
    ends at the plan, memory choices and weight the unbounded secant walk (`_WIDEN` infinite) ends at."""
    from autopar.search import driver

    model = block_stack(batch=64, width=8, hidden=32)
    free = autopar.build(model, 4, profile(peak=RC_PEAK))
    without, with_recompute = leanest(free, False), leanest(free, True)
    problem = autopar.build(
        model, 4, profile(capacity=with_recompute + share * (without - with_recompute), peak=RC_PEAK)
    )
    monkeypatch.setattr(driver, "_WIDEN", math.inf)
    plain = run_search(problem)
    assert plain.memory_multiplier > 0  # memory binds: the walk ran
    hinted = {
        scale: run_search(problem, SearchOptions(hint=plain.memory_multiplier * scale))
        for scale in (1e-3, 0.1, 1.0, 10.0)
    }
    monkeypatch.setattr(driver, "_WIDEN", 2.0)
    widened = {scale: run_search(problem, SearchOptions(hint=plain.memory_multiplier * scale)) for scale in hinted}
    for scale, found in hinted.items():
        assert (
            (widened[scale].choice, widened[scale].choices)
            == (found.choice, found.choices)
            == (plain.choice, plain.choices)
        )
        assert widened[scale].memory_multiplier == pytest.approx(found.memory_multiplier, rel=1e-9)


@pytest.mark.parametrize("share", [0.25, 0.75])
def test_a_refuted_search_gives_a_bound_between_what_it_was_told_and_the_ilp_optimum(share):
    """A search told to beat less than the best plan that fits says no plan does (`NothingFaster`), with a
    bound at least what it was told and no more than the exact optimum (the ILP's); asked again with its
    DP runs kept and a bound it cannot meet, it ends at the plan a fresh search finds."""
    from autopar.search.driver import NothingFaster, SearchCache

    model = block_stack(batch=64, width=8, hidden=32)
    free = autopar.build(model, 4, profile(peak=RC_PEAK))
    without, with_recompute = leanest(free, False), leanest(free, True)
    problem = autopar.build(
        model, 4, profile(capacity=with_recompute + share * (without - with_recompute), peak=RC_PEAK)
    )
    best = run_search(problem)
    seconds = problem.objective(best.choice, best.choices)
    assert best.memory_multiplier > 0  # memory binds: the walk ran
    pytest.importorskip("highspy")
    ilp = run_search(problem, SearchOptions(algorithm="ilp"))
    optimum = problem.objective(ilp.choice, ilp.choices)
    kept = SearchCache()
    proved_more = False
    for told in (optimum * 0.5, optimum * 0.9, optimum * 0.99):
        with pytest.raises(NothingFaster) as refuted:
            run_search(problem, SearchOptions(bound=told), kept)
        assert told <= refuted.value.bound_s <= optimum * (1 + 1e-9)
        proved_more |= refuted.value.bound_s > told * (1 + 1e-9)
    assert proved_more  # the runs made prove more than some bound asked for
    again = run_search(problem, SearchOptions(bound=seconds * 1.01), kept)
    assert (again.choice, again.choices) == (best.choice, best.choices)


# --- one process: the gradients are made in the backward -------------------------------------------------------


def test_one_device_peak_by_hand():
    """Z = (X @ W1) @ W2, X 16x8, W1 8x16, W2 16x4, mixed precision (12 B an element of a weight, 2 of them its
    FP16 gradient). Held all step: X 256 B, W1 and W2 without their gradients (128 x 10 + 64 x 10); Y (512 B,
    kept for W2's gradient) is freed once mm2's backward is done. While mm2's backward runs: Y and W2's
    gradient (128); while mm1's: both gradients (256 + 128). On two devices every gradient is held all step
    (DDP's buckets), as every activation until its backward: the sum."""
    model = two_matmul_chain(**CHAIN)
    one = autopar.plan(model, devices=1, cost_model=simple())
    always = 256 + 128 * 10 + 64 * 10
    assert one.memory_per_device == always + max(512 + 128, 256 + 128) == 2816
    breakdown = one.to_dict()["totals"]["memory_breakdown"]
    assert breakdown == {"parameter_state": 128 * 12 + 64 * 12, "activations": 512, "inputs": 256}
    assert sum(breakdown.values()) - one.memory_per_device == 256  # what is never held at once
    assert "256 B of it never at once: one process makes its gradients in the backward" in one.summary()
    two = autopar.plan(model, devices=2, cost_model=simple(), fixed={"mm1": [[2, 1], [1, 1]], "mm2": [[2, 1], [1, 1]]})
    assert two.memory_per_device == sum(two.to_dict()["totals"]["memory_breakdown"].values())
    assert "never at once" not in two.summary()


def test_one_device_accumulating_micro_batches_holds_its_gradients_all_step():
    """Over two micro-batches the gradients accumulate from the first backward to the update: held all step."""
    model = two_matmul_chain(**CHAIN)
    plan = autopar.plan(model, devices=1, cost_model=simple(), micro_batches=2)
    assert plan.memory_per_device == sum(plan.to_dict()["totals"]["memory_breakdown"].values())


def test_one_device_peak_lies_between_the_larger_sum_and_the_total_and_the_floor_below_it():
    """On random models: the peak is no less than what is held all step plus the larger of all the activations
    and all the gradients, and no more than the total; the memory floor is no more than the peak."""
    from autopar.cost import CostModel
    from autopar.graph import load_model
    from autopar.search.costing import build_problem

    for seed in range(20):
        problem = build_problem(load_model(random_model(seed)), CostModel(simple()), 1)
        choice = [0] * problem.size
        for recompute in (False, True):
            choices = MemoryChoices(recompute=recompute)
            held, activations, gradients = problem._held(choice, choices)
            always = held.sum() - activations.sum() - gradients.sum()
            peak = problem.memory(choice, choices)
            assert always + max(activations.sum(), gradients.sum()) - 1e-6 <= peak <= held.sum() + 1e-6
            assert problem.memory_floor(recompute) <= peak + 1e-6
