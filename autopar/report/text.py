"""Plain-text views for the CLI: the plan table and the model summary (deterministic, fixed width)."""

from __future__ import annotations

from collections import Counter
from typing import Any

from autopar.cost.mesh import Mesh
from autopar.graph import Graph
from autopar.lowering import GRAPH_OUTPUT, Plan
from autopar.lowering.planfile import CollectiveStep, PlanFile
from autopar.report.format import figure_ms, link_levels, memory_against_usable, strategy_text
from autopar.spmd import VerifyReport
from autopar.spmd.compare import PHASES
from autopar.units import human_bytes


def _error(value: float | bool | None) -> str:
    return "not finite" if value is None else f"{value:.3g}"


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


def plan_table(plan: Plan, top: int | None = 20) -> str:
    """The summary first, then the ``top`` operators by cost (None: every operator, in graph order)."""
    data = plan.file
    mesh = plan.mesh
    devices = f"{data.devices} device" + ("s" if data.devices != 1 else "")
    lines = [
        f"autopar plan: {data.model} on {devices} ({data.cost_model}, {data.precision} precision, {data.mode})",
        "",
    ]
    totals = data.totals
    breakdown = ", ".join(f"{key.replace('_', ' ')} {human_bytes(v)}" for key, v in totals.memory_breakdown.items())
    levels = ", ".join(
        f"{level.name} {len(level.bits)} bit{'s' if len(level.bits) > 1 else ''}" for level in mesh.levels
    )
    lines += [
        f"step time:        {figure_ms(totals.step_time_s)} ms predicted"
        f"  (compute {figure_ms(totals.compute_s)} ms, communication {figure_ms(totals.communication_s)} ms exposed)",
        f"vs data parallel: {figure_ms(totals.data_parallel_step_time_s)} ms"
        f"  -> this plan is x{totals.speedup_vs_data_parallel:.3f}"
        + ("  (pure data parallel: nothing fixed)" if totals.fixed_cost_s is not None else ""),
        *_fixed_cost_lines(data),
        f"ideal step time:  {figure_ms(totals.ideal_step_time_s)} ms (training FLOPs / (devices x peak))",
        f"memory/device:    {memory_against_usable(totals)}",
        f"memory by kind:   {breakdown}" + (f" (optimizer: {data.optimizer})" if data.optimizer else ""),
        f"mesh:             {mesh.num_devices} devices" + (f" over {levels}" if levels else ""),
    ]
    kinds = Counter(str(s.collective) for red in data.redistributions for s in red.steps)
    red_seconds = sum(red.seconds for red in data.redistributions)
    lines.append(
        f"redistributions:  {len(data.redistributions)} tensors, "
        + (", ".join(f"{n} {k}" for k, n in sorted(kinds.items())) or "none")
        + f"; {figure_ms(red_seconds)} ms forward+backward"
    )
    paths = data.gradients
    if paths:
        backward_kinds = Counter(str(s.collective) for path in paths for s in path.steps)
        lines.append(
            f"backward:         {len(paths)} gradients need collectives to reach their producers: "
            + ", ".join(f"{n} {k}" for k, n in sorted(backward_kinds.items()))
            + f"; {figure_ms(sum(path.seconds for path in paths))} ms"
        )
    synced = [g for g in data.gradient_sync if g.collective]
    lines.append(
        f"gradient sync:    {len(synced)} of {len(data.gradient_sync)} parameters synchronised,"
        f" {human_bytes(sum(g.bytes for g in synced))}, {figure_ms(totals.gradient_sync_s)} ms"
        f" ({figure_ms(totals.hidden_communication_s)} ms hidden behind the backward)"
    )
    memory_plan = data.memory_plan
    relief = []
    if memory_plan.parallel_optimizer:
        relief.append(f"parallel optimizer on {len(memory_plan.parallel_optimizer)} parameters")
    if memory_plan.recompute:
        relief.append(f"recompute the repeated blocks from {', '.join(memory_plan.recompute)}")
    if memory_plan.micro_batches > 1:
        relief.append(f"{memory_plan.micro_batches} micro-batches (gradient accumulation)")
    if relief:
        lines.append(f"memory plan:      {'; '.join(relief)}")
    if data.fallback_ops:
        lines.append(f"fallback ops:     {len(data.fallback_ops)} kept replicated: {', '.join(data.fallback_ops)}")
    lines.append(
        f"search:           {data.search.algorithm} over {data.search.candidates} candidates"
        f" of {data.search.operators} operators"
    )

    incoming: dict[str, list[str]] = {}
    for red in data.redistributions:
        target = red.consumer if red.consumer != GRAPH_OUTPUT else red.producer
        incoming.setdefault(target, []).extend(_step_text(s, mesh) for s in red.steps if s.collective != "Slice")
    ops = list(data.ops)
    if top is not None and top < len(ops):
        ranked = sorted(range(len(ops)), key=lambda i: -(ops[i].cost.compute_s + ops[i].cost.communication_s))
        keep = sorted(ranked[:top])  # the costliest, in graph order
        title = f"the {top} costliest of {len(ops)} operators (--all for every one, --top N for more)"
        ops = [ops[i] for i in keep]
    else:
        title = f"all {len(ops)} operators"
    # the framework's own layer names, where the exporter kept them
    shown = [f"{op.name} [{op.source}]" if op.source else op.name for op in ops]
    name_width = max(12, min(48, max(len(name) for name in shown)))
    type_width = max(4, max(len(op.op_type) for op in ops))
    strategies = [strategy_text(op.strategy) for op in ops]
    strategy_width = max(10, min(44, max(len(s) for s in strategies)))
    header = (
        f"{'operator':<{name_width}}  {'type':<{type_width}}  {'strategy':<{strategy_width}}  {'compute ms':>10}"
        f"  {'comm ms':>9}  collectives before this op"
    )
    lines += ["", f"{title}:", header, "-" * len(header)]
    for op, name, strategy in zip(ops, shown, strategies):
        lines.append(
            f"{name[:name_width]:<{name_width}}  {op.op_type:<{type_width}}  {strategy:<{strategy_width}}"
            f"  {figure_ms(op.cost.compute_s):>10}  {figure_ms(op.cost.communication_s):>9}"
            f"  {'; '.join(incoming.get(op.name, [])) or '-'}"
        )
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
    verdict = "VERIFIED" if report.ok else "FAILED"
    where = (
        f"{report.processes} torch.distributed process{'es' if report.processes > 1 else ''}"
        if report.runtime == "torch"
        else f"{report.devices} virtual devices"
    )
    what = "forward, backward and gradient sync" if report.gradients is not None else "forward"
    lines = [f"autopar verify: {verdict} on {where} ({report.time_s:.1f} s): {what}", ""]
    for name, entry in report.outputs.items():
        lines.append(
            f"output {name:<16} max abs error {_error(entry['max_abs_error'])}"
            f"  max rel error {_error(entry['max_rel_error'])}  {'ok' if entry['ok'] else 'MISMATCH'}"
        )
    check = report.gradients
    if check is not None:
        lines.append(
            f"gradients: {check.checked} parameters, max abs error {_error(check.max_abs_error)}"
            f"  max rel error {_error(check.max_rel_error)}  {'ok' if check.ok else 'MISMATCH'}"
            + (f"  (worst: {check.worst})" if check.worst else "")
        )
    lines.append("")
    lines.append("collectives executed (plan lists):")
    executed, planned = report.collectives["executed"], report.collectives["planned"]
    empty = True
    for phase in PHASES:
        ran, listed = executed.get(phase, {}), planned.get(phase, {})
        for label in sorted(set(ran) | set(listed)):
            empty = False
            done = ran.get(label, {"count": 0, "bytes": 0})
            want = listed.get(label, {"count": 0, "bytes": 0})
            lines.append(
                f"  {phase:<8} {label:<22} {done['count']:>5} x {human_bytes(done['bytes']):>10}"
                f"   ({want['count']} x {human_bytes(want['bytes'])})"
            )
    if empty:
        lines.append("  none")
    for problem in report.problems:
        lines.append(f"problem: {problem}")
    return "\n".join(lines) + "\n"
