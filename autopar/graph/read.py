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
        if not path.is_file():
            raise ModelImportError(f"Model file {str(path)!r} does not exist.")
        try:
            proto = onnx.load(str(path), load_external_data=False)
        except Exception as exc:  # protobuf raises several unrelated types
            raise ModelImportError(
                f"{str(path)!r} is not a readable ONNX model (truncated or foreign file: {type(exc).__name__})."
            ) from None
    if not proto.graph.node:
        raise ModelImportError("The model has no operators (is it an ONNX model file?).")
    return proto
