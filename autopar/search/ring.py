"""Context parallelism as ring attention runs it: keys and values gathered along the sequence arrive while
the fused attention kernel computes.

Where a fused kernel (`Dataflow.fused`) splits its queries' sequence over some devices and reads the keys
and values whole along theirs, each device holds the queries of its part of the sequence and needs every
key and value. Ring attention (Liu, Zaharia and Abbeel 2023; Megatron-Core's context parallelism, as
Llama 3 was trained with it) passes the key and value blocks round the ring of those devices, each block
computed on while the next arrives, and the gradients of the keys and values back the same way under
the backward. So the AllGather that brings the keys (values) to such a candidate, and the ReduceScatter
of their gradient, run under the product that reads them: of the pair's time, up to that product's own
(its `NodeCosts.compute`, forward and backward) is hidden. Any other transfer (an AllToAll between the
heads and sequence splits, Ulysses' way; a gather of the heads or the batch) runs before the kernel and
is not hidden. The operators' layout rules and verification are those of the operators.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from autopar.layout import Layout
from autopar.search.dataflow import Dataflow, TensorUse


def ring_slots(flow: Dataflow, node: int) -> tuple[int, ...]:
    """The inputs of a fused kernel's operator that ring attention passes round (the keys of the scores'
    product, the values of the values' product, both of an ``Attention`` operator): none elsewhere."""
    part = flow.fused.get(flow.rules[node].op.name)
    if part is None or part.role == "inner":
        return ()
    return (1, 2) if part.role == "kernel" else (1,)


def windows(flow: Dataflow, node: int, slot: int, compute: np.ndarray) -> np.ndarray:
    """Per candidate of ``node``, the seconds under which its input ``slot`` may arrive (`window`)."""
    return np.array([window(flow, node, slot, candidate, compute) for candidate in range(len(compute))])


def key_axis(flow: Dataflow, node: int) -> int:
    """The axis of the keys' (values') sequence in a ring input of ``node``: the last of the scores' second
    input (the keys transposed), the second-to-last of the values and of an ``Attention`` operator's keys and
    values."""
    return -1 if flow.fused[flow.rules[node].op.name].role == "scores" else -2


def window(flow: Dataflow, node: int, slot: int, candidate: int, compute: np.ndarray) -> float:
    """The seconds under which input ``slot`` of ``node``'s ``candidate`` may arrive: the compute of the product
    reading it (half of an ``Attention`` operator's, whose two products do equal work) where the candidate
    splits the queries' sequence (the second-to-last axis of the first input: queries, or the scores' rows)
    and reads that input whole along its sequence (`key_axis`); else 0."""
    rule = flow.rules[node]
    inputs = rule.candidate_layouts(candidate)[0]
    queries, keys = inputs[0], inputs[slot]
    if queries is None or keys is None or queries.ndim < 2 or keys.ndim < 2:
        return 0.0
    if not queries.dims[-2] or keys.dims[key_axis(flow, node)]:
        return 0.0
    share = 0.5 if flow.fused[rule.op.name].role == "kernel" else 1.0
    return share * float(compute[candidate])


def passed_round(src: Layout, dst: Layout, axis: int) -> bool:
    """Whether taking ``src`` to ``dst`` is what a ring passes round: an AllGather of the sequence (``axis``)
    alone, every other axis split as it was and nothing partial.

    >>> passed_round(Layout(((0,), (1,))), Layout(((0,), ()), ()), -1)
    True
    >>> passed_round(Layout(((), (1,))), Layout(((1,), ())), -1), passed_round(Layout(((0,), ())), Layout(((), ())), -1)
    (False, False)
    """
    if src.partial or not src.dims[axis] or dst.dims[axis]:
        return False
    return all(a == b for d, (a, b) in enumerate(zip(src.dims, dst.dims)) if d != axis % len(src.dims))


def hidden_under(
    table: np.ndarray,
    forward: np.ndarray,
    src_layouts: Sequence[Layout],
    dst_pos: np.ndarray,
    dst_layouts: Sequence[Layout],
    windows: tuple[np.ndarray, int],
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A use's tables (``table``: forward and the gradient's way back; ``forward``: its forward alone, over
    source rows and consumer columns) less what runs under the consumer's product, and the consumer's
    positions in them: candidates that read one layout but hide different amounts get columns of their own,
    those whose columns come out the same share one (most: a product's compute is most often longer than
    the transfer, which it then hides whole).

    ``src_layouts`` and ``dst_layouts``: a layout of each row and column; ``windows``: per consumer candidate
    (`window`), and the sequence's axis. An entry is hidden only where its transfer is passed round
    (`passed_round`)."""
    window, axis = windows
    numbers: dict[tuple, int] = {}  # the layouts' other axes, numbered: a ring keeps them as they are

    def others(layout: Layout) -> int:
        return numbers.setdefault(tuple(b for d, b in enumerate(layout.dims) if d != axis % layout.ndim), len(numbers))

    rows = np.array([others(src) if not src.partial and src.dims[axis] else -1 for src in src_layouts])
    columns = np.array([others(dst) if not dst.dims[axis] else -2 for dst in dst_layouts])
    passed = (rows[:, None] == columns[None, dst_pos]) & (window > 0)[None, :]
    both, alone = table[:, dst_pos], forward[:, dst_pos]
    both = both - np.where(passed, np.minimum(both, window[None, :]), 0.0)
    alone = alone - np.where(passed, np.minimum(alone, window[None, :]), 0.0)
    _, first, positions = np.unique(np.concatenate([both, alone]).T, axis=0, return_index=True, return_inverse=True)
    order = np.argsort(first, kind="stable")  # columns in the order of their first candidate
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    return both[:, first[order]], alone[:, first[order]], rank[positions.reshape(-1)].astype(np.int64)


def reads_through(flow: Dataflow, use: TensorUse) -> bool:
    """Whether ``use`` ends at an input ring attention passes round (`ring_slots`)."""
    return use.dst_slot in ring_slots(flow, use.dst_node)
