"""Every operator's torch kernel: registered, equal to onnxruntime on one device, right in the backward.

The forward of every bundled and test model in torch must equal onnxruntime's (it stays the
reference for the forward), and so must each operator alone under its attributes and opset
variants (`KERNELS`), with constant inputs given as tensors or as numpy arrays alike. Every
trainable parameter of a model with a loss gets a finite, non-zero gradient. Each one-operator
model of the coverage suite, with its float inputs made trainable weights, trains on 4 virtual
devices under several candidate strategies: every weight's gradient, reassembled from its
shards, equals torch autograd's on one device.
"""

from __future__ import annotations

import random

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import autopar
from autopar.errors import AutoparError
from autopar.graph import load_model
from autopar.ops import registered_op_types
from autopar.ops.registry import _REGISTRY
from autopar.spmd.compare import compare_output
from autopar.spmd.reference import reference_outputs
from autopar.spmd.values import materialise
from models.resnet50 import build_resnet50
from models.transformer import build_transformer
from tests.conftest import light_models, make_model
from tests.test_ops_coverage import CASES

torch = pytest.importorskip("torch")
pytest.importorskip("onnxruntime")

from autopar.runtime.single import run_graph, run_op, tensor  # noqa: E402  (needs torch)

MODELS = {
    "resnet50": lambda: ("models/resnet50.onnx", 2),
    "tiny_resnet": lambda: (build_resnet50(batch=4, num_classes=16, image_size=32, width=8, blocks=(1, 1, 1, 1)), None),
    "gpt": lambda: (
        build_transformer(kind="gpt", layers=2, hidden=64, heads=8, seq=16, vocab=64, batch=2, weights="random"),
        None,
    ),
    "bert_decomposed_layernorm": lambda: (
        build_transformer(kind="bert", layers=1, hidden=64, heads=8, seq=16, vocab=64, batch=2, layernorm="decomposed"),
        None,
    ),
    "gpt_fused_gelu": lambda: (
        build_transformer(kind="gpt", layers=1, hidden=64, heads=8, seq=16, vocab=64, batch=2, gelu="fused"),
        None,
    ),
    "torch_gpt_dynamo": lambda: ("tests/data/torch_gpt_dynamo.onnx", None),
    "torch_gpt_legacy": lambda: ("tests/data/torch_gpt_legacy.onnx", None),
    **{path.stem: (lambda path=path: (str(path), 1)) for path in light_models()},
}


def test_every_operator_with_a_rule_has_a_torch_kernel():
    missing = sorted(
        f"{op_type} (opset {d.since}+)"
        for (_, op_type), definitions in _REGISTRY.items()
        for d in definitions
        if d.rule is not None and d.torch_kernel is None
    )
    assert not missing
    local = [
        op_type
        for (_, op_type), definitions in _REGISTRY.items()
        for d in definitions
        if d.local_kernel is not None and d.torch_local_kernel is None
    ]
    assert not local, "an operator adjusted on its shards needs the torch twin of that adjustment"


@pytest.mark.parametrize("name", sorted(MODELS))
def test_torch_forward_equals_onnxruntime(name):
    model, batch = MODELS[name]()
    graph = autopar.build(model, 1, batch=batch).graph
    values = materialise(graph, seed=0)
    expected = reference_outputs(graph, values)
    outputs, _ = run_graph(graph, values)
    for output, value in expected.items():
        check = compare_output(output, outputs[output].detach().numpy(), value)
        assert check.ok, check.problem


def trainable_inputs(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model with every float graph input turned into a weight: its gradient is then checked."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    rng = np.random.default_rng(0)
    for value in list(out.graph.input):
        if value.type.tensor_type.elem_type != onnx.TensorProto.FLOAT:
            continue
        shape = [d.dim_value for d in value.type.tensor_type.shape.dim]
        out.graph.initializer.append(numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), value.name))
        out.graph.input.remove(value)
    return out


# Non-differentiable operators and those whose float inputs are configuration only
NO_GRADIENT = {"equal_and_not"}


@pytest.mark.parametrize("case", sorted(set(CASES) - NO_GRADIENT))
def test_operator_gradients_under_candidate_strategies(case):
    model = trainable_inputs(CASES[case]())
    candidates = autopar.candidates(model, devices=4)
    rng = random.Random(case)
    options = candidates["op"]
    draws = options if len(options) <= 6 else [options[0]] + rng.sample(options[1:], 5)
    for draw, strategy in enumerate(draws):
        strategies = {op: (strategy if op == "op" else rng.choice(cands)) for op, cands in candidates.items()}
        report = autopar.verify(model, strategies, devices=4, seed=draw, gradients=True)
        assert report.ok, (strategy, report.problems)
        assert report.gradients is not None and report.gradients.checked >= 1


# --- each operator alone, under its attributes and opset variants ---------------------------------

F, I64, B, U8 = TensorProto.FLOAT, TensorProto.INT64, TensorProto.BOOL, TensorProto.UINT8
X2, X4 = [("X", F, [3, 4])], [("X", F, [2, 3, 5, 6])]
XZ = [("X", F, [3, 4]), ("Z", F, [1, 4])]
BOOLS = [("A", B, [3, 4]), ("Z", B, [4])]
UNARY = (
    "Relu",
    "Exp",
    "Sigmoid",
    "Tanh",
    "Sqrt",
    "Reciprocal",
    "Log",
    "Abs",
    "Erf",
    "Softplus",
    "Softsign",
    "Sin",
    "Cos",
    "Neg",
    "Floor",
    "Ceil",
    "Round",
    "Sign",
    "Identity",
    "HardSwish",
    "Mish",
    "IsNaN",
    "IsInf",
)


def const(name, values, dtype=np.int64):
    return numpy_helper.from_array(np.asarray(values, dtype=dtype), name)


def ones(name, shape):
    return const(name, np.linspace(0.5, 1.5, int(np.prod(shape))).reshape(shape), np.float32)


def one(op_type, inputs, shapes, consts=(), outputs=("Y",), opset=17, **attrs):
    """A builder of a model with one operator reading graph inputs ``shapes`` and constants ``consts``."""
    node = helper.make_node(op_type, list(inputs), list(outputs), name="op", **attrs)
    return lambda: make_model([node], shapes, list(outputs), list(consts), opset=opset)


KERNELS = {
    **{name.lower(): one(name, ["X"], X2, opset=18) for name in UNARY},
    "not": one("Not", ["X"], [("X", B, [3, 4])]),
    "gelu": one("Gelu", ["X"], X2, opset=20),
    "gelu_tanh": one("Gelu", ["X"], X2, opset=20, approximate="tanh"),
    "leaky_relu": one("LeakyRelu", ["X"], X2, alpha=0.3),
    "elu": one("Elu", ["X"], X2, alpha=0.7),
    "selu": one("Selu", ["X"], X2, alpha=1.5, gamma=2.0),
    "celu": one("Celu", ["X"], X2, alpha=0.5),
    "hard_sigmoid": one("HardSigmoid", ["X"], X2, alpha=0.3, beta=0.4),
    "thresholded_relu": one("ThresholdedRelu", ["X"], X2, alpha=0.5),
    "is_inf_negative": one("IsInf", ["X"], X2, detect_positive=0),
    "cast_int": one("Cast", ["X"], X2, to=TensorProto.INT32),
    "cast_bool": one("Cast", ["X"], X2, to=TensorProto.BOOL),
    "cast_half": one("Cast", ["X"], X2, to=TensorProto.FLOAT16),
    "cast_like": one("CastLike", ["X", "t"], X2, [const("t", [1], np.int32)]),
    "clip_inputs": one("Clip", ["X", "lo", "hi"], X2, [const("lo", -0.5, np.float32), const("hi", 0.5, np.float32)]),
    "clip_max_only": one("Clip", ["X", "", "hi"], X2, [const("hi", 0.5, np.float32)]),
    "clip_attributes": one("Clip", ["X"], X2, opset=6, min=-0.3, max=0.2),
    "clip_int": one("Clip", ["X", "lo", "hi"], [("X", I64, [3, 4])], [const("lo", 0), const("hi", 1)]),
    "dropout_mask": one("Dropout", ["X"], X2, outputs=("Y", "M")),
    "dropout_mask_opset10": one("Dropout", ["X"], X2, outputs=("Y", "M"), opset=10),
    "add": one("Add", ["X", "Z"], XZ),
    "sub": one("Sub", ["X", "Z"], XZ),
    "mul": one("Mul", ["X", "Z"], XZ),
    "div": one("Div", ["X", "Z"], XZ),
    "div_int": one("Div", ["X", "d"], [("X", I64, [3, 4])], [const("d", [3, -2, 5, 7])]),
    "pow": one("Pow", ["X", "p"], X2, [const("p", 3.0, np.float32)]),
    "pow_int_exponent": one("Pow", ["X", "p"], X2, [const("p", 2)]),
    "sum": one("Sum", ["X", "Z", "X"], XZ),
    "mean": one("Mean", ["X", "Z", "X"], XZ),
    "max": one("Max", ["X", "Z", "X"], XZ),
    "min": one("Min", ["X", "Z"], XZ),
    "prelu": one("PRelu", ["X", "s"], [("X", F, [2, 3, 4])], [const("s", [[0.1], [0.2], [0.3]], np.float32)]),
    "where": one("Where", ["C", "X", "Z"], [("C", B, [3, 1]), ("X", F, [3, 4]), ("Z", F, [4])]),
    **{
        name.lower(): one(name, ["X", "Z"], XZ)
        for name in ("Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual")
    },
    **{name.lower(): one(name, ["A", "Z"], BOOLS) for name in ("And", "Or", "Xor")},
    "mod": one("Mod", ["X", "d"], [("X", I64, [2, 4])], [const("d", [3, -3, 2, -5])]),
    "fmod": one("Mod", ["X", "d"], X2, [const("d", [0.7, -0.4, 1.5, 2.0], np.float32)], fmod=1),
    "bit_shift_left": one(
        "BitShift", ["X", "s"], [("X", U8, [2, 4])], [const("s", [1, 2, 3, 0], np.uint8)], direction="LEFT"
    ),
    "bit_shift_right": one(
        "BitShift", ["X", "s"], [("X", U8, [2, 4])], [const("s", [1, 0, 1, 0], np.uint8)], direction="RIGHT"
    ),
    "expand": one("Expand", ["X", "s"], [("X", F, [3, 1])], [const("s", [2, 1, 4])]),
    "gemm": one(
        "Gemm",
        ["A", "W", "C"],
        [("A", F, [4, 3])],
        [ones("W", [5, 3]), ones("C", [1, 5])],
        transB=1,
        alpha=0.5,
        beta=2.0,
    ),
    "gemm_trans_a": one("Gemm", ["A", "W"], [("A", F, [3, 4])], [ones("W", [3, 5])], transA=1),
    "matmul": one("MatMul", ["A", "W"], [("A", F, [2, 3, 4]), ("W", F, [4, 5])]),
    "matmul_vector": one("MatMul", ["v", "W"], [("v", F, [4]), ("W", F, [2, 4, 5])]),
    "conv_pads": one(
        "Conv", ["X", "W", "b"], X4, [ones("W", [4, 3, 3, 2]), ones("b", [4])], pads=[1, 0, 0, 1], strides=[2, 1]
    ),
    "conv_same_lower": one("Conv", ["X", "W"], X4, [ones("W", [4, 3, 3, 3])], auto_pad="SAME_LOWER", strides=[2, 2]),
    "conv_grouped_dilated": one(
        "Conv", ["X", "W"], [("X", F, [2, 4, 7, 7])], [ones("W", [6, 2, 3, 3])], group=2, dilations=[2, 1]
    ),
    "conv_1d": one("Conv", ["X", "W"], [("X", F, [2, 3, 9])], [ones("W", [4, 3, 3])], auto_pad="SAME_UPPER"),
    "conv_transpose": one(
        "ConvTranspose",
        ["X", "W", "b"],
        X4,
        [ones("W", [3, 2, 3, 3]), ones("b", [2])],
        strides=[2, 2],
        pads=[1, 0, 0, 1],
        output_padding=[1, 0],
    ),
    "conv_transpose_same": one(
        "ConvTranspose", ["X", "W"], X4, [ones("W", [3, 2, 3, 3])], strides=[2, 2], auto_pad="SAME_UPPER"
    ),
    "conv_transpose_shape": one(
        "ConvTranspose",
        ["X", "W"],
        X4,
        [ones("W", [3, 2, 3, 3])],
        strides=[2, 2],
        output_shape=[10, 12],
        dilations=[1, 2],
    ),
    "batch_norm": one(
        "BatchNormalization", ["X", "s", "b", "m", "v"], X4, [ones(n, [3]) for n in "sbmv"], epsilon=1e-3
    ),
    "batch_norm_training": one(
        "BatchNormalization",
        ["X", "s", "b", "m", "v"],
        X4,
        [ones(n, [3]) for n in "sbmv"],
        outputs=("Y", "RM", "RV"),
        training_mode=1,
        momentum=0.8,
    ),
    "instance_norm": one("InstanceNormalization", ["X", "s", "b"], X4, [ones("s", [3]), ones("b", [3])], epsilon=1e-3),
    "layer_norm_statistics": one(
        "LayerNormalization",
        ["X", "s", "b"],
        X4,
        [ones("s", [5, 6]), ones("b", [5, 6])],
        axis=2,
        outputs=("Y", "M", "I"),
    ),
    "layer_norm_no_bias": one("LayerNormalization", ["X", "s"], X4, [ones("s", [6])], epsilon=0.1),
    "softmax": one("Softmax", ["X"], X4, axis=1),
    "log_softmax": one("LogSoftmax", ["X"], X4),
    "hardmax": one("Hardmax", ["X"], X4, axis=2),
    "softmax_opset11": one("Softmax", ["X"], X4, opset=11),
    "log_softmax_opset11": one("LogSoftmax", ["X"], X4, axis=2, opset=11),
    "hardmax_opset11": one("Hardmax", ["X"], X4, opset=11),
    "max_pool": one("MaxPool", ["X"], X4, kernel_shape=[3, 2], pads=[1, 0, 1, 1], strides=[2, 2]),
    "max_pool_ceil": one("MaxPool", ["X"], X4, kernel_shape=[2, 2], strides=[2, 2], ceil_mode=1),
    "max_pool_dilated": one("MaxPool", ["X"], X4, kernel_shape=[2, 2], dilations=[2, 1], pads=[1, 1, 0, 1]),
    "max_pool_1d": one("MaxPool", ["X"], [("X", F, [2, 3, 9])], kernel_shape=[3], strides=[2]),
    "max_pool_indices": one("MaxPool", ["X"], X4, kernel_shape=[2, 3], pads=[1, 1, 0, 1], outputs=("Y", "I")),
    "max_pool_indices_ceil": one(
        "MaxPool", ["X"], X4, kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1], ceil_mode=1, outputs=("Y", "I")
    ),
    "max_pool_indices_3d": one(
        "MaxPool",
        ["X"],
        [("X", F, [2, 2, 4, 5, 3])],
        kernel_shape=[2, 2, 2],
        pads=[1, 0, 0, 0, 1, 1],
        outputs=("Y", "I"),
    ),
    "max_pool_indices_column_major": one(
        "MaxPool", ["X"], [("X", F, [2, 2, 4, 5, 3])], kernel_shape=[2, 2, 2], outputs=("Y", "I"), storage_order=1
    ),
    "average_pool": one("AveragePool", ["X"], X4, kernel_shape=[3, 3], pads=[1, 1, 1, 1], strides=[2, 2]),
    "average_pool_counting_pads": one(
        "AveragePool", ["X"], X4, kernel_shape=[3, 3], pads=[1, 0, 1, 2], count_include_pad=1
    ),
    "average_pool_ceil": one("AveragePool", ["X"], X4, kernel_shape=[2, 2], strides=[2, 2], ceil_mode=1),
    "average_pool_ceil_counting_pads": one(
        "AveragePool", ["X"], X4, kernel_shape=[2, 2], strides=[2, 2], ceil_mode=1, count_include_pad=1
    ),
    "average_pool_same": one("AveragePool", ["X"], X4, kernel_shape=[2, 3], auto_pad="SAME_LOWER"),
    "average_pool_dilated": one(
        "AveragePool", ["X"], X4, kernel_shape=[2, 2], dilations=[2, 1], pads=[1, 0, 0, 1], opset=19
    ),
    "average_pool_1d": one("AveragePool", ["X"], [("X", F, [2, 3, 9])], kernel_shape=[3], strides=[2]),
    "global_average_pool": one("GlobalAveragePool", ["X"], X4),
    "global_max_pool": one("GlobalMaxPool", ["X"], X4),
    "lp_pool": one("LpPool", ["X"], X4, kernel_shape=[2, 2], strides=[2, 1], pads=[0, 1, 1, 0]),
    "lp_pool_p1": one("LpPool", ["X"], X4, kernel_shape=[3, 2], p=1),
    "lp_pool_ceil": one("LpPool", ["X"], X4, kernel_shape=[2, 2], strides=[2, 2], ceil_mode=1, opset=18),
    "lp_pool_dilated": one("LpPool", ["X"], X4, kernel_shape=[2, 2], dilations=[2, 2], p=3, opset=18),
    "lrn": one("LRN", ["X"], [("X", F, [2, 6, 3, 3])], size=3, alpha=0.01, beta=0.6, bias=2.0),
    "lrn_5": one("LRN", ["X"], [("X", F, [2, 7, 3, 2])], size=5),
    "reduce_sum_axes_input": one("ReduceSum", ["X", "a"], X4, [const("a", [1, -1])], keepdims=0),
    "reduce_sum_all": one("ReduceSum", ["X"], X4),
    "reduce_sum_noop": one("ReduceSum", ["X"], X4, noop_with_empty_axes=1),
    "reduce_mean_attribute": one("ReduceMean", ["X"], X4, axes=[2], opset=13),
    "reduce_mean_opset18": one("ReduceMean", ["X", "a"], X4, [const("a", [0, 3])], opset=18),
    "reduce_max": one("ReduceMax", ["X"], X4, axes=[1], keepdims=0),
    "reduce_min": one("ReduceMin", ["X"], X4),
    "top_k": one("TopK", ["X", "k"], X4, [const("k", [2])], outputs=("Y", "I"), axis=2),
    "top_k_smallest": one("TopK", ["X", "k"], X4, [const("k", [3])], outputs=("Y", "I"), largest=0),
    "transpose_reversed": one("Transpose", ["X"], X4),
    "transpose": one("Transpose", ["X"], X4, perm=[2, 0, 3, 1]),
    "concat": one("Concat", ["X", "Z"], [("X", F, [2, 3]), ("Z", F, [2, 5])], axis=-1),
    "split_attribute": one("Split", ["X"], X4, outputs=("A", "B"), axis=3, split=[2, 4], opset=11),
    "split_equal": one("Split", ["X"], X4, outputs=("A", "B", "C"), axis=3),
    "split_input": one("Split", ["X", "s"], X4, [const("s", [1, 4])], outputs=("A", "B"), axis=2),
    "split_num_outputs": one(
        "Split", ["X"], [("X", F, [2, 7])], outputs=("A", "B", "C"), axis=1, num_outputs=3, opset=18
    ),
    "slice_steps": one(
        "Slice",
        ["X", "s", "e", "a", "st"],
        X4,
        [const("s", [-1, 0]), const("e", [-100, 9]), const("a", [3, 2]), const("st", [-2, 2])],
    ),
    "slice_clamped": one("Slice", ["X", "s", "e"], X4, [const("s", [1, -10]), const("e", [100, -1])]),
    "slice_attributes": one("Slice", ["X"], X4, starts=[1], ends=[3], axes=[3], opset=9),
    "pad_constant": one(
        "Pad", ["X", "p", "v"], X4, [const("p", [0, 0, 1, -1, 0, 1, 2, 0]), const("v", 1.5, np.float32)]
    ),
    "pad_int": one("Pad", ["X", "p", "v"], [("X", I64, [2, 3])], [const("p", [1, 0, 0, 1]), const("v", 7)]),
    "pad_reflect": one("Pad", ["X", "p"], X4, [const("p", [1, 2, 1, 0, 0, 1, 2, 4])], mode="reflect"),
    "pad_edge": one("Pad", ["X", "p"], X4, [const("p", [1, 0, -1, 2, 0, 2, 0, -2])], mode="edge"),
    "pad_wrap": one("Pad", ["X", "p"], X4, [const("p", [0, 2, 1, 7, 0, 2, 6, 0])], mode="wrap", opset=19),
    "pad_axes": one("Pad", ["X", "p", "", "a"], X4, [const("p", [1, 2, 0, 3]), const("a", [1, -1])], opset=18),
    "pad_attributes": one("Pad", ["X"], X4, pads=[0, 1, 0, 0, 0, 1, 0, 0], value=2.0, opset=2),
    "tile": one("Tile", ["X", "r"], X4, [const("r", [1, 2, 1, 3])]),
    "reshape": one("Reshape", ["X", "s"], X4, [const("s", [0, -1, 6])]),
    "reshape_allowzero": one("Reshape", ["X", "s"], X4, [const("s", [6, -1, 2, 5])], allowzero=1, opset=14),
    "flatten_0": one("Flatten", ["X"], X4, axis=0),
    "flatten_negative": one("Flatten", ["X"], X4, axis=-1),
    "squeeze_input": one("Squeeze", ["X", "a"], [("X", F, [1, 3, 1, 4])], [const("a", [-2])]),
    "squeeze_all": one("Squeeze", ["X"], [("X", F, [1, 3, 1, 4])]),
    "squeeze_attribute": one("Squeeze", ["X"], [("X", F, [1, 3, 1, 4])], axes=[0], opset=11),
    "unsqueeze_input": one("Unsqueeze", ["X", "a"], X2, [const("a", [0, -1])]),
    "unsqueeze_attribute": one("Unsqueeze", ["X"], X2, axes=[1, 3], opset=11),
    "gather": one("Gather", ["E", "i"], [("i", I64, [2, 3])], [ones("E", [5, 4])]),
    "gather_negative": one("Gather", ["X", "i"], X4, [const("i", [[-1, 0], [2, -3]])], axis=3),
    "gather_elements": one("GatherElements", ["X", "i"], X2, [const("i", [[0, -1, 2, 1], [3, 3, 0, 0]])], axis=1),
    "one_hot": one(
        "OneHot", ["i", "d", "v"], [("i", I64, [2, 3])], [const("d", 5), const("v", [0.5, 2.0], np.float32)], axis=1
    ),
    "one_hot_int": one("OneHot", ["i", "d", "v"], [("i", I64, [2, 3])], [const("d", [4]), const("v", [0, 3])]),
    "cross_entropy_weighted_log_prob": one(
        "SoftmaxCrossEntropyLoss",
        ["X", "t", "w"],
        [("X", F, [4, 5, 3]), ("t", I64, [4, 3])],
        [const("w", [1, 2, 0.5, 1, 3], np.float32)],
        outputs=("Y", "L"),
    ),
    "cross_entropy_ignored_none": one(
        "SoftmaxCrossEntropyLoss", ["X", "t"], [("X", F, [6, 5]), ("t", I64, [6])], reduction="none", ignore_index=1
    ),
    "nll_weighted_mean_ignored": one(
        "NegativeLogLikelihoodLoss",
        ["X", "t", "w"],
        [("X", F, [4, 5]), ("t", I64, [4])],
        [const("w", [1, 2, 0.5, 1, 3], np.float32)],
        ignore_index=2,
    ),
    "nll_sum": one("NegativeLogLikelihoodLoss", ["X", "t"], [("X", F, [4, 5, 2]), ("t", I64, [4, 2])], reduction="sum"),
    "shape": one("Shape", ["X"], X4),
    "shape_start_end": one("Shape", ["X"], X4, start=1, end=-1, opset=15),
    "size": one("Size", ["X"], X4),
    "arg_max": one("ArgMax", ["X"], X4, axis=2),
    "arg_min_last": one("ArgMin", ["X"], X4, axis=-1, keepdims=0, select_last_index=1),
}


def resize(opset=19, roi=None, scales=None, sizes=None, **attrs):
    """Resize of a [1, 2, 4, 5] input, from whichever of roi, scales and sizes are given."""
    inputs, consts = ["X", "", "", ""], []
    for slot, name, value, dtype in (
        (1, "roi", roi, np.float32),
        (2, "scales", scales, np.float32),
        (3, "sizes", sizes, np.int64),
    ):
        if value is not None:
            inputs[slot] = name
            consts.append(const(name, value, dtype))
    while not inputs[-1]:
        inputs.pop()
    return one("Resize", inputs, [("X", F, [1, 2, 4, 5])], consts, opset=opset, **attrs)


LEGACY = [("X", F, [1, 2, 4, 5])]
KERNELS |= {
    "resize_nearest_up": resize(scales=[1, 1, 2, 1.5]),
    "resize_nearest_down": resize(scales=[1, 1, 0.5, 0.6]),
    "resize_nearest_ceil_align_corners": resize(
        sizes=[1, 2, 7, 3], nearest_mode="ceil", coordinate_transformation_mode="align_corners"
    ),
    "resize_nearest_floor_asymmetric": resize(
        scales=[1, 1, 1.7, 0.8], nearest_mode="floor", coordinate_transformation_mode="asymmetric"
    ),
    "resize_nearest_prefer_ceil": resize(scales=[1, 1, 3, 2], nearest_mode="round_prefer_ceil"),
    "resize_linear_up": resize(scales=[1, 1, 2, 1.5], mode="linear"),
    "resize_linear_down": resize(sizes=[1, 2, 3, 2], mode="linear"),
    "resize_linear_align_corners": resize(
        sizes=[1, 2, 7, 9], mode="linear", coordinate_transformation_mode="align_corners"
    ),
    "resize_linear_pytorch": resize(
        sizes=[1, 2, 1, 9], mode="linear", coordinate_transformation_mode="pytorch_half_pixel"
    ),
    "resize_linear_symmetric": resize(
        scales=[1, 1, 1.5, 0.7], mode="linear", coordinate_transformation_mode="half_pixel_symmetric"
    ),
    "resize_linear_crop": resize(
        sizes=[1, 2, 6, 4],
        roi=[0, 0, -0.2, 0.1, 1, 1, 0.9, 1.3],
        mode="linear",
        coordinate_transformation_mode="tf_crop_and_resize",
        extrapolation_value=3.0,
    ),
    "resize_cubic": resize(scales=[1, 1, 2, 1.5], mode="cubic"),
    "resize_cubic_exclude_outside": resize(
        scales=[1, 1, 0.6, 1.5], mode="cubic", exclude_outside=1, cubic_coeff_a=-0.5
    ),
    "resize_cubic_align_corners": resize(
        sizes=[1, 2, 6, 7], mode="cubic", coordinate_transformation_mode="align_corners"
    ),
    "resize_axes": resize(scales=[2.0, 0.6], axes=[2, 3], mode="linear"),
    "resize_not_larger": resize(sizes=[7, 7], axes=[2, 3], keep_aspect_ratio_policy="not_larger"),
    "resize_not_smaller": resize(sizes=[7, 7], axes=[2, 3], keep_aspect_ratio_policy="not_smaller", mode="linear"),
    "resize_opset11": resize(opset=11, roi=[], scales=[1, 1, 2, 1.5], mode="linear"),
    "resize_opset10": one("Resize", ["X", "s"], LEGACY, [const("s", [1, 1, 2, 1.5], np.float32)], opset=10),
    "resize_opset10_down": one("Resize", ["X", "s"], LEGACY, [const("s", [1, 1, 0.5, 0.6], np.float32)], opset=10),
    "resize_opset10_linear": one(
        "Resize", ["X", "s"], LEGACY, [const("s", [1, 1, 2, 1.5], np.float32)], opset=10, mode="linear"
    ),
    "upsample_opset7": one("Upsample", ["X"], LEGACY, opset=7, scales=[1.0, 1.0, 2.0, 3.0]),
    "upsample_linear": one(
        "Upsample", ["X", "s"], LEGACY, [const("s", [1, 1, 2, 1.5], np.float32)], opset=9, mode="linear"
    ),
}


def kernel_case(name):
    """(graph, values) of a one-operator case; unsigned inputs get small values a shift keeps in range."""
    graph = load_model(KERNELS[name]())
    values = materialise(graph, seed=0)
    for key, value in values.items():
        if value.dtype == np.uint8 and graph.tensor(key).kind == "input":
            values[key] = (np.arange(value.size).reshape(value.shape) % 7 * 9).astype(np.uint8)
    return graph, values


def test_every_operator_with_a_rule_is_checked_alone():
    checked = {KERNELS[name]().graph.node[0].op_type for name in KERNELS}
    assert set(registered_op_types()) <= checked


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_operator_alone_equals_onnxruntime(name):
    graph, values = kernel_case(name)
    expected = reference_outputs(graph, values)
    outputs, _ = run_graph(graph, values)
    for output, value in expected.items():
        got = outputs[output].detach().numpy()
        assert (got.shape, got.dtype) == (value.shape, value.dtype), output
        nan = np.isnan(value) if value.dtype.kind == "f" else np.zeros(value.shape, bool)
        assert np.array_equal(np.isnan(got) if got.dtype.kind == "f" else nan, nan), output
        check = compare_output(output, np.where(nan, 0, got), np.where(nan, 0, value))
        assert check.ok, check.problem


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_constant_inputs_may_be_numpy_arrays(name):
    """The runtime may hand a kernel a constant (Reshape's local target shape) as a numpy array."""
    graph, values = kernel_case(name)
    expected, _ = run_graph(graph, values)
    (op,) = graph.ops
    inputs = [
        None if not n else values[n] if graph.tensor(n).kind == "constant" else tensor(values[n]) for n in op.inputs
    ]
    for output, got in zip([n for n in op.outputs if n], run_op(op, graph, inputs)):
        assert torch.equal(got, expected[output]) or torch.allclose(got, expected[output], equal_nan=True), output


# --- gradients ----------------------------------------------------------------------------------

WITH_LOSS = ["tiny_resnet", "gpt", "bert_decomposed_layernorm", "torch_gpt_dynamo"]


@pytest.mark.parametrize("name", WITH_LOSS)
def test_every_trainable_parameter_gets_a_finite_nonzero_gradient(name):
    model, batch = MODELS[name]()
    graph = load_model(model, batch=batch)
    trainable = [n for n, info in graph.tensors.items() if info.kind == "parameter" and info.trainable]
    outputs, leaves = run_graph(graph, materialise(graph, seed=0), requires_grad=trainable)
    loss = outputs["loss"]
    assert loss.dim() == 0
    loss.backward()
    for name_, leaf in leaves.items():
        assert leaf.grad is not None, name_
        assert torch.isfinite(leaf.grad).all(), name_
        assert leaf.grad.abs().max() > 0, name_


def test_an_operator_without_a_torch_kernel_is_named():
    model = make_model(
        [
            helper.make_node("Relu", ["X"], ["r"], name="relu"),
            helper.make_node("CumSum", ["r", "a"], ["Y"], name="cumsum"),
        ],
        [("X", F, [2, 3])],
        ["Y"],
        [const("a", 1)],
    )
    graph = load_model(model)
    with pytest.raises(AutoparError, match=r"'cumsum' \(CumSum\)"):
        run_graph(graph, materialise(graph))
