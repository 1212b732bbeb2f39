"""A self-contained HTML summary of a plan: totals, a time bar, and the per-operator table."""

from __future__ import annotations

import html

from autopar.lowering import Plan


def _seconds(value: float) -> str:
    return f"{value * 1e3:.3f} ms"


def plan_html(plan: Plan) -> str:
    data = plan.to_dict()
    totals = data["totals"]
    step = totals["step_time_s"] or 1e-30
    compute_share = 100.0 * totals["compute_s"] / step
    rows = []
    for op in data["ops"]:
        strategy = html.escape(str(tuple(tuple(s) for s in op["strategy"])).replace(" ", ""))
        rows.append(
            f"<tr><td>{html.escape(op['name'])}</td><td>{html.escape(op['op_type'])}</td><td><code>{strategy}</code></td>"
            f"<td style='text-align:right'>{_seconds(op['cost']['compute_s'])}</td>"
            f"<td style='text-align:right'>{_seconds(op['cost']['communication_s'])}</td></tr>"
        )
    collectives: dict[str, int] = {}
    for red in data["redistributions"]:
        for step_entry in red["steps"]:
            collectives[step_entry["collective"]] = collectives.get(step_entry["collective"], 0) + 1
    summary = ", ".join(f"{count} {kind}" for kind, count in sorted(collectives.items())) or "none"
    return f"""<div class="autopar-plan">
<h3>autopar plan: {html.escape(data["model"])} on {data["devices"]} devices ({html.escape(data["cost_model"])},
{html.escape(data["precision"])} precision, {html.escape(data["mode"])})</h3>
<p>Predicted step time <b>{_seconds(totals["step_time_s"])}</b>
(data parallel {_seconds(totals["data_parallel_step_time_s"])}, speed-up x{totals["speedup_vs_data_parallel"]:.3f});
ideal {_seconds(totals["ideal_step_time_s"])}; memory {totals["memory_per_device_bytes"] / 1e9:.2f} GB per device.</p>
<div style="display:flex;width:480px;height:14px;border:1px solid #888">
<div title="compute" style="width:{compute_share:.1f}%;background:#4c78a8"></div>
<div title="communication" style="width:{100 - compute_share:.1f}%;background:#f58518"></div></div>
<p>Compute (blue) {_seconds(totals["compute_s"])}, communication (orange) {_seconds(totals["communication_s"])};
inserted redistribution steps: {summary}; fallback operators: {len(data["fallback_ops"])}.</p>
<table><thead><tr><th>operator</th><th>type</th><th>strategy</th><th>compute</th><th>communication</th></tr></thead>
<tbody>{"".join(rows)}</tbody></table></div>"""
