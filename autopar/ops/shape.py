"""Reshape-like operators (Reshape, Flatten, Squeeze, Unsqueeze).

A split survives a reshape when it cuts the leading dimension of a block of dimensions that
maps onto a block of the output: the shard stays one contiguous run of memory on both sides.
Any other split must be gathered first (the rule gives those dimensions no label).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from autopar.ops.base import Labels, OpSpec, as_ints, ints_from, normalize_axis, shape
from autopar.ops.cases import X2, X4, F, const, ints, named, node, one
from autopar.ops.registry import Keeps, LocalCall, MindSporePrimitive, no_flops, register

if TYPE_CHECKING:
    from autopar.ops.views import GraphView, NodeView


def reshape_labels(in_shape: Sequence[int], out_shape: Sequence[int]) -> tuple[Labels, Labels]:
    """Group dimensions into blocks of equal size; the leading dims of a block share a label."""
    in_labels: list[str | None] = [None] * len(in_shape)
    out_labels: list[str | None] = [None] * len(out_shape)
    i = j = 0
    block = 0
    while i < len(in_shape) and j < len(out_shape):
        in_dims, out_dims = [i], [j]
        in_size, out_size = in_shape[i], out_shape[j]
        i += 1
        j += 1
        while in_size != out_size:
            if in_size < out_size and i < len(in_shape):
                in_size *= in_shape[i]
                in_dims.append(i)
                i += 1
            elif j < len(out_shape):
                out_size *= out_shape[j]
                out_dims.append(j)
                j += 1
            else:
                return tuple(in_labels), tuple(out_labels)
        lead_in = next((d for d in in_dims if in_shape[d] > 1), None)
        lead_out = next((d for d in out_dims if out_shape[d] > 1), None)
        if lead_in is not None and lead_out is not None:
            in_labels[lead_in] = f"r{block}"
            out_labels[lead_out] = f"r{block}"
        block += 1
    return tuple(in_labels), tuple(out_labels)


def local_target_shape(call: LocalCall) -> list[np.ndarray]:
    """A shape input (Reshape's target, Expand's) becomes the rank's local output shape."""
    local = list(call.inputs)
    local[1] = np.asarray(call.output_shapes[0], dtype=np.int64)
    return call.run(local)


def torch_reshape(t: Any, op: NodeView, inputs: list[Any]) -> list[Any]:
    """Reshape (a 0 copies the input's dimension unless ``allowzero``), Flatten, Squeeze, Unsqueeze."""
    x = inputs[0]
    kind = op.op_type
    if kind == "Reshape":
        target = as_ints(inputs[1])
        if not int(op.attrs.get("allowzero", 0)):
            target = [x.shape[d] if size == 0 else size for d, size in enumerate(target)]
        return [x.reshape(target)]
    if kind == "Flatten":
        axis = normalize_axis(int(op.attrs.get("axis", 1)), x.dim())
        return [x.reshape(int(math.prod(x.shape[:axis])), -1)]
    axes = ints_from(op, inputs, 1, "axes")
    if kind == "Squeeze":
        if not axes:
            return [x.reshape([size for size in x.shape if size != 1])]
        drop = {normalize_axis(a, x.dim()) for a in axes}
        return [x.reshape([size for d, size in enumerate(x.shape) if d not in drop])]
    out_rank = x.dim() + len(axes or [])
    shape_out = list(x.shape)
    for axis in sorted(normalize_axis(a, out_rank) for a in axes or []):
        shape_out.insert(axis, 1)
    return [x.reshape(shape_out)]


@register(
    "Reshape",
    mindspore=MindSporePrimitive("ops.Reshape", 1),
    flops=no_flops,
    keeps=Keeps.NOTHING,
    local_kernel=local_target_shape,
    torch_kernel=torch_reshape,
    torch_local_kernel=local_target_shape,
)
@register(
    "Flatten",
    "Squeeze",
    "Unsqueeze",
    mindspore={
        "Flatten": MindSporePrimitive("ops.Flatten", 1),
        "Squeeze": MindSporePrimitive("ops.Squeeze", 1),
        "Unsqueeze": MindSporePrimitive("ops.ExpandDims", 1),
    },
    flops=no_flops,
    keeps=Keeps.NOTHING,
    torch_kernel=torch_reshape,
)
def reshape(op: NodeView, graph: GraphView) -> OpSpec:
    in_labels, out_labels = reshape_labels(shape(graph, op.inputs[0]), shape(graph, op.outputs[0]))
    inputs = (in_labels,) + tuple(None for _ in op.inputs[1:])
    return OpSpec(inputs=inputs, outputs=(out_labels,), op_class="free")


# --- the operator alone in tiny models, checked by the operator tests (`autopar.ops.cases`) -----

CASES = named(
    kernel={
        "reshape": one("Reshape", ["X", "s"], X4, [const("s", [0, -1, 6])]),
        "reshape_allowzero": one("Reshape", ["X", "s"], X4, [const("s", [6, -1, 2, 5])], allowzero=1, opset=14),
        "flatten_0": one("Flatten", ["X"], X4, axis=0),
        "flatten_negative": one("Flatten", ["X"], X4, axis=-1),
        "squeeze_input": one("Squeeze", ["X", "a"], [("X", F, [1, 3, 1, 4])], [const("a", [-2])]),
        "squeeze_all": one("Squeeze", ["X"], [("X", F, [1, 3, 1, 4])]),
        "squeeze_attribute": one("Squeeze", ["X"], [("X", F, [1, 3, 1, 4])], axes=[0], opset=11),
        "unsqueeze_input": one("Unsqueeze", ["X", "a"], X2, [const("a", [0, -1])]),
        "unsqueeze_attribute": one("Unsqueeze", ["X"], X2, axes=[1, 3], opset=11),
    },
    strategies={
        "flatten": one("Flatten", ["X"], [("X", F, [4, 2, 4])], axis=1),
        "reshape_heads": one("Reshape", ["X", "s"], [("X", F, [2, 4, 16])], consts=[ints("s", [2, 4, 4, 4])]),
        "unsqueeze_squeeze": one(
            "Squeeze",
            ["u", "a"],
            [("X", F, [4, 8])],
            [ints("a", [1])],
            before=[node("Unsqueeze", ["X", "a"], ["u"], "unsq")],
        ),
    },
)
