"""Elimination dynamic programming over the operator graph (OptCNN / MindSpore DP), exact within its limits.

The objective is a sum of node costs and pairwise edge costs, so eliminating operators one
at a time is exact: eliminating a node folds its cost and its edges into a new cost table
over its neighbours, minimised over the node's own choice. A chain node becomes an edge
between its neighbours (node elimination), parallel edges between the same two nodes add
up (edge elimination), and residual joins or multi-consumer tensors simply give a table over
three or more operators. A node whose candidates all show the same layouts joins nothing: each
of its tables just loses its axis (`_apart`).

States per layout, not per strategy. An edge's cost depends on the two candidates only
through the layouts of the tensor at its ends, so every `Factor` indexes each of its
operators by a *class* (the candidate's layout at that edge) and its table is over classes.
Eliminating a node groups its candidates by the classes they show every factor it touches:
candidates in one group differ only in their own cost, so only the cheapest can win (an exactly
dominated candidate is dropped). The neighbours' axes in the new table are their joint
classes. Tables shrink from candidates^k to layouts^k.

The order is greedy (smallest table left behind first, kept in a heap, so a 20,000-operator
chain is planned in linear time) and depends on the structure only: an `Elimination` is
planned once and `Elimination.run` replays it for each unary cost (the memory constraint's
Lagrangian weight changes the unary costs, never the structure).

Past the limits: where every order would sum or keep a table larger than `TableLimits` allows, the
elimination is planned again within half of them, and a step past those is split into groups of its
factors, each minimised over the node on its own (`_split`): the search then answers with a plan and a
lower bound of the optimum (`Solved.value`) instead of refusing; `Elimination.exact` says which it did.

Ties: every candidate list starts with the data-parallel strategy and a candidate's unary cost
carries a tiny penalty growing with its position (1e-9 of the data-parallel objective in
total), so exact and near-exact ties go to data parallel, as MindSpore's search does.
"""

from __future__ import annotations

import functools
import hashlib
import heapq
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from autopar import context, limits, progress
from autopar.errors import SearchTooLargeError, TooLargeError
from autopar.limits import MAX_TABLE_ENTRIES, MAX_TABLE_LEFT
from autopar.search import native

TIE_BREAK_FRACTION = 1e-9
ORDERS = ("left", "fill", "work", "degree", "weighted fill")
"""Greedy elimination orders, tried in turn; the one summing the fewest entries is kept (every order
gives the same optimum). "left": the smallest table left behind (the classic min-weight rule);
"fill": the fewest neighbours that share no table yet (min-fill, which keeps a transformer's branches
from meeting in one table); "work": the smallest table summed; "degree": the fewest neighbours;
"weighted fill": the least sum, over the pairs of neighbours that share no table yet, of the product of
their class counts (Kjaerulff's weighted min-fill). The first four only see the step at hand; the last
sees what a step joins that later steps must carry: eliminating a cheap node between two operators of
many layouts (a Reshape between a mixture of experts' dispatch and combine Einsums) costs little now,
but ties the two together, and the cycle through them (the router feeds both) must then be closed by a
table over both with two more operators. Weighted fill keeps the cheap node as the one the cycle is
closed over."""
SMALL_WORK = 20_000_000
"""An order summing fewer entries than this (a tenth of a second) is kept without trying the others."""
_PLANS_KEPT = 64
"""Plans kept for eliminations of a structure planned again, in the plan's context (`autopar.context`): the
size check before costing plans each problem's elimination and its solver plans the same again (76.1B GPT
on 1,024 GPUs: 37 of 102 plannings taken)."""
_SPLITS: tuple = ("every order splits a step",)
"""The plan kept for a structure every order of which passes the limits, where only an exact plan was asked for."""


_Live = tuple[tuple[int, ...], tuple[np.ndarray, ...], tuple[int, ...]]  # a factor's scope, class maps, shape


@dataclass(frozen=True)
class Factor:
    """A cost table over a few operators, each seen through a class map (candidate -> class).

    >>> f = Factor((0, 1), (np.array([0, 0, 1]), np.array([0, 1])), np.array([[0.0, 2.0], [3.0, 0.0]]))
    >>> f.value((2, 0))   # candidate 2 of operator 0 is class 1; candidate 0 of operator 1 is class 0
    3.0
    """

    scope: tuple[int, ...]
    maps: tuple[np.ndarray, ...]
    table: np.ndarray

    def value(self, choices: Sequence[int]) -> float:
        """The table's entry for one candidate per scope operator (in scope order)."""
        return float(self.table[tuple(int(m[c]) for m, c in zip(self.maps, choices))])


@dataclass(frozen=True)
class _Gather:
    factor: int  # id of a live factor in the bucket
    index: tuple[np.ndarray, ...] | None  # per factor operator: joint class -> the factor's class (None: same)
    order: tuple[int, ...] | None  # axis permutation into bucket order (None: already in order)
    shape: tuple[int, ...]  # the gathered table's broadcast shape over the bucket scope

    def take(self, table: np.ndarray) -> np.ndarray:
        if self.index is not None:
            table = table[np.ix_(*self.index)]
        if self.order is not None:
            table = table.transpose(self.order)
        return table.reshape(self.shape)


@dataclass(frozen=True)
class _Step:
    node: int
    rest: tuple[int, ...]
    gathers: tuple[_Gather, ...]
    axis: int  # the eliminated node's axis in the bucket scope
    node_shape: tuple[int, ...]  # broadcast shape of the node's class costs
    members: np.ndarray  # the node's candidates sorted by class (stable)
    starts: np.ndarray  # where each class begins in ``members``
    rest_maps: tuple[np.ndarray, ...]  # per rest operator: candidate -> joint class
    output: int  # id of the new factor (or -1 when ``rest`` is empty)
    # a node of one class: per factor (its id, the new factor's id or -1, the node's axis, its class there)
    apart: tuple[tuple[int, int, int, int], ...] = ()
    unary: bool = True  # the node's own costs are summed here (one group of a `_Split` only)


@dataclass(frozen=True)
class _Split:
    """A node eliminated from several groups of its factors at once (`_split`): each group is a step of its
    own, minimised over the node apart from the others, the node's own costs in the first."""

    node: int
    groups: tuple[_Step, ...]
    classes: tuple[np.ndarray, ...]  # per group: the node's class per candidate there
    entries: tuple[int, ...]  # per group: the entries its table sums


BOUNDED_SHARE = 2
"""The share of the table limits a search that cannot be exact keeps to (`TableLimits.bounded`)."""


@dataclass(frozen=True)
class TableLimits:
    """How large one elimination step may be: ``entries`` summed and minimised, ``left`` kept after it.

    >>> TableLimits(100, 10).fits(60, 6), TableLimits(100, 10).fits(60, 2)
    (True, False)
    """

    entries: int = MAX_TABLE_ENTRIES
    left: int = MAX_TABLE_LEFT

    def bounded(self) -> "TableLimits":
        """The limits of a search that cannot be exact, a `BOUNDED_SHARE` of these: none of its steps is as
        large as an exact search's largest, which it need not be (a step of 400 million entries takes seconds
        and, held for backtracking, gigabytes). Measured on four full-width exports at 64 devices
        (`bench/large_exports.py`): at half the limits the worst gap was 8.7 %, at the limits 16 %, at an
        eighth 22 %; the gaps of one model move either way with the share."""
        return TableLimits(self.entries // BOUNDED_SHARE, self.left // BOUNDED_SHARE)

    def fits(self, entries: int, node_classes: int) -> bool:
        """Whether a step summing ``entries`` and minimising over ``node_classes`` of them stays within both."""
        return entries <= self.entries and entries // max(node_classes, 1) <= self.left


TABLE_LIMITS = TableLimits()
"""The limits every search keeps to (`autopar.limits`); tests give smaller ones to split small problems."""


def joint_classes(maps: list[np.ndarray], counts: list[int]) -> tuple[np.ndarray, list[np.ndarray]]:
    """Joint classes of several class maps over one operator's candidates, and each map's class per joint class."""
    joint = np.zeros(len(maps[0]) if maps else 0, dtype=np.int64)
    size = 1
    for m, count in zip(maps, counts):
        _, joint = np.unique(joint * count + m, return_inverse=True)
        joint = joint.reshape(-1)
        size = int(joint.max()) + 1 if len(joint) else 0
    first = np.zeros(size, dtype=np.int64)
    first[joint[::-1]] = np.arange(len(joint) - 1, -1, -1)  # the first candidate of each joint class
    return joint, [m[first] for m in maps]


class Elimination:
    """A structural elimination plan: which node when, and how every table is gathered.

    ``keep`` names operators never eliminated: their leftover factors come back from `run`
    (a repeated block keeps its boundary operators, see `autopar.search.fold`). ``ties`` maps an
    operator to the one whose candidate it takes (twin branches, `autopar.search.twins`): its
    factors join the other's and its unary costs add to the other's; ties of kept operators are
    left to the search that eliminates them.
    """

    def __init__(
        self,
        sizes: Sequence[int],
        factors: Sequence[Factor],
        keep: Sequence[int] = (),
        ties: Mapping[int, int] | None = None,
        limits: TableLimits = TABLE_LIMITS,
        exact_only: bool = False,
    ) -> None:
        """``exact_only``: refuse (`SearchTooLargeError`) where every order passes the limits, rather than
        plan one that splits its steps (which, over thousands of operators, takes seconds)."""
        self.sizes = list(sizes)
        self.keep = tuple(keep)
        self.limits = limits
        kept = set(self.keep)
        self.ties = tuple(sorted((t, r) for t, r in (ties or {}).items() if t not in kept and r not in kept))
        self._tied = dict(self.ties)
        self.initial = [self._tie(f) for f in factors]
        self.steps: list[_Step | _Split] = []
        self.largest = 0
        self.work = 0
        self.leftover: list[int] = []
        key = self.structure = self._structure()
        plans = context.current().eliminations
        planned = plans.get(key)
        if planned is None or (planned is _SPLITS and not exact_only):
            planned = self._best_order(bounded=False)
            if planned is None:  # (kept as such where only an exact plan is asked for: known the next time)
                planned = _SPLITS if exact_only else self._best_order(bounded=True)
            assert planned is not None  # a bounded order always answers
            plans[key] = planned
            while len(plans) > _PLANS_KEPT:
                plans.popitem(last=False)
        else:
            plans.move_to_end(key)
        if exact_only and (planned is _SPLITS or any(isinstance(step, _Split) for step in planned[0])):
            raise SearchTooLargeError(f"every order of {len(self.sizes):,} operators passes the table limits")
        assert planned is not _SPLITS
        self.steps, self.work, self.largest, self.leftover, self._leftover = planned
        self.splits = sum(isinstance(step, _Split) for step in self.steps)
        """Steps split to stay within the limits (`_split`): where any is, `run` gives a lower bound of the
        optimum and a plan that need not reach it."""
        self.exact = not self.splits

    def _best_order(self, bounded: bool) -> tuple | None:
        """The plan of the order summing the fewest entries (None: every order passes the limits). ``bounded``:
        a step past the bounded search's limits (`TableLimits.bounded`) is split (`_split`); the order
        splitting the fewest nodes is kept."""
        best: tuple | None = None
        limits = self.limits.bounded() if bounded else self.limits
        for rule in ORDERS:
            try:
                planned = self._plan(rule, limits, bounded)
            except TooLargeError:
                continue
            splits = sum(isinstance(step, _Split) for step in planned[0])
            if best is None or (splits, planned[1]) < best[0]:
                best = ((splits, planned[1]), planned)
            if planned[1] <= SMALL_WORK and not splits:
                break  # cheap enough: another order could save little
        return None if best is None else best[1]

    def _structure(self) -> bytes:
        """A digest of all that planning reads (the candidate counts, the kept operators and the ties, each
        factor's scope, class maps and table shape, the orders and the limits): equal digests, equal plans."""
        digest = hashlib.blake2b(digest_size=32)
        limits = (ORDERS, SMALL_WORK, self.limits.entries, self.limits.left)
        digest.update(repr((self.sizes, self.keep, self.ties, limits)).encode())
        for factor in self.initial:
            maps = [(m.dtype.str, m.shape) for m in factor.maps]
            digest.update(repr((factor.scope, factor.table.shape, maps)).encode())
            for classes in factor.maps:
                digest.update(np.ascontiguousarray(classes).tobytes())
        return digest.digest()

    def _tie(self, factor: Factor) -> Factor:
        """The factor with every tied operator replaced by the one it is tied to (same candidates)."""
        if not any(u in self._tied for u in factor.scope):
            return factor
        return Factor(tuple(self._tied.get(u, u) for u in factor.scope), factor.maps, factor.table)

    def _plan(
        self, rule: str, limits: TableLimits, bounded: bool
    ) -> tuple[list[_Step | _Split], int, int, list[int], dict[int, _Live]]:
        """(steps, entries summed in all, the largest step, leftover factor ids, their structure) of one order;
        a step past the limits is refused (SearchTooLargeError) or, ``bounded``, split (`_split`)."""
        steps: list[_Step | _Split] = []
        largest = work_done = 0
        sizes = self.sizes
        live: dict[int, _Live] = {}
        touching: list[set[int]] = [set() for _ in sizes]
        for fid, factor in enumerate(self.initial):
            live[fid] = (factor.scope, factor.maps, factor.table.shape)
            for u in factor.scope:
                touching[u].add(fid)
        next_id = len(self.initial)
        keep = set(self.keep)

        def estimate(v: int) -> tuple[int, int]:
            return _order_key(rule, v, touching, live, sizes)

        heap = [(*estimate(v), v) for v in range(len(sizes)) if v not in keep and v not in self._tied]
        heapq.heapify(heap)
        current = {v: (left, work) for left, work, v in heap}
        done: set[int] = set()
        while heap:
            left, work, v = heapq.heappop(heap)
            if v in done or current.get(v) != (left, work):
                continue
            done.add(v)
            bucket = sorted(touching[v])
            joint = _joint(v, bucket, live, sizes)
            counts = joint.counts
            rest = tuple(u for u in joint.scope if u != v)
            if counts[v] == 1 and len(bucket) > 1 and rest:
                step, next_id = _apart(v, bucket, live, touching, joint.per_factor, joint.maps[v], next_id)
                steps.append(step)
                work_done += sum(int(np.prod(live[out][2])) for _, out, _, _ in step.apart if out >= 0)
            else:
                entries = joint.entries
                if limits.fits(entries, counts[v]):
                    step, next_id = _summed(v, bucket, joint, live, touching, next_id)
                    steps.append(step)
                    largest, work_done = max(largest, entries), work_done + entries
                elif not bounded:
                    raise SearchTooLargeError(
                        f"The search would sum a table of {entries:,} entries and keep one of"
                        f" {entries // max(counts[v], 1):,} (limits {limits.entries:,} and {limits.left:,}):"
                        " the model's operators have too many candidate layouts on this many devices"
                    )
                else:
                    split, next_id = _split(v, bucket, live, touching, sizes, limits, next_id)
                    steps.append(split)
                    largest, work_done = max(largest, *split.entries), work_done + sum(split.entries)
            for u in rest:
                if u in keep or u in done:
                    continue
                current[u] = estimate(u)
                heapq.heappush(heap, (*current[u], u))
        leftover = sorted(live)
        return steps, work_done, largest, leftover, {fid: live[fid] for fid in leftover}

    def bind(self, factors: Sequence[Factor]) -> None:
        """Give the first initial factors their real tables (the plan was made on same-shaped placeholders)."""
        factors = [self._tie(f) for f in factors]
        for old, new in zip(self.initial, factors):
            if old.scope != new.scope or old.table.shape != new.table.shape:
                raise ValueError("a bound factor differs from the one the elimination was planned on")
        self.initial[: len(factors)] = factors

    def states(self, without: Collection[int] = ()) -> tuple[int, int]:
        """(classes kept, candidates dropped) over the eliminated and tied operators (a tied operator's
        candidates are its twin's: none is a state of its own; a split node keeps its first group's), those
        ``without`` left out (counted elsewhere)."""
        steps = [step.groups[0] if isinstance(step, _Split) else step for step in self.steps]
        steps = [step for step in steps if step.node not in without]
        kept = sum(len(step.starts) for step in steps)
        tied = sum(self.sizes[t] for t, _ in self.ties if t not in without)
        return kept, sum(len(step.members) for step in steps) - kept + tied

    def leftover_structure(self) -> list[tuple[tuple[int, ...], tuple[np.ndarray, ...]]]:
        """(scope, class maps) of each factor `run` leaves over the kept operators."""
        return [self._leftover[fid][:2] for fid in self.leftover]

    def leftover_placeholders(self) -> list[Factor]:
        """The factors `run` leaves over the kept operators, with zero tables of their shapes: what a search
        that takes them in (`fold.Solver`'s main graph) is planned on."""
        return [Factor(scope, maps, np.zeros(shape)) for scope, maps, shape in map(self._leftover.get, self.leftover)]

    def run(self, unary: Sequence[np.ndarray], tables: dict[int, np.ndarray] | None = None) -> "Solved":
        """Replay the plan on these unary costs (kept operators' entries are ignored).

        ``tables`` replaces the tables of some initial factors (by position), same shapes.
        """
        tables = {fid: f.table for fid, f in enumerate(self.initial)} | (tables or {})
        if self.ties:
            unary = list(unary)
            for twin, partner in self.ties:
                unary[partner] = np.asarray(unary[partner], dtype=float) + unary[twin]
        records: list[tuple[_Step | _Split, list, np.ndarray]] = []
        value = 0.0
        every = max(1, len(self.steps) // 100)
        for done, step in enumerate(self.steps):
            if done % every == 0:
                progress.report("search", done, len(self.steps))
            costs = np.asarray(unary[step.node], dtype=float)
            if isinstance(step, _Split):
                kept_parts = []
                for group in step.groups:
                    parts = [gather.take(tables.pop(gather.factor)) for gather in group.gathers]
                    kept_parts.append(parts)
                    value += _minimise(group, parts, costs, tables)
                records.append((step, kept_parts, costs))
                continue
            if step.apart:
                best = float(np.min(costs))  # what no choice changes goes into the first factor left
                kept: list[tuple[int, np.ndarray]] = []
                for fid, out, axis, position in step.apart:
                    table = np.take(tables.pop(fid), position, axis=axis)
                    if out < 0:
                        best += float(table)
                    else:
                        kept.append((out, table))
                for index, (out, table) in enumerate(kept):
                    tables[out] = table + best if index == 0 else table
                value += 0.0 if kept else best
                records.append((step, [], step.members[_first_best(costs, step)]))
                continue
            parts = [gather.take(tables.pop(gather.factor)) for gather in step.gathers]
            own = _best_per_class(costs, step).reshape(step.node_shape)
            added = _min_plus_added(parts, own) if step.rest else None
            if added is not None:
                tables[step.output], parts = added
            else:
                parts = _merge_parts([*parts, own])
                if step.rest:
                    tables[step.output] = _sum_min(parts)
                else:
                    value += float(np.min(functools.reduce(np.add, parts)))
            records.append((step, parts, step.members[_first_best(costs, step)]))
        structure = self.leftover_structure()
        leftover = [Factor(*structure[i], tables[fid]) for i, fid in enumerate(self.leftover)]
        return Solved(len(self.sizes), records, leftover, self.ties, value)


def _best_per_class(costs: np.ndarray, step: _Step) -> np.ndarray:
    """The node's least cost in each of its classes at ``step``."""
    return np.minimum.reduceat(costs[step.members], step.starts)


def _first_best(costs: np.ndarray, step: _Step) -> np.ndarray:
    """Per class of the node at ``step``, the position in ``step.members`` of its first cheapest candidate."""
    values = costs[step.members]
    best = np.minimum.reduceat(values, step.starts)
    is_best = values == np.repeat(best, np.diff(np.append(step.starts, len(values))))
    return np.minimum.reduceat(np.where(is_best, np.arange(len(values)), len(values)), step.starts)


def _minimise(group: _Step, parts: list[np.ndarray], costs: np.ndarray, tables: dict[int, np.ndarray]) -> float:
    """One group of a split step: its table minimised over the node joins ``tables``; where it joins no
    other operator, its minimum is returned instead (0 otherwise)."""
    if group.unary:
        parts = [*parts, _best_per_class(costs, group).reshape(group.node_shape)]
    parts = _merge_parts(parts)
    if group.rest:
        tables[group.output] = _sum_min(parts)
        return 0.0
    return float(np.min(functools.reduce(np.add, parts)))


def _apart(
    v: int,
    bucket: Sequence[int],
    live: dict[int, _Live],
    touching: list[set[int]],
    per_factor: Mapping[tuple[int, int], np.ndarray],
    classes: np.ndarray,
    next_id: int,
) -> tuple[_Step, int]:
    """Eliminate a node every candidate of which shows the same layouts (one class): each of its
    factors just loses its axis and stays a factor of its own, so the node joins nothing.

    Joined, the factors would make one table over all the node's neighbours, a dependency that is
    not there: a one-candidate operator reading a graph input that another operator at the far end
    of the model also reads (T5's shifted labels and its loss) would tie the two ends together, and
    every operator eliminated between them would carry the other end's layouts. The minimum over one
    class is the table at that class, so this is exact.
    """
    apart = []
    for fid in sorted(bucket):
        scope, maps, shape = live.pop(fid)
        for u in scope:
            touching[u].discard(fid)
        axis = scope.index(v)
        out = -1
        if len(scope) > 1:
            out, next_id = next_id, next_id + 1
            keep = [i for i in range(len(scope)) if i != axis]
            live[out] = (tuple(scope[i] for i in keep), tuple(maps[i] for i in keep), tuple(shape[i] for i in keep))
            for u in live[out][0]:
                touching[u].add(out)
        apart.append((fid, out, axis, int(per_factor[(fid, v)][0])))
    members = np.argsort(classes, kind="stable")
    step = _Step(v, (), (), 0, (1,), members, np.zeros(1, dtype=np.int64), (), -1, tuple(apart))
    return step, next_id


def _order_key(
    rule: str, v: int, touching: Sequence[set[int]], live: Mapping[int, _Live], sizes: Sequence[int]
) -> tuple[int, int]:
    """The key of order ``rule`` for eliminating ``v`` next (see `ORDERS`): smallest first."""
    scope: dict[int, int] = {}
    for fid in touching[v]:
        f_scope, _, shape = live[fid]
        for u, count in zip(f_scope, shape):
            scope[u] = min(sizes[u], scope.get(u, 1) * count)
    own = scope.pop(v, 1)
    if own == 1:
        return 0, 0  # one class: its factors only lose its axis (see `_apart`), no table grows
    left = math.prod(scope.values())
    if rule == "left":
        return left, left * own
    if rule == "work":
        return left * own, left
    neighbours = list(scope)
    if rule == "degree":
        return len(neighbours), left
    weighted = rule == "weighted fill"
    fill = 0  # pairs of neighbours that share no table yet and will (weighted: by their class counts)
    for i, a in enumerate(neighbours):
        near = {u for fid in touching[a] for u in live[fid][0]}
        fill += sum(scope[a] * scope[b] if weighted else 1 for b in neighbours[i + 1 :] if b not in near)
    return fill, left


@dataclass(frozen=True)
class _Joint:
    """The operators a bucket of factors joins, the eliminated node last (its min and argmin then run over
    contiguous memory): each one's joint class per candidate, each factor's class per joint class, the class
    counts."""

    scope: list[int]
    maps: dict[int, np.ndarray]
    per_factor: dict[tuple[int, int], np.ndarray]
    counts: dict[int, int]

    @property
    def entries(self) -> int:
        """Entries of the table summed over the whole scope."""
        return math.prod(self.counts[u] for u in self.scope)


def _joint(v: int, bucket: Sequence[int], live: Mapping[int, _Live], sizes: Sequence[int]) -> _Joint:
    """The operators the factors of ``bucket`` join, ``v`` last (`_Joint`)."""
    scope = sorted({u for fid in bucket for u in live[fid][0]} - {v}) + [v]
    joint_maps: dict[int, np.ndarray] = {}
    per_factor: dict[tuple[int, int], np.ndarray] = {}
    counts: dict[int, int] = {}
    for u in scope:
        fids = [fid for fid in bucket if u in live[fid][0]]
        maps = [live[fid][1][live[fid][0].index(u)] for fid in fids]
        shapes = [live[fid][2][live[fid][0].index(u)] for fid in fids]
        if maps:
            joint, subs = joint_classes(maps, shapes)
        else:
            joint, subs = np.zeros(sizes[u], dtype=np.int64), []
        joint_maps[u] = joint
        counts[u] = int(joint.max()) + 1 if len(joint) else 0
        for fid, sub in zip(fids, subs):
            per_factor[(fid, u)] = sub
    return _Joint(scope, joint_maps, per_factor, counts)


def _summed(
    v: int,
    bucket: Sequence[int],
    joint: _Joint,
    live: dict[int, _Live],
    touching: list[set[int]],
    next_id: int,
    unary: bool = True,
) -> tuple[_Step, int]:
    """The step summing the factors of ``bucket`` (and, with ``unary``, the node's own costs) and minimising
    over ``v``: the factors leave ``live`` and the table it leaves over the rest of the scope joins it."""
    scope, joint_maps, per_factor, counts = joint.scope, joint.maps, joint.per_factor, joint.counts
    rest = tuple(u for u in scope if u != v)
    gathers = []
    for fid in bucket:
        f_scope = live[fid][0]
        shape = tuple(counts[u] if u in f_scope else 1 for u in scope)
        index = tuple(per_factor[(fid, u)] for u in f_scope)
        same = all(len(i) == n and np.array_equal(i, np.arange(n)) for i, n in zip(index, live[fid][2]))
        positions = [scope.index(u) for u in f_scope]
        order = tuple(np.argsort(positions).tolist())
        gathers.append(
            _Gather(fid, None if same else index, None if order == tuple(range(len(order))) else order, shape)
        )
    members = np.argsort(joint_maps[v], kind="stable")
    starts = np.searchsorted(joint_maps[v][members], np.arange(counts[v]))
    for fid in bucket:
        for u in live[fid][0]:
            touching[u].discard(fid)
        del live[fid]
    output = -1
    if rest:
        output, next_id = next_id, next_id + 1
        live[output] = (rest, tuple(joint_maps[u] for u in rest), tuple(counts[u] for u in rest))
        for u in rest:
            touching[u].add(output)
    node_shape = tuple(counts[v] if u == v else 1 for u in scope)
    rest_maps = tuple(joint_maps[u] for u in rest)
    step = _Step(v, rest, tuple(gathers), scope.index(v), node_shape, members, starts, rest_maps, output, unary=unary)
    return step, next_id


def _split(
    v: int,
    bucket: Sequence[int],
    live: dict[int, _Live],
    touching: list[set[int]],
    sizes: Sequence[int],
    limits: "TableLimits",
    next_id: int,
) -> tuple["_Split", int]:
    """Eliminate ``v`` from groups of its factors (mini-buckets, Dechter and Rish 2003), each group's table
    within the limits, each minimised over ``v`` on its own: min over v of a sum is at least the sum of the
    minima, so every table left is a lower bound of the exact one, and the search's value a lower bound of
    the optimum. The largest factors are placed first, each into the first group it fits."""
    groups: list[list[int]] = []
    for fid in sorted(bucket, key=lambda f: (-math.prod(live[f][2]), f)):
        for group in groups:
            trial = _joint(v, [*group, fid], live, sizes)
            if limits.fits(trial.entries, trial.counts[v]):
                group.append(fid)
                break
        else:
            groups.append([fid])
    steps, classes, entries = [], [], []
    for index, group in enumerate(groups):
        joint = _joint(v, sorted(group), live, sizes)
        step, next_id = _summed(v, sorted(group), joint, live, touching, next_id, unary=index == 0)
        steps.append(step)
        classes.append(joint.maps[v])
        entries.append(joint.entries)
    return _Split(v, tuple(steps), tuple(classes), tuple(entries)), next_id


def _merge_parts(parts: list[np.ndarray]) -> list[np.ndarray]:
    """Add each part into a larger one whose axes cover it, while they are still small (`_merge_plan`).

    The broadcast sum then makes one full-size pass per part left, not per part given. The
    order is fixed here, so backtracking sums the same parts in the same order.
    """
    return [functools.reduce(np.add, [parts[at] for at in group]) for group in _merge_plan([p.shape for p in parts])]


def _merge_plan(shapes: Sequence[tuple[int, ...]]) -> list[list[int]]:
    """How `_merge_parts` sums parts of these shapes: per part left, the positions of the parts summed into it,
    in the order they are added, the one they are added into first. The largest is taken first (the first
    listed on a tie), each added into the first part left whose axes cover its own.

    >>> _merge_plan([(4, 1, 3), (1, 5, 3), (1, 1, 3), (4, 1, 3)])  # the (1, 1, 3) into the largest, (1, 5, 3)
    [[1, 2], [0, 3]]
    """
    groups: list[list[int]] = []
    for at in sorted(range(len(shapes)), key=lambda i: -math.prod(shapes[i])):
        axes = [n > 1 for n in shapes[at]]
        for group in groups:
            if all(b or not a for a, b in zip(axes, (n > 1 for n in shapes[group[0]]))):
                group.append(at)
                break
        else:
            groups.append([at])
    return groups


_SLAB_CELLS = 1 << 18  # entries of the summed table held at once (2 MB): it stays in cache
_PARALLEL_CELLS = 1 << 22  # a step this large is shared between threads


def _sum_min(parts: list[np.ndarray]) -> np.ndarray:
    """min over the last axis of the broadcast sum of ``parts``, a slab of the first axis at a time.

    The sum over a three-operator scope can hold a hundred million entries; it is never built
    whole, so memory stays small and pages are not faulted in for a table read once. A slab stays
    in cache: where one row of the first axis is larger (a fork's row over an attention MatMul's and
    a Transpose's layouts, 1.4 million entries), each row is summed a block of its second axis at a
    time, a quarter faster on those steps. Each part is made contiguous first: a gathered edge table is
    often a transposed view, and slabs read across its strides took twice as long (a GPT layer's
    attention steps, 302 million entries each: 0.27 s where 0.12 s; a DP run of the 39.1B GPT at 512
    devices, 2.0 s where 1.1 s). A min-plus product (`_min_plus_native`) takes its parts as they come:
    it reads the transpose of one, which such a view already is. Each entry is the same sum in the same
    order either way.
    """
    shape = np.broadcast_shapes(*(part.shape for part in parts))
    compiled = native.worth(int(np.prod(shape)), native.ENTRIES)
    if compiled and _two_sided(parts):
        return _min_plus_native(parts)
    parts = [np.ascontiguousarray(part) for part in parts]
    if compiled and len(shape) == 4 and len(parts) in (2, 3):
        return _sum_min_native(parts, shape)
    rows, columns = shape[0], shape[1]
    per_row = max(1, int(np.prod(shape[1:])))
    wide = len(shape) > 2 and per_row > _SLAB_CELLS  # blocks of the second axis, one row at a time
    height = 1 if wide else max(1, _SLAB_CELLS // per_row)
    width = max(1, _SLAB_CELLS // max(1, int(np.prod(shape[2:])))) if wide else columns
    out = np.empty(shape[:-1])

    def slabs(first: int, last: int) -> None:
        buffer = np.empty((min(height, last - first), min(width, columns), *shape[2:]))
        for start in range(first, last, height):
            stop = min(last, start + height)
            block = [part[start:stop] if part.shape[0] > 1 else part for part in parts]
            if not wide:
                _add_min(block, buffer[: stop - start], out[start:stop])
                continue
            for left in range(0, columns, width):
                right = min(columns, left + width)
                pieces = [piece[:, left:right] if piece.shape[1] > 1 else piece for piece in block]
                _add_min(pieces, buffer[:, : right - left], out[start:stop, left:right])

    over_rows(slabs, rows, rows * per_row)
    return out


def _two_sided(parts: list[np.ndarray]) -> bool:
    """Two tables, one over (rows, 1, k) and one over (1, columns, k): a min-plus product, as most large
    steps are (a chain's operator between its two neighbours)."""
    if len(parts) != 2 or any(part.ndim != 3 for part in parts):
        return False
    (r0, c0, k0), (r1, c1, k1) = parts[0].shape, parts[1].shape
    return k0 == k1 and ((c0 == 1 and r1 == 1) or (r0 == 1 and c1 == 1))


def _min_plus_native(parts: list[np.ndarray]) -> np.ndarray:
    """`_sum_min` of two tables (`_two_sided`) by the compiled kernel: the same sums, so the same minima.
    The kernel runs along the columns of b, the transpose of the second table: a gathered edge table is most
    often a transposed view, whose transpose is contiguous as it is (a GPT's steps: 328 of 358 at 128 devices),
    where making the table contiguous first, then its transpose, copied it twice."""
    rows, columns = _sides(parts)
    a, b_t = _side(parts[rows], True), _side(parts[columns], False)
    out = np.empty((a.shape[0], b_t.shape[1]))
    over_rows(functools.partial(native.kernels().min_plus_rows, a, b_t, out), a.shape[0], out.size * a.shape[1])
    return out


def _sides(parts: Sequence[np.ndarray]) -> tuple[int, int]:
    """Of a min-plus product's two tables (`_two_sided`), which is over the rows (rows, 1, k) and which over the
    columns (1, columns, k), by position."""
    return (0, 1) if parts[0].shape[1] == 1 and parts[1].shape[0] == 1 else (1, 0)


def _side(table: np.ndarray, rows: bool) -> np.ndarray:
    """A min-plus table as the kernels read it: (rows, k) for the rows' side, (k, columns) for the columns'."""
    return np.ascontiguousarray(table[:, 0, :] if rows else table[0].T)


@dataclass(frozen=True)
class _Added:
    """A table with parts added to it, as `_merge_parts` sums them, kept as its terms where the kernel added
    them as it went (`_min_plus_added`): entry by entry ``table + terms[0] + ...``, in that order."""

    table: np.ndarray
    terms: tuple[np.ndarray, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return self.table.shape


def _min_plus_added(parts: list[np.ndarray], own: np.ndarray) -> tuple[np.ndarray, list] | None:
    """`_sum_min` of `_merge_parts` of a step's tables and the node's own costs (over the summed axis) where
    they merge into a min-plus product's two tables (`_two_sided`), by the compiled kernel making each merged
    sum as it goes (`min_plus_rows_summed`: a second table over one side's axes, and the costs): the same sums
    in the same order, so the same minima, and the parts as merged (`_Added`). None where the step merges
    into anything else, or is not compiled (`_sum_min` then takes the merged parts).

    `_merge_parts` made each merged sum a table as large as its largest part, in fresh memory, held until the
    run's plan is read back: GPT-3 175B's plan on 1,024 Ascend 910s paged in gigabytes of such sums, its
    kernel zeroing each page."""
    every = [*parts, own]
    groups = _merge_plan([part.shape for part in every])
    heads = [every[group[0]] for group in groups]
    if len(groups) != 2 or any(head.ndim != 3 for head in heads) or not _two_sided(heads):
        return None
    if not native.worth(math.prod(np.broadcast_shapes(*(head.shape for head in heads))), native.ENTRIES):
        return None
    mine = len(parts)  # the own costs' position
    seconds: list[np.ndarray | None] = [None, None]  # per group, a second table over its axes
    for index, group in enumerate(groups):
        tables = [every[at] for at in group[1:] if at != mine]
        if len(tables) > 1 or any(table.shape != heads[index].shape for table in tables):
            return None  # (more than a second table over the same axes, or a part over fewer)
        seconds[index] = tables[0] if tables else None
    if own.shape != (1, 1, heads[0].shape[2]) or not any(mine in group[1:] for group in groups):
        return None
    rows, columns = _sides(heads)
    none = np.empty((0, 0))
    a, b_t = _side(heads[rows], True), _side(heads[columns], False)
    rows_second, columns_second = seconds[rows], seconds[columns]
    a_plus = none if rows_second is None else _side(rows_second, True)
    b_plus_t = none if columns_second is None else _side(columns_second, False)
    costs, on_rows = np.ascontiguousarray(own.reshape(-1)), mine in groups[rows]
    out = np.empty((a.shape[0], b_t.shape[1]))
    kernel = functools.partial(native.kernels().min_plus_rows_summed, a, a_plus, b_t, b_plus_t, costs, on_rows, out)
    over_rows(kernel, a.shape[0], out.size * a.shape[1])
    merged = [
        _Added(heads[i], tuple(every[at] for at in group[1:])) if len(group) > 1 else heads[i]
        for i, group in enumerate(groups)
    ]
    return out, merged


def _sum_min_native(parts: list[np.ndarray], shape: tuple[int, ...]) -> np.ndarray:
    """`_sum_min` of two or three tables over a three-operator scope (four axes, the last summed over) by the
    compiled kernels: each entry the same sum in the same order, so the same minima (a Llama-2-7B at 32,768
    tokens on 32 devices spends three quarters of its search in these steps)."""
    views = [np.broadcast_to(part, shape) for part in parts]
    out = np.empty(shape[:-1])
    kernel = native.kernels().sum_min_two if len(views) == 2 else native.kernels().sum_min_three
    over_rows(lambda first, last: kernel(*views, out, first, last), shape[0], int(np.prod(shape)))
    return out


def over_rows(work: Callable[[int, int], None], rows: int, cells: int) -> None:
    """``work(first, last)`` over rows 0 .. ``rows`` of a step of ``cells`` entries: a large step's rows split
    between threads (numpy releases the GIL), each row's result the same whichever thread computes it."""
    workers = min(limits.WORKERS, rows, max(1, cells // _PARALLEL_CELLS))
    pool = context.current().pool() if workers > 1 else None
    if pool is None:
        work(0, rows)
        return
    bounds = np.linspace(0, rows, workers + 1).astype(int)
    list(pool.map(work, bounds[:-1], bounds[1:]))


def _add_min(pieces: list[np.ndarray], total: np.ndarray, out: np.ndarray) -> None:
    """``out`` = min over the last axis of the sum of ``pieces``, summed in ``total`` (their broadcast shape)."""
    if len(pieces) == 1:
        total[...] = pieces[0]
    else:
        np.add(pieces[0], pieces[1], out=total)
        for piece in pieces[2:]:
            np.add(total, piece, out=total)
    np.min(total, axis=-1, out=out)


@dataclass(frozen=True)
class Solved:
    """One run of an elimination: the argmin tables to backtrack, and the factors left over kept operators."""

    size: int
    records: list[tuple[_Step | _Split, list, np.ndarray]]
    leftover: list[Factor]
    ties: tuple[tuple[int, int], ...] = ()  # (tied operator, the one whose candidate it takes)
    value: float = 0.0
    """The minimum of what was eliminated and joins no kept operator (the whole objective where nothing is
    kept): exact where the elimination is, a lower bound of it where a step was split."""

    def backtrack(self, kept: dict[int, int] | None = None) -> list[int]:
        """A candidate per operator: kept operators as given, every eliminated one at its argmin."""
        choice = [0] * self.size
        for u, c in self.assign(kept or {}).items():
            choice[u] = c
        return choice

    def assign(self, kept: dict[int, int]) -> dict[int, int]:
        """The eliminated (and tied) operators' argmin given the kept ones (and the kept ones), as a mapping."""
        choice = dict(kept)
        for step, parts, representative in reversed(self.records):
            if isinstance(step, _Split):  # every group's table at the neighbours' choices, candidate by candidate
                total = np.array(representative, dtype=float)  # here: the node's own costs
                for group, classes, group_parts in zip(step.groups, step.classes, parts):
                    total += _row(group, group_parts, choice)[classes]
                choice[step.node] = int(np.argmin(total))
                continue
            if step.apart:  # one class: its cheapest candidate, whatever the neighbours chose
                choice[step.node] = int(representative[0])
                continue
            # the eliminated node's costs at the neighbours' chosen classes: the argmin is recomputed
            # here on one row instead of stored for the whole table
            choice[step.node] = int(representative[int(np.argmin(_row(step, parts, choice)))])
        for twin, partner in self.ties:
            choice[twin] = choice[partner]
        return choice


def _row(step: _Step, parts: Sequence[np.ndarray], choice: Mapping[int, int]) -> np.ndarray:
    """The sum of a step's parts at its other operators' chosen classes, over the node's classes."""
    at = tuple(int(m[choice[u]]) for m, u in zip(step.rest_maps, step.rest))
    row = sum(_at(part, at) for part in parts)
    return np.broadcast_to(row, (len(step.starts),))


def _at(part: np.ndarray | _Added, at: tuple[int, ...]) -> np.ndarray:
    """A part's entries at the other operators' chosen classes (an `_Added` one's sum made here, entry by entry
    as `_merge_parts` made it)."""
    if isinstance(part, _Added):
        return functools.reduce(np.add, [_at(term, at) for term in (part.table, *part.terms)])
    return part[tuple(a if n > 1 else 0 for a, n in zip(at, part.shape))]


@dataclass(frozen=True)
class TieBreak:
    """A position penalty per candidate, small enough never to beat a real difference: among exactly equal
    plans the DP takes the earliest candidates (data parallel first). ``epsilon``: seconds per position;
    ``slack``: the most it adds to a plan's time.

    >>> tie = TieBreak.of([np.zeros(3), np.zeros(3)], 4.0)
    >>> [offsets.tolist() for offsets in tie.offsets([np.zeros(3), np.zeros(2)])], tie.slack
    ([[0.0, 1e-09, 2e-09], [0.0, 1e-09]], 4e-09)
    """

    epsilon: float
    slack: float

    @classmethod
    def of(cls, node_time: Sequence[np.ndarray], base_objective: float) -> "TieBreak":
        """A `TIE_BREAK_FRACTION` of ``base_objective`` spread over the problem's positions."""
        scale = TIE_BREAK_FRACTION * max(base_objective, 1e-12)
        return cls(scale / _positions(node_time), scale)

    @classmethod
    def at(cls, epsilon: float, node_time: Sequence[np.ndarray]) -> "TieBreak":
        """``epsilon`` seconds a position, given, and what it adds at most over this problem's positions: the
        stages of one pipeline shape take one (`cuts._StageSearch`), so that a block's copies, alike in every
        stage, cost alike in every one."""
        return cls(epsilon, epsilon * _positions(node_time))

    def offsets(self, node_time: Sequence[np.ndarray]) -> list[np.ndarray]:
        return [self.epsilon * np.arange(len(t)) for t in node_time]


def _positions(node_time: Sequence[np.ndarray]) -> int:
    return sum(max(len(t) - 1, 0) for t in node_time) or 1


def tie_break_unary(node_time: Sequence[np.ndarray], base_objective: float) -> list[np.ndarray]:
    """Unary costs (seconds per candidate of each operator) plus the tie-break position penalty
    (`TieBreak.of`)."""
    return [t + o for t, o in zip(node_time, TieBreak.of(node_time, base_objective).offsets(node_time))]
