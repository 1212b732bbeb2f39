"""Hand-worked costs for Z = (X @ W1) @ W2 on 2 devices (X: 4x8, W1: 8x16, W2: 16x4).

Profile (conftest.simple_profile): 1e12 FLOP/s at full efficiency, HBM fast enough to ignore,
FP16 activations and gradients (mixed precision), bit 0 a 1 GB/s link with 1 us latency,
gradient fusion buckets of 1 MB (a gradient AllReduce pays latency x bytes / 1 MB).

Forward FLOPs: mm1 = 2*4*8*16 = 1024, mm2 = 2*4*16*4 = 512, both halved on 2 devices.
Backward passes: mm1 needs only dW1 (X is data) -> x2; mm2 needs dY and dW2 -> x3.
An AllReduce over one bit of the 1 GB/s level costs 2*(1e-6*scale + bytes/2/1e9).
These sums add every gradient sync to the step (``overlap=False``); overlap has its own tests.
"""

from __future__ import annotations

import pytest

import autopar
from autopar.cost import HardwareProfile
from tests.conftest import simple_profile_dict, two_matmul_chain

COMPUTE = (1024 / 2 / 1e12) * 2 + (512 / 2 / 1e12) * 3  # 1.024e-9 + 7.68e-10


def allreduce_one_bit(nbytes: float, fused: bool) -> float:
    scale = min(1.0, nbytes / 1e6) if fused else 1.0
    return 2 * (1e-6 * scale + nbytes / 2 / 1e9)


@pytest.fixture
def profile():
    return HardwareProfile.model_validate(simple_profile_dict())


def test_data_parallel_cost_by_hand(profile):
    strategies = {"mm1": ((2, 1), (1, 1)), "mm2": ((2, 1), (1, 1))}
    # W1 (8x16 FP16 = 256 B) and W2 (16x4 = 128 B) gradients AllReduced over bit 0; Y needs no move
    expected = COMPUTE + allreduce_one_bit(256, True) + allreduce_one_bit(128, True)
    assert expected == pytest.approx(3.8656e-7, rel=1e-4)
    got = autopar.evaluate(two_matmul_chain(), 2, strategies, cost_model=profile, overlap=False)
    assert got == pytest.approx(expected, rel=1e-12)


def test_megatron_cost_by_hand(profile):
    # mm1 splits columns (j), mm2 splits the contraction (k): Y stays put, Z ends partial
    strategies = {"mm1": ((1, 1), (1, 2)), "mm2": ((1, 2), (2, 1))}
    # no gradient sync (both weights are split); Z (4x4 FP16 = 32 B) is AllReduced once, unfused
    expected = COMPUTE + allreduce_one_bit(32, False)
    assert expected == pytest.approx(2.033792e-6, rel=1e-9)
    got = autopar.evaluate(two_matmul_chain(), 2, strategies, cost_model=profile, overlap=False)
    assert got == pytest.approx(expected, rel=1e-12)


def test_row_split_then_gather_cost_by_hand(profile):
    # mm1 data parallel, mm2 replicated: Y (4x16 FP16 = 128 B) is all-gathered forward; mm2 computes
    # the whole dY on both devices, so the way back is a local slice (free); only W1's gradient is
    # AllReduced
    strategies = {"mm1": ((2, 1), (1, 1)), "mm2": ((1, 1), (1, 1))}
    gather = 1e-6 + 128 / 2 / 1e9  # (g-1) * (alpha + out_bytes / g / bw), g = 2
    compute = (1024 / 2 / 1e12) * 2 + (512 / 1e12) * 3
    expected = compute + allreduce_one_bit(256, True) + gather
    got = autopar.evaluate(two_matmul_chain(), 2, strategies, cost_model=profile, overlap=False)
    assert got == pytest.approx(expected, rel=1e-12)


def test_a_partial_gradient_goes_back_as_one_reduce_scatter(profile):
    # mm1 data parallel, mm2 splits its columns: Y (4x16 FP16 = 128 B) is all-gathered forward; mm2's
    # dY comes out whole in shape but partial over bit 0, and one ReduceScatter (g = 2, 128 B in) both
    # sums it and gives each device its rows, as the runtime runs it: no AllReduce, then no dual
    strategies = {"mm1": ((2, 1), (1, 1)), "mm2": ((1, 1), (1, 2))}
    gather = 1e-6 + 128 / 2 / 1e9
    reduce_scatter = 1e-6 + 128 / 2 / 1e9  # (g-1) * (alpha + in_bytes / g / bw)
    expected = COMPUTE + allreduce_one_bit(256, True) + gather + reduce_scatter  # W2 split: no sync
    got = autopar.evaluate(two_matmul_chain(), 2, strategies, cost_model=profile, overlap=False)
    assert got == pytest.approx(expected, rel=1e-12)
    plan = autopar.plan(two_matmul_chain(), devices=2, cost_model=profile, mode="semi_auto_parallel", fixed=strategies)
    (path,) = plan.to_dict()["gradients"]
    assert [step["collective"] for step in path["steps"]] == ["ReduceScatter"]


def test_search_picks_the_cheapest_hand_worked_plan(profile):
    # on so small a model, keeping both MatMuls whole on every device beats any communication:
    # compute 2 * (1024 / 1e12) + 3 * (512 / 1e12) and nothing else
    plan = autopar.plan(two_matmul_chain(), devices=2, cost_model=profile, overlap=False)
    assert plan.strategies == {"mm1": ((1, 1), (1, 1)), "mm2": ((1, 1), (1, 1))}
    assert plan.objective == pytest.approx(2 * 1024 / 1e12 + 3 * 512 / 1e12, rel=1e-12)


@pytest.fixture
def slow_profile():
    """The same profile at 1 GFLOP/s, so that halving the work matters."""
    data = simple_profile_dict()
    data["compute"]["peak_flops_fp16"] = {"value": 1e9, "source": "test value"}
    return HardwareProfile.model_validate(data)


DP = {"mm1": ((2, 1), (1, 1)), "mm2": ((2, 1), (1, 1))}
MEGATRON = {"mm1": ((1, 1), (1, 2)), "mm2": ((1, 2), (2, 1))}


def test_megatron_wins_when_weights_dominate(slow_profile):
    # batch 8, 64 -> 256 -> 64. Both plans halve the compute:
    compute = (2 * 8 * 64 * 256 / 2 / 1e9) * 2 + (2 * 8 * 256 * 64 / 2 / 1e9) * 3
    # DP AllReduces the gradients of W1 and W2 (64x256 FP16 = 32 KiB each)
    dp = compute + 2 * allreduce_one_bit(64 * 256 * 2, True)
    # Megatron AllReduces Z (8x64 FP16 = 1 KiB) once, forward; X is data, so no backward AllReduce
    megatron = compute + allreduce_one_bit(8 * 64 * 2, False)
    model = two_matmul_chain(batch=8, d_in=64, d_hidden=256, d_out=64)
    assert autopar.evaluate(model, 2, DP, cost_model=slow_profile, overlap=False) == pytest.approx(dp, rel=1e-12)
    assert autopar.evaluate(model, 2, MEGATRON, cost_model=slow_profile, overlap=False) == pytest.approx(
        megatron, rel=1e-12
    )
    assert megatron < dp
    plan = autopar.plan(model, devices=2, cost_model=slow_profile, overlap=False)
    assert plan.strategies == MEGATRON
    assert plan.objective == pytest.approx(megatron, rel=1e-12)


def test_data_parallel_wins_when_activations_dominate(slow_profile):
    # batch 256, 8 -> 16 -> 4: gradients are tiny (256 B and 128 B), Z is 2 KiB
    compute = (2 * 256 * 8 * 16 / 2 / 1e9) * 2 + (2 * 256 * 16 * 4 / 2 / 1e9) * 3
    dp = compute + allreduce_one_bit(8 * 16 * 2, True) + allreduce_one_bit(16 * 4 * 2, True)
    megatron = compute + allreduce_one_bit(256 * 4 * 2, False)
    model = two_matmul_chain(batch=256, d_in=8, d_hidden=16, d_out=4)
    assert autopar.evaluate(model, 2, DP, cost_model=slow_profile, overlap=False) == pytest.approx(dp, rel=1e-12)
    assert autopar.evaluate(model, 2, MEGATRON, cost_model=slow_profile, overlap=False) == pytest.approx(
        megatron, rel=1e-12
    )
    assert dp < megatron
    plan = autopar.plan(model, devices=2, cost_model=slow_profile, overlap=False)
    assert plan.strategies == DP
    assert plan.objective == pytest.approx(dp, rel=1e-12)


def test_column_split_input_pays_a_backward_allreduce(slow_profile):
    # mm2 splits columns (j) while reading Y whole: its dY comes out partial over bit 0 and is
    # AllReduced backward (Megatron's "f" operator); mm1 replicated.
    model = two_matmul_chain(batch=8, d_in=64, d_hidden=256, d_out=64)
    strategies = {"mm1": ((1, 1), (1, 1)), "mm2": ((1, 1), (1, 2))}
    compute = (2 * 8 * 64 * 256 / 1e9) * 2 + (2 * 8 * 256 * 64 / 2 / 1e9) * 3
    expected = compute + allreduce_one_bit(8 * 256 * 2, False)
    assert autopar.evaluate(model, 2, strategies, cost_model=slow_profile, overlap=False) == pytest.approx(
        expected, rel=1e-12
    )


def test_memory_by_hand(profile):
    plan = autopar.plan(two_matmul_chain(), devices=2, cost_model=profile, mode="data_parallel")
    # X shard 2x8 FP16 = 32 B; W1, W2 whole at 12 B/element (FP32 master 4 + FP16 copy 2 + grad 2 + momentum 4);
    # kept for backward: Y shard 2x16 FP16 = 64 B (mm2 needs it for dW2); no backward needs the output Z
    assert plan.memory_per_device == 32 + 128 * 12 + 64 + 64 * 12
    assert plan.to_dict()["totals"]["memory_breakdown"] == {
        "parameter_state": 128 * 12 + 64 * 12,
        "activations": 64,
        "inputs": 32,
    }


@pytest.mark.parametrize("seq, batch, hidden, heads", [(64, 2, 32, 4), (32, 4, 48, 3)])
def test_gpt_layer_keeps_what_its_backward_needs(seq, batch, hidden, heads):
    """Korthikanti et al. (2022), no dropout: 32sbh + 2as^2b bytes in FP16 per layer.

    LayerNorm inputs 4sbh, QKV input 2sbh, Q and K 4sbh, V 2sbh, the softmax output 2as^2b, the
    output projection's input 2sbh, fc1's input 2sbh, GELU's input 8sbh, fc2's input 8sbh; the
    scaled and masked scores, biases and residual sums are kept by nobody. Each LayerNorm also
    keeps an FP32 mean and inverse deviation per row: 16sb.
    """
    from models.transformer import build_transformer

    def activations(layers: int) -> int:
        model = build_transformer(
            kind="gpt", layers=layers, hidden=hidden, heads=heads, seq=seq, batch=batch, vocab=64, gelu="fused"
        )
        return autopar.plan(model, devices=1).to_dict()["totals"]["memory_breakdown"]["activations"]

    s, b, h, a = seq, batch, hidden, heads
    assert activations(3) - activations(2) == 32 * s * b * h + 2 * a * s * s * b + 16 * s * b


@pytest.mark.parametrize("seq, batch, hidden, heads", [(64, 2, 32, 4), (32, 4, 48, 3)])
def test_gpt_layer_with_dropout_keeps_its_masks(seq, batch, hidden, heads):
    """Korthikanti et al. (2022) with dropout: 34sbh + 5as^2b bytes in FP16 per layer.

    Over the layer without dropout: the attention probabilities' mask as^2b and their dropped values 2as^2b (the
    product with the values keeps those, not the softmax output, which the softmax keeps), and the masks of the
    two dropouts before the residuals, sbh each (the residual Add keeps nothing). A mask is a byte an element.
    """
    from models.transformer import build_transformer

    def activations(layers: int, dropout: float) -> int:
        model = build_transformer(
            kind="gpt", layers=layers, hidden=hidden, heads=heads, seq=seq, batch=batch, vocab=64, gelu="fused",
            dropout=dropout,
        )  # fmt: skip
        return autopar.plan(model, devices=1).to_dict()["totals"]["memory_breakdown"]["activations"]

    s, b, h, a = seq, batch, hidden, heads
    assert activations(3, 0.1) - activations(2, 0.1) == 34 * s * b * h + 5 * a * s * s * b + 16 * s * b
    assert activations(3, 0.0) - activations(2, 0.0) == 32 * s * b * h + 2 * a * s * s * b + 16 * s * b


def test_overlap_hides_a_sync_behind_the_backward_before_it_and_changes_the_winner(slow_profile):
    """Batch 64, 4 -> 128 -> 16 at 1 GFLOP/s; both plans halve the compute, so only communication differs.

    Data parallel: W1 (4x128 FP16 = 1 KiB) and W2 (128x16 = 4 KiB) gradients are AllReduced.
    W2's gradient is ready after mm2's backward and its sync runs beside mm1's backward
    (2*64*4*128 / 2 / 1e9 = 32.768 us at mm1's fastest candidate): hidden. W1's is ready last,
    with no backward left to hide behind: exposed. Megatron AllReduces Z (64x16 FP16 = 2 KiB),
    forward, unfused. Summed, data parallel loses; overlapped, it wins.
    """
    model = two_matmul_chain(batch=64, d_in=4, d_hidden=128, d_out=16)
    compute = (2 * 64 * 4 * 128 / 2 / 1e9) * 2 + (2 * 64 * 128 * 16 / 2 / 1e9) * 3
    w1, w2 = allreduce_one_bit(4 * 128 * 2, True), allreduce_one_bit(128 * 16 * 2, True)
    hide = 2 * 64 * 4 * 128 / 2 / 1e9
    assert w2 < hide
    megatron = compute + allreduce_one_bit(64 * 16 * 2, False)
    summed, overlapped = compute + w1 + w2, compute + w1
    assert overlapped < megatron < summed
    for overlap, expected, winner in ((False, summed, MEGATRON), (True, overlapped, DP)):
        got = autopar.evaluate(model, 2, DP, cost_model=slow_profile, overlap=overlap)
        assert got == pytest.approx(expected, rel=1e-12)
        plan = autopar.plan(model, devices=2, cost_model=slow_profile, overlap=overlap)
        assert plan.strategies == winner
    plan = autopar.plan(model, devices=2, cost_model=slow_profile)
    totals = plan.to_dict()["totals"]
    assert totals["hidden_communication_s"] == pytest.approx(w2, rel=1e-9)
    assert totals["gradient_sync_s"] == pytest.approx(w1 + w2, rel=1e-9)


def test_a_sync_longer_than_the_backward_before_it_shows_the_rest(slow_profile):
    # batch 8, 8 -> 256 -> 64: W2 (256x64 FP16 = 32 KiB) takes 32.8 us to AllReduce, mm1's
    # backward (2*8*8*256 / 2 / 1e9) lasts 16.4 us: the other 16.4 us are exposed
    model = two_matmul_chain(batch=8, d_in=8, d_hidden=256, d_out=64)
    compute = (2 * 8 * 8 * 256 / 2 / 1e9) * 2 + (2 * 8 * 256 * 64 / 2 / 1e9) * 3
    w1, w2 = allreduce_one_bit(8 * 256 * 2, True), allreduce_one_bit(256 * 64 * 2, True)
    hide = 2 * 8 * 8 * 256 / 2 / 1e9
    expected = compute + w1 + (w2 - hide)
    assert autopar.evaluate(model, 2, DP, cost_model=slow_profile) == pytest.approx(expected, rel=1e-12)


def test_a_weight_product_runs_its_batch_dimensions_as_rows():
    """[64, 16, 1024] @ [1024, 2048]: the library runs one product of M = 64 x 16 = 1,024 rows, N = 2,048 and
    K = 1,024, at the full efficiency (0.5) of a fall-off table that gives 0.25 up to 512 and 1.0 from 1,024;
    not at the 16 positions of one sample. A product whose operands share the batch ([64, 16, 1024] @
    [64, 1024, 2048]) runs 64 products of M = 16: 0.25. Both do 2 x 1,024 x 1,024 x 2,048 FLOPs; the weight's
    gradient doubles the first, the second has no backward (its operands are inputs).
    """
    from onnx import TensorProto, helper

    from tests.conftest import make_model, weight

    data = simple_profile_dict()
    data["compute"]["matmul_falloff"] = {"smallest_dim": [512, 1024], "factor": [0.25, 1.0], "source": "test value"}
    data["compute"]["matmul_efficiency"] = {"value": 0.5, "source": "test value"}
    profile = HardwareProfile.model_validate(data)
    flops = 2 * 1024 * 1024 * 2048
    node = helper.make_node("MatMul", ["X", "W"], ["Y"], name="mm")
    rows = make_model([node], [("X", TensorProto.FLOAT, [64, 16, 1024])], ["Y"], [weight("W", [1024, 2048])])
    (op,) = autopar.plan(rows, devices=1, cost_model=profile).to_dict()["ops"]
    assert op["cost"]["compute_s"] == pytest.approx(flops / (1e12 * 0.5) * 2, rel=1e-9)
    for batched in ([64, 1024, 2048], [1, 1024, 2048]):  # a broadcast batch axis still makes a batched product
        inputs = [("X", TensorProto.FLOAT, [64, 16, 1024]), ("W", TensorProto.FLOAT, batched)]
        (op,) = autopar.plan(make_model([node], inputs, ["Y"]), devices=1, cost_model=profile).to_dict()["ops"]
        assert op["cost"]["compute_s"] == pytest.approx(flops / (1e12 * 0.5 * 0.25), rel=1e-9)
