"""Pooling: batch and channels split freely; windows stay whole; global pools reduce space locally."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from autopar.ops.base import OpSpec, no_split, shape
from autopar.ops.registry import Keeps, input_elements, register

if TYPE_CHECKING:
    from autopar.graph.types import Graph, OpNode


def window_flops(
    in_shapes: Sequence[Sequence[int] | None], out_shapes: Sequence[Sequence[int]], attrs: Mapping[str, Any]
) -> float:
    """One operation per window element per output element."""
    return float(math.prod(out_shapes[0]) * math.prod(attrs.get("kernel_shape", [1])))


def pool(op: OpNode, graph: Graph) -> OpSpec:
    rank = len(shape(graph, op.inputs[0]))
    channel = None if op.op_type == "LRN" else "c"  # LRN mixes neighbouring channels
    labels = ("n", channel) + no_split(rank - 2)
    outputs = tuple(labels if name else () for name in op.outputs)
    return OpSpec(inputs=(labels,), outputs=outputs)


def _window(op: OpNode, x: Any) -> tuple[list[int], list[int], list[int], list[int], list[int]]:
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


def torch_pool(t: Any, op: OpNode, inputs: list[Any]) -> list[Any]:
    """Pools through torch's, padded explicitly so ONNX's asymmetric pads and ceil_mode hold."""
    x = inputs[0]
    f, kind, spatial = t.nn.functional, op.op_type, x.dim() - 2
    if kind == "GlobalAveragePool":
        return [x.mean(dim=tuple(range(2, x.dim())), keepdim=True)]
    if kind == "GlobalMaxPool":
        return [x.amax(dim=tuple(range(2, x.dim())), keepdim=True)]
    if kind == "LRN":
        alpha, beta = float(op.attrs.get("alpha", 1e-4)), float(op.attrs.get("beta", 0.75))
        return [f.local_response_norm(x, int(op.attrs["size"]), alpha, beta, float(op.attrs.get("bias", 1.0)))]
    kernel, strides, begin, end, dilations = _window(op, x)
    ceil = bool(int(op.attrs.get("ceil_mode", 0)))
    if kind == "MaxPool":
        padded = _pad_trailing(t, x, begin, end, float("-inf"))
        pool = getattr(f, f"max_pool{spatial}d")
        return [pool(padded, kernel, strides, 0, dilations, ceil_mode=ceil)]
    if kind == "AveragePool":
        padded = _pad_trailing(t, x, begin, end, 0.0)
        pool = getattr(f, f"avg_pool{spatial}d")
        total = pool(padded, kernel, strides, 0, ceil_mode=ceil) * math.prod(kernel)
        if int(op.attrs.get("count_include_pad", 0)):
            return [total / math.prod(kernel)]
        count = pool(_pad_trailing(t, t.ones_like(x), begin, end, 0.0), kernel, strides, 0, ceil_mode=ceil)
        return [total / (count * math.prod(kernel))]
    p = int(op.attrs.get("p", 2))  # LpPool: (sum |x|^p)^(1/p) over each window
    padded = _pad_trailing(t, x.abs() ** p, begin, end, 0.0)
    pool = getattr(f, f"avg_pool{spatial}d")
    return [(pool(padded, kernel, strides, 0, ceil_mode=ceil) * math.prod(kernel)) ** (1.0 / p)]


register("MaxPool", flops=window_flops, keeps=Keeps.INPUTS | Keeps.OUTPUTS, torch_kernel=torch_pool)(
    pool
)  # the argmax of each window
register("AveragePool", flops=window_flops, keeps=Keeps.NOTHING, torch_kernel=torch_pool)(pool)
register("GlobalAveragePool", flops=input_elements, keeps=Keeps.NOTHING, torch_kernel=torch_pool)(pool)
register("GlobalMaxPool", flops=input_elements, keeps=Keeps.INPUTS | Keeps.OUTPUTS, torch_kernel=torch_pool)(pool)
register("LpPool", "LRN", keeps=Keeps.INPUTS | Keeps.OUTPUTS, torch_kernel=torch_pool)(pool)
