"""The yardstick: Megatron-LM's published GPT runs, written as Megatron configured them and planned by autopar.

Usage: python bench/megatron.py [--rows 7.5b,18.4b,39.1b,76.1b] [--timeout 600] [--fit]

Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM" (SC21), Table 1: GPT models on A100 80 GB DGX nodes (8 GPUs on NVLink a node,
InfiniBand between), sequence 2048, vocabulary 51,200, mixed precision, Adam, activation
recomputation. The rows with a power-of-two GPU count:

    model  layers hidden heads GPUs batch  Megatron's config  published TF/GPU
    7.5B   36     4096   32    128  512    TP 4, PP 1         142 (46 %)
    18.4B  40     6144   48    256  1024   TP 8, PP 1         135 (43 %)
    39.1B  48     8192   64    512  1536   TP 8, PP 2         138 (44 %)
    76.1B  60     10240  80    1024 1792   TP 8, PP 4         140 (45 %)

For each row, two fresh `autopar plan` processes on the a100 profile with Adam:
- Megatron's configuration in semi-auto: every layer's Q, K, V and fc1 MatMuls split their weight's
  columns TP ways and the attention output and fc2 MatMuls their weight's rows (Megatron's column-
  and row-parallel linears, on the fastest mesh bits: inside a node), the batch split over the rest
  of a stage's devices, PP pipeline stages, every layer recomputed (--recompute); the search fills in
  every other operator and the micro-batch count.
- autopar's own plan: nothing fixed, recomputation only where memory binds.
Achieved teraFLOP/s per GPU are counted with the paper's formula (its equation 3, which counts the
recomputed forward): 96 B s l h^2 (1 + s / (6 h) + V / (16 l h)) / (step x GPUs). The planning times are
with the compiled kernels where numba is installed (`autopar[fast]`, the first line says which).

One number of the a100 profile is fitted to these runs, on the 7.5B row alone: `matmul_efficiency`,
the share of peak large matrix products reach. ``--fit`` bisects the value at which Megatron's 7.5B
configuration predicts its published 142 TF/GPU (stored, rounded, in costmodels/a100.toml); the
three larger rows are the check, never the fit.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import sys
import tempfile
from pathlib import Path

import onnx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import autopar  # noqa: E402
from autopar.cost import load_profile  # noqa: E402
from autopar.lowering.decisions import degrees  # noqa: E402
from autopar.lowering.planfile import read_plan_file  # noqa: E402
from autopar.search import native  # noqa: E402
from autopar.search.calibration import with_compute_number  # noqa: E402
from bench.scale import run_case  # noqa: E402
from models.transformer import build_transformer  # noqa: E402

SEQ, VOCAB = 2048, 51200
ROWS = {  # name: (layers, hidden, heads, GPUs, batch, TP, PP, published TF/GPU)
    "7.5b": (36, 4096, 32, 128, 512, 4, 1, 142),
    "18.4b": (40, 6144, 48, 256, 1024, 8, 1, 135),
    "39.1b": (48, 8192, 64, 512, 1536, 8, 2, 138),
    "76.1b": (60, 10240, 80, 1024, 1792, 8, 4, 140),
}
FLAGS = ("--optimizer", "adam")
FIT_ROW = "7.5b"


def paper_flops(batch: int, layers: int, hidden: int) -> float:
    """FLOPs of one step as Narayanan et al. count them (equation 3, with the recomputed forward)."""
    return 96 * batch * SEQ * layers * hidden**2 * (1 + SEQ / (6 * hidden) + VOCAB / (16 * layers * hidden))


def megatron_strategies(layers: int, tp: int, dp: int) -> dict[str, list[list[int]]]:
    """Megatron's tensor parallelism as in_strategy per MatMul (and its bias Add), the batch split ``dp`` ways."""
    fixed: dict[str, list[list[int]]] = {}
    for i in range(layers):
        for name in (f"layer{i}.attn.q", f"layer{i}.attn.k", f"layer{i}.attn.v", f"layer{i}.mlp.fc1"):
            fixed[name] = [[dp, 1, 1], [1, tp]]  # column parallel: the output's hidden split tp ways
            fixed[f"{name}.bias_add"] = [[dp, 1, tp], [tp]]
        for name in (f"layer{i}.attn.out", f"layer{i}.mlp.fc2"):
            fixed[name] = [[dp, 1, tp], [tp, 1]]  # row parallel: the output partial, AllReduced
    return fixed


def megatron_flags(strategies: Path, pp: int) -> tuple[str, ...]:
    """Megatron's configuration as `autopar plan` flags: its strategies, its stages, every layer recomputed."""
    semi_auto = ("--mode", "semi_auto_parallel", "--strategies", str(strategies))
    return (*FLAGS, *semi_auto, "--pipeline-stages", str(pp), "--recompute")


def model_file(folder: Path, name: str) -> Path:
    """The row's GPT (sequence 2048, vocabulary 51,200, the row's batch) written to ``folder``."""
    layers, hidden, heads, _, batch, _, _, _ = ROWS[name]
    path = folder / f"gpt-{name}.onnx"
    model = build_transformer(kind="gpt", layers=layers, hidden=hidden, heads=heads, seq=SEQ, vocab=VOCAB, batch=batch)
    onnx.save(model, path)
    return path


def fit_matmul_efficiency(folder: Path, steps: int = 14) -> float:
    """Bisect the a100 profile's `matmul_efficiency` at which Megatron's configuration of the 7.5B row
    predicts the published TF/GPU (the prediction falls as the efficiency does)."""
    layers, hidden, _, gpus, batch, tp, pp, published = ROWS[FIT_ROW]
    path = model_file(folder, FIT_ROW)
    profile, flops = load_profile("a100"), paper_flops(batch, layers, hidden)
    low, high = 0.3, 1.0
    for _ in range(steps):
        middle = (low + high) / 2
        plan = autopar.plan(
            path,
            devices=gpus,
            cost_model=with_compute_number(profile, "matmul_efficiency", middle),
            mode="semi_auto_parallel",
            fixed=megatron_strategies(layers, tp, gpus // (tp * pp)),
            optimizer="adam",
            pipeline_stages=pp,
            recompute=True,
        )
        predicted = flops / (plan.file.totals.step_time_s * gpus) / 1e12
        print(f"matmul_efficiency {middle:.4f}: {predicted:.1f} TF/GPU (published {published})", flush=True)
        low, high = (middle, high) if predicted < published else (low, middle)
    return (low + high) / 2


def describe(result: dict) -> str:
    """The plan's degrees and micro-batches (or why there is none)."""
    if "error" in result:
        return f"refused: {result['error'][:120]}"
    plan = read_plan_file(result["plan"])
    recompute = ", recomputed" if plan.memory_plan.recompute else ""
    micro = plan.memory_plan.micro_batches
    return f"{degrees(plan)}, {micro} micro-batch{'es' if micro > 1 else ''}{recompute}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--fit", action="store_true", help=f"bisect matmul_efficiency on the {FIT_ROW} row, then stop")
    args = parser.parse_args()
    if args.fit:
        with tempfile.TemporaryDirectory() as folder:
            print(f"fitted matmul_efficiency = {fit_matmul_efficiency(Path(folder)):.4f}")
        return
    print(f"kernels: {kernels()}\n")
    print(
        "| model | GPUs | Megatron's config | its predicted TF/GPU (vs published) | autopar's plan | predicted TF/GPU |"
        " plan wall | plan RSS | where the planning time goes |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as folder:
        for name in args.rows.split(","):
            layers, hidden, _, gpus, batch, tp, pp, published = ROWS[name]
            path = model_file(Path(folder), name)
            strategies = Path(folder) / f"megatron-{name}.json"
            strategies.write_text(json.dumps(megatron_strategies(layers, tp, gpus // (tp * pp))))
            flops = paper_flops(batch, layers, hidden)
            theirs = run_case(path, gpus, args.timeout, "a100", megatron_flags(strategies, pp))
            ours = run_case(path, gpus, args.timeout, "a100", FLAGS)
            print(
                f"| {name} | {gpus} | TP {tp}, PP {pp}: {describe(theirs)} |"
                f" {tf_cell(theirs, flops, gpus, published)} |"
                f" {describe(ours)} | {tf_cell(ours, flops, gpus, published)} | {ours['wall']:.1f} s |"
                f" {ours['rss'] / 2**30:.2f} GiB | {phases(ours)} |",
                flush=True,
            )


def kernels() -> str:
    """Whether the planning processes run the compiled kernels (`autopar.search.native`), which change how
    long planning takes, never the plan."""
    if not native.enabled():
        return "numpy (numba not installed, or AUTOPAR_NATIVE=0)"
    return f"compiled (numba {importlib.metadata.version('numba')})"


def phases(result: dict) -> str:
    """The plan's phases in seconds (`search.phases_s`: import, costing, search, lowering); the rest of the
    wall is the process starting, reading the file and writing the plan."""
    found = result.get("plan", {}).get("search", {}).get("phases_s") or {}
    return ", ".join(f"{name} {seconds:.1f} s" for name, seconds in found.items()) or "-"


def tf_cell(result: dict, flops: float, gpus: int, published: float) -> str:
    """Predicted TF/GPU by the paper's formula, and how far from the published figure."""
    if "plan" not in result:
        return "-"
    tf = flops / (result["plan"]["totals"]["step_time_s"] * gpus) / 1e12
    return f"{tf:.0f} ({tf / published - 1:+.0%})"


if __name__ == "__main__":
    main()
