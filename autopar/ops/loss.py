"""Loss operators: SoftmaxCrossEntropyLoss and NegativeLogLikelihoodLoss.

Samples (the batch and any extra spatial/sequence axes) split; the class axis stays whole, as
the softmax needs every class. With reduction "sum" a rank's loss is a partial sum; with
"mean" it is a partial mean (the rank divides by the number of shards). A weighted mean or one
with ``ignore_index`` divides by a count only the whole batch knows, so those keep every axis
whole, as does a loss whose per-sample ``log_prob`` output is also read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from autopar.ops.base import OpSpec, shape
from autopar.ops.cases import I64, F, const, named, one
from autopar.ops.registry import Keeps, MindSporePrimitive, register

if TYPE_CHECKING:
    from autopar.ops.views import GraphView, NodeView


def _class_count(op: NodeView, graph: GraphView) -> int:
    """Labels index the class axis (axis 1) of the scores."""
    return graph.tensor(op.inputs[0]).shape[1]


def torch_class_loss(t: Any, op: NodeView, inputs: list[Any]) -> list[Any]:
    """Cross entropy from scores (SoftmaxCrossEntropyLoss) or from log-probabilities (NLL)."""
    scores, labels = inputs[0], inputs[1].long()
    weights = inputs[2] if len(inputs) > 2 else None
    log_prob = t.log_softmax(scores, dim=1) if op.op_type == "SoftmaxCrossEntropyLoss" else scores
    ignore = int(op.attrs.get("ignore_index", -100))
    if "ignore_index" not in op.attrs and bool((labels == -100).any()):
        ignore = -(2**62)  # no label is ignored
    loss = t.nn.functional.nll_loss(
        log_prob, labels, weight=weights, ignore_index=ignore, reduction=op.attrs.get("reduction", "mean")
    )
    outputs = [loss]
    if op.op_type == "SoftmaxCrossEntropyLoss" and len([name for name in op.outputs if name]) > 1:
        outputs.append(log_prob)
    return outputs


@register(
    "SoftmaxCrossEntropyLoss",
    "NegativeLogLikelihoodLoss",
    mindspore={
        "SoftmaxCrossEntropyLoss": MindSporePrimitive(
            "ops.SparseSoftmaxCrossEntropyWithLogits", 2, note="logits [N, C] and integer labels"
        ),
        "NegativeLogLikelihoodLoss": MindSporePrimitive("ops.NLLLoss", 2),
    },
    keeps=Keeps.INPUTS,
    index_bounds={1: _class_count},
    torch_kernel=torch_class_loss,
)
def class_loss(op: NodeView, graph: GraphView) -> OpSpec:
    rank = len(shape(graph, op.inputs[0]))
    reduction = op.attrs.get("reduction", "mean")
    weighted = len(op.inputs) > 2 and bool(op.inputs[2])
    second_output = len(op.outputs) > 1 and bool(op.outputs[1])
    splittable = reduction == "none" or (
        not second_output and (reduction == "sum" or not (weighted or "ignore_index" in op.attrs))
    )
    samples = tuple(f"d{d}" if splittable else None for d in range(rank) if d != 1)
    scores = samples[:1] + (None,) + samples[1:]
    inputs = (scores, samples) + ((None,) if weighted else ())
    loss = samples if reduction == "none" else ()
    outputs = (loss,) + ((scores,) if second_output else ())
    return OpSpec(inputs=inputs, outputs=outputs, local_mean=reduction == "mean")


# --- the operator alone in tiny models, checked by the operator tests (`autopar.ops.cases`) -----

CASES = named(
    kernel={
        "cross_entropy_weighted_log_prob": one(
            "SoftmaxCrossEntropyLoss",
            ["X", "t", "w"],
            [("X", F, [4, 5, 3]), ("t", I64, [4, 3])],
            [const("w", [1, 2, 0.5, 1, 3], np.float32)],
            outputs=("Y", "L"),
        ),
        "cross_entropy_ignored_none": one(
            "SoftmaxCrossEntropyLoss", ["X", "t"], [("X", F, [6, 5]), ("t", I64, [6])], reduction="none", ignore_index=1
        ),
        "nll_weighted_mean_ignored": one(
            "NegativeLogLikelihoodLoss",
            ["X", "t", "w"],
            [("X", F, [4, 5]), ("t", I64, [4])],
            [const("w", [1, 2, 0.5, 1, 3], np.float32)],
            ignore_index=2,
        ),
        "nll_sum": one(
            "NegativeLogLikelihoodLoss", ["X", "t"], [("X", F, [4, 5, 2]), ("t", I64, [4, 2])], reduction="sum"
        ),
    },
    strategies={
        "sce_mean": one("SoftmaxCrossEntropyLoss", ["X", "t"], [("X", F, [8, 16]), ("t", I64, [8])]),
        "sce_sum_3d": one(
            "SoftmaxCrossEntropyLoss", ["X", "t"], [("X", F, [4, 16, 8]), ("t", I64, [4, 8])], reduction="sum"
        ),
        "sce_ignore_index": one(
            "SoftmaxCrossEntropyLoss", ["X", "t"], [("X", F, [8, 16]), ("t", I64, [8])], ignore_index=1
        ),
        "nll_none": one(
            "NegativeLogLikelihoodLoss", ["X", "t"], [("X", F, [8, 16]), ("t", I64, [8])], reduction="none"
        ),
    },
)
