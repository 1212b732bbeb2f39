"""The Python API: plan a model, list its candidates, evaluate any assignment of them.

>>> import autopar
>>> plan = autopar.plan("models/resnet50.onnx", devices=8)
>>> plan.strategies["conv1"]
((8, 1, 1, 1), (1, 1, 1, 1))
>>> f"{plan.objective * 1e3:.3f} ms"
'16.492 ms'
>>> autopar.evaluate("models/resnet50.onnx", 8, plan.strategies) == plan.objective
True

One job a module: `planning` (plan, build, candidates, evaluate), `device_sweep` (sweep),
`verification` (verify), `exporting` (export_plan) and `baselines` (comparison: what the report
compares a plan with). Importing this package registers a `Plan`'s report as its Jupyter display.
"""

from __future__ import annotations

from autopar.api.baselines import comparison, compute_split
from autopar.api.device_sweep import Sweep, sweep
from autopar.api.exporting import export_plan
from autopar.api.planning import (
    ModelLike,
    build,
    build_with,
    candidates,
    choice_for,
    evaluate,
    plan,
    plan_with,
)
from autopar.api.verification import verify
from autopar.lowering import Plan
from autopar.report.html import plan_html, plan_report
from autopar.report.text import plan_table

__all__ = [
    "ModelLike",
    "Sweep",
    "build",
    "build_with",
    "candidates",
    "choice_for",
    "comparison",
    "compute_split",
    "evaluate",
    "export_plan",
    "plan",
    "plan_with",
    "sweep",
    "verify",
]


class _ReportFace:
    """How a `Plan` shows itself: the terminal's table, the report in Jupyter, the report as a page."""

    def text(self, plan: Plan, top: int | None) -> str:
        return plan_table(plan, top)

    def html(self, plan: Plan) -> str:
        return plan_html(plan, comparison(plan))

    def page(self, plan: Plan) -> str:
        return plan_report(plan, comparison(plan))


Plan.face = _ReportFace()  # print(plan), plan.report(path) and the Jupyter display; the core never imports faces
