"""Loss operators: SoftmaxCrossEntropyLoss and NegativeLogLikelihoodLoss.

Samples (the batch and any extra spatial/sequence axes) split; the class axis stays whole, as
the softmax needs every class. With reduction "sum" a rank's loss is a partial sum; with
"mean" it is a partial mean (the rank divides by the number of shards). A mean with
``ignore_index`` (every Hugging Face language model's loss) divides by the count of labels not
ignored, which only the whole batch knows: the scores split by samples and the labels are read
whole (a few bytes a sample, where the scores are a vocabulary's worth), so each rank sums its
samples' losses and divides by the whole count, a partial sum (`counted_mean`). A weighted mean
keeps every axis whole, as does a loss whose per-sample ``log_prob`` output is also read.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import numpy as np

from autopar.layout import shard_index
from autopar.ops.base import OpSpec, shape
from autopar.ops.cases import I64, F, const, named, one
from autopar.ops.registry import Keeps, LocalCall, MindSporePrimitive, register

if TYPE_CHECKING:
    from autopar.ops.views import GraphView, NodeView


def _class_count(op: NodeView, graph: GraphView) -> int:
    """Labels index the class axis (axis 1) of the scores."""
    return graph.tensor(op.inputs[0]).shape[1]


def counted_mean(op: NodeView) -> bool:
    """A mean over the labels not ignored (``ignore_index`` given, no class weights, the loss alone)."""
    weighted = len(op.inputs) > 2 and bool(op.inputs[2])
    second_output = len(op.outputs) > 1 and bool(op.outputs[1])
    reduction = op.attrs.get("reduction", "mean")
    return reduction == "mean" and "ignore_index" in op.attrs and not weighted and not second_output


def _rank_labels(call: LocalCall, labels: Any) -> Any:
    """The rank's labels, cut from the whole labels as its scores are cut (axis 0 and the axes past the
    classes, each by the bits splitting it)."""
    for axis in range(labels.ndim):
        bits = call.bits.get(f"d{axis if axis == 0 else axis + 1}", ())
        if bits:
            size = labels.shape[axis] >> len(bits)
            first = shard_index(call.rank, bits) * size
            labels = labels[(slice(None),) * axis + (slice(first, first + size),)]
    return labels


def _counted_local(call: LocalCall) -> list[np.ndarray]:
    """A counted mean on a rank's samples: their losses summed over the whole batch's count of labels not
    ignored (the ranks' results sum to the loss)."""
    if not counted_mean(call.op):
        return call.run(call.inputs)
    scores, whole = np.asarray(call.inputs[0]), np.asarray(call.inputs[1]).astype(np.int64)
    ignore = int(call.op.attrs["ignore_index"])
    labels = _rank_labels(call, whole)
    if call.op.op_type == "SoftmaxCrossEntropyLoss":
        shifted = scores - scores.max(axis=1, keepdims=True)
        scores = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    kept = labels != ignore
    picked = np.take_along_axis(scores, np.expand_dims(np.where(kept, labels, 0), 1), axis=1).squeeze(1)
    total = -np.where(kept, picked, 0).sum(dtype=np.float64)  # where, not times: an ignored row may be -inf
    return [np.asarray(total / (whole != ignore).sum(), dtype=scores.dtype)]


def _counted_local_torch(call: LocalCall) -> list[Any]:
    """`_counted_local` in torch, differentiable."""
    if not counted_mean(call.op):
        return call.run(call.inputs)
    torch = sys.modules[type(call.inputs[0]).__module__.split(".")[0]]
    scores, whole = call.inputs[0], call.inputs[1].long()
    ignore = int(call.op.attrs["ignore_index"])
    labels = _rank_labels(call, whole)
    log_prob = torch.log_softmax(scores.float(), dim=1) if call.op.op_type == "SoftmaxCrossEntropyLoss" else scores
    # summed in FP32: a shard's sum of half-precision losses passes 65,504 at a few thousand tokens
    total = torch.nn.functional.nll_loss(log_prob.float(), labels, ignore_index=ignore, reduction="sum")
    return [(total / (whole != ignore).sum()).to(scores.dtype)]


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
    local_kernel=_counted_local,
    torch_local_kernel=_counted_local_torch,
)
def class_loss(op: NodeView, graph: GraphView) -> OpSpec:
    rank = len(shape(graph, op.inputs[0]))
    reduction = op.attrs.get("reduction", "mean")
    weighted = len(op.inputs) > 2 and bool(op.inputs[2])
    second_output = len(op.outputs) > 1 and bool(op.outputs[1])
    splittable = reduction == "none" or (
        not second_output and (reduction == "sum" or not (weighted or "ignore_index" in op.attrs))
    )
    counted = counted_mean(op)
    samples = tuple(f"d{d}" if splittable or counted else None for d in range(rank) if d != 1)
    scores = samples[:1] + (None,) + samples[1:]
    labels = tuple(None for _ in samples) if counted else samples  # whole: the count needs every label
    inputs = (scores, labels) + ((None,) if weighted else ())
    loss = samples if reduction == "none" else ()
    outputs = (loss,) + ((scores,) if second_output else ())
    return OpSpec(inputs=inputs, outputs=outputs, local_mean=reduction == "mean" and not counted)


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
