"""Convolution: split the batch (n), output channels (o) and input channels (c, partial sums).

Spatial dimensions stay whole: splitting them needs halo exchanges, which this rule leaves out.
Grouped convolutions split only the batch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from autopar.ops.base import OpSpec, no_split, shape
from autopar.ops.cases import X4, F, named, one, ones
from autopar.ops.registry import Keeps, MindSporePrimitive, declare, register

if TYPE_CHECKING:
    from autopar.ops.views import GraphView, NodeView


def conv_flops(
    in_shapes: Sequence[Sequence[int] | None], out_shapes: Sequence[Sequence[int]], attrs: Mapping[str, Any]
) -> float:
    """Two FLOPs per multiply-add over (C/groups) x kh x kw per output element, plus the bias."""
    weight = in_shapes[1] or ()
    out = math.prod(out_shapes[0])
    flops = 2.0 * out * math.prod(weight[1:])
    if len(in_shapes) > 2 and in_shapes[2]:
        flops += out
    return flops


def _padding(
    t: Any, op: NodeView, x: Any, kernel: Sequence[int], strides: Sequence[int], dilations: Sequence[int]
) -> Any:
    """x padded as ``pads`` or ``auto_pad`` say (ONNX allows different begin and end pads)."""
    spatial = x.dim() - 2
    auto = op.attrs.get("auto_pad", "NOTSET")
    if auto in ("SAME_UPPER", "SAME_LOWER"):
        pads = [0] * (2 * spatial)
        for d in range(spatial):
            size = x.shape[2 + d]
            out = -(-size // strides[d])
            total = max(0, (out - 1) * strides[d] + (kernel[d] - 1) * dilations[d] + 1 - size)
            small, large = total // 2, total - total // 2
            pads[d], pads[spatial + d] = (small, large) if auto == "SAME_UPPER" else (large, small)
    elif auto == "VALID":
        pads = [0] * (2 * spatial)
    else:
        pads = [int(p) for p in op.attrs.get("pads", [0] * (2 * spatial))]
    flat: list[int] = []
    for d in reversed(range(spatial)):
        flat += [pads[d], pads[spatial + d]]
    return t.nn.functional.pad(x, flat) if any(flat) else x


def torch_conv(t: Any, op: NodeView, inputs: list[Any]) -> list[Any]:
    x, w = inputs[0], inputs[1]
    spatial = x.dim() - 2
    kernel = [int(k) for k in op.attrs.get("kernel_shape", w.shape[2:])]
    strides = [int(s) for s in op.attrs.get("strides", [1] * spatial)]
    dilations = [int(d) for d in op.attrs.get("dilations", [1] * spatial)]
    bias = inputs[2] if len(inputs) > 2 else None
    function = getattr(t.nn.functional, f"conv{spatial}d")
    x = _padding(t, op, x, kernel, strides, dilations)
    return [function(x, w, bias, stride=strides, dilation=dilations, groups=int(op.attrs.get("group", 1)))]


def torch_conv_transpose(t: Any, op: NodeView, inputs: list[Any]) -> list[Any]:
    """ConvTranspose: the full transposed convolution, then ``output_padding`` added and ``pads`` cropped.

    ONNX allows different begin and end pads, pads worked out from ``output_shape`` or ``auto_pad``,
    and output padding at least the stride; torch's operator allows none of these, so the full
    result is padded or cropped (`pad` with negative sizes crops) before the bias is added.
    """
    x, w = inputs[0], inputs[1]
    spatial = x.dim() - 2
    strides = [int(s) for s in op.attrs.get("strides", [1] * spatial)]
    dilations = [int(d) for d in op.attrs.get("dilations", [1] * spatial)]
    extra = [int(p) for p in op.attrs.get("output_padding", [0] * spatial)]
    groups = int(op.attrs.get("group", 1))
    function = getattr(t.nn.functional, f"conv_transpose{spatial}d")
    out = function(x, w, None, stride=strides, groups=groups, dilation=dilations)
    full = [
        (x.shape[2 + d] - 1) * strides[d] + extra[d] + (w.shape[2 + d] - 1) * dilations[d] + 1 for d in range(spatial)
    ]
    pads = [int(p) for p in op.attrs.get("pads", [0] * (2 * spatial))]
    auto = op.attrs.get("auto_pad", "NOTSET")
    if "output_shape" in op.attrs or auto in ("SAME_UPPER", "SAME_LOWER"):
        shape = [int(s) for s in op.attrs.get("output_shape", [x.shape[2 + d] * strides[d] for d in range(spatial)])]
        for d in range(spatial):
            total = full[d] - shape[-spatial + d]
            small, large = total // 2, total - total // 2
            pads[d], pads[spatial + d] = (small, large) if auto == "SAME_UPPER" else (large, small)
    elif auto == "VALID":
        pads = [0] * (2 * spatial)
    flat: list[int] = []
    for d in reversed(range(spatial)):
        flat += [-pads[d], extra[d] - pads[spatial + d]]
    out = t.nn.functional.pad(out, flat)
    if len(inputs) > 2 and inputs[2] is not None:
        out = out + inputs[2].reshape([1, -1] + [1] * spatial)
    return [out]


@register(
    "Conv",
    mindspore=MindSporePrimitive(
        "ops.Conv2D", 2, needs_args=True, note="ops.Conv3D for 5-D data; the bias is a BiasAdd"
    ),
    flops=conv_flops,
    keeps=Keeps.OPERANDS,
    weight_inputs=True,
    torch_kernel=torch_conv,
)
def conv(op: NodeView, graph: GraphView) -> OpSpec:
    x_rank = len(shape(graph, op.inputs[0]))
    spatial = x_rank - 2
    grouped = int(op.attrs.get("group", 1)) != 1
    channel = None if grouped else "c"
    out_channel = None if grouped else "o"
    x = ("n", channel) + no_split(spatial)
    w = (out_channel, channel) + no_split(spatial)
    inputs: list = [x, w]
    if len(op.inputs) > 2 and op.inputs[2]:
        inputs.append((out_channel,))
    y = ("n", out_channel) + no_split(spatial)
    return OpSpec(inputs=tuple(inputs), outputs=(y,), op_class="cube", local_once_inputs=(2,))


declare(
    "ConvTranspose",
    mindspore=MindSporePrimitive("ops.Conv2DTranspose", 2, needs_args=True),
    keeps=Keeps.OPERANDS,
    weight_inputs=True,
    torch_kernel=torch_conv_transpose,
)


# --- the operator alone in tiny models, checked by the operator tests (`autopar.ops.cases`) -----

CASES = named(
    kernel={
        "conv_pads": one(
            "Conv", ["X", "W", "b"], X4, [ones("W", [4, 3, 3, 2]), ones("b", [4])], pads=[1, 0, 0, 1], strides=[2, 1]
        ),
        "conv_same_lower": one(
            "Conv", ["X", "W"], X4, [ones("W", [4, 3, 3, 3])], auto_pad="SAME_LOWER", strides=[2, 2]
        ),
        "conv_grouped_dilated": one(
            "Conv", ["X", "W"], [("X", F, [2, 4, 7, 7])], [ones("W", [6, 2, 3, 3])], group=2, dilations=[2, 1]
        ),
        "conv_1d": one("Conv", ["X", "W"], [("X", F, [2, 3, 9])], [ones("W", [4, 3, 3])], auto_pad="SAME_UPPER"),
        "conv_transpose": one(
            "ConvTranspose",
            ["X", "W", "b"],
            X4,
            [ones("W", [3, 2, 3, 3]), ones("b", [2])],
            strides=[2, 2],
            pads=[1, 0, 0, 1],
            output_padding=[1, 0],
        ),
        "conv_transpose_same": one(
            "ConvTranspose", ["X", "W"], X4, [ones("W", [3, 2, 3, 3])], strides=[2, 2], auto_pad="SAME_UPPER"
        ),
        "conv_transpose_shape": one(
            "ConvTranspose",
            ["X", "W"],
            X4,
            [ones("W", [3, 2, 3, 3])],
            strides=[2, 2],
            output_shape=[10, 12],
            dilations=[1, 2],
        ),
    },
)
