"""Redistribution coefficients for many layout pairs at once, with numpy.

An edge's cost is ``latency + per_byte * tensor_bytes``, and the two coefficients depend on
the (source, target) layouts only. `redistribute.symbolic_steps` plans one pair at a time in
Python (tens of microseconds); a model on 1024 devices has millions of distinct pairs. This
module runs the same planner on every pair in lockstep: each round takes one step for every pair
still moving (one bit, or a run of bits whose one-bit steps the planner would fuse: gathers of one
dimension, slices or ReduceScatters of one), and fuses consecutive steps exactly as `_merge` does. The
summation order of each pair's terms is the one `costing.redistribution_coefficients`
uses, so the results are identical to the last bit (`tests/test_coefficients.py` checks it).

A dimension's bits are packed into one integer, four bits per mesh bit, most significant
first, so "is a prefix of", "pop the last bit" and "the next bit wanted" are shifts and masks.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from autopar import context, limits, progress
from autopar.cost import CostModel
from autopar.layout import Layout
from autopar.limits import MAX_DEVICES
from autopar.redistribute import Collective
from autopar.search import native

# Step kinds as small integers; -1 is "no step".
KINDS = (
    Collective.ALL_GATHER,
    Collective.REDUCE_SCATTER,
    Collective.ALL_TO_ALL,
    Collective.ALL_REDUCE,
    Collective.SLICE,
)
_AG, _RS, _A2A, _AR, _SLICE = range(len(KINDS))
_MERGEABLE = np.array([True, True, False, False, True])
_NIBBLE = 4  # bits per packed mesh bit: mesh bits 0..15, i.e. up to 65,536 devices
MAX_MESH_BITS = MAX_DEVICES.bit_length() - 1
CHUNK = 1 << 17  # pairs per lockstep batch: its arrays stay a few MB each, nearer the cache (7 % faster than 1 << 18)


class LayoutTable:
    """Layouts packed into arrays: per layout and dimension, the number of bits and their code."""

    def __init__(self, length: np.ndarray, code: np.ndarray, partial: np.ndarray) -> None:
        self.length = length
        self.code = code
        self.partial = partial

    @classmethod
    def of(cls, layouts: Sequence[Layout]) -> "LayoutTable":
        """The table of some `Layout` values (`OpRule.encoded_layouts` makes the same rows directly)."""
        width = max((layout.ndim for layout in layouts), default=0)
        length = np.zeros((len(layouts), max(width, 1)), dtype=np.int64)
        code = np.zeros(length.shape, dtype=np.uint64)
        partial = np.zeros(len(layouts), dtype=np.int64)
        for index, layout in enumerate(layouts):
            for dim, bits in enumerate(layout.dims):
                length[index, dim] = len(bits)
                packed = 0
                for bit in bits:
                    packed = (packed << _NIBBLE) | bit
                code[index, dim] = packed
            for bit in layout.partial:
                partial[index] |= 1 << bit
        return cls(length, code, partial)

    def places(self) -> tuple[np.ndarray, np.ndarray]:
        """Per layout and mesh bit: the dim the bit splits and its position there (-1 for both where it
        splits none), computed once."""
        found = self.__dict__.get("_places")
        if found is None:
            count = len(self.length)
            where = np.full((count, MAX_MESH_BITS), -1, dtype=np.int64)
            place = np.full((count, MAX_MESH_BITS), -1, dtype=np.int64)
            rows = np.arange(count)
            for dim in range(self.length.shape[1]):
                length = self.length[:, dim]
                for position in range(int(length.max(initial=0))):
                    has = position < length
                    shift = (np.maximum(length - 1 - position, 0) * _NIBBLE).astype(np.uint64)
                    bit = ((self.code[:, dim] >> shift) & np.uint64(15)).astype(np.int64)
                    where[rows[has], bit[has]] = dim
                    place[rows[has], bit[has]] = position
            found = self.__dict__["_places"] = (where, place)
        return found


def pair_coefficients(
    table: LayoutTable, src: np.ndarray, dst: np.ndarray, cost: CostModel
) -> tuple[np.ndarray, np.ndarray]:
    """(latency, seconds per byte of the whole tensor) of redistributing each ``src`` layout to its
    ``dst`` one (indices of ``table``); the target layouts must not be partial. A gradient's way
    back is a pair of its own: from the consumer's layout, partial where its gradient is, to the
    producer's (`costing._edge_costs`). Many pairs at once go to the compiled planner where numba is
    installed (`native`), which gives the same numbers.
    """
    count = len(src)
    if (table.partial != 0)[dst].any():  # (a flag a pair, not a row's bits: tens of millions of pairs)
        raise ValueError("a consumer never asks for a partial layout")
    if native.worth(count, native.PAIRS):
        return _compiled_coefficients(table, src, dst, cost)
    results = [np.zeros(count) for _ in range(2)]

    def work(start: int) -> None:
        stop = min(start + CHUNK, count)
        chunk = _chunk_coefficients(table, src[start:stop], dst[start:stop], cost)
        for result, part in zip(results, chunk):
            result[start:stop] = part

    _over_chunks(work, count)
    return results[0], results[1]


def _over_chunks(work: Callable[[int], None], count: int) -> None:
    """``work(start)`` for each chunk of ``count`` pairs: chunks are independent, and numpy and the compiled
    planner release the GIL, so one thread per core."""
    with ThreadPoolExecutor(max_workers=limits.WORKERS) as pool:
        for done, _ in enumerate(pool.map(work, range(0, count, CHUNK))):
            progress.report("costing redistributions", done * CHUNK, count)


def _compiled_coefficients(
    table: LayoutTable, src: np.ndarray, dst: np.ndarray, cost: CostModel
) -> tuple[np.ndarray, np.ndarray]:
    """`pair_coefficients` by the compiled planner (`native_jit.pair_coefficients`). The prices it reads
    are filled beforehand; a pair that meets one missing all the same (its latency NaN, the price's key for
    its seconds per byte: a first problem's tens of millions of pairs need no third array) is run again once
    it is priced."""
    prices = _Prices.of(cost).filled()
    where, place = table.places()
    kernel = native.kernels().pair_coefficients

    def run(src: np.ndarray, dst: np.ndarray, out: tuple[np.ndarray, np.ndarray], start: int) -> None:
        stop = min(start + CHUNK, len(src))
        prices_read = (prices.masks, prices.radix, prices.latency, prices.per_byte)
        ends = [side[start:stop].astype(np.int64, copy=False) for side in (src, dst)]  # (a chunk at a time)
        outputs = [part[start:stop] for part in out]
        kernel(table.length, table.code, table.partial, where, place, *ends, *prices_read, *outputs)

    count = len(src)
    found = (np.empty(count), np.empty(count))  # latency, per byte: the kernel writes every pair
    _over_chunks(lambda start: run(src, dst, found, start), count)
    again = np.flatnonzero(np.isnan(found[0]))
    while len(again):  # price what the tables lacked (in this thread), then run those pairs again
        prices.fill(np.unique(found[1][again].astype(np.int64)))
        redone = (np.empty(len(again)), np.empty(len(again)))
        for start in range(0, len(again), CHUNK):
            run(src[again], dst[again], redone, start)
        for array, values in zip(found, redone):
            array[again] = values
        again = again[np.isnan(redone[0])]
    return found[0], found[1]


@dataclass(frozen=True)
class KeySet:
    """The distinct values of a few integer arrays, sorted (``keys``), and where a value among them stands
    (`position`): `np.unique` and `np.searchsorted` for the tens of millions of layout-pair keys a large model
    has, where numpy 2.4's hashing `np.unique` takes seventeen times as long as a sort.

    >>> found = KeySet.of([np.array([3, 1, 3]), np.array([2, 9])])
    >>> found.keys.tolist(), found.position(np.array([9, 1, 3])).tolist()
    ([1, 2, 3, 9], [3, 0, 2])

    Keys that are dense (non-negative, the largest under sixteen per key given, as a layout pair's
    ``source * layouts + target`` over the pairs of ten thousand layouts is) are marked in a table of flags
    instead of sorted: one pass, and no more memory than the sort (the keys joined, then sorted: sixteen
    bytes a key). A key's position is then the flags set before it, counted a 64-bit word at a time, where a
    binary search would take twenty-odd steps of scattered reads: building a large model's edge tables takes
    a third less time.
    """

    keys: np.ndarray
    words: np.ndarray | None = None  # the flags, 64 keys a word, key k at bit k % 64 (None: sorted keys only)
    before: np.ndarray | None = None  # how many flags are set in the words before each

    @classmethod
    def of(cls, arrays: Sequence[np.ndarray]) -> "KeySet":
        arrays = [array for array in arrays if len(array)]
        if not arrays:
            return cls(np.zeros(0, dtype=np.int64))
        dtype = np.result_type(*arrays)
        total = sum(len(array) for array in arrays)
        least, most = min(int(array.min()) for array in arrays), max(int(array.max()) for array in arrays)
        if dtype.kind != "i" or least < 0 or most >= 16 * total:
            ordered = np.sort(np.concatenate(arrays))
            first = np.empty(len(ordered), dtype=bool)
            first[0] = True
            np.not_equal(ordered[1:], ordered[:-1], out=first[1:])
            return cls(ordered[first])
        seen = np.zeros((most // 64 + 1) * 64, dtype=bool)
        for array in arrays:
            seen[array] = True
        words = np.packbits(seen, bitorder="little").view("<u8")
        before = np.zeros(len(words), dtype=np.int64)
        np.cumsum(np.bitwise_count(words[:-1]), out=before[1:])
        keys = np.empty(int(before[-1] + np.bitwise_count(words[-1])), dtype=dtype)
        for start in range(0, len(seen), _FLAGS):  # (a band of flags at a time: no 64-bit index of every key)
            found = np.flatnonzero(seen[start : start + _FLAGS])
            at = int(before[start // 64])  # (the keys flagged before the band)
            keys[at : at + len(found)] = found + start
        return cls(keys, words, before)

    def __len__(self) -> int:
        return len(self.keys)

    def position(self, keys: np.ndarray, beside: np.ndarray | None = None) -> np.ndarray:
        """Each of ``keys``' index in `keys` (every one of them must be there), or, given an array ``beside``
        `keys`, its entry there, in ``beside``'s type. A chunk of keys at a time: a first problem's tables hold
        tens of millions of keys, and each step's array of that size was paged in anew.

        >>> KeySet.of([np.array([7, 2])]).position(np.array([[7, 7], [2, 7]]), np.array([20, 70])).tolist()
        [[70, 70], [20, 70]]
        """
        flat = keys.reshape(-1)
        found = np.empty(len(flat), dtype=np.int64 if beside is None else beside.dtype)
        for start in range(0, len(flat), _POSITIONS):
            at = self._positions(flat[start : start + _POSITIONS])
            found[start : start + len(at)] = at if beside is None else beside[at]
        return found.reshape(keys.shape)

    def _positions(self, keys: np.ndarray) -> np.ndarray:
        if self.words is None or self.before is None:
            return np.searchsorted(self.keys, keys)
        word = keys >> 6
        below = (np.uint64(1) << (keys & 63).astype(np.uint64)) - np.uint64(1)
        return self.before[word] + np.bitwise_count(self.words[word] & below)


_POSITIONS = 1 << 18  # keys `KeySet.position` looks up at a time: its steps' arrays stay a few MB
_FLAGS = 1 << 22  # flags `KeySet.of` lists the keys of at a time (a multiple of 64: a word's flags stay together)


class PairCache:
    """The coefficients of every layout pair one cost model has costed, for the problems planned after.

    A pipeline search builds a problem per stage count and micro-batch count on one cost model; their
    layouts are mostly the same (a mesh bit's link does not depend on how many devices the mesh has,
    and a smaller batch only drops the splits it no longer divides), so each pair is costed once.
    Layouts are numbered by their packed rows (`OpRule.encoded_layouts`); a pair's coefficients stay
    at one slot of `values` for good (new pairs are appended), and the pairs' keys are a sorted array
    beside their slots.

    A group of edges (`_edge_costs`: one tensor's source and consumer layouts) keeps its pairs' slots
    (`keep`), so a later problem whose group has layouts among those (the same operators at a smaller
    micro-batch or on fewer devices) takes its slots by indexing (`reused`), where looking its pairs
    up again in the sorted keys took most of a later problem's costing (76.1B GPT: 2 of 5 s a problem).
    """

    def __init__(self) -> None:
        self.rows: dict[bytes, int] = {}  # a packed layout row -> its number
        self.keys = np.zeros(0, dtype=np.int64)  # source number << 32 | target number, sorted
        self.slots = np.zeros(0, dtype=np.int32)  # where each key's coefficients are in `values` (`_slot_type`)
        self._sorted: list[np.ndarray] = [self.keys, self.slots]  # `keys` and `slots`, with room to grow (`_insert`)
        self._buffers = [np.zeros(0) for _ in range(2)]  # `values`, with room to grow (`_append`)
        self._count = 0  # pairs costed: the buffers' entries in use
        self.groups: dict[Hashable, PairSlots] = {}  # the slots of a group's pairs, by the group's name

    @property
    def values(self) -> list[np.ndarray]:
        """Latency and seconds per byte of every pair costed, in the order costed (a pair's slot indexes them)."""
        return [buffer[: self._count] for buffer in self._buffers]

    def _append(self, fresh: Sequence[np.ndarray]) -> np.ndarray:
        """Keep newly costed pairs' coefficients after the others; their slots (`_slot_type`). The buffers at least
        double when they grow: appending to arrays of tens of millions of pairs copied (and paged in) them all each
        time."""
        first, count = self._count, self._count + len(fresh[0])
        if not first:  # the first pairs: their arrays are the buffers (a first problem's are tens of millions)
            self._buffers, self._count = [np.asarray(part, dtype=float) for part in fresh], count
            return np.arange(count, dtype=_slot_type(count))
        if count > len(self._buffers[0]):
            capacity = max(count, 2 * len(self._buffers[0]))
            grown = [np.empty(capacity) for _ in self._buffers]
            for new, old in zip(grown, self._buffers):
                new[:first] = old[:first]
            self._buffers = grown
        for buffer, part in zip(self._buffers, fresh):
            buffer[first:count] = part
        self._count = count
        return np.arange(first, count, dtype=_slot_type(count))

    @classmethod
    def of(cls, cost: CostModel) -> "PairCache":
        """The pairs the plan under way has costed on this cost model (`autopar.context`)."""
        return context.current().for_cost_model("pairs", cost, lambda _: cls())

    def numbers(self, rows: Sequence[bytes]) -> np.ndarray:
        """Each packed layout row's number, given a new one where it has none."""
        return np.asarray([self.rows.setdefault(row, len(self.rows)) for row in rows], dtype=np.int64)

    def slots_of(
        self, numbers: np.ndarray, table: LayoutTable, src: np.ndarray, dst: np.ndarray, cost: CostModel
    ) -> np.ndarray:
        """The slot in `values` of each pair ``src`` -> ``dst`` (indices of ``table``, whose rows are
        numbered ``numbers``), costing the pairs not costed before."""
        keys = numbers[src]  # (in place: each array of a first problem's pairs is a hundred MB, paged in anew)
        keys <<= 32
        keys |= numbers[dst]
        if not len(self.keys) and (keys[1:] > keys[:-1]).all():  # the first problem: every pair new, in order
            self.keys, self.slots = keys, self._append(pair_coefficients(table, src, dst, cost))
            held = self.slots.view()
            held.flags.writeable = False
            return held
        at = np.searchsorted(self.keys, keys)
        np.minimum(at, len(self.keys) - 1, out=at)
        known = self.keys[at] == keys if len(self.keys) else np.zeros(len(keys), dtype=bool)
        if known.all():  # every pair costed before (any problem after the first at a device count)
            return self.slots[at]
        missing = np.flatnonzero(~known)
        found = np.empty(len(keys), dtype=_slot_type(self._count + len(missing)))  # (each new pair at most one slot)
        found[known] = self.slots[at[known]]
        asked = keys[missing]
        if (asked[1:] > asked[:-1]).all():  # sorted and distinct, as a first problem asks (no sort needed)
            new, costed, again = asked, missing, None
        else:
            new, first, again = np.unique(asked, return_index=True, return_inverse=True)
            costed = missing[first]
        slots = self._append(pair_coefficients(table, src[costed], dst[costed], cost))
        found[missing] = slots if again is None else slots[again.reshape(-1)]
        if not len(self.keys):  # an empty cache takes the new pairs as they are
            self.keys, self.slots = new, slots
            return found
        self._insert(new, slots)
        return found

    def _insert(self, new: np.ndarray, slots: np.ndarray) -> None:
        """Merge new keys (sorted, none held) and their slots into the sorted ones, in place: the keys sit at
        the head of buffers that at least double when they grow, and each later problem's few hundred
        thousand pairs move the held ones right, a band at a time. A merge into fresh arrays paged 240 MB in
        anew for each of a 1,024-device GPT's later problems (15 million pairs held)."""
        count, total = len(self.keys), len(self.keys) + len(new)
        before = np.searchsorted(self.keys, new)  # each new key goes before the held key there
        kinds = (np.dtype(np.int64), np.result_type(self.slots, slots))  # (slots widen once they pass 32 bits)
        if total > len(self._sorted[0]) or kinds[1] != self._sorted[1].dtype:
            grown = [np.empty(max(total, 2 * count), dtype=kind) for kind in kinds]
            for buffer, held in zip(grown, (self.keys, self.slots)):
                buffer[:count] = held
            self._sorted = grown
        for buffer, fresh in zip(self._sorted, (new, slots)):
            _insert_sorted(buffer, count, fresh, before)
        self.keys, self.slots = (buffer[:total] for buffer in self._sorted)

    def narrowed(self, slots: np.ndarray) -> np.ndarray:
        """Slots in the type `keep` keeps them in (the same array where they are in it already)."""
        return slots.astype(np.int32, copy=False) if self._count < 2**31 else slots

    def keep(self, name: Hashable, slots: "PairSlots") -> "PairSlots":
        """Keep a group's slots under its name, and give them back as kept: in 32 bits where they fit
        (a 1024-device GPT's groups hold 30 million slots, 120 MB so). The latest group of a name
        replaces the one before, and groups stay as long as the cost model does."""
        if self._count < 2**31:
            backward = None if slots.backward is None else slots.backward.astype(np.int32, copy=False)
            slots = PairSlots(slots.sources, slots.targets, slots.forward.astype(np.int32, copy=False), backward)
        self.groups[name] = slots
        return slots

    def reused(self, name: Hashable, sources: np.ndarray, targets: np.ndarray) -> "PairSlots | None":
        """The slots of a group whose source and target layouts (numbers) are all among those of the
        group kept under ``name``, taken from it (None: some are not)."""
        kept = self.groups.get(name)
        if kept is None:
            return None
        rows, columns = _places(kept.sources, sources), _places(kept.targets, targets)
        if rows is None or columns is None:
            return None
        if _every(rows, len(kept.sources)) and _every(columns, len(kept.targets)):
            return PairSlots(sources, targets, kept.forward, kept.backward)
        return PairSlots(sources, targets, kept.forward, kept.backward, rows, columns)


@dataclass(frozen=True)
class PairSlots:
    """The slots (`PairCache.values`) of a group of edges' layout pairs: ``forward`` a row per source and
    a column per target layout (numbers ``sources`` and ``targets``), ``backward`` (the gradient's way,
    None where none comes back) a row per target and a column per source layout.

    A group taken from a kept one with fewer layouts (`PairCache.reused`) holds the kept group's tables and
    its own layouts' places in them: its pair (i, j) is their (``rows[i]``, ``columns[j]``). The slots are
    read through them (`through`), not copied out: a 1,024-device GPT's later problems copied 115 million
    slots so, a second of their costing."""

    sources: np.ndarray
    targets: np.ndarray
    forward: np.ndarray
    backward: np.ndarray | None
    rows: np.ndarray | None = None  # None: every row of the tables, in order
    columns: np.ndarray | None = None

    @property
    def size(self) -> int:
        """How many layout pairs the group has: each source layout with each target layout."""
        return len(self.sources) * len(self.targets)

    def through(self) -> tuple[np.ndarray, np.ndarray]:
        """The places of the group's (source, target) layouts in its tables: (rows, columns) of ``forward``."""
        rows = np.arange(len(self.sources)) if self.rows is None else self.rows
        return rows, np.arange(len(self.targets)) if self.columns is None else self.columns

    def forward_slots(self) -> np.ndarray:
        """The group's own forward slots, a row per source and a column per target layout."""
        return self.forward if self.rows is None else self.forward[np.ix_(*self.through())]

    def backward_slots(self) -> np.ndarray | None:
        """The group's own slots of the gradient's way back, a row per target and a column per source layout."""
        if self.backward is None or self.rows is None:
            return self.backward
        rows, columns = self.through()
        return self.backward[np.ix_(columns, rows)]


def _every(places: np.ndarray, count: int) -> bool:
    """Whether ``places`` are 0 .. ``count - 1`` in order."""
    return len(places) == count and bool((places == np.arange(count)).all())


def _places(held: np.ndarray, wanted: np.ndarray) -> np.ndarray | None:
    """Where each of ``wanted`` is in ``held`` (None: some is not there).

    >>> _places(np.array([7, 3, 5]), np.array([5, 7])).tolist(), _places(np.array([7, 3]), np.array([4]))
    ([2, 0], None)
    """
    if not len(wanted):
        return np.zeros(0, dtype=np.int64)
    if not len(held):
        return None
    order = np.argsort(held, kind="stable")
    ordered = held[order]
    at = np.minimum(np.searchsorted(ordered, wanted), len(held) - 1)
    return order[at] if np.array_equal(ordered[at], wanted) else None


def _slot_type(count: int) -> type[np.signedinteger]:
    """The integer type of the slots of ``count`` pairs costed: 32 bits while every slot fits. A first problem's
    tens of millions of slots then take half the memory, and `PairCache.narrowed` keeps them as they are where it
    copied them into 32 bits: Megatron's 76.1B GPT on 1,024 GPUs, 14.6 million slots, 58 MB held where 117 MB were
    held and 58 MB more copied (its first problem's peak 1.17 GB where 1.23 GB).

    >>> _slot_type(2**31).__name__, _slot_type(2**31 + 1).__name__
    ('int32', 'int64')
    """
    return np.int32 if count - 1 <= np.iinfo(np.int32).max else np.int64


def _insert_sorted(buffer: np.ndarray, count: int, new: np.ndarray, before: np.ndarray, band: int = 1 << 18) -> None:
    """Insert ``new`` into the first ``count`` entries of ``buffer``, each new entry ``j`` before the held one at
    ``before[j]`` (sorted), in place: held entry ``i`` moves right by the new entries before it, a ``band`` of
    entries at a time from the end (a few MB), so no entry is written before it is read (used instead of
    `np.insert`, which makes a new array and sorts its positions first).

    >>> buffer = np.array([1, 5, 7, 0, 0, 0])
    >>> _insert_sorted(buffer, 3, np.array([3, 6, 9]), np.array([1, 2, 3]))
    >>> buffer.tolist()
    [1, 3, 5, 6, 7, 9]
    """
    stop = count
    while len(new) and stop > before[0]:
        start = max(int(before[0]), stop - band)
        first, last = np.searchsorted(before, [start, stop])
        moves = first + np.cumsum(np.bincount(before[first:last] - start, minlength=stop - start))
        buffer[np.arange(start, stop) + moves] = buffer[start:stop].copy()
        stop = start
    buffer[before + np.arange(len(new))] = new


def _cells(array: np.ndarray) -> np.ndarray:
    """A per-pair table's cells as one flat view (row * width + dim): writes through it change the table."""
    if not array.flags.c_contiguous:  # a copy would take the writes silently
        raise ValueError("a per-pair table must be C-contiguous")
    return array.reshape(-1)


def _drop(code: np.ndarray, count: np.ndarray) -> np.ndarray:
    """The code without its last ``count`` bits (16 or more drops everything)."""
    shift = (np.minimum(count, 15) * _NIBBLE).astype(np.uint64)
    return np.where(count >= 16, np.uint64(0), code >> shift)


def _status(
    length: np.ndarray, code: np.ndarray, want_length: np.ndarray, want_code: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Per cell: is the current bit list a prefix of the wanted one, and the next bit it wants (-1: none)."""
    room = want_length - length
    prefix = (room >= 0) & (_drop(want_code, np.maximum(room, 0)) == code)
    wanted = (_drop(want_code, np.maximum(room - 1, 0)) & np.uint64(15)).astype(np.int64)
    return prefix, np.where(prefix & (room > 0), wanted, -1)


def _low_nibbles(count: np.ndarray) -> np.ndarray:
    """A mask of the last ``count`` packed bits (0 to 16) of a code."""
    full = np.uint64(0xFFFF_FFFF_FFFF_FFFF)
    shift = (np.minimum(count, 15) * _NIBBLE).astype(np.uint64)
    return np.where(count >= 16, full, (np.uint64(1) << shift) - np.uint64(1))


class _Lockstep:
    """The planner (`redistribute.symbolic_steps`) on a chunk of pairs in lockstep.

    Its arrays hold the pairs still moving only (finished ones are dropped once they are half of them), one
    row a pair, one column a dimension; a round takes one step for every pair (`round`) and updates only the
    cells its step touched (`_touch`). Each step is fused into the pair's open one where the planner's
    `_merge` would (`_step`), and a finished step adds its (latency, per byte) to the pair's sums.
    """

    def __init__(self, table: LayoutTable, src: np.ndarray, dst: np.ndarray, cost: CostModel) -> None:
        count = len(src)
        self.table, self.dst, self.prices = table, dst, _Prices.of(cost)
        self.length, self.code = table.length[src].copy(), table.code[src].copy()
        self.want_length, self.want_code = table.length[dst].copy(), table.code[dst].copy()
        self.partial = table.partial[src].copy()
        self.prefix, self.wanted = _status(self.length, self.code, self.want_length, self.want_code)
        self.total = self.length.sum(axis=1)
        self.width = self.length.shape[1]
        self.pair = np.arange(count)
        # the open (not yet finished) fused step of every pair
        self.open_kind = np.full(count, -1, dtype=np.int64)
        self.open_dim = np.zeros(count, dtype=np.int64)
        self.open_mask = np.zeros(count, dtype=np.int64)
        self.open_shift = np.zeros(count, dtype=np.int64)
        self.sums = (np.zeros(count), np.zeros(count))  # latency, per byte
        self.alive = np.ones(count, dtype=bool)
        self.wrong = (~self.prefix).sum(axis=1)  # per pair: dimensions whose bits are not a prefix of the target's
        self.grows = (self.wanted >= 0).sum(axis=1)  # per pair: dimensions still to extend

    def run(self) -> tuple[np.ndarray, np.ndarray]:
        """Every pair's (latency, seconds per byte of the whole tensor)."""
        while len(self.pair):
            settled = self.wrong == 0
            # 1. bits where the target does not want them: the longest run of the last ones another dim wants
            # next, in order, moves there by one AllToAll (`redistribute._moving_run`); else the last is gathered
            self._move_misplaced(np.flatnonzero(~settled))  # a finished pair is settled
            # 2. every dimension holds a prefix of its target: extend the first one still growing
            extend = settled & (self.grows > 0)  # a finished pair wants nothing more
            self._extend(np.flatnonzero(extend))
            # 3. done: finish the open step, then AllReduce whatever is still partial; drop the pair
            self._finish(np.flatnonzero(settled & ~extend & self.alive))
        return self.sums

    def _emit(self, rows: np.ndarray, kind: np.ndarray, mask: np.ndarray, shift: np.ndarray) -> None:
        """Add finished steps (one per row) in order."""
        where = self.pair[rows]
        latency, per_byte = self.prices.look_up(kind, mask)
        self.sums[0][where] += latency
        self.sums[1][where] += per_byte * np.ldexp(1.0, -shift)

    def _close(self, rows: np.ndarray) -> None:
        rows = rows[self.open_kind[rows] >= 0]
        if len(rows):
            self._emit(rows, self.open_kind[rows], self.open_mask[rows], self.open_shift[rows])

    def _step(self, rows: np.ndarray, kind: np.ndarray, dim: np.ndarray, mask: np.ndarray, shift: np.ndarray) -> None:
        """One step per row over the bits of ``mask`` (one bit, or an AllToAll's run): fused into the
        open step, or that one finished and this one opened."""
        fuse = (self.open_kind[rows] == kind) & (self.open_dim[rows] == dim) & _MERGEABLE[kind]
        fresh = rows[~fuse]
        self._close(fresh)
        self.open_kind[fresh] = kind[~fuse]
        self.open_dim[fresh] = dim[~fuse]
        self.open_mask[fresh] = mask[~fuse]
        self.open_shift[fresh] = shift[~fuse]
        fused = rows[fuse]
        self.open_mask[fused] |= mask[fuse]
        self.open_shift[fused] = np.minimum(self.open_shift[fused], shift[fuse])

    def _touch(self, rows: np.ndarray, dim: np.ndarray) -> None:
        """Recompute one cell per row after its bits changed, and the row's counts of wrong and growing dims."""
        cell = rows * self.width + dim  # flat indices: a 1-D gather per array, cheaper than a 2-D advanced index
        flat_prefix, flat_wanted = _cells(self.prefix), _cells(self.wanted)
        was_prefix, was_growing = flat_prefix[cell], flat_wanted[cell] >= 0
        now_prefix, now_wanted = _status(
            _cells(self.length)[cell],
            _cells(self.code)[cell],
            _cells(self.want_length)[cell],
            _cells(self.want_code)[cell],
        )
        flat_prefix[cell], flat_wanted[cell] = now_prefix, now_wanted
        self.wrong[rows] += was_prefix.astype(np.int64) - now_prefix
        self.grows[rows] += (now_wanted >= 0).astype(np.int64) - was_growing

    def _moving_runs(
        self, rows: np.ndarray, dim: np.ndarray, held_length: np.ndarray, held: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """`redistribute._moving_run` for these rows: how many of dim ``dim``'s last bits (``held``,
        ``held_length`` of them) move in one AllToAll (0: none, the last is gathered) and to which dim.

        The place the target layout gives the last bit fixes the only candidate run; one comparison of packed
        codes checks it. Only the cells read are gathered, never whole rows."""
        last = (held & np.uint64(15)).astype(np.int64)
        where, place = self.table.places()
        targets = self.dst[self.pair[rows]]
        target, position = where[targets, last], place[targets, last]
        into = np.maximum(target, 0)
        cell = rows * self.width + into
        runs = position + 1 - _cells(self.length)[cell]
        fits = (target >= 0) & (target != dim) & _cells(self.prefix)[cell] & (runs >= 1) & (runs <= held_length)
        low = _low_nibbles(np.maximum(runs, 0))
        wants = _drop(_cells(self.want_code)[cell], np.maximum(_cells(self.want_length)[cell] - position - 1, 0))
        fits &= (wants & low) == (held & low)
        return np.where(fits, runs, 0), into

    def _move_misplaced(self, rows: np.ndarray) -> None:
        """Round step 1 for these rows: the first wrong dimension's run of last bits moves by one AllToAll
        where another dim wants it next, else its last bit is gathered (and the gathers after, `_gather_on`)."""
        if not len(rows):
            return
        d = np.argmax(~self.prefix[rows], axis=1)
        cell = rows * self.width + d
        flat_length, flat_code = _cells(self.length), _cells(self.code)
        held_length, held = flat_length[cell], flat_code[cell]
        runs, target = self._moving_runs(rows, d, held_length, held)
        moved = runs > 0
        popped = np.maximum(runs, 1)
        run = held & _low_nibbles(popped)
        mask = np.zeros(len(rows), dtype=np.int64)
        for j in range(int(popped.max())):
            nibble = ((run >> np.uint64(_NIBBLE * j)) & np.uint64(15)).astype(np.int64)
            mask |= np.where(j < popped, np.int64(1) << nibble, 0)
        shift = np.where(moved, self.total[rows], self.total[rows] - 1)
        flat_length[cell] -= popped
        flat_code[cell] = _drop(held, popped)
        self._touch(rows, d)
        to, into, many = rows[moved], target[moved], runs[moved]
        cell = to * self.width + into
        flat_length[cell] += many
        flat_code[cell] = (flat_code[cell] << (many * _NIBBLE).astype(np.uint64)) | run[moved]
        self._touch(to, into)
        self.total[rows[~moved]] -= 1
        self._step(rows, np.where(moved, _A2A, _AG), np.where(moved, target, d), mask, shift)
        self._gather_on(rows[~moved], d[~moved])

    def _gather_on(self, rows: np.ndarray, dim: np.ndarray) -> None:
        """Rows that just gathered the last bit of ``dim``: while that dim is still wrong and its new last bit
        moves nowhere, gather it too, fused into the open step, as the rounds after would (most of a
        redistribution's first steps are such runs of gathers)."""
        flat_length, flat_code, flat_prefix = _cells(self.length), _cells(self.code), _cells(self.prefix)
        while len(rows):
            cell = rows * self.width + dim
            wrong_still = ~flat_prefix[cell]
            rows, dim, cell = rows[wrong_still], dim[wrong_still], cell[wrong_still]
            if not len(rows):
                return
            held = flat_code[cell]
            runs, _ = self._moving_runs(rows, dim, flat_length[cell], held)
            gathers = runs == 0
            rows, dim, cell, held = rows[gathers], dim[gathers], cell[gathers], held[gathers]
            if not len(rows):
                return
            bit = (held & np.uint64(15)).astype(np.int64)
            flat_length[cell] -= 1
            flat_code[cell] = held >> np.uint64(_NIBBLE)
            self._touch(rows, dim)
            self.total[rows] -= 1
            self._step(rows, np.full(len(rows), _AG), dim, np.int64(1) << bit, self.total[rows])

    def _extend(self, rows: np.ndarray) -> None:
        """Round step 2 for these rows: the first dimension still growing takes the run of its next wanted bits
        that are all partial (ReduceScatter) or all not (slice): one step, as the planner's one-bit steps of
        that run fuse into."""
        if not len(rows):
            return
        d = np.argmax(self.wanted[rows] >= 0, axis=1)
        cell = rows * self.width + d
        bit = _cells(self.wanted)[cell]
        held = self.partial[rows]
        reduces = (held >> bit) & 1 == 1
        flat_length, flat_code = _cells(self.length), _cells(self.code)
        room = _cells(self.want_length)[cell] - flat_length[cell]  # bits still wanted, the first being ``bit``
        target = _cells(self.want_code)[cell]
        many = np.ones(len(rows), dtype=np.int64)
        mask = np.int64(1) << bit
        going = room > 1
        for j in range(1, int(room.max())):
            going &= j < room
            after = ((target >> (np.maximum(room - 1 - j, 0) * _NIBBLE).astype(np.uint64)) & np.uint64(15)).astype(
                np.int64
            )
            going &= ((held >> after) & 1 == 1) == reduces
            if not going.any():
                break
            many += going
            mask |= np.where(going, np.int64(1) << after, 0)
        self.partial[rows] = np.where(reduces, held & ~mask, held)
        shift = self.total[rows].copy()
        flat_length[cell] += many
        flat_code[cell] = _drop(target, room - many)  # the target's bits so far: the held ones are its prefix
        self._touch(rows, d)
        self.total[rows] += many
        self._step(rows, np.where(reduces, _RS, _SLICE), d, mask, shift)

    def _finish(self, rows: np.ndarray) -> None:
        """Round step 3 for these rows: close the open step, AllReduce what is still partial, retire the pair
        (the arrays shrink once the retired are half of them: copying costs too)."""
        if not len(rows):
            return
        self._close(rows)
        reducing = rows[self.partial[rows] != 0]
        if len(reducing):
            self._emit(reducing, np.full(len(reducing), _AR), self.partial[reducing], self.total[reducing])
        self.alive[rows] = False
        self.open_kind[rows] = -1
        if self.alive.sum() > len(self.alive) // 2:
            return
        keep = self.alive
        for name in (
            "alive",
            "length",
            "code",
            "want_length",
            "want_code",
            "partial",
            "prefix",
            "wanted",
            "total",
            "pair",
            "wrong",
            "grows",
            "open_kind",
            "open_dim",
            "open_mask",
            "open_shift",
        ):
            setattr(self, name, getattr(self, name)[keep])


def _chunk_coefficients(
    table: LayoutTable, src: np.ndarray, dst: np.ndarray, cost: CostModel
) -> tuple[np.ndarray, np.ndarray]:
    """The planner on a chunk of pairs in lockstep (`_Lockstep`)."""
    return _Lockstep(table, src, dst, cost).run()


class _Prices:
    """(latency, per byte) of every collective kind over every bit mask, by table look-up.

    A collective's coefficients depend only on how many of its bits fall in each link level
    (`CostModel.collective_coefficients`), so one cost-model call per kind and per count
    vector fills a small dense table; a mask is turned into its counts with popcounts.
    """

    def __init__(self, cost: CostModel) -> None:
        profile = cost.profile
        names: list[str] = []
        level_of: list[int] = []
        for bit in range(64):
            name = profile.level_of_bit(bit).name
            if name not in names:
                names.append(name)
            level_of.append(names.index(name))
        self.masks = np.array(
            [sum(1 << b for b in range(64) if level_of[b] == level and b < 63) for level in range(len(names))],
            dtype=np.int64,
        )
        self.radix = MAX_MESH_BITS + 1  # bits per level: 0..16
        self.levels = len(names)
        self.level_of = level_of
        self.cost = cost
        size = len(KINDS) * self.radix**self.levels
        self.latency = np.full(size, np.nan)
        self.per_byte = np.full(size, np.nan)

    @classmethod
    def of(cls, cost: CostModel) -> "_Prices":
        """The prices the plan under way has looked up on this cost model (`autopar.context`)."""
        return context.current().for_cost_model("prices", cost, cls)

    def look_up(self, kind: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        key = kind.astype(np.int64)
        for level in range(self.levels):
            key = key * self.radix + np.bitwise_count(mask & self.masks[level]).astype(np.int64)
        latency = self.latency[key]
        missing = np.isnan(latency)
        if missing.any():
            self.fill(np.unique(key[missing]))
            latency = self.latency[key]
        return latency, self.per_byte[key]

    def filled(self) -> "_Prices":
        """These prices with every key a mesh of up to `MAX_MESH_BITS` bits can ask priced (a few hundred), so
        the compiled planner, which cannot price a key itself, seldom meets one unpriced."""
        if not self.__dict__.get("_filled"):
            bits = self.level_of[:MAX_MESH_BITS]
            per_level = [bits.count(level) for level in range(self.levels)]
            keys = np.arange(len(KINDS))
            for level in range(self.levels):
                keys = (keys[:, None] * self.radix + np.arange(per_level[level] + 1)).reshape(-1)
            self.fill(keys[np.isnan(self.latency[keys])])
            self.__dict__["_filled"] = True
        return self

    def fill(self, keys: np.ndarray) -> None:
        """Price these keys (kind, then bits per level, as `look_up` makes them) into the tables."""
        for k in keys.tolist():
            self.latency[k], self.per_byte[k] = self._price(k)

    def _price(self, key: int) -> tuple[float, float]:
        counts = []
        for _ in range(self.levels):
            key, count = divmod(key, self.radix)
            counts.append(count)
        counts.reverse()
        bits: list[int] = []  # the lowest bits of each level: any bits with these counts price the same
        for level, count in enumerate(counts):
            bits += [b for b in range(64) if self.level_of[b] == level][:count]
        return self.cost.collective_coefficients(KINDS[key], tuple(sorted(bits, reverse=True)))
