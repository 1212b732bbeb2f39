"""The ResNet-50 plan: complete, consistent, no worse than data parallel, deterministic."""

from __future__ import annotations

import json

import pytest

import autopar
import autopar.report
from autopar.cost import CostModel, load_profile
from autopar.layout import Layout
from autopar.redistribute import Step, apply_steps

MODEL = "models/resnet50.onnx"


@pytest.fixture(scope="module")
def graph():
    return autopar.load_model(MODEL)


@pytest.fixture(scope="module")
def plan8(graph):
    return autopar.plan(graph, devices=8)


def test_every_op_has_a_strategy(plan8, graph):
    assert list(plan8.strategies) == [op.name for op in graph.ops]
    assert all(isinstance(s, tuple) and all(isinstance(t, tuple) for t in s) for s in plan8.strategies.values())
    assert plan8.fallback_ops == []


def test_every_layout_mismatch_has_its_redistribution(plan8):
    problem = plan8.problem
    entries = {(r["tensor"], r["producer"], r["consumer"]): r for r in plan8.to_dict()["redistributions"]}
    mismatches = 0
    for use in problem.uses:
        src = problem.source_layout(use, plan8.choice[use.src_node])
        dst = plan8.layouts(use.dst_node)[0][use.dst_slot]
        key = (use.tensor, problem.rules[use.src_node].op.name, problem.rules[use.dst_node].op.name)
        if src == dst:
            assert key not in entries
            continue
        mismatches += 1
        steps = [Step.from_dict(s) for s in entries[key]["steps"]]
        assert apply_steps(src, steps) == dst
    assert mismatches == len([r for r in entries.values() if r["consumer"] != "<graph output>"])


def test_every_replicated_parameter_has_its_gradient_sync(plan8, graph):
    sync = {g["parameter"]: g for g in plan8.gradient_sync()}
    trainable = [p.name for p in graph.parameters if p.trainable]
    assert sorted(sync) == sorted(trainable)
    problem = plan8.problem
    for name, entry in sync.items():
        node, _slot = problem.owner[name]
        rule = problem.rules[node]
        exponents = rule.candidates[plan8.choice[node]]
        op_bits = {b for bits in rule.label_bits(exponents).values() for b in bits}
        layout = Layout.from_dict(entry["layout"])
        expected = op_bits - layout.split_bits
        assert set(entry["bits"]) == expected
        sharded = node in plan8.search.choices.sharded  # the parallel optimizer: each rank its shard
        scattered = sharded and "dim" in entry  # no dimension the shards divide: a flat slice, summed whole
        assert entry["collective"] == (None if not expected else "ReduceScatter" if scattered else "AllReduce")


def test_data_parallel_plan_syncs_every_weight_over_all_devices(graph):
    plan = autopar.plan(graph, devices=8, mode="data_parallel")
    assert all(s[0][0] == 8 for name, s in plan.strategies.items() if name.endswith(("conv1", "conv2", "conv3")))
    syncs = plan.gradient_sync()
    assert all(g["group_size"] == 8 for g in syncs)
    gradient_bytes = sum(g["bytes"] for g in syncs)
    assert gradient_bytes == 25_557_032 * 2  # every trainable FP16 gradient, once
    # the loss leaves the network reduced: each rank's partial batch mean is AllReduced
    loss = [r for r in plan.to_dict()["redistributions"] if r["tensor"] == "loss"]
    assert len(loss) == 1 and loss[0]["consumer"] == "<graph output>"
    assert [s["collective"] for s in loss[0]["steps"]] == ["AllReduce"] and loss[0]["steps"][0]["group_size"] == 8


@pytest.mark.parametrize("devices", [8, 64])
def test_searched_plan_is_no_worse_than_data_parallel(graph, devices):
    plan = autopar.plan(graph, devices=devices)
    dp = autopar.plan(graph, devices=devices, mode="data_parallel")
    assert plan.objective <= dp.objective
    assert plan.objective == pytest.approx(autopar.evaluate(graph, devices, plan.strategies), rel=1e-12)
    assert plan.memory_per_device <= plan.problem.cost.capacity


def test_plan_dict_schema(plan8):
    data = plan8.to_dict()
    assert data["schema"] == "autopar.plan/3"
    assert data["devices"] == 8 and data["cost_model"] == "ascend910" and data["model"] == "resnet50"
    op = data["ops"][0]
    assert {"name", "op_type", "strategy", "inputs", "outputs", "cost"} <= set(op)
    totals = data["totals"]
    parts = totals["compute_s"] + totals["communication_s"] + totals["optimizer_update_s"]
    assert totals["step_time_s"] == pytest.approx(parts) and totals["optimizer_update_s"] > 0
    assert sum(op["cost"].get("update_s", 0.0) for op in data["ops"]) == pytest.approx(totals["optimizer_update_s"])
    assert 0 < totals["ideal_step_time_s"] < totals["step_time_s"]
    assert {"algorithm", "time_s", "candidates"} <= set(data["search"])
    for red in data["redistributions"]:
        for step in red["steps"]:
            assert {"collective", "group_size", "bytes", "seconds"} <= set(step)
    assert json.loads(json.dumps(data)) == data


def test_same_input_same_plan(graph):
    first = autopar.plan(MODEL, devices=8).to_dict()
    second = autopar.plan(MODEL, devices=8).to_dict()
    for data in (first, second):  # only measured seconds may differ
        data["search"].pop("time_s")
        data["search"].pop("phases_s")
    assert json.dumps(first) == json.dumps(second)


def test_jupyter_report_renders(plan8):
    html = plan8._repr_html_()
    assert "autopar plan" in html and "conv1" in html and "<table>" in html


@pytest.mark.parametrize("model, devices", [("gpt", 4), ("gpt", 8), ("resnet50", 8)])
def test_the_search_charges_each_edge_as_the_plan_lists_it(model, devices):
    """The forward redistributions and the gradients' ways back the plan file lists (what the runtime
    executes) cost what the search charged on the edges, for random assignments of a GPT (with its
    forks) and of ResNet-50 (whose edges share layout tables between uses that carry a gradient back
    and uses that do not: each group of edges keeps its own)."""
    import random

    from autopar.lowering import GRAPH_OUTPUT, Plan
    from autopar.search.driver import SearchResult
    from models.transformer import build_transformer

    if model == "gpt":
        model = build_transformer(kind="gpt", layers=2, hidden=64, heads=4, seq=16, vocab=64, batch=8)
    else:
        model = MODEL
    problem = autopar.build(model, devices)
    pick = random.Random(devices)
    for _ in range(8 if model != MODEL else 3):
        choice = tuple(pick.randrange(len(rule.candidates)) for rule in problem.rules)
        nodes = sum(float(problem.node_arrays(i)[0][c]) for i, c in enumerate(choice))
        charged = problem.objective(choice) - nodes
        data = Plan(problem, choice, SearchResult(choice, "given", 0.0), "model", "given", "ascend910", "mixed").file
        listed = sum(r.seconds for r in data.redistributions if r.consumer != GRAPH_OUTPUT)
        listed += sum(path.seconds for path in data.gradients if path.carries is None)
        assert listed == pytest.approx(charged, rel=1e-9, abs=1e-15)
        assert any(path.steps for path in data.gradients)


def test_the_optimizer_update_is_charged_once_a_step_and_a_shard_each_under_the_parallel_optimizer(graph):
    """Data parallel updates every trainable element on every device; the searched plan takes the parallel
    optimizer where that is faster, each of the 8 ranks updating an eighth: the totals say so, operator by
    operator, and the update is in the step as a line of its own (ResNet-50, SGD, Ascend 910)."""
    cost = CostModel(load_profile("ascend910"), "mixed")
    elements = sum(p.numel for p in graph.parameters if p.trainable)
    whole = autopar.plan(graph, devices=8, mode="data_parallel").to_dict()["totals"]
    assert whole["optimizer_update_s"] == pytest.approx(cost.update_time(elements), rel=1e-9)
    plan = autopar.plan(graph, devices=8)
    totals = plan.to_dict()["totals"]
    each = [
        Layout.from_dict(entry["layout"]).local_numel(graph.tensor(entry["parameter"]).shape)
        / (entry.get("optimizer_shards") or 1)
        for entry in plan.gradient_sync()
    ]
    assert any(entry.get("optimizer_shards") == 8 for entry in plan.gradient_sync())
    assert totals["optimizer_update_s"] == pytest.approx(cost.update_time(sum(each)), rel=1e-9)
    assert totals["optimizer_update_s"] < whole["optimizer_update_s"]
    assert totals["step_time_s"] == pytest.approx(
        totals["compute_s"] + totals["communication_s"] + totals["optimizer_update_s"], rel=1e-9
    )
    assert "optimizer update:" in autopar.report.plan_table(plan)
