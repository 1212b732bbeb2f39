"""Convolution: split the batch (n), output channels (o) and input channels (c, partial sums).

Spatial dimensions stay whole: splitting them needs halo exchanges, which this rule leaves out.
Grouped convolutions split only the batch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from autopar.ops.base import OpSpec, no_split, shape
from autopar.ops.registry import Keeps, declare, register

if TYPE_CHECKING:
    from autopar.graph.types import Graph, OpNode


def conv_flops(
    in_shapes: Sequence[Sequence[int] | None], out_shapes: Sequence[Sequence[int]], attrs: Mapping[str, Any]
) -> float:
    """Two FLOPs per multiply-add over (C/groups) x kh x kw per output element, plus the bias."""
    weight = in_shapes[1] or ()
    out = math.prod(out_shapes[0])
    flops = 2.0 * out * math.prod(weight[1:])
    if len(in_shapes) > 2 and in_shapes[2]:
        flops += out
    return flops


@register("Conv", flops=conv_flops, keeps=Keeps.OPERANDS, weight_inputs=True)
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


declare("ConvTranspose", keeps=Keeps.OPERANDS, weight_inputs=True)
