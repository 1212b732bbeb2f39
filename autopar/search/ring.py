"""Context parallelism as ring attention runs it: keys and values gathered along the sequence arrive while
the fused attention kernel computes.

Where a fused kernel's product (`Dataflow.fused`) splits its queries' sequence over some devices and reads
the keys (values) whole along theirs, each device holds the queries of its part of the sequence and needs
every key and value. Ring attention (Liu, Zaharia and Abbeel 2023; Megatron-Core's context parallelism, as
Llama 3 was trained with it) passes the key and value blocks round the ring of the devices that split them,
each block computed on while the next arrives, and their gradients back the same way under the backward.
So the AllGather of the keys' (values') sequence that such a candidate reads runs under the forward of the
product reading them, and the ReduceScatter of their gradient under its backward: of each, up to that
product's own time is hidden. Any other transfer (an AllToAll between the heads and sequence splits,
Ulysses' way; a gather of the heads or the batch) runs before the kernel and is not hidden.

An edge's table has a column per layout its consumer reads; a consumer's ring candidates get columns of
their own (`columns`), each hiding up to the least window of the candidates in it (one reading the keys
with its queries split more ways computes less per device): a structure that depends on the layouts alone,
so the search is planned on it before any cost is known. The operators' layout rules and verification are
those of the operators. An ``Attention`` operator (opset 23) is not among them: its rule never splits a
sequence, so no candidate of it reads round a ring.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from autopar.layout import Layout
from autopar.search.dataflow import Dataflow, TensorUse

RING_SLOT = 1
"""The input passed round: the keys (transposed) of the scores' product, the values of the values' product."""


def reads_through(flow: Dataflow, use: TensorUse) -> bool:
    """Whether ``use`` ends at the keys of a fused scores' product or the values of a fused values' product."""
    part = flow.fused.get(flow.rules[use.dst_node].op.name)
    return part is not None and part.role in ("scores", "values") and use.dst_slot == RING_SLOT


def key_axis(flow: Dataflow, node: int) -> int:
    """The axis of the keys' (values') sequence in the ring input of ``node``: the last of the scores' second
    input (the keys transposed), the second-to-last of the values."""
    return -1 if flow.fused[flow.rules[node].op.name].role == "scores" else -2


def reads_round(flow: Dataflow, node: int) -> np.ndarray:
    """Per candidate of a fused product, whether it reads its ring input round a ring: it splits the queries'
    sequence (the second-to-last axis of its first input: the queries, or the scores' rows) and reads the
    ring input whole along its own (`key_axis`)."""
    rule, axis = flow.rules[node], key_axis(flow, node)
    found = np.zeros(len(rule.candidates), dtype=bool)
    for candidate in range(len(rule.candidates)):
        inputs = rule.candidate_layouts(candidate)[0]
        queries, keys = inputs[0], inputs[RING_SLOT]
        if queries is not None and keys is not None and queries.ndim >= 2 and keys.ndim >= 2:
            found[candidate] = bool(queries.dims[-2]) and not keys.dims[axis]
    return found


def windows(flow: Dataflow, node: int, compute: np.ndarray, ring: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per candidate of a fused product, the seconds its forward and its backward take (``compute`` is both:
    the forward times `Dataflow.work_multiple`) where it reads round a ring (``ring``: `reads_round`), else 0."""
    multiple = flow.work_multiple(node)
    forward = np.where(ring, compute / multiple if multiple else 0.0, 0.0)
    return forward, np.where(ring, compute - forward, 0.0)


def columns(dst_pos: np.ndarray, ring: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(each consumer candidate's column, each column's layout column) of a ring input's table: the layout
    columns of ``dst_pos`` in their order, each split in two where some candidates reading it read round a
    ring (``ring``: `reads_round`) and some do not, those that do second. Where none does, the layout columns."""
    keys = dst_pos.astype(np.int64) * 2 + ring
    unique, positions = np.unique(keys, return_inverse=True)
    return positions.reshape(-1).astype(np.int64), unique // 2


def placed_windows(
    flow: Dataflow, use: TensorUse, dst_pos: np.ndarray, compute: np.ndarray
) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """A ring input's `columns` (over the consumer's layout columns ``dst_pos``) and each column's windows
    (`least_windows` of the product's, ``compute``): what costing charges and lowering lists alike."""
    ring = reads_round(flow, use.dst_node)
    placed = columns(dst_pos, ring)
    return placed, least_windows(placed, windows(flow, use.dst_node, compute, ring))


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


def least_windows(
    placed: tuple[np.ndarray, np.ndarray], under: tuple[np.ndarray, np.ndarray]
) -> tuple[np.ndarray, np.ndarray]:
    """Per column (`columns`: ``placed``), the least forward and backward windows of its candidates (`windows`:
    ``under``); 0 in a column of candidates that do not read round a ring."""
    positions, layout_of = placed
    least = (np.full(len(layout_of), np.inf), np.full(len(layout_of), np.inf))
    for window, into in zip(under, least):
        np.minimum.at(into, positions, window)
    return least


def hidden_under(
    tables: tuple[np.ndarray, np.ndarray],
    layouts: tuple[Sequence[Layout], Sequence[Layout]],
    layout_of: np.ndarray,
    least: tuple[np.ndarray, np.ndarray],
    axis: int,
) -> tuple[np.ndarray, np.ndarray]:
    """A ring input's tables, over source rows and its `columns`, less what runs under its product.

    ``tables``: forward and the gradient's way back, and the forward alone, over source rows and layout
    columns; ``layouts``: a layout of each row and of each layout column; ``layout_of``: each column's layout
    column; ``least``: each column's forward and backward windows (`least_windows`); ``axis``: the
    sequence's (`key_axis`). An entry is hidden only where its transfer is passed round (`passed_round`): of
    the forward, up to the forward window, and of the gradient's way back, up to the backward's."""
    (both, alone), (src_layouts, dst_layouts) = tables, layouts
    numbers: dict[tuple, int] = {}  # the layouts' other axes, numbered: a ring keeps them as they are

    def others(layout: Layout) -> int:
        return numbers.setdefault(tuple(b for d, b in enumerate(layout.dims) if d != axis % layout.ndim), len(numbers))

    rows = np.array([others(src) if not src.partial and src.dims[axis] else -1 for src in src_layouts])
    wanted = np.array([others(dst) if not dst.dims[axis] else -2 for dst in dst_layouts])[layout_of]
    passed = (rows[:, None] == wanted[None, :]) & (least[0] > 0)[None, :]
    both, alone = both[:, layout_of], alone[:, layout_of]
    ahead = np.where(passed, np.minimum(alone, least[0][None, :]), 0.0)
    back = np.where(passed, np.minimum(np.maximum(both - alone, 0.0), least[1][None, :]), 0.0)
    return both - ahead - back, alone - ahead
