"""Shapes computed in the graph: shape chains folded until every size is static, or one named.

Exporters write sizes as arithmetic on other tensors' shapes (``Shape → Gather → Mul →
Concat → Reshape``; pad sizes of a window attention, ``Shape → Sub → Mod → Pad``; an
encoder-decoder's ``Where(Equal(...)) → Expand``). ONNX's data propagation follows some of these
operators and gives up on the rest, leaving a generated symbol (``unk__0``) that names nothing
the user could bind. Once the batch and the input dimensions are bound, every such chain is a
function of static shapes and constants: `resolve_shapes` evaluates it once (as the importer
folds any constant, `fold.fold_constant`), writes each integer result the rest of the graph
reads back into the model as a ``Constant`` with the same output name, and infers shapes again,
until no size is left unknown or nothing more folds. A model whose sizes inference already
knows is left exactly as it was.

A size that still cannot be known (it depends on data: ``NonZero``, a ``TopK`` whose ``k`` is
an input) is named by its tensor and axis, ``"TENSOR:AXIS"``, the key `ComputedDimensionError`
asks the user to bind and `bind_computed` accepts: the binding is declared on that tensor, and
inference follows it downstream.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx
from onnx import numpy_helper

from autopar.errors import ComputedDimensionError, ModelImportError
from autopar.graph.bind import infer_refolded, infer_shapes
from autopar.graph.fold import KnownValue, fold_constant
from autopar.graph.proto import data_inputs, value_infos

MAX_ROUNDS = 32
"""Each round folds at least one chain that the previous inference could not size; real exports need two or three."""


def split_computed(dims: Mapping[str, int], proto: onnx.ModelProto) -> tuple[dict[str, int], dict[str, int]]:
    """The bindings of the inputs' symbols, and those of computed sizes (``"TENSOR:AXIS"`` keys).

    A key is a computed size when it is no input's symbol, ends in ``:AXIS`` and names a tensor an
    operator writes; anything else stays with the input symbols, where an unknown name is refused.
    """
    symbols = {
        dim.dim_param
        for vi in data_inputs(proto)
        if vi.type.HasField("tensor_type")
        for dim in vi.type.tensor_type.shape.dim
        if dim.HasField("dim_param")
    }
    written = {out for node in proto.graph.node for out in node.output if out}
    inputs: dict[str, int] = {}
    computed: dict[str, int] = {}
    for key, value in dims.items():
        tensor, sep, axis = key.rpartition(":")
        if key not in symbols and sep and axis.isdigit() and tensor in written:
            computed[key] = value
        else:
            inputs[key] = value
    return inputs, computed


def resolve_shapes(proto: onnx.ModelProto, computed: Mapping[str, int], checked: bool = False) -> onnx.ModelProto:
    """Infer shapes (strictly), folding shape chains and applying ``computed`` bindings until every
    size an operator reads is static or no round changes anything; then check that none is unknown.
    ``checked``: as `bind.infer_shapes` takes it.
    """
    inferred = infer_shapes(proto, checked)
    applied: set[str] = set()
    propagated = True  # the last inference followed the shape arithmetic (data propagation)
    for _ in range(MAX_ROUNDS):
        if not _unknown_sizes(inferred):
            break
        changed = _fold_chains(inferred)
        if propagated:  # a size only propagation finds is not the user's to bind
            changed |= _bind_computed(inferred, computed, applied)
        if not changed and propagated:
            break
        if not changed:  # folding stops where only propagation sizes what is left
            inferred, propagated = infer_shapes(inferred), True
            continue
        _forget_inferred(inferred, {key.rpartition(":")[0] for key in applied})
        # the chains the last inference sized are folded now: the next round sizes what they feed, without
        # propagation, which in a deep export costs more than the rest of its import (Mixtral's 32 layers,
        # its causal mask's four index constants of a million entries: 19.7 s, where 0.2 s)
        inferred, propagated = infer_refolded(inferred)
    if not propagated and _unknown_sizes(inferred):  # the rounds ran out: what propagation finds counts
        inferred = infer_shapes(inferred)
    for key in sorted(set(computed) - applied):
        tensor, _, axis = key.rpartition(":")
        raise ModelImportError(
            f"Dimension binding {key!r} names axis {axis} of tensor {tensor!r}, whose size there is not computed"
            " at run time (bind only a size the import asks for)."
        )
    _check_known(inferred)
    return inferred


def _read(proto: onnx.ModelProto) -> set[str]:
    return {name for node in proto.graph.node for name in node.input if name} | {o.name for o in proto.graph.output}


def _unknown_sizes(proto: onnx.ModelProto) -> list[tuple[onnx.NodeProto, str, int]]:
    """(producer, tensor, axis) of each size an operator reads or the graph returns that inference
    left unknown, in the file's order."""
    infos = value_infos(proto)
    read = _read(proto)
    found = []
    for node in proto.graph.node:
        for out in node.output:
            if not out or out not in read:
                continue
            vi = infos.get(out)
            if vi is None or not vi.type.HasField("tensor_type"):
                continue
            tensor_type = vi.type.tensor_type
            if not tensor_type.HasField("shape"):
                found.append((node, out, -1))
                continue
            found += [(node, out, axis) for axis, d in enumerate(tensor_type.shape.dim) if not d.HasField("dim_value")]
    return found


def _fold_chains(proto: onnx.ModelProto) -> bool:
    """Replace each integer value that folds and that an operator which does not fold reads by a
    ``Constant`` of that value; drop the folded operators nothing reads any more. Whether any was."""
    infos = value_infos(proto)
    constants: dict[str, KnownValue] = {
        init.name: numpy_helper.to_array(init)
        for init in proto.graph.initializer
        if init.data_location != onnx.TensorProto.EXTERNAL
    }
    outputs = {o.name for o in proto.graph.output}
    folded: dict[int, np.ndarray] = {}
    for position, node in enumerate(proto.graph.node):
        if set(node.output) & outputs:
            continue
        value = fold_constant(node, constants, infos, proto)
        if value is None:
            continue
        constants[node.output[0]] = value
        if node.op_type != "Constant" and isinstance(value, np.ndarray) and value.dtype.kind in "iub":
            folded[position] = value
    readers_left = {
        name
        for position, node in enumerate(proto.graph.node)
        if node.op_type != "Constant" and position not in folded
        for name in node.input
    } | outputs
    frontier = {p: v for p, v in folded.items() if proto.graph.node[p].output[0] in readers_left}
    if not frontier:
        return False
    nodes = list(proto.graph.node)
    for position, value in frontier.items():
        node = nodes[position]
        nodes[position] = onnx.helper.make_node(
            "Constant", [], [node.output[0]], name=node.name, value=numpy_helper.from_array(value)
        )
    nodes = _without_dead(nodes, set(folded) - set(frontier), outputs)
    del proto.graph.node[:]
    proto.graph.node.extend(nodes)
    return True


def _without_dead(nodes: list[onnx.NodeProto], removable: set[int], outputs: set[str]) -> list[onnx.NodeProto]:
    """The operators, less those of ``removable`` (folded ones) whose outputs nothing reads, repeatedly;
    also the operators whose only readers were removed and that only fed shape chains (``Shape``,
    ``Constant``)."""
    alive = set(range(len(nodes)))
    while True:
        read = {name for p in alive for name in nodes[p].input if name} | outputs
        dead = {
            p
            for p in alive
            if (p in removable or nodes[p].op_type in ("Shape", "Size", "Constant"))
            and not any(out in read for out in nodes[p].output if out)
        }
        if not dead:
            return [nodes[p] for p in sorted(alive)]
        alive -= dead


def _bind_computed(proto: onnx.ModelProto, computed: Mapping[str, int], applied: set[str]) -> bool:
    """Declare each computed size the user bound on its tensor, once inference has typed it."""
    infos = value_infos(proto)
    changed = False
    for key, value in sorted(computed.items()):
        tensor, _, text = key.rpartition(":")
        vi = infos.get(tensor)
        if key in applied or vi is None or not vi.type.tensor_type.HasField("shape"):
            continue
        dims = vi.type.tensor_type.shape.dim
        axis = int(text)
        if axis >= len(dims):
            raise ModelImportError(f"Dimension binding {key!r} names axis {axis}, but {tensor!r} has {len(dims)} axes.")
        if dims[axis].HasField("dim_value"):
            continue  # known already: reported unless a later round leaves it unknown
        dims[axis].dim_value = value
        applied.add(key)
        if not any(vi.name == tensor for vi in proto.graph.value_info) and tensor not in {
            o.name for o in proto.graph.output
        }:
            proto.graph.value_info.append(vi)
        changed = True
    return changed


def _forget_inferred(proto: onnx.ModelProto, keep: set[str]) -> None:
    """Drop the inferred intermediate and output shapes (a folded chain's sizes replace their symbols),
    except those the user bound."""
    kept = [vi for vi in proto.graph.value_info if vi.name in keep]
    del proto.graph.value_info[:]
    proto.graph.value_info.extend(kept)
    for out in proto.graph.output:
        if out.name not in keep and out.type.HasField("tensor_type"):
            out.type.tensor_type.ClearField("shape")


def _check_known(proto: onnx.ModelProto) -> None:
    """A size still unknown after folding, with every input bound, is computed from data: name it by
    tensor and axis (the first in the file's order, which the others usually follow from)."""
    symbols = {
        dim.dim_param
        for vi in data_inputs(proto)
        if vi.type.HasField("tensor_type")
        for dim in vi.type.tensor_type.shape.dim
        if dim.HasField("dim_param")
    }
    if symbols:
        return  # an input's symbol left unbound: the build asks for it, and binding it may size the rest
    for node, tensor, axis in _unknown_sizes(proto):
        if axis < 0:
            continue  # a whole shape unknown: the build names the tensor
        raise ComputedDimensionError(tensor, axis, node.op_type, node.name or node.output[0])
