"""Reading a model: a path or a ModelProto becomes a private ModelProto copy, or one sentence."""

from __future__ import annotations

from pathlib import Path

import onnx

from autopar.errors import ModelImportError


def read_model(model: str | Path | onnx.ModelProto) -> onnx.ModelProto:
    """A copy of the model the importer may rewrite; weights in external files are never read."""
    if isinstance(model, onnx.ModelProto):
        proto = onnx.ModelProto()
        proto.CopyFrom(model)
    else:
        path = Path(model)
        if path.is_dir():
            raise ModelImportError(f"{str(path)!r} is a directory; give the ONNX model file in it.")
        if not path.is_file():
            raise ModelImportError(f"Model file {str(path)!r} does not exist.")
        try:
            proto = onnx.load(str(path), load_external_data=False)
        except Exception as exc:  # protobuf raises several unrelated types
            raise ModelImportError(
                f"{str(path)!r} is not a readable ONNX model (truncated or foreign file: {type(exc).__name__})."
            ) from None
    if not proto.graph.node:
        named = "The model" if isinstance(model, onnx.ModelProto) else f"{str(model)!r}"
        if proto.graph.input or proto.graph.output:  # a graph, empty: its outputs are its inputs
            raise ModelImportError(f"{named} has no operators: there is nothing to plan.")
        raise ModelImportError(f"{named} has no operators (is it an ONNX model file?).")
    _check_names(proto)
    return proto


def _check_names(proto: onnx.ModelProto) -> None:
    """Protobuf hands back bytes for a string field that is not UTF-8: a corrupted file."""
    graph = proto.graph
    texts = [graph.name]
    for node in graph.node:
        texts += [node.name, node.op_type, node.domain, *node.input, *node.output]
        texts += [attribute.name for attribute in node.attribute]
    texts += [value.name for value in [*graph.input, *graph.output, *graph.value_info, *graph.initializer]]
    texts += [entry.domain for entry in proto.opset_import]
    for text in texts:
        if not isinstance(text, str):
            raise ModelImportError(
                f"The model names something {text!r}, which is not UTF-8 text: the file is corrupted."
            )
