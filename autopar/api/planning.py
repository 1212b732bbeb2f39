"""Planning: a model (a file, an ONNX proto or a `Graph`) and options in, a `Plan` out.

Also the costed problem a plan is searched on (`build`), each operator's candidates, and the
predicted step time of any full assignment of them (`evaluate`).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Mapping, Sequence
from os import PathLike
from pathlib import Path

import onnx

from autopar import progress
from autopar.context import opened
from autopar.cost import CostModel, load_profile
from autopar.cost.mesh import Mesh
from autopar.errors import (
    AutoparError,
    FallbackWarning,
    InfeasibleError,
    RenamedOperatorsWarning,
)
from autopar.graph import Graph, freeze, load_model, train, untrained
from autopar.lowering import Plan
from autopar.lowering.planfile import Asked
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
    expect,
    mapping_of,
    names_of,
)
from autopar.search.costing import build_problem, meeting_layouts
from autopar.search.cuts import search_stages
from autopar.search.driver import (
    SearchOptions,
    run_search,
)
from autopar.search.pipeline import ONE_STAGE, PipelineShape
from autopar.search.problem import SearchProblem
from autopar.search.shape_search import ShapeSearch, common_batch, joined, stage_starts
from autopar.strategy import OpRule

ModelLike = str | Path | onnx.ModelProto | Graph
STRATEGIES_SHAPE = "{operator: in_strategy}"

MODEL_SAID = "The model must be an ONNX file's path, an onnx.ModelProto or an imported Graph"


def check_model(model: object) -> ModelLike:
    """The model as given when it is one a plan reads (a path, a proto, a `Graph`); one sentence otherwise."""
    return expect(model, (str, PathLike, onnx.ModelProto, Graph), MODEL_SAID)


def model_graph(
    model: ModelLike,
    batch: int | None,
    dims: Mapping[str, int] | None,
    frozen: Sequence[str] = (),
    trainable: Sequence[str] = (),
) -> Graph:
    """The model as a `Graph` at this batch and these dims, the ``frozen`` parameters not trained and
    the ``trainable`` constants trained."""
    check_model(model)
    frozen, trainable = names_of(frozen, "frozen"), names_of(trainable, "trainable")
    bindings = dict(mapping_of(dims, "dims", "{dimension name: size}", none=True))
    if isinstance(model, Graph):
        return untrained(freeze(train(model, trainable), frozen))
    return load_model(model, batch=batch, dims=bindings, frozen=frozen, trainable=trainable)


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
        dims=dims,
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
    pipeline_stages: int | None = None,
    stage_starts: Sequence[str] = (),
    recompute: bool | None = None,
) -> Plan:
    """Search the best sharding plan for ``model`` on ``devices`` devices.

    ``mode`` is MindSpore's parallel mode: ``auto_parallel`` (search), ``data_parallel``
    (split the batch everywhere) or ``stand_alone`` (every operator whole on every device).
    ``frozen`` names parameters (or shell globs of them) that are not trained; ``trainable`` float
    constants the import took for masks or tables (`autopar.graph.build`) to train; ``overlap=False``
    adds every gradient synchronisation to the step instead of hiding it behind the backward.
    ``rank_table`` (MindSpore's rank_table.json, a path or its parsed JSON) gives the device count
    (8 by default without one) and the servers, whose shape re-derives the cost model's link levels.
    ``pipeline_stages`` (a power of two) cuts the model into that many stages, each on its own group of
    devices, and ``micro_batches`` runs the batch as that many micro-batches (1F1B across the stages,
    gradient accumulation in one); None (the default) searches both, exactly, with the strategies.
    ``stage_starts`` names the first operator of each stage after the first (fixing the cuts).
    ``recompute=True`` recomputes every repeated block's forward in the backward, as Megatron-LM's activation
    recomputation does; None (the default) recomputes only where memory binds.
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
        dims=dims,
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
        pipeline_stages=pipeline_stages,
        stage_starts=stage_starts,
        recompute=recompute,
    )
    return plan_with(model, options)


def plan_with(model: ModelLike, options: PlanOptions) -> Plan:
    """The plan for a model under checked options (`plan` with its keywords gathered)."""
    with opened():  # every cache, pool and thread the plan uses, closed when it returns
        return _plan_with(model, options)


def _plan_with(model: ModelLike, options: PlanOptions) -> Plan:
    batch, dims, frozen, fixed = options.batch, options.dims, options.frozen, options.fixed
    mode = options.mode.value
    cost = options.costs()
    started = time.perf_counter()
    progress.report("import", 0, 1)
    graph = model_graph(model, batch, dims, frozen, options.trainable)
    imported = time.perf_counter()

    def imports(micro_batches: int) -> Graph:
        size = _micro_batch(common_batch(graph), micro_batches, graph)
        return model_graph(model, size, dims, frozen, options.trainable)

    shapes = ShapeSearch(graph, options, cost, imports, rebatches=not isinstance(model, Graph))
    searched = shapes.search()
    problem, found, pipeline = searched.problem, searched.found, searched.pipeline
    if problem.graph.renamed_ops:
        pairs = ", ".join(f"{new!r}" for new in list(problem.graph.renamed_ops)[:5])
        more = f" and {len(problem.graph.renamed_ops) - 5} more" if len(problem.graph.renamed_ops) > 5 else ""
        warnings.warn(
            f"{len(problem.graph.renamed_ops)} operator(s) repeat a name used earlier in the file (ONNX"
            f" requires unique names); the plan calls them {pairs}{more}.",
            RenamedOperatorsWarning,
            stacklevel=4,  # the caller of `plan`
        )
    phases = {"import": imported - started, "costing": shapes.costing_s, "search": shapes.search_s}
    unfixed = build_problem(graph, cost, options.num_devices) if fixed and pipeline is not None else shapes.single
    free = _free_plan(problem, searched.shape, options, cost, unfixed) if fixed else None
    asked: list[Asked] = ["micro_batches"] if options.micro_batches is not None else []
    asked += ["recompute"] if options.recompute else []
    result = Plan.lower(
        problem, found, mode, phases, free, pipeline=pipeline, single=unfixed if pipeline else None, asked=asked
    )
    if result.fallback_ops:
        warnings.warn(result.fallback_summary(), FallbackWarning, stacklevel=4)
    return result


def _free_plan(
    problem: SearchProblem, shape: PipelineShape, options: PlanOptions, cost: CostModel, single: SearchProblem
) -> Plan | None:
    """With fixed strategies: the plan the search finds with nothing fixed, on the same graph (so at the
    same micro-batch size), stages and micro-batches, which the plan is compared with (None: nothing
    fits). ``single``: the whole batch on every device with nothing fixed (data parallel's problem)."""
    free = build_problem(problem.graph, cost, problem.num_devices, meet=problem.forks_meet)
    searching = SearchOptions(Mode.AUTO_PARALLEL, options.search, options.recompute)
    if shape == ONE_STAGE:
        try:
            result = run_search(free, searching)
        except InfeasibleError:
            return None
        return Plan.lower(free, result, "auto_parallel")
    starts = stage_starts(free, options.stage_starts) if options.stage_starts else None
    pipeline = search_stages(free, shape, searching, starts)
    if pipeline is None:
        return None
    found = joined(pipeline, 0.0)
    if shape.stages == 1:
        return Plan.lower(free, found, "auto_parallel")
    return Plan.lower(free, found, "auto_parallel", pipeline=pipeline, single=single)


def _micro_batch(step_batch: int | None, micro_batches: int, graph: Graph) -> int:
    if step_batch is None:
        raise AutoparError(
            f"Gradient accumulation needs a batch: the data inputs of {graph.name!r} do not share a leading size."
        )
    if step_batch % micro_batches:
        raise AutoparError(f"The batch of {step_batch} does not split into {micro_batches} equal micro-batches.")
    return step_batch // micro_batches


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
    for node, rule in enumerate(rules):
        if rule.spec.gradient_labels:  # a fork's: where its readers may meet (`costing.meeting_layouts`)
            rules[node] = rule.with_candidates(meeting_layouts(graph, rules, node))
    return {rule.op.name: [rule.in_strategy(exponents) for exponents in rule.candidates] for rule in rules}


def choice_for(problem: SearchProblem, strategies: Mapping[str, Sequence[Sequence[int]]]) -> list[int]:
    """Candidate indices for a full assignment of strategies; StrategyError on anything invalid."""
    return problem.choice_for(mapping_of(strategies, "strategies", STRATEGIES_SHAPE))


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
    """Predicted step time (the searched objective) of a full assignment of strategies, each parameter under the
    parallel optimizer where that is faster (`SearchProblem.fastest_choices`), as a plan with memory to spare
    takes it."""
    given = mapping_of(strategies, "strategies", STRATEGIES_SHAPE)
    problem = build(
        model, devices, cost_model, batch, dims, precision, frozen=frozen, overlap=overlap, rank_table=rank_table
    )
    choice = problem.choice_for(given)
    return problem.objective(choice, problem.fastest_choices(choice))
