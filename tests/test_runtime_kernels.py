"""Every operator's torch kernel: registered, equal to onnxruntime on one device, right in the backward.

The forward of every bundled and test model in torch must equal onnxruntime's (it stays the
reference for the forward). Each one-operator model of the coverage suite, with its float
inputs made trainable weights, trains on 4 virtual devices under several candidate strategies:
every weight's gradient, reassembled from its shards, equals torch autograd's on one device.
"""

from __future__ import annotations

import random

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import autopar
from autopar.ops.registry import _REGISTRY
from autopar.runtime.single import run_graph
from autopar.spmd.compare import compare_output
from autopar.spmd.reference import reference_outputs
from autopar.spmd.values import materialise
from models.resnet50 import build_resnet50
from models.transformer import build_transformer
from tests.conftest import light_models
from tests.test_ops_coverage import CASES

pytest.importorskip("torch")
pytest.importorskip("onnxruntime")

MODELS = {
    "resnet50": lambda: ("models/resnet50.onnx", 2),
    "tiny_resnet": lambda: (build_resnet50(batch=4, num_classes=16, image_size=32, width=8, blocks=(1, 1, 1, 1)), None),
    "gpt": lambda: (
        build_transformer(kind="gpt", layers=2, hidden=64, heads=8, seq=16, vocab=64, batch=2, weights="random"),
        None,
    ),
    "bert_decomposed_layernorm": lambda: (
        build_transformer(kind="bert", layers=1, hidden=64, heads=8, seq=16, vocab=64, batch=2, layernorm="decomposed"),
        None,
    ),
    "gpt_fused_gelu": lambda: (
        build_transformer(kind="gpt", layers=1, hidden=64, heads=8, seq=16, vocab=64, batch=2, gelu="fused"),
        None,
    ),
    "torch_gpt_dynamo": lambda: ("tests/data/torch_gpt_dynamo.onnx", None),
    "torch_gpt_legacy": lambda: ("tests/data/torch_gpt_legacy.onnx", None),
    **{path.stem: (lambda path=path: (str(path), 1)) for path in light_models()},
}


def test_every_operator_with_a_rule_has_a_torch_kernel():
    missing = sorted(
        f"{op_type} (opset {d.since}+)"
        for (_, op_type), definitions in _REGISTRY.items()
        for d in definitions
        if d.rule is not None and d.torch_kernel is None
    )
    assert not missing
    local = [
        op_type
        for (_, op_type), definitions in _REGISTRY.items()
        for d in definitions
        if d.local_kernel is not None and d.torch_local_kernel is None
    ]
    assert not local, "an operator adjusted on its shards needs the torch twin of that adjustment"


@pytest.mark.parametrize("name", sorted(MODELS))
def test_torch_forward_equals_onnxruntime(name):
    model, batch = MODELS[name]()
    graph = autopar.build(model, 1, batch=batch).graph
    values = materialise(graph, seed=0)
    expected = reference_outputs(graph, values)
    outputs, _ = run_graph(graph, values)
    for output, value in expected.items():
        check = compare_output(output, outputs[output].detach().numpy(), value)
        assert check.ok, check.problem


def trainable_inputs(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model with every float graph input turned into a weight: its gradient is then checked."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    rng = np.random.default_rng(0)
    for value in list(out.graph.input):
        if value.type.tensor_type.elem_type != onnx.TensorProto.FLOAT:
            continue
        shape = [d.dim_value for d in value.type.tensor_type.shape.dim]
        out.graph.initializer.append(numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), value.name))
        out.graph.input.remove(value)
    return out


# Non-differentiable operators and those whose float inputs are configuration only
NO_GRADIENT = {"equal_and_not"}


@pytest.mark.parametrize("case", sorted(set(CASES) - NO_GRADIENT))
def test_operator_gradients_under_candidate_strategies(case):
    model = trainable_inputs(CASES[case]())
    candidates = autopar.candidates(model, devices=4)
    rng = random.Random(case)
    options = candidates["op"]
    draws = options if len(options) <= 6 else [options[0]] + rng.sample(options[1:], 5)
    for draw, strategy in enumerate(draws):
        strategies = {op: (strategy if op == "op" else rng.choice(cands)) for op, cands in candidates.items()}
        report = autopar.verify(model, strategies, devices=4, seed=draw, gradients=True)
        assert report.ok, (strategy, report.problems)
        assert report.gradients is not None and report.gradients.checked >= 1
