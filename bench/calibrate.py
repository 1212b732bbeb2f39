"""Calibrate and check a bundled profile against its published ResNet-50 figures.

Anchors (autopar.search.calibration.ANCHORS), ResNet-50 v1.5 training, data-parallel plan:
- ascend910: MindSpore, Ascend 910, batch 256 per chip, mixed precision: 2115 images/s on 1 chip,
  16,600 on 8 (scaling 0.98).
- a100: NVIDIA DeepLearningExamples (PyTorch), DGX A100 80GB, AMP, batch 256 per GPU: 2470 images/s
  on 1 GPU, 16,621 on 8 (scaling 0.84).

A transformer (autopar.search.calibration.TRANSFORMER_ANCHORS):
- ascend910: MindSpore, BERT-Large (24 layers, hidden 1,024, 128 tokens, vocabulary 21,128), batch 96 per
  chip, mixed precision: 269 sentences/s on 1 chip, 2069 on 8; built by models/transformer.py.

Usage: python bench/calibrate.py [--cost-model NAME] [--fit]
Prints the data-parallel plan's predicted throughput next to the published one; with --fit it
also bisects the cube efficiency that makes the one-device ResNet-50 prediction exact and the matmul
efficiency that makes the one-device transformer prediction exact (the values stored, rounded, in
costmodels/NAME.toml as `cube_efficiency` and `matmul_efficiency`). A profile without an anchor (h100)
gets its predictions only.
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
    TRANSFORMER_ANCHORS,
    data_parallel_throughput,
    fit_cube_efficiency,
    fit_matmul_efficiency,
    predicted_throughput,
)
from models.transformer import build_transformer  # noqa: E402

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
    transformer(profile, args.fit)


def transformer(profile, fit: bool) -> None:
    """The transformer anchor's figures (and its matmul fit), where the profile has one."""
    anchor = TRANSFORMER_ANCHORS.get(profile.name)
    if anchor is None:
        return
    model = build_transformer(batch=anchor.batch_per_device, **anchor.shape)
    print(f"\n{profile.name}: {anchor.source}")
    if fit:
        print(
            f"fitted matmul_efficiency = {fit_matmul_efficiency(model, profile, anchor):.4f}"
            f" (profile has {profile.compute.matmul_efficiency.value})"
        )
    for n, published in anchor.sequences_per_s.items():
        value = data_parallel_throughput(model, profile, n, anchor.batch_per_device)
        error = value / published - 1
        print(f"{n} device(s): predicted {value:8.0f} sequences/s, published {published:8.0f}  ({error:+.1%})")
    print(f"note: {anchor.note}")


if __name__ == "__main__":
    main()
