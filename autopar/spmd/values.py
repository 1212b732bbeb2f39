"""Test values: full random weights, inputs and labels for a graph, drawn once from a seed.

Weights the file elides get He-normal values; inputs the registry marks positive (BatchNorm
scales and running variances) are drawn in [0.5, 1.5]; integer inputs are valid indices for
every operator that reads them (class labels, token ids), as the registry's index bounds say.
"""

from __future__ import annotations

import numpy as np

from autopar.graph import Graph
from autopar.ops import definition_for


def materialise(graph: Graph, seed: int = 0) -> dict[str, np.ndarray]:
    """Full values of every parameter, data input and constant (random where the file has none)."""
    rng = np.random.default_rng(seed)
    values: dict[str, np.ndarray] = {}
    positive = _positive_tensors(graph)
    for name in sorted(graph.tensors):
        info = graph.tensors[name]
        if info.kind == "activation":
            continue
        if info.value is not None:
            values[name] = np.asarray(info.value)
            continue
        dtype = np.dtype(info.dtype)
        if info.kind == "parameter":
            if name in positive:
                values[name] = rng.uniform(0.5, 1.5, info.shape).astype(dtype)
            else:
                fan_in = int(np.prod(info.shape[1:])) if len(info.shape) > 1 else max(info.shape[0], 1)
                values[name] = (rng.standard_normal(info.shape) / np.sqrt(fan_in)).astype(dtype)
        elif info.is_float:
            values[name] = rng.standard_normal(info.shape).astype(dtype)
        else:
            values[name] = rng.integers(0, index_bound(graph, name), info.shape).astype(dtype)
    return values


def _positive_tensors(graph: Graph) -> set[str]:
    found = set()
    for op in graph.ops:
        definition = definition_for(op, graph)
        if definition is not None:
            found |= {op.inputs[slot] for slot in definition.positive_inputs if slot < len(op.inputs)}
    return found


def index_bound(graph: Graph, name: str) -> int:
    """Integer inputs must be valid indices for every operator that reads them: the smallest bound."""
    limits = []
    for consumer in graph.consumers.get(name, []):
        op = graph.op(consumer)
        definition = definition_for(op, graph)
        if definition is None:
            continue
        for slot, inp in enumerate(op.inputs):
            bound = definition.index_bounds.get(slot) if inp == name else None
            limit = bound(op, graph) if bound is not None else None
            if limit is not None:
                limits.append(limit)
    return max(min(limits), 1) if limits else 2
