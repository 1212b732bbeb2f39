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
from autopar.report.charts import (
    COLOURS,
    costliest_section,
    memory_section,
    mesh_section,
    schedule_section,
    timeline_section,
)
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
    "ROOT",
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

SECTIONS = (
    "summary",
    "strategy-map",
    "mesh",
    "timeline",
    "schedule",
    "costliest",
    "memory",
    "why",
    "collectives",
)
TITLES = {
    "summary": "Summary",
    "strategy-map": "Strategy map",
    "mesh": "Device mesh",
    "timeline": "One step",
    "schedule": "Pipeline schedule",
    "costliest": "Costliest operators",
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


ROOT = ".autopar-report.autopar-scoped"  # two classes: outranks a notebook's ``.jp-RenderedHTMLCommon td``

# Every rule is scoped under ROOT (`scoped`), and the first ones reset what a notebook's stylesheet sets on
# bare elements (JupyterLab right-aligns every cell, centres tables, stripes rows, caps images at the
# cell's width): the report looks the same in a page and in Jupyter.
RULES = """
{font-family:system-ui,-apple-system,'Segoe UI',sans-serif;color:#222;max-width:1400px;text-align:left;
line-height:1.4}
p,li,h1,h2,h3,td,th,caption,summary{text-align:left}
td,th,tr{vertical-align:top;line-height:1.35;white-space:normal;max-width:none}
table{table-layout:auto;margin:6px 0;border-collapse:collapse;font-size:13px;color:#222}
tbody tr:nth-child(n),tbody tr:hover{background:transparent}
svg{max-width:none;height:auto;overflow:visible}
p{margin:6px 0}
h2{border-bottom:2px solid #ddd;padding-bottom:4px;margin-top:28px;font-weight:600}
td,th{border:none;border-bottom:1px solid #e5e5e5;padding:3px 8px}
th{background:#f4f4f4;font-weight:600}
td.num,th.num{text-align:right;white-space:nowrap}
td.f{text-align:center;min-width:56px;font-variant-numeric:tabular-nums}
td.name{font-family:ui-monospace,monospace;white-space:nowrap}
.cards{display:flex;flex-wrap:wrap;gap:12px}
.card{border:1px solid #ddd;border-radius:8px;padding:10px 14px;min-width:150px;background:#fafafa}
.card .label{font-size:12px;color:#666;text-transform:uppercase;letter-spacing:.04em}
.card .value{font-size:22px;font-weight:600;margin:4px 0}
.card .note{font-size:12px;color:#555;max-width:220px}
.warnings li{color:#9a3412}
.ok{color:#166534}
.legend{list-style:none;padding:0;margin:4px 0;display:flex;flex-wrap:wrap;gap:14px;font-size:13px}
.swatch{display:inline-block;min-width:14px;height:14px;margin-right:4px;padding:0 3px;border-radius:3px;
font-size:11px;text-align:center;vertical-align:middle}
.note{font-size:12px;color:#555}
nav a{margin-right:12px}
.scroll{max-height:560px;overflow:auto;border:1px solid #eee}
.scroll th{position:sticky;top:0}
code{white-space:nowrap;font-size:12px}
table.map td{padding:1px 8px}
details summary{cursor:pointer;color:#1f4e79}
"""


def scoped(rules: str, root: str = ROOT) -> str:
    """CSS ``rules`` with every selector under ``root`` (an empty selector is the root itself).

    >>> scoped("p,td.num{text-align:right}\\n{color:#222}", ".r")
    '.r p,.r td.num{text-align:right}\\n.r{color:#222}'
    """
    out = []
    for rule in rules.strip().split("}"):
        if not rule.strip():
            continue
        selectors, body = rule.split("{", 1)
        names = [name.strip() for name in selectors.replace("\n", " ").split(",")]
        out.append(",".join(f"{root} {name}" if name else root for name in names) + "{" + body.replace("\n", "") + "}")
    return "\n".join(out)


CSS = scoped(RULES)


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
        f"autopar plan: {plan.model} on {plan.devices} device{'s' if plan.devices > 1 else ''} ({plan.cost_model},"
        f" {plan.precision} precision, {plan.mode})"
    )
    bodies = {
        "summary": summary_section(plan, alone),
        "strategy-map": strategy_map_section(plan),
        "mesh": mesh_section(plan),
        "timeline": timeline_section(plan, forward_s, recompute_s),
        "schedule": schedule_section(plan) if plan.pipeline is not None else "",
        "costliest": costliest_section(plan),
        "memory": memory_section(plan),
        "why": why_section(plan, dp),
        "collectives": collectives_section(plan),
    }
    shown = [key for key in SECTIONS if key != "schedule" or plan.pipeline is not None]  # stages: their schedule
    nav = "".join(f"<a href='#{key}'>{TITLES[key]}</a>" for key in shown)
    sections = "".join(f"<section id='{key}'><h2>{TITLES[key]}</h2>{bodies[key]}</section>" for key in shown)
    search = plan.search
    fragment = (
        f"<div class='autopar-report autopar-scoped'><h1>{escape(title)}</h1><nav>{nav}</nav>"
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
