"""The Ascend 910 profile reproduces MindSpore's published ResNet-50 throughput.

Anchor (MindSpore benchmark, ResNet-50 v1.5, Ascend 910, batch 256/chip, mixed precision):
2115 images/s on 1 chip, 16,600 on 8 (scaling 0.98). The cube efficiency is fitted to the
one-chip figure, so that figure is checked as a fit (the stored value is what the fit gives);
the eight-chip figure and the scaling are predictions. bench/calibrate.py prints the figures.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from autopar.cost import load_profile
from autopar.cost.calibration import PUBLISHED_RESNET50_IMAGES_PER_S, data_parallel_throughput, fit_cube_efficiency

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
