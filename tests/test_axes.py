"""The plan's mesh bits grouped into named logical axes (`autopar.lowering.axes`)."""

from __future__ import annotations

import autopar
from autopar.lowering.axes import LogicalAxis, logical_axes
from models.transformer import build_transformer


def _product(axes: tuple[LogicalAxis, ...]) -> int:
    size = 1
    for axis in axes:
        size *= axis.size
    return size


def test_a_data_by_tensor_plan_has_two_axes_that_agree_with_its_degrees():
    model = build_transformer(kind="gpt", layers=1, hidden=1024, heads=16, seq=256, vocab=4096, batch=8)
    plan = autopar.plan(model, devices=8)
    axes = logical_axes(plan.file)
    assert axes == (LogicalAxis("data", (2, 1)), LogicalAxis("tensor", (0,)))
    assert {axis.name: axis.size for axis in axes} == {"data": plan.degrees.data, "tensor": plan.degrees.tensor}
    assert _product(axes) == 8


def test_bits_no_operator_uses_are_the_replicated_axis():
    plan = autopar.plan("models/resnet50.onnx", devices=512, mode="data_parallel")  # a batch of 256: pairs repeat
    axes = logical_axes(plan.file)
    assert [axis.name for axis in axes] == ["replicated", "data"]
    assert axes[0].size == plan.degrees.replicated == 2 and _product(axes) == 512
    assert sorted(bit for axis in axes for bit in axis.bits) == list(range(9))


def test_coordinates_spell_each_rank_and_keep_the_device_order():
    axes = (LogicalAxis("data", (5, 3, 1)), LogicalAxis("tensor", (4, 2, 0)))  # interleaved bits
    seen = set()
    for rank in range(64):
        at = tuple(axis.coordinate(rank) for axis in axes)
        seen.add(at)
        rebuilt = sum(
            ((at[i] >> (len(axis.bits) - 1 - j)) & 1) << bit
            for i, axis in enumerate(axes)
            for j, bit in enumerate(axis.bits)
        )
        assert rebuilt == rank
    assert len(seen) == 64
    assert axes[0].coordinate(0b100000) == 4 and axes[1].coordinate(0b000001) == 1


def test_one_device_has_no_axis():
    plan = autopar.plan("models/resnet50.onnx", devices=1)
    assert logical_axes(plan.file) == ()
