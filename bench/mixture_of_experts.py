"""Mixtral 8x7B on 64 H100s, as Megatron-Core trains it and as autopar plans it, from Hugging Face's export.

Usage: python bench/mixture_of_experts.py [--layers 32] [--batch 256] [--seq 4096] [--devices 64]
       [--capacity-factor 1.25] [--out FOLDER]

Megatron-Core's MoE guide reports 468 TFLOPS per GPU for Mixtral 8x7B in BF16 on H100s (MCore v0.9), and gives
TP 1 x PP 4 x EP 8 on 64 H100s as its configuration; the global batch of 256 sequences of 4,096 tokens here
is assumed (the guide's example scripts use it). The model is transformers' Mixtral at full width (hidden
4,096, 32 heads, 8 key-value heads, 8 experts of MLP 14,336, top 2, vocabulary 32,000) exported by
``bench/large_exports.py`` (``batched_mm`` experts, parameters on the meta device, the batch a symbol so
that a pipeline can cut it into micro-batches), then written by
`autopar route` as GShard's dispatch (capacity factor 1.25, rows past it dropped, as Megatron's token
dropping does). Two plans on the h100 profile with ``--optimizer adam``, each in a fresh process:

- Megatron-Core's configuration in semi-auto: 4 pipeline stages, every expert product split 8 ways by expert
  (one expert a device, the rest of a stage's 16 devices splitting the slots), every attention projection
  split by the batch alone (TP 1); the search fills in every other operator and the micro-batches;
- autopar's own plan, nothing fixed.

Both are counted in Megatron-LM's own model FLOPs (``num_floating_point_operations`` in its training.py:
12 x batch x seq x layers x hidden^2 x ((1 + groups / heads + seq / hidden) + ffn / hidden x top-k x 3/2
+ vocab / (2 x layers x hidden)), full attention counted) per GPU per second of the predicted step.
Needs torch, onnxscript and transformers (the test extra).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

# large_exports takes bench/ off the path (bench/transformers.py would shadow Hugging Face's package) and
# brings hf_exports' measuring with it
from large_exports import autopar, export, measure

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autopar.graph.experts import route_experts

HIDDEN, HEADS, GROUPS, FFN, EXPERTS, TOP_K, VOCAB = 4096, 32, 8, 14336, 8, 2, 32000
PUBLISHED = 468.0  # TFLOPS per GPU, Megatron-Core MoE guide, MCore v0.9, Mixtral 8x7B BF16 on H100
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
OPTIONS = ("--cost-model", "h100", "--optimizer", "adam", "--format", "json", "--quiet")


def megatron_flops(batch: int, seq: int, layers: int) -> float:
    """Megatron-LM's model FLOPs of one step of a mixture of experts with SwiGLU experts."""
    attention = 1 + GROUPS / HEADS + seq / HIDDEN
    experts = FFN / HIDDEN * TOP_K * 1.5
    return 12 * batch * seq * layers * HIDDEN * HIDDEN * (attention + experts + VOCAB / (2 * layers * HIDDEN))


def megatron_strategies(plan: dict, stage_devices: int, experts: int) -> dict[str, list[list[int]]]:
    """TP 1 and EP ``experts`` within each stage's devices, by the names and layers the plan shows."""
    fixed = {}
    for op in plan["ops"]:
        source, name = op.get("source") or "", op["name"]
        if op["op_type"] == "MatMul" and name.endswith(".experts.expert_outputs"):
            fixed[name] = [[experts, stage_devices // experts, 1], [experts, 1, 1]]
        elif op["op_type"] == "MatMul" and source.endswith(ATTENTION):
            fixed[name] = [[stage_devices, 1, 1], [1, 1]]
    return fixed


def planned(model: Path, devices: int, batch: int, *flags: str) -> tuple[dict | None, str]:
    """The plan (its JSON) and how it was made: wall and CPU seconds, peak memory; or the refusal."""
    where = ("--devices", str(devices), "--batch", str(batch))
    done = measure(autopar("plan", str(model), *where, *OPTIONS, *flags))
    head = f"{done.wall:.1f} s ({done.cpu:.1f} s CPU), {done.rss / 2**30:.1f} GiB"
    if done.code:
        return None, f"{head}, refused: {done.refusal[:200]}"
    return json.loads(done.out), head


def row(name: str, plan: dict | None, how: str, flops: float, devices: int) -> str:
    if plan is None:
        return f"| {name} | | | | {how} |"
    step = plan["totals"]["step_time_s"]
    search = plan["search"]
    exact = "exact" if search.get("exact") else f"within {100 * (search.get('gap') or 0):.2f} %"
    stages = len((plan.get("pipeline") or {}).get("stages") or []) or 1
    micro = (plan.get("memory_plan") or {}).get("micro_batches") or 1
    shape = f"{stages} stage{'s' * (stages > 1)}, {micro} micro-batch{'es' * (micro > 1)}"
    return (
        f"| {name} ({shape}; {exact}) | {step:.3f} s | {flops / step / devices / 1e12:.0f} | {PUBLISHED:.0f} | {how} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--batch", type=int, default=256, help="global batch in sequences")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--devices", type=int, default=64)
    parser.add_argument("--stages", type=int, default=4, help="Megatron-Core's pipeline stages")
    parser.add_argument("--capacity-factor", type=float, default=1.25)
    parser.add_argument("--out", type=Path, help="keep the export, the routed model and the plans in this folder")
    args = parser.parse_args()
    flops = megatron_flops(args.batch, args.seq, args.layers)
    with tempfile.TemporaryDirectory() as scratch:
        folder = args.out or Path(scratch)
        exported = folder / "mixtral.onnx"
        export("mixtral", args.layers, args.batch, args.seq, exported, dynamic_batch=True)
        routed = folder / "mixtral_routed.onnx"
        routed.write_bytes(route_experts(exported, args.capacity_factor).model.SerializeToString())
        own, own_how = planned(routed, args.devices, args.batch)
        theirs, theirs_how = None, "needs autopar's own plan for the operator names"
        if own is not None:
            fixed = megatron_strategies(own, args.devices // args.stages, EXPERTS)
            strategies = folder / "megatron_strategies.json"
            strategies.write_text(json.dumps(fixed))
            semi_auto = ("--mode", "semi_auto_parallel", "--strategies", str(strategies))
            stages = ("--pipeline-stages", str(args.stages))
            theirs, theirs_how = planned(routed, args.devices, args.batch, *semi_auto, *stages)
        if args.out:
            for name, plan in (("own", own), ("megatron", theirs)):
                if plan is not None:
                    (folder / f"plan_{name}.json").write_text(json.dumps(plan))
    print(
        f"Mixtral 8x7B, {args.layers} layers, batch {args.batch} x {args.seq:,} tokens, {args.devices} H100s, BF16,"
        f" capacity factor {args.capacity_factor:g}"
    )
    print("| plan | step | TFLOPS per GPU (Megatron-LM's formula) | published | planned in |")
    print("|---|---|---|---|---|")
    print(row(f"Megatron-Core's TP 1 x PP {args.stages} x EP {EXPERTS}", theirs, theirs_how, flops, args.devices))
    print(row("autopar's own", own, own_how, flops, args.devices))


if __name__ == "__main__":
    main()
