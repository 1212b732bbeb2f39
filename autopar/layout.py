"""Layouts: the exact meaning of a sharded tensor on N = 2^k devices.

A rank's k bits are the mesh axes (bit 0 is the fastest link). A `Layout` says, for each
tensor dimension, which rank bits split it (most significant first), and which bits hold
partial results still to be reduced. Every other bit replicates. Rank ``p`` holds, on a
dimension split by bits (b1..bm), the shard whose index is the number spelled by p's bits
b1..bm (`shard_index`). That rule is all the verifier and the redistribution planner need.

Layouts are canonical, as JAX's ``PartitionSpec`` and DTensor's placements are: partial bits
are stored in one order (highest first) and a layout with no partial bits always says
``ReduceOp.SUM``, so two layouts that mean the same thing compare equal.

>>> layout = Layout(((2, 1), ()))
>>> layout.shard_index(rank=5, dim=0)   # rank 5 = 0b101: bit 2 is 1, bit 1 is 0 -> shard 0b10
2
>>> layout.local_shape((8, 3))
(2, 3)
>>> Layout(((),), partial=(0, 1)) == Layout(((),), partial=(1, 0))
True
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any


class ReduceOp(enum.StrEnum):
    """How partial values combine: a partial sum, or a partial maximum / minimum."""

    SUM = "sum"
    MAX = "max"
    MIN = "min"


def shard_index(rank: int, bits: Sequence[int]) -> int:
    """The number that ``rank``'s ``bits`` spell, most significant first.

    It is both the shard of a dimension split by ``bits`` that the rank holds and the rank's
    position in the group of ranks that differ only in ``bits``.

    >>> shard_index(0b110, (2, 0))
    2
    """
    index = 0
    for bit in bits:
        index = (index << 1) | ((rank >> bit) & 1)
    return index


def _check_bit(bit: Any) -> int:
    if isinstance(bit, bool) or not isinstance(bit, int) or bit < 0:
        raise ValueError(f"a mesh bit must be a non-negative integer, got {bit!r}")
    return bit


def _checked(bits: Iterable[Any]) -> tuple[int, ...]:
    """``bits`` as a tuple, each a mesh bit (`_check_bit`)."""
    found = tuple(bits)
    for bit in found:
        if type(bit) is not int or bit < 0:
            _check_bit(bit)
    return found


@dataclass(frozen=True, order=True)
class Layout:
    """Bits splitting each dimension (MSB first), plus bits over which values are partial."""

    dims: tuple[tuple[int, ...], ...]
    partial: tuple[int, ...] = ()
    partial_op: ReduceOp = ReduceOp.SUM

    def __post_init__(self) -> None:
        # (the hottest constructor of a large plan: the checks are `_checked`'s, each bit's type asked directly)
        dims = tuple(map(_checked, self.dims))
        partial = tuple(sorted(_checked(self.partial), reverse=True))
        op = self.partial_op
        if type(op) is not ReduceOp:
            try:
                op = ReduceOp(op)
            except ValueError:
                raise ValueError(f"unknown reduce op {self.partial_op!r} (sum, max or min)") from None
        if not partial:
            op = ReduceOp.SUM  # nothing is partial: one spelling for every replicated layout
        object.__setattr__(self, "dims", dims)
        object.__setattr__(self, "partial", partial)
        object.__setattr__(self, "partial_op", op)
        used = [b for bits in dims for b in bits] + list(partial)
        if len(used) != len(set(used)):
            raise ValueError(f"a mesh bit is used twice in layout {self.describe()}")

    @staticmethod
    def replicated(ndim: int) -> "Layout":
        return Layout(tuple(() for _ in range(ndim)))

    @property
    def ndim(self) -> int:
        """The tensor's number of dimensions."""
        return len(self.dims)

    @property
    def used_bits(self) -> frozenset[int]:
        return frozenset(b for bits in self.dims for b in bits) | frozenset(self.partial)

    @property
    def split_bits(self) -> frozenset[int]:
        return frozenset(b for bits in self.dims for b in bits)

    def replicated_bits(self, mesh_bits: int) -> tuple[int, ...]:
        return tuple(b for b in range(mesh_bits) if b not in self.used_bits)

    def split(self, dim: int) -> int:
        """How many shards dimension ``dim`` is cut into."""
        return 1 << len(self.dims[dim])

    @property
    def num_shards(self) -> int:
        return 1 << len(self.split_bits)

    def local_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        return tuple(size // self.split(d) for d, size in enumerate(shape))

    def local_numel(self, shape: Sequence[int]) -> int:
        return math.prod(self.local_shape(shape))

    def shard_index(self, rank: int, dim: int) -> int:
        """Which shard of dimension ``dim`` device ``rank`` holds."""
        return shard_index(rank, self.dims[dim])

    def local_slices(self, rank: int, shape: Sequence[int]) -> tuple[slice, ...]:
        """The region of the full tensor that ``rank`` holds."""
        slices = []
        for dim, size in enumerate(shape):
            chunk = size // self.split(dim)
            start = self.shard_index(rank, dim) * chunk
            slices.append(slice(start, start + chunk))
        return tuple(slices)

    def describe(self) -> str:
        """Compact text: ``[b2b1,-]`` splits dim 0 by bits 2 and 1; partial bits follow.

        >>> Layout(((2, 1), ()), partial=(0,)).describe()
        '[b2b1,-] partial(sum) over b0'
        """
        parts = ["b" + "b".join(str(b) for b in bits) if bits else "-" for bits in self.dims]
        text = "[" + ",".join(parts) + "]"
        if self.partial:
            text += f" partial({self.partial_op}) over b" + "b".join(str(b) for b in self.partial)
        return text

    def to_dict(self) -> dict[str, Any]:
        """The plan file's form: ``dims``, and ``partial`` / ``partial_op`` only when partial."""
        out: dict[str, Any] = {"dims": [list(bits) for bits in self.dims]}
        if self.partial:
            out["partial"] = list(self.partial)
            out["partial_op"] = str(self.partial_op)
        return out

    @staticmethod
    def from_dict(data: dict[str, Any]) -> "Layout":
        return Layout(
            tuple(tuple(bits) for bits in data["dims"]),
            tuple(data.get("partial", ())),
            ReduceOp(data.get("partial_op", "sum")),
        )

    def to_mindspore(self, mesh_bits: int) -> tuple[list[int], list[int | tuple[int, ...]]]:
        """MindSpore's (dev_matrix, tensor_map): one device-matrix axis of size 2 per mesh bit.

        MindSpore numbers device-matrix axes from the right, so axis i is mesh bit i and a
        dimension's tensor_map entry is its bits (-1 when it is not split).
        """
        dev_matrix = [2] * mesh_bits
        tensor_map: list[int | tuple[int, ...]] = []
        for bits in self.dims:
            if not bits:
                tensor_map.append(-1)
            elif len(bits) == 1:
                tensor_map.append(bits[0])
            else:
                tensor_map.append(tuple(bits))
        return dev_matrix, tensor_map


def mesh_bits_for(num_devices: int) -> int:
    """log2 of the device count; the caller has checked it is a power of two."""
    return num_devices.bit_length() - 1


def is_power_of_two(value: int) -> bool:
    return value >= 1 and (value & (value - 1)) == 0
