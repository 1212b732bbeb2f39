"""The report's hand-built SVG: the device mesh, one step's timeline, memory against capacity.

Hand-built, not a charting library: a few rectangles need no dependency, render without
JavaScript in any browser and in Jupyter, and keep the page self-contained.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from autopar.cost.mesh import Mesh
from autopar.lowering import PlanFile
from autopar.lowering.axes import logical_axes
from autopar.lowering.stages import one_f_one_b
from autopar.report.figures import fold_groups, incoming_seconds, level_traffic, timeline_phases
from autopar.report.format import escape, memory_against_usable, ms
from autopar.units import human_bytes

COLOURS = {
    "forward": "#4c78a8",
    "recompute": "#9ecae9",
    "backward": "#72b7b2",
    "compute": "#4c78a8",
    "exposed gradient sync": "#e45756",
    "other exposed communication": "#f58518",
    "optimizer update": "#b279a2",
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


ROLE_COLOURS = {
    "pipeline": "#b279a2",
    "data": "#4c78a8",
    "sequence": "#54a24b",
    "tensor": "#f58518",
    "replicated": "#bab0ac",
}


def _units(count: int, size: int, x: float, y: float) -> list[str]:
    """``count`` boxes of ``size`` devices each from (x, y): every box up to 8, else five, an ellipsis and the last."""
    box, gap = 34, 5
    shown = list(range(count)) if count <= 8 else [0, 1, 2, 3, 4, -1, count - 1]
    parts = []
    for k, index in enumerate(shown):
        left = x + k * (box + gap)
        if index < 0:
            parts.append(f"<text x='{left + box / 2}' y='{y + 21}' text-anchor='middle' font-size='14'>&#8230;</text>")
            continue
        parts.append(
            f"<rect x='{left}' y='{y}' width='{box}' height='30' rx='4' fill='#eef2f7' stroke='#4c78a8'>"
            f"<title>unit {index} of {count}: {size} device{'s' if size != 1 else ''}</title></rect>"
            f"<text x='{left + box / 2}' y='{y + 19}' text-anchor='middle' font-size='11'>{size}</text>"
        )
    return parts


def mesh_figure(data: PlanFile) -> str:
    """The mesh as levels, not devices: a row per link level (slowest first) with the units it joins (each
    unit's devices written in it; five, an ellipsis and the last past eight), its mesh bits coloured by the
    logical axis each serves (`autopar.lowering.axes`), and the collective time that crosses it."""
    levels = level_traffic(data)
    if not levels:
        return ""
    role_of = {bit: axis.name for axis in logical_axes(data) for bit in axis.bits}
    slowest = max(level["seconds"] for level in levels) or 1.0
    row, top = 56, 30
    label_x, units_x, bits_x, bar_x, bar_w = 0, 190, 520, 760, 200
    parts = [
        f"<text x='{label_x}' y='16' font-size='12' font-weight='600'>link level</text>",
        f"<text x='{units_x}' y='16' font-size='12' font-weight='600'>joins (devices in each)</text>",
        f"<text x='{bits_x}' y='16' font-size='12' font-weight='600'>mesh bits, by axis</text>",
        f"<text x='{bar_x}' y='16' font-size='12' font-weight='600'>collective time crossing it</text>",
    ]
    ordered = sorted(levels, key=lambda level: -max(level["bits"]))
    for depth, level in enumerate(ordered):
        y = top + depth * row
        group = level["devices_per_group"]
        count = 1 << len(level["bits"])
        child = group // count
        parts.append(
            f"<text x='{label_x}' y='{y + 14}' font-size='13' font-weight='600'>{escape(level['name'])}</text>"
            f"<text x='{label_x}' y='{y + 30}' font-size='11' fill='#555'>{count:,} units of {child:,}:"
            f" groups of {group:,}</text>"
        )
        parts += _units(count, child, units_x, y)
        for k, bit in enumerate(sorted(level["bits"], reverse=True)):
            role = role_of.get(bit, "replicated")
            parts.append(
                f"<rect x='{bits_x + k * 22}' y='{y + 4}' width='20' height='22' rx='3' fill='{ROLE_COLOURS[role]}'>"
                f"<title>bit {bit}: {escape(role)}</title></rect><text x='{bits_x + k * 22 + 10}' y='{y + 19}'"
                f" text-anchor='middle' font-size='10' fill='#fff'>{bit}</text>"
            )
        width = bar_w * level["seconds"] / slowest
        parts.append(
            f"<rect x='{bar_x}' y='{y + 4}' width='{width:.1f}' height='22' fill='#e45756'>"
            f"<title>{escape(level['name'])}: {ms(level['seconds'])}</title></rect>"
            f"<text x='{bar_x + width + 6:.1f}' y='{y + 19}' font-size='11'>{ms(level['seconds'])},"
            f" {level['collectives']:,} collectives</text>"
        )
    height = top + len(ordered) * row
    legend = "".join(
        f"<li><span class='swatch' style='background:{colour}'></span>{escape(role)}</li>"
        for role, colour in ROLE_COLOURS.items()
        if role in role_of.values()
    )
    return (
        f"<svg width='1100' height='{height}' viewBox='0 0 1100 {height}' role='img' aria-label='device mesh by"
        f" link level'>{''.join(parts)}</svg><ul class='legend'>{legend}</ul>"
    )


def mesh_section(data: PlanFile) -> str:
    """The mesh as link levels and groups (`mesh_figure`), then the traffic each level carries as a table."""
    devices = data.devices
    levels = level_traffic(data)
    axes = logical_axes(data)
    named = " x ".join(f"{axis.name} {axis.size:,}" for axis in axes)
    rows = "".join(
        f"<tr><td>{escape(level['name'])}</td><td>{', '.join(map(str, level['bits']))}</td>"
        f"<td class='num'>{level['devices_per_group']:,}</td><td class='num'>{level['collectives']:,}</td>"
        f"<td class='num'>{escape(human_bytes(level['bytes']))}</td><td class='num'>{ms(level['seconds'])}</td></tr>"
        for level in levels
    )
    return (
        f"<p>{devices:,} devices over {len(levels)} link level(s); rank r sits at mesh position r, bit 0 the fastest"
        " link. Each row is one level, slowest first: how many units it joins and how many devices each holds"
        " (a unit is a group of the level below). A collective crosses every level whose bits it spans, so it"
        f" counts in each.{' Logical axes: ' + escape(named) + ' (the exports name them).' if named else ''}</p>"
        f"{mesh_figure(data)}<table><thead><tr><th>level</th><th>mesh bits</th><th class='num'>devices per group"
        "</th><th class='num'>collectives</th><th class='num'>bytes per rank</th><th class='num'>seconds</th></tr>"
        f"</thead><tbody>{rows}</tbody></table>"
    )


def costliest_section(data: PlanFile, top: int = 12) -> str:
    """The ``top`` costliest rows (repeated blocks folded, every copy counted) as stacked bars: compute, own
    communication, redistribution into the operator."""
    ops = data.ops
    moved = incoming_seconds(data)
    groups = fold_groups(data)

    def parts_of(group: list[int]) -> list[tuple[str, float]]:
        op = ops[group[0]]
        n = len(group)
        return [
            ("compute", op.cost.compute_s * n),
            ("own communication", op.cost.communication_s * n),
            ("optimizer update", (op.cost.update_s or 0.0) * n),
            ("redistribution", moved.get(op.name, 0.0) * n),
        ]

    ranked = sorted(groups, key=lambda g: (-sum(v for _, v in parts_of(g)), g[0]))[:top]
    if not ranked:
        return "<p>No operators.</p>"
    biggest = max(sum(v for _, v in parts_of(g)) for g in ranked) or 1.0
    width, row, left = 560, 24, 300
    colours = {
        "compute": COLOURS["compute"],
        "own communication": "#e45756",
        "optimizer update": COLOURS["optimizer update"],
        "redistribution": "#f58518",
    }
    svg = []
    for k, group in enumerate(ranked):
        op = ops[group[0]]
        y = 6 + k * row
        name = op.name if len(op.name) <= 34 else op.name[:33] + "~"
        label = name + (f" ({len(group)} copies)" if len(group) > 1 else "")
        svg.append(
            f"<text x='{left - 8}' y='{y + 14}' text-anchor='end' font-size='11'>{escape(label)}"
            f"<title>{escape(op.name)} ({escape(op.op_type)})</title></text>"
        )
        x = float(left)
        for part, value in parts_of(group):
            w = width * value / biggest
            if w > 0:
                svg.append(
                    f"<rect x='{x:.1f}' y='{y}' width='{w:.1f}' height='18' fill='{colours[part]}'>"
                    f"<title>{escape(part)}: {ms(value)}</title></rect>"
                )
            x += w
        total = sum(v for _, v in parts_of(group))
        svg.append(f"<text x='{x + 6:.1f}' y='{y + 14}' font-size='11'>{ms(total)}</text>")
    height = 12 + len(ranked) * row
    legend = "".join(
        f"<li><span class='swatch' style='background:{colour}'></span>{escape(part)}</li>"
        for part, colour in colours.items()
    )
    return (
        f"<p>The {len(ranked)} costliest operators of a step (a repeated block's row counts every copy): where the"
        " time goes at a glance; the strategy map and the collectives below give each one's strategy and steps.</p>"
        f"<svg width='{left + width + 120}' height='{height}' role='img' aria-label='costliest operators'>"
        f"{''.join(svg)}</svg><ul class='legend'>{legend}</ul>"
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


def schedule_section(data: PlanFile) -> str:
    """A pipelined plan's 1F1B schedule: stages over time, every micro-batch's forward and backward, the
    bubble left white (drawn with each stage at the slowest stage's pace, a backward twice a forward)."""
    pipe = data.pipeline
    if pipe is None:
        raise ValueError("a plan without pipeline stages has no schedule to draw")
    stages, micro = len(pipe.stages), pipe.micro_batches
    slowest = max(stage.step_time_s for stage in pipe.stages)
    per_micro_batch = (data.totals.pipeline_bubble_s or 0.0) / max(1, stages - 1) if stages > 1 else slowest
    forward, backward = per_micro_batch / 3, 2 * per_micro_batch / 3
    rows = one_f_one_b(stages, micro, forward, backward)
    end = max((start + (forward if kind == "F" else backward) for row in rows for kind, _, start in row), default=0.0)
    width, height = 640, 22
    scale = width / end if end > 0 else 0.0
    parts = []
    for index, row in enumerate(rows):
        y = 10 + index * (height + 6)
        parts.append(f"<text x='0' y='{y + 15}' font-size='12'>stage {index}</text>")
        for kind, m, start in row:
            span = (forward if kind == "F" else backward) * scale
            colour = COLOURS["forward" if kind == "F" else "backward"]
            parts.append(
                f"<rect x='{90 + start * scale:.2f}' y='{y}' width='{span:.2f}' height='{height}' fill='{colour}'"
                f" stroke='#fff'><title>stage {index}: {'forward' if kind == 'F' else 'backward'} of micro-batch"
                f" {m}</title></rect>"
            )
            if span > 16:
                parts.append(
                    f"<text x='{90 + start * scale + span / 2:.2f}' y='{y + 15}' text-anchor='middle' font-size='10'"
                    f" fill='#fff'>{m}</text>"
                )
    total = 10 + stages * (height + 6) + 10
    legend = (
        f"<li><span class='swatch' style='background:{COLOURS['forward']}'></span>forward</li>"
        f"<li><span class='swatch' style='background:{COLOURS['backward']}'></span>backward</li>"
    )
    return (
        f"<svg width='{90 + width + 20}' height='{total}' role='img' aria-label='pipeline schedule'>{''.join(parts)}"
        f"</svg><ul class='legend'>{legend}</ul><p class='note'>{stages} stages x {micro} micro-batches under"
        f" {escape(pipe.schedule)}: the white is the bubble, {pipe.bubble_fraction:.1%} of each stage's step"
        f" ({ms(data.totals.pipeline_bubble_s or 0.0)}). Every stage is drawn at the slowest stage's pace,"
        " a backward twice a forward; the gradient sync follows each stage's last backward.</p>"
    )


def memory_section(data: PlanFile) -> str:
    """Memory per device as two bars: against capacity, and the used part split by kind."""
    totals = data.totals
    capacity = totals.memory_usable_bytes
    used = totals.memory_per_device_bytes
    segments: list[tuple[str, float]] = list(totals.memory_breakdown.items())
    held = max(used, sum(value for _, value in segments))  # more than the peak on one device (`_never_at_once`)
    at_peak = [(name, value * used / held) for name, value in segments] if held > used else segments
    width = 600
    parts = [
        "<text x='0' y='30' font-size='12'>vs usable</text>",
        f"<rect x='120' y='14' width='{width}' height='26' fill='#f3f4f6' stroke='#999'>"
        f"<title>usable {escape(human_bytes(capacity))}</title></rect>",
        *_bar(at_peak, max(capacity, used), width, 14, 26, "B"),
        "<text x='0' y='70' font-size='12'>used, split</text>",
        *_bar(segments, held, width, 54, 26, "B"),
    ]
    legend = "".join(
        f"<li><span class='swatch' style='background:{COLOURS.get(name, '#888')}'></span>"
        f"{escape(name.replace('_', ' '))}: {escape(human_bytes(value))} ({value / held if held else 0:.1%})</li>"
        for name, value in segments
    )
    never = _never_at_once(held, used)
    return (
        f"<p>{escape(memory_against_usable(totals))} per device.</p>"
        f"<svg width='{120 + width + 20}' height='90' role='img' aria-label='memory per device'>{''.join(parts)}</svg>"
        f"<ul class='legend'>{legend}</ul><p class='note'>Parameter state: weights, gradients and optimizer state;"
        f" activations: what the backward pass keeps; inputs: the data each device loads.{never}</p>"
    )


def _never_at_once(held: float, used: float) -> str:
    """The note's sentence where the kinds add up to more than the peak: one process makes its gradients in the
    backward, as it frees activations (`SearchProblem.memory`)."""
    if held <= used:
        return ""
    return (
        f" {human_bytes(held - used)} of them is never held at once: one process makes its gradients in the"
        " backward, as it frees activations (the first bar is the peak, in their shares)."
    )
