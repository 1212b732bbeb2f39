"""Dropout's masks drawn from where each element is (`autopar.torch.dropout`)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from autopar.layout import Layout  # noqa: E402
from autopar.torch import dropout  # noqa: E402
from autopar.torch.dropout import MasksAsPlanned, drawn_apart, draws, dropped, element_hashes, keep_mask  # noqa: E402

SHAPE = (4, 8, 6)


def _whole(seed: int, draw: int) -> torch.Tensor:
    return element_hashes(seed, draw, SHAPE, [slice(0, size) for size in SHAPE])


def _mask(seed: int, draw: int, probability: float) -> torch.Tensor:
    return keep_mask(seed, draw, probability, SHAPE, [slice(0, size) for size in SHAPE])


def test_the_ranks_shards_put_together_are_the_whole_tensors_mask() -> None:
    layout = Layout(((2,), (1, 0), ()))  # dim 0 split by bit 2, dim 1 by bits 1 and 0: 8 shards
    whole = _whole(3, 5)
    together = torch.full(SHAPE, -1, dtype=torch.int64)
    for rank in range(8):
        region = layout.local_slices(rank, SHAPE)
        together[region] = element_hashes(3, 5, SHAPE, region)
    assert torch.equal(together, whole)
    replicated = Layout(((2,), (), ()))  # ranks that differ in bits 1 and 0 hold one region: they draw alike
    assert torch.equal(element_hashes(3, 5, SHAPE, replicated.local_slices(0, SHAPE)), whole[:2])
    assert torch.equal(element_hashes(3, 5, SHAPE, replicated.local_slices(3, SHAPE)), whole[:2])


def test_each_draw_drops_about_its_probability_and_draws_differ() -> None:
    shape = (256, 256)
    region = [slice(0, 256)] * 2
    first, second = (keep_mask(0, draw, 0.1, shape, region) for draw in (0, 1))
    assert abs(1 - first.float().mean().item() - 0.1) < 0.01
    assert abs((first == second).float().mean().item() - (0.1**2 + 0.9**2)) < 0.01  # independent, not equal
    assert not torch.equal(first, keep_mask(1, 0, 0.1, shape, region))


def test_a_mask_drawn_a_piece_at_a_time_is_the_mask_drawn_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    region = (slice(1, 4), slice(2, 8), slice(0, 6))
    at_once = keep_mask(5, 9, 0.3, SHAPE, region)
    assert torch.equal(at_once, (element_hashes(5, 9, SHAPE, region) >> 8) >= int(0.3 * (1 << 24)))
    monkeypatch.setattr(dropout, "_PIECE", 7)  # pieces that start and end within rows
    assert torch.equal(keep_mask(5, 9, 0.3, SHAPE, region), at_once)


def test_dropped_scales_what_it_keeps_as_torch_does() -> None:
    x = torch.arange(1.0, 1.0 + 4 * 8 * 6).reshape(SHAPE)
    mask = _mask(0, 0, 0.25)
    out = dropped(x, 0.25, mask)
    assert torch.equal(out[mask], x[mask] * (1 / 0.75)) and bool((out[~mask] == 0).all())
    assert bool((dropped(x, 1.0, _mask(0, 0, 1.0)) == 0).all())


def test_one_process_draws_the_masks_the_ranks_number_in_order() -> None:
    module = torch.nn.Sequential(torch.nn.Dropout(0.5), torch.nn.Dropout(0.0), torch.nn.Dropout(0.2))
    x = torch.ones(SHAPE)
    original = torch.nn.functional.dropout
    with MasksAsPlanned(7).drawing() as masks:
        out = module(x)
        module.eval()
        assert torch.equal(module(x), x)  # not training: nothing drawn
        module.train()
        again = module(x)
    assert torch.nn.functional.dropout is original
    assert masks.calls == 4  # two that drop, twice: the one of probability 0 draws nothing
    want = dropped(dropped(x, 0.5, _mask(7, 0, 0.5)), 0.2, _mask(7, 1, 0.2))
    assert torch.equal(out, want)
    assert torch.equal(again, dropped(dropped(x, 0.5, _mask(7, 2, 0.5)), 0.2, _mask(7, 3, 0.2)))


def test_the_programs_dropouts_that_draw_are_numbered_in_order() -> None:
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    aten = torch.ops.aten
    first = graph.call_function(aten.native_dropout.default, (x, 0.1, True))
    none = graph.call_function(aten.native_dropout.default, (x, 0.0, True))
    frozen = graph.call_function(aten.dropout.default, (x, 0.3, False))
    last = graph.call_function(aten.dropout.default, (x, 0.3, True))
    graph.output((first, none, frozen, last))
    assert draws(list(graph.nodes)) == {first.name: 0, last.name: 1}


def test_random_numbers_a_rank_would_draw_apart_are_refused_in_one_sentence() -> None:
    """An attention kernel's own dropout (the ONNX exporter leaves it out of the file) and any other random draw;
    not a dropout (drawn by element), nor an attention kernel that drops nothing."""
    graph = torch.fx.Graph()
    q = graph.placeholder("q")
    aten = torch.ops.aten
    dropping = graph.call_function(aten.scaled_dot_product_attention.default, (q, q, q), {"dropout_p": 0.1})
    keeping = graph.call_function(aten.scaled_dot_product_attention.default, (q, q, q, None, 0.0))
    noise = graph.call_function(aten.bernoulli.default, (q,))
    mask = graph.call_function(aten.native_dropout.default, (q, 0.1, True))
    plain = graph.call_function(aten.mm.default, (q, q))
    said = drawn_apart(dropping)
    assert said is not None and "dropout_p=0.1" in said and "attn_implementation='eager'" in said
    assert drawn_apart(keeping) is None and drawn_apart(mask) is None and drawn_apart(plain) is None
    said = drawn_apart(noise)
    assert said is not None and "draws random numbers" in said
