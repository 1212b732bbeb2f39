"""Write the plan files of a fixed set of models to a folder, measured times removed, to compare two trees.

Usage: python bench/plan_snapshot.py OUT_DIR [--quick]
then:  diff -r BEFORE_DIR AFTER_DIR   (no output: every plan is byte for byte the same)

The cases are the ones a refactor must leave unchanged: ResNet-50 at 8 and 64 devices (searched,
data parallel and stand-alone), the onnx wheel's nine light models at 8 devices (batch 32), and
transformers from `models/transformer.py` (GPT-2 with 4 layers at 16 devices, BERT with 3 layers at
8, a 4-layer GPT at 16 devices with its blocks folded, GPT-3's shape with 2 layers at 64). Only
the fields that hold wall-clock measurements (``time_s``, ``phases_s``) are dropped.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import onnx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import autopar  # noqa: E402
from models.transformer import build_preset, build_transformer  # noqa: E402

MEASURED = {"time_s", "phases_s"}


def _strip(value: object) -> object:
    if isinstance(value, dict):
        return {k: _strip(v) for k, v in value.items() if k not in MEASURED}
    if isinstance(value, list):
        return [_strip(v) for v in value]
    return value


def cases(quick: bool) -> dict[str, Callable[[], autopar.Plan]]:
    resnet = ROOT / "models" / "resnet50.onnx"
    found: dict[str, Callable[[], autopar.Plan]] = {
        "resnet50_8": lambda: autopar.plan(resnet, devices=8),
        "resnet50_64": lambda: autopar.plan(resnet, devices=64),
        "resnet50_8_dp": lambda: autopar.plan(resnet, devices=8, mode="data_parallel"),
        "resnet50_8_alone": lambda: autopar.plan(resnet, devices=8, mode="stand_alone"),
        "gpt2_4l_16": lambda: autopar.plan(build_preset("gpt2", layers=4), devices=16),
        "bert_3l_8": lambda: autopar.plan(build_transformer(kind="bert", layers=3, hidden=256, heads=4), devices=8),
        "gpt_4l_16": lambda: autopar.plan(
            build_transformer(kind="gpt", layers=4, hidden=256, heads=4, seq=128), devices=16
        ),
    }
    if not quick:
        found["gpt3_2l_64"] = lambda: autopar.plan(build_preset("gpt3", layers=2), devices=64)
        light = sorted((Path(onnx.__file__).parent / "backend" / "test" / "data" / "light").glob("light_*.onnx"))
        for path in light:
            found[path.stem] = lambda path=path: autopar.plan(path, devices=8, batch=32)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--quick", action="store_true", help="ResNet-50 and the small transformers only")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for name, make in cases(args.quick).items():
        data = _strip(make().to_dict())
        (args.out / f"{name}.json").write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        print(name, flush=True)


if __name__ == "__main__":
    main()
