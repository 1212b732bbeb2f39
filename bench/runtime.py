"""Wall time of the training step's verification: virtual ranks and torch.distributed processes.

Usage: python bench/runtime.py [--cases resnet50,gpt,gpt-pipeline,resnet50-pipeline,random]

Runs the real command line in a fresh process (interpreter start-up, import, search, reference
and the sharded step included) with ``--format json`` and prints, per case and runtime, the
wall time, the parameters whose gradients were checked, the largest errors, and whether the
collectives (and, pipelined, the point-to-point messages) executed equal the plan's in every phase.
  resnet50           the bundled ResNet-50 at batch 8 on 8 devices (the issue's acceptance command)
  gpt                a 2-layer GPT (hidden 256, 8 heads, sequence 128, batch 8) on 8 devices
  gpt-pipeline       a 4-layer GPT (hidden 256, 8 heads, sequence 128, batch 8) on 8 devices: 2 stages x 4
                     micro-batches, each stage Megatron's tensor 2 x data 2 (fixed), the rest searched
  resnet50-pipeline  the bundled ResNet-50 at batch 8 on 8 devices, 2 stages x 2 micro-batches
  random             20 random pipelined assignments (cuts, stage counts, micro-batches, strategies) of a
                     2-layer GPT (hidden 32, sequence 16, batch 8) on 8 virtual devices, in this process
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

from autopar.lowering.decisions import degrees  # noqa: E402
from autopar.lowering.planfile import read_plan_file  # noqa: E402
from bench.megatron import megatron_strategies  # noqa: E402
from models.transformer import build_transformer  # noqa: E402
from tests.pipelines import random_pipelined_plans  # noqa: E402

PIPELINED = {"gpt-pipeline", "resnet50-pipeline"}


def case_arguments(case: str, folder: Path) -> list[str]:
    if case.startswith("resnet50"):
        arguments = [str(ROOT / "models" / "resnet50.onnx"), "--devices", "8", "--batch", "8"]
    else:
        layers = 4 if case == "gpt-pipeline" else 2
        path = folder / f"{case}.onnx"
        model = build_transformer(kind="gpt", layers=layers, hidden=256, heads=8, seq=128, vocab=1024, batch=8)
        onnx.save(model, path)
        arguments = [str(path), "--devices", "8"]
    if case in PIPELINED:
        arguments += ["--plan", str(pipelined_plan(case, arguments, folder))]
    return arguments


def pipelined_plan(case: str, arguments: list[str], folder: Path) -> Path:
    """The case's 2-stage plan, fixed in semi-auto, written by the command line."""
    flags = ["--pipeline-stages", "2", "--micro-batches", "4" if case == "gpt-pipeline" else "2"]
    if case == "gpt-pipeline":
        strategies = folder / "megatron.json"
        strategies.write_text(json.dumps(megatron_strategies(4, tp=2, dp=2)))
        flags += ["--strategies", str(strategies)]
    plan = folder / f"{case}.plan.json"
    command = [sys.executable, "-m", "autopar", "plan", *arguments, *flags, "--format", "json", "-q"]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, check=False)
    if done.returncode:
        raise SystemExit(f"planning {case} failed: {done.stderr.strip()}")
    plan.write_text(done.stdout)
    file = read_plan_file(json.loads(done.stdout))
    print(f"| {case} | plan | {degrees(file)}, {file.memory_plan.micro_batches} micro-batches | | | | | |", flush=True)
    return plan


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


def random_pipelines(draws: int = 20) -> str:
    """Random pipelined assignments on virtual devices (`tests.pipelines.random_pipelined_plans`)."""
    import autopar

    model = build_transformer(kind="gpt", layers=2, hidden=32, heads=4, seq=16, vocab=32, batch=8, weights="random")
    passed, worst, started, shapes = 0, 0.0, time.perf_counter(), set()
    plans = random_pipelined_plans(model)
    for done in range(draws):
        stages, micro_batches, _, plan = next(plans)
        report = autopar.verify(model, plan, seed=done, gradients=True)
        shapes.add((stages, micro_batches))
        same = report.collectives["executed"] == report.collectives["planned"]
        passed += report.ok and same
        if report.gradients is not None:
            worst = max(worst, report.gradients.max_abs_error)
    wall = time.perf_counter() - started
    return (
        f"| virtual (1 process) | {wall:.1f} s | {passed} of {draws} ok | shapes (S, M) {sorted(shapes)}"
        f" | {worst:.2e} | | |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="resnet50,gpt,gpt-pipeline,resnet50-pipeline,random")
    args = parser.parse_args()
    print("| case | runtime | wall | verdict | gradients | max abs / rel error | collectives run | vs plan |")
    print("|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as folder:
        for case in args.cases.split(","):
            if case == "random":
                print(f"| {case} " + random_pipelines(), flush=True)
                continue
            arguments = case_arguments(case, Path(folder))
            for runtime in ("virtual", "torch"):
                print(f"| {case} " + run(arguments, runtime), flush=True)


if __name__ == "__main__":
    main()
