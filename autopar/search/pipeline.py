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
stage's plan coming from the exact per-stage search. Stages alike in their operators, reads and
place are searched once.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType

import numpy as np

from autopar.context import planning
from autopar.errors import InfeasibleError
from autopar.layout import Layout
from autopar.search.dataflow import TensorUse, kept_by
from autopar.search.dp import Factor
from autopar.search.driver import NothingFaster, SearchOptions, SearchResult, run_search
from autopar.search.fold import RunEdges, Solver
from autopar.search.ilp import recomputing
from autopar.search.memory import Alternative, MemoryChoices
from autopar.search.problem import SearchProblem
from autopar.search.repeats import Repeat
from autopar.strategy import OpRule

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
    for (src, _), dst in last_read.items():
        if problem.rules[src].spec.gradient_labels:  # a fork's readers meet it in one stage
            inside.update(range(src + 1, dst + 1))
            allowed.difference_update(range(src + 1, dst + 1))
    points = [p for p in range(1, n) if p in allowed or (p not in inside and crossing[p] == 1)]
    return tuple(points)


@dataclass(frozen=True)
class _Crossings:
    """The uses a stage reads from earlier stages (``into``) and writes to later ones (``out``)."""

    into: tuple[TensorUse, ...]
    out: tuple[TensorUse, ...]


def _crossings(problem: SearchProblem, first: int, last: int) -> _Crossings:
    into = tuple(u for u in problem.uses if u.src_node < first <= u.dst_node < last)
    out = tuple(u for u in problem.uses if first <= u.src_node < last <= u.dst_node)
    return _Crossings(into, out)


def _send_costs(
    problem: SearchProblem, crossings: _Crossings, first: int, index: int, shape: PipelineShape
) -> dict[int, np.ndarray]:
    """Per operator of the stage (its own index), seconds per micro-batch its boundary transfers take:
    receiving what it reads from earlier stages (forward) and reducing the gradient it sends back
    where that comes out partial, receiving the gradients of what later stages read from it
    (backward), and reducing a partial output before it leaves."""
    graph, cost = problem.graph, problem.cost
    extra: dict[int, np.ndarray] = {}

    def add(node: int, seconds: np.ndarray) -> None:
        extra[node - first] = extra.get(node - first, 0.0) + seconds

    if index > 0:
        bit = stage_link_bit(problem.mesh_bits, index - 1, index)
        for use in crossings.into:
            info = graph.tensor(use.tensor)
            if info.kind == "input":
                continue  # every stage loads the data it reads
            rule = problem.rules[use.dst_node]
            size = problem.itemsize(info)
            local = np.array(
                [rule.input_layout(c, use.dst_slot).local_numel(info.shape) for c in range(len(rule.candidates))]
            )
            add(use.dst_node, np.asarray(cost.send_time(bit, local * float(size)), dtype=float))
            if problem.requires_grad.get(use.tensor, False) and rule.differentiable:
                add(use.dst_node, _partial_gradients(problem, use))
    if index < shape.stages - 1:
        bit = stage_link_bit(problem.mesh_bits, index, index + 1)
        for use in crossings.out:
            info = graph.tensor(use.tensor)
            if info.kind == "input":
                continue
            rule = problem.rules[use.src_node]
            size = problem.itemsize(info)
            seconds = np.zeros(len(rule.candidates))
            for c in range(len(rule.candidates)):
                layout = problem.source_layout(use, c)
                if problem.requires_grad.get(use.tensor, False):
                    seconds[c] += float(cost.send_time(bit, layout.local_numel(info.shape) * float(size)))
                if layout.partial:
                    seconds[c] += problem.redistribution(use.tensor, layout, Layout(layout.dims))[1]
            add(use.src_node, seconds)
    return extra


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


def _kept_across(problem: SearchProblem, first: int, last: int, crossings: _Crossings) -> dict[int, np.ndarray]:
    """Per operator of the stage (its own index), bytes per candidate its activations change by because a
    tensor kept for a backward crosses a cut: the stage that keeps it holds it (the reading stage its
    received copy, at the first reader that keeps it), not the producing one unless it keeps it too."""
    graph, grad = problem.graph, problem.requires_grad
    keeps = {node: kept_by(problem.rules[node], graph, grad) for node in range(first, last)}
    for use in problem.uses:  # what a fork's readers keep is its input (`dataflow._kept_for_backward`)
        fork = problem.rules[use.src_node]
        if fork.spec.gradient_labels and use.src_node in keeps and use.tensor in keeps.get(use.dst_node, ()):
            keeps[use.src_node] = keeps[use.src_node] | {fork.op.inputs[0]}
    here = frozenset().union(*keeps.values()) if keeps else frozenset()
    moved: dict[int, np.ndarray] = {}
    done: set[str] = set()
    for use in crossings.out:
        if use.src_is_output and use.tensor in problem.kept and use.tensor not in here and use.tensor not in done:
            done.add(use.tensor)
            rule, info = problem.rules[use.src_node], graph.tensor(use.tensor)
            local = [rule.output_layout(c, use.src_slot).local_numel(info.shape) for c in range(len(rule.candidates))]
            moved[use.src_node - first] = moved.get(use.src_node - first, 0.0) - np.array(
                local, dtype=float
            ) * problem.itemsize(info)
    for use in sorted(crossings.into, key=lambda u: u.dst_node):
        if use.tensor in keeps[use.dst_node] and use.tensor not in done:
            done.add(use.tensor)
            rule, info = problem.rules[use.dst_node], graph.tensor(use.tensor)
            local = [rule.input_layout(c, use.dst_slot).local_numel(info.shape) for c in range(len(rule.candidates))]
            moved[use.dst_node - first] = moved.get(use.dst_node - first, 0.0) + np.array(
                local, dtype=float
            ) * problem.itemsize(info)
    return moved


def _restricted_folds(
    problem: SearchProblem, folds: Sequence[tuple[Repeat, RunEdges]], first: int, last: int
) -> tuple[list[Factor], list[tuple[Repeat, RunEdges]], dict[int, int]]:
    """The stage's part of each folded run: its copies inside the stage, still folded, but for a first
    copy that reads a copy of an earlier stage (its edges become plain factors).

    Returns (plain factors, runs, run copies per operator), every scope in the stage's own indices."""
    plain: list[Factor] = []
    runs: list[tuple[Repeat, RunEdges]] = []
    copies_in: dict[int, int] = {}

    def moved(factor: Factor, repeat: Repeat, k: int) -> Factor:
        return Factor(tuple(u - first for u in repeat.shift(factor.scope, k)), factor.maps, factor.table)

    for repeat, edges in folds:
        ks = [k for k in range(repeat.copies) if first <= repeat.block(k).start and repeat.block(k).stop <= last]
        if not ks:
            continue
        for k in ks:
            for node in repeat.block(k):
                copies_in[node - first] = len(ks)
        ka, kb = ks[0], ks[-1] + 1
        c0 = ka if repeat.last(ka - 1) >= first else ka + 1  # the first copy reading a copy of this stage
        pairs = [
            (f, g)
            for f, g in zip(edges.first, edges.later)
            if all(u >= repeat.start - 1 or first <= u < last for u in f.scope)  # its shared operators are here
        ]
        folded = kb - c0 >= 1
        for k in range(ka, kb if not folded else c0):
            for f, g in pairs:
                factor = moved(f if k == 0 else g, repeat, k)
                if all(0 <= u < last - first for u in factor.scope):
                    plain.append(factor)
        if folded:
            start = repeat.start + c0 * repeat.period - first
            shared = tuple(x - first for x in repeat.shared if first <= x < last)
            sub = Repeat(start, repeat.period, kb - c0, shared)
            if c0 == 0:
                run = RunEdges(
                    tuple(moved(f, repeat, 0) for f, _ in pairs), tuple(moved(g, repeat, 0) for _, g in pairs)
                )
            else:
                later = tuple(moved(g, repeat, c0) for _, g in pairs)
                run = RunEdges(later, later)
            runs.append((sub, run))
    return plain, runs, copies_in


def stage_problem(
    problem: SearchProblem,
    first: int,
    last: int,
    shape: PipelineShape,
    index: int,
    sends: dict[int, np.ndarray] | None = None,
    boundary: bool = True,
) -> SearchProblem:
    """Stage ``index`` of ``shape``, operators ``first`` .. ``last - 1`` of a micro-batch's problem, as a
    problem of its own whose objective is the stage's time per step and whose memory is a device's.
    ``sends``: `_send_costs` of the stage, where the caller has them. Without ``boundary`` the tensors it
    reads from before ``first`` and keeps are not counted (a run of operators inside a stage, whose
    producers count them).

    The whole problem of one stage and one micro-batch is the problem itself."""
    if first == 0 and last == problem.size and shape == ONE_STAGE:
        return problem
    slots, held = shape.slots, shape.in_flight(index)
    crossings = _crossings(problem, first, last)
    if sends is None:
        sends = _send_costs(problem, crossings, first, index, shape)
    nodes = range(first, last)

    def per_step(time: np.ndarray, once: np.ndarray, node: int) -> np.ndarray:
        return slots * (time - once + sends.get(node - first, 0.0)) + once

    kept = _kept_across(problem, first, last, crossings) if boundary else {}
    activations = tuple(
        problem.node_activations[i] + kept[i - first] if i - first in kept else problem.node_activations[i]
        for i in nodes
    )
    own_memory = tuple(
        problem.node_memory[i] + kept[i - first] if i - first in kept else problem.node_memory[i] for i in nodes
    )
    node_time = tuple(per_step(problem.node_time[i], problem.node_sync[i], i) for i in nodes)
    node_communication = tuple(per_step(problem.node_communication[i], problem.node_sync[i], i) for i in nodes)
    node_memory = tuple(own_memory[i - first] + (held - 1) * activations[i - first] for i in nodes)
    sharded = {
        i - first: Alternative(
            per_step(alt.time, alt.sync, i),
            per_step(alt.communication, alt.sync, i),
            alt.memory + kept.get(i - first, 0.0) + (held - 1) * activations[i - first],
            alt.hidden,
            alt.sync,
        )
        for i, alt in problem.sharded.items()
        if first <= i < last
    }
    plain, folds, copies_in = _restricted_folds(problem, problem.folds, first, last)
    plain_again, recompute_folds, _ = _restricted_folds(problem, problem.recompute_folds, first, last)
    main = [
        Factor(tuple(u - first for u in f.scope), f.maps, f.table)
        for f in problem.factors
        if all(first <= u < last for u in f.scope)
    ]
    scale = float(slots)

    def scaled(factors: Sequence[Factor]) -> tuple[Factor, ...]:
        return tuple(Factor(f.scope, f.maps, f.table * scale) for f in factors)

    def scaled_runs(runs: Sequence[tuple[Repeat, RunEdges]]) -> list[tuple[Repeat, RunEdges]]:
        return [(r, e.with_tables([f.table * scale for f in e.first])) for r, e in runs]

    # recomputation: one block's activations at a time, the blocks' inputs for every micro-batch held
    recompute_time = {i - first: slots * t for i, t in problem.recompute_time.items() if first <= i < last}
    recompute_memory: dict[int, np.ndarray] = {}
    recompute_share: dict[int, float] = {}
    for i, freed in problem.recompute_memory.items():
        if not first <= i < last:
            continue
        if i in problem.recompute_share:
            share = 1.0 / copies_in.get(i - first, 1)
            recompute_memory[i - first] = (share - held) * activations[i - first]
            recompute_share[i - first] = share
        else:
            recompute_memory[i - first] = np.zeros_like(freed)
    ties = {a - first: b - first for a, b in problem.ties.items() if first <= a < last and first <= b < last}
    for repeat, _ in problem.folds:
        for a, b in problem.ties.items():
            if a in repeat.block(0) and b in repeat.block(0):
                for k in range(1, repeat.copies):
                    a_k, b_k = a + k * repeat.period, b + k * repeat.period
                    if first <= a_k < last and first <= b_k < last:
                        ties[a_k - first] = b_k - first
    uses = tuple(
        TensorUse(u.tensor, u.src_node - first, u.src_slot, u.src_is_output, u.dst_node - first, u.dst_slot)
        for u in problem.uses
        if first <= u.src_node < last and first <= u.dst_node < last
    )
    owner = {name: (node - first, slot) for name, (node, slot) in problem.owner.items() if first <= node < last}
    return replace(
        problem,
        rules=problem.rules[first:last],
        uses=uses,
        owner=MappingProxyType(owner),
        fixed=frozenset(i - first for i in problem.fixed if first <= i < last),
        node_time=node_time,
        node_compute=tuple(slots * problem.node_compute[i] for i in nodes),
        node_communication=node_communication,
        node_memory=node_memory,
        node_hidden=problem.node_hidden[first:last],
        node_sync=problem.node_sync[first:last],
        sharded=MappingProxyType(sharded),
        recompute_time=MappingProxyType(recompute_time),
        recompute_memory=MappingProxyType(recompute_memory),
        recompute_share=MappingProxyType(recompute_share),
        factors=scaled(main + plain),
        recompute_factors=scaled(main + plain_again) if plain_again else (),
        folds=scaled_runs(folds),
        recompute_folds=scaled_runs(recompute_folds),
        unfolded=(),
        blocks=(),
        ties=MappingProxyType(ties),
        node_activations=activations,
        in_flight=held,
    )


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


class _StageSearch:
    """Each stage's exact plan, searched once per kind of stage: stages alike in their operators
    (copies of one block count alike), in what crosses their cuts and in their place in the
    pipeline have the same plan."""

    def __init__(
        self,
        problem: SearchProblem,
        shape: PipelineShape,
        options: SearchOptions,
    ) -> None:
        self.problem, self.shape, self.options = problem, shape, options
        self.recompute = options.recompute
        self.hint = options.hint  # the memory weight the last stage that memory bound settled on
        classes = list(range(problem.size))
        for repeat, _ in problem.folds:
            for k in range(1, repeat.copies):
                for node in repeat.block(k):
                    classes[node] = node - k * repeat.period
        self.classes = classes
        self.found: dict[tuple, tuple[float, SearchResult | None]] = {}
        self.searches = 0
        self.copies: tuple[tuple[range, float], ...] = ()  # `_copy_floors`, once the cut search asks for them
        self._copy_bounds: dict[tuple, float] = {}  # `_copy_lagrangian`'s

    def _key(self, first: int, last: int, index: int, crossings: _Crossings) -> tuple:
        graph = self.problem.graph

        def what(use: TensorUse) -> tuple:
            info = graph.tensor(use.tensor)
            grad = self.problem.requires_grad.get(use.tensor, False)
            return (info.kind, info.shape, info.dtype, grad, use.tensor in self.problem.kept)

        into = tuple(sorted((u.dst_node - first, u.dst_slot, *what(u)) for u in crossings.into))
        out = tuple(sorted((u.src_node - first, u.src_slot, u.src_is_output, *what(u)) for u in crossings.out))
        receives = stage_link_bit(0, index - 1, index) if index > 0 else None
        sends = stage_link_bit(0, index, index + 1) if index < self.shape.stages - 1 else None
        place = (self.shape.in_flight(index), receives, sends)
        return (tuple(self.classes[first:last]), into, out, place)

    def _refuted_at_hint(self, stage: SearchProblem, first: int, last: int, index: int, beat: float) -> bool:
        """Whether the Lagrangian bound at the hint's memory weight (`_stage_floor`), recomputing or not,
        shows that no plan of the stage that fits beats ``beat``: where memory binds, this refutes a cut
        whose walk would take two DP runs or more, with none (the copies' bounds are shared by every cut)."""
        weight, held = self.hint, self.shape.in_flight(index)
        blocks = [block for block, _ in self.copies if first <= block.start and block.stop <= last]
        # a tensor kept by a later stage is not counted where it is made (`_kept_across`): the copy's own
        # bound, which counts it, is lowered by the most that frees at its operators in this stage
        freed = [
            weight
            * held
            * sum(
                max(0.0, -float(np.min(stage.node_activations[i - first] - self.problem.node_activations[i])))
                for i in block
            )
            for block in blocks
        ]
        for recompute in recomputing(stage, self.recompute):
            within = tuple(
                (
                    range(block.start - first, block.stop - first),
                    self._copy_lagrangian(block, index, weight, recompute) - less,
                )
                for block, less in zip(blocks, freed)
            )
            if not within or _stage_floor(stage, within, weight, recompute) < beat:
                return False
        return True

    def _copy_lagrangian(self, block: range, index: int, weight: float, recompute: bool) -> float:
        """A lower bound on the Lagrangian (time + ``weight`` x memory) of one copy of a folded block, its
        operators and the edges among them, in stage ``index`` wherever the cuts put it: one DP run over
        the copy as a stage's operators are costed (`stage_problem`, its micro-batches in flight), without
        what only a stage's boundary adds or takes away (sends, kept tensors: `_refuted_at_hint` takes the
        latter off), and, recomputing, with no share of the one block's activations held at a time (which
        depends on how many copies the stage has). Once per copy kind, stage place, weight and way."""
        key = (self.classes[block.start], self.shape.in_flight(index), weight, recompute)
        if key not in self._copy_bounds:
            copy = stage_problem(self.problem, block.start, block.stop, self.shape, index, {}, boundary=False)
            unary = copy.lagrangian(weight, recompute)[0]
            if recompute:
                for node, share in copy.recompute_share.items():
                    unary[node] = unary[node] - weight * share * copy.node_activations[node]
            self._copy_bounds[key] = _least_below(copy, unary, recompute)
        return self._copy_bounds[key]

    def time(self, first: int, last: int, index: int, beat: float = math.inf) -> tuple[float, SearchResult | None]:
        """The stage's time per step and plan (infinite and None when nothing fits). A stage whose lower
        bound (`_stage_floor`) is no faster than ``beat`` is not searched: its bound comes back, with no
        plan."""
        crossings = _crossings(self.problem, first, last)
        key = self._key(first, last, index, crossings)
        hit = self.found.get(key)
        if hit is not None and (hit[1] is not None or math.isinf(hit[0]) or hit[0] >= beat):
            return hit
        sends = _send_costs(self.problem, crossings, first, index, self.shape)
        stage = stage_problem(self.problem, first, last, self.shape, index, sends)
        floor = _stage_floor(stage, _copies_in(self.copies, first, last, sends, self.shape.slots))
        if floor >= beat:
            self.found[key] = (floor, None)
            return floor, None
        if self.hint > 0.0 and beat < math.inf and self._refuted_at_hint(stage, first, last, index, beat):
            self.found[key] = (beat, None)  # no plan of the stage that fits beats ``beat``: a bound
            return beat, None
        self.searches += 1
        try:
            result = run_search(stage, dataclasses.replace(self.options, bound=beat, hint=self.hint))
        except NothingFaster:
            hit = (beat, None)  # no plan of the stage beats ``beat``: a bound, as the floor's
            self.found[key] = hit
            return hit
        except InfeasibleError:
            hit = (math.inf, None)
        else:
            hit = (stage.objective(result.choice, result.choices), result)
            self.hint = result.memory_multiplier or self.hint
        self.found[key] = hit
        return hit


@planning
def search_stages(
    problem: SearchProblem,
    shape: PipelineShape,
    options: SearchOptions | None = None,
    starts: Sequence[int] | None = None,
) -> PipelineResult | None:
    """The fastest pipelined plan of one micro-batch's problem (``problem``, on one stage's devices)
    with ``shape``'s stages and micro-batches: the cuts (or the given ``starts``, each stage's first
    operator) and every stage's plan. None when no cut gives a plan that fits and is faster than
    ``options.bound`` seconds; the other `SearchOptions` are every stage's.

    Exact: the cuts are a DP over the cut points minimising the slowest stage (min-max over a chain),
    each stage's time the exact per-stage search's; among equally fast cuts, `_min_max_search`'s rule
    picks. A stage is searched only when lower bounds leave it a chance to beat the best plan found so
    far: its own (`_stage_floor`) and, for the stages before and after it, the sum of their operators'
    least time per micro-batch, times the slots, each whole copy of a folded block counted at
    `_copy_floors`' bound where that is larger."""
    options = options or SearchOptions()
    bound = options.bound
    search = _StageSearch(problem, shape, options)
    n, count = problem.size, shape.stages
    if starts is not None:
        return _assemble(search, [*starts, n], bound)
    points = [0, *cut_points(problem), n]
    floors = _shape_floors(problem, shape, points, bound)
    if floors.seconds >= bound:
        return None  # not even the stages' lower bounds leave one fast enough (or no cut fits)
    search.copies = floors.copies
    least, last = floors.least, len(points) - 1

    def floor(a: int, b: int) -> float:  # no stage over points a..b is faster
        return float(least[points[b]] - least[points[a]])

    # first the cuts that balance the stages' lower bounds: their plan bounds the exact search
    probe = _assemble(search, [points[b] for b in _min_max_cuts(floor, count, last)], bound)
    if probe is not None:  # its ties too: the exact search's rule, not the bounds', picks among equal cuts
        bound = probe.time_s * (1 + 1e-12)
    exact = _min_max_search(search, points, count, floor, bound)
    return exact if exact is not None else probe


@dataclass(frozen=True)
class _ShapeFloors:
    """What bounds a shape's plans from below before any stage is searched (`_shape_floors`)."""

    seconds: float  # no cuts at the points give a faster plan (infinite: none has the stages, or fits)
    least: np.ndarray  # sums over the operators before each one of their least time per step
    copies: tuple[tuple[range, float], ...]  # `_copy_floors`


def _shape_floors(
    problem: SearchProblem, shape: PipelineShape, points: Sequence[int], bound: float = math.inf
) -> _ShapeFloors:
    """The lower bounds `search_stages` refutes a shape by, cheapest first, stopping at one no less than
    ``bound``: too few points for the stages, or every cut leaves a stage that does not fit
    (`_no_cut_fits`: infinite); the least fullest stage with each operator at its least time; the same
    with each whole copy of a folded block at its `_copy_floors` bound where that is larger."""
    n, count = problem.size, shape.stages
    if len(points) - 1 < count or _no_cut_fits(problem, shape, points):
        return _ShapeFloors(math.inf, np.zeros(n + 1), ())
    each = [_least(problem, i, shape.slots) for i in range(n)]
    least = np.concatenate([[0.0], np.cumsum(each)])
    seconds = _least_fullest_stage([least[points]] * count)
    if seconds >= bound:
        return _ShapeFloors(seconds, least, ())
    copies = _copy_floors(problem, shape, points)
    if not copies:
        return _ShapeFloors(seconds, least, copies)
    for block, copy_least in copies:  # a cut never splits a copy: its least counts as a whole
        each[block.start : block.stop] = [max(copy_least, sum(each[block.start : block.stop]))] + [0.0] * (
            len(block) - 1
        )
    least = np.concatenate([[0.0], np.cumsum(each)])
    return _ShapeFloors(_least_fullest_stage([least[points]] * count), least, copies)


def _no_cut_fits(problem: SearchProblem, shape: PipelineShape, points: Sequence[int]) -> bool:
    """Whether every cut at ``points`` leaves a stage whose leanest memory (`_leanest_memory`) is more than a
    device holds. Where the whole problem's memory floor times the first stage's micro-batches fits, as in
    most searches, no stage's bound can exceed the capacity (each operator's is between 0 and that many
    times its leanest bytes, activations being part of them), so the min-max over the cuts is skipped."""
    capacity = problem.cost.capacity * (1 + 1e-9)
    if shape.in_flight(0) * problem.memory_floor(False) <= capacity:
        return False
    return _least_fullest_stage(_leanest_memory(problem, shape, points)) > capacity


def _least_fullest_stage(prefixes: Sequence[np.ndarray]) -> float:
    """The least, over cuts at the points, of the largest stage, stage i over points a .. b costing
    ``prefixes[i][b] - prefixes[i][a]``: the min-max DP over a chain, a whole row of points at a time
    (a stage count of 128 over 200 points is 2.5 million pairs). The stages' time floors and their
    leanest memory (`_no_cut_fits`) both take it.

    >>> float(_least_fullest_stage([np.array([0.0, 1.0, 3.0, 4.0])] * 2))
    3.0
    """
    first = prefixes[0]
    best = first - first[0]  # stage 0 ending at each point
    best[0] = np.inf  # a stage has at least one step between its points
    below = np.tril(np.ones((len(first), len(first)), dtype=bool))  # a stage ends after it starts
    for prefix in prefixes[1:]:
        ending = np.maximum(best[:, None], prefix[None, :] - prefix[:, None])  # [start, end]
        ending[below] = np.inf
        best = ending.min(axis=0)
    return float(best[-1])


def _leanest_memory(problem: SearchProblem, shape: PipelineShape, points: Sequence[int]) -> list[np.ndarray]:
    """Per stage index, the sums at each of the ``points`` of a lower bound on the bytes each operator
    before it adds to a device of that stage: a stage over points ``a`` .. ``b`` holds at least the
    difference of the two. The bound holds for every plan, memory choice and cut at ``points``
    (`stage_problem`'s memory, operator by operator): the stage's own parameters, inputs and activations,
    the latter for each micro-batch it holds, with recomputation the whole run's share of one block's
    (1 / its copies, no more than any stage's). An operator with a kept output some later point may put
    in another stage (`_kept_across` moves it there) is counted without its activations at all: what a
    stage receives only adds.

    Refuting a shape by this takes a min-max over the points where searching it takes a stage problem and
    a DP run or more for every pair of points (ResNet-50 at a batch no stage count holds: seconds each)."""
    n = problem.size
    moving: set[int] = set()  # operators with a kept output some point may put in another stage
    for use in problem.uses:
        after = bisect.bisect_right(points, use.src_node)  # the first point after the writer
        if after < len(points) and points[after] <= use.dst_node and use.src_is_output and use.tensor in problem.kept:
            moving.add(use.src_node)
    helds = sorted({shape.in_flight(index) for index in range(shape.stages)})
    more = np.asarray(helds, dtype=float) - 1.0  # micro-batches held beyond the first
    each = np.zeros((n, len(helds)))
    alike: dict[tuple, np.ndarray] = {}  # the copies of a folded run share their arrays
    for i in range(n):
        memory, activations = problem.node_memory[i], problem.node_activations[i]
        alternative = problem.sharded[i].memory if i in problem.sharded else None
        share, moves = problem.recompute_share.get(i), i in moving
        key = (id(memory), id(activations), id(alternative), share, moves)
        if key not in alike:
            least = np.full(len(helds), np.inf)
            for base in (memory,) if alternative is None else (memory, alternative):
                if moves:  # its activations may all move: only what it holds besides counts
                    least = np.minimum(least, float((base - activations).min()))
                    continue
                least = np.minimum(least, (base[:, None] + activations[:, None] * more[None, :]).min(axis=0))
                if share is not None:  # one block's share, the stage's no less than the whole run's
                    least = np.minimum(least, float((base - (1.0 - share) * activations).min()))
            alike[key] = least
        each[i] = alike[key]
    at = {held: np.concatenate([[0.0], np.cumsum(each[:, k])])[list(points)] for k, held in enumerate(helds)}
    return [at[shape.in_flight(index)] for index in range(shape.stages)]


def _copy_floors(
    problem: SearchProblem, shape: PipelineShape, points: Sequence[int]
) -> tuple[tuple[range, float], ...]:
    """Every copy of each folded run none of whose copies a cut point splits, with a lower bound on the time
    per step of its operators and the edges among them in any stage of ``shape``: one DP run over one
    copy per run, memory aside (less a billionth, for rounding).

    Copies are alike (their operators' costs and their edges among them are one table), and a stage's
    cost of a copy is at least this: only the edges from outside the copy (the previous copy's, the
    shared operators'), the sends of a stage's boundary and recomputed forwards are left out, and those
    cost nothing less than zero. Where the best plan repeats one
    copy's layouts, as a uniform stack of layers does, the stage's time is within a few percent of the
    sum of its copies' bounds, where the operators' least times, each taken alone, fall a fifth short
    (76.1B GPT, 2 stages): the cut search then refutes most cuts without a DP run of their own."""
    found: list[tuple[range, float]] = []
    for repeat, _ in problem.folds:
        copies = [repeat.block(k) for k in range(repeat.copies)]
        if repeat.copies < 2 or any(block.start < p < block.stop for block in copies for p in points):
            continue
        one = repeat.block(1)
        copy = stage_problem(problem, one.start, one.stop, PipelineShape(1, shape.slots), 0)
        least = _least_below(copy, copy.lagrangian(0.0, False)[0], False)
        found.extend((block, least) for block in copies)
    return tuple(found)


def _least_below(problem: SearchProblem, unary: Sequence[np.ndarray], recompute: bool) -> float:
    """The least of ``unary`` plus every edge cost (recomputed forwards paid twice with ``recompute``) over
    the problem's plans, by one exact DP run, less a billionth of it for rounding: a bound that stays below."""
    solver = Solver.of(problem)
    solver.bind(problem.main_factors(recompute), problem.recompute_folds if recompute else problem.folds)
    choice = solver.minimise(unary)
    least = sum(float(u[c]) for u, c in zip(unary, choice))
    least += sum(factor.value([choice[u] for u in scope]) for factor, scope in problem.all_factors(recompute))
    return least - 1e-9 * abs(least)


def _copies_in(
    copies: Sequence[tuple[range, float]], first: int, last: int, sends: dict[int, np.ndarray], slots: int
) -> tuple[tuple[range, float], ...]:
    """The copies (`_copy_floors`) wholly in the stage of operators ``first`` .. ``last - 1``, in its own
    indices, each bound raised by the least its operators' boundary ``sends`` add, once per slot."""
    found = []
    for block, least in copies:
        if first <= block.start and block.stop <= last:
            inside = range(block.start - first, block.stop - first)
            found.append((inside, least + sum(slots * float(np.min(sends[i])) for i in inside if i in sends)))
    return tuple(found)


def _min_max_cuts(cost: Callable[[int, int], float], count: int, last: int) -> list[int]:
    """The cut points (indices, 0 and ``last`` included) that minimise the largest ``cost`` of a stage
    over ``count`` stages: a min-max DP over a chain (Alpa and PipeDream partition so)."""
    best = [[math.inf] * (last + 1) for _ in range(count)]
    came = [[0] * (last + 1) for _ in range(count)]
    for b in range(1, last + 1):
        best[0][b] = cost(0, b)
    for index in range(1, count):
        for b in range(index + 1, last + 1):
            for a in range(index, b):
                value = max(best[index - 1][a], cost(a, b))
                if value < best[index][b]:
                    best[index][b], came[index][b] = value, a
    cuts = [last]
    for index in range(count - 1, 0, -1):
        cuts.append(came[index][cuts[-1]])
    return [0, *reversed(cuts)]


def _min_max_search(
    search: _StageSearch, points: Sequence[int], count: int, floor: Callable[[int, int], float], bound: float
) -> PipelineResult | None:
    """The exact min-max DP over the cut points, each stage searched only where its lower bound and
    those of the stages around it leave it a chance to beat ``bound`` (None: nothing does).

    Top down, from the last stage: the cuts of stages 0..i ending at a point are the best over where
    stage i starts of the slower of stage i and the best cuts of the stages before it. Of those two,
    the one more likely to lose (the larger lower bound) is searched first, told the best found so far:
    where it cannot beat that (a DP run or two, often none), the other is never searched. Searching
    every earlier stage at every end first, as a bottom-up DP does, searched most of them in full only
    to find the last stage could not beat the best found anyway (76.1B GPT, 2 stages: 10 of 19 stage
    searches). Where cuts tie, each stage starts at the first place, in order, of the least: for the
    last stage, then for the stages before it given that start."""
    last = len(points) - 1
    cuts = _Cuts(search, points, floor)
    if not cuts.best_before(count - 1, last, bound) < bound:
        return None
    ends = [last]
    for index in range(count - 1, 0, -1):
        ends.append(cuts.known[(index, ends[-1])][1])
    return _assemble(search, [points[b] for b in [0, *reversed(ends)]], bound)


@dataclass
class _Cuts:
    """`_min_max_search`'s DP: its memo and its recursion (a method, not a closure calling itself, whose
    cell would hold the stage search, and every stage problem it holds, in a cycle only the collector frees)."""

    search: _StageSearch
    points: Sequence[int]
    floor: Callable[[int, int], float]
    # (stage index, end) -> (the least slowest stage, where that stage starts, the bound it was told):
    # exact where below its bound, else only known to be no less
    known: dict[tuple[int, int], tuple[float, int, float]] = field(default_factory=dict)

    def lower(self, index: int, b: int) -> float:
        """No cuts of stages 0..index ending at point b are faster: the slowest is no faster than the average."""
        return self.floor(0, b) / (index + 1)

    def best_before(self, index: int, b: int, beat: float) -> float:
        search, points, floor = self.search, self.points, self.floor
        hit = self.known.get((index, b))
        if hit is not None and (hit[0] < hit[2] or hit[0] >= beat):
            return hit[0]
        if index == 0:
            found, came = search.time(points[0], points[b], 0, beat)[0], 0
        else:
            found, came = beat, -1
            for a in range(index, b):
                before, own = self.lower(index - 1, a), floor(a, b)
                if max(before, own) >= found:
                    continue  # cannot beat the best found
                if own >= before:  # the stage first: it is the likelier to lose
                    seconds = search.time(points[a], points[b], index, found)[0]
                    value = max(seconds, self.best_before(index - 1, a, found)) if seconds < found else seconds
                else:
                    before = self.best_before(index - 1, a, found)
                    value = (
                        max(before, search.time(points[a], points[b], index, found)[0]) if before < found else before
                    )
                if value < found:
                    found, came = value, a
        self.known[(index, b)] = (found, came, beat)
        return found


def _least(problem: SearchProblem, node: int, slots: int = 1) -> float:
    """An operator's least time per step over its candidates (with or without a parallel optimizer),
    its time per micro-batch paid ``slots`` times and its time per step once."""
    arrays = [(problem.node_time[node], problem.node_sync[node])]
    if node in problem.sharded:
        alternative = problem.sharded[node]
        arrays.append((alternative.time, alternative.sync))
    return max(0.0, min(float(np.min(slots * (time - once) + once)) for time, once in arrays))


def _stage_floor(
    stage: SearchProblem, copies: Sequence[tuple[range, float]] = (), weight: float = 0.0, recompute: bool = False
) -> float:
    """A lower bound on a stage's time: each operator at its least cost counting, per candidate, the least
    each edge into it costs (every edge counted once, at its last operator), memory and recomputation
    aside. Given ``copies`` (ranges of the stage's operators, each with a lower bound on their costs and
    the edges among them: `_copy_floors`), the same with each copy's bound and the least of the edges
    into it counted instead of its operators', where that is larger.

    With a memory ``weight``, the same of the Lagrangian (time + weight x memory, recomputing or not as
    ``recompute`` says) less weight x the capacity: no plan of that kind that fits is faster (the copies'
    bounds then of the same Lagrangian, `_StageSearch._copy_lagrangian`)."""
    copy_of = np.full(stage.size, -1)
    for number, (block, _) in enumerate(copies):
        copy_of[block.start : block.stop] = number
    extra: list[np.ndarray | float] = [0.0] * stage.size
    outside: list[np.ndarray | float] = [0.0] * stage.size  # ``extra`` less the edges inside a copy
    least: dict[int, np.ndarray] = {}  # per factor table: its minimum over every axis but the last operator's
    unary = stage.lagrangian(weight, recompute)[0]
    for factor, scope in stage.all_factors(recompute):
        at = int(np.argmax(scope))
        key = id(factor.table) * 8 + at
        if key not in least:
            axes = tuple(axis for axis in range(factor.table.ndim) if axis != at)
            least[key] = factor.table.min(axis=axes) if axes else factor.table
        extra[scope[at]] = extra[scope[at]] + least[key][factor.maps[at]]
        if copy_of[scope[at]] < 0 or any(copy_of[u] != copy_of[scope[at]] for u in scope):
            outside[scope[at]] = outside[scope[at]] + least[key][factor.maps[at]]
    alone, counted = 0.0, sum(bound for _, bound in copies)
    for node in range(stage.size):
        own = float(np.min(unary[node] + extra[node]))
        alone += own
        counted += float(np.min(outside[node])) if copy_of[node] >= 0 else own
    return max(max(alone, counted) - weight * stage.cost.capacity, 0.0)


def _assemble(search: _StageSearch, bounds: Sequence[int], bound: float) -> PipelineResult | None:
    """The plan of given cuts (None: a stage does not fit)."""
    stages = []
    for index in range(search.shape.stages):
        seconds, result = search.time(bounds[index], bounds[index + 1], index, bound)
        if result is None or seconds >= bound:
            return None
        stages.append(StagePlan(bounds[index], bounds[index + 1], result, seconds))
    return PipelineResult(search.shape, tuple(stages))


def compute_floor(problem: SearchProblem) -> float:
    """Seconds of forward and backward compute one device needs at least, were the whole problem's
    work spread over it alone at each operator's best rate (its FLOPs at the fastest rate its class
    reaches, or its bytes at the memory bandwidth, whichever is slower).

    Work is at most linear in the batch and a stage splits it over at most its devices, so
    ``shape_floor`` of this bounds every plan of a pipeline shape from below. A matmul's best rate is
    the fastest its smallest dimension allows (`CostModel.fastest_matmul_rate_up_to`): on a device,
    and at a smaller micro-batch, each of its dimensions is at most the whole one, so its smallest is
    too (`costing.matmul_smallest_dim`; attention's head dimension keeps its products off the peak)."""
    cost = problem.cost
    total = 0.0
    for node, rule in enumerate(problem.rules):
        spec = rule.spec
        if spec.op_class == "free":
            continue
        if spec.matmul_labels is not None:
            rate = cost.fastest_matmul_rate_up_to(_smallest_dim(rule))
        else:
            rate = cost.cube_flops if spec.op_class == "cube" else cost.vector_flops
        traffic = sum(
            problem.graph.tensor(name).numel * problem.itemsize(problem.graph.tensor(name))
            for name in (*rule.op.inputs, *rule.op.outputs)
            if name
        )
        forward = max(rule.op.flops / rate, traffic / cost.memory_bandwidth)
        total += forward * (1.0 + cost.backward_factor * problem.backward_passes(node))
    return total


def _smallest_dim(rule: OpRule) -> float:
    """The smallest of a matmul's M, N and K, whole (an absent one, or one of unknown size, counts 1), as
    `costing.matmul_smallest_dim` takes it with no dimension split."""
    smallest = math.inf
    for label in rule.spec.matmul_labels or ():
        sizes = rule.label_sizes.get(label, set()) if label is not None else set()
        if label is None or not sizes:
            return 1.0
        smallest = min(smallest, float(max(sizes)))
    return smallest


def shape_floor(floor: float, num_devices: int, shape: PipelineShape) -> float:
    """A lower bound on any plan's step with ``shape`` on ``num_devices`` devices, from `compute_floor`
    of the whole batch: the slowest stage is no faster than the average, (M + S - 1) slots of
    1/S of the work of one micro-batch spread over N/S devices.

    >>> shape_floor(8.0, 8, PipelineShape(2, 4)) == 8.0 / 8 * 5 / 4
    True
    """
    return floor * shape.slots / (shape.micro_batches * num_devices)
