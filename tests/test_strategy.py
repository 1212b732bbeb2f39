"""User strategies: every invalid one is refused with a sentence naming the operator."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from autopar.errors import StrategyError
from autopar.graph import load_model
from autopar.search.coefficients import LayoutTable
from autopar.strategy import OpRule
from tests.conftest import conv_model, make_model, rule_for, weight
from tests.test_fold import residual_stack


@pytest.mark.parametrize(
    "strategy, message",
    [
        (((3, 1, 1, 1), (1, 1, 1, 1), (1,)), "must be a power of 2, but got 3"),
        (((4, 2, 1, 1), (2, 2, 1, 1), (2,)), "more than the 8 devices"),
        (((2, 2, 1, 1), (2, 4, 1, 1), (2,)), "disagree"),
        (((2, 1, 1, 1), (1, 1, 1, 1)), "wrong shape"),
        (((2, 1, 1), (1, 1, 1, 1), (1,)), "wrong shape"),
        ("nonsense", "must be a tuple"),
        (((0, 1, 1, 1), (1, 1, 1, 1), (1,)), "must be a power of 2, but got 0"),
    ],
)
def test_invalid_strategies_are_refused(strategy, message):
    rule = rule_for(conv_model(), "conv")
    with pytest.raises(StrategyError, match=message) as info:
        rule.parse(strategy)
    assert "'conv'" in str(info.value)


def test_split_must_divide_the_dimension():
    rule = rule_for(conv_model(), "conv", devices=64)
    with pytest.raises(StrategyError, match="does not divide"):
        rule.parse(((16, 1, 1, 1), (1, 1, 1, 1), (1,)))  # batch is 8


def test_repeated_calculation_is_allowed():
    rule = rule_for(conv_model(), "conv")
    exponents = rule.parse(((2, 1, 1, 1), (1, 1, 1, 1), (1,)))  # 2 of 8 devices' worth of splits: 4x repeated
    assert rule.shards(exponents) == 2
    bits = rule.label_bits(exponents)
    assert bits["n"] == (0,) and bits["o"] == () and bits["c"] == ()


@pytest.mark.parametrize("bias_first", [True, False])
def test_a_broadcast_operator_lays_out_its_output_in_the_output_s_dim_order(bias_first):
    """``Add(bias, x)`` gives the layout ``Add(x, bias)`` gives: a bias written first leaves the
    batch on the highest mesh bits, so the MatMul before it needs no AllToAll (the second builder's
    GPT-3 was 60 % slower than the first's for this alone)."""
    inputs = ["B", "X"] if bias_first else ["X", "B"]
    model = make_model(
        [helper.make_node("Add", inputs, ["Y"], name="add")],
        [("X", TensorProto.FLOAT, [16, 8, 32])],
        ["Y"],
        [weight("B", [32])],
    )
    rule = rule_for(model, "add", devices=64)
    strategy = ((4,), (16, 1, 4)) if bias_first else ((16, 1, 4), (4,))
    exponents = rule.parse(strategy)
    assert rule.output_layouts(exponents)[0].dims == ((5, 4, 3, 2), (), (1, 0))
    assert rule.input_layouts(exponents)[inputs.index("B")].dims == ((1, 0),)


def test_rules_listing_the_same_candidates_share_their_encoded_layouts_and_a_rule_with_new_ones_keeps_the_rest():
    """Every layer's alike operators list the same candidates: their packed layouts are one set of read-only
    arrays (derived once, for every problem planned at those limits), equal to the rows of their `Layout`s.
    A rule given other candidates encodes those, and keeps what does not depend on them."""
    graph = load_model(residual_stack(3))
    first, second = (OpRule.build(graph.op(name), graph, 3) for name in ("n0", "n7"))
    shared, again = first.encoded_layouts(True, 0), second.encoded_layouts(True, 0)
    assert all(a is b and not a.flags.writeable for a, b in zip(shared, again))
    table = LayoutTable.of([first.output_layout(c, 0) for c in range(len(first.candidates))])
    assert np.array_equal(shared[0], table.length) and np.array_equal(shared[1], table.code)
    assert first.candidate_count == len(first.candidates)
    given = first.with_candidates(first.candidates[1:3])
    assert given.candidate_count == first.candidate_count and given.label_sizes is first.label_sizes
    assert [row.tolist() for row in given.encoded_layouts(True, 0)[1]] == shared[1][1:3].tolist()
