"""Measure a model's training step on a GPU, eager and compiled, beside what autopar predicts for it.

Usage: python bench/gpu_step.py [--kind llama3_8b] [--layers 4] [--batch 2] [--seq 2048] [--steps 10]
                                [--cost-model h200] [--device cuda] [--no-compile] [--tiny]

The model is a Hugging Face configuration of ``bench/large_exports.py`` (default: Llama-3-8B's width with
4 layers: hidden 4,096, 32 heads, 8 key-value heads, MLP 14,336, vocabulary 128,256), random weights in
FP32 on the device, trained as its users train it: BF16 autocast, ``F.scaled_dot_product_attention``
(``attn_implementation="sdpa"``), fused AdamW, gradients set to None between steps. For each execution
(eager, then ``torch.compile`` of the model) it times ``--steps`` steps after three of warm-up, takes the
peak of ``torch.cuda.max_memory_allocated`` over them, and profiles one more step with
``torch.profiler``: each kernel's device time is summed into a class by its name (matrix products,
attention, the loss, the optimizer update, everything else).

The same configuration is exported by torch's dynamo exporter (``large_exports.export``) and planned by
``autopar.plan(FILE, devices=1, cost_model=..., optimizer="adam")``; the plan's operators are summed
into the same classes (a fused attention's operators into attention, the other MatMuls into matrix
products, the loss operators into the loss, the optimizer update from ``totals``), and its step and
memory per device are set beside the measurements. The profiles model fused or compiled kernels, as
Megatron and torchtitan run them: the compiled column is the one to compare.

``--device cpu --tiny`` runs the same code on a small configuration without a GPU (a check that the
script works; its times say nothing about any accelerator). Needs torch, onnxscript and transformers
(the test extra).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

from large_exports import configuration, export

# bench/transformers.py would shadow Hugging Face's package of that name
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autopar.units import human_bytes  # noqa: E402

CLASSES = ("matrix products", "attention", "loss", "optimizer update", "other")
LOSS_OPS = {"SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss", "LogSoftmax"}


def kernel_class(name: str) -> str:
    """The class of a kernel (or, on a CPU, an aten operator) by its name."""
    low = name.lower()
    if any(word in low for word in ("flash", "fmha", "attention", "attn", "sdpa")):
        return "attention"
    if any(word in low for word in ("adam", "multi_tensor", "foreach")):
        return "optimizer update"
    if any(word in low for word in ("cross_entropy", "nll_loss", "log_softmax")):
        return "loss"
    gemm = ("gemm", "cutlass", "xmma", "nvjet", "cublas", "sm80_", "sm90_", "aten::mm", "aten::bmm", "aten::addmm")
    if any(word in low for word in gemm):
        return "matrix products"
    return "other"


def tiny(config):
    """The configuration at a size a CPU trains in seconds."""
    for name, value in (
        ("hidden_size", 64),
        ("num_attention_heads", 4),
        ("num_key_value_heads", 2),
        ("intermediate_size", 128),
        ("vocab_size", 256),
    ):
        setattr(config, name, value)
    return config


def measured(config, batch: int, seq: int, steps: int, device: str, compiled: bool) -> dict:
    """Milliseconds a step (timed), milliseconds per kernel class (one profiled step), peak bytes."""
    import torch
    import transformers as hf

    torch.manual_seed(0)
    config._attn_implementation = "sdpa"
    model = hf.AutoModelForCausalLM.from_config(config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")
    forward = torch.compile(model) if compiled else model
    ids = torch.randint(0, config.vocab_size, (batch, seq), device=device)
    cuda = device == "cuda"

    def step() -> None:
        with torch.autocast(device_type=device, dtype=torch.bfloat16):
            loss = forward(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def synchronize() -> None:
        if cuda:
            torch.cuda.synchronize()

    for _ in range(3):
        step()
    synchronize()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    synchronize()
    step_ms = (time.perf_counter() - start) / steps * 1e3
    peak = torch.cuda.max_memory_allocated() if cuda else None
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as profile:
        step()
        synchronize()
    classes: dict[str, float] = defaultdict(float)
    for row in profile.key_averages():
        if cuda:
            spent = row.self_device_time_total  # kernels' own rows; an operator's row holds no self device time
        else:
            spent = row.self_cpu_time_total if row.key.startswith("aten::") else 0.0
        if spent:
            classes[kernel_class(row.key)] += spent / 1e3  # microseconds to milliseconds
    return {"step_ms": step_ms, "classes": dict(classes), "peak": peak}


def predicted(kind: str, config_of: Callable[[], object], layers: int, batch: int, seq: int, cost_model: str) -> dict:
    """autopar's step, per-class milliseconds and memory per device for the same model on one device."""
    import autopar

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / f"{kind}.onnx"
        export(kind, layers, batch, seq, path, config_of())  # the configuration measured, tiny or not
        plan = autopar.plan(path, devices=1, cost_model=cost_model, optimizer="adam")
    classes: dict[str, float] = defaultdict(float)
    for op in plan.file.ops:
        if op.fused:
            name = "attention"
        elif op.op_type in LOSS_OPS:
            name = "loss"
        elif op.op_type in ("MatMul", "Gemm"):
            name = "matrix products"
        else:
            name = "other"
        classes[name] += op.cost.compute_s * 1e3
    classes["optimizer update"] = plan.file.totals.optimizer_update_s * 1e3
    return {"step_ms": plan.file.totals.step_time_s * 1e3, "classes": dict(classes), "peak": plan.memory_per_device}


def table(runs: dict[str, dict]) -> list[str]:
    """The markdown rows: one column per run, one row per class, then the step and the peak memory."""
    names = list(runs)
    lines = ["| | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for name in CLASSES:
        cells = [f"{runs[run]['classes'].get(name, 0.0):.4g} ms" for run in names]
        lines.append(f"| {name} (kernel time) | " + " | ".join(cells) + " |")
    lines.append("| whole step | " + " | ".join(f"{runs[run]['step_ms']:.4g} ms" for run in names) + " |")
    memory = ["-" if runs[run]["peak"] is None else human_bytes(runs[run]["peak"]) for run in names]
    lines.append("| peak memory | " + " | ".join(memory) + " |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", default="llama3_8b", help="a configuration of bench/large_exports.py")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--cost-model", default="h200")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--no-compile", action="store_true", help="measure eager execution alone")
    parser.add_argument("--tiny", action="store_true", help="a small configuration (a CPU check of the script)")
    args = parser.parse_args()
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_step: no CUDA device here; run it on a GPU, or check it with --device cpu --tiny")

    def config_of():
        config = configuration(args.kind, args.layers, args.seq)
        return tiny(config) if args.tiny else config

    runs = {"measured, eager": measured(config_of(), args.batch, args.seq, args.steps, args.device, False)}
    if not args.no_compile:
        runs["measured, compiled"] = measured(config_of(), args.batch, args.seq, args.steps, args.device, True)
    runs[f"autopar ({args.cost_model})"] = predicted(
        args.kind, config_of, args.layers, args.batch, args.seq, args.cost_model
    )
    device = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    print(
        f"{args.kind}, {args.layers} layers, batch {args.batch} x {args.seq} tokens, on {device}"
        f" (torch {torch.__version__}); {args.steps} steps timed\n"
    )
    print("\n".join(table(runs)))


if __name__ == "__main__":
    main()
