"""A device-count sweep in the terminal and as one self-contained HTML page with hand-built SVG charts.

Hand-built SVG, not a charting library: a few lines over a log-2 device axis need no dependency,
render in any browser and in Jupyter without JavaScript, and keep the page a few kilobytes.

The charts: throughput on a log scale (linear scaling is then the dashed diagonal, and a curve that
bends away from it shows where scaling stops, at any count), scaling efficiency and MFU on linear
scales from 0. Every tick is labelled in short numbers (``1.2M``); the axis titles sit outside the
tick labels; a count where devices repeat one another's work is a hollow red point.

>>> short_number(1_192_993)
'1.19M'
>>> [short_number(v) for v in (0.5, 20, 1500, 250_000)]
['0.5', '20', '1.5k', '250k']
>>> log_ticks(90, 1_200_000)
[100, 1000, 10000, 100000, 1000000]
>>> log_ticks(300, 2000)
[500, 1000, 2000]
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from typing import Any

from autopar.units import human_bytes

REPEATS = "#d62728"  # the colour of a count where devices repeat work


def sweep_table(points: Sequence[dict[str, Any]]) -> str:
    """One line per device count (its global batch, and how often each shard is computed); notes under it."""
    header = (
        f"{'devices':>8}  {'batch':>9}  {'step ms':>10}  {'samples/s':>12}  {'scaling':>8}  {'MFU':>6}"
        f"  {'memory/device':>13}  {'repeats':>8}  {'stages':>10}  memory plan"
    )
    lines = [header, "-" * len(header)]
    for point in points:
        batch = point.get("global_batch")
        shown = f"{batch:,}" if batch else "-"
        if point.get("error"):
            lines.append(
                f"{point['devices']:>8}  {'-':>9}  {'-':>10}  {'-':>12}  {'-':>8}  {'-':>6}  {'-':>13}  {'-':>8}"
                f"  {'-':>10}  refused"
            )
            continue
        lines.append(
            f"{point['devices']:>8}  {shown:>9}  {point['step_time_s'] * 1e3:>10.3f}  {point['samples_per_s']:>12,.1f}"
            f"  {point['scaling_efficiency']:>8.3f}  {point['mfu']:>6.1%}"
            f"  {human_bytes(point['memory_per_device_bytes']):>13}  {_repeats(point):>8}  {_stages(point):>10}"
            f"  {_relief(point)}"
        )
    notes = [f"{point['devices']} devices: {point['warning']}" for point in points if point.get("warning")]
    notes += [f"{point['devices']} devices: {point['error']}" for point in points if point.get("error")]
    return "\n".join(lines + ([""] if notes else []) + notes) + "\n"


def _stages(point: dict[str, Any]) -> str:
    """Pipeline stages x micro-batches where the plan pipelines ("1" where it does not): where pipelining pays."""
    stages = int(point.get("pipeline_stages", 1))
    micro = (point.get("memory_plan") or {}).get("micro_batches", 1)
    return f"{stages} x {micro} mb" if stages > 1 else "1"


def _repeats(point: dict[str, Any]) -> str:
    """How many devices compute each shard: "-" when every device does distinct work."""
    copies = int(point.get("replicated", 1))
    return f"{copies} times" if copies > 1 else "-"


def _relief(point: dict[str, Any]) -> str:
    plan = point.get("memory_plan") or {}
    parts = []
    if plan.get("parallel_optimizer"):
        parts.append(f"parallel optimizer on {len(plan['parallel_optimizer'])} parameters")
    if plan.get("recompute"):
        parts.append("recompute")
    if plan.get("micro_batches", 1) > 1:
        parts.append(f"{plan['micro_batches']} micro-batches")
    return ", ".join(parts) or "-"


def short_number(value: float) -> str:
    """A tick label: three significant digits at most, k/M/G for thousands, millions, billions."""
    for size, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= size:
            return f"{value / size:.3g}{suffix}"
    return f"{value:.3g}"


def log_ticks(low: float, high: float) -> list[float]:
    """Round values (1, 2, 5 times a power of ten; powers of ten alone over a wide range) spanning [low, high]."""
    first, last = math.floor(math.log10(low)), math.ceil(math.log10(high))
    steps = (1, 2, 5) if last - first <= 2 else (1,)
    ticks = [step * 10**exp for exp in range(first, last + 1) for step in steps]
    inside = [t for t in ticks if low <= t <= high]
    return [int(t) if t >= 1 else t for t in inside] or [low, high]


def _linear_ticks(high: float) -> list[float]:
    """Five to ten round ticks from 0 to at least ``high``."""
    raw = high / 5 if high > 0 else 1.0
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    count = math.ceil(high / step - 1e-9)
    return [round(step * k, 10) for k in range(count + 1)]


def _chart(
    points: Sequence[dict[str, Any]], key: str, title: str, colour: str, *, log: bool, ideal: bool, percent: bool
) -> str:
    """A line chart of ``key`` over a log-2 device axis (y on a log scale with ``log``; the linear-scaling
    line dashed with ``ideal``), each tick labelled, the axis titles outside the tick labels."""
    shown = [p for p in points if not p.get("error")]
    if not shown:
        return "<p>No device count has a plan that fits.</p>"
    width, height, left, right, top, bottom = 620, 300, 92, 24, 16, 54
    xs = [math.log2(p["devices"]) for p in shown]
    ys = [float(p[key]) for p in shown]
    ideal_ys = [ys[0] * p["devices"] / shown[0]["devices"] for p in shown] if ideal else []
    x_low, x_high = min(xs), max(xs)
    if x_high == x_low:
        x_low, x_high = x_low - 0.5, x_high + 0.5
    values = [v for v in ys + ideal_ys if v > 0]
    if log and values:
        # the domain runs from the round value under the lowest point to the one over the highest
        wide = log_ticks(10 ** math.floor(math.log10(min(values))), 10 ** math.ceil(math.log10(max(values))))
        low = max([t for t in wide if t <= min(values) / 1.05] or [min(values) / 1.25])
        high = min([t for t in wide if t >= max(values) * 1.05] or [max(values) * 1.25])
        y_ticks = log_ticks(low, high)

        def y_at(value: float) -> float:
            share = (math.log(max(value, low)) - math.log(low)) / (math.log(high) - math.log(low))
            return height - bottom - share * (height - top - bottom)

    else:
        y_ticks = _linear_ticks(max(values, default=1.0) * 1.05)
        high = y_ticks[-1] or 1.0

        def y_at(value: float) -> float:
            return height - bottom - value / high * (height - top - bottom)

    def x_at(x: float) -> float:
        return left + 8 + (x - x_low) / (x_high - x_low) * (width - left - right - 16)

    def path(series: Sequence[float]) -> str:
        return " ".join(
            f"{'M' if i == 0 else 'L'}{x_at(x):.1f},{y_at(y):.1f}" for i, (x, y) in enumerate(zip(xs, series))
        )

    def label(value: float) -> str:
        return f"{value:.0%}" if percent else short_number(value)

    parts = [
        f"<line x1='{left}' y1='{height - bottom}' x2='{width - right}' y2='{height - bottom}' stroke='#444'/>",
        f"<line x1='{left}' y1='{top}' x2='{left}' y2='{height - bottom}' stroke='#444'/>",
    ]
    for tick in y_ticks:
        y = y_at(tick)
        parts.append(
            f"<line x1='{left - 4}' y1='{y:.1f}' x2='{width - right}' y2='{y:.1f}' stroke='#e5e7eb'/>"
            f"<text x='{left - 8}' y='{y + 4:.1f}' text-anchor='end' font-size='11'>{html.escape(label(tick))}</text>"
        )
    for x, point in zip(xs, shown):
        parts.append(
            f"<line x1='{x_at(x):.1f}' y1='{height - bottom}' x2='{x_at(x):.1f}' y2='{height - bottom + 4}'"
            f" stroke='#444'/><text x='{x_at(x):.1f}' y='{height - bottom + 17}' text-anchor='middle'"
            f" font-size='11'>{point['devices']:,}</text>"
        )
    parts.append(
        f"<text x='{(left + width - right) / 2}' y='{height - 10}' text-anchor='middle' font-size='12'>"
        "devices (log 2 scale)</text>"
        f"<text transform='translate(16 {(top + height - bottom) / 2}) rotate(-90)' text-anchor='middle'"
        f" font-size='12'>{html.escape(title)}{' (log scale)' if log else ''}</text>"
    )
    if ideal:
        parts.append(f"<path d='{path(ideal_ys)}' fill='none' stroke='#999' stroke-dasharray='5 4'/>")
    parts.append(f"<path d='{path(ys)}' fill='none' stroke='{colour}' stroke-width='2'/>")
    for x, y, point in zip(xs, ys, shown):
        repeats = int(point.get("replicated", 1)) > 1
        note = f"; each shard computed {point['replicated']} times" if repeats else ""
        fill, stroke = ("#fff", REPEATS) if repeats else (colour, colour)
        parts.append(
            f"<circle cx='{x_at(x):.1f}' cy='{y_at(y):.1f}' r='{5 if repeats else 3.5}' fill='{fill}'"
            f" stroke='{stroke}' stroke-width='2'><title>{point['devices']:,} devices: {html.escape(label(y))}"
            f"{html.escape(note)}</title></circle>"
        )
    return (
        f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' viewBox='0 0 {width} {height}'"
        f" role='img' aria-label='{html.escape(title)} by device count'>{''.join(parts)}</svg>"
    )


CSS = """
body{font-family:system-ui,sans-serif;margin:24px;color:#222}
table{border-collapse:collapse}td,th{border-bottom:1px solid #ddd;padding:4px 10px;text-align:right;white-space:nowrap}
td.note,th.note{text-align:left;white-space:normal}th{background:#f4f4f4}
.charts{display:flex;flex-wrap:wrap;gap:8px 28px}
figure{margin:0}figcaption{font-size:13px;color:#444;max-width:600px}
.repeats{color:#d62728}
"""


def _row(point: dict[str, Any]) -> str:
    """One table row of the page."""
    batch = f"{point['global_batch']:,}" if point.get("global_batch") else "-"
    head = f"<tr><td>{point['devices']:,}</td>"
    if point.get("error"):
        return head + f"<td>-</td><td colspan='7' class='note'>refused: {html.escape(point['error'])}</td></tr>"
    repeats = " class='repeats'" if int(point.get("replicated", 1)) > 1 else ""
    return (
        head + f"<td>{batch}</td><td>{point['step_time_s'] * 1e3:.3f} ms</td><td>{point['samples_per_s']:,.1f}</td>"
        f"<td>{point['scaling_efficiency']:.3f}</td><td>{point['mfu']:.1%}</td>"
        f"<td>{html.escape(human_bytes(point['memory_per_device_bytes']))}</td><td{repeats}>{_repeats(point)}</td>"
        f"<td class='note'>{html.escape(point.get('warning') or _relief(point))}</td></tr>"
    )


def sweep_html(model: str, points: Sequence[dict[str, Any]], per_device_batch: int | None = None) -> str:
    """One self-contained page: the charts and the table (nothing fetched from the network)."""
    rows = "".join(_row(p) for p in points)
    scaling = (
        f"weak scaling: {per_device_batch:,} samples a device, the global batch grows with the devices"
        if per_device_batch
        else "strong scaling: the same global batch at every count"
    )
    repeated = [p["devices"] for p in points if int(p.get("replicated", 1)) > 1]
    flagged = (
        f" Hollow red points: devices repeat one another's work ({', '.join(f'{d:,}' for d in repeated)} devices)."
        if repeated
        else ""
    )
    charts = [
        (
            _chart(points, "samples_per_s", "samples/s", "#4c78a8", log=True, ideal=True, percent=False),
            "Throughput. Dashed: linear scaling from the first count.",
        ),
        (
            _chart(points, "scaling_efficiency", "scaling efficiency", "#54a24b", log=False, ideal=False, percent=True),
            "Samples/s per device against the first count's (100%: linear scaling).",
        ),
        (
            _chart(points, "mfu", "MFU", "#f58518", log=False, ideal=False, percent=True),
            "Model FLOPs utilisation: ideal step time over predicted step time.",
        ),
    ]
    figures = "".join(
        f"<figure>{svg}<figcaption>{html.escape(caption)}</figcaption></figure>" for svg, caption in charts
    )
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>autopar sweep: {html.escape(model)}</title>
<style>{CSS}</style></head>
<body><h2>autopar sweep: {html.escape(model)}</h2><p>{html.escape(scaling)}.{html.escape(flagged)}</p>
<div class="charts">{figures}</div>
<table><thead><tr><th>devices</th><th>global batch</th><th>step</th><th>samples/s</th><th>scaling</th><th>MFU</th>
<th>memory/device</th><th>repeats</th><th class='note'>note</th></tr></thead><tbody>{rows}</tbody></table></body></html>
"""
