"""Verification: run a plan on virtual devices (or torch.distributed) and compare it with one device.

What runs is lowering's `PlanProgram`: a `Plan`'s own, a plan file's (read without costing the model), or
that of strategies given, annotated in the model, or searched.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from autopar.api.planning import ModelLike, _micro_batch, check_model, common_batch, model_graph, plan_with
from autopar.errors import AutoparError
from autopar.graph import Graph
from autopar.limits import MAX_SEED
from autopar.lowering import (
    PLAN_FILE_FIELDS,
    Plan,
    PlanFile,
    PlanProgram,
    load_plan_file,
    program_from_file,
    program_of,
    read_plan_file,
)
from autopar.lowering.program import plan_graph, planned_batch, trained_as_planned
from autopar.options import (
    DEFAULT_COST_MODEL,
    CostModelLike,
    Optimizer,
    PlanOptions,
    Precision,
    RankTable,
    Runtime,
    expect,
    runtime_of,
    shown,
)
from autopar.search.costing import build_problem
from autopar.spmd import VerifyReport, verify_program


def _is_plan_file(data: Mapping[str, Any], graph: Graph) -> bool:
    """A plan file's dict, not {op: strategy}: it has a schema, or plan-file keys and no operator's name."""
    if "schema" in data:
        return True
    operators = {op.name for op in graph.ops}
    return not (set(data) & operators) and bool(set(data) & set(PLAN_FILE_FIELDS))


def verify(
    model: ModelLike,
    plan_or_strategies: Plan | PlanFile | Mapping[str, Any] | str | Path | None = None,
    devices: int | None = None,
    batch: int | None = None,
    dims: Mapping[str, int] | None = None,
    seed: int = 0,
    cost_model: CostModelLike = DEFAULT_COST_MODEL,
    precision: Precision | str = Precision.MIXED,
    *,
    rank_table: RankTable | None = None,
    runtime: Runtime | str = Runtime.VIRTUAL,
    gradients: bool | None = None,
    port: int | None = None,
    timeout_s: float | None = None,
    optimizer: Optimizer | str | None = None,
    memory_reserve: float | str | None = None,
) -> VerifyReport:
    """Run a plan on ``devices`` devices and compare every output (and gradient) with one device.

    ``plan_or_strategies`` is a `Plan`, a plan file (a `PlanFile`, a dict as `Plan.to_dict()`
    or a JSON file gives it, or the JSON file's path), a plain {op: strategy} mapping, or None to verify the plan the
    model's autopar sharding annotations hold (``autopar export --to onnx``), else the plan
    autopar finds. ``runtime`` is "virtual" (every rank in this process) or "torch" (one
    torch.distributed process per rank: needs ``autopar[torch]``). ``gradients`` runs the
    backward pass and the gradient synchronisation too and checks every trainable parameter's
    gradient; the torch runtime always does, the virtual one when asked. A pipelined plan runs its stages
    over its micro-batches in 1F1B order, with every point-to-point message checked, against one device
    running the whole batch (``batch`` is the global batch, as for `autopar.plan`). A plan file runs as it was
    made: on its devices and at its inputs' shapes, where ``devices``, ``batch`` and ``dims`` are not given.
    ``optimizer`` and ``memory_reserve`` (`autopar.plan`'s) shape the plan searched when none is given.
    """
    check_model(model)
    given = _given_plan(plan_or_strategies)
    _check_run(seed, gradients, port, timeout_s)
    if isinstance(given, PlanFile) and devices is None and rank_table is None:
        devices = given.devices  # a plan file runs on the devices it was made for
    runtime = runtime_of(runtime)
    if runtime == "torch" and gradients is False:
        raise AutoparError("The torch runtime always checks gradients; leave gradients unset or True.")
    training = runtime == "torch" or bool(gradients)
    if training:
        _need_torch(runtime)
    options = PlanOptions.resolve(
        devices,
        cost_model,
        rank_table,
        batch=batch,
        dims=dims,
        precision=precision,
        optimizer=optimizer,
        memory_reserve=memory_reserve,
    )
    if given is None:  # the plan the model's annotations hold, else the one `plan` prints
        given = _annotated(model, options) or plan_with(model, options)
    staged = _pipelined(model, given, options)
    if staged is not None:
        from autopar.runtime.launch import DEFAULT_TIMEOUT_S
        from autopar.runtime.staged_verify import verify_staged

        program, graph = staged
        return verify_staged(
            program,
            graph,
            seed=seed,
            runtime=runtime,
            gradients=training,
            port=port,
            timeout_s=timeout_s or DEFAULT_TIMEOUT_S,
        )
    program = _program(model, given, options)
    if not training:
        return verify_program(program, seed=seed)
    from autopar.runtime.launch import DEFAULT_TIMEOUT_S
    from autopar.runtime.verify import verify_training

    return verify_training(program, seed=seed, runtime=runtime, port=port, timeout_s=timeout_s or DEFAULT_TIMEOUT_S)


PLAN_SAID = (
    "plan_or_strategies must be a Plan, a plan file (a PlanFile, its dict or its path),"
    " a mapping {operator: in_strategy} or None"
)


def _given_plan(given: object) -> Plan | PlanFile | Mapping[str, Any] | None:
    """What `verify` is given to run, a plan file's path read (PlanFileError on a bad file); one sentence
    for anything else."""
    if isinstance(given, str | Path):
        return load_plan_file(given)
    checked: Plan | PlanFile | Mapping[str, Any] | None = expect(
        given, (Plan, PlanFile, Mapping, type(None)), PLAN_SAID
    )
    if isinstance(checked, Mapping) and "schema" in checked:
        return read_plan_file(checked)  # a plan file's dict (one without its schema is told apart on the model)
    return checked


def _check_run(seed: object, gradients: object, port: object, timeout_s: object) -> None:
    """The run's own arguments, each one sentence when wrong."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise AutoparError(f"The seed must be an integer from 0 to {MAX_SEED:,}, got {seed!r}.")
    expect(gradients, (bool, type(None)), "gradients must be True, False or None")
    if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536):
        raise AutoparError(f"port must be a TCP port from 1 to 65535 or None, got {shown(port)}.")
    if timeout_s is not None and (
        isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or not 0 < timeout_s < math.inf
    ):
        raise AutoparError(f"timeout_s must be a number of seconds above 0 or None, got {shown(timeout_s)}.")


def _program(model: ModelLike, given: Plan | PlanFile | Mapping[str, Any] | None, options: PlanOptions) -> PlanProgram:
    """What `verify` runs: a `Plan`'s program; a plan file's, read without costing anything (its own
    precision sizes the collectives); or that of strategies (given, annotated, or searched), lowered
    on the model's costed problem."""
    if isinstance(given, Plan):
        return given.program
    if not isinstance(given, PlanFile):
        graph = model_graph(model, options.batch, options.dims)
        if not (isinstance(given, Mapping) and _is_plan_file(given, graph)):
            problem = build_problem(graph, options.costs(), options.num_devices)
            return program_of(problem, problem.choice_for(given or {}))
        given = read_plan_file(given)
    costs = options.replace(precision=Precision(given.precision).element_sizes).costs()
    return program_from_file(_file_graph(model, given, options), given, options.num_devices, costs)


def _annotated(model: ModelLike, options: PlanOptions) -> Mapping[str, Any] | None:
    """The strategies a model exported with ``autopar export --to onnx`` carries (None: it carries none)."""
    from autopar.export.onnx_sharding import annotated_strategies

    return annotated_strategies(model_graph(model, options.batch, options.dims).model, options.num_devices)


def _pipelined(
    model: ModelLike, given: Plan | PlanFile | Mapping[str, Any] | None, options: PlanOptions
) -> tuple[Any, Graph] | None:
    """A pipelined plan's staged program on one micro-batch's graph, and the model at the global batch
    (None: the plan has one stage). The plan's stages and sends are checked first: a plan whose ranks
    would wait forever is refused in one sentence (PlanFileError) before anything runs."""
    if isinstance(given, Plan):
        given = given.file
    if isinstance(given, Mapping) and "schema" in given and "pipeline" in given:
        given = read_plan_file(given)
    if not isinstance(given, PlanFile) or given.pipeline is None:
        return None
    _need_torch("torch")
    from autopar.lowering.staged import staged_program

    micro_batches = given.pipeline.micro_batches
    planned = planned_batch(given)
    whole = options.batch or (planned * micro_batches if planned is not None and not options.dims else None)
    if isinstance(model, Graph):
        graph = model_graph(model, whole, options.dims)
    else:  # the reference's: the whole batch
        graph = trained_as_planned(given, model, whole, options.dims, frozen_from_sync=False)
    micro = _micro_batch(common_batch(graph), micro_batches, graph)
    micro_graph = _file_graph(model, given, options.replace(batch=micro))
    costs = options.replace(precision=Precision(given.precision).element_sizes).costs()
    return staged_program(micro_graph, given, costs), graph


def _file_graph(model: ModelLike, file: PlanFile, options: PlanOptions) -> Graph:
    """The model as a plan file was made for it (`plan_graph`): at its inputs' shapes, where ``options`` give no
    batch or dims (with them, what differs is said), every parameter trained but those it lists as frozen
    (`trained_as_planned`: a plan that lost a parameter's synchronisation is caught)."""
    if isinstance(model, Graph):
        return model_graph(model, options.batch, options.dims)
    return plan_graph(file, model, options.batch, options.dims, frozen_from_sync=False)


def _need_torch(runtime: str) -> None:
    try:
        import torch  # noqa: F401
    except ImportError:
        what = "The torch runtime" if runtime == "torch" else "Checking gradients"
        raise AutoparError(
            f"{what} needs PyTorch: pip install 'autopar[torch]' (the CPU build, torch==2.13.0)."
        ) from None
