"""The compiled kernels `autopar.search.native` calls (numba, imported only where it is installed).

Each is the plain loop of what its numpy counterpart computes, in the same order of operations, so the
results are the same to the last bit; `native` says what each is for. A kernel's parameters are the arrays
it reads and writes, one each: numba compiles functions of arrays, not of the values that hold them, so a
kernel's parameter list is as long as its data (`tests/test_shape.py` exempts this module for that).
"""

from __future__ import annotations

import numba
import numpy as np

_AG, _RS, _A2A, _AR, _SLICE = range(5)  # `coefficients.KINDS`, in its order
_BITS_PER_CODE = 4  # `coefficients._NIBBLE`: a dimension's bits packed four bits each, the first highest
_jit = numba.njit(cache=True, nogil=True)
_inlined = numba.njit(cache=True, nogil=True, inline="always")  # a helper of a hot loop (numba calls a `_jit` one)


@_jit
def sum_min_two(a: np.ndarray, b: np.ndarray, out: np.ndarray, first: int, last: int) -> None:
    """Rows ``first`` .. ``last`` of out[i, j, l] = min_k a[i, j, l, k] + b[i, j, l, k]: two 4-D tables broadcast
    to one shape (views whose broadcast axes have stride 0), as `dp._add_min` sums them, without the sum held.
    Four entries of the third axis run side by side, each its own minimum (as `min_plus_rows` runs rows)."""
    _, columns, middle, depth = a.shape
    for i in range(first, last):
        for j in range(columns):
            m = 0
            while m + 4 <= middle:
                x0, x1, x2, x3 = a[i, j, m], a[i, j, m + 1], a[i, j, m + 2], a[i, j, m + 3]
                y0, y1, y2, y3 = b[i, j, m], b[i, j, m + 1], b[i, j, m + 2], b[i, j, m + 3]
                l0 = l1 = l2 = l3 = np.inf
                for k in range(depth):
                    v = x0[k] + y0[k]
                    l0 = v if v < l0 else l0
                    v = x1[k] + y1[k]
                    l1 = v if v < l1 else l1
                    v = x2[k] + y2[k]
                    l2 = v if v < l2 else l2
                    v = x3[k] + y3[k]
                    l3 = v if v < l3 else l3
                out[i, j, m], out[i, j, m + 1], out[i, j, m + 2], out[i, j, m + 3] = l0, l1, l2, l3
                m += 4
            while m < middle:
                x, y = a[i, j, m], b[i, j, m]
                least = np.inf
                for k in range(depth):
                    v = x[k] + y[k]
                    least = v if v < least else least
                out[i, j, m] = least
                m += 1


@_jit
def sum_min_three(a: np.ndarray, b: np.ndarray, c: np.ndarray, out: np.ndarray, first: int, last: int) -> None:
    """`sum_min_two` of three tables, each entry (a + b) + c, the order numpy's sum takes."""
    _, columns, middle, depth = a.shape
    for i in range(first, last):
        for j in range(columns):
            m = 0
            while m + 4 <= middle:
                x0, x1, x2, x3 = a[i, j, m], a[i, j, m + 1], a[i, j, m + 2], a[i, j, m + 3]
                y0, y1, y2, y3 = b[i, j, m], b[i, j, m + 1], b[i, j, m + 2], b[i, j, m + 3]
                z0, z1, z2, z3 = c[i, j, m], c[i, j, m + 1], c[i, j, m + 2], c[i, j, m + 3]
                l0 = l1 = l2 = l3 = np.inf
                for k in range(depth):
                    v = (x0[k] + y0[k]) + z0[k]
                    l0 = v if v < l0 else l0
                    v = (x1[k] + y1[k]) + z1[k]
                    l1 = v if v < l1 else l1
                    v = (x2[k] + y2[k]) + z2[k]
                    l2 = v if v < l2 else l2
                    v = (x3[k] + y3[k]) + z3[k]
                    l3 = v if v < l3 else l3
                out[i, j, m], out[i, j, m + 1], out[i, j, m + 2], out[i, j, m + 3] = l0, l1, l2, l3
                m += 4
            while m < middle:
                x, y, z = a[i, j, m], b[i, j, m], c[i, j, m]
                least = np.inf
                for k in range(depth):
                    v = (x[k] + y[k]) + z[k]
                    least = v if v < least else least
                out[i, j, m] = least
                m += 1


_TILE = 256  # columns of a min-plus product computed at once: a band of ``b_t`` that stays in the first-level cache
_ROWS = 8  # rows of ``a`` that share each band of ``b_t`` loaded
_STEPS = 8  # summed indices taken per pass over a band: each entry's running minimum is read and written once per eight


@_inlined
def _steps(k: int, end: int) -> tuple[int, int, int, int, int, int, int, int]:
    """The `_STEPS` summed indices a pass from ``k`` takes: past the last (``end``) it takes that again."""
    return (
        k,
        min(k + 1, end),
        min(k + 2, end),
        min(k + 3, end),
        min(k + 4, end),
        min(k + 5, end),
        min(k + 6, end),
        min(k + 7, end),
    )


@_inlined
def _band(b_t: np.ndarray, steps: tuple[int, ...], left: int, right: int) -> tuple[np.ndarray, ...]:
    """Rows ``steps`` of ``b_t``, columns ``left`` .. ``right``."""
    return (
        b_t[steps[0], left:right],
        b_t[steps[1], left:right],
        b_t[steps[2], left:right],
        b_t[steps[3], left:right],
        b_t[steps[4], left:right],
        b_t[steps[5], left:right],
        b_t[steps[6], left:right],
        b_t[steps[7], left:right],
    )


@_inlined
def _taken(row: np.ndarray, steps: tuple[int, ...]) -> tuple[float, ...]:
    """Entries ``steps`` of a row of ``a``."""
    return (
        row[steps[0]],
        row[steps[1]],
        row[steps[2]],
        row[steps[3]],
        row[steps[4]],
        row[steps[5]],
        row[steps[6]],
        row[steps[7]],
    )


@_inlined
def _plus(x: tuple[float, ...], y: tuple[float, ...]) -> tuple[float, ...]:
    """Two passes' values added entry by entry."""
    return (x[0] + y[0], x[1] + y[1], x[2] + y[2], x[3] + y[3], x[4] + y[4], x[5] + y[5], x[6] + y[6], x[7] + y[7])


@_inlined
def _row_summed(
    summed: np.ndarray, row: np.ndarray, plus: np.ndarray, more: bool, added: float, add: bool
) -> np.ndarray:
    """``summed`` holding ``row`` plus ``plus`` (where ``more``), then ``added`` (where ``add``), entry by entry."""
    for j in range(summed.size):
        value = row[j] + plus[j] if more else row[j]
        summed[j] = value + added if add else value
    return summed


@_inlined
def _band_summed(
    b_t: np.ndarray,
    plus: np.ndarray,
    more: bool,
    added: np.ndarray,
    add: bool,
    steps: tuple[int, ...],
    left: int,
    right: int,
    summed: np.ndarray,
) -> tuple[np.ndarray, ...]:
    """`_band` of ``b_t`` plus ``plus`` (where ``more``), then ``added`` (a vector over k, where ``add``), made in
    ``summed`` (`_STEPS` rows of `_TILE`)."""
    width = right - left
    for q in range(_STEPS):
        step = steps[q]
        _row_summed(summed[q, :width], b_t[step, left:right], plus[step, left:right], more, added[step], add)
    return _band(summed, _steps(0, _STEPS - 1), 0, width)


@_inlined
def _lowered(taken: tuple[float, ...], band: tuple[np.ndarray, ...], least: np.ndarray) -> None:
    """Each entry of ``least`` (a row's running minima over a band of columns) lowered to its `_STEPS` sums
    ``taken[q] + band[q][j]``, taken in order in registers."""
    for j in range(least.size):
        w = least[j]
        for q in range(_STEPS):
            v = taken[q] + band[q][j]
            w = v if v < w else w
        least[j] = w


@_jit
def min_plus_rows(a: np.ndarray, b_t: np.ndarray, out: np.ndarray, first: int, last: int) -> None:
    """Rows ``first`` .. ``last`` of out[i, j] = min_k a[i, k] + b_t[k, j] (``a`` and ``b_t`` C-contiguous).

    Columns run innermost, so each step is element-wise over contiguous columns (``v if v < w else w``
    is one vector minimum), a band of `_TILE` columns and `_ROWS` rows of ``a`` at a time. Each entry's
    running minimum is read, taken over `_STEPS` values of k in registers (the compiler unrolls that loop
    of a fixed count), and written back: a minimum stored where it was read (``m[j] = v if v < m[j] else
    m[j]``, one k at a time) compiles to a masked store, which AMD's Zen cores run as microcode (1.9 G
    entries a second on a Zen 3 core, where this takes 10). Each entry is one addition, as numpy's
    broadcast sum makes it, and its minimum is taken over k in ascending order, so every bit is the same;
    past the last k a step repeats it, which changes nothing (a minimum only moves to a smaller value)."""
    depth, columns = b_t.shape
    for top in range(first, last, _ROWS):
        bottom = min(last, top + _ROWS)
        for left in range(0, columns, _TILE):
            right = min(columns, left + _TILE)
            for i in range(top, bottom):
                out[i, left:right] = np.inf
            for k in range(0, depth, _STEPS):
                steps = _steps(k, depth - 1)
                band = _band(b_t, steps, left, right)
                for i in range(top, bottom):
                    _lowered(_taken(a[i], steps), band, out[i, left:right])


@_jit
def min_plus_rows_summed(
    a: np.ndarray,
    a_plus: np.ndarray,
    b_t: np.ndarray,
    b_plus_t: np.ndarray,
    added: np.ndarray,
    on_rows: bool,
    out: np.ndarray,
    first: int,
    last: int,
) -> None:
    """`min_plus_rows` of the two tables `dp._merge_parts` makes of an elimination step's parts, made as it goes:
    ``a`` plus ``a_plus`` (a second table over the same axes; one of no entries: none), then ``added`` (the
    node's own costs, a vector over k; empty: none) where ``on_rows``; ``b_t`` plus ``b_plus_t``, then ``added``
    where not. Each sum is the merge's, in its order ((a[i, k] + a_plus[i, k]) + added[k], and so for ``b_t``),
    so the minima are the same; the merged tables are not made. Where ``b_t`` takes a term, each band's sums are
    made once in a band of their own and read by its `_ROWS` rows. The loops are `min_plus_rows`'s, written
    again: that kernel choosing its band and its row's values on each pass, as this one does, ran 8 % slower."""
    depth, columns = b_t.shape
    rows_more, columns_more = a_plus.size > 0, b_plus_t.size > 0
    rows_added, columns_added = added.size > 0 and on_rows, added.size > 0 and not on_rows
    a_plus = a_plus if rows_more else a  # (read only where there is one)
    b_plus_t = b_plus_t if columns_more else b_t
    added = added if added.size else np.zeros(depth)  # (read only where there are costs)
    summed = np.empty((_STEPS, _TILE))
    for top in range(first, last, _ROWS):
        bottom = min(last, top + _ROWS)
        for left in range(0, columns, _TILE):
            right = min(columns, left + _TILE)
            for i in range(top, bottom):
                out[i, left:right] = np.inf
            for k in range(0, depth, _STEPS):
                steps = _steps(k, depth - 1)
                if columns_more or columns_added:
                    band = _band_summed(b_t, b_plus_t, columns_more, added, columns_added, steps, left, right, summed)
                else:
                    band = _band(b_t, steps, left, right)
                for i in range(top, bottom):
                    taken = _taken(a[i], steps)
                    if rows_more:
                        taken = _plus(taken, _taken(a_plus[i], steps))
                    if rows_added:
                        taken = _plus(taken, _taken(added, steps))
                    _lowered(taken, band, out[i, left:right])


@_jit
def min_plus_argmin(a: np.ndarray, b_t: np.ndarray, out: np.ndarray, arg: np.ndarray, first: int, last: int) -> None:
    """`min_plus_rows` with ``arg[i, j]`` the first k at the minimum (numpy's argmin: the first, and 0 where
    every sum is infinite): a k replaces the running one only where its sum is strictly smaller, so a repeated
    last k changes neither."""
    depth, columns = b_t.shape
    for top in range(first, last, _ROWS):
        bottom = min(last, top + _ROWS)
        for left in range(0, columns, _TILE):
            right = min(columns, left + _TILE)
            for i in range(top, bottom):
                out[i, left:right] = np.inf
                arg[i, left:right] = 0
            for k in range(0, depth, _STEPS):
                steps = _steps(k, depth - 1)
                band = _band(b_t, steps, left, right)
                for i in range(top, bottom):
                    taken, least, where = _taken(a[i], steps), out[i, left:right], arg[i, left:right]
                    for j in range(right - left):
                        w, at = least[j], where[j]
                        for q in range(_STEPS):
                            v = taken[q] + band[q][j]
                            w, at = (v, steps[q]) if v < w else (w, at)
                        least[j], where[j] = w, at


@_jit
def _popcount(value: int) -> int:
    count = 0
    while value:
        value &= value - 1
        count += 1
    return count


@_jit
def _price_key(kind: int, mask: int, level_masks: np.ndarray, radix: int) -> int:
    """`coefficients._Prices.look_up`'s key: the kind, then the bits of ``mask`` in each link level."""
    key = kind
    for level in range(len(level_masks)):
        key = key * radix + _popcount(mask & level_masks[level])
    return key


@_inlined
def _price(
    kind: int, mask: int, shift: int, level_masks: np.ndarray, radix: int, latency: np.ndarray, per_byte: np.ndarray
) -> tuple[int, float, float]:
    """A fused step's price key, latency (NaN: not in the tables) and seconds per byte of the whole tensor, the
    step moving a 2**-``shift`` share of it (an exact power of two, as `numpy.ldexp` scales it, only faster)."""
    key = _price_key(kind, mask, level_masks, radix)
    return key, latency[key], per_byte[key] * (1.0 / (np.int64(1) << shift))


@_inlined
def _closed(
    state: tuple[int, int, int, int],
    sums: tuple[float, float],
    level_masks: np.ndarray,
    radix: int,
    latency: np.ndarray,
    per_byte: np.ndarray,
) -> tuple[tuple[float, float], int]:
    """The sums with the open step priced (none open: as they are), and the key of a price not in the tables (else
    -1)."""
    kind, _, mask, shift = state
    if kind < 0:
        return sums, -1
    key, price, per = _price(kind, mask, shift, level_masks, radix, latency, per_byte)
    if np.isnan(price):
        return sums, key
    return (sums[0] + price, sums[1] + per), -1


@_inlined
def _fused(
    state: tuple[int, int, int, int],
    sums: tuple[float, float],
    step: tuple[int, int, int, int],
    level_masks: np.ndarray,
    radix: int,
    latency: np.ndarray,
    per_byte: np.ndarray,
) -> tuple[tuple[int, int, int, int], tuple[float, float], int]:
    """A step taken after the open one (`redistribute._merge`): fused into it where both are of one kind on one
    dimension (an AllToAll never is: each moves its own run), else the open one priced and this one open; the key
    of a price not in the tables (else -1)."""
    kind, dim, mask, shift = step
    if state[0] == kind and state[1] == dim and kind != _A2A:
        return (kind, dim, state[2] | mask, min(state[3], shift)), sums, -1
    sums, key = _closed(state, sums, level_masks, radix, latency, per_byte)
    return (step if key < 0 else state), sums, key


@_jit
def _drop(code: np.uint64, count: int) -> np.uint64:
    """A packed code without its last ``count`` bits (`coefficients._drop`)."""
    if count >= 16:
        return np.uint64(0)
    return code >> np.uint64(_BITS_PER_CODE * count)


@_jit
def _low(code: np.uint64, count: int) -> np.uint64:
    """The last ``count`` bits of a packed code."""
    if count >= 16:
        return code
    return code & ((np.uint64(1) << np.uint64(_BITS_PER_CODE * count)) - np.uint64(1))


@_jit
def _is_prefix(code: np.uint64, held: int, want_code: np.uint64, wanted: int) -> bool:
    """Whether the ``held`` bits packed in ``code`` are the first of the ``wanted`` ones in ``want_code``."""
    return held <= wanted and _drop(want_code, wanted - held) == code


@_jit
def pair_coefficients(
    length: np.ndarray,
    code: np.ndarray,
    partial: np.ndarray,
    where: np.ndarray,
    place: np.ndarray,
    src: np.ndarray,
    dst: np.ndarray,
    level_masks: np.ndarray,
    radix: int,
    latency: np.ndarray,
    per_byte: np.ndarray,
    out_latency: np.ndarray,
    out_per_byte: np.ndarray,
) -> None:
    """Each pair p: (latency, seconds per byte) of redistributing layout ``src[p]`` to
    ``dst[p]`` (rows of a `coefficients.LayoutTable`, with its `places`: ``where`` and ``place``), step for
    step as `redistribute.symbolic_steps` plans it and `redistribute._merge` fuses it, each step priced from
    the tables by kind and bits per link level (`coefficients._Prices`). A dimension's bits stay packed, as
    in the table, so a step is a few shifts. A pair that meets a price not in the tables stops with a latency
    of NaN and the price's key for its seconds per byte, to be priced and run again. A step never makes a
    dimension before the one it takes bits from stray from its target, so the first part resumes where it
    stopped, and once every dimension is a prefix of its target the rest only extends each in turn (half a
    large model's steps: a third less time than looking for the next step anew each time).

    Long, and with thirteen parameters, on purpose: numba compiles functions of arrays, not objects, so the
    layout table, its places and the prices pass as the arrays they are, and the planner's rounds for one
    pair stay in one loop body, as `coefficients._chunk_coefficients` writes them for numpy."""
    width = length.shape[1]
    held = np.zeros(width, dtype=np.int64)
    current = np.zeros(width, dtype=np.uint64)
    for p in range(len(src)):
        s, t = src[p], dst[p]
        total = 0
        for d in range(width):
            held[d] = length[s, d]
            current[d] = code[s, d]
            total += held[d]
        left = partial[s]
        state, sums = (-1, 0, 0, 0), (0.0, 0.0)  # the step still open (kind, dimension, mask, shift); the sums
        lack = -1  # the key of a price not in the tables
        d = 0
        while d < width:  # 1. a bit where the target does not want it: an AllToAll's run, or gathered
            if _is_prefix(current[d], held[d], code[t, d], length[t, d]):
                d += 1  # (a step keeps every dimension before the one it takes from a prefix of its target)
                continue
            bit = int(current[d] & np.uint64(15))
            target, at = where[t, bit], place[t, bit]
            count = 0
            if target >= 0 and target != d:
                have = held[target]
                run = at + 1 - have
                wanted = length[t, target]
                if (
                    1 <= run <= held[d]
                    and _is_prefix(current[target], have, code[t, target], wanted)
                    and _low(_drop(code[t, target], wanted - at - 1), run) == _low(current[d], run)
                ):
                    count = run
            if count > 0:
                moved = _low(current[d], count)
                kind, dim, mask, shift = _A2A, target, 0, total
                for q in range(count):
                    mask |= 1 << int((moved >> np.uint64(_BITS_PER_CODE * q)) & np.uint64(15))
                current[d] = _drop(current[d], count)
                current[target] = (current[target] << np.uint64(_BITS_PER_CODE * count)) | moved
                held[d] -= count
                held[target] += count
            else:
                current[d] = _drop(current[d], 1)
                held[d] -= 1
                total -= 1
                kind, dim, mask, shift = _AG, d, 1 << bit, total
            state, sums, lack = _fused(state, sums, (kind, dim, mask, shift), level_masks, radix, latency, per_byte)
            if lack >= 0:
                break
        grow = 0
        while lack < 0 and grow < width:  # 2. every dimension a prefix of its target: extend each in turn
            while lack < 0 and held[grow] < length[t, grow]:
                bit = int(_drop(code[t, grow], length[t, grow] - held[grow] - 1) & np.uint64(15))
                kind = _SLICE
                if (left >> bit) & 1:
                    left &= ~(1 << bit)
                    kind = _RS
                step = (kind, grow, 1 << bit, total)
                held[grow] += 1
                total += 1
                state, sums, lack = _fused(state, sums, step, level_masks, radix, latency, per_byte)
            grow += 1
        if lack < 0 and left:  # 3. the last fused step, then an AllReduce of what is still partial
            state, sums, lack = _fused(state, sums, (_AR, -1, left, total), level_masks, radix, latency, per_byte)
        if lack < 0:
            sums, lack = _closed(state, sums, level_masks, radix, latency, per_byte)
        out_latency[p], out_per_byte[p] = sums if lack < 0 else (np.nan, float(lack))


@_jit
def edge_tables(
    latency: np.ndarray,
    per_byte: np.ndarray,
    forward: np.ndarray,
    backward: np.ndarray,
    rows: np.ndarray,
    columns: np.ndarray,
    nbytes: float,
    out_forward: np.ndarray,
    out_both: np.ndarray,
    first: int,
    last: int,
) -> None:
    """Rows ``first`` .. ``last`` of a use's edge tables from its layout pairs' slots (`costing._edge_costs`),
    read through the places of its layouts in them (`coefficients.PairSlots.through`): ``out_forward[i, j]``
    = latency + per byte x ``nbytes`` of pair ``forward[rows[i], columns[j]]``, and ``out_both`` that plus
    the gradient's way back, pair ``backward[columns[j], rows[i]]``, the two coefficients summed first (where
    ``backward`` has no rows there is none, and ``out_both`` is not written). Eleven parameters: a compiled
    function takes its arrays one by one, and the rows it computes (a large use's are shared between threads)."""
    back = backward.shape[0] > 0
    for i in range(first, last):
        row = rows[i]
        for j in range(len(columns)):
            column = columns[j]
            slot = forward[row, column]
            there, rate = latency[slot], per_byte[slot]
            out_forward[i, j] = there + rate * nbytes
            if back:
                again = backward[column, row]
                out_both[i, j] = (there + latency[again]) + (rate + per_byte[again]) * nbytes


@_jit
def mark_slots(seen: np.ndarray, slots: np.ndarray, rows: np.ndarray, columns: np.ndarray) -> None:
    """``seen[slots[rows[i], columns[j]]] = True`` for every i and j: the pairs a group reads through the
    places of its layouts (`costing._distinct_pairs`), without copying them out first."""
    for i in range(len(rows)):
        row = rows[i]
        for j in range(len(columns)):
            seen[slots[row, columns[j]]] = True
