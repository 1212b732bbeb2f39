"""Binding sizes: the batch and symbolic dimensions, then shape inference with data propagation (once per
file content where nothing else needs it: `_strict_inference`).

A contract for the steps after it: every data input has the requested batch and dimensions,
every Reshape target that hard-coded the file's batch follows the new one, and shape inference
has run strictly; a Reshape that would change its element count is an error here, not a
silently wrong plan later.
"""

from __future__ import annotations

import collections
import hashlib
import math
import re
from collections.abc import Container

import numpy as np
import onnx
from onnx import numpy_helper, shape_inference

from autopar import context
from autopar.errors import ModelImportError, UnknownSymbolError
from autopar.graph.proto import attributes, data_inputs, value_infos
from autopar.graph.types import opset_of
from autopar.limits import MAX_DIMENSION


def check_bindings(batch: int | None, dims: dict[str, int]) -> None:
    """Sizes are integers from 1 to `MAX_DIMENSION` (checked before anything is inferred)."""
    if batch is not None and (isinstance(batch, bool) or not isinstance(batch, int)):
        raise ModelImportError(f"The batch size must be an integer, got {batch!r}.")
    if batch is not None and not 1 <= batch <= MAX_DIMENSION:
        raise ModelImportError(f"The batch size must be an integer from 1 to {MAX_DIMENSION:,}, got {batch}.")
    for key, value in dims.items():
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_DIMENSION:
            raise ModelImportError(
                f"Dimension {key!r} must be bound to an integer from 1 to {MAX_DIMENSION:,}, got {value!r}."
            )


def check_declared_sizes(proto: onnx.ModelProto, batch: int | None = None) -> None:
    """The file's own input sizes are within the limits too (checked before any inference runs).

    With a batch given, a placeholder leading size (0 or -1, as some converters write) is allowed:
    the batch replaces it; a leading size too large for inference to hold is still refused.
    """
    for vi in data_inputs(proto):
        shape = vi.type.tensor_type.shape.dim if vi.type.HasField("tensor_type") else []
        for axis, dim in enumerate(shape):
            if not dim.HasField("dim_value"):
                continue
            if axis == 0 and batch is not None and dim.dim_value <= MAX_DIMENSION:
                continue
            if not 1 <= dim.dim_value <= MAX_DIMENSION:
                raise ModelImportError(
                    f"Input {vi.name!r} has size {dim.dim_value} on axis {axis}; a dimension must be from 1 to"
                    f" {MAX_DIMENSION:,}."
                )


def bind_dimensions(proto: onnx.ModelProto, batch: int | None, dims: dict[str, int]) -> onnx.ModelProto:
    """Set the leading dimension of every data input to ``batch`` and named symbols to ``dims``."""
    known_params = set()
    for vi in data_inputs(proto):
        if not vi.type.HasField("tensor_type") or not vi.type.tensor_type.HasField("shape"):
            continue
        for position, dim in enumerate(vi.type.tensor_type.shape.dim):
            if dim.HasField("dim_param"):
                known_params.add(dim.dim_param)
                if dim.dim_param in dims:
                    dim.dim_value = dims[dim.dim_param]
            if position == 0 and batch is not None:
                dim.dim_value = batch
    unknown = sorted(set(dims) - known_params)
    if unknown:
        raise UnknownSymbolError(unknown, sorted(known_params))
    # Declared intermediate and output shapes may contradict the new bindings: let inference redo them.
    del proto.graph.value_info[:]
    for out in proto.graph.output:
        if out.type.HasField("tensor_type"):
            out.type.tensor_type.ClearField("shape")
    return proto


def declared_batch(proto: onnx.ModelProto) -> int | None:
    """The batch the file declares: its first data input's leading size, where that is a number."""
    return _declared_batch(proto)


def at_another_batch(error: ModelImportError, batch: int | None, declared: int | None) -> ModelImportError:
    """An inference failure at a batch the caller gave, other than the file's: said so, since the graph most often
    fixes its batch somewhere (a mask or position table exported at that size), which no rebinding changes."""
    said = str(error)
    if batch is None or declared is None or batch == declared or not said.startswith(_INFERENCE_FAILED):
        return error
    return ModelImportError(
        f"{said.rstrip('.')} (at a batch of {batch}, where the file was exported at {declared}: its graph may fix"
        " that size; plan it at its own batch)."
    )


def _declared_batch(proto: onnx.ModelProto) -> int | None:
    for vi in data_inputs(proto):
        dims = vi.type.tensor_type.shape.dim if vi.type.HasField("tensor_type") else []
        if dims and dims[0].HasField("dim_value") and dims[0].dim_value > 0:  # not a placeholder (0, -1)
            return int(dims[0].dim_value)
    return None


def rebatch_reshapes(proto: onnx.ModelProto, batch: int, key: bytes | None = None) -> None:
    """Exported CNNs often hard-code the batch in a Reshape target (``[1, 2048]``): rewrite it.

    A target is rewritten when the reshaped tensor's leading dimension is the file's batch and
    the target's first entry is that batch, or the batch times the dimensions after it that the
    Reshape merges into it (``[batch * seq, vocab]``; not for a batch of 1, which would match any
    flattening): so the entry is the batch, not a feature. An Expand's target is rewritten where
    both lead with the file's batch (grouped-query attention's ``repeat_kv`` writes
    ``[batch, kv_heads, groups, seq, head_dim]``). A tensor leading with a batch's tokens (the batch
    times the sizes after it in a data input: a router's scores over every token) is reshaped so too,
    where the target names every size (no -1, so that a size the batch does not hold is refused by the
    element count, never reshaped otherwise). ``key``: the file's `content_key`, where the caller has it.
    """
    old = _declared_batch(proto)
    if old is None or old == batch:
        return
    infos = _file_shapes(proto, key or content_key(proto))
    if infos is None:
        return  # the strict inference after binding reports the problem
    tokens, from_data = _batch_leading(proto, old), _read_from_data(proto)
    initializers = {init.name: init for init in proto.graph.initializer}
    for node in proto.graph.node:
        if node.op_type not in ("Reshape", "Expand") or node.domain or len(node.input) < 2:
            continue
        if node.input[1] not in initializers:
            continue
        target = numpy_helper.to_array(initializers[node.input[1]])
        dims = infos.get(node.input[0], ())
        if target.ndim != 1 or not target.size or not dims:
            continue
        if dims[0] != old:
            if _token_reshape(node, target, dims, old, tokens, from_data):
                _read_rebatched(proto, initializers, node, 1, target, old, batch)
            continue
        if node.op_type == "Expand" and (old == 1 or int(target[0]) != old):
            continue
        merged = [1]
        for size in dims:
            if size <= 0:
                break
            merged.append(merged[-1] * size)
        if int(target[0]) not in (merged[1:] if old > 1 else [1]):  # a batch of 1 merges into anything
            continue
        _read_rebatched(proto, initializers, node, 1, target, old, batch)


def _token_reshape(
    node: onnx.NodeProto, target: np.ndarray, dims: tuple[int, ...], old: int, tokens: set[int], from_data: set[str]
) -> bool:
    """Whether a Reshape of a tensor computed from the data, leading with a multiple of the file's batch ``old``
    (a batch's tokens, or each token's experts), leads its target with the batch or its tokens: a router's
    scores gathered per token, then split back into the batch's sequences. Only a target naming every size
    (no -1): a size the batch does not hold is then refused by the element count, never reshaped otherwise."""
    return (
        node.op_type == "Reshape"
        and old > 1  # (a batch of 1 divides every size)
        and node.input[0] in from_data
        and dims[0] > 0
        and dims[0] % old == 0
        and int(target[0]) in tokens | {old}
        and not (target <= 0).any()
    )


def _read_from_data(proto: onnx.ModelProto) -> set[str]:
    """The tensors computed from the data inputs (their sizes may follow the batch), in whatever order the file
    lists its nodes."""
    found = {vi.name for vi in data_inputs(proto)}
    pending = list(proto.graph.node)
    while pending:
        left = [node for node in pending if not any(name in found for name in node.input)]
        if len(left) == len(pending):
            break
        for node in pending:
            if any(name in found for name in node.input):
                found.update(name for name in node.output if name)
        pending = left
    return found


def _read_rebatched(
    proto: onnx.ModelProto,
    initializers: dict[str, onnx.TensorProto],
    node: onnx.NodeProto,
    slot: int,
    target: np.ndarray,
    old: int,
    batch: int,
) -> None:
    """Make ``node`` read, at ``slot``, the shape ``target`` with its first entry (the file's batch ``old``, or a
    multiple of it) scaled to ``batch``: an initializer of its own, which other readers of the file's keep."""
    rewritten = target.copy()
    rewritten[0] = int(target[0]) // old * batch
    new_name = f"{node.input[slot]}__batch{batch}"
    if new_name not in initializers:
        initializers[new_name] = numpy_helper.from_array(rewritten, new_name)
        proto.graph.initializer.append(initializers[new_name])
        if proto.ir_version < 4:  # before IR 4 every initializer is also a graph input
            proto.graph.input.append(
                onnx.helper.make_tensor_value_info(new_name, onnx.TensorProto.INT64, list(rewritten.shape))
            )
    node.input[slot] = new_name


def rebatch_filled(proto: onnx.ModelProto, batch: int, buffers: Container[str]) -> None:
    """A buffer the model fills at its batch (``new_empty(batch, ...)``, ``ones(batch * seq, 1)``), which the
    exporter folds into a ConstantOfShape of a stored shape, is filled at ``batch``: those of ``buffers``
    (`build.scattered_buffers`: what scatters alone read; a weight a builder elides as ConstantOfShape keeps
    its sizes, whatever they are).

    A shape is rewritten when its first entry is the file's batch, or the batch times the sizes after it in
    a data input (a batch of sequences' tokens), as `rebatch_reshapes` reads a Reshape's target; not for a
    batch of 1, which would match any size. DeepSeek-V3's key states are written into such a buffer.

    >>> from onnx import helper
    >>> graph = helper.make_graph(
    ...     [helper.make_node("ConstantOfShape", ["shape"], ["buffer"])], "g",
    ...     [helper.make_tensor_value_info("ids", onnx.TensorProto.INT64, [8, 16])],
    ...     [helper.make_tensor_value_info("buffer", onnx.TensorProto.FLOAT, None)],
    ...     [numpy_helper.from_array(np.array([128, 1], dtype=np.int64), "shape")])
    >>> proto = helper.make_model(graph)
    >>> rebatch_filled(proto, 2, {"buffer"})
    >>> proto.graph.node[0].input[0], numpy_helper.to_array(proto.graph.initializer[-1]).tolist()
    ('shape__batch2', [32, 1])
    """
    old = _declared_batch(proto)
    if old is None or old == batch or old == 1:
        return
    leading = {old} | _batch_leading(proto, old)
    initializers = {init.name: init for init in proto.graph.initializer}
    for node in proto.graph.node:
        if node.op_type != "ConstantOfShape" or node.domain or not node.input or node.input[0] not in initializers:
            continue
        if node.output[0] not in buffers:
            continue
        target = numpy_helper.to_array(initializers[node.input[0]])
        if target.ndim == 1 and target.size and int(target[0]) in leading:
            _read_rebatched(proto, initializers, node, 0, target, old, batch)


def _batch_leading(proto: onnx.ModelProto, old: int) -> set[int]:
    """The sizes a batch's tokens lead a tensor with: the file's batch ``old`` times the sizes after it in a
    data input that leads with it (``[batch, seq]``: batch x seq), the batch itself left out."""
    found: set[int] = set()
    for vi in data_inputs(proto):
        dims = list(vi.type.tensor_type.shape.dim) if vi.type.HasField("tensor_type") else []
        if not dims or not dims[0].HasField("dim_value") or dims[0].dim_value != old:
            continue
        merged = old
        for dim in dims[1:]:
            if not dim.HasField("dim_value") or dim.dim_value <= 0:
                break
            merged *= dim.dim_value
            if merged != old:
                found.add(merged)
    return found


# operators that read a stored table element by element (a mask added to scores, a mask selected by)
_ELEMENT_WISE_READERS = frozenset(
    {"Add", "Sub", "Mul", "Div", "Where", "And", "Or", "Xor", "Not", "Equal"}
    | {"Less", "LessOrEqual", "Greater", "GreaterOrEqual"}
)
_SCATTERS = frozenset({"ScatterElements", "ScatterND"})  # a uniform table each writes into is read element by element
# operators a table passes through on its way to such a reader, where they leave its first axis first and whole
_PASSING = frozenset({"Unsqueeze", "Concat", "Slice", "Cast"})


def rebatch_constants(proto: onnx.ModelProto, batch: int) -> None:
    """A stored table that holds one slice per sample of the file's batch, each the same (the causal mask a
    Hugging Face model expands to the batch it was exported at, its positions) or each its sample's index
    (the batch coordinate of the index grids transformers' masks gather by), is stored again for ``batch``
    samples: each sample's slice stays the slice it was.

    Only tables at least two-dimensional, leading with the file's batch (or, each slice the same, its tokens:
    `_batch_leading`), and read sample by sample along that axis (`_read_per_sample`): element by element,
    written into by a scatter (``zeros_like`` folded into a stored table), or gathered by or from with
    GatherND, directly or through an Unsqueeze, Concat, Slice or Cast that leaves that axis first and whole.
    """
    old = _declared_batch(proto)
    if old is None or old == batch or old == 1:
        return
    readers: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
    for node in proto.graph.node:
        for slot, name in enumerate(node.input):
            readers.setdefault(name, []).append((node, slot))
    constants = _small_constants(proto)
    leading = {old} | _batch_leading(proto, old)
    for index, tensor in enumerate(proto.graph.initializer):
        if len(tensor.dims) < 2 or tensor.dims[0] not in leading or tensor.data_location == onnx.TensorProto.EXTERNAL:
            continue
        if not _read_per_sample(tensor.name, len(tensor.dims), readers, constants):
            continue
        value = numpy_helper.to_array(tensor)
        rows = int(tensor.dims[0]) // old * batch
        if (value == value[:1]).all():
            new = np.broadcast_to(value[:1], (rows, *value.shape[1:]))
        elif rows == batch and value.dtype.kind in "iu" and (value == _sample_index(old, value.ndim)).all():
            new = np.broadcast_to(_sample_index(batch, value.ndim), (rows, *value.shape[1:])).astype(value.dtype)
        else:
            continue
        proto.graph.initializer[index].CopyFrom(numpy_helper.from_array(np.ascontiguousarray(new), tensor.name))


def _sample_index(batch: int, ndim: int) -> np.ndarray:
    """Each sample's index along the first of ``ndim`` axes (the others of size 1, to broadcast).

    >>> _sample_index(3, 2).tolist()
    [[0], [1], [2]]
    """
    return np.arange(batch).reshape((batch,) + (1,) * (ndim - 1))


def _read_per_sample(
    name: str,
    rank: int,
    readers: dict[str, list[tuple[onnx.NodeProto, int]]],
    constants: dict[str, np.ndarray],
) -> bool:
    """Whether ``name`` (of ``rank`` axes) is read, and only read, sample by sample along its first axis: by
    an element-wise reader, a scatter writing into it, a GatherND (data or indices, no batch dims), or an
    operator of `_PASSING` that keeps that axis first and whole (what it names of it is a stored constant
    here) and whose outputs are read so in turn."""
    found = readers.get(name)
    if not found:
        return False
    for node, slot in found:
        op = node.op_type
        if op in _ELEMENT_WISE_READERS or (op in _SCATTERS and slot == 0):
            continue
        if op == "GatherND" and slot in (0, 1) and not int(attributes(node).get("batch_dims", 0)):
            continue
        after = _rank_after(node, slot, rank, constants) if op in _PASSING else None
        if after is None or not all(_read_per_sample(out, after, readers, constants) for out in node.output if out):
            return False
    return True


def _rank_after(node: onnx.NodeProto, slot: int, rank: int, constants: dict[str, np.ndarray]) -> int | None:
    """The rank of a `_PASSING` operator's output where it keeps its input's first axis first and whole
    (None: it may not)."""
    op = node.op_type
    if op == "Cast":
        return rank
    if op == "Concat":
        return rank if int(attributes(node).get("axis", 0)) % rank != 0 else None
    if op == "Unsqueeze" and slot == 0:
        axes = _axes(node, 1, constants)
        after = rank + len(axes) if axes is not None else 0
        return after if axes is not None and all(int(a) % after != 0 for a in axes) else None
    if op == "Slice" and slot == 0:  # (without axes it slices the first too)
        axes = _axes(node, 3, constants) if len(node.input) > 3 else None
        return rank if axes is not None and all(int(a) % rank != 0 for a in axes) else None
    return None


def _axes(node: onnx.NodeProto, slot: int, constants: dict[str, np.ndarray]) -> np.ndarray | None:
    """The axes an operator names: its input at ``slot`` where stored, else its attribute (older opsets)."""
    if len(node.input) > slot:
        found = constants.get(node.input[slot])
        return None if found is None else np.atleast_1d(found)
    axes = attributes(node).get("axes")
    return None if axes is None else np.asarray(axes, dtype=np.int64)


def _small_constants(proto: onnx.ModelProto) -> dict[str, np.ndarray]:
    """Stored integer vectors (axes, starts, ends), by name: initializers and Constant nodes' values."""
    found = {
        t.name: numpy_helper.to_array(t)
        for t in proto.graph.initializer
        if len(t.dims) <= 1 and t.data_location != onnx.TensorProto.EXTERNAL
    }
    for node in proto.graph.node:
        if node.op_type == "Constant" and node.output:
            found[node.output[0]] = np.asarray(attributes(node).get("value"))
    return {name: value for name, value in found.items() if value.dtype.kind == "i"}


_FILE_SHAPES_KEPT = 4  # files whose shapes a plan keeps (`autopar.context`)


def content_key(proto: onnx.ModelProto) -> bytes | None:
    """A digest of a file's content (None: a model protobuf cannot hold, over 2 GB in memory, which inference
    cannot read either)."""
    try:
        return hashlib.sha256(proto.SerializeToString(deterministic=True)).digest()
    except Exception:
        return None


def import_key(proto: onnx.ModelProto, batch: int | None) -> bytes | None:
    """The key under which an import notes that data propagation inferred the file (`propagated`), or None:
    every import at a batch it is given has one (a search imports one file at many batches), and an import at
    the file's own batch has one where the file is small enough (`KEYED_BYTES`) that hashing it costs less
    than the propagation it spares the next import (0.23 s of the 76.1B GPT's first import at another batch)."""
    if batch is None and proto.ByteSize() > KEYED_BYTES:
        return None
    return content_key(proto)


KEYED_BYTES = 16 << 20
"""The largest file whose import at its own batch takes its content key (`import_key`): hashing 16 MB takes
a few hundredths of a second; an export with its weights, gigabytes, is left out."""


def propagated(key: bytes | None) -> bool:
    """Whether a file of this content was inferred with data propagation before in this plan (strictly,
    without an error: `_strict_inference`)."""
    return key is not None and key in context.current().propagated


def note_propagated(key: bytes | None) -> None:
    """Remember, for the rest of the plan, that a file of this content was inferred with data propagation
    (the last 16 files)."""
    if key is not None:
        _remember(context.current().propagated, key, None, 16)


def _remember(cache: collections.OrderedDict, key: bytes, value: object, kept: int) -> None:
    """Put ``value`` at ``key`` in a per-file-content cache, newest last, keeping the ``kept`` newest."""
    cache[key] = value
    cache.move_to_end(key)
    while len(cache) > kept:
        cache.popitem(last=False)


def _file_shapes(proto: onnx.ModelProto, key: bytes | None) -> dict[str, tuple[int, ...]] | None:
    """Each tensor's sizes as the file infers them at its own batch (0 where unknown; None: inference
    fails), once per file content (``key``, its `content_key`): a search over micro-batch counts imports
    one file at each count, and this inference is the same every time (a third of each import of the
    Megatron GPTs). Sizes only are kept, never the inferred model."""
    if key is None:
        return None
    shapes = context.current().file_shapes
    if key in shapes:
        shapes.move_to_end(key)
        return shapes[key]
    found: dict[str, tuple[int, ...]] | None
    try:
        inferred = _sized_without_propagation(proto) or shape_inference.infer_shapes(proto, data_prop=True)
    except Exception:
        found = None
    else:
        found = {
            name: tuple(dim.dim_value for dim in vi.type.tensor_type.shape.dim)
            for name, vi in value_infos(inferred).items()
            if vi.type.HasField("tensor_type")
        }
    _remember(shapes, key, found, _FILE_SHAPES_KEPT)
    return found


def _sized_without_propagation(proto: onnx.ModelProto) -> onnx.ModelProto | None:
    """Strict inference without data propagation where it sizes every operator's every output (None where not):
    then data propagation, which only refines what inference leaves unknown, infers the same sizes. Strict: no
    declared size contradicts an inferred one, and none is left out after an error the lenient inference keeps
    quiet about. Propagation costs a hundred times more (1.5 s of GPT-3 175B's 96 layers, where 0.02 s)."""
    quick = _without_propagation(proto)
    if quick is None:
        return None
    infos = value_infos(quick)
    for node in quick.graph.node:
        for name in node.output:
            info = infos.get(name) if name else None
            if name and (info is None or not _sized(info)):
                return None
    return quick


def _sized(info: onnx.ValueInfoProto) -> bool:
    """Whether a value info is a tensor's, with a static size on every axis."""
    tensor = info.type.tensor_type
    return (
        info.type.HasField("tensor_type")
        and tensor.HasField("shape")
        and all(dim.HasField("dim_value") for dim in tensor.shape.dim)
    )


# Operators ONNX defines as functions without a shape-inference rule (GroupNormalization): their
# output has their first input's type and shape, which inference then follows.
SHAPE_OF_FIRST_INPUT = frozenset({"GroupNormalization"})


def infer_shapes(proto: onnx.ModelProto, checked: bool = False) -> onnx.ModelProto:
    """Strict ONNX shape inference with data propagation (shape arithmetic is followed); ``checked``: the
    file was inferred so before, at another batch, and propagation may be left out where it finds nothing
    more (`_strict_inference`).

    An output of an operator in `SHAPE_OF_FIRST_INPUT` that inference leaves untyped is typed as
    that operator's first input, and inference runs again from there.
    """
    inferred = _strict_inference(proto, checked)
    while _type_like_first_input(inferred):
        inferred = _strict_inference(inferred, checked)
    return inferred


def infer_refolded(proto: onnx.ModelProto) -> tuple[onnx.ModelProto, bool]:
    """`infer_shapes` of this import's own graph with shape chains folded since, without data propagation
    wherever that inference succeeds, sizes left unknown or not (the caller folds the chains it now sizes, and
    propagates only where folding stops: `shapes.resolve_shapes`); and whether it propagated."""
    quick = _refolded_inference(proto)
    return (quick, False) if quick is not None else (infer_shapes(proto), True)


def _refolded_inference(proto: onnx.ModelProto) -> onnx.ModelProto | None:
    """Inference without data propagation of a graph this import inferred with it once (None where it fails,
    or leaves an output to type by hand). The sizes propagation found stay declared,
    and what it checked of the file's shape arithmetic it checked then, the folded chains now constants; what
    it would redo costs more than the rest of an import in a deep export (0.2 s a layer of a Mixtral one, each
    layer's folded constants propagated again)."""
    quick = _without_propagation(proto)  # (where it fails, the full inference says why, as it says it)
    if quick is None:
        return None
    if _type_like_first_input(quick):
        return None  # typed by hand: inferred again from there, as the full inference does
    return quick


def _type_like_first_input(proto: onnx.ModelProto) -> bool:
    """Type the untyped outputs of `SHAPE_OF_FIRST_INPUT` operators; whether any was."""
    infos = value_infos(proto)
    for init in proto.graph.initializer:
        infos.setdefault(init.name, onnx.helper.make_tensor_value_info(init.name, init.data_type, list(init.dims)))
    outputs = {vi.name: vi for vi in proto.graph.output}
    typed = False
    for node in proto.graph.node:
        if node.domain or node.op_type not in SHAPE_OF_FIRST_INPUT or not node.input or not node.output:
            continue
        source, name = infos.get(node.input[0]), node.output[0]
        known = infos.get(name)
        if source is None or not source.type.tensor_type.HasField("shape"):
            continue
        if known is not None and known.type.tensor_type.HasField("shape"):
            continue
        if name in outputs:
            outputs[name].type.CopyFrom(source.type)
        else:
            info = proto.graph.value_info.add()
            info.name = name
            info.type.CopyFrom(source.type)
        typed = True
    return typed


def _strict_inference(proto: onnx.ModelProto, checked: bool = False) -> onnx.ModelProto:
    """Strict inference with data propagation, which follows shape arithmetic (Shape, Gather, Concat, ...
    into a Reshape) and costs ten to twenty times inference without it (0.17 s of a 0.6 s import of the
    39.1B GPT). A file inferred with it before (``checked``) is inferred without it where its graph declares
    no shape past its inputs (as `bind_dimensions` leaves it), has no Shape or Size operator and has every
    size known without it: propagation then only adds sizes where they are unknown, there is no declared size
    to contradict, and what it checks of the file's constants (an index into a shape in range) it checked the
    first time, the input sizes reaching it only through Shape and Size (every file here infers the same
    either way). A file where propagation follows nothing (`_no_stored_start` before, `_vector_start` after
    the inference without it) is inferred without it, checked or not: the two inferences are then one (GPT-3
    175B's first import: 0.02 s, where 0.83 s)."""
    declared = proto.graph.value_info or any(out.type.tensor_type.HasField("shape") for out in proto.graph.output)
    readers = any(node.op_type in _SHAPE_READERS and node.domain in ("", "ai.onnx") for node in proto.graph.node)
    checkable = checked and not declared and not readers
    unstarted = _no_stored_start(proto)
    if unstarted or checkable:
        quick = _without_propagation(proto)  # (where it fails, said below, as the full inference says it)
        if quick is not None and unstarted and not _vector_start(quick):
            return quick
        if quick is not None and checkable and _every_size_known(quick):
            return quick
    try:
        return shape_inference.infer_shapes(proto, strict_mode=True, data_prop=True)
    except Exception as exc:
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        message = re.sub(r"elem type differs from existing elem type: \((\d+)\) vs \((\d+)\)", _type_names, message)
        raise ModelImportError(f"{_INFERENCE_FAILED}: {message.rstrip('.')}.") from None


_SHAPE_READERS = frozenset({"Shape", "Size"})
_INFERENCE_FAILED = "ONNX shape inference failed"

PROPAGATING = frozenset(
    {"Add", "Cast", "Concat", "Gather", "Mul", "Shape", "Size", "Slice", "Squeeze", "Sub", "Unsqueeze"}
)
"""The ONNX operators with a data-propagation function in some version (a test checks this list against
``onnx.defs``, which takes half a second to list them)."""

_INDEX_TYPES = frozenset({onnx.TensorProto.INT32, onnx.TensorProto.INT64})


def _no_stored_start(proto: onnx.ModelProto) -> bool:
    """Whether ONNX's data propagation finds nothing stored to start from in this graph: no Shape or Size
    (which make values of sizes), and no other operator that propagates (`PROPAGATING`) reads an integer
    initializer of at most one axis, a sparse one or a Constant's output. Its other start, a value typed with
    one axis of known length, is known only once inferred (`_vector_start`). Every operator has ONNX's own
    inference rule (not its function body, inferred node by node), writes names no other writes (ONNX refuses
    data written twice), and there is no subgraph and no function of the model's own, where propagation could
    run out of sight. Conservative: any other domain's operator counts as a start.

    >>> from onnx import helper
    >>> graph = helper.make_graph([helper.make_node("Add", ["x", "b"], ["y"])], "g", [], [])
    >>> _no_stored_start(helper.make_model(graph))
    True
    >>> graph.initializer.extend([helper.make_tensor("b", onnx.TensorProto.INT64, [2], [1, 2])])
    >>> _no_stored_start(helper.make_model(graph))
    False
    """
    if proto.functions:
        return False
    starts = {init.name for init in proto.graph.initializer if init.data_type in _INDEX_TYPES and len(init.dims) <= 1}
    starts |= {sparse.values.name for sparse in proto.graph.sparse_initializer}
    opset = opset_of(proto)
    inferred: dict[str, bool] = {}  # per operator type: whether ONNX has an inference rule for it at this opset
    written: set[str] = set()
    for node in proto.graph.node:
        if node.domain not in ("", "ai.onnx") or node.op_type in _SHAPE_READERS:
            return False
        if any(attr.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for attr in node.attribute):
            return False
        if node.op_type not in inferred:
            inferred[node.op_type] = _has_inference_rule(node.op_type, opset)
        if not inferred[node.op_type]:
            return False
        outputs = [name for name in node.output if name]
        if written.intersection(outputs) or len(set(outputs)) < len(outputs):
            return False
        written.update(outputs)
        if node.op_type == "Constant":
            starts.update(outputs)
        elif node.op_type in PROPAGATING and any(name in starts for name in node.input):
            return False
    return True


def _vector_start(inferred: onnx.ModelProto) -> bool:
    """Whether ONNX's data propagation would start from a vector in ``inferred``: a value not stored (no
    initializer) typed with one axis of known length, which propagation takes as that many unknown entries
    (a Reshape, Expand or ConstantOfShape reading them counts them as its output's rank). Every operator that
    propagates (`PROPAGATING`) acts only where its first input holds such entries, and reads its other inputs
    at most: so propagation starts where one's first input is a vector, or where a vector one reads is read by
    an operator that does not propagate. Where `_no_stored_start` holds, the inference without propagation
    types each value as the one with it types it before any propagation, so its types say whether any starts.

    >>> from onnx import helper
    >>> vector = helper.make_tensor_value_info("v", onnx.TensorProto.INT64, [3])
    >>> cast = helper.make_node("Cast", ["v"], ["w"], to=onnx.TensorProto.INT64)
    >>> _vector_start(helper.make_model(helper.make_graph([cast], "g", [vector], [])))
    True
    """
    stored = {init.name for init in inferred.graph.initializer}
    vectors = {
        name
        for name, info in value_infos(inferred).items()
        if name not in stored
        and info.type.tensor_type.HasField("shape")
        and len(info.type.tensor_type.shape.dim) == 1
        and info.type.tensor_type.shape.dim[0].HasField("dim_value")
    }
    read: set[str] = set()  # the vectors an operator that propagates reads (and propagation then holds)
    for node in inferred.graph.node:
        if node.op_type in PROPAGATING:
            if node.input and node.input[0] in vectors:
                return True
            read.update(name for name in node.input if name in vectors)
    return any(name in read for node in inferred.graph.node if node.op_type not in PROPAGATING for name in node.input)


def _without_propagation(proto: onnx.ModelProto) -> onnx.ModelProto | None:
    """Strict inference without data propagation (None where it fails)."""
    try:
        return shape_inference.infer_shapes(proto, strict_mode=True, data_prop=False)
    except Exception:
        return None


def _has_inference_rule(op_type: str, opset: int) -> bool:
    try:
        return onnx.defs.get_schema(op_type, opset, "").has_type_and_shape_inference_function
    except onnx.defs.SchemaError:
        return False


def _every_size_known(proto: onnx.ModelProto) -> bool:
    """Whether every tensor inference typed (and every graph output) has a static size on every axis."""
    return all(_sized(info) for info in (*proto.graph.value_info, *proto.graph.output))


def _type_names(match: re.Match[str]) -> str:
    """ONNX's numbered element types in words: "(1) vs (10)" -> "float (inferred) vs float16 (declared)"."""
    inferred, declared = (_type_name(int(number)) for number in match.groups())
    return f"elem type differs from the declared one: {inferred} (inferred) vs {declared} (declared)"


def _type_name(elem_type: int) -> str:
    names = onnx.TensorProto.DataType
    return names.Name(elem_type).lower() if elem_type in names.values() else str(elem_type)


def check_reshapes(proto: onnx.ModelProto) -> None:
    """Shape inference accepts a Reshape that changes the element count; running it would fail."""
    infos = value_infos(proto)
    for node in proto.graph.node:
        if node.op_type != "Reshape" or node.domain:
            continue
        sizes = []
        for name in (node.input[0], node.output[0]):
            vi = infos.get(name)
            dims = vi.type.tensor_type.shape.dim if vi is not None and vi.type.HasField("tensor_type") else None
            if dims is None or not all(d.HasField("dim_value") for d in dims):
                break
            sizes.append(math.prod(int(d.dim_value) for d in dims))
        if len(sizes) == 2 and sizes[0] != sizes[1]:
            raise ModelImportError(
                f"Reshape {node.name or node.output[0]!r} turns {sizes[0]} elements into {sizes[1]}: its target"
                " shape is hard-coded for another batch size or input shape."
            )
