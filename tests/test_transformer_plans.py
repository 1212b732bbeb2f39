"""Transformers from models/transformer.py: plans found, Megatron discovered, plans verified, memory stated."""

from __future__ import annotations

import pytest

import autopar
from autopar.errors import InfeasibleError
from models.transformer import build_preset, build_transformer

COLUMN = ((1, 1, 1), (1, 8))  # a [1, s, h] activation read whole, the weight split by columns
ROW = ((1, 1, 8), (8, 1))  # the activation split on h, the weight split by rows: partial output


def big_block(**overrides):
    """One GPT layer with a large hidden size and a single sequence: the Megatron regime."""
    config = dict(kind="gpt", layers=1, hidden=8192, heads=64, seq=512, vocab=1024, batch=1)
    config.update(overrides)
    return build_transformer(**config)


@pytest.fixture(scope="module")
def megatron_plan():
    return autopar.plan(big_block(), devices=8)


def test_search_finds_megatron_with_sequence_parallelism_for_large_hidden_and_small_batch(megatron_plan):
    """Megatron's column and row splits, with its sequence parallelism (Korthikanti et al. 2022): the
    layer norms split the sequence, the column-split projections gather their input and the gradient
    comes back as one ReduceScatter, and the row-split products reduce-scatter onto the sequence."""
    s = megatron_plan.strategies
    for name in ("layer0.attn.q", "layer0.attn.k", "layer0.attn.v", "layer0.mlp.fc1"):
        assert s[name] == COLUMN, name
    assert s["layer0.mlp.fc2"] == ROW
    assert s["layer0.attn.out"][1][0] > 1  # its weight's rows split: the output comes out partial
    assert s["layer0.ln1"] == s["layer0.ln2"] == ((1, 8, 1), (1,), (1,))
    assert s["layer0.attn.scores"] == ((1, 8, 1, 1), (1, 8, 1, 1))  # attention split by heads
    plan = megatron_plan.to_dict()
    into_fc1 = [r for r in plan["redistributions"] if r["consumer"] == "layer0.mlp.fc1"]
    assert [step["collective"] for r in into_fc1 for step in r["steps"]] == ["AllGather"]
    back_from_fc1 = [g for g in plan["gradients"] if g["consumer"] == "layer0.mlp.fc1"]
    assert [step["collective"] for g in back_from_fc1 for step in g["steps"]] == ["ReduceScatter"]
    after_fc2 = [r for r in plan["redistributions"] if r["producer"] == "layer0.mlp.fc2"]
    assert {step["collective"] for r in after_fc2 for step in r["steps"]} == {"ReduceScatter"}  # no AllReduce
    dp = autopar.plan(big_block(), devices=8, mode="data_parallel")
    assert megatron_plan.objective < dp.objective / 2


def test_data_parallel_stays_for_small_hidden_and_large_batch():
    plan = autopar.plan(big_block(hidden=256, heads=4, seq=128, batch=64), devices=8)
    for name in ("layer0.attn.q", "layer0.attn.out", "layer0.mlp.fc1", "layer0.mlp.fc2"):
        assert plan.strategies[name] == ((8, 1, 1), (1, 1)), name


def test_megatron_strategies_verify_on_a_small_instance(megatron_plan):
    # the same operators and splits on a model small enough to run: hidden 64, 8 heads
    small = big_block(hidden=64, heads=8, seq=16, vocab=64, weights="random")
    report = autopar.verify(small, megatron_plan.strategies, devices=8)
    assert report.ok, report.problems
    assert report.executed == report.planned
    assert report.executed["AllGather"]["count"] >= 2 and report.executed["ReduceScatter"]["count"] >= 2


@pytest.mark.parametrize("kind, layernorm", [("gpt", "fused"), ("bert", "decomposed")])
def test_small_stacks_plan_and_verify(kind, layernorm):
    model = build_transformer(
        kind=kind, layers=2, hidden=64, heads=4, seq=16, vocab=128, batch=4, layernorm=layernorm, weights="random"
    )
    for devices in (4, 8):
        plan = autopar.plan(model, devices=devices)
        assert not plan.fallback_ops
        report = autopar.verify(model, plan)
        assert report.ok, (devices, report.problems)


def test_gpt3_width_model_too_big_for_data_parallel_gets_a_plan_that_fits():
    model = build_preset("gpt3", layers=4, batch=1)  # 8.5e9 parameters: 136 GB of training state
    with pytest.raises(InfeasibleError, match="the data_parallel plan needs"):
        autopar.plan(model, devices=8, mode="data_parallel")
    plan = autopar.plan(model, devices=8)
    assert plan.memory_per_device <= 32e9
    assert plan.strategies["layer0.mlp.fc1"][1] != (1, 1)  # the weights are split


def test_gpt3_on_eight_devices_says_nothing_fits_and_why():
    model = build_preset("gpt3", batch=1)
    with pytest.raises(InfeasibleError) as info:
        autopar.plan(model, devices=8)
    message = str(info.value)
    assert message.startswith("Nothing fits in device memory")
    assert "parameters with gradients and optimizer state" in message
    assert "embed.tok.weight" in message  # the 50304 x 12288 embedding is the largest tensor
    assert "at least" in message and "devices are needed" in message
    assert "\n" not in message
