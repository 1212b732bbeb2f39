"""Pipeline stages: cuts, stages and micro-batches around the per-stage search (1F1B).

A pipelined plan cuts the operators, in their topological order, into S stages (S a power of
two). Stage i runs on the N/S devices whose slowest log2(S) mesh bits spell i, so the sends
between stages cross the slowest links and each stage keeps the fast bits for tensor and data
parallelism. The global batch runs as M micro-batches under 1F1B (Narayanan et al., SC21;
Megatron-LM), so each stage is costed on the problem of one micro-batch over N/S devices.

The cost of a stage (``stage_problem``) is today's objective scaled to the schedule: its
per-micro-batch forward and backward (compute, collectives, redistributions, and its boundary
sends) times the M + S - 1 slots of 1F1B, plus its gradient sync and weight gathers, paid once.
Megatron's 1F1B sends and receives between a micro-batch's forward and backward and waits for
them, so a stage's sends sit in its slots. The step is the slowest stage's: every stage runs as
many slots, at the pace of the slowest, so for alike stages this is Narayanan's
(M + S - 1) x (t_f + t_b) plus the sync; a stage with little compute and much sync may hide some
of its sync behind the slower stages' slots, which this does not credit.

Memory: stage i holds its parameters' state and the activations of min(S - i, M) micro-batches
(the first stage holds S); with recomputation, the inputs of each block of those micro-batches
and one block's activations at a time.

A tensor that crosses a cut travels point to point: each device of the reading stage receives
exactly its shard from a device of the writing stage that holds it (one transfer of the shard's
bytes over the link between the two stages), and its gradient comes back into the writer's
layout the same way; a partial writer reduces first. So the stages' searches are independent
given the cut, and the outer search is exact: for each stage count and micro-batch count, a DP
over the cut points takes the cuts whose slowest stage is fastest (a min-max chain), every
stage's plan coming from the exact per-stage search (`autopar.search.cuts`, its lower bounds in
`autopar.search.floors`, the shapes chosen among by `autopar.search.shape_search`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType

import numpy as np

from autopar.graph.records import fx_node_name, fx_record
from autopar.graph.tied import WRITTEN as TIED
from autopar.layout import Layout
from autopar.search.dataflow import TensorUse
from autopar.search.dp import Factor
from autopar.search.driver import SearchResult
from autopar.search.fold import RunEdges
from autopar.search.memory import Alternative, MemoryChoices
from autopar.search.problem import SearchProblem
from autopar.search.repeats import Repeat

SCHEDULE = "1F1B"


@dataclass(frozen=True)
class PipelineShape:
    """S stages and M micro-batches under 1F1B.

    >>> shape = PipelineShape(stages=2, micro_batches=4)
    >>> shape.slots, [shape.in_flight(i) for i in range(2)], round(shape.bubble_fraction, 3)
    (5, [2, 1], 0.2)
    """

    stages: int
    micro_batches: int

    @property
    def slots(self) -> int:
        """Forward+backward slots every stage spends per step: M of work and S - 1 of bubble."""
        return self.micro_batches + self.stages - 1

    @property
    def bubble_fraction(self) -> float:
        """The share of a step each stage waits: (S - 1) / (M + S - 1)."""
        return (self.stages - 1) / self.slots

    def in_flight(self, stage: int) -> int:
        """Micro-batches whose activations stage ``stage`` holds at once under 1F1B."""
        return min(self.stages - stage, self.micro_batches)


ONE_STAGE = PipelineShape(1, 1)


def stage_link_bit(mesh_bits: int, a: int, b: int) -> int:
    """The mesh bit whose link joins stage ``a``'s devices to stage ``b``'s: their highest differing
    stage bit, above the ``mesh_bits`` each stage keeps.

    >>> stage_link_bit(3, 0, 1), stage_link_bit(3, 1, 2)
    (3, 4)
    """
    return mesh_bits + (a ^ b).bit_length() - 1


def cut_points(problem: SearchProblem) -> tuple[int, ...]:
    """Where a stage may start: between two copies of a repeated block, at a run's ends, and, outside
    runs, wherever exactly one activation crosses (a chain's links, a residual stream between blocks);
    never between a fork and its readers, whose partial gradients meet it unreduced."""
    n = problem.size
    crossing = np.zeros(n + 1, dtype=np.int64)
    last_read: dict[tuple[int, int], int] = {}
    for use in problem.uses:
        if use.src_is_output:
            key = (use.src_node, use.src_slot)
            last_read[key] = max(last_read.get(key, -1), use.dst_node)
    for (src, _), dst in last_read.items():
        if dst > src:
            crossing[src + 1] += 1
            crossing[dst + 1] -= 1
    crossing = np.cumsum(crossing)  # activations crossing a cut before position p
    inside: set[int] = set()
    allowed: set[int] = set()
    for repeat in problem.blocks:
        for k in range(repeat.copies):
            block = repeat.block(k)
            inside.update(range(block.start + 1, block.stop))
            allowed.update((block.start, block.stop))
    spans = [(src, dst) for (src, _), dst in last_read.items() if problem.rules[src].spec.gradient_labels]
    spans += _shared_weights(problem) + _module_nodes(problem)
    for first, last in spans:  # a fork's readers meet it in one stage, as a trainable weight's do
        inside.update(range(first + 1, last + 1))
        allowed.difference_update(range(first + 1, last + 1))
    points = [p for p in range(1, n) if p in allowed or (p not in inside and crossing[p] == 1)]
    return tuple(points)


def _module_nodes(problem: SearchProblem) -> list[tuple[int, int]]:
    """The first and last operator of each module node the dynamo exporter wrote as several (a biased
    ``linear``: a MatMul and an Add): the trainer runs a node on one stage (`autopar.torch`)."""
    where: dict[str, list[int]] = {}
    for node, rule in enumerate(problem.rules):
        name = fx_node_name(fx_record(rule.op.proto)) if rule.op.proto is not None else None
        if name is not None:
            where.setdefault(name, []).append(node)
    return [(nodes[0], nodes[-1]) for nodes in where.values() if nodes[-1] > nodes[0]]


def _shared_weights(problem: SearchProblem) -> list[tuple[int, int]]:
    """The first and last reader of each trainable weight read by more than one operator (T5's embedding, read by
    its encoder, its decoder and its output; a tied embedding, read again as the output matrix): a stage is one
    weight's only owner, so no cut falls between them (a plan cut there would be one `autopar.lowering.staged`
    refuses to run)."""
    return [(first, last) for first, last in _shared_weight_readers(problem).values()]


def _shared_weight_readers(problem: SearchProblem) -> dict[str, tuple[int, int]]:
    """`_shared_weights` by weight."""
    graph = problem.graph
    readers: dict[str, list[int]] = {}
    for node, rule in enumerate(problem.rules):
        for name in rule.op.inputs:
            if name and graph.tensor(name).kind == "parameter" and graph.tensor(name).trainable:
                readers.setdefault(name, []).append(node)
    return {name: (nodes[0], nodes[-1]) for name, nodes in readers.items() if nodes[-1] > nodes[0]}


def too_few_cut_points(problem: SearchProblem, stages: int) -> str | None:
    """The sentence that says a model cannot be cut into ``stages`` stages, and why, where its cut points are too
    few (None: they are enough). The widest span a weight's readers hold together is named: a tied embedding's
    keeps a language model whole from its lookup to its output product."""
    points = cut_points(problem)
    if stages <= len(points) + 1:
        return None
    spans = _shared_weight_readers(problem)
    why = ""
    if spans:
        weight, (first, last) = max(spans.items(), key=lambda item: (item[1][1] - item[1][0], item[0]))
        ops = problem.rules[first].op, problem.rules[last].op
        why = f" (none between {ops[0].name!r} and {ops[1].name!r}, which both read weight {weight!r}: one stage holds"
        if ops[1].proto is not None and any(p.key == TIED for p in ops[1].proto.metadata_props):
            why += " it; the embedding is tied to the output matrix: untie it before exporting to cut between them)"
        else:
            why += " each weight)"
    where = f"{len(points)} place{'s' if len(points) != 1 else ''}" if points else "no place"
    most = 1 << (len(points) + 1).bit_length() - 1  # (stage counts are powers of two)
    ask = "plan it with one" if most == 1 else f"ask for at most {most}"
    return (
        f"The model has {where} where a pipeline stage may start{why}, so it cannot be cut into {stages} stages; {ask}."
    )


@dataclass(frozen=True)
class Crossings:
    """The uses a stage reads from earlier stages (``into``) and writes to later ones (``out``)."""

    into: tuple[TensorUse, ...]
    out: tuple[TensorUse, ...]


def cut_crossings(problem: SearchProblem, first: int, last: int) -> Crossings:
    into = tuple(u for u in problem.uses if u.src_node < first <= u.dst_node < last)
    out = tuple(u for u in problem.uses if first <= u.src_node < last <= u.dst_node)
    return Crossings(into, out)


def send_costs(
    problem: SearchProblem,
    crossings: Crossings,
    first: int,
    index: int,
    shape: PipelineShape,
    known: "SentAlike | None" = None,
) -> dict[int, np.ndarray]:
    """Per operator of the stage (its own index), seconds per micro-batch its boundary transfers take:
    receiving what it reads from earlier stages (forward) and reducing the gradient it sends back
    where that comes out partial, receiving the gradients of what later stages read from it
    (backward), and reducing a partial output before it leaves. ``known``: the same of the uses of
    other stages cut from the problem, taken where a use is alike (`SentAlike`)."""
    graph = problem.graph
    known = known if known is not None else SentAlike(tuple(range(problem.size)))
    extra: dict[int, np.ndarray] = {}

    def add(node: int, seconds: np.ndarray) -> None:
        extra[node - first] = extra.get(node - first, 0.0) + seconds

    if index > 0:
        bit = stage_link_bit(problem.mesh_bits, index - 1, index)
        for use in crossings.into:
            if graph.tensor(use.tensor).kind != "input":  # (every stage loads the data it reads)
                for part in known.seconds(problem, use, bit, receiving=True):
                    add(use.dst_node, part)
    if index < shape.stages - 1:
        bit = stage_link_bit(problem.mesh_bits, index, index + 1)
        for use in crossings.out:
            if graph.tensor(use.tensor).kind != "input":
                for part in known.seconds(problem, use, bit, receiving=False):
                    add(use.src_node, part)
    return extra


@dataclass(frozen=True)
class SentAlike:
    """`send_costs` per use, each worked out once for the uses alike: the same operator of a folded run's
    copies (``classes``: per operator, the one in the first copy it is a copy of; itself where none), the same
    slot, tensor shape and type, link and gradient. A cut search asks for hundreds of stages whose cuts
    cross the same tensor of one copy or another (GPT-3 175B: 500 stages, 12 ms each where it worked out
    every candidate's layout again)."""

    classes: Sequence[int]
    found: dict[tuple, tuple[np.ndarray, ...]] = field(default_factory=dict)

    def seconds(self, problem: SearchProblem, use: TensorUse, bit: int, receiving: bool) -> tuple[np.ndarray, ...]:
        """The use's seconds per candidate of its operator, in the parts the stage adds in turn."""
        info = problem.graph.tensor(use.tensor)
        grad = problem.requires_grad.get(use.tensor, False)
        node, slot = (use.dst_node, use.dst_slot) if receiving else (use.src_node, use.src_slot)
        key = (receiving, self.classes[node], slot, use.src_is_output, info.shape, info.dtype, bit, grad)
        if key not in self.found:
            self.found[key] = _received(problem, use, bit) if receiving else _sent(problem, use, bit)
        return self.found[key]


def _received(problem: SearchProblem, use: TensorUse, bit: int) -> tuple[np.ndarray, ...]:
    """Per candidate of the use's reader: seconds to receive it, then to reduce the gradient it sends back."""
    info, rule = problem.graph.tensor(use.tensor), problem.rules[use.dst_node]
    size = problem.itemsize(info)
    local = np.array([rule.input_layout(c, use.dst_slot).local_numel(info.shape) for c in range(len(rule.candidates))])
    seconds = np.asarray(problem.cost.send_time(bit, local * float(size)), dtype=float)
    if problem.requires_grad.get(use.tensor, False) and rule.differentiable:
        return seconds, _partial_gradients(problem, use)
    return (seconds,)


def _sent(problem: SearchProblem, use: TensorUse, bit: int) -> tuple[np.ndarray, ...]:
    """Per candidate of the use's writer: seconds to receive its gradient and to reduce it where it leaves
    partial."""
    info, rule = problem.graph.tensor(use.tensor), problem.rules[use.src_node]
    size = problem.itemsize(info)
    seconds = np.zeros(len(rule.candidates))
    for c in range(len(rule.candidates)):
        layout = problem.source_layout(use, c)
        if problem.requires_grad.get(use.tensor, False):
            seconds[c] += float(problem.cost.send_time(bit, layout.local_numel(info.shape) * float(size)))
        if layout.partial:
            seconds[c] += problem.redistribution(use.tensor, layout, Layout(layout.dims))[1]
    return (seconds,)


def _partial_gradients(problem: SearchProblem, use: TensorUse) -> np.ndarray:
    """Per candidate of the use's consumer: seconds to reduce the gradient it sends back over the bits
    it comes out partial on (the sending stage's own collective, before the send)."""
    rule = problem.rules[use.dst_node]
    seconds = np.zeros(len(rule.candidates))
    known: dict[Layout, float] = {}
    for c, exponents in enumerate(rule.candidates):
        bits = problem.gradient_sync_bits(use.dst_node, exponents, use.dst_slot)
        if bits:
            layout = Layout(rule.input_layout(c, use.dst_slot).dims, bits)
            if layout not in known:
                known[layout] = problem.redistribution(use.tensor, layout, Layout(layout.dims))[1]
            seconds[c] = known[layout]
    return seconds


def _kept_across(problem: SearchProblem, first: int, last: int, crossings: Crossings) -> dict[int, np.ndarray]:
    """Per operator of the stage (its own index), bytes per candidate its activations change by because a
    tensor kept for a backward crosses a cut: the stage that keeps it holds it (the reading stage its
    received copy, at the first reader that keeps it), not the producing one unless it keeps it too."""
    keeps = {node: problem.kept_by_operator[node] for node in range(first, last)}
    for use in problem.fork_uses:  # what a fork's readers keep is its input (`dataflow._kept_for_backward`)
        if use.src_node in keeps and use.tensor in keeps.get(use.dst_node, ()):
            keeps[use.src_node] = keeps[use.src_node] | {problem.rules[use.src_node].op.inputs[0]}
    here = frozenset().union(*keeps.values()) if keeps else frozenset()
    moved: dict[int, np.ndarray] = {}
    done: set[str] = set()
    for use in crossings.out:
        if use.src_is_output and use.tensor in problem.kept and use.tensor not in here and use.tensor not in done:
            done.add(use.tensor)
            moved[use.src_node - first] = moved.get(use.src_node - first, 0.0) - _kept_bytes(problem, use, True)
    for use in sorted(crossings.into, key=lambda u: u.dst_node):
        if use.tensor in keeps[use.dst_node] and use.tensor not in done:
            done.add(use.tensor)
            moved[use.dst_node - first] = moved.get(use.dst_node - first, 0.0) + _kept_bytes(problem, use, False)
    return moved


def _kept_bytes(problem: SearchProblem, use: TensorUse, written: bool) -> np.ndarray:
    """The bytes a device holds of a tensor kept for a backward, per candidate of the operator that writes it
    (``written``) or reads it in ``use``."""
    node, slot = (use.src_node, use.src_slot) if written else (use.dst_node, use.dst_slot)
    rule, info = problem.rules[node], problem.graph.tensor(use.tensor)
    layout = rule.output_layout if written else rule.input_layout
    local = [layout(c, slot).local_numel(info.shape) for c in range(len(rule.candidates))]
    return np.array(local, dtype=float) * problem.kept_itemsize(info)


def kept_sent(problem: SearchProblem, past: Mapping[int, int]) -> dict[int, np.ndarray]:
    """Per operator among ``past``'s keys, per candidate, the bytes of its outputs kept for a backward that an
    operator at ``past[node]`` or after reads: the most a cut at or after that point moves out of the stage
    writing them, per micro-batch it holds (`_kept_across`, where a tensor another operator of the stage keeps
    stays). Operators with none are left out."""
    sent: dict[int, np.ndarray] = {}
    done: set[str] = set()
    for use in problem.uses:
        if use.src_node not in past or use.dst_node < past[use.src_node] or not use.src_is_output:
            continue
        if use.tensor in problem.kept and use.tensor not in done:
            done.add(use.tensor)
            sent[use.src_node] = sent.get(use.src_node, 0.0) + _kept_bytes(problem, use, True)
    return sent


def stage_problem(
    problem: SearchProblem,
    first: int,
    last: int,
    shape: PipelineShape,
    index: int,
    sends: dict[int, np.ndarray] | None = None,
    boundary: bool = True,
    made: dict[tuple, tuple] | None = None,
) -> SearchProblem:
    """Stage ``index`` of ``shape``, operators ``first`` .. ``last - 1`` of a micro-batch's problem, as a
    problem of its own whose objective is the stage's time per step and whose memory is a device's: the
    operators restricted (`SearchProblem.restricted`), then rescaled to the schedule (`_per_step`).
    ``sends``: `send_costs` of the stage, where the caller has them. Without ``boundary`` the tensors it
    reads from before ``first`` and keeps are not counted (a run of operators inside a stage, whose
    producers count them). ``made``: the rescaled arrays of stages made before from ``problem`` (`_per_step`),
    kept by a caller making many, taken again and filled.

    The whole problem of one stage and one micro-batch is the problem itself."""
    if first == 0 and last == problem.size and shape == ONE_STAGE:
        return problem
    crossings = cut_crossings(problem, first, last)
    if sends is None:
        sends = send_costs(problem, crossings, first, index, shape)
    kept = _kept_across(problem, first, last, crossings) if boundary else {}
    held = shape.in_flight(index)
    return _per_step(problem.restricted(first, last), shape.slots, held, sends, kept, {} if made is None else made)


def _per_step(
    part: SearchProblem,
    slots: int,
    held: int,
    sends: Mapping[int, np.ndarray],
    kept: Mapping[int, np.ndarray],
    made: dict[tuple, tuple],
) -> SearchProblem:
    """A stage's operators (``part``, numbered from 0) costed per step of the schedule: each one's time per
    micro-batch and its boundary ``sends`` paid in every one of the ``slots``, its sync once, the edges in
    every slot; its bytes with what crosses the cuts (``kept``, `_kept_across`) and the activations of
    ``held`` micro-batches (recomputing: one block's, of the copies in the stage, and every block's input).
    Each rescaled array is made once (`_Rescaled`)."""
    nodes = range(part.size)
    activations = tuple(part.node_activations[i] + kept[i] if i in kept else part.node_activations[i] for i in nodes)
    own_memory = tuple(part.node_memory[i] + kept[i] if i in kept else part.node_memory[i] for i in nodes)
    rescaled = _Rescaled(slots, held, sends, kept, made)
    per_step, holding = rescaled.per_step, rescaled.holding
    sharded = {
        i: Alternative(
            per_step(alt.time, alt.sync, i),
            per_step(alt.communication, alt.sync, i),
            holding(alt.memory, activations[i], i, kept.get(i, 0.0)),
            alt.hidden,
            alt.sync,
        )
        for i, alt in part.sharded.items()
    }
    # recomputation: one block's activations at a time, the blocks' inputs for every micro-batch held
    recompute_memory = {
        i: rescaled.rebuilt(i, part.recompute_share.get(i), activations[i], freed)
        for i, freed in part.recompute_memory.items()
    }
    return replace(
        part,
        node_time=tuple(per_step(part.node_time[i], part.node_sync[i], i) for i in nodes),
        node_compute=tuple(slots * compute for compute in part.node_compute),
        node_communication=tuple(per_step(part.node_communication[i], part.node_sync[i], i) for i in nodes),
        node_memory=tuple(holding(own_memory[i], activations[i], i) for i in nodes),
        sharded=MappingProxyType(sharded),
        recompute_time=MappingProxyType({i: rescaled.times_slots(t) for i, t in part.recompute_time.items()}),
        recompute_memory=MappingProxyType(recompute_memory),
        factors=rescaled.factors(part.factors),
        recompute_factors=rescaled.factors(part.recompute_factors),
        folds=rescaled.runs(part.folds),
        recompute_folds=rescaled.runs(part.recompute_folds),
        node_activations=activations,
        in_flight=held,
        one_process=False,  # a stage's gradients wait for the last micro-batch's backward
    )


@dataclass(frozen=True)
class _Rescaled:
    """A stage's arrays rescaled to the schedule (`_per_step`). The copies of a folded run share their arrays,
    and so do their rescaled ones: each is made once, kept in ``made`` by the identities of the arrays it is
    made of, which are held with it (none is freed and its id reused), for every stage the caller cuts from
    one problem; an operator whose boundary sends or kept tensors are its own has arrays of its own."""

    slots: int
    held: int
    sends: Mapping[int, np.ndarray]
    kept: Mapping[int, np.ndarray]
    made: dict[tuple, tuple]

    def _once(self, key: tuple, sources: tuple[np.ndarray, ...], make: Callable[[], np.ndarray]) -> np.ndarray:
        if key not in self.made:
            self.made[key] = (sources, make())
        return self.made[key][1]

    def per_step(self, time: np.ndarray, once: np.ndarray, node: int) -> np.ndarray:
        """Time per micro-batch (and its sends) in every slot, the sync once."""
        slots = self.slots
        if node in self.sends:
            return slots * (time - once + self.sends[node]) + once
        return self._once(("step", id(time), id(once), slots), (time, once), lambda: slots * (time - once) + once)

    def holding(
        self, memory: np.ndarray, activations: np.ndarray, node: int, crossing: np.ndarray | float = 0.0
    ) -> np.ndarray:
        """Bytes with ``crossing`` (what crosses a cut) and the activations of every micro-batch held."""
        held = self.held
        if node in self.kept:
            return memory + crossing + (held - 1) * activations
        key = ("held", id(memory), id(activations), held)
        return self._once(key, (memory, activations), lambda: memory + crossing + (held - 1) * activations)

    def rebuilt(self, node: int, share: float | None, activations: np.ndarray, freed: np.ndarray) -> np.ndarray:
        """Recomputing: the bytes freed, with one block's ``share`` of its activations held (none: nothing)."""
        held = self.held
        if share is None:
            return self._once(("none", id(freed)), (freed,), lambda: np.zeros_like(freed))
        if node in self.kept:
            return (share - held) * activations
        return self._once(
            ("rebuilt", id(activations), share, held), (activations,), lambda: (share - held) * activations
        )

    def times_slots(self, array: np.ndarray) -> np.ndarray:
        """Paid in every slot."""
        scale = float(self.slots)
        return self._once(("slots", id(array), self.slots), (array,), lambda: array * scale)

    def factors(self, factors: Sequence[Factor]) -> tuple[Factor, ...]:
        return tuple(Factor(f.scope, f.maps, self.times_slots(f.table)) for f in factors)

    def runs(self, runs: Sequence[tuple[Repeat, RunEdges]]) -> list[tuple[Repeat, RunEdges]]:
        return [(r, e.with_tables([self.times_slots(f.table) for f in e.first])) for r, e in runs]


@dataclass(frozen=True)
class StagePlan:
    """One stage of a pipelined plan: operators ``first`` .. ``last - 1`` of the micro-batch's problem,
    its plan (candidate per operator, in its own indices) and its time per step (``time_s``)."""

    first: int
    last: int
    result: SearchResult
    time_s: float


@dataclass(frozen=True)
class PipelineResult:
    """The stages of a pipelined plan and its step time (the slowest stage's)."""

    shape: PipelineShape
    stages: tuple[StagePlan, ...]

    @property
    def time_s(self) -> float:
        return max(stage.time_s for stage in self.stages)

    @property
    def choice(self) -> tuple[int, ...]:
        """A candidate per operator of the micro-batch's problem, the stages' plans joined."""
        return tuple(c for stage in self.stages for c in stage.result.choice)

    @property
    def choices(self) -> MemoryChoices:
        """The stages' memory choices joined (recomputation if any stage recomputes)."""
        sharded = frozenset(i + s.first for s in self.stages for i in s.result.choices.sharded)
        recompute = any(s.result.choices.recompute for s in self.stages)
        return MemoryChoices(sharded, recompute, self.shape.micro_batches)

    @property
    def starts(self) -> tuple[int, ...]:
        return tuple(stage.first for stage in self.stages)
