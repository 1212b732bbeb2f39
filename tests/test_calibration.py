"""The bundled profiles reproduce their published ResNet-50 throughput.

Ascend 910 (MindSpore benchmark, ResNet-50 v1.5, batch 256/chip, mixed precision): 2115 images/s
on 1 chip, 16,600 on 8 (scaling 0.98). A100 (NVIDIA DeepLearningExamples, PyTorch, DGX A100 80GB,
AMP, batch 256/GPU): 2470 images/s on 1 GPU, 16,621 on 8 (scaling 0.84). In each profile only the
cube efficiency is fitted, to the one-device figure, so that figure is checked as a fit (the stored
value is what the fit gives); the eight-device figure and the scaling are predictions. The Ascend
910's matrix products are fitted likewise to MindSpore's BERT-Large on one chip (269 sentences/s at
batch 96), its eight-chip figure (2069) the check. bench/calibrate.py --cost-model NAME prints the figures.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from autopar.cost import load_profile
from autopar.errors import CostModelError
from autopar.search.calibration import (
    ANCHORS,
    PUBLISHED_RESNET50_IMAGES_PER_S,
    TRANSFORMER_ANCHORS,
    anchor_for,
    data_parallel_throughput,
    fit_cube_efficiency,
    fit_matmul_efficiency,
    predicted_throughput,
)

RESNET50 = Path(__file__).resolve().parents[1] / "models" / "resnet50.onnx"


@pytest.fixture(scope="module")
def profile():
    return load_profile("ascend910")


@pytest.fixture(scope="module")
def throughput(profile):
    return {n: data_parallel_throughput(RESNET50, profile, n) for n in (1, 8)}


def test_stored_cube_efficiency_is_the_fit(profile):
    # the profile stores the fitted value to two decimals; a cost-model change that moves the fit must refit
    fitted = fit_cube_efficiency(RESNET50, profile, steps=16)
    assert fitted == pytest.approx(profile.compute.cube_efficiency.value, abs=0.005)
    assert "fitted" in profile.compute.cube_efficiency.source


def test_eight_chip_throughput_within_15_percent(throughput):
    assert abs(throughput[8] / PUBLISHED_RESNET50_IMAGES_PER_S[8] - 1) <= 0.15


def test_eight_chip_scaling(throughput):
    scaling = throughput[8] / (8 * throughput[1])
    assert 0.95 <= scaling <= 1.00


# --- Ascend 910 transformers: MindSpore's BERT-Large ------------------------------------------------


@pytest.fixture(scope="module")
def bert():
    from models.transformer import build_transformer

    anchor = TRANSFORMER_ANCHORS["ascend910"]
    return build_transformer(batch=anchor.batch_per_device, **anchor.shape)


def test_stored_matmul_efficiency_is_the_bert_large_fit(profile, bert):
    # the matrix products are fitted to MindSpore's one-chip BERT-Large figure, the convolutions to ResNet-50's
    fitted = fit_matmul_efficiency(bert, profile, TRANSFORMER_ANCHORS["ascend910"], steps=16)
    assert fitted == pytest.approx(profile.compute.matmul_efficiency.value, abs=0.005)
    assert profile.compute.matmul_efficiency.source.startswith("fitted") and "BERT-Large" in (
        profile.compute.matmul_efficiency.source
    )


def test_bert_large_on_eight_chips_within_15_percent(profile, bert):
    anchor = TRANSFORMER_ANCHORS["ascend910"]
    predicted = data_parallel_throughput(bert, profile, 8, anchor.batch_per_device)
    assert abs(predicted / anchor.sequences_per_s[8] - 1) <= 0.15


# --- A100 (DGX A100 80GB) -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def a100():
    return load_profile("a100")


@pytest.fixture(scope="module")
def a100_throughput(a100):
    return predicted_throughput(RESNET50, a100)


def test_a100_anchor_is_the_published_table():
    anchor = anchor_for("a100")
    assert anchor.images_per_s == {1: 2470.0, 8: 16621.0}
    assert (anchor.batch_per_device, anchor.precision) == (256, "mixed")
    assert "DeepLearningExamples" in anchor.source and "A100 80GB" in anchor.source


def test_a100_fits_its_convolutions_to_resnet_and_its_matmuls_to_megatron(a100, a100_throughput):
    # fitted to both published figures: the geometric mean of predicted over published is one
    published = ANCHORS["a100"].images_per_s
    ratio = math.sqrt(a100_throughput[1] / published[1] * a100_throughput[8] / published[8])
    assert ratio == pytest.approx(1.0, abs=0.02)  # the stored value is the fit, rounded to 0.01
    numbers = [*a100.compute.model_dump().values(), *a100.training.model_dump().values()]
    numbers += [number for link in a100.links for number in (link.bandwidth.model_dump(), link.latency.model_dump())]
    fitted = [entry["source"] for entry in numbers if entry is not None and entry["source"].startswith("fitted")]
    assert fitted == [a100.compute.cube_efficiency.source, a100.compute.matmul_efficiency.source]
    assert "bench/calibrate.py" in fitted[0] and "Megatron-LM's 7.5B row alone" in fitted[1]


def test_a100_one_gpu_within_15_percent(a100_throughput):
    assert abs(a100_throughput[1] / ANCHORS["a100"].images_per_s[1] - 1) <= 0.15


def test_a100_eight_gpu_within_15_percent(a100_throughput):
    assert abs(a100_throughput[8] / ANCHORS["a100"].images_per_s[8] - 1) <= 0.15


def test_a100_predicts_near_linear_scaling(a100_throughput):
    # what the model leaves out (the host) is why the published run scales 0.84; the model's own is near 1
    assert 0.95 <= a100_throughput[8] / (8 * a100_throughput[1]) <= 1.0001


# --- H100 (DGX H100) ----------------------------------------------------------------------------


def test_h100_plans_resnet50_at_eight_devices():
    import autopar

    plan = autopar.plan(RESNET50, devices=8, cost_model="h100", batch=2048)
    assert plan.file.cost_model == "h100"
    assert 0 < plan.objective < float("inf")
    a100_dp = data_parallel_throughput(RESNET50, load_profile("a100"), 8)
    h100_dp = data_parallel_throughput(RESNET50, load_profile("h100"), 8)
    assert h100_dp > a100_dp  # more FLOPS, more HBM bandwidth, faster links


def test_profile_without_anchor_says_which_have_one():
    with pytest.raises(CostModelError, match=r"no published ResNet-50 figure.*a100, ascend910"):
        anchor_for("h100")
