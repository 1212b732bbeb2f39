"""Indexing operators: OneHot, Gather, GatherElements, GatherND, ScatterND, ScatterElements.

OneHot splits the indices' dimensions and the new class dimension. A rank holding classes
[c0, c0 + depth/f) writes ones where ``index - c0`` falls in its range. The strategy names the
output's dimensions first, as MindSpore's OneHot strategy does.

Gather may split the gathered axis too (an embedding table split by vocabulary rows): a rank
looks up only the rows it holds and writes zeros for the others, so the output is a partial
sum across the split, exactly one rank contributing each row (Megatron's vocab-parallel
embedding).

GatherND and ScatterND index their leading data axes with the last axis of ``indices``. The batch
axes (GatherND's ``batch_dims``), the indices' other axes (GatherND) and the trailing slice axes
split as any axis does. The indexed axes split too, as Gather's gathered axis does: GatherND on a
rank holding a block of them looks up only the index tuples that fall in its block and writes zeros
for the others, so its output is a partial sum over those bits (exactly one rank holds each tuple's
slice: a stack of expert weights split by experts, gathered per routed token); ScatterND on such a
rank writes only the updates whose tuples fall in its block, and its output keeps the block (every
reduction is exact that way). With ``reduction="add"`` the indices' leading axes (and the updates'
alike) split as well: each rank adds its share of the updates, the data is added by the first rank
of the group only, and the output is a partial sum (the tokens an expert group returns, summed where
their owners want them). ScatterElements, like GatherElements, splits every axis but the one it
indexes where data, indices and updates have the same size.
"""

from __future__ import annotations

import math
import sys
from typing import TYPE_CHECKING, Any

import numpy as np

from autopar.layout import shard_index
from autopar.ops.base import OpSpec, as_ints, dim_labels, normalize_axis, shape, tensors
from autopar.ops.cases import I64, X2, X4, F, const, ints, named, one, ones, weight
from autopar.ops.registry import Keeps, LocalCall, MindSporePrimitive, register

if TYPE_CHECKING:
    from autopar.ops.views import GraphView, NodeView

GATHERED = "g"
CLASSES = "cls"


def _one_hot_local(call: LocalCall) -> list[np.ndarray]:
    """OneHot on a rank's slice of the class axis: ones where (index - first class) falls in range."""
    indices = np.asarray(call.inputs[0]).astype(np.int64)
    depth = int(np.asarray(call.inputs[1]).reshape(-1)[0])
    values = np.asarray(call.inputs[2])
    off_value, on_value = values.reshape(-1)[:2]
    axis = call.spec.outputs[0].index(CLASSES)
    bits = call.bits[CLASSES]
    local_depth = depth >> len(bits)
    indices = np.where(indices < 0, indices + depth, indices) - shard_index(call.rank, bits) * local_depth
    classes = np.arange(local_depth).reshape([-1 if d == axis else 1 for d in range(indices.ndim + 1)])
    hot = np.expand_dims(indices, axis) == classes
    return [np.where(hot, on_value, off_value).astype(values.dtype)]


def _one_hot_depth(op: NodeView, graph: GraphView) -> int | None:
    depth = graph.tensor(op.inputs[1]).value
    return None if depth is None else int(np.asarray(depth).reshape(-1)[0])


def _gathered_axis_size(op: NodeView, graph: GraphView) -> int:
    data_shape = graph.tensor(op.inputs[0]).shape
    return data_shape[int(op.attrs.get("axis", 0)) % len(data_shape)]


def _gather_local(call: LocalCall) -> list[np.ndarray]:
    """Gather from a rank's rows of a split gathered axis; indices outside them give zeros."""
    bits = call.bits.get(GATHERED, ())
    if not bits:
        return call.run(call.inputs)
    data = np.asarray(call.inputs[0])
    indices = np.asarray(call.inputs[1]).astype(np.int64)
    labels = call.spec.inputs[0] or ()
    axis = labels.index(GATHERED)
    full = call.graph.tensor(call.op.inputs[0]).shape[axis]
    local = data.shape[axis]
    indices = np.where(indices < 0, indices + full, indices) - shard_index(call.rank, bits) * local
    held = (indices >= 0) & (indices < local)
    picked = np.take(data, np.where(held, indices, 0), axis=axis)
    mask = held.reshape((1,) * axis + held.shape + (1,) * (data.ndim - axis - 1))
    return [np.where(mask, picked, np.zeros((), dtype=data.dtype))]


def _take(x: Any, indices: Any, axis: int) -> Any:
    """x's entries along ``axis`` at ``indices`` (any shape): ONNX Gather, differentiable in x."""
    picked = x.index_select(axis, indices.reshape(-1))
    return picked.reshape(tuple(x.shape[:axis]) + tuple(indices.shape) + tuple(x.shape[axis + 1 :]))


def torch_gather(t: Any, op: NodeView, inputs: list[Any]) -> list[Any]:
    x, indices = inputs[0], tensors(t, inputs)[1].long()
    axis = normalize_axis(int(op.attrs.get("axis", 0)), x.dim())
    return [_take(x, t.where(indices < 0, indices + x.shape[axis], indices), axis)]


def torch_gather_elements(t: Any, op: NodeView, inputs: list[Any]) -> list[Any]:
    x, indices = inputs[0], tensors(t, inputs)[1].long()
    axis = normalize_axis(int(op.attrs.get("axis", 0)), x.dim())
    return [t.gather(x, axis, t.where(indices < 0, indices + x.shape[axis], indices))]


def torch_one_hot(t: Any, op: NodeView, inputs: list[Any]) -> list[Any]:
    """OneHot whole: the same as a rank holding every class."""
    return _one_hot_torch(t, op, inputs, first=0, depth=as_ints(inputs[1])[0], local_depth=as_ints(inputs[1])[0])


def _one_hot_torch(t: Any, op: NodeView, inputs: list[Any], first: int, depth: int, local_depth: int) -> list[Any]:
    indices = inputs[0].long()
    values = tensors(t, inputs)[2].reshape(-1)  # (off, on), maybe a numpy constant
    rank = indices.dim() + 1
    axis = normalize_axis(int(op.attrs.get("axis", -1)), rank)
    indices = t.where(indices < 0, indices + depth, indices) - first
    classes = t.arange(local_depth, device=indices.device).reshape([-1 if d == axis else 1 for d in range(rank)])
    hot = indices.unsqueeze(axis) == classes
    return [t.where(hot, values[1], values[0])]


def _one_hot_local_torch(call: LocalCall) -> list[Any]:
    """OneHot on a rank's slice of the class axis, in torch (``call.run`` is the torch kernel)."""
    depth = as_ints(call.inputs[1])[0]
    local_depth = depth >> len(call.bits[CLASSES])
    first = shard_index(call.rank, call.bits[CLASSES]) * local_depth
    torch = _torch_of(call.inputs[0])
    return _one_hot_torch(torch, call.op, call.inputs, first, depth, local_depth)


def _torch_of(tensor: Any) -> Any:
    """The torch module a tensor belongs to (`autopar.ops` imports no torch of its own)."""
    return sys.modules[type(tensor).__module__.split(".")[0]]


def _gather_local_torch(call: LocalCall) -> list[Any]:
    """Gather from a rank's rows of a split gathered axis; other indices give zeros (differentiably)."""
    bits = call.bits.get(GATHERED, ())
    if not bits:
        return call.run(call.inputs)
    torch = _torch_of(call.inputs[0])
    data, indices = call.inputs[0], call.inputs[1].long()
    axis = (call.spec.inputs[0] or ()).index(GATHERED)
    full = call.graph.tensor(call.op.inputs[0]).shape[axis]
    local = data.shape[axis]
    indices = torch.where(indices < 0, indices + full, indices) - shard_index(call.rank, bits) * local
    held = (indices >= 0) & (indices < local)
    picked = _take(data, torch.where(held, indices, torch.zeros_like(indices)), axis)
    mask = held.reshape((1,) * axis + tuple(held.shape) + (1,) * (data.dim() - axis - 1))
    return [picked * mask.to(picked.dtype)]


@register(
    "OneHot",
    mindspore=MindSporePrimitive("ops.OneHot", 1, note="MindSpore's OneHot strategy names the output"),
    differentiable=False,
    keeps=Keeps.NOTHING,
    local_kernel=_one_hot_local,
    torch_kernel=torch_one_hot,
    torch_local_kernel=_one_hot_local_torch,
    index_bounds={0: _one_hot_depth},
    config_inputs=frozenset({1, 2}),
)
def one_hot(op: NodeView, graph: GraphView) -> OpSpec:
    indices = dim_labels(len(shape(graph, op.inputs[0])))
    out_rank = len(indices) + 1
    axis = normalize_axis(int(op.attrs.get("axis", -1)), out_rank)
    out = indices[:axis] + (CLASSES,) + indices[axis:]
    inputs = (indices, None, None)
    strategy = (out, None, None)
    return OpSpec(inputs=inputs, outputs=(out,), strategy_labels=strategy)


@register(
    "Gather",
    mindspore=MindSporePrimitive("ops.Gather", 2),
    keeps=Keeps.SELECTORS,
    local_kernel=_gather_local,
    index_bounds={1: _gathered_axis_size},
    torch_kernel=torch_gather,
    torch_local_kernel=_gather_local_torch,
)
def gather(op: NodeView, graph: GraphView) -> OpSpec:
    data_rank = len(shape(graph, op.inputs[0]))
    axis = normalize_axis(int(op.attrs.get("axis", 0)), data_rank)
    data = tuple(GATHERED if d == axis else f"d{d}" for d in range(data_rank))
    indices = dim_labels(len(shape(graph, op.inputs[1])), prefix="i")
    out = data[:axis] + indices + data[axis + 1 :]
    return OpSpec(inputs=(data, indices), outputs=(out,))


@register(
    "GatherElements",
    mindspore=MindSporePrimitive("ops.GatherD", 2),
    keeps=Keeps.SELECTORS,
    index_bounds={1: _gathered_axis_size},
    torch_kernel=torch_gather_elements,
)
def gather_elements(op: NodeView, graph: GraphView) -> OpSpec:
    data_shape = shape(graph, op.inputs[0])
    index_shape = shape(graph, op.inputs[1])
    axis = normalize_axis(int(op.attrs.get("axis", 0)), len(data_shape))
    labels = tuple(None if d == axis or data_shape[d] != index_shape[d] else f"d{d}" for d in range(len(data_shape)))
    return OpSpec(inputs=(labels, labels), outputs=(labels,))


def _linear_index(t: Any, indices: Any, sizes: tuple[int, ...]) -> Any:
    """Each index tuple (the last axis of ``indices``) as one position over ``sizes``, negatives wrapped."""
    linear = t.zeros(indices.shape[:-1], dtype=t.long, device=indices.device)
    for position, size in enumerate(sizes):
        index = indices[..., position]
        linear = linear * size + t.where(index < 0, index + size, index)
    return linear


def torch_gather_nd(t: Any, op: NodeView, inputs: list[Any]) -> list[Any]:
    """Slices of ``data`` at the index tuples of ``indices``, per batch entry when ``batch_dims`` > 0."""
    data, indices = inputs[0], tensors(t, inputs)[1].long()
    batch_dims = int(op.attrs.get("batch_dims", 0))
    depth = indices.shape[-1]
    batch = int(math.prod(data.shape[:batch_dims]))
    sizes = tuple(data.shape[batch_dims : batch_dims + depth])
    rest = tuple(data.shape[batch_dims + depth :])
    flat = data.reshape((batch, int(math.prod(sizes))) + rest)
    linear = _linear_index(t, indices, sizes).reshape(batch, -1)
    picked = flat[t.arange(batch, device=flat.device).unsqueeze(1), linear]
    return [picked.reshape(tuple(indices.shape[:-1]) + rest)]


_SCATTER_REDUCE = {"mul": "prod", "max": "amax", "min": "amin"}


def torch_scatter_nd(t: Any, op: NodeView, inputs: list[Any]) -> list[Any]:
    """``data`` with the slices at the index tuples replaced by (or combined with) ``updates``."""
    data, indices, updates = inputs[0], tensors(t, inputs)[1].long(), inputs[2]
    depth = indices.shape[-1]
    sizes, rest = tuple(data.shape[:depth]), tuple(data.shape[depth:])
    flat = data.reshape((int(math.prod(sizes)),) + rest)
    linear = _linear_index(t, indices, sizes).reshape(-1)
    values = updates.reshape((-1,) + rest)
    reduction = op.attrs.get("reduction", "none")
    if reduction in ("none", "add"):
        out = flat.index_put((linear,), values, accumulate=reduction == "add")
    else:
        index = linear.reshape((-1,) + (1,) * len(rest)).expand_as(values)
        out = flat.scatter_reduce(0, index, values, reduce=_SCATTER_REDUCE[reduction], include_self=True)
    return [out.reshape(data.shape)]


def torch_scatter_elements(t: Any, op: NodeView, inputs: list[Any]) -> list[Any]:
    """``data`` with ``updates`` written (or combined) along ``axis`` at ``indices``."""
    data, indices, updates = inputs[0], tensors(t, inputs)[1].long(), inputs[2]
    axis = normalize_axis(int(op.attrs.get("axis", 0)), data.dim())
    indices = t.where(indices < 0, indices + data.shape[axis], indices)
    reduction = op.attrs.get("reduction", "none")
    if reduction == "none":
        return [data.scatter(axis, indices, updates)]
    if reduction == "add":
        return [data.scatter_add(axis, indices, updates)]
    return [data.scatter_reduce(axis, indices, updates, reduce=_SCATTER_REDUCE[reduction], include_self=True)]


def _indexed_size(op: NodeView, graph: GraphView, first: int) -> int:
    """The smallest of the data axes the index tuples address, from axis ``first`` on."""
    depth = shape(graph, op.inputs[1])[-1]
    return min(shape(graph, op.inputs[0])[first : first + depth])


def _indexed_label(axis: int) -> str:
    """The label of a data axis an index tuple addresses (GatherND, ScatterND)."""
    return f"n{axis}"


def _local_tuples(call: LocalCall, first: int) -> tuple[np.ndarray, np.ndarray] | None:
    """The index tuples relative to this rank's block of the indexed data axes (from axis ``first``),
    negatives wrapped, and which of them fall in the block; None when no indexed axis is split."""
    full = call.graph.tensor(call.op.inputs[0]).shape
    indices = _numpy_of(call.inputs[1]).astype(np.int64)
    depth = indices.shape[-1]
    split = [(j, call.bits.get(_indexed_label(first + j), ())) for j in range(depth)]
    if not any(bits for _, bits in split):
        return None
    local = np.empty_like(indices)
    held = np.ones(indices.shape[:-1], dtype=bool)
    for j, bits in split:
        size = full[first + j]
        index = np.where(indices[..., j] < 0, indices[..., j] + size, indices[..., j])
        if bits:
            size >>= len(bits)
            index = index - shard_index(call.rank, bits) * size
            held &= (index >= 0) & (index < size)
        local[..., j] = index
    return local, held


def _numpy_of(value: Any) -> np.ndarray:
    """An index input as numpy, whether it arrives as a torch tensor or a numpy constant."""
    if hasattr(value, "detach"):
        return value.detach().cpu().numpy()
    return np.asarray(value)


def _gather_nd_local(call: LocalCall) -> list[np.ndarray]:
    """GatherND on a rank's block of the indexed axes: tuples outside it give zeros (a partial sum)."""
    found = _local_tuples(call, int(call.op.attrs.get("batch_dims", 0)))
    if found is None:
        return call.run(call.inputs)
    local, held = found
    out = np.asarray(call.run([call.inputs[0], np.where(held[..., None], local, 0)])[0])
    mask = held.reshape(held.shape + (1,) * (out.ndim - held.ndim))
    return [np.where(mask, out, np.zeros((), dtype=out.dtype))]


def _gather_nd_local_torch(call: LocalCall) -> list[Any]:
    """`_gather_nd_local` in torch, differentiable in the data."""
    found = _local_tuples(call, int(call.op.attrs.get("batch_dims", 0)))
    if found is None:
        return call.run(call.inputs)
    torch = _torch_of(call.inputs[0])
    local, held = found
    safe = torch.from_numpy(np.where(held[..., None], local, 0)).to(call.inputs[0].device)
    out = call.run([call.inputs[0], safe])[0]
    mask = torch.from_numpy(held.reshape(held.shape + (1,) * (out.dim() - held.ndim))).to(out.device)
    return [out * mask.to(out.dtype)]


_SCATTER_UFUNC = {"add": np.add, "mul": np.multiply, "max": np.maximum, "min": np.minimum}


def _scatter_nd_local(call: LocalCall) -> list[np.ndarray]:
    """ScatterND on a rank's block of the indexed axes: only the updates whose tuples fall in it are written."""
    found = _local_tuples(call, 0)
    if found is None:
        return call.run(call.inputs)
    local, held = found
    data, updates = np.asarray(call.inputs[0]), np.asarray(call.inputs[2])
    depth = local.shape[-1]
    rest = data.shape[depth:]
    out = data.reshape((-1,) + rest).copy()
    linear = np.ravel_multi_index(tuple(local[held].T), data.shape[:depth]) if held.any() else np.zeros(0, np.int64)
    values = updates[held].reshape((-1,) + rest)
    reduction = call.op.attrs.get("reduction", "none")
    if reduction == "none":
        out[linear] = values
    else:
        _SCATTER_UFUNC[reduction].at(out, linear, values)
    return [out.reshape(data.shape)]


def _scatter_nd_local_torch(call: LocalCall) -> list[Any]:
    """`_scatter_nd_local` in torch, differentiable in the data and the updates."""
    found = _local_tuples(call, 0)
    if found is None:
        return call.run(call.inputs)
    torch = _torch_of(call.inputs[0])
    local, held = found
    data, updates = call.inputs[0], call.inputs[2]
    kept = torch.from_numpy(held).to(updates.device)
    indices = torch.from_numpy(local[held]).to(data.device)
    return torch_scatter_nd(torch, call.op, [data, indices, updates[kept]])


@register(
    "GatherND",
    since=11,
    mindspore=MindSporePrimitive("ops.GatherNd", 2, note="batch_dims 0 only"),
    keeps=Keeps.SELECTORS,
    index_bounds={1: lambda op, graph: _indexed_size(op, graph, int(op.attrs.get("batch_dims", 0)))},
    local_kernel=_gather_nd_local,
    torch_kernel=torch_gather_nd,
    torch_local_kernel=_gather_nd_local_torch,
)
def gather_nd(op: NodeView, graph: GraphView) -> OpSpec:
    """Every axis splits; a split indexed axis (masked lookups, as Gather's) leaves a partial sum."""
    data_rank = len(shape(graph, op.inputs[0]))
    index_shape = shape(graph, op.inputs[1])
    batch_dims = int(op.attrs.get("batch_dims", 0))
    depth = index_shape[-1]
    batch = dim_labels(batch_dims, prefix="b")
    indexed = tuple(_indexed_label(d) for d in range(batch_dims, batch_dims + depth))
    slice_labels = tuple(f"d{d}" for d in range(batch_dims + depth, data_rank))
    index_labels = tuple(f"i{d}" for d in range(batch_dims, len(index_shape) - 1))
    data = batch + indexed + slice_labels
    indices = batch + index_labels + (None,)
    return OpSpec(inputs=(data, indices), outputs=(batch + index_labels + slice_labels,))


@register(
    "ScatterND",
    since=11,
    mindspore=MindSporePrimitive("ops.TensorScatterUpdate", 3, note="TensorScatterAdd/Mul/Max/Min for a reduction"),
    keeps=Keeps.SELECTORS,  # none and add; a mul, max or min reduction also reads the values (not counted)
    index_bounds={1: lambda op, graph: _indexed_size(op, graph, 0)},
    local_kernel=_scatter_nd_local,
    torch_kernel=torch_scatter_nd,
    torch_local_kernel=_scatter_nd_local_torch,
)
def scatter_nd(op: NodeView, graph: GraphView) -> OpSpec:
    """The indexed and slice axes split (a rank writes the updates that land in its block); with
    ``reduction="add"`` the updates' leading axes too, leaving a partial sum that adds the data once."""
    data_rank = len(shape(graph, op.inputs[0]))
    index_shape = shape(graph, op.inputs[1])
    depth = index_shape[-1]
    slice_labels = tuple(f"d{d}" for d in range(depth, data_rank))
    data = tuple(_indexed_label(d) for d in range(depth)) + slice_labels
    adds = op.attrs.get("reduction", "none") == "add"
    leading = dim_labels(len(index_shape) - 1, prefix="u") if adds else (None,) * (len(index_shape) - 1)
    updates = leading + slice_labels
    return OpSpec(inputs=(data, leading + (None,), updates), outputs=(data,), local_once_inputs=(0,) if adds else ())


@register(
    "ScatterElements",
    since=11,
    mindspore=MindSporePrimitive("ops.TensorScatterElements", 3, needs_args=True),
    keeps=Keeps.SELECTORS,  # none and add; a mul, max or min reduction also reads the values (not counted)
    index_bounds={1: _gathered_axis_size},
    torch_kernel=torch_scatter_elements,
)
def scatter_elements(op: NodeView, graph: GraphView) -> OpSpec:
    """Every axis but the indexed one splits, where data, indices and updates have the same size."""
    data_shape = shape(graph, op.inputs[0])
    index_shape = shape(graph, op.inputs[1])
    axis = normalize_axis(int(op.attrs.get("axis", 0)), len(data_shape))
    labels = tuple(None if d == axis or data_shape[d] != index_shape[d] else f"d{d}" for d in range(len(data_shape)))
    return OpSpec(inputs=(labels, labels, labels), outputs=(labels,))


# --- the operator alone in tiny models, checked by the operator tests (`autopar.ops.cases`) -----

CASES = named(
    kernel={
        "gather": one("Gather", ["E", "i"], [("i", I64, [2, 3])], [ones("E", [5, 4])]),
        "gather_negative": one("Gather", ["X", "i"], X4, [const("i", [[-1, 0], [2, -3]])], axis=3),
        "gather_elements": one("GatherElements", ["X", "i"], X2, [const("i", [[0, -1, 2, 1], [3, 3, 0, 0]])], axis=1),
        "one_hot": one(
            "OneHot", ["i", "d", "v"], [("i", I64, [2, 3])], [const("d", 5), const("v", [0.5, 2.0], np.float32)], axis=1
        ),
        "one_hot_int": one("OneHot", ["i", "d", "v"], [("i", I64, [2, 3])], [const("d", [4]), const("v", [0, 3])]),
        "gather_nd": one("GatherND", ["X", "i"], [("X", F, [2, 3, 4])], [const("i", [[0, 1], [1, 2], [-1, 0]])]),
        "gather_nd_batch": one(
            "GatherND",
            ["X", "i"],
            [("X", F, [2, 3, 4])],
            [const("i", [[[2], [0]], [[1], [1]]])],
            batch_dims=1,
            opset=12,
        ),
        "scatter_nd": one(
            "ScatterND", ["X", "i", "U"], [("X", F, [4, 3]), ("U", F, [2, 3])], [const("i", [[1], [-1]])], opset=11
        ),
        "scatter_nd_add": one(
            "ScatterND",
            ["X", "i", "U"],
            [("X", F, [4, 3]), ("U", F, [3])],
            [const("i", [[0, 1], [0, 1], [2, 2]])],
            reduction="add",
            opset=16,
        ),
        "scatter_nd_max": one(
            "ScatterND",
            ["X", "i", "U"],
            [("X", F, [4, 3]), ("U", F, [3, 3])],
            [const("i", [[0], [0], [3]])],
            reduction="max",
            opset=18,
        ),
        "scatter_elements": one(
            "ScatterElements",
            ["X", "i", "U"],
            [("X", F, [3, 4]), ("U", F, [2, 4])],
            [const("i", [[0, 2, 1, -1], [1, 0, 2, 0]])],
        ),
        "scatter_elements_add": one(
            "ScatterElements",
            ["X", "i", "U"],
            [("X", F, [3, 4]), ("U", F, [3, 2])],
            [const("i", [[0, 0], [3, 1], [2, 2]])],
            axis=1,
            reduction="add",
            opset=16,
        ),
        "scatter_elements_mul": one(
            "ScatterElements",
            ["X", "i", "U"],
            [("X", F, [3, 4]), ("U", F, [3, 2])],
            [const("i", [[0, 0], [3, 1], [2, 2]])],
            axis=1,
            reduction="mul",
            opset=16,
        ),
    },
    strategies={
        "gather_embedding": one("Gather", ["E", "ids"], [("ids", I64, [4, 8])], consts=[weight("E", [16, 8])]),
        "gather_token": one("Gather", ["X", "k"], [("X", F, [4, 8, 8])], axis=1, consts=[ints("k", 3)]),
        "gather_elements": one("GatherElements", ["X", "idx"], [("X", F, [4, 8]), ("idx", I64, [4, 8])], axis=1),
        "gather_nd": one("GatherND", ["X", "i"], [("X", F, [4, 8, 8]), ("i", I64, [8, 2])]),
        "gather_nd_batch": one("GatherND", ["X", "i"], [("X", F, [4, 8, 8]), ("i", I64, [4, 8, 1])], batch_dims=1),
        # a stack of 8 experts' weights, one gathered per routed row (Hugging Face's batched_mm experts)
        "gather_nd_experts": one(
            "GatherND", ["W", "e"], [("e", I64, [16, 1])], consts=[weight("W", [8, 4, 8])], opset=13
        ),
        "scatter_nd": one(
            "ScatterND",
            ["X", "i", "U"],
            [("X", F, [8, 4, 8]), ("U", F, [4, 4, 8])],
            consts=[ints("i", [[1], [5], [2], [7]])],
        ),
        # tokens returned from 4 experts' slots to their rows and summed (index_add_)
        "scatter_nd_add_experts": one(
            "ScatterND",
            ["X", "i", "U"],
            [("X", F, [8, 8]), ("U", F, [4, 4, 8])],
            consts=[ints("i", [[[(5 * e + 3 * c) % 8] for c in range(4)] for e in range(4)])],
            reduction="add",
            opset=16,
        ),
        "scatter_elements": one(
            "ScatterElements",
            ["X", "i", "U"],
            [("X", F, [4, 8]), ("U", F, [4, 8])],
            axis=1,
            consts=[ints("i", [[(7 * r + 3 * c) % 8 for c in range(8)] for r in range(4)])],
        ),
        "scatter_elements_add": one(
            "ScatterElements",
            ["X", "i", "U"],
            [("X", F, [4, 8]), ("i", I64, [4, 6]), ("U", F, [4, 6])],
            axis=1,
            reduction="add",
            opset=16,
        ),
    },
)
