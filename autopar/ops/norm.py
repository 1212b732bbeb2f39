"""Normalisations: BatchNormalization, InstanceNormalization, LayerNormalization, Softmax family.

BatchNormalization with running statistics (ONNX inference form) is a per-channel affine map:
every dimension may be split and the per-channel parameters follow the channel split.
(Training frameworks compute batch statistics per device in data parallel, as MindSpore does
without SyncBatchNorm; the graph's semantics here are the ONNX ones.)

The others normalise over some axes: those stay whole on each rank (splitting them would need
a cross-device reduction inside the operator); the remaining axes split freely.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from autopar.ops.base import OpSpec, dim_labels, normalize_axis, shape
from autopar.ops.registry import Keeps, register

if TYPE_CHECKING:
    from autopar.graph.types import Graph, OpNode


def batch_norm_flops(
    in_shapes: Sequence[Sequence[int] | None], out_shapes: Sequence[Sequence[int]], attrs: Mapping[str, Any]
) -> float:
    """Normalise, then scale and shift: about four element-wise operations per output element."""
    return 4.0 * math.prod(out_shapes[0])


# scale (1) and running variance (4) are drawn positive for verification; the running mean and
# variance (3, 4) are statistics, stored like parameters but never trained
@register(
    "BatchNormalization",
    flops=batch_norm_flops,
    keeps=Keeps.INPUTS,
    weight_inputs=True,
    statistics_inputs=frozenset({3, 4}),
    positive_inputs=frozenset({1, 4}),
)
def batch_norm(op: OpNode, graph: Graph) -> OpSpec:
    rank = len(shape(graph, op.inputs[0]))
    x = dim_labels(rank)
    channel = (x[1],)
    inputs = (x,) + tuple(channel if name else None for name in op.inputs[1:])
    outputs = (x,) + tuple(channel for name in op.outputs[1:] if name)
    return OpSpec(inputs=inputs, outputs=outputs)


@register("InstanceNormalization", keeps=Keeps.INPUTS | Keeps.STATISTICS)
def instance_norm(op: OpNode, graph: Graph) -> OpSpec:
    rank = len(shape(graph, op.inputs[0]))
    x = ("d0", "d1") + tuple(None for _ in range(rank - 2))
    return OpSpec(inputs=(x, ("d1",), ("d1",)), outputs=(x,))


@register("LayerNormalization", keeps=Keeps.INPUTS | Keeps.STATISTICS, weight_inputs=True)
def layer_norm(op: OpNode, graph: Graph) -> OpSpec:
    """Leading axes split; the normalised axes (from ``axis`` on), scale and bias stay whole."""
    rank = len(shape(graph, op.inputs[0]))
    axis = normalize_axis(int(op.attrs.get("axis", -1)), rank)
    x = tuple(f"d{d}" if d < axis else None for d in range(rank))
    inputs = (x,) + tuple(tuple(None for _ in shape(graph, name)) if name else None for name in op.inputs[1:])
    statistics = x[:axis] + tuple(None for _ in range(rank - axis))  # Mean and InvStdDev keep size-1 axes
    outputs = tuple(() if not name else x if position == 0 else statistics for position, name in enumerate(op.outputs))
    return OpSpec(inputs=inputs, outputs=outputs)


def _softmax(op: OpNode, graph: Graph, axis: int, whole: set[int]) -> OpSpec:
    rank = len(shape(graph, op.inputs[0]))
    labels = tuple(None if d in whole else f"d{d}" for d in range(rank))
    return OpSpec(inputs=(labels,), outputs=(labels,))


@register("Softmax", "LogSoftmax", since=13, keeps=Keeps.OUTPUTS)
@register("Hardmax", since=13, differentiable=False, keeps=Keeps.NOTHING)
def softmax(op: OpNode, graph: Graph) -> OpSpec:
    """Opset 13 on: one axis (default the last) is normalised; the others split."""
    rank = len(shape(graph, op.inputs[0]))
    axis = normalize_axis(int(op.attrs.get("axis", -1)), rank)
    return _softmax(op, graph, axis, {axis})


@register("Softmax", "LogSoftmax", until=12, keeps=Keeps.OUTPUTS)
@register("Hardmax", until=12, differentiable=False, keeps=Keeps.NOTHING)
def softmax_flattened(op: OpNode, graph: Graph) -> OpSpec:
    """Before opset 13: every axis from ``axis`` (default 1) on is flattened into one and normalised."""
    rank = len(shape(graph, op.inputs[0]))
    axis = normalize_axis(int(op.attrs.get("axis", 1)), rank)
    return _softmax(op, graph, axis, set(range(axis, rank)))
