"""What the search decided, read off the plan file: degrees, decisions, axis kinds (`autopar.lowering.decisions`)."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import autopar
from autopar.lowering.decisions import Degrees, decisions, degrees, expert_bits
from models.transformer import build_transformer


def gpt(hidden: int, batch: int):
    return build_transformer(kind="gpt", layers=2, hidden=hidden, heads=hidden // 64, seq=512, vocab=8192, batch=batch)


@pytest.fixture(scope="module")
def resnet_plan_8():
    return autopar.plan("models/resnet50.onnx", devices=8)


def test_resnet50_is_data_parallel_but_for_fc_and_the_loss_max(resnet_plan_8):
    assert resnet_plan_8.degrees == Degrees(data=8, tensor=1) == degrees(resnet_plan_8.file)
    fc, reduce_max = resnet_plan_8.decisions()
    assert fc == {
        "name": "fc",
        "op_type": "Gemm",
        "strategy": ((4, 1), (2, 1), (2,)),
        "splits": {"batch": 4, "channels/hidden": 2},
        "devices": 8,
        "block": None,
        "fixed": False,
    }
    assert (reduce_max["name"], reduce_max["splits"]) == ("loss.reduce_max", {"batch": 4, "contraction": 2})
    assert resnet_plan_8.decisions() == decisions(resnet_plan_8.file)  # plain data, the same each call


def test_a_batch_of_one_is_all_tensor_parallel():
    plan = autopar.plan(gpt(8192, batch=1), devices=8)
    assert plan.degrees == Degrees(data=1, tensor=8)
    # (a Reshape flattening batch and sequence calls its split of the flattened rows "batch")
    batch = [d for d in plan.decisions() if d["op_type"] != "Reshape" and d["splits"].get("batch", 1) > 1]
    assert batch == []


def test_data_parallel_mode_decides_nothing():
    plan = autopar.plan(gpt(256, batch=8), devices=8, mode="data_parallel")
    assert plan.degrees == Degrees(data=8) and plan.decisions() == []


def test_degrees_multiply_to_the_devices():
    plan = autopar.plan(gpt(4096, batch=8), devices=8)
    d = plan.degrees
    assert d.data * d.tensor * d.sequence * d.replicated == 8 and d.tensor > 1
    assert str(d) == f"data {d.data} x tensor {d.tensor}" + (f" x sequence {d.sequence}" if d.sequence > 1 else "")


def test_devices_that_repeat_work_are_replicated():
    plan = autopar.plan("models/resnet50.onnx", devices=512)  # a batch of 256: every pair repeats
    assert plan.degrees.replicated == 2 and str(plan.degrees).endswith("(x 2 replicated)")


def test_an_expert_split_is_named_expert_not_data():
    """The expert MatMuls' leading axis is their batch, but it is read from a stack of expert weights."""
    from models.moe import build_moe

    model = build_moe(layers=1)
    experts = ("experts.up", "experts.gate", "experts.down")
    plan = autopar.plan(model, devices=8, fixed={f"layers.0.mlp.{n}": ((8, 1, 1), (8, 1, 1)) for n in experts})
    assert plan.degrees.expert == 8 and str(plan.degrees).endswith(", expert 8")
    d = plan.degrees
    assert d.data * d.tensor * d.sequence * d.replicated == 8  # the experts reuse devices another role counts
    split = {entry["name"]: entry["splits"] for entry in plan.decisions()}
    for name in experts:
        assert split[f"layers.0.mlp.{name}"] == {"expert": 8}
    assert split["layers.0.mlp.experts.swiglu"] == {"expert": 8}  # the experts' activations follow the split
    bits = expert_bits(plan.file)
    assert not any(name.startswith("layers.0.self_attn") for name in bits)  # attention's batch stays data
    assert "layers.0.mlp.router" not in bits or bits["layers.0.mlp.router"] <= bits["layers.0.mlp.experts.up"]


def test_a_stack_of_weights_every_row_reads_is_not_experts():
    """``x[8, 1, 5, 6] @ w[4, 6, 7]``: the rows broadcast against the stack, so each matrix reads them all (a
    split of the stack is the output's second axis, as heads are), where experts each take rows of their own."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 1, 5, 6])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [8, 4, 5, 7])
    w = numpy_helper.from_array(np.ones((4, 6, 7), dtype=np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "stack", [x], [y], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    plan = autopar.plan(model, devices=4, fixed={"mm": ((1, 1, 1, 1), (4, 1, 1))})
    assert expert_bits(plan.file) == {} and plan.degrees.expert == 1
    assert [entry["splits"] for entry in plan.decisions()] == [{"heads": 4}]


def test_batched_products_of_activations_and_convolutions_split_no_experts(resnet_plan_8):
    plan = autopar.plan(gpt(256, batch=8), devices=8)  # attention's MatMuls: [batch, heads, seq, seq]
    assert expert_bits(plan.file) == {} and plan.degrees.expert == 1
    assert expert_bits(resnet_plan_8.file) == {}  # a Conv weight's leading axis is output channels
    assert "expert" not in str(resnet_plan_8.degrees)
