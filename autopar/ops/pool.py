"""Pooling: batch and channels split freely; windows stay whole; global pools reduce space locally."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from autopar.ops.base import OpSpec, no_split, shape
from autopar.ops.cases import X4, F, named, one
from autopar.ops.registry import Keeps, MindSporePrimitive, input_elements, register

if TYPE_CHECKING:
    from autopar.ops.views import GraphView, NodeView


def window_flops(
    in_shapes: Sequence[Sequence[int] | None], out_shapes: Sequence[Sequence[int]], attrs: Mapping[str, Any]
) -> float:
    """One operation per window element per output element."""
    return float(math.prod(out_shapes[0]) * math.prod(attrs.get("kernel_shape", [1])))


def pool(op: NodeView, graph: GraphView) -> OpSpec:
    """Batch and channels split, but LRN's channels (it mixes neighbours), and nothing where MaxPool's Indices
    are named: they count positions over the whole input, every sample and channel before (a shard would count
    its own)."""
    rank = len(shape(graph, op.inputs[0]))
    if op.op_type == "MaxPool" and len(op.outputs) > 1 and op.outputs[1]:
        labels = no_split(rank)
        return OpSpec(inputs=(labels,), outputs=tuple(labels if name else () for name in op.outputs))
    channel = None if op.op_type == "LRN" else "c"  # LRN mixes neighbouring channels
    labels = ("n", channel) + no_split(rank - 2)
    outputs = tuple(labels if name else () for name in op.outputs)
    return OpSpec(inputs=(labels,), outputs=outputs)


def _window(op: NodeView, x: Any) -> tuple[list[int], list[int], list[int], list[int], list[int]]:
    """(kernel, strides, begin pads, end pads, dilations) with ONNX's defaults and ``auto_pad``."""
    spatial = x.dim() - 2
    kernel = [int(k) for k in op.attrs["kernel_shape"]]
    strides = [int(s) for s in op.attrs.get("strides", [1] * spatial)]
    dilations = [int(d) for d in op.attrs.get("dilations", [1] * spatial)]
    pads = [int(p) for p in op.attrs.get("pads", [0] * (2 * spatial))]
    auto = op.attrs.get("auto_pad", "NOTSET")
    if auto in ("SAME_UPPER", "SAME_LOWER"):
        for d in range(spatial):
            size = x.shape[2 + d]
            total = max(0, (-(-size // strides[d]) - 1) * strides[d] + (kernel[d] - 1) * dilations[d] + 1 - size)
            small, large = total // 2, total - total // 2
            pads[d], pads[spatial + d] = (small, large) if auto == "SAME_UPPER" else (large, small)
    elif auto == "VALID":
        pads = [0] * (2 * spatial)
    return kernel, strides, pads[:spatial], pads[spatial:], dilations


def _pad_trailing(t: Any, x: Any, begin: list[int], end: list[int], value: float) -> Any:
    flat: list[int] = []
    for d in reversed(range(len(begin))):
        flat += [begin[d], end[d]]
    return t.nn.functional.pad(x, flat, value=value) if any(flat) else x


def _out_sizes(op: NodeView, x: Any, window: tuple[list[int], ...]) -> list[int]:
    """ONNX's output sizes; with ``ceil_mode`` a window starting past the input and its begin pad is dropped."""
    kernel, strides, begin, end, dilations = window
    ceil = bool(int(op.attrs.get("ceil_mode", 0)))
    sizes = []
    for d, size in enumerate(x.shape[2:]):
        span = size + begin[d] + end[d] - (kernel[d] - 1) * dilations[d] - 1
        out = (-(-span // strides[d]) if ceil else span // strides[d]) + 1
        sizes.append(out - 1 if ceil and (out - 1) * strides[d] >= size + begin[d] else out)
    return sizes


def _window_sums(t: Any, x: Any, window: tuple[list[int], ...], sizes: list[int], value: float) -> Any:
    """The sum over each window of x padded with ``value`` (zeros past the pads), as a depthwise convolution."""
    kernel, strides, begin, end, dilations = window
    needed = [(n - 1) * s + (k - 1) * d + 1 for n, s, k, d in zip(sizes, strides, kernel, dilations)]
    x = _pad_trailing(t, x, begin, end, value)
    x = _pad_trailing(t, x, [0] * len(sizes), [max(0, n - size) for n, size in zip(needed, x.shape[2:])], 0.0)
    ones = x.new_ones((x.shape[1], 1, *kernel))
    function = getattr(t.nn.functional, f"conv{len(sizes)}d")
    return function(x, ones, None, stride=strides, dilation=dilations, groups=x.shape[1])


def _max_pool(t: Any, op: NodeView, x: Any, window: tuple[list[int], ...], sizes: list[int]) -> list[Any]:
    """MaxPool and its optional Indices: flat positions in the unpadded input, row- or column-major (storage_order)."""
    kernel, strides, begin, end, dilations = window
    spatial = len(sizes)
    pool = getattr(t.nn.functional, f"max_pool{spatial}d")
    padded = _pad_trailing(t, x, begin, end, float("-inf"))
    values, where = pool(padded, kernel, strides, 0, dilations, ceil_mode=True, return_indices=True)
    crop = tuple(slice(0, n) for n in sizes)
    values, where = values[(..., *crop)], where[(..., *crop)]
    if len([name for name in op.outputs if name]) < 2:
        return [values]
    dims = list(x.shape[2:])
    coords: list[Any] = []
    for d in reversed(range(spatial)):  # unravel in the padded plane, then shift by the begin pads
        coords.insert(0, where % padded.shape[2 + d] - begin[d])
        where = where // padded.shape[2 + d]
    order = list(reversed(range(spatial))) if int(op.attrs.get("storage_order", 0)) else list(range(spatial))
    index = t.zeros_like(coords[0])
    for d in order:
        index = index * dims[d] + coords[d]
    plane = t.arange(x.shape[0] * x.shape[1], device=x.device).reshape(x.shape[0], x.shape[1], *[1] * spatial)
    return [values, index + plane * math.prod(dims)]


def _lrn(t: Any, op: NodeView, x: Any) -> Any:
    """x / (bias + alpha / size x the sum of squares over ``size`` neighbouring channels) ** beta.

    The window spans floor((size - 1) / 2) channels before and ceil((size - 1) / 2) after, as ONNX
    says (torch's ``local_response_norm`` centres even windows the other way).
    """
    size = int(op.attrs["size"])
    alpha, beta, bias = (float(op.attrs.get(k, v)) for k, v in (("alpha", 1e-4), ("beta", 0.75), ("bias", 1.0)))
    flat = [0, 0] * (x.dim() - 2) + [(size - 1) // 2, size // 2]
    squares = t.nn.functional.pad(x * x, flat)
    total = sum(squares.narrow(1, i, x.shape[1]) for i in range(size))
    return x / (bias + alpha / size * total) ** beta


def torch_pool(t: Any, op: NodeView, inputs: list[Any]) -> list[Any]:
    """Pools padded explicitly, so that ONNX's asymmetric pads, ``ceil_mode`` and dilations hold."""
    x, kind = inputs[0], op.op_type
    if kind == "GlobalAveragePool":
        return [x.mean(dim=tuple(range(2, x.dim())), keepdim=True)]
    if kind == "GlobalMaxPool":
        return [x.amax(dim=tuple(range(2, x.dim())), keepdim=True)]
    if kind == "LRN":
        return [_lrn(t, op, x)]
    window = _window(op, x)
    sizes = _out_sizes(op, x, window)
    if kind == "MaxPool":
        return _max_pool(t, op, x, window, sizes)
    if kind == "AveragePool":  # divided by the window's count of input elements (and of pads, if counted)
        count = _window_sums(t, t.ones_like(x[:1, :1]), window, sizes, float(int(op.attrs.get("count_include_pad", 0))))
        return [_window_sums(t, x, window, sizes, 0.0) / count]
    p = int(op.attrs.get("p", 2))  # LpPool: (sum |x|^p)^(1/p) over each window
    return [_window_sums(t, x.abs() ** p, window, sizes, 0.0) ** (1.0 / p)]


register(
    "MaxPool",
    mindspore=MindSporePrimitive("ops.MaxPool", 1),
    flops=window_flops,
    keeps=Keeps.INPUTS | Keeps.OUTPUTS,
    torch_kernel=torch_pool,
)(pool)  # the argmax of each window
register(
    "AveragePool",
    mindspore=MindSporePrimitive("ops.AvgPool", 1),
    flops=window_flops,
    keeps=Keeps.NOTHING,
    torch_kernel=torch_pool,
)(pool)
register(
    "GlobalAveragePool",
    mindspore=MindSporePrimitive("ops.ReduceMean", 1, note="keep_dims=True over the spatial axes"),
    flops=input_elements,
    keeps=Keeps.NOTHING,
    torch_kernel=torch_pool,
)(pool)
register(
    "GlobalMaxPool",
    mindspore=MindSporePrimitive("ops.ReduceMax", 1, note="keep_dims=True over the spatial axes"),
    flops=input_elements,
    keeps=Keeps.INPUTS | Keeps.OUTPUTS,
    torch_kernel=torch_pool,
)(pool)
register(
    "LpPool",
    "LRN",
    mindspore={"LRN": MindSporePrimitive("ops.LRN", 1)},
    keeps=Keeps.INPUTS | Keeps.OUTPUTS,
    torch_kernel=torch_pool,
)(pool)


# --- the operator alone in tiny models, checked by the operator tests (`autopar.ops.cases`) -----

CASES = named(
    kernel={
        "max_pool": one("MaxPool", ["X"], X4, kernel_shape=[3, 2], pads=[1, 0, 1, 1], strides=[2, 2]),
        "max_pool_ceil": one("MaxPool", ["X"], X4, kernel_shape=[2, 2], strides=[2, 2], ceil_mode=1),
        "max_pool_dilated": one("MaxPool", ["X"], X4, kernel_shape=[2, 2], dilations=[2, 1], pads=[1, 1, 0, 1]),
        "max_pool_1d": one("MaxPool", ["X"], [("X", F, [2, 3, 9])], kernel_shape=[3], strides=[2]),
        "max_pool_indices": one("MaxPool", ["X"], X4, kernel_shape=[2, 3], pads=[1, 1, 0, 1], outputs=("Y", "I")),
        "max_pool_indices_ceil": one(
            "MaxPool",
            ["X"],
            X4,
            kernel_shape=[3, 3],
            strides=[2, 2],
            pads=[1, 1, 1, 1],
            ceil_mode=1,
            outputs=("Y", "I"),
        ),
        "max_pool_indices_3d": one(
            "MaxPool",
            ["X"],
            [("X", F, [2, 2, 4, 5, 3])],
            kernel_shape=[2, 2, 2],
            pads=[1, 0, 0, 0, 1, 1],
            outputs=("Y", "I"),
        ),
        "max_pool_indices_column_major": one(
            "MaxPool", ["X"], [("X", F, [2, 2, 4, 5, 3])], kernel_shape=[2, 2, 2], outputs=("Y", "I"), storage_order=1
        ),
        "average_pool": one("AveragePool", ["X"], X4, kernel_shape=[3, 3], pads=[1, 1, 1, 1], strides=[2, 2]),
        "average_pool_counting_pads": one(
            "AveragePool", ["X"], X4, kernel_shape=[3, 3], pads=[1, 0, 1, 2], count_include_pad=1
        ),
        "average_pool_ceil": one("AveragePool", ["X"], X4, kernel_shape=[2, 2], strides=[2, 2], ceil_mode=1),
        "average_pool_ceil_counting_pads": one(
            "AveragePool", ["X"], X4, kernel_shape=[2, 2], strides=[2, 2], ceil_mode=1, count_include_pad=1
        ),
        "average_pool_same": one("AveragePool", ["X"], X4, kernel_shape=[2, 3], auto_pad="SAME_LOWER"),
        "average_pool_dilated": one(
            "AveragePool", ["X"], X4, kernel_shape=[2, 2], dilations=[2, 1], pads=[1, 0, 0, 1], opset=19
        ),
        "average_pool_1d": one("AveragePool", ["X"], [("X", F, [2, 3, 9])], kernel_shape=[3], strides=[2]),
        "global_average_pool": one("GlobalAveragePool", ["X"], X4),
        "global_max_pool": one("GlobalMaxPool", ["X"], X4),
        "lp_pool": one("LpPool", ["X"], X4, kernel_shape=[2, 2], strides=[2, 1], pads=[0, 1, 1, 0]),
        "lp_pool_p1": one("LpPool", ["X"], X4, kernel_shape=[3, 2], p=1),
        "lp_pool_ceil": one("LpPool", ["X"], X4, kernel_shape=[2, 2], strides=[2, 2], ceil_mode=1, opset=18),
        "lp_pool_dilated": one("LpPool", ["X"], X4, kernel_shape=[2, 2], dilations=[2, 2], p=3, opset=18),
        "lrn": one("LRN", ["X"], [("X", F, [2, 6, 3, 3])], size=3, alpha=0.01, beta=0.6, bias=2.0),
        "lrn_5": one("LRN", ["X"], [("X", F, [2, 7, 3, 2])], size=5),
    },
    strategies={
        "lrn": one("LRN", ["X"], [("X", F, [4, 8, 4, 4])], size=3),
    },
)
