"""Reductions: any dimension may be split; splitting a reduced one leaves a partial result.

TopK selects along one axis, which stays whole; its other axes split freely.

ReduceMax/ReduceMin partials combine with max/min; ReduceSum/ReduceMean partials with a sum
(a rank's ReduceMean divides its local sum by the *global* count).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from autopar.layout import ReduceOp
from autopar.ops.base import OpSpec, as_ints, constant_value, dim_labels, ints_from, normalize_axis, shape
from autopar.ops.cases import X4, F, const, ints, named, one
from autopar.ops.registry import Keeps, MindSporePrimitive, input_elements, register

if TYPE_CHECKING:
    from autopar.ops.views import GraphView, NodeView

_REDUCE_OP = {
    "ReduceMax": ReduceOp.MAX,
    "ReduceMin": ReduceOp.MIN,
    "ReduceSum": ReduceOp.SUM,
    "ReduceMean": ReduceOp.SUM,
}


def reduced_axes(op: NodeView, graph: GraphView, rank: int) -> list[int] | None:
    """The reduced axes, or None when they are not known at planning time."""
    if "axes" in op.attrs:
        axes = list(op.attrs["axes"])
    elif len(op.inputs) > 1 and op.inputs[1]:
        value = constant_value(graph, op.inputs[1])
        if value is None:
            return None
        axes = [int(a) for a in np.asarray(value).reshape(-1)]
    else:
        axes = []
    if not axes:
        return [] if int(op.attrs.get("noop_with_empty_axes", 0)) else list(range(rank))
    return sorted(normalize_axis(int(a), rank) for a in axes)


def reduce(op: NodeView, graph: GraphView) -> OpSpec:
    rank = len(shape(graph, op.inputs[0]))
    axes = reduced_axes(op, graph, rank)
    labels = dim_labels(rank)
    if axes is None:
        axes = list(range(rank))
        labels = tuple(None for _ in range(rank))
    keepdims = int(op.attrs.get("keepdims", 1))
    if keepdims:
        out = tuple(None if i in axes else label for i, label in enumerate(labels))
    else:
        out = tuple(label for i, label in enumerate(labels) if i not in axes)
    inputs = (labels,) + tuple(None for _ in op.inputs[1:])
    return OpSpec(
        inputs=inputs, outputs=(out,), reduce_op=_REDUCE_OP[op.op_type], local_mean=op.op_type == "ReduceMean"
    )


def torch_reduce(t: Any, op: NodeView, inputs: list[Any]) -> list[Any]:
    """ReduceSum/Mean/Max/Min over ``axes`` (attribute or input; none: all, or none with noop_with_empty_axes)."""
    x = inputs[0]
    axes = ints_from(op, inputs, 1, "axes") or []
    if not axes:
        if int(op.attrs.get("noop_with_empty_axes", 0)):
            return [x]
        axes = list(range(x.dim()))
    dims = tuple(sorted(normalize_axis(a, x.dim()) for a in axes))
    keep = bool(int(op.attrs.get("keepdims", 1)))
    function = {"ReduceSum": t.sum, "ReduceMean": t.mean, "ReduceMax": t.amax, "ReduceMin": t.amin}[op.op_type]
    return [function(x, dim=dims, keepdim=keep) if dims else x]


def torch_top_k(t: Any, op: NodeView, inputs: list[Any]) -> list[Any]:
    x = inputs[0]
    k = as_ints(inputs[1])[0] if len(inputs) > 1 and inputs[1] is not None else int(op.attrs["k"])
    axis = normalize_axis(int(op.attrs.get("axis", -1)), x.dim())
    values, indices = t.topk(x, k, dim=axis, largest=bool(int(op.attrs.get("largest", 1))), sorted=True)
    return [values, indices]


register(
    "ReduceSum",
    "ReduceMean",
    mindspore={
        "ReduceSum": MindSporePrimitive("ops.ReduceSum", 1),
        "ReduceMean": MindSporePrimitive("ops.ReduceMean", 1),
    },
    flops=input_elements,
    keeps=Keeps.NOTHING,
    torch_kernel=torch_reduce,
)(reduce)
# the backward needs to know where the extreme was
register(
    "ReduceMax",
    "ReduceMin",
    mindspore={
        "ReduceMax": MindSporePrimitive("ops.ReduceMax", 1),
        "ReduceMin": MindSporePrimitive("ops.ReduceMin", 1),
    },
    flops=input_elements,
    keeps=Keeps.INPUTS | Keeps.OUTPUTS,
    torch_kernel=torch_reduce,
)(reduce)


@register(
    "TopK", since=10, mindspore=MindSporePrimitive("ops.TopK", 1), keeps=Keeps.OUTPUTS, torch_kernel=torch_top_k
)  # the backward scatters into the positions it chose
def top_k(op: NodeView, graph: GraphView) -> OpSpec:
    """The k largest (or smallest) along one axis: that axis stays whole, every other axis splits."""
    rank = len(shape(graph, op.inputs[0]))
    axis = normalize_axis(int(op.attrs.get("axis", -1)), rank)
    labels = dim_labels(rank)
    labels = tuple(None if d == axis else label for d, label in enumerate(labels))
    return OpSpec(inputs=(labels, None), outputs=(labels, labels))


# --- the operator alone in tiny models, checked by the operator tests (`autopar.ops.cases`) -----

CASES = named(
    kernel={
        "reduce_sum_axes_input": one("ReduceSum", ["X", "a"], X4, [const("a", [1, -1])], keepdims=0),
        "reduce_sum_all": one("ReduceSum", ["X"], X4),
        "reduce_sum_noop": one("ReduceSum", ["X"], X4, noop_with_empty_axes=1),
        "reduce_mean_attribute": one("ReduceMean", ["X"], X4, axes=[2], opset=13),
        "reduce_mean_opset18": one("ReduceMean", ["X", "a"], X4, [const("a", [0, 3])], opset=18),
        "reduce_max": one("ReduceMax", ["X"], X4, axes=[1], keepdims=0),
        "reduce_min": one("ReduceMin", ["X"], X4),
        "top_k": one("TopK", ["X", "k"], X4, [const("k", [2])], outputs=("Y", "I"), axis=2),
        "top_k_smallest": one("TopK", ["X", "k"], X4, [const("k", [3])], outputs=("Y", "I"), largest=0),
    },
    strategies={
        "reduce_mean_last": one("ReduceMean", ["X"], [("X", F, [4, 8])], axes=[-1]),
        "top_k": one("TopK", ["X", "k"], [("X", F, [4, 8, 6])], outputs=("Y", "I"), axis=1, consts=[ints("k", [3])]),
    },
)
