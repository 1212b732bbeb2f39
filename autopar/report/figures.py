"""What the report reads off a plan file: axis kinds, folded rows, summary figures, warnings, traffic per level.

Pure functions of the typed plan file (`PlanFile`), no HTML: the page draws them, notebooks and
tests check them. Each public reader also takes the plan file's dict (``Plan.to_dict()``, a JSON
file), validated into the typed model first, so a notebook can hand it either. The axis kinds, folds and
decisions are the lowering's (`autopar.lowering.decisions`), so the terminal and `Plan` say the same.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from autopar.cost.mesh import Mesh
from autopar.lowering import GRAPH_OUTPUT, SCHEMA, PlanFile, read_plan_file
from autopar.lowering.advice import plan_warnings
from autopar.lowering.decisions import AXES, IMAGE_OPS, axis_splits, expert_bits, is_image_model
from autopar.lowering.decisions import fold_groups as _fold_groups
from autopar.lowering.planfile import CollectiveStep, GradientSync
from autopar.report.format import link_levels
from autopar.units import human_bytes

__all__ = [
    "AXES",
    "AXIS_TITLES",
    "IMAGE_OPS",
    "PlanLike",
    "as_plan_file",
    "axis_splits",
    "collective_rows",
    "expert_bits",
    "fold_groups",
    "incoming_seconds",
    "is_image_model",
    "level_traffic",
    "samples_per_step",
    "summary_figures",
    "timeline_phases",
    "warnings_of",
]

AXIS_TITLES = {
    "batch": "batch (leading dimension)",
    "sequence": "sequence (or image space)",
    "channels/hidden": "channels / hidden (features, output channels, vocabulary, head size)",
    "heads": "attention heads",
    "contraction": "contraction (a reduced axis: the output is a partial sum)",
    "expert": "experts (the leading axis of a stack of expert weights, and the tokens dispatched to them)",
}

PlanLike = PlanFile | Mapping[str, Any]


def as_plan_file(data: PlanLike) -> PlanFile:
    """The typed plan file of ``data`` (a `PlanFile` as is; a dict validated: PlanFileError if it is none)."""
    return data if isinstance(data, PlanFile) else read_plan_file(dict(data))


def fold_groups(plan: PlanLike) -> list[list[int]]:
    """Operator indices grouped by row (`autopar.lowering.decisions.fold_groups`), of a plan file or its dict."""
    return _fold_groups(as_plan_file(plan))


def samples_per_step(data: PlanFile) -> int | None:
    """The data inputs' common leading size times the micro-batches (None: no common batch)."""
    shapes = data.context.inputs if data.context else {}
    sizes = {shape[0] for shape in shapes.values() if shape}
    if len(sizes) != 1:
        return None
    return int(sizes.pop()) * int(data.memory_plan.micro_batches)


def summary_figures(plan: PlanLike, stand_alone: PlanLike | None = None) -> dict[str, float | None]:
    """The numbers the summary cards show (None: not known)."""
    data = as_plan_file(plan)
    alone = as_plan_file(stand_alone) if stand_alone is not None else None
    totals = data.totals
    step = totals.step_time_s
    samples = samples_per_step(data)
    return {
        "step_time_s": step,
        "samples_per_s": samples / step if samples and step > 0 else None,
        "mfu": totals.ideal_step_time_s / step if step > 0 else None,
        "memory_per_device_bytes": totals.memory_per_device_bytes,
        "memory_capacity_bytes": totals.memory_capacity_bytes,
        "speedup_vs_data_parallel": totals.speedup_vs_data_parallel,
        "speedup_vs_stand_alone": (
            alone.totals.step_time_s / step if alone is not None and step > 0 and stand_alone_fits(alone) else None
        ),
    }


def stand_alone_fits(alone: PlanFile) -> bool:
    """Whether the stand-alone plan (every operator whole on every device) fits one device's memory: a speed-up
    over a plan no device can run says nothing."""
    totals = alone.totals
    return not totals.memory_usable_bytes or totals.memory_per_device_bytes <= totals.memory_usable_bytes


def warnings_of(plan: PlanLike) -> list[str]:
    """Plain sentences about what a reader should not miss (`autopar.lowering.advice`: the terminal says them too)."""
    return plan_warnings(as_plan_file(plan))


def level_traffic(plan: PlanLike) -> list[dict[str, Any]]:
    """Per mesh level: its bits, devices per group, and the collectives whose bits cross it.

    A collective over bits of two levels counts in both (its bytes cross both links), so the
    levels' figures do not add up to the plan's. Redistributions count forward, and the gradients'
    ways back as listed (an older file's dual of each step instead); local Slice steps cross nothing.
    """
    data = as_plan_file(plan)
    levels: list[dict[str, Any]] = []
    for level in data.mesh.levels:
        levels.append(
            {
                "name": level.name,
                "bits": list(level.bits),
                "devices_per_group": level.devices_per_group,
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

    for red in data.redistributions:
        for step in red.steps:
            if step.collective == "Slice":
                continue
            both = 2 if step.backward else 1  # a version-2 file charged each step's dual for the backward
            add(step.bits, step.bytes * both, step.seconds + (step.backward_seconds or 0.0), both)
    for path in data.gradients if data.schema_ == SCHEMA else ():  # older files charged the duals instead
        for collective in path.steps:
            if collective.collective != "Slice":
                add(collective.bits, collective.bytes, collective.seconds, 1)
    for sync in data.gradient_sync:
        if sync.collective:
            add(sync.bits, sync.bytes, sync.seconds, 1)
    return levels


def timeline_phases(
    plan: PlanLike, forward_s: float | None = None, recompute_s: float = 0.0
) -> list[tuple[str, float]]:
    """The step's critical path as (phase, seconds), summing to the step time, then the hidden sync.

    Without ``forward_s`` (a plan file alone does not split compute) the compute is one phase.
    Exposed communication splits into the gradient sync the backward could not hide and the rest
    (redistributions and the gradients' ways back, weight gathers).
    """
    totals = as_plan_file(plan).totals
    compute = totals.compute_s
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
    exposed_sync = min(max(0.0, totals.gradient_sync_s - totals.hidden_communication_s), totals.communication_s)
    phases += [
        ("exposed gradient sync", exposed_sync),
        ("other exposed communication", max(0.0, totals.communication_s - exposed_sync)),
        ("optimizer update", totals.optimizer_update_s),
        ("hidden gradient sync", totals.hidden_communication_s),
    ]
    return phases


def incoming_seconds(data: PlanFile) -> dict[str, float]:
    """Seconds of redistribution into each operator (a partial graph output's reduction: its producer)."""
    seconds: dict[str, float] = {}
    for red in data.redistributions:
        target = red.consumer if red.consumer != GRAPH_OUTPUT else red.producer
        seconds[target] = seconds.get(target, 0.0) + red.seconds
    return seconds


def collective_rows(plan: PlanLike) -> list[tuple[float, str, str, str]]:
    """(seconds, sentence, where, phase) for every collective the step runs, costliest first."""
    data = as_plan_file(plan)
    mesh = data.mesh
    rows: list[tuple[float, str, str, str]] = []
    for red in data.redistributions:
        where = (
            f"{red.producer} -> {red.consumer}" if red.consumer != GRAPH_OUTPUT else f"{red.producer} -> graph output"
        )
        # a forward passed round a ring wholly under its attention product (`search.ring`)
        phase = "forward, under the attention kernel" if red.hidden_s and red.hidden_s >= red.seconds else "forward"
        for step in red.steps:
            if step.collective != "Slice":
                rows.append((step.seconds, _sentence(mesh, step, red.tensor), where, phase))
    for path in data.gradients:
        what = f"the {path.carries} {path.tensor}" if path.carries else f"the gradient of {path.tensor}"
        for path_step in path.steps:
            if path_step.collective != "Slice":
                where = f"{path.consumer} -> {path.producer}"
                rows.append((path_step.seconds, _sentence(mesh, path_step, what), where, "backward"))
    for sync in data.gradient_sync:
        if not sync.collective:
            continue
        sentence = _sentence(mesh, sync, f"the gradient of {sync.parameter}")
        if sync.optimizer_shards:
            sentence += ", then AllGather of the updated weights"
        rows.append((sync.seconds, sentence, f"{sync.op} (gradient sync)", "gradient sync"))
    rows.sort(key=lambda row: -row[0])
    return rows


def _sentence(mesh: Mesh, step: CollectiveStep | GradientSync, what: str) -> str:
    """The collective in words: AllReduce of the gradient of w over 8 devices (HCCS+PCIe), 1.05 MB."""
    return (
        f"{step.collective} of {what} over {step.group_size} devices"
        f" ({link_levels(mesh, step.bits)}), {human_bytes(step.bytes)}"
    )
