"""NeMo's long-sequence Llama-2-7B runs, planned by autopar: NeMo's configuration and autopar's own plan.

Usage: python bench/long_sequence.py [--seq 32768] [--devices 32] [--tp 2] [--cp 2] [--batch 8] [--layers 32]
       (NeMo's 128k row: --seq 131072 --devices 128 --tp 4 --cp 4)

NeMo publishes Llama-2-7B pre-training in FP8 on DGX-H100 with context parallelism (docs/source/performance/
performance_long_sequence.md, NeMo 24.03.01): at 32k tokens on 32 GPUs TP 2, PP 1, DP 8, CP 2 reach 610 TFLOPS
per GPU, at 128k on 128 GPUs TP 4, DP 8, CP 4 reach 555 (the global batch is not given: ``--batch``, default
one sequence per data-parallel rank). The model is transformers' Llama at Llama-2-7B's width (hidden 4,096, 32
heads, no grouped-query attention, MLP 11,008, vocabulary 32,000) exported by ``bench/large_exports.py``, its
parameters on the meta device. Two plans on the h100 profile, ``--precision fp8 --optimizer adam``:
- NeMo's configuration in semi-auto: every layer's q, k, v, gate and up products split their weight's columns
  TP ways and the o and down products its rows (Megatron-Core's column- and row-parallel linears, on the
  fastest bits), their activations' sequence CP ways and batch over the rest; the search fills in every other
  operator (attention among them);
- autopar's own plan, nothing fixed.
Both are counted in NeMo's own model FLOPs (its ``llama2`` formula: gbs x seq x layers x hidden^2 x (12 + 12
groups / heads + 18 ffn / hidden + 12 seq / hidden + 6 vocab / (layers x hidden)), full attention counted) per
GPU per second of the predicted step. Needs torch, onnxscript and transformers (the test extra).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from large_exports import export

# bench/transformers.py would shadow Hugging Face's package of that name
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import autopar  # noqa: E402

HIDDEN, HEADS, GROUPS, FFN, VOCAB = 4096, 32, 32, 11008, 32000
PUBLISHED = {(32768, 32): 610.0, (131072, 128): 555.0}  # TFLOPS per GPU with context parallelism
COLUMNS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROWS = ("o_proj", "down_proj")
OPTIONS = {"cost_model": "h100", "optimizer": "adam", "precision": "fp8"}


def nemo_flops(batch: int, seq: int, layers: int) -> float:
    """NeMo's model FLOPs of one step of Llama-2 (its ``llama2`` formula)."""
    ratio = 12 + 12 * GROUPS / HEADS + 18 * FFN / HIDDEN + 12 * seq / HIDDEN + 6 * VOCAB / (layers * HIDDEN)
    return batch * seq * layers * HIDDEN * HIDDEN * ratio


def nemo_strategies(plan: autopar.Plan, data: int, tp: int, cp: int) -> dict[str, tuple[tuple[int, ...], ...]]:
    """Megatron-Core's linears, found by the layer names the exporter left ([batch, sequence, hidden] inputs)."""
    fixed = {}
    for op in plan.file.ops:
        source = op.source or ""
        if op.op_type != "MatMul" or ".layers." not in source:
            continue
        if source.endswith(COLUMNS):
            fixed[op.name] = ((data, cp, 1), (1, tp))
        elif source.endswith(ROWS):
            fixed[op.name] = ((data, cp, tp), (tp, 1))
    return fixed


def timed(path: Path, devices: int, **options: object) -> tuple[autopar.Plan, float]:
    start = time.perf_counter()
    plan = autopar.plan(path, devices=devices, **OPTIONS, **options)
    return plan, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=32768)
    parser.add_argument("--devices", type=int, default=32)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--batch", type=int, default=None, help="global batch (default: the data-parallel degree)")
    parser.add_argument("--layers", type=int, default=32)
    args = parser.parse_args()
    data = args.devices // (args.tp * args.cp)
    batch = args.batch or data
    flops = nemo_flops(batch, args.seq, args.layers)
    published = PUBLISHED.get((args.seq, args.devices))
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "llama2_7b.onnx"
        export("llama2_7b", args.layers, batch, args.seq, path)
        own, own_s = timed(path, args.devices)
        fixed = nemo_strategies(own, data, args.tp, args.cp)
        theirs, theirs_s = timed(path, args.devices, mode="semi_auto_parallel", fixed=fixed)
    print(f"Llama-2-7B, {args.layers} layers, batch {batch} x {args.seq:,} tokens, {args.devices} H100s, FP8")
    print("| plan | step | TFLOPS per GPU (NeMo's formula) | published | planned in |")
    print("|---|---|---|---|---|")
    for name, plan, seconds in (
        (f"NeMo's TP {args.tp} x CP {args.cp} x DP {data} ({len(fixed)} products fixed)", theirs, theirs_s),
        (f"autopar's ({plan_shape(own)})", own, own_s),
    ):
        step = plan.file.totals.step_time_s
        rate = flops / step / args.devices / 1e12
        shown = f"{published:.0f}" if published else "-"
        print(f"| {name} | {step:.3f} s | {rate:.0f} | {shown} | {seconds:.0f} s |", flush=True)


def plan_shape(plan: autopar.Plan) -> str:
    search = plan.to_dict()["search"]
    exact = "exact" if search.get("exact") else f"within {100 * (search.get('gap') or 0):.2f} %"
    return f"{plan.degrees}, {exact}"


if __name__ == "__main__":
    main()
