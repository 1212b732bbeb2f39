"""Building the `Graph`: fold constants, name operators uniquely, tell parameters from constants.

Precondition: shapes are inferred (`bind`). Postcondition: every tensor an operator reads or
writes has a static shape and a role (data input, parameter, constant or activation); operators
are in topological order with their forward FLOPs from the registry.
"""

from __future__ import annotations

import ast
import dataclasses
import fnmatch
import math
from collections.abc import Iterable

import numpy as np
import onnx
from onnx import helper, numpy_helper

from autopar.errors import ModelImportError
from autopar.graph.fold import KnownValue, fold_constant
from autopar.graph.proto import attributes, data_inputs, shape_of, value_infos
from autopar.graph.types import FLOAT_TYPES, ElidedValue, Graph, OpNode, TensorInfo, TensorKind, opset_of
from autopar.ops import lookup
from autopar.ops.registry import output_elements


def build_graph(proto: onnx.ModelProto, name: str) -> Graph:
    """The `Graph` of a shape-inferred model."""
    infos = value_infos(proto)
    opset = opset_of(proto)
    tensors: dict[str, TensorInfo] = {}
    constants: dict[str, KnownValue] = {}
    for init in proto.graph.initializer:
        if init.data_location == onnx.TensorProto.EXTERNAL:
            dims = tuple(int(d) for d in init.dims)
            constants[init.name] = _elided(dims, init.data_type)
        else:
            constants[init.name] = numpy_helper.to_array(init)

    # values that may be weights: stored or elided float tensors, and what is folded from them
    # (a Transpose of a weight is a weight; a causal mask built from Range and Where is not)
    weighty = {name for name, value in constants.items() if _may_be_weight(value)}
    ops: list[OpNode] = []
    graph_outputs = {o.name for o in proto.graph.output}
    for node in proto.graph.node:
        folded = None if set(node.output) & graph_outputs else fold_constant(node, constants, infos, proto)
        if folded is not None:
            constants[node.output[0]] = folded
            from_weight = any(name in weighty for name in node.input)
            if from_weight or (node.op_type in ("Constant", "ConstantOfShape") and _may_be_weight(folded)):
                weighty.add(node.output[0])
            continue
        ops.append(
            OpNode(
                name=node.name or f"{node.op_type}_{len(ops)}",
                op_type=node.op_type,
                inputs=tuple(node.input),
                outputs=tuple(node.output),
                attrs=attributes(node),
                index=len(ops),
                domain=node.domain,
                proto=node,
                source=framework_name(node),
            )
        )
    renamed = _rename_duplicates(ops)

    roles = _constant_roles(ops, {name: v for name, v in constants.items() if name in weighty}, opset)
    read = {inp for op in ops for inp in op.inputs} | graph_outputs
    for cname, value in constants.items():
        if cname not in read:
            continue  # e.g. the shape initializers of folded weight-elided parameters
        kind, trainable = roles.get(cname, ("constant", False))
        stored = value if isinstance(value, np.ndarray) else None
        shape = tuple(int(d) for d in value.shape)
        tensors[cname] = TensorInfo(cname, shape, value.dtype.name, kind, trainable, stored)

    graph_inputs = []
    for vi in data_inputs(proto):
        if vi.name in tensors:
            continue
        shape, dtype = shape_of(vi.name, infos)
        tensors[vi.name] = TensorInfo(vi.name, shape, dtype, "input")
        graph_inputs.append(vi.name)

    for op in ops:
        # an unused optional output (e.g. an old Dropout's mask) may have no inferred type: drop it
        op.outputs = tuple(o if (o in read or o in infos) else "" for o in op.outputs)
        for out in op.outputs:
            if out and out not in tensors:
                shape, dtype = shape_of(out, infos)
                tensors[out] = TensorInfo(out, shape, dtype, "activation")
        for inp in op.inputs:
            if inp and inp not in tensors:
                raise ModelImportError(f"Operator {op.name!r} reads tensor {inp!r}, which nothing produces.")

    for op in ops:
        in_shapes = [tensors[i].shape if i else None for i in op.inputs]
        out_shapes = [tensors[o].shape for o in op.outputs if o]
        definition = lookup(op.op_type, op.domain, opset)
        count = definition.flops if definition is not None else output_elements
        op.flops = count(in_shapes, out_shapes, op.attrs)

    outputs = [o.name for o in proto.graph.output]
    return Graph(
        name=name,
        ops=_topological(ops),
        tensors=tensors,
        inputs=graph_inputs,
        outputs=outputs,
        model=proto,
        renamed_ops=renamed,
    )


def framework_name(node: onnx.NodeProto) -> str:
    """The layer the exporting framework built this node for, where the file says.

    PyTorch's dynamo exporter records the module scopes (``pkg.torch.onnx.name_scopes``:
    ``['', 'blocks.0', 'blocks.0.qkv', 'linear']`` -> ``blocks.0.qkv``); its TorchScript exporter
    names nodes by module path (``/blocks.0/qkv/MatMul`` -> ``blocks.0.qkv``).

    >>> framework_name(helper.make_node("MatMul", ["a", "b"], ["c"], name="/blocks.0/qkv/MatMul"))
    'blocks.0.qkv'
    """
    for prop in node.metadata_props:
        if prop.key == "pkg.torch.onnx.name_scopes":
            try:
                scopes = [str(s) for s in ast.literal_eval(prop.value)]
            except (ValueError, SyntaxError, TypeError):
                break
            return scopes[-2] if len(scopes) >= 2 else ""
    if node.name.startswith("/") and node.name.count("/") >= 2:
        return ".".join(part for part in node.name.strip("/").split("/")[:-1] if part)
    return ""


def freeze(graph: Graph, patterns: Iterable[str]) -> Graph:
    """The graph with the parameters matching ``patterns`` (names or shell globs) not trained.

    A frozen parameter is still stored on every device that reads it, but has no gradient, no
    optimizer state and no gradient synchronisation. A pattern matching no trainable parameter
    is an error: a misspelt name must not silently train what the user meant to freeze.

    >>> from autopar.graph.types import TensorInfo
    >>> g = Graph("g", [], {"w": TensorInfo("w", (2,), "float32", "parameter", True)}, [], [], onnx.ModelProto())
    >>> freeze(g, ["w*"]).tensor("w").trainable
    False
    """
    patterns = list(patterns)
    if not patterns:
        return graph
    trainable = sorted(name for name, info in graph.tensors.items() if info.kind == "parameter" and info.trainable)
    tensors = dict(graph.tensors)
    for pattern in patterns:
        matched = [name for name in trainable if fnmatch.fnmatchcase(name, pattern)]
        if not matched:
            some = ", ".join(repr(name) for name in trainable[:3]) or "none"
            raise ModelImportError(
                f"No trainable parameter of the model matches {pattern!r} to freeze (its parameters include {some})."
            )
        for name in matched:
            tensors[name] = dataclasses.replace(tensors[name], trainable=False)
    return Graph(
        graph.name, graph.ops, tensors, graph.inputs, graph.outputs, graph.model, renamed_ops=graph.renamed_ops
    )


def _may_be_weight(value: KnownValue) -> bool:
    return value.dtype in FLOAT_TYPES and math.prod(value.shape) > 1


def _elided(dims: tuple[int, ...], data_type: int) -> KnownValue:
    return ElidedValue(dims, np.dtype(helper.tensor_dtype_to_np_dtype(data_type)))


def _rename_duplicates(ops: list[OpNode]) -> dict[str, str]:
    """Give every operator a unique name (a generated one never collides); new name -> the file's name."""
    taken = {op.name for op in ops}
    seen: set[str] = set()
    renamed: dict[str, str] = {}
    for op in ops:
        if op.name in seen:
            suffix = 1
            while f"{op.name}_{suffix}" in taken:
                suffix += 1
            renamed[f"{op.name}_{suffix}"] = op.name
            op.name = f"{op.name}_{suffix}"
            taken.add(op.name)
        seen.add(op.name)
    return renamed


def _constant_roles(
    ops: Iterable[OpNode], constants: dict[str, KnownValue], opset: int
) -> dict[str, tuple[TensorKind, bool]]:
    """Tell learned weights from configuration constants by how the registry says operators use them."""
    uses: dict[str, list[tuple[OpNode, int]]] = {}
    for op in ops:
        for position, inp in enumerate(op.inputs):
            if inp in constants:
                uses.setdefault(inp, []).append((op, position))
    roles: dict[str, tuple[TensorKind, bool]] = {}
    for cname, places in uses.items():
        value = constants[cname]
        if value.dtype not in FLOAT_TYPES or value.ndim == 0:
            continue
        definitions = [(lookup(op.op_type, op.domain, opset), position) for op, position in places]
        weight_uses = [(d, p) for d, p in definitions if d is None or p not in d.config_inputs]
        if value.size <= 1 and not any(d is not None and d.weight_inputs for d, _ in weight_uses):
            continue  # a one-element scale fed to arithmetic is a constant; a layer's weight is not
        if not weight_uses:
            continue
        statistics = all(d is not None and p in d.statistics_inputs for d, p in weight_uses)
        roles[cname] = ("parameter", not statistics)
    return roles


def _topological(ops: list[OpNode]) -> list[OpNode]:
    """ONNX requires topological order; re-sort defensively, stable on the file's order."""
    import networkx as nx  # only here: importing it costs a tenth of a second every run

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
