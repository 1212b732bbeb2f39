"""The plan report: one self-contained HTML page (inline CSS and hand-built SVG, no script, nothing fetched).

`report_html` reads a plan file (a `PlanFile`, or its dict: ``Plan.to_dict()``, a plan JSON file)
and, when given, the data-parallel and stand-alone plans of the same problem and the forward share
of the compute. `plan_report` (``autopar report``) and `plan_html` (a `Plan`'s Jupyter display)
take those as one `Comparison`, which the API works out (`autopar.api.comparison`): the report
reads plans, it never runs the search.

Sections, each an ``<section id=...>`` with an ``<h2>`` (figures: `autopar.report.figures`;
SVG: `autopar.report.charts`; words and tables: `autopar.report.sections`):

- ``summary``: predicted step time, throughput (the data inputs' leading size, times the micro-batches,
  per step), MFU (ideal step / step), memory per device against capacity, speed-up against data
  parallel and stand-alone, and warnings (devices left idle, a fully replicated model, fallback
  operators, what the memory plan did).
- ``strategy-map``: one row per operator (the later copies of repeated blocks folded into the first
  copy's row, with a count), one column per axis kind, coloured by split factor; see `axis_splits`.
- ``mesh``: the link levels and, per level, the collectives whose bits cross it.
- ``timeline``: one step as phases: forward, backward, exposed communication, and the gradient
  sync hidden beside the backward.
- ``memory``: parameter state, activations and inputs per device against capacity.
- ``why``: every operator whose strategy differs from data parallel, its costs beside data parallel's.
- ``collectives``: every redistribution step and gradient sync in plain words, costliest first.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.lowering import Plan, PlanFile
from autopar.report.charts import COLOURS, memory_section, mesh_section, timeline_section
from autopar.report.figures import (
    AXES,
    AXIS_TITLES,
    IMAGE_OPS,
    PlanLike,
    as_plan_file,
    axis_splits,
    collective_rows,
    fold_groups,
    level_traffic,
    summary_figures,
    timeline_phases,
    warnings_of,
)
from autopar.report.format import escape
from autopar.report.sections import collectives_section, strategy_map_section, summary_section, why_section

__all__ = [
    "AXES",
    "AXIS_TITLES",
    "COLOURS",
    "CSS",
    "IMAGE_OPS",
    "SECTIONS",
    "Comparison",
    "axis_splits",
    "collective_rows",
    "fold_groups",
    "level_traffic",
    "plan_html",
    "plan_report",
    "report_html",
    "summary_figures",
    "timeline_phases",
    "warnings_of",
]

SECTIONS = ("summary", "strategy-map", "mesh", "timeline", "memory", "why", "collectives")
TITLES = {
    "summary": "Summary",
    "strategy-map": "Strategy map",
    "mesh": "Device mesh",
    "timeline": "One step",
    "memory": "Memory per device",
    "why": "Why not data parallel",
    "collectives": "Collectives",
}


@dataclass(frozen=True)
class Comparison:
    """What a plan file alone cannot say, worked out on the plan's own problem by the API.

    ``data_parallel`` and ``stand_alone`` are the plan files of those modes on the same problem
    (the "why" section and the stand-alone speed-up need them); ``forward_s`` and ``recompute_s``
    split the step's compute for the timeline.
    """

    data_parallel: PlanFile | None = None
    stand_alone: PlanFile | None = None
    forward_s: float | None = None
    recompute_s: float = 0.0


CSS = """
.autopar-report{font-family:system-ui,-apple-system,'Segoe UI',sans-serif;color:#222;max-width:1400px}
.autopar-report h2{border-bottom:2px solid #ddd;padding-bottom:4px;margin-top:28px}
.autopar-report table{border-collapse:collapse;font-size:13px;margin:6px 0}
.autopar-report td,.autopar-report th{border-bottom:1px solid #e5e5e5;padding:3px 8px;text-align:left;
vertical-align:top}
.autopar-report th{background:#f4f4f4}
.autopar-report td.num{text-align:right;white-space:nowrap}
.autopar-report td.f{text-align:center;min-width:56px;font-variant-numeric:tabular-nums}
.autopar-report td.name{font-family:ui-monospace,monospace;white-space:nowrap}
.autopar-report .cards{display:flex;flex-wrap:wrap;gap:12px}
.autopar-report .card{border:1px solid #ddd;border-radius:8px;padding:10px 14px;min-width:150px;background:#fafafa}
.autopar-report .card .label{font-size:12px;color:#666;text-transform:uppercase;letter-spacing:.04em}
.autopar-report .card .value{font-size:22px;font-weight:600;margin:4px 0}
.autopar-report .card .note{font-size:12px;color:#555;max-width:220px}
.autopar-report .warnings li{color:#9a3412}
.autopar-report .ok{color:#166534}
.autopar-report .legend{list-style:none;padding:0;display:flex;flex-wrap:wrap;gap:14px;font-size:13px}
.autopar-report .swatch{display:inline-block;min-width:14px;height:14px;margin-right:4px;padding:0 3px;
border-radius:3px;font-size:11px;text-align:center;vertical-align:middle}
.autopar-report .note{font-size:12px;color:#555}
.autopar-report nav a{margin-right:12px}
.autopar-report .scroll{max-height:560px;overflow:auto;border:1px solid #eee}
.autopar-report .scroll th{position:sticky;top:0}
.autopar-report code{white-space:nowrap;font-size:12px}
.autopar-report table.map td{padding:1px 8px}
"""


def report_html(
    data: PlanLike,
    *,
    data_parallel: PlanLike | None = None,
    stand_alone: PlanLike | None = None,
    forward_s: float | None = None,
    recompute_s: float = 0.0,
    page: bool = True,
) -> str:
    """The report of plan file ``data``: a whole page (``page``), or a fragment for Jupyter.

    ``data_parallel`` and ``stand_alone`` are the plan files of those modes on the same problem (the
    "why" section and the stand-alone speed-up need them); ``forward_s`` and ``recompute_s`` split
    the step's compute for the timeline.
    """
    plan = as_plan_file(data)
    dp = as_plan_file(data_parallel) if data_parallel is not None else None
    alone = as_plan_file(stand_alone) if stand_alone is not None else None
    title = (
        f"autopar plan: {plan.model} on {plan.devices} devices ({plan.cost_model},"
        f" {plan.precision} precision, {plan.mode})"
    )
    bodies = {
        "summary": summary_section(plan, alone),
        "strategy-map": strategy_map_section(plan),
        "mesh": mesh_section(plan),
        "timeline": timeline_section(plan, forward_s, recompute_s),
        "memory": memory_section(plan),
        "why": why_section(plan, dp),
        "collectives": collectives_section(plan),
    }
    nav = "".join(f"<a href='#{key}'>{TITLES[key]}</a>" for key in SECTIONS)
    sections = "".join(f"<section id='{key}'><h2>{TITLES[key]}</h2>{bodies[key]}</section>" for key in SECTIONS)
    search = plan.search
    fragment = (
        f"<div class='autopar-report'><h1>{escape(title)}</h1><nav>{nav}</nav>"
        f"<p class='note'>{len(plan.ops)} operators; searched by {escape(search.algorithm)} over"
        f" {search.candidates} candidates.</p>{sections}</div>"
    )
    if not page:
        return f"<style>{CSS}</style>{fragment}"
    return (
        f"<!doctype html>\n<html lang='en'><head><meta charset='utf-8'><title>{escape(title)}</title>"
        f"<style>{CSS}</style></head><body>{fragment}</body></html>\n"
    )


def plan_report(plan: Plan | PlanFile, comparison: Comparison | None = None, *, page: bool = True) -> str:
    """The report of a plan, with what ``comparison`` adds (`autopar.api.comparison` works it out)."""
    data = plan.file if isinstance(plan, Plan) else plan
    other = comparison or Comparison()
    return report_html(
        data,
        data_parallel=other.data_parallel,
        stand_alone=other.stand_alone,
        forward_s=other.forward_s,
        recompute_s=other.recompute_s,
        page=page,
    )


def plan_html(plan: Plan | PlanFile, comparison: Comparison | None = None) -> str:
    """A plan's Jupyter display: the report as an HTML fragment (scoped styles, no script)."""
    return plan_report(plan, comparison, page=False)
