"""The program a plan describes: what verifying or running it reads, and nothing of the search.

A `PlanProgram` is frozen: the graph, each operator with its chosen strategy and layouts
(`PlannedOp`), which rank loads each parameter and which tensors carry a gradient, and the
collectives the plan lists (forward redistributions, backward gradient paths, gradient
synchronisation). The SPMD verifier and the torch runtime execute it; they never see costs.

It comes from a searched problem (`program_of`: a `Plan`, or a full assignment of strategies
scored on its problem) or from a plan file alone (`program_from_file`): a plan file lists every
collective already, so reading it builds the operators' rules and nothing is costed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from types import MappingProxyType

import onnx

from autopar.cost.mesh import Mesh
from autopar.cost.model import CostModel
from autopar.errors import AutoparError, PlanFileError, StrategyError
from autopar.graph import Graph, TensorInfo, gradient_reaches, load_model
from autopar.graph.proto import data_inputs
from autopar.graph.read import read_model
from autopar.layout import Layout
from autopar.lowering.lower import check_context, check_recorded, gradient_paths, gradient_sync, redistributions
from autopar.lowering.planfile import GradientPath, GradientSync, PlanFile, Redistribution
from autopar.search.problem import SearchProblem
from autopar.strategy import OpRule


@dataclass(frozen=True)
class PlannedOp:
    """One operator as the plan runs it: its rule (spec, kernels), the chosen exponents, the
    layouts they give, and per input the mesh bits its gradient comes out partial on."""

    rule: OpRule
    exponents: tuple[int, ...]
    inputs: tuple[Layout | None, ...]
    outputs: tuple[Layout | None, ...]
    gradient_bits: tuple[tuple[int, ...], ...]

    @property
    def name(self) -> str:
        return self.rule.op.name

    def input_layout(self, slot: int) -> Layout:
        """The layout this operator reads a present input in."""
        layout = self.inputs[slot]
        if layout is None:
            raise ValueError(f"operator {self.name!r} has no input {slot}")
        return layout


@dataclass(frozen=True)
class PlanProgram:
    """A plan as the verifiers execute it (see the module docstring); built by lowering only."""

    graph: Graph
    ops: tuple[PlannedOp, ...]
    num_devices: int
    mesh_bits: int
    owner: Mapping[str, tuple[int, int]]  # parameter or input -> (operator, slot) that loads it
    requires_grad: Mapping[str, bool]
    activation_itemsizes: Mapping[str, int]  # element type -> bytes as the device computes it
    gradient_itemsize: int
    redistributions: tuple[Redistribution, ...]
    gradients: tuple[GradientPath, ...]
    gradient_sync: tuple[GradientSync, ...]

    def itemsize(self, tensor: TensorInfo) -> int:
        """Bytes of one element of ``tensor`` in a collective (the plan's precision)."""
        return self.activation_itemsizes[tensor.dtype]

    def op(self, name: str) -> PlannedOp:
        """The planned operator of this name."""
        return self._by_name[name]

    @cached_property
    def _by_name(self) -> Mapping[str, PlannedOp]:
        return {planned.name: planned for planned in self.ops}

    def producer_of(self, name: str) -> str:
        """The operator holding a non-constant tensor first: its producer, or the one that loads it."""
        info = self.graph.tensor(name)
        if info.kind == "activation":
            return self.graph.producer[name]
        return self.ops[self.owner[name][0]].name


def program_of(
    problem: SearchProblem, choice: Sequence[int], file: PlanFile | None = None, mesh: Mesh | None = None
) -> PlanProgram:
    """The program of ``choice`` on its searched problem; its collectives are ``file``'s (a `Plan`'s
    own file, with its ``mesh``) or, for a bare assignment of strategies, lowered here without memory
    choices."""
    ops = []
    for node, (rule, c) in enumerate(zip(problem.rules, choice)):
        exponents = rule.candidates[c]
        bits = [
            problem.gradient_sync_bits(node, exponents, slot) if name else ()
            for slot, name in enumerate(rule.op.inputs)
        ]
        ops.append(_planned(rule, exponents, bits))
    if file is not None:
        moves, paths, syncs = file.redistributions, file.gradients, file.gradient_sync
    else:
        moves, paths = redistributions(problem, choice), gradient_paths(problem, choice)
        syncs = gradient_sync(problem, choice)
    mesh = mesh or Mesh.of(problem.cost, problem.num_devices)
    return _program(problem.graph, ops, mesh, problem.owner, problem.requires_grad, problem.cost, moves, paths, syncs)


def program_from_file(
    graph: Graph, plan: PlanFile, devices: int, cost: CostModel, mesh: Mesh | None = None
) -> PlanProgram:
    """The program a plan file lists for ``graph`` on ``devices``; ``cost`` gives the element sizes;
    ``mesh``: the devices it runs on, when not the plan's whole mesh (one pipeline stage's).

    A plan made for another model, batch or device count is refused first (PlanFileError, one
    sentence); then each operator's rule is built and its strategy read. Nothing is costed.
    """
    check_context(plan, graph, devices)
    mesh = mesh or plan.mesh
    rules = [OpRule.build(op, graph, mesh.mesh_bits) for op in graph.ops]
    ops = []
    for rule, exponents in zip(rules, exponents_for(rules, plan.strategies)):
        bits = [gradient_bits(rule, exponents, slot) if name else () for slot, name in enumerate(rule.op.inputs)]
        ops.append(_planned(rule, exponents, bits))
    owner, requires_grad = owners(graph, rules), gradient_reaches(graph)
    return _program(
        graph, ops, mesh, owner, requires_grad, cost, plan.redistributions, plan.gradients, plan.gradient_sync
    )


def plan_graph(
    plan: PlanFile,
    model: str | Path | onnx.ModelProto,
    batch: int | None = None,
    dims: Mapping[str, int] | None = None,
    *,
    frozen_from_sync: bool = True,
) -> Graph:
    """``model`` imported as ``plan`` was made for it: its input shapes bound (at ``batch`` and ``dims`` instead,
    where given: `check_context` then says what differs), the parameters it trains trained and the others frozen
    (`trained_as_planned`); PlanFileError (one sentence) if the plan was made for another model."""
    planned, planned_dims = _bindings(plan, read_model(model))
    if batch is not None and _is_whole_batch(plan, batch):
        batch = None  # the whole batch given for a plan of one of its micro-batches: the plan's own shapes
    graph = trained_as_planned(
        plan, model, batch or planned, {**planned_dims, **(dims or {})}, frozen_from_sync=frozen_from_sync
    )
    if plan.context is not None:
        check_recorded(plan, plan.context, graph)
    return graph


def trained_as_planned(
    plan: PlanFile,
    model: str | Path | onnx.ModelProto,
    batch: int | None,
    sizes: Mapping[str, int],
    *,
    frozen_from_sync: bool = True,
) -> Graph:
    """``model`` imported at ``batch`` and its symbolic ``sizes``, training the parameters ``plan`` trains. With
    ``frozen_from_sync`` (the trainer, the exports) every parameter its gradient synchronisation does not list
    is frozen; without (verification) only those the plan file lists as ``frozen`` are, so that a plan which
    lost a parameter's synchronisation is not taken for one that freezes it."""
    trained, dims = {entry.parameter for entry in plan.gradient_sync}, dict(sizes)
    try:
        graph = load_model(model, batch=batch, dims=dims)
        if frozen_from_sync:
            frozen = [t.name for t in graph.parameters if t.trainable and t.name not in trained]
        else:  # what the plan file says it froze, no more
            frozen = [t.name for t in graph.parameters if t.trainable and t.name in (plan.frozen or ())]
        made_trainable = [name for name in trained if name in graph.tensors and graph.tensor(name).kind == "constant"]
        if (plan.gradient_sync or not frozen_from_sync) and (frozen or made_trainable):
            graph = load_model(model, batch=batch, dims=dims, frozen=frozen, trainable=made_trainable)
    except AutoparError as exc:
        raise PlanFileError(f"The model cannot be read with the plan's input shapes: {exc}") from None
    return graph


def _is_whole_batch(plan: PlanFile, batch: int) -> bool:
    """Whether ``batch`` is the whole batch of a plan made for one of several micro-batches (its operators'
    shapes are a micro-batch's)."""
    micro, size = plan.memory_plan.micro_batches, planned_batch(plan)
    return micro > 1 and size is not None and batch == size * micro


def planned_batch(plan: PlanFile) -> int | None:
    """The batch a plan file's operators were made for (one micro-batch's, where it has several): its data
    inputs' common leading size (None: they share none, or the file records no shapes)."""
    shapes = list(plan.context.inputs.values()) if plan.context else []
    return shapes[0][0] if shapes and shapes[0] and all(s and s[0] == shapes[0][0] for s in shapes) else None


def _bindings(plan: PlanFile, model: onnx.ModelProto) -> tuple[int | None, dict[str, int]]:
    """The batch and symbolic sizes that give the model's data inputs the plan's shapes."""
    batch: int | None = None
    dims: dict[str, int] = {}
    if plan.context is None:
        return batch, dims
    for info in data_inputs(model):
        planned = plan.context.inputs.get(info.name)
        if not planned or not info.type.HasField("tensor_type"):
            continue
        for axis, (dim, size) in enumerate(zip(info.type.tensor_type.shape.dim, planned)):
            if dim.HasField("dim_param") and dim.dim_param:
                dims[dim.dim_param] = size
            elif axis == 0 and dim.dim_value != size:  # a different batch, or a placeholder (0, -1)
                batch = size
    return batch, dims


def exponents_for(rules: Sequence[OpRule], strategies: Mapping[str, Sequence[Sequence[int]]]) -> list[tuple[int, ...]]:
    """Each operator's exponents under a full assignment of strategies; StrategyError on anything invalid."""
    names = {rule.op.name for rule in rules}
    unknown = sorted(set(strategies) - names)
    if unknown:
        raise StrategyError(f"Strategies name operators the model does not have: {', '.join(unknown[:5])}.")
    missing = [rule.op.name for rule in rules if rule.op.name not in strategies]
    if missing:
        raise StrategyError(f"No strategy given for {len(missing)} operator(s), e.g. {missing[0]!r}.")
    return [rule.parse(strategies[rule.op.name]) for rule in rules]


def gradient_bits(rule: OpRule, exponents: Sequence[int], slot: int) -> tuple[int, ...]:
    """Bits over which input ``slot``'s gradient comes out partial: the split labels it lacks
    (as the search's `SearchProblem.gradient_sync_bits` charges them)."""
    labels = rule.spec.inputs[slot] or ()
    bits = rule.label_bits(exponents)
    return tuple(
        sorted((b for label in rule.spec.label_order if label not in labels for b in bits[label]), reverse=True)
    )


def owners(graph: Graph, rules: Sequence[OpRule]) -> dict[str, tuple[int, int]]:
    """The (operator, slot) that loads each parameter and data input: its first reader."""
    found: dict[str, tuple[int, int]] = {}
    for node, rule in enumerate(rules):
        for slot, name in enumerate(rule.op.inputs):
            if name and graph.tensor(name).kind not in ("constant", "activation"):
                found.setdefault(name, (node, slot))
    return found


def _planned(rule: OpRule, exponents: tuple[int, ...], bits: Sequence[tuple[int, ...]]) -> PlannedOp:
    return PlannedOp(
        rule,
        tuple(exponents),
        tuple(rule.input_layouts(exponents)),
        tuple(rule.output_layouts(exponents)),
        tuple(tuple(b) for b in bits),
    )


def _program(
    graph: Graph,
    ops: Sequence[PlannedOp],
    mesh: Mesh,
    owner: Mapping[str, tuple[int, int]],
    requires_grad: Mapping[str, bool],
    cost: CostModel,
    moves: Sequence[Redistribution],
    paths: Sequence[GradientPath],
    syncs: Sequence[GradientSync],
) -> PlanProgram:
    dtypes = sorted({info.dtype for info in graph.tensors.values()})
    return PlanProgram(
        graph,
        tuple(ops),
        mesh.num_devices,
        mesh.mesh_bits,
        MappingProxyType(dict(owner)),
        MappingProxyType(dict(requires_grad)),
        MappingProxyType({dtype: cost.activation_itemsize(dtype) for dtype in dtypes}),
        cost.gradient_itemsize(),
        tuple(moves),
        tuple(paths),
        tuple(syncs),
    )
