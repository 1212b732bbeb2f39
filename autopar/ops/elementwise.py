"""Element-wise operators: every dimension of the output may be split; broadcast dimensions follow.

Unary operators may carry configuration inputs (Clip's bounds, Dropout's ratio): those are
scalars every rank holds whole. Expand is a broadcast too: the dimensions it creates or
stretches from size 1 carry no label on the input.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from autopar.ops.base import OpSpec, broadcast_labels, dim_labels, shape
from autopar.ops.registry import Keeps, no_flops, register
from autopar.ops.shape import local_target_shape

if TYPE_CHECKING:
    from autopar.graph.types import Graph, OpNode

# What each backward needs: y' from the output (Relu, Exp, Sigmoid, Tanh, Sqrt, Reciprocal),
# from the input (Log, Erf, Gelu, ...), or nothing (Add, Neg, Cast). A product keeps each factor
# for the other's gradient (Mul by a constant keeps nothing); a quotient always keeps its divisor
# and, for the divisor's gradient, its numerator; Where keeps only its condition; Max and Min
# keep both to know which one won.
UNARY_KEEPS_OUTPUT = ("Relu", "Exp", "Sigmoid", "Tanh", "Sqrt", "Reciprocal")
UNARY_KEEPS_INPUT = (
    "Log",
    "Abs",
    "Erf",
    "Gelu",
    "Softplus",
    "Softsign",
    "LeakyRelu",
    "Elu",
    "Selu",
    "Celu",
    "HardSigmoid",
    "HardSwish",
    "Mish",
    "ThresholdedRelu",
    "Sin",
    "Cos",
)
UNARY_KEEPS_NOTHING = ("Neg", "Cast", "CastLike")
UNARY_NON_DIFFERENTIABLE = ("Not", "Floor", "Ceil", "Round", "Sign", "IsNaN", "IsInf")
BROADCAST_KEEPS_NOTHING = ("Add", "Sub", "Sum", "Mean")
BROADCAST_KEEPS_INPUTS = ("Max", "Min")
BROADCAST_KEEPS_OPERANDS = ("Mul",)
BROADCAST_NON_DIFFERENTIABLE = (
    "Equal",
    "Less",
    "LessOrEqual",
    "Greater",
    "GreaterOrEqual",
    "And",
    "Or",
    "Xor",
    "Mod",
    "BitShift",
)


def unary(op: OpNode, graph: Graph) -> OpSpec:
    rank = len(shape(graph, op.outputs[0]))
    labels = dim_labels(rank)
    if op.op_type == "CastLike":  # the second input only names a type
        inputs: tuple = (labels, None)
    else:
        inputs = (labels,) + tuple(None for _ in op.inputs[1:])
    outputs = tuple(labels if name else () for name in op.outputs)  # Dropout's mask follows its output
    return OpSpec(inputs=inputs, outputs=outputs)


def broadcast(op: OpNode, graph: Graph) -> OpSpec:
    out_shape = shape(graph, op.outputs[0])
    inputs = tuple(broadcast_labels(shape(graph, name), out_shape) if name else None for name in op.inputs)
    return OpSpec(inputs=inputs, outputs=(dim_labels(len(out_shape)),))


register(*UNARY_KEEPS_OUTPUT, keeps=Keeps.OUTPUTS)(unary)
register(*UNARY_KEEPS_INPUT, keeps=Keeps.INPUTS)(unary)
register("Clip", keeps=Keeps.INPUTS, config_inputs=frozenset({1, 2}))(unary)  # its bounds are not weights
register(*UNARY_KEEPS_NOTHING, keeps=Keeps.NOTHING)(unary)
register("Identity", flops=no_flops, keeps=Keeps.NOTHING)(unary)
# Dropout's ratio and training mode configure it; its mask is what the backward keeps; never folded
register("Dropout", keeps=Keeps.OUTPUTS, config_inputs=frozenset({1, 2}), foldable=False)(unary)
register(*UNARY_NON_DIFFERENTIABLE, differentiable=False, keeps=Keeps.NOTHING)(unary)
register(*BROADCAST_KEEPS_NOTHING, keeps=Keeps.NOTHING)(broadcast)
register(*BROADCAST_KEEPS_INPUTS, keeps=Keeps.INPUTS)(broadcast)
register("PRelu", keeps=Keeps.INPUTS, weight_inputs=True)(broadcast)  # its slope is learned, even a scalar one
register(*BROADCAST_KEEPS_OPERANDS, keeps=Keeps.OPERANDS)(broadcast)
register("Div", keeps=Keeps.OPERANDS | Keeps.DIVISOR)(broadcast)  # d(a/b)/db = -a/b^2: b always, a for b's gradient
register("Where", keeps=Keeps.SELECTORS)(broadcast)
register("Pow", keeps=Keeps.INPUTS, config_inputs=frozenset({1}))(broadcast)  # a scalar exponent
register(*BROADCAST_NON_DIFFERENTIABLE, differentiable=False, keeps=Keeps.NOTHING)(broadcast)


@register("Expand", keeps=Keeps.NOTHING, local_kernel=local_target_shape)
def expand(op: OpNode, graph: Graph) -> OpSpec:
    """Expand to the output shape; a rank's target shape is its local output shape."""
    out_shape = shape(graph, op.outputs[0])
    return OpSpec(
        inputs=(broadcast_labels(shape(graph, op.inputs[0]), out_shape), None), outputs=(dim_labels(len(out_shape)),)
    )
