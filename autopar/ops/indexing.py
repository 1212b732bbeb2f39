"""OneHot: split the indices' dimensions and the new class dimension.

A rank holding classes [c0, c0 + depth/f) writes ones where ``index - c0`` falls in its range.
The strategy names the output's dimensions first, as MindSpore's OneHot strategy does.
"""

from __future__ import annotations

from autopar.graph import Graph, OpNode
from autopar.ops.base import OpSpec, dim_labels, normalize_axis, rule, shape


@rule("OneHot")
def one_hot(op: OpNode, graph: Graph) -> OpSpec:
    indices = dim_labels(len(shape(graph, op.inputs[0])))
    out_rank = len(indices) + 1
    axis = normalize_axis(int(op.attrs.get("axis", -1)), out_rank)
    out = indices[:axis] + ("cls",) + indices[axis:]
    inputs = (indices, None, None)
    strategy = (out, None, None)
    return OpSpec(inputs=inputs, outputs=(out,), strategy_labels=strategy, differentiable=False)
