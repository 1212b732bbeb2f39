"""Reading ONNX protos: value infos by name, a tensor's static shape, a node's attributes."""

from __future__ import annotations

from typing import Any

import onnx
from onnx import helper, numpy_helper

from autopar.errors import ModelImportError, UnknownDimensionError

FLOAT_DATA_TYPES = (
    onnx.TensorProto.FLOAT,
    onnx.TensorProto.FLOAT16,
    onnx.TensorProto.BFLOAT16,
    onnx.TensorProto.DOUBLE,
)
"""The ONNX element types of floating-point tensors."""


def value_infos(proto: onnx.ModelProto) -> dict[str, onnx.ValueInfoProto]:
    """Every declared or inferred value info, by tensor name (outputs win over inputs)."""
    infos: dict[str, onnx.ValueInfoProto] = {}
    for vi in list(proto.graph.input) + list(proto.graph.value_info) + list(proto.graph.output):
        infos[vi.name] = vi
    return infos


def data_inputs(proto: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    """Graph inputs that no initializer feeds: what the user provides at run time."""
    initialized = {init.name for init in proto.graph.initializer}
    return [vi for vi in proto.graph.input if vi.name not in initialized]


def shape_of(name: str, infos: dict[str, onnx.ValueInfoProto]) -> tuple[tuple[int, ...], str]:
    """(static shape, numpy dtype name) of a tensor; UnknownDimensionError if any size is unknown."""
    vi = infos.get(name)
    if vi is None or not vi.type.HasField("tensor_type"):
        raise ModelImportError(f"Tensor {name!r} has no known type after shape inference.")
    tensor_type = vi.type.tensor_type
    dtype = helper.tensor_dtype_to_np_dtype(tensor_type.elem_type).name
    if not tensor_type.HasField("shape"):
        raise UnknownDimensionError(name)
    shape = []
    for axis, dim in enumerate(tensor_type.shape.dim):
        if not dim.HasField("dim_value"):
            raise UnknownDimensionError(name, dim.dim_param or "?", axis)
        shape.append(int(dim.dim_value))
    return tuple(shape), dtype


def attributes(node: onnx.NodeProto) -> dict[str, Any]:
    """A node's attributes as Python values (strings decoded, tensors as numpy arrays)."""
    attrs: dict[str, Any] = {}
    for attr in node.attribute:
        value = helper.get_attribute_value(attr)
        if isinstance(value, bytes):
            value = value.decode("utf-8", "replace")
        elif isinstance(value, onnx.TensorProto):
            value = numpy_helper.to_array(value)
        elif isinstance(value, (list, tuple)):
            value = [v.decode("utf-8", "replace") if isinstance(v, bytes) else v for v in value]
        attrs[attr.name] = value
    return attrs
