"""Plain-text views for the CLI: the plan table and the model summary (deterministic, fixed width)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

from autopar.cost.mesh import Mesh
from autopar.graph import Graph
from autopar.lowering import GRAPH_OUTPUT, SCHEMA, Plan
from autopar.lowering.planfile import CollectiveStep, OpEntry, PlanFile, SearchSummary, Totals
from autopar.report.figures import fold_groups, incoming_seconds, samples_per_step, summary_figures
from autopar.report.format import figure_ms, link_levels, memory_against_usable, strategy_text
from autopar.spmd import VerifyReport
from autopar.units import human_bytes


def _step_text(step: CollectiveStep, mesh: Mesh) -> str:
    """A collective in plain words: "AllGather over 8 devices (HCCS+PCIe), 786.43 KB"."""
    return (
        f"{step.collective} over {step.group_size} devices ({link_levels(mesh, step.bits)}), {human_bytes(step.bytes)}"
    )


def _fixed_cost_lines(data: PlanFile) -> list[str]:
    """With fixed strategies: what they cost, against the plan the search finds with nothing fixed."""
    totals = data.totals
    fixed = sum(1 for op in data.ops if op.fixed)
    if not fixed:
        return []
    named = f"{fixed} operator{'s' if fixed != 1 else ''}"
    if totals.fixed_cost_s is None or totals.free_step_time_s is None:
        return [f"fixed:            {named}; with nothing fixed no plan fits, so their cost is not known"]
    free = figure_ms(totals.free_step_time_s)
    if totals.fixed_cost_s <= 0:
        return [f"fixed:            {named}, at no cost (the search with nothing fixed finds {free} ms)"]
    return [
        f"fixed:            {named} cost {figure_ms(totals.fixed_cost_s)} ms a step"
        f" (this plan minus the {free} ms the search finds with nothing fixed)"
    ]


def splits_text(splits: Mapping[str, int]) -> str:
    """An operator's split factors per axis kind as a product ("batch 4 x contraction 2"): in the table,
    "x" always multiplies split factors (a speed-up is written as a plain ratio, copies as a count)."""
    parts = [f"{kind} {factor}" for kind, factor in splits.items() if factor > 1]
    return " x ".join(parts) if parts else "replicated"


def _pipeline_lines(data: PlanFile) -> list[str]:
    """The pipeline's line: stages, micro-batches, the bubble, and where each stage starts."""
    pipe = data.pipeline
    if pipe is None:
        return []
    totals = data.totals
    bubble = f", bubble {pipe.bubble_fraction:.1%}" + (
        f" ({figure_ms(totals.pipeline_bubble_s)} ms)" if totals.pipeline_bubble_s is not None else ""
    )
    starts = ", ".join(f"{stage.first_op} ({stage.operators} ops)" for stage in pipe.stages)
    return [
        f"pipeline:         {len(pipe.stages)} stages x {pipe.micro_batches} micro-batches ({pipe.schedule}{bubble});"
        f" stages start at {starts}"
    ]


def _fused_attention(data: PlanFile) -> list[str]:
    """The line for the attentions a fused kernel runs (none where there are none)."""
    kernels = sum(1 for op in data.ops if op.fused in ("values", "kernel"))
    if not kernels:
        return []
    computed = sum(op.cost.compute_s for op in data.ops if op.fused)
    return [
        f"attention:        {kernels} attention{'s' if kernels > 1 else ''} run as a fused kernel"
        f" ({figure_ms(computed)} ms compute; no s x s scores kept)"
    ]


def _not_at_once(totals: Totals) -> str:
    """Where the kinds add up to more than the peak (one device: the gradients are made in the backward, as it
    frees activations), the sentence that says so."""
    held = sum(totals.memory_breakdown.values())
    if held <= totals.memory_per_device_bytes:
        return ""
    return (
        f"; {human_bytes(held - totals.memory_per_device_bytes)} of it never at once: one process makes its"
        " gradients in the backward, as it frees activations"
    )


def _plan_summary(plan: Plan) -> list[str]:
    """The summary lines: what was decided (degrees, batch), what it costs, what it moves."""
    data = plan.file
    mesh = plan.mesh
    totals = data.totals
    figures = summary_figures(data)
    samples = samples_per_step(data)
    breakdown = ", ".join(f"{key.replace('_', ' ')} {human_bytes(v)}" for key, v in totals.memory_breakdown.items())
    levels = ", ".join(
        f"{level.name} {len(level.bits)} bit{'s' if len(level.bits) > 1 else ''}" for level in mesh.levels
    )
    micro = data.memory_plan.micro_batches
    if samples is None:
        batch = "unknown (the data inputs share no leading size)"
    else:
        batch = f"{samples:,} samples a step" + (
            f" ({micro} micro-batches of {samples // micro:,})" if micro > 1 else ""
        )
    throughput, mfu = figures["samples_per_s"], figures["mfu"]
    lines = [
        f"degrees:          {plan.degrees} ({data.devices:,} device{'s' if data.devices != 1 else ''})",
        *_pipeline_lines(data),
        f"global batch:     {batch}",
        f"step time:        {figure_ms(totals.step_time_s)} ms predicted"
        f"  (compute {figure_ms(totals.compute_s)} ms, communication {figure_ms(totals.communication_s)} ms exposed"
        + (f", optimizer update {figure_ms(totals.optimizer_update_s)} ms)" if totals.optimizer_update_s else ")"),
        f"throughput:       {throughput:,.1f} samples/s" if throughput is not None else "throughput:       unknown",
        f"MFU:              {mfu:.1%}" if mfu is not None else "MFU:              unknown",
        f"vs data parallel: {figure_ms(totals.data_parallel_step_time_s)} ms"
        f"  -> speed-up {totals.speedup_vs_data_parallel:.3f}"
        + ("  (pure data parallel: nothing fixed)" if totals.fixed_cost_s is not None else ""),
        *_fixed_cost_lines(data),
        f"ideal step time:  {figure_ms(totals.ideal_step_time_s)} ms (training FLOPs / (devices times peak))",
        f"memory/device:    {memory_against_usable(totals)}",
        f"memory by kind:   {breakdown}"
        + (f" (optimizer: {data.optimizer})" if data.optimizer else "")
        + _not_at_once(totals),
        f"mesh:             {mesh.num_devices} device{'s' if mesh.num_devices > 1 else ''}"
        + (f" over {levels}" if levels else ""),
    ]
    lines += _collective_lines(data)
    synced = [g for g in data.gradient_sync if g.collective]
    lines.append(
        f"gradient sync:    {len(synced)} of {len(data.gradient_sync)} parameters synchronised,"
        f" {human_bytes(sum(g.bytes for g in synced))}, {figure_ms(totals.gradient_sync_s)} ms"
        f" ({figure_ms(totals.hidden_communication_s)} ms hidden behind the backward)"
    )
    if totals.optimizer_update_s:
        sharded = sum(1 for g in data.gradient_sync if g.optimizer_shards)
        lines.append(
            f"optimizer update: {figure_ms(totals.optimizer_update_s)} ms a step ({data.optimizer or 'the profile'}'s"
            f" {len(data.gradient_sync)} parameters"
            + (f", {sharded} of them each rank its shard" if sharded else "")
            + ", at the memory bandwidth)"
        )
    lines += _fused_attention(data)
    memory_plan = data.memory_plan
    relief = []
    if memory_plan.parallel_optimizer:
        relief.append(f"parallel optimizer on {len(memory_plan.parallel_optimizer)} parameters")
    if memory_plan.recompute:
        relief.append(f"recompute the repeated blocks from {', '.join(memory_plan.recompute)}")
    if memory_plan.micro_batches > 1 and data.pipeline is None:
        relief.append(f"{memory_plan.micro_batches} micro-batches (gradient accumulation)")
    if relief:
        lines.append(f"memory plan:      {'; '.join(relief)}")
    if data.fallback_ops:
        lines.append(f"fallback ops:     {len(data.fallback_ops)} kept replicated: {', '.join(data.fallback_ops)}")
    lines.append(
        f"search:           {data.search.algorithm} over {data.search.candidates} candidates"
        f" of {data.search.operators} operators{_proof(data.search)}"
    )
    return lines


def _collective_lines(data: PlanFile) -> list[str]:
    """The summary's lines on the forward redistributions (and what of them runs under attention kernels)
    and on the gradients' ways back."""
    kinds = Counter(str(s.collective) for red in data.redistributions for s in red.steps)
    red_seconds = sum(red.seconds for red in data.redistributions)
    under = sum(red.hidden_s or 0.0 for red in data.redistributions)
    lines = [
        f"redistributions:  {len(data.redistributions)} tensors, "
        + (", ".join(f"{n} {k}" for k, n in sorted(kinds.items())) or "none")
        + f"; {figure_ms(red_seconds)} ms forward"
        + (f"; {figure_ms(under)} ms of them and their gradients' ways back under attention kernels" if under else "")
    ]
    paths = data.gradients
    if paths:
        backward_kinds = Counter(str(s.collective) for path in paths for s in path.steps)
        lines.append(
            f"backward:         {len(paths)} gradients need collectives to reach their producers: "
            + ", ".join(f"{n} {k}" for k, n in sorted(backward_kinds.items()))
            + f"; {figure_ms(sum(path.seconds for path in paths))} ms"
        )
    return lines


def _proof(search: SearchSummary) -> str:
    """What the search proved: exact, or how far the plan can be from the fastest and why."""
    if search.exact is None:
        return ""
    if search.exact:
        return ", exact"
    why = []
    if search.steps_split:
        why.append(f"{search.steps_split} elimination steps split to stay within the table limits")
    if search.runs_relaxed:
        runs = f"{search.runs_relaxed} repeated run{'s' if search.runs_relaxed > 1 else ''}"
        why.append(f"{runs} bounded with each copy reading the operators the copies share in its own best layout")
    if search.memory_multiplier or not why:
        why.append("memory binds: the plan is the best its memory walk reached")
    because = f" ({'; '.join(why)})"
    if search.gap is None or search.lower_bound_s is None:
        return f", not proved the fastest{because}"
    gap = f"{100 * search.gap:.2f} %" if search.gap >= 1e-4 else "0.01 %"  # the bound keeps the tie-break's slack
    bound = f"{1e3 * search.lower_bound_s:.3f} ms"
    return f", within {gap} of the fastest plan that fits: none is faster than {bound}{because}"


def _columns(rows: list[list[str]], header: list[str], right: set[int]) -> list[str]:
    """Rows as fixed-width columns (``right``: the columns aligned right; the last column is never padded)."""
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows)]

    def line(cells: list[str]) -> str:
        padded = [
            cell if k == len(cells) - 1 else (f"{cell:>{widths[k]}}" if k in right else f"{cell:<{widths[k]}}")
            for k, cell in enumerate(cells)
        ]
        return "  ".join(padded).rstrip()

    top = line(header)
    return [top, "-" * len(top), *(line(row) for row in rows)]


def _shown_name(op: OpEntry, copies: int = 1) -> str:
    """An operator's name (the framework's layer name beside it, where the exporter kept it), and how many
    copies of a repeated block its row stands for."""
    name = f"{op.name} [{op.source}]" if op.source else op.name
    name = name if len(name) <= 48 else name[:47] + "~"
    return name + (f" ({copies} copies)" if copies > 1 else "")


def _decision_lines(plan: Plan, incoming: Mapping[str, list[str]]) -> list[str]:
    """The operators whose strategy is not plain data parallel, one row per repeated-block position."""
    data = plan.file
    off = {entry["name"]: entry for entry in plan.decisions()}
    ops = data.ops
    model_ops = sum(not op.domain for op in ops)  # the model's operators: forks are autopar's
    rows = []
    for group in fold_groups(data):
        op = ops[group[0]]
        if op.name not in off:
            continue
        entry = off[op.name]
        rows.append(
            [
                _shown_name(op, len(group)) + (" (fixed)" if op.fixed else ""),
                op.op_type,
                strategy_text(op.strategy),
                splits_text(entry["splits"]),
                figure_ms(op.cost.compute_s),
                figure_ms(op.cost.communication_s),
                "; ".join(incoming.get(op.name, [])) or "-",
            ]
        )
    if not rows:
        splits = any(size > 1 for op in ops for given in op.strategy for size in given)
        said = "is plain data parallel (splits the batch alone)" if splits else "runs whole on every device"
        return ["", f"decisions: every one of the {model_ops} operators {said}"]
    header = ["operator", "type", "strategy", "splits", "compute ms", "comm ms", "collectives before this op"]
    count = len(off)
    return [
        "",
        f"decisions: {count} of {model_ops} operator{'s' if model_ops != 1 else ''} leave data parallel"
        f" (split more than the batch), {len(rows)} row{'s' if len(rows) != 1 else ''}"
        " with repeated blocks folded:",
        *_columns(rows, header, right={4, 5}),
    ]


def _redistribution_lines(data: PlanFile, mesh: Mesh, top: int | None) -> list[str]:
    """Every redistributed tensor, costliest first (``top``: the first ``top``); its seconds are the
    forward collectives' and its gradient's way back."""
    if not data.redistributions:
        return ["", "redistributed tensors: none (every consumer reads its producer's layout)"]
    back: dict[tuple[str, str, str], float] = {}  # the gradient's way back (a version-2 file's seconds hold it)
    for path in data.gradients if data.schema_ == SCHEMA else ():
        key = (path.tensor, path.producer, path.consumer)
        back[key] = back.get(key, 0.0) + path.seconds
    seconds = [red.seconds + back.get(red.key, 0.0) for red in data.redistributions]
    ranked = sorted(enumerate(data.redistributions), key=lambda item: (-seconds[item[0]], item[0]))
    shown = ranked if top is None else ranked[:top]
    rows = []
    for index, red in shown:
        consumer = "graph output" if red.consumer == GRAPH_OUTPUT else red.consumer
        steps = [_step_text(step, mesh) if step.collective != "Slice" else "local Slice" for step in red.steps]
        rows.append([red.tensor, f"{red.producer} -> {consumer}", figure_ms(seconds[index]), "; ".join(steps)])
    total = len(data.redistributions)
    more = f", the {len(shown)} costliest (--all for every one)" if len(shown) < total else ", costliest first"
    return [
        "",
        f"redistributed tensors: {total}{more}:",
        *_columns(rows, ["tensor", "producer -> consumer", "fwd+bwd ms", "collectives"], right={2}),
    ]


def plan_table(plan: Plan, top: int | None = 10) -> str:
    """What ``autopar plan`` prints: the summary, the decisions (operators off data parallel, repeated blocks
    folded), the redistributed tensors, then the ``top`` costliest operators, costliest first (None: every
    operator, in graph order)."""
    data = plan.file
    mesh = plan.mesh
    devices = f"{data.devices} device" + ("s" if data.devices != 1 else "")
    lines = [
        f"autopar plan: {data.model} on {devices} ({data.cost_model}, {data.precision} precision, {data.mode})",
        "",
        *_plan_summary(plan),
    ]
    incoming: dict[str, list[str]] = {}
    for red in data.redistributions:
        target = red.consumer if red.consumer != GRAPH_OUTPUT else red.producer
        incoming.setdefault(target, []).extend(_step_text(s, mesh) for s in red.steps if s.collective != "Slice")
    lines += _decision_lines(plan, incoming)
    lines += _redistribution_lines(data, mesh, top)
    ops = data.ops
    moved = incoming_seconds(data)

    def real_cost(op: OpEntry) -> float:
        return op.cost.compute_s + op.cost.communication_s + (op.cost.update_s or 0.0) + moved.get(op.name, 0.0)

    if top is None:
        rows_of = [[i] for i in range(len(ops))]
        title = f"all {len(ops)} operators, in graph order"
    else:
        groups = fold_groups(data)
        ranked = sorted(groups, key=lambda group: (-real_cost(ops[group[0]]), group[0]))
        rows_of = ranked[:top]
        folded = " (repeated blocks folded)" if any(len(group) > 1 for group in rows_of) else ""
        title = (
            f"the {len(rows_of)} costliest of {len(ops)} operators{folded}, costliest first"
            " (--all for every one, --top N for more)"
        )
    rows = []
    for group in rows_of:
        op = ops[group[0]]
        rows.append(
            [
                _shown_name(op, len(group)),
                op.op_type,
                strategy_text(op.strategy),
                figure_ms(op.cost.compute_s),
                figure_ms(op.cost.communication_s),
                figure_ms(op.cost.update_s or 0.0),
                figure_ms(moved.get(op.name, 0.0)),
                figure_ms(real_cost(op)),
                "; ".join(incoming.get(op.name, [])) or "-",
            ]
        )
    header = ["operator", "type", "strategy", "compute ms", "comm ms", "update ms", "redist ms", "total ms"]
    header.append("collectives before")
    lines += ["", f"{title}:", *_columns(rows, header, right={3, 4, 5, 6, 7})]
    return "\n".join(lines) + "\n"


def inspect_summary(graph: Graph) -> dict[str, Any]:
    by_type: dict[str, dict[str, float]] = {}
    for op in graph.ops:
        entry = by_type.setdefault(op.op_type, {"count": 0, "flops": 0.0})
        entry["count"] += 1
        entry["flops"] += op.flops
    params = graph.parameters
    return {
        "model": graph.name,
        "operators": len(graph.ops),
        "ops_by_type": dict(sorted(by_type.items(), key=lambda item: (-item[1]["flops"], item[0]))),
        "inputs": {name: list(graph.tensor(name).shape) for name in graph.inputs},
        "outputs": {name: list(graph.tensor(name).shape) for name in graph.outputs if name in graph.tensors},
        "parameters": {
            "tensors": len(params),
            "elements": sum(p.numel for p in params),
            "trainable_elements": sum(p.numel for p in params if p.trainable),
        },
        "forward_flops": graph.total_flops,
    }


def inspect_table(summary: dict[str, Any]) -> str:
    lines = [
        f"model {summary['model']}: {summary['operators']} operators,"
        f" {summary['forward_flops'] / 1e9:.2f} GFLOPs forward",
        "",
    ]
    for name, shape in summary["inputs"].items():
        lines.append(f"input   {name}: {shape}")
    for name, shape in summary["outputs"].items():
        lines.append(f"output  {name}: {shape}")
    params = summary["parameters"]
    lines += [
        "",
        f"parameters: {params['tensors']} tensors, {params['elements']:,} elements"
        f" ({params['trainable_elements']:,} trainable)",
        "",
        f"{'op type':<24}{'count':>7}{'GFLOPs':>12}{'share':>8}",
    ]
    total = summary["forward_flops"] or 1.0
    for op_type, entry in summary["ops_by_type"].items():
        share = 100 * entry["flops"] / total
        lines.append(f"{op_type:<24}{entry['count']:>7}{entry['flops'] / 1e9:>12.3f}{share:>7.1f}%")
    return "\n".join(lines) + "\n"


def verify_table(report: VerifyReport) -> str:
    """What ``autopar verify`` prints (`VerifyReport.table`)."""
    return report.table()
