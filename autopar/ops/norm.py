"""Normalisations: BatchNormalization, InstanceNormalization, LayerNormalization, Softmax family.

BatchNormalization with running statistics (ONNX inference form) is a per-channel affine map:
every dimension may be split and the per-channel parameters follow the channel split.
(Training frameworks compute batch statistics per device in data parallel, as MindSpore does
without SyncBatchNorm; the graph's semantics here are the ONNX ones.)

The others normalise over some axes: those stay whole on each rank (splitting them would need
a cross-device reduction inside the operator); the remaining axes split freely.
"""

from __future__ import annotations

from autopar.graph import Graph, OpNode
from autopar.ops.base import OpSpec, dim_labels, normalize_axis, opset_version, rule, shape


@rule("BatchNormalization")
def batch_norm(op: OpNode, graph: Graph) -> OpSpec:
    rank = len(shape(graph, op.inputs[0]))
    x = dim_labels(rank)
    channel = (x[1],)
    inputs = (x,) + tuple(channel if name else None for name in op.inputs[1:])
    outputs = (x,) + tuple(channel for name in op.outputs[1:] if name)
    return OpSpec(inputs=inputs, outputs=outputs)


@rule("InstanceNormalization")
def instance_norm(op: OpNode, graph: Graph) -> OpSpec:
    rank = len(shape(graph, op.inputs[0]))
    x = ("d0", "d1") + tuple(None for _ in range(rank - 2))
    return OpSpec(inputs=(x, ("d1",), ("d1",)), outputs=(x,))


@rule("LayerNormalization")
def layer_norm(op: OpNode, graph: Graph) -> OpSpec:
    """Leading axes split; the normalised axes (from ``axis`` on), scale and bias stay whole."""
    rank = len(shape(graph, op.inputs[0]))
    axis = normalize_axis(int(op.attrs.get("axis", -1)), rank)
    x = tuple(f"d{d}" if d < axis else None for d in range(rank))
    inputs = (x,) + tuple(tuple(None for _ in shape(graph, name)) if name else None for name in op.inputs[1:])
    statistics = x[:axis] + tuple(None for _ in range(rank - axis))  # Mean and InvStdDev keep size-1 axes
    outputs = tuple(() if not name else x if position == 0 else statistics
                    for position, name in enumerate(op.outputs))
    return OpSpec(inputs=inputs, outputs=outputs)


@rule("Softmax", "LogSoftmax", "Hardmax")
def softmax(op: OpNode, graph: Graph) -> OpSpec:
    """Opset 13 normalises one axis; older opsets flatten every axis from ``axis`` on into one."""
    rank = len(shape(graph, op.inputs[0]))
    modern = opset_version(graph) >= 13
    axis = normalize_axis(int(op.attrs.get("axis", -1 if modern else 1)), rank)
    whole = {axis} if modern else set(range(axis, rank))
    labels = tuple(None if d in whole else f"d{d}" for d in range(rank))
    return OpSpec(inputs=(labels,), outputs=(labels,), differentiable=op.op_type != "Hardmax")
