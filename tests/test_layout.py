"""Layouts: the rank -> slice rule and the exports."""

from __future__ import annotations

import pytest

from autopar.layout import Layout, is_power_of_two, mesh_bits_for


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
