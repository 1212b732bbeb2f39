"""Forks: where several operators read one tensor whole along a label they split, give them a place to meet.

q, k and v all read the layer norm's output; under tensor parallelism each splits its weight's
columns, reads the input whole and leaves the input's gradient partial over the column bits.
Megatron gathers that input once and sums the three gradients locally before one reduction.
Pairwise costs cannot say "once": each reader's redistribution, forward and back, is its own edge.
So the importer inserts a `Fork` (`autopar.ops.fork`) just before such readers: they read the
fork, and the search decides, by the fork's strategy, in which layout they meet and over which
bits their gradients may arrive partial. A fork that splits nothing is a pass-through, so no plan
gets dearer.

The rule: an activation read by two or more operator inputs whose spec lacks some label of the
operator (a split contraction or output column: their gradients can come back partial), when its
producer's backward does not keep its outputs (the fork's output is the copy the readers keep;
the producer keeping its own would count the tensor twice) and reads more than weights. Readers
must meet before their results combine (`_independent`): a tensor read again after that (the
encoder's output, read by every decoder layer's k and v) gets no fork, since a fork for each
layer's readers adds a variable between the layers that the search pays for in every table it
spans (T5 at 64 devices would go over the search's limits). A tensor
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
    """The graph with a fork before each group of readers the rule above names (the same graph when none)."""
    readers = _splitting_readers(graph)
    position = {op.name: at for at, op in enumerate(graph.ops)}
    groups = []
    for name, places in readers.items():
        if name not in graph.producer or name in graph.outputs:
            continue
        if _keeps_outputs(graph, graph.producer[name]) or _from_weights(graph, graph.producer[name]):
            continue
        found = _independent(graph, sorted(places, key=lambda place: position[place[0]]))
        if len(found) == 1 and len(found[0]) >= 2:  # read again by later layers: no fork (see the rule)
            groups.append((name, found[0]))
    if not groups:
        return graph
    taken = set(graph.tensors) | {op.name for op in graph.ops}
    renamed: dict[tuple[str, int], str] = {}  # (reader, slot) -> the fork's output it reads instead
    tensors = dict(graph.tensors)
    before: dict[str, list[OpNode]] = {}  # first reader -> the forks that come just before it
    for name, places in groups:
        producer = graph.producer[name]
        op_name, out = _fresh(f"{producer}.fork", taken), _fresh(f"{name}.forked", taken)
        info = graph.tensor(name)
        tensors[out] = TensorInfo(out, info.shape, info.dtype, "activation")
        fork = OpNode(op_name, FORK, (name,), (out,), {}, 0, domain=FORK_DOMAIN, source=graph.op(producer).source)
        before.setdefault(places[0][0], []).append(fork)
        renamed.update({place: out for place in places})
    ops: list[OpNode] = []
    for op in graph.ops:
        for fork in before.get(op.name, ()):
            ops.append(dataclasses.replace(fork, index=len(ops)))
        inputs = tuple(renamed.get((op.name, slot), name) for slot, name in enumerate(op.inputs))
        ops.append(dataclasses.replace(op, inputs=inputs, index=len(ops)))
    return dataclasses.replace(graph, ops=tuple(ops), tensors=tensors)


def _independent(graph: Graph, places: list[tuple[str, int]]) -> list[list[tuple[str, int]]]:
    """The readers (in graph order) in groups that meet before their results do: a group closes at
    the reader that computes from an earlier member's output, or that comes after an operator which
    already combines two members' results. q, k and v of one layer come before the scores that
    combine q and k, so they meet; a decoder's layers, each reading the encoder's output (k and v),
    each get their own fork, since each layer's attention combines its k and v before the next
    layer's k (one fork for all would tie every layer's choice together)."""
    groups: list[list[tuple[str, int]]] = [[]]
    origin: dict[str, frozenset[str]] = {}  # tensor -> the group members it is computed from
    combined = False
    first, last = graph.op(places[0][0]).index, graph.op(places[-1][0]).index
    wanted: dict[str, list[tuple[str, int]]] = {}
    for place in places:
        wanted.setdefault(place[0], []).append(place)
    for op in graph.ops[first : last + 1]:
        sources = frozenset().union(*(origin.get(name, frozenset()) for name in op.inputs if name))
        if op.name in wanted:
            if sources or combined:
                groups.append([])
                origin, combined, sources = {}, False, frozenset()
            groups[-1].extend(wanted[op.name])
            sources = sources | {op.name}
        combined = combined or len(sources) >= 2
        if sources:
            origin.update((name, sources) for name in op.outputs if name)
    return groups


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
