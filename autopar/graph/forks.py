"""Forks: where several operators read one tensor whole along a label they split, give them a place to meet.

q, k and v all read the layer norm's output; under tensor parallelism each splits its weight's
columns, reads the input whole and leaves the input's gradient partial over the column bits.
Megatron gathers that input once and sums the three gradients locally before one reduction.
Pairwise costs cannot say "once": each reader's redistribution, forward and back, is its own edge.
So the importer inserts a `Fork` (`autopar.ops.fork`) after such a tensor: the readers read the
fork, and the search decides, by the fork's strategy, in which layout they meet and over which
bits their gradients may arrive partial. A fork that splits nothing is a pass-through, so no plan
gets dearer.

The rule: an activation read by two or more operator inputs whose spec lacks some label of the
operator (a split contraction or output column: their gradients can come back partial), when its
producer's backward does not keep its outputs (the fork's output is the copy the readers keep;
the producer keeping its own would count the tensor twice) and reads more than weights. A tensor
computed from weights alone (ALBERT's shared Transposes, read by every layer) gets no fork: the
search holds such a producer whole for every copy of a repeated block, and a fork there would be one
more choice every copy shares. Only the readers that split alike move to the fork; the others still
read the producer.

>>> from onnx import TensorProto, helper
>>> from autopar.graph import load_model
>>> nodes = [helper.make_node("Erf", ["x"], ["h"], name="act")]
>>> nodes += [helper.make_node("MatMul", ["h", w], [w + "_out"], name=w) for w in ("q", "k")]
>>> weights = [helper.make_tensor_value_info(w, TensorProto.FLOAT, [4, 4]) for w in ("q", "k")]
>>> outs = [helper.make_tensor_value_info(w + "_out", TensorProto.FLOAT, None) for w in ("q", "k")]
>>> x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])
>>> graph = load_model(helper.make_model(helper.make_graph(nodes, "g", [x, *weights], outs)))
>>> [(op.name, op.inputs[0]) for op in graph.ops]
[('act', 'x'), ('act.fork', 'h'), ('q', 'h.forked'), ('k', 'h.forked')]
"""

from __future__ import annotations

import dataclasses

from autopar.graph.types import Graph, OpNode, TensorInfo
from autopar.ops import Keeps, definition_for, spec_for
from autopar.ops.fork import FORK, FORK_DOMAIN


def insert_forks(graph: Graph) -> Graph:
    """The graph with a fork after every tensor the rule above names (the same graph when none)."""
    readers = _splitting_readers(graph)
    forked = {
        name: places
        for name, places in readers.items()
        if len(places) >= 2
        and name not in graph.outputs
        and not _keeps_outputs(graph, graph.producer[name])
        and not _from_weights(graph, graph.producer[name])
    }
    if not forked:
        return graph
    taken = set(graph.tensors) | {op.name for op in graph.ops}
    renamed: dict[tuple[str, int], str] = {}  # (reader, slot) -> the fork's output it reads instead
    tensors = dict(graph.tensors)
    after: dict[str, list[OpNode]] = {}  # producer -> the forks that follow it
    for name, places in forked.items():
        producer = graph.producer[name]
        op_name, out = _fresh(f"{producer}.fork", taken), _fresh(f"{name}.forked", taken)
        info = graph.tensor(name)
        tensors[out] = TensorInfo(out, info.shape, info.dtype, "activation")
        fork = OpNode(op_name, FORK, (name,), (out,), {}, 0, domain=FORK_DOMAIN, source=graph.op(producer).source)
        after.setdefault(producer, []).append(fork)
        renamed.update({place: out for place in places})
    ops: list[OpNode] = []
    for op in graph.ops:
        inputs = tuple(renamed.get((op.name, slot), name) for slot, name in enumerate(op.inputs))
        ops.append(dataclasses.replace(op, inputs=inputs, index=len(ops)))
        for fork in after.get(op.name, ()):
            ops.append(dataclasses.replace(fork, index=len(ops)))
    return dataclasses.replace(graph, ops=tuple(ops), tensors=tensors)


def _splitting_readers(graph: Graph) -> dict[str, list[tuple[str, int]]]:
    """Each float activation -> the (operator, slot) inputs reading it that lack a label of their operator."""
    found: dict[str, list[tuple[str, int]]] = {}
    for op in graph.ops:
        spec = spec_for(op, graph)
        if spec.fallback:
            continue
        for slot, name in enumerate(op.inputs):
            if not name or slot >= len(spec.inputs) or spec.inputs[slot] is None:
                continue
            info = graph.tensor(name)
            if info.kind != "activation" or not info.is_float:
                continue
            if set(spec.label_order) - set(spec.inputs[slot] or ()):
                found.setdefault(name, []).append((op.name, slot))
    return found


def _from_weights(graph: Graph, producer: str) -> bool:
    """Whether the producer reads parameters and constants alone (a shared weight's Transpose)."""
    inputs = [name for name in graph.op(producer).inputs if name]
    return bool(inputs) and all(graph.tensor(name).kind in ("parameter", "constant") for name in inputs)


def _keeps_outputs(graph: Graph, producer: str) -> bool:
    definition = definition_for(graph.op(producer), graph)
    return definition is not None and Keeps.OUTPUTS in definition.keeps


def _fresh(name: str, taken: set[str]) -> str:
    """``name``, or ``name`` with the first free number after it."""
    candidate, number = name, 1
    while candidate in taken:
        candidate, number = f"{name}{number}", number + 1
    taken.add(candidate)
    return candidate
