"""Element-wise operators: every dimension of the output may be split; broadcast dimensions follow."""

from __future__ import annotations

from autopar.graph import Graph, OpNode
from autopar.ops.base import OpSpec, broadcast_labels, dim_labels, rule, shape

UNARY = ("Relu", "Exp", "Log", "Neg", "Identity", "Cast", "Sqrt", "Reciprocal", "Abs", "Sigmoid", "Tanh",
         "Erf", "Softplus", "LeakyRelu", "Elu", "Selu", "HardSigmoid", "Floor", "Ceil", "Not", "Sign")
BROADCAST = ("Add", "Sub", "Mul", "Div", "Sum", "Max", "Min", "Mean", "Pow", "Equal", "Less", "Greater",
             "And", "Or", "Where", "PRelu")
NON_DIFFERENTIABLE = {"Not", "Equal", "Less", "Greater", "And", "Or", "Floor", "Ceil", "Sign"}


@rule(*UNARY)
def unary(op: OpNode, graph: Graph) -> OpSpec:
    rank = len(shape(graph, op.outputs[0]))
    labels = dim_labels(rank)
    return OpSpec(inputs=(labels,), outputs=(labels,), differentiable=op.op_type not in NON_DIFFERENTIABLE)


@rule(*BROADCAST)
def broadcast(op: OpNode, graph: Graph) -> OpSpec:
    out_shape = shape(graph, op.outputs[0])
    inputs = tuple(broadcast_labels(shape(graph, name), out_shape) if name else None for name in op.inputs)
    return OpSpec(inputs=inputs, outputs=(dim_labels(len(out_shape)),),
                  differentiable=op.op_type not in NON_DIFFERENTIABLE)
