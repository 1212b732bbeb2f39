"""ONNX in, ONNX out: the model annotated with ONNX's own multi-device sharding (IR version 11).

The annotations are those of the ONNX multi-device proposal (``docs/proposals/
0006-ONNXMultiDeviceProposal.md`` and ``0007-ShardingFormalism.md`` in onnx/onnx; onnx >= 1.18):

* ``ModelProto.configuration`` gets one ``DeviceConfigurationProto`` named ``autopar`` with
  ``num_devices`` = the plan's N devices (device index = autopar rank).
* Every planned node gets one ``NodeDeviceConfigurationProto`` (``configuration_id`` ``autopar``)
  with a ``ShardingSpecProto`` per input and output tensor: the layout the operator reads (after
  any redistribution, which ONNX leaves implicit) and the layout it writes.
* ``sharded_dim`` has one ``ShardedDimProto`` per axis of the tensor (``axis`` = the axis), each
  with one ``SimpleShardedDimProto``: ``num_shards`` = 2^(bits splitting the axis), 1 where the
  axis is whole, and ``dim_value`` (or ``dim_param``) = the axis' full size where it is known.
* ``device`` lists who holds each shard, shards in row-major order over the axes (the
  proposal's loop order). Shard index i of an axis split by bits (b1, b2, ...) is the number
  those bits spell, most significant first (`autopar.layout.shard_index`). When one device
  holds a shard the entry is that device; when several do (they differ only in the bits that do
  not split the tensor: replication) the entry is a negative key -1, -2, ... and
  ``index_to_device_group_map`` maps it to the devices, ascending, as the proposal's
  "sharding as a broadcast" example does. A whole tensor is ``device = [-1]``, ``{-1: 0..N-1}``.

Partial values (a sum, maximum or minimum still to be reduced over some bits) have no ONNX
encoding: the device group of such a shard lists the devices whose partial values reduce to it,
and the node's ``metadata_props`` key ``autopar.partial`` holds JSON ``{tensor: {"bits": [...],
"op": "sum"}}`` for every partial input or output. A consumer that ignores the key reads those
tensors as replicated, which they are not. Where autopar's operator name differs from the node's
(an unnamed or renamed node), the key ``autopar.op`` holds autopar's name; where an operator's
in_strategy is not the shard counts of its inputs' axes (a OneHot's counts its output's axes),
the key ``autopar.strategy`` holds it as JSON.

The model's ``ir_version`` is raised to 11 where it is lower (the first with these fields); the
opsets are left as they are. `onnx.checker.check_model` accepts the result.

`read_annotations` reads such a model back into {operator: in_strategy}, so that
``autopar verify ANNOTATED.onnx`` checks the annotated plan; `read_layouts` decodes the layouts.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import onnx
from onnx import shape_inference

from autopar.errors import AutoparError, PlanFileError
from autopar.graph.validate import without_external_data
from autopar.layout import Layout, ReduceOp, mesh_bits_for, shard_index
from autopar.lowering.planfile import PlanFile

CONFIGURATION = "autopar"
PARTIAL_KEY = "autopar.partial"
OP_KEY = "autopar.op"
STRATEGY_KEY = "autopar.strategy"
IR_VERSION = 11  # the first IR version with ModelProto.configuration and NodeProto.device_configurations

Strategy = tuple[tuple[int, ...], ...]
Dim = int | str | None  # a known size, a symbolic one, or unknown


def write(plan: PlanFile, model: onnx.ModelProto | None, out: Path) -> list[Path]:
    """Write ``model`` annotated with ``plan``'s shardings to ``out``; the files written."""
    if model is None:
        raise AutoparError(
            "Exporting to onnx needs the ONNX model the plan was made for (--model MODEL.onnx on the command line)."
        )
    annotated = annotate(plan, model)
    try:
        onnx.checker.check_model(without_external_data(annotated))  # the weights need not be at hand
    except onnx.checker.ValidationError as exc:
        first = (str(exc).strip().splitlines() or ["invalid"])[0].rstrip(".")
        raise AutoparError(f"The annotated model does not pass onnx.checker: {first}.") from None
    try:
        onnx.save(annotated, str(out))
    except OSError as exc:
        raise AutoparError(f"Cannot write {str(out)!r}: {exc.strerror or exc}.") from None
    return [out]


def annotate(plan: PlanFile, model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` with ``plan``'s shardings as ONNX multi-device annotations."""
    if not hasattr(onnx, "DeviceConfigurationProto"):
        raise AutoparError(f"ONNX sharding annotations need onnx >= 1.18 (this is onnx {onnx.__version__}).")
    mesh = plan.mesh  # PlanFileError when its devices, mesh bits and links disagree
    result = onnx.ModelProto()
    result.CopyFrom(model)
    nodes = _nodes_for(plan, result)
    shapes = _shapes(result, plan)
    result.ir_version = max(result.ir_version, IR_VERSION)
    kept = [c for c in result.configuration if c.name != CONFIGURATION]
    del result.configuration[:]
    result.configuration.extend(kept)
    result.configuration.append(onnx.DeviceConfigurationProto(name=CONFIGURATION, num_devices=mesh.num_devices))
    ranks = {tensor: len(shape) for tensor, shape in shapes.items()}
    for node in result.graph.node:
        _clear(node)
    for op in plan.ops:
        node = nodes[op.name]
        config = onnx.NodeDeviceConfigurationProto(configuration_id=CONFIGURATION)
        partial: dict[str, dict[str, object]] = {}
        for entry in [*op.inputs, *op.outputs]:
            layout = entry.layout.layout()
            config.sharding_spec.append(
                sharding_spec(entry.tensor, layout, mesh.mesh_bits, shapes.get(entry.tensor, [None] * layout.ndim))
            )
            if layout.partial:
                partial[entry.tensor] = {"bits": list(layout.partial), "op": str(layout.partial_op)}
        node.device_configurations.append(config)
        layouts = {entry.tensor: entry.layout.layout() for entry in op.inputs}
        strategy = tuple(tuple(s) for s in op.strategy)
        if _strategy(op.name, node, layouts, lambda: ranks) != strategy:
            node.metadata_props.append(onnx.StringStringEntryProto(key=STRATEGY_KEY, value=json.dumps(op.strategy)))
        if partial:
            node.metadata_props.append(onnx.StringStringEntryProto(key=PARTIAL_KEY, value=json.dumps(partial)))
        if node.name != op.name:
            node.metadata_props.append(onnx.StringStringEntryProto(key=OP_KEY, value=op.name))
    return result


def sharding_spec(tensor: str, layout: Layout, mesh_bits: int, shape: Sequence[Dim]) -> onnx.ShardingSpecProto:
    """One tensor's `Layout` on 2^mesh_bits devices as a ShardingSpecProto (partial bits aside)."""
    spec = onnx.ShardingSpecProto(tensor_name=tensor)
    for axis, bits in enumerate(layout.dims):
        simple = onnx.SimpleShardedDimProto(num_shards=1 << len(bits))
        size = shape[axis] if axis < len(shape) else None
        if isinstance(size, int):
            simple.dim_value = size
        elif isinstance(size, str) and size:
            simple.dim_param = size
        spec.sharded_dim.append(onnx.ShardedDimProto(axis=axis, simple_sharding=[simple]))
    holders: dict[tuple[int, ...], list[int]] = {}
    for rank in range(1 << mesh_bits):
        holders.setdefault(tuple(shard_index(rank, bits) for bits in layout.dims), []).append(rank)
    for shard in sorted(holders):  # row-major: the first axis varies slowest
        devices = holders[shard]
        if len(devices) == 1:
            spec.device.append(devices[0])
        else:
            key = -1 - len(spec.index_to_device_group_map)
            spec.device.append(key)
            spec.index_to_device_group_map.append(onnx.IntIntListEntryProto(key=key, value=devices))
    return spec


def decode_spec(spec: onnx.ShardingSpecProto, num_devices: int) -> Layout:
    """The `Layout` a ShardingSpecProto written by `sharding_spec` means (without partial bits).

    AutoparError when the spec is not one an autopar layout can express (shards not spelled by
    mesh bits, a device missing or holding two shards).
    """
    where = f"The sharding of {spec.tensor_name!r}"
    groups = {entry.key: list(entry.value) for entry in spec.index_to_device_group_map}
    axes = sorted(spec.sharded_dim, key=lambda d: d.axis)
    if [d.axis for d in axes] != list(range(len(axes))):
        raise AutoparError(f"{where} does not list every axis once (autopar writes one entry per axis).")
    splits = [_num_shards(d, where) for d in axes]
    counts = [(n.bit_length() - 1) for n in splits]
    total = 1
    for n in splits:
        total *= n
    if len(spec.device) != total:
        raise AutoparError(f"{where} lists {len(spec.device)} devices for {total} shards.")
    owner: dict[int, tuple[int, ...]] = {}
    for position, device in enumerate(spec.device):
        shard = []
        rest = position
        for n in reversed(splits):
            shard.append(rest % n)
            rest //= n
        for rank in groups.get(device, [device]):
            if not 0 <= rank < num_devices or rank in owner:
                raise AutoparError(f"{where} places device {rank} badly (out of range or on two shards).")
            owner[rank] = tuple(reversed(shard))
    if len(owner) != num_devices:
        raise AutoparError(f"{where} leaves some of the {num_devices} devices out.")
    mesh_bits = mesh_bits_for(num_devices)
    dims: list[tuple[int, ...]] = []
    for axis, count in enumerate(counts):
        bits = []
        for position in range(count):  # most significant first
            shift = count - 1 - position
            found = [
                b
                for b in range(mesh_bits)
                if all(((owner[r][axis] >> shift) & 1) == ((r >> b) & 1) for r in range(num_devices))
            ]
            if not found:
                raise AutoparError(f"{where} splits axis {axis} in a way no mesh bits spell.")
            bits.append(found[0])
        dims.append(tuple(bits))
    return Layout(tuple(dims))


def _num_shards(dim: onnx.ShardedDimProto, where: str) -> int:
    n = 1
    for simple in dim.simple_sharding:
        n *= simple.num_shards
    if n < 1 or n & (n - 1):
        raise AutoparError(f"{where} splits axis {dim.axis} into {n} shards, not a power of two.")
    return n


def annotated_devices(model: onnx.ModelProto) -> int | None:
    """The device count of autopar's annotations in ``model``, None when it has none."""
    for config in model.configuration:
        if config.name == CONFIGURATION:
            return int(config.num_devices)
    return None


def read_layouts(model: onnx.ModelProto) -> dict[str, dict[str, Layout]] | None:
    """{operator: {tensor: Layout}} from autopar's annotations (partial bits included); None without any."""
    devices = annotated_devices(model)
    if devices is None:
        return None
    found: dict[str, dict[str, Layout]] = {}
    for node in model.graph.node:
        for config in node.device_configurations:
            if config.configuration_id != CONFIGURATION:
                continue
            meta = {entry.key: entry.value for entry in node.metadata_props}
            partial = json.loads(meta.get(PARTIAL_KEY, "{}"))
            layouts = {}
            for spec in config.sharding_spec:
                layout = decode_spec(spec, devices)
                if spec.tensor_name in partial:
                    extra = partial[spec.tensor_name]
                    layout = Layout(layout.dims, tuple(extra["bits"]), ReduceOp(extra.get("op", "sum")))
                layouts[spec.tensor_name] = layout
            found[meta.get(OP_KEY, node.name)] = layouts
    return found


def read_annotations(model: onnx.ModelProto) -> dict[str, Strategy] | None:
    """{operator: in_strategy} from autopar's annotations, None when ``model`` has none.

    Each input's entry is the number of shards of each axis its sharding spec gives; an input
    without a spec (one the plan gives no layout) is whole: ones, as many as its rank.
    """
    layouts = read_layouts(model)
    if layouts is None:
        return None
    ranks: dict[str, int] = {}

    def rank_of() -> dict[str, int]:
        if not ranks:
            ranks.update({t: len(shape) for t, shape in _inferred_shapes(model).items()})
        return ranks

    strategies: dict[str, Strategy] = {}
    for node in model.graph.node:
        meta = {entry.key: entry.value for entry in node.metadata_props}
        name = meta.get(OP_KEY, node.name)
        if name not in layouts or not any(c.configuration_id == CONFIGURATION for c in node.device_configurations):
            continue
        if STRATEGY_KEY in meta:
            strategies[name] = tuple(tuple(int(f) for f in entry) for entry in json.loads(meta[STRATEGY_KEY]))
        else:
            strategies[name] = _strategy(name, node, layouts[name], rank_of)
    return strategies


def _strategy(
    name: str, node: onnx.NodeProto, layouts: Mapping[str, Layout], ranks: Callable[[], Mapping[str, int]]
) -> Strategy:
    """The in_strategy the input layouts spell: per input, the shard count of each axis."""
    entries: list[tuple[int, ...]] = []
    for tensor in node.input:
        if not tensor:
            entries.append(())
        elif tensor in layouts:
            entries.append(tuple(1 << len(bits) for bits in layouts[tensor].dims))
        elif tensor in ranks():
            entries.append((1,) * ranks()[tensor])
        else:
            raise AutoparError(f"Operator {name!r} has no sharding for input {tensor!r} of unknown rank.")
    return tuple(entries)


def annotated_strategies(model: onnx.ModelProto, devices: int) -> dict[str, Strategy] | None:
    """`read_annotations`, checked against the device count it is to run on."""
    count = annotated_devices(model)
    if count is None:
        return None
    if count != devices:
        raise PlanFileError(f"The model is annotated for {count} devices, so it cannot verify on {devices}.")
    return read_annotations(model)


# --- the model's side ------------------------------------------------------------------------------


def _nodes_for(plan: PlanFile, model: onnx.ModelProto) -> dict[str, onnx.NodeProto]:
    """Each planned operator's node: the one producing its outputs (ONNX tensors have one producer)."""
    producer = {out: node for node in model.graph.node for out in node.output if out}
    by_name = {node.name: node for node in model.graph.node if node.name}
    nodes: dict[str, onnx.NodeProto] = {}
    for op in plan.ops:
        outputs = [entry.tensor for entry in op.outputs if entry.tensor]
        node = producer.get(outputs[0]) if outputs else by_name.get(op.name)
        inputs = [entry.tensor for entry in op.inputs]
        if (
            node is None
            or node.op_type != op.op_type
            or any(out not in node.output for out in outputs)
            or any(t not in node.input for t in inputs)
        ):
            raise PlanFileError(
                f"The plan was made for another model ({plan.model!r}): this one has no {op.op_type} operator"
                f" {op.name!r} with the plan's tensors."
            )
        nodes[op.name] = node
    return nodes


def _clear(node: onnx.NodeProto) -> None:
    """Drop autopar's earlier annotations of ``node`` (a model exported twice), keep everyone else's."""
    configs = [c for c in node.device_configurations if c.configuration_id != CONFIGURATION]
    del node.device_configurations[:]
    node.device_configurations.extend(configs)
    props = [p for p in node.metadata_props if p.key not in (PARTIAL_KEY, OP_KEY, STRATEGY_KEY)]
    del node.metadata_props[:]
    node.metadata_props.extend(props)


def _inferred_shapes(model: onnx.ModelProto) -> dict[str, list[Dim]]:
    """Every tensor's shape the file states or ONNX shape inference finds (best effort)."""
    try:
        inferred = shape_inference.infer_shapes(model)
    except Exception:  # an exotic model: fall back to what the file itself says
        inferred = model
    shapes: dict[str, list[Dim]] = {}
    graph = inferred.graph
    for info in [*graph.input, *graph.value_info, *graph.output]:
        if info.type.HasField("tensor_type") and info.type.tensor_type.HasField("shape"):
            shapes[info.name] = [
                int(d.dim_value) if d.HasField("dim_value") else (d.dim_param or None)
                for d in info.type.tensor_type.shape.dim
            ]
    for init in graph.initializer:
        shapes[init.name] = [int(d) for d in init.dims]
    return shapes


def _shapes(model: onnx.ModelProto, plan: PlanFile) -> Mapping[str, list[Dim]]:
    """Shapes for ``dim_value``: symbolic sizes the plan's inputs bind become numbers."""
    shapes = _inferred_shapes(model)
    binding: dict[str, int] = {}
    if plan.context is not None:
        for name, bound in plan.context.inputs.items():
            for size, value in zip(shapes.get(name, []), bound):
                if isinstance(size, str):
                    binding[size] = value
    return {t: [binding.get(d, d) if isinstance(d, str) else d for d in shape] for t, shape in shapes.items()}


__all__ = [
    "CONFIGURATION",
    "OP_KEY",
    "PARTIAL_KEY",
    "STRATEGY_KEY",
    "annotate",
    "annotated_devices",
    "annotated_strategies",
    "decode_spec",
    "read_annotations",
    "read_layouts",
    "sharding_spec",
    "write",
]
