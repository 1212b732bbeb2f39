"""Pooling: batch and channels split freely; windows stay whole; global pools reduce space locally."""

from __future__ import annotations

from autopar.graph import Graph, OpNode
from autopar.ops.base import OpSpec, no_split, rule, shape


@rule("MaxPool", "AveragePool", "LpPool", "GlobalAveragePool", "GlobalMaxPool", "LRN")
def pool(op: OpNode, graph: Graph) -> OpSpec:
    rank = len(shape(graph, op.inputs[0]))
    channel = None if op.op_type == "LRN" else "c"  # LRN mixes neighbouring channels
    labels = ("n", channel) + no_split(rank - 2)
    outputs = tuple(labels if name else () for name in op.outputs)
    return OpSpec(inputs=(labels,), outputs=outputs)
