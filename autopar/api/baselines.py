"""What the report compares a plan with: the data-parallel and stand-alone plans of its own problem, and the
forward / recomputed share of its compute. One lowering each, no new search."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from autopar import progress
from autopar.lowering import Plan
from autopar.report.html import Comparison
from autopar.search.driver import data_parallel_choice, stand_alone_choice
from autopar.search.memory import MemoryChoices


def _sibling(plan: Plan, choice: Sequence[int], mode: str) -> Plan:
    """The plan of another choice on ``plan``'s own problem (same micro-batches, no other memory relief); a
    pipelined plan's is the whole batch's on every device, one stage (`Plan.single`), as data parallel runs."""
    search = dataclasses.replace(
        plan.search,
        choice=tuple(choice),
        method=mode,
        memory_multiplier=0.0,
        candidates_kept=None,
        candidates_dropped=None,
        choices=MemoryChoices(micro_batches=1 if plan.pipeline is not None else plan.search.choices.micro_batches),
    )
    sibling = dataclasses.replace(plan, choice=tuple(choice), search=search, mode=mode, phases_s={})
    if plan.pipeline is None or plan.single is None:
        return sibling
    return dataclasses.replace(sibling, problem=plan.single, pipeline=None, single=None)


def compute_split(plan: Plan) -> tuple[float, float]:
    """(forward seconds, recomputed forward seconds) of the step's compute.

    Each operator's compute is its forward times its work multiple (`Dataflow.work_multiple`), as the cost
    model charges it; micro-batches multiply both.
    """
    problem, choices = plan.problem, plan.search.choices
    forward = sum(
        float(problem.node_compute[i][c]) / multiple
        for i, c in enumerate(plan.choice)
        if (multiple := problem.work_multiple(i)) > 0
    )
    recompute = (
        sum(float(problem.recompute_time[i][c]) for i, c in enumerate(plan.choice) if i in problem.recompute_time)
        if choices.recompute
        else 0.0
    )
    if plan.pipeline is not None:
        # the step's compute is the pipeline's (its slowest stage's, micro-batch after micro-batch), not the
        # sum over every operator: each part keeps its share of one micro-batch's compute on every stage
        total = sum(float(problem.node_compute[i][c]) for i, c in enumerate(plan.choice)) + recompute
        share = plan.file.totals.compute_s / total if total > 0 else 0.0
        return forward * share, recompute * share
    return forward * choices.micro_batches, recompute * choices.micro_batches


def comparison(plan: Plan) -> Comparison:
    """What the report compares a plan with, on the plan's own problem: one lowering each, no new search.

    The data-parallel and stand-alone plans of the same problem (same micro-batches) and the
    forward / recomputed share of the step's compute; the report reads them as plan files. With fixed
    strategies both are pure: they are lowered on the problem without them (``plan.free``'s), since a
    fixed operator's one candidate is neither data parallel nor stand-alone.
    """
    progress.report("comparisons", 0, 2)
    base = plan.free if plan.free is not None else plan
    problem = base.single if base.pipeline is not None and base.single is not None else base.problem
    dp_choice = data_parallel_choice(problem)
    same = base is plan and list(plan.choice) == dp_choice
    data_parallel = plan if same else _sibling(base, dp_choice, "data_parallel")
    dp_file = data_parallel.file
    progress.report("comparisons", 1, 2)
    stand_alone = _sibling(base, stand_alone_choice(problem), "stand_alone")
    forward, recompute = compute_split(plan)
    alone_file = stand_alone.file
    progress.report("comparisons", 2, 2)
    return Comparison(dp_file, alone_file, forward, recompute)
