"""Planning: a model (a file, an ONNX proto or a `Graph`) and options in, a `Plan` out.

Also the costed problem a plan is searched on (`build`), each operator's candidates, and the
predicted step time of any full assignment of them (`evaluate`).
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path

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
)
from autopar.graph import Graph, freeze, load_model, train
from autopar.limits import MAX_MICRO_BATCHES
from autopar.lowering import (
    Plan,
)
from autopar.options import (
    DEFAULT_COST_MODEL,
    DEFAULT_DEVICES,
    CostModelLike,
    Mode,
    Optimizer,
    PlanOptions,
    Precision,
    RankTable,
    SearchAlgorithm,
    check_devices,
)
from autopar.search.costing import build_problem
from autopar.search.driver import (
    SearchResult,
    parameter_state_bytes,
    run_search,
)
from autopar.search.problem import SearchProblem
from autopar.strategy import OpRule

ModelLike = str | Path | onnx.ModelProto | Graph


def model_graph(
    model: ModelLike,
    batch: int | None,
    dims: Mapping[str, int] | None,
    frozen: Sequence[str] = (),
    trainable: Sequence[str] = (),
) -> Graph:
    """The model as a `Graph` at this batch and these dims, the ``frozen`` parameters not trained and
    the ``trainable`` constants trained."""
    frozen = [frozen] if isinstance(frozen, str) else list(frozen)
    trainable = [trainable] if isinstance(trainable, str) else list(trainable)
    if isinstance(model, Graph):
        return freeze(train(model, trainable), frozen)
    return load_model(model, batch=batch, dims=dict(dims or {}), frozen=frozen, trainable=trainable)


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
    optimizer: Optimizer | str | None = None,
    memory_reserve: float | str | None = None,
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
        optimizer=optimizer,
        memory_reserve=memory_reserve,
    )
    return build_with(model, options)


def build_with(model: ModelLike, options: PlanOptions) -> SearchProblem:
    """The search problem for a model under checked options."""
    graph = model_graph(model, options.batch, options.dims, options.frozen, options.trainable)
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
    trainable: Sequence[str] = (),
    overlap: bool = True,
    rank_table: RankTable | None = None,
    micro_batches: int | None = None,
    fixed: Mapping[str, Sequence[Sequence[int]]] | None = None,
    optimizer: Optimizer | str | None = None,
    memory_reserve: float | str | None = None,
) -> Plan:
    """Search the best sharding plan for ``model`` on ``devices`` devices.

    ``mode`` is MindSpore's parallel mode: ``auto_parallel`` (search), ``data_parallel``
    (split the batch everywhere) or ``stand_alone`` (every operator whole on every device).
    ``frozen`` names parameters (or shell globs of them) that are not trained; ``trainable`` float
    constants the import took for masks or tables (`autopar.graph.build`) to train; ``overlap=False``
    adds every gradient synchronisation to the step instead of hiding it behind the backward.
    ``rank_table`` (MindSpore's rank_table.json, a path or its parsed JSON) gives the device count
    (8 by default without one) and the servers, whose shape re-derives the cost model's link levels.
    ``micro_batches``: gradient accumulation over this many micro-batches of the batch; None (the
    default) uses one unless nothing fits, then the fewest of 2, 4, 8, ... with a plan that fits.
    ``fixed`` maps operator names to the in_strategy each must keep; every other operator is searched
    around them (MindSpore's ``semi_auto_parallel`` with sharding propagation, but exact).
    ``optimizer`` ("adam" or "sgd") sets the optimizer state every trainable parameter keeps; None
    takes the profile's default. ``memory_reserve`` (bytes, or a size such as "4GB") is device memory
    plans leave free for workspace, communication buffers and fragmentation; None takes the profile's.
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
        trainable=trainable,
        overlap=overlap,
        micro_batches=micro_batches,
        fixed=fixed,
        optimizer=optimizer,
        memory_reserve=memory_reserve,
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
    graph = model_graph(model, batch, dims, frozen, options.trainable)
    step_batch = common_batch(graph)
    if micro_batches is not None and micro_batches > 1:
        graph = model_graph(model, _micro_batch(step_batch, micro_batches, graph), dims, frozen, options.trainable)
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
    free = _free_plan(problem, found, options, cost) if fixed else None
    result = Plan.lower(problem, found, mode, phases, free)
    if result.fallback_ops:
        warnings.warn(result.fallback_summary(), FallbackWarning, stacklevel=3)
    return result


def _free_plan(problem: SearchProblem, found: SearchResult, options: PlanOptions, cost: CostModel) -> Plan | None:
    """With fixed strategies: the plan the search finds with nothing fixed, on the same graph (so at the
    same micro-batch size) and micro-batches, which the plan is compared with (None: nothing fits)."""
    free = build_problem(problem.graph, cost, options.num_devices)
    try:
        result = run_search(free, "auto_parallel", options.search.value)
    except InfeasibleError:
        return None
    k = found.choices.micro_batches
    if k > 1:
        result = dataclasses.replace(result, choices=dataclasses.replace(result.choices, micro_batches=k))
    return Plan.lower(free, result, "auto_parallel")


def common_batch(graph: Graph) -> int | None:
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
            graph = model_graph(model, step_batch // k, options.dims, options.frozen, options.trainable)
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


def candidates(
    model: ModelLike, devices: int = DEFAULT_DEVICES, batch: int | None = None, dims: Mapping[str, int] | None = None
) -> dict[str, list[tuple[tuple[int, ...], ...]]]:
    """Every operator's candidate strategies (data parallel first).

    Candidates depend on the mesh's bits, not its links' speeds: the default profile's mesh does.
    """
    check_devices(devices)
    graph = model_graph(model, batch, dims)
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
