"""The report's hand-built SVG: the device mesh, one step's timeline, memory against capacity.

Hand-built, not a charting library: a few rectangles need no dependency, render without
JavaScript in any browser and in Jupyter, and keep the page self-contained.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from autopar.cost.mesh import Mesh
from autopar.lowering import PlanFile
from autopar.report.figures import level_traffic, timeline_phases
from autopar.report.format import escape, memory_against_usable, ms
from autopar.units import human_bytes

COLOURS = {
    "forward": "#4c78a8",
    "recompute": "#9ecae9",
    "backward": "#72b7b2",
    "compute": "#4c78a8",
    "exposed gradient sync": "#e45756",
    "other exposed communication": "#f58518",
    "hidden gradient sync": "#bab0ac",
    "parameter_state": "#4c78a8",
    "activations": "#f58518",
    "inputs": "#54a24b",
}


def factor_colour(factor: int, mesh: Mesh) -> tuple[str, str]:
    """(background, text colour) for a split factor: grey for 1, light to dark blue up to the mesh's devices."""
    if factor <= 1:
        return "#f3f4f6", "#9ca3af"
    share = math.log2(factor) / max(1, mesh.mesh_bits)
    low, high = (198, 219, 239), (8, 48, 107)
    rgb = tuple(round(a + (b - a) * share) for a, b in zip(low, high))
    return "#{:02x}{:02x}{:02x}".format(*rgb), "#fff" if share > 0.45 else "#111"


def mesh_section(data: PlanFile) -> str:
    """The devices as boxes, a bracket per link level's groups, and the traffic each level carries."""
    devices = data.devices
    levels = level_traffic(data)
    svg = ""
    if 1 < devices <= 64 and levels:
        box, gap, left = 28, 6, 10
        width = left * 2 + devices * (box + gap)
        height = 40 + 26 * len(levels) + 10
        parts = []
        for rank in range(devices):
            x = left + rank * (box + gap)
            parts.append(
                f"<rect x='{x}' y='6' width='{box}' height='{box}' rx='4' fill='#4c78a8'><title>device {rank}</title>"
                f"</rect><text x='{x + box / 2}' y='24' text-anchor='middle' font-size='11' fill='#fff'>{rank}</text>"
            )
        for depth, level in enumerate(levels):
            group = min(level["devices_per_group"], devices)
            y = 44 + 26 * depth
            for first in range(0, devices, group):
                x0 = left + first * (box + gap)
                x1 = left + (first + group) * (box + gap) - gap
                parts.append(
                    f"<path d='M{x0},{y} L{x0},{y + 8} L{x1},{y + 8} L{x1},{y}' fill='none' stroke='#555'/>"
                    f"<text x='{(x0 + x1) / 2}' y='{y + 20}' text-anchor='middle' font-size='11'>"
                    f"{escape(level['name'])} ({group})</text>"
                )
        svg = f"<svg width='{width}' height='{height}' role='img' aria-label='device mesh'>{''.join(parts)}</svg>"
    elif devices > 64:
        svg = f"<p>{devices} devices: too many to draw one by one; the levels are below.</p>"
    rows = "".join(
        f"<tr><td>{escape(level['name'])}</td><td>{', '.join(map(str, level['bits']))}</td>"
        f"<td class='num'>{level['devices_per_group']}</td><td class='num'>{level['collectives']}</td>"
        f"<td class='num'>{escape(human_bytes(level['bytes']))}</td><td class='num'>{ms(level['seconds'])}</td></tr>"
        for level in levels
    )
    return (
        f"<p>{devices} devices over {len(levels)} link level(s), fastest first; rank r sits at mesh position r, bit 0"
        " the fastest link. A collective crosses every level whose bits it spans, so it counts in each.</p>"
        f"{svg}<table><thead><tr><th>level</th><th>mesh bits</th><th>devices per group</th><th>collectives</th>"
        f"<th>bytes per rank</th><th>seconds</th></tr></thead><tbody>{rows}</tbody></table>"
    )


def _bar(
    segments: Sequence[tuple[str, float]], total: float, width: int, y: float, height: int, unit: str
) -> list[str]:
    """Stacked rectangles from x=0 scaled so ``total`` spans ``width`` (labels where they fit)."""
    parts, x = [], 0.0
    scale = width / total if total > 0 else 0.0
    for name, value in segments:
        w = value * scale
        if w <= 0:
            continue
        shown = ms(value) if unit == "s" else human_bytes(value)
        parts.append(
            f"<rect x='{120 + x:.2f}' y='{y}' width='{w:.2f}' height='{height}'"
            f" fill='{COLOURS.get(name, '#888')}'><title>{escape(name)}: {escape(shown)}</title></rect>"
        )
        if w > 70:
            parts.append(
                f"<text x='{120 + x + w / 2:.2f}' y='{y + height / 2 + 4}' text-anchor='middle' font-size='11'"
                f" fill='#fff'>{escape(shown)}</text>"
            )
        x += w
    return parts


def timeline_section(data: PlanFile, forward_s: float | None, recompute_s: float) -> str:
    """One step's critical path as a stacked bar, the hidden gradient sync drawn beside the backward."""
    phases = timeline_phases(data, forward_s, recompute_s)
    critical = phases[:-1]
    hidden = phases[-1][1]
    step = data.totals.step_time_s
    width = 600
    parts = [
        "<text x='0' y='30' font-size='12'>critical path</text>",
        "<text x='0' y='70' font-size='12'>beside it</text>",
        *_bar(critical, step, width, 14, 26, "s"),
    ]
    scale = width / step if step > 0 else 0.0
    seconds = dict(critical)
    compute_end = sum(seconds.get(name, 0.0) for name in ("compute", "forward", "recompute", "backward"))
    backward_start = compute_end - seconds.get("backward", seconds.get("compute", 0.0))
    if hidden > 0:
        start = max(backward_start, compute_end - hidden)
        parts.append(
            f"<rect x='{120 + start * scale:.2f}' y='54' width='{hidden * scale:.2f}' height='26'"
            f" fill='{COLOURS['hidden gradient sync']}'><title>hidden gradient sync: {ms(hidden)}</title></rect>"
        )
    for tick in range(5):
        x = 120 + width * tick / 4
        parts.append(
            f"<line x1='{x:.1f}' y1='88' x2='{x:.1f}' y2='93' stroke='#444'/>"
            f"<text x='{x:.1f}' y='106' text-anchor='middle' font-size='11'>{ms(step * tick / 4)}</text>"
        )
    parts.append(f"<line x1='120' y1='88' x2='{120 + width}' y2='88' stroke='#444'/>")
    legend = "".join(
        f"<li><span class='swatch' style='background:{COLOURS[name]}'></span>{escape(name)}: {ms(value)}</li>"
        for name, value in phases
    )
    note = (
        "Forward and backward split each operator's compute by the backward passes the cost model charges."
        if forward_s is not None
        else "The plan file does not split forward from backward compute; the compute is one phase."
    )
    return (
        f"<svg width='{120 + width + 40}' height='114' role='img' aria-label='one training step'>{''.join(parts)}</svg>"
        f"<ul class='legend'>{legend}</ul><p class='note'>Phases are summed, not drawn in the order events"
        f" happen (communication interleaves with compute). {escape(note)} The hidden gradient sync runs beside the"
        " backward pass and adds nothing to the step.</p>"
    )


def memory_section(data: PlanFile) -> str:
    """Memory per device as two bars: against capacity, and the used part split by kind."""
    totals = data.totals
    capacity = totals.memory_usable_bytes
    used = totals.memory_per_device_bytes
    segments: list[tuple[str, float]] = list(totals.memory_breakdown.items())
    width = 600
    parts = [
        "<text x='0' y='30' font-size='12'>vs usable</text>",
        f"<rect x='120' y='14' width='{width}' height='26' fill='#f3f4f6' stroke='#999'>"
        f"<title>usable {escape(human_bytes(capacity))}</title></rect>",
        *_bar(segments, max(capacity, used), width, 14, 26, "B"),
        "<text x='0' y='70' font-size='12'>used, split</text>",
        *_bar(segments, used, width, 54, 26, "B"),
    ]
    legend = "".join(
        f"<li><span class='swatch' style='background:{COLOURS.get(name, '#888')}'></span>"
        f"{escape(name.replace('_', ' '))}: {escape(human_bytes(value))} ({value / used if used else 0:.1%})</li>"
        for name, value in segments
    )
    return (
        f"<p>{escape(memory_against_usable(totals))} per device.</p>"
        f"<svg width='{120 + width + 20}' height='90' role='img' aria-label='memory per device'>{''.join(parts)}</svg>"
        f"<ul class='legend'>{legend}</ul><p class='note'>Parameter state: weights, gradients and optimizer state;"
        " activations: what the backward pass keeps; inputs: the data each device loads.</p>"
    )
