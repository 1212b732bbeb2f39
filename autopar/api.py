"""The Python API: plan a model, list its candidates, evaluate any assignment of them.

>>> import autopar
>>> plan = autopar.plan("models/resnet50.onnx", devices=8)
>>> plan.strategies["conv1"]
((8, 1, 1, 1), (1, 1, 1, 1))
>>> f"{plan.objective * 1e3:.3f} ms"
'16.208 ms'
>>> autopar.evaluate("models/resnet50.onnx", 8, plan.strategies) == plan.objective
True
"""

from __future__ import annotations

import dataclasses
import math
import time
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import onnx

from autopar import progress
from autopar.cost import CostModel, load_profile
from autopar.cost.mesh import Mesh
from autopar.errors import (
    AutoparError,
    FallbackWarning,
    FixedStrategyError,
    InfeasibleError,
    ModelImportError,
    RenamedOperatorsWarning,
    TooLargeError,
)
from autopar.export import export
from autopar.graph import Graph, freeze, load_model
from autopar.limits import MAX_MICRO_BATCHES, MAX_SEED
from autopar.lowering import (
    PLAN_FILE_FIELDS,
    Plan,
    PlanFile,
    PlanProgram,
    program_from_file,
    program_of,
    read_plan_file,
)
from autopar.options import (
    DEFAULT_COST_MODEL,
    DEFAULT_DEVICES,
    CostModelLike,
    Mode,
    PlanOptions,
    Precision,
    RankTable,
    Runtime,
    SearchAlgorithm,
    check_devices,
    runtime_of,
)
from autopar.report.html import Comparison, plan_html
from autopar.search.costing import build_problem
from autopar.search.driver import (
    SearchResult,
    data_parallel_choice,
    parameter_state_bytes,
    run_search,
    stand_alone_choice,
)
from autopar.search.memory import MemoryChoices
from autopar.search.problem import SearchProblem
from autopar.spmd import VerifyReport, verify_program
from autopar.strategy import OpRule

ModelLike = str | Path | onnx.ModelProto | Graph


def _graph(model: ModelLike, batch: int | None, dims: Mapping[str, int] | None, frozen: Sequence[str] = ()) -> Graph:
    if isinstance(frozen, str):
        frozen = [frozen]
    if isinstance(model, Graph):
        return freeze(model, frozen)
    return load_model(model, batch=batch, dims=dict(dims or {}), frozen=frozen)


def build(
    model: ModelLike,
    devices: int | None = None,
    cost_model: CostModelLike = DEFAULT_COST_MODEL,
    batch: int | None = None,
    dims: Mapping[str, int] | None = None,
    precision: Precision | str = Precision.MIXED,
    *,
    frozen: Sequence[str] = (),
    overlap: bool = True,
    rank_table: RankTable | None = None,
) -> SearchProblem:
    """The search problem for a model on a device count (costs of every candidate and edge)."""
    options = PlanOptions.resolve(
        devices,
        cost_model,
        rank_table,
        batch=batch,
        dims=dims or {},
        precision=precision,
        frozen=frozen,
        overlap=overlap,
    )
    return build_with(model, options)


def build_with(model: ModelLike, options: PlanOptions) -> SearchProblem:
    """The search problem for a model under checked options."""
    graph = _graph(model, options.batch, options.dims, options.frozen)
    return build_problem(graph, options.costs(), options.num_devices)


def plan(
    model: ModelLike,
    devices: int | None = None,
    cost_model: CostModelLike = DEFAULT_COST_MODEL,
    batch: int | None = None,
    mode: Mode | str = Mode.AUTO_PARALLEL,
    *,
    dims: Mapping[str, int] | None = None,
    precision: Precision | str = Precision.MIXED,
    search: SearchAlgorithm | str = SearchAlgorithm.DP,
    frozen: Sequence[str] = (),
    overlap: bool = True,
    rank_table: RankTable | None = None,
    micro_batches: int | None = None,
    fixed: Mapping[str, Sequence[Sequence[int]]] | None = None,
) -> Plan:
    """Search the best sharding plan for ``model`` on ``devices`` devices.

    ``mode`` is MindSpore's parallel mode: ``auto_parallel`` (search), ``data_parallel``
    (split the batch everywhere) or ``stand_alone`` (every operator whole on every device).
    ``frozen`` names parameters (or shell globs of them) that are not trained; ``overlap=False``
    adds every gradient synchronisation to the step instead of hiding it behind the backward.
    ``rank_table`` (MindSpore's rank_table.json, a path or its parsed JSON) gives the device count
    (8 by default without one) and the servers, whose shape re-derives the cost model's link levels.
    ``micro_batches``: gradient accumulation over this many micro-batches of the batch; None (the
    default) uses one unless nothing fits, then the fewest of 2, 4, 8, ... with a plan that fits.
    ``fixed`` maps operator names to the in_strategy each must keep; every other operator is searched
    around them (MindSpore's ``semi_auto_parallel`` with sharding propagation, but exact).
    """
    options = PlanOptions.resolve(
        devices,
        cost_model,
        rank_table,
        batch=batch,
        dims=dims or {},
        mode=mode,
        precision=precision,
        search=search,
        frozen=frozen,
        overlap=overlap,
        micro_batches=micro_batches,
        fixed=fixed,
    )
    return plan_with(model, options)


def plan_with(model: ModelLike, options: PlanOptions) -> Plan:
    """The plan for a model under checked options (`plan` with its keywords gathered)."""
    batch, dims, frozen, fixed = options.batch, options.dims, options.frozen, options.fixed
    micro_batches, devices = options.micro_batches, options.num_devices
    mode, search = options.mode.value, options.search.value
    cost = options.costs()
    started = time.perf_counter()
    progress.report("import", 0, 1)
    graph = _graph(model, batch, dims, frozen)
    step_batch = _common_batch(graph)
    if micro_batches is not None and micro_batches > 1:
        graph = _graph(model, _micro_batch(step_batch, micro_batches, graph), dims, frozen)
    imported = time.perf_counter()
    problem = build_problem(graph, cost, devices, fixed=fixed)
    costed = time.perf_counter()
    if problem.graph.renamed_ops:
        pairs = ", ".join(f"{new!r}" for new in list(problem.graph.renamed_ops)[:5])
        more = f" and {len(problem.graph.renamed_ops) - 5} more" if len(problem.graph.renamed_ops) > 5 else ""
        warnings.warn(
            f"{len(problem.graph.renamed_ops)} operator(s) repeat a name used earlier in the file (ONNX"
            f" requires unique names); the plan calls them {pairs}{more}.",
            RenamedOperatorsWarning,
            stacklevel=3,
        )
    try:
        found = run_search(problem, mode, search)
    except InfeasibleError:
        if micro_batches is not None or not options.mode.searched or isinstance(model, Graph) or step_batch is None:
            raise
        if parameter_state_bytes(problem) / devices > cost.capacity:
            raise  # the parameters alone do not fit: smaller micro-batches cannot help
        accumulated = _accumulate(model, step_batch, options, cost)
        if accumulated is None:
            raise
        problem, found = accumulated
    if micro_batches is not None and micro_batches > 1:
        found = dataclasses.replace(found, choices=dataclasses.replace(found.choices, micro_batches=micro_batches))
    phases = {"import": imported - started, "costing": costed - imported, "search": found.time_s}
    result = Plan.lower(problem, found, mode, phases)
    if result.fallback_ops:
        warnings.warn(result.fallback_summary(), FallbackWarning, stacklevel=3)
    return result


def _common_batch(graph: Graph) -> int | None:
    """The leading size every data input shares (the batch), or None."""
    sizes = {graph.tensor(name).shape[0] for name in graph.inputs if graph.tensor(name).shape}
    return sizes.pop() if len(sizes) == 1 else None


def _micro_batch(step_batch: int | None, micro_batches: int, graph: Graph) -> int:
    if step_batch is None:
        raise AutoparError(
            f"Gradient accumulation needs a batch: the data inputs of {graph.name!r} do not share a leading size."
        )
    if step_batch % micro_batches:
        raise AutoparError(f"The batch of {step_batch} does not split into {micro_batches} equal micro-batches.")
    return step_batch // micro_batches


def _accumulate(
    model: ModelLike,
    step_batch: int,
    options: PlanOptions,
    cost: CostModel,
) -> tuple[SearchProblem, SearchResult] | None:
    """Nothing fits in one batch: the fewest micro-batches (2, 4, ...) with a plan that fits (None: none)."""
    k = 2
    while k <= MAX_MICRO_BATCHES and step_batch % k == 0:
        progress.report("micro-batches", k, MAX_MICRO_BATCHES)
        try:
            graph = _graph(model, step_batch // k, options.dims, options.frozen)
        except ModelImportError:
            return None  # the model does not import at another batch (a shape hard-coded for its own)
        try:
            problem = build_problem(graph, cost, options.num_devices, fixed=options.fixed)
        except FixedStrategyError:
            return None  # a fixed split that does not divide the smaller batch
        try:
            found = run_search(problem, "auto_parallel", options.search.value)
        except InfeasibleError:
            k *= 2
            continue
        return problem, dataclasses.replace(found, choices=dataclasses.replace(found.choices, micro_batches=k))
    return None


def sweep(
    model: ModelLike,
    devices: Sequence[int] = (1, 8, 64, 512),
    cost_model: CostModelLike = DEFAULT_COST_MODEL,
    batch: int | None = None,
    *,
    dims: Mapping[str, int] | None = None,
    precision: Precision | str = Precision.MIXED,
    overlap: bool = True,
) -> list[dict[str, Any]]:
    """Plan ``model`` at each device count: step time, throughput, scaling efficiency, MFU, memory.

    A count whose plan is no faster than a smaller count's is flagged (``warning``); one where
    nothing fits, or that is too large to search, has ``error`` instead of figures.
    """
    counts = sorted(set(devices))
    for count in counts:
        check_devices(count)
    options = PlanOptions.resolve(
        cost_model=cost_model, batch=batch, dims=dims or {}, precision=precision, overlap=overlap
    )
    step_batch = _common_batch(_graph(model, batch, dims))
    points: list[dict[str, Any]] = []
    base: tuple[int, float] | None = None  # (devices, samples per second per device) of the first that fits
    for count in counts:
        progress.report("sweep", counts.index(count), len(counts))
        try:
            found = plan_with(model, options.replace(num_devices=count))
        except (InfeasibleError, TooLargeError) as exc:
            points.append({"devices": count, "error": str(exc)})
            continue
        totals = found.to_dict()["totals"]
        step = totals["step_time_s"]
        samples = (step_batch or 1) / step if step > 0 else math.inf
        if base is None:
            base = (count, samples / count)
        point: dict[str, Any] = {
            "devices": count,
            "step_time_s": step,
            "samples_per_s": samples,
            "scaling_efficiency": samples / count / base[1],
            "mfu": totals["ideal_step_time_s"] / step if step > 0 else 0.0,
            "memory_per_device_bytes": totals["memory_per_device_bytes"],
            "memory_plan": found.to_dict()["memory_plan"],
        }
        faster = [p for p in points if "step_time_s" in p and p["step_time_s"] <= step * (1 + 1e-9)]
        if faster:
            point["warning"] = (
                f"no faster than on {faster[0]['devices']} devices: the other {count - faster[0]['devices']} add"
                " nothing (the model has too little work to split further)"
            )
        points.append(point)
    return points


def candidates(
    model: ModelLike, devices: int = DEFAULT_DEVICES, batch: int | None = None, dims: Mapping[str, int] | None = None
) -> dict[str, list[tuple[tuple[int, ...], ...]]]:
    """Every operator's candidate strategies (data parallel first).

    Candidates depend on the mesh's bits, not its links' speeds: the default profile's mesh does.
    """
    check_devices(devices)
    graph = _graph(model, batch, dims)
    mesh = Mesh.of(load_profile(DEFAULT_COST_MODEL), devices)
    rules = [OpRule.build(op, graph, mesh.mesh_bits) for op in graph.ops]
    return {rule.op.name: [rule.in_strategy(exponents) for exponents in rule.candidates] for rule in rules}


def choice_for(problem: SearchProblem, strategies: Mapping[str, Sequence[Sequence[int]]]) -> list[int]:
    """Candidate indices for a full assignment of strategies; StrategyError on anything invalid."""
    return problem.choice_for(strategies)


def evaluate(
    model: ModelLike,
    devices: int | None,
    strategies: Mapping[str, Sequence[Sequence[int]]],
    cost_model: CostModelLike = DEFAULT_COST_MODEL,
    batch: int | None = None,
    dims: Mapping[str, int] | None = None,
    precision: Precision | str = Precision.MIXED,
    *,
    frozen: Sequence[str] = (),
    overlap: bool = True,
    rank_table: RankTable | None = None,
) -> float:
    """Predicted step time (the searched objective) of a full assignment of strategies."""
    problem = build(
        model, devices, cost_model, batch, dims, precision, frozen=frozen, overlap=overlap, rank_table=rank_table
    )
    return problem.objective(problem.choice_for(strategies))


def _is_plan_file(data: Mapping[str, Any], graph: Graph) -> bool:
    """A plan file's dict, not {op: strategy}: it has a schema, or plan-file keys and no operator's name."""
    if "schema" in data:
        return True
    operators = {op.name for op in graph.ops}
    return not (set(data) & operators) and bool(set(data) & set(PLAN_FILE_FIELDS))


def verify(
    model: ModelLike,
    plan_or_strategies: Plan | PlanFile | Mapping[str, Any] | None = None,
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
) -> VerifyReport:
    """Run a plan on ``devices`` devices and compare every output (and gradient) with one device.

    ``plan_or_strategies`` is a `Plan`, a plan file (a `PlanFile`, or a dict as `Plan.to_dict()`
    or a JSON file gives it), a plain {op: strategy} mapping, or None to verify the plan the
    model's autopar sharding annotations hold (``autopar export --to onnx``), else the plan
    autopar finds. ``runtime`` is "virtual" (every rank in this process) or "torch" (one
    torch.distributed process per rank: needs ``autopar[torch]``). ``gradients`` runs the
    backward pass and the gradient synchronisation too and checks every trainable parameter's
    gradient; the torch runtime always does, the virtual one when asked.
    """
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise AutoparError(f"The seed must be an integer from 0 to {MAX_SEED:,}, got {seed!r}.")
    runtime = runtime_of(runtime)
    if runtime == "torch" and gradients is False:
        raise AutoparError("The torch runtime always checks gradients; leave gradients unset or True.")
    training = runtime == "torch" or bool(gradients)
    if training:
        _need_torch(runtime)
    program = _program(model, plan_or_strategies, devices, batch, dims, cost_model, precision, rank_table)
    if not training:
        return verify_program(program, seed=seed)
    from autopar.runtime.launch import DEFAULT_TIMEOUT_S
    from autopar.runtime.verify import verify_training

    return verify_training(program, seed=seed, runtime=runtime, port=port, timeout_s=timeout_s or DEFAULT_TIMEOUT_S)


def _program(
    model: ModelLike,
    given: Plan | PlanFile | Mapping[str, Any] | None,
    devices: int | None,
    batch: int | None,
    dims: Mapping[str, int] | None,
    cost_model: CostModelLike,
    precision: Precision | str,
    rank_table: RankTable | None,
) -> PlanProgram:
    """What `verify` runs: a `Plan`'s program; a plan file's, read without costing anything (its own
    precision sizes the collectives); or that of strategies (given, annotated, or searched), lowered
    on the model's costed problem."""
    if isinstance(given, Plan):
        return given.program
    options = PlanOptions.resolve(devices, cost_model, rank_table, batch=batch, dims=dims or {}, precision=precision)
    graph = _graph(model, options.batch, options.dims)
    if isinstance(given, Mapping) and _is_plan_file(given, graph):
        given = read_plan_file(given)
    if isinstance(given, PlanFile):
        costs = options.replace(precision=given.precision).costs()
        return program_from_file(graph, given, options.num_devices, costs)
    problem = build_problem(graph, options.costs(), options.num_devices)
    if given is None:  # a model exported with `--to onnx` carries its plan
        from autopar.export.onnx_sharding import annotated_strategies

        given = annotated_strategies(graph.model, options.num_devices)
    if given is None:
        return Plan.lower(problem, run_search(problem), "auto_parallel").program
    return program_of(problem, problem.choice_for(given))


def export_plan(
    plan: Plan | PlanFile, to: str, out: str | Path | None = None, model: onnx.ModelProto | None = None
) -> list[Path]:
    """Write a plan for a framework (``to``: onnx, mindspore, dtensor or jax); the files written.

    The exporters (`autopar.export`) read the plan file; a `Plan` brings the model it was made
    for (ONNX in, ONNX out, and the shapes the DTensor and JAX checks use), a plan file takes ``model``.
    """
    if isinstance(plan, Plan):
        return export(plan.file, to, out, plan.problem.graph.model)
    return export(plan, to, out, model)


def _need_torch(runtime: str) -> None:
    try:
        import torch  # noqa: F401
    except ImportError:
        what = "The torch runtime" if runtime == "torch" else "Checking gradients"
        raise AutoparError(
            f"{what} needs PyTorch: pip install 'autopar[torch]' (the CPU build, torch==2.13.0)."
        ) from None


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
        float(problem.node_compute[i][c]) / (1.0 + factor * problem.backward_passes(i))
        for i, c in enumerate(plan.choice)
    )
    recompute = (
        sum(float(problem.recompute_time[i][c]) for i, c in enumerate(plan.choice) if i in problem.recompute_time)
        if choices.recompute
        else 0.0
    )
    return forward * choices.micro_batches, recompute * choices.micro_batches


def comparison(plan: Plan) -> Comparison:
    """What the report compares a plan with, on the plan's own problem: one lowering each, no new search.

    The data-parallel and stand-alone plans of the same problem (same micro-batches) and the
    forward / recomputed share of the step's compute; the report reads them as plan files.
    """
    problem = plan.problem
    dp_choice = data_parallel_choice(problem)
    data_parallel = plan if list(plan.choice) == dp_choice else _sibling(plan, dp_choice, "data_parallel")
    stand_alone = _sibling(plan, stand_alone_choice(problem), "stand_alone")
    forward, recompute = compute_split(plan)
    return Comparison(data_parallel.file, stand_alone.file, forward, recompute)


def _jupyter_report(plan: Plan) -> str:
    return plan_html(plan, comparison(plan))


Plan.html_renderer = _jupyter_report  # a Plan displays as its report in Jupyter; the core never imports the faces
