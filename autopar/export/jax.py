"""The ``jax`` export: a Python module with the plan's `jax.sharding.Mesh` and a PartitionSpec per tensor.

`write` makes one readable module (``{model}_jax.py`` by default) holding the mesh (`make_mesh`),
one ``Spec`` per parameter (``PARAMETERS``) and, per operator, one per input and output
(``OPERATORS``: the activation boundaries, data inputs and constants included): the global shape,
the ``PartitionSpec`` and autopar's own layout. Run with
``XLA_FLAGS=--xla_force_host_platform_device_count=N python FILE`` it places every parameter with
``jax.device_put`` of a seeded array on a `NamedSharding`, checks every addressable shard's shape,
index and values against the plan, checks every boundary's shard shape and per-device index
(``NamedSharding.shard_shape`` / ``devices_indices_map``: nothing is allocated), and prints OK.

The mesh: one named axis of size 2 per autopar mesh bit, ``b<bit>``, highest bit first
(8 devices: ``Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), ("b2", "b1", "b0"))``). A mesh
is a row-major array of devices, so device r of the list sits at the coordinate spelled by r's
bits, highest first: the mesh's device order is autopar's rank numbering (rank r is
``jax.devices()[r]``). A dimension split by bits (b1..bm), most significant first, is the tuple of
their axis names in the same order: in a PartitionSpec a tuple of axes is major to minor (the
first axis varies slowest; ``jax/_src/named_sharding.py``, the note on ``ArrayMapping``), whatever
the axes' order in the mesh, so any order of bits is plain ``P``. One bit is the bare name, no bit
``None``.

Partial values have no PartitionSpec entry in JAX's default (``Auto``) mesh axes: a tensor the
plan holds partial (a sum, max or min over some bits) gets the PartitionSpec of its split
dimensions, and ``Spec.unreduced`` / ``Spec.reduce_op`` plus the module's ``UNREDUCED`` dict
({(operator, tensor): (reduce op, axis names)}) say over which axes its values still have to be
reduced. (For sums, JAX >= 0.7 can also spell this as ``P(..., unreduced={...})`` on a mesh with
``AxisType.Explicit`` axes; the module does not, so it works with the default mesh.)

Shapes come from the model the plan was made for (``--model``; ``autopar.export_plan`` passes a
`Plan`'s): without one the module holds specs and layouts only and checks which shard each device holds.

>>> from autopar.layout import Layout
>>> partition_spec(Layout(((2, 1), (0,), ())))
"P(('b2', 'b1'), 'b0', None)"
>>> partition_spec(Layout(((0, 2),)))   # bit 0 major
"P(('b0', 'b2'))"
"""

from __future__ import annotations

from pathlib import Path

import onnx

from autopar.errors import AutoparError
from autopar.export.dtensor import Boundary, mesh_text, plan_tensors, spec_tables
from autopar.layout import Layout
from autopar.lowering.planfile import PlanFile


def partition_spec(layout: Layout) -> str:
    """The PartitionSpec (as source text) of a layout's split dimensions; partial bits are not in it."""
    entries = []
    for bits in layout.dims:
        if not bits:
            entries.append("None")
        elif len(bits) == 1:
            entries.append(repr(f"b{bits[0]}"))
        else:
            entries.append(repr(tuple(f"b{bit}" for bit in bits)))
    return "P(" + ", ".join(entries) + ")"


def unreduced_axes(layout: Layout) -> tuple[str, ...]:
    """The axis names over which a layout's values are partial, highest bit first."""
    return tuple(f"b{bit}" for bit in layout.partial)


def _spec(boundary: Boundary) -> str:
    layout = boundary.layout
    fields = [repr(boundary.shape), partition_spec(layout), f"dims={layout.dims!r}"]
    if layout.partial:
        fields += [f"unreduced={unreduced_axes(layout)!r}", f"reduce_op={str(layout.partial_op)!r}"]
    return "Spec(" + ", ".join(fields) + ")"


_RUNTIME = '''

# --- running it: XLA_FLAGS=--xla_force_host_platform_device_count=DEVICES python THIS_FILE --------


def make_mesh(devices: list | None = None) -> Mesh:
    """The plan's mesh over the first DEVICES devices: device r of the list is autopar's rank r."""
    devices = jax.devices() if devices is None else devices
    if len(devices) < DEVICES:
        raise SystemExit(
            f"this plan is for {DEVICES} devices, JAX sees {len(devices)}: on CPU run with"
            f" XLA_FLAGS=--xla_force_host_platform_device_count={DEVICES}"
        )
    return Mesh(np.array(devices[:DEVICES]).reshape(MESH_SHAPE), AXIS_NAMES)


def sharding(spec: Spec, mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, spec.spec)


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


def place(name: str, value: np.ndarray, mesh: Mesh) -> jax.Array:
    """Parameter ``name`` (its full value) placed as the plan says."""
    return jax.device_put(value, sharding(PARAMETERS[name], mesh))


def check_parameter(name: str, value: np.ndarray, mesh: Mesh, ranks: dict) -> None:
    spec = PARAMETERS[name]
    array = place(name, value, mesh)
    want = local_shape(spec, value.shape)
    for shard in array.addressable_shards:
        rank = ranks[shard.device]
        assert shard.data.shape == want, f"{name}: device {rank} holds {shard.data.shape}, the plan says {want}"
        region = local_bounds(spec, value.shape, rank)
        assert bounds(shard.index, value.shape) == region, f"{name}: device {rank} holds another shard"
        expected = value[tuple(slice(start, stop) for start, stop in region)]
        assert np.array_equal(np.asarray(shard.data), expected), f"{name}: device {rank} holds other values"


def check_boundary(label: str, spec: Spec, mesh: Mesh, ranks: dict) -> None:
    """Shard shape and every device's index, from the sharding alone (nothing is allocated)."""
    shape = spec.shape if spec.shape is not None else tuple(1 << len(bits) for bits in spec.dims)
    named = sharding(spec, mesh)
    want = local_shape(spec, shape)
    assert named.shard_shape(shape) == want, f"{label}: shards of {named.shard_shape(shape)}, the plan says {want}"
    for device, index in named.devices_indices_map(shape).items():
        rank = ranks[device]
        assert bounds(index, shape) == local_bounds(spec, shape, rank), f"{label}: device {rank} holds another shard"


def main() -> None:
    mesh = make_mesh()
    ranks = {device: rank for rank, device in enumerate(mesh.devices.flat)}
    rng = np.random.default_rng(SEED)
    for name, spec in PARAMETERS.items():
        if spec.shape is None:  # exported without the model: no shapes, check the shards only
            check_boundary(name, spec, mesh, ranks)
            continue
        check_parameter(name, rng.standard_normal(spec.shape, dtype=np.float32), mesh, ranks)
    seen: set[str] = set()
    for op_name, op in OPERATORS.items():
        for tensor, spec in [*op.inputs.items(), *op.outputs.items()]:
            key = repr(spec)
            if key not in seen:
                seen.add(key)
                check_boundary(f"{op_name}: {tensor}", spec, mesh, ranks)
    shapes = "" if SHAPES_KNOWN else " (no shapes: exported without the model)"
    print(
        f"OK: {len(PARAMETERS)} parameters and {len(seen)} distinct operator boundaries on mesh"
        f" {dict(mesh.shape)} match the plan{shapes}"
    )


if __name__ == "__main__":
    main()
'''


def module_text(plan: PlanFile, model: onnx.ModelProto | None, filename: str = "THIS_FILE") -> str:
    """The generated module's source (``filename``: its name, in the command line it shows)."""
    tensors = plan_tensors(plan, model)
    mesh = tensors.mesh
    bits = mesh.mesh_bits
    names, shape, links = mesh_text(mesh)
    lines = [
        f'"""JAX shardings of autopar\'s plan for {plan.model!r} on {mesh.num_devices} devices.',
        "",
        "Generated by ``autopar export --to jax``. Run it to check the plan against JAX:",
        "",
        f"    XLA_FLAGS=--xla_force_host_platform_device_count={mesh.num_devices} python {filename}",
        "",
        "It places every parameter (``jax.device_put`` of a seeded array on its NamedSharding), checks",
        "every shard's shape, index and values, checks every operator boundary's shard shape and",
        "per-device index, and prints OK.",
        "",
        f"Mesh: one axis of size 2 per autopar mesh bit, named {names!r}, highest bit first, over",
        f"jax.devices()[:{mesh.num_devices}] in row-major order: device r sits at the coordinate spelled by r's",
        "bits, highest first, so it is autopar's rank r (rank r's bit b is (r >> b) & 1). A dimension",
        "split by bits (b1..bm), most significant first, is the tuple of their axis names in that order",
        "(a PartitionSpec tuple is major to minor).",
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
        f"AXIS_NAMES = {names!r}  # autopar mesh bit of each axis, highest first",
        f"LINKS = {{{links}}}" if bits else "LINKS: dict[str, str] = {}",
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
    lines += spec_tables(tensors, _spec)
    unreduced = [
        f"    {(op.name, b.tensor)!r}: {(str(b.layout.partial_op), unreduced_axes(b.layout))!r},"
        for op in tensors.ops
        for b in (*op.inputs, *op.outputs)
        if b.layout.partial
    ]
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
