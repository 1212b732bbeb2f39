"""Plan transformer stacks from models/transformer.py and compare with data parallel.

Usage: python bench/transformers.py [--presets bert-base,gpt2] [--devices 8,64] [--batch 8]
For each preset and device count it prints the wall time of planning, the strategies chosen
for layer 0's attention (Q projection, scores, output projection) and MLP (fc1, fc2), the
predicted step time against data parallel, and the memory per device.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

# run as a script (python bench/transformers.py): the repository first, and this folder off the path, where
# this file would shadow Hugging Face's package of the same name
ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import autopar  # noqa: E402
from autopar.errors import InfeasibleError  # noqa: E402
from models.transformer import build_preset  # noqa: E402

SHOWN = ("layer0.attn.q", "layer0.attn.scores", "layer0.attn.out", "layer0.mlp.fc1", "layer0.mlp.fc2")


def compact(strategy) -> str:
    return str(strategy).replace(" ", "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="bert-base,gpt2")
    parser.add_argument("--devices", default="8,64")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--layers", type=int, default=None, help="override the preset's layer count")
    args = parser.parse_args()
    for preset in args.presets.split(","):
        overrides = {"batch": args.batch} | ({"layers": args.layers} if args.layers else {})
        model = build_preset(preset, **overrides)
        for devices in (int(d) for d in args.devices.split(",")):
            start = time.perf_counter()
            try:
                plan = autopar.plan(model, devices=devices)
            except InfeasibleError as exc:
                print(f"{preset} on {devices} devices: {exc}")
                continue
            seconds = time.perf_counter() - start
            try:
                dp = autopar.plan(plan.problem.graph, devices=devices, mode="data_parallel").objective
                versus = f"data parallel {dp * 1e3:.3f} ms (x{dp / plan.objective:.2f})"
            except InfeasibleError:
                versus = "data parallel does not fit"
            search = plan.to_dict()["search"]
            print(
                f"{preset} batch {args.batch} on {devices} devices: plan {plan.objective * 1e3:.3f} ms vs {versus};"
                f" memory {plan.memory_per_device / 1e9:.2f} GB; planned in {seconds:.1f} s"
                f" (search {search['time_s']:.2f} s over {search['candidates']} candidates)"
            )
            for name in SHOWN:
                print(f"    {name:<22}{compact(plan.strategies[name])}")


if __name__ == "__main__":
    main()
