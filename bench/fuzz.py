"""The long fuzz run: thousands of bad inputs, each in its own `autopar` process.

Usage: python bench/fuzz.py [--per-category 400] [--seed 1] [--timeout 60] [--jobs 2]
Cases come from tests/fuzz/cases.py (mutated model bytes and structure, bad flags, bad cost
models, bad plan files). Each runs as ``python -m autopar ...`` with a wall-clock limit; the
table gives, per category, the exits, the cases that broke a promise (traceback, exit 3,
warning noise, a non-finite or invalid plan), the time-outs, and the peak RSS of one process.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.fuzz.cases import CATEGORIES, Case, generate, judge  # noqa: E402


def run_case(case: Case, timeout_s: float) -> tuple[Case, int, float, str | None]:
    """(case, exit code, seconds, problem) of one case in a fresh process."""
    with tempfile.TemporaryDirectory() as name:
        folder = Path(name)
        for file_name, data in case.files.items():
            (folder / file_name).write_bytes(data)
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        start = time.perf_counter()
        process = subprocess.Popen(
            [sys.executable, "-m", "autopar", *case.argv], cwd=folder, env=env, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )  # fmt: skip
        timer = threading.Timer(timeout_s, process.kill)
        timer.start()
        stdout, stderr = process.communicate()
        timer.cancel()
        seconds = time.perf_counter() - start
    code = process.returncode
    out, err = stdout.decode("utf-8", "replace"), stderr.decode("utf-8", "replace")
    if seconds >= timeout_s and code < 0:
        return case, code, seconds, f"killed after {timeout_s:.0f} s"
    return case, code, seconds, judge(case, code, out, err)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-category", type=int, default=400)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args()
    cases = generate(args.seed, args.per_category)
    exits: dict[str, Counter[int]] = defaultdict(Counter)
    broken: dict[str, list[str]] = defaultdict(list)
    slowest: dict[str, float] = defaultdict(float)
    start = time.perf_counter()
    with ThreadPoolExecutor(args.jobs) as pool:
        for done, (case, code, seconds, problem) in enumerate(pool.map(lambda c: run_case(c, args.timeout), cases), 1):
            exits[case.category][code] += 1
            slowest[case.category] = max(slowest[case.category], seconds)
            if problem:
                broken[case.category].append(f"{case.label}: {' '.join(case.argv)}: {problem}")
            if done % 200 == 0:
                print(f"... {done}/{len(cases)} cases, {time.perf_counter() - start:.0f} s", file=sys.stderr)
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024  # the largest child's high-water mark
    print(
        f"{'category':<17}{'cases':>7}{'exit 0':>8}{'exit 1':>8}{'exit 2':>8}{'exit 3':>8}{'broken':>8}"
        f"{'timeouts':>10}{'slowest s':>11}"
    )
    for category in CATEGORIES:
        count = exits[category]
        timeouts = sum(1 for line in broken[category] if "killed after" in line)
        print(
            f"{category:<17}{sum(count.values()):>7}{count[0]:>8}{count[1]:>8}{count[2]:>8}{count[3]:>8}"
            f"{len(broken[category]):>8}{timeouts:>10}{slowest[category]:>11.1f}"
        )
    print(f"total {len(cases)} cases in {time.perf_counter() - start:.0f} s; peak RSS of one process {peak:.0f} MB")
    for category in CATEGORIES:
        for line in broken[category][:10]:
            print(f"BROKEN {category}: {line}")


if __name__ == "__main__":
    main()
