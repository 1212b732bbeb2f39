"""Normalisations: BatchNormalization, Instance-, Group-, Layer- and RMSNormalization, Softmax family.

BatchNormalization with running statistics (ONNX inference form) is a per-channel affine map:
every dimension may be split and the per-channel parameters follow the channel split.
(Training frameworks compute batch statistics per device in data parallel, as MindSpore does
without SyncBatchNorm; the graph's semantics here are the ONNX ones.) In training form
(``training_mode``, which the importer restores where PyTorch's exporter recorded a training
BatchNorm: `autopar.graph.records`) it normalises with the batch's own statistics: batch and
spatial axes stay whole, as the other normalisations keep theirs.

The others normalise over some axes: those stay whole on each rank (splitting them would need
a cross-device reduction inside the operator); the remaining axes split freely.
GroupNormalization (opset 21: scale and bias per channel) normalises each group of channels:
the channels split by whole groups, a rank normalising its ``num_groups / f`` groups (its local
kernels say so), scale and bias split alike. Opsets 18 to 20 (scale and bias per group) are not
registered: onnx's checker refuses them as deprecated, so no such model imports.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from autopar.ops.base import OpSpec, dim_labels, named_outputs, normalize_axis, shape
from autopar.ops.cases import X4, F, named, one, ones, weight
from autopar.ops.registry import Keeps, LocalCall, MindSporePrimitive, register

if TYPE_CHECKING:
    from autopar.ops.views import GraphView, NodeView


def batch_norm_flops(
    in_shapes: Sequence[Sequence[int] | None], out_shapes: Sequence[Sequence[int]], attrs: Mapping[str, Any]
) -> float:
    """Normalise, then scale and shift: about four element-wise operations per output element."""
    return 4.0 * math.prod(out_shapes[0])


# scale (1) and running variance (4) are drawn positive for verification; the running mean and
# variance (3, 4) are statistics, stored like parameters but never trained
def _per_channel(value: Any, rank: int) -> Any:
    return value.reshape([1, -1] + [1] * (rank - 2))


def torch_batch_norm(t: Any, op: NodeView, inputs: list[Any]) -> list[Any]:
    """The inference form normalises with the running statistics it reads, passed through as extra outputs.

    With ``training_mode`` (opset 14) it normalises with the batch's own mean and (population)
    variance and outputs the running statistics updated by ``momentum``.
    """
    x, scale, bias, mean, var = inputs[:5]
    eps = float(op.attrs.get("epsilon", 1e-5))
    rank = x.dim()
    extra = [mean, var]
    if int(op.attrs.get("training_mode", 0)):
        axes = (0,) + tuple(range(2, rank))
        batch_mean, batch_var = x.mean(dim=axes), x.var(dim=axes, unbiased=False)
        momentum = float(op.attrs.get("momentum", 0.9))
        extra = [mean * momentum + batch_mean * (1 - momentum), var * momentum + batch_var * (1 - momentum)]
        mean, var = batch_mean, batch_var
    y = (x - _per_channel(mean, rank)) / t.sqrt(_per_channel(var, rank) + eps)
    outputs = [y * _per_channel(scale, rank) + _per_channel(bias, rank)]
    return named_outputs(op, outputs + extra)


def torch_instance_norm(t: Any, op: NodeView, inputs: list[Any]) -> list[Any]:
    x, scale, bias = inputs[:3]
    axes = tuple(range(2, x.dim()))
    mean = x.mean(dim=axes, keepdim=True)
    var = ((x - mean) ** 2).mean(dim=axes, keepdim=True)
    y = (x - mean) / t.sqrt(var + float(op.attrs.get("epsilon", 1e-5)))
    return [y * _per_channel(scale, x.dim()) + _per_channel(bias, x.dim())]


def torch_layer_norm(t: Any, op: NodeView, inputs: list[Any]) -> list[Any]:
    """Normalise over the axes from ``axis`` on; Mean and InvStdDev keep those axes as size 1."""
    x = inputs[0]
    axes = tuple(range(normalize_axis(int(op.attrs.get("axis", -1)), x.dim()), x.dim()))
    mean = x.mean(dim=axes, keepdim=True)
    inv = t.rsqrt(((x - mean) ** 2).mean(dim=axes, keepdim=True) + float(op.attrs.get("epsilon", 1e-5)))
    y = (x - mean) * inv
    if len(inputs) > 1 and inputs[1] is not None:
        y = y * inputs[1]
    if len(inputs) > 2 and inputs[2] is not None:
        y = y + inputs[2]
    return named_outputs(op, [y, mean, inv])


def torch_group_norm(t: Any, op: NodeView, inputs: list[Any], groups: int | None = None) -> list[Any]:
    """Normalise each sample's groups of channels, then scale and shift each channel."""
    x, scale, bias = inputs[:3]
    groups = int(op.attrs["num_groups"]) if groups is None else groups
    grouped = x.reshape(x.shape[0], groups, -1)
    mean = grouped.mean(dim=2, keepdim=True)
    var = ((grouped - mean) ** 2).mean(dim=2, keepdim=True)
    y = ((grouped - mean) / t.sqrt(var + float(op.attrs.get("epsilon", 1e-5)))).reshape(x.shape)
    return [y * _per_channel(scale, x.dim()) + _per_channel(bias, x.dim())]


def _local_groups(call: LocalCall) -> int:
    """The groups a rank normalises: ``num_groups`` over the channel split."""
    return int(call.op.attrs["num_groups"]) >> len(call.bits.get("c", ()))


def _group_norm_local(call: LocalCall) -> list[np.ndarray]:
    """GroupNormalization on a rank's channels, whole groups each (numpy, for the virtual devices)."""
    x, scale, bias = (np.asarray(value) for value in call.inputs[:3])
    groups = _local_groups(call)
    grouped = x.reshape(x.shape[0], groups, -1).astype(np.float64)
    mean = grouped.mean(axis=2, keepdims=True)
    var = ((grouped - mean) ** 2).mean(axis=2, keepdims=True)
    y = ((grouped - mean) / np.sqrt(var + float(call.op.attrs.get("epsilon", 1e-5)))).reshape(x.shape)
    return [(y * _per_channel(scale, x.ndim) + _per_channel(bias, x.ndim)).astype(x.dtype)]


def _group_norm_local_torch(call: LocalCall) -> list[Any]:
    """GroupNormalization on a rank's channels, whole groups each (torch, differentiable)."""
    torch = sys.modules[type(call.inputs[0]).__module__.split(".")[0]]
    return torch_group_norm(torch, call.op, call.inputs, groups=_local_groups(call))


def torch_rms_norm(t: Any, op: NodeView, inputs: list[Any]) -> list[Any]:
    """Divide by the root mean square over the axes from ``axis`` on, then scale."""
    x = inputs[0]
    axes = tuple(range(normalize_axis(int(op.attrs.get("axis", -1)), x.dim()), x.dim()))
    inv = t.rsqrt((x * x).mean(dim=axes, keepdim=True) + float(op.attrs.get("epsilon", 1e-5)))
    return [x * inv * inputs[1]]


def _flattened(x: Any, axis: int, function: Any) -> Any:
    """Before opset 13 the axes from ``axis`` on are one: apply ``function`` to the 2-D view."""
    return function(x.reshape(int(math.prod(x.shape[:axis])), -1), 1).reshape(x.shape)


def _hardmax(t: Any, x: Any, dim: int) -> Any:
    return t.nn.functional.one_hot(x.argmax(dim=dim), x.shape[dim]).movedim(-1, dim).to(x.dtype)


def _normaliser(t: Any, op: NodeView) -> Any:
    """Softmax, LogSoftmax or Hardmax as a function of (tensor, dim)."""
    if op.op_type == "Hardmax":
        return lambda value, dim: _hardmax(t, value, dim)
    return t.softmax if op.op_type == "Softmax" else t.log_softmax


def torch_softmax(t: Any, op: NodeView, inputs: list[Any]) -> list[Any]:
    x = inputs[0]
    return [_normaliser(t, op)(x, normalize_axis(int(op.attrs.get("axis", -1)), x.dim()))]


def torch_softmax_flattened(t: Any, op: NodeView, inputs: list[Any]) -> list[Any]:
    x = inputs[0]
    function = _normaliser(t, op)
    return [_flattened(x, normalize_axis(int(op.attrs.get("axis", 1)), x.dim()), function)]


def batch_statistics(op: Any) -> bool:
    """Whether an operator (an `autopar.graph.OpNode`) normalises with its batch's own statistics: a
    BatchNormalization in training form. Micro-batches would change what it computes.
    """
    return op.op_type == "BatchNormalization" and not op.domain and bool(int(op.attrs.get("training_mode", 0)))


@register(
    "BatchNormalization",
    mindspore=MindSporePrimitive("ops.BatchNorm", 5),
    flops=batch_norm_flops,
    keeps=Keeps.INPUTS,
    weight_inputs=True,
    statistics_inputs=frozenset({3, 4}),
    positive_inputs=frozenset({1, 4}),
    torch_kernel=torch_batch_norm,
)
def batch_norm(op: NodeView, graph: GraphView) -> OpSpec:
    """Inference form: every axis splits. Training form: the batch's statistics are the operator's own,
    so the axes they reduce (batch and spatial) stay whole and only channels split."""
    rank = len(shape(graph, op.inputs[0]))
    x = dim_labels(rank)
    if int(op.attrs.get("training_mode", 0)):
        x = (None, x[1]) + tuple(None for _ in range(rank - 2))
    channel = (x[1],)
    inputs = (x,) + tuple(channel if name else None for name in op.inputs[1:])
    outputs = (x,) + tuple(channel for name in op.outputs[1:] if name)
    return OpSpec(inputs=inputs, outputs=outputs)


@register(
    "InstanceNormalization", mindspore=None, keeps=Keeps.INPUTS | Keeps.STATISTICS, torch_kernel=torch_instance_norm
)
def instance_norm(op: NodeView, graph: GraphView) -> OpSpec:
    rank = len(shape(graph, op.inputs[0]))
    x = ("d0", "d1") + tuple(None for _ in range(rank - 2))
    return OpSpec(inputs=(x, ("d1",), ("d1",)), outputs=(x,))


@register(
    "LayerNormalization",
    mindspore=MindSporePrimitive("ops.LayerNorm", 3),
    keeps=Keeps.INPUTS | Keeps.STATISTICS,
    weight_inputs=True,
    torch_kernel=torch_layer_norm,
)
def layer_norm(op: NodeView, graph: GraphView) -> OpSpec:
    """Leading axes split; the normalised axes (from ``axis`` on), scale and bias stay whole."""
    rank = len(shape(graph, op.inputs[0]))
    axis = normalize_axis(int(op.attrs.get("axis", -1)), rank)
    x = tuple(f"d{d}" if d < axis else None for d in range(rank))
    inputs = (x,) + tuple(tuple(None for _ in shape(graph, name)) if name else None for name in op.inputs[1:])
    statistics = x[:axis] + tuple(None for _ in range(rank - axis))  # Mean and InvStdDev keep size-1 axes
    outputs = tuple(() if not name else x if position == 0 else statistics for position, name in enumerate(op.outputs))
    return OpSpec(inputs=inputs, outputs=outputs)


@register(
    "GroupNormalization",
    since=21,
    mindspore=None,
    keeps=Keeps.INPUTS | Keeps.STATISTICS,
    weight_inputs=True,
    local_kernel=_group_norm_local,
    torch_kernel=torch_group_norm,
    torch_local_kernel=_group_norm_local_torch,
)
def group_norm(op: NodeView, graph: GraphView) -> OpSpec:
    """Batch and whole groups of channels split; scale and bias (one value per channel) follow the channels.

    A split of the channels by f must leave whole groups, so f must divide ``num_groups`` as
    well: that holds for every power of two dividing the channels when a group holds an odd
    number of channels; otherwise the channels stay whole.
    """
    x_shape = shape(graph, op.inputs[0])
    channels, groups = x_shape[1], int(op.attrs["num_groups"])
    c = "c" if (channels // groups) % 2 == 1 else None
    x = ("n", c) + tuple(None for _ in x_shape[2:])
    return OpSpec(inputs=(x, (c,), (c,)), outputs=(x,))


@register(
    "RMSNormalization",
    since=23,
    mindspore=MindSporePrimitive("ops.RmsNorm", 2),
    keeps=Keeps.INPUTS | Keeps.STATISTICS,
    weight_inputs=True,
    torch_kernel=torch_rms_norm,
)
def rms_norm(op: NodeView, graph: GraphView) -> OpSpec:
    """Leading axes split; the normalised axes (from ``axis`` on) and the scale stay whole."""
    rank = len(shape(graph, op.inputs[0]))
    axis = normalize_axis(int(op.attrs.get("axis", -1)), rank)
    x = tuple(f"d{d}" if d < axis else None for d in range(rank))
    return OpSpec(inputs=(x, tuple(None for _ in shape(graph, op.inputs[1]))), outputs=(x,))


def _softmax(op: NodeView, graph: GraphView, axis: int, whole: set[int]) -> OpSpec:
    rank = len(shape(graph, op.inputs[0]))
    labels = tuple(None if d in whole else f"d{d}" for d in range(rank))
    return OpSpec(inputs=(labels,), outputs=(labels,))


_SOFTMAX = {"Softmax": "ops.Softmax", "LogSoftmax": "ops.LogSoftmax"}


@register("Softmax", "LogSoftmax", since=13, mindspore=_SOFTMAX, keeps=Keeps.OUTPUTS, torch_kernel=torch_softmax)
@register("Hardmax", since=13, mindspore=None, differentiable=False, keeps=Keeps.NOTHING, torch_kernel=torch_softmax)
def softmax(op: NodeView, graph: GraphView) -> OpSpec:
    """Opset 13 on: one axis (default the last) is normalised; the others split."""
    rank = len(shape(graph, op.inputs[0]))
    axis = normalize_axis(int(op.attrs.get("axis", -1)), rank)
    return _softmax(op, graph, axis, {axis})


@register(
    "Softmax", "LogSoftmax", until=12, mindspore=_SOFTMAX, keeps=Keeps.OUTPUTS, torch_kernel=torch_softmax_flattened
)
@register(
    "Hardmax", until=12, mindspore=None, differentiable=False, keeps=Keeps.NOTHING, torch_kernel=torch_softmax_flattened
)
def softmax_flattened(op: NodeView, graph: GraphView) -> OpSpec:
    """Before opset 13: every axis from ``axis`` (default 1) on is flattened into one and normalised."""
    rank = len(shape(graph, op.inputs[0]))
    axis = normalize_axis(int(op.attrs.get("axis", 1)), rank)
    return _softmax(op, graph, axis, set(range(axis, rank)))


# --- the operator alone in tiny models, checked by the operator tests (`autopar.ops.cases`) -----

CASES = named(
    kernel={
        "batch_norm": one(
            "BatchNormalization", ["X", "s", "b", "m", "v"], X4, [ones(n, [3]) for n in "sbmv"], epsilon=1e-3
        ),
        "batch_norm_training": one(
            "BatchNormalization",
            ["X", "s", "b", "m", "v"],
            X4,
            [ones(n, [3]) for n in "sbmv"],
            outputs=("Y", "RM", "RV"),
            training_mode=1,
            momentum=0.8,
        ),
        "instance_norm": one(
            "InstanceNormalization", ["X", "s", "b"], X4, [ones("s", [3]), ones("b", [3])], epsilon=1e-3
        ),
        "layer_norm_statistics": one(
            "LayerNormalization",
            ["X", "s", "b"],
            X4,
            [ones("s", [5, 6]), ones("b", [5, 6])],
            axis=2,
            outputs=("Y", "M", "I"),
        ),
        "layer_norm_no_bias": one("LayerNormalization", ["X", "s"], X4, [ones("s", [6])], epsilon=0.1),
        "layer_norm_without_its_mean": one(  # an omitted output between named ones: each value to its own name
            "LayerNormalization", ["X", "s"], X4, [ones("s", [6])], outputs=("Y", "", "I")
        ),
        "softmax": one("Softmax", ["X"], X4, axis=1),
        "log_softmax": one("LogSoftmax", ["X"], X4),
        "hardmax": one("Hardmax", ["X"], X4, axis=2),
        "softmax_opset11": one("Softmax", ["X"], X4, opset=11),
        "log_softmax_opset11": one("LogSoftmax", ["X"], X4, axis=2, opset=11),
        "hardmax_opset11": one("Hardmax", ["X"], X4, opset=11),
        "group_norm": one(
            "GroupNormalization",
            ["X", "s", "b"],
            [("X", F, [2, 4, 3, 5])],
            [ones("s", [4]), ones("b", [4])],
            num_groups=2,
            epsilon=1e-3,
            opset=21,
            declared=[("Y", F, [2, 4, 3, 5])],
        ),
        "rms_norm": one("RMSNormalization", ["X", "s"], X4, [ones("s", [6])], opset=23),
        "rms_norm_axis": one("RMSNormalization", ["X", "s"], X4, [ones("s", [5, 6])], axis=2, epsilon=0.1, opset=23),
    },
    strategies={
        "layer_norm": one(
            "LayerNormalization",
            ["X", "g", "b"],
            [("X", F, [4, 8, 16])],
            consts=[weight("g", [16]), weight("b", [16], 1)],
            axis=-1,
            epsilon=1e-5,
        ),
        "instance_norm": one(
            "InstanceNormalization",
            ["X", "g", "b"],
            [("X", F, [4, 8, 6])],
            consts=[weight("g", [8]), weight("b", [8], 1)],
        ),
        "softmax": one("Softmax", ["X"], [("X", F, [4, 8, 16])], axis=1),
        "softmax_opset11": one("Softmax", ["X"], [("X", F, [4, 8, 16])], axis=1, opset=11),
        "log_softmax": one("LogSoftmax", ["X"], [("X", F, [4, 8, 16])]),
        "group_norm": one(
            "GroupNormalization",
            ["X", "g", "b"],
            [("X", F, [4, 8, 2, 3])],
            consts=[weight("g", [8]), weight("b", [8], 1)],
            num_groups=8,
            opset=21,
            declared=[("Y", F, [4, 8, 2, 3])],
        ),
        "group_norm_even_groups": one(
            "GroupNormalization",
            ["X", "g", "b"],
            [("X", F, [4, 8, 6])],
            consts=[weight("g", [8]), weight("b", [8], 1)],
            num_groups=4,
            opset=21,
            declared=[("Y", F, [4, 8, 6])],
        ),
        "rms_norm": one("RMSNormalization", ["X", "g"], [("X", F, [4, 8, 16])], consts=[weight("g", [16])], opset=23),
    },
)
