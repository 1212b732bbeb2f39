"""The plan report: one self-contained HTML page (inline CSS and hand-built SVG, no script, nothing fetched).

`report_html` reads a plan file dict (``Plan.to_dict()``, or a plan JSON file) and, when given,
the data-parallel and stand-alone plans of the same problem and the forward share of the compute;
`plan_html` (a `Plan`'s Jupyter display) and `plan_report` (``autopar report``) work those out from
a `Plan` on its own problem, so the comparison costs one lowering each, not a new search.

Sections, each an ``<section id=...>`` with an ``<h2>``:

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

import dataclasses
import html
import math
from collections.abc import Mapping, Sequence
from typing import Any

from autopar.lowering import GRAPH_OUTPUT, Plan
from autopar.report.text import _levels, _strategy
from autopar.search.driver import data_parallel_choice, stand_alone_choice
from autopar.search.problem import MemoryChoices, backward_passes
from autopar.units import human_bytes

AXES = ("batch", "sequence", "channels/hidden", "heads", "contraction")
AXIS_TITLES = {
    "batch": "batch (leading dimension)",
    "sequence": "sequence (or image space)",
    "channels/hidden": "channels / hidden (features, output channels, vocabulary, head size)",
    "heads": "attention heads",
    "contraction": "contraction (a reduced axis: the output is a partial sum)",
}
SECTIONS = ("summary", "strategy-map", "mesh", "timeline", "memory", "why", "collectives")
IMAGE_OPS = frozenset({"Conv", "ConvTranspose", "MaxPool", "AveragePool", "GlobalAveragePool"})
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


# --- reading the plan file -------------------------------------------------------------------


def _kind_at(position: int, rank: int, image: bool) -> str:
    """The axis kind of dimension ``position`` of a tensor of ``rank`` dimensions (the map's column rule)."""
    if rank == 0 or position == 0:
        return "batch"
    if rank == 2:
        return "channels/hidden"
    if rank == 3:
        return "sequence" if position == 1 else "channels/hidden"
    if rank == 4 and image:
        return "channels/hidden" if position == 1 else "sequence"
    if rank == 4:
        return ("heads", "sequence", "channels/hidden")[position - 1]
    return "channels/hidden" if position == rank - 1 else "sequence"


def axis_splits(op: Mapping[str, Any], image: bool) -> tuple[dict[str, int], int]:
    """(split factor per axis kind, devices the operator divides its work over), from its layouts alone.

    Every mesh bit the operator's layouts use is one factor of 2 on one axis. A bit is placed by
    where it lands in the first output: on its dimension e of rank r -> the kind of position e; in the
    output's partial bits -> contraction (a reduced axis), except for a full reduction to a scalar (a
    loss), whose bits keep the kind of the input dimension they split. Positions: rank <= 1 and
    dimension 0 of every tensor are batch; rank 2 is (batch, hidden); rank 3 (batch, sequence,
    hidden); rank 4 (batch, channels, space, space) in a model with convolutions or pooling, otherwise
    (batch, heads, sequence, hidden — for attention scores the last is the key sequence); higher
    ranks put hidden last and sequence between. A bit no output holds keeps its input position's kind.
    """
    outputs = op.get("outputs") or []
    where: dict[int, str] = {}
    if outputs:
        layout = outputs[0]["layout"]
        rank = len(layout["dims"])
        for position, bits in enumerate(layout["dims"]):
            for bit in bits:
                where[bit] = _kind_at(position, rank, image)
        if rank:
            for bit in layout.get("partial") or []:
                where[bit] = "contraction"
    for entry in op.get("inputs", []):
        dims = entry["layout"]["dims"]
        for position, bits in enumerate(dims):
            for bit in bits:
                where.setdefault(bit, _kind_at(position, len(dims), image))
    bits_of: dict[str, int] = {}
    for kind in where.values():
        bits_of[kind] = bits_of.get(kind, 0) + 1
    return {kind: 1 << count for kind, count in bits_of.items()}, 1 << len(where)


def fold_groups(data: Mapping[str, Any]) -> list[list[int]]:
    """Operator indices grouped by row: a repeated block's later copies join the first copy's operator.

    ``search.repeated_blocks`` gives (first_op, operators per copy, copies); an operator of a later
    copy folds into the first copy's operator at the same offset when type and strategy agree (a
    fixed operator inside the blocks is no longer a copy: it keeps its own row).
    """
    ops = data["ops"]
    index = {op["name"]: i for i, op in enumerate(ops)}
    representative: dict[int, int] = {}
    for block in data["search"].get("repeated_blocks", []):
        start = index.get(block["first_op"])
        if start is None:
            continue
        period = block["operators"]
        for copy in range(1, block["copies"]):
            for offset in range(period):
                i, first = start + copy * period + offset, start + offset
                if i < len(ops) and (ops[i]["op_type"], ops[i]["strategy"]) == (
                    ops[first]["op_type"],
                    ops[first]["strategy"],
                ):
                    representative[i] = first
    groups: dict[int, list[int]] = {}
    for i in range(len(ops)):
        groups.setdefault(representative.get(i, i), []).append(i)
    return [groups[key] for key in sorted(groups)]


def _samples_per_step(data: Mapping[str, Any]) -> int | None:
    """The data inputs' common leading size times the micro-batches (None: no common batch)."""
    shapes = (data.get("context") or {}).get("inputs") or {}
    sizes = {shape[0] for shape in shapes.values() if shape}
    if len(sizes) != 1:
        return None
    return int(sizes.pop()) * int(data["memory_plan"]["micro_batches"])


def summary_figures(data: Mapping[str, Any], stand_alone: Mapping[str, Any] | None = None) -> dict[str, float | None]:
    """The numbers the summary cards show (None: not known)."""
    totals = data["totals"]
    step = totals["step_time_s"]
    samples = _samples_per_step(data)
    return {
        "step_time_s": step,
        "samples_per_s": samples / step if samples and step > 0 else None,
        "mfu": totals["ideal_step_time_s"] / step if step > 0 else None,
        "memory_per_device_bytes": totals["memory_per_device_bytes"],
        "memory_capacity_bytes": totals["memory_capacity_bytes"],
        "speedup_vs_data_parallel": totals["speedup_vs_data_parallel"],
        "speedup_vs_stand_alone": (
            stand_alone["totals"]["step_time_s"] / step if stand_alone is not None and step > 0 else None
        ),
    }


def warnings_of(data: Mapping[str, Any]) -> list[str]:
    """Plain sentences about what a reader should not miss."""
    devices = data["devices"]
    image = any(op["op_type"] in IMAGE_OPS for op in data["ops"])
    used = [axis_splits(op, image)[1] for op in data["ops"]]
    found = []
    if devices > 1 and max(used) == 1:
        found.append(
            f"The model is fully replicated: every operator runs whole on each of the {devices} devices,"
            " which repeat one another's work."
        )
    elif max(used) < devices:
        found.append(
            f"Idle devices: the largest split uses {max(used)} of {devices} devices; the other"
            f" {devices // max(used) - 1} of every {devices // max(used)} repeat the same calculation."
        )
    if data["fallback_ops"]:
        named = ", ".join(data["fallback_ops"][:8]) + (" and more" if len(data["fallback_ops"]) > 8 else "")
        found.append(
            f"{len(data['fallback_ops'])} fallback operator(s) without a strategy rule run replicated with their"
            f" inputs gathered: {named}."
        )
    memory_plan = data["memory_plan"]
    if memory_plan["parallel_optimizer"]:
        found.append(
            f"To fit in memory, {len(memory_plan['parallel_optimizer'])} parameters use the parallel optimizer"
            " (gradient and optimizer state split, weights gathered after the update)."
        )
    if memory_plan["recompute"]:
        found.append(
            "To fit in memory, the repeated blocks from " + ", ".join(memory_plan["recompute"]) + " recompute"
            " their forward pass in the backward."
        )
    if memory_plan["micro_batches"] > 1:
        found.append(
            f"To fit in memory, the step accumulates gradients over {memory_plan['micro_batches']} micro-batches;"
            " the operators' shapes and costs below are one micro-batch's."
        )
    totals = data["totals"]
    if totals["memory_per_device_bytes"] > 0.9 * totals["memory_capacity_bytes"]:
        found.append("Memory is over 90% of capacity: a larger batch or model will not fit.")
    return found


def level_traffic(data: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Per mesh level: its bits, devices per group, and the collectives whose bits cross it.

    A collective over bits of two levels counts in both (its bytes cross both links), so the
    levels' figures do not add up to the plan's. Redistributions count forward and backward
    (their dual collective); local Slice steps cross nothing.
    """
    levels = []
    for link in data["links"]:
        levels.append(
            {
                "name": link["name"],
                "bits": list(link["bits"]),
                "devices_per_group": 1 << (max(link["bits"]) + 1) if link["bits"] else 1,
                "collectives": 0,
                "bytes": 0,
                "seconds": 0.0,
            }
        )

    def add(bits: Sequence[int], nbytes: int, seconds: float, count: int) -> None:
        for level in levels:
            if set(bits) & set(level["bits"]):
                level["collectives"] += count
                level["bytes"] += nbytes
                level["seconds"] += seconds

    for red in data["redistributions"]:
        for step in red["steps"]:
            if step["collective"] == "Slice":
                continue
            both = 2 if step["backward"] else 1
            add(step["bits"], step["bytes"] * both, step["seconds"] + step["backward_seconds"], both)
    for sync in data["gradient_sync"]:
        if sync["collective"]:
            add(sync["bits"], sync["bytes"], sync["seconds"], 1)
    return levels


def timeline_phases(
    data: Mapping[str, Any], forward_s: float | None = None, recompute_s: float = 0.0
) -> list[tuple[str, float]]:
    """The step's critical path as (phase, seconds), summing to the step time, then the hidden sync.

    Without ``forward_s`` (a plan file alone does not split compute) the compute is one phase.
    Exposed communication splits into the gradient sync the backward could not hide and the rest
    (redistributions, backward AllReduces of inputs read whole, weight gathers).
    """
    totals = data["totals"]
    compute = totals["compute_s"]
    phases: list[tuple[str, float]] = []
    if forward_s is None:
        phases.append(("compute", compute))
    else:
        forward = min(forward_s, compute)
        recompute = min(recompute_s, compute - forward)
        phases += [("forward", forward)]
        if recompute > 0:
            phases.append(("recompute", recompute))
        phases.append(("backward", max(0.0, compute - forward - recompute)))
    exposed_sync = min(
        max(0.0, totals["gradient_sync_s"] - totals["hidden_communication_s"]), totals["communication_s"]
    )
    phases += [
        ("exposed gradient sync", exposed_sync),
        ("other exposed communication", max(0.0, totals["communication_s"] - exposed_sync)),
        ("hidden gradient sync", totals["hidden_communication_s"]),
    ]
    return phases


# --- drawing -----------------------------------------------------------------------------------


def _e(value: object) -> str:
    return html.escape(str(value), quote=True)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"


def _factor_colour(factor: int, devices: int) -> tuple[str, str]:
    """(background, text colour) for a split factor: grey for 1, light to dark blue up to ``devices``."""
    if factor <= 1:
        return "#f3f4f6", "#9ca3af"
    share = math.log2(factor) / max(1.0, math.log2(devices))
    low, high = (198, 219, 239), (8, 48, 107)
    rgb = tuple(round(a + (b - a) * share) for a, b in zip(low, high))
    return "#{:02x}{:02x}{:02x}".format(*rgb), "#fff" if share > 0.45 else "#111"


def _card(key: str, label: str, value: float | None, shown: str, note: str) -> str:
    exact = "" if value is None else f" data-value='{value!r}'"
    return (
        f"<div class='card' data-key='{key}'{exact}><div class='label'>{_e(label)}</div>"
        f"<div class='value'>{_e(shown)}</div><div class='note'>{_e(note)}</div></div>"
    )


def _summary(data: Mapping[str, Any], stand_alone: Mapping[str, Any] | None) -> str:
    figures = summary_figures(data, stand_alone)
    totals = data["totals"]
    samples = _samples_per_step(data)
    step = totals["step_time_s"]
    throughput = figures["samples_per_s"]
    mfu = figures["mfu"]
    used, capacity = totals["memory_per_device_bytes"], totals["memory_capacity_bytes"]
    vs_alone = figures["speedup_vs_stand_alone"]
    cards = [
        _card(
            "step_time_s",
            "predicted step time",
            step,
            _ms(step),
            f"compute {_ms(totals['compute_s'])}, exposed communication {_ms(totals['communication_s'])}",
        ),
        _card(
            "samples_per_s",
            "throughput",
            throughput,
            f"{throughput:,.1f} samples/s" if throughput is not None else "unknown",
            f"{samples} samples a step" if samples else "the data inputs share no leading size",
        ),
        _card(
            "mfu",
            "MFU",
            mfu,
            f"{mfu:.1%}" if mfu is not None else "-",
            f"ideal step {_ms(totals['ideal_step_time_s'])} (training FLOPs / devices x peak)",
        ),
        _card(
            "memory_per_device_bytes",
            "memory per device",
            used,
            human_bytes(used),
            f"of {human_bytes(capacity)} ({used / capacity:.1%})" if capacity else "capacity unknown",
        ),
        _card(
            "speedup_vs_data_parallel",
            "speed-up vs data parallel",
            totals["speedup_vs_data_parallel"],
            f"x{totals['speedup_vs_data_parallel']:.3f}",
            f"data parallel {_ms(totals['data_parallel_step_time_s'])}",
        ),
        _card(
            "speedup_vs_stand_alone",
            "speed-up vs stand-alone",
            vs_alone,
            f"x{vs_alone:.2f}" if vs_alone is not None else "not computed",
            f"stand-alone {_ms(stand_alone['totals']['step_time_s'])} (every operator whole on every device)"
            if stand_alone is not None
            else "needs the plan on its problem (a plan file alone cannot say)",
        ),
    ]
    found = warnings_of(data)
    warned = (
        "<ul class='warnings'>" + "".join(f"<li>{_e(w)}</li>" for w in found) + "</ul>"
        if found
        else "<p class='ok'>No warnings: every device does distinct work and every operator has a strategy rule.</p>"
    )
    return f"<div class='cards'>{''.join(cards)}</div><h3>Warnings</h3>{warned}"


def _strategy_map(data: Mapping[str, Any]) -> str:
    ops = data["ops"]
    devices = data["devices"]
    image = any(op["op_type"] in IMAGE_OPS for op in ops)
    rows = []
    for group in fold_groups(data):
        op = ops[group[0]]
        splits, used = axis_splits(op, image)
        strategy = _strategy(op["strategy"])
        names = [ops[i]["name"] for i in group]
        title = f"in_strategy {strategy}" + (
            f"; also {len(names) - 1} copies: {', '.join(names[1:])}" if len(names) > 1 else ""
        )
        cells = []
        for axis in AXES:
            factor = splits.get(axis, 1)
            background, colour = _factor_colour(factor, devices)
            cells.append(
                f"<td class='f' style='background:{background};color:{colour}'"
                f" title='{_e(axis)}: split {factor} ways; in_strategy {_e(strategy)}'>"
                f"{'x' + str(factor) if factor > 1 else '1'}</td>"
            )
        repeated = devices // used
        flags = (" fallback" if op["fallback"] else "") + (" fixed" if op.get("fixed") else "")
        rows.append(
            f"<tr data-op='{_e(op['name'])}' data-count='{len(group)}' title='{_e(title)}'>"
            f"<td class='name'>{_e(op['name'])}{_e(flags)}</td><td>{_e(op['op_type'])}</td>"
            f"<td class='num'>{'x' + str(len(group)) if len(group) > 1 else ''}</td>{''.join(cells)}"
            f"<td class='num'>{'x' + str(repeated) if repeated > 1 else '-'}</td>"
            f"<td><code>{_e(strategy)}</code></td></tr>"
        )
    swatches = [(f, *_factor_colour(f, devices)) for f in (1 << b for b in range(int(math.log2(devices)) + 1))]
    legend = "".join(
        f"<span class='swatch' style='background:{background};color:{colour}'>x{f}</span>"
        for f, background, colour in swatches
    )
    heads = "".join(f"<th title='{_e(AXIS_TITLES[a])}'>{_e(a)}</th>" for a in AXES)
    folded = sum(len(g) - 1 for g in fold_groups(data))
    note = (
        f" {folded} operators of repeated blocks are folded into their first copy's row (the copies column)."
        if folded
        else ""
    )
    return (
        f"<p>Split factor per axis kind; colour: {legend}. Hover a row for the exact in_strategy.{_e(note)}"
        " Columns come from the layouts: a mesh bit counts for the axis of the output dimension it splits"
        " (position in a tensor of that rank), or for contraction when the output is partial over it."
        " <i>repeated</i>: devices that compute the same shard.</p>"
        "<div class='scroll'><table class='map'><thead><tr><th>operator</th><th>type</th><th>copies</th>"
        f"{heads}<th>repeated</th><th>in_strategy</th></tr></thead><tbody>{''.join(rows)}</tbody></table></div>"
    )


def _mesh(data: Mapping[str, Any]) -> str:
    devices = data["devices"]
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
                    f"{_e(level['name'])} ({group})</text>"
                )
        svg = f"<svg width='{width}' height='{height}' role='img' aria-label='device mesh'>{''.join(parts)}</svg>"
    elif devices > 64:
        svg = f"<p>{devices} devices: too many to draw one by one; the levels are below.</p>"
    rows = "".join(
        f"<tr><td>{_e(level['name'])}</td><td>{', '.join(map(str, level['bits']))}</td>"
        f"<td class='num'>{level['devices_per_group']}</td><td class='num'>{level['collectives']}</td>"
        f"<td class='num'>{_e(human_bytes(level['bytes']))}</td><td class='num'>{_ms(level['seconds'])}</td></tr>"
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
        shown = _ms(value) if unit == "s" else human_bytes(value)
        parts.append(
            f"<rect x='{120 + x:.2f}' y='{y}' width='{w:.2f}' height='{height}'"
            f" fill='{COLOURS.get(name, '#888')}'><title>{_e(name)}: {_e(shown)}</title></rect>"
        )
        if w > 70:
            parts.append(
                f"<text x='{120 + x + w / 2:.2f}' y='{y + height / 2 + 4}' text-anchor='middle' font-size='11'"
                f" fill='#fff'>{_e(shown)}</text>"
            )
        x += w
    return parts


def _timeline(data: Mapping[str, Any], forward_s: float | None, recompute_s: float) -> str:
    phases = timeline_phases(data, forward_s, recompute_s)
    critical = phases[:-1]
    hidden = phases[-1][1]
    step = data["totals"]["step_time_s"]
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
            f" fill='{COLOURS['hidden gradient sync']}'><title>hidden gradient sync: {_ms(hidden)}</title></rect>"
        )
    for tick in range(5):
        x = 120 + width * tick / 4
        parts.append(
            f"<line x1='{x:.1f}' y1='88' x2='{x:.1f}' y2='93' stroke='#444'/>"
            f"<text x='{x:.1f}' y='106' text-anchor='middle' font-size='11'>{_ms(step * tick / 4)}</text>"
        )
    parts.append(f"<line x1='120' y1='88' x2='{120 + width}' y2='88' stroke='#444'/>")
    legend = "".join(
        f"<li><span class='swatch' style='background:{COLOURS[name]}'></span>{_e(name)}: {_ms(value)}</li>"
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
        f" happen (communication interleaves with compute). {_e(note)} The hidden gradient sync runs beside the"
        " backward pass and adds nothing to the step.</p>"
    )


def _memory(data: Mapping[str, Any]) -> str:
    totals = data["totals"]
    capacity = totals["memory_capacity_bytes"]
    used = totals["memory_per_device_bytes"]
    segments = list(totals["memory_breakdown"].items())
    width = 600
    parts = [
        "<text x='0' y='30' font-size='12'>vs capacity</text>",
        f"<rect x='120' y='14' width='{width}' height='26' fill='#f3f4f6' stroke='#999'>"
        f"<title>capacity {_e(human_bytes(capacity))}</title></rect>",
        *_bar(segments, max(capacity, used), width, 14, 26, "B"),
        "<text x='0' y='70' font-size='12'>used, split</text>",
        *_bar(segments, used, width, 54, 26, "B"),
    ]
    legend = "".join(
        f"<li><span class='swatch' style='background:{COLOURS.get(name, '#888')}'></span>{_e(name.replace('_', ' '))}:"
        f" {_e(human_bytes(value))} ({value / used if used else 0:.1%})</li>"
        for name, value in segments
    )
    return (
        f"<p>{_e(human_bytes(used))} of {_e(human_bytes(capacity))} per device"
        f" ({used / capacity if capacity else 0:.1%}).</p>"
        f"<svg width='{120 + width + 20}' height='90' role='img' aria-label='memory per device'>{''.join(parts)}</svg>"
        f"<ul class='legend'>{legend}</ul><p class='note'>Parameter state: weights, gradients and optimizer state;"
        " activations: what the backward pass keeps; inputs: the data each device loads.</p>"
    )


def _incoming(data: Mapping[str, Any]) -> dict[str, float]:
    """Seconds of redistribution into each operator (a partial graph output's reduction: its producer)."""
    seconds: dict[str, float] = {}
    for red in data["redistributions"]:
        target = red["consumer"] if red["consumer"] != GRAPH_OUTPUT else red["producer"]
        seconds[target] = seconds.get(target, 0.0) + red["seconds"]
    return seconds


def _splits_in_words(splits: Mapping[str, int]) -> str:
    words = [f"{axis} x{splits[axis]}" for axis in AXES if splits.get(axis, 1) > 1]
    return ", ".join(words) if words else "nothing (replicated)"


def _why(data: Mapping[str, Any], data_parallel: Mapping[str, Any] | None) -> str:
    ops = data["ops"]
    image = any(op["op_type"] in IMAGE_OPS for op in ops)
    if data_parallel is None:
        return (
            "<p>The comparison needs the data-parallel plan of the same problem (the report of a `Plan`, or"
            " <code>autopar report</code>, works it out).</p>"
        )
    reference = {op["name"]: op for op in data_parallel["ops"]}
    mine, theirs = _incoming(data), _incoming(data_parallel)
    rows, differ = [], 0
    for group in fold_groups(data):
        op = ops[group[0]]
        other = reference.get(op["name"])
        if other is None or other["strategy"] == op["strategy"]:
            continue
        differ += len(group)
        cost, base = op["cost"], other["cost"]
        here = cost["compute_s"] + cost["communication_s"] + mine.get(op["name"], 0.0)
        there = base["compute_s"] + base["communication_s"] + theirs.get(op["name"], 0.0)
        delta = there - here
        verdict = (
            f"{_ms(delta)} faster here" if delta > 1e-12 else f"{_ms(-delta)} slower here" if delta < -1e-12 else "even"
        )
        if delta < -1e-12:
            verdict += " (repaid by its neighbours: fewer redistributions or gradient sync elsewhere)"
        copies = f" (each of {len(group)} copies)" if len(group) > 1 else ""
        memory = (
            f"; memory {human_bytes(cost['memory_bytes'])} vs {human_bytes(base['memory_bytes'])}"
            if cost["memory_bytes"] != base["memory_bytes"]
            else ""
        )
        sentence = (
            f"splits {_splits_in_words(axis_splits(op, image)[0])} where data parallel splits"
            f" {_splits_in_words(axis_splits(other, image)[0])}. Compute {_ms(cost['compute_s'])}"
            f" (data parallel {_ms(base['compute_s'])}), own communication {_ms(cost['communication_s'])}"
            f" ({_ms(base['communication_s'])}), redistribution into it {_ms(mine.get(op['name'], 0.0))}"
            f" ({_ms(theirs.get(op['name'], 0.0))}){memory}: {verdict}{copies}."
        )
        rows.append(
            f"<tr data-op='{_e(op['name'])}' title='in_strategy {_e(_strategy(op['strategy']))}'>"
            f"<td class='name'>{_e(op['name'])}</td><td>{_e(op['op_type'])}</td><td>{_e(sentence)}</td></tr>"
        )
    if not rows:
        return "<p>Every operator takes the data-parallel strategy: the batch split over all devices.</p>"
    return (
        f"<p>{differ} of {len(ops)} operators leave data parallel (the batch split over all devices). Own"
        " communication counts the operator's gradient sync before any overlap and backward AllReduces of"
        " inputs it reads whole; redistribution counts forward and backward.</p>"
        f"<table><thead><tr><th>operator</th><th>type</th><th>why, against data parallel</th></tr></thead>"
        f"<tbody>{''.join(rows)}</tbody></table>"
    )


def collective_rows(data: Mapping[str, Any]) -> list[tuple[float, str, str, str]]:
    """(seconds, sentence, where, phase) for every collective the step runs, costliest first."""
    links = data["links"]
    rows: list[tuple[float, str, str, str]] = []
    for red in data["redistributions"]:
        where = (
            f"{red['producer']} -> {red['consumer']}"
            if red["consumer"] != GRAPH_OUTPUT
            else f"{red['producer']} -> graph output"
        )
        for step in red["steps"]:
            if step["collective"] != "Slice":
                rows.append((step["seconds"], _sentence(links, step, red["tensor"]), where, "forward"))
    for path in data.get("gradients", []):
        what = f"the {path['carries']} {path['tensor']}" if path.get("carries") else f"the gradient of {path['tensor']}"
        for step in path["steps"]:
            if step["collective"] != "Slice":
                where = f"{path['consumer']} -> {path['producer']}"
                rows.append((step["seconds"], _sentence(links, step, what), where, "backward"))
    for sync in data["gradient_sync"]:
        if not sync["collective"]:
            continue
        sentence = _sentence(links, sync, f"the gradient of {sync['parameter']}")
        if sync.get("optimizer_shards"):
            sentence += ", then AllGather of the updated weights"
        rows.append((sync["seconds"], sentence, f"{sync['op']} (gradient sync)", "gradient sync"))
    rows.sort(key=lambda row: -row[0])
    return rows


def _sentence(links: list[dict[str, Any]], step: Mapping[str, Any], what: str) -> str:
    """The collective in words: AllReduce of the gradient of w over 8 devices (HCCS+PCIe), 1.05 MB."""
    return (
        f"{step['collective']} of {what} over {step['group_size']} devices"
        f" ({_levels(links, step['bits'])}), {human_bytes(step['bytes'])}"
    )


def _collectives(data: Mapping[str, Any]) -> str:
    rows = collective_rows(data)
    if not rows:
        return "<p>No collectives: nothing moves between devices.</p>"
    body = "".join(
        f"<tr><td>{_e(sentence)}</td><td>{_e(where)}</td><td>{_e(phase)}</td><td class='num'>{_ms(seconds)}</td></tr>"
        for seconds, sentence, where, phase in rows
    )
    slices = sum(
        1
        for entry in [*data["redistributions"], *data.get("gradients", [])]
        for s in entry["steps"]
        if s["collective"] == "Slice"
    )
    note = f" {slices} local Slice steps (no communication) are left out." if slices else ""
    return (
        f"<p>{len(rows)} collectives a step runs, costliest first: the forward redistributions, the backward"
        " collectives that take each gradient to its producer's layout, and each parameter's gradient sync"
        f" (hidden or not). Bytes are each rank's payload.{_e(note)}</p>"
        "<div class='scroll'><table><thead><tr><th>collective</th><th>where</th><th>phase</th><th>seconds</th></tr>"
        f"</thead><tbody>{body}</tbody></table></div>"
    )


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
    data: Mapping[str, Any],
    *,
    data_parallel: Mapping[str, Any] | None = None,
    stand_alone: Mapping[str, Any] | None = None,
    forward_s: float | None = None,
    recompute_s: float = 0.0,
    page: bool = True,
) -> str:
    """The report of plan file ``data``: a whole page (``page``), or a fragment for Jupyter.

    ``data_parallel`` and ``stand_alone`` are the plan files of those modes on the same problem (the
    "why" section and the stand-alone speed-up need them); ``forward_s`` and ``recompute_s`` split
    the step's compute for the timeline.
    """
    title = (
        f"autopar plan: {data['model']} on {data['devices']} devices ({data['cost_model']},"
        f" {data['precision']} precision, {data['mode']})"
    )
    names = {
        "summary": "Summary",
        "strategy-map": "Strategy map",
        "mesh": "Device mesh",
        "timeline": "One step",
        "memory": "Memory per device",
        "why": "Why not data parallel",
        "collectives": "Collectives",
    }
    bodies = {
        "summary": _summary(data, stand_alone),
        "strategy-map": _strategy_map(data),
        "mesh": _mesh(data),
        "timeline": _timeline(data, forward_s, recompute_s),
        "memory": _memory(data),
        "why": _why(data, data_parallel),
        "collectives": _collectives(data),
    }
    nav = "".join(f"<a href='#{key}'>{names[key]}</a>" for key in SECTIONS)
    sections = "".join(f"<section id='{key}'><h2>{names[key]}</h2>{bodies[key]}</section>" for key in SECTIONS)
    search = data["search"]
    fragment = (
        f"<div class='autopar-report'><h1>{_e(title)}</h1><nav>{nav}</nav>"
        f"<p class='note'>{len(data['ops'])} operators; searched by {_e(search['algorithm'])} over"
        f" {search['candidates']} candidates.</p>{sections}</div>"
    )
    if not page:
        return f"<style>{CSS}</style>{fragment}"
    return (
        f"<!doctype html>\n<html lang='en'><head><meta charset='utf-8'><title>{_e(title)}</title>"
        f"<style>{CSS}</style></head><body>{fragment}</body></html>\n"
    )


# --- from a Plan --------------------------------------------------------------------------------


def _sibling(plan: Plan, choice: Sequence[int], mode: str) -> Plan:
    """The plan of another choice on ``plan``'s own problem (same micro-batches, no other memory relief)."""
    search = dataclasses.replace(
        plan.search,
        choice=tuple(choice),
        method=mode,
        lagrange_multiplier=0.0,
        candidates_kept=None,
        candidates_dropped=None,
        choices=MemoryChoices(micro_batches=plan.search.choices.micro_batches),
    )
    return dataclasses.replace(plan, choice=tuple(choice), search=search, mode=mode, phases_s={})


def compute_split(plan: Plan) -> tuple[float, float]:
    """(forward seconds, recomputed forward seconds) of the step's compute.

    Each operator's compute is its forward times (1 + backward factor x backward passes), as the cost
    model charges it; micro-batches multiply both.
    """
    problem, choices = plan.problem, plan.search.choices
    factor = problem.cost.backward_factor
    forward = sum(
        float(problem.node_compute[i][c]) / (1.0 + factor * backward_passes(problem, i))
        for i, c in enumerate(plan.choice)
    )
    recompute = (
        sum(float(problem.recompute_time[i][c]) for i, c in enumerate(plan.choice) if i in problem.recompute_time)
        if choices.recompute
        else 0.0
    )
    return forward * choices.micro_batches, recompute * choices.micro_batches


def plan_report(plan: Plan, *, page: bool = True, compare: bool = True) -> str:
    """The report of a `Plan`, with data parallel and stand-alone worked out on its own problem."""
    data = plan.to_dict()
    data_parallel = stand_alone = None
    if compare:
        problem = plan.problem
        dp_choice = data_parallel_choice(problem)
        data_parallel = data if list(plan.choice) == dp_choice else _sibling(plan, dp_choice, "data_parallel").to_dict()
        stand_alone = _sibling(plan, stand_alone_choice(problem), "stand_alone").to_dict()
    forward, recompute = compute_split(plan)
    return report_html(
        data,
        data_parallel=data_parallel,
        stand_alone=stand_alone,
        forward_s=forward,
        recompute_s=recompute,
        page=page,
    )


def plan_html(plan: Plan, compare: bool = True) -> str:
    """A `Plan`'s Jupyter display: the report as an HTML fragment (scoped styles, no script)."""
    return plan_report(plan, page=False, compare=compare)
