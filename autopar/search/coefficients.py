"""Redistribution coefficients for many layout pairs at once, with numpy.

An edge's cost is ``latency + per_byte * tensor_bytes``, and the two coefficients depend on
the (source, target) layouts only. `redistribute.symbolic_steps` plans one pair at a time in
Python (tens of microseconds); a model on 1024 devices has millions of distinct pairs. This
module runs the same planner on every pair in lockstep: each round takes one step (one bit)
for every pair still moving, and fuses consecutive steps exactly as `_merge` does. The
summation order of each pair's terms is the one `SearchProblem.redistribution_coefficients`
uses, so the results are identical to the last bit (`tests/test_coefficients.py` checks it).

A dimension's bits are packed into one integer, four bits per mesh bit, most significant
first, so "is a prefix of", "pop the last bit" and "the next bit wanted" are shifts and masks.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from autopar.cost import CostModel
from autopar.layout import Layout
from autopar.redistribute import BACKWARD_DUAL, Collective

# Step kinds as small integers; -1 is "no step".
KINDS = (
    Collective.ALL_GATHER,
    Collective.REDUCE_SCATTER,
    Collective.ALL_TO_ALL,
    Collective.ALL_REDUCE,
    Collective.SLICE,
)
_AG, _RS, _A2A, _AR, _SLICE = range(len(KINDS))
_DUAL = [KINDS.index(d) if (d := BACKWARD_DUAL[k]) is not None else -1 for k in KINDS]
_MERGEABLE = np.array([True, True, False, False, True])
_NIBBLE = 4  # bits per packed mesh bit: mesh bits 0..15, i.e. up to 65,536 devices
CHUNK = 1 << 18  # pairs per lockstep batch: bounds the working arrays to a few tens of MB


class LayoutTable:
    """Layouts packed into arrays: per layout and dimension, the number of bits and their code."""

    def __init__(self, layouts: Sequence[Layout]) -> None:
        width = max((layout.ndim for layout in layouts), default=0)
        self.length = np.zeros((len(layouts), max(width, 1)), dtype=np.int64)
        self.code = np.zeros(self.length.shape, dtype=np.uint64)
        self.partial = np.zeros(len(layouts), dtype=np.int64)
        for index, layout in enumerate(layouts):
            for dim, bits in enumerate(layout.dims):
                self.length[index, dim] = len(bits)
                code = 0
                for bit in bits:
                    code = (code << _NIBBLE) | bit
                self.code[index, dim] = code
            for bit in layout.partial:
                self.partial[index] |= 1 << bit


def pair_coefficients(
    table: LayoutTable, src: np.ndarray, dst: np.ndarray, cost: CostModel
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(forward latency, forward seconds per byte, forward+backward latency, forward+backward per byte).

    ``src`` and ``dst`` index ``table``; the target layouts must not be partial. The backward
    terms are the dual collectives a tensor carrying a gradient pays (`BACKWARD_DUAL`).
    """
    count = len(src)
    results = [np.zeros(count) for _ in range(4)]
    for start in range(0, count, CHUNK):
        stop = min(start + CHUNK, count)
        chunk = _chunk_coefficients(table, src[start:stop], dst[start:stop], cost)
        for result, part in zip(results, chunk):
            result[start:stop] = part
    return results[0], results[1], results[2], results[3]


def _drop(code: np.ndarray, count: np.ndarray) -> np.ndarray:
    """The code without its last ``count`` bits (16 or more drops everything)."""
    shift = (np.minimum(count, 15) * _NIBBLE).astype(np.uint64)
    return np.where(count >= 16, np.uint64(0), code >> shift)


def _append(code: np.ndarray, bit: np.ndarray) -> np.ndarray:
    return (code << np.uint64(_NIBBLE)) | bit.astype(np.uint64)


def _chunk_coefficients(
    table: LayoutTable, src: np.ndarray, dst: np.ndarray, cost: CostModel
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    count = len(src)
    cur_len = table.length[src].copy()
    cur_code = table.code[src].copy()
    want_len = table.length[dst]
    want_code = table.code[dst]
    partial = table.partial[src].copy()
    if (table.partial[dst] != 0).any():
        raise ValueError("a consumer never asks for a partial layout")
    width = cur_len.shape[1]
    dims = np.arange(width)
    pair = np.arange(count)
    # the open (not yet closed) fused step of every pair
    open_kind = np.full(count, -1, dtype=np.int64)
    open_dim = np.zeros(count, dtype=np.int64)
    open_mask = np.zeros(count, dtype=np.int64)
    open_shift = np.zeros(count, dtype=np.int64)
    records: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []  # pair, kind, mask, shift

    def close(rows: np.ndarray) -> None:
        """Record the open step of ``rows`` (indices into the active arrays) that have one."""
        rows = rows[open_kind[active[rows]] >= 0]
        if len(rows):
            where = active[rows]
            records.append((where, open_kind[where], open_mask[where], open_shift[where]))

    def step(rows: np.ndarray, kind: np.ndarray, dim: np.ndarray, bit: np.ndarray, shift: np.ndarray) -> None:
        """Add one single-bit step to ``rows``: fuse it into the open step or close that and open it."""
        where = active[rows]
        fuse = (open_kind[where] == kind) & (open_dim[where] == dim) & _MERGEABLE[kind]
        close(rows[~fuse])
        fresh = where[~fuse]
        open_kind[fresh] = kind[~fuse]
        open_dim[fresh] = dim[~fuse]
        open_mask[fresh] = 1 << bit[~fuse]
        open_shift[fresh] = shift[~fuse]
        fused = where[fuse]
        open_mask[fused] |= 1 << bit[fuse]
        open_shift[fused] = np.minimum(open_shift[fused], shift[fuse])

    active = pair.copy()
    while len(active):
        c_len, c_code = cur_len[active], cur_code[active]
        w_len, w_code = want_len[active], want_code[active]
        room = w_len - c_len
        prefix = (room >= 0) & (_drop(w_code, np.maximum(room, 0)) == c_code)
        growing = prefix & (room > 0)
        next_bit = (_drop(w_code, np.maximum(room - 1, 0)) & np.uint64(15)).astype(np.int64)
        total = c_len.sum(axis=1)
        wrong = ~prefix
        any_wrong = wrong.any(axis=1)
        n = len(active)
        rows = np.arange(n)

        # 1. a bit where the target does not want it: AllToAll to the dim that wants it next, else AllGather
        w_rows = rows[any_wrong]
        if len(w_rows):
            d = np.argmax(wrong[w_rows], axis=1)
            bit = (c_code[w_rows, d] & np.uint64(15)).astype(np.int64)
            takes = growing[w_rows] & (next_bit[w_rows] == bit[:, None]) & (dims[None, :] != d[:, None])
            has_target = takes.any(axis=1)
            target = np.argmax(takes, axis=1)
            where = active[w_rows]
            cur_len[where, d] -= 1
            cur_code[where, d] >>= np.uint64(_NIBBLE)
            moved = where[has_target]
            cur_len[moved, target[has_target]] += 1
            cur_code[moved, target[has_target]] = _append(cur_code[moved, target[has_target]], bit[has_target])
            kind = np.where(has_target, _A2A, _AG)
            step(
                w_rows,
                kind,
                np.where(has_target, target, d),
                bit,
                np.where(has_target, total[w_rows], total[w_rows] - 1),
            )

        # 2. every dimension holds a prefix of its target: extend the first one still growing
        g_rows = rows[~any_wrong & growing.any(axis=1)]
        if len(g_rows):
            d = np.argmax(growing[g_rows], axis=1)
            bit = next_bit[g_rows, d]
            where = active[g_rows]
            reduces = (partial[where] >> bit) & 1 == 1
            partial[where[reduces]] &= ~(1 << bit[reduces])
            cur_len[where, d] += 1
            cur_code[where, d] = _append(cur_code[where, d], bit)
            step(g_rows, np.where(reduces, _RS, _SLICE), d, bit, total[g_rows])

        # 3. done: close the open step, then AllReduce whatever is still partial
        f_rows = rows[~any_wrong & ~growing.any(axis=1)]
        if len(f_rows):
            close(f_rows)
            where = active[f_rows]
            reducing = where[partial[where] != 0]
            if len(reducing):
                records.append(
                    (
                        reducing,
                        np.full(len(reducing), _AR),
                        partial[reducing],
                        cur_len[reducing].sum(axis=1),
                    )
                )
            keep = np.ones(n, dtype=bool)
            keep[f_rows] = False
            active = active[keep]
    return _sum_records(records, count, cost)


def _sum_records(
    records: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]], count: int, cost: CostModel
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per pair, the sums of every step's coefficients, in step order (forward, then its dual)."""
    if not records:
        zero = np.zeros(count)
        return zero, zero.copy(), zero.copy(), zero.copy()
    # records were appended round by round; a stable sort by pair keeps each pair's steps in order
    pair = np.concatenate([r[0] for r in records])
    kind = np.concatenate([r[1] for r in records])
    mask = np.concatenate([r[2] for r in records])
    shift = np.concatenate([r[3] for r in records])
    order = np.argsort(pair, kind="stable")
    pair, kind, mask, shift = pair[order], kind[order], mask[order], shift[order]
    dual = np.asarray(_DUAL)[kind]
    latency, per_byte = _collective_table(kind, mask, cost)
    dual_latency, dual_per_byte = _collective_table(np.maximum(dual, 0), mask, cost)
    scale = np.ldexp(1.0, -shift)
    forward_latency = np.bincount(pair, latency, minlength=count)
    forward_per_byte = np.bincount(pair, per_byte * scale, minlength=count)
    # forward and dual interleaved, as the scalar code adds them
    has_dual = dual >= 0
    both_pair = np.stack([pair, pair], axis=1)[np.stack([np.ones_like(has_dual), has_dual], axis=1)]
    both_latency = np.stack([latency, dual_latency], axis=1)[np.stack([np.ones_like(has_dual), has_dual], axis=1)]
    both_per_byte = np.stack([per_byte * scale, dual_per_byte * scale], axis=1)[
        np.stack([np.ones_like(has_dual), has_dual], axis=1)
    ]
    total_latency = np.bincount(both_pair, both_latency, minlength=count)
    total_per_byte = np.bincount(both_pair, both_per_byte, minlength=count)
    return forward_latency, forward_per_byte, total_latency, total_per_byte


def _collective_table(kind: np.ndarray, mask: np.ndarray, cost: CostModel) -> tuple[np.ndarray, np.ndarray]:
    """(latency, per byte) of each (kind, bit mask), each distinct one computed once by the cost model."""
    keys = kind * (1 << 32) + mask
    unique, inverse = np.unique(keys, return_inverse=True)
    latency = np.empty(len(unique))
    per_byte = np.empty(len(unique))
    for index, key in enumerate(unique.tolist()):
        k, m = divmod(key, 1 << 32)
        bits = tuple(b for b in range(m.bit_length() - 1, -1, -1) if (m >> b) & 1)
        latency[index], per_byte[index] = cost.collective_coefficients(KINDS[k], bits)
    return latency[inverse.reshape(-1)], per_byte[inverse.reshape(-1)]
