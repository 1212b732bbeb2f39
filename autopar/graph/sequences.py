"""Pieces of a tensor split into a sequence, read back as the slices they are.

PyTorch's dynamo exporter writes ``torch.split`` with sizes, unoptimised, as ``SplitToSequence`` followed by
one ``SequenceAt`` per piece (latent attention's query and key halves, Mamba2's projections). ONNX's shape
inference types a sequence's elements without their sizes, so each piece would be "a size computed from
data". `slice_sequences` writes each ``SequenceAt`` whose split sizes and position are constants as the
``Slice`` it reads, and drops a ``SplitToSequence`` nothing else reads: the same values, their shapes known.

>>> import onnx
>>> from onnx import helper
>>> sizes = helper.make_node("Constant", [], ["sizes"], value=helper.make_tensor("s", 7, [2], [3, 5]))
>>> one = helper.make_node("Constant", [], ["one"], value=helper.make_tensor("p", 7, [], [1]))
>>> split = helper.make_node("SplitToSequence", ["x", "sizes"], ["pieces"], axis=-1)
>>> at = helper.make_node("SequenceAt", ["pieces", "one"], ["y"])
>>> graph = helper.make_graph([sizes, one, split, at], "g", [], [])
>>> proto = helper.make_model(graph)
>>> slice_sequences(proto)
1
>>> [node.op_type for node in proto.graph.node]
['Constant', 'Constant', 'Constant', 'Constant', 'Constant', 'Slice']
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from autopar.graph.proto import attributes


def _known(proto: onnx.ModelProto, wanted: set[str]) -> dict[str, np.ndarray]:
    """The values of the ``wanted`` tensors the file states outright (initializers with their data in the
    file, Constant nodes' values); one whose data does not read as its type says is left unknown."""
    values = {}
    stored = [tensor for tensor in proto.graph.initializer if tensor.name in wanted and not tensor.data_location]
    for tensor in stored:
        try:
            values[tensor.name] = numpy_helper.to_array(tensor)
        except ValueError:
            continue  # the checker's sentence names it later
    for node in proto.graph.node:
        if node.op_type == "Constant" and not node.domain and node.output[0] in wanted:
            value = attributes(node).get("value")
            if value is not None:
                values[node.output[0]] = np.asarray(value)
    return values


def _bounds(sizes: np.ndarray, position: int) -> tuple[int, int] | None:
    """(start, end) of piece ``position`` of pieces of these sizes (a scalar: chunks of that size; the last
    may be shorter, and its end is then past the axis, as Slice allows); None for a position out of range."""
    if sizes.ndim == 0:
        size = int(sizes)
        return (position * size, (position + 1) * size) if position >= 0 and size > 0 else None
    sizes = sizes.reshape(-1).astype(np.int64)
    if position < 0:
        position += len(sizes)
    if not 0 <= position < len(sizes):
        return None
    start = int(sizes[:position].sum())
    return start, start + int(sizes[position])


def slice_sequences(proto: onnx.ModelProto) -> int:
    """Write every ``SequenceAt`` of a ``SplitToSequence`` with constant sizes and position as a ``Slice``;
    how many were written."""
    graph = proto.graph
    sequences = {node.output[0] for node in graph.node if node.op_type == "SplitToSequence" and not node.domain}
    if not sequences:
        return 0
    wanted = {node.input[1] for node in graph.node if node.op_type == "SplitToSequence" and len(node.input) > 1}
    wanted |= {node.input[1] for node in graph.node if node.op_type == "SequenceAt" and node.input[0] in sequences}
    known = _known(proto, wanted)
    splits = {
        node.output[0]: node
        for node in graph.node
        if node.op_type == "SplitToSequence" and not node.domain and len(node.input) > 1 and node.input[1] in known
    }
    written = 0
    nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        split = splits.get(node.input[0]) if node.op_type == "SequenceAt" and not node.domain else None
        position = known.get(node.input[1]) if split is not None and len(node.input) > 1 else None
        if split is None or position is None or position.size != 1:
            nodes.append(node)
            continue
        bounds = _bounds(known[split.input[1]], int(position.reshape(-1)[0]))
        if bounds is None:
            nodes.append(node)
            continue
        axis = int(attributes(split).get("axis", 0))
        out = node.output[0]
        for part, value in (("starts", bounds[0]), ("ends", bounds[1]), ("axes", axis)):
            tensor = numpy_helper.from_array(np.array([value], dtype=np.int64), f"{out}.{part}")
            nodes.append(helper.make_node("Constant", [], [f"{out}.{part}"], value=tensor))
        inputs = [split.input[0], f"{out}.starts", f"{out}.ends", f"{out}.axes"]
        sliced = helper.make_node("Slice", inputs, [out], name=node.name or f"{out}.slice")
        sliced.metadata_props.extend(node.metadata_props)
        nodes.append(sliced)
        written += 1
    read = {name for node in nodes for name in node.input}
    read |= {output.name for output in graph.output}
    kept = [node for node in nodes if not (node.op_type == "SplitToSequence" and node.output[0] not in read)]
    if written:
        del graph.node[:]
        graph.node.extend(kept)
    return written
