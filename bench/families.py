"""Every model family the project keeps an export of, side by side: planned at 8 and 64 devices, verified at 8.

Usage: python bench/families.py [--families albert,t5,swin,qwen3,bloom,gpt_neox,olmoe,mixtral,deepseek_v3,mamba2,
                                            clip,moe] [--devices 8,64]
                                [--checks forward,gradients,torch]

Each command is the one a user types, run in a fresh process (`hf_exports.measure`):
``autopar plan FILE --devices N --quiet`` for each device count, then ``autopar verify FILE --devices 8``
with nothing more (the forward pass on virtual devices), with ``--gradients`` (the training step on
virtual devices) and with ``--runtime torch`` (the training step on 8 torch.distributed processes).
Printed per command: wall time, CPU time (user and system, its child processes' included: on a
busy machine the steadier figure), peak resident memory (of the largest process: the torch runtime's
8 workers are forked from the command and each has its own), and the predicted step time or the
verdict. The Hugging Face families are the exports kept in tests/data (tests/data/make_exports.py,
bench/hf_exports.py); the mixture of experts is what ``python models/moe.py`` writes by default.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from hf_exports import autopar, measure

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"
EXPORTS = {
    "albert": "hf_albert_dynamo.onnx",
    "t5": "hf_t5_legacy.onnx",
    "swin": "hf_swin_legacy.onnx",
    "qwen3": "hf_qwen3_dynamo.onnx",
    "bloom": "hf_bloom_dynamo.onnx",
    "gpt_neox": "hf_gpt_neox_dynamo.onnx",
    "olmoe": "hf_olmoe_dynamo.onnx",
    "mixtral": "hf_mixtral_dynamo.onnx",
    "deepseek_v3": "hf_deepseek_v3_dynamo.onnx",
    "mamba2": "hf_mamba2_dynamo.onnx",
    "clip": "hf_clip_dynamo.onnx",
}
CHECKS = {"forward": (), "gradients": ("--gradients",), "torch": ("--runtime", "torch")}


def model_file(family: str, folder: Path) -> Path:
    if family in EXPORTS:
        return DATA / EXPORTS[family]
    if family == "moe":
        path = folder / "moe.onnx"
        done = measure([sys.executable, str(ROOT / "models" / "moe.py"), "--out", str(path)])
        if done.code:
            raise SystemExit(f"models/moe.py failed: {done.refusal}")
        return path
    raise SystemExit(f"unknown family {family!r}: choose from {', '.join([*EXPORTS, 'moe'])}")


def said(out: str, start: str) -> str:
    return next((line for line in out.splitlines() if line.startswith(start)), "").strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join([*EXPORTS, "moe"]))
    parser.add_argument("--devices", default="8,64", help="device counts to plan on")
    parser.add_argument("--checks", default=",".join(CHECKS), help="verifications at 8 devices")
    args = parser.parse_args()
    print("| family | command | wall | CPU | peak memory | result |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as folder:
        for family in args.families.split(","):
            path = model_file(family, Path(folder))
            commands = [("plan", "--devices", devices, "--quiet") for devices in args.devices.split(",")]
            commands += [("verify", "--devices", "8", *CHECKS[check]) for check in args.checks.split(",")]
            for command in commands:
                done = measure(autopar(command[0], str(path), *command[1:]))
                if done.code:
                    result = f"refused: {done.refusal[:150]}"
                elif command[0] == "plan":
                    result = said(done.out, "step time:")[:80]
                else:
                    result = said(done.out, "autopar verify:")[:80]
                shown = " ".join(("autopar", command[0], path.name, *command[1:]))
                memory = f"{done.rss / 2**20:,.0f} MiB"
                times = f"{done.wall:.1f} s | {done.cpu:.1f} s"
                print(f"| {family} | `{shown}` | {times} | {memory} | {result} |", flush=True)


if __name__ == "__main__":
    main()
