"""One micro-batch of a plan on one rank of the user's module: every unit in order, every read moved as planned.

`RankProgram` is built once per rank from the plan's program (`autopar.lowering.program.PlanProgram`),
its collectives (`autopar.runtime.program.Schedule`) and the module's map (`autopar.torch.mapping`), and
checks everything it can before anything runs: that each listed move leads where the reader needs the
tensor, that each gradient path leads where its producer sums. `forward` then runs one micro-batch:

- a tensor computed on this stage is kept in the layout its writer leaves it in, keyed (tensor, writer)
  as the plan names it, and moved for each reader by a `Move` (`autopar.torch.moves`);
- a data input is sliced by the operator that loads it, and moved from there for its other readers;
- a parameter is loaded once (`Load`: as stored, or gathered by the parallel optimizer) for its owner,
  whose gradient is then synchronised as planned, and read by its other readers through
  `ParameterRead`; with ``defer_sync`` the owners' gradients wait in ``unsynced`` for `synchronise`;
- a constant is sliced by each reader.

A unit runs as the module's ATen call on its shards (`autopar.torch.local`). A node whose operators move
a tensor between them (a bias added after the AllReduce of a split contraction) runs as those operators
instead, each with autopar's own local kernel (`autopar.runtime.local`), the moves between them as planned.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
import torch
import torch.fx

from autopar.layout import Layout, ReduceOp
from autopar.lowering.planfile import GRAPH_OUTPUT
from autopar.lowering.program import PlannedOp, PlanProgram
from autopar.ops.elementwise import dropout_draws
from autopar.ops.fork import FORK_DOMAIN
from autopar.redistribute import Collective, Step, redistribute
from autopar.runtime.local import run_local
from autopar.runtime.program import PlanBroken, Schedule, follow
from autopar.torch import local as shards
from autopar.torch.dropout import drawn_apart, draws, dropout_arguments, dropped, keep_mask
from autopar.torch.mapping import (
    DerivedUnit,
    ForkUnit,
    MappingError,
    ModuleMap,
    NodeUnit,
    Read,
    WholeUnit,
    inverse,
    reads_metadata_only,
)
from autopar.torch.moves import Move, Mover, ParameterRead


class PlanMismatch(MappingError):
    """The plan's moves do not lead where the module's nodes need their tensors."""


@dataclass(frozen=True)
class ReadPlan:
    """A `Read` resolved: where its value comes from and what moves it there and its gradient back."""

    read: Read
    kind: str  # activation, input, parameter, constant or received (from an earlier stage)
    producer: str  # the operator holding the source (a parameter's or input's owner)
    layout: Layout  # the reader's layout
    forward: tuple[Step, ...]
    backward: tuple[Step, ...]
    masked: tuple[int, ...]  # bits the gradient is made partial over after its steps
    owner: bool  # this read loads the input or parameter
    itemsize: int  # bytes per element of the tensor, as the plan counts them
    gradient_itemsize: int


@dataclass(frozen=True)
class NodePlan:
    """A `NodeUnit` resolved: its reads, output layouts and local shapes, and how it runs."""

    unit: NodeUnit
    node: torch.fx.Node
    reads: tuple[ReadPlan, ...]
    layouts: tuple[Layout | None, ...]  # per output
    local_shapes: tuple[tuple[int, ...] | None, ...]
    as_operators: bool  # runs as the plan's operators (their own kernels), not as the node's ATen call
    once: frozenset[str]  # arguments added by the first rank of each partial group only
    divisor: int  # a local mean's divisor


def _follow(source: Layout, steps: tuple[Step, ...], target: Layout, what: str) -> tuple[int, ...]:
    """`autopar.runtime.program.follow`, its refusal as this module's error (one sentence)."""
    try:
        return follow(source, steps, target, what)
    except PlanBroken as exc:
        text = str(exc)
        raise PlanMismatch(f"{text[:1].upper()}{text[1:]}.") from None


@dataclass
class Held:
    layout: Layout
    value: torch.Tensor


def folded_nodes(
    mapping: ModuleMap, program: PlanProgram, nodes: Mapping[str, torch.fx.Node], stage_ops: frozenset[int] | None
) -> frozenset[str]:
    """The nodes computing the folded weights (`ModuleMap.derived`) that the operators ``stage_ops`` read (None:
    every operator), and every node they are computed from, the module's parameter placeholders among them;
    another stage's folded weights are its own to compute and train."""
    wanted = [
        node for tensor, node in mapping.derived.items() if stage_ops is None or program.owner[tensor][0] in stage_ops
    ]
    found: set[str] = set()
    while wanted:
        name = mapping.node_of.get(wanted.pop(), "")
        if name in nodes and name not in found:
            found.add(name)
            wanted += [arg.name for arg in nodes[name].all_input_nodes]
    return frozenset(found)


def folded_keys(mapping: ModuleMap, nodes: frozenset[str]) -> frozenset[str]:
    """What the placeholders among ``nodes`` (`folded_nodes`) are: the module's parameters by state_dict key (and
    data inputs by name, which no caller holds as parameters)."""
    return frozenset(mapping.placeholders[n] for n in nodes if n in mapping.placeholders)


@dataclass
class RankProgram:
    """One rank's share of the plan on the module (see the module docstring)."""

    program: PlanProgram
    schedule: Schedule
    mapping: ModuleMap
    graph_module: torch.fx.GraphModule
    mover: Mover
    stage_ops: frozenset[int] | None = None  # this rank's stage (None: every operator)
    defer_sync: bool = False
    units: list[Any] = field(default_factory=list)
    unsynced: dict[str, torch.Tensor] = field(default_factory=dict)
    gathered: dict[str, torch.Tensor] = field(default_factory=dict)  # parallel-optimizer loads, once a step
    constants: dict[tuple[str, Layout], torch.Tensor] = field(default_factory=dict)  # this rank's slices of them
    by_operators: int = 0  # nodes that run as the plan's operators (see the module docstring)
    derived_mover: Mover | None = None  # counts the reductions of folded weights' gradients (`DerivedUnit`)
    seed: int = 0  # dropout's masks' (`autopar.torch.dropout`)

    def __post_init__(self) -> None:
        self.nodes = {node.name: node for node in self.graph_module.graph.nodes}
        self.draws = draws(list(self.graph_module.graph.nodes))  # dropouts that draw a mask -> their place
        apart = next(filter(None, map(drawn_apart, self.graph_module.graph.nodes)), None)
        if apart is not None:
            raise PlanMismatch(apart)
        self.rank = self.mover.rank
        self.syncs = {entry.parameter: entry.step() for entry in self.program.gradient_sync}
        for unit in self.mapping.units:
            if isinstance(unit, NodeUnit):
                if self.stage_ops is not None and not set(unit.ops) <= self.stage_ops:
                    if set(unit.ops) & self.stage_ops:
                        raise PlanMismatch(f"Module node {unit.node!r} is cut between two pipeline stages.")
                    continue
                plan = self._node_plan(unit)
                self._check_drawn(plan)
                self.by_operators += plan.as_operators
                self.units.append(plan)
            elif isinstance(unit, ForkUnit):
                if self.stage_ops is None or unit.op in self.stage_ops:
                    self.units.append((unit, self._fork_read(unit)))
            elif not isinstance(unit, DerivedUnit) or unit.node in self.derived_nodes:
                self.units.append(unit)
        for name in self.mapping.derived:
            if self.mapping.parameters.get(name) is not None:
                raise PlanMismatch(f"{name!r} is both a parameter and computed from parameters.")
        paired = {unit.node for unit in self.mapping.units if isinstance(unit, NodeUnit)}
        unpaired = sorted(set(self.draws) - paired, key=self.draws.__getitem__)
        if unpaired:
            raise PlanMismatch(f"Module node {unpaired[0]!r} drops elements, but no Dropout of the plan is its.")

    def _check_drawn(self, plan: NodePlan) -> None:
        """A node run as the plan's operators draws no mask: refused where it should (its node drops, or one of
        its operators is a Dropout that trains: the plan's kernel keeps every element)."""
        program = self.program
        drops = plan.unit.node in self.draws or any(
            dropout_draws(program.ops[index].rule.op, program.graph) for index in plan.unit.ops
        )
        if plan.as_operators and drops:
            raise PlanMismatch(f"Module node {plan.unit.node!r} drops elements, but would run as operators.")

    @cached_property
    def derived_nodes(self) -> frozenset[str]:
        """The folded weights' nodes this rank computes (`folded_nodes` of its stage)."""
        return folded_nodes(self.mapping, self.program, self.nodes, self.stage_ops)

    @cached_property
    def folded_parameters(self) -> frozenset[str]:
        """The module's parameters (state_dict keys) the folded weights this rank computes are computed from."""
        return folded_keys(self.mapping, self.derived_nodes)

    # --- building ---------------------------------------------------------------------------

    def _node_plan(self, unit: NodeUnit) -> NodePlan:
        program = self.program
        reads = tuple(self._read_plan(read) for read in unit.reads)
        layouts = tuple(
            program.ops[writer].outputs[program.ops[writer].rule.op.outputs.index(t)] if t else None
            for t, writer in unit.outputs
        )
        shapes = tuple(
            layout.local_shape(program.graph.tensor(tensor).shape) if tensor and layout is not None else None
            for (tensor, _), layout in zip(unit.outputs, layouts)
        )
        shares = any(out in self.mapping.shared for index in unit.ops for out in program.ops[index].rule.op.outputs)
        as_operators = self._moves_inside(unit) or self._reads_twice(reads) or shares
        as_operators = as_operators or any(not plan.read.arg for plan in reads) or self._splits_unread(unit, reads)
        as_operators = as_operators or unit.merged
        for index in unit.ops:
            why = shards.unsupported(program.ops[index])
            if why is not None:
                as_operators = True
        once = frozenset(
            plan.read.arg
            for plan in reads
            if plan.read.slot in program.ops[plan.read.consumer].rule.spec.local_once_inputs
        )
        writer = program.ops[unit.outputs[0][1]] if unit.outputs else None
        divisor = shards.mean_divisor(writer) if writer is not None else 1
        if (
            not as_operators
            and len(unit.ops) > 1
            and any(
                shards.mean_divisor(program.ops[index]) > 1 or program.ops[index].rule.spec.local_once_inputs
                for index in unit.ops
                if program.ops[index] is not writer
            )
        ):
            as_operators = True
        return NodePlan(unit, self.nodes[unit.node], reads, layouts, shapes, as_operators, once, divisor)

    def _moves_inside(self, unit: NodeUnit) -> bool:
        """Whether the plan moves a tensor between the node's own operators."""
        program = self.program
        mine = {program.ops[index].name for index in unit.ops}
        for index in unit.ops:
            planned = program.ops[index]
            for slot, name in enumerate(planned.rule.op.inputs):
                if not name or program.graph.tensor(name).kind != "activation":
                    continue
                producer = program.graph.producer[name]
                if producer not in mine:
                    continue
                written = program.op(producer).outputs[program.op(producer).rule.op.outputs.index(name)]
                if written != planned.input_layout(slot) or self.schedule.forward.get((name, producer, planned.name)):
                    return True
                if self.schedule.backward.get((name, producer, planned.name, slot)):
                    return True
        return False

    def _splits_unread(self, unit: NodeUnit, reads: tuple[ReadPlan, ...]) -> bool:
        """Whether the node's operators read a constant the plan splits that no argument of the node's call is: the
        call computes that value whole, where the rank holds a shard (T5's labels shifted right put a start token
        the module fills in for the whole batch, a constant the exporter stored, into each row the rank holds)."""
        program, paired = self.program, {plan.read.tensor for plan in reads}
        return any(
            name not in paired
            and program.graph.tensor(name).kind == "constant"
            and program.ops[index].input_layout(slot).split_bits
            for index in unit.ops
            for slot, name in enumerate(program.ops[index].rule.op.inputs)
            if name
        )

    @staticmethod
    def _reads_twice(reads: tuple[ReadPlan, ...]) -> bool:
        """Whether one argument is read by two operators of the node in two ways (layouts, or moves of their own)."""
        seen: dict[str, ReadPlan] = {}
        for plan in reads:
            first = seen.setdefault(plan.read.arg, plan)
            if first is plan:
                continue
            if (
                plan.layout != first.layout
                or plan.forward
                or plan.backward
                or plan.read.permutation != first.read.permutation
            ):
                return True
        return False

    def _read_plan(self, read: Read) -> ReadPlan:
        program, schedule = self.program, self.schedule
        name = read.tensor
        info = program.graph.tensor(name)
        consumer = program.ops[read.consumer]
        layout = consumer.input_layout(read.slot)
        itemsize = program.itemsize(info)
        gradient_itemsize = program.gradient_itemsize if info.kind == "parameter" else itemsize
        bits = consumer.gradient_bits[read.slot]
        source = Layout(layout.dims, bits) if bits else Layout(layout.dims)
        if info.kind == "constant" or name in self.mapping.untrained:
            if layout.partial:
                raise PlanMismatch(f"The plan reads constant {name!r} partial at {consumer.name!r}.")
            return ReadPlan(read, "constant", "", layout, (), (), (), False, itemsize, itemsize)
        if info.kind == "activation":
            producer = program.graph.producer[name]
            if self.stage_ops is not None and program.graph.position[producer] not in self.stage_ops:
                # from an earlier stage, in this reader's layout; its gradient leaves reduced within the stage
                steps: tuple[Step, ...] = ()
                if program.requires_grad.get(name, False) and consumer.rule.differentiable and source.partial:
                    steps = redistribute(source, Layout(layout.dims), info.shape, itemsize)
                return ReadPlan(read, "received", producer, layout, (), steps, (), False, itemsize, itemsize)
            written = program.op(producer)
            held = written.outputs[written.rule.op.outputs.index(name)]
            assert held is not None  # a present output has a layout
            if held.partial and held.partial_op != ReduceOp.SUM:
                raise PlanMismatch(
                    f"The plan reads the partial {held.partial_op} {name!r}; autopar's trainer runs partial sums only."
                )
            forward = tuple(schedule.forward.get((name, producer, consumer.name), ()))
            _follow(held, forward, layout, f"redistribution of {name!r} from {producer!r} to {consumer.name!r}")
            backward: tuple[Step, ...] = ()
            masked: tuple[int, ...] = ()
            if program.requires_grad.get(name, False) and consumer.rule.differentiable:
                backward = tuple(schedule.backward.get((name, producer, consumer.name, read.slot), ()))
                target = written.rule.gradient_target(written.exponents, written.rule.op.outputs.index(name))
                what = f"gradient of {name!r} from {consumer.name!r} to {producer!r}"
                masked = _follow(source, backward, target, what)
            return ReadPlan(read, "activation", producer, layout, forward, backward, masked, False, itemsize, itemsize)
        owner_node, owner_slot = program.owner[name]
        owner = program.ops[owner_node]
        loaded = owner.input_layout(owner_slot)
        if self.stage_ops is not None and owner_node not in self.stage_ops:
            raise PlanMismatch(
                f"{name!r} is loaded on another pipeline stage than {consumer.name!r} reads it on; autopar's trainer"
                " loads each parameter and input on one stage."
            )
        is_owner = (read.consumer, read.slot) == (owner_node, owner_slot)
        forward = () if is_owner else tuple(schedule.forward.get((name, owner.name, consumer.name), ()))
        _follow(loaded, forward, layout, f"redistribution of {name!r} from {owner.name!r} to {consumer.name!r}")
        if info.kind == "input":
            return ReadPlan(read, "input", owner.name, layout, forward, (), (), is_owner, itemsize, itemsize)
        target = self.stored_layout(name)
        if is_owner:
            sync = schedule.sync.get(name)
            backward = (sync,) if sync is not None else ()
            what = f"gradient synchronisation of {name!r}"
        else:
            backward = tuple(schedule.backward.get((name, owner.name, consumer.name, read.slot), ()))
            what = f"gradient of {name!r} from {consumer.name!r} back to {owner.name!r}"
        masked = _follow(source, backward, target, what) if info.trainable else ()
        return ReadPlan(
            read, "parameter", owner.name, layout, forward, backward, masked, is_owner, itemsize, gradient_itemsize
        )

    def _fork_read(self, unit: ForkUnit) -> ReadPlan:
        planned = self.program.ops[unit.op]
        return self._read_plan(Read(planned.rule.op.inputs[0], planned.rule.op.inputs[0], unit.op, 0))

    def loaded_layout(self, name: str) -> Layout:
        """The layout a parameter or input is loaded in: its owner's."""
        node, slot = self.program.owner[name]
        return self.program.ops[node].input_layout(slot)

    def _sync(self, name: str) -> Step | None:
        """A parameter's gradient synchronisation, as the plan lists it (whichever stage holds it)."""
        return self.syncs.get(name)

    def stored_layout(self, name: str) -> Layout:
        """A parameter as its ranks store it: its loaded layout, split further by the parallel optimizer."""
        layout = self.loaded_layout(name)
        sync = self._sync(name)
        if sync is None or sync.kind != Collective.REDUCE_SCATTER or sync.dim is None:
            return Layout(layout.dims)
        return Layout(tuple(bits + sync.bits if d == sync.dim else bits for d, bits in enumerate(layout.dims)))

    def gather_step(self, name: str) -> Step | None:
        """The parallel optimizer's AllGather that restores a parameter from its stored shards (None: none)."""
        sync = self._sync(name)
        if sync is None or sync.kind != Collective.REDUCE_SCATTER:
            return None
        return Step(Collective.ALL_GATHER, sync.bits, sync.nbytes, sync.dim)

    # --- running ----------------------------------------------------------------------------

    def forward(
        self,
        inputs: Mapping[str, torch.Tensor],
        parameters: Mapping[str, torch.Tensor],
        constants: Mapping[str, torch.Tensor],
        received: Mapping[tuple[str, str, int], torch.Tensor] | None = None,
        draw: int | None = None,
    ) -> "Pass":
        """One micro-batch: ``inputs`` whole (plan input name -> tensor), ``parameters`` this rank's stored
        shards (state_dict key -> local tensor), ``constants`` the module's buffers by FX placeholder; ``draw``:
        the pass's number among those that drop (None: the module is not training, and dropout keeps all)."""
        run = Pass(self, inputs, parameters, constants, dict(received or {}), draw)
        run.run()
        return run

    def derived_values(
        self, parameters: Mapping[str, torch.Tensor], constants: Mapping[str, torch.Tensor], names: list[str]
    ) -> dict[str, torch.Tensor]:
        """Folded weights as their stored shards, computed again from the parameters (with autograd)."""
        run = Pass(self, {}, parameters, constants, {})
        for unit in self.units:
            if isinstance(unit, WholeUnit):
                run._whole(unit)
            elif isinstance(unit, DerivedUnit):
                run._derived(unit)
        return {name: run._stored(name) for name in names}

    def synchronise(self) -> dict[str, torch.Tensor]:
        """The owners' accumulated gradients, synchronised once (with ``defer_sync``): plan tensor -> stored."""
        out = {}
        for name in sorted(self.unsynced):
            sync = self.schedule.sync.get(name)
            grad = self.unsynced.pop(name)
            info = self.program.graph.tensor(name)
            out[name] = self.mover.run(
                grad, (sync,) if sync is not None else (), "sync", self.program.gradient_itemsize
            )
            del info
        return out


class Pass:
    """One micro-batch's forward on one rank (see `RankProgram.forward`); the backward runs through autograd."""

    def __init__(
        self,
        rank_program: RankProgram,
        inputs: Mapping[str, torch.Tensor],
        parameters: Mapping[str, torch.Tensor],
        constants: Mapping[str, torch.Tensor],
        received: dict[tuple[str, str, int], torch.Tensor],
        draw: int | None = None,
    ) -> None:
        self.p = rank_program
        self.inputs, self.parameters, self.constants, self.received = inputs, parameters, constants, received
        self.draw = draw
        self.held: dict[tuple[str, str], Held] = {}
        self.whole: dict[str, torch.Tensor] = dict(constants)
        self.values: dict[str, torch.Tensor] = {}  # FX value -> its local value in this pass (node outputs)

    def run(self) -> None:
        for unit in self.p.units:
            if isinstance(unit, NodePlan):
                self._node(unit)
            elif isinstance(unit, WholeUnit):
                self._whole(unit)
            elif isinstance(unit, DerivedUnit):
                self._derived(unit)
            else:
                fork, read = unit
                self._fork(fork.op, read)

    # --- values -------------------------------------------------------------------------------

    def _whole(self, unit: WholeUnit) -> None:
        node = self.p.nodes[unit.node]
        args, kwargs = torch.fx.node.map_arg(
            (node.args, node.kwargs),
            lambda n: (
                _stand_in(n) if reads_metadata_only(node, n) else self.whole[self.p.mapping.node_of.get(n.name, n.name)]
            ),
        )
        with torch.no_grad():
            self.whole[unit.node] = node.target(*args, **kwargs)

    def _derived(self, unit: DerivedUnit) -> None:
        """A folded weight computed whole from whole parameters (kept replicated), with autograd."""
        node = self.p.nodes[unit.node]
        placeholders = self.p.mapping.placeholders

        def value_of(arg: torch.fx.Node) -> Any:
            source = self.p.mapping.node_of.get(arg.name, arg.name)
            if source in self.whole:
                return self.whole[source]
            if source in placeholders and placeholders[source] in self.parameters:
                return self.parameters[placeholders[source]]
            raise PlanMismatch(f"Module node {node.name!r} reads {arg.name!r}, which this rank does not hold whole.")

        mapped: Any = torch.fx.node.map_arg((node.args, node.kwargs), value_of)
        self.whole[unit.node] = node.target(*mapped[0], **mapped[1])

    def _stored(self, name: str) -> torch.Tensor:
        """A parameter's stored local shard in the plan's orientation (a folded weight's: sliced from its whole
        value, its gradient summed over the bits the slice splits, as the plan does not know it is one)."""
        derived = self.p.mapping.derived.get(name)
        if derived is not None:
            layout = self.p.stored_layout(name)
            mover = self.p.derived_mover or self.p.mover
            whole = _planned(self.whole[derived], self.p.program.graph.tensor(name).shape)
            return Slice.apply(whole, layout, self.p.rank, mover, self.p.program.gradient_itemsize)
        use = self.p.mapping.parameters[name]
        local = self.parameters[use.parameter]
        return local.permute(use.permutation) if use.permutation else local

    def _loaded(self, name: str, plan: ReadPlan) -> torch.Tensor:
        """The parameter as its owner reads it; the owner's gradient is synchronised on its way back."""
        p = self.p
        stored = self._stored(name)
        gather = p.gather_step(name)
        if gather is not None and name not in p.gathered:
            p.gathered[name] = p.mover.run(stored.detach(), (gather,), "sync", plan.gradient_itemsize)

        def forward(x: torch.Tensor) -> torch.Tensor:
            return p.gathered[name] if gather is not None else x

        def backward(grad: torch.Tensor) -> torch.Tensor | None:
            if p.defer_sync:
                p.unsynced[name] = p.unsynced[name] + grad if name in p.unsynced else grad
                return None
            return p.mover.masked(p.mover.run(grad, plan.backward, "sync", plan.gradient_itemsize), plan.masked)

        return Move.apply(stored, forward, backward)

    def _read(self, plan: ReadPlan) -> torch.Tensor:
        """The read's value in its reader's layout (the plan's orientation)."""
        p, read = self.p, plan.read
        name = read.tensor
        if plan.kind == "constant":
            whole = self.whole.get(read.arg)
            if whole is None:
                raise PlanMismatch(f"Constant {name!r} has no value the module computes.")
            if read.permutation:
                whole = whole.permute(read.permutation)
            return _planned(whole, p.program.graph.tensor(name).shape)[
                plan.layout.local_slices(p.rank, tuple(p.program.graph.tensor(name).shape))
            ]
        if plan.kind == "received":
            return self._move(self.received[(name, p.program.ops[read.consumer].name, read.slot)], plan)
        if plan.kind == "activation":
            held = self.held[(name, plan.producer)]
            return self._move(held.value, plan)
        if plan.kind == "input":
            key = (name, plan.producer)
            if key not in self.held:
                layout = p.loaded_layout(name)
                whole = self.inputs[name]
                self.held[key] = Held(layout, whole[layout.local_slices(p.rank, tuple(whole.shape))])
            return self._move(self.held[key].value, plan)
        key = (name, plan.producer)
        if plan.owner:
            if key not in self.held:
                self.held[key] = Held(plan.layout, self._loaded(name, plan))
            return self.held[key].value
        if key not in self.held:  # the owner reads later in this pass: load it now
            owner_node, owner_slot = p.program.owner[name]
            owner_read = next(
                u for u in self._all_reads() if (u.read.consumer, u.read.slot) == (owner_node, owner_slot)
            )
            self.held[key] = Held(owner_read.layout, self._loaded(name, owner_read))
        loaded = self.held[key].value

        def forward(x: torch.Tensor) -> torch.Tensor:
            return p.mover.run(x, plan.forward, "forward", plan.itemsize)

        def backward(grad: torch.Tensor) -> torch.Tensor:
            return p.mover.masked(p.mover.run(grad, plan.backward, "backward", plan.gradient_itemsize), plan.masked)

        return ParameterRead.apply(self._stored(name), loaded, forward, backward)

    def _all_reads(self) -> list[ReadPlan]:
        found = []
        for unit in self.p.units:
            if isinstance(unit, NodePlan):
                found += list(unit.reads)
            elif isinstance(unit, tuple):
                found.append(unit[1])
        return found

    def _move(self, value: torch.Tensor, plan: ReadPlan) -> torch.Tensor:
        p = self.p
        if not plan.forward and not plan.backward and not plan.masked:
            return value

        def forward(x: torch.Tensor) -> torch.Tensor:
            return p.mover.run(x, plan.forward, "forward", plan.itemsize)

        def backward(grad: torch.Tensor) -> torch.Tensor:
            return p.mover.masked(p.mover.run(grad, plan.backward, "backward", plan.gradient_itemsize), plan.masked)

        return Move.apply(value, forward, backward)

    # --- nodes --------------------------------------------------------------------------------

    def _node(self, plan: NodePlan) -> None:
        if plan.as_operators:
            self._operators(plan)
            return
        p = self.p
        local: dict[str, torch.Tensor] = {}
        for read in plan.reads:
            if read.read.arg in local:
                continue
            value = self._read(read)
            if read.read.permutation:
                value = value.permute(inverse(read.read.permutation))
            if read.read.arg in plan.once and not shards.first_of_partial_group(
                p.program.ops[read.read.consumer], p.rank
            ):
                value = value * 0  # in the graph still: every rank runs the same collectives on the way back
            local[read.read.arg] = value
        node = plan.node

        def value_of(arg: torch.fx.Node) -> Any:
            source = p.mapping.node_of.get(arg.name, arg.name)
            if source in local:
                return local[source]
            if reads_metadata_only(node, arg):
                return _stand_in(arg)
            if source in p.mapping.inline:  # a node merged into this one's operators, run on the shard they read
                merged = p.nodes[source]
                inner: Any = torch.fx.node.map_arg((merged.args, merged.kwargs), value_of)
                return merged.target(*inner[0], **inner[1])
            if source in self.whole:
                return self.whole[source]
            raise PlanMismatch(f"Module node {node.name!r} reads {arg.name!r}, which this pass has not computed.")

        mapped: Any = torch.fx.node.map_arg((node.args, node.kwargs), value_of)
        args, kwargs = mapped
        if node.name in p.draws:
            self._keep(plan, self._dropout(plan, args[0]))
            return
        order = plan.unit.permutation  # (the plan's tensor is the value permuted so: its shape so too)
        shape = plan.local_shapes[0]
        in_order = tuple(shape[d] for d in inverse(order)) if order is not None and shape is not None else shape
        target, args, kwargs = shards.local_call(node.target, tuple(args), dict(kwargs), in_order)
        gathered = next(
            (shards.gathered_rows(p.program.ops[i]) for i in plan.unit.ops if shards.gathered_rows(p.program.ops[i])),
            (),
        )
        if gathered:  # a lookup on a table split along the axis it looks up: the rows this rank holds
            full = _looked_up_size(node)
            out: Any = shards.masked_lookup(node.target, args, kwargs, full, p.rank, gathered)
            if out is None:
                raise PlanMismatch(f"Module node {node.name!r} ({node.target}) looks up rows of a table split by rows.")
        else:
            out = target(*args, **kwargs)
        outputs = list(out) if isinstance(out, (tuple, list)) else [out]
        if plan.divisor > 1:
            outputs[0] = outputs[0] / plan.divisor
        if order is not None:
            outputs[0] = outputs[0].permute(order)
        self._keep(plan, outputs)

    def _dropout(self, plan: NodePlan, x: torch.Tensor) -> list[torch.Tensor]:
        """A dropout that draws, each element's mask drawn from its place in the whole tensor
        (`autopar.torch.dropout`): alike on every rank that holds it, as one process draws it. Outside training
        (no ``draw``), the identity."""
        if self.draw is None:
            return [x, torch.ones_like(x, dtype=torch.bool)]
        p, (tensor, _), layout = self.p, plan.unit.outputs[0], plan.layouts[0]
        if layout is None or plan.unit.permutation is not None:
            raise PlanMismatch(f"Module node {plan.node.name!r} drops elements of a tensor the plan does not lay out.")
        shape = p.program.graph.tensor(tensor).shape
        number = self.draw * len(p.draws) + p.draws[plan.node.name]
        probability, _ = dropout_arguments(plan.node)
        assert probability is not None  # (a node that draws)
        mask = keep_mask(p.seed, number, probability, shape, layout.local_slices(p.rank, shape), x.device)
        return [dropped(x, probability, mask), mask]

    def _keep(self, plan: NodePlan, outputs: list[Any]) -> None:
        for (tensor, writer), layout, shape, value in zip(plan.unit.outputs, plan.layouts, plan.local_shapes, outputs):
            if not tensor or layout is None:
                continue
            if tuple(value.shape) != shape:
                raise PlanMismatch(
                    f"Module node {plan.node.name!r} gives rank {self.p.rank} a shard of shape {list(value.shape)},"
                    f" where the plan's layout {layout.describe()} of {tensor!r} gives {list(shape or ())}."
                )
            self.held[(tensor, self.p.program.ops[writer].name)] = Held(layout, value)

    def _operators(self, plan: NodePlan) -> None:
        """The node as the plan's operators, each with autopar's own local kernel, the moves between them planned."""
        p = self.p
        program = p.program
        by_slot = {(read.read.consumer, read.read.slot): read for read in plan.reads}
        mine = {program.ops[index].name for index in plan.unit.ops}
        for index in plan.unit.ops:
            planned = program.ops[index]
            op = planned.rule.op
            inputs: list[torch.Tensor | None] = []
            for slot, name in enumerate(op.inputs):
                if not name:
                    inputs.append(None)
                    continue
                read = by_slot.get((index, slot))
                if read is not None:
                    inputs.append(self._read(read))
                elif program.graph.tensor(name).kind == "activation" and program.graph.producer[name] in mine:
                    inputs.append(self._inner(name, planned, slot))
                elif (fork := self._own_fork(name, mine)) is not None:
                    self._fork(fork, p._fork_read(ForkUnit(fork)))  # (its own unit later finds it done)
                    inputs.append(self._inner(name, planned, slot))
                else:
                    inputs.append(self._constant(name, planned, slot))
            shapes = [
                layout.local_shape(program.graph.tensor(out).shape) if out and layout is not None else None
                for out, layout in zip(op.outputs, planned.outputs)
            ]
            outputs = run_local(planned.rule, planned.exponents, p.rank, inputs, shapes)
            for out, layout, value in zip(op.outputs, planned.outputs, outputs):
                if out and layout is not None:
                    self.held[(out, planned.name)] = Held(layout, value)

    def _own_fork(self, name: str, mine: set[str]) -> int | None:
        """The fork writing ``name`` where one of the node's own operators writes what it forks (the exporter
        computed a value once for this node and another, as Falcon's Transpose before its two lookups), else None."""
        graph = self.p.program.graph
        if name not in graph.producer:
            return None  # (a constant, a parameter)
        producer = graph.op(graph.producer[name])
        if producer.domain != FORK_DOMAIN or graph.producer.get(producer.inputs[0]) not in mine:
            return None
        return self.p.program.ops.index(self.p.program.op(producer.name))

    def _fork(self, index: int, read: ReadPlan) -> None:
        """A fork's output, moved from what it forks as the plan moves it, once a pass."""
        planned = self.p.program.ops[index]
        key, layout = (planned.rule.op.outputs[0], planned.name), planned.outputs[0]
        assert layout is not None  # (a fork always writes its output)
        if key not in self.held:
            self.held[key] = Held(layout, self._read(read))

    def _inner(self, name: str, reader: PlannedOp, slot: int) -> torch.Tensor:
        """A tensor one of a node's operators writes and another reads, moved as the plan moves it."""
        p = self.p
        producer = p.program.graph.producer[name]
        plan = p._read_plan(Read(name, name, p.program.ops.index(reader), slot))
        return self._move(self.held[(name, producer)].value, plan)

    def _constant(self, name: str, reader: PlannedOp, slot: int) -> torch.Tensor:
        info = self.p.program.graph.tensor(name)
        if info.value is None:
            raise PlanMismatch(f"Constant {name!r} of the plan's model has no stored value.")
        layout = reader.input_layout(slot)
        key = (name, layout)
        if key not in self.p.constants:  # made once: a copy (a stored value, or a buffer's view, is read-only)
            local = info.value[layout.local_slices(self.p.rank, tuple(info.value.shape))]
            self.p.constants[key] = torch.from_numpy(np.array(local))
        return self.p.constants[key]

    # --- outputs --------------------------------------------------------------------------------

    def leaving(self, tensor: str, producer: str) -> torch.Tensor:
        """A tensor a later stage reads, reduced within this stage where its writer leaves it partial; the gradient
        that comes back whole is made partial where the writer takes it so (a fork's)."""
        p = self.p
        held = self.held[(tensor, producer)]
        whole = Layout(held.layout.dims)
        info = p.program.graph.tensor(tensor)
        itemsize = p.program.itemsize(info)
        steps = redistribute(held.layout, whole, info.shape, itemsize)
        written = p.program.op(producer)
        target = written.rule.gradient_target(written.exponents, written.rule.op.outputs.index(tensor))
        masked = _follow(whole, (), target, f"gradient of {tensor!r} sent back to {producer!r}")

        def forward(x: torch.Tensor) -> torch.Tensor:
            return p.mover.run(x, steps, "forward", itemsize)

        return Move.apply(held.value, forward, lambda grad: p.mover.masked(grad, masked))

    def buffer_value(self, source: tuple[str, str], mover: Mover) -> torch.Tensor | None:
        """A buffer's new value, whole (`ModuleMap.mutated`), gathered by ``mover`` where the plan splits it; None
        where another stage computes it."""
        tensor, node = source
        if node:
            return self.whole[node].detach()
        p = self.p
        producer = p.program.graph.producer[tensor]
        held = self.held.get((tensor, producer))
        if held is None:
            return None
        info = p.program.graph.tensor(tensor)
        itemsize = p.program.itemsize(info)
        steps = redistribute(held.layout, Layout(tuple(() for _ in info.shape)), info.shape, itemsize)
        return mover.run(held.value.detach(), steps, "buffers", itemsize)

    def output(self, tensor: str) -> torch.Tensor:
        """A graph output, reduced as the plan reduces it (its layout's partial bits), on this rank."""
        p = self.p
        producer = p.program.graph.producer[tensor]
        held = self.held[(tensor, producer)]
        if not held.layout.partial:
            return held.value
        steps = tuple(p.schedule.forward.get((tensor, producer, GRAPH_OUTPUT), ()))
        whole = Layout(held.layout.dims)
        _follow(held.layout, steps, whole, f"reduction of output {tensor!r}")
        itemsize = p.program.itemsize(p.program.graph.tensor(tensor))

        def forward(x: torch.Tensor) -> torch.Tensor:
            return p.mover.run(x, steps, "forward", itemsize)

        return Move.apply(held.value, forward, lambda grad: grad)


def _looked_up_size(node: torch.fx.Node) -> int:
    """The whole size of the axis a lookup node looks up (its table's, as the module sees it)."""
    args: Any = node.args
    axis = 0 if node.target == torch.ops.aten.embedding.default else int(args[1])
    return int(args[0].meta["val"].shape[axis])


def _planned(whole: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """A value the module computed at the batch it was exported at, as the plan's micro-batch has it: its first
    samples (the tables a batch repeats, `autopar.graph.bind.rebatch_constants`)."""
    if tuple(whole.shape) == tuple(shape) or not whole.dim() or len(shape) != whole.dim():
        return whole
    if tuple(whole.shape[1:]) == tuple(shape[1:]) and whole.shape[0] > shape[0]:
        return whole[: shape[0]]
    return whole


class Slice(torch.autograd.Function):
    """A rank's shard of a whole tensor every rank computes alike; on the way back, the shard's gradient summed
    over the bits the layout splits, so every rank holds the whole gradient again."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        whole: torch.Tensor,
        layout: Layout,
        rank: int,
        mover: Mover,
        itemsize: int,
    ) -> torch.Tensor:
        ctx.layout, ctx.rank, ctx.mover, ctx.itemsize = layout, rank, mover, itemsize  # type: ignore[attr-defined]
        ctx.shape = tuple(whole.shape)  # type: ignore[attr-defined]
        return whole.detach()[layout.local_slices(rank, tuple(whole.shape))].clone()

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple[Any, None, None, None, None]:
        layout: Layout = ctx.layout  # type: ignore[attr-defined]
        whole = grad.new_zeros(ctx.shape)  # type: ignore[attr-defined]
        whole[layout.local_slices(ctx.rank, ctx.shape)] = grad  # type: ignore[attr-defined]
        bits = tuple(sorted(layout.split_bits, reverse=True))
        if bits:
            step = Step(Collective.ALL_REDUCE, bits, whole.numel() * ctx.itemsize)  # type: ignore[attr-defined]
            whole = ctx.mover.run(whole, (step,), "sync", ctx.itemsize)  # type: ignore[attr-defined]
        return whole, None, None, None, None


def _stand_in(arg: torch.fx.Node) -> torch.Tensor:
    """What a node reading ``arg`` for its dtype or shape alone is given: an uninitialised tensor of its (whole)
    shape and dtype, the value never computed (`mapping.reads_metadata_only`)."""
    value = arg.meta["val"]
    return torch.empty(tuple(value.shape), dtype=value.dtype)
