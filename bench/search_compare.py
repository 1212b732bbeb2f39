"""DP against the exact ILP (HiGHS) on the bundled ResNet-50: objectives and search times side by side.

Usage: python bench/search_compare.py [--devices 8 64]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import autopar  # noqa: E402
from autopar.search.driver import SearchOptions, run_search  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, nargs="+", default=[8, 64])
    args = parser.parse_args()
    graph = autopar.load_model(ROOT / "models" / "resnet50.onnx")
    for devices in args.devices:
        problem = autopar.build(graph, devices)
        results = {}
        for algorithm in ("dp", "ilp"):
            start = time.perf_counter()
            choice = run_search(problem, SearchOptions(algorithm=algorithm)).choice
            results[algorithm] = (problem.objective(choice), time.perf_counter() - start)
        (dp, dp_s), (ilp, ilp_s) = results["dp"], results["ilp"]
        print(
            f"{devices:>3} devices: DP {dp * 1e3:.6f} ms in {dp_s:.3f} s | ILP {ilp * 1e3:.6f} ms in {ilp_s:.3f} s"
            f" | relative difference {abs(dp - ilp) / ilp:.1e}"
        )


if __name__ == "__main__":
    main()
