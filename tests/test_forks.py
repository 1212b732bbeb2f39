"""Forks (`autopar.graph.forks`, `autopar.ops.fork`): readers that split one tensor alike meet once.

The hand-worked model: Y = X @ W0 is read by two column-split MatMuls (A = Y @ W1, B = Y @ W2) and
Z = A + B. Each reader's gradient of Y comes out whole in shape and partial over the bit it splits
columns by; summed at the fork, one AllReduce takes it to mm0 where two ran before.
"""

from __future__ import annotations

import pytest
from onnx import TensorProto, helper

import autopar
from autopar.cost import HardwareProfile
from autopar.graph import load_model
from autopar.graph.build import build_graph
from autopar.search.pipeline import cut_points
from models.transformer import build_transformer
from tests.conftest import make_model, simple_profile_dict, weight

SHARED = {"mm0": ((1, 1), (1, 1)), "mm1": ((1, 1), (1, 2)), "mm2": ((1, 1), (1, 2)), "sum": ((1, 2), (1, 2))}


def fan_out(readers: tuple[str, ...] = ("mm1", "mm2"), producer: str = "MatMul") -> object:
    """X [4, 8] -> mm0 -> Y [4, 16], read by the MatMuls ``readers`` (each Y @ W [16, 4]), summed into Z."""
    if producer == "MatMul":
        nodes = [helper.make_node("MatMul", ["X", "W0"], ["Y"], name="mm0")]
    else:
        nodes = [helper.make_node(producer, ["X0"], ["Y"], name="mm0")]
    outs = []
    for index, name in enumerate(readers):
        nodes.append(helper.make_node("MatMul", ["Y", f"W{index + 1}"], [f"{name}_out"], name=name))
        outs.append(f"{name}_out")
    nodes.append(helper.make_node("Sum", outs, ["Z"], name="sum"))
    weights = [weight(f"W{index + 1}", [16, 4], index + 2) for index in range(len(readers))]
    if producer == "MatMul":
        return make_model(nodes, [("X", TensorProto.FLOAT, [4, 8])], ["Z"], [weight("W0", [8, 16], 1), *weights])
    return make_model(nodes, [("X0", TensorProto.FLOAT, [4, 16])], ["Z"], weights)


@pytest.fixture
def profile():
    return HardwareProfile.model_validate(simple_profile_dict())


def test_the_importer_forks_a_tensor_two_readers_split_alike():
    graph = load_model(fan_out())
    fork = graph.op("mm0.fork")
    assert (fork.op_type, fork.domain, fork.inputs) == ("Fork", "autopar", ("Y",))
    assert graph.op("mm1").inputs[0] == graph.op("mm2").inputs[0] == "Y.forked"
    assert [op.name for op in graph.ops][:2] == ["mm0", "mm0.fork"]  # just before its first reader


@pytest.mark.parametrize(
    "model",
    [
        fan_out(readers=("mm1",)),  # one reader: nothing to meet
        fan_out(producer="Sigmoid"),  # the producer keeps its output for its backward: the tensor would count twice
    ],
)
def test_no_fork_where_the_rule_says_none(model):
    assert not [op for op in load_model(model).ops if op.domain == "autopar"]


def test_a_fork_changes_no_fingerprint():
    model = fan_out()
    assert load_model(model).fingerprint == build_graph(load_model(model).model, "tiny").fingerprint


def test_readers_whose_gradients_meet_at_the_fork_pay_one_all_reduce(profile):
    # Y's gradient (4x16 FP16 = 128 B), partial over bit 0 from each reader: unfused AllReduce once, not twice
    all_reduce = 2 * (1e-6 + 128 / 2 / 1e9)
    model = fan_out()
    apart = autopar.evaluate(model, 2, {**SHARED, "mm0.fork": ((1, 1), (1,))}, cost_model=profile, overlap=False)
    met = autopar.evaluate(model, 2, {**SHARED, "mm0.fork": ((1, 1), (2,))}, cost_model=profile, overlap=False)
    assert apart - met == pytest.approx(all_reduce, rel=1e-9)
    # a fork left out takes its cheapest candidate beside the operators given, as a search with them fixed does
    left_out = autopar.evaluate(model, 2, SHARED, cost_model=profile, overlap=False)
    assert left_out == pytest.approx(met, rel=1e-12)
    plan = autopar.plan(model, devices=2, cost_model=profile, mode="semi_auto_parallel", fixed=SHARED, overlap=False)
    assert plan.strategies["mm0.fork"] == ((1, 1), (2,))
    assert plan.objective == pytest.approx(met, rel=1e-12)
    paths = [(g["consumer"], [s["collective"] for s in g["steps"]]) for g in plan.to_dict()["gradients"]]
    assert paths == [("mm0.fork", ["AllReduce"])]


@pytest.mark.parametrize(
    "strategies",
    [
        {**SHARED, "mm0.fork": ((1, 1), (2,))},
        # mm2 computes its gradient whole: at the fork one rank of each pair keeps it, the other adds zero
        {**SHARED, "mm2": ((1, 1), (1, 1)), "sum": ((1, 1), (1, 1)), "mm0.fork": ((1, 1), (2,))},
        {**SHARED, "mm0": ((2, 1), (1, 1)), "mm0.fork": ((1, 1), (2,))},
    ],
)
def test_plans_with_forks_train_correctly(strategies):
    pytest.importorskip("torch")
    report = autopar.verify(fan_out(), strategies, devices=2, gradients=True)
    assert report.ok, report.problems
    assert report.collectives["executed"] == report.collectives["planned"]


def test_no_stage_starts_between_a_fork_and_its_readers():
    model = build_transformer(kind="gpt", layers=2, hidden=64, heads=4, seq=16, vocab=64, batch=4)
    problem = autopar.build(model, 8)
    index = {rule.op.name: node for node, rule in enumerate(problem.rules)}
    points = set(cut_points(problem))
    for layer in range(2):
        fork, last = index[f"layer{layer}.ln1.fork"], index[f"layer{layer}.attn.v"]
        assert not points & set(range(fork + 1, last + 1))


def test_exports_leave_forks_out():
    model = fan_out()
    plan = autopar.plan(model, devices=2, mode="semi_auto_parallel", fixed=SHARED)
    file = plan.file.without_forks()
    assert [op.name for op in file.ops] == ["mm0", "mm1", "mm2", "sum"]
    assert file.ops[1].inputs[0].tensor == "Y"
    assert not [r for r in file.redistributions if "fork" in r.producer + r.consumer]
