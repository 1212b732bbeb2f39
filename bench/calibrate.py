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

from autopar.cost import load_profile  # noqa: E402
from autopar.cost.calibration import (  # noqa: E402
    PUBLISHED_RESNET50_IMAGES_PER_S,
    data_parallel_throughput,
    fit_cube_efficiency,
)

MODEL = ROOT / "models" / "resnet50.onnx"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fit", action="store_true", help="bisect the cube efficiency that matches 1 chip")
    args = parser.parse_args()
    profile = load_profile("ascend910")
    if args.fit:
        print(
            f"fitted cube_efficiency = {fit_cube_efficiency(MODEL, profile):.4f}"
            f" (profile has {profile.compute.cube_efficiency.value})"
        )
    published = PUBLISHED_RESNET50_IMAGES_PER_S
    results = {n: data_parallel_throughput(MODEL, profile, n) for n in published}
    for n, value in results.items():
        error = value / published[n] - 1
        print(f"{n} chip(s): predicted {value:8.0f} images/s, published {published[n]:8.0f}  ({error:+.1%})")
    scaling = results[8] / (8 * results[1])
    print(f"8-chip scaling: predicted {scaling:.3f}, published {published[8] / (8 * published[1]):.3f}")


if __name__ == "__main__":
    main()
