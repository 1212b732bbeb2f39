"""A pipelined plan's stages, sends and whole-step figures, for its plan file.

The search leaves one micro-batch's problem on one stage's devices, each stage's range of
operators and the shape (`autopar.search.pipeline`); this module lays out what that means for
the whole machine: each stage's devices (the slowest mesh bits spell its index), every tensor
sent between stages with its bytes and link, and the step's totals taken from the slowest stage.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from autopar.cost.mesh import Mesh
from autopar.lowering.lower import (
    gradient_sync_seconds,
    memory_breakdown,
    optimizer_updates,
    rounded,
    training_flops,
)
from autopar.lowering.planfile import GradientPath, PipelineEntry, Redistribution, SendEntry, StageEntry, Totals
from autopar.search.driver import data_parallel_choice
from autopar.search.memory import MemoryChoices
from autopar.search.pipeline import SCHEDULE, PipelineResult, stage_link_bit, stage_problem
from autopar.search.problem import SearchProblem


def stage_problems(problem: SearchProblem, pipeline: PipelineResult) -> list[SearchProblem]:
    """Each stage as the search costed it."""
    shape = pipeline.shape
    return [stage_problem(problem, s.first, s.last, shape, i) for i, s in enumerate(pipeline.stages)]


def _stage_choices(pipeline: PipelineResult, index: int) -> MemoryChoices:
    return pipeline.stages[index].result.choices


def pipeline_memory(stages: Sequence[SearchProblem], pipeline: PipelineResult) -> float:
    """Bytes per device of the fullest stage (``stages``: `stage_problems`)."""
    return max(stage.memory(s.result.choice, s.result.choices) for stage, s in zip(stages, pipeline.stages))


def pipeline_entry(
    problem: SearchProblem, pipeline: PipelineResult, stages: Sequence[SearchProblem], mesh: Mesh
) -> PipelineEntry:
    """The plan file's pipeline: stages with their devices, time and memory, and every send (``stages``:
    `stage_problems`)."""
    shape, rules = pipeline.shape, problem.rules
    per_stage = problem.num_devices
    stage_of = {}
    entries = []
    for index, (stage, plan) in enumerate(zip(stages, pipeline.stages)):
        for node in range(plan.first, plan.last):
            stage_of[node] = index
        entries.append(
            StageEntry(
                first_op=rules[plan.first].op.name,
                last_op=rules[plan.last - 1].op.name,
                operators=plan.last - plan.first,
                first_device=index * per_stage,
                devices=per_stage,
                micro_batches_in_flight=shape.in_flight(index),
                step_time_s=rounded(plan.time_s),
                memory_per_device_bytes=round(stage.memory(plan.result.choice, plan.result.choices)),
            )
        )
    choice = pipeline.choice
    sends = []
    for use in problem.uses:
        src, dst = stage_of[use.src_node], stage_of[use.dst_node]
        info = problem.graph.tensor(use.tensor)
        if src == dst or info.kind == "input":
            continue
        size = problem.itemsize(info)
        received = rules[use.dst_node].input_layout(choice[use.dst_node], use.dst_slot).local_numel(info.shape)
        sent = problem.source_layout(use, choice[use.src_node]).local_numel(info.shape)
        bit = stage_link_bit(problem.mesh_bits, dst - 1, dst)
        sends.append(
            SendEntry(
                tensor=use.tensor,
                from_op=rules[use.src_node].op.name,
                to_op=rules[use.dst_node].op.name,
                from_stage=src,
                to_stage=dst,
                bytes=received * size,
                gradient_bytes=sent * size if problem.requires_grad.get(use.tensor, False) else 0,
                link=mesh.level_of(bit).name,
            )
        )
    return PipelineEntry(
        schedule=SCHEDULE,
        micro_batches=shape.micro_batches,
        bits=list(range(problem.mesh_bits, mesh.mesh_bits)),
        bubble_fraction=rounded(shape.bubble_fraction),
        stages=entries,
        sends=sends,
    )


def pipeline_totals(
    problem: SearchProblem,
    pipeline: PipelineResult,
    stages: Sequence[SearchProblem],
    single: SearchProblem,
    num_devices: int,
    free_step: float | None = None,
) -> Totals:
    """The step's figures: its time is the slowest stage's; compute, communication, bubble, sync and
    memory are that stage's (memory the fullest stage's; ``stages``: `stage_problems`); data parallel is
    the one-stage problem's (``single``: the whole batch on every device); ``free_step``: with fixed
    strategies, the step of the plan found with nothing fixed."""
    shape = pipeline.shape
    slowest = max(range(len(stages)), key=lambda i: pipeline.stages[i].time_s)
    fullest = max(
        range(len(stages)),
        key=lambda i: stages[i].memory(pipeline.stages[i].result.choice, _stage_choices(pipeline, i)),
    )
    plan = pipeline.stages[slowest]
    stage, choice, choices = stages[slowest], plan.result.choice, plan.result.choices
    once = sum(float(stage.node_sync[i][c]) for i, c in enumerate(choice))
    per_micro_batch = (plan.time_s - once) / shape.slots
    compute = sum(float(problem.node_compute[plan.first + i][c]) for i, c in enumerate(choice))
    if choices.recompute:
        compute += sum(
            float(problem.recompute_time[plan.first + i][c])
            for i, c in enumerate(choice)
            if plan.first + i in problem.recompute_time
        )
    compute *= shape.micro_batches
    bubble = (shape.stages - 1) * per_micro_batch
    update = sum(optimizer_updates(stage, choice, choices))
    step = pipeline.time_s
    data_parallel = single.objective(data_parallel_choice(single))
    flops = training_flops(problem) * shape.micro_batches
    lean = pipeline.stages[fullest]
    return Totals(
        step_time_s=rounded(step),
        compute_s=rounded(compute),
        communication_s=rounded(max(0.0, step - compute - bubble - update)),
        hidden_communication_s=rounded(stage.hidden(choice, choices)),
        gradient_sync_s=rounded(gradient_sync_seconds(stage, choice, choices)),
        optimizer_update_s=rounded(update),
        memory_per_device_bytes=round(stages[fullest].memory(lean.result.choice, lean.result.choices)),
        memory_capacity_bytes=int(problem.cost.device_capacity),
        memory_reserve_bytes=int(problem.cost.memory_reserve),
        memory_breakdown=memory_breakdown(stages[fullest], lean.result.choice, lean.result.choices),
        training_flops=flops,
        ideal_step_time_s=rounded(flops / (num_devices * problem.cost.peak_flops)),
        data_parallel_step_time_s=rounded(data_parallel),
        speedup_vs_data_parallel=rounded(data_parallel / step) if step > 0 else 1.0,
        pipeline_bubble_s=rounded(bubble),
        free_step_time_s=rounded(free_step) if free_step is not None else None,
        fixed_cost_s=rounded(step - free_step) if free_step is not None else None,
    )


_Entry = TypeVar("_Entry", Redistribution, GradientPath)


def within_stages(entries: list[_Entry], problem: SearchProblem, pipeline: PipelineResult | None) -> list[_Entry]:
    """The redistributions (or gradient paths) inside a stage: a tensor between two stages is a send
    (`pipeline_entry`), each device receiving its shard point to point, not a collective."""
    if pipeline is None:
        return entries
    stage = {problem.rules[node].op.name: i for i, s in enumerate(pipeline.stages) for node in range(s.first, s.last)}
    return [e for e in entries if stage[e.producer] == stage.get(e.consumer, stage[e.producer])]


def one_f_one_b(stages: int, micro_batches: int, forward: float, backward: float) -> list[list[tuple[str, int, float]]]:
    """The 1F1B schedule of ``stages`` alike stages: per stage, its (``"F"`` or ``"B"``, micro-batch, start)
    in the order it runs them (each forward lasts ``forward``, each backward ``backward``).

    Stage i first runs min(S - i - 1, M) forwards, then alternates one forward and one backward, then
    drains its backwards; a forward waits for the stage before, a backward for the stage after.

    >>> [[(kind, m) for kind, m, _ in row] for row in one_f_one_b(2, 2, 1.0, 2.0)]
    [[('F', 0), ('F', 1), ('B', 0), ('B', 1)], [('F', 0), ('B', 0), ('F', 1), ('B', 1)]]
    >>> max(start for row in one_f_one_b(2, 4, 1.0, 2.0) for _, _, start in row) + 2.0 == (4 + 2 - 1) * 3.0
    True
    """
    orders = []
    for stage in range(stages):
        warm = min(stages - stage - 1, micro_batches)
        order = [("F", m) for m in range(warm)]
        for m in range(micro_batches - warm):
            order += [("F", warm + m), ("B", m)]
        order += [("B", m) for m in range(micro_batches - warm, micro_batches)]
        orders.append(order)
    done: dict[tuple[str, int, int], float] = {}
    free = [0.0] * stages
    position = [0] * stages
    starts: list[list[tuple[str, int, float]]] = [[] for _ in range(stages)]
    while any(position[i] < len(orders[i]) for i in range(stages)):
        for stage in range(stages):
            if position[stage] == len(orders[stage]):
                continue
            kind, m = orders[stage][position[stage]]
            if kind == "F":
                needs = [("F", m, stage - 1)] if stage else []
            else:
                needs = [("B", m, stage + 1)] if stage < stages - 1 else [("F", m, stage)]
            if any(need not in done for need in needs):
                continue
            start = max([free[stage], *(done[need] for need in needs)])
            end = start + (forward if kind == "F" else backward)
            done[(kind, m, stage)] = end
            free[stage] = end
            starts[stage].append((kind, m, start))
            position[stage] += 1
    return starts
