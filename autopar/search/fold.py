"""Repeated blocks: found from the graph's structure, costed once, combined exactly.

Transformers repeat a layer tens of times and ResNets a bottleneck; the copies have the same
operators, attributes, shapes and wiring, hence the same cost tables. `find_repeats` finds
runs of structurally identical consecutive blocks from the operators alone (types,
attributes, shapes, dtypes, constant values and wiring relative to the operator, never node
names), where every block reads only from the previous block's last operator and only its
own last operator is read outside it.

For a run of L copies, one copy is eliminated down to a table F[p, q] over its input class p
(the previous block's last operator, seen through the layouts the copy reads) and its last
operator's candidate q. Its square form S[p, p'] (q reduced to the class the next copy reads)
is raised to the (L-1)-th min-plus power by repeated squaring, and G = S^(L-1) (x) F joins the
main graph as one factor between the operator before the run and the run's last operator.
After the main search, the argmin is unfolded: the class of every intermediate boundary from
the products' recorded midpoints, then each copy's interior by backtracking the one
elimination with its two boundaries fixed. The objective is the unfolded DP's, exactly (ties
between equally fast plans may resolve differently).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from autopar.graph import Graph
from autopar.search.dp import Elimination, Factor, Solved, joint_classes

if TYPE_CHECKING:
    from autopar.search.problem import SearchProblem

MIN_FOLDED_COPIES = 4  # below this, repeated squaring saves less than the boundary tables cost
MAX_PERIODS_TRIED = 12
_PRODUCT_CHUNK_CELLS = 1 << 22  # cells of the temporary in one block of a min-plus product


@dataclass(frozen=True)
class Repeat:
    """Operators ``start + k * period`` .. ``+ period - 1``, k in 0..copies-1, are copies of one block.

    Copy 0 reads operator ``start - 1`` (in the main graph, and structurally the same operator as
    every copy's last, so its candidates and layouts are theirs); copy k reads copy k-1's last.
    """

    start: int
    period: int
    copies: int

    def block(self, k: int) -> range:
        first = self.start + k * self.period
        return range(first, first + self.period)

    def last(self, k: int) -> int:
        """The operator whose output copy k+1 reads (k = -1: the one copy 0 reads)."""
        return self.start + (k + 1) * self.period - 1

    @property
    def folded(self) -> range:
        """Every operator of every copy: the search sees them only through the folded table."""
        return range(self.start, self.start + self.copies * self.period)


def signatures(
    graph: Graph,
    uses: Sequence,
    owner: dict,
    requires_grad: dict,
    kept: frozenset[str],
    outputs: set,
    pinned: dict | None = None,
) -> list[int]:
    """One small integer per operator: equal integers mean structurally identical operators.

    Everything a cost depends on is in the signature; where an input comes from is written
    relative to the operator (how many operators back, which slot), so copies match.
    """
    source: dict[tuple[int, int], tuple] = {}
    for use in uses:
        source[(use.dst_node, use.dst_slot)] = (use.dst_node - use.src_node, use.src_slot, use.src_is_output)
    ids: dict[tuple, int] = {}
    found = []
    for node, op in enumerate(graph.ops):
        inputs: list[tuple | None] = []
        for slot, name in enumerate(op.inputs):
            if not name:
                inputs.append(None)
                continue
            info = graph.tensor(name)
            where: object = source.get((node, slot))
            if where is None:
                where = "owned" if owner.get(name) == (node, slot) else "constant"
            value = info.value.tobytes() if info.kind == "constant" and info.value is not None else None
            inputs.append(
                (info.shape, info.dtype, info.kind, info.trainable, requires_grad.get(name, False), where, value)
            )
        outputs_ = tuple(
            (graph.tensor(n).shape, graph.tensor(n).dtype, requires_grad.get(n, False), n in kept, n in outputs)
            if n
            else None
            for n in op.outputs
        )
        attributes = tuple(sorted((k, _exact(v)) for k, v in op.attrs.items()))
        key = (op.op_type, op.domain, attributes, op.flops, tuple(inputs), outputs_, (pinned or {}).get(node))
        found.append(ids.setdefault(key, len(ids)))
    return found


def _exact(value: object) -> object:
    """A hashable stand-in equal only for equal values (array reprs elide their middle)."""
    if isinstance(value, np.ndarray):
        return (value.dtype.str, value.shape, value.tobytes())
    if isinstance(value, (list, tuple)):
        return tuple(_exact(v) for v in value)
    return repr(value)


def find_repeats(size: int, uses: Sequence, signature: Sequence[int]) -> list[Repeat]:
    """Non-overlapping runs of identical consecutive blocks that can be folded, in graph order.

    Candidate periods are the distances between repeated signatures, most frequent (weighted by
    length) first; where runs overlap, the one folding the most operators wins.
    """
    seq = np.asarray(signature, dtype=np.int64)
    if size < 3:
        return []
    reads: list[list[int]] = [[] for _ in range(size)]  # producers each operator reads
    readers: list[list[int]] = [[] for _ in range(size)]
    for use in uses:
        if use.src_node != use.dst_node:
            reads[use.dst_node].append(use.src_node)
            readers[use.src_node].append(use.dst_node)
    last_seen: dict[int, int] = {}
    distances: dict[int, int] = {}
    for i, s in enumerate(seq.tolist()):
        if s in last_seen:
            d = i - last_seen[s]
            distances[d] = distances.get(d, 0) + 1
        last_seen[s] = i
    periods = sorted(distances, key=lambda d: (-distances[d] * d, d))[:MAX_PERIODS_TRIED]
    candidates: list[Repeat] = []
    for period in periods:
        if MIN_FOLDED_COPIES * period + 1 > size:
            continue  # no room for the copies and the operator before them
        same = seq[:-period] == seq[period:]
        i = 0
        while i < len(same):
            if not same[i]:
                i += 1
                continue
            j = i
            while j < len(same) and same[j]:
                j += 1
            # operators i .. j + period - 1 repeat with this period
            for offset in range(2 * period):  # the first copy may need the run's second block as its input
                start = max(i + offset, 1)
                copies = (j + period - start) // period
                if copies < MIN_FOLDED_COPIES:
                    break
                if seq[start - 1] != seq[start + period - 1]:
                    continue  # the operator before the run must be a copy of each copy's last (same candidates)
                repeat = _valid_prefix(Repeat(start, period, copies), reads, readers)
                if repeat is not None:
                    candidates.append(repeat)
                    break
            i = j
    chosen: list[Repeat] = []
    taken = np.zeros(size, dtype=bool)
    for repeat in sorted(candidates, key=lambda r: (-(r.copies - 1) * r.period, r.start, r.period)):
        span = slice(repeat.start, repeat.start + repeat.copies * repeat.period)
        if not taken[span].any():
            taken[span] = True
            chosen.append(repeat)
    return sorted(chosen, key=lambda r: r.start)


def _valid_prefix(repeat: Repeat, reads: list[list[int]], readers: list[list[int]]) -> Repeat | None:
    """The longest prefix of the run whose copies have a clean boundary, or None."""
    copies = 0
    for k in range(repeat.copies):
        block = repeat.block(k)
        q_prev, q = repeat.last(k - 1), repeat.last(k)
        clean = all(src in block or src == q_prev for node in block for src in reads[node])
        clean = clean and all(dst in block for node in block if node != q for dst in readers[node])
        if not clean:
            break
        copies = k + 1
    # every copy's last operator but the run's last is read only by the next copy
    while copies >= MIN_FOLDED_COPIES:
        if all(dst in repeat.block(k + 1) for k in range(copies - 1) for dst in readers[repeat.last(k)]):
            return Repeat(repeat.start, repeat.period, copies)
        copies -= 1
    return None


# --- solving a folded run -----------------------------------------------------------------


@dataclass
class _Product:
    """A min-plus product tree: a leaf is one S; a node records the argmin midpoint of each entry."""

    length: int
    left: "_Product | None" = None
    right: "_Product | None" = None
    middle: np.ndarray | None = None


def min_plus(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(C, argmin) with C[i, j] = min_k a[i, k] + b[k, j], in blocks of rows to bound memory.

    >>> c, k = min_plus(np.array([[0.0, 1.0]]), np.array([[5.0], [1.0]]))
    >>> float(c[0, 0]), int(k[0, 0])
    (2.0, 1)
    """
    rows = max(1, _PRODUCT_CHUNK_CELLS // max(1, a.shape[1] * b.shape[1]))
    out = np.empty((a.shape[0], b.shape[1]))
    arg = np.empty((a.shape[0], b.shape[1]), dtype=np.int64)
    for start in range(0, a.shape[0], rows):
        block = a[start : start + rows, :, None] + b[None, :, :]
        arg[start : start + rows] = np.argmin(block, axis=1)
        out[start : start + rows] = np.min(block, axis=1)
    return out, arg


def _power(square: np.ndarray, exponent: int) -> tuple[np.ndarray | None, _Product | None]:
    """S^exponent in the min-plus semiring by repeated squaring, with the tree to unfold it."""
    result: tuple[np.ndarray, _Product] | None = None
    base: tuple[np.ndarray, _Product] = (square, _Product(1))
    while exponent:
        if exponent & 1:
            if result is None:
                result = base
            else:
                table, middle = min_plus(result[0], base[0])
                result = (table, _Product(result[1].length + base[1].length, result[1], base[1], middle))
        exponent >>= 1
        if exponent:
            table, middle = min_plus(base[0], base[0])
            base = (table, _Product(2 * base[1].length, base[1], base[1], middle))
    return (None, None) if result is None else result


def _unfold(tree: _Product, a: int, b: int) -> list[int]:
    """The classes between boundary a and boundary b along a product tree (length - 1 of them)."""
    if tree.length == 1:
        return []
    assert tree.left is not None and tree.right is not None and tree.middle is not None
    mid = int(tree.middle[a, b])
    return _unfold(tree.left, a, mid) + [mid] + _unfold(tree.right, mid, b)


class FoldedRun:
    """A folded run: its representative copy's elimination and how the main graph sees it."""

    def __init__(self, repeat: Repeat, factors: list[Factor], sizes: Sequence[int]) -> None:
        self.repeat = repeat
        self.factors = factors  # the representative copy's edges (copy 0, reading operator start - 1)
        block = set(repeat.block(0))
        self.p, self.q = repeat.last(-1), repeat.last(0)
        keep = [u for u in range(len(sizes)) if u not in block or u == self.q]
        self.elimination = Elimination(sizes, factors, keep)
        maps = [m[s.index(self.p)] for s, m in self.elimination.leftover_structure() if self.p in s]
        if maps:
            self.boundary, _ = joint_classes(maps, [int(m.max()) + 1 for m in maps])
        else:
            self.boundary = np.zeros(sizes[self.p], dtype=np.int64)
        self.classes = int(self.boundary.max()) + 1
        self._members = np.argsort(self.boundary, kind="stable")
        self._starts = np.searchsorted(self.boundary[self._members], np.arange(self.classes))
        self._first = np.zeros(self.classes, dtype=np.int64)
        self._first[self.boundary[::-1]] = np.arange(len(self.boundary) - 1, -1, -1)

    @property
    def last(self) -> int:
        return self.repeat.last(self.repeat.copies - 1)

    def placeholder(self, q_candidates: int) -> Factor:
        """The main graph's factor between the operator before the run and its last one (table set per solve)."""
        maps = (self.boundary, np.arange(q_candidates, dtype=np.int64))
        return Factor((self.p, self.last), maps, np.zeros((self.classes, q_candidates)))

    def solve(self, unary: Sequence[np.ndarray]) -> "SolvedRun":
        """G[class of the operator before the run, candidate of the run's last] for these unary costs."""
        p, q = self.p, self.q
        solved = self.elimination.run(unary)
        first = self._first
        table = np.zeros((self.classes, 1)) + np.asarray(unary[q], dtype=float)[None, :]
        for factor in solved.leftover:
            if factor.scope == (p, q):
                part = factor.table[np.ix_(factor.maps[0][first], factor.maps[1])]
            elif factor.scope == (p,):
                part = factor.table[factor.maps[0][first]][:, None]
            else:
                part = factor.table[factor.maps[0]][None, :]
            table = table + part
        # S[a, b]: q reduced to the class the next copy reads, and which q candidate achieves it
        ordered = table[:, self._members]
        square = np.minimum.reduceat(ordered, self._starts, axis=1)
        counts = np.diff(np.append(self._starts, len(self._members)))
        is_best = ordered == np.repeat(square, counts, axis=1)
        positions = np.where(is_best, np.arange(len(self._members))[None, :], len(self._members))
        best_q = self._members[np.minimum.reduceat(positions, self._starts, axis=1)]
        power, tree = _power(square, self.repeat.copies - 1)
        if power is None:
            return SolvedRun(self, solved, table, None, None, best_q)
        joined, middle = min_plus(power, table)
        return SolvedRun(self, solved, joined, tree, middle, best_q)


@dataclass
class SolvedRun:
    """One folded run solved for one set of unary costs."""

    run: FoldedRun
    solved: Solved
    joined: np.ndarray  # G
    tree: _Product | None
    middle: np.ndarray | None
    best_q: np.ndarray

    def unfold(self, choice: list[int]) -> None:
        """Fill in every copy of ``choice`` given the operator before the run and the run's last one."""
        run = self.run
        repeat = run.repeat
        start = int(run.boundary[choice[run.p]])
        end_candidate = choice[run.last]
        if self.tree is None or self.middle is None:
            classes = [start]
        else:
            before_last = int(self.middle[start, end_candidate])
            classes = [start] + _unfold(self.tree, start, before_last) + [before_last]
        # boundaries: the one before the run is given; copy k's last from the classes; the run's last is given
        q_choice = [choice[run.p]]
        for k in range(1, repeat.copies):
            q_choice.append(int(self.best_q[classes[k - 1], classes[k]]))
        q_choice.append(end_candidate)
        for k in range(repeat.copies):
            inner = self.solved.assign({run.p: q_choice[k], run.q: q_choice[k + 1]})
            for node in repeat.block(0):
                choice[node + k * repeat.period] = inner[node]


class Solver:
    """The exact search of one problem: the main graph's elimination plus one per folded run."""

    def __init__(
        self,
        problem: "SearchProblem | None" = None,
        *,
        sizes: Sequence[int] = (),
        factors: Sequence[Factor] = (),
        folds: Sequence[tuple[Repeat, list[Factor]]] = (),
    ) -> None:
        """The solver of ``problem``, or of bare ``sizes``, ``factors`` and ``folds`` (whose tables
        may be placeholders of the right shape: planning reads shapes only)."""
        if problem is not None:
            sizes, factors, folds = [len(t) for t in problem.node_time], problem.factors, problem.folds
        self.sizes = list(sizes)
        self.runs = [FoldedRun(repeat, run_factors, self.sizes) for repeat, run_factors in folds]
        placeholders = [run.placeholder(self.sizes[run.last]) for run in self.runs]
        self.first_placeholder = len(factors)
        folded = {u for run in self.runs for u in run.repeat.folded if u != run.last}
        self.main = Elimination(self.sizes, list(factors) + placeholders, sorted(folded))
        self.largest = max([self.main.largest] + [run.elimination.largest for run in self.runs])

    def bind(self, factors: Sequence[Factor], folds: Sequence[tuple[Repeat, list[Factor]]]) -> None:
        """Swap the placeholder tables this solver was planned on for the costed ones."""
        self.main.bind(factors)
        for run, (_, run_factors) in zip(self.runs, folds):
            run.elimination.bind(run_factors)
            run.factors = run_factors

    @classmethod
    def of(cls, problem: "SearchProblem") -> "Solver":
        """The solver `build_problem` planned before costing, or a new one for a problem built by hand."""
        return problem.solver if problem.solver is not None else cls(problem)

    def states(self) -> tuple[int, int]:
        """(candidates kept as states, candidates dropped as exactly dominated), over every operator.

        A node's candidates that show the same layouts to every table it touches collapse into one
        state: only the cheapest of them can be chosen.
        """
        kept, dropped = self.main.states()
        for run in self.runs:
            block_kept, block_dropped = run.elimination.states()
            boundary = len(run.boundary) - run.classes  # copy k's last operator, reduced to the classes read
            kept += run.repeat.copies * block_kept + (run.repeat.copies - 1) * run.classes
            dropped += run.repeat.copies * block_dropped + (run.repeat.copies - 1) * boundary
        return kept, dropped

    def minimise(self, unary: Sequence[np.ndarray]) -> list[int]:
        """Exact argmin of node costs ``unary`` plus every edge cost."""
        solved = [run.solve(unary) for run in self.runs]
        tables = {self.first_placeholder + i: s.joined for i, s in enumerate(solved)}
        main_unary = list(unary)
        for run in self.runs:
            main_unary[run.last] = np.zeros(self.sizes[run.last])  # its cost is inside G
        choice = self.main.run(main_unary, tables).backtrack()
        for s in solved:
            s.unfold(choice)
        return choice


def minimise(problem: "SearchProblem", unary: Sequence[np.ndarray]) -> list[int]:
    """Exact argmin of the problem's objective with these unary costs (repeated blocks folded)."""
    return Solver.of(problem).minimise(unary)
