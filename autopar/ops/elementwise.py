"""Element-wise operators: every dimension of the output may be split; broadcast dimensions follow.

Unary operators may carry configuration inputs (Clip's bounds, Dropout's ratio): those are
scalars every rank holds whole. Expand is a broadcast too: the dimensions it creates or
stretches from size 1 carry no label on the input.
"""

from __future__ import annotations

from autopar.graph import Graph, OpNode
from autopar.ops.base import OpSpec, broadcast_labels, dim_labels, rule, shape

UNARY = ("Relu", "Exp", "Log", "Neg", "Identity", "Cast", "CastLike", "Sqrt", "Reciprocal", "Abs", "Sigmoid",
         "Tanh", "Erf", "Gelu", "Softplus", "Softsign", "LeakyRelu", "Elu", "Selu", "Celu", "HardSigmoid",
         "HardSwish", "Mish", "ThresholdedRelu", "Floor", "Ceil", "Round", "Not", "Sign", "IsNaN", "IsInf",
         "Sin", "Cos", "Clip", "Dropout")
BROADCAST = ("Add", "Sub", "Mul", "Div", "Sum", "Max", "Min", "Mean", "Pow", "Mod", "Equal", "Less", "LessOrEqual",
             "Greater", "GreaterOrEqual", "And", "Or", "Xor", "Where", "PRelu", "BitShift")
NON_DIFFERENTIABLE = {"Not", "Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "And", "Or", "Xor",
                      "Floor", "Ceil", "Round", "Sign", "IsNaN", "IsInf", "Mod", "BitShift"}


@rule(*UNARY)
def unary(op: OpNode, graph: Graph) -> OpSpec:
    rank = len(shape(graph, op.outputs[0]))
    labels = dim_labels(rank)
    if op.op_type == "CastLike":  # the second input only names a type
        inputs: tuple = (labels, None)
    else:
        inputs = (labels,) + tuple(None for _ in op.inputs[1:])
    outputs = tuple(labels if name else () for name in op.outputs)  # Dropout's mask follows its output
    return OpSpec(inputs=inputs, outputs=outputs, differentiable=op.op_type not in NON_DIFFERENTIABLE)


@rule(*BROADCAST)
def broadcast(op: OpNode, graph: Graph) -> OpSpec:
    out_shape = shape(graph, op.outputs[0])
    inputs = tuple(broadcast_labels(shape(graph, name), out_shape) if name else None for name in op.inputs)
    return OpSpec(inputs=inputs, outputs=(dim_labels(len(out_shape)),),
                  differentiable=op.op_type not in NON_DIFFERENTIABLE)


@rule("Expand")
def expand(op: OpNode, graph: Graph) -> OpSpec:
    """Expand to the output shape; a rank's target shape is its local output shape."""
    out_shape = shape(graph, op.outputs[0])
    return OpSpec(inputs=(broadcast_labels(shape(graph, op.inputs[0]), out_shape), None),
                  outputs=(dim_labels(len(out_shape)),))
