"""Calibrate and check the Ascend 910 profile against MindSpore's published ResNet-50 figures.

Anchor (MindSpore benchmark page, ResNet-50 v1.5 on ImageNet, Ascend 910, batch 256 per chip,
mixed precision): 2115 images/s on 1 chip and 16,600 images/s on 8 chips (scaling 0.98).

Usage: python bench/calibrate.py [--fit]
Prints the data-parallel plan's predicted throughput next to the published one; with --fit it
also bisects the cube efficiency that makes the one-chip prediction exact (the value stored,
rounded, in costmodels/ascend910.toml as `cube_efficiency`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from autopar.cost import CostModel, load_profile  # noqa: E402
from autopar.graph import load_model  # noqa: E402
from autopar.search.driver import data_parallel_choice  # noqa: E402
from autopar.search.problem import build_problem  # noqa: E402

PUBLISHED = {1: 2115.0, 8: 16600.0}
PER_CHIP_BATCH = 256
MODEL = ROOT / "models" / "resnet50.onnx"


def predicted_throughput(profile, devices: int) -> float:
    """Images per second of the data-parallel plan at 256 images per chip."""
    batch = PER_CHIP_BATCH * devices
    graph = load_model(MODEL, batch=batch)
    problem = build_problem(graph, CostModel(profile), devices)
    return batch / problem.objective(data_parallel_choice(problem))


def with_cube_efficiency(profile, value: float):
    compute = profile.compute.model_copy(update={
        "cube_efficiency": profile.compute.cube_efficiency.model_copy(update={"value": value})})
    return profile.model_copy(update={"compute": compute})


def fit_cube_efficiency(profile) -> float:
    low, high = 0.01, 1.0
    for _ in range(40):
        middle = (low + high) / 2
        if predicted_throughput(with_cube_efficiency(profile, middle), 1) < PUBLISHED[1]:
            low = middle
        else:
            high = middle
    return (low + high) / 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fit", action="store_true", help="bisect the cube efficiency that matches 1 chip")
    args = parser.parse_args()
    profile = load_profile("ascend910")
    if args.fit:
        print(f"fitted cube_efficiency = {fit_cube_efficiency(profile):.4f}"
              f" (profile has {profile.compute.cube_efficiency.value})")
    results = {n: predicted_throughput(profile, n) for n in PUBLISHED}
    for n, value in results.items():
        error = value / PUBLISHED[n] - 1
        print(f"{n} chip(s): predicted {value:8.0f} images/s, published {PUBLISHED[n]:8.0f}  ({error:+.1%})")
    scaling = results[8] / (8 * results[1])
    print(f"8-chip scaling: predicted {scaling:.3f}, published {PUBLISHED[8] / (8 * PUBLISHED[1]):.3f}")


if __name__ == "__main__":
    main()
