"""The operator registry: one `OpDef` per (domain, op type, opset range), with every fact about the operator."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from onnx import TensorProto, helper

from autopar.graph import load_model
from autopar.ops import definition_for, registered_op_types, spec_for
from autopar.ops.base import OpSpec
from autopar.ops.registry import _REGISTRY, Keeps, OpDef, lookup, register
from autopar.spmd.values import index_bound
from tests.conftest import make_model, weight

TEST_OP = "AutoparTestOp"


def _opset_checked(op_type: str) -> int:
    """Opset 17, or the operator's first opset when ONNX added it later (GroupNormalization-21, RMSNormalization-23)."""
    return max(17, min(d.since for d in _REGISTRY[("", op_type)]))


def test_every_registered_op_type_has_a_rule_at_opset_17_or_its_first():
    types = registered_op_types()
    assert len(types) > 20
    missing = [
        t
        for t in types
        if not isinstance(lookup(t, "", _opset_checked(t)), OpDef) or lookup(t, "", _opset_checked(t)).rule is None
    ]
    assert missing == []
    assert _opset_checked("RMSNormalization") == 23 and lookup("RMSNormalization", "", 22) is None
    assert lookup("NoSuchOperator", "", 17) is None


def test_ai_onnx_is_the_default_domain():
    assert lookup("MatMul", "ai.onnx", 17) is lookup("MatMul", "", 17)


def _softmax_graph(opset: int):
    nodes = [helper.make_node("Softmax", ["X"], ["Y"], name="sm", axis=1)]
    return load_model(make_model(nodes, [("X", TensorProto.FLOAT, [2, 3, 4])], ["Y"], opset=opset))


def test_softmax_registrations_split_at_opset_13():
    old, new = lookup("Softmax", "", 11), lookup("Softmax", "", 13)
    assert old is not None and new is not None
    assert old is not new
    assert old.until == 12 and new.since == 13 and new.until is None
    assert lookup("Softmax", "", 12) is old and lookup("Softmax", "", 17) is new
    assert old.rule is not new.rule


def test_old_softmax_keeps_every_axis_from_axis_on_whole():
    old_graph, new_graph = _softmax_graph(11), _softmax_graph(13)
    assert definition_for(old_graph.op("sm"), old_graph) is lookup("Softmax", "", 11)
    old = spec_for(old_graph.op("sm"), old_graph)
    new = spec_for(new_graph.op("sm"), new_graph)
    assert old.inputs == (("d0", None, None),)  # axes 1 and 2 are flattened together and normalised
    assert new.inputs == (("d0", None, "d2"),)  # only axis 1 is normalised
    assert old.outputs == old.inputs and new.outputs == new.inputs


def _test_rule(op, graph) -> OpSpec:  # pragma: no cover - never called
    raise AssertionError("the throwaway rule must not run")


def test_overlapping_opset_ranges_are_refused():
    assert ("", TEST_OP) not in _REGISTRY
    try:
        register(TEST_OP, since=5, until=10)(_test_rule)
        with pytest.raises(ValueError, match=TEST_OP):
            register(TEST_OP, since=10)(_test_rule)  # opset 10 is covered twice
        with pytest.raises(ValueError, match="overlapping"):
            register(TEST_OP, since=1, until=5)(_test_rule)
        with pytest.raises(ValueError):
            register(TEST_OP, since=7, until=8)(_test_rule)  # inside the first range
        register(TEST_OP, since=11)(_test_rule)  # adjacent ranges are fine
        assert lookup(TEST_OP, "", 10).until == 10
        assert lookup(TEST_OP, "", 11).since == 11
        assert lookup(TEST_OP, "", 4) is None
        assert len(_REGISTRY[("", TEST_OP)]) == 2  # the refused registrations left nothing behind
    finally:
        _REGISTRY.pop(("", TEST_OP), None)
    assert TEST_OP not in registered_op_types()


def _int_input_model(nodes, inputs, outputs, inits=()):
    return load_model(make_model(nodes, inputs, outputs, inits))


def test_onehot_indices_are_bounded_by_depth():
    depth = helper.make_tensor("depth", TensorProto.INT64, [], [10])
    values = helper.make_tensor("values", TensorProto.FLOAT, [2], [0.0, 1.0])
    nodes = [helper.make_node("OneHot", ["L", "depth", "values"], ["Y"], name="oh", axis=-1)]
    graph = _int_input_model(nodes, [("L", TensorProto.INT64, [8])], ["Y"], [depth, values])
    assert index_bound(graph, "L") == 10


@pytest.mark.parametrize("axis, bound", [(0, 7), (1, 5)])
def test_gather_indices_are_bounded_by_the_gathered_axis(axis, bound):
    nodes = [helper.make_node("Gather", ["E", "I"], ["Y"], name="g", axis=axis)]
    graph = _int_input_model(nodes, [("I", TensorProto.INT64, [3])], ["Y"], [weight("E", [7, 5])])
    assert index_bound(graph, "I") == bound


def test_class_labels_are_bounded_by_the_class_count():
    nodes = [helper.make_node("SoftmaxCrossEntropyLoss", ["S", "L"], ["loss"], name="ce")]
    graph = _int_input_model(nodes, [("S", TensorProto.FLOAT, [8, 6]), ("L", TensorProto.INT64, [8])], ["loss"])
    assert index_bound(graph, "L") == 6


def test_index_bound_is_the_smallest_over_consumers():
    depth = helper.make_tensor("depth", TensorProto.INT64, [], [10])
    values = helper.make_tensor("values", TensorProto.FLOAT, [2], [0.0, 1.0])
    nodes = [
        helper.make_node("OneHot", ["L", "depth", "values"], ["Y"], name="oh", axis=-1),
        helper.make_node("Gather", ["E", "L"], ["Z"], name="g", axis=0),
    ]
    graph = _int_input_model(nodes, [("L", TensorProto.INT64, [8])], ["Y", "Z"], [depth, values, weight("E", [7, 5])])
    assert index_bound(graph, "L") == 7


def test_declared_non_differentiable_ops():
    for op_type in ("NonZero", "Shape"):
        definition = lookup(op_type, "", 17)
        assert definition is not None and definition.rule is None, op_type
        assert definition.differentiable is False, op_type
    for op_type in ("ArgMax", "ArgMin"):  # a rule of their own, and still no gradient
        definition = lookup(op_type, "", 17)
        assert definition is not None and definition.rule is not None and definition.differentiable is False
    assert lookup("OneHot", "", 17).differentiable is False
    assert lookup("Relu", "", 17).differentiable is True
    assert lookup("MatMul", "", 17).differentiable is True
    assert lookup("RandomNormal", "", 17).foldable is False
    assert "NonZero" not in registered_op_types()  # declared, not ruled
    assert lookup("Range", "", 17).differentiable is False
    assert lookup("GroupNormalization", "", 18) is None  # onnx's checker refuses opsets 18-20 as deprecated


@pytest.mark.parametrize(
    "op_type, keeps",
    [
        ("MatMul", Keeps.OPERANDS),
        ("Mul", Keeps.OPERANDS),
        ("Div", Keeps.OPERANDS | Keeps.DIVISOR),
        ("Gelu", Keeps.INPUTS),
        ("LayerNormalization", Keeps.INPUTS | Keeps.STATISTICS),
        ("Where", Keeps.SELECTORS),
        ("Softmax", Keeps.OUTPUTS),
        ("Relu", Keeps.OUTPUTS),
        ("Add", Keeps.NOTHING),
        ("Reshape", Keeps.NOTHING),
        ("Einsum", Keeps.OPERANDS),
        ("ReduceL2", Keeps.INPUTS | Keeps.OUTPUTS),
        ("ReduceSumSquare", Keeps.INPUTS),
        ("CumSum", Keeps.NOTHING),
        ("GatherND", Keeps.SELECTORS),
        ("ScatterND", Keeps.SELECTORS),
        ("RMSNormalization", Keeps.INPUTS | Keeps.STATISTICS),
        ("GroupNormalization", Keeps.INPUTS | Keeps.STATISTICS),
        ("Attention", Keeps.INPUTS | Keeps.OUTPUTS),
        ("RotaryEmbedding", Keeps.INPUTS),
    ],
)
def test_what_the_backward_keeps(op_type, keeps):
    assert lookup(op_type, "", _opset_checked(op_type)).keeps == keeps


def _readme_operator_table() -> set[str]:
    """The operator names in the first column of README's "what may split" table."""
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    start = text.index("| operators | what may split |")
    rows = text[start : text.index("\n\n", start)].splitlines()[2:]
    return {name for row in rows for name in re.findall(r"\b[A-Z][A-Za-z]+[0-9]*\b", row.split("|")[1])}


def test_the_readme_operator_table_names_every_operator_with_a_rule():
    named = _readme_operator_table()
    assert sorted(set(registered_op_types()) - named) == []  # a new operator needs its row (or its name in one)
    assert sorted(named - set(registered_op_types())) == []  # and the table names no operator autopar lacks


def test_every_operator_with_a_rule_has_a_case_in_its_module():
    from autopar.ops import FAMILIES
    from autopar.ops.cases import KERNEL, STRATEGIES, all_cases

    cased = {case.op_type for check in (KERNEL, STRATEGIES) for case in all_cases(FAMILIES, check).values()}
    assert sorted(set(registered_op_types()) - cased) == []
