"""Repeated blocks, costed once and combined exactly.

`autopar.search.repeats` finds runs of structurally identical consecutive blocks; this module
solves them.

For a run of L copies, one copy is eliminated down to a table F[p, q] over its input class p
(the layouts the copy reads) and its last operator's candidate q. Copy 0 reads the operator
before the run and every later copy the previous copy's last, which need not be the same kind of
operator (an embedding's output feeds the first layer, a residual sum every other): the copy is
eliminated once with the tensor it reads in every layout either of them gives (`RunEdges`), so
F has a row for each. Its square form S[p, p'] (q reduced to the class the next copy reads)
is raised to the (L-1)-th min-plus power by repeated squaring, and G = S^(L-1) (x) F joins the
main graph as one factor between the operator before the run and the run's last operator; where
that operator's own costs differ from copy 0's last's, which F holds (a pipeline stage's last
operator sends its output on), the main graph pays the difference.
After the main search, the argmin is unfolded: the class of every intermediate boundary from
the products' recorded midpoints, then each copy's interior by backtracking the one
elimination with its two boundaries fixed. The objective is the unfolded DP's, exactly (ties
between equally fast plans may resolve differently).
"""

from __future__ import annotations

import collections
import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from autopar.errors import SearchTooLargeError
from autopar.search import native
from autopar.search.dp import TABLE_LIMITS, Elimination, Factor, Solved, TableLimits, joint_classes, over_rows
from autopar.search.repeats import Repeat

_PRODUCT_CHUNK_CELLS = 1 << 22  # cells of the temporary in one block of a min-plus product


# --- solving a folded run -----------------------------------------------------------------


@dataclass(frozen=True)
class RunEdges:
    """A folded run's edges, costed once: copy 0's (``first``), whose edges from the operator
    before the run index its candidates, and the same edges as every later copy sees them
    (``later``), indexing the previous copy's last operator's candidates instead. Both are written
    in copy 0's scopes and share their tables, which cover the layouts either operator gives."""

    first: tuple[Factor, ...]
    later: tuple[Factor, ...]

    @classmethod
    def same(cls, factors: Sequence[Factor]) -> "RunEdges":
        """Edges of a run whose copies all read the same kind of operator."""
        return cls(tuple(factors), tuple(factors))

    def with_tables(self, tables: Sequence[np.ndarray]) -> "RunEdges":
        """The same edges with other tables of the same shapes (one per edge, in order)."""
        return RunEdges(
            tuple(Factor(f.scope, f.maps, t) for f, t in zip(self.first, tables)),
            tuple(Factor(f.scope, f.maps, t) for f, t in zip(self.later, tables)),
        )


@dataclass
class _Product:
    """A min-plus product tree: a leaf is one S; a node records the argmin midpoint of each entry."""

    length: int
    left: "_Product | None" = None
    right: "_Product | None" = None
    middle: np.ndarray | None = None


def min_plus(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(C, argmin) with C[i, j] = min_k a[i, k] + b[k, j], in blocks of rows to bound memory (a large
    product's rows split between threads, each summing one block at a time).

    >>> c, k = min_plus(np.array([[0.0, 1.0]]), np.array([[5.0], [1.0]]))
    >>> float(c[0, 0]), int(k[0, 0])
    (2.0, 1)
    """
    rows = max(1, _PRODUCT_CHUNK_CELLS // max(1, a.shape[1] * b.shape[1]))
    out = np.empty((a.shape[0], b.shape[1]))
    arg = np.empty((a.shape[0], b.shape[1]), dtype=np.int64)
    cells = a.shape[0] * a.shape[1] * b.shape[1]
    if native.worth(cells, native.ENTRIES):  # compiled: the same sums and argmins
        kernel, rows_of_a, b_rows = native.kernels().min_plus_argmin, np.ascontiguousarray(a), np.ascontiguousarray(b)
        over_rows(lambda first, last: kernel(rows_of_a, b_rows, out, arg, first, last), a.shape[0], cells)
        return out, arg
    columns = np.ascontiguousarray(b.T)  # the summed index last: one contiguous pass finds the argmin

    def blocks(first: int, last: int) -> None:
        for start in range(first, last, rows):
            stop = min(last, start + rows)
            block = a[start:stop, None, :] + columns[None, :, :]
            best = np.argmin(block, axis=2)
            arg[start:stop] = best
            out[start:stop] = np.take_along_axis(block, best[..., None], axis=2)[..., 0]

    over_rows(blocks, a.shape[0], a.shape[0] * a.shape[1] * b.shape[1])  # as a large elimination step's
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


class CopyRuns:
    """Runs of copy eliminations kept for the copies of other problems (`FoldedRun.solve`), the newest
    ``kept``: the stages of a pipeline shape are cut from one problem and share its copies' tables, and where
    their walks meet at one memory weight (none, or the hint, as each starts) their copies' costs, however
    many copies each stage has. A run is taken again for the same plan, the same costs it reads and the same
    tables, held with it so that their identities stay theirs. The 175B GPT on 1,024 devices: its stages'
    searches take 85 s where 124."""

    def __init__(self, kept: int = 8) -> None:
        self.kept = kept
        self._runs: collections.OrderedDict[tuple, tuple[tuple[np.ndarray, ...], Solved]] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._runs)

    def run(self, elimination: Elimination, unary: Sequence[np.ndarray], read: Sequence[int]) -> Solved:
        """``elimination`` run on ``unary`` (of which it reads the costs of ``read``), or its run kept."""
        tables = tuple(factor.table for factor in elimination.initial)
        digest = hashlib.blake2b(digest_size=32)
        for node in read:
            digest.update(np.ascontiguousarray(unary[node], dtype=float).tobytes())
        key = (elimination.structure, digest.digest(), tuple(id(table) for table in tables))
        found = self._runs.get(key)
        if found is not None and all(a is b for a, b in zip(found[0], tables)):
            self._runs.move_to_end(key)
            return found[1]
        solved = elimination.run(unary)
        self._runs[key] = (tables, solved)
        while len(self._runs) > self.kept:
            self._runs.popitem(last=False)
        return solved


class FoldedRun:
    """A folded run: its representative copy's elimination and how the main graph sees it.

    The representative copy is eliminated down to factors over the tensor it reads (through a
    virtual operator, ``entry``, whose candidates are those of the operator before the run and then
    those of a copy's last, so one elimination serves copy 0 and every later copy), its own last
    operator (q) and the shared operators every copy reads (x). With the shared operators'
    classes fixed, the copies form a chain, so the run is one min-plus power per joint class of
    the shared operators: exact, and as cheap as before when nothing is shared.
    """

    def __init__(
        self,
        repeat: Repeat,
        edges: RunEdges,
        sizes: Sequence[int],
        ties: Mapping[int, int] | None = None,
        limits: TableLimits = TABLE_LIMITS,
        relaxed: bool = False,
    ) -> None:
        """``relaxed``: every copy takes the shared operators' layouts as its own (`Solver`), so that the
        copies form one chain whatever the shared operators' candidates."""
        self.repeat = repeat
        self.edges = edges
        block = set(repeat.block(0))
        self.p, self.q = repeat.last(-1), repeat.last(0)
        self.p_candidates = sizes[self.p]
        # the copy's elimination numbers its own operators (and the shared ones its edges read) in the order
        # of the problem's, the entry last: a copy cut anywhere (a pipeline stage's) is the same elimination
        read = {u for f in edges.first for u in f.scope} - {self.p}
        self._nodes = tuple(sorted(block | read))
        self._own = {node: index for index, node in enumerate(self._nodes)}
        self.entry = len(self._nodes)
        own_sizes = [*(sizes[u] for u in self._nodes), sizes[self.p] + sizes[self.q]]
        factors = [self._entry_factor(first, later) for first, later in zip(edges.first, edges.later)]
        # relaxed, the shared operators a copy reads are eliminated with the copy, at no cost of their own
        # (theirs is the main graph's): each copy then reads them in the layout it likes best
        self.relaxed = tuple(sorted(read - block)) if relaxed else ()
        outside = {self._own[u] for u in read - block} - {self._own[u] for u in self.relaxed}
        keep = sorted(outside | {self._own[self.q], self.entry})
        own_ties = {self._own[a]: self._own[b] for a, b in (ties or {}).items() if a in self._own and b in self._own}
        self.elimination = Elimination(own_sizes, factors, keep, own_ties, limits)
        kept = set(keep)
        self._read = tuple(u for u in range(len(self._nodes)) if u not in kept)  # the costs a run reads
        structure = self.elimination.leftover_structure()
        entry, self._first = self._classes(self.entry, structure, own_sizes)
        self.classes = int(entry.max()) + 1
        self.boundary = entry[: self.p_candidates]  # class per candidate of the operator before the run
        self.follows = entry[self.p_candidates :]  # class per candidate of a copy's last: what the next copy reads
        self._members = np.argsort(self.follows, kind="stable")
        self._starts = np.searchsorted(self.follows[self._members], np.arange(self.classes))
        left = {u for scope, _ in structure for u in scope} - {self.entry, self._own[self.q]}
        self.shared = tuple(self._nodes[u] for u in sorted(left))
        shared = [self._classes(self._own[x], structure, own_sizes) for x in self.shared]
        self.shared_maps = tuple(m for m, _ in shared)
        self._shared_first = tuple(first for _, first in shared)
        self.shared_counts = tuple(int(m.max()) + 1 for m in self.shared_maps)

    def _entry_factor(self, first: Factor, later: Factor) -> Factor:
        """An edge of the representative copy in the copy's own numbering, the operator before the run replaced
        by the entry."""
        maps = list(first.maps)
        if self.p in first.scope:
            at = first.scope.index(self.p)
            maps[at] = np.concatenate([first.maps[at], later.maps[at]])
        scope = tuple(self.entry if u == self.p else self._own[u] for u in first.scope)
        return Factor(scope, tuple(maps), first.table)

    @property
    def relaxed_own(self) -> tuple[int, ...]:
        """The shared operators the copy's elimination eliminates (relaxed), in its own numbering."""
        return tuple(self._own[u] for u in self.relaxed)

    @staticmethod
    def _classes(node: int, structure: list, sizes: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """(class per candidate, first candidate per class) of one kept operator, as the leftover factors see it."""
        maps = [m[s.index(node)] for s, m in structure if node in s]
        if maps:
            classes, _ = joint_classes(maps, [int(m.max()) + 1 for m in maps])
        else:
            classes = np.zeros(sizes[node], dtype=np.int64)
        first = np.zeros(int(classes.max()) + 1, dtype=np.int64)
        first[classes[::-1]] = np.arange(len(classes) - 1, -1, -1)
        return classes, first

    @property
    def last(self) -> int:
        return self.repeat.last(self.repeat.copies - 1)

    @property
    def table_entries(self) -> int:
        """Entries of the run's table in the main graph (`placeholder`): over the classes the first copy reads,
        the candidates of the run's last operator and the classes of the shared operators."""
        return self.classes * len(self.follows) * math.prod(self.shared_counts)

    def placeholder(self, q_candidates: int) -> Factor:
        """The main graph's factor over the operator before the run, its last one and the shared ones
        (table set per solve)."""
        maps = (self.boundary, np.arange(q_candidates, dtype=np.int64), *self.shared_maps)
        table = np.zeros((self.classes, q_candidates, *self.shared_counts))
        return Factor((self.p, self.last, *self.shared), maps, table)

    def _boundary_table(self, solved: Solved, unary: np.ndarray) -> np.ndarray:
        """F[shared classes..., class of p, candidate of q]: one copy's cost with its boundaries fixed."""
        p, q = self.entry, self._own[self.q]
        shared = [self._own[x] for x in self.shared]
        axes = {x: i for i, x in enumerate(shared)} | {p: len(shared), q: len(shared) + 1}
        firsts = dict(zip(shared, self._shared_first)) | {p: self._first}
        shape = (*self.shared_counts, self.classes, len(unary))
        table = np.zeros(shape) + np.asarray(unary, dtype=float)
        for factor in solved.leftover:
            index = [m if u == q else m[firsts[u]] for u, m in zip(factor.scope, factor.maps)]
            part = factor.table[np.ix_(*index)]
            order = np.argsort([axes[u] for u in factor.scope])
            part = part.transpose(order)
            present = sorted(axes[u] for u in factor.scope)
            table = table + part.reshape([shape[a] if a in present else 1 for a in range(len(shape))])
        return table

    def solve(self, unary: Sequence[np.ndarray], copies: CopyRuns | None = None) -> "SolvedRun":
        """G[class of the operator before the run, candidate of the run's last, shared classes...]; ``copies``:
        the copy eliminations other problems ran, taken where this one's is among them (and kept)."""
        if self.relaxed:
            unary = list(unary)
            for x in self.relaxed:
                unary[x] = np.zeros(len(unary[x]))
        own = [unary[u] for u in self._nodes]  # (the entry is kept: no costs of its own)
        solved = copies.run(self.elimination, own, self._read) if copies is not None else self.elimination.run(own)
        tables = self._boundary_table(solved, unary[self.q])
        chains: dict[tuple[int, ...], _Chain] = {}
        joined = np.empty(tables.shape)
        for shared in np.ndindex(*self.shared_counts):
            chain = _Chain.of(tables[shared], self._members, self._starts, self.repeat.copies - 1)
            chains[shared] = chain
            joined[shared] = chain.joined
        joined = np.moveaxis(joined, (-2, -1), (0, 1)) if self.shared else joined
        return SolvedRun(self, solved, np.ascontiguousarray(joined), chains)

    def assign(self, solved: Solved, entry: int, last: int, shared: Mapping[int, int]) -> dict[int, int]:
        """A copy's operators' candidates (in the problem's numbering, as copy 0's) given its ends: the entry's
        candidate, its last operator's and the shared operators' (by the problem's numbering)."""
        kept = {self.entry: entry, self._own[self.q]: last} | {self._own[x]: c for x, c in shared.items()}
        inner = solved.assign(kept)
        return {node: inner[self._own[node]] for node in self.repeat.block(0)}


@dataclass
class _Chain:
    """The copies' chain with the shared operators' classes fixed: S^(copies-1) (x) F, to unfold."""

    joined: np.ndarray  # G[class of p, candidate of the run's last]
    tree: _Product | None
    middle: np.ndarray | None
    best_q: np.ndarray  # [class a, class b]: the candidate of a copy's last that shows class b, from a

    @classmethod
    def of(cls, table: np.ndarray, members: np.ndarray, starts: np.ndarray, exponent: int) -> "_Chain":
        # S[a, b]: q reduced to the class the next copy reads, and which q candidate achieves it;
        # a class only the operator before the run shows is never read again (infinite)
        ordered = table[:, members]
        counts = np.diff(np.append(starts, len(members)))
        shown = counts > 0
        square = np.full((table.shape[0], len(starts)), np.inf)
        square[:, shown] = np.minimum.reduceat(ordered, starts[shown], axis=1)
        is_best = ordered == np.repeat(square, counts, axis=1)
        positions = np.where(is_best, np.arange(len(members))[None, :], len(members))
        best_q = np.full(square.shape, -1, dtype=np.int64)
        best_q[:, shown] = members[np.minimum.reduceat(positions, starts[shown], axis=1)]
        power, tree = _power(square, exponent)
        if power is None:
            return cls(table, None, None, best_q)
        joined, middle = min_plus(power, table)
        return cls(joined, tree, middle, best_q)


@dataclass
class SolvedRun:
    """One folded run solved for one set of unary costs."""

    run: FoldedRun
    solved: Solved
    joined: np.ndarray  # G, the main graph's factor table
    chains: dict[tuple[int, ...], _Chain]

    def unfold(self, choice: list[int]) -> None:
        """Fill in every copy of ``choice`` given the operators around the run and the shared ones."""
        run = self.run
        repeat = run.repeat
        chain = self.chains[tuple(int(m[choice[x]]) for x, m in zip(run.shared, run.shared_maps))]
        start = int(run.boundary[choice[run.p]])
        end_candidate = choice[run.last]
        if chain.tree is None or chain.middle is None:
            classes = [start]
        else:
            before_last = int(chain.middle[start, end_candidate])
            classes = [start] + _unfold(chain.tree, start, before_last) + [before_last]
        # boundaries: the one before the run is given; copy k's last from the classes; the run's last is given
        q_choice = [choice[run.p]]
        for k in range(1, repeat.copies):
            q_choice.append(int(chain.best_q[classes[k - 1], classes[k]]))
        q_choice.append(end_candidate)
        shared = {x: choice[x] for x in run.shared}
        inners: dict[tuple[int, int], dict[int, int]] = {}  # copies with the same ends take the same choice
        for k in range(repeat.copies):
            entry = q_choice[k] if k == 0 else run.p_candidates + q_choice[k]  # copy 0 reads p, the rest a q
            ends = (entry, q_choice[k + 1])
            if ends not in inners:
                inners[ends] = run.assign(self.solved, entry, q_choice[k + 1], shared)
            inner = inners[ends]
            for node in repeat.block(0):
                choice[node + k * repeat.period] = inner[node]


class Costed(Protocol):
    """What a solver reads of a costed problem (`problem.SearchProblem`): arrays, never the problem."""

    @property
    def node_time(self) -> Sequence[np.ndarray]: ...
    @property
    def factors(self) -> Sequence[Factor]: ...
    @property
    def folds(self) -> Sequence[tuple[Repeat, RunEdges]]: ...
    @property
    def ties(self) -> Mapping[int, int]: ...


class Solver:
    """The search of one problem: the main graph's elimination plus one per folded run. Exact (``exact``)
    wherever every elimination step stays within the table limits; otherwise `solve` gives a plan and a
    lower bound of the optimum (`dp._split`)."""

    def __init__(
        self,
        *,
        sizes: Sequence[int] = (),
        factors: Sequence[Factor] = (),
        folds: Sequence[tuple[Repeat, RunEdges]] = (),
        ties: Mapping[int, int] | None = None,
        limits: TableLimits = TABLE_LIMITS,
        copies: CopyRuns | None = None,
    ) -> None:
        """The solver of ``sizes`` candidates per operator, ``factors`` and ``folds`` (whose tables
        may be placeholders of the right shape: planning reads shapes only); ``ties`` maps the
        operators of twin branches to the one whose candidate they take (`autopar.search.twins`);
        ``limits`` bound each elimination step; ``copies``: copy eliminations shared with the solvers of
        other problems cut from one (`CopyRuns`)."""
        self.sizes, self.limits, self.copies = list(sizes), limits, copies
        runs = [FoldedRun(repeat, edges, self.sizes, ties, limits) for repeat, edges in folds]
        # a run whose table over its boundaries would pass the limits of a table kept (its copies read many
        # shared operators that split) is searched copy by copy in the main graph instead
        over = [index for index, run in enumerate(runs) if run.table_entries > limits.left]
        try:
            self._plan(factors, folds, runs, ties, exact_only=bool(over))
        except SearchTooLargeError:
            # copy by copy the search would split its steps: relaxed, such a run is one chain again
            # (`FoldedRun`), a lower bound of the optimum with a plan, in a fraction of the time (Mixtral's 31
            # layers read the mask and rotary tables: 229 steps split and 14.6 s a DP run, where 9 and 1.3 s)
            for index in over:
                runs[index] = FoldedRun(*folds[index], self.sizes, ties, limits, relaxed=True)
            self._plan(factors, folds, runs, ties)
        self.relaxed = tuple(index for index, run in enumerate(runs) if run.relaxed and index not in self.unfolded)
        self.exact = not self.splits and not self.relaxed

    def _plan(
        self,
        factors: Sequence[Factor],
        folds: Sequence[tuple[Repeat, RunEdges]],
        runs: Sequence[FoldedRun],
        ties: Mapping[int, int] | None,
        exact_only: bool = False,
    ) -> None:
        """Plan the main graph's elimination around the runs folded (those within the limits of a table kept);
        ``exact_only``: refuse where it would split its steps (`dp.Elimination`)."""
        limits = self.limits
        self.unfolded = tuple(index for index, run in enumerate(runs) if run.table_entries > limits.left)
        self.runs = [run for index, run in enumerate(runs) if index not in self.unfolded]
        self.lead = _Lead.of(self.sizes, factors, self.runs, ties, limits, exact_only) if not self.unfolded else None
        placeholders = [run.placeholder(self.sizes[run.last]) for run in self.runs]
        given = [*self._main_factors(factors), *self._copies(folds)]
        leading = self.lead.placeholders() if self.lead is not None else []
        self.first_lead = len(given)
        self.first_placeholder = len(given) + len(leading)
        folded = {u for run in self.runs for u in run.repeat.folded if u != run.last}
        if self.lead is not None:
            folded |= set(self.lead.eliminated)
        self.main = Elimination(self.sizes, given + leading + placeholders, sorted(folded), ties, limits, exact_only)
        eliminations = [self.main, *(run.elimination for run in self.runs)]
        if self.lead is not None:
            eliminations.append(self.lead.elimination)
        self.largest = max(elimination.largest for elimination in eliminations)
        self.splits = sum(elimination.splits for elimination in eliminations)

    def _main_factors(self, factors: Sequence[Factor]) -> list[Factor]:
        """The factors the main graph eliminates: all but the lead's own (`_Lead`)."""
        if self.lead is None:
            return list(factors)
        inner = set(self.lead.inner)
        return [factor for index, factor in enumerate(factors) if index not in inner]

    def _copies(self, folds: Sequence[tuple[Repeat, RunEdges]]) -> list[Factor]:
        """The edges of every copy of the runs searched copy by copy, each in its own copy's scope."""
        found: list[Factor] = []
        for index in self.unfolded:
            repeat, edges = folds[index]
            found += edges.first
            for k in range(1, repeat.copies):
                found += [Factor(repeat.shift(f.scope, k), f.maps, f.table) for f in edges.later]
        return found

    def bind(self, factors: Sequence[Factor], folds: Sequence[tuple[Repeat, RunEdges]]) -> None:
        """Swap the placeholder tables this solver was planned on for the costed ones."""
        if self.lead is not None:
            self.lead.elimination.bind([factors[index] for index in self.lead.inner])
        self.main.bind([*self._main_factors(factors), *self._copies(folds)])
        folds = [fold for index, fold in enumerate(folds) if index not in self.unfolded]
        for run, (_, edges) in zip(self.runs, folds):
            run.elimination.bind([run._entry_factor(f, g) for f, g in zip(edges.first, edges.later)])
            run.edges = edges

    @classmethod
    def of(cls, problem: Costed, limits: TableLimits = TABLE_LIMITS, copies: CopyRuns | None = None) -> "Solver":
        """The solver planned on a costed problem's arrays (bound to its tables without recomputation)."""
        sizes = [len(t) for t in problem.node_time]
        folds, ties = problem.folds, problem.ties
        return cls(sizes=sizes, factors=problem.factors, folds=folds, ties=ties, limits=limits, copies=copies)

    def states(self) -> tuple[int, int]:
        """(candidates kept as states, candidates dropped as exactly dominated), over every operator.

        A node's candidates that show the same layouts to every table it touches collapse into one
        state: only the cheapest of them can be chosen.
        """
        kept, dropped = self.main.states()
        if self.lead is not None:
            lead_kept, lead_dropped = self.lead.elimination.states()
            kept, dropped = kept + lead_kept, dropped + lead_dropped
        for run in self.runs:
            block_kept, block_dropped = run.elimination.states(run.relaxed_own)  # the main graph's count those
            read = len(np.unique(run.follows))
            boundary = len(run.follows) - read  # copy k's last operator, reduced to the classes read
            kept += run.repeat.copies * block_kept + (run.repeat.copies - 1) * read
            dropped += run.repeat.copies * block_dropped + (run.repeat.copies - 1) * boundary
        return kept, dropped

    def minimise(self, unary: Sequence[np.ndarray]) -> list[int]:
        """The argmin of node costs ``unary`` plus every edge cost (exact where the solver is)."""
        return self.solve(unary)[0]

    def solve(self, unary: Sequence[np.ndarray]) -> tuple[list[int], float]:
        """(a candidate per operator, the least objective any plan has): the argmin and its objective where
        the solver is ``exact``; else a plan and a lower bound that need not meet."""
        solved = [run.solve(unary, self.copies) for run in self.runs]
        tables = {self.first_placeholder + i: s.joined for i, s in enumerate(solved)}
        leading = self.lead
        lead = leading.run(unary, self.copies) if leading is not None else None
        if lead is not None:
            tables |= {self.first_lead + i: factor.table for i, factor in enumerate(lead.leftover)}
        main_unary = list(unary)
        for run in self.runs:
            # its cost is inside G, as copy 0's last operator's: what its own costs differ by (a pipeline stage's
            # last operator sends its output on) is the main graph's
            own, first = np.asarray(unary[run.last]), np.asarray(unary[run.q])
            differ = np.zeros(self.sizes[run.last])
            if own is not first and not np.array_equal(own, first):  # (what copy 0's cannot take, G prices out)
                np.subtract(own, first, out=differ, where=np.isfinite(first))
            main_unary[run.last] = differ
        main = self.main.run(main_unary, tables)
        choice = main.backtrack()
        if leading is not None and lead is not None:
            for node, candidate in lead.assign({u: choice[u] for u in leading.keep}).items():
                choice[node] = candidate
        for s in solved:
            s.unfold(choice)
        # what a copy's elimination minimised apart from its boundaries is the same in every copy
        value = main.value + sum(s.run.repeat.copies * s.solved.value for s in solved)
        if lead is not None:
            value += lead.value
        return choice, value


@dataclass(frozen=True)
class _Lead:
    """The operators before a problem's first folded run, eliminated on their own where they are as many as
    one copy of it: a pipeline stage's first copy, which reads what the stage before sends, not a copy of
    this stage, and so cannot join the run (`problem._restricted_runs`). In the main graph every DP run of
    every stage eliminated it anew, as costly as the run's own copy; on its own, its elimination is kept
    in `CopyRuns` like a copy's and taken again by the stages cut from one problem where their costs are
    the same (the memory weight of a walk's first runs, and the stage's place). The 175B GPT on 1,024
    devices, 4 stages over 48 micro-batches: its main graphs summed 66.5 billion entries where its copies
    summed 47.8 billion. Its operators are numbered as the problem's (they are its first), so the stages'
    leads are one elimination."""

    elimination: Elimination
    inner: tuple[int, ...]  # the positions, among the problem's factors, of those over the lead's operators alone
    keep: tuple[int, ...]  # the lead's operators the main graph eliminates: its last, those read from beyond it
    eliminated: tuple[int, ...]  # the others: the lead's own

    @classmethod
    def of(
        cls,
        sizes: Sequence[int],
        factors: Sequence[Factor],
        runs: Sequence[FoldedRun],
        ties: Mapping[int, int] | None,
        limits: TableLimits,
        exact_only: bool,
    ) -> "_Lead | None":
        """The lead of a problem whose first run starts one copy's operators in (None: any other problem)."""
        if not runs:
            return None
        first = min(runs, key=lambda run: run.repeat.start)
        size = first.repeat.start
        if size < 2 or size != first.repeat.period:
            return None
        if any((a < size) != (b < size) for a, b in (ties or {}).items()):
            return None  # a twin inside and its partner outside: the main graph ties them
        inner = tuple(index for index, factor in enumerate(factors) if all(u < size for u in factor.scope))
        beyond = {u for factor in factors if any(u >= size for u in factor.scope) for u in factor.scope if u < size}
        beyond |= {x for run in runs for x in (run.p, *run.shared) if x < size}
        keep = tuple(sorted(beyond))
        own_ties = {a: b for a, b in (ties or {}).items() if a < size and b < size}
        if any(a in beyond or b in beyond for a, b in own_ties.items()):
            return None  # a twin the main graph eliminates: neither search would tie it (each leaves it to the other)
        elimination = Elimination(sizes[:size], [factors[index] for index in inner], keep, own_ties, limits, exact_only)
        eliminated = tuple(u for u in range(size) if u not in beyond)
        return cls(elimination, inner, keep, eliminated)

    def placeholders(self) -> list[Factor]:
        """The main graph's factors over the kept operators, one per factor the lead leaves (tables set per solve)."""
        return self.elimination.leftover_placeholders()

    def run(self, unary: Sequence[np.ndarray], copies: CopyRuns | None) -> Solved:
        """The lead eliminated on ``unary`` (its kept operators' costs are the main graph's), or its run kept."""
        own = list(unary[: len(self.elimination.sizes)])
        if copies is None:
            return self.elimination.run(own)
        return copies.run(self.elimination, own, self.eliminated)


def minimise(problem: Costed, unary: Sequence[np.ndarray]) -> list[int]:
    """Exact argmin of the problem's objective with these unary costs (repeated blocks folded)."""
    return Solver.of(problem).minimise(unary)
