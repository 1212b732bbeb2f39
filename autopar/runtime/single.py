"""The model on one device in torch: the reference the sharded gradients are compared with.

`run_op` runs one operator through its registered ``torch_kernel``; `run_graph` runs the whole
graph from materialised values, with the named parameters as leaf tensors that collect
gradients. Its forward must equal onnxruntime's (the tests check every bundled model).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import numpy as np
import torch

from autopar.errors import AutoparError
from autopar.graph import Graph
from autopar.graph.types import OpNode
from autopar.ops import definition_for


def run_op(op: OpNode, graph: Graph, inputs: list[Any]) -> list[torch.Tensor]:
    """``op``'s outputs from its inputs, as ONNX defines the operator, through its torch kernel."""
    definition = definition_for(op, graph)
    kernel = definition.torch_kernel if definition is not None else None
    if kernel is None:
        raise AutoparError(
            f"Operator {op.name!r} ({op.op_type}) has no torch kernel, so the training step cannot run it;"
            " verify the forward pass alone (without --gradients or --runtime torch)."
        )
    return list(kernel(torch, op, inputs))


def tensor(value: np.ndarray) -> torch.Tensor:
    """A torch tensor owning a copy of ``value`` (0-d arrays stay 0-d)."""
    return torch.from_numpy(np.array(value, copy=True))


def run_graph(
    graph: Graph, values: Mapping[str, np.ndarray], requires_grad: Collection[str] = ()
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(graph outputs by name, the leaf tensors of ``requires_grad`` by name) of one forward pass."""
    leaves = {name: tensor(values[name]).requires_grad_(True) for name in requires_grad}
    env = {name: leaves[name] if name in leaves else tensor(value) for name, value in values.items()}
    last_read = {name: index for index, op in enumerate(graph.ops) for name in op.inputs if name}
    keep = set(graph.outputs)
    for index, op in enumerate(graph.ops):
        outputs = run_op(op, graph, [env[name] if name else None for name in op.inputs])
        for name, value in zip([name for name in op.outputs if name], outputs):
            env[name] = value
        for name in set(op.inputs):  # autograd keeps what the backward needs; drop the rest
            if name and last_read[name] == index and name not in keep and name not in values:
                del env[name]
    return {name: env[name] for name in graph.outputs}, leaves
