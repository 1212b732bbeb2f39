"""A plan written in a framework's own form: the exporters (`autopar.export`) read the plan file."""

from __future__ import annotations

from collections.abc import Mapping
from os import PathLike
from pathlib import Path
from typing import Any

import onnx

from autopar.export import export
from autopar.lowering import Plan, PlanFile, load_plan_file, read_plan_file
from autopar.options import expect

PLAN_SAID = "The plan to export must be a Plan, a PlanFile, a plan file's dict or its path"


def export_plan(
    plan: Plan | PlanFile | Mapping[str, Any] | str | Path,
    to: str,
    out: str | Path | None = None,
    model: onnx.ModelProto | None = None,
) -> list[Path]:
    """Write a plan for a framework (``to``: onnx, mindspore, dtensor or jax); the files written.

    The exporters (`autopar.export`) read the plan file; a `Plan` brings the model it was made
    for (ONNX in, ONNX out, and the shapes the DTensor and JAX checks use), a plan file (a `PlanFile`,
    its dict as `Plan.to_dict()` gives it, or the JSON file's path) takes ``model``.
    """
    expect(to, str, "The export format (to) must be a name such as 'onnx' or 'dtensor'")
    expect(out, (str, PathLike, type(None)), "out must be a file's path or None")
    expect(model, (onnx.ModelProto, type(None)), "model must be an onnx.ModelProto or None")
    if isinstance(plan, Plan):
        return export(plan.file, to, out, plan.problem.graph.model)
    return export(_plan_file(plan), to, out, model)


def _plan_file(plan: object) -> PlanFile:
    """The plan file given, read from its path or its dict (PlanFileError on a bad one); one sentence otherwise."""
    if isinstance(plan, str | Path):
        return load_plan_file(plan)
    if isinstance(plan, Mapping):
        return read_plan_file(dict(plan))
    return expect(plan, PlanFile, PLAN_SAID)
