"""Experts reached by gathered weights, rewritten to GShard's dispatch so that tokens move to their experts.

Hugging Face's ``batched_mm`` experts (Mixtral, OLMoE, Qwen-MoE, DeepSeek-V3, as the dynamo exporter writes
them) take each routed row's expert weights from the ``[experts, out, in]`` stack, ``GatherND(stack,
index)``, and multiply them by the row: ``MatMul(gathered, row[..., None])``. The gathered tensor holds
a copy of an expert's weights per routed row; no layout says which device holds a row's expert, so a
plan can only keep the experts whole there. `route_experts` writes the same experts as GShard does
(Lepikhin et al., 2020, "GShard", section 2.2), with the shapes fixed when the file is written:

- the routed rows are cut into groups of at most ``group_rows`` (consecutive rows, whole tokens, dividing each
  sample's rows);
- each row's place among its expert's rows in the group is counted (``OneHot``, ``CumSum``), and a row
  past the expert's ``capacity`` (``ceil(capacity_factor * group / experts)``, at most the group's tokens) is
  dropped: its expert output is zero, as GShard and Megatron's token dropping write it;
- ``Einsum("grec,grb->egcb")`` dispatches the rows to ``[experts, groups * capacity, in]``, the experts'
  products run as one ``MatMul`` over the expert axis, and ``Einsum("grec,egca->gra")`` combines them
  back into the rows, where the exported graph goes on (gate weights, the sum over the top k).

Between two products of one index (SwiGLU's gate-and-up, then down) the row-wise operators run on the
experts' rows, so the rows are dispatched once and combined once. The expert axis is then a label of
the dispatch and of each expert product: a plan may split it, and the tokens move between the batch
split and the expert split by AllToAll. A capacity factor of ``experts / top_k`` or more drops no row,
and the routed model computes what the exported one does; below it, the rows past capacity are lost,
as in GShard's training.

>>> import numpy as np
>>> from onnx import TensorProto, helper, numpy_helper
>>> stack = numpy_helper.from_array(np.arange(24, dtype=np.float32).reshape(2, 3, 4), "stack")
>>> nodes = [
...     helper.make_node("Reshape", ["route", "pairs"], ["index"], name="index"),
...     helper.make_node("GatherND", ["stack", "index"], ["gathered"], name="gather"),
...     helper.make_node("Reshape", ["tokens", "columns"], ["column"], name="column"),
...     helper.make_node("MatMul", ["gathered", "column"], ["y"], name="product"),
... ]
>>> shapes = [numpy_helper.from_array(np.array(s, np.int64), n) for n, s in (("pairs", [4, 1]), ("columns", [4, 4, 1]))]
>>> inputs = [helper.make_tensor_value_info("route", TensorProto.INT64, [1, 4]),
...           helper.make_tensor_value_info("tokens", TensorProto.FLOAT, [1, 4, 4])]
>>> outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 3, 1])]
>>> model = helper.make_model(helper.make_graph(nodes, "g", inputs, outputs, [stack, *shapes]))
>>> routed = route_experts(model, capacity_factor=2.0, group_rows=4)
>>> routed.blocks
(RoutedBlock(products=('product',), experts=2, rows=4, group_rows=4, capacity=4),)
>>> sorted({node.op_type for node in routed.model.graph.node} - {"Constant"})
['Cast', 'CumSum', 'Einsum', 'MatMul', 'Mul', 'OneHot', 'Reshape', 'Sub', 'Transpose', 'Unsqueeze']
>>> import onnxruntime
>>> run = lambda m: onnxruntime.InferenceSession(m.SerializeToString()).run(None, {"route": np.array([[1, 0, 1, 1]]),
...     "tokens": np.ones((1, 4, 4), np.float32)})[0]
>>> bool(np.allclose(run(model), run(routed.model)))
True
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from autopar.errors import ModelImportError
from autopar.graph.proto import attributes
from autopar.graph.read import read_model
from autopar.graph.sequences import slice_sequences

GROUP_ROWS = 1024
"""Routed rows a group holds by default (512 tokens at top 2): GShard's groups keep the dispatch tensor,
and the dispatch and combine products, a small share of the experts' own work (assumed; GShard's paper
leaves the group size to the user)."""

ROW_WISE = frozenset(
    {"Sigmoid", "Mul", "Add", "Sub", "Div", "Tanh", "Erf", "Relu", "Cast", "Neg", "Exp", "Softplus", "Gelu"}
    | {"Identity", "Split", "Slice", "Squeeze", "Unsqueeze"}
)
"""Operators that act on each routed row alone (their other operands broadcast over the rows), so they
run on the experts' rows unchanged but for an axis count shifted by the expert axis. An empty slot's row
is zeros: each of these is finite there, and so is its gradient (a ``Div`` only by what is not a row;
no reciprocal, power or square root, whose value or slope at zero is infinite, and which the combine's
zero weight would turn into NaN)."""

ORDER_KEEPING = frozenset({"Reshape", "Unsqueeze", "Squeeze", "Expand", "Identity", "Flatten"})
"""Operators through which an index keeps its values in row order (and ``Concat`` or ``Max`` of one
input): two products whose indices lead back to one tensor through them read the same experts."""


@dataclass(frozen=True)
class RoutedBlock:
    """One dispatch: the expert products (MatMul names) it feeds, the experts, the routed rows, the rows
    a group holds and the slots each expert has in a group."""

    products: tuple[str, ...]
    experts: int
    rows: int
    group_rows: int
    capacity: int


@dataclass(frozen=True)
class RoutedModel:
    """The rewritten model and what was rewritten (no block: no gathered experts were found)."""

    model: onnx.ModelProto
    blocks: tuple[RoutedBlock, ...]


@dataclass(frozen=True)
class _Product:
    """``MatMul(GatherND(stack, index), column)``: the stack ``[experts, out, in]`` as the GatherND reads
    it, the index ``[rows, 1]``, the column ``[rows, in, 1]`` and the product ``[rows, out, 1]``."""

    gather: onnx.NodeProto
    between: tuple[onnx.NodeProto, ...]  # identity Transposes between the GatherND and the MatMul
    matmul: onnx.NodeProto
    stack: str
    index_root: str
    column: str
    output: str
    top_k: int  # the rows a token routes, where the index leads back to a TopK's indices; else 1


class _Shapes:
    """Static shapes, element types and the known integer values of the model's tensors, as ONNX's shape
    inference gives them; where the file leaves its batch symbolic, as autopar's importer gives them at a
    batch of one (the rewrite reads rows per sample, and its shapes say -1 wherever the batch enters)."""

    def __init__(self, proto: onnx.ModelProto, dims: Mapping[str, int]) -> None:
        self.shape: dict[str, tuple[int, ...]] = {}
        self.dtype: dict[str, int] = {}
        self.value: dict[str, np.ndarray] = {}
        leading = _symbolic(proto)
        if leading is not None:
            self._imported(proto, 1 if leading else None, dims)
            return
        graph = onnx.shape_inference.infer_shapes(proto).graph
        for info in [*graph.input, *graph.value_info, *graph.output]:
            tensor = info.type.tensor_type
            if info.type.HasField("tensor_type") and tensor.HasField("shape"):
                sizes = tensor.shape.dim
                if all(d.HasField("dim_value") for d in sizes):
                    self.shape[info.name] = tuple(int(d.dim_value) for d in sizes)
                self.dtype[info.name] = tensor.elem_type
        for init in graph.initializer:
            self.shape[init.name] = tuple(init.dims)
            self.dtype[init.name] = init.data_type
            if not init.data_location and init.data_type == onnx.TensorProto.INT64:
                self.value[init.name] = numpy_helper.to_array(init)
        for node in graph.node:
            if node.op_type == "Constant" and "value" in attributes(node):
                value = np.asarray(attributes(node)["value"])
                self.shape[node.output[0]] = value.shape
                self.value[node.output[0]] = value

    def _imported(self, proto: onnx.ModelProto, batch: int | None, dims: Mapping[str, int]) -> None:
        from autopar.graph import load_model  # the importer reads this module's package: import it late

        graph = load_model(proto, batch=batch, dims=dict(dims))
        for name, tensor in graph.tensors.items():
            self.shape[name] = tuple(tensor.shape)
            self.dtype[name] = helper.np_dtype_to_tensor_dtype(np.dtype(tensor.dtype))
            if tensor.value is not None and np.asarray(tensor.value).dtype.kind in "iu":
                self.value[name] = np.asarray(tensor.value)


class _Writer:
    """New nodes and constants, named ``{prefix}.{what}`` (numbered where the model has the name already),
    each carrying the metadata of the product it replaces, so that a plan shows them under its layer."""

    def __init__(self, metadata: Iterable[onnx.StringStringEntryProto], names: set[str]) -> None:
        self.metadata = [(entry.key, entry.value) for entry in metadata]
        self.nodes: list[onnx.NodeProto] = []
        self.used = names  # every node and tensor name in the model, shared by the blocks
        self.prefix = ""

    def name(self, what: str) -> str:
        full, count = f"{self.prefix}.{what}", 1
        while (named := full if count == 1 else f"{full}.{count}") in self.used:
            count += 1
        self.used.add(named)
        return named

    def node(self, op: str, inputs: Iterable[str], what: str, output: str | None = None, **attrs: Any) -> str:
        name = self.name(what)
        self.nodes.append(helper.make_node(op, list(inputs), [output or name], name=name, **attrs))
        for key, value in self.metadata:
            self.nodes[-1].metadata_props.add(key=key, value=value)
        return output or name

    def constant(self, value: np.ndarray, what: str) -> str:
        return self.node("Constant", [], what, value=numpy_helper.from_array(value))


def route_experts(
    model: str | Path | onnx.ModelProto,
    capacity_factor: float,
    group_rows: int = GROUP_ROWS,
    dims: Mapping[str, int] | None = None,
) -> RoutedModel:
    """The model with its gathered expert products written as GShard's dispatch (see the module).

    ``capacity_factor``: each expert's slots in a group, as a multiple of an even share of its rows;
    ``group_rows``: the most routed rows a group holds (a group holds whole tokens and divides each sample's
    rows); ``dims`` binds the inputs' symbolic sizes other than the batch (a batch left symbolic is read
    per sample, and the routed model plans at any batch). ModelImportError (one sentence) for a factor that
    is not positive, a group size below one, a symbol left unbound, or gathered experts below opset 13.
    """
    if not capacity_factor > 0 or not math.isfinite(capacity_factor):
        raise ModelImportError(f"The capacity factor must be a positive number, not {capacity_factor}.")
    if group_rows < 1:
        raise ModelImportError(f"A group must hold at least one routed row, not {group_rows}.")
    proto = read_model(model)
    slice_sequences(proto)
    shapes = _Shapes(proto, dims or {})
    products = _products(proto, shapes)
    blocks = _blocks(proto, products, shapes)
    if blocks and _opset(proto) < 13:
        raise ModelImportError(
            f"Routing experts writes Unsqueeze with its axes as an input and Einsum, which need opset 13 or later;"
            f" the model's is {_opset(proto)} (export it at a later opset)."
        )
    samples = _samples(proto)
    read_before = {name for node in proto.graph.node for name in node.input}
    names = {node.name for node in proto.graph.node} | {out for node in proto.graph.node for out in node.output}
    names |= {init.name for init in proto.graph.initializer} | {info.name for info in proto.graph.input}
    routed: list[RoutedBlock] = []
    written: list[onnx.NodeProto] = []
    for products, joins in blocks:
        sizes, nodes = _route(shapes, (products, joins), capacity_factor, group_rows, samples, names)
        routed.append(dataclasses.replace(sizes, products=tuple(product.matmul.name for product in products)))
        written += nodes
    if routed:
        # a node is known by its first output (outputs are unique): the block's own nodes go, once for all
        removed = {
            node.output[0] for products, _ in blocks for p in products for node in (p.gather, *p.between, p.matmul)
        }
        removed |= {node.output[0] for _, joins in blocks for nodes in joins for node in nodes}
        kept = [node for node in proto.graph.node if node.output[0] not in removed]
        del proto.graph.node[:]
        proto.graph.node.extend(kept + written)
        _drop_unread(proto, read_before)
        _sort_topologically(proto)
    return RoutedModel(proto, tuple(routed))


def _consumers(proto: onnx.ModelProto) -> dict[str, list[onnx.NodeProto]]:
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in proto.graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    return readers


def _index_root(name: str, producers: dict[str, onnx.NodeProto]) -> str:
    """The tensor an index leads back to through operators that keep its values in row order."""
    while name in producers:
        node = producers[name]
        single = node.op_type in ("Concat", "Max", "Min") and len(node.input) == 1
        if node.op_type not in ORDER_KEEPING and not single:
            break
        name = node.input[0]
    return name


def _through_transposes(name: str, producers: dict[str, onnx.NodeProto]) -> str:
    """The tensor ``name`` transposes (through any number of Transposes), or ``name``."""
    while name in producers and producers[name].op_type == "Transpose" and not producers[name].domain:
        name = producers[name].input[0]
    return name


def _is_identity_transpose(node: onnx.NodeProto) -> bool:
    perm = attributes(node).get("perm")
    return node.op_type == "Transpose" and perm is not None and list(perm) == list(range(len(perm)))


def _products(proto: onnx.ModelProto, shapes: _Shapes) -> list[_Product]:
    """Every ``MatMul(GatherND(stack, index), column)`` whose stack is a stored ``[experts, out, in]``
    parameter (as it is, or through Transposes) and whose column is ``[rows, in, 1]``, in the graph's
    order; none whose gathered weights the graph also returns."""
    readers = _consumers(proto)
    producers = {out: node for node in proto.graph.node for out in node.output}
    stored = {init.name for init in proto.graph.initializer}
    returned = {info.name for info in proto.graph.output}
    found = []
    for node in proto.graph.node:
        if node.op_type != "GatherND" or node.domain or attributes(node).get("batch_dims", 0) != 0:
            continue
        stack, index = node.input[0], node.input[1]
        if _through_transposes(stack, producers) not in stored:
            continue
        stack_shape, index_shape = shapes.shape.get(stack), shapes.shape.get(index)
        if stack_shape is None or len(stack_shape) != 3 or index_shape is None or len(index_shape) != 2:
            continue
        if index_shape[1] != 1:
            continue
        between, tensor = [], node.output[0]
        while len(readers.get(tensor, [])) == 1 and _is_identity_transpose(readers[tensor][0]):
            between.append(readers[tensor][0])
            tensor = between[-1].output[0]
        matmuls = readers.get(tensor, [])
        if len(matmuls) != 1 or matmuls[0].op_type != "MatMul" or matmuls[0].input[0] != tensor:
            continue
        if returned & {node.output[0], *(t.output[0] for t in between)}:
            continue
        matmul = matmuls[0]
        rows = index_shape[0]
        column_shape = shapes.shape.get(matmul.input[1])
        if column_shape != (rows, stack_shape[2], 1):
            continue
        root = _index_root(index, producers)
        chosen = root in producers and producers[root].op_type == "TopK" and root == producers[root].output[-1]
        top_k = shapes.shape[root][-1] if chosen and shapes.shape.get(root) else 1
        found.append(_Product(node, tuple(between), matmul, stack, root, matmul.input[1], matmul.output[0], top_k))
    return found


_Block = tuple[list[_Product], list[list[onnx.NodeProto]]]
"""Products of one index, and the row-wise operators that join each to the next (in the graph's order)."""


def _blocks(proto: onnx.ModelProto, products: list[_Product], shapes: _Shapes) -> list[_Block]:
    """The products in blocks: each joined to the next product of its index by row-wise operators."""
    join = _Join(proto, shapes)
    taken: set[str] = set()  # products by their output (a node's name may be empty; its outputs are unique)
    blocks = []
    for first in products:
        if first.output in taken:
            continue
        chain, joins = [first], []
        while (joined := join.following(chain[-1], products, taken)) is not None:
            chain.append(joined[0])
            joins.append(joined[1])
            taken.add(joined[0].output)
        taken.add(first.output)
        blocks.append((chain, joins))
    return blocks


class _Join:
    """Which product follows another through row-wise operators alone."""

    def __init__(self, proto: onnx.ModelProto, shapes: _Shapes) -> None:
        self.readers = _consumers(proto)
        self.producers = {out: node for node in proto.graph.node for out in node.output}
        self.order = {node.output[0]: i for i, node in enumerate(proto.graph.node)}
        self.returned = {info.name for info in proto.graph.output}
        self.shapes = shapes

    def following(
        self, product: _Product, products: list[_Product], taken: set[str]
    ) -> tuple[_Product, list[onnx.NodeProto]] | None:
        """The next product of the same index that reads ``product``'s rows only through row-wise
        operators, and those operators; None where there is none."""
        reached: dict[str, onnx.NodeProto] = {}
        frontier = [product.output]
        while frontier:
            tensor = frontier.pop()
            for reader in self.readers.get(tensor, []):
                if reader.output[0] not in reached and _row_wise(reader):
                    reached[reader.output[0]] = reader
                    frontier += list(reader.output)
        for following in products:
            if following is product or following.output in taken or following.index_root != product.index_root:
                continue
            source = self.producers.get(following.column)
            if source is None or source.output[0] not in reached:
                continue
            path = self._path_to(source, reached)
            if self._liftable(path, product, following):
                return following, sorted(path.values(), key=lambda node: self.order[node.output[0]])
        return None

    def _path_to(self, end: onnx.NodeProto, reached: dict[str, onnx.NodeProto]) -> dict[str, onnx.NodeProto]:
        """The reached operators ``end`` depends on, itself included."""
        path: dict[str, onnx.NodeProto] = {}
        stack = [end]
        while stack:
            node = stack.pop()
            if node.output[0] in path:
                continue
            path[node.output[0]] = node
            for name in node.input:
                source = self.producers.get(name)
                if source is not None and source.output[0] in reached:
                    stack.append(source)
        return path

    def _liftable(self, path: dict[str, onnx.NodeProto], product: _Product, following: _Product) -> bool:
        """Whether ``path`` can run on the experts' rows: its row tensors are read only inside it (or by
        ``following``'s product) and never returned by the graph, a ``Div`` divides a row by what is not one,
        and every other operand is a constant axis list or size, or broadcasts over the rows (it has fewer
        axes than the row tensor it meets)."""
        rows = {product.output} | {out for node in path.values() for out in node.output}
        allowed = set(path) | {following.matmul.output[0]}
        if rows & self.returned:
            return False
        if any(reader.output[0] not in allowed for out in rows for reader in self.readers.get(out, [])):
            return False
        for node in path.values():
            if node.op_type == "Div" and node.input[1] in rows:
                return False
            row_inputs = [name for name in node.input if name in rows]
            rank = max((len(self.shapes.shape.get(name, ())) for name in row_inputs), default=0)
            for slot, name in enumerate(node.input):
                if not name or name in rows:
                    continue
                if slot == _AXES_INPUT.get(node.op_type) or node.op_type in ("Split", "Slice"):
                    if name not in self.shapes.value:
                        return False
                elif name not in self.shapes.shape or len(self.shapes.shape[name]) >= rank:
                    return False
        return True


def _row_wise(node: onnx.NodeProto) -> bool:
    """An operator of `ROW_WISE` (a Slice only with its axes given: without them it counts from the rows)."""
    if node.domain or node.op_type not in ROW_WISE:
        return False
    return node.op_type != "Slice" or len(node.input) > 3


def _symbolic(proto: onnx.ModelProto) -> bool | None:
    """Whether a data input's size is a symbol: None if none is, True if a leading one (a dynamic batch,
    taken as one sample), False if only others (bound by the caller's ``dims``)."""
    initialized = {init.name for init in proto.graph.initializer}
    found: bool | None = None
    for info in proto.graph.input:
        sizes = info.type.tensor_type.shape.dim if info.type.HasField("tensor_type") else []
        if info.name in initialized:
            continue
        for axis, size in enumerate(sizes):
            if size.HasField("dim_param") or not size.HasField("dim_value"):
                found = found or axis == 0
    return found


def _opset(proto: onnx.ModelProto) -> int:
    return next((int(entry.version) for entry in proto.opset_import if entry.domain in ("", "ai.onnx")), 1)


def _largest_divisor(count: int, limit: int) -> int:
    """The largest divisor of ``count`` that is at most ``limit``.

    >>> _largest_divisor(1000, 512), _largest_divisor(4096, 512), _largest_divisor(7, 4)
    (500, 512, 1)
    """
    return next(d for d in range(min(count, limit), 0, -1) if count % d == 0)


def _samples(proto: onnx.ModelProto) -> int:
    """The leading size the data inputs share (the batch), 1 where none is stated."""
    initialized = {init.name for init in proto.graph.initializer}
    for info in proto.graph.input:
        if info.name in initialized or not info.type.HasField("tensor_type"):
            continue
        dims = info.type.tensor_type.shape.dim
        if dims and dims[0].HasField("dim_value") and dims[0].dim_value > 0:
            return int(dims[0].dim_value)
    return 1


def _route(
    shapes: _Shapes, block: _Block, capacity_factor: float, group_rows: int, samples: int, names: set[str]
) -> tuple[RoutedBlock, list[onnx.NodeProto]]:
    """One block written as a dispatch, its products over the expert axis and a combine (module docstring):
    what was routed and the new nodes (the block's own nodes are the caller's to remove)."""
    products, joins = block
    first, last = products[0], products[-1]
    routed = _sizes(shapes, first, capacity_factor, group_rows, samples)
    experts, group, capacity = routed.experts, routed.group_rows, routed.capacity
    element = shapes.dtype.get(first.column, onnx.TensorProto.FLOAT)
    w = _Writer(first.matmul.metadata_props, names)
    dispatch = _dispatch(w, shapes, first, routed, element)
    lifted: dict[str, str] = {}
    for position, product in enumerate(products):
        stack_shape = shapes.shape[product.stack]
        w.prefix = f"{product.matmul.name or product.output}.experts"
        if position == 0:
            column = w.node(
                "Reshape", [product.column, w.constant(np.array([-1, group, stack_shape[2]], np.int64), "rows")], "x"
            )
            tokens = w.node("Einsum", [dispatch, column], "expert_inputs", equation="grec,grb->egcb")
        else:
            tokens = lifted[product.column]
        tokens = w.node(
            "Reshape", [tokens, w.constant(np.array([experts, -1, stack_shape[2]], np.int64), "expert_rows")], "rows"
        )
        weights = w.node("Transpose", [product.stack], "stack_in_out", perm=[0, 2, 1])
        out = w.node("MatMul", [tokens, weights], "expert_outputs")
        if product is last:
            out = w.node(
                "Reshape", [out, w.constant(np.array([experts, -1, capacity, stack_shape[1]], np.int64), "slots")], "o"
            )
            combine = dispatch
            if shapes.dtype.get(product.stack, element) != element:  # the join cast the rows
                combine = w.node("Cast", [dispatch], "combine", to=shapes.dtype[product.stack])
            rows_out = w.node("Einsum", [combine, out], "combined", equation="grec,egca->gra")
            target = w.constant(np.array([-1, stack_shape[1], 1], np.int64), "product_rows")
            w.node("Reshape", [rows_out, target], "product", output=product.output)
        else:
            target = w.constant(np.array([experts, -1, stack_shape[1], 1], np.int64), "lifted_rows")
            lifted[product.output] = w.node("Reshape", [out, target], "lifted")
            for node in joins[position]:
                _lift(node, lifted, w, shapes)
    return routed, w.nodes


def _sizes(shapes: _Shapes, first: _Product, capacity_factor: float, group_rows: int, samples: int) -> RoutedBlock:
    """The experts, rows, rows a group holds (whole tokens) and slots an expert has in a group (no products
    named yet)."""
    experts, _, _ = shapes.shape[first.stack]
    rows = shapes.shape[first.column][0]
    per_sample = rows // samples if rows % samples == 0 else rows
    top_k = first.top_k if _rooted(shapes, first) and per_sample % first.top_k == 0 else 1
    # whole tokens a group: a token sends an expert at most one of its rows, so an expert's rows in a group are
    # at most its tokens, and a factor of experts / top-k gives every one a slot
    group_tokens = _largest_divisor(per_sample // top_k, max(1, group_rows // top_k))
    capacity = math.ceil(min(capacity_factor * group_tokens * top_k / experts, group_tokens))
    return RoutedBlock((), experts, rows, group_tokens * top_k, capacity)


def _rooted(shapes: _Shapes, product: _Product) -> bool:
    """Whether the index's root holds one entry a routed row (it can stand for the index)."""
    root_shape = shapes.shape.get(product.index_root)
    return root_shape is not None and math.prod(root_shape) == shapes.shape[product.column][0]


def _dispatch(w: _Writer, shapes: _Shapes, first: _Product, routed: RoutedBlock, element: int) -> str:
    """``[groups, group rows, experts, capacity]``: one where a row takes a slot of its expert."""
    w.prefix = f"{first.matmul.name or first.output}.dispatch"
    # read from the routing's own output, [tokens, top_k]: the exporter's copies of the index (Max, Expand,
    # Concat of one input) then go, and ONNX's data propagation, which spells every entry of a 1-D integer
    # tensor as a dimension, never meets the million-entry vectors they are
    source = first.index_root if _rooted(shapes, first) else first.gather.input[1]
    index = w.node("Reshape", [source, w.constant(np.array([-1, routed.group_rows], np.int64), "groups")], "index")
    # counted in integers: a half-precision count is exact only to 256 (bfloat16)
    counted = w.constant(np.array([0, 1], np.int64), "off_on_counted")
    experts = w.constant(np.array(routed.experts, np.int64), "experts")
    chosen = w.node("OneHot", [index, experts, counted], "routed", axis=-1)
    count = w.node("CumSum", [chosen, w.constant(np.array(1, np.int64), "row_axis")], "count")
    place = w.node("Sub", [count, w.constant(np.array(1, np.int64), "one")], "place")
    off_on = w.constant(np.array([0, 1], helper.tensor_dtype_to_np_dtype(element)), "off_on")
    slots = w.constant(np.array(routed.capacity, np.int64), "capacity")
    slot = w.node("OneHot", [place, slots, off_on], "slot", axis=-1)  # past capacity: all zeros
    last_axis = w.constant(np.array([-1], np.int64), "last_axis")
    values = w.node("Cast", [chosen], "routed_values", to=element)
    return w.node("Mul", [slot, w.node("Unsqueeze", [values, last_axis], "routed_slots")], "dispatch")


def _lift(node: onnx.NodeProto, lifted: dict[str, str], w: _Writer, shapes: _Shapes) -> None:
    """``node`` on the experts' rows: its row inputs replaced by their lifted tensors, an axis it names
    counted past the expert axis (a row tensor ``[rows, ...]`` lifts to ``[experts, slots, ...]``)."""
    inputs = []
    for slot, name in enumerate(node.input):
        if name in lifted:
            inputs.append(lifted[name])
        elif slot == _AXES_INPUT.get(node.op_type) and name:
            inputs.append(_shifted_axes(name, shapes, w))
        else:
            inputs.append(name)
    attrs = attributes(node)
    if "axis" in attrs and attrs["axis"] >= 0:
        attrs["axis"] += 1
    if "axes" in attrs:
        attrs["axes"] = [a + 1 if a >= 0 else a for a in attrs["axes"]]
    w.prefix = node.name or node.output[0]
    name = w.node(node.op_type, inputs, "on_experts", **attrs)
    w.nodes[-1].output[:] = [name] + [w.name("on_experts") for _ in node.output[1:]]
    lifted.update(zip(node.output, w.nodes[-1].output))


_AXES_INPUT = {"Squeeze": 1, "Unsqueeze": 1, "Slice": 3}
"""Where an operator of `ROW_WISE` takes its axes as an input (opset 13 and later)."""


def _shifted_axes(name: str, shapes: _Shapes, w: _Writer) -> str:
    """A constant axis list with each axis counted from the front moved past the expert axis."""
    axes = np.asarray(shapes.value[name]).astype(np.int64)
    return w.constant(np.where(axes >= 0, axes + 1, axes), "axes_on_experts")


def _drop_unread(proto: onnx.ModelProto, read_before: set[str]) -> None:
    """Remove the operators nothing reads any more (the gathered products' index chains), the stored values
    only they read, and the shapes the file declares for what they computed."""
    wanted = {info.name for info in proto.graph.output}
    kept = list(proto.graph.node)
    while True:
        read = wanted | {name for node in kept for name in node.input}
        still = [node for node in kept if any(out in read for out in node.output)]
        if len(still) == len(kept):
            break
        kept = still
    del proto.graph.node[:]
    proto.graph.node.extend(kept)
    produced = {out for node in kept for out in node.output}
    live = [info for info in proto.graph.value_info if info.name in produced]
    del proto.graph.value_info[:]
    proto.graph.value_info.extend(live)  # a declared shape of a removed tensor would still be checked
    read = {name for node in kept for name in node.input} | wanted | {info.name for info in proto.graph.input}
    stored = [init for init in proto.graph.initializer if init.name in read or init.name not in read_before]
    del proto.graph.initializer[:]
    proto.graph.initializer.extend(stored)


def _sort_topologically(proto: onnx.ModelProto) -> None:
    """The nodes in an order where each follows the producers of its inputs (the new ones were appended)."""
    nodes = list(proto.graph.node)
    produced = {out: i for i, node in enumerate(nodes) for out in node.output}
    done: set[int] = set()
    order: list[onnx.NodeProto] = []
    for start in range(len(nodes)):
        stack = [(start, False)]
        while stack:
            i, ready = stack.pop()
            if i in done:
                continue
            if ready:
                done.add(i)
                order.append(nodes[i])
                continue
            stack.append((i, True))
            stack += [
                (produced[n], False) for n in reversed(nodes[i].input) if n in produced and produced[n] not in done
            ]
    del proto.graph.node[:]
    proto.graph.node.extend(order)
