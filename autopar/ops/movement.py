"""Data-movement operators: Transpose, Concat, Split, Slice, Pad, Tile, DepthToSpace, SpaceToDepth.

Transpose carries every label to its new position. DepthToSpace and SpaceToDepth move blocks
between the channels and the two spatial axes: a spatial shard maps onto a spatial shard (rows
[r0, r1) of the input are rows [r0 b, r1 b) of DepthToSpace's output), so batch and space split;
channels split only in DepthToSpace's CRD mode, where each output channel reads a contiguous run
of input channels. The others touch one set of axes (the
concatenated, split, sliced, padded or tiled ones): those stay whole, because a rank's shard
of them would not line up with the operator's offsets; every other axis may be split.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from autopar.ops.base import OpSpec, as_float, as_ints, constant_ints, dim_labels, ints_from, normalize_axis, shape
from autopar.ops.cases import I64, X4, F, const, ints, named, one
from autopar.ops.registry import Keeps, MindSporePrimitive, register

if TYPE_CHECKING:
    from autopar.ops.views import GraphView, NodeView


def _except_axes(rank: int, axes: set[int] | None) -> tuple[str | None, ...]:
    """Labels for every dimension but ``axes`` (None: the axes are unknown, so nothing splits)."""
    return tuple(None if axes is None or d in axes else f"d{d}" for d in range(rank))


def torch_transpose(t: Any, op: NodeView, inputs: list[Any]) -> list[Any]:
    x = inputs[0]
    return [x.permute(*[int(p) for p in op.attrs.get("perm", list(reversed(range(x.dim()))))])]


def torch_concat(t: Any, op: NodeView, inputs: list[Any]) -> list[Any]:
    return [t.cat([x for x in inputs if x is not None], dim=int(op.attrs["axis"]))]


def torch_split(t: Any, op: NodeView, inputs: list[Any]) -> list[Any]:
    """Sizes from ``split`` (attribute or input); else ``num_outputs`` chunks, the last smaller; else equal."""
    x = inputs[0]
    axis = normalize_axis(int(op.attrs.get("axis", 0)), x.dim())
    sizes = ints_from(op, inputs, 1, "split")
    count = len([name for name in op.outputs if name])
    if not sizes:
        length = x.shape[axis]
        chunk = -(-length // int(op.attrs.get("num_outputs", count)))
        sizes = [min(chunk, length - start) for start in range(0, length, chunk)]
    return list(t.split(x, sizes, dim=axis))


def torch_slice(t: Any, op: NodeView, inputs: list[Any]) -> list[Any]:
    """ONNX clamps starts and ends as Python's slices do; a negative step gathers the indices."""
    x = inputs[0]
    if "starts" in op.attrs:  # opset < 10: attributes
        starts, ends = [int(v) for v in op.attrs["starts"]], [int(v) for v in op.attrs["ends"]]
        axes = [int(v) for v in op.attrs.get("axes", range(len(starts)))]
        steps = [1] * len(starts)
    else:
        starts, ends = as_ints(inputs[1]), as_ints(inputs[2])
        axes = ints_from(op, inputs, 3, "axes") or list(range(len(starts)))
        steps = ints_from(op, inputs, 4, "steps") or [1] * len(starts)
    for start, end, axis, step in zip(starts, ends, axes, steps):
        axis = normalize_axis(axis, x.dim())
        first, stop, stride = slice(start, end, step).indices(x.shape[axis])
        if stride > 0:
            x = (
                x.narrow(axis, first, max(0, -(-(stop - first) // stride)))
                if stride == 1
                else x[(slice(None),) * axis + (slice(first, stop, stride),)]
            )
        else:
            index = t.arange(first, stop, stride, device=x.device)
            x = x.index_select(axis, index)
    return [x]


def _border_indices(t: Any, size: int, begin: int, end: int, mode: str, device: Any) -> Any:
    """The input positions a padded axis reads: reflected, repeated at the edge, or wrapped around."""
    index = t.arange(-begin, size + end, device=device)
    if mode == "edge":
        return index.clamp(0, size - 1)
    if mode == "wrap":
        return index.remainder(size)
    period = max(2 * (size - 1), 1)  # reflect: mirrored about the first and last element
    index = index.remainder(period)
    return t.where(index >= size, period - index, index)


def torch_pad(t: Any, op: NodeView, inputs: list[Any]) -> list[Any]:
    """Pad with a constant (negative pads crop), or reflect, edge and wrap by indexing, on any axes."""
    x = inputs[0]
    pads = ints_from(op, inputs, 1, "pads") or []
    rank = x.dim()
    axes = [normalize_axis(a, rank) for a in (ints_from(op, inputs, 3, "axes") or range(len(pads) // 2))]
    begin = dict(zip(axes, pads[: len(axes)]))
    end = dict(zip(axes, pads[len(axes) :]))
    mode = op.attrs.get("mode", "constant")
    if mode != "constant":
        for d in axes:
            x = x.index_select(d, _border_indices(t, x.shape[d], begin[d], end[d], mode, x.device))
        return [x]
    flat: list[int] = []
    for d in reversed(range(rank)):  # torch lists the last dimension first
        flat += [begin.get(d, 0), end.get(d, 0)]
    value = as_float(inputs[2]) if len(inputs) > 2 and inputs[2] is not None else float(op.attrs.get("value", 0))
    return [t.nn.functional.pad(x, flat, value=value)]


def torch_tile(t: Any, op: NodeView, inputs: list[Any]) -> list[Any]:
    return [inputs[0].repeat(*as_ints(inputs[1]))]


@register(
    "Transpose", mindspore=MindSporePrimitive("ops.Transpose", 1), keeps=Keeps.NOTHING, torch_kernel=torch_transpose
)
def transpose(op: NodeView, graph: GraphView) -> OpSpec:
    rank = len(shape(graph, op.inputs[0]))
    perm = [int(p) for p in op.attrs.get("perm", list(reversed(range(rank))))]
    labels = dim_labels(rank)
    return OpSpec(inputs=(labels,), outputs=(tuple(labels[p] for p in perm),))


@register(
    "Concat",
    mindspore=MindSporePrimitive("ops.Concat", note="axis as a constructor argument"),
    keeps=Keeps.NOTHING,
    torch_kernel=torch_concat,
)
def concat(op: NodeView, graph: GraphView) -> OpSpec:
    rank = len(shape(graph, op.outputs[0]))
    labels = _except_axes(rank, {normalize_axis(int(op.attrs["axis"]), rank)})
    return OpSpec(inputs=tuple(labels if name else None for name in op.inputs), outputs=(labels,))


@register("Split", mindspore=MindSporePrimitive("ops.Split", 1), keeps=Keeps.NOTHING, torch_kernel=torch_split)
def split(op: NodeView, graph: GraphView) -> OpSpec:
    rank = len(shape(graph, op.inputs[0]))
    labels = _except_axes(rank, {normalize_axis(int(op.attrs.get("axis", 0)), rank)})
    inputs = (labels,) + tuple(None for _ in op.inputs[1:])
    return OpSpec(inputs=inputs, outputs=tuple(labels if name else () for name in op.outputs))


@register("Slice", mindspore=MindSporePrimitive("ops.StridedSlice", 1), keeps=Keeps.NOTHING, torch_kernel=torch_slice)
def slice_(op: NodeView, graph: GraphView) -> OpSpec:
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


# pads and constant value configure Pad
@register(
    "Pad",
    mindspore=MindSporePrimitive("ops.PadV3", 1),
    keeps=Keeps.NOTHING,
    config_inputs=frozenset({1, 2}),
    torch_kernel=torch_pad,
)
@register("Tile", mindspore=MindSporePrimitive("ops.Tile", 1), keeps=Keeps.NOTHING, torch_kernel=torch_tile)
def resize_axes(op: NodeView, graph: GraphView) -> OpSpec:
    """The axes Pad or Tile change in size stay whole; their pads/repeats inputs are constants."""
    in_shape = shape(graph, op.inputs[0])
    out_shape = shape(graph, op.outputs[0])
    labels = _except_axes(len(in_shape), {d for d in range(len(in_shape)) if in_shape[d] != out_shape[d]})
    return OpSpec(inputs=(labels,) + tuple(None for _ in op.inputs[1:]), outputs=(labels,))


def torch_depth_to_space(t: Any, op: NodeView, inputs: list[Any]) -> list[Any]:
    """[N, C, H, W] -> [N, C/b², H b, W b].

    DCR (the default) reads the depth as (row, column, channel), CRD as (channel, row, column).
    """
    x = inputs[0]
    b = int(op.attrs["blocksize"])
    n, c, h, w = x.shape
    if op.attrs.get("mode", "DCR") == "CRD":
        y = x.reshape(n, c // (b * b), b, b, h, w).permute(0, 1, 4, 2, 5, 3)
    else:
        y = x.reshape(n, b, b, c // (b * b), h, w).permute(0, 3, 4, 1, 5, 2)
    return [y.reshape(n, c // (b * b), h * b, w * b)]


def torch_space_to_depth(t: Any, op: NodeView, inputs: list[Any]) -> list[Any]:
    """[N, C, H, W] -> [N, C b², H/b, W/b], depth ordered as (row, column, channel)."""
    x = inputs[0]
    b = int(op.attrs["blocksize"])
    n, c, h, w = x.shape
    y = x.reshape(n, c, h // b, b, w // b, b).permute(0, 3, 5, 1, 2, 4)
    return [y.reshape(n, c * b * b, h // b, w // b)]


@register(
    "DepthToSpace",
    mindspore=MindSporePrimitive("ops.DepthToSpace", 1, needs_args=True),
    keeps=Keeps.NOTHING,
    torch_kernel=torch_depth_to_space,
)
def depth_to_space(op: NodeView, graph: GraphView) -> OpSpec:
    """Batch, rows and columns split (their shards map onto shards); channels too in CRD mode."""
    channels = "c" if op.attrs.get("mode", "DCR") == "CRD" else None
    labels = ("n", channels, "h", "w")
    return OpSpec(inputs=(labels,), outputs=(labels,))


@register(
    "SpaceToDepth",
    mindspore=MindSporePrimitive("ops.SpaceToDepth", 1, needs_args=True),
    keeps=Keeps.NOTHING,
    torch_kernel=torch_space_to_depth,
)
def space_to_depth(op: NodeView, graph: GraphView) -> OpSpec:
    """Batch, rows and columns split; channels stay whole (an output channel block interleaves them all)."""
    labels = ("n", None, "h", "w")
    return OpSpec(inputs=(labels,), outputs=(labels,))


# --- the operator alone in tiny models, checked by the operator tests (`autopar.ops.cases`) -----

CASES = named(
    kernel={
        "transpose_reversed": one("Transpose", ["X"], X4),
        "transpose": one("Transpose", ["X"], X4, perm=[2, 0, 3, 1]),
        "concat": one("Concat", ["X", "Z"], [("X", F, [2, 3]), ("Z", F, [2, 5])], axis=-1),
        "split_attribute": one("Split", ["X"], X4, outputs=("A", "B"), axis=3, split=[2, 4], opset=11),
        "split_equal": one("Split", ["X"], X4, outputs=("A", "B", "C"), axis=3),
        "split_input": one("Split", ["X", "s"], X4, [const("s", [1, 4])], outputs=("A", "B"), axis=2),
        "split_num_outputs": one(
            "Split", ["X"], [("X", F, [2, 7])], outputs=("A", "B", "C"), axis=1, num_outputs=3, opset=18
        ),
        "slice_steps": one(
            "Slice",
            ["X", "s", "e", "a", "st"],
            X4,
            [const("s", [-1, 0]), const("e", [-100, 9]), const("a", [3, 2]), const("st", [-2, 2])],
        ),
        "slice_clamped": one("Slice", ["X", "s", "e"], X4, [const("s", [1, -10]), const("e", [100, -1])]),
        "slice_attributes": one("Slice", ["X"], X4, starts=[1], ends=[3], axes=[3], opset=9),
        "pad_constant": one(
            "Pad", ["X", "p", "v"], X4, [const("p", [0, 0, 1, -1, 0, 1, 2, 0]), const("v", 1.5, np.float32)]
        ),
        "pad_int": one("Pad", ["X", "p", "v"], [("X", I64, [2, 3])], [const("p", [1, 0, 0, 1]), const("v", 7)]),
        "pad_reflect": one("Pad", ["X", "p"], X4, [const("p", [1, 2, 1, 0, 0, 1, 2, 4])], mode="reflect"),
        "pad_edge": one("Pad", ["X", "p"], X4, [const("p", [1, 0, -1, 2, 0, 2, 0, -2])], mode="edge"),
        "pad_wrap": one("Pad", ["X", "p"], X4, [const("p", [0, 2, 1, 7, 0, 2, 6, 0])], mode="wrap", opset=19),
        "pad_axes": one("Pad", ["X", "p", "", "a"], X4, [const("p", [1, 2, 0, 3]), const("a", [1, -1])], opset=18),
        "pad_attributes": one("Pad", ["X"], X4, pads=[0, 1, 0, 0, 0, 1, 0, 0], value=2.0, opset=2),
        "tile": one("Tile", ["X", "r"], X4, [const("r", [1, 2, 1, 3])]),
        "depth_to_space": one("DepthToSpace", ["X"], [("X", F, [2, 8, 3, 5])], blocksize=2),
        "depth_to_space_crd": one("DepthToSpace", ["X"], [("X", F, [2, 18, 2, 3])], blocksize=3, mode="CRD"),
        "depth_to_space_opset1": one("DepthToSpace", ["X"], [("X", F, [1, 8, 2, 3])], blocksize=2, opset=1),
        "space_to_depth": one("SpaceToDepth", ["X"], [("X", F, [2, 3, 4, 6])], blocksize=2),
    },
    strategies={
        "transpose": one("Transpose", ["X"], [("X", F, [2, 4, 8, 4])], perm=[0, 2, 1, 3]),
        "concat": one("Concat", ["X", "Z"], [("X", F, [4, 2, 8]), ("Z", F, [4, 6, 8])], axis=1),
        "split": one(
            "Split",
            ["X", "sizes"],
            [("X", F, [4, 8, 8])],
            outputs=("Y1", "Y2"),
            axis=2,
            consts=[ints("sizes", [2, 6])],
        ),
        "slice": one(
            "Slice",
            ["X", "s", "e", "ax"],
            [("X", F, [4, 8, 8])],
            consts=[ints("s", [1]), ints("e", [5]), ints("ax", [1])],
        ),
        "slice_whole_axis": one(
            "Slice",
            ["X", "s", "e", "ax"],
            [("X", F, [4, 8, 8])],
            consts=[ints("s", [0, 0]), ints("e", [8, 3]), ints("ax", [1, 2])],
        ),
        "pad": one("Pad", ["X", "p"], [("X", F, [4, 4, 6])], consts=[ints("p", [0, 0, 1, 0, 0, 2])]),
        "tile": one("Tile", ["X", "r"], [("X", F, [4, 4])], consts=[ints("r", [1, 2])]),
        "depth_to_space": one("DepthToSpace", ["X"], [("X", F, [4, 8, 4, 4])], blocksize=2),
        "depth_to_space_crd": one("DepthToSpace", ["X"], [("X", F, [2, 16, 4, 2])], blocksize=2, mode="CRD"),
        "space_to_depth": one("SpaceToDepth", ["X"], [("X", F, [4, 2, 8, 8])], blocksize=2),
    },
)
