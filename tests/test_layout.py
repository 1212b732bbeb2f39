"""Layouts: the rank -> slice rule and the exports."""

from __future__ import annotations

import pytest

from autopar.layout import Layout, ReduceOp, is_power_of_two, mesh_bits_for, shard_index


def test_shard_index_reads_bits_most_significant_first():
    layout = Layout(((0, 2), ()))  # dim 0 split 4-way: bit 0 is the high digit
    # rank 0b100 = 4: bit0 = 0, bit2 = 1 -> index 0b01
    assert layout.shard_index(4, 0) == 1
    # rank 0b001 = 1: bit0 = 1, bit2 = 0 -> index 0b10
    assert layout.shard_index(1, 0) == 2


def test_local_slices_cover_the_tensor_once_per_replica():
    layout = Layout(((1,), (0,)))
    shape = (4, 6)
    regions = {tuple((s.start, s.stop) for s in layout.local_slices(rank, shape)) for rank in range(8)}
    assert len(regions) == 4  # bit 2 replicates: 8 ranks, 4 distinct shards
    assert layout.local_shape(shape) == (2, 3)
    assert layout.replicated_bits(3) == (2,)


def test_a_bit_cannot_serve_two_roles():
    with pytest.raises(ValueError):
        Layout(((0,), (0,)))
    with pytest.raises(ValueError):
        Layout(((0,),), partial=(0,))


def test_mindspore_export_and_round_trip():
    layout = Layout(((2, 1), (), (0,)))
    dev_matrix, tensor_map = layout.to_mindspore(3)
    assert dev_matrix == [2, 2, 2]
    assert tensor_map == [(2, 1), -1, 0]
    assert Layout.from_dict(layout.to_dict()) == layout
    partial = Layout(((),), (1, 0), "max")
    assert Layout.from_dict(partial.to_dict()) == partial
    assert "partial(max)" in partial.describe()


def test_power_of_two_helpers():
    assert [v for v in range(1, 20) if is_power_of_two(v)] == [1, 2, 4, 8, 16]
    assert mesh_bits_for(64) == 6


# --- canonical form -------------------------------------------------------------------------------


def test_partial_bits_are_canonical():
    dims = ((2,), ())
    assert Layout(dims, partial=(1, 0)) == Layout(dims, partial=(0, 1))
    assert hash(Layout(dims, partial=(1, 0))) == hash(Layout(dims, partial=(0, 1)))
    assert Layout(dims, partial=(0, 1)).partial == (1, 0)  # stored highest first
    assert Layout(dims, partial=(1, 0)) != Layout(dims, partial=(1,))


def test_partial_op_is_a_reduce_op():
    layout = Layout(((),), partial=(0,), partial_op="max")
    assert layout.partial_op is ReduceOp.MAX
    assert layout == Layout(((),), partial=(0,), partial_op=ReduceOp.MAX)
    assert layout != Layout(((),), partial=(0,))
    with pytest.raises(ValueError, match="avg"):
        Layout(((),), partial=(0,), partial_op="avg")


@pytest.mark.parametrize(
    "dims, partial",
    [
        (((-3,),), ()),
        (((),), (-3,)),
        (((True,),), ()),
        (((),), (False,)),
        (((1.0,),), ()),
    ],
)
def test_bad_bits_are_refused(dims, partial):
    with pytest.raises(ValueError, match="mesh bit"):
        Layout(dims, partial=partial)


def test_no_partial_bits_means_no_partial_op():
    plain = Layout(((1,), ()))
    assert Layout(((1,), ()), partial_op="max") == plain
    assert Layout(((1,), ()), partial=(), partial_op=ReduceOp.MIN) == plain
    assert Layout(((1,), ()), partial_op="max").partial_op is ReduceOp.SUM
    assert Layout(((1,), ()), partial_op="max").to_dict() == {"dims": [[1], []]}


def test_ndim():
    assert Layout(((2, 1), (), (0,))).ndim == 3
    assert Layout(()).ndim == 0
    assert Layout.replicated(4).ndim == 4


@pytest.mark.parametrize("dims", [((0, 2), ()), ((2, 1), (0,)), ((), (1, 0, 2)), ((3,), ())])
def test_shard_index_function_agrees_with_the_method(dims):
    layout = Layout(dims)
    for rank in range(16):
        for dim, bits in enumerate(dims):
            assert shard_index(rank, bits) == layout.shard_index(rank, dim)
    assert [shard_index(rank, (2, 0)) for rank in range(8)] == [0, 1, 0, 1, 2, 3, 2, 3]
    assert shard_index(5, ()) == 0
