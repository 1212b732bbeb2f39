"""The mesh both framework exports build: the plan's logical axes (`autopar.lowering.axes`), refined per tensor.

A tensor's placements need one role per mesh dimension: all of a dimension's bits split the same tensor
dimension (as a contiguous run of that dimension's bits, in the same order), or all hold partial values,
or none is used. Most tensors of a plan meet that on the logical axes themselves (``data``, ``tensor``,
...). Where a tensor uses part of an axis, or its bits in another order, `tensor_groups` splits that axis
into runs of one role each, named after the axis and their bits (``data_b4_b3``, ``data_b2``): a mesh of
the same devices with one axis cut in two. Every group's coordinate is the number a rank's bits spell in
the group's order, so every mesh built from groups holds the devices in autopar's exact order.

DTensor shards a tensor dimension over several mesh dimensions left to right (the leftmost major), so with
``ordered`` the groups that split one dimension are also put in that dimension's order (a permuted mesh
of the same devices); a JAX PartitionSpec names them major first itself, whatever the mesh's order.

>>> from autopar.layout import Layout
>>> from autopar.lowering.axes import LogicalAxis
>>> axes = (LogicalAxis("data", (2, 1)), LogicalAxis("tensor", (0,)))
>>> tensor_groups(Layout(((2, 1), (0,))), axes)
(('data', (2, 1)), ('tensor', (0,)))
>>> tensor_groups(Layout(((2,), (0,)), partial=(1,)), axes)
(('data_b2', (2,)), ('data_b1', (1,)), ('tensor', (0,)))
>>> tensor_groups(Layout(((0, 2, 1),)), axes, ordered=True)   # bit 0 major: the tensor axis first
(('tensor', (0,)), ('data', (2, 1)))
"""

from __future__ import annotations

from collections.abc import Sequence

from autopar.cost.mesh import Mesh
from autopar.layout import Layout
from autopar.lowering.axes import LogicalAxis

SINGLE = "single"  # the one axis of a one-device mesh
Group = tuple[str, tuple[int, ...]]  # a mesh dimension: its name and its bits, major first


def _role(layout: Layout, bit: int) -> tuple[str, int, int]:
    """("dim", d, position of the bit among d's bits), ("partial", 0, 0) or ("replicate", 0, 0)."""
    for dim, bits in enumerate(layout.dims):
        if bit in bits:
            return "dim", dim, bits.index(bit)
    return ("partial", 0, 0) if bit in layout.partial else ("replicate", 0, 0)


def tensor_groups(layout: Layout, axes: Sequence[LogicalAxis], *, ordered: bool = False) -> tuple[Group, ...]:
    """The mesh dimensions a tensor of ``layout`` is placed on: the logical axes, each cut into runs of one
    role where the tensor needs it; with ``ordered``, the runs splitting one tensor dimension in its order."""
    if not axes:
        return ((SINGLE, ()),)
    groups: list[Group] = []
    for axis in axes:
        runs: list[list[int]] = []
        previous: tuple[str, int, int] | None = None
        for bit in axis.bits:
            role = _role(layout, bit)
            follows = (
                previous is not None and role[:2] == previous[:2] and (role[0] != "dim" or role[2] == previous[2] + 1)
            )
            if follows:
                runs[-1].append(bit)
            else:
                runs.append([bit])
            previous = role
        if len(runs) == 1:
            groups.append((axis.name, axis.bits))
        else:
            groups += [(axis.name + "_" + "_".join(f"b{bit}" for bit in run), tuple(run)) for run in runs]
    if ordered:
        for bits in layout.dims:
            mine = sorted((bits.index(group[1][0]), k) for k, group in enumerate(groups) if group[1][0] in bits)
            positions = sorted(k for _, k in mine)
            chosen = [groups[k] for _, k in mine]
            for position, group in zip(positions, chosen):
                groups[position] = group
    return tuple(groups)


def placement_kinds(layout: Layout, groups: Sequence[Group]) -> list[tuple[str, int]]:
    """Per group: ("shard", d), ("partial", 0) or ("replicate", 0)."""
    out = []
    for _, bits in groups:
        role = _role(layout, bits[0]) if bits else ("replicate", 0, 0)
        out.append(("shard", role[1]) if role[0] == "dim" else (role[0], 0))
    return out


def axis_links(mesh: Mesh, groups: Sequence[Group]) -> str:
    """Dict-literal source: each group's name -> the links its bits cross, fastest first ("HCCS+PCIe")."""
    link_of = mesh.link_names()
    entries = []
    for name, bits in groups:
        names: list[str] = []
        for bit in sorted(bits):
            if link_of.get(bit, "?") not in names:
                names.append(link_of.get(bit, "?"))
        entries.append(f"{name!r}: {'+'.join(names) or 'none'!r}")
    return ", ".join(entries)


def logical_groups(axes: Sequence[LogicalAxis]) -> tuple[Group, ...]:
    """The logical mesh itself: one group per axis (one-device plans: the single axis)."""
    return tuple((axis.name, axis.bits) for axis in axes) or ((SINGLE, ()),)


__all__ = ["SINGLE", "Group", "axis_links", "logical_groups", "placement_kinds", "tensor_groups"]
