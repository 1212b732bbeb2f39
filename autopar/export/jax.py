"""The ``jax`` export: a Python module with the plan's `jax.sharding.Mesh` and a PartitionSpec per tensor.

`write` makes one readable module (``{model}_jax.py`` by default) holding the mesh (`make_mesh`),
one ``Spec`` per parameter (``PARAMETERS``) and, per operator, one per input and output
(``OPERATORS``: the activation boundaries, data inputs and constants included): the global shape,
the ``PartitionSpec`` and autopar's own layout. Run with
``XLA_FLAGS=--xla_force_host_platform_device_count=N python FILE`` it places every parameter with
``jax.device_put`` of a seeded array on a `NamedSharding`, checks every addressable shard's shape,
index and values against the plan, checks every boundary's shard shape and per-device index
(``NamedSharding.shard_shape`` / ``devices_indices_map``: nothing is allocated), and prints OK.

The mesh: the plan's logical axes (`autopar.lowering.axes`: its mesh bits grouped by role into
``data``, ``sequence``, ``tensor`` and ``replicated``; 8 devices of ResNet-50 are ``("data",)`` of shape
``(8,)``), ``Mesh(devices[rank_grid()], AXIS_NAMES)``: ``rank_grid`` puts rank r (``jax.devices()[r]``)
at the numbers its bits spell on each axis (``AXIS_BITS``, major first), so the mesh holds autopar's
exact device order whatever bits an axis holds. A dimension split by the bits of axes, each run in its
axis's order, names those axes major first (a PartitionSpec tuple is major to minor, whatever the axes'
order in the mesh: ``jax/_src/named_sharding.py``, the note on ``ArrayMapping``); one axis is the bare
name, none ``None``. A tensor that uses part of an axis (a dimension split by two of its three bits, or
its bits in another order) lives on a mesh of the same devices with that axis cut into runs of one role
(``data_b4_b3``, ``data_b2``; `autopar.export.logical`; ``Spec.mesh``).

Partial values have no PartitionSpec entry in JAX's default (``Auto``) mesh axes: a tensor the
plan holds partial (a sum, max or min over some bits) gets the PartitionSpec of its split
dimensions, and ``Spec.unreduced`` / ``Spec.reduce_op`` plus the module's ``UNREDUCED`` dict
({(operator, tensor): (reduce op, axis names)}) say over which axes its values still have to be
reduced. (For sums, JAX >= 0.7 can also spell this as ``P(..., unreduced={...})`` on a mesh with
``AxisType.Explicit`` axes; the module does not, so it works with the default mesh.)

Shapes come from the model the plan was made for (``--model``; ``autopar.export_plan`` passes a
`Plan`'s): without one the module holds specs and layouts only and checks which shard each device holds.

>>> from autopar.layout import Layout
>>> partition_spec(Layout(((2, 1), (0,), ())), (("data", (2, 1)), ("tensor", (0,))))
"P('data', 'tensor', None)"
>>> partition_spec(Layout(((0, 2, 1),)), (("data", (2, 1)), ("tensor", (0,))))   # bit 0 major
"P(('tensor', 'data'))"
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import onnx

from autopar.errors import AutoparError
from autopar.export.dtensor import AxisTable, Boundary, plan_tensors, spec_tables
from autopar.export.logical import Group, axis_links
from autopar.layout import Layout
from autopar.lowering.planfile import PlanFile


def _devices(count: int) -> str:
    return f"{count} device{'s' if count > 1 else ''}"


def partition_spec(layout: Layout, groups: Sequence[Group]) -> str:
    """The PartitionSpec (as source text) of a layout's split dimensions over the mesh dimensions ``groups``
    (`autopar.export.logical.tensor_groups`); partial bits are not in it."""
    entries = []
    for bits in layout.dims:
        names = [
            name for _, name in sorted((bits.index(run[0]), name) for name, run in groups if run and run[0] in bits)
        ]
        if not names:
            entries.append("None")
        elif len(names) == 1:
            entries.append(repr(names[0]))
        else:
            entries.append(repr(tuple(names)))
    return "P(" + ", ".join(entries) + ")"


def unreduced_axes(layout: Layout, groups: Sequence[Group]) -> tuple[str, ...]:
    """The mesh dimensions over which a layout's values are partial, in mesh order."""
    return tuple(name for name, bits in groups if bits and bits[0] in layout.partial)


def _spec(boundary: Boundary, table: AxisTable) -> str:
    layout = boundary.layout
    groups = table.groups(layout, ordered=False)
    fields = [repr(boundary.shape), partition_spec(layout, groups), f"dims={layout.dims!r}"]
    if layout.partial:
        fields += [f"unreduced={unreduced_axes(layout, groups)!r}", f"reduce_op={str(layout.partial_op)!r}"]
    names = tuple(name for name, _ in groups)
    if names != table.names():
        fields.append(f"mesh={names!r}")
    return "Spec(" + ", ".join(fields) + ")"


_RUNTIME = '''

# --- running it: XLA_FLAGS=--xla_force_host_platform_device_count=DEVICES python THIS_FILE --------


def rank_grid(axes: tuple[str, ...] = AXIS_NAMES) -> np.ndarray:
    """The ranks over a mesh whose axes are ``axes``: rank r at the numbers its bits spell on each."""
    bits = [bit for name in axes for bit in AXIS_BITS[name]]
    grid = np.arange(DEVICES)
    if bits:  # axis i of the (2, ..., 2) grid is bit len(bits) - 1 - i: row-major, highest bit first
        grid = grid.reshape([2] * len(bits)).transpose([len(bits) - 1 - bit for bit in bits])
    return grid.reshape([1 << len(AXIS_BITS[name]) for name in axes])


_MESHES: dict[tuple[str, ...], Mesh] = {}


def make_mesh(axes: tuple[str, ...] = AXIS_NAMES, devices: list | None = None) -> Mesh:
    """The plan's mesh over the first DEVICES devices (device r of the list is autopar's rank r), on
    ``axes``: the logical axes, or the same devices with an axis cut or reordered (built once)."""
    if axes not in _MESHES:
        devices = jax.devices() if devices is None else devices
        if len(devices) < DEVICES:
            raise SystemExit(
                f"this plan is for {DEVICES} devices, JAX sees {len(devices)}: on CPU run with"
                f" XLA_FLAGS=--xla_force_host_platform_device_count={DEVICES}"
            )
        _MESHES[axes] = Mesh(np.array(devices[:DEVICES], dtype=object)[rank_grid(axes)], axes)
    return _MESHES[axes]


def sharding(spec: Spec) -> NamedSharding:
    return NamedSharding(make_mesh(spec.mesh), spec.spec)


def shard_index(rank: int, bits: tuple[int, ...]) -> int:
    """autopar's rule: the shard a rank holds is the number its bits spell, most significant first."""
    index = 0
    for bit in bits:
        index = (index << 1) | ((rank >> bit) & 1)
    return index


def local_bounds(spec: Spec, shape: tuple[int, ...], rank: int) -> tuple[tuple[int, int], ...]:
    """(start, stop) per dimension of the region of a tensor of ``shape`` that ``rank`` holds."""
    out = []
    for size, bits in zip(shape, spec.dims):
        chunk = size >> len(bits)
        start = shard_index(rank, bits) * chunk
        out.append((start, start + chunk))
    return tuple(out)


def local_shape(spec: Spec, shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(size >> len(bits) for size, bits in zip(shape, spec.dims))


def bounds(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    return tuple(s.indices(size)[:2] for s, size in zip(index, shape))


def place(name: str, value: np.ndarray) -> jax.Array:
    """Parameter ``name`` (its full value) placed as the plan says."""
    return jax.device_put(value, sharding(PARAMETERS[name]))


def check_parameter(name: str, value: np.ndarray, ranks: dict) -> None:
    spec = PARAMETERS[name]
    array = place(name, value)
    want = local_shape(spec, value.shape)
    for shard in array.addressable_shards:
        rank = ranks[shard.device]
        assert shard.data.shape == want, f"{name}: device {rank} holds {shard.data.shape}, the plan says {want}"
        region = local_bounds(spec, value.shape, rank)
        assert bounds(shard.index, value.shape) == region, f"{name}: device {rank} holds another shard"
        expected = value[tuple(slice(start, stop) for start, stop in region)]
        assert np.array_equal(np.asarray(shard.data), expected), f"{name}: device {rank} holds other values"


def check_boundary(label: str, spec: Spec, ranks: dict) -> None:
    """Shard shape and every device's index, from the sharding alone (nothing is allocated)."""
    shape = spec.shape if spec.shape is not None else tuple(1 << len(bits) for bits in spec.dims)
    named = sharding(spec)
    want = local_shape(spec, shape)
    assert named.shard_shape(shape) == want, f"{label}: shards of {named.shard_shape(shape)}, the plan says {want}"
    for device, index in named.devices_indices_map(shape).items():
        rank = ranks[device]
        assert bounds(index, shape) == local_bounds(spec, shape, rank), f"{label}: device {rank} holds another shard"


def check_mesh(mesh: Mesh, ranks: dict) -> None:
    """Every device sits on each axis at the number its rank's bits of that axis spell: autopar's order."""
    for coordinates in np.ndindex(mesh.devices.shape):
        rank = ranks[mesh.devices[coordinates]]
        for name, at in zip(mesh.axis_names, coordinates):
            assert shard_index(rank, AXIS_BITS[name]) == at, f"device {rank} is not where its bits put it on {name}"


def main() -> None:
    mesh = make_mesh()
    ranks = {device: rank for rank, device in enumerate(jax.devices()[:DEVICES])}
    check_mesh(mesh, ranks)
    rng = np.random.default_rng(SEED)
    for name, spec in PARAMETERS.items():
        if spec.shape is None:  # exported without the model: no shapes, check the shards only
            check_boundary(name, spec, ranks)
            continue
        check_parameter(name, rng.standard_normal(spec.shape, dtype=np.float32), ranks)
    seen: set[str] = set()
    for op_name, op in OPERATORS.items():
        for tensor, spec in [*op.inputs.items(), *op.outputs.items()]:
            key = repr(spec)
            if key not in seen:
                seen.add(key)
                check_boundary(f"{op_name}: {tensor}", spec, ranks)
    shapes = "" if SHAPES_KNOWN else " (no shapes: exported without the model)"
    print(
        f"OK: {len(PARAMETERS)} parameters and {len(seen)} distinct operator boundaries on mesh"
        f" {dict(zip(AXIS_NAMES, MESH_SHAPE))} match the plan{shapes}"
    )


if __name__ == "__main__":
    main()
'''


def module_text(plan: PlanFile, model: onnx.ModelProto | None, filename: str = "THIS_FILE") -> str:
    """The generated module's source (``filename``: its name, in the command line it shows)."""
    tensors = plan_tensors(plan, model)
    mesh = tensors.mesh
    table = AxisTable(tensors.axes)
    tables = spec_tables(tensors, lambda b: _spec(b, table))  # first: it records the cut axes it uses
    unreduced = [
        f"    {(op.name, b.tensor)!r}:"
        f" {(str(b.layout.partial_op), unreduced_axes(b.layout, table.groups(b.layout, ordered=False)))!r},"
        for op in tensors.ops
        for b in (*op.inputs, *op.outputs)
        if b.layout.partial
    ]
    names, shape = table.names(), table.shape()
    lines = [
        f'"""JAX shardings of autopar\'s plan for {plan.model!r} on {_devices(mesh.num_devices)}.',
        "",
        "Generated by ``autopar export --to jax``. Run it to check the plan against JAX:",
        "",
        f"    XLA_FLAGS=--xla_force_host_platform_device_count={mesh.num_devices} python {filename}",
        "",
        "It places every parameter (``jax.device_put`` of a seeded array on its NamedSharding), checks",
        "every shard's shape, index and values, checks every operator boundary's shard shape and",
        "per-device index, and prints OK.",
        "",
        f"Mesh: the plan's logical axes {names!r}, shape {shape!r}, over jax.devices()[:{mesh.num_devices}].",
        "``AXIS_BITS`` gives each axis's autopar mesh bits, major first; ``rank_grid`` puts device r at the",
        "number its bits spell on each axis (rank r's bit b is (r >> b) & 1), so device r is autopar's rank",
        "r. A dimension split by the bits of axes names them major first (a PartitionSpec tuple is major to",
        "minor). A tensor that uses part of an axis, or its bits in another order, lives on a mesh of the",
        "same devices with that axis cut into runs of one role (``data_b4_b3``; ``Spec.mesh``).",
        "",
        "Partial values: a PartitionSpec (on the default Auto axes) cannot say them. ``Spec.spec`` holds",
        "the split dimensions; ``Spec.unreduced`` names the axes over which the values are still partial",
        "and ``Spec.reduce_op`` how they combine (sum, max or min); ``UNREDUCED`` lists every such",
        "(operator, tensor). On a mesh with Explicit axes, a sum is ``P(*spec.spec, unreduced=set(axes))``.",
        "",
        "``Spec.dims`` is autopar's layout (the bits splitting each dimension, most significant first);",
        "the check compares JAX's shards with it.",
        '"""',
        "",
        "from __future__ import annotations",
        "",
        "from typing import NamedTuple",
        "",
        "import jax",
        "import numpy as np",
        "from jax.sharding import Mesh, NamedSharding",
        "from jax.sharding import PartitionSpec as P",
        "",
        f"DEVICES = {mesh.num_devices}",
        f"MESH_SHAPE = {shape!r}",
        f"AXIS_NAMES = {names!r}  # the logical axes, the one with the highest bit first",
        "# each mesh axis's autopar mesh bits, major first: the logical axes, then any cut a tensor needs",
        "AXIS_BITS: dict[str, tuple[int, ...]] = {",
        table.source().rstrip("\n"),
        "}",
        f"LINKS = {{{axis_links(mesh, table.logical)}}}  # the links each axis's collectives cross",
        "SEED = 0",
        f"SHAPES_KNOWN = {tensors.shapes_known}",
        "",
        "",
        "class Spec(NamedTuple):",
        '    """A tensor: global shape, PartitionSpec, autopar\'s layout, and the axes it is partial over."""',
        "",
        "    shape: tuple[int, ...] | None",
        "    spec: P",
        "    dims: tuple[tuple[int, ...], ...]  # autopar: the bits splitting each dimension, major first",
        "    unreduced: tuple[str, ...] = ()  # axes over which the values are partial (not in ``spec``)",
        '    reduce_op: str = "sum"  # how the partial values combine',
        "    mesh: tuple[str, ...] = AXIS_NAMES  # the mesh axes the spec refers to",
        "",
        "",
        "class Op(NamedTuple):",
        '    """An operator: its type, its in_strategy, and its inputs\' and outputs\' shardings."""',
        "",
        "    op_type: str",
        "    strategy: tuple[tuple[int, ...], ...]",
        "    inputs: dict[str, Spec]",
        "    outputs: dict[str, Spec]",
        "",
        "",
    ]
    lines += tables
    lines += [
        "",
        "# (operator, tensor) -> (reduce op, axes): values still partial there, which PartitionSpec cannot say",
        "UNREDUCED: dict[tuple[str, str], tuple[str, tuple[str, ...]]] = {",
        *unreduced,
        "}",
    ]
    return "\n".join(lines) + "\n" + _RUNTIME


def write(plan: PlanFile, model: onnx.ModelProto | None, out: Path) -> list[Path]:
    """Write the JAX module for ``plan`` at ``out``; the one path."""
    path = Path(out)
    text = module_text(plan, model, path.name)
    try:
        path.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise AutoparError(f"Cannot write {str(path)!r}: {exc.strerror or exc}.") from None
    return [path]


__all__ = ["module_text", "partition_spec", "unreduced_axes", "write"]
