"""The ``dtensor`` export: a Python module that places the plan's tensors with PyTorch DTensor.

`write` makes one readable module (``{model}_dtensor.py`` by default) holding the `DeviceMesh`,
one ``Spec`` per parameter (``PARAMETERS``) and, per operator, one per input and output
(``OPERATORS``: the activation boundaries, data inputs and constants included): the global shape,
the DTensor placements (``Shard(d)``, ``Replicate()``, ``Partial(op)``) and autopar's own layout.
Run as ``torchrun --nproc-per-node N FILE`` (gloo on CPU) it builds the mesh, distributes every
parameter (`distribute_tensor` of a seeded full tensor), checks on every rank that the local
tensor is the shard the plan says (shape and values), checks every boundary's local shape (a
meta tensor) and which shard each rank holds (a small probe tensor), and prints OK.

The mesh: the plan's logical axes (`autopar.lowering.axes`: its mesh bits grouped by role into
``data``, ``sequence``, ``tensor`` and ``replicated``; 64 devices of GPT-2 may be
``("replicated", "data", "sequence", "tensor")`` of shape ``(2, 8, 2, 2)``), built as
``DeviceMesh(device_type, rank_grid(), mesh_dim_names=MESH_DIM_NAMES)``: ``rank_grid`` puts rank r at the
coordinates its bits spell on each axis (``AXIS_BITS``, major first), so the mesh holds autopar's exact
rank order whatever bits an axis holds. A tensor dimension split by the bits of an axis, in the axis's
order, is ``Shard(d)`` there; an axis whose bits hold partial values is ``Partial(op)``; one it does not
use is ``Replicate()``. DTensor shards a tensor dimension over several mesh dimensions left to right (the
leftmost mesh dimension major: `DTensorSpec.compute_default_shard_order`, the `_StridedShard` docstring
in ``torch/distributed/tensor/placement_types.py``), so axes come highest bit first and a dimension split
over several axes in another order lives on a mesh of the same ranks with those axes permuted
(``Spec.mesh``). A tensor that uses part of an axis (a dimension split by two of its three bits) lives on
a mesh with that axis cut into runs of one role (``data_b4_b3``, ``data_b2``; `autopar.export.logical`):
plain ``Shard`` again, never the private ``_StridedShard``.

Shapes come from the model the plan was made for (``--model`` on the command line;
``autopar.export_plan`` passes a `Plan`'s): without one, the module holds placements and layouts
only and checks which shard each rank holds, not the local shapes.

>>> from autopar.layout import Layout
>>> placements(Layout(((2, 1), (0,))), (("data", (2, 1)), ("tensor", (0,))))
['Shard(0)', 'Shard(1)']
>>> placements(Layout(((),), partial=(2, 1)), (("data", (2, 1)), ("tensor", (0,))))
["Partial('sum')", 'Replicate()']
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import onnx

from autopar.cost.mesh import Mesh
from autopar.errors import AutoparError, PlanFileError
from autopar.export.logical import Group, axis_links, logical_groups, placement_kinds, tensor_groups
from autopar.layout import Layout
from autopar.lowering.axes import LogicalAxis, logical_axes
from autopar.lowering.planfile import PlanFile
from autopar.lowering.program import plan_graph

# --- what both framework exports place -------------------------------------------------------------


@dataclass(frozen=True)
class Boundary:
    """One tensor as an operator sees it: its layout there, its global shape (None when unknown)."""

    tensor: str
    layout: Layout
    shape: tuple[int, ...] | None
    kind: str  # parameter, constant, input or activation


@dataclass(frozen=True)
class OpBoundaries:
    name: str
    op_type: str
    strategy: tuple[tuple[int, ...], ...]
    inputs: tuple[Boundary, ...]
    outputs: tuple[Boundary, ...]


@dataclass(frozen=True)
class PlanTensors:
    """The plan's parameters (their own layouts) and every operator's boundaries, with shapes."""

    mesh: Mesh  # the plan's devices, mesh bits and the link of each bit
    axes: tuple[LogicalAxis, ...]  # the mesh bits grouped into named logical axes
    parameters: dict[str, Boundary]
    ops: tuple[OpBoundaries, ...]
    shapes_known: bool


def plan_tensors(plan: PlanFile, model: onnx.ModelProto | None) -> PlanTensors:
    """What the dtensor and jax exports write: shapes from ``model`` (bound as the plan was), if given."""
    graph = plan_graph(plan, model) if model is not None else None
    trainable = {entry.parameter: entry.layout.layout() for entry in plan.gradient_sync}

    def kind_of(tensor: str) -> str:
        if graph is None:
            return "parameter" if tensor in trainable else "activation"
        return graph.tensor(tensor).kind

    def boundary(tensor: str, layout: Layout) -> Boundary:
        shape = None
        if graph is not None:
            shape = tuple(graph.tensor(tensor).shape)
            if len(shape) != layout.ndim:
                raise PlanFileError(
                    f"The plan was made for another model ({plan.model!r}): tensor {tensor!r} has"
                    f" {len(shape)} dimensions here, {layout.ndim} in the plan."
                )
        return Boundary(tensor, layout, shape, kind_of(tensor))

    ops: list[OpBoundaries] = []
    parameters: dict[str, Boundary] = {}
    for op in plan.ops:
        for entry in [*op.inputs, *op.outputs]:
            if entry.tensor and graph is not None and entry.tensor not in graph.tensors:
                raise PlanFileError(
                    f"The plan was made for another model ({plan.model!r}): this one has no tensor {entry.tensor!r}."
                )
        inputs = tuple(boundary(e.tensor, e.layout.layout()) for e in op.inputs if e.tensor)
        outputs = tuple(boundary(e.tensor, e.layout.layout()) for e in op.outputs if e.tensor)
        for b in inputs:
            if b.kind == "parameter" and b.tensor not in parameters:
                layout = trainable.get(b.tensor, b.layout)  # its own layout: where its gradient is synced
                parameters[b.tensor] = boundary(b.tensor, layout)
        ops.append(OpBoundaries(op.name, op.op_type, tuple(tuple(s) for s in op.strategy), inputs, outputs))
    for name, layout in trainable.items():  # a parameter no operator reads (not expected): still placed
        if name not in parameters and (graph is None or name in graph.tensors):
            parameters[name] = boundary(name, layout)
    return PlanTensors(plan.mesh, logical_axes(plan), parameters, tuple(ops), graph is not None)


# --- the logical axes as mesh dimensions ------------------------------------------------------------


def placements(layout: Layout, groups: Sequence[Group]) -> list[str]:
    """DTensor placements (as source text), one per mesh dimension ``groups`` (`tensor_groups`)."""
    out = []
    for kind, dim in placement_kinds(layout, groups):
        if kind == "shard":
            out.append(f"Shard({dim})")
        elif kind == "partial":
            out.append(f"Partial({str(layout.partial_op)!r})")
        else:
            out.append("Replicate()")
    return out


class AxisTable:
    """The mesh dimensions a generated module uses, each name with its bits (``AXIS_BITS``), in first use."""

    def __init__(self, axes: Sequence[LogicalAxis]) -> None:
        self.axes = tuple(axes)
        self.logical = logical_groups(axes)
        self.bits: dict[str, tuple[int, ...]] = dict(self.logical)

    def groups(self, layout: Layout, *, ordered: bool) -> tuple[Group, ...]:
        found = tensor_groups(layout, self.axes, ordered=ordered)
        for name, bits in found:
            self.bits.setdefault(name, bits)
        return found

    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.logical)

    def shape(self) -> tuple[int, ...]:
        return tuple(1 << len(bits) for _, bits in self.logical)

    def source(self) -> str:
        """``AXIS_BITS``'s entries as source."""
        return "".join(f"    {name!r}: {bits!r},\n" for name, bits in self.bits.items())


# --- the generated module ---------------------------------------------------------------------------


def _spec(boundary: Boundary, table: AxisTable) -> str:
    layout = boundary.layout
    groups = table.groups(layout, ordered=True)
    fields = [repr(boundary.shape), _tuple(placements(layout, groups)), f"dims={layout.dims!r}"]
    if layout.partial:
        fields += [f"partial={layout.partial!r}", f"partial_op={str(layout.partial_op)!r}"]
    names = tuple(name for name, _ in groups)
    if names != table.names():
        fields.append(f"mesh={names!r}")
    return "Spec(" + ", ".join(fields) + ")"


def spec_tables(tensors: PlanTensors, spec_of: Callable[[Boundary], str]) -> list[str]:
    """The ``PARAMETERS`` and ``OPERATORS`` tables of a generated module, ``spec_of`` writing each entry.

    An operator input that is a parameter placed as ``PARAMETERS`` says is written as that entry.
    """
    specs = {name: spec_of(b) for name, b in tensors.parameters.items()}
    lines = ["# every parameter, as its gradient synchronisation sees it (trainable) or its first reader"]
    lines += ["PARAMETERS: dict[str, Spec] = {", *(f"    {name!r}: {spec}," for name, spec in specs.items()), "}"]
    lines += ["", "# every operator's inputs and outputs: the activation boundaries", "OPERATORS: dict[str, Op] = {"]
    for op in tensors.ops:
        lines += [f"    {op.name!r}: Op(", f"        {op.op_type!r},", f"        {op.strategy!r},"]
        for label, group in (("inputs", op.inputs), ("outputs", op.outputs)):
            lines.append(f"        {label}={{")
            for b in group:
                spec = spec_of(b)
                text = f"PARAMETERS[{b.tensor!r}]" if specs.get(b.tensor) == spec else spec
                lines.append(f"            {b.tensor!r}: {text},")
            lines.append("        },")
        lines.append("    ),")
    lines.append("}")
    return lines


def _tuple(items: Sequence[str]) -> str:
    """Source text of a tuple of source texts."""
    return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"


_RUNTIME = '''

# --- running it: torchrun --nproc-per-node DEVICES THIS_FILE --------------------------------------


def rank_grid(mesh_dims: tuple[str, ...] = MESH_DIM_NAMES) -> torch.Tensor:
    """The ranks over a mesh whose dimensions are ``mesh_dims``: rank r at the numbers its bits spell on each."""
    bits = [bit for name in mesh_dims for bit in AXIS_BITS[name]]
    grid = torch.arange(DEVICES)
    if bits:  # dimension i of the (2, ..., 2) grid is bit len(bits) - 1 - i: row-major, highest bit first
        grid = grid.reshape([2] * len(bits)).permute([len(bits) - 1 - bit for bit in bits])
    return grid.reshape([1 << len(AXIS_BITS[name]) for name in mesh_dims])


_MESHES: dict[tuple[str, ...], DeviceMesh] = {}


def device_mesh(mesh_dims: tuple[str, ...] = MESH_DIM_NAMES) -> DeviceMesh:
    """The device mesh (built once). Another holds the same ranks with its axes cut or reordered."""
    if mesh_dims not in _MESHES:
        _MESHES[mesh_dims] = DeviceMesh(DEVICE_TYPE, rank_grid(mesh_dims), mesh_dim_names=mesh_dims)
    return _MESHES[mesh_dims]


def check_mesh(mesh: DeviceMesh) -> None:
    """Every rank sits on each axis at the number its bits of that axis spell: autopar's rank order."""
    names = mesh.mesh_dim_names or ()
    for coordinates, rank in zip(itertools.product(*map(range, mesh.mesh.shape)), mesh.mesh.flatten().tolist()):
        for name, at in zip(names, coordinates):
            assert shard_index(rank, AXIS_BITS[name]) == at, f"rank {rank} is not where its bits put it on {name}"


def shard_index(rank: int, bits: tuple[int, ...]) -> int:
    """autopar's rule: the shard a rank holds is the number its bits spell, most significant first."""
    index = 0
    for bit in bits:
        index = (index << 1) | ((rank >> bit) & 1)
    return index


def local_slices(spec: Spec, shape: tuple[int, ...], rank: int) -> tuple[slice, ...]:
    """The region of a tensor of ``shape`` that ``rank`` holds under ``spec`` (autopar's layout)."""
    out = []
    for size, bits in zip(shape, spec.dims):
        chunk = size >> len(bits)
        start = shard_index(rank, bits) * chunk
        out.append(slice(start, start + chunk))
    return tuple(out)


def local_shape(spec: Spec, shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(size >> len(bits) for size, bits in zip(shape, spec.dims))


def partial_scale(spec: Spec) -> float:
    """distribute_tensor gives each rank 1/n of a full value for Partial("sum"), the value itself otherwise."""
    return 1.0 / (1 << len(spec.partial)) if spec.partial and spec.partial_op == "sum" else 1.0


def distribute(name: str, full: torch.Tensor) -> DTensor:
    """Parameter ``name`` (the same full value on every rank: each keeps its shard, nothing is sent)."""
    spec = PARAMETERS[name]
    return distribute_tensor(full, device_mesh(spec.mesh), spec.placements, src_data_rank=None)


def check_parameter(name: str, full: torch.Tensor, rank: int) -> None:
    spec = PARAMETERS[name]
    local = distribute(name, full).to_local().cpu()
    want = local_shape(spec, tuple(full.shape))
    assert tuple(local.shape) == want, f"{name}: rank {rank} holds {tuple(local.shape)}, the plan says {want}"
    expected = full[local_slices(spec, tuple(full.shape), rank)] * partial_scale(spec)
    assert torch.allclose(local, expected), f"{name}: rank {rank} holds another shard than the plan says"


def check_boundary(label: str, spec: Spec, rank: int) -> None:
    """The local shape DTensor gives (a meta tensor: nothing allocated) and the shard each rank holds."""
    mesh = device_mesh(spec.mesh)
    if spec.shape is not None:
        meta = distribute_tensor(torch.empty(spec.shape, device="meta"), mesh, spec.placements, src_data_rank=None)
        got, want = tuple(meta.to_local().shape), local_shape(spec, spec.shape)
        assert got == want, f"{label}: rank {rank} holds {got}, the plan says {want}"
    probe_shape = tuple(1 << len(bits) for bits in spec.dims)  # one element per shard, numbered
    probe = torch.arange(math.prod(probe_shape), dtype=torch.float64).reshape(probe_shape)
    local = distribute_tensor(probe, mesh, spec.placements, src_data_rank=None).to_local().cpu()
    expected = probe[local_slices(spec, probe_shape, rank)] * partial_scale(spec)
    assert torch.equal(local, expected), f"{label}: rank {rank} holds another shard than the plan says"


_FULL: dict[str, torch.Tensor] = {}


def check_rank(rank: int) -> int:
    """Check every parameter and boundary on ``rank``; the distinct boundaries checked."""
    check_mesh(device_mesh())
    generator = torch.Generator().manual_seed(SEED)  # the same full tensors on every rank
    for name, spec in PARAMETERS.items():
        if spec.shape is None:  # exported without the model: no shapes, check the shards only
            check_boundary(name, spec, rank)
            continue
        if name not in _FULL:
            full = torch.randn(spec.shape, generator=generator)
            if not dist.is_initialized() or dist.get_backend() != "fake":
                check_parameter(name, full, rank)
                continue
            _FULL[name] = full  # simulated ranks share one process: draw each tensor once
        check_parameter(name, _FULL[name], rank)
    seen: set[str] = set()
    for op_name, op in OPERATORS.items():
        for tensor, spec in [*op.inputs.items(), *op.outputs.items()]:
            key = repr(spec)
            if key not in seen:
                seen.add(key)
                check_boundary(f"{op_name}: {tensor}", spec, rank)
    return len(seen)


def say_ok(boundaries: int) -> None:
    shapes = "" if SHAPES_KNOWN else " (no shapes: exported without the model)"
    print(
        f"OK: {len(PARAMETERS)} parameters and {boundaries} distinct operator boundaries on mesh"
        f" {dict(zip(MESH_DIM_NAMES, MESH_SHAPE))} match the plan{shapes}"
    )


def simulate() -> None:
    """Every rank in turn in this one process, on torch's fake process group (no collective runs: each rank
    keeps its own shard of the same full tensors), for more ranks than the machine can start."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    global DEVICE_TYPE
    DEVICE_TYPE = "cpu"
    for rank in range(DEVICES):
        dist.init_process_group("fake", rank=rank, world_size=DEVICES, store=FakeStore())
        _MESHES.clear()
        boundaries = check_rank(rank)
        dist.destroy_process_group()
    say_ok(boundaries)


def main() -> None:
    if "--simulate" in sys.argv[1:]:
        simulate()
        return
    dist.init_process_group("cpu:gloo,cuda:nccl" if DEVICE_TYPE == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != DEVICES:
        raise SystemExit(f"this plan is for {DEVICES} devices: run torchrun --nproc-per-node {DEVICES} (got {world})")
    if DEVICE_TYPE == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    boundaries = check_rank(rank)
    dist.barrier()
    if rank == 0:
        say_ok(boundaries)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
'''


def module_text(plan: PlanFile, model: onnx.ModelProto | None, filename: str = "THIS_FILE") -> str:
    """The generated module's source (``filename``: its name, in the command line it shows)."""
    tensors = plan_tensors(plan, model)
    mesh = tensors.mesh
    table = AxisTable(tensors.axes)
    tables = spec_tables(tensors, lambda b: _spec(b, table))  # first: it records the cut axes it uses
    names, shape = table.names(), table.shape()
    lines = [
        f'"""DTensor placements of autopar\'s plan for {plan.model!r} on {mesh.num_devices} devices.',
        "",
        "Generated by ``autopar export --to dtensor``. Run it to check the plan against DTensor:",
        "",
        f"    torchrun --nproc-per-node {mesh.num_devices} {filename}",
        "",
        "(gloo on CPU, NCCL where CUDA is available): every rank builds the mesh, distributes every",
        "parameter (``distribute_tensor`` of a seeded full tensor), checks its local shard's shape and",
        "values, checks every operator boundary's local shape and shard, and rank 0 prints OK.",
        f"``python {filename} --simulate`` runs the same checks for every rank in turn in one process, on",
        "torch's fake process group (for more ranks than a machine can start).",
        "",
        f"Mesh: the plan's logical axes {names!r}, shape {shape!r}, as",
        "``init_device_mesh`` users name them. ``AXIS_BITS`` gives each axis's autopar mesh bits, major",
        "first; ``rank_grid`` puts rank r at the number its bits spell on each axis (rank r's bit b is",
        "(r >> b) & 1), so the mesh holds autopar's exact rank order. A tensor dimension split by an axis's",
        "bits, in its order, is Shard(d) there; DTensor shards over several mesh dimensions left to right,",
        "the leftmost major, as autopar's first bit is. Axes holding partial values are Partial(op); the",
        "rest Replicate(). A tensor that uses part of an axis, or splits a dimension over axes in another",
        "order, lives on a mesh of the same ranks with that axis cut into runs of one role (``data_b4_b3``)",
        "or the axes reordered (``Spec.mesh``).",
        "",
        "``Spec.dims`` / ``partial`` are autopar's layout (the bits splitting each dimension, most",
        "significant first, and the bits holding partial values); the check compares DTensor with it.",
        '"""',
        "",
        "from __future__ import annotations",
        "",
        "import itertools",
        "import math",
        "import os",
        "import sys",
        "from typing import NamedTuple",
        "",
        "import torch",
        "import torch.distributed as dist",
        "from torch.distributed.device_mesh import DeviceMesh",
        "from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor",
        "",
        f"DEVICES = {mesh.num_devices}",
        f"MESH_SHAPE = {shape!r}",
        f"MESH_DIM_NAMES = {names!r}  # the logical axes, the one with the highest bit first",
        "# each mesh dimension's autopar mesh bits, major first: the logical axes, then any cut a tensor needs",
        "AXIS_BITS: dict[str, tuple[int, ...]] = {",
        table.source().rstrip("\n"),
        "}",
        f"LINKS = {{{axis_links(mesh, table.logical)}}}  # the links each axis's collectives cross",
        "# CUDA (NCCL) where every local rank has a GPU, else CPU (gloo)",
        'LOCAL_RANKS = int(os.environ.get("LOCAL_WORLD_SIZE", DEVICES))',
        'DEVICE_TYPE = "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= LOCAL_RANKS else "cpu"',
        "SEED = 0",
        f"SHAPES_KNOWN = {tensors.shapes_known}",
        "",
        "",
        "class Spec(NamedTuple):",
        '    """A tensor: global shape, DTensor placements (one per mesh dim), autopar\'s layout, its mesh."""',
        "",
        "    shape: tuple[int, ...] | None",
        "    placements: tuple[Placement, ...]",
        "    dims: tuple[tuple[int, ...], ...]  # autopar: the bits splitting each dimension, major first",
        "    partial: tuple[int, ...] = ()  # autopar: the bits over which values are partial",
        '    partial_op: str = "sum"',
        "    mesh: tuple[str, ...] = MESH_DIM_NAMES  # the mesh dimensions the placements refer to",
        "",
        "",
        "class Op(NamedTuple):",
        '    """An operator: its type, its in_strategy, and its inputs\' and outputs\' placements."""',
        "",
        "    op_type: str",
        "    strategy: tuple[tuple[int, ...], ...]",
        "    inputs: dict[str, Spec]",
        "    outputs: dict[str, Spec]",
        "",
        "",
    ]
    return "\n".join(lines + tables) + "\n" + _RUNTIME


def write(plan: PlanFile, model: onnx.ModelProto | None, out: Path) -> list[Path]:
    """Write the DTensor module for ``plan`` at ``out``; the one path."""
    if plan.pipeline is not None:  # a program that trains with torch's pipelining
        from autopar.export import dtensor_pipeline

        return dtensor_pipeline.write(plan, model, out)
    path = Path(out)
    text = module_text(plan, model, path.name)
    try:
        path.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise AutoparError(f"Cannot write {str(path)!r}: {exc.strerror or exc}.") from None
    return [path]


__all__ = [
    "AxisTable",
    "Boundary",
    "OpBoundaries",
    "PlanTensors",
    "module_text",
    "placements",
    "plan_tensors",
    "spec_tables",
    "write",
]
