"""Strategy rules per operator family: which axes split, and which splits leave partial outputs."""

from __future__ import annotations

import pytest
from onnx import TensorProto, helper

from autopar.layout import Layout
from autopar.ops import registered_op_types
from autopar.ops.shape import reshape_labels
from tests.conftest import conv_model, make_model, rule_for, weight

ISSUE_OPS = [
    "Conv",
    "BatchNormalization",
    "Relu",
    "MaxPool",
    "AveragePool",
    "GlobalAveragePool",
    "Add",
    "Sum",
    "Flatten",
    "Reshape",
    "Gemm",
    "MatMul",
    "ReduceMax",
    "ReduceSum",
    "ReduceMean",
    "Sub",
    "Exp",
    "Div",
    "Log",
    "OneHot",
    "Mul",
    "Neg",
    "Identity",
    "Cast",
]


def test_every_required_op_has_a_rule():
    assert set(ISSUE_OPS) <= set(registered_op_types())


def test_conv_splits_batch_out_and_in_channels():
    rule = rule_for(conv_model(), "conv")
    assert rule.spec.label_order == ("n", "c", "o")
    strategy = ((2, 2, 1, 1), (2, 2, 1, 1), (2,))
    exponents = rule.parse(strategy)
    assert rule.in_strategy(exponents) == strategy
    inputs, outputs = rule.input_layouts(exponents), rule.output_layouts(exponents)
    # device matrix [n, c, o]: o takes bit 0, c bit 1, n bit 2
    assert inputs[0] == Layout(((2,), (1,), (), ()))
    assert inputs[1] == Layout(((0,), (1,), (), ()))
    assert outputs[0] == Layout(((2,), (0,), (), ()), partial=(1,))  # the input-channel split leaves partial sums
    assert rule.spec.local_once_inputs == (2,)  # the bias is added once per partial group
    with pytest.raises(Exception, match="cannot be split"):
        rule.parse(((1, 1, 2, 1), (1, 1, 1, 1), (1,)))  # spatial splits need halos


def test_grouped_conv_splits_only_batch():
    rule = rule_for(conv_model(group=8), "conv")
    assert rule.spec.label_order == ("n",)


def test_gemm_splits_i_k_j_and_transposes():
    nodes = [helper.make_node("Gemm", ["A", "B", "C"], ["Y"], name="gemm", transB=1)]
    model = make_model(nodes, [("A", TensorProto.FLOAT, [8, 16])], ["Y"], [weight("B", [4, 16]), weight("C", [4])])
    rule = rule_for(model, "gemm")
    assert rule.spec.label_order == ("i", "k", "j")
    exponents = rule.parse(((2, 4), (1, 4), (1,)))
    assert rule.output_layouts(exponents)[0] == Layout(((2,), ()), partial=(1, 0))
    assert rule.input_layouts(exponents)[1] == Layout(((), (1, 0)))  # B is [j, k] under transB


def test_matmul_batch_dims_and_contraction():
    nodes = [helper.make_node("MatMul", ["A", "B"], ["Y"], name="mm")]
    model = make_model(nodes, [("A", TensorProto.FLOAT, [4, 8, 16]), ("B", TensorProto.FLOAT, [16, 8])], ["Y"])
    rule = rule_for(model, "mm")
    assert rule.spec.label_order == ("b0", "i", "k", "j")
    assert ((2, 2, 2), (2, 1)) in [rule.in_strategy(e) for e in rule.candidates]


@pytest.mark.parametrize("op_type, partial_op", [("ReduceMax", "max"), ("ReduceMean", "sum")])
def test_reductions_leave_partial_results_of_the_right_kind(op_type, partial_op):
    nodes = [helper.make_node(op_type, ["X"], ["Y"], name="red", axes=[1], keepdims=1)]
    model = make_model(nodes, [("X", TensorProto.FLOAT, [8, 16])], ["Y"])
    rule = rule_for(model, "red")
    exponents = rule.parse(((2, 4),))
    out = rule.output_layouts(exponents)[0]
    assert out.partial and out.partial_op == partial_op
    assert out.dims == ((2,), ())


def test_reduce_sum_axes_as_input():
    axes = helper.make_tensor("axes", TensorProto.INT64, [1], [0])
    nodes = [helper.make_node("ReduceSum", ["X", "axes"], ["Y"], name="red", keepdims=0)]
    model = make_model(nodes, [("X", TensorProto.FLOAT, [8, 16])], ["Y"], [axes])
    rule = rule_for(model, "red")
    exponents = rule.parse(((4, 2), (1,)))
    assert rule.output_layouts(exponents)[0] == Layout(((0,),), partial=(2, 1))


def test_onehot_strategy_names_the_output_like_mindspore():
    depth = helper.make_tensor("depth", TensorProto.INT64, [], [10])
    values = helper.make_tensor("values", TensorProto.FLOAT, [2], [0.0, 1.0])
    nodes = [helper.make_node("OneHot", ["L", "depth", "values"], ["Y"], name="oh", axis=-1)]
    model = make_model(nodes, [("L", TensorProto.INT64, [8])], ["Y"], [depth, values])
    rule = rule_for(model, "oh")
    assert rule.in_strategy(rule.data_parallel) == ((8, 1), (), (1,))
    exponents = rule.parse(((4, 2), (), (1,)))
    assert rule.output_layouts(exponents)[0] == Layout(((2, 1), (0,)))
    assert rule.input_layouts(exponents)[0] == Layout(((2, 1),))


def test_broadcast_dims_are_never_split():
    nodes = [helper.make_node("Sub", ["X", "M"], ["Y"], name="sub")]
    model = make_model(nodes, [("X", TensorProto.FLOAT, [8, 16]), ("M", TensorProto.FLOAT, [8, 1])], ["Y"])
    rule = rule_for(model, "sub")
    assert rule.spec.inputs[1] == ("d0", None)
    exponents = rule.parse(((2, 4), (2, 1)))
    assert rule.input_layouts(exponents)[1] == Layout(((2,), ()))


@pytest.mark.parametrize(
    "src, dst, expected",
    [
        ((256, 2048, 1, 1), (256, 2048), (("r0", "r1", None, None), ("r0", "r1"))),
        ((4, 6), (24,), (("r0", None), ("r0",))),
        ((24,), (4, 6), (("r0",), ("r0", None))),
        ((6, 4), (4, 6), (("r0", None), ("r0", None))),
    ],
)
def test_reshape_keeps_splits_that_stay_contiguous(src, dst, expected):
    assert reshape_labels(src, dst) == expected


def test_candidates_respect_devices_divisibility_and_start_with_data_parallel():
    rule = rule_for(conv_model(), "conv", devices=8)
    # n (8: up to 2^3), c (8), o (16): all exponent vectors with sum <= 3 -> C(6, 3) = 20
    assert len(rule.candidates) == 20
    assert rule.candidates[0] == rule.data_parallel == (3, 0, 0)
    assert len(set(rule.candidates)) == len(rule.candidates)


def test_max_pool_with_its_indices_is_never_split():
    """Its Indices count positions over the whole input (samples and channels before): a shard would count its own."""
    x = [("X", TensorProto.FLOAT, [4, 8, 6, 6])]
    plain = make_model([helper.make_node("MaxPool", ["X"], ["Y"], name="p", kernel_shape=[2, 2])], x, ["Y"])
    assert len(rule_for(plain, "p").candidates) > 1
    both = [helper.make_node("MaxPool", ["X"], ["Y", "I"], name="p", kernel_shape=[2, 2])]
    rule = rule_for(make_model(both, x, ["Y", "I"]), "p")
    assert rule.candidates == [(0,) * len(rule.spec.label_order)] and not any(rule.spec.label_order)


def test_unknown_operator_falls_back_to_replicated():
    nodes = [helper.make_node("Det", ["X"], ["Y"], name="odd")]
    model = make_model(nodes, [("X", TensorProto.FLOAT, [4, 8, 8])], ["Y"])
    rule = rule_for(model, "odd")
    assert rule.spec.fallback and rule.candidates == [()]
    assert rule.input_layouts(())[0] == Layout(((), (), ()))


def test_a_clip_export_pools_its_text_by_arg_max_split_by_batch():
    """CLIP's text tower pools each sequence at its end token, found by ArgMax over the sequence: with its rule
    (every axis but the one it selects along) no operator of the export is kept replicated for want of one,
    the data-parallel plan splits the ArgMax by batch, and that plan verifies forward and backward."""
    from pathlib import Path

    import autopar

    path = Path(__file__).resolve().parent / "data" / "hf_clip_dynamo.onnx"
    for devices in (8, 64):
        assert autopar.plan(path, devices=devices).fallback_ops == []
    plan = autopar.plan(path, devices=4, mode="data_parallel")
    (pooling,) = [rule.op.name for rule in plan.problem.rules if rule.op.op_type == "ArgMax"]
    assert plan.strategies[pooling] == ((4, 1),)
    assert autopar.verify(path, plan, gradients=True).ok


@pytest.mark.parametrize(
    ("opset", "ratio", "training", "draws"),
    [
        (17, 0.1, True, True),
        (17, 0.1, False, False),
        (17, 0.0, True, False),
        (17, None, True, True),
        (11, 0.1, None, False),
    ],
)
def test_a_dropout_draws_a_mask_only_where_it_trains(opset, ratio, training, draws):
    """From opset 12, where its training mode is true and its ratio (0.5 unless given) above 0; before opset 12,
    ONNX's Dropout is inference's. Only then does its backward keep a mask (`Keeps.MASK`)."""
    import numpy as np
    from onnx import numpy_helper

    from autopar.graph import load_model
    from autopar.ops.elementwise import dropout_draws

    constants = []
    if opset >= 12:
        constants = [
            numpy_helper.from_array(np.array(ratio if ratio is not None else 0.5, dtype=np.float32), "ratio"),
            numpy_helper.from_array(np.array(training), "training"),
        ]
        inputs = ["x", "ratio" if ratio is not None else "", "training"]
        node = helper.make_node("Dropout", inputs, ["y"], name="drop")
    else:
        node = helper.make_node("Dropout", ["x"], ["y"], name="drop", ratio=ratio)
    model = make_model([node], [("x", TensorProto.FLOAT, [4, 8])], ["y"], constants, opset=opset)
    graph = load_model(model)
    assert dropout_draws(graph.op("drop"), graph) is draws
