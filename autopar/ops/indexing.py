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

from typing import TYPE_CHECKING

import numpy as np

from autopar.layout import shard_index
from autopar.ops.base import OpSpec, dim_labels, normalize_axis, shape
from autopar.ops.registry import Keeps, LocalCall, register

if TYPE_CHECKING:
    from autopar.graph.types import Graph, OpNode

GATHERED = "g"
CLASSES = "cls"


def _one_hot_local(call: LocalCall) -> list[np.ndarray]:
    """OneHot on a rank's slice of the class axis: ones where (index - first class) falls in range."""
    indices = np.asarray(call.inputs[0]).astype(np.int64)
    depth = int(np.asarray(call.inputs[1]).reshape(-1)[0])
    values = np.asarray(call.inputs[2])
    off_value, on_value = values.reshape(-1)[:2]
    axis = call.spec.outputs[0].index(CLASSES)
    bits = call.bits[CLASSES]
    local_depth = depth >> len(bits)
    indices = np.where(indices < 0, indices + depth, indices) - shard_index(call.rank, bits) * local_depth
    classes = np.arange(local_depth).reshape([-1 if d == axis else 1 for d in range(indices.ndim + 1)])
    hot = np.expand_dims(indices, axis) == classes
    return [np.where(hot, on_value, off_value).astype(values.dtype)]


def _one_hot_depth(op: OpNode, graph: Graph) -> int | None:
    depth = graph.tensor(op.inputs[1]).value
    return None if depth is None else int(np.asarray(depth).reshape(-1)[0])


def _gathered_axis_size(op: OpNode, graph: Graph) -> int:
    data_shape = graph.tensor(op.inputs[0]).shape
    return data_shape[int(op.attrs.get("axis", 0)) % len(data_shape)]


def _gather_local(call: LocalCall) -> list[np.ndarray]:
    """Gather from a rank's rows of a split gathered axis; indices outside them give zeros."""
    bits = call.bits.get(GATHERED, ())
    if not bits:
        return call.run(call.inputs)
    data = np.asarray(call.inputs[0])
    indices = np.asarray(call.inputs[1]).astype(np.int64)
    labels = call.spec.inputs[0] or ()
    axis = labels.index(GATHERED)
    full = call.graph.tensor(call.op.inputs[0]).shape[axis]
    local = data.shape[axis]
    indices = np.where(indices < 0, indices + full, indices) - shard_index(call.rank, bits) * local
    held = (indices >= 0) & (indices < local)
    picked = np.take(data, np.where(held, indices, 0), axis=axis)
    mask = held.reshape((1,) * axis + held.shape + (1,) * (data.ndim - axis - 1))
    return [np.where(mask, picked, np.zeros((), dtype=data.dtype))]


@register(
    "OneHot",
    differentiable=False,
    keeps=Keeps.NOTHING,
    local_kernel=_one_hot_local,
    index_bounds={0: _one_hot_depth},
    config_inputs=frozenset({1, 2}),
)
def one_hot(op: OpNode, graph: Graph) -> OpSpec:
    indices = dim_labels(len(shape(graph, op.inputs[0])))
    out_rank = len(indices) + 1
    axis = normalize_axis(int(op.attrs.get("axis", -1)), out_rank)
    out = indices[:axis] + (CLASSES,) + indices[axis:]
    inputs = (indices, None, None)
    strategy = (out, None, None)
    return OpSpec(inputs=inputs, outputs=(out,), strategy_labels=strategy)


@register("Gather", keeps=Keeps.SELECTORS, local_kernel=_gather_local, index_bounds={1: _gathered_axis_size})
def gather(op: OpNode, graph: Graph) -> OpSpec:
    data_rank = len(shape(graph, op.inputs[0]))
    axis = normalize_axis(int(op.attrs.get("axis", 0)), data_rank)
    data = tuple(GATHERED if d == axis else f"d{d}" for d in range(data_rank))
    indices = dim_labels(len(shape(graph, op.inputs[1])), prefix="i")
    out = data[:axis] + indices + data[axis + 1 :]
    return OpSpec(inputs=(data, indices), outputs=(out,))


@register("GatherElements", keeps=Keeps.SELECTORS, index_bounds={1: _gathered_axis_size})
def gather_elements(op: OpNode, graph: Graph) -> OpSpec:
    data_shape = shape(graph, op.inputs[0])
    index_shape = shape(graph, op.inputs[1])
    axis = normalize_axis(int(op.attrs.get("axis", 0)), len(data_shape))
    labels = tuple(None if d == axis or data_shape[d] != index_shape[d] else f"d{d}" for d in range(len(data_shape)))
    return OpSpec(inputs=(labels, labels), outputs=(labels,))
