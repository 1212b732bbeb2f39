"""Convolution: split the batch (n), output channels (o) and input channels (c, partial sums).

Spatial dimensions stay whole: splitting them needs halo exchanges, which this rule leaves out.
Grouped convolutions split only the batch.
"""

from __future__ import annotations

from autopar.graph import Graph, OpNode
from autopar.ops.base import OpSpec, no_split, rule, shape


@rule("Conv")
def conv(op: OpNode, graph: Graph) -> OpSpec:
    x_rank = len(shape(graph, op.inputs[0]))
    spatial = x_rank - 2
    grouped = int(op.attrs.get("group", 1)) != 1
    channel = None if grouped else "c"
    out_channel = None if grouped else "o"
    x = ("n", channel) + no_split(spatial)
    w = (out_channel, channel) + no_split(spatial)
    inputs: list = [x, w]
    if len(op.inputs) > 2 and op.inputs[2]:
        inputs.append((out_channel,))
    y = ("n", out_channel) + no_split(spatial)
    return OpSpec(inputs=tuple(inputs), outputs=(y,), op_class="cube", local_once_inputs=(2,))
