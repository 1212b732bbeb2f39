"""Lowering: a chosen candidate per operator becomes the parts of a plan file.

Each function reads the search problem and the choice and returns typed plan-file parts:
every operator's strategy and layouts, every redistribution the dataflow needs (with its
collectives, group sizes, bytes and seconds), each parameter's gradient synchronisation,
and the totals. Seconds are rounded to 12 significant digits so plans are byte-identical
across platforms' last bits.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from autopar.cost.mesh import Mesh
from autopar.errors import PlanFileError
from autopar.graph import Graph, TensorInfo
from autopar.layout import Layout, ReduceOp
from autopar.lowering.planfile import (
    GRAPH_OUTPUT,
    CollectiveStep,
    GradientPath,
    GradientSync,
    LayoutEntry,
    LinkUse,
    MemoryPlan,
    OpCost,
    OpEntry,
    PlanContext,
    PlanFile,
    Redistribution,
    StepEntry,
    TensorLayout,
    Totals,
)
from autopar.ops.fork import FORK_DOMAIN
from autopar.redistribute import Collective, Step, redistribute
from autopar.search import ring
from autopar.search.costing import ring_windows
from autopar.search.dataflow import TensorUse
from autopar.search.driver import data_parallel_choice
from autopar.search.memory import NO_MEMORY_CHOICES, MemoryChoices
from autopar.search.problem import SearchProblem
from autopar.strategy import OpRule


def rounded(value: float) -> float:
    """Seconds and ratios printed with 12 significant digits: stable across platforms' last bits."""
    return float(f"{value:.12g}")


def optimizer_updates(
    problem: SearchProblem, choice: Sequence[int], choices: MemoryChoices = NO_MEMORY_CHOICES
) -> list[float]:
    """Per operator, seconds of the optimizer update of the trainable parameters it owns, as the search charges
    it (`CostModel.update_time`): their elements on a device, each rank's shard under a parallel optimizer."""
    found = [0.0] * problem.size
    for owned in trained_parameters(problem, choice):
        local = float(owned.layout.local_numel(owned.info.shape))
        if owned.node in choices.sharded:
            local /= 1 << len(problem.gradient_sync_bits(owned.node, owned.exponents, owned.slot))
        found[owned.node] += float(problem.cost.update_time(local))
    return found


@dataclass(frozen=True)
class OwnedParameter:
    """A trained parameter, the operator that loads it (and its input slot) and its layout in a plan."""

    info: TensorInfo
    node: int
    slot: int
    exponents: tuple[int, ...]
    layout: Layout


def trained_parameters(problem: SearchProblem, choice: Sequence[int]) -> list[OwnedParameter]:
    """Every trained parameter with the operator that owns it, in graph order of the owners."""
    found = []
    for name, (node, slot) in sorted(problem.owner.items(), key=lambda item: item[1]):
        info = problem.graph.tensor(name)
        if info.kind != "parameter" or not info.trainable:
            continue
        layout = problem.rules[node].candidate_layouts(choice[node])[0][slot]
        assert layout is not None  # an owned input is present
        found.append(OwnedParameter(info, node, slot, tuple(problem.rules[node].candidates[choice[node]]), layout))
    return found


def op_entries(
    problem: SearchProblem, choice: Sequence[int], choices: MemoryChoices = NO_MEMORY_CHOICES
) -> list[OpEntry]:
    entries = []
    updates = optimizer_updates(problem, choice, choices)
    for node, (rule, c) in enumerate(zip(problem.rules, choice)):
        time, memory = problem.node_arrays(node, choices)
        inputs, outputs = rule.candidate_layouts(c)
        entries.append(
            OpEntry(
                name=rule.op.name,
                op_type=rule.op.op_type,
                domain=rule.op.domain if rule.spec.gradient_labels else None,
                strategy=[list(s) for s in rule.in_strategy(rule.candidates[c])],
                inputs=[
                    TensorLayout(tensor=t, layout=LayoutEntry.of(lay))
                    for t, lay in zip(rule.op.inputs, inputs)
                    if t and lay is not None
                ],
                outputs=[
                    TensorLayout(tensor=t, layout=LayoutEntry.of(lay))
                    for t, lay in zip(rule.op.outputs, outputs)
                    if t and lay is not None
                ],
                cost=OpCost(
                    compute_s=rounded(float(problem.node_compute[node][c])),
                    communication_s=rounded(float(time[c] - problem.node_compute[node][c]) - updates[node]),
                    memory_bytes=int(memory[c]),
                    update_s=rounded(updates[node]) if updates[node] else None,
                ),
                fallback=rule.spec.fallback,
                fixed=True if node in problem.fixed else None,
                source=rule.op.source or None,
                fused=part.role if (part := problem.fused.get(rule.op.name)) else None,
            )
        )
    return entries


def redistributions(
    problem: SearchProblem, choice: Sequence[int], paths: Sequence[GradientPath] = ()
) -> list[Redistribution]:
    """Every producer/consumer pair whose layouts differ, with its collective steps; where the consumer is a
    fused attention product reading it round a ring, with what of it and of its gradient's way back (among
    ``paths``) runs under the product, as the search charged it (`autopar.search.ring`)."""
    found = []
    back = {path.key: path.seconds for path in paths}
    for use in problem.uses:
        src = problem.source_layout(use, choice[use.src_node])
        dst = problem.rules[use.dst_node].candidate_layouts(choice[use.dst_node])[0][use.dst_slot]
        if dst is None or src == dst:
            continue
        move = _redistribution(
            problem, use.tensor, problem.rules[use.src_node].op.name, problem.rules[use.dst_node].op.name, src, dst
        )
        if ring.reads_through(problem, use) and ring.passed_round(src, dst, ring.key_axis(problem, use.dst_node)):
            ahead, behind = ring_windows(problem, use, problem.node_compute[use.dst_node], choice[use.dst_node])
            if ahead > 0:
                hidden = min(move.seconds, ahead) + min(back.get((*move.key, use.dst_slot), 0.0), behind)
                move = move.model_copy(update={"hidden_s": rounded(hidden)})
        found.append(move)
    outputs = set(problem.graph.outputs)
    for node, rule in enumerate(problem.rules):
        for name, layout in zip(rule.op.outputs, rule.candidate_layouts(choice[node])[1]):
            if name in outputs and layout is not None and layout.partial:
                found.append(_redistribution(problem, name, rule.op.name, GRAPH_OUTPUT, layout, Layout(layout.dims)))
    return found


def _redistribution(
    problem: SearchProblem, tensor: str, producer: str, consumer: str, src: Layout, dst: Layout
) -> Redistribution:
    steps, seconds = problem.redistribution(tensor, src, dst)
    entries = [StepEntry(**entry.model_dump()) for entry in _collective_steps(problem, steps)]
    return Redistribution(
        tensor=tensor,
        producer=producer,
        consumer=consumer,
        from_=LayoutEntry.of(src),
        to=LayoutEntry.of(dst),
        steps=entries,
        seconds=rounded(seconds),
    )


def parameter_gradient_layout(
    problem: SearchProblem, name: str, choice: Sequence[int], choices: MemoryChoices = NO_MEMORY_CHOICES
) -> tuple[Layout, Layout, int | None]:
    """(layout of the owner's local gradient, layout after its synchronisation, dim a ReduceScatter splits).

    The owner's backward leaves the gradient partial over the bits of the labels the parameter
    lacks; the AllReduce makes it whole there, or, under the parallel optimizer, a
    ReduceScatter splits it over those bits on the first dimension they divide.
    """
    node, slot = problem.owner[name]
    rule = problem.rules[node]
    layout = rule.candidate_layouts(choice[node])[0][slot]
    assert layout is not None  # an owned input is present
    bits = problem.gradient_sync_bits(node, rule.candidates[choice[node]], slot)
    local = Layout(layout.dims, bits) if bits else Layout(layout.dims)
    if not bits or node not in choices.sharded:
        return local, Layout(layout.dims), None
    shape = layout.local_shape(problem.graph.tensor(name).shape)
    dim = next((d for d, size in enumerate(shape) if size % (1 << len(bits)) == 0), None)
    if dim is None:  # nothing divides: the optimizer shard is a flat slice; the gradient stays whole
        return local, Layout(layout.dims), None
    dims = tuple(b + bits if d == dim else b for d, b in enumerate(layout.dims))
    return local, Layout(dims), dim


def _collective_steps(problem: SearchProblem, steps: Sequence[Step]) -> list[CollectiveStep]:
    cost = problem.cost
    return [
        CollectiveStep(
            collective=step.kind,
            group_size=step.group_size,
            bits=list(step.bits),
            bytes=step.nbytes,
            dim=step.dim,
            concat_dim=step.concat_dim,
            reduce_op=step.reduce_op if step.reduces else None,
            seconds=rounded(cost.collective_time(step.kind, step.bits, step.nbytes)),
        )
        for step in steps
    ]


def gradient_paths(
    problem: SearchProblem, choice: Sequence[int], choices: MemoryChoices = NO_MEMORY_CHOICES
) -> list[GradientPath]:
    """Every consumer's gradient that needs collectives to reach its producer (see `GradientPath`),
    and the maxima a partial max's backward needs back where no AllReduce completed them."""
    found = []
    completed: dict[tuple[str, int], bool] = {}  # partial max/min outputs: reduced whole by some consumer?
    for use in problem.uses:
        info = problem.graph.tensor(use.tensor)
        rule = problem.rules[use.dst_node]
        if not problem.requires_grad.get(use.tensor, False) or not rule.differentiable:
            continue
        layout = rule.candidate_layouts(choice[use.dst_node])[0][use.dst_slot]
        assert layout is not None  # a use reads a present input
        produced = problem.source_layout(use, choice[use.src_node])
        if produced.partial and produced.partial_op != ReduceOp.SUM and problem.rules[use.src_node].differentiable:
            key = (use.tensor, use.src_node)
            completed[key] = completed.get(key, False) or layout == Layout(produced.dims)
        bits = problem.gradient_sync_bits(use.dst_node, rule.candidates[choice[use.dst_node]], use.dst_slot)
        source = Layout(layout.dims, bits) if bits else Layout(layout.dims)
        if info.kind == "parameter":
            target = parameter_gradient_layout(problem, use.tensor, choice, choices)[1]
            itemsize = problem.cost.gradient_itemsize()
        else:
            producer = problem.rules[use.src_node]  # a fork may take it partial (`autopar.ops.fork`)
            exponents = producer.candidates[choice[use.src_node]]
            target = producer.gradient_target(exponents, use.src_slot) if use.src_is_output else Layout(produced.dims)
            itemsize = problem.itemsize(info)
        entries = _collective_steps(problem, redistribute(source, target, info.shape, itemsize))
        if entries:
            found.append(_path(problem, use, source, target, entries))
    outputs = set(problem.graph.outputs)
    for (tensor, node), whole in completed.items():
        if whole or tensor in outputs:  # a graph output's AllReduce completes it too
            continue
        use = next(u for u in problem.uses if (u.tensor, u.src_node) == (tensor, node))
        held = problem.rules[use.dst_node].input_layout(choice[use.dst_node], use.dst_slot)
        produced = problem.source_layout(use, choice[node])
        info = problem.graph.tensor(tensor)
        steps = redistribute(held, Layout(produced.dims), info.shape, problem.itemsize(info))
        found.append(
            _path(problem, use, held, Layout(produced.dims), _collective_steps(problem, steps), produced.partial_op)
        )
    return found


def _path(
    problem: SearchProblem,
    use: TensorUse,
    source: Layout,
    target: Layout,
    steps: list[CollectiveStep],
    maximum: ReduceOp | None = None,
) -> GradientPath:
    return GradientPath(
        tensor=use.tensor,
        producer=problem.rules[use.src_node].op.name,
        consumer=problem.rules[use.dst_node].op.name,
        slot=use.dst_slot,
        carries=str(maximum) if maximum is not None else None,
        from_=LayoutEntry.of(source),
        to=LayoutEntry.of(target),
        steps=steps,
        seconds=rounded(sum(step.seconds for step in steps)),
    )


def gradient_sync(
    problem: SearchProblem, choice: Sequence[int], choices: MemoryChoices = NO_MEMORY_CHOICES
) -> list[GradientSync]:
    """The AllReduce of each trainable parameter over the bits its gradient is partial on (with a
    parallel optimizer: a ReduceScatter, and after the update an AllGather of the weights)."""
    cost = problem.cost
    entries = []
    for owned in trained_parameters(problem, choice):
        info, node, slot, exponents, layout = owned.info, owned.node, owned.slot, owned.exponents, owned.layout
        name = info.name
        bits = problem.gradient_sync_bits(node, exponents, slot)
        nbytes = layout.local_numel(info.shape) * cost.gradient_itemsize()
        sharded = node in choices.sharded and bool(bits)
        dim = parameter_gradient_layout(problem, name, choice, choices)[2] if sharded else None
        # where no dimension divides, the optimizer state is a flat slice and the gradient is summed whole
        # (an AllReduce costs what the ReduceScatter and the AllGather after the update cost together)
        kind = Collective.REDUCE_SCATTER if sharded and dim is not None else Collective.ALL_REDUCE
        seconds = cost.gradient_sync_time(bits, nbytes, kind) if bits else 0.0
        if kind == Collective.REDUCE_SCATTER:
            seconds += cost.gradient_sync_time(bits, nbytes, Collective.ALL_GATHER)
        entries.append(
            GradientSync(
                parameter=name,
                op=problem.rules[node].op.name,
                layout=LayoutEntry.of(layout),
                collective=kind.value if bits else None,
                bits=list(bits),
                group_size=1 << len(bits),
                bytes=nbytes if bits else 0,
                seconds=rounded(seconds),
                optimizer_shards=1 << len(bits) if sharded else None,
                dim=dim,
            )
        )
    return entries


def training_flops(problem: SearchProblem) -> float:
    """Forward FLOPs plus the backward passes the cost model charges (inputs needing gradients); a fused
    attention's products count the scores a causal kernel computes, and not the scores' product run again."""
    total = 0.0
    for node, rule in enumerate(problem.rules):
        if rule.spec.op_class != "free":
            part = problem.fused.get(rule.op.name)
            share = part.share if part is not None and part.role != "inner" else 1.0
            total += rule.op.flops * share * (1.0 + problem.cost.backward_factor * problem.backward_passes(node))
    return float(total)


def memory_breakdown(
    problem: SearchProblem, choice: Sequence[int], choices: MemoryChoices = NO_MEMORY_CHOICES
) -> dict[str, int]:
    """Bytes per device by what holds them (the keys of `Totals.memory_breakdown`)."""
    keys = {"parameter": "parameter_state", "activation": "activations", "input": "inputs"}
    found = dict.fromkeys(keys.values(), 0.0)
    for node, c in enumerate(choice):
        for _, role, nbytes in problem.memory_items(node, c, choices):
            found[keys[role]] += nbytes
    return {key: round(value) for key, value in found.items()}


def gradient_sync_seconds(
    problem: SearchProblem, choice: Sequence[int], choices: MemoryChoices = NO_MEMORY_CHOICES
) -> float:
    """Every parameter's gradient synchronisation, hidden or not (as `gradient_sync` lists it)."""
    return sum(entry.seconds for entry in gradient_sync(problem, choice, choices))


def plan_context(problem: SearchProblem) -> PlanContext:
    graph = problem.graph
    # optional numbers a profile leaves out (no fused attention, no FP8) do not change the hash of one that has none
    profile = hashlib.sha256(problem.cost.profile.model_dump_json(exclude_none=True).encode()).hexdigest()[:16]
    return PlanContext(
        model_fingerprint=graph.fingerprint,
        inputs={name: list(graph.tensor(name).shape) for name in graph.inputs},
        cost_model_fingerprint=profile,
    )


def check_context(plan: PlanFile, graph: Graph, devices: int, action: str = "verify") -> None:
    """PlanFileError, in one sentence, when ``plan`` was made for another model, batch or device count: what its
    file records of them (its context, absent in old files), then each operator against the model's."""
    if plan.devices != devices:
        raise PlanFileError(f"The plan is for {plan.devices} devices, so it cannot {action} on {devices}.")
    if plan.context is not None:
        check_recorded(plan, plan.context, graph)
    _check_operators(plan, graph)


def check_recorded(plan: PlanFile, context: PlanContext, graph: Graph) -> None:
    """The model's input shapes and fingerprint are those the plan records. Where the same inputs have other
    sizes, that is said first: a model imported at another batch may also differ in the constants the batch
    shapes, which the fingerprint spells, and it is the same model at another batch, not another model."""
    shapes = {name: list(graph.tensor(name).shape) for name in graph.inputs}
    if context.inputs != shapes and _only_batches_differ(context.inputs, shapes):
        differ = next(name for name in shapes if context.inputs[name] != shapes[name])
        planned = context.inputs[differ]
        advice = "plan again with this batch"
        if plan.memory_plan.micro_batches > 1 and planned:
            micro = plan.memory_plan.micro_batches
            whole = planned[0] * micro
            advice = f"its shapes are one of {micro} micro-batches: leave --batch out, or give the whole {whole}"
        raise PlanFileError(
            f"The plan was made for input {differ!r} of shape {planned}, not {shapes[differ]} (a plan searched at"
            f" one batch does not hold at another); {advice}."
        )
    if context.model_fingerprint != graph.fingerprint:
        raise PlanFileError(
            f"The plan was made for another model ({plan.model!r}, fingerprint {context.model_fingerprint}),"
            f" not this {graph.name!r} ({graph.fingerprint})."
        )
    extra = next((name for name in context.inputs if name not in shapes), None)
    if extra is not None:
        raise PlanFileError(f"The plan was made for a model with input {extra!r}, which {graph.name!r} lacks.")


def _only_batches_differ(planned: Mapping[str, Sequence[int]], shapes: Mapping[str, Sequence[int]]) -> bool:
    """The same inputs, each of the same shape but maybe its leading size (the batch).

    >>> _only_batches_differ({"x": [2, 16]}, {"x": [8, 16]}), _only_batches_differ({"x": [4, 32]}, {"x": [4, 224]})
    (True, False)
    """
    if set(planned) != set(shapes):
        return False
    return all(
        len(planned[name]) == len(shape) and list(planned[name][1:]) == list(shape[1:])
        for name, shape in shapes.items()
    )


def _check_operators(plan: PlanFile, graph: Graph) -> None:
    """Every operator of the plan is the model's, of its type, with a strategy of its inputs' shape, and every
    operator of the model has one."""
    ops = {op.name: op for op in graph.ops}
    for entry in plan.ops:
        op = ops.get(entry.name)
        if op is None:
            raise PlanFileError(
                f"The plan lists operator {entry.name!r} ({entry.op_type}), which model {graph.name!r} does not"
                f" have: the plan was made for another model ({plan.model!r}) or edited."
            )
        if op.op_type != entry.op_type:
            raise PlanFileError(
                f"The plan's operator {entry.name!r} is a {entry.op_type}, but in model {graph.name!r} it is a"
                f" {op.op_type}."
            )
        rule = OpRule.build(op, graph, plan.mesh_bits)
        ranks = [len(splits) for splits in rule.in_strategy(rule.stand_alone)]
        if [len(splits) for splits in entry.strategy] != ranks:
            raise PlanFileError(
                f"The plan's strategy {entry.strategy} for {entry.name!r} ({entry.op_type}) does not fit model"
                f" {graph.name!r}, whose operator's inputs have ranks {ranks}."
            )
    planned = {entry.name for entry in plan.ops}
    # (a plan from before autopar inserted forks lists none: the exporters drop them all the same)
    missing = [op.name for op in graph.ops if op.name not in planned and op.domain != FORK_DOMAIN]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise PlanFileError(
            f"The plan has no strategy for operator {missing[0]!r}{more} of model {graph.name!r}: it was made for"
            f" another model ({plan.model!r}) or edited."
        )


def mesh_links(mesh: Mesh) -> list[LinkUse]:
    """The mesh's link levels as the plan file lists them (levels the mesh does not reach are left out)."""
    return [LinkUse(name=level.name, bits=list(level.bits)) for level in mesh.levels]


def memory_plan(problem: SearchProblem, choice: Sequence[int], choices: MemoryChoices) -> MemoryPlan:
    names = [entry.parameter for entry in gradient_sync(problem, choice, choices) if entry.optimizer_shards]
    recomputed = [problem.rules[repeat.start].op.name for repeat, _ in problem.folds] if choices.recompute else []
    return MemoryPlan(parallel_optimizer=names, recompute=recomputed, micro_batches=choices.micro_batches)


def totals(
    problem: SearchProblem,
    choice: Sequence[int],
    choices: MemoryChoices = NO_MEMORY_CHOICES,
    free: tuple[SearchProblem, float] | None = None,
) -> Totals:
    """The plan's figures for a whole step (with k micro-batches: k micro-steps, one gradient sync).

    ``free`` (with fixed strategies): the problem with nothing fixed and the step of its searched plan;
    data parallel is then that problem's (a fixed operator's one candidate is not data parallel), and
    the fixed strategies' cost is this step minus the free one.
    """
    k = choices.micro_batches
    compute = sum(float(problem.node_compute[i][c]) for i, c in enumerate(choice))
    if choices.recompute:
        compute += sum(float(problem.recompute_time[i][c]) for i, c in enumerate(choice) if i in problem.recompute_time)
    compute *= k
    step = problem.objective(choice, choices)
    update = sum(optimizer_updates(problem, choice, choices))  # once a step, whatever the micro-batches
    unfixed = free[0] if free is not None else problem
    data_parallel = unfixed.objective(data_parallel_choice(unfixed), MemoryChoices(micro_batches=k))
    flops = training_flops(problem) * k
    return Totals(
        step_time_s=rounded(step),
        compute_s=rounded(compute),
        communication_s=rounded(max(0.0, step - compute - update)),  # no -0.0 from the last bits
        hidden_communication_s=rounded(problem.hidden(choice, choices)),
        gradient_sync_s=rounded(gradient_sync_seconds(problem, choice, choices)),
        optimizer_update_s=rounded(update),
        memory_per_device_bytes=round(problem.memory(choice, choices)),
        memory_capacity_bytes=int(problem.cost.device_capacity),
        memory_reserve_bytes=int(problem.cost.memory_reserve),
        memory_breakdown=memory_breakdown(problem, choice, choices),
        training_flops=flops,
        ideal_step_time_s=rounded(flops / (problem.num_devices * problem.cost.peak_flops)),
        data_parallel_step_time_s=rounded(data_parallel),
        speedup_vs_data_parallel=rounded(data_parallel / step) if step > 0 else 1.0,
        free_step_time_s=rounded(free[1]) if free is not None else None,
        fixed_cost_s=rounded(step - free[1]) if free is not None else None,
    )
