"""Operators: one registration each (`registry`), one module per operator family.

Importing this package registers every family. `definition_for` finds an operator's
registration for the model's opset; `spec_for` its strategy spec (a replicated fallback for
an operator without a rule).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from autopar.ops import (
    attention,
    conv,
    declared,
    elementwise,
    fork,  # noqa: F401  autopar's own operator: registered, no ONNX cases
    indexing,
    loss,
    matmul,
    movement,
    norm,
    pool,
    reduce,
    scan,
    shape,
)
from autopar.ops.base import OpSpec, fallback_spec
from autopar.ops.registry import Keeps, LocalCall, OpDef, lookup, registered_op_types

if TYPE_CHECKING:
    from autopar.ops.views import GraphView, NodeView

# the operator families: importing one registers its operators; each lists its test cases (`cases`)
FAMILIES = (attention, conv, declared, elementwise, indexing, loss, matmul, movement, norm, pool, reduce, scan, shape)


def definition_for(op: NodeView, graph: GraphView) -> OpDef | None:
    """The operator's registration for the model's opset, or None when autopar does not know it."""
    return lookup(op.op_type, op.domain, graph.opset)


def spec_for(op: NodeView, graph: GraphView) -> OpSpec:
    """The rule's spec for this operator, or a replicated fallback when no rule applies."""
    definition = definition_for(op, graph)
    if definition is None or definition.rule is None:
        return fallback_spec(op, graph)
    return definition.rule(op, graph)


__all__ = [
    "FAMILIES",
    "Keeps",
    "LocalCall",
    "OpDef",
    "OpSpec",
    "definition_for",
    "fallback_spec",
    "lookup",
    "registered_op_types",
    "spec_for",
]
