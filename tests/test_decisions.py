"""What the search decided, read off the plan file: degrees, decisions, axis kinds (`autopar.lowering.decisions`)."""

from __future__ import annotations

import pytest

import autopar
from autopar.lowering.decisions import Degrees, decisions, degrees
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
