"""Reductions: any dimension may be split; splitting a reduced one leaves a partial result.

TopK selects along one axis, which stays whole; its other axes split freely.

ReduceMax/ReduceMin partials combine with max/min; ReduceSum/ReduceMean partials with a sum
(a rank's ReduceMean divides its local sum by the *global* count); ReduceL1 and ReduceSumSquare
are sums of |x| and x², so their partials sum too. ReduceProd, ReduceL2, ReduceLogSum and
ReduceLogSumExp apply a function after (or combine by something other than) a sum, max or min:
a partial product or a partial root of a sum of squares has no reduction among `ReduceOp`, so
their reduced axes stay whole and only the kept axes split.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from autopar.layout import ReduceOp
from autopar.ops.base import OpSpec, as_ints, constant_value, dim_labels, ints_from, normalize_axis, shape
from autopar.ops.cases import X4, F, const, ints, named, node, one
from autopar.ops.registry import Keeps, MindSporePrimitive, input_elements, register

if TYPE_CHECKING:
    from autopar.ops.views import GraphView, NodeView

_REDUCE_OP = {
    "ReduceMax": ReduceOp.MAX,
    "ReduceMin": ReduceOp.MIN,
    "ReduceSum": ReduceOp.SUM,
    "ReduceMean": ReduceOp.SUM,
    "ReduceL1": ReduceOp.SUM,
    "ReduceSumSquare": ReduceOp.SUM,
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
    elif op.op_type not in _REDUCE_OP:  # no partial combines: the reduced axes stay whole
        labels = tuple(None if d in axes else label for d, label in enumerate(labels))
    keepdims = int(op.attrs.get("keepdims", 1))
    if keepdims:
        out = tuple(None if i in axes else label for i, label in enumerate(labels))
    else:
        out = tuple(label for i, label in enumerate(labels) if i not in axes)
    inputs = (labels,) + tuple(None for _ in op.inputs[1:])
    return OpSpec(
        inputs=inputs,
        outputs=(out,),
        reduce_op=_REDUCE_OP.get(op.op_type, ReduceOp.SUM),
        local_mean=op.op_type == "ReduceMean",
    )


def _reduction(t: Any, op_type: str) -> Any:
    """The reduction as a torch function of (tensor, dims, keepdim)."""
    if op_type == "ReduceProd":
        return lambda x, dims, keep: _prod(x, dims, keep)
    if op_type == "ReduceL2":
        return lambda x, dims, keep: t.linalg.vector_norm(x, 2, dim=dims, keepdim=keep)
    if op_type == "ReduceL1":
        return lambda x, dims, keep: x.abs().sum(dim=dims, keepdim=keep)
    if op_type == "ReduceSumSquare":
        return lambda x, dims, keep: (x * x).sum(dim=dims, keepdim=keep)
    if op_type == "ReduceLogSum":
        return lambda x, dims, keep: t.log(x.sum(dim=dims, keepdim=keep))
    if op_type == "ReduceLogSumExp":
        return lambda x, dims, keep: t.logsumexp(x, dim=dims, keepdim=keep)
    function = {"ReduceSum": t.sum, "ReduceMean": t.mean, "ReduceMax": t.amax, "ReduceMin": t.amin}[op_type]
    return lambda x, dims, keep: function(x, dim=dims, keepdim=keep)


def _prod(x: Any, dims: tuple[int, ...], keep: bool) -> Any:
    """A product over several dims (torch's ``prod`` takes one at a time), the last first."""
    for dim in sorted(dims, reverse=True):
        x = x.prod(dim=dim, keepdim=keep)
    return x


def torch_reduce(t: Any, op: NodeView, inputs: list[Any]) -> list[Any]:
    """A reduction over ``axes`` (attribute or input; none: all, or none with noop_with_empty_axes)."""
    x = inputs[0]
    axes = ints_from(op, inputs, 1, "axes") or []
    if not axes:
        if int(op.attrs.get("noop_with_empty_axes", 0)):
            return [x]
        axes = list(range(x.dim()))
    dims = tuple(sorted(normalize_axis(a, x.dim()) for a in axes))
    keep = bool(int(op.attrs.get("keepdims", 1)))
    return [_reduction(t, op.op_type)(x, dims, keep) if dims else x]


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
# partials that sum; the backward of |x| and x² reads x
register(
    "ReduceL1",
    "ReduceSumSquare",
    mindspore=None,
    flops=input_elements,
    keeps=Keeps.INPUTS,
    torch_kernel=torch_reduce,
)(reduce)
# reduced axes whole; the backward of a product, a norm or a log-sum-exp reads the input and the
# result (x's gradient is y/x, x/y, exp(x - y)); that of a log of a sum only the result (exp(y))
register(
    "ReduceProd",
    "ReduceL2",
    "ReduceLogSumExp",
    mindspore={"ReduceProd": MindSporePrimitive("ops.ReduceProd", 1), "ReduceL2": None, "ReduceLogSumExp": None},
    flops=input_elements,
    keeps=Keeps.INPUTS | Keeps.OUTPUTS,
    torch_kernel=torch_reduce,
)(reduce)
register(
    "ReduceLogSum",
    mindspore=None,
    flops=input_elements,
    keeps=Keeps.OUTPUTS,
    positive_inputs=frozenset({0}),
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


def torch_arg_extreme(t: Any, op: NodeView, inputs: list[Any]) -> list[Any]:
    """ArgMax and ArgMin, the last of equal extremes with ``select_last_index``."""
    x = inputs[0]
    axis = normalize_axis(int(op.attrs.get("axis", 0)), x.dim())
    keep = bool(int(op.attrs.get("keepdims", 1)))
    last = bool(int(op.attrs.get("select_last_index", 0)))
    values = x.flip(axis) if last else x
    found = values.argmax(dim=axis, keepdim=keep) if op.op_type == "ArgMax" else values.argmin(dim=axis, keepdim=keep)
    return [x.shape[axis] - 1 - found if last else found]


@register(
    "ArgMax",
    "ArgMin",
    mindspore={"ArgMax": "ops.Argmax", "ArgMin": "ops.Argmin"},
    flops=input_elements,
    differentiable=False,
    keeps=Keeps.NOTHING,
    torch_kernel=torch_arg_extreme,
)  # an index: no gradient flows back through it
def arg_extreme(op: NodeView, graph: GraphView) -> OpSpec:
    """The position of the largest (smallest) along one axis: that axis stays whole, every other splits (a
    text tower's pooling picks each sequence's end token so, batch and all, with no gather)."""
    rank = len(shape(graph, op.inputs[0]))
    axis = normalize_axis(int(op.attrs.get("axis", 0)), rank)
    labels = tuple(None if d == axis else label for d, label in enumerate(dim_labels(rank)))
    kept = labels if int(op.attrs.get("keepdims", 1)) else tuple(label for d, label in enumerate(labels) if d != axis)
    return OpSpec(inputs=(labels,), outputs=(kept,))


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
        "arg_max": one("ArgMax", ["X"], X4, axis=2),
        "arg_min_last": one("ArgMin", ["X"], X4, axis=-1, keepdims=0, select_last_index=1),
        "reduce_prod": one("ReduceProd", ["X"], X4, axes=[1, 3], keepdims=0, opset=13),
        "reduce_prod_opset18_all": one("ReduceProd", ["X"], X4, opset=18),
        "reduce_l2": one("ReduceL2", ["X", "a"], X4, [const("a", [-1])], opset=18),
        "reduce_l2_opset13": one("ReduceL2", ["X"], X4, axes=[0, 2], keepdims=0, opset=13),
        "reduce_log_sum_exp": one("ReduceLogSumExp", ["X", "a"], X4, [const("a", [1])], keepdims=0, opset=18),
        "reduce_log_sum_exp_all": one("ReduceLogSumExp", ["X"], X4, opset=13),
        "reduce_l1": one("ReduceL1", ["X"], X4, axes=[2], opset=13),
        "reduce_sum_square": one("ReduceSumSquare", ["X", "a"], X4, [const("a", [0, -1])], opset=18),
        "reduce_log_sum": one("ReduceLogSum", ["X", "a"], [("X", F, [2, 3, 5])], [const("a", [1])], opset=18),
    },
    strategies={
        "reduce_mean_last": one("ReduceMean", ["X"], [("X", F, [4, 8])], axes=[-1]),
        "reduce_prod": one("ReduceProd", ["X"], [("X", F, [4, 8, 4])], axes=[1], keepdims=0),
        "reduce_l2": one("ReduceL2", ["X"], [("X", F, [4, 8])], axes=[-1]),
        "reduce_log_sum_exp": one("ReduceLogSumExp", ["X"], [("X", F, [4, 8, 4])], axes=[0, 2]),
        "reduce_l1": one("ReduceL1", ["X"], [("X", F, [4, 8])], axes=[1], keepdims=0),
        "reduce_sum_square": one("ReduceSumSquare", ["X"], [("X", F, [4, 8, 2])], axes=[1]),
        "reduce_log_sum": one(
            "ReduceLogSum", ["A"], [("X", F, [4, 8])], axes=[1], before=[node("Abs", ["X"], ["A"], "abs")]
        ),
        "top_k": one("TopK", ["X", "k"], [("X", F, [4, 8, 6])], outputs=("Y", "I"), axis=1, consts=[ints("k", [3])]),
        "arg_max_kept": one("ArgMax", ["X"], [("X", F, [4, 8, 6])], axis=1),
        "arg_min_dropped": one("ArgMin", ["X"], [("X", F, [4, 8, 6])], axis=-1, keepdims=0),
    },
)
