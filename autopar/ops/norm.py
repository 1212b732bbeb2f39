"""BatchNormalization with running statistics (ONNX inference form): a per-channel affine map.

Every dimension may be split; the per-channel parameters follow the channel split. (Training
frameworks compute batch statistics per device in data parallel, as MindSpore does without
SyncBatchNorm; the graph's semantics here are the ONNX ones.)
"""

from __future__ import annotations

from autopar.graph import Graph, OpNode
from autopar.ops.base import OpSpec, dim_labels, rule, shape


@rule("BatchNormalization")
def batch_norm(op: OpNode, graph: Graph) -> OpSpec:
    rank = len(shape(graph, op.inputs[0]))
    x = dim_labels(rank)
    channel = (x[1],)
    inputs = (x,) + tuple(channel if name else None for name in op.inputs[1:])
    outputs = (x,) + tuple(channel for name in op.outputs[1:] if name)
    return OpSpec(inputs=inputs, outputs=outputs)
