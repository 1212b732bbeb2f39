"""Data-movement operators: Transpose, Concat, Split, Slice, Pad, Tile.

Transpose carries every label to its new position. The others touch one set of axes (the
concatenated, split, sliced, padded or tiled ones): those stay whole, because a rank's shard
of them would not line up with the operator's offsets; every other axis may be split.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from autopar.ops.base import OpSpec, constant_ints, dim_labels, normalize_axis, shape
from autopar.ops.registry import Keeps, register

if TYPE_CHECKING:
    from autopar.graph.types import Graph, OpNode


def _except_axes(rank: int, axes: set[int] | None) -> tuple[str | None, ...]:
    """Labels for every dimension but ``axes`` (None: the axes are unknown, so nothing splits)."""
    return tuple(None if axes is None or d in axes else f"d{d}" for d in range(rank))


@register("Transpose", keeps=Keeps.NOTHING)
def transpose(op: OpNode, graph: Graph) -> OpSpec:
    rank = len(shape(graph, op.inputs[0]))
    perm = [int(p) for p in op.attrs.get("perm", list(reversed(range(rank))))]
    labels = dim_labels(rank)
    return OpSpec(inputs=(labels,), outputs=(tuple(labels[p] for p in perm),))


@register("Concat", keeps=Keeps.NOTHING)
def concat(op: OpNode, graph: Graph) -> OpSpec:
    rank = len(shape(graph, op.outputs[0]))
    labels = _except_axes(rank, {normalize_axis(int(op.attrs["axis"]), rank)})
    return OpSpec(inputs=tuple(labels if name else None for name in op.inputs), outputs=(labels,))


@register("Split", keeps=Keeps.NOTHING)
def split(op: OpNode, graph: Graph) -> OpSpec:
    rank = len(shape(graph, op.inputs[0]))
    labels = _except_axes(rank, {normalize_axis(int(op.attrs.get("axis", 0)), rank)})
    inputs = (labels,) + tuple(None for _ in op.inputs[1:])
    return OpSpec(inputs=inputs, outputs=tuple(labels if name else () for name in op.outputs))


@register("Slice", keeps=Keeps.NOTHING)
def slice_(op: OpNode, graph: Graph) -> OpSpec:
    in_shape = shape(graph, op.inputs[0])
    out_shape = shape(graph, op.outputs[0])
    rank = len(in_shape)
    if "starts" in op.attrs:  # opset < 10: attributes
        axes = op.attrs.get("axes", list(range(len(op.attrs["starts"]))))
    else:
        axes = constant_ints(graph, op, 3, "axes")
        if axes == []:
            axes = list(range(len(constant_ints(graph, op, 1, "starts") or [])))
        steps = constant_ints(graph, op, 4, "steps")
        if steps is None:
            axes = None
        elif axes is not None and any(step != 1 for step in steps):
            return OpSpec(
                inputs=(_except_axes(rank, None),) + tuple(None for _ in op.inputs[1:]),
                outputs=(_except_axes(rank, None),),
            )
    # an axis the slice leaves whole (same size in and out, step 1) may stay split
    touched = None if axes is None else {normalize_axis(int(a), rank) for a in axes}
    if touched is not None:
        touched = {d for d in touched if in_shape[d] != out_shape[d]}
    labels = _except_axes(rank, touched)
    return OpSpec(inputs=(labels,) + tuple(None for _ in op.inputs[1:]), outputs=(labels,))


@register("Pad", keeps=Keeps.NOTHING, config_inputs=frozenset({1, 2}))  # pads and constant value
@register("Tile", keeps=Keeps.NOTHING)
def resize_axes(op: OpNode, graph: Graph) -> OpSpec:
    """The axes Pad or Tile change in size stay whole; their pads/repeats inputs are constants."""
    in_shape = shape(graph, op.inputs[0])
    out_shape = shape(graph, op.outputs[0])
    labels = _except_axes(len(in_shape), {d for d in range(len(in_shape)) if in_shape[d] != out_shape[d]})
    return OpSpec(inputs=(labels,) + tuple(None for _ in op.inputs[1:]), outputs=(labels,))
