"""Median wall time of the whole `autopar plan` command on the bundled ResNet-50.

Usage: python bench/plan_time.py [--runs 7] [--devices 8]
Runs the real command line in a fresh process each time (interpreter start-up, imports,
ONNX import, costing, search and JSON output included) and prints the median and spread.
It also reports the search alone for 8 and 64 devices, from the plan's own timer.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "models" / "resnet50.onnx"


def command(devices: int) -> list[str]:
    script = shutil.which("autopar")
    prefix = [script] if script else [sys.executable, "-m", "autopar.cli"]
    return prefix + ["plan", str(MODEL), "--devices", str(devices), "--format", "json"]


def time_command(devices: int, runs: int) -> tuple[list[float], dict]:
    times, plan = [], {}
    for _ in range(runs):
        start = time.perf_counter()
        done = subprocess.run(command(devices), capture_output=True, text=True, cwd=ROOT, check=True)
        times.append(time.perf_counter() - start)
        plan = json.loads(done.stdout)
    return times, plan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--devices", type=int, nargs="+", default=[8, 64])
    args = parser.parse_args()
    for devices in args.devices:
        times, plan = time_command(devices, args.runs)
        print(
            f"autopar plan resnet50 --devices {devices}: median {statistics.median(times):.3f} s"
            f" (min {min(times):.3f}, max {max(times):.3f}, {args.runs} runs);"
            f" search alone {plan['search']['time_s']:.3f} s over {plan['search']['candidates']} candidates;"
            f" step {plan['totals']['step_time_s'] * 1e3:.3f} ms vs data parallel"
            f" {plan['totals']['data_parallel_step_time_s'] * 1e3:.3f} ms"
        )


if __name__ == "__main__":
    main()
