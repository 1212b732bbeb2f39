"""Exports: a plan in the forms training frameworks consume, one module per format.

Every exporter reads the typed plan file (`autopar.lowering.PlanFile`), never the search, without
the forks autopar inserts (`PlanFile.without_forks`), and writes files beside ``out``: ``onnx``
also needs the model the plan was made for (ONNX in, ONNX out). Given the model, `export` first checks the
plan against it (`autopar.lowering.lower.check_context`: a plan of another model is one sentence), then
dispatches by name; each module registers its writer in `EXPORTERS`.

>>> sorted(FORMATS)
['dtensor', 'jax', 'mindspore', 'onnx']
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path

import onnx

from autopar.errors import AutoparError
from autopar.lowering.lower import check_context
from autopar.lowering.planfile import PlanFile
from autopar.lowering.program import plan_graph

# format -> (module, what ``out`` defaults to in the working folder: the model's name, then the format)
FORMATS: dict[str, tuple[str, str]] = {
    "onnx": ("autopar.export.onnx_sharding", "{model}_sharded.onnx"),
    "mindspore": ("autopar.export.mindspore", "{model}_strategy.ckpt"),
    "dtensor": ("autopar.export.dtensor", "{model}_dtensor.py"),
    "jax": ("autopar.export.jax", "{model}_jax.py"),
}

Writer = Callable[[PlanFile, "onnx.ModelProto | None", Path], list[Path]]


def default_output(plan: PlanFile, to: str) -> Path:
    """Where `export` writes when no path is given: in the working folder, named after the model."""
    return Path(FORMATS[to][1].format(model=plan.model))


PIPELINED = ("mindspore", "dtensor")  # the formats that express pipeline stages


def export(plan: PlanFile, to: str, out: str | Path | None = None, model: onnx.ModelProto | None = None) -> list[Path]:
    """Write ``plan`` as format ``to`` at ``out`` (a default name if None); the files written."""
    if to not in FORMATS:
        raise AutoparError(f"Unknown export format {to!r}; choose one of: {', '.join(FORMATS)}.")
    if plan.pipeline is not None and to not in PIPELINED:
        raise AutoparError(
            f"The {to} export does not express pipeline stages; export this plan --to dtensor or --to mindspore,"
            " or plan it with --pipeline-stages 1."
        )
    if model is not None:  # the plan is checked against the model it is written for, as verify and report check it
        graph = plan_graph(plan, model)
        check_context(plan, graph, plan.devices, action="be exported")
        model = graph.model  # (as imported: a tied weight's stored copy is the Transpose the plan names)
    module = importlib.import_module(FORMATS[to][0])
    target = Path(out) if out is not None else default_output(plan, to)
    written: list[Path] = module.write(plan.without_forks(), model, target)
    return written


__all__ = ["FORMATS", "default_output", "export"]
