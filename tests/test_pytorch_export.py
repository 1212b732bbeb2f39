"""Transformers exported by PyTorch (legacy TorchScript and dynamo exporters) plan and verify.

The committed files in tests/data/ are what each exporter wrote for tests/torch_gpt.py's GPT
(weights left out); the last test exports afresh and is skipped where torch is absent.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

import autopar
from autopar.graph import load_model
from tests.torch_gpt import BATCH, CONFIG, DATA, export

pytest.importorskip("onnxruntime")

EXPORTERS = ("legacy", "dynamo")


def torch_parameter_count(vocab: int, hidden: int, heads: int, seq: int, layers: int) -> int:
    block = (
        2 * 2 * hidden
        + (3 * hidden * hidden + 3 * hidden)
        + (hidden * hidden + hidden)
        + (4 * hidden * hidden + 4 * hidden)
        + (4 * hidden * hidden + hidden)
    )
    return vocab * hidden + seq * hidden + layers * block + 2 * hidden + hidden * vocab


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_exported_gpt_imports_with_every_weight_found(exporter):
    graph = load_model(DATA / f"torch_gpt_{exporter}.onnx")
    trainable = sum(p.numel for p in graph.parameters if p.trainable)
    assert trainable == torch_parameter_count(**CONFIG) == 117504
    kinds = {op.op_type for op in graph.ops}
    assert {"Gather", "LayerNormalization", "MatMul", "Softmax", "Where", "Erf", "SoftmaxCrossEntropyLoss"} <= kinds
    assert graph.tensor("logits").shape == (BATCH, CONFIG["seq"], CONFIG["vocab"])


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_exported_gpt_plans_and_verifies(exporter):
    path = DATA / f"torch_gpt_{exporter}.onnx"
    for mode in ("auto_parallel", "data_parallel"):
        plan = autopar.plan(path, devices=8, mode=mode)
        assert not plan.fallback_ops
        report = autopar.verify(path, plan)
        assert report.ok, (mode, report.problems)
    candidates = autopar.candidates(path, devices=8)
    rng = random.Random(exporter)
    kinds = set()
    for draw in range(8):  # sharded layouts of every operator, not only the cheapest
        strategies = {op: rng.choice(options) for op, options in candidates.items()}
        report = autopar.verify(path, strategies, devices=8, seed=draw)
        assert report.ok, (draw, report.problems)
        kinds |= set(report.executed)
    assert {"AllGather", "AllReduce"} <= kinds


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_fresh_export_plans_and_verifies(exporter, tmp_path: Path):
    pytest.importorskip("torch")
    if exporter == "dynamo":
        pytest.importorskip("onnxscript")
    path = tmp_path / "gpt.onnx"
    export(path, dynamo=exporter == "dynamo")
    plan = autopar.plan(path, devices=8)
    assert not plan.fallback_ops
    report = autopar.verify(path, plan)
    assert report.ok, report.problems
