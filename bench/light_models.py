"""Plan and verify the onnx package's model-zoo test files (weights elided) on N devices.

Usage: python bench/light_models.py [--devices 8] [--batch 32] [--no-verify] [--models alexnet,vgg19]
The files ship inside the onnx wheel (onnx/backend/test/data/light/*.onnx). For each model it
prints the operator count after folding, the fallback count, the search time, the predicted
step time against data parallel, and (unless --no-verify) the verification result and time.
Verification runs every rank on this machine's CPU: at batch 32 the big CNNs take minutes.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import onnx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's autopar, however the script is run

import autopar  # noqa: E402


def light_models() -> list[Path]:
    return sorted((Path(onnx.__file__).parent / "backend" / "test" / "data" / "light").glob("light_*.onnx"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--no-verify", action="store_true")
    parser.add_argument("--models", default="", help="comma-separated names (default: all nine)")
    args = parser.parse_args()
    wanted = {name.strip() for name in args.models.split(",") if name.strip()}
    print(
        f"{'model':<20}{'ops':>6}{'fallbacks':>10}{'search s':>10}{'plan s':>8}{'step ms':>10}{'DP ms':>10}"
        f"{'verify':>9}{'verify s':>10}{'max rel err':>13}"
    )
    for path in light_models():
        name = path.stem.removeprefix("light_")
        if wanted and name not in wanted:
            continue
        start = time.perf_counter()
        plan = autopar.plan(path, devices=args.devices, batch=args.batch)
        plan_s = time.perf_counter() - start
        dp = autopar.plan(plan.problem.graph, devices=args.devices, mode="data_parallel")
        verdict, verify_s, error = "-", 0.0, float("nan")
        if not args.no_verify:
            report = autopar.verify(path, plan)
            verdict, verify_s = ("ok" if report.ok else "FAILED"), report.time_s
            error = max(entry["max_rel_error"] for entry in report.outputs.values())
        summary = plan.to_dict()["search"]
        print(
            f"{name:<20}{len(plan.problem.rules):>6}{len(plan.fallback_ops):>10}{summary['time_s']:>10.3f}"
            f"{plan_s:>8.2f}{plan.objective * 1e3:>10.3f}{dp.objective * 1e3:>10.3f}{verdict:>9}{verify_s:>10.1f}"
            f"{error:>13.2e}",
            flush=True,
        )


if __name__ == "__main__":
    main()
