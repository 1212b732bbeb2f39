"""Building the `Graph`: fold constants, name operators uniquely, tell parameters from constants.

Precondition: shapes are inferred (`bind`). Postcondition: every tensor an operator reads or
writes has a static shape and a role (data input, parameter, constant or activation); operators
are in topological order with their forward FLOPs from the registry.
"""

from __future__ import annotations

import ast
import dataclasses
import fnmatch
import heapq
import math
from collections import Counter
from collections.abc import Iterable

import numpy as np
import onnx
from onnx import helper, numpy_helper

from autopar.errors import ModelImportError
from autopar.graph.fold import KnownValue, fold_constant
from autopar.graph.proto import FLOAT_DATA_TYPES, attributes, data_inputs, shape_of, value_infos
from autopar.graph.tied import tie_transposed_copies
from autopar.graph.types import FLOAT_TYPES, ElidedValue, Graph, OpNode, TensorInfo, TensorKind, opset_of
from autopar.ops import lookup
from autopar.ops.registry import output_elements


def build_graph(proto: onnx.ModelProto, name: str) -> Graph:
    """The `Graph` of a shape-inferred model, each value built once in its final form (the model may be
    rewritten first: see `_unshare_vectors` and `tie_transposed_copies`)."""
    _unshare_vectors(proto)
    tied = tie_transposed_copies(proto)  # (their Transposes stay operators: folded, the copy would be back)
    infos = value_infos(proto)
    opset = opset_of(proto)
    tensors: dict[str, TensorInfo] = {}
    constants: dict[str, KnownValue] = {}
    for init in proto.graph.initializer:
        external = init.data_location == onnx.TensorProto.EXTERNAL
        constants[init.name] = _elided(tuple(init.dims), init.data_type) if external else numpy_helper.to_array(init)

    nodes, weighty = _folded(proto, constants, infos, tied)
    graph_outputs = {o.name for o in proto.graph.output}
    names, renamed = _unique_names([node.name or f"{node.op_type}_{i}" for i, node in enumerate(nodes)])

    roles = _constant_roles(nodes, {name: v for name, v in constants.items() if name in weighty}, opset)
    read = {inp for node in nodes for inp in node.input} | graph_outputs
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

    # an unused optional output (e.g. an old Dropout's mask) may have no inferred type: drop it
    outputs_of = [tuple(o if (o in read or o in infos) else "" for o in node.output) for node in nodes]
    for node, op_name, outs in zip(nodes, names, outputs_of):
        for out in outs:
            if out and out not in tensors:
                shape, dtype = shape_of(out, infos)
                tensors[out] = TensorInfo(out, shape, dtype, "activation")
        for inp in node.input:
            if inp and inp not in tensors:
                raise ModelImportError(f"Operator {op_name!r} reads tensor {inp!r}, which nothing produces.")

    ops = []
    for position, file_position in enumerate(_topological([tuple(n.input) for n in nodes], outputs_of)):
        node, outs = nodes[file_position], outputs_of[file_position]
        attrs = attributes(node)
        in_shapes = [tensors[i].shape if i else None for i in node.input]
        out_shapes = [tensors[o].shape for o in outs if o]
        definition = lookup(node.op_type, node.domain, opset)
        count = definition.flops if definition is not None else output_elements
        ops.append(
            OpNode(
                name=names[file_position],
                op_type=node.op_type,
                inputs=tuple(node.input),
                outputs=outs,
                attrs=attrs,
                index=position,
                flops=count(in_shapes, out_shapes, attrs),
                domain=node.domain,
                proto=node,
                source=framework_name(node),
            )
        )

    return Graph(
        name=name,
        ops=tuple(ops),
        tensors=tensors,
        inputs=tuple(graph_inputs),
        outputs=tuple(o.name for o in proto.graph.output),
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


def gradient_reaches(graph: Graph) -> dict[str, bool]:
    """Per tensor, whether a gradient reaches it: it depends on a trained parameter through differentiable
    operators and float tensors, and a graph output (the loss) depends on it the same way (an operator
    autopar does not know passes gradients). A buffer read only by TopK's indices, an ArgMax or a
    comparison (a router's bias, a mask) has none, as autograd gives it none.

    >>> from onnx import TensorProto
    >>> from autopar.graph import load_model
    >>> values = [numpy_helper.from_array(np.full(shape, 0.5, np.float32), name) for name, shape in
    ...           [("w", (4, 4)), ("b", (4,))]] + [numpy_helper.from_array(np.array([1]), "k")]
    >>> nodes = [helper.make_node("MatMul", ["x", "w"], ["y"]), helper.make_node("Add", ["x", "b"], ["v"]),
    ...          helper.make_node("TopK", ["v", "k"], ["top", "i"])]
    >>> typed = [helper.make_tensor_value_info(n, t, s) for n, t, s in
    ...          [("x", TensorProto.FLOAT, [2, 4]), ("y", TensorProto.FLOAT, [2, 4]), ("i", TensorProto.INT64, [2, 1])]]
    >>> graph = load_model(helper.make_model(helper.make_graph(nodes, "g", typed[:1], typed[1:], values)))
    >>> reaches = gradient_reaches(graph)
    >>> reaches["w"], reaches["b"], graph.tensor("b").trainable
    (True, False, False)
    """
    grad = {name: info.kind == "parameter" and info.trainable for name, info in graph.tensors.items()}
    differentiable = {}
    for op in graph.ops:
        definition = lookup(op.op_type, op.domain, graph.opset)
        differentiable[op.name] = definition is None or definition.differentiable
        needs = differentiable[op.name] and any(grad.get(name, False) for name in op.inputs if name)
        for out in op.outputs:
            if out:
                grad[out] = needs and graph.tensor(out).is_float
    reaches = {name: grad.get(name, False) for name in graph.outputs}  # back from the outputs
    for op in reversed(graph.ops):
        if differentiable[op.name] and any(reaches.get(out, False) for out in op.outputs if out):
            for name in op.inputs:
                if name and grad.get(name, False):
                    reaches[name] = True
    return {name: needs and reaches.get(name, False) for name, needs in grad.items()}


def untrained(graph: Graph) -> Graph:
    """The graph with the trainable parameters no gradient reaches (`gradient_reaches`) not trained: autograd
    gives them no gradient, so they have no optimizer state and no gradient synchronisation."""
    reaches = gradient_reaches(graph)
    unreached = [p.name for p in graph.parameters if p.trainable and not reaches.get(p.name, False)]
    if not unreached:
        return graph
    tensors = dict(graph.tensors)
    for name in unreached:
        tensors[name] = dataclasses.replace(tensors[name], trainable=False)
    return dataclasses.replace(graph, tensors=tensors)


def freeze(graph: Graph, patterns: Iterable[str]) -> Graph:
    """The graph with the parameters matching ``patterns`` (names or shell globs) not trained.

    A frozen parameter is still stored on every device that reads it, but has no gradient, no
    optimizer state and no gradient synchronisation. A pattern matching no trainable parameter
    is an error: a misspelt name must not silently train what the user meant to freeze.

    >>> from autopar.graph.types import TensorInfo
    >>> g = Graph("g", (), {"w": TensorInfo("w", (2,), "float32", "parameter", True)}, (), (), onnx.ModelProto())
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
    frozen = {*graph.frozen, *(name for name in trainable if not tensors[name].trainable)}
    return dataclasses.replace(graph, tensors=tensors, frozen=tuple(sorted(frozen)))


def _shared_from_weight(node: onnx.NodeProto, weighty: set[str], readers: Counter[str]) -> bool:
    """Whether an operator on a weight stays an operator though its value is known: several operators
    read its output (ALBERT transposes each shared weight once and every layer reads the Transpose).

    Folded, the result would be a new weight read by every layer, owned by the first and redistributed
    to the rest; kept, it is the weight's one reader, as it is anyway when the weights are elided
    (exported to a file not read): the search treats the model alike either way (see
    `autopar.search.costing._weight_only`).
    """
    return node.op_type != "Constant" and any(n in weighty for n in node.input) and readers[node.output[0]] > 1


def train(graph: Graph, patterns: Iterable[str]) -> Graph:
    """The graph with the float constants matching ``patterns`` (names or shell globs) trained.

    The importer's rule (`_constant_roles`) trains a float initializer, or a value folded from one,
    when some operator reads it as a weight; it does not train one no framework would: a stored
    attention mask (only added and holding zeros and very negative numbers, or only multiplied and
    holding zeros and ones), a table several element-wise products or sums read (rotary cos/sin,
    ALiBi), a one-element scale, values built from integers (a causal mask from Range and Where),
    a running statistic. This overrides the rule for a tensor the user does train. A pattern matching
    no float constant of the graph is an error, as a misspelt ``--frozen`` is.

    >>> from autopar.graph.types import TensorInfo
    >>> g = Graph("g", (), {"m": TensorInfo("m", (2, 2), "float32", "constant")}, (), (), onnx.ModelProto())
    >>> (train(g, ["m"]).tensor("m").kind, train(g, ["m"]).tensor("m").trainable)
    ('parameter', True)
    """
    patterns = list(patterns)
    if not patterns:
        return graph
    candidates = sorted(
        name
        for name, info in graph.tensors.items()
        if info.is_float and (info.kind == "constant" or (info.kind == "parameter" and not info.trainable))
    )
    tensors = dict(graph.tensors)
    for pattern in patterns:
        matched = [name for name in candidates if fnmatch.fnmatchcase(name, pattern)]
        if not matched:
            some = ", ".join(repr(name) for name in candidates[:3]) or "none"
            raise ModelImportError(
                f"No float constant or untrained parameter of the model matches {pattern!r} to train (it has {some})."
            )
        for name in matched:
            tensors[name] = dataclasses.replace(tensors[name], kind="parameter", trainable=True)
    return dataclasses.replace(graph, tensors=tensors)


SCATTERS = frozenset({"ScatterND", "ScatterElements", "Scatter"})
"""Operators that write values into a copy of their first input at given places."""


def _folded(
    proto: onnx.ModelProto,
    constants: dict[str, KnownValue],
    infos: dict[str, onnx.ValueInfoProto],
    tied: frozenset[str],
) -> tuple[list[onnx.NodeProto], set[str]]:
    """Fold into ``constants`` what the import can compute; the operators that stay, in the file's order, and the
    values that may be weights: stored or elided float tensors, and what is folded from them (a Transpose of a
    weight is a weight; a causal mask built from Range and Where is not, nor a buffer built for scatters)."""
    buffers = scattered_buffers(proto)
    # a table stored with one value throughout that only scatters write into is a buffer (``zeros_like`` folded)
    weighty = {
        name for name, value in constants.items() if _may_be_weight(value) and not (name in buffers and _uniform(value))
    }
    nodes: list[onnx.NodeProto] = []
    graph_outputs = {o.name for o in proto.graph.output}
    readers = Counter(name for node in proto.graph.node for name in set(node.input) if name)
    for node in proto.graph.node:
        folded = None if set(node.output) & graph_outputs else fold_constant(node, constants, infos, proto)
        if folded is not None and (node.output[0] in tied or _shared_from_weight(node, weighty, readers)):
            folded = None
        if folded is not None and node.op_type in ("Transpose", "Reshape") and node.input[0] in buffers:
            folded = None  # (the order a buffer is scattered in stays an operator: the trainer reads it there)
        if folded is None:
            nodes.append(node)
            continue
        if isinstance(folded, ElidedValue) and node.output[0] in buffers:
            folded = _filled(node, folded)
        constants[node.output[0]] = folded
        from_weight = any(name in weighty for name in node.input)
        built = node.op_type in ("Constant", "ConstantOfShape") and node.output[0] not in buffers
        if from_weight or (built and _may_be_weight(folded)):
            weighty.add(node.output[0])
    return nodes, weighty


def scattered_buffers(proto: onnx.ModelProto) -> set[str]:
    """Tensors that scatters alone read, directly or through Transposes and Reshapes: a buffer the model builds to
    write into (DeepSeek-V3's key states, ``new_empty`` filled by two slice assignments; a routing mask from
    ``zeros_like``) or the values it writes (``scatter``'s one value, made a table of its indices' shape). A
    weight elided as ``ConstantOfShape`` is read by the products and norms it is a weight of; such a buffer, built
    the same way, is a constant.

    >>> from onnx import helper
    >>> nodes = [helper.make_node("ConstantOfShape", ["s"], ["zeros"]),
    ...          helper.make_node("Transpose", ["zeros"], ["turned"], perm=[1, 0]),
    ...          helper.make_node("ScatterND", ["turned", "i", "u"], ["y"]),
    ...          helper.make_node("MatMul", ["x", "w"], ["z"])]
    >>> sorted(scattered_buffers(helper.make_model(helper.make_graph(nodes, "g", [], []))))
    ['turned', 'u', 'zeros']
    """
    consumers: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
    for node in proto.graph.node:
        for slot, name in enumerate(node.input):
            if name:
                consumers.setdefault(name, []).append((node, slot))
    found: dict[str, bool] = {}

    def only_scattered(name: str) -> bool:
        if name not in found:
            found[name] = False  # (a cycle is no buffer)
            readers = consumers.get(name, [])
            found[name] = bool(readers) and all(
                (node.op_type in SCATTERS and slot != 1)
                or (
                    node.op_type in ("Transpose", "Reshape")
                    and slot == 0
                    and all(only_scattered(out) for out in node.output if out)
                )
                for node, slot in readers
            )
        return found[name]

    return {name for name in consumers if only_scattered(name)}


def _uniform(value: KnownValue) -> bool:
    """A stored table holding one value throughout (an elided one's values are not known).

    >>> _uniform(np.zeros((4, 1), dtype=np.float32)), _uniform(np.eye(2, dtype=np.float32))
    (True, False)
    """
    return isinstance(value, np.ndarray) and value.size > 0 and bool((value == value.reshape(-1)[0]).all())


def _filled(node: onnx.NodeProto, elided: ElidedValue) -> np.ndarray:
    """A buffer ``ConstantOfShape`` fills (`scattered_buffers`): its one value at every place, one element held
    (a read-only broadcast view: a key-state buffer of a large model is gigabytes)."""
    fill = np.asarray(attributes(node).get("value", np.zeros(1, dtype=np.float32)))
    return np.broadcast_to(fill.reshape(-1)[:1].astype(elided.dtype).reshape(()), elided.shape)


def _may_be_weight(value: KnownValue) -> bool:
    return value.dtype in FLOAT_TYPES and math.prod(value.shape) > 1


def _elided(dims: tuple[int, ...], data_type: int) -> KnownValue:
    return ElidedValue(dims, np.dtype(helper.tensor_dtype_to_np_dtype(data_type)))


def _unique_names(names: list[str]) -> tuple[list[str], dict[str, str]]:
    """Every operator's name made unique (a generated one never collides), and new name -> the file's name.

    >>> _unique_names(["a", "b", "a", "a_1"])
    (['a', 'b', 'a_2', 'a_1'], {'a_2': 'a'})
    """
    taken = set(names)
    seen: set[str] = set()
    unique: list[str] = []
    renamed: dict[str, str] = {}
    for name in names:
        if name in seen:
            suffix = 1
            while f"{name}_{suffix}" in taken:
                suffix += 1
            renamed[f"{name}_{suffix}"] = name
            name = f"{name}_{suffix}"
            taken.add(name)
        seen.add(name)
        unique.append(name)
    return unique, renamed


def _constant_roles(
    nodes: Iterable[onnx.NodeProto], constants: dict[str, KnownValue], opset: int
) -> dict[str, tuple[TensorKind, bool]]:
    """Tell learned weights from configuration constants by how the registry says operators use them."""
    uses: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
    for node in nodes:
        for position, inp in enumerate(node.input):
            if inp in constants:
                uses.setdefault(inp, []).append((node, position))
    roles: dict[str, tuple[TensorKind, bool]] = {}
    for cname, places in uses.items():
        value = constants[cname]
        if value.dtype not in FLOAT_TYPES or value.ndim == 0:
            continue
        definitions = [(lookup(node.op_type, node.domain, opset), position) for node, position in places]
        weight_uses = [(d, p) for d, p in definitions if d is None or p not in d.config_inputs]
        if value.size <= 1 and not any(d is not None and d.weight_inputs for d, _ in weight_uses):
            continue  # a one-element scale fed to arithmetic is a constant; a layer's weight is not
        readers = [node.op_type for node, _ in places]
        if not weight_uses or _is_mask(value, set(readers)) or _is_shared_table(value, readers):
            continue
        statistics = all(d is not None and p in d.statistics_inputs for d, p in weight_uses)
        roles[cname] = ("parameter", not statistics)
    return roles


PER_LAYER_READERS = frozenset({"Mul", "Add", "LayerNormalization", "RMSNormalization", "BatchNormalization"})
"""Operators that read a vector as their own per-feature scale, bias or statistic."""


def _unshare_vectors(proto: onnx.ModelProto) -> None:
    """Give each reader its own copy of a float vector that several element-wise products or sums, or
    normalisations, read and nothing else.

    Exporters merge initializers that hold identical values, so a fresh model's norm scales and
    biases (all ones, all zeros) arrive as one tensor that every layer reads, where the framework
    trains one per layer. Left merged, one layer would own them all and tie every layer to it.
    PyTorch's TorchScript exporter keeps each merged parameter's own name as an Identity of the one
    it kept (T5's twelve norm scales): such an Identity, read only as a per-layer vector, becomes a
    copy under that name.
    """
    initializers = {tensor.name: tensor for tensor in proto.graph.initializer}
    places: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
    consumers: dict[str, set[str]] = {}
    for node in proto.graph.node:
        for slot, name in enumerate(node.input):
            consumers.setdefault(name, set()).add(node.op_type)
            if name in initializers:
                places.setdefault(name, []).append((node, slot))
    outputs = {o.name for o in proto.graph.output}

    def named_copy(node: onnx.NodeProto) -> bool:
        """An Identity that only names a per-layer vector (its output read as one, not a graph output)."""
        if node.op_type != "Identity" or len(node.output) != 1 or node.output[0] in outputs:
            return False
        read_by = consumers.get(node.output[0], set())
        return bool(read_by) and read_by <= PER_LAYER_READERS

    taken = set(initializers) | {out for node in proto.graph.node for out in node.output}
    renamed: list[onnx.NodeProto] = []
    for name, readers in places.items():
        tensor = initializers[name]
        if len(readers) < 2 or len(tensor.dims) != 1 or tensor.data_type not in FLOAT_DATA_TYPES or name in outputs:
            continue
        if any(node.op_type not in PER_LAYER_READERS and not named_copy(node) for node, _ in readers):
            continue
        for node, _ in readers:
            if named_copy(node):
                copy = onnx.TensorProto()
                copy.CopyFrom(tensor)
                copy.name = node.output[0]
                proto.graph.initializer.append(copy)
                renamed.append(node)
        readers = [(node, slot) for node, slot in readers if not named_copy(node)]
        for copy_index, (node, slot) in enumerate(readers[1:], start=1):
            new_name = f"{name}.{copy_index}"
            while new_name in taken:
                new_name += "_"
            taken.add(new_name)
            copy = onnx.TensorProto()
            copy.CopyFrom(tensor)
            copy.name = new_name
            proto.graph.initializer.append(copy)
            node.input[slot] = new_name
    for node in renamed:
        proto.graph.node.remove(node)


MASK_FLOOR = -1e4
"""An additive mask hides a position with a value at or below this (PyTorch uses -inf or the dtype's minimum)."""


def _is_mask(value: KnownValue, readers: set[str]) -> bool:
    """A stored attention mask, which no framework trains: only added or selected by Where, and holding
    only zeros and very negative numbers; or only multiplied (or selected), and holding only zeros and
    ones (both present).

    >>> _is_mask(np.triu(np.full((4, 4), -1e4, dtype=np.float32), 1), {"Add"})
    True
    >>> _is_mask(np.zeros((4,), dtype=np.float32), {"Add"})  # a bias initialised to zero
    False
    >>> _is_mask(np.triu(np.full((4, 4), -np.inf, dtype=np.float32), 1), {"Where"})
    True
    """
    if not isinstance(value, np.ndarray):
        return False
    if readers and readers <= {"Add", "Where"}:  # added to the scores, or selected where a condition holds
        hidden = value <= MASK_FLOOR
        return bool(hidden.any() and np.all(hidden | (value == 0)))
    if readers and readers <= {"Mul", "Where"} and readers != {"Where"}:
        return bool((value == 0).any() and (value == 1).any() and np.all((value == 0) | (value == 1)))
    return False


def _is_shared_table(value: KnownValue, readers: list[str]) -> bool:
    """A table over positions that several element-wise products or sums read, and nothing else: rotary
    cos/sin (read by every query and key rotation), an ALiBi bias (added to every layer's scores). No
    framework trains one. A trained scale or bias is a vector, which an exporter may share between
    layers only because a fresh model's norms hold identical values; a weight shared between layers
    (ALBERT, a tied embedding) is read by matrix products and lookups.

    >>> table, scale = np.zeros((16, 8), np.float32), np.ones(8, np.float32)
    >>> _is_shared_table(table, ["Mul", "Mul"]), _is_shared_table(scale, ["Mul", "Mul"])
    (True, False)
    >>> _is_shared_table(table, ["Add"]), _is_shared_table(table, ["MatMul", "MatMul"])
    (False, False)
    """
    return value.ndim >= 2 and len(readers) >= 2 and set(readers) <= {"Mul", "Add"}


def _topological(inputs: list[tuple[str, ...]], outputs: list[tuple[str, ...]]) -> list[int]:
    """ONNX requires topological order; re-sort defensively, stable on the file's order.

    The positions (in the file) of the operators in order: of the operators ready to run, the
    earliest in the file first (a lexicographic topological sort).

    >>> _topological([("b",), ("x",)], [("c",), ("b",)])
    [1, 0]
    >>> _topological([("b",), ("a",)], [("a",), ("b",)])
    Traceback (most recent call last):
    autopar.errors.ModelImportError: The model graph has a cycle.
    """
    produced = {out: position for position, outs in enumerate(outputs) for out in outs if out}
    waiting = [0] * len(inputs)  # per operator, how many of its producers have not run
    successors: list[list[int]] = [[] for _ in inputs]
    for position, ins in enumerate(inputs):
        for source in {produced[i] for i in ins if i in produced and produced[i] != position}:
            successors[source].append(position)
            waiting[position] += 1
    ready = [position for position, count in enumerate(waiting) if not count]  # (ascending: a heap already)
    order: list[int] = []
    while ready:
        position = heapq.heappop(ready)
        order.append(position)
        for successor in successors[position]:
            waiting[successor] -= 1
            if not waiting[successor]:
                heapq.heappush(ready, successor)
    if len(order) < len(inputs):
        raise ModelImportError("The model graph has a cycle.")
    return order
