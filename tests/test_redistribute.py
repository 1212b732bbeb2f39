"""Redistribution: each row of DESIGN.md's table, and exactness proved on virtual devices."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar.layout import Layout, ReduceOp
from autopar.redistribute import Collective, as_partial, redistribute
from autopar.spmd import assemble, run_step, shard


def kinds(src: Layout, dst: Layout, shape=(8, 8)) -> list[str]:
    return [s.kind for s in redistribute(src, dst, shape, itemsize=4)]


@pytest.mark.parametrize(
    "src, dst, expected",
    [
        (Layout(((0,), ())), Layout(((), ())), ["AllGather"]),  # split -> replicated
        (Layout(((), ())), Layout(((0,), ())), ["Slice"]),  # replicated -> split
        (Layout(((0,), ())), Layout(((), (0,))), ["AllToAll"]),  # split a -> split b
        (Layout(((), ()), (0,)), Layout(((), ())), ["AllReduce"]),  # partial -> replicated
        (Layout(((), ()), (0,)), Layout(((0,), ())), ["ReduceScatter"]),  # partial -> split
        (Layout(((1, 0), ())), Layout(((1, 0), ())), []),  # same role
    ],
)
def test_design_table_rows(src, dst, expected):
    assert kinds(src, dst) == expected


def test_bit_order_within_a_dim_matters():
    # (2,0) -> (0,2): the same bits in the other order is a real reorder, not a no-op
    steps = kinds(Layout(((2, 0), ())), Layout(((0, 2), ())))
    assert steps and set(steps) <= {"AllGather", "Slice", "AllToAll"}


def test_consecutive_gathers_fuse_into_one_collective():
    steps = redistribute(Layout(((2, 1, 0), ())), Layout(((2,), ())), (16, 4), itemsize=2)
    assert len(steps) == 1
    assert steps[0].kind == "AllGather" and steps[0].bits == (1, 0) and steps[0].group_size == 4
    # gathered output per rank: half the tensor (still split by bit 2)
    assert steps[0].nbytes == 16 * 4 * 2 // 2


def test_expert_parallelism_meets_a_batch_split_in_one_all_to_all():
    """GShard's token exchange: dispatched tokens [e, b, c, h] = [8, 8, 4, 16] in fp16 (8,192 bytes), split
    by batch on bits (2, 1, 0), go to the experts' devices, split by expert on the same bits. One
    AllToAll over the 8 ranks: each rank's local buffer (1,024 bytes) is cut 8 ways along e and the
    pieces swapped, so 7/8 of it crosses the wire. Bit by bit it could not be one (the batch drops bit 0
    first, the experts want bit 2 first): an AllGather over 4 ranks, an AllToAll and a Slice, 5,120
    bytes a rank on the wire against 896. The way back is the same AllToAll reversed, and on 2 devices
    it is one AllToAll over the one bit."""
    shape = (8, 8, 4, 16)
    by_batch, by_expert = Layout(((), (2, 1, 0), (), ())), Layout(((2, 1, 0), (), (), ()))
    (there,) = redistribute(by_batch, by_expert, shape, itemsize=2)
    assert (there.kind, there.bits, there.nbytes, there.dim, there.concat_dim) == ("AllToAll", (2, 1, 0), 1024, 0, 1)
    (back,) = redistribute(by_expert, by_batch, shape, itemsize=2)
    assert (back.kind, back.bits, back.nbytes, back.dim, back.concat_dim) == ("AllToAll", (2, 1, 0), 1024, 1, 0)
    (two,) = redistribute(Layout(((), (0,), (), ())), Layout(((0,), (), (), ())), shape, itemsize=2)
    assert (two.kind, two.bits, two.nbytes) == ("AllToAll", (0,), 4096)
    full = np.arange(np.prod(shape), dtype=np.float64).reshape(shape)
    buffers = run_step(shard(full, by_batch, 3), there)
    for rank, buffer in enumerate(buffers):
        np.testing.assert_array_equal(buffer, full[by_expert.local_slices(rank, shape)])


def test_a_run_of_bits_moves_whole_only_in_its_order_and_only_where_it_must_go():
    # the reverse order is three AllToAlls of one bit, each the next one the target wants
    assert kinds(Layout(((), (2, 1, 0))), Layout(((0, 1, 2), ())), shape=(8, 8)) == ["AllToAll"] * 3
    # bit 2 stays where it is; the run (1, 0) moves to the other dim in one AllToAll
    steps = redistribute(Layout(((2, 1, 0), ())), Layout(((2,), (1, 0))), (8, 8), itemsize=4)
    assert [(str(s.kind), s.bits) for s in steps] == [("AllToAll", (1, 0))]
    # after a prefix the target already holds: the run joins it (dim 1 keeps bit 3, then takes 1 and 0)
    steps = redistribute(Layout(((1, 0), (3,))), Layout(((), (3, 1, 0))), (8, 8), itemsize=4)
    assert [(str(s.kind), s.bits) for s in steps] == [("AllToAll", (1, 0))]


def test_step_bytes_follow_the_conventions():
    (rs,) = redistribute(Layout(((), ()), (0,)), Layout(((0,), ())), (8, 8), itemsize=2)
    assert rs.kind == "ReduceScatter" and rs.nbytes == 128  # input per rank: the whole partial tensor
    (ag,) = redistribute(Layout(((0,), ())), Layout(((), ())), (8, 8), itemsize=2)
    assert ag.nbytes == 128  # output per rank
    (a2a,) = redistribute(Layout(((0,), ())), Layout(((), (0,))), (8, 8), itemsize=2)
    assert a2a.nbytes == 64  # the local buffer


def test_a_gradient_goes_back_as_a_redistribution_of_its_own():
    """An AllGather forward: a gradient that comes back whole is sliced (each device computed all of
    it), one that comes back partial is reduce-scattered: never an AllReduce then a gather's dual."""
    rows = Layout(((0,), ()))
    (gather,) = redistribute(rows, Layout(((), ())), (8, 8), itemsize=2)
    assert gather.kind == "AllGather"
    (whole,) = redistribute(Layout(((), ())), rows, (8, 8), itemsize=2)
    assert whole.kind == "Slice"
    (partial,) = redistribute(Layout(((), ()), partial=(0,)), rows, (8, 8), itemsize=2)
    assert partial.kind == "ReduceScatter" and partial.nbytes == 128


def test_a_partial_target_keeps_the_bits_the_source_is_partial_over_and_reduces_the_rest():
    # a gradient a fork takes partial over bit 0: bit 1 is reduced, bit 0 left for the fork's own way back
    (step,) = redistribute(Layout(((),), (1, 0)), Layout(((),), (0,)), (4,), 4)
    assert (step.kind, step.bits) == (Collective.ALL_REDUCE, (1,))
    # over a bit the source is whole on, no step: the runtime keeps it on one rank of the pair
    assert redistribute(Layout(((),)), Layout(((),), (0,)), (4,), 4) == ()
    assert as_partial(Layout(((),)), Layout(((),), (0,))) == (0,)
    with pytest.raises(ValueError):  # only a sum is ever taken partial
        redistribute(Layout(((),), (0,), ReduceOp.MAX), Layout(((),), (0,), ReduceOp.MAX), (4,), 4)


@st.composite
def layout_pair(draw):
    mesh_bits = draw(st.integers(1, 3))
    rank = draw(st.integers(1, 3))
    shape = tuple(draw(st.sampled_from([8, 16])) for _ in range(rank))

    def draw_layout(allow_partial: bool) -> Layout:
        dims: list[list[int]] = [[] for _ in range(rank)]
        partial = []
        order = draw(st.permutations(list(range(mesh_bits))))
        for bit in order:
            role = draw(st.integers(-2 if allow_partial else -1, rank - 1))
            if role >= 0:
                dims[role].append(bit)
            elif role == -2:
                partial.append(bit)
        op = draw(st.sampled_from(["sum", "max"]))
        return Layout(tuple(tuple(d) for d in dims), tuple(sorted(partial, reverse=True)), op)

    return mesh_bits, shape, draw_layout(True), draw_layout(False)


@settings(max_examples=300, deadline=None)
@given(layout_pair())
def test_every_redistribution_is_exact_on_virtual_devices(case):
    mesh_bits, shape, src, dst = case
    rng = np.random.default_rng(0)
    full = rng.standard_normal(shape)
    buffers = shard(full, src, mesh_bits, rng)
    for step in redistribute(src, dst, shape, itemsize=8):
        before = [b.nbytes for b in buffers]
        buffers = run_step(buffers, step)
        if step.kind == "AllGather":
            assert step.nbytes == buffers[0].nbytes
        elif step.kind in ("ReduceScatter", "Slice", "AllReduce", "AllToAll"):
            assert step.nbytes == before[0]
    for rank, buffer in enumerate(buffers):
        np.testing.assert_allclose(buffer, full[dst.local_slices(rank, shape)], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(assemble(buffers, dst, shape), full)
