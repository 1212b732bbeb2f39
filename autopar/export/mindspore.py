"""The ``mindspore`` export: MindSpore's strategy checkpoint, and the same plan as ``shard()`` calls.

`write` makes two files from a plan:

* ``OUT`` (``{model}_strategy.ckpt`` by default): the protobuf ``ParallelStrategyMap`` of MindSpore's
  ``node_strategy.proto`` (`autopar.export.node_strategy_pb2`), the file MindSpore reads with
  ``set_auto_parallel_context(strategy_ckpt_config={"load_file": ...})``. One
  ``ParallelStrategyItem`` per operator: the ONNX node's name, its pipeline stage (0 without stages),
  and one ``ParallelStrategy`` per input holding the plan's in_strategy unchanged. One
  ``ParallelLayoutItem`` per parameter (trainable ones from the plan's gradient sync; with the model,
  the untrained ones too, by the importer's rule: frozen weights, BatchNorm's running statistics):
  ``dev_matrix``, ``tensor_map``,
  ``field`` 0, an empty ``param_split_shape`` / ``indices_offset`` (autopar has no manual field
  split), and ``opt_weight_shard_size`` / ``opt_weight_shard_step`` from the parallel optimizer
  (0 / 0 where it does not split the parameter, as MindSpore writes).
* ``OUT`` with the suffix ``.py`` (``{model}_strategy.py``): a readable Python module of MindSpore
  primitives with their ``.shard(in_strategy)``, one per ONNX node. Given an ``OUT`` ending in
  ``.py``, that is the snippet and the checkpoint goes to ``OUT`` with the suffix ``.ckpt``.

The device matrix and tensor map (MindSpore's ``TensorLayout``; see `device_matrix`): ranks are
numbered over the device matrix with its last axis varying fastest, and a tensor map entry counts
device-matrix axes from the right (0 is the last axis), -1 for a dimension not split. autopar's
rank bit 0 is the fastest, so an operator's mesh bits, highest first, are cut into runs of
adjacent bits that every one of its tensors uses alike (the same dimension, most significant bit
first; or all partial; or all unused); each run is one axis of size 2^len(run). A dimension split
by bits of more than one axis (bits that are not adjacent, or that another tensor of the operator
uses apart) gets MindSpore's nested form (``Layout(("dp", "mp"), ...)``): one ``TensorMap`` per
tensor dimension, each listing its axes, outer first (MindSpore reads a single TensorMap as the
flat form, so a 1-D tensor split over two axes reads back ambiguously there too).

ONNX node names are not MindSpore primitive names: the checkpoint keys strategies by the ONNX
name, and the snippet names, per node, the ONNX op type and the primitive it corresponds to
(`PRIMITIVES`, read from the operator registry: each operator's registration names its primitive).

>>> from autopar.layout import Layout
>>> x, w, y = Layout(((2,), ())), Layout(((), (1, 0))), Layout(((2,), (1, 0)))
>>> device_matrix([x, w, y], mesh_bits=3)   # MatMul ((2, 1), (1, 4)): axes bit 2 | bits 1-0
[(2,), (1, 0)]
>>> tensor_map(w, [(2,), (1, 0)])
[-1, 0]
>>> tensor_map(Layout(((2, 0), ())), [(2,), (1,), (0,)])  # bits 2 and 0: two axes, outer first
[[2, 0], -1]
"""

from __future__ import annotations

import keyword
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx

from autopar.errors import AutoparError
from autopar.export import node_strategy_pb2 as pb
from autopar.layout import Layout
from autopar.lowering.planfile import OpEntry, PlanFile
from autopar.ops.registry import MindSporePrimitive, mindspore_primitives

TensorMapEntry = int | list[int]


# ONNX op type -> MindSpore primitive (mindspore.ops), as each operator's registration names it
# (`autopar.ops.registry.MindSporePrimitive`). MatMul of two matrices is ops.MatMul, with batch
# dimensions ops.BatchMatMul; Conv of 4-D data is ops.Conv2D, of 5-D ops.Conv3D; Gemm is ops.MatMul
# then ops.BiasAdd (or ops.Add for a 2-D bias). None: no primitive does the same.
Primitive = MindSporePrimitive
PRIMITIVES: Mapping[str, Primitive | None] = mindspore_primitives()


# --- the device matrix and tensor map -------------------------------------------------------------


def _role(layout: Layout, bit: int) -> tuple[int, ...] | None:
    """What ``bit`` does in ``layout``: (dim, position) splitting a dimension, () partial, None unused."""
    for dim, bits in enumerate(layout.dims):
        if bit in bits:
            return (dim, bits.index(bit))
    return () if bit in layout.partial else None


def _follows(higher: tuple[int, ...] | None, lower: tuple[int, ...] | None) -> bool:
    """Whether bit b (role ``lower``) continues the axis of bit b+1 (role ``higher``) in one tensor."""
    if higher is None or lower is None or not higher or not lower:
        return higher == lower
    return lower == (higher[0], higher[1] + 1)


def device_matrix(layouts: Sequence[Layout], mesh_bits: int) -> list[tuple[int, ...]]:
    """An operator's device-matrix axes as runs of mesh bits, highest first (the run's bits too).

    Adjacent bits join one axis when every tensor of the operator uses them alike: splitting the
    same dimension with the higher bit just before the lower one, or both partial, or both unused.
    Axis i from the right is then the run whose lowest bit sits above i runs, so MindSpore's rank
    coordinates (last axis fastest) are exactly autopar's rank bits. Split factors of 1 have no axis.
    """
    runs: list[tuple[int, ...]] = []
    for bit in range(mesh_bits - 1, -1, -1):
        if runs and all(_follows(_role(layout, bit + 1), _role(layout, bit)) for layout in layouts):
            runs[-1] = runs[-1] + (bit,)
        else:
            runs.append((bit,))
    return runs


def tensor_map(layout: Layout, runs: Sequence[tuple[int, ...]]) -> list[TensorMapEntry]:
    """Per dimension, the device-matrix axis splitting it counted from the right (-1: not split).

    A dimension split by more than one axis gets the list of them, outer (more significant) first.
    """
    axis_of = {bit: len(runs) - 1 - index for index, run in enumerate(runs) for bit in run}
    entries: list[TensorMapEntry] = []
    for bits in layout.dims:
        axes: list[int] = []
        for bit in bits:
            if not axes or axes[-1] != axis_of[bit]:
                axes.append(axis_of[bit])
        covered = [bit for axis in axes for bit in runs[len(runs) - 1 - axis]]
        if covered != list(bits):
            raise AutoparError(f"Layout {layout.describe()} does not fit the device matrix {runs}.")
        entries.append(-1 if not axes else axes[0] if len(axes) == 1 else axes)
    return entries


def split_factors(dev_matrix: Sequence[int], tmap: Sequence[TensorMapEntry]) -> list[int]:
    """The tensor's strategy a (dev_matrix, tensor_map) pair means (MindSpore's ``_get_tensor_strategy``)."""
    factors = []
    for entry in tmap:
        factor = 1
        for axis in entry if isinstance(entry, list) else [entry]:
            if axis != -1:
                factor *= dev_matrix[len(dev_matrix) - 1 - axis]
        factors.append(factor)
    return factors


def optimizer_shard_step(bits: Sequence[int]) -> int:
    """MindSpore's ``opt_weight_shard_step``: the rank stride of the optimizer-shard group.

    MindSpore computes it from a group's sorted ranks as (last - first) / (size - 1); the group of
    rank 0 over ``bits`` runs from 0 to the sum of their values.

    >>> optimizer_shard_step([2, 1]), optimizer_shard_step([0])
    (2, 1)
    """
    size = 1 << len(bits)
    return sum(1 << bit for bit in bits) // (size - 1)


@dataclass(frozen=True)
class ParameterLayout:
    """One parameter's MindSpore layout, as the checkpoint holds it."""

    name: str
    op: str
    dev_matrix: list[int]
    tensor_map: list[TensorMapEntry]
    opt_weight_shard_step: int = 0
    opt_weight_shard_size: int = 0


def _op_layouts(op: OpEntry) -> list[Layout]:
    return [entry.layout.layout() for entry in (*op.inputs, *op.outputs)]


_FLOATING = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE}


def _stored_weights(model: onnx.ModelProto | None) -> set[str]:
    """The model's floating-point weights: stored initializers and elided ones (``ConstantOfShape``)."""
    if model is None:
        return set()
    names = {init.name for init in model.graph.initializer if init.data_type in _FLOATING}
    for node in model.graph.node:
        if node.op_type == "ConstantOfShape" and node.output:
            values = [attr.t for attr in node.attribute if attr.name == "value"]
            if not values or values[0].data_type in _FLOATING:  # no value: float zeros
                names.add(node.output[0])
    return names


def _weight_shapes(model: onnx.ModelProto | None) -> dict[str, list[int]]:
    """Shapes of the model's tensors that ONNX shape inference knows (initializers first)."""
    if model is None:
        return {}
    shapes = {init.name: [int(d) for d in init.dims] for init in model.graph.initializer}
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:  # the shapes only name Conv2D's arguments in the snippet
        return shapes
    for info in (*inferred.graph.value_info, *inferred.graph.input):
        dims = info.type.tensor_type.shape.dim
        if info.name not in shapes and all(d.HasField("dim_value") for d in dims):
            shapes[info.name] = [int(d.dim_value) for d in dims]
    return shapes


def _untrained_parameters(plan: PlanFile, model: onnx.ModelProto | None) -> set[str]:
    """The model's weights that are parameters but carry no gradient: frozen ones, running statistics.

    The importer's rule (`autopar.graph.build`): a stored or elided floating-point tensor that some
    operator reads other than as a configuration input, and, if it has one element, reads as a
    layer's weight; a one-element scale or a OneHot's values stay constants.
    """
    if model is None:
        return set()
    from autopar.graph.types import opset_of
    from autopar.ops import lookup

    stored = _stored_weights(model) - {entry.tensor for op in plan.ops for entry in op.outputs}
    shapes = _weight_shapes(model)
    opset = opset_of(model)
    domains = {node.name: node.domain for node in model.graph.node}
    weights: set[str] = set()
    for op in plan.ops:
        definition = lookup(op.op_type, domains.get(op.name, ""), opset)
        for position, entry in enumerate(op.inputs):
            if entry.tensor not in stored or (definition is not None and position in definition.config_inputs):
                continue
            shape = shapes.get(entry.tensor)
            if shape is None or not shape:
                continue
            if math.prod(shape) <= 1 and not (definition is not None and definition.weight_inputs):
                continue
            weights.add(entry.tensor)
    return weights


def parameter_layouts(plan: PlanFile, model: onnx.ModelProto | None = None) -> list[ParameterLayout]:
    """Every parameter's layout under the operator that owns it (the plan's gradient sync), in plan order.

    With ``model``, the parameters no gradient syncs (frozen weights, running statistics) follow,
    each under the first operator reading it.
    """
    ops = {op.name: op for op in plan.ops}
    owners: dict[str, tuple[str, Layout, int, int]] = {}
    for sync in plan.gradient_sync:
        step = size = 0
        if sync.optimizer_shards and sync.bits:
            size, step = sync.optimizer_shards, optimizer_shard_step(sync.bits)
        owners[sync.parameter] = (sync.op, sync.layout.layout(), step, size)
    others = _untrained_parameters(plan, model) - set(owners)
    for op in plan.ops:
        for entry in op.inputs:
            if entry.tensor in others and entry.tensor not in owners:
                owners[entry.tensor] = (op.name, entry.layout.layout(), 0, 0)
    layouts = []
    for name, (op_name, layout, step, size) in owners.items():
        op_layouts = _op_layouts(ops[op_name]) if op_name in ops else []
        runs = device_matrix([*op_layouts, layout], plan.mesh_bits)
        layouts.append(
            ParameterLayout(name, op_name, [1 << len(run) for run in runs], tensor_map(layout, runs), step, size)
        )
    return layouts


# --- the checkpoint -------------------------------------------------------------------------------


def strategy_map(plan: PlanFile, model: onnx.ModelProto | None = None) -> Any:
    """The plan as a ``ParallelStrategyMap`` message (`autopar.export.node_strategy_pb2`)."""
    message = pb.ParallelStrategyMap(current_stage=0)
    stage_of = plan.stage_of
    for op in plan.ops:
        item = message.parallel_strategy_item.add(node_name=op.name)
        item.parallel_strategys.stage = stage_of[op.name]
        for split in _mindspore_strategy(op):
            item.parallel_strategys.parallel_strategy.add().dim.extend(split)
    for param in parameter_layouts(plan, model):
        item = message.parallel_layout_item.add(param_name=param.name)
        layouts = item.parallel_layouts
        layouts.dev_matrix.add().dim.extend(param.dev_matrix)
        if any(isinstance(entry, list) for entry in param.tensor_map):  # nested: one TensorMap per dimension
            for entry in param.tensor_map:
                layouts.tensor_map.add().dim.extend(entry if isinstance(entry, list) else [entry])
        else:
            layouts.tensor_map.add().dim.extend(param.tensor_map)
        layouts.param_split_shape.add()
        layouts.indices_offset.add()
        layouts.field = 0
        layouts.opt_weight_shard_step = param.opt_weight_shard_step
        layouts.opt_weight_shard_size = param.opt_weight_shard_size
    return message


def _labels_read_whole(op: OpEntry) -> bool:
    """A loss whose scores split by samples while its labels are read whole (a mean over the labels not
    ignored, `autopar.ops.loss.counted_mean`)."""
    if op.op_type not in ("SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss") or len(op.strategy) < 2:
        return False
    return any(f > 1 for f in op.strategy[0]) and all(f == 1 for f in op.strategy[1])


def _mindspore_strategy(op: OpEntry) -> list[list[int]]:
    """The in_strategy MindSpore can run: a loss's labels split as its logits' samples are (its primitive
    checks that each device's logits and labels hold the same samples; it has no ignore_index, so it
    averages each shard, where autopar divides by the whole batch's count of labels kept)."""
    splits = [list(split) for split in op.strategy]
    if _labels_read_whole(op):
        samples = splits[0][:1] + splits[0][2:]
        splits[1] = samples[: len(splits[1])]
    return splits


def read_strategies(data: bytes) -> dict[str, tuple[tuple[int, ...], ...]]:
    """A strategy checkpoint's in_strategy per node, as `PlanFile.strategies` gives them."""
    message = pb.ParallelStrategyMap.FromString(data)
    return {
        item.node_name: tuple(tuple(split.dim) for split in item.parallel_strategys.parallel_strategy)
        for item in message.parallel_strategy_item
    }


# --- the shard() snippet --------------------------------------------------------------------------


def _identifier(name: str, taken: set[str]) -> str:
    base = re.sub(r"\W", "_", name) or "op"
    if base[0].isdigit() or keyword.iskeyword(base):
        base = f"op_{base}"
    candidate, count = base, 1
    while candidate in taken:
        count += 1
        candidate = f"{base}_{count}"
    taken.add(candidate)
    return candidate


def _strategy_text(splits: Sequence[Sequence[int]]) -> str:
    return repr(tuple(tuple(split) for split in splits))


def _conv_arguments(node: onnx.NodeProto | None, weights: dict[str, list[int]]) -> str | None:
    """Conv2D's constructor arguments from the ONNX node and its weight's shape, None if unknown."""
    if node is None or len(node.input) < 2 or node.input[1] not in weights:
        return None
    shape = weights[node.input[1]]
    attrs = {attr.name: onnx.helper.get_attribute_value(attr) for attr in node.attribute}
    if len(shape) != 4 or attrs.get("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET"):
        return None
    pads = list(attrs.get("pads", [0, 0, 0, 0]))
    args = [f"out_channel={shape[0]}", f"kernel_size={tuple(shape[2:])}", 'pad_mode="pad"']
    args.append(f"pad={(pads[0], pads[2], pads[1], pads[3])}")  # ONNX (t, l, b, r) -> (t, b, l, r)
    args.append(f"stride={tuple(attrs.get('strides', [1, 1]))}")
    args.append(f"dilation={tuple(attrs.get('dilations', [1, 1]))}")
    args.append(f"group={attrs.get('group', 1)}")
    return ", ".join(args)


def _calls(op: OpEntry, var: str, node: onnx.NodeProto | None, weights: dict[str, list[int]]) -> list[str]:
    """The snippet's lines for one operator."""
    primitive = PRIMITIVES.get(op.op_type)
    splits = _mindspore_strategy(op)
    header = f"# {op.name}: ONNX {op.op_type}"
    if _labels_read_whole(op):
        header += (
            " (autopar reads the labels whole and divides each shard's losses by the whole batch's count of labels"
            " not ignored; MindSpore's primitive averages each shard: equal where every shard keeps as many)"
        )
    if primitive is None:
        return [f"{header}, no MindSpore primitive; in_strategy {_strategy_text(splits)}"]
    name = primitive.name
    if op.op_type == "MatMul" and any(len(split) != 2 for split in splits[:2]):
        name = "ops.BatchMatMul"
    if op.op_type == "Conv" and splits and len(splits[0]) == 5:
        name = "ops.Conv3D"
    shard = splits if primitive.inputs is None else splits[: primitive.inputs]
    args = ""
    if op.op_type == "Gemm" and node is not None:
        attrs = {attr.name: onnx.helper.get_attribute_value(attr) for attr in node.attribute}
        flags = [f"transpose_{side}=True" for side, attr in (("a", "transA"), ("b", "transB")) if attrs.get(attr)]
        args = ", ".join(flags)
    note = f" ({primitive.note})" if primitive.note and name == primitive.name else ""
    lines = [f"{header} -> {name}{note}"]
    if primitive.needs_args:
        known = _conv_arguments(node, weights) if name == "ops.Conv2D" else None
        if known is None:
            lines.append(f"# {var} = {name}(...).shard({_strategy_text(shard)})  # arguments as in your network")
            return lines
        args = known
    unknown_flags = "  # transpose_a/_b: the ONNX node's transA/transB" if op.op_type == "Gemm" and node is None else ""
    lines.append(f"{var} = {name}({args}).shard({_strategy_text(shard)}){unknown_flags}")
    if op.op_type == "Gemm" and len(splits) > 2 and op.outputs:
        out = op.outputs[0].layout.layout()
        rows, cols = out.split(0), out.split(1)
        if len(splits[2]) == 2:
            lines.append(f"{var}_bias = ops.Add().shard((({rows}, {cols}), {tuple(splits[2])}))")
        else:
            lines.append(f"{var}_bias = ops.BiasAdd().shard((({rows}, {cols}), ({cols},)))")
    return lines


def _pipeline_comment(plan: PlanFile) -> list[str]:
    """How the plan's stages map onto MindSpore's: each Cell's ``pipeline_stage``, and the micro-batches."""
    if plan.pipeline is None:
        return []
    lines = [
        "# pipeline: set each Cell's pipeline_stage to the stage of its operators, and wrap the network as",
        f"# nn.PipelineCell(net, micro_size={plan.pipeline.micro_batches}); the stages start at:",
    ]
    lines += [f"#   stage {i}: {stage.first_op} .. {stage.last_op}" for i, stage in enumerate(plan.pipeline.stages)]
    return lines


def snippet(plan: PlanFile, model: onnx.ModelProto | None = None, checkpoint: str = "strategy.ckpt") -> str:
    """The plan as a Python module of MindSpore primitives with their ``shard()`` strategies."""
    nodes = {node.name: node for node in model.graph.node} if model is not None else {}
    weights = _weight_shapes(model)
    taken: set[str] = {"ms", "ops", "SHARDED"}
    body: list[str] = []
    sharded: list[tuple[str, str]] = []
    for op in plan.ops:
        var = _identifier(op.name, taken)
        lines = _calls(op, var, nodes.get(op.name), weights)
        body.extend(lines)
        if any(line.startswith(f"{var} = ") for line in lines):
            sharded.append((op.name, var))
    head = [
        f'"""MindSpore shard() calls for autopar\'s plan of {plan.model!r} on {plan.devices} devices.',
        "",
        "Written by `autopar export --to mindspore` beside the strategy checkpoint",
        f"{checkpoint!r} (load it with ms.set_auto_parallel_context(strategy_ckpt_config=",
        '{"load_file": ...})). ONNX node names are not MindSpore names: each primitive below is the',
        "one its ONNX node corresponds to, with the plan's in_strategy for its tensor inputs (inputs",
        "ONNX passes where MindSpore takes constructor arguments are left out). Build your network's",
        "primitives this way; a commented line needs constructor arguments the plan does not hold.",
        '"""',
        "",
        "import mindspore as ms",
        "from mindspore import ops",
        "",
        f'# ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num={plan.devices}'
        + (f", pipeline_stages={len(plan.pipeline.stages)})" if plan.pipeline else ")"),
        *_pipeline_comment(plan),
        "",
    ]
    tail = ["", "# ONNX node name -> its sharded primitive", "SHARDED = {"]
    tail += [f"    {name!r}: {var}," for name, var in sharded]
    tail.append("}")
    return "\n".join(head + body + tail) + "\n"


# --- writing --------------------------------------------------------------------------------------


def output_paths(out: Path) -> tuple[Path, Path]:
    """(checkpoint, snippet): ``OUT`` and ``OUT`` as ``.py``; for an ``OUT`` ending in .py, ``OUT`` as ``.ckpt``.

    >>> [str(path) for path in output_paths(Path("resnet50_strategy.ckpt"))]
    ['resnet50_strategy.ckpt', 'resnet50_strategy.py']
    >>> [str(path) for path in output_paths(Path("plan.py"))]
    ['plan.ckpt', 'plan.py']
    """
    if out.suffix == ".py":
        return out.with_suffix(".ckpt"), out
    return out, out.with_suffix(".py")


def _write(path: Path, data: bytes) -> None:
    try:
        path.write_bytes(data)
    except OSError as exc:
        raise AutoparError(f"Cannot write {str(path)!r}: {exc.strerror or exc}.") from None


def write(plan: PlanFile, model: onnx.ModelProto | None, out: Path) -> list[Path]:
    """Write the strategy checkpoint and the shard() snippet for ``plan``; the two paths."""
    checkpoint, code = output_paths(Path(out))
    _write(checkpoint, strategy_map(plan, model).SerializeToString())
    _write(code, snippet(plan, model, checkpoint.name).encode("utf-8"))
    return [checkpoint, code]


__all__ = [
    "PRIMITIVES",
    "ParameterLayout",
    "Primitive",
    "device_matrix",
    "optimizer_shard_step",
    "output_paths",
    "parameter_layouts",
    "read_strategies",
    "snippet",
    "split_factors",
    "strategy_map",
    "tensor_map",
    "write",
]
