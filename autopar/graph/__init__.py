"""ONNX import: a model file becomes a `Graph` whose every tensor has a known shape and dtype.

The passes, in order (one module each): `read` the file, `bind` the batch and symbolic
dimensions, infer shapes folding the chains that compute sizes (`shapes`), `validate` (ONNX's
checker, numeric inputs, positive sizes), then `build` the graph (constant folding in `fold`,
parameters told from constants, FLOPs from the operator registry) and insert `forks` where
several readers split one tensor alike. `types` holds the values they make.

>>> from onnx import TensorProto, helper
>>> node = helper.make_node("Relu", ["x"], ["y"], name="relu")
>>> model = helper.make_model(helper.make_graph([node], "tiny",
...     [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
...     [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]))
>>> load_model(model, batch=2).tensor("y").shape
(2, 4)
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import onnx

from autopar.context import planning
from autopar.errors import ModelImportError
from autopar.graph.bind import (
    at_another_batch,
    bind_dimensions,
    check_bindings,
    check_declared_sizes,
    check_reshapes,
    declared_batch,
    import_key,
    note_propagated,
    propagated,
    rebatch_constants,
    rebatch_filled,
    rebatch_reshapes,
)
from autopar.graph.build import build_graph, freeze, gradient_reaches, scattered_buffers, train, untrained
from autopar.graph.forks import insert_forks
from autopar.graph.read import read_model
from autopar.graph.records import restore_training_batch_norms
from autopar.graph.sequences import slice_sequences
from autopar.graph.shapes import resolve_shapes, split_computed
from autopar.graph.types import ElidedValue, Graph, OpNode, TensorInfo, TensorKind
from autopar.graph.validate import (
    check_data_inputs,
    check_declared_types,
    check_dimensions,
    check_input_types,
    check_model,
    check_wiring,
    declared_types,
)


@planning
def load_model(
    model: str | Path | onnx.ModelProto,
    batch: int | None = None,
    dims: dict[str, int] | None = None,
    frozen: Iterable[str] = (),
    trainable: Iterable[str] = (),
) -> Graph:
    """Import an ONNX model (a path or a ModelProto) with every shape resolved.

    ``dims`` binds the inputs' symbolic dimensions, and sizes the graph computes from data by their
    ``"TENSOR:AXIS"`` key (`shapes`). ``frozen``: names or globs of parameters not to train (`freeze`);
    ``trainable``: of float constants to train all the same (`train`).
    """
    proto = read_model(model)
    restore_training_batch_norms(proto)
    slice_sequences(proto)
    name = Path(model).stem if isinstance(model, (str, Path)) else (proto.graph.name or "model")
    check_bindings(batch, dims or {})
    check_wiring(proto)
    check_declared_sizes(proto, batch)
    declared = declared_types(proto)
    key = import_key(proto, batch)
    exported = declared_batch(proto)
    if batch is not None:
        rebatch_reshapes(proto, batch, key)
        rebatch_constants(proto, batch)
        rebatch_filled(proto, batch, scattered_buffers(proto))
    symbols, computed = split_computed(dims or {}, proto)
    proto = bind_dimensions(proto, batch, symbols)
    try:
        proto = resolve_shapes(proto, computed, checked=propagated(key))
    except ModelImportError as error:
        raise at_another_batch(error, batch, exported) from None
    note_propagated(key)
    check_declared_types(proto, declared)
    check_model(proto)
    check_data_inputs(proto)
    check_input_types(proto)
    check_dimensions(proto)
    check_reshapes(proto)
    return untrained(insert_forks(freeze(train(build_graph(proto, name), trainable), frozen)))


__all__ = [
    "ElidedValue",
    "Graph",
    "OpNode",
    "TensorInfo",
    "TensorKind",
    "freeze",
    "gradient_reaches",
    "load_model",
    "train",
    "untrained",
]
