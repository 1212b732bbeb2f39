"""A plan's training step as an SPMD program in torch: forward, backward, gradient synchronisation.

The program is the same on virtual ranks (one process computes all N) and on a real runtime
(each process computes its own rank); only `Collectives` differ. Each rank holds only its
shards and runs every operator's registered torch kernel on them (`local`). The forward
carries out the redistributions the plan lists. The backward walks the operators in reverse:
each operator's local gradients come from torch autograd on that operator alone, and every
collective a gradient needs is the one the plan lists for it (`PlanFile.gradients`, the
gradient synchronisation), never one derived here. So a plan whose backward is wrong is
caught by name, before its numbers are compared.

A pipeline stage runs the same step on its own range of operators (``nodes``): what it reads from
an earlier stage arrives in ``received``, the gradients it owes an earlier stage wait in
``outgoing``, and with ``defer_sync`` a parameter's gradient is kept unsynchronised in ``unsynced``
so the micro-batches accumulate before the one synchronisation (`autopar.runtime.pipeline`).

Gradients follow one convention: a rank's gradient of a tensor it holds replicated is the
whole gradient; a consumer whose strategy splits a label its input lacks leaves that
input's gradient partial over those bits, and the plan's steps reduce it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from autopar import progress
from autopar.layout import Layout, ReduceOp, shard_index
from autopar.lowering.planfile import GRAPH_OUTPUT, GradientPath, GradientSync, Redistribution
from autopar.lowering.program import PlanProgram
from autopar.redistribute import Collective, Step, apply_steps, as_partial, redistribute
from autopar.runtime.collectives import Collectives
from autopar.runtime.local import run_local
from autopar.spmd.compare import Tally

Buffers = list[torch.Tensor]


class PlanBroken(Exception):
    """The plan's collectives do not lead where the program needs a tensor or a gradient."""


@dataclass(frozen=True)
class Schedule:
    """The collectives a plan lists, keyed the way the program looks them up."""

    forward: Mapping[tuple[str, str, str], list[Step]]
    backward: Mapping[tuple[str, str, str, int], list[Step]]
    sync: Mapping[str, Step | None]
    maxima: Mapping[tuple[str, str], tuple[str, list[Step]]]  # (tensor, producer) -> (consumer, steps)
    listed: tuple[tuple[str, Step], ...]  # (phase, step) of every entry: a tensor read twice is moved twice

    @classmethod
    def of(
        cls, redistributions: Sequence[Redistribution], gradients: Sequence[GradientPath], syncs: Sequence[GradientSync]
    ) -> "Schedule":
        listed = [("forward", s.step()) for entry in redistributions for s in entry.steps]
        listed += [("backward", s.step()) for entry in gradients for s in entry.steps]
        listed += [("sync", step) for step in (entry.step() for entry in syncs) if step is not None]
        return cls(
            forward={entry.key: [s.step() for s in entry.steps] for entry in redistributions},
            backward={entry.key: [s.step() for s in entry.steps] for entry in gradients if entry.carries is None},
            sync={entry.parameter: entry.step() for entry in syncs},
            maxima={
                (entry.tensor, entry.producer): (entry.consumer, [s.step() for s in entry.steps])
                for entry in gradients
                if entry.carries is not None
            },
            listed=tuple(listed),
        )

    def planned(self, gradients: bool) -> Tally:
        """What the plan lists: the forward alone, or with ``gradients`` the whole step."""
        tally = Tally()
        for phase, step in self.listed:
            if gradients or phase == "forward":
                tally.add(phase, step, step.nbytes)
        return tally


def follow(src: Layout, steps: Sequence[Step], dst: Layout, what: str) -> tuple[int, ...]:
    """Check that ``steps`` lead from ``src`` to ``dst`` (PlanBroken naming ``what`` if not); the bits over which
    the result is still to be made partial (`as_partial`: a gradient a fork takes partial over bits it is whole on)."""
    try:
        reached = apply_steps(src, steps)
    except ValueError as exc:
        raise PlanBroken(f"the plan's {what} is malformed: {exc}") from None
    if reached != dst and reached.dims == dst.dims:
        try:
            return as_partial(reached, dst)
        except ValueError:
            pass
    if reached != dst:
        raise PlanBroken(
            f"the plan's {what} leaves it in layout {reached.describe()} but {dst.describe()} is needed"
            " (a collective is missing or wrong)"
        )
    return ()


def payload_numel(step: Step, before: torch.Tensor, after: torch.Tensor) -> int:
    """Elements of a step's per-rank payload, as `Step.nbytes` counts them."""
    return after.numel() if step.kind == Collective.ALL_GATHER else before.numel()


class TrainingStep:
    """One training step of a plan on the ranks ``collectives`` computes."""

    def __init__(
        self,
        program: PlanProgram,
        schedule: Schedule,
        values: Mapping[str, np.ndarray],
        collectives: Collectives,
        nodes: range | None = None,
        defer_sync: bool = False,
    ) -> None:
        self.program, self.schedule, self.values = program, schedule, values
        self.collectives = collectives
        self.nodes = nodes if nodes is not None else range(len(program.ops))
        self.names = {program.ops[node].name for node in self.nodes}
        self.defer_sync = defer_sync
        self.received: dict[tuple[str, str, int], Buffers] = {}  # (tensor, consumer, slot) from an earlier stage
        self.outgoing: dict[tuple[str, str, int], tuple[Layout, Buffers]] = {}  # gradients owed to an earlier stage
        self.unsynced: dict[str, tuple[Layout, Buffers]] = {}  # parameter -> gradient before its synchronisation
        self.ranks = collectives.ranks
        self.device = collectives.device
        self.buffers: dict[tuple[str, str], tuple[Layout, Buffers]] = {}
        self.tape: dict[int, tuple[list[list[torch.Tensor | None]], list[list[torch.Tensor]]]] = {}
        self.reduced: dict[tuple[str, str], Buffers] = {}  # partial max/min outputs after their AllReduce
        self.sliced: dict[tuple[str, str, str], tuple[Layout, Buffers]] = {}  # ... or a consumer's slice of them
        self.grads: dict[tuple[str, str], tuple[Layout, Buffers]] = {}
        self.executed = Tally()

    # --- shards and collectives -----------------------------------------------------------

    def _shard(self, name: str, layout: Layout) -> Buffers:
        full = self.values[name]
        if layout.partial:
            raise PlanBroken(f"{name!r} is loaded in a partial layout {layout.describe()}")
        return [self._tensor(full[layout.local_slices(r, full.shape)]) for r in self.ranks]

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        if array.dtype.name == "bfloat16":  # numpy's (ml_dtypes') bfloat16, which torch does not take: by way of
            # float32, where every bfloat16 is exact
            return torch.from_numpy(array.astype(np.float32)).to(device=self.device, dtype=torch.bfloat16)
        return torch.from_numpy(np.array(array, order="C", copy=True)).to(self.device)

    def _itemsize(self, name: str, phase: str) -> int:
        info = self.program.graph.tensor(name)
        if phase != "forward" and info.kind == "parameter":
            return self.program.gradient_itemsize
        return self.program.itemsize(info)

    def _run(self, name: str, buffers: Buffers, steps: Sequence[Step], phase: str) -> Buffers:
        itemsize = self._itemsize(name, phase)
        for step in steps:
            after = self.collectives.run(buffers, step)
            self.executed.add(phase, step, payload_numel(step, buffers[0], after[0]) * itemsize)
            buffers = after
        return buffers

    def _follow(self, src: Layout, steps: Sequence[Step], dst: Layout, what: str) -> tuple[int, ...]:
        return follow(src, steps, dst, what)

    # --- forward --------------------------------------------------------------------------

    def forward(self) -> None:
        program = self.program
        grad = program.requires_grad
        for node in self.nodes:
            planned = program.ops[node]
            progress.report("verify forward", node - self.nodes.start, len(self.nodes))
            rule = planned.rule
            inputs = [self._input(node, slot) for slot in range(len(rule.op.inputs))]
            out_layouts = planned.outputs
            out_shapes = [
                layout.local_shape(program.graph.tensor(name).shape) if name and layout is not None else None
                for name, layout in zip(rule.op.outputs, out_layouts)
            ]
            leaves: list[list[torch.Tensor | None]] = []
            outputs: list[list[torch.Tensor]] = []
            for index, rank in enumerate(self.ranks):
                local: list[torch.Tensor | None] = []
                for slot, buffers in enumerate(inputs):
                    if buffers is None:
                        local.append(None)
                        continue
                    leaf = buffers[index].detach()
                    needs = rule.differentiable and grad.get(rule.op.inputs[slot], False) and leaf.is_floating_point()
                    local.append(leaf.requires_grad_(True) if needs else leaf)
                leaves.append(local)
                outputs.append(run_local(rule, planned.exponents, rank, list(local), out_shapes))
            self.tape[node] = (leaves, outputs)
            present = [(name, layout) for name, layout in zip(rule.op.outputs, out_layouts) if name]
            for position, (name, layout) in enumerate(present):
                assert layout is not None  # a present output has a layout
                self.buffers[(name, rule.op.name)] = (layout, [out[position].detach() for out in outputs])

    def _input(self, node: int, slot: int) -> Buffers | None:
        program = self.program
        planned = program.ops[node]
        name = planned.rule.op.inputs[slot]
        if not name:
            return None
        layout = planned.input_layout(slot)
        info = program.graph.tensor(name)
        if info.kind == "activation" and program.graph.producer[name] not in self.names:
            if (name, planned.name, slot) not in self.received:
                raise PlanBroken(f"{name!r} never arrived at {planned.name!r} from the stage that writes it")
            return self.received[(name, planned.name, slot)]
        if info.kind == "constant" or program.owner.get(name) == (node, slot) or self._loads_here(name, node):
            buffers = self._shard(name, layout)
            if info.kind != "constant":
                self.buffers[(name, planned.name)] = (layout, buffers)
            return buffers
        return self._redistribute(name, program.producer_of(name), planned.name, layout)

    def _loads_here(self, name: str, node: int) -> bool:
        """A stage loads the data and parameters it reads when their first reader is on another stage."""
        owner = self.program.owner.get(name)
        return owner is not None and owner[0] not in self.nodes and self.program.graph.tensor(name).kind != "activation"

    def reduce_for_send(self, name: str, producer: str) -> tuple[Layout, Buffers]:
        """A tensor leaving the stage, whole: a partial writer reduces it within the stage first."""
        src, held = self.buffers[(name, producer)]
        if not src.partial:
            return src, held
        whole = Layout(src.dims)
        info = self.program.graph.tensor(name)
        after = self._run(name, held, redistribute(src, whole, info.shape, self.program.itemsize(info)), "forward")
        if src.partial_op != ReduceOp.SUM:
            self.reduced[(name, producer)] = after
        return whole, after

    def reduce_gradient(self, name: str, layout: Layout, buffers: Buffers) -> tuple[Layout, Buffers]:
        """A gradient leaving the stage, whole: reduced within the stage over the bits it is partial on."""
        if not layout.partial:
            return layout, buffers
        whole = Layout(layout.dims)
        info = self.program.graph.tensor(name)
        steps = redistribute(layout, whole, info.shape, self.program.itemsize(info))
        return whole, self._run(name, buffers, steps, "backward")

    def _redistribute(self, name: str, producer: str, consumer: str, dst: Layout) -> Buffers:
        src, held = self.buffers[(name, producer)]
        steps = self.schedule.forward.get((name, producer, consumer), [])
        self._follow(src, steps, dst, f"redistribution of {name!r} from {producer!r} to {consumer!r}")
        after = self._run(name, held, steps, "forward")
        if src.partial and src.partial_op != ReduceOp.SUM:  # a max's backward needs the whole maximum
            if dst == Layout(src.dims):
                self.reduced[(name, producer)] = after
            else:
                self.sliced[(name, producer, consumer)] = (dst, after)
        return after

    def output(self, name: str) -> tuple[Layout, Buffers]:
        """A graph output on every rank: reduced where the producer left it partial."""
        producer = self.program.graph.producer[name]
        layout, buffers = self.buffers[(name, producer)]
        if not layout.partial:
            return layout, buffers
        return Layout(layout.dims), self._redistribute(name, producer, GRAPH_OUTPUT, Layout(layout.dims))

    # --- backward -------------------------------------------------------------------------

    def backward(
        self,
        cotangents: Mapping[str, np.ndarray],
        arrived: Mapping[tuple[str, str], tuple[Layout, Buffers]] | None = None,
    ) -> None:
        """Seed each output with its cotangent (and each tensor a later stage read with the gradient it
        sent back, ``arrived``: (tensor, producer) -> whole layout and buffers), then walk the operators
        in reverse."""
        program = self.program
        for name, full in cotangents.items():
            producer = program.graph.producer[name]
            layout = Layout(self.buffers[(name, producer)][0].dims)
            seeds = [self._tensor(full[layout.local_slices(r, full.shape)]) for r in self.ranks]
            self._accumulate(name, producer, layout, seeds)
        for (name, producer), (layout, buffers) in (arrived or {}).items():
            target = self._gradient_target(name, producer)
            masked = self._follow(layout, [], target, f"gradient of {name!r} sent back to {producer!r}")
            self._accumulate(name, producer, target, self._masked(buffers, masked))
        for node in reversed(self.nodes):
            progress.report("verify backward", self.nodes.stop - 1 - node, len(self.nodes))
            self._backward_node(node)

    def _accumulate(self, name: str, holder: str, layout: Layout, buffers: Buffers) -> None:
        key = (name, holder)
        if key in self.grads:
            held_layout, held = self.grads[key]
            if held_layout != layout:
                raise PlanBroken(f"gradients of {name!r} arrive at {holder!r} in two layouts")
            buffers = [a + b for a, b in zip(held, buffers)]
        self.grads[key] = (layout, buffers)

    def _maximum(self, name: str, producer: str, layout: Layout) -> Buffers:
        """The reduced values of a partial max/min on every rank: kept from an AllReduce, or gathered
        from a consumer's slice of them by the steps the plan lists (once)."""
        if (name, producer) not in self.reduced:
            consumer, steps = self.schedule.maxima.get((name, producer), ("", []))
            if (name, producer, consumer) not in self.sliced:
                raise PlanBroken(
                    f"the plan lists no collectives that bring the whole {layout.partial_op} {name!r} back to"
                    f" {producer!r} for its backward"
                )
            held, buffers = self.sliced[(name, producer, consumer)]
            self._follow(
                held, steps, Layout(layout.dims), f"{layout.partial_op} {name!r} from {consumer!r} back to {producer!r}"
            )
            self.reduced[(name, producer)] = self._run(name, buffers, steps, "backward")
        return self.reduced[(name, producer)]

    def parameter_target(self, name: str, layout: Layout) -> Layout:
        """A parameter's gradient layout after its synchronisation: whole, or split by the parallel optimizer."""
        sync = self.schedule.sync.get(name)
        if sync is None or sync.kind != Collective.REDUCE_SCATTER or sync.dim is None:
            return Layout(layout.dims)
        return Layout(tuple(bits + sync.bits if d == sync.dim else bits for d, bits in enumerate(layout.dims)))

    def _backward_node(self, node: int) -> None:
        planned = self.program.ops[node]
        rule = planned.rule
        op = rule.op
        if not rule.differentiable or node not in self.tape:
            return
        leaves, outputs = self.tape[node]
        present = [name for name in op.outputs if name]
        seeded = [(position, name) for position, name in enumerate(present) if (name, op.name) in self.grads]
        slots = [slot for slot, leaf in enumerate(leaves[0]) if leaf is not None and leaf.requires_grad]
        if not seeded or not slots:
            return
        local_grads: list[list[torch.Tensor]] = []
        for index in range(len(self.ranks)):
            pairs = []
            for position, name in seeded:
                out = outputs[index][position]
                if not out.requires_grad:
                    continue
                seed = self.grads[(name, op.name)][1][index]
                layout = self.buffers[(name, op.name)][0]
                if layout.partial and layout.partial_op != ReduceOp.SUM:  # only ranks holding the max pass its gradient
                    seed = seed * (out.detach() == self._maximum(name, op.name, layout)[index]).to(seed.dtype)
                pairs.append((out, seed.to(out.dtype)))
            wrt = [leaf for leaf in (leaves[index][slot] for slot in slots) if leaf is not None]
            found: Sequence[torch.Tensor | None] = (
                torch.autograd.grad([out for out, _ in pairs], wrt, [seed for _, seed in pairs], allow_unused=True)
                if pairs
                else [None] * len(wrt)
            )
            local_grads.append([g if g is not None else torch.zeros_like(x) for g, x in zip(found, wrt)])
        for column, slot in enumerate(slots):
            name = op.inputs[slot]
            layout = planned.input_layout(slot)
            bits = planned.gradient_bits[slot]
            source = Layout(layout.dims, bits) if bits else Layout(layout.dims)
            buffers = [grads[column].detach() for grads in local_grads]
            self._send_back(node, slot, name, source, buffers)

    def _send_back(self, node: int, slot: int, name: str, source: Layout, buffers: Buffers) -> None:
        """Take a consumer's gradient to its producer with the collectives the plan lists."""
        program = self.program
        consumer = program.ops[node].name
        info = program.graph.tensor(name)
        if info.kind == "activation" and program.graph.producer[name] not in self.names:
            self.outgoing[(name, consumer, slot)] = (source, buffers)  # the pipeline sends it back
            return
        if info.kind == "activation":
            producer = program.graph.producer[name]
            target = self._gradient_target(name, producer)
            steps = self.schedule.backward.get((name, producer, consumer, slot), [])
            what, phase = f"gradient of {name!r} from {consumer!r} back to {producer!r}", "backward"
        else:
            owner_node, owner_slot = program.owner[name]
            producer = program.ops[owner_node].name
            target = self.parameter_target(name, self.buffers[(name, producer)][0])
            if (owner_node, owner_slot) == (node, slot):
                sync = self.schedule.sync.get(name)
                steps = [sync] if sync is not None else []
                what, phase = f"gradient synchronisation of parameter {name!r} (read by {consumer!r})", "sync"
                if self.defer_sync:  # the micro-batches accumulate; `synchronise` runs the step once
                    self._follow(source, steps, target, what)
                    if name in self.unsynced:
                        _, held = self.unsynced[name]
                        buffers = [a + b for a, b in zip(held, buffers)]
                    self.unsynced[name] = (source, buffers)
                    return
            else:
                steps = self.schedule.backward.get((name, producer, consumer, slot), [])
                what, phase = f"gradient of {name!r} from {consumer!r} back to {producer!r}", "backward"
        masked = self._follow(source, steps, target, what)
        self._accumulate(name, producer, target, self._masked(self._run(name, buffers, steps, phase), masked))

    def _gradient_target(self, name: str, producer: str) -> Layout:
        """The layout the producer of activation ``name`` takes its readers' gradients in (`OpRule.gradient_target`)."""
        planned = self.program.op(producer)
        return planned.rule.gradient_target(planned.exponents, planned.rule.op.outputs.index(name))

    def _masked(self, buffers: Buffers, bits: Sequence[int]) -> Buffers:
        """A gradient whole over ``bits`` made partial over them (`as_partial`): one rank of each group keeps it."""
        if not bits:
            return buffers
        return [b if shard_index(r, bits) == 0 else torch.zeros_like(b) for b, r in zip(buffers, self.ranks)]

    def synchronise(self, name: str, source: Layout, buffers: Buffers) -> None:
        """Run a parameter's gradient synchronisation on ``buffers`` (accumulated before it) and keep the result."""
        program = self.program
        owner_node, _ = program.owner[name]
        producer = program.ops[owner_node].name
        target = self.parameter_target(name, self.buffers[(name, producer)][0])
        sync = self.schedule.sync.get(name)
        steps = [sync] if sync is not None else []
        self._follow(source, steps, target, f"gradient synchronisation of parameter {name!r}")
        self._accumulate(name, producer, target, self._run(name, buffers, steps, "sync"))

    def parameter_gradient(self, name: str) -> tuple[Layout, Buffers]:
        """A trainable parameter's gradient as the ranks hold it after synchronisation."""
        producer = self.program.producer_of(name)
        held = self.grads.get((name, producer))
        if held is not None:
            return held
        layout = self.parameter_target(name, self.buffers[(name, producer)][0])
        shape = self.program.graph.tensor(name).shape
        dtype = self.buffers[(name, producer)][1][0].dtype
        return layout, [torch.zeros(layout.local_shape(shape), dtype=dtype, device=self.device) for _ in self.ranks]
