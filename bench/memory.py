"""Memory as the hardware shows it: activation bytes per GPT layer, and GPT-3 175B on Ascend 910.

Usage: python bench/memory.py [--skip-175b]

1. Activations kept per layer of a GPT decoder (fused LayerNorm and GELU, no dropout, FP16),
   measured as the difference between the 3-layer and the 2-layer model on one device, against
   Korthikanti et al. (2022), "Reducing Activation Recomputation in Large Transformer Models":
   32sbh + 2as^2b bytes, at three shapes.
2. GPT-3 175B (96 layers, hidden 12288, 96 heads, seq 2048, global batch 1536, weights elided)
   planned by the real command line on 1024, 128 and 64 Ascend 910 devices (32 GB each): the
   wall time, the step, MFU, memory per device by kind and the memory plan, or the refusal.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import onnx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import autopar  # noqa: E402
from models.transformer import build_preset, build_transformer  # noqa: E402

SHAPES = [(512, 8, 1024, 16), (1024, 2, 1536, 16), (2048, 1, 2048, 32)]  # (s, b, h, a)


def layer_activations(seq: int, batch: int, hidden: int, heads: int) -> int:
    def total(layers: int) -> int:
        model = build_transformer(
            kind="gpt", layers=layers, hidden=hidden, heads=heads, seq=seq, batch=batch, vocab=1024, gelu="fused"
        )
        return autopar.plan(model, devices=1).to_dict()["totals"]["memory_breakdown"]["activations"]

    return total(3) - total(2)


def plan_175b(path: Path, devices: int) -> str:
    started = time.perf_counter()
    command = [sys.executable, "-m", "autopar", "plan", str(path), "--devices", str(devices), "--format", "json"]
    done = subprocess.run([*command, "--quiet"], capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        return f"| {devices} | {wall:.1f} s | refused (exit {done.returncode}): {done.stderr.strip()} |"
    plan = json.loads(done.stdout)
    totals, memory_plan = plan["totals"], plan["memory_plan"]
    breakdown = ", ".join(f"{key} {value / 1e9:.2f} GB" for key, value in totals["memory_breakdown"].items())
    mfu = totals["ideal_step_time_s"] / totals["step_time_s"]
    return (
        f"| {devices} | {wall:.1f} s | step {totals['step_time_s']:.3f} s, MFU {mfu:.1%},"
        f" {totals['memory_per_device_bytes'] / 1e9:.2f} of"
        f" {(totals['memory_capacity_bytes'] - totals.get('memory_reserve_bytes', 0)) / 1e9:.1f} GB usable"
        f" ({breakdown}); parallel optimizer on {len(memory_plan['parallel_optimizer'])} parameters,"
        f" recompute {memory_plan['recompute'] or 'none'}; exposed communication"
        f" {totals['communication_s']:.3f} s, hidden {totals['hidden_communication_s']:.3f} s |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-175b", action="store_true", help="only the per-layer activation check")
    args = parser.parse_args()
    print("| s | b | h | a | activations per layer | 32sbh + 2as^2b | ratio |")
    print("|---|---|---|---|---|---|---|")
    for s, b, h, a in SHAPES:
        measured = layer_activations(s, b, h, a)
        published = 32 * s * b * h + 2 * a * s * s * b
        ratio = measured / published
        print(f"| {s} | {b} | {h} | {a} | {measured / 1e6:.2f} MB | {published / 1e6:.2f} MB | {ratio:.4f} |")
    if args.skip_175b:
        return
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "gpt3_175b.onnx"
        onnx.save(build_preset("gpt3", batch=1536), path)
        print()
        print("| devices | wall | GPT-3 175B, global batch 1536, Ascend 910 |")
        print("|---|---|---|")
        for devices in (1024, 128, 64):
            print(plan_175b(path, devices), flush=True)


if __name__ == "__main__":
    main()
