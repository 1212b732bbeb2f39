"""A plan written in a framework's own form: the exporters (`autopar.export`) read the plan file."""

from __future__ import annotations

from pathlib import Path

import onnx

from autopar.export import export
from autopar.lowering import Plan, PlanFile


def export_plan(
    plan: Plan | PlanFile, to: str, out: str | Path | None = None, model: onnx.ModelProto | None = None
) -> list[Path]:
    """Write a plan for a framework (``to``: onnx, mindspore, dtensor or jax); the files written.

    The exporters (`autopar.export`) read the plan file; a `Plan` brings the model it was made
    for (ONNX in, ONNX out, and the shapes the DTensor and JAX checks use), a plan file takes ``model``.
    """
    if isinstance(plan, Plan):
        return export(plan.file, to, out, plan.problem.graph.model)
    return export(plan, to, out, model)
