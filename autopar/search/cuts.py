"""The cut search: where a pipeline's stages start, and each stage's plan (`search_stages`).

For one shape (S stages, M micro-batches) and one micro-batch's problem, a DP over the cut points
takes the cuts whose slowest stage is fastest (a min-max over a chain), each stage's time the exact
per-stage search's (`autopar.search.pipeline.stage_problem` searched by `run_search`). Stages alike
in their operators, reads and place are searched once, and the lower bounds of
`autopar.search.floors` keep most stages from being searched at all. A stage a search refuted for one
bound keeps the bound its DP runs proved, and, asked again for a larger one, its problem and runs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from autopar.context import planning
from autopar.errors import InfeasibleError
from autopar.search.dataflow import TensorUse
from autopar.search.dp import Elimination, TieBreak
from autopar.search.driver import (
    NothingFaster,
    SearchCache,
    SearchOptions,
    SearchResult,
    data_parallel_choice,
    run_search,
)
from autopar.search.floors import (
    MemoryFloors,
    ShapeFloors,
    StageEdges,
    copies_in,
    least_below,
    least_below_and_less,
    least_fullest,
    shape_floors,
    stage_floor,
)
from autopar.search.fold import CopyRuns, Solver
from autopar.search.ilp import recomputing
from autopar.search.pipeline import (
    Crossings,
    PipelineResult,
    PipelineShape,
    SentAlike,
    StagePlan,
    cut_crossings,
    cut_points,
    kept_sent,
    send_costs,
    stage_link_bit,
    stage_problem,
)
from autopar.search.problem import SearchProblem


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
        self.problem, self.shape = problem, shape
        # one tie-break for every stage: a copy of a block costs the same in every stage of its place (`fold`)
        base = shape.slots * problem.objective(data_parallel_choice(problem))
        tie = options.tie_break if options.tie_break is not None else TieBreak.of(problem.node_time, base).epsilon
        self.options = dataclasses.replace(options, tie_break=tie)
        self.recompute = options.recompute
        self.hint = options.hint  # the memory weight the last stage that memory bound settled on
        self.hints: dict[int, float] = {}  # the same, per micro-batches in flight (a stage's place)
        classes = list(range(problem.size))
        for repeat, _ in problem.folds:
            for k in range(1, repeat.copies):
                for node in repeat.block(k):
                    classes[node] = node - k * repeat.period
        self.classes = classes
        self.found: dict[tuple, tuple[float, SearchResult | None]] = {}
        self.searches = 0
        self.copies: tuple[tuple[range, float], ...] = ()  # `copy_floors`, once the cut search asks for them
        self._copy_bounds: dict[tuple, float] = {}  # `_copy_lagrangian`'s
        self._copy_problems: dict[tuple[int, int], SearchProblem] = {}  # (the same's, by copy kind and place)
        self._copy_solvers: dict[int, Solver] = {}  # (their solvers, by copy kind: planned once for every place)
        self._sent_on: dict[int, dict[int, np.ndarray]] = {}  # per copy kind, `kept_sent` past its end, by place
        self._ending_runs: dict[int, Elimination] = {}  # per copy kind, its DP run keeping what it sends from
        self._stages: dict[tuple, _Kept] = {}  # `_kept`'s
        self._arrays: dict[tuple, tuple] = {}  # the rescaled arrays the stages share (`stage_problem`'s ``made``)
        self._copies = CopyRuns()  # the copy eliminations the stages' searches share (`fold.CopyRuns`)
        self._minima: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}  # `StageEdges`' shared ones
        self._sent = SentAlike(self.classes)  # each boundary use's transfers, once for the uses alike

    def _key(self, first: int, last: int, index: int, crossings: Crossings) -> tuple:
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

    def _bound_at_hint(
        self, kept: "_Kept", first: int, last: int, index: int, weight: float, beat: float | None = None
    ) -> float:
        """The Lagrangian bound at the memory ``weight`` (`stage_floor`), the least over recomputing or
        not, each way's no less than its floor (`_floors`): no plan of the stage that fits is faster. Where
        memory binds, this refutes a cut whose walk would take two DP runs or more, with none (the copies'
        bounds are shared by every cut). Once per stage kind and hint. Given ``beat``, a way whose bound is
        below it ends the work at once with no bound (minus infinity): the least is no larger, so it could not
        refute the stage, and the other way's copies are not run (a DP run over a copy each)."""
        if weight in kept.at_weight:
            return kept.at_weight[weight]
        held, stage = self.shape.in_flight(index), kept.stage
        blocks = [block for block, _ in self.copies if first <= block.start and block.stop <= last]
        # a copy at the stage's cuts is costed otherwise than the copy's own bound counts it (what it sends and
        # receives, the tensors kept across: `_kept_across`): its bound is lowered by the most its kept tensors
        # free here, or its operators count one by one, whichever bounds more
        # (only an operator at the cuts has activations of its own in the stage: the others free nothing)
        at_cuts = [[i for i in block if i - first in kept.ends] for block in blocks]
        freed = [
            weight
            * held
            * sum(
                max(0.0, -float(np.min(stage.node_activations[i - first] - self.problem.node_activations[i])))
                for i in ends
            )
            for ends in at_cuts
        ]
        inner = [not ends for ends in at_cuts]
        least = math.inf
        for recompute, floor in kept.floors.items():
            copies = [
                (range(block.start - first, block.stop - first), self._copy_lagrangian(block, index, weight, recompute))
                for block in blocks
            ]
            lowered = tuple((inside, bound - less) for (inside, bound), less in zip(copies, freed))
            edges = self._edges(kept, recompute)
            best = max(floor, stage_floor(stage, lowered, weight, recompute, edges) if copies else -math.inf)
            if not all(inner):
                within = [copy for copy, keep in zip(copies, inner) if keep]
                best = max(best, stage_floor(stage, within, weight, recompute, edges))
            if beat is not None and best < beat:
                return -math.inf
            least = min(least, best)
        kept.at_weight[weight] = least
        return least

    def _floors(
        self, kept: "_Kept", first: int, last: int, index: int, sends: dict[int, np.ndarray]
    ) -> dict[bool, float]:
        """`stage_floor` of each way a plan of the stage may fit, recomputing or not (a way whose leanest plan
        does not fit has none): no plan of that way is faster. Where only recomputing plans fit (a first stage
        holding many micro-batches), their floor counts the forwards they pay again."""
        stage = kept.stage
        capacity = stage.cost.capacity * (1 + 1e-12)
        floors = {}
        for recompute in recomputing(stage, self.recompute):
            if stage.memory_floor(recompute) > capacity:
                continue
            copies = tuple(copy for copy in self.copies if first <= copy[0].start and copy[0].stop <= last)
            if recompute:
                copies = tuple((block, self._copy_lagrangian(block, index, 0.0, True)) for block, _ in copies)
            within = copies_in(copies, first, last, sends, self.shape.slots)
            floors[recompute] = stage_floor(stage, within, 0.0, recompute, self._edges(kept, recompute))
        return floors

    def _edges(self, kept: "_Kept", recompute: bool) -> StageEdges:
        """The stage's edges as `stage_floor` reads them, gathered once per way to recompute."""
        if recompute not in kept.edges:
            kept.edges[recompute] = StageEdges(kept.stage, recompute, self._minima)
        return kept.edges[recompute]

    def _copy_lagrangian(self, block: range, index: int, weight: float, recompute: bool, end: bool = False) -> float:
        """A lower bound on the Lagrangian (time + ``weight`` x memory) of one copy of a folded block, its
        operators and the edges among them, in stage ``index`` wherever the cuts put it: one DP run over
        the copy as a stage's operators are costed (`stage_problem`, its micro-batches in flight), without
        what only a stage's boundary adds or takes away (sends, kept tensors: `_bound_at_hint` takes the
        latter off), and, recomputing, with no share of the one block's activations held at a time (which
        depends on how many copies the stage has). Once per copy kind, stage place, weight and way; at weight 0
        once per copy kind and way: a copy's times are the same in every place (the micro-batches a place holds
        change its bytes alone), and memory then counts nothing. With ``end``, the copy ends its stage: its
        outputs kept for a backward that later operators read are sent on (`pipeline.kept_sent`), their bytes
        off each micro-batch held (`MemoryFloors`); without recomputation both bounds come from one DP run where
        one operator sends (`_with_ending`)."""
        kind = (self.classes[block.start], self.shape.in_flight(index))
        key = (kind[0], kind[1] if weight else None, weight, recompute, end and weight > 0.0)
        if key not in self._copy_bounds:
            if kind not in self._copy_problems:  # (one problem for every weight and way)
                self._copy_problems[kind] = stage_problem(
                    self.problem, block.start, block.stop, self.shape, index, {}, boundary=False, made=self._arrays
                )
            copy = self._copy_problems[kind]
            if kind[0] not in self._copy_solvers:  # every place's copy has the same operators and edges
                self._copy_solvers[kind[0]] = Solver.of(copy)
            solver = self._copy_solvers[kind[0]]
            unary = copy.lagrangian(weight, recompute)[0]
            if recompute:
                for node, share in copy.recompute_share.items():
                    unary[node] = unary[node] - weight * share * copy.node_activations[node]
            sent_on = self._sent_on_of(block) if weight > 0.0 else {}
            both = None if recompute else self._with_ending(kind[0], copy, unary, sent_on, weight * kind[1])
            if both is not None:  # (the bound ending its stage too, from the same DP run)
                self._copy_bounds[key[:4] + (False,)], self._copy_bounds[key[:4] + (True,)] = both
                return self._copy_bounds[key]
            if end and weight > 0.0:
                for node, sent_bytes in sent_on.items():
                    unary[node] = unary[node] - weight * kind[1] * sent_bytes
            self._copy_bounds[key] = least_below(copy, unary, recompute, solver)
        return self._copy_bounds[key]

    def _sent_on_of(self, block: range) -> dict[int, np.ndarray]:
        """Per operator of a copy (its own index), the bytes of its outputs kept for a backward that operators
        past the copy read (`pipeline.kept_sent`): alike for every copy of its kind."""
        kind = self.classes[block.start]
        if kind not in self._sent_on:
            sent = kept_sent(self.problem, {node: block.stop for node in block})
            self._sent_on[kind] = {node - block.start: sent_bytes for node, sent_bytes in sent.items()}
        return self._sent_on[kind]

    def _with_ending(
        self, kind: int, copy: SearchProblem, unary: list[np.ndarray], sent_on: dict[int, np.ndarray], weight: float
    ) -> tuple[float, float] | None:
        """A copy's bound and its bound ending its stage (its kept outputs sent on, their bytes at ``weight``
        off), from one DP run (`least_below_and_less`), where one operator sends and the copy's factors are
        all its edges (no folded runs, no twins); None elsewhere."""
        if len(sent_on) != 1 or copy.folds or copy.ties:
            return None
        ((node, sent_bytes),) = sent_on.items()
        if kind not in self._ending_runs:  # (planned once for every place: the copies' edges are alike)
            sizes = [len(costs) for costs in copy.node_time]
            self._ending_runs[kind] = Elimination(sizes, copy.factors, keep=(node,))
        return least_below_and_less(copy, unary, node, weight * sent_bytes, self._ending_runs[kind])

    def copy_time(self, block: range) -> float:
        """`copy_floors`' bound of one copy (`floors.CopyTime`), as `_copy_lagrangian` takes it at weight 0: its copy
        problem and planned elimination, made once, serve the memory floors and the cut search after."""
        return self._copy_lagrangian(block, 0, 0.0, False)

    def memory_floor(self, points: Sequence[int], times: np.ndarray, bound: float) -> MemoryFloors | None:
        """`MemoryFloors` of the shape at `_FLOOR_WEIGHT` of the hint, for every place. None where memory did not
        bind (no hint), nothing bounds the search, no copy is whole between the points or a copy keeps an output
        for past the next copy (the bound would not hold).

        The first place first: it holds the most micro-batches, so it binds most, and where its bound alone (the
        other stages at their time floors) is no less than ``bound`` the shape is refuted without the other
        places' DP runs. GPT-3 175B on 1,024 Ascend 910s: 9 of the 19 shapes its memory floors refute, 6 of
        them of 2 stages (two DP runs fewer each)."""
        blocks = [block for block, _ in self.copies]
        if self.hint <= 0.0 or math.isinf(bound) or not blocks:
            return None
        floors = MemoryFloors(self.problem, self.shape, points, times, blocks, self._copy_lagrangian, self.recompute)
        if not floors.safe():
            return None
        weight = _FLOOR_WEIGHT * self.hint
        if floors.add([weight]) < bound:  # (the shape is searched with every place's bound)
            floors.add([weight] * floors.places)
        return floors

    def time(self, first: int, last: int, index: int, beat: float = math.inf) -> tuple[float, SearchResult | None]:
        """The stage's time per step and plan (infinite and None when nothing fits). A stage whose lower
        bound (`stage_floor`, or the DP runs of a search told to beat less) is no faster than ``beat`` is
        not searched: its bound comes back, with no plan."""
        crossings = cut_crossings(self.problem, first, last)
        key = self._key(first, last, index, crossings)
        hit = self.found.get(key)
        if hit is not None and (hit[1] is not None or math.isinf(hit[0]) or hit[0] >= beat):
            return hit
        kept = self._kept(key, first, last, index, crossings)
        if kept.floor >= beat:
            self.found[key] = (kept.floor, None)
            return kept.floor, None
        hint = self.hints.get(self.shape.in_flight(index), self.hint)
        if hint > 0.0 and beat < math.inf:
            bound = self._bound_at_hint(kept, first, last, index, hint, beat)
            if bound >= beat:
                self.found[key] = (bound, None)  # no plan of the stage that fits beats ``beat``: a bound
                return bound, None
        self.searches += 1
        try:
            result = run_search(kept.stage, dataclasses.replace(self.options, bound=beat, hint=hint), kept.runs)
        except NothingFaster as beaten:
            hit = (beaten.bound_s, None)  # no plan of the stage beats ``beat``, or more: a bound, as the floor's
            self.found[key] = hit
            if beaten.weight:  # the weight that refuted it likeliest refutes its neighbours by their bounds alone
                self.hints[self.shape.in_flight(index)] = beaten.weight
            return hit
        except InfeasibleError:
            hit = (math.inf, None)
        else:
            hit = (kept.stage.objective(result.choice, result.choices), result)
            self.hint = result.memory_multiplier or self.hint
            if result.memory_multiplier:
                self.hints[self.shape.in_flight(index)] = result.memory_multiplier
        del self._stages[key]  # asked again only with a bound it already meets
        self.found[key] = hit
        return hit

    def _kept(self, key: tuple, first: int, last: int, index: int, crossings: Crossings) -> "_Kept":
        """The stage problem of a kind of stage, with its floor and DP runs: a stage refuted for one bound is
        most often asked again for a larger one (the cut search tells each the best found for its end), and
        then takes up where its search stopped. The latest `_STAGES_KEPT` kinds are kept."""
        kept = self._stages.pop(key, None)
        if kept is None:
            sends = send_costs(self.problem, crossings, first, index, self.shape, self._sent)
            stage = stage_problem(self.problem, first, last, self.shape, index, sends, made=self._arrays)
            ends = {u.src_node - first for u in crossings.out} | {u.dst_node - first for u in crossings.into}
            kept = _Kept(stage, frozenset(ends), SearchCache(copies=self._copies))
            kept.floors.update(self._floors(kept, first, last, index, sends))
        self._stages[key] = kept  # (the newest last)
        while len(self._stages) > _STAGES_KEPT:
            del self._stages[next(iter(self._stages))]
        return kept


_FLOOR_WEIGHT = 0.25
"""The share of the hint (the memory weight the last one-stage search that memory bound settled on) that
`_StageSearch.memory_floor` bounds a shape's stages at. Any weight gives a bound; a stage holds a share of
the model and of the micro-batches, and its walk settles lower (GPT-3 175B on 1,024 Ascend 910s: the hint
2.9e-9, its stages' walks 1e-10 to 2.6e-9). Fitted on that model: of the shares 1, 1/2 and 1/4 of the hint,
the quarter refutes most shapes (2 to 4 stages), and one weight costs a third of three."""

_STAGES_KEPT = 16
"""Stage problems a cut search keeps for asking again (`_StageSearch._kept`): the cut search asks a stage
again within a few others (the cuts of one end), and each holds its arrays and solver."""


@dataclass
class _Kept:
    """A kind of stage's problem, its floors (`_StageSearch._floors`), its bounds at the memory weights tried
    (`_StageSearch._bound_at_hint`), its edges as the floors read them and the DP runs of its searches."""

    stage: SearchProblem
    ends: frozenset[int]  # its operators (its own indices) that read or write across its cuts
    runs: SearchCache
    floors: dict[bool, float] = field(default_factory=dict)  # per way to recompute that can fit
    at_weight: dict[float, float] = field(default_factory=dict)
    edges: dict[bool, StageEdges] = field(default_factory=dict)

    @property
    def floor(self) -> float:
        """No plan of the stage that fits is faster (infinite: none fits)."""
        return min(self.floors.values(), default=math.inf)


@planning
def search_stages(
    problem: SearchProblem,
    shape: PipelineShape,
    options: SearchOptions | None = None,
    starts: Sequence[int] | None = None,
) -> PipelineResult | None:
    """`bounded_search_stages`' plan alone."""
    return bounded_search_stages(problem, shape, options, starts)[0]


@planning
def bounded_search_stages(
    problem: SearchProblem,
    shape: PipelineShape,
    options: SearchOptions | None = None,
    starts: Sequence[int] | None = None,
) -> tuple[PipelineResult | None, float]:
    """The fastest pipelined plan of one micro-batch's problem (``problem``, on one stage's devices)
    with ``shape``'s stages and micro-batches: the cuts (or the given ``starts``, each stage's first
    operator) and every stage's plan. None when no cut gives a plan that fits and is faster than
    ``options.bound`` seconds; the other `SearchOptions` are every stage's. Then a step no plan of the
    shape that fits beats: the plan's own (or the bound, where there is none) where every stage searched
    was exact, else the shape's floor (`shape_floors`), and minus infinity for given ``starts``.

    Exact: the cuts are a DP over the cut points minimising the slowest stage (min-max over a chain),
    each stage's time the exact per-stage search's; among equally fast cuts, `_min_max_search`'s rule
    picks. A stage is searched only when lower bounds leave it a chance to beat the best plan found so
    far: its own (`stage_floor`) and, for the stages before and after it, the sum of their operators'
    least time per micro-batch, times the slots, each whole copy of a folded block counted at
    `copy_floors`' bound where that is larger; and, where memory binds, no cut is searched whose stages'
    Lagrangian bounds (`MemoryFloors`) leave none fast enough. `bound_shape` then `search_bounded`."""
    options = options or SearchOptions()
    if starts is not None:  # the cuts given: the bound is of plans with them
        search = _StageSearch(problem, shape, options)
        return _proved(search, _assemble(search, [*starts, problem.size], options.bound), options.bound, -math.inf)
    return search_bounded(bound_shape(problem, shape, options), options.bound)


@dataclass
class ShapeBound:
    """What bounds a shape's plans before any cut is searched (`bound_shape`), with the search that took the
    bounds and searches the cuts (`search_bounded`): its stage problems and DP runs serve both."""

    search: _StageSearch
    points: list[int]  # the cut points, with the first and the last operator's end
    floors: ShapeFloors
    memory: MemoryFloors | None  # where memory binds (a hint) and a bound was given

    @property
    def seconds(self) -> float:
        """No plan of the shape that fits is faster."""
        return float(self.memory.before[-1][-1]) if self.memory is not None else self.floors.seconds


def bound_shape(problem: SearchProblem, shape: PipelineShape, options: SearchOptions) -> ShapeBound:
    """A shape's lower bounds, cheapest first, stopping at one no less than ``options.bound``: its floors
    (`shape_floors`), then, where memory binds, its stages' Lagrangian bounds (`MemoryFloors`)."""
    search = _StageSearch(problem, shape, options)
    points = [0, *cut_points(problem), problem.size]
    floors = shape_floors(problem, shape, points, options.bound, search.copy_time)
    if floors.seconds >= options.bound:
        return ShapeBound(search, points, floors, None)  # not even the stages' lower bounds leave one fast enough
    search.copies = floors.copies
    return ShapeBound(search, points, floors, search.memory_floor(points, floors.least, options.bound))


def search_bounded(bounded: ShapeBound, bound: float) -> tuple[PipelineResult | None, float]:
    """`bounded_search_stages` of a shape bounded before (`bound_shape`, with the same or a larger bound)."""
    search, points, floors, memory = bounded.search, bounded.points, bounded.floors, bounded.memory
    seconds = bounded.seconds
    if seconds >= bound:
        return None, seconds  # the stages' lower bounds (memory counted, where it binds) leave none fast enough
    least, count = floors.least, search.shape.stages

    def floor(a: int, b: int) -> float:  # no stage over points a..b is faster
        return float(least[points[b]] - least[points[a]])

    # first the cuts that balance the stages' lower bounds: their plan bounds the exact search
    probe = _assemble(search, [points[b] for b in least_fullest([least[points]] * count)[1]], bound)
    beat = probe.time_s * (1 + 1e-12) if probe is not None else bound  # (its ties too: the exact search's rule picks)
    exact = _min_max_search(search, points, count, floor, beat, memory)
    return _proved(search, exact if exact is not None else probe, bound, seconds)  # (no less than the floor)


def _proved(
    search: _StageSearch, found: PipelineResult | None, bound: float, floor: float
) -> tuple[PipelineResult | None, float]:
    """The plan found and a step no plan of the shape that fits beats: its own (``bound`` where there is
    none) where every stage searched was exact; else ``floor`` (a stage's walk is not proved best, nor are
    the cuts taken on its time)."""
    if not all(result.exact for _, result in search.found.values() if result is not None):
        return found, floor
    return found, found.time_s if found is not None else bound


def _min_max_search(
    search: _StageSearch,
    points: Sequence[int],
    count: int,
    floor: Callable[[int, int], float],
    bound: float,
    memory: MemoryFloors | None = None,
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
    cuts = _Cuts(search, points, floor, memory)
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
    memory: MemoryFloors | None = None  # per stage and cuts of the stages before, bounds memory counted
    # (stage index, end) -> (the least slowest stage, where that stage starts, the bound it was told):
    # exact where below its bound, else only known to be no less
    known: dict[tuple[int, int], tuple[float, int, float]] = field(default_factory=dict)

    def lower(self, index: int, b: int) -> float:
        """No cuts of stages 0..index ending at point b are faster: the slowest is no faster than the average,
        nor than the least slowest of their bounds memory counted (`MemoryFloors.before`)."""
        average = self.floor(0, b) / (index + 1)
        return average if self.memory is None else max(average, float(self.memory.before[index][b]))

    def own(self, index: int, a: int, b: int) -> float:
        """No stage ``index`` over points a .. b is faster: its floor, or its bound memory counted."""
        floor = self.floor(a, b)
        return floor if self.memory is None else max(floor, float(self.memory.stage(index)[a, b]))

    def best_before(self, index: int, b: int, beat: float) -> float:
        search, points = self.search, self.points
        hit = self.known.get((index, b))
        if hit is not None and (hit[0] < hit[2] or hit[0] >= beat):
            return hit[0]
        if index == 0:
            found, came = search.time(points[0], points[b], 0, beat)[0], 0
        else:
            found, came = beat, -1
            for a in range(index, b):
                before, own = self.lower(index - 1, a), self.own(index, a, b)
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


def _assemble(search: _StageSearch, bounds: Sequence[int], bound: float) -> PipelineResult | None:
    """The plan of given cuts (None: a stage does not fit)."""
    stages = []
    for index in range(search.shape.stages):
        seconds, result = search.time(bounds[index], bounds[index + 1], index, bound)
        if result is None or seconds >= bound:
            return None
        stages.append(StagePlan(bounds[index], bounds[index + 1], result, seconds))
    return PipelineResult(search.shape, tuple(stages))
