"""Pooling: batch and channels split freely; windows stay whole; global pools reduce space locally."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from autopar.ops.base import OpSpec, no_split, shape
from autopar.ops.registry import Keeps, input_elements, register

if TYPE_CHECKING:
    from autopar.graph.types import Graph, OpNode


def window_flops(
    in_shapes: Sequence[Sequence[int] | None], out_shapes: Sequence[Sequence[int]], attrs: Mapping[str, Any]
) -> float:
    """One operation per window element per output element."""
    return float(math.prod(out_shapes[0]) * math.prod(attrs.get("kernel_shape", [1])))


def pool(op: OpNode, graph: Graph) -> OpSpec:
    rank = len(shape(graph, op.inputs[0]))
    channel = None if op.op_type == "LRN" else "c"  # LRN mixes neighbouring channels
    labels = ("n", channel) + no_split(rank - 2)
    outputs = tuple(labels if name else () for name in op.outputs)
    return OpSpec(inputs=(labels,), outputs=outputs)


register("MaxPool", flops=window_flops, keeps=Keeps.INPUTS | Keeps.OUTPUTS)(pool)  # the argmax of each window
register("AveragePool", flops=window_flops, keeps=Keeps.NOTHING)(pool)
register("GlobalAveragePool", flops=input_elements, keeps=Keeps.NOTHING)(pool)
register("GlobalMaxPool", flops=input_elements, keeps=Keeps.INPUTS | Keeps.OUTPUTS)(pool)
register("LpPool", "LRN", keeps=Keeps.INPUTS | Keeps.OUTPUTS)(pool)
