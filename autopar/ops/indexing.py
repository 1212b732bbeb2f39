"""Indexing operators: OneHot, Gather, GatherElements.

OneHot splits the indices' dimensions and the new class dimension. A rank holding classes
[c0, c0 + depth/f) writes ones where ``index - c0`` falls in its range. The strategy names the
output's dimensions first, as MindSpore's OneHot strategy does.

Gather may split the gathered axis too (an embedding table split by vocabulary rows): a rank
looks up only the rows it holds and writes zeros for the others, so the output is a partial
sum across the split, exactly one rank contributing each row (Megatron's vocab-parallel
embedding).
"""

from __future__ import annotations

from autopar.graph import Graph, OpNode
from autopar.ops.base import OpSpec, dim_labels, normalize_axis, rule, shape

GATHERED = "g"


@rule("OneHot")
def one_hot(op: OpNode, graph: Graph) -> OpSpec:
    indices = dim_labels(len(shape(graph, op.inputs[0])))
    out_rank = len(indices) + 1
    axis = normalize_axis(int(op.attrs.get("axis", -1)), out_rank)
    out = indices[:axis] + ("cls",) + indices[axis:]
    inputs = (indices, None, None)
    strategy = (out, None, None)
    return OpSpec(inputs=inputs, outputs=(out,), strategy_labels=strategy, differentiable=False)


@rule("Gather")
def gather(op: OpNode, graph: Graph) -> OpSpec:
    data_rank = len(shape(graph, op.inputs[0]))
    axis = normalize_axis(int(op.attrs.get("axis", 0)), data_rank)
    data = tuple(GATHERED if d == axis else f"d{d}" for d in range(data_rank))
    indices = dim_labels(len(shape(graph, op.inputs[1])), prefix="i")
    out = data[:axis] + indices + data[axis + 1:]
    return OpSpec(inputs=(data, indices), outputs=(out,))


@rule("GatherElements")
def gather_elements(op: OpNode, graph: Graph) -> OpSpec:
    data_shape = shape(graph, op.inputs[0])
    index_shape = shape(graph, op.inputs[1])
    axis = normalize_axis(int(op.attrs.get("axis", 0)), len(data_shape))
    labels = tuple(None if d == axis or data_shape[d] != index_shape[d] else f"d{d}" for d in range(len(data_shape)))
    return OpSpec(inputs=(labels, labels), outputs=(labels,))
