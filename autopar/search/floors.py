"""Lower bounds on pipelined plans: no plan of a shape, a cut or a stage is faster than these.

The shape search (`autopar.search.shape_search`) skips a shape by `shape_floor`, or by `time_floors` of
a relaxation of a shape built before (a larger micro-batch, on as many stages); the cut search
(`autopar.search.cuts`) skips a cut by `shape_floors` and a stage by `stage_floor`, each bound
taken from the costs of the problem itself, so a skipped shape, cut or stage is one the exact
search would not have picked.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from autopar.search.dp import Elimination
from autopar.search.fold import Solver
from autopar.search.ilp import recomputing
from autopar.search.pipeline import PipelineShape, kept_sent, stage_problem
from autopar.search.problem import SearchProblem
from autopar.strategy import OpRule


@dataclass(frozen=True)
class ShapeFloors:
    """What bounds a shape's plans from below before any stage is searched (`shape_floors`)."""

    seconds: float  # no cuts at the points give a faster plan (infinite: none has the stages, or fits)
    least: np.ndarray  # sums over the operators before each one of their least time per step
    copies: tuple[tuple[range, float], ...]  # `copy_floors`


CopyTime = Callable[[range], float]
"""A lower bound on the time per step of one copy of a folded block, its operators and the edges among them, in
any stage of a shape, memory aside (`copy_floors`): the cut search's own (`_StageSearch.copy_time`), whose copy
problem and planned elimination its memory floors then take again."""


def shape_floors(
    problem: SearchProblem,
    shape: PipelineShape,
    points: Sequence[int],
    bound: float = math.inf,
    copy_time: CopyTime | None = None,
) -> ShapeFloors:
    """The lower bounds `search_stages` refutes a shape by, cheapest first, stopping at one no less than
    ``bound``: too few points for the stages, or every cut leaves a stage that does not fit
    (`_no_cut_fits`: infinite); then `time_floors`."""
    if len(points) - 1 < shape.stages or _no_cut_fits(problem, shape, points):
        return ShapeFloors(math.inf, np.zeros(problem.size + 1), ())
    return time_floors(problem, shape, points, bound, copy_time)


def time_floors(
    problem: SearchProblem,
    shape: PipelineShape,
    points: Sequence[int],
    bound: float = math.inf,
    copy_time: CopyTime | None = None,
) -> ShapeFloors:
    """`shape_floors` memory aside, stopping at one no less than ``bound``: too few points for the stages
    (infinite); the least fullest stage with each operator at its least time; the same with each whole copy
    of a folded block at its `copy_floors` bound where that is larger."""
    n, count = problem.size, shape.stages
    if len(points) - 1 < count:
        return ShapeFloors(math.inf, np.zeros(n + 1), ())
    each = [_least(problem, i, shape.slots) for i in range(n)]
    least = np.concatenate([[0.0], np.cumsum(each)])
    seconds = least_fullest([least[points]] * count)[0]
    if seconds >= bound:
        return ShapeFloors(seconds, least, ())
    copies = copy_floors(problem, shape, points, copy_time)
    if not copies:
        return ShapeFloors(seconds, least, copies)
    for block, copy_least in copies:  # a cut never splits a copy: its least counts as a whole
        each[block.start : block.stop] = [max(copy_least, sum(each[block.start : block.stop]))] + [0.0] * (
            len(block) - 1
        )
    least = np.concatenate([[0.0], np.cumsum(each)])
    return ShapeFloors(least_fullest([least[points]] * count)[0], least, copies)


def _no_cut_fits(problem: SearchProblem, shape: PipelineShape, points: Sequence[int]) -> bool:
    """Whether every cut at ``points`` leaves a stage whose leanest memory (`leanest_memory`) is more than a
    device holds. Where the whole problem's memory floor times the first stage's micro-batches fits, as in
    most searches, no stage's bound can exceed the capacity (each operator's is between 0 and that many
    times its leanest bytes, activations being part of them), so the min-max over the cuts is skipped."""
    capacity = problem.cost.capacity * (1 + 1e-9)
    if shape.in_flight(0) * problem.memory_floor(False) <= capacity:
        return False
    return least_fullest(leanest_memory(problem, shape, points))[0] > capacity


def least_fullest(prefixes: Sequence[np.ndarray]) -> tuple[float, list[int]]:
    """The least, over cuts at the points, of the largest stage, stage i over points a .. b costing
    ``prefixes[i][b] - prefixes[i][a]``, and the cuts that give it (point indices, the first and last
    included; among equal cuts, each stage from the last back starts at the first place of the least):
    the min-max DP over a chain (Alpa and PipeDream partition so), a whole row of points at a time (a
    stage count of 128 over 200 points is 2.5 million pairs). The stages' time floors, the cuts that
    balance them and the stages' leanest memory (`_no_cut_fits`) all take it.

    >>> least_fullest([np.array([0.0, 1.0, 3.0, 4.0])] * 2)
    (3.0, [0, 1, 3])
    """
    return least_slowest(len(prefixes), lambda i: prefixes[i][None, :] - prefixes[i][:, None])


def least_slowest(count: int, stage: Callable[[int], np.ndarray]) -> tuple[float, list[int]]:
    """`least_fullest` of ``count`` stages, stage i over points a .. b costing ``stage(i)[a, b]`` (a cost
    that need not be a difference of sums: `MemoryFloors` takes the best of several per stage).

    >>> cost = np.array([[0.0, 1.0, 5.0], [0.0, 0.0, 2.0], [0.0, 0.0, 0.0]])
    >>> least_slowest(2, lambda i: cost)
    (2.0, [0, 1, 2])
    """
    bests, came = slowest_before(count, stage)
    cuts = [len(bests[-1]) - 1]
    for starts in reversed(came):
        cuts.append(int(starts[cuts[-1]]))
    return float(bests[-1][-1]), [0, *reversed(cuts)]


def slowest_before(count: int, stage: Callable[[int], np.ndarray]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """`least_slowest`'s DP: per stage i, the least slowest of stages 0 .. i ending at each point (infinite where
    none), and per stage after the first, where it starts for each point it ends at."""
    best = stage(0)[0].copy()  # stage 0 ending at each point
    best[0] = np.inf  # a stage has at least one step between its points
    below = np.tril(np.ones((len(best), len(best)), dtype=bool))  # a stage ends after it starts
    bests, came = [best], []
    for index in range(1, count):
        ending = np.maximum(bests[-1][:, None], stage(index))  # [start, end]
        ending[below] = np.inf
        came.append(ending.argmin(axis=0))
        bests.append(ending.min(axis=0))
    return bests, came


CopyBound = Callable[[range, int, float, bool, bool], float]
"""A lower bound on the Lagrangian of one copy of a folded block in a stage of a shape: given the copy, the
stage's index, the memory weight, whether the stage recomputes and whether the copy ends its stage (its
kept outputs then sent on: `pipeline.kept_sent`). The cut search's `_StageSearch._copy_lagrangian`."""


class MemoryFloors:
    """A step no cut of a shape at ``points`` beats, memory counted: `time_floors` made tighter where memory binds.

    A stage's plan that fits is no slower than its Lagrangian less the weight times the capacity, at every
    memory weight (time + weight x bytes, `stage_floor`'s), whichever way it recomputes. So each stage over
    points a .. b is bounded by the least, over the ways to recompute, of the largest over the weights added
    (`add`) of: its copies' bounds (`CopyBound`, the one ending the stage with its kept outputs sent on) and
    the least Lagrangian of each other operator (its kept outputs read past the next point sent on), less the
    weight times the capacity; and by its time floor. The min-max over the cuts of those (`least_slowest`) bounds
    every plan of the shape. A stage's place counts: the first holds the most micro-batches, so it binds
    where memory does, and only the first `_PLACES` places are bounded so (the rest by their time floors).

    GPT-3 175B on 1,024 Ascend 910s, 4 stages x 64 micro-batches: 57.4 s against its time floor's 54.1 s
    (its plan 60.8 s, the best shape's 57.3 s), where refuting it took a cut search of 2 s. A copy's bound at
    a place between the first and the last bounded is read off those two (`_copy`), not run."""

    def __init__(
        self,
        problem: SearchProblem,
        shape: PipelineShape,
        points: Sequence[int],
        times: np.ndarray,
        copies: Sequence[range],
        copy_bound: CopyBound,
        recompute: bool | None,
    ) -> None:
        """``times``: `ShapeFloors.least`; ``copies``: the copies none of whose runs a point splits;
        ``recompute``: as the options ask."""
        self.problem, self.shape, self.points, self.copies, self.copy_bound = problem, shape, points, copies, copy_bound
        prefix = times[list(points)]
        self.base = prefix[None, :] - prefix[:, None]  # every stage's time floor
        self.places = min(shape.stages, _PLACES)
        self.ways = recomputing(problem, recompute)
        self.bounds: dict[tuple[int, bool], np.ndarray] = {}  # per place and way, the best over the weights
        inside = np.zeros(problem.size, dtype=bool)
        for block in copies:
            inside[block.start : block.stop] = True
        outside = np.flatnonzero(~inside).tolist()
        self.runs: list[tuple[int, int]] = []  # the other operators, in runs (first, last + 1)
        for node in outside:
            if self.runs and self.runs[-1][1] == node:
                self.runs[-1] = (self.runs[-1][0], node + 1)
            else:
                self.runs.append((node, node + 1))
        after = {node: points[bisect.bisect_right(points, node)] for node in outside}
        self.sent = kept_sent(problem, after)
        self.ends = [next((block for block in copies if block.stop == point), None) for point in points]
        self._stages: dict[int, list[SearchProblem]] = {}
        self.per_place: list[np.ndarray] = []  # `stage`'s, per place the weights bound
        self.before: list[np.ndarray] = []  # per stage i, no cuts of stages 0 .. i ending at a point are faster

    def safe(self) -> bool:
        """Whether a stage's kept outputs sent on come from its last copy and its other operators alone: no copy
        keeps an output for an operator past the next copy's end (else no bound is taken)."""
        return not kept_sent(
            self.problem, {node: 2 * block.stop - block.start for block in self.copies for node in block}
        )

    def add(self, weights: Sequence[float]) -> float:
        """Take ``weights`` (one per place from the first, of the first `_PLACES` stages': a place without one keeps
        its time floors) among the weights tried; the bound from every weight taken so far."""
        for index, weight in enumerate(weights[: self.places]):
            for recompute in self.ways:
                found = self._lagrangian(index, weight, recompute)
                key = (index, recompute)
                self.bounds[key] = np.maximum(self.bounds[key], found) if key in self.bounds else found
        self.per_place = [
            np.maximum(self.base, np.minimum.reduce([self.bounds[(index, way)] for way in self.ways]))
            if (index, self.ways[0]) in self.bounds
            else self.base
            for index in range(self.places)
        ]
        self.before = slowest_before(self.shape.stages, self.stage)[0]
        return float(self.before[-1][-1])

    def stage(self, index: int) -> np.ndarray:
        """Stage ``index``'s bound over points a .. b, at [a, b], from the weights taken so far."""
        return self.per_place[index] if index < len(self.per_place) else self.base

    def _lagrangian(self, index: int, weight: float, recompute: bool) -> np.ndarray:
        """Per stage of place ``index`` over points a .. b, its bound at ``weight`` recomputing or not. A copy
        ending its stage is bounded as one sending its kept outputs on only without recomputation: recomputing,
        its bound counts none of its activations (`_StageSearch._copy_lagrangian`), of which they are part. The
        last stage ends at the last point, so only there is a copy ending it bounded: a model whose last copy
        is followed by operators of its own (a GPT's head) takes no such DP run for its last place."""
        each = np.zeros(self.problem.size + 1)
        held = self.shape.in_flight(index)
        for (first, _), stage in zip(self.runs, self._outside(index)):
            for own in range(stage.size):
                unary = stage.node_lagrangian(own, weight, recompute)[0]
                if recompute and own in stage.recompute_share:
                    unary = unary - weight * stage.recompute_share[own] * stage.node_activations[own]
                if first + own in self.sent:
                    unary = unary - weight * held * self.sent[first + own]
                each[first + own + 1] = float(np.min(unary))
        plain: dict[int, float] = {}
        for block in self.copies:
            each[block.start + 1] = plain[block.start] = self._copy(block, index, weight, recompute, False)
        prefix = np.cumsum(each)[list(self.points)]
        ending = np.zeros(len(self.points))
        final = len(self.points) - 1  # the last stage ends there: where it ends before, it is left unbounded
        for at, end in enumerate(self.ends):
            if end is None or recompute:
                continue
            if index == self.shape.stages - 1 and at < final:
                ending[at] = -np.inf  # (the cut search never asks: the time floor stands there)
            else:
                ending[at] = self._copy(end, index, weight, recompute, True) - plain[end.start]
        return prefix[None, :] - prefix[:, None] + ending[None, :] - weight * self.problem.cost.capacity * (1 + 1e-12)

    def _copy(self, block: range, index: int, weight: float, recompute: bool, end: bool) -> float:
        """`copy_bound` at place ``index``; between the first and the last place bounded, the chord of theirs.

        Every plan's Lagrangian is affine in the micro-batches its stage holds: its bytes hold that many
        micro-batches' activations (recomputing, one block's share less that many of them), a copy ending its
        stage sends that many micro-batches' kept outputs on, and its time does not change. The least over the
        plans is so concave in them, and the chord between two places lies below it at every place between:
        a bound without a DP run. The first place holds the most micro-batches and binds, so the bounds in
        between seldom count: GPT-3 175B on 1,024 Ascend 910s, every shape's bound the same, and the
        memory floors of 4 stages and more take half their DP runs."""
        held = self.shape.in_flight(index)
        most, least = self.shape.in_flight(0), self.shape.in_flight(self.places - 1)
        if not least < held < most:
            return self.copy_bound(block, index, weight, recompute, end)
        first = self.copy_bound(block, 0, weight, recompute, end)
        last = self.copy_bound(block, self.places - 1, weight, recompute, end)
        chord = ((held - least) * first + (most - held) * last) / (most - least)
        return chord - 1e-9 * abs(chord)  # (less, for rounding)

    def _outside(self, index: int) -> list[SearchProblem]:
        """Each run of the operators outside the copies as a stage of place ``index``, without what crosses
        cuts (`stage_problem` without its boundary): their own costs."""
        if index not in self._stages:
            self._stages[index] = [
                stage_problem(self.problem, first, last, self.shape, index, {}, boundary=False)
                for first, last in self.runs
            ]
        return self._stages[index]


_PLACES = 4
"""The first places of a pipeline `MemoryFloors` bounds with memory counted (each a DP run over each kind of copy
per weight and way): the first stage holds the most micro-batches, so memory binds there first."""


def leanest_memory(problem: SearchProblem, shape: PipelineShape, points: Sequence[int]) -> list[np.ndarray]:
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


def copy_floors(
    problem: SearchProblem, shape: PipelineShape, points: Sequence[int], copy_time: CopyTime | None = None
) -> tuple[tuple[range, float], ...]:
    """Every copy of each folded run none of whose copies a cut point splits, with a lower bound on the time
    per step of its operators and the edges among them in any stage of ``shape``: one DP run over one
    copy per run, memory aside (less a billionth, for rounding); ``copy_time``'s, given one.

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
        if copy_time is not None:
            least = copy_time(one)
        else:
            copy = stage_problem(problem, one.start, one.stop, PipelineShape(1, shape.slots), 0)
            least = least_below(copy, copy.lagrangian(0.0, False)[0], False)
        found.extend((block, least) for block in copies)
    return tuple(found)


def least_below(
    problem: SearchProblem, unary: Sequence[np.ndarray], recompute: bool, solver: Solver | None = None
) -> float:
    """The least of ``unary`` plus every edge cost (recomputed forwards paid twice with ``recompute``) over
    the problem's plans, by one exact DP run, less a billionth of it for rounding: a bound that stays below.
    ``solver``: one planned on the problem before (`fold.Solver.of`)."""
    solver = solver or Solver.of(problem)
    solver.bind(problem.main_factors(recompute), problem.recompute_folds if recompute else problem.folds)
    choice, least = solver.solve(unary)
    if solver.exact:  # the plan's own value, summed as the objective sums it
        least = sum(float(u[c]) for u, c in zip(unary, choice))
        least += sum(factor.value([choice[u] for u in scope]) for factor, scope in problem.all_factors(recompute))
    return least - 1e-9 * abs(least)  # (not exact: the solver's value, a lower bound, not its plan's)


def least_below_and_less(
    problem: SearchProblem, unary: Sequence[np.ndarray], node: int, less: np.ndarray, elimination: Elimination
) -> tuple[float, float] | None:
    """`least_below` of ``unary`` (without recomputation) and of ``unary`` with ``less`` taken off ``node``'s
    costs, from one DP run: ``elimination`` keeps ``node`` (planned on the problem's factors, no folded runs),
    so what it leaves is, per candidate of ``node``, the least of every plan taking it; each minimum's plan
    is then backtracked from its candidate and summed as `least_below` sums its own. None where that
    elimination is not exact (each is then a DP run of its own).

    A copy ending its pipeline stage sends the outputs it keeps for a backward on (`MemoryFloors`): its
    bound takes their bytes off one operator's costs, and the same copy's bound without that was one more
    DP run over it (GPT-3 175B on 1,024 Ascend 910s: 42 runs of 224, 3.8 s)."""
    if not elimination.exact:
        return None
    elimination.bind(problem.factors)
    solved = elimination.run(unary)
    if any(factor.scope != (node,) for factor in solved.leftover):
        return None
    per_candidate = np.asarray(unary[node], dtype=float) + solved.value
    for factor in solved.leftover:
        per_candidate = per_candidate + factor.table[factor.maps[0]]
    lowered = [*unary[:node], np.asarray(unary[node], dtype=float) - less, *unary[node + 1 :]]
    found = []
    for costs, own in ((unary, per_candidate), (lowered, per_candidate - less)):
        choice = solved.backtrack({node: int(np.argmin(own))})
        least = sum(float(u[c]) for u, c in zip(costs, choice))
        least += sum(factor.value([choice[u] for u in scope]) for factor, scope in problem.all_factors(False))
        found.append(least - 1e-9 * abs(least))
    return found[0], found[1]


def copies_in(
    copies: Sequence[tuple[range, float]], first: int, last: int, sends: dict[int, np.ndarray], slots: int
) -> tuple[tuple[range, float], ...]:
    """The copies (`copy_floors`) wholly in the stage of operators ``first`` .. ``last - 1``, in its own
    indices, each bound raised by the least its operators' boundary ``sends`` add, once per slot."""
    found = []
    for block, least in copies:
        if first <= block.start and block.stop <= last:
            inside = range(block.start - first, block.stop - first)
            found.append((inside, least + sum(slots * float(np.min(sends[i])) for i in inside if i in sends)))
    return tuple(found)


def _least(problem: SearchProblem, node: int, slots: int = 1) -> float:
    """An operator's least time per step over its candidates (with or without a parallel optimizer),
    its time per micro-batch paid ``slots`` times and its time per step once."""
    arrays = [(problem.node_time[node], problem.node_sync[node])]
    if node in problem.sharded:
        alternative = problem.sharded[node]
        arrays.append((alternative.time, alternative.sync))
    return max(0.0, min(float(np.min(slots * (time - once) + once)) for time, once in arrays))


class StageEdges:
    """The edges `stage_floor` reads of one stage problem, recomputing or not, gathered once for the bounds it
    takes at every weight: per operator, each edge counted at it (its last operator) as the least of its table
    over the others' candidates, with the first operator it joins, and the identities of the arrays its
    Lagrangian is made of. ``minima``: those least tables by table and axis, shared by the stages cut from one
    problem (their tables are one: `pipeline.stage_problem`'s ``made``), each held with its table so that its
    identity stays its own."""

    def __init__(
        self, stage: SearchProblem, recompute: bool, minima: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]]
    ) -> None:
        self.stage, self.recompute = stage, recompute
        into: list[list[tuple[tuple[int, int], np.ndarray, int]]] = [[] for _ in range(stage.size)]
        for factor, scope in stage.all_factors(recompute):
            last = max(scope)
            at = scope.index(last)  # (the first, as numpy's argmax takes it)
            key = (id(factor.table), at)
            if key not in minima:
                axes = tuple(axis for axis in range(factor.table.ndim) if axis != at)
                minima[key] = (factor.table, factor.table.min(axis=axes) if axes else factor.table)
            into[last].append((key, factor.maps[at], min(scope)))
        self.into = into
        self.minima = minima
        self.sources = [stage.node_sources(node, recompute) for node in range(stage.size)]


def stage_floor(
    stage: SearchProblem,
    copies: Sequence[tuple[range, float]] = (),
    weight: float = 0.0,
    recompute: bool = False,
    edges: StageEdges | None = None,
) -> float:
    """A lower bound on a stage's time: each operator at its least cost counting, per candidate, the least
    each edge into it costs (every edge counted once, at its last operator), memory and recomputation
    aside. Given ``copies`` (ranges of the stage's operators, each with a lower bound on their costs and
    the edges among them: `copy_floors`), the same with each copy's bound and the least of the edges
    into it counted instead of its operators', where that is larger.

    With a memory ``weight``, the same of the Lagrangian (time + weight x memory, recomputing or not as
    ``recompute`` says) less weight x the capacity: no plan of that kind that fits is faster (the copies'
    bounds then of the same Lagrangian, `_StageSearch._copy_lagrangian`). ``edges``: the stage's, gathered
    before (`StageEdges`)."""
    if edges is None:
        edges = StageEdges(stage, recompute, {})
    assert edges.stage is stage and edges.recompute == recompute
    copy_of = np.full(stage.size, -1)
    for number, (block, _) in enumerate(copies):
        copy_of[block.start : block.stop] = number
    copy_at = copy_of.tolist()
    minima = edges.minima
    # the copies of a folded run share their arrays: an operator's least is taken once per set of sources
    found: dict[tuple, tuple[float, float]] = {}
    alone, counted = 0.0, sum(bound for _, bound in copies)
    for node in range(stage.size):
        copy = copy_at[node]
        into = [(key, rows, copy >= 0 and copy_at[first] == copy) for key, rows, first in edges.into[node]]
        sources = (edges.sources[node], tuple((key, id(rows), inside) for key, rows, inside in into))
        if sources not in found:
            extra: np.ndarray | float = 0.0
            outside: np.ndarray | float = 0.0  # ``extra`` less the edges inside a copy
            for key, rows, inside in into:
                least = minima[key][1][rows]
                extra = extra + least
                if not inside:
                    outside = outside + least
            unary = stage.node_lagrangian(node, weight, recompute)[0]
            found[sources] = (float(np.min(unary + extra)), float(np.min(outside)))
        own, beyond = found[sources]
        alone += own
        counted += beyond if copy >= 0 else own
    return max(max(alone, counted) - weight * stage.cost.capacity, 0.0)


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
        part = problem.fused.get(rule.op.name)
        if spec.op_class == "free" or (part is not None and part.role == "inner"):
            continue
        flops = rule.op.flops
        if part is not None:
            rate, flops = cost.attention_rate, flops * part.share
        elif spec.matmul_labels is not None:
            rate = cost.fastest_matmul_rate_up_to(_smallest_dim(rule), rule.op.name in problem.fp8_products)
        else:
            rate = cost.cube_flops if spec.op_class == "cube" else cost.vector_flops
        traffic = sum(
            problem.graph.tensor(name).numel * problem.itemsize(problem.graph.tensor(name))
            for name in (*rule.op.inputs, *rule.op.outputs)
            if name and (part is None or name not in part.hidden)
        )
        forward = max(flops / rate, traffic / cost.memory_bandwidth)
        total += forward * problem.work_multiple(node)
    return total


def _smallest_dim(rule: OpRule) -> float:
    """The smallest of a matmul's M, N and K, whole (an absent one, or one of unknown size, counts 1), as
    `costing.matmul_smallest_dim` takes it with no dimension split."""
    smallest = math.inf
    for position, label in enumerate(rule.spec.matmul_labels or ()):
        sizes = rule.label_sizes.get(label, set()) if label is not None else set()
        if label is None or not sizes:
            return 1.0
        folded = rule.spec.matmul_folded if position == 0 else ()
        smallest = min(smallest, float(max(sizes)) * math.prod(max(rule.label_sizes.get(b, {1})) for b in folded))
    return smallest


def shape_floor(floor: float, num_devices: int, shape: PipelineShape) -> float:
    """A lower bound on any plan's step with ``shape`` on ``num_devices`` devices, from `compute_floor`
    of the whole batch: the slowest stage is no faster than the average, (M + S - 1) slots of
    1/S of the work of one micro-batch spread over N/S devices.

    >>> shape_floor(8.0, 8, PipelineShape(2, 4)) == 8.0 / 8 * 5 / 4
    True
    """
    return floor * shape.slots / (shape.micro_batches * num_devices)
