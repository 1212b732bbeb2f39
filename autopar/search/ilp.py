"""Exact cross-check: the same search problem as an integer linear program, solved by HiGHS.

Alpa's formulation: a one-hot binary choice per operator, and per edge a continuous variable
per pair of *cost classes* (candidates whose edge-cost rows, or columns, are identical: in
practice, candidates that produce or need the same layout), tied to the choices by marginal
constraints. With integral choices the edge variables are forced to the product of the two
one-hot vectors, so the program is exact. Device memory is one linear budget row, so unlike
the DP's Lagrangian the ILP is exact under a binding memory limit too.

HiGHS (``highspy``) is an optional extra: ``pip install "autopar[ilp]"``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from autopar.errors import AutoparError, InfeasibleError
from autopar.search.memory import MemoryChoices
from autopar.search.problem import SearchProblem
from autopar.stdio import stdout_elsewhere

TIME_SCALE = 1e6  # solve in microseconds: keeps coefficients well inside HiGHS' tolerances


def _highs() -> Any:
    try:
        import highspy
    except ImportError:
        raise AutoparError("The ILP search needs the optional HiGHS solver: pip install 'autopar[ilp]'.") from None
    return highspy


def recomputing(problem: SearchProblem, recompute: bool | None, memory_binds: bool = True) -> tuple[bool, ...]:
    """The ways to try recomputation: as asked (``recompute``), else without it and, where the model has
    repeated blocks to recompute and memory may bind, with it. A model without repeated blocks has none.
    """
    if not problem.recompute_time:
        return (False,)
    if recompute is not None:
        return (recompute,)
    return (False, True) if memory_binds else (False,)


def _classes(matrix: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray]:
    """Distinct rows (axis 0) or columns (axis 1) of an edge matrix and each candidate's class."""
    unique, inverse = np.unique(matrix if axis == 0 else matrix.T, axis=0, return_inverse=True)
    return unique, inverse.reshape(-1)


def solve_ilp(
    problem: SearchProblem, capacity: float | None = None, time_limit: float = 600.0, recompute: bool | None = None
) -> tuple[list[int], MemoryChoices]:
    """Optimal candidate per operator (minimum step time, memory within ``capacity``) and memory choices.

    The parallel optimizer is a binary per operator and candidate that may be on only where the
    candidate is chosen; recomputation, one switch for the whole model, is solved both ways (only
    ``recompute``'s way when it is given).
    """
    best: tuple[float, list[int], MemoryChoices] | None = None
    for again in recomputing(problem, recompute, capacity is not None):
        try:
            choice, sharded = _solve(problem, capacity, again, time_limit)
        except InfeasibleError:
            continue
        choices = MemoryChoices(sharded, again)
        found = problem.objective(choice, choices)
        if best is None or found < best[0]:
            best = (found, choice, choices)
    if best is None:
        raise InfeasibleError("Nothing fits in device memory: the ILP finds no plan within the capacity.")
    return best[1], best[2]


@dataclass
class _Program:
    """The integer program as HiGHS takes it: variable costs, and constraint rows in compressed form."""

    costs: list[np.ndarray] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    indices: list[np.ndarray] = field(default_factory=list)
    values: list[np.ndarray] = field(default_factory=list)
    lower: list[float] = field(default_factory=list)
    upper: list[float] = field(default_factory=list)

    def add_row(self, index: list[int], value: list[float], lower: float, upper: float) -> None:
        self.starts.append(sum(len(i) for i in self.indices))
        self.indices.append(np.asarray(index, dtype=np.int32))
        self.values.append(np.asarray(value, dtype=np.float64))
        self.lower.append(lower)
        self.upper.append(upper)


def _solve(
    problem: SearchProblem, capacity: float | None, recompute: bool, time_limit: float
) -> tuple[list[int], frozenset[int]]:
    plain = MemoryChoices(recompute=recompute)
    node_time = [problem.node_arrays(i, plain)[0] for i in range(problem.size)]
    node_memory = [problem.node_arrays(i, plain)[1] for i in range(problem.size)]
    offsets = np.cumsum([0] + [len(t) for t in node_time])
    program = _Program([np.concatenate(node_time) * TIME_SCALE])
    for node in range(problem.size):  # one candidate per operator
        members = list(range(offsets[node], offsets[node + 1]))
        program.add_row(members, [1.0] * len(members), 1.0, 1.0)

    next_var = int(offsets[-1])
    sharded = MemoryChoices(frozenset(problem.sharded), recompute)
    switches: list[tuple[int, int, int]] = []  # (variable, node, candidate) of each parallel-optimizer switch
    extra_memory: list[float] = []
    for node in sorted(problem.sharded):
        time, memory = problem.node_arrays(node, sharded)
        for c in range(len(time)):
            if memory[c] < node_memory[node][c]:
                switches.append((next_var, node, c))
                program.costs.append(np.array([(time[c] - node_time[node][c]) * TIME_SCALE]))
                extra_memory.append(float(memory[c] - node_memory[node][c]))
                program.add_row([next_var, int(offsets[node]) + c], [1.0, -1.0], -np.inf, 0.0)  # only if chosen
                next_var += 1
    n_binary = next_var
    for (i, j), matrix in sorted(problem.edges_for(recompute).items()):
        if matrix.any():
            next_var = _add_edge(program, matrix, int(offsets[i]), int(offsets[j]), next_var)
    if capacity is not None:
        memory = np.concatenate([np.concatenate(node_memory), extra_memory]) / capacity  # in capacity units
        program.add_row(list(range(n_binary)), list(memory), -np.inf, 1.0)
    values = _run(program, n_binary, time_limit)
    choice = [int(np.argmax(values[offsets[n] : offsets[n + 1]])) for n in range(problem.size)]
    on = frozenset(node for variable, node, c in switches if values[variable] > 0.5 and choice[node] == c)
    return choice, on


def _add_edge(program: _Program, matrix: np.ndarray, first_i: int, first_j: int, next_var: int) -> int:
    """One edge's cost over classes of equal rows and columns, as continuous variables y[r, s] whose row and
    column sums are the chosen candidates' (the binaries from ``first_i`` and ``first_j``); the next free
    variable."""
    rows, row_of = _classes(matrix, 0)
    _, col_of = _classes(matrix, 1)
    n_rows, n_cols = len(rows), int(col_of.max()) + 1
    class_cost = np.zeros((n_rows, n_cols))
    class_cost[row_of[:, None], col_of[None, :]] = matrix
    base = next_var
    program.costs.append(class_cost.reshape(-1) * TIME_SCALE)
    for r in range(n_rows):  # sum_s y[r, s] = sum of x[i, c] over candidates c in row class r
        ys = [base + r * n_cols + s for s in range(n_cols)]
        xs = [first_i + int(c) for c in np.flatnonzero(row_of == r)]
        program.add_row(ys + xs, [1.0] * len(ys) + [-1.0] * len(xs), 0.0, 0.0)
    for s in range(n_cols):
        ys = [base + r * n_cols + s for r in range(n_rows)]
        xs = [first_j + int(c) for c in np.flatnonzero(col_of == s)]
        program.add_row(ys + xs, [1.0] * len(ys) + [-1.0] * len(xs), 0.0, 0.0)
    return base + n_rows * n_cols


def _run(program: _Program, n_binary: int, time_limit: float) -> np.ndarray:
    """The optimal values of the binaries, by HiGHS; one sentence where it finds none."""
    highspy = _highs()
    with stdout_elsewhere():  # HiGHS prints its banner on descriptor 1 when made, before any option is read
        highs = highspy.Highs()
        highs.setOptionValue("output_flag", False)
    highs.setOptionValue("mip_rel_gap", 1e-9)
    highs.setOptionValue("mip_abs_gap", 1e-12)
    highs.setOptionValue("time_limit", float(time_limit))
    highs.setOptionValue("random_seed", 0)
    highs.setOptionValue("primal_feasibility_tolerance", 1e-9)
    highs.setOptionValue("mip_feasibility_tolerance", 1e-9)
    cost = np.concatenate(program.costs)
    n_vars = len(cost)
    highs.addVars(n_vars, np.zeros(n_vars), np.concatenate([np.ones(n_binary), np.full(n_vars - n_binary, np.inf)]))
    highs.changeColsCost(n_vars, np.arange(n_vars, dtype=np.int32), cost)
    highs.changeColsIntegrality(
        n_binary, np.arange(n_binary, dtype=np.int32), np.full(n_binary, highspy.HighsVarType.kInteger, dtype=np.uint8)
    )
    index = np.concatenate(program.indices)
    highs.addRows(
        len(program.lower),
        np.asarray(program.lower),
        np.asarray(program.upper),
        len(index),
        np.asarray(program.starts, dtype=np.int32),
        index,
        np.concatenate(program.values),
    )
    with stdout_elsewhere():  # output_flag keeps the solve quiet; this keeps a future banner off stdout too
        highs.run()
    status = highs.getModelStatus()
    if status == highspy.HighsModelStatus.kInfeasible:
        raise InfeasibleError("Nothing fits in device memory: the ILP finds no plan within the capacity.")
    if status != highspy.HighsModelStatus.kOptimal:
        raise AutoparError(f"The ILP solver stopped without an optimal plan ({highs.modelStatusToString(status)}).")
    return np.asarray(highs.getSolution().col_value[:n_binary])
