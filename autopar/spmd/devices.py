"""Virtual devices: rank buffers for a layout, and collectives carried out on them literally.

This is the executable meaning of `Layout` and `Step`: `shard` gives each rank exactly the
slice the layout says it holds, `run_step` moves data only between the ranks of each
collective's group, and `assemble` checks the ranks agree and rebuilds the full tensor.
Nothing here ever reads the full tensor behind a collective's back.

>>> import numpy as np
>>> from autopar.layout import Layout
>>> full = np.arange(8.0).reshape(4, 2)
>>> ranks = shard(full, Layout(((1, 0), ())), mesh_bits=2)
>>> [r.ravel().tolist() for r in ranks]
[[0.0, 1.0], [2.0, 3.0], [4.0, 5.0], [6.0, 7.0]]
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from autopar.layout import Layout, ReduceOp, shard_index
from autopar.redistribute import Collective, Step

_REDUCE = {ReduceOp.SUM: np.add, ReduceOp.MAX: np.maximum, ReduceOp.MIN: np.minimum}


def group_of(rank: int, bits: Sequence[int]) -> list[int]:
    """Ranks that differ from ``rank`` only in ``bits``, ordered by the index those bits spell."""
    base = rank
    for bit in bits:
        base &= ~(1 << bit)
    members = []
    for index in range(1 << len(bits)):
        member = base
        for position, bit in enumerate(bits):
            if (index >> (len(bits) - 1 - position)) & 1:
                member |= 1 << bit
        members.append(member)
    return members


def shard(full: np.ndarray, layout: Layout, mesh_bits: int, rng: np.random.Generator | None = None) -> list[np.ndarray]:
    """Each rank's buffer under ``layout``. Partial layouts get random pieces that reduce to the truth."""
    ranks = 1 << mesh_bits
    buffers = [np.array(full[layout.local_slices(rank, full.shape)], copy=True) for rank in range(ranks)]
    if not layout.partial:
        return buffers
    rng = rng or np.random.default_rng(0)
    for rank in range(ranks):
        if shard_index(rank, layout.partial) == 0:
            continue
        noise = rng.standard_normal(buffers[rank].shape).astype(full.dtype)
        if layout.partial_op == ReduceOp.SUM:
            buffers[rank] = noise
        else:  # max/min: the other ranks hold values no closer than the truth
            sign = -1.0 if layout.partial_op == ReduceOp.MAX else 1.0
            buffers[rank] = buffers[rank] + sign * np.abs(noise)
    if layout.partial_op == ReduceOp.SUM:
        for rank in range(ranks):
            if shard_index(rank, layout.partial) == 0:
                others = [buffers[q] for q in group_of(rank, layout.partial) if q != rank]
                buffers[rank] = buffers[rank] - np.sum(others, axis=0)
    return buffers


def run_step(buffers: list[np.ndarray], step: Step) -> list[np.ndarray]:
    """Carry out one collective (or local slice) on every rank's buffer."""
    bits = step.bits
    size = 1 << len(bits)
    if step.dim is None and step.kind != Collective.ALL_REDUCE:
        raise ValueError(f"{step.kind} needs a dim")
    dim = step.dim if step.dim is not None else 0  # an AllReduce has none and needs none
    result: list[np.ndarray] = []
    for rank in range(len(buffers)):
        group = group_of(rank, bits)
        me = shard_index(rank, bits)
        if step.kind == Collective.ALL_GATHER:
            result.append(np.concatenate([buffers[q] for q in group], axis=dim))
        elif step.kind == Collective.SLICE:
            result.append(np.split(buffers[rank], size, axis=dim)[me].copy())
        elif step.kind == Collective.ALL_REDUCE:
            result.append(_reduce([buffers[q] for q in group], step.reduce_op))
        elif step.kind == Collective.REDUCE_SCATTER:
            reduced = _reduce([buffers[q] for q in group], step.reduce_op)
            result.append(np.split(reduced, size, axis=dim)[me].copy())
        elif step.kind == Collective.ALL_TO_ALL:
            pieces = [np.split(buffers[q], size, axis=dim)[me] for q in group]
            if step.concat_dim is None:
                raise ValueError("AllToAll needs a concat_dim")
            result.append(np.concatenate(pieces, axis=step.concat_dim))
        else:
            raise ValueError(f"unknown collective {step.kind!r}")
    return result


def _reduce(parts: list[np.ndarray], op: ReduceOp) -> np.ndarray:
    out = np.array(parts[0], copy=True)
    for part in parts[1:]:
        out = _REDUCE[op](out, part)
    return out


def assemble(buffers: list[np.ndarray], layout: Layout, shape: Sequence[int]) -> np.ndarray:
    """The full tensor from rank buffers of a non-partial layout; raises if replicas disagree."""
    if layout.partial:
        raise ValueError("reduce partial bits before assembling")
    full = np.zeros(tuple(shape), dtype=buffers[0].dtype)
    seen = np.zeros(tuple(shape), dtype=bool)
    for rank, buffer in enumerate(buffers):
        region = layout.local_slices(rank, shape)
        if buffer.shape != full[region].shape:
            raise ValueError(f"rank {rank} holds shape {buffer.shape}, layout says {full[region].shape}")
        if seen[region].all() and not np.allclose(full[region], buffer, rtol=1e-5, atol=1e-6):
            raise ValueError(f"rank {rank} disagrees with its replicas")
        full[region] = buffer
        seen[region] = True
    return full
