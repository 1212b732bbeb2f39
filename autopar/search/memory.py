"""Memory per device: what each operator's candidate keeps resident, and what the memory choices save.

An operator holds the parameters and data inputs it owns (`dataflow`), in the layout it wants:
parameters with their gradient and optimizer state as the cost model prices them, inputs in the
compute dtype. Activations some backward needs (`Dataflow.kept`) are counted once, at their
producer, plus a normalisation's statistics. The memory choices (`MemoryChoices`) trade time for
it: a parallel optimizer splits the state of parameters replicated over some bits, and
recomputation keeps only each repeated block's input and runs its forward again.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from autopar.graph import TensorInfo
from autopar.layout import Layout
from autopar.ops import Keeps
from autopar.ops.elementwise import dropout_draws
from autopar.search.dataflow import Dataflow, backward_readers, backward_runs

STATISTICS_BYTES_PER_ROW = 8  # a normalisation's FP32 mean and inverse deviation per row
MASK_BYTES_PER_ELEMENT = 1  # a dropout's mask, a bool an element (torch's native_dropout keeps it so)
LOGSUMEXP_BYTES_PER_ROW = 4  # a fused attention kernel's FP32 log-sum-exp per query row (FlashAttention's L)


@dataclass(frozen=True)
class MemoryChoices:
    """What a plan does to save memory, beside its strategies (searched only when memory binds).

    ``sharded``: operators whose trainable parameters use a parallel optimizer (MindSpore's
    ``enable_parallel_optimizer``, ZeRO-2: gradient and optimizer state split over the bits the
    parameter is replicated on; ReduceScatter, then AllGather of the updated weights);
    ``recompute``: every folded run of repeated blocks keeps only each block's input and runs
    its forward again in the backward pass; ``micro_batches``: the problem is one micro-batch of
    a step that accumulates gradients over this many (the gradient sync is paid once a step).
    """

    sharded: frozenset[int] = frozenset()
    recompute: bool = False
    micro_batches: int = 1


NO_MEMORY_CHOICES = MemoryChoices()


@dataclass(frozen=True)
class Alternative:
    """An operator's figures per candidate with its parameters under a parallel optimizer."""

    time: np.ndarray
    communication: np.ndarray
    memory: np.ndarray
    hidden: np.ndarray
    sync: np.ndarray  # the part of ``time`` paid once a step: exposed gradient sync and weight gathers


class CandidateSplits:
    """An operator's candidates as arrays: how many mesh bits split each label, and which bits.

    A tensor's local size is its size shifted right by the exponents of the labels splitting it;
    the bits a label takes are a mask built from the labels' bit ranges (the last label of the
    device matrix takes the lowest bits, as `OpRule.label_bits` says).

    >>> splits = CandidateSplits([(0, 0), (1, 0), (1, 2)], ("b", "n"))
    >>> splits.split(("b", None)).tolist()
    [0, 1, 1]
    >>> splits.absent_mask(("b",)).tolist()  # the bits of label n, the lowest ones
    [0, 0, 3]
    """

    def __init__(self, candidates: Sequence[tuple[int, ...]], order: Sequence[str]) -> None:
        self.count = len(candidates)
        self.order = tuple(order)
        self.exponents = np.asarray(candidates, dtype=np.int64).reshape(self.count, len(order))
        self.column = {label: i for i, label in enumerate(order)}
        # bit offset of each label: the sum of the exponents of the labels after it
        offsets = np.cumsum(self.exponents[:, ::-1], axis=1)[:, ::-1] - self.exponents
        self.label_mask = ((np.int64(1) << self.exponents) - 1) << offsets

    def split(self, labels: Sequence[str | None] | None) -> np.ndarray:
        """How many mesh bits split a tensor with these labels, per candidate."""
        bits = np.zeros(self.count, dtype=np.int64)
        for label in labels or ():
            if label is not None:
                bits += self.exponents[:, self.column[label]]
        return bits

    def local(self, info: TensorInfo, labels: Sequence[str | None] | None) -> np.ndarray:
        """Elements of a tensor one device holds, per candidate."""
        return np.int64(info.numel) >> self.split(labels)

    def absent_mask(self, labels: Sequence[str | None] | None) -> np.ndarray:
        """The bits of the labels a tensor lacks (its gradient is partial over them), per candidate."""
        mask = np.zeros(self.count, dtype=np.int64)
        for label in self.order:
            if label not in (labels or ()):
                mask |= self.label_mask[:, self.column[label]]
        return mask


@dataclass(frozen=True)
class Resident:
    """One operator's bytes per device per candidate, before the memory choices."""

    memory: np.ndarray  # parameter state, inputs it owns, activations kept for backward
    state_saving: np.ndarray  # bytes a parallel optimizer saves (0 where the parameters are split everywhere)
    activations: np.ndarray  # bytes of its outputs kept for backward (dropped when recomputed)


def resident(flow: Dataflow, node: int, splits: CandidateSplits) -> Resident:
    """`memory_items` for every candidate at once, term for term."""
    rule = flow.rules[node]
    op, graph, cost, spec = rule.op, flow.graph, flow.cost, rule.spec
    memory, state_saving = np.zeros(splits.count), np.zeros(splits.count)
    for slot, name in enumerate(op.inputs):
        if not name or flow.owner.get(name) != (node, slot):
            continue
        labels = spec.inputs[slot] if slot < len(spec.inputs) else None
        info = graph.tensor(name)
        numel = splits.local(info, labels)
        if info.kind != "parameter":
            memory = memory + numel * flow.itemsize(info)
            continue
        memory = memory + numel * cost.parameter_bytes_per_element(info.trainable)
        if not info.trainable:
            continue
        shards = np.ldexp(1.0, np.bitwise_count(splits.absent_mask(labels)).astype(np.int64))
        state_saving = state_saving + numel * cost.parameter_bytes_split(True)[1] * (1.0 - 1.0 / shards)
    activations = np.zeros(splits.count)
    for labels, name in zip(spec.outputs, op.outputs):
        if name and name in flow.kept:
            info = graph.tensor(name)
            activations = activations + splits.local(info, labels) * flow.kept_itemsize(info)
    memory = memory + activations
    if Keeps.STATISTICS in rule.keeps and backward_runs(rule, flow.requires_grad):
        labels = spec.inputs[0] or ()
        rows = math.prod(size for size, label in zip(graph.tensor(op.inputs[0]).shape, labels) if label is not None)
        statistics = (np.int64(rows) >> splits.split(labels)) * STATISTICS_BYTES_PER_ROW
        memory, activations = memory + statistics, activations + statistics
    rows = logsumexp_rows(flow, node)
    if rows:
        statistics = (np.int64(rows) >> splits.split(spec.outputs[0][:-1])) * LOGSUMEXP_BYTES_PER_ROW
        memory, activations = memory + statistics, activations + statistics
    if keeps_mask(flow, node):
        mask = splits.local(graph.tensor(op.outputs[0]), spec.outputs[0]) * MASK_BYTES_PER_ELEMENT
        memory, activations = memory + mask, activations + mask
    return Resident(memory, state_saving, activations)


def keeps_mask(flow: Dataflow, node: int) -> bool:
    """Whether an operator's backward keeps a mask of its own (`Keeps.MASK`): a Dropout that draws one, in
    training, outside a fused attention kernel (which draws its mask again in its backward)."""
    rule = flow.rules[node]
    if Keeps.MASK not in rule.keeps or not backward_runs(rule, flow.requires_grad) or rule.op.name in flow.fused:
        return False
    return dropout_draws(rule.op, flow.graph)


def input_bytes(flow: Dataflow, node: int) -> np.ndarray:
    """Per candidate, the bytes of the data inputs an operator loads (those it owns), as `resident` counts them.
    Most operators own none: their candidates are not read (a relaxation asks for every operator's)."""
    rule = flow.rules[node]
    total = np.zeros(len(rule.candidates))
    owned = [
        slot
        for slot, name in enumerate(rule.op.inputs)
        if name and flow.owner.get(name) == (node, slot) and flow.graph.tensor(name).kind != "parameter"
    ]
    if not owned:
        return total
    splits = CandidateSplits(rule.candidates, rule.spec.label_order)
    for slot in owned:
        info = flow.graph.tensor(rule.op.inputs[slot])
        labels = rule.spec.inputs[slot] if slot < len(rule.spec.inputs) else None
        total = total + splits.local(info, labels) * flow.itemsize(info)
    return total


def gradient_bytes(flow: Dataflow, node: int, choice: int) -> float:
    """Bytes of the gradients of the trained parameters an operator owns, on one device in its candidate's
    layout: the part of their state (`memory_items`' "parameter") a single process makes only in the backward."""
    rule = flow.rules[node]
    total = 0.0
    for slot, name in enumerate(rule.op.inputs):
        if not name or flow.owner.get(name) != (node, slot):
            continue
        info = flow.graph.tensor(name)
        if info.kind == "parameter" and info.trainable:
            total += rule.input_layout(choice, slot).local_numel(info.shape) * flow.cost.gradient_itemsize()
    return total


def released_after(flow: Dataflow) -> tuple[int, ...]:
    """Per operator, the operator after whose backward its activations are all freed: the first in graph order
    (the last to run its backward) of the operators whose backward reads one of them, itself where it keeps
    statistics or a log-sum-exp of its own (its own index where it keeps nothing)."""
    keepers = backward_readers(flow.graph, flow.rules, flow.requires_grad, flow.fused)
    found = []
    for node, rule in enumerate(flow.rules):
        readers = [min(keepers[name]) for name in rule.op.outputs if name in keepers]
        own = Keeps.STATISTICS in rule.keeps and backward_runs(rule, flow.requires_grad)
        if own or logsumexp_rows(flow, node) or keeps_mask(flow, node):
            readers.append(node)
        found.append(min(readers, default=node))
    return tuple(found)


def logsumexp_rows(flow: Dataflow, node: int) -> int:
    """Query rows whose log-sum-exp a fused attention kernel keeps for its backward (0 for other operators):
    one per row of its output, the last axis (the value size) not counted."""
    rule = flow.rules[node]
    part = flow.fused.get(rule.op.name)
    if part is None or part.role not in ("values", "kernel") or not backward_runs(rule, flow.requires_grad):
        return 0
    shape = flow.graph.tensor(rule.op.outputs[0]).shape
    if part.role == "kernel" and len(shape) == 3:  # heads folded into the hidden axis
        return shape[0] * shape[1] * int(rule.op.attrs["q_num_heads"])
    return math.prod(shape[:-1])


def recompute_savings(
    activations: Sequence[np.ndarray], copies: int, nodes: Sequence[int], last_of_copy: set[int]
) -> tuple[dict[int, np.ndarray], dict[int, float]]:
    """(bytes freed per candidate, <= 0; share of its activations that stays) of a recomputed run's operators.

    One block's activations stay, rebuilt in turn; a copy's last output is the next block's input
    and is kept whole.
    """
    kept = (copies - 1) / copies
    freed: dict[int, np.ndarray] = {}
    share: dict[int, float] = {}
    for node in nodes:
        if node in last_of_copy:
            freed[node] = np.zeros(len(activations[node]))
        else:
            freed[node] = -kept * activations[node]
            share[node] = 1.0 - kept
    return freed, share


def memory_items(
    flow: Dataflow,
    node: int,
    choice: int,
    choices: MemoryChoices,
    recompute_share: Mapping[int, float],
    in_flight: int = 1,
) -> list[tuple[str, str, float]]:
    """(tensor, role, bytes per device) an operator's candidate keeps resident.

    Roles: "parameter" (weights with their FP32 master copy, gradient and optimizer state, as the
    cost model prices them), "input" (data it loads) and "activation" (outputs kept for backward, for
    each of the ``in_flight`` micro-batches a pipeline stage holds; once a block's forward is
    recomputed, ``recompute_share`` of one).
    """
    rule = flow.rules[node]
    op, graph, cost = rule.op, flow.graph, flow.cost
    out_layouts = rule.candidate_layouts(choice)[1]
    items: list[tuple[str, str, float]] = []
    for slot, name in enumerate(op.inputs):
        if not name or flow.owner.get(name) != (node, slot):
            continue
        info = graph.tensor(name)
        numel = rule.input_layout(choice, slot).local_numel(info.shape)
        if info.kind == "parameter":
            shards = 1
            if node in choices.sharded and info.trainable:
                shards = 1 << len(flow.gradient_sync_bits(node, rule.candidates[choice], slot))
            items.append((name, "parameter", numel * cost.parameter_bytes_per_element(info.trainable, shards)))
        else:
            items.append((name, "input", numel * flow.itemsize(info)))
    share = recompute_share[node] if choices.recompute and node in recompute_share else float(in_flight)
    for name, layout in zip(op.outputs, out_layouts):
        if name and name in flow.kept:
            info = graph.tensor(name)
            items.append((name, "activation", share * _local_bytes(layout, info, flow.kept_itemsize(info))))
    if Keeps.STATISTICS in rule.keeps and backward_runs(rule, flow.requires_grad):
        layout = rule.input_layout(choice, 0)
        x = graph.tensor(op.inputs[0])
        labels = rule.spec.inputs[0] or ()
        rows = math.prod(size for size, label in zip(x.shape, labels) if label is not None)
        shards = x.numel // max(1, layout.local_numel(x.shape))
        items.append((f"{op.name} statistics", "activation", share * (rows // shards * STATISTICS_BYTES_PER_ROW)))
    rows = logsumexp_rows(flow, node)
    if rows:
        y, layout = graph.tensor(op.outputs[0]), out_layouts[0]
        shards = 1 if layout is None else y.numel // max(1, layout.local_numel(y.shape)) >> len(layout.dims[-1])
        items.append((f"{op.name} log-sum-exp", "activation", share * (rows // shards * LOGSUMEXP_BYTES_PER_ROW)))
    if keeps_mask(flow, node):
        mask = _local_bytes(out_layouts[0], graph.tensor(op.outputs[0]), MASK_BYTES_PER_ELEMENT)
        items.append((f"{op.name} mask", "activation", share * mask))
    return items


def _local_bytes(layout: Layout | None, info: TensorInfo, itemsize: int) -> int:
    if layout is None:
        return 0
    return layout.local_numel(info.shape) * itemsize
