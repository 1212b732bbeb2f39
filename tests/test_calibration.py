"""The Ascend 910 profile reproduces MindSpore's published ResNet-50 throughput.

Anchor (MindSpore benchmark, ResNet-50 v1.5, Ascend 910, batch 256/chip, mixed precision):
2115 images/s on 1 chip, 16,600 on 8 (scaling 0.98). bench/calibrate.py prints the figures.
"""

from __future__ import annotations

import pytest

from bench.calibrate import PUBLISHED, predicted_throughput
from autopar.cost import load_profile


@pytest.fixture(scope="module")
def throughput():
    profile = load_profile("ascend910")
    return {n: predicted_throughput(profile, n) for n in (1, 8)}


@pytest.mark.parametrize("devices", [1, 8])
def test_data_parallel_throughput_within_15_percent(throughput, devices):
    assert abs(throughput[devices] / PUBLISHED[devices] - 1) <= 0.15


def test_eight_chip_scaling(throughput):
    scaling = throughput[8] / (8 * throughput[1])
    assert 0.95 <= scaling <= 1.00
