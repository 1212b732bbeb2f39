"""Calibrate and check a bundled profile against its published ResNet-50 figures.

Anchors (autopar.search.calibration.ANCHORS), ResNet-50 v1.5 training, data-parallel plan:
- ascend910: MindSpore, Ascend 910, batch 256 per chip, mixed precision: 2115 images/s on 1 chip,
  16,600 on 8 (scaling 0.98).
- a100: NVIDIA DeepLearningExamples (PyTorch), DGX A100 80GB, AMP, batch 256 per GPU: 2470 images/s
  on 1 GPU, 16,621 on 8 (scaling 0.84).

Usage: python bench/calibrate.py [--cost-model NAME] [--fit]
Prints the data-parallel plan's predicted throughput next to the published one; with --fit it
also bisects the cube efficiency that makes the one-device prediction exact (the value stored,
rounded, in costmodels/NAME.toml as `cube_efficiency`). A profile without an anchor (h100) gets
its predictions only.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from autopar.cost import load_profile  # noqa: E402
from autopar.search.calibration import (  # noqa: E402
    ANCHORS,
    data_parallel_throughput,
    fit_cube_efficiency,
    predicted_throughput,
)

MODEL = ROOT / "models" / "resnet50.onnx"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cost-model", default="ascend910", help="bundled profile name (default ascend910)")
    parser.add_argument("--fit", action="store_true", help="bisect the cube efficiency that matches 1 device")
    args = parser.parse_args()
    profile = load_profile(args.cost_model)
    anchor = ANCHORS.get(profile.name)
    if anchor is None:
        print(f"{profile.name}: no published anchor; predictions at 256 images per device, mixed precision")
        for n in (1, 8):
            print(f"{n} device(s): predicted {data_parallel_throughput(MODEL, profile, n):8.0f} images/s")
        return
    print(f"{profile.name}: {anchor.source}")
    if args.fit:
        print(
            f"fitted cube_efficiency = {fit_cube_efficiency(MODEL, profile):.4f}"
            f" (profile has {profile.compute.cube_efficiency.value})"
        )
    published = anchor.images_per_s
    results = predicted_throughput(MODEL, profile)
    for n, value in results.items():
        error = value / published[n] - 1
        print(f"{n} device(s): predicted {value:8.0f} images/s, published {published[n]:8.0f}  ({error:+.1%})")
    scaling = results[8] / (8 * results[1])
    print(f"8-device scaling: predicted {scaling:.3f}, published {published[8] / (8 * published[1]):.3f}")
    if anchor.note:
        print(f"note: {anchor.note}")


if __name__ == "__main__":
    main()
