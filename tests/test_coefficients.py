"""The vectorised redistribution coefficients are the scalar planner's, to the last bit."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar.context import opened
from autopar.cost import CostModel
from autopar.layout import Layout
from autopar.redistribute import Collective
from autopar.search.coefficients import KeySet, LayoutTable, PairCache, PairSlots, _insert_sorted, pair_coefficients
from autopar.search.costing import redistribution_coefficients
from tests.conftest import profile


@st.composite
def layout_pairs(draw):
    bits = draw(st.sampled_from([1, 3, 6, 10, 16]))
    ndim = draw(st.integers(1, 4))

    def layout(partial_ok: bool) -> Layout:
        dims: list[list[int]] = [[] for _ in range(ndim)]
        partial = []
        for bit in draw(st.permutations(range(bits))):
            where = draw(st.integers(-2 if partial_ok else -1, ndim - 1))
            if where >= 0:
                dims[where].append(bit)
            elif where == -2:
                partial.append(bit)
        return Layout(tuple(tuple(d) for d in dims), tuple(partial))

    return bits, [(layout(True), layout(False)) for _ in range(draw(st.integers(1, 12)))]


@settings(max_examples=200, deadline=None)
@given(case=layout_pairs())
def test_vectorised_coefficients_equal_the_scalar_ones(case):
    _, pairs = case
    _assert_vectorised_equals_scalar(CostModel(profile()), pairs)


def _assert_vectorised_equals_scalar(cost: CostModel, pairs: list[tuple[Layout, Layout]]) -> tuple:
    """The pairs costed at once by `pair_coefficients` equal each costed by the scalar planner; the
    vectorised (latency, per-byte) arrays come back."""
    layouts = sorted({layout for pair in pairs for layout in pair})
    index = {layout: i for i, layout in enumerate(layouts)}
    src = np.array([index[a] for a, _ in pairs])
    dst = np.array([index[b] for _, b in pairs])
    got = pair_coefficients(LayoutTable.of(layouts), src, dst, cost)
    for k, (a, b) in enumerate(pairs):
        assert (got[0][k], got[1][k]) == redistribution_coefficients(cost, a, b)
    return got


def _moved_runs(bits: int) -> list[tuple[Layout, Layout]]:
    """Pairs where a run of one dim's last bits is wanted next by another dim, in order, reversed, or
    after bits the target keeps (each a different case of `redistribute._moving_run`), on ``bits`` mesh bits."""
    every = tuple(range(bits - 1, -1, -1))
    half = len(every) // 2
    return [
        (Layout(((), every)), Layout((every, ()))),  # the whole run, in order: one AllToAll
        (Layout(((), every)), Layout((every[::-1], ()))),  # reversed: a bit at a time
        (Layout((every, ())), Layout((every[:half], every[half:]))),  # the first bits stay
        (Layout((every[half:], every[:half])), Layout(((), every))),  # appended after a kept prefix
        (Layout((every[half:], (), every[:half])), Layout(((), every[half:], ()))),  # moved and gathered
        (Layout(((), every)), Layout((every[:1], ()))),  # nobody wants the last bit: gathered first
    ]


@pytest.mark.parametrize("bits", [2, 3, 6, 16])
def test_runs_moved_by_one_all_to_all_cost_what_the_scalar_planner_says(bits):
    cost = CostModel(profile())
    got = _assert_vectorised_equals_scalar(cost, _moved_runs(bits))
    # the first pair is one AllToAll over every bit, of the local buffer (1/2^bits of the tensor)
    latency, per_byte = cost.collective_coefficients(Collective.ALL_TO_ALL, tuple(range(bits - 1, -1, -1)))
    assert (got[0][0], got[1][0]) == (latency, per_byte * 2.0**-bits)


def test_a_partial_target_is_refused():
    cost = CostModel(profile())
    layouts = [Layout(((0,),)), Layout(((),), partial=(0,))]
    with pytest.raises(ValueError, match="partial"):
        pair_coefficients(LayoutTable.of(layouts), np.array([0]), np.array([1]), cost)


@settings(max_examples=50, deadline=None)
@given(first=layout_pairs(), second=layout_pairs(), third=layout_pairs())
def test_a_pair_cache_gives_what_costing_each_pair_gives(first, second, third):
    """Tables costed through one cache (each reusing the pairs of those before where they meet, its new
    pairs merged into the keys held, into room left by the last) give the coefficients costing each table
    afresh gives."""
    cost = CostModel(profile())
    cache = PairCache()
    for _, pairs in (first, second, third, first):
        layouts = sorted({layout for pair in pairs for layout in pair})
        index = {layout: i for i, layout in enumerate(layouts)}
        table = LayoutTable.of(layouts)
        src = np.array([index[a] for a, _ in pairs])
        dst = np.array([index[b] for _, b in pairs])
        rows = [repr(layout).encode() for layout in layouts]
        slots = cache.slots_of(cache.numbers(rows), table, src, dst, cost)
        assert slots.dtype == np.int32 and cache.narrowed(slots) is slots  # 32 bits, as groups keep them: no copy
        got = [values[slots] for values in cache.values]
        want = pair_coefficients(table, src, dst, cost)
        assert all(np.array_equal(g, w) for g, w in zip(got, want))
    assert len(cache.keys) == len(np.unique(cache.keys))
    assert (np.diff(cache.keys) > 0).all()  # sorted, as its lookups need


def test_held_slots_widen_once_a_slot_passes_32_bits():
    """Slots past 2**31 - 1 (a cache of more pairs than that) widen the held ones to 64 bits, each beside its key,
    where writing them into the 32-bit buffer would wrap them."""
    cache = PairCache()
    cache.keys, cache.slots = np.array([10, 30], dtype=np.int64), np.array([0, 1], dtype=np.int32)
    cache._insert(np.array([20, 40], dtype=np.int64), np.array([2**31, 2**31 + 1], dtype=np.int64))
    assert cache.keys.tolist() == [10, 20, 30, 40]
    assert cache.slots.dtype == np.int64 and cache.slots.tolist() == [0, 2**31, 1, 2**31 + 1]


@settings(max_examples=200, deadline=None)
@given(keys=st.sets(st.integers(-1000, 1000), max_size=60), data=st.data(), band=st.integers(1, 8))
def test_inserting_into_sorted_keys_in_place_is_sorting_them_all(keys, data, band):
    """`_insert_sorted`, whatever its band (how many held entries move at a time), gives the keys sorted, each
    held and new entry beside its key (the slots move with the keys)."""
    ordered = sorted(keys)
    new = sorted(data.draw(st.sets(st.sampled_from(ordered), max_size=len(ordered))) if ordered else [])
    held = [k for k in ordered if k not in set(new)]
    buffer = np.array(held + [0] * (len(new) + data.draw(st.integers(0, 3))), dtype=np.int64)
    before = np.searchsorted(np.array(held, dtype=np.int64), np.array(new, dtype=np.int64))
    _insert_sorted(buffer, len(held), np.array(new, dtype=np.int64), before, band)
    assert buffer[: len(ordered)].tolist() == ordered


@settings(max_examples=100, deadline=None)
@given(keys=st.lists(st.integers(-(2**40), 2**40), max_size=50), dense=st.lists(st.integers(0, 200), max_size=200))
def test_distinct_is_numpy_s_unique_whether_keys_are_sparse_or_dense(keys, dense):
    for values in (keys, dense, keys + dense):
        array = np.asarray(values, dtype=np.int64)
        found = KeySet.of([array]).keys
        assert found.dtype == np.int64 and found.tolist() == np.unique(array).tolist()


@settings(max_examples=100, deadline=None)
@given(
    parts=st.lists(st.lists(st.integers(0, 700), max_size=120), min_size=1, max_size=4),
    sparse=st.lists(st.integers(0, 2**40), max_size=20),
)
def test_a_key_set_positions_keys_as_unique_and_searchsorted_do(parts, sparse):
    """Dense keys (flags counted a word at a time) and sparse ones (sorted) give numpy's answers."""
    for arrays in (
        [np.asarray(p, dtype=np.int64) for p in parts],
        [np.asarray(sparse + p, dtype=np.int64) for p in parts],
    ):
        found = KeySet.of(arrays)
        every = np.concatenate(arrays)
        unique = np.unique(every)
        assert found.keys.tolist() == unique.tolist()
        assert found.position(every).tolist() == np.searchsorted(unique, every).tolist()


@settings(max_examples=50, deadline=None)
@given(parts=st.lists(st.lists(st.integers(0, 1_000), min_size=70, max_size=300), min_size=1, max_size=3))
def test_dense_keys_listed_a_band_of_flags_at_a_time_are_numpy_s_unique(parts):
    """`KeySet.of` lists flagged keys a band at a time; with bands of 64 flags (up to sixteen of them here:
    seventy keys or more under a thousand are dense), the keys are numpy's `unique`, in the type given,
    and each is where `position` finds it."""
    from autopar.search import coefficients

    for dtype in (np.int32, np.int64):
        arrays = [np.asarray(part, dtype=dtype) for part in parts]
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(coefficients, "_FLAGS", 64)
            found = KeySet.of(arrays)
        every = np.concatenate(arrays)
        assert found.words is not None  # (flagged, not sorted)
        assert found.keys.dtype == dtype and found.keys.tolist() == np.unique(every).tolist()
        assert found.position(every).tolist() == np.searchsorted(found.keys, every).tolist()


def test_keys_within_sixteen_per_key_are_flagged_and_sparser_ones_sorted():
    keys = np.array([0, 63, 64, 65, 127, 200, 7, 7, *range(20)])  # 28 keys, the largest 200 < 16 x 28
    dense = KeySet.of([keys])
    assert dense.words is not None and dense.keys.tolist() == np.unique(keys).tolist()
    assert dense.position(np.array([200, 64, 0, 127])).tolist() == [24, 21, 0, 23]
    sparse = KeySet.of([np.array([5, 10_000])])  # 10,000 >= 16 x 2
    assert sparse.words is None and sparse.position(np.array([10_000, 5])).tolist() == [1, 0]


@settings(max_examples=50, deadline=None)
@given(case=layout_pairs(), data=st.data())
def test_a_group_among_a_kept_one_takes_the_slots_looking_its_pairs_up_gives(case, data):
    """A group of pairs whose layouts are all among a kept group's takes its slots from it: the slots
    `slots_of` gives its pairs; one with a layout the kept group lacks is not taken from it."""
    _, pairs = case
    cost = CostModel(profile())
    cache = PairCache()
    sources = sorted({a for a, _ in pairs})
    targets = sorted({b for _, b in pairs})
    layouts = sorted({*sources, *targets})
    index = {layout: i for i, layout in enumerate(layouts)}
    table = LayoutTable.of(layouts)
    numbers = cache.numbers([repr(layout).encode() for layout in layouts])
    src_ids = np.array([index[a] for a in sources])
    dst_ids = np.array([index[b] for b in targets])
    grid = np.meshgrid(src_ids, dst_ids, indexing="ij")
    forward = cache.slots_of(numbers, table, grid[0].reshape(-1), grid[1].reshape(-1), cost).reshape(grid[0].shape)
    cache.keep("group", PairSlots(numbers[src_ids], numbers[dst_ids], forward, None))
    some_src = data.draw(st.lists(st.sampled_from(list(src_ids)), min_size=1, unique=True))
    some_dst = data.draw(st.lists(st.sampled_from(list(dst_ids)), min_size=1, unique=True))
    taken = cache.reused("group", numbers[some_src], numbers[some_dst])
    assert taken is not None
    rows, columns = np.meshgrid(some_src, some_dst, indexing="ij")
    assert np.array_equal(
        taken.forward_slots(),
        cache.slots_of(numbers, table, rows.reshape(-1), columns.reshape(-1), cost).reshape(rows.shape),
    )
    assert cache.reused("group", np.array([max(numbers) + 1]), numbers[some_dst]) is None
    assert cache.reused("another", numbers[some_src], numbers[some_dst]) is None


def test_a_problem_costed_after_another_has_the_tables_it_has_costed_alone():
    """Problems built one after another on one cost model (a smaller batch, fewer devices: their groups
    taken from the first's) have the tables, and count the layout pairs, each has built alone."""
    from autopar.graph import load_model
    from autopar.search.costing import build_problem
    from models.transformer import build_transformer

    def graph(batch: int):
        return load_model(build_transformer(kind="gpt", layers=2, hidden=64, heads=4, seq=32, batch=batch))

    shared = CostModel(profile())
    with opened():  # one plan: the later problems take the first's pairs (`autopar.context`)
        built = [build_problem(graph(batch), shared, devices) for batch, devices in ((16, 16), (4, 16), (8, 8))]
        assert PairCache.of(shared).groups  # the later problems had groups to take from
    for problem, (batch, devices) in zip(built, ((16, 16), (4, 16), (8, 8))):
        alone = build_problem(graph(batch), CostModel(profile()), devices)
        assert problem.pairs_costed == alone.pairs_costed and problem.layouts_costed == alone.layouts_costed
        assert len(problem.factors) == len(alone.factors)
        for mine, theirs in zip(problem.factors, alone.factors):
            assert mine.scope == theirs.scope and np.array_equal(mine.table, theirs.table)
        for (_, mine), (_, theirs) in zip(problem.folds, alone.folds):
            for f, g in zip((*mine.first, *mine.later), (*theirs.first, *theirs.later)):
                assert np.array_equal(f.table, g.table)


def test_a_problem_whose_groups_are_partly_kept_costs_only_the_others_and_has_its_tables_alone(monkeypatch):
    """Where some of a problem's edge groups are kept and others not, only the others' pairs are looked up
    (`_costed_slots` is given them alone), and the tables and counts are those it has built alone."""
    from autopar.graph import load_model
    from autopar.search import costing
    from autopar.search.costing import build_problem
    from models.transformer import build_transformer

    graph = load_model(build_transformer(kind="gpt", layers=2, hidden=64, heads=4, seq=32, batch=8))
    shared = CostModel(profile())
    with opened():  # one plan (`autopar.context`)
        build_problem(graph, shared, 8)
        cache = PairCache.of(shared)
        dropped = sorted(cache.groups, key=repr)[::3]  # a third of the groups no longer kept
        for name in dropped:
            del cache.groups[name]
        looked_up: list[tuple[int, int]] = []
        original = costing._costed_slots

        def costed_slots(flow, layouts, groups, names, cache, slots):
            looked_up.append((len(groups), len(slots)))
            return original(flow, layouts, groups, names, cache, slots)

        monkeypatch.setattr(costing, "_costed_slots", costed_slots)
        again = build_problem(graph, shared, 8)
        assert looked_up == [(len(dropped), len(cache.groups))]
    alone = build_problem(graph, CostModel(profile()), 8)
    assert again.pairs_costed == alone.pairs_costed and again.layouts_costed == alone.layouts_costed
    for mine, theirs in zip((*again.factors, *again.recompute_factors), (*alone.factors, *alone.recompute_factors)):
        assert mine.scope == theirs.scope and np.array_equal(mine.table, theirs.table)
    for (_, mine), (_, theirs) in zip(again.folds, alone.folds):
        for f, g in zip((*mine.first, *mine.later), (*theirs.first, *theirs.later)):
            assert np.array_equal(f.table, g.table)


def test_layouts_stripped_of_partial_bits_are_numbered_as_one_at_a_time_numbers_them():
    """`_Layouts.without` (a whole array at a time, a table per set of bits) gives each layout the number of
    the same layout less those bits (itself where it has none of them), numbering the new ones in the order
    they are first asked for, and the same numbers when asked again."""
    from autopar.graph import load_model
    from autopar.search import costing
    from models.transformer import build_transformer

    graph = load_model(build_transformer(kind="gpt", layers=2, hidden=64, heads=4, seq=32, batch=8))
    layouts = costing._planned(costing._Bound.of(graph, CostModel(profile()), 8, None), True, True).layouts
    every = np.arange(len(layouts.rows))
    partial = np.flatnonzero(layouts.partial(every))
    assert len(partial) > 4  # the model has layouts partial over some bits
    asked = np.concatenate([partial[::-1], partial[:3], every])
    for kept in (-1, 1, 2, 3):
        before = len(layouts.rows)
        found = layouts.without(asked, kept)
        for index, number in zip(asked.tolist(), found.tolist()):
            length, code, bits = layouts.rows[index]
            if not bits & kept:
                assert number == index
            stripped = layouts.rows[number]
            assert np.array_equal(stripped[0], length) and np.array_equal(stripped[1], code)
            assert stripped[2] == bits & ~kept
        new = [number for number in dict.fromkeys(found.tolist()) if number >= before]
        assert new == list(range(before, len(layouts.rows)))  # numbered in the order first asked for
        assert np.array_equal(layouts.without(asked, kept), found)  # again, from its table


def test_the_pairs_limit_counts_the_forward_pairs_alone(monkeypatch):
    """A problem is refused where its distinct forward layout pairs pass `MAX_LAYOUT_PAIRS`, saying how many;
    the gradient's ways back, which add pairs of their own, do not count."""
    from types import SimpleNamespace

    from autopar.errors import TooLargeError
    from autopar.search import costing

    flow = SimpleNamespace(num_devices=8)
    forward = [np.array([[1, 2], [2, 3]], dtype=np.int32), np.array([3, 2], dtype=np.int32)]
    backward = [np.array([[4, 5], [6, 7]], dtype=np.int32)]
    monkeypatch.setattr(costing, "MAX_LAYOUT_PAIRS", 3)
    assert costing._distinct_keys(flow, forward, backward).keys.tolist() == [1, 2, 3, 4, 5, 6, 7]
    monkeypatch.setattr(costing, "MAX_LAYOUT_PAIRS", 2)
    with pytest.raises(TooLargeError, match=r"^3 distinct redistributions between layouts .* on 8 devices"):
        costing._distinct_keys(flow, forward, backward)
