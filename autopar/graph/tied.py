"""Tied weights: one trained matrix the exporter stored twice, once as it is and once transposed.

A language model whose output matrix is its token embedding (``tie_word_embeddings``: Qwen2, Llama 3.2,
Gemma, GPT-2) trains one parameter, read by the lookup as it is and by the output product transposed.
PyTorch's exporter folds that transpose into a second initializer, so the file holds two weights of the
same values. Planned as two, each would take its own layout, its own optimizer state and its own
gradient, and the module's one parameter could not be stored as the plan says. `tie_transposed_copies`
writes the copy back as what it is, a ``Transpose`` of the one weight: the plan then holds the parameter
once, in its first reader's layout, moves it to the output product as it moves any weight read twice,
and charges the move and its gradient's way back (`autopar.search.dataflow`).
"""

from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import helper, numpy_helper

from autopar.graph.proto import FLOAT_DATA_TYPES

TRANSPOSED_READERS = frozenset({"MatMul", "Gemm"})
"""Operators an exporter stores a weight transposed for (a linear layer's ``x @ W.T``)."""

WRITTEN = "autopar.tied"
"""The metadata key marking a ``Transpose`` written for a copy: an imported model read again (`Graph.model`, as
export and verify take it back) finds its copies already written, and keeps them operators as the first import did."""


def tie_transposed_copies(proto: onnx.ModelProto) -> frozenset[str]:
    """Rewrite each stored matrix that only matrix products read and that is exactly the transpose of a matrix
    something else reads (the lookup), as a ``Transpose`` of that one, written just before its first reader,
    named after it and with that reader's metadata (the layer it belongs to). A matrix of one value
    throughout, or its own transpose, does not count (`_fresh`), nor do two that products alone read (two
    layers' weights may hold equal values when fresh). The tensors the new operators write come back: they
    stay operators, not folded into a weight again.

    >>> rng = np.random.default_rng(0)
    >>> table = rng.standard_normal((6, 4)).astype(np.float32)
    >>> nodes = [helper.make_node("Gather", ["E", "ids"], ["h"], name="embed"),
    ...          helper.make_node("MatMul", ["h", "E_t"], ["logits"], name="head")]
    >>> model = helper.make_model(helper.make_graph(nodes, "g",
    ...     [helper.make_tensor_value_info("ids", onnx.TensorProto.INT64, [2])],
    ...     [helper.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, [2, 6])],
    ...     [numpy_helper.from_array(table, "E"), numpy_helper.from_array(table.T.copy(), "E_t")]))
    >>> sorted(tie_transposed_copies(model)), [i.name for i in model.graph.initializer]
    (['E_t'], ['E'])
    >>> [(n.op_type, list(n.input), list(n.output)) for n in model.graph.node][1]
    ('Transpose', ['E'], ['E_t'])
    >>> sorted(tie_transposed_copies(model))  # (imported again: the copy is found written)
    ['E_t']
    """
    written = {node.output[0] for node in proto.graph.node if any(p.key == WRITTEN for p in node.metadata_props)}
    stored = {tensor.name: tensor for tensor in proto.graph.initializer if _matrix(tensor)}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in proto.graph.node:
        for name in set(node.input):
            if name in stored:
                readers.setdefault(name, []).append(node)
    outputs = {value.name for value in proto.graph.output}
    products = {name for name, nodes in readers.items() if all(n.op_type in TRANSPOSED_READERS for n in nodes)}
    looked_up = {tuple(stored[name].dims)[::-1] for name in readers if name not in products}  # (as a copy's shape)
    copies = {name for name in products if name not in outputs and tuple(stored[name].dims) in looked_up}
    if not copies:
        return frozenset(written)
    # a copy's first row is its original's first column: a cheap key that only true pairs share in full
    wanted = {tuple(stored[name].dims) for name in copies}
    values: dict[str, np.ndarray] = {}
    for name in readers:
        value = _bits(stored[name]) if name not in products and tuple(stored[name].dims)[::-1] in wanted else None
        if value is not None:
            values[name] = value
    by_column = {(v.shape[::-1], v.dtype.str, v[:, 0].tobytes()): n for n, v in values.items()}
    tied: dict[str, str] = {}  # copy -> the weight it is the transpose of
    for copy in sorted(copies):
        value = _bits(stored[copy])
        if value is None or _fresh(value):
            continue
        original = by_column.get((value.shape, value.dtype.str, value[0].tobytes()))
        if original is not None and np.array_equal(value, values[original].T):
            tied[copy] = original
    for copy, original in tied.items():
        _write_as_transpose(proto, copy, original, readers[copy][0])
    return frozenset(written | tied.keys())


def _matrix(tensor: onnx.TensorProto) -> bool:
    """A stored float matrix of more than one row and column (not elided to an external file)."""
    return (
        len(tensor.dims) == 2
        and min(tensor.dims) > 1
        and tensor.data_type in FLOAT_DATA_TYPES
        and tensor.data_location != onnx.TensorProto.EXTERNAL
    )


def _bits(tensor: onnx.TensorProto) -> np.ndarray | None:
    """A stored matrix's elements as unsigned integers of their width, equal where the values are (bfloat16
    included); None for a type read widened from its field, which is not compared."""
    width = np.dtype(helper.tensor_dtype_to_np_dtype(tensor.data_type)).itemsize
    raw = tensor.raw_data  # (read once: each read may copy the bytes)
    if raw:
        flat = np.frombuffer(raw, dtype=f"<u{width}")
    else:  # (values in the typed fields: small, or a type numpy widens, whose bits say nothing here)
        flat = np.ascontiguousarray(numpy_helper.to_array(tensor)).reshape(-1).view(f"<u{width}")
    return flat.reshape(tuple(tensor.dims)) if flat.size == math.prod(tensor.dims) else None


def _fresh(value: np.ndarray) -> bool:
    """A matrix any two fresh weights may equal without being one: one value throughout (zeros), or its own
    transpose (an identity): two such initializers are equal for being fresh, not tied.

    >>> _fresh(np.eye(3)), _fresh(np.zeros((2, 3))), _fresh(np.arange(6).reshape(2, 3))
    (True, True, False)
    """
    return bool(np.all(value == value.flat[0])) or (value.shape[0] == value.shape[1] and np.array_equal(value, value.T))


def _write_as_transpose(proto: onnx.ModelProto, copy: str, kept: str, reader: onnx.NodeProto) -> None:
    """Replace the initializer ``copy`` by ``Transpose(kept)``, written just before its first reader (its type
    declared: the model was shape-inferred with the copy stored). ``kept`` is in the mark (`WRITTEN`)."""
    initializer = next(tensor for tensor in proto.graph.initializer if tensor.name == copy)
    proto.graph.initializer.remove(initializer)
    for value in [value for value in proto.graph.input if value.name == copy]:
        proto.graph.input.remove(value)
    proto.graph.value_info.append(helper.make_tensor_value_info(copy, initializer.data_type, initializer.dims))
    node = helper.make_node("Transpose", [kept], [copy], name=copy, perm=[1, 0])
    node.metadata_props.extend(reader.metadata_props)
    node.metadata_props.add(key=WRITTEN, value=kept)
    position = list(proto.graph.node).index(reader)
    proto.graph.node.insert(position, node)
