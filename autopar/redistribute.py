"""Redistribution: turn one layout into another as a sequence of collective steps.

The planner works bit by bit (DESIGN.md's table): a bit that splits a dimension in the source
but not (at that position) in the target is gathered, or moved to another dimension by an
AllToAll when the target wants it there next; partial bits become a ReduceScatter when the
target splits a dimension by them next, otherwise an AllReduce; a bit the target splits by
that the source replicates is a local Slice. Each step is exact under the layout rule, so
the verifier can carry the steps out literally.

>>> steps = redistribute(Layout(((0,), ())), Layout(((), (0,))), shape=(4, 4), itemsize=2)
>>> [(s.kind, s.bits, s.nbytes) for s in steps]
[('AllToAll', (0,), 16)]
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Sequence

from autopar.layout import Layout

# Backward of each forward step: the gradient travels the other way with the dual collective.
BACKWARD_DUAL = {
    "AllGather": "ReduceScatter",
    "ReduceScatter": "AllGather",
    "Slice": "AllGather",
    "AllToAll": "AllToAll",
    "AllReduce": None,  # the gradient of a reduced-then-replicated value is already replicated
}


@dataclass(frozen=True)
class Step:
    """One collective (or local slice) over the group of ranks that differ only in ``bits``.

    ``dim`` is the dimension gathered (AllGather), sliced (Slice), scattered (ReduceScatter) or
    newly split (AllToAll); ``concat_dim`` is the dimension an AllToAll un-splits. ``nbytes`` is
    the per-rank payload: the gathered output for AllGather, the input for ReduceScatter and
    Slice, the local buffer for AllReduce and AllToAll.
    """

    kind: str
    bits: tuple[int, ...]
    nbytes: int
    dim: int | None = None
    concat_dim: int | None = None
    reduce_op: str = "sum"

    @property
    def group_size(self) -> int:
        return 1 << len(self.bits)

    def to_dict(self) -> dict:
        out = {"collective": self.kind, "group_size": self.group_size, "bits": list(self.bits), "bytes": self.nbytes}
        if self.dim is not None:
            out["dim"] = self.dim
        if self.concat_dim is not None:
            out["concat_dim"] = self.concat_dim
        if self.kind in ("AllReduce", "ReduceScatter"):
            out["reduce_op"] = self.reduce_op
        return out

    @staticmethod
    def from_dict(data: dict) -> "Step":
        return Step(data["collective"], tuple(data["bits"]), int(data["bytes"]), data.get("dim"),
                    data.get("concat_dim"), data.get("reduce_op", "sum"))


def redistribute(src: Layout, dst: Layout, shape: Sequence[int], itemsize: int) -> tuple[Step, ...]:
    """Steps that turn a tensor held in ``src`` into ``dst``; empty when they already agree."""
    if src.rank != dst.rank or src.rank != len(shape):
        raise ValueError(f"layout ranks {src.rank}/{dst.rank} do not match shape {tuple(shape)}")
    total = math.prod(shape) * itemsize
    return tuple(Step(kind, bits, total >> shift, dim, concat_dim, op)
                 for kind, bits, shift, dim, concat_dim, op in symbolic_steps(src, dst))


@functools.lru_cache(maxsize=1 << 16)
def symbolic_steps(src: Layout, dst: Layout) -> tuple[tuple, ...]:
    """Shape-free steps: (kind, bits, shift, dim, concat_dim, reduce_op), payload = total bytes >> shift."""
    if dst.partial:
        raise ValueError("a consumer never asks for a partial layout")
    current = [list(bits) for bits in src.dims]
    partial = list(src.partial)
    raw: list[tuple] = []

    def shift() -> int:
        return sum(len(bits) for bits in current)

    def is_next_bit(dim: int, bit: int) -> bool:
        want = dst.dims[dim]
        have = len(current[dim])
        return tuple(current[dim]) == want[:have] and len(want) > have and want[have] == bit

    rank = len(current)
    while True:
        # 1. Drop every bit that sits where the target does not want it, last bit first.
        wrong = [d for d in range(rank) if tuple(current[d]) != dst.dims[d][: len(current[d])]]
        if wrong:
            dim = wrong[0]
            bit = current[dim][-1]
            target = next((e for e in range(rank) if e != dim and is_next_bit(e, bit)), None)
            if target is not None:
                size = shift()
                current[dim].pop()
                current[target].append(bit)
                raw.append(("AllToAll", (bit,), size, target, dim, "sum"))
            else:
                current[dim].pop()
                raw.append(("AllGather", (bit,), shift(), dim, None, "sum"))
            continue
        # 2. Every dimension now holds a prefix of its target bits: extend them in order.
        growing = [d for d in range(rank) if len(current[d]) < len(dst.dims[d])]
        if growing:
            dim = growing[0]
            bit = dst.dims[dim][len(current[dim])]
            size = shift()
            if bit in partial:
                partial.remove(bit)
                raw.append(("ReduceScatter", (bit,), size, dim, None, src.partial_op))
            else:
                raw.append(("Slice", (bit,), size, dim, None, "sum"))
            current[dim].append(bit)
            continue
        break
    if partial:
        raw.append(("AllReduce", tuple(sorted(partial, reverse=True)), shift(), None, None, src.partial_op))
    return _merge(raw)


def _merge(steps: list[tuple]) -> tuple[tuple, ...]:
    """Fuse consecutive steps of one kind on one dimension into a single collective over more bits."""
    merged: list[tuple] = []
    for step in steps:
        kind, bits, size, dim, concat_dim, op = step
        if merged and merged[-1][0] == kind and merged[-1][3] == dim and kind in ("AllGather", "Slice",
                                                                                 "ReduceScatter"):
            last = merged[-1]
            if kind == "AllGather":
                # gathered last bit first: the fused group spells the shard index MSB first
                merged[-1] = (kind, bits + last[1], size, dim, None, op)
            else:
                merged[-1] = (kind, last[1] + bits, last[2], dim, None, op)
            continue
        merged.append(step)
    return tuple(merged)


def apply_steps(layout: Layout, steps: Sequence[Step]) -> Layout:
    """The layout a tensor has after ``steps``; ValueError if a step does not fit the layout.

    Used to check a plan (or a plan file someone edited) without touching any data.
    """
    dims = [list(bits) for bits in layout.dims]
    partial = list(layout.partial)
    for step in steps:
        bits = list(step.bits)
        if step.kind == "AllGather":
            if step.dim is None or dims[step.dim][-len(bits):] != bits:
                raise ValueError(f"AllGather over {bits} does not match dim bits {dims[step.dim or 0]}")
            del dims[step.dim][-len(bits):]
        elif step.kind == "Slice":
            if any(b in partial or any(b in d for d in dims) for b in bits):
                raise ValueError(f"Slice over bits {bits} that are already in use")
            dims[step.dim].extend(bits)
        elif step.kind == "AllToAll":
            if step.concat_dim is None or dims[step.concat_dim][-len(bits):] != bits:
                raise ValueError(f"AllToAll over {bits} does not match dim bits {dims[step.concat_dim or 0]}")
            del dims[step.concat_dim][-len(bits):]
            dims[step.dim].extend(bits)
        elif step.kind in ("ReduceScatter", "AllReduce"):
            if any(b not in partial for b in bits):
                raise ValueError(f"{step.kind} over bits {bits} that are not partial")
            for b in bits:
                partial.remove(b)
            if step.kind == "ReduceScatter":
                dims[step.dim].extend(bits)
        else:
            raise ValueError(f"unknown collective {step.kind!r}")
    return Layout(tuple(tuple(d) for d in dims), tuple(partial), layout.partial_op if partial else "sum")
