"""A device-count sweep in the terminal and as one self-contained HTML page with a hand-built SVG chart.

Hand-built SVG, not a charting library: two lines over a log2 axis need no dependency, render
in any browser and in Jupyter without JavaScript, and keep the page a few kilobytes.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from typing import Any

from autopar.units import human_bytes


def sweep_table(points: Sequence[dict[str, Any]]) -> str:
    """One line per device count; warnings under the table."""
    header = (
        f"{'devices':>8}  {'step ms':>10}  {'samples/s':>12}  {'scaling':>8}  {'MFU':>6}  {'memory/device':>13}"
        "  memory plan"
    )
    lines = [header, "-" * len(header)]
    for point in points:
        if point.get("error"):
            lines.append(f"{point['devices']:>8}  {'-':>10}  {'-':>12}  {'-':>8}  {'-':>6}  {'-':>13}  refused")
            continue
        lines.append(
            f"{point['devices']:>8}  {point['step_time_s'] * 1e3:>10.3f}  {point['samples_per_s']:>12,.1f}"
            f"  {point['scaling_efficiency']:>8.3f}  {point['mfu']:>6.1%}"
            f"  {human_bytes(point['memory_per_device_bytes']):>13}  {_relief(point)}"
        )
    notes = [f"{point['devices']} devices: {point['warning']}" for point in points if point.get("warning")]
    notes += [f"{point['devices']} devices: {point['error']}" for point in points if point.get("error")]
    return "\n".join(lines + ([""] if notes else []) + notes) + "\n"


def _relief(point: dict[str, Any]) -> str:
    plan = point.get("memory_plan") or {}
    parts = []
    if plan.get("parallel_optimizer"):
        parts.append(f"parallel optimizer x{len(plan['parallel_optimizer'])}")
    if plan.get("recompute"):
        parts.append("recompute")
    if plan.get("micro_batches", 1) > 1:
        parts.append(f"{plan['micro_batches']} micro-batches")
    return ", ".join(parts) or "-"


def _chart(points: Sequence[dict[str, Any]], key: str, label: str, color: str, ideal: bool) -> str:
    """A line chart of ``key`` over log2(devices); with ``ideal``, the linear-scaling line dashed."""
    shown = [p for p in points if not p.get("error")]
    if not shown:
        return "<p>No device count has a plan that fits.</p>"
    width, height, left, bottom, top, right = 560, 260, 70, 40, 20, 20
    xs = [math.log2(p["devices"]) for p in shown]
    ys = [p[key] for p in shown]
    ideal_ys = [ys[0] * p["devices"] / shown[0]["devices"] for p in shown] if ideal else []
    x_low, x_high = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
    y_high = max(ys + ideal_ys) * 1.1 or 1.0

    def at(x: float, y: float) -> tuple[float, float]:
        px = left + (x - x_low) / (x_high - x_low) * (width - left - right)
        py = height - bottom - y / y_high * (height - top - bottom)
        return px, py

    def path(values: Sequence[float]) -> str:
        return " ".join(
            f"{'M' if i == 0 else 'L'}{at(x, y)[0]:.1f},{at(x, y)[1]:.1f}" for i, (x, y) in enumerate(zip(xs, values))
        )

    ticks = "".join(
        f"<text x='{at(x, 0)[0]:.1f}' y='{height - bottom + 16}' text-anchor='middle' font-size='11'>"
        f"{p['devices']}</text>"
        for x, p in zip(xs, shown)
    )
    dots = "".join(
        f"<circle cx='{at(x, y)[0]:.1f}' cy='{at(x, y)[1]:.1f}' r='3.5' fill='{color}'>"
        f"<title>{p['devices']} devices: {html.escape(_format(key, y))}</title></circle>"
        for x, y, p in zip(xs, ys, shown)
    )
    dashed = (
        f"<path d='{path(ideal_ys)}' fill='none' stroke='#999' stroke-dasharray='4 3'/>"
        f"<text x='{width - right}' y='{top + 12}' text-anchor='end' font-size='11' fill='#777'>"
        "dashed: linear scaling</text>"
        if ideal
        else ""
    )
    return (
        f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' role='img'"
        f" aria-label='{html.escape(label)} by device count'>"
        f"<line x1='{left}' y1='{height - bottom}' x2='{width - right}' y2='{height - bottom}' stroke='#444'/>"
        f"<line x1='{left}' y1='{top}' x2='{left}' y2='{height - bottom}' stroke='#444'/>"
        f"<text x='{left - 8}' y='{top + 4}' text-anchor='end' font-size='11'>"
        f"{html.escape(_format(key, y_high))}</text>"
        f"<text x='{left - 8}' y='{height - bottom}' text-anchor='end' font-size='11'>0</text>"
        f"<text x='{(left + width - right) / 2}' y='{height - 6}' text-anchor='middle' font-size='12'>devices</text>"
        f"<text x='12' y='{top + 2}' font-size='12' transform='rotate(90 12 {top + 2})'>{html.escape(label)}</text>"
        f"{ticks}{dashed}<path d='{path(ys)}' fill='none' stroke='{color}' stroke-width='2'/>{dots}</svg>"
    )


def _format(key: str, value: float) -> str:
    if key == "samples_per_s":
        return f"{value:,.0f}/s"
    if key == "mfu":
        return f"{value:.1%}"
    return f"{value:.3g}"


def sweep_html(model: str, points: Sequence[dict[str, Any]]) -> str:
    """One self-contained page: the two charts and the table (nothing fetched from the network)."""
    rows = "".join(
        f"<tr><td>{p['devices']}</td>"
        + (
            "<td colspan='6'>refused: " + html.escape(p["error"]) + "</td></tr>"
            if p.get("error")
            else f"<td>{p['step_time_s'] * 1e3:.3f} ms</td><td>{p['samples_per_s']:,.1f}</td>"
            f"<td>{p['scaling_efficiency']:.3f}</td><td>{p['mfu']:.1%}</td>"
            f"<td>{html.escape(human_bytes(p['memory_per_device_bytes']))}</td>"
            f"<td>{html.escape(p.get('warning') or _relief(p))}</td></tr>"
        )
        for p in points
    )
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>autopar sweep: {html.escape(model)}</title>
<style>body{{font-family:system-ui,sans-serif;margin:24px;color:#222}}table{{border-collapse:collapse}}
td,th{{border-bottom:1px solid #ddd;padding:4px 10px;text-align:right}}th{{background:#f4f4f4}}</style></head>
<body><h2>autopar sweep: {html.escape(model)}</h2>
{_chart(points, "samples_per_s", "throughput (samples/s)", "#4c78a8", ideal=True)}
{_chart(points, "mfu", "MFU", "#f58518", ideal=False)}
<table><thead><tr><th>devices</th><th>step</th><th>samples/s</th><th>scaling</th><th>MFU</th><th>memory/device</th>
<th>note</th></tr></thead><tbody>{rows}</tbody></table></body></html>
"""
