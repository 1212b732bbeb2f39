"""One operator on every rank's local shards.

Almost every operator runs unchanged on its shards (that is what a strategy rule promises):
onnxruntime executes it on the local shapes. Two adjustments follow from the spec alone:
an input under `OpSpec.local_once_inputs` (a bias under a split contraction) is added only by
the first rank of each partial group, so the reduction counts it once; and a mean over a
split axis (`OpSpec.local_mean`) divides by the global count, so the partial results sum.
Everything else an operator needs on its shards (Reshape's local target, OneHot's class
range, a masked Gather) is its registered `local_kernel`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import onnx
from onnx import helper

from autopar.graph import Graph
from autopar.layout import shard_index
from autopar.lowering.program import PlannedOp
from autopar.ops import LocalCall
from autopar.strategy import OpRule

Shards = list[np.ndarray]
SessionFactory = Callable[[onnx.ModelProto], Any]


def _slot_name(slot: int) -> str:
    return f"autopar_input_{slot}"


def _mini_model(rule: OpRule, graph: Graph, local_inputs: list[np.ndarray | None]) -> onnx.ModelProto:
    """A one-node model of the operator, typed for the local input shapes."""
    op = rule.op
    node = onnx.NodeProto()
    assert op.proto is not None  # every imported operator keeps its node
    node.CopyFrom(op.proto)
    # one graph input per slot: a tensor read twice may arrive in two different layouts
    for slot, name in enumerate(op.inputs):
        if name:
            node.input[slot] = _slot_name(slot)
    inputs = [
        helper.make_tensor_value_info(_slot_name(slot), helper.np_dtype_to_tensor_dtype(x.dtype), list(x.shape))
        for slot, (name, x) in enumerate(zip(op.inputs, local_inputs))
        if name and x is not None
    ]
    outputs = [
        helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(np.dtype(graph.tensor(name).dtype)), None)
        for name in op.outputs
        if name
    ]
    mini = helper.make_graph([node], f"local_{op.name}", inputs, outputs)
    return helper.make_model(mini, opset_imports=list(graph.model.opset_import), ir_version=graph.model.ir_version)


def run_operator(
    planned: PlannedOp, inputs: list[Shards | None], ranks: int, make_session: SessionFactory
) -> list[Shards]:
    """Each output's per-rank buffers after running the operator on the ranks' local inputs."""
    rule = planned.rule
    op, graph, spec = rule.op, rule.graph, rule.spec
    bits = rule.label_bits(planned.exponents)
    reduced = tuple(label for label in spec.reduced_labels if bits[label])
    out_shapes = [
        layout.local_shape(graph.tensor(name).shape) if name and layout is not None else None
        for name, layout in zip(op.outputs, planned.outputs)
    ]
    kernel = rule.definition.local_kernel if rule.definition is not None else None
    sessions: list[Any] = []

    def run(local: list[np.ndarray | None]) -> list[np.ndarray]:
        if not sessions:  # every rank has the same local shapes: one session serves them all
            sessions.append(make_session(_mini_model(rule, graph, local)))
        feeds = {_slot_name(slot): x for slot, (name, x) in enumerate(zip(op.inputs, local)) if name}
        return [np.asarray(value) for value in sessions[0].run(None, feeds)]

    results: list[Shards] = [[] for name in op.outputs if name]
    for rank in range(ranks):
        local = [x[rank] if x is not None else None for x in inputs]
        first_of_group = all(shard_index(rank, bits[label]) == 0 for label in reduced)
        for slot in spec.local_once_inputs:
            value = local[slot] if slot < len(local) else None
            if value is not None and reduced and not first_of_group:
                local[slot] = np.zeros_like(value)
        if kernel is not None:
            outs = kernel(LocalCall(op, graph, spec, bits, rank, local, out_shapes, run))
        else:
            outs = run(local)
        if spec.local_mean and reduced:
            outs[0] = (outs[0] / (1 << sum(len(bits[label]) for label in reduced))).astype(outs[0].dtype)
        for position, value in enumerate(outs):
            results[position].append(np.asarray(value))
    return results
