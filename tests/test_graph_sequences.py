"""`autopar.graph.sequences`: pieces of a split sequence read back as the slices they are."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import autopar
from autopar.graph.sequences import slice_sequences


def _split_model(split: list[int] | int, positions: list[int], axis: int = -1) -> onnx.ModelProto:
    """x (4, 12) -> SplitToSequence(split, axis) -> one SequenceAt per position -> each piece times 2."""
    sizes = np.array(split, dtype=np.int64)
    nodes = [
        helper.make_node("Constant", [], ["sizes"], value=numpy_helper.from_array(sizes, "sizes")),
        helper.make_node("SplitToSequence", ["x", "sizes"], ["pieces"], axis=axis),
    ]
    outputs = []
    for index, position in enumerate(positions):
        at = numpy_helper.from_array(np.array(position, dtype=np.int64), f"at{index}")
        nodes.append(helper.make_node("Constant", [], [f"at{index}"], value=at))
        nodes.append(helper.make_node("SequenceAt", ["pieces", f"at{index}"], [f"piece{index}"]))
        nodes.append(helper.make_node("Add", [f"piece{index}", f"piece{index}"], [f"y{index}"]))
        outputs.append(helper.make_tensor_value_info(f"y{index}", TensorProto.FLOAT, None))
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 12])
    graph = helper.make_graph(nodes, "split", [x], outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


@pytest.mark.parametrize(
    ("split", "positions"),
    [([3, 5, 4], [0, 1, 2]), ([3, 5, 4], [-1, -3]), (4, [0, 2]), (5, [2])],  # sizes; negative; chunks; a short last
)
def test_each_piece_is_the_slice_it_reads_and_the_split_goes(split, positions):
    """Every SequenceAt becomes a Slice computing the same values (onnx's reference evaluator on both), and
    the SplitToSequence nothing reads any more is dropped."""
    model = _split_model(split, positions)
    x = np.random.default_rng(0).random((4, 12), dtype=np.float32)
    before = ReferenceEvaluator(model).run(None, {"x": x})
    sliced = onnx.ModelProto()
    sliced.CopyFrom(model)
    assert slice_sequences(sliced) == len(positions)
    assert {node.op_type for node in sliced.graph.node} == {"Constant", "Slice", "Add"}
    for want, got in zip(before, ReferenceEvaluator(sliced).run(None, {"x": x})):
        assert np.array_equal(want, got)


def test_a_position_out_of_range_or_computed_is_left_as_it_is():
    """Only a constant position within the pieces is rewritten; a sequence still read keeps its split."""
    model = _split_model([6, 6], [0, 5])
    assert slice_sequences(model) == 1
    assert [node.op_type for node in model.graph.node].count("SplitToSequence") == 1


def test_a_model_splitting_a_projection_into_a_sequence_plans_with_its_pieces_sized():
    """The dynamo exporter's unoptimised ``torch.split`` (latent attention, Mamba2) no longer reads as sizes
    computed from data: the model plans and verifies, forward and backward."""
    w = numpy_helper.from_array(np.random.default_rng(1).random((16, 24), dtype=np.float32), "w")
    sizes = numpy_helper.from_array(np.array([8, 16], dtype=np.int64), "sizes")
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"]),
        helper.make_node("SplitToSequence", ["h", "sizes"], ["pieces"], axis=-1),
        helper.make_node("Constant", [], ["one"], value=numpy_helper.from_array(np.array(1, dtype=np.int64), "one")),
        helper.make_node("SequenceAt", ["pieces", "one"], ["b"]),
        helper.make_node("ReduceSum", ["b"], ["loss"], keepdims=0),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 16])
    loss = helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])
    graph = helper.make_graph(nodes, "projection", [x], [loss], initializer=[w, sizes])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    plan = autopar.plan(model, devices=4)
    assert "SequenceAt" not in {op["op_type"] for op in plan.to_dict()["ops"]}
    assert autopar.verify(model, plan, gradients=True).ok
