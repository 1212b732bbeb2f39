"""The plan's mesh bits grouped into named logical axes (data, sequence, tensor), as users name a mesh.

Users write ``init_device_mesh("cuda", (8, 8), mesh_dim_names=("data", "tensor"))`` or
``PartitionSpec("data", "tensor")``, not one dimension of size 2 per mesh bit. `logical_axes` gives each
bit the role it plays in the plan (`autopar.lowering.decisions.bit_roles`: the batch -> data, a sequence
-> sequence, anything else -> tensor; a bit no operator uses -> replicated, its devices repeating one
another's work) and groups the bits of a role into one axis, its bits highest first: an axis's
coordinate is the number a rank's bits spell in that order, so the devices keep autopar's exact order
(rank r's bit b is (r >> b) & 1), whatever bits an axis holds. Axes come in the order of their highest
bit (the slowest links first), so a plan whose roles take contiguous bits is a plain row-major mesh.

A pipelined plan's stage bits (the slowest) form the ``pipeline`` axis.

>>> axis = LogicalAxis("data", (5, 4, 3))
>>> axis.size, axis.coordinate(0b101000)
(8, 5)
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.lowering.decisions import bit_roles
from autopar.lowering.planfile import PlanFile

ROLES = ("pipeline", "data", "sequence", "tensor", "replicated")


@dataclass(frozen=True)
class LogicalAxis:
    """A named mesh axis: the mesh bits it holds, highest (major) first; ``2 ** len(bits)`` devices long."""

    name: str
    bits: tuple[int, ...]

    @property
    def size(self) -> int:
        return 1 << len(self.bits)

    def coordinate(self, rank: int) -> int:
        """Where ``rank`` sits along this axis: the number its bits spell, major first."""
        index = 0
        for bit in self.bits:
            index = (index << 1) | ((rank >> bit) & 1)
        return index


def logical_axes(plan: PlanFile) -> tuple[LogicalAxis, ...]:
    """The plan's mesh bits grouped by role into named axes, the axis with the highest bit first (no bits: ())."""
    roles = bit_roles(plan)
    if plan.pipeline is not None:
        roles.update(dict.fromkeys(plan.pipeline.bits, "pipeline"))
    grouped: dict[str, list[int]] = {}
    for bit in range(plan.mesh_bits - 1, -1, -1):
        grouped.setdefault(roles.get(bit, "replicated"), []).append(bit)
    axes = [LogicalAxis(role, tuple(bits)) for role, bits in grouped.items()]
    return tuple(sorted(axes, key=lambda axis: (-axis.bits[0], ROLES.index(axis.name))))


__all__ = ["ROLES", "LogicalAxis", "logical_axes"]
