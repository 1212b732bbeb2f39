"""Repeated blocks, found from the graph's structure: which consecutive blocks are copies of one another.

Transformers repeat a layer tens of times and ResNets a bottleneck; the copies have the same
operators, attributes, shapes and wiring, hence the same cost tables. `find_repeats` finds runs
of structurally identical consecutive blocks from the operators alone (types, attributes, shapes,
dtypes, constant values and wiring relative to the operator, never node names), where every block
reads only its own operators, the previous block's last operator and tensors from before the run
that every copy reads alike (a mask, a rotary table, a shared weight), and only its own last
operator is read outside it. A stretch of copies that cannot be folded is reported with the reason
(`Unfolded`), so a plan can say why. `autopar.search.fold` solves the runs found.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from autopar.graph import Graph

MIN_FOLDED_COPIES = 4  # below this, repeated squaring saves less than the boundary tables cost
MAX_PERIODS_TRIED = 12


@dataclass(frozen=True)
class Repeat:
    """Operators ``start + k * period`` .. ``+ period - 1``, k in 0..copies-1, are copies of one block.

    Copy 0 reads operator ``start - 1`` (in the main graph; it may be another kind of operator than
    the copies' last, such as the embedding before the first layer, as long as the tensors read are
    alike); copy k reads copy k-1's last.
    Every copy may also read the same tensors of the ``shared`` operators, all before ``start - 1``.
    """

    start: int
    period: int
    copies: int
    shared: tuple[int, ...] = ()  # operators before the run whose tensors every copy reads alike

    def shift(self, scope: tuple[int, ...], k: int) -> tuple[int, ...]:
        """A scope of copy 0 moved to copy k: shared operators before the run stay where they are."""
        return tuple(u + k * self.period if u >= self.start - 1 else u for u in scope)

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


@dataclass(frozen=True)
class Structure:
    """Each operator's structure, for finding copies: equal entries mean structurally identical.

    ``whole`` is one id per operator with every input's source written relative to the operator
    (how many operators back, which slot): copies of a block that reads only its predecessor
    have equal ids. ``local`` leaves the sources out; ``relative`` and ``absolute`` write each
    input slot's source both ways (-1: none, an owned or constant input), so a copy may also read
    the *same* tensor as every other copy from outside the run (a mask, a rotary table, a shared
    weight) and still match.
    """

    whole: np.ndarray
    local: np.ndarray
    relative: np.ndarray
    absolute: np.ndarray

    def same(self, period: int) -> np.ndarray:
        """Per operator i: is operator i + period a copy of it (each input from the same relative
        place, or from the very same tensor)?"""
        relative, absolute = self.relative, self.absolute
        sources = (relative[:-period] == relative[period:]) | (absolute[:-period] == absolute[period:])
        return (self.local[:-period] == self.local[period:]) & sources.all(axis=1)


def signatures(
    graph: Graph,
    uses: Sequence,
    owner: dict,
    requires_grad: dict,
    kept: frozenset[str],
    outputs: set,
    pinned: dict | None = None,
) -> Structure:
    """Every operator's `Structure`: everything a cost depends on, never a name."""
    source: dict[tuple[int, int], tuple[int, int, bool]] = {}
    for use in uses:
        source[(use.dst_node, use.dst_slot)] = (use.src_node, use.src_slot, use.src_is_output)
    whole_ids: dict[tuple, int] = {}
    local_ids: dict[tuple, int] = {}
    source_ids: dict[tuple, int] = {}
    values: dict[str, bytes | tuple[object, ...]] = {}  # a constant's bytes, once per tensor (each layer may read one)
    whole, local = [], []
    width = max((len(op.inputs) for op in graph.ops), default=0)
    relative = np.full((len(graph.ops), max(width, 1)), -1, dtype=np.int64)
    absolute = np.full((len(graph.ops), max(width, 1)), -1, dtype=np.int64)
    for node, op in enumerate(graph.ops):
        inputs: list[tuple | None] = []
        wheres: list[object] = []
        for slot, name in enumerate(op.inputs):
            if not name:
                inputs.append(None)
                wheres.append(None)
                continue
            info = graph.tensor(name)
            found = source.get((node, slot))
            if found is None:
                where: object = "owned" if owner.get(name) == (node, slot) else "constant"
            else:
                src, src_slot, is_output = found
                where = (node - src, src_slot, is_output)
                relative[node, slot] = source_ids.setdefault(("relative", *where), len(source_ids))
                absolute[node, slot] = source_ids.setdefault(("absolute", *found), len(source_ids))
            value: bytes | tuple[object, ...] | None = None
            if info.kind == "constant" and info.value is not None:
                value = values.get(name)
                if value is None:
                    value = values[name] = _value_key(info.value)
            inputs.append((info.shape, info.dtype, info.kind, info.trainable, requires_grad.get(name, False), value))
            wheres.append(where if found is None else "used")
        outputs_ = tuple(
            (graph.tensor(n).shape, graph.tensor(n).dtype, requires_grad.get(n, False), n in kept, n in outputs)
            if n
            else None
            for n in op.outputs
        )
        attributes = tuple(sorted((k, _exact(v)) for k, v in op.attrs.items()))
        fixed = (pinned or {}).get(node)
        key = (op.op_type, op.domain, attributes, op.flops, tuple(inputs), tuple(wheres), outputs_, fixed)
        local.append(local_ids.setdefault(key, len(local_ids)))
        full = (key, tuple(relative[node].tolist()))
        whole.append(whole_ids.setdefault(full, len(whole_ids)))
    return Structure(np.asarray(whole, dtype=np.int64), np.asarray(local, dtype=np.int64), relative, absolute)


def _exact(value: object) -> object:
    """A hashable stand-in equal only for equal values (array reprs elide their middle)."""
    if isinstance(value, np.ndarray):
        return (value.dtype.str, value.shape, value.tobytes())
    if isinstance(value, (list, tuple)):
        return tuple(_exact(v) for v in value)
    return repr(value)


@dataclass(frozen=True)
class Unfolded:
    """A stretch of structurally identical consecutive blocks that was not folded, and why.

    ``reason`` is a sentence with ``{op}`` where the name of operator ``op`` goes (the face names it).
    """

    start: int
    period: int
    copies: int
    reason: str
    op: int
    clean: int = 0  # copies from the first with a clean boundary


def find_repeats(size: int, uses: Sequence, structure: Structure) -> tuple[list[Repeat], list[Unfolded]]:
    """Non-overlapping runs of identical consecutive blocks that can be folded, in graph order, and the
    stretches of copies left unfolded with their reasons.

    Candidate periods are the distances between repeated signatures, most frequent (weighted by
    length) first; where runs overlap, the one folding the most operators wins.
    """
    seq = structure.whole
    if size < 3:
        return [], []
    reads: list[list[tuple[int, int]]] = [[] for _ in range(size)]  # (producer, slot) each operator reads
    readers: list[list[int]] = [[] for _ in range(size)]
    for use in uses:
        if use.src_node != use.dst_node:
            reads[use.dst_node].append((use.src_node, use.dst_slot))
            readers[use.src_node].append(use.dst_node)
    candidates: list[Repeat] = []
    refused: list[Unfolded] = []
    for period in _periods(seq):
        if MIN_FOLDED_COPIES * period + 1 > size:
            continue  # no room for the copies and the operator before them
        same = structure.same(period)
        i = 0
        while i < len(same):
            if not same[i]:
                i += 1
                continue
            j = i
            while j < len(same) and same[j]:
                j += 1
            # operators i .. j + period - 1 repeat with this period
            found = _run_in(i, j, period, seq, reads, readers)
            if isinstance(found, Repeat):
                candidates.append(found)
            elif found is not None:
                refused.append(found)
            i = j
    return _chosen(size, candidates, refused)


def _periods(seq: np.ndarray) -> list[int]:
    """The distances between repeated signatures, most frequent (weighted by length) first."""
    last_seen: dict[int, int] = {}
    distances: dict[int, int] = {}
    for i, s in enumerate(seq.tolist()):
        if s in last_seen:
            d = i - last_seen[s]
            distances[d] = distances.get(d, 0) + 1
        last_seen[s] = i
    return sorted(distances, key=lambda d: (-distances[d] * d, d))[:MAX_PERIODS_TRIED]


def _run_in(
    i: int,
    j: int,
    period: int,
    seq: np.ndarray,
    reads: list[list[tuple[int, int]]],
    readers: list[list[int]],
) -> Repeat | Unfolded | None:
    """The run to fold where operators ``i`` .. ``j + period - 1`` repeat with ``period``, or why none is
    (None: nothing worth saying)."""
    best_refusal: Unfolded | None = None
    phases: list[Repeat] = []  # the earliest clean phase, then the earliest read from a copy's like
    for offset in range(2 * period):  # the first copy may need the run's second block as its input
        start = max(i + offset, 1)
        copies = (j + period - start) // period
        if copies < MIN_FOLDED_COPIES:
            if best_refusal is not None and not best_refusal.clean:
                reason = f"fewer than {MIN_FOLDED_COPIES} copies line up with a clean boundary"
                best_refusal = Unfolded(i, period, (j - i) // period + 1, reason, i)
            break
        alike = seq[start - 1] == seq[start + period - 1]
        if phases and not alike:
            continue
        found = _valid_prefix(Repeat(start, period, copies), reads, readers)
        if isinstance(found, Repeat):
            phases.append(found)
            if alike:
                best_refusal = None
                break
        elif alike and (best_refusal is None or found.clean > best_refusal.clean):
            best_refusal = found  # the phase whose copies line up longest says the most
    if phases and _alike(phases[-1], seq):
        # the copies keep the block boundaries the graph's repetition shows (the first copy reads
        # an operator like every copy's last); the first copy may read an unlike one (the
        # embedding before the first layer) only to extend such a run: every copy's start
        # bounds an overlap window, so a run found nowhere else would change the cost model
        return max(reversed(phases), key=lambda r: r.copies)
    return best_refusal


def _chosen(size: int, candidates: list[Repeat], refused: list[Unfolded]) -> tuple[list[Repeat], list[Unfolded]]:
    """The runs folded, the most operators first where they overlap, and the stretches left unfolded."""
    chosen: list[Repeat] = []
    taken = np.zeros(size, dtype=bool)
    for repeat in sorted(candidates, key=lambda r: (-(r.copies - 1) * r.period, r.start, r.period)):
        span = slice(repeat.start, repeat.start + repeat.copies * repeat.period)
        if not taken[span].any():
            taken[span] = True
            chosen.append(repeat)
    interior = {u for r in chosen for u in r.folded if u != r.last(r.copies - 1)}
    # a run may read what another run computes only from that run's last operator (the main graph sees no other)
    folded = sorted((r for r in chosen if not interior.intersection(r.shared)), key=lambda r: r.start)
    for r in chosen:
        if r not in folded:
            inside = min(interior.intersection(r.shared))
            taken[r.start : r.start + r.copies * r.period] = False
            refused.append(
                Unfolded(r.start, r.period, r.copies, "its copies read {op}, inside another folded run", inside)
            )
    unfolded: list[Unfolded] = []
    for stretch in sorted(refused, key=lambda u: (-(u.copies * u.period), u.start)):
        span = slice(stretch.start, stretch.start + stretch.copies * stretch.period)
        if not taken[span].any():  # nothing of it folded under another period
            taken[span] = True
            unfolded.append(stretch)
    return folded, sorted(unfolded, key=lambda u: u.start)


def _alike(repeat: Repeat, seq: np.ndarray) -> bool:
    """Is the operator before the run structurally every copy's last?"""
    return bool(seq[repeat.start - 1] == seq[repeat.last(0)])


def _valid_prefix(repeat: Repeat, reads: list[list[tuple[int, int]]], readers: list[list[int]]) -> Repeat | Unfolded:
    """The longest prefix of the run whose copies have a clean boundary, or why there is none.

    A copy reads only its own operators, the previous copy's last, and tensors from before the
    run that every copy reads alike (the same producer at the same operator and slot).
    """
    copies = 0
    shared: dict[tuple[int, int], int] = {}  # (offset in the block, slot) -> the producer every copy reads there
    why = ("", -1)
    for k in range(repeat.copies):
        block = repeat.block(k)
        q_prev, q = repeat.last(k - 1), repeat.last(k)
        outside: dict[tuple[int, int], int] = {}
        for node in block:
            for src, slot in reads[node]:
                if src not in block and src != q_prev:
                    outside[(node - block[0], slot)] = src
                    if src >= repeat.start - 1 and not why[0]:
                        why = (f"copy {k + 1} reads {{op}}, outside its block and not read alike by every copy", src)
        if not why[0] and k and outside != shared:
            differ = sorted(set(outside.items()) ^ set(shared.items()))[0]
            why = (f"copy {k + 1} reads {{op}}, which the first copy does not read there", differ[1])
        if not why[0]:
            escaped = [node for node in block if node != q for dst in readers[node] if dst not in block]
            if escaped:
                why = (f"{{op}} in copy {k + 1} is read outside its block", escaped[0])
        if why[0]:
            break
        shared = outside if k == 0 else shared
        copies = k + 1
    # every copy's last operator but the run's last is read only by the next copy
    while copies >= MIN_FOLDED_COPIES:
        leaks = [
            repeat.last(k)
            for k in range(copies - 1)
            for dst in readers[repeat.last(k)]
            if dst not in repeat.block(k + 1)
        ]
        if not leaks:
            return Repeat(repeat.start, repeat.period, copies, tuple(sorted(set(shared.values()))))
        why = ("{op}, the last operator of a copy, is read outside the next copy", leaks[0])
        copies -= 1
    if not why[0]:
        why = (f"fewer than {MIN_FOLDED_COPIES} copies have a clean boundary", repeat.start)
    return Unfolded(repeat.start, repeat.period, repeat.copies, why[0], why[1], copies)


def _value_key(value: np.ndarray) -> bytes | tuple[object, ...]:
    """What a constant holds, comparable: its bytes, or for one value at every place (a broadcast buffer,
    `autopar.graph.build.scattered_buffers`) that value and its shape, without writing the buffer out."""
    if value.size > 1 and not any(value.strides):
        return ("filled", value.shape, value.reshape(-1)[:1].tobytes())
    return value.tobytes()
