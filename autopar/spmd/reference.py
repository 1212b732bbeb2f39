"""The reference: the original graph on one device, run by onnxruntime (an optional extra)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from autopar.errors import AutoparError
from autopar.graph import Graph


def _onnxruntime() -> Any:
    try:
        import onnxruntime
    except ImportError:
        raise AutoparError("Verification needs onnxruntime: pip install 'autopar[verify]'.") from None
    return onnxruntime


def session(model: onnx.ModelProto) -> Any:
    """An onnxruntime session that keeps fp32 arithmetic as written (no graph rewrites)."""
    ort = _onnxruntime()
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def reference_outputs(graph: Graph, values: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Run the original graph on one device, elided weights replaced by ``values``."""
    model = onnx.ModelProto()
    model.CopyFrom(graph.model)
    params = {p.name for p in graph.parameters}
    kept = [node for node in model.graph.node if not (set(node.output) & params)]
    del model.graph.node[:]
    model.graph.node.extend(kept)
    # weights kept in external data files are never read: the run uses the materialised ones
    external = [init for init in model.graph.initializer if init.data_location == onnx.TensorProto.EXTERNAL]
    for init in external:
        model.graph.initializer.remove(init)
    existing = {init.name for init in model.graph.initializer}
    for name in sorted((params | {init.name for init in external if init.name in values}) - existing):
        model.graph.initializer.append(numpy_helper.from_array(values[name], name))
    _name_apart(model)
    _without_training_dropout(model)
    feeds = {name: values[name] for name in graph.inputs}
    names = list(graph.outputs)
    try:
        found = dict(zip(names, session(model).run(names, feeds)))
    except AutoparError:  # onnxruntime is not installed: that sentence as it is
        raise
    except Exception as exc:  # onnxruntime raises its own types (Fail, NotImplemented, InvalidGraph, ...)
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0].rstrip(".")
        raise AutoparError(f"onnxruntime, which computes the reference, cannot run this model: {reason}.") from None
    for name, value in found.items():
        shape = tuple(graph.tensor(name).shape)
        if tuple(value.shape) != shape:
            raise AutoparError(
                f"onnxruntime, which computes the reference, gives output {name!r} the shape {tuple(value.shape)},"
                f" where ONNX's shape inference, which the plan follows, gives it {shape}: the plan cannot be"
                " checked against it."
            )
    return found


def _without_training_dropout(model: onnx.ModelProto) -> None:
    """Run every Dropout as inference does, the identity (its training mode off), as the ranks run it
    (`autopar.ops.elementwise.dropout_local`): onnxruntime's random mask would be drawn anew on every run."""
    off = "autopar_dropout_training_off"
    dropouts = [node for node in model.graph.node if node.op_type == "Dropout" and node.domain in ("", "ai.onnx")]
    for node in dropouts:
        if len(node.input) > 2 and node.input[2]:
            node.input[2] = off
    if any(len(node.input) > 2 and node.input[2] == off for node in dropouts):
        model.graph.initializer.append(numpy_helper.from_array(np.array(False), off))


def _name_apart(model: onnx.ModelProto) -> None:
    """Give operators that share a name names of their own, as the importer does (onnxruntime refuses a model
    whose operators repeat a name; the names do not change what it computes)."""
    seen = {node.name for node in model.graph.node if node.name}
    named: set[str] = set()
    for node in model.graph.node:
        if node.name and node.name in named:
            suffix = 1
            while f"{node.name}_{suffix}" in seen:
                suffix += 1
            node.name = f"{node.name}_{suffix}"
            seen.add(node.name)
        named.add(node.name)
