"""The `Plan`: the chosen whole, immutable, with everything it implies.

A plan is one search result on one problem. Its plan file (`Plan.file`, typed; `to_dict`,
`to_json`) lists every operator's strategy and layouts, every redistribution, each
parameter's gradient synchronisation, totals and, when pipelined, the stages (schema "autopar.plan/3");
its program
(`Plan.program`) is what the verifiers run. Exporters read the file (`autopar.api.export_plan`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from os import PathLike
from pathlib import Path
from typing import Any, ClassVar, Protocol

from autopar import progress
from autopar.cost.mesh import Mesh
from autopar.errors import AutoparError
from autopar.layout import Layout
from autopar.lowering.advice import fallback_sentence
from autopar.lowering.decisions import Degrees, decisions, degrees
from autopar.lowering.lower import (
    gradient_paths,
    gradient_sync,
    memory_plan,
    mesh_links,
    op_entries,
    plan_context,
    redistributions,
    rounded,
    totals,
)
from autopar.lowering.planfile import SCHEMA, Asked, PlanFile, RepeatedBlock, SearchSummary, UnfoldedRun
from autopar.lowering.program import PlanProgram, program_of
from autopar.lowering.stages import pipeline_entry, pipeline_memory, pipeline_totals, stage_problems, within_stages
from autopar.search.driver import SearchResult, data_parallel_choice
from autopar.search.pipeline import PipelineResult
from autopar.search.problem import SearchProblem


def write_page(path: object, page: Callable[[], str]) -> Path:
    """Write the text ``page`` makes to the file ``path``; one sentence (`AutoparError`) for a path that is not
    a file's, before the page is made, or one that cannot be written."""
    if not isinstance(path, str | PathLike):
        raise AutoparError(f"The report's path must be a file's path (a str or a Path), got {path!r}.")
    target = Path(path)
    if target.is_dir():
        raise AutoparError(f"Cannot write the report to {str(path)!r}: it is a directory; name a file to write.")
    try:
        target.write_text(page(), encoding="utf-8")
    except OSError as exc:
        raise AutoparError(f"Cannot write the report to {str(path)!r}: {exc.strerror or exc}.") from None
    return target


class PlanFace(Protocol):
    """How a plan shows itself: the faces (`autopar.api`) register one; the core never imports them."""

    def text(self, plan: "Plan", top: int | None) -> str: ...

    def html(self, plan: "Plan") -> str: ...

    def page(self, plan: "Plan") -> str: ...


@dataclass(frozen=True)
class Plan:
    """The chosen whole: a strategy per operator plus everything it implies.

    ``print(plan)`` shows what ``autopar plan`` prints (`summary`); in Jupyter it displays as its report;
    `report` writes that report as a page; `degrees` and `decisions` say what the search decided.
    """

    problem: SearchProblem = field(repr=False)
    choice: tuple[int, ...] = field(repr=False)
    search: SearchResult = field(repr=False)
    model_name: str
    mode: str
    cost_model: str
    precision: str
    phases_s: dict[str, float] = field(default_factory=dict, repr=False, compare=False)
    # with fixed strategies: the plan the search finds with nothing fixed, on the same graph and
    # micro-batches; what the plan is compared with (pure data parallel, the cost of what was fixed)
    free: "Plan | None" = field(default=None, repr=False, compare=False)
    # with pipeline stages: the stages (``problem`` is then one micro-batch's on one stage's devices) and
    # the one-stage problem of the whole batch on every device, which data parallel is costed on
    pipeline: PipelineResult | None = field(default=None, repr=False, compare=False)
    single: SearchProblem | None = field(default=None, repr=False, compare=False)
    # the memory measures the options asked for rather than left to the search (`SearchSummary.asked`)
    asked: tuple[Asked, ...] = field(default=(), repr=False, compare=False)

    # The faces register how a plan shows itself (autopar.api); the core never imports them.
    face: ClassVar[PlanFace | None] = None

    @classmethod
    def lower(
        cls,
        problem: SearchProblem,
        result: SearchResult,
        mode: str,
        phases_s: dict[str, float] | None = None,
        free: "Plan | None" = None,
        *,
        pipeline: PipelineResult | None = None,
        single: SearchProblem | None = None,
        asked: Sequence[Asked] = (),
    ) -> "Plan":
        """The plan of one search result on one problem (``phases_s``: measured seconds so far; ``free``:
        with fixed strategies, the plan found with nothing fixed; ``pipeline``: its stages, ``problem``
        being one micro-batch's on one stage's devices, and ``single`` the one-stage problem; ``asked``: the
        memory measures the options asked for, `SearchSummary.asked`)."""
        if pipeline is not None and single is None:
            raise ValueError("a pipelined plan needs the one-stage problem its data parallel is costed on")
        return cls(
            problem,
            tuple(result.choice),
            result,
            problem.graph.name,
            mode,
            problem.cost.profile.name,
            problem.cost.precision,
            dict(phases_s or {}),
            free,
            pipeline,
            single,
            tuple(asked),
        )

    @cached_property
    def mesh(self) -> Mesh:
        """The devices, mesh bits and links the plan was searched on (built once, from its cost model)."""
        stages = self.pipeline.shape.stages if self.pipeline is not None else 1
        return Mesh.of(self.problem.cost, self.problem.num_devices * stages)

    @cached_property
    def stage_problems(self) -> list[SearchProblem]:
        """Each pipeline stage as the search costed it (none without stages), made once for every figure."""
        return stage_problems(self.problem, self.pipeline) if self.pipeline is not None else []

    @cached_property
    def stage_mesh(self) -> Mesh:
        """The devices of one pipeline stage (the whole mesh without stages): what its program runs on."""
        return Mesh.of(self.problem.cost, self.problem.num_devices)

    @property
    def devices(self) -> int:
        return self.mesh.num_devices

    @property
    def strategies(self) -> dict[str, tuple[tuple[int, ...], ...]]:
        """Operator name -> MindSpore-style in_strategy (one split tuple per input)."""
        return {rule.op.name: rule.in_strategy(rule.candidates[c]) for rule, c in zip(self.problem.rules, self.choice)}

    @property
    def objective(self) -> float:
        """The searched objective: predicted training step time in seconds."""
        if self.pipeline is not None:
            return self.pipeline.time_s
        return self.problem.objective(self.choice, self.search.choices)

    @property
    def memory_per_device(self) -> float:
        if self.pipeline is not None:
            return pipeline_memory(self.stage_problems, self.pipeline)
        return self.problem.memory(self.choice, self.search.choices)

    @property
    def fallback_ops(self) -> list[str]:
        return [rule.op.name for rule in self.problem.rules if rule.spec.fallback]

    def fallback_summary(self) -> str:
        """One sentence naming the operators kept replicated for want of a rule."""
        return fallback_sentence(
            [f"{rule.op.name} ({rule.op.op_type})" for rule in self.problem.rules if rule.spec.fallback]
        )

    @property
    def data_parallel_objective(self) -> float:
        """Pure data parallel's step on this plan's problem (with fixed strategies: on the problem without them)."""
        problem = self.single or (self.free.problem if self.free is not None else self.problem)
        return problem.objective(data_parallel_choice(problem))

    def layouts(self, node: int) -> tuple[list[Layout | None], list[Layout | None]]:
        """(input layouts, output layouts) of operator ``node`` under this plan."""
        return self.problem.rules[node].candidate_layouts(self.choice[node])

    # --- the plan file ------------------------------------------------------------------------

    @cached_property
    def file(self) -> PlanFile:
        """The typed plan file (computed once)."""
        problem, choice = self.problem, self.choice
        progress.report("lowering", 0, 1)
        started = time.perf_counter()
        choices = self.search.choices
        ops = op_entries(problem, choice, choices)
        listed = gradient_paths(problem, choice, choices)
        moves = within_stages(redistributions(problem, choice, listed), problem, self.pipeline)
        paths = within_stages(listed, problem, self.pipeline)
        syncs = gradient_sync(problem, choice, choices)
        free = (self.free.problem, self.free.objective) if self.free is not None else None
        if self.pipeline is not None and self.single is not None:
            free_step = self.free.objective if self.free is not None else None
            stages, devices = self.stage_problems, self.mesh.num_devices
            total = pipeline_totals(problem, self.pipeline, stages, self.single, devices, free_step)
        else:
            total = totals(problem, choice, choices, free)
        phases = {**self.phases_s, "lowering": time.perf_counter() - started} if self.phases_s else None
        return PlanFile(
            schema_=SCHEMA,
            model=self.model_name,
            devices=self.mesh.num_devices,
            mesh_bits=self.mesh.mesh_bits,
            links=mesh_links(self.mesh),
            cost_model=self.cost_model,
            precision=self.precision,
            optimizer=problem.cost.optimizer,
            mode=self.mode,
            objective_s=rounded(self.objective),
            ops=ops,
            redistributions=moves,
            gradients=paths,
            gradient_sync=syncs,
            frozen=list(problem.graph.frozen) or None,
            fallback_ops=self.fallback_ops,
            totals=total,
            memory_plan=memory_plan(problem, choice, choices),
            context=plan_context(problem),
            pipeline=(
                pipeline_entry(problem, self.pipeline, self.stage_problems, self.mesh)
                if self.pipeline is not None
                else None
            ),
            search=SearchSummary(
                algorithm=self.search.method,
                time_s=round(self.search.time_s, 4),
                candidates=sum(len(rule.candidates) for rule in problem.rules),
                operators=problem.size,
                memory_multiplier=rounded(self.search.memory_multiplier),
                **self._proof(),
                asked=list(self.asked) or None,
                phases_s={name: round(seconds, 4) for name, seconds in phases.items()} if phases else None,
                layouts=problem.layouts_costed or None,
                layout_pairs=problem.pairs_costed or None,
                candidates_kept=self.search.candidates_kept,
                candidates_dropped=self.search.candidates_dropped,
                repeated_blocks=[
                    RepeatedBlock(
                        first_op=problem.rules[repeat.start].op.name, operators=repeat.period, copies=repeat.copies
                    )
                    for repeat, _ in problem.folds
                ],
                unfolded_runs=[
                    UnfoldedRun(
                        first_op=problem.rules[run.start].op.name,
                        operators=run.period,
                        copies=run.copies,
                        reason=run.reason.format(op=repr(problem.rules[run.op].op.name)),
                    )
                    for run in problem.unfolded
                ]
                or None,
            ),
        )

    def _proof(self) -> dict[str, Any]:
        """What the search proved of the plan (`SearchSummary`'s exact, lower_bound_s, gap, steps_split and
        runs_relaxed)."""
        found = self.search
        if found.method not in ("dp", "ilp"):
            return {}
        proof: dict[str, Any] = {
            "exact": found.exact,
            "steps_split": found.steps_split or None,
            "runs_relaxed": found.runs_relaxed or None,
        }
        if not found.exact and found.bound_s is not None:
            objective = self.objective
            bound = min(found.bound_s, objective)
            proof["lower_bound_s"] = rounded(bound)
            proof["gap"] = rounded(objective / bound - 1.0) if bound > 0 else None
        return proof

    @cached_property
    def program(self) -> PlanProgram:
        """What verifying or running this plan executes (computed once, from its file)."""
        return program_of(self.problem, self.choice, self.file, self.stage_mesh)

    def redistributions(self) -> list[dict[str, Any]]:
        """Every producer/consumer pair whose layouts differ, with its collective steps."""
        return self.to_dict()["redistributions"]

    def gradient_sync(self) -> list[dict[str, Any]]:
        """The AllReduce of each trainable parameter over the bits its gradient is partial on."""
        return self.to_dict()["gradient_sync"]

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe plan (schema autopar.plan/3); a fresh copy each call."""
        return self.file.dump()

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)

    # --- what the search decided, and how the plan shows itself ---------------------------------

    @property
    def degrees(self) -> Degrees:
        """The parallel degrees users speak in (data x tensor, sequence where it applies): each mesh bit
        counts for the role it plays in most operators (`autopar.lowering.decisions.degrees`)."""
        return degrees(self.file)

    def decisions(self) -> list[dict[str, Any]]:
        """The operators off data parallel (splitting more than the batch), as plain data, in graph order:
        name, op_type, strategy, splits (factor per axis kind), devices, block (the first copy's operator of
        the repeated block it is in, or None), fixed."""
        return decisions(self.file)

    def summary(self, top: int | None = 10) -> str:
        """What ``autopar plan`` prints: the summary, the decisions, the redistributed tensors and the ``top``
        costliest operators (None: every operator, in graph order)."""
        return self._face().text(self, top)

    def __str__(self) -> str:
        return self.summary()

    def report(self, path: str | Path) -> Path:
        """Write the plan's report (one self-contained HTML page, as ``autopar report`` writes) to ``path``."""
        return write_page(path, lambda: self._face().page(self))

    def _face(self) -> PlanFace:
        face = type(self).face
        if face is None:  # importing the package registers them (autopar.api): only a stripped install lacks them
            raise RuntimeError("No face is registered to show a plan: import autopar.api first.")
        return face

    def _repr_html_(self) -> str | None:
        return self._face().html(self)
