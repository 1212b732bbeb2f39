"""What a reader of a plan should not miss, in plain sentences: devices that repeat one another's work,
operators without a strategy rule, what the plan does to fit in memory.

Read off the plan file alone, in one place: the HTML report lists them, ``autopar plan`` and
``autopar sweep`` say them on stderr, `autopar.sweep` keeps them with each device count.
"""

from __future__ import annotations

from collections.abc import Sequence

from autopar.lowering.planfile import OpEntry, PlanFile


def devices_used(op: OpEntry) -> int:
    """The devices an operator divides its work over: 2 to the number of mesh bits its layouts use
    (its inputs' splits, its first output's splits and, unless it is a scalar, its partial bits)."""
    bits: set[int] = set()
    if op.outputs:
        layout = op.outputs[0].layout
        bits.update(bit for dim in layout.dims for bit in dim)
        if layout.dims:
            bits.update(layout.partial or [])
    for tensor in op.inputs:
        bits.update(bit for dim in tensor.layout.dims for bit in dim)
    return 1 << len(bits)


def fallback_sentence(named: Sequence[str]) -> str:
    """One sentence for the operators kept replicated for want of a strategy rule (``named``: how to call each)."""
    shown = ", ".join(named[:5]) + (f" and {len(named) - 5} more" if len(named) > 5 else "")
    return (
        f"{len(named)} operator(s) have no strategy rule and are kept replicated with their inputs gathered: {shown}."
    )


def plan_warnings(data: PlanFile) -> list[str]:
    """The plan's warnings, each one sentence (none: nothing to say)."""
    devices = data.devices >> (len(data.pipeline.bits) if data.pipeline is not None else 0)  # one stage's
    widest = max(devices_used(op) for op in data.ops)
    found = []
    if devices > 1 and widest == 1:
        found.append(
            f"The model is fully replicated: every operator runs whole on each of the {devices:,} devices"
            f"{' of its stage' if data.pipeline is not None else ''}, which repeat one another's work."
        )
    elif widest < devices:
        found.append(
            f"Idle devices: the largest split uses {widest:,} of {devices:,} devices"
            f"{' of a stage' if data.pipeline is not None else ''}; the other"
            f" {devices // widest - 1:,} of every {devices // widest:,} repeat the same calculation."
        )
    if data.fallback_ops:
        types = {op.name: op.op_type for op in data.ops}
        found.append(
            fallback_sentence([f"{name} ({types[name]})" if name in types else name for name in data.fallback_ops])
        )
    memory_plan = data.memory_plan
    if memory_plan.parallel_optimizer and data.search.memory_multiplier:  # (taken as faster, it warns of nothing)
        found.append(
            f"To fit in memory, {len(memory_plan.parallel_optimizer)} parameters use the parallel optimizer"
            " (gradient and optimizer state split, weights gathered after the update)."
        )
    asked = data.search.asked or []
    if memory_plan.recompute:
        found.append(
            ("As asked" if "recompute" in asked else "To fit in memory")
            + ", the repeated blocks from "
            + ", ".join(memory_plan.recompute)
            + " recompute their forward pass in the backward."
        )
    if memory_plan.micro_batches > 1 and data.pipeline is None:
        found.append(
            f"{'As asked' if 'micro_batches' in asked else 'To fit in memory'}, the step accumulates gradients"
            f" over {memory_plan.micro_batches} micro-batches; the operators' shapes and costs are one micro-batch's."
        )
    totals = data.totals
    if totals.memory_per_device_bytes > 0.9 * totals.memory_usable_bytes:
        found.append("Memory is over 90% of the usable capacity: a larger batch or model will not fit.")
    return found
