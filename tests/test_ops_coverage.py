"""Every supported operator, alone in a tiny model, verifies under its candidate strategies.

Each case checks what the rule lets split, then runs candidates on 4 virtual devices against
onnxruntime on one: the op's local execution, partial outputs and their reductions must agree.
"""

from __future__ import annotations

import random

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import autopar
from autopar.errors import FallbackWarning
from autopar.graph import load_model
from autopar.ops import registered_op_types
from autopar.strategy import OpRule
from tests.conftest import make_model, weight

pytest.importorskip("onnxruntime")

F, I64, B = TensorProto.FLOAT, TensorProto.INT64, TensorProto.BOOL

ISSUE_OPS = [
    "MatMul",
    "Gemm",
    "Transpose",
    "Reshape",
    "Flatten",
    "Unsqueeze",
    "Squeeze",
    "Concat",
    "Split",
    "Slice",
    "Gather",
    "GatherElements",
    "LayerNormalization",
    "ReduceMean",
    "Sub",
    "Pow",
    "Sqrt",
    "Div",
    "Add",
    "Softmax",
    "LogSoftmax",
    "Erf",
    "Tanh",
    "Sigmoid",
    "Gelu",
    "Where",
    "Expand",
    "Equal",
    "And",
    "Not",
    "Dropout",
    "Cast",
    "SoftmaxCrossEntropyLoss",
    "NegativeLogLikelihoodLoss",
    "LRN",
    "Clip",
    "Max",
    "Min",
]


def ints(name, values):
    return numpy_helper.from_array(np.asarray(values, dtype=np.int64), name)


def floats(name, values):
    return numpy_helper.from_array(np.asarray(values, dtype=np.float32), name)


def node(op_type, inputs, outputs=("Y",), **attrs):
    return helper.make_node(op_type, list(inputs), list(outputs), name="op", **attrs)


def single(op_type, inputs, shapes, outputs=("Y",), initializers=(), opset=17, **attrs):
    """A model with one operator named "op" reading graph inputs ``shapes`` = [(name, type, shape)]."""
    return make_model([node(op_type, inputs, outputs, **attrs)], shapes, list(outputs), initializers, opset=opset)


CASES = {
    "matmul_broadcast": lambda: single("MatMul", ["A", "Bm"], [("A", F, [2, 1, 4, 8]), ("Bm", F, [4, 8, 4])]),
    "matmul_vector": lambda: single("MatMul", ["A", "v"], [("A", F, [4, 8, 8]), ("v", F, [8])]),
    "gemm_trans": lambda: single(
        "Gemm",
        ["A", "W", "C"],
        [("A", F, [8, 4])],
        transA=1,
        transB=1,
        initializers=[weight("W", [8, 8]), weight("C", [8])],
    ),
    "transpose": lambda: single("Transpose", ["X"], [("X", F, [2, 4, 8, 4])], perm=[0, 2, 1, 3]),
    "concat": lambda: single("Concat", ["X", "Z"], [("X", F, [4, 2, 8]), ("Z", F, [4, 6, 8])], axis=1),
    "split": lambda: single(
        "Split",
        ["X", "sizes"],
        [("X", F, [4, 8, 8])],
        outputs=("Y1", "Y2"),
        axis=2,
        initializers=[ints("sizes", [2, 6])],
    ),
    "slice": lambda: single(
        "Slice",
        ["X", "s", "e", "ax"],
        [("X", F, [4, 8, 8])],
        initializers=[ints("s", [1]), ints("e", [5]), ints("ax", [1])],
    ),
    "slice_whole_axis": lambda: single(
        "Slice",
        ["X", "s", "e", "ax"],
        [("X", F, [4, 8, 8])],
        initializers=[ints("s", [0, 0]), ints("e", [8, 3]), ints("ax", [1, 2])],
    ),
    "pad": lambda: single("Pad", ["X", "p"], [("X", F, [4, 4, 6])], initializers=[ints("p", [0, 0, 1, 0, 0, 2])]),
    "tile": lambda: single("Tile", ["X", "r"], [("X", F, [4, 4])], initializers=[ints("r", [1, 2])]),
    "expand": lambda: single("Expand", ["X", "s"], [("X", F, [4, 1, 8])], initializers=[ints("s", [2, 4, 4, 8])]),
    "gather_embedding": lambda: single(
        "Gather", ["E", "ids"], [("ids", I64, [4, 8])], initializers=[weight("E", [16, 8])]
    ),
    "gather_token": lambda: single("Gather", ["X", "k"], [("X", F, [4, 8, 8])], axis=1, initializers=[ints("k", 3)]),
    "gather_elements": lambda: single("GatherElements", ["X", "idx"], [("X", F, [4, 8]), ("idx", I64, [4, 8])], axis=1),
    "layer_norm": lambda: single(
        "LayerNormalization",
        ["X", "g", "b"],
        [("X", F, [4, 8, 16])],
        initializers=[weight("g", [16]), weight("b", [16], 1)],
        axis=-1,
        epsilon=1e-5,
    ),
    "instance_norm": lambda: single(
        "InstanceNormalization",
        ["X", "g", "b"],
        [("X", F, [4, 8, 6])],
        initializers=[weight("g", [8]), weight("b", [8], 1)],
    ),
    "softmax": lambda: single("Softmax", ["X"], [("X", F, [4, 8, 16])], axis=1),
    "softmax_opset11": lambda: single("Softmax", ["X"], [("X", F, [4, 8, 16])], axis=1, opset=11),
    "log_softmax": lambda: single("LogSoftmax", ["X"], [("X", F, [4, 8, 16])]),
    "gelu": lambda: single("Gelu", ["X"], [("X", F, [4, 8])], opset=20),
    "erf": lambda: single("Erf", ["X"], [("X", F, [4, 8])]),
    "tanh": lambda: single("Tanh", ["X"], [("X", F, [4, 8])]),
    "sigmoid": lambda: single("Sigmoid", ["X"], [("X", F, [4, 8])]),
    "sqrt_abs": lambda: make_model(
        [helper.make_node("Abs", ["X"], ["A"], name="abs"), helper.make_node("Sqrt", ["A"], ["Y"], name="op")],
        [("X", F, [4, 8])],
        ["Y"],
    ),
    "pow": lambda: single("Pow", ["X", "two"], [("X", F, [4, 8])], initializers=[floats("two", 2.0)]),
    "where": lambda: single("Where", ["c", "X", "Z"], [("c", B, [1, 8]), ("X", F, [4, 8]), ("Z", F, [4, 1])]),
    "equal_and_not": lambda: make_model(
        [
            helper.make_node("Equal", ["a", "b"], ["e"], name="eq"),
            helper.make_node("Not", ["e"], ["n"], name="not"),
            helper.make_node("And", ["n", "c"], ["Y"], name="op"),
        ],
        [("a", I64, [4, 8]), ("b", I64, [4, 8]), ("c", B, [4, 8])],
        ["Y"],
    ),
    "dropout_cast": lambda: make_model(
        [
            helper.make_node("Dropout", ["X"], ["d"], name="drop"),
            helper.make_node("Cast", ["d"], ["Y"], name="op", to=TensorProto.DOUBLE),
        ],
        [("X", F, [4, 8])],
        ["Y"],
    ),
    "clip": lambda: single(
        "Clip", ["X", "lo", "hi"], [("X", F, [4, 8])], initializers=[floats("lo", -0.5), floats("hi", 0.5)]
    ),
    "max_min": lambda: make_model(
        [helper.make_node("Max", ["X", "Z"], ["m"], name="max"), helper.make_node("Min", ["m", "X"], ["Y"], name="op")],
        [("X", F, [4, 8]), ("Z", F, [8])],
        ["Y"],
    ),
    "sce_mean": lambda: single("SoftmaxCrossEntropyLoss", ["X", "t"], [("X", F, [8, 16]), ("t", I64, [8])]),
    "sce_sum_3d": lambda: single(
        "SoftmaxCrossEntropyLoss", ["X", "t"], [("X", F, [4, 16, 8]), ("t", I64, [4, 8])], reduction="sum"
    ),
    "sce_ignore_index": lambda: single(
        "SoftmaxCrossEntropyLoss", ["X", "t"], [("X", F, [8, 16]), ("t", I64, [8])], ignore_index=1
    ),
    "nll_none": lambda: single(
        "NegativeLogLikelihoodLoss", ["X", "t"], [("X", F, [8, 16]), ("t", I64, [8])], reduction="none"
    ),
    "lrn": lambda: single("LRN", ["X"], [("X", F, [4, 8, 4, 4])], size=3),
    "unsqueeze_squeeze": lambda: make_model(
        [
            helper.make_node("Unsqueeze", ["X", "a"], ["u"], name="unsq"),
            helper.make_node("Squeeze", ["u", "a"], ["Y"], name="op"),
        ],
        [("X", F, [4, 8])],
        ["Y"],
        [ints("a", [1])],
    ),
    "flatten": lambda: single("Flatten", ["X"], [("X", F, [4, 2, 4])], axis=1),
    "reshape_heads": lambda: single(
        "Reshape", ["X", "s"], [("X", F, [2, 4, 16])], initializers=[ints("s", [2, 4, 4, 4])]
    ),
    "reduce_mean_last": lambda: single("ReduceMean", ["X"], [("X", F, [4, 8])], axes=[-1]),
    "top_k": lambda: single(
        "TopK", ["X", "k"], [("X", F, [4, 8, 6])], outputs=("Y", "I"), axis=1, initializers=[ints("k", [3])]
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_candidates_verify(case):
    model = CASES[case]()
    candidates = autopar.candidates(model, devices=4)
    assert not autopar.plan(model, devices=4).fallback_ops
    options = candidates["op"]
    rng = random.Random(case)
    draws = options if len(options) <= 10 else [options[0]] + rng.sample(options[1:], 9)
    for draw, strategy in enumerate(draws):
        strategies = {op: (strategy if op == "op" else rng.choice(cands)) for op, cands in candidates.items()}
        report = autopar.verify(model, strategies, devices=4, seed=draw)
        assert report.ok, (strategy, report.problems)


def rule(model, devices=8) -> OpRule:
    graph = load_model(model)
    return OpRule.build(graph.op("op"), graph, devices.bit_length() - 1)


def split_axes(model, devices=8) -> list[tuple[int, ...]]:
    """For each input, the dims some candidate splits."""
    r = rule(model, devices)
    split = [set() for _ in r.op.inputs]
    for exponents in r.candidates:
        for position, entry in enumerate(r.in_strategy(exponents)):
            split[position] |= {d for d, f in enumerate(entry) if f > 1}
    return [tuple(sorted(s)) for s in split]


def test_every_issue_op_has_a_rule():
    assert set(ISSUE_OPS) <= set(registered_op_types())


def test_embedding_vocab_split_gives_a_partial_sum():
    r = rule(CASES["gather_embedding"]())
    vocab_split = next(e for e in r.candidates if r.in_strategy(e)[0] == (8, 1))
    out = r.output_layouts(vocab_split)[0]
    assert out.partial and out.partial_op == "sum"
    assert split_axes(CASES["gather_embedding"]())[0] == (0, 1)


@pytest.mark.parametrize(
    "case, strategy",
    [
        ("gather_embedding", ((4, 1), (1, 1))),  # vocabulary rows split: masked lookups, summed
        ("gather_embedding", ((2, 1), (2, 1))),
        ("gather_token", ((1, 4, 1), ())),  # the gathered sequence axis split: one rank holds the token
    ],
)
def test_split_gather_axis_verifies(case, strategy):
    model = CASES[case]()
    report = autopar.verify(model, {"op": strategy}, devices=4)
    assert report.ok, report.problems
    assert report.executed.get("AllReduce", {}).get("count") == 1  # the partial output is summed once


def test_axes_an_operator_works_along_stay_whole():
    assert split_axes(CASES["concat"]()) == [(0, 2), (0, 2)]
    assert split_axes(CASES["split"]())[0] == (0, 1)
    assert split_axes(CASES["slice"]())[0] == (0, 2)
    assert split_axes(CASES["slice_whole_axis"]())[0] == (0, 1)  # axis 1 is sliced whole
    assert split_axes(CASES["layer_norm"]())[0] == (0, 1)
    assert split_axes(CASES["softmax"]())[0] == (0, 2)
    assert split_axes(CASES["softmax_opset11"]())[0] == (0,)  # opset < 13 flattens from the axis on
    assert split_axes(CASES["lrn"]())[0] == (0,)
    assert split_axes(CASES["sce_ignore_index"]()) == [(), ()]
    assert split_axes(CASES["top_k"]()) == [(0, 2), ()]  # TopK selects along axis 1


def test_transpose_moves_splits_with_their_dims():
    r = rule(CASES["transpose"]())
    exponents = next(e for e in r.candidates if r.in_strategy(e)[0] == (2, 4, 1, 1))
    in_dims = r.input_layouts(exponents)[0].dims
    assert r.output_layouts(exponents)[0].dims == in_dims[:1] + ((), in_dims[1], ())


def test_mean_loss_split_over_samples_is_a_partial_sum():
    r = rule(CASES["sce_mean"]())
    exponents = next(e for e in r.candidates if r.in_strategy(e)[0] == (8, 1))
    out = r.output_layouts(exponents)[0]
    assert out.partial and out.partial_op == "sum" and r.spec.local_mean


def test_unknown_operator_runs_replicated_and_is_reported(tmp_path, capsys):
    from autopar.cli import main

    nodes = [
        helper.make_node("Relu", ["X"], ["r"], name="relu"),
        helper.make_node("CumSum", ["r", "axis"], ["Y"], name="cumsum"),
    ]
    model = make_model(nodes, [("X", F, [8, 8])], ["Y"], [ints("axis", 1)])
    with pytest.warns(FallbackWarning, match=r"cumsum \(CumSum\)"):
        plan = autopar.plan(model, devices=8)
    assert plan.fallback_ops == ["cumsum"]
    assert autopar.verify(model, plan).ok
    path = tmp_path / "cumsum.onnx"
    onnx.save(model, path)
    assert main(["plan", str(path), "--devices", "8"]) == 0
    assert "cumsum" in capsys.readouterr().err
