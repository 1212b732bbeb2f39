"""Operators along an ordered axis: CumSum, Trilu, Range.

CumSum scans one axis: a rank's shard of it would need the sum of every shard before it (an
exclusive scan across ranks, which no collective of the plan performs), so the scanned axis stays
whole and every other axis splits. Trilu keeps a triangle of the last two axes, whose positions
relative to the diagonal a shard would shift: they stay whole, the leading (batch) axes split.
Range computes its output from three scalars; it is usually folded at import, and otherwise runs
whole on every rank.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from autopar.ops.base import OpSpec, as_float, as_ints, constant_ints, dim_labels, normalize_axis, shape
from autopar.ops.cases import I64, X4, F, const, floats, ints, named, one
from autopar.ops.registry import Keeps, MindSporePrimitive, no_flops, register

if TYPE_CHECKING:
    from autopar.ops.views import GraphView, NodeView


def torch_cumsum(t: Any, op: NodeView, inputs: list[Any]) -> list[Any]:
    """Running sums along ``axis`` (an input); ``exclusive`` shifts them by one, ``reverse`` runs from the end."""
    x = inputs[0]
    axis = normalize_axis(as_ints(inputs[1])[0], x.dim())
    reverse = bool(int(op.attrs.get("reverse", 0)))
    if reverse:
        x = x.flip(axis)
    y = x.cumsum(axis)
    if int(op.attrs.get("exclusive", 0)):
        length = y.shape[axis]
        y = t.cat([t.zeros_like(y.narrow(axis, 0, 1)), y.narrow(axis, 0, length - 1)], dim=axis)
    return [y.flip(axis) if reverse else y]


def torch_trilu(t: Any, op: NodeView, inputs: list[Any]) -> list[Any]:
    """The upper (``upper=1``, the default) or lower triangle of the last two axes, from diagonal ``k``."""
    k = as_ints(inputs[1])[0] if len(inputs) > 1 and inputs[1] is not None else 0
    function = t.triu if int(op.attrs.get("upper", 1)) else t.tril
    return [function(inputs[0], k)]


def torch_range(t: Any, op: NodeView, inputs: list[Any]) -> list[Any]:
    """``start + i * delta`` for ``i < max(ceil((limit - start) / delta), 0)``, in the inputs' type."""
    start, limit, delta = (as_float(x) for x in inputs[:3])
    count = max(math.ceil((limit - start) / delta), 0)
    first = inputs[0]
    dtype = first.dtype if hasattr(first, "dtype") and isinstance(first.dtype, t.dtype) else None
    dtype = dtype if dtype is not None else t.from_numpy(np.array(first)).dtype
    device = first.device if isinstance(first, t.Tensor) else None
    if dtype.is_floating_point:
        steps = t.arange(count, dtype=t.float64, device=device)
        return [(steps * delta + start).to(dtype)]
    return [t.arange(int(start), int(start) + count * int(delta), int(delta), dtype=dtype, device=device)[:count]]


@register(
    "CumSum",
    since=11,
    mindspore=MindSporePrimitive("ops.CumSum", 1, note="exclusive and reverse are constructor arguments"),
    keeps=Keeps.NOTHING,  # the gradient is the reverse running sum of the output's gradient
    torch_kernel=torch_cumsum,
)
def cumsum(op: NodeView, graph: GraphView) -> OpSpec:
    """Every axis but the scanned one splits (none when the axis is computed at run time)."""
    rank = len(shape(graph, op.inputs[0]))
    axis = constant_ints(graph, op, 1, "axis")
    scanned = set(range(rank)) if not axis else {normalize_axis(axis[0], rank)}
    labels = tuple(None if d in scanned else label for d, label in enumerate(dim_labels(rank)))
    return OpSpec(inputs=(labels, None), outputs=(labels,))


@register("Trilu", since=14, mindspore=None, keeps=Keeps.NOTHING, torch_kernel=torch_trilu)
def trilu(op: NodeView, graph: GraphView) -> OpSpec:
    """The leading axes split; the two axes of the triangle stay whole."""
    rank = len(shape(graph, op.inputs[0]))
    labels = dim_labels(rank)[:-2] + (None, None)
    return OpSpec(inputs=(labels,) + tuple(None for _ in op.inputs[1:]), outputs=(labels,))


@register(
    "Range",
    since=11,
    mindspore=MindSporePrimitive("ops.Range"),
    flops=no_flops,
    differentiable=False,
    keeps=Keeps.NOTHING,
    config_inputs=frozenset({0, 1, 2}),
    torch_kernel=torch_range,
)
def range_(op: NodeView, graph: GraphView) -> OpSpec:
    """The output is computed whole on every rank from three scalars (it is a constant when they are)."""
    return OpSpec(inputs=((), (), ()), outputs=((None,),), op_class="free")


# --- the operator alone in tiny models, checked by the operator tests (`autopar.ops.cases`) -----

_RANGE_FLOAT = [floats("s", 1.0), floats("l", 7.0), floats("d", 1.5)]

CASES = named(
    kernel={
        "cumsum": one("CumSum", ["X", "a"], X4, [const("a", 2)], opset=11),
        "cumsum_exclusive_reverse": one("CumSum", ["X", "a"], X4, [const("a", [-1])], exclusive=1, reverse=1),
        "cumsum_int": one("CumSum", ["X", "a"], [("X", I64, [3, 4])], [const("a", 0)], exclusive=1),
        "trilu_upper": one("Trilu", ["X"], X4, opset=14),
        "trilu_lower_k": one("Trilu", ["X", "k"], X4, [const("k", -1)], upper=0, opset=14),
        "trilu_upper_k": one("Trilu", ["X", "k"], [("X", F, [3, 4])], [const("k", 2)], opset=14),
        "range_float": one("Range", ["s", "l", "d"], [], _RANGE_FLOAT, opset=11),
        "range_int_down": one("Range", ["s", "l", "d"], [], [ints("s", 10), ints("l", 1), ints("d", -3)]),
    },
    strategies={
        "cumsum": one("CumSum", ["X", "a"], [("X", F, [4, 8, 4])], consts=[ints("a", 1)], reverse=1),
        "trilu": one("Trilu", ["X", "k"], [("X", F, [4, 2, 8, 8])], consts=[ints("k", 1)], upper=0, opset=14),
        "range": one("Range", ["s", "l", "d"], [], _RANGE_FLOAT),
    },
)
