"""Run a search mode on a costed problem, with device memory as a constraint.

The driver owns the solver: it plans one (`fold.Solver`) on the problem's arrays for each DP
search, or takes the one a `SearchCache` kept from an earlier search of the same problem, and binds
it to the tables each memory choice needs; nothing is stored on the problem.

Memory enters through a Lagrangian weight: if the fastest plan does not fit, the DP is rerun
with ``time + lambda * memory``, walking the lower hull of (time, memory) to the best plan on
it that fits. That is exact whenever the fastest plan fits (the usual case) and a good feasible
plan otherwise (the ILP is exact either way); when even the leanest plan does not fit, the
error names the largest tensors.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from autopar.context import planning
from autopar.errors import InfeasibleError
from autopar.limits import MAX_DEVICES
from autopar.options import Mode, SearchAlgorithm
from autopar.search.descent import condition_on_hubs, descend
from autopar.search.dp import TABLE_LIMITS, TableLimits, TieBreak
from autopar.search.fold import CopyRuns, Solver
from autopar.search.ilp import recomputing
from autopar.search.memory import NO_MEMORY_CHOICES, MemoryChoices
from autopar.search.problem import SearchProblem
from autopar.units import human_bytes

_HULL_STEPS = 64  # DP runs of a walk at most, widening ones included (a handful in practice)
_WIDEN = 2.0
"""While the only plan known to fit is the leanest (at an infinite weight), a walk's next weight is at most
this many times the last that did not fit, its power one higher at each such run (2, 4, 8, 16, 32): the leanest
plan is far from where the hull crosses the capacity (ten or a hundred times slower), so the line to it
overshoots the crossing by orders of magnitude, and the walk would climb back a run at a time. A hinted
walk's first run most often lands just short of the crossing (a neighbouring stage's weight), so the first
step is small; a weight far too small is passed as fast as eightfold steps pass it. At most `_WIDEN_RUNS`
such runs (a hint 32,768 times too small); then the line to the leanest plan again. GPT-3 175B on 1,024
devices, whose stages' walks widened 8-fold from their hint to plans far leaner than the crossing's: 180 s
where 192 s, the same plan; Megatron's 39.1B and 76.1B GPTs plan as fast as with eightfold steps."""
_WIDEN_RUNS = 5
_FIRST_SHARE = 0.15
"""Without a hint, a walk's first weight prices the fastest plan's memory over the capacity at this share of
its time. Fitted: the 39.1B GPT's walks at 1, 4 and 6 micro-batches end at a weight pricing it at 16-18 %
(at 3, at 25 times its time: the walk then widens to it). A walk ends where it would without it (up to plans
tied on one edge of the hull), in fewer runs when it is near (4 micro-batches unhinted: 7 runs where 10)."""


@dataclass(frozen=True)
class SearchOptions:
    """How one problem is searched. ``mode``: MindSpore's parallel mode (the searched ones search; data
    parallel and stand-alone fix every strategy); ``algorithm``: the elimination DP or the ILP that checks it;
    ``recompute``: True (False) makes every plan recompute the repeated blocks' forward (keep every activation),
    None leaves it to the memory walk; ``bound``: with a finite one (seconds) the DP's memory walk stops,
    raising `NothingFaster`, once no plan that fits can beat it; ``hint``: a memory weight to try first where
    memory binds (the multiplier a like problem settled on), which changes how many DP runs the walk takes,
    not where it ends; ``table_limits``: how large an elimination step may be before it is split
    (`dp._split`); ``tie_break``: seconds a candidate's position adds among equal plans (`dp.TieBreak`; None:
    the problem's own). A mode or algorithm given by name is read as its enumeration (an unknown one is refused).

    >>> SearchOptions(algorithm="ilp").algorithm is SearchAlgorithm.ILP
    True
    """

    mode: Mode = Mode.AUTO_PARALLEL
    algorithm: SearchAlgorithm = SearchAlgorithm.DP
    recompute: bool | None = None
    bound: float = math.inf
    hint: float = 0.0
    table_limits: TableLimits = TABLE_LIMITS
    tie_break: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", Mode(self.mode))
        object.__setattr__(self, "algorithm", SearchAlgorithm(self.algorithm))


@dataclass(frozen=True)
class SearchResult:
    """A candidate index per operator, and how it was found.

    ``method`` is the solver (``dp``, ``ilp``) or the fixed mode (``data_parallel``,
    ``stand_alone``), or ``given`` for strategies a user supplied; ``memory_multiplier`` is
    the memory weight the constrained DP settled on (0 when the fastest plan fits). ``fastest_s``:
    where the DP ran, no plan of the problem is faster than this, memory aside (None: not known).
    """

    choice: tuple[int, ...]
    method: str
    time_s: float
    memory_multiplier: float = 0.0
    candidates_kept: int | None = None
    candidates_dropped: int | None = None
    choices: MemoryChoices = field(default=NO_MEMORY_CHOICES)
    fastest_s: float | None = None
    exact: bool = True
    bound_s: float | None = None
    steps_split: int = 0
    runs_relaxed: int = 0
    """``exact``: the plan is the fastest of the problem that fits (every elimination step within the table
    limits, and the fastest plan fits memory), up to the tie-break. ``bound_s``: no plan of the problem that
    fits is faster than this (the plan's own time where exact; a lower bound from the split tables and the
    memory weights tried otherwise; None: not known). ``steps_split``: elimination steps split to stay within
    the table limits (`dp._split`); ``runs_relaxed``: repeated runs whose copies each took the operators they
    share in the layouts they liked best (`fold.Solver`), for a lower bound where the copy-by-copy search split."""


@dataclass
class SearchCache:
    """What a DP search of one problem computes that a later search of the same problem takes again: its
    solver and the plan of each DP run, by (memory weight, recompute, time scale): a run is a function of
    the problem and those. A pipeline search asks first whether the whole batch's fastest plan fits, and
    where it does not, searches the whole batch again later, with a bound: that search starts from the same
    fastest plan. A cache serves the one problem it was first given (another is refused)."""

    solver: Solver | None = None
    runs: dict[tuple[float, bool, float], "_Point"] = field(default_factory=dict)
    problem: SearchProblem | None = None
    copies: CopyRuns | None = None  # copy eliminations its solver shares with other problems' (`fold.CopyRuns`)

    def serving(self, problem: SearchProblem) -> "SearchCache":
        """This cache, bound to ``problem`` (a ValueError for a cache of another problem)."""
        if self.problem is None:
            self.problem = problem
        elif self.problem is not problem:
            raise ValueError("a search cache serves the one problem it was first given")
        return self


class NothingFaster(InfeasibleError):
    """No plan of the problem that fits beats the bound the search was given (a search of one
    pipeline shape among several, or of one stage, that cannot win). ``fastest_s``: as
    `SearchResult.fastest_s`; ``bound_s``: no plan that fits is faster than this, the bound given or
    more (what the DP runs made on the way proved): a search asked again with a larger bound that this
    still meets needs no run. ``weight``: the memory weight whose run proved the most (0: memory aside), where
    a like problem's bound is likeliest to refute it too (`cuts._StageSearch`)."""

    def __init__(self, message: str, fastest_s: float | None, bound_s: float, weight: float = 0.0) -> None:
        super().__init__(message)
        self.fastest_s, self.bound_s, self.weight = fastest_s, bound_s, weight


def data_parallel_choice(problem: SearchProblem) -> list[int]:
    """Every candidate list starts with the data-parallel strategy."""
    return [0] * problem.size


def stand_alone_choice(problem: SearchProblem) -> list[int]:
    return [rule.candidates.index(rule.stand_alone) for rule in problem.rules]


@planning
def run_search(
    problem: SearchProblem, options: SearchOptions | None = None, cache: SearchCache | None = None
) -> SearchResult:
    """The plan ``options`` ask for (`SearchOptions`; the defaults: auto-parallel by the DP) on ``problem``.
    ``cache``: the same problem's earlier searches' solver and DP runs, taken again (and filled)."""
    options = options or SearchOptions()
    mode, recompute, bound, hint = options.mode, options.recompute, options.bound, options.hint
    start = time.perf_counter()
    capacity = problem.cost.capacity
    multiplier = 0.0
    choices = NO_MEMORY_CHOICES
    states: tuple[int | None, int | None] = (None, None)
    fastest: float | None = None
    exact, floor, solver = True, None, None
    if mode == Mode.DATA_PARALLEL:
        choice, used, exact = data_parallel_choice(problem), mode.value, False
    elif mode == Mode.STAND_ALONE:
        choice, used, exact = stand_alone_choice(problem), mode.value, False
    elif options.algorithm == SearchAlgorithm.ILP:
        from autopar.search.ilp import solve_ilp

        choice, choices = solve_ilp(problem, capacity, recompute=recompute)
        used = "ilp"
        floor = problem.objective(choice, choices)
    else:
        cache = (cache if cache is not None else SearchCache()).serving(problem)
        solver = cache.solver = cache.solver or Solver.of(problem, options.table_limits, cache.copies)
        tie = _tie_break(problem, options)
        choice, choices, multiplier, fastest, fits = _constrained_dp(
            problem, solver, capacity, recompute, bound, hint, cache.runs, tie
        )
        used, states = options.algorithm.value, solver.states()
        floor = problem.objective(choice, choices)
        exact = solver.exact and fits
        if not exact:
            floor = min(floor, _lower_bound(problem, cache.runs, recompute, capacity, tie.slack))
    memory = problem.memory(choice, choices)
    if memory > capacity:
        raise InfeasibleError(_infeasible_message(problem, choice, capacity, mode, choices))
    seconds = time.perf_counter() - start
    split = solver.splits if solver is not None else 0
    relaxed = len(solver.relaxed) if solver is not None else 0
    return SearchResult(
        tuple(choice), used, seconds, multiplier, *states, choices, fastest, exact, floor, split, relaxed
    )


def fastest_bound(
    problem: SearchProblem, options: SearchOptions, solver: Solver | None = None
) -> tuple[float, float | None]:
    """(no plan of the problem that fits is faster than this, memory aside: the fastest plan of the first way
    to recompute that can fit, infinite where none can; the fastest plan of all memory aside, as
    `SearchResult.fastest_s`, where that was the one): one DP run, on ``solver`` where given (planned on
    tables of the same shapes). A plan recomputing is no faster than the same plan keeping its activations,
    so the first way that can fit bounds the others (`_constrained_dp` starts so); no memory walk."""
    solver = solver or Solver.of(problem, options.table_limits)
    tie = _tie_break(problem, options)
    slack = tie.slack  # the most the tie-break adds to a plan's time
    runs = _Runs(problem, solver, tie.offsets(problem.node_time), {})
    ways = recomputing(problem, options.recompute)
    for kind in ways:
        if problem.memory_floor(kind) > problem.cost.capacity * (1 + 1e-12):
            continue  # no plan of this kind fits
        fast = runs.solve(0.0, kind)
        least = (fast.seen if solver.exact else min(fast.seen, fast.floor)) - slack
        return least, least if kind == ways[0] else None
    return math.inf, None


def memory_bound(
    problem: SearchProblem, options: SearchOptions, weight: float, least: float, solver: Solver | None = None
) -> float:
    """No plan of the problem that fits is faster than this, memory counted at ``weight``: the larger of ``least``
    (`fastest_bound`'s, memory aside, which bounds every way to recompute) and the Lagrangian bound of one DP run
    per way that can fit at that weight (`_lower_bound`). Once a way's run leaves it below ``options.bound``, the
    others are not run and ``least`` comes back (the shape is not refuted)."""
    solver = solver or Solver.of(problem, options.table_limits)
    tie = _tie_break(problem, options)
    runs = _Runs(problem, solver, tie.offsets(problem.node_time), {})
    capacity = problem.cost.capacity
    for kind in recomputing(problem, options.recompute):
        if problem.memory_floor(kind) > capacity * (1 + 1e-12):
            continue  # no plan of this kind fits
        if runs.solve(weight, kind).floor - weight * capacity - tie.slack < options.bound:
            return least
    return max(least, _lower_bound(problem, runs.made, options.recompute, capacity, tie.slack))


def _tie_break(problem: SearchProblem, options: SearchOptions) -> TieBreak:
    """The tie-break the options give, or the problem's own (a share of its data-parallel plan's step)."""
    if options.tie_break is not None:
        return TieBreak.at(options.tie_break, problem.node_time)
    return TieBreak.of(problem.node_time, problem.objective(data_parallel_choice(problem)))


def _lower_bound(
    problem: SearchProblem,
    runs: dict[tuple[float, bool, float], "_Point"],
    recompute: bool | None,
    capacity: float,
    slack: float,
) -> float:
    """A time no plan of the problem that fits beats, from the DP runs a search made: a run at memory weight w
    found no plan with time + w x memory below its value (a lower bound where its tables were split), so every
    plan that fits takes at least that value less w x capacity (Lagrangian duality), less what the tie-break
    adds (``slack``). The least over the memory choices (recomputation or not) that can fit; the best weight of
    each."""
    plain = [p.floor for (w, r, scale), p in runs.items() if w == 0.0 and not r and scale == 1.0]
    least = math.inf
    for kind in recomputing(problem, recompute):
        if problem.memory_floor(kind) > capacity * (1 + 1e-12):
            continue  # no plan of this kind fits
        bounds = [p.floor - w * capacity for (w, r, scale), p in runs.items() if r == kind and scale == 1.0]
        if kind and plain:
            bounds += plain  # a plan recomputing is no faster than the same plan keeping its activations
        least = min(least, max(bounds, default=-math.inf) - slack)
    return least


def _proving_weight(runs: dict[tuple[float, bool, float], "_Point"], capacity: float) -> float:
    """The memory weight of the run whose Lagrangian bound (`_lower_bound`) is highest: where a like problem's
    bound is likeliest to refute it too (0 where no run had a weight)."""
    weighed = [(p.floor - w * capacity, w) for (w, _, scale), p in runs.items() if w > 0.0 and scale == 1.0]
    return max(weighed, default=(0.0, 0.0))[1]


@dataclass(frozen=True)
class _Point:
    """A plan on the (time, memory) plane: ``seen`` is its time as the DP sees it (with the tie-break)."""

    choice: list[int]
    choices: MemoryChoices
    seen: float
    memory: float
    floor: float = -math.inf  # what the run's DP found no plan below (time + weight x memory, tie-break included)


@dataclass
class _Runs:
    """The DP runs of one problem's memory walk, each made once (``made``: by weight, recompute and time
    scale), seen with the tie-break ``offsets`` added (`dp.TieBreak`)."""

    problem: SearchProblem
    solver: Solver
    offsets: list[np.ndarray]
    made: dict[tuple[float, bool, float], _Point]

    def solve(self, weight: float, recompute: bool, time_scale: float = 1.0) -> _Point:
        """The plan that minimises time_scale x time + weight x memory (recomputing or not)."""
        key = (weight, recompute, time_scale)
        if key not in self.made:
            self.made[key] = self._run(weight, recompute, time_scale)
        return self.made[key]

    def _run(self, weight: float, recompute: bool, time_scale: float) -> _Point:
        problem, solver = self.problem, self.solver
        unary, takes = problem.lagrangian(weight, recompute, time_scale)
        solver.bind(problem.main_factors(recompute), problem.recompute_folds if recompute else problem.folds)
        seen_unary = [u + time_scale * o for u, o in zip(unary, self.offsets)]
        choice, floor = solver.solve(seen_unary)
        if not solver.exact:  # a plan backtracked through split tables: what one operator's move gains, taken
            choice = descend(seen_unary, problem.all_factors(recompute), choice)
        choices = problem.choices_at(choice, takes, recompute)
        seen = problem.objective(choice, choices) + sum(float(o[c]) for o, c in zip(self.offsets, choice))
        return _Point(choice, choices, seen, problem.memory(choice, choices), floor)

    def improved(self, point: _Point, weight: float, recompute: bool, capacity: float) -> _Point:
        """The plan a search that split its steps ends at, searched again with its hubs held
        (`condition_on_hubs`) at the memory weight it was found at: taken where it is faster and fits. Once a
        search, on the plan it ends at, not on each run of its memory walk (each costs a DP run or two)."""
        if self.solver.exact:
            return point
        problem = self.problem
        unary, takes = problem.lagrangian(weight, recompute)
        seen_unary = [u + o for u, o in zip(unary, self.offsets)]
        folded = (problem.main_factors(recompute), problem.recompute_folds if recompute else problem.folds)
        factors = problem.all_factors(recompute)
        choice = condition_on_hubs(seen_unary, factors, point.choice, self.solver.limits, folded)
        if choice == point.choice:
            return point
        choices = problem.choices_at(choice, takes, recompute)
        seen = problem.objective(choice, choices) + sum(float(o[c]) for o, c in zip(self.offsets, choice))
        memory = problem.memory(choice, choices)
        return _Point(choice, choices, seen, memory, point.floor) if seen < point.seen and memory <= capacity else point

    def leanest(self, recompute: bool) -> _Point:
        """The plan of least memory, the faster of equally lean ones: memory is a sum over operators,
        so each takes its leanest candidate (no DP run); the walk needs it only as a plan that fits."""
        problem = self.problem
        unary, takes = problem.lagrangian(1.0, recompute, 1e-9)
        choice = [int(np.argmin(u + 1e-9 * o)) for u, o in zip(unary, self.offsets)]
        choices = problem.choices_at(choice, takes, recompute)
        seen = problem.objective(choice, choices) + sum(float(o[c]) for o, c in zip(self.offsets, choice))
        return _Point(choice, choices, seen, problem.memory(choice, choices))


def _constrained_dp(
    problem: SearchProblem,
    solver: Solver,
    capacity: float,
    recompute: bool | None = None,
    beat: float = math.inf,
    hint: float = 0.0,
    runs: dict[tuple[float, bool, float], _Point] | None = None,
    tie: TieBreak | None = None,
) -> tuple[list[int], MemoryChoices, float, float | None, bool]:
    """The fastest plan that fits, by a walk along the Lagrangian's lower hull of (time, memory).

    Each DP run minimises time + lambda * memory, each operator taking the parallel optimizer
    where that is smaller. Given a plan that does not fit and one that does, the next lambda is
    where their two lines cross: the run there either finds a plan strictly below both (a new
    hull vertex, which replaces one end) or proves there is none, and the plan that fits is the
    hull's best. A handful of runs, where bisection takes forty. Only when the fastest plan does
    not fit are the memory choices searched: each walk is done without recomputation and, where
    the model has repeated blocks, with it, and the faster plan that fits wins. Last comes a bound
    no plan beats, memory aside (the fastest plan's time less the most the tie-break can add), or
    None where the fastest plan was not needed, and whether the fastest plan fits. A finite ``beat``
    ends the walk as soon as no plan that fits can beat it (`NothingFaster`). A ``hint`` weight is each
    walk's first run (`_walk`); without one, a weight pricing the excess memory at `_FIRST_SHARE` of the
    time. ``runs``: DP runs of this problem made before, by (weight, recompute, time scale), taken instead
    of running again (and filled); ``tie``: the tie-break (`dp.TieBreak`; None: the problem's own).
    """
    tie = tie or _tie_break(problem, SearchOptions())
    slack = tie.slack  # the most the tie-break adds to a plan's time
    beat_seen = beat + slack  # a plan faster than ``beat`` is seen below this
    dp = _Runs(problem, solver, tie.offsets(problem.node_time), runs if runs is not None else {})
    solve, leanest = dp.solve, dp.leanest

    kinds = recomputing(problem, recompute)
    first = kinds[0]
    fits_first = problem.memory_floor(first) <= capacity * (1 + 1e-12)
    fast = solve(0.0, first) if fits_first else None  # a plan that cannot fit needs no run to say so
    fastest = None if fast is None else (fast.seen if solver.exact else min(fast.seen, fast.floor)) - slack
    if fast is not None and fast.memory <= capacity:
        fast = dp.improved(fast, 0.0, first, capacity)
        return fast.choice, fast.choices, 0.0, fastest, True
    if fast is not None and fast.seen >= beat_seen and not math.isinf(beat):
        proved = beat if fastest is None else max(beat, fastest)  # (memory aside: so with it too)
        raise NothingFaster(f"no plan is faster than {beat:.6g} s", fastest, proved)
    best: tuple[_Point, float] | None = None
    best_kind = first  # whether the best plan recomputes
    leans: dict[bool, _Point] = {}
    for kind in kinds:
        bound = best[0].seen if best is not None else beat_seen
        again = sum(float(t.min()) for t in problem.recompute_time.values())
        if kind and not first and fast is not None and fast.seen + again >= bound:
            continue  # every recomputing plan pays at least the fastest forward of every block again
        if problem.memory_floor(kind) > capacity * (1 + 1e-12):
            continue  # not even each operator's leanest candidate fits: no run of the DP needed to see it
        start = fast if kind == first and fast is not None else solve(0.0, kind)
        if start.seen >= bound:
            continue  # no plan of this kind is faster than the one found (so none is needed for the message)
        lean = leans[kind] = leanest(kind)
        if lean.memory > capacity:
            continue
        excess = start.memory - capacity  # where the fastest plan fits, the walk ends at it whatever the weight
        first_weight = hint or (_FIRST_SHARE * start.seen / excess if excess > 0 else 0.0)
        walked = _walk(start, lean, capacity, functools.partial(solve, recompute=kind), bound, first_weight)
        if walked is not None and walked[0].seen < bound:
            best, best_kind = walked, kind
    if best is None and not math.isinf(beat):
        proved = max(beat, _lower_bound(problem, dp.made, recompute, capacity, slack))
        weight = _proving_weight(dp.made, capacity)
        raise NothingFaster(f"no plan that fits is faster than {beat:.6g} s", fastest, proved, weight)
    if best is None:  # nothing fits: the message describes the leanest plan of every kind
        least = min((leans.get(kind) or leanest(kind) for kind in kinds), key=lambda p: p.memory)
        solver.bind(problem.factors, problem.folds)
        message = _infeasible_message(problem, least.choice, capacity, "auto_parallel", least.choices)
        raise InfeasibleError(message)
    solver.bind(problem.factors, problem.folds)
    point = dp.improved(best[0], best[1], best_kind, capacity)
    return point.choice, point.choices, best[1], fastest, False


def _walk(
    low: _Point,
    high: _Point,
    capacity: float,
    solve: Callable[[float], _Point],
    bound: float = math.inf,
    hint: float = 0.0,
) -> tuple[_Point, float] | None:
    """The best plan that fits on the hull between a plan that may not fit and one that does.

    None once the Lagrangian bound (every plan that fits takes at least time + lambda x (memory -
    capacity) of the run at lambda) shows that nothing here beats ``bound``.

    A positive ``hint`` weight is run first. The run at any weight is a vertex of the hull optimal at
    that weight, so it replaces the end on its side of the capacity and the walk goes on between hull
    vertices as before: it ends at the same vertex (of plans tied on the edge where the hull crosses the
    capacity, the fastest one the runs saw that fits), in
    fewer runs when the hint is near the weight where the hull crosses the capacity (and its
    Lagrangian bound is then near its best, so a problem that cannot beat ``bound`` is told in one run).
    """
    if low.memory <= capacity:
        return low, 0.0
    low_weight, high_weight = 0.0, math.inf
    if 0.0 < hint < math.inf:
        trial = solve(hint)
        if trial.seen + hint * (trial.memory - capacity) >= bound:
            return None
        if trial.memory <= capacity:
            high, high_weight = trial, hint
        else:
            low, low_weight = trial, hint
    widened = 0
    for _ in range(_HULL_STEPS):
        if low.memory <= high.memory:
            break
        crossing = (high.seen - low.seen) / (low.memory - high.memory)
        weight = crossing
        if low_weight > 0.0 and math.isinf(high_weight) and widened < _WIDEN_RUNS:
            weight = min(weight, low_weight * _WIDEN ** (widened + 1))  # the leanest plan is no neighbour: widen
            widened += weight < crossing
        if not low_weight * (1 + 1e-12) < weight < high_weight:
            # the ends meet at the bracket's edge (a hinted run lands where the hull crosses the capacity):
            # the fitting end is optimal there, the weight an unhinted walk settles on
            high_weight = min(high_weight, max(weight, low_weight))
            break
        trial = solve(weight)
        if trial.seen + weight * (trial.memory - capacity) >= bound:
            return None
        at_high = high.seen + weight * high.memory
        if weight == crossing and trial.seen + weight * trial.memory >= at_high - 1e-12 * abs(at_high):
            high_weight = min(high_weight, weight)  # both ends are optimal at this weight
            if trial.memory <= capacity and trial.seen < high.seen:
                high = trial  # a plan on the segment between them that fits: faster than the end that fits
            break  # nothing below the segment: the plan that fits is the best on the hull
        if trial.memory <= capacity:
            high, high_weight = trial, weight
        else:
            low, low_weight = trial, weight
    return high, high_weight if math.isfinite(high_weight) else 0.0


def parameter_state_bytes(problem: SearchProblem) -> float:
    """The parameters' weights, gradients and optimizer state in all: at best split over every device,
    whatever the batch (so no micro-batching makes a plan fit when this over the devices does not)."""
    cost = problem.cost
    return sum(info.numel * cost.parameter_bytes_per_element(info.trainable) for info in problem.graph.parameters)


def _usable(problem: SearchProblem, capacity: float) -> str:
    """`` usable (32.00 GB less a 3.20 GB reserve)`` when the capacity is the cost model's, less its reserve."""
    cost = problem.cost
    if not cost.memory_reserve or capacity != cost.capacity:
        return ""
    return f" usable ({human_bytes(cost.device_capacity)} less a {human_bytes(cost.memory_reserve)} reserve)"


NOTHING_FITS = "Nothing fits in device memory"
"""How `InfeasibleError`'s sentence starts (`_infeasible_message`): the shape search says which shape it is of."""


def _infeasible_message(
    problem: SearchProblem,
    choice: list[int],
    capacity: float,
    mode: str,
    choices: MemoryChoices = NO_MEMORY_CHOICES,
) -> str:
    """Say that nothing fits, what dominates, and what would make it fit."""
    need = problem.memory(choice, choices)
    items = [item for i, c in enumerate(choice) for item in problem.memory_items(i, c, choices)]
    roles = ("parameter", "activation", "input")
    by_role = {role: sum(nbytes for _, r, nbytes in items if r == role) for role in roles}
    heavy = ", ".join(
        f"{name} ({human_bytes(nbytes)})" for name, _, nbytes in sorted(items, key=lambda item: (-item[2], item[0]))[:3]
    )
    what = "the leanest plan" if Mode(mode).searched else f"the {mode} plan"
    state = parameter_state_bytes(problem)
    floor = max(1, math.ceil(state / capacity))
    devices = 1 << (floor - 1).bit_length()
    if devices > MAX_DEVICES:
        advice = (
            f"the parameters' training state alone is {human_bytes(state)}, more than {MAX_DEVICES:,} such devices hold"
        )
    elif devices > problem.num_devices:
        advice = (
            f"the parameters' training state alone is {human_bytes(state)}, so at least {devices:,} devices are needed"
        )
    else:
        advice = (
            f"the parameters' training state alone ({human_bytes(state)}) would fit on {problem.num_devices:,}"
            f" device{'s' if problem.num_devices > 1 else ''},"
            " so it is the activations and inputs that do not fit: use a smaller batch or more devices"
        )
    gathered = _gathered_experts(problem, [name for name, _, _ in items])
    if gathered:
        advice += (
            f"; {gathered!r} is an expert stack gathered per routed row (Hugging Face's batched_mm experts):"
            " 'autopar route MODEL' writes such experts as GShard's dispatch, which a plan can split by expert"
        )
    return (
        f"{NOTHING_FITS}: {what} needs {human_bytes(need)} per device (parameters with gradients"
        f" and optimizer state {human_bytes(by_role['parameter'])}, {problem.cost.optimizer}; activations kept for"
        f" backward {human_bytes(by_role['activation'])}; inputs {human_bytes(by_role['input'])}) but the device has"
        f" {human_bytes(capacity)}{_usable(problem, capacity)}; the largest tensors are {heavy}; {advice}."
    )


def _gathered_experts(problem: SearchProblem, kept: Sequence[str]) -> str | None:
    """The first kept tensor a GatherND takes from a parameter of three or more axes (an expert stack), as it
    is or transposed (exporters write both)."""
    producers = {out: op for op in problem.graph.ops for out in op.outputs}
    parameters = {tensor.name for tensor in problem.graph.parameters}

    def through_transposes(name: str) -> str:
        while name in producers and producers[name].op_type == "Transpose":
            name = producers[name].inputs[0]
        return name

    for name in kept:
        op = producers.get(through_transposes(name))
        if op is None or op.op_type != "GatherND":
            continue
        stack = through_transposes(op.inputs[0])
        if stack in parameters and len(problem.graph.tensor(stack).shape) >= 3:
            return name
    return None
