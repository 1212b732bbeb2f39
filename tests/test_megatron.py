"""Tensor parallelism is discoverable: Megatron's MLP split, worked by hand on 8 devices.

The block is Z = Relu(X @ W1) @ W2 with X: [tokens, h] (tokens = batch x sequence), W1: [h, 4h],
W2: [4h, h]. Profile: 1 GFLOP/s for every operator class (HBM fast enough to ignore), FP16
activations and gradients, one flat 1 GB/s level with 1 us latency over all 8 devices, 1 MB
gradient-fusion buckets.

An AllReduce over g = 8 devices of n bytes is a ReduceScatter then an AllGather:
2 (g - 1) alpha + 2 (g - 1) / g * n / bw = 14 us + 1.75 n / 1e9 s; a fused gradient AllReduce
pays the latency in proportion n / 1 MB.

Both plans divide all work by 8. Backward: fc1 needs only dW1 (X is data), Relu one pass,
fc2 needs dA and dW2, so compute = (fc1 x 2 + relu x 2 + fc2 x 3) / 8 / 1e9.
- Data parallel: each weight's gradient (2 h 4h bytes) is AllReduced, fused.
- Megatron: fc1 splits W1's columns, Relu follows, fc2 splits W2's rows: A never moves, no
  weight gradient is shared, and Z comes out partial: one AllReduce of Z (2 tokens h bytes)
  forward, unfused. X needs no gradient, so no backward AllReduce on the input side.
Every gradient sync is added to the step here (``overlap=False``), as worked by hand. Each plan updates h^2
weights a device (momentum SGD, 20 B an element at the 1e18 B/s HBM: 1.3e-12 s at h = 256): Megatron's and the
2-D split's weights are split 8 ways, data parallel's are whole on every device and updated a shard each
(the parallel optimizer, as fast as the AllReduce: a ReduceScatter and an AllGather).
Where few tokens make the AllReduce's latency count, a split of fc2 over rows 4 ways and columns
2 ways beats Megatron's (a smaller AllReduce group, and a gather whose gradient comes back as one
ReduceScatter, the way the runtime runs it).
"""

from __future__ import annotations

import pytest
from onnx import TensorProto, helper

import autopar
from autopar.cost import HardwareProfile
from tests.conftest import make_model, simple_profile_dict, weight

DEVICES = 8
DP = {"fc1": ((8, 1), (1, 1)), "act": ((8, 1),), "fc2": ((8, 1), (1, 1))}
MEGATRON = {"fc1": ((1, 1), (1, 8)), "act": ((1, 8),), "fc2": ((1, 8), (8, 1))}
TWO_D = {"fc1": ((1, 1), (1, 8)), "act": ((1, 8),), "fc2": ((1, 4), (4, 2))}


@pytest.fixture
def flat_profile() -> HardwareProfile:
    data = simple_profile_dict()
    data["compute"]["peak_flops_fp16"] = {"value": 1e9, "source": "test value"}
    data["links"] = [
        {
            "name": "flat",
            "bits": 40,
            "bandwidth": {"value": 1e9, "source": "test value"},
            "latency": {"value": 1e-6, "source": "test value"},
        }
    ]
    return HardwareProfile.model_validate(data)


def mlp(tokens: int, hidden: int):
    nodes = [
        helper.make_node("MatMul", ["X", "W1"], ["H"], name="fc1"),
        helper.make_node("Relu", ["H"], ["A"], name="act"),
        helper.make_node("MatMul", ["A", "W2"], ["Z"], name="fc2"),
    ]
    return make_model(
        nodes,
        [("X", TensorProto.FLOAT, [tokens, hidden])],
        ["Z"],
        [weight("W1", [hidden, 4 * hidden], 1), weight("W2", [4 * hidden, hidden], 2)],
    )


def compute(tokens: int, hidden: int) -> float:
    fc = 2 * tokens * hidden * 4 * hidden
    return (fc * 2 + tokens * 4 * hidden * 2 + fc * 3) / DEVICES / 1e9


def allreduce(nbytes: float, fused: bool) -> float:
    return 14e-6 * (min(1.0, nbytes / 1e6) if fused else 1.0) + 1.75 * nbytes / 1e9


def update(hidden: int) -> float:
    """The optimizer update of h^2 weight elements a device: momentum SGD reads the FP32 weights, the FP16
    gradient and the momentum (4 + 2 + 4 B) and writes the weights, the momentum and the FP16 copy (4 + 4 + 2)."""
    return hidden * hidden * 20 / 1e18


def costs(tokens: int, hidden: int) -> tuple[float, float]:
    weight_bytes = 2 * hidden * 4 * hidden
    dp = compute(tokens, hidden) + 2 * allreduce(weight_bytes, fused=True) + update(hidden)
    megatron = compute(tokens, hidden) + allreduce(2 * tokens * hidden, fused=False) + update(hidden)
    return dp, megatron


def check_costs_and_search(model, profile, dp: float, megatron: float, winner: dict, best: float | None = None):
    """Both hand-worked costs equal autopar's, and the search returns the ``winner`` at its cost
    (``best``, or the cheaper of the two)."""
    assert autopar.evaluate(model, DEVICES, DP, cost_model=profile, overlap=False) == pytest.approx(dp, rel=1e-12)
    assert autopar.evaluate(model, DEVICES, MEGATRON, cost_model=profile, overlap=False) == pytest.approx(
        megatron, rel=1e-12
    )
    plan = autopar.plan(model, devices=DEVICES, cost_model=profile, overlap=False)
    assert plan.strategies == winner
    assert plan.objective == pytest.approx(min(dp, megatron) if best is None else best, rel=1e-12)
    return plan


def test_tensor_parallelism_wins_with_large_hidden_and_few_tokens(flat_profile):
    tokens, hidden = 8, 256
    dp, megatron = costs(tokens, hidden)
    # compute (2 x 8 x 256 x 1024 x 5 + 8 x 1024 x 2) / 8 / 1e9 = 2623.5 us;
    # DP syncs 2 x 512 KiB of gradients: 2 x (7.34 us + 917.5 us) = 1849.7 us;
    # Megatron AllReduces Z, 4 KiB: 14 us + 7.17 us = 21.2 us
    assert dp == pytest.approx(4.4732e-3, rel=1e-4)
    assert megatron == pytest.approx(2.6447e-3, rel=1e-4)
    assert megatron < dp
    model = mlp(tokens, hidden)
    # Cheaper still: fc2 splits W2's rows 4 ways (bits 2, 1) and its columns over bit 0. A (8 x 1024,
    # split 8 ways) is all-gathered over bit 0 (g = 2: 1 us + 4 KiB / 2 / 1 GB/s), its gradient comes
    # back partial over bit 0 and is reduce-scattered (the same), and Z (2 KiB a device) is AllReduced
    # over 4 devices: 2 x 3 x 1 us + 2 x 3/4 x 2 KiB / 1 GB/s. 15.2 us against Megatron's 21.2 us.
    gather = 1e-6 + 4096 / 2 / 1e9
    two_d = compute(tokens, hidden) + 2 * gather + 6e-6 + 1.5 * 2048 / 1e9 + update(hidden)
    assert autopar.evaluate(model, DEVICES, TWO_D, cost_model=flat_profile, overlap=False) == pytest.approx(
        two_d, rel=1e-12
    )
    plan = check_costs_and_search(model, flat_profile, dp, megatron, TWO_D, two_d)
    moves = [
        (entry["tensor"], step["collective"]) for entry in plan.to_dict()["redistributions"] for step in entry["steps"]
    ]
    assert moves == [("A", "AllGather"), ("Z", "AllReduce")]
    (back,) = plan.to_dict()["gradients"]
    assert (back["tensor"], [step["collective"] for step in back["steps"]]) == ("A", ["ReduceScatter"])
    report = autopar.verify(model, plan, gradients=True)
    assert report.ok, report.problems
    assert report.collectives["executed"] == report.collectives["planned"]
    # Megatron's own split verifies too: its one collective is Z's AllReduce
    report = autopar.verify(model, MEGATRON, devices=DEVICES)
    assert report.ok, report.problems
    assert report.executed == {"AllReduce": {"count": 1, "bytes": 2 * tokens * hidden}}


def test_data_parallel_wins_with_small_hidden_and_many_tokens(flat_profile):
    tokens, hidden = 4096, 16
    dp, megatron = costs(tokens, hidden)
    # DP syncs 2 x 2 KiB of gradients: 2 x (0.029 us + 3.58 us); Megatron AllReduces Z, 128 KiB: 243 us
    assert dp == pytest.approx(compute(tokens, hidden) + 7.226e-6, rel=1e-3)
    assert megatron == pytest.approx(compute(tokens, hidden) + 2.434e-4, rel=1e-3)
    assert dp < megatron
    check_costs_and_search(mlp(tokens, hidden), flat_profile, dp, megatron, DP)
