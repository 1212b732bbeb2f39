"""Constant folding: operators whose value is known at import become constants every rank holds.

Covers ``Constant``, weight-elided parameters written as ``ConstantOfShape(shape initializer)``
(the pattern the onnx package's own model-zoo test files use), ``Shape``/``Size`` read from the inferred
shapes or a stored tensor's, ``CastLike`` of a known value (the target's type is all it reads: the dynamo
exporter's unoptimised zero bias is ``Expand(CastLike(0, x), Shape(W))``), and any operator whose inputs
are all known values (Gather on a shape, Concat, Range, Unsqueeze, Cast, ...), evaluated once by onnx's
reference evaluator. Operators the registry marks as not foldable (random ones, Dropout) are never evaluated.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import onnx

from autopar.errors import ModelImportError
from autopar.graph.proto import attributes, shape_of
from autopar.graph.types import FLOAT_TYPES, ElidedValue, opset_of
from autopar.ops import lookup

FOLD_MAX_ELEMENTS = 1 << 22  # a folded value is held whole by every rank: keep it small
KnownValue = np.ndarray | ElidedValue


def _constant(node: onnx.NodeProto) -> np.ndarray | None:
    attrs = attributes(node)
    if "value" in attrs:
        return np.asarray(attrs["value"])
    for key, dtype in (
        ("value_float", np.float32),
        ("value_int", np.int64),
        ("value_floats", np.float32),
        ("value_ints", np.int64),
    ):
        if key in attrs:
            return np.asarray(attrs[key], dtype=dtype)
    return None


def fold_constant(
    node: onnx.NodeProto,
    constants: dict[str, KnownValue],
    infos: dict[str, onnx.ValueInfoProto],
    proto: onnx.ModelProto,
) -> KnownValue | None:
    """Value of a node computable at import time, or None. Weight-elided parameters come here too."""
    if node.op_type == "Constant" and not node.domain:
        return _constant(node)
    shape_source = constants.get(node.input[0]) if node.input else None
    if node.op_type == "ConstantOfShape" and not node.domain and isinstance(shape_source, np.ndarray):
        shape = tuple(int(d) for d in shape_source.reshape(-1))
        fill = np.asarray(attributes(node).get("value", np.zeros(1, dtype=np.float32)))
        if fill.dtype in FLOAT_TYPES and len(shape) > 0 and math.prod(shape) > 1:
            return ElidedValue(shape, fill.dtype)  # a weight-elided parameter: keep its shape only
        return np.full(shape, fill.reshape(-1)[0], dtype=fill.dtype)
    if node.domain or len(node.output) != 1:
        return None
    if node.op_type in ("Shape", "Size"):
        known = constants.get(node.input[0])
        if known is not None:  # a stored tensor (inference types no initializer that is not an input)
            in_shape = tuple(int(d) for d in known.shape)
        else:
            try:
                in_shape, _ = shape_of(node.input[0], infos)
            except ModelImportError:
                return None
        if node.op_type == "Size":
            return np.asarray(math.prod(in_shape), dtype=np.int64)
        attrs = attributes(node)
        start, end = attrs.get("start", 0), attrs.get("end", len(in_shape))
        return np.asarray(in_shape[slice(start, end)], dtype=np.int64)
    if node.op_type == "CastLike" and isinstance(constants.get(node.input[0]), np.ndarray):
        like = _dtype_of(node.input[1], infos)  # only the target's type is read, never its data
        return None if like is None else np.asarray(constants[node.input[0]]).astype(like)
    present = [name for name in node.input if name]
    definition = lookup(node.op_type, node.domain, opset_of(proto))
    if (
        not present
        or (definition is not None and not definition.foldable)
        or not all(isinstance(constants.get(n), np.ndarray) for n in present)
    ):
        return None
    try:
        out_shape, _ = shape_of(node.output[0], infos)
    except ModelImportError:  # a size inference could not follow (a shape chain): evaluate, then bound
        if _surely_too_large(node, constants):
            return None
        value = _evaluate(node, constants, proto)
        return value if value is not None and value.size <= FOLD_MAX_ELEMENTS else None
    if math.prod(out_shape) > FOLD_MAX_ELEMENTS:
        return None
    return _evaluate(node, constants, proto)


BROADCASTING = frozenset(
    {
        "Add",
        "Sub",
        "Mul",
        "Div",
        "Pow",
        "Mod",
        "Max",
        "Min",
        "And",
        "Or",
        "Xor",
        "Where",
        "Equal",
        "Less",
        "LessOrEqual",
        "Greater",
        "GreaterOrEqual",
        "BitShift",
        "BitwiseAnd",
        "BitwiseOr",
        "BitwiseXor",
    }
)
"""Operators whose output has the inputs' broadcast shape: its size is known before they run."""


def _surely_too_large(node: onnx.NodeProto, constants: dict[str, KnownValue]) -> bool:
    """Whether the output of a node whose size inference left open is past `FOLD_MAX_ELEMENTS` by its inputs
    alone (a broadcast, an Expand, a GatherND): such a value (a causal mask of 32k x 32k positions, 8.6
    billion entries at batch 8) would take seconds and gigabytes to evaluate, only to be refused."""
    shapes = [np.shape(constants[name]) for name in node.input if name]
    if node.op_type == "GatherND" and len(shapes) == 2 and shapes[1]:  # exporters build masks by index
        data, indices = shapes
        batch_dims = int(attributes(node).get("batch_dims", 0))
        return math.prod(indices[:-1]) * math.prod(data[batch_dims + indices[-1] :]) > FOLD_MAX_ELEMENTS
    if node.op_type == "Expand" and len(shapes) == 2:
        shapes[1] = tuple(int(d) for d in np.asarray(constants[node.input[1]]).reshape(-1))
    elif node.op_type not in BROADCASTING:
        return False
    try:
        return math.prod(np.broadcast_shapes(*shapes)) > FOLD_MAX_ELEMENTS
    except ValueError:
        return False


def _dtype_of(name: str, infos: dict[str, onnx.ValueInfoProto]) -> np.dtype | None:
    """A tensor's element type as numpy's, or None where inference did not say."""
    info = infos.get(name)
    if info is None or not info.type.HasField("tensor_type") or not info.type.tensor_type.elem_type:
        return None
    return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(info.type.tensor_type.elem_type))


def gather_nd(data: np.ndarray, indices: np.ndarray, batch_dims: int = 0) -> np.ndarray:
    """ONNX's GatherND by numpy's indexing: onnx's reference evaluator loops in Python over every index tuple
    (seconds for the million-entry masks exporters build by index).

    >>> gather_nd(np.arange(6).reshape(2, 3), np.array([[1, 2], [0, -1]]))
    array([5, 2])
    >>> gather_nd(np.arange(12).reshape(2, 2, 3), np.array([[1], [0]]), batch_dims=1)
    array([[3, 4, 5],
           [6, 7, 8]])
    """
    leading = data.shape[:batch_dims]
    count = math.prod(leading)
    flat_data = data.reshape((count, *data.shape[batch_dims:]))
    flat_indices = indices.reshape((count, *indices.shape[batch_dims:]))
    positions = np.arange(count).reshape((count,) + (1,) * (flat_indices.ndim - 2))
    picked = flat_data[(positions, *np.moveaxis(flat_indices, -1, 0))]
    return picked.reshape(leading + picked.shape[1:])


def _evaluate(node: onnx.NodeProto, constants: dict[str, Any], proto: onnx.ModelProto) -> np.ndarray | None:
    """Run one operator on known inputs with onnx's reference evaluator (None if it cannot)."""
    from onnx.reference import ReferenceEvaluator

    if node.op_type == "GatherND" and not node.domain:
        data, indices = (np.asarray(constants[name]) for name in node.input[:2])
        try:
            return gather_nd(data, indices.astype(np.int64), int(attributes(node).get("batch_dims", 0)))
        except (IndexError, ValueError):
            return None

    opsets = {entry.domain or "": int(entry.version) for entry in proto.opset_import}
    try:
        evaluator = ReferenceEvaluator(node, opsets=opsets)
        feeds = {name: constants[name] for name in node.input if name}
        (value,) = evaluator.run(None, feeds)
    except Exception:
        return None
    return np.asarray(value)
