"""The onnx package's model-zoo CNNs (weights elided): plan at 8 devices, batch 32, and verify.

Verification runs at batch 8 to keep CI quick; `python bench/light_models.py` verifies at 32.
"""

from __future__ import annotations

import pytest

import autopar
from tests.conftest import light_models

MODELS = {path.stem.removeprefix("light_"): path for path in light_models()}


def test_all_nine_files_are_found():
    assert sorted(MODELS) == [
        "bvlc_alexnet",
        "densenet121",
        "inception_v1",
        "inception_v2",
        "resnet50",
        "shufflenet",
        "squeezenet",
        "vgg19",
        "zfnet512",
    ]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_plans_at_batch_32_without_fallbacks_and_verifies(name):
    plan = autopar.plan(MODELS[name], devices=8, batch=32)
    assert plan.fallback_ops == []
    assert plan.problem.graph.tensor(plan.problem.graph.inputs[0]).shape[0] == 32
    dp = autopar.plan(plan.problem.graph, devices=8, mode="data_parallel")
    assert plan.objective <= dp.objective * (1 + 1e-9)
    pytest.importorskip("onnxruntime")
    small = autopar.plan(MODELS[name], devices=8, batch=8)
    report = autopar.verify(MODELS[name], small)
    assert report.ok, report.problems
    assert report.executed == report.planned
