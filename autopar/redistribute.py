"""Redistribution: turn one layout into another as a sequence of collective steps.

A target may be partial (a gradient a fork takes partial, `autopar.ops.fork`): bits the source is
partial over too are left as they are, the others reduced; over its partial bits the source is whole
on, the steps leave it whole, and `as_partial` makes it partial with no communication.

The planner works bit by bit (DESIGN.md's table): a bit that splits a dimension in the source
but not (at that position) in the target is gathered, or moved to another dimension by an
AllToAll when the target wants it there next; partial bits become a ReduceScatter when the
target splits a dimension by them next, otherwise an AllReduce; a bit the target splits by
that the source replicates is a local Slice. Each step is exact under the layout rule, so
the verifier can carry the steps out literally.

>>> steps = redistribute(Layout(((0,), ())), Layout(((), (0,))), shape=(4, 4), itemsize=2)
>>> [(str(s.kind), s.bits, s.nbytes) for s in steps]
[('AllToAll', (0,), 16)]

A run of bits moves in one AllToAll when the target wants the whole run next, in the same order:
GShard's expert parallelism turns tokens split by batch, [e, b, c, h] on bits (2, 1, 0) of b, into
tokens split by expert, the same bits on e, and one AllToAll over the 8 ranks does it. One bit at a
time it cannot be done (the last bit, 0, is not the one e wants first), so it would be an AllGather
over bits 1 and 0, an AllToAll over bit 2 and a Slice: nearly six times the bytes on the wire.

>>> steps = redistribute(Layout(((), (2, 1, 0))), Layout(((2, 1, 0), ())), shape=(8, 8), itemsize=2)
>>> [(str(s.kind), s.bits, s.nbytes, s.dim, s.concat_dim) for s in steps]
[('AllToAll', (2, 1, 0), 16, 0, 1)]
"""

from __future__ import annotations

import enum
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from autopar.layout import Layout, ReduceOp


class Collective(enum.StrEnum):
    """The steps a redistribution is made of: four collectives and the local Slice."""

    ALL_GATHER = "AllGather"
    REDUCE_SCATTER = "ReduceScatter"
    ALL_TO_ALL = "AllToAll"
    ALL_REDUCE = "AllReduce"
    SLICE = "Slice"


# (kind, bits, shift, dim, concat_dim, reduce op): a step before the tensor's size is known
SymbolicStep = tuple[Collective, tuple[int, ...], int, int | None, int | None, ReduceOp]


@dataclass(frozen=True)
class Step:
    """One collective (or local slice) over the group of ranks that differ only in ``bits``.

    ``dim`` is the dimension gathered (AllGather), sliced (Slice), scattered (ReduceScatter) or
    newly split (AllToAll); ``concat_dim`` is the dimension an AllToAll un-splits. ``nbytes`` is
    the per-rank payload: the gathered output for AllGather, the input for ReduceScatter and
    Slice, the local buffer for AllReduce and AllToAll.
    """

    kind: Collective
    bits: tuple[int, ...]
    nbytes: int
    dim: int | None = None
    concat_dim: int | None = None
    reduce_op: ReduceOp = ReduceOp.SUM

    @property
    def group_size(self) -> int:
        return 1 << len(self.bits)

    @property
    def reduces(self) -> bool:
        return self.kind in (Collective.ALL_REDUCE, Collective.REDUCE_SCATTER)

    def to_dict(self) -> dict[str, Any]:
        """The plan file's form: ``dim``, ``concat_dim`` and ``reduce_op`` only where they apply."""
        out: dict[str, Any] = {
            "collective": str(self.kind),
            "group_size": self.group_size,
            "bits": list(self.bits),
            "bytes": self.nbytes,
        }
        if self.dim is not None:
            out["dim"] = self.dim
        if self.concat_dim is not None:
            out["concat_dim"] = self.concat_dim
        if self.reduces:
            out["reduce_op"] = str(self.reduce_op)
        return out

    @staticmethod
    def from_dict(data: dict[str, Any]) -> "Step":
        return Step(
            Collective(data["collective"]),
            tuple(data["bits"]),
            int(data["bytes"]),
            data.get("dim"),
            data.get("concat_dim"),
            ReduceOp(data.get("reduce_op", "sum")),
        )


def redistribute(src: Layout, dst: Layout, shape: Sequence[int], itemsize: int) -> tuple[Step, ...]:
    """Steps that turn a tensor held in ``src`` into ``dst``; empty when they already agree."""
    if src.ndim != dst.ndim or src.ndim != len(shape):
        raise ValueError(f"layouts of {src.ndim}/{dst.ndim} dimensions do not match shape {tuple(shape)}")
    total = math.prod(shape) * itemsize
    return tuple(
        Step(kind, bits, total >> shift, dim, concat_dim, op)
        for kind, bits, shift, dim, concat_dim, op in symbolic_steps(src, dst)
    )


@functools.lru_cache(maxsize=1 << 16)
def symbolic_steps(src: Layout, dst: Layout) -> tuple[SymbolicStep, ...]:
    """Shape-free steps: (kind, bits, shift, dim, concat_dim, reduce_op), payload = total bytes >> shift."""
    kept = set(dst.partial) & set(src.partial)
    if dst.partial and dst.partial_op != ReduceOp.SUM:
        raise ValueError("only a gradient (a sum) is redistributed to a partial layout")
    current = [list(bits) for bits in src.dims]
    partial = [bit for bit in src.partial if bit not in kept]
    raw: list[SymbolicStep] = []

    def shift() -> int:
        return sum(len(bits) for bits in current)

    ndim = len(current)
    while True:
        # 1. Drop every bit that sits where the target does not want it, last bit first.
        wrong = [d for d in range(ndim) if tuple(current[d]) != dst.dims[d][: len(current[d])]]
        if wrong:
            dim = wrong[0]
            bit = current[dim][-1]
            moving = _moving_run(current, dst.dims, dim)
            if moving is not None:
                target, count = moving
                size = shift()
                run = tuple(current[dim][-count:])
                del current[dim][-count:]
                current[target].extend(run)
                raw.append((Collective.ALL_TO_ALL, run, size, target, dim, ReduceOp.SUM))
            else:
                current[dim].pop()
                raw.append((Collective.ALL_GATHER, (bit,), shift(), dim, None, ReduceOp.SUM))
            continue
        # 2. Every dimension now holds a prefix of its target bits: extend them in order.
        growing = [d for d in range(ndim) if len(current[d]) < len(dst.dims[d])]
        if growing:
            dim = growing[0]
            bit = dst.dims[dim][len(current[dim])]
            size = shift()
            if bit in partial:
                partial.remove(bit)
                raw.append((Collective.REDUCE_SCATTER, (bit,), size, dim, None, src.partial_op))
            else:
                raw.append((Collective.SLICE, (bit,), size, dim, None, ReduceOp.SUM))
            current[dim].append(bit)
            continue
        break
    if partial:
        raw.append((Collective.ALL_REDUCE, tuple(sorted(partial, reverse=True)), shift(), None, None, src.partial_op))
    return _merge(raw)


def _moving_run(
    current: Sequence[Sequence[int]], wanted: Sequence[tuple[int, ...]], dim: int
) -> tuple[int, int] | None:
    """(target dim, how many bits) of the run of ``dim``'s last bits that another dim wants next, in that
    order; None when there is none (the last bit is gathered).

    The run ends with ``dim``'s last bit, so the place the target gives that bit fixes the run: the dim
    that holds it (a bit splits one dim at most) must hold a prefix of its own target, the bits of the run
    next. The run's bits are not ``dim``'s to keep (the target puts them elsewhere). One AllToAll over m
    bits moves each rank's buffer once, (2^m - 1) / 2^m of it over the wire; a run that only fits whole
    (the target wants its first bit first, the source drops its last bit first) would otherwise be
    gathered and sliced again. The run is taken wherever there is one, which is not always the cheaper
    route: an AllToAll's latency grows with its group, so for small tensors the bit-at-a-time route can
    be quicker, and a run across link levels pays the slow level's rate on more of the bytes. Choosing
    per tensor would take two routes' costs per layout pair, where the search keeps one.

    >>> _moving_run([[], [2, 1, 0]], [(2, 1, 0), ()], 1)
    (0, 3)
    >>> _moving_run([[], [2, 1, 0]], [(0, 1, 2), ()], 1)   # the reverse order: one bit at a time
    (0, 1)
    >>> _moving_run([[2, 1, 0], []], [(2,), ()], 0) is None   # nobody wants bit 0: gathered
    True
    """
    held = tuple(current[dim])
    last = held[-1]
    target = next((e for e, want in enumerate(wanted) if last in want), None)
    if target is None or target == dim:
        return None
    want, have = wanted[target], len(current[target])
    count = want.index(last) + 1 - have
    if count < 1 or count > len(held) or tuple(current[target]) != want[:have]:
        return None
    return (target, count) if want[have : have + count] == held[-count:] else None


def _merge(steps: list[SymbolicStep]) -> tuple[SymbolicStep, ...]:
    """Fuse consecutive steps of one kind on one dimension into a single collective over more bits."""
    merged: list[SymbolicStep] = []
    for step in steps:
        kind, bits, size, dim, _, op = step
        if (
            merged
            and merged[-1][0] == kind
            and merged[-1][3] == dim
            and kind in (Collective.ALL_GATHER, Collective.SLICE, Collective.REDUCE_SCATTER)
        ):
            last = merged[-1]
            if kind == Collective.ALL_GATHER:
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

    >>> apply_steps(Layout(((1, 0), ())), [Step(Collective.ALL_GATHER, (0,), 64, dim=0)]).describe()
    '[b1,-]'
    """
    dims = [list(bits) for bits in layout.dims]
    partial = list(layout.partial)

    def dimension(index: int | None, role: str) -> list[int]:
        if index is None or not 0 <= index < len(dims):
            raise ValueError(f"{step.kind} names {role} {index}, but the tensor has {len(dims)} dimensions")
        return dims[index]

    for step in steps:
        bits = list(step.bits)
        if not bits:
            raise ValueError(f"{step.kind} over no mesh bits")
        if step.kind == Collective.ALL_GATHER:
            held = dimension(step.dim, "dim")
            if held[-len(bits) :] != bits:
                raise ValueError(f"AllGather over {bits} does not match dim bits {held}")
            del held[-len(bits) :]
        elif step.kind == Collective.SLICE:
            if any(b in partial or any(b in d for d in dims) for b in bits):
                raise ValueError(f"Slice over bits {bits} that are already in use")
            dimension(step.dim, "dim").extend(bits)
        elif step.kind == Collective.ALL_TO_ALL:
            source = dimension(step.concat_dim, "concat_dim")
            target = dimension(step.dim, "dim")
            if source[-len(bits) :] != bits:
                raise ValueError(f"AllToAll over {bits} does not match dim bits {source}")
            del source[-len(bits) :]
            target.extend(bits)
        elif step.reduces:
            if any(b not in partial for b in bits):
                raise ValueError(f"{step.kind} over bits {bits} that are not partial")
            for b in bits:
                partial.remove(b)
            if step.kind == Collective.REDUCE_SCATTER:
                dimension(step.dim, "dim").extend(bits)
        else:
            raise ValueError(f"unknown collective {step.kind!r}")
    return Layout(tuple(tuple(d) for d in dims), tuple(partial), layout.partial_op)


def as_partial(reached: Layout, target: Layout) -> tuple[int, ...]:
    """The bits over which a gradient that ``reached`` a layout is whole where ``target`` wants it partial
    (a sum): each rank with any of them set zeroes its buffer, so the group's sum is the value once.
    ValueError when no such local step leads from one layout to the other.

    >>> as_partial(Layout(((1,), ())), Layout(((1,), ()), (0,)))
    (0,)
    """
    extra = tuple(bit for bit in target.partial if bit not in reached.partial)
    if reached.dims != target.dims or any(bit not in target.partial for bit in reached.partial):
        raise ValueError(f"{reached.describe()} is not {target.describe()} less some partial bits")
    if extra and target.partial_op != ReduceOp.SUM:
        raise ValueError(f"a {target.partial_op} is never made partial locally")
    return extra
