"""ONNX import: a model file becomes a `Graph` whose every tensor has a known shape and dtype.

The importer binds the batch size and symbolic dimensions (rewriting Reshape targets that
hard-code the old batch), runs ONNX shape inference, folds constants, tells parameters from
constants and data inputs, and counts forward FLOPs.

Folding covers ``Constant``, weight-elided parameters written as ``ConstantOfShape(shape
initializer)`` (the pattern the onnx package's own model-zoo test files use), and every
shape computation: ``Shape``/``Size`` read the inferred shapes, and any operator whose inputs
are all known values (Gather on a shape, Concat, Range, Unsqueeze, Cast, ...) is evaluated
once by onnx's reference evaluator. Folded values are replicated constants: they cost nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Literal

import networkx as nx
import numpy as np
import onnx
from onnx import helper, numpy_helper, shape_inference

from autopar.errors import ModelImportError
from autopar.flops import forward_flops

TensorKind = Literal["input", "parameter", "constant", "activation"]

# Float inputs that configure an operator rather than carry learned weights.
_CONFIG_INPUTS: dict[str, set[int]] = {
    "OneHot": {1, 2},
    "Clip": {1, 2},
    "Pad": {1, 2},
    "Resize": {1, 2, 3},
    "Upsample": {1},
    "Pow": {1},
    "Dropout": {1, 2},
}
# Operators whose float inputs are layer weights even when they hold a single element.
_WEIGHT_OPS = {"Conv", "ConvTranspose", "Gemm", "MatMul", "BatchNormalization", "LayerNormalization", "PRelu"}
# Inputs that hold running statistics: stored like parameters but never trained.
_STATISTICS_INPUTS: dict[str, set[int]] = {"BatchNormalization": {3, 4}}
_FLOAT_TYPES = {np.dtype(t) for t in ("float16", "float32", "float64")} | {np.dtype("float16")}
# Folding evaluates an operator at import time; its output becomes a constant every rank holds.
_FOLD_MAX_ELEMENTS = 1 << 22
_NEVER_FOLD = {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial", "Bernoulli",
               "Dropout"}


@dataclass(frozen=True)
class ElidedValue:
    """A tensor whose shape and dtype are known but whose values are not stored (elided weights)."""

    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)


@dataclass
class TensorInfo:
    """A tensor of the graph: its static shape, element type and role."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    kind: TensorKind
    trainable: bool = False
    value: np.ndarray | None = field(default=None, repr=False)

    @property
    def numel(self) -> int:
        return math.prod(self.shape) if self.shape else 1

    @property
    def is_float(self) -> bool:
        return np.dtype(self.dtype) in _FLOAT_TYPES


@dataclass
class OpNode:
    """One operator of the graph, in topological order (``index``)."""

    name: str
    op_type: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attrs: dict[str, Any]
    index: int
    flops: float = 0.0
    domain: str = ""
    proto: onnx.NodeProto | None = field(default=None, repr=False, compare=False)


@dataclass
class Graph:
    """The imported model: operators, tensors and the dataflow between them."""

    name: str
    ops: list[OpNode]
    tensors: dict[str, TensorInfo]
    inputs: list[str]
    outputs: list[str]
    model: onnx.ModelProto = field(repr=False)
    producer: dict[str, str] = field(default_factory=dict)
    consumers: dict[str, list[str]] = field(default_factory=dict)
    dataflow: nx.DiGraph = field(default_factory=nx.DiGraph, repr=False)

    def __post_init__(self) -> None:
        self._by_name = {op.name: op for op in self.ops}
        for op in self.ops:
            for out in op.outputs:
                if out:
                    self.producer[out] = op.name
            for inp in op.inputs:
                if inp:
                    users = self.consumers.setdefault(inp, [])
                    if op.name not in users:
                        users.append(op.name)
        self.dataflow.add_nodes_from(op.name for op in self.ops)
        for op in self.ops:
            for inp in op.inputs:
                src = self.producer.get(inp)
                if src is not None:
                    self.dataflow.add_edge(src, op.name, tensor=inp)

    def op(self, name: str) -> OpNode:
        return self._by_name[name]

    @property
    def parameters(self) -> list[TensorInfo]:
        return [t for t in self.tensors.values() if t.kind == "parameter"]

    @property
    def total_flops(self) -> float:
        return sum(op.flops for op in self.ops)

    def tensor(self, name: str) -> TensorInfo:
        return self.tensors[name]


def load_model(
    model: str | Path | onnx.ModelProto,
    batch: int | None = None,
    dims: dict[str, int] | None = None,
) -> Graph:
    """Import an ONNX model (a path or a ModelProto) with every shape resolved."""
    proto = _read(model)
    name = Path(model).stem if isinstance(model, (str, Path)) else (proto.graph.name or "model")
    if batch is not None:
        _rebatch_reshapes(proto, batch)
    proto = _bind_dimensions(proto, batch, dims or {})
    proto = _infer_shapes(proto)
    _check_reshapes(proto)
    return _build_graph(proto, name)


def _read(model: str | Path | onnx.ModelProto) -> onnx.ModelProto:
    if isinstance(model, onnx.ModelProto):
        proto = onnx.ModelProto()
        proto.CopyFrom(model)
    else:
        path = Path(model)
        if not path.is_file():
            raise ModelImportError(f"Model file {str(path)!r} does not exist.")
        try:
            proto = onnx.load(str(path), load_external_data=False)
        except Exception as exc:  # protobuf raises several unrelated types
            raise ModelImportError(
                f"{str(path)!r} is not a readable ONNX model (truncated or foreign file: {type(exc).__name__})."
            ) from None
    if not proto.graph.node:
        raise ModelImportError("The model has no operators (is it an ONNX model file?).")
    return proto


def _data_inputs(proto: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    initialized = {init.name for init in proto.graph.initializer}
    return [vi for vi in proto.graph.input if vi.name not in initialized]


def _bind_dimensions(proto: onnx.ModelProto, batch: int | None, dims: dict[str, int]) -> onnx.ModelProto:
    if batch is not None and batch < 1:
        raise ModelImportError(f"--batch must be a positive integer, got {batch}.")
    for key, value in dims.items():
        if value < 1:
            raise ModelImportError(f"--dim {key}={value}: a dimension must be a positive integer.")
    known_params = set()
    for vi in _data_inputs(proto):
        if not vi.type.HasField("tensor_type") or not vi.type.tensor_type.HasField("shape"):
            continue
        for position, dim in enumerate(vi.type.tensor_type.shape.dim):
            if dim.HasField("dim_param"):
                known_params.add(dim.dim_param)
                if dim.dim_param in dims:
                    dim.dim_value = dims[dim.dim_param]
            if position == 0 and batch is not None:
                dim.dim_value = batch
    unknown = sorted(set(dims) - known_params)
    if unknown:
        raise ModelImportError(
            f"--dim names {', '.join(unknown)} but the model's inputs have no such symbolic dimension"
            + (f" (they have: {', '.join(sorted(known_params))})." if known_params else ".")
        )
    # Declared intermediate and output shapes may contradict the new bindings: let inference redo them.
    del proto.graph.value_info[:]
    for out in proto.graph.output:
        if out.type.HasField("tensor_type"):
            out.type.tensor_type.ClearField("shape")
    return proto


def _declared_batch(proto: onnx.ModelProto) -> int | None:
    for vi in _data_inputs(proto):
        dims = vi.type.tensor_type.shape.dim if vi.type.HasField("tensor_type") else []
        if dims and dims[0].HasField("dim_value"):
            return int(dims[0].dim_value)
    return None


def _rebatch_reshapes(proto: onnx.ModelProto, batch: int) -> None:
    """Exported CNNs often hard-code the batch in a Reshape target (``[1, 2048]``): rewrite it.

    A target is rewritten when its first entry equals the file's batch and the reshaped
    tensor's leading dimension is that batch too (so the entry is the batch, not a feature).
    """
    old = _declared_batch(proto)
    if old is None or old == batch:
        return
    try:
        inferred = shape_inference.infer_shapes(proto, data_prop=True)
    except Exception:
        return  # the strict inference after binding reports the problem
    infos = _value_infos(inferred)
    initializers = {init.name: init for init in proto.graph.initializer}
    for node in proto.graph.node:
        if node.op_type != "Reshape" or node.domain or len(node.input) < 2 or node.input[1] not in initializers:
            continue
        target = numpy_helper.to_array(initializers[node.input[1]])
        vi = infos.get(node.input[0])
        dims = vi.type.tensor_type.shape.dim if vi is not None and vi.type.HasField("tensor_type") else []
        if target.ndim != 1 or not target.size or int(target[0]) != old or not dims or dims[0].dim_value != old:
            continue
        rewritten = target.copy()
        rewritten[0] = batch
        new_name = f"{node.input[1]}__batch{batch}"
        if new_name not in initializers:
            initializers[new_name] = numpy_helper.from_array(rewritten, new_name)
            proto.graph.initializer.append(initializers[new_name])
        node.input[1] = new_name


def _check_reshapes(proto: onnx.ModelProto) -> None:
    """Shape inference accepts a Reshape that changes the element count; running it would fail."""
    infos = _value_infos(proto)
    for node in proto.graph.node:
        if node.op_type != "Reshape" or node.domain:
            continue
        sizes = []
        for name in (node.input[0], node.output[0]):
            vi = infos.get(name)
            dims = vi.type.tensor_type.shape.dim if vi is not None and vi.type.HasField("tensor_type") else None
            if dims is None or not all(d.HasField("dim_value") for d in dims):
                break
            sizes.append(math.prod(int(d.dim_value) for d in dims))
        if len(sizes) == 2 and sizes[0] != sizes[1]:
            raise ModelImportError(
                f"Reshape {node.name or node.output[0]!r} turns {sizes[0]} elements into {sizes[1]}: its target"
                " shape is hard-coded for another batch size or input shape.")


def _infer_shapes(proto: onnx.ModelProto) -> onnx.ModelProto:
    try:
        return shape_inference.infer_shapes(proto, strict_mode=True, data_prop=True)
    except Exception as exc:
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelImportError(f"ONNX shape inference failed: {message}") from None


def _value_infos(proto: onnx.ModelProto) -> dict[str, onnx.ValueInfoProto]:
    infos: dict[str, onnx.ValueInfoProto] = {}
    for vi in list(proto.graph.input) + list(proto.graph.value_info) + list(proto.graph.output):
        infos[vi.name] = vi
    return infos


def _shape_of(name: str, infos: dict[str, onnx.ValueInfoProto]) -> tuple[tuple[int, ...], str]:
    vi = infos.get(name)
    if vi is None or not vi.type.HasField("tensor_type"):
        raise ModelImportError(f"Tensor {name!r} has no known type after shape inference.")
    tensor_type = vi.type.tensor_type
    dtype = helper.tensor_dtype_to_np_dtype(tensor_type.elem_type).name
    if not tensor_type.HasField("shape"):
        raise ModelImportError(f"Tensor {name!r} has an unknown shape; bind its dimensions with --batch or --dim.")
    shape = []
    for dim in tensor_type.shape.dim:
        if not dim.HasField("dim_value"):
            label = dim.dim_param or "?"
            raise ModelImportError(
                f"Tensor {name!r} has an unknown dimension {label!r}; bind it with --dim {label}=VALUE"
                " (or --batch for the leading dimension)."
            )
        shape.append(int(dim.dim_value))
    return tuple(shape), dtype


def _attributes(node: onnx.NodeProto) -> dict[str, Any]:
    attrs = {}
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


def _fold_constant(node: onnx.NodeProto, constants: dict[str, Any], infos: dict[str, onnx.ValueInfoProto],
                   proto: onnx.ModelProto) -> np.ndarray | ElidedValue | None:
    """Value of a node computable at import time, or None. Weight-elided parameters come here too."""
    if node.op_type == "Constant" and not node.domain:
        attrs = _attributes(node)
        if "value" in attrs:
            return np.asarray(attrs["value"])
        for key, dtype in (("value_float", np.float32), ("value_int", np.int64)):
            if key in attrs:
                return np.asarray(attrs[key], dtype=dtype)
        for key, dtype in (("value_floats", np.float32), ("value_ints", np.int64)):
            if key in attrs:
                return np.asarray(attrs[key], dtype=dtype)
        return None
    shape_source = constants.get(node.input[0]) if node.input else None
    if node.op_type == "ConstantOfShape" and not node.domain and isinstance(shape_source, np.ndarray):
        shape = tuple(int(d) for d in shape_source.reshape(-1))
        fill = np.asarray(_attributes(node).get("value", np.zeros(1, dtype=np.float32)))
        if fill.dtype in _FLOAT_TYPES and len(shape) > 0 and math.prod(shape) > 1:
            return ElidedValue(shape, fill.dtype)  # a weight-elided parameter: keep its shape only
        return np.full(shape, fill.reshape(-1)[0], dtype=fill.dtype)
    if node.domain or len(node.output) != 1:
        return None
    if node.op_type in ("Shape", "Size"):
        try:
            in_shape, _ = _shape_of(node.input[0], infos)
        except ModelImportError:
            return None
        if node.op_type == "Size":
            return np.asarray(math.prod(in_shape), dtype=np.int64)
        attrs = _attributes(node)
        start, end = attrs.get("start", 0), attrs.get("end", len(in_shape))
        return np.asarray(in_shape[slice(start, end)], dtype=np.int64)
    present = [name for name in node.input if name]
    if not present or node.op_type in _NEVER_FOLD or not all(isinstance(constants.get(n), np.ndarray) for n in present):
        return None
    try:
        out_shape, _ = _shape_of(node.output[0], infos)
    except ModelImportError:
        return None
    if math.prod(out_shape) > _FOLD_MAX_ELEMENTS:
        return None
    return _evaluate(node, constants, proto)


def _evaluate(node: onnx.NodeProto, constants: dict[str, Any], proto: onnx.ModelProto) -> np.ndarray | None:
    """Run one operator on known inputs with onnx's reference evaluator (None if it cannot)."""
    from onnx.reference import ReferenceEvaluator

    opsets = {entry.domain or "": int(entry.version) for entry in proto.opset_import}
    try:
        evaluator = ReferenceEvaluator(node, opsets=opsets)
        feeds = {name: constants[name] for name in node.input if name}
        (value,) = evaluator.run(None, feeds)
    except Exception:
        return None
    return np.asarray(value)


def _build_graph(proto: onnx.ModelProto, name: str) -> Graph:
    infos = _value_infos(proto)
    tensors: dict[str, TensorInfo] = {}
    constants: dict[str, np.ndarray] = {}
    for init in proto.graph.initializer:
        if init.data_location == onnx.TensorProto.EXTERNAL:
            dims = tuple(int(d) for d in init.dims)
            constants[init.name] = ElidedValue(dims, np.dtype(helper.tensor_dtype_to_np_dtype(init.data_type)))
        else:
            constants[init.name] = numpy_helper.to_array(init)

    ops: list[OpNode] = []
    graph_outputs = {o.name for o in proto.graph.output}
    for node in proto.graph.node:
        folded = None if set(node.output) & graph_outputs else _fold_constant(node, constants, infos, proto)
        if folded is not None:
            constants[node.output[0]] = folded
            continue
        ops.append(
            OpNode(
                name=node.name or f"{node.op_type}_{len(ops)}",
                op_type=node.op_type,
                inputs=tuple(node.input),
                outputs=tuple(node.output),
                attrs=_attributes(node),
                index=len(ops),
                domain=node.domain,
                proto=node,
            )
        )
    _rename_duplicates(ops)

    roles = _constant_roles(ops, constants)
    read = {inp for op in ops for inp in op.inputs} | {o.name for o in proto.graph.output}
    for cname, value in constants.items():
        if cname not in read:
            continue  # e.g. the shape initializers of folded weight-elided parameters
        kind, trainable = roles.get(cname, ("constant", False))
        stored = None if isinstance(value, ElidedValue) else value
        tensors[cname] = TensorInfo(cname, tuple(int(d) for d in value.shape), value.dtype.name, kind, trainable, stored)

    graph_inputs = []
    for vi in _data_inputs(proto):
        if vi.name in tensors:
            continue
        shape, dtype = _shape_of(vi.name, infos)
        tensors[vi.name] = TensorInfo(vi.name, shape, dtype, "input")
        graph_inputs.append(vi.name)

    used = {inp for op in ops for inp in op.inputs} | {o.name for o in proto.graph.output}
    for op in ops:
        # an unused optional output (e.g. an old Dropout's mask) may have no inferred type: drop it
        op.outputs = tuple(o if (o in used or o in infos) else "" for o in op.outputs)
        for out in op.outputs:
            if out and out not in tensors:
                shape, dtype = _shape_of(out, infos)
                tensors[out] = TensorInfo(out, shape, dtype, "activation")
        for inp in op.inputs:
            if inp and inp not in tensors:
                raise ModelImportError(f"Operator {op.name!r} reads tensor {inp!r}, which nothing produces.")

    for op in ops:
        in_shapes = [tensors[i].shape if i else None for i in op.inputs]
        out_shapes = [tensors[o].shape for o in op.outputs if o]
        op.flops = forward_flops(op.op_type, in_shapes, out_shapes, op.attrs)

    outputs = [o.name for o in proto.graph.output]
    graph = Graph(name=name, ops=_topological(ops), tensors=tensors, inputs=graph_inputs, outputs=outputs, model=proto)
    return graph


def _rename_duplicates(ops: list[OpNode]) -> None:
    """Give every operator a unique name; a generated name never collides with a real one."""
    taken = {op.name for op in ops}
    seen: set[str] = set()
    for op in ops:
        if op.name in seen:
            suffix = 1
            while f"{op.name}_{suffix}" in taken:
                suffix += 1
            op.name = f"{op.name}_{suffix}"
            taken.add(op.name)
        seen.add(op.name)


def _constant_roles(ops: Iterable[OpNode], constants: dict[str, Any]) -> dict[str, tuple[TensorKind, bool]]:
    """Tell learned weights from configuration constants by how operators use them."""
    uses: dict[str, list[tuple[str, int]]] = {}
    for op in ops:
        for position, inp in enumerate(op.inputs):
            if inp in constants:
                uses.setdefault(inp, []).append((op.op_type, position))
    roles: dict[str, tuple[TensorKind, bool]] = {}
    for cname, places in uses.items():
        value = constants[cname]
        if value.dtype not in _FLOAT_TYPES or value.ndim == 0:
            continue
        weight_uses = [(t, p) for t, p in places if p not in _CONFIG_INPUTS.get(t, set())]
        if value.size <= 1 and not any(t in _WEIGHT_OPS for t, _ in weight_uses):
            continue  # a one-element scale fed to arithmetic is a constant; a layer's weight is not
        if not weight_uses:
            continue
        statistics = all(p in _STATISTICS_INPUTS.get(t, set()) for t, p in weight_uses)
        roles[cname] = ("parameter", not statistics)
    return roles


def _topological(ops: list[OpNode]) -> list[OpNode]:
    """ONNX requires topological order; re-sort defensively, stable on the file's order."""
    produced = {out: op.index for op in ops for out in op.outputs if out}
    dag = nx.DiGraph()
    dag.add_nodes_from(op.index for op in ops)
    for op in ops:
        for inp in op.inputs:
            if inp in produced and produced[inp] != op.index:
                dag.add_edge(produced[inp], op.index)
    try:
        order = list(nx.lexicographical_topological_sort(dag))
    except nx.NetworkXUnfeasible:
        raise ModelImportError("The model graph has a cycle.") from None
    by_index = {op.index: op for op in ops}
    sorted_ops = [by_index[i] for i in order]
    for position, op in enumerate(sorted_ops):
        op.index = position
    return sorted_ops
