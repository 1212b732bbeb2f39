"""Wall time of the training step's verification: virtual ranks and torch.distributed processes.

Usage: python bench/runtime.py [--cases resnet50,gpt]

Runs the real command line in a fresh process (interpreter start-up, import, search, reference
and the sharded step included) with ``--format json`` and prints, per case and runtime, the
wall time, the parameters whose gradients were checked, the largest errors, and whether the
collectives executed equal the plan's in every phase.
  resnet50  the bundled ResNet-50 at batch 8 on 8 devices (the issue's acceptance command)
  gpt       a 2-layer GPT (hidden 256, 8 heads, sequence 128, batch 8) on 8 devices
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

from models.transformer import build_transformer  # noqa: E402


def case_arguments(case: str, folder: Path) -> list[str]:
    if case == "resnet50":
        return [str(ROOT / "models" / "resnet50.onnx"), "--devices", "8", "--batch", "8"]
    path = folder / "gpt.onnx"
    onnx.save(build_transformer(kind="gpt", layers=2, hidden=256, heads=8, seq=128, vocab=1024, batch=8), path)
    return [str(path), "--devices", "8"]


def run(arguments: list[str], runtime: str) -> str:
    flags = ["--runtime", "torch"] if runtime == "torch" else ["--gradients"]
    command = [sys.executable, "-m", "autopar", "verify", *arguments, *flags, "--format", "json"]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - started
    if not done.stdout:
        return f"| {runtime} | {wall:.1f} s | failed: {done.stderr.strip()} |"
    report = json.loads(done.stdout)
    gradients = report["gradients"]
    collectives = report["collectives"]
    same = collectives["executed"] == collectives["planned"]
    counts = {phase: sum(e["count"] for e in entries.values()) for phase, entries in collectives["executed"].items()}
    return (
        f"| {runtime} ({report['processes']} process{'es' if report['processes'] > 1 else ''}) | {wall:.1f} s"
        f" | {'ok' if report['ok'] else 'FAILED'} | {gradients['checked']}"
        f" | {gradients['max_abs_error']:.2e} / {gradients['max_rel_error']:.2e}"
        f" | {counts} | {'equal' if same else 'DIFFERENT'} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="resnet50,gpt")
    args = parser.parse_args()
    print("| case | runtime | wall | verdict | gradients | max abs / rel error | collectives run | vs plan |")
    print("|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as folder:
        for case in args.cases.split(","):
            arguments = case_arguments(case, Path(folder))
            for runtime in ("virtual", "torch"):
                print(f"| {case} " + run(arguments, runtime), flush=True)


if __name__ == "__main__":
    main()
