"""The report's sections in words and tables: summary cards, the strategy map, why not data parallel, collectives."""

from __future__ import annotations

from collections.abc import Mapping

from autopar.lowering import PlanFile
from autopar.report.charts import factor_colour
from autopar.report.figures import (
    AXES,
    AXIS_TITLES,
    axis_splits,
    collective_rows,
    expert_bits,
    fold_groups,
    incoming_seconds,
    is_image_model,
    samples_per_step,
    stand_alone_fits,
    summary_figures,
    warnings_of,
)
from autopar.report.format import escape, memory_against_usable, ms, strategy_text
from autopar.units import human_bytes


def _card(key: str, label: str, value: float | None, shown: str, note: str) -> str:
    exact = "" if value is None else f" data-value='{value!r}'"
    return (
        f"<div class='card' data-key='{key}'{exact}><div class='label'>{escape(label)}</div>"
        f"<div class='value'>{escape(shown)}</div><div class='note'>{escape(note)}</div></div>"
    )


def _stand_alone_detail(stand_alone: PlanFile | None) -> str:
    """What the stand-alone card compares with, or why it compares with nothing."""
    if stand_alone is None:
        return "needs the plan on its problem (a plan file alone cannot say)"
    totals = stand_alone.totals
    if not stand_alone_fits(stand_alone):
        need, usable = human_bytes(totals.memory_per_device_bytes), human_bytes(totals.memory_usable_bytes)
        return f"the model does not fit one device: every operator whole needs {need} of {usable}"
    return f"stand-alone {ms(totals.step_time_s)} (every operator whole on every device)"


def summary_section(data: PlanFile, stand_alone: PlanFile | None) -> str:
    """The cards (step, throughput, MFU, memory, speed-ups) and the warnings."""
    figures = summary_figures(data, stand_alone)
    totals = data.totals
    samples = samples_per_step(data)
    step = totals.step_time_s
    throughput = figures["samples_per_s"]
    mfu = figures["mfu"]
    used, capacity = totals.memory_per_device_bytes, totals.memory_usable_bytes
    vs_alone = figures["speedup_vs_stand_alone"]
    cards = [
        _card(
            "step_time_s",
            "predicted step time",
            step,
            ms(step),
            f"compute {ms(totals.compute_s)}, exposed communication {ms(totals.communication_s)}",
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
            f"ideal step {ms(totals.ideal_step_time_s)} (training FLOPs / devices x peak)",
        ),
        _card(
            "memory_per_device_bytes",
            "memory per device",
            used,
            human_bytes(used),
            memory_against_usable(totals, with_used=False) if capacity else "capacity unknown",
        ),
        _card(
            "speedup_vs_data_parallel",
            "speed-up vs data parallel",
            totals.speedup_vs_data_parallel,
            f"{totals.speedup_vs_data_parallel:.3f}",
            f"data parallel {ms(totals.data_parallel_step_time_s)}"
            + (" (pure: nothing fixed)" if totals.free_step_time_s is not None else ""),
        ),
        _card(
            "speedup_vs_stand_alone",
            "speed-up vs stand-alone",
            vs_alone,
            f"{vs_alone:.2f}" if vs_alone is not None else "none",
            _stand_alone_detail(stand_alone),
        ),
    ]
    if totals.fixed_cost_s is not None and totals.free_step_time_s is not None:
        fixed = sum(1 for op in data.ops if op.fixed)
        cards.append(
            _card(
                "fixed_cost_s",
                "cost of the fixed strategies",
                totals.fixed_cost_s,
                ms(max(0.0, totals.fixed_cost_s)),
                f"{fixed} operator{'s' if fixed != 1 else ''} fixed; with nothing fixed the search finds"
                f" {ms(totals.free_step_time_s)}",
            )
        )
    found = warnings_of(data)
    warned = (
        "<ul class='warnings'>" + "".join(f"<li>{escape(w)}</li>" for w in found) + "</ul>"
        if found
        else "<p class='ok'>No warnings: every device does distinct work and every operator has a strategy rule.</p>"
    )
    return f"<div class='cards'>{''.join(cards)}</div><h3>Warnings</h3>{warned}"


def strategy_map_section(data: PlanFile) -> str:
    """One row per operator (repeated blocks folded), one column per axis kind, coloured by split factor."""
    ops = data.ops
    devices, mesh = data.devices, data.mesh
    image = is_image_model(data)
    experts = expert_bits(data)
    groups = fold_groups(data)
    rows = []
    for group in groups:
        op = ops[group[0]]
        splits, used = axis_splits(op, image, experts.get(op.name, ()))
        strategy = strategy_text(op.strategy)
        names = [ops[i].name for i in group]
        title = f"in_strategy {strategy}" + (
            f"; also {len(names) - 1} copies: {', '.join(names[1:])}" if len(names) > 1 else ""
        )
        cells = []
        for axis in AXES:
            factor = splits.get(axis, 1)
            background, colour = factor_colour(factor, mesh)
            cells.append(
                f"<td class='f' style='background:{background};color:{colour}'"
                f" title='{escape(axis)}: split {factor} ways; in_strategy {escape(strategy)}'>"
                f"{'x' + str(factor) if factor > 1 else '1'}</td>"
            )
        repeated = devices // used
        flags = (" fallback" if op.fallback else "") + (" fixed" if op.fixed else "")
        rows.append(
            f"<tr data-op='{escape(op.name)}' data-count='{len(group)}' title='{escape(title)}'>"
            f"<td class='name'>{escape(op.name)}{escape(flags)}</td><td>{escape(op.op_type)}</td>"
            f"<td class='num'>{len(group) if len(group) > 1 else ''}</td>{''.join(cells)}"
            f"<td class='num'>{repeated if repeated > 1 else '-'}</td>"
            f"<td><code>{escape(strategy)}</code></td></tr>"
        )
    swatches = [(f, *factor_colour(f, mesh)) for f in (1 << b for b in range(mesh.mesh_bits + 1))]
    legend = "".join(
        f"<span class='swatch' style='background:{background};color:{colour}'>x{f}</span>"
        for f, background, colour in swatches
    )
    heads = "".join(f"<th title='{escape(AXIS_TITLES[a])}'>{escape(a)}</th>" for a in AXES)
    folded = sum(len(g) - 1 for g in groups)
    note = (
        f" {folded} operators of repeated blocks are folded into their first copy's row (the copies column)."
        if folded
        else ""
    )
    return (
        f"<p>Split factor per axis kind; colour: {legend}. Hover a row for the exact in_strategy.{escape(note)}"
        " Columns come from the layouts: a mesh bit counts for the axis of the output dimension it splits"
        " (position in a tensor of that rank), or for contraction when the output is partial over it."
        " <i>repeated</i>: devices that compute the same shard.</p>"
        "<div class='scroll'><table class='map'><thead><tr><th>operator</th><th>type</th><th>copies</th>"
        f"{heads}<th>repeated</th><th>in_strategy</th></tr></thead><tbody>{''.join(rows)}</tbody></table></div>"
    )


def _splits_in_words(splits: Mapping[str, int]) -> str:
    words = [f"{axis} x{splits[axis]}" for axis in AXES if splits.get(axis, 1) > 1]
    return ", ".join(words) if words else "nothing (replicated)"


def block_rows(data: PlanFile) -> dict[int, tuple[str, int]]:
    """Operator index -> (first operator, copies) of the repeated block whose first copy holds it: the
    plan's own ``search.repeated_blocks``, the blocks the terminal folds too."""
    index = {op.name: i for i, op in enumerate(data.ops)}
    found: dict[int, tuple[str, int]] = {}
    for block in data.search.repeated_blocks:
        start = index.get(block.first_op)
        if start is not None:
            for i in range(start, min(start + block.operators, len(data.ops))):
                found[i] = (block.first_op, block.copies)
    return found


def _verdict(delta: float) -> str:
    if delta > 1e-12:
        return f"{ms(delta)} faster here"
    if delta < -1e-12:
        return f"{ms(-delta)} slower here (repaid by its neighbours: fewer redistributions or gradient sync elsewhere)"
    return "even"


def why_section(data: PlanFile, data_parallel: PlanFile | None) -> str:
    """The operators off data parallel, grouped by repeated block and decision (how they split against how
    data parallel splits), each group's costs beside data parallel's (needs that plan); each operator's
    own figures folded under its group."""
    ops = data.ops
    image = is_image_model(data)
    if data_parallel is None:
        return (
            "<p>The comparison needs the data-parallel plan of the same problem (the report of a `Plan`, or"
            " <code>autopar report</code>, works it out).</p>"
        )
    reference = {op.name: op for op in data_parallel.ops}
    experts, their_experts = expert_bits(data), expert_bits(data_parallel)
    mine, theirs = incoming_seconds(data), incoming_seconds(data_parallel)
    blocks = block_rows(data)
    grouped: dict[tuple[str, int, str, str], list[tuple[str, str, float, float, str]]] = {}
    differ = 0
    for group in fold_groups(data):
        op = ops[group[0]]
        other = reference.get(op.name)
        if op.domain or other is None or other.strategy == op.strategy:  # a fork is no decision of the model's
            continue
        differ += len(group)
        cost, base = op.cost, other.cost
        here = cost.compute_s + cost.communication_s + (cost.update_s or 0.0) + mine.get(op.name, 0.0)
        there = base.compute_s + base.communication_s + (base.update_s or 0.0) + theirs.get(op.name, 0.0)
        first, copies = blocks.get(group[0], ("", 1))
        key = (
            first,
            copies,
            _splits_in_words(axis_splits(op, image, experts.get(op.name, ()))[0]),
            _splits_in_words(axis_splits(other, image, their_experts.get(other.name, ()))[0]),
        )
        detail = (
            f"compute {ms(cost.compute_s)} ({ms(base.compute_s)}), own communication {ms(cost.communication_s)}"
            f" ({ms(base.communication_s)}), redistribution into it {ms(mine.get(op.name, 0.0))}"
            f" ({ms(theirs.get(op.name, 0.0))})"
        )
        grouped.setdefault(key, []).append((op.name, op.op_type, here, there, detail))
    if not grouped:
        return "<p>Every operator takes the data-parallel strategy: the batch split over all devices.</p>"
    rows = []
    for (first, copies, splits, reference_splits), members in grouped.items():
        where = f"each of {copies} copies of the block from {first}" if first else "outside repeated blocks"
        here, there = sum(m[2] for m in members), sum(m[3] for m in members)
        names = ", ".join(m[0] for m in members[:4]) + (f", ... ({len(members)} in all)" if len(members) > 4 else "")
        details = "".join(
            f"<li><code>{escape(name)}</code> ({escape(op_type)}): {escape(detail)}: {escape(_verdict(th - hr))}</li>"
            for name, op_type, hr, th, detail in members
        )
        rows.append(
            f"<tr data-group='{escape(first)}|{escape(splits)}' data-count='{len(members)}'>"
            f"<td>{escape(where)}</td><td>{escape(splits)}<br><span class='note'>data parallel:"
            f" {escape(reference_splits)}</span></td><td class='num'>{ms(here)}</td><td class='num'>{ms(there)}</td>"
            f"<td>{escape(_verdict(there - here))}</td><td><details><summary>{len(members)} operator"
            f"{'s' if len(members) != 1 else ''}: {escape(names)}</summary><ul>{details}</ul></details></td></tr>"
        )
    return (
        f"<p>{differ} of {sum(not op.domain for op in ops)} operators leave data parallel (the batch split over"
        " all devices), in"
        f" {len(rows)} group{'s' if len(rows) != 1 else ''}: one per repeated block and decision (how the"
        " operators split, against how data parallel splits them). Seconds are a step's compute, own"
        " communication (the gradient sync before any overlap) and redistribution into the operators,"
        " forward and the gradients' way back, summed over the group (one copy of a"
        " block). Open a group for each operator.</p>"
        "<table><thead><tr><th>where</th><th>splits</th><th class='num'>here</th>"
        "<th class='num'>data parallel</th><th>verdict</th><th>operators</th></tr></thead>"
        f"<tbody>{''.join(rows)}</tbody></table>"
    )


def collectives_section(data: PlanFile) -> str:
    """Every collective the step runs, in words, costliest first (local Slice steps counted, not listed)."""
    rows = collective_rows(data)
    if not rows:
        return "<p>No collectives: nothing moves between devices.</p>"
    body = "".join(
        f"<tr><td>{escape(sentence)}</td><td>{escape(where)}</td><td>{escape(phase)}</td>"
        f"<td class='num'>{ms(seconds)}</td></tr>"
        for seconds, sentence, where, phase in rows
    )
    steps = [*(s for red in data.redistributions for s in red.steps), *(s for g in data.gradients for s in g.steps)]
    slices = sum(1 for s in steps if s.collective == "Slice")
    note = f" {slices} local Slice steps (no communication) are left out." if slices else ""
    return (
        f"<p>{len(rows)} collectives a step runs, costliest first: the forward redistributions, the backward"
        " collectives that take each gradient to its producer's layout, and each parameter's gradient sync"
        f" (hidden or not). Bytes are each rank's payload.{escape(note)}</p>"
        "<div class='scroll'><table><thead><tr><th>collective</th><th>where</th><th>phase</th><th>seconds</th></tr>"
        f"</thead><tbody>{body}</tbody></table></div>"
    )
