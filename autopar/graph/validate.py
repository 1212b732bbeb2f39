"""Validation: what ONNX's checker rejects, and what autopar cannot plan, stops here in one sentence.

Runs on the bound, shape-inferred model, so the checker sees every output typed. The checker's
reason is kept (its first line); weights kept in external files are never read (they are
checked as graph inputs of the same type and shape instead).
"""

from __future__ import annotations

import onnx

from autopar.errors import ModelImportError, UnknownDimensionError
from autopar.graph.proto import data_inputs, value_infos
from autopar.graph.types import opset_of
from autopar.limits import MAX_DIMENSION

_PROTOBUF_LIMIT = 2**31 - 1  # the checker cannot serialise a larger proto
_NUMERIC = {
    onnx.TensorProto.FLOAT,
    onnx.TensorProto.DOUBLE,
    onnx.TensorProto.FLOAT16,
    onnx.TensorProto.BFLOAT16,
    onnx.TensorProto.INT8,
    onnx.TensorProto.INT16,
    onnx.TensorProto.INT32,
    onnx.TensorProto.INT64,
    onnx.TensorProto.UINT8,
    onnx.TensorProto.UINT16,
    onnx.TensorProto.UINT32,
    onnx.TensorProto.UINT64,
    onnx.TensorProto.BOOL,
}


def without_external_data(proto: onnx.ModelProto) -> onnx.ModelProto:
    """A copy whose externally stored initializers are graph inputs (typed), so nothing is read."""
    external = [init for init in proto.graph.initializer if init.data_location == onnx.TensorProto.EXTERNAL]
    if not external:
        return proto
    copy = onnx.ModelProto()
    copy.CopyFrom(proto)
    names = {init.name for init in external}
    kept = [init for init in copy.graph.initializer if init.name not in names]
    del copy.graph.initializer[:]
    copy.graph.initializer.extend(kept)
    declared = {vi.name for vi in copy.graph.input}
    for init in external:
        if init.name not in declared:
            copy.graph.input.append(onnx.helper.make_tensor_value_info(init.name, init.data_type, list(init.dims)))
    return copy


def check_wiring(proto: onnx.ModelProto) -> None:
    """Before inference, what would leave shapes unknown for a reason no binding cures, said as itself: an
    operator reading a tensor nothing writes (no operator, input or initializer), a data input that declares
    no shape, a graph output listed twice. Inference would otherwise stop there, and the first unknown size
    downstream would be blamed on the batch or a dimension to bind."""
    known = {vi.name for vi in proto.graph.input} | {init.name for init in proto.graph.initializer}
    known |= {sparse.values.name for sparse in proto.graph.sparse_initializer}
    known |= {name for node in proto.graph.node for name in node.output if name}
    for node in proto.graph.node:
        missing = next((name for name in node.input if name and name not in known), None)
        if missing is not None:
            raise ModelImportError(
                f"{node.op_type} {node.name or node.output[0]!r} reads {missing!r}, which no operator writes and"
                " which is no input or initializer."
            )
    for vi in data_inputs(proto):
        if vi.type.HasField("tensor_type") and not vi.type.tensor_type.HasField("shape"):
            raise ModelImportError(f"Input {vi.name!r} declares no shape; autopar needs its sizes to plan.")
    outputs = [output.name for output in proto.graph.output]
    twice = next((name for name in outputs if outputs.count(name) > 1), None)
    if twice is not None:
        raise ModelImportError(f"Graph output {twice!r} is listed twice.")
    stored = {init.name for init in proto.graph.initializer}
    returned = next((name for name in outputs if name in stored), None)
    if returned is not None:
        raise ModelImportError(
            f"Graph output {returned!r} is an initializer, returned as it is stored; autopar plans the outputs"
            " operators compute (route it through an Identity to keep it)."
        )


def _where_inference_stops(proto: onnx.ModelProto) -> onnx.NodeProto | None:
    """The first operator whose inputs all have shapes and some output none: where shape inference stopped."""
    infos = value_infos(proto)
    shaped = {init.name for init in proto.graph.initializer}
    shaped |= {name for name, vi in infos.items() if vi.type.tensor_type.HasField("shape")}
    for node in proto.graph.node:
        if all(not name or name in shaped for name in node.input) and any(
            name and name not in shaped for name in node.output
        ):
            return node
    return None


def _unshaped_output(proto: onnx.ModelProto, output: str) -> ModelImportError:
    """Why graph output ``output`` has no shape: an operator ONNX does not define stopped inference (named),
    or, where every operator is ONNX's, a size to bind (`UnknownDimensionError`)."""
    stop = _where_inference_stops(proto)
    if stop is not None and not onnx.defs.has(stop.op_type, stop.domain or ""):
        domain = f" in domain {stop.domain!r}" if stop.domain else ""
        return ModelImportError(
            f"Shape inference stops at {stop.op_type} {stop.name or stop.output[0]!r}, which ONNX does not"
            f" define{domain}, so its outputs' shapes are unknown: export the model without it."
        )
    return UnknownDimensionError(output)


def check_model(proto: onnx.ModelProto) -> None:
    """ONNX's own checker (schemas, attributes, opsets, SSA form) on the inferred model."""
    newest = onnx.defs.onnx_opset_version()
    opset = opset_of(proto)
    if opset > newest:
        raise ModelImportError(
            f"The model uses ONNX opset {opset}, but the installed onnx {onnx.__version__} knows opsets up to {newest}."
        )
    produced = {name for node in proto.graph.node for name in node.output}
    known = produced | {vi.name for vi in proto.graph.input} | {init.name for init in proto.graph.initializer}
    for output in proto.graph.output:
        if output.name not in known:
            raise ModelImportError(f"Graph output {output.name!r} is produced by no operator and is no input.")
        if output.type.HasField("tensor_type") and not output.type.tensor_type.HasField("shape"):
            raise _unshaped_output(proto, output.name)  # inference could not follow it (a custom operator, say)
    checked = without_external_data(proto)
    if checked.ByteSize() > _PROTOBUF_LIMIT:
        return  # weights stored inline past 2 GB: the checker cannot take it; inference has run strictly
    try:
        onnx.checker.check_model(checked)
    except (onnx.checker.ValidationError, ValueError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelImportError(f"The model is not valid ONNX: {reason.rstrip('.')}.") from None


def check_data_inputs(proto: onnx.ModelProto) -> None:
    """Every data input is a numeric tensor (a string or untyped input cannot be sharded or costed)."""
    for vi in data_inputs(proto):
        if not vi.type.HasField("tensor_type"):
            raise ModelImportError(f"Input {vi.name!r} is not a tensor; autopar plans tensor inputs only.")
        elem = vi.type.tensor_type.elem_type
        if elem not in _NUMERIC:
            name = onnx.TensorProto.DataType.Name(elem) if elem in onnx.TensorProto.DataType.values() else str(elem)
            raise ModelImportError(f"Input {vi.name!r} has element type {name}; autopar plans numeric tensors only.")


_FLOATS = {onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16}


def check_dimensions(proto: onnx.ModelProto) -> None:
    """After binding and inference, data inputs and computed float tensors have positive sizes.

    Data inputs are also bounded by `MAX_DIMENSION`. Known values may be empty (an unused
    ``roi`` of Resize, a shape vector for a scalar), and so may integer shape arithmetic; a float
    activation of size 0 means a weight or an input with a zero dimension, which no plan can serve.
    """
    known = {init.name for init in proto.graph.initializer}
    known |= {out for node in proto.graph.node if node.op_type == "Constant" for out in node.output}
    inputs = {vi.name for vi in data_inputs(proto)}
    for name, vi in value_infos(proto).items():
        if name in known or not vi.type.HasField("tensor_type") or not vi.type.tensor_type.HasField("shape"):
            continue
        if name not in inputs and vi.type.tensor_type.elem_type not in _FLOATS:
            continue
        high = MAX_DIMENSION if name in inputs else None
        for axis, dim in enumerate(vi.type.tensor_type.shape.dim):
            if not dim.HasField("dim_value"):
                continue
            if dim.dim_value < 1 or (high is not None and dim.dim_value > high):
                limit = f"from 1 to {high:,}" if high is not None else "positive"
                raise ModelImportError(
                    f"Tensor {name!r} has size {dim.dim_value} on axis {axis}; a dimension must be {limit}."
                )


def declared_types(proto: onnx.ModelProto) -> dict[str, int]:
    """The element types the file declares for its intermediate tensors, read before binding drops those
    declarations (their shapes follow the new sizes) so that `check_declared_types` can hold them to what
    inference finds."""
    return {
        vi.name: vi.type.tensor_type.elem_type
        for vi in proto.graph.value_info
        if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type
    }


def check_declared_types(proto: onnx.ModelProto, declared: dict[str, int]) -> None:
    """Every declaration of a tensor's element type agrees with what the tensor holds.

    An initializer is what its data says; any other tensor what inference gives its producer. A
    declaration that disagrees (a float16 value info for a float activation, an initializer declared
    as an input of another type) would cost and run the wrong bytes.
    """
    initializers = {init.name: init.data_type for init in proto.graph.initializer}
    claims = [(vi.name, vi.type.tensor_type.elem_type) for vi in proto.graph.input if vi.type.HasField("tensor_type")]
    claims += list(declared.items())
    infos = value_infos(proto)
    producers = {out: node for node in proto.graph.node for out in node.output if out}
    for name, claimed in claims:
        if not claimed:
            continue
        if name in initializers:
            if initializers[name] != claimed:
                raise ModelImportError(
                    f"Initializer {name!r} holds {_type_name(initializers[name])} but the model declares it"
                    f" {_type_name(claimed)}."
                )
            continue
        vi = infos.get(name)
        found = vi.type.tensor_type.elem_type if vi is not None and vi.type.HasField("tensor_type") else 0
        if found and found != claimed:
            node = producers.get(name)
            source = f"operator {node.name or node.output[0]!r} ({node.op_type}) yields" if node else "it is"
            raise ModelImportError(
                f"Tensor {name!r} is declared {_type_name(claimed)} but {source} {_type_name(found)}."
            )


def _type_name(elem_type: int) -> str:
    """ONNX's spelling in type constraints: FLOAT -> 'float', INT64 -> 'int64'."""
    return onnx.TensorProto.DataType.Name(elem_type).lower() if elem_type in onnx.TensorProto.DataType.values() else "?"


def check_input_types(proto: onnx.ModelProto) -> None:
    """Inputs that share a type parameter in an operator's schema (MatMul's A and B: T) share a type.

    Shape inference takes the output type from one input and never compares the others, so a
    float activation multiplied by an int32 weight would otherwise plan, and only fail at run time.
    """
    types = {
        name: vi.type.tensor_type.elem_type
        for name, vi in value_infos(proto).items()
        if vi.type.HasField("tensor_type")
    }
    types.update({init.name: init.data_type for init in proto.graph.initializer})
    opset = opset_of(proto)
    signatures: dict[str, tuple[list, set[str]] | None] = {}  # per operator type (a deep model repeats a few)
    for node in proto.graph.node:
        if node.domain not in ("", "ai.onnx"):
            continue
        if node.op_type not in signatures:
            signatures[node.op_type] = _formal_inputs(node.op_type, opset)
        found = signatures[node.op_type]
        if found is None:
            continue
        formals, constrained = found
        bound: dict[str, tuple[str, int]] = {}
        for position, name in enumerate(node.input):
            if not name or not formals or name not in types:
                continue
            formal = formals[min(position, len(formals) - 1)]
            if position >= len(formals) and not formal.is_homogeneous:
                continue
            if formal.type_str not in constrained:
                continue
            seen = bound.setdefault(formal.type_str, (name, types[name]))
            if seen[1] != types[name]:
                raise ModelImportError(
                    f"Operator {node.name or node.output[0]!r} ({node.op_type}) reads {seen[0]!r} as"
                    f" {_type_name(seen[1])} and {name!r} as {_type_name(types[name])}, but ONNX requires one type"
                    f" for both ({formal.type_str})."
                )


def _formal_inputs(op_type: str, opset: int) -> tuple[list, set[str]] | None:
    """An ONNX operator's formal inputs and its constrained type parameters at ``opset`` (None: no schema)."""
    try:
        schema = onnx.defs.get_schema(op_type, opset, "")
    except onnx.defs.SchemaError:
        return None
    return list(schema.inputs), {constraint.type_param_str for constraint in schema.type_constraints}
