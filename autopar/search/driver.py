"""Run a search mode on a problem, with device memory as a constraint.

Memory enters through a Lagrangian weight: if the fastest plan does not fit, the DP is rerun
with ``time + lambda * memory``, walking the lower hull of (time, memory) to the best plan on
it that fits. That is exact whenever the fastest plan fits (the usual case) and a good feasible
plan otherwise (the ILP is exact either way); when even the leanest plan does not fit, the
error names the largest tensors.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from autopar.errors import InfeasibleError
from autopar.limits import MAX_DEVICES
from autopar.search.dp import tie_break_unary
from autopar.search.fold import Solver
from autopar.search.problem import SearchProblem, memory_items
from autopar.units import human_bytes

MODES = ("auto_parallel", "data_parallel", "stand_alone")
ALGORITHMS = ("dp", "ilp")
_HULL_STEPS = 64  # hull vertices visited at most (a few in practice)


@dataclass(frozen=True)
class SearchResult:
    """A candidate index per operator, and how it was found.

    ``method`` is the solver (``dp``, ``ilp``) or the fixed mode (``data_parallel``,
    ``stand_alone``), or ``given`` for strategies a user supplied; ``lagrange_multiplier`` is
    the memory weight the constrained DP settled on (0 when the fastest plan fits).
    """

    choice: tuple[int, ...]
    method: str
    time_s: float
    lagrange_multiplier: float = 0.0
    candidates_kept: int | None = None
    candidates_dropped: int | None = None


def data_parallel_choice(problem: SearchProblem) -> list[int]:
    """Every candidate list starts with the data-parallel strategy."""
    return [0] * problem.size


def stand_alone_choice(problem: SearchProblem) -> list[int]:
    return [rule.candidates.index(rule.stand_alone) for rule in problem.rules]


def run_search(problem: SearchProblem, mode: str = "auto_parallel", algorithm: str = "dp") -> SearchResult:
    start = time.perf_counter()
    capacity = problem.cost.capacity
    multiplier = 0.0
    states: tuple[int | None, int | None] = (None, None)
    if mode == "data_parallel":
        choice, used = data_parallel_choice(problem), "data_parallel"
    elif mode == "stand_alone":
        choice, used = stand_alone_choice(problem), "stand_alone"
    elif algorithm == "ilp":
        from autopar.search.ilp import solve_ilp

        choice, used = solve_ilp(problem, capacity), "ilp"
    else:
        solver = Solver.of(problem)
        choice, multiplier = _constrained_dp(problem, solver, capacity)
        used, states = algorithm, solver.states()
    memory = problem.memory(choice)
    if memory > capacity:
        raise InfeasibleError(_infeasible_message(problem, choice, capacity, mode))
    return SearchResult(tuple(choice), used, time.perf_counter() - start, multiplier, *states)


def _constrained_dp(problem: SearchProblem, solver: Solver, capacity: float) -> tuple[list[int], float]:
    """The fastest plan that fits, by a walk along the Lagrangian's lower hull of (time, memory).

    Each DP run minimises time + lambda * memory. Given a plan that does not fit and one that
    does, the next lambda is where their two lines cross: the run there either finds a plan
    strictly below both (a new hull vertex, which replaces one end) or proves there is none,
    and the plan that fits is the hull's best. A handful of runs, where bisection takes forty.
    """
    base = problem.objective(data_parallel_choice(problem))
    unary = tie_break_unary(problem, base)

    def point(choice: list[int]) -> tuple[list[int], float, float]:
        """(plan, time as the DP sees it (with the tie-break), memory)."""
        seen = problem.objective(choice) + sum(float(u[c] - t[c]) for u, t, c in zip(unary, problem.node_time, choice))
        return choice, seen, problem.memory(choice)

    fast = point(solver.minimise(unary))
    if fast[2] <= capacity:
        return fast[0], 0.0
    leanest = solver.minimise([m + 1e-9 * t for m, t in zip(problem.node_memory, problem.node_time)])
    if problem.memory(leanest) > capacity:
        raise InfeasibleError(_infeasible_message(problem, leanest, capacity, "auto_parallel"))
    # the hull's two ends: the fastest plan (weight 0) and the leanest (an unbounded weight)
    low, low_weight = fast, 0.0
    high, high_weight = point(leanest), math.inf
    for _ in range(_HULL_STEPS):
        if low[2] <= high[2]:
            break
        weight = (high[1] - low[1]) / (low[2] - high[2])
        if not low_weight < weight < high_weight:
            break
        trial = point(solver.minimise([u + weight * m for u, m in zip(unary, problem.node_memory)]))
        at_high = high[1] + weight * high[2]
        if trial[1] + weight * trial[2] >= at_high - 1e-12 * abs(at_high):
            high_weight = min(high_weight, weight)  # both ends are optimal at this weight
            break  # nothing below the segment: the plan that fits is the best on the hull
        if trial[2] <= capacity:
            high, high_weight = trial, weight
        else:
            low, low_weight = trial, weight
    return high[0], high_weight if math.isfinite(high_weight) else 0.0


def _infeasible_message(problem: SearchProblem, choice: list[int], capacity: float, mode: str) -> str:
    """Say that nothing fits, what dominates, and what would make it fit."""
    need = problem.memory(choice)
    items = [item for i, c in enumerate(choice) for item in memory_items(problem, i, c)]
    roles = ("parameter", "activation", "input")
    by_role = {role: sum(nbytes for _, r, nbytes in items if r == role) for role in roles}
    heavy = ", ".join(
        f"{name} ({human_bytes(nbytes)})" for name, _, nbytes in sorted(items, key=lambda item: (-item[2], item[0]))[:3]
    )
    what = "the leanest plan" if mode == "auto_parallel" else f"the {mode} plan"
    cost = problem.cost
    state = sum(info.numel * cost.parameter_bytes_per_element(info.trainable) for info in problem.graph.parameters)
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
            f"the parameters' training state alone ({human_bytes(state)}) would fit on {problem.num_devices:,} devices,"
            " so it is the activations and inputs that do not fit: use a smaller batch or more devices"
        )
    return (
        f"Nothing fits in device memory: {what} needs {human_bytes(need)} per device but the device has"
        f" {human_bytes(capacity)} (parameters with gradients and optimizer state {human_bytes(by_role['parameter'])},"
        f" activations kept for backward {human_bytes(by_role['activation'])}, inputs {human_bytes(by_role['input'])});"
        f" the largest tensors are {heavy}; {advice}."
    )
