"""Attention as the graph writes it: the product of queries and keys, what scales, masks and softmaxes the
scores, and the product with the values, found so that costing can price it as one fused kernel.

Exporters write attention as operators: ``MatMul(Q, K^T)``, then a scale (``Mul``, ``Div``), a mask or bias
(``Add``, ``Where``), a soft cap (``Tanh``), casts and reshapes, ``Softmax``, maybe ``Dropout``, then
``MatMul(P, V)``. Frameworks run it as one flash kernel (FlashAttention, cuDNN, PyTorch's
``scaled_dot_product_attention``): the s x s scores never reach device memory, the backward recomputes
them, and only the output and a log-sum-exp per query row are kept. An `AttentionRegion` names the
operators of one such chain; the chain qualifies only where every score tensor has one reader (nothing
else, an ``output_attentions``, reads the probabilities) and both products multiply activations (a
classifier's weight is not a key).

A causal mask known at import (an additive constant, ``-inf`` or below ``-1e4`` above the diagonal and
finite on and below it) lets the kernel skip the blocks above the diagonal: ``kept_share`` is the share
of the scores left (about a half); 1.0 where the mask is not causal or not known.

>>> from onnx import TensorProto, helper
>>> import numpy as np
>>> nodes = [
...     helper.make_node("MatMul", ["q", "k"], ["s"], name="scores"),
...     helper.make_node("Div", ["s", "d"], ["scaled"], name="scale"),
...     helper.make_node("Add", ["scaled", "mask"], ["masked"], name="mask"),
...     helper.make_node("Softmax", ["masked"], ["p"], name="softmax", axis=-1),
...     helper.make_node("MatMul", ["p", "v"], ["o"], name="values"),
... ]
>>> mask = np.triu(np.full((4, 4), -np.inf, dtype=np.float32), 1)
>>> consts = [helper.make_tensor("d", TensorProto.FLOAT, [], [2.0]),
...           helper.make_tensor("mask", TensorProto.FLOAT, [4, 4], mask.reshape(-1))]
>>> x = [helper.make_tensor_value_info(n, TensorProto.FLOAT, s)
...      for n, s in (("q", [1, 2, 4, 8]), ("k", [1, 2, 8, 4]), ("v", [1, 2, 4, 8]))]
>>> o = helper.make_tensor_value_info("o", TensorProto.FLOAT, None)
>>> from autopar.graph import load_model
>>> graph = load_model(helper.make_model(helper.make_graph(nodes, "g", x, [o], consts)))
>>> region, = find_attention(graph)
>>> region.scores, region.values, region.inner, region.rows, region.kept_share
('scores', 'values', ('scale', 'mask', 'softmax'), 8, 0.625)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from autopar.graph.types import Graph, OpNode

THROUGH = frozenset({"Mul", "Div", "Add", "Sub", "Where", "Cast", "Reshape", "Tanh", "Dropout", "Identity"})
"""Operators a score tensor may pass through between the two products (the scale, mask, bias, soft cap,
casts around a softmax in FP32, a reshape between a 3-D and a 4-D product, dropout or the Identity
an exporter writes for it)."""

MASKED_BELOW = -1e4
"""An additive mask entry at or below this hides its score (exporters write -inf or the dtype's minimum)."""


@dataclass(frozen=True)
class AttentionRegion:
    """One attention chain: the operators a flash kernel runs as one.

    ``scores`` is the product of queries and keys, ``values`` the product of the probabilities with the
    values, ``inner`` the operators between them (scale, mask, softmax, ...), ``hidden`` the s x s tensors
    the kernel never writes; ``rows`` counts the query rows (a log-sum-exp each is kept for the backward)
    and ``kept_share`` the share of the scores a causal kernel computes.
    """

    scores: str
    values: str
    inner: tuple[str, ...]
    hidden: tuple[str, ...]
    rows: int
    kept_share: float = 1.0


def find_attention(graph: Graph) -> tuple[AttentionRegion, ...]:
    """Every attention chain of the graph, in graph order; a chain sharing a product with an earlier one
    (the values product of one read as the scores product of the next) is not attention."""
    ops = {op.name: op for op in graph.ops}
    found: list[AttentionRegion] = []
    taken: set[str] = set()
    for op in graph.ops:
        if op.op_type == "Softmax":
            region = _around(graph, ops, op)
            if region is not None and not {region.scores, region.values} & taken:
                found.append(region)
                taken |= {region.scores, region.values}
    return tuple(found)


def _one_reader(graph: Graph, tensor: str) -> str | None:
    readers = graph.consumers.get(tensor, ())
    return readers[0] if len(readers) == 1 and tensor not in graph.outputs else None


def _score_input(graph: Graph, op: OpNode, size: int, depth: int = 0) -> str | None:
    """The input of a pass-through operator that carries the scores: the one activation of their size, or where
    a mask has their size too, the one that leads back to a product through pass-through operators."""
    carried = [
        name
        for name in op.inputs
        if name and graph.tensor(name).kind == "activation" and graph.tensor(name).numel == size
    ]
    if len(carried) > 1 and depth < 8:
        carried = [name for name in carried if _from_product(graph, name, size, depth + 1)]
    return carried[0] if len(carried) == 1 else None


def _from_product(graph: Graph, tensor: str, size: int, depth: int) -> bool:
    """Whether ``tensor`` is a product's output, or passes one on through `THROUGH` operators."""
    producer = graph.producer.get(tensor)
    if producer is None:
        return False
    op = graph.op(producer)
    if op.op_type == "MatMul":
        return True
    carried = _score_input(graph, op, size, depth) if op.op_type in THROUGH and depth < 8 else None
    return carried is not None and _from_product(graph, carried, size, depth + 1)


def _around(graph: Graph, ops: dict[str, OpNode], softmax: OpNode) -> AttentionRegion | None:
    scores_shape = graph.tensor(softmax.inputs[0]).shape
    axis = int(softmax.attrs.get("axis", -1 if graph.opset >= 13 else 1))  # before opset 13: over axes 1 and on
    if len(scores_shape) < 3 or axis not in (-1, len(scores_shape) - 1):
        return None
    size = math.prod(scores_shape)
    inner, hidden = [softmax.name], []
    masks: list[tuple[str, bool | None]] = []  # (mask, the condition value that hides: None if additive)
    tensor = softmax.inputs[0]
    while True:  # back to the product of queries and keys
        if _one_reader(graph, tensor) is None or tensor not in graph.producer:
            return None
        hidden.append(tensor)
        op = ops[graph.producer[tensor]]
        if op.op_type == "MatMul":
            scores = op
            break
        carried = _score_input(graph, op, size) if op.op_type in THROUGH else None
        if carried is None:
            return None
        if op.op_type == "Add":
            masks += [(name, None) for name in op.inputs if name and name != carried]
        elif op.op_type == "Where" and len(op.inputs) == 3 and carried in op.inputs[1:]:
            fill = op.inputs[1] if carried == op.inputs[2] else op.inputs[2]
            value = graph.tensor(fill).value
            if value is not None and value.size == 1 and float(value.reshape(-1)[0]) <= MASKED_BELOW:
                masks.append((op.inputs[0], carried == op.inputs[2]))
        inner.insert(0, op.name)
        tensor = carried
    tensor = softmax.outputs[0]
    while True:  # on to the product with the values
        reader = _one_reader(graph, tensor)
        if reader is None:
            return None
        hidden.append(tensor)
        op = ops[reader]
        if op.op_type == "MatMul":
            if op.inputs[0] != tensor:
                return None
            values = op
            break
        if op.op_type not in THROUGH or _score_input(graph, op, size) != tensor:
            return None
        inner.append(op.name)
        hidden += [name for name in op.outputs[1:] if name]  # a dropout's mask: the kernel draws it again
        tensor = op.outputs[0]
    factors = (*scores.inputs, values.inputs[1])
    if any(
        graph.tensor(name).kind not in ("activation", "input") or len(graph.tensor(name).shape) < 2 for name in factors
    ):
        return None
    share = min((_causal_share(graph, name, scores_shape, hidden_where) for name, hidden_where in masks), default=1.0)
    return AttentionRegion(scores.name, values.name, tuple(inner), tuple(hidden), size // scores_shape[-1], share)


def _causal_share(graph: Graph, mask: str, scores_shape: tuple[int, ...], hidden_where: bool | None) -> float:
    """The share of scores a causal kernel computes under this mask, or 1.0 where it is not a known causal
    mask (queries align with the last keys: query i sees keys up to i + keys - queries).

    ``hidden_where`` is None for an additive mask; for a ``Where`` condition, the value of the condition
    that hides a score (``Where(cond, -inf, scores)`` hides where it is true). A mask computed at run time is
    read through what computes it (`_visible_share`).
    """
    queries, keys = scores_shape[-2], scores_shape[-1]
    value = graph.tensor(mask).value
    if value is None:
        if hidden_where is False:  # Where(cond, scores, -inf): the condition is what stays visible
            return _visible_share(graph, mask, queries, keys)
        producer = graph.op(graph.producer[mask]) if hidden_where is None and mask in graph.producer else None
        if producer is not None and producer.op_type == "Where" and _additive_visible(graph, producer):
            return _visible_share(graph, producer.inputs[0], queries, keys)
        return 1.0
    if hidden_where is None:
        if not np.issubdtype(value.dtype, np.floating):
            return 1.0
        return _known_visible(value > MASKED_BELOW, queries, keys)
    condition = value.astype(bool)
    return _known_visible(~condition if hidden_where else condition, queries, keys)


def _additive_visible(graph: Graph, where: OpNode) -> bool:
    """``Where(cond, 0, fill)`` with a fill that hides: an additive mask whose condition is what stays visible."""
    keep, fill = (graph.tensor(name).value for name in where.inputs[1:3])
    return (
        keep is not None
        and fill is not None
        and keep.size == 1
        and fill.size == 1
        and float(keep.reshape(-1)[0]) == 0.0
        and float(fill.reshape(-1)[0]) <= MASKED_BELOW
    )


PASSED_ON = frozenset({"Expand", "Cast", "Identity"})
"""Operators a visibility condition passes through unchanged in its last two axes."""


def _visible_share(graph: Graph, condition: str, queries: int, keys: int, depth: int = 0) -> float:
    """The share of scores a causal kernel computes where ``condition`` (computed at run time) says which stay
    visible: through an ``And`` the stricter side, through a comparison of two position ramps (``kv <= q`` as
    transformers writes a causal mask, keys along the last axis, queries along the one before) the causal
    share at their offset; 1.0 where neither is found."""
    value = graph.tensor(condition).value
    if value is not None:  # folded at import: causal or not, as it stands
        return _known_visible(value.astype(bool), queries, keys)
    producer = graph.producer.get(condition)
    if producer is None or depth > 8:
        return 1.0
    op = graph.op(producer)
    if op.op_type in PASSED_ON:
        return _visible_share(graph, op.inputs[0], queries, keys, depth + 1)
    if op.op_type == "And":
        return min(_visible_share(graph, name, queries, keys, depth + 1) for name in op.inputs)
    below = {"LessOrEqual": 0, "Less": -1}.get(op.op_type)  # key - query <= offset + this
    above = {"GreaterOrEqual": 0, "Greater": -1}.get(op.op_type)
    if below is not None:
        key_side, query_side, slack = op.inputs[0], op.inputs[1], below
    elif above is not None:
        key_side, query_side, slack = op.inputs[1], op.inputs[0], above
    else:
        return 1.0
    key_start = _ramp_start(graph.tensor(key_side).value, keys, axis=-1)
    query_start = _ramp_start(graph.tensor(query_side).value, queries, axis=-2)
    if key_start is None or query_start is None:
        return 1.0
    return causal_share(queries, keys, query_start - key_start + slack)


def causal_share(queries: int, keys: int, offset: int | None = None) -> float:
    """The share of a queries x keys score matrix a causal kernel computes: key k is visible to query q where
    k - q <= ``offset`` (default keys - queries: the queries are the last positions, past keys first).

    >>> causal_share(4, 4)
    0.625
    """
    offset = keys - queries if offset is None else offset
    return float(np.clip(np.arange(queries) + offset + 1, 0, keys).sum()) / (queries * keys)


def _known_visible(visible: np.ndarray, queries: int, keys: int) -> float:
    """The causal share where ``visible`` is exactly the causal pattern (queries aligned with the last keys)
    over its last two axes, 1.0 otherwise."""
    if visible.ndim < 2 or visible.shape[-2:] != (queries, keys):
        return 1.0
    causal = np.tril(np.ones((queries, keys), dtype=bool), keys - queries)
    if not np.array_equal(
        visible.reshape(-1, queries, keys), np.broadcast_to(causal, (visible.size // causal.size, queries, keys))
    ):
        return 1.0
    return causal_share(queries, keys)


def _ramp_start(value: np.ndarray | None, size: int, axis: int) -> int | None:
    """Where a tensor that counts 0, 1, 2, ... (plus a start) along ``axis`` and is constant along every other
    axis starts; None for any other tensor."""
    if value is None or value.ndim < 2 or value.shape[axis] != size or value.size != size * (value.size // size):
        return None
    if not np.issubdtype(value.dtype, np.integer) or value.size // size > 64:
        return None
    line = np.moveaxis(value, axis, -1).reshape(-1, size)
    if not (line == line[0]).all() or not (np.diff(line[0].astype(np.int64)) == 1).all():  # no wrapping round
        return None
    return int(line[0][0])
