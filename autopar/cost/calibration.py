"""Calibration of a profile against published training throughput (ResNet-50 on Ascend 910).

Anchor: MindSpore's published ResNet-50 v1.5 training throughput on ImageNet, Ascend 910,
batch 256 per chip, mixed precision: 2115 images/s on 1 chip and 16,600 on 8 (scaling 0.98).
Only the cube efficiency is fitted, to the one-chip figure; the eight-chip figure and the
scaling are predictions the tests hold the profile to. ``bench/calibrate.py`` prints them.
"""

from __future__ import annotations

from pathlib import Path

import onnx

from autopar.cost.model import CostModel
from autopar.cost.profile import HardwareProfile
from autopar.graph import Graph, load_model
from autopar.search.driver import data_parallel_choice
from autopar.search.problem import build_problem

PUBLISHED_RESNET50_IMAGES_PER_S = {1: 2115.0, 8: 16600.0}
PER_CHIP_BATCH = 256


def data_parallel_throughput(
    model: str | Path | onnx.ModelProto | Graph, profile: HardwareProfile, devices: int
) -> float:
    """Images per second of the data-parallel plan at 256 images per chip.

    ``model`` is a file or proto (imported at 256 x ``devices`` images) or a graph already at that batch.
    """
    batch = PER_CHIP_BATCH * devices
    graph = model if isinstance(model, Graph) else load_model(model, batch=batch)
    problem = build_problem(graph, CostModel(profile), devices)
    return batch / problem.objective(data_parallel_choice(problem))


def with_cube_efficiency(profile: HardwareProfile, value: float) -> HardwareProfile:
    """The same profile with another cube efficiency (its source unchanged)."""
    compute = profile.compute.model_copy(
        update={"cube_efficiency": profile.compute.cube_efficiency.model_copy(update={"value": value})}
    )
    return profile.model_copy(update={"compute": compute})


def fit_cube_efficiency(model: str | Path | onnx.ModelProto, profile: HardwareProfile, steps: int = 40) -> float:
    """Bisect the cube efficiency whose one-chip prediction equals the published figure."""
    graph = load_model(model, batch=PER_CHIP_BATCH)
    target = PUBLISHED_RESNET50_IMAGES_PER_S[1]
    low, high = 0.01, 1.0
    for _ in range(steps):
        middle = (low + high) / 2
        if data_parallel_throughput(graph, with_cube_efficiency(profile, middle), 1) < target:
            low = middle
        else:
            high = middle
    return (low + high) / 2
