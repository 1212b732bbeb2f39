"""The pipeline-shape search: which stage count and micro-batch count a plan takes, and its plan.

Every shape (`PipelineShape`: S stages, a power of two, and M micro-batches, a divisor of the batch)
the options leave open is searched exactly on the problem of one micro-batch over N/S devices
(`autopar.search.pipeline`), in an order that finds a good plan early, each refuted where a lower
bound shows it cannot win; the fastest plan that fits wins, the fewer stages and micro-batches on a
tie. The caller gives the model at each micro-batch's size (`ShapeSearch`'s ``imports``) and lowers
the result.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

import numpy as np

from autopar import progress
from autopar.cost import CostModel
from autopar.errors import AutoparError, FixedStrategyError, InfeasibleError, ModelImportError, StrategyError
from autopar.graph import Graph
from autopar.limits import MAX_MICRO_BATCHES
from autopar.ops.norm import batch_statistics
from autopar.options import PlanOptions
from autopar.search import ring
from autopar.search.costing import build_problem, build_with_latency
from autopar.search.cuts import ShapeBound, bound_shape, bounded_search_stages, search_bounded
from autopar.search.driver import (
    NOTHING_FITS,
    NothingFaster,
    SearchCache,
    SearchOptions,
    SearchResult,
    fastest_bound,
    memory_bound,
    parameter_state_bytes,
    run_search,
)
from autopar.search.floors import compute_floor, shape_floor, time_floors
from autopar.search.pipeline import (
    ONE_STAGE,
    PipelineResult,
    PipelineShape,
    StagePlan,
    cut_points,
    stage_problem,
    too_few_cut_points,
)
from autopar.search.problem import SearchProblem
from autopar.strategy import OpRule


@dataclasses.dataclass(frozen=True)
class ShapeResult:
    """The best plan of every pipeline shape tried: one micro-batch's problem on one stage's devices,
    the plan on it and, with more than one stage, the stages."""

    problem: SearchProblem
    found: SearchResult
    pipeline: PipelineResult | None
    time_s: float
    shape: PipelineShape = ONE_STAGE


class ShapeSearch:
    """The joint search over pipeline shapes: every stage count S (a power of two) and micro-batch
    count M (a divisor of the batch) the options leave open, each searched exactly on the problem of
    one micro-batch over N/S devices (`autopar.search.pipeline`); the fastest plan that fits wins, the
    fewer stages and micro-batches on a tie. A shape whose lower bound (`shape_floor`) is no faster
    than the best plan found is not searched, nor, once the whole batch's fastest one-stage plan fits
    as it is, one stage over micro-batches (gradient accumulation): the same strategies over the whole
    batch do each micro-batch's work at once, at sizes no less efficient, and pay each collective's
    latency once, so micro-batches pay only where memory binds; for the same reason no one-stage plan
    over M' micro-batches is faster than the fastest one (memory aside) over M micro-batches where M
    divides M', so such a shape is skipped once that bound cannot win. Stages are searched where memory binds
    the one-stage plans (the case they are for: the model's state or activations do not fit as they
    are), or where the options ask for them; elsewhere one stage stands, so a model that fits keeps
    today's plan and its planning time."""

    def __init__(
        self,
        graph: Graph,
        options: PlanOptions,
        cost: CostModel,
        imports: Callable[[int], Graph],
        rebatches: bool = True,
    ) -> None:
        """``graph``: the model at the whole batch; ``imports``: the model at the size of one of so many
        micro-batches (raising `ModelImportError` where it does not take it); ``rebatches``: whether the
        model can be imported at other batches (no micro-batch counts are searched where not)."""
        self.graph, self.options, self.cost, self.imports = graph, options, cost, imports
        self.step_batch = common_batch(graph)
        self.rebatches = rebatches
        self.costing_s = self.search_s = 0.0
        self._built: set[tuple[int, int]] = set()  # shapes whose problem was built (the losers' are dropped)
        self._refusals: dict[tuple[int, int], ModelImportError | FixedStrategyError] = {}  # why a shape has none
        self._graphs: dict[int, Graph | ModelImportError] = {1: graph}  # per micro-batch count, for every stage count
        self._fastest: dict[int, float] = {}  # one stage over M micro-batches: no plan is faster, memory aside
        self._stages_built: dict[int, tuple[int, SearchProblem]] = {}  # per stage count, the last shape's problem
        self._memory_bound: dict[int, bool] = {}  # per stage count, whether memory raised that shape's bound
        self._counts: dict[
            tuple[int, int], float
        ] = {}  # per stage shape, a step none of its plans beats (`_relax_counts`)
        self._counts_relaxed: set[int] = set()  # stage counts whose micro-batch counts were relaxed in pairs
        self._hint = 0.0  # the memory weight the last search that memory bound settled on: the next tries it first
        self._one_stage_s = math.inf  # the fastest one-stage plan found (`_memory_may_refute`)
        self._together: dict[int, float] = {}  # per one-stage count, a step none of its plans beats (`_relax_together`)
        self._together_at = math.inf  # the bound the counts were last relaxed together for
        self._single_runs = SearchCache()  # the whole batch is searched twice where memory binds (`_visiting`)
        self.lower_s = math.inf  # no plan of a shape searched (`_timed_search`) is faster, where it fits
        self.searching = SearchOptions(options.mode, options.search, options.recompute)  # every search's
        single = self.problem(1, 1)
        assert single is not None  # the whole batch on every device: its errors are the user's
        self.single = single

    def problem(self, stages: int, micro_batches: int) -> SearchProblem | None:
        """One micro-batch's problem on one stage's devices (None: the model does not import at that batch,
        or a fixed strategy does not fit that many devices or that micro-batch). Each shape asks once, but
        for the first (`single`, kept): a problem is held only while its shape is searched or holds the best
        plan, so a search of many shapes holds few at a time. Each micro-batch count's graph is imported once."""
        key = (stages, micro_batches)
        if key == (1, 1) and key in self._built:
            return self.single
        started = time.perf_counter()
        options = self.options
        built: SearchProblem | None
        # one stage's micro-batches pass their forks through where the whole batch's do (`_fewer_micro_batches_win`)
        meet = stages > 1 or key == (1, 1) or self.single.forks_meet
        try:
            graph = self._graph(micro_batches)
            built = build_problem(graph, self.cost, options.num_devices // stages, fixed=options.fixed, meet=meet)
        except (ModelImportError, FixedStrategyError) as error:
            if key == (1, 1):
                raise
            self._refusals[key] = _detached(error)
            built = None
        else:
            self._built.add(key)
        self.costing_s += time.perf_counter() - started
        return built

    def _graph(self, micro_batches: int) -> Graph:
        """The model at one micro-batch's size, imported once (the graph is read, never changed)."""
        if micro_batches not in self._graphs:
            imported: Graph | ModelImportError
            try:
                imported = self.imports(micro_batches)
            except ModelImportError as error:
                imported = _detached(error)
            self._graphs[micro_batches] = imported
        found = self._graphs[micro_batches]
        if isinstance(found, ModelImportError):
            raise found
        return found

    def shapes(self) -> list[PipelineShape]:
        """The shapes the options leave open, the one-stage, one-micro-batch plan first."""
        options, devices = self.options, self.options.num_devices
        if options.pipeline_stages is not None:
            counts = [options.pipeline_stages]
            too_many = None if options.stage_starts else too_few_cut_points(self.single, options.pipeline_stages)
            if too_many is not None:
                raise StrategyError(too_many)
        elif options.mode.searched:
            most = min(devices, len(cut_points(self.single)) + 1)
            counts = [1 << k for k in range(most.bit_length()) if 1 << k <= most]
        else:
            counts = [1]
        coupled = next((op.name for op in self.graph.ops if batch_statistics(op)), None)
        if coupled is not None and (options.micro_batches or 1) > 1:
            raise StrategyError(
                f"Operator {coupled!r} normalises with its batch's statistics (a BatchNorm in training), which"
                f" {options.micro_batches} micro-batches would change; plan it with micro_batches=1."
            )
        if options.micro_batches is not None:
            micro = [options.micro_batches]
        elif not options.mode.searched or self.step_batch is None or not self.rebatches:
            micro = [1]
        else:
            micro = self._micro_batch_counts()
        return _listed([PipelineShape(s, m) for s in counts for m in micro])

    def search(self) -> ShapeResult:
        options = self.options
        if parameter_state_bytes(self.single) / options.num_devices > self.cost.capacity:
            run_search(self.single, self.searching)  # nothing can fit: its sentence says so
        floor = compute_floor(self.single)
        shapes = self.shapes()
        rank = {shape: index for index, shape in enumerate(shapes)}  # on a tie, the shape listed first wins
        best, order = self._visiting(shapes)
        return self._proved(self._searched(shapes, order, rank, best, floor))

    def _proved(self, best: ShapeResult) -> ShapeResult:
        """The best plan with what the search proved of it: no plan of any shape that fits is faster than the
        least of each searched shape's bound and its own step (a shape not searched was refuted by a bound no
        less than the best plan's step, or is not among those searched); exact only where that is its step."""
        bound = min(self.lower_s, best.time_s)
        exact = best.found.exact and bound >= best.time_s
        lower = bound if bound > -math.inf else None
        return dataclasses.replace(best, found=dataclasses.replace(best.found, exact=exact, bound_s=lower))

    def _searched(
        self,
        shapes: Sequence[PipelineShape],
        order: Sequence[PipelineShape],
        rank: Mapping[PipelineShape, int],
        best: ShapeResult | None,
        floor: float,
    ) -> ShapeResult:
        done: set[PipelineShape] = set()  # shapes bounded with an earlier one's group (`_group`)
        for index, shape in enumerate(order):
            progress.report("pipeline shapes", index, len(shapes))
            if shape in done:
                continue
            problem = self._opened(shape, best, rank, floor, order[index + 1 :])
            if problem is None:
                continue
            if shape.stages == 1 or self.options.stage_starts:
                best = _better(self._timed_search(problem, shape, self._bound(shape, best, rank)), best, rank)
            else:
                group = self._group(shape, problem, order[index + 1 :], done, best, rank, floor)
                for member, bounded in group:
                    best = _better(self._search_bounded(member, bounded, self._bound(member, best, rank)), best, rank)
                del group
            del problem  # a losing shape's problem is not held while the next is built (but the last per stage count)
        if best is None and self._refusals and not self._built & {(s.stages, s.micro_batches) for s in shapes}:
            (stages, micro), error = next(iter(self._refusals.items()))  # no shape asked for could be built
            why = str(error)
            if isinstance(error, ModelImportError) and self.step_batch is not None:
                why = f"the model does not take a batch of {self.step_batch // micro} ({why.rstrip('.')})."
            kind = ModelImportError if isinstance(error, ModelImportError) else FixedStrategyError
            raise kind(
                f"No plan with {micro} micro-batch{'es' if micro > 1 else ''} over {stages}"
                f" stage{'s' if stages > 1 else ''}: {why}"
            ) from None
        if best is None:
            # raises when one stage does not fit: its sentence says what does not fit and how many devices would hold it
            self._say_leanest()
            run_search(self.single, self.searching, cache=self._single_runs)
            raise InfeasibleError(
                f"No plan with the pipeline stages and micro-batches asked for fits in device memory on"
                f" {self.options.num_devices} devices; leave them to the search."
            )
        return best

    def _say_leanest(self) -> None:
        """Where one stage over the most micro-batches searched has no plan that fits either, raise its sentence
        (its leanest plan's bytes, not the whole batch's, which the micro-batches shrink), saying so."""
        most = max((shape.micro_batches for shape in self.shapes() if shape.stages == 1), default=1)
        problem = self.problem(1, most) if most > 1 else None
        if problem is None:
            return
        try:
            run_search(stage_problem(problem, 0, problem.size, PipelineShape(1, most), 0), self.searching)
        except InfeasibleError as error:
            said = str(error).replace(NOTHING_FITS, f"{NOTHING_FITS}, even over {most} micro-batches", 1)
            raise InfeasibleError(said) from None

    def _opened(
        self,
        shape: PipelineShape,
        best: ShapeResult | None,
        rank: Mapping[PipelineShape, int],
        floor: float,
        later: Sequence[PipelineShape] = (),
    ) -> SearchProblem | None:
        """``shape``'s problem, built, where what is known before building it leaves it a chance to beat the
        best plan (None: refuted, or the model has no problem at that shape). ``later``: the shapes to visit
        after it, whose one-stage counts may be relaxed with its own (`_relax_together`)."""
        bound = self._bound(shape, best, rank)
        if not self._may_win(shape, best, bound, floor):
            return None
        if self._relaxes_together(shape, bound, shape_floor(floor, self.options.num_devices, shape)):
            counts = [s.micro_batches for s in later if s.stages == 1 and s.micro_batches > 1]
            self._relax_together(
                shape, bound, [m for m in counts if self._may_win(PipelineShape(1, m), best, bound, floor)]
            )
        if self._relaxation_refutes(shape, bound):
            return None
        if self._smaller_batch_refutes(shape, bound):
            return None
        if shape.stages > 1 and shape.stages not in self._counts_relaxed and self._relaxes_counts(shape, bound):
            counts = [
                s.micro_batches for s in later if s.stages == shape.stages and self._may_win(s, best, bound, floor)
            ]
            self._relax_counts(shape, bound, counts)
        if self._counts_refute(shape, bound):
            return None
        problem = self.problem(shape.stages, shape.micro_batches)
        if problem is not None and shape.stages > 1:  # it may refute a shape of as many stages, more micro-batches
            self._stages_built[shape.stages] = (shape.micro_batches, problem)
        return problem

    def _group(
        self,
        shape: PipelineShape,
        problem: SearchProblem,
        rest: Sequence[PipelineShape],
        done: set[PipelineShape],
        best: ShapeResult | None,
        rank: Mapping[PipelineShape, int],
        floor: float,
    ) -> list[tuple[PipelineShape, ShapeBound]]:
        """The shapes of more than one stage to search now, each with its bounds, in the order of those bounds
        (the least first, the shape listed first on a tie): ``shape``, where its bounds do not refute it, with
        the shapes of as many micro-batches still to visit (``rest``, each then ``done``) that theirs do not.

        Where memory binds, more stages often fit a faster plan, and the bounds of a shape's stages say which
        (a DP run over each kind of copy per place): searched first, the least bound's plan most often refutes
        the others by their bounds alone, where a search of each in the order listed walks their cuts in full.
        GPT-3 175B on 1,024 Ascend 910s, 48 micro-batches: 2 stages bounded at 57.96 s, 4 at 51.17 s, 8 at
        48.70 s; 8 stages searched first find 58.17 s, 4 then the best plan (57.31 s), and 2 are refuted, where
        searching 2 stages first (61.31 s) then 4 took twice as long. The group's problems are held at once:
        one micro-batch count's, one per stage count."""
        bound = self._bound(shape, best, rank)
        bounded = self._bounded(problem, shape, bound)
        if bounded.seconds >= bound:
            self.lower_s = min(self.lower_s, bounded.seconds)
            return []
        group = [(shape, bounded)]
        for sibling in rest:
            if sibling in done or sibling.stages == 1 or sibling.micro_batches != shape.micro_batches:
                continue
            done.add(sibling)
            built = self._opened(sibling, best, rank, floor, rest)
            if built is None:
                continue
            bound = self._bound(sibling, best, rank)
            bounded = self._bounded(built, sibling, bound)
            if bounded.seconds >= bound:
                self.lower_s = min(self.lower_s, bounded.seconds)
                continue
            group.append((sibling, bounded))
        return sorted(group, key=lambda member: (member[1].seconds, rank[member[0]]))

    def _bounded(self, problem: SearchProblem, shape: PipelineShape, bound: float) -> ShapeBound:
        """`bound_shape`, timed, noting whether memory raised the bound past the stages' floors (which
        `_smaller_batch_refutes` reads)."""
        started = time.perf_counter()
        try:
            bounded = bound_shape(problem, shape, dataclasses.replace(self.searching, bound=bound, hint=self._hint))
        finally:
            self.search_s += time.perf_counter() - started
        self._memory_bound[shape.stages] = bounded.seconds > bounded.floors.seconds
        return bounded

    def _search_bounded(self, shape: PipelineShape, bounded: ShapeBound, bound: float) -> ShapeResult | None:
        """The best plan of a shape bounded before (`search_bounded`; None: none fits faster than ``bound``),
        timed, its bound kept (`lower_s`)."""
        started = time.perf_counter()
        try:
            result, lower = search_bounded(bounded, bound)
        finally:
            self.search_s += time.perf_counter() - started
        self.lower_s = min(self.lower_s, lower)
        if result is None:
            return None
        found = joined(result, time.perf_counter() - started)
        return ShapeResult(bounded.search.problem, found, result, result.time_s, shape)

    def _bound(self, shape: PipelineShape, best: ShapeResult | None, rank: Mapping[PipelineShape, int]) -> float:
        """The step time ``shape`` must beat: the best plan's (a shape listed before the best one wins a tie
        with it, so it must be searched for one)."""
        if best is None:
            return math.inf
        return best.time_s * (1 + _TIE if rank[shape] < rank[best.shape] else 1)

    def _timed_search(self, problem: SearchProblem, shape: PipelineShape, bound: float) -> ShapeResult | None:
        """`_search_shape`, timed, its bound kept (`lower_s`)."""
        started = time.perf_counter()
        try:
            searched, lower = self._search_shape(problem, shape, bound)
        finally:
            self.search_s += time.perf_counter() - started
        self.lower_s = min(self.lower_s, lower)
        return searched

    def _may_win(self, shape: PipelineShape, best: ShapeResult | None, bound: float, floor: float) -> bool:
        """Whether a shape is left a chance to beat ``bound`` by what is known without building it."""
        options = self.options
        if shape_floor(floor, options.num_devices, shape) >= bound:
            return False  # no plan of this shape can be faster
        if shape.stages == 1 and options.micro_batches is None and self._fits_whole(best):
            return False  # one stage's fastest plan fits: micro-batches only repeat its work at smaller sizes
        if shape.stages == 1 and self._fewer_micro_batches_win(shape, bound):
            return False  # a divisor's fastest plan (or its own), memory aside, does not beat the best: nor does this
        # stages are searched where memory binds one stage (or asked for)
        return not (shape.stages > 1 and options.pipeline_stages is None and self._memory_free(best))

    def _relaxation_refutes(self, shape: PipelineShape, bound: float) -> bool:
        """Whether one stage over ``shape``'s micro-batches has no plan that fits faster than ``bound``, shown on
        the whole batch's problem relaxed to a micro-batch's (`SearchProblem.micro_batch_relaxation`: its
        activations and inputs shrunk, the splits a micro-batch lacks priced out) before the shape is built.
        One DP run (`fastest_bound`): the relaxation's fastest plan of the first way to recompute that can fit,
        memory aside, is no faster than the count's; that of all, where it is the one, bounds its multiples
        too (`_fewer_micro_batches_win`). Where that refutes nothing and memory may (`_memory_may_refute`), memory
        counts too: a DP run per way to recompute at the hint's weight (`memory_bound`; the relaxation's bytes are
        no more than the count's). Where it refutes nothing, the shape is built and searched as before (its
        import kept). Megatron's 76.1B GPT on 1,024 GPUs: 4 micro-batches (so 8 to 64) and 2 refuted in 1.3 s,
        where their builds and walks took 3.6 s; GPT-3 175B on 1,024 Ascend 910s, whose one-stage plans memory
        binds: 3, 12, 16 and 24 micro-batches refuted with memory counted, where each took a build and a walk."""
        if shape.stages > 1 or shape.micro_batches == 1 or math.isinf(bound) or self.options.search.value != "dp":
            return False
        together = self._together.get(shape.micro_batches, -math.inf)
        if together >= bound:  # (refuted with other counts: `_relax_together`)
            self.lower_s = min(self.lower_s, together)
            return True
        try:
            graph = self._graph(shape.micro_batches)
        except ModelImportError:
            return False  # (the shape's build says why)
        lacking = lacking_splits(self.single, graph)
        if lacking is None:
            return False
        relaxed = self.single.micro_batch_relaxation(1.0 / shape.micro_batches, lacking, 2.0 * bound)
        least, fastest = self._relaxed_bound(relaxed, bound)
        self._note_fastest(self.single, shape, fastest)
        if least < bound:
            return False
        self.lower_s = min(self.lower_s, least)
        return True

    def _relaxes_together(self, shape: PipelineShape, bound: float, floor: float) -> bool:
        """Whether one stage over ``shape``'s micro-batches is relaxed with the counts after it (`_relax_together`):
        they were not relaxed together for ``bound`` or a smaller one, nor refuted so, and `_memory_may_refute`'s
        guess says yes, made before the counts are imported with ``floor`` (`shape_floor`, no more than any
        relaxation's bound memory aside) for the relaxation's bound. GPT-3 175B on 1,024 Ascend 910s: 111.7 s
        against 57.3 s, its floor 34.1 s; Megatron's 39.1B GPT on 512 GPUs: 9.184 s against 9.180 s, its floor
        8.0 s, so its counts are relaxed one by one."""
        return (
            shape.stages == 1
            and shape.micro_batches > 1
            and bound < self._together_at
            and self.options.search.value == "dp"
            and self._memory_may_refute(floor, bound)
            and self._together.get(shape.micro_batches, -math.inf) < bound
            and _shrinks_with_share(self.single)
        )

    def _relax_together(self, shape: PipelineShape, bound: float, later: Sequence[int]) -> None:
        """Bound one stage over ``shape``'s micro-batches and each count of ``later`` at once, before any is
        relaxed alone (`_relaxation_refutes`, which reads the bounds kept here), where memory bound a search
        before and the fastest one-stage plan found is slower than ``bound``: one relaxation of the whole batch's
        problem for them all, its bytes that grow with the batch scaled by the least share (1 / the most
        micro-batches) and only the candidates every count lacks priced out. Each count's own relaxation
        (`SearchProblem.micro_batch_relaxation`) is a stricter problem: each of its plans is a plan here, as
        fast, and fits here where it fits there (a byte that grows with the batch counts less at a smaller
        share, recomputing or not: `_shrinks_with_share`). So the bound here bounds every count's plans.
        Once per bound to beat, a DP run memory aside and, where it refutes nothing, a run per way to recompute
        at the hint's weight (`memory_bound`). GPT-3 175B on 1,024 Ascend 910s: its ten other counts bounded at
        64.4 s against the best plan's 57.3 s, in three DP runs, where one by one they took 24."""
        lacking: dict[int, list[np.ndarray]] = {}
        started = time.perf_counter()
        for count in [shape.micro_batches, *later]:
            try:
                found = lacking_splits(self.single, self._graph(count))
            except ModelImportError:
                continue  # (the count's own build says why)
            if found is not None:
                lacking[count] = found
        self.costing_s += time.perf_counter() - started
        if len(lacking) < 2:
            return
        self._together_at = bound
        every = [np.logical_and.reduce([lacks[node] for lacks in lacking.values()]) for node in range(self.single.size)]
        least, _ = self._relaxed_bound(
            self.single.micro_batch_relaxation(1.0 / max(lacking), every, 2.0 * bound), bound
        )
        for count in lacking:
            self._together[count] = max(self._together.get(count, -math.inf), least)

    def _relaxed_bound(self, relaxed: SearchProblem, bound: float) -> tuple[float, float | None]:
        """A step no plan of a one-stage relaxation of the whole batch (`micro_batch_relaxation`) that fits beats,
        told ``bound``, and its fastest plan memory aside (as `fastest_bound` gives it), timed: one DP run on the
        whole batch's solver (its tables), and where that is short of ``bound`` and memory may refute
        (`_memory_may_refute`), a run per way to recompute at the hint's weight (`memory_bound`)."""
        started = time.perf_counter()
        searching, solver = dataclasses.replace(self.searching, bound=bound), self._single_runs.solver
        least, fastest = fastest_bound(relaxed, searching, solver)
        if least < bound and self._memory_may_refute(least, bound):
            least = memory_bound(relaxed, searching, self._hint, least, solver)
        self.search_s += time.perf_counter() - started
        return least, fastest

    def _memory_may_refute(self, least: float, bound: float) -> bool:
        """Whether a relaxation that memory aside does not refute a one-stage shape (its bound ``least``, short of
        ``bound``) is worth its DP runs with memory counted: memory bound a search before (a hint), and the fastest
        one-stage plan found is slower than ``bound`` by as much as ``least`` falls short of it (memory cost those
        plans at least that much). A guess about cost only: where it says no, the shape is built and searched.
        GPT-3 175B on 1,024 Ascend 910s: its one-stage plan takes 111.7 s against 57.3 s, and its relaxations
        with memory counted bound 75-101 s; Megatron's 39.1B GPT on 512 GPUs: 9.18 s against 9.18 s, where
        memory counted would raise no relaxation past the bound."""
        return self._hint > 0.0 and self._one_stage_s - bound >= bound - least

    def _smaller_batch_refutes(self, shape: PipelineShape, bound: float) -> bool:
        """Whether ``shape``'s stages have no plan faster than ``bound``, shown before it is built on the problem
        of the shape with as many stages and fewer micro-batches (so a larger micro-batch) built last.

        ``shape``'s micro-batch is a ``share`` of that one (M / M', M' its count): its plans are plans there
        (`lacking_splits` prices out the splits it lacks, and refuses where it has more), and each operator's
        time and each edge's per micro-batch is at least ``share`` of its time there, as every size and every
        operator's FLOPs is at least ``share`` of its own there and no size is larger (`_sizes_shrink`, on
        its import), a matmul's rate does not rise as its smallest dimension falls (`Falloff`), and a
        collective's latency is paid whatever its payload. So ``share`` times the `time_floors` of that
        problem relaxed (`SearchProblem.per_micro_batch_relaxation`: the sync and the update paid once a step
        left out, as what the backward hides changes with the micro-batch, and memory aside) over ``shape``'s
        slots bounds every plan of ``shape`` from below. Not where a ring input's transfer hides under its
        product (what stays exposed need not shrink so), nor where the problem's forks pass through.

        The search visits such a pair of shapes the fewer micro-batches first (`_visiting_order`). Where the
        split of a micro-batch binds (a 7 x 2^k batch on 2^k devices), this refutes most of the other counts:
        Megatron's 76.1B GPT on 1,024 GPUs, 7 of its 11 stage shapes refuted, each for its import and one DP
        run over one copy of its layer. Not tried where memory raised the held shape's bound past its stages'
        floors (`_bounded`): this floor leaves memory out, so it falls short where memory is what binds. A guess
        about cost only (the shape is then built and bounded as any other): GPT-3 175B on 1,024 Ascend 910s,
        whose stage shapes memory binds every one, refuted one of 15 so, for 4.5 s of DP runs."""
        held = self._stages_built.get(shape.stages)
        if held is None or held[0] >= shape.micro_batches or math.isinf(bound):
            return False
        if self._memory_bound.get(shape.stages, False):
            return False  # (a guess about cost: the floor leaves memory out, and memory bound the shape held)
        micro, problem = held
        started = time.perf_counter()
        try:
            graph = self._graph(shape.micro_batches)
        except ModelImportError:
            return False  # (the shape's build says why)
        finally:
            self.costing_s += time.perf_counter() - started
        started = time.perf_counter()
        least = smaller_batch_floor(problem, micro, graph, shape, bound)
        self.search_s += time.perf_counter() - started
        if least is None or least < bound:
            return False
        self.lower_s = min(self.lower_s, least)
        return True

    def _relaxes_counts(self, shape: PipelineShape, bound: float) -> bool:
        """Whether the micro-batch counts of ``shape``'s stage count are relaxed in pairs (`_relax_counts`) before
        ``shape`` is built: a bound to beat, the DP, memory raising the bound of the shape held for that stage
        count (so the counts' own floors, memory aside, are too weak to refute them). A guess about cost: a
        shape not refuted so is built and bounded as any other."""
        return (
            not math.isinf(bound) and self.options.search.value == "dp" and self._memory_bound.get(shape.stages, False)
        )

    def _relax_counts(self, shape: PipelineShape, bound: float, later: Sequence[int]) -> None:
        """Bound ``shape``'s stage count over its micro-batch count and those of ``later`` (the counts still to
        visit), before any is built, in groups of four counts in order (`counts_floor`: the whole batch's problem
        on one stage's devices relaxed to every count of a group), each group not bounded so halved once; once a
        stage count, where at least `_COUNTS_RELAXED` counts are left (a guess about cost: the whole batch's
        problem is built with its twin at zero bytes, `build_with_latency`, and each group's bound takes about a
        count's own build and bound). Each count's bound is kept for `_counts_refute`. GPT-3 175B on 1,024 Ascend 910s:
        2 stages over 2 to 64 micro-batches, their own bounds 58.2-75.1 s against the best plan's 57.3 s, bounded
        in three groups at 57.8-72.5 s, where each count took its build and bound (24 s in all, 6 here)."""
        self._counts_relaxed.add(shape.stages)
        counts = sorted({shape.micro_batches, *later} - {m for s, m in self._built if s == shape.stages})
        if len(counts) < _COUNTS_RELAXED:
            return
        devices = self.options.num_devices // shape.stages
        started = time.perf_counter()
        try:
            whole, latency = build_with_latency(self.graph, self.cost, devices, fixed=self.options.fixed)
        except FixedStrategyError:
            return  # (a fixed strategy does not fit that many devices: each shape's build says so)
        finally:
            self.costing_s += time.perf_counter() - started
        for at in range(0, len(counts), 4):
            group = counts[at : at + 4]
            least = self._counts_bound(shape.stages, group, bound, (whole, latency))
            halves = [group[:2], group[2:]] if least < bound and len(group) > 2 else []
            for half in halves:
                self._counts_bound(shape.stages, half, bound, (whole, latency))

    def _counts_bound(
        self, stages: int, counts: Sequence[int], bound: float, problems: tuple[SearchProblem, SearchProblem]
    ) -> float:
        """`counts_floor` of ``stages`` stages over each of ``counts``, timed, told ``bound`` (``problems``: the
        whole batch's on one stage's devices, and the same with every edge at zero bytes), kept per count for
        `_counts_refute` (minus infinity where its premise does not hold)."""
        started = time.perf_counter()
        try:
            graphs = {count: self._graph(count) for count in counts}
        except ModelImportError:
            return -math.inf  # (the shape's build says why)
        finally:
            self.costing_s += time.perf_counter() - started
        started = time.perf_counter()
        searching = dataclasses.replace(self.searching, bound=bound * (1 + _TIE), hint=self._hint)
        least = counts_floor(*problems, graphs, PipelineShape(stages, counts[0]), searching)
        self.search_s += time.perf_counter() - started
        if least is None:
            return -math.inf
        self._counts.update(((stages, count), least) for count in counts)
        return least

    def _counts_refute(self, shape: PipelineShape, bound: float) -> bool:
        """Whether ``shape``'s micro-batch count was bounded at ``bound`` or more with others (`_relax_counts`)."""
        least = self._counts.get((shape.stages, shape.micro_batches), -math.inf)
        if least < bound:
            return False
        self.lower_s = min(self.lower_s, least)
        return True

    def _micro_batch_counts(self) -> list[int]:
        """The micro-batch counts the search may try: the batch's divisors, up to `MAX_MICRO_BATCHES`."""
        if self.step_batch is None or any(batch_statistics(op) for op in self.graph.ops):
            return [1]  # (a BatchNorm in training would normalise each micro-batch with its own statistics)
        return [m for m in range(1, min(self.step_batch, MAX_MICRO_BATCHES) + 1) if self.step_batch % m == 0]

    def _visiting(self, shapes: list[PipelineShape]) -> tuple[ShapeResult | None, list[PipelineShape]]:
        """The whole batch's plan where it is found already, and the shapes to search, in the order to search
        them (`_visiting_order`). With micro-batch counts to search, one DP run first says whether the whole
        batch's fastest plan fits (bound 0: only such a plan comes back). Where it does not, memory binds, and
        a micro-batch count is searched before the whole batch: the walk along the whole batch's memory hull,
        a handful of runs, is then most often refuted in one."""
        order = _visiting_order(shapes)
        if self.options.search.value != "dp" or len(order) < 2 or order[0] != ONE_STAGE or order[1].stages > 1:
            return None, order
        started = time.perf_counter()
        try:
            fits, lower = self._search_shape(self.single, ONE_STAGE, 0.0)
        finally:
            self.search_s += time.perf_counter() - started
        if fits is not None:  # (where none fits, the whole batch is searched again: its bound is that search's)
            self.lower_s = min(self.lower_s, lower)
        return (fits, order[1:]) if fits is not None else (None, [order[1], ONE_STAGE, *order[2:]])

    def _note_fastest(self, problem: SearchProblem, shape: PipelineShape, fastest_s: float | None) -> None:
        """Keep a count's fastest plan (memory aside) to bound its multiples, where it may: its forks meet, or
        no one-stage problem's do (`_fewer_micro_batches_win`)."""
        if fastest_s is not None and (problem.forks_meet or not self.single.forks_meet):
            self._fastest[shape.micro_batches] = fastest_s

    def _fewer_micro_batches_win(self, shape: PipelineShape, best_s: float) -> bool:
        """Some micro-batch count dividing ``shape``'s had no plan faster than ``best_s``, memory aside: its own
        too, where it was searched before (the whole batch, in its one-run check, `_visiting`).

        A plan of M' micro-batches is one of M' / M times fewer (M dividing M'), at least as fast, only where
        its candidates are there too: a fork's meeting layouts are not where the fewer micro-batches' forks
        only pass through (meeting went over the size limits). So a count bounds its multiples only where its
        forks meet, or where the whole batch's do not: every one-stage problem's forks then pass through
        (`problem`), so the counts compare like with like."""
        return any(shape.micro_batches % m == 0 and t >= best_s for m, t in self._fastest.items())

    def _memory_free(self, best: ShapeResult | None) -> bool:
        """The best plan so far is one stage's and memory did not bind it: the fastest plan fit as it was (no
        memory weight, no recomputation the search chose; recomputation the options ask for does not count),
        and would fit with every optimizer whole. A parallel optimizer the search took because it is faster
        (each rank updating its shard) may be what fits a large model all the same (the 76.1B GPT on 1,024
        GPUs: its one-stage plan holds 19 B parameters' state a device without it), and stages may then be
        faster (4 there, 7 % faster)."""
        if best is None or best.pipeline is not None or best.found.memory_multiplier:
            return False
        if best.found.choices.recompute and self.options.recompute is None:
            return False
        whole = dataclasses.replace(best.found.choices, sharded=frozenset())
        return best.problem.memory(best.found.choice, whole) <= self.cost.capacity

    def _fits_whole(self, best: ShapeResult | None) -> bool:
        """`_memory_free`, over the whole batch (one micro-batch)."""
        return self._memory_free(best) and best is not None and best.found.choices.micro_batches == 1

    def _search_shape(
        self, problem: SearchProblem, shape: PipelineShape, bound: float
    ) -> tuple[ShapeResult | None, float]:
        """The best plan of one shape (None: nothing fits, or nothing faster than ``bound``), and a step no plan
        of the shape that fits beats (`SearchResult.bound_s`; ``bound`` where none beats it; infinite where none
        fits; minus infinity where not known)."""
        options = self.options
        searching = dataclasses.replace(self.searching, bound=bound, hint=self._hint)
        started = time.perf_counter()
        if shape.stages == 1:  # the whole model as one stage (over the micro-batches: gradient accumulation)
            stage = problem if shape == ONE_STAGE else stage_problem(problem, 0, problem.size, shape, 0)
            cache = self._single_runs if stage is self.single else None
            try:
                found = run_search(stage, searching, cache)
            except NothingFaster as beaten:
                self._note_fastest(stage, shape, beaten.fastest_s)
                return None, bound
            except InfeasibleError:
                if len(self.shapes()) == 1:
                    raise
                return None, math.inf
            self._note_fastest(stage, shape, found.fastest_s)
            self._hint = found.memory_multiplier or self._hint
            lower = found.bound_s if found.bound_s is not None else -math.inf
            seconds = stage.objective(found.choice, found.choices)
            self._one_stage_s = min(self._one_stage_s, seconds)
            if shape == ONE_STAGE:
                return ShapeResult(problem, found, None, seconds), lower
            if seconds >= bound:
                return None, lower
            whole = PipelineResult(shape, (StagePlan(0, problem.size, found, seconds),))
            searched = ShapeResult(problem, joined(whole, time.perf_counter() - started), None, seconds, shape)
            return searched, lower
        starts = stage_starts(problem, options.stage_starts) if options.stage_starts else None
        result, lower = bounded_search_stages(problem, shape, searching, starts)
        if result is None:
            return None, lower
        found = joined(result, time.perf_counter() - started)
        return ShapeResult(problem, found, result if shape.stages > 1 else None, result.time_s, shape), lower


_Kept = TypeVar("_Kept", bound=BaseException)


def _detached(error: _Kept) -> _Kept:
    """An error to keep, without the traceback of its raising or of the error it was raised handling: their
    frames hold the search that keeps it, a cycle only the collector would free."""
    error.__context__ = None
    return error.with_traceback(None)


_TIE = 1e-12
"""Plans of two shapes this close in step time (relative) are a tie: the shape listed first wins."""

_COUNTS_RELAXED = 8
"""The fewest micro-batch counts of a stage count left to visit that `ShapeSearch._relax_counts` relaxes
together. Measured on GPT-3 175B on 1,024 Ascend 910s: 2 stages have 10 left, whose builds and bounds took 15 s
and whose groups take 6 s after 1.3 s of the whole batch's builds; 4 stages have 7, whose builds and bounds take
6 s, and whose relaxations in pairs would take as long with the builds, two of them refuting nothing."""


def _wins(searched: ShapeResult, best: ShapeResult, rank: Mapping[PipelineShape, int]) -> bool:
    """Whether a shape's plan beats the best so far: faster, or tied and listed first (`ShapeSearch.shapes`)."""
    if searched.time_s < best.time_s * (1 - _TIE):
        return True
    return rank[searched.shape] < rank[best.shape] and searched.time_s < best.time_s * (1 + _TIE)


def _better(
    searched: ShapeResult | None, best: ShapeResult | None, rank: Mapping[PipelineShape, int]
) -> ShapeResult | None:
    """The better of a shape's plan (None: it had none) and the best so far (`_wins`)."""
    if searched is not None and (best is None or _wins(searched, best, rank)):
        return searched
    return best


def _listed(shapes: Sequence[PipelineShape]) -> list[PipelineShape]:
    """Shapes in the order the search lists them (`ShapeSearch.shapes`): the one-stage, one-micro-batch plan first,
    then by the share of a step each stage works (the least bubble first), fewer stages and micro-batches first.

    >>> [(p.stages, p.micro_batches) for p in _listed([PipelineShape(2, 2), PipelineShape(2, 8), ONE_STAGE])]
    [(1, 1), (2, 8), (2, 2)]
    """
    return sorted(shapes, key=lambda p: (p != ONE_STAGE, p.slots / p.micro_batches, p.stages, p.micro_batches))


def _visiting_order(shapes: Sequence[PipelineShape]) -> list[PipelineShape]:
    """The order shapes are searched in: the list's own, but for one stage's micro-batch counts after the
    whole batch: the count a quarter of the way up their list first, then the stages, then the other
    counts, those below it down, then those above it up; the stages' shapes with the fewer micro-batches of
    each pair first (`_fewer_micro_batches_first`).

    Where memory binds one stage, its fastest plan is most often at a low but not the lowest count (fewer
    do not fit without recomputing, more pay their collectives' latency more often), and a good plan found
    early refutes the others in a DP run or two each, where counting up walks most of them in full. The
    stages come next: where memory binds even that count's plan they are most often faster still, and the
    best plan of any shape refutes the other counts fastest, a multiple of a count searched before unbuilt
    where that count's fastest plan is no faster (`_fewer_micro_batches_win`). GPT-3 175B on 1,024 devices,
    whose stages' plans are a third faster than one stage's: its ten other counts took 53 s before the
    stages; after them, seven take a build and a DP run each (15 s) and three are not built.
    The order changes how fast the search is, not what it finds: a tie goes to the shape listed first
    whichever is searched first (`_wins`), and a walk ends at the same plan whatever weight it starts from,
    up to plans tied on one edge of its hull (which the weights the walks start from, other shapes', may
    pick differently).

    >>> order = _visiting_order([ONE_STAGE, *(PipelineShape(1, m) for m in (2, 3, 4, 6, 8)), PipelineShape(2, 8)])
    >>> [(p.stages, p.micro_batches) for p in order]
    [(1, 1), (1, 3), (2, 8), (1, 2), (1, 4), (1, 6), (1, 8)]
    """
    micro = [shape for shape in shapes[1:] if shape.stages == 1]
    if len(micro) < 3 or shapes[0] != ONE_STAGE:
        return _fewer_micro_batches_first(shapes)
    at = len(micro) // 4
    counts = [*micro[at::-1], *micro[at + 1 :]]
    stages = _fewer_micro_batches_first([shape for shape in shapes[1:] if shape.stages > 1])
    return [shapes[0], counts[0], *stages, *counts[1:]]


def _fewer_micro_batches_first(shapes: Sequence[PipelineShape]) -> list[PipelineShape]:
    """The shapes of more than one stage taken in pairs per stage count, in their order (a count's first and
    second, its third and fourth, ...), each pair swapped where its second has fewer micro-batches; the rest
    where they are. The fewer micro-batches' problem then often refutes the other's unbuilt
    (`ShapeSearch._smaller_batch_refutes`), where the other first could not be refuted so.

    >>> shapes = [PipelineShape(s, m) for s, m in ((2, 8), (2, 6), (4, 8), (2, 4), (4, 6), (2, 3), (1, 2))]
    >>> [(p.stages, p.micro_batches) for p in _fewer_micro_batches_first(shapes)]
    [(2, 6), (2, 8), (4, 6), (2, 3), (4, 8), (2, 4), (1, 2)]
    """
    order = list(shapes)
    waiting: dict[int, int] = {}  # per stage count, where the first of a pair is
    for at, shape in enumerate(order):
        if shape.stages == 1:
            continue
        first = waiting.pop(shape.stages, None)
        if first is None:
            waiting[shape.stages] = at
        elif shape.micro_batches < order[first].micro_batches:
            order[first], order[at] = shape, order[first]
    return order


def _shrinks_with_share(problem: SearchProblem) -> bool:
    """Whether every operator's bytes in ``problem``'s micro-batch relaxation (`micro_batch_relaxation`) fall
    with the share, recomputing or not: its memory there is its bytes less (1 - share) x what grows with the
    batch, plus share x what recomputing frees (no more than nothing), so it falls where the activations left
    after recomputing are no fewer than nothing, as an operator's bytes kept for the backward are."""
    return all(
        bool((problem.node_activations[node] + freed >= 0.0).all()) for node, freed in problem.recompute_memory.items()
    )


def lacking_splits(problem: SearchProblem, graph: Graph) -> list[np.ndarray] | None:
    """Per operator of ``problem``, which of its candidates split a label further than ``graph`` (the same
    model at a smaller batch) divides it: candidates that model cannot have (None where the two do not
    list the same operators, or where ``graph`` splits some label further: its candidates are then not
    among ``problem``'s). An operator whose labels differ there keeps every candidate; the copies of
    a folded run take their first copy's."""
    if len(graph.ops) != problem.size:
        return None
    copy_of: dict[int, int] = {}
    for repeat, _ in problem.folds:
        for k in range(1, repeat.copies):
            copy_of.update((node, node - k * repeat.period) for node in repeat.block(k))
    lacking: list[np.ndarray] = []
    for node, (rule, op) in enumerate(zip(problem.rules, graph.ops)):
        if op.name != rule.op.name:
            return None
        if node in copy_of:
            lacking.append(lacking[copy_of[node]])
            continue
        smaller = OpRule.build(op, graph, problem.mesh_bits)
        order = rule.spec.label_order
        most = [smaller.max_exponent(label) for label in order] if smaller.spec.label_order == order else []
        if any(m > rule.max_exponent(label) for m, label in zip(most, order)):
            return None
        if not most or all(m >= rule.max_exponent(label) for m, label in zip(most, order)):
            lacking.append(np.zeros(len(rule.candidates), dtype=bool))  # (every split it has, the smaller has)
            continue
        exponents = np.asarray(rule.candidates, dtype=np.int64).reshape(len(rule.candidates), len(order))
        lacking.append(np.asarray((exponents > np.asarray(most)).any(axis=1), dtype=bool))
    return lacking


def smaller_batch_floor(
    problem: SearchProblem, micro: int, graph: Graph, shape: PipelineShape, bound: float
) -> float | None:
    """A step no plan of ``shape`` beats, or ``bound`` and more, from ``problem``: the same model at ``micro``
    micro-batches on one of as many stages' devices, where ``graph`` is the model at ``shape``'s micro-batch,
    a smaller one (`ShapeSearch._smaller_batch_refutes` says why it bounds); None where that premise does not
    hold: sizes that do not shrink so (`_sizes_shrink`), splits ``graph`` has that ``problem`` lacks, forks that
    pass through, or a ring input's transfer hidden under its product (what stays exposed need not shrink)."""
    if not problem.forks_meet or any(ring.reads_through(problem, use) for use in problem.uses):
        return None
    lacking = (
        lacking_splits(problem, graph) if _sizes_shrink(problem.graph, graph, micro, shape.micro_batches) else None
    )
    if lacking is None:
        return None
    share = micro / shape.micro_batches
    relaxed = problem.per_micro_batch_relaxation(lacking, 2.0 * bound)
    points = [0, *cut_points(relaxed), relaxed.size]
    return share * time_floors(relaxed, shape, points, bound / share).seconds * (1 - 1e-9)  # (less, for rounding)


def counts_floor(
    whole: SearchProblem,
    latency: SearchProblem,
    graphs: Mapping[int, Graph],
    shape: PipelineShape,
    options: SearchOptions,
) -> float | None:
    """A step no plan of ``shape``'s stage count over any of the micro-batch counts of ``graphs`` (the model at
    each count's micro-batch) beats, or ``options.bound`` and more, from ``whole``: the whole batch on one
    stage's devices, and ``latency`` the same with every edge at zero bytes; ``shape`` has the fewest of the
    counts. The relaxation is `SearchProblem.counts_relaxation`'s, its stages' cuts sized as the most
    micro-batches' model (no larger than any count's), bounded as a shape is (`bound_shape`). None where the
    premise does not hold: a count's splits not among the whole batch's, forks that pass through, sizes that do
    not shrink with the count (`_sizes_shrink`), or a ring input's transfer hidden under its product (what
    stays exposed need not shrink)."""
    if not whole.forks_meet or any(ring.reads_through(whole, use) for use in whole.uses):
        return None  # (a count's forks meet: where the whole batch's do not, their candidates are not among its)
    if not _shrinks_with_share(whole):
        return None
    most = max(graphs)
    lacks = [found for found in (lacking_splits(whole, graph) for graph in graphs.values()) if found is not None]
    if len(lacks) < len(graphs):
        return None
    if not all(_sizes_shrink(whole.graph, graph, 1, count) for count, graph in graphs.items()):
        return None
    if not all(_sizes_shrink(graph, graphs[most], count, most) for count, graph in graphs.items()):
        return None
    every = [np.logical_and.reduce([lacking[node] for lacking in lacks]) for node in range(whole.size)]
    stages, fewest = shape.stages, shape.micro_batches
    shares = ((most + stages - 1) / (most * (fewest + stages - 1)), 1.0 / most)
    relaxed = whole.counts_relaxation(latency, shares, every, 2.0 * options.bound)
    sized = {name: info for name, info in graphs[most].tensors.items() if name in whole.graph.tensors}
    relaxed = dataclasses.replace(
        relaxed, graph=dataclasses.replace(whole.graph, tensors={**whole.graph.tensors, **sized})
    )
    return bound_shape(relaxed, shape, options).seconds * (1 - 1e-9)  # (less, for rounding)


def _sizes_shrink(larger: Graph, smaller: Graph, micro: int, more: int) -> bool:
    """Whether ``smaller`` is ``larger`` at ``micro`` / ``more`` of its micro-batch with every size and every
    operator's FLOPs at least that share of its own there, and no size larger: the same operators reading and
    writing the same tensors (a constant may be named for its batch: a Reshape's target), of the same types,
    roles and ranks (`ShapeSearch._smaller_batch_refutes`)."""
    if len(larger.ops) != len(smaller.ops):
        return False
    pairs: set[tuple[str, str]] = set()  # (each tensor is read and written by several operators: checked once)
    for big, small in zip(larger.ops, smaller.ops):
        ends = (len(big.inputs), len(big.outputs))
        if (big.name, big.op_type, ends) != (small.name, small.op_type, (len(small.inputs), len(small.outputs))):
            return False
        if small.flops * more < big.flops * micro:
            return False
        for big_name, small_name in zip((*big.inputs, *big.outputs), (*small.inputs, *small.outputs)):
            if big_name == small_name == "":
                continue
            if not big_name or not small_name:
                return False
            pairs.add((big_name, small_name))
    for big_name, small_name in pairs:
        big_tensor, small_tensor = larger.tensor(big_name), smaller.tensor(small_name)
        if big_name != small_name and not big_tensor.kind == small_tensor.kind == "constant":
            return False
        alike = (small_tensor.dtype, small_tensor.kind, small_tensor.trainable, len(small_tensor.shape))
        if alike != (big_tensor.dtype, big_tensor.kind, big_tensor.trainable, len(big_tensor.shape)):
            return False
        if any(s > b or s * more < b * micro for s, b in zip(small_tensor.shape, big_tensor.shape)):
            return False
    return True


def joined(result: PipelineResult, seconds: float) -> SearchResult:
    """A pipeline's stages as one search result on the micro-batch's problem."""
    first = result.stages[0].result
    exact = all(stage.result.exact for stage in result.stages)
    split = sum(stage.result.steps_split for stage in result.stages)
    relaxed = sum(stage.result.runs_relaxed for stage in result.stages)
    return SearchResult(
        result.choice,
        first.method,
        seconds,
        first.memory_multiplier,
        choices=result.choices,
        exact=exact,
        steps_split=split,
        runs_relaxed=relaxed,
    )


def stage_starts(problem: SearchProblem, names: Sequence[str]) -> tuple[int, ...]:
    """Each stage's first operator from the names of those after the first; one sentence for a name the
    model lacks or an order the graph does not have."""
    index = {rule.op.name: node for node, rule in enumerate(problem.rules)}
    starts = [0]
    for name in names:
        if name not in index:
            raise AutoparError(f"A stage is to start at {name!r}, which the model does not have.")
        if index[name] <= starts[-1]:
            raise AutoparError(f"The stage starting at {name!r} does not come after the stage before it in the graph.")
        starts.append(index[name])
    return tuple(starts)


def common_batch(graph: Graph) -> int | None:
    """The leading size every data input shares (the batch), or None."""
    sizes = {graph.tensor(name).shape[0] for name in graph.inputs if graph.tensor(name).shape}
    return sizes.pop() if len(sizes) == 1 else None
