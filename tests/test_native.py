"""The compiled kernels give the numpy path's numbers, to the last bit (each is used only where numba is
installed; without it these tests are skipped and the numpy path is the one tested everywhere else)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings

from autopar.cost import CostModel
from autopar.graph import load_model
from autopar.layout import Layout
from autopar.search import coefficients, costing, dp, fold, native
from autopar.search.coefficients import LayoutTable, pair_coefficients
from autopar.search.costing import build_problem, redistribution_coefficients
from models.transformer import build_transformer
from tests.conftest import profile
from tests.test_coefficients import _moved_runs, layout_pairs

pytest.importorskip("numba")


@pytest.fixture
def numpy_path(monkeypatch):
    """A function that runs its argument with the kernels switched off (``AUTOPAR_NATIVE=0``)."""

    def run(work):
        with monkeypatch.context() as patch:
            patch.setenv("AUTOPAR_NATIVE", "0")
            assert not native.enabled()
            return work()

    return run


def test_the_kernels_are_on_where_numba_is_and_off_when_the_environment_says_so(monkeypatch):
    assert native.enabled()
    monkeypatch.setenv("AUTOPAR_NATIVE", "0")
    assert not native.enabled()


def test_smaller_work_goes_to_the_kernels_once_numba_is_imported(monkeypatch):
    """Before any work has paid for importing numba, only work of the threshold asked for goes to a kernel;
    once the kernels are imported, work from `native.LOADED` items does too, and never less."""
    import sys

    native.kernels()
    assert native.worth(native.LOADED, native.ENTRIES) and not native.worth(native.LOADED - 1, native.ENTRIES)
    monkeypatch.delitem(sys.modules, "autopar.search.native_jit")
    assert not native.worth(native.LOADED, native.ENTRIES) and native.worth(native.ENTRIES, native.ENTRIES)
    monkeypatch.setenv("AUTOPAR_NATIVE", "0")
    assert not native.worth(native.ENTRIES, native.ENTRIES)


def test_the_kernel_names_the_collective_kinds_as_the_numpy_planner_does():
    kernels = native.kernels()
    assert (kernels._AG, kernels._RS, kernels._A2A, kernels._AR, kernels._SLICE) == (
        coefficients._AG,
        coefficients._RS,
        coefficients._A2A,
        coefficients._AR,
        coefficients._SLICE,
    )
    assert kernels._BITS_PER_CODE == coefficients._NIBBLE


def _tables(rows: int, columns: int, depth: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Small integers (so many sums tie) with some infinite entries, as edge tables have."""
    rng = np.random.default_rng(seed)
    a = rng.integers(0, 40, (rows, depth)).astype(float)
    b = rng.integers(0, 40, (columns, depth)).astype(float)
    a[rng.random(a.shape) < 0.05] = np.inf
    b[rng.random(b.shape) < 0.05] = np.inf
    a[1 % rows] = np.inf  # a whole row infinite: its minima are infinite
    return a, b


# (21, 300, 9): rows past a block of eight and columns past a band (`native_jit._ROWS`, `_TILE`)
@pytest.mark.parametrize(("rows", "columns", "depth"), [(19, 23, 7), (8, 1, 5), (3, 30, 1), (64, 40, 33), (21, 300, 9)])
@pytest.mark.parametrize("rows_first", [True, False])
def test_a_two_table_elimination_step_compiled_is_numpy_s_bit_for_bit(
    monkeypatch, numpy_path, rows, columns, depth, rows_first
):
    a, b = _tables(rows, columns, depth, rows * columns)
    parts = [a[:, None, :], b[None, :, :]]
    parts = parts if rows_first else parts[::-1]
    assert dp._two_sided(parts)
    want = numpy_path(lambda: dp._sum_min(parts))
    monkeypatch.setattr(native, "ENTRIES", 1)  # every step compiled, however small
    got = dp._sum_min(parts)
    assert got.shape == want.shape == (rows, columns)
    assert np.array_equal(got, want)


def _fractions(rows: int, columns: int, depth: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Two tables and a vector over their summed axis of fractions spread over magnitudes (so how a sum of
    three associates changes its last bits), with some infinite entries."""
    rng = np.random.default_rng(seed)
    a, b = (rng.random(shape) * 10.0 ** rng.integers(-3, 4, shape) for shape in ((rows, depth), (columns, depth)))
    a[rng.random(a.shape) < 0.05] = np.inf
    b[rng.random(b.shape) < 0.05] = np.inf
    return a, b, rng.random(depth) * 10.0 ** rng.integers(-3, 4, depth)


@pytest.mark.parametrize(("rows", "columns", "depth"), [(19, 23, 7), (9, 300, 33), (21, 260, 9), (2, 2, 1)])
@pytest.mark.parametrize("on_rows", [True, False])
def test_the_min_plus_kernel_adding_a_vector_as_it_goes_is_the_kernel_over_the_sum_bit_for_bit(
    rows, columns, depth, on_rows
):
    kernels = native.kernels()
    a, b, added = _fractions(rows, columns, depth, rows + columns + depth)
    b_t = np.ascontiguousarray(b.T)
    summed_a, summed_b_t = (a + added, b_t) if on_rows else (a, np.ascontiguousarray(b_t + added[:, None]))
    want, got = np.empty((rows, columns)), np.empty((rows, columns))
    kernels.min_plus_rows(summed_a, summed_b_t, want, 0, rows)
    kernels.min_plus_rows_summed(a, np.empty((0, 0)), b_t, np.empty((0, 0)), added, on_rows, got, 0, rows)
    assert np.array_equal(got, want)
    other = (a[:, None, :] + (b[None, :, :] + added)) if on_rows else ((a[:, None, :] + added) + b[None, :, :])
    if depth > 1:  # (the sums associated the other way differ: the test tells the two apart)
        assert not np.array_equal(other.min(axis=2), want)


@pytest.mark.parametrize(("rows", "columns", "depth"), [(19, 23, 7), (40, 12, 30), (12, 40, 30), (13, 13, 5)])
@pytest.mark.parametrize("rows_first", [True, False])
@pytest.mark.parametrize("second", [None, "rows", "columns"])
def test_a_step_s_parts_summed_as_the_kernel_goes_give_the_merged_step_s_table_and_rows(
    monkeypatch, rows, columns, depth, rows_first, second
):
    a, b, added = _fractions(rows, columns, depth, rows * columns + depth)
    more, other, _ = _fractions(rows, columns, depth, depth)  # a second table over the rows' or the columns' axes
    parts = [a[:, None, :], b[None, :, :]]
    parts = parts if rows_first else parts[::-1]
    parts += {None: [], "rows": [more[:, None, :]], "columns": [other[None, :, :]]}[second]
    own = added.reshape(1, 1, depth)
    monkeypatch.setattr(native, "ENTRIES", 1)  # every step compiled, however small
    merged = dp._merge_parts([*parts, own])
    table, kept = dp._min_plus_added(parts, own)
    assert np.array_equal(table, dp._sum_min(merged))
    assert [part.shape for part in kept] == [part.shape for part in merged]
    for at in [(0, 0), (rows - 1, columns - 1), (rows // 2, 1)]:  # (a class of each axis: rows, then columns)
        assert np.array_equal(dp._at(kept[0], at) + dp._at(kept[1], at), dp._at(merged[0], at) + dp._at(merged[1], at))
    assert dp._min_plus_added([a[:1, None, :], b[None, :, :]], own) is None  # one class over its axis: merged
    assert dp._min_plus_added([*parts, a[:, None, :1]], own) is None  # a part over fewer axes: merged


@pytest.mark.parametrize("seed", range(4))
def test_a_chain_eliminated_with_its_costs_added_by_the_kernel_has_numpy_s_value_and_plan(
    monkeypatch, numpy_path, seed
):
    """A whole run and its read-back: each inner operator of a chain is a min-plus step with its own costs."""
    rng = np.random.default_rng(seed)
    sizes = [int(n) for n in rng.integers(3, 12, 6)]

    def spread(shape):
        return rng.random(shape) * 10.0 ** rng.integers(-3, 4, shape)

    factors = [
        dp.Factor((u, u + 1), (np.arange(sizes[u]), np.arange(sizes[u + 1])), spread((sizes[u], sizes[u + 1])))
        for u in range(len(sizes) - 1)
    ]
    unary = [spread(n) for n in sizes]
    ends = {0: 1, len(sizes) - 1: 2}  # kept: each inner operator is eliminated between two neighbours
    want = numpy_path(lambda: dp.Elimination(sizes, factors, keep=tuple(ends)).run(unary))
    original, added = dp._min_plus_added, []

    def counted(parts, own):
        found = original(parts, own)
        added.append(found is not None)
        return found

    monkeypatch.setattr(native, "ENTRIES", 1)  # every step compiled, however small
    monkeypatch.setattr(dp, "_min_plus_added", counted)
    got = dp.Elimination(sizes, factors, keep=tuple(ends)).run(unary)
    assert any(added)  # (the inner operators' steps took the kernel's sums)
    assert len(got.leftover) == len(want.leftover) > 0
    assert all(np.array_equal(g.table, w.table) for g, w in zip(got.leftover, want.leftover))
    assert got.backtrack(ends) == want.backtrack(ends)


def test_a_three_table_or_one_sided_step_keeps_the_numpy_path():
    a, b = _tables(4, 5, 3, 0)
    assert not dp._two_sided([a[:, None, :], b[None, :, :], a[:, None, :]])
    assert not dp._two_sided([a[:, None, :], a[:, None, :]])
    assert not dp._two_sided([a[:, None, :], b[None, :, :2]])


@pytest.mark.parametrize(("rows", "inner", "columns"), [(9, 13, 11), (1, 1, 1), (40, 64, 17), (21, 5, 300)])
def test_a_min_plus_product_compiled_has_numpy_s_minima_and_first_argmins(
    monkeypatch, numpy_path, rows, inner, columns
):
    a, b = _tables(rows, columns, inner, rows + inner)
    b = np.ascontiguousarray(b.T)  # (inner, columns): min_plus sums over a's columns and b's rows
    want = numpy_path(lambda: fold.min_plus(a, b))
    monkeypatch.setattr(native, "ENTRIES", 1)
    got = fold.min_plus(a, b)
    assert np.array_equal(got[0], want[0])
    assert np.array_equal(got[1], want[1])  # the first k at the minimum, 0 where every sum is infinite


def _compiled_and_numpy(cost: CostModel, pairs: list[tuple[Layout, Layout]], numpy_path, monkeypatch) -> tuple:
    layouts = sorted({layout for pair in pairs for layout in pair})
    index = {layout: i for i, layout in enumerate(layouts)}
    src = np.array([index[a] for a, _ in pairs])
    dst = np.array([index[b] for _, b in pairs])
    table = LayoutTable.of(layouts)
    want = numpy_path(lambda: pair_coefficients(table, src, dst, cost))
    monkeypatch.setattr(native, "PAIRS", 1)
    got = pair_coefficients(table, src, dst, cost)
    return got, want


@settings(max_examples=100, deadline=None)
@given(case=layout_pairs())
def test_the_compiled_planner_costs_every_pair_as_numpy_and_the_scalar_planner_do(case):
    _, pairs = case
    cost = CostModel(profile())
    with pytest.MonkeyPatch.context() as patch:
        got, want = _compiled_and_numpy(cost, pairs, _numpy_path(patch), patch)
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
    for k, (a, b) in enumerate(pairs):
        assert (got[0][k], got[1][k]) == redistribution_coefficients(cost, a, b)


def _numpy_path(patch: pytest.MonkeyPatch):
    def run(work):
        with patch.context() as inner:
            inner.setenv("AUTOPAR_NATIVE", "0")
            return work()

    return run


@pytest.mark.parametrize("bits", [2, 6, 16])
def test_the_compiled_planner_moves_runs_by_one_all_to_all_as_the_scalar_planner(monkeypatch, numpy_path, bits):
    got, want = _compiled_and_numpy(CostModel(profile()), _moved_runs(bits), numpy_path, monkeypatch)
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])


def test_a_pair_that_meets_an_unpriced_collective_is_priced_and_run_again(monkeypatch, numpy_path):
    """The prices are filled beforehand; left empty, every pair stops at its first step and is run again
    once that price is in, until none is missing: the same numbers."""
    monkeypatch.setattr(coefficients._Prices, "filled", lambda self: self)
    pairs = _moved_runs(6) + [(Layout(((5, 4), (3,)), (2, 1)), Layout(((), (3, 1), (5,), (2,))))]
    got, want = _compiled_and_numpy(CostModel(profile()), pairs, numpy_path, monkeypatch)
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
    with pytest.raises(ValueError, match="partial"):
        pair_coefficients(
            LayoutTable.of([Layout(((0,),)), Layout(((),), (0,))]), np.array([0]), np.array([1]), CostModel(profile())
        )


def _tables_of(problem) -> list[np.ndarray]:
    """Every edge table of a problem: the main graph's, and each folded run's, with and without recomputation."""
    runs = [edges for _, edges in (*problem.folds, *problem.recompute_folds)]
    return [f.table for f in problem.factors] + [f.table for edges in runs for f in (*edges.first, *edges.later)]


def test_edge_tables_filled_by_the_kernel_are_numpy_s_bit_for_bit(monkeypatch, numpy_path):
    """A GPT's edges at 64 devices: the gradient's way back summed in, tables written in both orientations,
    a folded run's copies; the second build of each path takes its pairs' slots from the cache."""
    graph = load_model(build_transformer(kind="gpt", layers=4, hidden=64, heads=4, seq=32, vocab=256, batch=8))
    cost = CostModel(profile())
    want = numpy_path(lambda: build_problem(graph, cost, 64))
    compiled_tables = costing._compiled_tables
    monkeypatch.setattr(native, "ENTRIES", 1)
    # each build_problem is a plan of its own (`autopar.context`): the pairs are costed again, too
    filled = []
    monkeypatch.setattr(costing, "_compiled_tables", lambda *a: filled.append(a) or compiled_tables(*a))
    got = build_problem(graph, cost, 64)
    assert len(filled) > 10 and any(found.backward is not None for _, _, found, _ in filled)
    assert len(_tables_of(got)) == len(_tables_of(want)) > 10
    for mine, theirs in zip(_tables_of(got), _tables_of(want)):
        assert mine.shape == theirs.shape and np.array_equal(mine, theirs)


def test_tables_read_through_a_kept_group_s_places_are_numpy_s_bit_for_bit(monkeypatch, numpy_path):
    """Problems built one after another in one plan, at a smaller batch and on fewer devices: their groups
    are the first's read through their layouts' places there (`PairSlots.through`), by the kernels, and
    give the tables and the count of layout pairs the numpy path gives from the slots copied out."""
    from autopar.context import opened

    def graph(batch: int):
        return load_model(build_transformer(kind="gpt", layers=2, hidden=64, heads=4, seq=32, batch=batch))

    shapes = ((16, 16), (4, 16), (8, 8))

    def built() -> list:
        shared = CostModel(profile())
        with opened():  # one plan: the later problems take the first's groups (`autopar.context`)
            return [build_problem(graph(batch), shared, devices) for batch, devices in shapes]

    want = numpy_path(built)
    compiled_tables = costing._compiled_tables
    monkeypatch.setattr(native, "ENTRIES", 1)
    filled = []
    monkeypatch.setattr(costing, "_compiled_tables", lambda *a: filled.append(a) or compiled_tables(*a))
    got = built()
    assert any(found.rows is not None and found.backward is not None for _, _, found, _ in filled)
    for mine, theirs in zip(got, want):
        assert mine.pairs_costed == theirs.pairs_costed and mine.layouts_costed == theirs.layouts_costed
        assert len(_tables_of(mine)) == len(_tables_of(theirs)) > 10
        for a, b in zip(_tables_of(mine), _tables_of(theirs)):
            assert a.shape == b.shape and np.array_equal(a, b)


@pytest.mark.parametrize("count", [2, 3])
@pytest.mark.parametrize("shape", [(5, 7, 3, 4), (9, 1, 6, 2), (2, 3, 4, 1)])
def test_a_three_operator_step_compiled_is_numpy_s_bit_for_bit(monkeypatch, numpy_path, count, shape):
    """Two or three tables over four axes, each broadcast along some (a three-operator scope's step): the
    kernels sum each entry as numpy does, in the same order, and keep the same minima."""
    rng = np.random.default_rng(sum(shape) + count)
    masks = [(1, 1, 0, 1), (0, 1, 1, 1), (1, 0, 1, 1)][:count]
    parts = [rng.random(tuple(n if keep else 1 for n, keep in zip(shape, mask))) * 1e-3 for mask in masks]
    want = numpy_path(lambda: dp._sum_min(parts))
    monkeypatch.setattr(native, "ENTRIES", 1)  # every step compiled, however small
    got = dp._sum_min(parts)
    assert got.shape == want.shape == shape[:-1]
    assert np.array_equal(got, want)


@pytest.mark.parametrize("cut", [0, 3, 8, 13, 21])
def test_the_min_plus_kernels_give_the_same_rows_wherever_the_rows_are_cut_between_threads(cut):
    kernels = native.kernels()
    a, b = _tables(21, 300, 9, cut)
    b_t = np.ascontiguousarray(b.T)
    whole, halves = np.empty((21, 300)), np.empty((21, 300))
    arg_whole, arg_halves = np.empty((21, 300), dtype=np.int64), np.empty((21, 300), dtype=np.int64)
    kernels.min_plus_rows(a, b_t, whole, 0, 21)
    kernels.min_plus_rows(a, b_t, halves, 0, cut)
    kernels.min_plus_rows(a, b_t, halves, cut, 21)
    assert np.array_equal(whole, halves) and np.array_equal(whole, (a[:, None, :] + b[None, :, :]).min(axis=2))
    none = np.empty((0, 0))
    for on_rows in (True, False):
        added = np.arange(9) * 0.1
        kernels.min_plus_rows_summed(a, none, b_t, none, added, on_rows, whole, 0, 21)
        kernels.min_plus_rows_summed(a, none, b_t, none, added, on_rows, halves, 0, cut)
        kernels.min_plus_rows_summed(a, none, b_t, none, added, on_rows, halves, cut, 21)
        assert np.array_equal(whole, halves)
    kernels.min_plus_argmin(a, b_t, whole, arg_whole, 0, 21)
    kernels.min_plus_argmin(a, b_t, halves, arg_halves, 0, cut)
    kernels.min_plus_argmin(a, b_t, halves, arg_halves, cut, 21)
    assert np.array_equal(arg_whole, arg_halves) and np.array_equal(
        arg_whole, (a[:, None, :] + b[None, :, :]).argmin(axis=2)
    )
