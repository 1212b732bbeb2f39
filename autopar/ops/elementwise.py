"""Element-wise operators: every dimension of the output may be split; broadcast dimensions follow.

Unary operators may carry configuration inputs (Clip's bounds, Dropout's ratio): those are
scalars every rank holds whole. Expand is a broadcast too: the dimensions it creates or
stretches from size 1 carry no label on the input.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
from onnx import TensorProto

from autopar.ops.base import OpSpec, as_float, as_ints, broadcast_labels, dim_labels, shape, tensors
from autopar.ops.cases import BOOLS, I64, U8, X2, XZ, B, F, const, floats, ints, named, node, one
from autopar.ops.registry import Keeps, LocalCall, MindSporePrimitive, TorchKernel, no_flops, register
from autopar.ops.shape import local_target_shape

if TYPE_CHECKING:
    from autopar.graph import Graph, OpNode
    from autopar.ops.views import GraphView, NodeView

# What each backward needs: y' from the output (Relu, Exp, Sigmoid, Tanh, Sqrt, Reciprocal),
# from the input (Log, Erf, Gelu, ...), or nothing (Add, Neg, Cast). A product keeps each factor
# for the other's gradient (Mul by a constant keeps nothing); a quotient always keeps its divisor
# and, for the divisor's gradient, its numerator; Where keeps only its condition; Max and Min
# keep both to know which one won.
# Each table maps an op type to its MindSpore primitive (None: no primitive does the same).
UNARY_KEEPS_OUTPUT: dict[str, str | None] = {
    "Relu": "ops.ReLU",
    "Exp": "ops.Exp",
    "Sigmoid": "ops.Sigmoid",
    "Tanh": "ops.Tanh",
    "Sqrt": "ops.Sqrt",
    "Reciprocal": "ops.Reciprocal",
}
UNARY_KEEPS_INPUT: dict[str, MindSporePrimitive | str | None] = {
    "Log": "ops.Log",
    "Abs": "ops.Abs",
    "Erf": "ops.Erf",
    "Gelu": "ops.GeLU",
    "Softplus": "ops.Softplus",
    "Softsign": "ops.Softsign",
    "LeakyRelu": None,
    "Elu": "ops.Elu",
    "Selu": "ops.SeLU",
    "Celu": "ops.CeLU",
    "HardSigmoid": "ops.HSigmoid",
    "HardSwish": "ops.HSwish",
    "Mish": "ops.Mish",
    "ThresholdedRelu": None,
    "Shrink": MindSporePrimitive("ops.SoftShrink", needs_args=True, note="bias = lambd; ops.HShrink for bias 0"),
    "Sin": "ops.Sin",
    "Cos": "ops.Cos",
}
UNARY_KEEPS_NOTHING: dict[str, MindSporePrimitive | None] = {
    "Neg": MindSporePrimitive("ops.Neg"),
    "Cast": MindSporePrimitive("ops.Cast", 1),
    "CastLike": MindSporePrimitive("ops.Cast", 1),
}
UNARY_NON_DIFFERENTIABLE: dict[str, str | None] = {
    "Not": "ops.LogicalNot",
    "Floor": "ops.Floor",
    "Ceil": "ops.Ceil",
    "Round": "ops.Round",
    "Sign": "ops.Sign",
    "IsNaN": "ops.IsNan",
    "IsInf": "ops.IsInf",
}
BROADCAST_KEEPS_NOTHING: dict[str, str | None] = {"Add": "ops.Add", "Sub": "ops.Sub", "Sum": "ops.AddN", "Mean": None}
BROADCAST_KEEPS_INPUTS: dict[str, str | None] = {"Max": "ops.Maximum", "Min": "ops.Minimum"}
BROADCAST_KEEPS_OPERANDS: dict[str, str | None] = {"Mul": "ops.Mul"}
BROADCAST_NON_DIFFERENTIABLE: dict[str, str | None] = {
    "Equal": "ops.Equal",
    "Less": "ops.Less",
    "LessOrEqual": "ops.LessEqual",
    "Greater": "ops.Greater",
    "GreaterOrEqual": "ops.GreaterEqual",
    "And": "ops.LogicalAnd",
    "Or": "ops.LogicalOr",
    "Xor": "ops.LogicalXor",
    "Mod": "ops.FloorMod",
    "BitShift": None,
}


def unary(op: NodeView, graph: GraphView) -> OpSpec:
    rank = len(shape(graph, op.outputs[0]))
    labels = dim_labels(rank)
    if op.op_type == "CastLike":  # the second input only names a type
        inputs: tuple = (labels, None)
    else:
        inputs = (labels,) + tuple(None for _ in op.inputs[1:])
    outputs = tuple(labels if name else () for name in op.outputs)  # Dropout's mask follows its output
    return OpSpec(inputs=inputs, outputs=outputs)


def broadcast(op: NodeView, graph: GraphView) -> OpSpec:
    """The device matrix follows the output's dims (MindSpore's rule for broadcasting operators), so
    ``Add(bias, x)`` lays out its output as ``Add(x, bias)`` does: a bias written first must not move
    the batch to lower mesh bits than the producer of ``x`` gave it."""
    out_shape = shape(graph, op.outputs[0])
    inputs = tuple(broadcast_labels(shape(graph, name), out_shape) if name else None for name in op.inputs)
    order = tuple(label for label in dim_labels(len(out_shape)) if label is not None)
    return OpSpec(inputs=inputs, outputs=(order,), label_order=order)


# ONNX TensorProto element types as torch dtype names (Cast's ``to``)
TORCH_DTYPES = {
    1: "float32",
    2: "uint8",
    3: "int8",
    4: "uint16",
    5: "int16",
    6: "int32",
    7: "int64",
    9: "bool",
    10: "float16",
    11: "float64",
    12: "uint32",
    13: "uint64",
    16: "bfloat16",
}
SELU_ALPHA, SELU_GAMMA = 1.67326319217681884765625, 1.05070102214813232421875  # ONNX's defaults
_TORCH_SAME_NAME = {"Relu", "Exp", "Sigmoid", "Tanh", "Sqrt", "Reciprocal", "Log", "Abs", "Erf", "Sin", "Cos", "Neg"}
_TORCH_ROUNDING = {"Floor", "Ceil", "Round", "Sign"}  # torch.round rounds half to even, as ONNX does


def _unary_math(t: Any, op: NodeView, x: Any) -> Any:
    """The element-wise functions, with ONNX's attribute defaults."""
    a, f, kind = op.attrs, t.nn.functional, op.op_type
    if kind in _TORCH_SAME_NAME or kind in _TORCH_ROUNDING:
        return getattr(t, kind.lower())(x)
    if kind == "Gelu":
        return f.gelu(x, approximate=a.get("approximate", "none"))
    if kind == "Softplus":
        return f.softplus(x)
    if kind == "Softsign":
        return x / (1 + t.abs(x))
    if kind == "LeakyRelu":
        return f.leaky_relu(x, a.get("alpha", 0.01))
    if kind == "Elu":
        return f.elu(x, a.get("alpha", 1.0))
    if kind == "Selu":
        return a.get("gamma", SELU_GAMMA) * t.where(x > 0, x, a.get("alpha", SELU_ALPHA) * (t.exp(x) - 1))
    if kind == "Celu":
        return f.celu(x, a.get("alpha", 1.0))
    if kind == "HardSigmoid":
        return t.clamp(a.get("alpha", 0.2) * x + a.get("beta", 0.5), 0, 1)
    if kind == "HardSwish":
        return f.hardswish(x)
    if kind == "Mish":
        return f.mish(x)
    if kind == "ThresholdedRelu":
        return t.where(x > a.get("alpha", 1.0), x, t.zeros_like(x))
    if kind == "Shrink":  # x - bias above lambd, x + bias below -lambd, 0 between
        lambd, bias = a.get("lambd", 0.5), a.get("bias", 0.0)
        return t.where(x > lambd, x - bias, t.where(x < -lambd, x + bias, t.zeros_like(x)))
    if kind == "Not":
        return t.logical_not(x)
    if kind == "IsNaN":
        return t.isnan(x)
    if kind == "IsInf":
        positive = t.isposinf(x) if a.get("detect_positive", 1) else t.zeros_like(x, dtype=t.bool)
        return positive | (t.isneginf(x) if a.get("detect_negative", 1) else t.zeros_like(x, dtype=t.bool))
    if kind == "Identity":
        return x
    raise KeyError(kind)


def torch_unary(t: Any, op: NodeView, inputs: list[Any]) -> list[Any]:
    x = inputs[0]
    kind = op.op_type
    if kind in ("Cast", "CastLike"):
        target = getattr(t, TORCH_DTYPES[int(op.attrs["to"])]) if kind == "Cast" else tensors(t, inputs)[1].dtype
        if x.dtype == t.float64 and target.is_floating_point:
            return [x]  # verification runs in float64 (`runtime.verify.in_float64`): a narrower float only rounds
        return [x.to(target)]
    if kind == "Clip":  # bounds as attributes before opset 11, as optional inputs after
        low = op.attrs.get("min", as_float(inputs[1]) if len(inputs) > 1 and inputs[1] is not None else None)
        high = op.attrs.get("max", as_float(inputs[2]) if len(inputs) > 2 and inputs[2] is not None else None)
        if not x.is_floating_point():  # integer bounds keep an integer tensor integer
            low, high = (None if bound is None else int(bound) for bound in (low, high))
        return [t.clamp(x, low, high)]
    return [_unary_math(t, op, x)]


def dropout_kernel(mask: bool, typed_mask: bool = False) -> TorchKernel:
    """Dropout in inference (these graphs never train through ONNX's random mask): the identity.

    Its optional mask is all ``mask``: ones from opset 12; onnxruntime writes zeros before, in
    the input's type (``typed_mask``) before opset 10.
    """

    def torch_dropout(t: Any, op: NodeView, inputs: list[Any]) -> list[Any]:
        x = inputs[0]
        fill = t.ones_like if mask else t.zeros_like
        return [x, fill(x, dtype=x.dtype if typed_mask else t.bool)][: len([name for name in op.outputs if name])]

    return torch_dropout


def dropout_draws(op: OpNode, graph: Graph) -> bool:
    """Whether a Dropout draws a mask, which its backward keeps: from opset 12, where its training mode is true
    and its ratio (0.5 where not given) above 0; one computed in the graph counts as drawing. Before opset 12,
    ONNX's Dropout is inference's: the identity."""
    if op.op_type != "Dropout" or graph.opset < 12 or len(op.inputs) < 3 or not op.inputs[2]:
        return False
    training = graph.tensor(op.inputs[2]).value
    ratio = graph.tensor(op.inputs[1]).value if op.inputs[1] else np.float32(0.5)
    trains = training is None or bool(np.asarray(training).reshape(-1)[0])
    return trains and (ratio is None or float(np.asarray(ratio).reshape(-1)[0]) > 0)


def dropout_local(call: LocalCall) -> list[Any]:
    """Dropout on a rank's shards as inference runs it, the identity, as `dropout_kernel` and the verification's
    reference run it (`autopar.spmd.reference`): a mask onnxruntime drew on each rank would be that rank's own.
    The same for numpy arrays and torch tensors (torch's kernel is the identity already)."""
    inputs = list(call.inputs)
    if len(inputs) > 2 and inputs[2] is not None:
        inputs[2] = inputs[2] != inputs[2]  # its training mode, off (a boolean of its own kind)
    return call.run(inputs)


_TORCH_BINARY = {
    "Add": "add",
    "Sub": "sub",
    "Mul": "mul",
    "Pow": "pow",
    "Equal": "eq",
    "Less": "lt",
    "LessOrEqual": "le",
    "Greater": "gt",
    "GreaterOrEqual": "ge",
    "And": "logical_and",
    "Or": "logical_or",
    "Xor": "logical_xor",
}


def torch_broadcast(t: Any, op: NodeView, inputs: list[Any]) -> list[Any]:
    kind = op.op_type
    xs = [x for x in tensors(t, inputs) if x is not None]
    if kind in ("Sum", "Mean", "Max", "Min"):  # variadic
        out = xs[0]
        for x in xs[1:]:
            out = out + x if kind in ("Sum", "Mean") else t.maximum(out, x) if kind == "Max" else t.minimum(out, x)
        return [out / len(xs) if kind == "Mean" else out]
    a, b = xs[0], xs[1]
    if kind == "Div":
        return [a / b if a.is_floating_point() else t.div(a, b, rounding_mode="trunc")]
    if kind == "Mod":
        return [t.fmod(a, b) if int(op.attrs.get("fmod", 0)) else t.remainder(a, b)]
    if kind == "BitShift":
        shift = t.bitwise_left_shift if op.attrs.get("direction") == "LEFT" else t.bitwise_right_shift
        return [shift(a, b)]
    if kind == "Where":
        return [t.where(a.bool(), b, xs[2])]
    if kind == "PRelu":
        return [t.where(a < 0, a * b, a)]
    return [getattr(t, _TORCH_BINARY[kind])(a, b)]


def torch_expand(t: Any, op: NodeView, inputs: list[Any]) -> list[Any]:
    """Expand broadcasts both ways: the target may be smaller than the input in any dimension."""
    x = inputs[0]
    return [x.expand(*t.broadcast_shapes(tuple(x.shape), tuple(as_ints(inputs[1]))))]


register(*UNARY_KEEPS_OUTPUT, mindspore=UNARY_KEEPS_OUTPUT, keeps=Keeps.OUTPUTS, torch_kernel=torch_unary)(unary)
register(*UNARY_KEEPS_INPUT, mindspore=UNARY_KEEPS_INPUT, keeps=Keeps.INPUTS, torch_kernel=torch_unary)(unary)
register("Clip", mindspore=None, keeps=Keeps.INPUTS, config_inputs=frozenset({1, 2}), torch_kernel=torch_unary)(
    unary
)  # its bounds are not weights
register(*UNARY_KEEPS_NOTHING, mindspore=UNARY_KEEPS_NOTHING, keeps=Keeps.NOTHING, torch_kernel=torch_unary)(unary)
register("Identity", mindspore="ops.Identity", flops=no_flops, keeps=Keeps.NOTHING, torch_kernel=torch_unary)(unary)
# Dropout's ratio and training mode configure it; its mask is what the backward keeps (a byte an element, as
# torch's native_dropout keeps it, where it draws one: `dropout_draws`); never folded
_DROPOUT: dict[str, Any] = {
    "mindspore": MindSporePrimitive("ops.Dropout", 1),
    "keeps": Keeps.MASK,
    "config_inputs": frozenset({1, 2}),
    "foldable": False,
    "local_kernel": dropout_local,
    "torch_local_kernel": dropout_local,
}
register("Dropout", until=9, torch_kernel=dropout_kernel(False, typed_mask=True), **_DROPOUT)(unary)
register("Dropout", since=10, until=11, torch_kernel=dropout_kernel(False), **_DROPOUT)(unary)
register("Dropout", since=12, torch_kernel=dropout_kernel(True), **_DROPOUT)(unary)
register(
    *UNARY_NON_DIFFERENTIABLE,
    mindspore=UNARY_NON_DIFFERENTIABLE,
    differentiable=False,
    keeps=Keeps.NOTHING,
    torch_kernel=torch_unary,
)(unary)
register(
    *BROADCAST_KEEPS_NOTHING, mindspore=BROADCAST_KEEPS_NOTHING, keeps=Keeps.NOTHING, torch_kernel=torch_broadcast
)(broadcast)
register(*BROADCAST_KEEPS_INPUTS, mindspore=BROADCAST_KEEPS_INPUTS, keeps=Keeps.INPUTS, torch_kernel=torch_broadcast)(
    broadcast
)
register("PRelu", mindspore="ops.PReLU", keeps=Keeps.INPUTS, weight_inputs=True, torch_kernel=torch_broadcast)(
    broadcast
)  # its slope is learned, even a scalar one
register(
    *BROADCAST_KEEPS_OPERANDS, mindspore=BROADCAST_KEEPS_OPERANDS, keeps=Keeps.OPERANDS, torch_kernel=torch_broadcast
)(broadcast)
register(
    "Div",
    mindspore=MindSporePrimitive("ops.RealDiv", note="ops.Div for integers"),
    keeps=Keeps.OPERANDS | Keeps.DIVISOR,
    torch_kernel=torch_broadcast,
)(broadcast)  # d(a/b)/db = -a/b^2: b always, a for b's gradient
register("Where", mindspore="ops.Select", keeps=Keeps.SELECTORS, torch_kernel=torch_broadcast)(broadcast)
register("Pow", mindspore="ops.Pow", keeps=Keeps.INPUTS, config_inputs=frozenset({1}), torch_kernel=torch_broadcast)(
    broadcast
)  # a scalar exponent
register(
    *BROADCAST_NON_DIFFERENTIABLE,
    mindspore=BROADCAST_NON_DIFFERENTIABLE,
    differentiable=False,
    keeps=Keeps.NOTHING,
    torch_kernel=torch_broadcast,
)(broadcast)


@register(
    "Expand",
    mindspore=MindSporePrimitive("ops.BroadcastTo", 1, needs_args=True),
    keeps=Keeps.NOTHING,
    local_kernel=local_target_shape,
    torch_kernel=torch_expand,
    torch_local_kernel=local_target_shape,
)
def expand(op: NodeView, graph: GraphView) -> OpSpec:
    """Expand to the output shape; a rank's target shape is its local output shape."""
    out_shape = shape(graph, op.outputs[0])
    return OpSpec(
        inputs=(broadcast_labels(shape(graph, op.inputs[0]), out_shape), None), outputs=(dim_labels(len(out_shape)),)
    )


# --- the operator alone in tiny models, checked by the operator tests (`autopar.ops.cases`) -----

CASES = named(
    both={"shrink": one("Shrink", ["X"], [("X", F, [4, 8])], lambd=0.3, bias=0.1)},
    kernel={
        "relu": one("Relu", ["X"], X2, opset=18),
        "exp": one("Exp", ["X"], X2, opset=18),
        "sigmoid": one("Sigmoid", ["X"], X2, opset=18),
        "tanh": one("Tanh", ["X"], X2, opset=18),
        "sqrt": one("Sqrt", ["X"], X2, opset=18),
        "reciprocal": one("Reciprocal", ["X"], X2, opset=18),
        "log": one("Log", ["X"], X2, opset=18),
        "abs": one("Abs", ["X"], X2, opset=18),
        "erf": one("Erf", ["X"], X2, opset=18),
        "softplus": one("Softplus", ["X"], X2, opset=18),
        "softsign": one("Softsign", ["X"], X2, opset=18),
        "sin": one("Sin", ["X"], X2, opset=18),
        "cos": one("Cos", ["X"], X2, opset=18),
        "neg": one("Neg", ["X"], X2, opset=18),
        "floor": one("Floor", ["X"], X2, opset=18),
        "ceil": one("Ceil", ["X"], X2, opset=18),
        "round": one("Round", ["X"], X2, opset=18),
        "sign": one("Sign", ["X"], X2, opset=18),
        "identity": one("Identity", ["X"], X2, opset=18),
        "hardswish": one("HardSwish", ["X"], X2, opset=18),
        "mish": one("Mish", ["X"], X2, opset=18),
        "isnan": one("IsNaN", ["X"], X2, opset=18),
        "isinf": one("IsInf", ["X"], X2, opset=18),
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
        "clip_inputs": one(
            "Clip", ["X", "lo", "hi"], X2, [const("lo", -0.5, np.float32), const("hi", 0.5, np.float32)]
        ),
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
        "mod": one("Mod", ["X", "d"], [("X", I64, [2, 4])], [const("d", [3, -3, 2, -5])]),
        "fmod": one("Mod", ["X", "d"], X2, [const("d", [0.7, -0.4, 1.5, 2.0], np.float32)], fmod=1),
        "bit_shift_left": one(
            "BitShift", ["X", "s"], [("X", U8, [2, 4])], [const("s", [1, 2, 3, 0], np.uint8)], direction="LEFT"
        ),
        "bit_shift_right": one(
            "BitShift", ["X", "s"], [("X", U8, [2, 4])], [const("s", [1, 0, 1, 0], np.uint8)], direction="RIGHT"
        ),
        "expand": one("Expand", ["X", "s"], [("X", F, [3, 1])], [const("s", [2, 1, 4])]),
        "equal": one("Equal", ["X", "Z"], XZ),
        "less": one("Less", ["X", "Z"], XZ),
        "lessorequal": one("LessOrEqual", ["X", "Z"], XZ),
        "greater": one("Greater", ["X", "Z"], XZ),
        "greaterorequal": one("GreaterOrEqual", ["X", "Z"], XZ),
        "and": one("And", ["A", "Z"], BOOLS),
        "or": one("Or", ["A", "Z"], BOOLS),
        "xor": one("Xor", ["A", "Z"], BOOLS),
    },
    strategies={
        "expand": one("Expand", ["X", "s"], [("X", F, [4, 1, 8])], consts=[ints("s", [2, 4, 4, 8])]),
        "gelu": one("Gelu", ["X"], [("X", F, [4, 8])], opset=20),
        "erf": one("Erf", ["X"], [("X", F, [4, 8])]),
        "tanh": one("Tanh", ["X"], [("X", F, [4, 8])]),
        "sigmoid": one("Sigmoid", ["X"], [("X", F, [4, 8])]),
        "pow": one("Pow", ["X", "two"], [("X", F, [4, 8])], consts=[floats("two", 2.0)]),
        "where": one("Where", ["c", "X", "Z"], [("c", B, [1, 8]), ("X", F, [4, 8]), ("Z", F, [4, 1])]),
        "clip": one("Clip", ["X", "lo", "hi"], [("X", F, [4, 8])], consts=[floats("lo", -0.5), floats("hi", 0.5)]),
        "sqrt_abs": one("Sqrt", ["A"], [("X", F, [4, 8])], before=[node("Abs", ["X"], ["A"], "abs")]),
        "equal_and_not": one(
            "And",
            ["n", "c"],
            [("a", I64, [4, 8]), ("b", I64, [4, 8]), ("c", B, [4, 8])],
            before=[node("Equal", ["a", "b"], ["e"], "eq"), node("Not", ["e"], ["n"], "not")],
        ),
        "dropout_cast": one(
            "Cast", ["d"], [("X", F, [4, 8])], before=[node("Dropout", ["X"], ["d"], "drop")], to=TensorProto.DOUBLE
        ),
        "max_min": one(
            "Min", ["m", "X"], [("X", F, [4, 8]), ("Z", F, [8])], before=[node("Max", ["X", "Z"], ["m"], "max")]
        ),
    },
)
